"""``python -m gradsync bench convergence``: does a scheme cost accuracy? Schemes × seeds × a
fixed step budget, compared with DDP (issue 11, "The study").

``python -m gradsync bench convergence [--model cnn,gpt_tiny] [--schemes …] [--seeds N]
[--steps N] [--world-size 4] [--density 0.01[,0.03,…]] [--out DIR] [--write-docs [PATH]]
[--resume]``

Each (model, seed) is one ``python -m gradsync train`` job (:func:`gradsync.apps.train.launch`,
loopback gloo ranks) that trains every scheme in turn from the same initial model on the same
seeded data shards in the same order, so seed ``s`` gives every scheme the same data order and
differences between schemes are paired by seed. Seeds are ``1 … --seeds``; without it, per
model :data:`DEFAULT_SEEDS` (10 for the CNN, 3 for a language model). The CNN needs the ten: over
3 seeds its paired differences to DDP have a standard deviation of 0.1–2.6 points (median 1.3),
so a 3-seed interval is about ±3 points wide, three times issue 11's 1-point bar; with 10 it is
±0.6–1.0 for the sparse schemes (docs/results/archive/convergence-cnn-10-seeds.md). TinyGPT's
differences are steadier: over 3 seeds the intervals are ±0.7–1.1 of perplexity around gaps of
1.9–4.6, each wholly beyond the 5 % bar (0.85), so 3 seeds decide it.

Workloads (``--model``, comma-separated; default both):

* ``cnn``: the CNN on Fashion-MNIST, test accuracy on the **whole** 10,000-image test split
  (``eval_batches = ceil(10000 / batch)``);
* ``gpt_tiny`` (or ``lstm``): a language model on the text corpus, perplexity on
  ``--lm-eval-batches`` seeded windows of the held-out last 10 % of the corpus.

The run is also evaluated at ``--eval-points`` evenly spaced steps (``TrainSpec.eval_every``)
for the accuracy-against-step curves and the time to a target. An evaluation scores rank 0's
model, its batches shared out over the ranks (``gradsync.apps.train.loop.evaluate``).

Per model and scheme the table gives: mean ± std over seeds (sample std) of the final accuracy
(or perplexity); the mean paired difference to ``ddp`` with its 95 % interval
``mean(d) ± t_{0.975, n-1} · sd(d) / sqrt(n)`` over the seeds' differences ``d`` (``n/a`` with
fewer than 2 seeds or without ``ddp``); bytes each rank sends per step (counted at the
torch.distributed call, the train summary's ``bytes_per_step``, mean over seeds); the share of
(tensor, step) pairs of which no entry was synchronized (SSFusion's "tensor missing", §III-A,
train's ``missing_rate``, mean over seeds); and the steps
and rank-0 training seconds (evaluation excluded) until the first evaluation point at which
the scheme reaches 99 % of DDP's mean final accuracy (perplexity: at most DDP's / 0.99), mean
over the seeds that reach it, with how many did ("not reached" otherwise; the resolution is
the evaluation spacing); the seconds until the scheme's curve reaches DDP's mean final value,
DDP's own over them (the time-to-accuracy speed-up), the step time (training seconds per step)
with DDP's over it (the step speed-up), and the share of the step speed-up that the time
speed-up keeps (issue 68: what the accuracy lag leaves of the link's saving); and the other
way round, the step at which DDP's mean curve reaches
the scheme's mean final value (:func:`ddp_steps_for`, linear between evaluation points, with
its share of the budget): how many of DDP's steps the scheme's budget was worth, the extra
training a compressed run needs to match DDP; and the stability figure, rank 0's largest
training loss after step 5 over its step-0 loss on the worst seed (:func:`spike`; ``inf``
once a loss is not finite), with the seeds on which the run diverged (its final value is then
``nan``, and the interval ``n/a``).

**On a slow link** (``--bandwidth 100mbit``, root: tbf-shaped per-rank links, as ``train
--bandwidth``): every job of the study runs on it, so the step times and the times to DDP's
accuracy are the link's, and the time-to-accuracy and step speed-ups come from the same runs.
On loopback they are the machine's.

Writes ``<out>/convergence.json`` (rows per model, every seed's final value, bytes, history
and plan digest), ``<out>/convergence.png`` (metric against step, mean with a ±1 std band per
scheme) and ``<out>/plans-<model>-seed<s>.json`` (each job's engine plans: the schemes that
plan from measured times may plan differently per seed, and the page says which did;
``--plans DIR`` replays a folder of them, job by job, as ``train --plan`` does).
``--write-docs`` also writes ``docs/results/convergence.md`` (the tables, the exact command,
the date, the machine and its load) and copies the JSON and PNG beside it under the same name
(``convergence.json``/``.png``; ``--write-docs docs/results/lm.md``: ``lm.json``…).

**A long study over several sittings** (``--resume``): every finished run is kept in
``<out>/runs/<model>[-d<density>]-seed<s>-<scheme>.json`` with the configuration that decides
it (:func:`run_config`: the train spec but how it is launched, and a replayed plan; for DDP
and torch's other hooks, not the settings only gradsync reads, so a study of ``--density-warmup``
or ``--min-k`` pairs with another study's DDP runs copied into its ``runs/``) and the code
revision that trained it. With ``--resume`` the runs kept there of the same configuration are
reused, one of another configuration is refused with the fields that differ, and every
other scheme trains as its own job, kept as soon as it ends: a study stopped midway (a
ResNet-18 run is ~18 min on 2 cores) loses at most the run in flight, and the same command
with ``--resume`` goes on. A scheme alone in its job trains bit for bit as beside others (the
same seeded model, data and order), so kept runs still pair by seed; one that plans from
measured times may plan otherwise, as in any other job. The page says how many runs were
kept and at which code revisions.

**A density sweep** (``--density 0.01,0.03,0.1``): one study per density, each with its own
table, and first a trade-off table per model: for every scheme that uses the density, its mean
gap to DDP (points of accuracy, or percent of perplexity) and bytes per step at each density,
and the lowest density at which it meets issue 11's bar (:data:`PARITY`: within 1 point of
DDP's accuracy, within 5 % of its perplexity). torch's own DDP hooks ignore the density
(:func:`density_independent`): they are trained once, at the first density, and each density's
rows are paired with that run (``trained_at_density`` in the JSON). The PNG then plots each
scheme's gap against its bytes per step, one point per density. A plan is made for one density,
so ``--plans`` takes one density; a sweep writes ``plans-<model>-d<density>-seed<s>.json``.

Cost: about 13 s per scheme and seed for the CNN (160 steps, 4 whole-split evaluations) and
4–6 s for TinyGPT (60 steps) on the 2-core machine, so the default run (10 schemes, 10 CNN
seeds and 3 TinyGPT seeds) takes about 27 min; docs/results/convergence.md records its wall
time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shlex
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from gradsync.apps.common import code_revision, cpu_description, print_table, write_outputs
from gradsync.apps.train.spec import LR_SCHEDULES
from gradsync.apps.train.summary import time_to
from gradsync.engine.config import DENSITY_SCHEDULES, ENGINE_SPARSIFIERS
from gradsync.schedule.budget import BUDGETS
from gradsync.schedule.plan import MIN_K

DEFAULT_SCHEMES = ("ddp", "ddp_powersgd", "per_tensor", "multi_tensor", "cupcake", "topka",
                   "oktopk", "densestream", "ssfusion", "ssfusion_oi")
DEFAULT_MODELS = ("cnn", "gpt_tiny")
DEFAULT_STEPS = {"cnn": 160, "gpt_tiny": 60, "lstm": 60}  # per model unless --steps
# per model unless --seeds (module docstring: what 3 seeds resolve on each)
DEFAULT_SEEDS = {"cnn": 10}
OTHER_SEEDS = 3
TEST_IMAGES = 10_000  # Fashion-MNIST's test split
TARGET = 0.99  # time to reach 99 % of DDP's final mean accuracy
# issue 11's bar for "converges like DDP": accuracy at most 1 point below DDP's mean,
# perplexity at most 5 % above it (at_parity)
PARITY = {"test_accuracy": 0.01, "perplexity": 0.05}
DOCS_PATH = Path("docs/results/convergence.md")
SPIKE_AFTER = 5  # the largest training loss after this step, over step 0's (issue 44's bar: 3×)

# t_{0.975, df}, df = 1 … 30 (two-sided 95 %), from the standard tables.
T975 = (12.706205, 4.302653, 3.182446, 2.776445, 2.570582, 2.446912, 2.364624, 2.306004,
        2.262157, 2.228139, 2.200985, 2.178813, 2.160369, 2.144787, 2.131450, 2.119905,
        2.109816, 2.100922, 2.093024, 2.085963, 2.079614, 2.073873, 2.068658, 2.063899,
        2.059539, 2.055529, 2.051831, 2.048407, 2.045230, 2.042272)


def t975(df: int) -> float:
    """Student's t quantile t_{0.975, df}: the table for df ≤ 30, beyond it the Cornish–Fisher
    expansion around z = 1.959964 (error < 1e-4 for df > 30)."""
    if isinstance(df, bool) or not isinstance(df, int) or df < 1:
        raise ValueError(f"degrees of freedom must be an integer >= 1, got {df!r}")
    if df <= len(T975):
        return T975[df - 1]
    z = 1.959963984540054
    return (z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
            + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3))


def paired_ci(xs: list[float], base: list[float]) -> dict[str, Any]:
    """Mean paired difference ``xs[i] - base[i]`` and its 95 % t interval over the pairs;
    ``half``/``low``/``high`` are ``None`` with fewer than 2 pairs or a non-finite value (a
    diverged run's)."""
    if len(xs) != len(base) or not xs:
        raise ValueError(f"paired_ci needs equally many values, got {len(xs)} and {len(base)}")
    d = [a - b for a, b in zip(xs, base)]
    mean = statistics.fmean(d)
    if len(d) < 2 or not all(math.isfinite(v) for v in d):  # < 2 pairs, or a diverged run
        return {"mean": mean, "half": None, "low": None, "high": None, "n": len(d)}
    half = t975(len(d) - 1) * statistics.stdev(d) / math.sqrt(len(d))
    return {"mean": mean, "half": half, "low": mean - half, "high": mean + half, "n": len(d)}


def _std(xs: list[float]) -> float | None:
    ok = len(xs) > 1 and all(math.isfinite(v) for v in xs)  # a diverged run: no spread
    return statistics.stdev(xs) if ok else None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from gradsync.apps import models
    from gradsync.apps.train import all_schemes

    p = argparse.ArgumentParser(prog="python -m gradsync bench convergence",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=",".join(DEFAULT_MODELS),
                   help="comma-separated: cnn (Fashion-MNIST accuracy) and/or a language "
                        "model, gpt_tiny or lstm (perplexity); default both cnn,gpt_tiny")
    p.add_argument("--schemes", default=",".join(DEFAULT_SCHEMES),
                   help="comma-separated; ddp should be among them (the reference)")
    p.add_argument("--seeds", type=int, default=None,
                   help="seeds 1 … N for every model (>= 2 for the interval; default: " +
                        ", ".join(f"{k} {v}" for k, v in DEFAULT_SEEDS.items()) +
                        f", {OTHER_SEEDS} for the others)")
    p.add_argument("--steps", type=int, default=None,
                   help="steps per scheme (default: " + ", ".join(
                       f"{k} {v}" for k, v in DEFAULT_STEPS.items()) + ")")
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--density", default="0.01",
                   help="the density of every sparse scheme; comma-separated for a sweep "
                        "(0.01,0.03,0.1): one study per density and the trade-off table, "
                        "accuracy against bytes per step")
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr-schedule", choices=LR_SCHEDULES, default=None,
                   help="train's --lr-schedule for every scheme, DDP included: cosine anneals "
                        "the learning rate to 0 at the last step (default constant)")
    p.add_argument("--density-warmup", default=None, metavar="PERIODS:STEPS",
                   help="train's DGC density warm-up for the gradsync schemes: PERIODS:STEPS, "
                        "D1,D2,...:STEPS or off (default: the scheme's)")
    p.add_argument("--density-schedule", choices=DENSITY_SCHEDULES, default=None,
                   help="train's --density-schedule for the gradsync schemes "
                        "(Config.density_schedule; default fixed)")
    p.add_argument("--momentum-masking", action="store_true", default=None,
                   help="train's --momentum-masking for the gradsync schemes (default off)")
    p.add_argument("--momentum-ahead", type=float, default=None, metavar="A",
                   help="train's --momentum-ahead for the gradsync schemes (Config's default)")
    p.add_argument("--min-k", type=int, default=None, metavar="K",
                   help="train's --min-k for the gradsync schemes "
                        f"(Config.min_k; default the scheme's: {MIN_K}, 1 for SSFusion)")
    p.add_argument("--budget", choices=BUDGETS, default=None,
                   help="train's --budget for the gradsync schemes (Config.budget; default "
                        "the scheme's: pooled for the SSFusion family, blend for the others)")
    p.add_argument("--sparsifier", choices=ENGINE_SPARSIFIERS, default="dgc",
                   help="train's --sparsifier for the gradsync schemes (Config.sparsifier)")
    p.add_argument("--clip-norm", type=float, default=None, metavar="C",
                   help="train's --clip-norm for the gradsync schemes (Config.clip_norm; "
                        "default off)")
    p.add_argument("--adam-warmup", type=int, default=None, metavar="STEPS",
                   help="train's --adam-warmup: with AdamW (the transformers), steps of exact "
                        "AdamW with gradients sent whole before the variance freezes (default "
                        "10%% of the steps)")
    p.add_argument("--amp", choices=("bf16", "fp16"), default=None,
                   help="train's automatic mixed precision for every scheme (fp16: with a "
                        "GradScaler the gradsync schemes follow; default fp32)")
    p.add_argument("--eval-points", type=int, default=4,
                   help="evaluations per run (evenly spaced, the last at the end)")
    p.add_argument("--image-eval-batches", type=int, default=None,
                   help="test batches for accuracy (default: the whole test split)")
    p.add_argument("--lm-eval-batches", type=int, default=20,
                   help="held-out windows (batches) for the perplexity")
    p.add_argument("--data", default=None, help="override the data set (synthetic for tests)")
    p.add_argument("--out", default="bench-out/convergence")
    p.add_argument("--write-docs", nargs="?", const=str(DOCS_PATH), default=None,
                   metavar="PATH", help=f"also write PATH (default {DOCS_PATH}) with the "
                                        "table, command, date and machine")
    p.add_argument("--bandwidth", default=None,
                   help="train's --bandwidth: every job on tbf-shaped per-rank links of this "
                        "rate (100mbit, 1gbit, …; root, else loopback with a note), so the "
                        "times to a target are the link's (default loopback)")
    p.add_argument("--latency", default=None,
                   help="train's --latency: tbf's queueing bound on the shaped links")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per job")
    p.add_argument("--resume", action="store_true",
                   help="reuse the runs an earlier study of the same configuration kept in "
                        "--out (runs/); train each other scheme as its own job, kept as it "
                        "ends")
    p.add_argument("--plans", default=None, metavar="DIR",
                   help="replay the plans an earlier run wrote to its --out "
                        "(plans-<model>-seed<s>.json per job; train --plan)")
    a = p.parse_args(argv)
    a.models = [m.strip() for m in a.model.split(",") if m.strip()]
    a.scheme_list = [s.strip() for s in a.schemes.split(",") if s.strip()]
    known = set(all_schemes())
    bad = [s for s in a.scheme_list if s not in known]
    if bad or not a.scheme_list:
        p.error(f"--schemes: unknown {bad or a.scheme_list}; choose from "
                f"{', '.join(all_schemes())}")
    if len(set(a.scheme_list)) != len(a.scheme_list):
        p.error("--schemes names a scheme twice")
    for m in a.models:
        if m not in models.names():
            p.error(f"--model: unknown {m!r}; choose from {', '.join(models.names())}")
    if not a.models:
        p.error("--model: give at least one model")
    if a.seeds is not None and a.seeds < 1:
        p.error(f"--seeds must be >= 1, got {a.seeds}")
    if a.steps is not None and a.steps < 1:
        p.error(f"--steps must be >= 1, got {a.steps}")
    if a.eval_points < 1:
        p.error(f"--eval-points must be >= 1, got {a.eval_points}")
    try:
        a.densities = parse_densities(a.density)
    except ValueError as e:
        p.error(f"--density: {e}")
    a.density = a.densities[0]
    if len(a.densities) > 1 and all(density_independent(s) for s in a.scheme_list):
        p.error("--density: a sweep needs a scheme that uses the density; "
                f"{', '.join(a.scheme_list)} ignore it")
    a.plan_files = {}
    if a.plans is not None and len(a.densities) > 1:
        p.error("--plans replays plans made at one density; give one --density with it")
    if a.plans is not None:
        for m in a.models:
            for seed in range(1, seeds_for(a, m) + 1):
                f = plans_file(a.plans, m, seed)
                try:
                    a.plan_files[m, seed] = json.loads(f.read_text())
                except (OSError, ValueError) as e:
                    p.error(f"--plans {a.plans}: {f.name}: {e}")
    return a


def seeds_for(a: argparse.Namespace, model: str) -> int:
    """How many seeds ``model`` runs: ``--seeds``, else :data:`DEFAULT_SEEDS` (module
    docstring)."""
    return a.seeds if a.seeds is not None else DEFAULT_SEEDS.get(model, OTHER_SEEDS)


def parse_densities(text: str) -> list[float]:
    """``--density``: one density or a comma-separated sweep, each in (0, 1], none twice,
    in the order given."""
    from gradsync.sparsify import validate_density

    out = []
    for part in text.split(","):
        try:
            d = validate_density(float(part))
        except ValueError as e:
            raise ValueError(f"{part.strip()!r}: {e}") from None
        if d in out:
            raise ValueError(f"{d} is given twice")
        out.append(d)
    return out


def density_independent(scheme: str) -> bool:
    """torch's own DDP hooks (``ddp``, ``ddp_powersgd``, ``ddp_fp16``) ignore ``--density``:
    a sweep trains them once, at its first density, and pairs every density with that run."""
    from gradsync.apps.train import scheme_choice

    return scheme_choice(scheme).scheme is None


def plans_file(folder: str | Path, model: str, seed: int, density: float | None = None
               ) -> Path:
    """Where a job writes (and ``--plans`` reads) its engine plans; a sweep's jobs name their
    density (``density``), since a plan's densities are made for one."""
    tag = "" if density is None else f"-d{density:g}"
    return Path(folder) / f"plans-{model}{tag}-seed{seed}.json"


def _spec(a: argparse.Namespace, model: str, seed: int, density: float,
          schemes: list[str]):
    from gradsync.apps import models
    from gradsync.apps.train import TrainSpec, resolve_data

    image = models.task(model) == "image"
    steps = a.steps or DEFAULT_STEPS.get(model, 80)
    if image:
        n_eval = a.image_eval_batches or math.ceil(TEST_IMAGES / a.batch_size)
    else:
        n_eval = a.lm_eval_batches
    try:
        spec = TrainSpec(model=model, schemes=tuple(schemes), data=a.data,
                         world_size=a.world_size, steps=steps, batch_size=a.batch_size,
                         lr_schedule=a.lr_schedule, density=density, seed=seed, eval_batches=n_eval,
                         eval_every=max(1, steps // a.eval_points), timeout=a.timeout,
                         progress=False, density_warmup=a.density_warmup,
                         density_schedule=a.density_schedule,
                         min_k=a.min_k, momentum_masking=a.momentum_masking,
                         momentum_ahead=a.momentum_ahead, budget=a.budget,
                         adam_warmup=a.adam_warmup, amp=a.amp,
                         sparsifier=a.sparsifier, clip_norm=a.clip_norm,
                         bandwidth=a.bandwidth, latency=a.latency,
                         plans=a.plan_files.get((model, seed)))
    except ValueError as e:
        raise SystemExit(f"python -m gradsync bench convergence: error: {e}") from None
    return resolve_data(spec, quiet=seed != 1)


def _metric(task: str) -> tuple[str, bool]:
    """(summary key, higher is better)."""
    return ("test_accuracy", True) if task == "image" else ("perplexity", False)


def ddp_steps_for(ddp_histories: list[list[dict]], key: str, higher: bool, value: float
                  ) -> dict[str, Any] | None:
    """The step at which DDP's mean curve reaches ``value``: how many of DDP's steps a
    scheme's budget was worth when its final mean is ``value``.

    DDP's curve is the mean over seeds at each evaluation point (every seed must have the same
    points); the step is interpolated linearly between the last point that falls short of
    ``value`` and the first that reaches it. ``{"step": s, "bound": "="}``; ``"≤"`` with the
    first point when DDP had reached ``value`` already there; ``"≥"`` with the last point when
    it never does (the scheme ends better than DDP). ``None`` without a usable history."""
    if not ddp_histories or not all(ddp_histories) or any(
            [p["step"] for p in h] != [p["step"] for p in ddp_histories[0]]
            for h in ddp_histories):
        return None
    steps = [p["step"] for p in ddp_histories[0]]
    curve = [statistics.fmean(h[i][key] for h in ddp_histories) for i in range(len(steps))]

    def reaches(v: float) -> bool:
        return v >= value if higher else v <= value

    i = next((i for i, v in enumerate(curve) if reaches(v)), None)
    if i is None:
        return {"step": float(steps[-1]), "bound": "≥"}
    if i == 0:
        return {"step": float(steps[0]), "bound": "≤"}
    (s0, v0), (s1, v1) = (steps[i - 1], curve[i - 1]), (steps[i], curve[i])
    return {"step": s0 + (s1 - s0) * (value - v0) / (v1 - v0), "bound": "="}


def aggregate(model: str, task: str, per_seed: dict[int, list[dict]],
              schemes: list[str]) -> list[dict]:
    """Rows per scheme from ``per_seed[seed] = [{"scheme", "final", "bytes_per_step",
    "history", "plan_digest" (optional)}, …]`` (see the module docstring for the fields)."""
    key, higher = _metric(task)
    seeds = sorted(per_seed)
    by = {s: [next(r for r in per_seed[sd] if r["scheme"] == s) for sd in seeds] for s in schemes}
    ddp = by.get("ddp")
    ddp_mean = statistics.fmean([r["final"] for r in ddp]) if ddp else None
    ddp_step_s = _step_s(ddp) if ddp else None
    target = None
    if ddp_mean is not None:
        target = TARGET * ddp_mean if higher else ddp_mean / TARGET
    rows = []
    for s in schemes:
        finals = [r["final"] for r in by[s]]
        row: dict[str, Any] = {
            "model": model, "scheme": s, "metric": key, "seeds": seeds, "finals": finals,
            "mean": statistics.fmean(finals), "std": _std(finals),
            "bytes_per_step": statistics.fmean([r["bytes_per_step"] for r in by[s]]),
            "missing_rate": (statistics.fmean([r["missing_rate"] for r in by[s]])
                             if all(r.get("missing_rate") is not None for r in by[s])
                             else None),
            "diff_vs_ddp": None, "target": target, "steps_to_target": None,
            "seconds_to_target": None, "reached": None, "ddp_steps": None,
            "seconds_to_ddp": None, "time_speedup": None, "reached_ddp": None,
            "step_s": _step_s(by[s]), "step_speedup": None, "speedup_kept": None,
            "run_bytes_per_step": _mean_of(by[s], "run_bytes_per_step"),
            "plans": [r.get("plan_digest") for r in by[s]],
            "spike": max((r["spike"] for r in by[s] if r.get("spike") is not None),
                         default=None),
            "diverged": sum(r.get("status", "ok") != "ok" for r in by[s]),
            "history": [r["history"] for r in by[s]],
            "code": [r.get("code") for r in by[s]],
            "reused": sum(bool(r.get("reused")) for r in by[s])}
        if ddp is not None:
            row["diff_vs_ddp"] = paired_ci(finals, [r["final"] for r in ddp])
            row["ddp_steps"] = ddp_steps_for([r["history"] for r in ddp], key, higher,
                                             row["mean"])
        if ddp_mean is not None and all(r["history"] for r in by[s] + ddp):
            _time_to_ddp(row, by[s], ddp, key, higher, ddp_mean)
            if ddp_step_s is not None and row["step_s"]:
                row["step_speedup"] = ddp_step_s / row["step_s"]
                if row["time_speedup"] is not None:
                    row["speedup_kept"] = row["time_speedup"] / row["step_speedup"]
        if target is not None and all(r["history"] for r in by[s]):
            hits = []
            for r in by[s]:
                hit = next((h for h in r["history"]
                            if (h[key] >= target if higher else h[key] <= target)), None)
                if hit is not None:
                    hits.append(hit)
            row["reached"] = len(hits)
            if hits:
                row["steps_to_target"] = statistics.fmean([h["step"] for h in hits])
                row["seconds_to_target"] = statistics.fmean([h["elapsed_s"] for h in hits])
        rows.append(row)
    return rows


def _step_s(runs: list[dict]) -> float | None:
    """Rank 0's training seconds per step (evaluation excluded, on the study's link), mean
    over ``runs``: each run's last evaluation point's ``elapsed_s`` over its step; ``None``
    without a curve."""
    if not runs or not all(r["history"] for r in runs):
        return None
    return statistics.fmean([r["history"][-1]["elapsed_s"] / r["history"][-1]["step"]
                             for r in runs])


def _mean_of(runs: list[dict], key: str) -> float | None:
    """The mean of ``key`` over ``runs``; None when a run lacks it (kept from before it was)."""
    vals = [r.get(key) for r in runs]
    return None if any(v is None for v in vals) else statistics.fmean(vals)


def _time_to_ddp(row: dict, runs: list[dict], ddp: list[dict], key: str, higher: bool,
                 ddp_mean: float) -> None:
    """The time to DDP's mean final score (issue 68): per seed, the training seconds until
    the evaluation curve reaches it (:func:`gradsync.apps.train.summary.time_to`), the mean
    over the seeds that do, and DDP's own mean time to it over that (the effective speed-up,
    0 when no seed gets there)."""
    times = [time_to(r["history"], key, higher, ddp_mean) for r in runs]
    hit = [t for t in times if t is not None]
    row["reached_ddp"] = len(hit)
    own = [time_to(r["history"], key, higher, ddp_mean) for r in ddp]
    t_ddp = statistics.fmean([t for t in own if t is not None]) if any(own) else None
    if hit:
        row["seconds_to_ddp"] = statistics.fmean(hit)
        row["time_speedup"] = None if t_ddp is None else t_ddp / row["seconds_to_ddp"]
    else:
        row["time_speedup"] = 0.0


RUN_SPEC_IGNORED = ("schemes", "timeout", "progress", "out", "plans")  # not the run's


def run_file(folder: str | Path, model: str, seed: int, scheme: str,
             density: float | None = None) -> Path:
    """Where a study keeps one finished run (``<out>/runs/``), which ``--resume`` reuses; a
    sweep's name their density, as :func:`plans_file` does."""
    tag = "" if density is None else f"-d{density:g}"
    return Path(folder) / "runs" / f"{model}{tag}-seed{seed}-{scheme}.json"


def run_config(spec: Any, scheme: str) -> dict[str, Any]:
    """What decides a run's result: the train spec's fields but those that only say how it is
    launched (:data:`RUN_SPEC_IGNORED`) and, for torch's own DDP hooks, those that only
    gradsync's schemes read (``GRADSYNC_FIELDS``: a study that changes only how gradsync
    compresses reuses its DDP runs); and the plan it replays, if any."""
    from gradsync.apps.train.spec import DDP_PEERS, GRADSYNC_FIELDS
    from gradsync.engine.config import Config

    ignored = RUN_SPEC_IGNORED + (GRADSYNC_FIELDS if scheme in DDP_PEERS else ())
    cfg = {k: v for k, v in dataclasses.asdict(spec).items() if k not in ignored}
    cfg["plan"] = (spec.plans or {}).get(scheme)
    choice = next((c for c in spec.choices if c.name == scheme), None)
    ours = choice is not None and choice.scheme is not None  # a gradsync scheme
    if ours and cfg["momentum_ahead"] is None:
        # the scheme's share at this density under momentum correction, the default since
        # 2026-12-05 (a run kept before, where None meant 0, or under another share, differs)
        from gradsync.apps.train.runners import MOMENTUM

        share = Config(scheme=choice.scheme.name, density=spec.density,
                       momentum=MOMENTUM).effective_momentum_ahead
        cfg["momentum_ahead"] = f"scheme's {share:.6g}"
    if ours and cfg["budget"] is None:
        # the scheme's budget (Config.effective_budget): "blend" since 2026-12-07, "pooled"
        # for the SSFusion family since later that day (a run kept before, where None meant
        # "even", then "blend" for every scheme, differs; one given that --budget is this run)
        cfg["budget"] = Config(scheme=choice.scheme.name).effective_budget
    if (ours and cfg["density_warmup"] is None
            and any(choice.scheme.dgc_warmup) and spec.density < 1 and not spec.adamw):
        # the scheme's DGC warm-up, the SSFusion family's default since 9052b94, the other
        # measured schemes' since then (a run kept before, where None meant none, differs);
        # AdamW's recipe replaces it
        cfg["density_warmup"] = "scheme's {}:{}".format(*choice.scheme.dgc_warmup)
    return json.loads(json.dumps(cfg))  # tuples as lists: what a file gives back


def load_run(path: Path, config: dict[str, Any]) -> dict[str, Any] | None:
    """The run kept at ``path`` (``None``: none there). One made with another configuration
    is refused with the fields that differ: reusing it would pair runs of different studies."""
    try:
        kept = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise SystemExit(f"python -m gradsync bench convergence: error: --resume: {path}: "
                         f"{e}") from None
    from gradsync.apps.train.spec import GRADSYNC_FIELDS

    old = kept.get("config", {})
    # a DDP run kept before 00b9d07 still names GRADSYNC_FIELDS: for it they decide nothing
    keys = config.keys() | (old.keys() - set(GRADSYNC_FIELDS))
    diff = sorted(k for k in keys if old.get(k) != config.get(k))
    if diff:
        shown = ", ".join(f"{k}: {old.get(k)!r} there, {config.get(k)!r} now" for k in diff)
        raise SystemExit(f"python -m gradsync bench convergence: error: --resume: {path} was "
                         f"trained with another configuration ({shown}); remove it or give "
                         f"another --out")
    return kept


def _launch(spec: Any, model: str, seed: int) -> tuple[list[dict], list[dict], dict]:
    """One train job: (its summarized runs, rank 0's runs, the link). A scheme that diverges
    is recorded (its run's ``status``, its final ``nan``) and the job goes on with the next:
    the study counts it ("diverged on k/n seeds") instead of stopping."""
    from gradsync.apps import train
    from gradsync.testing import DistributedError, DistributedTimeout

    try:
        results, link = train.launch(spec, keep_going=True)
    except (DistributedError, DistributedTimeout) as e:
        raise RuntimeError(f"{model} seed {seed} failed: {e}") from e
    rank0 = next(r for r in results if r["rank"] == 0)
    return train.summarize(results, spec.warmup_steps), rank0["runs"], link


def _run_model(a: argparse.Namespace, model: str, density: float,
               carried: dict[int, list[dict]] | None = None
               ) -> tuple[list[dict], dict, dict[int, list[dict]]]:
    """One model at one density: a train job per seed, then the rows of every scheme.
    ``carried[seed]``: results of the density-independent schemes from the sweep's first
    density (:func:`density_independent`), paired here instead of trained again. Returns
    the rows, the study's info and this density's per-seed results.

    Every finished run is kept in ``<out>/runs/`` (:func:`run_file`). With ``--resume`` the
    kept runs of the same configuration are reused and each other scheme is its own job, kept
    as soon as it ends, so a study stopped midway loses at most the run in flight."""
    from gradsync.apps import models

    key, _ = _metric(models.task(model))
    carried = carried or {}
    reused = {r["scheme"] for rs in carried.values() for r in rs}
    schemes = [s for s in a.scheme_list if s not in reused]
    sweep = len(a.densities) > 1
    tag = density if sweep else None
    per_seed: dict[int, list[dict]] = {}
    evaluated = None  # test images (accuracy) or target tokens (perplexity) per evaluation
    spec = None
    link: dict = {}
    for seed in range(1, seeds_for(a, model) + 1):
        spec = _spec(a, model, seed, density, schemes)  # parse_args: never empty
        per_seed[seed] = list(carried.get(seed, []))
        kept: dict[str, dict] = {}
        if a.resume:
            for s in schemes:
                run = load_run(run_file(a.out, model, seed, s, tag), run_config(spec, s))
                if run is not None:
                    kept[s] = run
        todo = [s for s in schemes if s not in kept]
        jobs = [[s] for s in todo] if a.resume else ([todo] if todo else [])
        t0 = time.perf_counter()
        for job in jobs:
            t1 = time.perf_counter()
            runs, rank0_runs, link = _launch(dataclasses.replace(spec, schemes=tuple(job)),
                                             model, seed)
            ev = rank0_runs[0]["eval"]
            for r, rr in zip(runs, rank0_runs):
                kept[r["scheme"]] = {
                    "config": run_config(spec, r["scheme"]), "code": code_revision(),
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    "job_s": time.perf_counter() - t1, "scheme_count": len(job),
                    "link": link, "evaluated": ev.get("test_samples", ev.get("eval_tokens")),
                    "plan": r.get("plan"),
                    "row": {"scheme": r["scheme"],
                            "final": r["summary"].get(key, math.nan),  # nan: diverged
                            "status": r.get("status", "ok"), "spike": spike(rr["records"]),
                            "bytes_per_step": r["summary"]["bytes_per_step"],
                            "run_bytes_per_step": r["summary"]["run_bytes_per_step"],
                            "missing_rate": r["summary"].get("missing_rate"),
                            "plan_digest": r["summary"].get("plan_digest"),
                            "history": [{k: h[k] for k in ("step", "elapsed_s", key)}
                                        for h in rr.get("history", [])]}}
                path = run_file(a.out, model, seed, r["scheme"], tag)
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(kept[r["scheme"]]))
        plans = {s: kept[s]["plan"] for s in schemes if kept[s].get("plan") is not None}
        if plans:  # what `train --plan` replays
            Path(a.out).mkdir(parents=True, exist_ok=True)
            plans_file(a.out, model, seed, tag).write_text(json.dumps(plans))
        last = kept[schemes[-1]]
        evaluated = last["evaluated"]
        link = link or last["link"]
        per_seed[seed] += [dict(kept[s]["row"], code=kept[s]["code"], reused=s not in todo)
                           for s in schemes]
        at = f" at density {density:g}" if sweep else ""
        again = len(schemes) - len(todo)
        print(f"bench convergence: {model} seed {seed}{at}: {len(todo)} "
              f"scheme{'s' if len(todo) != 1 else ''} in {time.perf_counter() - t0:.0f} s"
              + (f", {again} kept from an earlier run (--resume)" if again else ""), flush=True)
    assert spec is not None
    rows = aggregate(model, models.task(model), per_seed, a.scheme_list)
    for r in rows:
        r["density"] = density
        r["trained_at_density"] = (a.densities[0] if r["scheme"] in reused else density)
    info = {"model": model, "task": models.task(model), "data": spec.data, "metric": key,
            "steps": spec.steps, "batch_size": spec.batch_size, "lr": spec.lr,
            "lr_schedule": spec.lr_schedule,
            "eval_batches": spec.eval_batches, "eval_every": spec.eval_every,
            "evaluated": evaluated,
            "world_size": spec.world_size, "density": density,
            "density_warmup": spec.density_warmup,
            "density_schedule": spec.density_schedule,
            "sparsifier": spec.sparsifier, "clip_norm": spec.clip_norm, "min_k": spec.min_k,
            "budget": spec.budget,
            "momentum_masking": spec.momentum_masking, "momentum_ahead": spec.momentum_ahead,
            "adam_freeze_step": spec.adam_freeze_step(spec.steps) if spec.adamw else None,
            "amp": spec.amp,
            "text_fallback": spec.text_fallback, "link": link.get("link", "loopback")}
    return rows, info, per_seed


def spike(records: list[dict]) -> float | None:
    """Rank 0's largest training loss after step :data:`SPIKE_AFTER`, over its step-0 loss
    (``inf`` once a loss is not finite; ``None`` for a run too short to tell)."""
    losses = [r["loss"] for r in records]
    if len(losses) <= SPIKE_AFTER + 1 or not losses[0] > 0:
        return None
    later = losses[SPIKE_AFTER + 1:]
    if not all(math.isfinite(v) for v in later):
        return math.inf
    return max(later) / losses[0]


def at_parity(row: dict, ddp_mean: float) -> bool:
    """Issue 11's bar: mean final accuracy at most :data:`PARITY` ``["test_accuracy"]`` (1 point)
    below DDP's mean, or mean perplexity at most :data:`PARITY` ``["perplexity"]`` (5 %)
    above it."""
    if row["metric"] == "test_accuracy":
        return row["mean"] >= ddp_mean - PARITY["test_accuracy"] - 1e-12
    return row["mean"] <= ddp_mean * (1 + PARITY["perplexity"]) + 1e-12


def _gap(row: dict, ddp_mean: float) -> float:
    """A row's mean against DDP's: points of accuracy, or percent of perplexity."""
    if row["metric"] == "test_accuracy":
        return 100.0 * (row["mean"] - ddp_mean)
    return 100.0 * (row["mean"] / ddp_mean - 1)


def _sweep(results: list[tuple[list[dict], dict]], model: str
           ) -> tuple[list[tuple[dict, dict[str, dict]]], dict | None, bool]:
    """One model's studies in a sweep, in the order run: ``[(info, rows by scheme)]``, DDP's
    row (the same at every density; ``None`` without ddp) and whether the metric is
    accuracy."""
    studies = [(info, {r["scheme"]: r for r in rows})
               for rows, info in results if info["model"] == model]
    first = studies[0][1]
    return studies, first.get("ddp"), next(iter(first.values()))["metric"] == "test_accuracy"


def tradeoff(results: list[tuple[list[dict], dict]], model: str
             ) -> tuple[list[str], list[list[str]], str]:
    """A sweep's summary for one model: per scheme that uses the density, its mean gap to DDP
    (points of accuracy, or % of perplexity) and bytes per step at each density, and the
    lowest density at which it meets the parity bar (:func:`at_parity`). Returns the columns,
    the cells and a line on DDP's reference."""
    studies, ddp, acc = _sweep(results, model)
    unit = "points" if acc else "%"
    cols = (["scheme"] + [f"density {info['density']:g}: Δ {unit} · MB/step"
                          for info, _ in studies] + ["lowest density at parity"])
    cells = []
    for scheme in [s for s in studies[0][1] if not density_independent(s)]:
        line, best = [scheme], None
        for info, rows in studies:
            r = rows[scheme]
            mb = f"{r['bytes_per_step'] / 1e6:.4f}"
            if ddp is None:
                line.append(f"n/a · {mb}")
                continue
            line.append(f"{_gap(r, ddp['mean']):+.2f} · {mb}")
            if at_parity(r, ddp["mean"]) and (best is None or info["density"] < best):
                best = info["density"]
        line.append("n/a" if ddp is None else ("none of these" if best is None
                                               else f"{best:g}"))
        cells.append(line)
    if ddp is None:
        return cols, cells, "no ddp among the schemes: no gaps"
    if acc:
        bar = f"within {100 * PARITY['test_accuracy']:g} point of its accuracy"
        mean = f"{100 * ddp['mean']:.2f}"
    else:
        bar = f"within {100 * PARITY['perplexity']:g} % of its perplexity"
        mean = f"{ddp['mean']:.2f}"
    return cols, cells, (f"ddp (trained once, density-independent): {mean} mean, "
                         f"{ddp['bytes_per_step'] / 1e6:.4f} MB/step; parity: {bar}")


def _fmt(v: float | None, fmt: str = "{:.2f}") -> str:
    return "n/a" if v is None else fmt.format(v)


def table(rows: list[dict], info: dict) -> tuple[list[str], list[list[str]]]:
    """Columns and formatted cells of one model's table (printed and written to the docs)."""
    acc = info["metric"] == "test_accuracy"
    scale = 100.0 if acc else 1.0
    name = "test acc %" if acc else "perplexity"
    cols = ["scheme", f"{name} mean ± std", "Δ vs ddp [95% CI]", "MB/step",
            "tensors missing %", "steps to target", "s to target",
            "s to ddp's mean (× ddp)", "ms/step (× ddp)", "of the step speed-up kept",
            "ddp steps to its mean",
            f"largest loss after step {SPIKE_AFTER} / step 0 (worst seed)"]
    out = []
    for r in rows:
        std = "" if r["std"] is None else f" ± {scale * r['std']:.2f}"
        d = r["diff_vs_ddp"]
        if d is None:
            dcell = "n/a (no ddp)"
        elif r["scheme"] == "ddp":
            dcell = "0"
        elif d["half"] is None:
            why = "1 seed" if d["n"] < 2 else "a run diverged"
            dcell = f"{scale * d['mean']:+.2f} [n/a: {why}]"
        else:
            dcell = f"{scale * d['mean']:+.2f} [{scale * d['low']:+.2f}, {scale * d['high']:+.2f}]"
        if r["reached"] is None:
            st = ss = "n/a"
        elif r["reached"] == 0:
            st = ss = "not reached"
        else:
            k = f" ({r['reached']}/{len(r['seeds'])})" if r["reached"] < len(r["seeds"]) else ""
            st, ss = f"{r['steps_to_target']:.0f}{k}", f"{r['seconds_to_target']:.1f}{k}"
        eq = r.get("ddp_steps")
        if eq is None:
            ecell = "n/a"
        else:
            last = info.get("steps")
            share = f" ({100 * eq['step'] / last:.0f} %)" if last and eq["bound"] == "=" else ""
            ecell = f"{'' if eq['bound'] == '=' else eq['bound'] + ' '}{eq['step']:.0f}{share}"
        if r.get("reached_ddp") is None:
            tcell = "n/a"
        elif r["reached_ddp"] == 0:
            tcell = "not reached"
        else:
            k = (f" ({r['reached_ddp']}/{len(r['seeds'])})"
                 if r["reached_ddp"] < len(r["seeds"]) else "")
            x = "" if r["time_speedup"] is None else f" ({r['time_speedup']:.2f}×)"
            tcell = f"{r['seconds_to_ddp']:.1f}{x}{k}"
        step_s, up = r.get("step_s"), r.get("step_speedup")
        mcell = "n/a" if step_s is None else (
            f"{1e3 * step_s:.1f}" + ("" if up is None else f" ({up:.2f}×)"))
        kept = r.get("speedup_kept")
        kcell = "n/a" if kept is None else f"{100 * kept:.0f} %" + (
            f" ({r['reached_ddp']}/{len(r['seeds'])})"  # of the seeds that got there
            if r["reached_ddp"] < len(r["seeds"]) else "")
        miss = r.get("missing_rate")
        sp, bad = r.get("spike"), r.get("diverged") or 0
        scell = "n/a" if sp is None else f"{sp:.2f}×"
        if bad:
            scell += f", diverged on {bad}/{len(r['seeds'])} seeds"
        out.append([r["scheme"], f"{scale * r['mean']:.2f}{std}", dcell,
                    f"{r['bytes_per_step'] / 1e6:.4f}",
                    "n/a" if miss is None else f"{100 * miss:.1f}", st, ss, tcell, mcell, kcell,
                    ecell, scell])
    return cols, out


def _title(info: dict, rows: list[dict]) -> str:
    """A study's heading; its seed count is the rows' (every row has every seed)."""
    n_seeds = len(rows[0]["seeds"]) if rows else 0
    n = info.get("evaluated")
    if info["metric"] == "test_accuracy":
        what = ("accuracy on the whole test split" if n == TEST_IMAGES
                else f"accuracy on {n} test images")
    else:
        what = f"held-out perplexity ({n} tokens)"
    return (f"{info['model']} on {info['data']} — {what}; P={info['world_size']}, "
            f"{info['steps']} steps × {info['batch_size']}/rank, density {info['density']}, "
            f"{n_seeds} seeds, {info['link']}"
            + (f", learning rate {info['lr_schedule']}" if info.get("lr_schedule") else "")
            + (f", AMP {info['amp']}" if info.get("amp") else ""))


def _plot(results: list[tuple[list[dict], dict]]):
    def plot(ax) -> None:
        fig = ax.figure
        fig.set_size_inches(7 * len(results), 4.8)
        ax.remove()
        axes = fig.subplots(1, len(results), squeeze=False)[0]
        for axis, (rows, info) in zip(axes, results):
            acc = info["metric"] == "test_accuracy"
            scale = 100.0 if acc else 1.0
            for r in rows:
                hs = [h for h in r["history"] if h]
                if hs and all(len(h) == len(hs[0]) for h in hs):
                    steps = [p["step"] for p in hs[0]]
                    vals = [[scale * h[i][info["metric"]] for h in hs] for i in range(len(steps))]
                    mean = [statistics.fmean(v) for v in vals]
                    # a curve gone non-finite (a perplexity overflowing) plots as a gap
                    sd = [statistics.stdev(v) if len(v) > 1 and all(map(math.isfinite, v))
                          else 0.0 for v in vals]
                    line, = axis.plot(steps, mean, marker="o", ms=3, label=r["scheme"])
                    axis.fill_between(steps, [m - s for m, s in zip(mean, sd)],
                                      [m + s for m, s in zip(mean, sd)],
                                      color=line.get_color(), alpha=0.15)
            if rows and rows[0]["target"] is not None:
                axis.axhline(scale * rows[0]["target"], color="gray", ls=":", lw=1,
                             label="99% of ddp")
            axis.set_xlabel("step")
            axis.set_ylabel("test accuracy %" if acc else "held-out perplexity")
            axis.set_title(_title(info, rows), fontsize=8)
            axis.legend(fontsize=7, ncol=2)

    return plot


def _tradeoff_plot(results: list[tuple[list[dict], dict]], model_names: list[str]):
    """A sweep's figure: per model, each density-dependent scheme's gap to DDP (points of
    accuracy, or % of perplexity) against its bytes per step, one marker per density, with
    the parity bar."""
    def plot(ax) -> None:
        fig = ax.figure
        fig.set_size_inches(7 * len(model_names), 4.8)
        ax.remove()
        axes = fig.subplots(1, len(model_names), squeeze=False)[0]
        for axis, model in zip(axes, model_names):
            studies, ddp, acc = _sweep(results, model)
            if ddp is None:
                continue
            for scheme in [s for s in studies[0][1] if not density_independent(s)]:
                pts = [(rows[scheme], info["density"]) for info, rows in studies]
                xs = [r["bytes_per_step"] / 1e6 for r, _ in pts]
                ys = [_gap(r, ddp["mean"]) for r, _ in pts]
                line, = axis.plot(xs, ys, marker="o", ms=4, label=scheme)
                for x, y, (_, d) in zip(xs, ys, pts):
                    axis.annotate(f"{d:g}", (x, y), fontsize=6, color=line.get_color(),
                                  xytext=(3, 3), textcoords="offset points")
            axis.axhline(0, color="gray", lw=1)
            bar = -100 * PARITY["test_accuracy"] if acc else 100 * PARITY["perplexity"]
            axis.axhline(bar, color="gray", ls=":", lw=1, label="parity bar")
            axis.set_xscale("log")
            axis.set_xlabel("MB per step per rank (log)")
            axis.set_ylabel("accuracy − ddp's (points)" if acc
                            else "perplexity vs ddp's (%)")
            info = studies[0][0]
            axis.set_title(f"{model}: P={info['world_size']}, {info['steps']} steps, "
                           f"{len(ddp['seeds'])} seeds; labels: density", fontsize=8)
            axis.legend(fontsize=7, ncol=2)

    return plot


def plans_note(rows: list[dict]) -> str:
    """A sentence naming the schemes whose plan differed between seeds ("" when none did)."""
    distinct = [(r["scheme"], len({p for p in r.get("plans", []) if p}), len(r["seeds"]))
                for r in rows]
    varied = [d for d in distinct if d[1] > 1]
    if not varied:
        return ""
    names = ", ".join(f"{s} ({n} plans in {k} seeds)" for s, n, k in varied)
    return (f"Plans differed between seeds for {names}: these schemes plan from times "
            "measured in their warm-up. Another plan can change the result (MG-WFBP merging "
            "two buffers into one changes which entries are selected) or leave it bit for bit "
            "(moving an SSFusion buffer boundary changes no tensor's selection or sum). Each "
            "seed's plan digest is in the JSON (`plans`), its plans in the `--out` folder "
            "(`plans-<model>-seed<s>.json`, which `--plans DIR` replays; a density sweep's "
            "`plans-<model>-d<density>-seed<s>.json`).")


def _machine_note() -> str:
    cpus = os.cpu_count() or 0
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    state = "loaded" if load > 0.75 * cpus else "quiet"
    return (f"machine: {cpus} cores ({cpu_description()}), {state} (1-min load average "
            f"{load:.1f} at the end)")


def _runs_note(results: list[tuple[list[dict], dict]]) -> list[str]:
    """The page's line on runs kept from an earlier invocation (``--resume``) and the code
    revisions the runs were trained at; none when this command trained every run at one."""
    rows = [r for rows, _ in results for r in rows]
    total = sum(len(r["finals"]) for r in rows)
    reused = sum(r.get("reused", 0) for r in rows)
    codes = sorted({c or "unknown" for r in rows for c in r.get("code", [])})
    if not reused and len(codes) <= 1:
        return [f"- code: {codes[0]}"] if codes else []
    return [f"- runs: {total - reused} trained by this command, {reused} kept from earlier "
            f"invocations (`--resume`, each in `<out>/runs/`); code: {', '.join(codes)}"]


def write_docs(path: Path, results: list[tuple[list[dict], dict]], command: str, wall: float,
               artifacts: list[Path]) -> Path:
    """The markdown page: one table per model, the command, the date and the machine."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = ["# Convergence study (`python -m gradsync bench convergence`)", "",
             "Written by the command, not by hand.", "",
             f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
             f"- command: `{command}`",
             f"- {_machine_note()}; wall time {wall / 60:.1f} min",
             *_runs_note(results),
             "- Δ vs ddp: mean over seeds of the paired difference (same seed, same data "
             "order), 95 % interval mean ± t(0.975, n−1)·sd/√n; accuracy in points.",
             "- target: 99 % of ddp's mean final accuracy (perplexity: ddp's / 0.99); steps "
             "and rank-0 training seconds to the first evaluation point that reaches it "
             "(resolution: the evaluation spacing), mean over the seeds that reach it.",
             "- s to ddp's mean (× ddp): rank-0 training seconds until the scheme's curve "
             "reaches ddp's mean final value itself (linear between evaluation points), mean "
             "over the seeds that reach it, and ddp's own mean time to it over that: the "
             "speed-up once accuracy is counted (on loopback the times are the machine's, "
             "not a link's).",
             "- ms/step (× ddp): rank-0 training seconds per step over the whole run "
             "(evaluation excluded, on the study's link), mean over seeds, and ddp's over it; "
             "of the step speed-up kept: the time speed-up over the step speed-up, what is "
             "left of the link's saving once the accuracy lag is paid (issue 68's bar: at "
             "least 85 %), over the seeds that reach ddp's mean (k/n when not all do; the "
             "others never get there).",
             "- ddp steps to its mean: the step at which ddp's mean curve reaches the "
             "scheme's mean final value (linear between evaluation points; ≤: already at the "
             "first point, ≥: never), with its share of the budget.",
             "- MB/step: bytes each rank sends per step, counted at the torch.distributed "
             "call (train's `bytes_per_step`: mean over ranks and the steps after the first "
             "warmup_steps + 1), mean over seeds.",
             "- tensors missing %: the share of (tensor, step) pairs of which no entry was "
             "synchronized (SSFusion §III-A, Table I; train's `missing_rate`: rank 0, the "
             "steps after the warm-up), mean over seeds.", ""]
    names = list(dict.fromkeys(info["model"] for _, info in results))
    if len(results) > len(names):  # a density sweep: its trade-off first
        for model in names:
            cols, cells, ref = tradeoff(results, model)
            lines += [f"## {model}: the density sweep", "", f"- {ref}", "",
                      "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
            lines += ["| " + " | ".join(c) + " |" for c in cells]
            lines.append("")
    for rows, info in results:
        cols, cells = table(rows, info)
        lines += [f"## {_title(info, rows)}", "",
                  "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join(c) + " |" for c in cells]
        varied = plans_note(rows)
        if varied:
            lines += ["", varied]
        if info.get("text_fallback"):
            lines += ["", "Note: the text corpus is not installed; trained on gradsync's own "
                          "source text."]
        lines.append("")
    for p in artifacts:
        lines.append(f"- [{p.name}]({p.name})")
    path.write_text("\n".join(lines) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv)
    if a.seeds is not None and a.seeds < 2:
        print("note: with 1 seed there is no interval (shown as n/a); use --seeds 2 or more")
    if "ddp" not in a.scheme_list:
        print("note: no ddp among the schemes: differences and targets are n/a")
    dens = ",".join(f"{d:g}" for d in a.densities)
    seeds = ", ".join(f"{m} {seeds_for(a, m)}" for m in a.models)
    print(f"bench convergence: {len(a.scheme_list)} schemes, seeds per model: {seeds}; "
          f"P={a.world_size}, density {dens}", flush=True)
    t0 = time.perf_counter()
    results = []
    try:
        for model in a.models:
            carried = None
            for density in a.densities:
                rows, info, per_seed = _run_model(a, model, density, carried)
                results.append((rows, info))
                if carried is None:  # the density-independent schemes, trained once
                    carried = {seed: [r for r in rs if density_independent(r["scheme"])]
                               for seed, rs in per_seed.items()}
    except RuntimeError as e:
        print(f"bench convergence failed: {e}", file=sys.stderr)
        return 1
    wall = time.perf_counter() - t0
    for rows, info in results:
        cols, cells = table(rows, info)
        print_table(_title(info, rows), cols, cells)
    sweep = len(a.densities) > 1
    if sweep:
        for model in a.models:
            cols, cells, ref = tradeoff(results, model)
            print_table(f"{model}: the density sweep ({ref})", cols, cells)
    command = "python -m gradsync bench convergence" + (" " + shlex.join(argv) if argv else "")
    meta = {"command": command, "wall_s": wall, "models": [info for _, info in results],
            "target_fraction": TARGET, "machine": _machine_note()}
    rows_all = [r for rows, _ in results for r in rows]
    plot = _tradeoff_plot(results, a.models) if sweep else _plot(results)
    jpath, ppath = write_outputs("convergence", rows_all, a.out, plot=plot, meta=meta)
    print(f"bench convergence: {wall:.0f} s; wrote {jpath} and {ppath}")
    if a.write_docs:
        dpath = Path(a.write_docs)
        arts = []
        for p in (jpath, ppath):
            if p is not None:
                dst = dpath.parent / (dpath.stem + p.suffix)  # beside it, its name
                dpath.parent.mkdir(parents=True, exist_ok=True)
                if p.resolve() != dst.resolve():
                    shutil.copyfile(p, dst)
                arts.append(dst)
        print(f"wrote {write_docs(dpath, results, command, wall, arts)}")
    return 0


__all__ = ["DEFAULT_SCHEMES", "DEFAULT_SEEDS", "PARITY", "T975", "aggregate", "at_parity",
           "ddp_steps_for", "density_independent", "main", "paired_ci", "parse_args",
           "parse_densities", "seeds_for", "t975", "table", "tradeoff", "write_docs"]
