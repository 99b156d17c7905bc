"""``auto``'s measured trials: the A-B-B-A rule both doors decide by, and the DDP hook's trial
of its per-bucket prediction against all-dense.

**The rule** (:func:`decide`). A candidate plan (B) is measured against the one in use (A) in
windows A-B-B-A, so that a drift of the machine weighs on both alike. Each side's time is the
mean of its windows, a sparse side's handicapped by :data:`~gradsync.schedule.auto.MARGIN`
(:func:`effective`: the model under-predicts inline sparsification where ranks share cores,
docs/results/speed.md, "The DDP hook's `auto`, measured"); the faster one stays. A trial whose
two sides are within :data:`TRIAL_CLOSE` of each other goes on with B-B-A again, up to
:data:`TRIAL_ROUNDS` rounds, and the means over every round decide: window times vary by ±10–20 %
on a shared machine, so one round is close to a coin flip between plans a few percent apart,
and a near tie costs little whichever plan runs the extra rounds. :class:`gradsync.GradSync`'s
``auto`` puts whole re-plans on trial so (:mod:`.drift`); the DDP hook, its prediction.

**The DDP hook's trial** (:class:`AutoTrial`). The hook's ``auto`` predicts per bucket from the
link and sparsifier costs measured once (:func:`~gradsync.engine.warmup.link_costs`,
:func:`~gradsync.schedule.auto.bucket_sparse`), then keeps the prediction (A, ``"model"``)
only if it beats all-dense (B, ``"dense"``) by the rule: windows of :data:`TRIAL_STEPS` steps in
the order :data:`TRIAL_ORDER`, then :data:`AGAIN_ORDER` per further round, each step timed from
one first bucket to the next, the sides' means max-reduced over the ranks at each round's end
(one 16-byte all-reduce), so every rank decides alike. The same object, with the sides
``("split", "merged")``, decides whether the hook's sparse buckets each run their own
collectives or wait for the step's last bucket and travel in one
(:meth:`gradsync.engine.pipeline.BufferPipeline.hold`).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from gradsync import sparsify
from gradsync.collectives.comm import Comm
from gradsync.engine.warmup import link_costs
from gradsync.schedule.auto import MARGIN, bucket_sparse
from gradsync.schedule.costmodel import AffineFit, AlphaBeta

__all__ = ["AGAIN_ORDER", "AUTO_SIDES", "FUSION_SIDES", "TRIAL_CLOSE", "TRIAL_ORDER",
           "TRIAL_ROUNDS", "TRIAL_STEPS", "AutoTrial", "decide", "effective", "fusion_from"]

# Two sides within TRIAL_CLOSE of each other (after the margin) are too close to call after one
# round: B-B-A again, up to TRIAL_ROUNDS rounds (module doc, "The rule").
TRIAL_CLOSE = 0.10
TRIAL_ROUNDS = 3
TRIAL_STEPS = 5  # the hook's window, in steps
# the hook's windows, as indices into a trial's sides (A, B)
TRIAL_ORDER = (0, 1, 1, 0)  # the first round: A-B-B-A
AGAIN_ORDER = (1, 1, 0)  # each further round: B-B-A
AUTO_SIDES = ("model", "dense")  # auto's: the prediction (A) against all-dense (B)
FUSION_SIDES = ("split", "merged")  # a bucket's own collectives (A) against one per step (B)


def effective(step: float, sparse: bool) -> float:
    """A measured time, handicapped by ``auto.MARGIN`` for a side that sparsifies anything: a
    sparse plan must be measured that much faster than a dense one to be kept."""
    return step / (1 - MARGIN) if sparse else step


def decide(incumbent: float, candidate: float, incumbent_sparse: bool, candidate_sparse: bool,
           rounds: int) -> bool | None:
    """The A-B-B-A rule (module doc) after ``rounds`` rounds, on each side's mean time: whether
    the candidate (B) replaces the plan in use (A), or ``None`` when the two are within
    :data:`TRIAL_CLOSE` and fewer than :data:`TRIAL_ROUNDS` rounds have run (another round)."""
    a, b = effective(incumbent, incumbent_sparse), effective(candidate, candidate_sparse)
    if abs(b - a) < TRIAL_CLOSE * min(a, b) and rounds < TRIAL_ROUNDS:
        return None
    return b < a


@dataclass
class AutoTrial:
    """A trial of two sides, A in use and B the candidate (module doc): ``auto``'s prediction
    against all-dense (:data:`AUTO_SIDES`, with the measured link), or a step's sparse buckets
    each on their own against merged (:data:`FUSION_SIDES`)."""

    link: tuple[Any, ...] | None = None  # the measured (all-reduce, all-gather, sparsify)
    # {"start": step, "rounds": n, "times": {A: [...], B: [...]}, "verdict": None | A | B};
    # None: no trial (yet)
    trial: dict[str, Any] | None = None
    last_first: tuple[int, float] | None = None  # (step, time) of the last first bucket
    # the trial's clock (seconds); a test gives its own, so that a verdict never rests on
    # how loaded the machine was
    clock: Callable[[], float] = field(default=time.perf_counter, repr=False)
    sides: tuple[str, str] = AUTO_SIDES

    def mode(self, step: int) -> str:
        """The side that runs at ``step``: A before the trial, the trial's window, or its
        verdict once it is over. ``auto``'s: ``"model"`` (the prediction's buckets) or
        ``"dense"`` (every bucket all-reduced)."""
        t = self.trial
        if t is not None and t["verdict"] is not None:
            return t["verdict"]
        if t is None or step < t["start"]:
            return self.sides[0]
        order = _order(t["rounds"], self.sides)
        w = _window(step - t["start"])
        return order[-1] if w is None else order[min(w, len(order) - 1)]

    def open(self, start: int) -> None:
        """Put B on trial from step ``start`` on (nothing when a trial is open or over)."""
        if self.trial is None:
            self.trial = {"start": start, "rounds": 1, "verdict": None,
                          "times": {k: [] for k in self.sides}}

    def sparse(self, numels: list[int], density: float, elem_bytes: int, step: int,
               probe: Callable[[], sparsify.Sparsifier], group: dist.ProcessGroup | None,
               comm: Comm | None, device: torch.device | None) -> bool:
        """Whether a bucket of ``numels`` is sparsified at ``step``: the prediction (the link
        measured at the first call, its traffic counted in ``comm``; the sparsifier
        ``probe()`` timed where the gradients are), put on trial the first time it
        sparsifies, and overruled by the trial's dense windows and a dense verdict."""
        P = dist.get_world_size(group)
        if self.link is None and P > 1:
            self.link = link_costs(probe(), group, comm, device)
        sparse = P > 1 and bucket_sparse(numels, density, P, elem_bytes, *self.link)
        if sparse:  # the prediction sparsifies: measure it
            self.open(step + 1)
        return sparse and (self.trial is None or self.mode(step) == "model")

    def time_step(self, step: int, comm: Comm) -> None:
        """At a step's first bucket: the previous step's time goes to its window; at the end
        of a round the ranks agree on the sides' means (one 16-byte max-reduce) and
        :func:`decide`: a verdict, or another round."""
        t = self.trial
        if t is None or t["verdict"] is not None:
            return
        now = self.clock()
        prev, self.last_first = self.last_first, (step, now)
        rounds = t["rounds"]
        order = _order(rounds, self.sides)
        if prev is not None and prev[0] == step - 1 and prev[0] >= t["start"]:
            w = _window(prev[0] - t["start"])
            if w is not None and w < len(order):
                t["times"][order[w]].append(now - prev[1])
        if step - t["start"] < _end(rounds):
            return
        a, b = self.sides
        means = torch.tensor([statistics.fmean(t["times"][k]) if t["times"][k] else math.inf
                              for k in (a, b)], dtype=torch.float64)
        comm.all_reduce(means, op=dist.ReduceOp.MAX)  # every rank: the same numbers
        ta, tb = means.tolist()
        # a side sparsifies unless it is auto's all-dense one (merged buckets: both sides,
        # so the margin cancels)
        b_wins = decide(ta, tb, a != "dense", b != "dense", rounds)
        if b_wins is None:  # too close to call: B-B-A again
            t["rounds"] = rounds + 1
            return
        t["verdict"] = b if b_wins else a
        t["measured"] = {a: ta, b: tb}

    def state_dict(self) -> dict[str, Any]:
        link, trial = self.link, self.trial
        return {"link": None if link is None else [vars(x).copy() for x in link],
                "trial": None if trial is None else {
                    **trial, "times": {k: list(v) for k, v in trial["times"].items()}}}

    @classmethod
    def from_state(cls, state: dict[str, Any], clock: Callable[[], float],
                   sides: tuple[str, str] = AUTO_SIDES) -> AutoTrial:
        """The trial of a hook's ``state_dict`` (its ``link`` and ``trial`` entries; absent:
        measured again); ``ValueError`` when malformed."""
        return cls(_link_from(state.get("link")), _trial_from(state.get("trial"), sides),
                   None, clock, sides)


def fusion_from(saved: Any, clock: Callable[[], float]) -> AutoTrial:
    """The trial of merged buckets (:data:`FUSION_SIDES`) a hook's ``state_dict`` saved as
    ``"fusion"`` (None: none yet); ``ValueError`` when malformed."""
    return AutoTrial.from_state({"trial": saved}, clock, FUSION_SIDES)


def _order(rounds: int, sides: tuple[str, str]) -> tuple[str, ...]:
    """The hook's windows over ``rounds`` rounds: A-B-B-A, then B-B-A per further round."""
    return tuple(sides[i] for i in TRIAL_ORDER + AGAIN_ORDER * (rounds - 1))


_FIRST = len(TRIAL_ORDER) * TRIAL_STEPS  # the first round's steps
_AGAIN = len(AGAIN_ORDER) * TRIAL_STEPS + 1  # a further round's: the step that decided the one
# before it (its mode read before the decision, so left untimed), then its windows


def _window(k: int) -> int | None:
    """The window (an index into :func:`_order`) of the trial's ``k``-th step, ``None`` for a
    step at which a round was decided."""
    if k < _FIRST:
        return k // TRIAL_STEPS
    r, j = divmod(k - _FIRST, _AGAIN)
    return None if j == 0 else len(TRIAL_ORDER) + r * len(AGAIN_ORDER) + (j - 1) // TRIAL_STEPS


def _end(rounds: int) -> int:
    """The trial's step at whose first bucket round ``rounds`` is decided."""
    return _FIRST + (rounds - 1) * _AGAIN


def _link_from(saved: Any) -> tuple[Any, ...] | None:
    if saved is None:
        return None
    try:
        ar, ag, sp = saved
        return AlphaBeta(**ar), AlphaBeta(**ag), AffineFit(**sp)
    except (ValueError, TypeError) as e:
        raise ValueError(f"the DDP hook state's link entry is malformed ({e}): "
                         f"{saved!r:.200}") from None


def _trial_from(saved: Any, sides: tuple[str, str]) -> dict[str, Any] | None:
    if saved is None:
        return None
    try:
        trial = {"start": int(saved["start"]), "verdict": saved["verdict"],
                 "times": {k: [float(t) for t in saved["times"][k]] for k in sides}}
        if "measured" in saved:  # the agreed means behind the verdict
            trial["measured"] = {k: float(saved["measured"][k]) for k in sides}
        trial["rounds"] = saved.get("rounds", 1)  # absent: saved before rounds existed
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"the DDP hook state's trial entry is malformed ({e!r}): "
                         f"{saved!r:.200}") from None
    rounds = trial["rounds"]
    if not isinstance(rounds, int) or isinstance(rounds, bool) or not 1 <= rounds <= TRIAL_ROUNDS:
        raise ValueError(f"the DDP hook state's trial rounds must be an int in [1, "
                         f"{TRIAL_ROUNDS}], got {rounds!r}")
    if trial["verdict"] not in (None, *sides):
        raise ValueError(f"the DDP hook state's trial verdict must be None, {sides[0]!r} or "
                         f"{sides[1]!r}, got {trial['verdict']!r}")
    return trial
