"""The engine's two background threads: the communication thread and the offload worker.

**Communication thread** (wait-free backpropagation, SSFusion §II 'DenseOvlp'): one thread runs
every job's collective strictly in plan order, so every rank issues the same collectives in the
same order while the backward pass goes on. A per-tensor buffer's two parts under SSFusion-I
(§IV-D) are two jobs here: Buffer_AR's all-reduce, then Buffer_AG's sparse collective. A
selection the offload worker has not finished yet is waited for here, on the communication
thread, never on the training thread. An all-reduce (a dense buffer, or Buffer_AR) is issued
and not waited for here: the next job goes out at once, as DDP's Reducer issues its buckets,
and the training thread waits for the sum itself (``JobResult.settle``), with no wake-up of this
thread between the sum's arrival and the optimizer step (measured on 2 cores at P = 4: −4…−1 %
on loopback, +0.5…+3 % at 1 Gbit/s, docs/results/speed.md, "The all-reduce in flight").

**Offload worker** (SSFusion-O, §IV-C): the tensors the planner offloaded are sparsified on one
serial worker thread instead of the training thread. On the CPU it selects in place. On CUDA
(docs/architecture.md, "GPU path"):

1. the training thread makes the executor's own *offload stream* wait for the work queued so
   far on its current stream (the accumulated gradient is ready then), and queues there a
   non-blocking copy into a pinned host buffer, and an event after it. The copy overlaps the
   backward kernels still to come on the compute stream; the gradient is marked as used by the
   offload stream (``record_stream``), so the allocator cannot hand its memory out before the
   copy is done;
2. the worker thread waits for that event only, selects on the host, pins the selection and
   queues non-blocking host→device copies on the training thread's stream (captured in step 1;
   the device's default stream, which the communication thread queues on too), so every later
   use of the selection is ordered after its copy without another wait.

Both threads are bound to the CUDA device current where the engine was built (the current
device is per thread), so NCCL control words and copies land on the job's GPU.

Bitwise-identical replicas on CUDA need ``torch.use_deterministic_algorithms(True)``: the
collectives' merges (``index_add_`` with indices from several ranks) use atomics on CUDA, so two
ranks adding the same values may round differently. The executor warns once when a multi-rank
CUDA job runs without it.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist

from gradsync import collectives, sparsegrad, sparsify
from gradsync.collectives.comm import Comm, CommStats
from gradsync.engine.jobs import InFlight, Job, JobResult, Payload
from gradsync.engine.prepare import carry, carry_message, shows_alike
from gradsync.sparsegrad import SparseGrad

__all__ = ["Executor", "comm_thread"]


def comm_thread(name: str = "gradsync-comm") -> ThreadPoolExecutor:
    """One thread that runs a rank's collectives strictly in the order they are handed to it
    (every rank issues them in the same order), bound to the caller's CPU kernels and CUDA
    device: the engine's communication thread (:class:`Executor`) and the DDP hook's
    (:mod:`gradsync.engine.pipeline`)."""
    return ThreadPoolExecutor(1, thread_name_prefix=name,
                              initializer=_binder(sparsegrad.cpu_kernels(), _current_cuda()))


def _current_cuda() -> int | None:
    """The caller's CUDA device, if it uses CUDA at all (never initialise CUDA for a CPU job)."""
    return (torch.cuda.current_device()
            if torch.cuda.is_available() and torch.cuda.is_initialized() else None)


def _binder(kernels: sparsegrad.Kernels, cuda: int | None) -> Callable[[], None]:
    """A thread initializer: the thread takes ``kernels`` and CUDA device ``cuda``."""
    def bind() -> None:
        sparsegrad.bind(kernels)
        if cuda is not None:
            torch.cuda.set_device(cuda)
    return bind


class Executor:
    """The communication thread and the offload worker of one engine.

    Args:
        group: the engine's process group.
        collective: the collective of a key (``job:<index>``), called on the communication
            thread.
        audit: keep a copy of every payload handed to a collective (:mod:`.audit`).
    """

    def __init__(self, group: dist.ProcessGroup | None,
                 collective: Callable[[str], collectives.Collective], audit: bool) -> None:
        self.group = group
        self._collective = collective
        self._audit = audit
        self._cuda = _current_cuda()
        # the kernels of the caller's CPU tensors, taken by both threads (chosen once, here)
        self.kernels = sparsegrad.cpu_kernels()
        self._comm = comm_thread()
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="gradsync-sparsify",
                                          initializer=_binder(self.kernels, self._cuda))
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        if (self._cuda is not None and Comm(group).size > 1
                and not torch.are_deterministic_algorithms_enabled()):
            warnings.warn("gradsync on CUDA: replicas stay bitwise identical only under "
                          "torch.use_deterministic_algorithms(True) (index_add_ uses atomics "
                          "on CUDA); see docs/architecture.md, 'GPU path'", stacklevel=3)

    def _offload_stream(self, device: torch.device) -> torch.cuda.Stream:
        """SSFusion-O's own CUDA stream on ``device`` (created once)."""
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        return stream

    def offload(self, sp: sparsify.Sparsifier, acc: torch.Tensor, step: int) -> Future:
        """SSFusion-O: sparsify on the worker thread (via pinned host memory on CUDA).

        The future's result is ``(selection, seconds spent selecting)``. The selection makes
        no finiteness read: prepare checked the gradients, the engine checks the sums
        (:mod:`gradsync.engine.prepare`).
        """
        if acc.is_cuda:
            dev = acc.device
            stream = self._offload_stream(dev)
            consumer = torch.cuda.current_stream(dev)  # the training thread's
            stream.wait_stream(consumer)  # acc is computed
            host = torch.empty(acc.shape, dtype=acc.dtype, pin_memory=True)
            with torch.cuda.stream(stream):
                host.copy_(acc, non_blocking=True)
                ready = torch.cuda.Event(blocking=True)  # the worker sleeps, not spins
                ready.record(stream)
            acc.record_stream(stream)

            def work() -> tuple[SparseGrad, float]:
                ready.synchronize()  # the host copy only; the compute stream runs on
                t0 = time.perf_counter()
                sel = sparsify.select_each([(sp, host)], step, checked=True)[0]
                idx, val = sel.indices.pin_memory(), sel.values.pin_memory()
                with torch.cuda.stream(consumer):  # ordered before every later use
                    out = SparseGrad(idx.to(dev, non_blocking=True),
                                     val.to(dev, non_blocking=True), sel.numel, validate=False)
                return out, time.perf_counter() - t0
        else:
            def work() -> tuple[SparseGrad, float]:
                t0 = time.perf_counter()
                sel = sparsify.select_each([(sp, acc)], step, checked=True)[0]
                return sel, time.perf_counter() - t0
        return self._worker.submit(work)

    def submit(self, job: Job, index: int, payload: Payload, step: int,
               finite: torch.Tensor | None = None) -> Future[JobResult]:
        """Queue job ``index`` of the plan behind the jobs already queued; ``finite``:
        prepare's flag of its gradients (on the device), carried in the message
        (:func:`carry`)."""
        return self._comm.submit(self._communicate, job, index, payload, step, finite)

    def _communicate(self, job: Job, index: int, payload: Payload, step: int,
                     finite: torch.Tensor | None) -> JobResult:
        """Runs on the communication thread: one collective, in plan order."""
        if payload.dense is not None:  # Mode.DENSE, or a job whose every entry travels
            data = payload.dense
            carry(data, finite)
            sent = data.clone() if self._audit else None
            stats, in_flight = self._all_reduce(data)
            return JobResult(data, None, stats, sent_values=sent, in_flight=in_flight)
        offload_s = 0.0
        sels = []
        for part in payload.selections:
            if isinstance(part, Future):
                part, s = part.result()
                offload_s += s
            sels.append(part)
        sel = payload.message(job, sels)
        coll = self._collective(f"job:{index}", job.collective_density, job.collective)
        alike = shows_alike(coll, sel, self.group)
        if alike:
            sel = carry_message(sel, finite)
        sent_idx, sent_vals = ((sel.indices.clone(), sel.values.clone()) if self._audit
                               else (None, None))
        checks: list[tuple[torch.Tensor, str]] = []
        # a CPU tensor's sum, where a collective can, is left to the training thread, which
        # reads it next (JobResult.settle): a buffer another core wrote is slow to read first
        res = coll(sel, group=self.group, step=step, deferred=checks,
                   lazy=sel.device.type == "cpu")
        return JobResult(res.dense, res.kept, res.stats, offload_s, sent_idx, sent_vals,
                         checks=checks, missing=payload.known_missing(sel, res.kept),
                         alike=alike, decode=res.decode,
                         sent_ahead=payload.sent_at(sel, res.kept))

    def _all_reduce(self, data: torch.Tensor) -> tuple[CommStats, InFlight]:
        """Issue the all-reduce of ``data`` and return without waiting for it: the next job
        is issued at once, as DDP's Reducer issues its buckets, and the training thread waits
        (:meth:`JobResult.settle`) with no hop through this thread when the sum arrives.
        Returns the stats (their ``seconds`` are set by the wait) and the call in flight."""
        comm = Comm(self.group)
        t0 = time.perf_counter()
        work = comm.all_reduce(data, async_op=True)
        return comm.stats, InFlight(work, comm.stats, t0)

    def close(self) -> None:
        """Let the queued jobs finish, then stop both threads."""
        self._comm.shutdown(wait=True)
        self._worker.shutdown(wait=True)
