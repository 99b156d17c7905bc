"""Cupcake's FindOptFusion (SSFusion §II-E "Cupcake", §IV-B Step-1), derived from the cost model.

Cupcake fuses consecutive gradients (backward order) into buffers that are each sparsified as
one vector and all-gathered, choosing the fusion that minimises the iteration time. Its released
code lacks FindOptFusion (docs/papers.md, "The SSFusion paper's baselines");
we compute it exactly as a dynamic program over contiguous groups with the simulator's
recurrence (timeline.py, mode ``"fused"``, overlap on).

Why the DP is exact. With gradients 1..L in backward order, B_j = Σ_{l≤j} T_b^l,
N_j = Σ_{l≤j} n_l, and the sparsifier's affine time T_sp(n) = a + b·n, a grouping whose m-th
buffer ends at gradient j has

    compute clock after sparsifying it:  R(j, m) = B_j + b·N_j + a·m          (each buffer: +a)
    end of its communication:            e_m = max(R(j, m), e_{m−1}) + T_AG(k(N_j − N_i)·(4+K))

and the iteration time is e_M (the last buffer's ready time is the end of the compute stream).
R depends on the prefix only through (j, m), and every later e is a non-decreasing function of
e_m, so among prefixes with the same (j, m) the one with the smallest e_m is never worse: the
principle of optimality holds for the state (j, m) and

    E[j, m] = min_{i < j} max(R(j, m), E[i, m−1]) + T_AG(k(N_j − N_i)·(4+K)),   E[0, 0] = 0

gives the exact minimum of ``simulate`` over all 2^{L−1} contiguous groupings. The buffer count
m has to be in the state because of the sparsifier's start-up a; that makes it O(L³) arithmetic,
done as O(L) vectorised numpy steps (L = 500 takes well under a second). Ties go to fewer buffers.

**No core of its own (ours, as SSFusion-I's split: schedule/ssfusion.py).** The recurrence lets
a buffer's all-gather run beside the next buffers' backward. Where the host's cores, shared out
over its ranks, leave the communication threads no core beside the training thread's
(:attr:`~gradsync.schedule.costmodel.CostModel.worker_has_a_core`), the all-gather's start-ups
and their CPU work ((P−1)α + the collective's fixed compute) take that core: each buffer then
adds them to the compute stream too, as the sparsifier's start-up ``a`` does: the DP is then
exact for that recurrence (``simulate`` with ``a`` raised by them). Measured on 2 cores at
P = 4 (docs/results/speed.md, "Fusion without a spare core"): SSFusion-OI's CNN plan of two
buffers made two all-gathers a step, 6 ring rounds against TopkA's 3, for no overlap.
"""

from __future__ import annotations

import numpy as np

from gradsync.schedule.costmodel import CostModel
from gradsync.sparsegrad import target_k

__all__ = ["cupcake_groups"]


def cupcake_groups(names: list[str], numel: dict[str, int], cost: CostModel,
                   density: float) -> tuple[list[list[str]], float]:
    """The contiguous grouping of ``names`` minimising the simulated iteration time of fused
    sparsification at ``density``, and that time."""
    L = len(names)
    tb = np.array([cost.backward[n] for n in names], dtype=np.float64)
    ns = np.array([numel[n] for n in names], dtype=np.int64)
    B = np.concatenate([[0.0], np.cumsum(tb)])
    N = np.concatenate([[0], np.cumsum(ns)])
    a, b = cost.sparsify.a, cost.sparsify.b
    if not cost.worker_has_a_core:  # no core of its own (module doc): each buffer's start-ups
        a += (cost.P - 1) * cost.allgather.alpha + cost.t_compute_allgather(0)  # hold it
    # T_cm of group (i, j] for every pair (Eq. 3 on k(N_j − N_i) entries), vectorised; k is
    # the one rule target_k, evaluated once per distinct group size.
    sizes = np.maximum(N[None, :] - N[:, None], 0)  # [i, j] = N_j − N_i
    uniq, inv = np.unique(sizes, return_inverse=True)
    k = np.array([target_k(int(s), density) for s in uniq], dtype=np.int64)[inv]
    k = k.reshape(sizes.shape)
    p, ab = cost.P, cost.allgather
    C = (p - 1) * ab.alpha + (p - 1) * (k * cost.entry_bytes) * ab.beta
    E = np.full((L + 1, L + 1), np.inf)  # E[m, j]
    E[0, 0] = 0.0
    parent = np.zeros((L + 1, L + 1), dtype=np.int64)
    for j in range(1, L + 1):
        m = np.arange(1, j + 1)
        R = B[j] + b * N[j] + a * m  # R(j, m)
        val = np.maximum(R[:, None], E[0:j, 0:j]) + C[None, 0:j, j]  # [m−1, i]
        arg = np.argmin(val, axis=1)
        E[1: j + 1, j] = val[m - 1, arg]
        parent[1: j + 1, j] = arg
    m_best = int(np.argmin(E[:, L]))
    best = float(E[m_best, L])
    groups: list[list[str]] = []
    j, m = L, m_best
    while j > 0:
        i = int(parent[m, j])
        groups.append(names[i:j])
        j, m = i, m - 1
    groups.reverse()
    return groups, best
