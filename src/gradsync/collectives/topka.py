"""TopkA: all-gather every rank's (indices, values), then a local scatter-add.

Ok-Topk §2 / Table 1: volume per rank 2k(P−1) words (COO, one index and one value per entry).
k varies by rank, so the counts are gathered first and the payload travels as an exact-size
all-gather-v (no padding, no even ``numel // P`` split) of one ``[indices][values]`` message per
rank (:func:`gradsync.formats.wire.pack_entries`); a selection's dense prefix (tensors sent
whole at the front of a fused buffer, ``SparseGrad.dense_prefix``, SSFusion's excluded tensors)
travels as values only. Duplicates across ranks accumulate
(:func:`~gradsync.sparsegrad.add_at`), never overwrite. Indices are int64 in memory and travel
as int32 when numel < 2**31, else int64 (:func:`~gradsync.formats.wire.wire_index_dtype`),
never through a float buffer.

Every rank adds the P contributions in rank order, so ``dense`` is bitwise identical everywhere.
"""

from __future__ import annotations

from typing import Any

import torch

from gradsync.collectives import registry
from gradsync.collectives.base import Collective
from gradsync.collectives.comm import Comm
from gradsync.formats.wire import entries_bytes, pack_entries, unpack_entries, wire_index_dtype
from gradsync.sparsegrad import SparseGrad, add_at


@registry.register("topka")
class TopkA(Collective):
    """TopkA: all-gather-v of every rank's entries, then a scatter-add in rank order."""

    def _reduce(
        self, sel: SparseGrad, comm: Comm, step: int
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        m = sel.dense_prefix  # alike on every rank (the shape check compares it)
        counts = comm.all_gather_counts(len(sel), sel.device)
        wire = wire_index_dtype(sel.numel)
        if min(counts) < m:  # every rank sees the same counts, so every rank raises
            raise ValueError(f"topka: a rank sent {min(counts)} entries, fewer than the "
                             f"dense prefix of {m}")
        msgs = comm.all_gather_v(pack_entries(sel.indices, sel.values, wire, m),
                                 [entries_bytes(c, wire, sel.dtype, m) for c in counts])
        dense = torch.zeros(sel.numel, dtype=sel.dtype, device=sel.device)
        for msg, c in zip(msgs, counts):
            idx, val = unpack_entries(msg, c, wire, sel.dtype, "topka", m)
            if m:  # the tensors sent whole: values only, added in rank order
                dense[:m] += val[:m]
            add_at(dense, idx, val[m:])
        return dense, sel.indices, {"counts": counts}
