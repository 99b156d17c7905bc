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

__all__ = ["DistributedError", "DistributedTimeout", "run_distributed", "watch_launcher"]

_GRACE_SECONDS = 5.0  # how long peers get to exit on their own after one rank failed
_WATCH_SECONDS = 0.5  # how often a rank checks that its launcher still runs


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


def _context() -> mp.context.BaseContext:
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
    args: tuple,
    kwargs: dict,
) -> None:
    watch_launcher(launcher)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        if cuda:
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            backend, init_method=init_method, rank=rank, world_size=world_size,
            timeout=timedelta(seconds=timeout),
        )
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
    timeout: float = 120.0,
    backend: str = "gloo",
    cuda: bool | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` ranks; return results.

    ``backend``: the process group's; ``cuda``: set one CUDA device per rank (default: when
    the backend names NCCL; module docstring).

    Raises :class:`DistributedError` (with the failing rank's traceback) if any rank raised or
    died, and :class:`DistributedTimeout` if any rank is still running after ``timeout``
    seconds. All child processes are reaped before this function returns or raises.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if timeout <= 0:
        raise ValueError(f"timeout must be > 0, got {timeout}")
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
    ctx = _context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="gradsync-rdzv-") as tmp:
        init_method = f"file://{os.path.join(tmp, 'store')}"
        procs = [
            ctx.Process(
                target=_worker,
                args=(fn, r, world_size, init_method, backend, cuda, timeout, results,
                      os.getpid(), args, kwargs),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        try:
            return _collect(procs, results, world_size, timeout)
        finally:
            _reap(procs)
            results.close()


def _collect(procs: list, results: Any, world_size: int, timeout: float) -> list[Any]:
    deadline = time.monotonic() + timeout
    done: dict[int, Any] = {}
    raised: list[DistributedError] = []  # ranks that raised, in arrival order
    died: list[DistributedError] = []  # ranks that exited without a result: the root cause
    stop_at = deadline  # after a failure: how long peers get to finish on their own

    def fail(err: DistributedError, into: list[DistributedError]) -> None:
        nonlocal stop_at
        into.append(err)
        stop_at = min(stop_at, time.monotonic() + _GRACE_SECONDS)

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
        # A rank that died without reporting (segfault, os._exit) never puts a result; its
        # last words may still be in the pipe, so drain once more before declaring it dead.
        for r, p in enumerate(procs):
            if r not in done and p.exitcode is not None and not receive(0.5) and r not in done:
                done[r] = None
                msg = f"process exited with code {p.exitcode} without a result"
                fail(DistributedError(r, msg), died)
    return finish(done, died, raised, world_size, timeout)


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
