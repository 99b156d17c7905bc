"""The density schedule (gradsync.engine.density): Accordion's critical regimes with a byte cap,
decided alike on every rank, the same through the engine and the DDP hook."""

import math

import pytest
import torch
from torch import nn

from gradsync import Config, GradSync
from gradsync.engine import density as ds
from gradsync.engine.density import DensitySchedule
from gradsync.integrations import ddp
from gradsync.testing import run_distributed

D = 0.01
HIGH = D * ds.CRITICAL_FACTOR
# the adaptive schedule alone (the scheme's DGC warm-up off)
ADAPTIVE = Config(scheme="topka", density=D, density_schedule="adaptive", density_warmup=())


def _steps(sched: DensitySchedule, first: int, last: int) -> list[float]:
    """Densities of steps ``first … last-1``, spending them as the doors do (no window ends)."""
    out = []
    for s in range(first, last):
        out.append(sched.at(s))
        sched.spent += sched.at(s)
        sched.steps += 1
    return out


def test_the_first_window_is_critical_then_the_target_until_the_norm_changes():
    sched = DensitySchedule(ADAPTIVE)
    assert _steps(sched, 0, ds.WINDOW) == [HIGH] * ds.WINDOW
    assert sched.decide(100.0, ds.WINDOW) is False  # one statistic: nothing to compare
    assert _steps(sched, ds.WINDOW, 2 * ds.WINDOW) == [D] * ds.WINDOW
    # a change by less than η of the previous window's: still the target
    assert sched.decide(100.0 * (1 - ds.ETA) + 1.0, 2 * ds.WINDOW) is False


def test_a_critical_window_needs_the_change_and_the_budget():
    """After the first window a window is critical only if the norm moved by η or more and the
    run's mean density, that window included, stays within BUDGET × density."""
    sched = DensitySchedule(ADAPTIVE)
    critical_at, n = [], 1.0
    for step in range(ds.WINDOW, 400, ds.WINDOW):
        _steps(sched, step - ds.WINDOW, step)
        n *= 3  # every window's norm triples: always a change
        affordable = sched.spent + ds.WINDOW * HIGH <= ds.BUDGET * D * (step + ds.WINDOW)
        if sched.decide(n, step):
            critical_at.append(step)
        assert sched.critical == (affordable and step > ds.WINDOW)
    assert critical_at, "a run this long affords critical windows"
    assert critical_at[0] > 10 * ds.WINDOW  # the first window's cost is paid off first
    assert sched.spent / sched.steps <= ds.BUDGET * D


@pytest.mark.parametrize("n", [math.nan, math.inf])
def test_a_non_finite_statistic_changes_nothing(n):
    sched = DensitySchedule(ADAPTIVE)
    _steps(sched, 0, ds.WINDOW)
    sched.decide(1.0, ds.WINDOW)
    _steps(sched, ds.WINDOW, 200)
    assert sched.decide(n, 210) is False
    assert sched.decide(5.0, 220) is False  # after a NaN window: no comparison either
    assert sched.decide(20.0, 230) is True


def test_fixed_is_the_target_and_dgc_warmup_is_one_setting_of_it():
    fixed = DensitySchedule(Config(scheme="topka", density=D, density_warmup=()))
    assert _steps(fixed, 0, 30) == [D] * 30
    # the default: the scheme's DGC warm-up (4 periods of 9 steps), then the target
    default = DensitySchedule(Config(scheme="topka", density=D))
    dgc = [D ** (e / 5) for e in (1, 2, 3, 4) for _ in range(9)]
    assert _steps(default, 0, 40) == pytest.approx(dgc + [D] * 4, rel=1e-12)
    warm = Config(scheme="topka", density=D, density_schedule="fixed",
                  density_warmup=(0.2, 0.05), density_warmup_steps=5)
    assert _steps(DensitySchedule(warm), 0, 12) == [0.2] * 5 + [0.05] * 5 + [D] * 2
    # with the adaptive schedule the larger of the two applies
    both = DensitySchedule(Config(scheme="topka", density=D, density_warmup=(0.2,),
                                  density_warmup_steps=5, density_schedule="adaptive"))
    assert _steps(both, 0, ds.WINDOW) == [0.2] * 5 + [HIGH] * (ds.WINDOW - 5)
    # a dense scheme has nothing to decide
    assert not DensitySchedule(Config(scheme="dense", density_schedule="adaptive")).adaptive


def test_config_names_the_schedules():
    with pytest.raises(ValueError, match="density_schedule must be one of"):
        Config(density_schedule="accordion")
    assert Config().density_schedule == "fixed"
    # a checkpoint's config saved before the key existed ran the fixed schedule
    assert Config().differences({}, ("density_schedule",)) == []
    assert Config(density_schedule="adaptive").differences({}, ("density_schedule",)) == [
        "density_schedule: saved 'fixed', here 'adaptive'"]


def test_state_round_trip_and_malformed_entry():
    cfg = Config(scheme="topka", density=D, density_schedule="adaptive", density_warmup=())
    sched = DensitySchedule(cfg)
    _steps(sched, 0, 20)
    sched.decide(3.0, 20)
    sched.observe(torch.ones(4))
    back = DensitySchedule.loaded(cfg, sched.state_dict())
    assert back.state_dict() == sched.state_dict()
    assert DensitySchedule.loaded(cfg, None).state_dict() == DensitySchedule(cfg).state_dict()
    with pytest.raises(ValueError, match="malformed density_schedule"):
        DensitySchedule.loaded(cfg, {"critical": True})


def _door_rank(rank, world_size, door):
    """Each rank trains a small MLP on its own data, its gradient norms differing, through the
    engine or the DDP hook; returns each step's density, bytes and what was critical."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))
    cfg = Config(scheme="ssfusion_oi", density=0.02, warmup_steps=1, seed=3,
                 density_schedule="adaptive", budget="blend")  # small tensors all-reduced
    g = torch.Generator().manual_seed(100 + rank)
    if door == "engine":
        sync = GradSync(model, cfg)
        step, state = sync.synchronize, None
        net = model
    else:
        net = nn.parallel.DistributedDataParallel(model)
        state = ddp.register(net, cfg)
        step = None
    out = []
    for s in range(3 * ds.WINDOW):
        x = torch.randn(16, 64, generator=g) * (1 + 3 * rank) * (1 + (s >= 15) * 4)
        net.zero_grad()
        net(x).square().mean().backward()
        if step is not None:
            step()
        stats = sync.stats() if door == "engine" else state.stats()
        d = stats["density"]
        last = sync.last.bytes_sent if door == "engine" else stats["last"]["bytes_sent"]
        out.append((d["critical"], d["critical_windows"], last))
    sched = sync._planning.density if door == "engine" else state.density
    return out, sched.state_dict(), sched.previous


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("door", ["engine", "hook"])
def test_every_rank_decides_alike_through_either_door(world_size, door):
    """Ranks see different gradient norms (rank r's inputs are 1 + 3r times larger), yet every
    rank takes the same regime at every step: the window's statistic is all-reduced. The norm
    rises fivefold at step 15, so the window after step 20 would be critical, but the byte cap
    forbids it this early."""
    out = run_distributed(_door_rank, world_size, door, timeout=300)
    regimes = [[(c, w) for c, w, _ in steps] for steps, _, _ in out]
    assert all(r == regimes[0] for r in regimes)
    prevs = [p for _, _, p in out]
    assert all(p == prevs[0] and p > 0 for p in prevs)
    # the first window critical, then the target: the cap keeps the norm's jump from paying
    assert [c for c, _ in regimes[0]][:ds.WINDOW - 1] == [True] * (ds.WINDOW - 1)
    assert [c for c, _ in regimes[0]][ds.WINDOW:] == [False] * (2 * ds.WINDOW)
    # the critical window sends more: 4× the density (the all-reduced small tensors aside)
    for steps, _, _ in out:
        sent = [b for _, _, b in steps]
        assert min(sent[2:ds.WINDOW - 1]) > 2 * max(sent[ds.WINDOW + 1:2 * ds.WINDOW - 1])
