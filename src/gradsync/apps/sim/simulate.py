"""``python -m gradsync simulate``: predict iteration time at large P from a measured cost model.

A **planning tool, not a distributed runtime**: nothing is sent anywhere. One worker's compute
is measured (SSFusion §IV-A: T_b^l per tensor, the sparsification fit, plus the forward pass and
the optimizer step), the network is the one you plan for (α = ``--latency``, β = 1/
``--bandwidth``), and each scheme's synchronization is costed step by step:

* fusion schemes (``dense``, ``dense_ovlp``, ``per_tensor``, ``multi_tensor``/``omgs``,
  ``cupcake``, ``ssfusion``, ``ssfusion_o``, ``ssfusion_oi``): the plan of
  :func:`gradsync.schedule.make_plan` for a cost model at P ranks and the timeline of
  :func:`gradsync.schedule.timeline` (WFBP overlap, offload worker, SSFusion-I split), whose
  buffers cost Eq. 4 (ring all-reduce) and Eq. 3 (ring all-gather of COO entries);
* one-buffer sparse schemes (``topka``, ``gaussiank``, ``topkdsa``, ``gtopk``, ``oktopk``,
  ``densestream``): the whole gradient is sparsified once after the backward and reduced by the
  collective's step-by-step pattern (:mod:`gradsync.apps.sim.patterns`, Ok-Topk Table 1 /
  DenseStream Eq. 4–6), including TopkDSA's and DenseStream's fill-in: the union density of m
  ranks' selections is ``u(m) = 1 − (1 − d)^(m^γ)`` with ``--union-gamma`` γ (1 = independent
  positions, the stated default and the pessimistic end; 0 = full overlap; ``--validate``
  measures γ on the model's real top-k selections across ranks).

Iteration = forward + (backward, sparsification and exposed communication from the timeline) +
optimizer step. The breakdown columns say where the time goes.

``--validate`` runs the same model with :class:`gradsync.engine.GradSync` on P = 2, 4, 8 ranks
over tbf-shaped links (:func:`gradsync.testing.netem.run_shaped`, root; loopback otherwise, and the
output says so), profiles the cost model *inside* that run (every rank at once, so the backward
times include the contention of P ranks sharing this machine's cores), predicts, and tabulates
prediction vs measurement (:mod:`gradsync.apps.sim.validate`).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gradsync.apps.sim import patterns
from gradsync.schedule import SCHEMES, entries, make_plan
from gradsync.schedule import simulate as timeline_of
from gradsync.schedule.costmodel import AffineFit, AlphaBeta, CostModel

__all__ = ["FUSION_SCHEMES", "ONE_BUFFER", "Network", "load_table", "main", "predict",
           "profile_model"]

ONE_BUFFER = {"topka": "topka", "gaussiank": "topka", "topkdsa": "topkdsa", "gtopk": "gtopk",
              "oktopk": "oktopk", "densestream": "densestream"}
FUSION_SCHEMES = tuple(s for s in SCHEMES if s not in ONE_BUFFER)
NOTE = ("planning tool, not a distributed runtime: times are predictions of the α-β model "
        "from one worker's measured compute, not measurements")


class Network:
    """The network planned for: α seconds per message, β seconds per byte."""

    def __init__(self, alpha: float, beta: float) -> None:
        if not (math.isfinite(alpha) and alpha >= 0):
            raise ValueError(f"latency α must be a finite number >= 0 s, got {alpha!r}")
        if not (math.isfinite(beta) and beta > 0):
            raise ValueError(f"β must be a finite number > 0 s/B, got {beta!r}")
        self.alpha, self.beta = float(alpha), float(beta)

    @classmethod
    def parse(cls, bandwidth: str, latency: str) -> Network:
        from gradsync.testing.netem import parse_bandwidth, parse_time

        return cls(parse_time(latency), 8.0 / parse_bandwidth(bandwidth))


def _at(base: CostModel, P: int, net: Network) -> CostModel:
    """``base``'s compute with P ranks on ``net`` (Eq. 3 / Eq. 4 with the planned α, β)."""
    ab = AlphaBeta(net.alpha, net.beta)
    return CostModel(P=P, order=list(base.order), numel=dict(base.numel),
                     elem_bytes=base.elem_bytes, backward=dict(base.backward),
                     sparsify=base.sparsify, offload=base.offload, allreduce=ab, allgather=ab,
                     info=dict(base.info))


def predict(
    scheme: str, base: CostModel, P: int, net: Network, density: float, *,
    union_gamma: float = 1.0, forward_s: float = 0.0, step_s: float = 0.0,
    densestream_ratio: float | None = None, bucket_bytes: int = 25 * 2**20,
    min_density: float = 0.001,
) -> dict[str, Any]:
    """One row: predicted iteration time of ``scheme`` at P ranks and its breakdown."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; available: {', '.join(SCHEMES)}")
    if isinstance(P, bool) or int(P) != P or P < 1:
        raise ValueError(f"P must be a positive integer, got {P!r}")
    if not 0.0 < density <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {density!r}")
    if not 0.0 <= union_gamma <= 1.0:
        raise ValueError(f"union_gamma must be in [0, 1], got {union_gamma!r}")
    cost = _at(base, int(P), net)
    row: dict[str, Any] = {"scheme": scheme, "P": int(P)}
    if scheme in ONE_BUFFER:
        n = sum(cost.numel[t] for t in cost.order)
        k = entries(n, density)
        d = k / n if n else 0.0

        def union(m: float) -> float:
            return patterns.union_density(d, m, union_gamma)

        coll = ONE_BUFFER[scheme]
        steps = patterns.pattern(coll, cost.P, n, k, union=union, value_bytes=cost.elem_bytes,
                                 densestream_ratio=densestream_ratio)
        backward = sum(cost.backward[t] for t in cost.order)
        sparsify = cost.t_sparsify(n)
        comm = patterns.comm_time(steps, net.alpha, net.beta)
        row.update(collective=coll, backward_s=backward, sparsify_s=sparsify, comm_s=comm,
                   exposed_comm_s=comm, sync_end_s=backward + sparsify + comm,
                   volume_bytes=patterns.volume(steps),
                   messages=sum(s.messages for s in steps), buffers=1,
                   union_density=union(cost.P))
    else:
        plan = make_plan(scheme, list(cost.order), cost.numel, density, cost,
                         elem_bytes=cost.elem_bytes, bucket_bytes=bucket_bytes,
                         min_density=min_density)
        tl = timeline_of(plan, cost)
        p = cost.P
        vol = sum(b["ar_bytes"] * 2 * (p - 1) / p + b["ag_bytes"] * (p - 1) for b in tl.buffers)
        msgs = sum(2 * (p - 1) * ("ar_start" in b) + (p - 1) * ("ag_start" in b)
                   for b in tl.buffers)
        row.update(collective="allreduce" if scheme.startswith("dense") else "allreduce+topka",
                   backward_s=tl.backward, sparsify_s=tl.sparsify, comm_s=tl.comm,
                   exposed_comm_s=tl.exposed_comm, sync_end_s=tl.iteration, volume_bytes=vol,
                   messages=msgs, buffers=len(plan.buffers), union_density=None)
    row["forward_s"] = forward_s
    row["step_s"] = step_s
    row["iteration_s"] = forward_s + row["sync_end_s"] + step_s
    return row


# ---------------------------------------------------------------------------------------------
# Cost model sources
# ---------------------------------------------------------------------------------------------
def load_table(path: str | Path) -> tuple[CostModel, float, float]:
    """A per-layer table: CSV ``name,numel,backward_s`` in backward order, plus optional
    ``# key=value`` lines for ``elem_bytes`` (4), ``sparsify_a``/``sparsify_b`` (s, s/element;
    0), ``offload_a``/``offload_b`` (default: the sparsify fit), ``forward_s``, ``step_s`` (0).
    Returns (cost model with P = 1, forward_s, step_s)."""
    text = Path(path).read_text()
    meta: dict[str, float] = {}
    body = []
    for ln, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if not s:
            continue
        if s.startswith("#"):
            for part in s[1:].replace(",", " ").split():
                if "=" in part:
                    key, val = part.split("=", 1)
                    try:
                        meta[key.strip()] = float(val)
                    except ValueError:
                        raise ValueError(f"{path}:{ln}: {key}={val!r} is not a number") from None
            continue
        body.append(s)
    rows = list(csv.DictReader(body))
    if not rows or not {"name", "numel", "backward_s"} <= set(rows[0]):
        raise ValueError(f"{path}: expected a CSV header 'name,numel,backward_s' and >= 1 row")
    order, numel, backward = [], {}, {}
    for i, r in enumerate(rows):
        try:
            n, b = int(r["numel"]), float(r["backward_s"])
        except (TypeError, ValueError):
            raise ValueError(f"{path}: row {i + 1} has a bad numel or backward_s: {r}") from None
        order.append(r["name"])
        numel[r["name"]], backward[r["name"]] = n, b
    sp = AffineFit(meta.get("sparsify_a", 0.0), meta.get("sparsify_b", 0.0))
    off = AffineFit(meta.get("offload_a", sp.a), meta.get("offload_b", sp.b))
    cost = CostModel(P=1, order=order, numel=numel, elem_bytes=int(meta.get("elem_bytes", 4)),
                     backward=backward, sparsify=sp, offload=off,
                     allreduce=AlphaBeta(0.0, 0.0), allgather=AlphaBeta(0.0, 0.0),
                     info={"source": str(path)})
    return cost, meta.get("forward_s", 0.0), meta.get("step_s", 0.0)


def _median_s(fn, repeats: int) -> float:
    fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def profile_model(name: str, batch: int, sparsifier: str, density: float, seed: int = 0,
                  repeats: int = 3, rank: int = 0) -> tuple[CostModel, float, float]:
    """Measure one worker here: T_b^l (``profile_backward``), the sparsifier fit
    (``profile_sparsifier``, sizes up to the whole model), the forward pass and an SGD step.
    Returns (cost model with P = 1, forward_s, step_s)."""
    import torch

    from gradsync import sparsify
    from gradsync.apps import models
    from gradsync.schedule import costmodel

    net, step = models.model_step(name, batch, seed, rank)
    order, numel, backward = costmodel.profile_backward(net, step, repeats=repeats)
    forward = _median_s(step, repeats)  # with autograd on, as in training
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    step().backward()
    step_s = _median_s(opt.step, repeats)
    net.zero_grad(set_to_none=True)
    n = sum(numel.values())
    sizes = sorted({s for s in (1 << 10, 1 << 14, 1 << 17, 1 << 20) if s < n} | {n})
    sp = sparsify.get(sparsifier, density=density, seed=seed)
    inline = costmodel.profile_sparsifier(sp, sizes=sizes, repeats=repeats)
    off = costmodel.profile_sparsifier(sp, sizes=sizes, repeats=repeats, offload=True)
    cost = CostModel(P=1, order=order, numel=numel, elem_bytes=4, backward=backward,
                     sparsify=inline, offload=off, allreduce=AlphaBeta(0.0, 0.0),
                     allgather=AlphaBeta(0.0, 0.0),
                     info={"model": name, "batch": batch, "sparsifier": sparsifier,
                           "density": density, "threads": torch.get_num_threads(),
                           "forward_s": forward, "step_s": step_s})
    return cost, forward, step_s


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------
def _int_list(s: str, what: str) -> list[int]:
    try:
        out = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what}: expected comma-separated integers, got {s!r}") from None
    if not out or any(x < 1 for x in out):
        raise ValueError(f"{what}: expected positive integers, got {s!r}")
    return sorted(set(out))


def _schemes(s: str) -> list[str]:
    out = [x.strip() for x in s.split(",") if x.strip()]
    bad = [x for x in out if x not in SCHEMES]
    if not out or bad:
        raise ValueError(f"--schemes: unknown {bad or s!r}; available: {', '.join(SCHEMES)}")
    return list(dict.fromkeys(out))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    from gradsync import sparsify
    from gradsync.apps import models

    p = argparse.ArgumentParser(
        prog="python -m gradsync simulate",
        description="Predict iteration time per scheme and P from a measured cost model and an "
        "α-β network (a planning tool, not a distributed runtime).")
    p.add_argument("--model", default="resnet18", choices=models.names())
    p.add_argument("--schemes", default="dense_ovlp,topka,oktopk,densestream,ssfusion_oi")
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--workers", default="8,16,32,64,128,256", help="P values, comma-separated")
    p.add_argument("--bandwidth", default="1gbit", help="per link and direction, tc units")
    p.add_argument("--latency", default="50us", help="α per message")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--cost-model", help="JSON written by `python -m gradsync profile`")
    src.add_argument("--table", help="per-layer CSV name,numel,backward_s (see load_table)")
    src.add_argument("--profile", action="store_true", help="profile the model here (default)")
    p.add_argument("--forward-s", type=float, default=None,
                   help="forward + data time per iteration (default: measured / from the file)")
    p.add_argument("--step-s", type=float, default=None, help="optimizer step time")
    p.add_argument("--sparsifier", default="dgc", choices=sparsify.names())
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--union-gamma", type=float, default=1.0,
                   help="union density u(m) = 1-(1-d)^(m^γ); 1 = independent, 0 = overlap")
    p.add_argument("--densestream-ratio", type=float, default=None,
                   help="DenseStream/COO size ratio (Table I); default: independent positions")
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-out/simulate")
    v = p.add_argument_group("validation (--validate)")
    v.add_argument("--validate", action="store_true",
                   help="measure GradSync on shaped links and compare with the prediction")
    v.add_argument("--validate-workers", default="2,4,8")
    v.add_argument("--steps", type=int, default=10, help="timed training steps per scheme")
    v.add_argument("--timeout", type=float, default=900.0)
    v.add_argument("--loopback", action="store_true", help="validate on loopback (no shaping)")
    a = p.parse_args(list(argv) if argv is not None else None)
    a.scheme_list = _schemes(a.schemes)
    a.worker_list = _int_list(a.workers, "--workers")
    a.validate_list = _int_list(a.validate_workers, "--validate-workers")
    if not 0.0 < a.density <= 1.0:
        raise ValueError(f"--density must be in (0, 1], got {a.density}")
    if not 0.0 <= a.union_gamma <= 1.0:
        raise ValueError(f"--union-gamma must be in [0, 1], got {a.union_gamma}")
    if a.densestream_ratio is not None and not a.densestream_ratio > 0:
        raise ValueError(f"--densestream-ratio must be > 0, got {a.densestream_ratio}")
    for name in ("batch", "repeats", "steps"):
        if getattr(a, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(a, name)}")
    for name in ("forward_s", "step_s"):
        x = getattr(a, name)
        if x is not None and not (math.isfinite(x) and x >= 0):
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {x}")
    if not (a.bucket_mb > 0 and math.isfinite(a.bucket_mb)):
        raise ValueError(f"--bucket-mb must be > 0, got {a.bucket_mb}")
    a.net = Network.parse(a.bandwidth, a.latency)
    return a


def _source(a: argparse.Namespace) -> tuple[CostModel, float, float, str]:
    if a.cost_model:
        try:
            d = json.loads(Path(a.cost_model).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"--cost-model {a.cost_model}: {e}") from None
        cost = CostModel.from_dict(d)
        fwd = float(cost.info.get("forward_s", 0.0))
        stp = float(cost.info.get("step_s", 0.0))
        src = f"cost model {a.cost_model}"
    elif a.table:
        cost, fwd, stp = load_table(a.table)
        src = f"table {a.table}"
    else:
        cost, fwd, stp = profile_model(a.model, a.batch, a.sparsifier, a.density, a.seed,
                                       a.repeats)
        src = f"profiled here: {a.model}, batch {a.batch}, {a.sparsifier}"
    if a.forward_s is not None:
        fwd = a.forward_s
    if a.step_s is not None:
        stp = a.step_s
    return cost, fwd, stp, src


def predict_all(a: argparse.Namespace, cost: CostModel, fwd: float, stp: float,
                workers: list[int]) -> list[dict[str, Any]]:
    rows = []
    for scheme in a.scheme_list:
        for P in workers:
            rows.append(predict(scheme, cost, P, a.net, a.density, union_gamma=a.union_gamma,
                                forward_s=fwd, step_s=stp,
                                densestream_ratio=a.densestream_ratio,
                                bucket_bytes=int(a.bucket_mb * 2**20)))
    return rows


def _plot_vs_p(rows: list[dict[str, Any]], title: str, measured: bool = False):
    def plot(ax) -> None:
        for scheme in dict.fromkeys(r["scheme"] for r in rows):
            rs = [r for r in rows if r["scheme"] == scheme]
            line = ax.plot([r["P"] for r in rs], [r["predicted_s" if measured else
                                                      "iteration_s"] for r in rs],
                           marker="o", label=f"{scheme}" + (" predicted" if measured else ""))
            if measured:
                ax.plot([r["P"] for r in rs], [r["measured_s"] for r in rs], marker="x",
                        linestyle="--", color=line[0].get_color(), label=f"{scheme} measured")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("workers P")
        ax.set_ylabel("iteration time (s)")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)

    return plot


def main(argv: Sequence[str] | None = None) -> int:
    from gradsync.apps.common import print_table, write_outputs

    a = parse_args(argv)
    if a.validate:
        from gradsync.apps.sim.validate import run_validation

        return run_validation(a)
    cost, fwd, stp, src = _source(a)
    rows = predict_all(a, cost, fwd, stp, a.worker_list)
    net = f"α={a.net.alpha * 1e6:.3g} us, bandwidth {a.bandwidth} (β={a.net.beta:.3g} s/B)"
    n = sum(cost.numel.values())
    print(f"NOTE: {NOTE}.")
    print(f"compute: {src}; n={n} elements in {len(cost.order)} tensors; "
          f"Σ T_b={sum(cost.backward.values()) * 1e3:.2f} ms, forward={fwd * 1e3:.2f} ms, "
          f"optimizer step={stp * 1e3:.2f} ms; network: {net}; density {a.density}; "
          f"union γ={a.union_gamma}")
    cols = ["scheme", "P", "iteration ms", "backward ms", "sparsify ms", "exposed comm ms",
            "comm ms", "MB/rank", "messages"]
    table = [[r["scheme"], r["P"], r["iteration_s"] * 1e3, r["backward_s"] * 1e3,
              r["sparsify_s"] * 1e3, r["exposed_comm_s"] * 1e3, r["comm_s"] * 1e3,
              r["volume_bytes"] / 1e6, round(r["messages"], 2)] for r in rows]
    print_table(f"simulate: {cost.info.get('model', a.model)} — predicted iteration time "
                "(planning tool)", cols, table)
    meta = {"note": NOTE, "source": src, "bandwidth": a.bandwidth, "latency": a.latency,
            "alpha_s": a.net.alpha, "beta_s_per_byte": a.net.beta, "density": a.density,
            "union_gamma": a.union_gamma, "densestream_ratio": a.densestream_ratio,
            "forward_s": fwd, "step_s": stp, "cost_model": cost.to_dict()}
    j, png = write_outputs("simulate", rows, a.out, meta=meta, plot=_plot_vs_p(
        rows, f"{cost.info.get('model', a.model)}, d={a.density}, {a.bandwidth}, "
        f"α={a.latency} (predicted)"))
    print(f"wrote {j} and {png}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    import sys

    sys.exit(main())
