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
from gradsync.engine.jobs import JobResult, Launched, Mode, Transport, bounds
from gradsync.engine.stats import StepStats
from gradsync.feedback import ErrorFeedback

__all__ = ["apply", "count_missing"]


def apply(launched: Launched, result: JobResult, params: dict[str, nn.Parameter],
          P: int, ef: ErrorFeedback, stats: StepStats, step: int, audit: AuditSink) -> None:
    """Write the averaged gradients of ``launched`` and update its residuals, one buffer at a
    time (a fixed number of operations per job, plus the ``.grad`` writes)."""
    job, acc = launched.job, launched.acc
    spans = bounds(job.names, launched.sizes)
    offset = spans[-1][2]
    # the sum of an all-reduce is this step's own buffer (prepare's concatenation or the
    # all-reduce part's densified selection): divided in place; a collective's may be its own
    # every .grad views the job's storage: one write for all of them
    if launched.storage is not None:
        avg = torch.div(result.dense, P, out=launched.storage)
    else:
        avg = (result.dense.div_(P) if job.transport is Transport.ALLREDUCE
               else torch.div(result.dense, P))
        _write_grads(params, spans, avg)
    stats.tensors += len(spans)
    stats.numel += offset
    wire = avg.dtype
    if job.mode is Mode.DENSE:
        stats.selected += offset
        residual = None
        if acc is not None:  # the velocity (or scaled gradient) was sent whole
            residual = ef.update_buffer(launched.index, acc, None,
                                        None if acc.dtype == wire else acc.to(wire))
        if result.sent_values is not None:  # auditing
            for n, lo, hi in spans:
                a = launched.audit_acc[lo:hi]
                audit.record(AuditRecord(
                    step, n, job.mode.value, job.wire, a, torch.arange(hi - lo, device=a.device),
                    result.sent_values[lo:hi].clone(),
                    torch.zeros_like(a) if residual is None else residual[lo:hi].clone()))
        return
    kept = result.kept.to(torch.int64)
    missing = count_missing(kept, [lo for _, lo, _ in spans], offset, "the job's",
                            f"{job.wire}: ")
    whole = kept.numel() == offset  # distinct indices: every entry (no index work)
    sent = None if acc.dtype == wire else (acc if whole else acc[kept]).to(wire)
    residual = ef.update_buffer(launched.index, acc, None if whole else kept, sent)
    stats.selected += int(kept.numel())
    stats.missing += int(missing)
    if result.sent_values is not None:  # auditing
        kept_values = values_at(result.sent_indices, result.sent_values, kept)
        for n, lo, hi in spans:
            mine = (kept >= lo) & (kept < hi)
            audit.record(AuditRecord(
                step, n, job.mode.value, job.wire, launched.audit_acc[lo:hi],
                kept[mine] - lo, kept_values[mine].clone(), residual[lo:hi].clone()))


def count_missing(kept: torch.Tensor, starts: list[int], numel: int, what: str,
                  who: str = "") -> int:
    """How many of the tensors that start at ``starts`` (ascending, the last one ending at
    ``numel``) have no position in ``kept`` (SSFusion Table I's missing tensors); positions
    before ``starts[0]`` belong to none. A position outside ``[0, numel)`` raises
    ``ValueError`` (``who``, then ``what``) instead of being dropped. Range check and count
    come back to the host in one read (on a GPU each read waits for the queued work)."""
    if not kept.numel():
        return len(starts)
    lo, hi = torch.aminmax(kept)
    checks = [(lo >= 0) & (hi < numel)]
    if starts:
        at = torch.tensor(starts, dtype=torch.int64, device=kept.device)
        owner = torch.searchsorted(at, kept, right=True)  # 0: before the first tensor
        counts = torch.bincount(owner.clamp_(max=len(starts)), minlength=len(starts) + 1)
        checks.append((counts[1:] == 0).sum())
    in_range, *missing = torch.stack(checks).tolist()
    if not in_range:
        raise ValueError(f"{who}the collective kept positions outside {what} [0, {numel})")
    return int(missing[0]) if missing else 0


def _write_grads(params: dict[str, nn.Parameter], spans: list[tuple[str, int, int]],
                 avg: torch.Tensor) -> None:
    """``.grad = avg`` per tensor: copied into an existing ``.grad``, else a view of ``avg``."""
    for n, lo, hi in spans:
        p = params[n]
        g = avg[lo:hi].view_as(p)
        if g.dtype != p.dtype:
            g = g.to(p.dtype)
        if p.grad is None:  # a view of this step's averaged buffer: no copy
            p.grad = g
        else:
            p.grad.copy_(g)
