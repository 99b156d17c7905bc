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

A *plan* (``gradsync.schedule``) groups tensors into fusion buffers and says, per buffer, whether
it is all-reduced dense, sparsified as one fused vector (multi-tensor), or sparsified per tensor
(SSFusion: small tensors dense; SSFusion-I: a dense all-reduce part and a sparse all-gather
part). The engine turns each buffer into one or two *jobs* and runs them strictly in plan order
on one communication thread, so every rank issues the same collectives in the same order.

Schemes that need a cost model (MG-WFBP/OMGS, Cupcake, SSFusion*) first run ``warmup_steps``
profiling iterations without overlap: hooks only time the backward pass; then the engine
profiles sparsification and the group's α/β, rank 0 plans, and the plan is broadcast. Every
scheme runs at least one such step to observe the real backward order of the gradients.

Invariants (tested): ``dense`` results are bitwise identical on every rank, so replicas never
drift; per parameter and step, ``accumulated == sent + residual`` exactly (error feedback);
at density 1 every scheme's averaged gradient equals plain DDP's within float tolerance.

Audit (opt-in, for tests and debugging): ``GradSync(model, cfg, audit=True)`` keeps, for the
last step, one :class:`AuditRecord` per parameter in ``sync.audit_log`` (``audit=callable``
calls it with each record instead): the accumulated gradient ``acc``, the indices and values
this rank really put on the wire that entered the result (taken from the payload handed to the
collective, before it ran) and the new residual, so that
``acc == scatter(sent_indices, sent_values) + residual`` can be checked bit for bit. It clones
every accumulated gradient and payload; leave it off in training.

Checkpoints: :meth:`GradSync.state_dict` holds everything a bitwise resume needs — step,
warm-up progress and backward-order samples, plan and cost model, residuals and DGC velocities,
every sparsifier's generator and threshold state, every collective's state (Ok-Topk thresholds
and boundaries, DenseStream boundaries) — and is per rank (residuals differ across ranks);
:mod:`gradsync.checkpoint` saves it with the model and optimizer (torch.save or DCP).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradsync import collectives, schedule, sparsify
from gradsync.collectives.comm import Comm
from gradsync.engine.config import Config
from gradsync.engine.consistency import check_consistency, signature_check
from gradsync.engine.state import Identity
from gradsync.feedback import ErrorFeedback
from gradsync.schedule import BufferPlan, Plan, costmodel
from gradsync.sparsegrad import SparseGrad, all_finite

__all__ = ["AuditRecord", "GradSync", "StepStats"]

# Config fields that change the trajectory: a checkpoint must be loaded with equal values.
# (nonfinite, timeout_s and check_every may change between runs.)
_RESUME_FIELDS = ("scheme", "density", "sparsifier", "momentum", "warmup_steps", "bucket_mb",
                  "min_density", "seed")

# The sparse collective each scheme reduces with (the papers' pairings): the fusion schemes of
# SSFusion all-gather their COO selections (TopkA), the Ok-Topk/DenseStream schemes use theirs.
_SCHEME_COLLECTIVE = {
    "topka": "topka", "topkdsa": "topkdsa", "gtopk": "gtopk", "oktopk": "oktopk",
    "densestream": "densestream", "gaussiank": "topka",
}


@dataclass
class StepStats:
    """One step's (or the cumulative) figures of a rank."""

    bytes_sent: int = 0
    bytes_recv: int = 0
    messages: int = 0
    backward_s: float = 0.0  # first to last gradient hook
    sparsify_s: float = 0.0  # inline + offloaded sparsification
    comm_s: float = 0.0  # time inside collectives (communication thread)
    wait_s: float = 0.0  # synchronize() blocked on communication: the exposed part
    selected: int = 0  # entries this rank sent that entered the result
    numel: int = 0
    tensors: int = 0
    missing: int = 0  # tensors of which no entry was synchronized (SSFusion Table I)
    skipped: int = 0  # steps skipped for non-finite gradients

    @property
    def missing_rate(self) -> float:
        return self.missing / self.tensors if self.tensors else 0.0

    def add(self, other: StepStats) -> None:
        for k, v in vars(other).items():
            setattr(self, k, getattr(self, k) + v)

    def as_dict(self) -> dict[str, float]:
        d = dict(vars(self))
        d["missing_rate"] = self.missing_rate
        return d


@dataclass
class AuditRecord:
    """What one parameter's synchronization did on this rank in one step (``audit=True``).

    All tensors are flat copies in the accumulator's dtype / int64. For ``dense`` jobs (no
    error feedback) ``acc`` is the raw gradient, every index is sent and ``residual`` is zeros.
    """

    step: int
    name: str
    mode: str  # the job's mode: "dense", "fused", "per_tensor"
    transport: str  # "allreduce" or the collective's name
    acc: torch.Tensor  # accumulated gradient (residual + gradient, momentum-corrected)
    sent_indices: torch.Tensor  # positions in ``acc`` consumed by the collective
    sent_values: torch.Tensor  # the values at those positions as they were handed to it
    residual: torch.Tensor  # residual after the step


@dataclass
class _Job:
    """One collective of a plan: a group of tensors and how they travel."""

    names: list[str]
    mode: str  # "dense" (all-reduce raw grads, no EF), "fused", "per_tensor"
    transport: str  # "allreduce" or a collective name
    density: float | None = None  # fused mode
    densities: dict[str, float | None] = field(default_factory=dict)  # per_tensor mode
    offload: frozenset[str] = frozenset()


@dataclass
class _Launched:
    job: _Job
    accs: dict[str, torch.Tensor]  # per-tensor accumulated gradient (flat)
    future: Future
    nonfinite: list[str]
    audit_accs: dict[str, torch.Tensor] | None = None  # clones of accs (audit only)


class GradSync:
    """Compressed, overlapped gradient synchronization for a model replicated on every rank.

    Args:
        model: the local replica; every parameter with ``requires_grad`` is synchronized
            (frozen parameters are ignored, parameters without a gradient in a step count as
            zero).
        config: a :class:`Config` (default ``Config()``: SSFusion-OI with DGC at 1%).
        group: the process group; ``None`` creates a dedicated group over all ranks (so the
            engine's background communication never interleaves with the caller's own
            collectives) with ``config.timeout_s``. Without an initialised process group the
            engine runs as a single rank.
        audit: ``True`` keeps the last step's :class:`AuditRecord` s in ``audit_log``; a
            callable receives every record as it is made; ``False`` (default) records nothing.
    """

    def __init__(self, model: nn.Module, config: Config | None = None,
                 group: dist.ProcessGroup | None = None,
                 audit: bool | Callable[[AuditRecord], None] = False) -> None:
        if not (isinstance(audit, bool) or callable(audit)):
            raise ValueError(f"audit must be a bool or a callable, got {type(audit).__name__}")
        self._audit = audit
        self.audit_log: list[AuditRecord] = []
        self.cfg = config or Config()
        self.model = model
        self.params: dict[str, nn.Parameter] = {
            n: p for n, p in model.named_parameters() if p.requires_grad
        }
        if not self.params:
            raise ValueError("GradSync: the model has no parameter that requires grad")
        self._initialised = dist.is_available() and dist.is_initialized()
        if self._initialised and group is None:
            group = dist.new_group(timeout=timedelta(seconds=self.cfg.timeout_s))
        self.group = group
        probe = Comm(group)
        self.rank, self.P = probe.rank, probe.size
        if self.P > 1:
            signature_check(self._signature(), group)
        self.ef = ErrorFeedback(momentum=self.cfg.momentum)
        self.step = 0
        self.plan: Plan | None = None
        self.cost: costmodel.CostModel | None = None
        self._sparsifiers: dict[str, sparsify.Sparsifier] = {}
        self._collectives: dict[str, collectives.Collective] = {}
        self._numel = {n: p.numel() for n, p in self.params.items()}
        self._warmup_left = self.cfg.warmup_steps if schedule.needs_cost_model(
            self.cfg.scheme) else 1
        # the provisional plan (before the backward order is observed): reversed registration
        # order, as DDP assumes
        self._set_plan(self._provisional_plan(list(reversed(self.params))))
        self._comm = ThreadPoolExecutor(1, thread_name_prefix="gradsync-comm")
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="gradsync-sparsify")
        self._lock = threading.Lock()
        self._no_sync = False
        self._closed = False
        self._reset_step()
        self.last = StepStats()
        self.total = StepStats()
        self._bwd_times: list[dict[str, float]] = []
        self._handles = [p.register_post_accumulate_grad_hook(self._hook)
                         for p in self.params.values()]
        self._name_of = {id(p): n for n, p in self.params.items()}

    # ------------------------------------------------------------------ public API
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (micro-batches); synchronize after the block."""
        prev, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = prev

    def synchronize(self) -> bool:
        """Finish the step's synchronization and write averaged gradients into ``.grad``.

        Returns ``True``, or ``False`` when ``Config.nonfinite == "skip_step"`` and some rank
        had a NaN/Inf gradient (then every rank's gradients are zeroed and residuals are left
        as before the step; skip ``optimizer.step()``).
        """
        if self._closed:
            raise RuntimeError("GradSync.synchronize() after close()")
        if self._no_sync:
            raise RuntimeError("GradSync.synchronize() inside no_sync(): leave the block first")
        stats = StepStats()
        self.audit_log = []
        profiling = self._warmup_left > 0
        if profiling:
            self._record_backward_order()
        with self._lock:
            self._launch_ready(force=True)
        t0 = time.perf_counter()
        results = []
        for launched in self._launched:
            try:
                results.append(launched.future.result())
            except Exception as e:
                self._reset_step()
                raise RuntimeError(
                    f"gradsync: communication failed on rank {self.rank} at step {self.step}: "
                    f"{e}\n(a peer that died, stalled or left the job makes this happen after "
                    f"Config.timeout_s={self.cfg.timeout_s:g}s; check the other ranks' logs)"
                ) from e
        stats.wait_s = time.perf_counter() - t0
        bad_local = sorted({n for lj in self._launched for n in lj.nonfinite})
        ok = self._agree_finite(bad_local, stats)
        if ok:
            for launched, (dense, kept, cstats, sp_s, sent) in zip(self._launched, results):
                self._apply(launched, dense, kept, stats, sent)
                stats.sparsify_s += sp_s
                stats.bytes_sent += cstats.bytes_sent
                stats.bytes_recv += cstats.bytes_recv
                stats.messages += cstats.messages
                stats.comm_s += cstats.seconds
        else:
            stats.skipped = 1
            for name in self.params:
                self.ef.discard(name)
                p = self.params[name]
                if p.grad is not None:
                    p.grad.zero_()
        stats.sparsify_s += self._inline_sparsify_s
        stats.backward_s = (self._last_hook - self._first_hook) if self._first_hook else 0.0
        self.last = stats
        self.total.add(stats)
        self.step += 1
        self._reset_step()
        if profiling:
            self._warmup_left -= 1
            if self._warmup_left == 0:
                self._make_final_plan()
        if self.cfg.check_every and self.step % self.cfg.check_every == 0:
            # only here, once this step's jobs have drained: the check uses the same group
            check_consistency(self.model, self.group)
        return ok

    def stats(self) -> dict[str, Any]:
        """Figures of the last step and cumulative ones (bytes, time breakdown, missing rate)."""
        return {"step": self.step, "scheme": self.cfg.scheme, "world_size": self.P,
                "last": self.last.as_dict(), "total": self.total.as_dict(),
                "plan": self.plan.info if self.plan else {}}

    def identity(self) -> Identity:
        """Who this engine is, for checkpoints (:class:`gradsync.engine.state.Stateful`)."""
        return Identity(self.cfg.scheme, self.rank, self.P, self.group)

    def state_dict(self) -> dict[str, Any]:
        """Everything this rank needs to resume bitwise (see the module docstring).

        Residuals, velocities and sparsifier generators differ across ranks: save one state per
        rank (:mod:`gradsync.checkpoint` does, under ``rank{r}/`` keys for DCP).
        """
        return {
            "rank": self.rank, "world_size": self.P, "step": self.step,
            "config": self.cfg.to_dict(),
            "params": {n: list(p.shape) for n, p in self.params.items()},
            "dtypes": {n: str(p.dtype) for n, p in self.params.items()},
            "warmup_left": self._warmup_left,
            "plan": self.plan.to_dict() if self.plan else None,
            "cost": self.cost.to_dict() if self.cost else None,
            "feedback": self.ef.state_dict(),
            "sparsifiers": {k: s.state_dict() for k, s in self._sparsifiers.items()},
            "collectives": {k: c.state_dict() for k, c in self._collectives.items()},
            "bwd_times": [dict(t) for t in self._bwd_times],
            "total": self.total.as_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` of the same rank.

        A different world size, rank, scheme, trajectory-relevant config field (density,
        sparsifier, momentum, warm-up, bucket size, min density, seed) or model (parameter
        names, shapes, dtypes) raises ``ValueError`` before anything is changed.
        """
        self.check_compatible(state)
        # build every component first, so a bad entry raises before the engine changes
        sparsifiers = {}
        for k, s in state["sparsifiers"].items():
            sp = sparsify.get(self._sparsifier_name(), density=s["density"],
                              seed=self._sparsifier_seed(k))
            sp.load_state_dict(s)
            sparsifiers[k] = sp
        colls = {}
        for k, s in state["collectives"].items():
            c = self._new_collective()
            c.load_state_dict(s)
            colls[k] = c
        ef = ErrorFeedback(momentum=self.cfg.momentum)
        ef.load_state_dict(state["feedback"])
        cost = costmodel.CostModel.from_dict(state["cost"]) if state["cost"] else None
        plan = Plan.from_dict(state["plan"]) if state["plan"] is not None else None
        if plan is not None:
            self._set_plan(plan)
        self.step = int(state["step"])
        self._warmup_left = int(state["warmup_left"])
        self.cost = cost
        self.ef = ef
        self._sparsifiers = sparsifiers
        self._collectives = colls
        self._bwd_times = [dict(t) for t in state.get("bwd_times", [])]
        self.total = StepStats()
        for k, v in state.get("total", {}).items():
            if k != "missing_rate" and hasattr(self.total, k):
                setattr(self.total, k, v)

    def check_compatible(self, state: dict[str, Any]) -> None:
        """Raise ``ValueError`` unless ``state`` was saved by this rank of an equal set-up."""
        if not isinstance(state, dict) or "world_size" not in state or "config" not in state:
            raise ValueError("not a GradSync state_dict (no world_size/config entries)")
        if state["world_size"] != self.P:
            raise ValueError(f"checkpoint is from world size {state['world_size']}, this job "
                             f"has {self.P}: residuals are per rank and cannot be re-sharded")
        if state["config"]["scheme"] != self.cfg.scheme:
            raise ValueError(f"checkpoint is for scheme {state['config']['scheme']!r}, this "
                             f"engine runs {self.cfg.scheme!r}")
        mine = {n: list(p.shape) for n, p in self.params.items()}
        if state["params"] != mine:
            raise ValueError("checkpoint is for a different model: "
                             f"{_diff_params(state['params'], mine)}")
        dtypes = {n: str(p.dtype) for n, p in self.params.items()}
        if state.get("dtypes", dtypes) != dtypes:
            bad = sorted(n for n in dtypes if state["dtypes"].get(n) != dtypes[n])
            raise ValueError(f"checkpoint is for a different model: dtypes differ for {bad[:5]}")
        if state.get("rank", self.rank) != self.rank:
            raise ValueError(f"checkpoint state of rank {state['rank']} loaded on rank "
                             f"{self.rank}: residuals are per rank, load this rank's own state")
        cfg = self.cfg.to_dict()
        diff = [f"{k}: saved {state['config'].get(k)!r}, here {cfg[k]!r}"
                for k in _RESUME_FIELDS if state["config"].get(k) != cfg[k]]
        if diff:
            raise ValueError(f"checkpoint was saved with a different configuration: {diff}")

    def close(self) -> None:
        """Remove the hooks and stop the worker threads."""
        if self._closed:
            return
        self._closed = True
        for h in self._handles:
            h.remove()
        self._comm.shutdown(wait=True)
        self._worker.shutdown(wait=True)

    def __del__(self) -> None:  # pragma: no cover - best effort
        with contextlib.suppress(Exception):
            self.close()

    # ------------------------------------------------------------------ plan handling
    def _signature(self) -> dict[str, Any]:
        return {"config": self.cfg.to_dict(),
                "params": [(n, tuple(p.shape), str(p.dtype)) for n, p in self.params.items()]}

    def _provisional_plan(self, order: list[str]) -> Plan:
        scheme = self.cfg.scheme
        kw = {"bucket_bytes": int(self.cfg.bucket_mb * 2**20),
              "min_density": self.cfg.min_density}
        if not schedule.needs_cost_model(scheme):
            return schedule.make_plan(scheme, order, self._numel, self.cfg.density, **kw)
        if scheme in ("multi_tensor", "omgs", "cupcake"):
            # fixed buckets, sparsified as fused vectors: multi-tensor semantics while profiling
            base = schedule.make_plan("dense_ovlp", order, self._numel, self.cfg.density, **kw)
            bufs = [BufferPlan(tensors=b.tensors, mode="fused", density=self.cfg.density)
                    for b in base.buffers]
            return Plan(scheme=scheme, buffers=bufs, info={"provisional": True})
        plan = schedule.make_plan("per_tensor", order, self._numel, self.cfg.density, **kw)
        plan.scheme = scheme
        plan.info["provisional"] = True
        return plan

    def _set_plan(self, plan: Plan) -> None:
        self.plan = plan
        jobs: list[_Job] = []
        sparse = _SCHEME_COLLECTIVE.get(self.cfg.scheme, "topka")
        for buf in plan.buffers:
            names = [t.name for t in buf.tensors]
            if buf.mode == "dense":
                jobs.append(_Job(names, "dense", "allreduce"))
            elif buf.mode == "fused":
                jobs.append(_Job(names, "fused", sparse, density=buf.density))
            elif buf.mode == "per_tensor":
                ar = [t for t in buf.tensors if t.allreduce]
                ag = [t for t in buf.tensors if not t.allreduce]
                for part, transport in ((ar, "allreduce"), (ag, sparse)):
                    if part:
                        jobs.append(_Job(
                            [t.name for t in part], "per_tensor", transport,
                            densities={t.name: t.density for t in part},
                            offload=frozenset(t.name for t in part if t.offload)))
            else:
                raise ValueError(f"plan buffer mode {buf.mode!r} is unknown")
        covered = sorted(n for j in jobs for n in j.names)
        if covered != sorted(self.params):
            raise ValueError("plan does not cover every parameter exactly once")
        self._jobs = jobs
        self._job_of = {n: i for i, j in enumerate(jobs) for n in j.names}

    def _record_backward_order(self) -> None:
        if self._hook_times:
            self._bwd_times.append(dict(self._hook_times))

    def _make_final_plan(self) -> None:
        """After the profiling steps: cost model → plan on rank 0 → broadcast."""
        order, backward = _backward_profile(self._bwd_times, list(self.params))
        needs = schedule.needs_cost_model(self.cfg.scheme)
        payload: list[Any] = [None]
        if needs:
            ar, ag = costmodel.profile_collectives(self.group)
        if self.rank == 0:
            cost = None
            if needs:
                probe = sparsify.get(self._sparsifier_name(), density=self.cfg.density,
                                     seed=self.cfg.seed)
                inline = costmodel.profile_sparsifier(probe)
                offload = costmodel.profile_sparsifier(probe, offload=True)
                cost = costmodel.CostModel(
                    P=self.P, order=order, numel=dict(self._numel),
                    elem_bytes=next(iter(self.params.values())).element_size(),
                    backward=backward, sparsify=inline, offload=offload,
                    allreduce=ar, allgather=ag)
            plan = schedule.make_plan(
                self.cfg.scheme, order, self._numel, self.cfg.density, cost,
                bucket_bytes=int(self.cfg.bucket_mb * 2**20), min_density=self.cfg.min_density)
            payload = [{"plan": plan.to_dict(), "cost": cost.to_dict() if cost else None}]
        if self.P > 1:
            dist.broadcast_object_list(payload, src=_global(self.group, 0), group=self.group)
        got = payload[0]
        self.cost = costmodel.CostModel.from_dict(got["cost"]) if got["cost"] else None
        self._set_plan(Plan.from_dict(got["plan"]))

    # ------------------------------------------------------------------ per-step runtime
    def _reset_step(self) -> None:
        self._ready: set[str] = set()
        self._next_job = 0
        self._launched: list[_Launched] = []
        self._hook_times: dict[str, float] = {}
        self._first_hook = 0.0
        self._last_hook = 0.0
        self._inline_sparsify_s = 0.0

    def _hook(self, p: torch.Tensor) -> None:
        if self._no_sync or self._closed:
            return
        name = self._name_of[id(p)]
        now = time.perf_counter()
        self._first_hook = self._first_hook or now
        self._last_hook = now
        self._hook_times.setdefault(name, now)
        if self._warmup_left > 0 or not self.plan.overlap:
            return  # profiling steps and non-overlapped plans launch in synchronize()
        with self._lock:
            self._ready.add(name)
            self._launch_ready(force=False)

    def _launch_ready(self, force: bool) -> None:
        """Launch jobs in plan order while all their tensors are ready (or ``force``)."""
        while self._next_job < len(self._jobs):
            job = self._jobs[self._next_job]
            if not force and any(n not in self._ready for n in job.names):
                return
            self._launch(job)
            self._next_job += 1

    def _grad(self, name: str) -> torch.Tensor:
        p = self.params[name]
        if p.grad is None:
            return torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
        return p.grad.detach().reshape(-1)

    def _launch(self, job: _Job) -> None:
        nonfinite = [n for n in job.names if not all_finite(self._grad(n))]
        accs: dict[str, torch.Tensor] = {}
        for n in job.names:
            g = self._grad(n)
            if n in nonfinite:
                g = torch.zeros_like(g)  # never enters a residual; the step is agreed below
                accs[n] = g
            elif job.mode == "dense":
                accs[n] = g
            else:
                accs[n] = self.ef.accumulate(n, g)
        t0 = time.perf_counter()
        if job.mode == "dense":
            payload: Any = ("dense", torch.cat([accs[n] for n in job.names]))
        elif job.mode == "fused":
            flat = torch.cat([accs[n] for n in job.names])
            key = f"buffer:{self._next_job}"
            payload = ("sparse", [self._sparsifier(key, job.density).select(flat, self.step)])
        else:
            parts = []
            for n in job.names:
                d = job.densities[n]
                if d is None:  # not sparsified: every entry travels
                    parts.append(SparseGrad(torch.arange(accs[n].numel(), device=accs[n].device),
                                            accs[n], accs[n].numel(), validate=False))
                elif n in job.offload:
                    parts.append(self._offload(self._sparsifier(n, d), accs[n]))
                else:
                    parts.append(self._sparsifier(n, d).select(accs[n], self.step))
            payload = ("parts", parts)
        self._inline_sparsify_s += time.perf_counter() - t0
        audit_accs = {n: a.detach().clone() for n, a in accs.items()} if self._audit else None
        future = self._comm.submit(self._communicate, job, self._next_job, payload, self.step)
        self._launched.append(_Launched(job, accs, future, nonfinite, audit_accs))

    def _offload(self, sp: sparsify.Sparsifier, acc: torch.Tensor) -> Future:
        """SSFusion-O: sparsify on the worker thread (via pinned host memory on CUDA)."""
        step = self.step
        if acc.is_cuda:
            host = torch.empty(acc.shape, dtype=acc.dtype, pin_memory=True)
            host.copy_(acc, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()

            def work() -> tuple[SparseGrad, float]:
                ready.synchronize()
                t0 = time.perf_counter()
                sel = sp.select(host, step)
                out = SparseGrad(sel.indices.to(acc.device, non_blocking=True),
                                 sel.values.to(acc.device, non_blocking=True), sel.numel,
                                 validate=False)
                return out, time.perf_counter() - t0
        else:
            def work() -> tuple[SparseGrad, float]:
                t0 = time.perf_counter()
                return sp.select(acc, step), time.perf_counter() - t0
        return self._worker.submit(work)

    def _communicate(self, job: _Job, index: int, payload: Any, step: int):
        """Runs on the communication thread: one collective, in plan order.

        Returns ``(dense_sum, kept, comm_stats, offload_s, sent)``; ``sent`` is ``None``
        unless auditing, then a copy of the (indices, values) handed to the collective.
        """
        kind, data = payload
        offload_s = 0.0
        if kind == "dense":
            sent = (None, data.clone()) if self._audit else None
            comm = Comm(self.group)
            t0 = time.perf_counter()
            comm.all_reduce(data)
            comm.stats.seconds = time.perf_counter() - t0
            return data, None, comm.stats, 0.0, sent
        sels = []
        for part in data:
            if isinstance(part, Future):
                part, s = part.result()
                offload_s += s
            sels.append(part)
        sel = _concat(sels) if kind == "parts" else sels[0]
        sent = (sel.indices.clone(), sel.values.clone()) if self._audit else None
        if job.transport == "allreduce":
            comm = Comm(self.group)
            dense = sel.to_dense()
            t0 = time.perf_counter()
            comm.all_reduce(dense)
            comm.stats.seconds = time.perf_counter() - t0
            return dense, sel.indices, comm.stats, offload_s, sent
        coll = self._collective_for(f"job:{index}")
        res = coll(sel, group=self.group, step=step)
        return res.dense, res.kept, res.stats, offload_s, sent

    def _apply(self, launched: _Launched, dense: torch.Tensor, kept: torch.Tensor | None,
               stats: StepStats, sent: tuple[torch.Tensor | None, torch.Tensor] | None = None
               ) -> None:
        """Write averaged gradients and update residuals with what was consumed."""
        job = launched.job
        offset = 0
        bounds = []
        for n in job.names:
            bounds.append((n, offset, offset + self._numel[n]))
            offset += self._numel[n]
        avg = torch.div(dense, self.P)
        if kept is not None:
            kept = kept.to(torch.int64)
            starts = torch.tensor([b[1] for b in bounds], dtype=torch.int64, device=kept.device)
            owner = torch.searchsorted(starts, kept, right=True) - 1
            if sent is not None:
                kept_values = _values_at(sent[0], sent[1], kept)
        for i, (n, lo, hi) in enumerate(bounds):
            p = self.params[n]
            g = avg[lo:hi].view_as(p).to(p.dtype)
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)
            stats.tensors += 1
            stats.numel += hi - lo
            if job.mode == "dense":
                stats.selected += hi - lo
                if sent is not None:
                    acc = launched.audit_accs[n]
                    self._record(AuditRecord(
                        self.step, n, job.mode, job.transport, acc,
                        torch.arange(hi - lo, device=acc.device), sent[1][lo:hi].clone(),
                        torch.zeros_like(acc)))
                continue
            mine = owner == i
            local = kept[mine] - lo
            residual = self.ef.update(n, launched.accs[n], local)
            stats.selected += int(local.numel())
            stats.missing += int(local.numel() == 0)
            if sent is not None:
                self._record(AuditRecord(
                    self.step, n, job.mode, job.transport, launched.audit_accs[n], local.clone(),
                    kept_values[mine].clone(), residual.detach().reshape(-1).clone()))

    def _record(self, rec: AuditRecord) -> None:
        if callable(self._audit):
            self._audit(rec)
        else:
            self.audit_log.append(rec)

    def _agree_finite(self, bad_local: list[str], stats: StepStats) -> bool:
        """All ranks agree whether any gradient was non-finite, then apply the policy."""
        flag = torch.tensor([1 if bad_local else 0], dtype=torch.int64)
        if self.P > 1:
            comm = Comm(self.group)
            comm.all_reduce(flag, op=dist.ReduceOp.MAX)
            stats.bytes_sent += comm.stats.bytes_sent
            stats.bytes_recv += comm.stats.bytes_recv
            stats.messages += comm.stats.messages
        if not int(flag):
            return True
        where = (f"on this rank ({self.rank}) in {bad_local}" if bad_local
                 else "on another rank")
        if self.cfg.nonfinite == "raise":
            for name in self.params:
                self.ef.discard(name)
            self.step += 1
            self._reset_step()
            raise ValueError(f"gradsync: non-finite gradient {where} at step {self.step - 1}; "
                             "residuals were left untouched (Config.nonfinite='raise')")
        return False

    # ------------------------------------------------------------------ components
    def _sparsifier_name(self) -> str:
        return "gaussiank" if self.cfg.scheme == "gaussiank" else self.cfg.sparsifier

    def _sparsifier_seed(self, key: str) -> int:
        """Each sparsifier's own generator seed: the config seed, its key and this rank."""
        return sparsify.seed_for(self.cfg.seed, key, self.rank)

    def _sparsifier(self, key: str, density: float) -> sparsify.Sparsifier:
        sp = self._sparsifiers.get(key)
        if sp is None or sp.density != density:
            sp = sparsify.get(self._sparsifier_name(), density=density,
                              seed=self._sparsifier_seed(key))
            self._sparsifiers[key] = sp
        return sp

    def _new_collective(self) -> collectives.Collective:
        name = _SCHEME_COLLECTIVE.get(self.cfg.scheme, "topka")
        opts = {"density": self.cfg.density} if name == "oktopk" else {}
        return collectives.get(name, **opts)

    def _collective_for(self, key: str) -> collectives.Collective:
        coll = self._collectives.get(key)
        if coll is None:
            coll = self._new_collective()
            self._collectives[key] = coll
        return coll


# ---------------------------------------------------------------------- helpers
def _concat(parts: list[SparseGrad]) -> SparseGrad:
    """Concatenate per-tensor selections into one selection over the fused buffer."""
    idx, vals, offset = [], [], 0
    for s in parts:
        idx.append(s.indices + offset)
        vals.append(s.values)
        offset += s.numel
    return SparseGrad(torch.cat(idx), torch.cat(vals), offset, validate=False)


def _values_at(indices: torch.Tensor, values: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """``values`` of the selection ``(indices, values)`` at positions ``at`` (audit only).

    A position the selection does not hold gets NaN, so an audit comparison fails loudly.
    """
    at = at.to(torch.int64)
    if indices.numel() == 0:
        return torch.full(at.shape, float("nan"), dtype=values.dtype, device=values.device)
    order = torch.argsort(indices.to(torch.int64))
    srt = indices.to(torch.int64)[order]
    pos = torch.searchsorted(srt, at).clamp_(max=srt.numel() - 1)
    out = values[order[pos]].clone()
    out[srt[pos] != at] = float("nan")
    return out


def _backward_profile(
    samples: list[dict[str, float]], names: list[str]
) -> tuple[list[str], dict[str, float]]:
    """Backward order (by median ready time) and T_b per tensor from hook timestamps."""
    if not samples:
        return list(reversed(names)), {n: 0.0 for n in names}
    rel = {n: [] for n in names}
    for s in samples:
        t0 = min(s.values())
        for n in names:
            rel[n].append(s.get(n, float("inf")) - t0)
    med = {n: sorted(v)[len(v) // 2] for n, v in rel.items()}
    pos = {n: i for i, n in enumerate(names)}
    order = sorted(names, key=lambda n: (med[n], -pos[n]))  # ties: reverse registration
    finite = [med[n] for n in order if med[n] != float("inf")]
    backward, prev = {}, 0.0
    for n in order:
        t = med[n] if med[n] != float("inf") else (finite[-1] if finite else 0.0)
        backward[n] = max(0.0, t - prev)
        prev = max(prev, t)
    if len(order) > 1:  # the first tensor's own T_b is unobserved: use the mean of the others
        rest = [backward[n] for n in order[1:]]
        backward[order[0]] = sum(rest) / len(rest)
    return order, backward


def _global(group: dist.ProcessGroup | None, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def _diff_params(saved: dict[str, list[int]], mine: dict[str, list[int]]) -> str:
    missing = sorted(set(saved) - set(mine))
    extra = sorted(set(mine) - set(saved))
    shapes = sorted(n for n in set(saved) & set(mine) if saved[n] != mine[n])
    return f"missing here {missing[:5]}, new here {extra[:5]}, other shapes {shapes[:5]}"
