"""TAGC's compressed reduce-scatter: bit index + count sketch + peeling (TAGC §3.1, Algorithm 1).

TAGC §3.1 / Algorithm 1 ("THLC communication hook"), lines 3–10. Every rank holds its gradient
of one FSDP unit as P destination chunks ``q[j]`` of n elements (chunk j is the part of the
shard rank j owns), already θ-sparsified — lines 1–2, the local accumulation ``g ← g + acc``
and ``g, acc_next ← sparsify(g, θ)``, are the caller's (:mod:`gradsync.integrations.fsdp`):

    3  local_index ← create_index(q)        # per chunk: formats.sketch.pack_index(q[j] ≠ 0)
    4  index ← All-Reduce(local_index)      # here: OR, reduce-scattered (owner d: ∨_r index_r[d])
    5  local_count_sketch ← compress(q)     # per chunk: CountSketch(q[j])  (encode_chunks)
    6  Reduce(local_count_sketch, d)        # here: ONE SUM reduce-scatter, all P owners at once
    8  if LOCAL RANK = d:
    10     g ← peeling_decompress(index, count_sketch)

The paper reduces each shard's sketch to its master device; a reduce-scatter runs those P
reductions in one call, every rank being the master of its own shard. The same algorithm as an
all-reduce (every rank peels the whole vector) is LHC, :mod:`gradsync.collectives.lhc`.

Index aggregation (``index_method``), n elements per chunk, B = ⌈n/8⌉ bytes per packed bitmap,
bytes sent per rank as :class:`~gradsync.collectives.comm.Comm` counts them:

=============  =================================================  ======================
method         what travels                                       bytes sent per rank
=============  =================================================  ======================
``bor``        packed bitmaps, reduce-scatter with bitwise OR     (P−1)·B (gloo only)
``gather``     packed bitmaps exchanged pairwise (step s sends    (P−1)·B
               chunk r+s to its owner), OR at the owner
``max``        uint8 0/1 per element, reduce-scatter MAX          (P−1)·n
``count4``     packed 4-bit counters, reduce-scatter SUM          (P−1)·⌈n/2⌉ (P ≤ 15)
=============  =================================================  ======================

``"auto"`` takes LHC's rule (:func:`gradsync.collectives.lhc.choose_index_method`: ``count4``
for 4-bit indices and P ≤ 15, ``bor`` on gloo, which alone has a bitwise-OR reduction), with
one difference: where LHC switches from ``gather`` to ``max`` (P ≥ 16, when an all-gather's P
bitmaps outweigh a byte per element), a reduce-scatter keeps ``gather`` — each owner receives
only its own chunk, (P−1)·B bytes against ``max``'s (P−1)·n at every P. 1-bit bitmaps are
never SUMmed (a carry would corrupt the neighbouring bit); 4-bit counters are, exact for
P ≤ 15. See docs/papers.md, "TAGC and LHC".

The sketches are fp32 whatever the gradient dtype: (P−1)·4·length bytes per rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from gradsync.collectives.comm import Comm
from gradsync.collectives.lhc import INDEX_METHODS, choose_index_method
from gradsync.formats.sketch import CountSketch, PeelError, PeelReport, pack_index, unpack_index
from gradsync.sparsegrad import check_finite

__all__ = [
    "RSResult",
    "agree_lossless",
    "choose_method",
    "compressed_reduce_scatter",
    "encode_chunks",
    "index_reduce_scatter",
]


@dataclass
class RSResult:
    """Outcome of :func:`compressed_reduce_scatter` on this rank."""

    values: torch.Tensor  # (n,) this rank's shard of Σ_ranks q[rank]
    report: PeelReport  # the peel of this rank's shard
    union_nnz: int  # nonzeros of the OR index of this rank's shard
    index_method: str
    index_bytes: int  # bytes this rank sent for the index (line 4)
    sketch_bytes: int  # bytes this rank sent for the sketches (line 6)


def choose_method(index_bits: int, P: int, backend: str, bitwise: bool | None = None) -> str:
    """The ``"auto"`` index aggregation of a reduce-scatter (module docstring)."""
    method = choose_index_method(index_bits, P, backend, bitwise)
    return "gather" if method == "max" else method


def encode_chunks(sketch: CountSketch, q: torch.Tensor) -> torch.Tensor:
    """Count sketches of the P rows of ``q`` at once, from their nonzeros only: (P, length).

    Equals ``torch.stack([sketch.encode(q[j]) for j in range(P)])`` (the sketch is linear;
    zeros add nothing) but costs O(nnz) instead of O(n) — after θ-sparsification 1% of the
    chunk. Positions map to cells through the sketch's own ``element_cells``, the single source
    of its layout. NaN/Inf raises ``ValueError``.
    """
    P, n = q.shape
    if n != sketch.n:
        raise ValueError(f"sketch of {sketch.n} elements cannot encode chunks of {n}")
    check_finite(q, "TAGC: gradient")
    j, pos = torch.nonzero(q, as_tuple=True)
    v = q[j, pos].to(torch.float32)
    cells, signs = sketch.element_cells(pos)  # (E, k) cells of one sketch, (E, k) ±1
    cells = cells + (j * sketch.length).unsqueeze(1)
    out = torch.zeros(P * sketch.length, dtype=torch.float32, device=q.device)
    out.index_add_(0, cells.reshape(-1), (signs * v.unsqueeze(1)).reshape(-1))
    return out.view(P, sketch.length)


def index_reduce_scatter(mask: torch.Tensor, comm: Comm, index_bits: int = 1,
                         method: str = "auto") -> tuple[torch.Tensor, str]:
    """Lines 3–4: ``bool (P, n)`` nonzero masks -> this rank's ``bool (n,)`` OR over ranks of
    chunk ``comm.rank``, and the method that ran (module docstring table)."""
    if method not in INDEX_METHODS:
        raise ValueError(f"index method must be one of {INDEX_METHODS}, got {method!r}")
    P, n = mask.shape
    if comm.size != P:
        raise ValueError(f"index_reduce_scatter: {P} chunks for {comm.size} ranks")
    if method == "auto":
        method = choose_method(index_bits, P, comm.backend,
                               P > 1 and comm.reduces_bitwise(mask.device))
    if method == "count4" and P > 15:
        raise ValueError(f"4-bit counters summed over P = {P} > 15 ranks overflow a nibble")
    if method == "max":
        out = torch.empty(n, dtype=torch.uint8, device=mask.device)
        comm.reduce_scatter(out, mask.to(torch.uint8).reshape(-1), op=dist.ReduceOp.MAX)
        return out > 0, method
    bits = 4 if method == "count4" else 1
    local = torch.stack([pack_index(mask[j], bits) for j in range(P)])  # (P, bytes)
    out = torch.empty(local.shape[1], dtype=torch.uint8, device=mask.device)
    if method == "count4":  # per element, how many ranks hold it: no carry for P <= 15
        comm.reduce_scatter(out, local.view(-1))
    elif method == "bor":
        comm.reduce_scatter(out, local.view(-1), op=dist.ReduceOp.BOR)
    else:  # gather: step s sends chunk r+s to its owner, receives chunk r from rank r−s
        r = comm.rank
        out.copy_(local[r])
        buf = torch.empty_like(out)
        for s in range(1, P):
            dst, src = (r + s) % P, (r - s) % P
            comm.sendrecv(local[dst].contiguous(), dst, buf, src)
            out.bitwise_or_(buf)
    return unpack_index(out, n, bits), method


def compressed_reduce_scatter(q: torch.Tensor, sketch: CountSketch, comm: Comm, *,
                              index_bits: int = 1, index_method: str = "auto") -> RSResult:
    """Lines 3–10 for the ``(P, n)`` chunks ``q``: this rank's shard of the SUM over ranks.

    Exact (up to fp32 rounding of the peeling subtractions) whenever the OR index of the shard
    is peelable; otherwise ``report.lossy`` and the unresolved values are count-sketch
    estimates. Every rank calls it with an identical ``sketch`` (same n, ratio and seed).
    """
    if q.dim() != 2 or q.shape[1] != sketch.n:
        raise ValueError(f"compressed_reduce_scatter: expected (P, {sketch.n}) chunks, "
                         f"got {tuple(q.shape)}")
    before = comm.stats.bytes_sent
    # 3-4: local index per destination chunk; the owner receives the OR over ranks
    nonzero, method = index_reduce_scatter(q != 0, comm, index_bits, index_method)
    index_bytes = comm.stats.bytes_sent - before
    # 5-6: count sketch per chunk; owner d receives Σ_ranks sketch(chunk d)
    local_sketch = encode_chunks(sketch, q)
    count_sketch = torch.empty(sketch.length, dtype=torch.float32, device=q.device)
    before = comm.stats.bytes_sent
    comm.reduce_scatter(count_sketch, local_sketch.view(-1))
    sketch_bytes = comm.stats.bytes_sent - before
    # 10: g ← peeling_decompress(index, count_sketch) on the owner
    values, report = sketch.peel(count_sketch, nonzero, on_failure="report", dtype=q.dtype)
    return RSResult(values, report, int(nonzero.sum()), method, index_bytes, sketch_bytes)


def agree_lossless(report: PeelReport, comm: Comm, device: torch.device | str | None = None,
                   what: str = "TAGC") -> None:
    """Raise on EVERY rank when any rank's peel was lossy (``on_failure="raise"``).

    One 8-byte MAX all-reduce of the unresolved count keeps the ranks in step, so no rank is
    left waiting in the next collective. The rank whose peel failed raises
    :class:`~gradsync.formats.sketch.PeelError`, the others ``RuntimeError``.
    """
    flag = torch.tensor([int(report.unresolved)], dtype=torch.int64,
                        device=comm.device if device is None else device)
    comm.all_reduce(flag, op=dist.ReduceOp.MAX)
    if int(flag) > 0:
        if report.lossy:
            raise PeelError(report)
        raise RuntimeError(f"{what}: peeling failed on another rank's shard ({int(flag)} "
                           "nonzeros unresolved there); on_failure='raise'")
