"""The engine's two background threads: the communication thread and the offload worker.

**Communication thread** (wait-free backpropagation, SSFusion §II 'DenseOvlp'): one thread runs
every job's collective strictly in plan order, so every rank issues the same collectives in the
same order while the backward pass goes on. A per-tensor buffer's two parts under SSFusion-I
(§IV-D) are two jobs here: Buffer_AR's all-reduce, then Buffer_AG's sparse collective. A
selection the offload worker has not finished yet is waited for here, on the communication
thread, never on the training thread.

**Offload worker** (SSFusion-O, §IV-C): the tensors the planner offloaded are sparsified on one
serial worker thread instead of the training thread. On CUDA the accumulated gradient is copied
to pinned host memory without blocking, the worker waits for that copy's event, selects on the
host and moves the selection back to the device; on the CPU it selects in place.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist

from gradsync import collectives, sparsify
from gradsync.collectives.comm import Comm
from gradsync.engine.jobs import Job, JobResult, Mode, Payload, Transport, concat
from gradsync.sparsegrad import SparseGrad

__all__ = ["Executor"]


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
        self._comm = ThreadPoolExecutor(1, thread_name_prefix="gradsync-comm")
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="gradsync-sparsify")

    def offload(self, sp: sparsify.Sparsifier, acc: torch.Tensor, step: int) -> Future:
        """SSFusion-O: sparsify on the worker thread (via pinned host memory on CUDA).

        The future's result is ``(selection, seconds spent selecting)``.
        """
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

    def submit(self, job: Job, index: int, payload: Payload, step: int) -> Future[JobResult]:
        """Queue job ``index`` of the plan behind the jobs already queued."""
        return self._comm.submit(self._communicate, job, index, payload, step)

    def _communicate(self, job: Job, index: int, payload: Payload, step: int) -> JobResult:
        """Runs on the communication thread: one collective, in plan order."""
        if job.mode is Mode.DENSE:
            data = payload.dense
            sent = data.clone() if self._audit else None
            stats = self._all_reduce(data)
            return JobResult(data, None, stats, 0.0, None, sent)
        offload_s = 0.0
        sels = []
        for part in payload.selections:
            if isinstance(part, Future):
                part, s = part.result()
                offload_s += s
            sels.append(part)
        sel = concat(sels) if job.mode is Mode.PER_TENSOR else sels[0]
        sent_idx, sent_vals = ((sel.indices.clone(), sel.values.clone()) if self._audit
                               else (None, None))
        if job.transport is Transport.ALLREDUCE:  # SSFusion-I's Buffer_AR
            dense = sel.to_dense()
            stats = self._all_reduce(dense)
            return JobResult(dense, sel.indices, stats, offload_s, sent_idx, sent_vals)
        res = self._collective(f"job:{index}")(sel, group=self.group, step=step)
        return JobResult(res.dense, res.kept, res.stats, offload_s, sent_idx, sent_vals)

    def _all_reduce(self, data: torch.Tensor):
        comm = Comm(self.group)
        t0 = time.perf_counter()
        comm.all_reduce(data)
        comm.stats.seconds = time.perf_counter() - t0
        return comm.stats

    def close(self) -> None:
        """Let the queued jobs finish, then stop both threads."""
        self._comm.shutdown(wait=True)
        self._worker.shutdown(wait=True)
