"""gTop-k: global top-k by a reduction tree and a broadcast tree (Ok-Topk §2, Table 1 row
"gTop-k"; Shi et al. [42]).

P = 2^m ranks. Reduction tree, rounds j = 0 … m−1 at distance 2^j: rank r with r mod 2^(j+1) =
2^j sends its ≤ k entries to r − 2^j and leaves the tree; the receiver adds them to its own
(``index_add``) and keeps the top-k by magnitude of the ≤ 2k merged entries. After m rounds
rank 0 holds the global top-k, which travels back down the same binomial tree (broadcast).
Volume on the busiest rank (the root): 4k·log2 P words (k entries of 2 words, received and
sent once per round). P not a power of two: rank r ≥ P' = 2^⌊log2 P⌋ is folded into r − P'
first (one more merge there) and receives the result from it at the end.

``kept`` is exact, not "local index ∈ final k": an entry dropped at an inner merge may re-enter
from another subtree, and then its value is *not* in the sum. So each broadcast message carries,
besides the final k, one bit per entry saying whether the receiver's subtree contribution
survived every merge above it; every rank combines that with its own merges. The sum over ranks
of the kept entries therefore equals ``dense`` exactly (conservation for the residuals).

k: ``k=`` or ``density=`` (k = ``target_k(numel, density)`` = max(1, round(density·numel)),
the rule of every sparsifier and collective) fix it; by default k is the largest local
selection in the merged subtrees (the usual case: every rank selects the same k).

Wire: every message is a header of int64 control words (count, and the subtree's k going up),
then ``[indices][values]`` (:func:`gradsync.formats.wire.pack_entries`, int32 indices when
numel < 2**31) and, going down, one packed survival bit per entry
(:func:`gradsync.formats.wire.pack_bits`).
Received entries are checked on the device (indices strictly increasing inside the tensor), a
bad index moved into it with its value zeroed, and the checks go to the caller with the step's
others (``Collective``'s ``CHECKS``): a malformed message fails the receiving rank once the
trees are done, instead of in the middle of them (its peers would wait for it).

**Verdicts in the trees (ours).** So that every rank fails such a step, with no agreement round
after the trees: each message's header ends with its sender's verdict, a word made on the
device from the checks it made or heard so far (1 when one failed), read with the header the
receiver reads anyway; a 1 becomes a failed check there ("another rank received a malformed
message"). Going up, every rank's verdict reaches the root; going down, the root's reaches
every rank. Each rank checks the final entries it sends down as its children check them, so a
malformed one fails it as well as them: every rank when the root packed it, and otherwise the
sender and the ranks below it, as a message corrupted on a link of the broadcast tree fails the
ranks below that link (docs/usage.md); the rest take the step. A rank's NaN (carried in its
selection, ``prepare.carry``) ranks above every magnitude in each merge, so it reaches the
root's top-k and every rank's sum.

Ties in magnitude are broken by the smaller index, so the result is deterministic; ``dense`` is
the root's result copied to every rank, hence bitwise identical.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from gradsync.collectives import registry
from gradsync.collectives.base import CHECKS, Collective, any_failed, heard
from gradsync.collectives.comm import Comm
from gradsync.formats.wire import (
    entry_bytes,
    pack_bits,
    pack_entries,
    packed_bytes,
    unpack_bits,
    unpack_entries,
    wire_index_dtype,
)
from gradsync.sparsegrad import (
    SparseGrad,
    checked_entries,
    flatnonzero,
    isin_sorted,
    sparse_sum,
    target_k,
    top_k_mask,
    validate_density,
)

__all__ = ["GTopk"]


def _top_k(idx: torch.Tensor, val: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k entries of largest |val| (ties: smaller index first), returned in index order."""
    if idx.numel() <= k:
        return idx, val
    at = flatnonzero(top_k_mask(val, k))  # idx is increasing: position order is index order
    return torch.index_select(idx, 0, at), torch.index_select(val, 0, at)


def _merge(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor], k: int,
           n: int):
    """Add two sparse sets of indices in ``[0, n)`` by index (``a`` first) and keep the top-k
    of the ≤ 2k entries (the sum's indices are sorted, whatever ``b``'s order)."""
    return _top_k(*sparse_sum([a, b], within=(0, n)), k)


@registry.register("gtopk")
class GTopk(Collective):
    """gTop-k sparse allreduce: tree of pairwise top-k merges, then a broadcast of the top-k."""

    exact = False

    def __init__(
        self, k: int | None = None, density: float | None = None, *, check_shapes: bool | str = True
    ) -> None:
        super().__init__(check_shapes=check_shapes)
        if k is not None and density is not None:
            raise ValueError("gtopk: give k or density, not both")
        if k is not None and (not isinstance(k, int) or k < 0):
            raise ValueError(f"gtopk: k must be an int >= 0, got {k!r}")
        if density is not None:
            density = validate_density(density, "gtopk: density")
        self.k, self.density = k, density

    def _fixed_k(self, numel: int) -> int | None:
        if self.k is not None:
            return self.k
        if self.density is not None:
            return target_k(numel, self.density)
        return None

    def __repr__(self) -> str:
        return f"GTopk(k={self.k}, density={self.density})"

    def alike(self, sel: SparseGrad, group: dist.ProcessGroup | None = None) -> bool:
        """Always: the verdicts travel up and down the trees (module doc), and the root's
        top-k, which every rank sums, keeps a NaN a rank's selection carries."""
        return True

    # -- wire ------------------------------------------------------------------------------
    def _setup(self, sel: SparseGrad) -> None:
        self._index = wire_index_dtype(sel.numel)
        self._eb = entry_bytes(self._index, sel.dtype)
        self._dtype, self._device, self._n = sel.dtype, sel.device, sel.numel
        self._checks: list[tuple[torch.Tensor, str]] = []  # the received entries', on the device

    def _header(self, *words: int) -> torch.Tensor:
        """A message's control words, then this rank's verdict (module doc, "Verdicts in the
        trees"): 1 when a check it made or heard so far failed. Nothing is read."""
        verdict = any_failed(self._checks, self._device).to(torch.int64).reshape(1)
        return torch.cat([torch.tensor(words, dtype=torch.int64, device=self._device), verdict])

    def _heard(self, verdict: int, src: int) -> None:
        """A verdict read with a header: a 1 (or garbage) fails this rank's step too."""
        self._checks.extend(heard("gtopk", verdict, self._device, f" (from rank {src})"))

    def _send_up(self, comm: Comm, s: tuple[torch.Tensor, torch.Tensor], k: int, dst: int):
        """Reduction-tree message: header (count, subtree k, verdict), then indices and
        values."""
        comm.send(self._header(s[0].numel(), k), dst)
        if s[0].numel():
            comm.send(pack_entries(s[0], s[1], self._index), dst)

    def _recv_up(self, comm: Comm, src: int):
        header = torch.empty(3, dtype=torch.int64, device=self._device)
        comm.recv(header, src)
        count, k, verdict = header.tolist()
        self._heard(verdict, src)
        buf = torch.empty(count * self._eb, dtype=torch.uint8, device=self._device)
        if count:
            comm.recv(buf, src)
        got = unpack_entries(buf, count, self._index, self._dtype, "gtopk")
        return checked_entries(*got, self._n, 0, self._checks,
                               f"gtopk: entries from rank {src}"), k

    def _packed_down(self, final) -> tuple[torch.Tensor, torch.Tensor]:
        """The final entries as every broadcast-tree message from this rank carries them,
        checked here as its children check them (module doc, "Verdicts in the trees"), and
        the header: count and verdict."""
        count = final[0].numel()
        packed = pack_entries(final[0], final[1], self._index)
        checked_entries(*unpack_entries(packed, count, self._index, self._dtype, "gtopk"),
                        self._n, 0, self._checks, "gtopk: the final entries this rank sends")
        return packed, self._header(count)

    def _send_down(self, comm: Comm, down: tuple[torch.Tensor, torch.Tensor],
                   alive: torch.Tensor, dst: int) -> None:
        """Broadcast-tree message (``down``: :meth:`_packed_down`'s): count and verdict, then
        the final entries and one 'alive' bit each."""
        packed, header = down
        comm.send(header, dst)
        if packed.numel():
            comm.send(torch.cat([packed, pack_bits(alive)]), dst)

    def _recv_down(self, comm: Comm, src: int):
        header = torch.empty(2, dtype=torch.int64, device=self._device)
        comm.recv(header, src)
        count, verdict = header.tolist()
        self._heard(verdict, src)
        b = count * self._eb
        buf = torch.empty(b + packed_bytes(count, 1), dtype=torch.uint8, device=self._device)
        if count:
            comm.recv(buf, src)
        final = unpack_entries(buf[:b], count, self._index, self._dtype, "gtopk")
        final = checked_entries(*final, self._n, 0, self._checks,
                                f"gtopk: final entries from rank {src}")
        return final, unpack_bits(buf[b:], count) > 0

    # -- algorithm -------------------------------------------------------------------------
    def _reduce(
        self, sel: SparseGrad, comm: Comm, step: int
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        P, r, n = comm.size, comm.rank, sel.numel
        self._setup(sel)
        fixed = self._fixed_k(n)
        k = fixed if fixed is not None else len(sel)
        s = _top_k(sel.indices, sel.values, k)  # this rank's ≤ k entries
        own = s[0]
        merges: list[tuple[int, torch.Tensor]] = []  # (child, indices kept by that merge)
        parent: int | None = None

        def merge_from(child: int) -> None:
            nonlocal s, k
            got, k_child = self._recv_up(comm, child)
            k = k if fixed is not None else max(k, k_child)
            s = _merge(s, got, k, n)
            merges.append((child, s[0]))

        P2 = 1 << (P.bit_length() - 1)  # P' = the largest power of two ≤ P
        if r >= P2:  # fold: an extra rank is a leaf under r − P'
            parent = r - P2
            self._send_up(comm, s, k, parent)
        else:
            if r + P2 < P:
                merge_from(r + P2)
            d = 1  # reduction tree: distance 2^j in round j
            while d < P2:
                if r & d:
                    parent = r - d
                    self._send_up(comm, s, k, parent)
                    break
                merge_from(r + d)
                d *= 2

        # Broadcast tree (the reduction tree reversed): final top-k and survival bits.
        if parent is None:
            final, alive = s, torch.ones(s[0].numel(), dtype=torch.bool, device=self._device)
        else:
            final, alive = self._recv_down(comm, parent)
        # A contribution merged at merge t reached the root iff the index survived merges
        # t, t+1, … here and everything above (``alive`` from the parent).
        down = self._packed_down(final) if merges else None
        for child, kept_idx in reversed(merges):
            alive = alive & isin_sorted(final[0], kept_idx)
            self._send_down(comm, down, alive, child)
        kept = torch.index_select(own, 0, flatnonzero(isin_sorted(
            own, torch.index_select(final[0], 0, flatnonzero(alive)))))

        dense = SparseGrad(final[0], final[1], n, validate=False).to_dense()
        return dense, kept, {"k": k, "global_count": int(final[0].numel()),
                             CHECKS: self._checks}
