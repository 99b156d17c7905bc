"""MG-WFBP / OMGS merging (Shi et al.; SSFusion §II-E "OMGS"), on the cost model.

Wait-free backpropagation sends each gradient as soon as it is ready; MG-WFBP merges gradient l
into the buffer before it when that saves more start-up time (α, and with multi-tensor
sparsification the sparsifier's start-up ``a``) than it delays the buffer. OMGS applies the
rule with the buffer sparsified as one vector (mode ``"fused"``).

Walking the gradients in backward order we keep the state of the simulator's recurrence
(compute clock ``c``, end of the previous buffer's communication ``e``) and, for gradient l,
compare the finish time of the two choices:

* merge:  ready = c + T_b^l + T_sp(n_cur + n_l);  end = max(ready, e) + T_cm(n_cur + n_l)
* split:  the current buffer is closed when its last gradient is ready
  (ready₁ = c + T_sp(n_cur), end₁ = max(ready₁, e) + T_cm(n_cur)), then gradient l alone
  (ready₂ = ready₁ + T_b^l + T_sp(n_l), end₂ = max(ready₂, end₁) + T_cm(n_l)).

It merges when ``end ≤ end₂``: the merged message finishes no later, i.e. the start-up saved is
at least the delay. This is a greedy rule (MG-WFBP's), not a global optimum; Cupcake's DP
(cupcake.py) is.
"""

from __future__ import annotations

from collections.abc import Callable

from gradsync.schedule.costmodel import CostModel
from gradsync.schedule.plan import entries

__all__ = ["fused_comm", "mgwfbp_groups"]


def fused_comm(cost: CostModel, density: float) -> Callable[[int], float]:
    """T_cm of a fused buffer of n elements sparsified at ``density`` (all-gather, Eq. 3)."""
    return lambda n: cost.t_allgather(entries(n, density) * cost.entry_bytes)


def mgwfbp_groups(names: list[str], numel: dict[str, int], cost: CostModel,
                  density: float) -> list[list[str]]:
    """MG-WFBP merging of ``names`` (backward order) with fused sparsification."""
    t_cm = fused_comm(cost, density)
    t_sp = cost.t_sparsify
    groups: list[list[str]] = [[names[0]]]
    c = cost.backward[names[0]]  # compute clock: last gradient of the open buffer is ready
    e = 0.0  # end of the communication of the buffers before the open one
    n_cur = numel[names[0]]
    for name in names[1:]:
        tb, n = cost.backward[name], numel[name]
        ready = c + tb + t_sp(n_cur + n)
        merged_end = max(ready, e) + t_cm(n_cur + n)
        ready1 = c + t_sp(n_cur)
        end1 = max(ready1, e) + t_cm(n_cur)
        ready2 = ready1 + tb + t_sp(n)
        split_end = max(ready2, end1) + t_cm(n)
        if merged_end <= split_end:
            groups[-1].append(name)
            n_cur += n
            c += tb
        else:
            groups.append([name])
            e, c, n_cur = end1, ready1 + tb, n
    return groups
