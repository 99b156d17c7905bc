"""SSFusion: tensor fusion with selective sparsification (SSFusion §IV-B), SSFusion-O (§IV-C)
and SSFusion-I (§IV-D).

**§IV-B Step-1.** The buffers (their number M and sizes N_i) come from Cupcake's FindOptFusion
(cupcake.py); every tensor starts sparsified individually at ``density`` (per-tensor).

**§IV-B Step-2, overlap-maximised selection (Eq. 2).** Buffers are decided in backward order,
so the previous buffer's communication time T_cm^{i−1} is known when buffer i is decided. In
each buffer the tensors are sorted by ascending size and the smallest are excluded from
sparsification (sent dense) one by one until

    T_cm^{i−1} ≥ Σ_{j=1}^{N_i} (T_b^j + T_gpu^j)                                  (Eq. 2)

where T_gpu^j = 0 for an excluded tensor (its backward still runs; only its sparsification is
saved). The first exclusion count that satisfies Eq. 2 is taken ("maximum overlap": excluding
more would only shorten the computation that the previous buffer's communication hides).
T_cm^{i−1} is that of buffer i−1 with the exclusions decided so far, compensated model-wide
(later exclusions lower d′ a little further; ``info["T_cm_prev"]`` records the value used).
When Eq. 2 cannot hold, the planner takes the exclusion count (smallest first, 0..N_i) that
minimises the simulated iteration time — keeping everything sparsified when excluding does not
help; gains under 1 ppm count as ties, which go to fewer exclusions — and records
``eq2: "unreachable"``. **Buffer 1** is treated the same way: Eq. 2 is written for
2 ≤ i ≤ M because Buffer_1 has no earlier communication to hide its computation (T_cm^0 = 0,
Eq. 2 never holds), but the selection still applies to it — Fig. 8(b) leaves G5 and G4 of
Buffer_1 unsparsified — so its small tensors are excluded when that shortens the simulated
iteration (``eq2: "n/a"``).
Exclusions stop at the compensation budget: a tensor is excluded only while the tensors sent
whole take at most :data:`WHOLE_SHARE` (a quarter) of the byte budget density·n, each element
at the most it can cost on the wire (:func:`allgather_charge`), and the model's sparsified
tensors, lowered to at most the density floor, can absorb them (so the model still sends
≈ density·n entries). These guards are ours: the paper's argument (Insight #2: the excluded
small tensors are a negligible share of the bytes) assumes them; without the second, Eq. 2 could
be bought by sending large tensors dense, which Eq. 2 does not charge for. Without the share, a
model whose small tensors are many (the LayerNorms and biases of a small transformer) spent
most of its budget on them and starved its matrices toward the floor. Measured (1 %):

* TinyGPT, P = 4, 60 steps, 3 seeds, held-out perplexity (DDP 17.03): SSFusion 20.51 with no
  share, 20.00 with a quarter, 19.61 with a tenth; SSFusion-OI 20.00, 19.55 and 19.56;
* the DDP hook's SSFusion-OI under the Trainer's AdamW (GPT-2s of 106 k, 409 k and 1.6 M
  parameters, 2 ranks, 78 steps, 2 seeds, the same bytes): final loss 2.12, 0.29 and 0.12 with
  no share, 1.25, 0.20 and 0.11 with a quarter (1.25, 0.21 and 0.11 with a tenth); the plain
  Trainer's after 60 steps: 0.85, 0.09 and 0.06.

A quarter, not a tenth, keeps every small tensor of the CNN whole (21 % of its budget), and the
119 smallest of ResNet-50's 126 small tensors at 5 %.

**Density-aware compensation (§IV-B, model-wide).** The paper's four steps: (i) the number of
gradient elements n (the model's); (ii) the number of elements selective sparsification sends;
(iii) their difference from the target k = density·n; (iv) lower the density d′ of the
sparsified (large) tensors until the difference is near zero:
Σ_{sparsified} k(n_j, d′) ≈ density·n − Σ_{excluded} n_j (``compensate``, by bisection, since
k(n, d′) is a step function). One d′ for every sparsified tensor of the model, so the dense
small tensors' cost is spread over all large tensors, not over the few in the same buffer.
Lower bound 0.001 (``min_density``; never above the target density). The DDP hook calls the same
function over all of the model's parameters (integrations/ddp.py). SSFusion's published code
leaves the density unchanged (docs/papers.md, "SSFusion"); this is the paper's intent.

**SSFusion-O (§IV-C Step-1).** In each buffer, sparsified tensors are taken in backward order; a
tensor is offloaded to the (single, serial) worker thread when its offloaded sparsification
finishes no later than the buffer's backward, T_offload^{l′} ≤ Σ_{j=1}^{N_i} T_b^j, both measured
from the start of the backward of the buffer's first tensor. The tensor becomes ready when the
compute stream reaches it (its backward, plus the inline sparsification of earlier tensors that
were not offloaded); otherwise it stays inline. On a GPU host (the cost model's
``info["device"]`` is not ``"cpu"``) a tensor is offloaded only where its offloaded
sparsification, copies included, is also shorter than the inline one: there the inline kernels
are cheap and the copies to the host and back would be paid for nothing (on the CPU the worker
is another core, so fitting in the backward suffices). On a CPU that selects each buffer at
once (``info["segmented"]``: :func:`gradsync.sparsify.segments.pays_on`, ``bench overhead
--segments-on-cpu``, which measures what an accelerator runs) nothing is offloaded: the worker
would select tensor by tensor, on the same cores, what the buffer's one selection does with no
launch per tensor. Nor where the host's cores, shared out over its ranks, leave the worker no
core of its own (:attr:`~gradsync.schedule.costmodel.CostModel.worker_has_a_core`): there the
worker's selection runs on the core of the backward it was meant to hide behind, or of another
rank, and adds a hand-off between threads to the same CPU work. A cost model profiled before
this key plans as before.

**SSFusion-I (§IV-D).** Each buffer is split at l′ (0 ≤ l′ ≤ N_i, backward order): the
unsparsified tensors among the first l′ form Buffer_AR (all-reduced, ``allreduce=True``), every
other tensor Buffer_AG (all-gathered). ``best_split`` picks l′ minimising T1 + T2 with

    T1 = Σ_{j≤l′} (T_b^j + T_gpu^j)
    T2 = max(T_AR(Buffer_AR), Σ_{j>l′} (T_b^j + T_gpu^j)) + T_AG(Buffer_AG)

(T_gpu^j = 0 for dense and for offloaded tensors; an empty part costs nothing).
**No core of its own (ours).** The paper's T2 lets Buffer_AR's all-reduce run entirely beside
the backward. Where the host's cores, shared out over its ranks, leave the threads that run it
(gloo's, the engine's communication thread) no core beside the training thread's
(:attr:`~gradsync.schedule.costmodel.CostModel.worker_has_a_core`, as for SSFusion-O), its
start-ups and CPU work (:meth:`~gradsync.schedule.costmodel.CostModel.t_allreduce_host`) take
that core, and only its bytes cross the link meanwhile: T2 = max(T_AR, Σ_{j>l′} (T_b^j +
T_gpu^j) + T_AR^host) + T_AG. Measured on 2 cores at P = 2 (a core per rank), the CNN's split
(four small tensors all-reduced mid-backward) made the step 2.4–2.8 ms slower than no split
(``bench anatomy``, SSFusion-OI against SSFusion); with this term the split is taken only where
the all-gather's bytes it saves outweigh those start-ups. T_AR^host also carries one call's
cost above a raw collective's start-ups (Python, hand-offs, the ranks meeting once more), as
the warm-up measures it where no core is spare (``info["call_overhead_s"]``,
:func:`gradsync.engine.warmup.final_plan`): with the start-ups alone the CNN's split still
won at P = 2, 1 Gbit/s, in 2 of 3 warm-ups, and cost 1.6 ms a step (speed.md, "A sparse call
is not a raw all-gather"). Separation
follows the selective-sparsification decisions, as the paper says; the split point decides how
early the all-reduce can start. After the split, compensation charges each Buffer_AR tensor
at what its all-reduce sends (:func:`charge_bytes`: 1/P of an all-gathered entry per element
in fp32) instead of one entry per element, so SSFusion-I sends the target's bytes, not fewer.

**Excluded tensors in the all-gather travel as values (ours).** A buffer's tensors sent whole
go first in its all-gather, as the selection's dense prefix, and TopkA sends their values
without indices (``SparseGrad.dense_prefix``): an index for every element of a tensor sent whole
says nothing. :func:`charge_bytes` charges them at that (1/2 of an entry per fp32 element), for
SSFusion, SSFusion-O and SSFusion-I's all-gather part alike. Both charges are ours: the paper
counts elements, and its purpose is that excluding small tensors does not prolong transmission.

**min_k (ours).** ``Config.min_k`` (8) sends whole every tensor that ``density`` would give
fewer entries, as the other per-tensor schemes do, but here compensation pays for them with
the others' density, so only where they fit :data:`MIN_K_SHARE` (half) of the byte budget
together; otherwise none is forced, and Eq. 2's exclusions within :data:`WHOLE_SHARE` decide
(:func:`starved`, for the engine and the DDP hook alike). A tensor's entries are counted at the
compensated d′ it would be selected at, not at the target. Measured at 1 %, P = 4 (docs/results/
accuracy-history.md, "min_k in the SSFusion family"): ResNet-20's small tensors (its BatchNorm
vectors, first convolution and classifier) take 40 % of the budget; sparsified, the classifier sends
5 of its 640 entries a step and SSFusion ended 11.1 points below DDP, whole 1.1 (5 seeds).
TinyGPT's biases and norms take 66 %; forced whole they halved the matrices' density (d′
0.0079 → 0.0034) and cost 1.9 perplexity at 60 steps and 0.29 at 1000 (3 seeds).

**Pooled buffers send nothing whole (ours).** Under ``Config.budget="pooled"``, the family's
default, a buffer's sparsified tensors are selected by one top-k of K = Σ k_i
(:attr:`gradsync.engine.jobs.Job.pools`). Eq. 2 excludes a tensor to save its own
sparsification, T_gpu^j; a pool pays one selection over all of its elements, which excluding
its smallest tensors shortens by their elements only (ResNet-20's 38 BatchNorm vectors are
0.5 % of its pool), while what they then send whole takes up to :data:`WHOLE_SHARE` of the
bytes from the others. So under pooling :func:`selective_buffers` excludes nothing (its info
says ``eq2: "pooled"``) and ``min_k``'s default is 1: the pool, not a per-tensor k, gives a
small tensor the entries its values earn, as TopkA's global selection does. SSFusion-I's
Buffer_AR is then empty. The DDP hook does the same (every tensor of a bucket in its pool).
``Config(budget="blend")`` is the paper's selective sparsification. Measured at 1 %, P = 4
(docs/results/accuracy-history.md, "Pooled buffers send nothing whole"), SSFusion-OI against its
buffers pooled beside the tensors sent whole: ResNet-20 (cosine schedule, 10 seeds) −0.69
points vs DDP instead of −1.23 (+0.54 [+0.05, +1.02] paired); the CNN −0.48 [−1.59, +0.63]
paired (10 seeds, unresolved; +0.57 vs DDP); TinyGPT lower perplexity on every seed.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from gradsync.schedule.costmodel import INDEX_BYTES, CostModel, spare_core
from gradsync.schedule.plan import BufferPlan, Plan, TensorPlan, below_min_k, entries
from gradsync.schedule.timeline import buffer_comm_time, simulate
from gradsync.sparsegrad import target_k

__all__ = [
    "MIN_K_SHARE",
    "WHOLE_SHARE",
    "allgather_charge",
    "allreduce_charge",
    "best_split",
    "charge_bytes",
    "compensate",
    "dishonoured_density",
    "hook_interleaves",
    "hook_plan",
    "interleave_buffer",
    "offload_buffer",
    "selective_buffers",
    "small_within_budget",
    "starved",
]

# The largest share of the byte budget (density · n entries, at each element's wire charge) that
# the tensors SSFusion sends whole may take; the sparsified ones keep the rest (module docstring,
# "Exclusions stop at the compensation budget", which gives what it measured).
WHOLE_SHARE = 0.25
# The largest share of it that the tensors Config.min_k sends whole may take together; beyond it
# none is forced and Eq. 2's exclusions (within WHOLE_SHARE) decide them (module doc, "min_k").
MIN_K_SHARE = 0.5


# ---------------------------------------------------------------------------------------------
# Density-aware compensation
# ---------------------------------------------------------------------------------------------
def compensate(numels: Sequence[int], sparse: Sequence[bool], density: float,
               min_density: float = 0.001, charge: float | Sequence[float] = 1.0
               ) -> tuple[float | None, dict[str, Any]]:
    """Density d′ of the sparsified tensors among ``numels`` (None when none is sparsified).

    Call it with **all of the model's tensors** (§IV-B(i): "the number of gradient elements" is
    the model's): the entries the excluded tensors send whole are taken from every sparsified
    tensor of the model alike, so Σ_sparsified k(n_j, d′) ≈ density·Σ n − Σ_excluded c_j·n_j
    (bisection, since k(n, d′) is a step function), floor ``min(min_density, density)``.

    ``charge`` (c_j, one number or one per tensor): what one element of an excluded tensor
    costs on the wire, in sparse entries. 1 is the paper's element count; at its bytes
    (:func:`charge_bytes`) :func:`allgather_charge` when it travels whole in the all-gather (a
    value without its index), :func:`allreduce_charge` when SSFusion-I all-reduces it.
    """
    numels, sparse = list(numels), list(sparse)
    charges = [float(charge)] * len(numels) if isinstance(charge, (int, float)) else list(charge)
    if not len(numels) == len(sparse) == len(charges):
        raise ValueError("compensate: numels, sparse and charge differ in length")
    if not all(math.isfinite(c) and c > 0 for c in charges):
        raise ValueError(f"compensate: every charge must be finite and > 0, got {charges}")
    total = sum(numels)
    k_target = density * total
    dense_n = sum(n for n, s in zip(numels, sparse) if not s)
    dense_c = sum(c * n for n, s, c in zip(numels, sparse, charges) if not s)
    S = Counter(n for n, s in zip(numels, sparse) if s)  # size → how many (models repeat sizes)
    floor = min(min_density, density)
    info: dict[str, Any] = {"k_target": k_target, "dense_numel": dense_n,
                            "dense_charged": dense_c, "floor": False}

    def f(d: float) -> int:  # entries the sparsified tensors send at density d
        return sum(c * entries(n, d) for n, c in S.items())

    if not S:
        info.update(density=None, k_sent=dense_n)
        return None, info
    if dense_n == 0:
        d = density  # nothing to compensate
    else:
        k_s = k_target - dense_c  # what the sparsified tensors may still send
        if f(floor) >= k_s:
            d, info["floor"] = floor, True
        elif f(density) <= k_s:
            d = density
        else:
            lo, hi = floor, density  # f(lo) < k_s < f(hi)
            for _ in range(64):
                mid = 0.5 * (lo + hi)
                if f(mid) >= k_s:
                    hi = mid
                else:
                    lo = mid
            d = lo if k_s - f(lo) <= f(hi) - k_s else hi
    info.update(density=d, k_sent=dense_n + f(d), k_charged=dense_c + f(d))
    return d, info


def dishonoured_density(scheme: str, density: float, sent: float | None,
                        min_k: int) -> str | None:
    """What to tell a user whose ``density`` SSFusion cannot send (``sent``, in entries per
    element, above it by more than 5 %: the tensors that must travel whole, those ``density``
    gives fewer than ``min_k`` entries, exceed the budget even with the others at the density
    floor); None when it sends what was asked. The engine and the DDP hook say it once."""
    if sent is None or sent <= 1.05 * density:
        return None
    return (f"gradsync: {scheme} cannot send density {density:g} on this model: the tensors "
            f"it must send whole (fewer than Config.min_k={min_k} entries at that density) "
            f"exceed the budget, so it sends {sent:.4g} (stats()['density'])")


def small_within_budget(numels: Sequence[int], small_numel: int, density: float,
                        min_density: float = 0.001, charge: float = 1.0, min_k: int = 1,
                        min_k_charge: float | None = None) -> tuple[int, dict[str, Any]]:
    """The size below which SSFusion's DDP hook sends a tensor whole (it has no Eq. 2: no cost
    model), over all of the model's tensors ``numels``; a tensor of n < the returned size
    travels whole, every other one is sparsified at the compensated d′ (:func:`compensate`).

    Insight #2 excludes the tensors below ``small_numel`` (the hook's 102,400-element
    heuristic) because they are a negligible share of the bytes. On a model whose tensors are
    all small that premise fails: excluding them all sends the model dense whatever ``density``
    asks. So, as :func:`selective_buffers` does for the engine, exclusions stop at the
    compensation budget: sizes are excluded smallest first (every tensor of a size together)
    only while what the excluded ones send at ``charge`` entries per element stays within
    :data:`WHOLE_SHARE` of ``density · Σ numels`` and the remaining sparsified tensors, at the
    density floor, can still absorb it. The tensors that ``density`` would give fewer than
    ``min_k`` entries travel whole first, when together they fit :data:`MIN_K_SHARE` of the
    budget (:func:`starved`, at ``min_k_charge`` per element, None: ``charge``).

    ``info``: ``starved`` (which tensors min_k sends whole: one mark per tensor), ``budget``
    (whether the budget, not ``small_numel``, set the size) and ``k_target``.
    """
    floor = min(min_density, density)
    forced = starved(numels, density, min_k, charge if min_k_charge is None else min_k_charge,
                     min_density)
    k_target = density * sum(numels)
    dense_c = sum(charge * n for n, f in zip(numels, forced) if f)
    count = Counter(n for n, f in zip(numels, forced) if not f)
    sparse_floor = sum(c * entries(n, floor) for n, c in count.items())
    cutoff, budget = 0, False
    for n in sorted(count):
        c = count[n]
        if n >= small_numel:
            break
        if (dense_c + charge * n * c + sparse_floor - c * entries(n, floor) >= k_target
                or dense_c + charge * n * c > WHOLE_SHARE * k_target):
            budget = True
            break
        dense_c += charge * n * c
        sparse_floor -= c * entries(n, floor)
        cutoff = n + 1
    return cutoff, {"starved": forced, "budget": budget, "k_target": k_target}


def starved(numels: Sequence[int], density: float, min_k: int, charge: float,
            min_density: float = 0.001) -> list[bool]:
    """Per tensor, whether SSFusion sends it whole for ``min_k``: every tensor that its density
    would give fewer than ``min_k`` entries (:func:`~gradsync.schedule.plan.below_min_k`),
    when all of them together take at most :data:`MIN_K_SHARE` of the byte budget
    ``density · Σ numels`` at ``charge`` entries per element; else none, and the planner's own
    exclusions (Eq. 2, :data:`WHOLE_SHARE`) decide the small tensors (module doc, "min_k").

    A tensor's density is the compensated d′ (:func:`compensate`, floor ``min_density``) that
    the tensors marked so far leave, not the target: sending them whole lowers d′, which can
    leave another tensor under ``min_k``, so the marks grow until they hold at their own d′
    (d′ only falls, so each round marks more or stops). A round whose marks no longer fit the
    share is not taken: the marks before it stand. Decided at the target alone, ResNet-20's
    classifier (640 entries: 8 at 1.25 %, whole at 1 %) was sparsified at 1.25 % with d′ =
    0.97 %, 6 entries a step, and SSFusion-OI ended 2.79 points below DDP there against 1.44 at
    1 % (docs/results/accuracy-history.md, "SSFusion-OI on ResNet-20: its budget")."""
    budget = MIN_K_SHARE * density * sum(numels)

    def fits(marks: list[bool]) -> bool:
        return sum(charge * n for n, b in zip(numels, marks) if b) <= budget

    below = [below_min_k(n, density, min_k) for n in numels]
    if not fits(below):
        return [False] * len(numels)
    while True:
        d, _ = compensate(numels, [not b for b in below], density, min_density, charge)
        more = [b or (d is not None and below_min_k(n, d, min_k)) for n, b in zip(numels, below)]
        if more == below or not fits(more):
            return below
        below = more


def hook_interleaves(interleave: bool, device: str) -> bool:
    """Whether the DDP hook splits a bucket's tensors sent whole into SSFusion-I's all-reduce
    part (Buffer_AR): for the SSFusion-I schemes (``interleave``) where the threads that run it
    have a core of their own (:func:`~gradsync.schedule.costmodel.spare_core`). Without one its
    start-ups take the backward's core, which the engine's cost model charges (module doc, "No
    core of its own") and the hook, without a cost model, cannot weigh; the split then only
    saves bytes at P > 2 and adds a round: on 2 cores the CNN's step through the hook was 0.2 ms
    faster without it at P = 2 and 3 ms at P = 4 (speed.md, "The hook's split without a spare
    core")."""
    return interleave and spare_core(device)


@functools.lru_cache(maxsize=64)
def hook_plan(numels: tuple[int, ...], small_numel: int, density: float, min_density: float,
              charge: float, min_k: int, min_k_charge: float | None = None
              ) -> tuple[int, float | None, float, bool]:
    """SSFusion over all of a model's parameters, as the DDP hook runs it (computed once): the
    size below which a tensor travels whole (:func:`small_within_budget`; those ``min_k``
    sends whole, :func:`starved`, too), the compensated d′ of the others (§IV-B(i),
    :func:`compensate`), the density the model then sends, in entries at ``charge`` per
    element sent whole, and whether ``min_k`` sends its tensors whole on this model."""
    whole, info = small_within_budget(numels, small_numel, density, min_density, charge, min_k,
                                      min_k_charge)
    forced = info["starved"]
    dense = [n < whole or f for n, f in zip(numels, forced)]
    d, _ = compensate(numels, [not w for w in dense], density, min_density, charge)
    sent = sum(charge * n if w or d is None else target_k(n, d) for n, w in zip(numels, dense))
    return whole, d, sent / max(1, sum(numels)), any(forced)


def allreduce_charge(P: int, elem_bytes: int) -> float:
    """What one element that SSFusion-I all-reduces costs on the wire, in sparse entries of its
    all-gather (§IV-D's two collectives; bytes each rank sends, as counted at the
    torch.distributed call): a ring all-reduce sends 2(P−1)/P · elem_bytes per element, the
    all-gather (P−1) · (INDEX_BYTES + elem_bytes) per entry, so
    2·elem_bytes / (P·(INDEX_BYTES + elem_bytes)): 1/P for fp32. One rank sends nothing
    either way: 1, the paper's element count."""
    if int(P) != P or P < 1 or int(elem_bytes) != elem_bytes or elem_bytes < 1:
        raise ValueError(f"allreduce_charge: P and elem_bytes must be integers >= 1, got "
                         f"{P!r}, {elem_bytes!r}")
    if P == 1:
        return 1.0
    return 2 * elem_bytes / (P * (INDEX_BYTES + elem_bytes))


def _compensated(groups: Sequence[Sequence[str]], numel: dict[str, int], excluded: set[str],
                 density: float, min_density: float) -> tuple[list[BufferPlan], dict]:
    """Per-tensor buffers over ``groups``: ``excluded`` sent whole, every other tensor at the
    model-wide compensated density d′."""
    names = [n for g in groups for n in g]
    d, info = compensate([numel[n] for n in names], [n not in excluded for n in names], density,
                         min_density)
    bufs = [BufferPlan(tuple(TensorPlan(n, numel[n], None if n in excluded else d) for n in g),
                       "per_tensor") for g in groups]
    return bufs, info


# ---------------------------------------------------------------------------------------------
# §IV-B: overlap-maximised selective sparsification
# ---------------------------------------------------------------------------------------------
def selective_buffers(groups: list[list[str]], numel: dict[str, int], cost: CostModel,
                      density: float, min_density: float = 0.001, min_k: int = 1,
                      pooled: bool = False) -> tuple[list[BufferPlan], list[dict[str, Any]]]:
    """Per-tensor buffers over ``groups`` with Eq. 2 selection in every buffer and model-wide
    density-aware compensation; one info dict per buffer (the last compensation in each).

    ``min_k`` (``Config.min_k``; 1: the paper's planner): the tensors that ``density`` would
    give fewer entries are excluded before Eq. 2 runs (:func:`~gradsync.schedule.plan.
    whole_below`), so the compensation charges what they send whole; Eq. 2 then excludes
    among the others; when they would take more than :data:`MIN_K_SHARE` of the budget none is
    forced (:func:`starved`).

    ``pooled`` (``Config.budget="pooled"``): Eq. 2 excludes nothing (module doc, "Pooled
    buffers send nothing whole"); ``min_k`` still forces what it marks."""
    everything = [n for g in groups for n in g]
    floor = min(min_density, density)
    k_target = density * sum(numel[n] for n in everything)
    k_floor = {n: entries(numel[n], floor) for n in everything}
    w_whole = allgather_charge(cost.P, cost.elem_bytes)  # the most an element sent whole costs
    marks = starved([numel[n] for n in everything], density, min_k, w_whole, min_density)
    forced = {n for n, f in zip(everything, marks) if f}
    if pooled:  # module doc, "Pooled buffers send nothing whole": Eq. 2 has nothing to save
        buffers, cinfo = _compensated(groups, numel, forced, density, min_density)
        return buffers, [{"buffer": i, "eq2": "pooled", "excluded": [],
                          "forced": [n for n in g if n in forced], **cinfo}
                         for i, g in enumerate(groups)]
    excluded: set[str] = set(forced)
    infos: list[dict[str, Any]] = []
    for i, group in enumerate(groups):
        names = [n for n in group if n not in forced]
        tb = sum(cost.backward[n] for n in group)
        tsp = {n: cost.t_sparsify(numel[n]) for n in names}
        ascending = sorted(names, key=lambda n: (numel[n], names.index(n)))

        def t_comp(e: int, ascending=ascending, tb=tb, tsp=tsp) -> float:
            # Σ_j (T_b^j + T_gpu^j) with the e smallest excluded (T_gpu = 0 for them)
            return tb + sum(tsp[n] for n in ascending[e:])

        # Compensation budget (model-wide): exclude only while the model's sparsified tensors,
        # at the density floor, can still absorb what the excluded ones send whole.
        dense_n = sum(numel[n] for n in excluded)
        sparse_floor = sum(k_floor[n] for n in everything if n not in excluded)
        e_max = 0
        while e_max < len(names):
            n = ascending[e_max]
            if (dense_n + numel[n] + sparse_floor - k_floor[n] >= k_target
                    or (dense_n + numel[n]) * w_whole > WHOLE_SHARE * k_target):
                break
            dense_n += numel[n]
            sparse_floor -= k_floor[n]
            e_max += 1
        if i == 0:  # T_cm^0: nothing earlier to overlap with, Eq. 2 cannot hold
            t_cm_prev, status = 0.0, "n/a"
            chosen = None
        else:
            current, _ = _compensated(groups, numel, excluded, density, min_density)
            t_cm_prev, status = buffer_comm_time(current[i - 1], cost), "holds"  # T_cm^{i−1}
            chosen = next((e for e in range(e_max + 1) if t_cm_prev >= t_comp(e)), None)
        if chosen is None:  # least simulated time, ties (< 1 ppm) to fewer exclusions
            status = "unreachable" if i else status
            best_t = None
            for e in range(e_max + 1):
                cand, _ = _compensated(groups, numel, excluded | set(ascending[:e]), density,
                                       min_density)
                t = simulate(Plan("ssfusion", cand), cost).iteration
                if best_t is None or t < best_t * (1 - 1e-6):
                    best_t, chosen = t, e
        excluded |= set(ascending[:chosen])
        infos.append({"buffer": i, "eq2": status, "T_cm_prev": t_cm_prev,
                      "T_comp": t_comp(chosen), "max_excluded": e_max,
                      "excluded": list(ascending[:chosen]),
                      "forced": [n for n in group if n in forced]})
    buffers, cinfo = _compensated(groups, numel, excluded, density, min_density)
    for inf in infos:
        inf.update(cinfo)
    return buffers, infos


# ---------------------------------------------------------------------------------------------
# §IV-C: SSFusion-O
# ---------------------------------------------------------------------------------------------
def offload_buffer(buf: BufferPlan, cost: CostModel) -> tuple[BufferPlan, dict[str, Any]]:
    """Mark the sparsified tensors whose offloaded sparsification ends within the buffer's
    backward (T_offload^{l′} ≤ Σ T_b^j, serial worker) and, on a GPU host, is shorter than
    the inline one (module docstring)."""
    bound = sum(cost.backward[t.name] for t in buf.tensors)  # Σ_{j=1}^{N_i} T_b^j
    clock = 0.0  # compute stream, from the start of the buffer's first backward
    worker = 0.0  # the worker is idle at the buffer's start (earlier offloads ended in time)
    out, offloaded = [], {}
    accelerator = cost.info.get("device", "cpu") != "cpu"
    no_core = not cost.worker_has_a_core
    if no_core or (not accelerator and cost.info.get("segmented")):  # module docstring
        why = {"cores_per_rank": cost.info["cores_per_rank"]} if no_core else {}
        return BufferPlan(tuple(buf.tensors), "per_tensor"), {"bound": bound, "T_offload": {},
                                                              **why}
    for t in buf.tensors:
        clock += cost.backward[t.name]
        if t.density is None:
            out.append(t)
            continue
        t_offload = max(clock, worker) + cost.t_sparsify(t.numel, offload=True)
        pays = (not accelerator
                or cost.t_sparsify(t.numel, offload=True) < cost.t_sparsify(t.numel))
        if t_offload <= bound and pays:
            worker = t_offload
            offloaded[t.name] = t_offload
            out.append(TensorPlan(t.name, t.numel, t.density, offload=True))
        else:
            clock += cost.t_sparsify(t.numel)  # inline: delays the rest of the backward
            out.append(t)
    return BufferPlan(tuple(out), "per_tensor"), {"bound": bound, "T_offload": offloaded}


# ---------------------------------------------------------------------------------------------
# §IV-D: SSFusion-I
# ---------------------------------------------------------------------------------------------
def best_split(tb: Sequence[float], tsp: Sequence[float], dense: Sequence[bool],
               dense_bytes: Sequence[int], ag_bytes: Sequence[int],
               t_allreduce: Callable[[int], float], t_allgather: Callable[[int], float],
               t_allreduce_host: Callable[[int], float] | None = None) -> tuple[int, float]:
    """The split l′ ∈ {0, …, N} minimising T1 + T2 (§IV-D, Eq. 3 and 4), and that minimum.

    Per tensor j (backward order): ``tb`` T_b^j, ``tsp`` its inline sparsification time (0 when
    dense or offloaded), ``dense`` whether it is unsparsified, ``dense_bytes`` its size in the
    all-reduce part, ``ag_bytes`` its bytes in the all-gather part. Tensors j < l′ (0-based)
    that are dense go to Buffer_AR; all others to Buffer_AG. Ties go to the smallest l′.
    ``t_allreduce_host``: the part of Buffer_AR's all-reduce that runs on the core of the
    backward it overlaps (module docstring, "No core of its own"), added to the rest of the
    backward: T2 = max(T_AR, Σ_{j>l′} … + T_AR^host) + T_AG; ``None``: nothing (the paper's).
    """
    n = len(tb)
    if not (len(tsp) == len(dense) == len(dense_bytes) == len(ag_bytes) == n):
        raise ValueError("best_split: per-tensor sequences differ in length")
    comp = [x + y for x, y in zip(tb, tsp)]
    total_ag = sum(ag_bytes)
    best_l, best_v = 0, None
    t1 = 0.0  # Σ_{j<l} (T_b^j + T_gpu^j)
    ar_bytes = ar_count = 0  # Buffer_AR of the first l tensors
    ag_b = total_ag
    for l in range(n + 1):
        if l > 0:
            t1 += comp[l - 1]
            if dense[l - 1]:
                ar_bytes += dense_bytes[l - 1]
                ag_b -= ag_bytes[l - 1]
                ar_count += 1
        rest = sum(comp[l:])
        t_ar = t_allreduce(ar_bytes) if ar_count else 0.0
        host = t_allreduce_host(ar_bytes) if ar_count and t_allreduce_host else 0.0
        t_ag = t_allgather(ag_b) if ar_count < n else 0.0
        v = t1 + max(t_ar, rest + host) + t_ag
        if best_v is None or v < best_v:
            best_l, best_v = l, v
    return best_l, float(best_v)


def interleave_buffer(buf: BufferPlan, cost: CostModel) -> tuple[BufferPlan, dict[str, Any]]:
    """Split one per-tensor buffer into Buffer_AR / Buffer_AG at ``best_split``; where the
    rank's threads have no core beside the training thread's, Buffer_AR's start-ups and CPU
    work delay the backward it overlaps (module docstring)."""
    ts = buf.tensors
    tsp = [0.0 if t.density is None or t.offload else cost.t_sparsify(t.numel) for t in ts]
    l, v = best_split(
        [cost.backward[t.name] for t in ts], tsp, [t.density is None for t in ts],
        [t.numel * cost.elem_bytes for t in ts],
        [t.numel * cost.elem_bytes if t.density is None else t.k * cost.entry_bytes
         for t in ts],  # a tensor sent whole in the all-gather: its values only
        cost.t_allreduce, cost.t_allgather, None if cost.worker_has_a_core else (
            lambda b: cost.t_allreduce_host(b) + cost.info.get("call_overhead_s", 0.0)))
    out = tuple(TensorPlan(t.name, t.numel, t.density, t.offload,
                           allreduce=(j < l and t.density is None)) for j, t in enumerate(ts))
    return BufferPlan(out, "per_tensor"), {"split": l, "T1+T2": v,
                                           "allreduce": [t.name for t in out if t.allreduce]}


def allgather_charge(P: int, elem_bytes: int) -> float:
    """What one element of a tensor sent whole through the all-gather costs, in sparse entries:
    its value without an index (it sits in the selection's dense prefix,
    ``SparseGrad.dense_prefix``, which TopkA sends as values only), so
    elem_bytes / (INDEX_BYTES + elem_bytes): 1/2 for fp32, 1/3 for bf16 and fp16. One rank
    sends nothing either way: 1, the paper's element count (as :func:`allreduce_charge`)."""
    if int(P) != P or P < 1 or int(elem_bytes) != elem_bytes or elem_bytes < 1:
        raise ValueError(f"allgather_charge: P and elem_bytes must be integers >= 1, got "
                         f"{P!r}, {elem_bytes!r}")
    if P == 1:
        return 1.0
    return elem_bytes / (INDEX_BYTES + elem_bytes)


def charge_bytes(buffers: Sequence[BufferPlan], P: int, elem_bytes: int, density: float,
                 min_density: float = 0.001) -> tuple[list[BufferPlan], dict[str, Any]]:
    """SSFusion's buffers with d′ compensated at the wire cost of each excluded tensor:
    SSFusion-I's Buffer_AR tensors at :func:`allreduce_charge` (P, elem_bytes), those that
    travel whole in the all-gather at :func:`allgather_charge` (P, elem_bytes).

    Compensation exists so that excluding small tensors does not prolong transmission (§IV-B,
    "Density-aware sparsification"). Counted in elements, it charges an excluded tensor as if
    each element were an (index, value) pair all-gathered to P − 1 peers, and the model then
    sends fewer bytes than the target (SSFusion-I on TinyGPT at P = 4: 0.0186 MB per step
    against TopkA's 0.0315). Charged at its bytes, d′ rises until the model sends what every
    tensor at ``density`` through the all-gather would. The exclusions and the split are the
    ones decided at the element count; only d′ changes (it can only rise)."""
    ts = [t for b in buffers for t in b.tensors]
    w_ar, w_ag = allreduce_charge(P, elem_bytes), allgather_charge(P, elem_bytes)
    d, info = compensate([t.numel for t in ts], [t.density is not None for t in ts], density,
                         min_density, [w_ar if t.allreduce else w_ag for t in ts])
    info["allreduce_charge"], info["allgather_charge"] = w_ar, w_ag
    # the density the model then sends, in entries per element (dishonoured_density's figure)
    info["sent_density"] = info["k_charged"] / max(1, sum(t.numel for t in ts))
    out = [BufferPlan(tuple(t if t.density is None else replace(t, density=d) for t in b.tensors),
                      b.mode, b.density) for b in buffers]
    return out, info
