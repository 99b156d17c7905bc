"""Exact Top-k: the k entries of largest magnitude (the reference every estimator aims at).

k = max(1, round(density · n)); ties are broken by ``torch.topk``.
"""

from __future__ import annotations

import torch

from gradsync.sparsify import registry
from gradsync.sparsify.base import Sparsifier


@registry.register("topk")
class TopK(Sparsifier):
    def _select(self, x: torch.Tensor, k: int, step: int) -> torch.Tensor:
        # torch.topk has no bf16/fp16 kernel on every backend; magnitudes compare exactly in fp32.
        return torch.topk(x.abs().float(), k, sorted=False).indices
