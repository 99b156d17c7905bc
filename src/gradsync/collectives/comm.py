"""A thin accounting wrapper over ``torch.distributed``: bytes are counted at the call.

Every collective in gradsync talks to the network only through :class:`Comm`, so the bytes it
reports are those it handed to torch.distributed, not an estimate from a formula elsewhere.

Accounting convention (per rank, payload bytes; headers of the transport are not counted):

* point-to-point ``send``/``recv``/``isend``/``irecv``: exactly the tensor's bytes, 1 message.
* ``all_reduce`` of B bytes: the bandwidth-optimal ring, ``2·(P−1)/P·B`` sent and received in
  ``2(P−1)`` messages — the "Dense" row of Ok-Topk Table 1 (gloo's own algorithm may differ).
* ``reduce_scatter`` of a P·B buffer: ring, ``(P−1)·B`` sent and received, ``P−1`` messages.
* ``all_gather`` of B bytes per rank: ``(P−1)·B`` sent and received. On gloo as rounds of
  point-to-point messages straight into the output's rows (:meth:`Comm._gather_rounds`, also
  :meth:`Comm.all_gather_v`'s and :meth:`Comm.all_gather_bounded`'s), one message a round:
  gloo's own all-gather took 1.3–3.8× a ring of such messages at P = 2, 1.0–2.3× at P = 4 and
  1.0–1.8× at P = 8 (8 B to 1 MiB per rank, in lock-step; speed.md, "One round fewer"). A
  step pays each gloo call 0.3–1 ms at P = 2 and 1–5 ms at P = 4 on two cores whatever its
  bytes (docs/results/rounds-cpu.md), so blocks take Bruck's doubling, ⌈log2 P⌉ rounds, where
  it saves rounds: P ≥ 4 (at P ≤ 3 both take P − 1), unless their mean reaches
  :data:`LONG_BLOCK_BYTES` per round saved (1 MiB at P = 4, 4 MiB at P = 8). Such blocks go
  round the ring, P − 1 rounds of one block each: the doubling's longer messages and the
  copies of its wrapped spans grow with the blocks, the rounds it saves do not (speed.md,
  "Long blocks go round the ring"). The choice depends only on sizes every rank knows, so
  every rank makes the same one. NCCL keeps its own (a ring: ``P−1`` messages counted).
* ``all_gather_v`` (variable sizes): the same rounds of exact-size messages with no padding:
  rank r receives every other rank's bytes, ``Σ_{j≠r} B_j``, and sends, in the doubling's round
  of distance d, the min(d, P − d) blocks it holds from its own on, or in the ring every block
  but rank r + 1's (the group's totals are equal). The counts themselves travel in a small
  ``all_gather`` that is counted too.
* ``broadcast`` of B bytes from ``src``: a binomial tree; each non-root receives B once and sends
  B to each of its children.
* ``sendrecv_bounded``: a receive into a buffer longer than its message (gloo's; NCCL needs
  the sender's count, :meth:`Comm.bounded`) counts the length the message gives of itself (its
  header, read by the caller's ``size_of``), not the buffer's: a message whose length travels
  inside it costs one round, where announcing the length first costs two.

Use ``Comm.size == 1`` fast paths freely: with one rank nothing is sent and nothing is counted.

Devices (docs/architecture.md, "GPU path"). ``Comm`` reads the group's backend
(``dist.get_backend``) and knows which device each backend takes:

* ``Comm.device`` is where control tensors (counts, headers, flags) live: the current CUDA
  device for NCCL, else the CPU (gloo; and ``cpu:gloo,cuda:nccl`` groups, whose gloo half moves
  small CPU words without a device sync).
* Payloads stay on the caller's device. When the backend cannot take a tensor where it is —
  a CPU tensor on an NCCL group, or a CUDA tensor on gloo for anything but ``all_reduce`` and
  ``broadcast`` (gloo has no CUDA send/recv, and its CUDA all-gather/reduce-scatter are not
  guaranteed) — ``Comm`` stages it through the other device and copies the result back, so
  every collective runs unchanged on either. Staging copies are not wire bytes and are not
  counted.
* NCCL has no bitwise reduction: ``all_reduce(op=BOR/BAND/BXOR)`` raises ``ValueError`` there
  (:meth:`Comm.reduces_bitwise`); LHC/TAGC pick an OR that NCCL has (collectives/lhc.py).
* Point-to-point on NCCL is grouped: a receive and a send between the same two ranks share
  one NCCL stream, so posted one by one (``irecv`` then ``isend`` on both sides) each waits
  for the other forever. So on NCCL ``isend``/``irecv`` only queue their message, and the
  queue goes out as one ``batch_isend_irecv`` when any of their handles is waited on or the
  ``Comm`` does anything else (``sendrecv`` is such a pair) — every handle must be waited on,
  as on any backend. Blocking ``send``/``recv`` go out at once.

Testing without a GPU: ``GRADSYNC_EMULATE_BACKEND`` in a process's environment
(:data:`EMULATE_BACKEND_ENV`, read by every ``Comm`` as it is made) maps devices to backends as
the string says while gloo still moves the bytes —
``"cpu:nccl"`` runs NCCL's code paths (no bitwise reduction, queued point-to-point) on CPU
tensors, ``"cuda:gloo"`` stages every CPU tensor through a copy as a CPU tensor on an NCCL
group would be. ``tests/test_cuda.py`` runs the collectives under both.

Exit safety. Every ``torch.autograd.backward`` of torch 2.13 stashes a Python object (a
``contextvars.Context``) in the thread's C++ thread-local state, and a gloo work captures that
state when it is created. A collective issued inside the backward pass (the DDP comm hook,
FSDP's reduce-scatter) therefore holds a Python object, and when gloo's worker thread drops
the last reference to a finished work it must take the GIL. If that happens while the
interpreter shuts down, the worker thread is killed inside a C++ destructor and the process
aborts with "terminate called without an active exception". ``Comm`` issues every call with
that object lifted from the thread-local state (:func:`outside_backward`) and puts it back
afterwards, so its works hold no Python object (tests/test_exit.py).

The tensors a work holds are Python tensors, and dropping a work's last reference frees them,
which needs the GIL as well. gloo's worker thread drops its reference a moment after the work
completes, so if the caller's reference went first the worker thread frees the tensors. So
``Comm`` issues every call with ``async_op=True``, waits, and keeps the last
``KEPT_WORKS`` works of the process (:func:`_kept`): the training thread frees them, later.
An ``atexit`` handler keeps the last ones alive past the interpreter's exit, so no work is
freed by gloo's thread while the interpreter shuts down. torch's object collectives
(``dist.all_gather_object``, ``dist.gather_object``) wait without handing out their work, so
gloo's thread may free it: tests/test_lightning.py's job aborted at exit in 4 of 34 launches
run three at a time, gloo's worker thread freeing an all-gather's tensors in
``Py_FinalizeEx``. :func:`exchange_objects` replaces them for gradsync's own calls (0 of 84).

A future's ``then`` callback runs on gloo's worker thread, which drops it afterwards, a moment
after the future completed. A callback must therefore not own a process group: if the caller
has meanwhile let go of its own references and called ``destroy_process_group()``, the group is
freed on its own worker thread, which joins itself and aborts the process ("Resource deadlock
avoided"; the DDP hook's dense buckets hold their state weakly, tests/test_exit.py).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import ctypes
import functools
import itertools
import os
import pickle
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "EMULATE_BACKEND_ENV",
    "Comm",
    "CommStats",
    "backend_devices",
    "exchange_objects",
    "gather_rounds",
    "outside_backward",
    "ring_allreduce_bytes",
]

_TLS_KEY = "context"  # what torch.autograd.graph._engine_run_backward stashes


@contextlib.contextmanager
def outside_backward() -> Iterator[None]:
    """Run a ``torch.distributed`` call without the Python object that the backward pass
    keeps in the C++ thread-local state, then put it back (module docstring, "Exit safety").
    A no-op outside a backward pass and on a torch without that state."""
    C = torch._C
    if not (hasattr(C, "_is_key_in_tls") and C._is_key_in_tls(_TLS_KEY)):
        yield
        return
    saved = C._get_obj_in_tls(_TLS_KEY)
    C._remove_obj_from_tls(_TLS_KEY)
    try:
        yield
    finally:
        C._stash_obj_in_tls(_TLS_KEY, saved)


KEPT_WORKS = 8
_KEPT: collections.deque = collections.deque(maxlen=KEPT_WORKS)


def _kept(work: dist.Work | None) -> dist.Work | None:
    """Keep one of the last ``KEPT_WORKS`` works alive (module docstring, "Exit safety")."""
    if work is not None:
        _KEPT.append(work)
    return work


@atexit.register
def _outlive_interpreter() -> None:
    """The last works outlive the interpreter: their tensors are never freed during its
    shutdown, where a gloo thread dropping the last reference would abort the process."""
    for work in _KEPT:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(work))


def all_gather_single(out: torch.Tensor, t: torch.Tensor, group=None,
                      async_op: bool = False) -> dist.Work | None:
    """``dist.all_gather_single`` where torch has it (2.13), else the same call under its
    older name ``all_gather_into_tensor`` (torch 2.11, the CUDA image ``make gpu-check`` has
    run on). Looked up at each call: the newer name first, so 2.13 gives no deprecation
    warning."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, t, group=group, async_op=async_op)


def reduce_scatter_single(out: torch.Tensor, inp: torch.Tensor,
                          op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM, group=None,
                          async_op: bool = False) -> dist.Work | None:
    """``dist.reduce_scatter_single`` (torch 2.13), else ``reduce_scatter_tensor`` (2.11)."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, inp, op=op, group=group, async_op=async_op)


def _waited(work: dist.Work | None) -> None:
    """Wait for a call issued with ``async_op=True`` and keep its work (:func:`_kept`)."""
    if work is not None:
        _kept(work).wait()


def exchange_objects(obj: Any, group=None, dst: int | None = None) -> list[Any] | None:
    """Every rank's picklable ``obj`` in group-rank order: on every rank (``dst=None``, as
    ``dist.all_gather_object``) or on group rank ``dst`` only, the others getting ``None`` (as
    ``dist.gather_object``). A collective: every rank of ``group`` calls it alike.

    The pickles travel on the group's control device (:attr:`Comm.device`) as one all-gather of
    their lengths and one all-gather (or gather) of the bytes padded to the longest, each issued
    asynchronously, outside the backward's thread-local state, waited and kept (module
    docstring, "Exit safety"). Not counted in any :class:`CommStats`: like the torch calls it
    replaces, it is set-up and checkpoint traffic, not a step's. It unpickles what the ranks
    sent: for a job's own ranks."""
    world = dist.get_world_size(group)
    if world == 1:
        return [obj]
    dev = Comm(group).device
    blob = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    sizes = torch.empty(world, dtype=torch.int64, device=dev)
    with outside_backward():
        _waited(all_gather_single(sizes, torch.tensor([blob.numel()], device=dev), group=group,
                                  async_op=True))
        lengths = sizes.tolist()
        mine = torch.zeros(max(lengths), dtype=torch.uint8, device=dev)
        mine[:blob.numel()] = blob.to(dev)
        if dst is None:
            out = torch.empty(world * mine.numel(), dtype=torch.uint8, device=dev)
            _waited(all_gather_single(out, mine, group=group, async_op=True))
        else:
            me = dist.get_rank(group)
            out = (torch.empty(world * mine.numel(), dtype=torch.uint8, device=dev)
                   if me == dst else None)
            _waited(dist.gather(mine, None if out is None else list(out.view(world, -1)),
                                group=group, group_dst=dst, async_op=True))
            if out is None:
                return None
    rows = out.cpu().view(world, -1)
    return [pickle.loads(rows[r, :lengths[r]].numpy().tobytes()) for r in range(world)]


def _outside_backward(fn: Callable) -> Callable:
    """Decorate a :class:`Comm` method that calls ``torch.distributed``
    (:func:`outside_backward`)."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with outside_backward():
            return fn(*args, **kwargs)
    return wrapped


@dataclass
class CommStats:
    """Traffic of one rank: payload bytes sent/received, messages sent, wall seconds."""

    bytes_sent: int = 0
    bytes_recv: int = 0
    messages: int = 0
    seconds: float = 0.0

    def __iadd__(self, other: CommStats) -> CommStats:
        self.bytes_sent += other.bytes_sent
        self.bytes_recv += other.bytes_recv
        self.messages += other.messages
        self.seconds += other.seconds
        return self

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def ring_allreduce_bytes(nbytes: int, P: int) -> int:
    """Bytes one rank sends (and receives) in a ring all-reduce of ``nbytes``: 2(P−1)/P·B,
    rounded down (0 for one rank). The accounting of :meth:`Comm.all_reduce`, also used to meter
    all-reduces gradsync does not issue itself (torch's own DDP hooks)."""
    return 2 * (P - 1) * nbytes // P if P > 1 else 0


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# The operations gloo runs on CUDA tensors itself (torch.distributed's backend table); the
# others are staged through host memory.
_GLOO_CUDA_OPS = frozenset({"all_reduce", "broadcast"})
_BITWISE = (dist.ReduceOp.BOR, dist.ReduceOp.BAND, dist.ReduceOp.BXOR)


def backend_devices(backend: str) -> dict[str, str]:
    """Device type -> backend of a ``dist.get_backend`` string: ``"nccl"`` -> ``{cuda: nccl}``,
    ``"gloo"`` -> ``{cpu: gloo, cuda: gloo}``, ``"cpu:gloo,cuda:nccl"`` -> as written; an
    unknown single backend is taken to move tensors of every device (nothing is staged)."""
    backend = backend.lower()
    if ":" in backend:
        pairs = [pair.split(":", 1) for pair in backend.split(",")]
        if any(len(p) != 2 or not p[0] or not p[1] for p in pairs):
            raise ValueError(f"backend {backend!r}: expected 'device:backend[,...]'")
        return dict(pairs)
    if backend == "nccl":
        return {"cuda": "nccl"}
    if backend in ("gloo", "mpi"):
        return {"cpu": backend, "cuda": backend}
    return {}


#: The environment variable of a ``dist.get_backend``-style string (``"cpu:nccl"``) by which
#: a process's ``Comm`` objects map devices to backends instead of their group's. For tests
#: (module docstring).
EMULATE_BACKEND_ENV = "GRADSYNC_EMULATE_BACKEND"
LONG_BLOCK_BYTES = 1 << 20  # per round the doubling saves: longer blocks go round the ring


def gather_rounds(p: int, block_bytes: float, long_block_bytes: int = LONG_BLOCK_BYTES
                  ) -> list[int]:
    """The rounds of a gloo all-gather of P blocks of ``block_bytes`` (their mean), as the
    blocks each round's one message carries (module docstring, ``all_gather``): Bruck's
    doubling, ``min(d, P − d)`` for d = 1, 2, 4, … < P, where it saves rounds (P ≥ 4) and the
    blocks are shorter than ``long_block_bytes`` per round it saves; otherwise the ring, P − 1
    rounds of one block. :meth:`Comm._rounds` sends them; the simulator prices them
    (``gradsync.apps.sim.patterns``)."""
    saved = (p - 1) - (p - 1).bit_length()  # the rounds the doubling saves: P − 1 − ⌈log2 P⌉
    if saved <= 0 or block_bytes >= long_block_bytes * saved:
        return [1] * (p - 1)
    return [min(1 << j, p - (1 << j)) for j in range((p - 1).bit_length())]


class _Staged:
    """The handle of a staged ``isend``/``irecv``: ``wait()`` also copies a received tensor
    back to the caller's device."""

    def __init__(self, work: dist.Work, wire: torch.Tensor, into: torch.Tensor | None):
        self._work, self._wire, self._into = work, wire, into

    def wait(self) -> bool:
        ok = self._work.wait()
        if self._into is not None:
            self._into.copy_(self._wire)
            self._into = None
        return ok

    def is_completed(self) -> bool:
        return self._into is None and self._work.is_completed()


class _Batch:
    """Queued NCCL ``isend``/``irecv`` posted together; waited on once (a gloo work waited on
    a second time can block, and emulation runs this on gloo)."""

    def __init__(self, works: list[dist.Work]) -> None:
        self.works: list[dist.Work] | None = works

    def wait(self) -> None:
        works, self.works = self.works, None
        for w in works or ():
            w.wait()


class _Deferred:
    """The handle of an ``isend``/``irecv`` queued on NCCL (module docstring): ``wait()``
    posts the queue first if nobody has yet, then waits for the whole batch."""

    def __init__(self, comm: Comm) -> None:
        self._comm = comm
        self.batch: _Batch | None = None

    def wait(self) -> bool:
        if self.batch is None:
            self._comm.flush()
        self.batch.wait()
        return True

    def is_completed(self) -> bool:
        return self.batch is not None and self.batch.works is None


class _Done:
    """The handle of an ``async_op`` call that completed synchronously (it was staged)."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class Comm:
    """Counts every byte a rank hands to torch.distributed within one group.

    ``group=None`` is the default group. Without an initialised process group, ``Comm`` acts
    as a single rank (size 1), so single-process code paths need no special casing.

    ``backend`` is the group's backend string (``"none"`` without a process group) and
    ``device`` the device of its control tensors (module docstring).
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        if dist.is_available() and dist.is_initialized():
            self.rank = dist.get_rank(group)
            self.size = dist.get_world_size(group)
            self.backend = str(dist.get_backend(group))
        else:
            self.rank, self.size = 0, 1
            self.backend = "none"
        self._devices = backend_devices(os.environ.get(EMULATE_BACKEND_ENV) or self.backend)
        if ("cpu" not in self._devices and self._devices.get("cuda") == "nccl"
                and torch.cuda.is_available()):  # NCCL only: this thread's CUDA device
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        self.stats = CommStats()
        self.long_block_bytes = LONG_BLOCK_BYTES  # module docstring, ``all_gather``
        self._queued: list[tuple[dist.P2POp, _Deferred]] = []

    # -- helpers ----------------------------------------------------------------------
    def global_rank(self, group_rank: int) -> int:
        """The global rank of ``group_rank`` (what p2p calls take)."""
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def wire_device(self, device: torch.device, op: str) -> torch.device | None:
        """Where ``op`` must move a tensor on ``device`` when the backend cannot take it there,
        or ``None`` when it can (module docstring)."""
        if not self._devices:
            return None
        be = self._devices.get(device.type)
        if be is not None and not (be == "gloo" and device.type == "cuda"
                                   and op not in _GLOO_CUDA_OPS):
            return None
        if device.type != "cpu" and "cpu" in self._devices:
            return torch.device("cpu")
        return self.device

    def reduces_bitwise(self, device: torch.device | str | None = None) -> bool:
        """Whether ``all_reduce`` with a bitwise op works for a tensor on ``device`` (default
        the control device): not where it would run on NCCL."""
        dev = self.device if device is None else torch.device(device)
        dev = self.wire_device(dev, "all_reduce") or dev
        return self._devices.get(dev.type) != "nccl"

    def bounded(self, device: torch.device | str) -> bool:
        """Whether a receive of a tensor on ``device`` may post a buffer longer than the
        message it gets (:meth:`sendrecv_bounded`): gloo delivers a shorter message into it,
        NCCL needs the sender's count, and a staged tensor would copy the whole buffer."""
        dev = torch.device(device)
        return self.wire_device(dev, "recv") is None and self._devices.get(dev.type) == "gloo"

    def _staged(self, t: torch.Tensor, op: str) -> torch.Tensor:
        """``t`` itself, or a copy on the device the backend takes (see :meth:`wire_device`)."""
        dev = self.wire_device(t.device, op)
        return t if dev is None else t.to(dev, copy=True)

    @_outside_backward
    def flush(self) -> None:
        """Post the queued NCCL ``isend``/``irecv`` as one batch (module docstring)."""
        if not self._queued:
            return
        ops = [op for op, _ in self._queued]
        handles = [h for _, h in self._queued]
        self._queued = []
        batch = _Batch(dist.batch_isend_irecv(ops))
        for h in handles:
            h.batch = batch

    def _queue(self, fn: Callable, wire: torch.Tensor, peer: int) -> _Deferred:
        handle = _Deferred(self)
        self._queued.append((dist.P2POp(fn, wire, self.global_rank(peer), self.group), handle))
        return handle

    def _check_op(self, what: str, op: dist.ReduceOp.RedOpType, wire: torch.Tensor) -> None:
        if op in _BITWISE and self._devices.get(wire.device.type) == "nccl":
            raise ValueError(f"{what}: NCCL has no bitwise reduction ({op}); exchange the "
                             "bits and combine them locally instead (collectives/lhc.py)")

    def _count(self, sent: int, recv: int, messages: int) -> None:
        self.stats.bytes_sent += int(sent)
        self.stats.bytes_recv += int(recv)
        self.stats.messages += int(messages)

    # -- point to point ---------------------------------------------------------------
    @_outside_backward
    def send(self, t: torch.Tensor, dst: int) -> None:
        self.flush()
        self._count(_nbytes(t), 0, 1)
        _waited(dist.isend(self._staged(t, "send"), self.global_rank(dst), group=self.group))

    @_outside_backward
    def recv(self, t: torch.Tensor, src: int) -> None:
        self.flush()
        self._count(0, _nbytes(t), 0)
        wire = self._staged(t, "recv")
        _waited(dist.irecv(wire, self.global_rank(src), group=self.group))
        if wire is not t:
            t.copy_(wire)

    @_outside_backward
    def isend(self, t: torch.Tensor, dst: int) -> dist.Work:
        self._count(_nbytes(t), 0, 1)
        wire = self._staged(t, "send")
        if self._devices.get(wire.device.type) == "nccl":
            work = self._queue(dist.isend, wire, dst)
        else:
            work = _kept(dist.isend(wire, self.global_rank(dst), group=self.group))
        return work if wire is t else _Staged(work, wire, None)

    @_outside_backward
    def irecv(self, t: torch.Tensor, src: int) -> dist.Work:
        self._count(0, _nbytes(t), 0)
        wire = self._staged(t, "recv")
        if self._devices.get(wire.device.type) == "nccl":
            work = self._queue(dist.irecv, wire, src)
        else:
            work = _kept(dist.irecv(wire, self.global_rank(src), group=self.group))
        return work if wire is t else _Staged(work, wire, t)

    def sendrecv(
        self, send: torch.Tensor | None, dst: int, recv: torch.Tensor | None, src: int
    ) -> None:
        """Send to ``dst`` and receive from ``src`` concurrently (either may be ``None``); on
        NCCL the two go out as one batch (module docstring)."""
        self.flush()
        self._with_send(self.irecv(recv, src) if recv is not None and recv.numel() else None,
                        send, dst)

    def _with_send(self, received: dist.Work | None, send: torch.Tensor | None,
                   dst: int) -> None:
        """Post ``send`` to ``dst`` (unless empty) after the receive ``received``, then wait
        for both."""
        works = [] if received is None else [received]
        if send is not None and send.numel():
            works.append(self.isend(send, dst))
        for w in works:
            w.wait()

    def sendrecv_bounded(self, send: torch.Tensor | None, dst: int, buf: torch.Tensor,
                         src: int, size_of: Callable[[torch.Tensor], int]) -> int:
        """:meth:`sendrecv` into ``buf``, longer than the message it receives where
        :meth:`bounded` allows it: one round for a message whose length travels inside it.
        gloo aborts the process on a message longer than its buffer, so ``buf`` must hold any
        well-formed message. ``size_of`` reads the message's length from what arrived (its own
        header; ``ValueError`` when malformed, with both directions complete, so no peer is
        left waiting); that length is what is counted as received. Returns it."""
        self.flush()
        self._with_send(self.irecv_bounded(buf, src), send, dst)
        n = int(size_of(buf))
        self.received(n)
        return n

    @_outside_backward
    def irecv_bounded(self, buf: torch.Tensor, src: int) -> dist.Work:
        """Post a receive into ``buf``, which may be longer than the message (:meth:`bounded`
        must allow it; gloo aborts the process on a message longer than ``buf``). Nothing is
        counted until :meth:`received` gives the length the message carries."""
        if not self.bounded(buf.device):
            raise ValueError(f"a bounded receive: a {buf.device.type} buffer on "
                             f"{self.backend} needs the message's exact size")
        return _kept(dist.irecv(buf, self.global_rank(src), group=self.group))

    def received(self, nbytes: int) -> None:
        """Count ``nbytes`` received by a bounded receive (:meth:`irecv_bounded`), read from
        the message itself once it arrived."""
        self._count(0, nbytes, 0)

    # -- collectives ------------------------------------------------------------------
    @_outside_backward
    def all_reduce(
        self, t: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM, async_op=False
    ):
        """In-place all-reduce of ``t`` (ring accounting). A bitwise ``op`` where the backend
        has none (NCCL) raises ``ValueError`` (so does :meth:`reduce_scatter`)."""
        self.flush()
        p = self.size
        if p == 1:
            return None
        wire = self._staged(t, "all_reduce")
        self._check_op("all_reduce", op, wire)
        b = ring_allreduce_bytes(_nbytes(t), p)
        self._count(b, b, 2 * (p - 1))
        work = _kept(dist.all_reduce(wire, op=op, group=self.group, async_op=True))
        if wire is t:
            if async_op:
                return work
            work.wait()
            return None
        work.wait()
        t.copy_(wire)
        return _Done() if async_op else None

    @_outside_backward
    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """All-gather equal-size tensors: returns a ``(P, *t.shape)`` tensor, rank order."""
        self.flush()
        p = self.size
        out = torch.empty((p, *t.shape), dtype=t.dtype, device=t.device)
        if p == 1:
            out[0] = t
            return out
        flat = t.contiguous().view(-1)
        if self._devices.get(flat.device.type) != "nccl":  # gloo: rounds of p2p (module docstring)
            rows = out.view(p, -1)
            rows[self.rank].copy_(flat)
            self._gather_rounds(out.view(-1), [flat.numel()] * p)
            return out
        b = _nbytes(t)
        self._count((p - 1) * b, (p - 1) * b, p - 1)
        wire = self._staged(flat, "all_gather")
        if wire is flat:
            _waited(all_gather_single(out.view(-1), flat, group=self.group, async_op=True))
            return out
        got = torch.empty(out.numel(), dtype=t.dtype, device=wire.device)
        _waited(all_gather_single(got, wire, group=self.group, async_op=True))
        out.view(-1).copy_(got)
        return out

    @_outside_backward
    def reduce_scatter(
        self, out: torch.Tensor, inp: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
    ) -> None:
        """Reduce ``inp`` (P equal chunks) over ranks; rank r receives chunk r in ``out``."""
        self.flush()
        p = self.size
        if inp.numel() != p * out.numel():
            raise ValueError(f"reduce_scatter: input of {inp.numel()} != {p} × {out.numel()}")
        if p == 1:
            out.copy_(inp.view_as(out))
            return
        b = _nbytes(out)
        self._count((p - 1) * b, (p - 1) * b, p - 1)
        wire_in = self._staged(inp, "reduce_scatter")
        self._check_op("reduce_scatter", op, wire_in)
        if wire_in is inp:
            _waited(reduce_scatter_single(out, inp, op=op, group=self.group, async_op=True))
            return
        wire_out = torch.empty(out.shape, dtype=out.dtype, device=wire_in.device)
        _waited(reduce_scatter_single(wire_out, wire_in, op=op, group=self.group,
                                      async_op=True))
        out.copy_(wire_out)

    @_outside_backward
    def broadcast(self, t: torch.Tensor, src: int) -> None:
        """Broadcast ``t`` from group rank ``src`` (binomial-tree accounting)."""
        self.flush()
        p = self.size
        if p == 1:
            return
        b = _nbytes(t)
        v = (self.rank - src) % p  # rank relative to the root
        children, mask = 0, 1
        while mask < p:
            if v & mask:
                break
            if v + mask < p:
                children += 1
            mask <<= 1
        self._count(children * b, b if v else 0, children)
        wire = self._staged(t, "broadcast")
        _waited(dist.broadcast(wire, self.global_rank(src), group=self.group, async_op=True))
        if wire is not t:
            t.copy_(wire)

    def broadcast_object(self, obj: Any, src: int) -> Any:
        """Group rank ``src``'s picklable ``obj`` on every rank: its pickled length (one int64
        word) and then its bytes, both as :meth:`broadcast` (so counted). Like
        ``dist.broadcast_object_list`` it unpickles what ``src`` sent: for a job's own ranks."""
        if self.size == 1:
            return obj
        mine = self.rank == src
        blob = pickle.dumps(obj) if mine else b""
        n = torch.tensor([len(blob)], dtype=torch.int64, device=self.device)
        self.broadcast(n, src)
        buf = (torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(self.device) if mine
               else torch.empty(int(n), dtype=torch.uint8, device=self.device))
        self.broadcast(buf, src)
        return obj if mine else pickle.loads(buf.cpu().numpy().tobytes())

    def all_gather_counts(self, n: int, device: torch.device | str | None = None) -> list[int]:
        """All-gather one integer per rank (e.g. a selection size); the word travels on
        ``device`` (default :attr:`device`, the control device)."""
        word = torch.tensor([n], dtype=torch.int64,
                            device=self.device if device is None else device)
        return self.all_gather(word).view(-1).tolist()

    def all_gather_v(self, t: torch.Tensor, counts: list[int] | None = None) -> list[torch.Tensor]:
        """All-gather 1-D tensors of different lengths; returns one tensor per rank.

        ``counts`` (every rank's length) may be given when already known; otherwise it is
        gathered first. The payload travels in rounds of exact-size point-to-point messages
        (:meth:`_gather_rounds`: ⌈log2 P⌉, or P − 1 for long blocks) into one buffer; the
        blocks returned are views of it.
        """
        p = self.size
        t = t.reshape(-1)
        if counts is None:
            counts = self.all_gather_counts(t.numel())
        if len(counts) != p or counts[self.rank] != t.numel():
            raise ValueError(f"all_gather_v: counts {counts} do not match this rank's "
                             f"{t.numel()} elements at rank {self.rank} of {p}")
        flat = torch.empty(sum(counts), dtype=t.dtype, device=t.device)
        blocks = list(flat.split(counts))
        blocks[self.rank].copy_(t)
        self._gather_rounds(flat, counts)
        return blocks

    def all_gather_bounded(self, t: torch.Tensor, bounds: list[int],
                           size_of: Callable[[int, torch.Tensor], int],
                           expected: float) -> list[torch.Tensor]:
        """:meth:`all_gather_v` of 1-D byte blocks whose lengths travel inside them, where
        :meth:`bounded` allows it: the same rounds (:meth:`_rounds`, chosen by ``expected``,
        the bytes a block should hold, the same on every rank: not the bounds, which may be far
        longer), no count exchange first. A round's message is the blocks it carries back to
        back, received into a buffer of their ``bounds`` (``bounds[q]``: the longest
        well-formed block of rank q) and cut block by block at ``size_of(q, buf)`` bytes, read
        from the block's own start (at most ``bounds[q]``; the caller rejects a malformed
        length there, and the bytes it keeps are what it forwards, so every rank gets the same
        blocks). Returns every rank's block, this rank's ``t``."""
        p, r = self.size, self.rank
        blocks: list[torch.Tensor] = [t.reshape(-1)] * p
        for shift, first, n in self._rounds(expected):
            held = [blocks[(first + i) % p] for i in range(n)]
            qs = [(first + shift + i) % p for i in range(n)]
            buf = torch.empty(sum(bounds[q] for q in qs), dtype=torch.uint8, device=t.device)
            cuts: list[tuple[int, int, int]] = []

            def cut(got: torch.Tensor, qs: list[int] = qs,
                    cuts: list[tuple[int, int, int]] = cuts) -> int:
                at = 0
                for q in qs:
                    m = size_of(q, got[at:at + bounds[q]])
                    cuts.append((q, at, at + m))
                    at += m
                return at

            self.sendrecv_bounded(held[0] if n == 1 else torch.cat(held), (r - shift) % p, buf,
                                  (r + shift) % p, cut)
            for q, a, b in cuts:
                blocks[q] = buf[a:b]
        return blocks

    def _rounds(self, block_bytes: float) -> Iterator[tuple[int, int, int]]:
        """The rounds of a gloo all-gather of blocks of ``block_bytes`` (their mean) as
        ``(shift, first, n)``: this rank sends the n blocks from block ``first`` on to rank
        r − shift and receives the n blocks from block first + shift on from rank r + shift.
        Bruck's doubling, d = 1, 2, 4, … < P, ``(d, r, min(d, P − d))``, where it saves rounds
        (P ≥ 4) and the blocks are shorter than :attr:`long_block_bytes` per round it saves;
        otherwise the ring: step s = 0 … P − 2, ``(−1, r − s, 1)``, the block received in the
        step before passed on to rank r + 1 (module docstring, ``all_gather``)."""
        p, r = self.size, self.rank
        blocks = gather_rounds(p, block_bytes, self.long_block_bytes)
        if len(blocks) == p - 1:  # the ring (also the doubling's own rounds where P ≤ 3)
            for s in range(p - 1):
                yield -1, (r - s) % p, 1
            return
        for j, n in enumerate(blocks):
            yield 1 << j, r, n

    def _gather_rounds(self, flat: torch.Tensor, counts: list[int]) -> None:
        """Fill every rank's block of ``flat`` (blocks of ``counts`` elements in rank order;
        this rank's holds its own) in the rounds of :meth:`_rounds`, exact-size point-to-point
        messages. In Bruck et al.'s doubling, round j (d = 2^j) finds rank r holding the d blocks
        r, r + 1, …, r + d − 1 (mod P); it sends the first min(d, P − d) of them to rank r − d and
        receives as many from rank r + d, the ones that follow its own: P − 1 blocks sent and
        received in ⌈log2 P⌉ messages instead of the ring's P − 1. Blocks that wrap past rank
        P − 1 travel as one copy; those that do not, as a view of ``flat``."""
        p = self.size
        starts = [0, *itertools.accumulate(counts)]

        def span(first: int, n: int) -> list[tuple[int, int]]:  # element ranges, wrap split
            last = first + n
            if last <= p:
                return [(starts[first], starts[last])]
            return [(starts[first], starts[p]), (0, starts[last - p])]

        for shift, first, n in self._rounds(flat.element_size() * starts[p] / p):
            out, into = span(first, n), span((first + shift) % p, n)
            send = (flat[out[0][0]:out[0][1]] if len(out) == 1
                    else torch.cat([flat[a:b] for a, b in out]))
            recv = (flat[into[0][0]:into[0][1]] if len(into) == 1
                    else torch.empty(sum(b - a for a, b in into), dtype=flat.dtype,
                                     device=flat.device))
            self.sendrecv(send, (self.rank - shift) % p, recv, (self.rank + shift) % p)
            if len(into) > 1:
                at = 0
                for a, b in into:
                    flat[a:b].copy_(recv[at:at + b - a])
                    at += b - a

    @_outside_backward
    def barrier(self) -> None:
        self.flush()
        if self.size > 1:
            _waited(dist.barrier(group=self.group, async_op=True))
