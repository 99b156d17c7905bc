"""The collective contract (docs/architecture.md, "Contracts"): every rank calls
``coll(sel, group, step)``.

``SyncResult.dense`` is the SUM over ranks (callers divide by P), bitwise identical on every
rank; ``kept`` are the local indices that entered it (exact collectives keep all of them; Ok-Topk
and gTop-k only those surviving the global selection); ``stats`` is this rank's traffic, counted
by :class:`~gradsync.collectives.comm.Comm` at the torch.distributed call.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from gradsync.collectives.comm import Comm, CommStats
from gradsync.formats.wire import DTYPE_CODES
from gradsync.sparsegrad import SparseGrad

__all__ = ["CHECKS", "Collective", "SyncResult", "any_failed", "heard", "raise_failed"]

#: the key of ``_reduce``'s info under which a collective leaves checks made on the device:
#: a list of ``(ok, message)``, ``ok`` a bool tensor (``Collective.__call__``)
CHECKS = "checks"
# the shape check's word holds the capacity modulo this (plus one; 0: no capacity)
_CAP_MOD = (1 << 22) - 1
#: ``check_shapes="changes"`` keeps this many agreed descriptions (then starts afresh, on every
#: rank at the same call): a DDP hook's buckets, an engine's buffers, warm-up densities.
AGREED_KEPT = 256


def raise_failed(checks: list[tuple[torch.Tensor, str]]) -> None:
    """Read ``checks`` (``(ok, message)``, ``ok`` on the device) in one copy and raise
    ``ValueError`` with the first failed one's message."""
    if not checks:
        return
    oks = torch.stack([ok.reshape(()).to(torch.bool) for ok, _ in checks]).tolist()
    for ok, (_, message) in zip(oks, checks):
        if not ok:
            raise ValueError(message)


def any_failed(checks: list[tuple[torch.Tensor, str]], device: torch.device) -> torch.Tensor:
    """Whether any of ``checks`` failed: a bool on ``device``, nothing read (a rank's verdict
    that travels to its peers: DenseStream's allgather, Ok-Topk's heads)."""
    if not checks:
        return torch.zeros((), dtype=torch.bool, device=device)
    return ~torch.stack([ok.reshape(()).to(torch.bool) for ok, _ in checks]).all()


def heard(name: str, verdict: int, device: torch.device, who: str = ""
          ) -> list[tuple[torch.Tensor, str]]:
    """The checks a verdict word read from peers (:func:`any_failed`'s, sent ahead of a
    message) stands for: none for 0; for 1 one failed check, "another rank received a
    malformed message"; for anything else one failed check naming the malformed word.
    ``who``: the ranks it came from, for the message."""
    if verdict == 0:
        return []
    why = ("another rank received a malformed message" if verdict == 1 else
           f"a verdict word of {verdict}, not 0 or 1")
    return [(torch.zeros((), dtype=torch.bool, device=device),
             f"{name}: {why}{who} (its error names the check)")]


@dataclass
class SyncResult:
    """What a collective returns on each rank."""

    dense: torch.Tensor | None  # None until ``decode`` runs (``lazy``: Collective.__call__)
    kept: torch.Tensor
    stats: CommStats = field(default_factory=CommStats)
    info: dict[str, Any] = field(default_factory=dict)  # algorithm-specific (e.g. "lossy")
    # ``lazy``: what writes ``dense``, for the caller to run on the thread that reads it
    decode: Callable[[], torch.Tensor] | None = None


class Collective(ABC):
    """Base class: input checks, a shape consensus, timing; subclasses implement ``_reduce``.

    ``check_shapes`` (default on) runs one all-reduce of four int64 words so that ranks passing
    different ``numel``, dtypes or dense prefixes (``SparseGrad.dense_prefix``) fail with a
    clear ``ValueError`` on every rank instead of hanging or corrupting memory. Its 32 bytes
    are counted like any other traffic, and its read makes a GPU's host wait, once per call.
    ``check_shapes="changes"``: once per description of the tensor (numel, dtype, dense
    prefix, capacity) this rank has not passed before (at most :data:`AGREED_KEPT` kept), as
    torch DDP checks its parameters' shapes once. For callers whose every rank passes the same
    sequence of tensors, which they agreed on beforehand (the engine, the DDP hook: their
    configuration and model are checked at construction, their plans agreed): every rank then
    checks at the same calls. A rank that alone changed what it passes would meet the others
    in another collective (a hang until the group's timeout, or garbage), which the default
    rules out.
    """

    name: str = "?"  # set by ``registry.register(name)``
    exact: bool = True  # does `dense` equal the sum of every rank's selection?
    # ``_reduce`` takes ``lazy``: it can leave the sum's writing to the caller (__call__)
    lazy_decode: bool = False
    # every rank's selection reaches every rank as sent (an all-gather): (P − 1)·k entries sent
    gathers: bool = False

    def __init__(self, *, check_shapes: bool | str = True) -> None:
        if check_shapes not in (True, False, "changes"):
            raise ValueError(f"{self.name}: check_shapes must be True, False or 'changes', got "
                             f"{check_shapes!r}")
        self.check_shapes = check_shapes
        self._agreed: set[tuple[int, ...]] = set()  # with "changes": descriptions agreed

    def alike(self, sel: SparseGrad, group: dist.ProcessGroup | None = None) -> bool:
        """Whether this call shows its checks, and a NaN one rank put in its message, alike
        on every rank of ``group``: every rank decodes every rank's message (TopkA's
        all-gather), or hears every rank's verdict on the messages it decoded (DenseStream's
        and SparDL's all-gathers, gTop-k's trees, Ok-Topk's heads on the CPU), so a caller
        needs no agreement collective for them (the engine's step of such jobs makes none:
        engine/sync.py, ``_agreement``). Every rank decides alike (``sel``'s size and dtype
        are checked alike by the shape check). False by default."""
        return False

    def rescale(self, factor: float) -> None:
        """The values are ``factor`` times larger from the next call on (a loss scale that
        changed): state kept in the values' units (Ok-Topk's reused global θ) is multiplied by
        ``factor``. Nothing to do for the collectives that keep none (the default)."""
        return None

    def __call__(
        self, sel: SparseGrad, group: dist.ProcessGroup | None = None, step: int = 0, *,
        deferred: list[tuple[torch.Tensor, str]] | None = None, lazy: bool = False,
    ) -> SyncResult:
        """Reduce ``sel`` over the group. Checks a collective makes on the device (TopkA's
        fixed-capacity messages: :data:`CHECKS`) are read before returning (``ValueError``),
        or, with ``deferred``, appended to it as ``(ok, message)`` for the caller to read with
        the step's other checks, one read for all (the engine and the DDP hook do).

        ``lazy``: a collective that can (:attr:`lazy_decode`) returns ``dense=None`` and
        ``decode``, which writes the sum and returns it, for the caller to run on the thread
        that reads the sum: on the CPU a buffer that one core wrote costs another core about
        ten times a warm pass to read first (measured: 1.7 MB summed in 232 µs against 30)."""
        if not isinstance(sel, SparseGrad):
            raise ValueError(f"{self.name}: expected a SparseGrad, got {type(sel).__name__}")
        comm = Comm(group)
        t0 = time.perf_counter()
        if self.check_shapes and comm.size > 1:
            key = (comm.size, comm.rank, *self._describe(sel))
            if self.check_shapes is True or key not in self._agreed:
                self._agree(sel, comm)
                if self.check_shapes == "changes":
                    if len(self._agreed) >= AGREED_KEPT:  # alike on every rank: lockstep
                        self._agreed.clear()
                    self._agreed.add(key)
        if lazy and self.lazy_decode:
            dense, kept, info = self._reduce(sel, comm, step, lazy=True)
        else:
            dense, kept, info = self._reduce(sel, comm, step)
        decode = info.pop("decode", None)
        checks = info.pop(CHECKS, [])
        if deferred is not None:
            deferred.extend(checks)
        else:
            raise_failed(checks)
        comm.stats.seconds = time.perf_counter() - t0
        return SyncResult(dense=dense, kept=kept, stats=comm.stats, info=info, decode=decode)

    @staticmethod
    def _describe(sel: SparseGrad) -> tuple[int, int]:
        """``(numel, code)``: the dtype code (one byte), the dense prefix (below 2**31) and a
        fingerprint of the capacity (SparseGrad.capacity; 0: none) share the second word."""
        cap = 0 if sel.capacity is None else sel.capacity % _CAP_MOD + 1
        return sel.numel, DTYPE_CODES.get(sel.dtype, 0) + 256 * sel.dense_prefix + (1 << 40) * cap

    @classmethod
    def _agree(cls, sel: SparseGrad, comm: Comm) -> None:
        _, code = cls._describe(sel)
        word = torch.tensor([sel.numel, code, -sel.numel, -code], dtype=torch.int64,
                            device=comm.device)
        comm.all_reduce(word, op=dist.ReduceOp.MAX)
        hi_n, hi_c, lo_n, lo_c = (int(w) for w in word.tolist())
        if hi_n != -lo_n or hi_c != -lo_c:
            mask = (1 << 40) - 1
            raise ValueError(
                f"ranks disagree on the tensor: numel ranges over [{-lo_n}, {hi_n}], dtype "
                f"codes over [{-lo_c % 256}, {hi_c % 256}], dense prefixes over "
                f"[{(-lo_c & mask) // 256}, {(hi_c & mask) // 256}], capacities "
                f"{'agree' if (-lo_c) >> 40 == hi_c >> 40 else 'differ'}; this rank "
                f"({comm.rank}) has numel={sel.numel}, dtype={sel.dtype}, "
                f"dense_prefix={sel.dense_prefix}, capacity={sel.capacity}"
            )

    @abstractmethod
    def _reduce(
        self, sel: SparseGrad, comm: Comm, step: int
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """Return (dense SUM, kept local indices, info) using only ``comm`` for traffic."""

    # Stateful collectives (Ok-Topk) override these.
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"{self.name}: unexpected state keys {sorted(state)}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

