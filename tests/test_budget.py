"""``Config.budget="gradient"``: a per-tensor plan's entries shared by the gradient's L1 mass.

The reference here is computed from the gradients the test gives each rank (constant, so the
mass of tensor i over W profiling steps and P ranks is W · Σ_r Σ|c_i^r|), and the entries each
tensor should get from that mass by hand, not through :func:`gradsync.schedule.budget.shares`.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import gradsync
from gradsync.schedule import BufferPlan, Plan, TensorPlan, make_plan
from gradsync.schedule.budget import apportion, shares
from gradsync.testing import run_distributed

# per_tensor at 1 %: k = 40, 40, 20 (100 entries a step); "bn" (k = 1) is sent whole (min_k)
SIZES = {"a": 4000, "b": 4000, "c": 2000, "bn": 16}
SCALE = {"a": 0.01, "b": 1.0, "c": 0.3, "bn": 1.0}  # |gradient| per entry, about
W = 3  # profiling steps


def _grads(rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return {n: SCALE[n] * (0.5 + torch.rand(k, generator=g)) * (1 - 2 * (torch.rand(
        k, generator=g) < 0.5)) for n, k in SIZES.items()}


def _model() -> nn.ParameterDict:
    return nn.ParameterDict({n: nn.Parameter(torch.zeros(k)) for n, k in SIZES.items()})


def _train(sync: gradsync.GradSync, model: nn.ParameterDict, rank: int, steps: int) -> None:
    c = _grads(rank)
    for _ in range(steps):
        for p in model.values():
            p.grad = None
        sum((p * c[n]).sum() for n, p in model.items()).backward()
        sync.synchronize()


def _plan_of(rank: int, world_size: int, scheme: str, budget: str) -> dict:
    model = _model()
    cfg = gradsync.Config(scheme=scheme, density=0.01, warmup_steps=W, budget=budget,
                          compress_single_rank=True)
    sync = gradsync.GradSync(model, cfg)
    _train(sync, model, rank, W + 1)
    plan = sync.plan
    sync.close()
    return {"k": {t.name: t.k for b in plan.buffers for t in b.tensors},
            "whole": sorted(t.name for b in plan.buffers for t in b.tensors
                            if t.density is None),
            "digest": plan.digest()}


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_per_tensor_entries_follow_the_gradients_mass(world_size):
    got = run_distributed(_plan_of, world_size, "per_tensor", "gradient")
    even = run_distributed(_plan_of, world_size, "per_tensor", "even")[0]
    assert len({r["digest"] for r in got}) == 1  # every rank runs rank 0's plan
    k = got[0]["k"]
    # the reference: masses from the gradients the ranks were given
    mass = {n: W * sum(float(_grads(r)[n].abs().sum()) for r in range(world_size))
            for n in SIZES}
    total = sum(even["k"][n] for n in ("a", "b", "c"))
    assert total == 100 and even["k"]["b"] == 40
    # a's share (< 1 entry) is raised to min_k = 8; b and c share the other 92 by mass
    assert k["a"] == 8
    want_b = (total - 8) * mass["b"] / (mass["b"] + mass["c"])
    assert abs(k["b"] - want_b) <= 1 and abs(k["b"] + k["c"] - (total - 8)) <= 1
    assert k["b"] >= 2 * even["k"]["b"]  # the tensor that holds the mass gets it
    assert got[0]["whole"] == even["whole"] == ["bn"]  # the same tensors travel whole


@pytest.mark.parametrize("world_size", [1, 3])
def test_blend_shares_half_evenly_and_half_by_mass(world_size):
    got = run_distributed(_plan_of, world_size, "per_tensor", "blend")
    assert len({r["digest"] for r in got}) == 1
    mass = {n: W * sum(float(_grads(r)[n].abs().sum()) for r in range(world_size))
            for n in ("a", "b", "c")}
    n = {t: SIZES[t] for t in mass}
    # by hand: k_i = K (m_i/M + n_i/N) / 2 with K = 100; no bound binds here
    for t in mass:
        want = 100 * (mass[t] / sum(mass.values()) + n[t] / sum(n.values())) / 2
        assert abs(got[0]["k"][t] - want) <= 1, (t, got[0]["k"], want)
    assert got[0]["whole"] == ["bn"]
    # between the two rules: a keeps at least half of its even 40, b gets more than its 40
    assert 20 <= got[0]["k"]["a"] < 40 < got[0]["k"]["b"]


def test_apportion_keeps_the_whole_tensors_the_modes_and_the_entries():
    names = ["fc.bias", "fc.weight", "conv2", "bn", "conv1"]
    numel = {"fc.bias": 10, "fc.weight": 640, "conv2": 36864, "bn": 64, "conv1": 9216}
    even = make_plan("per_tensor", names, numel, 0.01)
    mass = {"fc.bias": 1.0, "fc.weight": 50.0, "conv2": 30.0, "bn": 1.0, "conv1": 40.0}
    out = apportion(even, mass, min_k=8)
    before = {t.name: t for b in even.buffers for t in b.tensors}
    after = {t.name: t for b in out.buffers for t in b.tensors}
    assert [b.mode for b in out.buffers] == [b.mode for b in even.buffers]
    assert {n for n, t in after.items() if t.density is None} == {
        n for n, t in before.items() if t.density is None} == {"fc.bias", "fc.weight", "bn"}
    sparse = ("conv2", "conv1")
    assert sum(after[n].k for n in sparse) == sum(before[n].k for n in sparse) == 369 + 92
    # conv1 holds 40/70 of the mass: 263 entries of 461, where one density gave it 92
    assert after["conv1"].k == round(461 * 40 / 70) and after["conv2"].k == 461 - 263
    assert out.info["budget"] == "gradient"
    # blend: half of the 461 entries by mass (263 / 198 above), half by size (92 / 369)
    mixed = {t.name: t for b in apportion(even, mass, 8, "blend").buffers for t in b.tensors}
    assert abs(mixed["conv1"].k - (263 + 92) / 2) <= 1 and abs(mixed["conv2"].k - (198 + 369)
                                                                  / 2) <= 1
    assert mixed["fc.weight"].density is None
    with pytest.raises(ValueError, match="rule must be one of"):
        apportion(even, mass, 8, "even")
    # offload and all-reduce choices are kept
    flags = Plan("ssfusion_oi", [BufferPlan((TensorPlan("x", 1000, 0.01, offload=True),
                                             TensorPlan("y", 50, None, allreduce=True),
                                             TensorPlan("z", 3000, 0.01)), "per_tensor")])
    moved = apportion(flags, {"x": 1.0, "y": 5.0, "z": 1.0}, 8)
    assert [(t.offload, t.allreduce) for t in moved.buffers[0].tensors] == [
        (True, False), (False, True), (False, False)]
    assert [t.k for t in moved.buffers[0].tensors] == [20, 50, 20]


def test_plans_with_nothing_to_share_come_back_unchanged():
    numel = {"a": 1000, "b": 3000}
    fused = make_plan("topka", ["a", "b"], numel, 0.01)
    assert apportion(fused, {"a": 1.0, "b": 2.0}, 8) is fused
    even = make_plan("per_tensor", ["a", "b"], numel, 0.01)
    assert apportion(even, {"a": 0.0, "b": 0.0}, 8) is even  # no gradient seen: as planned
    with pytest.raises(ValueError, match="no mass for"):
        apportion(even, {"a": 1.0}, 8)


def test_shares_by_hand():
    n = {"x": 100, "y": 1000, "z": 1000}
    # proportional inside the bounds
    assert shares(100, n, {"x": 1.0, "y": 2.0, "z": 2.0}, 1) == {"x": 20, "y": 40, "z": 40}
    # x would want 300 of its 100 entries: capped, the rest shared by y and z
    assert shares(400, n, {"x": 3.0, "y": 0.5, "z": 0.5}, 1) == {"x": 100, "y": 150, "z": 150}
    # z without mass keeps its floor, paid by the others
    assert shares(100, n, {"x": 1.0, "y": 1.0, "z": 0.0}, 8) == {"x": 46, "y": 46, "z": 8}
    # the tensor with the mass capped, only massless ones left: they share the rest by size
    # (hypothesis found 5 entries of 37 spent as 2: t1 left at its floor)
    assert shares(5, {"t0": 1, "t1": 36}, {"t0": 1.0, "t1": 0.0}, 1) == {"t0": 1, "t1": 4}
    assert shares(41, {"x": 1, "y": 10, "z": 30}, {"x": 1.0, "y": 0.0, "z": 0.0}, 1) == {
        "x": 1, "y": 10, "z": 30}
    assert shares(21, {"x": 1, "y": 10, "z": 30}, {"x": 1.0, "y": 0.0, "z": 0.0}, 1) == {
        "x": 1, "y": 5, "z": 15}
    # floors over the budget: every tensor at its floor (a tensor smaller than it: whole)
    assert shares(5, {"x": 3, "y": 50}, {"x": 1.0, "y": 1.0}, 8) == {"x": 3, "y": 8}
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="finite masses >= 0"):
            shares(10, n, {"x": bad, "y": 1.0, "z": 1.0}, 1)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 5000), st.floats(0.0, 1e3)), min_size=1, max_size=12),
       st.floats(0.001, 0.2), st.integers(1, 16))
def test_shares_stay_within_bounds_and_budget(tensors, density, min_k):
    numel = {f"t{i}": n for i, (n, _) in enumerate(tensors)}
    mass = {f"t{i}": m for i, (_, m) in enumerate(tensors)}
    k_total = max(1, round(density * sum(numel.values())))
    k = shares(k_total, numel, mass, min_k)
    assert set(k) == set(numel)
    lo = {t: min(min_k, numel[t]) for t in numel}
    assert all(lo[t] <= k[t] <= numel[t] for t in numel)
    floors, caps = sum(lo.values()), sum(numel.values())
    if floors <= k_total <= caps and any(m > 0 for m in mass.values()):
        assert abs(sum(k.values()) - k_total) <= len(numel)  # rounding, at most one each
    # more mass per entry never means fewer entries per entry (among unbounded tensors)
    free = [t for t in numel if lo[t] < k[t] < numel[t]]
    for s in free:
        for t in free:
            if mass[s] / numel[s] > mass[t] / numel[t] * 1.5 and k[t] > 8:
                assert k[s] / numel[s] >= k[t] / numel[t] * 0.99


def _scaled_plan(rank: int, world_size: int, path: str, factor: float, told: bool) -> dict:
    """Each tensor's entries (engine) or density (hook) after W profiling steps whose
    gradients are ``factor`` times larger from step 2 on (a loss scale that grew), the owner
    ``told`` so (``rescale``) or not; "a" holds the mass of steps 0-1, "b" that of 2 on."""
    cfg = gradsync.Config(scheme="per_tensor", density=0.01, warmup_steps=W, budget="gradient",
                          compress_single_rank=True)
    c = _grads(rank)
    if path == "engine":
        model = _model()
        owner = gradsync.GradSync(model, cfg)
    else:
        net = _Net()
        ddp = nn.parallel.DistributedDataParallel(net)
        owner = gradsync.ddp.register(ddp, cfg)
    for step in range(W + 2):
        if step == 2 and factor != 1 and told:
            owner.rescale(factor)
        w = {"a": 100.0 if step < 2 else 1.0, "b": 1.0, "c": 1.0, "bn": 1.0}
        scaled = {n: c[n] * w[n] * (1.0 if step < 2 else factor) for n in c}
        if path == "engine":
            for p in model.values():
                p.grad = None
            sum((p * scaled[n]).sum() for n, p in model.items()).backward()
            owner.synchronize()
        else:
            ddp.zero_grad(set_to_none=True)
            ddp(scaled).backward()
    if path == "hook":
        return {n.split(".")[-1]: d for n, d in owner.model.budget.density.items()}
    k = {t.name: t.k for b in owner.plan.buffers for t in b.tensors}
    owner.close()
    return k


@pytest.mark.parametrize(("world_size", "path"), [(1, "engine"), (2, "engine"), (2, "hook")])
def test_a_loss_scale_that_changes_in_the_profiling_steps_weighs_nothing(world_size, path):
    """Masses are kept in the units of the loss scale, as residuals are: a power-of-two scale
    that grows in the profiling steps plans exactly as the unscaled run does."""
    plain = run_distributed(_scaled_plan, world_size, path, 1.0, True)[0]
    assert run_distributed(_scaled_plan, world_size, path, 8.0, True)[0] == plain
    # unit-blind masses would weigh the later steps 8 times: "a" would lose entries
    assert run_distributed(_scaled_plan, world_size, path, 8.0, False)[0]["a"] < plain["a"]


def _resumed(rank: int, world_size: int) -> dict:
    model = _model()
    cfg = gradsync.Config(scheme="per_tensor", density=0.01, warmup_steps=W, budget="gradient")
    sync = gradsync.GradSync(model, cfg)
    _train(sync, model, rank, 1)  # one profiling step, then a checkpoint
    state = sync.state_dict()
    sync.close()
    fresh_model = _model()
    fresh = gradsync.GradSync(fresh_model, cfg)
    fresh.load_state_dict(state)
    _train(fresh, fresh_model, rank, W)
    digest = fresh.plan.digest()
    fresh.close()
    return {"digest": digest, "saved": sorted(state["warmup_mass"])}


def test_a_checkpoint_during_the_profiling_steps_keeps_the_masses():
    whole = run_distributed(_plan_of, 2, "per_tensor", "gradient")[0]["digest"]
    for r in run_distributed(_resumed, 2):
        assert r["saved"] == sorted(SIZES) and r["digest"] == whole


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.p = _model()

    def forward(self, c: dict[str, torch.Tensor]) -> torch.Tensor:
        return sum((p * c[n]).sum() for n, p in self.p.items())


def _hook_densities(rank: int, world_size: int, scheme: str, model_given: bool,
                    budget: str = "gradient") -> dict:
    net = _Net()
    cfg = gradsync.Config(scheme=scheme, density=0.01, warmup_steps=W, budget=budget)
    ddp = nn.parallel.DistributedDataParallel(net)
    if model_given:
        state = gradsync.ddp.register(ddp, cfg)
    else:  # the hook learns the tensors from its buckets (named by position and shape)
        state, fn = gradsync.ddp.hook(cfg)
        ddp.register_comm_hook(state, fn)
    c = _grads(rank)
    seen = []
    for _ in range(W + 2):
        ddp.zero_grad(set_to_none=True)
        ddp(c).backward()
        seen.append(state.model.budget.density)
    # the engine, from the same gradients: its plan's densities
    model = _model()
    sync = gradsync.GradSync(model, cfg)
    _train(sync, model, rank, W + 1)
    planned = {t.name.removeprefix("p."): t.density for b in sync.plan.buffers
               for t in b.tensors}
    sync.close()
    names = {f"param{i}:{tuple(p.shape)}": n for i, (n, p) in enumerate(net.p.items())}
    return {"before": seen[:W], "engine": planned, "saved": state.state_dict()["budget"],
            "hook": {names.get(n, n).removeprefix("p."): d for n, d in seen[-1].items()}}


@pytest.mark.parametrize(("world_size", "model_given", "budget"), [
    (2, True, "gradient"), (3, True, "gradient"), (2, False, "gradient"), (3, True, "blend")])
def test_the_ddp_hook_shares_the_entries_as_the_engine_plans_them(world_size, model_given,
                                                                   budget):
    for r in run_distributed(_hook_densities, world_size, "per_tensor", model_given, budget):
        assert r["before"] == [None] * W  # the profiling steps run at one density
        assert r["hook"] == pytest.approx(r["engine"]) and r["hook"]["bn"] is None
        # the tensor that holds the mass gets the entries (blend: half of them by mass)
        assert r["hook"]["b"] >= (2 if budget == "gradient" else 1.5) * 0.01
        # a checkpoint keeps the settled densities (HookState.state_dict)
        assert sorted(r["saved"]["density"].values(), key=str) == sorted(
            r["hook"].values(), key=str)


def test_config_and_the_hook_refuse_what_they_cannot_run():
    with pytest.raises(ValueError, match="budget"):
        gradsync.Config(budget="global")
    assert gradsync.Config().budget is None  # the scheme's (test_pooled.py)
    # a resumed run must keep its budget: the plan depends on it
    per = gradsync.Config(scheme="per_tensor")
    diff = gradsync.Config(scheme="per_tensor", budget="gradient").differences(
        per.to_dict(), ("budget",))
    assert diff == ["budget: saved 'blend', here 'gradient'"]
    # a checkpoint from before the key ran the even budget: the default (blend) refuses it
    assert per.differences({"scheme": "per_tensor"}, ("budget",)) == [
        "budget: saved 'even', here 'blend'"]
    assert gradsync.Config(scheme="per_tensor", budget="even").differences(
        {"scheme": "per_tensor"}, ("budget",)) == []


def test_the_hooks_masses_survive_a_checkpoint(monkeypatch):
    from gradsync.collectives.comm import Comm
    from gradsync.engine.warmup import Masses
    from gradsync.integrations.budget import HookBudget

    cfg = gradsync.Config(scheme="per_tensor", density=0.01, warmup_steps=W, budget="gradient")
    sizes = list(SIZES.items())
    c = _grads(0)
    buf = torch.cat([c[n] for n in SIZES])
    even = [0.01, 0.01, 0.01, None]  # bn: whole (min_k)

    def run(stop: int | None) -> dict:
        b = HookBudget(cfg, sizes)
        for step in range(W + 1):
            if step == stop:  # a restart: the state into a new hook's
                saved, b = b.state_dict(), HookBudget(cfg, sizes)
                b.load(saved)
            b.settle(step, Comm(None), lambda ns: even)
            b.weigh(step, list(SIZES), list(SIZES.values()), buf)
        return b.density

    whole = run(None)
    assert whole["b"] > whole["a"] and whole["bn"] is None
    assert run(1) == run(W) == whole  # restarted in the profiling steps, or after them
    # the masses are summed on the device settle is given (the bucket's), not where a
    # checkpoint left them (the CPU), which NCCL would refuse
    restored = HookBudget(cfg, sizes)
    restored.load({"budget": {"mass": {n: 1.0 for n in SIZES}, "density": None}})
    seen = []
    real = Masses.totals
    monkeypatch.setattr(Masses, "totals", lambda self, names, comm, device=None: seen.append(
        device) or real(self, names, comm, device))
    restored.settle(W, Comm(None), lambda ns: even, torch.device("cpu"))
    assert seen == [torch.device("cpu")] and restored.density["a"] == restored.density["b"]
    assert HookBudget(gradsync.Config(budget="even"), None).densities(["x"], [0.01]) == [0.01]


def test_weighing_costs_ops_per_job_and_nothing_after_the_profiling_steps(monkeypatch):
    """Counted, not guessed: weighing a job of 40 tensors is a few ops (one fused norm, a
    stack, an add), not a few per tensor, and it happens once per job in each profiling step
    and never after them."""
    from gradsync.engine.warmup import Masses
    from test_engine import _ComputeOps

    sizes = [16 * 16, 16] * 20
    grad, masses = torch.randn(sum(sizes)), Masses()
    names = [f"t{i}" for i in range(len(sizes))]
    masses.weigh(names, sizes, grad)
    with _ComputeOps() as weigh:
        masses.weigh(names, sizes, grad)
    assert 0 < weigh.count <= 4, weigh.count

    calls: list[int] = []
    real = Masses.weigh
    monkeypatch.setattr(Masses, "weigh",
                        lambda self, *a: calls.append(sync.step) or real(self, *a))
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(20) for m in (nn.Linear(16, 16), nn.Tanh())])
    sync = gradsync.GradSync(model, gradsync.Config(
        scheme="per_tensor", density=0.05, momentum=0.9, warmup_steps=3, budget="gradient",
        compress_single_rank=True))
    for _ in range(8):
        model.zero_grad(set_to_none=False)
        model(torch.randn(8, 16)).square().mean().backward()
        sync.synchronize()
    jobs = len(sync._layout.jobs)  # the even plan's buffers, as in the profiling steps
    sync.close()
    assert sorted(calls) == [s for s in range(3) for _ in range(jobs)]


def _overflowed(rank: int, world_size: int) -> dict:
    """A GradScaler's overflow in a profiling step (``nonfinite="skip_step"``): the step is
    skipped and weighs nothing; the plan comes from the finite steps."""
    model = _model()
    cfg = gradsync.Config(scheme="per_tensor", density=0.01, warmup_steps=W, budget="gradient",
                          nonfinite="skip_step")
    sync = gradsync.GradSync(model, cfg)
    c = _grads(rank)
    kept = []
    for step in range(W + 2):
        for p in model.values():
            p.grad = None
        scale = float("inf") if step == 1 and rank == 0 else 1.0
        sum((p * c[n] * scale).sum() for n, p in model.items()).backward()
        kept.append(sync.synchronize())
    k = {t.name: t.k for b in sync.plan.buffers for t in b.tensors}
    sync.close()
    return {"kept": kept, "k": k}


def test_an_overflow_in_the_profiling_steps_weighs_nothing():
    got = run_distributed(_overflowed, 2)
    clean = run_distributed(_plan_of, 2, "per_tensor", "gradient")[0]["k"]
    for r in got:
        assert r["kept"] == [True, False] + [True] * W  # every rank skipped step 1
        # W - 1 finite steps of constant gradients: the same shares as W of them
        assert r["k"] == clean
