"""Preconditioned error feedback (issue 11, the language model): ``GradSync.precondition``, the
DDP hook's ``HookState.precondition`` and ``FrozenVarianceAdamW(sync=...)``.

The references do not use the code under test's preconditioning: the same training run without
it (``FrozenVarianceAdamW`` dividing by ``√v̂ + eps`` itself), and top-k picks worked out by hand.
The world-size-1 cases compress as at P ≥ 2 (``Config.compress_single_rank``).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from conftest import image_batch, pin_profiles
from gradsync.apps.models import build
from gradsync.engine import GradSync
from gradsync.engine.config import Config
from gradsync.integrations import ddp as gddp
from gradsync.optim import FrozenVarianceAdamW
from gradsync.testing import run_distributed

B1, LR, W, STEPS = 0.9, 1e-2, 3, 7


def _step(model: nn.Module, rank: int, step: int) -> None:
    x, y = image_batch(rank, step)
    model.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(x), y).backward()


def _dense_runs(rank: int, P: int, path: str) -> dict[str, float]:
    """Two runs from the same weights, gradients sent whole at every step (a density warm-up of
    1 that lasts the whole run), the variance frozen after step W: one preconditioned, one
    not. Returns the largest parameter difference after the freeze and the scales' spread."""
    pin_profiles(backward=True)
    base = build("mlp", seed=1)
    models, opts, engines = [], [], []
    for precondition in (False, True):
        model = copy.deepcopy(base)
        cfg = Config(scheme="topka" if path == "engine" else "per_tensor", density=0.05,
                     sparsifier="topk", momentum=B1, warmup_steps=1, density_warmup=(1.0,),
                     density_warmup_steps=STEPS + 1, compress_single_rank=True)
        if path == "engine":
            sync = GradSync(model, cfg)
            net = model
        else:
            net = nn.parallel.DistributedDataParallel(model, broadcast_buffers=False)
            sync = gddp.register(net, cfg)
        opt = FrozenVarianceAdamW(model.parameters(), lr=LR, betas=(B1, 0.999), freeze_step=W,
                                  sync=sync if precondition else None)
        models.append(net)
        opts.append(opt)
        engines.append(sync)
    worst = 0.0
    for step in range(STEPS):
        for net, opt, sync in zip(models, opts, engines):
            _step(net, rank, step)
            if path == "engine":
                sync.synchronize()
            opt.step()
        if step >= W:
            a, b = (list(m.parameters()) for m in models)
            worst = max(worst, max((p - q).abs().max().item() for p, q in zip(a, b)))
    scales = [s for s in (engines[1].ef.scale(n) for n in engines[1].ef.names()) if s is not None]
    spread = max(float(s.max() / s.min()) for s in scales)
    for sync in engines:
        if path == "engine":
            sync.close()
    return {"worst": worst, "spread": spread, "scaled": len(scales) == len(list(base.parameters()))}


@pytest.mark.parametrize("P", [1, 2, 3])
def test_sent_whole_preconditioning_changes_nothing_across_the_freeze(P: int) -> None:
    # the update is linear in what error feedback carries: sent whole, scaling it by 1/(√v̂+eps)
    # before and not dividing after is the same step, up to fp32 rounding. A velocity that were
    # not rescaled at the freeze would be off by the scale itself (10-1000x here).
    for out in run_distributed(_dense_runs, P, "engine", timeout=300):
        assert out["scaled"] and out["spread"] > 10, out  # the scales are not uniform
        # an Adam step moves an entry by about lr: 0.1 % of one step (a few dozen fp32 ulps)
        assert out["worst"] < 1e-3 * LR, out


@pytest.mark.parametrize("P", [2, 3])
def test_sent_whole_preconditioning_changes_nothing_in_the_ddp_hook(P: int) -> None:
    for out in run_distributed(_dense_runs, P, "hook", timeout=300):
        assert out["scaled"] and out["spread"] > 10, out
        assert out["worst"] < 1e-3 * LR, out


class _Two(nn.Module):
    """Two parameters whose gradients are fixed: ``a``'s entries 1, ``b``'s 0.001."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.zeros(8))
        self.b = nn.Parameter(torch.zeros(8))

    def forward(self) -> torch.Tensor:
        return self.a.sum() + 1e-3 * self.b.sum()


def _selection(rank: int, P: int, precondition: bool) -> dict[str, list[float]]:
    pin_profiles(backward=True)
    model = _Two()
    # one fused buffer of 16 entries at density 1/4: k = 4 entries per rank
    sync = GradSync(model, Config(scheme="topka", density=0.25, warmup_steps=1,
                                  bucket_mb=1.0, compress_single_rank=True,
                                  density_warmup=()))  # k = 4 from the first sparse step
    for step in range(3):  # the warm-up steps, then the plan's
        if step == 2 and precondition:
            sync.precondition({model.a: torch.ones(8), "b": torch.full((8,), 1e4)})
        model.zero_grad(set_to_none=True)
        model().backward()
        sync.synchronize()
    out = {"a": model.a.grad.tolist(), "b": model.b.grad.tolist()}
    sync.close()
    return out


@pytest.mark.parametrize("P", [1, 2])
def test_the_selection_ranks_scaled_entries(P: int) -> None:
    plain = run_distributed(_selection, P, False, timeout=120)[0]
    scaled = run_distributed(_selection, P, True, timeout=120)[0]
    # raw magnitudes: a's 1 beats b's 0.001, so only a's entries travel
    assert sum(v != 0 for v in plain["a"]) >= 4 and not any(plain["b"]), plain
    # scaled by 1e4, b's entries (10) beat a's (1): b travels, preconditioned (0.001·1e4 plus
    # its residual of the earlier steps, also scaled), a stays in its residual
    assert not any(scaled["a"]) and sum(v != 0 for v in scaled["b"]) == 4, scaled
    assert all(v == pytest.approx(30.0) for v in scaled["b"] if v), scaled


def _mismatch(rank: int, P: int) -> str:
    model = build("mlp", seed=1)
    sync = GradSync(model, Config(scheme="topka", density=0.05, warmup_steps=1))
    p = next(iter(model.parameters()))
    try:
        sync.precondition({p: torch.full(p.shape, 1.0 + (rank == P - 1))})
    except ValueError as e:
        return str(e)
    finally:
        sync.close()
    return "no error"


@pytest.mark.parametrize("P", [2, 3])
def test_scales_that_differ_across_ranks_fail_on_every_rank(P: int) -> None:
    for msg in run_distributed(_mismatch, P, timeout=120):
        assert "differ across ranks" in msg and f"ranks [{P - 1}]" in msg, msg


def _resume(rank: int, P: int) -> dict[str, bool]:
    pin_profiles(backward=True)
    model = build("mlp", seed=1)
    cfg = Config(scheme="topka", density=0.05, sparsifier="topk", momentum=B1, warmup_steps=1)
    sync = GradSync(model, cfg)
    for step in range(3):
        _step(model, rank, step)
        sync.synchronize()
    scales = {p: torch.rand(p.shape, generator=torch.Generator().manual_seed(i)) + 0.5
              for i, p in enumerate(model.parameters())}
    sync.precondition(scales)
    state = copy.deepcopy(sync.state_dict())
    twin = copy.deepcopy(model)
    again = GradSync(twin, cfg)
    again.load_state_dict(state)
    same = True
    for step in range(3, 5):
        for m, s in ((model, sync), (twin, again)):
            _step(m, rank, step)
            s.synchronize()
        same &= all(torch.equal(p.grad, q.grad)
                    for p, q in zip(model.parameters(), twin.parameters()))
    # a checkpoint saved before scales existed loads, with none
    fresh = GradSync(copy.deepcopy(model), cfg)
    fresh.load_state_dict({**state, "feedback": {k: v for k, v in state["feedback"].items()
                                                 if k != "scale"}})
    unscaled = all(fresh.ef.scale(n) is None for n in fresh.params)
    for s in (sync, again, fresh):
        s.close()
    return {"same": same, "saved": len(state["feedback"]["scale"]) == len(scales),
            "old_loads_unscaled": unscaled}


def test_scales_are_part_of_the_engines_state() -> None:
    for out in run_distributed(_resume, 2, timeout=120):
        assert out == {"same": True, "saved": True, "old_loads_unscaled": True}


def _mid_step(rank: int, P: int) -> str:
    model = build("mlp", seed=1)
    # one rank, compressing: its gradient hooks are what mark a step in progress
    sync = GradSync(model, Config(scheme="topka", density=0.05, warmup_steps=1,
                                  compress_single_rank=True))
    _step(model, rank, 0)  # backward done, synchronize() not yet called
    p = next(iter(model.parameters()))
    try:
        sync.precondition({p: torch.ones(p.shape)})
        return "no error"
    except ValueError as e:
        return str(e)
    finally:
        sync.synchronize()
        sync.close()


def test_precondition_refuses_a_step_in_progress() -> None:
    assert "in progress" in run_distributed(_mid_step, 1, timeout=60)[0]


@pytest.mark.parametrize("scale, what", [(torch.zeros(3), "> 0"),
                                         (torch.tensor([1.0, float("nan"), 1.0]), "finite"),
                                         (torch.ones(4), "shape"),
                                         (torch.ones(3, dtype=torch.int64), "floating")])
def test_bad_scales_are_refused_before_anything_changes(scale, what) -> None:
    model = nn.Linear(3, 1, bias=False)
    sync = GradSync(model, Config(scheme="topka", density=0.5, warmup_steps=1))
    try:
        with pytest.raises(ValueError, match=what):
            sync.precondition({model.weight: scale.reshape(1, -1) if scale.numel() == 3
                               else scale})
        assert sync.ef.scale("weight") is None
    finally:
        sync.close()


def test_the_optimizer_refuses_a_sync_without_precondition() -> None:
    with pytest.raises(ValueError, match="precondition"):
        FrozenVarianceAdamW([nn.Parameter(torch.zeros(2))], sync=object())


@pytest.mark.parametrize("door", ["engine", "hook", "hook without a model"])
def test_keys_that_name_no_synchronized_parameter_are_refused(door: str) -> None:
    """Both doors resolve keys alike (``engine.preconditioning.resolver``): a name that is not
    one of the model's, a key that is neither a parameter nor a name, and (the engine) a
    parameter it does not synchronize, each refused before anything changes."""
    model, stranger = nn.Linear(3, 1, bias=False), nn.Parameter(torch.ones(2))
    if door == "engine":
        sync = GradSync(model, Config(scheme="topka", density=0.5, warmup_steps=1))
        bad = [("bias", "no parameter named 'bias'"), (3, "keys are parameters or their names"),
               (stranger, "a parameter GradSync does not synchronize")]
    else:
        sync, _ = gddp.hook(Config(scheme="per_tensor", density=0.5),
                            model if door == "hook" else None)
        bad = [("bias", "no parameter named 'bias'" + ("" if door == "hook"
                                                      else " (names need the model)")),
               (3, "keys are parameters or their names")]
    try:
        for key, message in bad:
            with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
                sync.precondition({key: torch.ones(2)})
        assert sync.ef.scale("weight") is None
    finally:
        if door == "engine":
            sync.close()
