"""``auto``: per fusion buffer, a dense all-reduce or a sparse all-gather, whichever the measured
cost model says is faster — and never a plan predicted to be slower than DDP's.

What it is built from (no new model, only a choice between the existing ones):

* the α-β cost model of SSFusion §IV-A (Eq. 1; ring all-reduce Eq. 4, ring all-gather Eq. 3)
  with the measured backward times T_b^l and sparsification costs (inline T_gpu, offloaded
  T_offload) of :mod:`.costmodel`, measured during the engine's warm-up;
* the iteration-time recurrence of :func:`gradsync.schedule.timeline.simulate` (SSFusion
  Fig. 1/7: compute stream, offload worker, one serial channel) as the objective;
* HiPress's *compress-or-not* question (Bai et al., SOSP'21, §4 "selective compression") asked
  per **fusion buffer** instead of per tensor, and Espresso's greedy walk over options on the
  timeline (Wang et al., EuroSys'23, §5) applied to buffers instead of single tensors.

**Options per buffer.** ``dense``: the buffer is all-reduced as it is (T_AR of its n·K bytes),
exactly DDP's bucket; when a plan with sparse tensors is replaced, the engine first runs one
step of :func:`flushing` (the dense buffers in their all-reduce part *with* error feedback), so
a residual left by a sparse step is sent, never stranded (with DGC momentum correction every
dense buffer goes through error feedback anyway: its velocity carries on, as SGD's momentum
buffer does); ``fused': the buffer is
sparsified as one vector (multi-tensor, T_gpu of its n elements on the compute stream) and
all-gathered (T_AG of k·(4+K) bytes per rank); ``inline``: every tensor sparsified on its own on the
compute stream (layer-wise, no tensor misses the step) and all-gathered;
``offload``: every tensor sparsified on its own on the worker thread (SSFusion-O's T_offload)
and all-gathered.

**Groupings.** Two candidate groupings are planned: DDP's ``bucket_bytes`` buckets (the
grouping a dense all-reduce is best at) and Cupcake's optimal contiguous fusion for fused
sparsification at ``density`` (the grouping sparse buffers are best at,
:func:`~gradsync.schedule.cupcake.cupcake_groups`). For each, starting from every buffer dense,
the buffers are walked in backward order and each takes the option that minimises the simulated
iteration with the others fixed; walks repeat until nothing changes (at most ``passes``; a walk
never raises the predicted time, so it ends). Ties (within 1 ppm) keep the simpler option
(dense, fused, inline, offload).

**Never slower than DDP (the switch margin).** The all-dense plan on DDP's buckets is the
reference. The best candidate replaces it only when its predicted iteration is at least
``margin`` (default :data:`MARGIN` = 5 %) shorter: a cost model that is a few percent wrong then
cannot make ``auto`` slower than the dense plan it would have run otherwise.

**Measured, not only predicted** (the engine's, :mod:`gradsync.engine.warmup`): the decision
record lists the runners-up (``alternatives``: of DDP's dense plan, the best sparse plan and
TopkA's plan — the whole gradient as one fused buffer after the backward — those that differ
from the choice; DDP's dense plan first, the others in order of prediction). The engine runs
each once for a window against the plan in use and keeps the one measured faster, a sparse
plan only by ``margin``. The dense plan goes first because it is what the promise is measured
against: where the model wrongly chose a sparse plan (it under-predicts them on a shared CPU),
the first trial already returns to it, and the other sparse runners-up are then measured
against it rather than against each other first. Every
runner-up is measured, however much slower it is predicted: on a 2-core machine the model
under-predicted sparse plans by up to 4× (docs/results/speed.md, on ``auto``), and
measuring costs two windows per runner-up, once. When the measured step later drifts from the
prediction, :func:`calibrated` rescales the cost model by the measured/predicted ratios of
all-reduce, all-gather and sparsification time and the engine plans again; a new plan is taken
only when it beats the current one, under the same calibrated model, by ``margin``, and it too
is measured against the plan it replaced (hysteresis: no flapping between near-equal choices).

**The DDP hook** has no warm-up timeline, so it asks the static question per DDP bucket
(:func:`bucket_sparse`): sparsifying each tensor and all-gathering, T_sp + T_AG(k·E), against
T_AR(n·K), with the same margin; when the answer sparsifies, it measures the answer against
all-dense in a short trial and keeps the faster (``gradsync.integrations.ddp``).
"""

from __future__ import annotations

from typing import Any

from gradsync.schedule.costmodel import AffineFit, AlphaBeta, CostModel
from gradsync.schedule.cupcake import cupcake_groups
from gradsync.schedule.fixed import fixed_buckets
from gradsync.schedule.plan import BufferPlan, Plan, TensorPlan, entries
from gradsync.schedule.timeline import simulate

__all__ = ["MARGIN", "OPTIONS", "auto_buffers", "bucket_sparse", "calibrated",
           "flushing", "has_sparse", "option_buffer"]

OPTIONS = ("dense", "fused", "inline", "offload")
MARGIN = 0.05  # a sparse plan must be predicted this much faster than the dense one


def option_buffer(names: list[str], numel: dict[str, int], option: str,
                  density: float) -> BufferPlan:
    """The buffer of ``names`` sent as ``option`` (one of :data:`OPTIONS`)."""
    if option == "dense":
        return BufferPlan(tuple(TensorPlan(n, numel[n], None) for n in names), "dense")
    if option == "fused":
        return BufferPlan(tuple(TensorPlan(n, numel[n], None) for n in names), "fused", density)
    if option == "inline":
        return BufferPlan(tuple(TensorPlan(n, numel[n], density) for n in names), "per_tensor")
    if option == "offload":
        return BufferPlan(tuple(TensorPlan(n, numel[n], density, offload=True) for n in names),
                          "per_tensor")
    raise ValueError(f"auto option must be one of {OPTIONS}, got {option!r}")


def _walk(groups: list[list[str]], numel: dict[str, int], cost: CostModel, density: float,
          passes: int) -> tuple[list[str], list[BufferPlan], float, int]:
    """Espresso's greedy walk over the buffers of ``groups`` (module doc)."""
    variants = [{o: option_buffer(g, numel, o, density) for o in OPTIONS} for g in groups]
    choice = ["dense"] * len(groups)

    def iteration(ch: list[str]) -> float:
        return simulate(Plan("auto", [v[o] for v, o in zip(variants, ch)]), cost).iteration

    best = iteration(choice)
    walks = 0
    for walks in range(1, passes + 1):  # noqa: B007 - the count is reported
        changed = False
        for i in range(len(groups)):
            for opt in OPTIONS:
                if opt == choice[i]:
                    continue
                t = iteration([*choice[:i], opt, *choice[i + 1:]])
                if t < best * (1 - 1e-6) or (t <= best * (1 + 1e-6)
                                            and OPTIONS.index(opt) < OPTIONS.index(choice[i])):
                    best, choice[i], changed = t, opt, True
        if not changed:
            break
    return choice, [v[o] for v, o in zip(variants, choice)], best, walks


def auto_buffers(names: list[str], numel: dict[str, int], cost: CostModel, density: float,
                 bucket_bytes: int, margin: float = MARGIN, passes: int = 4, *,
                 first_bucket_bytes: int | None = None,
                 ) -> tuple[list[BufferPlan], dict[str, Any]]:
    """``auto``'s buffers over ``names`` (backward order) and its decision record
    (``bucket_bytes``, ``first_bucket_bytes``: DDP's bucket limits, :mod:`.fixed`)."""
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"margin must be in [0, 1), got {margin!r}")
    ddp_groups = fixed_buckets(names, numel, cost.elem_bytes, bucket_bytes, first_bucket_bytes)
    dense = [option_buffer(g, numel, "dense", density) for g in ddp_groups]
    t_dense = simulate(Plan("auto", dense), cost).iteration
    candidates = {"ddp_buckets": ddp_groups}
    if cost.P > 1:
        candidates["cupcake"] = cupcake_groups(names, numel, cost, density)[0]
    best: tuple[str, list[str], list[BufferPlan], float] | None = None
    walks = {}
    for label, groups in candidates.items():
        choice, buffers, t, walks[label] = _walk(groups, numel, cost, density, passes)
        if best is None or t < best[3] * (1 - 1e-6):
            best = (label, choice, buffers, t)
    label, choice, buffers, t_best = best
    # the runners-up the engine measures once each against the choice (drift.Drift): of DDP's
    # dense plan, the best sparse plan and TopkA's plan (one fused buffer after the backward),
    # those that differ from the choice, DDP's first, then in order of prediction
    runners = [(t_dense, dense)]
    if any(o != "dense" for o in choice):
        runners.append((t_best, buffers))
    if cost.P > 1:
        one = [option_buffer(list(names), numel, "fused", density)]
        runners.append((simulate(Plan("auto", one), cost).iteration, one))
    if not t_best < t_dense * (1 - margin):  # not enough gain: DDP's dense plan
        label, choice, buffers, t_best = "ddp_buckets", ["dense"] * len(dense), dense, t_dense
    chosen = [b.to_dict() for b in buffers]
    alternatives: list[list[dict[str, Any]]] = []
    # DDP's dense plan first (the promise's reference), then the others by prediction
    for _, bufs in [runners[0], *sorted(runners[1:], key=lambda r: r[0])]:
        d = [b.to_dict() for b in bufs]
        if d != chosen and d not in alternatives:
            alternatives.append(d)
    info = {"grouping": label, "options": choice, "iteration": t_best,
            "dense_iteration": t_dense, "margin": margin, "walks": walks,
            "sparse_buffers": sum(o != "dense" for o in choice),
            "alternatives": alternatives if cost.P > 1 else []}
    return buffers, info


def flushing(plan: Plan) -> Plan:
    """``plan`` with every ``dense`` buffer sent in its all-reduce part with error feedback
    (same bytes, same time in the model): one step of it sends the residuals a sparse plan
    left behind."""
    bufs = [BufferPlan(tuple(TensorPlan(t.name, t.numel, None, allreduce=True)
                             for t in b.tensors), "per_tensor") if b.mode == "dense" else b
            for b in plan.buffers]
    return Plan(plan.scheme, bufs, plan.overlap, {**plan.info, "flushing": True})


def has_sparse(buffers: list[BufferPlan]) -> bool:
    """Whether any tensor of ``buffers`` is sparsified."""
    return any(b.mode == "fused" or any(t.density is not None for t in b.tensors)
               for b in buffers)


def calibrated(cost: CostModel, allreduce: float = 1.0, allgather: float = 1.0,
               sparsify: float = 1.0, backward: float = 1.0) -> CostModel:
    """``cost`` with its all-reduce, all-gather, sparsification (inline and offloaded) and
    backward times multiplied by the given measured/predicted ratios (each > 0)."""
    for what, f in (("allreduce", allreduce), ("allgather", allgather), ("sparsify", sparsify),
                    ("backward", backward)):
        if not f > 0 or f == float("inf"):
            raise ValueError(f"calibration factor {what} must be a positive number, got {f!r}")
    return CostModel(
        P=cost.P, order=list(cost.order), numel=dict(cost.numel), elem_bytes=cost.elem_bytes,
        backward={n: t * backward for n, t in cost.backward.items()},
        sparsify=AffineFit(cost.sparsify.a * sparsify, cost.sparsify.b * sparsify),
        offload=AffineFit(cost.offload.a * sparsify, cost.offload.b * sparsify),
        allreduce=AlphaBeta(cost.allreduce.alpha * allreduce, cost.allreduce.beta * allreduce),
        allgather=AlphaBeta(cost.allgather.alpha * allgather, cost.allgather.beta * allgather),
        info={**cost.info, "calibration": {"allreduce": allreduce, "allgather": allgather,
                                           "sparsify": sparsify, "backward": backward}})


def bucket_sparse(numels: list[int], density: float, P: int, elem_bytes: int,
                  allreduce: AlphaBeta, allgather: AlphaBeta, sparsify: AffineFit,
                  margin: float = MARGIN) -> bool:
    """The DDP hook's static test for one bucket of tensors with ``numels`` elements: whether
    sparsifying every tensor and all-gathering (T_sp + T_AG of Eq. 3) is at least ``margin``
    faster than all-reducing the bucket (Eq. 4)."""
    if P <= 1 or not numels:
        return False
    n = sum(numels)
    k = sum(entries(m, density) for m in numels)
    t_ar = 2 * (P - 1) * allreduce.alpha + 2 * (P - 1) / P * n * elem_bytes * allreduce.beta
    t_ag = (P - 1) * allgather.alpha + (P - 1) * k * (4 + elem_bytes) * allgather.beta
    t_sp = sum(sparsify(m) for m in numels)
    return t_sp + t_ag < t_ar * (1 - margin)
