"""Every collective on real gloo ranks: time, bytes per rank, and bytes over the O(k) bound.

``python -m gradsync bench collectives --world-size 4 --numel 4e6 --density 0.01,0.05,0.1
[--bandwidth 100mbit] [--collectives dense,topka,…] [--repeats 5] [--quick]``

Each rank's input is a seeded, heavy-tailed, gradient-like tensor: a log-normal magnitude
shared by all ranks times (a shared + a per-rank Gaussian), so the ranks' top-k selections
differ but overlap partially (the union of the P selections is reported). Every rank passes its
exact top-k at each density to each collective: one warm-up call, then ``--repeats`` timed calls,
each started after a barrier. Reported per collective and density:

* time: per repetition the maximum over ranks (a collective is done when its slowest rank is),
  then the median over repetitions; and the ratio to ``dense`` in the same run. On a shared
  machine the load drifts between the runs of two collectives, so each repetition is also
  followed, in the same rank processes, by a dense all-reduce of the same selection: the
  column "× dense (interleaved)" is the median over repetitions of the collective's time over
  that dense time (both maxima over ranks);
* CPU: each call's process CPU on each rank (``time.process_time``, every thread), the busiest
  rank's per repetition; ``cpu ms`` is its median, and "cpu × dense (interleaved)" the median
  over repetitions of that over the busiest rank's CPU for the dense all-reduce right after.
  With more ranks than cores a call is CPU-bound and this ratio follows the wall ratio
  (P = 4 on 2 cores, n = 4e6, three runs: DenseStream at 10 % 3.05–3.32 against 2.69–3.16 in
  wall time, SparDL 2.64–3.04 against 2.73–2.91), telling where the time goes;
* ``--threads``: torch intra-op threads per rank (default 1: P ranks share the machine's cores,
  and P × the default threads would oversubscribe them);
* bytes sent per rank, mean and max over ranks, from ``SyncResult.stats`` (counted by ``Comm``);
* those bytes over the Ok-Topk Theorem 3.1 lower bound (§3): no O(k) sparse allreduce sends less
  than 2k(P−1)/P entries, here priced at (index + value) bytes, index int32 on the wire;
* the relative error of rank 0's ``dense`` against the sum of the selections computed in this
  process with plain torch (≈ 0 for exact collectives; Ok-Topk and gTop-k drop entries by design).

Links: loopback (default) or, with ``--bandwidth``, per-rank tbf-shaped links from
:mod:`gradsync.testing.netem` (root only; otherwise it says so and runs on loopback).
``--latency`` is tbf's queueing bound, not a propagation delay: netem is unavailable, so delay
is not emulated.
Each collective runs in its own set of rank processes, so one that fails or hangs is reported
in its row and the others still run.
"""

from __future__ import annotations

import argparse
import importlib
import math
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from gradsync import collectives
from gradsync.apps.common import add_common_args, print_table, write_outputs
from gradsync.formats.wire import wire_index_bytes
from gradsync.sparsify import get as get_sparsifier
from gradsync.sparsify import target_k
from gradsync.testing import DistributedError, DistributedTimeout, netem, run_distributed

NAME = "collectives"
# Collectives added alongside this benchmark; imported here when present so the bench covers
# them even before ``gradsync.collectives`` imports them itself.
OPTIONAL = ("topkdsa", "gtopk", "oktopk", "densestream", "lhc")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SIGMA, SHARED = 1.0, 1.0  # log-normal spread of the magnitudes; weight of the shared component


def import_collectives() -> list[str]:
    """Import every optional collective module that exists; return one note per missing one."""
    notes = []
    for mod in OPTIONAL:
        try:
            importlib.import_module(f"gradsync.collectives.{mod}")
        except ModuleNotFoundError as e:
            if e.name != f"gradsync.collectives.{mod}":
                notes.append(f"{mod}: import failed ({e})")
            else:
                notes.append(f"{mod}: not available yet")
        except Exception as e:  # a module mid-edit must not stop the other collectives
            notes.append(f"{mod}: import failed ({type(e).__name__}: {e})")
    return notes


def gradient(numel: int, rank: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rank ``rank``'s gradient-like tensor: exp(σ·z_shared) · (w·g_shared + g_rank)."""
    shared = torch.Generator().manual_seed(seed)
    scale = torch.exp(SIGMA * torch.randn(numel, generator=shared))
    common = torch.randn(numel, generator=shared)
    own = torch.randn(numel, generator=torch.Generator().manual_seed(seed + 1 + rank))
    return (scale * (SHARED * common + own)).to(dtype)


def build(name: str, density: float) -> collectives.Collective:
    """``collectives.get(name, density=…)`` for those that take a density, else ``get(name)``."""
    try:
        return collectives.get(name, density=density)
    except TypeError:  # the constructor has no ``density`` (dense, topka, lhc, …)
        return collectives.get(name)


def _rank(rank: int, world_size: int, name: str, densities: list[float], numel: int, seed: int,
          dtype: str, warmup: int, repeats: int, threads: int = 1) -> list[dict[str, Any]]:
    """Run collective ``name`` at every density; return timings, traffic and rank 0's sums.

    After each call of a collective other than ``dense`` a dense all-reduce of the same
    selection is timed in the same processes (``dense_times``)."""
    torch.set_num_threads(max(1, threads))
    import_collectives()  # a fresh rank process has only what gradsync.collectives imports
    x = gradient(numel, rank, seed, DTYPES[dtype])
    out = []
    for density in densities:
        sel = get_sparsifier("topk", density=density).select(x)
        coll = build(name, density)
        ref = collectives.get("dense") if name != "dense" else None
        times, dense_times, sent, recv, msgs = [], [], [], [], []
        cpus, dense_cpus = [], []  # process CPU per call (every thread of the rank)
        info: dict[str, Any] = {}
        for step in range(warmup + repeats):
            dist.barrier()
            c0, t0 = time.process_time(), time.perf_counter()
            res = coll(sel, step=step)
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            if step >= warmup:
                times.append(dt)
                cpus.append(dc)
                sent.append(res.stats.bytes_sent)
                recv.append(res.stats.bytes_recv)
                msgs.append(res.stats.messages)
                info = {k: v for k, v in res.info.items() if isinstance(v, bool | int | float)}
            if ref is not None:
                dist.barrier()
                c0, t0 = time.process_time(), time.perf_counter()
                ref(sel, step=step)
                if step >= warmup:
                    dense_times.append(time.perf_counter() - t0)
                    dense_cpus.append(time.process_time() - c0)
        out.append({
            "density": density, "k_local": len(sel), "times": times,
            "dense_times": dense_times or times,
            "cpus": cpus, "dense_cpus": dense_cpus or cpus,
            "bytes_sent": statistics.fmean(sent), "bytes_recv": statistics.fmean(recv),
            "messages": statistics.fmean(msgs), "info": info, "exact": bool(coll.exact),
            "dense": res.dense if rank == 0 else None,
        })
    return out


def reference(numel: int, world_size: int, density: float, seed: int, dtype: str
              ) -> tuple[torch.Tensor, int]:
    """Σ over ranks of each rank's top-k selection (float64), and the union's size."""
    total = torch.zeros(numel, dtype=torch.float64)
    union = torch.zeros(numel, dtype=torch.bool)
    k = target_k(numel, density)
    for r in range(world_size):
        x = gradient(numel, r, seed, DTYPES[dtype])
        idx = torch.topk(x.abs().float(), k, sorted=False).indices
        total[idx] += x[idx].double()
        union[idx] = True
    return total, int(union.sum())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m gradsync bench collectives",
                                description=__doc__.split("\n\n")[0])
    add_common_args(p, NAME)
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--numel", type=float, default=None, help="elements (default 4e6; --quick 1e5)")
    p.add_argument("--density", default="0.01,0.05,0.1", help="comma-separated densities")
    p.add_argument("--collectives", default=None,
                   help="comma-separated names (default: all registered)")
    p.add_argument("--bandwidth", default=None,
                   help="shape each rank's link with tc tbf, e.g. 100mbit (root; else loopback)")
    p.add_argument("--latency", default=None,
                   help="tbf queueing bound (e.g. 50ms); NOT a propagation delay (netem is "
                        "unavailable, so delay is not emulated)")
    p.add_argument("--burst", default=None, help="tbf bucket, e.g. 64kb (default: 4 ms, ≥32kb)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per collective run")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads per rank (1: the ranks share the cores)")
    p.add_argument("--quick", action="store_true", help="small defaults for a smoke run")
    a = p.parse_args(argv)
    if a.numel is None:
        a.numel = 1e5 if a.quick else 4e6
    if a.quick:
        a.repeats = min(a.repeats, 2)
    if a.numel != int(a.numel) or a.numel < 1:
        p.error(f"--numel must be a positive integer, got {a.numel:g}")
    a.numel = int(a.numel)
    try:
        a.densities = [float(d) for d in a.density.split(",") if d.strip()]
    except ValueError:
        p.error(f"--density: cannot parse {a.density!r}")
    if not a.densities or not all(0 < d <= 1 for d in a.densities):
        p.error(f"--density values must be in (0, 1], got {a.density!r}")
    if a.world_size < 1 or a.repeats < 1 or a.warmup < 0 or a.threads < 1:
        p.error("--world-size, --repeats and --threads must be >= 1, --warmup >= 0")
    if a.bandwidth is not None:
        try:
            a.bandwidth_bps = netem.parse_bandwidth(a.bandwidth)
        except ValueError as e:
            p.error(f"--bandwidth: {e}")
    elif a.latency is not None or a.burst is not None:
        p.error("--latency and --burst shape links: give --bandwidth too")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    notes = import_collectives()
    names = collectives.names() if a.collectives is None else [
        n.strip() for n in a.collectives.split(",") if n.strip()]
    unknown = [n for n in names if n not in collectives.names()]
    if unknown:
        notes += [f"{n}: not registered (available: {', '.join(collectives.names())})"
                  for n in unknown]
        names = [n for n in names if n not in unknown]
    for note in notes:
        print(f"note: {note}")
    p, numel = a.world_size, a.numel
    vb = torch.empty(0, dtype=DTYPES[a.dtype]).element_size()
    ib = wire_index_bytes(numel)

    refs = {d: reference(numel, p, d, a.seed, a.dtype) for d in a.densities}
    run_args = (a.densities, numel, a.seed, a.dtype, a.warmup, a.repeats, a.threads)

    shaped, link = False, "loopback"
    world_cm = None
    if a.bandwidth is not None:
        reason = netem.netem_available()
        if reason is None:
            try:
                world_cm = netem.shaped_world(p, a.bandwidth_bps, latency=a.latency,
                                              burst=a.burst)
                world = world_cm.__enter__()
                shaped, link = True, f"tbf {a.bandwidth} per rank and direction"
            except netem.NetemUnavailable as e:
                world_cm, reason = None, str(e)
        if not shaped:
            print(f"note: no shaped links ({reason}); running on loopback")
        if a.latency is not None:
            print(f"note: --latency {a.latency} is tbf's queueing bound; no propagation delay "
                  "is added (netem is unavailable)")

    results: dict[str, Any] = {}
    try:
        for name in names:
            t0 = time.perf_counter()
            try:
                if shaped:
                    results[name] = world.run(_rank, name, *run_args, timeout=a.timeout)
                else:
                    results[name] = run_distributed(_rank, p, name, *run_args,
                                                    timeout=a.timeout)
            except (DistributedError, DistributedTimeout) as e:
                lines = str(getattr(e, "remote_traceback", e)).strip().splitlines()
                where = f"rank {e.rank}: " if isinstance(e, DistributedError) else ""
                results[name] = where + (lines[-1] if lines else type(e).__name__)
                print(f"note: {name} failed: {results[name]}")
            print(f"  {name}: {time.perf_counter() - t0:.1f}s", flush=True)
    finally:
        if world_cm is not None:
            world_cm.__exit__(None, None, None)

    rows = _rows(results, a, refs, vb, ib)
    _table(rows, a, link)
    meta = {"world_size": p, "numel": numel, "densities": a.densities, "dtype": a.dtype,
            "repeats": a.repeats, "warmup": a.warmup, "seed": a.seed, "link": link,
            "threads_per_rank": a.threads,
            "shaped": shaped, "bandwidth": a.bandwidth,
            "bandwidth_bps": getattr(a, "bandwidth_bps", None),
            "tbf_latency": a.latency, "propagation_delay": "not emulated",
            "index_bytes": ib, "value_bytes": vb, "notes": notes,
            "lower_bound": "Ok-Topk Theorem 3.1: 2k(P-1)/P entries x (index+value bytes)",
            "union_over_k": {str(d): refs[d][1] / max(1, target_k(numel, d))
                             for d in a.densities}}
    jpath, ppath = write_outputs(NAME, rows, a.out, plot=lambda ax: _plot(ax, rows), meta=meta)
    print(f"wrote {jpath}" + (f" and {ppath}" if ppath else ""))
    return 0


def _rows(results: dict[str, Any], a: argparse.Namespace, refs: dict, vb: int, ib: int
          ) -> list[dict[str, Any]]:
    p, numel = a.world_size, a.numel
    rows = []
    for name, res in results.items():
        for j, density in enumerate(a.densities):
            k = target_k(numel, density)
            bound = 2 * k * (p - 1) / p * (ib + vb)
            row: dict[str, Any] = {"collective": name, "density": density, "k": k,
                                   "world_size": p, "numel": numel,
                                   "lower_bound_bytes": bound}
            if isinstance(res, str):
                row["error"] = res
                rows.append(row)
                continue
            per = [r[j] for r in res]
            reps = [max(t) for t in zip(*(q["times"] for q in per))]
            dense_reps = [max(t) for t in zip(*(q["dense_times"] for q in per))]
            cpu_reps = [max(c) for c in zip(*(q["cpus"] for q in per))]
            dense_cpu_reps = [max(c) for c in zip(*(q["dense_cpus"] for q in per))]
            sent = [q["bytes_sent"] for q in per]
            ref, union = refs[density]
            d0 = per[0]["dense"].double()
            err = float((d0 - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
            row.update({
                "time_s": statistics.median(reps), "times_s": reps,
                "dense_interleaved_times_s": dense_reps,
                "time_over_dense_interleaved": statistics.median(
                    t / d for t, d in zip(reps, dense_reps)),
                "cpu_s": statistics.median(cpu_reps), "cpus_s": cpu_reps,
                "dense_interleaved_cpus_s": dense_cpu_reps,
                "cpu_over_dense_interleaved": statistics.median(
                    c / d for c, d in zip(cpu_reps, dense_cpu_reps) if d > 0)
                if any(d > 0 for d in dense_cpu_reps) else math.nan,
                "bytes_sent_mean": statistics.fmean(sent), "bytes_sent_max": max(sent),
                "bytes_recv_mean": statistics.fmean(q["bytes_recv"] for q in per),
                "messages_mean": statistics.fmean(q["messages"] for q in per),
                "sent_over_bound_mean": statistics.fmean(sent) / bound if bound else math.nan,
                "sent_over_bound_max": max(sent) / bound if bound else math.nan,
                "union": union, "exact": per[0]["exact"], "rel_err": err,
                "info": per[0]["info"],
            })
            rows.append(row)
    for row in rows:  # same-run ratio to dense at the same density
        base = next((r.get("time_s") for r in rows if r["collective"] == "dense"
                     and r["density"] == row["density"]), None)
        if base and "time_s" in row:
            row["time_over_dense"] = row["time_s"] / base
    return rows


def _table(rows: list[dict[str, Any]], a: argparse.Namespace, link: str) -> None:
    cols = ["collective", "density", "k", "time ms", "× dense", "× dense (interleaved)",
            "cpu ms", "cpu × dense (interleaved)", "sent MB mean", "sent MB max", "mean/LB",
            "max/LB", "rel err", "note"]
    out = []
    for r in rows:
        if "error" in r:
            out.append([r["collective"], r["density"], r["k"], *["-"] * 10, r["error"][:60]])
            continue
        # True boolean flags from SyncResult.info (e.g. lhc's lossy=True when peeling failed).
        flags = ", ".join(f"{k}={v}" for k, v in r["info"].items() if isinstance(v, bool) and v)
        out.append([r["collective"], r["density"], r["k"], 1e3 * r["time_s"],
                    r.get("time_over_dense", "-"), r["time_over_dense_interleaved"],
                    1e3 * r["cpu_s"], r["cpu_over_dense_interleaved"],
                    r["bytes_sent_mean"] / 1e6,
                    r["bytes_sent_max"] / 1e6, r["sent_over_bound_mean"],
                    r["sent_over_bound_max"], r["rel_err"],
                    ("exact" if r["exact"] else "lossy by design") + (f"; {flags}" if flags
                                                                     else "")])
    print_table(f"collectives: P={a.world_size}, n={a.numel:g}, {a.dtype}, {link}, "
                f"median of {a.repeats} (max over ranks); LB = 2k(P-1)/P x (4+value) bytes",
                cols, out)


def _plot(ax: Any, rows: list[dict[str, Any]]) -> None:
    ok = [r for r in rows if "time_s" in r]
    names = list(dict.fromkeys(r["collective"] for r in ok))
    dens = list(dict.fromkeys(r["density"] for r in ok))
    fig = ax.figure
    fig.set_size_inches(12, 4.5)
    grid = fig.add_gridspec(1, 2)
    ax.set_subplotspec(grid[0])
    ax2 = fig.add_subplot(grid[1])
    width = 0.8 / max(1, len(dens))
    for j, d in enumerate(dens):
        by = {r["collective"]: r for r in ok if r["density"] == d}
        xs = [i + (j - (len(dens) - 1) / 2) * width for i in range(len(names))]
        ax.bar(xs, [1e3 * by[n]["time_s"] if n in by else 0 for n in names], width,
               label=f"density {d:g}")
        ax2.bar(xs, [by[n]["sent_over_bound_mean"] if n in by else 0 for n in names], width,
                label=f"density {d:g}")
    for a_, label in ((ax, "median time (ms, max over ranks)"),
                      (ax2, "bytes sent per rank / Thm 3.1 bound")):
        a_.set_xticks(range(len(names)), names, rotation=30)
        a_.set_yscale("log")
        a_.set_ylabel(label)
        a_.legend(fontsize=8)
    ax2.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_title("time per collective")
    ax2.set_title("traffic relative to the O(k) lower bound")
