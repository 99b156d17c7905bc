"""Segmented selection (gradsync.sparsify.segments) against the per-tensor selections.

For every buffer the segmented DGC and top-k pick exactly the entries that selecting each tensor
with its own sparsifier picks, leave every generator in the same state and record the same
thresholds, adjustments and counts; the reference is the sparsifiers' own ``select``, run on
twins with the same seeds. Magnitude ties at a tensor's k-th place may be broken differently
(both pick any): there the test compares the selected values, not positions.
"""

from __future__ import annotations

import math
from unittest.mock import patch

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import segmented
from gradsync import sparsegrad, sparsify
from gradsync.sparsify.segments import (
    Segments,
    descending_keys,
    order_in_segments,
    ranges,
    segment_keys,
    select_buffer,
    top_in_segments,
)


def _buffer(sizes: list[int], seed: int, zeros: float = 0.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = sum(sizes)
    # heavy tails: DGC's sampled threshold misses, so its adjustment rounds run
    x = torch.randn(n, generator=g) * torch.exp(2 * torch.randn(n, generator=g))
    if zeros:
        x[torch.rand(n, generator=g) < zeros] = 0.0
    return x


def _twins(name: str, densities: list[float], seed: int) -> tuple[list, list]:
    make = [lambda d=d, i=i: sparsify.get(name, density=d, seed=seed * 100 + i)
            for i, d in enumerate(densities)]
    return [m() for m in make], [m() for m in make]


def _per_tensor(sps, x: torch.Tensor, sizes: list[int], step: int) -> torch.Tensor:
    out, o = [], 0
    for sp, n in zip(sps, sizes):
        out.append(sp.select(x[o:o + n], step).indices + o)
        o += n
    return torch.cat(out)


sizes_st = st.lists(st.integers(1, 2500), min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(sizes=sizes_st, data=st.data(), seed=st.integers(0, 10_000),
       name=st.sampled_from(["dgc", "topk"]))
def test_segmented_selection_is_the_per_tensor_selection(sizes, data, seed, name):
    densities = data.draw(st.lists(st.sampled_from([0.001, 0.01, 0.05, 0.3, 1.0]),
                                   min_size=len(sizes), max_size=len(sizes)))
    x = _buffer(sizes, seed)
    mine, ref = _twins(name, densities, seed)
    for step in range(3):  # the generators advance alike over steps
        want = _per_tensor(ref, x, sizes, step)
        got = select_buffer(mine, x, sizes, step)
        assert got is not None
        assert torch.equal(got.indices, want)
        assert torch.equal(got.values, x[want])
        assert got.numel == x.numel()
        for a, b in zip(mine, ref):
            assert torch.equal(a.generator.get_state(), b.generator.get_state())
            assert (a.last_k, a.last_count) == (b.last_k, b.last_count)
            if name == "dgc":
                assert a.last_threshold == b.last_threshold
                assert a.last_adjustments == b.last_adjustments
        x = x.roll(7) * 1.5  # another buffer next step


def test_dgc_adjustment_rounds_are_exercised():
    # the property test would be weaker if no tensor ever lowered its threshold: here some do
    sizes = [3000, 500, 2000]
    adjusted = set()
    for seed in range(30):
        mine, ref = _twins("dgc", [0.001, 0.01, 0.001], seed)
        x = _buffer(sizes, seed)
        assert torch.equal(select_buffer(mine, x, sizes).indices, _per_tensor(ref, x, sizes, 0))
        assert [sp.last_adjustments for sp in mine] == [sp.last_adjustments for sp in ref]
        adjusted |= {sp.last_adjustments for sp in ref}
    assert max(adjusted) >= 1


def test_ties_at_zero_select_the_same_values():
    sizes = [400, 1200, 64]
    x = _buffer(sizes, 5, zeros=0.97)
    for name in ("dgc", "topk"):
        mine, ref = _twins(name, [0.05, 0.05, 0.5], 5)
        got = select_buffer(mine, x, sizes)
        o = 0
        for sp, n in zip(ref, sizes):
            want = sp.select(x[o:o + n]).values
            part = got.values[(got.indices >= o) & (got.indices < o + n)]
            assert torch.equal(torch.sort(part.abs()).values, torch.sort(want.abs()).values)
            o += n


def test_other_sparsifiers_fall_back():
    x = torch.randn(100)
    assert select_buffer([sparsify.get("randomk", density=0.1)] * 2, x, [50, 50]) is None
    mixed = [sparsify.get("dgc", density=0.1), sparsify.get("topk", density=0.1)]
    assert select_buffer(mixed, x, [50, 50]) is None
    odd = [sparsify.get("dgc", density=0.1), sparsify.get("dgc", density=0.1, lower=0.5)]
    assert select_buffer(odd, x, [50, 50]) is None


def test_bad_buffers_are_refused_before_any_draw():
    sps = [sparsify.get("dgc", density=0.01, seed=1), sparsify.get("dgc", density=0.01, seed=2)]
    before = [sp.generator.get_state() for sp in sps]
    x = torch.randn(3000)
    x[2500] = math.nan
    with pytest.raises(ValueError, match="NaN"):
        select_buffer(sps, x, [2000, 1000])
    assert all(torch.equal(a, sp.generator.get_state()) for a, sp in zip(before, sps))
    with pytest.raises(ValueError, match="2 sparsifiers for 2 tensors of 2999"):
        select_buffer(sps, torch.randn(3000), [2000, 999])


def test_helpers():
    assert ranges([5, 0, 9], [2, 0, 3], torch.device("cpu")).tolist() == [5, 6, 9, 10, 11]
    v = torch.tensor([1.0, 5.0, 3.0, 2.0, 9.0, 0.5])
    assert top_in_segments(v, [3, 3], [2, 1]).tolist() == [1, 2, 4]
    assert Segments((3, 4, 5)).offsets == (0, 3, 7)



@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), sizes=st.lists(st.integers(0, 40), min_size=1, max_size=6))
def test_order_in_segments_sorts_by_segment_then_descending_magnitude(seed, sizes):
    """One sort of int64 keys orders every segment at once as ranking each segment's
    magnitudes by (descending value, position) would: ties (few distinct values), zeros,
    subnormals, the largest floats and +Inf included."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor([0.0, 1e-45, 2e-45, 0.5, 1.0, 1.0000001, 3e38, math.inf])
    v = pool[torch.randint(0, len(pool), (sum(sizes),), generator=g)]
    bases = segment_keys(sizes, torch.device("cpu"))
    assert bases.tolist() == [i * 2**32 + 2**31 - 1 for i, n in enumerate(sizes)
                              for _ in range(n)]
    got = order_in_segments(v, bases).tolist()
    want, o = [], 0
    for n in sizes:
        want += sorted(range(o, o + n), key=lambda i: (-float(v[i]), i))
        o += n
    assert got == want
    with pytest.raises(TypeError, match="fp32"):
        order_in_segments(v.double(), bases)

@pytest.mark.usefixtures("kernels")
def test_engine_trains_bitwise_alike_with_and_without_segments(monkeypatch):
    """The engine's per-tensor jobs through select_buffer (forced on the CPU) end where
    selecting tensor by tensor ends, bit for bit (per_tensor: a fixed plan)."""
    import gradsync
    from gradsync.sparsify import segments

    calls = []
    real = segments.select_buffer

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(segments, "select_buffer", spy)
    monkeypatch.setattr(sparsify, "select_buffer", spy)

    def run(on: bool) -> list[torch.Tensor]:
        with sparsegrad.using(segmented(on)):  # the engine's threads take them too
            torch.manual_seed(0)
            model = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(24, 24),
                                                                          torch.nn.Tanh())])
            sync = gradsync.GradSync(model, gradsync.Config(
                scheme="per_tensor", density=0.05, momentum=0.9, warmup_steps=2,
                compress_single_rank=True))
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            g = torch.Generator().manual_seed(1)
            for _ in range(6):
                opt.zero_grad()
                model(torch.randn(8, 24, generator=g)).square().mean().backward()
                sync.synchronize()
                opt.step()
            sync.close()
            return [p.detach().clone() for p in model.parameters()]

    per_tensor = run(False)
    assert not calls
    at_once = run(True)
    assert calls  # the segmented path ran
    assert all(torch.equal(a, b) for a, b in zip(per_tensor, at_once))
    assert not all(torch.equal(a, b) for a, b in zip(per_tensor, run_untrained()))


def run_untrained() -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(24, 24),
                                                                  torch.nn.Tanh())])
    return [p.detach().clone() for p in model.parameters()]


def _hook_rank(rank, world_size, scheme, on):
    """A DDP-hook run whose buckets travel reordered (SSFusion: small tensors first)."""
    import torch.distributed as dist  # noqa: F401  (the process group is up)
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradsync

    sparsegrad.bind(segmented(on))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(24, 24),
                                                                  torch.nn.Tanh())])
    net = DDP(model)
    gradsync.ddp.register(net, gradsync.Config(scheme=scheme, density=0.05, momentum=0.9),
                          small_numel=100)  # the biases travel whole, ahead of the weights
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1 + rank)
    for _ in range(5):
        opt.zero_grad()
        net(torch.randn(8, 24, generator=g)).square().mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.usefixtures("kernels")
@pytest.mark.accelerator_at(scheme='ssfusion_oi')
@pytest.mark.parametrize("scheme", ["ssfusion", "ssfusion_oi"])
def test_the_ddp_hook_reorders_a_bucket_alike_by_index_and_by_slices(scheme):
    """The DDP hook's travel order (small tensors first) by one position index (the
    accelerators' path, forced on the CPU) and by one slice per tensor (the CPU's): the same
    training, bit for bit, on every rank."""
    from gradsync.testing import run_distributed

    by_slices = run_distributed(_hook_rank, 2, scheme, False, timeout=120)
    by_index = run_distributed(_hook_rank, 2, scheme, True, timeout=120)
    for a, b in zip(by_slices, by_index):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert all(torch.equal(x, y) for x, y in zip(by_slices[0], by_slices[1]))


def _one_buffer_rank(rank, world_size, sparsifier, on, capped):
    """The engine's one-buffer ``topka`` on the accelerators' path (``on``) or the CPU's, with
    the selection's capacity (``capped``) or with it taken away as it reaches the collective:
    the parameters after 5 SGD steps, and how often TopkA exchanged counts after the
    warm-up."""
    import dataclasses

    from gradsync.collectives.comm import Comm
    from gradsync.collectives.topka import TopkA
    from gradsync.engine import GradSync
    from gradsync.engine.config import Config

    sparsegrad.bind(segmented(on))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(24, 24),
                                                                  torch.nn.Tanh())])
    sync = GradSync(model, Config(scheme="topka", density=0.05, sparsifier=sparsifier,
                                  momentum=0.9, warmup_steps=1, density_warmup=()))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1 + rank)
    real, exchanges = Comm.all_gather_counts, []

    def counting(self, *args, **kwargs):
        exchanges.append(1)
        return real(self, *args, **kwargs)

    real_reduce = TopkA._reduce

    def uncapped(self, sel, comm, step, lazy=False):  # the exact-size exchange ignores lazy
        return real_reduce(self, dataclasses.replace(sel, capacity=None), comm, step)

    with (patch.object(Comm, "all_gather_counts", counting),
          patch.object(TopkA, "_reduce", real_reduce if capped else uncapped)):
        for step in range(5):
            if step == 2:
                exchanges.clear()
            opt.zero_grad()
            model(torch.randn(8, 24, generator=g)).square().mean().backward()
            sync.synchronize()
            opt.step()
    sync.close()
    return [p.detach().clone() for p in model.parameters()], len(exchanges)


@pytest.mark.parametrize("P", [2, 3])
@pytest.mark.parametrize("sparsifier", ["dgc", "topk"])
def test_the_one_buffer_topka_trains_alike_with_and_without_the_count_exchange(P, sparsifier):
    """A DGC or top-k selection of the whole buffer carries its capacity k, and TopkA sends it
    at that fixed size and exchanges no counts, with the accelerators' kernels and with the
    CPU's; without the capacity it exchanges them and sends the exact size. The same
    training, bit for bit, on every rank (what lies past a rank's count is masked, never
    added)."""
    from gradsync.testing import run_distributed

    runs = {(on, capped): run_distributed(_one_buffer_rank, P, sparsifier, on, capped,
                                          timeout=120)
            for on in (True, False) for capped in (True, False)}
    exact = runs[False, False]
    for (on, capped), got in runs.items():
        assert all(n == (0 if capped else 3) for _, n in got), (on, capped)  # steps 2-4
        for (a, _), (b, _) in zip(got, exact):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), (on, capped)
        assert all(torch.equal(x, y) for x, y in zip(got[0][0], got[-1][0]))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), J=st.integers(0, 10))
def test_dgc_levels_equal_the_comparisons_round_by_round(seed, J):
    """DGC's adjustment rounds without reads: each entry's level, the first round whose
    threshold θ·0.8^j it meets (found as its place among every row's levels), equals J + 1
    comparisons, also for entries exactly at a threshold or one ulp either side, zeros,
    subnormals, the largest floats, +inf, a zero θ (a tensor sent whole), and rows of -0.0
    and -inf thresholds (which every magnitude meets)."""
    from gradsync.sparsify.dgc import _levels

    g = torch.Generator().manual_seed(seed)
    thr = torch.rand(5, generator=g, dtype=torch.float64) * 3
    thr[1], thr[3], thr[4] = 0.0, -math.inf, -0.0
    cols = [thr]
    for _ in range(J):
        cols.append(cols[-1] * 0.8)
    table = torch.stack(cols, dim=1).float()
    sizes = [60, 20, 40, 10, 12]
    parts = []
    for i, n in enumerate(sizes):
        row = table[i][torch.isfinite(table[i])]
        picks = row[torch.randint(0, max(1, row.numel()), (n // 3,), generator=g)] \
            if row.numel() else torch.zeros(n // 3)
        near = torch.cat([picks, torch.nextafter(picks, torch.tensor(math.inf)),
                          torch.nextafter(picks, torch.tensor(0.0))]).abs()
        rest = torch.rand(n - near.numel(), generator=g) * 4
        rest[:2] = 0.0
        extremes = torch.tensor([math.inf, 1e-45, 3e38, 0.0])
        parts.append(torch.cat([near, rest, extremes]))
    sizes = [p.numel() for p in parts]
    a = torch.cat(parts)
    seg_of = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    keys = descending_keys(a, segment_keys(sizes, torch.device("cpu")))
    got = _levels(keys, table) - seg_of * (J + 2)  # its place among all rows' levels
    want, o = [], 0
    for i, n in enumerate(sizes):
        for v in a[o:o + n]:
            meets = [j for j in range(J + 1) if bool(v >= table[i, j])]
            want.append(meets[0] if meets else J + 1)
        o += n
    assert got.tolist() == want


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), kind=st.sampled_from(["normal", "cubed", "student", "spiky"]),
       density=st.sampled_from([0.001, 0.01, 0.1, 0.3]))
def test_gaussiank_rounds_on_the_device_equal_the_host_loop(seed, kind, density):
    """GaussianK's threshold corrections where buffers are selected at once run on the device
    without a read (every round runs; one past the window changes nothing): the same selection,
    number of corrections and thresholds as the host loop that stops early, on Gaussian and
    heavy-tailed gradients (where the fit misses k and the corrections matter)."""
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(200, 40_000, (1,), generator=g))
    x = torch.randn(n, generator=g)
    if kind == "cubed":
        x = x ** 3
    elif kind == "student":  # two degrees of freedom: tails far heavier than the fit's
        x = x / (torch.randn(n, 2, generator=g).pow(2).mean(1).sqrt())
    elif kind == "spiky":
        x = x * torch.rand(n, generator=g) ** 8

    got = {}
    for on_cpu in (False, True):
        with sparsegrad.using(segmented(on_cpu)):
            sp = sparsify.get("gaussiank", density=density)
            sel = sp.select(x)
        got[on_cpu] = (sel.indices.tolist(), sp.last_adjustments, sp.last_threshold,
                       sp.last_gaussian_threshold)
    host, device = got[False], got[True]
    assert device[:2] == host[:2]
    # IEEE float64 both ways; torch's CPU sqrt may differ from math.sqrt by an ulp
    assert device[2:] == pytest.approx(host[2:], rel=1e-14)


def test_threshold_reuse_nudges_on_the_device_equal_the_host_loop():
    """Ok-Topk's reused threshold (sparsify.threshold) where buffers are selected at once: its
    nudges run on the device and one read brings the outcome back; over gradients that drift
    slowly, fast and down, every call selects what the host loop selects, with the same nudges,
    recomputations and kept threshold (to an ulp), including calls whose nudges fail and
    recompute the exact threshold."""

    seen = set()
    for seed, growth in ((0, 0.87), (1, 1.15), (2, 1.8), (3, 0.5)):
        g = torch.Generator().manual_seed(seed)
        xs = [torch.randn(5000, generator=g) * growth ** t for t in range(12)]
        runs = {}
        for on_cpu in (False, True):
            with sparsegrad.using(segmented(on_cpu)):
                sp = sparsify.get("threshold", density=0.05, period=6)
                runs[on_cpu] = []
                for t, x in enumerate(xs):
                    sel = sp.select(x, t)
                    runs[on_cpu].append((sorted(sel.indices.tolist()), sp.last_nudges,
                                         sp.last_exact, sp.thr))
        for host, device in zip(runs[False], runs[True]):
            assert device[:3] == host[:3]
            assert device[3] == pytest.approx(host[3], rel=1e-14)
            seen.add(host[1:3])
    # the paths compared: reused as is, nudged once and twice, nudges failed (recomputed)
    assert {(0, False), (1, False), (2, False), (3, True)} <= seen


def _overflow_rank(rank, world_size, scheme, sparsifier, policy, accelerators=True):
    """The accelerators' path (forced on the CPU; ``accelerators=False``: the CPU's own): on
    rank 0, one tensor's gradient and its residual are finite but their sum overflows float32
    at step 2."""
    from conftest import batch, loss
    from gradsync.apps.models import build
    from gradsync.engine import GradSync
    from gradsync.engine.config import Config

    sparsegrad.bind(segmented(accelerators))
    model = build("mlp", seed=1)
    sync = GradSync(model, Config(scheme=scheme, density=0.05, sparsifier=sparsifier,
                                  warmup_steps=1, nonfinite=policy))
    w = model.net[1].weight
    out = []
    for step in range(3):
        model.zero_grad()
        x, y = batch("cnn", rank, step)
        handle = None
        if step == 2 and rank == 0:  # during backward, as in real life
            def big(grad):
                grad = grad.clone()
                grad[0, :4] = 3e38  # finite, and so is the residual: their sum is not
                return grad
            handle = w.register_hook(big)
            residual = sync.ef.residual("net.1.weight")
            residual.view(-1)[:4] = 3e38
            assert sync.ef.residual("net.1.weight").view(-1)[0] == 3e38  # held, not a copy
        loss(model, "cnn", x, y).backward()
        if handle is not None:
            handle.remove()
        try:
            out.append(("ok", sync.synchronize(),
                        all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())))
        except (ValueError, RuntimeError) as e:
            out.append(("raised", str(e)))
            break
    sync.close()
    return out


@pytest.mark.parametrize("scheme,sparsifier", [("multi_tensor", "topk"), ("oktopk", "dgc"),
                                               ("per_tensor", "topk"), ("per_tensor", "dgc")])
@pytest.mark.parametrize("policy", ["raise", "skip_step"])
@pytest.mark.parametrize("accelerators", [True, False])
def test_an_overflowed_sum_never_reaches_grad(scheme, sparsifier, policy, accelerators):
    """On the accelerators' path the selections make no finiteness read of their own (the
    engine's deferred check covers the gradients); a gradient plus residual that overflows
    still never reaches ``.grad`` on either path: the policy applies on every rank (with
    ``skip_step`` the step is skipped, as a loss scaler needs). Ok-Topk finds it in what it
    receives and returns a sum of NaN, to which the engine applies the policy."""
    from gradsync.testing import run_distributed

    for rank_out in run_distributed(_overflow_rank, 2, scheme, sparsifier, policy,
                                    accelerators):
        assert rank_out[:2] == [("ok", True, True)] * 2, rank_out
        if policy == "raise":
            assert rank_out[2][0] == "raised" and "non-finite" in rank_out[2][1], rank_out
        else:
            assert rank_out[2] == ("ok", False, True), rank_out


def test_dgc_levels_stay_in_their_row_whatever_a_row_holds():
    """A row of thresholds that is not ordered (θ NaN of either sign, from an accumulator
    that overflowed) or all +Inf gives its entries levels in [0, J + 1], never a place in
    another row (the histogram's bins would spill, or index past its end on the last row)."""
    from gradsync.sparsify.dgc import _levels

    J, g = 4, torch.Generator().manual_seed(1)
    neg_nan = torch.tensor([-0x00400000], dtype=torch.int32).view(torch.float32)[0]
    thetas = [math.nan, float(neg_nan), math.inf, 1.0]
    table = torch.stack([torch.tensor([t * 0.8 ** j for j in range(J + 1)]) for t in thetas])
    table[1] = neg_nan  # every column a negative NaN
    for order in ([0, 1, 2, 3], [3, 2, 1, 0]):
        rows = table[order]
        sizes = [7, 5, 6, 9]
        a = torch.rand(sum(sizes), generator=g) * 3
        a[::4] = math.inf
        a[1::5] = math.nan
        keys = descending_keys(a.abs(), segment_keys(sizes, torch.device("cpu")))
        seg_of = torch.repeat_interleave(torch.arange(4), torch.tensor(sizes))
        level = _levels(keys, rows) - seg_of * (J + 2)
        assert int(level.min()) >= 0 and int(level.max()) <= J + 1


def test_segmented_dgc_selects_what_overflowed_instead_of_raising_on_one_rank():
    """``checked=True`` (the caller checked the gradients): +Inf and NaN magnitudes in the
    buffer are selected, each tensor still keeps at most k, and nothing raises (a raise on
    the one rank whose sum overflowed would leave the others in the collective)."""
    sps = [sparsify.get("dgc", density=0.05, seed=i) for i in range(3)]
    g = torch.Generator().manual_seed(2)
    sizes = [400, 1000, 600]
    x = torch.randn(sum(sizes), generator=g)
    x[[5, 900, 1500]] = torch.tensor([math.inf, -math.inf, math.nan])
    sel = select_buffer(sps, x, sizes, checked=True)
    assert {5, 900, 1500} <= set(sel.indices.tolist())
    for sp in sps:
        assert 1 <= sp.last_count <= sp.last_k
