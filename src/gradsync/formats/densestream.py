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

from collections.abc import Sequence
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
    header_raw,
    header_tensor,
    unpack_header,
    view_as,
)
from gradsync.sparsegrad import SparseGrad, flatnonzero, host_kernels, put_at
from gradsync.sparsify.segments import pays_on

__all__ = ["HEADER_BYTES", "MAGIC", "announced_size", "blocks", "decode", "decode_into",
           "decode_stored", "encode", "encode_announced", "max_zero_run", "size_bytes", "split",
           "split_decode_into"]

MAGIC = b"GSDS"
HEADER_BYTES = header_bytes(3)  # 32: numel, blocks, Σ lengths
_RULE_2 = "{what}: a zero run inside a block exceeds the gap rule (rule 2)"


def max_zero_run(index_bytes: int, value_bytes: int) -> int:
    """Z: the most consecutive zeros a block holds, ``⌊2·index_bytes / K⌋`` (rule 2)."""
    return (2 * index_bytes) // value_bytes


def _candidates(sel_or_dense: SparseGrad | torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(indices, values, numel) of every entry of a SparseGrad, or of a dense tensor."""
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
    return idx, val, n


def _entries(sel_or_dense: SparseGrad | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(indices, values, numel) of the nonzero entries of a SparseGrad or a dense tensor."""
    idx, val, n = _candidates(sel_or_dense)
    bits = val.contiguous().view(BITS_DTYPES[val.element_size()])
    if int(torch.count_nonzero(bits)) == val.numel():  # the usual case: nothing to drop
        return idx, val, n
    keep = flatnonzero(bits.bool())  # .bool(): a fifth of the time of `!= 0` on CPU
    return (torch.index_select(idx, 0, keep),
            torch.index_select(bits, 0, keep).view(val.dtype), n)  # bit for bit


def _blocks_at(idx: torch.Tensor, at: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks' starts and lengths for sorted nonzero ``idx`` and the positions of the gaps
    that open a block (``at``: :func:`_layout`; nonzero ``at + 1`` opens a block, nonzero
    ``at`` closes one); each block starts and ends at a nonzero (rule 1). O(blocks) gathers."""
    starts = torch.cat([idx[:1], torch.index_select(idx, 0, at + 1)])
    lengths = torch.cat([torch.index_select(idx, 0, at), idx[-1:]]).sub_(starts).add_(1)
    return starts, lengths


def _find_blocks(sel_or_dense: SparseGrad | torch.Tensor, index_bytes: int
                 ) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """``(starts, lengths, Σ lengths, K)`` of the blocks DenseStream cuts a selection into."""
    idx, val, n = _entries(sel_or_dense)
    check_index_bytes(index_bytes, n)
    vb = val.element_size()
    if idx.numel() == 0:
        e = torch.empty(0, dtype=torch.int64, device=idx.device)
        return e, e, 0, vb
    _, last, at, _ = _layout(idx, max_zero_run(index_bytes, vb))
    return *_blocks_at(idx, at), last + 1, vb


def blocks(sel_or_dense: SparseGrad | torch.Tensor, index_bytes: int = 4
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The dense blocks ``(starts, lengths)`` (int64) DenseStream cuts ``sel_or_dense`` into."""
    starts, lengths, _, _ = _find_blocks(sel_or_dense, index_bytes)
    return starts, lengths


def size_bytes(sel_or_dense: SparseGrad | torch.Tensor, index_bytes: int = 4) -> int:
    """Exact encoded size: ``HEADER_BYTES + blocks·2·index_bytes + K·Σ lengths``."""
    starts, _, total, vb = _find_blocks(sel_or_dense, index_bytes)
    return HEADER_BYTES + starts.numel() * 2 * index_bytes + vb * total


def _layout(idx: torch.Tensor, z: int) -> tuple[int, int, torch.Tensor, torch.Tensor]:
    """The blocks of sorted nonzero ``idx`` (§III-A): ``(cuts, Σ lengths − 1, at, pos)``. A gap
    of more than Z + 1 opens a block: ``at`` holds the positions of the ``cuts`` nonzeros
    followed by such a gap; each nonzero's position in the stream (``pos``) is the previous
    one's plus its gap inside a block, plus one across a cut: one cumulative sum.

    On the CPU's kernels the cuts are compacted first and their gaps set to one by a scatter
    (``masked_fill_`` costs there five times a compaction and a scatter together), and the
    stream's length is read after; elsewhere the gaps are masked on the device and both
    counts come back in one read."""
    gaps = torch.diff(idx)  # zeros between consecutive nonzeros, plus one
    cut = gaps > z + 1
    pos = torch.empty(idx.numel(), dtype=torch.int64, device=idx.device)
    pos[:1] = 0
    if host_kernels(idx):
        at = flatnonzero(cut)
        torch.cumsum(put_at(gaps, at, torch.ones_like(at)), 0, out=pos[1:])
        return at.numel(), int(pos[-1]), at, pos
    torch.cumsum(gaps.masked_fill_(cut, 1), 0, out=pos[1:])  # in place: fresh pages cost
    cuts, last = torch.stack([torch.count_nonzero(cut), pos[-1]]).tolist()
    return cuts, last, flatnonzero(cut, cuts), pos


def _layout_among(idx: torch.Tensor, nonzero: torch.Tensor, z: int
                  ) -> tuple[int, int, int, torch.Tensor, torch.Tensor]:
    """:func:`_layout` of the entries of sorted ``idx`` where ``nonzero`` holds, the others
    (+0.0) skipped where they stand, so that they need no compaction (and no read of their
    count) first: ``(nnz, cuts, Σ lengths − 1, opens, pos)`` in one read. ``opens``: the entry is
    a nonzero that opens a block after the first; ``pos``: a nonzero's position in the stream
    (a skipped entry repeats the one before it). The gap of a nonzero is counted from the
    nonzero before it, the last one at or before each entry being a running maximum."""
    before = torch.cummax(torch.where(nonzero, idx, -1), 0).values  # −1: none yet
    prev = torch.empty_like(before)
    prev[:1] = -1
    prev[1:] = before[:-1]
    gaps = idx - prev  # of a nonzero after another: zeros between them, plus one
    follows = nonzero & (prev >= 0)
    opens = follows & (gaps > z + 1)
    pos = torch.cumsum(gaps.masked_fill_(opens, 1).masked_fill_(~follows, 0), 0)
    nnz, cuts, last = torch.stack([torch.count_nonzero(nonzero), torch.count_nonzero(opens),
                                   pos[-1]]).tolist()
    return nnz, cuts, last, opens, pos


def _nonzero_layout(idx: torch.Tensor, vbits: torch.Tensor, z: int
                    ) -> tuple[torch.Tensor, torch.Tensor, int, int, torch.Tensor,
                               torch.Tensor] | None:
    """The entries of sorted ``idx`` whose bits ``vbits`` are not +0.0 (−0.0 and NaN payloads
    stay) and their layout: ``(idx, vbits, cuts, Σ lengths − 1, at, pos)`` as
    :func:`_layout`'s, or ``None`` when there are none. Where a read waits for the device
    (:func:`~gradsync.sparsify.segments.pays_on`) one read, the +0.0 entries skipped where they
    stand (:func:`_layout_among`); on the CPU the nonzeros are counted (a free read there, while
    ``cummax`` is slow: 2 ms of 250 k entries), dropped where entries hold +0.0, and laid out
    once (:func:`_layout`)."""
    nonzero = vbits.bool()  # a fifth of the time of `!= 0` on CPU
    if pays_on(idx.device):
        nnz, cuts, last, opens, pos = _layout_among(idx, nonzero, z)
        if nnz and nnz < idx.numel():
            keep = flatnonzero(nonzero, nnz)
            idx, vbits, pos, opens = (torch.index_select(t, 0, keep)
                                      for t in (idx, vbits, pos, opens))
        # a gap opens a block: its right end
        return (idx, vbits, cuts, last, flatnonzero(opens[1:], cuts), pos) if nnz else None
    nnz = int(torch.count_nonzero(nonzero))
    if not nnz:
        return None
    if nnz < idx.numel():
        keep = flatnonzero(nonzero, nnz)
        idx, vbits = torch.index_select(idx, 0, keep), torch.index_select(vbits, 0, keep)
    return idx, vbits, *_layout(idx, z)


def encode(sel_or_dense: SparseGrad | torch.Tensor, index_bytes: int = 4) -> torch.Tensor:
    """Encode the nonzeros of a SparseGrad (or of a dense tensor) as DenseStream bytes.

    One output buffer, written in place: the header, the starts and lengths (converted to the
    index width while copied) and the block values (zero-filled, then the nonzeros scattered
    to their positions). One read (the entries' nonzero count, the blocks and the stream's
    length, which then size every compaction), also when entries hold +0.0 (a sum's stored
    zeros, in DenseStream's allreduce) where a read waits for the device; on the CPU two then
    (:func:`_nonzero_layout`)."""
    return encode_announced(sel_or_dense, index_bytes)[0]


def encode_announced(sel_or_dense: SparseGrad | torch.Tensor, index_bytes: int = 4
                     ) -> tuple[torch.Tensor, bytes]:
    """:func:`encode`, and the encoding's header on the host (its bytes, known while encoding:
    no read), for a caller that announces or validates it (:func:`split_decode_into`'s
    ``headers``)."""
    idx, val, n = _candidates(sel_or_dense)
    idx_dtype = check_index_bytes(index_bytes, n)
    vb = val.element_size()
    dev = val.device
    z = max_zero_run(index_bytes, vb)
    bits = BITS_DTYPES[vb]
    vbits = val.contiguous().view(bits)
    bare = header_raw(MAGIC, index_bytes, dtype_code(val.dtype), n, 0, 0)
    found = None if idx.numel() == 0 else _nonzero_layout(idx, vbits, z)
    if found is None:
        return header_tensor(bare, dev), bare
    idx, vbits, cuts, last, at, pos = found
    starts, lengths = _blocks_at(idx, at)
    nb, total = cuts + 1, last + 1
    vals_at = HEADER_BYTES + 2 * nb * index_bytes  # a multiple of 8: every view is aligned
    out = torch.empty(vals_at + total * vb, dtype=torch.uint8, device=dev)
    head = header_raw(MAGIC, index_bytes, dtype_code(val.dtype), n, nb, total)
    out[:HEADER_BYTES] = header_tensor(head, dev)
    out[HEADER_BYTES:HEADER_BYTES + nb * index_bytes].view(idx_dtype).copy_(starts)
    out[HEADER_BYTES + nb * index_bytes:vals_at].view(idx_dtype).copy_(lengths)
    # Values move as their bit patterns (integer views: a float kernel may quieten NaN
    # payloads); scatter_/index_select are far cheaper than x[i] on CPU.
    stream = out[vals_at:].view(bits)
    stream.zero_()
    stream.scatter_(0, pos, vbits)
    return out, head


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


class _Header(NamedTuple):
    """A buffer's header, checked against its size (:func:`_header`), and its arrays' views."""

    buf: torch.Tensor              # the encoding's bytes
    numel: int
    dtype: torch.dtype
    z: int                         # Z, the most zeros a block holds (rule 2)
    starts: torch.Tensor | None    # the block table, in the wire's index width
    lengths: torch.Tensor | None
    stream: torch.Tensor | None    # the stored values


def _fields(src: torch.Tensor | bytes, what: str, numel: int | None,
            dtype: torch.dtype | None) -> tuple[int, torch.dtype, int, int, int, int]:
    """``(index width, dtype, numel, blocks, Σ lengths, encoded size)`` of a header (read from
    the buffer ``src``, or given as its bytes), checked on its own."""
    iw, vdtype, (n, nb, total) = unpack_header(src, MAGIC, 3, what, numel=numel, dtype=dtype)
    if not 0 <= nb <= total <= n or (nb == 0) != (total == 0):
        raise ValueError(f"{what}: blocks={nb}, total length={total} inconsistent "
                         f"with numel={n} (need 0 ≤ blocks ≤ length ≤ numel, and no values "
                         f"without a block)")
    vb = torch.empty(0, dtype=vdtype).element_size()
    return iw, vdtype, n, nb, total, HEADER_BYTES + nb * 2 * iw + total * vb  # no overflow


def announced_size(header: bytes, *, numel: int, dtype: torch.dtype) -> int:
    """The size in bytes of the encoding whose header is ``header`` (its first
    :data:`HEADER_BYTES` bytes, on the host: no read), checked as :func:`decode` checks it."""
    return _fields(header, "densestream.announced_size", numel, dtype)[-1]


def _header(buf: torch.Tensor | bytes, what: str, numel: int | None,
            dtype: torch.dtype | None, *, prefix: bool = False, raw: bytes | None = None
            ) -> _Header:
    """The header (one read; none when its bytes are given, ``raw``) checked on its own and
    against the buffer's size; the arrays are views of ``buf`` (``None`` when it has no
    block). ``prefix``: the encoding is the buffer's beginning (:func:`split`), which must be
    long enough for it."""
    buf = as_buffer(buf)
    iw, vdtype, n, nb, total, expected = _fields(buf if raw is None else raw, what, numel,
                                                 dtype)
    z = max_zero_run(iw, torch.empty(0, dtype=vdtype).element_size())
    if prefix and buf.numel() < expected:
        raise ValueError(f"{what}: an encoding of {expected} bytes runs past the end of the "
                         f"{buf.numel()}-byte buffer (truncated)")
    if not prefix and buf.numel() != expected:
        raise ValueError(f"{what}: buffer of {buf.numel()} bytes, header implies "
                         f"{expected}; truncated or corrupted")
    buf = buf[:expected]
    if nb == 0:  # total == 0 too (checked above)
        return _Header(buf, n, vdtype, z, None, None, None)
    idx_dtype = INDEX_DTYPES[iw]
    return _Header(buf, n, vdtype, z, view_as(buf, HEADER_BYTES, nb, idx_dtype),
                   view_as(buf, HEADER_BYTES + nb * iw, nb, idx_dtype),  # summed in int64
                   view_as(buf, HEADER_BYTES + 2 * nb * iw, total, vdtype))


def _positions(starts: torch.Tensor, lengths: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(bounds, jumps)``: ``bounds[b]`` is block b's first position in the stream and
    ``bounds[b + 1]`` its exclusive end; ``jumps[b]`` is how far block b's first index lies
    from the previous block's last index (block 0: its start, from 0), so a cumulative sum of
    ones with ``jumps`` at the blocks' first positions gives every stored position's index.
    Block b's *shift* is its start less its first position; two consecutive blocks leave
    ``shift[b] − shift[b − 1]`` zeros out between them."""
    nb = starts.numel()
    bounds = torch.empty(nb + 1, dtype=torch.int64, device=starts.device)
    bounds[:1] = 0
    torch.cumsum(lengths, 0, dtype=torch.int64, out=bounds[1:])
    shift = torch.sub(starts, bounds[:-1])  # int64 (bounds is), whatever the field width
    jumps = torch.empty(nb, dtype=torch.int64, device=starts.device)
    jumps[:1] = starts[:1]
    torch.sub(shift[1:], shift[:-1], out=jumps[1:])
    jumps[1:].add_(1)
    return bounds, jumps


def _read(buf: torch.Tensor | bytes, what: str, numel: int | None, dtype: torch.dtype | None
          ) -> _Table:
    """The header and the block table of a buffer, validated on the host.

    The block table and the gap rule are checked in one pass of reductions: lengths ≥ 1;
    blocks sorted and separated by more than Z zeros (the gap rule: a closer pair would be one
    canonical block); the first start ≥ 0 and the last end ≤ n (with the above: every block
    inside [0, n)); lengths summing to the header's total. The zeros left out between two
    blocks are one more than their jump (:func:`_positions`), so the smallest jump gives the
    gap rule. With 4-byte fields nothing can wrap in int64; with 8-byte fields every block is
    first checked on its own (start ≥ 0, start ≤ n − length), so no sum below can wrap either.
    Then rule 1: every block begins and ends with a nonzero (not the bits of +0.0), read off
    the stream's nonzero mask, which the callers reuse. Rule 2 inside the blocks is the
    callers' (:func:`_runs_ok`).
    """
    h = _header(buf, what, numel, dtype)
    n, z, starts, lengths, stream = h.numel, h.z, h.starts, h.lengths, h.stream
    if starts is None:
        return _Table(n, h.dtype, z, (0, 0), None, None, None, None)
    nb, total = starts.numel(), stream.numel()
    bounds, jumps = _positions(starts, lengths)
    words = [lengths.min().long(), starts[0].long(), starts[-1].long() + lengths[-1].long(),
             bounds[-1]]
    if nb > 1:
        words.append(jumps[1:].min() - 1)  # the fewest zeros left out between two blocks
    if starts.element_size() == 8:
        words.append(((starts >= 0) & (starts <= n - lengths)).all().long())
    lmin, first, last, summed, *rest = torch.stack(words).tolist()
    gap = rest[0] if nb > 1 else z + 1
    entries_ok = bool(rest[-1]) if starts.element_size() == 8 else True
    table_ok = (entries_ok and lmin >= 1 and first >= 0 and last <= n and summed == total
                and gap >= 0)
    if not (table_ok and gap > z):
        if table_ok:
            raise ValueError(f"{what}: blocks closer than the gap rule allows")
        raise ValueError(f"{what}: {_structure_error(starts.long(), lengths.long(), n, total)}")
    bits = stream.view(BITS_DTYPES[stream.element_size()])
    nonzero = bits.bool()  # a fifth of the time of `bits != 0` on CPU
    if not bool(_ends_ok(nonzero, bounds)[0]):
        raise ValueError(f"{what}: a block begins or ends with a zero (rule 1)")
    return _Table(n, h.dtype, z, (first, last), bounds[:-1], jumps, bits, nonzero)


def _read_deferred(h: _Header, what: str, lo: int, hi: int,
                   checks: list[tuple[torch.Tensor, str]]
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """:func:`_read` and :func:`_runs_ok` past the header (:func:`_header`, its one
    read) without a read: every rule of
    the block table and of §III-A becomes a bool tensor appended to ``checks``, for the caller
    to read with its others (:data:`gradsync.collectives.base.CHECKS`). Returns ``(indices,
    bits, nonzero)`` of every stored position, or ``None`` when the buffer has no block.

    Nothing here can fail or write out of place before ``checks`` are read: whatever the
    table holds, positions are clamped into the stream and indices into ``[lo, hi)``. The
    table's rules are checked block by block (lengths ≥ 1; lo ≤ start ≤ hi − length; the next
    start more than Z zeros past this block's end): each comparison is free of overflow once
    the ones before it hold, and together they put every block, disjoint and sorted, inside
    ``[lo, hi)``, so the lengths' sum cannot wrap either. Rules 1 and 2: :func:`_ends_ok`,
    :func:`_runs_ok`, as the strict readers check them.
    """
    starts, lengths, stream, z = h.starts, h.lengths, h.stream, h.z
    if starts is None:
        return None
    total = stream.numel()
    bounds, jumps = _positions(starts, lengths)
    # int64 throughout (bounds, jumps): lengths ≥ 1 and every jump past the first > Z + 1
    # (zeros left out between two blocks > Z) make the blocks sorted and disjoint, so the
    # first start and the last end bound them all
    # (minima rather than all(): several times cheaper on the CPU)
    ok = (lengths.min() >= 1) & (jumps[0] >= lo) & (bounds[-1] == total)
    if starts.numel() > 1:
        ok &= jumps[1:].min() > z + 1
    ok &= (starts[-1:].long() + lengths[-1:].long() <= hi).all()  # int64: cannot wrap here
    if starts.element_size() == 8:  # int64 fields: every block bounded before a sum can wrap
        ok &= ((starts >= lo) & (starts <= hi - lengths)).all()
    checks.append((ok, f"{what}: a peer's block table is malformed (a length < 1, a block "
                       f"outside [{lo}, {hi}), blocks unsorted, overlapping or closer than "
                       f"the gap rule, or lengths not summing to the header's {total})"))
    bits = stream.view(BITS_DTYPES[stream.element_size()])
    nonzero = bits.bool()
    ends_ok, firsts = _ends_ok(nonzero, bounds)
    checks.append((ends_ok, f"{what}: a block begins or ends with a zero (rule 1)"))
    checks.append((_runs_ok(nonzero, z), _RULE_2.format(what=what)))
    return _stored_indices(firsts, jumps, total).clamp_(lo, hi - 1), bits, nonzero


def _ends_ok(nonzero: torch.Tensor, bounds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rule 1 on the device: every block's first position (``bounds[b]``) and last one
    (``bounds[b + 1] − 1``) holds a nonzero. Returns the bool and the blocks' first positions,
    both clamped into the stream (a malformed table reads nothing outside it)."""
    ends = torch.stack([bounds[:-1], bounds[1:] - 1]).clamp_(0, nonzero.numel() - 1)
    held = torch.index_select(nonzero, 0, ends.view(-1))
    return torch.count_nonzero(held) == held.numel(), ends[0]  # all(): slower on the CPU


def _runs_ok(nonzero: torch.Tensor, z: int) -> torch.Tensor:
    """Rule 2 inside the blocks on the device: every Z + 1 stored positions in a row hold a
    nonzero (Z shifted ORs of the mask, Z ≤ 8; zero runs never cross a block boundary, by
    rule 1)."""
    total = nonzero.numel()
    if total <= z:
        return torch.ones((), dtype=torch.bool, device=nonzero.device)
    held = nonzero[z:].clone()
    for j in range(z):
        held |= nonzero[j:total - z + j]
    return torch.count_nonzero(held) == held.numel()  # all(): slower on the CPU


def _stored_indices(offsets: torch.Tensor, jumps: torch.Tensor, total: int) -> torch.Tensor:
    """The index of every stored position: one more than the previous position's, or, at a
    block's first position, the previous block's last index plus the block's jump."""
    step = torch.ones(total, dtype=torch.int64, device=offsets.device)
    put_at(step, offsets, jumps)
    return torch.cumsum(step, 0, out=step)  # in place: one stream-sized int64 buffer, not two


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
    if not bool(_runs_ok(t.nonzero, t.z)):
        raise ValueError(_RULE_2.format(what="densestream.decode"))
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
    nnz, runs_ok = torch.stack([torch.count_nonzero(t.nonzero), _runs_ok(t.nonzero, z)]).tolist()
    if not runs_ok:
        raise ValueError(_RULE_2.format(what="densestream.decode_into"))
    put_at(out.view(bits.dtype), _stored_indices(t.offsets, t.jumps, bits.numel()), bits)
    return nnz


def split(buf: torch.Tensor | bytes, count: int) -> list[torch.Tensor]:
    """The ``count`` encodings laid back to back in ``buf``, as views of it (each still to be
    :func:`decode`-d). Only the headers are read here: ``ValueError`` when one is invalid, runs
    past the end, or the pieces do not fill ``buf`` exactly."""
    return [h.buf for h in _split(buf, count, "densestream.split")]


def _split(buf: torch.Tensor | bytes, count: int, what: str,
           numel: int | None = None, dtype: torch.dtype | None = None,
           raws: Sequence[bytes] | None = None) -> list[_Header]:
    """:func:`split`'s headers, one read each (none with their bytes given, ``raws``)."""
    buf = as_buffer(buf)
    check_int("count", count, 0)
    if raws is not None and len(raws) != count:
        raise ValueError(f"{what}: {len(raws)} headers given for {count} encodings")
    heads, at = [], 0
    for i in range(count):
        heads.append(_header(buf[at:], what, numel, dtype, prefix=True,
                             raw=None if raws is None else raws[i]))
        at += heads[-1].buf.numel()
    if at != buf.numel():
        raise ValueError(f"{what}: {buf.numel() - at} bytes left after {count} encodings")
    return heads


def decode_stored(buf: torch.Tensor | bytes, *, numel: int, dtype: torch.dtype, lo: int,
                  hi: int, checks: list[tuple[torch.Tensor, str]],
                  header: bytes | None = None) -> SparseGrad:
    """Every stored position of a buffer's blocks (their zeros included, as +0.0) as a
    SparseGrad, validated with one read, the header's: what a collective that *sums* a peer's
    message needs (adding +0.0 changes no value, only a −0.0 to +0.0, as a dense sum would).

    The rules :func:`decode` enforces (and ``lo ≤`` every index ``< hi``) become bool tensors
    appended to ``checks`` as ``(ok, message)``, for the caller to read with its other checks
    before it uses the result; until then a malformed buffer gives indices clamped into
    ``[lo, hi)`` and values that mean nothing, and nothing fails. The values view ``buf``.
    ``header``: the header's bytes, already on the host (announced by the sender): then no
    read at all; the buffer's own header must equal it (the caller's check).
    """
    h = _header(buf, "densestream.decode_stored", numel, dtype, raw=header)
    got = _read_deferred(h, "densestream.decode_stored", lo, hi, checks)
    if got is None:
        return SparseGrad.empty(numel, dtype, h.buf.device)
    at, bits, _ = got
    return SparseGrad(at, bits.view(dtype), numel, validate=False)


def split_decode_into(buf: torch.Tensor | bytes, out: torch.Tensor,
                      ranges: Sequence[tuple[int, int]],
                      checks: list[tuple[torch.Tensor, str]],
                      headers: Sequence[bytes] | None = None
                      ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """:func:`split` and :func:`decode_into` of every piece with one read per piece (its
    header): the ``len(ranges)`` encodings laid back to back in ``buf``, piece q written into
    ``out`` inside ``ranges[q]``. Validated as :func:`decode_stored` (the checks appended to
    ``checks``; a malformed piece writes only inside its range). Returns the pieces (views of
    ``buf``) and the number of nonzeros written, a 0-dim tensor (not read). ``headers``: the
    pieces' headers, already on the host (as :func:`decode_stored`'s ``header``): no read."""
    if not isinstance(out, torch.Tensor) or out.dim() != 1 or not out.is_contiguous():
        raise ValueError("densestream.split_decode_into: out must be a contiguous 1-D tensor")
    what = "densestream.split_decode_into"
    heads = _split(buf, len(ranges), what, out.numel(), out.dtype, headers)
    nnz = torch.zeros((), dtype=torch.int64, device=out.device)
    for h, (lo, hi) in zip(heads, ranges, strict=True):
        got = _read_deferred(h, what, lo, hi, checks)
        if got is not None:
            at, bits, nonzero = got
            put_at(out.view(bits.dtype), at, bits)
            nnz += torch.count_nonzero(nonzero)
    return [h.buf for h in heads], nnz
