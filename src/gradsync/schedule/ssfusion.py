"""SSFusion: tensor fusion with selective sparsification (SSFusion §IV-B), SSFusion-O (§IV-C)
and SSFusion-I (§IV-D).

**§IV-B Step-1.** The buffers (their number M and sizes N_i) come from Cupcake's FindOptFusion
(cupcake.py); every tensor starts sparsified individually at ``density`` (per-tensor).

**§IV-B Step-2, overlap-maximised selection (Eq. 2).** Buffers are decided in backward order,
so the previous buffer's communication time T_cm^{i−1} is final when buffer i is decided. For
buffer i ≥ 2 the tensors are sorted by ascending size and the smallest are excluded from
sparsification (sent dense) one by one until

    T_cm^{i−1} ≥ Σ_{j=1}^{N_i} (T_b^j + T_gpu^j)                                  (Eq. 2)

where T_gpu^j = 0 for an excluded tensor (its backward still runs; only its sparsification is
saved). The first exclusion count that satisfies Eq. 2 is taken ("maximum overlap": excluding
more would only shorten the computation that the previous buffer's communication hides).
Exclusions stop at the compensation budget: a tensor is excluded only while the buffer's
sparsified tensors, lowered to at most the density floor, can absorb the dense ones (so the
buffer still sends ≈ density·n_i entries). The paper's argument (Insight #2: the excluded small
tensors are a negligible share of the bytes) assumes exactly this; without the bound, Eq. 2 can
be bought by sending large tensors dense, which Eq. 2 does not charge for.
Eq. 2 is defined for 2 ≤ i ≤ M only: buffer 1 has no earlier communication to overlap with and,
as in Fig. 7(b), stays per-tensor sparsified. When Eq. 2 cannot hold even with every tensor
excluded within that budget, the planner falls back to the exclusion count (smallest first,
0..N_i) that minimises the simulated iteration time — keeping everything sparsified when
excluding does not help; gains under 1 ppm (e.g. one entry saved by rounding) count as ties,
which go to fewer exclusions — and records ``eq2: "unreachable"``.

**Density-aware compensation.** The paper's four steps: (i) the buffer's element count n_i;
(ii) the number of elements selective sparsification sends; (iii) their difference from the
target k = density·n_i; (iv) lower the density d′ of the buffer's sparsified (large) tensors until
the difference is near zero: Σ_{sparsified} k(n_j, d′) ≈ density·n_i − Σ_{excluded} n_j (found by
bisection, since k(n, d′) is a step function). Lower bound 0.001 (``min_density``; never above
the target density). SSFusion's published code leaves the density unchanged (docs/architecture.md,
"Facts from the reference implementations"); this is the paper's intent.

**SSFusion-O (§IV-C Step-1).** In each buffer, sparsified tensors are taken in backward order; a
tensor is offloaded to the (single, serial) worker thread when its offloaded sparsification
finishes no later than the buffer's backward, T_offload^{l′} ≤ Σ_{j=1}^{N_i} T_b^j, both measured
from the start of the backward of the buffer's first tensor. The tensor becomes ready when the
compute stream reaches it (its backward, plus the inline sparsification of earlier tensors that
were not offloaded); otherwise it stays inline.

**SSFusion-I (§IV-D).** Each buffer is split at l′ (0 ≤ l′ ≤ N_i, backward order): the
unsparsified tensors among the first l′ form Buffer_AR (all-reduced, ``allreduce=True``), every
other tensor Buffer_AG (all-gathered). ``best_split`` picks l′ minimising T1 + T2 with

    T1 = Σ_{j≤l′} (T_b^j + T_gpu^j)
    T2 = max(T_AR(Buffer_AR), Σ_{j>l′} (T_b^j + T_gpu^j)) + T_AG(Buffer_AG)

(T_gpu^j = 0 for dense and for offloaded tensors; an empty part costs nothing). Separation
follows the selective-sparsification decisions, as the paper says; the split point decides how
early the all-reduce can start.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from gradsync.schedule.costmodel import CostModel
from gradsync.schedule.plan import BufferPlan, Plan, TensorPlan, entries
from gradsync.schedule.timeline import buffer_comm_time, simulate

__all__ = [
    "best_split",
    "compensate",
    "interleave_buffer",
    "offload_buffer",
    "selective_buffers",
]


# ---------------------------------------------------------------------------------------------
# Density-aware compensation
# ---------------------------------------------------------------------------------------------
def compensate(numels: Sequence[int], sparse: Sequence[bool], density: float,
               min_density: float = 0.001) -> tuple[float | None, dict[str, Any]]:
    """Density d′ for the sparsified tensors of a buffer (None when none is sparsified)."""
    total = sum(numels)
    k_target = density * total
    dense_n = sum(n for n, s in zip(numels, sparse) if not s)
    S = [n for n, s in zip(numels, sparse) if s]
    floor = min(min_density, density)
    info: dict[str, Any] = {"k_target": k_target, "dense_numel": dense_n, "floor": False}

    def f(d: float) -> int:  # entries the sparsified tensors send at density d
        return sum(entries(n, d) for n in S)

    if not S:
        info.update(density=None, k_sent=dense_n)
        return None, info
    if dense_n == 0:
        d = density  # nothing to compensate
    else:
        k_s = k_target - dense_n  # what the sparsified tensors may still send
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
    info.update(density=d, k_sent=dense_n + f(d))
    return d, info


def _per_tensor_buffer(names: Sequence[str], numel: dict[str, int], excluded: set[str],
                       density: float, min_density: float) -> tuple[BufferPlan, dict]:
    sparse = [n not in excluded for n in names]
    d, info = compensate([numel[n] for n in names], sparse, density, min_density)
    tensors = tuple(TensorPlan(n, numel[n], d if s else None) for n, s in zip(names, sparse))
    return BufferPlan(tensors, "per_tensor"), info


# ---------------------------------------------------------------------------------------------
# §IV-B: overlap-maximised selective sparsification
# ---------------------------------------------------------------------------------------------
def selective_buffers(groups: list[list[str]], numel: dict[str, int], cost: CostModel,
                      density: float, min_density: float = 0.001
                      ) -> tuple[list[BufferPlan], list[dict[str, Any]]]:
    """Per-tensor buffers over ``groups`` with Eq. 2 selection and density compensation."""
    buffers: list[BufferPlan] = []
    infos: list[dict[str, Any]] = []
    for i, names in enumerate(groups):
        tb = sum(cost.backward[n] for n in names)
        tsp = {n: cost.t_sparsify(numel[n]) for n in names}
        if i == 0:
            buf, cinfo = _per_tensor_buffer(names, numel, set(), density, min_density)
            buffers.append(buf)
            infos.append({"buffer": 0, "eq2": "n/a", "excluded": [],
                          "T_comp": tb + sum(tsp.values()), **cinfo})
            continue
        t_cm_prev = buffer_comm_time(buffers[-1], cost)  # T_cm^{i−1}
        ascending = sorted(names, key=lambda n: (numel[n], names.index(n)))

        def t_comp(e: int, ascending=ascending, tb=tb, tsp=tsp) -> float:
            # Σ_j (T_b^j + T_gpu^j) with the e smallest excluded (T_gpu = 0 for them)
            return tb + sum(tsp[n] for n in ascending[e:])

        # Compensation budget: exclude only while the sparsified tensors can absorb the dense
        # ones above the density floor (the buffer then sends ≈ density·n_i entries);
        # beyond it every exclusion adds traffic that Eq. 2 does not see.
        # (same test as ``compensate``'s floor: Σ_S k(n, floor) ≥ density·n_i − Σ_D n).
        floor, k_target = min(min_density, density), density * sum(numel[n] for n in names)
        k_floor = [entries(numel[n], floor) for n in ascending]
        e_max, dense_n = 0, 0
        while e_max < len(names):
            dense_n += numel[ascending[e_max]]
            if sum(k_floor[e_max + 1:]) >= k_target - dense_n:
                break
            e_max += 1
        chosen = next((e for e in range(e_max + 1) if t_cm_prev >= t_comp(e)), None)
        status = "holds"
        if chosen is None:  # Eq. 2 unreachable: least simulated time, ties to fewer exclusions
            status = "unreachable"
            best_t = None
            for e in range(e_max + 1):
                cand, _ = _per_tensor_buffer(names, numel, set(ascending[:e]), density,
                                             min_density)
                rest = [_per_tensor_buffer(g, numel, set(), density, min_density)[0]
                        for g in groups[i + 1:]]
                t = simulate(Plan("ssfusion", [*buffers, cand, *rest]), cost).iteration
                if best_t is None or t < best_t * (1 - 1e-6):  # < 1 ppm: a tie
                    best_t, chosen = t, e
        excluded = ascending[:chosen]
        buf, cinfo = _per_tensor_buffer(names, numel, set(excluded), density, min_density)
        buffers.append(buf)
        infos.append({"buffer": i, "eq2": status, "T_cm_prev": t_cm_prev,
                      "T_comp": t_comp(chosen), "max_excluded": e_max,
                      "excluded": list(excluded), **cinfo})
    return buffers, infos


# ---------------------------------------------------------------------------------------------
# §IV-C: SSFusion-O
# ---------------------------------------------------------------------------------------------
def offload_buffer(buf: BufferPlan, cost: CostModel) -> tuple[BufferPlan, dict[str, Any]]:
    """Mark the sparsified tensors whose offloaded sparsification ends within the buffer's
    backward (T_offload^{l′} ≤ Σ T_b^j, serial worker)."""
    bound = sum(cost.backward[t.name] for t in buf.tensors)  # Σ_{j=1}^{N_i} T_b^j
    clock = 0.0  # compute stream, from the start of the buffer's first backward
    worker = 0.0  # the worker is idle at the buffer's start (earlier offloads ended in time)
    out, offloaded = [], {}
    for t in buf.tensors:
        clock += cost.backward[t.name]
        if t.density is None:
            out.append(t)
            continue
        t_offload = max(clock, worker) + cost.t_sparsify(t.numel, offload=True)
        if t_offload <= bound:
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
               t_allreduce: Callable[[int], float], t_allgather: Callable[[int], float]
               ) -> tuple[int, float]:
    """The split l′ ∈ {0, …, N} minimising T1 + T2 (§IV-D, Eq. 3 and 4), and that minimum.

    Per tensor j (backward order): ``tb`` T_b^j, ``tsp`` its inline sparsification time (0 when
    dense or offloaded), ``dense`` whether it is unsparsified, ``dense_bytes`` its size in the
    all-reduce part, ``ag_bytes`` its bytes in the all-gather part. Tensors j < l′ (0-based)
    that are dense go to Buffer_AR; all others to Buffer_AG. Ties go to the smallest l′.
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
        t_ag = t_allgather(ag_b) if ar_count < n else 0.0
        v = t1 + max(t_ar, rest) + t_ag
        if best_v is None or v < best_v:
            best_l, best_v = l, v
    return best_l, float(best_v)


def interleave_buffer(buf: BufferPlan, cost: CostModel) -> tuple[BufferPlan, dict[str, Any]]:
    """Split one per-tensor buffer into Buffer_AR / Buffer_AG at ``best_split``."""
    ts = buf.tensors
    tsp = [0.0 if t.density is None or t.offload else cost.t_sparsify(t.numel) for t in ts]
    l, v = best_split(
        [cost.backward[t.name] for t in ts], tsp, [t.density is None for t in ts],
        [t.numel * cost.elem_bytes for t in ts], [t.k * cost.entry_bytes for t in ts],
        cost.t_allreduce, cost.t_allgather)
    out = tuple(TensorPlan(t.name, t.numel, t.density, t.offload,
                           allreduce=(j < l and t.density is None)) for j, t in enumerate(ts))
    return BufferPlan(out, "per_tensor"), {"split": l, "T1+T2": v,
                                           "allreduce": [t.name for t in out if t.allreduce]}
