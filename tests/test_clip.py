"""DGC's local gradient clipping (``Config.clip_norm``, ``gradsync.feedback.clip_local``).

Each rank's gradient is clipped per tensor to an L2 norm of ``clip_norm / √P`` before it
enters error feedback, in the engine and in the DDP hook. The reference is torch's own
``clip_grad_norm_`` applied to each tensor alone with that threshold, then averaged over the
ranks by hand: at density 1 every entry is sent, so ``.grad`` after ``synchronize()`` must be
that average.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradsync
from gradsync.feedback import clip_local
from gradsync.testing import run_distributed


def _reference(grads: list[torch.Tensor], threshold: float) -> list[torch.Tensor]:
    out = []
    for g in grads:
        t = nn.Parameter(torch.zeros_like(g))
        t.grad = g.clone()
        torch.nn.utils.clip_grad_norm_([t], threshold)
        out.append(t.grad)
    return out


def test_clip_local_is_per_tensor_clip_grad_norm_at_the_scaled_threshold():
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(50, generator=g) * s for s in (0.01, 1.0, 30.0)] + [torch.zeros(7)]
    before = [x.clone() for x in grads]
    for P in (1, 4):
        got = clip_local(grads, 2.0, P)
        want = _reference(grads, 2.0 / math.sqrt(P))
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=0)
        norms = [float(x.norm()) for x in got]
        assert max(norms) <= 2.0 / math.sqrt(P) * (1 + 1e-5)
        assert torch.equal(got[0], grads[0])  # a small tensor is left as it is
    assert all(torch.equal(a, b) for a, b in zip(grads, before))  # inputs untouched
    assert clip_local([], 1.0, 2) == []


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 3))


def _run(rank: int, world_size: int, kind: str, clip: float | None) -> dict:
    model = _model()
    cfg = gradsync.Config(scheme="topka" if kind == "engine" else "per_tensor", density=1.0,
                          clip_norm=clip, compress_single_rank=True)
    g = torch.Generator().manual_seed(10 + rank)
    x, y = torch.randn(8, 16, generator=g) * (1 + 5 * rank), torch.randn(8, 3, generator=g)
    if kind == "engine":
        sync = gradsync.GradSync(model, cfg)
        nn.functional.mse_loss(model(x), y).backward()
        grads = [p.grad.detach().clone().reshape(-1) for p in model.parameters()]
        sync.synchronize()
        out = [p.grad.detach().clone().reshape(-1) for p in model.parameters()]
        sync.close()
    else:
        ddp = nn.parallel.DistributedDataParallel(model)
        gradsync.ddp.register(ddp, cfg)
        ref = _model()
        nn.functional.mse_loss(ref(x), y).backward()
        grads = [p.grad.detach().reshape(-1) for p in ref.parameters()]
        nn.functional.mse_loss(ddp(x), y).backward()
        out = [p.grad.detach().clone().reshape(-1) for p in model.parameters()]
    threshold = clip / math.sqrt(world_size) if clip is not None else None
    mine = _reference(grads, threshold) if clip is not None else grads
    want = []
    for t in mine:  # the average over ranks, by hand
        t = t.clone()
        dist.all_reduce(t)
        want.append(t / world_size)
    return {"max_err": max(float((a - b).abs().max()) for a, b in zip(out, want)),
            "clipped": clip is not None and any(
                float(a.norm()) > threshold * 1.01 for a in grads)}


@pytest.mark.parametrize("kind", ["engine", "hook"])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_synchronized_gradient_is_the_average_of_clipped_ones(kind, world_size):
    for r in run_distributed(_run, world_size, kind, 0.5):
        assert r["clipped"], "the test must clip something"
        assert r["max_err"] < 1e-6, r
    for r in run_distributed(_run, world_size, kind, None):  # off: the plain average
        assert r["max_err"] < 1e-6, r


def test_config_validates_clip_norm():
    for bad in (0, -1.0, math.inf, math.nan, True, "1"):
        with pytest.raises(ValueError, match="clip_norm"):
            gradsync.Config(clip_norm=bad)
    assert gradsync.Config(clip_norm=1).clip_norm == 1
