"""Checkpoint and resume (gradsync.checkpoint) on real gloo ranks, P = 2.

A first job trains, saving mid-run with plain ``torch.save`` per rank and with DCP, and runs on
uninterrupted; a second job — new processes, a NEW process group, fresh models initialised
differently, fresh optimizers and engines — loads each checkpoint and continues. The parent
asserts that every resumed run ends bitwise where the uninterrupted one did (parameters and
sync state, per rank), that every rank got back its own residuals (they differ across ranks),
for ``ssfusion_oi`` (DGC + momentum correction, saved both during warm-up and after it),
``oktopk`` (thresholds and boundaries), the DDP comm hook and the FSDP2 TAGC path; and that
loading from a different world size, scheme, configuration, rank or model raises
``ValueError``. It also pins the torch fact the DCP layout rests on: DCP keeps ONE copy of an
entry saved under the same key by every rank.

Warm-up: the final plan of the cost-model schemes is computed from timings measured during
the warm-up steps, so two uninterrupted runs can already differ in their plan. The children
therefore pin those measurements (fixed α/β, sparsifier and backward-time fits; the backward
*order* is still observed); what a mid-warm-up resume must then carry — warm-up progress,
the observed backward samples, the provisional plan, residuals, generators — is tested.
"""

from __future__ import annotations

import hashlib
import io
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from conftest import image_batch, pin_profiles, sharded_gpt
from gradsync.apps.models import build
from gradsync.engine import GradSync
from gradsync.engine.config import Config
from gradsync.integrations import checkpoint
from gradsync.integrations import ddp as gddp
from gradsync.schedule import SCHEMES
from gradsync.testing import run_distributed

P = 2
TOTAL = 7  # engine runs: steps 0..6
SAVE_AT = (2, 4)  # ssfusion_oi with warmup_steps=3: step 2 is mid-warm-up, 4 after it
TAGC_TOTAL, TAGC_SAVE = 4, 2
ENGINE_CASES = {
    "ssfusion_oi": Config(scheme="ssfusion_oi", density=0.05, warmup_steps=3, momentum=0.9),
    # momentum 0: Ok-Topk then reuses its threshold θ at step 4 (a resume without θ would not)
    "oktopk": Config(scheme="oktopk", density=0.05, warmup_steps=3, momentum=0.0),
}
FORMATS = ("plain", "dcp")
HOOK_CFG = Config(scheme="ssfusion_oi", density=0.05, momentum=0.9)  # DGC: random streams
HOOK_TOTAL, HOOK_SAVE = 5, 3
HOOK_SMALL = 1000  # the biases travel dense, the weights sparsified and compensated


# -- helpers run in the children --------------------------------------------------------------
def _digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        if t is None:
            h.update(b"none")
            continue
        if hasattr(t, "to_local"):
            t = t.to_local()
        t = t.detach().cpu().contiguous().reshape(-1)
        if t.dtype in (torch.bfloat16, torch.float16):
            t = t.view(torch.int16)
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def _params(model) -> str:
    return _digest(p for _, p in model.named_parameters())


def _sync_digest(sync) -> str:
    """Residuals and velocities (engine) or accumulators (TAGC) of this rank."""
    if isinstance(sync, GradSync | gddp.HookState):
        st = sync.ef.state_dict()
        return _digest([st["residual"][k] for k in sorted(st["residual"])]
                       + [st["velocity"][k] for k in sorted(st["velocity"])])
    return _digest(sync.units[n].acc for n in sorted(sync.units))


def _engine_run(name: str, seed: int = 1):
    model = build("mlp", seed=seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, opt, GradSync(model, ENGINE_CASES[name])


def _engine_step(rank, step, model, opt, sync) -> None:
    opt.zero_grad(set_to_none=True)
    x, y = image_batch(rank, step)
    nn.functional.cross_entropy(model(x), y).backward()
    sync.synchronize()
    opt.step()


def _tagc_run(seed_shift: bool = False):
    from gradsync.integrations.fsdp import TAGCConfig, compress

    m = sharded_gpt(dim=32, layers=2, heads=2, context=16)
    if seed_shift:  # a fresh model that differs from the saved one: the load must overwrite
        with torch.no_grad():
            for p in m.parameters():
                p.to_local().add_(0.5)
    t = compress(m, TAGCConfig(ratio=4, theta=0.9))
    opt = torch.optim.Adam(m.parameters(), lr=3e-3)
    return m, opt, t


def _tagc_step(rank, step, m, opt) -> None:
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randint(0, 256, (4, 16), generator=g)
    y = torch.randint(0, 256, (4, 16), generator=g)
    out = m(x)
    opt.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)).backward()
    opt.step()


def _hook_run(seed: int = 1, cfg: Config = HOOK_CFG):
    """A model under DDP with the gradsync comm hook; the optimizer sees DDP's parameters."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = build("mlp", seed=seed)
    ddp = DDP(model)
    state = gddp.register(ddp, cfg, small_numel=HOOK_SMALL)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    return model, ddp, opt, state


def _hook_step(rank, step, ddp, opt) -> None:
    opt.zero_grad(set_to_none=True)
    x, y = image_batch(rank, step)
    nn.functional.cross_entropy(ddp(x), y).backward()
    opt.step()


def _save(fmt, path, **kw) -> None:
    (checkpoint.save if fmt == "plain" else checkpoint.save_dcp)(path, **kw)


def _load(fmt, path, **kw):
    return (checkpoint.load if fmt == "plain" else checkpoint.load_dcp)(path, **kw)


def _dedup_fact(rank: int, path: str) -> dict:
    """What DCP does with one key saved by every rank with different contents."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"same": torch.full((3,), float(rank)), f"rank{rank}/own": torch.full((3,),
              float(rank))}, checkpoint_id=path)
    back = {"same": torch.zeros(3), f"rank{rank}/own": torch.zeros(3)}
    dcp.load(back, checkpoint_id=path)
    return {"same": back["same"].tolist(), "own": back[f"rank{rank}/own"].tolist()}


# every scheme (and the generator-driven sparsifiers), resumed in-process mid-warm-up
SWEEP = [(s, "dgc") for s in SCHEMES] + [("topka", "randomk"), ("per_tensor", "redsync"),
                                          ("ssfusion", "sidco"), ("multi_tensor", "topk")]


def _sweep(rank: int) -> dict:
    """Save at step 1 (warm-up not finished for the cost-model schemes), run to step 4; a
    fresh engine and model loading the bytes must end bitwise equal."""
    out = {}
    for scheme, sp in SWEEP:
        cfg = Config(scheme=scheme, density=0.05, sparsifier=sp, warmup_steps=2, momentum=0.5)
        runs, saved = [], {}
        for resumed in (False, True):
            model = build("mlp", seed=3 if resumed else 1)
            sync = GradSync(model, cfg)
            start = 0
            if resumed:
                ck = torch.load(io.BytesIO(saved["blob"]), weights_only=False)
                model.load_state_dict(ck["model"])
                sync.load_state_dict(ck["sync"])
                round_trip = _same(sync.state_dict(), ck["sync"])  # every field restored
                start = 1
            for step in range(start, 4):
                if step == 1 and not resumed:
                    buf = io.BytesIO()
                    torch.save({"model": model.state_dict(), "sync": sync.state_dict()}, buf)
                    saved["blob"] = buf.getvalue()
                model.zero_grad(set_to_none=True)
                x, y = image_batch(rank, step)
                nn.functional.cross_entropy(model(x), y).backward()
                sync.synchronize()
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(p.grad, alpha=-0.05)
            runs.append((_params(model), _sync_digest(sync)))
            sync.close()
        out[(scheme, sp)] = {"runs": runs, "round_trip": round_trip}
    return out


# -- job 1: train, save, go on ----------------------------------------------------------------
def _straight(rank: int, world: int, path: str) -> dict:
    pin_profiles()
    out: dict = {"dedup": _dedup_fact(rank, os.path.join(path, "dedup")), "sweep": _sweep(rank)}
    for name in ENGINE_CASES:
        model, opt, sync = _engine_run(name)
        saved = {}
        for step in range(TOTAL):
            if step in SAVE_AT:
                for fmt in FORMATS:
                    _save(fmt, os.path.join(path, f"{name}-{fmt}-{step}"), sync=sync,
                          model=model, optimizer=opt, extra={"step": step})
                st = sync.state_dict()
                saved[step] = {"sync": _sync_digest(sync), "warmup_left": st["warmup_left"],
                               "collectives": st["collectives"]}
            _engine_step(rank, step, model, opt, sync)
        out[name] = {"params": _params(model), "sync": _sync_digest(sync), "saved": saved,
                     "plan": sync.plan.to_dict()}
        sync.close()
    m, opt, t = _tagc_run()
    for step in range(TAGC_TOTAL):
        if step == TAGC_SAVE:
            for fmt in FORMATS:
                _save(fmt, os.path.join(path, f"tagc-{fmt}"), sync=t, model=m, optimizer=opt)
            saved_acc = _sync_digest(t)
        _tagc_step(rank, step, m, opt)
    out["tagc"] = {"params": _params(m), "sync": _sync_digest(t), "saved": saved_acc,
                   "stats": t.stats()}
    model, ddp, opt, hs = _hook_run()
    for step in range(HOOK_TOTAL):
        if step == HOOK_SAVE:
            for fmt in FORMATS:
                _save(fmt, os.path.join(path, f"hook-{fmt}"), sync=hs, model=model,
                      optimizer=opt, extra={"step": step})
            saved_hook = _sync_digest(hs)
            n_sparse = len(hs.sparsifiers)
        _hook_step(rank, step, ddp, opt)
    out["hook"] = {"params": _params(model), "sync": _sync_digest(hs), "saved": saved_hook,
                   "sparsifiers": n_sparse, "stats": hs.stats()}
    return out


# -- job 2: a new process group resumes from every checkpoint ---------------------------------
def _errors(fmt, path, **kw) -> str | None:
    try:
        _load(fmt, path, **kw)
    except ValueError as e:
        return str(e)
    return None


def _resume(rank: int, world: int, path: str) -> dict:
    pin_profiles()
    out: dict = {}
    for name in ENGINE_CASES:
        for fmt in FORMATS:
            for step in SAVE_AT:
                model, opt, sync = _engine_run(name, seed=77)
                extra = _load(fmt, os.path.join(path, f"{name}-{fmt}-{step}"), sync=sync,
                              model=model, optimizer=opt)
                loaded = _sync_digest(sync)
                colls = sync.state_dict()["collectives"]
                for s in range(step, TOTAL):
                    _engine_step(rank, s, model, opt, sync)
                out[(name, fmt, step)] = {"params": _params(model), "sync": _sync_digest(sync),
                                          "loaded": loaded, "extra": extra,
                                          "collectives": colls,
                                          "plan": sync.plan.to_dict()}
                sync.close()
    for fmt in FORMATS:
        m, opt, t = _tagc_run(seed_shift=True)
        _load(fmt, os.path.join(path, f"tagc-{fmt}"), sync=t, model=m, optimizer=opt)
        loaded = _sync_digest(t)
        for s in range(TAGC_SAVE, TAGC_TOTAL):
            _tagc_step(rank, s, m, opt)
        out[("tagc", fmt)] = {"params": _params(m), "sync": _sync_digest(t), "loaded": loaded}
    # mismatches: another scheme, another model, TAGC vs engine — all before anything changes
    errs: dict = {}
    for fmt in FORMATS:
        src = os.path.join(path, f"ssfusion_oi-{fmt}-4")
        m = build("mlp", seed=5)
        before = _params(m)
        s = GradSync(m, Config(scheme="oktopk", density=0.05, warmup_steps=3, momentum=0.9))
        errs[(fmt, "scheme")] = _errors(fmt, src, sync=s, model=m)
        s.close()
        c = build("cnn", seed=5)
        s = GradSync(c, ENGINE_CASES["ssfusion_oi"])
        errs[(fmt, "model")] = _errors(fmt, src, sync=s, model=c)
        s.close()
        errs[(fmt, "untouched")] = before == _params(m)
        tm, _, tt = _tagc_run()
        errs[(fmt, "tagc")] = _errors(fmt, src, sync=tt, model=tm)
    out["errors"] = errs
    out["hook_errors"] = _hook_resume(rank, world, path, out)
    return out


def _hook_resume(rank: int, world: int, path: str, out: dict) -> dict:
    """The DDP hook resumes from both formats; another rank's state, another configuration and
    a checkpoint whose rank files were swapped are refused before anything changes."""
    import shutil

    for fmt in FORMATS:
        model, ddp, opt, hs = _hook_run(seed=77)
        extra = _load(fmt, os.path.join(path, f"hook-{fmt}"), sync=hs, model=model,
                      optimizer=opt)
        loaded = _sync_digest(hs)
        for s in range(HOOK_SAVE, HOOK_TOTAL):
            _hook_step(rank, s, ddp, opt)
        out[("hook", fmt)] = {"params": _params(model), "sync": _sync_digest(hs),
                              "loaded": loaded, "extra": extra}
    errs: dict = {}
    src = os.path.join(path, "hook-plain")
    model, ddp, opt, hs = _hook_run(seed=77)
    before = (_params(model), _sync_digest(hs))
    other = torch.load(os.path.join(src, f"rank{1 - rank}.pt"), weights_only=False)["sync"]
    try:
        hs.load_state_dict(other)
    except ValueError as e:
        errs["other_rank"] = str(e)
    if rank == 0:  # a checkpoint whose rank files were swapped
        swapped = os.path.join(path, "hook-swapped")
        os.makedirs(swapped)
        for r in range(world):
            shutil.copy(os.path.join(src, f"rank{r}.pt"),
                        os.path.join(swapped, f"rank{world - 1 - r}.pt"))
    dist.barrier()
    errs["swapped"] = _errors("plain", os.path.join(path, "hook-swapped"), sync=hs,
                              model=model, optimizer=opt)
    for fmt in FORMATS:
        _, _, _, dense = _hook_run(seed=77, cfg=Config(scheme="ssfusion_oi", density=0.1,
                                                       momentum=0.9))
        errs[(fmt, "config")] = _errors(fmt, os.path.join(path, f"hook-{fmt}"), sync=dense,
                                        model=model, optimizer=opt)
        s = GradSync(model, HOOK_CFG)  # the engine's state is not the hook's
        errs[(fmt, "engine")] = _errors(fmt, os.path.join(path, f"hook-{fmt}"), sync=s,
                                        model=model)
        s.close()
    errs["untouched"] = before == (_params(model), _sync_digest(hs))
    return errs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ckpt"))
    straight = run_distributed(_straight, P, path, timeout=300)
    resumed = run_distributed(_resume, P, path, timeout=300)
    return path, straight, resumed


def test_dcp_deduplicates_one_key_across_ranks(runs):
    """The fact behind the per-rank keys (torch 2.13): a key saved by every rank with
    different values is stored once, and every rank loads that single copy."""
    _, straight, _ = runs
    same = [o["dedup"]["same"] for o in straight]
    assert same[0] == same[1]  # both ranks got the same copy ...
    assert any(s != [float(r)] * 3 for r, s in enumerate(same))  # ... so one lost its own
    for r, o in enumerate(straight):
        assert o["dedup"]["own"] == [float(r)] * 3  # per-rank keys keep every rank's


@pytest.mark.parametrize("name", list(ENGINE_CASES))
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("step", SAVE_AT)
def test_engine_resume_is_bitwise(runs, name, fmt, step):
    _, straight, resumed = runs
    for rank in range(P):
        s, r = straight[rank][name], resumed[rank][(name, fmt, step)]
        assert r["loaded"] == s["saved"][step]["sync"], "a rank did not get its own residuals"
        assert r["extra"] == {"step": step}
        assert r["plan"] == s["plan"]
        assert r["params"] == s["params"], (name, fmt, step, rank)
        assert r["sync"] == s["sync"], (name, fmt, step, rank)
    # residuals differ across ranks, so "its own" above is a real check
    assert straight[0][name]["saved"][step]["sync"] != straight[1][name]["saved"][step]["sync"]


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("fmt", FORMATS)
def test_collective_state_is_restored(runs, fmt):
    """Ok-Topk's boundaries and threshold θ come back exactly (the sums they produce at P = 2
    are the same whatever the boundaries, so the trajectory alone would not show it)."""
    _, straight, resumed = runs
    for rank in range(P):
        for step in SAVE_AT:
            saved = straight[rank]["oktopk"]["saved"][step]["collectives"]
            assert _same(resumed[rank][("oktopk", fmt, step)]["collectives"], saved)


def test_resume_points_cover_warmup_and_oktopk_state(runs):
    _, straight, _ = runs
    saved = straight[0]["ssfusion_oi"]["saved"]
    assert saved[2]["warmup_left"] == 1 and saved[4]["warmup_left"] == 0
    for step in SAVE_AT:  # Ok-Topk's threshold (and boundaries) were part of the saved state
        (coll,) = straight[0]["oktopk"]["saved"][step]["collectives"].values()
        assert coll["theta"] is not None and coll["exact_evaluations"] > 0
        # at P = 2 (gloo) one exchange a step needs no boundaries (collectives/oktopk.py, 6.)
        assert (coll["boundaries"] is None) == (P == 2)


def test_every_scheme_resumes_bitwise_mid_warmup(runs):
    _, straight, _ = runs
    for rank in range(P):
        for case, res in straight[rank]["sweep"].items():
            plain, resumed = res["runs"]
            assert resumed == plain, (case, rank)
            assert res["round_trip"], case
    assert len(straight[0]["sweep"]) == len(SWEEP)


@pytest.mark.parametrize("fmt", FORMATS)
def test_fsdp_tagc_resume_is_bitwise(runs, fmt):
    _, straight, resumed = runs
    for rank in range(P):
        s, r = straight[rank]["tagc"], resumed[rank][("tagc", fmt)]
        assert r["loaded"] == s["saved"]
        assert r["params"] == s["params"], (fmt, rank)
        assert r["sync"] == s["sync"], (fmt, rank)
    assert straight[0]["tagc"]["saved"] != straight[1]["tagc"]["saved"]
    assert straight[0]["tagc"]["stats"]["sketch_bytes_per_step"] > 0  # TAGC really ran


@pytest.mark.parametrize("fmt", FORMATS)
def test_ddp_hook_resume_is_bitwise(runs, fmt):
    """Each rank gets back its own residuals, velocities and generators: the resumed job ends
    where the uninterrupted one did."""
    _, straight, resumed = runs
    for rank in range(P):
        s, r = straight[rank]["hook"], resumed[rank][("hook", fmt)]
        assert r["loaded"] == s["saved"], "a rank did not get its own residuals"
        assert r["extra"] == {"step": HOOK_SAVE}
        assert r["params"] == s["params"], (fmt, rank)
        assert r["sync"] == s["sync"], (fmt, rank)
    assert straight[0]["hook"]["saved"] != straight[1]["hook"]["saved"]
    assert straight[0]["hook"]["sparsifiers"] == 1  # the three weights, sparsified as one pool
    assert straight[0]["hook"]["stats"]["calls"] > 0


def test_ddp_hook_refuses_foreign_state(runs):
    _, _, resumed = runs
    for rank, o in enumerate(resumed):
        errs = o["hook_errors"]
        assert f"belongs to rank {1 - rank}" in errs["other_rank"]
        assert errs["swapped"] and f"belongs to rank {P - 1 - rank}" in errs["swapped"]
        for fmt in FORMATS:
            assert errs[(fmt, "config")] and "density" in errs[(fmt, "config")]
            assert errs[(fmt, "engine")] and "ddp_hook:ssfusion_oi" in errs[(fmt, "engine")]
        assert errs["untouched"]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("fmt", FORMATS)
def test_mismatched_checkpoint_raises(runs, fmt):
    path, _, resumed = runs
    for o in resumed:
        errs = o["errors"]
        assert errs[(fmt, "scheme")] and "scheme" in errs[(fmt, "scheme")]
        assert errs[(fmt, "model")] and "different model" in errs[(fmt, "model")]
        assert errs[(fmt, "tagc")] and "tagc" in errs[(fmt, "tagc")]
        assert errs[(fmt, "untouched")]
    # a different world size: a single process (P = 1) loading the P = 2 checkpoint
    model = build("mlp", seed=1)
    sync = GradSync(model, ENGINE_CASES["ssfusion_oi"])
    src = os.path.join(path, f"ssfusion_oi-{fmt}-4")
    with pytest.raises(ValueError, match="2 ranks"):
        _load(fmt, src, sync=sync, model=model)
    sync.close()
    hook_state, _ = gddp.hook(HOOK_CFG, model=model, small_numel=HOOK_SMALL)
    with pytest.raises(ValueError, match="2 ranks"):
        _load(fmt, os.path.join(path, f"hook-{fmt}"), sync=hook_state, model=model)


def test_engine_rejects_another_ranks_state():
    a = GradSync(build("mlp", seed=1), ENGINE_CASES["oktopk"])
    st = a.state_dict()
    st["rank"] = 1
    with pytest.raises(ValueError, match="rank 1"):
        a.load_state_dict(st)
    st["rank"] = 0
    st["config"] = {**st["config"], "density": 0.1}
    with pytest.raises(ValueError, match="density"):
        a.load_state_dict(st)
    a.close()
    assert not dist.is_initialized()
