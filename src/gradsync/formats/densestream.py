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

import torch

from gradsync.formats.wire import (
    BITS_DTYPES,
    INDEX_DTYPES,
    as_buffer,
    check_index_bytes,
    dtype_code,
    header_bytes,
    pack_header,
    to_bytes,
    unpack_header,
    view_as,
)
from gradsync.sparsegrad import SparseGrad

__all__ = ["HEADER_BYTES", "MAGIC", "blocks", "decode", "encode", "max_zero_run", "size_bytes"]

MAGIC = b"GSDS"
HEADER_BYTES = header_bytes(3)  # 32: numel, blocks, Σ lengths


def max_zero_run(index_bytes: int, value_bytes: int) -> int:
    """Z: the most consecutive zeros a block holds, ``⌊2·index_bytes / K⌋`` (rule 2)."""
    return (2 * index_bytes) // value_bytes


def _nonzero_bits(v: torch.Tensor) -> torch.Tensor:
    """Mask of values whose bit pattern is not +0.0 (−0.0 and NaN count as nonzero)."""
    return v.contiguous().view(BITS_DTYPES[v.element_size()]) != 0


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
    keep = _nonzero_bits(val)
    return idx[keep], val[keep], n


def _find_blocks(idx: torch.Tensor, z: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block of each nonzero (sorted ``idx``), and the blocks' starts and lengths.

    A new block begins after a gap of more than ``z`` zeros between consecutive nonzeros
    (rule 2); each block starts and ends at a nonzero (rule 1).
    """
    if idx.numel() == 0:
        e = torch.empty(0, dtype=torch.int64, device=idx.device)
        return e, e, e
    gaps = idx[1:] - idx[:-1] - 1                       # zeros between consecutive nonzeros
    cut = gaps > z
    one = torch.ones(1, dtype=torch.bool, device=idx.device)
    first = torch.cat([one, cut])                      # nonzero j opens a block
    last = torch.cat([cut, one])                       # nonzero j closes a block
    block_of = torch.cumsum(first.to(torch.int64), 0) - 1
    starts = idx[first]
    lengths = idx[last] - starts + 1
    return block_of, starts, lengths


def blocks(sel_or_dense: SparseGrad | torch.Tensor, index_bytes: int = 4
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The dense blocks ``(starts, lengths)`` (int64) DenseStream cuts ``sel_or_dense`` into."""
    idx, val, n = _entries(sel_or_dense)
    check_index_bytes(index_bytes, n)
    _, starts, lengths = _find_blocks(idx, max_zero_run(index_bytes, val.element_size()))
    return starts, lengths


def size_bytes(sel_or_dense: SparseGrad | torch.Tensor, index_bytes: int = 4) -> int:
    """Exact encoded size: ``HEADER_BYTES + blocks·2·index_bytes + K·Σ lengths``."""
    idx, val, n = _entries(sel_or_dense)
    check_index_bytes(index_bytes, n)
    _, starts, lengths = _find_blocks(idx, max_zero_run(index_bytes, val.element_size()))
    return HEADER_BYTES + starts.numel() * 2 * index_bytes + val.element_size() * int(
        lengths.sum())


def encode(sel_or_dense: SparseGrad | torch.Tensor, index_bytes: int = 4) -> torch.Tensor:
    """Encode the nonzeros of a SparseGrad (or of a dense tensor) as DenseStream bytes."""
    idx, val, n = _entries(sel_or_dense)
    idx_dtype = check_index_bytes(index_bytes, n)
    block_of, starts, lengths = _find_blocks(idx, max_zero_run(index_bytes, val.element_size()))
    total = int(lengths.sum()) if lengths.numel() else 0
    # Position of each nonzero inside the concatenated block values.
    offsets = torch.cumsum(lengths, 0) - lengths
    pos = offsets[block_of] + (idx - starts[block_of])
    stream = torch.zeros(total, dtype=val.dtype, device=val.device)
    stream[pos] = val
    header = pack_header(MAGIC, index_bytes, dtype_code(val.dtype), n, starts.numel(), total,
                         device=val.device)
    return torch.cat([header, to_bytes(starts.to(idx_dtype)), to_bytes(lengths.to(idx_dtype)),
                      to_bytes(stream)])


def decode(buf: torch.Tensor | bytes, *, numel: int | None = None,
           dtype: torch.dtype | None = None) -> SparseGrad:
    """Decode DenseStream bytes into the SparseGrad of their nonzeros (validated).

    ``numel``/``dtype`` (optional) must match what the buffer declares.
    """
    buf = as_buffer(buf)
    iw, vdtype, (n, nb, total) = unpack_header(buf, MAGIC, 3, "densestream.decode",
                                               numel=numel, dtype=dtype)
    vb = torch.empty(0, dtype=vdtype).element_size()
    if not 0 <= nb <= total <= n or (nb == 0) != (total == 0):
        raise ValueError(f"densestream.decode: blocks={nb}, total length={total} inconsistent "
                         f"with numel={n} (need 0 ≤ blocks ≤ length ≤ numel, and no values "
                         f"without a block)")
    expected = HEADER_BYTES + nb * 2 * iw + total * vb  # Python ints: no overflow
    if buf.numel() != expected:
        raise ValueError(f"densestream.decode: buffer of {buf.numel()} bytes, header implies "
                         f"{expected}; truncated or corrupted")
    idx_dtype = INDEX_DTYPES[iw]
    starts = view_as(buf, HEADER_BYTES, nb, idx_dtype).to(torch.int64)
    lengths = view_as(buf, HEADER_BYTES + nb * iw, nb, idx_dtype).to(torch.int64)
    stream = view_as(buf, HEADER_BYTES + 2 * nb * iw, total, vdtype)
    empty = torch.empty(0, dtype=torch.int64, device=buf.device)
    if nb == 0:  # total == 0 too (checked above)
        return SparseGrad(empty, torch.empty(0, dtype=vdtype, device=buf.device), n,
                          validate=False)
    # Every comparison below is overflow-free: lengths ≥ 1 is checked before n − lengths, and
    # starts + lengths is formed only once both are known to lie in [0, n].
    if not bool((lengths >= 1).all()):
        raise ValueError("densestream.decode: a block has length < 1")
    if not bool(((starts >= 0) & (starts <= n - lengths)).all()):
        raise ValueError(f"densestream.decode: a block lies outside [0, {n})")
    ends = starts + lengths                             # exclusive
    if nb > 1 and not bool((starts[1:] >= ends[:-1]).all()):
        raise ValueError("densestream.decode: blocks unsorted or overlapping")
    if int(lengths.sum()) != total:
        raise ValueError(f"densestream.decode: lengths sum to {int(lengths.sum())}, header "
                         f"says {total}")
    # Index of every stored element, then keep the nonzeros.
    block_of = torch.repeat_interleave(torch.arange(nb, device=buf.device), lengths)
    offsets = torch.cumsum(lengths, 0) - lengths
    pos = torch.arange(total, device=buf.device)
    nz = _nonzero_bits(stream)
    # Rule 1: blocks begin and end with a nonzero.
    if not bool((nz[offsets] & nz[offsets + lengths - 1]).all()):
        raise ValueError("densestream.decode: a block begins or ends with a zero (rule 1)")
    # Rule 2: no run of more than Z zeros inside a block (its ends are nonzero, so runs of
    # zeros lie between consecutive nonzeros of the same block).
    where = pos[nz]
    if where.numel() > 1:
        same = block_of[where[1:]] == block_of[where[:-1]]
        run = where[1:] - where[:-1] - 1
        if bool((same & (run > max_zero_run(iw, vb))).any()):
            raise ValueError("densestream.decode: a zero run inside a block exceeds the gap "
                             "rule (rule 2)")
    # Blocks of the canonical encoding are separated by more than Z zeros.
    if nb > 1:
        sep = starts[1:] - ends[:-1]
        if bool((sep <= max_zero_run(iw, vb)).any()):
            raise ValueError("densestream.decode: blocks closer than the gap rule allows")
    idx = starts[block_of[where]] + (where - offsets[block_of[where]])
    return SparseGrad(idx, stream[where].clone(), n, validate=False)
