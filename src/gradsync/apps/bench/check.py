"""``python -m gradsync bench check``: a timing regression check that holds on any machine.

``python -m gradsync bench check [--baseline .ci/bench-baseline.json] [--repeats 9]``
``python -m gradsync bench check --record 5 --why "…"`` (writes the baseline)

Counts of ops and reads do not catch a slower kernel: Ok-Topk's collective became 1.8× slower
on the CPU (84a55f3, a ``searchsorted`` per peer) while every count held. This check times
what users run, as ratios to a dense reference measured **in the same processes, interleaved**,
so that a ratio means the same on a fast and on a slow (or busy) machine:

* ``collective/<name>@<density>``: TopkA, Ok-Topk and DenseStream on P = 4 gloo ranks, each
  rank passing its exact top-k of a seeded gradient-like tensor (:mod:`.collectives`'s), at
  1 % and 10 %. Per repetition each collective is followed by a dense all-reduce of the same
  selection (``dense``); a repetition's time is the maximum over ranks, its ratio the
  collective's over the dense all-reduce's right after it, and the figure the median ratio.
  The collectives' order rotates with the repetition.
* ``step/<scheme>``: one training step (forward, backward, synchronize, SGD) of the CNN on
  P = 4 ranks through :class:`~gradsync.GradSync` with the README's flagship schemes at 1 %,
  over one step of torch's ``DistributedDataParallel`` on an identical model right after it.

The baseline file (in the repository) records, per figure, the median and the largest ratio
of ``--record N`` runs. A figure fails when its ratio exceeds the largest recorded one by more
than ``tolerance`` (25 %). A failing run is run once more, and the check fails only on figures
that fail twice. The baseline moves only by ``--record`` with ``--why``, committed with a
message that says why: a change that makes something slower lands with its reason written.
Ratios differ between CPUs (DenseStream's collective runs 1.5-2x slower against the dense
reference on an Intel Xeon than on an AMD EPYC), so a machine may have its own baseline beside
the default one: ``<baseline stem>-<its CPU, as a slug>.json`` (:func:`machine_baseline`),
used when it exists and recorded with ``--record … --baseline`` that path.

Writes ``check.json`` (every run, every figure, the verdicts) and ``check.png`` under
``--out``. Exit status 1 when a figure failed twice, 2 on a missing or mismatched baseline.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gradsync.apps.common import code_revision, cpu_description, print_table, write_outputs

NAME = "check"
DEFAULT_BASELINE = ".ci/bench-baseline.json"
TOLERANCE = 0.25  # a figure may exceed its largest recorded ratio by this fraction
WORLD = 4
NUMEL = 4_000_000
DENSITIES = (0.01, 0.1)
COLLECTIVES = ("topka", "oktopk", "densestream")
SCHEMES = ("topka", "ssfusion_oi", "oktopk", "densestream")
STEP_DENSITY = 0.01
BATCH = 32


# -- measurements on the ranks ---------------------------------------------------------------
def _timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _collectives_rank(rank: int, world_size: int, numel: int, repeats: int, seed: int
                      ) -> dict[str, list[tuple[float, float]]]:
    """Per figure, this rank's ``(collective, dense)`` seconds of every repetition."""
    from gradsync import collectives
    from gradsync.apps.bench.collectives import build, gradient, import_collectives
    from gradsync.sparsify import get as get_sparsifier

    torch.set_num_threads(1)
    import_collectives()
    x = gradient(numel, rank, seed)
    dense = collectives.get("dense")
    runs = []
    for d in DENSITIES:
        sel = get_sparsifier("topk", density=d).select(x)
        for name in COLLECTIVES:
            runs.append((f"collective/{name}@{d:g}", build(name, d), sel))
    out: dict[str, list[tuple[float, float]]] = {f: [] for f, _, _ in runs}
    for step in range(repeats + 1):  # the first is a warm-up
        turn = step % len(runs)
        for figure, coll, sel in runs[turn:] + runs[:turn]:
            t = _timed(lambda c=coll, s=sel, i=step: c(s, step=i))
            t_dense = _timed(lambda s=sel, i=step: dense(s, step=i))
            if step:
                out[figure].append((t, t_dense))
    return out


def _steps_rank(rank: int, world_size: int, repeats: int, seed: int
                ) -> dict[str, list[tuple[float, float]]]:
    """Per scheme, this rank's ``(GradSync step, DDP step)`` seconds of every repetition."""
    import gradsync
    from gradsync.apps import models

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(seed + rank)
    x = torch.randn(BATCH, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (BATCH,), generator=g)

    def trainer(model: torch.nn.Module, sync: Any):
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def step() -> None:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            if sync is not None:
                sync.synchronize()
            opt.step()
        return step

    ddp = trainer(torch.nn.parallel.DistributedDataParallel(models.build("cnn", seed)), None)
    runs = []
    for scheme in SCHEMES:
        model = models.build("cnn", seed)
        sync = gradsync.GradSync(model, gradsync.Config(  # the step at the target density
            scheme=scheme, density=STEP_DENSITY, density_warmup=()))
        runs.append((f"step/{scheme}", trainer(model, sync), sync))
    out: dict[str, list[tuple[float, float]]] = {f: [] for f, _, _ in runs}
    try:
        for step in range(repeats + 2):  # two warm-ups: the engine plans in its first step
            turn = step % len(runs)
            for figure, fn, _ in runs[turn:] + runs[:turn]:
                t, t_ddp = _timed(fn), _timed(ddp)
                if step >= 2:
                    out[figure].append((t, t_ddp))
    finally:
        for _, _, sync in runs:
            sync.close()
    return out


def _ratios(per_rank: list[dict[str, list[tuple[float, float]]]]) -> dict[str, dict[str, Any]]:
    """Per figure: the repetitions' times (maximum over ranks) and the median ratio."""
    out = {}
    for figure in per_rank[0]:
        reps = zip(*(r[figure] for r in per_rank), strict=True)
        pairs = [(max(t for t, _ in rep), max(d for _, d in rep)) for rep in reps]
        out[figure] = {
            "ratio": statistics.median(t / d for t, d in pairs),
            "ms": 1e3 * statistics.median(t for t, _ in pairs),
            "reference_ms": 1e3 * statistics.median(d for _, d in pairs),
        }
    return out


def measure(repeats: int, numel: int = NUMEL, seed: int = 0) -> dict[str, dict[str, Any]]:
    """One run of every figure: ``{figure: {"ratio", "ms", "reference_ms"}}``."""
    from gradsync.testing import run_distributed

    figures = _ratios(run_distributed(_collectives_rank, WORLD, numel, repeats, seed,
                                      timeout=600))
    figures.update(_ratios(run_distributed(_steps_rank, WORLD, repeats, seed, timeout=600)))
    return figures


# -- the baseline and the verdict ------------------------------------------------------------
def record(runs: list[dict[str, dict[str, Any]]], why: str, repeats: int, numel: int
           ) -> dict[str, Any]:
    """The baseline of ``runs``: per figure the median and the largest ratio, and the runs."""
    return {
        "about": "python -m gradsync bench check's reference ratios; move only with "
                 "--record and a commit that says why",
        "why": why,
        "code": code_revision(),
        "recorded": time.strftime("%Y-%m-%d"),
        "cpu": cpu_description(),
        "torch": torch.__version__,
        "repeats": repeats,
        "numel": numel,
        "tolerance": TOLERANCE,
        "figures": {f: {"median": statistics.median(r[f]["ratio"] for r in runs),
                        "max": max(r[f]["ratio"] for r in runs),
                        "runs": [round(r[f]["ratio"], 4) for r in runs]}
                    for f in runs[0]},
    }


def limit(entry: dict[str, Any], tolerance: float) -> float:
    """The largest ratio a figure may show: its largest recorded one, plus ``tolerance``."""
    return entry["max"] * (1.0 + tolerance)


def verdicts(figures: dict[str, dict[str, Any]], baseline: dict[str, Any]) -> dict[str, bool]:
    """Per figure of the baseline: whether the run's ratio is within its limit."""
    tol = baseline.get("tolerance", TOLERANCE)
    return {f: figures[f]["ratio"] <= limit(e, tol) for f, e in baseline["figures"].items()}


def machine_baseline(path: Path, cpu: str | None = None) -> Path:
    """This machine's baseline beside ``path``: ``<stem>-<cpu slug>.json`` where it exists
    (``cpu``: :func:`~gradsync.apps.common.cpu_description` by default), else ``path``."""
    slug = re.sub(r"[^a-z0-9]+", "-", (cpu or cpu_description()).lower()).strip("-")
    own = path.with_name(f"{path.stem}-{slug}{path.suffix}")
    return own if own.exists() else path


def load_baseline(path: Path) -> dict[str, Any]:
    """The baseline at ``path``; ``ValueError`` when it is missing or malformed."""
    try:
        base = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"no baseline at {path}: record one with python -m gradsync bench "
                         f"check --record 5 --why '…'") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not JSON: {e}") from None
    figs = base.get("figures") if isinstance(base, dict) else None
    if not isinstance(figs, dict) or not figs or not all(
            isinstance(e, dict) and isinstance(e.get("max"), int | float) and e["max"] > 0
            for e in figs.values()):
        raise ValueError(f"{path}: expected {{'figures': {{name: {{'max': ratio > 0, …}}}}}}")
    return base


# -- the command -----------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m gradsync bench check",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=f"bench-out/{NAME}", help="folder for JSON and PNG")
    p.add_argument("--baseline", default=DEFAULT_BASELINE, help="the recorded ratios (JSON)")
    p.add_argument("--repeats", type=int, default=9, help="timed repetitions per figure")
    p.add_argument("--record", type=int, default=0, metavar="N",
                   help="run N times and write the baseline instead of checking")
    p.add_argument("--why", default=None, help="with --record: why the baseline moves")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.repeats < 3:
        p.error("--repeats must be >= 3 (a median of fewer is noise)")
    if a.record < 0 or a.record == 1:
        p.error("--record takes N >= 2 runs: the spread is part of the baseline")
    if a.record and not (a.why and a.why.strip()):
        p.error("--record needs --why: say why the baseline moves")
    return a


def _table(title: str, figures: dict[str, dict[str, Any]], baseline: dict[str, Any] | None,
           ok: dict[str, bool] | None) -> None:
    tol = (baseline or {}).get("tolerance", TOLERANCE)
    rows = []
    for f, v in figures.items():
        e = (baseline or {}).get("figures", {}).get(f)
        rows.append([f, round(v["ms"], 2), round(v["reference_ms"], 2), round(v["ratio"], 3),
                     "" if e is None else round(e["median"], 3),
                     "" if e is None else round(limit(e, tol), 3),
                     "" if ok is None or f not in ok else ("ok" if ok[f] else "SLOWER")])
    print_table(title, ["figure", "ms", "reference ms", "ratio", "recorded median", "limit",
                        "verdict"], rows)


def _plot(figures: dict[str, dict[str, Any]], baseline: dict[str, Any] | None):
    def plot(ax) -> None:
        names = list(figures)
        ax.bar(range(len(names)), [figures[f]["ratio"] for f in names], label="this run")
        if baseline is not None:
            tol = baseline.get("tolerance", TOLERANCE)
            lims = [limit(baseline["figures"][f], tol) if f in baseline["figures"]
                    else float("nan") for f in names]
            ax.scatter(range(len(names)), lims, marker="_", s=300, color="red", label="limit")
        ax.set_xticks(range(len(names)), names, rotation=45, ha="right", fontsize=7)
        ax.set_ylabel("time over the dense reference, same run")
        ax.legend(fontsize=7)
    return plot


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    path = Path(a.baseline)
    started = time.perf_counter()
    if a.record:
        runs = []
        for i in range(a.record):
            runs.append(measure(a.repeats, seed=a.seed))
            print(f"run {i + 1}/{a.record}: " + ", ".join(
                f"{f} {v['ratio']:.3f}" for f, v in runs[-1].items()))
        base = record(runs, a.why.strip(), a.repeats, NUMEL)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(base, indent=2) + "\n")
        _table(f"bench check: baseline of {a.record} runs written to {path}", runs[-1], base,
               None)
        write_outputs(NAME, [{"figure": f, **v} for f, v in runs[-1].items()], a.out,
                      _plot(runs[-1], base), meta={"recorded": base})
        return 0
    path = machine_baseline(path)
    try:
        base = load_baseline(path)
    except ValueError as e:
        print(f"bench check: {e}")
        return 2
    attempts, failed = [], None
    for attempt in range(2):  # a failing figure is measured once more before it fails
        figures = measure(a.repeats, seed=a.seed)
        missing = sorted(set(base["figures"]) - set(figures))
        if missing:
            print(f"bench check: the baseline names figures this code does not measure: "
                  f"{', '.join(missing)}; record it again (--record)")
            return 2
        ok = verdicts(figures, base)
        attempts.append({"figures": figures, "ok": ok})
        _table(f"bench check, run {attempt + 1} (P = {WORLD}, loopback; baseline "
               f"{path.name}: {base.get('code')}, {base.get('recorded')})", figures, base, ok)
        now = {f for f, good in ok.items() if not good}
        failed = now if failed is None else failed & now
        if not failed:
            break
    write_outputs(NAME, [{"figure": f, **v, "ok": attempts[-1]["ok"].get(f)}
                         for f, v in attempts[-1]["figures"].items()], a.out,
                  _plot(attempts[-1]["figures"], base),
                  meta={"attempts": attempts, "baseline": str(path),
                        "failed": sorted(failed or ())})
    took = time.perf_counter() - started
    if failed:
        print(f"bench check: FAILED in {took:.0f} s: slower than the baseline allows, twice: "
              f"{', '.join(sorted(failed))}. If that is intended, record the baseline again "
              f"(--record 5 --why '…') and say why in the commit.")
        return 1
    print(f"bench check: every figure within its limit ({took:.0f} s)")
    return 0
