"""DDP integration: a comm hook that sparsifies inside each DDP bucket.

``gradsync.ddp.register(ddp_model, cfg)`` installs the hook; ``gradsync.ddp.hook(cfg, model)``
returns ``(state, hook)``. Lightning, Accelerate and the Trainer install it through
:mod:`gradsync.lightning`, :mod:`gradsync.accelerate` and :mod:`gradsync.transformers`.

Per bucket (SSFusion §III–IV on DDP's fusion buffers; docs/architecture.md, "Through the DDP
comm hook") the hook decides each tensor's density (:func:`_densities`), makes the bucket the
engine's jobs and hands it to :class:`gradsync.engine.pipeline.BufferPipeline` (error feedback,
selection, collectives, non-finite rule, deferred commit, merged buckets).

Facts this relies on (docs/architecture.md, "torch.distributed facts"): the hook's second
parameter must be named ``bucket`` and annotated ``dist.GradBucket`` itself (so no ``from
__future__ import annotations`` here); plain functions work, ``functools.partial`` and callable
instances do not; buckets are rebuilt after iteration 0, so state is keyed by parameter name;
under ``no_sync()`` the hook is not called. HookState is a ``Stateful`` (``"ddp_hook:<scheme>"``).
"""

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradsync import sparsify
from gradsync.collectives.comm import Comm
from gradsync.engine.components import Components
from gradsync.engine.config import Config, require_config
from gradsync.engine.consistency import signature_check
from gradsync.engine.density import DensitySchedule
from gradsync.engine.jobs import at_density, bucket_jobs
from gradsync.engine.pipeline import BufferPipeline, Counts, Scratch
from gradsync.engine.preconditioning import apply_scales, resolver
from gradsync.engine.state import Identity, check_identity, check_params
from gradsync.engine.trial import FUSION_SIDES, AutoTrial, fusion_from
from gradsync.feedback import ErrorFeedback, Units, saved_rates, saved_scale
from gradsync.integrations.budget import HookBudget
from gradsync.schedule import schemes
from gradsync.schedule.ssfusion import (
    allgather_charge,
    allreduce_charge,
    dishonoured_density,
    hook_interleaves,
    hook_plan,
)
from gradsync.sparsegrad import target_k

__all__ = ["DDP_SCHEMES", "HookState", "hook", "register"]

# The schemes with a DDP hook: the rows of the table of schemes marked ``ddp_hook``.
DDP_SCHEMES = tuple(name for name, s in schemes.SCHEMES.items() if s.ddp_hook)
SMALL_NUMEL = 102_400  # SSFusion Insight #2: ~200 KB of fp32
# Config fields that change the hook's trajectory: a checkpoint must be loaded with equal values.
RESUME_FIELDS = ("scheme", "density", "sparsifier", "momentum", "min_density", "seed",
                 "residual_dtype", "density_warmup", "density_warmup_steps", "min_k",
                 "clip_norm", "density_schedule", "budget")


@dataclass
class _Model:
    """What the hook knows of the model and its ranks, set once (its budget settles later)."""

    names: dict[int, str] = field(default_factory=dict)  # id(param) -> name
    shapes: list[tuple[str, tuple[int, ...]]] | None = None  # the model's, when known
    trained: tuple[int, ...] | None = None  # numels of the parameters DDP reduces (trainable)
    sizes: list[tuple[str, int]] | None = None  # and their names
    budget: HookBudget = field(init=False)  # Config.budget's densities (HookState.__post_init__)
    checked: bool = False  # configuration agreed across ranks
    passthrough: bool = False  # P = 1 without Config.compress_single_rank: every bucket whole


@dataclass
class HookState:
    """Everything the hook keeps between calls (DDP's comm ``state``), grouped by role; the
    :class:`~gradsync.engine.pipeline.Owner` of the buckets' pipelines. ``state_dict()`` holds
    this rank's residuals, sparsifier generators and trials (``auto``'s, with its link; merged
    buckets'), with its rank, world size and configuration; ``load_state_dict`` refuses
    another rank's, world size's, configuration's or model's (``engine.state.Stateful``)."""

    cfg: Config
    group: dist.ProcessGroup | None = None
    small_numel: int = SMALL_NUMEL
    ef: ErrorFeedback = field(init=False)
    parts: Components = field(init=False)  # the sparsifiers and the sparse parts' collective
    density: DensitySchedule = field(init=False)  # each step's density (Accordion, DGC)
    model: _Model = field(default_factory=_Model)
    scratch: Scratch = field(default_factory=Scratch)
    counts: Counts = field(default_factory=Counts)
    auto: AutoTrial = field(default_factory=AutoTrial)
    fusion: AutoTrial = field(default_factory=lambda: AutoTrial(sides=FUSION_SIDES))
    units: Units = field(default_factory=Units)  # what it follows: a scaler, an optimizer

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
        self.parts = Components(self.cfg, Comm(self.group).rank)  # the rank again at _agree
        self.model.budget = HookBudget(self.cfg, self.model.sizes)

    def reconfigure(self, cfg: Config) -> None:
        """Run ``cfg`` instead, before the first call (:mod:`gradsync.integrations.adamw`)."""
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
        scale): residuals, velocities and sparsifiers' thresholds are multiplied by it now, as
        :meth:`gradsync.GradSync.rescale` does. Between steps, the same factor on every rank."""
        self.ef.rescale(factor)  # checks the factor first
        self.parts.rescale(factor)
        self.model.budget.rescale(factor)  # Config.budget's masses, in the same units

    def follow(self, what: Any) -> None:
        """:meth:`gradsync.GradSync.follow` for the hook (an optimizer or a GradScaler), read
        at each step's first bucket (:meth:`gradsync.feedback.Units.update`)."""
        self.units.follow(what, self.cfg.nonfinite, "HookState")

    def precondition(self, scales: Mapping[torch.Tensor | str, torch.Tensor]) -> None:
        """:meth:`gradsync.GradSync.precondition` for the hook: from the next backward on,
        every bucket compresses ``scale ⊙ gradient`` of the given parameters (a parameter, or
        its name when the hook was given the model). Checked across ranks; between steps."""
        shapes = None if self.model.shapes is None else dict(self.model.shapes)
        apply_scales(self.ef, scales, resolver(shapes, self.name_of, "HookState"), self.group,
                     "HookState")

    @property
    def sparsifiers(self) -> dict[str, sparsify.Sparsifier]:
        """Each tensor's sparsifier, by name (``parts``)."""
        return self.parts.sparsifiers

    def auto_mode(self) -> str:
        """``auto``'s mode at this step: ``"model"`` or ``"dense"`` (:class:`AutoTrial`)."""
        return self.auto.mode(self.counts.steps)

    def stats(self) -> dict[str, Any]:
        c = self.counts
        return {"last": c.last.as_dict(), "total": c.total.as_dict(), "calls": c.calls,
                "nonfinite_buckets": c.nonfinite, "buckets": self.fusion.mode(c.steps),
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
        me = self.identity()
        return {"rank": me.rank, "world_size": me.world_size, "config": self.cfg.to_dict(),
                "small_numel": self.small_numel, "params": self._params(),
                "feedback": self.ef.state_dict(), "steps": self.counts.steps,
                "loss_scale": self.units.loss_scale, "lr": self.units.lr and list(self.units.lr),
                "density_schedule": self.density.state_dict(),
                **self.parts.state_dict(), **self.auto.state_dict(),
                **self.model.budget.state_dict(),
                "fusion": self.fusion.trial}

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
        if mine is not None and theirs is not None:
            check_params(theirs, mine, "the DDP hook state")
        AutoTrial.from_state(state, self.auto.clock)
        fusion_from(state.get("fusion"), self.fusion.clock)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` of this rank; raises before changing anything."""
        self.check_compatible(state)
        ef = self.cfg.new_feedback()
        ef.load_state_dict(state["feedback"])
        parts = self.parts.loaded(state)
        scale, rates = (saved_scale(state.get("loss_scale"), "HookState.load_state_dict"),
                        saved_rates(state.get("lr"), "HookState.load_state_dict"))
        density = DensitySchedule.loaded(self.cfg, state.get("density_schedule"))
        self.ef, self.density = ef, density
        self.parts.install(parts)
        self.counts.steps = int(state.get("steps", 0))
        self.units.loss_scale, self.units.lr = scale, rates
        self.auto = AutoTrial.from_state(state, self.auto.clock)
        self.model.budget.load(state)
        self.fusion = fusion_from(state.get("fusion"), self.fusion.clock)


def _densities(state: HookState, numels: list[int], elem_bytes: int = 4,
               comm: Comm | None = None, device: torch.device | None = None,
               names: list[str] | None = None) -> list[float | None]:
    """Per-tensor density of one bucket, None = sent whole: ``per_tensor`` every tensor at
    ``density``; ``auto`` all or none (:class:`AutoTrial`); SSFusion :func:`hook_plan` over the
    model's trainable parameters (the bucket's without one; pooled: no size threshold), whole
    below ``Config.min_k`` entries at d′; with ``names``, ``Config.budget``'s shares (settled)."""
    cfg, forced = state.cfg, True
    if state.scheme.planner == "auto":
        sparse = state.auto.sparse(
            numels, cfg.density, elem_bytes, state.counts.steps,
            lambda: state.parts.new_sparsifier("auto:probe", cfg.density), state.group, comm,
            device)
        chosen: list[float | None] = [cfg.density if sparse else None] * len(numels)
    elif state.scheme.planner == "per_tensor":
        chosen = [cfg.density] * len(numels)
    else:
        P = comm.size if comm is not None else 1
        split = hook_interleaves(state.scheme.interleave, getattr(device, "type", "cpu"))
        charge = (allreduce_charge if split else allgather_charge)(P, elem_bytes)
        small = 0 if cfg.pooled else state.small_numel  # a pool sends nothing whole for size
        whole, d, sent, forced = hook_plan(
            state.model.trained or tuple(numels), small, cfg.density,
            cfg.min_density, charge, cfg.effective_min_k, allgather_charge(P, elem_bytes))
        if state.model.trained is not None and state.counts.sent_density is None:
            state.counts.sent_density = sent  # said once, on rank 0, when not honoured
            why = dishonoured_density(cfg.scheme, cfg.density, sent, cfg.effective_min_k)
            if why is not None and state.identity().rank == 0:
                warnings.warn(why, stacklevel=2)
        chosen = [None if n < whole else d for n in numels]
    chosen = [None if d is None or (forced and target_k(n, d) < cfg.effective_min_k)
              else d for n, d in zip(numels, chosen)]
    return chosen if names is None else state.model.budget.densities(names, chosen)


def _sparse_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The comm hook: decides the bucket's jobs and hands it to its pipeline (module doc)."""
    if not state.model.checked:
        _agree(state)
    buf, comm, params = bucket.buffer(), Comm(state.group), bucket.parameters()
    if bucket.index() == 0:  # DDP reduces bucket 0 first: the step's time for the trial
        state.units.update(state.rescale, state.ef.rescale_residual)
        (state.auto if state.scheme.planner == "auto" else state.fusion).time_step(
            state.counts.steps, comm)
    names, numels = [state.name_of(p) for p in params], [p.numel() for p in params]
    pipe = BufferPipeline(state, comm, bucket.index(), names, numels, bucket.is_last())
    if not state.scheme.sparse or state.model.passthrough:
        # dense, or P = 1 (Config.compress_single_rank): an all-reduce (velocities, clipped)
        clip = state.model.passthrough and state.cfg.clip_norm is not None
        return pipe.whole(buf, clip or any(state.ef.transforms(n) for n in names))
    if bucket.index() == 0:  # at step warmup_steps: the ranks' masses summed (Config.budget)
        state.model.budget.settle(state.counts.steps, comm, lambda ns: _densities(
            state, ns, buf.element_size(), comm, buf.device), buf.device)
    state.model.budget.weigh(state.counts.steps, names, numels, buf)
    if state.scheme.planner != "auto" and (held := pipe.hold(buf)) is not None:
        return held  # merged buckets (engine/pipeline.py): it travels with the last one
    pipe, buf = pipe.merged(buf)
    densities = _densities(state, pipe.numels, buf.element_size(), comm, buf.device, pipe.names)
    if state.scheme.planner == "auto" and all(d is None for d in densities):
        # every tensor sent whole: DDP's own path, the all-reduce left in flight so the
        # backward goes on (a blocking one here held autograd: 0.69-0.87x DDP); through
        # error feedback, which holds what earlier sparse steps left behind
        return pipe.whole(buf, True)
    # SSFusion-I (where a core is spare for it) and auto: the tensors sent whole all-reduced
    split = hook_interleaves(state.scheme.interleave, buf.device.type)
    jobs = bucket_jobs(tuple(pipe.names), tuple(pipe.numels), tuple(densities), split or
                       state.scheme.planner == "auto", state.scheme.collective, pipe.pools())
    if (d := state.density.at(state.counts.steps)) != state.cfg.density:  # DGC's warm-up
        k = dict(zip(pipe.names, pipe.numels))  # as the engine's jobs take it (at_density)
        jobs = tuple(at_density(job, d, state.cfg.density, k, comm.size) for job in jobs)
    return pipe.sparse(buf, jobs)


def hook(cfg: Config, model: nn.Module | None = None, group: dist.ProcessGroup | None = None,
         small_numel: int = SMALL_NUMEL) -> tuple[HookState, Any]:
    """``(state, hook)`` for frameworks with separate slots (Lightning, Accelerate). Pass
    ``model`` (the module DDP wraps) so residuals are keyed by parameter name, portable across
    restarts. The ranks' configurations and models are compared (one small all-gather) here,
    or at the first call before ``init_process_group``: ``ValueError`` on every rank."""
    require_config(cfg, "gradsync.ddp.hook")
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(f"gradsync.ddp.hook: model must be the nn.Module DDP wraps, got "
                        f"{type(model).__name__}")
    known = _Model()
    if model is not None:
        known.names = {id(p): n for n, p in model.named_parameters()}
        known.shapes = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
        # frozen parameters never reach DDP's buckets: they take no part in the budget
        known.sizes = [(n, p.numel()) for n, p in model.named_parameters() if p.requires_grad]
        known.trained = tuple(k for _, k in known.sizes)
    state = HookState(cfg=cfg, group=group, small_numel=small_numel, model=known)
    if dist.is_available() and dist.is_initialized():
        _agree(state)
    return state, _sparse_hook


def _agree(state: HookState) -> None:
    """All ranks must run the same hook configuration on the same model; at world size 1
    nothing is sent, every bucket whole (unless ``Config.compress_single_rank``)."""
    P = dist.get_world_size(state.group)
    if not state.model.checked and P > 1:
        signature_check({"config": state.cfg.to_dict(), "small_numel": state.small_numel,
                         "params": state.model.shapes}, state.group)
    state.model.checked = True
    state.model.passthrough = P == 1 and not state.cfg.compress_single_rank
    state.parts.rank = Comm(state.group).rank  # the process group may be new since hook()


def register(ddp_model: nn.parallel.DistributedDataParallel, cfg: Config,
             small_numel: int = SMALL_NUMEL) -> HookState:
    """Install the sparsifying comm hook on ``ddp_model``; returns its state (stats, ckpt).
    With ``DDP(..., gradient_as_bucket_view=True)`` ``.grad`` is the bucket: no copy back into it.
    ``TypeError`` for anything but a ``DistributedDataParallel`` and a :class:`~gradsync.Config`,
    ``RuntimeError`` before ``init_process_group``."""
    require_config(cfg, "gradsync.ddp.register")
    if not isinstance(ddp_model, nn.parallel.DistributedDataParallel):
        raise TypeError(
            f"gradsync.ddp.register installs a comm hook on a DistributedDataParallel model, got "
            f"{type(ddp_model).__name__}: wrap it first, DistributedDataParallel(model) after "
            f"init_process_group; a training loop without DDP uses gradsync.GradSync(model, cfg)")
    if not (dist.is_available() and dist.is_initialized()):  # pragma: no cover - DDP needs it
        raise RuntimeError("gradsync.ddp.register: call torch.distributed.init_process_group "
                           "first (torchrun sets the environment it reads)")
    state, fn = hook(cfg, ddp_model.module, ddp_model.process_group, small_numel)
    ddp_model.register_comm_hook(state, fn)
    return state
