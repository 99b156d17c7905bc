"""A dynamic loss scale (``torch.amp.GradScaler``) with error feedback: the gradients arrive
multiplied by the scale S, so residuals and velocities hold S-scaled values; ``rescale(S'/S)``
after the scaler changes S keeps them meaningful. GradScaler's factors are powers of two, so a
scaled run with ``rescale`` ends bitwise where an unscaled run ends (top-k is scale-invariant,
and scaling by 2^j commutes with rounding). Without ``rescale`` it does not. At world size 1
the engine and the hook compress too (``Config.compress_single_rank``): by default they would
hold nothing to rescale."""

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
# path → (scheme, sparsifier). ``engine:reuse``: Ok-Topk, whose thresholds are reused between
# exact evaluations (the local one, τ′ = Config.local_tau_prime, in its selection; the global
# θ in its collective), in the units of the loss scale they were computed in, so rescaled
# with it. (The DDP hook's sparsifiers reuse none.)
SCHEME = {"engine": ("topka", "topk"), "hook": ("per_tensor", "topk"),
          "engine:reuse": ("oktopk", "topk")}
PATHS = list(SCHEME)


def _cfg(path: str, **kw) -> Config:
    scheme, sparsifier = SCHEME[path]
    # compress_single_rank: the world-size-1 cases run the pipeline (it matters only at P = 1)
    return Config(scheme=scheme, density=0.05, momentum=0.9, sparsifier=sparsifier,
                  compress_single_rank=True, **kw)


def _run(rank: int, P: int, path: str, scaled: bool, follow: bool | str, overflow: bool
         ) -> tuple[str, list[float]]:
    """``path``: "engine" (GradSync) or "hook" (DDP's comm hook, skip_step), with the scheme
    and sparsifier of ``SCHEME[path]``.
    ``scaled``: a GradScaler that doubles its scale every 2 good steps; ``follow``: call
    ``rescale`` when it changes (``"self"``: the engine or hook follows the scaler itself,
    ``follow(scaler)``). ``overflow``: an Inf on the last rank at BAD_STEP, which the scaler
    backs off from; the unscaled run leaves that step out."""
    model = build("mlp", seed=5)  # seeded, not the global RNG
    hook = path.startswith("hook")
    skip = {"nonfinite": "skip_step"} if hook or follow == "self" else {}
    net, state, sync = _owner(path, model, _cfg(path, **skip))
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
    if follow == "self":
        state.follow(scaler)
    scales = []
    for step in range(STEPS):
        bad = overflow and step == BAD_STEP
        if bad and not scaled:
            continue  # the reference never sees the overflow step
        poison["on"] = bad and rank == P - 1
        opt.zero_grad(set_to_none=True)
        x, y = image_batch(rank, step)
        scaler.scale(nn.functional.cross_entropy(net(x), y)).backward()
        if sync is not None:
            assert sync.synchronize() != bad  # False: the step overflowed on some rank
        before = scaler.get_scale() if scaled else 1.0
        scaler.step(opt)  # unscales; skips the step when a gradient is not finite
        scaler.update()
        after = scaler.get_scale() if scaled else 1.0
        scales.append(after)
        if follow is True and after != before:
            state.rescale(after / before)
    if sync is not None:
        sync.close()
    return parameter_digest(model)[0], scales


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_rescale_follows_a_grad_scaler_bit_for_bit(path, world_size):
    overflow = path.startswith("hook")  # the engine runs nonfinite="raise" here: no overflow

    def run(scaled: bool, follow: bool) -> list[tuple[str, list[float]]]:
        return run_distributed(_run, world_size, path, scaled, follow, overflow, timeout=240)

    ref, got, stale = run(False, False), run(True, True), run(True, False)
    scales = got[0][1]
    assert len(set(scales)) > 2  # the scale grew (and, on the hook's path, backed off)
    if overflow:
        assert scales[BAD_STEP] == scales[BAD_STEP - 1] / 2  # the scaler saw the overflow
    assert {d for d, _ in ref} == {d for d, _ in got} and len({d for d, _ in got}) == 1
    assert {d for d, _ in stale} != {d for d, _ in ref}  # without rescale: another run


@pytest.mark.parametrize("path", ["engine", "hook"])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_follow_a_grad_scaler_through_an_overflow_bit_for_bit(path, world_size):
    """``follow(scaler)``: the engine or the hook rescales by itself, and an overflow on one
    rank reaches the scaler (the engine leaves NaN in ``.grad``), which skips the step and
    halves its scale; the run ends bitwise where the unscaled run without that step ends.
    Not Ok-Topk's path: a skipped step leaves the residuals as they were, but it still counts
    on the clocks of its thresholds (exact every τ′ steps) and they still see its counts, so
    a run with the step and one without it select differently afterwards."""
    ref = run_distributed(_run, world_size, path, False, False, True, timeout=240)
    got = run_distributed(_run, world_size, path, True, "self", True, timeout=240)
    scales = got[0][1]
    assert len(set(scales)) > 2 and scales[BAD_STEP] == scales[BAD_STEP - 1] / 2
    assert {d for d, _ in ref} == {d for d, _ in got} and len({d for d, _ in got}) == 1


def _owner(path: str, model: nn.Module, cfg: Config):
    """(forward module, the owner of error feedback, its GradSync or None) for ``path``."""
    if path.startswith("engine"):
        sync = GradSync(model, cfg)
        return model, sync, sync
    net = DDP(model)
    return net, gradsync.ddp.register(net, cfg, small_numel=1000), None


def _follow_errors(rank: int, P: int, path: str) -> list[str]:
    errors = []
    for cfg, scaler in ((_cfg(path), torch.amp.GradScaler("cpu")),
                        (_cfg(path, nonfinite="skip_step"), object())):
        _, state, sync = _owner(path, build("mlp", seed=5), cfg)
        with pytest.raises(ValueError) as e:
            state.follow(scaler)
        errors.append(str(e.value))
        if sync is not None:
            sync.close()
    # a disabled scaler is no scaler: any policy may follow it
    _, state, sync = _owner(path, build("mlp", seed=5), _cfg(path))
    state.follow(torch.amp.GradScaler("cpu", enabled=False))
    if sync is not None:
        sync.close()
    return errors


@pytest.mark.parametrize("path", ["engine", "hook"])
def test_follow_needs_skip_step_and_a_scaler(path):
    (raise_policy, not_a_scaler), = run_distributed(_follow_errors, 1, path)
    assert "nonfinite='skip_step'" in raise_policy
    assert "GradScaler" in not_a_scaler


def _resume(rank: int, P: int, path: str) -> tuple[str, str]:
    """Four scaled steps, a checkpoint, then two more steps in a new engine or DDP hook whose
    scaler starts at another scale (its state not restored): the residuals the checkpoint
    holds are brought to the new scale at the first step, so the run ends where the run that
    kept its scaler ends, bit for bit (the scales are powers of two)."""
    def setup(init_scale: float):
        model = build("mlp", seed=5)
        net, state, sync = _owner(path, model, _cfg(path, nonfinite="skip_step"))
        scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=1000)
        state.follow(scaler)
        return model, net, state, sync, scaler, torch.optim.SGD(model.parameters(), lr=0.1)

    def train(model, net, sync, scaler, opt, steps):
        for step in steps:
            opt.zero_grad(set_to_none=True)
            x, y = image_batch(rank, step)
            scaler.scale(nn.functional.cross_entropy(net(x), y)).backward()
            if sync is not None:
                assert sync.synchronize()
            scaler.step(opt)
            scaler.update()

    model, net, state, sync, scaler, opt = setup(2.0 ** 10)
    train(model, net, sync, scaler, opt, range(4))
    saved, weights = state.state_dict(), {k: v.clone() for k, v in model.state_dict().items()}
    assert saved["loss_scale"] == 2.0 ** 10
    train(model, net, sync, scaler, opt, range(4, 6))
    kept = parameter_digest(model)[0]
    model, net, state, sync, scaler, opt = setup(2.0 ** 3)  # a fresh scaler, another scale
    model.load_state_dict(weights)
    state.load_state_dict(saved)
    train(model, net, sync, scaler, opt, range(4, 6))
    with pytest.raises(ValueError, match="loss_scale"):
        state.load_state_dict({**saved, "loss_scale": -1.0})
    return kept, parameter_digest(model)[0]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("world_size", [1, 2])
def test_a_resumed_owner_brings_its_residuals_to_the_new_scale(path, world_size):
    out = run_distributed(_resume, world_size, path, timeout=240)
    assert all(kept == resumed for kept, resumed in out)
    assert len({kept for kept, _ in out}) == 1


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
