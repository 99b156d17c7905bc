"""TopkA: all-gather every rank's (indices, values), then a local scatter-add.

Ok-Topk §2 / Table 1: volume per rank 2k(P−1) words (COO, one index and one value per entry).
k varies by rank: it travels in one equal-size all-gather of messages padded to a capacity every
rank knows ("Fixed capacity", below), or, without one, the counts are gathered first and the
payload travels as an exact-size all-gather-v (no padding, no even ``numel // P`` split) of
one ``[indices][values]`` message per rank (:func:`gradsync.formats.wire.pack_entries`); a
selection's dense prefix (tensors sent
whole at the front of a fused buffer, ``SparseGrad.dense_prefix``, SSFusion's excluded tensors)
travels as values only. Duplicates across ranks accumulate
(:func:`~gradsync.sparsegrad.add_at`), never overwrite. Indices are int64 in memory and travel
as int32 when numel < 2**31, else int64 (:func:`~gradsync.formats.wire.wire_index_dtype`),
never through a float buffer. Every received index is checked on the device (inside the
tensor, past the dense prefix: each message's extremes) and one that is not lands in a slot
outside the sum, so a malformed message writes nowhere before the caller reads the check with
the step's others.

**Fixed capacity.** A selection whose size every rank can bound without asking
(``SparseGrad.capacity``: k of a DGC or exact top-k selection, Σ k_i of a buffer's, the plan's
k_i alike on every rank) skips the count exchange: on an accelerator's kernels always, on the
CPU's up to :data:`HOST_CAPPED_MAX` entries (see below). Each rank sends one
message of the capacity's size with its count in an 8-byte header
(:func:`gradsync.formats.wire.pack_entries_capped`), one equal-size all-gather carries them,
and the receivers unpack every message at once and mask what lies past each count on the
device. No count is read back to the host (on a GPU: no wait for the device before the values
travel); the messages' checks (count within the capacity, indices in range) are read by the
caller with the step's others (``Collective.__call__``'s ``deferred``). The price is the
padding, at most the capacity minus the count (DGC keeps between 0.8·k and k entries), the
8-byte count and at most 14 bytes that align each part to 8 bytes: on the CNN at 1 %, P = 4,
0.0974 → 0.1012 MB per rank and step (+3.9 %). What it saves is a round: the counts'
all-gather waits for the slowest rank, then the payload's rounds follow. On this project's
2-core machine the CNN's TopkA step at P = 4 fell from 40.6/42.1 to 36.8/37.1 ms (loopback,
``bench anatomy``, with the ring all-gather of :meth:`gradsync.collectives.comm.Comm.all_gather`;
speed.md, "One round fewer"). On the CPU the padded messages' unpacking costs more than the
round beyond some ten thousand entries: at P = 2, 4·10⁶ elements, 10 % (400,000 entries a
rank), 14–15 ms exact-size against 20–21 capped on the slower rank (`bench check`'s
``collective/topka@0.1`` went from 1.08× to 1.7–1.9× dense), so there a selection of more than
:data:`HOST_CAPPED_MAX` entries exchanges its counts. Selections without a capacity (a
threshold's, Ok-Topk's) exchange their counts first, then exact-size messages.

Every rank adds the P contributions in rank order, so ``dense`` is bitwise identical everywhere.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from gradsync.collectives import registry
from gradsync.collectives.base import CHECKS, Collective
from gradsync.collectives.comm import Comm
from gradsync.formats.wire import (
    entries_bytes,
    pack_entries,
    pack_entries_capped,
    unpack_entries,
    unpack_entries_capped,
    wire_index_dtype,
)
from gradsync.sparsegrad import SparseGrad, add_at
from gradsync.sparsify.segments import pays_on

# On the CPU's kernels, the largest capacity sent at its fixed size (module doc)
HOST_CAPPED_MAX = 2**15


@registry.register("topka")
class TopkA(Collective):
    """TopkA: all-gather-v of every rank's entries, then a scatter-add in rank order."""

    lazy_decode = True  # the fixed-capacity exchange can leave the sum's writing to the caller
    gathers = True

    def alike(self, sel: SparseGrad, group: dist.ProcessGroup | None = None) -> bool:
        """Always: every rank unpacks the same P messages."""
        return True

    def _reduce(
        self, sel: SparseGrad, comm: Comm, step: int, lazy: bool = False
    ) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, Any]]:
        m = sel.dense_prefix  # alike on every rank (the shape check compares it)
        wire = wire_index_dtype(sel.numel)
        if sel.capacity is not None and (  # alike on every rank too (the shape check)
                sel.capacity <= HOST_CAPPED_MAX or pays_on(sel.device)):
            return self._reduce_capped(sel, comm, wire, m, lazy)
        counts = comm.all_gather_counts(len(sel), sel.device)
        if min(counts) < m:  # every rank sees the same counts, so every rank raises
            raise ValueError(f"topka: a rank sent {min(counts)} entries, fewer than the "
                             f"dense prefix of {m}")
        n = sel.numel
        msgs = comm.all_gather_v(pack_entries(sel.indices, sel.values, wire, m),
                                 [entries_bytes(c, wire, sel.dtype, m) for c in counts])
        # Every received index lies past the dense prefix, inside the tensor: checked per
        # message on the device from its extremes (no read), and one that does not lands in a
        # slot outside ``dense`` (0 below, n + 1 above), so a malformed message writes nowhere.
        # In place on the unpacked indices: a check over their concatenation (a copy and four
        # passes) made TopkA's CPU step at P = 4, n = 4e6, 10 % a third slower.
        out = torch.zeros(n + 2, dtype=sel.dtype, device=sel.device)
        dense = out[1:n + 1]
        oks = []
        for msg, c in zip(msgs, counts):
            idx, val = unpack_entries(msg, c, wire, sel.dtype, "topka", m)
            if m:  # the tensors sent whole: values only, added in rank order
                dense[:m].add_(val[:m])
            if idx.numel():
                lo, hi = torch.aminmax(idx)
                oks.append((lo >= m) & (hi < n))
                if m:  # a position in the prefix goes below
                    idx = torch.where(idx < m, -1, idx)
                add_at(out, idx.add_(1).clamp_(0, n + 1), val[m:])
        ok = torch.stack(oks).all() if oks else torch.ones((), dtype=torch.bool,
                                                           device=sel.device)
        return dense, sel.indices, {"counts": counts, CHECKS: [
            (ok, f"topka: a rank's message holds an index outside [{m}, {n})")]}

    @staticmethod
    def _reduce_capped(sel: SparseGrad, comm: Comm, wire: torch.dtype, m: int,
                       lazy: bool = False
                       ) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, Any]]:
        """The fixed-capacity exchange (module doc): one all-gather of equal messages, all of
        them unpacked at once, every rank's entries added in rank order (what lies past a
        count lands one past the buffer), the messages' checks left on the device."""
        cap = sel.capacity
        assert cap is not None
        msgs = comm.all_gather(pack_entries_capped(sel.indices, sel.values, wire, cap, m))
        idx, val, ok = unpack_entries_capped(msgs, cap, wire, sel.dtype, sel.numel, m, "topka")
        P, numel = comm.size, sel.numel

        def decode() -> torch.Tensor:
            out = torch.zeros(numel + 1, dtype=val.dtype, device=val.device)
            dense = out[:numel]
            for r in range(P):
                if m:  # the tensors sent whole: values only, added in rank order
                    dense[:m].add_(val[r, :m])
                add_at(out, idx[r], val[r, m:])
            return dense

        info = {"capacity": cap, CHECKS: [
            (ok, f"topka: a rank's message announces a count outside [{m}, {cap}] or an index "
                 f"outside [0, {sel.numel})")]}
        if lazy:
            return None, sel.indices, {**info, "decode": decode}
        return decode(), sel.indices, info
