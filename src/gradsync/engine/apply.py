"""A job's result on the training thread: averaged gradients into ``.grad``, the rest kept.

The collective returns the SUM over ranks of the job's tensors (concatenated) and, for sparse
jobs, which of this rank's entries entered it (``kept``). Per tensor of the job:

* ``.grad = sum / P``, in the parameter's dtype;
* error feedback's second half: the residual keeps exactly what was not consumed,
  ``residual = acc`` with the kept positions zeroed (or holding the wire dtype's rounding
  error, when residuals are fp32 and values travel in bf16/fp16), so
  ``acc == sent + residual`` bit for bit
  (``docs/architecture.md``, "Contracts": conservation);
* a tensor of which no entry was kept counts as *missing* (SSFusion Table I);
* with auditing, one :class:`~gradsync.engine.audit.AuditRecord`.
"""

from __future__ import annotations

import torch
from torch import nn

from gradsync.engine.audit import AuditRecord, AuditSink, values_at
from gradsync.engine.jobs import JobResult, Launched, Mode, Transport
from gradsync.engine.stats import StepStats
from gradsync.feedback import ErrorFeedback

__all__ = ["apply"]


def apply(launched: Launched, result: JobResult, params: dict[str, nn.Parameter],
          P: int, ef: ErrorFeedback, stats: StepStats, step: int, audit: AuditSink) -> None:
    """Write the averaged gradients of ``launched`` and update its residuals."""
    job = launched.job
    offset = 0
    bounds = []
    for n in job.names:
        numel = params[n].numel()
        bounds.append((n, offset, offset + numel))
        offset += numel
    # the sum of an all-reduce is this step's own buffer (prepare's concatenation or the
    # all-reduce part's densified selection): divided in place; a collective's may be its own
    avg = (result.dense.div_(P) if job.transport is Transport.ALLREDUCE
           else torch.div(result.dense, P))
    kept = result.kept
    sent = result.sent_values is not None  # auditing
    if kept is not None:
        kept = kept.to(torch.int64)
        # every tensor's start and the job's end: one host-to-device copy
        ends = torch.tensor([b[1] for b in bounds] + [offset], dtype=torch.int64,
                            device=kept.device)
        starts = ends[:-1]
        # sorted kept (what every all-reduce part and most collectives return): each tensor's
        # entries are one slice, found by binary search, instead of one mask per tensor over
        # all of kept (O(tensors · kept), 30 ms per CNN step for a dense all-reduce part).
        # The cuts, "sorted" and "in range" come back to the host in one transfer (each one
        # waits for the queued work on a GPU); in range, every tensor's slice is too, so
        # ErrorFeedback.update need not read each one back again
        probe = torch.searchsorted(kept, ends)
        if kept.numel():
            lo, hi = torch.aminmax(kept)
            probe = torch.cat([probe, torch.stack([(kept[1:] >= kept[:-1]).all(),
                                                   (lo >= 0) & (hi < offset)]).to(probe.dtype)])
            *cuts, ordered, in_range = probe.tolist()
            if not in_range:
                raise ValueError(f"{job.wire}: the collective kept indices outside the job's "
                                 f"[0, {offset})")
        else:
            cuts, ordered = [0] * len(ends), True
        if not ordered:
            cuts = None
        owner = torch.searchsorted(starts, kept, right=True) - 1 if cuts is None else None
        if sent:
            kept_values = values_at(result.sent_indices, result.sent_values, kept)
    for i, (n, lo, hi) in enumerate(bounds):
        p = params[n]
        g = avg[lo:hi].view_as(p).to(p.dtype)
        if p.grad is None:  # a view of this step's averaged buffer: no copy
            p.grad = g
        else:
            p.grad.copy_(g)
        stats.tensors += 1
        stats.numel += hi - lo
        if job.mode is Mode.DENSE:
            stats.selected += hi - lo
            residual = None
            if ef.transforms(n):  # the velocity (or scaled gradient) was sent whole
                acc = launched.accs[n]
                residual = ef.update(n, acc, None, _sent(acc, None, p.dtype))
            if sent:
                acc = launched.audit_accs[n]
                audit.record(AuditRecord(
                    step, n, job.mode.value, job.wire, acc,
                    torch.arange(hi - lo, device=acc.device),
                    result.sent_values[lo:hi].clone(),
                    torch.zeros_like(acc) if residual is None
                    else residual.detach().reshape(-1).clone()))
            continue
        mine = owner == i if cuts is None else slice(cuts[i], cuts[i + 1])
        local = kept[mine] - lo
        whole = local.numel() == hi - lo  # distinct indices: every entry (no index work)
        residual = ef.update(n, launched.accs[n], None if whole else local,
                             _sent(launched.accs[n], None if whole else local, p.dtype),
                             check=False)  # kept is in range: checked above
        stats.selected += int(local.numel())
        stats.missing += int(local.numel() == 0)
        if sent:
            audit.record(AuditRecord(
                step, n, job.mode.value, job.wire, launched.audit_accs[n], local.clone(),
                kept_values[mine].clone(), residual.detach().reshape(-1).clone()))


def _sent(acc: torch.Tensor, local: torch.Tensor | None, dtype: torch.dtype
          ) -> torch.Tensor | None:
    """The values that travelled for ``local`` (all of ``acc`` when None): ``acc``'s rounded to
    the wire dtype, or None when no rounding happened (the residual keeps the rounding)."""
    if acc.dtype == dtype:
        return None
    flat = acc.reshape(-1)
    return (flat if local is None else flat[local]).to(dtype)
