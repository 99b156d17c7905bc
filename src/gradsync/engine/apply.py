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

import itertools
from collections.abc import Hashable, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from gradsync.collectives.comm import Comm
from gradsync.engine.audit import AuditRecord, AuditSink, values_at
from gradsync.engine.jobs import JobResult, Launched, Transport, bounds
from gradsync.engine.stats import StepStats
from gradsync.feedback import ErrorFeedback
from gradsync.sparsegrad import bincount, constant, host_kernels

__all__ = ["agreement_word", "apply", "commit", "job_check", "missing_check", "missing_on_host",
           "settle", "settle_missing"]


def agreement_word(comm: Comm, device: torch.device,
                   wire: Sequence[tuple[torch.Tensor, str]] = (),
                   bad: torch.Tensor | None = None) -> torch.Tensor:
    """The ranks' agreement on a step's checks, made before its one read (the engine's
    ``_settle``, the DDP hook's): one int64 word all-reduced (MAX) on the device through
    ``comm`` (its traffic counted there), 2 when some rank's collective check failed
    (``wire``: a malformed message), else 1 when some rank's ``bad`` (a bool on the device)
    is set, else 0. Nothing is read: the caller reads it with the step's other checks."""
    word = torch.zeros((), dtype=torch.int64, device=device)
    if bad is not None:
        word = bad.reshape(()).to(torch.int64)
    if wire:
        word = torch.where(torch.stack([ok.reshape(()) for ok, _ in wire]).all(), word, 2)
    word = word.reshape(1)
    comm.all_reduce(word, op=dist.ReduceOp.MAX)
    return word[0]


def settle(jobs: Sequence[tuple[Launched, JobResult]], who: str = "",
           flags: Sequence[torch.Tensor] = ()) -> tuple[int, list[bool]]:
    """Before any job of a step is applied: every sparse job's :func:`missing_check` (unless
    its missing tensors are known on the host, ``JobResult.missing``) and its collective's
    device-side checks, read back in one copy with ``flags`` (bools on the
    device, e.g. prepare's deferred finiteness checks) (:func:`settle_missing`).
    Returns the step's missing tensors and the flags' values; ``ValueError`` before any
    ``.grad`` or residual changes when a collective kept a position outside its job or sent a
    malformed message."""
    checks: list[torch.Tensor] = []
    wire: list[tuple[torch.Tensor, str]] = []
    known = 0
    for launched, result in jobs:
        if result.kept is None:  # every entry travelled (an all-reduce)
            continue
        if result.missing is not None:  # kept: this rank's own selection, counted on the host
            known += result.missing
        else:
            checks.append(job_check(launched.sizes, result.kept))
        wire.extend(result.checks)
    missing, values = settle_missing(checks, "the job's buffer", who, wire, flags)
    return known + sum(missing), values


def apply(launched: Launched, result: JobResult, params: dict[str, nn.Parameter],
          P: int, ef: ErrorFeedback, stats: StepStats, step: int, audit: AuditSink) -> None:
    """Write the averaged gradients of ``launched`` and update its residuals, one buffer at a
    time (a fixed number of operations per job, plus the ``.grad`` writes), once
    :func:`settle` has checked the step's jobs (and counted their missing tensors)."""
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
    if result.kept is None:  # every entry travelled: Mode.DENSE, Buffer_AR
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
    residual = commit(ef, launched.index, acc, kept, wire, sent=result.sent_ahead)
    stats.selected += int(kept.numel())
    if result.sent_values is not None:  # auditing
        kept_values = values_at(result.sent_indices, result.sent_values, kept)
        for n, lo, hi in spans:
            mine = (kept >= lo) & (kept < hi)
            audit.record(AuditRecord(
                step, n, job.mode.value, job.wire, launched.audit_acc[lo:hi],
                kept[mine] - lo, kept_values[mine].clone(), residual[lo:hi].clone()))


def commit(ef: ErrorFeedback, key: Hashable, acc: torch.Tensor, kept: torch.Tensor | None,
           wire: torch.dtype, whole: int = 0, sent: torch.Tensor | None = None
           ) -> torch.Tensor:
    """Error feedback's second half for one sparse job (the engine's, the DDP hook's): the
    positions ``kept`` of ``acc`` (None, or all of them: every entry) travelled in ``wire``;
    the residual keeps the rest and the rounding. ``whole``: the first ``whole`` entries
    travelled too (an all-reduce part of the same buffer, the DDP hook's SSFusion-I), ``kept``
    counting from there. ``sent``: the values that travelled at ``kept`` where they were not
    ``acc``'s (momentum sent ahead: ``JobResult.sent_ahead``), the residual keeping
    ``acc − sent`` there. Returns the new residual."""
    if sent is not None and kept is not None:
        head = acc[:whole].to(wire) if whole else None
        return ef.update_buffer(key, acc, kept, sent if head is None else torch.cat([head, sent]),
                                whole=whole)
    every = kept is None or kept.numel() == acc.numel() - whole  # distinct: no index work
    if every:
        sent = None if acc.dtype == wire else acc.to(wire)
        return ef.update_buffer(key, acc, None, sent)
    sent = None
    if acc.dtype != wire:  # the values as they travelled: the rounding stays behind
        tail = acc[whole:][kept]
        sent = (torch.cat([acc[:whole], tail]) if whole else tail).to(wire)
    return ef.update_buffer(key, acc, kept, sent, whole=whole)


def missing_on_host(kept: torch.Tensor, sizes: Sequence[int]) -> int | None:
    """How many of a job's tensors (``sizes`` entries each, in order) hold none of the
    positions ``kept``, counted on the host where the CPU's own kernels run and the positions
    increase inside the buffer (a selection's: :func:`prepare.select` counts a fused job's
    right after selecting it, while its positions are warm, instead of :func:`job_check`
    after the collective); None elsewhere."""
    if not host_kernels(kept):
        return None
    if not kept.numel():
        return len(sizes)
    counted = _missing_sorted(kept.numpy(), *_starts(sizes))
    return None if counted is None or not counted[0] else counted[1]


def job_check(sizes: Sequence[int], kept: torch.Tensor) -> torch.Tensor:
    """:func:`missing_check` of a job whose tensors hold ``sizes`` entries, in order."""
    return missing_check(kept.to(torch.int64), *_starts(sizes))


def _starts(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Where each of a job's tensors (``sizes`` entries each, in order) starts in its buffer,
    and the buffer's length."""
    ends = list(itertools.accumulate(sizes))
    return [0, *ends[:-1]] if ends else [], ends[-1] if ends else 0


def missing_check(kept: torch.Tensor, starts: list[int], numel: int) -> torch.Tensor:
    """On the device, no read: ``[in_range, missing]`` (int64) for the positions ``kept`` of a
    buffer of ``numel`` entries whose tensors start at ``starts`` (ascending, the last one
    ending at ``numel``; positions before ``starts[0]`` belong to none): whether every position
    lies in ``[0, numel)``, and how many tensors have none (SSFusion Table I's missing
    tensors). :func:`settle_missing` reads a step's checks at once."""
    dev = kept.device
    if not kept.numel():
        return torch.tensor([1, len(starts)], dtype=torch.int64, device=dev)
    if host_kernels(kept):  # the CPU's own kernels: increasing positions by bisection
        counted = _missing_sorted(kept.numpy(), starts, numel)
        if counted is not None:
            return torch.tensor(counted, dtype=torch.int64)
    lo, hi = torch.aminmax(kept)
    in_range = ((lo >= 0) & (hi < numel)).to(torch.int64)
    if not starts:
        return torch.stack([in_range, in_range * 0])
    at = constant(tuple(starts), torch.int64, dev)
    owner = torch.searchsorted(at, kept, right=True)  # 0: before the first tensor
    per = bincount(owner.clamp_(max=len(starts)), len(starts) + 1)
    return torch.stack([in_range, (per[1:] == 0).sum()])


def _missing_sorted(kept: np.ndarray, starts: list[int], numel: int) -> list[int] | None:
    """:func:`missing_check` of strictly increasing positions (a selection's, TopkA's ``kept``),
    on the host: the extremes are the first and last, and each tensor's count is the distance
    between the bisections of its bounds, in one call over the tensors' starts (a step's six
    operations over the positions took 0.13 ms on the CPU for 4,216 of them; this, a few µs).
    None when the positions do not increase: the caller counts them as any others."""
    if kept.size > 1 and not (kept[1:] > kept[:-1]).all():
        return None
    in_range = int(kept[0] >= 0 and kept[-1] < numel)
    if not starts:
        return [in_range, 0]
    edges = np.searchsorted(kept, [*starts, numel])  # a tensor: [starts[i], next start)
    return [in_range, int((edges[1:] == edges[:-1]).sum())]


def settle_missing(checks: list[torch.Tensor], what: str, who: str = "",
                   wire: Sequence[tuple[torch.Tensor, str]] = (),
                   flags: Sequence[torch.Tensor] = ()) -> tuple[list[int], list[bool]]:
    """The missing tensors of a step's :func:`missing_check` results, read back with the
    collectives' device-side checks (``wire``: ``(ok, message)``, ``Collective.__call__``'s
    ``deferred``) and the caller's ``flags`` in one copy (on a GPU each read waits for the
    queued work). Returns each check's missing tensors and the flags' values. ``ValueError``
    with the first failed ``wire`` message, or (``who``, then ``what``) when a collective kept a
    position outside its buffer instead of it being dropped."""
    parts = [torch.stack(checks).view(-1)] if checks else []
    bools = [ok.reshape(()) for ok, _ in wire] + [f.reshape(()) for f in flags]
    if bools:
        parts.append(torch.stack(bools).to(torch.int64))
    if not parts:
        return [], []
    values = (torch.cat(parts) if len(parts) > 1 else parts[0]).tolist()
    n, w = 2 * len(checks), len(wire)
    for ok, (_, message) in zip(values[n:n + w], wire):
        if not ok:
            raise ValueError(message)
    if any(not ok for ok in values[0:n:2]):
        raise ValueError(f"{who}the collective kept positions outside {what}")
    return values[1:n:2], [bool(v) for v in values[n + w:]]


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
