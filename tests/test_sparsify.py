"""Sparsifier zoo: the contract (valid SparseGrad, x untouched, own RNG, state), per-method rules.

References are computed independently of the code under test (a full sort for top-k, plain
comparisons against the threshold each estimator reports).
"""

from __future__ import annotations

import inspect
import io
import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradsync import sparsify
from gradsync.sparsegrad import SparseGrad

ALL = ["dgc", "gaussiank", "randomk", "redsync", "sidco", "threshold", "topk"]
# (name, options) covering every variant
VARIANTS = [(n, {}) for n in ALL] + [("sidco", {"dist": "gpareto"}),
                                     ("threshold", {"clock": "step"})]
IDS = [n + "".join(f"-{v}" for v in o.values()) for n, o in VARIANTS]


def make(name: str, density: float, seed: int = 0, **options):
    return sparsify.get(name, density=density, seed=seed, **options)


def gradient_like(n: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    """Laplace-ish values with random signs and distinct magnitudes (no ties)."""
    g = torch.Generator().manual_seed(seed)
    mag = -torch.log(torch.rand(n, generator=g, dtype=torch.float64).clamp_min(1e-12))
    mag = mag + torch.arange(n, dtype=torch.float64) * 1e-9  # break ties
    sign = torch.randint(2, (n,), generator=g) * 2 - 1
    return (mag * sign * 1e-2).to(dtype)


def check_valid(sel: SparseGrad, x: torch.Tensor) -> None:
    assert isinstance(sel, SparseGrad)
    assert sel.numel == x.numel()
    assert sel.indices.dtype == torch.int64
    assert sel.values.dtype == x.dtype
    i = sel.indices
    if i.numel():
        assert int(i.min()) >= 0 and int(i.max()) < x.numel()
        assert bool((i[1:] > i[:-1]).all()), "indices not strictly increasing"
    assert torch.equal(sel.values, x[i])


def test_registry_lists_the_zoo():
    assert set(ALL) <= set(sparsify.names())


@pytest.mark.parametrize("name", sorted(set(ALL) | {"fraction"}))
def test_registry_sets_the_name_once(name):
    """``@registry.register("dgc")`` is the only place a sparsifier's name is written."""
    s = make(name, 0.1)
    assert s.name == name and type(s).name == name
    assert f'name = "{name}"' not in inspect.getsource(type(s))


def test_registry_register_names_aliases_and_duplicates():
    reg = type(sparsify.registry)("thing")  # a fresh Registry

    @reg.register("first", "alias")
    class Thing:
        def __init__(self, x: int = 0) -> None:
            self.x = x

    assert Thing.name == "first" and reg.names() == ["alias", "first"]
    assert isinstance(reg.get("alias", x=2), Thing) and reg.get("first").x == 0
    with pytest.raises(ValueError, match="already registered"):
        reg.register("other", "alias")(type("Other", (), {}))
    assert "other" not in reg and reg.names() == ["alias", "first"]  # nothing half-registered
    with pytest.raises(ValueError, match="non-empty"):
        reg.register("")
    with pytest.raises(ValueError, match="unknown thing 'nope'"):
        reg.get("nope")


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("density", [0.0, -0.1, 1.01, float("nan"), float("inf"), "x", None])
def test_bad_density_is_rejected_at_get(name, density):
    with pytest.raises(ValueError, match="density"):
        make(name, density)


@pytest.mark.parametrize("name", ALL)
def test_bad_input_is_rejected(name):
    sp = make(name, 0.1)
    for bad in (torch.zeros(3, 3), torch.arange(10), [1.0, 2.0]):
        with pytest.raises(ValueError):
            sp.select(bad)
    for v in (float("nan"), float("inf"), float("-inf")):
        x = torch.ones(100)
        x[7] = v
        with pytest.raises(ValueError, match="non-finite"):
            sp.select(x)


@pytest.mark.parametrize(("name", "opts"), VARIANTS, ids=IDS)
@pytest.mark.parametrize("density", [0.001, 0.01, 0.1, 0.5])
def test_valid_selection_and_rules(name, opts, density):
    x = gradient_like(20_000, seed=3)
    sp = make(name, density, **opts)
    k = max(1, round(density * x.numel()))
    a = x.abs()
    for step in range(3):  # threshold: an exact call then reuse calls
        sel = sp.select(x, step=step)
        check_valid(sel, x)
        assert sp.last_k == k and sp.last_count == len(sel)
        assert sp.last_deviation == pytest.approx((len(sel) - k) / k)
        chosen = torch.zeros(x.numel(), dtype=torch.bool)
        chosen[sel.indices] = True
        if name in ("topk", "randomk"):
            assert len(sel) == k
        if name == "topk":  # reference: a full descending sort of |x| (no ties here)
            ref = torch.sort(torch.argsort(a, descending=True)[:k]).values
            assert torch.equal(sel.indices, ref)
        if name in ("gaussiank", "redsync", "sidco"):  # rule: exactly {|x| > threshold}
            assert torch.equal(chosen, a > sp.last_threshold)
        if name == "dgc":  # candidates |x| ≥ thr, truncated to the k largest
            assert len(sel) <= k
            assert bool((a[sel.indices] >= sp.last_threshold).all())
            if len(sel) == k:
                # the truncation keeps the largest candidates: nothing left out is larger
                assert float(a[~chosen].max()) <= float(a[sel.indices].min())
        if name == "threshold":
            assert 2 * k <= 3 * len(sel) <= 4 * k
            assert bool((a[sel.indices] >= sp.last_threshold).all())
            if not sp.last_exact:  # reuse: exactly {|x| ≥ thr}
                assert torch.equal(chosen, a >= sp.last_threshold)


@pytest.mark.parametrize(("name", "opts"), VARIANTS, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dtypes_and_x_untouched(name, opts, dtype):
    x = gradient_like(5000, seed=1, dtype=dtype)
    before = x.clone()
    sp = make(name, 0.02, **opts)
    for step in range(2):
        sel = sp.select(x, step=step)
        check_valid(sel, x)
        assert 0 < len(sel) <= x.numel()
    assert torch.equal(x, before)
    assert x.dtype == dtype


@pytest.mark.parametrize(("name", "opts"), VARIANTS, ids=IDS)
def test_global_rng_untouched(name, opts):
    torch.manual_seed(1234)
    state = torch.random.get_rng_state()
    sp = make(name, 0.01, seed=5, **opts)
    for n in (1, 7, 1000, 30_000):
        sp.select(gradient_like(n, seed=n), step=0)
    assert torch.equal(torch.random.get_rng_state(), state)


@pytest.mark.usefixtures("kernels")
@pytest.mark.parametrize(("name", "opts"), VARIANTS, ids=IDS)
def test_tiny_tensors_and_density_one(name, opts):
    sp = make(name, 0.01, **opts)
    for n in (0, 1, 2, 50, 99):  # n < 1/density: k = 1 (k = 0 for the empty tensor)
        x = gradient_like(n, seed=n)
        sel = sp.select(x)
        check_valid(sel, x)
        assert sp.last_k == min(n, 1)
        if name in ("topk", "randomk", "threshold", "dgc"):
            assert len(sel) == min(n, 1)
        if name == "topk" and n:
            assert int(sel.indices[0]) == int(torch.argmax(x.abs()))
    full = make(name, 1.0, **opts)
    x = gradient_like(333, seed=9)
    sel = full.select(x)
    assert torch.equal(sel.indices, torch.arange(333))
    assert torch.equal(sel.to_dense(), x)


@pytest.mark.parametrize(("name", "opts"), VARIANTS, ids=IDS)
def test_determinism_by_seed(name, opts):
    xs = [gradient_like(20_000, seed=s) for s in range(4)]
    a, b = make(name, 0.01, seed=7, **opts), make(name, 0.01, seed=7, **opts)
    for step, x in enumerate(xs):
        assert torch.equal(a.select(x, step=step).indices, b.select(x, step=step).indices)


def test_randomk_seed_changes_positions_and_is_uniform():
    x = gradient_like(100_000, seed=0)
    i1 = make("randomk", 0.01, seed=1).select(x).indices
    i2 = make("randomk", 0.01, seed=2).select(x).indices
    assert not torch.equal(i1, i2)
    # Uniformity: every code path (host: with-replacement draws for k ≪ n, randperm for large
    # k; device: the k smallest of uniform keys, the path on CUDA, forced here on the CPU).
    for n, k_density, draws, device_draws in ((200, 0.02, 4000, None), (40, 0.5, 1000, None),
                                              (200, 0.02, 4000, True), (40, 0.5, 1000, True)):
        sp = make("randomk", k_density, seed=3, device_draws=device_draws)
        hits = torch.zeros(n)
        y = torch.ones(n)
        for _ in range(draws):
            hits[sp.select(y).indices] += 1
        k = round(k_density * n)
        expect = draws * k / n
        # each position's count is Binomial(draws, k/n): 6 standard deviations
        sd = math.sqrt(draws * (k / n) * (1 - k / n))
        assert float((hits - expect).abs().max()) < 6 * sd
        assert float(hits.sum()) == draws * k


def test_randomk_device_draws_follow_the_generator_state():
    # the device path seeds a device generator from one draw of the sparsifier's own: its
    # state (what a checkpoint saves) fixes the next selection, and two seeds differ
    x = gradient_like(50_000, seed=1)
    a = make("randomk", 0.1, seed=5, device_draws=True)
    b = make("randomk", 0.1, seed=5, device_draws=True)
    for step in range(3):
        ia, ib = a.select(x, step).indices, b.select(x, step).indices
        assert torch.equal(ia, ib) and ia.unique().numel() == ia.numel() == 5000
    saved = a.state_dict()
    want = a.select(x, 3).indices
    b.load_state_dict(saved)
    assert torch.equal(b.select(x, 3).indices, want)
    other = make("randomk", 0.1, seed=6, device_draws=True).select(x).indices
    assert not torch.equal(other, make("randomk", 0.1, seed=5, device_draws=True).select(x).indices)
    with pytest.raises(ValueError, match="device_draws"):
        make("randomk", 0.1, device_draws="yes")


@pytest.mark.parametrize(("name", "opts"), VARIANTS, ids=IDS)
def test_state_round_trip(name, opts):
    xs = [gradient_like(20_000, seed=s) * (1 + 0.05 * s) for s in range(8)]
    a = make(name, 0.01, seed=11, **opts)
    for step in range(3):
        a.select(xs[step], step=step)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b = make(name, 0.01, seed=99, **opts)  # a different seed: the state must override it
    b.load_state_dict(torch.load(buf, weights_only=False))
    for step in range(3, 8):
        sa, sb = a.select(xs[step], step=step), b.select(xs[step], step=step)
        assert torch.equal(sa.indices, sb.indices)
        assert a.last_threshold == b.last_threshold
    with pytest.raises(ValueError, match="density"):
        make(name, 0.02, **opts).load_state_dict(a.state_dict())


def test_threshold_reuse_period_and_window():
    period = 8
    sp = make("threshold", 0.01, period=period)
    g = torch.Generator().manual_seed(0)
    x = gradient_like(20_000, seed=0)
    exact_calls = []
    for t in range(40):
        # a slowly drifting gradient: scale and content change a little every step
        x = x * 1.01 + 0.002 * torch.randn(x.numel(), generator=g) * x.abs().mean()
        sel = sp.select(x)
        k = sp.last_k
        assert 2 * k <= 3 * len(sel) <= 4 * k
        if sp.last_exact:
            exact_calls.append(t)
            assert len(sel) == k
    assert exact_calls[:1] == [0]
    assert all(b - a <= period for a, b in itertools.pairwise(exact_calls))
    assert len(exact_calls) < 40 // 2  # reuse actually happens
    # A sudden 100x change of scale cannot be absorbed by nudges: recomputed on the spot.
    sel = sp.select(x * 100.0)
    assert sp.last_exact and len(sel) == sp.last_k
    # clock="step": recomputed when the step advanced by the period
    st_sp = make("threshold", 0.01, period=5, clock="step")
    flags = []
    for step in (0, 1, 2, 4, 5, 6, 9, 10, 3):
        st_sp.select(x, step=step)
        flags.append(st_sp.last_exact)
    assert flags == [True, False, False, False, True, False, False, True, True]
    # a different tensor size forces a recomputation
    st_sp.select(x[:1000], step=4)
    assert st_sp.last_exact


def test_threshold_state_has_threshold_and_counters():
    sp = make("threshold", 0.01, period=4)
    x = gradient_like(10_000, seed=2)
    for _ in range(3):
        sp.select(x)
    s = sp.state_dict()
    assert s["thr"] == sp.thr and s["calls_since_exact"] == 3 and s["exact_count"] == 1


def test_sidco_stage_ratios_multiply_to_density():
    for d in (0.5, 0.25, 0.1, 0.01, 0.001, 1e-5):
        for opts in ({}, {"stages": 3}, {"first_ratio": 0.5, "stage_ratio": 0.1}):
            r = make("sidco", d, **opts).stage_ratios()
            assert math.prod(r) == pytest.approx(d, rel=1e-9)
            assert all(0 < q <= 1 for q in r)
    assert len(make("sidco", 0.5).stage_ratios()) == 1
    # density 0.001 = 0.25 · 0.004; ln(0.004)/ln(0.25) = 3.98 → 4 more stages
    assert len(make("sidco", 0.001).stage_ratios()) == 5
    assert len(make("sidco", 0.001, stages=3).stage_ratios()) == 3
    with pytest.raises(ValueError):
        make("sidco", 0.01, dist="normal")


def test_dgc_sample_covers_one_percent_and_two_over_density():
    sp = make("dgc", 0.001)
    a = torch.arange(1_000_000, dtype=torch.float32)
    s = sp._sample(a)
    assert s.numel() >= 10_000  # ≥ 1% of the elements, and ≥ 2/density = 2000
    stride = int(s[1] - s[0])
    assert bool((s[1:] - s[:-1] == stride).all())  # strided
    starts = {int(sp._sample(a)[0]) for _ in range(20)}
    assert len(starts) > 1  # random start


def test_gaussiank_threshold_is_the_normal_ppf_on_gaussian_data():
    # On truly Gaussian data the fitted threshold needs no correction and is accurate.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200_000, generator=g)
    sp = make("gaussiank", 0.01)
    sel = sp.select(x)
    assert sp.last_adjustments == 0
    assert sp.last_gaussian_threshold == pytest.approx(2.5758 * float(x.std()), rel=0.02)
    assert abs(sp.last_deviation) < 0.1
    assert len(sel) > 0


_DISTRIBUTIONS = ("normal", "laplace", "lognormal", "sparse", "constant")


def _hyp_tensor(n: int, dist: str, scale: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dist == "normal":
        x = torch.randn(n, generator=g)
    elif dist == "laplace":
        x = -torch.log(torch.rand(n, generator=g).clamp_min(1e-12)) * (
            torch.randint(2, (n,), generator=g) * 2 - 1)
    elif dist == "lognormal":
        x = torch.exp(2 * torch.randn(n, generator=g)) * (
            torch.randint(2, (n,), generator=g) * 2 - 1)
    elif dist == "sparse":  # mostly exact zeros
        x = torch.randn(n, generator=g) * (torch.rand(n, generator=g) < 0.05)
    else:
        x = torch.full((n,), 0.5)
    return x * scale


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(ALL),
    n=st.integers(min_value=0, max_value=3000),
    density=st.floats(min_value=1e-4, max_value=1.0),
    dist=st.sampled_from(_DISTRIBUTIONS),
    scale=st.sampled_from([1e-6, 1e-2, 1.0, 1e3]),
    seed=st.integers(min_value=0, max_value=2**31 - 1),
)
def test_property_valid_and_bounded(name, n, density, dist, scale, seed):
    x = _hyp_tensor(n, dist, scale, seed)
    before = x.clone()
    sp = make(name, density, seed=seed)
    k = min(n, max(1, round(density * n))) if n else 0
    for step in range(2):
        sel = sp.select(x, step=step)
        check_valid(sel, x)
        assert sp.last_k == k
        assert len(sel) <= n
        if name in ("topk", "randomk") or k == n:
            assert len(sel) == k
        elif name == "dgc":
            assert len(sel) <= k
        elif name == "threshold":
            assert 2 * k <= 3 * len(sel) <= 4 * k
    assert torch.equal(x, before)


def test_select_each_selects_as_select_with_one_finiteness_read(monkeypatch):
    """``select_each``: the same selections and sparsifier state as ``select`` on each pair,
    after one finiteness read for all the tensors (``select`` reads once per tensor); a NaN or
    Inf in any tensor raises ``select``'s error, naming the counts, before any selection runs
    (no sparsifier's state moves)."""
    from gradsync.sparsify import base

    xs = [gradient_like(n, seed=n) for n in (3000, 40, 12_000, 1)]
    names = ["dgc", "topk", "randomk", "gaussiank"]
    one = [make(nm, 0.05, seed=i) for i, nm in enumerate(names)]
    each = [make(nm, 0.05, seed=i) for i, nm in enumerate(names)]
    want = [sp.select(x, step=2) for sp, x in zip(one, xs)]
    reads = []
    real = base.all_finite_each
    monkeypatch.setattr(base, "all_finite_each", lambda ts: reads.append(len(ts)) or real(ts))
    got = sparsify.select_each(list(zip(each, xs)), step=2)
    assert reads == [4]  # one read for the four tensors
    for w, g, a, b in zip(want, got, one, each):
        assert torch.equal(w.indices, g.indices) and torch.equal(w.values, g.values)
        assert (a.last_k, a.last_count, a.last_threshold) == (b.last_k, b.last_count,
                                                              b.last_threshold)
    bad = [x.clone() for x in xs]
    bad[2][[5, 9]] = float("nan")
    bad[2][7] = float("inf")
    fresh = [make(nm, 0.05, seed=i) for i, nm in enumerate(names)]
    with pytest.raises(ValueError, match=r"randomk: input gradient holds non-finite values "
                                         r"\(2 NaN, 1 Inf\)"):
        sparsify.select_each(list(zip(fresh, bad)))
    assert [sp.last_k for sp in fresh] == [0, 0, 0, 0]  # nothing was selected
    with pytest.raises(ValueError, match="expected a 1-D tensor"):
        sparsify.select_each([(fresh[0], xs[0].view(30, 100))])
    assert sparsify.select_each([]) == []

    class Own(type(make("topk", 0.05))):  # overrides select itself: called through it
        def select(self, x, step=0):
            return SparseGrad(torch.tensor([0]), x[:1], x.numel())

    got = sparsify.select_each([(Own(0.05), xs[0]), (make("topk", 0.05), xs[0])])
    assert got[0].indices.tolist() == [0] and len(got[1]) == round(0.05 * 3000)


def test_dgc_draws_its_sample_starts_without_a_tensor_operation():
    """DGC's sample start comes from its own Python generator: a selection dispatches no
    ``randint`` and reads nothing back but its one ``nonzero`` (and an adjustment's); a state
    saved before the draws had their own generator starts them afresh from the seed, and a
    malformed one is refused."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    from gradsync import sparsegrad

    x = gradient_like(50_000, seed=3)
    picked = {}
    # the accelerators' kernels compact with torch's nonzero (a read each); the CPU's with
    # numpy's flatnonzero on the mask (no torch op, no device to wait for): the same entries
    for kernels in (sparsegrad.CPU_AS_ACCELERATOR, sparsegrad.CPU):
        sp = make("dgc", 0.01, seed=4)
        with sparsegrad.using(kernels), Seen() as seen:
            picked[kernels.name] = sp.select(x).indices
        assert "randint" not in seen.names and "random_" not in seen.names
        assert seen.names.count("nonzero") == (0 if kernels.host else 1 + sp.last_adjustments)
    assert torch.equal(*picked.values())
    # the same seed draws the same starts; an old state (no "draws") restarts from the seed
    old = {k: v for k, v in make("dgc", 0.01, seed=4).state_dict().items() if k != "draws"}
    again = make("dgc", 0.01, seed=8)
    again.load_state_dict(old)
    assert torch.equal(again.select(x).indices, make("dgc", 0.01, seed=4).select(x).indices)
    with pytest.raises(ValueError, match="draws are malformed"):
        make("dgc", 0.01).load_state_dict({**sp.state_dict(), "draws": [3, "x", None]})


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 60_000), share=st.floats(1e-4, 0.3), seed=st.integers(0, 2**31 - 1),
       heavy=st.booleans())
def test_threshold_exact_top_k_through_candidates_is_torch_topk(n, share, seed, heavy):
    """``sparsegrad.top_k`` (the exact Top-k's selection, Ok-Topk's exact recomputation)
    selects the entries ``torch.topk`` selects, with their values, whether the sample's
    candidates hold the top-k or it falls back to every entry; compared with ``torch.topk``
    itself, on magnitudes drawn distinct (so which of several equal entries is taken does not
    arise)."""
    from gradsync.sparsegrad import top_k

    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, generator=g).abs()
    if heavy:  # a few huge entries the strided sample mostly misses
        a[torch.randint(0, n, (max(1, n // 500),), generator=g)] *= 1e4
    if a.unique().numel() < n:
        return
    k = max(1, min(n, round(share * n)))
    vals, idx = top_k(a, k)
    want_vals, want_idx = torch.topk(a, k, sorted=False)
    assert sorted(idx.tolist()) == sorted(want_idx.tolist())
    assert torch.equal(vals, a[idx]) and torch.equal(vals.sort().values, want_vals.sort().values)


def test_threshold_exact_top_k_falls_back_when_the_candidates_are_too_few(monkeypatch):
    """A sample whose threshold lets fewer than k entries pass (the large entries all sit on
    the sample's strides, so its (2·k·s/n)-th largest passes only that many) falls back to
    ``torch.topk`` of every entry: still the exact top-k."""
    from gradsync import sparsegrad

    n, k = 100_000, 300
    a = torch.linspace(0, 1, n)
    stride = n // max(4096, n // 100)
    a[::stride] = 2.0 + torch.arange(len(a[::stride])) * 1e-3  # on the sample, all large
    calls = []
    real = torch.topk

    def counted(t, kk, **kw):
        calls.append(t.numel())
        return real(t, kk, **kw)

    monkeypatch.setattr(sparsegrad.torch, "topk", counted)
    vals, idx = sparsegrad.top_k(a, k)
    assert calls[-1] == n  # the fallback: every entry
    assert sorted(idx.tolist()) == sorted(real(a, k).indices.tolist())
    assert torch.equal(vals, a[idx])
