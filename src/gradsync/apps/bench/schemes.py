"""``python -m gradsync bench schemes``: every sync scheme training one model, side by side,
on one or several links.

``python -m gradsync bench schemes --model resnet18 --world-size 4 --density 0.01
[--bandwidth loopback,1gbit,100mbit] [--steps 30] [--schemes …] [--repeats N] [--quick]``

Trains a few dozen steps per scheme on real gloo ranks (the workers of
``python -m gradsync train``: same seed, same data shards, same initial model for every scheme)
and reports, per scheme, the SSFusion Fig. 13 breakdown — backward, sparsification,
communication and *exposed* communication (what the step waited for) — beside throughput
(global samples/s, median after warm-up), the process CPU time of a step (``cpu ms``: the
busiest rank's, every thread; with more ranks than cores it sets the step time), bytes each
rank sends per step (counted at the torch.distributed call) and the tensor missing rate
(SSFusion Table I). PyTorch's own DDP
all-reduce (``ddp``) and its PowerSGD hook (``ddp_powersgd``) run as peers in the same job, so
the speed-ups are same-run ratios. See :mod:`gradsync.apps.train` for how each time is measured for
the DDP peers (from their comm-hook timestamps) and for the engine (``GradSync.stats()``).

Links: ``--bandwidth`` is a comma-separated list of ``loopback`` and tc rates (``100mbit``,
``1gbit``, …); each rate gives per-rank tbf-shaped links (root; otherwise a one-line note and
loopback). One job runs per link, every scheme in each. ``--latency`` is tbf's queueing bound,
not a propagation delay, and applies to the shaped links.

Writes ``schemes.json`` (rows of every link + environment + the train metrics) and
``schemes.png`` (stacked breakdown bars, per link), and the crossover — speed-up over DDP per
scheme and link, and ``auto`` against DDP and against the best fixed scheme of the same link —
over all measured steps and, "settled", after the steps in which ``auto`` measures its
runners-up once (their count is printed; a run longer than that sees the settled figure) — as a
table, ``crossover.json`` and ``crossover.png`` (speed-up over DDP against link rate, one
line per scheme) under ``--out``.

``--repeats N`` runs every link's job N times, the schemes in reverse order every other time,
and the crossover gives per figure the median of the N same-run ratios with their range
(:func:`crossover_over_repeats`; each repeat's own crossover is in ``per_repeat``). One job
runs the schemes one after another, so a machine whose speed drifts during the job (a shared
host) favours the schemes that ran while it was fast: on this 2-core machine two identical
runs of ``--bandwidth loopback,1gbit,100mbit --schemes ddp,dense_ovlp,topka,auto --steps 300``
(CNN, P = 4) gave ``auto`` 1.16× then 0.81× DDP on loopback and 0.82× then 1.00× at
1 Gbit/s. A single run cannot resolve differences of that size; quote the median.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import TYPE_CHECKING, Any

from gradsync.apps.bench._harness import bench_parser, print_written
from gradsync.apps.common import print_table, write_outputs

if TYPE_CHECKING:
    from gradsync.apps.train import TrainSpec

DEFAULT_SCHEMES = ("ddp", "ddp_powersgd", "dense_ovlp", "topka", "oktopk", "densestream",
                   "per_tensor", "multi_tensor", "cupcake", "ssfusion", "ssfusion_o",
                   "ssfusion_oi", "hipress", "espresso", "spardl", "auto")
QUICK_SCHEMES = ("ddp", "ddp_powersgd", "topka", "ssfusion_oi")
LOOPBACK = "loopback"


def parse_links(value: str) -> list[str]:
    """The links of ``--bandwidth``: ``loopback`` and tc rates, comma-separated, in the order
    given; an empty item, a duplicate (also the same rate spelled twice) or a bad rate raises
    ``ValueError``."""
    from gradsync.testing import netem

    items = [v.strip() for v in str(value).split(",")]
    if not items or any(not v for v in items):
        raise ValueError(f"--bandwidth: an empty item in {value!r} (e.g. loopback,1gbit,100mbit)")
    seen: dict[object, str] = {}
    for v in items:
        key: object = LOOPBACK if v.lower() == LOOPBACK else netem.parse_bandwidth(v)
        if key in seen:
            raise ValueError(f"--bandwidth: {v!r} repeats {seen[key]!r}")
        seen[key] = v
    return [LOOPBACK if v.lower() == LOOPBACK else v for v in items]


def link_rate(link: str) -> float:
    """Bits per second of a link of :func:`parse_links` (loopback: infinity)."""
    from gradsync.testing import netem

    return float("inf") if link == LOOPBACK else float(netem.parse_bandwidth(link))


def _parse(argv: list[str] | None) -> tuple[list[TrainSpec], list[str], argparse.Namespace]:
    from gradsync.apps import train

    p = bench_parser("schemes", __doc__)
    p.add_argument("--model", default=None, help="default resnet18 (--quick: cnn)")
    p.add_argument("--world-size", default=None, help="default 4 (--quick: 2)")
    p.add_argument("--density", default="0.01")
    p.add_argument("--sparsifier", default="dgc")
    p.add_argument("--bandwidth", default=LOOPBACK,
                   help="links, comma-separated: loopback and tbf rates (100mbit, 1gbit, …); "
                        "default loopback")
    p.add_argument("--latency", default=None, help="tbf queueing bound, not a delay")
    p.add_argument("--steps", default=None, help="steps per scheme (default 30; --quick 4)")
    p.add_argument("--batch-size", default=None, help="per rank (default 16; --quick 8)")
    p.add_argument("--warmup-steps", default=None,
                   help="engine profiling steps, not measured (default 5; --quick 1)")
    p.add_argument("--schemes", default=None,
                   help=f"comma-separated (default {','.join(DEFAULT_SCHEMES)})")
    p.add_argument("--seed", default="0")
    p.add_argument("--repeats", type=int, default=1,
                   help="run each link's job N times, the scheme order reversed every other "
                        "time; the crossover is then the median of the same-run ratios, with "
                        "their range (default 1)")
    p.add_argument("--out", default="bench-out/schemes")
    p.add_argument("--quick", action="store_true", help="tiny settings for a smoke run")
    p.add_argument("--progress", action="store_true", help="show the training progress bars")
    b = p.parse_args(argv)
    try:
        links = parse_links(b.bandwidth)
    except ValueError as e:
        p.error(str(e))
    if b.latency is not None and links == [LOOPBACK]:
        p.error("--latency shapes links: give a rate in --bandwidth too")
    if b.repeats < 1:
        p.error(f"--repeats must be >= 1, got {b.repeats}")
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
        "--density-warmup", "off",  # the steps at the target density, not the scheme's warm-up
    ]
    if not b.progress:
        targs.append("--no-progress")
    specs = []
    for link in links:  # validation (density, world size, schemes) is train's
        extra = [] if link == LOOPBACK else ["--bandwidth", link] + (
            ["--latency", b.latency] if b.latency is not None else [])
        specs.append(train.parse_args(
            targs + extra, parser=train.build_parser("python -m gradsync bench schemes")))
    return specs, links, b


def _over(row: dict | None, key: str, base: dict | None) -> float | None:
    """``row[key]`` over ``base``'s samples/s; None when either is missing or not a number."""
    v = row.get(key) if row else None
    if v is None or base is None or not base["samples_per_s"] or v != v:  # v != v: NaN
        return None
    return v / base["samples_per_s"]


def _mb(v: float | None) -> float | None:
    """Bytes as MB; None for None or NaN."""
    return None if v is None or v != v else v / 1e6


def crossover(rows: list[dict], links: list[str]) -> dict:
    """Speed-up over DDP per scheme and link, and per link ``auto`` against DDP and against the
    best fixed scheme (the fastest other scheme of that link's run)."""
    table: dict[str, dict[str, float | None]] = {}
    best: dict[str, dict] = {}
    for link in links:
        mine = [r for r in rows if r["link"] == link]
        for r in mine:
            table.setdefault(r["scheme"], {})[link] = r["speedup_vs_ddp"]
        fixed = [r for r in mine if r["scheme"] != "auto"]
        auto_row = next((r for r in mine if r["scheme"] == "auto"), None)
        ddp_row = next((r for r in mine if r["scheme"] == "ddp"), None)
        top = max(fixed, key=lambda r: r["samples_per_s"], default=None)
        best[link] = {
            "best_fixed": top["scheme"] if top else None,
            "best_fixed_samples_per_s": top["samples_per_s"] if top else None,
            "auto_vs_ddp": (auto_row["samples_per_s"] / ddp_row["samples_per_s"]
                            if auto_row and ddp_row else None),
            "auto_vs_best_fixed": (auto_row["samples_per_s"] / top["samples_per_s"]
                                   if auto_row and top else None),
            # after auto's one-time probing of its runners-up (what a long run sees)
            "auto_probing_steps": auto_row.get("probing_steps") if auto_row else None,
            "auto_settled_mb_per_step": _mb(auto_row.get("settled_bytes_per_step")
                                            if auto_row else None),
            "auto_settled_vs_ddp": _over(auto_row, "settled_samples_per_s", ddp_row),
            "auto_settled_vs_best_fixed": _over(auto_row, "settled_samples_per_s", top),
        }
    return {"links": links, "rate_bps": {k: link_rate(k) for k in links},
            "speedup_vs_ddp": table, "auto": best}


def crossover_over_repeats(rows: list[dict], links: list[str]) -> dict:
    """:func:`crossover` of each repeat's rows (``row["repeat"]``), then per figure the median
    over the repeats and its range ``[min, max]``: the ratios are same-run ones, so a load that
    drifts between jobs moves a repeat's ratios less than its times, and alternating the scheme
    order puts the drift on both ends alike. ``best_fixed`` is the scheme fastest in most
    repeats (ties: the first in the rows)."""
    reps = sorted({r["repeat"] for r in rows})
    each = [crossover([r for r in rows if r["repeat"] == k], links) for k in reps]

    def agg(values: list) -> tuple[float | None, list[float] | None]:
        xs = [v for v in values if v is not None and v == v]
        return ((statistics.median(xs), [min(xs), max(xs)]) if xs else (None, None))

    table: dict[str, dict[str, float | None]] = {}
    spread: dict[str, dict[str, list[float] | None]] = {}
    for scheme in each[0]["speedup_vs_ddp"]:
        for link in links:
            mid, rng = agg([c["speedup_vs_ddp"].get(scheme, {}).get(link) for c in each])
            table.setdefault(scheme, {})[link] = mid
            spread.setdefault(scheme, {})[link] = rng
    best: dict[str, dict] = {}
    for link in links:
        names = [c["auto"][link]["best_fixed"] for c in each]
        order = [r["scheme"] for r in rows if r["link"] == link]
        fig: dict[str, Any] = {"best_fixed": max(
            dict.fromkeys(n for n in names if n), default=None,
            key=lambda n: (names.count(n), -order.index(n)))}
        for key in ("best_fixed_samples_per_s", "auto_vs_ddp", "auto_vs_best_fixed",
                    "auto_probing_steps", "auto_settled_vs_ddp", "auto_settled_vs_best_fixed",
                    "auto_settled_mb_per_step"):
            fig[key], fig[key + "_range"] = agg([c["auto"][link][key] for c in each])
        best[link] = fig
    return {"links": links, "rate_bps": {k: link_rate(k) for k in links},
            "speedup_vs_ddp": table, "speedup_range": spread, "auto": best,
            "repeats": len(reps), "per_repeat": each}


def _plot_crossover(cross: dict, title: str):
    def plot(ax) -> None:
        links = sorted(cross["links"], key=lambda k: cross["rate_bps"][k])  # slow → fast
        import matplotlib

        x = list(range(len(links)))
        colors = matplotlib.colormaps["tab20"].colors
        for i, (scheme, by_link) in enumerate(cross["speedup_vs_ddp"].items()):
            ys = [by_link.get(k) for k in links]
            ys = [y if y is not None else float("nan") for y in ys]
            style = ({"color": "black", "linewidth": 2.5, "marker": "o", "zorder": 3}
                     if scheme == "auto" else
                     {"color": colors[i % len(colors)], "linewidth": 1, "alpha": 0.9,
                      "marker": "os^vD<>"[i % 7], "markersize": 4,
                      "linestyle": ("-", "--", ":")[(i // len(colors)) % 3]})
            ax.plot(x, ys, label=scheme, **style)
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
        ax.set_xticks(x, links)
        ax.set_xlabel("link rate per rank (slow → fast)")
        ax.set_ylabel("speed-up over DDP (samples/s ratio)")
        ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%gx"))
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=6, ncol=2)

    return plot


def _plot(rows: list[dict], title: str, several: bool):
    def plot(ax) -> None:
        names = [(f"{r['scheme']} @ {r['link']}" if several else r["scheme"])
                 + (f" #{r['repeat'] + 1}" if "repeat" in r else "") for r in rows]
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
        ax.set_xticks(list(x), names, rotation=45 if not several else 90, ha="right",
                      fontsize=8 if not several else 5)
        ax.set_ylabel("ms per step (median)")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=8)

    return plot


def _ratio(v: float | None) -> str:
    return f"{v:.2f}x" if v else "-"


def _run_rows(runs: list[dict], order: tuple[str, ...], link: str,
              repeat: int | None) -> list[dict[str, Any]]:
    """The rows of one job (``train.summarize``'s ``runs`` on ``link``), in the schemes'
    ``order``; with ``repeat`` (several repeats) each row says which."""
    rows = []
    for r in sorted(runs, key=lambda r: order.index(r["scheme"])):
        s = r["summary"]
        rows.append({
            "link": link, "scheme": s["scheme"], "samples_per_s": s["samples_per_s"],
            "speedup_vs_ddp": s["speedup_vs_ddp"], "step_ms": 1e3 * s["step_s"],
            "backward_ms": 1e3 * s["backward_s"], "sparsify_ms": 1e3 * s["sparsify_s"],
            "comm_ms": 1e3 * s["comm_s"], "exposed_ms": 1e3 * s["wait_s"],
            "cpu_ms": 1e3 * s["cpu_s"], "bytes_per_step": s["bytes_per_step"],
            "missing_rate": s["missing_rate"],
            "final_loss": s["final_loss"], "measured_steps": s["measured_steps"],
            "probing_steps": s["probing_steps"],
            "settled_samples_per_s": s["settled_samples_per_s"],
            "settled_bytes_per_step": s["settled_bytes_per_step"],
        })
        if repeat is not None:
            rows[-1]["repeat"] = repeat
    return rows


def _print_run(rows: list[dict[str, Any]], title: str) -> None:
    """One job's table: the Fig. 13 breakdown beside throughput, bytes and missing rate."""
    cols = ["scheme", "samples/s", "vs ddp", "step ms", "backward ms", "sparsify ms",
            "comm ms", "exposed ms", "cpu ms", "MB/step", "missing %", "final loss"]
    print_table(title, cols, [[
        r["scheme"], r["samples_per_s"], _ratio(r["speedup_vs_ddp"]),
        r["step_ms"], r["backward_ms"], r["sparsify_ms"], r["comm_ms"],
        r["exposed_ms"], r["cpu_ms"], r["bytes_per_step"] / 1e6,
        100 * r["missing_rate"], r["final_loss"]] for r in rows])


def _print_crossover(cross: dict, title: str, repeats: int) -> None:
    """The crossover's tables: speed-up over DDP per scheme and link, then (where ``auto``
    ran) ``auto`` against DDP and the best fixed scheme; with ``repeats`` > 1 each figure is
    a median with its range."""
    links = cross["links"]
    rng = cross.get("speedup_range", {})

    def cell(v: float | None, span: list[float] | None = None) -> str:
        return _ratio(v) + (f" [{span[0]:.2f}–{span[1]:.2f}]" if span else "")

    print_table(title, ["scheme", *links], [
        [scheme, *(cell(by.get(k), rng.get(scheme, {}).get(k)) for k in links)]
        for scheme, by in cross["speedup_vs_ddp"].items()])
    if any(v["auto_vs_ddp"] is not None for v in cross["auto"].values()):
        print_table("auto against DDP and the best fixed scheme (samples/s ratios, same run; "
                    "settled: after auto's probing steps)"
                    + (f"; median of {repeats} runs [range]" if repeats > 1 else ""),
                    ["link", "auto/ddp", "best fixed", "auto/best", "probing steps",
                     "settled/ddp", "settled/best", "settled MB/step"],
                    [[k, cell(v["auto_vs_ddp"], v.get("auto_vs_ddp_range")),
                      v["best_fixed"] or "-",
                      cell(v["auto_vs_best_fixed"], v.get("auto_vs_best_fixed_range")),
                      v["auto_probing_steps"],
                      cell(v["auto_settled_vs_ddp"], v.get("auto_settled_vs_ddp_range")),
                      cell(v["auto_settled_vs_best_fixed"],
                           v.get("auto_settled_vs_best_fixed_range")),
                      "-" if v["auto_settled_mb_per_step"] is None
                      else f"{v['auto_settled_mb_per_step']:.4g}"]
                     for k, v in cross["auto"].items()])


def main(argv: list[str] | None = None) -> int:
    from gradsync.apps import train
    from gradsync.testing import DistributedError, DistributedTimeout

    specs, links, b = _parse(argv)
    specs = [train.resolve_data(specs[0])] + [
        train.resolve_data(s, quiet=True) for s in specs[1:]]
    spec = specs[0]
    print(f"bench schemes: {spec.model} on {spec.data}, P={spec.world_size}, {spec.steps} steps × "
          f"{spec.batch_size} per rank and scheme, density {spec.density} ({spec.sparsifier}), "
          f"{len(spec.schemes)} schemes, links {', '.join(links)}", flush=True)
    t0 = time.perf_counter()
    rows, all_runs, descr, ranks = [], {}, {}, 0
    n_rep = b.repeats
    for rep in range(n_rep):
        for name, base in zip(links, specs):
            # every other repeat runs the schemes in reverse order: drift in the machine's
            # speed during a job then falls on the first and the last schemes alike
            sp = base if rep % 2 == 0 else dataclasses.replace(
                base, schemes=tuple(reversed(base.schemes)))
            try:
                results, link = train.launch(sp)
            except (DistributedError, DistributedTimeout) as e:
                print(f"bench schemes failed on {name}: {e}")
                return 1
            descr[name] = link
            ranks = len(results)
            runs = train.summarize(results, sp.warmup_steps)
            if n_rep == 1:
                all_runs[name] = runs
            else:
                all_runs.setdefault(name, []).append(runs)
            mine = _run_rows(runs, base.schemes, name, rep if n_rep > 1 else None)
            _print_run(mine, f"bench schemes — {spec.model}, P={spec.world_size}, "
                       f"{link['link']}, density {spec.density}, {spec.steps} steps"
                       + (f", run {rep + 1}/{n_rep} ({'reversed' if rep % 2 else 'in'} order)"
                          if n_rep > 1 else ""))
            rows += mine
    wall = time.perf_counter() - t0
    cross = crossover(rows, links) if n_rep == 1 else crossover_over_repeats(rows, links)
    ctitle = (f"crossover — {spec.model}, P={spec.world_size}, density {spec.density}: "
              f"speed-up over DDP" + (f", median of {n_rep} runs [range]" if n_rep > 1 else ""))
    _print_crossover(cross, ctitle, n_rep)
    one = len(links) == 1
    config = spec.config(ranks)
    config["bandwidth"] = links if not one else config["bandwidth"]
    config["repeats"] = n_rep
    meta = {"config": config, "links": links,
            "link": descr[links[0]] if one else descr, "wall_s": wall,
            "environment": train.environment("local", "gloo", "cpu", descr[links[0]]),
            "quick": b.quick, "runs": all_runs[links[0]] if one else all_runs,
            "crossover": cross,
            "notes": "times: medians over the steps after warmup_steps+1; samples/s global; "
                     "bytes per rank per step, ring accounting at the torch.distributed call"}
    title = (f"bench schemes — {spec.model}, P={spec.world_size}, "
             f"{descr[links[0]]['link'] if one else ', '.join(links)}, "
             f"density {spec.density}, {spec.steps} steps")
    jpath, ppath = write_outputs("schemes", rows, b.out,
                                 plot=_plot(rows, title, not one or n_rep > 1),
                                 meta=meta)
    crows = [{"scheme": sc, **{k: by.get(k) for k in links}}
             for sc, by in cross["speedup_vs_ddp"].items()]
    cj, cp = write_outputs("crossover", crows, b.out, plot=_plot_crossover(cross, ctitle),
                           meta={"crossover": cross, "model": spec.model,
                                 "world_size": spec.world_size, "density": spec.density,
                                 "steps": spec.steps, "links": descr})
    print_written(jpath, ppath, cj, cp, lead=f"bench schemes: {wall:.0f} s; ")
    return 0
