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

**Initial number of stages** (by the density): with first-stage ratio δ₁ (``first_ratio``,
default 0.25) and per-stage ratio δᵢ (``stage_ratio``, default 0.25), M = 1 when density ≥ δ₁,
else M = 1 + ⌈ln(density/δ₁) / ln δᵢ⌉; the middle stages use δᵢ and the last stage the
remainder so the product is exactly the density. Any other M uses equal ratios after the
first, (density/δ₁)^(1/(M−1)). ``stages=M`` fixes M (no adaptation).

**Adaptive stages** (SIDCo §4, ``adapt=True``, the default when ``stages`` is None). A fit
with no count feedback misses k by a factor that depends on the data: on a mixture of layer
scales the exponential MLE lands 4–20× above k with one stage and 3–6× below it with the
density rule's 4–5 stages (count/k 0.15–0.30 at 1%). SIDCo therefore adapts M online: the
achieved ratio count/k is averaged over Q calls (``period``, Q = 5 as in the reference); when
the average leaves the band [1 − ε, 1 + ε] (``band`` ε = 0.2) M moves by one — up (a higher
threshold) when too many were selected, down when too few — within [1, ⌈log₂(1/δ)⌉] (1 when
δ ≥ δ₁). Two additions of ours, both measured on heavy-tailed data and CNN gradients
(tests/test_selection.py): (1) the last average seen at each M is remembered for ``memory``
windows, and M does not move to a neighbour known to be worse (further from 1 in log ratio) —
without this, data whose ratio jumps across the band between two M (e.g. 5.6 at M = 1 and 0.72
at M = 2) makes M oscillate and half the windows send 5× k; (2) when the usual direction is
blocked (bound, or known worse) and the other neighbour is unknown or better, M moves there:
the generalized-Pareto fit's count can grow with M. The reference starts from M = 1; we start
from the density rule above, so the first Q calls do not send up to 20× k. The reference may
also adapt δ₁ (0.05…0.5); we keep it fixed: on these inputs count/k is not monotone in δ₁ and
moves by less than a factor 1.5 over that range, while one stage moves it by 2–6×.

Selection is ``|x| > η_M`` over the whole tensor; the count is statistical, not bounded.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from gradsync.sparsegrad import positions_above
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


def _initial_ratios(density: float, d1: float, di: float) -> list[float]:
    """The density rule: δ₁, then δᵢ while needed, the remainder last (product = density)."""
    if density >= d1:
        return [density]
    rest = density / d1
    m = max(1, math.ceil(math.log(rest) / math.log(di) - 1e-9))
    return [d1] + [di] * (m - 1) + [rest / di ** (m - 1)]


@registry.register("sidco")
class SIDCo(Sparsifier):
    def __init__(self, density: float, *, seed: int = 0, dist: str = "exp",
                 stages: int | None = None, first_ratio: float = 0.25,
                 stage_ratio: float = 0.25, adapt: bool | None = None, period: int = 5,
                 band: float = 0.2, memory: int = 20) -> None:
        super().__init__(density, seed=seed)
        if dist not in _DISTS:
            raise ValueError(f"sidco: dist must be one of {_DISTS}, got {dist!r}")
        if stages is not None and int(stages) < 1:
            raise ValueError(f"sidco: stages must be >= 1 or None (by density), got {stages}")
        for nm, r in (("first_ratio", first_ratio), ("stage_ratio", stage_ratio)):
            if not 0.0 < r < 1.0:
                raise ValueError(f"sidco: {nm} must be in (0, 1), got {r}")
        if int(period) < 1 or int(memory) < 1:
            raise ValueError(f"sidco: period (Q) and memory must be >= 1, got {period}, {memory}")
        if not 0.0 < band < 1.0:
            raise ValueError(f"sidco: band must be in (0, 1), got {band}")
        if adapt and stages is not None:
            raise ValueError("sidco: adapt=True needs stages=None (a fixed M does not adapt)")
        self.dist = dist
        self.stages = None if stages is None else int(stages)
        self.first_ratio, self.stage_ratio = float(first_ratio), float(stage_ratio)
        self.adapt = stages is None if adapt is None else bool(adapt)
        self.period, self.band, self.memory = int(period), float(band), int(memory)
        self._initial = _initial_ratios(self.density, self.first_ratio, self.stage_ratio)
        self.m_max = 1 if self.density >= self.first_ratio else max(
            1, math.ceil(math.log2(1.0 / self.density) - 1e-9))
        # M: fixed, or the density rule's to start with (clamped to the adaptive bounds)
        self.m = self.stages if self.stages is not None else (
            min(len(self._initial), self.m_max) if self.adapt else len(self._initial))
        self.window: list[float] = []  # count/k of the calls of the current window
        self.windows = 0  # windows completed
        self.seen: dict[int, tuple[float, int]] = {}  # M → (its last average, window index)
        self.last_stages = 0

    def stage_ratios(self) -> list[float]:
        """δ₁, …, δ_M with δ₁ · ⋯ · δ_M = density (M = the current number of stages)."""
        d, d1, m = self.density, self.first_ratio, self.m
        if d >= d1 or m == 1:
            return [d]
        if self.stages is None and m == len(self._initial):
            return list(self._initial)
        return [d1] + [(d / d1) ** (1.0 / (m - 1))] * (m - 1)

    def _adapt(self, ratio: float) -> None:
        """One call's count/k; every Q calls, move M by one when the average left the band."""
        self.window.append(ratio)
        if len(self.window) < self.period:
            return
        r = sum(self.window) / len(self.window)
        self.window = []
        self.seen[self.m] = (r, self.windows)
        self.windows += 1
        if 1.0 - self.band <= r <= 1.0 + self.band:
            return
        up = r > 1.0 + self.band  # too many: more stages raise the threshold
        miss = abs(math.log(max(r, 1e-12)))
        for j, c in enumerate((self.m + 1, self.m - 1) if up else (self.m - 1, self.m + 1)):
            if not 1 <= c <= self.m_max:
                continue
            known = self.seen.get(c)
            if known is not None and self.windows - known[1] > self.memory:
                known = None  # stale: the gradients have moved on
            if known is None and j == 0:
                self.m = c  # the usual direction, not tried recently
                return
            if known is not None and abs(math.log(max(known[0], 1e-12))) < miss:
                self.m = c  # a neighbour known to be closer to k
                return
            if known is None:  # the usual direction is blocked: explore the other one
                self.m = c
                return

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
        idx = positions_above(a, eta, strict=True)
        if self.adapt:
            self._adapt(idx.numel() / k)
        return idx

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "last_threshold": self.last_threshold, "m": self.m,
                "window": list(self.window), "windows": self.windows,
                "seen": {str(m): list(v) for m, v in self.seen.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.last_threshold = state.get("last_threshold")
        if "m" in state:
            m = int(state["m"])
            if not 1 <= m <= max(self.m_max, self.m):
                raise ValueError(f"sidco: saved number of stages {m} is out of range")
            self.m = m
            self.window = [float(r) for r in state["window"]]
            self.windows = int(state["windows"])
            self.seen = {int(m): (float(v[0]), int(v[1])) for m, v in state["seen"].items()}
