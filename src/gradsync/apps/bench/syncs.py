"""``python -m gradsync bench syncs``: host reads per step at P ranks, on every rank.

``python -m gradsync bench syncs [--ranks 2,4] [--model resnet50] [--schemes topka,…]
[--count-steps 2] [--out DIR] [--write-docs]``; torch DDP comes first, as the reference.

``bench overhead`` measures one rank: at P = 1 nothing travels, so it sees what the
compression itself reads back. At P > 1 a sparse collective reads more: the sizes of its peers'
messages before it can receive them, the size of a merge's union, and the engine's agreement
between ranks. On a GPU each read makes the host wait for the device (module docstring of
:mod:`gradsync.apps.bench.overhead`, the counts). This command runs ``--ranks`` real gloo
processes on the CPU (:func:`gradsync.testing.run_distributed`), each scheme on the
accelerators' path (:mod:`gradsync.sparsify.segments`: each buffer selected at once, as a GPU
runs it) and with their kernels (:data:`gradsync.sparsegrad.ACCELERATOR`: compactions
by ``nonzero``, or ``nonzero_static`` at a known count, sorts by ``torch.sort``, as on a GPU;
without the tests' count checks, :attr:`~gradsync.sparsegrad.Kernels.check_counts`), and counts with
:func:`~gradsync.apps.bench.overhead.count_step` every rank's host reads per step, over
``--count-steps`` steps after 4 unmeasured ones (the engine's ``Config.warmup_steps`` is 1: its
plan is fixed by then; Ok-Topk's and the threshold sparsifiers' exact steps, every 32, fall
outside the counted ones).

What the CPU stands in for: ``Tensor.tolist()`` and ``Tensor.numpy()`` count as reads (a copy
to the host on a GPU; here ``numpy`` is left only where a received header is read),
``aten::nonzero`` too and ``nonzero_static`` not. So the counts are a GPU's, but for the reads
of tensors that stay on the host there (e.g. DGC's sampling offset, drawn from a CPU
generator). Ranks differ: the one whose region or block receives more parts merges where
another scatters. The counts are deterministic; no time is measured (on two cores, P processes
timing each other say nothing).

Writes ``syncs-cpu.json``, ``.md`` and ``.png`` (to ``--out``, or ``docs/results/`` with
``--write-docs``).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch

from gradsync.apps.bench import overhead
from gradsync.apps.bench._harness import add_output_args
from gradsync.apps.common import grouped_bars, grouped_tick, print_table, write_outputs
from gradsync.testing import run_distributed

DEFAULT_SCHEMES = ("topka", "per_tensor", "ssfusion_oi", "oktopk", "densestream", "gaussiank",
                   "hook:per_tensor", "hook:ssfusion_oi")
WARMUP_STEPS = 4  # unmeasured steps before counting (the engine's warm-up is 1)


def _namespace(a: dict[str, Any]) -> argparse.Namespace:
    """What :mod:`~gradsync.apps.bench.overhead`'s runs read of their arguments."""
    return argparse.Namespace(density=a["density"], sparsifier=a["sparsifier"],
                              momentum=a["momentum"], warmup_steps=1, powersgd_rank=4,
                              seed=a["seed"])


def _rank(rank: int, world: int, schemes: list[str], a: dict[str, Any]) -> dict[str, Any]:
    """One rank: every scheme in turn on one model build, its reads per counted step."""
    import torch.distributed as dist

    from gradsync import sparsegrad

    # the accelerators' path and kernels, without the tests' count checks, which a GPU skips
    sparsegrad.bind(sparsegrad.ACCELERATOR)
    torch.set_num_threads(1)
    ns = _namespace(a)
    wl = overhead.workload(a["model"], False, image_size=a["image_size"],
                           mlp_params=a["mlp_params"], seed=a["seed"])
    template = wl.build()
    out: dict[str, Any] = {}
    for label in overhead.parse_schemes(",".join(schemes)):
        run = overhead.Run(wl, template, label, ns, torch.device("cpu"), dist.group.WORLD)
        try:
            for _ in range(WARMUP_STEPS):
                run.step()
            calls = 0 if run.hook is None else run.hook.counts.calls
            c = overhead.count_step(run.step, a["count_steps"], "cpu")
            out[label.label] = {"host_reads": c["host_reads"],
                                "host_read_ops": dict(c["host_read_ops"]),
                                "buffers": run.buffers(calls, a["count_steps"])}
        finally:
            run.close()
    return out


def measure(ranks: int, schemes: list[str], a: dict[str, Any],
            timeout: float = 1800.0) -> list[dict[str, Any]]:
    """The rows of one world size: per scheme, every rank's reads per step."""
    per_rank = run_distributed(_rank, ranks, schemes, a, timeout=timeout)
    rows = []
    for s in schemes:
        mine = [r[s] for r in per_rank]
        reads = [m["host_reads"] for m in mine]
        buffers = mine[0]["buffers"]
        rows.append({"ranks": ranks, "scheme": s, "buffers": buffers,
                     "reads_per_rank": reads, "reads_max": max(reads),
                     "p1_bar": None if buffers is None else 2 + buffers,
                     "read_ops_rank0": mine[0]["host_read_ops"]})
    return rows


def _cells(r: dict[str, Any]) -> list[Any]:
    ops = ", ".join(f"{k.removeprefix('aten::')} {v:g}" for k, v in
                    sorted(r["read_ops_rank0"].items()))
    return [r["ranks"], r["scheme"], overhead.cell(r["buffers"]),
            " / ".join(overhead.cell(x) for x in r["reads_per_rank"]),
            overhead.cell(r["p1_bar"]), ops]


COLUMNS = ("P", "scheme", "buffers", "host reads / step, rank 0 / 1 / …",
           "P = 1 bar (2 + buffers)", "read ops on rank 0")


def write_markdown(path: Path, rows: list[dict[str, Any]], meta: dict[str, Any]) -> Path:
    lines = [f"# Host reads per step at P ranks ({meta['model']})", "",
             f"Written by `{meta['command']}` on {meta['date']} (code {meta['code']}). "
             f"{meta['describe']}; density {meta['density']}, {meta['sparsifier']}, "
             f"momentum {meta['momentum']}; gloo ranks on the CPU, the accelerators' path and "
             f"kernels; {meta['count_steps']} counted steps after {WARMUP_STEPS}. What the "
             f"counts stand for: `python -m gradsync bench syncs --help`. The P = 1 bar is "
             f"issue 42's GPU bar on syncs; at P > 1 no bar is set.", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(str(c) for c in _cells(r)) + " |" for r in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def _plot(rows: list[dict[str, Any]]):
    def plot(ax) -> None:
        schemes = grouped_bars(ax, rows, "ranks", "scheme", lambda r: r["reads_max"],
                               lambda p: f"P = {p}")
        worlds = len(dict.fromkeys(r["ranks"] for r in rows))
        bars = {r["scheme"]: r["p1_bar"] for r in rows if r["p1_bar"] is not None}
        ax.scatter([grouped_tick(schemes.index(s), worlds) for s in bars], list(bars.values()),
                   marker="_", s=300, color="black", label="P = 1 bar")
        ax.set_ylabel("host reads per step (the most of any rank)")
        ax.set_title("host reads per step at P ranks (CPU, accelerators' path and kernels)",
                     fontsize=9)
        ax.legend(fontsize=8)

    return plot


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gradsync bench syncs", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="2,4", help="comma-separated world sizes (2,4)")
    p.add_argument("--model", default="resnet50",
                   help="one of bench overhead's models on the CPU (resnet50: the zoo's)")
    p.add_argument("--schemes", default=",".join(DEFAULT_SCHEMES),
                   help="engine schemes, hook:<scheme>, ddp_powersgd (torch DDP comes first, "
                        "the reference)")
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--sparsifier", default="dgc")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--count-steps", type=int, default=2)
    p.add_argument("--image-size", type=int, default=16)
    p.add_argument("--mlp-params", type=float, default=float(1 << 20))
    p.add_argument("--seed", type=int, default=0)
    add_output_args(p, "syncs", 1800.0)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = build_parser()
    a = p.parse_args(argv)
    try:
        worlds = [int(w) for w in a.ranks.split(",") if w.strip()]
    except ValueError:
        p.error(f"--ranks: comma-separated integers, got {a.ranks!r}")
    if not worlds or min(worlds) < 1:
        p.error("--ranks: world sizes must be >= 1")
    if a.count_steps < 1:
        p.error("--count-steps must be >= 1")
    try:
        labels = overhead.parse_schemes(a.schemes)
        wl = overhead.workload(a.model, False, image_size=a.image_size,
                               mlp_params=int(a.mlp_params), seed=a.seed)
        overhead.config_for("dense", _namespace(vars(a)))  # checks density, sparsifier, momentum
    except ValueError as e:
        p.error(str(e))
    schemes = [x.label for x in labels]
    cfg = {"model": a.model, "density": a.density, "sparsifier": a.sparsifier,
           "momentum": a.momentum, "count_steps": a.count_steps, "image_size": a.image_size,
           "mlp_params": int(a.mlp_params), "seed": a.seed}
    meta = {"command": "python -m gradsync bench syncs " + shlex.join(argv),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "code": overhead.code_label(), "describe": wl.describe, **cfg,
            "warmup_steps": WARMUP_STEPS, "ranks": worlds, "schemes": schemes}
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for world in worlds:
        print(f"bench syncs: P = {world}, {len(schemes)} schemes", flush=True)
        rows.extend(measure(world, schemes, cfg, timeout=a.timeout))
    meta["wall_s"] = round(time.perf_counter() - t0, 1)
    out = overhead.DOCS_DIR if a.write_docs else Path(a.out)
    jpath, ppath = write_outputs("syncs-cpu", rows, out, plot=_plot(rows), meta=meta)
    mpath = write_markdown(out / "syncs-cpu.md", rows, meta)
    print_table(f"bench syncs — {a.model}, host reads per step", COLUMNS,
                [_cells(r) for r in rows])
    print(f"bench syncs: {meta['wall_s']:.0f} s; wrote {jpath}, {mpath}"
          + (f" and {ppath}" if ppath else ""))
    return 0
