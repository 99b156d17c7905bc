"""Faults: a dead or stalled peer, and mismatched set-ups across ranks.

A rank that dies (``os._exit``) or stalls (sleeps inside its backward pass) mid-step must make
the surviving ranks fail within the configured timeout — the engine's ``Config.timeout_s``, the
DDP hook's process group timeout, the FSDP2/TAGC mesh's group timeout — with an error that says
what happened (a timeout or a lost peer), never hang. ``run_distributed``'s own timeout is much
larger than the ranks' timeouts, so what is observed is the ranks' own error, not the harness
killing them. Survivors write what they saw to a file (a dead rank makes ``run_distributed``
raise, which would lose their return values).

Mismatched configurations (model shapes, scheme, density, dtype, layers, check_every) must be
detected at ``GradSync`` construction on every rank, with an error naming the difference; the
DDP hook (scheme, density) at registration and TAGC (sketch seed, ratio) at ``compress``.
"""

from __future__ import annotations

import json
import os
import re
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from conftest import image_batch
from gradsync.apps.models import build
from gradsync.engine import GradSync
from gradsync.engine.config import Config
from gradsync.testing import DistributedError, run_distributed

RANK_TIMEOUT_S = 5.0  # the ranks' own collective timeout
HARNESS_TIMEOUT_S = 150.0  # run_distributed's: far above the ranks' own
# what a surviving rank's error must say: a timeout, or that a peer went away
PEER_FAILURE = re.compile(r"time[d ]?out|timed out|closed|reset|peer|broken pipe|connection",
                          re.IGNORECASE)
# what the backend says for each (the library's hint after it names both, so not in these)
TIMED_OUT = re.compile(r"timed out|timeout caused", re.IGNORECASE)
GONE = re.compile(r"closed|reset|broken pipe", re.IGNORECASE)
FAULTY = 1  # the rank that dies or stalls


def _write(outdir: str, rank: int, tag: str, res: dict) -> None:
    p = Path(outdir) / f"{tag}-rank{rank}.json"
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps(res))
    tmp.replace(p)


def _read(outdir: str, tag: str, ranks) -> dict[int, dict]:
    out = {}
    for r in ranks:
        p = Path(outdir) / f"{tag}-rank{r}.json"
        if p.exists():
            out[r] = json.loads(p.read_text())
    return out


class _GiveUp(Exception):
    """Raised by the stalled rank once the survivors have reported: ends its step at once."""


def _survivors_reported(outdir: str, tag: str, world_size: int) -> bool:
    others = [r for r in range(world_size) if r != FAULTY]
    return len(_read(outdir, tag, others)) == len(others)


def _inject(first_layer: nn.Module, fault: str, outdir: str, tag: str, world_size: int):
    """Make this rank die or stall in the middle of its backward pass.

    The hook sits on ``first_layer``'s output, so it fires during backward after the later
    layers' gradients exist (their communication may already be in flight) and before
    ``first_layer``'s own. (A hook on the parameter would not fire under FSDP2, whose forward
    uses the unsharded parameter, not the registered one.) A stall lasts until every survivor
    has reported (at most 60 s), then abandons the step.
    """

    def grad_hook(g):
        if fault == "die":
            os._exit(3)
        deadline = time.monotonic() + 60.0
        while time.monotonic() < deadline and not _survivors_reported(outdir, tag, world_size):
            time.sleep(0.05)
        raise _GiveUp("stalled rank gives up")

    def fwd_hook(module, inputs, output):
        output.register_hook(grad_hook)

    return first_layer.register_forward_hook(fwd_hook)


def _engine_setup(scheme: str):
    model = build("mlp", seed=0, hidden=32)
    sync = GradSync(model, Config(scheme=scheme, density=0.05, sparsifier="topk",
                                  warmup_steps=1, timeout_s=RANK_TIMEOUT_S))

    def step(x, y):
        nn.functional.cross_entropy(model(x), y).backward()
        sync.synchronize()

    return model, step, sync.group, sync.close


def _ddp_setup(scheme: str):
    """DDP over a short-timeout group with gradsync's comm hook (small buckets: several)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradsync.integrations.ddp

    group = dist.new_group(timeout=timedelta(seconds=RANK_TIMEOUT_S))
    model = build("mlp", seed=0, hidden=32)
    ddp = DDP(model, process_group=group, bucket_cap_mb=0.01)
    gradsync.ddp.register(ddp, Config(scheme=scheme, density=0.05, sparsifier="topk"),
                          small_numel=1000)

    def step(x, y):
        nn.functional.cross_entropy(ddp(x), y).backward()

    return model, step, group, lambda: None


def _fsdp_setup(scheme: str):
    """fully_shard on a mesh over a short-timeout group, TAGC on every unit."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from gradsync.integrations.fsdp import TAGCConfig, all_layers, compress

    group = dist.new_group(timeout=timedelta(seconds=RANK_TIMEOUT_S))
    mesh = DeviceMesh.from_group(group, "cpu")
    model = build("mlp", seed=0, hidden=32)
    for layer in (model.net[1], model.net[3]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    compress(model, TAGCConfig(ratio=2, theta=0.9, policy=all_layers))

    def step(x, y):
        nn.functional.cross_entropy(model(x), y).backward()

    return model, step, group, lambda: None


SETUPS = {"engine": _engine_setup, "ddp": _ddp_setup, "fsdp": _fsdp_setup}


def _tag(path: str, scheme: str, fault: str) -> str:
    return f"{path}-{scheme}-{fault}"


def _faults(rank: int, world_size: int, cases: list[tuple[str, str, str]], outdir: str):
    """Per (path, scheme, fault): 2 good steps, then FAULTY dies/stalls in step 2's backward.

    Survivors record their error (type, message, traceback, seconds since the step began),
    write it to ``outdir`` and destroy the case's group, which also releases the stalled rank's
    pending collectives; then every rank moves on to the next case on fresh groups. A death
    ends the process, so a "die" case must come last.
    """
    for path, scheme, fault in cases:
        tag = _tag(path, scheme, fault)
        model, step_fn, group, close = SETUPS[path](scheme)
        res: dict = {"rank": rank, "outcome": "finished"}
        t_fault = None
        for step in range(4):
            model.zero_grad()
            x, y = image_batch(rank, step)
            handle = None
            if step == 2:
                t_fault = time.monotonic()
                if rank == FAULTY:
                    handle = _inject(model.net[1], fault, outdir, tag, world_size)
            try:
                step_fn(x, y)
            except Exception as e:  # the survivors' error is what this test is about
                res.update(outcome="raised", type=type(e).__name__, msg=str(e)[:2000],
                           tb=traceback.format_exc(), step=step,
                           after_s=time.monotonic() - (t_fault or time.monotonic()))
                break
            finally:
                if handle is not None:
                    handle.remove()
        if rank != FAULTY:
            _write(outdir, rank, tag, res)  # before close(): a stuck close must not hide it
        t0 = time.monotonic()
        close()
        res["close_s"] = time.monotonic() - t0
        if rank != FAULTY:
            _write(outdir, rank, tag + "-closed", res)
        # drop the DDP/FSDP/engine objects before their group: a DDP whose group was
        # destroyed first can hang in its destructor
        del model, step_fn, close
        dist.destroy_process_group(group)
    return "done"


def _check_survivors(outdir: str, tag: str, world_size: int, fault: str,
                     where: str | None = None) -> None:
    """Every survivor raised in step 2, saying why, within the rank timeout (+ slack).

    A stalled peer is noticed by the ranks' own timeout: its error says so, and it came no
    earlier than the timeout allows (a lower bound the timeout guarantees: no margin). A dead
    peer is noticed when its sockets close: its error says that, not a timeout. ``where``: a
    file that must appear in the survivor's traceback (the path whose collective noticed).
    Closing the engine afterwards must not wait on the dead collectives: every survivor wrote
    its "closed" record, which a hung close() never does (the harness's timeout then fails it).
    """
    survivors = [r for r in range(world_size) if r != FAULTY]
    got = _read(outdir, tag, survivors)
    assert sorted(got) == survivors, f"{tag}: survivors that did not report: " \
        f"{sorted(set(survivors) - set(got))}"
    closed = _read(outdir, tag + "-closed", survivors)
    for r, res in got.items():
        assert res["outcome"] == "raised", f"{tag} rank {r}: {res}"
        assert res["step"] == 2, f"{tag} rank {r}: failed at step {res['step']}"
        assert PEER_FAILURE.search(res["msg"]), f"{tag} rank {r}: unclear error {res['msg']!r}"
        timed_out, gone = TIMED_OUT.search(res["msg"]), GONE.search(res["msg"])
        if fault == "stall":
            assert timed_out and not gone, f"{tag} rank {r}: not the timeout: {res['msg']!r}"
            assert res["after_s"] >= 0.8 * RANK_TIMEOUT_S, \
                f"{tag} rank {r}: raised after {res['after_s']:.1f}s, before the timeout"
        else:
            assert gone and not timed_out, f"{tag} rank {r}: waited for the timeout: " \
                f"{res['msg']!r}"
        if where is not None:
            assert where in res["tb"], f"{tag} rank {r}: not raised in {where}:\n{res['tb']}"
        assert r in closed, f"{tag} rank {r}: close() hung"


PATH_FILE = {"engine": "gradsync/engine/", "ddp": "gradsync/integrations/",
             "fsdp": "gradsync/integrations/"}
STALL_CASES = [("engine", "topka", "stall"), ("ddp", "ssfusion_oi", "stall"),
               ("fsdp", "tagc", "stall")]
SLOW_STALL_CASES = [("engine", s, "stall")
                    for s in ("dense_ovlp", "oktopk", "densestream", "ssfusion_oi")] + [
    ("ddp", "per_tensor", "stall")]


def _run_and_check(tmp_path, cases):
    """Run the cases in one set of processes; the last may be a death."""
    dies = cases[-1][2] == "die"
    if dies:
        with pytest.raises(DistributedError) as ei:
            run_distributed(_faults, 3, cases, str(tmp_path), timeout=HARNESS_TIMEOUT_S)
        assert ei.value.rank == FAULTY and "exited with code 3" in str(ei.value)
    else:
        out = run_distributed(_faults, 3, cases, str(tmp_path), timeout=HARNESS_TIMEOUT_S)
        assert out == ["done"] * 3
    for path, scheme, fault in cases:
        _check_survivors(str(tmp_path), _tag(path, scheme, fault), 3, fault,
                         where=PATH_FILE[path])


def test_stalled_peer_times_out_then_engine_peer_dies(tmp_path):
    """Engine (TopkA), DDP hook, FSDP2/TAGC: a stall each; then a death in the engine."""
    _run_and_check(tmp_path, [*STALL_CASES, ("engine", "topka", "die")])


@pytest.mark.slow
@pytest.mark.parametrize("path", ["ddp", "fsdp"])
def test_dead_peer_fails_fast(tmp_path, path):
    _run_and_check(tmp_path, [(path, "ssfusion_oi" if path == "ddp" else "tagc", "die")])


@pytest.mark.slow
def test_more_schemes_stall(tmp_path):
    _run_and_check(tmp_path, [*SLOW_STALL_CASES, ("engine", "dense_ovlp", "die")])


# -- mismatched set-ups across ranks ----------------------------------------------------------
# (what rank 1 changes, the words the error must contain)
ENGINE_MISMATCHES = {
    "shape": ({"hidden": 33}, {}, [r"net\.1\.weight", r"\(32, 784\)", r"\(33, 784\)"]),
    "scheme": ({}, {"scheme": "oktopk"}, ["scheme", "topka", "oktopk"]),
    "density": ({}, {"density": 0.02}, ["density", "0.01", "0.02"]),
    "dtype": ({"dtype": torch.bfloat16}, {}, ["bfloat16", "float32"]),
    "layers": ({"extra": True}, {}, ["entries"]),
    "check_every": ({}, {"check_every": 5}, ["check_every"]),
}


def _model_for(kind: dict) -> nn.Module:
    model = build("mlp", seed=0, hidden=kind.get("hidden", 32))
    if kind.get("extra"):
        model.net.append(nn.Linear(10, 10))
    return model.to(kind.get("dtype", torch.float32))


def _engine_mismatch(rank: int, world_size: int, cases: list[str]):
    """Every rank builds a GradSync; rank 1 differs in one respect per case."""
    out = {}
    for case in cases:
        model_kw, cfg_kw, _ = ENGINE_MISMATCHES[case]
        kw = {"scheme": "topka", "density": 0.01, **(cfg_kw if rank == 1 else {})}
        model = _model_for(model_kw if rank == 1 else {})
        try:  # a mismatch found by waiting for the timeout would raise a timeout, not this
            GradSync(model, Config(**kw, timeout_s=30)).close()
            out[case] = ("built", "")
        except ValueError as e:
            out[case] = ("ValueError", str(e))
    return out


def test_engine_mismatched_setups_fail_at_construction_on_every_rank():
    cases = list(ENGINE_MISMATCHES)
    out = run_distributed(_engine_mismatch, 3, cases, timeout=HARNESS_TIMEOUT_S)
    for case in cases:
        for rank, res in enumerate(out):
            kind, msg = res[case]
            assert kind == "ValueError", f"{case}: rank {rank} built an engine"
            for word in ENGINE_MISMATCHES[case][2]:
                assert re.search(word, msg), f"{case}: rank {rank}: {word!r} not in {msg!r}"
            assert "rank 1" in msg, f"{case}: the odd rank is not named: {msg!r}"


def _ddp_mismatch(rank: int, world_size: int, cases: list[dict]):
    """gradsync's DDP hook with rank 1's Config differing per case; one step each."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradsync.integrations.ddp

    out = []
    for diff in cases:
        group = dist.new_group(timeout=timedelta(seconds=RANK_TIMEOUT_S))
        model = build("mlp", seed=0, hidden=32)
        ddp = DDP(model, process_group=group, bucket_cap_mb=0.01)
        kw = {"scheme": "ssfusion_oi", "density": 0.05, "sparsifier": "topk",
              **(diff if rank == 1 else {})}
        try:
            gradsync.ddp.register(ddp, Config(**kw), small_numel=1000)
            x, y = image_batch(rank, 0)
            nn.functional.cross_entropy(ddp(x), y).backward()
            out.append(("trained", ""))
        except ValueError as e:
            out.append(("ValueError", str(e)))
        del ddp  # before its group goes
        dist.destroy_process_group(group)
    return out


def test_ddp_hook_mismatched_config_fails_at_registration():
    cases = [{"density": 0.5}, {"scheme": "per_tensor"}]  # the abort (if any) last
    out = run_distributed(_ddp_mismatch, 2, cases, timeout=HARNESS_TIMEOUT_S)
    for rank, res in enumerate(out):
        for diff, (kind, msg) in zip(cases, res):
            assert kind == "ValueError", f"{diff}: rank {rank} trained"
            assert next(iter(diff)) in msg, f"{diff}: rank {rank}: {msg!r}"


def _tagc_mismatch(rank: int, world_size: int, cases: list[dict]):
    """TAGC installed with rank 1's TAGCConfig differing per case; one step each."""
    from torch.distributed.fsdp import fully_shard

    from gradsync.integrations.fsdp import TAGCConfig, all_layers, compress

    out = []
    for diff in cases:
        model = build("mlp", seed=0, hidden=32)
        for layer in (model.net[1], model.net[3]):
            fully_shard(layer)
        fully_shard(model)
        kw = {"ratio": 2, "theta": 0.9, "policy": all_layers, **(diff if rank == 1 else {})}
        try:
            compress(model, TAGCConfig(**kw))
            x, y = image_batch(rank, 0)
            nn.functional.cross_entropy(model(x), y).backward()
            out.append(("trained", ""))
        except ValueError as e:
            out.append(("ValueError", str(e)))
    return out


def test_tagc_mismatched_config_fails_at_compress():
    cases = [{"seed": 5}, {"ratio": 4}]  # the abort (if any) last
    out = run_distributed(_tagc_mismatch, 2, cases, timeout=HARNESS_TIMEOUT_S)
    for rank, res in enumerate(out):
        for diff, (kind, msg) in zip(cases, res):
            assert kind == "ValueError", f"{diff}: rank {rank} trained"
            assert next(iter(diff)) in msg, f"{diff}: rank {rank}: {msg!r}"
