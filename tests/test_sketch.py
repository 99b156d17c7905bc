"""Count sketch, peeling, bit index (formats/sketch.py) and TAGC's θ sparsifier (fraction)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gradsync.sparsify.fraction  # noqa: F401  (registers "fraction")
from gradsync import sparsify
from gradsync.formats.sketch import (
    MAX_ROUNDS,
    CountSketch,
    PeelError,
    index_wire_bytes,
    pack_index,
    unpack_counts,
    unpack_index,
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Small vectorised ops: one intra-op thread is faster, and fair on a shared 2-core box."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def sparse_input(n: int, density: float, seed: int, dtype=torch.float32, integer=False):
    """A random mask of the given density and values on it (integers: exact float sums)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(n, generator=g) < density
    if integer:
        vals = torch.randint(1, 50, (n,), generator=g).float() * (
            torch.randint(0, 2, (n,), generator=g).float() * 2 - 1)
    else:
        vals = torch.randn(n, generator=g)
    return (vals * mask).to(dtype), mask


# -- sketch layout -------------------------------------------------------------------------
@pytest.mark.parametrize("ratio", [2, 4, 10])
def test_length_and_three_distinct_rows(ratio):
    n = 300_000 + 17  # not a multiple of 1024: the tail block is padded
    cs = CountSketch(n, ratio, seed=3)
    B = math.ceil(n / 1024)
    assert cs.blocks == B
    assert cs.length == math.ceil(n / 1024 / ratio) * 1024
    rows = cs.hashes
    assert rows.shape == (B, 3)
    assert bool((rows[:, 0] != rows[:, 1]).all() and (rows[:, 0] != rows[:, 2]).all()
                and (rows[:, 1] != rows[:, 2]).all())
    assert int(rows.min()) >= 0 and int(rows.max()) < cs.rows
    assert set(cs.signs.unique().tolist()) == {-1.0, 1.0}
    # Same seed -> same hashes (every rank builds the same sketch); other seed -> other hashes.
    assert torch.equal(CountSketch(n, ratio, seed=3).hashes, rows)
    assert not torch.equal(CountSketch(n, ratio, seed=4).hashes, rows)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 6000), ratio=st.sampled_from([1, 2, 4, 10]),
       lanes=st.sampled_from([8, 64, 1024]), seed=st.integers(0, 2**31), shift=st.booleans())
def test_homomorphism_exact_on_integers(n, ratio, lanes, seed, shift):
    cs = CountSketch(n, ratio, seed=seed, lanes=lanes, shift=shift)
    a, _ = sparse_input(n, 0.3, seed, integer=True)
    b, _ = sparse_input(n, 0.3, seed + 1, integer=True)
    # Integer-valued floats: every sum is exact, so linearity must hold bitwise.
    assert torch.equal(cs.encode(a + b), cs.encode(a) + cs.encode(b))
    assert cs.encode(a).shape == (cs.length,)


def test_homomorphism_float_and_low_precision():
    n = 50_000
    cs = CountSketch(n, 4, seed=1)
    a, _ = sparse_input(n, 0.5, 1)
    b, _ = sparse_input(n, 0.5, 2)
    torch.testing.assert_close(cs.encode(a + b), cs.encode(a) + cs.encode(b),
                               rtol=1e-5, atol=1e-5)
    for dt in (torch.bfloat16, torch.float16):
        s = cs.encode(a.to(dt))
        assert s.dtype == torch.float32  # fp32 accumulation whatever the input
        assert torch.equal(s, cs.encode(a.to(dt).float()))


def test_sketch_sums_to_independent_reference():
    """Each cell equals the signed sum of the elements hashed into it (computed by loops)."""
    n, L = 700, 16
    cs = CountSketch(n, 4, seed=5, lanes=L)
    x, _ = sparse_input(n, 0.4, 9, integer=True)
    ref = [0.0] * cs.length
    for i in range(n):
        b, lane = divmod(i, L)
        for j in range(3):
            r = int(cs.hashes[b, j])
            c = r * L + (lane + int(cs.offsets[b, j])) % L
            ref[c] += float(cs.signs[b, j]) * float(x[i])
    assert cs.encode(x).tolist() == ref


@pytest.mark.usefixtures("kernels")
@pytest.mark.parametrize("shift", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_encode_entries_is_encode_of_the_dense_tensor_bit_for_bit(shift, dtype):
    """The O(nnz) encoder (LHC's) against the reference sum above, then bitwise against
    ``encode`` of the dense tensor; bad positions raise."""
    n = 5000
    x, mask = sparse_input(n, 0.3, seed=4, dtype=dtype)
    cs = CountSketch(n, 4, seed=9, lanes=64, shift=shift)
    pos = torch.nonzero(mask).view(-1)
    got = cs.encode_entries(pos, x[pos])
    ref = torch.zeros(cs.length, dtype=torch.float64)
    for i in pos.tolist():
        b, lane = divmod(i, cs.lanes)
        for j in range(3):
            c = int(cs.hashes[b, j]) * cs.lanes + (lane + int(cs.offsets[b, j])) % cs.lanes
            ref[c] += float(cs.signs[b, j]) * float(x[i])
    assert torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-4)
    assert torch.equal(got.view(torch.int32), cs.encode(x).view(torch.int32))
    with pytest.raises(ValueError, match="strictly increasing"):
        cs.encode_entries(pos.flip(0), x[pos])
    with pytest.raises(ValueError, match="out of range"):
        cs.encode_entries(pos + n, x[pos])
    with pytest.raises(ValueError, match="non-finite"):
        cs.encode_entries(pos, torch.full((pos.numel(),), float("nan")))


# -- peeling -------------------------------------------------------------------------------
@pytest.mark.parametrize("ratio,zeros", [(2, 0.80), (4, 0.90), (10, 0.9875)])
def test_peeling_round_trip_at_table1_sparsities(ratio, zeros):
    """TAGC Table 1 operating points: lossless in ≥ 95% of 24 seeds (measured: all of them)."""
    n = 1 << 16
    ok = 0
    trials = 24
    for seed in range(trials):
        x, mask = sparse_input(n, 1 - zeros, seed, integer=True)
        cs = CountSketch(n, ratio, seed=1000 + seed)
        vals, rep = cs.peel(cs.encode(x), mask)
        if not rep.lossy:
            assert rep.unresolved == 0 and rep.estimated == 0 and rep.rounds >= 1
            assert torch.equal(vals, x)  # integer values: peeling is bitwise exact
            ok += 1
    assert ok / trials >= 0.95, f"{ratio}x at {zeros:.2%} zeros: {ok}/{trials} lossless"


@pytest.mark.parametrize("ratio,limit", [(2, 0.40), (4, 0.20), (10, 0.08)])
def test_peeling_success_vs_union_density(ratio, limit):
    """Succeeds well below the ≈0.82/ratio threshold, fails well above it."""
    n = 1 << 16
    below = above = 0
    trials = 8
    for seed in range(trials):
        cs = CountSketch(n, ratio, seed=seed)
        x, mask = sparse_input(n, 0.6 * limit, seed)
        below += not cs.peel(cs.encode(x), mask)[1].lossy
        x, mask = sparse_input(n, 1.5 * limit, seed)
        above += not cs.peel(cs.encode(x), mask)[1].lossy
    assert below == trials
    assert above == 0


def test_peel_float_values_close_and_tail_recovered():
    n = 5 * 1024 * 10 + 3  # tail block of 3 elements
    x, mask = sparse_input(n, 0.03, 7)
    x[-1], mask[-1] = 2.5, True  # a nonzero in the padded tail block (TAGC's code drops it)
    cs = CountSketch(n, 10, seed=2)
    vals, rep = cs.peel(cs.encode(x), mask, on_failure="raise")
    assert not rep.lossy
    torch.testing.assert_close(vals, x, rtol=0, atol=1e-5)
    assert float(vals[-1]) == 2.5
    assert bool((vals[~mask] == 0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_peel_dtypes(dtype):
    n = 40_000
    x, mask = sparse_input(n, 0.05, 11, dtype=dtype)
    cs = CountSketch(n, 4, seed=0)
    vals, rep = cs.peel(cs.encode(x), mask, dtype=dtype)
    assert vals.dtype == dtype and not rep.lossy
    # Values recovered in fp32 then cast: equal to the input up to fp32 rounding of peeling.
    torch.testing.assert_close(vals.float(), x.float(), rtol=1e-2, atol=1e-3)


def test_peel_failure_reports_or_raises():
    n = 1 << 15
    x, mask = sparse_input(n, 0.5, 3)  # far above 8% at 10x
    cs = CountSketch(n, 10, seed=0)
    vals, rep = cs.peel(cs.encode(x), mask)
    assert rep.lossy and rep.unresolved > 0 and rep.estimated == rep.unresolved
    assert not bool(torch.equal(vals, x))
    assert bool((vals[~mask] == 0).all())  # estimates only where the index says nonzero
    with pytest.raises(PeelError) as ei:
        cs.peel(cs.encode(x), mask, on_failure="raise")
    assert ei.value.report.unresolved == rep.unresolved


@pytest.mark.parametrize("n", [0, 1, 1023, 1024, 2048, 3000, 3 * 1024 + 1, 5000])
@pytest.mark.parametrize("ratio", [2, 10])
def test_tiny_tensors(n, ratio):
    cs = CountSketch(n, ratio, seed=1)
    x, mask = sparse_input(n, 0.2, n)
    vals, rep = cs.peel(cs.encode(x), mask)
    if cs.direct:  # at most 3 blocks: identity layout, always exact
        assert cs.length == cs.blocks * 1024 and not rep.lossy
        assert torch.equal(vals, x)
    else:
        assert cs.rows >= 3
    if not rep.lossy:
        torch.testing.assert_close(vals, x, rtol=0, atol=1e-5)


def test_lane_rotation_helps_at_10x():
    """LHC's unrotated layout fails at Table 1's 10x point far more often (module doc)."""
    n = 1 << 18
    fails = {True: 0, False: 0}
    for seed in range(10):
        x, mask = sparse_input(n, 0.0125, seed)
        for shift in (True, False):
            cs = CountSketch(n, 10, seed=seed, shift=shift)
            fails[shift] += cs.peel(cs.encode(x), mask)[1].lossy
    assert fails[True] == 0
    assert fails[False] >= 1


# -- bad input -----------------------------------------------------------------------------
def test_constructor_and_peel_validation():
    for bad in [dict(n=-1, ratio=2), dict(n=10, ratio=0), dict(n=10, ratio=2.5),
                dict(n=10, ratio=2, lanes=0), dict(n=True, ratio=2)]:
        with pytest.raises(ValueError):
            CountSketch(**bad)
    cs = CountSketch(5000, 2)
    x, mask = sparse_input(5000, 0.1, 0)
    s = cs.encode(x)
    with pytest.raises(ValueError):
        cs.encode(x[:-1])
    with pytest.raises(ValueError):
        cs.encode(x.long())
    with pytest.raises(ValueError):
        cs.encode(torch.full((5000,), float("nan")))
    for bad_s, bad_m in [(s[:-1], mask), (s, mask[:-1]), (s.long(), mask), (s, mask.float()),
                         (s.view(2, -1), mask), (torch.full_like(s, float("inf")), mask)]:
        with pytest.raises(ValueError):
            cs.peel(bad_s, bad_m)
    with pytest.raises(ValueError):
        cs.peel(s, mask, on_failure="ignore")


@FUZZ
@given(data=st.data())
def test_peel_fuzz_never_crashes(data):
    n = data.draw(st.integers(0, 3000))
    cs = CountSketch(n, data.draw(st.sampled_from([2, 4, 10])), lanes=64)
    length = data.draw(st.sampled_from([cs.length, cs.length + 1, max(0, cs.length - 1)]))
    mlen = data.draw(st.sampled_from([n, n + 1, max(0, n - 1)]))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 1000)))
    sk = torch.randn(length, generator=g) * 1e3
    mask = torch.rand(mlen, generator=g) < data.draw(st.floats(0, 1))
    if length != cs.length or mlen != n:
        with pytest.raises(ValueError):
            cs.peel(sk, mask)
    else:  # arbitrary (inconsistent) sketch: must terminate with finite values and a report
        vals, rep = cs.peel(sk, mask)
        assert vals.shape == (n,) and bool(torch.isfinite(vals).all())
        assert rep.rounds <= int(mask.sum())


# -- a hostile mask: peeling's work stays bounded ------------------------------------------------
def chain_mask(cs: CountSketch, length: int) -> tuple[torch.Tensor, list[int], int]:
    """A mask crafted against ``cs``'s own hashes on which peeling frees one element per round
    from each end of a chain (LHC's previous peel rescanned every unresolved element in each of
    those rounds: O(E²)).

    A *core* of whole blocks whose three rows all lie in a row set H, pruned until every row of H
    is held by at least 2 core blocks: each cell of an H row then counts ≥ 2 core elements
    forever, so no core element is ever pure (a stopping set). A *chain* e_1 … e_m of elements
    outside the core, e_t = {c_{t−1}, c_t, h_t}: c_t is a fresh cell of a row outside H held by
    e_t and e_{t+1} only, h_t a core cell. Only the ends are pure; resolving e_t frees
    e_{t+1}. Returns (mask, chain positions, core elements)."""
    L, R, B = cs.lanes, cs.rows, cs.blocks
    rows, offs = cs.hashes.tolist(), cs.offsets.tolist()
    H = set(range(int(0.58 * R)))
    core = [b for b in range(B) if set(rows[b]) <= H and (b + 1) * L <= cs.n]
    while True:  # prune: every row of the core held by ≥ 2 core blocks
        deg = {r: 0 for r in H}
        for b in core:
            for r in rows[b]:
                deg[r] += 1
        H = {r for r, d in deg.items() if d >= 2}
        kept = [b for b in core if set(rows[b]) <= H]
        if len(kept) == len(core):
            break
        core = kept
    by_row: dict[int, list[tuple[int, int]]] = {}
    for b in range(B):
        if b not in core:
            for j, r in enumerate(rows[b]):
                by_row.setdefault(r, []).append((b, j))
    start = next(r for r in range(R) if r not in H)
    cell, used, chain = (start, 0), {(start, 0)}, []
    while len(chain) < length:
        r, lane = cell
        step = None
        for b, j in by_row[r]:
            lo = (lane - offs[b][j]) % L
            if b * L + lo >= cs.n:
                continue
            other = [(rows[b][i], (lo + offs[b][i]) % L) for i in range(3) if i != j]
            for new, h in (other, other[::-1]):
                if new[0] not in H and new not in used and h[0] in H:
                    step = (b * L + lo, new)
                    break
            if step:
                break
        if step is None:
            break
        chain.append(step[0])
        used.add(step[1])
        cell = step[1]
    mask = torch.zeros(cs.n, dtype=torch.bool)
    for b in core:
        mask[b * L:(b + 1) * L] = True
    mask[chain] = True
    return mask, chain, len(core) * L


def test_peel_work_is_bounded_on_a_crafted_chain():
    """The hostile input takes about m/2 rounds (one element from each end of the chain per
    round): peeling still resolves every chain element exactly while visiting at most 2·k·E
    element-cell pairs in all, and the default round cap stops it and reports the rest lossy."""
    cs = CountSketch(1 << 20, 10, seed=3)
    mask, chain, n_core = chain_mask(cs, 3000)
    m, E = len(chain), int(mask.sum())
    assert m == 3000 and n_core + m == E
    x = torch.zeros(cs.n)
    x[mask] = torch.randint(1, 100, (E,), generator=torch.Generator().manual_seed(0)).float()
    sketch = cs.encode(x)
    vals, rep = cs.peel(sketch, mask, max_rounds=10**6)
    assert rep.rounds >= m // 2  # crafted: the chain frees ~2 elements per round
    assert torch.equal(vals[chain], x[chain])  # integers: every chain element exact
    assert rep.unresolved == n_core and rep.lossy and not rep.capped  # the core is stuck
    assert rep.visits <= 2 * 3 * E  # linear work (the old peel: ≈ rounds × 3E)
    vals, rep = cs.peel(sketch, mask)  # the default cap
    assert rep.capped and rep.rounds == MAX_ROUNDS and rep.lossy
    assert rep.unresolved == n_core + m - 2 * MAX_ROUNDS and rep.estimated == rep.unresolved
    assert rep.visits <= 2 * 3 * E
    with pytest.raises(PeelError, match="round cap"):
        cs.peel(sketch, mask, max_rounds=5, on_failure="raise")
    with pytest.raises(ValueError, match="max_rounds"):
        cs.peel(sketch, mask, max_rounds=0)


# -- bit index -----------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 300), bits=st.sampled_from([1, 4]), seed=st.integers(0, 10**6))
def test_index_round_trip(n, bits, seed):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(n, generator=g) < 0.4
    buf = pack_index(mask, bits)
    assert buf.dtype == torch.uint8 and buf.numel() == index_wire_bytes(n, bits)
    assert buf.numel() == math.ceil(n * bits / 8)
    assert torch.equal(unpack_index(buf, n, bits), mask)
    # Bit layout, checked against Python integers: element i is bit (i·bits) of the buffer.
    as_int = int.from_bytes(bytes(buf.tolist()), "little")
    assert [(as_int >> (i * bits)) & 1 for i in range(n)] == mask.int().tolist()


def _masks(P: int, n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shared = torch.rand(n, generator=g) < 0.2  # nonzeros every rank holds
    return [shared | (torch.rand(n, generator=g) < 0.1) for _ in range(P)]


@pytest.mark.parametrize("P", [2, 3, 8])
def test_sum_of_packed_bitmaps_is_wrong_but_4bit_counters_are_exact(P):
    """TAGC sums packed 1-bit bitmaps: wrong with shared nonzeros. 4-bit sums are exact."""
    n = 999
    masks = _masks(P, n, P)
    true_or = [any(bool(m[i]) for m in masks) for i in range(n)]  # plain Python OR
    true_cnt = [sum(int(m[i]) for m in masks) for i in range(n)]
    summed1 = torch.zeros(index_wire_bytes(n, 1), dtype=torch.uint8)
    summed4 = torch.zeros(index_wire_bytes(n, 4), dtype=torch.uint8)
    for m in masks:  # what an all-reduce SUM on uint8 computes (wrapping arithmetic)
        summed1 += pack_index(m, 1)
        summed4 += pack_index(m, 4)
    try:
        wrong = unpack_index(summed1, n, 1).tolist()
    except ValueError:  # carries may even spill into the padding bits
        wrong = None
    assert wrong != true_or
    assert unpack_index(summed4, n, 4).tolist() == true_or
    assert unpack_counts(summed4, n, 4).tolist() == true_cnt


def test_4bit_counters_overflow_above_15_ranks():
    n = 8
    mask = torch.ones(n, dtype=torch.bool)
    summed = torch.zeros(index_wire_bytes(n, 4), dtype=torch.uint8)
    for _ in range(16):
        summed += pack_index(mask, 4)
    assert unpack_counts(summed, n, 4).tolist() != [16] * n  # why P > 15 needs a fallback


def test_unpack_rejects_bad_buffers():
    with pytest.raises(ValueError):
        unpack_index(torch.zeros(3, dtype=torch.uint8), 30, 1)  # too short
    with pytest.raises(ValueError):
        unpack_index(torch.zeros(5, dtype=torch.uint8), 30, 1)  # too long
    with pytest.raises(ValueError):
        unpack_index(torch.zeros(4, dtype=torch.int32), 30, 1)
    with pytest.raises(ValueError):
        unpack_index(torch.zeros(2, 2, dtype=torch.uint8), 30, 1)
    with pytest.raises(ValueError):
        unpack_index(torch.tensor([0, 0, 0, 0x80], dtype=torch.uint8), 30, 1)  # padding bit
    with pytest.raises(ValueError):
        unpack_index(torch.tensor([0x10], dtype=torch.uint8), 1, 4)  # padding nibble
    for bad in [(torch.zeros(1, dtype=torch.uint8), 8, 2), (torch.zeros(1, dtype=torch.uint8),
                -1, 1), (torch.zeros(1, dtype=torch.uint8), 8.0, 1), ([0], 8, 1)]:
        with pytest.raises(ValueError):
            unpack_index(*bad)
    with pytest.raises(ValueError):
        pack_index(torch.zeros(8), 1)
    with pytest.raises(ValueError):
        index_wire_bytes(8, 3)


@FUZZ
@given(raw=st.binary(max_size=64), n=st.integers(-3, 600), bits=st.sampled_from([0, 1, 2, 4]))
def test_unpack_fuzz(raw, n, bits):
    buf = torch.tensor(list(raw), dtype=torch.uint8)
    try:
        out = unpack_index(buf, n, bits)
    except ValueError:
        return
    # Accepted only when well formed: right size, and it packs back to the same bytes.
    assert bits in (1, 4) and n >= 0 and buf.numel() == index_wire_bytes(n, bits)
    assert out.dtype == torch.bool and out.shape == (n,)
    if bits == 1:
        assert torch.equal(pack_index(out, 1), buf)


# -- fraction (TAGC θ) ---------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("density", [0.2, 0.1, 0.0125])
def test_fraction_keeps_largest_and_zeros_theta(dtype, density):
    n = 10_000
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, generator=g).to(dtype)
    x_copy = x.clone()
    sp = sparsify.get("fraction", density=density)
    sel = sp.select(x)
    assert torch.equal(x, x_copy)  # not modified
    k = round(density * n)
    assert len(sel) <= k
    zeros_after = n - len(sel)
    assert zeros_after / n >= 1 - density - 1e-12  # at least θ of the values become zero
    assert torch.equal(sel.values, x[sel.indices])
    # Every kept |x| >= every dropped |x| (computed independently by sorting).
    mag = x.float().abs()
    kept = torch.zeros(n, dtype=torch.bool)
    kept[sel.indices] = True
    assert float(mag[kept].min()) >= float(mag[~kept].max())
    assert len(sel) == k  # randn has no zeros


def test_fraction_theta_and_zeros():
    sp = sparsify.get("fraction", theta=0.9)
    assert abs(sp.density - 0.1) < 1e-12 and abs(sp.theta - 0.9) < 1e-12
    x = torch.zeros(1000)
    x[:30] = torch.arange(1, 31).float()
    sel = sp.select(x)  # k = 100 but only 30 nonzeros: zeros are never selected
    assert sel.indices.tolist() == list(range(30))
    for bad in [dict(), dict(density=0.1, theta=0.9), dict(theta=1.0), dict(theta=-0.1),
                dict(theta="x"), dict(density=0.0)]:
        with pytest.raises(ValueError):
            sparsify.get("fraction", **bad)
    with pytest.raises(ValueError):
        sp.select(torch.tensor([1.0, float("nan")]))
