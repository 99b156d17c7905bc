"""The DDP hook's policy for NaN/Inf gradients (``gradsync.ddp``, "Non-finite gradients"): a
non-finite gradient on one rank reaches every rank through the bucket's own collective, error
feedback keeps nothing of that step on any rank, and then ``Config.nonfinite`` decides:
``"raise"`` raises from ``backward()`` on every rank (DDP stays usable), ``"skip_step"`` leaves
the non-finite average in ``.grad`` on every rank, as plain DDP does, for the caller (or
``torch.amp.GradScaler``) to skip ``optimizer.step()``. Nothing hangs, and a run that skips the
bad step ends bitwise where a run without that step ends. At world size 1 the hook runs too
(``Config.compress_single_rank``; by default DDP would keep its own all-reduce)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsync.integrations.ddp
from conftest import image_batch
from gradsync.apps.models import build
from gradsync.engine.config import Config
from gradsync.engine.consistency import parameter_digest
from gradsync.testing import run_distributed

BAD_STEP = 1


def _ef_state(state) -> dict[str, torch.Tensor]:
    ef = state.ef.state_dict()
    return {f"{kind}:{n}": t.clone() for kind in ("residual", "velocity")
            for n, t in ef.get(kind, {}).items()}


def _run(rank: int, P: int, scheme: str, policy: str, steps: list[int], bad_rank: int,
         value: float) -> dict:
    model = build("mlp", seed=3)  # seeded, not the global RNG
    ddp = DDP(model)
    state = gradsync.ddp.register(ddp, Config(scheme=scheme, density=0.05, momentum=0.9,
                                              sparsifier="topk", nonfinite=policy,
                                              compress_single_rank=True),
                                  small_numel=1000)
    poison = {"on": False}

    def inject(g: torch.Tensor) -> torch.Tensor:  # runs before DDP sees the gradient
        if not poison["on"]:
            return g
        g = g.clone()
        g.view(-1)[5] = value
        return g

    next(model.parameters()).register_hook(inject)  # the first layer's weight
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out: dict = {"errors": [], "finite": [], "same_state": None}
    for step in steps:
        poison["on"] = step == BAD_STEP and rank == bad_rank
        before = _ef_state(state) if step == BAD_STEP else None
        opt.zero_grad(set_to_none=True)
        x, y = image_batch(rank, step)
        try:
            nn.functional.cross_entropy(ddp(x), y).backward()
            failed = False
        except RuntimeError as e:  # DDP re-raises the bucket's error
            out["errors"].append((step, str(e)))
            failed = True
        if before is not None:
            after = _ef_state(state)
            out["same_state"] = (before.keys() == after.keys() and bool(before)
                                 and all(torch.equal(before[k], after[k]) for k in before))
        if failed:
            continue
        finite = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
        out["finite"].append((step, finite))
        if finite:  # what GradScaler does: a non-finite step is not taken
            opt.step()
    out["digest"] = parameter_digest(model)[0]
    out["nonfinite"] = state.stats()["nonfinite_buckets"]
    return out


def _both(rank: int, P: int, scheme: str, policy: str, value: float) -> tuple[dict, dict]:
    bad = P - 1
    got = _run(rank, P, scheme, policy, [0, 1, 2, 3], bad, value)
    ref = _run(rank, P, scheme, policy, [0, 2, 3], bad, value)  # never saw the bad step
    return got, ref


@pytest.mark.usefixtures("kernels")
@pytest.mark.accelerator_at(world_size=3, scheme="per_tensor", policy="skip_step")
@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("scheme,value", [("dense", math.inf), ("per_tensor", math.nan),
                                          ("ssfusion", math.inf), ("ssfusion_oi", math.nan)])
@pytest.mark.parametrize("policy", ["raise", "skip_step"])
def test_hook_nonfinite_gradient_reaches_every_rank_and_keeps_nothing(world_size, scheme,
                                                                      value, policy):
    out = run_distributed(_both, world_size, scheme, policy, value, timeout=240)
    bad = world_size - 1
    digests = set()
    for rank, (got, ref) in enumerate(out):
        assert got["nonfinite"] == 1, got  # counted on every rank, once
        assert ref["nonfinite"] == 0
        assert got["same_state"] is True  # residuals and velocities as before the step
        if policy == "raise":
            assert [s for s, _ in got["errors"]] == [BAD_STEP], got["errors"]
            msg = got["errors"][0][1]
            assert "non-finite gradient" in msg and "in bucket 0 (" in msg
            assert "Config.nonfinite='raise'" in msg
            assert (f"on this rank ({rank})" in msg) == (rank == bad), msg
            assert ("on another rank" in msg) == (rank != bad), msg
            assert [s for s, ok in got["finite"]] == [0, 2, 3]
        else:
            assert not got["errors"]
            assert dict(got["finite"]) == {0: True, 1: False, 2: True, 3: True}
        assert all(ok for _, ok in got["finite"] if _ != BAD_STEP)
        # skipping the bad step leaves the run bitwise where a run without it ends
        assert got["digest"] == ref["digest"]
        digests.add(got["digest"])
    assert len(digests) == 1  # replicas identical


def _overflow(rank: int, P: int, policy: str) -> dict:
    """At step 1 on the last rank, an entry of the first layer's gradient and of its residual
    are finite (3e38) but their sum is not: the hook's selection sees an infinite accumulator."""
    model = build("mlp", seed=3)
    ddp = DDP(model)
    state = gradsync.ddp.register(ddp, Config(scheme="per_tensor", density=0.05,
                                              sparsifier="topk", nonfinite=policy,
                                              compress_single_rank=True), small_numel=1000)
    name, first = next(iter(model.named_parameters()))
    big = {"on": False}

    def inject(g: torch.Tensor) -> torch.Tensor:
        if not big["on"]:
            return g
        g = g.clone()
        g.view(-1)[:4] = 3e38
        return g

    first.register_hook(inject)
    out: dict = {"errors": [], "finite": []}
    for step in range(3):
        big["on"] = step == BAD_STEP and rank == P - 1
        if big["on"]:
            res = state.ef.residual(name)
            res.view(-1)[:4] = 3e38
            assert state.ef.residual(name).view(-1)[0] == 3e38  # held, not a copy
        ddp.zero_grad(set_to_none=True)
        x, y = image_batch(rank, step)
        try:
            nn.functional.cross_entropy(ddp(x), y).backward()
        except RuntimeError as e:
            out["errors"].append((step, str(e)))
            continue
        out["finite"].append((step, all(bool(torch.isfinite(p.grad).all())
                                        for p in model.parameters())))
    out["nonfinite"] = state.stats()["nonfinite_buckets"]
    return out


@pytest.mark.usefixtures("kernels")
@pytest.mark.accelerator_at(world_size=3, policy="raise")
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("policy", ["raise", "skip_step"])
def test_hook_overflowed_accumulator_applies_the_policy_on_every_rank(world_size, policy):
    """A gradient and a residual each finite whose sum overflows: the selection makes no
    finiteness read of its own (one rank raising there stranded its peers in the all-gather);
    the Inf it selects shows in the sum on every rank, where the policy applies."""
    out = run_distributed(_overflow, world_size, policy, timeout=120)
    for got in out:
        assert got["nonfinite"] == 1, got
        if policy == "raise":
            assert [s for s, _ in got["errors"]] == [BAD_STEP], got["errors"]
            assert "non-finite gradient" in got["errors"][0][1]
        else:
            assert not got["errors"] and dict(got["finite"]) == {0: True, 1: False, 2: True}
