"""DGC's sampled threshold (Deep Gradient Compression, Lin et al. 2018; SSFusion §II, [44]).

The top-k threshold is estimated on a strided sample instead of the whole tensor:

1. sample: ``s = max(⌈1% · n⌉, ⌈2/density⌉)`` elements with stride ``⌊n/s⌋`` from a random
   start (the sparsifier's own generator), so the sample holds ≥ 1% of the elements and ≥ 2
   expected top-k entries;
2. threshold: ``thr`` = the smallest of the sample's top-k′, ``k′ = ⌈density · |sample|⌉``;
3. select ``|x| ≥ thr``; up to 10 adjustments: when fewer than ``0.8·k`` are selected,
   ``thr ← 0.8·thr`` and select again; when more than ``1.3·k``, take the exact top-k among the
   candidates and stop;
4. truncate to k.

docs/architecture.md, "Facts from the reference implementations" (DGC threshold): the
reference truncates to the *first* k candidates by position, which drops large entries at high
indices; here the truncation keeps the k largest candidates (a top-k over at most 1.3·k values,
cheap). The result therefore never exceeds k and, unless
all 10 adjustments were used, holds at least 0.8·k entries.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from gradsync.sparsify import registry
from gradsync.sparsify.base import Sparsifier, magnitudes


@registry.register("dgc")
class DGC(Sparsifier):
    def __init__(self, density: float, *, seed: int = 0, sample_ratio: float = 0.01,
                 max_adjust: int = 10, lower: float = 0.8, upper: float = 1.3) -> None:
        super().__init__(density, seed=seed)
        if not 0.0 < sample_ratio <= 1.0:
            raise ValueError(f"dgc: sample_ratio must be in (0, 1], got {sample_ratio}")
        if max_adjust < 0:
            raise ValueError(f"dgc: max_adjust must be >= 0, got {max_adjust}")
        if not 0.0 < lower < 1.0 < upper:
            raise ValueError(f"dgc: need 0 < lower < 1 < upper, got {lower}, {upper}")
        self.sample_ratio = float(sample_ratio)
        self.max_adjust = int(max_adjust)
        self.lower, self.upper = float(lower), float(upper)
        self.last_adjustments = 0

    def _sample(self, a: torch.Tensor) -> torch.Tensor:
        n = a.numel()
        s = max(math.ceil(self.sample_ratio * n), math.ceil(2.0 / self.density))
        if s >= n:
            return a
        stride = n // s  # ⌈(n − start)/stride⌉ ≥ s for every start < stride
        start = int(torch.randint(stride, (1,), generator=self.generator))
        return a[start::stride]

    @property
    def last_threshold(self) -> float | None:
        """The threshold of the last selection. It stays a 0-dim tensor on the input's device
        until read (reading it waits for the device; a selection itself does not)."""
        if isinstance(self._last_thr, torch.Tensor):
            self._last_thr = float(self._last_thr)
        return self._last_thr

    @last_threshold.setter
    def last_threshold(self, value: float | torch.Tensor | None) -> None:
        self._last_thr = value

    def _select(self, x: torch.Tensor, k: int, step: int) -> torch.Tensor:
        a = magnitudes(x)
        sample = self._sample(a)
        k_s = min(sample.numel(), max(1, math.ceil(self.density * sample.numel())))
        # thr in float64 on the device, as a Python float would be, without reading it back:
        # the comparisons round it to fp32 either way, and ×0.8 is the same IEEE product
        thr = torch.topk(sample, k_s, sorted=False).values.min().double()
        idx = torch.nonzero(a >= thr).view(-1)
        adjustments = 0
        while adjustments < self.max_adjust:
            count = idx.numel()
            if count > self.upper * k:
                # Too many: exact top-k among the candidates, done.
                idx = idx[torch.topk(a[idx], k, sorted=False).indices]
                break
            if count >= self.lower * k:
                break
            thr = thr * self.lower  # too few: lower the threshold by 0.8 and select again
            idx = torch.nonzero(a >= thr).view(-1)
            adjustments += 1
        if idx.numel() > k:  # truncate to k, keeping the largest candidates
            idx = idx[torch.topk(a[idx], k, sorted=False).indices]
        self.last_threshold = thr
        self.last_adjustments = adjustments
        return idx

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "last_threshold": self.last_threshold}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.last_threshold = state.get("last_threshold")
