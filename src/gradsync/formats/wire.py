"""The wire chores every format and collective shares, each written once.

* **Index width** (docs/architecture.md, "Contracts": int32 on the wire): indices are int64 in
  memory and travel as int32 when every index fits (``numel < 2**31``), else int64 — never
  through a float buffer. :func:`wire_index_dtype` is that choice; :func:`check_index_bytes`
  validates a width the caller asked for.
* **Entries** ``[indices][values]``: one uint8 message holding ``count`` indices at the wire
  width, then the ``count`` values bit for bit (:func:`pack_entries` / :func:`unpack_entries`,
  :func:`entry_bytes`, :func:`entries_bytes`); a selection's dense prefix (indices 0 … m−1,
  tensors sent whole) travels as values only. The COO format's body and the messages of
  TopkA, TopkDSA, gTop-k and Ok-Topk all have this layout. A message of *fixed* size (the
  receiver knows an upper bound and needs no count message first) is
  ``[count as int64][entries][zeros up to capacity]`` (:func:`pack_entries_fixed` /
  :func:`unpack_entries_fixed`); SparDL's rounds and all-gather use it. Without the zeros,
  ``[count as int64][entries]`` (:func:`pack_entries_counted`) is a message whose receiver
  posts a buffer of the bound and reads the count from what arrives (gloo,
  ``Comm.irecv_bounded``); Ok-Topk's split-and-reduce uses it.
* **Value dtype codes**: one byte per value dtype (:data:`DTYPE_CODES`, :func:`dtype_code`), in
  the format headers and in the collectives' shape consensus.
* **Header** of the wire formats (:func:`pack_header` / :func:`unpack_header`): magic, version,
  index width, value dtype code, a reserved zero byte, then int64 fields, the first being numel.
* **Bit packing** (:func:`pack_bits` / :func:`unpack_bits`): ``bits=1``, a packed bitmap (bit i
  of byte i // 8 is element i, little-endian bit order); ``bits=4``, one 4-bit counter per
  element (element 2i in the low nibble of byte i). TAGC's bit index, the DDP/FSDP TAGC path and
  gTop-k's survival bits use it.
* **Bytes**: :func:`as_buffer` (accept a uint8 tensor or bytes), :func:`to_bytes`,
  :func:`view_as` (a typed view at any byte offset, copying only when unaligned).

Every reader validates what it reads and raises ``ValueError`` on a truncated, corrupted or
hostile buffer; nothing larger than the buffer implies is allocated.
"""

from __future__ import annotations

import struct
import sys

import numpy as np
import torch

from gradsync.sparsegrad import host_kernels, iota

__all__ = [
    "BITS_DTYPES",
    "CODE_DTYPES",
    "COUNT_BYTES",
    "DTYPE_CODES",
    "INDEX_DTYPES",
    "VERSION",
    "as_buffer",
    "capped_entries_bytes",
    "check_index_bytes",
    "check_int",
    "dtype_code",
    "entries_bytes",
    "entry_bytes",
    "fixed_entries_bytes",
    "header_bytes",
    "header_raw",
    "header_tensor",
    "pack_bits",
    "pack_entries",
    "pack_entries_capped",
    "pack_entries_counted",
    "pack_entries_fixed",
    "pack_header",
    "packed_bytes",
    "to_bytes",
    "unpack_bits",
    "unpack_entries",
    "unpack_entries_capped",
    "unpack_entries_fixed",
    "unpack_header",
    "view_as",
    "wire_index_bytes",
    "wire_index_dtype",
]

if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for
    raise ImportError("gradsync wire formats assume a little-endian host")

VERSION = 1

#: value dtype ↔ one-byte code on the wire
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float64: 4,
}
CODE_DTYPES: dict[int, torch.dtype] = {c: d for d, c in DTYPE_CODES.items()}
#: integer dtype with the same width as each value dtype (bit tests, e.g. "is +0.0")
BITS_DTYPES: dict[int, torch.dtype] = {2: torch.int16, 4: torch.int32, 8: torch.int64}
#: index width in bytes → wire dtype of the indices
INDEX_DTYPES: dict[int, torch.dtype] = {4: torch.int32, 8: torch.int64}


def check_int(name: str, v: object, lo: int) -> int:
    """``v`` if it is an int (not a bool) ``>= lo``; else ``ValueError`` naming ``name``."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{name} must be an int, got {type(v).__name__} {v!r}")
    if v < lo:
        raise ValueError(f"{name} must be >= {lo}, got {v}")
    return v


# -- index width --------------------------------------------------------------------------
def wire_index_dtype(numel: int) -> torch.dtype:
    """int32 when every index of a ``numel``-element tensor fits (numel < 2**31), else int64."""
    return torch.int32 if numel < 2**31 else torch.int64


def wire_index_bytes(numel: int) -> int:
    """Bytes of one index on the wire (:func:`wire_index_dtype`'s width): 4 or 8."""
    return wire_index_dtype(numel).itemsize


def check_index_bytes(index_bytes: int, numel: int) -> torch.dtype:
    """The wire dtype of indices of width ``index_bytes`` for a tensor of ``numel`` elements."""
    if index_bytes not in INDEX_DTYPES:
        raise ValueError(f"index_bytes must be 4 or 8, got {index_bytes!r}")
    if index_bytes == 4 and numel >= 2**31:
        raise ValueError(f"int32 indices need numel < 2**31, got numel={numel}; "
                         "use index_bytes=8")
    return INDEX_DTYPES[index_bytes]


# -- value dtypes -------------------------------------------------------------------------
def dtype_code(dtype: torch.dtype) -> int:
    """The one-byte wire code of a value dtype; ``ValueError`` for an unsupported one."""
    try:
        return DTYPE_CODES[dtype]
    except KeyError:
        raise ValueError(f"unsupported value dtype {dtype}; supported: "
                         f"{', '.join(str(d) for d in DTYPE_CODES)}") from None


# -- bytes --------------------------------------------------------------------------------
def _width(dtype: torch.dtype) -> int:
    """Bytes of one element of ``dtype``."""
    return dtype.itemsize  # no tensor: a launch-free lookup


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


def to_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a 1-D tensor (no copy when contiguous)."""
    if t.numel() == 0:  # torch refuses to view some empty tensors (e.g. stride 0 from numpy)
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    return t.contiguous().view(torch.uint8)


def view_as(buf: torch.Tensor, start: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """``count`` elements of ``dtype`` read from byte ``start`` of ``buf`` (copy if unaligned)."""
    width = _width(dtype)
    chunk = buf[start:start + count * width]
    if count == 0:
        return torch.empty(0, dtype=dtype, device=buf.device)
    try:
        return chunk.view(dtype)
    except RuntimeError:  # storage offset not a multiple of the element size
        return chunk.clone().view(dtype)


# -- header -------------------------------------------------------------------------------
def header_bytes(n_fields: int) -> int:
    """Size of a header with ``n_fields`` int64 fields: 8 + 8·n_fields."""
    return 8 + 8 * n_fields


def header_raw(magic: bytes, index_bytes: int, code: int, *fields: int) -> bytes:
    """:func:`pack_header`'s bytes, on the host."""
    return struct.pack("<4sBBBB" + "q" * len(fields), magic, VERSION, index_bytes, code, 0,
                       *fields)


def pack_header(magic: bytes, index_bytes: int, code: int, *fields: int,
                device: torch.device | str = "cpu") -> torch.Tensor:
    """``magic, version, index width, dtype code, 0`` followed by int64 ``fields``."""
    return header_tensor(header_raw(magic, index_bytes, code, *fields), device)


def header_tensor(raw: bytes, device: torch.device | str = "cpu") -> torch.Tensor:
    """A header's bytes (:func:`header_raw`) as a uint8 tensor on ``device``."""
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device)


def unpack_header(buf: torch.Tensor | bytes, magic: bytes, n_fields: int, what: str, *,
                  numel: int | None = None, dtype: torch.dtype | None = None
                  ) -> tuple[int, torch.dtype, list[int]]:
    """Parse and check the common header: returns (index width, value dtype, int64 fields).
    ``buf``: the buffer (its header is read, one copy to the host) or the header's bytes
    already on the host.

    The first field is the tensor's numel in every format: it must fit the index width, and
    match ``numel``/``dtype`` when the caller states what it expects.
    """
    size = header_bytes(n_fields)
    have = len(buf) if isinstance(buf, bytes) else buf.numel()
    if have < size:
        raise ValueError(f"{what}: buffer of {have} bytes is shorter than the "
                         f"{size}-byte header (truncated)")
    raw = buf[:size] if isinstance(buf, bytes) else bytes(buf[:size].cpu().tolist())
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


# -- entries [indices][values] ----------------------------------------------------------------
def entry_bytes(index_dtype: torch.dtype, dtype: torch.dtype) -> int:
    """Bytes of one entry: one index of ``index_dtype`` and one value of ``dtype``."""
    return _width(index_dtype) + _width(dtype)


def pack_entries(indices: torch.Tensor, values: torch.Tensor,
                 index_dtype: torch.dtype, prefix: int = 0) -> torch.Tensor:
    """One uint8 message ``[indices as index_dtype][values]`` (bit-exact, no float casts).

    ``prefix`` (m): the first m entries are indices 0 … m−1 (``SparseGrad.dense_prefix``, the
    caller's promise): their indices are left out, ``[indices[m:]][values]``."""
    return torch.cat([to_bytes(indices[prefix:].to(index_dtype)), to_bytes(values)])


def entries_bytes(count: int, index_dtype: torch.dtype, dtype: torch.dtype,
                  prefix: int = 0) -> int:
    """Size of a :func:`pack_entries` message of ``count`` entries, ``prefix`` of them without
    their index."""
    return count * entry_bytes(index_dtype, dtype) - prefix * _width(index_dtype)


def fixed_entries_bytes(capacity: int, index_dtype: torch.dtype, dtype: torch.dtype) -> int:
    """Size of a :func:`pack_entries_fixed` message: the count + ``capacity`` entries."""
    return COUNT_BYTES + capacity * entry_bytes(index_dtype, dtype)


# the int64 count ahead of the entries of a counted or fixed-size message
COUNT_BYTES = 8


def pack_entries_counted(indices: torch.Tensor, values: torch.Tensor,
                         index_dtype: torch.dtype) -> torch.Tensor:
    """``[count (int64)][indices][values]``: :func:`pack_entries` with its count ahead, in one
    copy (:data:`COUNT_BYTES` + :func:`entries_bytes` bytes)."""
    count = torch.tensor([indices.numel()], dtype=torch.int64, device=values.device)
    return torch.cat([to_bytes(count), to_bytes(indices.to(index_dtype)), to_bytes(values)])


def pack_entries_fixed(indices: torch.Tensor, values: torch.Tensor, index_dtype: torch.dtype,
                       capacity: int) -> torch.Tensor:
    """``[count (int64)][indices][values][zeros]``, exactly
    :func:`fixed_entries_bytes` (capacity) bytes; ``ValueError`` when more than ``capacity``
    entries are given."""
    count = indices.numel()
    if count > capacity:
        raise ValueError(f"pack_entries_fixed: {count} entries exceed the capacity {capacity}")
    out = torch.zeros(fixed_entries_bytes(capacity, index_dtype, values.dtype), dtype=torch.uint8,
                      device=values.device)
    body = pack_entries_counted(indices, values, index_dtype)
    out[:body.numel()] = body
    return out


def unpack_entries_fixed(buf: torch.Tensor, capacity: int, index_dtype: torch.dtype,
                         dtype: torch.dtype, what: str = "entries"
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_entries_fixed`: (int64 indices, values) of the ``count`` entries
    the message announces. ``ValueError`` when the size is not the capacity's or the count is
    negative or above ``capacity`` (the padding is not read)."""
    if buf.numel() != fixed_entries_bytes(capacity, index_dtype, dtype):
        raise ValueError(f"{what}: message of {buf.numel()} bytes, a capacity of {capacity} "
                         f"entries needs {fixed_entries_bytes(capacity, index_dtype, dtype)}")
    count = int(view_as(buf, 0, 1, torch.int64)[0])
    if not 0 <= count <= capacity:
        raise ValueError(f"{what}: a message announces {count} entries, capacity {capacity}")
    return unpack_entries(buf[8:8 + count * entry_bytes(index_dtype, dtype)], count,
                          index_dtype, dtype, what)


def _pad8(n: int) -> int:
    """``n`` rounded up to a multiple of 8."""
    return -(-n // 8) * 8


def capped_entries_bytes(capacity: int, index_dtype: torch.dtype, dtype: torch.dtype,
                         prefix: int = 0) -> int:
    """Size of a :func:`pack_entries_capped` message: an 8-byte count, then room for
    ``capacity − prefix`` indices and for ``capacity`` values, each part padded to 8 bytes,
    whatever the count."""
    return (8 + _pad8((capacity - prefix) * _width(index_dtype))
            + _pad8(capacity * _width(dtype)))


def pack_entries_capped(indices: torch.Tensor, values: torch.Tensor, index_dtype: torch.dtype,
                        capacity: int, prefix: int = 0) -> torch.Tensor:
    """``[count (int64)][indices[prefix:], zeros to capacity − prefix][values, zeros to
    capacity]``, each part padded with zeros to 8 bytes, :func:`capped_entries_bytes` long
    for any count up to ``capacity``: ranks that know the capacity exchange it without first
    exchanging their counts, and the count never comes back to the host
    (:func:`unpack_entries_capped` reads it on the device). Every part starts at a multiple of
    8 bytes, so each is a typed view in every message of an all-gather's ``(P, bytes)``
    result. The first ``prefix`` entries are indices 0 … prefix−1 and travel without them,
    as in :func:`pack_entries`. ``ValueError`` when the count is not in ``[prefix,
    capacity]``."""
    count = indices.numel()
    if not prefix <= count <= capacity:
        raise ValueError(f"pack_entries_capped: {count} entries, outside [{prefix}, {capacity}] "
                         "(the dense prefix, the capacity)")
    out = torch.zeros(capped_entries_bytes(capacity, index_dtype, values.dtype, prefix),
                      dtype=torch.uint8, device=values.device)
    out[:8].view(torch.int64).fill_(count)  # the count is the host's: no tensor made for it
    if count > prefix:  # one copy each, the cast to the wire width in it
        out[8:8 + (count - prefix) * _width(index_dtype)].view(index_dtype).copy_(
            indices[prefix:])
    if count:
        at = 8 + _pad8((capacity - prefix) * _width(index_dtype))
        out[at:at + count * _width(values.dtype)].view(values.dtype).copy_(values)
    return out


def unpack_entries_capped(msgs: torch.Tensor, capacity: int, index_dtype: torch.dtype,
                          dtype: torch.dtype, numel: int, prefix: int = 0,
                          what: str = "entries"
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_entries_capped` for one message (1-D) or P of them (``(P,
    bytes)``, an all-gather's result: every message at once, in a number of operations that
    does not grow with P), without a read of the counts: ``(indices, values, ok)``, per
    message its ``capacity − prefix`` int64 indices and ``capacity`` values (shaped as the
    messages: a row each), and ``ok``, a bool on the device: every count lies in ``[prefix,
    capacity]`` and every index a message announces in ``[0, numel)``. An index past its
    message's count or out of range reads as ``numel``, one past the buffer: the caller adds
    into ``numel + 1`` entries and drops the last, so a malformed message writes nowhere
    (whatever its padding holds) before the caller reads ``ok`` with the step's other checks.
    Only the size is checked here (``ValueError``): it is known on the host."""
    size = capped_entries_bytes(capacity, index_dtype, dtype, prefix)
    rows = msgs.view(1, -1) if msgs.dim() == 1 else msgs
    if rows.dim() != 2 or rows.shape[1] != size:
        raise ValueError(f"{what}: message of {rows.shape[-1]} bytes, a capacity of {capacity} "
                         f"entries ({prefix} without index) needs {size}")
    tail, at = capacity - prefix, 8 + _pad8((capacity - prefix) * _width(index_dtype))
    announced = rows[:, :8].view(torch.int64)  # (P, 1): indices each announces
    if prefix:
        announced = announced - prefix
    idx = rows[:, 8:8 + tail * _width(index_dtype)].view(index_dtype).to(torch.int64)
    val = rows[:, at:at + capacity * _width(dtype)].view(dtype)
    # announced (before the count) and in range
    good = (idx.clamp(0, numel - 1) == idx) & (iota(tail, rows.device) < announced)
    # every announced index good and every count in [prefix, capacity]: exactly count − prefix
    # good indices in each message (a count above the capacity announces more indices than
    # there are, one below the prefix fewer than none)
    ok = (good.sum(1, keepdim=True) == announced).all()
    idx = torch.where(good, idx, numel)
    if msgs.dim() == 1:
        return idx.view(-1), val.view(-1), ok
    return idx, val, ok


def unpack_entries(buf: torch.Tensor, count: int, index_dtype: torch.dtype,
                   dtype: torch.dtype, what: str = "entries", prefix: int = 0
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_entries` for a message of ``count`` entries, the first ``prefix``
    of them without their index: (int64 indices of the other ``count − prefix`` entries,
    every value). The values are a view of ``buf`` when aligned (a copy otherwise); the indices
    are not checked here (a decoder that needs sorted, in-range indices calls
    :func:`gradsync.sparsegrad.check_indices`). ``ValueError`` when the size is not exactly
    that, or ``prefix`` is not in [0, count]."""
    if not 0 <= prefix <= count:
        raise ValueError(f"{what}: prefix {prefix} outside [0, {count}]")
    if buf.numel() != entries_bytes(count, index_dtype, dtype, prefix):
        raise ValueError(f"{what}: message of {buf.numel()} bytes is not {count} entries "
                         f"({prefix} without index)")
    tail = count - prefix
    idx = view_as(buf, 0, tail, index_dtype).to(torch.int64)
    return idx, view_as(buf, tail * _width(index_dtype), count, dtype)


# -- bit packing ----------------------------------------------------------------------------
def _check_bits(bits: object) -> int:
    if isinstance(bits, bool) or bits not in (1, 4):
        raise ValueError(f"bits per element (index_bits) must be 1 or 4, got {bits!r}")
    return int(bits)  # type: ignore[arg-type]


def packed_bytes(n: int, bits: int) -> int:
    """Bytes of ``n`` packed elements of ``bits`` (1 or 4) bits: ``ceil(n · bits / 8)``."""
    check_int("n", n, 0)
    return (n * _check_bits(bits) + 7) // 8


_SHIFT8 = torch.arange(8, dtype=torch.uint8)


def pack_bits(mask: torch.Tensor, bits: int = 1) -> torch.Tensor:
    """``bool[n]`` -> uint8 buffer of ``packed_bytes(n, bits)`` bytes (layout: module doc)."""
    bits = _check_bits(bits)
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() != 1:
        raise ValueError("pack_bits: mask must be a 1-D bool tensor, got "
                         f"{getattr(mask, 'dtype', type(mask).__name__)} "
                         f"{tuple(getattr(mask, 'shape', ()))}")
    n = mask.numel()
    if bits == 1 and host_kernels(mask):  # numpy's packbits: the same layout, ~100x faster
        return torch.from_numpy(np.packbits(mask.numpy(), bitorder="little"))
    per_byte = 8 // bits
    nb = packed_bytes(n, bits)
    m = torch.zeros(nb * per_byte, dtype=torch.uint8, device=mask.device)
    m[:n] = mask
    m = m.view(nb, per_byte)
    shift = _SHIFT8.to(mask.device)[:per_byte] * bits  # bit i (1-bit) or nibble i (4-bit)
    return (m << shift).sum(dim=1, dtype=torch.uint8)


def unpack_bits(buf: torch.Tensor, n: int, bits: int = 1) -> torch.Tensor:
    """uint8 buffer -> per-element field ``uint8[n]`` (0/1 for a 1-bit bitmap, the counter for
    4 bits). Validates type, length and that the padding bits past ``n`` are zero
    (``ValueError``)."""
    bits = _check_bits(bits)
    check_int("n", n, 0)
    if not isinstance(buf, torch.Tensor) or buf.dtype != torch.uint8 or buf.dim() != 1:
        raise ValueError("unpack_bits: buffer must be a 1-D uint8 tensor, got "
                         f"{getattr(buf, 'dtype', type(buf).__name__)} "
                         f"{tuple(getattr(buf, 'shape', ()))}")
    nb = packed_bytes(n, bits)
    if buf.numel() != nb:
        raise ValueError(f"unpack_bits: {n} elements at {bits} bit(s) need {nb} bytes, "
                         f"got {buf.numel()}")
    if bits == 1 and host_kernels(buf):  # numpy's unpackbits, the padding checked apart
        if n % 8 and nb and int(buf[-1]) >> (n % 8):
            raise ValueError("unpack_bits: nonzero padding bits past the last element "
                             "(corrupt or foreign buffer)")
        return torch.from_numpy(np.unpackbits(buf.numpy(), count=n, bitorder="little"))
    per_byte = 8 // bits
    shift = _SHIFT8.to(buf.device)[:per_byte] * bits
    vals = ((buf.unsqueeze(1) >> shift) & ((1 << bits) - 1)).view(-1)
    if vals.numel() > n and bool(vals[n:].any()):
        raise ValueError("unpack_bits: nonzero padding bits past the last element "
                         "(corrupt or foreign buffer)")
    return vals[:n]
