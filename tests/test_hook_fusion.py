"""The DDP hook's merged buckets (``engine/pipeline.py``, "Merged buckets"): with the CPU's own
kernels at P > 1 the hook puts "each sparse bucket its own collectives" (split) on trial
against "the step's sparse buckets in one set, at its last bucket" (merged), by the A-B-B-A
rule of ``engine/trial.py``. The two sides differ in when and in how many calls the
collectives run, not in what they compute: training is bit for bit the same."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsync.integrations.ddp
from conftest import image_batch
from gradsync.apps.models import build
from gradsync.engine.config import Config
from gradsync.engine.consistency import parameter_digest
from gradsync.engine.trial import FUSION_SIDES, TRIAL_STEPS
from gradsync.testing import run_distributed


def _verdict(state, side: str) -> None:
    """A trial that is over, with ``side`` kept, from step 0 on."""
    state.fusion.trial = {"start": 0, "rounds": 1, "verdict": side,
                          "times": {k: [] for k in FUSION_SIDES}}


def _hook(rank: int, cfg: Config, unused: bool = False):
    model = build("cnn", seed=4)  # 0.1 MB buckets: several a step
    ddp = DDP(model, bucket_cap_mb=0.1, find_unused_parameters=unused)
    return model, ddp, gradsync.ddp.register(ddp, cfg, small_numel=1000)


def _side(rank: int, world_size: int, scheme: str, side: str, unused: bool) -> dict:
    """Five steps on one side of the trial, with momentum and clipping."""
    # no warm-up: its first period's selection, all-reduced (engine.jobs.at_density), is
    # summed per bucket on one side and at the last bucket on the other: at P = 3 in another
    # order
    model, ddp, state = _hook(rank, Config(scheme=scheme, density=0.02, momentum=0.9,
                                           clip_norm=1.0, density_warmup=()), unused)
    _verdict(state, side)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    calls = []
    for step in range(5):
        opt.zero_grad(set_to_none=True)
        x, y = image_batch(rank, step, 16)
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        calls.append(state.stats()["calls"])
    return {"digest": parameter_digest(model)[0], "residual": state.ef.state_dict(),
            "calls": calls, "missing": state.counts.missing, "tensors": state.counts.tensors,
            "sent": state.stats()["total"]["bytes_sent"],
            "thread": state.scratch.thread is not None}


@pytest.mark.parametrize("world_size,scheme,unused", [(3, "ssfusion_oi", False),
                                                      (3, "per_tensor", True),
                                                      (2, "ssfusion", False)])
def test_merged_buckets_train_bit_for_bit_as_split_ones(world_size, scheme, unused):
    """Merged, a step makes one call of collectives instead of one per bucket and sends less
    (one count exchange); parameters, residuals, velocities and missing tensors are those of
    the split side bit for bit, and the replicas stay alike. At P = 3 a ring all-reduce sums
    an entry in an order its buffer's layout sets: ``ssfusion_oi``'s all-reduce part, merged,
    is still one all-reduce per bucket (one of them all would round differently)."""
    split = run_distributed(_side, world_size, scheme, "split", unused, timeout=300)
    merged = run_distributed(_side, world_size, scheme, "merged", unused, timeout=300)
    for s, m in zip(split, merged):
        assert s["calls"][1] - s["calls"][0] > 1, s["calls"]  # several buckets a step
        assert m["calls"] == [1, 2, 3, 4, 5]
        assert s["thread"] and not m["thread"]  # nothing left for the hook's thread
        assert m["digest"] == s["digest"]
        assert m["missing"] == s["missing"] and m["tensors"] == s["tensors"]
        assert 0 < m["sent"] < s["sent"]
        assert m["residual"].keys() == s["residual"].keys()
        for kind in ("residual", "velocity"):
            a, b = m["residual"][kind], s["residual"][kind]
            assert a.keys() == b.keys() and a
            assert all(torch.equal(a[n].reshape(-1), b[n].reshape(-1)) for n in a), kind
    assert len({m["digest"] for m in merged}) == 1


def _trial(rank: int, world_size: int, slow: str) -> dict:
    """The trial on a real loopback, timed by an injected clock: a step takes 100 ms, and
    250 ms more on the side ``slow``, however loaded the machine is."""
    model, ddp, state = _hook(rank, Config(scheme="per_tensor", density=0.02))
    now = [0.0]
    state.fusion.clock = lambda: now[0]
    modes, ran, calls = [], [], [0]
    for step in range(4 * TRIAL_STEPS + 5):
        mode = state.fusion.mode(state.counts.steps)
        now[0] += 0.1 + (0.25 if mode == slow else 0.0)
        ddp.zero_grad(set_to_none=True)
        x, y = image_batch(rank, step, 16)
        nn.functional.cross_entropy(ddp(x), y).backward()
        modes.append(mode)
        ran.append(state.fusion.mode(step))  # what it ran: a verdict at its first bucket too
        calls.append(state.stats()["calls"])
    fresh, _ = gradsync.ddp.hook(Config(scheme="per_tensor", density=0.02), model=model,
                                 small_numel=1000)
    fresh.load_state_dict(state.state_dict())
    assert state.stats()["buckets"] == state.fusion.trial["verdict"]
    return {"modes": modes, "ran": ran, "calls": [b - a for a, b in pairwise(calls)],
            "trial": state.fusion.trial, "resumed": fresh.fusion.trial}


@pytest.mark.parametrize("slow,verdict", [("split", "merged"), ("merged", "split")])
def test_the_hook_measures_merged_buckets_against_split_ones(slow, verdict):
    """A-B-B-A windows from the step after the first with a bucket before the last (DDP
    reduces step 0 in one bucket here, and rebuilds its buckets after it), then the faster
    side on every rank; a merged step makes one call, a split one a call per bucket; the
    trial is saved and restored with the hook's state."""
    w = TRIAL_STEPS
    for r in run_distributed(_trial, 2, slow, timeout=300):
        start = r["trial"]["start"]
        assert r["trial"]["verdict"] == verdict and r["resumed"] == r["trial"]
        assert start == 2 and r["calls"][0] == 1 and r["calls"][1] > 1
        assert r["modes"][:start + 4 * w] == (["split"] * (start + w) + ["merged"] * (2 * w)
                                              + ["split"] * w)
        assert set(r["modes"][start + 1 + 4 * w:]) == {verdict}
        for mode, n in list(zip(r["ran"], r["calls"]))[1:]:
            assert (n == 1) == (mode == "merged"), (mode, n)


def _failures(rank: int, world_size: int, side: str) -> dict:
    """A NaN in the first bucket (held when merged; step 1, rank 0) and a collective that
    raises at the last bucket, in the hook (step 3, every rank); ``nonfinite="raise"``."""
    from gradsync.engine import pipeline

    real = pipeline.BufferPipeline._launch

    def launch(self, parts, here):
        if self.owner.counts.steps == 3 and self.last:
            raise RuntimeError("injected: the peer is gone")
        return real(self, parts, here)

    pipeline.BufferPipeline._launch = launch
    model, ddp, state = _hook(rank, Config(scheme="per_tensor", density=0.02, momentum=0.9,
                                           nonfinite="raise"))
    _verdict(state, side)
    last = list(model.parameters())[-1]  # bucket 0: held for the last one
    last.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("nan"))
                       if state.counts.steps == 1 and rank == 0 else g)
    out: dict = {"errors": [], "kept": []}
    for step in range(6):
        before = {k: v.clone() for k, v in state.ef.state_dict()["velocity"].items()}
        ddp.zero_grad(set_to_none=True)
        x, y = image_batch(rank, step, 16)
        try:
            nn.functional.cross_entropy(ddp(x), y).backward()
        except Exception as e:  # the step's error, through DDP
            out["errors"].append((step, str(e)))
            after = state.ef.state_dict()["velocity"]
            out["kept"].append(before.keys() == after.keys() and all(
                torch.equal(before[k], after[k]) for k in before))
    out["digest"] = parameter_digest(model)[0]
    out["steps"] = state.counts.steps
    return out


@pytest.mark.parametrize("side", FUSION_SIDES)
def test_a_failed_step_fails_backward_on_every_rank_and_the_next_steps_train(side):
    """A step that fails (a NaN in the first bucket on one rank, or a collective that raises
    at the last) fails ``backward()`` on every rank, leaves error feedback as before the step
    and no bucket pending: the next steps train, the replicas alike. Before, a collective that
    raised in the last bucket's hook left DDP's reducer broken for every later step."""
    out = run_distributed(_failures, 2, side, timeout=300)
    for r in out:
        assert [s for s, _ in r["errors"]] == [1, 3], [e[:300] for _, e in r["errors"]]
        assert "non-finite" in r["errors"][0][1]
        assert "injected: the peer is gone" in r["errors"][1][1]
        assert r["kept"] == [True, True] and r["steps"] == 6
    assert out[0]["digest"] == out[1]["digest"]


def test_the_merged_buckets_trial_is_checked_on_load():
    """The trial travels in the hook's state as ``"fusion"``: restored as saved, absent (a
    state saved before it) as no trial yet, and refused, changing nothing, when malformed."""
    model = build("cnn", seed=4)
    state, _ = gradsync.ddp.hook(Config(scheme="per_tensor", density=0.02), model=model)
    state.fusion.trial = {"start": 2, "rounds": 1, "verdict": None,
                          "times": {"split": [0.1, 0.2], "merged": [0.3]}}
    state.counts.steps = 8  # in the second window: merged
    sd = state.state_dict()
    fresh, _ = gradsync.ddp.hook(Config(scheme="per_tensor", density=0.02), model=model)
    fresh.load_state_dict(sd)
    assert fresh.fusion.trial == state.fusion.trial and fresh.stats()["buckets"] == "merged"
    for bad in ({"start": 2}, {**sd["fusion"], "verdict": "dense"},
                {**sd["fusion"], "times": {"model": [], "dense": []}}):
        with pytest.raises(ValueError, match="trial"):
            fresh.load_state_dict({**sd, "fusion": bad})
    assert fresh.fusion.trial == state.fusion.trial  # nothing changed
    fresh.load_state_dict({k: v for k, v in sd.items() if k != "fusion"})
    assert fresh.fusion.trial is None and fresh.stats()["buckets"] == "split"
