"""`GradSync`: per-parameter gradient hooks → fusion buffers → async sparse sync → ``.grad``.

How a step runs (wait-free backpropagation, WFBP)::

    loss.backward()      # each parameter's post-accumulate-grad hook marks it ready; as soon as
                         # every tensor of the next job of the plan is ready, the job is prepared
                         # on the training thread (error feedback + sparsification, inline or on
                         # the offload worker) and handed to the communication thread, so its
                         # collective overlaps the rest of the backward pass
    sync.synchronize()   # launches what is left, waits, decodes, divides by P, writes .grad,
                         # and keeps what was not sent in the residuals
    optimizer.step()

Where each part lives (one module each, named after the SSFusion section it implements):

* :mod:`.jobs` — the plan's buffers as jobs, run in plan order (§II-D buffer modes, §IV-D's
  all-reduce and all-gather parts);
* :mod:`.prepare` — a job on the training thread: error feedback, selective sparsification at
  the planned densities (§IV-B), hand-off of offloaded tensors (§IV-C);
* :mod:`.executor` — the communication thread and SSFusion-O's offload worker (§IV-C);
* :mod:`.apply` — the sums back into ``.grad`` and the residuals;
* :mod:`.preconditioning` — :meth:`GradSync.precondition`'s per-entry scales (frozen-variance
  AdamW);
* :mod:`.warmup` — the profiling steps, the cost model and rank 0's plan (§IV-A);
* :mod:`.components` — the scheme's sparsifiers and collectives (the table of schemes);
* :mod:`.audit`, :mod:`.stats`, :mod:`.state` — audit records, step figures, the
  :class:`~gradsync.engine.state.Stateful` protocol.

Invariants (tested): ``dense`` results are bitwise identical on every rank, so replicas never
drift; per parameter and step, ``accumulated == sent + residual`` exactly (error feedback);
at density 1 every scheme's averaged gradient equals plain DDP's within float tolerance.

Checkpoints: :meth:`GradSync.state_dict` holds everything a bitwise resume needs — step,
warm-up progress and backward-order samples, plan and cost model, ``auto``'s drift watch
(window, strikes, trial, pending plan), residuals, DGC velocities and preconditioning scales,
every sparsifier's generator and threshold state, every collective's state (Ok-Topk thresholds
and boundaries, DenseStream boundaries) — and is per rank (residuals differ across ranks);
:mod:`gradsync.checkpoint` saves it with the model and optimizer (torch.save or DCP).
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from gradsync.collectives.comm import Comm
from gradsync.engine import drift, warmup
from gradsync.engine.apply import agreement_word, apply, settle
from gradsync.engine.audit import AuditRecord, AuditSink
from gradsync.engine.components import Components
from gradsync.engine.config import Config, require_config
from gradsync.engine.consistency import (
    broadcast_states,
    check_consistency,
    signature_check,
    state_signature,
)
from gradsync.engine.density import DensitySchedule
from gradsync.engine.executor import Executor
from gradsync.engine.jobs import Job, JobResult, Launched, Mode, StepRun, at_density, plan_jobs
from gradsync.engine.preconditioning import apply_scales, resolver
from gradsync.engine.prepare import prepare
from gradsync.engine.state import Identity, check_identity, check_params
from gradsync.engine.stats import StepStats
from gradsync.feedback import Units, clip_local, saved_rates, saved_scale
from gradsync.schedule import Plan, costmodel
from gradsync.schedule.ssfusion import dishonoured_density
from gradsync.sparsegrad import all_finite, all_finite_each, finite_flag

__all__ = ["GradSync"]

# Config fields that change the trajectory: a checkpoint must be loaded with equal values.
# (nonfinite, timeout_s and check_every may change between runs.)
_RESUME_FIELDS = ("scheme", "density", "sparsifier", "momentum", "warmup_steps", "bucket_mb",
                  "first_bucket_mb", "min_density", "seed", "local_tau_prime", "residual_dtype",
                  "density_warmup", "density_warmup_steps", "plan", "compress_single_rank",
                  "clip_norm", "min_k", "density_schedule", "budget")


@dataclass
class _Replica:
    """Who this replica is and what it synchronizes, set once."""

    rank: int
    P: int  # the papers' symbol for the world size
    passthrough: bool  # world size 1 without Config.compress_single_rank: plain training
    numel: dict[str, int]  # name -> elements
    name_of: dict[int, str]  # id(parameter) -> name
    handles: list[Any] = field(default_factory=list)  # the gradient hooks


@dataclass
class _Layout:
    """The plan in force and its jobs (made again by every change of plan)."""

    plan: Plan
    jobs: list[Job]
    job_of: dict[str, int]  # tensor -> its job
    job_sizes: list[int]  # tensors per job
    # per job: its gradient storage (_gather), made at its first launch under this plan
    storage: dict[int, tuple[torch.Tensor, list[torch.Tensor]] | None] = field(
        default_factory=dict)


@dataclass
class _Planning:
    """What decides the plans and densities: the warm-up, the cost model, ``auto``'s watch."""

    given: Plan | None  # Config.plan, checked
    warmup: warmup.Warmup
    drift: drift.Drift | None  # auto's re-planning
    density: DensitySchedule  # each step's density (Accordion, DGC)
    cost: costmodel.CostModel | None = None  # once the warm-up has measured it
    last_done: float | None = None  # when the last watched step ended (auto)
    said: bool = False  # a density the plan cannot send: said once (_set_plan)


@dataclass
class _Counts:
    """The steps taken and their figures."""

    step: int = 0
    last: StepStats = field(default_factory=StepStats)
    total: StepStats = field(default_factory=StepStats)


@dataclass
class _Life:
    """The hooks' lock and the engine's modes."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    no_sync: bool = False
    closed: bool = False


class GradSync:
    """Compressed, overlapped gradient synchronization for a model replicated on every rank.

    Implements :class:`~gradsync.engine.state.Stateful`.

    Args:
        model: the local replica; every parameter with ``requires_grad`` is synchronized
            (frozen parameters are ignored, parameters without a gradient in a step count as
            zero).
        config: a :class:`Config` (default ``Config()``: SSFusion-OI with DGC at 1%).
            With ``config.broadcast_initial`` (the default) the constructor overwrites every
            rank's parameters and buffers (frozen ones too) with rank 0's, on ``group``, before
            anything else uses them, as ``DistributedDataParallel`` does: replicas start
            bit-identical whatever each rank's seed. It is a collective, so every rank of the
            group must construct the engine; build the model and load its weights first.
        group: the process group; ``None`` creates a dedicated group over all ranks (so the
            engine's background communication never interleaves with the caller's own
            collectives) with ``config.timeout_s``. Without an initialised process group the
            engine runs as a single rank.
        audit: ``True`` keeps the last step's :class:`AuditRecord` s in ``audit_log``; a
            callable receives every record as it is made; ``False`` (default) records nothing
            (:mod:`gradsync.engine.audit`).

    Attributes: ``cfg``, ``model``, ``params`` (name → synchronized parameter), ``group``,
    ``rank``, ``P`` (world size), ``ef`` (the :class:`ErrorFeedback` residuals), ``step``,
    ``plan``, ``cost`` (the cost model, once warm-up has measured it), ``last`` and ``total``
    (:class:`StepStats`).
    """

    def __init__(self, model: nn.Module, config: Config | None = None,
                 group: dist.ProcessGroup | None = None,
                 audit: bool | Callable[[AuditRecord], None] = False) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"GradSync takes the model (an nn.Module), got {type(model).__name__}")
        if isinstance(model, nn.parallel.DistributedDataParallel | FSDPModule):
            raise TypeError(
                f"GradSync synchronizes gradients itself: pass the bare model, not a "
                f"{type(model).__name__}-wrapped one (or keep DDP and use "
                f"gradsync.ddp.register(ddp_model, cfg); FSDP2: gradsync.fsdp.compress)")
        self._audit = AuditSink(audit)
        self.cfg = Config() if config is None else require_config(config, "GradSync")
        self.model = model
        self.params: dict[str, nn.Parameter] = {
            n: p for n, p in model.named_parameters() if p.requires_grad
        }
        if not self.params:
            raise ValueError("GradSync: the model has no parameter that requires grad, so there "
                             "is no gradient to synchronize; build GradSync after unfreezing the "
                             "parameters you train (requires_grad=True)")
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if group is None and launched > 1 and not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(f"GradSync: {launched} processes were launched (WORLD_SIZE) but "
                               f"torch.distributed is not initialized; call "
                               f"torch.distributed.init_process_group() before GradSync(...)")
        if dist.is_available() and dist.is_initialized() and group is None:
            group = dist.new_group(timeout=timedelta(seconds=self.cfg.timeout_s))
        self.group = group
        probe = Comm(group)
        # world size 1: nothing to send, plain training (Config.compress_single_rank)
        self._replica = _Replica(probe.rank, probe.size,
                                 probe.size == 1 and not self.cfg.compress_single_rank,
                                 {n: p.numel() for n, p in self.params.items()},
                                 {id(p): n for n, p in self.params.items()})
        if self._replica.P > 1:
            signature_check(self._signature(), group)
            if self.cfg.broadcast_initial:
                # DDP's rule: every replica starts from rank 0's parameters and buffers
                broadcast_states(model, group, src=0)
        self.ef = self.cfg.new_feedback()
        self._counts = _Counts()
        self._units = Units()
        self._life = _Life()
        self._parts = Components(self.cfg, self._replica.rank)
        self._planning = _Planning(
            given=warmup.given_plan(self.cfg, self._replica.numel),  # Config.plan, checked
            warmup=warmup.Warmup.for_config(self.cfg),
            drift=drift.Drift.for_config(self.cfg, self._replica.P),  # auto's re-planning
            density=DensitySchedule(self.cfg))  # each step's density (Accordion, DGC)
        self._run = StepRun()
        self._set_plan(warmup.provisional_plan(self.cfg, list(reversed(self.params)),
                                               self._replica.numel))
        self._exec = Executor(group, self._parts.collective, self._audit.enabled)
        if not self._replica.passthrough:
            self._replica.handles = [p.register_post_accumulate_grad_hook(self._hook)
                                     for p in self.params.values()]

    # ------------------------------------------------------------------ the roles' figures
    @property
    def rank(self) -> int:
        return self._replica.rank

    @property
    def P(self) -> int:  # the papers' symbol for the world size
        return self._replica.P

    @property
    def passthrough(self) -> bool:
        """World size 1 without ``Config.compress_single_rank``: plain training."""
        return self._replica.passthrough

    @property
    def step(self) -> int:
        return self._counts.step

    @property
    def last(self) -> StepStats:
        return self._counts.last

    @property
    def total(self) -> StepStats:
        return self._counts.total

    @property
    def plan(self) -> Plan | None:
        return self._layout.plan

    @property
    def cost(self) -> costmodel.CostModel | None:
        return self._planning.cost

    @property
    def loss_scale(self) -> float | None:
        """The loss scale error feedback's contents are in (:meth:`follow`)."""
        return self._units.loss_scale

    # ------------------------------------------------------------------ public API
    @property
    def audit_log(self) -> list[AuditRecord]:
        """The last step's audit records (``audit=True``; empty otherwise)."""
        return self._audit.log

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (micro-batches); synchronize after the block."""
        prev, self._life.no_sync = self._life.no_sync, True
        try:
            yield
        finally:
            self._life.no_sync = prev

    def synchronize(self) -> bool:
        """Finish the step's synchronization and write averaged gradients into ``.grad``: every
        ``.grad`` is then a view into its fusion buffer's gradient storage, the same tensor from
        step to step (as DDP's ``gradient_as_bucket_view``), so a step writes each buffer once,
        not each tensor (parameters of mixed dtypes in one buffer get copies instead).

        Returns ``True``, or ``False`` when ``Config.nonfinite == "skip_step"`` and some rank
        had a NaN/Inf gradient (then every rank's gradients are zeroed — NaN instead when
        following a GradScaler (:meth:`follow`), so that the scaler skips the step and backs
        off — and residuals are left as before the step; skip ``optimizer.step()``).
        """
        if self._life.closed:
            raise RuntimeError("GradSync.synchronize() after close()")
        if self._life.no_sync:
            raise RuntimeError("GradSync.synchronize() inside no_sync(): leave the block first")
        if self.passthrough:
            return self._local_step()
        run, stats = self._run, StepStats()
        self._audit.new_step()
        profiling = self._planning.warmup.left > 0
        if profiling:
            self._planning.warmup.observe(run.hook_times)
        results = self._collect(run, stats)
        try:
            missing, deferred_bad, dense_bad, agreed = self._settle(run, results, stats)
        except ValueError:  # a malformed message: nothing was applied; the next step is fresh
            self._abandon()
            raise
        ok = self._agree(run, stats, deferred_bad, dense_bad, agreed, _alike(results))
        if ok:
            stats.missing += missing
        self._apply(run, results, stats, ok)
        self._advance(run, stats)
        if profiling:
            self._advance_warmup()
        elif self._planning.drift is not None and self.cost is not None and ok and run.first_hook:
            self._watch(run, results, time.perf_counter())
        if self.cfg.check_every and self.step % self.cfg.check_every == 0:
            # only here, once this step's jobs have drained: the check uses the same group
            check_consistency(self.model, self.group)
        return ok

    def _collect(self, run: StepRun, stats: StepStats) -> list[JobResult]:
        """Launch what the backward left unlaunched and wait for every job's result."""
        with self._life.lock:
            self._launch_ready(force=True)
        t0 = time.perf_counter()
        results = []
        for launched in run.launched:
            try:
                results.append(launched.future.result().settle())
            except Exception as e:
                self._run = StepRun()
                raise RuntimeError(
                    f"gradsync: communication failed on rank {self.rank} at step {self.step}: "
                    f"{e}\n(a peer that died, stalled or left the job makes this happen after "
                    f"Config.timeout_s={self.cfg.timeout_s:g}s; check the other ranks' logs)"
                ) from e
        stats.wait_s = time.perf_counter() - t0
        return results

    def _settle(self, run: StepRun, results: list[JobResult], stats: StepStats
                ) -> tuple[int, list[str], bool, bool | None]:
        """Every device-side check of the step in one read, before anything is applied: the
        jobs' missing tensors and their collectives' checks (:func:`settle`), prepare's
        deferred finiteness flags, the finiteness of every job's sum and, at P > 1, the ranks'
        agreement on them (:meth:`_agreement`, all-reduced before the read, so it costs no
        read of its own). Returns the missing tensors, this rank's non-finite tensors among
        the deferred jobs (named from the gradients, only when a flag failed), whether a sum
        was non-finite, and whether any rank saw a non-finite value (``None``: no agreement
        made, see :meth:`_agree`). ``ValueError`` on every rank when one received a malformed
        message: the details on that rank, a pointer to it on the others.

        Plain all-reduces (Mode.DENSE) carry a rank's non-finite gradient as it is (prepare
        does not look at them), so their sums, alike on every rank, are non-finite then: one
        check of the sums instead of one per tensor."""
        deferred = [lj for lj in run.launched if lj.finite is not None]
        # every sum: the plain all-reduces carry a non-finite gradient as it is, a selection
        # makes no finiteness read of its own (Sparsifier.select's checked), so an accumulator
        # that overflowed shows here, alike on every rank, instead of reaching .grad; and a
        # collective that finds NaN/Inf under skip_step (Ok-Topk) returns a sum of NaN
        finite = [*(lj.finite for lj in deferred), *(finite_flag(r.dense) for r in results)]
        word = self._agreement(results, finite, stats)
        extra = [] if word is None else [word >= 1, word >= 2]
        missing, flags = settle(list(zip(run.launched, results)), f"step {self.step}: ",
                                [*finite, *extra])
        agreed = None
        if word is not None:
            agreed, peer_wire = flags[len(finite):]
            if peer_wire:
                raise ValueError(f"gradsync: step {self.step}: another rank received a "
                                 "malformed message (its error names the check); nothing was "
                                 "applied")
        bad: list[str] = []
        for lj, ok in zip(deferred, flags):
            if not ok:  # rare: name the culprits, a read per tensor
                bad.extend(n for n in lj.job.names if not all_finite(self._grad(n)))
        return missing, bad, not all(flags[len(deferred):len(finite)]), agreed

    def _agreement(self, results: list[JobResult], finite: list[torch.Tensor],
                   stats: StepStats) -> torch.Tensor | None:
        """At P > 1, unless every job's result shows alike on every rank by itself
        (``JobResult.alike``: an all-reduce's sum; a TopkA at its capacity, whose every rank
        unpacks every message, each carrying its rank's non-finite flag as a NaN): one int64
        word, all-reduced (MAX) on the device before the step's read: 2 when some rank
        received a malformed message (a collective's check failed), else 1 when some rank saw
        a non-finite gradient or sum, else 0. So a rank whose check fails has met its peers
        in this collective, and they stop too instead of waiting for it at the next one.
        Without the word a step of TopkA saves a round: at P = 4 on 2 cores, about 2 ms of a
        37 ms step (docs/results/speed.md, "One round fewer")."""
        if self.P == 1 or _alike(results):
            return None
        wire = [check for r in results for check in r.checks]
        dev = finite[0].device if finite else wire[0][0].device if wire else torch.device("cpu")
        bad = None
        if finite:
            bad = ~torch.stack([f.reshape(()) for f in finite]).all()
        comm = Comm(self.group)
        word = agreement_word(comm, dev, wire, bad)
        stats.add_traffic(comm.stats)
        return word

    def _agree(self, run: StepRun, stats: StepStats, deferred_bad: list[str],
               dense_bad: bool, agreed: bool | None, alike: bool) -> bool:
        """Whether every rank's gradients were finite (``Config.nonfinite``), agreed by all
        (``deferred_bad``, ``dense_bad``, ``agreed``: what :meth:`_settle` found). A step whose
        results are ``alike`` on every rank (:meth:`_agreement`) needs no agreement: a
        non-finite sum, which every rank sees, is the verdict; in another step a non-finite
        sum joins this rank's flag."""
        bad_local = sorted(deferred_bad)
        if dense_bad:  # rare: name this rank's culprits for the message
            bad_local = sorted({*bad_local, *(n for lj in run.launched
                                              if lj.job.mode is Mode.DENSE
                                              for n in lj.job.names
                                              if not all_finite(self._grad(n)))})
        if alike:
            agreed = dense_bad
        return self._agree_finite(bool(bad_local) or dense_bad, stats, agreed, bad_local,
                                  _only_dense(run))

    def _apply(self, run: StepRun, results: list[JobResult], stats: StepStats, ok: bool) -> None:
        """Average every job's result into ``.grad`` and update residuals, or, when a rank
        had a non-finite gradient, zero the step's gradients and leave residuals alone."""
        if ok:
            for launched, res in zip(run.launched, results):
                apply(launched, res, self.params, self.P, self.ef, stats, self.step,
                      self._audit)
                stats.sparsify_s += res.offload_s
                stats.add_traffic(res.stats)
                stats.comm_s += res.stats.seconds
        else:
            stats.skipped = 1
            self._skip_grads()

    def _advance(self, run: StepRun, stats: StepStats) -> None:
        """Record the step's figures and start the next step."""
        stats.sparsify_s += run.inline_sparsify_s
        stats.hooks_s = run.launch_s
        stats.backward_s = run.backward_s
        traffic = self._planning.density.end_step(self.step, self.group)
        if traffic is not None:
            stats.add_traffic(traffic)
        self._counts.last = stats
        self._counts.total.add(stats)
        self._counts.step += 1
        self._run = StepRun()

    def _advance_warmup(self) -> None:
        """One profiling step done; after the last, plan (or take ``Config.plan``)."""
        self._planning.warmup.left -= 1
        if self._planning.warmup.left == 0:
            self._switch_plan(self._plan_after_warmup())

    def _fresh_velocity(self, names: set[str]) -> None:
        """The tensors that travelled whole during the warm-up and are sparsified from now on
        (not while ``Config.density_warmup`` still sends every tensor whole: :meth:`_switch_plan`)
        start their DGC velocity afresh, as a sparsified run starts (the ones sent whole keep
        theirs). Carried over at full strength, it entered every waiting entry's residual at
        once, and the entries crossed the threshold together some ten steps later: on the
        CNN (seed 8, 1 %, P = 4) SSFusion-OI's loss rose to 4.1× step 0's at step 16 and
        SSFusion's to 3.8×; with a fresh velocity their worst after step 5 is 1.5× and 1.8×
        (docs/results/convergence-cnn-10-seeds-fresh-velocity.md). A tensor whole during the
        warm-up holds no residual, so only momentum's tail is given up, as DGC's masking does."""
        if self.cfg.momentum > 0:
            for name in sorted(names):
                self.ef.reset(name)

    def _plan_after_warmup(self) -> Plan:
        if self._planning.given is not None:
            return self._planning.given  # a replay: nothing to profile or plan
        comm = Comm(self.group)
        first = next(iter(self.params.values()))
        plan, self._planning.cost = warmup.final_plan(
            self.cfg, self._planning.warmup.samples, list(self.params), self._replica.numel,
            first.element_size(), self._parts.sparsifier_name, self.group, self.rank,
            self.P, device=first.device, comm=comm,
            new_collective=self._parts.new_collective,
            mass=None if (m := self._planning.warmup.mass) is None
            else m.totals(list(self.params), comm))
        self._counts.last.add_traffic(comm.stats)  # profiling and the plan: this step's bytes
        self._counts.total.add_traffic(comm.stats)
        return plan

    def precondition(self, scales: Mapping[nn.Parameter | str, torch.Tensor]) -> None:
        """Compress ``scale ⊙ gradient`` from the next step on, per parameter (a parameter or
        its name → a positive tensor of its shape); residuals and velocities held are rescaled
        now, so nothing accumulated changes meaning (:mod:`gradsync.engine.preconditioning`).
        ``.grad`` then holds the averaged *scaled* update: the optimizer must not divide again
        (:class:`gradsync.optim.FrozenVarianceAdamW` calls this at its freeze when given
        ``sync=``). Every rank must pass bit-identical scales (checked: ``ValueError`` on every
        rank otherwise); call it between steps. The scales are part of :meth:`state_dict`."""
        self._between_steps("precondition")
        shapes = {n: p.shape for n, p in self.params.items()}

        def name_of(p: torch.Tensor) -> str | None:
            name = self._replica.name_of.get(id(p))
            return name if name in shapes else None

        apply_scales(self.ef, scales, resolver(shapes, name_of, "GradSync"), self.group,
                     "GradSync")

    def _between_steps(self, what: str) -> None:
        """``ValueError`` naming ``what`` once a gradient hook of this step has fired."""
        if self._run.first_hook or self._run.launched:
            raise ValueError(f"GradSync.{what}: a step is in progress (call it after "
                             "synchronize(), before the next backward)")

    def rescale(self, factor: float) -> None:
        """The gradients are ``factor`` times larger from the next step on (a loss scale that
        changed, e.g. ``torch.amp.GradScaler``'s after ``update()``): residuals and velocities
        held are multiplied by ``factor`` now, so what they hold keeps its meaning
        (:meth:`gradsync.feedback.ErrorFeedback.rescale`). Call it between steps, with the same
        factor on every rank. Thresholds reused between exact evaluations (Ok-Topk's local
        one in its selection, its global θ in its collective) are multiplied too: a power of
        two keeps every selection bit for bit the unscaled run's."""
        self._between_steps("rescale")
        self._rescale_held(factor)

    def _rescale_held(self, factor: float) -> None:
        self.ef.rescale(factor)  # checks the factor first
        self._parts.rescale(factor)
        if self._planning.warmup.mass is not None:  # Config.budget's masses, in the same units
            self._planning.warmup.mass.rescale(factor)

    def follow(self, what: Any) -> None:
        """Follow ``what`` from the next step on; call it once for each.

        - **An optimizer** (anything with ``param_groups``): its learning rate is read at each
          step's first gradient hook and, when a schedule changed it from η to η′, the residual
          is multiplied by η/η′, so that what error feedback owes stays the same update
          (:class:`gradsync.feedback.Units`); velocities are not (dense momentum's buffer is
          in gradient units too). Under a constant rate nothing changes.
          :class:`~gradsync.optim.FrozenVarianceAdamW` given ``sync=`` follows itself.
        - **A** ``torch.amp.GradScaler``: the scale is read at the step's first gradient hook
          and, when ``scaler.update()`` changed it, what error feedback holds is multiplied by
          ``new / old`` (:meth:`rescale`) before anything accumulates. A step that overflowed
          leaves NaN in ``.grad`` (``synchronize()`` returns ``False``) for the scaler to skip
          and back off from. Needs ``Config(nonfinite="skip_step")``, else ``ValueError``.

        The scale and rates the contents are in travel in :meth:`state_dict`. On CUDA, reading
        the scale waits for the device once per step (so does ``scaler.step``); a rate is read
        on the host (a tensor rate on the device would wait too)."""
        self._between_steps("follow")
        self._units.follow(what, self.cfg.nonfinite, "GradSync")

    def stats(self) -> dict[str, Any]:
        """Figures of the last step and cumulative ones (bytes, time breakdown, missing rate).

        ``probing``: ``auto`` is still measuring its runners-up (a trial in progress or one
        still to come, :class:`~gradsync.engine.drift.Drift`); always False for other
        schemes. Throughput after probing is what a long run sees."""
        d = self._planning.drift
        return {"step": self.step, "scheme": self.cfg.scheme, "world_size": self.P,
                "last": self._counts.last.as_dict(), "total": self._counts.total.as_dict(),
                "plan": self.plan.info if self.plan else {},
                "density": {"requested": self.cfg.density, "sent": self._sent_density(),
                            **self._planning.density.summary()},
                "probing": d is not None and (not d.probed or d.trial is not None)}

    def identity(self) -> Identity:
        """Who this engine is: its scheme, rank and world size, and its process group."""
        return Identity(kind=self.cfg.scheme, rank=self.rank, world_size=self.P,
                        group=self.group)

    def state_dict(self) -> dict[str, Any]:
        """Everything this rank needs to resume bitwise (see the module docstring).

        Residuals, velocities and sparsifier generators differ across ranks: save one state per
        rank (:mod:`gradsync.checkpoint` does, under ``rank{r}/`` keys for DCP).
        """
        parts, watch = self._parts.state_dict(), self._planning.drift
        return {
            "rank": self.rank, "world_size": self.P, "step": self.step,
            "config": self.cfg.to_dict(),
            "params": {n: list(p.shape) for n, p in self.params.items()},
            "dtypes": {n: str(p.dtype) for n, p in self.params.items()},
            "warmup_left": self._planning.warmup.left,
            "plan": self.plan.to_dict() if self.plan else None,
            "cost": self.cost.to_dict() if self.cost else None,
            "feedback": self.ef.state_dict(),
            "sparsifiers": parts["sparsifiers"],
            "collectives": parts["collectives"],
            "collective_density": parts["collective_density"],
            "bwd_times": [dict(t) for t in self._planning.warmup.samples],
            "warmup_mass": None if (m := self._planning.warmup.mass) is None else m.saved(),
            "total": self._counts.total.as_dict(),
            "drift": None if watch is None else watch.state_dict(),
            "loss_scale": self._units.loss_scale,
            "lr": None if self._units.lr is None else list(self._units.lr),
            "density_schedule": self._planning.density.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` of the same rank.

        A different world size, rank, scheme, trajectory-relevant config field (density,
        sparsifier, momentum, warm-up, bucket size, min density, seed) or model (parameter
        names, shapes, dtypes) raises ``ValueError`` before anything is changed, and so does a
        malformed ``auto`` drift entry. A checkpoint without a drift entry (saved before it was
        kept) resumes ``auto`` with a fresh watch: a new window and a new trial of the runner-up.
        """
        self.check_compatible(state)
        watch = self._drift_from(state)
        scale = saved_scale(state.get("loss_scale"), "GradSync.load_state_dict")
        rates = saved_rates(state.get("lr"), "GradSync.load_state_dict")
        # build every component first, so a bad entry raises before the engine changes
        parts = self._parts.loaded(state)
        density = DensitySchedule.loaded(self.cfg, state.get("density_schedule"))
        ef = self.cfg.new_feedback()
        ef.load_state_dict(state["feedback"])
        cost = costmodel.CostModel.from_dict(state["cost"]) if state["cost"] else None
        plan = Plan.from_dict(state["plan"]) if state["plan"] is not None else None
        if plan is not None:
            self._set_plan(plan)
        self._counts.step = int(state["step"])
        self._planning.warmup = warmup.Warmup.loaded(
            self.cfg, state, next(iter(self.params.values())).device)
        self._planning.cost = cost
        self.ef = ef
        self._parts.install(parts)
        self._counts.total = StepStats.from_dict(state.get("total", {}))
        self._planning.drift = watch
        self._planning.density = density
        self._planning.last_done = None
        self._units.loss_scale, self._units.lr = scale, rates

    def check_compatible(self, state: dict[str, Any]) -> None:
        """Raise ``ValueError`` unless ``state`` was saved by this rank of an equal set-up."""
        check_identity(state, self.identity(), "GradSync")
        if "config" not in state:
            raise ValueError("not a GradSync state_dict (no config entry)")
        if state["config"]["scheme"] != self.cfg.scheme:
            raise ValueError(f"checkpoint is for scheme {state['config']['scheme']!r}, this "
                             f"engine runs {self.cfg.scheme!r}")
        mine = {n: list(p.shape) for n, p in self.params.items()}
        check_params(state["params"], mine, "checkpoint")
        dtypes = {n: str(p.dtype) for n, p in self.params.items()}
        if state.get("dtypes", dtypes) != dtypes:
            bad = sorted(n for n in dtypes if state["dtypes"].get(n) != dtypes[n])
            raise ValueError(f"checkpoint is for a different model: dtypes differ for {bad[:5]}")
        diff = self.cfg.differences(state["config"], _RESUME_FIELDS)
        if diff:
            raise ValueError(f"checkpoint was saved with a different configuration: {diff}")
        self._drift_from(state)

    def _drift_from(self, state: dict[str, Any]) -> drift.Drift | None:
        """``auto``'s drift watch as ``state`` holds it: a fresh one when there is no entry (a
        checkpoint from before it was saved); ``ValueError`` when the entry is malformed or
        does not fit this engine (only ``auto`` with P > 1 keeps a watch)."""
        if "drift" not in state:
            return drift.Drift.for_config(self.cfg, self.P)
        saved = state["drift"]
        if (saved is None) != (self._planning.drift is None):
            raise ValueError(f"checkpoint's drift entry is {'empty' if saved is None else 'set'}"
                             f", but scheme {self.cfg.scheme!r} at P = {self.P} "
                             f"{'has no' if self._planning.drift is None else 'keeps a'} "
                             "drift watch")
        return None if saved is None else drift.Drift.from_state_dict(saved)

    def close(self) -> None:
        """Remove the hooks and stop the worker threads."""
        if self._life.closed:
            return
        self._life.closed = True
        for h in self._replica.handles:
            h.remove()
        self._exec.close()

    def __del__(self) -> None:  # pragma: no cover - best effort
        with contextlib.suppress(Exception):
            self.close()

    # ------------------------------------------------------------------ internals
    def _signature(self) -> dict[str, Any]:
        sig = {"config": self.cfg.to_dict(),
               "params": [(n, tuple(p.shape), str(p.dtype)) for n, p in self.params.items()]}
        if self.cfg.broadcast_initial:
            sig["states"] = state_signature(self.model)  # what the broadcast will move
        return sig

    def _watch(self, run: StepRun, results: list[JobResult], t_done: float) -> None:
        """``auto``: this step's measurements; at a window's end the ranks agree whether the
        step drifted from the prediction and, if so, take rank 0's new plan
        (:class:`~gradsync.engine.drift.Drift`)."""
        ar = sum(r.stats.seconds for lj, r in zip(run.launched, results)
                 if lj.job.transport == "allreduce")
        ag = sum(r.stats.seconds for lj, r in zip(run.launched, results)
                 if lj.job.transport != "allreduce")
        sp = run.inline_sparsify_s + sum(r.offload_s for r in results)
        last, self._planning.last_done = self._planning.last_done, t_done
        self._planning.drift.record(t_done - run.first_hook, ar, ag, sp,
                           max(0.0, run.backward_s - run.inline_sparsify_s),
                           None if last is None else t_done - last)
        flushed = self._planning.drift.after_step()  # a flushing step ran: now its plan
        if flushed is not None:
            self._switch_plan(flushed)
        if self._planning.drift.due:
            comm = Comm(self.group)
            got = self._planning.drift.check(self.cfg, self.plan, self.cost, self.group,
                                             self.rank, self.P, comm)
            # the watch's own traffic, in this step's bytes
            self._counts.last.add_traffic(comm.stats)
            self._counts.total.add_traffic(comm.stats)
            if got is not None:
                plan, self._planning.cost = got
                self._switch_plan(self._planning.drift.change(self.plan, plan))

    def _switch_plan(self, plan: Plan) -> None:
        """Take another plan between steps (the warm-up's end; ``auto``'s trials, their way
        back, its re-plans): the tensors it sparsifies that the last plan sent whole start
        their velocity afresh (:meth:`_fresh_velocity`)."""
        before = self.plan.sparsified
        self._set_plan(plan)
        if self._planning.density.at(self.step) < 1.0:
            self._fresh_velocity(plan.sparsified - before)
        # else DGC's warm-up still sends every tensor whole: their velocity is a dense run's
        # and stays (under FrozenVarianceAdamW it is Adam's first moment: dropped one step
        # before the freeze, it cost TinyGPT's SSFusion +4.5 % perplexity, 19.92 -> 20.82)

    def _set_plan(self, plan: Plan) -> None:
        jobs = plan_jobs(plan, self._parts.collective_name, list(self.params), self.cfg.pooled)
        self._layout = _Layout(plan, jobs, {n: i for i, j in enumerate(jobs) for n in j.names},
                               [len(j.names) for j in jobs])
        run = self._run
        if run.ready:  # a plan loaded between hooks: recount
            run.waiting = [sum(n not in run.ready for n in j.names) for j in jobs]
        why = dishonoured_density(self.cfg.scheme, self.cfg.density, self._sent_density(),
                                  self.cfg.effective_min_k)
        if why is not None and self.rank == 0 and not self._planning.said:
            self._planning.said = True
            warnings.warn(why, stacklevel=3)

    def _sent_density(self) -> float | None:
        """The density the plan sends, as SSFusion's compensation worked it out
        (:func:`gradsync.schedule.ssfusion.charge_bytes`); None for the other planners."""
        comp = (self.plan.info or {}).get("compensation") if self.plan is not None else None
        return comp.get("sent_density") if comp else None

    def _hook(self, p: torch.Tensor) -> None:
        if self._life.no_sync or self._life.closed:
            return
        name = self._replica.name_of[id(p)]
        run = self._run
        if not run.first_hook:  # the step's first gradient: a followed scaler's scale
            self._units.update(self._rescale_held, self.ef.rescale_residual)
        if p.is_cuda and self._planning.warmup.left > 0:  # profiling: when the gradient IS ready
            torch.cuda.current_stream(p.device).synchronize()
        run.hooked(name, time.perf_counter())
        if self._planning.warmup.left > 0 or not self.plan.overlap:
            return  # profiling steps and non-overlapped plans launch in synchronize()
        with self._life.lock:
            run.mark_ready(name, self._layout.job_of[name], self._layout.job_sizes)
            self._launch_ready(force=False)

    def _launch_ready(self, force: bool) -> None:
        """Launch jobs in plan order while all their tensors are ready (or ``force``); the
        time a gradient hook spends launching is the step's ``hooks_s``."""
        run = self._run
        while run.next_job < len(self._layout.jobs):
            job = self._layout.jobs[run.next_job]
            if not force and not run.job_ready(run.next_job):
                return
            t0 = time.perf_counter()
            self._launch(job, run.next_job)
            run.next_job += 1
            if not force:
                run.launch_s += time.perf_counter() - t0

    def _grad(self, name: str) -> torch.Tensor:
        p = self.params[name]
        if p.grad is None:
            return torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
        return p.grad.detach().reshape(-1)

    def _launch(self, job: Job, index: int) -> None:
        sizes = tuple(self._replica.numel[n] for n in job.names)
        job = at_density(job, self._planning.density.at(self.step), self.cfg.density,
                         self._replica.numel, self.P)
        grad, storage = self._gather(index, job.names)
        self._planning.density.observe(grad)
        if self._planning.warmup.left > 0 and self._planning.warmup.mass is not None:
            self._planning.warmup.mass.weigh(job.names, sizes, grad)  # Config.budget
        prep = prepare(job, index, grad, sizes, self.ef, self._parts.sparsifier,
                       self._exec.offload, self.step,
                       clip=None if self.cfg.clip_norm is None else (self.cfg.clip_norm, self.P),
                       reuse=storage is None)
        self._run.inline_sparsify_s += prep.sparsify_s
        # what is sent, before the communication thread may sum into it (a raw dense job)
        audit_acc = ((grad if prep.acc is None else prep.acc).detach().clone()
                     if self._audit.enabled else None)
        future = self._exec.submit(job, index, prep.payload, self.step, prep.finite)
        self._run.launched.append(Launched(job, index, sizes, prep.acc, future, audit_acc,
                                           storage, prep.finite))

    def _gather(self, index: int, names: tuple[str, ...]
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Job ``index``'s gradients as one flat tensor, and the job's gradient storage, if it
        has one: a flat buffer of which every parameter's ``.grad`` is a view (as DDP's
        ``gradient_as_bucket_view``), so gathering costs nothing where ``.grad`` already is the
        view and one copy where autograd made a new one (``zero_grad(set_to_none=True)``), and
        the averaged result lands in every ``.grad`` in one write. Parameters of mixed dtypes
        or devices have no storage: their gradients are concatenated."""
        if index not in self._layout.storage:
            self._layout.storage[index] = self._new_storage(names)
        st = self._layout.storage[index]
        if st is None:
            return torch.cat([self._grad(n) for n in names]), None
        flat, slots = st
        for n, slot in zip(names, slots):
            p = self.params[n]
            if p.grad is not slot:
                if p.grad is None:  # no gradient this step: it counts as zero
                    slot.zero_()
                else:
                    slot.copy_(p.grad)
                p.grad = slot
        return flat, flat

    def _new_storage(self, names: tuple[str, ...]
                     ) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        ps = [self.params[n] for n in names]
        if any(p.dtype != ps[0].dtype or p.device != ps[0].device
               or p.layout is not torch.strided for p in ps):
            return None
        flat = torch.zeros(sum(p.numel() for p in ps), dtype=ps[0].dtype, device=ps[0].device)
        slots, o = [], 0
        for p in ps:
            slots.append(flat[o:o + p.numel()].view_as(p))
            o += p.numel()
        return flat, slots

    def _skip_grads(self) -> None:
        """A skipped step (``nonfinite="skip_step"``): nothing accumulated is kept, and every
        ``.grad`` is zeroed, or NaN while following a GradScaler, which must see the overflow."""
        for name, p in self.params.items():
            self.ef.discard(name)
            if p.grad is not None:
                p.grad.fill_(math.nan if self._units.scaler is not None
                             and self._units.scaler.is_enabled() else 0.0)

    def _local_step(self) -> bool:
        """World size 1 without ``Config.compress_single_rank``: the step at density 1 with
        nothing to send. Everything but compression stays: the non-finite policy (one read for
        every gradient), a followed GradScaler, and what error feedback does to a gradient sent
        whole (clipping, a preconditioning scale, DGC's momentum velocity, which ``.grad`` then
        holds). With none of those ``.grad`` is left as it is: plain training."""
        stats = StepStats()
        grads = {n: p.grad for n, p in self.params.items() if p.grad is not None}
        bad = [n for n, ok in zip(grads, all_finite_each(list(grads.values()))) if not ok]
        if not self._agree_finite(bool(bad), stats, None, bad):
            self._skip_grads()
            stats.skipped = 1
        else:
            self._units.update(self._rescale_held, self.ef.rescale_residual)
            into = [n for n in grads if self.ef.transforms(n) or self.cfg.clip_norm is not None]
            flat = [grads[n].detach().reshape(-1) for n in into]
            if self.cfg.clip_norm is not None:
                flat = clip_local(flat, self.cfg.clip_norm, 1)
            for n, g in zip(into, flat):
                acc = self.ef.accumulate(n, g, check=False)
                sent = acc.to(grads[n].dtype)  # the residual keeps the rounding, as when sent
                self.ef.update(n, acc, None, None if sent.dtype == acc.dtype else sent,
                               check=False)  # sent whole: the velocity carries on
                grads[n].copy_(sent.view_as(grads[n]))
        self._counts.last = stats
        self._counts.total.add(stats)
        self._counts.step += 1
        return not stats.skipped

    def _abandon(self) -> None:
        """A step that raised: its pending error feedback discarded (residuals as before it),
        its jobs forgotten and its number spent, so the next step starts fresh."""
        for name in self.params:
            self.ef.discard(name)
        self._counts.step += 1
        self._run = StepRun()

    def _agree_finite(self, bad: bool, stats: StepStats, agreed: bool | None,
                      bad_local: list[str], only_dense: bool = False) -> bool:
        """All ranks agree whether any gradient was non-finite (``bad``: this rank saw one;
        ``agreed``: already known alike on every rank, no collective), then apply the policy
        (``bad_local``: this rank's non-finite tensors, for the message)."""
        any_bad = bad if agreed is None else agreed
        if self.P > 1 and agreed is None:  # the flag travels; otherwise the host knows it
            flag = torch.tensor([int(bad)], dtype=torch.int64)
            comm = Comm(self.group)
            comm.all_reduce(flag, op=dist.ReduceOp.MAX)
            stats.add_traffic(comm.stats)
            any_bad = bool(int(flag))
        if not any_bad:
            return True
        where = (f"on this rank ({self.rank}) in {bad_local}" if bad_local
                 else "on another rank (or the all-reduced sum overflowed)" if only_dense
                 else "on another rank (or a sum overflowed)")
        if self.cfg.nonfinite == "raise":
            self._abandon()
            raise ValueError(f"gradsync: non-finite gradient {where} at step {self.step - 1}; "
                             "residuals were left untouched (Config.nonfinite='raise')")
        return False


def _alike(results: list[JobResult]) -> bool:
    """Every job's result shows a malformed message and a rank's non-finite gradient alike on
    every rank (``JobResult.alike``), so the step needs no agreement word."""
    return all(r.alike for r in results)


def _only_dense(run: StepRun) -> bool:
    """Every job of the step was a plain all-reduce: its sums, alike on every rank, tell
    whether a gradient was non-finite, with no agreement collective."""
    return bool(run.launched) and all(lj.job.mode is Mode.DENSE for lj in run.launched)
