"""``python -m gradsync bench schemes``: every sync scheme training one model, side by side.

``python -m gradsync bench schemes --model resnet18 --world-size 4 --density 0.01
[--bandwidth 1gbit] [--steps 30] [--schemes …] [--quick]``

Trains a few dozen steps per scheme on real gloo ranks (the workers of
``python -m gradsync train``: same seed, same data shards, same initial model for every scheme)
and reports, per scheme, the SSFusion Fig. 13 breakdown — backward, sparsification,
communication and *exposed* communication (what the step waited for) — beside throughput
(global samples/s, median after warm-up), bytes each rank sends per step (counted at the
torch.distributed call) and the tensor missing rate (SSFusion Table I). PyTorch's own DDP
all-reduce (``ddp``) and its PowerSGD hook (``ddp_powersgd``) run as peers in the same job, so
the speed-ups are same-run ratios. See :mod:`gradsync.apps.train` for how each time is measured for
the DDP peers (from their comm-hook timestamps) and for the engine (``GradSync.stats()``).

Links: loopback, or with ``--bandwidth`` per-rank tbf-shaped links (root; otherwise a one-line
note and loopback). ``--latency`` is tbf's queueing bound, not a propagation delay.

Writes ``schemes.json`` (rows + environment + the train metrics) and ``schemes.png`` (stacked
breakdown bars) under ``--out``.
"""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING

from gradsync.apps.common import print_table, write_outputs

if TYPE_CHECKING:
    from gradsync.apps.train import TrainSpec

DEFAULT_SCHEMES = ("ddp", "ddp_powersgd", "dense_ovlp", "topka", "oktopk", "densestream",
                   "per_tensor", "multi_tensor", "cupcake", "ssfusion", "ssfusion_o",
                   "ssfusion_oi")
QUICK_SCHEMES = ("ddp", "ddp_powersgd", "topka", "ssfusion_oi")


def _parse(argv: list[str] | None) -> tuple[TrainSpec, argparse.Namespace]:
    from gradsync.apps import train

    p = argparse.ArgumentParser(prog="python -m gradsync bench schemes", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default resnet18 (--quick: cnn)")
    p.add_argument("--world-size", default=None, help="default 4 (--quick: 2)")
    p.add_argument("--density", default="0.01")
    p.add_argument("--sparsifier", default="dgc")
    p.add_argument("--bandwidth", default=None, help="tbf-shaped links: 100mbit, 1gbit, …")
    p.add_argument("--latency", default=None, help="tbf queueing bound, not a delay")
    p.add_argument("--steps", default=None, help="steps per scheme (default 30; --quick 4)")
    p.add_argument("--batch-size", default=None, help="per rank (default 16; --quick 8)")
    p.add_argument("--warmup-steps", default=None,
                   help="engine profiling steps, not measured (default 5; --quick 1)")
    p.add_argument("--schemes", default=None,
                   help=f"comma-separated (default {','.join(DEFAULT_SCHEMES)})")
    p.add_argument("--seed", default="0")
    p.add_argument("--out", default="bench-out/schemes")
    p.add_argument("--quick", action="store_true", help="tiny settings for a smoke run")
    p.add_argument("--progress", action="store_true", help="show the training progress bars")
    b = p.parse_args(argv)
    q = b.quick
    targs = [
        "--model", b.model or ("cnn" if q else "resnet18"),
        "--world-size", b.world_size or ("2" if q else "4"),
        "--density", b.density, "--sparsifier", b.sparsifier,
        "--steps", b.steps or ("4" if q else "30"),
        "--batch-size", b.batch_size or ("8" if q else "16"),
        "--warmup-steps", b.warmup_steps or ("1" if q else "5"),
        "--scheme", b.schemes or ",".join(QUICK_SCHEMES if q else DEFAULT_SCHEMES),
        "--seed", b.seed, "--eval-batches", "0",
    ]
    if b.bandwidth is not None:
        targs += ["--bandwidth", b.bandwidth]
    if b.latency is not None:
        targs += ["--latency", b.latency]
    if not b.progress:
        targs.append("--no-progress")
    # validation (density, world size, bandwidth, schemes) is train's, with argparse errors
    spec = train.parse_args(targs, parser=train.build_parser("python -m gradsync bench schemes"))
    return spec, b


def _plot(rows: list[dict], title: str):
    def plot(ax) -> None:
        names = [r["scheme"] for r in rows]
        x = range(len(rows))
        bottom = [0.0] * len(rows)
        for key, label, color in (("backward_ms", "backward", "tab:blue"),
                                  ("sparsify_ms", "sparsification", "tab:orange"),
                                  ("exposed_ms", "exposed communication", "tab:red")):
            vals = [r[key] if r[key] == r[key] else 0.0 for r in rows]  # NaN → 0
            ax.bar(x, vals, bottom=bottom, label=label, color=color)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.scatter(x, [r["comm_ms"] if r["comm_ms"] == r["comm_ms"] else 0.0 for r in rows],
                   marker="_", s=300, color="black", label="communication (total)", zorder=3)
        ax.set_xticks(list(x), names, rotation=45, ha="right")
        ax.set_ylabel("ms per step (median)")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=8)

    return plot


def main(argv: list[str] | None = None) -> int:
    from gradsync.apps import train
    from gradsync.testing import DistributedError, DistributedTimeout

    spec, b = _parse(argv)
    spec = train.resolve_data(spec)
    print(f"bench schemes: {spec.model} on {spec.data}, P={spec.world_size}, {spec.steps} steps × "
          f"{spec.batch_size} per rank and scheme, density {spec.density} ({spec.sparsifier}), "
          f"{len(spec.schemes)} schemes", flush=True)
    t0 = time.perf_counter()
    try:
        results, link = train.launch(spec)
    except (DistributedError, DistributedTimeout) as e:
        print(f"bench schemes failed: {e}")
        return 1
    wall = time.perf_counter() - t0
    runs = train.summarize(results, spec.warmup_steps)
    rows = []
    for r in runs:
        s = r["summary"]
        rows.append({
            "scheme": s["scheme"], "samples_per_s": s["samples_per_s"],
            "speedup_vs_ddp": s["speedup_vs_ddp"], "step_ms": 1e3 * s["step_s"],
            "backward_ms": 1e3 * s["backward_s"], "sparsify_ms": 1e3 * s["sparsify_s"],
            "comm_ms": 1e3 * s["comm_s"], "exposed_ms": 1e3 * s["wait_s"],
            "bytes_per_step": s["bytes_per_step"], "missing_rate": s["missing_rate"],
            "final_loss": s["final_loss"], "measured_steps": s["measured_steps"],
        })
    title = (f"bench schemes — {spec.model}, P={spec.world_size}, {link['link']}, "
             f"density {spec.density}, {spec.steps} steps")
    cols = ["scheme", "samples/s", "vs ddp", "step ms", "backward ms", "sparsify ms",
            "comm ms", "exposed ms", "MB/step", "missing %", "final loss"]
    print_table(title, cols, [[
        r["scheme"], r["samples_per_s"],
        f"{r['speedup_vs_ddp']:.2f}x" if r["speedup_vs_ddp"] else "-",
        r["step_ms"], r["backward_ms"], r["sparsify_ms"], r["comm_ms"], r["exposed_ms"],
        r["bytes_per_step"] / 1e6, 100 * r["missing_rate"], r["final_loss"]] for r in rows])
    meta = {"config": spec.config(len(results)), "link": link, "wall_s": wall,
            "environment": train.environment("local", "gloo", "cpu", link),
            "quick": b.quick, "runs": runs,
            "notes": "times: medians over the steps after warmup_steps+1; samples/s global; "
                     "bytes per rank per step, ring accounting at the torch.distributed call"}
    jpath, ppath = write_outputs("schemes", rows, b.out, plot=_plot(rows, title), meta=meta)
    print(f"bench schemes: {wall:.0f} s; wrote {jpath} and {ppath}")
    return 0
