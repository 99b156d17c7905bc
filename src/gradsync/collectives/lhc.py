"""LHC: lossless homomorphic compression as a data-parallel all-reduce (TAGC §2.2, LHC [19]).

Per rank, with the local selection q (TAGC's θ sparsification is the caller's job, e.g.
``sparsify.get("fraction", density=…)``):

1. ``local_index <- create_index(q)``; ``index <- OR over ranks`` (below — never a SUM of
   packed 1-bit bitmaps, which TAGC's code does and which is wrong as soon as two ranks share a
   nonzero: 1 + 1 carries into the neighbour bit);
2. ``local_count_sketch <- compress(q)`` (``formats.sketch.CountSketch``, ``ratio`` 2/4/10);
   ``count_sketch <- All-Reduce SUM`` (the sketch is linear);
3. ``g <- peeling_decompress(index, count_sketch)`` on every rank. Every rank peels the same
   summed sketch with the same global index, so ``dense`` is bitwise identical everywhere; it is
   exact (lossless up to fp32 rounding of the subtractions) whenever peeling resolves every
   nonzero, else ``info["lossy"]`` is True and ``info["unresolved"]`` of them are estimates
   (``on_failure="raise"`` raises ``PeelError`` on every rank instead).

Index OR, traffic per rank (ring accounting of ``Comm``, n elements, P ranks):

=============  ==========================================  ==============================
method         what travels                                bytes sent per rank
=============  ==========================================  ==============================
``bor``        packed bitmap, all-reduce with bitwise OR    2(P−1)/P · n/8 (gloo only;
                                                            NCCL has no bitwise reduce)
``gather``     all-gather packed bitmaps, OR locally        (P−1) · n/8
``max``        uint8 0/1 per element, all-reduce MAX        2(P−1)/P · n
``count4``     packed 4-bit counters, all-reduce SUM        2(P−1)/P · n/2 (P ≤ 15 only:
                                                            a nibble holds counts ≤ 15)
=============  ==========================================  ==============================

``index_bits=1``, ``index_method="auto"``: ``bor`` where the backend has a bitwise OR for the
mask's device (gloo; :meth:`Comm.reduces_bitwise`), else — NCCL, whose reductions are only
SUM/PROD/MIN/MAX/AVG — ``gather`` for P < 16 (cheaper than ``max`` while P − 1 < 16(P−1)/P)
and ``max`` from P = 16 on. Both fallbacks are exact ORs and run on gloo too (name them, or
``GRADSYNC_EMULATE_BACKEND=cpu:nccl`` to make ``auto`` choose as on NCCL); ``bor`` named
explicitly on NCCL raises ``ValueError`` (from ``Comm.all_reduce``).
``index_bits=4``: ``count4`` (TAGC's 4-bit index; the summed counters are exact) for P ≤ 15;
for P > 15 the counters would overflow into the neighbour nibble, so it falls back to the
1-bit choice above (``info["index_method"]`` says which ran).

The sketch all-reduce moves 2(P−1)/P · 4·length bytes ≈ 2(P−1)/P · 32/ratio bits per parameter.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from gradsync.collectives import registry
from gradsync.collectives.base import Collective
from gradsync.collectives.comm import Comm
from gradsync.formats.sketch import LANES, CountSketch
from gradsync.formats.wire import pack_bits, unpack_bits
from gradsync.sparsegrad import SparseGrad

__all__ = ["LHC", "all_or_index", "choose_index_method"]

INDEX_METHODS = ("auto", "bor", "gather", "max", "count4")


def choose_index_method(index_bits: int, P: int, backend: str,
                        bitwise: bool | None = None) -> str:
    """The ``auto`` choice for the index OR (module docstring table). ``bitwise``: whether the
    backend reduces with bitwise OR where the mask lives (:meth:`Comm.reduces_bitwise`);
    ``None``: only gloo does."""
    if index_bits == 4 and P <= 15:
        return "count4"
    if backend == "gloo" if bitwise is None else bitwise:
        return "bor"
    return "gather" if P < 16 else "max"


def all_or_index(
    mask: torch.Tensor, comm: Comm, index_bits: int = 1, method: str = "auto"
) -> tuple[torch.Tensor, str]:
    """The OR over ranks of every rank's ``bool[n]`` nonzero mask; returns (mask, method)."""
    if method not in INDEX_METHODS:
        raise ValueError(f"index method must be one of {INDEX_METHODS}, got {method!r}")
    if index_bits not in (1, 4):
        raise ValueError(f"index_bits must be 1 or 4, got {index_bits!r}")
    P, n = comm.size, mask.numel()
    if method == "auto":
        method = choose_index_method(index_bits, P, comm.backend,
                                     P > 1 and comm.reduces_bitwise(mask.device))
    if method == "count4" and P > 15:
        raise ValueError(f"4-bit counters summed over P = {P} > 15 ranks overflow a nibble")
    if P == 1:
        return mask.clone(), method
    if method == "bor":
        buf = pack_bits(mask, 1)
        comm.all_reduce(buf, op=dist.ReduceOp.BOR)
        return unpack_bits(buf, n, 1) > 0, method
    if method == "gather":
        bufs = comm.all_gather(pack_bits(mask, 1))  # (P, n/8)
        out = bufs[0]
        for r in range(1, P):
            out = out | bufs[r]
        return unpack_bits(out, n, 1) > 0, method
    if method == "max":
        buf = mask.to(torch.uint8)
        comm.all_reduce(buf, op=dist.ReduceOp.MAX)
        return buf > 0, method
    # count4: per element, how many ranks hold it (≤ P ≤ 15, so no carry between nibbles)
    buf = pack_bits(mask, 4)
    comm.all_reduce(buf, op=dist.ReduceOp.SUM)
    return unpack_bits(buf, n, 4) > 0, method


@registry.register("lhc")
class LHC(Collective):
    """Index OR-allreduce + count-sketch SUM-allreduce + peeling (module docstring)."""

    exact = True  # lossless whenever peeling succeeds; info["lossy"] says when it did not

    def __init__(
        self,
        ratio: int = 10,
        index_bits: int = 1,
        on_failure: str = "report",
        *,
        index_method: str = "auto",
        seed: int = 0,
        lanes: int = LANES,
        shift: bool = True,
        check_shapes: bool | str = True,
    ) -> None:
        super().__init__(check_shapes=check_shapes)
        if isinstance(ratio, bool) or not isinstance(ratio, int) or ratio < 1:
            raise ValueError(f"lhc: ratio must be an int >= 1 (TAGC: 2, 4, 10), got {ratio!r}")
        if isinstance(index_bits, bool) or index_bits not in (1, 4):
            raise ValueError(f"lhc: index_bits must be 1 or 4, got {index_bits!r}")
        if on_failure not in ("report", "raise"):
            raise ValueError(f"lhc: on_failure must be 'report' or 'raise', got {on_failure!r}")
        if index_method not in INDEX_METHODS:
            raise ValueError(f"lhc: index_method must be one of {INDEX_METHODS}, "
                             f"got {index_method!r}")
        self.ratio, self.index_bits, self.on_failure = ratio, index_bits, on_failure
        self.index_method, self.seed, self.lanes, self.shift = index_method, seed, lanes, shift
        self._sketches: dict[tuple[int, str], CountSketch] = {}

    def sketch_for(self, n: int, device: torch.device) -> CountSketch:
        """The (cached) CountSketch of an n-element tensor; identical on every rank (seed)."""
        key = (n, str(device))
        cs = self._sketches.get(key)
        if cs is None:
            cs = CountSketch(n, self.ratio, seed=self.seed, lanes=self.lanes, device=device,
                             shift=self.shift)
            self._sketches[key] = cs
        return cs

    def _reduce(
        self, sel: SparseGrad, comm: Comm, step: int
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        n = sel.numel
        cs = self.sketch_for(n, sel.device)
        # 1. local_index <- create_index(q); index <- OR over ranks
        local = torch.zeros(n, dtype=torch.bool, device=sel.device).index_fill_(
            0, sel.indices, True)
        index, method = all_or_index(local, comm, self.index_bits, self.index_method)
        # 2. local_count_sketch <- compress(q); count_sketch <- All-Reduce SUM
        sketch = cs.encode_entries(sel.indices, sel.values)  # O(nnz), = encode(to_dense())
        comm.all_reduce(sketch, op=dist.ReduceOp.SUM)
        # 3. g <- peeling_decompress(index, count_sketch), identically on every rank
        dense, report = cs.peel(sketch, index, on_failure=self.on_failure, dtype=sel.dtype)
        union = int(torch.count_nonzero(index))
        info = {
            "lossy": report.lossy,
            "unresolved": report.unresolved,
            "estimated": report.estimated,
            "rounds": report.rounds,
            "union_nnz": union,
            "union_density": union / n if n else 0.0,
            "index_method": method,
            "sketch_length": cs.length,
            "ratio": self.ratio,
            "index_bits": self.index_bits,
        }
        return dense, sel.indices, info

    def __repr__(self) -> str:
        return (f"LHC(ratio={self.ratio}, index_bits={self.index_bits}, "
                f"on_failure={self.on_failure!r}, index_method={self.index_method!r})")
