"""Issue 14: the collectives' own CPU per call in the simulator (``gradsync.apps.sim.callcpu``).

The expected figures are written out by hand from the model's definition (compute = messages'
software cost + max(merges and codec, measured CPU); the floor counts the measured CPU
unscaled), not taken from the implementation.
"""

from __future__ import annotations

import json
import math

import pytest

from gradsync.apps.sim import patterns
from gradsync.apps.sim import simulate as sim
from gradsync.apps.sim.callcpu import CollectiveCPU, fit_collective_cpu
from gradsync.apps.sim.contention import Contention
from gradsync.schedule.costmodel import AffineFit, AlphaBeta, ComputeCost, CostModel


def tiny_cost() -> CostModel:
    order = [f"t{i}" for i in range(6)]
    numel = {n: 10_000 * (i + 1) for i, n in enumerate(order)}  # n = 210 000
    return CostModel(P=1, order=order, numel=numel, elem_bytes=4,
                     backward={n: 0.002 for n in order}, sparsify=AffineFit(1e-4, 1e-8),
                     offload=AffineFit(2e-4, 1e-8), allreduce=AlphaBeta(0, 0),
                     allgather=AlphaBeta(0, 0))


MESSAGE, MERGE, CODEC = 3e-4, AffineFit(1e-5, 2e-8), AffineFit(2e-5, 5e-8)


def with_compute() -> CostModel:
    cost = tiny_cost()
    cost.compute = ComputeCost(message=MESSAGE, merge=MERGE, codec=CODEC)
    return cost


# ----------------------------------------------------------------------------- the fit
def test_fit_recovers_a_known_affine_cost():
    c0, c1 = 2.5e-3, 3e-7  # 2.5 ms per call + 0.3 us per entry
    pts = [[m, c0 + c1 * m, 0.0] for m in (1054, 2108, 4216)]
    f = fit_collective_cpu(pts)
    assert f.a == pytest.approx(c0, rel=1e-9) and f.b == pytest.approx(c1, rel=1e-9)
    # symmetric noise around the line: the least-squares fit stays close
    noisy = [[m, c0 + c1 * m + e, 0.0] for m, e in ((1054, 1e-4), (2108, -2e-4), (4216, 1e-4))]
    g = fit_collective_cpu(noisy)
    assert g.a == pytest.approx(c0, abs=2e-4) and g.b == pytest.approx(c1, rel=0.2)
    # CPU falling with the entries (noise) never gives a negative slope: the best constant
    h = fit_collective_cpu([[1000, 4e-3], [4000, 3e-3]])
    assert h.b == 0 and h.a == pytest.approx(3.5e-3)
    # one size: no slope
    assert fit_collective_cpu([[4216, 2e-3]]) == AffineFit(2e-3, 0.0)
    with pytest.raises(ValueError, match="at least one"):
        fit_collective_cpu([])
    with pytest.raises(ValueError, match="cpu_s"):
        fit_collective_cpu([[1000, float("nan")]])
    with pytest.raises(ValueError, match="cpu_s"):
        fit_collective_cpu([[1000, -1e-3]])


def test_table_by_P_and_collective():
    t = CollectiveCPU.from_samples(4, {"topka": [[1000, 3e-3, 9e-3], [4000, 6e-3, 20e-3]]})
    f = t.fit("topka", 4)
    assert f.a == pytest.approx(2e-3) and f.b == pytest.approx(1e-6)
    assert t.seconds("topka", 4, 2000) == pytest.approx(4e-3)
    assert t.fit("topka", 8) is None and t.seconds("oktopk", 4, 1000) is None
    u = t.merged(CollectiveCPU.from_samples(8, {"oktopk": [[1000, 7e-3], [2000, 8e-3]]}))
    assert sorted(u.fits) == [4, 8] and u.seconds("oktopk", 8, 3000) == pytest.approx(9e-3)
    assert "topka 2.00 ms + 1000.0 ns/entry" in u.describe(4)


# ----------------------------------------------------------------------------- JSON
def test_json_round_trip_and_bad_values_rejected():
    t = CollectiveCPU.from_samples(4, {"topka": [[1000, 3e-3, 9e-3], [4000, 6e-3, 20e-3]],
                                       "oktopk": [[1000, 7e-3, 30e-3], [4000, 7e-3, 31e-3]]})
    d = json.loads(json.dumps(t.to_dict()))
    assert set(d) == {"4"} and set(d["4"]) == {"oktopk", "topka"}
    back = CollectiveCPU.from_dict(d)
    assert back == t and back.to_dict() == t.to_dict()
    good = {"a": 1e-3, "b": 1e-7}
    for bad, msg in (([], "mapping"), ({"zero": {"topka": good}}, "positive integer"),
                     ({"0": {"topka": good}}, "positive integer"),
                     ({"4": {"topka": {"a": 1e-3}}}, "'b'"),
                     ({"4": {"topka": {"a": -1e-3, "b": 0}}}, r"\['topka'\]\.a"),
                     ({"4": {"topka": {"a": float("nan"), "b": 0}}}, "finite"),
                     ({"4": {"topka": {"a": "fast", "b": 0}}}, "number of seconds"),
                     ({"4": {"topka": good | {"samples": [[1]]}}}, "samples"),
                     ({"4": ["topka"]}, "mapping collective")):
        with pytest.raises(ValueError, match=msg):
            CollectiveCPU.from_dict(bad)


def test_simulate_reads_it_from_the_cost_model_json(tmp_path, capsys):
    """The profile JSON carries ``collective_cpu`` next to the other terms; simulate uses it
    at the measured P only; a bad one is refused naming the file."""
    cost = with_compute()
    k = round(0.01 * 210_000)
    calls = CollectiveCPU.from_samples(4, {"topka": [[k // 4, 0.020], [k, 0.020]]})
    path = tmp_path / "cm.json"
    path.write_text(json.dumps(cost.to_dict() | {"collective_cpu": calls.to_dict()}))
    assert sim.main(["--cost-model", str(path), "--schemes", "topka", "--workers", "2,4",
                     "--out", str(tmp_path / "o")]) == 0
    assert "measured at P=4" in capsys.readouterr().out
    rows = json.loads((tmp_path / "o" / "simulate.json").read_text())["rows"]
    assert rows[0]["collective_cpu_s"] is None
    assert rows[1]["collective_cpu_s"] == pytest.approx(0.020)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(cost.to_dict() | {"collective_cpu": {"4": {"topka": {
        "a": -1, "b": 0}}}}))
    with pytest.raises(ValueError, match=r"--cost-model .*bad\.json.*topka"):
        sim.main(["--cost-model", str(bad), "--out", str(tmp_path / "b")])


# ----------------------------------------------------------------------------- prediction
@pytest.mark.parametrize("P", [2, 4, 8])
def test_one_buffer_prediction_grows_by_exactly_the_measured_cpu_over_the_micro_terms(P):
    """TopkA on the tiny model (n = 210 000, k = 2 100): the micro terms are one merge of P·k
    and one codec of 2(P − 1)·k entries per payload step (as in test_sim); a measured 20 ms
    per call replaces them, the messages' software cost stays."""
    cost = with_compute()
    net = sim.Network(50e-6, 8 / 1e9)
    k = 2100
    rounds = P - 1 if P < 4 else int(math.log2(P))  # gradsync's all-gather on gloo
    micro = (rounds * MERGE.a + MERGE.b * P * k + rounds * CODEC.a
             + CODEC.b * 2 * (P - 1) * k)
    msg = rounds * MESSAGE
    calls = CollectiveCPU.from_samples(P, {"topka": [[k // 4, 0.010 + 1e-6 * (k // 4)],
                                                     [k, 0.010 + 1e-6 * k]]})
    cpu = 0.010 + 1e-6 * k
    old = sim.predict("topka", cost, P, net, 0.01, forward_s=0.004, step_s=0.001)
    new = sim.predict("topka", cost, P, net, 0.01, forward_s=0.004, step_s=0.001,
                      collective_cpu=calls)
    assert old["compute_s"] == pytest.approx(msg + micro)
    assert new["compute_s"] == pytest.approx(msg + cpu)
    assert new["iteration_s"] - old["iteration_s"] == pytest.approx(cpu - micro)
    assert new["link_s"] == old["link_s"] and new["collective_cpu_s"] == pytest.approx(cpu)
    assert old["collective_cpu_s"] is None
    # a measured CPU below the micro terms does not lower the prediction (a floor)
    low = CollectiveCPU.from_samples(P, {"topka": [[k, micro / 10]]})
    assert sim.predict("topka", cost, P, net, 0.01, collective_cpu=low)["compute_s"] == \
        pytest.approx(msg + micro)
    # measured at another P, or for another collective: no change
    other = CollectiveCPU.from_samples(P + 1, {"topka": [[k, 1.0]]})
    other = other.merged(CollectiveCPU.from_samples(P, {"oktopk": [[k, 1.0]]}))
    assert sim.predict("topka", cost, P, net, 0.01, forward_s=0.004, step_s=0.001,
                       collective_cpu=other) == old


def test_fusion_buffers_pay_the_measured_cpu_per_sparse_all_gather():
    """SSFusion-OI's sparse buffers run TopkA: each all-gather buffer of m entries per rank
    costs max(its merges and codec, a + b·m) more than its start-ups; the plan is unchanged.
    Free links, so every buffer's end moves by its compute."""
    cost = with_compute()
    net = sim.Network(0.0, 1e-15)
    P = 4
    a, b = 0.030, 1e-6
    calls = CollectiveCPU.from_samples(P, {"topka": [[100, a + b * 100], [2000, a + b * 2000]]})
    old = sim.predict("ssfusion_oi", cost, P, net, 0.01)
    new = sim.predict("ssfusion_oi", cost, P, net, 0.01, collective_cpu=calls)
    plan_old = (old["buffers"], old["volume_bytes"], old["messages"])
    assert (new["buffers"], new["volume_bytes"], new["messages"]) == plan_old
    # the sparse buffers' entries from the predicted volume: Σ ag_bytes·(P − 1) bytes sent
    from gradsync.apps.sim.predict import at_scale
    from gradsync.schedule import make_plan
    from gradsync.schedule import simulate as timeline

    c = at_scale(cost, P, net)
    plan = make_plan("ssfusion_oi", list(c.order), c.numel, 0.01, c, elem_bytes=4,
                     bucket_bytes=25 * 2**20, min_density=0.001)
    ag = [bf["ag_bytes"] for bf in timeline(plan, c).buffers if "ag_start" in bf]
    assert ag, "the tiny model's SSFusion-OI plan has a sparse buffer"
    extra = 0.0
    for nb in ag:
        m = nb / 8
        micro = ((P - 1) * MERGE.a + MERGE.b * (P - 1) * m + (P - 1) * CODEC.a
                 + CODEC.b * P * m)
        extra += max(micro, a + b * m) - micro
    assert new["compute_s"] - old["compute_s"] == pytest.approx(extra)
    assert new["collective_cpu_s"] == pytest.approx(sum(a + b * nb / 8 for nb in ag))
    assert new["iteration_s"] >= old["iteration_s"] + 0.030 - 1e-12
    # dense schemes have no sparse collective: no change
    assert sim.predict("dense_ovlp", cost, P, net, 0.01, collective_cpu=calls) == \
        sim.predict("dense_ovlp", cost, P, net, 0.01)


def test_contention_floor_counts_the_measured_cpu_instead_of_micro_terms_and_calls():
    """Ok-Topk at P = 4 on 2 cores, a profile of one rank alone (σ = 1): W = forward 10 ms +
    Σ T_b 12 ms + T_sparsify(210 000) 2.2 ms + step 1 ms = 25.2 ms without the micro terms;
    the measured 8 ms per call replaces the micro terms and every call of a step, and only the
    amortised small calls (1/64 + 2/32 at the default rates: the boundaries' all-reduce and the
    exact threshold's all-gather, Bruck's 2 rounds on gloo, Work.amortised_calls) still pay
    the 8-byte call's 1 ms: floor = 4·(25.2 + 8 + (1/64 + 2/32)·1) / 2 ms."""
    cost = with_compute()
    net = sim.Network(1e-6, 8 / 1e10)
    P, k = 4, 2100
    cont = Contention(cores=2, share=1.0, call_cpu_s=1e-3)
    calls = CollectiveCPU.from_samples(P, {"oktopk": [[k, 0.008]]})
    kw = {"forward_s": 0.010, "step_s": 0.001, "contention": cont}
    old = sim.predict("oktopk", cost, P, net, 0.01, **kw)
    new = sim.predict("oktopk", cost, P, net, 0.01, collective_cpu=calls, **kw)
    steps = patterns.pattern("oktopk", P, 210_000, k)
    w = patterns.work("oktopk", steps, P, k)
    assert w.amortised_calls == pytest.approx(1 / 64 + 2 / 32)
    assert new["dist_calls"] == pytest.approx(w.amortised_calls)
    assert new["cpu_work_s"] == pytest.approx(0.0252)
    assert new["cpu_floor_s"] == pytest.approx(4 * (0.0252 + 0.008 + w.amortised_calls * 1e-3)
                                               / 2)
    assert old["dist_calls"] == pytest.approx(w.dist_calls)
    assert old["cpu_work_s"] > 0.0252  # the micro terms were in W
    assert new["iteration_s"] == pytest.approx(max(new["sync_end_s"] + 0.011,
                                                   new["cpu_floor_s"]))
    # a profile taken with all 4 ranks busy (σ = 2/4) scales the profiled wall work W, not
    # the measured CPU: floor = 4·(0.5·25.2 + 8 + amortised·1) / 2 ms
    busy = sim.predict("oktopk", cost, P, net, 0.01, forward_s=0.010, step_s=0.001,
                       contention=Contention(cores=2, call_cpu_s=1e-3), collective_cpu=calls)
    assert busy["cpu_floor_s"] == pytest.approx(
        4 * (0.5 * 0.0252 + 0.008 + w.amortised_calls * 1e-3) / 2)
    # before: the micro terms in W and every call at the 8-byte call's CPU
    assert old["cpu_floor_s"] == pytest.approx(4 * (old["cpu_work_s"] + w.dist_calls * 1e-3) / 2)
    assert math.isfinite(new["iteration_s"])


def test_a_one_buffer_collective_on_fewer_cores_than_ranks_takes_p_over_c_of_its_cpu():
    """A one-buffer collective starts after every rank's backward pass, and then every rank runs
    the call's CPU at once: on C < P cores that takes P/C times the CPU in wall time (the
    validation runs' in-collective time at P = 8 on 2 cores was 1.4–2.2× the prediction
    without it). Ok-Topk at P = 4, 8 ms of CPU per call: 16 ms on 2 cores, 8 ms on 4 cores or
    more and without contention. The micro terms scale alike; the floor does not change."""
    cost = with_compute()
    net = sim.Network(1e-6, 8 / 1e10)
    P, k = 4, 2100
    calls = CollectiveCPU.from_samples(P, {"oktopk": [[k, 0.008]]})
    kw = {"forward_s": 0.010, "step_s": 0.001, "collective_cpu": calls}

    def on(cores: float | None, **more) -> dict:
        cont = None if cores is None else Contention(cores=cores, share=1.0, call_cpu_s=1e-3)
        return sim.predict("oktopk", cost, P, net, 0.01, contention=cont, **(kw | more))

    alone = on(None)
    assert on(2)["compute_s"] - alone["compute_s"] == pytest.approx(0.008)
    assert on(1)["compute_s"] - alone["compute_s"] == pytest.approx(3 * 0.008)
    assert on(4)["compute_s"] == pytest.approx(alone["compute_s"])
    assert on(16)["compute_s"] == pytest.approx(alone["compute_s"])
    assert on(2)["comm_s"] - alone["comm_s"] == pytest.approx(0.008)
    assert on(2)["cpu_floor_s"] == pytest.approx(4 * (0.0252 + 0.008 + (1 / 64 + 2 / 32) * 1e-3)
                                                 / 2)
    # without a measured CPU per call, the merges and codec (micro) scale the same way
    micro = on(None, collective_cpu=None)
    msg = micro["rounds"] * cost.compute.message
    assert on(2, collective_cpu=None)["compute_s"] == pytest.approx(
        msg + 2 * (micro["compute_s"] - msg))


def test_work_separates_the_amortised_calls():
    n, k = 1_000_000, 10_000
    ok = patterns.pattern("oktopk", 8, n, k, oktopk_exact_rate=1.0)
    w = patterns.work("oktopk", ok, 8, k)
    # on gloo: the exact θ's all-gather in 3 rounds, the boundaries' all-reduce every 64 steps;
    # the 13 steps' messages (no shape check: the engine's steady state)
    assert w.amortised_calls == pytest.approx(3 + 1 / 64)
    assert w.dist_calls - w.amortised_calls == pytest.approx(13)
    assert patterns.work("topka", patterns.pattern("topka", 8, n, k), 8, k).amortised_calls == 0


# ----------------------------------------------------------------------------- profiling
def test_profile_collective_cpu_on_two_ranks():
    from gradsync.testing import run_distributed

    res = run_distributed(_profile_rank, 2)
    assert [r[0] for r in res] == [res[0][0]] * 2  # the maximum over ranks on both
    out, sends = res[0]
    # dense_ovlp has no sparse collective; Gaussian-k's TopkA gathers counts first
    assert set(out) == {"topka", "gaussiank", "oktopk"}
    for pts in out.values():
        assert [p[0] for p in pts] == [25, 50, 100]  # k/4, k/2, k of n = 10 000 at 1 %
        for _, cpu, wall in pts:
            assert 0 < cpu < 1 and 0 < wall < 5
    # called as the engine calls them: each size's description agreed once (one small
    # all-reduce, at its first call), then at P = 2 one message a call (TopkA at its
    # capacity, Ok-Topk's one exchange), two for Gaussian-k (its count, then its entries)
    for name, per_call in (("topka", 1), ("oktopk", 1), ("gaussiank", 2)):
        assert sends[name] == {"isend": 3 * (1 + 3) * per_call, "all_reduce": 3 + 1}, name


def _profile_rank(rank, world_size):
    import collections

    import torch
    import torch.distributed as dist

    from gradsync.apps.sim.callcpu import profile_collective_cpu

    flat = torch.randn(10_000, generator=torch.Generator().manual_seed(rank))
    calls: collections.Counter = collections.Counter()
    real = {op: getattr(dist, op) for op in ("isend", "all_reduce")}

    def counted(op):
        def call(*a, **k):
            calls[op] += 1
            return real[op](*a, **k)
        return call

    out, sends = {}, {}
    try:
        for op in real:
            setattr(dist, op, counted(op))
        for scheme in ("topka", "gaussiank", "oktopk"):  # one at a time, to count each
            calls.clear()
            out.update(profile_collective_cpu(["dense_ovlp", scheme], flat, 0.01, repeats=3))
            sends[scheme] = dict(calls)
    finally:
        for op, fn in real.items():
            setattr(dist, op, fn)
    return out, sends


def test_profile_command_stores_it_and_simulate_uses_it(tmp_path, capsys):
    """``python -m gradsync profile --world-size 2`` runs the schemes' collectives on the
    model's gradient and writes ``collective_cpu`` beside the other terms; simulate at P = 2
    then prices TopkA's call with it."""
    from gradsync.apps import profile

    out = tmp_path / "cm.json"
    assert profile.main(["--quick", "--model", "mlp", "--world-size", "2", "--device", "cpu",
                         "--collective-cpu", "topka,oktopk", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    calls = CollectiveCPU.from_dict(doc["collective_cpu"])
    assert sorted(calls.fits) == [2] and sorted(calls.fits[2]) == ["oktopk", "topka"]
    for pts in calls.samples[2].values():
        assert len(pts) == 3 and all(0 < s[1] < 1 for s in pts)
    assert "collectives' CPU per call at P=2" in capsys.readouterr().out
    assert sim.main(["--cost-model", str(out), "--schemes", "topka", "--workers", "2,4",
                     "--density", "0.01", "--out", str(tmp_path / "o")]) == 0
    rows = json.loads((tmp_path / "o" / "simulate.json").read_text())["rows"]
    n = sum(doc["numel"].values())
    k = max(1, round(0.01 * n))
    assert rows[0]["collective_cpu_s"] == pytest.approx(calls.seconds("topka", 2, k))
    assert rows[1]["collective_cpu_s"] is None
    with pytest.raises(ValueError, match="unknown"):
        profile.main(["--quick", "--collective-cpu", "nope", "--out", str(tmp_path / "x")])
