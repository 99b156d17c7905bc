"""The simulator's prediction: one scheme's iteration time at P ranks on an α-β network.

What ``python -m gradsync simulate`` (:mod:`gradsync.apps.sim.simulate`) tabulates and
``--validate`` (:mod:`gradsync.apps.sim.validate`) compares with measured runs:

* :class:`Network`: the network planned for, α seconds per message and β seconds per byte;
* :func:`predict`: the iteration time of one scheme from a cost model's compute. The table of
  schemes (:mod:`gradsync.schedule.schemes`) decides how: a ``single``-planner scheme
  sparsifies the whole gradient once after the backward and reduces it with its collective's
  step-by-step pattern (:mod:`gradsync.apps.sim.patterns`); every other planner's plan
  (:func:`gradsync.schedule.make_plan`) is costed by the timeline of
  :func:`gradsync.schedule.simulate` (WFBP overlap, offload worker, SSFusion-I split), whose
  buffers cost Eq. 4 (ring all-reduce) and Eq. 3 (ring all-gather of COO entries). The plan
  is the one the engine would make (:func:`engine_view`), not the best under this model;
* :class:`~gradsync.apps.sim.contention.Contention` (``contention=``, off by default): P ranks
  sharing C cores — a round that runs during the backward pays its loaded price, and the
  iteration is at least all ranks' CPU work over the cores;
* :class:`~gradsync.apps.sim.callcpu.CollectiveCPU` (``collective_cpu=``, off by default): the
  collectives' own CPU per call, measured at P, a floor over the merge and codec terms;
* the compute a prediction starts from: :func:`load_table` (a per-layer CSV) or
  :func:`profile_model` (measured here, SSFusion §IV-A);
* :func:`plot_vs_p`: predicted (and measured) iteration time against P.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from gradsync.apps.common import median_time
from gradsync.apps.sim import patterns
from gradsync.apps.sim.callcpu import CollectiveCPU
from gradsync.apps.sim.contention import Contention
from gradsync.schedule import entries, make_plan, schemes
from gradsync.schedule import simulate as timeline_of
from gradsync.schedule.costmodel import AffineFit, AlphaBeta, CostModel
from gradsync.schedule.plan import Plan
from gradsync.sparsify import validate_density

__all__ = ["NOTE", "Network", "at_scale", "engine_view", "load_table", "planned", "plot_vs_p",
           "predict",
           "profile_model"]

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


def scheme_sparsify(cost: CostModel, scheme: str) -> AffineFit:
    """The inline sparsification fit of ``scheme``: its own sparsifier's
    (``Scheme.sparsifier``: Gaussian-k, Ok-Topk's threshold reuse) where the cost model holds
    a fit of it (``info["sparsifiers"][name]``, written by :func:`profile_model`), else the
    cost model's (the ``--sparsifier`` every other scheme uses)."""
    own = schemes.get(scheme).sparsifier
    fit = (cost.info.get("sparsifiers") or {}).get(own) if own else None
    if fit is None:
        return cost.sparsify
    try:
        return AffineFit(float(fit["a"]), float(fit["b"]))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"cost model info['sparsifiers'][{own!r}] must be {{'a': s, 'b': "
                         f"s/element}} with a, b ≥ 0, got {fit!r} ({e})") from None


def own_sparsifiers(scheme_names: Sequence[str], sparsifier: str) -> list[str]:
    """The sparsifiers the schemes ``scheme_names`` run instead of ``sparsifier``."""
    own = (schemes.get(s).sparsifier for s in scheme_names)
    return sorted({o for o in own if o and o != sparsifier})


def at_scale(base: CostModel, P: int, net: Network) -> CostModel:
    """``base``'s compute with P ranks on ``net`` (Eq. 3 / Eq. 4 with the planned α, β)."""
    ab = AlphaBeta(net.alpha, net.beta)
    return CostModel(P=P, order=list(base.order), numel=dict(base.numel),
                     elem_bytes=base.elem_bytes, backward=dict(base.backward),
                     sparsify=base.sparsify, offload=base.offload, allreduce=ab, allgather=ab,
                     info=dict(base.info), compute=base.compute)


@dataclass
class _Timed(CostModel):
    """The cost model the timeline times fusion buffers with (the plan is made without it:
    :func:`engine_view`). Its sparse all-gather's rounds cost ``busy`` (``Contention.busy``,
    P/C ranks per core, at least 1) times their idle software: each is a Python ``sendrecv``
    whose peers must be scheduled on the shared cores (docs/results/simulator.md, "An
    all-gather's rounds on shared cores"). With ``call``, the call costs at least its
    measured CPU (:class:`~gradsync.apps.sim.callcpu.CollectiveCPU`): the rounds' software
    plus max(merges and codec, ``call(m)``) for m entries per rank."""

    call: AffineFit | None = None
    busy: float = 1.0

    def t_startups_allgather(self, nbytes_per_rank: float) -> float:
        return self.busy * super().t_startups_allgather(nbytes_per_rank)

    def t_compute_allgather(self, nbytes_per_rank: int) -> float:
        base = super().t_compute_allgather(nbytes_per_rank)
        if self.call is None or self.P == 1:
            return base
        msg = self.t_startups_allgather(nbytes_per_rank)
        return msg + max(base - msg, self.call(nbytes_per_rank / self.entry_bytes))


def engine_view(cost: CostModel) -> CostModel:
    """The cost model the engine plans with, from ``cost``: its warm-up times each collective
    on the link, so each message's software cost (``compute.message``) is part of the α it
    measures, and it has no other compute term (no merge or codec cost, no start-ups beyond
    Eq. 3/4's). The simulator plans with this and times the plan with ``cost``: planning with
    the whole model chose plans the engine never runs (Espresso's small tensors sent dense
    where every run sent them sparse) and under-predicted them (docs/results/simulator.md)."""
    if cost.compute is None:
        return cost
    m = cost.compute.message
    return replace(cost, allreduce=AlphaBeta(cost.allreduce.alpha + m, cost.allreduce.beta),
                   allgather=AlphaBeta(cost.allgather.alpha + m, cost.allgather.beta),
                   compute=None)


def planned(scheme: str, base: CostModel, P: int, net: Network, density: float, *,
            bucket_bytes: int = 25 * 2**20, first_bucket_bytes: int | None = None,
            min_density: float = 0.001,
            adjust: Callable[[CostModel], CostModel] | None = None) -> Plan | None:
    """The plan :func:`predict` times for ``scheme`` from ``base`` at P ranks on ``net``: the
    scheme's planner on :func:`engine_view` of the scaled model (None for a one-buffer scheme,
    ``planner="single"``, which has no plan). ``adjust`` maps that view before planning
    (``simulate --validate`` puts a run's warm-up measurements in it)."""
    if schemes.get(scheme).planner == "single":
        return None
    view = engine_view(at_scale(base, int(P), net))
    if adjust is not None:
        view = adjust(view)
    return make_plan(scheme, list(view.order), view.numel, density, view,
                     elem_bytes=view.elem_bytes, bucket_bytes=bucket_bytes,
                     first_bucket_bytes=first_bucket_bytes, min_density=min_density)


def _timed(cost: CostModel, call: AffineFit | None, busy: float) -> CostModel:
    if call is None and busy == 1.0:
        return cost
    return _Timed(P=cost.P, order=list(cost.order), numel=dict(cost.numel),
                  elem_bytes=cost.elem_bytes, backward=dict(cost.backward),
                  sparsify=cost.sparsify, offload=cost.offload, allreduce=cost.allreduce,
                  allgather=cost.allgather, info=dict(cost.info), compute=cost.compute,
                  call=call, busy=busy)


def predict(
    scheme: str, base: CostModel, P: int, net: Network, density: float, *,
    union_gamma: float = 1.0, forward_s: float = 0.0, step_s: float = 0.0,
    densestream_ratio: float | None = None, bucket_bytes: int = 25 * 2**20,
    first_bucket_bytes: int | None = None,
    min_density: float = 0.001, oktopk_exact_rate: float | None = None,
    contention: Contention | None = None, collective_cpu: CollectiveCPU | None = None,
    plan: Plan | None = None, implementation: str = "gloo",
) -> dict[str, Any]:
    """One row: predicted iteration time of ``scheme`` at P ranks and its breakdown.
    ``oktopk_exact_rate``: the share of steps in which Ok-Topk computes its threshold exactly
    (:func:`gradsync.apps.sim.patterns.oktopk`; default 1/τ′). ``contention``: P ranks sharing
    the cores (:mod:`gradsync.apps.sim.contention`: the floor, loaded rounds, steal, and a
    one-buffer collective's CPU taking P/C of it); None leaves the prediction as without it.
    ``collective_cpu``: the collectives' CPU per call measured at P
    (:mod:`gradsync.apps.sim.callcpu`); where it has the scheme's collective at P, a call's
    compute is the messages' software cost plus max(merges and codec, the measured CPU), and
    the contention floor counts that CPU; None (or no fit at P) leaves the micro terms.
    ``plan``: time this plan (made for ``scheme``, over the cost model's tensors) instead of
    the one the scheme's planner makes from ``base`` — ``simulate --validate`` passes the plan
    a measured run used; ignored by one-buffer schemes (``planner="single"``), which have one.
    ``implementation``: whose messages a one-buffer collective sends
    (:data:`gradsync.apps.sim.patterns.IMPLEMENTATIONS`): ``"gloo"``, gradsync's on gloo (what
    ``simulate`` measures and validates), or ``"papers"``, the papers' algorithms
    (``report cluster``).

    Row terms: ``rounds`` synchronising rounds (start-ups of the payload and control
    messages), ``round_wait_s`` what loaded calls add to ``comm_s`` (2(P − 1)·``contention.
    round_s`` per call of a buffer that starts during the backward; a one-buffer collective
    starts after it and pays the idle price),
    ``cpu_work_s`` the profiled work of one rank (forward, backward, sparsification, the
    collective's merges and codec where no CPU per call was measured, step),
    ``collective_cpu_s`` the measured CPU of its collective calls (None where not measured),
    ``dist_calls`` its torch.distributed calls outside those and ``cpu_floor_s`` the
    contention floor on the iteration (None when off)."""
    sch = schemes.get(scheme)  # an unknown name raises ValueError naming the choices
    if isinstance(P, bool) or int(P) != P or P < 1:
        raise ValueError(f"P must be a positive integer, got {P!r}")
    density = validate_density(density)
    if not 0.0 <= union_gamma <= 1.0:
        raise ValueError(f"union_gamma must be in [0, 1], got {union_gamma!r}")
    cost = at_scale(base, int(P), net)
    row: dict[str, Any] = {"scheme": scheme, "P": int(P)}
    if sch.planner == "single":  # the whole gradient, one sparsification, one collective
        n = sum(cost.numel[t] for t in cost.order)
        k = entries(n, density)
        d = k / n if n else 0.0

        def union(m: float) -> float:
            return patterns.union_density(d, m, union_gamma)

        coll = patterns.collective_of(scheme)
        steps = patterns.pattern(coll, cost.P, n, k, union=union, value_bytes=cost.elem_bytes,
                                 densestream_ratio=densestream_ratio,
                                 oktopk_exact_rate=oktopk_exact_rate,
                                 implementation=implementation)
        backward = sum(cost.backward[t] for t in cost.order)
        sparsify = scheme_sparsify(cost, scheme)(n)
        link = patterns.comm_time(steps, net.alpha, net.beta)
        w = patterns.work(coll, steps, cost.P, k, cost.elem_bytes,
                          implementation=implementation)
        rounds = sum(s.messages for s in steps) + w.control
        msg_s = micro = 0.0
        if cost.compute is not None:  # issue 14: the collective's CPU work
            msg_s = rounds * cost.compute.message
            micro = cost.compute.collective(0.0, merged=w.merged, encoded=w.encoded,
                                            calls=max(w.calls, 1.0))
        call_cpu = (collective_cpu.seconds(coll, cost.P, k)
                    if collective_cpu is not None and cost.P > 1 else None)
        # every rank runs the call's CPU at once: on C < P cores, P/C of it in wall time
        busy = contention.busy(cost.P) if contention is not None else 1.0
        if call_cpu is None:  # the micro terms: profiled wall time, work of W
            compute, work, calls = msg_s + micro * busy, micro, w.dist_calls
        else:  # measured CPU per call: covers the calls of a step, not the amortised ones
            compute, work, calls = msg_s + max(micro, call_cpu) * busy, 0.0, w.amortised_calls
        wait = 0.0  # it runs after every rank's backward: its rounds pay the idle price
        comm = link + compute
        row.update(collective=coll, backward_s=backward, sparsify_s=sparsify, comm_s=comm,
                   link_s=link, compute_s=compute, rounds=rounds, round_wait_s=wait,
                   dist_calls=calls, collective_cpu_s=call_cpu, collective_work_s=work,
                   exposed_comm_s=comm, sync_end_s=backward + sparsify + comm,
                   volume_bytes=patterns.volume(steps),
                   messages=sum(s.messages for s in steps), buffers=1,
                   union_density=union(cost.P))
    else:
        if plan is None:
            plan = planned(scheme, base, P, net, density, bucket_bytes=bucket_bytes,
                           first_bucket_bytes=first_bucket_bytes, min_density=min_density)
        elif plan.scheme != scheme or sorted(plan.names) != sorted(cost.order):
            raise ValueError(f"predict: the given plan is for {plan.scheme!r} over "
                             f"{len(plan.names)} tensors; expected {scheme!r} over the cost "
                             f"model's {len(cost.order)}")
        row["plan_digest"] = plan.digest()
        p = cost.P
        fit = (collective_cpu.fit(patterns.collective_of(scheme), p)
               if collective_cpu is not None and sch.sparse and p > 1 else None)
        timed = _timed(cost, fit, contention.busy(p) if contention else 1.0)
        tl = timeline_of(plan, timed, round_s=contention.round_s if contention else 0.0,
                         steal=contention.steal(p) if contention else 0.0)
        compute = calls = work = 0.0
        rounds = 0  # start-ups: the row's messages too
        call_cpu = None if fit is None else 0.0
        for b in tl.buffers:
            ar, ag = "ar_start" in b, "ag_start" in b
            if ar:  # one gloo all-reduce: its start-ups' software cost, no merge or codec
                compute += cost.t_compute_allreduce(b["ar_bytes"])
                calls += 1
            ag_rounds = cost.startups_allgather(b["ag_bytes"]) if ag else 0
            if ag:  # TopkA: gradsync's rounds of point-to-point messages
                compute += timed.t_compute_allgather(b["ag_bytes"])
                if fit is None or p == 1:
                    work += max(0.0, cost.t_compute_allgather(b["ag_bytes"])
                                - cost.t_startups_allgather(b["ag_bytes"]))
                    calls += ag_rounds
                else:
                    call_cpu += fit(b["ag_bytes"] / cost.entry_bytes)
            # the start-ups t_compute_allreduce / t_compute_allgather price
            rounds += cost.startups_allreduce() * ar + ag_rounds
        calls *= p > 1
        wait = tl.round_wait
        vol = sum(b["ar_bytes"] * 2 * (p - 1) / p + b["ag_bytes"] * (p - 1) for b in tl.buffers)
        row.update(collective=f"allreduce+{sch.collective}" if sch.sparse else "allreduce",
                   backward_s=tl.backward, sparsify_s=tl.sparsify, comm_s=tl.comm,
                   link_s=tl.comm - compute - wait, compute_s=compute, rounds=rounds,
                   round_wait_s=wait, dist_calls=calls, collective_cpu_s=call_cpu,
                   collective_work_s=work, exposed_comm_s=tl.exposed_comm,
                   sync_end_s=tl.iteration, volume_bytes=vol,
                   messages=rounds, buffers=len(plan.buffers), union_density=None)
    row["forward_s"] = forward_s
    row["step_s"] = step_s
    row["iteration_s"] = forward_s + row["sync_end_s"] + step_s
    # merges and codec (where no CPU per call was measured); the per-message price is latency
    # (gloo, the kernel), not work
    row["cpu_work_s"] = (forward_s + row["backward_s"] + row["sparsify_s"]
                         + row.pop("collective_work_s") + step_s)
    row["cpu_floor_s"] = None
    if contention is not None:
        row["cpu_floor_s"] = contention.floor(row["cpu_work_s"], cost.P, row["dist_calls"],
                                              cpu_s=row["collective_cpu_s"] or 0.0)
        row["iteration_s"] = max(row["iteration_s"], row["cpu_floor_s"])
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


def profile_model(name: str, batch: int, sparsifier: str, density: float, seed: int = 0,
                  repeats: int = 3, rank: int = 0, own: Sequence[str] = ()
                  ) -> tuple[CostModel, float, float]:
    """Measure one worker here: T_b^l (``profile_backward``), the sparsifier fit
    (``profile_sparsifier``, sizes up to the whole model), the forward pass and an SGD step;
    with ``own`` (:func:`own_sparsifiers`), the inline fit of each of those sparsifiers too,
    in ``info["sparsifiers"]`` (:func:`scheme_sparsify` reads it).
    Returns (cost model with P = 1, forward_s, step_s)."""
    import torch

    from gradsync import sparsify
    from gradsync.apps import models
    from gradsync.schedule import costmodel

    net, step = models.model_step(name, batch, seed, rank)
    order, numel, backward = costmodel.profile_backward(net, step, repeats=repeats)
    forward = median_time(step, repeats)  # with autograd on, as in training
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    step().backward()
    step_s = median_time(opt.step, repeats)
    net.zero_grad(set_to_none=True)
    n = sum(numel.values())
    sizes = sorted({s for s in (1 << 10, 1 << 14, 1 << 17, 1 << 20) if s < n} | {n})
    sp = sparsify.get(sparsifier, density=density, seed=seed)
    inline = costmodel.profile_sparsifier(sp, sizes=sizes, repeats=repeats)
    off = costmodel.profile_sparsifier(sp, sizes=sizes, repeats=repeats, offload=True)
    fits = {}
    for other in own:  # the schemes' own sparsifiers, with their default options
        fit = costmodel.profile_sparsifier(sparsify.get(other, density=density, seed=seed),
                                           sizes=sizes, repeats=repeats)
        fits[other] = {"a": fit.a, "b": fit.b}
    cost = CostModel(P=1, order=order, numel=numel, elem_bytes=4, backward=backward,
                     sparsify=inline, offload=off, allreduce=AlphaBeta(0.0, 0.0),
                     allgather=AlphaBeta(0.0, 0.0),
                     info={"model": name, "batch": batch, "sparsifier": sparsifier,
                           "density": density, "threads": torch.get_num_threads(),
                           "forward_s": forward, "step_s": step_s}
                     | ({"sparsifiers": fits} if fits else {}))
    return cost, forward, step_s


def plot_vs_p(rows: list[dict[str, Any]], title: str, measured: bool = False):
    """A ``plot(ax)`` for :func:`gradsync.apps.common.write_outputs`: iteration time against P
    per scheme, log-log; with ``measured``, rows carry ``predicted_s`` and ``measured_s``."""

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
