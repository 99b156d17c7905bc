"""Ok-Topk's threshold reuse (Ok-Topk §3.1.3, Algorithm 1 lines 2–4; docs/papers.md,
"Ok-Topk").

The gradient values form a slowly changing stochastic process, so the top-k threshold of one
iteration is a good threshold for the next ones. Every τ′ iterations (``period``, 32 by default;
Ok-Topk uses 128 for BERT) the *accurate* threshold is computed — the k-th largest |x| — and
the exact top-k is selected; in the τ′ − 1 iterations in between the threshold is reused and
the selection is one comparison per element, ``|x| ≥ thr``.

Between recomputations the count is kept in ``[2k/3, 4k/3]`` by small multiplicative nudges of
the reused threshold (×``nudge`` up when too many, ÷``nudge`` down when too few; the geometric
mean once both sides are known), at most ``max_nudges`` per call; the nudged threshold is kept
for the following calls, so it tracks slow drift. If the nudges do not bring the count into
the window, the accurate threshold is recomputed on the spot (and the period restarts), so the
count is *always* in ``[2k/3, 4k/3]`` (exactly k on recomputation).

The period is counted by the ``step`` passed to ``select`` (``clock="step"``: recompute when
``step − last_exact_step ≥ τ′`` or the step went backwards) or by this sparsifier's own call
count (``clock="calls"``, the default, for callers that pass no step). A tensor of a different
size than the last one also forces a recomputation. ``state_dict`` carries the threshold and
the counters, so a resumed run reuses exactly where it stopped.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from gradsync.sparsegrad import positions_above, top_k
from gradsync.sparsify import registry, segments
from gradsync.sparsify.base import LazyScalar, Sparsifier, magnitudes

_CLOCKS = ("calls", "step")


@registry.register("threshold")
class ThresholdReuse(Sparsifier):
    # the reused threshold; where segments pay (an accelerator), an exact recomputation leaves
    # it on the device, and the next reuse starts from it there (no read)
    thr = LazyScalar(float)

    def __init__(self, density: float, *, seed: int = 0, period: int = 32,
                 clock: str = "calls", nudge: float = 1.2, max_nudges: int = 3) -> None:
        super().__init__(density, seed=seed)
        if int(period) < 1:
            raise ValueError(f"threshold: period (τ′) must be >= 1, got {period}")
        if clock not in _CLOCKS:
            raise ValueError(f"threshold: clock must be one of {_CLOCKS}, got {clock!r}")
        if not nudge > 1.0:
            raise ValueError(f"threshold: nudge must be > 1, got {nudge}")
        if int(max_nudges) < 0:
            raise ValueError(f"threshold: max_nudges must be >= 0, got {max_nudges}")
        self.period, self.clock = int(period), clock
        self.nudge, self.max_nudges = float(nudge), int(max_nudges)
        self.thr = None
        self.calls_since_exact = 0
        self.last_exact_step: int | None = None
        self.last_numel: int | None = None
        self.exact_count = 0  # how many accurate recomputations so far
        self.last_exact = False
        self.last_nudges = 0

    def _held(self) -> float | torch.Tensor | None:
        """The reused threshold as kept (a device tensor is not read)."""
        return ThresholdReuse.thr.raw(self)

    def _due(self, n: int, step: int) -> bool:
        if self._held() is None or n != self.last_numel:
            return True
        if self.clock == "calls":
            return self.calls_since_exact >= self.period
        last = self.last_exact_step if self.last_exact_step is not None else step
        return step - last >= self.period or step < last

    def _exact(self, a: torch.Tensor, k: int, step: int) -> torch.Tensor:
        """Accurate threshold: the k-th largest |x|; select the exact top-k."""
        vals, idx = top_k(a, k)
        self.thr = vals.min() if segments.pays_on(a.device) else float(vals.min())
        self.calls_since_exact = 0
        self.last_exact_step = step
        self.exact_count += 1
        self.last_exact = True
        return idx

    def _select(self, x: torch.Tensor, k: int, step: int) -> torch.Tensor:
        a = magnitudes(x)
        n = a.numel()
        self.last_exact, self.last_nudges = False, 0
        if self._due(n, step):
            idx = self._exact(a, k, step)
        else:
            idx = self._reuse(a, k)
            if idx is None:  # nudges did not reach [2k/3, 4k/3]: recompute now
                idx = self._exact(a, k, step)
        self.last_numel = n
        self.calls_since_exact += 1
        self.last_threshold = self._held()
        return idx

    def _reuse(self, a: torch.Tensor, k: int) -> torch.Tensor | None:
        if segments.pays_on(a.device):
            return self._reuse_on_device(a, k)
        thr = self.thr
        assert thr is not None
        too_low = too_high = None  # thresholds known to select too many / too few
        # each round's positions, compared on the host where the CPU's own kernels run
        # (positions_above: numpy's compare and compaction, not torch's unvectorised bool pass
        # and a sum to read): the count is their length
        idx = positions_above(a, thr)
        count = idx.numel()
        nudges = 0
        while not 2 * k <= 3 * count <= 4 * k:  # count ∉ [2k/3, 4k/3]
            if nudges == self.max_nudges:
                self.last_nudges = nudges
                return None
            if 3 * count > 4 * k:
                too_low = thr
                thr = thr * self.nudge if too_high is None else math.sqrt(thr * too_high)
            else:
                too_high = thr
                thr = thr / self.nudge if too_low is None else math.sqrt(thr * too_low)
            idx = positions_above(a, thr)
            count = idx.numel()
            nudges += 1
        self.thr = thr
        self.last_nudges = nudges
        return idx

    def _reuse_on_device(self, a: torch.Tensor, k: int) -> torch.Tensor | None:
        """:meth:`_reuse` with the nudges as float64 tensors on ``a``'s device: every one of the
        ``max_nudges`` rounds runs (one past the window changes nothing) and one read brings
        back whether the count reached the window, the count and the threshold; the selection
        is then made at that known size (no second read)."""
        kept = self._held()
        assert kept is not None
        thr = (kept.to(a.device, torch.float64) if isinstance(kept, torch.Tensor)
               else torch.full((), kept, dtype=torch.float64, device=a.device))

        def outside(count: torch.Tensor) -> torch.Tensor:  # count ∉ [2k/3, 4k/3]
            return (2 * k > 3 * count) | (3 * count > 4 * k)

        count = (a >= thr).sum().double()
        nan = torch.full_like(thr, math.nan)
        too_low, too_high = nan, nan  # thresholds known to select too many / too few
        nudges = torch.zeros_like(count)
        for _ in range(self.max_nudges):
            active, many = outside(count), 3 * count > 4 * k
            up = torch.where(too_high.isnan(), thr * self.nudge, (thr * too_high).sqrt())
            down = torch.where(too_low.isnan(), thr / self.nudge, (thr * too_low).sqrt())
            too_low = torch.where(active & many, thr, too_low)
            too_high = torch.where(active & ~many, thr, too_high)
            thr = torch.where(active, torch.where(many, up, down), thr)
            count = torch.where(active, (a >= thr).sum().double(), count)
            nudges = nudges + active
        out, n, value, nudged = torch.stack([outside(count).double(), count, thr,
                                             nudges]).tolist()  # the one read
        self.last_nudges = int(nudged)
        if out:
            return None
        self.thr = value
        return torch.nonzero_static(a >= thr, size=int(n)).view(-1)

    def rescale(self, factor: float) -> None:
        """The reused threshold follows the inputs' scale (a power of two from a GradScaler
        keeps the selection bit for bit the unscaled one's)."""
        kept = self._held()
        if kept is not None:  # a device value stays one
            self.thr = kept * float(factor)
            self.last_threshold = self._held()

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "thr": self.thr,
                "calls_since_exact": self.calls_since_exact,
                "last_exact_step": self.last_exact_step, "last_numel": self.last_numel,
                "exact_count": self.exact_count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.thr = state["thr"]
        self.calls_since_exact = int(state["calls_since_exact"])
        self.last_exact_step = state["last_exact_step"]
        self.last_numel = state["last_numel"]
        self.exact_count = int(state["exact_count"])
        self.last_threshold = self.thr
