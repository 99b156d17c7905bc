"""TopkA: all-gather every rank's (indices, values), then a local scatter-add.

Ok-Topk §2 / Table 1: volume per rank 2k(P−1) words (COO, one index and one value per entry).
k varies by rank, so the counts are gathered first and the payload travels as an exact-size
all-gather-v (no padding, no even ``numel // P`` split). Duplicates across ranks accumulate
(``index_add_``), never overwrite. Indices stay int64 end to end (never through a float buffer).

Every rank adds the P contributions in rank order, so ``dense`` is bitwise identical everywhere.
"""

from __future__ import annotations

from typing import Any

import torch

from gradsync.collectives import registry
from gradsync.collectives.base import Collective
from gradsync.collectives.comm import Comm
from gradsync.sparsegrad import SparseGrad


@registry.register("topka")
class TopkA(Collective):
    """TopkA: all-gather-v of every rank's entries, then a scatter-add in rank order."""

    def _reduce(
        self, sel: SparseGrad, comm: Comm, step: int
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        counts = comm.all_gather_counts(len(sel), sel.device)
        # int32 indices on the wire when they fit (DESIGN.md: int32 allowed below 2**31).
        wire_index = torch.int32 if sel.numel < 2**31 else torch.int64
        all_idx = comm.all_gather_v(sel.indices.to(wire_index), counts)
        all_val = comm.all_gather_v(sel.values, counts)
        dense = torch.zeros(sel.numel, dtype=sel.dtype, device=sel.device)
        for idx, val in zip(all_idx, all_val):
            dense.index_add_(0, idx.to(torch.int64), val)
        return dense, sel.indices, {"counts": counts}
