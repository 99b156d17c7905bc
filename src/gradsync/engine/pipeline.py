"""One fusion buffer's step through the wire, as the DDP hook drives it (SSFusion §III–IV on
DDP's buckets; docs/architecture.md, "Through the DDP comm hook").

A :class:`BufferPipeline` runs one bucket's step in the engine's phases, with the engine's own
pieces for each (:mod:`.prepare`, :mod:`.jobs`, :mod:`.apply`):

1. **prepare**: the bucket in travel order (:class:`_Travel`: its all-reduce part first, then
   the all-gather's tensors sent whole, then the selected ones), local clipping and error
   feedback once for the bucket (:func:`~gradsync.engine.prepare.accumulate`: one buffer),
   each job's payload (:func:`~gradsync.engine.prepare.select`);
2. **launch**: the all-reduce part issued first and interleaved with the all-gather's
   collective (SSFusion-I);
3. **settle** (:func:`settle`, at the step's last bucket): every sparse bucket's checks read in
   one copy, with, at P > 1, the ranks' word on malformed messages
   (:func:`~gradsync.engine.apply.agreement_word`), unless every bucket's checks show alike
   on every rank (TopkA at a capacity: every rank unpacks every message; the engine's rule,
   ``JobResult.alike``);
4. **commit**: each bucket's error feedback committed (every sum finite,
   :func:`~gradsync.engine.apply.commit`) or left as before the step (a NaN/Inf in any).

**Non-finite gradients.** Nothing is read while a bucket is sent: a bucket whose gradients
hold a NaN/Inf selects from zeros (``accumulate`` zeroed its accumulator) and carries one NaN,
``values[0] / finite`` (0/0; a finite bucket's is x/1 = x exactly,
:func:`~gradsync.engine.prepare.carry`), in the message every rank
expects, so every rank's sum shows it. A NaN/Inf in a bucket sent whole travels in its
all-reduce. So every rank sees it alike and keeps its residuals: ``Config.nonfinite="raise"``
fails a future of the step (DDP raises from ``backward()`` on every rank), ``"skip_step"``
leaves the non-finite average in ``.grad``, as DDP would. A malformed message on any rank fails
that step's ``backward()`` on every rank (the receiving rank with the check's message).

**Dense buckets** (:meth:`BufferPipeline.whole`) leave their all-reduce in flight, as DDP's
default hook does; their error feedback (momentum's velocity, a preconditioning scale, a
sparse step's leftovers) commits in the future's callback once the sum is in and finite.

**The communication thread.** A sparse bucket's collectives cannot be chained on the all-reduce
(gloo launches no collective from ``Future.then``). With the CPU's own kernels at P > 1, phase
2 and the average run on one thread per hook (:func:`~gradsync.engine.executor.comm_thread`,
the engine's kind) while the backward computes the next buckets; the bucket's future completes
when the average is in (with an all-reduce part, at the step's last bucket: "Merged
buckets"). The step's last bucket, and a bucket sent whole, first wait for the
buckets handed to the thread (every rank then issues its collectives in one order), then run
on the calling thread: the last one settles the step, so DDP's own collectives after it
(``find_unused_parameters``' all-reduce) find the thread idle. A collective that raised there
fails the step's last future (DDP stays usable so, not when an earlier one fails), the
buckets after it sending nothing, error feedback as before the step. On
an accelerator's kernels the capped exchange reads nothing back: phase 2 runs in the hook.

**Merged buckets.** Each bucket's collectives cost the step their rounds (and, on cores the
ranks share, the thread's competition with the backward), which overlap repays only when the
bucket's bytes take long on the link: on the CPU at P = 2 and 4, the CNN's two buckets (a
1 MiB first bucket, then the rest) stepped up to 19 % faster in one set of collectives, on
loopback and at 100 Mbit/s, while ResNet-18's three stepped about 16 % slower so at
100 Mbit/s (speed.md, "Merged buckets"). So, with the CPU's own kernels at P > 1, the hook
measures both: an A-B-B-A trial (:class:`~gradsync.engine.trial.AutoTrial`, sides ``"split"``
and ``"merged"``) from the step after the first with a bucket before the last. Merged, a sparse
bucket (:meth:`BufferPipeline.hold`) waits for the step's last, which runs one pipeline over
all of their tensors (:meth:`BufferPipeline.merged`) and completes every held future with its
average. Training is the same bit for bit on both sides: the step's all-reduce parts
(SSFusion-I's) are summed in one call at its last bucket, in bucket order, on the split side
too (:meth:`BufferPipeline._launch`).

The owner (the hook's :class:`~gradsync.integrations.ddp.HookState`) is any object with the
attributes of :class:`Owner`.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import itertools
import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from gradsync.collectives.comm import Comm, CommStats
from gradsync.engine.apply import agreement_word, commit, job_check, settle_missing
from gradsync.engine.components import Components
from gradsync.engine.config import Config
from gradsync.engine.density import DensitySchedule
from gradsync.engine.executor import comm_thread
from gradsync.engine.jobs import Job, Payload
from gradsync.engine.prepare import accumulate, carry, carry_message, select, shows_alike
from gradsync.engine.trial import FUSION_SIDES, AutoTrial
from gradsync.feedback import ErrorFeedback, clip_local
from gradsync.sparsegrad import all_finite, finite_flag, host_kernels
from gradsync.sparsify import segments

__all__ = ["BufferPipeline", "Counts", "Owner", "Scratch", "settle"]


@dataclass
class Counts:
    """What the pipeline has done, for ``stats()``; ``steps`` is also DGC's warm-up clock."""

    last: CommStats = field(default_factory=CommStats)
    total: CommStats = field(default_factory=CommStats)
    calls: int = 0
    steps: int = 0  # backward passes seen (DDP's last bucket of each)
    missing: int = 0
    tensors: int = 0
    nonfinite: int = 0  # buckets whose sum was NaN/Inf (module doc, "Non-finite gradients")
    # SSFusion: the density the model sends, in entries per element (the tensors sent whole
    # charged at their bytes); set at the first sparse bucket
    sent_density: float | None = None
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)  # gloo's thread


@dataclass
class Scratch:
    """This step's sparse buckets, their checks on the device: read once, at the last bucket,
    where error feedback commits (or drops) each of them (:func:`settle`); and the hook's
    communication thread with the buckets handed to it this step (module doc)."""

    pending: list[_Pending] = field(default_factory=list, repr=False)
    wire_checks: list[tuple[torch.Tensor, str]] = field(default_factory=list, repr=False)
    thread: ThreadPoolExecutor | None = field(default=None, repr=False)  # made at first use
    queued: list[Future] = field(default_factory=list, repr=False)
    failed: BaseException | None = None  # the step's first error on the thread
    # the buckets held for the step's last (BufferPipeline.hold): pipeline, buffer, future
    held: list[tuple[BufferPipeline, torch.Tensor, torch.futures.Future]] = field(
        default_factory=list, repr=False)
    # split: the all-reduce parts left for the step's last bucket, and their buckets' ends
    # (the average into their buffer, the future to complete, the buffer)
    dense: list[torch.Tensor] = field(default_factory=list, repr=False)
    later: list[tuple[Callable[[], None], torch.futures.Future | None, torch.Tensor]] = field(
        default_factory=list, repr=False)

    def queue(self, work: Callable[[], BaseException | None]) -> None:
        """Hand ``work`` (which returns its error, never raises) to the thread."""
        if self.thread is None:
            self.thread = comm_thread("gradsync-hook")
        self.queued.append(self.thread.submit(work))

    def drain(self) -> BaseException | None:
        """Wait for the work handed to the thread; the step's first error on it, if any (kept
        until the step's last bucket has abandoned the step: :func:`_abandoned`)."""
        queued, self.queued = self.queued, []
        errors = [f.result() for f in queued]
        self.failed = self.failed or next((e for e in errors if e is not None), None)
        return self.failed


class Owner(Protocol):
    """What a pipeline reads and counts in: its configuration, error feedback, its
    sparsifiers and collective, the density schedule, the counts and this step's scratch."""

    cfg: Config
    group: Any
    ef: ErrorFeedback
    parts: Components  # the sparsifiers, and the sparse parts' collective ("ddp")
    density: DensitySchedule
    counts: Counts
    scratch: Scratch
    fusion: AutoTrial  # the trial of merged buckets (module doc, "Merged buckets")


@dataclass
class _Pending:
    """A sparse bucket's error-feedback step, committed at the step's last bucket once the
    checks of every bucket are read in one copy (:func:`settle`)."""

    index: int | tuple[int, ...]  # the bucket's (its error feedback's key); merged: theirs
    names: list[str]
    acc: torch.Tensor  # the bucket's accumulator, in travel order
    kept: torch.Tensor | None  # the positions of the all-gather part that travelled, counted
    # from its start (None: every entry travelled)
    whole: int  # the entries of the all-reduce part, ahead of the all-gather's
    wire: torch.dtype  # the dtype its values travelled in
    finite: torch.Tensor  # the sums hold no NaN/Inf (a bool on the device)
    here: torch.Tensor  # this rank's gradients were finite
    check: torch.Tensor | None  # engine.apply.job_check of the all-gather part (None: none,
    # or its missing tensors known on the host)
    missing: int = 0  # the all-gather part's missing tensors, when known on the host
    alike: bool = False  # its checks show alike on every rank (JobResult.alike): no word
    sent_ahead: torch.Tensor | None = None  # its values at kept (JobResult.sent_ahead)


class BufferPipeline:
    """One bucket's step (module doc): :meth:`sparse` for a bucket with sparse parts,
    :meth:`whole` for one all-reduced whole. Both return the future DDP's hook returns."""

    def __init__(self, owner: Owner, comm: Comm, key: int | tuple[int, ...], names: list[str],
                 numels: list[int], last: bool) -> None:
        self.owner, self.comm, self.key, self.last = owner, comm, key, last
        self.names, self.numels = names, numels
        self.offsets = [0]
        for n in numels:
            self.offsets.append(self.offsets[-1] + n)
        # merged (:meth:`merged`): each bucket's buffer and future (None: the last's own), and
        # how many of the tensors each bucket holds
        self.spill: list[tuple[torch.Tensor, torch.futures.Future | None]] = []
        self.buckets = (len(names),)
        self.defer = False  # split (:meth:`hold`): the all-reduce part goes with the last's

    def hold(self, buf: torch.Tensor) -> torch.futures.Future | None:
        """On the trial's ``"merged"`` side, a sparse bucket before the step's last, with the
        CPU's own kernels at P > 1, is held for the last one (module doc, "Merged buckets"):
        its future, complete once the step's average is in ``buf``. None: it goes on its own
        (the ``"split"`` side; an all-reduce part of it waits for the last: :meth:`_launch`)."""
        owner = self.owner
        if self.last or self.comm.size == 1 or not host_kernels(buf):
            return None
        owner.fusion.open(owner.counts.steps + 1)  # DDP rebuilds its buckets after step 0
        if owner.fusion.mode(owner.counts.steps) != FUSION_SIDES[1]:
            self.defer = True
            return None
        fut: torch.futures.Future = torch.futures.Future()
        owner.scratch.held.append((self, buf, fut))
        return fut

    def merged(self, buf: torch.Tensor) -> tuple[BufferPipeline, torch.Tensor]:
        """The step's last bucket and the ones held before it (:meth:`hold`): one pipeline
        over their tensors, which reads and averages each bucket's buffer where it lies (no
        concatenation of them), and the last bucket's ``buf``; ``(self, buf)`` for any other
        bucket, or when none is held. It runs here, on the calling thread (:meth:`_send`)."""
        held = self.owner.scratch.held
        if not self.last or not held:
            return self, buf
        self.owner.scratch.held = []
        parts = [*held, (self, buf, None)]
        pipe = BufferPipeline(self.owner, self.comm, tuple(p.key for p, _, _ in parts),
                              [n for p, _, _ in parts for n in p.names],
                              [k for p, _, _ in parts for k in p.numels], self.last)
        pipe.spill = [(b, f) for _, b, f in parts]
        pipe.buckets = tuple(len(p.names) for p, _, _ in parts)
        return pipe, buf

    def pools(self) -> tuple[int, ...]:
        """``engine.jobs.bucket_jobs``' ``buckets`` under ``Config.budget="pooled"``: each DDP
        bucket's sparsified tensors one pool, merged or split alike; else ()."""
        return self.buckets if self.owner.cfg.pooled else ()

    def _release(self) -> None:
        """A merged pipeline's held buckets: their futures completed with their buffers (the
        average, or as they were when the step failed)."""
        for b, fut in self.spill:
            if fut is not None and not fut.done():
                fut.set_result(b)

    def sparse(self, buf: torch.Tensor, jobs: Sequence[Job]) -> torch.futures.Future:
        """Phases 1–2 for a bucket with sparse parts (the commit waits for :func:`settle`):
        ``buf`` ← the average, a non-finite one too (.grad shows it, module doc)."""
        owner, P = self.owner, self.comm.size
        position = {n: i for i, n in enumerate(self.names)}
        order = [n for job in jobs for n in job.names]  # the travel order: jobs in turn
        bufs = [b for b, _ in self.spill] or [buf]  # merged: every bucket's, in order
        travel = _Travel([position[n] for n in order], self.offsets, self.numels,
                         [b.numel() for b in bufs], buf.device)
        grad = travel.gather(bufs)
        owner.density.observe(grad)
        here = finite_flag(grad)  # checked once, whatever its jobs (no read: module doc)
        sizes = [self.numels[position[n]] for n in order]
        parts, whole, acc = self._prepare(jobs, grad, order, sizes, here, buf.dtype)

        def finish(result: torch.futures.Future | None) -> CommStats:
            """Phase 2, and the bucket's average in ``buf`` (``result`` then completed): here,
            or on the hook's communication thread (:meth:`_send`); a bucket whose all-reduce
            part waits for the step's last bucket is averaged there."""
            sums, res, sel, stats = self._launch(parts, here)

            def complete() -> None:
                travel.average_into(bufs, sums, P)
                kept = None if res is None else res.kept.to(torch.int64)
                # the all-gather part's missing tensors: on the host when it kept this rank's
                # selection
                known = None if res is None else parts[-1][2].known_missing(sel, res.kept)
                owner.scratch.pending.append(_Pending(
                    self.key, self.names, acc, kept, whole, buf.dtype,
                    _finite(bufs), here,  # the averages (so the sums) hold no NaN/Inf:
                    # alike on every rank
                    None if kept is None or known is not None
                    else job_check(parts[-1][1], kept), known or 0,
                    shows_alike(owner.parts.collective("ddp", None, parts[-1][0].collective),
                                sel, self.comm.group),
                    None if res is None else parts[-1][2].sent_at(sel, res.kept)))
                owner.counts.tensors += len(self.names)
                self._release()
                if result is not None:
                    result.set_result(buf)

            if self.defer and whole:  # its all-reduce part is not summed yet
                owner.scratch.later.append((complete, result, buf))
            else:
                complete()
            return stats

        try:
            return self._send(finish, buf)  # merged: here, the last bucket's
        finally:
            self._release()  # a failed step's: pending, they would hang DDP's backward

    def _send(self, finish: Callable[[torch.futures.Future | None], CommStats],
              buf: torch.Tensor) -> torch.futures.Future:
        """Phase 2 of a sparse bucket (``finish``) on the hook's communication thread, so that
        the backward goes on meanwhile (module doc, "The communication thread"); here, after
        every bucket handed to the thread, for the step's last bucket (it settles the step),
        at P = 1, and on an accelerator's kernels, whose capped exchange reads nothing back."""
        owner, scratch = self.owner, self.owner.scratch
        if self.last or self.comm.size == 1 or not host_kernels(buf):
            error = scratch.drain()  # every rank's collectives in one order: the queued first
            if error is not None:
                return _abandoned(owner, buf, error, self.last)
            try:
                stats = finish(None)
            except Exception as e:  # at the last bucket: its future fails (DDP stays usable)
                if not self.last:
                    raise
                return _abandoned(owner, buf, e.with_traceback(None), True)
            return _done(owner, stats, buf, self.last)
        result: torch.futures.Future = torch.futures.Future()

        def work() -> BaseException | None:
            try:  # finish completes result, at once or at the step's last bucket
                _account(owner, finish(result), False)
            except BaseException as e:  # for the step's last bucket (_abandoned)
                if not result.done():
                    result.set_result(buf)
                return e.with_traceback(None)  # no frames that hold the owner (comm.py)
            return None

        scratch.queue(work)
        return result

    def _prepare(self, jobs: Sequence[Job], grad: torch.Tensor, order: list[str],
                 sizes: list[int], here: torch.Tensor, wire: torch.dtype
                 ) -> tuple[list[tuple[Job, list[int], Payload]], int, torch.Tensor]:
        """Phase 1: error feedback once for the bucket, in travel order (one accumulation, one
        commit), then each job's payload; returns the parts, the all-reduce part's entries
        (ahead of the all-gather's) and the accumulator."""
        owner = self.owner
        clip = None if owner.cfg.clip_norm is None else (owner.cfg.clip_norm, self.comm.size)
        acc = accumulate(self.key, order, sizes, grad, owner.ef, clip, here)
        writable = owner.ef.writable(self.key, acc)  # the all-reduce part may sum in acc
        lead = owner.ef.lead(self.key)  # momentum sent ahead (feedback.py, "Ahead")
        parts: list[tuple[Job, list[int], Payload]] = []
        i = at = whole = 0
        for job in jobs:
            job_sizes, i = sizes[i:i + len(job.names)], i + len(job.names)
            n = sum(job_sizes)
            payload, _ = select(job, self.key, acc[at:at + n], job_sizes, owner.parts.sparsifier,
                                None, owner.counts.steps, wire, writable,
                                None if lead is None else (lead[0][at:at + n], lead[1]))
            parts.append((job, job_sizes, payload))
            at += n
            whole += n if payload.dense is not None else 0
        return parts, whole, acc

    def _launch(self, parts: list[tuple[Job, list[int], Payload]], here: torch.Tensor
                ) -> tuple[list[torch.Tensor], Any, Any, CommStats]:
        """Phase 2: the all-reduce part issued first, interleaved with the all-gather's
        collective; returns the sums in travel order, the all-gather's result and message
        (None: no all-gather part) and the traffic. A poisoned bucket carries its NaN in one
        part only (module doc): the sums' flag covers them all. On the split side a bucket's
        all-reduce part waits for the step's last bucket, which sums them all with its own in
        one call, in bucket order (the merged side's layout: a ring sums an entry in an order
        the layout sets, so both sides sum alike), and averages their buckets."""
        owner, comm = self.owner, self.comm
        res = sel = None
        works: list[Any] = []
        sums: list[torch.Tensor] = []
        stats = comm.stats
        poison: torch.Tensor | None = here
        left = owner.scratch.dense if self.last else []  # the split side's, summed here
        groups: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
        try:
            for job, _, payload in parts:
                if payload.dense is not None:  # an all-reduce part, interleaved with the
                    sums.append(payload.dense)  # all-gather below
                    poison = carry(sums[-1], poison)
                    if self.defer:
                        owner.scratch.dense.append(payload.dense)
                    else:
                        works += _all_reduce(comm, [*left, payload.dense], groups)
                        left = []
                    continue
                # poisoned: the selection of zeros (every rank's message has the capacity
                # they expect), one value NaN, or one entry of NaN (carry_message)
                sel = carry_message(payload.message(job, payload.selections), poison)
                poison = None
                coll = owner.parts.collective("ddp", None, job.collective)
                res = coll(sel, group=owner.group, step=owner.counts.steps,
                           deferred=owner.scratch.wire_checks)
                sums.append(res.dense)
                stats += res.stats
            if left:  # a last bucket with no all-reduce part of its own
                works += _all_reduce(comm, left, groups)
        except BaseException:
            # the all-reduce is waited for on every path, a failing all-gather included: a
            # work left pending keeps this bucket's tensors in gloo's worker thread, which may
            # then release them while the interpreter shuts down
            for work in works:
                with contextlib.suppress(Exception):
                    work.wait()
            raise
        for work in works:  # Comm keeps the work, so gloo's thread never frees it (comm.py,
            work.wait()  # "Exit safety")
        for together, group in groups:
            if len(group) > 1:  # back into each bucket's part
                for t, summed in zip(group, together.split([g.numel() for g in group])):
                    t.copy_(summed)
        if self.last:  # the buckets whose all-reduce part was summed here: their averages
            owner.scratch.dense, later, owner.scratch.later = [], owner.scratch.later, []
            for complete, _, _ in later:
                complete()
        return sums, res, sel, stats

    def whole(self, buf: torch.Tensor, feedback: bool) -> torch.futures.Future:
        """A bucket sent whole, as DDP's default hook sends it: issued, not waited for (the
        future completes with ``buf`` averaged once the sum is in). With ``feedback`` every
        tensor sends error feedback's ``acc`` (residual + gradient, momentum's velocity, a
        preconditioning scale), and its residual keeps only the rounding to the gradients'
        dtype, committed once the sum is in and finite; without, the raw gradients travel.
        No tensor is checked on its own: a NaN/Inf shows in every rank's sum."""
        owner, comm, key, names = self.owner, self.comm, self.key, self.names
        error = owner.scratch.drain()  # sparse buckets queued before this one go first
        if error is not None:
            return _abandoned(owner, buf, error, self.last)
        acc = None
        if feedback:
            grad = buf
            if owner.cfg.clip_norm is not None:  # clipped per tensor (DGC §3.3)
                grad = torch.cat(clip_local(list(buf.split(self.numels)), owner.cfg.clip_norm,
                                            comm.size))
            acc = owner.ef.accumulate_buffer(key, names, self.numels, grad)
            buf.copy_(acc)  # rounded to the gradients' dtype; the residual keeps it
        owner.counts.tensors += len(names)
        P, rank, step = comm.size, comm.rank, owner.counts.steps
        # gloo's worker thread runs the callback and then drops it; if it held the owner, the
        # process group it holds could be freed there (comm.py, "Exit safety"): a weak
        # reference, and DDP, which holds the owner, outlives the step's callbacks
        held_by = weakref.ref(owner)

        def settle_sum() -> torch.Tensor:
            """The sum is in ``buf``: a finite one commits error feedback (the residual keeps
            only the rounding), a non-finite one leaves it as before the step."""
            held = held_by()
            if held is None:  # DDP and its hook are gone: no one reads this step
                return buf.div_(P)
            if all_finite(buf):
                if acc is not None:
                    commit(held.ef, key, acc, None, buf.dtype)
            else:  # this rank's part is known only where it was kept apart (acc)
                if acc is not None:
                    held.ef.discard_buffer(key)
                here = not all_finite(acc) if acc is not None else None
                err = _nonfinite(held, key, names, here, rank, step)
                if err is not None:
                    del held  # not in the frame the error's traceback keeps
                    raise err  # in the callback: DDP's backward raises it on every rank
            return buf.div_(P)

        work = comm.all_reduce(buf, async_op=True)
        future = getattr(work, "get_future", None)
        if future is None:  # one rank, or a staged call that completed at issue
            try:
                settle_sum()
            except ValueError as err:
                return _done(owner, comm.stats, buf, self.last, err)
            return _done(owner, comm.stats, buf, self.last)

        def average(fut: torch.futures.Future) -> torch.Tensor:
            fut.value()  # a failed all-reduce raises here, into DDP's backward
            return settle_sum()

        # the sparse buckets' error (auto's), the last one settled here: after the average
        return _failing(future().then(average), _account(owner, comm.stats, self.last))


def _all_reduce(comm: Comm, group: list[torch.Tensor],
                groups: list[tuple[torch.Tensor, list[torch.Tensor]]]) -> list[Any]:
    """One asynchronous all-reduce of ``group``'s tensors, concatenated (``groups`` keeps
    them, to spread the sums back); its work, or none at one rank."""
    together = group[0] if len(group) == 1 else torch.cat(group)
    groups.append((together, group))
    work = comm.all_reduce(together, async_op=True)
    return [work] if work is not None else []


def settle(owner: Owner, comm: Comm) -> ValueError | None:
    """Phases 3–4 at a step's last bucket: every sparse bucket's checks in one read (with, at
    P > 1, the ranks' word on malformed messages), then the buckets' error feedback committed
    (every sum finite) or left as before the step (a NaN/Inf in any: counted per bucket, and
    under ``Config.nonfinite="raise"`` the error of the first such bucket is returned; a
    malformed message on any rank: the error returned on every rank)."""
    pending, owner.scratch.pending = owner.scratch.pending, []
    wire, owner.scratch.wire_checks = owner.scratch.wire_checks, []
    if not pending and not wire:
        return None
    checked = [p for p in pending if p.check is not None]
    oks = [p.finite for p in pending]
    # whether a bucket's collective ran is alike on every rank (the same jobs), so every rank
    # meets here; a step of plain all-reduces (DGC's warm-up at density 1) receives no message
    ran = [p for p in pending if p.kept is not None]
    word = (agreement_word(comm, ran[0].finite.device, wire) > 0
            if ran and comm.size > 1 and not all(p.alike for p in ran) else None)
    try:
        missing, flags = settle_missing(
            [p.check for p in checked], "a bucket's parts", "gradsync.ddp: ", wire,
            [f for p, ok in zip(pending, oks) for f in (ok, p.here)] + (
                [] if word is None else [word]))
    except ValueError as e:  # this rank received a malformed message: its check's message
        for p in pending:
            owner.ef.discard_buffer(p.index)
        # without its traceback, whose frames hold the owner: a dense last bucket's callback
        # carries the error, and gloo's thread drops it (BufferPipeline.whole)
        return e.with_traceback(None)
    if word is not None and flags.pop():
        for p in pending:
            owner.ef.discard_buffer(p.index)
        return ValueError(f"gradsync DDP hook: step {owner.counts.steps}: another rank "
                          "received a malformed message (its error names the check); "
                          "residuals and velocities were left as before the step")
    counts = {id(p): m for p, m in zip(checked, missing)}  # else p.missing: known
    error, taken = None, all(flags[0::2])
    for p, ok, here in zip(pending, flags[0::2], flags[1::2]):
        if taken:
            owner.counts.missing += counts.get(id(p), p.missing)
            commit(owner.ef, p.index, p.acc, p.kept, p.wire, p.whole, p.sent_ahead)
            continue
        # a NaN/Inf in any bucket: the step is not taken (its backward raises, or a scaler
        # skips it), so no bucket's residuals and velocities move, as in the engine (and
        # however the buckets travelled, merged or split); its missing tensors not counted
        owner.ef.discard_buffer(p.index)
        if not ok:
            err = _nonfinite(owner, p.index, p.names, not here, comm.rank, owner.counts.steps)
            error = error or err
    return error


class _Travel:
    """A bucket's tensors in the order they travel (``order``: bucket positions), and the way
    back, over the bucket's buffer, or the buffers of merged buckets (``sizes``: each one's
    entries; the positions count through them in turn). In one bucket's order nothing moves.
    Otherwise, on an accelerator one gather and one scatter by a position index made once per
    layout (a launch each, whatever the tensors); on the CPU, where an indexed pass costs
    several copies, one slice per run of tensors that lie side by side in one buffer."""

    def __init__(self, order: list[int], offsets: list[int], numels: list[int],
                 sizes: list[int], device: torch.device) -> None:
        self.ordered = len(sizes) == 1 and order == list(range(len(order)))
        bases = list(itertools.accumulate(sizes, initial=0))
        self.spans = []  # (buffer, start, end) of each tensor, in travel order
        self.runs: list[list[int]] = []  # [buffer, start, end] of tensors side by side
        for i in order:
            b = bisect.bisect_right(bases, offsets[i], hi=len(sizes)) - 1
            lo, hi = offsets[i] - bases[b], offsets[i] + numels[i] - bases[b]
            self.spans.append((b, lo, hi))
            if self.runs and self.runs[-1][0] == b and self.runs[-1][2] == lo:
                self.runs[-1][2] = hi
            else:
                self.runs.append([b, lo, hi])
        self.perm = None
        if not self.ordered and len(sizes) == 1 and segments.pays_on(device):
            self.perm = _positions(tuple(lo for _, lo, _ in self.spans),
                                   tuple(hi - lo for _, lo, hi in self.spans), device)

    def gather(self, bufs: list[torch.Tensor]) -> torch.Tensor:
        if self.ordered:
            return bufs[0]
        if self.perm is not None:
            return bufs[0].index_select(0, self.perm)
        return torch.cat([bufs[b][lo:hi] for b, lo, hi in self.runs])

    def average_into(self, bufs: list[torch.Tensor], sums: list[torch.Tensor], P: int
                     ) -> None:
        """The buffers (bucket order) ← the sums (their parts in travel order, each of whole
        tensors) divided by ``P``. On an accelerator's path one gather of the parts and one
        scatter by position; else each run of tensors that lie in one part and side by side in
        one buffer is divided straight into it: one pass over the sums, where concatenating
        them and dividing into a copy first took three (on the CPU, per bucket), and merged
        buckets took two more (their concatenation, and the copies back)."""
        if self.perm is not None:
            out = sums[0] if len(sums) == 1 else torch.cat(sums)
            bufs[0].index_copy_(0, self.perm, torch.div(out, P))
            return
        at = part = 0  # the position in sums[part]
        run: list[int] | None = None  # [buffer, start, end, part, start in the part]
        for b, lo, hi in self.spans:
            while at == sums[part].numel() and part + 1 < len(sums):  # parts end where a
                part, at = part + 1, 0  # tensor ends (jobs hold whole tensors)
            if run is not None and run[0] == b and run[2] == lo and run[3] == part:
                run[2] = hi
            else:
                if run is not None:
                    _divide(bufs, sums, run, P)
                run = [b, lo, hi, part, at]
            at += hi - lo
        if run is not None:
            _divide(bufs, sums, run, P)


def _divide(bufs: list[torch.Tensor], sums: list[torch.Tensor], run: list[int], P: int
            ) -> None:
    """``bufs[b][lo:hi]`` ← ``sums[part][at:at + hi − lo] / P``, for ``run`` =
    ``[b, lo, hi, part, at]``."""
    b, lo, hi, part, at = run
    torch.div(sums[part][at:at + hi - lo], P, out=bufs[b][lo:hi])


def _finite(bufs: list[torch.Tensor]) -> torch.Tensor:
    """Whether the averaged buffers hold no NaN/Inf (a bool on their device): one check of
    the bucket, whatever its parts (sum / P is finite exactly when the sum is); merged
    buckets, on the CPU only, one each."""
    flags = [finite_flag(b) for b in bufs]
    return flags[0] if len(flags) == 1 else torch.stack(flags).all()


@functools.lru_cache(maxsize=32)
def _positions(starts: tuple[int, ...], lengths: tuple[int, ...], device: torch.device
               ) -> torch.Tensor:
    """The bucket positions of a travel order (cached: DDP's buckets keep their layout)."""
    return segments.ranges(starts, lengths, device)


def _nonfinite(owner: Owner, index: int, names: list[str], here: bool | None, rank: int,
              step: int) -> ValueError | None:
    """A bucket's sum held NaN/Inf (on every rank alike): count it; under
    ``Config.nonfinite="raise"`` the error for the bucket's future (DDP raises it from
    ``backward()``; raised in the hook itself, it would leave DDP's reducer broken). May run on
    gloo's thread (a dense bucket's callback)."""
    with owner.counts.lock:
        owner.counts.nonfinite += 1
    if owner.cfg.nonfinite == "raise":
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


def _account(owner: Owner, stats: CommStats, last: bool) -> ValueError | None:
    """Count a bucket's traffic; at the last bucket settle the step (:func:`settle`), close
    the density schedule's window, and return the step's error, if any, for that bucket's
    future."""
    comm = Comm(owner.group)
    error = settle(owner, comm) if last else None
    stats += comm.stats  # the malformed-message word, if one was all-reduced
    window = owner.density.end_step(owner.counts.steps, owner.group) if last else None
    if window is not None:  # the density schedule's word, at a window's end
        stats += window
    owner.counts.steps += int(last)
    owner.counts.last = stats
    owner.counts.total += stats
    owner.counts.calls += 1
    return error


def _abandoned(owner: Owner, buf: torch.Tensor, error: BaseException, last: bool
               ) -> torch.futures.Future:
    """A bucket after one whose collective raised on the thread (a peer that died or
    stalled): no collective of its own; at the step's last bucket the step's error feedback
    left as before it, and the error for DDP to raise from ``backward()`` (the last bucket's
    future only: DDP stays usable when its last future fails, not an earlier one)."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(buf)
    if not last:
        return fut
    owner.ef.discard_pending()  # the failed bucket's too, which never reached the pending
    owner.scratch.pending, owner.scratch.wire_checks = [], []
    for _, result, b in owner.scratch.later:  # split buckets left for this one: as they are
        if result is not None and not result.done():
            result.set_result(b)
    owner.scratch.dense, owner.scratch.later = [], []
    owner.scratch.failed = None
    owner.counts.steps += 1
    return _failing(fut, error)


def _done(owner: Owner, stats: CommStats, buf: torch.Tensor, last: bool = False,
         error: Exception | None = None) -> torch.futures.Future:
    """A completed future: ``buf``, or ``error`` (or the step's, settled at its last bucket)
    for DDP to raise from ``backward()``."""
    settled = _account(owner, stats, last)
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(buf)
    return _failing(fut, error or settled)


def _failing(fut: torch.futures.Future, error: Exception | None) -> torch.futures.Future:
    """``fut``, or when ``error`` is given a future that raises it once ``fut`` completes."""
    if error is None:
        return fut

    def fail(finished: torch.futures.Future) -> torch.Tensor:
        finished.value()  # its own failure first
        raise error  # as a dense bucket's callback raises (set_exception reaches DDP's C++
        # reducer as "Unable to cast ...", not as the error)

    return fut.then(fail)
