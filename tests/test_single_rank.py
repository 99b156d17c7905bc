"""World size 1: nothing to send, so by default a step is what density 1 would be.

``Config.compress_single_rank=False`` (default): the engine installs no hooks and sparsifies
nothing, and the DDP hook sends every bucket whole. What does not depend on compression stays:
DGC's momentum (``.grad`` holds the velocity, so SGD without momentum then trains exactly as
SGD with it) and the non-finite policy. ``True`` compresses at P = 1 as at P ≥ 2 (the tests of
the pipeline on one process and ``bench overhead`` use it). The reference is torch's SGD on a
copy of the model.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import gradsync
from gradsync.testing import run_distributed


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 4))


def _batches(n: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 32, generator=g), torch.randn(16, 4, generator=g))
            for _ in range(n)]


def _train(model: nn.Module, step, momentum: float = 0.0) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    for x, y in _batches():
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        step()
        opt.step()


def _engine(rank: int, world_size: int, compress: bool) -> dict:
    model, ref = _model(), _model()
    sync = gradsync.GradSync(model, gradsync.Config(scheme="topka", density=0.05, momentum=0.9,
                                                    compress_single_rank=compress))
    _train(model, sync.synchronize)  # momentum lives in the config (DGC's correction)
    _train(ref, lambda: None, momentum=0.9)
    same = all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    out = {"same": same, "passthrough": sync.passthrough, "step": sync.step,
           "bytes": sync.stats()["total"]["bytes_sent"], "residuals": len(sync.ef.names())}
    sync.close()
    return out


def test_engine_at_world_size_1_is_sgd_with_momentum():
    (r,) = run_distributed(_engine, 1, False)
    assert r["passthrough"] and r["same"] and r["step"] == 4
    assert r["bytes"] == 0


def test_engine_at_world_size_1_compresses_when_asked():
    (r,) = run_distributed(_engine, 1, True)
    assert not r["passthrough"] and not r["same"]  # 5 % of the entries move per step
    assert r["residuals"] == 4 and r["step"] == 4


@pytest.mark.parametrize("policy", ["raise", "skip_step"])
def test_engine_at_world_size_1_keeps_the_nonfinite_policy(policy):
    model = _model()
    sync = gradsync.GradSync(model, gradsync.Config(nonfinite=policy))
    assert sync.passthrough
    model(torch.randn(2, 32)).sum().backward()
    next(model.parameters()).grad[0, 0] = float("nan")
    if policy == "raise":
        with pytest.raises(ValueError, match=r"non-finite gradient .*\['0.weight'\] at step 0"):
            sync.synchronize()
    else:
        assert sync.synchronize() is False
        assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters())
    model.zero_grad()
    model(torch.randn(2, 32)).sum().backward()
    assert sync.synchronize() is True and sync.step == 2


def test_engine_at_world_size_2_always_compresses():
    for r in run_distributed(_engine, 2, False):
        assert not r["passthrough"] and r["bytes"] > 0


def _hook(rank: int, world_size: int, compress: bool, door: str = "register") -> dict:
    model = _model()
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    ddp = nn.parallel.DistributedDataParallel(model)
    cfg = gradsync.Config(scheme="per_tensor", density=0.05, momentum=0.9,
                          compress_single_rank=compress)
    if door == "register":
        state = gradsync.ddp.register(ddp, cfg)
    else:  # the (state, hook) pair of frameworks with separate slots: the same at P = 1
        state, fn = gradsync.ddp.hook(cfg, model)
        ddp.register_comm_hook(state, fn)
    _train(ddp, lambda: None)  # momentum lives in the config (DGC's correction)
    _train(ref, lambda: None, momentum=0.9)
    same = all(torch.equal(p, q) for p, q in zip(ddp.parameters(), ref.parameters()))
    return {"same": same, "passthrough": state.model.passthrough,
            "bytes": state.stats()["total"]["bytes_sent"], "residuals": len(state.ef.names())}


@pytest.mark.parametrize("compress,door", [(False, "register"), (True, "register"),
                                           (False, "hook")])
def test_ddp_hook_at_world_size_1(compress, door):
    (r,) = run_distributed(_hook, 1, compress, door)
    assert r["passthrough"] is not compress
    assert r["same"] is not compress  # sent whole: DDP + SGD(momentum), bit for bit
    assert r["residuals"] > 0  # the velocities (and, compressing, the residuals)


def test_config_refuses_a_non_bool():
    with pytest.raises(ValueError, match="compress_single_rank must be True or False"):
        gradsync.Config(compress_single_rank=1)
