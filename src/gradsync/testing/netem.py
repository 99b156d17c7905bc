"""Emulated slow links: one network namespace per rank, a bridge, ``tc tbf`` on every veth.

How gradsync measures on a slow link: the link is emulated with network namespaces, veth pairs
and ``tc … tbf`` (needs root); without root the benchmark says so and runs on loopback.

Topology of ``shaped_world(P, bandwidth)``::

    ns <tag>-r0  [veth <s>r0a 10.231.77.1] ──┐
    ns <tag>-r1  [veth <s>r1a 10.231.77.2] ──┤  veth <s>r*b ── bridge <s>br   (ns <tag>-br)
    …                                        ┘

Every veth is shaped on egress at both ends (``tbf rate <bandwidth>``): the rank's end limits
what the rank sends, the bridge's end what it receives, so each rank has a full-duplex link of
``bandwidth`` to a non-blocking switch — the α-β link model of the papers with β = 1/bandwidth.

Latency. ``tbf``'s ``latency`` only bounds how long a packet may wait in the shaper's queue (it
sets the queue length); it adds no propagation delay. ``netem``, the qdisc that adds delay, is
not available on the machines this project runs on, and a user-space delay would need a proxy
in front of every gloo connection. So **propagation delay is not emulated**: the ``latency``
argument here is tbf's queueing bound and nothing else, and shaped runs model bandwidth-bound
links with the (sub-millisecond) α of a veth pair.

Lifetime. Namespaces are named ``<tag>-…`` = ``gsne-<pid>-<n>-…`` after the creating process
(interfaces, created inside them, ``<s>`` = ``gs<pid % 10000>n<n % 100>``). They are removed
when the ``with`` block exits — normally, by an exception, by Ctrl-C (``KeyboardInterrupt``) or
by SIGTERM (turned into ``SystemExit`` while the block runs) — and by an ``atexit`` hook as a
last resort. A process killed with SIGKILL cannot clean up; the next ``shaped_world`` removes
every ``gsne-<pid>-…`` namespace whose ``<pid>`` is no longer running.

``run_shaped(fn, P, …)`` runs ``fn(rank, P, …)`` like :func:`gradsync.testing.run_distributed`,
but each rank is a separate ``ip netns exec <ns> python -m gradsync.testing._netem_worker``
process on its shaped link; each rank exits within a second once the process that launched
it is gone, so a launcher killed with SIGKILL leaves no rank running (its namespaces are then
removed as above). Without root, ``ip`` or ``tc`` (or when the namespaces cannot be
created) it warns in one line and runs on loopback; the returned :class:`ShapedResults` says
which happened.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import math
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gradsync.testing.distributed import DistributedError, finish, rank_threads, run_distributed

__all__ = [
    "NetemUnavailable",
    "ShapedResults",
    "ShapedWorld",
    "cleanup_stale",
    "netem_available",
    "parse_bandwidth",
    "parse_size",
    "parse_time",
    "run_shaped",
    "shaped_world",
]

log = logging.getLogger(__name__)

PREFIX = "gsne"  # every namespace this module creates is named gsne-<pid>-<n>-…
SUBNET = "10.231.77"  # private /24, used only inside our own namespaces
PORT = 29517  # rendezvous port on rank 0's address; the namespace is private, so no clash
MAX_WORLD = 250
_GRACE_SECONDS = 5.0  # how long peers get to exit on their own after one rank failed
_counter = itertools.count()


class NetemUnavailable(RuntimeError):
    """Shaped links cannot be set up here (not root, no ``ip``/``tc``, or a command failed)."""


# -- parsing --------------------------------------------------------------------------------
_NUM = r"([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)"
_RATE_UNITS = {  # tc(8) semantics: SI prefixes for "bit", binary for "ibit"
    "": 1, "bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12,
    "kibit": 2**10, "mibit": 2**20, "gibit": 2**30, "tibit": 2**40,
}
_SIZE_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 2**10, "kib": 2**10, "m": 2**20, "mb": 2**20,
               "mib": 2**20}
_TIME_UNITS = {"s": 1.0, "sec": 1.0, "ms": 1e-3, "msec": 1e-3, "us": 1e-6, "usec": 1e-6}


def _parse(value: Any, units: dict[str, float], what: str, hint: str) -> float:
    if isinstance(value, bool):
        raise ValueError(f"{what}: expected a number or a string like {hint}, got {value!r}")
    if isinstance(value, int | float):
        x = float(value)
    elif isinstance(value, str):
        m = re.fullmatch(_NUM + r"\s*([a-zA-Z]*)", value.strip())
        if m is None:
            raise ValueError(f"{what}: cannot parse {value!r}; expected e.g. {hint}")
        unit = m.group(2).lower()
        if unit.endswith("bps"):
            raise ValueError(
                f"{what}: {value!r} is ambiguous (tc reads '{unit}' as BYTES per second); "
                f"write bits per second, e.g. {hint}"
            )
        if unit not in units:
            raise ValueError(
                f"{what}: unknown unit {m.group(2)!r} in {value!r}; "
                f"use one of {', '.join(u for u in units if u)}"
            )
        x = float(m.group(1)) * units[unit]
    else:
        raise ValueError(f"{what}: expected a number or a string like {hint}, got {value!r}")
    if not math.isfinite(x) or x <= 0:
        raise ValueError(f"{what}: must be positive and finite, got {value!r}")
    return x


def parse_bandwidth(value: str | float) -> int:
    """Bits per second of ``"100mbit"``, ``"1gbit"``, ``"500kbit"``, ``"2.5mbit"``, ``1e8``.

    Units follow tc(8): ``bit``/``kbit``/``mbit``/``gbit``/``tbit`` (powers of 1000) and
    ``kibit``/``mibit``/… (powers of 1024); a bare number is bits per second. The ``…bps``
    forms (which tc reads as *bytes* per second) are rejected as ambiguous.
    """
    bits = _parse(value, _RATE_UNITS, "bandwidth", "'100mbit', '1gbit' or '500kbit'")
    if bits < 8:
        raise ValueError(f"bandwidth: {value!r} is below 8 bit/s")
    return round(bits)


def parse_size(value: str | int) -> int:
    """Bytes of ``32768``, ``"32kb"``, ``"64k"``, ``"1mb"`` (tc(8): k = 1024 bytes)."""
    return round(_parse(value, _SIZE_UNITS, "size", "'32kb' or 65536"))


def parse_time(value: str | float) -> float:
    """Seconds of ``"50ms"``, ``"1s"``, ``"500us"``; a bare number is seconds."""
    if isinstance(value, str) and re.fullmatch(_NUM, value.strip()):
        value = float(value)
    return _parse(value, _TIME_UNITS, "time", "'50ms' or '1s'")


# -- availability ---------------------------------------------------------------------------
def netem_available() -> str | None:
    """``None`` when shaped links can be tried here, else the reason in one line."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "not root (network namespaces and tc need root)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found on PATH"
    return None


def _sh(*cmd: str) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise NetemUnavailable(f"`{' '.join(cmd)}` failed: {r.stderr.strip() or r.returncode}")
    return r.stdout


def _list_namespaces() -> list[str]:
    return [line.split()[0] for line in _sh("ip", "netns", "list").splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale() -> list[str]:
    """Delete ``gsne-<pid>-…`` namespaces whose creating process is gone; return their names."""
    removed = []
    for ns in _list_namespaces():
        m = re.fullmatch(PREFIX + r"-(\d+)-\d+-\w+", ns)
        if m and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
            with contextlib.suppress(NetemUnavailable):
                _sh("ip", "netns", "del", ns)
                removed.append(ns)
    if removed:
        log.info("gradsync.testing.netem: removed %d stale namespaces: %s", len(removed), removed)
    return removed


# -- the shaped world -----------------------------------------------------------------------
@dataclass
class ShapedWorld:
    """A set of namespaces, one per rank, linked by tbf-shaped veths to a bridge."""

    world_size: int
    bandwidth_bps: int
    latency_s: float
    burst_bytes: int
    tag: str
    namespaces: list[str] = field(default_factory=list)  # rank 0 … P−1
    ifnames: list[str] = field(default_factory=list)  # the rank-side veth of each rank
    addresses: list[str] = field(default_factory=list)
    bridge_ns: str = ""
    _created: list[str] = field(default_factory=list)
    _closed: bool = False

    @property
    def master_addr(self) -> str:
        return self.addresses[0]

    def _setup(self) -> None:
        # Interface names must stay ≤ 15 characters: gs<pid % 10000>n<n % 100>r<rank>a|b|br.
        pid, n = self.tag.split("-")[1:3]
        short = f"gs{int(pid) % 10000}n{int(n) % 100}"
        self.bridge_ns = f"{self.tag}-br"
        bridge = f"{short}br"
        tbf = ["tbf", "rate", f"{self.bandwidth_bps}bit", "burst", str(self.burst_bytes),
               "latency", f"{max(1, round(self.latency_s * 1e6))}us"]
        _sh("ip", "netns", "add", self.bridge_ns)
        self._created.append(self.bridge_ns)
        _sh("ip", "-n", self.bridge_ns, "link", "add", bridge, "type", "bridge")
        _sh("ip", "-n", self.bridge_ns, "link", "set", bridge, "up")
        for r in range(self.world_size):
            ns, a, b = f"{self.tag}-r{r}", f"{short}r{r}a", f"{short}r{r}b"
            addr = f"{SUBNET}.{r + 1}"
            _sh("ip", "netns", "add", ns)
            self._created.append(ns)
            # Created directly inside the namespaces: the names never exist in the root one.
            _sh("ip", "-n", ns, "link", "add", a, "type", "veth", "peer", "name", b,
                "netns", self.bridge_ns)
            _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", a)
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            _sh("ip", "-n", ns, "link", "set", a, "up")
            _sh("ip", "-n", self.bridge_ns, "link", "set", b, "master", bridge)
            _sh("ip", "-n", self.bridge_ns, "link", "set", b, "up")
            _sh("tc", "-n", ns, "qdisc", "add", "dev", a, "root", *tbf)  # rank → switch
            _sh("tc", "-n", self.bridge_ns, "qdisc", "add", "dev", b, "root", *tbf)  # → rank
            self.namespaces.append(ns)
            self.ifnames.append(a)
            self.addresses.append(addr)

    def teardown(self) -> None:
        """Delete every namespace (and with it every veth and the bridge); idempotent."""
        if self._closed:
            return
        self._closed = True
        # A second Ctrl-C or SIGTERM must not cut the clean-up short: defer them until it is done.
        main = threading.current_thread() is threading.main_thread()
        deferred = {signal.SIGINT, signal.SIGTERM}
        if main:
            signal.pthread_sigmask(signal.SIG_BLOCK, deferred)
        try:
            for ns in reversed(self._created):
                with contextlib.suppress(Exception):
                    _sh("ip", "netns", "del", ns)
            self._created.clear()
        finally:
            if main:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, deferred)

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 120.0,
            **kwargs: Any) -> list[Any]:
        """Run ``fn(rank, P, *args, **kwargs)`` on the shaped ranks; see :func:`run_shaped`."""
        if self._closed:
            raise ValueError("this shaped world has been torn down")
        return _run_in_namespaces(self, fn, args, kwargs, timeout)


@contextlib.contextmanager
def _teardown_on_signals(teardown: Callable[[], None]) -> Iterator[None]:
    """SIGTERM → ``SystemExit`` inside the block (SIGINT already raises); ``atexit`` backstop.

    A SIGTERM handler the program installed itself is left alone (it decides how to exit;
    ``atexit`` still runs if it exits through Python).
    """
    atexit.register(teardown)
    previous = None
    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL):
        def on_term(signum: int, frame: Any) -> None:
            raise SystemExit(128 + signum)

        with contextlib.suppress(ValueError, OSError):
            previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        atexit.unregister(teardown)


@contextlib.contextmanager
def shaped_world(
    world_size: int,
    bandwidth: str | float = "100mbit",
    latency: str | float | None = None,
    burst: str | int | None = None,
) -> Iterator[ShapedWorld]:
    """Create ``world_size`` namespaces on tbf-shaped links; delete them on exit.

    ``bandwidth`` per link and direction (:func:`parse_bandwidth`). ``latency`` is tbf's
    queueing bound (default 50 ms) — **not** a propagation delay, which is not emulated (see
    the module docstring). ``burst`` is tbf's bucket in bytes (default: 4 ms of traffic, at
    least 32 KiB). Raises :class:`NetemUnavailable` when this machine cannot do it.
    """
    if not isinstance(world_size, int) or not 1 <= world_size <= MAX_WORLD:
        raise ValueError(f"world_size must be an int in [1, {MAX_WORLD}], got {world_size!r}")
    bps = parse_bandwidth(bandwidth)
    lat = 0.05 if latency is None else parse_time(latency)
    b = max(32 * 1024, round(bps / 8 * 0.004)) if burst is None else parse_size(burst)
    reason = netem_available()
    if reason is not None:
        raise NetemUnavailable(reason)
    cleanup_stale()
    world = ShapedWorld(world_size, bps, lat, b, tag=f"{PREFIX}-{os.getpid()}-{next(_counter)}")
    with _teardown_on_signals(world.teardown):
        try:
            world._setup()
            yield world
        finally:
            world.teardown()


# -- running ranks in the namespaces --------------------------------------------------------
class ShapedResults(list):
    """Per-rank results in rank order (a ``list``) plus how they were obtained.

    ``shaped`` is True when the ranks ran on tbf-shaped links, False when they fell back to
    loopback; ``reason`` says why in that case; ``bandwidth_bps`` is the configured rate.
    """

    def __init__(self, results: list[Any], *, shaped: bool, bandwidth_bps: int,
                 reason: str | None = None) -> None:
        super().__init__(results)
        self.shaped = shaped
        self.bandwidth_bps = bandwidth_bps
        self.reason = reason


def run_shaped(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    bandwidth: str | float = "100mbit",
    timeout: float = 120.0,
    latency: str | float | None = None,
    burst: str | int | None = None,
    fallback: bool = True,
    **kwargs: Any,
) -> ShapedResults:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ranks joined by shaped links.

    Same semantics as :func:`gradsync.testing.run_distributed`: results in rank order, a rank's
    exception raised as :class:`~gradsync.testing.DistributedError` with its traceback, hung
    ranks as :class:`~gradsync.testing.DistributedTimeout` after every process was reaped.
    Each rank is its own ``ip netns exec`` process with gloo bound to its veth
    (``GLOO_SOCKET_IFNAME``) and a TCP rendezvous on rank 0's address. ``fn`` must be a
    module-level function of an importable module (it is pickled by reference).

    When shaped links are unavailable it warns in one line and runs ``run_distributed`` on
    loopback (``fallback=False`` raises :class:`NetemUnavailable` instead); the result's
    ``shaped`` attribute says which happened.
    """
    if timeout <= 0:
        raise ValueError(f"timeout must be > 0, got {timeout}")
    bps = parse_bandwidth(bandwidth)
    _check_picklable(fn)
    reason = netem_available()
    if reason is None:
        try:
            with shaped_world(world_size, bps, latency=latency, burst=burst) as world:
                out = world.run(fn, *args, timeout=timeout, **kwargs)
            return ShapedResults(out, shaped=True, bandwidth_bps=bps)
        except NetemUnavailable as e:
            reason = str(e)
    if not fallback:
        raise NetemUnavailable(reason)
    warnings.warn(f"gradsync.testing.netem: no shaped links ({reason}); running on loopback "
                  "instead",
                  RuntimeWarning, stacklevel=2)
    out = run_distributed(fn, world_size, *args, timeout=timeout, **kwargs)
    return ShapedResults(out, shaped=False, bandwidth_bps=bps, reason=reason)


def _check_picklable(fn: Callable[..., Any]) -> None:
    if getattr(fn, "__module__", None) == "__main__" or "<locals>" in getattr(
            fn, "__qualname__", ""):
        raise ValueError(
            f"run_shaped: fn must be a module-level function of an importable module "
            f"(it is pickled by reference into another process), got {fn!r}"
        )


def _src_root() -> str:
    import gradsync

    return str(Path(gradsync.__file__).resolve().parent.parent)


def _run_in_namespaces(world: ShapedWorld, fn: Callable[..., Any], args: tuple, kwargs: dict,
                       timeout: float) -> list[Any]:
    p = world.world_size
    threads = rank_threads(p)
    with tempfile.TemporaryDirectory(prefix="gradsync-netem-") as tmp:
        procs: list[subprocess.Popen] = []
        logs = []
        results = [os.path.join(tmp, f"result{r}.pt") for r in range(p)]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([_src_root(), env.get("PYTHONPATH", "")]).rstrip(
            os.pathsep)
        env.update(OMP_NUM_THREADS=str(threads), WORLD_SIZE=str(p), LOCAL_WORLD_SIZE=str(p),
                   MASTER_ADDR=world.master_addr, MASTER_PORT=str(PORT))
        try:
            for r in range(p):
                spec = os.path.join(tmp, f"spec{r}.pkl")
                with open(spec, "wb") as f:
                    pickle.dump({
                        "sys_path": list(sys.path), "rank": r, "world_size": p,
                        "init_method": f"tcp://{world.master_addr}:{PORT}",
                        "timeout": timeout, "threads": threads, "result": results[r],
                        "launcher": os.getpid(),
                    }, f)
                    try:
                        pickle.dump((fn, args, kwargs), f)
                    except Exception as e:
                        raise ValueError(f"run_shaped: cannot pickle fn/args: {e}") from e
                rank_env = dict(env, RANK=str(r), LOCAL_RANK=str(r),
                                GLOO_SOCKET_IFNAME=world.ifnames[r])
                log_f = open(os.path.join(tmp, f"stderr{r}.txt"), "wb")  # noqa: SIM115
                logs.append(log_f)
                procs.append(subprocess.Popen(
                    ["ip", "netns", "exec", world.namespaces[r], sys.executable, "-m",
                     "gradsync.testing._netem_worker", spec],
                    env=rank_env, stderr=log_f, stdin=subprocess.DEVNULL,
                    start_new_session=True,
                ))
            return _collect(procs, results, logs, timeout)
        finally:
            _reap(procs)
            for f in logs:
                f.close()


def _collect(procs: list[subprocess.Popen], results: list[str], logs: list, timeout: float
             ) -> list[Any]:
    p = len(procs)
    deadline = time.monotonic() + timeout
    done: dict[int, Any] = {}
    raised: list[DistributedError] = []
    died: list[DistributedError] = []
    stop_at = deadline

    def fail(err: DistributedError, into: list[DistributedError]) -> None:
        nonlocal stop_at
        into.append(err)
        stop_at = min(stop_at, time.monotonic() + _GRACE_SECONDS)

    def receive(r: int) -> bool:
        if not os.path.exists(results[r]):
            return False
        ok, payload = torch.load(results[r], weights_only=False)
        done[r] = payload if ok else None
        if not ok:
            fail(DistributedError(r, payload), raised)
        return True

    def arrived(r: int) -> int | None:
        with contextlib.suppress(OSError):
            return os.stat(results[r]).st_mtime_ns
        return None

    while len(done) < p and time.monotonic() < stop_at:
        progressed = False
        # Results in the order they were written, so the root cause (the first rank to fail)
        # comes before peers that failed because it went away.
        ready = sorted((t, r) for r in range(p) if r not in done and (t := arrived(r)) is not None)
        for _, r in ready:
            progressed = receive(r) or progressed
        for r in range(p):
            if r in done:
                continue
            if procs[r].poll() is not None and not receive(r):
                done[r] = None
                fail(DistributedError(r, f"process exited with code {procs[r].returncode} "
                                         f"without a result{_tail(logs[r])}"), died)
                progressed = True
        if not progressed:
            time.sleep(0.05)
    return finish(done, died, raised, p, timeout)


def _tail(log_f: Any, n: int = 2000) -> str:
    try:
        log_f.flush()
        text = Path(log_f.name).read_bytes()[-n:].decode(errors="replace").strip()
    except OSError:
        return ""
    return f"; stderr:\n{text}" if text else ""


def _reap(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=0.2 if proc.poll() is None else 1.0)
    for sig, wait in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 2.0)):
        alive = [proc for proc in procs if proc.poll() is None]
        for proc in alive:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)  # its own session: the rank and anything it started
        for proc in alive:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=wait)
