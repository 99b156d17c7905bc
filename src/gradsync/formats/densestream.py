"""DenseStream wire format: dense blocks ``[start, length, values]`` (DenseStream §III-A).

A *dense block* covers ``length`` consecutive elements from ``start``; it stores every value of
that range, zeros included. With K the bytes of one value and ``index_bytes`` the width of a
start and of a length, the blocks of a selection are defined by §III-A's two rules:

1. the first and the last element of a block are nonzero;
2. a run of zeros stays inside a block while ``zeros × K ≤ 2 × index_bytes`` (the bytes of one
   (index, length) pair); a longer run splits the block, because a new (start, length) pair is
   then cheaper than the zeros. So at most ``Z = ⌊2·index_bytes / K⌋`` consecutive zeros: 2 for
   4-byte indices and fp32, 4 for bf16/fp16 (the paper's ``⌈2⌈log2 N/8⌉/K⌉`` with fixed-width
   4-byte fields).

Splitting exactly where a zero run costs more than a pair is optimal: the payload
``2·index_bytes·blocks + K·Σ lengths`` equals ``2·index_bytes + K·nnz + Σ_gaps min(K·g,
2·index_bytes)`` over the nnz−1 gaps of g zeros between consecutive nonzeros, the smallest over
all ways of cutting the selection into blocks. Hence, for nnz ≥ 1,
``2·index_bytes + K·nnz ≤ payload ≤ (2·index_bytes + K)·nnz``: never more than COO's
``(index_bytes + K)·nnz`` plus one length field per nonzero (reached when every block is a
singleton), and at most one (start, length) pair more than the dense span. (Eq. 3 of the paper
prints the two bounds the other way round.)

"Nonzero" means "not the bit pattern of +0.0": −0.0 and NaN payloads are kept, so
``decode(encode(x)).to_dense()`` equals ``x`` bit for bit. ``decode`` returns the nonzero
entries only (the zeros stored inside blocks are dropped).

Layout (little-endian; the blocks are stored as three arrays, which has exactly the size of
the interleaved ``[start, length, values]`` stream and lets both ends work vectorised)::

    offset  size  field
    0       4     magic  b"GSDS"
    4       1     version (1)
    5       1     index width in bytes, 4 (int32) or 8 (int64), for starts and lengths
    6       1     value dtype code: 1 fp32, 2 fp16, 3 bf16, 4 fp64
    7       1     reserved, 0
    8       8     numel (int64)
    16      8     blocks B (int64)
    24      8     Σ lengths L (int64)
    32      B × index width   starts, strictly increasing
    ...     B × index width   lengths, ≥ 1
    ...     L × K             values of every block, in order

``size_bytes(sel) == HEADER_BYTES + B·2·index_bytes + K·L == len(encode(sel))``.
The header and dtype codes are :mod:`gradsync.formats.wire`'s (shared with COO).
``decode`` accepts exactly the canonical encodings (the rules above hold, blocks lie in range,
sorted, not overlapping); anything else raises ``ValueError``. Hence for every buffer it
accepts, ``encode(decode(buf), index_bytes) == buf`` byte for byte.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from gradsync.formats.wire import (
    BITS_DTYPES,
    INDEX_DTYPES,
    as_buffer,
    check_index_bytes,
    check_int,
    dtype_code,
    header_bytes,
    pack_header,
    unpack_header,
    view_as,
)
from gradsync.sparsegrad import SparseGrad, flatnonzero, put_at

__all__ = ["HEADER_BYTES", "MAGIC", "blocks", "decode", "decode_into", "encode", "max_zero_run",
           "size_bytes", "split"]

MAGIC = b"GSDS"
HEADER_BYTES = header_bytes(3)  # 32: numel, blocks, Σ lengths


def max_zero_run(index_bytes: int, value_bytes: int) -> int:
    """Z: the most consecutive zeros a block holds, ``⌊2·index_bytes / K⌋`` (rule 2)."""
    return (2 * index_bytes) // value_bytes


def _entries(sel_or_dense: SparseGrad | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(indices, values, numel) of the nonzero entries of a SparseGrad or a dense tensor."""
    if isinstance(sel_or_dense, SparseGrad):
        idx, val, n = sel_or_dense.indices, sel_or_dense.values, sel_or_dense.numel
    elif isinstance(sel_or_dense, torch.Tensor):
        if not sel_or_dense.is_floating_point():
            raise ValueError(f"densestream: expected a floating tensor, got {sel_or_dense.dtype}")
        val = sel_or_dense.reshape(-1)
        n = val.numel()
        idx = torch.arange(n, device=val.device)
    else:
        raise ValueError(f"densestream: expected a SparseGrad or a tensor, got "
                         f"{type(sel_or_dense).__name__}")
    dtype_code(val.dtype)
    bits = val.contiguous().view(BITS_DTYPES[val.element_size()])
    if int(torch.count_nonzero(bits)) == val.numel():  # the usual case: nothing to drop
        return idx, val, n
    keep = flatnonzero(bits.bool())  # .bool(): a fifth of the time of `!= 0` on CPU
    return (torch.index_select(idx, 0, keep),
            torch.index_select(bits, 0, keep).view(val.dtype), n)  # bit for bit


def _find_blocks(idx: torch.Tensor, z: int, positions: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The blocks' starts and lengths for sorted nonzero ``idx`` and, with ``positions``, each
    nonzero's position in the concatenated block values.

    A new block begins after a gap of more than ``z`` zeros between consecutive nonzeros
    (rule 2); each block starts and ends at a nonzero (rule 1). A nonzero's position is the
    previous one's plus its index gap inside a block, plus one across a cut (the zeros of a
    cut gap are not stored): one cumulative sum. O(nnz) passes, O(blocks) gathers.
    """
    if idx.numel() == 0:
        e = torch.empty(0, dtype=torch.int64, device=idx.device)
        return e, e, e
    gaps = torch.diff(idx)  # zeros between consecutive nonzeros, plus one
    at = flatnonzero(gaps > z + 1)  # nonzero at + 1 opens a block, nonzero at closes one
    starts = torch.cat([idx[:1], torch.index_select(idx, 0, at + 1)])
    lengths = torch.cat([torch.index_select(idx, 0, at), idx[-1:]]).sub_(starts).add_(1)
    if not positions:
        return starts, lengths, None
    pos = torch.empty(idx.numel(), dtype=torch.int64, device=idx.device)
    pos[:1] = 0
    torch.cumsum(put_at(gaps, at, torch.ones_like(at)), 0, out=pos[1:])
    return starts, lengths, pos


def blocks(sel_or_dense: SparseGrad | torch.Tensor, index_bytes: int = 4
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The dense blocks ``(starts, lengths)`` (int64) DenseStream cuts ``sel_or_dense`` into."""
    idx, val, n = _entries(sel_or_dense)
    check_index_bytes(index_bytes, n)
    starts, lengths, _ = _find_blocks(idx, max_zero_run(index_bytes, val.element_size()))
    return starts, lengths


def size_bytes(sel_or_dense: SparseGrad | torch.Tensor, index_bytes: int = 4) -> int:
    """Exact encoded size: ``HEADER_BYTES + blocks·2·index_bytes + K·Σ lengths``."""
    idx, val, n = _entries(sel_or_dense)
    check_index_bytes(index_bytes, n)
    starts, lengths, _ = _find_blocks(idx, max_zero_run(index_bytes, val.element_size()))
    return HEADER_BYTES + starts.numel() * 2 * index_bytes + val.element_size() * int(
        lengths.sum())


def encode(sel_or_dense: SparseGrad | torch.Tensor, index_bytes: int = 4) -> torch.Tensor:
    """Encode the nonzeros of a SparseGrad (or of a dense tensor) as DenseStream bytes.

    One output buffer, written in place: the header, the starts and lengths (converted to the
    index width while copied) and the block values (zero-filled, then the nonzeros scattered
    to their positions)."""
    idx, val, n = _entries(sel_or_dense)
    idx_dtype = check_index_bytes(index_bytes, n)
    vb = val.element_size()
    dev = val.device
    if idx.numel() == 0:
        return pack_header(MAGIC, index_bytes, dtype_code(val.dtype), n, 0, 0, device=dev)
    starts, lengths, pos = _find_blocks(idx, max_zero_run(index_bytes, vb), positions=True)
    nb, total = starts.numel(), int(pos[-1]) + 1
    vals_at = HEADER_BYTES + 2 * nb * index_bytes  # a multiple of 8: every view is aligned
    out = torch.empty(vals_at + total * vb, dtype=torch.uint8, device=dev)
    out[:HEADER_BYTES] = pack_header(MAGIC, index_bytes, dtype_code(val.dtype), n, nb, total,
                                     device=dev)
    out[HEADER_BYTES:HEADER_BYTES + nb * index_bytes].view(idx_dtype).copy_(starts)
    out[HEADER_BYTES + nb * index_bytes:vals_at].view(idx_dtype).copy_(lengths)
    # Values move as their bit patterns (integer views: a float kernel may quieten NaN
    # payloads); scatter_/index_select are far cheaper than x[i] on CPU.
    bits = BITS_DTYPES[vb]
    stream = out[vals_at:].view(bits)
    stream.zero_()
    stream.scatter_(0, pos, val.contiguous().view(bits))
    return out


def _structure_error(starts: torch.Tensor, lengths: torch.Tensor, n: int, total: int) -> str:
    """The first rule a block table breaks (called only once a combined check has failed)."""
    if not bool((lengths >= 1).all()):
        return "a block has length < 1"
    # Overflow-free: lengths ≥ 1 is known before n − lengths, and starts + lengths is formed
    # only once both are known to lie in [0, n].
    if not bool(((starts >= 0) & (starts <= n - lengths)).all()):
        return f"a block lies outside [0, {n})"
    ends = starts + lengths
    if starts.numel() > 1 and not bool((starts[1:] >= ends[:-1]).all()):
        return "blocks unsorted or overlapping"
    return f"lengths sum to {int(lengths.sum())}, header says {total}"


class _Table(NamedTuple):
    """A validated buffer (:func:`_read`); the tensors are ``None`` when it has no block."""

    numel: int
    dtype: torch.dtype
    z: int                         # Z, the most zeros a block holds (rule 2)
    span: tuple[int, int]          # the first block's start, the last block's end
    offsets: torch.Tensor | None   # each block's first position in the stream
    jumps: torch.Tensor | None     # see _read
    bits: torch.Tensor | None      # the stored values as their bit patterns
    nonzero: torch.Tensor | None   # bits != +0.0, per stored position (bool)


def _read(buf: torch.Tensor | bytes, what: str, numel: int | None, dtype: torch.dtype | None
          ) -> _Table:
    """The header and the block table of a buffer, validated.

    The block table and the gap rule are checked in one pass of reductions: lengths ≥ 1;
    blocks sorted and separated by more than Z zeros (the gap rule: a closer pair would be one
    canonical block); the first start ≥ 0 and the last end ≤ n (with the above: every block
    inside [0, n)); lengths summing to the header's total. Block b's *shift* is its start less
    its first position in the stream; two consecutive blocks leave ``shift[b] − shift[b − 1]``
    zeros out between them, so one difference of shifts gives the gap rule. With 4-byte fields
    nothing can wrap in int64; with 8-byte fields every block is first checked on its own
    (start ≥ 0, start ≤ n − length), so no sum below can wrap either. Then rule 1: every
    block begins and ends with a nonzero (not the bits of +0.0), read off the stream's
    nonzero mask, which the callers reuse. Rule 2 inside the blocks is the callers'
    (:func:`_check_zero_runs`).

    ``jumps[b]`` is how far block b's first index lies from the previous block's last index
    (block 0: its start, from 0), so a cumulative sum of ones with ``jumps`` at the
    ``offsets`` gives every stored position's index.
    """
    buf = as_buffer(buf)
    iw, vdtype, (n, nb, total) = unpack_header(buf, MAGIC, 3, what, numel=numel, dtype=dtype)
    vb = torch.empty(0, dtype=vdtype).element_size()
    z = max_zero_run(iw, vb)
    if not 0 <= nb <= total <= n or (nb == 0) != (total == 0):
        raise ValueError(f"{what}: blocks={nb}, total length={total} inconsistent "
                         f"with numel={n} (need 0 ≤ blocks ≤ length ≤ numel, and no values "
                         f"without a block)")
    expected = HEADER_BYTES + nb * 2 * iw + total * vb  # Python ints: no overflow
    if buf.numel() != expected:
        raise ValueError(f"{what}: buffer of {buf.numel()} bytes, header implies "
                         f"{expected}; truncated or corrupted")
    if nb == 0:  # total == 0 too (checked above)
        return _Table(n, vdtype, z, (0, 0), None, None, None, None)
    idx_dtype = INDEX_DTYPES[iw]
    starts = view_as(buf, HEADER_BYTES, nb, idx_dtype)
    lengths = view_as(buf, HEADER_BYTES + nb * iw, nb, idx_dtype)  # summed in int64 below
    stream = view_as(buf, HEADER_BYTES + 2 * nb * iw, total, vdtype)
    # bounds[b]: block b's first position in the stream; bounds[b + 1]: its exclusive end
    bounds = torch.empty(nb + 1, dtype=torch.int64, device=buf.device)
    bounds[:1] = 0
    torch.cumsum(lengths, 0, dtype=torch.int64, out=bounds[1:])
    offsets = bounds[:-1]
    shift = torch.sub(starts, offsets)  # int64 (offsets is), whatever the field width
    # jumps[b] = shift[b] − shift[b − 1] + 1 (block 0: its start); first the zeros between
    jumps = torch.empty(nb, dtype=torch.int64, device=buf.device)
    jumps[:1] = starts[:1]
    torch.sub(shift[1:], shift[:-1], out=jumps[1:])  # zeros left out between blocks
    words = [lengths.min().long(), starts[0].long(), starts[-1].long() + lengths[-1].long(),
             bounds[-1]]
    if nb > 1:
        words.append(jumps[1:].min())
    if iw == 8:
        words.append(((starts >= 0) & (starts <= n - lengths)).all().long())
    lmin, first, last, summed, *rest = torch.stack(words).tolist()
    gap = rest[0] if nb > 1 else z + 1
    entries_ok = bool(rest[-1]) if iw == 8 else True
    table_ok = (entries_ok and lmin >= 1 and first >= 0 and last <= n and summed == total
                and gap >= 0)
    if not (table_ok and gap > z):
        if table_ok:
            raise ValueError(f"{what}: blocks closer than the gap rule allows")
        raise ValueError(f"{what}: {_structure_error(starts.long(), lengths.long(), n, total)}")
    bits = stream.view(BITS_DTYPES[vb])
    nonzero = bits.bool()  # a fifth of the time of `bits != 0` on CPU
    # rule 1: a block's first position is `offsets`, its last one before the next `bounds`
    if not bool(torch.index_select(nonzero, 0, offsets).all()) or not bool(
            torch.index_select(nonzero, 0, bounds[1:] - 1).all()):
        raise ValueError(f"{what}: a block begins or ends with a zero (rule 1)")
    jumps[1:].add_(1)
    return _Table(n, vdtype, z, (first, last), offsets, jumps, bits, nonzero)


def _stored_indices(offsets: torch.Tensor, jumps: torch.Tensor, total: int) -> torch.Tensor:
    """The index of every stored position: one more than the previous position's, or, at a
    block's first position, the previous block's last index plus the block's jump."""
    step = torch.ones(total, dtype=torch.int64, device=offsets.device)
    put_at(step, offsets, jumps)
    return torch.cumsum(step, 0, out=step)  # in place: one stream-sized int64 buffer, not two


def _check_zero_runs(zeros: torch.Tensor, z: int, what: str) -> None:
    """Rule 2 inside the blocks: no Z + 1 stored zeros in a row. ``zeros`` are the stream
    positions of the stored zeros, increasing. Zero runs never cross a block boundary (rule 1),
    so positions j and j + Z of the list lie Z apart exactly when a run of Z + 1 zeros exists.
    One pass over the stored zeros: at most Z per nonzero, and in real selections fewer than
    the nonzeros (ResNet-18's top 10 %: 0.43 M zeros among 1.55 M stored positions)."""
    if zeros.numel() > z and bool(((zeros[z:] - zeros[:-z]) == z).any()):
        raise ValueError(f"{what}: a zero run inside a block exceeds the gap rule (rule 2)")


def decode(buf: torch.Tensor | bytes, *, numel: int | None = None,
           dtype: torch.dtype | None = None) -> SparseGrad:
    """Decode DenseStream bytes into the SparseGrad of their nonzeros (validated).

    ``numel``/``dtype`` (optional) must match what the buffer declares. Validation is
    vectorised and done once: the block table (lengths ≥ 1, inside ``[0, numel)``, sorted, not
    overlapping, lengths summing to the header's total) in one combined pass, then the rules
    of §III-A together — every block begins and ends with a nonzero (rule 1), and consecutive
    nonzeros lie in different blocks exactly when more than Z zeros separate them (rule 2 inside
    a block, the gap rule between blocks): the buffer is the canonical encoding of its
    nonzeros.
    """
    t = _read(buf, "densestream.decode", numel, dtype)
    n, vdtype, bits = t.numel, t.dtype, t.bits
    if bits is None:
        dev = as_buffer(buf).device
        return SparseGrad(torch.empty(0, dtype=torch.int64, device=dev),
                          torch.empty(0, dtype=vdtype, device=dev), n, validate=False)
    at = _stored_indices(t.offsets, t.jumps, bits.numel())
    where = flatnonzero(t.nonzero)
    if where.numel() == bits.numel():  # no zeros stored: every position is an entry
        return SparseGrad(at, bits.clone().view(vdtype), n, validate=False)
    _check_zero_runs(flatnonzero(~t.nonzero), t.z, "densestream.decode")
    return SparseGrad(torch.index_select(at, 0, where),
                      torch.index_select(bits, 0, where).view(vdtype),  # bit for bit
                      n, validate=False)


def decode_into(buf: torch.Tensor | bytes, out: torch.Tensor, *, lo: int = 0,
                hi: int | None = None) -> int:
    """Decode DenseStream bytes straight into the dense 1-D ``out``: the allgather's path.

    Validated exactly as :func:`decode` (the buffer's numel and dtype must be ``out``'s), and
    every block must lie inside ``[lo, hi)`` (default: all of ``out``). Every index a block
    covers is written: the nonzeros with their bits, the zeros stored inside blocks with +0.0.
    So into a zero tensor, or over indices no other selection touches (the disjoint regions of
    a reduce-scatter), the result is ``densify`` of :func:`decode`'s entries bit for bit, with
    no per-entry index built for the nonzeros. Returns the number of nonzeros written.
    """
    if not isinstance(out, torch.Tensor) or out.dim() != 1 or not out.is_contiguous():
        raise ValueError("densestream.decode_into: out must be a contiguous 1-D tensor")
    hi = out.numel() if hi is None else hi
    t = _read(buf, "densestream.decode_into", out.numel(), out.dtype)
    bits, z = t.bits, t.z
    if bits is None:
        return 0
    if t.span[0] < lo or t.span[1] > hi:
        raise ValueError(f"densestream.decode_into: a block lies outside [{lo}, {hi})")
    total = bits.numel()
    zeros = flatnonzero(~t.nonzero)  # the zeros stored inside blocks
    _check_zero_runs(zeros, z, "densestream.decode_into")
    put_at(out.view(bits.dtype), _stored_indices(t.offsets, t.jumps, total), bits)
    return total - zeros.numel()


def split(buf: torch.Tensor | bytes, count: int) -> list[torch.Tensor]:
    """The ``count`` encodings laid back to back in ``buf``, as views of it (each still to be
    :func:`decode`-d). Only the headers are read here: ``ValueError`` when one is invalid, runs
    past the end, or the pieces do not fill ``buf`` exactly."""
    buf = as_buffer(buf)
    check_int("count", count, 0)
    pieces, at = [], 0
    for _ in range(count):
        iw, vdtype, (_, nb, total) = unpack_header(buf[at:], MAGIC, 3, "densestream.split")
        if nb < 0 or total < 0:
            raise ValueError(f"densestream.split: blocks={nb}, total length={total} negative")
        size = HEADER_BYTES + nb * 2 * iw + total * torch.empty(0, dtype=vdtype).element_size()
        if at + size > buf.numel():
            raise ValueError(f"densestream.split: an encoding of {size} bytes runs past the "
                             f"end of the {buf.numel()}-byte buffer (truncated)")
        pieces.append(buf[at:at + size])
        at += size
    if at != buf.numel():
        raise ValueError(f"densestream.split: {buf.numel() - at} bytes left after {count} "
                         "encodings")
    return pieces
