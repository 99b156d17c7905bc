"""Gaussian-k: threshold from a normal fit, then adaptive correction (Shi et al. 2019 [22/41];
SSFusion §II; Ok-Topk §2 and §5.4, its Gaussiank baseline).

Fit x ~ N(μ, σ²) with the tensor's mean and standard deviation; the two tails together hold a
fraction ``density`` when ``|x − μ| > z·σ`` with ``z = −Φ⁻¹(density/2)`` (the normal
percent-point function, ``torch.special.ndtri``). The selection is by magnitude, so the
threshold is ``τ = |μ| + z·σ`` and the rule is ``|x| > τ``.

Real gradients are heavier-tailed and more peaked than the Gaussian (Ok-Topk Fig. 4): σ is
inflated by the tail, τ lands too high and the count is far *below* k. Gaussiank therefore
corrects the threshold adaptively (lower it when too few, raise it when too many: ×0.5 / ×1.5
in the reference, a few times). Ok-Topk's evaluation scales it "until the number of selected
values is more than 3k/4". Here: up to ``max_adjust`` corrections until the count lies in
``[lower·k, upper·k]`` (default [2k/3, 4k/3]); ×0.5 / ×1.5 until the target is bracketed, then
the geometric mean of the bracket (the reference's fixed factors can oscillate). The best
threshold seen is used. No truncation: the count may exceed k (at most by ``upper`` once the
window is reached).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from gradsync.sparsify import registry
from gradsync.sparsify.base import Sparsifier, magnitudes


@registry.register("gaussiank")
class GaussianK(Sparsifier):
    def __init__(self, density: float, *, seed: int = 0, max_adjust: int = 6,
                 lower: float = 2 / 3, upper: float = 4 / 3) -> None:
        super().__init__(density, seed=seed)
        if max_adjust < 0:
            raise ValueError(f"gaussiank: max_adjust must be >= 0, got {max_adjust}")
        if not 0.0 < lower <= 1.0 <= upper:
            raise ValueError(f"gaussiank: need 0 < lower <= 1 <= upper, got {lower}, {upper}")
        self.max_adjust = int(max_adjust)
        self.lower, self.upper = float(lower), float(upper)
        self.last_adjustments = 0
        self.last_gaussian_threshold: float | None = None

    def _select(self, x: torch.Tensor, k: int, step: int) -> torch.Tensor:
        a = magnitudes(x)
        std, mean = torch.std_mean(x.float())
        # z = −Φ⁻¹(density/2): the two tails of N(μ, σ²) beyond μ ± zσ hold the density.
        z = -float(torch.special.ndtri(torch.tensor(self.density / 2, dtype=torch.float64)))
        tau = abs(float(mean)) + z * float(std)
        self.last_gaussian_threshold = tau

        def miss(count: int) -> float:  # distance of count from k on a log scale
            return abs(math.log((count + 0.5) / k))

        count = int((a > tau).sum())
        best_tau, best_count = tau, count
        too_high = too_low = None  # thresholds known to give too few / too many
        adjustments = 0
        while adjustments < self.max_adjust and not (
            self.lower * k <= count <= self.upper * k
        ):
            if count < self.lower * k:
                too_high = tau
                tau = tau * 0.5 if too_low is None else math.sqrt(too_low * tau)
            else:
                too_low = tau
                tau = tau * 1.5 if too_high is None else math.sqrt(too_high * tau)
            count = int((a > tau).sum())
            adjustments += 1
            if miss(count) < miss(best_count):
                best_tau, best_count = tau, count
        self.last_threshold = best_tau
        self.last_adjustments = adjustments
        return torch.nonzero(a > best_tau).view(-1)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "last_threshold": self.last_threshold}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.last_threshold = state.get("last_threshold")
