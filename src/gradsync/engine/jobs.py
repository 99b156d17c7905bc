"""Plan → jobs: the collectives one step issues, in plan order (SSFusion §II-D, §IV-D).

A *plan* (:mod:`gradsync.schedule`) groups tensors into fusion buffers and says, per buffer,
whether it is all-reduced dense, sparsified as one fused vector (multi-tensor), or sparsified
per tensor (SSFusion: small tensors dense; SSFusion-I: a dense all-reduce part and a sparse
all-gather part). The engine turns each buffer into one or two :class:`Job` s and runs them
strictly in plan order on one communication thread, so every rank issues the same collectives
in the same order:

=============  ==========================================  =====================================
buffer mode    job(s)                                      transport
=============  ==========================================  =====================================
``dense``      the raw gradients, concatenated (no error   :attr:`Transport.ALLREDUCE`
               feedback): Dense / DenseOvlp buckets
``fused``      residual + gradient of every tensor,        :attr:`Transport.COLLECTIVE`
               sparsified as one vector (multi-tensor)
``per_tensor`` Buffer_AR: the tensors SSFusion-I moved to  :attr:`Transport.ALLREDUCE`
               the all-reduce part (§IV-D), sent whole
               Buffer_AG: every other tensor, each         :attr:`Transport.COLLECTIVE`
               sparsified at its own density (§IV-B) or
               sent whole when selective sparsification
               excluded it (those first: values only)
=============  ==========================================  =====================================

The types that carry a job through a step live here too: the :class:`Payload` the training
thread hands to the communication thread, the :class:`JobResult` that comes back, the
:class:`Launched` job waiting for it, and :class:`StepRun`, one step's progress through the
jobs (wait-free backpropagation: a job launches as soon as all its tensors are ready).
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from enum import StrEnum

import torch

from gradsync import collectives
from gradsync.collectives.comm import CommStats
from gradsync.engine.audit import values_at
from gradsync.schedule import BufferPlan, Plan, TensorPlan
from gradsync.sparsegrad import SparseGrad, bincount, constant

__all__ = ["RESENT", "InFlight", "Job", "JobResult", "Launched", "Mode", "Payload", "StepRun",
           "Transport", "ahead", "at_density", "bounds", "bucket_jobs", "concat", "plan_jobs",
           "resent",
           "selected_share"]


class Mode(StrEnum):
    """How a job's tensors are compressed (the buffer modes of ``gradsync.schedule.plan``)."""

    DENSE = "dense"  # raw gradients, no error feedback
    FUSED = "fused"  # one selection over the concatenated buffer (multi-tensor)
    PER_TENSOR = "per_tensor"  # one selection per tensor, each at its own density (SSFusion)


class Transport(StrEnum):
    """How a job travels."""

    ALLREDUCE = "allreduce"  # a dense sum over the group
    COLLECTIVE = "collective"  # the scheme's sparse collective (``Scheme.collective``)


@dataclass(frozen=True)
class Job:
    """One collective of a plan: a group of tensors (backward order) and how they travel."""

    names: tuple[str, ...]
    mode: Mode
    transport: Transport
    collective: str = ""  # the gradsync.collectives name, for Transport.COLLECTIVE
    density: float | None = None  # Mode.FUSED: of the whole buffer
    # Mode.PER_TENSOR: each tensor's density (None: sent whole, excluded by §IV-B), and the
    # tensors SSFusion-O sparsifies on the worker thread (§IV-C)
    densities: dict[str, float | None] = field(default_factory=dict)
    offload: frozenset[str] = frozenset()
    # the density the scheme's collective selects at (Ok-Topk, SparDL); None: Config.density
    collective_density: float | None = None
    # the share of momentum sent ahead in force: 1 at the target density, ``target / density``
    # above it (at_density), so that the lead stays the same fraction of what an entry carries
    lead_share: float = 1.0
    # Mode.PER_TENSOR under Config.budget "pooled": the job's sparsified tensors (after those
    # sent whole) in pools of these many tensors, each pool's entries, Σ k(n_i, d_i), chosen
    # by one selection over all of its tensors (prepare.select); (): one selection per tensor
    pools: tuple[int, ...] = ()

    @property
    def wire(self) -> str:
        """``"allreduce"`` or the collective's name (what an audit record calls it)."""
        return self.collective if self.transport is Transport.COLLECTIVE else "allreduce"


def at_density(job: Job, density: float, target: float, numel: Mapping[str, int], P: int
               ) -> Job:
    """``job`` during DGC's density warm-up (``Config.density_warmup``): every planned density
    scaled by ``density / target`` (capped at 1, so SSFusion's compensation keeps its shape) and
    the collective's own selection at ``density``. Dense jobs are returned unchanged. At
    density 1 every entry travels: a dense all-reduce through error feedback (the all-reduce
    part of a per-tensor job, every tensor excluded), DDP's bytes instead of an all-gather of
    every entry from every rank (P/2 times as many; AdamW's warm-up, ``gradsync.optim``).

    Below density 1, where the job's collective all-gathers the selection
    (``Collective.gathers``: TopkA's) and the job would select 1/``P`` or more of its entries
    (``numel``: each name's entries; :func:`selected_share`), the selection travels densified in an
    all-reduce (``collective="dense"``): the same sum at DDP's bytes, where an all-gather sends
    (P − 1)·2d values' bytes per entry against the ring's 2(P − 1)/P (1.6× DDP at P = 4 in
    DGC's first period). The selection, residual and lead are as they would be
    (docs/results/accuracy-history.md, "The warm-up's selection all-reduced").

    The lead of momentum sent ahead (``gradsync.feedback``, "Ahead") shrinks by ``target /
    density`` (:attr:`Job.lead_share`): an entry selected at density d waits about 1/d steps,
    so it carries about u/d, and the lead c·u is the same share of that at every density.
    A whole lead at a warm-up density sends entries that owe no debt yet c velocities ahead at
    once, a burst: DGC's 4 periods with the SSFusion family's c = 9 diverged the CNN on 1 seed
    of 10 (docs/results/accuracy-history.md, "The lead follows the density: the SSFusion family
    warms up")."""
    if job.mode is Mode.DENSE or density == target:
        return job
    if density >= 1.0:
        return Job(job.names, Mode.PER_TENSOR, Transport.ALLREDUCE,
                   densities=dict.fromkeys(job.names))
    f = density / target
    out = replace(job, density=None if job.density is None else min(1.0, job.density * f),
                  densities={n: None if d is None else min(1.0, d * f)
                             for n, d in job.densities.items()},
                  collective_density=density, lead_share=min(1.0, target / density))
    if (job.transport is Transport.COLLECTIVE
            and collectives.registry.factory(job.collective).gathers
            and selected_share(job, f, target, numel) * P >= 1.0):
        # an all-gather of it would send more than DDP: the same selection, densified and
        # all-reduced (the `dense` collective), sums the same at DDP's bytes
        out = replace(out, collective="dense")
    return out


def selected_share(job: Job, f: float, target: float, numel: Mapping[str, int]) -> float:
    """The share of ``job``'s entries (``numel``: each name's) its selection takes with every
    planned density scaled by ``f`` (capped at 1): a fused job's density (the target where it
    has none of its own), a per-tensor job's entries over its tensors, whole ones at 1."""
    missing = [name for name in job.names if name not in numel]
    if missing:
        raise ValueError(f"selected_share: no size for {missing} of the job's "
                         f"{len(job.names)} tensors")
    n = sum(numel[name] for name in job.names)
    if job.mode is Mode.FUSED or not n:
        return min(1.0, (target if job.density is None else job.density) * f)
    took = sum(numel[name] * (1.0 if job.densities.get(name) is None
                              else min(1.0, job.densities[name] * f)) for name in job.names)
    return took / n


@functools.lru_cache(maxsize=256)
def bucket_jobs(names: tuple[str, ...], numels: tuple[int, ...],
                densities: tuple[float | None, ...], to_allreduce: bool, collective: str,
                buckets: tuple[int, ...] = ()) -> tuple[Job, ...]:
    """A DDP bucket as jobs (a plan of one per-tensor buffer; each tensor's density, None:
    sent whole): the tensors sent whole in an all-reduce part when ``to_allreduce``
    (SSFusion-I, ``auto``), then the all-gather's, its tensors sent whole first (values
    without indices), then the selected ones. ``buckets`` (``Config.budget="pooled"``): how
    many of ``names`` each DDP bucket holds, merged buckets several (``BufferPipeline.merged``);
    each bucket's sparsified tensors are one pool, however the buckets travel. Cached: DDP's
    buckets keep their layout and densities."""
    tensors = tuple(TensorPlan(n, k, d, allreduce=d is None and to_allreduce)
                    for n, k, d in zip(names, numels, densities))
    at = list(itertools.accumulate(buckets, initial=0))
    plan = Plan("ddp_hook", [BufferPlan(tensors, "per_tensor")])
    return tuple(plan_jobs(plan, collective, names,
                           [tensors[a:b] for a, b in itertools.pairwise(at)]))


def plan_jobs(plan: Plan, collective: str, names: Sequence[str],
              pools: bool | Sequence[Sequence[TensorPlan]] = False) -> list[Job]:
    """The jobs of ``plan`` in plan order; sparse ones go through ``collective``. ``pools``
    (``Config.budget="pooled"``): True, each per-tensor buffer's sparsified tensors of its
    all-gather job are one pool (:attr:`Job.pools`), in plan order (a plan is fixed for a run,
    and a checkpoint keeps it); or the groups of the one buffer's tensors whose sparsified
    ones are (the DDP hook's buckets), each laid out by name: a selection over a pool depends
    on its layout (DGC samples positions), which must not follow DDP's bucket order, rebuilt
    after the first step (a run resumed from a checkpoint would select otherwise).

    Raises ``ValueError`` unless the jobs cover every tensor in ``names`` exactly once.
    """
    jobs: list[Job] = []
    for buf in plan.buffers:
        tensors = tuple(t.name for t in buf.tensors)
        if buf.mode == Mode.DENSE:
            jobs.append(Job(tensors, Mode.DENSE, Transport.ALLREDUCE))
        elif buf.mode == Mode.FUSED:
            jobs.append(Job(tensors, Mode.FUSED, Transport.COLLECTIVE, collective,
                            density=buf.density))
        elif buf.mode == Mode.PER_TENSOR:
            buffer_ar = [t for t in buf.tensors if t.allreduce]  # SSFusion-I, §IV-D
            groups = ([] if not pools else [buf.tensors] if pools is True else pools)
            pooled = [[t for t in g if not t.allreduce and t.density is not None]
                      for g in groups]
            if pools is not True:  # DDP's buckets: by name
                pooled = [sorted(g, key=lambda t: t.name) for g in pooled]
            pooled = [g for g in pooled if g]
            # the tensors sent whole first: the selection's dense prefix, whose values
            # travel without indices (concat, SparseGrad.dense_prefix); then the pools
            buffer_ag = ([t for t in buf.tensors if not t.allreduce and t.density is None]
                         + ([t for g in pooled for t in g] if pooled else
                            [t for t in buf.tensors if not t.allreduce
                             and t.density is not None]))
            for part, transport in ((buffer_ar, Transport.ALLREDUCE),
                                    (buffer_ag, Transport.COLLECTIVE)):
                if part:
                    jobs.append(Job(
                        tuple(t.name for t in part), Mode.PER_TENSOR, transport,
                        collective if transport is Transport.COLLECTIVE else "",
                        densities={t.name: t.density for t in part},
                        offload=frozenset(t.name for t in part if t.offload),
                        pools=(tuple(len(g) for g in pooled)
                               if transport is Transport.COLLECTIVE else ())))
        else:
            raise ValueError(f"plan buffer mode {buf.mode!r} is unknown")
    covered = sorted(n for j in jobs for n in j.names)
    if covered != sorted(names):
        raise ValueError("plan does not cover every parameter exactly once")
    return jobs


@dataclass
class Payload:
    """What the training thread hands to the communication thread for one job.

    ``dense``: :attr:`Mode.DENSE`'s concatenated raw gradients. ``selections``: one selection
    over the buffer (:attr:`Mode.FUSED`) or one per tensor in the job's order
    (:attr:`Mode.PER_TENSOR`), an offloaded one as the worker's future of
    ``(selection, seconds)``.
    """

    dense: torch.Tensor | None = None
    selections: list[SparseGrad | Future] = field(default_factory=list)
    wire_dtype: torch.dtype | None = None  # selections' values are cast to it before sending
    # the job's tensors with no entry in this rank's selection, when prepare knows it without
    # a read (a per-tensor job selected inline: each selection's count is on the host; a fused
    # one on the CPU's own kernels: engine.apply.missing_on_host); None: counted on the device
    # from what the collective kept (engine.apply.job_check)
    missing: int | None = None
    # error feedback's momentum sent ahead (feedback.py, "Ahead"): the job's pending velocity
    # u (flat, in the job's order), c and its tensors' sizes; the message's selected entries
    # then carry acc + c·u (but those of a tensor resent: ahead())
    lead: tuple[torch.Tensor, float, tuple[int, ...]] | None = None  # (u, c, sizes)

    def wire(self, sel: SparseGrad) -> SparseGrad:
        """``sel`` with its values in :attr:`wire_dtype` (the gradients' dtype)."""
        if self.wire_dtype is None or sel.values.dtype == self.wire_dtype:
            return sel
        return sel.to(self.wire_dtype)  # indices and dense prefix kept

    def known_missing(self, message: SparseGrad, kept: torch.Tensor | None) -> int | None:
        """:attr:`missing` when what the collective kept is exactly this rank's ``message``
        (``kept`` is its indices): those positions came from the selections, so they lie in
        the buffer and leave exactly the tensors prepare counted empty; else None."""
        return self.missing if kept is not None and kept is message.indices else None

    def message(self, job: Job, parts: Sequence[SparseGrad]) -> SparseGrad:
        """The job's selection as it travels: ``parts`` (:attr:`selections`, the worker's
        futures resolved) in :attr:`wire_dtype`, one selection over the job's buffer
        (concatenated for :attr:`Mode.PER_TENSOR`)."""
        if self.lead is None:
            sels = [self.wire(p) for p in parts]
            return concat(sels) if job.mode is Mode.PER_TENSOR else sels[0]
        sel = concat(list(parts)) if job.mode is Mode.PER_TENSOR else parts[0]
        return self.wire(ahead(sel, *self.lead))

    def sent_at(self, message: SparseGrad, kept: torch.Tensor | None) -> torch.Tensor | None:
        """The values ``message`` (this rank's, as it travelled) carried at the positions
        the collective ``kept``, where they are not the accumulator's (:attr:`lead`), for
        error feedback's commit; None where the accumulator's values travelled."""
        if self.lead is None or kept is None:
            return None
        if kept is message.indices:  # the collective kept this rank's message as it is
            return message.values
        return values_at(message.indices, message.values, kept)


@dataclass
class JobResult:
    """What one job's collective produced on this rank."""

    dense: torch.Tensor | None  # the SUM over ranks, over the job's concatenated tensors
    kept: torch.Tensor | None  # positions of this rank's entries that entered the sum
    # (None: every entry, an all-reduce: Mode.DENSE, SSFusion-I's Buffer_AR)
    stats: CommStats
    offload_s: float = 0.0  # sparsification time spent on the worker thread
    sent_indices: torch.Tensor | None = None  # audit only: the selection handed to the
    sent_values: torch.Tensor | None = None  # collective (indices None for Mode.DENSE)
    # an all-reduce the communication thread issued and did not wait for (``dense`` is its
    # buffer): :meth:`settle` waits for it on the training thread
    in_flight: InFlight | None = None
    # the collective's checks left on the device, ``(ok, message)`` (Collective.__call__'s
    # ``deferred``): read with the step's others
    checks: list[tuple[torch.Tensor, str]] = field(default_factory=list)
    # the job's missing tensors, known on the host: the collective kept exactly this rank's
    # selection (its indices, TopkA's) and prepare counted its empty tensors
    # (Payload.missing); None: engine.apply.job_check counts them on the device
    missing: int | None = None
    # the values this rank sent at ``kept`` where they are not its accumulator's (momentum sent
    # ahead: Payload.sent_at); None: the accumulator's (in the wire dtype)
    sent_ahead: torch.Tensor | None = None
    # its checks and a rank's non-finite flag (carried in the message) show alike on every
    # rank: an all-reduce, or a collective whose every rank decodes every message
    # (Collective.alike) and can carry a NaN (prepare.shows_alike); False: they need the
    # ranks' agreement word (GradSync._agreement)
    alike: bool = True
    # the collective left the sum's writing to the thread that reads it (Collective's
    # ``lazy``): :meth:`settle` runs it there, and ``dense`` is None until then
    decode: Callable[[], torch.Tensor] | None = None

    def settle(self) -> JobResult:
        """Wait for the all-reduce still in flight, if any, or write the sum the collective
        left to this thread: ``dense`` holds the sum after."""
        if self.in_flight is not None:
            self.in_flight.wait()
            self.in_flight = None
        if self.decode is not None:
            self.dense, self.decode = self.decode(), None
        return self


class InFlight:
    """An all-reduce issued with ``async_op=True`` (``work``: its handle, None when it completed
    at issue). :meth:`wait` sets ``stats.seconds`` to the time from issue to completion, taken
    when the backend completes it (its future's callback), not when someone waits."""

    def __init__(self, work, stats: CommStats, t0: float) -> None:
        self._work, self._stats, self._t0 = work, stats, t0
        self._done: float | None = None
        future = getattr(work, "get_future", None)
        if future is None:  # no work (one rank), or a staged call that completed at issue
            self._done = time.perf_counter()
        else:
            future().then(self._completed)

    def _completed(self, _fut) -> None:
        self._done = time.perf_counter()

    def wait(self) -> None:
        """Block until the all-reduce is done (a failure or timeout raises here)."""
        if self._work is not None:
            self._work.wait()
        self._stats.seconds = (self._done or time.perf_counter()) - self._t0


@dataclass
class Launched:
    """A job handed to the communication thread, and what its result will be applied to."""

    job: Job
    index: int  # position in the plan's jobs (keys the job's collective)
    sizes: tuple[int, ...]  # the entries of each tensor of the job
    acc: torch.Tensor | None  # the accumulated gradients, flat (None: a raw dense job)
    future: Future[JobResult]
    audit_acc: torch.Tensor | None = None  # a clone of ``acc`` or the gradients (audit only)
    storage: torch.Tensor | None = None  # the job's gradient storage, which .grad views
    # whether the job's gradients were finite, still on the device (prepare's deferred check;
    # None: a dense job, whose sum shows a NaN/Inf)
    finite: torch.Tensor | None = None


@dataclass
class StepRun:
    """One step's progress through the jobs (wait-free backpropagation)."""

    ready: set[str] = field(default_factory=set)  # tensors whose gradient hook fired
    next_job: int = 0  # jobs before it are launched
    # per job of the plan: how many of its tensors are not ready yet (set by the first hook),
    # so a hook costs O(1), not a scan of the next job's names (O(tensors²) per step)
    waiting: list[int] | None = None
    launched: list[Launched] = field(default_factory=list)
    hook_times: dict[str, float] = field(default_factory=dict)  # first hook per tensor
    first_hook: float = 0.0
    last_hook: float = 0.0
    inline_sparsify_s: float = 0.0
    launch_s: float = 0.0  # gradient hooks launching jobs (StepStats.hooks_s)

    def mark_ready(self, name: str, job: int, sizes: Sequence[int]) -> None:
        """Tensor ``name`` (of job index ``job``; ``sizes``: every job's tensor count) is
        ready; a second hook of the same tensor in one step changes nothing."""
        if name in self.ready:
            return
        self.ready.add(name)
        if self.waiting is None:
            self.waiting = list(sizes)
        self.waiting[job] -= 1

    def job_ready(self, job: int) -> bool:
        """Whether every tensor of job index ``job`` is ready."""
        return self.waiting is not None and self.waiting[job] == 0

    def hooked(self, name: str, now: float) -> None:
        self.first_hook = self.first_hook or now
        self.last_hook = now
        self.hook_times.setdefault(name, now)

    @property
    def backward_s(self) -> float:
        return (self.last_hook - self.first_hook) if self.first_hook else 0.0


def bounds(names: Sequence[str], sizes: Sequence[int]) -> list[tuple[str, int, int]]:
    """Each tensor's ``(name, start, end)`` in its job's flat buffer."""
    out, o = [], 0
    for n, k in zip(names, sizes):
        out.append((n, o, o + k))
        o += k
    return out


RESENT = 0.2
"""A tensor of which a step's selection takes more than the fraction ``RESENT`` of its entries
(on average each sent more often than every fifth step) carries nothing ahead that step
(:func:`ahead`)."""


def ahead(sel: SparseGrad, u: torch.Tensor, c: float, sizes: Sequence[int]) -> SparseGrad:
    """``sel`` (a selection of a job's accumulator, whose tensors hold ``sizes`` entries in
    order) with each entry after its dense prefix carrying ``c`` velocities ahead:
    ``value + c·u[position]`` (``gradsync.feedback``, "Ahead"); the entries sent whole keep
    their values, and so do those of a tensor the selection takes more than the fraction
    :data:`RESENT` of: its entries are sent again step after step, where a lead only
    amplifies what oscillates (:func:`resent`). New values, never ``sel``'s."""
    p = sel.dense_prefix
    if p == len(sel):
        return sel
    idx = sel.indices[p:]
    c_i = resent(idx, sizes).logical_not_().to(sel.dtype).mul_(c)
    lead = torch.addcmul(sel.values[p:], c_i, u.index_select(0, idx).to(sel.dtype))
    values = torch.cat([sel.values[:p], lead]) if p else lead
    return SparseGrad(sel.indices, values, sel.numel, validate=False, dense_prefix=p,
                      capacity=sel.capacity)


def resent(idx: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """Per position of ``idx`` (distinct positions in a buffer of tensors holding ``sizes``
    entries in order): whether ``idx`` holds more than the fraction :data:`RESENT` of its
    tensor's entries. On the device, from the positions alone: a few operations per job, no
    read.

    Why: an entry sent at step t and again at t+1 with a lead ``c`` moves by
    ``(1 + c)·u_t − c·u_{t−1}``, a derivative term that raises an oscillating velocity's
    step by ``1 + 2c``; for SGD with momentum m = 0.9 on a quadratic of curvature λ, the
    largest stable ηλ falls from 3.8 (heavy ball, c = 0) to 1.36 at c = m (Nesterov) and
    0.54 at c = 3. Measured on ResNet-18 (TopkA, 1 %): its classifier, 38 % of whose entries
    a step selects, spiked the loss to 6.6× step 0's within 3 steps with a lead of 3, and
    did not spike without a lead there; the CNN's output layer (14 %) gains from its lead
    (docs/results/accuracy-history.md, "Resent means over a fifth of a tensor": a fifth lies between
    the two, read off those measurements)."""
    ends = constant(tuple(itertools.accumulate(sizes)), idx.dtype, idx.device)
    seg = torch.searchsorted(ends, idx, right=True)
    held = bincount(seg, len(sizes))
    cap = constant(tuple(RESENT * k for k in sizes), torch.float32, idx.device)
    return held.gt(cap).index_select(0, seg)


def concat(parts: list[SparseGrad]) -> SparseGrad:
    """Concatenate per-tensor selections into one selection over the fused buffer. The leading
    parts sent whole (and the next part's own dense prefix) form its dense prefix; its
    capacity is the parts' sum, when every part has one (``SparseGrad.capacity``). One
    selected part (a buffer selected at once) is its own concatenation: no copy (a part sent
    whole views the accumulator, and is copied as before)."""
    if len(parts) == 1 and not parts[0].dense_prefix:
        return parts[0]
    idx, vals, offset, prefix, leading = [], [], 0, 0, True
    capacity: int | None = 0
    for s in parts:
        idx.append(s.indices + offset if offset else s.indices)
        vals.append(s.values)
        offset += s.numel
        if leading:
            prefix += s.dense_prefix
            leading = s.dense_prefix == s.numel
        capacity = None if capacity is None or s.capacity is None else capacity + s.capacity
    return SparseGrad(torch.cat(idx), torch.cat(vals), offset, validate=False,
                      dense_prefix=prefix, capacity=capacity)
