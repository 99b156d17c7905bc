"""``python -m gradsync train`` keeps what finished: a scheme that diverges or fails is recorded
and the others run; ``--timeout`` watches progress, not the whole run (its watchdog,
``run_distributed(progress_timeout=...)``)."""

from __future__ import annotations

import json
import math
import time

import pytest

from gradsync.apps import train
from gradsync.testing import DistributedError
from gradsync.testing.distributed import (
    DistributedStall,
    heartbeat,
    progress_limit,
    run_distributed,
)

# the MLP on synthetic images, 2 ranks, small batches: a second or two per scheme
TINY = ["--model", "mlp", "--data", "synthetic", "--world-size", "2", "--batch-size", "8",
        "--warmup-steps", "1", "--eval-batches", "1", "--no-progress"]


def _metrics(out) -> dict:
    return json.loads((out / "metrics.json").read_text())


def test_diverged_and_failed_schemes_are_recorded_and_the_others_run(tmp_path, capsys):
    """lr 11 makes the MLP's loss grow ~30x a step. torch's fp16 compression hook overflows
    fp16 (gradients > 65504) first: NaN loss a few steps in, a real divergence that only the
    loss check sees (DDP averages NaN without complaint). TopkA's engine and gradsync's DDP
    hook meet a non-finite gradient at the last steps and raise on every rank. PowerSGD's
    rank-1 updates stay finite for 8 steps. ``ddp`` fails outright (rank 1 raises at step 1).
    All five are in the table and metrics.json, the exit status is 1 and the last line names
    the four. Momentum sent ahead is off here (``--momentum-ahead 0``): with it the sparse runs
    blow up a step sooner, on their loss, and the gradient's path would go untested."""
    out = tmp_path / "out"
    rc = train.main([*TINY, "--steps", "8", "--lr", "11", "--out", str(out),
                     "--scheme", "ddp_fp16,ddp,ddp_powersgd,topka,ddp_gradsync_per_tensor",
                     "--fail-rank", "1", "--inject-scheme", "ddp", "--momentum-ahead", "0"])
    cap = capsys.readouterr()
    assert rc == 1
    m = _metrics(out)
    assert m["complete"] is True
    runs = {r["scheme"]: r for r in m["runs"]}
    assert list(runs) == ["ddp_fp16", "ddp", "ddp_powersgd", "topka", "ddp_gradsync_per_tensor"]

    fp16 = runs["ddp_fp16"]  # diverged on its loss: the diverging step is recorded, NaN
    n = fp16["diverged_at_step"]
    assert fp16["status"] == f"diverged at step {n}" and 0 < n < 7
    assert len(fp16["steps"]) == n + 1 and not math.isfinite(fp16["steps"][-1]["loss"])
    assert all(math.isfinite(r["loss"]) for r in fp16["steps"][:-1])
    assert fp16["reason"] == "non-finite loss on ranks 0, 1"  # the NaN average reached both
    # every rank stopped at the same step (no rank left waiting in a collective)
    assert [len(b) for b in fp16["bytes_sent_per_rank"]] == [n + 1, n + 1]
    assert math.isnan(fp16["summary"]["final_loss"]) and "test_accuracy" not in fp16["summary"]

    topka = runs["topka"]  # diverged on a gradient: the engine raised on every rank
    k = topka["diverged_at_step"]
    assert topka["status"] == f"diverged at step {k}" and 0 < k < 8
    assert topka["reason"].startswith("non-finite gradient (gradsync: non-finite gradient")
    assert len(topka["steps"]) == k and all(math.isfinite(r["loss"]) for r in topka["steps"])
    assert [len(b) for b in topka["bytes_sent_per_rank"]] == [k, k]

    hook = runs["ddp_gradsync_per_tensor"]  # raised from backward() on every rank (torch wraps it)
    h = hook["diverged_at_step"]
    assert hook["status"] == f"diverged at step {h}" and 0 < h < 8 and len(hook["steps"]) == h
    assert hook["reason"].startswith("non-finite gradient (")
    assert "gradsync DDP hook: non-finite gradient" in hook["reason"]
    assert [len(b) for b in hook["bytes_sent_per_rank"]] == [h, h]

    ddp = runs["ddp"]
    assert ddp["status"] == ("failed: rank 1: RuntimeError: injected failure on rank 1 at "
                             "step 1 (--fail-rank)")
    assert ddp["steps"] == [] and math.isnan(ddp["summary"]["samples_per_s"])

    psgd = runs["ddp_powersgd"]  # ran after the failure, every step, evaluated
    assert psgd["status"] == "ok" and len(psgd["steps"]) == 8
    assert all(math.isfinite(r["loss"]) for r in psgd["steps"])
    assert 0.0 <= psgd["summary"]["test_accuracy"] <= 1.0
    assert psgd["summary"]["speedup_vs_ddp"] is None  # ddp failed: nothing to compare with

    # the table has every row and a status column marking the three
    table = cap.out[cap.out.index("gradsync train —"):]
    assert "status" in table and table.count("diverged at step") == 3
    assert f"diverged at step {n}" in table and f"diverged at step {k}" in table
    assert "failed: rank 1" in table and "ok" in table and "ddp_powersgd" in table
    # a line per scheme as it finished, before the table
    assert f"[1/5] ddp_fp16: diverged at step {n}" in cap.out
    assert "[2/5] ddp: failed: rank 1" in cap.out and "[3/5] ddp_powersgd: ok" in cap.out
    assert cap.out.index("[5/5] ddp_gradsync_per_tensor") < cap.out.index("gradsync train —")
    assert "error: ddp: training failed on rank 1" in cap.err
    last = cap.err.strip().splitlines()[-1]
    assert last.startswith("error: 4 of 5 schemes did not finish: ")
    assert f"ddp_fp16 diverged at step {n} (non-finite loss" in last
    assert "ddp failed: rank 1" in last and f"topka diverged at step {k}" in last
    assert f"ddp_gradsync_per_tensor diverged at step {h} (non-finite gradient" in last
    assert "ddp_powersgd" not in last


def _diverging_spec(**kw) -> train.TrainSpec:
    return train.TrainSpec(model="mlp", data="synthetic", world_size=2, steps=8, batch_size=8,
                           warmup_steps=1, eval_batches=0, lr=10.0, progress=False, **kw)


def test_launch_without_keep_going_raises_a_divergence_on_every_rank():
    """``train.launch`` (demo, bench) keeps failing a job whose scheme diverged, now on every
    rank alike (the root cause names the step), instead of training on NaN."""
    with pytest.raises(DistributedError) as e:
        train.launch(_diverging_spec(schemes=("ddp_fp16",)))
    assert "Diverged: ddp_fp16 diverged at step" in str(e.value)
    assert "non-finite loss on ranks 0, 1" in str(e.value)
    assert "failed too" in str(e.value)  # both ranks raised it: neither was left waiting


def test_a_long_run_that_keeps_stepping_outlives_the_timeout(tmp_path):
    """Every step takes 0.5 s (a test-only sleep): 10 steps run well past ``--timeout 4`` in
    all, but each step completes within it, so the watchdog lets the run finish."""
    t0 = time.perf_counter()
    rc = train.main([*TINY, "--scheme", "ddp", "--steps", "10", "--step-sleep", "0.5",
                     "--timeout", "4", "--out", str(tmp_path)])
    wall = time.perf_counter() - t0
    assert rc == 0
    assert wall > 10 * 0.5 > 4  # it did run longer than --timeout
    run = _metrics(tmp_path)["runs"][0]
    assert run["status"] == "ok" and len(run["steps"]) == 10


def test_a_stalled_rank_is_caught_named_and_the_finished_scheme_kept(tmp_path, capsys,
                                                                    monkeypatch):
    """Rank 1 stops after the collectives of topka's step 2: rank 0 completes that step and
    waits in step 3. Within --timeout (4 s) of the last progress the watchdog stops the scheme
    and names rank 1 at step 2. The ddp run before it was on disk before topka started."""
    from gradsync.apps.train import command

    seen = []
    real_launch = command.launch

    def launch(spec, **kw):  # what metrics.json holds when each scheme starts
        f = tmp_path / "metrics.json"
        seen.append(json.loads(f.read_text()) if f.exists() else None)
        return real_launch(spec, **kw)

    monkeypatch.setattr(command, "launch", launch)
    rc = train.main([*TINY, "--scheme", "ddp,topka", "--steps", "6", "--timeout", "4",
                     "--stall-at", "1:2", "--inject-scheme", "topka", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 1
    assert ("no rank made progress for 4s: rank 1 stalled at step 2" in err
            and "waiting for it: rank 0 at step 3" in err), err
    assert err.strip().splitlines()[-1].startswith(
        "error: 1 of 2 schemes did not finish: topka failed: no rank made progress for 4s: "
        "rank 1 stalled at step 2")
    assert seen[0] is None  # nothing before the first scheme
    assert seen[1]["complete"] is False and [r["scheme"] for r in seen[1]["runs"]] == ["ddp"]
    assert seen[1]["runs"][0]["status"] == "ok" and len(seen[1]["runs"][0]["steps"]) == 6
    m = _metrics(tmp_path)
    assert m["complete"] is True and [r["status"][:7] for r in m["runs"]] == ["ok", "failed:"]


def _beating(rank: int, world_size: int, steps: int, stall: tuple[int, int] | None) -> int:
    assert progress_limit() == 1.5
    for i in range(steps):
        time.sleep(0.05)
        if stall == (rank, i):
            time.sleep(600)
        heartbeat(i)
    return rank


def test_run_distributed_progress_watchdog():
    """The launcher's own terms: steps of 0.05 s under a 1.5 s progress limit and no bound on
    the whole, then a rank that stops beating at step 2 while its peer finished — named with
    its step; a watchdog needs a bound (``timeout=None`` alone is refused); outside a watched
    run ``heartbeat`` does nothing."""
    assert run_distributed(_beating, 2, 5, None, timeout=None, progress_timeout=1.5) == [0, 1]
    with pytest.raises(DistributedStall) as e:  # the watchdog's verdict, with no other bound
        run_distributed(_beating, 2, 4, (1, 2), timeout=None, progress_timeout=1.5)
    assert e.value.ranks == [1] and e.value.steps == {1: 2}  # rank 0 had finished
    assert "rank 1 stalled at step 2" in str(e.value)
    with pytest.raises(ValueError, match="progress_timeout"):
        run_distributed(_beating, 1, 1, None, timeout=None)
    heartbeat(3)
    assert progress_limit() is None


def test_progress_watch_gives_a_rank_not_up_yet_its_start_up_grace():
    """Start-up (interpreter, imports, the process group) is not the loop's progress: a rank
    that has not reported yet is stalled only after ``STARTUP_GRACE_S`` (a loaded machine
    took over 1.5 s to start two ranks), one that is up after the progress limit; a stall
    names the ranks at the lowest step, 0 for not up or no step completed."""
    from gradsync.testing import distributed as d

    now = 1000.0  # an injected clock: the ages below are exact
    limit = 1.5
    assert d._stalled(([now - 10.0] * 2, [d._NOT_UP] * 2, limit), [0, 1], now) is None
    late = d._stalled(([now - d.STARTUP_GRACE_S - 1] * 2, [d._NOT_UP] * 2, limit), [0, 1], now)
    assert late is not None and late.ranks == [0, 1] and late.steps == {0: 0, 1: 0}
    up = d._stalled(([now - 2.0, now - 10.0], [-1, d._NOT_UP], limit), [0, 1], now)
    assert up is None  # rank 1 is still within its start-up grace
    both = d._stalled(([now - 2.0, now - 3.0], [-1, 4], limit), [0, 1], now)
    assert both is not None and both.ranks == [0] and both.steps == {0: 0, 1: 5}
    assert d._stalled(([now - 1.0, now - 3.0], [-1, 4], limit), [0, 1], now) is None


def test_table_and_summary_of_unfinished_runs():
    """A failed run has no records: summarized with NaN, a row of dashes and its status; the
    status column appears only when some run did not finish."""
    from gradsync.apps.train.summary import failed_run, table_rows, unfinished

    recs = [{"step": i, "loss": 1.0, "time_s": 0.1, "elapsed_s": 0.1 * (i + 1),
             "samples_per_s": 10.0, "bytes_sent": 8, "bytes_recv": 8, "backward_s": 0.0,
             "sparsify_s": 0.0, "comm_s": 0.0, "wait_s": 0.0, "missing_rate": 0.0,
             "warmup": i <= 1} for i in range(4)]
    ok = {"scheme": "ddp", "task": "image", "records": recs, "eval": {}, "status": "ok"}
    runs = train.summarize([{"rank": 0, "runs": [ok]}], 1)
    cols, rows = table_rows(runs)
    assert "status" not in cols and unfinished(runs) == []
    bad = failed_run("topka", "image", "rank 1: boom")
    runs = train.summarize([{"rank": 0, "runs": [ok, bad]}], 1)
    cols, rows = table_rows(runs)
    assert cols[-1] == "status" and rows[0][-1] == "ok" and rows[0][-2] == "-"
    assert rows[1] == ["topka"] + ["-"] * (len(cols) - 2) + ["failed: rank 1: boom"]
    s = runs[1]["summary"]
    assert s["status"] == "failed: rank 1: boom" and math.isnan(s["final_loss"])
    assert s["speedup_vs_ddp"] is None and runs[0]["summary"]["speedup_vs_ddp"] == 1.0
    assert [r["scheme"] for r in unfinished(runs)] == ["topka"]
