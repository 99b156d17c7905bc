"""A job on the training thread: error feedback, then selective sparsification (SSFusion §IV-B,
§IV-C).

For every tensor of the job, as soon as the job's tensors are all ready:

1. **Non-finite check.** A gradient holding NaN/Inf is replaced by zeros, so it never enters a
   residual; the ranks agree on the step's fate after the collectives (``Config.nonfinite``).
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
     communication thread waits for.

Only step 3 counts as inline sparsification time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from gradsync import sparsify
from gradsync.engine.jobs import Job, Mode, Payload
from gradsync.feedback import ErrorFeedback, clip_local
from gradsync.sparsegrad import SparseGrad, all_finite_each
from gradsync.sparsify import segments

__all__ = ["Prepared", "prepare"]

Sparsifiers = Callable[[str, float], sparsify.Sparsifier]  # (key, density) -> its sparsifier
Offload = Callable[[sparsify.Sparsifier, torch.Tensor, int], Future]  # Executor.offload


@dataclass
class Prepared:
    """A job ready for the communication thread: its payload and what stays behind."""

    accs: dict[str, torch.Tensor]  # per tensor: the accumulated gradient (flat)
    nonfinite: list[str]  # tensors whose gradient held NaN/Inf
    payload: Payload
    sparsify_s: float  # inline selection time


def prepare(job: Job, index: int, grads: dict[str, torch.Tensor], ef: ErrorFeedback,
            sparsifier: Sparsifiers, offload: Offload, step: int,
            clip: tuple[float, int] | None = None) -> Prepared:
    """Steps 1–3 above for job ``index`` of the plan; ``grads`` are the flat gradients.
    ``clip``: ``(Config.clip_norm, P)``, DGC's local clipping of what enters error feedback."""
    # a plain all-reduce carries the gradient (or its velocity) as it is: a NaN/Inf shows in the
    # sum on every rank (GradSync.synchronize checks the sums, and a pending velocity is then
    # discarded), so no per-tensor pass here
    dense = job.mode is Mode.DENSE
    nonfinite = [] if dense else [
        n for n, ok in zip(job.names, all_finite_each([grads[n] for n in job.names])) if not ok]
    if clip is not None:  # the gradients that enter error feedback, clipped in one call
        into = [n for n in job.names if n not in nonfinite and (not dense or ef.transforms(n))]
        grads = {**grads, **dict(zip(into, clip_local([grads[n] for n in into], *clip)))}
    accs: dict[str, torch.Tensor] = {}
    for n in job.names:
        g = grads[n]
        if n in nonfinite:
            # never enters a residual; the step is agreed later. A dense job carries one NaN
            # for it instead: the all-reduce's sum then shows every rank that some rank had a
            # non-finite gradient, with no agreement collective (sync.GradSync.synchronize)
            accs[n] = torch.zeros_like(g)
            if job.mode is Mode.DENSE:
                accs[n].view(-1)[:1] = float("nan")
        elif dense and not ef.transforms(n):
            accs[n] = g
        else:  # dense jobs with momentum keep a velocity (feedback.py: sent whole); a scale
            # (GradSync.precondition) applies to every path
            accs[n] = ef.accumulate(n, g, check=False)  # checked just above
    wire = grads[job.names[0]].dtype  # values travel in the gradients' dtype
    t0 = time.perf_counter()
    if job.mode is Mode.DENSE:
        payload = Payload(dense=torch.cat([accs[n].to(grads[n].dtype) for n in job.names]))
    elif job.mode is Mode.FUSED:
        flat = torch.cat([accs[n] for n in job.names])
        sp = sparsifier(f"buffer:{index}", job.density)
        payload = Payload(selections=[sp.select(flat, step)], wire_dtype=wire)
    else:
        parts: list[SparseGrad | Future | None] = []
        inline: list[tuple[int, sparsify.Sparsifier, torch.Tensor]] = []
        for n in job.names:
            d = job.densities[n]
            if d is None:  # excluded from sparsification: every entry travels
                parts.append(SparseGrad(torch.arange(accs[n].numel(), device=accs[n].device),
                                        accs[n], accs[n].numel(), validate=False,
                                        dense_prefix=accs[n].numel()))
            elif n in job.offload:  # SSFusion-O
                parts.append(offload(sparsifier(n, d), accs[n], step))
            else:  # selected below, all with one finiteness read (on a GPU: one wait)
                inline.append((len(parts), sparsifier(n, d), accs[n]))
                parts.append(None)
        parts = _select_inline(parts, inline, step)
        payload = Payload(selections=parts, wire_dtype=wire)
    return Prepared(accs, nonfinite, payload, time.perf_counter() - t0)


def _select_inline(parts: list, inline: list[tuple[int, sparsify.Sparsifier, torch.Tensor]],
                   step: int) -> list:
    """Fill ``parts``' inline selections. The inline tensors come last (plan_jobs puts the
    tensors sent whole first; an offloaded one may sit between them): when they are one run,
    they are selected as one buffer, every tensor at its own k, in a number of operations
    independent of their count (:func:`gradsync.sparsify.segments.select_buffer`); otherwise,
    or on the CPU (:func:`~gradsync.sparsify.segments.pays_on`), or for a sparsifier without a
    segmented form, tensor by tensor."""
    first = len(parts) - len(inline)
    if (len(inline) > 1 and [i for i, _, _ in inline] == list(range(first, len(parts)))
            and segments.pays_on(inline[0][2].device)):
        accs = [acc for _, _, acc in inline]
        one = sparsify.select_buffer([sp for _, sp, _ in inline], torch.cat(accs),
                                     [acc.numel() for acc in accs], step)
        if one is not None:
            return [*parts[:first], one]
    chosen = sparsify.select_each([(sp, acc) for _, sp, acc in inline], step)
    for (i, _, _), sel in zip(inline, chosen):
        parts[i] = sel
    return parts
