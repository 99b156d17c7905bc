"""SIDCo: multi-stage statistical threshold (Abdelmoniem et al., MLSys 2021 [24]; SSFusion §II).

SIDCo models the gradient magnitudes with a sparsity-inducing distribution and reads the
threshold off its fitted quantile, refining it over M stages on the exceedances (peaks over
threshold):

* stage 1: fit the distribution to |x|; η₁ = the quantile leaving a fraction δ₁ above it;
* stage m > 1: fit the *exceedances* y = |x| − η_{m−1} (over |x| > η_{m−1}) and set
  η_m = η_{m−1} + the quantile of the fit leaving a fraction δ_m above it;
* the stage ratios multiply to the target: δ₁ · δ₂ ⋯ δ_M = density.

Distributions (``dist``):

* ``"exp"`` (SIDCo-E, double exponential for x ⇔ exponential for |x|): the MLE scale is the
  mean, β̂ = mean(y), and the quantile is ``−β̂ · ln δ``;
* ``"gpareto"`` (SIDCo-GP, generalized Pareto, the limit law of exceedances): shape ξ and
  scale σ by the method of moments, ``ξ = ½(1 − μ²/s²)``, ``σ = ½ μ (μ²/s² + 1)``, and the
  quantile is ``σ/ξ · (δ^(−ξ) − 1)`` (→ ``−σ ln δ`` as ξ → 0, the exponential).

Number of stages chosen by the density (SIDCo's adaptive-stage rule): with first-stage ratio
δ₁ (``first_ratio``, default 0.25) and per-stage ratio δᵢ (``stage_ratio``, default 0.25),
M = 1 when density ≥ δ₁, else M = 1 + ⌈ln(density/δ₁) / ln δᵢ⌉; the middle stages use δᵢ and
the last stage the remainder so the product is exactly the density. ``stages=M`` fixes M
instead (the ratios after the first are then equal: (density/δ₁)^(1/(M−1))).

Selection is ``|x| > η_M`` over the whole tensor; the count is statistical, not bounded.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from gradsync.sparsify import registry
from gradsync.sparsify.base import Sparsifier, magnitudes

_DISTS = ("exp", "gpareto")


def _exp_quantile(y: torch.Tensor, delta: float) -> float:
    """Exponential MLE on y ≥ 0: β̂ = mean(y); P(Y > q) = δ at q = −β̂ ln δ."""
    return -float(y.mean()) * math.log(delta)


def _gpareto_quantile(y: torch.Tensor, delta: float) -> float:
    """Generalized Pareto (location 0) by moments; P(Y > q) = δ at q = σ/ξ (δ^(−ξ) − 1)."""
    var, mu = torch.var_mean(y.double(), correction=0)
    mu, var = float(mu), float(var)
    if var <= 0.0 or mu <= 0.0:  # degenerate (constant exceedances): no tail to model
        return 0.0
    r = mu * mu / var
    xi = 0.5 * (1.0 - r)
    sigma = 0.5 * mu * (r + 1.0)
    if abs(xi) < 1e-6:
        return -sigma * math.log(delta)
    return sigma / xi * (delta ** (-xi) - 1.0)


@registry.register("sidco")
class SIDCo(Sparsifier):
    def __init__(self, density: float, *, seed: int = 0, dist: str = "exp",
                 stages: int | None = None, first_ratio: float = 0.25,
                 stage_ratio: float = 0.25) -> None:
        super().__init__(density, seed=seed)
        if dist not in _DISTS:
            raise ValueError(f"sidco: dist must be one of {_DISTS}, got {dist!r}")
        if stages is not None and int(stages) < 1:
            raise ValueError(f"sidco: stages must be >= 1 or None (by density), got {stages}")
        for nm, r in (("first_ratio", first_ratio), ("stage_ratio", stage_ratio)):
            if not 0.0 < r < 1.0:
                raise ValueError(f"sidco: {nm} must be in (0, 1), got {r}")
        self.dist = dist
        self.stages = None if stages is None else int(stages)
        self.first_ratio, self.stage_ratio = float(first_ratio), float(stage_ratio)
        self.last_stages = 0

    def stage_ratios(self) -> list[float]:
        """δ₁, …, δ_M with δ₁ · ⋯ · δ_M = density."""
        d, d1 = self.density, self.first_ratio
        if d >= d1 or self.stages == 1:
            return [d]
        rest = d / d1
        if self.stages is not None:
            return [d1] + [rest ** (1.0 / (self.stages - 1))] * (self.stages - 1)
        m = max(1, math.ceil(math.log(rest) / math.log(self.stage_ratio) - 1e-9))
        return [d1] + [self.stage_ratio] * (m - 1) + [rest / self.stage_ratio ** (m - 1)]

    def _select(self, x: torch.Tensor, k: int, step: int) -> torch.Tensor:
        a = magnitudes(x)
        quantile = _exp_quantile if self.dist == "exp" else _gpareto_quantile
        eta = 0.0
        tail = a  # stage 1 fits |x| itself (location 0)
        stages = 0
        for m, delta in enumerate(self.stage_ratios()):
            if m:  # the exceedances over η_{m−1}, from the previous stage's tail
                tail = tail[tail > eta]
                if tail.numel() == 0:
                    break  # nothing left to fit
            eta = eta + quantile(tail - eta if m else tail, delta)
            stages += 1
        self.last_threshold = eta
        self.last_stages = stages
        return torch.nonzero(a > eta).view(-1)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "last_threshold": self.last_threshold}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.last_threshold = state.get("last_threshold")
