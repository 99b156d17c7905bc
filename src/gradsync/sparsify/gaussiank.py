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

import functools
import math
from typing import Any

import torch

from gradsync.sparsegrad import positions_above
from gradsync.sparsify import registry, segments
from gradsync.sparsify.base import LazyScalar, Sparsifier, magnitudes


@functools.lru_cache(maxsize=64)
def _z(density: float) -> float:
    """z = −Φ⁻¹(density/2): the two tails of N(μ, σ²) beyond μ ± zσ hold the density (read
    once per density, not per selection)."""
    return -float(torch.special.ndtri(torch.tensor(density / 2, dtype=torch.float64)))


@registry.register("gaussiank")
class GaussianK(Sparsifier):
    # the rounds on the device leave these as 0-dim tensors: read only when asked for
    last_adjustments = LazyScalar(int)  # threshold corrections of the last selection
    last_gaussian_threshold = LazyScalar(float)  # the normal fit's τ, before any correction

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
        self.last_gaussian_threshold = None

    def _select(self, x: torch.Tensor, k: int, step: int) -> torch.Tensor:
        a = magnitudes(x)
        std, mean = torch.std_mean(x.float())
        if segments.pays_on(x.device):  # the rounds on the device: one read, the selection's
            best_tau = self._rounds_on_device(a, std, mean, k)
            return positions_above(a, best_tau, strict=True)
        tau = abs(float(mean)) + _z(self.density) * float(std)
        self.last_gaussian_threshold = tau

        def miss(count: int) -> float:  # distance of count from k on a log scale: the order
            r = (count + 0.5) / k  # of |log r| is that of max(r, 1/r) (no rounding of a log)
            return max(r, 1 / r)

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
        return positions_above(a, best_tau, strict=True)

    def _rounds_on_device(self, a: torch.Tensor, std: torch.Tensor, mean: torch.Tensor,
                          k: int) -> torch.Tensor:
        """The same rounds as the host loop, as float64 tensors on ``a``'s device and without a
        read: every one of the ``max_adjust`` rounds runs, a round after the count reached the
        window changing nothing (on a GPU ``max_adjust`` more passes over ``a`` cost less than
        one wait for the device). ``miss`` compares ``max(r, 1/r)``, ``r = (count + ½)/k``: the
        order of ``|log r|`` without a logarithm, so host and device agree to the bit. The
        thresholds are kept as 0-dim tensors (read when asked for)."""
        lo_k, hi_k = self.lower * k, self.upper * k

        def miss(count: torch.Tensor) -> torch.Tensor:
            r = (count + 0.5) / k
            return torch.maximum(r, 1 / r)

        tau = mean.double().abs() + _z(self.density) * std.double()
        self.last_gaussian_threshold = tau
        count = (a > tau).sum().double()
        best_tau, best_miss = tau, miss(count)
        nan = torch.full_like(tau, math.nan)
        too_high, too_low = nan, nan  # thresholds known to give too few / too many (NaN: none)
        adjustments = torch.zeros_like(count)
        for _ in range(self.max_adjust):
            active = (count < lo_k) | (count > hi_k)
            few = count < lo_k
            lowered = torch.where(too_low.isnan(), tau * 0.5, (too_low * tau).sqrt())
            raised = torch.where(too_high.isnan(), tau * 1.5, (too_high * tau).sqrt())
            too_high = torch.where(active & few, tau, too_high)
            too_low = torch.where(active & ~few, tau, too_low)
            tau = torch.where(active, torch.where(few, lowered, raised), tau)
            count = torch.where(active, (a > tau).sum().double(), count)
            adjustments = adjustments + active
            m = miss(count)
            better = active & (m < best_miss)
            best_tau = torch.where(better, tau, best_tau)
            best_miss = torch.where(better, m, best_miss)
        self.last_threshold = best_tau
        self.last_adjustments = adjustments
        return best_tau

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "last_threshold": self.last_threshold}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.last_threshold = state.get("last_threshold")
