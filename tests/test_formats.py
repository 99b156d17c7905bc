"""COO and DenseStream wire formats: round trips, exact sizes, §III-A block rules, fuzzing;
the shared wire helpers (formats/wire.py): index width, entries, header, bit packing.

References are computed independently of the code under test: block sizes by a plain Python
walk over the nonzeros, hostile buffers packed by hand with ``struct``.
"""

from __future__ import annotations

import math
import re
import struct
from itertools import pairwise

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import segmented
from gradsync import sparsegrad
from gradsync.formats import coo, wire
from gradsync.formats import densestream as ds
from gradsync.sparsegrad import SparseGrad, host_kernels

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SLOW = settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(BITS[t.dtype])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


# -- inputs --------------------------------------------------------------------------------
@st.composite
def sparse_grads(draw, max_numel: int = 400, raw_bits: bool | None = None):
    """A random selection: uniform, clustered or dense, with normal or arbitrary-bit values."""
    numel = draw(st.integers(0, max_numel))
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**31 - 1))
    shape = draw(st.sampled_from(["uniform", "clustered", "runs", "full"]))
    g = torch.Generator().manual_seed(seed)
    if numel == 0:
        mask = torch.zeros(0, dtype=torch.bool)
    elif shape == "uniform":
        mask = torch.rand(numel, generator=g) < draw(st.floats(0.0, 1.0))
    elif shape == "full":
        mask = torch.ones(numel, dtype=torch.bool)
    elif shape == "clustered":  # a dense window with a few strays elsewhere
        lo = int(torch.randint(numel, (1,), generator=g))
        hi = min(numel, lo + int(torch.randint(1, 64, (1,), generator=g)))
        mask = torch.rand(numel, generator=g) < 0.02
        mask[lo:hi] |= torch.rand(hi - lo, generator=g) < 0.8
    else:  # runs separated by gaps of 0..6 zeros: exercises the gap rule at its edge
        gaps = torch.randint(0, 7, (numel,), generator=g)
        runs = torch.randint(1, 4, (numel,), generator=g)
        mask = torch.zeros(numel, dtype=torch.bool)
        pos = 0
        for gap, run in zip(gaps.tolist(), runs.tolist()):  # test-side reference only
            pos += gap
            if pos >= numel:
                break
            mask[pos:pos + run] = True
            pos += run
    idx = torch.nonzero(mask).reshape(-1)
    use_bits = draw(st.booleans()) if raw_bits is None else raw_bits
    if use_bits:  # any bit pattern: NaN payloads, ±Inf, −0.0, +0.0, subnormals
        ib = BITS[dtype]
        info = torch.iinfo(ib)
        vals = torch.randint(info.min, info.max, (idx.numel(),), generator=g,
                             dtype=torch.int64).to(ib).view(dtype)
    else:
        vals = torch.randn(idx.numel(), generator=g).to(dtype)
    return SparseGrad(idx, vals, numel)


def nonzero_entries(sel: SparseGrad) -> tuple[list[int], torch.Tensor]:
    keep = bits(sel.values) != 0
    return sel.indices[keep].tolist(), sel.values[keep]


def reference_payload(sel: SparseGrad, iw: int) -> tuple[int, int, int]:
    """(blocks, Σ lengths, payload bytes) by walking the nonzeros in Python (§III-A)."""
    idx, _ = nonzero_entries(sel)
    k = sel.values.element_size()
    if not idx:
        return 0, 0, 0
    nblocks, total = 1, 1
    for a, b in pairwise(idx):
        zeros = b - a - 1
        if zeros * k <= 2 * iw:  # keep the zeros inside the block
            total += zeros + 1
        else:
            nblocks += 1
            total += 1
    return nblocks, total, nblocks * 2 * iw + k * total


# -- shared wire helpers ---------------------------------------------------------------------
def test_wire_index_width_is_int32_exactly_below_2_31():
    assert wire.wire_index_dtype(0) == wire.wire_index_dtype(2**31 - 1) == torch.int32
    assert wire.wire_index_dtype(2**31) == wire.wire_index_dtype(2**40) == torch.int64
    assert wire.wire_index_bytes(2**31 - 1) == 4 and wire.wire_index_bytes(2**31) == 8
    assert wire.check_index_bytes(4, 2**31 - 1) == torch.int32
    assert wire.check_index_bytes(8, 2**31) == torch.int64
    with pytest.raises(ValueError, match="2\\*\\*31"):
        wire.check_index_bytes(4, 2**31)
    with pytest.raises(ValueError, match="index_bytes"):
        wire.check_index_bytes(2, 10)


def test_wire_entries_keep_int64_indices_exact():
    idx = torch.tensor([0, 2**24 + 1, 2**31 + 3, 2**40 + 5])
    val = torch.tensor([1.0, -2.0, 3.0, 4.0], dtype=torch.bfloat16)
    buf = wire.pack_entries(idx, val, torch.int64)
    assert buf.dtype == torch.uint8 and buf.numel() == 4 * (8 + 2)
    assert wire.entry_bytes(torch.int64, torch.bfloat16) == 10
    assert bytes(buf[:32].tolist()) == struct.pack("<4q", *idx.tolist())  # indices first
    i2, v2 = wire.unpack_entries(buf, 4, torch.int64, torch.bfloat16)
    assert i2.dtype == torch.int64 and torch.equal(i2, idx) and torch.equal(v2, val)
    odd = wire.pack_entries(idx[:3] % 2**31, val[:3].double(), torch.int32)  # unaligned values
    assert bytes(odd.tolist()) == struct.pack("<3i3d", *(idx[:3] % 2**31).tolist(),
                                              *val[:3].double().tolist())
    i3, v3 = wire.unpack_entries(odd, 3, torch.int32, torch.float64)
    assert torch.equal(i3, idx[:3] % 2**31) and torch.equal(v3, val[:3].double())
    with pytest.raises(ValueError, match="not 3 entries"):
        wire.unpack_entries(odd[:-1], 3, torch.int32, torch.float64)
    e_i, e_v = wire.unpack_entries(wire.pack_entries(idx[:0], val[:0], torch.int32), 0,
                                   torch.int32, torch.bfloat16)
    assert e_i.numel() == 0 and e_v.dtype == torch.bfloat16


@settings(max_examples=60, deadline=None)
@given(capacity=st.integers(0, 40), data=st.data(),
       index=st.sampled_from([torch.int32, torch.int64]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_wire_fixed_entries_round_trip_at_any_count(capacity, data, index, dtype):
    count = data.draw(st.integers(0, capacity))
    g = torch.Generator().manual_seed(capacity * 41 + count)
    idx = torch.sort(torch.randperm(1000, generator=g)[:count]).values
    val = torch.randn(count, generator=g).to(dtype)
    buf = wire.pack_entries_fixed(idx, val, index, capacity)
    # layout: an int64 count, the entries as pack_entries lays them out, zeros to the capacity
    size = 8 + capacity * wire.entry_bytes(index, dtype)
    assert buf.numel() == size == wire.fixed_entries_bytes(capacity, index, dtype)
    assert struct.unpack("<q", bytes(buf[:8].tolist()))[0] == count
    body = wire.pack_entries(idx, val, index)
    assert torch.equal(buf[8:8 + body.numel()], body) and not buf[8 + body.numel():].any()
    i2, v2 = wire.unpack_entries_fixed(buf, capacity, index, dtype)
    assert torch.equal(i2, idx) and torch.equal(v2.view(torch.int16 if dtype != torch.float32
                                                        else torch.int32),
                                                val.view(torch.int16 if dtype != torch.float32
                                                         else torch.int32))
    # the counted message: the same without the zeros (what a bounded receive reads)
    counted = wire.pack_entries_counted(idx, val, index)
    assert wire.COUNT_BYTES == 8 and counted.numel() == 8 + body.numel()
    assert torch.equal(counted, buf[:8 + body.numel()])


@settings(max_examples=60, deadline=None)
@given(data=st.data(), index=st.sampled_from([torch.int32, torch.int64]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_wire_entries_with_a_dense_prefix_round_trip_without_its_indices(data, index, dtype):
    m = data.draw(st.integers(0, 30))
    tail = data.draw(st.integers(0, 30))
    g = torch.Generator().manual_seed(m * 97 + tail)
    rest = torch.sort(torch.randperm(500, generator=g)[:tail]).values
    idx = torch.cat([torch.arange(m), m + rest])
    val = torch.randn(m + tail, generator=g).to(dtype)
    buf = wire.pack_entries(idx, val, index, m)
    ib, vb = index.itemsize, dtype.itemsize
    # layout: the indices of the entries past the prefix, then every value
    assert buf.numel() == tail * ib + (m + tail) * vb == wire.entries_bytes(m + tail, index,
                                                                            dtype, m)
    assert torch.equal(buf[tail * ib:], val.contiguous().view(torch.uint8))
    got_idx, got_val = wire.unpack_entries(buf, m + tail, index, dtype, prefix=m)
    assert torch.equal(got_idx, idx[m:])
    assert torch.equal(got_val.view(torch.uint8), val.view(torch.uint8))
    longer = torch.cat([buf, torch.zeros(1, dtype=torch.uint8)])  # one byte too many
    with pytest.raises(ValueError, match="is not"):
        wire.unpack_entries(longer, m + tail, index, dtype, prefix=m)
    with pytest.raises(ValueError, match="prefix"):
        wire.unpack_entries(buf, m + tail, index, dtype, prefix=m + tail + 1)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), index=st.sampled_from([torch.int32, torch.int64]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_wire_capped_entries_round_trip_and_mask_what_lies_past_the_count(data, index, dtype):
    """pack_entries_capped: an int64 count, the indices past the dense prefix and zeros to
    capacity − prefix, the values and zeros to the capacity, each part padded to 8 bytes;
    unpacked on the device, the indices past the count read as numel (nowhere), the values
    as sent (+0), and ``ok`` holds."""
    m = data.draw(st.integers(0, 10))
    count = m + data.draw(st.integers(0, 20))
    capacity = count + data.draw(st.integers(0, 15))
    g = torch.Generator().manual_seed(m * 1009 + count * 31 + capacity)
    idx = torch.cat([torch.arange(m), m + torch.sort(torch.randperm(400, generator=g)
                                                     [:count - m]).values])
    val = torch.randn(count, generator=g).to(dtype)
    buf = wire.pack_entries_capped(idx, val, index, capacity, m)
    ib, vb = index.itemsize, dtype.itemsize
    at = 8 + math.ceil((capacity - m) * ib / 8) * 8
    assert buf.numel() == at + math.ceil(capacity * vb / 8) * 8 == \
        wire.capped_entries_bytes(capacity, index, dtype, m)
    assert struct.unpack("<q", bytes(buf[:8].tolist()))[0] == count
    assert not buf[8 + (count - m) * ib:at].any() and not buf[at + count * vb:].any()
    got_i, got_v, ok = wire.unpack_entries_capped(buf, capacity, index, dtype, 400 + m, m)
    assert bool(ok)
    want_i = torch.full((capacity - m,), 400 + m, dtype=torch.int64)
    want_i[:count - m] = idx[m:]
    want_v = torch.zeros(capacity, dtype=dtype)
    want_v[:count] = val
    assert torch.equal(got_i, want_i)
    assert torch.equal(got_v.view(torch.uint8), want_v.view(torch.uint8))


def test_wire_capped_entries_flag_hostile_counts_and_indices_without_writing_anywhere():
    idx, val = torch.tensor([0, 1, 5]), torch.tensor([1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="outside"):
        wire.pack_entries_capped(idx, val, torch.int32, 2)  # above the capacity
    with pytest.raises(ValueError, match="outside"):
        wire.pack_entries_capped(idx[:1], val[:1], torch.int32, 4, prefix=2)  # below the prefix
    buf = wire.pack_entries_capped(idx, val, torch.int32, 4, prefix=2)
    with pytest.raises(ValueError, match="bytes"):
        wire.unpack_entries_capped(buf[:-1], 4, torch.int32, torch.float32, 10, 2)
    for bad in (5, 1, -1):  # above the capacity, below the prefix, negative
        forged = buf.clone()
        forged[:8] = torch.tensor(list(struct.pack("<q", bad)), dtype=torch.uint8)
        i, _, ok = wire.unpack_entries_capped(forged, 4, torch.int32, torch.float32, 10, 2)
        assert not bool(ok) and int(i.min()) >= 0 and int(i.max()) <= 10
    for bad_index in (10, -3):  # an announced index outside [0, numel): flagged, sent nowhere
        forged = buf.clone()
        forged[8:12] = torch.tensor(list(struct.pack("<i", bad_index)), dtype=torch.uint8)
        i, _, ok = wire.unpack_entries_capped(forged, 4, torch.int32, torch.float32, 10, 2)
        assert not bool(ok) and int(i[0]) == 10



@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_wire_capped_entries_ok_is_the_count_and_every_announced_index_checked(data):
    """``ok`` of a forged message (any count, any indices) against the rule checked here one
    entry at a time: the count lies in [prefix, capacity] and every index it announces in
    [0, numel); what is returned points inside [0, numel], and at numel (nowhere) exactly
    where an index is past the count or out of range."""
    prefix = data.draw(st.integers(0, 3))
    capacity = prefix + data.draw(st.integers(0, 6))
    numel = data.draw(st.integers(1, 12))
    count = data.draw(st.integers(-3, capacity + 3))
    forged_idx = data.draw(st.lists(st.integers(-4, numel + 4), min_size=capacity - prefix,
                                    max_size=capacity - prefix))
    pad = torch.zeros(4 * ((capacity - prefix) % 2), dtype=torch.uint8)  # to 8 bytes
    buf = torch.tensor(list(struct.pack("<q", count)), dtype=torch.uint8)
    buf = torch.cat([buf, torch.tensor(forged_idx, dtype=torch.int32).view(torch.uint8), pad,
                     torch.ones(capacity).view(torch.uint8),
                     torch.zeros(4 * (capacity % 2), dtype=torch.uint8)])
    i, v, ok = wire.unpack_entries_capped(buf, capacity, torch.int32, torch.float32, numel,
                                          prefix)
    announced = forged_idx[:max(0, min(count, capacity) - prefix)]
    want = prefix <= count <= capacity and all(0 <= j < numel for j in announced)
    assert bool(ok) == want
    assert i.tolist() == [j if p < count - prefix and 0 <= j < numel else numel
                          for p, j in enumerate(forged_idx)]
    assert v.tolist() == [1.0] * capacity

def test_wire_fixed_entries_refuse_hostile_counts_and_sizes():
    idx, val = torch.tensor([1, 5]), torch.tensor([1.0, 2.0])
    with pytest.raises(ValueError, match="exceed the capacity"):
        wire.pack_entries_fixed(idx, val, torch.int32, 1)
    buf = wire.pack_entries_fixed(idx, val, torch.int32, 3)
    with pytest.raises(ValueError, match="bytes"):
        wire.unpack_entries_fixed(buf[:-1], 3, torch.int32, torch.float32)
    for bad in (4, -1):  # above the capacity, negative: refused before anything is read
        forged = buf.clone()
        forged[:8] = torch.tensor(list(struct.pack("<q", bad)), dtype=torch.uint8)
        with pytest.raises(ValueError, match="announces"):
            wire.unpack_entries_fixed(forged, 3, torch.int32, torch.float32)


def test_wire_header_round_trip_and_layout():
    buf = wire.pack_header(b"TEST", 8, wire.dtype_code(torch.float16), 2**40, -3, 7)
    assert bytes(buf.tolist()) == struct.pack("<4sBBBBqqq", b"TEST", 1, 8, 2, 0, 2**40, -3, 7)
    assert buf.numel() == wire.header_bytes(3) == 32
    iw, dtype, fields = wire.unpack_header(buf, b"TEST", 3, "t")
    assert (iw, dtype, fields) == (8, torch.float16, [2**40, -3, 7])
    with pytest.raises(ValueError, match="expected 5"):
        wire.unpack_header(buf, b"TEST", 3, "t", numel=5)
    with pytest.raises(ValueError, match="magic"):
        wire.unpack_header(buf, b"OTHR", 3, "t")
    with pytest.raises(ValueError, match="unsupported value dtype"):
        wire.dtype_code(torch.int32)


def test_dtype_codes_are_one_table():
    """Both formats write the one table's codes (the collectives' shape consensus reads it)."""
    documented = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float64: 4}
    assert documented == wire.DTYPE_CODES
    assert all(wire.CODE_DTYPES[c] == d for d, c in wire.DTYPE_CODES.items())
    for d, c in CODES.items():
        assert bytes(coo.encode(SparseGrad.empty(3, d)).tolist())[6] == c
        assert bytes(ds.encode(SparseGrad.empty(3, d)).tolist())[6] == c


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 300), bits_=st.sampled_from([1, 4]), seed=st.integers(0, 10**6))
def test_wire_bit_packing_layout(n, bits_, seed):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(n, generator=g) < 0.4
    buf = wire.pack_bits(mask, bits_)
    assert buf.dtype == torch.uint8 and buf.numel() == wire.packed_bytes(n, bits_)
    assert buf.numel() == (n * bits_ + 7) // 8
    # Independent reference: element i is bit i·bits of the little-endian integer.
    ref = sum(1 << (i * bits_) for i in range(n) if bool(mask[i]))
    assert bytes(buf.tolist()) == ref.to_bytes(buf.numel(), "little")
    assert torch.equal(wire.unpack_bits(buf, n, bits_), mask.to(torch.uint8))
    if n % (8 // bits_):  # a nonzero padding field is rejected
        bad = buf.clone()
        bad[-1] |= 1 << (8 - bits_)
        with pytest.raises(ValueError, match="padding"):
            wire.unpack_bits(bad, n, bits_)


# -- COO -----------------------------------------------------------------------------------
@pytest.mark.usefixtures("kernels")
@FAST
@given(sel=sparse_grads(), iw=st.sampled_from([4, 8]))
def test_coo_roundtrip_bitwise_and_size(sel, iw):
    buf = coo.encode(sel, index_bytes=iw)
    assert buf.dtype == torch.uint8 and buf.dim() == 1
    assert len(buf) == coo.size_bytes(sel, iw) == coo.HEADER_BYTES + len(sel) * (
        iw + sel.values.element_size())
    out = coo.decode(buf, numel=sel.numel, dtype=sel.dtype)
    assert out.numel == sel.numel and out.indices.dtype == torch.int64
    assert torch.equal(out.indices, sel.indices)
    assert same_bits(out.values, sel.values)
    assert torch.equal(coo.encode(out, iw), buf)


def test_coo_header_layout_is_documented_one():
    sel = SparseGrad(torch.tensor([3, 7]), torch.tensor([1.5, -2.0]), 10)
    raw = bytes(coo.encode(sel).tolist())
    assert raw[:24] == struct.pack("<4sBBBBqq", b"GSCO", 1, 4, 1, 0, 10, 2)
    assert raw[24:32] == struct.pack("<ii", 3, 7)
    assert raw[32:] == struct.pack("<ff", 1.5, -2.0)


def test_coo_int32_only_below_2_31():
    big = SparseGrad.empty(2**31)
    with pytest.raises(ValueError, match="2\\*\\*31"):
        coo.encode(big, index_bytes=4)
    with pytest.raises(ValueError, match="2\\*\\*31"):
        coo.size_bytes(big, index_bytes=4)
    out = coo.decode(coo.encode(big, index_bytes=8))
    assert out.numel == 2**31 and len(out) == 0
    sel = SparseGrad(torch.tensor([2**31 - 1, 2**40]), torch.tensor([1.0, 2.0]), 2**41)
    assert torch.equal(coo.decode(coo.encode(sel, index_bytes=8)).indices, sel.indices)
    with pytest.raises(ValueError, match="index_bytes"):
        coo.encode(SparseGrad.empty(4), index_bytes=2)


def test_coo_rejects_bad_arguments():
    with pytest.raises(ValueError, match="SparseGrad"):
        coo.encode(torch.zeros(3))
    with pytest.raises(ValueError, match="dtype"):
        coo.encode(SparseGrad(torch.tensor([0]), torch.tensor([1.0], dtype=torch.complex64), 2,
                              validate=False))
    buf = coo.encode(SparseGrad(torch.tensor([1]), torch.tensor([1.0]), 4))
    with pytest.raises(ValueError, match="numel"):
        coo.decode(buf, numel=5)
    with pytest.raises(ValueError, match="expected"):
        coo.decode(buf, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="uint8"):
        coo.decode(buf.view(torch.int8))
    with pytest.raises(ValueError, match="uint8"):
        coo.decode([1, 2, 3])
    assert len(coo.decode(bytes(buf.tolist()))) == 1


def _coo_raw(numel, nnz, idx, vals, *, iw=4, code=1, magic=b"GSCO", version=1, reserved=0):
    ifmt = {4: "i", 8: "q"}[iw]
    return (struct.pack("<4sBBBBqq", magic, version, iw, code, reserved, numel, nnz)
            + struct.pack(f"<{len(idx)}{ifmt}", *idx) + struct.pack(f"<{len(vals)}f", *vals))


@pytest.mark.parametrize("raw, what", [
    (b"", "shorter"),
    (b"GSCO", "shorter"),
    (_coo_raw(4, 1, [1], [1.0], magic=b"GSDS"), "magic"),
    (_coo_raw(4, 1, [1], [1.0], version=2), "version"),
    (_coo_raw(4, 1, [1], [1.0], iw=4, code=9), "dtype code"),
    (_coo_raw(4, 1, [1], [1.0], reserved=1), "reserved"),
    (_coo_raw(4, 1, [1], [1.0])[:-1], "truncated"),
    (_coo_raw(4, 1, [1], [1.0]) + b"\0", "truncated"),
    (_coo_raw(2**62, 2**62, [], [], iw=8), "truncated"),     # nnz larger than the buffer holds
    (_coo_raw(10, -1, [], []), "nnz"),
    (_coo_raw(4, 5, [0, 1, 2, 3, 3], [1.0] * 5), "nnz"),  # nnz > numel
    (_coo_raw(-4, 0, [], []), "numel"),
    (_coo_raw(2**31, 0, [], []), "numel"),                # int32 indices, numel too large
    (_coo_raw(4, 1, [4], [1.0]), "range"),
    (_coo_raw(4, 1, [-1], [1.0]), "range"),
    (_coo_raw(4, 2, [2, 1], [1.0, 1.0]), "increasing"),
    (_coo_raw(4, 2, [1, 1], [1.0, 1.0]), "increasing"),
    (_coo_raw(2**40, 1, [2**40], [1.0], iw=8), "range"),
])
def test_coo_hostile_buffers(raw, what):
    with pytest.raises(ValueError, match=what):
        coo.decode(raw)


# -- DenseStream ---------------------------------------------------------------------------
@FAST
@given(sel=sparse_grads(), iw=st.sampled_from([4, 8]))
def test_densestream_roundtrip_size_and_closed_form(sel, iw):
    buf = ds.encode(sel, index_bytes=iw)
    out = ds.decode(buf, numel=sel.numel, dtype=sel.dtype)
    # to_dense round-trips bit for bit; decode returns exactly the nonzeros.
    assert same_bits(out.to_dense(), sel.to_dense())
    ref_idx, ref_val = nonzero_entries(sel)
    assert out.indices.tolist() == ref_idx
    assert same_bits(out.values, ref_val)
    # Exact size: len(encode) == size_bytes == header + blocks·2·iw + K·Σ lengths.
    nblocks, total, payload = reference_payload(sel, iw)
    assert len(buf) == ds.size_bytes(sel, iw) == ds.HEADER_BYTES + payload
    starts, lengths = ds.blocks(sel, iw)
    assert starts.numel() == nblocks and int(lengths.sum()) == total
    # Canonical: re-encoding the decoded selection gives the same bytes.
    assert torch.equal(ds.encode(out, iw), buf)
    # A dense tensor encodes like its SparseGrad.
    assert torch.equal(ds.encode(sel.to_dense(), iw), buf)


@FAST
@given(sel=sparse_grads(), iw=st.sampled_from([4, 8]))
def test_densestream_blocks_obey_section_3a_rules(sel, iw):
    k = sel.values.element_size()
    z = (2 * iw) // k
    dense_bits = bits(sel.to_dense())
    starts, lengths = ds.blocks(sel, iw)
    s, n = starts.tolist(), lengths.tolist()
    covered = torch.zeros(sel.numel, dtype=torch.bool)
    for i, (a, m) in enumerate(zip(s, n)):
        blk = dense_bits[a:a + m]
        assert m >= 1 and blk[0] != 0 and blk[-1] != 0               # rule 1
        run = longest = 0
        for b in blk.tolist():                                        # rule 2
            run = run + 1 if b == 0 else 0
            longest = max(longest, run)
        assert longest * k <= 2 * iw and longest <= z
        if i:
            assert a - (s[i - 1] + n[i - 1]) > z                      # split only when cheaper
        covered[a:a + m] = True
    assert not bool((dense_bits[~covered] != 0).any())                # every nonzero covered


def test_gap_rule_examples_from_the_brief():
    # 4-byte index and length: fp32 keeps ≤ 2 zeros inside a block, bf16/fp16 keep ≤ 4.
    assert ds.max_zero_run(4, 4) == 2 and ds.max_zero_run(4, 2) == 4
    assert ds.max_zero_run(8, 4) == 4 and ds.max_zero_run(8, 8) == 2
    for zeros, fp32_blocks, half_blocks in [(2, 1, 1), (3, 2, 1), (4, 2, 1), (5, 2, 2)]:
        x = torch.zeros(20)
        x[3] = 1.0
        x[4 + zeros] = 2.0
        assert ds.blocks(x)[0].numel() == fp32_blocks
        assert ds.blocks(x.to(torch.bfloat16))[0].numel() == half_blocks
        assert ds.blocks(x.to(torch.float16))[0].numel() == half_blocks
    # Fig. 2 of the paper: 3 zeros between two runs make two blocks (4-byte everything).
    x = torch.tensor([0, 1, 1, 0, 1, 0, 0, 1, 0, 0, 0, 1, 1, 0], dtype=torch.float32)
    starts, lengths = ds.blocks(x)
    assert starts.tolist() == [1, 11] and lengths.tolist() == [7, 2]
    assert ds.size_bytes(x) == ds.HEADER_BYTES + 2 * 8 + 4 * 9


@FAST
@given(sel=sparse_grads(raw_bits=False), iw=st.sampled_from([4, 8]))
def test_densestream_size_bounds_against_coo(sel, iw):
    """What holds (derived in the module docstring), with payload = size − header."""
    k = sel.values.element_size()
    idx, _ = nonzero_entries(sel)
    nnz = len(idx)
    payload = ds.size_bytes(sel, iw) - ds.HEADER_BYTES
    coo_payload = nnz * (iw + k)            # COO of the same nonzeros
    if nnz == 0:
        assert payload == 0
        return
    assert 2 * iw + k * nnz <= payload <= (2 * iw + k) * nnz
    assert payload <= coo_payload + iw * nnz                 # at most one length per nonzero
    assert payload <= 2 * iw + k * (idx[-1] - idx[0] + 1)    # ≤ one pair over the dense span
    assert payload <= 2 * iw + k * sel.numel                 # ... and over the whole tensor
    gaps = [b - a - 1 for a, b in pairwise(idx)]
    if all(g * k > 2 * iw for g in gaps):                    # all singletons: equality
        assert payload == coo_payload + iw * nnz
    if all(g == 0 for g in gaps):                            # one run: dense plus one pair
        assert payload == 2 * iw + k * nnz


def test_densestream_extremes():
    x = torch.randn(1000)
    x[x == 0] = 1.0
    assert ds.size_bytes(x) == ds.HEADER_BYTES + 8 + 4 * 1000      # fully dense: one block
    sel = SparseGrad(torch.arange(0, 1000, 10), torch.ones(100), 1000)   # all singletons
    assert ds.size_bytes(sel) - ds.HEADER_BYTES == coo.size_bytes(sel) - coo.HEADER_BYTES + 400
    empty = SparseGrad.empty(7, torch.bfloat16)
    assert len(ds.encode(empty)) == ds.HEADER_BYTES
    out = ds.decode(ds.encode(empty))
    assert out.numel == 7 and len(out) == 0 and out.dtype == torch.bfloat16
    # Explicit +0.0 entries are not stored; −0.0 is (bitwise round trip).
    sel = SparseGrad(torch.tensor([1, 2, 5]), torch.tensor([0.0, -0.0, 3.0]), 8)
    out = ds.decode(ds.encode(sel))
    assert out.indices.tolist() == [2, 5] and same_bits(out.to_dense(), sel.to_dense())


@pytest.mark.parametrize("accelerators", [False, True])
@pytest.mark.parametrize("zeros", [False, True])
def test_densestream_encode_reads_its_layout_once_where_a_read_waits(zeros, accelerators):
    """Entries that hold +0.0 (the stored zeros a sum carries in DenseStream's allreduce): on
    the accelerators' path they are skipped where they stand and the layout comes back in one
    read (``tolist``); on the CPU's, where a read costs no wait, they are
    counted, dropped and the rest laid out once (no ``tolist``: a compaction and a scatter,
    cheaper there than a masked fill). Either way the bytes are those of the selection
    without them."""

    from gradsync.apps.bench import overhead

    g = torch.Generator().manual_seed(5)
    idx = torch.randperm(10_000, generator=g)[:600].sort().values
    val = torch.randn(600, generator=g)
    if zeros:
        val[::3] = 0.0
        val[1] = -0.0  # a nonzero bit pattern: kept
    sel = SparseGrad(idx, val, 10_000)
    kept = val.view(torch.int32) != 0
    assert int(kept.sum()) == (400 if zeros else 600)
    with sparsegrad.using(segmented(accelerators)):
        c = overhead.count_step(lambda: ds.encode(sel), steps=1)
        if accelerators:
            assert c["host_read_ops"].get("Tensor.tolist") == 1
        elif host_kernels(idx):  # the CPU's kernels (not those standing in for a GPU's)
            assert "Tensor.tolist" not in c["host_read_ops"]
        assert torch.equal(ds.encode(sel), ds.encode(SparseGrad(idx[kept], val[kept], 10_000)))


def test_densestream_rejects_bad_arguments():
    with pytest.raises(ValueError, match="2\\*\\*31"):
        ds.encode(SparseGrad.empty(2**31), index_bytes=4)
    with pytest.raises(ValueError, match="index_bytes"):
        ds.size_bytes(torch.ones(3), index_bytes=5)
    with pytest.raises(ValueError, match="floating"):
        ds.encode(torch.ones(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="SparseGrad"):
        ds.encode([1.0, 2.0])
    big = SparseGrad(torch.tensor([5, 2**40]), torch.tensor([1.0, 2.0]), 2**41)
    assert torch.equal(ds.decode(ds.encode(big, index_bytes=8)).indices, big.indices)
    buf = ds.encode(torch.ones(4))
    with pytest.raises(ValueError, match="numel"):
        ds.decode(buf, numel=3)
    with pytest.raises(ValueError, match="expected"):
        ds.decode(buf, dtype=torch.float16)


def _ds_raw(numel, starts, lengths, vals, *, nb=None, total=None, iw=4, code=1, magic=b"GSDS"):
    ifmt = {4: "i", 8: "q"}[iw]
    nb = len(starts) if nb is None else nb
    total = len(vals) if total is None else total
    return (struct.pack("<4sBBBBqqq", magic, 1, iw, code, 0, numel, nb, total)
            + struct.pack(f"<{len(starts)}{ifmt}", *starts)
            + struct.pack(f"<{len(lengths)}{ifmt}", *lengths)
            + struct.pack(f"<{len(vals)}f", *vals))


def test_densestream_hand_packed_buffer_decodes():
    raw = _ds_raw(20, [2, 10], [3, 1], [1.0, 0.0, 2.0, 3.0])
    out = ds.decode(raw)
    assert out.indices.tolist() == [2, 4, 10] and out.values.tolist() == [1.0, 2.0, 3.0]


U32_MAX = 2**32 - 1


@pytest.mark.parametrize("raw, what", [
    (b"GSDS\x01", "shorter"),
    (_ds_raw(20, [2], [1], [1.0], magic=b"GSCO"), "magic"),
    (_ds_raw(20, [2], [1], [1.0])[:-2], "truncated"),
    (_ds_raw(20, [2], [1], [1.0], total=2**60), "inconsistent"),          # total > numel
    (_ds_raw(2**62, [2], [1], [1.0], iw=8, nb=2**61, total=2**61), "truncated"),
    (_ds_raw(20, [2], [1], [1.0], nb=-1), "inconsistent"),
    (_ds_raw(20, [2, 5], [1, 1], [1.0], nb=2, total=1), "inconsistent"),
    (_ds_raw(20, [2], [0], [], total=0, nb=1), "inconsistent"),         # a block, no values
    (_ds_raw(20, [2, 9], [0, 2], [1.0, 1.0]), "length < 1"),
    (_ds_raw(20, [-1], [1], [1.0]), "outside"),
    (_ds_raw(20, [19], [2], [1.0, 1.0]), "outside"),
    (_ds_raw(20, [2**31 - 1], [1], [1.0]), "outside"),
    (_ds_raw(2**40, [5], [2**63 - 1], [1.0], iw=8), "length|outside|sum"),   # length overflow
    (_ds_raw(2**40, [2**63 - 1], [1], [1.0], iw=8), "outside"),             # start + length
    (_ds_raw(20, [2, 2], [1, 1], [1.0, 1.0]), "overlapping"),
    (_ds_raw(20, [9, 2], [1, 1], [1.0, 1.0]), "overlapping"),
    (_ds_raw(20, [2, 3], [2, 1], [1.0, 1.0, 1.0]), "overlapping"),
    (_ds_raw(20, [2, 10], [2, 2], [1.0, 1.0, 1.0], total=3), "truncated|sum"),
    (_ds_raw(20, [2], [2], [1.0, 0.0]), "rule 1"),
    (_ds_raw(20, [2], [2], [0.0, 1.0]), "rule 1"),
    (_ds_raw(20, [2], [5], [1.0, 0.0, 0.0, 0.0, 1.0]), "rule 2"),
    (_ds_raw(20, [2, 5], [1, 1], [1.0, 1.0]), "gap rule"),               # should be one block
    (_ds_raw(2**31, [2], [1], [1.0]), "numel"),                          # int32 indices
])
def test_densestream_hostile_buffers(raw, what):
    with pytest.raises(ValueError, match=what):
        ds.decode(raw)
    numel = struct.unpack_from("<q", raw, 8)[0] if len(raw) >= 16 else 20
    if 0 <= numel <= 1 << 20:  # decode_into refuses it for the same reason, into any out
        with pytest.raises(ValueError, match=what):
            ds.decode_into(raw, torch.zeros(numel))
    # the deferred readers too: at the header, or with a failed device check naming the rule
    for verdict in _deferred_verdicts(raw, max(numel, 0), torch.float32):
        assert verdict is not None and re.search(what, verdict), verdict


@pytest.mark.usefixtures("kernels")
@FAST
@given(sel=sparse_grads(), iw=st.sampled_from([4, 8]), fill=st.booleans())
def test_densestream_decode_into_writes_the_blocks_bit_for_bit(sel, iw, fill):
    """Into zeros: the selection's dense tensor, bit for bit, and its count of nonzeros.
    Over other values: exactly the indices the blocks cover are written (their zeros too)."""
    buf = ds.encode(sel, index_bytes=iw)
    ref_idx, _ = nonzero_entries(sel)
    out = torch.zeros(sel.numel, dtype=sel.dtype)
    assert ds.decode_into(buf, out) == len(ref_idx)
    assert same_bits(out, sel.to_dense())
    if fill:
        out = torch.full((sel.numel,), 7.0, dtype=sel.dtype)
        ds.decode_into(buf, out)
        covered = torch.zeros(sel.numel, dtype=torch.bool)
        for a, m in zip(*[t.tolist() for t in ds.blocks(sel, iw)]):
            covered[a:a + m] = True
        assert same_bits(out[covered], sel.to_dense()[covered])
        assert bool((out[~covered] == 7.0).all())


@FAST
@given(sel=sparse_grads(), iw=st.sampled_from([4, 8]), pieces=st.integers(1, 3))
def test_densestream_deferred_readers_agree_with_decode(sel, iw, pieces):
    """decode_stored: decode's entries plus the zeros stored inside blocks (as +0.0), every
    check true. split_decode_into of the selection cut into ``pieces`` back-to-back encodings
    (each with its own range): decode_into's tensor, bit for bit, and its count."""
    buf = ds.encode(sel, index_bytes=iw)
    checks: list = []
    got = ds.decode_stored(buf, numel=sel.numel, dtype=sel.dtype, lo=0, hi=sel.numel,
                           checks=checks)
    assert all(bool(ok) for ok, _ in checks)
    covered = torch.zeros(sel.numel, dtype=torch.bool)
    for a, m in zip(*[t.tolist() for t in ds.blocks(sel, iw)]):
        covered[a:a + m] = True
    assert got.indices.tolist() == torch.nonzero(covered).view(-1).tolist()
    assert same_bits(got.to_dense(), sel.to_dense())
    cuts = [sel.numel * j // pieces for j in range(pieces + 1)]
    parts = [SparseGrad(sel.indices[(sel.indices >= a) & (sel.indices < b)],
                        sel.values[(sel.indices >= a) & (sel.indices < b)], sel.numel)
             for a, b in pairwise(cuts)]
    joined = torch.cat([ds.encode(p, index_bytes=iw) for p in parts])
    out, checks = torch.zeros(sel.numel, dtype=sel.dtype), []
    views, nnz = ds.split_decode_into(joined, out, list(pairwise(cuts)), checks)
    assert all(bool(ok) for ok, _ in checks) and len(views) == len(parts)
    assert same_bits(out, sel.to_dense()) and int(nnz) == len(nonzero_entries(sel)[0])


def test_densestream_announced_size_and_headers_given_on_the_host():
    """A header's bytes on the host give its encoding's size, checked as decode checks it, and
    stand for the buffer's own header in the deferred readers (no read)."""
    raw = _ds_raw(20, [2, 10], [3, 1], [1.0, 0.0, 2.0, 3.0])
    head = raw[:ds.HEADER_BYTES]
    assert ds.announced_size(head, numel=20, dtype=torch.float32) == len(raw)
    for bad, what in [(b"GSCO" + head[4:], "magic"), (head[:-1], "shorter"),
                      (_ds_raw(20, [2], [1], [1.0], total=2**60)[:32], "inconsistent")]:
        with pytest.raises(ValueError, match=what):
            ds.announced_size(bad, numel=20, dtype=torch.float32)
    with pytest.raises(ValueError, match="numel"):
        ds.announced_size(head, numel=21, dtype=torch.float32)
    checks: list = []
    got = ds.decode_stored(raw, numel=20, dtype=torch.float32, lo=0, hi=20, checks=checks,
                           header=head)
    assert got.indices.tolist() == [2, 3, 4, 10] and all(bool(ok) for ok, _ in checks)
    out = torch.zeros(20)
    ds.split_decode_into(raw + raw, out.clone(), [(0, 20), (0, 20)], [], [head, head])
    with pytest.raises(ValueError, match="headers given"):
        ds.split_decode_into(raw, out, [(0, 20)], [], [head, head])


def test_densestream_deferred_readers_check_the_range():
    """A block outside the caller's range is a failed check, not a write outside it."""
    raw = _ds_raw(20, [2, 10], [3, 1], [1.0, 0.0, 2.0, 3.0])
    assert _deferred_verdicts(raw, 20, torch.float32, lo=2, hi=11) == [None, None]
    for lo, hi in [(3, 20), (0, 10)]:
        assert all("outside [" in v for v in _deferred_verdicts(raw, 20, torch.float32, lo, hi))
    with pytest.raises(ValueError, match="numel"):
        ds.decode_stored(raw, numel=21, dtype=torch.float32, lo=0, hi=21, checks=[])
    with pytest.raises(ValueError, match="contiguous 1-D"):
        ds.split_decode_into(raw, torch.zeros(40)[::2], [(0, 20)], [])
    with pytest.raises(ValueError, match="left after"):
        ds.split_decode_into(torch.cat([torch.tensor(list(raw), dtype=torch.uint8)] * 2),
                             torch.zeros(20), [(0, 20)], [])


def test_densestream_decode_into_checks_its_range_and_its_out():
    raw = _ds_raw(20, [2, 10], [3, 1], [1.0, 0.0, 2.0, 3.0])
    out = torch.zeros(20)
    assert ds.decode_into(raw, out, lo=2, hi=11) == 3
    assert out[[2, 4, 10]].tolist() == [1.0, 2.0, 3.0] and int((out != 0).sum()) == 3
    for lo, hi in [(3, 20), (0, 10)]:  # the first start below lo; the last index at hi
        with pytest.raises(ValueError, match="outside"):
            ds.decode_into(raw, torch.zeros(20), lo=lo, hi=hi)
    with pytest.raises(ValueError, match="numel"):
        ds.decode_into(raw, torch.zeros(21))
    with pytest.raises(ValueError, match="expected"):
        ds.decode_into(raw, torch.zeros(20, dtype=torch.float16))
    with pytest.raises(ValueError, match="contiguous 1-D"):
        ds.decode_into(raw, torch.zeros(40)[::2])


# -- fuzzing: random bytes, truncations, bit flips ------------------------------------------
FORMATS = {"coo": coo, "densestream": ds}


def _deferred_verdicts(raw: bytes, numel: int, dtype: torch.dtype, lo: int = 0,
                       hi: int | None = None) -> list[str | None]:
    """What the deferred readers (``decode_stored``; ``split_decode_into`` when ``numel`` is
    small) say of ``raw``: the message of their ValueError (the header) or of their first
    failed device check, ``None`` when they accept. Whatever the buffer, nothing else fails,
    every index lies in ``[lo, hi)``, and nothing outside ``[lo, hi)`` is written."""
    hi = numel if hi is None else hi
    verdicts: list[str | None] = []
    checks: list = []
    try:
        got = ds.decode_stored(raw, numel=numel, dtype=dtype, lo=lo, hi=hi, checks=checks)
        assert got.indices.numel() == 0 or bool(
            ((got.indices >= lo) & (got.indices < hi)).all())
        verdicts.append(next((m for ok, m in checks if not bool(ok)), None))
    except ValueError as e:
        verdicts.append(str(e))
    if 0 <= numel <= 1 << 20:
        out, checks = torch.full((numel,), 7.0, dtype=dtype), []
        try:
            ds.split_decode_into(raw, out, [(lo, hi)], checks)
            verdicts.append(next((m for ok, m in checks if not bool(ok)), None))
        except ValueError as e:
            verdicts.append(str(e))
        assert bool((out[:lo] == 7.0).all()) and bool((out[hi:] == 7.0).all())
    return verdicts


def _refused_by_decode_into(fmt, raw: bytes) -> None:
    """What decode refuses, decode_into and the deferred readers refuse too (into a tensor of
    the declared numel)."""
    if fmt is not ds or len(raw) < 16:
        return
    numel, code = struct.unpack_from("<q", raw, 8)[0], raw[6]
    dtype = {1: torch.float32, 2: torch.float16, 3: torch.bfloat16}.get(code, torch.float32)
    if 0 <= numel <= 1 << 20:
        with pytest.raises(ValueError):
            ds.decode_into(raw, torch.zeros(numel, dtype=dtype))
    assert None not in _deferred_verdicts(raw, max(numel, 0), dtype)


def _decode_or_valueerror(fmt, raw: bytes, iw_hint: int | None = None) -> None:
    """decode either raises ValueError or returns a valid, canonical SparseGrad."""
    try:
        out = fmt.decode(raw)
    except ValueError:
        _refused_by_decode_into(fmt, raw)
        return
    out._validate()  # a valid SparseGrad (sorted, in range, matching lengths)
    iw = raw[5]
    assert bytes(fmt.encode(out, index_bytes=iw).tolist()) == raw  # accepted ⇒ canonical
    if fmt is ds and out.numel <= 1 << 20:  # decode_into accepts it too, and agrees
        dense = torch.zeros(out.numel, dtype=out.dtype)
        assert ds.decode_into(raw, dense) == len(out)
        assert same_bits(dense, out.to_dense())
    if fmt is ds:  # so do the deferred readers
        assert _deferred_verdicts(raw, out.numel, out.dtype) in ([None], [None, None])


def _fuzz_random_bytes(data):
    fmt = FORMATS[data.draw(st.sampled_from(sorted(FORMATS)))]
    # A valid header prefix (else nearly everything fails on the magic) with random fields.
    n_fields = 2 if fmt is coo else 3
    head = struct.pack("<4sBBBB", fmt.MAGIC, 1, data.draw(st.sampled_from([4, 8, 3])),
                       data.draw(st.sampled_from([1, 2, 3, 7])), 0)
    fields = [data.draw(st.one_of(st.integers(-2, 64), st.integers(-2**63, 2**63 - 1)))
              for _ in range(n_fields)]
    body = data.draw(st.binary(max_size=256))
    raw = head + struct.pack(f"<{n_fields}q", *fields) + body
    if data.draw(st.booleans()):
        raw = data.draw(st.binary(max_size=64))
    _decode_or_valueerror(fmt, raw)


def _fuzz_mutations(data):
    name = data.draw(st.sampled_from(sorted(FORMATS)))
    fmt = FORMATS[name]
    sel = data.draw(sparse_grads(max_numel=120))
    iw = data.draw(st.sampled_from([4, 8]))
    raw = bytes(fmt.encode(sel, index_bytes=iw).tolist())
    cut = data.draw(st.integers(0, len(raw) - 1))
    with pytest.raises(ValueError):
        fmt.decode(raw[:cut])                          # every truncation is detected
    flipped = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(raw) - 1))
        flipped[pos] ^= 1 << data.draw(st.integers(0, 7))
    _decode_or_valueerror(fmt, bytes(flipped))
    # Header words rewritten to extreme values: a count (nnz, blocks, Σ lengths) can never
    # match the buffer; numel may legitimately grow (with 8-byte indices).
    word = data.draw(st.integers(1, 3 if fmt is ds else 2))
    extreme = bytearray(raw)
    extreme[8 * word: 8 * word + 8] = struct.pack(
        "<q", data.draw(st.sampled_from([-1, 2**31, 2**62, 2**63 - 1, -2**63])))
    if word == 1:
        _decode_or_valueerror(fmt, bytes(extreme))
    else:
        with pytest.raises(ValueError):
            fmt.decode(bytes(extreme))


@FAST
@given(data=st.data())
def test_fuzz_random_buffers(data):
    _fuzz_random_bytes(data)


@FAST
@given(data=st.data())
def test_fuzz_truncations_and_bit_flips(data):
    _fuzz_mutations(data)


@pytest.mark.slow
@SLOW
@given(data=st.data())
def test_fuzz_campaign_random(data):
    _fuzz_random_bytes(data)


@pytest.mark.slow
@SLOW
@given(data=st.data())
def test_fuzz_campaign_mutations(data):
    _fuzz_mutations(data)


def test_densestream_split_back_to_back_encodings():
    """DSA's allgather forwards one encoding per region, back to back: split finds them."""
    a = SparseGrad(torch.tensor([1, 2, 9]), torch.tensor([1.0, 2.0, 3.0]), 20)
    b = SparseGrad.empty(20)
    c = SparseGrad(torch.tensor([15]), torch.tensor([-4.0]), 20)
    bufs = [ds.encode(x) for x in (a, b, c)]
    joined = torch.cat(bufs)
    pieces = ds.split(joined, 3)
    assert [p.numel() for p in pieces] == [x.numel() for x in bufs]
    for p, x in zip(pieces, (a, b, c)):
        assert torch.equal(ds.decode(p).to_dense(), x.to_dense())
    assert ds.split(joined[:0], 0) == []
    with pytest.raises(ValueError, match="left after"):
        ds.split(joined, 2)
    with pytest.raises(ValueError, match=r"past the end|shorter"):
        ds.split(joined[:-1], 3)
    with pytest.raises(ValueError, match="magic"):
        ds.split(torch.cat([bufs[0], coo.encode(a)]), 2)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), index=st.sampled_from([torch.int32, torch.int64]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]))
def test_wire_capped_entries_of_p_messages_unpack_at_once_as_one_by_one(data, index, dtype):
    """An all-gather's ``(P, bytes)`` result unpacks in one call to each message's own
    unpacking, row by row (every part of every message aligned, whatever the widths and
    the capacity's parity), and ``ok`` fails when any one message is malformed."""
    P = data.draw(st.integers(1, 5))
    m = data.draw(st.integers(0, 3))
    capacity = m + data.draw(st.integers(0, 7))
    numel = m + 20
    msgs = []
    for r in range(P):
        count = data.draw(st.integers(m, capacity))
        g = torch.Generator().manual_seed(r * 97 + count)
        idx = torch.cat([torch.arange(m), m + torch.sort(torch.randperm(20, generator=g)
                                                         [:count - m]).values])
        msgs.append(wire.pack_entries_capped(idx, torch.randn(count, generator=g).to(dtype),
                                             index, capacity, m))
    rows = torch.stack(msgs)
    i, v, ok = wire.unpack_entries_capped(rows, capacity, index, dtype, numel, m)
    assert bool(ok) and i.shape == (P, capacity - m) and v.shape == (P, capacity)
    for r, msg in enumerate(msgs):
        one_i, one_v, one_ok = wire.unpack_entries_capped(msg, capacity, index, dtype, numel, m)
        assert bool(one_ok) and torch.equal(i[r], one_i)
        assert torch.equal(v[r].view(torch.uint8), one_v.view(torch.uint8))
    bad = data.draw(st.integers(0, P - 1))
    rows[bad, :8] = torch.tensor(list(struct.pack("<q", capacity + 1)), dtype=torch.uint8)
    assert not bool(wire.unpack_entries_capped(rows, capacity, index, dtype, numel, m)[2])
