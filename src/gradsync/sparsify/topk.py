"""Exact Top-k: the k entries of largest magnitude (the reference every estimator aims at).

k = max(1, round(density · n)); ties are broken by
:func:`~gradsync.sparsegrad.top_k` (``torch.topk``, or its candidates on the CPU's own kernels).
"""

from __future__ import annotations

import torch

from gradsync.sparsegrad import top_k
from gradsync.sparsify import registry
from gradsync.sparsify.base import Sparsifier
from gradsync.sparsify.segments import Segments, top_in_segments


@registry.register("topk")
class TopK(Sparsifier):
    at_most_k = True  # exactly k

    def _select(self, x: torch.Tensor, k: int, step: int) -> torch.Tensor:
        # torch.topk has no bf16/fp16 kernel on every backend; magnitudes compare exactly in fp32.
        return top_k(x.abs().float(), k)[1]

    @classmethod
    def _select_segments(cls, sparsifiers: list[TopK], x: torch.Tensor, seg: Segments,
                         ks: list[int], step: int) -> torch.Tensor:
        """Each tensor's k largest magnitudes, every tensor at once
        (:func:`~gradsync.sparsify.segments.top_in_segments`: one sort over the buffer, one over
        what it keeps)."""
        idx = top_in_segments(x.abs().float(), seg.sizes, ks)
        for sp, k in zip(sparsifiers, ks):
            sp.last_k, sp.last_count = k, k
        return idx
