"""Random-k: k positions drawn uniformly without replacement (SSFusion §II baseline).

Randomness comes from the sparsifier's own seeded ``torch.Generator``: the same seed gives the
same positions on every rank, and the global RNG is never touched.
"""

from __future__ import annotations

import torch

from gradsync.sparsify import registry
from gradsync.sparsify.base import Sparsifier


@registry.register("randomk")
class RandomK(Sparsifier):
    name = "randomk"

    def _select(self, x: torch.Tensor, k: int, step: int) -> torch.Tensor:
        n = x.numel()
        return torch.randperm(n, generator=self.generator)[:k].to(x.device)
