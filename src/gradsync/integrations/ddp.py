"""DDP integration: a comm hook that sparsifies inside each DDP bucket.

``gradsync.ddp.register(ddp_model, cfg)`` installs the hook; ``gradsync.ddp.hook(cfg, model)``
returns ``(state, hook)``. Lightning, Accelerate and the Trainer install it through
:mod:`gradsync.lightning`, :mod:`gradsync.accelerate` and :mod:`gradsync.transformers`.

Per bucket (SSFusion §III–IV on DDP's own fusion buffers; docs/architecture.md, "Through the
DDP comm hook"): ``dense`` all-reduces it; ``per_tensor`` sparsifies every tensor and
all-gathers the selections (TopkA); ``ssfusion`` keeps tensors below ``small_numel``
(SSFusion's 102,400-element heuristic) whole as far as the density budget allows (smallest
first: ``schedule.ssfusion.small_within_budget``), first in the all-gather as values without
indices, and lowers the others' density by SSFusion's compensation, computed once over the
model (§IV-B(i)); ``ssfusion_oi`` all-reduces the whole tensors instead (SSFusion-I); ``auto``
predicts per bucket from link and sparsifier costs measured once, then keeps the prediction
only if it beats all-dense in a measured A-B-B-A trial (``HookState.auto``), because the
model under-predicts inline sparsification where ranks share cores (docs/results/speed.md,
"The DDP hook's `auto`, measured"). Unlike :class:`gradsync.GradSync` the fusion buffer is
DDP's bucket and the selection rule a size threshold (Eq. 2 needs the engine's cost model);
the rest is the engine's step pipeline, written once: a bucket becomes the engine's jobs
(``plan_jobs``, ``at_density``), accumulated once by ``engine.prepare.accumulate`` (one
error-feedback buffer per bucket, its all-reduce and all-gather parts alike), each job's payload
made by ``engine.prepare.select``, sent as ``Payload.message`` and committed by
``engine.apply.commit``.
A NaN/Inf travels in the bucket's own collectives, so every rank sees it alike and keeps its
residuals: ``Config.nonfinite="raise"`` fails a future of the step (DDP raises from
``backward()`` on every rank), ``"skip_step"`` leaves the non-finite average in ``.grad``, as
DDP would. A sparse bucket reads nothing: its checks (finite gradients and sums, the
collective's message, missing tensors) wait on the device until the step's last bucket, which
reads them all in one copy and only then commits or drops each bucket's error feedback. At
P > 1, in a step whose buckets ran a sparse collective, one int64 word joins that read,
all-reduced (MAX) on the device before it: whether some rank received a malformed message. So
every rank fails that step's ``backward()`` (the receiving rank with the check's message, the
others saying another rank received one) and keeps its residuals, instead of its peers applying
the step and then waiting for it at the next collective.
:meth:`HookState.follow` keeps error feedback in a GradScaler's units.

Facts this relies on (docs/architecture.md, "torch.distributed facts"): the hook's second
parameter must be named ``bucket`` and annotated ``dist.GradBucket`` itself (so no ``from
__future__ import annotations`` here); plain functions work, ``functools.partial`` and callable
instances do not; buckets are rebuilt after iteration 0, so state is keyed by parameter name;
under ``no_sync()`` the hook is not called; on gloo a second collective cannot be launched from
``Future.then``, so a sparse bucket's collectives run blocking and return a completed future,
and a bucket sent whole is one asynchronous all-reduce with only the averaging in ``.then``.
:class:`HookState` is :class:`gradsync.engine.state.Stateful` (``"ddp_hook:<scheme>"``).
"""

import contextlib
import functools
import math
import statistics
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradsync import collectives, sparsify
from gradsync.collectives.comm import Comm, CommStats
from gradsync.engine.apply import agreement_word, commit, job_check, settle_missing
from gradsync.engine.config import Config, require_config
from gradsync.engine.consistency import signature_check
from gradsync.engine.density import DensitySchedule
from gradsync.engine.jobs import Job, Payload, at_density, plan_jobs
from gradsync.engine.preconditioning import apply_scales
from gradsync.engine.prepare import accumulate, select
from gradsync.engine.state import Identity, check_identity
from gradsync.engine.warmup import link_costs
from gradsync.feedback import (
    ErrorFeedback,
    check_scaler,
    clip_local,
    follow_scale,
    saved_scale,
)
from gradsync.schedule import BufferPlan, Plan, TensorPlan, schemes
from gradsync.schedule.auto import MARGIN, bucket_sparse
from gradsync.schedule.costmodel import AffineFit, AlphaBeta
from gradsync.schedule.ssfusion import (
    allgather_charge,
    allreduce_charge,
    compensate,
    dishonoured_density,
    small_within_budget,
)
from gradsync.sparsegrad import all_finite, finite_flag, largest, target_k
from gradsync.sparsify import segments

__all__ = ["DDP_SCHEMES", "TRIAL_ORDER", "TRIAL_STEPS", "HookState", "hook", "register"]

# auto's trial of its prediction against all-dense: windows of TRIAL_STEPS steps, A-B-B-A
TRIAL_STEPS = 5
TRIAL_ORDER = ("model", "dense", "dense", "model")

# The schemes with a DDP hook: the rows of the table of schemes marked ``ddp_hook``.
DDP_SCHEMES = tuple(name for name, s in schemes.SCHEMES.items() if s.ddp_hook)
SMALL_NUMEL = 102_400  # SSFusion Insight #2: ~200 KB of fp32
# Config fields that change the hook's trajectory: a checkpoint must be loaded with equal values.
RESUME_FIELDS = ("scheme", "density", "sparsifier", "momentum", "min_density", "seed",
                 "residual_dtype", "density_warmup", "density_warmup_steps", "min_k",
                 "clip_norm", "density_schedule")


@dataclass
class _Model:
    """What the hook knows of the model and its ranks, set once."""

    names: dict[int, str] = field(default_factory=dict)  # id(param) -> name
    shapes: list[tuple[str, tuple[int, ...]]] | None = None  # the model's, when known
    trained: tuple[int, ...] | None = None  # numels of the parameters DDP reduces (trainable)
    checked: bool = False  # configuration agreed across ranks
    # world size 1 without Config.compress_single_rank: every bucket sent whole (dense path)
    passthrough: bool = False


@dataclass
class _Scratch:
    """This step's sparse buckets, their checks on the device: read once, at the last bucket,
    where error feedback commits (or drops) each of them (:func:`_settle`)."""

    pending: list["_Pending"] = field(default_factory=list, repr=False)
    wire_checks: list[tuple[torch.Tensor, str]] = field(default_factory=list, repr=False)


@dataclass
class _Counts:
    """What the hook has done, for ``stats()``; ``steps`` is also DGC's warm-up clock."""

    last: CommStats = field(default_factory=CommStats)
    total: CommStats = field(default_factory=CommStats)
    calls: int = 0
    steps: int = 0  # backward passes seen (DDP's last bucket of each)
    missing: int = 0
    tensors: int = 0
    nonfinite: int = 0  # buckets whose sum was NaN/Inf (module doc, "Non-finite gradients")
    # SSFusion: the density the model sends, in entries per element (the tensors sent whole
    # charged at their bytes); set at the first sparse bucket (honour())
    sent_density: float | None = None
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)  # gloo's thread


@dataclass
class _Auto:
    """``auto``: the measured link and the trial of its prediction against all-dense."""

    link: tuple[Any, ...] | None = None  # the measured (all-reduce, all-gather, sparsify)
    # {"start": step, "times": {"model": [...], "dense": [...]}, "verdict": None | "model" |
    # "dense"}; None: no trial (yet)
    trial: dict[str, Any] | None = None
    last_first: tuple[int, float] | None = None  # (step, time) of the last first bucket
    # the trial's clock (seconds); a test gives its own, so that a verdict never rests on
    # how loaded the machine was
    clock: Callable[[], float] = field(default=time.perf_counter, repr=False)


@dataclass
class _Amp:
    """Mixed precision: a GradScaler to follow (``follow()``) and the loss scale error
    feedback's contents are in."""

    scaler: Any = field(default=None, repr=False)
    loss_scale: float | None = None


@dataclass
class HookState:
    """Everything the hook keeps between calls (pass it as DDP's comm ``state``), by role:
    the configuration (``cfg``, ``group``, ``small_numel``), what compresses (``ef``,
    ``sparsifiers``, ``density``, ``collective``), the model (``model``), this step's
    buckets (``scratch``), the counts (``counts``), ``auto``'s trial (``auto``) and mixed
    precision (``amp``).

    Implements :class:`gradsync.engine.state.Stateful`: ``state_dict()`` holds this rank's
    residuals and sparsifier generators (and ``auto``'s measured link, so a resumed job decides
    every bucket as before) with its rank, world size and configuration, and
    ``load_state_dict`` refuses another rank's state, world size, configuration or model.
    """

    cfg: Config
    group: dist.ProcessGroup | None = None
    small_numel: int = SMALL_NUMEL
    ef: ErrorFeedback = field(init=False)
    sparsifiers: dict[str, sparsify.Sparsifier] = field(default_factory=dict)
    density: DensitySchedule = field(init=False)  # each step's density (Accordion, DGC)
    collective: collectives.Collective = field(init=False)  # for the sparse parts
    model: _Model = field(default_factory=_Model)
    scratch: _Scratch = field(default_factory=_Scratch)
    counts: _Counts = field(default_factory=_Counts)
    auto: _Auto = field(default_factory=_Auto)
    amp: _Amp = field(default_factory=_Amp)

    @property
    def scheme(self) -> schemes.Scheme:
        """The row of the table of schemes."""
        return schemes.get(self.cfg.scheme)

    def __post_init__(self) -> None:
        if not self.scheme.ddp_hook:
            raise ValueError(f"the DDP hook supports schemes {DDP_SCHEMES}, got "
                             f"{self.cfg.scheme!r} (use gradsync.GradSync for the others)")
        if self.cfg.plan is not None:
            raise ValueError("the DDP hook takes no Config.plan: it decides per DDP bucket "
                             "(Config.plan is for gradsync.GradSync)")
        if self.small_numel < 0:
            raise ValueError(f"small_numel must be >= 0, got {self.small_numel}")
        self.ef = self.cfg.new_feedback()
        self.density = DensitySchedule(self.cfg)
        options = {k: getattr(self.cfg, k) for k in self.scheme.collective_options}
        # each bucket's description agreed once, not every step (DDP checked the parameters'
        # shapes at construction; every rank passes the same buckets)
        self.collective = collectives.get(self.scheme.collective, check_shapes="changes",
                                          **options)

    def reconfigure(self, cfg: Config) -> None:
        """Run ``cfg`` instead of the configuration given, before the hook's first call (the
        AdamW recipe of a door that sees the optimizer only after DDP's wrapping,
        :mod:`gradsync.integrations.adamw`)."""
        if self.counts.calls:
            raise RuntimeError("HookState.reconfigure: the hook has run already")
        self.cfg = require_config(cfg, "HookState.reconfigure")
        self.__post_init__()

    def name_of(self, p: torch.Tensor) -> str:
        name = self.model.names.get(id(p))
        if name is None:  # no model given: stable within the run only
            name = self.model.names[id(p)] = f"param{len(self.model.names)}:{tuple(p.shape)}"
        return name

    def rescale(self, factor: float) -> None:
        """The gradients are ``factor`` times larger from the next step on (a changed loss
        scale): residuals and velocities held are multiplied by it now, as
        :meth:`gradsync.GradSync.rescale` does, and the thresholds its sparsifiers keep (none
        of the hook's reuses one today). Between steps, the same factor on every rank."""
        self.ef.rescale(factor)  # checks the factor first
        for sp in self.sparsifiers.values():
            sp.rescale(factor)

    def follow(self, scaler: Any) -> None:
        """Follow ``scaler`` (a ``torch.amp.GradScaler``): from the next step on, the hook reads
        ``scaler.get_scale()`` at each step's first bucket and, when it differs from the scale
        error feedback's contents are in, calls :meth:`rescale` with ``new / old`` before
        anything accumulates. ``scaler.update()`` runs between steps on every rank alike, so
        every rank sees the same scale. A scaler skips the steps whose gradients overflow, so
        the hook must leave them in ``.grad``: ``Config(nonfinite="skip_step")``, else
        ``ValueError``. On CUDA reading the scale waits for the device once per step (so does
        ``scaler.step``)."""
        check_scaler(scaler, self.cfg.nonfinite, "HookState")
        self.amp.scaler = scaler

    def precondition(self, scales: Mapping[torch.Tensor | str, torch.Tensor]) -> None:
        """:meth:`gradsync.GradSync.precondition` for the hook: from the next backward on,
        every bucket compresses ``scale ⊙ gradient`` of the given parameters (a parameter, or
        its name when the hook was given the model), and DDP's ``.grad`` holds the averaged
        scaled update. Checked across ranks; call it between steps."""
        shapes = dict(self.model.shapes or [])

        def resolve(key: object) -> tuple[str, tuple[int, ...]]:
            if isinstance(key, str):
                if key not in shapes:
                    raise ValueError(f"HookState.precondition: no parameter named {key!r} "
                                     "(names need hook(cfg, model))")
                return key, shapes[key]
            if not isinstance(key, torch.Tensor):
                raise ValueError(f"HookState.precondition: keys are parameters or names, got "
                                 f"{type(key).__name__}")
            return self.name_of(key), tuple(key.shape)

        apply_scales(self.ef, scales, resolve, self.group, "HookState")

    def _new_sparsifier(self, name: str, density: float) -> sparsify.Sparsifier:
        return sparsify.get(self.scheme.sparsifier or self.cfg.sparsifier, density=density,
                            seed=sparsify.seed_for(self.cfg.seed, name, self.identity().rank))

    def sparsifier(self, name: str, density: float) -> sparsify.Sparsifier:
        sp = self.sparsifiers.get(name)
        if sp is None or sp.density != density:
            sp = self.sparsifiers[name] = self._new_sparsifier(name, density)
        return sp

    def honour(self, sent: float) -> None:
        """Record the density the model sends (``stats()["density"]``) and, when it is above
        the one asked for by more than 5 % (the tensors that must travel whole exceed the
        budget), say so once, on rank 0."""
        self.counts.sent_density = sent
        why = dishonoured_density(self.cfg.scheme, self.cfg.density, sent, self.cfg.effective_min_k)
        if why is not None and self.identity().rank == 0:
            warnings.warn(why, stacklevel=2)

    def stats(self) -> dict[str, Any]:
        c = self.counts
        return {"last": c.last.as_dict(), "total": c.total.as_dict(),
                "calls": c.calls, "nonfinite_buckets": c.nonfinite,
                "missing_rate": c.missing / c.tensors if c.tensors else 0.0,
                "density": {"requested": self.cfg.density, "sent": c.sent_density,
                            **self.density.summary()}}

    # -- checkpointing (gradsync.engine.state.Stateful) ---------------------------------
    def identity(self) -> Identity:
        """``"ddp_hook:<scheme>"``, this rank and the size of the hook's group."""
        comm = Comm(self.group)
        return Identity(f"ddp_hook:{self.cfg.scheme}", comm.rank, comm.size, self.group)

    def _params(self) -> dict[str, list[int]] | None:
        return None if self.model.shapes is None else {n: list(s) for n, s in self.model.shapes}

    def state_dict(self) -> dict[str, Any]:
        """This rank's residuals and sparsifier generators, with what they depend on."""
        me, link, trial = self.identity(), self.auto.link, self.auto.trial
        return {"rank": me.rank, "world_size": me.world_size, "config": self.cfg.to_dict(),
                "small_numel": self.small_numel, "params": self._params(),
                "feedback": self.ef.state_dict(), "steps": self.counts.steps,
                "loss_scale": self.amp.loss_scale,
                "density_schedule": self.density.state_dict(),
                "sparsifiers": {k: s.state_dict() for k, s in self.sparsifiers.items()},
                "link": None if link is None else [vars(x).copy() for x in link],
                "trial": None if trial is None else {
                    **trial, "times": {k: list(v) for k, v in trial["times"].items()}}}

    @staticmethod
    def _link_from(state: dict[str, Any]) -> tuple[Any, ...] | None:
        """``auto``'s measured link in ``state`` (``None``: absent, measured again at the next
        call); ``ValueError`` when malformed."""
        saved = state.get("link")
        if saved is None:
            return None
        try:
            ar, ag, sp = saved
            return AlphaBeta(**ar), AlphaBeta(**ag), AffineFit(**sp)
        except (ValueError, TypeError) as e:
            raise ValueError(f"the DDP hook state's link entry is malformed ({e}): "
                             f"{saved!r:.200}") from None

    def check_compatible(self, state: dict[str, Any]) -> None:
        """Raise ``ValueError`` unless ``state`` was saved by this rank of a job with the same
        world size, trajectory-relevant configuration and model; changes nothing."""
        check_identity(state, self.identity(), "DDP hook")
        saved = state.get("config")
        if not isinstance(saved, dict):
            raise ValueError("not a DDP hook state_dict (no config entry)")
        diff = self.cfg.differences(saved, RESUME_FIELDS)
        if state.get("small_numel") != self.small_numel:
            diff.append(f"small_numel: saved {state.get('small_numel')!r}, "
                        f"here {self.small_numel!r}")
        if diff:
            raise ValueError(f"the DDP hook state was saved with a different configuration: "
                             f"{diff}")
        mine, theirs = self._params(), state.get("params")
        if mine is not None and theirs is not None and mine != theirs:
            bad = sorted(set(mine) ^ set(theirs)) or sorted(
                n for n in mine if mine[n] != theirs[n])
            raise ValueError(f"the DDP hook state is for a different model (parameters "
                             f"{bad[:5]} differ)")
        self._link_from(state)
        self._trial_from(state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` of this rank; raises before changing anything."""
        self.check_compatible(state)
        ef = self.cfg.new_feedback()
        ef.load_state_dict(state["feedback"])
        sparsifiers = {}
        for k, s in state["sparsifiers"].items():
            sparsifiers[k] = self._new_sparsifier(k, s["density"])
            sparsifiers[k].load_state_dict(s)
        link = self._link_from(state)
        trial = self._trial_from(state)
        scale = saved_scale(state.get("loss_scale"), "HookState.load_state_dict")
        density = DensitySchedule.loaded(self.cfg, state.get("density_schedule"))
        self.ef, self.sparsifiers, self.density = ef, sparsifiers, density
        self.counts.steps = int(state.get("steps", 0))
        self.amp.loss_scale = scale
        self.auto.link, self.auto.trial, self.auto.last_first = link, trial, None

    @staticmethod
    def _trial_from(state: dict[str, Any]) -> dict[str, Any] | None:
        """``auto``'s trial in ``state`` (``None``: absent); ``ValueError`` when malformed."""
        saved = state.get("trial")
        if saved is None:
            return None
        try:
            trial = {"start": int(saved["start"]), "verdict": saved["verdict"],
                     "times": {k: [float(t) for t in saved["times"][k]]
                               for k in ("model", "dense")}}
            if "measured" in saved:  # the agreed means behind the verdict
                trial["measured"] = {k: float(saved["measured"][k]) for k in ("model", "dense")}
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"the DDP hook state's trial entry is malformed ({e!r}): "
                             f"{saved!r:.200}") from None
        if trial["verdict"] not in (None, "model", "dense"):
            raise ValueError(f"the DDP hook state's trial verdict must be None, 'model' or "
                             f"'dense', got {trial['verdict']!r}")
        return trial

    def auto_mode(self) -> str:
        """``auto``'s mode at this step: ``"model"`` (the prediction's buckets) or ``"dense"``
        (every bucket all-reduced): the trial's window, or its verdict once it is over (the
        step whose first bucket takes the verdict reads as the last window before it runs)."""
        t = self.auto.trial
        if t is None:
            return "model"
        if t["verdict"] is not None:
            return t["verdict"]
        if self.counts.steps < t["start"]:
            return "model"
        window = (self.counts.steps - t["start"]) // TRIAL_STEPS
        return TRIAL_ORDER[min(window, len(TRIAL_ORDER) - 1)]

    def _time_step(self, first_bucket: bool, comm: Comm) -> None:
        """At DDP's first bucket of a step: the previous step's time goes to its window; after
        the last window the ranks agree on the verdict (one 16-byte max-reduce)."""
        t = self.auto.trial
        if t is None or t["verdict"] is not None or not first_bucket:
            return
        now = self.auto.clock()
        prev, self.auto.last_first = self.auto.last_first, (self.counts.steps, now)
        if prev is not None and prev[0] == self.counts.steps - 1 and prev[0] >= t["start"]:
            w = (prev[0] - t["start"]) // TRIAL_STEPS
            if w < len(TRIAL_ORDER):
                t["times"][TRIAL_ORDER[w]].append(now - prev[1])
        if self.counts.steps - t["start"] < len(TRIAL_ORDER) * TRIAL_STEPS:
            return
        means = torch.tensor([statistics.fmean(t["times"][k]) if t["times"][k] else math.inf
                              for k in ("model", "dense")], dtype=torch.float64)
        comm.all_reduce(means, op=dist.ReduceOp.MAX)  # every rank: the same verdict
        model, dense = means.tolist()
        t["verdict"] = "model" if model < dense * (1 - MARGIN) else "dense"
        t["measured"] = {"model": model, "dense": dense}


def _densities(state: HookState, numels: list[int], elem_bytes: int = 4,
               comm: Comm | None = None, device: torch.device | None = None
               ) -> list[float | None]:
    """Per-tensor density of one bucket; None = sent dense. A tensor that ``Config.density``
    would give fewer than ``Config.min_k`` entries is sent whole, as the engine's planners
    do (:func:`gradsync.schedule.plan.whole_below`); SSFusion's compensated d′ may then give a
    sparsified tensor fewer, as the engine's SSFusion does."""
    k_min, density = state.cfg.effective_min_k, state.cfg.density
    return [None if d is None or target_k(n, density) < k_min else d
            for n, d in zip(numels, _scheme_densities(state, numels, elem_bytes, comm, device))]


def _scheme_densities(state: HookState, numels: list[int], elem_bytes: int,
                      comm: Comm | None, device: torch.device | None) -> list[float | None]:
    """Per-tensor density of one bucket as the scheme chooses it; None = sent dense.

    ``per_tensor``: every tensor at ``density``. SSFusion: tensors below ``small_numel`` are
    not sparsified, smallest first and only while the budget lets the other tensors absorb
    them (:func:`gradsync.schedule.ssfusion.small_within_budget`: on a model whose tensors are
    all small, most of them are sparsified), and the others get SSFusion's density-aware
    compensation, the engine
    planner's function (:func:`gradsync.schedule.ssfusion.compensate`), applied as §IV-B(i)
    says: over the **whole model** — once, over every trainable parameter of the model given
    to :func:`hook`/:func:`register` (frozen ones never reach DDP's buckets; the set is read
    at registration) — so the model sends about ``density × trained numel`` entries
    and every sparsified tensor gets the same d′ (floor ``min_density``), whatever bucket it
    is in. Without a model the hook only sees buckets, and compensates within each bucket.
    The unsparsified tensors are charged at what they send, so the model sends the target's
    bytes as the engine's SSFusion does: ``ssfusion`` sends them as values without indices
    (:func:`gradsync.schedule.ssfusion.allgather_charge`: 1/2 of an entry per fp32 element),
    ``ssfusion_oi`` all-reduces them (:func:`gradsync.schedule.ssfusion.allreduce_charge`: 1/P
    of an all-gathered entry per fp32 element).
    """
    cfg = state.cfg
    if state.scheme.planner == "auto":  # measured once, agreed by every rank
        P = dist.get_world_size(state.group)
        if state.auto.link is None and P > 1:
            # the sparsifier is timed where the gradients are (a GPU job: on its GPU); the
            # probe's traffic is counted in this call's
            state.auto.link = link_costs(state._new_sparsifier("auto:probe", cfg.density),
                                         state.group, comm, device)
        sparse = P > 1 and bucket_sparse(numels, cfg.density, P, elem_bytes, *state.auto.link)
        if sparse and state.auto.trial is None:  # the prediction sparsifies: measure it
            state.auto.trial = {"start": state.counts.steps + 1, "verdict": None,
                           "times": {"model": [], "dense": []}}
        if state.auto.trial is not None and state.auto_mode() == "dense":
            sparse = False
        return [cfg.density if sparse else None] * len(numels)
    if state.scheme.planner == "per_tensor":
        return [cfg.density] * len(numels)
    # the unsparsified tensors travel whole, charged at their bytes: values only in the
    # all-gather (its dense prefix), or in SSFusion-I's all-reduce
    P = comm.size if comm is not None else 1
    charge = (allreduce_charge if state.scheme.interleave else allgather_charge)(P, elem_bytes)
    whole, d, sent = _ssfusion_plan(state.model.trained or tuple(numels), state.small_numel,
                                    cfg.density, cfg.min_density, charge, cfg.effective_min_k)
    if state.model.trained is not None and state.counts.sent_density is None:
        state.honour(sent)
    return [None if n < whole else d for n in numels]


@functools.lru_cache(maxsize=64)
def _ssfusion_plan(numels: tuple[int, ...], small_numel: int, density: float,
                   min_density: float, charge: float, min_k: int
                   ) -> tuple[int, float | None, float]:
    """SSFusion over all of a model's parameters (computed once): the size below which a tensor
    travels whole (:func:`gradsync.schedule.ssfusion.small_within_budget`: ``small_numel``,
    lowered to the compensation budget), the compensated d′ of the others (§IV-B(i)), and the
    density the model then sends, in entries at ``charge`` per element sent whole."""
    whole, _ = small_within_budget(numels, small_numel, density, min_density, charge, min_k)
    d, _ = compensate(numels, [n >= whole for n in numels], density, min_density, charge)
    sent = sum(charge * n if n < whole or d is None else target_k(n, d) for n in numels)
    return whole, d, sent / max(1, sum(numels))


def _sparse_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The comm hook: a bucket sent whole leaves its all-reduce in flight (DDP's own path);
    a bucket with sparse parts runs its collectives blocking and returns a completed future."""
    if not state.model.checked:
        _agree(state)
    if state.amp.scaler is not None and bucket.index() == 0:  # DDP reduces bucket 0 first
        state.amp.loss_scale = follow_scale(state.amp.loss_scale, state.amp.scaler, state.rescale)
    buf = bucket.buffer()
    comm = Comm(state.group)
    if state.scheme.planner == "auto":
        state._time_step(bucket.index() == 0, comm)
    params = bucket.parameters()
    numels = [p.numel() for p in params]
    names = [state.name_of(p) for p in params]
    offsets = [0]
    for n in numels:
        offsets.append(offsets[-1] + n)
    if not state.scheme.sparse or state.model.passthrough:
        # dense, or world size 1 (Config.compress_single_rank): a plain all-reduce, of the
        # velocities with momentum (and at P = 1 of the clipped gradients with clip_norm)
        clip = state.model.passthrough and state.cfg.clip_norm is not None
        return _all_reduce_bucket(state, comm, buf, names, offsets, bucket.is_last(),
                                  clip or any(state.ef.transforms(name) for name in names),
                                  bucket.index())
    densities = _densities(state, numels, buf.element_size(), comm, buf.device)
    if state.scheme.planner == "auto" and all(d is None for d in densities):
        # every tensor sent whole: DDP's own path, the all-reduce left in flight so the
        # backward goes on (a blocking one here held autograd: 0.69-0.87x DDP); through
        # error feedback, which holds what earlier sparse steps left behind
        return _all_reduce_bucket(state, comm, buf, names, offsets, bucket.is_last(), True,
                                  bucket.index())
    # SSFusion-I and auto: dense tensors in an all-reduce part
    jobs = _bucket_jobs(tuple(names), tuple(numels), tuple(densities),
                        state.scheme.interleave or state.scheme.planner == "auto",
                        state.scheme.collective)
    # DGC's warm-up (Config.density_warmup), as the engine's jobs take it; at density 1 every
    # entry travels in an all-reduce (DDP's bytes, not an all-gather of all of it)
    d_now = state.density.at(state.counts.steps)
    jobs = tuple(at_density(job, d_now, state.cfg.density) for job in jobs)
    return _send_bucket(state, bucket, comm, jobs, names, numels, offsets)


@functools.lru_cache(maxsize=256)
def _bucket_jobs(names: tuple[str, ...], numels: tuple[int, ...],
                 densities: tuple[float | None, ...], to_allreduce: bool, collective: str
                 ) -> tuple[Job, ...]:
    """The bucket as the engine's jobs (a plan of one per-tensor buffer, through
    :func:`gradsync.engine.jobs.plan_jobs`): the tensors sent whole in an all-reduce part
    (SSFusion-I, ``auto``, a warm-up step at density 1), then the all-gather's, its tensors sent
    whole first (the selection's dense prefix: values without indices), then the selected
    ones. Cached: DDP's buckets keep their layout and their densities (``auto``'s change with
    its verdict; DGC's warm-up scales the jobs after, :func:`~gradsync.engine.jobs.at_density`)."""
    tensors = tuple(TensorPlan(n, k, d, allreduce=d is None and to_allreduce)
                    for n, k, d in zip(names, numels, densities))
    return tuple(plan_jobs(Plan("ddp_hook", [BufferPlan(tensors, "per_tensor")]), collective,
                           names))


def _send_bucket(state: HookState, bucket: dist.GradBucket, comm: Comm, jobs: tuple[Job, ...],
                 names: list[str], numels: list[int], offsets: list[int]
                 ) -> torch.futures.Future[torch.Tensor]:
    """A bucket with sparse parts, through the engine's pipeline: local clipping and error
    feedback once for the bucket (:func:`gradsync.engine.prepare.accumulate`: one buffer in
    travel order, its all-reduce part first), each job's payload as the engine makes it
    (:func:`gradsync.engine.prepare.select`; the all-reduce part sums in the accumulator itself
    when error feedback made it new), the all-reduce part issued first and interleaved with the
    all-gather's collective, and the bucket's error feedback committed at the step's last
    bucket (:func:`_settle`, :func:`gradsync.engine.apply.commit`). Nothing is read here: a
    bucket whose gradients hold a NaN/Inf selects from zeros and sends one NaN, the message
    every rank expects, so every rank's sum shows it (module doc)."""
    buf, P, key = bucket.buffer(), comm.size, bucket.index()
    position = {n: i for i, n in enumerate(names)}
    order = [n for job in jobs for n in job.names]  # the travel order: jobs after each other
    travel = _Travel([position[n] for n in order], offsets, numels, buf.device)
    grad = travel.gather(buf)
    state.density.observe(grad)
    # the bucket's gradients checked once, whatever its number of jobs (no read: module doc)
    here = finite_flag(grad)
    clip = None if state.cfg.clip_norm is None else (state.cfg.clip_norm, P)
    # error feedback keeps the bucket as one buffer in travel order, whatever its jobs (the
    # all-reduce part first, SSFusion-I): one accumulation, one commit
    sizes = [numels[position[n]] for n in order]
    acc = accumulate(key, order, sizes, grad, state.ef, clip, here)
    writable = state.ef.writable(key, acc)  # the all-reduce part may sum in acc itself
    parts: list[tuple[Job, list[int], Payload]] = []
    i = at = whole = 0  # whole: the entries of the all-reduce part, ahead of the all-gather's
    for job in jobs:
        job_sizes, i = sizes[i:i + len(job.names)], i + len(job.names)
        n = sum(job_sizes)
        payload, _ = select(job, key, acc[at:at + n], job_sizes, state.sparsifier, None,
                            state.counts.steps, buf.dtype, writable)
        parts.append((job, job_sizes, payload))
        at += n
        whole += n if payload.dense is not None else 0
    sums, res, sel, stats = _launch(state, comm, parts, here)
    out = sums[0] if len(sums) == 1 else torch.cat(sums)  # the sums, in travel order
    kept = None if res is None else res.kept.to(torch.int64)
    # the all-gather part's missing tensors: on the host when it kept this rank's selection
    known = None if res is None else parts[-1][2].known_missing(sel, res.kept)
    state.scratch.pending.append(_Pending(
        key, names, acc, kept, whole,
        buf.dtype, largest(out), here,  # the sums' largest magnitude: alike on every rank
        None if kept is None or known is not None else job_check(parts[-1][1], kept),
        known or 0))
    state.counts.tensors += len(names)
    travel.average_into(buf, out, P)  # a non-finite average too: .grad shows it (module doc)
    return _done(state, stats, buf, bucket.is_last())


def _launch(state: HookState, comm: Comm, parts: list[tuple[Job, list[int], Payload]],
            here: torch.Tensor) -> tuple[list[torch.Tensor], Any, Any, CommStats]:
    """A bucket's parts on the wire: the all-reduce part issued first and interleaved with the
    all-gather's collective; returns the sums in travel order, the all-gather's result and
    message (None: no all-gather part) and the traffic. A poisoned bucket's first value becomes
    NaN by one division by the finiteness flag ``here`` (accumulate zeroed the bucket's
    accumulator, so it is 0/0; a finite bucket's is x/1 = x exactly): in one part only, the
    sums' flag covers them all."""
    res = sel = None
    works: list[Any] = []
    sums: list[torch.Tensor] = []
    stats = comm.stats
    poison: torch.Tensor | None = here
    try:
        for job, _, payload in parts:
            if payload.dense is not None:  # an all-reduce part, interleaved with the
                sums.append(payload.dense)  # all-gather below
                poison = _poison(sums[-1], poison)
                work = comm.all_reduce(sums[-1], async_op=True)
                works += [work] if work is not None else []  # None: one rank
                continue
            # poisoned: the selection of zeros (every rank's message has the capacity they
            # expect), one value NaN
            sel = payload.message(job, payload.selections)
            poison = _poison(sel.values, poison)
            res = state.collective(sel, group=state.group, step=state.counts.steps,
                                   deferred=state.scratch.wire_checks)
            sums.append(res.dense)
            stats += res.stats
    except BaseException:
        # SSFusion-I's all-reduce is waited for on every path, a failing all-gather included:
        # a work left pending keeps this bucket's tensors in gloo's worker thread, which may
        # then release them while the interpreter shuts down
        for work in works:
            with contextlib.suppress(Exception):
                work.wait()
        raise
    for work in works:  # Comm keeps the work, so gloo's thread never frees it (comm.py,
        work.wait()  # "Exit safety")
    return sums, res, sel, stats


def _poison(values: torch.Tensor, flag: torch.Tensor | None) -> torch.Tensor | None:
    """``values[0] /= flag`` (NaN where the bucket's gradients were not finite: see
    _send_bucket) unless a part already carries it (``flag`` None) or ``values`` is empty;
    returns the flag still to carry."""
    if flag is None or not values.numel():
        return flag
    values[:1].div_(flag)
    return None


@dataclass
class _Pending:
    """A sparse bucket's error-feedback step, committed at the step's last bucket once the
    checks of every bucket are read in one copy (:func:`_settle`)."""

    index: int  # the bucket's (its error feedback's key)
    names: list[str]
    acc: torch.Tensor  # the bucket's accumulator, in travel order
    kept: torch.Tensor | None  # the positions of the all-gather part that travelled, counted
    # from its start (None: every entry travelled)
    whole: int  # the entries of the all-reduce part, ahead of the all-gather's
    wire: torch.dtype  # the dtype its values travelled in
    top: torch.Tensor  # the sums' largest magnitude (on the device): finite when below +Inf,
    # compared for every bucket at once in _settle
    here: torch.Tensor  # this rank's gradients were finite
    check: torch.Tensor | None  # engine.apply.job_check of the all-gather part (None: none,
    # or its missing tensors known on the host)
    missing: int = 0  # the all-gather part's missing tensors, when known on the host


def _settle(state: HookState, comm: Comm) -> ValueError | None:
    """At a step's last bucket: every sparse bucket's checks in one read (with, at P > 1, the
    ranks' word on malformed messages: :func:`~gradsync.engine.apply.agreement_word`), then
    each bucket's error feedback committed (finite sums) or left as before the step (NaN/Inf:
    counted, and under ``Config.nonfinite="raise"`` the error of the first such bucket is
    returned; a malformed message on any rank: every bucket's, and the error returned on
    every rank)."""
    pending, state.scratch.pending = state.scratch.pending, []
    wire, state.scratch.wire_checks = state.scratch.wire_checks, []
    if not pending and not wire:
        return None
    checked = [p for p in pending if p.check is not None]
    oks = (torch.stack([p.top for p in pending]) < math.inf).unbind() if pending else ()
    # whether a bucket's collective ran is alike on every rank (the same jobs), so every rank
    # meets here; a step of plain all-reduces (DGC's warm-up at density 1) receives no message
    # to check
    ran = [p for p in pending if p.kept is not None]
    word = (agreement_word(comm, ran[0].top.device, wire) > 0
            if ran and comm.size > 1 else None)
    try:
        missing, flags = settle_missing(
            [p.check for p in checked], "a bucket's parts", "gradsync.ddp: ", wire,
            [f for p, ok in zip(pending, oks) for f in (ok, p.here)] + (
                [] if word is None else [word]))
    except ValueError as e:  # this rank received a malformed message: its check's message
        for p in pending:
            state.ef.discard_buffer(p.index)
        # without its traceback, whose frames hold this state: a dense last bucket's
        # callback carries the error, and gloo's thread drops it (_all_reduce_bucket)
        return e.with_traceback(None)
    if word is not None and flags.pop():
        for p in pending:
            state.ef.discard_buffer(p.index)
        return ValueError(f"gradsync DDP hook: step {state.counts.steps}: another rank received a "
                          "malformed message (its error names the check); residuals and "
                          "velocities were left as before the step")
    counts = {id(p): m for p, m in zip(checked, missing)}  # else p.missing: known
    error = None
    for p, ok, here in zip(pending, flags[0::2], flags[1::2]):
        if ok:  # a non-finite bucket's missing tensors are not counted: its step is not taken
            state.counts.missing += counts.get(id(p), p.missing)
            commit(state.ef, p.index, p.acc, p.kept, p.wire, p.whole)
            continue
        state.ef.discard_buffer(p.index)  # residuals and velocities as before this step
        err = _nonfinite(state, p.index, p.names, not here, comm.rank, state.counts.steps)
        error = error or err
    return error


class _Travel:
    """A bucket's tensors in the order they travel (``order``: bucket positions), and the way
    back. In bucket order nothing moves. Otherwise, on an accelerator one gather and one
    scatter by a position index made once per layout (a launch each, whatever the tensors);
    on the CPU, where an indexed pass costs several copies, one slice per tensor."""

    def __init__(self, order: list[int], offsets: list[int], numels: list[int],
                 device: torch.device) -> None:
        self.ordered = order == list(range(len(order)))
        self.spans = [(offsets[i], offsets[i] + numels[i]) for i in order]
        self.perm = None
        if not self.ordered and segments.pays_on(device):
            self.perm = _positions(tuple(lo for lo, _ in self.spans),
                                   tuple(hi - lo for lo, hi in self.spans), device)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        if self.ordered:
            return x
        if self.perm is not None:
            return x.index_select(0, self.perm)
        return torch.cat([x[lo:hi] for lo, hi in self.spans])

    def average_into(self, buf: torch.Tensor, sums: torch.Tensor, P: int) -> None:
        """``buf`` (bucket order) ← ``sums / P`` (travel order)."""
        if self.ordered:
            torch.div(sums, P, out=buf)
        elif self.perm is not None:
            buf.index_copy_(0, self.perm, torch.div(sums, P))
        else:
            avg, at = torch.div(sums, P), 0
            for lo, hi in self.spans:
                buf[lo:hi].copy_(avg[at:at + hi - lo])
                at += hi - lo


@functools.lru_cache(maxsize=32)
def _positions(starts: tuple[int, ...], lengths: tuple[int, ...], device: torch.device
               ) -> torch.Tensor:
    """The bucket positions of a travel order (cached: DDP's buckets keep their layout)."""
    return segments.ranges(starts, lengths, device)


def _clipped(state: HookState, buf: torch.Tensor, numels: list[int], P: int) -> torch.Tensor:
    """The bucket's gradients as error feedback takes them: clipped per tensor when
    ``Config.clip_norm`` is set (:func:`gradsync.feedback.clip_local`, DGC §3.3)."""
    if state.cfg.clip_norm is None:
        return buf
    return torch.cat(clip_local(list(buf.split(numels)), state.cfg.clip_norm, P))


def _all_reduce_bucket(state: HookState, comm: Comm, buf: torch.Tensor, names: list[str],
                       offsets: list[int], last: bool, feedback: bool,
                       bucket_index: int = 0) -> torch.futures.Future:
    """A bucket sent whole, as DDP's default hook sends it: issued, not waited for (the future
    completes with ``buf`` averaged once the sum is in). With ``feedback`` every tensor sends
    error feedback's ``acc`` (residual + gradient, momentum's velocity, a preconditioning
    scale), and its residual keeps only the rounding to the gradients' dtype, committed once
    the sum is in and finite; without, the raw gradients travel (nothing is held back for
    them). No tensor is checked on its own: a NaN/Inf shows in every rank's sum, which is
    checked where it arrives (module doc, "Non-finite gradients")."""
    acc = None
    if feedback:  # not checked here: a NaN/Inf travels and shows in every rank's sum
        numels = [offsets[i + 1] - offsets[i] for i in range(len(names))]
        acc = state.ef.accumulate_buffer(bucket_index, names, numels,
                                         _clipped(state, buf, numels, comm.size))
        buf.copy_(acc)  # rounded to the gradients' dtype; the residual keeps it
    state.counts.tensors += len(names)
    P, rank, step = comm.size, comm.rank, state.counts.steps
    # gloo's worker thread runs the callback and then drops it; if it held the state, the
    # process group the state holds could be freed there (comm.py, "Exit safety"): it holds a
    # weak reference, and DDP, which holds the state, outlives the step's callbacks
    owner = weakref.ref(state)

    def settle() -> torch.Tensor:
        """The sum is in ``buf``: a finite one commits error feedback (the residual keeps
        only the rounding), a non-finite one leaves it as before the step."""
        held = owner()
        if held is None:  # DDP and its hook are gone: no one reads this step
            return buf.div_(P)
        if all_finite(buf):
            if acc is not None:
                commit(held.ef, bucket_index, acc, None, buf.dtype)
        else:  # this rank's part is known only where it was kept apart (acc)
            if acc is not None:
                held.ef.discard_buffer(bucket_index)
            here = not all_finite(acc) if acc is not None else None
            err = _nonfinite(held, bucket_index, names, here, rank, step)
            if err is not None:
                del held  # not in the frame the error's traceback keeps (the future holds it)
                raise err  # in the callback: DDP's backward raises it on every rank
        return buf.div_(P)

    work = comm.all_reduce(buf, async_op=True)
    future = getattr(work, "get_future", None)
    if future is None:  # one rank, or a staged call that completed at issue
        try:
            settle()
        except ValueError as err:
            return _done(state, comm.stats, buf, last, err)
        return _done(state, comm.stats, buf, last)

    def average(fut: torch.futures.Future) -> torch.Tensor:
        fut.value()  # a failed all-reduce raises here, into DDP's backward
        return settle()

    # the sparse buckets' error (auto's), the last one settled here: after the average
    return _failing(future().then(average), _account(state, comm.stats, last))


def _nonfinite(state: HookState, index: int, names: list[str], here: bool | None,
               rank: int, step: int) -> ValueError | None:
    """A bucket's sum held NaN/Inf (on every rank alike): count it; under
    ``Config.nonfinite="raise"`` the error for the bucket's future (DDP raises it from
    ``backward()``; raised in the hook itself, it would leave DDP's reducer broken). May run on
    gloo's thread (a dense bucket's callback)."""
    with state.counts.lock:
        state.counts.nonfinite += 1
    if state.cfg.nonfinite == "raise":
        where = (f"on this rank ({rank})" if here
                 else "on some rank" if here is None
                 else "on another rank (or the sum overflowed)")
        return ValueError(
            f"gradsync DDP hook: non-finite gradient {where} in bucket {index} "
            f"({', '.join(names[:4])}{', ...' if len(names) > 4 else ''}) at step {step}; "
            "residuals and velocities were left as before the step (Config.nonfinite='raise'; "
            "'skip_step' leaves the non-finite average in .grad on every rank, as DDP does, "
            "for your check of .grad, or a GradScaler, to skip optimizer.step())")
    return None


def _account(state: HookState, stats: CommStats, last: bool) -> ValueError | None:
    """Count a bucket's traffic; at the last bucket settle the step (:func:`_settle`) and
    return its error, if any, for that bucket's future."""
    comm = Comm(state.group)
    error = _settle(state, comm) if last else None
    stats += comm.stats  # the malformed-message word, if one was all-reduced
    window = state.density.end_step(state.counts.steps, state.group) if last else None
    if window is not None:  # the density schedule's word, at a window's end
        stats += window
    state.counts.steps += int(last)
    state.counts.last = stats
    state.counts.total += stats
    state.counts.calls += 1
    return error


def _done(state: HookState, stats: CommStats, buf: torch.Tensor,
          last: bool = False, error: Exception | None = None) -> torch.futures.Future:
    """A completed future: ``buf``, or ``error`` (or the step's, settled at its last bucket)
    for DDP to raise from ``backward()``."""
    settled = _account(state, stats, last)
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(buf)
    return _failing(fut, error or settled)


def _failing(fut: torch.futures.Future, error: Exception | None) -> torch.futures.Future:
    """``fut``, or when ``error`` is given a future that raises it once ``fut`` completes."""
    if error is None:
        return fut

    def fail(done: torch.futures.Future) -> torch.Tensor:
        done.value()  # its own failure first
        raise error  # as a dense bucket's callback raises (set_exception reaches DDP's C++
        # reducer as "Unable to cast ...", not as the error)

    return fut.then(fail)


def hook(cfg: Config, model: nn.Module | None = None, group: dist.ProcessGroup | None = None,
         small_numel: int = SMALL_NUMEL) -> tuple[HookState, Any]:
    """``(state, hook)`` for frameworks with separate slots (Lightning, Accelerate).

    Pass ``model`` (the module DDP wraps) so residuals are keyed by parameter name, which
    makes ``state.state_dict()`` portable across restarts. The ranks' configurations and
    models are compared (one small all-gather) here when the process group already exists,
    otherwise at the hook's first call; a difference raises ``ValueError`` on every rank.
    """
    require_config(cfg, "gradsync.ddp.hook")
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(f"gradsync.ddp.hook: model must be the nn.Module DDP wraps, got "
                        f"{type(model).__name__}")
    state = HookState(cfg=cfg, group=group, small_numel=small_numel)
    if model is not None:
        state.model.names = {id(p): n for n, p in model.named_parameters()}
        state.model.shapes = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
        # frozen parameters never reach DDP's buckets: they take no part in the budget
        state.model.trained = tuple(p.numel() for p in model.parameters() if p.requires_grad)
    if dist.is_available() and dist.is_initialized():
        _agree(state)
    return state, _sparse_hook


def _agree(state: HookState) -> None:
    """All ranks must run the same hook configuration on the same model."""
    if not state.model.checked and dist.get_world_size(state.group) > 1:
        signature_check({"config": state.cfg.to_dict(), "small_numel": state.small_numel,
                         "params": state.model.shapes}, state.group)
    state.model.checked = True


def register(ddp_model: nn.parallel.DistributedDataParallel, cfg: Config,
             small_numel: int = SMALL_NUMEL) -> HookState:
    """Install the sparsifying comm hook on ``ddp_model``; returns its state (stats, ckpt).

    Raises ``TypeError`` when ``ddp_model`` is not a ``DistributedDataParallel`` or ``cfg`` not
    a :class:`~gradsync.Config`, and ``RuntimeError`` before ``init_process_group``.
    """
    require_config(cfg, "gradsync.ddp.register")
    if not isinstance(ddp_model, nn.parallel.DistributedDataParallel):
        raise TypeError(
            f"gradsync.ddp.register installs a comm hook on a DistributedDataParallel model; got "
            f"{type(ddp_model).__name__}: wrap it first, ddp_model = torch.nn.parallel."
            f"DistributedDataParallel(model) (after init_process_group), and pass ddp_model; "
            f"for a training loop without DDP use gradsync.GradSync(model, cfg)")
    if not (dist.is_available() and dist.is_initialized()):  # pragma: no cover - DDP needs it
        raise RuntimeError("gradsync.ddp.register: call torch.distributed.init_process_group "
                           "first (torchrun sets the environment it reads)")
    state, fn = hook(cfg, ddp_model.module, ddp_model.process_group, small_numel)
    # world size 1: nothing to send, every bucket whole (Config.compress_single_rank)
    state.model.passthrough = (dist.get_world_size(ddp_model.process_group) == 1
                         and not cfg.compress_single_rank)
    ddp_model.register_comm_hook(state, fn)
    return state
