"""Error feedback that follows the learning rate (``GradSync.follow(optimizer)``,
``HookState.follow(optimizer)``, :class:`gradsync.feedback.Units`): the residual is a debt of
update, so when a schedule moves the rate from η to η′ the residual is multiplied by η/η′ before
the step's gradient enters; velocities are not. Gradients here are known constants
(``loss = Σ W ⊙ C``, so ``∂loss/∂W = C`` whatever W is), which lets each step's accumulator be
written out from the previous step's residual."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsync.integrations.ddp
from conftest import conserved
from gradsync.engine import GradSync
from gradsync.engine.config import Config
from gradsync.feedback import ErrorFeedback, Units
from gradsync.optim import FrozenVarianceAdamW
from gradsync.testing import run_distributed

STEPS = 6


def _cfg(scheme: str) -> Config:
    # momentum 0: acc_t = f·residual_{t−1} + C_t exactly; compress_single_rank: P = 1 too
    return Config(scheme=scheme, density=0.1, momentum=0.0, sparsifier="topk",
                  compress_single_rank=True)


def _grad(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(32, 64, generator=g)


class _Known(nn.Module):
    """``forward(C) = Σ W ⊙ C``: the gradient of W is C (through DDP's forward, which the
    hook needs)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(32, 64))

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        return (self.weight * c).sum()


def _halving(model: nn.Module) -> tuple[torch.optim.SGD, torch.optim.lr_scheduler.LambdaLR]:
    """SGD whose rate halves every step: the residual doubles, exactly (a power of two)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.8)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 0.5 ** t)


def _engine(rank: int, P: int, follow: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    model = nn.Linear(64, 32, bias=False)
    records = []
    sync = GradSync(model, _cfg("topka"), audit=records.append)
    opt, sched = _halving(model)
    if follow:
        sync.follow(opt)
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        (model.weight * _grad(rank, step)).sum().backward()
        sync.synchronize()
        opt.step()
        sched.step()
    sync.close()
    assert len(records) == STEPS and conserved(records)
    return [(r.acc.clone(), r.residual.clone()) for r in records]


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_the_engine_doubles_the_residual_when_the_rate_halves(world_size):
    followed = run_distributed(_engine, world_size, True, timeout=120)
    plain = run_distributed(_engine, world_size, False, timeout=120)
    for rank, (got, ref) in enumerate(zip(followed, plain)):
        for t in range(1, STEPS):
            C = _grad(rank, t).reshape(-1)
            assert torch.equal(got[t][0], 2 * got[t - 1][1] + C)  # η/η′ = 2, bit for bit
            assert torch.equal(ref[t][0], ref[t - 1][1] + C)  # not following: as before
        assert any(not torch.equal(g[0], r[0]) for g, r in zip(got, ref))


def _hook(rank: int, P: int, follow: bool) -> float:
    """The largest gap over steps in Σ_ranks (residual_t + sent_t) = Σ_ranks (2·residual_{t−1}
    + C_t), with P·.grad standing for the ranks' sent values (.grad is their mean)."""
    model = _Known()
    net = DDP(model)
    state = gradsync.ddp.register(net, _cfg("per_tensor"), small_numel=0)
    opt, sched = _halving(model)
    if follow:
        state.follow(opt)
    held = torch.zeros(32 * 64)
    worst = 0.0
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        net(_grad(rank, step)).backward()
        residual = state.ef.residual("weight")
        now = (torch.zeros(32 * 64) if residual is None else residual.reshape(-1)).clone()
        lhs = now.clone()
        rhs = (2 if step else 1) * held + _grad(rank, step).reshape(-1)
        if P > 1:
            dist.all_reduce(lhs)
            dist.all_reduce(rhs)
        lhs += P * model.weight.grad.reshape(-1)
        worst = max(worst, float((lhs - rhs).abs().max()))
        held = now
        opt.step()
        sched.step()
    return worst


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_the_ddp_hook_doubles_the_residual_when_the_rate_halves(world_size):
    assert max(run_distributed(_hook, world_size, True, timeout=120)) < 1e-5
    assert max(run_distributed(_hook, world_size, False, timeout=120)) > 0.1


def test_rescale_residual_leaves_velocities_and_refuses_within_a_step():
    ef = ErrorFeedback(momentum=0.9, masking=False)
    g = torch.tensor([4.0, -1.0, 0.5, 2.0])
    acc = ef.accumulate("w", g)
    ef.update("w", acc, torch.tensor([0]))
    r, u = ef.residual("w").clone(), ef.velocity("w").clone()
    assert torch.equal(r, torch.tensor([0.0, -1.0, 0.5, 2.0]))
    ef.rescale_residual(4.0)
    assert torch.equal(ef.residual("w"), 4 * r) and torch.equal(ef.velocity("w"), u)
    ef.accumulate("w", g)
    with pytest.raises(ValueError, match="between steps only"):
        ef.rescale_residual(2.0)
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="finite and > 0"):
            ErrorFeedback().rescale_residual(bad)


def test_units_read_the_rates_and_ask_for_the_factor():
    calls: list[float] = []
    p, q = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([{"params": [p], "lr": 0.4}, {"params": [q], "lr": 0.04}])
    units = Units()
    units.follow(opt, "raise", "GradSync")  # no GradScaler: "raise" is fine

    def step(*rates: float) -> list[float]:
        for group, r in zip(opt.param_groups, rates):
            group["lr"] = r
        calls.clear()
        units.update(lambda f: pytest.fail("a loss-scale rescale without a scaler"),
                     calls.append)
        return list(calls)

    assert step(0.4, 0.04) == []  # the first step: the rates are read, nothing held yet
    assert step(0.1, 0.01) == [4.0]  # both groups a quarter: the residual ×4
    assert step(0.1, 0.01) == []
    assert step(0.0, 0.0) == [] and units.lr == (0.1, 0.01)  # a rate of 0 owes nothing
    assert step(math.inf, math.nan) == [] and units.lr == (0.1, 0.01)  # nor one not finite
    assert step(0.2, 0.02) == [0.5]  # from the held rates
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert step(0.1, 0.02) == [] and step(0.05, 0.04) == []  # uneven: left as they are
    assert len([w for w in seen if "different factors" in str(w.message)]) == 1
    assert units.lr == (0.05, 0.04)
    # another optimizer: the residual is still in the held rates, so the next step rescales
    # from them (a resumed or swapped optimizer at another rate)
    other = torch.optim.SGD([{"params": [p], "lr": 0.025}, {"params": [q], "lr": 0.02}])
    units.follow(other, "raise", "GradSync")
    calls.clear()
    units.update(lambda f: pytest.fail("a loss-scale rescale without a scaler"), calls.append)
    assert calls == [2.0] and units.lr == (0.025, 0.02)
    with pytest.raises(ValueError, match="need an 'lr' each"):
        Units().follow(type("O", (), {"param_groups": [{"params": []}]})(), "raise", "X")
    with pytest.raises(ValueError, match="GradScaler or an optimizer"):
        Units().follow(object(), "raise", "X")


def _saved(rank: int, P: int) -> None:
    model = nn.Linear(64, 32, bias=False)
    sync = GradSync(model, _cfg("topka"))
    opt, sched = _halving(model)
    sync.follow(opt)
    for step in range(2):
        opt.zero_grad(set_to_none=True)
        (model.weight * _grad(rank, step)).sum().backward()
        sync.synchronize()
        opt.step()
        sched.step()
    state = sync.state_dict()
    assert state["lr"] == [0.4]  # the rate the residual is in: step 1's
    again = GradSync(nn.Linear(64, 32, bias=False), _cfg("topka"))
    again.load_state_dict(state)
    assert again._units.lr == (0.4,)
    for bad in ([-1.0], "0.4", [math.nan], []):
        with pytest.raises(ValueError, match="saved lr"):
            again.load_state_dict(dict(state, lr=bad))
    again.load_state_dict({k: v for k, v in state.items() if k != "lr"})  # saved before it
    assert again._units.lr is None
    # FrozenVarianceAdamW given sync= follows itself
    adam = FrozenVarianceAdamW(again.params.values(), lr=1e-3, freeze_step=2, sync=again)
    assert again._units.optimizer is adam
    sync.close()
    again.close()


def test_the_rate_travels_in_the_state_dict_and_adamw_follows_itself():
    run_distributed(_saved, 1, timeout=120)
