"""Rank processes that are reused: :func:`run_distributed` on a pool of live gloo ranks.

:func:`gradsync.testing.distributed.run_distributed` starts ``world_size`` processes per call,
each of which imports the caller's module, joins a new process group and exits: about half a
second a call on a 2-core machine, seconds under load, for a function that often runs for
less. Inside :func:`pooled` (the test suite enters it for its whole session), a call is handed
instead to a :class:`RankPool`: ``world_size`` processes that joined one process group when
the pool started and run one function after another.

The contract is :func:`~gradsync.testing.distributed.run_distributed`'s, tested for both:
results in rank order; a rank that raises gives :class:`DistributedError` with its traceback,
its peers being stopped; a rank that dies gives its exit code; a call past its ``timeout``
gives :class:`DistributedTimeout` naming the ranks that did not finish. After any of those the
pool's processes are killed (a peer may be blocked in a collective forever) and the next call
starts a new pool. Between calls each rank puts back what a call may change in a process:

* the module globals of ``gradsync`` and of the test modules (``conftest``, ``test_*``),
  every name rebound, added or deleted, and the contents of their dicts, lists, sets and
  deques (a call that pins ``costmodel.profile_collectives`` leaves no trace), and the
  attributes of the classes they define (a method patched on ``Comm``); the functions of
  ``torch.distributed`` (a call that wraps ``dist.all_reduce``), not its data (its count of
  groups must go on);
* ``os.environ``, torch's and numpy's global random states, torch's intra-op threads, grad
  mode, default dtype and deterministic-algorithms flag, as a new process has them;
* the kernels of the caller (:func:`~gradsync.testing.distributed.caller_kernels`) are bound
  before each call, as in a new process.

The process groups a call made (``new_group``) are destroyed after it. A call that leaves the
default process group destroyed ends the pool. Calls that need a fresh process
go to the fresh launcher: another backend, CUDA, a progress watchdog, a ``timeout`` under
:data:`MIN_TIMEOUT_S` (a hang the caller expects to see quickly), or ``fresh=True``. What a pool
cannot restore (a C extension's state, a thread a call started and left running, the contents
of objects reached through a module global) stays: a test that leaves such state behind should
clean up after itself, or ask for ``fresh=True``.
"""

from __future__ import annotations

import collections
import contextlib
import importlib
import io
import math
import multiprocessing.connection as mpc
import os
import pkgutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gradsync import sparsegrad
from gradsync.testing import distributed as launcher
from gradsync.testing.distributed import DistributedError, caller_kernels, finish

__all__ = ["MIN_TIMEOUT_S", "RankPool", "pooled", "run_distributed"]

#: Calls with a shorter ``timeout`` go to fresh processes: the pool's group waits
#: :data:`GROUP_TIMEOUT_S` in a collective, so a hang shows only at the call's own deadline.
MIN_TIMEOUT_S = 60.0
GROUP_TIMEOUT_S = 900.0
#: At most this many pooled rank processes per launcher; the pool used least recently goes.
MAX_PROCESSES = 16

_MISSING = object()
_CONTAINERS = (dict, list, set, collections.deque)


def _watched(name: str) -> bool:
    """Module globals a pool puts back between calls."""
    return (name == "gradsync" or name.startswith("gradsync.") or name == "conftest"
            or name.startswith("test_") or name in ("torch.distributed",
                                                       "torch.distributed.distributed_c10d"))


class _Pristine:
    """What a rank process looked like before its first call, to put back after each."""

    def __init__(self) -> None:
        self.environ = dict(os.environ)
        self.rng = torch.get_rng_state()
        self.threads = torch.get_num_threads()
        self.dtype = torch.get_default_dtype()
        self.deterministic = torch.are_deterministic_algorithms_enabled()
        self.numpy = _numpy_state()
        self.modules: dict[str, tuple[Any, dict[str, Any], dict[str, Any]]] = {}
        self.classes: list[tuple[type, dict[str, Any]]] = []
        self.watch_new_modules()

    def watch_new_modules(self) -> None:
        """Record the globals of watched modules imported since (a call's module, imported
        when its function arrives, is recorded before the function runs)."""
        for name, mod in list(sys.modules.items()):
            if mod is None or name in self.modules or not _watched(name):
                continue
            names = dict(vars(mod))
            if name.startswith("torch."):  # its functions only: its counters must go on
                names = {k: v for k, v in names.items() if callable(v)}
                self.modules[name] = (mod, names, {})
                continue
            contents = {k: list(v) if type(v) is collections.deque else type(v)(v)
                        for k, v in names.items() if type(v) in _CONTAINERS}
            self.modules[name] = (mod, names, contents)
            self.classes += [(v, dict(vars(v))) for v in names.values()
                             if isinstance(v, type) and v.__module__ == name]

    def restore(self) -> None:
        for name, (mod, names, contents) in self.modules.items():
            now = vars(mod)
            for k in [k for k in now if k not in names and not name.startswith("torch.")]:
                del now[k]
            for k, v in names.items():
                if now.get(k, _MISSING) is not v:
                    now[k] = v
            for k, saved in contents.items():
                obj = names[k]
                if isinstance(obj, dict | set):
                    obj.clear()
                    obj.update(saved)
                elif isinstance(obj, list):
                    obj[:] = saved
                else:  # a deque (comm's kept works)
                    obj.clear()
                    obj.extend(saved)
        for cls, attrs in self.classes:  # a method patched on a class (Comm.all_gather_v)
            now = vars(cls)
            if now.keys() == attrs.keys() and all(now[k] is v for k, v in attrs.items()):
                continue
            for k in [k for k in now if k not in attrs]:
                delattr(cls, k)
            for k, v in attrs.items():
                if now.get(k, _MISSING) is not v:
                    setattr(cls, k, v)
        if os.environ != self.environ:
            os.environ.clear()
            os.environ.update(self.environ)
        torch.set_rng_state(self.rng)
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        torch.set_default_dtype(self.dtype)
        torch.use_deterministic_algorithms(self.deterministic)
        torch.set_grad_enabled(True)
        if self.numpy is not None:
            import numpy as np

            np.random.set_state(self.numpy)


def _numpy_state() -> Any:
    try:
        import numpy as np
    except ImportError:  # numpy is a dependency of gradsync; tolerate its absence here
        return None
    return np.random.get_state()


#: Modules a pooled rank does not import before its first call: the applications and the
#: integrations with Lightning, Accelerate and transformers, whose imports cost seconds (a
#: call that needs one imports it; its globals are recorded from the next call on).
_NOT_PRELOADED = ("gradsync.apps", "gradsync.lightning", "gradsync.accelerate",
                  "gradsync.transformers", "gradsync.integrations.lightning",
                  "gradsync.integrations.accelerate", "gradsync.integrations.transformers",
                  "gradsync.__main__")


def _import_library() -> None:
    """Import gradsync's library modules, so that their globals are recorded as imported,
    before any call could change them."""
    import gradsync

    for info in pkgutil.walk_packages(gradsync.__path__, "gradsync."):
        if info.name.startswith(_NOT_PRELOADED):
            continue
        with contextlib.suppress(Exception):  # an optional dependency missing, say
            importlib.import_module(info.name)


def _groups() -> set[Any]:
    """The process groups this process holds (the default one and those ``new_group`` made)."""
    from torch.distributed import distributed_c10d as c10d

    return set(c10d._world.pg_map)


def _destroy_groups_since(before: set[Any]) -> None:
    """Destroy the groups a call made (every ``GradSync`` makes one, and none destroys it): a
    pooled rank would otherwise keep each one's sockets and threads for the session."""
    for pg in _groups() - before:
        with contextlib.suppress(Exception):
            dist.destroy_process_group(pg)


def _serve(rank: int, world_size: int, init_method: str, conn: Any, parent: int) -> None:
    """A pooled rank: join the group, then run the calls that arrive until told to stop."""
    launcher.watch_launcher(parent)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(launcher.rank_threads(world_size))
    launcher.join_group("gloo", init_method, rank, world_size, timedelta(seconds=GROUP_TIMEOUT_S))
    _import_library()
    pristine = _Pristine()
    while True:
        try:
            task = conn.recv_bytes()
        except EOFError:
            break
        if not task:  # the pool closes
            break
        groups = _groups()
        try:
            fn, args, kwargs, kernels = torch.load(io.BytesIO(task), weights_only=False)
            pristine.watch_new_modules()
            sparsegrad.bind(kernels)
            out = fn(rank, world_size, *args, **kwargs)
            buf = io.BytesIO()
            torch.save(out, buf)
            reply: tuple[bool, Any] = (True, buf.getvalue())
        except BaseException:  # everything, SystemExit included, must reach the parent
            reply = (False, traceback.format_exc())
        healthy = dist.is_initialized() and dist.get_world_size() == world_size
        if healthy:
            _destroy_groups_since(groups)
        pristine.restore()
        conn.send((*reply, healthy))
        if not healthy:
            break
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


class RankPool:
    """``world_size`` live gloo ranks on loopback, one process group, calls run one at a time
    (module docstring). ``run`` raises as :func:`run_distributed` does; after a failure the
    pool is closed and ``alive`` is false."""

    def __init__(self, world_size: int) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.calls = 0
        ctx = launcher.start_context()
        self._tmp = tempfile.TemporaryDirectory(prefix="gradsync-pool-")
        init_method = f"file://{os.path.join(self._tmp.name, 'store')}"
        self._conns, self._procs = [], []
        for r in range(world_size):
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=_serve, args=(r, world_size, init_method, theirs,
                                                 os.getpid()), daemon=True)
            p.start()
            theirs.close()
            self._conns.append(mine)
            self._procs.append(p)

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def run(self, fn: Callable[..., Any], args: tuple, kwargs: dict,
            timeout: float | None) -> list[Any]:
        """``fn(rank, world_size, *args, **kwargs)`` on every rank; results in rank order."""
        if not self.alive:
            raise RuntimeError("RankPool.run: the pool is closed")
        buf = io.BytesIO()
        torch.save((fn, args, kwargs, caller_kernels()), buf)
        task = buf.getvalue()
        self.calls += 1
        try:
            for c in self._conns:
                c.send_bytes(task)
        except (BrokenPipeError, OSError):
            self.close()
            raise
        done, died, raised, healthy = {}, [], [], True
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        stop_at = deadline
        waiting = {c: r for r, c in enumerate(self._conns)}
        sentinels = {p.sentinel: r for r, p in enumerate(self._procs)}
        # until every rank has an outcome: a rank whose pipe closed is waited for until its
        # sentinel says it died (else a peer's error, raised because it died, would be
        # reported as the cause when that pipe closed first)
        while len(done) < self.world_size and time.monotonic() < stop_at:
            ready = mpc.wait([*waiting, *(s for s, r in sentinels.items() if r not in done)],
                             timeout=min(1.0, max(0.0, stop_at - time.monotonic())))
            for obj in ready:
                if obj in waiting:
                    r = waiting.pop(obj)
                    try:
                        ok, payload, up = obj.recv()
                    except (EOFError, OSError):  # it died: its sentinel says so, shortly
                        stop_at = min(stop_at, time.monotonic() + launcher.GRACE_SECONDS)
                        continue
                    healthy &= bool(up)
                    if ok:
                        done[r] = torch.load(io.BytesIO(payload), weights_only=False)
                    else:
                        done[r] = None
                        raised.append(DistributedError(r, payload))
                        stop_at = min(stop_at, time.monotonic() + launcher.GRACE_SECONDS)
                elif obj in sentinels:
                    r = sentinels[obj]
                    if r in done:
                        continue
                    conn = self._conns[r]
                    if conn in waiting and conn.poll(0.5):  # its last words, if any
                        continue
                    waiting.pop(conn, None)
                    done[r] = None
                    code = self._procs[r].exitcode
                    died.append(DistributedError(r, f"process exited with code {code} without "
                                                    f"a result"))
                    stop_at = min(stop_at, time.monotonic() + launcher.GRACE_SECONDS)
        if died or raised or waiting or not healthy:
            self.close()  # a peer may be blocked in a collective, or the group is gone
        return finish(done, died, raised, self.world_size, timeout)

    def close(self) -> None:
        """Stop the ranks (politely, then by force) and remove the rendezvous folder."""
        for c in self._conns:
            with contextlib.suppress(Exception):
                c.send_bytes(b"")
        for p in self._procs:
            p.join(timeout=1.0)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=2.0)
        for c in self._conns:
            c.close()
        self._conns, self._procs = [], []
        self._tmp.cleanup()


class _Pools:
    """The live pools of this process, by world size, least recently used first."""

    def __init__(self) -> None:
        self.by_size: dict[int, RankPool] = {}

    def get(self, world_size: int) -> RankPool:
        pool = self.by_size.pop(world_size, None)
        if pool is None or not pool.alive:
            if pool is not None:
                pool.close()
            while self.by_size and (sum(p.world_size for p in self.by_size.values())
                                    + world_size > MAX_PROCESSES):
                self.by_size.pop(next(iter(self.by_size))).close()
            pool = RankPool(world_size)
        self.by_size[world_size] = pool  # most recently used last
        return pool

    def close(self) -> None:
        while self.by_size:
            self.by_size.popitem()[1].close()


_ACTIVE: list[_Pools] = []  # the pools of the innermost pooled() block, if any


@contextlib.contextmanager
def pooled() -> Iterator[None]:
    """Within this block :func:`run_distributed` hands eligible calls to reused ranks; the
    pools are closed at its end."""
    pools = _Pools()
    _ACTIVE.append(pools)
    try:
        yield
    finally:
        _ACTIVE.remove(pools)
        pools.close()


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any,
                    timeout: float | None = 120.0, backend: str = "gloo",
                    cuda: bool | None = None, progress_timeout: float | None = None,
                    fresh: bool = False, **kwargs: Any) -> list[Any]:
    """:func:`gradsync.testing.distributed.run_distributed`, on reused ranks inside
    :func:`pooled` when the call allows it (module docstring); ``fresh=True`` asks for new
    processes."""
    eligible = (_ACTIVE and not fresh and backend == "gloo" and not cuda
                and progress_timeout is None and timeout is not None
                and timeout >= MIN_TIMEOUT_S and world_size >= 1)
    if not eligible:
        return launcher.run_distributed(fn, world_size, *args, timeout=timeout,
                                        backend=backend, cuda=cuda,
                                        progress_timeout=progress_timeout, **kwargs)
    return _ACTIVE[-1].get(world_size).run(fn, args, kwargs, timeout)
