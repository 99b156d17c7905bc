"""``scheme="auto"`` resumes its drift watch (issue 13): checkpoints carry ``drift.Drift``.

Real gloo ranks at P = 2 and 3 train the MLP with ``auto`` for ``TOTAL`` steps, crossing several
drift windows: the runners-up's probes (DDP's dense plan, then TopkA's one fused buffer), their
trials, two drifted windows and the re-plan they cause (each a plan change; those from sparse to
dense through a flushing step). The same job is then
interrupted at every step of ``SAVE_AT`` — right after a sparse → dense change (a trial in
progress, a pending post-flush plan, an empty window) and in the middle of a window with one
strike — and resumed from scratch (new model initialised differently, new engine with a new
process group, new optimizer, all loaded from ``torch.save`` bytes). The resumed run must end
with the drift state (rows, strikes, checks, probed, reference, trial, events, pending), plan,
cost model and parameters of the uninterrupted run, bitwise.

Deterministic timing: plan choices follow measured times. Cost-model profiling is pinned (a
100 Mbit/s link and a cheap sparsifier, as in ``test_auto.py``, so the first plan sparsifies the
large layer), and the seam for the drift watch is ``drift.Drift.record``: inside the rank
function it is replaced by a wrapper that drops the engine's measured times and records a fixed
schedule instead (:func:`_row`: a function of the watch's own ``checks`` and window position and
of the rank, so a resume that lost those would record other numbers). The engine's call, and
every decision after it (max-reduce over the ranks, probe, trial, drift test, re-plan on rank 0
and broadcast), runs unchanged.

Also: a checkpoint from before the drift entry existed (entry removed) loads and resumes with a
fresh watch (its checks count restarts, so the end state differs and the comparison above can
fail; the plan itself records that its runners-up were measured, so it does not probe again);
a corrupted drift entry raises ``ValueError`` before the engine changes; malformed ``Drift``
states are refused one by one; the DDP hook's ``auto`` keeps its measured link across a
resume (it has no drift watch).
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

from conftest import image_batch, pin_profiles
from gradsync.apps.models import build
from gradsync.engine import GradSync, drift
from gradsync.engine.config import Config
from gradsync.schedule import costmodel
from gradsync.schedule.costmodel import AffineFit, AlphaBeta
from gradsync.testing import run_distributed

SLOW = 8 / 100e6  # s/B: 100 Mbit/s
WINDOW = 3  # steps per drift window here (the default is 10)
WARMUP = 2
TOTAL = 24  # steps 0..23: warm-up 0-1, windows of 3 steps (a trial's: 1 step), checks 0-12, a flush
SAVE_AT = (5, 18)  # before 5: just after check 0 (dense probe, flush pending); 18: mid-window
CFG = Config(scheme="auto", density=0.01, sparsifier="topk", warmup_steps=WARMUP,
             check_every=0, momentum=0.0)

# the measured step (s) of each window, by check (a trial's windows are one step: WINDOW // 2):
# the sparse plan (A), the first runner-up measured slower (B, B), the sparse plan back (A: it
# stays); the same for the second runner-up; then three times the reference in two windows
# (drift: a re-plan after DRIFT_PATIENCE = 2, switched to dense), the dense plan on trial
# measured faster (B, B) than the sparse plan (A: dense is kept), then steady
STEPS = (0.010, 0.013, 0.013, 0.010,
         0.010, 0.013, 0.013, 0.010,
         0.030, 0.030, 0.020, 0.020, 0.030, 0.030)
CHECKS = 13  # windows closed by the end: 4 + 4 (two trials), 2 (drift), 3 (the re-plan's trial)


def _row(checks: int, i: int, rank: int) -> list[float]:
    """The times recorded for row ``i`` of window ``checks`` on ``rank``: step, all-reduce,
    all-gather (about 1000× faster than the pinned slow link predicts, so the re-plan on the
    rescaled model prefers dense buffers), sparsification (about 100× the pinned fit: costly,
    likewise), backward; they vary by row and rank
    (the median and the max-reduce matter)."""
    s = STEPS[min(checks, len(STEPS) - 1)] * (1 + 0.05 * i + 0.01 * rank)
    return [s, 1e-3 * (1 + 0.1 * i), 1e-6 * (1 + 0.1 * i), 3e-3, 1e-4 * (1 + 0.01 * rank)]


def _pin(rank: int) -> None:
    """This child's measurements, fixed: profiling (plans) and the drift watch's rows."""
    pin_profiles(backward=True)
    costmodel.profile_collectives = lambda group=None, **kw: (
        AlphaBeta(5e-5, SLOW), AlphaBeta(5e-5, SLOW))
    costmodel.profile_sparsifier = lambda sp, offload=False, **kw: (
        AffineFit(2e-5, 1e-10) if offload else AffineFit(1e-5, 1e-10))
    drift.DRIFT_WINDOW = WINDOW
    orig = drift.Drift.record

    def record(self, *measured: float) -> None:  # the engine's times are dropped
        orig(self, *_row(self.checks, len(self.rows), rank))

    drift.Drift.record = record


def _new_job(seed: int):
    model = build("mlp", seed=seed)
    return model, GradSync(model, CFG)


def _step(rank: int, step: int, model, sync, opt) -> None:
    opt.zero_grad(set_to_none=True)
    x, y = image_batch(rank, step)
    nn.functional.cross_entropy(model(x), y).backward()
    sync.synchronize()
    opt.step()


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _end(model, sync) -> dict:
    st = sync.state_dict()
    return {"drift": st["drift"], "plan": st["plan"], "cost": st["cost"], "step": st["step"],
            "params": [p.detach().clone() for p in model.parameters()]}


def _resume(rank: int, blob: bytes, start: int, edit=None) -> dict:
    """A new job from ``blob`` (``edit`` changes its sync state first), run to ``TOTAL``."""
    ck = torch.load(io.BytesIO(blob), weights_only=False)
    if edit is not None:
        edit(ck["sync"])
    model = build("mlp", seed=7)  # initialised differently: the load must overwrite it
    model.load_state_dict(ck["model"])
    sync = GradSync(model, CFG)
    sync.load_state_dict(ck["sync"])
    opt = _sgd(model)
    opt.load_state_dict(ck["opt"])
    loaded = sync.state_dict()["drift"]
    for step in range(start, TOTAL):
        _step(rank, step, model, sync, opt)
    out = _end(model, sync) | {"loaded": loaded}
    sync.close()
    return out


def _job(rank: int, P: int) -> dict:
    _pin(rank)
    model, sync = _new_job(seed=1)
    opt = _sgd(model)
    blobs, saved, traffic = {}, {}, []
    for step in range(TOTAL):
        if step in SAVE_AT:
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                        "sync": sync.state_dict()}, buf)
            blobs[step] = buf.getvalue()
            saved[step] = sync.state_dict()["drift"]
        plan = sync.plan.to_dict()
        _step(rank, step, model, sync, opt)
        st = sync.state_dict()
        traffic.append({"messages": sync.last.messages, "bytes": sync.last.bytes_sent,
                        "checks": st["drift"]["checks"] if st["drift"] else 0,
                        "same_plan": plan == st["plan"] == sync.plan.to_dict(), "plan": plan})
    out = {"straight": _end(model, sync), "saved": saved, "traffic": traffic}
    sync.close()
    out["resumed"] = {m: _resume(rank, blobs[m], m) for m in SAVE_AT}
    # a checkpoint from before the drift entry existed: a fresh watch
    out["old"] = _resume(rank, blobs[SAVE_AT[-1]], SAVE_AT[-1],
                         edit=lambda s: s.pop("drift"))
    # a corrupted drift entry: ValueError, and the engine is left as it was
    ck = torch.load(io.BytesIO(blobs[SAVE_AT[-1]]), weights_only=False)
    model, sync = _new_job(seed=1)
    before = sync.state_dict()
    errors = {}
    for what, bad in {"rows": "not rows", "strikes": -1, "trial": {"plan": {}},
                      "pending": {"scheme": "auto"}}.items():
        state = copy.deepcopy(ck["sync"])
        state["drift"][what] = bad
        try:
            sync.load_state_dict(state)
            errors[what] = None
        except ValueError as e:
            errors[what] = str(e)
    state = copy.deepcopy(ck["sync"])
    state["drift"] = None  # an engine that keeps a watch cannot take an empty entry
    try:
        sync.load_state_dict(state)
        errors["empty"] = None
    except ValueError as e:
        errors["empty"] = str(e)
    after = sync.state_dict()
    out["errors"] = errors
    out["untouched"] = (after["drift"] == before["drift"] and after["step"] == before["step"]
                        and after["plan"] == before["plan"])
    sync.close()
    return out


@pytest.fixture(scope="module", params=[2, 3])
def runs(request):
    return request.param, run_distributed(_job, request.param, timeout=300)


def _same_end(a: dict, b: dict) -> bool:
    return (a["drift"] == b["drift"] and a["plan"] == b["plan"] and a["cost"] == b["cost"]
            and a["step"] == b["step"]
            and all(torch.equal(x, y) for x, y in zip(a["params"], b["params"], strict=True)))


def test_the_run_crosses_windows_and_the_save_points_hold_state(runs):
    _, out = runs

    def agreed(d):  # the rows are this rank's own times; the rest every rank agreed on
        return {k: v for k, v in d.items() if k != "rows"}

    for o in out:
        assert agreed(o["straight"]["drift"]) == agreed(out[0]["straight"]["drift"])
        for m in SAVE_AT:
            assert agreed(o["saved"][m]) == agreed(out[0]["saved"][m])
    assert out[-1]["saved"][SAVE_AT[-1]]["rows"] != out[0]["saved"][SAVE_AT[-1]]["rows"]
    drift = out[0]["straight"]["drift"]
    _, _, trial, _, _, trial1, replan, _, trial2 = drift["events"]
    assert [e["kind"] for e in drift["events"]] == [
        "probe", "trial_back", "trial", "probe", "trial_back", "trial", "replan", "trial_back",
        "trial"]
    # both runners-up were measured slower: the sparse plan came back each time
    assert not trial["kept"] and not trial1["kept"]
    # two drifted windows, then the re-plan on the rescaled (fast) link: dense, kept
    assert replan["switched"] and replan["factors"]["allgather"] < 0.01, replan
    assert trial2["kept"]
    assert all(b["mode"] == "dense" for b in out[0]["straight"]["plan"]["buffers"])
    assert drift["checks"] == CHECKS and drift["probed"]
    first, mid = (out[0]["saved"][m] for m in SAVE_AT)
    # after check 0: the dense runner-up (probed first) is on trial against the sparse plan,
    # reached through a flushing step that has not run yet
    assert first["checks"] == 1 and first["trial"] is not None and first["pending"] is not None
    assert first["rows"] == [] and not first["probed"]  # TopkA's buffer still to measure
    # mid-window: one drifted window counted, one row of the next recorded
    assert mid["strikes"] == 1 and len(mid["rows"]) == 1 and mid["reference"] is not None


def test_resume_continues_the_drift_watch_bitwise(runs):
    P, out = runs
    for rank, o in enumerate(out):
        for m in SAVE_AT:
            r = o["resumed"][m]
            assert r["loaded"] == o["saved"][m], (P, rank, m)
            assert r["drift"] == o["straight"]["drift"], (P, rank, m)
            assert _same_end(r, o["straight"]), (P, rank, m)


def test_a_checkpoint_without_drift_entry_resumes_with_a_fresh_watch(runs):
    _, out = runs
    for o in out:
        old = o["old"]
        fresh = {"rows": [], "strikes": 0, "checks": 0, "probed": False, "reference": None,
                 "trial": None, "events": [], "pending": None, "reprobes": 0}
        assert old["loaded"] == fresh
        # the plan records that its runners-up were all measured: no probe again; the count of
        # checks restarts
        assert all(e["kind"] != "probe" for e in old["drift"]["events"])
        assert old["drift"]["checks"] < o["straight"]["drift"]["checks"]
        assert old["drift"] != o["straight"]["drift"]  # so the comparison above can fail
        assert all(torch.isfinite(p).all() for p in old["params"])


def test_a_corrupted_drift_entry_raises_before_anything_changes(runs):
    _, out = runs
    for o in out:
        for what, msg in o["errors"].items():
            assert msg is not None, what
            assert "drift" in msg, msg
            if what != "empty":
                assert what in msg, msg
        assert o["untouched"]


MALFORMED = {
    "missing": lambda s: s.pop("checks"),
    "unknown": lambda s: s.update(extra=1),
    "short_row": lambda s: s.update(rows=[[1.0, 2.0]]),
    "nan_row": lambda s: s.update(rows=[[1.0, 2.0, 3.0, 4.0, 5.0, float("nan")]]),
    "float_strikes": lambda s: s.update(strikes=1.5),
    "bool_checks": lambda s: s.update(checks=True),
    "str_probed": lambda s: s.update(probed="yes"),
    "negative_reprobes": lambda s: s.update(reprobes=-1),
    "negative_reference": lambda s: s.update(reference=-1.0),
    "empty_trial": lambda s: s.update(trial={"plan": None, "cost": None, "step": 1.0}),
    "str_events": lambda s: s.update(events=["probe"]),
    "list_pending": lambda s: s.update(pending=[1, 2]),
}


@pytest.mark.parametrize("edit", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_drift_states_are_refused(edit):
    d = drift.Drift(rows=[[0.1, 0.01, 0.02, 0.001, 0.05, 0.12]], strikes=1, checks=3, probed=True,
                     reference=0.1, events=[{"check": 0, "kind": "probe", "measured": 0.1}])
    state = d.state_dict()
    assert drift.Drift.from_state_dict(state) == d  # the round trip
    edit(state)
    with pytest.raises(ValueError, match="drift state"):
        d.load_state_dict(state)
    assert d.checks == 3 and d.strikes == 1 and len(d.rows) == 1  # unchanged
    with pytest.raises(ValueError, match="must be a dict"):
        drift.Drift.from_state_dict([1, 2])


# ------------------------------------------------------------------------------------ DDP hook
def _hook(rank: int, P: int) -> dict:
    from gradsync.integrations import ddp as gddp

    _pin(rank)
    cfg = Config(scheme="auto", density=0.01, sparsifier="topk")

    def job(seed):
        model = build("mlp", seed=seed)
        ddp_model = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.1)
        return model, ddp_model, gddp.register(ddp_model, cfg)

    def step(ddp_model, s):
        ddp_model.zero_grad(set_to_none=True)
        x, y = image_batch(rank, s)
        nn.functional.cross_entropy(ddp_model(x), y).backward()
        with torch.no_grad():
            for p in ddp_model.parameters():
                p.add_(p.grad, alpha=-0.05)

    model, ddp_model, state = job(1)
    for s in range(2):
        step(ddp_model, s)
    saved = copy.deepcopy({"model": model.state_dict(), "hook": state.state_dict()})
    for s in range(2, 4):
        step(ddp_model, s)
    straight = [p.detach().clone() for p in model.parameters()]
    model, ddp_model, state = job(7)
    model.load_state_dict(saved["model"])
    state.load_state_dict(saved["hook"])
    link = state.auto.link

    def measured(*a, **kw):
        raise AssertionError("the resumed hook measured its link again")

    gddp.link_costs = measured  # the hook's own name for it
    for s in range(2, 4):
        step(ddp_model, s)
    bad = copy.deepcopy(saved["hook"])
    bad["link"] = [{"alpha": -1.0, "beta": 0.0}] * 3
    try:
        state.load_state_dict(bad)
        err = None
    except ValueError as e:
        err = str(e)
    old = copy.deepcopy(saved["hook"])
    del old["link"]  # an older checkpoint: loads, the link is measured at the next call
    state.load_state_dict(old)
    return {"saved_link": saved["hook"]["link"], "link": [vars(x) for x in link],
            "same": all(torch.equal(p, q) for p, q in zip(model.parameters(), straight)),
            "err": err, "old_link": state.auto.link}


def test_ddp_hook_auto_keeps_its_measured_link():
    out = run_distributed(_hook, 2, timeout=300)
    for o in out:
        assert o["saved_link"] is not None and o["link"] == o["saved_link"]
        assert o["link"][1]["beta"] == pytest.approx(SLOW)  # the pinned all-gather link
        assert o["same"]
        assert o["err"] is not None and "link" in o["err"]
        assert o["old_link"] is None


def test_the_watch_traffic_is_counted_in_its_step(runs):
    """A window's close costs one all-reduce of the 6 agreed medians (fp64, 48 B): a ring of
    2(P − 1) messages and 2(P − 1)/P · 48 B sent, counted in the step that closed it. Compared
    with the step before it, with the same plan and no check, under the fixed plan."""
    P, out = runs
    for o in out:
        t = o["traffic"]
        pairs = [(t[s - 1], t[s]) for s in range(WARMUP + 1, TOTAL)
                 if t[s]["checks"] == t[s - 1]["checks"] + 1 and t[s - 1]["checks"] == (
                     t[s - 2]["checks"] if s >= 2 else 0)
                 and t[s]["same_plan"] and t[s - 1]["same_plan"]
                 and t[s]["plan"] == t[s - 1]["plan"]]
        assert pairs, "no window closed under an unchanged plan"
        for before, closing in pairs:
            assert closing["messages"] - before["messages"] == 2 * (P - 1)
            assert closing["bytes"] - before["bytes"] == 2 * (P - 1) * 48 // P
