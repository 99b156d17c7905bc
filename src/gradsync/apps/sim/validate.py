"""``python -m gradsync simulate --validate``: predictions vs measured GradSync runs.

For each P in ``--validate-workers`` (default 2, 4, 8) the model trains with
:class:`gradsync.engine.GradSync` on P ranks joined by tbf-shaped links of ``--bandwidth``
(:func:`gradsync.testing.netem.run_shaped`, needs root; otherwise loopback, and the output says so).
Inside the same run, before training, every rank profiles its compute *at the same time*
(:func:`gradsync.apps.sim.predict.profile_model`: T_b^l per tensor, forward, optimizer step,
sparsification fit), so the cost model the prediction uses carries the contention of P ranks
sharing this machine's cores; the slowest rank's profile is used (a synchronous step waits for
it). Each rank also takes the top-k of one real gradient and the ranks all-gather the masks, so
the union density u(m) of the selections — and the γ of ``u(m) = 1 − (1 − d)^(m^γ)`` — is
measured, not assumed. The ranks then run each sparse scheme's collective on their own top-m
of that gradient (m = k/4, k/2, k) and record its process CPU per call
(:mod:`gradsync.apps.sim.callcpu`), which the prediction uses as the collective's compute. Then
every scheme runs ``warmup_steps + 2`` untimed steps and
``--steps`` timed ones (forward, backward, ``synchronize()``, optimizer step); the measured
iteration is the median over steps of the slowest rank's step time.

The prediction for the same P uses the profiled compute, the *nominal* network (β = 1/
``--bandwidth``, α = ``--latency``; tbf adds no propagation delay, so the real α is a veth's)
and the measured γ. Error = (predicted − measured) / measured. A second prediction uses α, β
fitted in the same run to the group's all-gather times (Eq. 3, ``profile_collectives``): the
gap between the two shows how much of the error is the network model (gloo's per-message
software cost on a loaded machine is far above a wire's α) rather than the compute profile.

Limits, stated in the output: with P ranks on a machine of C cores (P > C) the ranks are
compute-bound and time-share the cores; communication then also competes for CPU with the other
ranks' compute, which the α-β model does not know about.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from gradsync.apps.sim.callcpu import CollectiveCPU
from gradsync.apps.sim.contention import Contention, round_extra
from gradsync.schedule import bucket_bytes_of
from gradsync.schedule.costmodel import ComputeCost, CostModel
from gradsync.schedule.plan import Plan

__all__ = ["RUN_INPUTS", "most_run", "run_validation", "with_run_inputs"]


def _rank(rank: int, world_size: int, model: str, schemes: list[str], density: float,
          sparsifier: str, batch: int, steps: int, seed: int, repeats: int,
          bucket_mb: float, first_bucket_mb: float | None) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from gradsync.apps.models import model_step
    from gradsync.apps.sim.predict import own_sparsifiers, profile_model
    from gradsync.engine import GradSync
    from gradsync.engine.config import Config
    from gradsync.schedule import entries

    P = world_size
    dist.barrier()
    c0, w0 = time.process_time(), time.perf_counter()
    cost, fwd, stp = profile_model(model, batch, sparsifier, density, seed, repeats, rank,
                                   own=own_sparsifiers(schemes, sparsifier))
    share = (time.process_time() - c0) / (time.perf_counter() - w0)  # σ, as a check

    # union density of the ranks' top-k selections of one real gradient
    net, step = model_step(model, batch, seed, rank)
    step().backward()
    flat = torch.cat([p.grad.reshape(-1) for p in net.parameters() if p.grad is not None])
    n = flat.numel()
    k = entries(n, density)
    mask = torch.zeros(n, dtype=torch.uint8)
    mask[torch.topk(flat.abs(), k, sorted=False).indices] = 1
    masks = [torch.empty_like(mask) for _ in range(P)]
    dist.all_gather(masks, mask)
    union: dict[int, float] = {}
    acc = torch.zeros(n, dtype=torch.uint8)
    for m in range(1, P + 1):
        acc |= masks[m - 1]
        union[m] = float(acc.sum()) / n

    # α, β of this group's all-gather as gloo delivers them here (Eq. 3 fit), for comparison
    from gradsync.schedule.costmodel import profile_collectives

    # an 8-byte point anchors α: the per-message cost comes from the smallest all-reduce;
    # every size timed in full, as the simulator was validated
    ar, ag = profile_collectives(None, sizes=(8, 1 << 10, 1 << 14, 1 << 17), repeats=5,
                                 lean=False)
    # issue 14: the collectives' CPU work, fitted here under the same contention
    from gradsync.schedule.costmodel import profile_compute

    compute = profile_compute(repeats=repeats, numel=n, seed=seed + rank)
    # issue 14: each sparse scheme's collective, run here at this P and n on this rank's top-m
    # of the real gradient (m = k/4, k/2, k): process CPU seconds per call
    from gradsync.apps.sim.callcpu import profile_collective_cpu

    call_samples = profile_collective_cpu(schemes, flat, density)
    # issue 14, contention: an 8-byte all-reduce idle and with every rank's backward looping
    from gradsync.apps.sim.contention import profile_round_latency

    # backward only (autograd's C++ engine, as during training), not the Python forward: the
    # rounds' price under busy cores, not under a busy interpreter lock
    loss = step()
    round_idle, round_loaded, call_cpu = profile_round_latency(
        lambda loss=loss: loss.backward(retain_graph=True))
    net.zero_grad(set_to_none=True)

    results: dict[str, Any] = {}
    for scheme in schemes:
        net, step = model_step(model, batch, seed, rank)
        opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
        cfg = Config(scheme=scheme, density=density, sparsifier=sparsifier, bucket_mb=bucket_mb,
                     first_bucket_mb=first_bucket_mb, density_warmup=())  # the target's steps
        sync = GradSync(net, cfg)
        warm = cfg.warmup_steps + 2
        times, stats, cpu, fwds, afters = [], [], [], [], []
        timed_plans: list[Plan | None] = []  # the plan each timed step ran
        exact0 = 0
        try:
            dist.barrier()
            for i in range(warm + steps):
                if i == warm:
                    exact0 = _exact_evaluations(sync)
                ran = sync.plan  # the plan this step runs (synchronize() may set the next's)
                t0, c0 = time.perf_counter(), time.process_time()
                opt.zero_grad(set_to_none=True)
                loss = step()
                t1 = time.perf_counter()
                loss.backward()
                sync.synchronize()
                t2 = time.perf_counter()
                opt.step()
                dt = time.perf_counter() - t0
                if i >= warm:
                    times.append(dt)
                    fwds.append(t1 - t0)  # zero_grad and the forward pass
                    afters.append(t2 - t1)  # backward and synchronize()
                    cpu.append(time.process_time() - c0)  # every thread of this rank
                    stats.append(sync.stats()["last"])
                    timed_plans.append(ran)
            exact = (_exact_evaluations(sync) - exact0) / steps
            ran_most, n_plans = most_run(timed_plans)  # agreed by ranks
            plan = ran_most.to_dict() if ran_most is not None else None
            # the cost model the engine planned with (its warm-up's), beside the profile's
            run_cost = sync.cost.to_dict() if sync.cost is not None else None
        finally:
            sync.close()
        results[scheme] = {"times": times, "cpu": cpu, "stats": stats, "exact_rate": exact,
                           "forward": fwds, "backward_sync": afters, "plan": plan,
                           "plans_timed": n_plans,
                           "cost": run_cost}
    dist.barrier()
    return {"cost": cost.to_dict(), "compute": compute.to_dict(), "forward_s": fwd,
            "step_s": stp, "union": union, "profile_share": share,
            "round_idle_s": round_idle, "round_loaded_s": round_loaded,
            "call_cpu_s": call_cpu, "collective_cpu": call_samples,
            "allreduce_fit": vars(ar), "allgather_fit": vars(ag), "results": results}


def _exact_evaluations(sync: Any) -> int:
    """Ok-Topk's exact threshold computations so far, over the engine's collectives (0 for
    the others): the simulator's ``oktopk_exact_rate`` is measured from it."""
    colls = sync.state_dict().get("collectives") or {}
    return sum(int(s.get("exact_evaluations", 0)) for s in colls.values()
               if isinstance(s, dict))


def _gamma(union: dict[int, float], d: float) -> float | None:
    """γ of ``u(m) = 1 − (1 − d)^(m^γ)`` fitted to the measured u(m), m ≥ 2 (least squares in
    log m); None when P = 1 or the data cannot define it."""
    xs, ys = [], []
    for m, u in union.items():
        if m < 2 or not 0 < u < 1 or not 0 < d < 1:
            continue
        eff = math.log1p(-u) / math.log1p(-d)  # effective number of independent ranks
        if eff <= 0:
            continue
        xs.append(math.log(m))
        ys.append(math.log(eff))
    if not xs:
        return None
    g = sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
    return min(1.0, max(0.0, g))


def _models(res: list[dict[str, Any]], link_alpha: float,
            cores: float) -> tuple[CostModel, Contention, CollectiveCPU]:
    """The cost model and the contention of one validated P from the ranks' profiles.

    * compute: the slowest rank's profile (a synchronous step waits for it);
    * the collectives' CPU work: the slowest rank's merge/codec fit; the software cost per
      message is the in-run all-reduce fit's α — already per message, Eq. 4's intercept over
      its 2(P − 1) start-ups (:func:`~gradsync.schedule.costmodel.fit_alpha_beta`) — less the
      link's own α (tbf adds no propagation delay, so the rest is gloo's and the kernel's);
    * contention: ``cores``, the loaded round (:func:`~gradsync.apps.sim.contention.
      round_extra` of the ranks' 8-byte all-reduce, idle and under load) and the CPU of one
      round (the slowest rank's CPU seconds per 8-byte all-reduce call);
    * the collectives' CPU per call (:mod:`gradsync.apps.sim.callcpu`), fitted to the
      samples every rank holds (already the maximum over ranks).
    """
    P = len(res)
    costs = [CostModel.from_dict(r["cost"]) for r in res]
    cost = costs[max(range(P), key=lambda r: sum(costs[r].backward.values()))]
    comp = [ComputeCost.from_dict(r["compute"]) for r in res]
    cslow = max(range(P), key=lambda r: comp[r].merge(1 << 14) + comp[r].codec(1 << 14))
    cost.compute = ComputeCost(message=max(0.0, res[0]["allreduce_fit"]["alpha"] - link_alpha),
                               merge=comp[cslow].merge, codec=comp[cslow].codec)
    rnd = round_extra(max(r["round_idle_s"] for r in res),
                      max(r["round_loaded_s"] for r in res), P)
    calls = CollectiveCPU.from_samples(P, res[0].get("collective_cpu") or {})
    return cost, Contention(cores=cores, round_s=rnd,
                            call_cpu_s=max(r["call_cpu_s"] for r in res)), calls


# the planner's inputs a run's warm-up measures (:func:`with_run_inputs`), alone and together
RUN_INPUTS = (("backward",), ("link",), ("backward", "link"), ("backward", "link", "sparsify"))


def most_run(plans: Sequence[Plan | None]) -> tuple[Plan | None, int]:
    """The plan that most of the timed steps ran (``plans``: one per step; a tie goes to the
    one that ran first) and how many distinct plans ran. The row's "plan the run used" is this
    one, not the plan in place after the last step: ``auto`` puts runners-up on trial after
    its warm-up, and the plan left in place when the timing ends can be a trial that ran in
    none of the timed steps (DDP's dense buckets on 100 Mbit/s, which the simulator timed at
    3.8× the measured steps)."""
    runs = [(p.digest(), p) for p in plans if p is not None]
    if not runs:
        return None, 0
    counts = Counter(d for d, _ in runs)  # most_common: equal counts in first-seen order
    best = counts.most_common(1)[0][0]
    return next(p for d, p in runs if d == best), len(counts)


def with_run_inputs(view: CostModel, run: CostModel, terms: tuple[str, ...]) -> CostModel:
    """The simulator's planning view (``engine_view`` of the scaled profile) with the named
    inputs taken from the cost model a run's warm-up built and planned with: ``backward``
    (the backward order and T_b per tensor), ``link`` (the all-reduce and all-gather α, β the
    warm-up timed on the link, in place of the nominal network plus each message's software
    cost), ``sparsify`` (rank 0's inline and offloaded sparsification fits). With all three
    the planner has the run's inputs, so it must make the run's plan (``auto`` aside: its
    trials may replace the planned plan by a measured runner-up); each alone shows how
    many of the plans that differ it explains. With P ranks on fewer cores the warm-up's
    measurements move from run to run (ranks time-share the cores unevenly), which the
    profile (every rank busy at once) cannot follow."""
    unknown = set(terms) - {"backward", "link", "sparsify"}
    if unknown:
        raise ValueError(f"with_run_inputs: unknown terms {sorted(unknown)}")
    if sorted(run.order) != sorted(view.order):
        raise ValueError("with_run_inputs: the run's cost model covers other tensors")
    out = view
    if "backward" in terms:
        out = dataclasses.replace(out, order=list(run.order), backward=dict(run.backward))
    if "link" in terms:
        out = dataclasses.replace(out, allreduce=run.allreduce, allgather=run.allgather)
    if "sparsify" in terms:
        out = dataclasses.replace(out, sparsify=run.sparsify, offload=run.offload)
    return out


def run_validation(a) -> int:
    """``simulate --validate``: ``a.validate_runs`` whole runs (each profiles and measures
    every P afresh), each printed as it ends; with several, the median over runs per scheme
    and P, the figure the bar is judged on (one run's profile moves more than the runs do:
    docs/results/simulator.md)."""
    from gradsync.apps.common import write_outputs
    from gradsync.apps.sim.predict import NOTE, plot_vs_p

    cores = a.cores if a.cores is not None else (os.cpu_count() or 1)
    runs = a.validate_runs
    all_rows: list[dict[str, Any]] = []
    per_run: list[dict[str, Any]] = []
    load0 = os.getloadavg()
    for run in range(runs):
        if runs > 1:
            print(f"--- validation run {run + 1} of {runs} ---")
        rows, per_p, link = _measure(a, cores)
        _report(a, rows, per_p, link, cores)
        for r in rows:
            r["run"] = run
        all_rows += rows
        per_run.append({str(k): v for k, v in per_p.items()})
    load1 = os.getloadavg()
    meta = {"note": NOTE, "link": link, "bandwidth": a.bandwidth, "latency": a.latency,
            "cores": cores, "loadavg_before": load0, "loadavg_after": load1,
            "density": a.density, "sparsifier": a.sparsifier, "batch": a.batch,
            "steps": a.steps, "runs": runs, "per_P": per_run[0],
            "compute_bound_P": [P for P in a.validate_list if cores < P]}
    shown = all_rows
    if runs > 1:
        meta["per_run_P"] = per_run
        meta["summary"] = shown = summarize(all_rows)
        _report_summary(shown, runs, link)
        print(f"over the {runs} runs: {_input_plans(all_rows)}")
    j, png = write_outputs("validate", all_rows, a.out, meta=meta, plot=plot_vs_p(
        shown, f"{a.model}: predicted vs measured"
        + (f" (median of {runs} runs)" if runs > 1 else "") + f", {link}", measured=True))
    print(f"wrote {j} and {png}")
    return 0


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per scheme and P, over the runs in ``rows`` (each row of one run, ``"run"``): the
    median measured and predicted iteration, every run's error, and the median error (also
    timing the plan each run used), in the order the rows first name them."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["scheme"], r["P"]), []).append(r)
    out = []
    for (scheme, P), rs in groups.items():
        errs = [r["error"] for r in rs]
        out.append({"scheme": scheme, "P": P, "runs": len(rs),
                    "measured_s": statistics.median(r["measured_s"] for r in rs),
                    "predicted_s": statistics.median(r["predicted_s"] for r in rs),
                    "errors": errs, "error": statistics.median(errs),
                    "error_run_plan": statistics.median(r["error_run_plan"] for r in rs),
                    "within_25": sum(abs(e) <= 0.25 for e in errs)})
    return out


def _report_summary(summary: list[dict[str, Any]], runs: int, link: str | None) -> None:
    from gradsync.apps.common import print_table

    cols = ["scheme", "P", "measured ms (median)", "predicted ms (median)",
            "error % per run", "median error %", "median err run's plan %", "runs within 25 %"]
    table = [[s["scheme"], s["P"], s["measured_s"] * 1e3, s["predicted_s"] * 1e3,
              " ".join(f"{100 * e:+.0f}" for e in s["errors"]), 100 * s["error"],
              100 * s["error_run_plan"], f"{s['within_25']}/{s['runs']}"] for s in summary]
    print_table(f"simulate --validate: median over {runs} runs, {link}", cols, table)
    single = sum(s["within_25"] for s in summary)
    total = sum(s["runs"] for s in summary)
    for key, what in (("error", "median error over the runs"),
                      ("error_run_plan", "the same, timing the plan each run used")):
        ok = [s for s in summary if abs(s[key]) <= 0.25]
        miss = ", ".join(f"{s['scheme']} P={s['P']} {100 * s[key]:+.0f} %"
                         for s in summary if abs(s[key]) > 0.25)
        print(f"{what}: {len(ok)} of {len(summary)} scheme × P within 25 %"
              + (f"; outside: {miss}" if miss else ""))
    print(f"single runs: {single} of {total} rows within 25 %")


def _input_plans(rows: list[dict[str, Any]]) -> str:
    """How many of the planned rows' plans equal the run's: from the profile, and with each
    set of :data:`RUN_INPUTS` taken from the run's warm-up (:func:`with_run_inputs`)."""
    rs = [r for r in rows if r.get("plan_same_run_inputs")]
    if not rs:
        return "plans from the run's warm-up inputs: no row has a run cost model"
    own = sum(bool(r["plan_same"]) for r in rs)
    parts = [f"with the run's {k.replace('+', ' + ')} "
             f"{sum(bool(r['plan_same_run_inputs'][k]) for r in rs)}"
             for k in rs[0]["plan_same_run_inputs"]]
    errs = [abs(r["error_run_backward_plan"]) for r in rs]
    return (f"plans as the run's, of the {len(rs)} rows whose run planned from a warm-up cost "
            f"model: from the profile {own}; {'; '.join(parts)} (rows within 25 % timing the "
            f"plan made with the run's backward: {sum(e <= 0.25 for e in errs)} of {len(rs)})")


def _measure(a, cores: float) -> tuple[list[dict[str, Any]], dict[int, Any], str | None]:
    """One validation run: every P of ``a.validate_list`` profiled, measured and predicted."""
    from gradsync.apps.sim.predict import Network, planned, predict
    from gradsync.schedule import entries
    from gradsync.testing import netem, run_distributed

    rows: list[dict[str, Any]] = []
    per_p: dict[int, Any] = {}
    link = None
    for P in a.validate_list:
        args = (a.model, a.scheme_list, a.density, a.sparsifier, a.batch, a.steps, a.seed,
                a.repeats, a.bucket_mb, a.first_bucket_mb)
        t0 = time.perf_counter()
        if a.loopback:
            res = run_distributed(_rank, P, *args, timeout=a.timeout)
            shaped, reason = False, "--loopback"
        else:
            res = netem.run_shaped(_rank, P, *args, bandwidth=a.bandwidth, timeout=a.timeout)
            shaped, reason = res.shaped, res.reason
        wall = time.perf_counter() - t0
        link = (f"tbf {a.bandwidth} per rank and direction" if shaped
                else f"loopback ({reason}); the prediction still assumes {a.bandwidth}")
        cost, contention, callcpu = _models(res, a.net.alpha, cores)
        slow = max(range(P), key=lambda r: sum(res[r]["cost"]["backward"].values()))
        fwd = max(r["forward_s"] for r in res)
        stp = max(r["step_s"] for r in res)
        union = {int(m): u for m, u in res[0]["union"].items()}
        n = sum(cost.numel.values())
        gamma = _gamma(union, entries(n, a.density) / n)
        g_use = a.union_gamma if gamma is None else gamma
        ag = res[0]["allgather_fit"]
        fitted = Network(ag["alpha"], ag["beta"] if ag["beta"] > 0 else a.net.beta)
        per_p[P] = {"allreduce_fit": res[0]["allreduce_fit"], "allgather_fit": ag,
                    "shaped": shaped, "link": link, "wall_s": wall, "union": union,
                    "gamma": gamma, "slowest_rank": slow, "forward_s": fwd, "step_s": stp,
                    "cost_model": cost.to_dict(), "cores": cores,
                    "round_idle_s": max(r["round_idle_s"] for r in res),
                    "round_loaded_s": max(r["round_loaded_s"] for r in res),
                    "round_s": contention.round_s, "share": contention.sigma(P),
                    "call_cpu_s": contention.call_cpu_s,
                    "collective_cpu": callcpu.to_dict(),
                    "collective_cpu_text": callcpu.describe(P),
                    "profile_share_measured": [r["profile_share"] for r in res]}
        for scheme in a.scheme_list:
            steps = [max(r["results"][scheme]["times"][i] for r in res)
                     for i in range(a.steps)]
            meas = statistics.median(steps)

            def med(key: str, scheme: str = scheme, res: Any = res) -> float:
                return statistics.median(
                    max(r["results"][scheme]["stats"][i][key] for r in res)
                    for i in range(a.steps))

            rate = max(r["results"][scheme]["exact_rate"] for r in res)  # agreed θ decisions

            def med_raw(key: str, scheme: str = scheme, res: Any = res) -> float:
                return statistics.median(max(r["results"][scheme][key][i] for r in res)
                                         for i in range(a.steps))

            kw = {"union_gamma": g_use, "forward_s": fwd, "step_s": stp,
                  "densestream_ratio": a.densestream_ratio, "oktopk_exact_rate": rate,
                  "bucket_bytes": bucket_bytes_of(a.bucket_mb),
                  "first_bucket_bytes": bucket_bytes_of(a.first_bucket_mb)}
            bare = CostModel.from_dict(cost.to_dict() | {"compute": None})
            pred = predict(scheme, cost, P, a.net, a.density, contention=contention,
                           collective_cpu=callcpu, **kw)
            nocall = predict(scheme, cost, P, a.net, a.density, contention=contention, **kw)
            nosteal = predict(scheme, cost, P, a.net, a.density, collective_cpu=callcpu,
                              contention=dataclasses.replace(contention, steal_cpu=False),
                              **kw)
            nocont = predict(scheme, cost, P, a.net, a.density, collective_cpu=callcpu, **kw)
            nocomp = predict(scheme, bare, P, a.net, a.density, **kw)
            fit = predict(scheme, bare, P, fitted, a.density, **kw)
            # the plan the run used: the planners that plan from measured times (MG-WFBP,
            # SSFusion, HiPress, Espresso) may choose another plan from the profile than the
            # run did from its warm-up; timing the run's own plan separates the timing model's
            # error from the planner's choice
            ran = res[0]["results"][scheme].get("plan")
            ran_plan = Plan.from_dict(ran) if ran and "plan_digest" in pred else None
            asrun = (predict(scheme, cost, P, a.net, a.density, contention=contention,
                             collective_cpu=callcpu, plan=ran_plan, **kw)
                     if ran_plan is not None else pred)
            # the plan made with the run's warm-up inputs in place of the profile's
            run_cost = res[0]["results"][scheme].get("cost") if ran_plan is not None else None
            same_inputs: dict[str, bool] = {}
            bwd_pred = None
            run_model = CostModel.from_dict(run_cost) if run_cost else None
            if run_model is not None and sorted(run_model.order) == sorted(cost.order):
                for terms in RUN_INPUTS:
                    alt = planned(scheme, cost, P, a.net, a.density,
                                  bucket_bytes=kw["bucket_bytes"],
                                  first_bucket_bytes=kw["first_bucket_bytes"],
                                  adjust=lambda v, t=terms, r=run_model: with_run_inputs(v, r, t))
                    same_inputs["+".join(terms)] = alt.digest() == ran_plan.digest()
                    if terms == ("backward",):
                        bwd_pred = predict(scheme, cost, P, a.net, a.density,
                                           contention=contention, collective_cpu=callcpu,
                                           plan=alt, **kw)["iteration_s"]
            cpu = statistics.median(max(r["results"][scheme]["cpu"][i] for r in res)
                                    for i in range(a.steps))
            rows.append({
                "scheme": scheme, "P": P, "shaped": shaped, "measured_s": meas,
                "measured_steps_s": steps, "predicted_s": pred["iteration_s"],
                "error": (pred["iteration_s"] - meas) / meas,
                "plan_same": ran_plan is None or ran_plan.digest() == pred["plan_digest"],
                "predicted_run_plan_s": asrun["iteration_s"],
                "error_run_plan": (asrun["iteration_s"] - meas) / meas, "run_plan": ran,
                "plans_timed": res[0]["results"][scheme].get("plans_timed"),
                "plan_same_run_inputs": same_inputs,
                "predicted_run_backward_plan_s": bwd_pred,
                "error_run_backward_plan": (None if bwd_pred is None
                                            else (bwd_pred - meas) / meas),
                "run_cost_model": res[0]["results"][scheme].get("cost"),
                "predicted_no_call_cpu_s": nocall["iteration_s"],
                "predicted_no_steal_s": nosteal["iteration_s"],
                "error_no_steal": (nosteal["iteration_s"] - meas) / meas,
                "error_no_call_cpu": (nocall["iteration_s"] - meas) / meas,
                "predicted_collective_cpu_s": pred["collective_cpu_s"],
                "predicted_no_contention_s": nocont["iteration_s"],
                "error_no_contention": (nocont["iteration_s"] - meas) / meas,
                "predicted_round_wait_s": pred["round_wait_s"],
                "predicted_cpu_floor_s": pred["cpu_floor_s"],
                "predicted_cpu_work_s": pred["cpu_work_s"], "measured_cpu_s": cpu,
                "measured_backward_s": med("backward_s"),
                "predicted_backward_s": pred["backward_s"],
                "measured_wait_s": med("wait_s"), "predicted_exposed_comm_s":
                    pred["exposed_comm_s"],
                "measured_sparsify_s": med("sparsify_s"),
                "measured_forward_s": med_raw("forward"),
                "measured_backward_sync_s": med_raw("backward_sync"),
                "measured_comm_s": med("comm_s"), "predicted_comm_s": pred["comm_s"],
                "predicted_sparsify_s": pred["sparsify_s"],
                "measured_bytes_sent": med("bytes_sent"),
                "predicted_volume_bytes": pred["volume_bytes"],
                "predicted_no_compute_s": nocomp["iteration_s"],
                "error_no_compute": (nocomp["iteration_s"] - meas) / meas,
                "predicted_link_s": pred["link_s"], "predicted_compute_s": pred["compute_s"],
                "predicted_fitted_s": fit["iteration_s"],
                "error_fitted": (fit["iteration_s"] - meas) / meas,
                "fitted_alpha_s": fitted.alpha, "fitted_beta_s_per_byte": fitted.beta,
                "union_gamma_used": g_use, "oktopk_exact_rate": rate, "prediction": pred,
            })
    return rows, per_p, link


def _report(a, rows: list[dict[str, Any]], per_p: dict[int, Any], link: str | None,
            cores: float) -> None:
    """One run's figures: the profile per P, the table of rows, the share within 25 %."""
    from gradsync.apps.common import print_table
    from gradsync.apps.sim.predict import NOTE

    print(f"NOTE: {NOTE}. Validation: measured GradSync runs vs predictions.")
    print(f"model {a.model}, batch {a.batch}/rank, {a.sparsifier} at density {a.density}, "
          f"{a.steps} timed steps per scheme; link: {link}; predicted with α={a.latency}, "
          f"β=1/{a.bandwidth}; this machine has {cores} cores; load average now "
          f"{os.getloadavg()[0]:.2f}")
    for P, info in per_p.items():
        g = info["gamma"]
        bound = f"compute-bound: {P} ranks share {cores} cores" if cores < P else ""
        print(f"P={P}: union density of top-k selections u(P)={info['union'][P]:.4f} "
              f"(d={a.density}), fitted γ={'n/a' if g is None else f'{g:.3f}'}; "
              f"Σ T_b (slowest rank, under contention)="
              f"{sum(info['cost_model']['backward'].values()) * 1e3:.1f} ms; all-gather fit "
              f"on this link α={info['allgather_fit']['alpha'] * 1e6:.0f} us, "
              f"β={info['allgather_fit']['beta']:.3g} s/B; {bound}")
        sh = info["profile_share_measured"]
        print(f"P={P} contention: {info['cores']} cores; 8-byte all-reduce idle "
              f"{info['round_idle_s'] * 1e3:.2f} ms, with every rank's backward looping "
              f"{info['round_loaded_s'] * 1e3:.2f} ms → {info['round_s'] * 1e3:.3f} ms per "
              f"round, {info['call_cpu_s'] * 1e3:.3f} ms CPU per call; profile share "
              f"σ={info['share']:.2f} (CPU/wall measured per rank while "
              f"profiling: {min(sh):.2f}–{max(sh):.2f})")
        print(f"P={P} collectives' CPU per call (process CPU, max over ranks; fit c0 + c1·m "
              f"for m entries per rank): {info['collective_cpu_text']}")
    cols = ["scheme", "P", "measured ms", "predicted ms", "error %", "plan as run",
            "err run's plan %", "err no-steal %", "err no-call-CPU %",
            "err no-contention %", "err no-compute %", "round wait pred ms",
            "CPU floor pred ms", "CPU floor meas ms", "link pred ms", "compute pred ms",
            "coll CPU pred ms", "err fit-αβ %", "bwd meas ms",
            "bwd pred ms", "wait meas ms", "exposed pred ms", "comm meas ms", "comm pred ms",
            "fwd meas ms", "fwd pred ms", "MB sent meas", "MB pred"]
    table = [[r["scheme"], r["P"], r["measured_s"] * 1e3, r["predicted_s"] * 1e3,
              100 * r["error"], "same" if r["plan_same"] else "other",
              100 * r["error_run_plan"], 100 * r["error_no_steal"], 100 * r["error_no_call_cpu"],
              100 * r["error_no_contention"],
              100 * r["error_no_compute"],
              r["predicted_round_wait_s"] * 1e3, r["predicted_cpu_floor_s"] * 1e3,
              r["P"] * r["measured_cpu_s"] / cores * 1e3, r["predicted_link_s"] * 1e3,
              r["predicted_compute_s"] * 1e3,
              (r["predicted_collective_cpu_s"] or 0.0) * 1e3, 100 * r["error_fitted"],
              r["measured_backward_s"] * 1e3,
              r["predicted_backward_s"] * 1e3, r["measured_wait_s"] * 1e3,
              r["predicted_exposed_comm_s"] * 1e3, r["measured_comm_s"] * 1e3,
              r["predicted_comm_s"] * 1e3, r["measured_forward_s"] * 1e3,
              r["prediction"]["forward_s"] * 1e3, r["measured_bytes_sent"] / 1e6,
              r["predicted_volume_bytes"] / 1e6] for r in rows]
    print_table(f"simulate --validate: {a.model} on {link}", cols, table)
    for key, what in (("error", "with contention and the collectives' CPU per call"),
                      ("error_run_plan", "the same, timing the plan each run used"),
                      ("error_no_steal", "without the collectives' CPU delaying the backward"),
                      ("error_no_call_cpu", "without the CPU per call (the previous model)"),
                      ("error_no_contention", "without contention"),
                      ("error_no_compute", "without compute or contention")):
        errs = [abs(r[key]) for r in rows]
        print(f"{what}: {sum(e <= 0.25 for e in errs)} of {len(rows)} rows within 25 %, "
              f"median |error| {100 * statistics.median(errs):.0f} %")
    other = [f"{r['scheme']} P={r['P']}" for r in rows if not r["plan_same"]]
    print(f"plans: the planner chose another plan from the profile than the run did in "
          f"{len(other)} of {len(rows)} rows{': ' + ', '.join(other) if other else ''}")
    print(_input_plans(rows))
    ok = [r for r in rows if r["oktopk_exact_rate"] > 0]
    if ok:
        print("Ok-Topk exact thresholds (measured share of timed steps, used by the prediction): "
              + ", ".join(f"{r['scheme']} P={r['P']}: {r['oktopk_exact_rate']:.2f}" for r in ok))
