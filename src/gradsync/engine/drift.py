"""``auto``'s drift watch: trials of the runners-up and re-planning on drift.

``auto`` (:mod:`gradsync.schedule.auto`) keeps checking its plan after the warm-up
(:mod:`gradsync.engine.warmup`) (:class:`Drift`): per window of
:data:`DRIFT_WINDOW` steps the median measured step (first gradient ready → gradients
written), all-reduce, all-gather, sparsification and backward times and the whole iteration
(gradients written → gradients written: forward and optimizer included) are max-reduced over
the ranks (so every rank holds the same numbers and takes the same decision). Trials and the
drift reference compare iterations — what the user waits for; a plan that speeds up the
backward part but slows the rest is not faster — and the cost model, which has no forward
pass, is checked against the step. After the warm-up
each of the planner's runners-up (DDP's dense plan, the best sparse plan, TopkA's one fused
buffer: those that differ from the choice) is put on trial against the plan in use, one after
the other; a trial is A-B-B-A (the plan in use for a window, the runner-up for
:data:`TRIAL_WINDOWS` half windows, the plan in use for one more), so a load that comes or goes
meanwhile weighs on both; a trial too close to call (within
:data:`~gradsync.engine.trial.TRIAL_CLOSE`) repeats B-B-A, up to
:data:`~gradsync.engine.trial.TRIAL_ROUNDS` rounds (the rule the DDP hook's trial decides by
too, :func:`gradsync.engine.trial.decide`); the measured faster one stays, a sparse one only if
``auto.MARGIN`` faster. Afterwards, when the step is off the reference (the
kept plan's measured step; the prediction before any measurement) by more than
:data:`DRIFT_THRESHOLD` (either way) in :data:`DRIFT_PATIENCE` consecutive windows, rank 0
rescales the cost model by the measured / predicted ratios
(:func:`gradsync.schedule.auto.calibrated`), plans again, takes the new plan only if it is
predicted ``auto.MARGIN`` faster than the current one under the same rescaled model, and
broadcasts plan and model; a new plan is on trial against the old one, and the reference is
re-based either way, so the same drift does not trigger again (hysteresis). When the plan stays,
the runners-up of the rescaled model are measured again, one trial each: the conditions that
drifted (another job's load that came or went, a link that changed) may have changed which plan
is faster, and only a measurement says so. Each re-measurement that keeps the plan doubles the
drifted windows the next one needs (up to 32 × :data:`DRIFT_PATIENCE`): on a noisy machine
windows can look drifted without a lasting change, and every trial runs a slower plan.
The whole watch — the window's rows, strikes, checks, whether the runners-up were probed, the
reference, a trial in progress, the events and a pending post-flush plan — is plain data in
:meth:`Drift.state_dict`, part of the engine's per-rank ``state_dict()``, so a resumed run goes
on exactly as an uninterrupted one; a checkpoint without it resumes with a fresh watch.
"""

from __future__ import annotations

import copy
import math
import statistics
from dataclasses import dataclass, field, fields
from typing import Any

import torch
import torch.distributed as dist

from gradsync import schedule
from gradsync.collectives.comm import Comm
from gradsync.engine import trial as rule
from gradsync.engine.config import Config
from gradsync.engine.warmup import from_rank0, plan_kwargs
from gradsync.schedule import BufferPlan, Plan, auto, costmodel, schemes

__all__ = ["DRIFT_PATIENCE", "DRIFT_THRESHOLD", "DRIFT_WINDOW", "TRIAL_WINDOWS", "Drift"]

DRIFT_THRESHOLD = 0.25  # |measured / predicted step − 1| beyond this (either way) is drift
# steps per measurement (their median). 10, not 5: single steps vary too much on a loaded
# machine for a 5-step median to pick the faster plan (docs/results/speed.md, "The warm-up's
# windows and trials")
DRIFT_WINDOW = 10
DRIFT_PATIENCE = 2  # consecutive drifted windows before auto plans again
# A trial is A-B-B-A: the plan in use for a window, the candidate for TRIAL_WINDOWS half
# windows, the plan in use again for one half window; the means of each plan's window medians
# decide. A load that comes or goes during the trial then weighs on both plans alike, where
# with one window each a load arriving between them could keep the slower plan for the rest of
# the run (docs/results/speed.md, "The warm-up's windows and trials").
TRIAL_WINDOWS = 2
# A close trial goes on (B-B-A again, up to trial.TRIAL_ROUNDS rounds) by the rule the DDP hook
# decides by too: gradsync.engine.trial.decide.


# A trial in progress (Drift.trial): the plan in use before it, its model and window median,
# the candidate's half-window medians, the candidate once the plan in use is back, and the plan
# in use's half-window medians of the rounds closed so far ("incumbent").
_TRIAL_KEYS = ("plan", "cost", "step", "measured", "candidate", "incumbent")

# The measured quantities of one step, in this order (see Drift): "step" from the first gradient
# hook to the gradients written (what the cost model predicts), the four parts the model is
# rescaled by, and "iteration", the wall time since the previous step's gradients were written
# (forward, optimizer and the training loop's own work included: what a plan costs the user).
_FIELDS = ("step", "allreduce", "allgather", "sparsify", "backward", "iteration")
_PARTS = ("allreduce", "allgather", "sparsify", "backward")


def _predicted(plan: Plan, cost: costmodel.CostModel) -> dict[str, float]:
    """What ``cost`` predicts for the quantities of :data:`_FIELDS` under ``plan``."""
    tl = schedule.simulate(plan, cost)
    ar = ag = 0.0
    for b in plan.buffers:
        ar_b, ag_b = schedule.buffer_parts(b, cost)
        if b.mode == "dense" or any(t.allreduce for t in b.tensors):
            ar += cost.t_allreduce(ar_b)
        if b.mode != "dense" and any(not t.allreduce for t in b.tensors):
            ag += cost.t_allgather(ag_b)
    first = plan.buffers[0].tensors[0].name  # its own T_b precedes the first hook
    return {"step": tl.iteration - cost.backward[first], "allreduce": ar, "allgather": ag,
            "sparsify": tl.sparsify, "backward": tl.backward - cost.backward[first]}


def _prediction(plan: Plan, cost: costmodel.CostModel) -> dict[str, float]:
    """``Plan.info["predicted"]`` as ``make_plan`` writes it."""
    tl = schedule.simulate(plan, cost)
    return {"iteration": tl.iteration, "backward": tl.backward, "sparsify": tl.sparsify,
            "comm": tl.comm, "exposed_comm": tl.exposed_comm}


def _ratio(measured: float, predicted: float) -> float | None:
    return measured / predicted if measured > 0 and predicted > 0 else None


def _time(x: Any) -> float | None:
    """``x`` as a measured time (a finite number >= 0), else ``None``."""
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    return float(x) if math.isfinite(x) and x >= 0 else None


@dataclass
class Drift:
    """``auto``'s watch on its plan (module doc). One row of measurements per step; every
    :data:`DRIFT_WINDOW` steps the ranks agree on the window's medians, and then:

    1. the first window after the warm-up, and the first after each trial of step 1: the
       planner's next runner-up (``info["auto"]["alternatives"]``) is put on trial, until each
       has been measured;
    2. a trial (A-B-B-A): the window just closed measured the plan in use (A); the candidate
       runs :data:`TRIAL_WINDOWS` half windows (B), then the plan in use one more (A). The
       candidate is kept if the mean of its medians is below the plan in use's (a sparse plan
       by ``auto.MARGIN``); when the two are within ``trial.TRIAL_CLOSE``, B-B-A runs again (at
       most ``trial.TRIAL_ROUNDS`` rounds) and the means over the rounds decide; the kept plan's
       measured iteration is the new reference;
    3. otherwise the drift test against the reference (the prediction until a plan has been
       measured), and after :data:`DRIFT_PATIENCE` drifted windows a re-plan on the rescaled
       model: a different plan predicted ``auto.MARGIN`` faster goes on trial as in 2; else the
       plan stays and the runners-up of the rescaled model are measured again as in 1 (the
       conditions changed: what was measured before no longer holds). Each such
       re-measurement that keeps the plan doubles the drifted windows needed next time
       (:attr:`patience`); a trial that changes the plan resets it.

    Every decision is a function of the agreed numbers and of plans every rank holds, so every
    rank takes it alike; a new plan comes from rank 0.
    """

    rows: list[list[float]] = field(default_factory=list)
    strikes: int = 0
    checks: int = 0
    probed: bool = False
    reference: float | None = None  # measured step of the plan in use (None: its prediction)
    trial: dict[str, Any] | None = None  # the replaced plan, its model and measured step
    events: list[dict[str, Any]] = field(default_factory=list)
    pending: Plan | None = None  # the plan to run after this step's flushing step
    reprobes: int = 0  # re-measurements after drift that kept the plan, in a row (back-off)

    def change(self, old: Plan, new: Plan) -> Plan:
        """The plan to run next step when ``new`` replaces ``old``: when ``old`` sparsified
        something and ``new`` has dense buffers, first one step of ``auto.flushing(new)`` (the
        residuals are sent), then ``new`` (:meth:`after_step`)."""
        if auto.has_sparse(old.buffers) and any(b.mode == "dense" for b in new.buffers):
            self.pending = new
            return auto.flushing(new)
        self.pending = None
        return new

    def after_step(self) -> Plan | None:
        """The plan a flushing step was for, once that step has run (else ``None``)."""
        plan, self.pending = self.pending, None
        return plan

    def state_dict(self) -> dict[str, Any]:
        """The whole watch as plain data (numbers, lists, plan and cost-model dicts): the
        window's rows, strikes, checks, whether the runner-up was probed, the reference, a
        trial in progress, the events and a pending post-flush plan. Part of the engine's
        per-rank :meth:`~gradsync.engine.GradSync.state_dict` (the same on every rank)."""
        return {"rows": [[float(x) for x in r] for r in self.rows], "strikes": self.strikes,
                "checks": self.checks, "probed": self.probed, "reference": self.reference,
                "trial": copy.deepcopy(self.trial), "events": copy.deepcopy(self.events),
                "pending": self.pending.to_dict() if self.pending is not None else None,
                "reprobes": self.reprobes}

    @classmethod
    def from_state_dict(cls, state: Any) -> Drift:
        """The watch :meth:`state_dict` describes; ``ValueError`` naming the entry that is
        missing or malformed."""
        if not isinstance(state, dict):
            raise ValueError(f"auto's drift state must be a dict, got {type(state).__name__}")
        keys = {f.name for f in fields(cls)}
        if "reprobes" not in state and set(state) == keys - {"reprobes"}:
            state = {**state, "reprobes": 0}  # saved before the back-off existed
        if set(state) != keys:
            raise ValueError(f"auto's drift state: missing entries {sorted(keys - set(state))},"
                             f" unknown entries {sorted(set(state) - keys)}")

        def bad(what: str, why: str) -> ValueError:
            return ValueError(f"auto's drift state: {what} {why}, got {state[what]!r:.200}")

        rows = state["rows"]
        if isinstance(rows, list) and all(isinstance(r, list | tuple) and len(r) == 5
                                          for r in rows):
            rows = [[*r, r[0]] for r in rows]  # saved before "iteration": the step stands in
        if not isinstance(rows, list) or not all(
                isinstance(r, list | tuple) and len(r) == len(_FIELDS)
                and all(_time(x) is not None for x in r) for r in rows):
            raise bad("rows", f"must be a list of rows of {len(_FIELDS)} finite times >= 0")
        for what in ("strikes", "checks", "reprobes"):
            v = state[what]
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise bad(what, "must be an int >= 0")
        if not isinstance(state["probed"], bool):
            raise bad("probed", "must be a bool")
        if state["reference"] is not None and _time(state["reference"]) is None:
            raise bad("reference", "must be None or a finite time >= 0")
        trial = state["trial"]
        if trial is not None:
            try:
                if isinstance(trial, dict) and set(trial) == {"plan", "cost", "step"}:
                    trial = {**trial, "measured": [], "candidate": None}  # one-window trials
                if isinstance(trial, dict) and set(trial) == set(_TRIAL_KEYS) - {"incumbent"}:
                    trial = {**trial, "incumbent": []}  # saved before close trials went on
                if (not isinstance(trial, dict) or set(trial) != set(_TRIAL_KEYS)
                        or _time(trial["step"]) is None):
                    raise ValueError(f"needs the entries {sorted(_TRIAL_KEYS)} and a finite "
                                     "step")
                Plan.from_dict(trial["plan"])
                costmodel.CostModel.from_dict(trial["cost"])
                most = TRIAL_WINDOWS * rule.TRIAL_ROUNDS
                if not (isinstance(trial["measured"], list)
                        and len(trial["measured"]) <= most
                        and all(_time(x) is not None for x in trial["measured"])):
                    raise ValueError(f"measured must be at most {most} finite times")
                if not (isinstance(trial["incumbent"], list)
                        and len(trial["incumbent"]) < rule.TRIAL_ROUNDS
                        and all(_time(x) is not None for x in trial["incumbent"])):
                    raise ValueError(f"incumbent must be fewer than {rule.TRIAL_ROUNDS} finite "
                                     "times")
                cand = trial["candidate"]
                if cand is not None:
                    if not isinstance(cand, dict) or set(cand) != {"plan", "cost"}:
                        raise ValueError("a candidate needs a plan and a cost model")
                    Plan.from_dict(cand["plan"])
                    costmodel.CostModel.from_dict(cand["cost"])
            except (ValueError, TypeError, KeyError, AttributeError) as e:
                raise bad("trial", f"is not a trial ({e})") from None
        events = state["events"]
        if not isinstance(events, list) or not all(
                isinstance(e, dict) and isinstance(e.get("check"), int) for e in events):
            raise bad("events", "must be a list of event dicts (each with its check)")
        pending = None
        if state["pending"] is not None:
            try:
                pending = Plan.from_dict(state["pending"])
            except (ValueError, TypeError, KeyError, AttributeError) as e:
                raise bad("pending", f"is not a plan ({e})") from None
        return cls(rows=[[float(x) for x in r] for r in rows], strikes=state["strikes"],
                   checks=state["checks"], probed=state["probed"],
                   reference=None if state["reference"] is None else float(state["reference"]),
                   trial=copy.deepcopy(trial), events=copy.deepcopy(events), pending=pending,
                   reprobes=state["reprobes"])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; a malformed state raises ``ValueError`` and changes
        nothing."""
        loaded = Drift.from_state_dict(state)
        for f in fields(self):
            setattr(self, f.name, getattr(loaded, f.name))

    @classmethod
    def for_config(cls, cfg: Config, P: int) -> Drift | None:
        """A watch for ``auto`` with more than one rank; ``None`` otherwise."""
        auto = schemes.get(cfg.scheme).planner == "auto"
        return cls() if auto and P > 1 and cfg.plan is None else None

    def record(self, step_s: float, allreduce_s: float, allgather_s: float, sparsify_s: float,
               backward_s: float, iteration_s: float | None = None) -> None:
        """One step's measurements (seconds, this rank); ``iteration_s`` (None: ``step_s``)
        is the wall time since the previous step's gradients were written."""
        self.rows.append([step_s, allreduce_s, allgather_s, sparsify_s, backward_s,
                          step_s if iteration_s is None else iteration_s])

    @property
    def patience(self) -> int:
        """Drifted windows in a row before a re-plan: :data:`DRIFT_PATIENCE`, doubled after
        each re-measurement of the runners-up that kept the plan (at most 32×), so that noise
        that only looks like drift does not keep ``auto`` measuring slower plans, while a
        lasting change is still answered."""
        return DRIFT_PATIENCE * 2 ** min(self.reprobes, 5)

    @property
    def due(self) -> bool:
        """Whether the window is full (a half window during a trial's B-B-A part)."""
        return len(self.rows) >= (max(1, DRIFT_WINDOW // 2) if self.trial else DRIFT_WINDOW)

    def _event(self, plan: Plan, **what: Any) -> None:
        self.events.append({"check": self.checks, **what})
        plan.info["replans"] = list(self.events)

    def check(self, cfg: Config, plan: Plan, cost: costmodel.CostModel,
              group: dist.ProcessGroup | None, rank: int, P: int, comm: Comm | None = None
              ) -> tuple[Plan, costmodel.CostModel] | None:
        """Close the window (every rank calls it at the same step); returns the plan and model
        to run from now on, or ``None`` to keep the current ones (class doc). Its traffic (the
        window's all-reduce, a re-plan's broadcast) goes through ``comm``, which counts it."""
        comm = comm or Comm(group)
        med = [statistics.median(col) for col in zip(*self.rows)]
        self.rows.clear()
        t = torch.tensor(med, dtype=torch.float64)
        comm.all_reduce(t, op=dist.ReduceOp.MAX)  # every rank: the same numbers
        measured = dict(zip(_FIELDS, t.tolist()))
        self.checks += 1
        step = measured["iteration"]  # trials and the reference: what the user waits for
        if self.trial is not None:  # 2. A-B-B-A: go on, or keep one of the two plans
            return self._trial(plan, cost, step)
        alts = plan.info.get("auto", {}).get("alternatives") or []
        if not self.probed and alts:  # 1. measure each runner-up once, in turn
            return self._probe(plan, cost, step, alts)
        self.probed = True
        pred = _predicted(plan, cost)
        # against the measured reference (an iteration), else the prediction (which has no
        # forward pass: the step it predicts is compared with the measured step)
        r = (_ratio(step, self.reference) if self.reference is not None
             else _ratio(measured["step"], pred["step"]))
        drifted = r is not None and not 1 / (1 + DRIFT_THRESHOLD) <= r <= 1 + DRIFT_THRESHOLD
        self.strikes = self.strikes + 1 if drifted else 0
        if self.strikes < self.patience:
            return None
        self.strikes = 0  # 3. re-plan on the rescaled model
        f = {k: _ratio(measured[k], pred[k]) for k in _PARTS}
        link = f["allreduce"] or f["allgather"] or 1.0  # one link: a missing side follows
        factors = {"allreduce": f["allreduce"] or link, "allgather": f["allgather"] or link,
                   "sparsify": f["sparsify"] or 1.0, "backward": f["backward"] or 1.0}
        payload: list[Any] = [None]
        if rank == 0:
            payload = [_replan(cfg, plan, cost, factors)]
        new_plan, new_cost = from_rank0(payload, group, P, comm)
        switched = bool(new_plan.info.pop("switched"))
        current = new_plan.info.pop("current_iteration")
        if switched:
            self.trial = _trial_of(plan, cost, step)
        else:  # the conditions changed: measure the runners-up of the rescaled model again
            self.probed = not new_plan.info.get("auto", {}).get("alternatives")
            self.reprobes += not self.probed
        self.reference = None if switched else step
        self._event(new_plan, kind="replan", ratio=r, factors=factors, measured=step,
                    current_iteration=current,
                    new_iteration=new_plan.info["predicted"]["iteration"], switched=switched)
        return new_plan, new_cost

    def _probe(self, plan: Plan, cost: costmodel.CostModel, step: float, alts: list[Any]
               ) -> tuple[Plan, costmodel.CostModel]:
        """Step 1 of the class doc: put the first runner-up left (``alts``) on trial against
        ``plan``, measured at ``step``; the plan returned holds the runners-up left after it."""
        rest = alts[1:]
        self.probed = not rest

        def holding(buffers: list[BufferPlan]) -> Plan:  # the runners-up left to measure
            return Plan(plan.scheme, buffers, plan.overlap,
                        {**plan.info, "auto": {**plan.info["auto"], "alternatives": rest}})

        new = holding([BufferPlan.from_dict(b) for b in alts[0]])
        new.info["predicted"] = _prediction(new, cost)
        self.trial = _trial_of(holding(list(plan.buffers)), cost, step)
        self._event(new, kind="probe", measured=step)
        return new, cost

    def _trial(self, plan: Plan, cost: costmodel.CostModel, step: float
               ) -> tuple[Plan, costmodel.CostModel] | None:
        """Step 2 of the class doc: ``step`` is the median of the half window just closed."""
        t = self.trial
        if t["candidate"] is None:  # a B window of the candidate closed
            t["measured"].append(step)
            if len(t["measured"]) < TRIAL_WINDOWS * (len(t["incumbent"]) + 1):
                return None
            # the plan in use (A) again for one half window; the candidate is remembered
            t["candidate"] = {"plan": plan.to_dict(), "cost": cost.to_dict()}
            back = Plan.from_dict(t["plan"])
            self._event(back, kind="trial_back", measured=statistics.fmean(t["measured"]))
            return back, costmodel.CostModel.from_dict(t["cost"])
        cand = Plan.from_dict(t["candidate"]["plan"])
        t["incumbent"].append(step)
        mine = statistics.fmean(t["measured"])
        before = statistics.fmean([t["step"], *t["incumbent"]])  # its A windows
        keep = rule.decide(before, mine, auto.has_sparse(plan.buffers),
                           auto.has_sparse(cand.buffers), len(t["incumbent"]))
        if keep is None:  # too close to call: the candidate again (B-B), then the plan in use
            cand_cost = costmodel.CostModel.from_dict(t["candidate"]["cost"])
            t["candidate"] = None
            self._event(cand, kind="trial_again", measured=mine, replaced_measured=before)
            return cand, cand_cost
        self.reference = mine if keep else before
        self.trial = None
        if keep:  # a measured change: drift is worth answering promptly again
            self.reprobes = 0
        self._event(cand if keep else plan, kind="trial", measured=mine,
                    replaced_measured=before, kept=keep)
        if not keep:
            return None
        return cand, costmodel.CostModel.from_dict(t["candidate"]["cost"])


def _replan(cfg: Config, plan: Plan, cost: costmodel.CostModel, factors: dict[str, float]
            ) -> dict[str, Any]:
    """Step 3 of :class:`Drift`'s doc, on rank 0: rescale ``cost`` by ``factors``, plan
    again, and switch only to a plan predicted ``auto.MARGIN`` faster than ``plan`` under the
    rescaled model (else keep ``plan``, its prediction and runners-up re-based on it). Returns
    the broadcast's payload: the plan (with ``switched`` and ``current_iteration`` in its
    info) and the rescaled model."""
    new_cost = auto.calibrated(cost, **factors)
    current = schedule.simulate(plan, new_cost).iteration
    new = schedule.make_plan(cfg.scheme, list(new_cost.order), dict(new_cost.numel),
                             cfg.density, new_cost, **plan_kwargs(cfg))
    switch = (new.info["predicted"]["iteration"] < current * (1 - auto.MARGIN)
              and [b.to_dict() for b in new.buffers] != [b.to_dict() for b in plan.buffers])
    keep = new if switch else Plan(plan.scheme, plan.buffers, plan.overlap, dict(plan.info))
    if not switch:  # re-base the prediction on the rescaled model, and its runners-up
        keep.info["predicted"] = _prediction(keep, new_cost)
        mine = [b.to_dict() for b in plan.buffers]
        alts: list[Any] = []
        for bufs in ([b.to_dict() for b in new.buffers],
                     *new.info.get("auto", {}).get("alternatives", [])):
            if bufs != mine and bufs not in alts:
                alts.append(bufs)
        if "auto" in keep.info:
            keep.info["auto"] = {**keep.info["auto"], "alternatives": alts}
    keep.info["switched"] = switch
    keep.info["current_iteration"] = current
    return {"plan": keep.to_dict(), "cost": new_cost.to_dict()}


def _trial_of(plan: Plan, cost: costmodel.CostModel, step: float) -> dict[str, Any]:
    """A trial against ``plan`` (in use until now; its window measured ``step``)."""
    return {"plan": plan.to_dict(), "cost": cost.to_dict(), "step": step, "measured": [],
            "candidate": None, "incumbent": []}
