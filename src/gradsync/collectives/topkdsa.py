"""TopkDSA: SparCML's dynamic sparse allreduce (Ok-Topk §2, Table 1 row "TopkDSA"; SparCML [36]).

Rabenseifner's allreduce on sparse streams, P = 2^m ranks:

1. *Reduce-scatter by recursive halving.* In step s = 0 … m−1 rank r exchanges with
   r XOR P/2^(s+1): the current index range [lo, hi) is halved, each rank sends the half its
   partner owns and adds (``index_add`` semantics) the partner's stream for the half it keeps.
   After m steps rank r holds the reduced r-th region of the index space.
2. *Allgather by recursive doubling.* In step s rank r exchanges its reduced range with
   r XOR 2^s; the ranges are adjacent and concatenate.

Dynamic switch ("fill-in"): each stream is sent as COO (``[indices][values]``,
:func:`gradsync.formats.wire.pack_entries`; int32 indices when numel < 2**31) unless
that would exceed the dense size of its range, in which case it is sent dense; a stream that is
dense stays dense. The decision is local to the sender and per stream, so a one-word header
(the entry count, or −1 for dense) precedes each payload. Volume per rank (Table 1, in words):
between 4k(P−1)/P (indices fully overlapping, uniformly spread) and the dense cap 2n(P−1)/P.

A received stream's indices are checked on the device (strictly increasing inside the range
both ends know), a bad one moved into range with its value zeroed, and the checks go to the
caller with the step's others (``Collective``'s ``CHECKS``): a malformed stream fails the
receiving rank once the collective is done, and writes nothing outside its range before.

Exactness: every entry of every rank is summed, so ``dense`` is the SUM and ``kept`` is every
local index. Each region is reduced along one fixed tree (the halving steps) and only its
owner's bits are copied in the allgather, so ``dense`` is bitwise identical on all ranks.

P not a power of two: with P' = 2^⌊log2 P⌋, rank r ≥ P' first sends its whole stream to
r − P' (which adds it) and receives the full result from r − P' at the end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gradsync.collectives import registry
from gradsync.collectives.base import CHECKS, Collective
from gradsync.collectives.comm import Comm
from gradsync.formats.wire import (
    entry_bytes,
    pack_entries,
    to_bytes,
    unpack_entries,
    view_as,
    wire_index_dtype,
)
from gradsync.sparsegrad import SparseGrad, checked_entries, sparse_sum

__all__ = ["TopkDSA"]

_DENSE = -1  # header value announcing a dense payload


@dataclass
class _Stream:
    """The entries of the index range [lo, hi): sparse (idx, val) or dense (buf)."""

    lo: int
    hi: int
    idx: torch.Tensor | None = None  # int64, absolute, strictly increasing
    val: torch.Tensor | None = None
    buf: torch.Tensor | None = None  # dense values of [lo, hi)

    @property
    def is_dense(self) -> bool:
        return self.buf is not None

    def slice(self, a: int, b: int) -> _Stream:
        if self.is_dense:
            return _Stream(a, b, buf=self.buf[a - self.lo : b - self.lo])
        bounds = torch.tensor([a, b], dtype=torch.int64, device=self.idx.device)
        i, j = (int(x) for x in torch.searchsorted(self.idx, bounds))
        return _Stream(a, b, idx=self.idx[i:j], val=self.val[i:j])

    def densified(self) -> torch.Tensor:
        if self.is_dense:
            return self.buf
        return SparseGrad(self.idx - self.lo, self.val, self.hi - self.lo,
                          validate=False).to_dense()


def _add(a: _Stream, b: _Stream) -> _Stream:
    """Sum of two streams over the same range (index_add; a + b == b + a bitwise)."""
    if a.is_dense or b.is_dense:
        if not a.is_dense:
            a, b = b, a
        if b.is_dense:
            return _Stream(a.lo, a.hi, buf=a.buf + b.buf)
        return _Stream(a.lo, a.hi, buf=a.buf.clone().index_add_(0, b.idx - a.lo, b.val))
    # both inside [lo, hi) (a received stream's indices are moved there): no read of the ends
    idx, val = sparse_sum([(a.idx, a.val), (b.idx, b.val)], within=(a.lo, a.hi))
    return _Stream(a.lo, a.hi, idx=idx, val=val)


def _join(a: _Stream, b: _Stream) -> _Stream:
    """Concatenate adjacent streams, ``a`` left of ``b``; dense if either is dense."""
    if a.is_dense or b.is_dense:
        return _Stream(a.lo, b.hi, buf=torch.cat([a.densified(), b.densified()]))
    return _Stream(a.lo, b.hi, idx=torch.cat([a.idx, b.idx]), val=torch.cat([a.val, b.val]))


class _Wire:
    """Encoding of streams on the wire: header (count or −1), then one packed byte payload."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self.index = wire_index_dtype(numel)
        self.eb = entry_bytes(self.index, dtype)
        self.dtype, self.device = dtype, device
        self.vb = torch.empty(0, dtype=dtype).element_size()
        self.dense_sends = 0
        self.checks: list[tuple[torch.Tensor, str]] = []  # the received streams', on the device

    def encode(self, s: _Stream) -> tuple[torch.Tensor, torch.Tensor]:
        n_range = s.hi - s.lo
        if not s.is_dense and s.idx.numel() * self.eb > n_range * self.vb:
            s = _Stream(s.lo, s.hi, buf=s.densified())  # the switch to dense
        if s.is_dense:
            self.dense_sends += 1
            header = torch.tensor([_DENSE], dtype=torch.int64, device=self.device)
            return header, to_bytes(s.buf)
        header = torch.tensor([s.idx.numel()], dtype=torch.int64, device=self.device)
        return header, pack_entries(s.idx, s.val, self.index)

    def payload_bytes(self, header: int, lo: int, hi: int) -> int:
        if header == _DENSE:
            return (hi - lo) * self.vb
        return header * self.eb

    def decode(self, header: int, payload: torch.Tensor, lo: int, hi: int) -> _Stream:
        if header == _DENSE:
            return _Stream(lo, hi, buf=view_as(payload, 0, hi - lo, self.dtype))
        idx, val = unpack_entries(payload, header, self.index, self.dtype, "topkdsa")
        # strictly increasing inside [lo, hi): checked on the device (no read), a bad index
        # moved into it with its value zeroed, so the stream writes only inside its range
        idx, val = checked_entries(idx, val, hi, lo, self.checks, "topkdsa: a peer's stream")
        return _Stream(lo, hi, idx=idx, val=val)

    def empty_header(self) -> torch.Tensor:
        return torch.empty(1, dtype=torch.int64, device=self.device)

    def empty_payload(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    # -- transfers over Comm (both ends know the range [lo, hi) of the stream) -------------
    def send(self, comm: Comm, s: _Stream, dst: int) -> None:
        header, payload = self.encode(s)
        comm.send(header, dst)
        if payload.numel():
            comm.send(payload, dst)

    def recv(self, comm: Comm, src: int, lo: int, hi: int) -> _Stream:
        header = self.empty_header()
        comm.recv(header, src)
        h = int(header)
        payload = self.empty_payload(self.payload_bytes(h, lo, hi))
        if payload.numel():
            comm.recv(payload, src)
        return self.decode(h, payload, lo, hi)

    def sendrecv(self, comm: Comm, s: _Stream, peer: int, lo: int, hi: int) -> _Stream:
        """Send ``s`` to ``peer`` and receive the peer's stream over [lo, hi)."""
        header, payload = self.encode(s)
        got = self.empty_header()
        comm.sendrecv(header, peer, got, peer)
        h = int(got)
        buf = self.empty_payload(self.payload_bytes(h, lo, hi))
        comm.sendrecv(payload, peer, buf, peer)
        return self.decode(h, buf, lo, hi)


@registry.register("topkdsa")
class TopkDSA(Collective):
    """SparCML's dynamic sparse allreduce (exact SUM; sparse ↔ dense switch per stream)."""

    exact = True

    def _reduce(
        self, sel: SparseGrad, comm: Comm, step: int
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        P, r, n = comm.size, comm.rank, sel.numel
        if P == 1:
            return sel.to_dense(), sel.indices, {"dense_sends": 0}
        wire = _Wire(n, sel.dtype, sel.device)
        mine = _Stream(0, n, idx=sel.indices, val=sel.values)
        P2 = 1 << (P.bit_length() - 1)  # P' = the largest power of two ≤ P

        # Fold: rank r ≥ P' hands its stream to r − P' and waits for the result.
        if r >= P2:
            wire.send(comm, mine, r - P2)
            full = wire.recv(comm, r - P2, 0, n)
            return full.densified(), sel.indices, {"dense_sends": wire.dense_sends,
                                                   CHECKS: wire.checks}
        if r + P2 < P:
            mine = _add(mine, wire.recv(comm, r + P2, 0, n))

        # 1. Reduce-scatter by recursive halving: distance P'/2, P'/4, …, 1.
        lo, hi = 0, n
        ranges: dict[int, tuple[int, int]] = {}  # range held before the step at distance d
        d = P2 // 2
        while d:
            ranges[d] = (lo, hi)
            mid = lo + (hi - lo) // 2
            keep, give = ((mid, hi), (lo, mid)) if r & d else ((lo, mid), (mid, hi))
            got = wire.sendrecv(comm, mine.slice(*give), r ^ d, *keep)
            mine = _add(mine.slice(*keep), got)
            lo, hi = keep
            d //= 2

        # 2. Allgather by recursive doubling: distance 1, 2, …, P'/2; ranges are adjacent.
        d = 1
        while d < P2:
            ulo, uhi = ranges[d]
            if r & d:  # the partner holds the left part of the union
                got = wire.sendrecv(comm, mine, r ^ d, ulo, lo)
                mine = _join(got, mine)
            else:
                got = wire.sendrecv(comm, mine, r ^ d, hi, uhi)
                mine = _join(mine, got)
            lo, hi = ulo, uhi
            d *= 2

        if r + P2 < P:  # unfold: the extra rank gets this rank's bits
            wire.send(comm, mine, r + P2)
        # a fresh tensor either way (to_dense, or a dense stream built by +, cat or a received
        # buffer of exactly [0, n)): no copy of the result
        return mine.densified(), sel.indices, {"dense_sends": wire.dense_sends,
                                               CHECKS: wire.checks}
