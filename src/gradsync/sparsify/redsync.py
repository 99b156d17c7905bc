"""RedSync's trimmed top-k threshold search (Fang et al. 2019 [23]; SSFusion §II).

RedSync searches the threshold between the mean and the maximum of |x| by binary search on a
ratio r ∈ [0, 1]:

    thr = mean + r · (max − mean);  nnz = #{|x| > thr}
    nnz within tolerance of k → stop;  nnz too large → l = r;  too small → r_hi = r

with a bounded number of iterations. The reference stops when ``k < nnz < 2k`` or after the
ratio interval falls under 0.2 (three probes), which on heavy-tailed gradients leaves the count
far from k: most of the top-k threshold's precision lies at small r. Here the acceptance window
is ``[lower·k, upper·k]`` (default [2k/3, 4k/3]) and the search runs up to ``max_iters``
halvings (default 40), returning the closest count seen. When even ``thr = mean`` selects too
few (possible for density ≳ 0.3), the search interval is widened down to 0.

Each probe counts only the values still inside the current interval: values above the upper
end are already counted and values below the lower end never matter, so the work per probe
shrinks geometrically (the answer is the same as recounting the whole tensor).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from gradsync.sparsegrad import positions_above
from gradsync.sparsify import registry
from gradsync.sparsify.base import Sparsifier, magnitudes


@registry.register("redsync")
class RedSync(Sparsifier):
    def __init__(self, density: float, *, seed: int = 0, max_iters: int = 40,
                 lower: float = 2 / 3, upper: float = 4 / 3) -> None:
        super().__init__(density, seed=seed)
        if max_iters < 1:
            raise ValueError(f"redsync: max_iters must be >= 1, got {max_iters}")
        if not 0.0 < lower <= 1.0 <= upper:
            raise ValueError(f"redsync: need 0 < lower <= 1 <= upper, got {lower}, {upper}")
        self.max_iters = int(max_iters)
        self.lower, self.upper = float(lower), float(upper)
        self.last_iters = 0

    def _select(self, x: torch.Tensor, k: int, step: int) -> torch.Tensor:
        a = magnitudes(x)
        mean, top = float(a.mean()), float(a.max())
        lo_k, hi_k = self.lower * k, self.upper * k
        lo, hi = mean, top  # thr = lo + r·(hi − lo); the search is on r
        above_hi = int((a > hi).sum())  # 0: nothing exceeds the max
        inside = a[a > lo]  # values in (lo, hi]; #{a > thr} = above_hi + #{inside > thr}
        if above_hi + inside.numel() < lo_k:  # even the mean is too high: search from 0
            lo, inside = 0.0, a[a > 0]

        def miss(count: int) -> float:
            return abs(math.log((count + 0.5) / k))

        best_thr, best_count = lo, above_hi + inside.numel()
        iters = 0
        while iters < self.max_iters and not lo_k <= best_count <= hi_k:
            thr = lo + 0.5 * (hi - lo)
            if not lo < thr < hi:  # interval exhausted at float precision (ties)
                break
            mask = inside > thr
            count = above_hi + int(mask.sum())
            iters += 1
            if miss(count) < miss(best_count):
                best_thr, best_count = thr, count
            if count > hi_k:  # too many: raise the lower end
                lo, inside = thr, inside[mask]
            elif count < lo_k:  # too few: lower the upper end
                hi, above_hi, inside = thr, count, inside[~mask]
            else:
                break
        self.last_threshold = best_thr
        self.last_iters = iters
        return positions_above(a, best_thr, strict=True)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "last_threshold": self.last_threshold}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.last_threshold = state.get("last_threshold")
