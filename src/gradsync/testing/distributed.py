"""Multi-rank test harness: run a function on ``world_size`` real gloo ranks on loopback.

``run_distributed(fn, world_size, *args, **kwargs)`` starts one process per rank, initialises
``torch.distributed`` in each (a fresh file-based rendezvous, so parallel test sessions never
race for a TCP port), runs ``fn(rank, world_size, *args, **kwargs)`` and returns the per-rank
return values in rank order.

Guarantees, each tested in ``tests/test_testing.py``:

* an exception on any rank is raised in the parent as :class:`DistributedError`, carrying that
  rank's traceback; the other ranks are stopped (they may be blocked in a collective);
* a rank that hangs past ``timeout`` seconds makes the call raise :class:`DistributedTimeout`,
  naming the ranks that did not finish; every child is reaped, the caller never hangs;
* with ``progress_timeout=T`` the job is watched for progress instead (or as well, when
  ``timeout`` is given too): each rank reports it with :func:`heartbeat` (a training loop: once
  per completed step), and when no unfinished rank has reported for ``T`` seconds the call
  raises :class:`DistributedStall` (a :class:`DistributedTimeout`) naming the ranks furthest
  behind and the step each rank was at. A long job that keeps stepping runs as long as it
  needs; a deadlock still ends ``T`` seconds after the last step anyone completed (tested in
  ``tests/test_train_failures.py``, with ``python -m gradsync train``, its user);
* a rank that dies without raising (``os._exit``, a signal) is reported with its exit code;
* a launcher killed outright (``SIGTERM``/``SIGKILL`` to it alone, no ``finally`` runs) does
  not leave its ranks running: each rank watches the launcher's process and exits within
  about a second of its end (:data:`_WATCH_SECONDS`);
* world size 1 works.

Backends and devices: ``backend="gloo"`` (default) or ``"nccl"``, or any string
``init_process_group`` takes (``"cpu:gloo,cuda:nccl"``). With ``cuda=True`` — the default when
the backend names NCCL — rank r first calls ``torch.cuda.set_device(r % device_count)``, so
NCCL gets one GPU per rank and gloo ranks on CUDA tensors share the GPUs there are. NCCL with
more ranks than GPUs raises ``ValueError`` here (NCCL refuses two ranks on one GPU); ask for
CUDA without a GPU and it raises too.

``fn`` must be picklable (a module-level function). Return values travel back through
``torch.save``, so tensors, dicts and dataclasses of tensors all work. Children are forked from
a server process that has already imported torch, which keeps a rank's start-up well under a
second; each rank runs with ``max(1, cpus // world_size)`` intra-op threads so that 8 ranks on a
2-core machine do not oversubscribe it.
"""

from __future__ import annotations

import contextlib
import io
import math
import multiprocessing as mp
import os
import queue
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gradsync import sparsegrad

__all__ = ["DistributedError", "DistributedStall", "DistributedTimeout", "caller_kernels",
           "heartbeat", "join_group", "progress_limit", "run_distributed", "watch_launcher"]

GRACE_SECONDS = 5.0  # how long peers get to exit on their own after one rank failed
_WATCH_SECONDS = 0.5  # how often a rank checks that its launcher still runs
# Under a progress watchdog (run_distributed(progress_timeout=T)) the ranks' collectives time out
# after this many times T: the watchdog, which sees every rank, then fires first and names the
# stalled one, instead of a waiting peer's collective failing with a bare timeout.
COLLECTIVE_TIMEOUT_FACTOR = 2.0

# This rank's heartbeat slots when a watched run_distributed started it: (times, steps, rank,
# limit); None elsewhere (heartbeat() is then a no-op).
_HEARTBEAT: tuple[Any, Any, int, float] | None = None


def heartbeat(step: int | None = None) -> None:
    """Report progress of this rank to its launcher's watchdog: ``step`` completed (``None``:
    alive, still at the step last reported, e.g. during an evaluation). A no-op unless this
    process is a rank of :func:`run_distributed` with ``progress_timeout``; cheap (two stores
    to shared memory), so a loop may call it every step."""
    hb = _HEARTBEAT
    if hb is None:
        return
    times, steps, rank, _ = hb
    if step is not None:
        steps[rank] = int(step)
    times[rank] = time.monotonic()


def progress_limit() -> float | None:
    """The ``progress_timeout`` this rank's launcher watches its :func:`heartbeat` with;
    ``None`` outside such a run (no watchdog: a loop's own collective timeouts are all there
    is). Code that sets timeouts of its own collectives can make them longer than the
    watchdog's (:data:`COLLECTIVE_TIMEOUT_FACTOR`), so that the watchdog reports a stall."""
    return None if _HEARTBEAT is None else _HEARTBEAT[3]


def _watch(launcher: int) -> None:
    while True:
        time.sleep(_WATCH_SECONDS)
        try:
            os.kill(launcher, 0)
        except (ProcessLookupError, PermissionError):  # gone (or the pid reused by another user)
            os._exit(3)


def watch_launcher(launcher: int) -> None:
    """Exit this process (code 3) within ``_WATCH_SECONDS`` once the process ``launcher`` is
    gone: a daemon thread polls it. A launcher killed outright runs no clean-up, and its
    death reaches a rank no other way when the rank is not its child (forked from a server
    process here; re-parented to init when its parent dies, in ``run_shaped``); an orphaned
    rank would hold its cores until its collectives time out."""
    threading.Thread(target=_watch, args=(launcher,), daemon=True,
                     name="gradsync-launcher-watch").start()


class DistributedError(RuntimeError):
    """A rank raised (or died); ``rank`` and ``remote_traceback`` say which and where."""

    def __init__(self, rank: int, remote_traceback: str):
        self.rank = rank
        self.remote_traceback = remote_traceback
        super().__init__(f"rank {rank} failed:\n{remote_traceback}")


class DistributedTimeout(TimeoutError):
    """Some ranks did not finish within the timeout; ``ranks`` lists them."""

    def __init__(self, ranks: list[int], timeout: float):
        self.ranks = ranks
        super().__init__(
            f"ranks {ranks} did not finish within {timeout:g}s (hung or deadlocked); "
            "all ranks were terminated"
        )


class DistributedStall(DistributedTimeout):
    """No unfinished rank reported progress (:func:`heartbeat`) for ``progress_timeout``
    seconds. ``ranks``: the stalled ones — the ranks furthest behind, at the lowest step;
    ``steps``: every unfinished rank → the step it was at (one past the last it completed; 0:
    none completed); ``idle``: rank → seconds since its last report."""

    def __init__(self, steps: dict[int, int], idle: dict[int, float], progress_timeout: float):
        low = min(steps.values())
        self.ranks = [r for r in sorted(steps) if steps[r] == low]
        self.steps, self.idle, self.progress_timeout = dict(steps), dict(idle), progress_timeout
        who = "rank" if len(self.ranks) == 1 else "ranks"
        names = ", ".join(map(str, self.ranks))
        first = "before completing any step" if low == 0 else f"at step {low}"
        parts = [f"{who} {names} stalled {first} (last progress "
                 f"{max(idle[r] for r in self.ranks):.0f}s ago)"]
        ahead = sorted(r for r in steps if steps[r] != low)
        if ahead:
            them = "it" if len(self.ranks) == 1 else "them"
            parts.append(f"waiting for {them}: "
                         + ", ".join(f"rank {r} at step {steps[r]}" for r in ahead))
        TimeoutError.__init__(
            self, f"no rank made progress for {progress_timeout:g}s: {'; '.join(parts)} "
                  "(hung or deadlocked); all ranks were terminated")


def join_group(backend: str, init_method: str, rank: int, world_size: int,
               timeout: timedelta) -> None:
    """``init_process_group``, then a barrier: return only once every rank has joined.

    Gloo's full-mesh connect can finish on one side of a pair before the other has read the
    handshake; a rank whose ``fn`` makes no collective would then destroy its group and close
    the socket while its peer is still connecting, and the peer fails with "Connection closed
    by peer" (seen once in CI, in ``test_ranks_take_the_callers_kernels``). The barrier keeps
    every rank in the group until all have connected."""
    dist.init_process_group(backend, init_method=init_method, rank=rank,
                            world_size=world_size, timeout=timeout)
    dist.barrier()


def caller_kernels() -> sparsegrad.Kernels:
    """The kernels this process's CPU tensors take (:func:`gradsync.sparsegrad.cpu_kernels`):
    the ranks a launcher starts take the caller's, so a test that chooses them for itself (the
    suite's ``kernels`` fixture, :func:`gradsync.sparsegrad.using`) chooses them for its ranks
    too. Rank processes are forked from a server started with the environment of the first
    launch, not the caller's current one."""
    return sparsegrad.cpu_kernels()


def start_context() -> mp.context.BaseContext:
    method = os.environ.get("GRADSYNC_START_METHOD", "forkserver")
    if method not in mp.get_all_start_methods():
        method = "spawn"
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "gradsync"])
    return ctx


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    init_method: str,
    backend: str,
    cuda: bool,
    timeout: float,
    results: Any,
    launcher: int,
    beats: tuple[Any, Any, float] | None,
    kernels: sparsegrad.Kernels,
    args: tuple,
    kwargs: dict,
) -> None:
    global _HEARTBEAT
    watch_launcher(launcher)
    sparsegrad.bind(kernels)
    if beats is not None:
        _HEARTBEAT = (beats[0], beats[1], rank, beats[2])
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(rank_threads(world_size))
    try:
        if cuda:
            torch.cuda.set_device(rank % torch.cuda.device_count())
        join_group(backend, init_method, rank, world_size, timedelta(seconds=timeout))
        if beats is not None:
            beats[1][rank] = -1  # up: from here the progress limit applies
        heartbeat()
        out = fn(rank, world_size, *args, **kwargs)
        buf = io.BytesIO()
        torch.save(out, buf)
        results.put((rank, True, buf.getvalue()))
    except BaseException:  # everything, SystemExit included, must reach the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float | None = 120.0,
    backend: str = "gloo",
    cuda: bool | None = None,
    progress_timeout: float | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` ranks; return results.

    ``backend``: the process group's; ``cuda``: set one CUDA device per rank (default: when
    the backend names NCCL; module docstring).

    Raises :class:`DistributedError` (with the failing rank's traceback) if any rank raised or
    died, and :class:`DistributedTimeout` if any rank is still running after ``timeout``
    seconds. All child processes are reaped before this function returns or raises.

    ``progress_timeout``: also watch for progress (module docstring): ``fn`` reports it with
    :func:`heartbeat`, start-up counts as one, and :class:`DistributedStall` is raised once no
    unfinished rank reported for this many seconds. With it ``timeout`` may be ``None`` (no
    bound on the whole job, only on its progress); the process group's timeout is then
    :data:`COLLECTIVE_TIMEOUT_FACTOR` times ``progress_timeout`` (else it is ``timeout``).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if progress_timeout is not None and not progress_timeout > 0:
        raise ValueError(f"progress_timeout must be > 0, got {progress_timeout}")
    if timeout is None and progress_timeout is None:
        raise ValueError("timeout=None needs a progress_timeout (a job must end in bounded "
                         "time when it hangs)")
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout must be > 0, got {timeout}")
    pg_timeout = (timeout if progress_timeout is None
                  else COLLECTIVE_TIMEOUT_FACTOR * progress_timeout)
    nccl = "nccl" in backend.lower()
    cuda = nccl if cuda is None else bool(cuda)
    if cuda or nccl:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus == 0:
            raise ValueError(f"run_distributed: backend {backend!r} with cuda={cuda} needs a "
                             "CUDA device and none is available")
        if nccl and world_size > gpus:
            raise ValueError(f"run_distributed: NCCL runs one rank per GPU; {world_size} ranks "
                             f"for {gpus} GPU(s) (use gloo on CUDA tensors for more ranks)")
    ctx = start_context()
    results = ctx.Queue()
    beats = None
    if progress_timeout is not None:  # per rank: when it last reported, the step it completed
        times = ctx.Array("d", [time.monotonic()] * world_size, lock=False)
        steps = ctx.Array("q", [_NOT_UP] * world_size, lock=False)
        beats = (times, steps, float(progress_timeout))
    with tempfile.TemporaryDirectory(prefix="gradsync-rdzv-") as tmp:
        init_method = f"file://{os.path.join(tmp, 'store')}"
        procs = [
            ctx.Process(
                target=_worker,
                args=(fn, r, world_size, init_method, backend, cuda, pg_timeout, results,
                      os.getpid(), beats, caller_kernels(), args, kwargs),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        if beats is not None:  # the watch starts once they run (a forkserver may start slowly)
            beats[0][:] = [time.monotonic()] * world_size
        try:
            return _collect(procs, results, world_size, timeout, beats)
        finally:
            _reap(procs)
            results.close()


def _collect(procs: list, results: Any, world_size: int, timeout: float | None,
             beats: tuple[Any, Any, float] | None = None) -> list[Any]:
    deadline = math.inf if timeout is None else time.monotonic() + timeout
    stall: DistributedStall | None = None
    done: dict[int, Any] = {}
    raised: list[DistributedError] = []  # ranks that raised, in arrival order
    died: list[DistributedError] = []  # ranks that exited without a result: the root cause
    stop_at = deadline  # after a failure: how long peers get to finish on their own

    def fail(err: DistributedError, into: list[DistributedError]) -> None:
        nonlocal stop_at
        into.append(err)
        stop_at = min(stop_at, time.monotonic() + GRACE_SECONDS)

    def receive(wait: float) -> bool:
        try:
            rank, ok, payload = results.get(timeout=wait)
        except queue.Empty:
            return False
        if ok:
            done[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        else:
            done[rank] = None
            fail(DistributedError(rank, payload), raised)
        return True

    while len(done) < world_size and time.monotonic() < stop_at:
        if receive(0.05):
            continue
        if beats is not None and not (died or raised):
            stall = _stalled(beats, [r for r in range(world_size) if r not in done])
            if stall is not None:
                break
        # A rank that died without reporting (segfault, os._exit) never puts a result; its
        # last words may still be in the pipe, so drain once more before declaring it dead.
        for r, p in enumerate(procs):
            if r not in done and p.exitcode is not None and not receive(0.5) and r not in done:
                done[r] = None
                msg = f"process exited with code {p.exitcode} without a result"
                fail(DistributedError(r, msg), died)
    if stall is not None:
        raise stall
    return finish(done, died, raised, world_size, timeout)


#: How long a rank may take to come up (start its interpreter, import, join the process group)
#: before its first report: start-up is not the progress a loop's ``progress_timeout`` bounds,
#: and on a loaded machine it alone takes seconds; a rank that never comes up is still
#: reported, after this long.
STARTUP_GRACE_S = 60.0

_NOT_UP = -2  # a rank's step before its first report (-1: up, no step completed yet)


#: The cores a launcher's ranks share (default: the machine's). A test session with several
#: workers gives each its share (tests/conftest.py), so that ranks of different workers do not
#: each spin up a thread per core of the machine.
CPUS_ENV = "GRADSYNC_RANK_CPUS"


def rank_threads(world_size: int) -> int:
    """torch's intra-op threads for one of ``world_size`` ranks: its share of the cores
    (:data:`CPUS_ENV`, else ``os.cpu_count()``), at least one."""
    cpus = int(os.environ.get(CPUS_ENV) or os.cpu_count() or 1)
    return max(1, cpus // world_size)


def _stalled(beats: tuple[Any, Any, float], active: list[int],
             now: float | None = None) -> DistributedStall | None:
    """The stall of ``active`` ranks when none of them reported for the progress limit (for a
    rank not up yet, :data:`STARTUP_GRACE_S` if longer), at ``now`` (``time.monotonic()``)."""
    times, steps, limit = beats
    now = time.monotonic() if now is None else now
    idle = {r: now - times[r] for r in active}
    if not active or any(idle[r] <= (max(limit, STARTUP_GRACE_S) if steps[r] == _NOT_UP
                                     else limit) for r in active):
        return None
    return DistributedStall({r: max(steps[r], -1) + 1 for r in active}, idle, limit)


def finish(done: dict[int, Any], died: list[DistributedError], raised: list[DistributedError],
           world_size: int, timeout: float) -> list[Any]:
    """Turn collected per-rank outcomes into results in rank order, or the root-cause error.

    A rank that died without a result comes first (its peers usually fail *because* it went
    away), then the first rank that raised; the others are named as likely consequences.
    Ranks with no outcome at all timed out. Shared by every launcher (loopback, netns).
    """
    failures = died + raised
    if failures:
        root = failures[0]
        others = sorted(e.rank for e in failures[1:])
        if others:
            root.args = (f"{root.args[0]}\n(ranks {others} failed too, likely as a consequence)",)
        raise root
    if len(done) < world_size:
        raise DistributedTimeout([r for r in range(world_size) if r not in done], timeout)
    return [done[r] for r in range(world_size)]


def _reap(procs: list) -> None:
    for p in procs:
        p.join(timeout=0.2 if p.exitcode is None else 1.0)
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=2.0)
        if p.is_alive():
            p.kill()
            p.join(timeout=2.0)
