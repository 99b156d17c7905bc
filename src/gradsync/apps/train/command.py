"""``python -m gradsync train``'s command line: arguments → :class:`TrainSpec`, the launch on
local workers or as one worker of a torchrun job, the report."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from gradsync.apps.train.loop import train_worker
from gradsync.apps.train.shards import resolve_data
from gradsync.apps.train.spec import DATASETS, DEFAULT_STEPS, TrainSpec, all_schemes, defaults
from gradsync.apps.train.summary import environment, report
from gradsync.collectives.comm import exchange_objects

__all__ = ["TORCHRUN_VARS", "build_parser", "launch", "main", "parse_args", "torchrun_env"]

DESCRIPTION = ("``python -m gradsync train``: train a model with one or more sync schemes and "
               "compare them.")
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")


def build_parser(prog: str = "python -m gradsync train") -> argparse.ArgumentParser:
    """The argument parser (``prog`` names the command in usage and errors)."""
    from gradsync.apps import models
    from gradsync.engine.config import ENGINE_SPARSIFIERS

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
                        "decreasing densities before --density (gradsync schemes; default off)")
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
    p.add_argument("--timeout", type=float, default=d["timeout"],
                   help="seconds before a hung job is stopped")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--fail-rank", type=int, default=None, help=argparse.SUPPRESS)  # tests
    return p


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
            batch_size=a.batch_size, lr=a.lr, density=a.density, sparsifier=a.sparsifier,
            seed=a.seed, warmup_steps=a.warmup_steps, eval_batches=a.eval_batches,
            bandwidth=a.bandwidth, latency=a.latency, timeout=a.timeout, out=a.out,
            progress=not a.no_progress, fail_rank=a.fail_rank, density_warmup=a.density_warmup,
            adam_warmup=a.adam_warmup, amp=a.amp, plans=_read_plans(a.plan, p),
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


def launch(spec: TrainSpec) -> tuple[list[dict], dict]:
    """Run ``spec.world_size`` local workers (shaped links with ``spec.bandwidth``); returns
    (per-rank results of :func:`gradsync.apps.train.train_worker`, link description)."""
    from gradsync.testing import netem, run_distributed

    if spec.bandwidth is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            res = netem.run_shaped(train_worker, spec.world_size, spec,
                                   bandwidth=spec.bandwidth_bps, latency=spec.latency,
                                   timeout=spec.timeout)
        if res.shaped:
            link = f"tbf {spec.bandwidth} per rank and direction"
        else:
            link = "loopback"
            print(f"note: no shaped links ({res.reason}); ran on loopback instead")
        return list(res), {"link": link, "shaped": res.shaped,
                           "bandwidth_bps": spec.bandwidth_bps}
    out = run_distributed(train_worker, spec.world_size, spec, timeout=spec.timeout)
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
    try:
        mine = train_worker(rank, P, spec)
        gathered = exchange_objects(mine)  # collectives/comm.py, "Exit safety"
        if rank == 0:
            env = environment("torchrun", backend, spec.device,
                              {"link": "torchrun job", "shaped": False, "bandwidth_bps": None})
            report(spec, gathered, env, f"gradsync train — {spec.model}, P={P}, torchrun "
                                        f"({backend})")
    finally:
        dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m gradsync train``; returns the exit status (argument errors exit 2)."""
    spec = parse_args(argv)
    if torchrun_env():
        spec = resolve_data(spec, quiet=os.environ["RANK"] != "0")
        if spec.bandwidth is not None and os.environ["RANK"] == "0":
            print("note: --bandwidth/--latency shape only local workers; ignored under torchrun")
        return _main_torchrun(spec)
    from gradsync.testing import DistributedError, DistributedTimeout

    spec = resolve_data(spec)
    if torch.cuda.is_available():
        print("note: local workers train on the CPU (gloo); to train on this machine's GPUs, "
              "launch under torchrun: torchrun --nproc-per-node <GPUs> -m gradsync train …")
    t0 = time.perf_counter()
    try:
        results, link = launch(spec)
    except DistributedError as e:
        last = e.remote_traceback.strip().splitlines()[-1] if e.remote_traceback else ""
        print(f"error: training failed on rank {e.rank}: {last}", file=sys.stderr)
        print(str(e), file=sys.stderr)
        return 1
    except DistributedTimeout as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    env = environment("local", "gloo", "cpu", link)
    report(spec, results, env, f"gradsync train — {spec.model} on {spec.data}, "
                               f"P={spec.world_size}, {link['link']}, density {spec.density}, "
                               f"{time.perf_counter() - t0:.0f} s")
    return 0
