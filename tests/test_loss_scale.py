"""A dynamic loss scale (``torch.amp.GradScaler``) with error feedback: the gradients arrive
multiplied by the scale S, so residuals and velocities hold S-scaled values; ``rescale(S'/S)``
after the scaler changes S keeps them meaningful. GradScaler's factors are powers of two, so a
scaled run with ``rescale`` ends bitwise where an unscaled run ends (top-k is scale-invariant,
and scaling by 2^j commutes with rounding). Without ``rescale`` it does not."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsync.integrations.ddp
from conftest import image_batch
from gradsync.apps.models import build
from gradsync.engine import GradSync
from gradsync.engine.config import Config
from gradsync.engine.consistency import parameter_digest
from gradsync.feedback import ErrorFeedback
from gradsync.testing import run_distributed

STEPS = 8
BAD_STEP = 5  # the hook runs: an overflow on the last rank, which the scaler backs off from


def _cfg(**kw) -> Config:
    return Config(scheme=kw.pop("scheme"), density=0.05, momentum=0.9, sparsifier="topk", **kw)


def _run(rank: int, P: int, path: str, scaled: bool, follow: bool) -> tuple[str, list[float]]:
    """``path``: "engine" (GradSync, topka) or "hook" (DDP + per_tensor hook, skip_step).
    ``scaled``: a GradScaler that doubles its scale every 2 good steps; ``follow``: call
    ``rescale`` when it changes. The unscaled run leaves the overflow step out."""
    model = build("mlp", seed=5)  # seeded, not the global RNG
    if path == "engine":
        net, sync = model, GradSync(model, _cfg(scheme="topka"))
        state = sync
    else:
        net, sync = DDP(model), None
        state = gradsync.ddp.register(net, _cfg(scheme="per_tensor", nonfinite="skip_step"),
                                      small_numel=1000)
    poison = {"on": False}

    def inject(g: torch.Tensor) -> torch.Tensor:
        if poison["on"]:
            g = g.clone()
            g.view(-1)[3] = math.inf
        return g

    next(model.parameters()).register_hook(inject)  # the first layer's weight
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2,
                                  enabled=scaled)
    scales = []
    for step in range(STEPS):
        bad = path == "hook" and step == BAD_STEP
        if bad and not scaled:
            continue  # the reference never sees the overflow step
        poison["on"] = bad and rank == P - 1
        opt.zero_grad(set_to_none=True)
        x, y = image_batch(rank, step)
        scaler.scale(nn.functional.cross_entropy(net(x), y)).backward()
        if sync is not None:
            assert sync.synchronize()
        before = scaler.get_scale() if scaled else 1.0
        scaler.step(opt)  # unscales; skips the step when a gradient is not finite
        scaler.update()
        after = scaler.get_scale() if scaled else 1.0
        scales.append(after)
        if follow and after != before:
            state.rescale(after / before)
    if sync is not None:
        sync.close()
    return parameter_digest(model)[0], scales


@pytest.mark.parametrize("path", ["engine", "hook"])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_rescale_follows_a_grad_scaler_bit_for_bit(path, world_size):
    def run(scaled: bool, follow: bool) -> list[tuple[str, list[float]]]:
        return run_distributed(_run, world_size, path, scaled, follow, timeout=240)

    ref, got, stale = run(False, False), run(True, True), run(True, False)
    scales = got[0][1]
    assert len(set(scales)) > 2  # the scale grew (and, on the hook's path, backed off)
    if path == "hook":
        assert scales[BAD_STEP] == scales[BAD_STEP - 1] / 2  # the scaler saw the overflow
    assert {d for d, _ in ref} == {d for d, _ in got} and len({d for d, _ in got}) == 1
    assert {d for d, _ in stale} != {d for d, _ in ref}  # without rescale: another run


def test_rescale_multiplies_what_is_held_and_is_checked():
    ef = ErrorFeedback(momentum=0.9, masking=False)
    acc = ef.accumulate("w", torch.tensor([1.0, -2.0, 3.0]))
    with pytest.raises(ValueError, match="between steps"):
        ef.rescale(2.0)
    ef.update("w", acc, torch.tensor([2]))
    ef.rescale(0.5)
    assert torch.equal(ef.residual("w"), torch.tensor([0.5, -1.0, 0.0]))
    assert torch.equal(ef.state_dict()["velocity"]["w"], torch.tensor([0.5, -1.0, 1.5]))
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="finite and > 0"):
            ef.rescale(bad)
