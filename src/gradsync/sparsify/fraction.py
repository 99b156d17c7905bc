"""Fraction: TAGC's dynamic sparsification threshold θ (TAGC §3.2, "Gradient Sparsification").

"The value for zeroing the gradient is chosen dynamically, so that at least θ % of the values
become zero." With θ = 1 − density this keeps at most k = round(density · n) entries (k ≥ 1, the
sparsifier contract) — the k largest |x| — and never selects an entry that is already zero, so
the nonzero index sent by LHC/TAGC is no denser than necessary (at least θ of the values are zero
after selection; fewer than k entries are selected when x has fewer than k nonzeros, reported in
``last_deviation``). Pass ``theta=`` instead of ``density=`` to state it the paper's way.
The unselected values go to the caller's local accumulator (TAGC's local gradient accumulation).
"""

from __future__ import annotations

import torch

from gradsync.sparsegrad import top_k
from gradsync.sparsify import registry
from gradsync.sparsify.base import Sparsifier


@registry.register("fraction")
class Fraction(Sparsifier):
    def __init__(
        self, density: float | None = None, *, theta: float | None = None, seed: int = 0
    ) -> None:
        if (density is None) == (theta is None):
            raise ValueError("fraction: give exactly one of density= or theta= (θ = 1 − density)")
        if theta is not None:
            try:
                t = float(theta)
            except (TypeError, ValueError):
                msg = f"fraction: theta must be a number in [0, 1), got {theta!r}"
                raise ValueError(msg) from None
            if not 0.0 <= t < 1.0:
                raise ValueError(f"fraction: theta must be in [0, 1), got {theta!r}")
            density = 1.0 - t
        super().__init__(density, seed=seed)

    @property
    def theta(self) -> float:
        """θ: the least fraction of values that the selection leaves zero."""
        return 1.0 - self.density

    def _select(self, x: torch.Tensor, k: int, step: int) -> torch.Tensor:
        # The k largest |x| (compared in fp32: no topk kernel for bf16/fp16 everywhere) ...
        idx = top_k(x.abs().float(), k)[1]
        # ... minus entries that are zero anyway: they would only densify the index.
        return idx[x[idx] != 0]

    def __repr__(self) -> str:
        return f"Fraction(density={self.density:g}, theta={self.theta:g})"
