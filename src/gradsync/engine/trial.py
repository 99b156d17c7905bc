"""``auto`` per DDP bucket: the prediction, and its measured A-B-B-A trial against all-dense.

The DDP hook's ``auto`` predicts per bucket from the link and sparsifier costs measured once
(:func:`~gradsync.engine.warmup.link_costs`, :func:`~gradsync.schedule.auto.bucket_sparse`),
then keeps the prediction only if it beats all-dense in a measured trial: windows of
:data:`TRIAL_STEPS` steps in the order :data:`TRIAL_ORDER` (A-B-B-A, so a drift of the machine
weighs on both alike), each step timed from one first bucket to the next, and the verdict taken
from the means max-reduced over the ranks (one 16-byte all-reduce), so every rank takes it
alike. The prediction must be :data:`~gradsync.schedule.auto.MARGIN` faster to be kept, because
the model under-predicts inline sparsification where ranks share cores (docs/results/speed.md,
"The DDP hook's `auto`, measured"). :class:`gradsync.GradSync`'s ``auto`` re-plans whole fusion
buffers instead (:mod:`.drift`), with the same margin and the same A-B-B-A order.
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

__all__ = ["TRIAL_ORDER", "TRIAL_STEPS", "AutoTrial"]

TRIAL_STEPS = 5
TRIAL_ORDER = ("model", "dense", "dense", "model")


@dataclass
class AutoTrial:
    """The measured link and the trial of its prediction against all-dense (module doc)."""

    link: tuple[Any, ...] | None = None  # the measured (all-reduce, all-gather, sparsify)
    # {"start": step, "times": {"model": [...], "dense": [...]}, "verdict": None | "model" |
    # "dense"}; None: no trial (yet)
    trial: dict[str, Any] | None = None
    last_first: tuple[int, float] | None = None  # (step, time) of the last first bucket
    # the trial's clock (seconds); a test gives its own, so that a verdict never rests on
    # how loaded the machine was
    clock: Callable[[], float] = field(default=time.perf_counter, repr=False)

    def mode(self, step: int) -> str:
        """``"model"`` (the prediction's buckets) or ``"dense"`` (every bucket all-reduced) at
        ``step``: the trial's window, or its verdict once it is over."""
        t = self.trial
        if t is None:
            return "model"
        if t["verdict"] is not None:
            return t["verdict"]
        if step < t["start"]:
            return "model"
        window = (step - t["start"]) // TRIAL_STEPS
        return TRIAL_ORDER[min(window, len(TRIAL_ORDER) - 1)]

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
        if sparse and self.trial is None:  # the prediction sparsifies: measure it
            self.trial = {"start": step + 1, "verdict": None, "times": {"model": [], "dense": []}}
        return sparse and (self.trial is None or self.mode(step) == "model")

    def time_step(self, step: int, comm: Comm) -> None:
        """At a step's first bucket: the previous step's time goes to its window; after the
        last window the ranks agree on the verdict (one 16-byte max-reduce)."""
        t = self.trial
        if t is None or t["verdict"] is not None:
            return
        now = self.clock()
        prev, self.last_first = self.last_first, (step, now)
        if prev is not None and prev[0] == step - 1 and prev[0] >= t["start"]:
            w = (prev[0] - t["start"]) // TRIAL_STEPS
            if w < len(TRIAL_ORDER):
                t["times"][TRIAL_ORDER[w]].append(now - prev[1])
        if step - t["start"] < len(TRIAL_ORDER) * TRIAL_STEPS:
            return
        means = torch.tensor([statistics.fmean(t["times"][k]) if t["times"][k] else math.inf
                              for k in ("model", "dense")], dtype=torch.float64)
        comm.all_reduce(means, op=dist.ReduceOp.MAX)  # every rank: the same verdict
        model, dense = means.tolist()
        t["verdict"] = "model" if model < dense * (1 - MARGIN) else "dense"
        t["measured"] = {"model": model, "dense": dense}

    def state_dict(self) -> dict[str, Any]:
        link, trial = self.link, self.trial
        return {"link": None if link is None else [vars(x).copy() for x in link],
                "trial": None if trial is None else {
                    **trial, "times": {k: list(v) for k, v in trial["times"].items()}}}

    @classmethod
    def from_state(cls, state: dict[str, Any], clock: Callable[[], float]) -> AutoTrial:
        """The trial of a hook's ``state_dict`` (its ``link`` and ``trial`` entries; absent:
        measured again); ``ValueError`` when malformed."""
        return cls(_link_from(state.get("link")), _trial_from(state.get("trial")), None, clock)


def _link_from(saved: Any) -> tuple[Any, ...] | None:
    if saved is None:
        return None
    try:
        ar, ag, sp = saved
        return AlphaBeta(**ar), AlphaBeta(**ag), AffineFit(**sp)
    except (ValueError, TypeError) as e:
        raise ValueError(f"the DDP hook state's link entry is malformed ({e}): "
                         f"{saved!r:.200}") from None


def _trial_from(saved: Any) -> dict[str, Any] | None:
    if saved is None:
        return None
    try:
        trial = {"start": int(saved["start"]), "verdict": saved["verdict"],
                 "times": {k: [float(t) for t in saved["times"][k]] for k in ("model", "dense")}}
        if "measured" in saved:  # the agreed means behind the verdict
            trial["measured"] = {k: float(saved["measured"][k]) for k in ("model", "dense")}
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"the DDP hook state's trial entry is malformed ({e!r}): "
                         f"{saved!r:.200}") from None
    if trial["verdict"] not in (None, "model", "dense"):
        raise ValueError(f"the DDP hook state's trial verdict must be None, 'model' or "
                         f"'dense', got {trial['verdict']!r}")
    return trial
