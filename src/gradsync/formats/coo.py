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
int32 indices are allowed only when ``numel < 2**31`` (DESIGN.md); indices never pass through
a float buffer. ``decode`` validates everything it reads: a truncated, corrupted or hostile
buffer raises ``ValueError``, and nothing larger than the buffer implies is allocated.

The helpers ``pack_header``/``unpack_header``/``view_as`` are shared with the DenseStream format.
"""

from __future__ import annotations

import struct
import sys

import torch

from gradsync.sparsegrad import SparseGrad

__all__ = ["HEADER_BYTES", "MAGIC", "decode", "encode", "size_bytes"]

MAGIC = b"GSCO"
VERSION = 1
_HEADER = struct.Struct("<4sBBBBqq")
HEADER_BYTES = _HEADER.size  # 24

#: value dtype ↔ one-byte code on the wire
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float64: 4,
}
CODE_DTYPES: dict[int, torch.dtype] = {c: d for d, c in DTYPE_CODES.items()}
#: integer dtype with the same width as each value dtype (bit tests, e.g. "is +0.0")
BITS_DTYPES: dict[int, torch.dtype] = {2: torch.int16, 4: torch.int32, 8: torch.int64}
INDEX_DTYPES: dict[int, torch.dtype] = {4: torch.int32, 8: torch.int64}

if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for
    raise ImportError("gradsync wire formats assume a little-endian host")


def check_index_bytes(index_bytes: int, numel: int) -> torch.dtype:
    """The wire dtype of indices of width ``index_bytes`` for a tensor of ``numel`` elements."""
    if index_bytes not in INDEX_DTYPES:
        raise ValueError(f"index_bytes must be 4 or 8, got {index_bytes!r}")
    if index_bytes == 4 and numel >= 2**31:
        raise ValueError(f"int32 indices need numel < 2**31, got numel={numel}; "
                         "use index_bytes=8")
    return INDEX_DTYPES[index_bytes]


def dtype_code(dtype: torch.dtype) -> int:
    try:
        return DTYPE_CODES[dtype]
    except KeyError:
        raise ValueError(f"unsupported value dtype {dtype}; supported: "
                         f"{', '.join(str(d) for d in DTYPE_CODES)}") from None


def pack_header(magic: bytes, index_bytes: int, code: int, *fields: int,
                device: torch.device | str = "cpu") -> torch.Tensor:
    """``magic, version, index width, dtype code, 0`` followed by int64 ``fields``."""
    raw = struct.pack("<4sBBBB" + "q" * len(fields), magic, VERSION, index_bytes, code, 0,
                      *fields)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device)


def as_buffer(buf: object) -> torch.Tensor:
    """Accept a 1-D uint8 tensor (any device) or a bytes-like object; else ``ValueError``."""
    if isinstance(buf, bytes | bytearray | memoryview):
        raw = bytearray(buf)
        return (torch.frombuffer(raw, dtype=torch.uint8) if raw
                else torch.empty(0, dtype=torch.uint8))
    if not isinstance(buf, torch.Tensor):
        raise ValueError(f"expected a uint8 tensor or bytes, got {type(buf).__name__}")
    if buf.dtype != torch.uint8 or buf.dim() != 1:
        raise ValueError(f"expected a 1-D uint8 tensor, got {buf.dtype} of shape "
                         f"{tuple(buf.shape)}")
    return buf


def unpack_header(buf: torch.Tensor, magic: bytes, n_fields: int, what: str, *,
                  numel: int | None = None, dtype: torch.dtype | None = None
                  ) -> tuple[int, torch.dtype, list[int]]:
    """Parse and check the common header: returns (index width, value dtype, int64 fields).

    The first field is the tensor's numel in every format: it must fit the index width, and
    match ``numel``/``dtype`` when the caller states what it expects.
    """
    size = 8 + 8 * n_fields
    if buf.numel() < size:
        raise ValueError(f"{what}: buffer of {buf.numel()} bytes is shorter than the "
                         f"{size}-byte header (truncated)")
    raw = bytes(buf[:size].cpu().tolist())
    got_magic, version, iw, code, reserved, *fields = struct.unpack(
        "<4sBBBB" + "q" * n_fields, raw)
    if got_magic != magic:
        raise ValueError(f"{what}: bad magic {got_magic!r}, expected {magic!r}")
    if version != VERSION:
        raise ValueError(f"{what}: unsupported version {version}")
    if iw not in INDEX_DTYPES:
        raise ValueError(f"{what}: bad index width {iw}")
    if code not in CODE_DTYPES:
        raise ValueError(f"{what}: bad value dtype code {code}")
    if reserved != 0:
        raise ValueError(f"{what}: reserved header byte is {reserved}, expected 0")
    n, vdtype = fields[0], CODE_DTYPES[code]
    if n < 0 or (iw == 4 and n >= 2**31):
        raise ValueError(f"{what}: numel {n} out of range for {iw}-byte indices")
    if numel is not None and n != numel:
        raise ValueError(f"{what}: buffer holds numel={n}, expected {numel}")
    if dtype is not None and vdtype != dtype:
        raise ValueError(f"{what}: buffer holds {vdtype}, expected {dtype}")
    return iw, vdtype, fields


def view_as(buf: torch.Tensor, start: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """``count`` elements of ``dtype`` read from byte ``start`` of ``buf`` (copy if unaligned)."""
    width = torch.empty(0, dtype=dtype).element_size()
    chunk = buf[start:start + count * width]
    if count == 0:
        return torch.empty(0, dtype=dtype, device=buf.device)
    try:
        return chunk.view(dtype)
    except RuntimeError:  # storage offset not a multiple of the element size
        return chunk.clone().view(dtype)


def to_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a 1-D tensor (no copy when contiguous)."""
    if t.numel() == 0:  # torch refuses to view some empty tensors (e.g. stride 0 from numpy)
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    return t.contiguous().view(torch.uint8)


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
    return torch.cat([header, to_bytes(sel.indices.to(idx_dtype)), to_bytes(sel.values)])


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
    idx = view_as(buf, HEADER_BYTES, nnz, INDEX_DTYPES[iw]).to(torch.int64)
    val = view_as(buf, HEADER_BYTES + nnz * iw, nnz, vdtype).clone()
    if nnz:
        if int(idx[0]) < 0 or int(idx[-1]) >= n:
            raise ValueError(f"coo.decode: indices out of range [0, {n})")
        if nnz > 1 and not bool((idx[1:] > idx[:-1]).all()):
            raise ValueError("coo.decode: indices not strictly increasing")
    return SparseGrad(idx, val, n, validate=False)
