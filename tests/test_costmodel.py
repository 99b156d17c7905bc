"""The cost model: fits recover known parameters, Eq. 3/4, JSON, the profilers and the command."""

from __future__ import annotations

import json
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradsync.schedule.costmodel import (
    AffineFit,
    AlphaBeta,
    CostModel,
    fit_affine,
    fit_alpha_beta,
    missing_rate,
    profile_backward,
    profile_collectives,
    profile_sparse_call,
    profile_sparsifier,
    with_call_cost,
)
from gradsync.sparsify import get as get_sparsifier
from gradsync.testing import run_distributed


def small_model(P=4):
    return CostModel(P=P, order=["b", "a"], numel={"a": 10, "b": 1000}, elem_bytes=4,
                     backward={"a": 1e-3, "b": 2e-3}, sparsify=AffineFit(1e-4, 2e-9),
                     offload=AffineFit(3e-4, 5e-9), allreduce=AlphaBeta(1e-5, 1e-9),
                     allgather=AlphaBeta(2e-5, 3e-9), info={"source": "test"})


# ---- fits ------------------------------------------------------------------------------------
@settings(max_examples=50, deadline=None)
@given(st.floats(0, 1e-2), st.floats(0, 1e-6), st.lists(st.integers(1, 10**7), min_size=2,
                                                          max_size=8, unique=True))
def test_fit_affine_recovers_exact_lines(a, b, xs):
    f = fit_affine(xs, [a + b * x for x in xs])
    assert f.a == pytest.approx(a, rel=1e-6, abs=1e-12)
    assert f.b == pytest.approx(b, rel=1e-6, abs=1e-15)


def test_fit_affine_with_noise_and_clamping():
    rng = random.Random(0)
    xs = [2**e for e in range(8, 22)]
    ts = [3e-4 + 2e-9 * x + rng.gauss(0, 1e-6) for x in xs]
    f = fit_affine(xs, ts)
    assert f.a == pytest.approx(3e-4, rel=0.05) and f.b == pytest.approx(2e-9, rel=0.05)
    # data through a negative intercept: the constrained fit goes through the origin
    f = fit_affine([1, 2, 3], [0.5, 1.5, 2.5])  # unconstrained a = −0.5
    assert f.a == 0 and f.b == pytest.approx((0.5 + 3 + 7.5) / 14)
    # decreasing data: the best non-negative fit is a constant
    f = fit_affine([1, 2, 3], [3.0, 2.0, 1.0])
    assert f.b == 0 and f.a == pytest.approx(2.0)
    assert fit_affine([5, 5], [1.0, 3.0]) == AffineFit(2.0, 0.0)
    for bad in (([], []), ([1, 2], [1.0]), ([1, float("nan")], [1.0, 2.0])):
        with pytest.raises(ValueError):
            fit_affine(*bad)


@pytest.mark.parametrize("P", [2, 3, 8, 64])
def test_fit_alpha_beta_inverts_eq3_and_eq4(P):
    alpha, beta = 3e-5, 2e-9
    sizes = [1 << 10, 1 << 14, 1 << 17, 1 << 20]
    ar = [2 * (P - 1) * alpha + 2 * (P - 1) / P * s * beta for s in sizes]  # Eq. 4
    ag = [(P - 1) * alpha + (P - 1) * s * beta for s in sizes]  # Eq. 3
    for kind, ts in (("allreduce", ar), ("allgather", ag)):
        ab = fit_alpha_beta(kind, P, sizes, ts)
        assert ab.alpha == pytest.approx(alpha, rel=1e-6)
        assert ab.beta == pytest.approx(beta, rel=1e-6)
    cm = small_model(P)
    cm.allreduce = fit_alpha_beta("allreduce", P, sizes, ar)
    cm.allgather = fit_alpha_beta("allgather", P, sizes, ag)
    for s, t1, t2 in zip(sizes, ar, ag):
        assert cm.t_allreduce(s) == pytest.approx(t1) and cm.t_allgather(s) == pytest.approx(t2)
    assert fit_alpha_beta("allreduce", 1, sizes, ar) == AlphaBeta(0.0, 0.0)
    with pytest.raises(ValueError):
        fit_alpha_beta("broadcast", P, sizes, ar)
    with pytest.raises(ValueError):
        fit_alpha_beta("allreduce", 0, sizes, ar)


# ---- the model -------------------------------------------------------------------------------
def test_cost_model_times_and_round_trip():
    cm = small_model(P=4)
    assert cm.t_sparsify(1000) == pytest.approx(1e-4 + 2e-6)
    assert cm.t_sparsify(1000, offload=True) == pytest.approx(3e-4 + 5e-6)
    assert cm.t_allreduce(4000) == pytest.approx(6 * 1e-5 + 1.5 * 4000 * 1e-9)
    assert cm.t_allgather(800) == pytest.approx(3 * 2e-5 + 3 * 800 * 3e-9)
    assert cm.entry_bytes == 8
    d = json.loads(json.dumps(cm.to_dict()))
    back = CostModel.from_dict(d)
    assert back == cm
    assert back.order == ["b", "a"]
    one = small_model(P=1)
    assert one.t_allreduce(10**6) == 0 and one.t_allgather(10**6) == 0


def test_cost_model_rejects_bad_input():
    good = small_model().to_dict()
    for key, value in (("P", 0), ("elem_bytes", 0), ("order", ["a", "a"]),
                       ("order", ["a", "zz"]), ("backward", {"a": -1.0, "b": 0.0})):
        with pytest.raises(ValueError):
            CostModel.from_dict({**good, key: value})
    with pytest.raises(ValueError):
        CostModel.from_dict({"P": 2})
    with pytest.raises(ValueError):
        AffineFit(-1.0, 0.0)
    with pytest.raises(ValueError):
        AlphaBeta(0.0, float("inf"))


def test_missing_rate():
    assert missing_rate({"a": 0, "b": 3, "c": 0, "d": 1}) == 0.5
    assert missing_rate({"a": 5}) == 0.0
    with pytest.raises(ValueError):
        missing_rate({})
    with pytest.raises(ValueError):
        missing_rate({"a": -1})


# ---- profilers -------------------------------------------------------------------------------
def test_profile_sparsifier_inline_and_offloaded():
    sp = get_sparsifier("topk", density=0.01)
    sizes = (1 << 8, 1 << 12, 1 << 16)
    inline = profile_sparsifier(sp, sizes=sizes, repeats=2)
    off = profile_sparsifier(sp, sizes=sizes, repeats=2, offload=True)
    for f in (inline, off):
        assert f.a >= 0 and f.b >= 0
        assert f(1 << 16) > 0  # selecting from 65536 entries takes measurable time
    with pytest.raises(ValueError):
        profile_sparsifier(sp, sizes=(), repeats=2)


def test_profile_backward_gives_reverse_layer_order():
    from gradsync.apps import models

    net = models.build("mlp")
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 1, 28, 28, generator=g), torch.randint(10, (8,), generator=g)
    order, numel, tb = profile_backward(
        net, lambda: torch.nn.functional.cross_entropy(net(x), y), repeats=2)
    params = dict(net.named_parameters())
    assert sorted(order) == sorted(params)
    assert numel == {n: p.numel() for n, p in params.items()}
    # the last layer's gradients become ready before the first layer's
    assert order.index("net.5.weight") < order.index("net.1.weight")
    assert all(t >= 0 for t in tb.values()) and sum(tb.values()) > 0
    assert all(p.grad is None for p in net.parameters())  # left clean


def _collectives(rank, world_size):
    return profile_collectives(sizes=(1 << 10, 1 << 16), repeats=2)


def test_profile_collectives_agree_across_ranks():
    assert profile_collectives() == (AlphaBeta(0.0, 0.0), AlphaBeta(0.0, 0.0))  # one rank
    (ar0, ag0), (ar1, ag1) = run_distributed(_collectives, 2, timeout=120)
    assert ar0 == ar1 and ag0 == ag1  # max over ranks: everyone plans with the same numbers
    assert ar0.alpha + ar0.beta > 0 and ag0.alpha + ag0.beta > 0


class _Clock:
    """An injected clock for ``costmodel``'s ``time``: it moves only when told to."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class _Slow:
    """A sparse collective that costs a known ``cost`` seconds per call on top of TopkA, on an
    injected clock (no sleeping, no timing margin)."""

    def __init__(self, clock: _Clock | None = None, cost: float = 0.02):
        from gradsync import collectives

        self.inner, self.calls, self.clock, self.cost = collectives.get("topka"), 0, clock, cost

    def __call__(self, sel, group=None, step=0):
        self.calls += 1
        if self.clock is not None:
            self.clock.now += self.cost
        return self.inner(sel, group=group, step=step)


def _sparse_call(rank, world_size):
    from gradsync.collectives.comm import Comm
    from gradsync.schedule import costmodel

    clock = _Clock()
    costmodel.time = clock  # the pooled ranks restore module globals after the call
    comm, coll = Comm(None), _Slow(clock, cost=0.01 * (rank + 1))
    t = profile_sparse_call(coll, repeats=3, comm=comm)
    return t, coll.calls, comm.stats.bytes_sent


class _Link:
    """A group of ``P`` ranks on an ideal α-β link, on an injected clock: each all-reduce of B
    bytes takes Eq. 4's time, each all-gather of B bytes per rank Eq. 3's (written here from
    the paper's equations, not taken from the code under test); it records every call."""

    def __init__(self, P: int, alpha: float, beta: float, clock: _Clock):
        self.size, self.alpha, self.beta, self.clock = P, alpha, beta, clock
        self.calls: list[tuple[str, int]] = []

    def barrier(self) -> None:
        pass

    def all_reduce(self, t, op=None):
        if op is None:  # the probes; the closing max over the ranks costs nothing here
            B, P = 4 * t.numel(), self.size
            self.calls.append(("allreduce", B))
            self.clock.now += 2 * (P - 1) * self.alpha + 2 * (P - 1) / P * B * self.beta
        return t

    def all_gather(self, t):
        B, P = 4 * t.numel(), self.size
        self.calls.append(("allgather", B))
        self.clock.now += (P - 1) * self.alpha + (P - 1) * B * self.beta
        return t.repeat(P)


@pytest.mark.parametrize("P", [2, 3, 8])
def test_lean_probes_fit_the_same_link_with_fewer_bytes(monkeypatch, P):
    from gradsync.schedule import costmodel

    clock = _Clock()
    monkeypatch.setattr(costmodel, "time", clock)
    alpha, beta = 2e-4, 8e-8  # 100 Mbit/s
    sizes = (1 << 10, 1 << 14, 1 << 17, 1 << 20)
    fits, calls = {}, {}
    for lean in (False, True):
        link = _Link(P, alpha, beta, clock)
        fits[lean] = profile_collectives(sizes=sizes, repeats=5, device="cpu", comm=link,
                                         lean=lean)
        calls[lean] = link.calls
    for ar, ag in fits.values():  # both recover the link exactly
        for fit in (ar, ag):
            assert fit.alpha == pytest.approx(alpha, rel=1e-6)
            assert fit.beta == pytest.approx(beta, rel=1e-6)
    # in full: a warm-up and 5 timed calls of each collective at every size, B bytes each
    assert calls[False] == [(kind, s) for s in sizes for kind in ("allreduce", "allgather")
                            for _ in range(6)]
    # lean: each rank all-gathers B/P bytes (whole fp32 values); 3 timed calls from 128 KB up
    assert calls[True] == [(kind, s if kind == "allreduce" else 4 * (s // (4 * P)))
                           for s in sizes
                           for kind in ("allreduce", "allgather")
                           for _ in range(4 if s >= 1 << 17 else 6)]
    sent = {lean: sum((2 * (P - 1) / P if k == "allreduce" else P - 1) * b
                      for k, b in calls[lean]) for lean in calls}  # bytes on each rank's link
    assert sent[True] < 0.55 * sent[False]  # about half at P = 2, a third at P = 8


def test_lean_probes_too_small_to_divide_are_timed_in_full(monkeypatch):
    from gradsync.schedule import costmodel

    clock = _Clock()
    monkeypatch.setattr(costmodel, "time", clock)
    link = _Link(8, 1e-4, 1e-9, clock)
    _, ag = profile_collectives(sizes=(4, 16), repeats=1, device="cpu", comm=link)
    assert {b for k, b in link.calls if k == "allgather"} == {4, 16}  # not both 4 bytes
    assert ag.beta == pytest.approx(1e-9, rel=1e-6)


def _probe_bytes(rank, world_size, lean):
    from gradsync.collectives.comm import Comm

    comm = Comm(None)
    fit = profile_collectives(sizes=(1 << 10, 1 << 14, 1 << 17), repeats=2, comm=comm,
                              lean=lean)
    return fit, comm.stats.bytes_sent


def test_lean_probes_send_fewer_bytes_and_agree_across_ranks():
    full = run_distributed(_probe_bytes, 3, False, timeout=120)
    lean = run_distributed(_probe_bytes, 3, True, timeout=120)
    for out in (full, lean):
        assert all(fit == out[0][0] for fit, _ in out)  # every rank plans with one fit
    # counted at the torch.distributed calls: the all-gathers carry a third of the bytes
    assert all(b < 0.7 * f for (_, b), (_, f) in zip(lean, full, strict=True))


@pytest.mark.parametrize("P", [2, 3])
def test_profile_sparse_call_times_one_call_alike_on_every_rank(P):
    assert profile_sparse_call(_Slow(), repeats=1) == 0.0  # one rank: nothing to time
    out = run_distributed(_sparse_call, P, timeout=120)
    for t, calls, sent in out:
        # one call of the slowest rank (rank P - 1 costs 10·P ms a call), not the sum of four
        assert t == pytest.approx(0.01 * P) and calls == 4  # a warm-up and three timed calls
        assert sent > 0  # the probes' bytes are counted in the caller's Comm


def test_with_call_cost_prices_the_call_once_per_all_gather():
    ag = AlphaBeta(1e-4, 1e-9)
    for P in (2, 4, 8):
        got = with_call_cost(ag, 5e-3, P)
        assert got.beta == ag.beta
        # a tiny all-gather now costs the measured call: (P - 1)·α′ = 5 ms
        assert (P - 1) * got.alpha == pytest.approx(5e-3)
    assert with_call_cost(ag, 1e-5, 4) == ag  # cheaper than the raw α: unchanged
    assert with_call_cost(ag, 5e-3, 1) == ag
    with pytest.raises(ValueError, match="call_s"):
        with_call_cost(ag, float("nan"), 4)


def test_profile_command_writes_a_cost_model(tmp_path, capsys):
    out = tmp_path / "cm.json"
    from gradsync.apps import profile

    assert profile.main(["--quick", "--model", "mlp", "--out", str(out)]) == 0
    cm = CostModel.from_dict(json.loads(out.read_text()))
    assert cm.P == 1 and len(cm.order) == 6 and cm.info["model"] == "mlp"
    assert "all-gather" in capsys.readouterr().out
    # the planners accept what the profiler wrote
    from gradsync.schedule import make_plan

    plan = make_plan("ssfusion_oi", cm.order, cm.numel, 0.01, cm)
    assert plan.names == cm.order


# ---- issue 14: the collectives' CPU work ------------------------------------------------------
def test_fit_compute_recovers_synthetic_measurements():
    from gradsync.schedule.costmodel import ComputeCost, fit_compute

    rng = random.Random(3)
    ms = [256, 4096, 32768, 131072]
    merge = [2e-5 + 3e-9 * m * (1 + rng.uniform(-0.01, 0.01)) for m in ms]
    codec = [5e-5 + 7e-9 * m * (1 + rng.uniform(-0.01, 0.01)) for m in ms]
    c = fit_compute(4e-4, (ms, merge), (ms, codec))
    assert c.message == 4e-4
    assert c.merge.b == pytest.approx(3e-9, rel=0.03) and c.merge.a == pytest.approx(2e-5,
                                                                                     abs=5e-6)
    assert c.codec.b == pytest.approx(7e-9, rel=0.03) and c.codec.a == pytest.approx(5e-5,
                                                                                     abs=1e-5)
    # 10 messages, 1000 entries merged, 2000 encoded, in 4 calls — priced independently
    expect = 10 * 4e-4 + 4 * c.merge.a + c.merge.b * 1000 + 4 * c.codec.a + c.codec.b * 2000
    assert c.collective(10, merged=1000, encoded=2000, calls=4) == pytest.approx(expect)
    assert ComputeCost.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    with pytest.raises(ValueError, match="message"):
        ComputeCost(message=-1.0)
    with pytest.raises(ValueError):
        fit_compute(float("nan"), (ms, merge), (ms, codec))


def test_cost_model_prices_compute_in_eq3_eq4_and_round_trips():
    from gradsync.schedule.costmodel import ComputeCost

    base = small_model(P=4)
    c = ComputeCost(message=1e-4, merge=AffineFit(1e-5, 2e-9), codec=AffineFit(3e-5, 4e-9))
    cost = small_model(P=4)
    cost.compute = c
    B = 8000  # bytes per rank: 1000 entries of 8 bytes
    # all-reduce: 2(P−1) messages' software cost on top of Eq. 4
    assert cost.t_allreduce(B) - base.t_allreduce(B) == pytest.approx(6 * 1e-4)
    # all-gather (TopkA's call on gloo): Bruck's ⌈log2 4⌉ = 2 rounds of point-to-point
    # messages (no shape check, no counts: the engine's steady state), each at the message's
    # price; P−1 received blocks decoded and merged
    assert cost.startups_allgather(B) == 2 and cost.startups_allreduce() == 6
    # long blocks go round the ring: P − 1 rounds (1 MiB per round the doubling saves)
    assert cost.startups_allgather(2**20) == 3
    assert cost.t_startups_allgather(B) == pytest.approx(2e-4)
    assert cost.t_startups_allgather(2**20) == pytest.approx(3e-4)
    assert base.t_startups_allgather(B) == 0.0
    extra = 2 * 1e-4 + 3 * 1e-5 + 2e-9 * 3000 + 3 * 3e-5 + 4e-9 * 4000
    assert cost.t_allgather(B) - base.t_allgather(B) == pytest.approx(extra)
    back = CostModel.from_dict(json.loads(json.dumps(cost.to_dict())))
    assert back.compute == c and back.t_allgather(B) == pytest.approx(cost.t_allgather(B))
    assert "compute" not in base.to_dict() and CostModel.from_dict(base.to_dict()).compute is None
    one = small_model(P=1)
    one.compute = c
    assert one.t_allgather(B) == 0.0


def test_profile_compute_measures_merge_and_codec():
    from gradsync.schedule.costmodel import profile_compute

    # 2^18 entries and the median of 5: with 2^16 and 2 repeats the codec's fitted slope came
    # out 0 once in a full test run on a loaded 2-core machine (the 64-entry point timed high)
    c = profile_compute(sizes=(64, 4096, 1 << 18), repeats=5, message_s=2e-4, numel=1 << 18)
    assert c.message == 2e-4
    # merging / coding 2^18 entries costs more than 64 of them
    assert c.merge(1 << 18) > c.merge(64) and c.codec(1 << 18) > c.codec(64)
    with pytest.raises(ValueError):
        profile_compute(sizes=(), repeats=1)
