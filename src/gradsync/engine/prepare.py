"""A job on the training thread: error feedback, then selective sparsification (SSFusion §IV-B,
§IV-C).

For every tensor of the job, as soon as the job's tensors are all ready:

1. **Non-finite check**, the same on every device and the DDP hook's
   (:mod:`gradsync.engine.pipeline`): one flag per job, left on the device. A job whose
   gradients hold a NaN/Inf accumulates as zeros (:func:`accumulate`), so no NaN enters a
   residual or a selection; the engine reads every job's flag with the step's other checks,
   once per step, and the ranks agree on the step's fate (``Config.nonfinite``), naming the
   culprits from the gradients only then. Only the kernel that zeroes differs
   (:func:`~gradsync.sparsegrad.zero_unless`).
   Dense jobs skip the check: the gradient (or its velocity, still pending) travels as it is,
   its NaN/Inf shows in the all-reduced sum on every rank, which the engine checks once, and a
   skipped step discards the pending velocity.
2. **Error feedback.** ``acc = residual + gradient`` (DGC's momentum correction when
   ``Config.momentum`` > 0), in the residual dtype (fp32 for 16-bit gradients by default);
   dense jobs skip it and send the raw gradient, unless ``Config.momentum`` > 0 (they send the
   velocity: a tensor sent whole keeps its momentum, ``gradsync.feedback``) or the tensor has a
   preconditioning scale (:meth:`GradSync.precondition`: the scaled one). Values travel
   in the gradient's dtype (``Payload.wire_dtype``); the rounding stays in the residual.
3. **Selection**, as the plan decided:

   * ``fused`` (multi-tensor): the concatenated accumulators are sparsified as one vector at
     the buffer's density — a small tensor may lose every entry ("tensor missing");
   * ``per_tensor`` (SSFusion §IV-B): each tensor is sparsified on its own at the density the
     planner gave it (the target density, or lower where density-aware compensation pays for
     the tensors selective sparsification excluded); an excluded tensor travels whole (its
     values, at the front of the job: the selection's dense prefix); a tensor SSFusion-O
     offloads (§IV-C) goes to the worker thread and travels as a future that the
     communication thread waits for. Under ``Config.budget="pooled"`` (the SSFusion family's
     default, ours) the tensors it sparsifies are selected as one vector with the entries
     their densities give them together, Σ k_i: which of them sends what follows the
     accumulators each step, as TopkA's global top-k does, and the tensors excluded still
     travel whole.

The selections make no finiteness read of their own (``Sparsifier.select``'s ``checked``):
step 1 checked the gradients, and an accumulator that overflowed (finite gradient and residual,
infinite sum) is selected as it is, so its Inf reaches the collective's sum, alike on every
rank, where the engine checks every sum and applies the non-finite policy on every rank (a
selection that raised did so on one rank alone).

Only step 3 counts as inline sparsification time.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gradsync import sparsify
from gradsync.collectives import Collective
from gradsync.engine.apply import missing_on_host
from gradsync.engine.jobs import Job, Mode, Payload, Transport, bounds
from gradsync.feedback import ErrorFeedback, clip_local
from gradsync.sparsegrad import SparseGrad, finite_flag, host_kernels, iota, target_k, zero_unless
from gradsync.sparsify import segments

__all__ = ["Prepared", "accumulate", "carry", "carry_message", "prepare", "select",
           "shows_alike"]

Sparsifiers = Callable[[str, float], sparsify.Sparsifier]  # (key, density) -> its sparsifier
Offload = Callable[[sparsify.Sparsifier, torch.Tensor, int], Future]  # Executor.offload


@dataclass
class Prepared:
    """A job ready for the communication thread: its payload and what stays behind."""

    acc: torch.Tensor | None  # the accumulated gradients, flat, in the job's order (None: a
    # dense job that carries the raw gradients, with nothing in error feedback)
    payload: Payload
    sparsify_s: float  # inline selection time
    # whether the job's gradients were all finite, a bool on the device that the engine reads
    # with the step's other checks (None: a dense job, whose sum shows a NaN/Inf)
    finite: torch.Tensor | None = None


def prepare(job: Job, index: Hashable, grad: torch.Tensor, sizes: Sequence[int],
            ef: ErrorFeedback, sparsifier: Sparsifiers, offload: Offload | None, step: int,
            clip: tuple[float, int] | None = None, reuse: bool = True) -> Prepared:
    """Steps 1–3 above for one job, one buffer at a time: ``grad`` is the job's gradients,
    flat and concatenated in its order (``sizes`` entries each); error feedback keeps the job
    as one buffer keyed ``index`` (the job's position in the plan; the DDP hook's bucket)
    (:meth:`~gradsync.feedback.ErrorFeedback.accumulate_buffer`). ``offload``: SSFusion-O's
    worker (None: the job offloads nothing). ``clip``: ``(Config.clip_norm, P)``, DGC's local
    clipping of what enters error feedback. ``reuse``: ``grad`` is the caller's to give away (a
    dense job then sums in it, in place); otherwise it is copied first (the engine's gradient
    storage: the local gradients stay for the message that names a non-finite one). The DDP
    hook runs steps 2 and 3 itself (:func:`accumulate` once per bucket, :func:`select` per
    job), its check made once per bucket and left on the device."""
    # a plain all-reduce carries the gradient (or its velocity) as it is: a NaN/Inf shows in the
    # sum on every rank (GradSync.synchronize checks the sums, and a pending velocity is then
    # discarded), so no pass over it here
    dense = job.mode is Mode.DENSE
    # the check stays on the device (module doc, step 1): a buffer that holds a NaN/Inf
    # accumulates as zeros, and the engine reads the flag with the step's other checks
    if job.offload and offload is None:
        raise ValueError(f"prepare: job {index!r} offloads {sorted(job.offload)[:3]} and no "
                         "worker was given")
    finite = None if dense else finite_flag(grad)
    wire = grad.dtype  # values travel in the gradients' dtype
    # dense jobs with momentum keep a velocity (feedback.py: sent whole); a scale
    # (GradSync.precondition) applies to every path
    if dense and not any(ef.transforms(n) for n in job.names):
        return Prepared(None, Payload(dense=grad if reuse else grad.clone()), 0.0)
    acc = accumulate(index, job.names, sizes, grad, ef, clip, finite)
    payload, seconds = select(job, index, acc, sizes, sparsifier, offload, step, wire,
                              lead=ef.lead(index))
    return Prepared(acc, payload, seconds, finite)


def accumulate(key: Hashable, names: Sequence[str], sizes: Sequence[int], grad: torch.Tensor,
               ef: ErrorFeedback, clip: tuple[float, int] | None = None,
               finite: torch.Tensor | None = None) -> torch.Tensor:
    """Step 2 for a buffer of tensors (one job's, or the DDP hook's bucket of several): the
    gradients clipped (``clip``, see :func:`prepare`), ``acc`` = error feedback's accumulator
    (:meth:`~gradsync.feedback.ErrorFeedback.accumulate_buffer`, keyed ``key``), zeroed in
    one operation where ``finite`` (step 1's deferred check) is False."""
    if clip is not None:  # the gradients that enter error feedback, clipped (one call)
        grad = torch.cat(clip_local(list(grad.split(list(sizes))), *clip))
    acc = ef.accumulate_buffer(key, names, sizes, grad)
    if finite is not None:  # acc is new (or the pending velocity, discarded on such a step)
        zero_unless(finite, acc)
    return acc


def carry(values: torch.Tensor, finite: torch.Tensor | None) -> torch.Tensor | None:
    """The non-finite rule's flag carried in a message (the engine's jobs whose checks show
    alike on every rank, the DDP hook's buckets): ``values[0] /= finite``, 0/0 — a NaN — where
    the gradients were not finite (:func:`accumulate` zeroed them, so the selection holds
    zeros), x/1 = x exactly where they were. Every rank's sum then shows one rank's NaN with
    no agreement collective and nothing read. Returns the flag still to carry: ``finite``
    when ``values`` is empty (another part of the message must carry it), else None."""
    if finite is None or not values.numel():
        return finite
    values[:1].div_(finite)
    return None


def carry_message(sel: SparseGrad, finite: torch.Tensor | None) -> SparseGrad:
    """:func:`carry` for a whole message: one with no entry (a threshold's selection of the
    zeros :func:`accumulate` left) is replaced, where the CPU's kernels run (reading the flag
    is free there), by one entry of its own, position 0, holding the NaN (the step fails on
    every rank: its error feedback stays). A message with a capacity holds entries anyway."""
    rest = carry(sel.values, finite)
    if rest is None or not host_kernels(sel.values) or bool(rest):
        return sel
    return SparseGrad(torch.zeros(1, dtype=sel.indices.dtype),
                      torch.full((1,), float("nan"), dtype=sel.dtype), sel.numel, validate=False)


def shows_alike(collective: Collective, sel: SparseGrad | None,
                group: dist.ProcessGroup | None) -> bool:
    """Whether ``collective``'s result for the message ``sel`` shows a malformed message and a
    rank's NaN (:func:`carry_message`) alike on every rank, so that the step needs no agreement
    word for it: every rank decodes every message (``Collective.alike``), and a rank whose
    gradients were not finite sends an entry to carry its NaN: the message has a capacity
    (``SparseGrad.capacity``, alike on every rank by the shape check: it holds entries, zeros)
    or the CPU's kernels run (:func:`carry_message`). The one rule of the engine
    (``JobResult.alike``) and the DDP hook."""
    return (sel is not None and (sel.capacity is not None or host_kernels(sel.values))
            and collective.alike(sel, group))


def select(job: Job, index: Hashable, acc: torch.Tensor, sizes: Sequence[int],
           sparsifier: Sparsifiers, offload: Offload | None, step: int, wire: torch.dtype,
           writable: bool = False, lead: tuple[torch.Tensor, float] | None = None
           ) -> tuple[Payload, float]:
    """Step 3 for one job whose accumulator is ``acc`` (flat, in the job's order): its payload,
    values in ``wire``, and the inline selection time. ``writable``: an all-reduce may sum in
    ``acc`` itself (error feedback zeroes what it sent:
    :meth:`~gradsync.feedback.ErrorFeedback.writable`); otherwise it sums in a copy.
    ``lead``: the job's pending velocity and factor when its selected entries are sent ahead
    (:meth:`~gradsync.feedback.ErrorFeedback.lead`; :attr:`Payload.lead`)."""
    t0 = time.perf_counter()
    if job.mode is Mode.DENSE or job.transport is Transport.ALLREDUCE:  # SSFusion-I's
        # Buffer_AR and a warm-up step at density 1 send every entry: the buffer as it is, no
        # selection to build; in a copy unless writable (acc may be the pending velocity)
        keep = writable and acc.dtype == wire
        return Payload(dense=acc if keep else acc.to(wire, copy=True)), time.perf_counter() - t0
    if job.mode is Mode.FUSED:
        sp = sparsifier(f"buffer:{index}", job.density)
        sel = sparsify.select_each([(sp, acc)], step, checked=True)[0]  # module doc
        # its tensors with no entry, counted now where that costs no read (the CPU's own
        # kernels), while the positions are warm: after the collective's wait they were cold
        payload = Payload(selections=[sel], wire_dtype=wire,
                          missing=missing_on_host(sel.indices, sizes),
                          lead=_lead(lead, sizes, job.lead_share))
    elif job.pools:  # Config.budget "pooled": which tensor's entries travel follows the
        # accumulators; missing tensors are counted from what the collective kept
        # (apply.job_check)
        payload = Payload(selections=_select_pooled(job, acc, sizes, sparsifier, offload, step),
                          wire_dtype=wire, lead=_lead(lead, sizes, job.lead_share))
    else:
        parts: list[SparseGrad | Future | None] = []
        inline: list[tuple[int, sparsify.Sparsifier, int, int]] = []
        first_inline = None
        whole: list[int] = []  # the current run of tensors sent whole: [lo, hi)
        for n, lo, hi in bounds(job.names, sizes):
            d = job.densities[n]
            if d is None:  # excluded from sparsification: every entry travels; a run of
                # them is one part (one arange, not one per tensor), made when the run ends
                if whole:
                    whole[1] = hi
                else:
                    whole = [lo, hi]
                    parts.append(None)
                continue
            if whole:
                parts[-1], whole = _sent_whole(acc, *whole), []
            if n in job.offload:  # SSFusion-O
                parts.append(offload(sparsifier(n, d), acc[lo:hi], step))
            else:  # selected below, as one buffer where that pays (no slice per tensor)
                first_inline = lo if first_inline is None else first_inline
                inline.append((len(parts), sparsifier(n, d), lo, hi))
                parts.append(None)
        if whole:
            parts[-1] = _sent_whole(acc, *whole)
        parts, empty = _select_inline(parts, inline, acc, first_inline, step)
        # a tensor sent whole is never missing; an offloaded one's count is the worker's
        payload = Payload(selections=parts, wire_dtype=wire,
                          missing=None if job.offload else empty,
                          lead=_lead(lead, sizes, job.lead_share))
    return payload, time.perf_counter() - t0


def _select_pooled(job: Job, acc: torch.Tensor, sizes: Sequence[int], sparsifier: Sparsifiers,
                   offload: Offload | None, step: int) -> list[SparseGrad | Future]:
    """A pooled per-tensor job's parts (:attr:`Job.pools`): its tensors sent whole as one
    (they come first: plan_jobs), then per pool one selection of K = Σ k(n_i, d_i) entries,
    the plan's, over the accumulators of its tensors (a pool of one: that tensor's own
    sparsifier), on the worker where one of them is offloaded (SSFusion-O)."""
    spans = list(bounds(job.names, sizes))
    first = len(spans) - sum(job.pools)  # plan_jobs puts the pools last
    whole = spans[first][1] if first < len(spans) else acc.numel()
    parts: list[SparseGrad | Future] = [_sent_whole(acc, 0, whole)] if whole else []
    for a, b in itertools.pairwise(itertools.accumulate(job.pools, initial=first)):
        pool = spans[a:b]
        k = sum(target_k(hi - lo, job.densities[n]) for n, lo, hi in pool)
        start, end = pool[0][1], pool[-1][2]
        if end == start:  # empty tensors only: nothing to select
            continue
        sp = (sparsifier(f"pooled:{pool[0][0]}", k / (end - start)) if len(pool) > 1
              else sparsifier(pool[0][0], job.densities[pool[0][0]]))  # as unpooled
        if offload is not None and any(n in job.offload for n, _, _ in pool):
            parts.append(offload(sp, acc[start:end], step))
        else:
            parts.append(sparsify.select_each([(sp, acc[start:end])], step, checked=True)[0])
    return parts


def _lead(lead: tuple[torch.Tensor, float] | None, sizes: Sequence[int], share: float
          ) -> tuple[torch.Tensor, float, tuple[int, ...]] | None:
    """:attr:`Payload.lead`: the velocity and factor (times the job's ``share`` in force,
    :attr:`Job.lead_share`) with the job's tensors' sizes."""
    return None if lead is None else (lead[0], lead[1] * share, tuple(sizes))


def _sent_whole(acc: torch.Tensor, lo: int, hi: int) -> SparseGrad:
    """``acc[lo:hi]`` as a selection of every entry (a dense prefix: values without
    indices on TopkA's wire)."""
    n = hi - lo  # its indices: a view of a cached arange (sparsegrad.iota), never written
    return SparseGrad(iota(n, acc.device), acc[lo:hi], n, validate=False,
                      dense_prefix=n, capacity=n)


def _select_inline(parts: list, inline: list[tuple[int, sparsify.Sparsifier, int, int]],
                   acc: torch.Tensor, first: int | None, step: int) -> tuple[list, int]:
    """Fill ``parts``' inline selections. The inline tensors come last (plan_jobs puts the
    tensors sent whole first; an offloaded one may sit between them): when they are one run,
    they are selected as one buffer, every tensor at its own k, in a number of operations
    independent of their count, and one read (:func:`gradsync.sparsify.segments.select_buffer`;
    a lone tensor too: DGC tensor by tensor reads once per adjustment round); otherwise,
    or on the CPU (:func:`~gradsync.sparsify.segments.pays_on`), or for a sparsifier without a
    segmented form, tensor by tensor. ``inline``: ``(part, sparsifier, lo, hi)`` of each, its
    entries ``acc[lo:hi]``; ``first``: the first one's ``lo``. Also returns how many of them
    selected no entry (each count is on the host: ``last_count``, a selection's size)."""
    at = len(parts) - len(inline)
    if (inline and [i for i, *_ in inline] == list(range(at, len(parts)))
            and segments.pays_on(acc.device)):  # one tensor too: DGC's own rounds read each
        one = sparsify.select_buffer([sp for _, sp, _, _ in inline], acc[first:],
                                     [hi - lo for _, _, lo, hi in inline], step,
                                     checked=True)  # prepare's own check read the gradients
        if one is not None:
            return [*parts[:at], one], sum(sp.last_count == 0 for _, sp, _, _ in inline)
    chosen = sparsify.select_each([(sp, acc[lo:hi]) for _, sp, lo, hi in inline], step,
                                  checked=True)
    for (i, *_), sel in zip(inline, chosen):
        parts[i] = sel
    return parts, sum(len(sel) == 0 for sel in chosen)
