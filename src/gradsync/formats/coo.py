"""COO ("key-value") wire format: a fixed header, then the indices, then the values.

The key-value representation that DenseStream Table I and Ok-Topk Table 1 measure against:
one index and one value per selected entry. Layout (all fields little-endian)::

    offset  size  field
    0       4     magic  b"GSCO"
    4       1     version (1)
    5       1     index width in bytes, 4 (int32) or 8 (int64)
    6       1     value dtype code: 1 fp32, 2 fp16, 3 bf16, 4 fp64
    7       1     reserved, 0
    8       8     numel (int64)
    16      8     nnz   (int64)
    24      nnz × index width     indices, strictly increasing, in [0, numel)
    ...     nnz × value bytes     values, bit for bit (fp32/bf16/fp16 round-trip bitwise)

``size_bytes(sel) == HEADER_BYTES + nnz × (index_bytes + value bytes) == len(encode(sel))``.
int32 indices are allowed only when ``numel < 2**31`` (docs/architecture.md, "Contracts");
indices never pass through a float buffer. ``decode`` validates everything it reads: a
truncated, corrupted or hostile buffer raises ``ValueError``, and nothing larger than the buffer
implies is allocated.

The header, the dtype codes and the ``[indices][values]`` body are :mod:`gradsync.formats.wire`'s
(shared with the DenseStream format and the collectives).
"""

from __future__ import annotations

import torch

from gradsync.formats.wire import (
    INDEX_DTYPES,
    as_buffer,
    check_index_bytes,
    dtype_code,
    header_bytes,
    pack_entries,
    pack_header,
    unpack_entries,
    unpack_header,
)
from gradsync.sparsegrad import SparseGrad, check_indices

__all__ = ["HEADER_BYTES", "MAGIC", "decode", "encode", "size_bytes"]

MAGIC = b"GSCO"
HEADER_BYTES = header_bytes(2)  # 24: numel, nnz


# -- COO ------------------------------------------------------------------------------------
def size_bytes(sel: SparseGrad, index_bytes: int = 4) -> int:
    """Exact encoded size: ``HEADER_BYTES + nnz × (index_bytes + value bytes)``."""
    check_index_bytes(index_bytes, sel.numel)
    return HEADER_BYTES + len(sel) * (index_bytes + sel.values.element_size())


def encode(sel: SparseGrad, index_bytes: int = 4) -> torch.Tensor:
    """Encode ``sel`` as a uint8 tensor on ``sel``'s device (header, indices, values)."""
    if not isinstance(sel, SparseGrad):
        raise ValueError(f"coo.encode: expected a SparseGrad, got {type(sel).__name__}")
    idx_dtype = check_index_bytes(index_bytes, sel.numel)
    code = dtype_code(sel.dtype)
    header = pack_header(MAGIC, index_bytes, code, sel.numel, len(sel), device=sel.device)
    return torch.cat([header, pack_entries(sel.indices, sel.values, idx_dtype)])


def decode(buf: torch.Tensor | bytes, *, numel: int | None = None,
           dtype: torch.dtype | None = None) -> SparseGrad:
    """Decode a COO buffer; ``numel``/``dtype`` (optional) must match what it declares."""
    buf = as_buffer(buf)
    iw, vdtype, (n, nnz) = unpack_header(buf, MAGIC, 2, "coo.decode", numel=numel,
                                         dtype=dtype)
    vb = torch.empty(0, dtype=vdtype).element_size()
    if nnz < 0 or nnz > n:
        raise ValueError(f"coo.decode: nnz {nnz} out of range [0, numel={n}]")
    expected = HEADER_BYTES + nnz * (iw + vb)  # Python ints: no overflow
    if buf.numel() != expected:
        raise ValueError(f"coo.decode: buffer of {buf.numel()} bytes, header implies "
                         f"{expected} (nnz={nnz}); truncated or corrupted")
    idx, val = unpack_entries(buf[HEADER_BYTES:], nnz, INDEX_DTYPES[iw], vdtype, "coo.decode")
    check_indices(idx, n, "coo.decode")
    return SparseGrad(idx, val.clone(), n, validate=False)
