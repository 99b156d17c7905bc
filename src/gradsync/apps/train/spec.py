"""What one ``python -m gradsync train`` job is: the accepted schemes and the validated spec.

:class:`TrainSpec` replaces the command line's namespace everywhere below it: every rank
receives it (it pickles), the runners and the loop read it, and :meth:`TrainSpec.config` is the
``"config"`` object of ``metrics.json``. It validates itself and fills the defaults that depend
on the model (data set, learning rate), so a spec that exists is one that can run.

Schemes come from the table :data:`gradsync.schedule.schemes.SCHEMES`; :func:`scheme_choices`
turns it into the ``--scheme`` values ``train`` accepts and how each one runs
(:class:`SchemeChoice`): torch's own DDP hooks (:data:`DDP_PEERS`), every engine scheme through
:class:`gradsync.GradSync`, and ``ddp_gradsync_<s>`` for every scheme with ``Scheme.ddp_hook``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from gradsync.engine.config import DENSITY_SCHEDULES
from gradsync.integrations.adamw import WARMUP_SHARE
from gradsync.schedule.budget import BUDGETS
from gradsync.schedule.schemes import SCHEMES, Scheme

__all__ = ["ADAMW_LR", "AMP", "DATASETS", "DDP_HOOK_PREFIX", "DDP_PEERS", "DEFAULT_STEPS",
           "GRADSYNC_FIELDS", "LOCAL", "LR_SCHEDULES", "MEET", "RUNNERS", "SGD_LR", "SchemeChoice",
           "TrainSpec",
           "all_schemes", "defaults", "scheme_choice", "scheme_choices", "uses_adamw"]

DDP_PEERS = ("ddp", "ddp_powersgd", "ddp_fp16")  # torch's own comm hooks, run as peers
# TrainSpec fields that only gradsync's schemes read (runners.py): torch's own hooks above train
# bit for bit the same under any of them (bench convergence's kept DDP runs leave them out).
GRADSYNC_FIELDS = ("density", "sparsifier", "density_warmup", "density_schedule", "clip_norm",
                   "min_k", "momentum_masking", "momentum_ahead",
                   "adam_warmup", "topk_shares", "budget")
DDP_HOOK_PREFIX = "ddp_gradsync_"  # + a scheme with Scheme.ddp_hook: gradsync's DDP comm hook
DATASETS = ("fashion-mnist", "text", "synthetic")
RUNNERS = ("engine", "ddp_hook", "torch_ddp", "local", "meet")
AMP = (None, "bf16", "fp16")  # TrainSpec.amp: torch.autocast's dtype (fp16 with a GradScaler)
DEFAULT_STEPS = 50
SGD_LR, ADAMW_LR = 0.05, 3e-3
# TrainSpec.lr_schedule: the learning rate over a run, the same for every scheme (None: constant)
LR_SCHEDULES = ("constant", "cosine")


@dataclass(frozen=True)
class SchemeChoice:
    """One accepted ``--scheme`` value.

    Attributes:
        name: the ``--scheme`` value.
        runner: ``"engine"`` (:class:`gradsync.GradSync`), ``"ddp_hook"`` (torch DDP with
            gradsync's comm hook, :mod:`gradsync.ddp`), ``"torch_ddp"`` (torch DDP with one
            of torch's own comm hooks), ``"local"`` (no exchange: :data:`LOCAL`) or ``"meet"``
            (no gradient exchanged, one 8-byte all-reduce a step: :data:`MEET`).
        scheme: the gradsync scheme that runs; ``None`` for torch's own hooks.
    """

    name: str
    runner: str
    scheme: Scheme | None = None

    @property
    def sparse(self) -> bool:
        """Gradients are sparsified (DGC's momentum correction applies). torch's PowerSGD and
        fp16 hooks compress too but keep the optimizer's momentum, as torch runs them."""
        return self.scheme is not None and self.scheme.sparse


# No exchange at all: each rank trains its bare model alone (SGD with momentum, as DDP's
# optimizer). Not a --scheme: ``bench anatomy`` runs it as the no-sync floor of a step.
LOCAL = SchemeChoice("local", "local")
# The floor with one meeting a step: each rank trains alone, as under LOCAL, and after each
# backward the ranks all-reduce one 8-byte word, no gradient. ``bench anatomy`` runs it to
# measure what meeting once a step costs before any gradient travels (the ranks' skew on shared
# cores and one round). Not a --scheme.
MEET = SchemeChoice("meet", "meet")


def scheme_choices() -> dict[str, SchemeChoice]:
    """Every accepted ``--scheme`` value → how it runs, in the order ``--help`` lists them."""
    out = {n: SchemeChoice(n, "torch_ddp") for n in DDP_PEERS}
    out.update({n: SchemeChoice(n, "engine", s) for n, s in SCHEMES.items()})
    out.update({DDP_HOOK_PREFIX + n: SchemeChoice(DDP_HOOK_PREFIX + n, "ddp_hook", s)
                for n, s in SCHEMES.items() if s.ddp_hook})
    return out


def all_schemes() -> list[str]:
    """Every accepted ``--scheme`` value."""
    return list(scheme_choices())


def scheme_choice(name: str) -> SchemeChoice:
    """How ``--scheme name`` runs; an unknown name raises ``ValueError`` naming the choices."""
    choices = scheme_choices()
    if name not in choices:
        raise ValueError(f"unknown scheme {name!r}; choose from {', '.join(choices)}")
    return choices[name]


def uses_adamw(model: str) -> bool:
    """Transformers (GPT, BERT, ViT) train with AdamW; the others with SGD + momentum."""
    return model.startswith(("gpt", "bert", "vit"))


def _int(name: str, v: Any, low: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {v!r}")


def _positive(name: str, v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, int | float) or not (v > 0 and math.isfinite(v)):
        raise ValueError(f"{name} must be a positive number, got {v!r}")


@dataclass(frozen=True)
class TrainSpec:
    """One training job: the model, the schemes run in turn, their shared settings, the launch.

    Defaults that depend on the model are filled in: ``data`` (``fashion-mnist`` for image
    models, ``text`` for language models), ``lr`` (:data:`SGD_LR` with SGD + momentum 0.9,
    :data:`ADAMW_LR` with AdamW) and ``steps`` (:data:`DEFAULT_STEPS` unless ``epochs`` is
    given). Invalid values raise ``ValueError`` naming the field.

    Attributes:
        model: a :func:`gradsync.apps.models.names` entry.
        schemes: ``--scheme`` values (:func:`all_schemes`), each run once, in order.
        data: one of :data:`DATASETS`; ``synthetic`` or the model's own data set.
        world_size: local workers (a torchrun job has its own).
        steps, epochs: how long each scheme trains: steps, or passes over a rank's shard.
        batch_size: samples per rank and step.
        lr, density, sparsifier, seed: optimizer and ``Config`` settings shared by the schemes.
        lr_schedule: the learning rate over the run, for every scheme alike: ``"cosine"``
            decays it from ``lr`` to 0 at the last step (``CosineAnnealingLR``, stepped after
            each optimizer step), as ResNet and GPT recipes end; ``None`` (or ``"constant"``):
            ``lr`` throughout.
        warmup_steps: the engine's profiling steps; the first ``warmup_steps + 1`` steps are
            not measured.
        eval_batches: test batches for accuracy / perplexity (0: no evaluation).
        eval_every: also evaluate every this many steps (and at the end) into rank 0's
            ``history`` (0: only the final evaluation; ``bench convergence`` uses it).
        bandwidth, latency: tbf-shaped per-rank links (``latency`` is tbf's queueing bound, not
            a propagation delay); ``None``: loopback.
        timeout: seconds without progress before a hung job is stopped: local workers are
            watched by :func:`gradsync.testing.run_distributed`'s progress watchdog (no rank
            completed a step for this long; their collectives time out at twice it), a
            torchrun job's collectives time out after it, shaped links (netns) bound each
            scheme's whole run by it.
        out: where ``metrics.json`` and the plots go (``None``: nowhere).
        progress: rank 0 shows progress bars.
        fail_rank: a rank that raises at step 1 (tests of the failure path).
        stall_at: ``(rank, step)``: that rank stops making progress after the collectives of
            that step, until it is stopped (tests of the hang watchdog).
        step_sleep: seconds every rank sleeps after each step (tests of the watchdog: a slow,
            healthy run).
        inject_scheme: the scheme ``fail_rank``, ``stall_at`` and ``step_sleep`` apply to
            (``None``: every scheme).
        text_fallback: the language models train on gradsync's own source text (the corpus is
            not installed; :func:`gradsync.apps.train.resolve_data` decides).
        device: the device every rank trains on (``None``: CPU; torchrun sets ``cuda:<local>``).
        density_warmup: DGC's warm-up for the gradsync schemes, ``"PERIODS:STEPS"``: PERIODS
            periods of STEPS steps at exponentially decreasing densities
            (``Config.dgc_warmup``), then ``density``; or ``"D1,D2,…:STEPS"``: the periods'
            densities themselves (``Config.density_warmup``); ``"off"``: none; ``None``:
            Config's default, the scheme's (``Scheme.dgc_warmup``).
        density_schedule: ``Config.density_schedule`` of the gradsync schemes
            (``"adaptive"`` or ``"fixed"``); ``None``: Config's default.
        clip_norm: ``Config.clip_norm`` of the gradsync schemes (DGC's local gradient
            clipping); ``None``: off.
        momentum_masking: ``Config.momentum_masking`` of the gradsync schemes under momentum
            correction (DGC's momentum factor masking); ``None``: Config's default (off).
        momentum_ahead: ``Config.momentum_ahead`` of the gradsync schemes under momentum
            correction (the share of a sent entry's velocity tail sent with it); ``None``:
            Config's default, the scheme's share (``Scheme.momentum_ahead``).
        min_k: ``Config.min_k`` of the gradsync schemes: a tensor sparsified on its own that
            would send fewer entries per step travels whole; ``None``: Config's default.
        budget: ``Config.budget`` of the gradsync schemes (``"gradient"``: a per-tensor plan's
            entries by each tensor's share of the gradient's L1 mass, ``"blend"``: half of
            them so, ``"pooled"``: one selection over a buffer's tensors); ``None``: Config's,
            the scheme's.
        adam_warmup: AdamW with a sparse scheme (:class:`gradsync.optim.FrozenVarianceAdamW`):
            the steps of exact AdamW, gradients sent whole, before the variance freezes
            (rounded up to whole ``density_warmup`` periods); ``None``:
            the integrations' share of the run's steps
            (:data:`gradsync.integrations.adamw.WARMUP_SHARE`), at least 1 (not their
            ``MIN_WARMUP``: the harness's short runs would be sent whole throughout).
        amp: automatic mixed precision for every scheme: ``"bf16"`` (``torch.autocast`` in
            bfloat16) or ``"fp16"`` (autocast in float16 with a ``torch.amp.GradScaler``; the
            gradsync schemes follow it, ``GradSync.follow``/``HookState.follow``, with
            ``Config(nonfinite="skip_step")``, and an overflowing step is skipped on every
            rank); ``None``: fp32. Parameters, residuals and optimizer state stay fp32.
        plans: ``--plan FILE``: scheme → plan (``Config.plan``) for the engine schemes, as
            ``plans.json`` of an earlier ``--out`` holds them; each engine scheme run must have
            one, made for it (the others take none, extra entries are ignored). ``None``: every
            engine scheme plans as usual.
        topk_shares: rank 0 records, for each engine scheme, every tensor's share of a global
            top-k of the accumulators (:mod:`gradsync.apps.train.shares`; ``metrics.json``
            ``runs[i].topk_shares``). It audits every step (a copy of each accumulator).
    """

    model: str = "cnn"
    schemes: tuple[str, ...] = ("ssfusion_oi",)
    data: str | None = None
    world_size: int = 2
    steps: int | None = None
    epochs: float | None = None
    batch_size: int = 32
    lr: float | None = None
    lr_schedule: str | None = None
    density: float = 0.01
    sparsifier: str = "dgc"
    seed: int = 0
    warmup_steps: int = 5
    eval_batches: int = 20
    eval_every: int = 0
    bandwidth: str | None = None
    latency: str | None = None
    timeout: float = 900.0
    out: str | None = None
    progress: bool = True
    fail_rank: int | None = None
    stall_at: tuple[int, int] | None = None
    step_sleep: float = 0.0
    inject_scheme: str | None = None
    text_fallback: bool = False
    device: str | None = None
    density_warmup: str | None = None
    density_schedule: str | None = None
    clip_norm: float | None = None
    min_k: int | None = None
    budget: str | None = None
    momentum_masking: bool | None = None
    momentum_ahead: float | None = None
    adam_warmup: int | None = None
    amp: str | None = None
    plans: dict[str, dict[str, Any]] | None = None
    topk_shares: bool = False

    def __post_init__(self) -> None:
        from gradsync.apps import models
        from gradsync.engine.config import ENGINE_SPARSIFIERS
        from gradsync.sparsify import validate_density
        from gradsync.testing import netem

        def fill(name: str, value: Any) -> None:  # frozen: defaults are set once, here
            object.__setattr__(self, name, value)

        if self.model not in models.names():
            raise ValueError(f"model: unknown {self.model!r}; choose from "
                             f"{', '.join(models.names())}")
        fill("schemes", tuple(self.schemes))
        known = scheme_choices()
        bad = [s for s in self.schemes if s not in known]
        if not self.schemes or bad:
            raise ValueError(f"scheme: unknown {bad or list(self.schemes)}; choose from "
                             f"{', '.join(known)}")
        if len(set(self.schemes)) != len(self.schemes):
            raise ValueError(f"scheme: {','.join(self.schemes)!r} names a scheme twice")
        natural = "fashion-mnist" if models.task(self.model) == "image" else "text"
        if self.data is None:
            fill("data", natural)
        elif self.data not in DATASETS:
            raise ValueError(f"data: unknown {self.data!r}; choose from {', '.join(DATASETS)}")
        elif self.data not in ("synthetic", natural):
            raise ValueError(f"data {self.data} does not fit model {self.model} (use {natural} "
                             "or synthetic)")
        _int("world_size", self.world_size, 1)
        if self.steps is not None and self.epochs is not None:
            raise ValueError("give steps or epochs, not both")
        if self.steps is None and self.epochs is None:
            fill("steps", DEFAULT_STEPS)
        if self.steps is not None:
            _int("steps", self.steps, 1)
        else:
            _positive("epochs", self.epochs)
        _int("batch_size", self.batch_size, 1)
        if self.lr is None:
            fill("lr", ADAMW_LR if uses_adamw(self.model) else SGD_LR)
        _positive("lr", self.lr)
        if self.lr_schedule not in (None, *LR_SCHEDULES):
            raise ValueError(f"lr_schedule: unknown {self.lr_schedule!r}; choose from "
                             f"{', '.join(LR_SCHEDULES)}")
        if self.lr_schedule == "constant":
            fill("lr_schedule", None)  # one spelling: a kept run's key stays comparable
        fill("density", validate_density(self.density))
        if self.sparsifier not in ENGINE_SPARSIFIERS:
            raise ValueError(f"sparsifier: unknown {self.sparsifier!r}; choose from "
                             f"{', '.join(ENGINE_SPARSIFIERS)}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        _int("warmup_steps", self.warmup_steps, 1)
        _int("eval_batches", self.eval_batches, 0)
        _int("eval_every", self.eval_every, 0)
        if self.bandwidth is not None:
            try:
                netem.parse_bandwidth(self.bandwidth)
            except ValueError as e:
                raise ValueError(f"bandwidth: {e}") from None
        elif self.latency is not None:
            raise ValueError("latency shapes links: give bandwidth too")
        if self.latency is not None:
            try:
                netem.parse_time(self.latency)
            except ValueError as e:
                raise ValueError(f"latency: {e}") from None
        _positive("timeout", self.timeout)
        if self.stall_at is not None:
            if not (isinstance(self.stall_at, tuple | list) and len(self.stall_at) == 2):
                raise ValueError(f"stall_at must be (rank, step), got {self.stall_at!r}")
            _int("stall_at rank", self.stall_at[0], 0)
            _int("stall_at step", self.stall_at[1], 0)
            fill("stall_at", tuple(self.stall_at))
        if not (isinstance(self.step_sleep, int | float) and 0 <= self.step_sleep < math.inf):
            raise ValueError(f"step_sleep must be a number >= 0, got {self.step_sleep!r}")
        if self.inject_scheme is not None and self.inject_scheme not in known:
            raise ValueError(f"inject_scheme: unknown scheme {self.inject_scheme!r}")
        if self.density_warmup is not None:
            self.warmup_schedule()  # raises on a malformed value
        if self.density_schedule not in (None, *DENSITY_SCHEDULES):
            raise ValueError(f"density_schedule: unknown {self.density_schedule!r}; choose from "
                             f"{', '.join(DENSITY_SCHEDULES)}")
        if self.clip_norm is not None and not (
                isinstance(self.clip_norm, int | float) and 0 < self.clip_norm < math.inf):
            raise ValueError(f"clip_norm must be a finite number > 0, got {self.clip_norm!r}")
        if self.min_k is not None:
            _int("min_k", self.min_k, 1)
        if self.budget not in (None, *BUDGETS):
            raise ValueError(f"budget: unknown {self.budget!r}; choose from {', '.join(BUDGETS)}")
        if not (self.momentum_masking is None or isinstance(self.momentum_masking, bool)):
            raise ValueError(f"momentum_masking must be True, False or None, got "
                             f"{self.momentum_masking!r}")
        a = self.momentum_ahead
        if a is not None and (isinstance(a, bool) or not isinstance(a, int | float)
                              or not 0 <= a <= 1):
            raise ValueError(f"momentum_ahead must be a number in [0, 1] or None, got {a!r}")
        if self.adam_warmup is not None:
            _int("adam_warmup", self.adam_warmup, 1)
        if self.amp not in AMP:
            raise ValueError(f"amp: unknown {self.amp!r}; choose from bf16, fp16 (or none)")
        if self.plans is not None:
            self._check_plans()
        if not isinstance(self.topk_shares, bool):
            raise ValueError(f"topk_shares must be True or False, got {self.topk_shares!r}")

    def _check_plans(self) -> None:
        """Every engine scheme run has a plan that ``Config`` accepts for it (its own checks,
        so a bad file fails here, at the command line, not in every rank)."""
        from gradsync.engine.config import Config

        if not isinstance(self.plans, dict):
            raise ValueError(f"plans must map scheme names to plans, got "
                             f"{type(self.plans).__name__}")
        engine = [c.name for c in self.choices if c.runner == "engine"]
        missing = [s for s in engine if s not in self.plans]
        if missing:
            raise ValueError(f"plans: no plan for {missing} (it has "
                             f"{sorted(self.plans) or 'none'})")
        for name in engine:
            try:
                Config(scheme=name, plan=self.plans[name])
            except ValueError as e:
                raise ValueError(f"plans[{name!r}]: {e}") from None

    def warmup_schedule(self) -> tuple[tuple[float, ...] | None, int | None]:
        """``(Config.density_warmup, Config.density_warmup_steps)`` of :attr:`density_warmup`
        (``(None, None)``: Config's default, the scheme's warm-up)."""
        from gradsync.engine.config import Config

        if self.density_warmup is None:
            return None, None
        if self.density_warmup == "off":
            return (), 0
        try:
            head, steps_s = self.density_warmup.split(":")
            steps = int(steps_s)
            periods = None if "." in head or "," in head else int(head)
            densities = () if periods else tuple(float(v) for v in head.split(","))
            if steps < 1 or (periods is not None and periods < 1):
                raise ValueError
        except ValueError:
            raise ValueError(f"density_warmup: expected PERIODS:STEPS (two integers >= 1), "
                             f"D1,D2,…:STEPS (each period's density) or off, got "
                             f"{self.density_warmup!r}") from None
        if periods is None:  # Config checks them: each in (density, 1], non-increasing
            Config(density=self.density, density_warmup=densities, density_warmup_steps=steps)
            return densities, steps
        return Config.dgc_warmup(self.density, periods), steps

    def adam_freeze_step(self, steps: int) -> int:
        """The optimizer step after which :class:`~gradsync.optim.FrozenVarianceAdamW` freezes
        its variance in a run of ``steps`` steps (:attr:`adam_warmup`)."""
        w = (self.adam_warmup if self.adam_warmup is not None
             else max(1, math.ceil(WARMUP_SHARE * steps)))
        _, period = self.warmup_schedule()
        return math.ceil(w / period) * period if period else w

    def engine_warmup(self, steps: int, momentum_correction: bool
                      ) -> tuple[tuple[float, ...] | None, int | None]:
        """``(Config.density_warmup, Config.density_warmup_steps)`` of a scheme: DGC's warm-up
        (:meth:`warmup_schedule`), after :meth:`adam_freeze_step` steps sent whole when AdamW's
        momentum moves into error feedback (``momentum_correction``), whose warm-up then
        replaces the scheme's own, as ``gradsync.integrations.adamw``'s recipe does."""
        warm, period = self.warmup_schedule()
        if not (self.adamw and momentum_correction) or self.density >= 1:
            return warm, period
        freeze = self.adam_freeze_step(steps)
        if period:
            return (1.0,) * (freeze // period) + (warm or ()), period
        return (1.0,), freeze

    @property
    def bandwidth_bps(self) -> int | None:
        """The shaped links' rate in bits per second (``None``: loopback)."""
        from gradsync.testing import netem

        return None if self.bandwidth is None else netem.parse_bandwidth(self.bandwidth)

    @property
    def adamw(self) -> bool:
        """The model trains with AdamW (:func:`uses_adamw`)."""
        return uses_adamw(self.model)

    def injects(self, scheme: str) -> bool:
        """The test knobs (``fail_rank``, ``stall_at``, ``step_sleep``) apply to ``scheme``."""
        return self.inject_scheme is None or self.inject_scheme == scheme

    @property
    def choices(self) -> list[SchemeChoice]:
        """How each of :attr:`schemes` runs, in order."""
        return [scheme_choice(s) for s in self.schemes]

    def config(self, world_size: int) -> dict[str, Any]:
        """The ``"config"`` object of ``metrics.json`` for a job of ``world_size`` ranks."""
        return {"model": self.model, "data": self.data, "schemes": list(self.schemes),
                "world_size": world_size, "steps": self.steps, "epochs": self.epochs,
                "batch_size": self.batch_size, "lr": self.lr,
                "lr_schedule": self.lr_schedule or "constant",
                "optimizer": (
                    "adamw(sparse schemes: gradsync.optim.FrozenVarianceAdamW, DGC momentum "
                    "correction 0.9 in error feedback, variance frozen after adam_warmup steps "
                    "sent whole, then 1/(sqrt(v)+eps) preconditions error feedback; no "
                    "momentum factor masking; at density 1 torch's AdamW)"
                ) if self.adamw else (
                    "sgd(momentum=0.9; sparse schemes: momentum 0 in SGD, DGC momentum "
                    "correction 0.9 in error feedback, no momentum factor masking)"),
                "text_fallback": self.text_fallback,
                "density": self.density, "sparsifier": self.sparsifier, "seed": self.seed,
                "warmup_steps": self.warmup_steps, "eval_batches": self.eval_batches,
                "density_warmup": self.density_warmup,
                "density_schedule": self.density_schedule, "clip_norm": self.clip_norm,
                "min_k": self.min_k, "momentum_masking": self.momentum_masking,
                "momentum_ahead": self.momentum_ahead, "budget": self.budget,
                "adam_warmup": self.adam_warmup,
                "amp": self.amp,
                "bandwidth": self.bandwidth, "latency": self.latency,
                "replayed_plans": sorted(self.plans) if self.plans else [],
                "topk_shares": self.topk_shares}


def defaults() -> dict[str, Any]:
    """:class:`TrainSpec`'s field defaults (the command line's defaults)."""
    return {f.name: f.default for f in fields(TrainSpec)}
