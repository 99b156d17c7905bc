"""Metering DDP comm hooks: bytes at the ``torch.distributed`` call, hook times.

While a DDP peer (``ddp``, ``ddp_powersgd``, ``ddp_fp16``) trains, :func:`counting_all_reduce`
wraps ``torch.distributed.all_reduce`` (what torch's comm hooks call) and counts what it is
handed with the ring accounting of :class:`gradsync.collectives.Comm` (``2(P−1)/P·B`` per
all-reduce of B bytes), and :func:`metered_hook` wraps the hook itself to record when each
bucket's call starts, returns and completes. gradsync's own hook (``ddp_gradsync_<s>``) is
timed the same way; its bytes are its own ``Comm``'s counts. :meth:`Meter.step_metrics` turns
one step's records into the SSFusion Fig. 13 breakdown:

* ``backward_s``: from the start of ``loss.backward()`` to the last bucket's hook call;
* ``sparsify_s``: the synchronous part of the hook calls (PowerSGD/fp16 compression, launches);
* ``comm_s``: the union of the hooks' launch→done intervals minus their synchronous part (for a
  blocking hook: the all-reduces' own time, measured at the call);
* ``wait_s``: the exposed communication, end of the last hook call to ``loss.backward()``
  returning;
* ``hook_blocked_s``: the hook calls' blocks, their wall time minus the calling thread's CPU
  and its wait for a core during them (:class:`RunQueueClock`): gradsync's hook runs the step's
  last bucket's collectives inside its call and waits there for the peers and for its
  communication thread; torch's hooks launch and return (a blocking one waits for its
  all-reduce).
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from gradsync.collectives.comm import ring_allreduce_bytes

__all__ = ["Meter", "MeteredHookState", "RunQueueClock", "counting_all_reduce", "metered_hook",
           "union_length"]


class RunQueueClock:
    """The calling thread's time spent runnable but waiting for a core, in seconds (Linux's
    ``/proc/thread-self/schedstat``, its second field): where the ranks' threads outnumber the
    cores, the part of a phase's wall time that is neither the thread's CPU nor a block. Opened
    on, and only meaningful for, the thread that makes it (the file follows its opener); NaN
    where the kernel does not keep it. One ``pread`` per reading (~3 µs)."""

    def __init__(self) -> None:
        try:
            self._fd: int | None = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:
            self._fd = None

    def __call__(self) -> float:
        if self._fd is None:
            return math.nan
        try:
            return int(os.pread(self._fd, 64, 0).split()[1]) * 1e-9
        except (OSError, IndexError, ValueError):
            return math.nan

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    __del__ = close  # a thread's clock (_clocks) goes with its thread, and its file with it


_clocks = threading.local()  # each thread's RunQueueClock (a hook runs on autograd's thread)


def _runq() -> float:
    """The calling thread's :class:`RunQueueClock` reading (its clock opened on first use)."""
    clock = getattr(_clocks, "clock", None)
    if clock is None:
        clock = _clocks.clock = RunQueueClock()
    return clock()


class Meter:
    """Bytes handed to torch.distributed and comm-hook timestamps of one rank's DDP peer."""

    def __init__(self, P: int, blocking: bool = False) -> None:
        self.P = P
        self.lock = threading.Lock()
        self.bytes_sent = 0
        self.blocking = blocking  # all-reduces complete inside the call (timed as comm)
        self.start_step()

    def start_step(self) -> None:
        """Forget the last step's timestamps; bytes from now on count for this step."""
        with self.lock:
            self.calls: list[float] = []
            self.returns: list[float] = []
            self.done: list[float] = []
            self.sync_s = 0.0
            self.blocked_s = 0.0  # the hook calls' blocks (module docstring)
            self.blocking_comm_s = 0.0
            self.step_start_bytes = self.bytes_sent

    def count_allreduce(self, t: torch.Tensor) -> None:
        b = t.numel() * t.element_size()
        with self.lock:  # ring accounting, as Comm.all_reduce
            self.bytes_sent += ring_allreduce_bytes(b, self.P)

    def step_metrics(self, backward_start: float, backward_end: float) -> dict[str, float]:
        """This step's record fields (module docstring), given when ``loss.backward()`` started
        and returned (``time.perf_counter()``)."""
        with self.lock:
            calls, rets, done = list(self.calls), list(self.returns), list(self.done)
            sent, sync_s = self.bytes_sent - self.step_start_bytes, self.sync_s
            blocking_comm, blocked = self.blocking_comm_s, self.blocked_s
        last_call = max(calls) if calls else backward_end
        last_ret = max(rets) if rets else backward_end
        if self.blocking:  # communication ran inside the hook, timed at the call
            comm, sync_s = blocking_comm, max(0.0, sync_s - blocking_comm)
        else:
            comm = union_length(list(zip(calls, done))) - sync_s if done else 0.0
        return {"bytes_sent": sent, "bytes_recv": sent,
                "backward_s": max(0.0, last_call - backward_start), "sparsify_s": sync_s,
                "comm_s": max(0.0, comm), "wait_s": max(0.0, backward_end - last_ret),
                "hook_blocked_s": blocked, "missing_rate": 0.0}


@contextlib.contextmanager
def counting_all_reduce(meter: Meter) -> Iterator[None]:
    """Wrap ``torch.distributed.all_reduce`` (what torch's comm hooks call) to count bytes;
    with ``meter.blocking`` each all-reduce is also waited for and timed at the call."""
    orig = dist.all_reduce

    def all_reduce(tensor, *args, **kwargs):
        meter.count_allreduce(tensor)
        if not meter.blocking:
            return orig(tensor, *args, **kwargs)
        t0 = time.perf_counter()
        work = orig(tensor, *args, **kwargs)
        if work is not None:
            work.wait()
        with meter.lock:
            meter.blocking_comm_s += time.perf_counter() - t0
        return work

    dist.all_reduce = all_reduce
    try:
        yield
    finally:
        dist.all_reduce = orig


class MeteredHookState:
    """DDP comm ``state`` of :func:`metered_hook`: a comm hook (torch's, or gradsync's for
    ``ddp_gradsync_<s>``), its own state, the meter."""

    def __init__(self, inner: Callable[..., Any], inner_state: Any, meter: Meter) -> None:
        self.inner, self.inner_state, self.meter = inner, inner_state, meter


def metered_hook(state: MeteredHookState, bucket):
    """Delegate to the hook (torch's own, or gradsync's); record call, return and completion
    times.

    With ``state.meter.blocking`` the hook's future is waited for inside the call (gloo cannot
    launch PowerSGD's second all-reduce from a callback while another bucket's is queued; see
    docs/architecture.md, "torch.distributed facts") and a completed future is returned.
    """
    m = state.meter
    c0, q0 = time.thread_time(), _runq()
    t0 = time.perf_counter()
    fut = state.inner(state.inner_state, bucket)
    if m.blocking:
        value = fut.wait()
        fut = torch.futures.Future()
        fut.set_result(value)
    t1 = time.perf_counter()
    ran = time.thread_time() - c0
    queued = _runq() - q0  # NaN off Linux: the block then holds the wait for a core too
    with m.lock:
        m.calls.append(t0)
        m.returns.append(t1)
        m.sync_s += t1 - t0
        m.blocked_s += max(0.0, t1 - t0 - ran - (queued if queued == queued else 0.0))

    def done(f):
        with m.lock:
            m.done.append(time.perf_counter())
        return f.value()

    if m.blocking:
        with m.lock:
            m.done.append(t1)
        return fut
    return fut.then(done)


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of ``[start, end]`` intervals."""
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total
