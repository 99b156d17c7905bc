"""SparseGrad: validation, dense round trips, sizes."""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import subprocess
import sys
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradsync import SparseGrad, sparsegrad, sparsify
from gradsync.sparsegrad import (
    add_at,
    densify,
    flatnonzero,
    isin_sorted,
    mark_at,
    put_at,
    sparse_sum,
    target_k,
    top_k_mask,
    validate_density,
)
from gradsync.testing import run_distributed


def test_validation_errors():
    v = torch.ones(3)
    with pytest.raises(ValueError, match="strictly increasing"):
        SparseGrad(torch.tensor([2, 1, 3]), v, 10)
    with pytest.raises(ValueError, match="strictly increasing"):
        SparseGrad(torch.tensor([1, 1, 3]), v, 10)
    with pytest.raises(ValueError, match="out of range"):
        SparseGrad(torch.tensor([1, 2, 10]), v, 10)
    with pytest.raises(ValueError, match="out of range"):
        SparseGrad(torch.tensor([-1, 2, 3]), v, 10)
    with pytest.raises(ValueError, match="mismatch"):
        SparseGrad(torch.tensor([1, 2]), v, 10)
    with pytest.raises(ValueError, match="int64"):
        SparseGrad(torch.tensor([1, 2, 3], dtype=torch.int32), v, 10)
    with pytest.raises(ValueError, match="floating"):
        SparseGrad(torch.tensor([1, 2, 3]), torch.ones(3, dtype=torch.int64), 10)
    with pytest.raises(ValueError, match="1-D"):
        SparseGrad(torch.tensor([[1, 2, 3]]), v, 10)
    with pytest.raises(ValueError, match="numel"):
        SparseGrad(torch.tensor([], dtype=torch.int64), torch.ones(0), -1)


def test_empty_and_views():
    e = SparseGrad.empty(5, torch.bfloat16)
    assert len(e) == 0 and e.density == 0.0 and e.wire_bytes() == 0
    assert torch.equal(e.to_dense(), torch.zeros(5, dtype=torch.bfloat16))
    s = SparseGrad(torch.tensor([0, 4]), torch.tensor([1.5, -2.0]), 5)
    assert len(s) == 2 and s.nnz == 2 and s.density == pytest.approx(0.4)
    assert s.wire_bytes() == 2 * (4 + 4) and s.wire_bytes(8) == 2 * 12
    assert s.to(torch.float16).wire_bytes() == 2 * (4 + 2)
    with pytest.raises(ValueError):
        s.wire_bytes(3)
    assert "nnz=2" in repr(s)


def test_dense_prefix_is_validated_kept_and_sent_without_indices():
    v = torch.ones(4)
    s = SparseGrad(torch.tensor([0, 1, 2, 7]), v, 10, dense_prefix=3)
    assert s.dense_prefix == 3
    assert s.wire_bytes() == 4 * (4 + 4)  # the COO size: every index
    assert s.to(torch.bfloat16).dense_prefix == 3
    moved = s.to("cpu")  # a device move keeps the promise and the values
    assert moved.dense_prefix == 3 and torch.equal(moved.values, v)
    assert SparseGrad(torch.tensor([0, 1, 2, 7]), v, 10).dense_prefix == 0
    with pytest.raises(ValueError, match="first 2 indices are not 0"):
        SparseGrad(torch.tensor([0, 2, 3, 7]), v, 10, dense_prefix=2)
    with pytest.raises(ValueError, match="dense_prefix must lie"):
        SparseGrad(torch.tensor([0, 1, 2, 7]), v, 10, dense_prefix=5)
    with pytest.raises(ValueError, match="dense_prefix must lie"):
        SparseGrad(torch.tensor([0, 1, 2, 7]), v, 10, dense_prefix=-1)


def test_from_indices_sorts():
    x = torch.arange(10.0)
    s = SparseGrad.from_indices(x, torch.tensor([7, 2, 5]))
    assert s.indices.tolist() == [2, 5, 7] and s.values.tolist() == [2.0, 5.0, 7.0]


@settings(max_examples=80, deadline=None)
@given(
    n=st.integers(0, 500),
    density=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
)
def test_dense_round_trip(n, density, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g).to(dtype)
    x[torch.rand(n, generator=g) > density] = 0
    s = SparseGrad.from_dense(x)
    assert torch.equal(s.to_dense(), x)
    assert len(s) == int((x != 0).sum())
    SparseGrad(s.indices, s.values, s.numel)  # what from_dense built is valid


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_all_finite_and_check_finite(dtype):
    from gradsync.sparsegrad import all_finite, check_finite

    x = torch.randn(257).to(dtype)
    assert all_finite(x) and all_finite(torch.empty(0, dtype=dtype))
    check_finite(x)
    for bad in (float("nan"), float("inf"), -float("inf")):
        for pos in (0, 128, 256):
            y = x.clone()
            y[pos] = bad
            assert not all_finite(y)
            with pytest.raises(ValueError, match="non-finite"):
                check_finite(y, "g")


def test_all_finite_each_agrees_with_isfinite_per_tensor():
    """One read-back for a list: the same answer per tensor as ``torch.isfinite(x).all()``,
    for finite, NaN, ±Inf, empty, integer and 16-bit tensors in one call."""
    from gradsync.sparsegrad import all_finite, all_finite_each, finite_flag

    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(50, generator=g), torch.randn(7, generator=g),
          torch.randn(9, generator=g).to(torch.bfloat16), torch.empty(0),
          torch.arange(5), torch.randn(4, 4, generator=g).to(torch.float16)]
    xs[1][3] = float("nan")
    xs[2][8] = float("inf")
    xs[5][2, 1] = -float("inf")
    # the largest finite values of each dtype are finite (the check must not overflow), and a
    # NaN in the last entry of a long tensor or -Inf in a float64 one is seen
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        top = torch.finfo(dtype).max
        xs.append(torch.tensor([top, -top, top], dtype=dtype))
    xs.append(torch.randn(100_000, generator=g))
    xs[-1][-1] = float("nan")
    xs.append(torch.tensor([1e300, -float("inf")], dtype=torch.float64))
    want = [bool(torch.isfinite(x).all()) if x.is_floating_point() else True for x in xs]
    assert want == [True, False, False, True, True, False, True, True, True, True, False, False]
    assert all_finite_each(xs) == want
    assert [all_finite(x) for x in xs] == want
    assert all_finite_each([]) == []
    assert [bool(finite_flag(x)) for x in xs] == want  # the device-side flag: the same


def test_finite_flag_stays_on_the_device_and_sees_every_kind_of_non_finite():
    """``finite_flag`` (the ∞-norm below +Inf): a NaN anywhere (NaN payloads and signs
    included), ±Inf, in fp32, bf16 and fp16, never an overflow of the largest finite value."""
    from gradsync.sparsegrad import finite_flag

    nans = torch.tensor([0x7FC00000, 0x7F800001, -0x00400000], dtype=torch.int32).view(
        torch.float32)  # quiet, signalling, negative
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        top = torch.finfo(dtype).max
        base = torch.tensor([top, -top, 0.0, -0.0, 1e-30], dtype=dtype)
        flag = finite_flag(base)
        assert flag.dtype == torch.bool and flag.dim() == 0 and bool(flag)
        for bad in (*nans.tolist(), math.inf, -math.inf):
            for pos in (0, 2, 4):
                y = base.clone()
                y[pos] = torch.tensor(bad, dtype=torch.float32).to(dtype)
                assert not bool(finite_flag(y)), (dtype, bad, pos)


@pytest.mark.usefixtures("kernels")
@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 3000), seed=st.integers(0, 2**16),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]),
       bad=st.lists(st.sampled_from([math.nan, math.inf, -math.inf]), max_size=3),
       scale=st.sampled_from([1.0, 0.5, 1.0 / 3.0]))
def test_finite_flag_is_isfinite_all_when_the_sum_overflows_too(n, seed, dtype, bad, scale):
    """``finite_flag`` against ``torch.isfinite(x).all()``, with either kernel set: entries
    from a fraction of the dtype's largest value up to it (so that most sums overflow: the
    CPU's first pass, a sum, is then not finite while every entry is) and a few NaN/±Inf at
    random positions (+Inf and −Inf together sum to NaN)."""
    from gradsync.sparsegrad import finite_flag

    g = torch.Generator().manual_seed(seed)
    top = torch.finfo(dtype).max
    x = (torch.rand(n, generator=g, dtype=torch.float64) * 2 - 1) * top * scale
    x = x.to(dtype)  # may round a value just below the top up to it; never past it
    for value in bad:
        x[int(torch.randint(n, (1,), generator=g))] = value
    flag = finite_flag(x)
    assert flag.dtype == torch.bool and flag.dim() == 0
    assert bool(flag) == bool(torch.isfinite(x).all())


def test_sort_positions_is_torch_sort_with_either_kernel_set():
    """``sort_positions`` (numpy on the CPU's own kernels) orders distinct int64 positions as
    ``torch.sort`` does, empty and non-contiguous inputs included."""
    from gradsync import sparsegrad
    from gradsync.sparsegrad import sort_positions

    g = torch.Generator().manual_seed(5)
    cases = [torch.randperm(10**6, generator=g)[:4216], torch.empty(0, dtype=torch.int64),
             torch.randperm(50, generator=g)[::3], torch.tensor([2**40, 3, 2**33])]
    for kernels in (sparsegrad.CPU, sparsegrad.CPU_AS_ACCELERATOR):
        with sparsegrad.using(kernels):
            for idx in cases:
                got = sort_positions(idx)
                assert got.dtype == torch.int64
                assert torch.equal(got, torch.sort(idx).values), kernels.name


@pytest.mark.usefixtures("kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_unless_zeroes_exactly_when_the_flag_is_false(dtype):
    """``zero_unless`` (the one non-finite rule's zeroing): a false flag zeroes every entry, a
    true one leaves the tensor bit for bit, with either kernel set (the CPU's reads the flag,
    the accelerators' writes through ``torch.where``)."""
    from gradsync.sparsegrad import finite_flag, zero_unless

    g = torch.Generator().manual_seed(0)
    x = torch.randn(257, generator=g).to(dtype)
    kept = x.clone()
    zero_unless(finite_flag(x), kept)
    assert torch.equal(kept, x)
    y = x.clone()
    y[100] = math.nan
    zero_unless(finite_flag(y), y)
    assert y.dtype == dtype and torch.equal(y, torch.zeros_like(x))
    empty = torch.empty(0, dtype=dtype)
    zero_unless(finite_flag(empty), empty)
    assert empty.numel() == 0


# -- the shared rules: target_k and validate_density -------------------------------------------
@settings(max_examples=200, deadline=None)
@given(n=st.integers(-3, 10**9), d=st.floats(1e-9, 1.0))
def test_target_k_is_round_clamped_to_1_and_n(n, d):
    k = target_k(n, d)
    if n <= 0:
        assert k == 0
        return
    # Independent reference: the float64 product rounded half to even, by exact arithmetic.
    exact = Fraction(d * n)
    lo = exact.numerator // exact.denominator
    frac = exact - lo
    nearest = lo + (frac > Fraction(1, 2) or (frac == Fraction(1, 2) and lo % 2 == 1))
    assert k == min(n, max(1, nearest))
    assert 1 <= k <= n


def test_target_k_rounds_where_ceil_would_not():
    assert target_k(100, 0.07) == 7  # 0.07·100 = 7.000000000000001 in float64; ceil gives 8
    assert target_k(10, 0.12) == 1 and target_k(10, 0.15) == 2 and target_k(10, 0.25) == 2
    assert target_k(3, 0.01) == 1 and target_k(5, 1.0) == 5 and target_k(0, 0.5) == 0


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.01, float("nan"), float("inf"), "x", None, [0.1]])
def test_validate_density_rejects_and_names_what(bad):
    with pytest.raises(ValueError, match="min_density must"):
        validate_density(bad, "min_density")


def test_validate_density_accepts_and_is_reexported():
    assert validate_density(1) == 1.0 and validate_density("0.25") == 0.25
    assert sparsify.validate_density is validate_density and sparsify.target_k is target_k


# -- the shared operations on selections: sparse_sum, isin_sorted, top_k_mask ---------------
def _random_parts(n: int, sizes: list[int], seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    parts = []
    for m in sizes:
        idx = torch.sort(torch.randperm(n, generator=g)[:m]).values
        parts.append((idx, torch.randn(m, generator=g).to(dtype)))
    return parts


@pytest.mark.parametrize("n,sizes", [
    (50, [10, 20, 5]),            # span small against the entries: the dense scatter
    (10**7, [30, 40, 7, 0, 12]),  # span far larger than the entries: the sort
    (1000, [0, 0]),               # nothing at all
    (1000, [0, 17]),              # one part holds everything
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_sparse_sum_is_the_left_fold_of_the_parts(n, sizes, dtype):
    """Reference: a dict of per-index running sums, added part by part in list order in the
    output dtype (independent of the helper's scatter/sort paths), bit for bit."""
    parts = _random_parts(n, sizes, seed=len(sizes) + n, dtype=dtype)
    ref: dict[int, torch.Tensor] = {}
    for idx, val in parts:
        for i, v in zip(idx.tolist(), val):
            ref[i] = ref.get(i, torch.zeros((), dtype=dtype)) + v
    got_i, got_v = sparse_sum(parts)
    assert got_i.dtype == torch.int64 and got_v.dtype == dtype
    assert got_i.tolist() == sorted(ref)
    want = torch.stack([ref[i] for i in sorted(ref)]) if ref else torch.empty(0, dtype=dtype)
    assert torch.equal(got_v.view(-1), want.view(-1))
    # a wider accumulator: the parts' values are converted, not rounded first
    wide_i, wide_v = sparse_sum(parts, torch.float64)
    assert torch.equal(wide_i, got_i) and wide_v.dtype == torch.float64


def _left_fold(parts, dtype):
    ref: dict[int, torch.Tensor] = {}
    for idx, val in parts:
        for i, v in zip(idx.tolist(), val):
            ref[i] = ref.get(i, torch.zeros((), dtype=dtype)) + v.to(dtype)
    return ref


@settings(max_examples=60, deadline=None)
@given(st.data(), st.integers(2, 9), st.sampled_from([torch.float32, torch.bfloat16]),
       st.booleans())
def test_sparse_sum_both_paths_are_the_left_fold(data, n_parts, dtype, wide):
    """Parts drawn from one small pool of indices (so many parts share an index, up to all of
    them) laid out either densely (the scatter path) or spread over a span far above the
    entries (the merge path, with an index held by 2 … n_parts parts), against the dict fold,
    bit for bit; values include ±0.0."""
    pool_size = data.draw(st.integers(1, 40))
    spread = data.draw(st.booleans())
    step = 10_000 if spread else 1
    pool = [step * i + data.draw(st.integers(0, step - 1)) for i in range(pool_size)]
    parts = []
    for _ in range(n_parts):
        chosen = sorted(data.draw(st.sets(st.sampled_from(pool), max_size=pool_size)))
        vals = data.draw(st.lists(st.sampled_from([0.0, -0.0, 1.5, -2.25, 1e8, -1e8, 3e-3]),
                                  min_size=len(chosen), max_size=len(chosen)))
        parts.append((torch.tensor(chosen, dtype=torch.int64),
                      torch.tensor(vals, dtype=torch.float32).to(dtype)))
    out_dtype = torch.float64 if wide else dtype
    # the caller may name a range that holds every index (a region it owns): the same bits
    margin = data.draw(st.integers(0, 3 * step))
    within = (max(0, pool[0] - margin), pool[-1] + 1 + margin)
    ref = _left_fold(parts, out_dtype)
    want = torch.stack([ref[i] for i in sorted(ref)]) if ref else torch.empty(0, dtype=out_dtype)
    bits = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16}
    for kw in ({}, {"within": within}):
        got_i, got_v = sparse_sum(parts, out_dtype, **kw)
        assert got_i.tolist() == sorted(ref)
        assert torch.equal(got_v.view(bits[out_dtype]), want.view(bits[out_dtype]))  # -0.0 too


def test_sparse_sum_adds_every_value_of_a_part_that_repeats_an_index():
    """Parts must hold distinct indices, and a malformed message (an index moved into range by
    :func:`indices_flag`, its value zeroed) can break that; its caller then raises. Until it
    does, the merge still adds every value, in order, though an index is held more times than
    there are parts (its level counts one read deeper)."""
    at = [5, 70_000, 900_000]
    parts = [(torch.tensor(at), torch.tensor([1.0, 2.0, 4.0])),
             (torch.tensor([5, 5, 5, 5, 900_000]), torch.tensor([8.0, 16.0, 32.0, 64.0, 128.0])),
             (torch.tensor([70_000]), torch.tensor([256.0]))]
    for kw in ({}, {"within": (0, 1_000_000)}):
        got_i, got_v = sparse_sum(parts, **kw)
        assert got_i.tolist() == at
        assert got_v.tolist() == [1.0 + 8 + 16 + 32 + 64, 2.0 + 256, 4.0 + 128]


def test_sparse_sum_merge_path_runs_where_the_span_is_wide():
    """The merge path (span > SUM_SPAN_FACTOR × entries) and the scatter agree bit for bit on
    the same overlapping parts shifted apart, and the merge never allocates the span."""
    import gradsync.sparsegrad as sg

    g = torch.Generator().manual_seed(3)
    near = [(torch.sort(torch.randperm(300, generator=g)[:m]).values,
             torch.randn(m, generator=g)) for m in (120, 200, 90, 250)]
    far = [(i * 1000, v) for i, v in near]  # the same overlaps, span 1000× wider
    m = sum(i.numel() for i, _ in near)
    assert 299 < sg.SUM_SPAN_FACTOR * m < 299_000
    ni, nv = sparse_sum(near)
    fi, fv = sparse_sum(far)
    assert torch.equal(fi, ni * 1000) and torch.equal(fv, nv)
    calls = []
    orig = torch.zeros
    try:
        sg.torch.zeros = lambda *a, **k: calls.append(a) or orig(*a, **k)
        sparse_sum(far)
    finally:
        sg.torch.zeros = orig
    assert all(a[0] <= m for a in calls)  # nothing of the span's size


def test_sparse_sum_order_is_the_order_of_the_parts():
    """Three values whose fp32 sum depends on the order: the helper follows the list."""
    i = torch.tensor([3])
    a, b, c = (torch.tensor([x], dtype=torch.float32) for x in (1e8, -1e8, 1.0))
    assert float(sparse_sum([(i, a), (i, b), (i, c)])[1]) == 1.0  # (1e8 − 1e8) + 1
    assert float(sparse_sum([(i, a), (i, c), (i, b)])[1]) == 0.0  # (1e8 + 1) − 1e8
    with pytest.raises(ValueError, match="no parts"):
        sparse_sum([])


@pytest.mark.usefixtures("kernels")
def test_isin_sorted_matches_torch_isin():
    g = torch.Generator().manual_seed(1)
    ref = torch.unique(torch.randint(0, 500, (200,), generator=g))
    x = torch.randint(-5, 510, (1000,), generator=g)
    assert torch.equal(isin_sorted(x, ref), torch.isin(x, ref))
    assert not isin_sorted(x, ref[:0]).any() and isin_sorted(x[:0], ref).numel() == 0
    far = torch.unique(torch.randint(0, 10**9, (50,), generator=g))  # the binary-search path
    y = torch.cat([far[::3], torch.randint(-10, 10**9 + 10, (100,), generator=g), far[-1:] + 1])
    assert torch.equal(isin_sorted(y, far), torch.isin(y, far))


@pytest.mark.usefixtures("kernels")
@pytest.mark.accelerator_at(k=7)
@pytest.mark.parametrize("k", [0, 1, 7, 50, 99, 100, 150])
def test_top_k_mask_is_the_stable_sort_with_ties_to_the_smaller_position(k):
    g = torch.Generator().manual_seed(k)
    v = torch.randint(-6, 7, (100,), generator=g).float()  # many ties, signs mixed
    order = sorted(range(100), key=lambda p: (-abs(float(v[p])), p))  # independent reference
    want = torch.zeros(100, dtype=torch.bool)
    want[order[:k]] = True
    assert torch.equal(top_k_mask(v, k), want)
    assert torch.equal(top_k_mask(v.to(torch.bfloat16), k), want)
    u = torch.randn(1000, generator=g)  # continuous: no ties (the one-pass path)
    assert torch.equal(flatnonzero(top_k_mask(u, k)), u.abs().topk(k).indices.sort().values)
    w = v.clone()
    w[[5, 60]] = float("nan")  # NaN ranks above every number, like the descending sort
    order = sorted(range(100), key=lambda p: (0 if p in (5, 60) else 1, -abs(float(w[p])), p))
    want = torch.zeros(100, dtype=torch.bool)
    want[order[:k]] = True
    assert torch.equal(top_k_mask(w, k), want)


@pytest.mark.usefixtures("kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_densify_writes_disjoint_parts_bit_for_bit(dtype):
    nan = torch.tensor([float("nan")], dtype=dtype)
    parts = [(torch.tensor([0, 3]), torch.tensor([1.5, -0.0], dtype=dtype)),
             (torch.tensor([], dtype=torch.int64), torch.tensor([], dtype=dtype)),
             (torch.tensor([5]), nan)]
    out = densify(parts, 7, dtype, "cpu")
    expect = torch.zeros(7, dtype=dtype)
    expect[0], expect[3], expect[5] = 1.5, -0.0, nan[0]
    width = {2: torch.int16, 4: torch.int32, 8: torch.int64}[expect.element_size()]
    assert torch.equal(out.view(width), expect.view(width))  # −0.0 and the NaN bits kept


_INT = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


@pytest.mark.usefixtures("kernels")
@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 300), seed=st.integers(0, 2**31 - 1),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_scatters_of_distinct_indices_match_a_python_loop_bit_for_bit(n, seed, dtype):
    """put_at / add_at / mark_at against element-by-element Python, on values that include
    ±0.0, NaN payloads and ±Inf (moved and added as IEEE says, once per target)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, generator=g).to(dtype)
    m = int(torch.randint(0, n + 1, (1,), generator=g)) if n else 0
    idx = torch.randperm(n, generator=g)[:m]  # distinct, in any order
    src = torch.randn(m, generator=g).to(dtype)
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan")]).to(dtype)
    if m:
        src[: min(m, 5)] = specials[: min(m, 5)]
        src.view(_INT[dtype])[min(m, 5) - 1] |= 1  # a NaN (or odd-bit) payload
    put_ref, add_ref = base.clone(), base.clone()
    mask = torch.rand(n, generator=g) < 0.3
    mask_ref = mask.clone()
    for i, v in zip(idx.tolist(), src, strict=True):  # v: a 0-d tensor, payload kept
        put_ref.view(_INT[dtype])[i] = v.view(_INT[dtype])
        add_ref[i] = (add_ref[i].float() + v.float()).to(dtype)  # one rounding
        mask_ref[i] = True
    out = base.clone()
    put_at(out.view(_INT[dtype]), idx, src.view(_INT[dtype]))
    assert torch.equal(out.view(_INT[dtype]), put_ref.view(_INT[dtype]))
    out = base.clone()
    assert add_at(out, idx, src) is out
    same = (out.view(_INT[dtype]) == add_ref.view(_INT[dtype])) | (out.isnan() & add_ref.isnan())
    assert bool(same.all())
    assert torch.equal(mark_at(mask, idx), mask_ref)


@pytest.mark.usefixtures("kernels")
@settings(max_examples=50, deadline=None)
@given(values=st.lists(st.integers(0, 40), max_size=300), extra=st.integers(0, 5))
def test_bincount_without_a_wait_equals_torch_bincount(values, extra):
    """sparsegrad.bincount (a scatter-add into a known size: no read of the input's range on
    CUDA) counts what torch.bincount counts, empty inputs included."""
    from gradsync.sparsegrad import bincount

    idx = torch.tensor(values, dtype=torch.int64)
    nbins = 41 + extra
    got = bincount(idx, nbins)
    assert got.dtype == torch.int64 and got.shape == (nbins,)
    assert torch.equal(got, torch.bincount(idx, minlength=nbins))


@settings(max_examples=80, deadline=None)
@given(values=st.lists(st.integers(-5, 60), max_size=40), lo=st.integers(0, 10),
       width=st.integers(0, 50))
def test_indices_flag_is_check_indices_on_the_device(values, lo, width):
    """indices_flag's ``ok`` is what check_indices accepts (strictly increasing, in [lo, hi):
    a Python reference here), ``inside`` marks the entries in range, and ``safe`` keeps those
    and moves the others to ``lo``."""
    from gradsync.sparsegrad import indices_flag

    hi = lo + width
    idx = torch.tensor(values, dtype=torch.int64)
    safe, inside, ok = indices_flag(idx, hi, lo)
    ref_inside = [lo <= v < hi for v in values]
    ref_ok = all(ref_inside) and all(a < b for a, b in itertools.pairwise(values))
    assert bool(ok) is ref_ok
    assert inside.tolist() == ref_inside
    assert safe.tolist() == [v if i else lo for v, i in zip(values, ref_inside)]


def test_largest_is_the_largest_magnitude_or_nan_and_iota_a_shared_arange():
    """``largest``: the ∞-norm (NaN when a NaN is present, 0 for an empty or integer tensor),
    one reduction whose results compare with +Inf at once; ``iota``: ``arange(n)`` as views of
    one vector that grows when a longer one is asked for."""
    from gradsync.sparsegrad import iota, largest

    xs = [torch.tensor([1.0, -3.0, 2.0]), torch.tensor([1.0, math.nan]),
          torch.tensor([-math.inf, 0.0], dtype=torch.bfloat16), torch.zeros(0),
          torch.tensor([5, -9])]
    tops = [largest(x) for x in xs]
    assert tops[0].item() == 3.0 and math.isnan(tops[1].item())
    assert tops[2].item() == math.inf and tops[3].item() == 0.0 and tops[4].item() == 0.0
    assert (torch.stack(tops) < math.inf).tolist() == [True, False, False, True, True]
    for n in (0, 5, 3, 17, 1000, 2):
        got = iota(n, torch.device("cpu"))
        assert torch.equal(got, torch.arange(n)) and got.dtype == torch.int64
    assert iota(3, torch.device("cpu")).data_ptr() == iota(900, torch.device("cpu")).data_ptr()


def test_flatnonzero_takes_either_kernel_and_the_stand_in_checks_the_count():
    """The CPU's kernel (numpy) and the accelerators' (``nonzero``, ``nonzero_static`` at a
    known count) give the same positions; a wrong count, which ``nonzero_static`` would pad
    with −1 or cut short on an accelerator without a word, raises where the CPU stands in."""
    g = torch.Generator().manual_seed(0)
    mask = torch.rand(1000, generator=g) < 0.3
    want = [i for i, m in enumerate(mask.tolist()) if m]  # independent reference
    for kernels in (sparsegrad.CPU, sparsegrad.CPU_AS_ACCELERATOR, sparsegrad.ACCELERATOR):
        with sparsegrad.using(kernels):
            assert flatnonzero(mask).tolist() == want
            assert flatnonzero(mask, len(want)).tolist() == want
            assert flatnonzero(mask[:0], 0).numel() == 0
    with sparsegrad.using(sparsegrad.CPU_AS_ACCELERATOR):
        for wrong in (len(want) - 1, len(want) + 1, 0):
            with pytest.raises(RuntimeError, match=f"told {wrong} positions, the mask holds "
                                                   f"{len(want)}"):
                flatnonzero(mask, wrong)
    # without the check (``bench syncs``, which counts a GPU's reads), a GPU's silence: padded
    # with −1, or cut short
    with sparsegrad.using(sparsegrad.ACCELERATOR):
        assert flatnonzero(mask, len(want) + 1).tolist() == [*want, -1]
        assert flatnonzero(mask, len(want) - 1).tolist() == want[:-1]


@pytest.mark.parametrize("value", ["1", "0"])
def test_the_environment_makes_the_cpu_stand_in_for_an_accelerator(value):
    """``GRADSYNC_CPU_AS_ACCELERATOR=1`` at import: the accelerators' kernels, with the count
    checks, and path of selection on the CPU; anything else: the
    CPU's own."""
    code = ("import torch; from gradsync import sparsegrad; from gradsync.sparsify import "
            "segments; k = sparsegrad.kernels_for(torch.device('cpu')); print(not k.host, "
            "k.check_counts, k.segmented, segments.pays_on(torch.device('cpu')), "
            "sparsegrad.host_kernels(torch.zeros(1)))")
    env = {**os.environ, sparsegrad.CPU_AS_ACCELERATOR_ENV: value}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True, timeout=120)
    on = value == "1"
    assert out.stdout.split() == [str(on), str(on), str(on), str(on), str(not on)]


def _kernels_rank(rank, world_size):
    k = sparsegrad.kernels_for(torch.device("cpu"))
    return not k.host, k.segmented


@pytest.mark.parametrize("world_size", [1, 2])
def test_every_rank_takes_the_kernels_its_environment_names(world_size):
    """The ranks ``run_distributed`` starts (from a forkserver that imported gradsync) stand
    in for an accelerator exactly when the test run does."""
    on = os.environ.get(sparsegrad.CPU_AS_ACCELERATOR_ENV, "") == "1"
    assert run_distributed(_kernels_rank, world_size, timeout=120) == [(on, on)] * world_size


def test_kernels_follow_the_device_and_a_choice_lasts_its_block_and_the_threads_started_in_it():
    """An accelerator's tensors always take the accelerators' kernels; the CPU's take the
    CPU's unless a block chose others (``using``), and only inside it. The engine's threads
    (its communication and sparsification workers) take the kernels of the code that made
    them, whichever thread later asks."""
    from gradsync.engine.executor import Executor

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    default = sparsegrad.cpu_kernels()
    assert sparsegrad.kernels_for(cuda) == sparsegrad.ACCELERATOR
    with sparsegrad.using(sparsegrad.CPU_AS_ACCELERATOR if default == sparsegrad.CPU
                          else sparsegrad.CPU) as chosen:
        assert chosen != default and sparsegrad.kernels_for(cpu) == chosen
        assert sparsegrad.kernels_for(cuda) == sparsegrad.ACCELERATOR
        assert sparsegrad.host_kernels(torch.zeros(1)) == chosen.host
        made_here = Executor(None, lambda key: None, False)
    made_outside = Executor(None, lambda key: None, False)
    try:
        assert sparsegrad.kernels_for(cpu) == default  # the block's choice ended with it
        for ex, want in ((made_here, chosen), (made_outside, default)):
            for pool in (ex._comm, ex._worker):
                assert pool.submit(sparsegrad.cpu_kernels).result() == want
    finally:
        made_here.close()
        made_outside.close()
    with pytest.raises(dataclasses.FrozenInstanceError):
        sparsegrad.CPU.host = False  # a choice is an object, not a switch


@settings(max_examples=60, deadline=None)
@given(values=st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), min_size=1,
                       max_size=300),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16]))
def test_largest_is_the_largest_magnitude_on_both_kernels(values, dtype):
    """``largest``: the CPU's own kernels (``aminmax``) and the accelerators'
    (``vector_norm(x, inf)``) give the same value, against a plain-Python reference: NaN when
    the tensor holds one, else the largest |x| (+Inf for ±Inf); ``finite_flag`` follows."""
    x = torch.tensor(values, dtype=torch.float64).to(dtype)
    ref = [abs(v) for v in x.tolist()]
    want = math.nan if any(v != v for v in ref) else max(ref)
    for kernels in (sparsegrad.CPU, sparsegrad.CPU_AS_ACCELERATOR):
        with sparsegrad.using(kernels):
            got = sparsegrad.largest(x)
            flag = bool(sparsegrad.finite_flag(x))
        assert got.dtype == dtype and got.shape == ()
        assert (math.isnan(got.item()) if want != want else got.item() == want), (kernels, got)
        assert flag == math.isfinite(want)


@settings(max_examples=60, deadline=None)
@given(values=st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), min_size=0,
                       max_size=300),
       thr=st.floats(allow_nan=False, allow_infinity=False),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16]),
       strict=st.booleans(), as_tensor=st.booleans())
def test_positions_above_are_torchs_comparison_on_both_kernels(values, thr, dtype, strict,
                                                               as_tensor):
    """``positions_above``: numpy's comparison on the CPU's own kernels, torch's elsewhere;
    both the positions of torch's own ``a >= thr`` (``a > thr``), the threshold rounded to the
    tensor's dtype (a Python float or a 0-dim float64 tensor, as DGC keeps it)."""
    a = torch.tensor(values, dtype=torch.float64).to(dtype)
    t = torch.tensor(thr, dtype=torch.float64) if as_tensor else thr
    want = torch.nonzero(a > t if strict else a >= t).view(-1)
    for kernels in (sparsegrad.CPU, sparsegrad.CPU_AS_ACCELERATOR):
        with sparsegrad.using(kernels):
            got = sparsegrad.positions_above(a, t, strict=strict)
        assert got.dtype == torch.int64 and torch.equal(got, want), (kernels.name, got, want)
