"""Summaries of a training job: per-scheme medians, the comparison table, ``metrics.json``.

``samples_per_s`` is global (all ranks) and, like the times, the median over the steps after
the ``warmup_steps + 1`` first ones; ``bytes_per_step`` is the mean over ranks and measured
steps; ``final_loss`` the mean over ranks of the last step's loss; ``speedup_vs_ddp`` the ratio
of samples/s to the ``ddp`` run of the same job (``None`` without one). ``auto`` measures its
runners-up once after its warm-up (one window each, slower plans included): ``probing_steps``
counts the measured steps up to its last probing step, ``settled_samples_per_s`` is the median
after them — what a run longer than the probing sees (NaN when the run ended probing) — and
``settled_bytes_per_step`` the mean bytes per rank and step after them (``bytes_per_step``
includes the probes, e.g. DDP's dense plan on trial on a slow link). The DDP hook's
trials (``auto``'s, merged buckets') probe so too. The schema of ``metrics.json`` is in
:mod:`gradsync.apps.train`.

A run that did not finish keeps its ``status``: ``"diverged at step N"`` (its records up to
that step; ``final_loss`` NaN, no evaluation) or ``"failed: <reason>"`` (no records; made by
:func:`failed_run`). The table then gains a ``status`` column, and ``metrics.json`` is
written as each scheme finishes (``complete: false`` until the last).
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from gradsync.apps.common import print_table
from gradsync.apps.train.spec import TrainSpec
from gradsync.schedule.plan import Plan

__all__ = ["SCHEMA", "environment", "failed_run", "metric_of", "progress_line", "report",
           "summarize", "table_rows", "time_to", "unfinished", "write_metrics"]

SCHEMA = "gradsync.train/1"


def _median(xs: list[float]) -> float:
    xs = [x for x in xs if not (isinstance(x, float) and math.isnan(x))]
    return statistics.median(xs) if xs else float("nan")


def metric_of(task: str) -> tuple[str, bool]:
    """The evaluation's score of ``task`` and whether higher is better."""
    return ("test_accuracy", True) if task == "image" else ("perplexity", False)


def time_to(history: list[dict], key: str, higher: bool, target: float) -> float | None:
    """Training seconds (``elapsed_s``: the steps' own times, evaluation excluded, on the link
    the run used) at which the evaluation curve ``history`` first reaches ``target``, linear
    between the last point short of it and the first that reaches it (from 0 s at the start
    when the first point reaches it); ``None`` when it never does."""
    t0 = 0.0
    v0: float | None = None
    for p in history:
        v = p.get(key)
        if v is None or not math.isfinite(v):
            return None
        if (v >= target) if higher else (v <= target):
            if v0 is None or v == v0:
                return float(p["elapsed_s"])
            return t0 + (p["elapsed_s"] - t0) * (target - v0) / (v - v0)
        t0, v0 = float(p["elapsed_s"]), v
    return None


def _time_to_accuracy(runs: list[dict]) -> None:
    """Each run's seconds to the final score of the job's ``ddp`` run (``s_to_ddp``) and the
    effective speed-up, DDP's seconds to it over the scheme's (``time_speedup_vs_ddp``): what
    a user gets, where ``speedup_vs_ddp`` is per step. ``None`` without an evaluation curve or
    a ``ddp`` run; ``s_to_ddp`` ``None`` and the speed-up 0 when the run never got there."""
    ddp = next((r for r in runs if r["scheme"] == "ddp" and r.get("status", "ok") == "ok"), None)
    key, higher = metric_of(runs[0]["task"]) if runs else ("", True)
    target = None if ddp is None else ddp["summary"].get(key)
    for r in runs:
        r["summary"]["s_to_ddp"] = r["summary"]["time_speedup_vs_ddp"] = None
    if target is None or not ddp["history"]:
        return
    t_ddp = time_to(ddp["history"], key, higher, target)
    for r in runs:
        if not r["history"] or r.get("status", "ok") != "ok":
            continue
        t = time_to(r["history"], key, higher, target)
        r["summary"]["s_to_ddp"] = t
        r["summary"]["time_speedup_vs_ddp"] = (t_ddp / t if t and t_ddp else
                                               0.0 if t is None else None)


def failed_run(scheme: str, task: str, reason: str) -> dict:
    """A rank's record of a scheme whose run failed (``status`` ``"failed: <reason>"``)."""
    return {"scheme": scheme, "task": task, "records": [], "eval": {}, "history": [],
            "plan": None, "topk_shares": None, "status": f"failed: {reason}",
            "diverged_at": None, "reason": reason}


def summarize(results: list[dict], warmup_steps: int) -> list[dict]:
    """Per scheme: the summary and the records (the fields: :mod:`gradsync.apps.train`)."""
    runs = []
    by_rank = sorted(results, key=lambda r: r["rank"])
    for i, run0 in enumerate(by_rank[0]["runs"]):
        recs = run0["records"]
        skip = min(warmup_steps + 1, max(0, len(recs) - 1))
        meas = recs[skip:]
        per_rank = [r["runs"][i]["records"] for r in by_rank]
        sent = [[x["bytes_sent"] for x in rr] for rr in per_rank]
        measured_bytes = [b for rr in sent for b in rr[skip:]]
        bytes_per_step = statistics.fmean(measured_bytes) if measured_bytes else 0.0
        s = {"scheme": run0["scheme"], "measured_steps": len(meas),
             "samples_per_s": _median([x["samples_per_s"] for x in meas]),
             "step_s": _median([x["time_s"] for x in meas])}
        for k in ("backward_s", "sparsify_s", "comm_s", "wait_s"):
            s[k] = _median([x[k] for x in meas])
        # process CPU of a step (all threads), the busiest rank's: with more ranks than cores
        # it, not the link, sets the step time
        s["cpu_s"] = _median([max(rr[j].get("cpu_s", math.nan) for rr in per_rank)
                              for j in range(skip, min(len(rr) for rr in per_rank))])
        s["bytes_per_step"] = bytes_per_step
        # over the whole run, the warm-up and a density schedule's denser steps included
        every = [b for rr in sent for b in rr]
        s["run_bytes_per_step"] = statistics.fmean(every) if every else 0.0
        s["mb_per_step"] = bytes_per_step / 1e6
        s["missing_rate"] = (statistics.fmean([x["missing_rate"] for x in meas]) if meas
                             else float("nan") if not recs else 0.0)
        status = run0.get("status", "ok")
        last = [rr[-1]["loss"] for rr in per_rank if rr]
        s["final_loss"] = statistics.fmean(last) if last and status == "ok" else float("nan")
        # auto, the hook's trials: the measured steps up to the last probing one, the median
        # after them
        last = max((j for j, x in enumerate(meas) if x.get("probing")), default=-1)
        s["probing_steps"] = last + 1
        s["settled_samples_per_s"] = _median([x["samples_per_s"] for x in meas[last + 1:]])
        # what the plan it settled on sends (bytes_per_step averages the probes in too)
        settled = [b for rr in sent for b in rr[skip + last + 1:]]
        s["settled_bytes_per_step"] = statistics.fmean(settled) if settled else float("nan")
        s.update(run0["eval"])
        plan = run0.get("plan")
        s["plan_digest"] = None if plan is None else Plan.from_dict(plan).digest()
        s["status"] = status
        runs.append({"scheme": run0["scheme"], "task": run0["task"], "status": status,
                     "diverged_at_step": run0.get("diverged_at"), "reason": run0.get("reason"),
                     "steps": recs, "bytes_sent_per_rank": sent, "summary": s, "plan": plan,
                     "history": run0.get("history", []),
                     "topk_shares": run0.get("topk_shares")})
    base = next((r["summary"] for r in runs if r["scheme"] == "ddp"), None)
    for r in runs:
        s = r["summary"]
        s["speedup_vs_ddp"] = (s["samples_per_s"] / base["samples_per_s"]
                               if base and base["samples_per_s"] > 0
                               and math.isfinite(s["samples_per_s"]) else None)
    _time_to_accuracy(runs)
    return runs


def unfinished(runs: list[dict]) -> list[dict]:
    """The runs that diverged or failed (:func:`summarize`'s output)."""
    return [r for r in runs if r.get("status", "ok") != "ok"]


def table_rows(runs: list[dict]) -> tuple[list[str], list[list[Any]]]:
    """The comparison table's columns and one row per run (:func:`summarize`'s output)."""
    lm = any(r["task"] != "image" for r in runs)
    cols = ["scheme", "samples/s", "vs ddp", "step ms", "bwd ms", "sparsify ms", "comm ms",
            "exposed ms", "MB/step", "missing %", "final loss",
            "eval ppl" if lm else "test acc %"]
    # time to DDP's final score: with an evaluation curve and a ddp run
    tta = any(r["summary"].get("time_speedup_vs_ddp") is not None for r in runs)
    if tta:
        cols += ["s to ddp's " + ("ppl" if lm else "acc"), "vs ddp (time)"]
    status = bool(unfinished(runs))  # a status column only when some run did not finish
    if status:
        cols.append("status")
    rows = []
    for r in runs:
        s = r["summary"]
        q = s.get("perplexity") if lm else (100 * s["test_accuracy"]
                                            if "test_accuracy" in s else None)
        if not r.get("steps") and r.get("status", "ok") != "ok":  # failed: nothing measured
            row = [s["scheme"]] + ["-"] * (len(cols) - 1 - status)
        else:
            row = [s["scheme"], s["samples_per_s"],
                   f"{s['speedup_vs_ddp']:.2f}x" if s["speedup_vs_ddp"] else "-",
                   1e3 * s["step_s"], 1e3 * s["backward_s"], 1e3 * s["sparsify_s"],
                   1e3 * s["comm_s"], 1e3 * s["wait_s"], s["mb_per_step"],
                   100 * s["missing_rate"], s["final_loss"], "-" if q is None else q]
            if tta:
                t, x = s.get("s_to_ddp"), s.get("time_speedup_vs_ddp")
                row += ["not reached" if t is None else f"{t:.1f}",
                        "-" if x is None or t is None else f"{x:.2f}x"]
        if status:
            row.append(_short(r.get("status", "ok")))
        rows.append(row)
    return cols, rows


def _short(text: str, n: int = 60) -> str:
    """``text`` cut to ``n`` characters for a table cell (metrics.json keeps all of it)."""
    text = " ".join(text.split())
    return text if len(text) <= n else text[:n - 1] + "…"


def progress_line(run: dict, done: int, total: int) -> str:
    """One line for a scheme as it finishes (:func:`summarize`'s run): where the job stands,
    the status and, when it trained, its throughput, bytes and final loss or score."""
    s = run["summary"]
    head = f"[{done}/{total}] {run['scheme']}: {run.get('status', 'ok')}"
    if not run.get("steps"):
        return head
    parts = [f"{s['samples_per_s']:.4g} samples/s", f"{s['mb_per_step']:.4g} MB/step"]
    if run.get("status", "ok") == "ok":
        parts.append(f"final loss {s['final_loss']:.4g}")
    if "test_accuracy" in s:
        parts.append(f"test acc {100 * s['test_accuracy']:.1f}%")
    elif "perplexity" in s:
        parts.append(f"eval ppl {s['perplexity']:.4g}")
    return f"{head} — {', '.join(parts)}"


def environment(launcher: str, backend: str, device: str, link: dict) -> dict:
    """The ``"environment"`` object of ``metrics.json``; ``link`` is the link description
    :func:`gradsync.apps.train.launch` returns."""
    return {"torch": torch.__version__, "python": platform.python_version(),
            "machine": platform.machine(), "cpus": os.cpu_count(),
            "load_avg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "launcher": launcher,
            "backend": backend, "device": device, **link,
            "propagation_delay": "not emulated"}


def write_metrics(out: str | Path, config: dict, env: dict, runs: list[dict], *,
                  complete: bool = True, plots: bool = True) -> list[Path]:
    """``metrics.json``, ``plans.json`` (the engine runs' plans by scheme, what ``train --plan``
    replays; only when there is one) plus, with ``plots``, ``loss_vs_time.png`` and
    ``throughput.png``; returns the paths. ``complete=False``: the runs so far of a job still
    running (``metrics.json``'s ``"complete"``). Each file is written whole, then renamed into
    place, so a job killed while writing leaves the previous version."""
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    paths = [d / "metrics.json"]
    _write(paths[0], json.dumps({"schema": SCHEMA, "complete": complete, "config": config,
                                 "environment": env, "runs": runs},
                                indent=1, default=_json_default))
    plans = {r["scheme"]: r["plan"] for r in runs if r.get("plan") is not None}
    if plans:
        paths.append(d / "plans.json")
        _write(paths[-1], json.dumps(plans, indent=1))
    if not plots:
        return paths
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in runs:
        ax.plot([x["elapsed_s"] for x in r["steps"]], [x["loss"] for x in r["steps"]],
                label=r["scheme"])
    ax.set_xlabel("training time on rank 0 (s)")
    ax.set_ylabel("training loss (rank 0)")
    ax.set_title(f"loss vs time — {env.get('link', '')}")
    ax.legend()
    fig.tight_layout()
    paths.append(d / "loss_vs_time.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = [r["scheme"] for r in runs]
    ax.bar(names, [r["summary"]["samples_per_s"] for r in runs], color="tab:blue")
    ax.set_ylabel("samples/s (median after warm-up, all ranks)")
    ax.set_title(f"throughput per scheme — {env.get('link', '')}")
    ax.tick_params(axis="x", rotation=45)
    fig.tight_layout()
    paths.append(d / "throughput.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _json_default(o: Any) -> Any:
    if isinstance(o, float | int):
        return o
    return str(o)


def report(spec: TrainSpec, results: list[dict], env: dict, title: str) -> list[dict]:
    """Print the comparison table, a row per scheme — those that diverged or failed marked in
    a ``status`` column — (and write ``spec.out``); returns the runs."""
    runs = summarize(results, spec.warmup_steps)
    cols, rows = table_rows(runs)
    print_table(title, cols, rows)
    if spec.out:
        paths = write_metrics(spec.out, spec.config(len(results)), env, runs)
        print("wrote " + ", ".join(str(p) for p in paths))
    return runs
