"""The DDP comm hook: same loss curve as plain DDP at density 1, sparse training consistent,
(state, hook) form, bucket rebuilds, no_sync, bad schemes; the engine's compensation and
seeding rule; the Stateful protocol (identity, state_dict checks)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsync.integrations.ddp
from conftest import image_batch, probe_bytes_at_two_ranks
from gradsync import sparsify
from gradsync.apps.models import build
from gradsync.engine.config import Config
from gradsync.engine.consistency import parameter_digest
from gradsync.engine.state import Identity, Stateful
from gradsync.integrations.ddp import HookState, _densities
from gradsync.testing import run_distributed


def _train(rank, world_size, scheme, density, steps, use_hook, small_numel):
    model = build("cnn", seed=4)
    # small buckets so that several buckets (and a rebuild after iteration 0) are exercised
    ddp = DDP(model, bucket_cap_mb=0.1)
    state = None
    if use_hook == "register":
        state = gradsync.ddp.register(ddp, Config(scheme=scheme, density=density,
                                                  sparsifier="topk"), small_numel=small_numel)
    elif use_hook == "pair":
        state, fn = gradsync.ddp.hook(Config(scheme=scheme, density=density, sparsifier="topk"),
                                      model=model, small_numel=small_numel)
        ddp.register_comm_hook(state, fn)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    losses = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        if step == 2:  # gradient accumulation: the hook is not called inside no_sync
            with ddp.no_sync():
                x, y = image_batch(rank, 1000 + step, 16)
                nn.functional.cross_entropy(ddp(x), y).backward()
        x, y = image_batch(rank, step, 16)
        loss = nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    stats = state.stats() if state is not None else None
    if state is not None:
        stats["seeds"] = {n: sp.seed for n, sp in state.sparsifiers.items()}
    return losses, parameter_digest(model)[0], stats


@pytest.mark.usefixtures("kernels")
@pytest.mark.accelerator_at(scheme='per_tensor')
@pytest.mark.parametrize("scheme", ["per_tensor", "ssfusion", "ssfusion_oi", "dense"])
def test_density_one_matches_plain_ddp(scheme):
    ref = run_distributed(_train, 2, scheme, 1.0, 8, None, 1000, timeout=300)
    got = run_distributed(_train, 2, scheme, 1.0, 8, "register", 1000, timeout=300)
    for (lr, _, _), (lg, _, stats) in zip(ref, got):
        assert max(abs(a - b) for a, b in zip(lr, lg)) < 1e-4, (lr, lg)
        assert stats["calls"] > 0


@pytest.mark.usefixtures("kernels")
@pytest.mark.accelerator_at(world_size=3)
@pytest.mark.parametrize("world_size", [2, 3])
def test_sparse_hook_keeps_replicas_identical(world_size):
    out = run_distributed(_train, world_size, "ssfusion_oi", 0.01, 12, "pair", 1000,
                          timeout=300)
    assert len({o[1] for o in out}) == 1
    for rank, (_, _, stats) in enumerate(out):
        assert stats["missing_rate"] == 0.0  # selective sparsification never drops a tensor
        assert stats["total"]["bytes_sent"] > 0
        # the engine's seeding rule: run seed, parameter name and rank mixed
        assert stats["seeds"] and all(seed == sparsify.seed_for(0, n, rank)
                                      for n, seed in stats["seeds"].items())
    seeds = [set(o[2]["seeds"].values()) for o in out]
    assert len(seeds[0]) == len(out[0][2]["seeds"])  # every tensor its own stream ...
    assert not seeds[0] & seeds[1]  # ... and every rank
    # sparse training still learns on real-ish data: the loss goes down on average
    losses = out[0][0]
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 + 0.5


def _threaded(rank: int, world_size: int, scheme: str, inline: bool, unused: bool) -> dict:
    """The hook over several buckets (a CNN, 0.1 MB buckets) with momentum and clipping, its
    sparse buckets' collectives on its communication thread, or (``inline``) in the hook as
    on an accelerator's kernels, the CPU's own kernels either way; ``unused``: DDP's
    ``find_unused_parameters`` (the Trainer's default), whose own all-reduce follows the last
    bucket."""
    import threading

    from gradsync.engine import pipeline
    from gradsync.schedule import costmodel

    costmodel.cores_per_rank = lambda: 4.0  # a spare core: SSFusion-I's split (hook_interleaves)
    if inline:  # the only difference: _send's choice of thread
        pipeline.host_kernels = lambda t: False
    model = build("cnn", seed=4)
    ddp = DDP(model, bucket_cap_mb=0.1, find_unused_parameters=unused)
    state = gradsync.ddp.register(ddp, Config(scheme=scheme, density=0.02, momentum=0.9,
                                              clip_norm=1.0, budget="blend"), small_numel=1000)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    calls = []
    for step in range(6):
        opt.zero_grad(set_to_none=True)
        x, y = image_batch(rank, step, 16)
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        calls.append(state.stats()["calls"])
    names = {t.name for t in threading.enumerate()}
    return {"digest": parameter_digest(model)[0], "residual": state.ef.state_dict(),
            "calls": calls, "missing": state.counts.missing,
            "bytes": {k: v for k, v in state.stats()["total"].items() if k != "seconds"},
            "thread": state.scratch.thread is not None,
            "named": any(n.startswith("gradsync-hook") for n in names)}


@pytest.mark.parametrize("world_size,scheme,unused", [(2, "ssfusion_oi", False),
                                                      (3, "per_tensor", True)])
def test_sparse_buckets_on_the_hooks_thread_train_bit_for_bit_as_in_the_hook(world_size,
                                                                               scheme, unused):
    """The hook's communication thread changes where a sparse bucket's collectives run, not
    what they compute: parameters, residuals, bytes and missing tensors bit for bit as when
    every bucket runs in the hook, over several buckets per step; the thread is used only
    there (CPU's own kernels, P > 1)."""
    threaded = run_distributed(_threaded, world_size, scheme, False, unused, timeout=300)
    inline = run_distributed(_threaded, world_size, scheme, True, unused, timeout=300)
    for t, i in zip(threaded, inline):
        assert t["thread"] and t["named"] and not i["thread"]
        assert t["digest"] == i["digest"] and t["calls"] == i["calls"]
        assert t["calls"][1] - t["calls"][0] > 1, t["calls"]  # several buckets a step
        # the same bytes; on the thread's side the step's all-reduce parts are summed in one
        # call at its last bucket (engine/pipeline.py, "Merged buckets"): fewer messages
        assert {k: v for k, v in t["bytes"].items() if k != "messages"} == {
            k: v for k, v in i["bytes"].items() if k != "messages"}
        assert (t["bytes"]["messages"] < i["bytes"]["messages"]) == (scheme == "ssfusion_oi")
        assert t["missing"] == i["missing"]
        assert t["residual"].keys() == i["residual"].keys()
        for k in t["residual"]:
            a, b = t["residual"][k], i["residual"][k]
            if isinstance(a, dict):
                assert a.keys() == b.keys()
                assert all(torch.equal(a[n], b[n]) for n in a), k
    assert len({t["digest"] for t in threaded}) == 1


def _thread_fails(rank: int, world_size: int) -> dict:
    """A sparse bucket's collective raises on the hook's thread at step 2 (every rank alike)."""
    from gradsync.engine import pipeline

    real = pipeline.BufferPipeline._launch

    def launch(self, parts, here):
        if self.owner.counts.steps == 2 and not self.last:
            raise RuntimeError("injected: the peer is gone")
        return real(self, parts, here)

    pipeline.BufferPipeline._launch = launch
    model = build("cnn", seed=4)
    ddp = DDP(model, bucket_cap_mb=0.1)
    state = gradsync.ddp.register(ddp, Config(scheme="per_tensor", density=0.02, momentum=0.9),
                                  small_numel=1000)
    out: dict = {"errors": []}
    for step in range(5):
        if step == 2:
            before = {k: v.clone() for k, v in state.ef.state_dict()["residual"].items()}
            sent = state.stats()["total"]["bytes_sent"]
        ddp.zero_grad(set_to_none=True)
        x, y = image_batch(rank, step, 16)
        try:
            nn.functional.cross_entropy(ddp(x), y).backward()
        except Exception as e:  # the injected error, through DDP
            out["errors"].append((step, str(e)))
        if step == 2:
            after = state.ef.state_dict()["residual"]
            out["kept"] = before.keys() == after.keys() and all(
                torch.equal(before[k], after[k]) for k in before)
            out["sent_in_failed_step"] = state.stats()["total"]["bytes_sent"] - sent
    out["steps"] = state.counts.steps
    out["digest"] = parameter_digest(model)[0]
    return out


def test_a_collective_that_fails_on_the_hooks_thread_fails_backward_and_abandons_the_step():
    """A collective raising on the hook's thread fails that step's ``backward()`` on every
    rank (its bucket's future and the last one's); the last bucket sends nothing of its own,
    error feedback stays as before the step, and the next steps train (replicas alike)."""
    out = run_distributed(_thread_fails, 2, timeout=300)
    for r in out:
        assert [s for s, _ in r["errors"]] == [2], [e[:300] for _, e in r["errors"][1:]]
        assert "injected: the peer is gone" in r["errors"][0][1]
        assert r["kept"] and r["steps"] == 5
    assert out[0]["digest"] == out[1]["digest"]


def test_hook_rejects_engine_only_schemes():
    with pytest.raises(ValueError, match="DDP hook supports"):
        HookState(cfg=Config(scheme="oktopk"))
    with pytest.raises(ValueError):
        HookState(cfg=Config(scheme="per_tensor"), small_numel=-1)
    # the table of schemes decides which schemes have a hook
    assert set(gradsync.ddp.DDP_SCHEMES) == {"dense", "per_tensor", "ssfusion", "ssfusion_oi",
                                             "auto"}


def _sent(numels, ds):
    """Entries a bucket sends, counted with the sparsifier contract k = max(1, round(d·n))."""
    return sum(n if d is None else max(1, round(d * n)) for n, d in zip(numels, ds))


def test_compensation_keeps_bucket_budget():
    numels = [200_000, 300_000, 50, 1000, 64]
    # the pooled budget (the family's default): one selection per bucket, nothing whole
    pooled = HookState(cfg=Config(scheme="ssfusion", density=0.01, min_density=0.001))
    assert _densities(pooled, numels) == [0.01] * 5
    # the blended one: §IV-B's selective sparsification, compensated
    state = HookState(cfg=Config(scheme="ssfusion", density=0.01, min_density=0.001,
                                 budget="blend"))
    ds = _densities(state, numels)
    assert ds[2] is ds[3] is ds[4] is None and ds[0] == ds[1]
    assert 0.001 < ds[0] < 0.01
    # the bucket sends density × bucket numel entries, up to the rounding of each k
    assert abs(_sent(numels, ds) - 0.01 * sum(numels)) <= 1
    # small tensors that would exceed the budget are sparsified instead (the large one alone
    # cannot absorb them even at the floor): the density holds
    ds = _densities(state, [200_000, 90_000, 90_000])
    assert ds == [0.01, 0.01, 0.01]
    # and those the budget can absorb stay whole, smallest first, within a quarter of it
    # (ssfusion.WHOLE_SHARE): 1000 of 5040 entries is, 4000 is not
    ds = _densities(state, [200_000, 300_000, 1000, 3000])
    assert ds[2] is None and 0.001 < ds[0] == ds[1] == ds[3] < 0.01
    ds = _densities(state, [2_000_000, 300_000, 1000, 3000])
    assert ds[2] is ds[3] is None and 0.001 < ds[0] == ds[1] < 0.01
    # nothing to compensate: density unchanged; nothing large: everything dense
    assert _densities(state, [200_000, 300_000]) == [0.01, 0.01]
    # two tensors of k = 1 that would take the whole budget: SSFusion's min_k (8) yields to it
    # (ssfusion.starved: over half of it), and they are sparsified; min_k sends them whole
    # where the budget has room (the 50 and 64 of the first model above)
    assert _densities(state, [50, 64]) == [0.01, 0.01]
    assert _densities(state, [50, 64, 200_000])[:2] == [None, None]
    # per_tensor: every tensor at the density but those it would sparsify to fewer than
    # Config.min_k = 8 entries (50 and 64 entries: k = 1), which travel whole
    pt = HookState(cfg=Config(scheme="per_tensor", density=0.01))
    assert _densities(pt, numels) == [0.01, 0.01, None, 0.01, None]
    assert _densities(HookState(cfg=Config(scheme="per_tensor", density=0.01, min_k=11)),
                      numels) == [0.01, 0.01, None, None, None]  # 1000 entries: k = 10
    every = HookState(cfg=Config(scheme="per_tensor", density=0.01, min_k=1))
    assert _densities(every, numels) == [0.01] * 5


def _bucket_bytes(rank, world_size, scheme, cores=4.0, budget="blend"):
    from gradsync.collectives.comm import Comm
    from gradsync.schedule import costmodel

    costmodel.cores_per_rank = lambda: cores  # cores per rank: a spare one, or none
    reduced = []  # the entries of every floating-point all-reduce (SSFusion-I's Buffer_AR)
    orig = Comm.all_reduce

    def counted(self, tensor, *args, **kwargs):
        if tensor.is_floating_point():
            reduced.append(tensor.numel())
        return orig(self, tensor, *args, **kwargs)

    Comm.all_reduce = counted
    model = build("cnn", seed=4)
    ddp = DDP(model, bucket_cap_mb=25)  # one bucket: one hook call per step
    state = gradsync.ddp.register(ddp, Config(scheme=scheme, density=0.01, sparsifier="topk",
                                              density_warmup=(),  # 1 % from the first step
                                              budget=budget), small_numel=1000)
    sent = []
    for step in range(2):
        ddp.zero_grad(set_to_none=True)
        x, y = image_batch(rank, step, 16)
        nn.functional.cross_entropy(ddp(x), y).backward()
        sent.append(state.counts.last.bytes_sent)
    return sent, sum(p.numel() for p in model.parameters()), reduced


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("scheme", ["ssfusion", "ssfusion_oi"])
def test_ssfusion_hooks_send_the_target_bytes(scheme, world_size):
    """Each rank sends, counted at the torch.distributed calls, what every tensor at 1 % through
    the all-gather would: (P − 1) · 8 bytes per entry, 1 % of the CNN's entries. ``ssfusion_oi``
    all-reduces its unsparsified tensors (522 entries here); charged as all-gathered entries
    they would leave its weights 6–9 % of that budget short."""
    for sent, numel, reduced in run_distributed(_bucket_bytes, world_size, scheme,
                                                timeout=180):
        target = 0.01 * numel * 8 * (world_size - 1)
        assert all(abs(b - target) <= 0.005 * target for b in sent), (sent, target)
        assert reduced == ([522] * 2 if scheme == "ssfusion_oi" else []), reduced


def test_ssfusion_oi_hook_pooled_sends_the_target_bytes_all_gathered():
    """The pooled budget (the family's default): every tensor in its bucket's pool, so the
    same bytes with nothing all-reduced (SSFusion-I's Buffer_AR is empty)."""
    for sent, numel, reduced in run_distributed(_bucket_bytes, 3, "ssfusion_oi", 4.0, "pooled",
                                                timeout=180):
        target = 0.01 * numel * 8 * 2
        assert all(abs(b - target) <= 0.005 * target for b in sent), (sent, target)
        assert reduced == [], reduced


@pytest.mark.parametrize("world_size", [2, 3])
def test_without_a_spare_core_the_hook_sends_ssfusion_i_whole_tensors_in_the_all_gather(
        world_size):
    """Where each rank has less than a core beside its training thread
    (``schedule.costmodel.spare_core``: a CPU host, fewer than 2 cores per rank), SSFusion-I's
    all-reduce part cannot run beside the backward: the hook sends the tensors it would
    all-reduce as values in the all-gather (no floating-point all-reduce at all), charged as
    all-gathered entries, so each rank still sends the target's bytes (the engine's cost model
    weighs the same split: ``schedule/ssfusion.py``, "No core of its own")."""
    for sent, numel, reduced in run_distributed(_bucket_bytes, world_size, "ssfusion_oi", 1.0,
                                                timeout=180):
        target = 0.01 * numel * 8 * (world_size - 1)
        assert all(abs(b - target) <= 0.005 * target for b in sent), (sent, target)
        assert reduced == [], reduced


def test_sparsifiers_seeded_per_tensor():
    state = HookState(cfg=Config(scheme="per_tensor", density=0.05, sparsifier="randomk",
                                 seed=3))
    a, b = state.parts.sparsifier("w1", 0.05), state.parts.sparsifier("w2", 0.05)
    assert (a.seed, b.seed) == (sparsify.seed_for(3, "w1", 0), sparsify.seed_for(3, "w2", 0))
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(0))
    assert not torch.equal(a.select(x).indices, b.select(x).indices)  # independent streams


def _filled_state(cfg, model, small_numel=1000):
    """A hook state that holds residuals and generators, filled without a process group."""
    state, _ = gradsync.ddp.hook(cfg, model=model, small_numel=small_numel)
    g = torch.Generator().manual_seed(5)
    for name, p in model.named_parameters():
        acc = state.ef.accumulate(name, torch.randn(p.numel(), generator=g))
        sel = state.parts.sparsifier(name, cfg.density).select(acc)
        state.ef.update(name, acc, sel.indices)
    return state


def test_hook_state_round_trip_and_checks():
    cfg = Config(scheme="ssfusion_oi", density=0.05, sparsifier="randomk", momentum=0.9)
    model = build("mlp", seed=1)
    state = _filled_state(cfg, model)
    assert isinstance(state, Stateful)
    assert state.identity() == Identity("ddp_hook:ssfusion_oi", 0, 1, None)
    sd = state.state_dict()
    assert (sd["rank"], sd["world_size"], sd["config"]) == (0, 1, cfg.to_dict())
    fresh, _ = gradsync.ddp.hook(cfg, model=build("mlp", seed=2), small_numel=1000)
    fresh.load_state_dict(sd)
    x = torch.randn(5000, generator=torch.Generator().manual_seed(1))
    for name, _ in model.named_parameters():
        want, got = state.ef.state_dict(), fresh.ef.state_dict()
        assert torch.equal(want["residual"][name], got["residual"][name])
        assert torch.equal(want["velocity"][name], got["velocity"][name])
        # the generators continue where they were
        assert torch.equal(state.sparsifiers[name].select(x).indices,
                           fresh.sparsifiers[name].select(x).indices)
    before = {k: v.clone() for k, v in fresh.ef.state_dict()["residual"].items()}
    bad = [({**sd, "rank": 1}, "rank 1"), ({**sd, "world_size": 2}, "2 ranks"),
           ({**sd, "config": {**sd["config"], "density": 0.1}}, "density"),
           ({**sd, "config": {**sd["config"], "seed": 7}}, "seed"),
           ({**sd, "small_numel": 5}, "small_numel"),
           ({**sd, "params": {**sd["params"], "net.1.weight": [1, 2]}}, "different model"),
           ({"feedback": sd["feedback"]}, "rank/world_size")]
    for state_dict, match in bad:
        with pytest.raises(ValueError, match=match):
            fresh.load_state_dict(state_dict)
    other, _ = gradsync.ddp.hook(Config(scheme="per_tensor", density=0.05,
                                        sparsifier="randomk", momentum=0.9), model=model,
                                 small_numel=1000)
    with pytest.raises(ValueError, match="scheme"):
        other.load_state_dict(sd)
    after = fresh.ef.state_dict()["residual"]
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing changed


def _auto_hook_traffic(rank: int, world_size: int) -> list[int]:
    model = build("mlp", seed=1)
    ddp = DDP(model, bucket_cap_mb=25)  # one bucket: one hook call per step
    state = gradsync.ddp.register(ddp, Config(scheme="auto", density=0.05, sparsifier="topk"))
    sent = []
    for step in range(2):
        ddp.zero_grad(set_to_none=True)
        x, y = image_batch(rank, step)
        nn.functional.cross_entropy(ddp(x), y).backward()
        sent.append(state.counts.last.bytes_sent)
    return sent


def test_auto_hook_counts_its_link_measurement():
    """The DDP hook's ``auto`` measures the link at its first call; that traffic is counted in
    the call. P = 2, the default probes (:func:`conftest.probe_bytes_at_two_ranks`) and the
    sparsifier fit's max-reduce (16 B). Which way ``auto`` sends the bucket depends on the times it
    measured (a loaded machine makes it sparse): its sparse collective's first call adds its
    shape check (32 B), the dense all-reduce sends the gradient (4 B an entry at P = 2)."""
    probes = probe_bytes_at_two_ranks() + 16
    dense = 4 * sum(p.numel() for p in build("mlp", seed=1).parameters())
    for first, second in run_distributed(_auto_hook_traffic, 2, timeout=180):
        shape = 0 if second == dense else 32  # sparse: smaller, and checked once
        assert second <= dense
        assert first - second == probes + shape  # the same bucket both steps, probes once


def _auto_profile_device(rank: int, world_size: int) -> list[str]:
    from gradsync.schedule import costmodel

    seen = []
    real = costmodel.profile_sparsifier

    def recording(sparsifier, *args, **kwargs):
        seen.append(str(kwargs.get("device")))
        return real(sparsifier, *args, **kwargs)

    costmodel.profile_sparsifier = recording
    try:
        _auto_hook_traffic(rank, world_size)
    finally:
        costmodel.profile_sparsifier = real
    return seen


def test_auto_hook_times_its_sparsifier_where_the_gradients_are():
    """Issue 14: the hook's ``auto`` fits the sparsifier on the bucket's device (a GPU job
    is not planned with CPU timings); before, it was called without one (the CPU default)."""
    for seen in run_distributed(_auto_profile_device, 2, timeout=180):
        assert seen == ["cpu"]  # once, at the first call, on the CPU buckets' device


def _auto_trial(rank: int, world_size: int, slow: str, extra: float = 0.25,
                rounds: int = 1) -> dict:
    """The DDP hook's ``auto`` with a link model that predicts sparse (1 Mbit/s), on a real
    loopback, timed by an injected clock: a step takes 100 ms, and ``extra`` more in the mode
    ``slow`` (a stand-in for its cost), however loaded the machine is; ``rounds``: the
    trial's rounds to run steps for."""
    from gradsync.engine.trial import AGAIN_ORDER, TRIAL_ORDER, TRIAL_STEPS
    from gradsync.schedule.costmodel import AffineFit, AlphaBeta

    model = build("mlp", seed=1)
    ddp = DDP(model, bucket_cap_mb=25)  # one bucket
    state = gradsync.ddp.register(ddp, Config(scheme="auto", density=0.05, sparsifier="topk"))
    slow_link = AlphaBeta(1e-4, 8 / 1e6)
    state.auto.link = (slow_link, slow_link, AffineFit(0.0, 0.0))  # predicts sparse
    now = [0.0]
    state.auto.clock = lambda: now[0]
    modes, sent = [], []
    steps = (len(TRIAL_ORDER) + len(AGAIN_ORDER) * (rounds - 1)) * TRIAL_STEPS + rounds + 3
    for step in range(steps):
        mode = state.auto_mode()
        now[0] += 0.1 + (extra if mode == slow else 0.0)
        ddp.zero_grad(set_to_none=True)
        x, y = image_batch(rank, step)
        nn.functional.cross_entropy(ddp(x), y).backward()
        modes.append(mode)
        sent.append(state.counts.last.bytes_sent)
    fresh, _ = gradsync.ddp.hook(Config(scheme="auto", density=0.05, sparsifier="topk"),
                                 model=model)
    fresh.load_state_dict(state.state_dict())
    assert fresh.auto.trial == state.auto.trial
    residual = max((r.abs().max().item() for r in state.ef.state_dict()["residual"].values()),
                   default=0.0)
    return {"modes": modes, "sent": sent, "verdict": state.auto.trial["verdict"],
            "residual": residual,
            "measured": state.auto.trial["measured"], "resumed_mode": fresh.auto_mode(),
            "numel": sum(p.numel() for p in model.parameters())}


@pytest.mark.parametrize("slow,verdict", [("model", "dense"), ("dense", "model")])
def test_auto_hook_measures_its_prediction_against_all_dense(slow, verdict):
    """A-B-B-A windows of the prediction and all-dense, then the faster of the two (the
    prediction only by the margin) on every rank; a dense step sends DDP's bytes."""
    from gradsync.engine.trial import TRIAL_STEPS

    out = run_distributed(_auto_trial, 2, slow, timeout=300)
    for r in out:
        assert r["verdict"] == verdict and r["resumed_mode"] == verdict
        assert r["measured"] == out[0]["measured"]  # max-reduced: the same numbers
        w = TRIAL_STEPS
        # step 0 decides and measures the link; the trial starts at step 1
        assert r["modes"][:1 + w] == ["model"] * (1 + w)
        assert r["modes"][1 + w:1 + 3 * w] == ["dense"] * (2 * w)
        assert r["modes"][1 + 3 * w:1 + 4 * w] == ["model"] * w
        # step 1 + 4w takes the verdict at its first bucket (read before it: the last window)
        assert set(r["modes"][2 + 4 * w:]) == {verdict}
        dense_bytes = 2 * (2 - 1) / 2 * r["numel"] * 4  # ring all-reduce at P = 2, fp32
        modes, sent = r["modes"][1:1 + 4 * w] + r["modes"][2 + 4 * w:], \
            r["sent"][1:1 + 4 * w] + r["sent"][2 + 4 * w:]
        dense_steps = [b for m, b in zip(modes, sent) if m == "dense"]
        model_steps = [b for m, b in zip(modes, sent) if m == "model"]
        # the verdict's step also carries the 16-byte max-reduce
        assert set(dense_steps) <= {dense_bytes, dense_bytes + 16}
        assert max(model_steps) < dense_bytes / 4
        # momentum 0: after a dense step nothing is held back, the sparse steps' residuals
        # included (they travel in the first all-reduce); after a sparse one, something is
        assert (r["residual"] == 0.0) == (verdict == "dense"), r["residual"]


def test_a_close_hook_trial_goes_on_and_the_means_of_every_round_decide():
    """The hook decides by the engine's A-B-B-A rule (``trial.decide``): all-dense and the
    prediction equally fast is within TRIAL_CLOSE once the margin is counted, so B-B-A runs
    again until TRIAL_ROUNDS rounds, and then all-dense (the sparse side handicapped) stays, on
    every rank alike."""
    from gradsync.engine.trial import TRIAL_ROUNDS, TRIAL_STEPS

    out = run_distributed(_auto_trial, 2, "neither", 0.0, TRIAL_ROUNDS, timeout=300)
    w = TRIAL_STEPS
    want = ["model"] * (1 + w) + ["dense"] * (2 * w) + ["model"] * w
    for _ in range(TRIAL_ROUNDS - 1):  # the step that decided the round before, untimed
        want += ["model"] + ["dense"] * (2 * w) + ["model"] * w
    for r in out:
        assert r["verdict"] == "dense" and r["resumed_mode"] == "dense"
        assert r["modes"][:len(want)] == want
        assert set(r["modes"][len(want) + 1:]) == {"dense"}
        assert r["measured"] == {"model": pytest.approx(0.1), "dense": pytest.approx(0.1)}


def test_the_a_b_b_a_rule_by_hand():
    """``trial.decide``: the sparse side's time over (1 − MARGIN); within TRIAL_CLOSE another
    round until TRIAL_ROUNDS; a dense candidate against a sparse plan in use and the reverse."""
    from gradsync.engine.trial import TRIAL_ROUNDS, decide
    from gradsync.schedule.auto import MARGIN

    assert decide(1.0, 1.3, False, False, 1) is False  # 30 % slower: one round settles it
    assert decide(1.3, 1.0, False, False, 1) is True
    assert decide(1.0, 1.05, False, False, 1) is None  # 5 %: too close
    assert decide(1.0, 1.05, False, False, TRIAL_ROUNDS) is False  # the last round decides
    # a sparse plan in use at 1.0 against a dense candidate at 1.0: 1/(1 − MARGIN) against 1
    assert decide(1.0, 1.0, True, False, TRIAL_ROUNDS) is True
    # a sparse candidate must be MARGIN faster: at (1 − MARGIN) × 1.01 it is not
    assert decide(1.0, (1 - MARGIN) * 1.01, False, True, TRIAL_ROUNDS) is False
    assert decide(1.0, (1 - MARGIN) * 0.99, False, True, TRIAL_ROUNDS) is True
    assert decide(1.0, 0.5, False, True, 1) is True


def test_auto_hook_trial_entries_are_checked_on_load():
    model = build("mlp", seed=1)
    state, _ = gradsync.ddp.hook(Config(scheme="auto", density=0.05), model=model)
    state.auto.trial = {"start": 3, "rounds": 1, "verdict": None,
                        "times": {"model": [0.1, 0.2], "dense": [0.3]}}
    state.counts.steps = 9  # in the second window: all-dense
    sd = state.state_dict()
    fresh, _ = gradsync.ddp.hook(Config(scheme="auto", density=0.05), model=model)
    fresh.load_state_dict(sd)
    assert fresh.auto.trial == state.auto.trial and fresh.auto_mode() == "dense"
    again = {**state.auto.trial, "rounds": 2}  # a second round (B-B-A) is saved and restored
    fresh.load_state_dict({**sd, "trial": again})
    assert fresh.auto.trial == again
    for bad in ({"start": 3}, {"start": 3, "verdict": "sometimes",
                               "times": {"model": [], "dense": []}},
                {"start": "x", "verdict": None, "times": {"model": [], "dense": []}},
                {**again, "rounds": 0}, {**again, "rounds": 99}, {**again, "rounds": "2"}):
        with pytest.raises(ValueError, match="trial"):
            fresh.load_state_dict({**sd, "trial": bad})
    assert fresh.auto.trial == again  # nothing changed
    before_rounds = {k: v for k, v in state.auto.trial.items() if k != "rounds"}
    fresh.load_state_dict({**sd, "trial": before_rounds})  # saved before rounds existed
    assert fresh.auto.trial == {**before_rounds, "rounds": 1}


def test_kept_counts_missing_tensors_and_refuses_positions_outside():
    """The check of a collective's ``kept`` that the hook and the engine share (positions in
    the all-gather part: a dense prefix of 3 entries, then selected tensors of 4, 0 and 3
    entries): the selected tensors with no entry kept are counted, in one read, sorted or not;
    a position outside the part raises instead of being dropped."""
    from gradsync.engine.apply import missing_check, settle_missing

    def count_missing(kept: torch.Tensor, starts: list[int], numel: int, what: str) -> int:
        (missing,), _ = settle_missing([missing_check(kept, starts, numel)],
                                       f"{what} [0, {numel})")
        return missing

    starts = [3, 7, 7]  # tensors at [3, 7), [7, 7), [7, 10)
    for kept, missing in (([0, 1, 2, 4, 8], 1), ([9, 4, 0], 1), ([0, 1, 2], 3), ([5, 7], 1)):
        assert count_missing(torch.tensor(kept), starts, 10, "the bucket's parts") == missing
    assert count_missing(torch.tensor([], dtype=torch.int64), starts, 10, "x") == 3
    for bad in ([1, 10], [-1, 2]):
        with pytest.raises(ValueError, match=r"outside the bucket's parts \[0, 10\)"):
            count_missing(torch.tensor(bad), starts, 10, "the bucket's parts")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-3, 40), max_size=30), st.booleans(),
       st.lists(st.integers(0, 36), max_size=6), st.integers(30, 40))
def test_kept_counted_on_the_host_is_the_devices_count(kept, ordered, starts, numel):
    """The CPU's own kernels count increasing positions by bisection on the host; any other
    positions, and the accelerators' kernels, by the device's six operations: the same
    ``[in_range, missing]`` for every positions and tensors (empty ones, positions before the
    first tensor, outside the buffer, repeated, unordered), checked against both."""
    from gradsync import sparsegrad
    from gradsync.engine.apply import missing_check

    if ordered:
        kept = sorted(set(kept))
    starts = sorted(starts)
    t = torch.tensor(kept, dtype=torch.int64)
    with sparsegrad.using(sparsegrad.CPU):
        host = missing_check(t, starts, numel).tolist()
    with sparsegrad.using(sparsegrad.CPU_AS_ACCELERATOR):
        device = missing_check(t, starts, numel).tolist()
    assert host[0] == device[0] == int(all(0 <= k < numel for k in kept))
    if host[0]:  # a count is read only when every position lies inside (settle_missing)
        per = [sum(a <= k < b for k in kept) for a, b in zip(starts, [*starts[1:], numel])]
        assert host[1] == device[1] == sum(c == 0 for c in per)


def _malformed(rank: int, P: int, sparsifier: str, segmented: bool | str,
               who: str = "link") -> dict:
    """At step 2 rank P − 1 corrupts an index of the first message it unpacks (``who="link"``:
    as a faulty link to it would), or every rank corrupts rank 0's message (``"sender"``: as a
    faulty rank 0 would send it); 4 steps, each rank's errors, error feedback's state around
    step 2, and the final parameters. ``segmented``: a bucket selected at once (the
    accelerators' path), or ``"accelerator"``: the CPU standing in for an accelerator's
    kernels (no host read: a message with no capacity cannot carry a NaN, so the ranks agree)."""
    import gradsync.collectives.topka as topka_mod
    from conftest import segmented as segmented_kernels
    from gradsync import sparsegrad

    sparsegrad.bind(sparsegrad.CPU_AS_ACCELERATOR if segmented == "accelerator"
                    else segmented_kernels(segmented))

    model = build("mlp", seed=3)
    ddp = DDP(model)
    state = gradsync.ddp.register(ddp, Config(scheme="per_tensor", density=0.05, momentum=0.9,
                                              sparsifier=sparsifier, density_warmup=()),
                                  small_numel=1000)  # the target's capacity from the start
    armed, paths = [False], set()
    capped, plain = topka_mod.unpack_entries_capped, topka_mod.unpack_entries

    def bad_capped(msgs, *args):
        paths.add("capped")
        if armed[0]:
            armed[0] = False
            msgs = msgs.clone()
            msgs[0, 8:12] = 255  # rank 0's first index: int32 −1
        return capped(msgs, *args)

    def bad_plain(buf, *args):
        paths.add("exact size")
        idx, val = plain(buf, *args)
        if armed[0] and idx.numel():
            armed[0] = False
            idx = idx.clone()
            idx[0] = -1
        return idx, val

    topka_mod.unpack_entries_capped, topka_mod.unpack_entries = bad_capped, bad_plain
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out: dict = {"errors": [], "same_state": None}
    try:
        for step in range(4):
            armed[0] = step == 2 and (rank == P - 1 or who == "sender")
            before = _ef(state) if step == 2 else None
            opt.zero_grad(set_to_none=True)
            x, y = image_batch(rank, step)
            try:
                nn.functional.cross_entropy(ddp(x), y).backward()
            except RuntimeError as e:  # DDP raises the bucket future's error
                out["errors"].append((step, str(e)))
                continue
            finally:
                if before is not None:
                    after = _ef(state)
                    out["same_state"] = bool(before) and before.keys() == after.keys() and all(
                        torch.equal(before[k], after[k]) for k in before)
            opt.step()
    finally:
        topka_mod.unpack_entries_capped, topka_mod.unpack_entries = capped, plain
    out["paths"] = sorted(paths)
    out["digest"] = parameter_digest(model)[0]
    return out


def _ef(state) -> dict[str, torch.Tensor]:
    ef = state.ef.state_dict()
    return {f"{kind}:{n}": t.clone() for kind in ("residual", "velocity")
            for n, t in ef.get(kind, {}).items()}


@pytest.mark.parametrize("P", [2, 3])
@pytest.mark.parametrize(("sparsifier", "segmented", "path", "who"), [
    ("gaussiank", "accelerator", "exact size", "link"),
    ("gaussiank", False, "exact size", "sender"),
    ("topk", True, "capped", "sender"), ("topk", False, "capped", "sender")])
def test_hook_malformed_message_fails_that_step_on_every_rank(P, sparsifier, segmented, path,
                                                               who):
    """A message whose index lies outside the tensor: that step's ``backward()`` raises on
    every rank — the ranks that unpacked it name the check; where one rank alone did (a faulty
    link to it) and the messages need the ranks' agreement (no capacity, on an accelerator's
    kernels), the others, told by the agreement word, say another rank received a
    malformed message — no rank's error feedback keeps anything of it, nothing hangs, and the
    next steps train on with the replicas identical. Where every rank unpacks every message
    and each can carry its NaN (a capacity, or the CPU's kernels), a faulty sender's message
    fails every rank alike with no agreement word."""
    outs = run_distributed(_malformed, P, sparsifier, segmented, who, timeout=240)
    for rank, out in enumerate(outs):
        assert out["paths"] == [path], out["paths"]
        assert [s for s, _ in out["errors"]] == [2], (rank, out["errors"])
        msg = out["errors"][0][1]
        if rank == P - 1 or who == "sender":
            assert "topka: a rank's message" in msg and "outside" in msg, msg
        else:
            assert "another rank received a malformed message" in msg, (rank, msg)
        assert out["same_state"], rank
    assert len({o["digest"] for o in outs}) == 1


@pytest.mark.parametrize("P", [2, 3])
@pytest.mark.parametrize(("sparsifier", "segmented", "path"), [
    ("topk", True, "capped"), ("gaussiank", False, "exact size")])
def test_hook_a_link_fault_at_a_fixed_capacity_fails_the_receiving_rank_only(P, sparsifier,
                                                                             segmented, path):
    """The documented limit of that rule (usage.md, "Non-finite gradients"): at a fixed
    capacity, or with no capacity on the CPU's kernels, no agreement word travels, so a message
    that one rank alone receives corrupted (a link fault TCP's checksum missed) fails that
    rank's step only, its error feedback as before the step; its peers take the step, nothing
    hangs, and every rank trains on (its replica now differs, as a corrupted value would make
    it)."""
    outs = run_distributed(_malformed, P, sparsifier, segmented, "link", timeout=240)
    for rank, out in enumerate(outs):
        assert out["paths"] == [path], out["paths"]
        if rank == P - 1:
            assert [s for s, _ in out["errors"]] == [2], out["errors"]
            assert "topka: a rank's message" in out["errors"][0][1], out["errors"]
            assert out["same_state"]
        else:
            assert out["errors"] == [], (rank, out["errors"])
            assert out["same_state"] is False, rank  # it took the step
    assert len({o["digest"] for o in outs[:-1]}) == 1
    assert outs[-1]["digest"] != outs[0]["digest"]


def test_hook_state_is_grouped_by_role():
    """The hook's state is a dozen fields, each a role (configuration, what compresses, the
    model, the step's buckets, counts, auto's trial, mixed precision), so a reader finds where a
    value lives; the counts ``stats()`` reports come from its ``counts``."""
    import dataclasses

    state = HookState(cfg=Config(scheme="per_tensor", density=0.05))
    names = [f.name for f in dataclasses.fields(state)]
    assert len(names) <= 12, names
    state.counts.calls, state.counts.nonfinite = 3, 1
    state.counts.missing, state.counts.tensors = 1, 4
    got = state.stats()
    assert (got["calls"], got["nonfinite_buckets"], got["missing_rate"]) == (3, 1, 0.25)
    assert state.scheme.name == "per_tensor"


def _bucket_views(rank: int, world_size: int, scheme: str, views: bool) -> dict:
    """The hook over several buckets with momentum, clipping, a ``no_sync`` micro-batch and a
    step whose gradients are NaN on rank 0 (``skip_step``: NaN in every rank's ``.grad``, and
    the step not taken), DDP's gradients copied into its
    buckets (torch's default) or living in them (``gradient_as_bucket_view``)."""
    model = build("cnn", seed=4)
    ddp = DDP(model, bucket_cap_mb=0.1, gradient_as_bucket_view=views)
    state = gradsync.ddp.register(ddp, Config(scheme=scheme, density=0.02, momentum=0.9,
                                              clip_norm=1.0, nonfinite="skip_step"),
                                  small_numel=1000)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    grads = []
    for step in range(7):
        opt.zero_grad(set_to_none=step % 2 == 0)  # both of torch's ways
        if step == 3:
            with ddp.no_sync():
                x, y = image_batch(rank, 1000 + step, 16)
                nn.functional.cross_entropy(ddp(x), y).backward()
        x, y = image_batch(rank, step, 16)
        if step == 5 and rank == 0:
            x = x * float("nan")
        nn.functional.cross_entropy(ddp(x), y).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        if grads[-1].isfinite().all():  # the skipped step's NaN tells the optimizer to skip
            opt.step()
    return {"digest": parameter_digest(model)[0], "grads": grads,
            "residual": state.ef.state_dict()["residual"],
            "total": {k: v for k, v in state.stats()["total"].items() if k != "seconds"},
            # storages the gradients live in: DDP's few buckets, or one per parameter
            "storages": len({p.grad.untyped_storage().data_ptr() for p in model.parameters()})}


@pytest.mark.parametrize("world_size,scheme", [(2, "ssfusion_oi"), (3, "per_tensor"),
                                               (2, "dense")])
def test_the_hook_trains_bit_for_bit_with_gradients_as_bucket_views(world_size, scheme):
    """``DDP(..., gradient_as_bucket_view=True)`` (what ``GradSyncStrategy`` builds, and the
    faster set-up for the other doors) changes where ``.grad`` lives, not what the hook computes:
    every step's averaged gradients (a skipped step's NaN included), the parameters, the
    residuals and the bytes are those of torch's default layout, bit for bit."""
    copied = run_distributed(_bucket_views, world_size, scheme, False, timeout=300)
    viewed = run_distributed(_bucket_views, world_size, scheme, True, timeout=300)
    for c, v in zip(copied, viewed):
        assert v["storages"] < c["storages"] == len(list(build("cnn", seed=4).parameters()))
        assert c["digest"] == v["digest"]
        for a, b in zip(c["grads"], v["grads"]):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
        assert [g.isnan().any().item() for g in c["grads"]] == [False] * 5 + [True, False]
        assert c["total"] == v["total"] and c["total"]["bytes_sent"] > 0
        assert c["residual"].keys() == v["residual"].keys()
        for k, a in c["residual"].items():
            b = v["residual"][k]
            assert (a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
                    if isinstance(a, dict) else torch.equal(a, b)), k
    assert len({v["digest"] for v in viewed}) == 1
