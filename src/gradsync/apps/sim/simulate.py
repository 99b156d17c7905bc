"""``python -m gradsync simulate``: predict iteration time at large P from a measured cost model.

A **planning tool, not a distributed runtime**: nothing is sent anywhere. One worker's compute
is measured (SSFusion §IV-A: T_b^l per tensor, the sparsification fit, plus the forward pass and
the optimizer step), the network is the one you plan for (α = ``--latency``, β = 1/
``--bandwidth``), and each scheme's synchronization is costed step by step:

* fusion schemes (every planner but ``single`` in :mod:`gradsync.schedule.schemes`: ``dense``,
  ``dense_ovlp``, ``per_tensor``, ``multi_tensor``/``omgs``, ``cupcake``, ``ssfusion``,
  ``ssfusion_o``, ``ssfusion_oi``): the plan of :func:`gradsync.schedule.make_plan` for a cost
  model at P ranks and its timeline (:func:`gradsync.schedule.simulate`: WFBP overlap, offload
  worker, SSFusion-I split), whose buffers cost Eq. 4 (ring all-reduce) and Eq. 3 (ring
  all-gather of COO entries);
* one-buffer sparse schemes (planner ``single``: ``topka``, ``gaussiank``, ``topkdsa``,
  ``gtopk``, ``oktopk``, ``densestream``): the whole gradient is sparsified once after the
  backward and reduced by its ``Scheme.collective``'s step-by-step pattern
  (:mod:`gradsync.apps.sim.patterns`, Ok-Topk Table 1 / DenseStream Eq. 4–6), including
  TopkDSA's and DenseStream's fill-in: the union density of m ranks' selections is
  ``u(m) = 1 − (1 − d)^(m^γ)`` with ``--union-gamma`` γ (1 = independent positions, the stated
  default and the pessimistic end; 0 = full overlap; ``--validate`` measures γ on the model's
  real top-k selections across ranks).

Iteration = forward + (backward, sparsification and exposed communication from the timeline) +
optimizer step. The breakdown columns say where the time goes.

``--validate`` runs the same model with :class:`gradsync.engine.GradSync` on P = 2, 4, 8 ranks
over tbf-shaped links (:func:`gradsync.testing.netem.run_shaped`, root; loopback otherwise, and the
output says so), profiles the cost model *inside* that run (every rank at once, so the backward
times include the contention of P ranks sharing this machine's cores), predicts, and tabulates
prediction vs measurement (:mod:`gradsync.apps.sim.validate`). ``--validate-runs N`` repeats
the whole run N times and adds each scheme's median error over the runs: on a 2-core machine
one run's in-run profile moves more than the measured iterations do, so the median is the
figure to judge the model by.

This module is the command line; the prediction itself (:func:`predict`, :class:`Network`,
:func:`load_table`, :func:`profile_model`) lives in :mod:`gradsync.apps.sim.predict` and is
re-exported here.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gradsync.apps.sim import patterns
from gradsync.apps.sim.callcpu import CollectiveCPU
from gradsync.apps.sim.contention import Contention
from gradsync.apps.sim.predict import (
    NOTE,
    Network,
    load_table,
    own_sparsifiers,
    plot_vs_p,
    predict,
    profile_model,
)
from gradsync.schedule import SCHEMES, bucket_bytes_of
from gradsync.schedule.costmodel import CostModel
from gradsync.sparsify import validate_density

__all__ = ["NOTE", "Network", "load_table", "main", "parse_args", "predict", "predict_all",
           "profile_model"]


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
    p.add_argument("--oktopk-exact-rate", type=float, default=None,
                   help="share of steps in which Ok-Topk computes its threshold exactly "
                        "(default 1/32, the paper's reuse; --validate measures it)")
    p.add_argument("--implementation", default="gloo", choices=patterns.IMPLEMENTATIONS,
                   help="whose messages the one-buffer collectives send: gloo, gradsync's on "
                        "gloo (counted in real calls; what --validate checks), or papers, the "
                        "papers' algorithms (rings, counts apart; what report cluster prices)")
    p.add_argument("--cores", type=float, default=None,
                   help="CPU contention (apps/sim/contention.py): the cores P ranks share; "
                        "off unless given (--validate: this machine's count)")
    p.add_argument("--round-latency", default=None,
                   help="with --cores: what one synchronising round costs above its idle "
                        "price under load (--validate measures it)")
    p.add_argument("--bucket-mb", type=float, default=25.0,
                   help="DDP's bucket size (MiB) for the schemes that fuse as DDP does")
    p.add_argument("--first-bucket-mb", type=float, default=None,
                   help="the first bucket's size (MiB; default: --bucket-mb; DDP's default "
                        "layout: 1, Config.first_bucket_mb)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-out/simulate")
    v = p.add_argument_group("validation (--validate)")
    v.add_argument("--validate", action="store_true",
                   help="measure GradSync on shaped links and compare with the prediction")
    v.add_argument("--validate-workers", default="2,4,8")
    v.add_argument("--steps", type=int, default=10, help="timed training steps per scheme")
    v.add_argument("--validate-runs", type=int, default=1,
                   help="whole runs (each profiles and measures afresh); with several, the "
                        "median error over runs per scheme and P is reported too")
    v.add_argument("--timeout", type=float, default=900.0)
    v.add_argument("--loopback", action="store_true", help="validate on loopback (no shaping)")
    a = p.parse_args(list(argv) if argv is not None else None)
    a.scheme_list = _schemes(a.schemes)
    a.worker_list = _int_list(a.workers, "--workers")
    a.validate_list = _int_list(a.validate_workers, "--validate-workers")
    try:
        a.density = validate_density(a.density)
    except ValueError as e:
        raise ValueError(f"--{e}") from None
    if not 0.0 <= a.union_gamma <= 1.0:
        raise ValueError(f"--union-gamma must be in [0, 1], got {a.union_gamma}")
    if a.densestream_ratio is not None and not a.densestream_ratio > 0:
        raise ValueError(f"--densestream-ratio must be > 0, got {a.densestream_ratio}")
    if a.oktopk_exact_rate is not None and not 0.0 <= a.oktopk_exact_rate <= 1.0:
        raise ValueError(f"--oktopk-exact-rate must be in [0, 1], got {a.oktopk_exact_rate}")
    if a.validate and a.implementation != "gloo":
        raise ValueError("--validate runs gradsync on gloo: it checks --implementation gloo, "
                         f"not {a.implementation!r}")
    for name in ("batch", "repeats", "steps", "validate_runs"):
        if getattr(a, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    for name in ("forward_s", "step_s"):
        x = getattr(a, name)
        if x is not None and not (math.isfinite(x) and x >= 0):
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {x}")
    for name in ("bucket_mb", "first_bucket_mb"):
        x = getattr(a, name)
        if x is not None and not (x > 0 and math.isfinite(x)):
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {x}")
    a.net = Network.parse(a.bandwidth, a.latency)
    from gradsync.testing.netem import parse_time

    a.contention = None
    a.collective_cpu = None  # --cost-model: its "collective_cpu", when it has one
    if a.cores is not None:  # a profile of one rank alone: σ = 1
        rnd = parse_time(a.round_latency) if a.round_latency is not None else 0.0
        a.contention = Contention(a.cores, rnd, share=1.0)
    return a


def _source(a: argparse.Namespace) -> tuple[CostModel, float, float, str]:
    if a.cost_model:
        try:
            d = json.loads(Path(a.cost_model).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"--cost-model {a.cost_model}: {e}") from None
        cost = CostModel.from_dict(d)
        if d.get("collective_cpu"):  # issue 14: the collectives' CPU per call, per P
            try:
                a.collective_cpu = CollectiveCPU.from_dict(d["collective_cpu"])
            except ValueError as e:
                raise ValueError(f"--cost-model {a.cost_model}: {e}") from None
        fwd = float(cost.info.get("forward_s", 0.0))
        stp = float(cost.info.get("step_s", 0.0))
        src = f"cost model {a.cost_model}"
    elif a.table:
        cost, fwd, stp = load_table(a.table)
        src = f"table {a.table}"
    else:
        cost, fwd, stp = profile_model(a.model, a.batch, a.sparsifier, a.density, a.seed,
                                       a.repeats,
                                       own=own_sparsifiers(a.scheme_list, a.sparsifier))
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
                                bucket_bytes=bucket_bytes_of(a.bucket_mb),
                                first_bucket_bytes=bucket_bytes_of(a.first_bucket_mb),
                                oktopk_exact_rate=a.oktopk_exact_rate,
                                contention=a.contention,
                                collective_cpu=getattr(a, "collective_cpu", None),
                                implementation=a.implementation))
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    from gradsync.apps.common import print_table, write_outputs
    from gradsync.apps.sim.validate import run_validation

    a = parse_args(argv)
    if a.validate:
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
    if a.collective_cpu is not None:
        ps = sorted(a.collective_cpu.fits)
        print(f"collectives' CPU per call measured at P={', '.join(map(str, ps))} (used there; "
              "other P price merges and codec only): "
              + " | ".join(f"P={P}: {a.collective_cpu.describe(P)}" for P in ps))
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
            "implementation": a.implementation,
            "forward_s": fwd, "step_s": stp, "cost_model": cost.to_dict()}
    j, png = write_outputs("simulate", rows, a.out, meta=meta, plot=plot_vs_p(
        rows, f"{cost.info.get('model', a.model)}, d={a.density}, {a.bandwidth}, "
        f"α={a.latency} (predicted)"))
    print(f"wrote {j} and {png}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    import sys

    sys.exit(main())
