"""``python -m gradsync bench anatomy``: where a synchronized step's time goes, against the same
step with no gradient exchange at all.

``python -m gradsync bench anatomy [--model cnn] [--world-size 2,4] [--bandwidth loopback,1gbit]
[--steps 40] [--schemes ddp,topka,…] [--repeats 1] [--out bench-out/anatomy] [--write-docs]``

``--repeats N`` runs every job N times and keeps, per scheme, the run whose step − floor is the
median (its whole row, so that its parts still add up; every run's step − floor beside it): one
run's rows move by up to ±1 ms on these shared cores (docs/results/speed.md).

For every world size P of ``--world-size`` and every link of ``--bandwidth`` (``loopback`` and
tc rates, shaped as ``bench schemes`` shapes them: per-rank ``tbf`` links, root only, else a
one-line note and loopback) it runs one job of P gloo ranks
(:func:`gradsync.apps.train.launch`, what ``bench schemes`` runs: same seed, same shards,
the same initial model for every scheme) in which each rank trains

* the **floor**: the bare model alone (``train``'s ``local`` runner,
  :data:`gradsync.apps.train.spec.LOCAL`): the same model, data shard, batch and SGD step
  (momentum 0.9, as DDP's optimizer), no hook and no exchange; its P processes share the cores
  as the schemes' P do;
* the **meeting floor** (:data:`gradsync.apps.train.spec.MEET`): the floor whose ranks
  all-reduce one 8-byte word after each backward, no gradient, once after the first floor and
  once before the last: what meeting once a step costs before any gradient travels. Every
  synchronized step pays it: the ranks' steps drift apart on shared cores, and the first to
  arrive waits for the last. ``meet_cost_ms`` is each
  meeting run's step against the floor runs either side of it, averaged; a row's
  ``over_meet_ms`` ("beyond meeting") is its step − floor less that cost;
* every scheme in turn, as ``python -m gradsync train`` does, each followed by the floor
  again (by default the engine's and, as ``ddp_gradsync_<s>``, the same schemes through
  gradsync's DDP hook, the door of Lightning, Accelerate and the Trainer). A scheme's floor
  figures are over the measured steps of the two floor runs either side of it, so a machine
  whose speed drifts during the job moves the floor as it moves the schemes.

Every time is rank 0's **mean** over the measured steps (after ``--warmup-steps + 1``), not
the median ``train`` reports: means add up, so a step's mean is exactly the sum of its
phases' means, where the medians of the phases missed the median step by up to 12 ms on these
shared cores (the phases' distributions are skewed, and not alike). Except ``cpu ms`` (the
busiest rank's process CPU time per step, every thread, then the median: ``bench schemes``'
cpu ms) and the bytes (sent per rank and step, counted at the torch.distributed call, mean
over ranks and measured steps).

The decomposition. The training loop times four consecutive parts of each step on the
training thread (``train_scheme``'s ``phases``): forward (``zero_grad``, forward, loss),
``loss.backward()``, the runner's work after it (the engine's ``synchronize()``; nothing for
torch's DDP) and the optimizer step. So step − floor is Δforward + Δbackward +
synchronize() + Δoptimizer, each Δ against the floor's own part (``phase_gap_ms`` in the
JSON: what the loop's own bookkeeping between the parts adds, ~0). The components measured
on their own, and where they sit:

* ``select``: the engine's ``sparsify_s`` (error feedback's selection, inline and offloaded);
  for torch's DDP the synchronous part of its comm hooks (bucket launches). With an
  overlapping plan (``plans.json``) the jobs are prepared in the gradient hooks, inside
  ``loss.backward()``; a plan without overlap (``dense``) prepares them in ``synchronize()``,
  where the time is already part of ``sync host`` and is not counted again (†); tensors the
  plan offloads (SSFusion-O) are selected on the worker thread, concurrently with the backward
  pass, and ``sparsify_s`` then sums both threads' time (‡: the engine does not record the
  split per step).
* ``hooks``: the engine's ``hooks_s`` (``StepStats.hooks_s``), the gradient hooks' time
  launching jobs inside ``loss.backward()``: gathering a job's gradients, error feedback's
  accumulation, the inline selection (so ``select``'s inline part is inside it) and the
  hand-off to the communication thread; for torch's DDP, ``select``.
* ``wait``: ``wait_s``, the exposed communication: the engine's ``synchronize()`` blocked on
  the communication thread; DDP (torch's hooks, gradsync's): from the end of the last bucket's
  hook call to ``loss.backward()`` returning, plus the hook calls' own blocks
  (``hook_blocked_s``: their wall time minus the thread's CPU and wait for a core in them;
  gradsync's hook waits there for the last bucket's collectives and its communication
  thread) — inside the backward call (*).
* ``sync host``: the engine's ``synchronize()`` minus its wait (per step, then the mean):
  launching what the backward left, the ranks' finiteness agreement, decoding the sums into
  ``.grad``, the residuals (``apply``) and the step's bookkeeping. 0 for torch's DDP.
* ``main``, ``runq``: the training thread's own CPU time inside ``loss.backward()``
  (``phases``' ``backward_main_cpu_s``) and the time it waited there for a core, runnable but
  not running (``backward_main_runq_s``: Linux's ``/proc/thread-self/schedstat``), each over
  the floor's. Where the ranks fill the cores (P ≥ cores, as here) the communication thread,
  gloo's threads and the other ranks take the core from it: that is ``runq``.
* ``threads``: the CPU time the process's other threads spent while ``loss.backward()`` ran
  (``backward_others_cpu_s``: process CPU minus the training thread's), over the floor's: the
  engine's communication and offload threads and gloo's own. A cause of ``runq``, not a part
  of the step: shown, and counted only for records made before the run-queue clock.

``counted`` = the training thread's time inside ``loss.backward()`` over the floor's, which
is its CPU (``main``: the hooks' work, DDP's bucket copies, the autograd engine's work for
the hooks), its wait for a core (``runq``) and its blocks — DDP's exposed wait, the blocks
measured there (the engine's gradient hooks do not wait on the wire) — three disjoint
intervals of one thread. At most Δbackward⁺ (the backward's slowdown: what runs inside it
cannot have cost more, and a larger figure means the floor's backward was the slower one, i.e.
noise). Plus the engine's ``synchronize()`` (wait + sync host), plus, in the forward and the
optimizer step, the training thread's extra CPU and wait for a core there (``main′`` +
``runq′``: a slower forward after the exchange, a communication thread still finishing), at
most (Δforward + Δoptimizer)⁺. ``residual`` = step − floor − counted: blocks nobody measured
(the GIL held by the communication thread, a lock, the hand-off to a thread) and noise.
Records made before the run-queue clock count, in the backward, the larger of ``main`` and
the hooks' wall time plus, for the engine, ``threads`` (each such millisecond read as one the
training thread waited for a core); outside it ``threads′`` for ``runq′``; before the thread
clocks, the engine's hooks or DDP's select + wait.

**The floor** of a row is the floor runs either side of it: the job runs the floor before the
first scheme and after every scheme, so a machine whose speed drifts during the job (the load
of other jobs) moves each scheme's floor with it.

``accounted %`` = 100 × counted / (step − floor): the share of the step's extra time the
measured components explain; marked ``~`` when step − floor is within twice the floor's own
drift around the row (its two floor runs' means against each other), where the ratio
means little. ``of sync phases %`` = 100 × counted in those two phases (main′ + runq′ left out) /
(Δbackward⁺ + synchronize()): the share
of the two phases that hold the synchronization, which the forward's and optimizer's noise
does not reach (≤ 100 by construction). ``of step %`` = 100 × (floor + counted) / step.
Counted's parts do not overlap: in each part of the step, the training thread's CPU, the time
it waits for a core, and the time it blocks (DDP's wait inside the backward; the engine's wait
in ``synchronize()``) are disjoint. What overlaps them: ``comm``
(``comm_s``: time inside the step's collectives, summed over them, on the communication
thread; torch's DDP: the union of its all-reduces' launch→done) runs concurrently with the
backward pass and only its exposed part, ``wait``, is on the training thread; an offloaded
selection overlaps the backward pass; and on shared cores every thread's CPU time slows the
others (``cpu ms`` counts all of them: with more ranks than cores it, not the link, sets the
step; ``cpu−floor`` is it against the floor's, the CPU the exchange costs, steadier than wall
times on shared cores).

``comm`` against ``wire``: ``wire`` is the step's bytes' time at the link rate,
bytes_sent × 8 / rate. On a shaped link the rate is the tbf rate per rank and direction. On
loopback there is no set rate: the rate used is the one DDP's all-reduce achieved in the same
job (its bytes per step × 8 / its comm time per step, printed with the table), so ``comm /
wire`` on loopback is a collective's time against a dense all-reduce's for as many bytes.
What a collective does besides moving bytes — encoding, decoding, merging, the extra rounds —
runs inside its time: encode/decode are not separable per step, and ``comm − wire`` bounds
them from above.

Writes ``<out>/anatomy.json`` (every row, the floors, the loopback rates, the environment) and
``anatomy.png`` (stacked bars per link and P: floor, select, wait, sync host, residual; the
step as a tick). ``--write-docs`` also writes ``docs/results/anatomy-cpu.md`` (the tables,
the command, date, machine, commit and what the numbers show) with ``anatomy-cpu.json`` and
``anatomy-cpu.png`` beside it. Times on a shared machine are noisy: quote medians, and compare
schemes within one job.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from gradsync.apps.bench.schemes import LOOPBACK, link_rate, parse_links
from gradsync.apps.common import code_revision, cpu_description, print_table, write_outputs

if TYPE_CHECKING:
    from gradsync.apps.train import TrainSpec

__all__ = ["COLUMNS", "DEFAULT_SCHEMES", "DOCS_PATH", "anatomy_rows", "anatomy_worker",
           "floor_figures", "floor_thread", "loopback_rate", "main", "parse_world_sizes",
           "write_docs"]

# the engine's schemes, then the DDP hook's (what Lightning, Accelerate and the Trainer run)
DEFAULT_SCHEMES = ("ddp", "topka", "ssfusion_oi", "ssfusion", "per_tensor", "densestream",
                   "oktopk", "ddp_gradsync_ssfusion_oi", "ddp_gradsync_per_tensor")
DOCS_PATH = Path("docs/results/anatomy-cpu.md")
NAN = float("nan")


def parse_world_sizes(value: str) -> list[int]:
    """``--world-size``: comma-separated integers ≥ 2, no repeats; ``ValueError`` otherwise."""
    try:
        sizes = [int(v) for v in str(value).split(",")]
    except ValueError:
        raise ValueError(f"--world-size: integers, comma-separated, got {value!r}") from None
    if any(p < 2 for p in sizes) or len(set(sizes)) != len(sizes):
        raise ValueError(f"--world-size: distinct integers >= 2, got {value!r}")
    return sizes


def anatomy_worker(rank: int, world_size: int, spec: TrainSpec, keep_going: bool = False
                   ) -> dict:
    """One rank of a link's job: the floor (:data:`~gradsync.apps.train.spec.LOCAL`), the
    meeting floor (:data:`~gradsync.apps.train.spec.MEET`), every scheme of ``spec``
    (:func:`~gradsync.apps.train.train_worker`) each followed by the floor, then the meeting
    floor and the floor again; returns ``train_worker``'s ``{"rank", "runs"}`` plus
    ``"floor"``, the floor runs (one before the schemes, one after each, one last), and
    ``"meet"``, the two meeting runs. So every scheme runs between two floors in the same
    processes, and a machine whose speed drifts during the job moves each scheme's floor as it
    moves the scheme; each meeting run, too. Module level: the launchers start it on every
    rank."""
    import dataclasses

    import torch

    from gradsync.apps.train import train_scheme, train_worker
    from gradsync.apps.train.spec import LOCAL, MEET

    device = torch.device(spec.device or "cpu")
    floors = [train_scheme(LOCAL, rank, world_size, spec, device)]
    meets = [train_scheme(MEET, rank, world_size, spec, device)]
    runs: list[dict] = []
    for name in spec.schemes:  # each scheme between two floors
        one = dataclasses.replace(spec, schemes=(name,))
        runs += train_worker(rank, world_size, one, keep_going=keep_going)["runs"]
        floors.append(train_scheme(LOCAL, rank, world_size, spec, device))
    meets.append(train_scheme(MEET, rank, world_size, spec, device))
    floors.append(train_scheme(LOCAL, rank, world_size, spec, device))
    return {"rank": rank, "runs": runs, "floor": floors, "meet": meets}


def _floor_run(results: list[dict], skip: int, which: slice
               ) -> tuple[dict, list[list[dict]]]:
    """Rank 0's floor runs ``which`` as one run of their measured steps (each run's first
    ``skip`` steps left out), and every rank's measured records of those runs."""
    def measured(runs: list[dict], key: str) -> list[dict]:
        return [x for run in runs[which] for x in run[key][skip:]]

    by_rank = sorted(results, key=lambda r: r["rank"])
    rank0 = by_rank[0]["floor"]
    return ({"records": measured(rank0, "records"), "phases": measured(rank0, "phases")},
            [measured(r["floor"], "records") for r in by_rank])


def _mean(xs: list[float]) -> float:
    xs = [x for x in xs if x == x]  # NaN out
    return statistics.fmean(xs) if xs else NAN


def _median(xs: list[float]) -> float:
    xs = [x for x in xs if x == x]  # NaN out
    return statistics.median(xs) if xs else NAN


def _rank0(results: list[dict]) -> list[dict]:
    """Rank 0's runs of a job's per-rank results."""
    return min(results, key=lambda r: r["rank"])["runs"]


def _phases(run: dict, skip: int) -> dict[str, float]:
    """Means over a run's measured steps (module docstring: means add up) of its phases
    (``train_scheme``'s ``phases``: the four parts, each thread's CPU in three of them), of the
    engine's host work in ``synchronize()`` besides its wait, and of the records' step time,
    hooks, selection, wait and communication."""
    ph = run.get("phases") or []
    recs = run["records"]
    skip = min(skip, max(0, len(ph) - 1))
    out = {k: _mean([p[k] for p in ph[skip:]]) for k in
           ("forward_s", "backward_call_s", "after_backward_s", "optimizer_s")}
    out["sync_host_s"] = _mean([max(0.0, p["after_backward_s"] - r["wait_s"])
                                  for p, r in zip(ph[skip:], recs[skip:])])
    out["hooks_s"] = _mean([r.get("hooks_s", NAN) for r in recs[skip:]])  # engine only
    for part in ("forward", "backward", "optimizer"):
        for k in (f"{part}_main_cpu_s", f"{part}_others_cpu_s", f"{part}_main_runq_s"):
            out[k] = _mean([p.get(k, NAN) for p in ph[skip:]])
    for k in ("time_s", "sparsify_s", "wait_s", "comm_s"):
        out[k] = _mean([r.get(k, NAN) for r in recs[skip:]])
    # DDP's hook calls' blocks (metering): inside the backward, its exposed wait with wait_s;
    # 0 for the engine and for records made before they were metered
    blocked = [r.get("hook_blocked_s", NAN) for r in recs[skip:]]
    out["hook_blocked_s"] = _mean([b if b == b else 0.0 for b in blocked])
    return out


def loopback_rate(summary: dict | None) -> float | None:
    """Bits per second DDP's all-reduce achieved (its bytes per step over its comm time per
    step), the rate ``wire`` uses on loopback; ``None`` without a ddp run or comm time."""
    if not summary or not summary.get("comm_s") or not summary["comm_s"] > 0:
        return None
    return 8 * summary["bytes_per_step"] / summary["comm_s"]


def _selection_place(run: dict) -> str:
    """Where a run's selection (``sparsify_s``) runs: ``"backward"`` (in the gradient hooks),
    ``"synchronize"`` (a plan without overlap), ``"backward+worker"`` (an offloading plan)."""
    plan = run.get("plan")
    if plan is None:  # torch's DDP: the hooks' synchronous part, inside loss.backward()
        return "backward"
    if not plan.get("overlap", True):
        return "synchronize"
    if any(t.get("offload") for b in plan.get("buffers", []) for t in b["tensors"]):
        return "backward+worker"
    return "backward"


def floor_figures(results: list[dict], skip: int, which: slice = slice(None)
                  ) -> dict[str, float]:
    """The floor of a job (:func:`anatomy_worker`'s ``"floor"`` runs ``which``, by default all
    of them, every step after each one's first ``skip``): rank 0's mean step and phases, the
    busiest rank's median process CPU per step, in ms, and the measured steps; ``before_ms``,
    ``after_ms``: the first and last floor run's own mean, ``spread_ms`` the largest
    difference between the runs' means (the drift during the job)."""
    run, per_rank = _floor_run(results, skip, which)
    ph = _phases(run, 0)
    n = min(len(rr) for rr in per_rank)
    each = [1e3 * _mean([x["time_s"] for x in f["records"][skip:]])
            for f in min(results, key=lambda r: r["rank"])["floor"][which]]
    return {"step_ms": 1e3 * _mean([x["time_s"] for x in run["records"]]),
            "before_ms": each[0], "after_ms": each[-1], "spread_ms": max(each) - min(each),
            "cpu_ms": 1e3 * _median([max(rr[j]["cpu_s"] for rr in per_rank) for j in range(n)]),
            "measured_steps": len(run["records"]),
            **{k[:-2] + "_ms": 1e3 * v for k, v in ph.items() if k != "sync_host_s"}}


def meet_figures(results: list[dict], skip: int) -> dict[str, Any]:
    """What meeting once a step costs in a job (:func:`anatomy_worker`'s ``"meet"`` runs, every
    step after each one's first ``skip``; rank 0's means, ms): ``meet_ms``, the meeting floor's
    step; ``meet_wait_ms``, its all-reduce; ``meet_cost_ms``, each meeting run's step against
    the mean of the floor runs either side of it, averaged over the runs (``meet_cost_runs_ms``);
    ``floor_ranks_ms``, each rank's own floor (every floor run), in rank order: the slowest
    sets a synchronized step's pace, so the slowest's excess over rank 0's is the part of the
    meeting's cost that one process running slower throughout explains (the rest: the steps'
    drift from step to step, and the round). NaN for results without meeting runs (made
    before them)."""
    def step(run: dict) -> float:
        return 1e3 * _mean([x["time_s"] for x in run["records"][skip:]])

    by_rank = sorted(results, key=lambda r: r["rank"])
    # each rank's floor over all its floor runs: a synchronized step goes at the slowest's pace
    ranks = [_mean([step(f) for f in r["floor"]]) for r in by_rank]
    meets, floors = by_rank[0].get("meet") or [], by_rank[0]["floor"]
    if not meets or len(floors) < 2:
        return {"meet_ms": NAN, "meet_wait_ms": NAN, "meet_cost_ms": NAN,
                "meet_cost_runs_ms": [], "floor_ranks_ms": ranks}

    around = [(floors[0], floors[1]), (floors[-2], floors[-1])]
    costs = [step(m) - (step(a) + step(b)) / 2 for m, (a, b) in zip(meets, around)]
    return {"meet_ms": _mean([step(m) for m in meets]),
            "meet_wait_ms": 1e3 * _mean([x["wait_s"] for m in meets
                                         for x in m["records"][skip:]]),
            "meet_cost_ms": _mean(costs), "meet_cost_runs_ms": costs, "floor_ranks_ms": ranks}


def anatomy_rows(results: list[dict], runs: list[dict], skip: int, link: str,
                 world_size: int, rate_bps: float | None) -> list[dict]:
    """One row per scheme of a job: ``results`` are the job's per-rank results
    (:func:`anatomy_worker`'s, through :func:`gradsync.apps.train.launch`), ``runs`` their
    :func:`~gradsync.apps.train.summarize` (in the same order); ``skip`` steps of each run are
    not measured; ``rate_bps`` is the link rate ``wire`` uses (``None``: no wire time). The
    fields are in the module docstring, times in ms."""
    rows = []
    meet = meet_figures(results, skip)["meet_cost_ms"]
    for i, (raw, run) in enumerate(zip(_rank0(results), runs)):
        fl = floor_figures(results, skip, slice(i, i + 2))  # the floors either side of it
        floor_ms = fl["step_ms"]
        s = run["summary"]
        ph = _phases(raw, skip)
        step = 1e3 * ph["time_s"]
        over = step - floor_ms

        def delta(key: str, ph: dict = ph, fl: dict = fl) -> float:  # against the floor, ms
            return 1e3 * ph[key + "_s"] - fl[key + "_ms"]

        d_bwd = delta("backward_call")
        place = _selection_place(raw)
        engine = raw.get("plan") is not None
        select = 1e3 * ph["sparsify_s"]
        wait = 1e3 * (ph["wait_s"] + (0.0 if engine else ph["hook_blocked_s"]))
        # inside loss.backward() (module docstring, "counted"): the training thread's time
        # there is its CPU (main), its wait for a core (runq) and its blocks (torch DDP's
        # exposed wait), each against the floor's. Records without the run-queue clock take
        # the other threads' CPU (engine) for the wait for a core, and the larger of the
        # thread's CPU and its hooks' wall time for its work (or the hooks alone, before the
        # thread clocks). At most the backward's slowdown counts.
        hooks = 1e3 * ph["hooks_s"]
        threads, main = delta("backward_others_cpu"), delta("backward_main_cpu")
        runq = delta("backward_main_runq")
        blocked = 0.0 if engine else wait
        if runq == runq:
            in_bwd = max(0.0, main) + max(0.0, runq) + blocked
        else:
            own = ((hooks if hooks == hooks else 0.0 if place == "synchronize" else select)
                   if engine else select)
            clocks = main == main  # NaN: records made before the thread clocks
            if clocks:
                own = max(own, main)
            in_bwd = max(0.0, own) + ((max(0.0, threads) if clocks else 0.0) if engine
                                      else blocked)
        counted_bwd = min(in_bwd, max(0.0, d_bwd))
        host = 1e3 * ph["sync_host_s"] if engine else 0.0
        in_sync = wait + host if engine else 0.0  # synchronize(): its wait and host work
        # the forward and optimizer step: the training thread's extra CPU and wait for a core
        # (without the run-queue clock: the other threads' CPU), at most their slowdown
        d_out = delta("forward") + delta("optimizer")
        threads_out = delta("forward_others_cpu") + delta("optimizer_others_cpu")
        main_out = delta("forward_main_cpu") + delta("optimizer_main_cpu")
        runq_out = delta("forward_main_runq") + delta("optimizer_main_runq")
        queued_out = runq_out if runq_out == runq_out else threads_out
        counted_out = min(max(0.0, queued_out) + max(0.0, main_out), max(0.0, d_out))
        explained = counted_bwd + in_sync + counted_out
        phases = max(0.0, d_bwd) + in_sync
        wire = (8 * s["bytes_per_step"] / rate_bps * 1e3) if rate_bps else NAN
        comm = 1e3 * ph["comm_s"]
        rows.append({
            "link": link, "world_size": world_size, "scheme": s["scheme"],
            "status": run.get("status", "ok"), "measured_steps": s["measured_steps"],
            "step_ms": step, "floor_ms": floor_ms, "over_floor_ms": over,
            "meet_cost_ms": meet, "over_meet_ms": over - meet,
            "median_step_ms": 1e3 * s["step_s"],  # train's figure, for speed comparisons
            "forward_ms": 1e3 * ph["forward_s"], "backward_call_ms": 1e3 * ph["backward_call_s"],
            "sync_call_ms": 1e3 * ph["after_backward_s"], "optimizer_ms": 1e3 * ph["optimizer_s"],
            "d_forward_ms": delta("forward"),
            "d_backward_ms": d_bwd,
            "d_optimizer_ms": delta("optimizer"),
            "select_ms": select, "select_place": place, "wait_ms": wait,
            "hooks_ms": hooks if engine else select, "threads_ms": threads,
            "threads_out_ms": threads_out, "counted_out_ms": counted_out,
            "main_cpu_backward_ms": main, "main_cpu_out_ms": main_out,
            "runq_backward_ms": runq, "runq_out_ms": runq_out,
            "wait_place": "synchronize" if engine else "backward", "sync_host_ms": host,
            "in_backward_ms": in_bwd, "counted_backward_ms": counted_bwd,
            "sync_wait_ms": wait if engine else 0.0, "explained_ms": explained,
            "residual_ms": over - explained,
            "accounted_pct": 100 * explained / over if over > 0 else NAN,
            "noisy": not over > 2 * fl["spread_ms"],
            "sync_phases_pct": (100 * (counted_bwd + in_sync) / phases if phases > 0
                                else NAN),
            "accounted_step_pct": 100 * (floor_ms + explained) / step if step > 0 else NAN,
            "floor_spread_ms": fl["spread_ms"],
            "comm_ms": comm, "wire_ms": wire,
            "comm_over_wire": comm / wire if wire == wire and wire > 0 else NAN,
            "rate_bps": rate_bps, "cpu_ms": 1e3 * s["cpu_s"], "floor_cpu_ms": fl["cpu_ms"],
            "d_cpu_ms": 1e3 * s["cpu_s"] - fl["cpu_ms"],
            "bytes_per_step": s["bytes_per_step"], "missing_rate": s["missing_rate"],
            "backward_ms": 1e3 * s["backward_s"],
            # the step's time outside the four timed parts (the loop's bookkeeping)
            "phase_gap_ms": step - 1e3 * sum(ph[k] for k in ("forward_s", "backward_call_s",
                                                             "after_backward_s", "optimizer_s")),
        })
    return rows


def _cells(r: dict) -> list[Any]:
    mark = {"synchronize": " †", "backward+worker": " ‡"}.get(r["select_place"], "")
    pct, sync_pct = r["accounted_pct"], r["sync_phases_pct"]
    over_meet = r.get("over_meet_ms", NAN)
    return [r["scheme"], r["step_ms"], r["floor_ms"], r["over_floor_ms"],
            "-" if over_meet != over_meet else over_meet, r["d_backward_ms"],
            f"{r['select_ms']:.3g}{mark}", r["hooks_ms"],
            *("-" if v != v else v for v in (
                r["main_cpu_backward_ms"], r.get("runq_backward_ms", NAN), r["threads_ms"],
                r["main_cpu_out_ms"], r.get("runq_out_ms", NAN), r["threads_out_ms"])),
            f"{r['wait_ms']:.3g}" + (
                " *" if r["wait_place"] == "backward" else ""),
            r["sync_host_ms"], r["explained_ms"], r["residual_ms"],
            "-" if pct != pct else ("~" if r["noisy"] else "") + f"{pct:.0f}",
            "-" if sync_pct != sync_pct else f"{sync_pct:.0f}",
            f"{r['accounted_step_pct']:.0f}",
            r["comm_ms"], r["wire_ms"] if r["wire_ms"] == r["wire_ms"] else "-", r["cpu_ms"],
            r["d_cpu_ms"], r["bytes_per_step"] / 1e6]


COLUMNS = ["scheme", "step ms", "floor ms", "step−floor", "beyond meeting", "Δbackward", "select",
           "hooks",
           "main", "runq", "threads", "main′", "runq′", "threads′", "wait", "sync host",
           "counted", "residual",
           "accounted %", "of sync phases %", "of step %", "comm ms", "wire ms", "cpu ms",
           "cpu−floor", "MB/step"]
LEGEND = ("beyond meeting: step − floor − what meeting once a step costs (the meeting floor's "
          "step − floor, in the row's own run of the job); "
          "select: † runs inside synchronize() (a plan without overlap), ‡ includes the offload "
          "worker's time; wait: * inside loss.backward() (torch's DDP); counted: the parts "
          "explained (in-backward ones capped at Δbackward, main′ + runq′ at Δforward + "
          "Δoptimizer); "
          "accounted %: counted / (step − floor), ~ where step − floor is within twice the "
          "floor's drift around the row; of sync phases %: counted in the backward and "
          "synchronize() / (Δbackward⁺ + synchronize()); of step %: (floor + counted) / step")


def _title(link: str, P: int, spec: TrainSpec, rate: float | None) -> str:
    how = ("" if link != LOOPBACK else
           " — wire at DDP's achieved rate " + (f"{rate / 1e9:.3g} Gbit/s" if rate else "(none)"))
    return (f"bench anatomy — {spec.model}, P={P}, {link}, density {spec.density}, "
            f"{spec.steps} steps{how}")


def _plot(rows: list[dict]):
    def plot(ax) -> None:
        names = [f"{r['scheme']} P{r['world_size']} {r['link']}" for r in rows]
        x = list(range(len(rows)))
        bottom = [0.0] * len(rows)
        for key, label, color in (("floor_ms", "floor (no sync)", "tab:gray"),
                                  ("counted_backward_ms",
                                   "in backward: select (DDP: + wait)", "tab:orange"),
                                  ("sync_wait_ms", "synchronize(): wait", "tab:red"),
                                  ("sync_host_ms", "synchronize(): host", "tab:purple"),
                                  ("residual_ms", "residual (≥ 0 shown)", "tab:olive")):
            vals = [max(0.0, r[key]) if r[key] == r[key] else 0.0 for r in rows]
            ax.bar(x, vals, bottom=bottom, label=label, color=color)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.scatter(x, [r["step_ms"] for r in rows], marker="_", s=200, color="black",
                   label="step (mean)", zorder=3)
        ax.set_xticks(x, names, rotation=90, fontsize=5)
        ax.set_ylabel("ms per step (mean)")
        ax.set_title("bench anatomy: step = floor + counted (select, wait, sync host) + residual",
                     fontsize=9)
        ax.legend(fontsize=6)

    return plot


def _parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[str], list[int]]:
    p = argparse.ArgumentParser(prog="python -m gradsync bench anatomy", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="cnn")
    p.add_argument("--world-size", default="2,4", help="comma-separated (default 2,4)")
    p.add_argument("--bandwidth", default=LOOPBACK,
                   help="links, comma-separated: loopback and tbf rates (1gbit, …)")
    p.add_argument("--latency", default=None, help="tbf queueing bound, not a delay")
    p.add_argument("--density", default="0.01")
    p.add_argument("--sparsifier", default="dgc")
    p.add_argument("--steps", default="40", help="steps per scheme (default 40)")
    p.add_argument("--batch-size", default="16", help="per rank (default 16)")
    p.add_argument("--warmup-steps", default="5",
                   help="engine profiling steps, not measured (default 5)")
    p.add_argument("--schemes", default=",".join(DEFAULT_SCHEMES),
                   help=f"comma-separated (default {','.join(DEFAULT_SCHEMES)})")
    p.add_argument("--seed", default="0")
    p.add_argument("--out", default="bench-out/anatomy")
    p.add_argument("--write-docs", action="store_true",
                   help=f"also write {DOCS_PATH} and its JSON and PNG beside it")
    p.add_argument("--progress", action="store_true", help="show the training progress bars")
    p.add_argument("--repeats", type=int, default=1,
                   help="run each job this many times; each row is its median run (default 1)")
    a = p.parse_args(argv)
    if a.repeats < 1:
        p.error("--repeats must be >= 1")
    try:
        links = parse_links(a.bandwidth)
        sizes = parse_world_sizes(a.world_size)
    except ValueError as e:
        p.error(str(e))
    if a.latency is not None and links == [LOOPBACK]:
        p.error("--latency shapes links: give a rate in --bandwidth too")
    return a, links, sizes


def _spec(a: argparse.Namespace, P: int, link: str) -> TrainSpec:
    from gradsync.apps import train

    targs = ["--model", a.model, "--world-size", str(P), "--density", a.density,
             "--sparsifier", a.sparsifier, "--steps", a.steps, "--batch-size", a.batch_size,
             "--warmup-steps", a.warmup_steps, "--scheme", a.schemes, "--seed", a.seed,
             "--eval-batches", "0", "--density-warmup", "off",  # steps at the target density
             ] + ([] if a.progress else ["--no-progress"])
    if link != LOOPBACK:
        targs += ["--bandwidth", link] + (["--latency", a.latency] if a.latency else [])
    return train.parse_args(targs, parser=train.build_parser("python -m gradsync bench anatomy"))


class JobRun(NamedTuple):
    """One run of a job (:func:`_job`)."""

    rows: list[dict]
    floor: dict            # floor_figures, with the link and P
    name: str              # the link as the page names it
    rate: float | None     # bits/s: the tbf rate, or on loopback DDP's achieved rate this run
    descr: dict            # the launcher's description of the link
    shaped: bool


def _job(results: list[dict], descr: dict, spec: TrainSpec, skip: int, P: int, link: str
         ) -> JobRun:
    """One run of a job: its rows, its floor figures, the link's name and rate (loopback: DDP's
    achieved all-reduce rate in this run), the link's description and whether it was shaped."""
    from gradsync.apps import train

    runs = train.summarize(results, spec.warmup_steps)
    ddp = next(({**r["summary"], "comm_s": _phases(raw, skip)["comm_s"]}  # its mean
                for r, raw in zip(runs, _rank0(results)) if r["scheme"] == "ddp"), None)
    shaped = bool(link != LOOPBACK and descr.get("shaped"))
    rate = link_rate(link) if shaped else loopback_rate(ddp)
    name = link if link == LOOPBACK or shaped else f"{link} (not shaped: loopback)"
    return JobRun(anatomy_rows(results, runs, skip, name, P, rate),
                  {"link": name, "world_size": P, **floor_figures(results, skip),
                   **meet_figures(results, skip)}, name, rate, descr, shaped)


def median_job(jobs: list[JobRun]) -> tuple[list[dict], dict, str, float | None, bool]:
    """The rows of several runs of one job (:func:`_job`): per scheme, the run whose step −
    floor is the median of the runs' (the lower middle one of an even count), its row whole,
    so that its parts still add up, with every run's step − floor (``over_floor_runs_ms``, in
    run order); the floor of the run whose floor step is the median, with every run's
    (``step_ms_runs``); the link's name, rate (the first run's) and whether it was shaped."""
    rows = []
    for per_run in zip(*(j.rows for j in jobs), strict=True):
        ranked = sorted(per_run, key=lambda r: r["over_floor_ms"])
        rows.append({**ranked[(len(ranked) - 1) // 2],
                     "over_floor_runs_ms": [r["over_floor_ms"] for r in per_run]})
    floors = [j.floor for j in jobs]
    floor = sorted(floors, key=lambda f: f["step_ms"])[(len(floors) - 1) // 2]
    first = jobs[0]
    return (rows, {**floor, "step_ms_runs": [f["step_ms"] for f in floors]}, first.name,
            first.rate, first.shaped)


def _load() -> float:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else NAN


def main(argv: list[str] | None = None) -> int:
    from gradsync.apps import train
    from gradsync.testing import DistributedError, DistributedTimeout

    argv = list(sys.argv[1:] if argv is None else argv)
    a, links, sizes = _parse(argv)
    specs = {(P, link): _spec(a, P, link) for P in sizes for link in links}
    first = train.resolve_data(specs[(sizes[0], links[0])])
    specs = {k: train.resolve_data(s, quiet=True) for k, s in specs.items()}
    print(f"bench anatomy: {first.model} on {first.data}, P in {sizes}, {first.steps} steps × "
          f"{first.batch_size} per rank, density {first.density}, schemes "
          f"{', '.join(first.schemes)}, links {', '.join(links)}", flush=True)
    meta: dict[str, Any] = {
        "command": "python -m gradsync bench anatomy " + shlex.join(argv),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "code": code_revision(),
        "machine": f"{os.cpu_count()} cores ({cpu_description()})", "load_start": _load(),
        "world_sizes": sizes, "links": links, "config": first.config(sizes[0]),
        "floors": [], "loopback_rate_bps": {}, "link_descriptions": {}, "repeats": a.repeats}
    skip = first.warmup_steps + 1
    t0 = time.perf_counter()
    rows: list[dict] = []
    for P in sizes:
        for link in links:
            spec = specs[(P, link)]
            jobs = []
            for _ in range(a.repeats):
                try:
                    results, descr = train.launch(spec, worker=anatomy_worker)
                except (DistributedError, DistributedTimeout) as e:
                    print(f"bench anatomy failed at P={P} on {link}: {e}")
                    return 1
                jobs.append(_job(results, descr, spec, skip, P, link))
            mine, floor, name, rate, shaped = median_job(jobs)
            meta["link_descriptions"][f"P{P} {link}"] = jobs[0].descr
            if not shaped:
                meta["loopback_rate_bps"][f"P{P} {name}"] = rate
            meta["floors"].append(floor)
            print_table(_title(name, P, spec, rate if not shaped else None), COLUMNS,
                        [_cells(r) for r in mine])
            fl = meta["floors"][-1]
            print(f"floor {fl['step_ms']:.1f} ms (before the schemes {fl['before_ms']:.1f}, "
                  f"after {fl['after_ms']:.1f}), meeting once a step +"
                  f"{fl['meet_cost_ms']:.1f} ms; {LEGEND}", flush=True)
            rows += mine
    meta["wall_s"] = time.perf_counter() - t0
    meta["load_end"] = _load()
    print_table("bench anatomy — the floors (no exchange; the meeting floor: one 8-byte "
                "all-reduce a step), ms per step (rank 0's means)",
                FLOOR_COLUMNS, [_floor_cells(f) for f in meta["floors"]])
    jpath, ppath = write_outputs("anatomy", rows, a.out, plot=_plot(rows), meta=meta)
    print(f"bench anatomy: {meta['wall_s']:.0f} s; wrote {jpath}" + (f", {ppath}" if ppath else ""))
    if a.write_docs:
        DOCS_PATH.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(jpath, DOCS_PATH.with_suffix(".json"))
        if ppath is not None:
            shutil.copyfile(ppath, DOCS_PATH.with_suffix(".png"))
        print(f"wrote {write_docs(DOCS_PATH, rows, meta, png=ppath is not None)}")
    return 0


FLOOR_COLUMNS = ["link", "P", "step", "before", "after", "forward", "backward", "optimizer",
                 "cpu ms", "training thread's cpu", "its wait for a core", "meeting floor",
                 "meeting − floor", "its all-reduce"]
_PARTS = ("forward", "backward", "optimizer")


def floor_thread(f: dict, what: str) -> float:
    """A floor's training thread per step, over its three parts: ``what`` ``"cpu"`` (its CPU
    time) or ``"runq"`` (its wait for a core; NaN without the run-queue clock)."""
    return sum(f.get(f"{p}_main_{what}_ms", NAN) for p in _PARTS)


def _floor_cells(f: dict) -> list[Any]:
    runq = floor_thread(f, "runq")
    meet = [f.get(k, NAN) for k in ("meet_ms", "meet_cost_ms", "meet_wait_ms")]
    return [f["link"], f["world_size"], f["step_ms"], f["before_ms"], f["after_ms"],
            f["forward_ms"], f["backward_call_ms"], f["optimizer_ms"], f["cpu_ms"],
            floor_thread(f, "cpu"), "-" if runq != runq else runq,
            *("-" if v != v else v for v in meet)]


def _md_table(columns: list[str], cells: list[list[Any]]) -> list[str]:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return "-" if v != v else f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
        return str(v)

    return (["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
            + ["| " + " | ".join(fmt(v) for v in r) + " |" for r in cells])


def _findings(rows: list[dict], meta: dict) -> list[str]:
    """Sentences read off the numbers (the page's "what this shows")."""
    out = []
    floors = {(f["link"], f["world_size"]): f for f in meta["floors"]}
    sizes = sorted({p for _, p in floors})
    for link in dict.fromkeys(k for k, _ in floors):
        lo, hi = floors.get((link, sizes[0])), floors.get((link, sizes[-1]))
        if len(sizes) > 1 and lo and hi and lo["step_ms"] > 0:
            out.append(
                f"Floor (no exchange) in the {link} jobs: {lo['step_ms']:.1f} ms per step at "
                f"P = {sizes[0]}, {hi['step_ms']:.1f} ms at P = {sizes[-1]} "
                f"({hi['step_ms'] / lo['step_ms']:.2f}×), cpu {lo['cpu_ms']:.1f} → "
                f"{hi['cpu_ms']:.1f} ms, on {os.cpu_count()} cores: what P ranks sharing the "
                "cores cost before a byte is sent. P × cpu / cores, the step if the cores were "
                f"the limit: {sizes[0] * lo['cpu_ms'] / (os.cpu_count() or 1):.1f} ms at "
                f"P = {sizes[0]}, {sizes[-1] * hi['cpu_ms'] / (os.cpu_count() or 1):.1f} ms at "
                f"P = {sizes[-1]}."
                + ("" if floor_thread(hi, "runq") != floor_thread(hi, "runq") else
                   f" Measured on the training thread (its run queue): it waited for a core "
                   f"{floor_thread(lo, 'runq'):.1f} ms per step at P = {sizes[0]} and "
                   f"{floor_thread(hi, 'runq'):.1f} ms at P = {sizes[-1]}, beside "
                   f"{floor_thread(lo, 'cpu'):.1f} and {floor_thread(hi, 'cpu'):.1f} ms of "
                   "its own CPU."))
    engine = [r for r in rows if r["wait_place"] == "synchronize" and r["over_floor_ms"] > 0]
    if engine:
        def share(key: str) -> float:
            return statistics.median(r[key] / r["over_floor_ms"] for r in engine)

        ratios = [r["comm_over_wire"] for r in engine
                  if r["comm_over_wire"] == r["comm_over_wire"]]
        out.append(
            f"Over all gradsync rows (median share of step − floor): synchronize()'s wait "
            f"{100 * share('sync_wait_ms'):.0f} %, its host work {100 * share('sync_host_ms'):.0f} "
            f"%, the training thread's CPU and wait for a core in the backward "
            f"{100 * share('counted_backward_ms'):.0f} %, in the forward and optimizer "
            f"{100 * share('counted_out_ms'):.0f} %, "
            f"residual "
            f"{100 * share('residual_ms'):.0f} %."
            + (f" Their collectives took {min(ratios):.0f}–{max(ratios):.0f}× their bytes' wire "
               "time: at these sizes a collective's time is its rounds and CPU, not its bytes."
               if ratios else ""))
    for (link, P), f in floors.items():
        mine = [r for r in rows if r["link"] == link and r["world_size"] == P]
        if not mine:
            continue
        fast = min(mine, key=lambda r: r["step_ms"])
        parts = []
        for r in mine:
            own = r["main_cpu_backward_ms"]
            own = min(max(0.0, own if own == own else r["hooks_ms"]), r["counted_backward_ms"])
            comps = {"training thread's CPU in backward": own,
                     "waiting for a core in backward": r["counted_backward_ms"] - own,
                     "threads in forward and optimizer": r["counted_out_ms"],
                     "synchronize()'s wait": r["sync_wait_ms"],
                     "synchronize()'s host work": r["sync_host_ms"],
                     "residual": r["residual_ms"]}
            if r["wait_place"] == "backward":
                del comps["waiting for a core in backward"]
                del comps["training thread's CPU in backward"]
                comps["training thread in backward (CPU, core, wire)"] = r["counted_backward_ms"]
            top = max(comps, key=lambda k: comps[k])
            pct = r["accounted_pct"]
            parts.append(f"{r['scheme']} +{r['over_floor_ms']:.1f} ms ({top} "
                         f"{comps[top]:.1f} ms; accounted "
                         + ("-" if pct != pct else ("~" if r["noisy"] else "") + f"{pct:.0f} %")
                         + ")")
        cw = [r for r in mine if r["comm_over_wire"] == r["comm_over_wire"]
              and r["scheme"] != "ddp"]
        worst = max(cw, key=lambda r: r["comm_over_wire"], default=None)
        cost = f.get("meet_cost_ms", NAN)
        each = sorted(r.get("meet_cost_ms", NAN) for r in mine)
        own = ("" if not each or max(each) - min(each) < 0.05 else
               f" (each row against its own run's meeting, {each[0]:.1f}–{each[-1]:.1f} ms: "
               "with --repeats a row is one run whole)")
        meeting = "" if cost != cost else (
            f" Meeting once a step (the meeting floor: an 8-byte all-reduce after each "
            f"backward, no gradient) costs +{cost:.1f} ms over the floor (its all-reduce "
            f"{f['meet_wait_ms']:.1f} ms: mostly waiting for the other ranks, whose steps "
            "drift apart on shared cores"
            + ("" if not f.get("floor_ranks_ms") else
               "; each rank's own floor, in rank order: "
               + ", ".join(f"{x:.1f}" for x in f["floor_ranks_ms"]) + " ms")
            + f"); beyond that{own}: "
            + ", ".join(f"{r['scheme']} {r['over_meet_ms']:+.1f}" for r in mine) + " ms.")
        bar = _bar(mine) if P == 2 else ""
        out.append(f"P = {P}, {link} (floor {f['step_ms']:.1f} ms, {f['before_ms']:.1f} before "
                   f"the schemes and {f['after_ms']:.1f} after): fastest {fast['scheme']} "
                   f"({fast['step_ms']:.1f} ms). Over the floor, with the largest part: "
                   + "; ".join(parts) + "." + meeting + bar
                   + (f" A collective's time against its bytes' wire time is highest for "
                      f"{worst['scheme']} ({worst['comm_over_wire']:.0f}×)." if worst else ""))
    return out


BAR_MS = 3.0  # issue 67's bar at P = 2: a sparse step at most the floor + its wire time + 3 ms


def _bar(rows: list[dict]) -> str:
    """The sentence that holds a job's gradsync rows to the bar step ≤ floor + wire + 3 ms
    (:data:`BAR_MS`): each one's margin, and the same with the meeting's cost set aside."""
    mine = [r for r in rows if r["scheme"] != "ddp" and r["wire_ms"] == r["wire_ms"]]
    if not mine:
        return ""

    def margins(key: str) -> str:
        return ", ".join(f"{r['scheme']} {r[key] - r['wire_ms'] - BAR_MS:+.1f}" for r in mine)

    met = [r["scheme"] for r in mine if r["over_floor_ms"] <= r["wire_ms"] + BAR_MS]
    out = (f" Against the bar step ≤ floor + wire + {BAR_MS:g} ms, each row's step − floor − "
           f"wire − {BAR_MS:g} (≤ 0 meets it): {margins('over_floor_ms')} ms"
           + (f" (met: {', '.join(met)})" if met else " (none meets it)"))
    if all(r.get("over_meet_ms", NAN) == r.get("over_meet_ms", NAN) for r in mine):
        out += f"; with the meeting's cost set aside: {margins('over_meet_ms')} ms"
    return out + "."


def _repeats_line(meta: dict) -> list[str]:
    n = meta.get("repeats", 1)
    return [] if n == 1 else [
        f"- repeats: each job ran {n} times; each row is the run whose step − floor is the "
        "median of the runs' (the whole row of that run, so its parts still add up), each "
        "floor the run whose floor is the median; every run's step − floor is under each "
        "table and in the JSON (`over_floor_runs_ms`)."]


def _runs_line(rows: list[dict]) -> list[str]:
    if not rows or len(rows[0].get("over_floor_runs_ms", [])) < 2:
        return []
    runs = "; ".join(f"{r['scheme']} " + ", ".join(f"{x:.1f}" for x in r["over_floor_runs_ms"])
                     for r in rows)
    return [f"step − floor in each run, ms: {runs}.", ""]


def write_docs(path: Path, rows: list[dict], meta: dict, png: bool = True) -> Path:
    """The markdown page: what was run, one table per link and P, the floors, what the numbers
    show (sentences read off them), and how the columns are made."""
    lines = ["# Step anatomy on the CPU (`python -m gradsync bench anatomy`)", "",
             "Written by the command, not by hand. Where a synchronized step's time goes, "
             "against the same step with no exchange at all (the floor); the decomposition is "
             "in `src/gradsync/apps/bench/anatomy.py`'s docstring.", "",
             f"- date: {meta['date']}", f"- command: `{meta['command']}`",
             f"- machine: {meta['machine']}; 1-min load average {meta['load_start']:.1f} at the "
             f"start, {meta['load_end']:.1f} at the end; wall time {meta['wall_s'] / 60:.1f} min",
             f"- code: {meta['code'] or 'unknown'}"
             + (" (the package had uncommitted changes when this ran)"
                if str(meta["code"]).endswith("+dirty") else ""),
             f"- settings: {meta['config']['model']}, density {meta['config']['density']} "
             f"({meta['config']['sparsifier']}), {meta['config']['steps']} steps × "
             f"{meta['config']['batch_size']} per rank, the first "
             f"{meta['config']['warmup_steps'] + 1} not measured; gloo ranks on this machine",
             "- **noisy**: this machine's cores are shared with other jobs (see the load "
             "average); every time is a mean over one run's steps. Compare schemes within one "
             "table (one job) rather than across tables.", *_repeats_line(meta), ""]
    if png:
        lines += [f"![step anatomy]({path.with_suffix('.png').name})", ""]
    lines += ["## What this shows", "", *(f"- {s}" for s in _findings(rows, meta)), ""]
    for f in meta["floors"]:
        link, P = f["link"], f["world_size"]
        mine = [r for r in rows if r["link"] == link and r["world_size"] == P]
        rate = next((r["rate_bps"] for r in mine), None)
        how = (f"wire at DDP's achieved all-reduce rate in this job, {rate / 1e9:.3g} Gbit/s"
               if link == LOOPBACK and rate else
               "no wire rate (no ddp run)" if link == LOOPBACK else
               f"wire at the tbf rate, {link}")
        lines += [f"## P = {P}, {link}", "",
                  f"Floor {f['step_ms']:.1f} ms ({f['before_ms']:.1f} before the schemes, "
                  f"{f['after_ms']:.1f} after; forward {f['forward_ms']:.1f}, backward "
                  f"{f['backward_call_ms']:.1f}, optimizer {f['optimizer_ms']:.1f}; cpu "
                  f"{f['cpu_ms']:.1f} ms); {how}. ms per step.", "",
                  *_md_table(COLUMNS, [_cells(r) for r in mine]), "", *_runs_line(mine)]
    lines += ["## The floors", "", *_md_table(FLOOR_COLUMNS, [_floor_cells(f)
                                                            for f in meta["floors"]]), "",
              "## Columns", "",
              "- step, floor: rank 0's mean step (means add up; medians of the parts do "
              "not); the floor trains the bare model with no exchange at the same P, in "
              "the same job, before the schemes and after each "
              "(SGD momentum 0.9, DDP's optimizer); a row's floor is the two floor runs either "
              "side of it. The meeting floor is the same bare model whose ranks all-reduce one "
              "8-byte word after each backward (no gradient), run twice in the job (after the "
              "first floor and before the last), each against the floor runs either side of "
              "it: what synchronizing once a step costs before any gradient travels, which "
              "every synchronized row pays too; beyond meeting is a row's step − floor less "
              "that cost.",
              "- Δbackward: `loss.backward()` against the floor's: the hooks' work, inline "
              "selection, DDP's bucket copies and exposed wait, and the other threads' "
              "competition for the cores.",
              "- select: `sparsify_s` (engine) or the DDP hooks' synchronous part; hooks: the "
              "engine's gradient hooks launching jobs inside the backward (`hooks_s`: gathering, "
              "error feedback, inline selection, hand-off); wait: the exposed communication; "
              "sync host: synchronize() minus its wait; main: the training thread's own CPU "
              "inside `loss.backward()` over the floor's; runq: the time it waited for a core "
              "there (runnable, not running: Linux's schedstat), over the floor's; the two, "
              "with DDP's wait, are counted up to Δbackward; threads: the CPU time the "
              "process's other threads (communication, offload, gloo's) spent inside "
              "`loss.backward()`, over the floor's, shown only (a cause of runq, not a "
              "part of the step); main′, runq′, threads′: the same three during the forward "
              "and the optimizer step, main′ + runq′ counted up to their slowdown.",
              f"- {LEGEND}.",
              "- residual: step − floor − counted.",
              "- comm: time inside the step's collectives (overlaps the backward pass); wire: "
              "bytes sent × 8 / the rate; cpu ms: the busiest rank's process CPU per step, "
              "every thread; cpu−floor: that against the floor's (the CPU the exchange costs; "
              "steadier than wall time on shared cores); MB/step: bytes sent per rank, counted "
              "at the torch.distributed call.", ""]
    path.write_text("\n".join(lines))
    return path
