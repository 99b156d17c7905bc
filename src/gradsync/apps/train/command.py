"""``python -m gradsync train``'s command line: arguments → :class:`TrainSpec`, the launch on
local workers or as one worker of a torchrun job, the report.

Schemes that do not finish. Local workers train one scheme per launch: a scheme that diverges
(a NaN/Inf loss or gradient, seen alike on every rank: :mod:`.loop`) or fails (any rank
raised or died, or the job stopped making progress for ``--timeout`` seconds) is recorded as
``"diverged at step N"`` or ``"failed: <reason>"`` and the next scheme starts on fresh ranks.
Under torchrun the processes are the job's: a divergence is recorded the same way, but any
other error ends the job (torchrun stops every worker), after the schemes before it were
written. As each scheme finishes, a line says how it went and ``--out``'s ``metrics.json`` is
rewritten with the runs so far (``"complete": false`` until the end), so a crash or a kill
later keeps them; the table comes at the end, with a ``status`` column when some scheme did not
finish, and the exit status is 1 then (the last line names them).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from gradsync.apps.train.loop import train_worker
from gradsync.apps.train.shards import resolve_data
from gradsync.apps.train.spec import (
    DATASETS,
    DEFAULT_STEPS,
    LR_SCHEDULES,
    TrainSpec,
    all_schemes,
    defaults,
)
from gradsync.apps.train.summary import (
    environment,
    failed_run,
    progress_line,
    report,
    summarize,
    unfinished,
    write_metrics,
)
from gradsync.collectives.comm import exchange_objects
from gradsync.schedule.plan import MIN_K

__all__ = ["TORCHRUN_VARS", "build_parser", "launch", "main", "parse_args", "torchrun_env"]

DESCRIPTION = ("``python -m gradsync train``: train a model with one or more sync schemes and "
               "compare them.")
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")


def build_parser(prog: str = "python -m gradsync train") -> argparse.ArgumentParser:
    """The argument parser (``prog`` names the command in usage and errors)."""
    from gradsync.apps import models
    from gradsync.engine.config import DENSITY_SCHEDULES, ENGINE_SPARSIFIERS
    from gradsync.schedule.budget import BUDGETS

    d = defaults()
    p = argparse.ArgumentParser(prog=prog, description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Schemes: " + ", ".join(all_schemes()))
    p.add_argument("--model", default=d["model"], choices=models.names())
    p.add_argument("--data", choices=DATASETS, default=None,
                   help="default: the model's real dataset (fashion-mnist, or text for LMs)")
    p.add_argument("--scheme", default=",".join(d["schemes"]),
                   help="one scheme or a comma-separated list run in turn (see below)")
    p.add_argument("--world-size", type=int, default=d["world_size"],
                   help="local workers (ignored under torchrun)")
    p.add_argument("--density", type=float, default=d["density"])
    p.add_argument("--sparsifier", default=d["sparsifier"], choices=ENGINE_SPARSIFIERS)
    p.add_argument("--density-warmup", default=None, metavar="PERIODS:STEPS",
                   help="DGC's warm-up: PERIODS periods of STEPS steps at exponentially "
                        "decreasing densities before --density, or D1,D2,...:STEPS, each "
                        "period's density, or off (gradsync schemes; default: the scheme's, "
                        "4:9 for TopkA, Ok-Topk, DenseStream, per_tensor and the SSFusion family)")
    p.add_argument("--density-schedule", choices=DENSITY_SCHEDULES, default=None,
                   help="gradsync schemes: 'adaptive' raises the density in the critical "
                        "regimes the gradient norm shows, 'fixed' sends --density at every step "
                        "(Config.density_schedule; default fixed)")
    p.add_argument("--clip-norm", type=float, default=None, metavar="C",
                   help="DGC's local gradient clipping for the gradsync schemes: each rank's "
                        "gradient, per tensor, to an L2 norm of C/sqrt(P) before it enters "
                        "error feedback (Config.clip_norm; default off)")
    p.add_argument("--momentum-masking", action="store_true", default=None,
                   help="DGC's momentum factor masking for the gradsync schemes under momentum "
                        "correction (Config.momentum_masking; default off)")
    p.add_argument("--momentum-ahead", type=float, default=None, metavar="A",
                   help="gradsync schemes under momentum correction: the share A in [0, 1] of "
                        "a sent entry's velocity tail sent with it (Config.momentum_ahead; default "
                        "the scheme's share, 0 to turn it off)")
    p.add_argument("--min-k", type=int, default=None, metavar="K",
                   help="gradsync schemes: a tensor sparsified on its own that would send "
                        "fewer than K entries per step travels whole "
                        f"(Config.min_k; default {MIN_K}; SSFusion's within half its budget)")
    p.add_argument("--budget", choices=BUDGETS, default=None,
                   help="gradsync schemes that sparsify tensor by tensor: 'gradient' shares the "
                        "plan's entries by each tensor's share of the gradient's L1 mass over "
                        "the profiling steps, 'blend' half of them so, 'even' gives every tensor "
                        "one density, 'pooled' selects a buffer's tensors as one (Config.budget; "
                        "default the scheme's: pooled for SSFusion, blend for the others)")
    p.add_argument("--adam-warmup", type=int, default=None, metavar="STEPS",
                   help="AdamW with a sparse scheme: steps of exact AdamW, gradients sent "
                        "whole, before its variance freezes (gradsync.optim; default 10%% of "
                        "the steps)")
    p.add_argument("--topk-shares", action="store_true",
                   help="rank 0 records, per engine scheme, each tensor's share of a global "
                        "top-k of the accumulators into metrics.json (runs[i].topk_shares; "
                        "gradsync.apps.train.shares)")
    p.add_argument("--amp", choices=("bf16", "fp16"), default=None,
                   help="automatic mixed precision (torch.autocast); fp16 with a GradScaler "
                        "that the gradsync schemes follow (default: fp32)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--steps", type=int, default=None, help=f"default {DEFAULT_STEPS}")
    g.add_argument("--epochs", type=float, default=None,
                   help="passes over each rank's shard (instead of --steps)")
    p.add_argument("--batch-size", type=int, default=d["batch_size"], help="per rank")
    p.add_argument("--lr", type=float, default=None,
                   help="default 0.05 (SGD, momentum 0.9) or 3e-3 (AdamW, language models)")
    p.add_argument("--lr-schedule", choices=LR_SCHEDULES, default=None,
                   help="the learning rate over the run, every scheme alike: cosine anneals "
                        "it to 0 at the last step (default constant)")
    p.add_argument("--seed", type=int, default=d["seed"])
    p.add_argument("--warmup-steps", type=int, default=d["warmup_steps"],
                   help="engine profiling steps; the first warmup+1 steps are not measured")
    p.add_argument("--bandwidth", default=None,
                   help="emulate per-rank links of this rate (tbf, root): 100mbit, 1gbit, …")
    p.add_argument("--latency", default=None,
                   help="tbf queueing bound (e.g. 50ms); NOT a propagation delay, which is not "
                        "emulated (see gradsync.testing.netem)")
    p.add_argument("--out", default=None,
                   help="write metrics.json, plans.json and PNG plots here")
    p.add_argument("--plan", default=None, metavar="FILE",
                   help="replay the engine schemes' plans from an earlier --out's plans.json "
                        "(the schemes that plan from measured times otherwise may plan "
                        "differently in every run)")
    p.add_argument("--eval-batches", type=int, default=d["eval_batches"],
                   help="test batches for accuracy / perplexity (0 = no evaluation)")
    p.add_argument("--eval-every", type=int, default=d["eval_every"], metavar="N",
                   help="also evaluate every N steps (the curve the time to DDP's final score "
                        "is read from; 0 = only at the end)")
    p.add_argument("--timeout", type=float, default=d["timeout"],
                   help="seconds without progress before a hung scheme is stopped: when no "
                        "rank completed a step for this long, the scheme fails naming the "
                        "stalled ranks and their step, and the next scheme runs (a long, "
                        "healthy run is never cut short; under torchrun: the collectives' "
                        "timeout; with --bandwidth on shaped links: each scheme's whole run)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    # tests of the failure paths: a rank that raises at step 1, a rank that stalls after a
    # step's collectives (RANK:STEP), a sleep after every step, the one scheme they apply to
    p.add_argument("--fail-rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--stall-at", type=_rank_step, default=None, help=argparse.SUPPRESS)
    p.add_argument("--step-sleep", type=float, default=d["step_sleep"], help=argparse.SUPPRESS)
    p.add_argument("--inject-scheme", default=None, help=argparse.SUPPRESS)
    return p


def _rank_step(value: str) -> tuple[int, int]:
    """``--stall-at RANK:STEP``."""
    try:
        rank, step = (int(v) for v in value.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected RANK:STEP, got {value!r}") from None
    return rank, step


def parse_args(argv: list[str] | None, parser: argparse.ArgumentParser | None = None
               ) -> TrainSpec:
    """The validated spec of ``argv``; bad values exit with status 2 (argparse errors)."""
    from gradsync.apps import models

    p = parser or build_parser()
    a = p.parse_args(argv)
    try:
        spec = TrainSpec(
            model=a.model, schemes=tuple(s.strip() for s in a.scheme.split(",") if s.strip()),
            data=a.data, world_size=a.world_size, steps=a.steps, epochs=a.epochs,
            batch_size=a.batch_size, lr=a.lr, lr_schedule=a.lr_schedule, density=a.density,
            sparsifier=a.sparsifier, seed=a.seed, warmup_steps=a.warmup_steps,
            eval_batches=a.eval_batches, eval_every=a.eval_every,
            bandwidth=a.bandwidth, latency=a.latency, timeout=a.timeout, out=a.out,
            progress=not a.no_progress, fail_rank=a.fail_rank, stall_at=a.stall_at,
            step_sleep=a.step_sleep, inject_scheme=a.inject_scheme,
            density_warmup=a.density_warmup, density_schedule=a.density_schedule,
            clip_norm=a.clip_norm,
            min_k=a.min_k, momentum_masking=a.momentum_masking, budget=a.budget,
            momentum_ahead=a.momentum_ahead, adam_warmup=a.adam_warmup,
            amp=a.amp, plans=_read_plans(a.plan, p),
            topk_shares=a.topk_shares)
    except ValueError as e:
        p.error(str(e))
    try:  # a model needing a missing optional dependency fails here, not in every rank
        models.build(spec.model, seed=0, device="meta")
    except (ImportError, RuntimeError) as e:
        p.error(f"--model {spec.model}: {e}")
    return spec


def _read_plans(path: str | None, p: argparse.ArgumentParser) -> dict | None:
    """``--plan FILE``'s JSON (argument errors when it cannot be read)."""
    if path is None:
        return None
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        p.error(f"--plan {path}: {e}")


def launch(spec: TrainSpec, keep_going: bool = False, note: bool = True,
           worker: Callable[..., dict] = train_worker) -> tuple[list[dict], dict]:
    """Run ``spec.world_size`` local workers (shaped links with ``spec.bandwidth``); returns
    (per-rank results of :func:`gradsync.apps.train.train_worker`, link description).
    ``worker``: what each rank runs instead, called as ``train_worker`` is (a module-level
    function; ``bench anatomy``'s adds the no-sync floor to the job).

    On loopback the job is watched for progress: it fails
    (:class:`~gradsync.testing.distributed.DistributedStall`) when no rank completed a step for
    ``spec.timeout`` seconds, however long it runs otherwise; on shaped links ``spec.timeout``
    bounds the whole job. A diverged scheme raises on every rank
    (:class:`~gradsync.apps.train.loop.Diverged`, reaching here as a ``DistributedError``),
    or, with ``keep_going``, is recorded in its run's ``status``. ``note``: say so when
    shaped links were asked for and the run fell back to loopback."""
    from gradsync.testing import netem, run_distributed

    if spec.bandwidth is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            res = netem.run_shaped(worker, spec.world_size, spec,
                                   bandwidth=spec.bandwidth_bps, latency=spec.latency,
                                   timeout=spec.timeout, keep_going=keep_going)
        if res.shaped:
            link = f"tbf {spec.bandwidth} per rank and direction"
        else:
            link = "loopback"
            if note:
                print(f"note: no shaped links ({res.reason}); ran on loopback instead")
        return list(res), {"link": link, "shaped": res.shaped,
                           "bandwidth_bps": spec.bandwidth_bps}
    out = run_distributed(worker, spec.world_size, spec, keep_going=keep_going,
                          timeout=None, progress_timeout=spec.timeout)
    return out, {"link": "loopback", "shaped": False, "bandwidth_bps": None}


def torchrun_env() -> bool:
    """This process is one worker of a torchrun job (its variables are set)."""
    return all(v in os.environ for v in TORCHRUN_VARS)


def _main_torchrun(spec: TrainSpec) -> int:
    from datetime import timedelta

    cuda = torch.cuda.is_available()
    local = int(os.environ["LOCAL_RANK"])
    if cuda:
        gpus = torch.cuda.device_count()
        if local >= gpus:  # NCCL needs a GPU per process; CUDA would say "invalid ordinal"
            raise SystemExit(
                f"error: torchrun started local rank {local} but this node has {gpus} GPU(s) "
                f"visible: launch at most {gpus} process(es) per node (--nproc-per-node), or "
                f"hide the GPUs (CUDA_VISIBLE_DEVICES=) to train on the CPU with gloo")
        torch.cuda.set_device(local)
    backend = "nccl" if cuda else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timedelta(seconds=spec.timeout))
    rank, P = dist.get_rank(), dist.get_world_size()
    spec = dataclasses.replace(spec, device=f"cuda:{local}" if cuda else "cpu")
    link = {"link": "torchrun job", "shaped": False, "bandwidth_bps": None}
    results = [{"rank": r, "runs": []} for r in range(P)]  # rank 0's copy of every rank's

    def on_run(run: dict) -> None:  # every rank, after each scheme: rank 0 keeps and writes
        gathered = exchange_objects(run, dst=0)  # collectives/comm.py, "Exit safety"
        if rank == 0:
            for mine, theirs in zip(results, gathered):
                mine["runs"].append(theirs)
            _scheme_done(spec, results, environment("torchrun", backend, spec.device, link))

    try:
        mine = train_worker(rank, P, spec, keep_going=True, on_run=on_run)
        if rank == 0:
            report(spec, results, environment("torchrun", backend, spec.device, link),
                   f"gradsync train — {spec.model}, P={P}, torchrun ({backend})")
        status = _exit_status(mine["runs"], rank == 0)  # alike on every rank
        if P > 1:  # rank 0 has reported: no rank's non-zero exit makes torchrun stop it first
            dist.barrier()
    finally:
        dist.destroy_process_group()
    return status


def _scheme_done(spec: TrainSpec, results: list[dict], env: dict) -> None:
    """A scheme finished (its runs are the last of ``results``): say how it went and, before
    the last one, write the runs so far to ``spec.out`` (the table and plots come at the
    end)."""
    runs = summarize(results, spec.warmup_steps)
    print(progress_line(runs[-1], len(runs), len(spec.schemes)), flush=True)
    if spec.out and len(runs) < len(spec.schemes):
        write_metrics(spec.out, spec.config(len(results)), env, runs, complete=False,
                      plots=False)


def _exit_status(runs: list[dict], say: bool) -> int:
    """1 when some scheme of ``runs`` (each with ``"scheme"`` and ``"status"``) diverged or
    failed (``say``: the last line names them), else 0."""
    bad = unfinished(runs)
    if not bad:
        return 0
    if say:
        print(f"error: {len(bad)} of {len(runs)} scheme{'s' if len(runs) > 1 else ''} did not "
              f"finish: " + "; ".join(_what(r) for r in bad), file=sys.stderr)
    return 1


def _what(run: dict) -> str:
    """``scheme status`` of a run that did not finish; a divergence with what was non-finite."""
    text = f"{run['scheme']} {run['status']}"
    reason = run.get("reason")
    if run["status"].startswith("diverged") and reason:
        reason = " ".join(reason.split())
        text += f" ({reason if len(reason) <= 100 else reason[:99] + '…'})"
    return text


def _main_local(spec: TrainSpec) -> int:
    """Local workers, one launch per scheme (module docstring)."""
    from gradsync.apps import models
    from gradsync.testing import DistributedError, DistributedTimeout

    t0 = time.perf_counter()
    task = models.task(spec.model)
    results = [{"rank": r, "runs": []} for r in range(spec.world_size)]
    link = {"link": "loopback", "shaped": False, "bandwidth_bps": None}
    for i, name in enumerate(spec.schemes):
        try:
            res, link = launch(dataclasses.replace(spec, schemes=(name,)), keep_going=True,
                               note=i == 0)
            for mine, theirs in zip(results, res):
                mine["runs"].extend(theirs["runs"])
        except (DistributedError, DistributedTimeout) as e:
            if isinstance(e, DistributedError):
                last = (e.remote_traceback.strip().splitlines()[-1]
                        if e.remote_traceback.strip() else "")
                reason = f"rank {e.rank}: {last}"
                print(f"error: {name}: training failed on rank {e.rank}: {last}",
                      file=sys.stderr)
                print(str(e), file=sys.stderr, flush=True)  # the rank's traceback
            else:
                reason = str(e)
                print(f"error: {name}: {e}", file=sys.stderr, flush=True)
            for mine in results:
                mine["runs"].append(failed_run(name, task, reason))
        _scheme_done(spec, results, environment("local", "gloo", "cpu", link))
    env = environment("local", "gloo", "cpu", link)
    runs = report(spec, results, env, f"gradsync train — {spec.model} on {spec.data}, "
                                      f"P={spec.world_size}, {link['link']}, density "
                                      f"{spec.density}, {time.perf_counter() - t0:.0f} s")
    return _exit_status(runs, True)


def main(argv: list[str] | None = None) -> int:
    """``python -m gradsync train``; returns the exit status (argument errors exit 2)."""
    spec = parse_args(argv)
    if torchrun_env():
        spec = resolve_data(spec, quiet=os.environ["RANK"] != "0")
        if spec.bandwidth is not None and os.environ["RANK"] == "0":
            print("note: --bandwidth/--latency shape only local workers; ignored under torchrun")
        return _main_torchrun(spec)
    spec = resolve_data(spec)
    if torch.cuda.is_available():
        print("note: local workers train on the CPU (gloo); to train on this machine's GPUs, "
              "launch under torchrun: torchrun --nproc-per-node <GPUs> -m gradsync train …")
    return _main_local(spec)
