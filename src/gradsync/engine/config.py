"""`Config`: the validated settings of a :class:`gradsync.GradSync` engine and the DDP hook.

Every field is checked at construction; a bad value raises ``ValueError`` naming the field and
the accepted values, so a typo fails before any process group work starts.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from gradsync import sparsify
from gradsync.feedback import ErrorFeedback
from gradsync.schedule import schemes
from gradsync.schedule.budget import BUDGETS
from gradsync.schedule.plan import Plan

__all__ = ["ENGINE_SPARSIFIERS", "Config", "require_config"]

# The sparsifiers an engine scheme may use (Config.sparsifier); every scheme uses the same one
# so that experiments compare schemes, not sparsifiers.
ENGINE_SPARSIFIERS = ("dgc", "topk", "gaussiank", "redsync", "sidco", "randomk")
NONFINITE_POLICIES = ("raise", "skip_step")
DENSITY_SCHEDULES = ("fixed", "adaptive")
# What a config saved before a key existed meant by it (Config.differences).
_BEFORE_THE_KEY: dict[str, Any] = {"min_k": 1, "density_schedule": "fixed",
                                    "momentum_ahead": 0.0, "budget": "even"}
# the least density at which a scheme's share of 1 (momentum_ahead's default) applies; below it
# the default share is at most 1/3 (Config.momentum_ahead)
AHEAD_WHOLE_FROM = 0.01
RESIDUAL_DTYPES = {"auto": "auto", "float32": torch.float32, "float64": torch.float64,
                   "param": None}


def _ahead_in_force(scheme: str, given: float | None, momentum: float, masking: bool,
                    density: float) -> float:
    """``Config.momentum_ahead`` in force: 0 at density 1, where nothing is compressed (every
    scheme then trains as DDP with momentum does); else ``given``, or for ``None`` the
    scheme's share under momentum correction without masking (nothing is sent ahead without
    a velocity, and masking drops the tail), else 0."""
    if density >= 1.0:
        return 0.0
    if given is not None:
        return float(given)
    if not momentum or masking:
        return 0.0
    share = schemes.get(scheme).momentum_ahead
    # below 1 % the whole tail diverged SSFusion-OI on 2 of 5 CNN seeds at 0.1 %; 1/3 trained
    return min(share, schemes.THIRD) if density < AHEAD_WHOLE_FROM else share


@dataclass(frozen=True)
class Config:
    """Settings of gradient synchronization.

    Attributes:
        scheme: a name in the table of schemes ``gradsync.schedule.SCHEMES`` (``dense``,
            ``dense_ovlp``, ``topka``, ``topkdsa``, ``gtopk``, ``gaussiank``, ``oktopk``,
            ``densestream``, ``per_tensor``, ``multi_tensor``/``omgs``, ``cupcake``,
            ``ssfusion``, ``ssfusion_o``, ``ssfusion_oi``).
        density: fraction of gradient entries sent, in (0, 1].
        sparsifier: how entries are chosen (``dgc`` default; ``topk``, ``gaussiank``,
            ``redsync``, ``sidco``, ``randomk``). The ``gaussiank`` scheme always uses
            Gaussian-k, as the Ok-Topk paper runs it.
        momentum: DGC momentum correction inside error feedback (0 = plain error feedback).
        momentum_masking: DGC's momentum factor masking: ``True`` zeroes the velocity of
            every entry a compressed tensor sends (DGC §3.2). ``False`` (default) keeps it, so
            every entry's cumulative update is exactly dense momentum's, only delayed; masking
            drops the momentum's tail, which shrinks the step of entries sent at every step
            by up to ``1 − momentum``, and more so the higher the density (measured: CNN, SGD,
            10 %: 3.8 points below DDP with masking, 0.2 without; ``gradsync.feedback``,
            "Masking"). Checkpoints saved before this option had masking on: resume them with
            ``True``.
        momentum_ahead: under momentum correction without masking, the share ``a`` in
            [0, 1] of its velocity's remaining tail (``m/(1 − m)·u``) that a compressed entry
            carries when it is sent, borrowed from the steps after and repaid by the velocity
            (``gradsync.feedback``, "Ahead"; ours), but not in a step whose selection takes
            over a fifth of a tensor's entries (``engine.jobs.resent``: ResNet-18's
            classifier, where a lead made TopkA diverge). ``None`` (default): the scheme's share,
            ``Scheme.momentum_ahead`` (1/3 for TopkA, DenseStream, Ok-Topk and per_tensor, 1
            for the SSFusion family, at most 1/3 below 1 % density, where the whole tail
            diverged SSFusion-OI on 2 of 5 CNN seeds at 0.1 %; 0 for the schemes not
            measured), and 0 under
            masking or without momentum, and for preconditioned tensors (AdamW's frozen
            variance, where it made TinyGPT diverge; a number given applies there too).
            ``0``: DGC's momentum correction as it is. At density 1 nothing is compressed and
            nothing is sent ahead, whatever is given (every scheme then trains as DDP);
            :attr:`effective_momentum_ahead` is the value in force. Measured: CNN, SGD, 1 %,
            10 seeds: before the resent rule the schemes with a share went from 0.60–2.17
            points below DDP to between −0.01 and +0.74, and TopkA's ResNet-18 loss rose to
            6.84× its start; since, TopkA +0.70 (−0.98 without a lead), DenseStream +0.66,
            Ok-Topk +0.34, and on ResNet-18 TopkA 84.41 % with its loss at most 1.11× (docs/
            results/accuracy-history.md, "Resent means over a fifth of a tensor"). A number
            excludes ``momentum_masking``; checkpoints saved before this option resume with
            ``0``.
        warmup_steps: online-profiling iterations before a cost-model plan is fixed
            (SSFusion §IV-B uses 5).
        bucket_mb: fusion-buffer size of the schemes that fuse as DDP does (``dense``,
            ``dense_ovlp``, ``per_tensor``, ``auto``'s dense reference): DDP's 25 MiB.
        first_bucket_mb: the first such buffer's size (in backward order: the gradients
            ready first); ``None`` (default): ``bucket_mb``, DDP's layout when
            ``bucket_cap_mb`` is given. ``1.0`` is DDP's default layout (a 1 MiB first bucket,
            ``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``), whose early all-reduce overlaps
            the backward; on a CPU host where ranks share cores it took CPU from the backward
            instead (:mod:`gradsync.schedule.fixed`). A buffer closes once it reaches its
            size, as DDP's buckets do.
        min_density: floor of SSFusion's density-aware compensation (0.001).
        min_k: a tensor sparsified on its own (``per_tensor``, the SSFusion family, HiPress,
            Espresso, ``auto``, the DDP hook) that would send fewer than ``min_k`` entries per
            step is sent whole instead (``None``, the default: the scheme's own, 8,
            ``Scheme.min_k``, and 1 under the pooled budget, where a pool's K counts, not a
            tensor's k; ``1`` sparsifies every tensor the planner chose to;
            :attr:`effective_min_k` is the value in force). In the SSFusion family, whose
            compensation pays for them, only where they fit half of its byte budget together
            (:func:`gradsync.schedule.ssfusion.starved`). DGC's reference sends
            biases and BatchNorm whole for the same reason: at k of a few entries the rest of a
            small tensor waits many steps and then lands as one stale, outsized step
            (:func:`gradsync.schedule.plan.whole_below`). Decided at the density a tensor is
            selected at (the target; in the SSFusion family the compensated d′);
            fused buffers (``topka``, …) are selected as one vector and do not need it.
        nonfinite: ``"raise"`` (default: a NaN/Inf gradient raises ``ValueError`` naming the
            parameter) or ``"skip_step"`` (the step's gradients are zeroed on every rank,
            residuals untouched; NaN instead when following a GradScaler,
            ``GradSync.follow``, which needs this policy). The DDP hook raises from
            ``backward()`` on every rank, or leaves DDP's non-finite average in ``.grad``
            (``gradsync.ddp``, "Non-finite gradients").
        timeout_s: timeout of the engine's process group; a dead or hung peer makes the
            step fail after this many seconds instead of hanging.
        seed: seeds every sparsifier's generator (with the tensor name and rank mixed in).
        check_every: every K steps verify that parameters are identical on all ranks
            (0 = never).
        broadcast_initial: ``True`` (default): :class:`gradsync.GradSync` copies rank 0's
            parameters and buffers to every rank at construction, as
            ``DistributedDataParallel`` does, so replicas start equal whatever each rank's
            seed; ``False`` leaves each rank's initial values alone. The DDP hook ignores it
            (DDP itself broadcasts at construction).
        local_tau_prime: τ′ of Ok-Topk's local threshold reuse (Algorithm 1 lines 2–4), for
            the schemes whose row in the table of schemes takes it (``oktopk``): the local
            top-k threshold is computed exactly every τ′ steps and reused in between (32, the
            paper's τ′). ``0`` turns reuse off: the scheme then selects with
            ``Config.sparsifier``.
        residual_dtype: dtype of error feedback's residuals and DGC velocities: ``"auto"``
            (default: fp32 for bf16/fp16 parameters, the parameter's dtype otherwise),
            ``"float32"``, ``"float64"`` or ``"param"`` (the parameter's own dtype; 16-bit
            residuals lose small entries to rounding, see ``gradsync.feedback``). Values still
            travel in the parameter's dtype; the rounding stays in the residual.
        density_warmup: DGC's warm-up: the densities of the first periods of training, each
            in (density, 1] and non-increasing, e.g. ``(0.25, 0.0625, 0.015625, 0.004)``
            (DGC's four warm-up epochs); :meth:`dgc_warmup` builds the exponential schedule.
            After the last period the target ``density`` applies; inside one, momentum sent
            ahead leads by ``density / period's density`` of its share. ``None`` (default):
            the scheme's (``Scheme.dgc_warmup``, with what it was measured to gain and cost):
            for TopkA, Ok-Topk, DenseStream, per_tensor and the SSFusion family 4 periods of 9
            steps, 39.8 → 2.5 % at 1 %; none for the schemes not measured. ``()``: none.
            :attr:`warmup` is the schedule in force (none at density 1).
        density_warmup_steps: the length of one warm-up period in synchronized steps (an
            epoch's steps for DGC's per-epoch schedule); required (> 0) with a non-empty
            ``density_warmup``, ``None`` with the scheme's.
        density_schedule: ``"fixed"`` (default): ``density`` at every step (after
            ``density_warmup``); ``"adaptive"``: the density follows training, higher inside
            the critical regimes that Accordion detects from the gradient norm (the first
            window, and where the norm changes by half between windows), within a byte cap of
            1.5× the fixed density's mean after the first window (:mod:`gradsync.engine.density`,
            which gives what it measured: no gain on the CNN over 10 seeds, so not the
            default).
        plan: a plan to run instead of the one the scheme's planner would make (``None``,
            default: plan as usual). The schemes whose row in the table of schemes
            ``needs_cost_model`` (``multi_tensor``, ``cupcake``, ``ssfusion*``, ``auto``, …)
            plan from times measured in the warm-up, so two runs with the same seed can get
            different plans, and hence different (equally valid) results. To replay a run,
            pass its plan: ``GradSync.plan.to_dict()``, the ``plan`` of a run in ``train``'s
            ``metrics.json``, or an entry of its ``plans.json``. It must be a
            :class:`~gradsync.schedule.plan.Plan` dict made for this ``scheme``; the engine
            checks at construction that it lists every synchronized tensor once with its
            size. The warm-up steps still run as usual, so the plan a run ended with replays
            that run bitwise, except for ``auto``, whose plan can change during a run (given
            a plan, ``auto`` keeps it and never re-plans); nothing is profiled. The DDP hook
            does not take one (it decides per DDP bucket).
        compress_single_rank: at world size 1 there is nothing to send, so by default
            (``False``) a step is what density 1 would be: no gradient hooks, no sparsification,
            no residual. What does not depend on compression stays: ``momentum`` (``.grad``
            holds DGC's velocity, as at density 1), ``clip_norm``, preconditioning scales and
            the ``nonfinite`` policy; with none of them ``.grad`` is left as it is, plain
            training. The DDP hook sends every bucket whole at P = 1 (its dense path).
            ``True`` compresses at world size 1 too, as at P ≥ 2: for experiments, for tests of
            the pipeline on one process, and for ``bench overhead``, which measures the tax a
            P ≥ 2 run pays.
        clip_norm: DGC's local gradient clipping (§3.3; ``None``, default: off): before a
            gradient enters error feedback, each tensor of it is scaled so that its L2 norm is
            at most ``clip_norm / √P`` (:func:`gradsync.feedback.clip_local`). Unlike
            ``torch.nn.utils.clip_grad_norm_`` after ``synchronize()``, which clips the
            averaged sparse update (a step many accumulated gradients large has already been
            sent), this bounds what each rank adds to its residual every step. The engine and
            the DDP hook apply it; the tensors of a plain dense all-reduce are not clipped.
        budget: how a plan that sparsifies tensors one by one (``per_tensor``, the SSFusion
            family, HiPress, Espresso) shares its entries: ``"even"`` (the papers' rule) one
            density for every tensor it sparsifies; ``"gradient"`` each such tensor's entries
            in proportion to its share of the gradient's L1 mass over the ``warmup_steps``
            profiling steps (summed over the ranks), which is how a global top-k with error
            feedback shares them (:mod:`gradsync.schedule.budget`): the same tensors whole,
            the same entries a step, at least ``min_k`` each; ``"blend"`` half of the
            entries each way, which brought per_tensor and SSFusion-OI within a point of DDP
            on ResNet-18 where each other rule left one of them 1.2 to 3.3 points below
            (docs/results/accuracy-history.md, "Half evenly, half by mass"); ``"pooled"`` (ours) the
            entries one density gives a job's sparsified tensors, Σ k_i, chosen each step by
            one top-k over all of them, as TopkA's global selection shares the model's (a
            tensor may then send none in a step: SSFusion §III-A's "tensor missing", which
            error feedback catches up); nothing of a pool is sent whole for its size: SSFusion's
            Eq. 2 excludes no tensor and ``min_k``'s default is 1
            (:mod:`gradsync.schedule.ssfusion`, "Pooled buffers send nothing whole"), in the
            engine and the DDP hook alike. ``None`` (default): the scheme's
            (``Scheme.budget``, :attr:`effective_budget`): ``"pooled"`` for the SSFusion
            family, ``"blend"`` for the others. Under ``"gradient"`` and ``"blend"``
            ``per_tensor`` profiles ``warmup_steps`` steps at ``density`` before its plan is
            fixed, and the DDP hook weighs the model's parameters in its first
            ``warmup_steps`` steps. Other schemes and a given ``plan`` ignore it (a given
            plan still pools under ``"pooled"``).
    """

    scheme: str = "ssfusion_oi"
    density: float = 0.01
    sparsifier: str = "dgc"
    momentum: float = 0.0
    momentum_masking: bool = False
    momentum_ahead: float | None = None
    warmup_steps: int = 5
    bucket_mb: float = 25.0
    first_bucket_mb: float | None = None
    min_density: float = 0.001
    min_k: int | None = None
    nonfinite: str = "raise"
    timeout_s: float = 300.0
    seed: int = 0
    check_every: int = 0
    broadcast_initial: bool = True
    local_tau_prime: int = 32
    residual_dtype: str = "auto"
    density_warmup: tuple[float, ...] | None = None
    density_warmup_steps: int | None = None
    density_schedule: str = "fixed"
    plan: dict[str, Any] | None = None
    compress_single_rank: bool = False
    clip_norm: float | None = None
    budget: str | None = None

    def __post_init__(self) -> None:
        if self.scheme not in schemes.SCHEMES:
            raise ValueError(f"Config.scheme {self.scheme!r} is unknown; choose one of "
                             f"{', '.join(schemes.SCHEMES)}")
        sparsify.validate_density(self.density)
        if self.sparsifier not in ENGINE_SPARSIFIERS or self.sparsifier not in sparsify.names():
            raise ValueError(f"Config.sparsifier {self.sparsifier!r} is unknown; choose one of "
                             f"{', '.join(s for s in ENGINE_SPARSIFIERS if s in sparsify.names())}")
        self._check_momentum()
        if int(self.warmup_steps) != self.warmup_steps or self.warmup_steps < 1:
            raise ValueError(f"Config.warmup_steps must be an integer >= 1, got "
                             f"{self.warmup_steps!r}")
        if not (self.bucket_mb > 0 and math.isfinite(self.bucket_mb)):
            raise ValueError(f"Config.bucket_mb must be > 0, got {self.bucket_mb!r}")
        if self.first_bucket_mb is not None and not (
                self.first_bucket_mb > 0 and math.isfinite(self.first_bucket_mb)):
            raise ValueError(f"Config.first_bucket_mb must be > 0, got {self.first_bucket_mb!r}")
        if not 0.0 < self.min_density <= self.density:
            raise ValueError(f"Config.min_density must be in (0, density={self.density}], got "
                             f"{self.min_density!r}")
        if self.min_k is not None and (not isinstance(self.min_k, int)
                                       or isinstance(self.min_k, bool) or self.min_k < 1):
            raise ValueError(f"Config.min_k must be an integer >= 1 (1 = sparsify every tensor "
                             f"the planner chose to), got {self.min_k!r}")
        if self.nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"Config.nonfinite must be one of {NONFINITE_POLICIES}, got "
                             f"{self.nonfinite!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"Config.timeout_s must be > 0, got {self.timeout_s!r}")
        if int(self.check_every) != self.check_every or self.check_every < 0:
            raise ValueError(f"Config.check_every must be an integer >= 0, got "
                             f"{self.check_every!r}")
        if not isinstance(self.broadcast_initial, bool):
            raise ValueError(f"Config.broadcast_initial must be True or False, got "
                             f"{self.broadcast_initial!r}")
        if (not isinstance(self.local_tau_prime, int) or isinstance(self.local_tau_prime, bool)
                or self.local_tau_prime < 0):
            raise ValueError(f"Config.local_tau_prime must be an integer >= 0 (0 = no threshold "
                             f"reuse), got {self.local_tau_prime!r}")
        if self.residual_dtype not in RESIDUAL_DTYPES:
            raise ValueError(f"Config.residual_dtype must be one of {tuple(RESIDUAL_DTYPES)}, "
                             f"got {self.residual_dtype!r}")
        if self.clip_norm is not None and (
                isinstance(self.clip_norm, bool) or not isinstance(self.clip_norm, int | float)
                or not (math.isfinite(self.clip_norm) and self.clip_norm > 0)):
            raise ValueError(f"Config.clip_norm must be None or a finite number > 0, got "
                             f"{self.clip_norm!r}")
        if not isinstance(self.compress_single_rank, bool):
            raise ValueError(f"Config.compress_single_rank must be True or False, got "
                             f"{self.compress_single_rank!r}")
        self._check_density_schedule()
        if self.budget not in (None, *BUDGETS):
            raise ValueError(f"Config.budget must be None (the scheme's) or one of {BUDGETS}, "
                             f"got {self.budget!r}")
        if self.plan is not None:
            if not isinstance(self.plan, dict):
                raise ValueError(f"Config.plan must be a plan dict (Plan.to_dict()) or None, "
                                 f"got {type(self.plan).__name__}")
            try:
                plan = Plan.from_dict(self.plan)
            except ValueError as e:
                raise ValueError(f"Config.plan is not a valid plan: {e}") from None
            if plan.scheme != self.scheme:
                raise ValueError(f"Config.plan was made for scheme {plan.scheme!r}, this "
                                 f"config runs {self.scheme!r}")
            object.__setattr__(self, "plan", plan.to_dict())  # a normalised copy

    def _check_momentum(self) -> None:
        """``momentum``, ``momentum_masking`` and ``momentum_ahead``."""
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"Config.momentum must be in [0, 1), got {self.momentum!r}")
        if not isinstance(self.momentum_masking, bool):
            raise ValueError(f"Config.momentum_masking must be True or False, got "
                             f"{self.momentum_masking!r}")
        a = self.momentum_ahead
        if a is not None and (isinstance(a, bool) or not isinstance(a, int | float)
                              or not 0.0 <= a <= 1.0):
            raise ValueError(f"Config.momentum_ahead must be None (the scheme's share) or a "
                             f"number in [0, 1], got {a!r}")
        if a and self.momentum_masking:
            raise ValueError("Config.momentum_ahead and momentum_masking exclude each other: "
                             "masking drops the velocity that momentum_ahead sends early")

    def _check_density_schedule(self) -> None:
        """``density_schedule``, ``density_warmup`` and ``density_warmup_steps``."""
        if self.density_schedule not in DENSITY_SCHEDULES:
            raise ValueError(f"Config.density_schedule must be one of {DENSITY_SCHEDULES}, got "
                             f"{self.density_schedule!r}")
        if isinstance(self.density_warmup, list):  # from JSON/YAML
            object.__setattr__(self, "density_warmup", tuple(self.density_warmup))
        w, steps = self.density_warmup, self.density_warmup_steps
        if w is None:
            if steps is not None:
                raise ValueError(f"Config.density_warmup_steps={steps!r} needs density_warmup "
                                 f"(None takes the scheme's warm-up with its own steps)")
            return
        if not isinstance(w, tuple) or not all(
                isinstance(d, (int, float)) and not isinstance(d, bool) for d in w):
            raise ValueError(f"Config.density_warmup must be None (the scheme's), () (none) or a "
                             f"tuple of densities, got {w!r}")
        if (any(not self.density < d <= 1.0 for d in w)
                or any(a < b for a, b in itertools.pairwise(w))):
            raise ValueError(f"Config.density_warmup densities must lie in (density="
                             f"{self.density}, 1] and not increase, got {w!r}")
        if steps is None and not w:
            object.__setattr__(self, "density_warmup_steps", 0)
        elif (not isinstance(steps, int) or isinstance(steps, bool) or steps < 0
              or (w and steps == 0)):
            raise ValueError(f"Config.density_warmup_steps must be an integer >= 0, and > 0 with "
                             f"density_warmup, got {steps!r}")

    @functools.cached_property
    def warmup(self) -> tuple[tuple[float, ...], int]:
        """``(density_warmup, density_warmup_steps)`` in force: the ones given, else the
        scheme's DGC warm-up (``Scheme.dgc_warmup``); none at density 1, where every entry is
        sent anyway. Computed once: :meth:`density_at` reads it for every job of every step."""
        if self.density_warmup is not None:
            return self.density_warmup, int(self.density_warmup_steps or 0)
        periods, steps = schemes.get(self.scheme).dgc_warmup
        if not periods or self.density >= 1.0:
            return (), 0
        return self.dgc_warmup(self.density, periods), steps

    def density_at(self, step: int) -> float:
        """The density of synchronized step ``step`` (:attr:`warmup`, then ``density``)."""
        densities, steps = self.warmup
        if steps:
            period = step // steps
            if period < len(densities):
                return float(densities[period])
        return self.density

    @staticmethod
    def dgc_warmup(density: float, periods: int) -> tuple[float, ...]:
        """DGC's exponential warm-up: ``coeff^(e+1)`` for ``e < periods`` with
        ``coeff = density^(1/(periods+1))`` (so the next period would be ``density``)."""
        if int(periods) != periods or periods < 1:
            raise ValueError(f"dgc_warmup: periods must be an integer >= 1, got {periods!r}")
        sparsify.validate_density(density)
        coeff = density ** (1.0 / (periods + 1))
        return tuple(coeff ** (e + 1) for e in range(periods))

    def differences(self, saved: dict[str, Any], keys: tuple[str, ...]) -> list[str]:
        """``"key: saved …, here …"`` for each of ``keys`` where the config dict ``saved``
        (a checkpoint's) differs from this one. A key that ``saved`` lacks counts as what
        runs saved before the key existed did (``min_k``: 1, every tensor sparsified)."""
        mine = self.to_dict()
        out = []
        for k in keys:
            theirs = saved.get(k, _BEFORE_THE_KEY.get(k))
            if k == "min_k":  # the value in force: a default saved as its number is the same
                mine[k] = self.effective_min_k
                scheme = saved.get("scheme", self.scheme)
                rule = saved.get("budget", _BEFORE_THE_KEY["budget"])
                pooled = (rule or schemes.get(scheme).budget) == "pooled"
                theirs = schemes.get(scheme).min_k_under(pooled) if theirs is None else theirs
            if k == "budget":  # the rule in force: None is the scheme's
                mine[k] = self.effective_budget
                theirs = (schemes.get(saved.get("scheme", self.scheme)).budget
                          if theirs is None else theirs)
            if k == "momentum_ahead":  # the share in force, whichever way it was given
                mine[k] = self.effective_momentum_ahead
                theirs = _ahead_in_force(saved.get("scheme", self.scheme), theirs,
                                         saved.get("momentum", 0.0),
                                         saved.get("momentum_masking", True),
                                         saved.get("density", self.density))
            if k in ("density_warmup", "density_warmup_steps"):  # the warm-up in force
                mine[k], theirs = self._warmup_in_force(k, saved)
            if theirs != mine[k]:
                out.append(f"{k}: saved {theirs!r}, here {mine[k]!r}")
        return out

    def _warmup_in_force(self, key: str, saved: dict[str, Any]) -> tuple[Any, Any]:
        """``key``'s part of :attr:`warmup` here and in the config dict ``saved`` (saved
        before the key took ``None``: an empty warm-up)."""
        part = 0 if key == "density_warmup" else 1
        w = saved.get("density_warmup", ())
        try:
            theirs = Config(scheme=saved.get("scheme", self.scheme),
                            density=saved.get("density", self.density),
                            density_warmup=None if w is None else tuple(w),
                            density_warmup_steps=saved.get("density_warmup_steps")).warmup
        except ValueError:  # not a warm-up this version can run: compare as saved
            return self.warmup[part], saved.get(key)
        return self.warmup[part], theirs[part]

    @property
    def effective_budget(self) -> str:
        """``budget`` in force: the one given, else the scheme's (``Scheme.budget``)."""
        return schemes.get(self.scheme).budget if self.budget is None else self.budget

    @property
    def pooled(self) -> bool:
        """Whether a per-tensor plan's jobs select their sparsified tensors as one
        (``"pooled"`` in force, :attr:`gradsync.engine.jobs.Job.pools`)."""
        return self.effective_budget == "pooled"

    @property
    def effective_min_k(self) -> int:
        """``min_k`` in force: the one given, else 1 under the pooled budget (a pool's K
        counts, not a tensor's k) and the scheme's (``Scheme.min_k``) under the others."""
        return schemes.get(self.scheme).min_k_under(self.pooled) if self.min_k is None else (
            self.min_k)

    @property
    def effective_momentum_ahead(self) -> float:
        """``momentum_ahead`` in force: the one given, else the scheme's
        (``Scheme.momentum_ahead``) under momentum correction without masking, else 0; 0 at
        density 1, where nothing is compressed."""
        return _ahead_in_force(self.scheme, self.momentum_ahead, self.momentum,
                               self.momentum_masking, self.density)

    @property
    def feedback_dtype(self) -> torch.dtype | str | None:
        """``residual_dtype`` as :class:`gradsync.feedback.ErrorFeedback` takes it."""
        return RESIDUAL_DTYPES[self.residual_dtype]

    def new_feedback(self) -> ErrorFeedback:
        """A fresh :class:`~gradsync.feedback.ErrorFeedback` as this config sets it up
        (momentum, masking, residual dtype)."""
        a = self.effective_momentum_ahead  # the scheme's share is SGD's: not preconditioned
        return ErrorFeedback(momentum=self.momentum, residual_dtype=self.feedback_dtype,
                             masking=self.momentum_masking, ahead=a,
                             ahead_preconditioned=0.0 if self.momentum_ahead is None else a)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Config:
        """Build from a dict (e.g. parsed YAML/JSON); unknown keys raise ``ValueError``."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown Config keys {unknown}; known: {sorted(known)}")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def require_config(cfg: Any, where: str) -> Config:
    """``cfg`` if it is a :class:`Config`, else ``TypeError`` naming the fix (public entries)."""
    if not isinstance(cfg, Config):
        hint = (" (build one with gradsync.Config.from_dict(...))" if isinstance(cfg, dict)
                else "")
        raise TypeError(f"{where} takes a gradsync.Config, e.g. gradsync.Config(scheme="
                        f"'topka', density=0.01); got {type(cfg).__name__}{hint}")
    return cfg
