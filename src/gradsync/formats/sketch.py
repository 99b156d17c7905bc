"""Lossless homomorphic compression: bit index + count sketch + peeling (TAGC §2.2, LHC [19]).

TAGC §2.2 / §3.1 (after LHC, Li et al. 2024). A flat gradient of n elements is cut into
``B = ceil(n / lanes)`` blocks of ``lanes = 1024`` elements (the last block is zero-padded, so
tail nonzeros are never dropped, unlike TAGC's code). Three hashes of the *block id* choose three
DISTINCT sketch rows and a sign per hash; element ``(b, l)`` is added, times its sign, to cell
``(row_j(b), l)`` (lane rotated, see below) of a sketch of ``R = ceil(B / ratio)`` rows of
``lanes`` cells, i.e. a sketch of ``length = ceil(n / lanes / ratio) · lanes`` values (ratio
2, 4, 10 in TAGC Table 1). The sketch is linear, ``encode(a + b) == encode(a) + encode(b)``,
so ranks SUM their sketches with a plain all-reduce (or reduce / reduce-scatter in TAGC's FSDP
path).

Lane rotation (``shift=True``, the default; a deviation from LHC, measured): with LHC's plain
layout (lane = position within the block, ``shift=False``) every lane of two blocks whose three
rows coincide (or form any small stopping set) is unpeelable as soon as both are nonzero there;
with ~B²/2 block pairs and only C(R, 3) row triples this makes peeling fail at TAGC's own Table 1
operating points (n = 1e6: 8/20 seeds lossy at 4x / 90% zeros, 5/20 at 10x / 98.75%). A fourth
hash per (block, row) rotates the block's lanes, ``lane = (l + offset_j(b)) mod lanes`` — still a
contiguous per-block roll — which turns the per-lane hypergraphs into one random hypergraph over
all cells: 0/20 failures at those points. ``shift=False`` keeps LHC's exact layout.

Decoding needs the *global* nonzero mask (the OR of every rank's index). From it each rank
counts, locally, how many nonzero elements hash into each cell (the counts are never sent).
Peeling: a cell with count 1 holds exactly one element, so ``value = sign · cell``; the value is
subtracted from the element's other cells (their counts drop by one) and the process repeats,
all pure cells of a round at once, until no cell of count 1 is left. The work is bounded: the
first round looks at every element, each later round only at the elements of the cells the
previous round left pure (a cell also keeps the sum of its unresolved elements' numbers, so
the one element of a pure cell is read directly), and each of those is resolved in that round,
so all rounds together visit at most 2·k·E element-cell pairs (E nonzeros, k = 3). The number of
rounds is capped at ``max_rounds`` (:data:`MAX_ROUNDS`): a crafted mask can free one element
per round (a chain), and without the cap its E rounds would cost E times the per-round
overhead (before this bound, each such round re-scanned every unresolved element: O(E²)).
Elements still unresolved then make the decode lossy: ``on_failure="report"`` estimates each by
the median of its three sign-corrected cells (count-sketch estimation) and says so in
:class:`PeelReport`; ``on_failure="raise"`` raises :class:`PeelError`. Peeling succeeds with
high probability while the union density stays below about 0.82 / ratio (the 3-uniform
hypergraph peeling threshold: ≈ 40% at 2x, 20% at 4x, 8% at 10x).

Precision: the sketch and all decoding arithmetic are fp32, whatever the input dtype (bf16 and
fp16 inputs are upcast before encoding; ``peel(dtype=…)`` casts only the result). Peeling is
exact in exact arithmetic; in fp32 a value recovered after subtractions carries rounding of the
order of eps_fp32 × the magnitudes that shared its cells.

Tiny tensors: three distinct rows need ``R >= 3``. When ``ceil(B / ratio) < 3`` the sketch gets
``min(B, 3)`` rows, and whenever ``R >= B`` it is the identity (block b in row b, one copy, no
hashing), i.e. tensors of at most 3 blocks travel uncompressed and always decode exactly.

Determinism: the hashes come from a CPU ``torch.Generator`` seeded with ``seed`` (identical on
every rank and device). On CPU encode and peel are deterministic, so every rank peels the same
summed sketch to bitwise identical values. (On CUDA, ``index_add_`` uses atomics; run with
``torch.use_deterministic_algorithms(True)`` if bitwise equality across ranks matters there.)

The bit index (``pack_index``/``unpack_index``) is :mod:`gradsync.formats.wire`'s bit packing
under TAGC's names: ``index_bits=1`` is a packed bitmap (bit i of byte i // 8 is element i,
little-endian bit order); ``index_bits=4`` holds one 4-bit counter per element (element 2i in the
low nibble of byte i), so summing packed 4-bit indices of P <= 15 ranks counts, per element, how
many ranks hold it — exactly, with no carry between nibbles. Summing packed 1-bit bitmaps is
WRONG (1 + 1 carries into the neighbour bit); the OR is the collective's job
(``collectives/lhc.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from gradsync.formats.wire import check_int, pack_bits, packed_bytes, unpack_bits
from gradsync.sparsegrad import check_finite, check_indices, flatnonzero

__all__ = [
    "MAX_ROUNDS",
    "CountSketch",
    "PeelError",
    "PeelReport",
    "index_wire_bytes",
    "pack_index",
    "unpack_counts",
    "unpack_index",
]

LANES = 1024  # TAGC / LHC block width
#: Default cap on peeling rounds. A random union below the peeling threshold needs a few tens
#: (measured: ≤ 40 at n = 1e6 within 5% of the threshold); only a crafted mask (a chain that
#: frees one element per round) needs more, and its remaining nonzeros are reported lossy.
MAX_ROUNDS = 1024


@dataclass
class PeelReport:
    """Outcome of one peel: ``lossy`` when some nonzeros could not be peeled.

    ``unresolved``: nonzeros left after peeling stopped; ``rounds``: peeling rounds run;
    ``estimated``: nonzeros whose value is a median estimate (== unresolved with "report");
    ``capped``: peeling stopped at the round cap (``max_rounds``) with pure cells left;
    ``visits``: element-cell pairs examined, at most 2·k·E (the work bound, module doc).
    """

    lossy: bool
    unresolved: int
    rounds: int
    estimated: int
    capped: bool = False
    visits: int = 0


class PeelError(RuntimeError):
    """Peeling stopped with unresolved nonzeros and ``on_failure="raise"`` was asked."""

    def __init__(self, report: PeelReport) -> None:
        self.report = report
        why = (f"the round cap of {report.rounds} rounds was reached" if report.capped
               else "union density too high for this compression ratio")
        super().__init__(
            f"peeling failed: {report.unresolved} nonzeros unresolved after {report.rounds} "
            f"rounds ({why})"
        )


class CountSketch:
    """The LHC count sketch of an ``n``-element tensor at compression ``ratio`` (module doc)."""

    def __init__(
        self,
        n: int,
        ratio: int,
        *,
        seed: int = 0,
        lanes: int = LANES,
        device="cpu",
        shift: bool = True,
    ) -> None:
        self.n = check_int("n", n, 0)
        self.ratio = check_int("ratio", ratio, 1)
        self.seed = check_int("seed", seed, 0)
        self.lanes = check_int("lanes", lanes, 1)
        self.device = torch.device(device)
        B = math.ceil(self.n / self.lanes)  # blocks
        R = math.ceil(B / self.ratio)  # sketch rows
        if R < 3:
            R = min(B, 3)
        self.blocks, self.rows = B, R
        self.length = R * self.lanes
        self.direct = R >= B  # identity layout: nothing to hash, nothing to peel
        self.shift = bool(shift) and not self.direct
        if self.direct:
            rows = torch.arange(B, dtype=torch.int64).view(B, 1)
            signs = torch.ones(B, 1)
            offsets = torch.zeros(B, 1, dtype=torch.int64)
        else:
            rows, signs, offsets = self._hash(B, R, self.lanes, self.seed)
            if not self.shift:
                offsets.zero_()
        self.hashes = rows.to(self.device)  # (B, k) int64: the k = 3 distinct rows of block b
        self.signs = signs.to(self.device)  # (B, k) fp32 ±1: the sign of block b in each row
        self.offsets = offsets.to(self.device)  # (B, k) int64 lane rotation (0 if not shift)
        self._lane = torch.arange(self.lanes, device=self.device)

    @staticmethod
    def _hash(B: int, R: int, L: int, seed: int) -> tuple[torch.Tensor, ...]:
        """Three distinct rows, signs and lane rotations per block id (CPU generator, seed)."""
        g = torch.Generator().manual_seed(seed)
        h1 = torch.randint(0, R, (B,), generator=g)
        h2 = torch.randint(0, R - 1, (B,), generator=g)
        h2 = h2 + (h2 >= h1).long()  # skip h1: uniform over the R − 1 other rows
        h3 = torch.randint(0, R - 2, (B,), generator=g)
        lo, hi = torch.minimum(h1, h2), torch.maximum(h1, h2)
        h3 = h3 + (h3 >= lo).long()
        h3 = h3 + (h3 >= hi).long()  # skip both: uniform over the R − 2 others
        rows = torch.stack([h1, h2, h3], dim=1)
        signs = torch.randint(0, 2, (B, 3), generator=g).float() * 2 - 1
        offsets = torch.randint(0, L, (B, 3), generator=g)
        return rows, signs, offsets

    def __repr__(self) -> str:
        return (f"CountSketch(n={self.n}, ratio={self.ratio}, rows={self.rows}, "
                f"lanes={self.lanes}, length={self.length}, direct={self.direct})")

    # -- encode ------------------------------------------------------------------------
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Dense ``x[n]`` (fp32/bf16/fp16) -> fp32 sketch ``[length]``; linear in ``x``."""
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"CountSketch.encode: expected a tensor, got {type(x).__name__}")
        if x.dim() != 1 or x.numel() != self.n:
            raise ValueError(f"CountSketch.encode: expected a 1-D tensor of {self.n} elements, "
                             f"got shape {tuple(x.shape)}")
        if not x.is_floating_point():
            raise ValueError(f"CountSketch.encode: expected a floating tensor, got {x.dtype}")
        if x.device != self.device:
            raise ValueError(f"CountSketch.encode: tensor on {x.device}, sketch on {self.device}")
        check_finite(x, "CountSketch.encode: input")
        pos = flatnonzero(x != 0)  # zeros add nothing (and ±0 leaves every cell's bits alone)
        return self._encode_at(pos, torch.index_select(x, 0, pos))

    def encode_entries(self, pos: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """The sketch of the tensor whose only nonzeros are ``values`` at flat positions ``pos``
        (int64, strictly increasing, in ``[0, n)``): O(nnz) instead of ``encode``'s O(n), and
        bit for bit ``encode`` of that dense tensor (the same additions in the same order)."""
        if not isinstance(pos, torch.Tensor) or not isinstance(values, torch.Tensor):
            raise ValueError("CountSketch.encode_entries: expected tensors")
        if pos.dtype != torch.int64 or pos.dim() != 1 or values.shape != pos.shape:
            raise ValueError(f"CountSketch.encode_entries: expected 1-D int64 positions and as "
                             f"many values, got {pos.dtype} {tuple(pos.shape)} and "
                             f"{tuple(values.shape)}")
        if not values.is_floating_point():
            raise ValueError(f"CountSketch.encode_entries: expected floating values, got "
                             f"{values.dtype}")
        check_indices(pos, self.n, "CountSketch.encode_entries")
        check_finite(values, "CountSketch.encode_entries: input")
        return self._encode_at(pos, values)

    def _encode_at(self, pos: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Add ``sign · value`` (fp32) into every cell of every element, hash by hash and, within
        a hash, in position order — the order of a dense pass over the blocks."""
        cells, signs = self.element_cells(pos)
        contrib = signs * values.to(torch.float32).unsqueeze(1)
        sketch = torch.zeros(self.length, dtype=torch.float32, device=self.device)
        sketch.index_add_(0, cells.t().reshape(-1), contrib.t().reshape(-1))
        return sketch

    # -- decode ------------------------------------------------------------------------
    def element_cells(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat sketch cells (E, k) and signs (E, k) of the elements at flat positions ``pos``.

        The one description of the layout: ``encode``, ``peel``, ``cell_counts`` and TAGC's
        O(nnz) chunk encoder all go through it."""
        L = self.lanes
        b = torch.div(pos, L, rounding_mode="floor")
        lane = torch.index_select(self.offsets, 0, b).add_((pos - b * L).unsqueeze(1))
        lane = torch.where(lane >= L, lane - L, lane)  # (l + offset) mod L, both in [0, L)
        cells = torch.index_select(self.hashes, 0, b).mul_(L).add_(lane)
        return cells, torch.index_select(self.signs, 0, b)

    def cell_counts(self, nonzero: torch.Tensor) -> torch.Tensor:
        """Number of nonzero elements (of the global mask) hashed into each cell, int64."""
        self._check_mask(nonzero)
        cells, _ = self.element_cells(flatnonzero(nonzero))
        return torch.bincount(cells.reshape(-1), minlength=self.length)

    def _check_mask(self, nonzero: torch.Tensor) -> None:
        if not isinstance(nonzero, torch.Tensor) or nonzero.dtype != torch.bool:
            raise ValueError("CountSketch.peel: nonzero must be a bool tensor, got "
                             f"{getattr(nonzero, 'dtype', type(nonzero).__name__)}")
        if nonzero.dim() != 1 or nonzero.numel() != self.n:
            raise ValueError(f"CountSketch.peel: nonzero must be 1-D of {self.n} elements, "
                             f"got shape {tuple(nonzero.shape)}")
        if nonzero.device != self.device:
            raise ValueError(f"CountSketch.peel: mask on {nonzero.device}, "
                             f"sketch on {self.device}")

    def peel(
        self,
        sketch: torch.Tensor,
        nonzero: torch.Tensor,
        *,
        on_failure: str = "report",
        dtype: torch.dtype = torch.float32,
        max_rounds: int = MAX_ROUNDS,
    ) -> tuple[torch.Tensor, PeelReport]:
        """Recover ``values[n]`` from a (summed) sketch and the global nonzero mask.

        Returns the values (``dtype``, computed in fp32) and a :class:`PeelReport`. With
        ``on_failure="report"`` unresolved nonzeros are median-estimated and the report says
        ``lossy=True``; with ``"raise"`` a :class:`PeelError` is raised instead.

        Bounded work (module doc, "Peeling"): at most ``max_rounds`` rounds, and at most
        2·k·E element-cell visits over all rounds (E nonzeros, k = 3 cells each).
        """
        self._check_peel_args(sketch, nonzero, on_failure, dtype, max_rounds)
        dev = self.device
        values = torch.zeros(self.n, dtype=torch.float32, device=dev)
        pos = flatnonzero(nonzero)  # the union's nonzeros, E of them
        cells, sg = self.element_cells(pos)  # (E, k)
        E, k = cells.shape
        # Per cell, computed locally from the global index (never sent): how many unresolved
        # elements it holds, and the sum of their element numbers (the one element of a pure
        # cell, read in O(1) — the frontier of the next round).
        flat_all = cells.reshape(-1)
        count = torch.bincount(flat_all, minlength=self.length)
        ids = torch.zeros(self.length, dtype=torch.int64, device=dev)
        ids.index_add_(0, flat_all, torch.arange(E, device=dev).repeat_interleave(k))
        residual = sketch.to(torch.float32, copy=True)
        resolved = torch.zeros(E, dtype=torch.bool, device=dev)
        rounds, visits, capped = self._peel_rounds(cells, sg, pos, values, residual, count, ids,
                                                   resolved, max_rounds)
        left = flatnonzero(~resolved)
        unresolved = int(left.numel())
        report = PeelReport(lossy=unresolved > 0, unresolved=unresolved, rounds=rounds,
                            estimated=0, capped=capped, visits=visits)
        if unresolved:
            if on_failure == "raise":
                raise PeelError(report)
            med = self._median_estimate(cells, sg, residual, left)
            values.index_copy_(0, torch.index_select(pos, 0, left), med)
            report.estimated = unresolved
        return values.to(dtype), report

    def _check_peel_args(self, sketch: torch.Tensor, nonzero: torch.Tensor, on_failure: str,
                         dtype: torch.dtype, max_rounds: int) -> None:
        """``peel``'s arguments: a finite fp sketch of ``length`` values on the sketch's device,
        a bool mask of ``n`` elements, a floating ``dtype``, ``max_rounds >= 1``."""
        if on_failure not in ("report", "raise"):
            raise ValueError(f"on_failure must be 'report' or 'raise', got {on_failure!r}")
        check_int("max_rounds", max_rounds, 1)
        if not isinstance(sketch, torch.Tensor) or not sketch.is_floating_point():
            raise ValueError("CountSketch.peel: sketch must be a floating tensor, got "
                             f"{getattr(sketch, 'dtype', type(sketch).__name__)}")
        if sketch.dim() != 1 or sketch.numel() != self.length:
            raise ValueError(f"CountSketch.peel: sketch must be 1-D of {self.length} values, "
                             f"got shape {tuple(sketch.shape)}")
        if sketch.device != self.device:
            raise ValueError(f"CountSketch.peel: sketch on {sketch.device}, "
                             f"expected {self.device}")
        check_finite(sketch, "CountSketch.peel: sketch")
        self._check_mask(nonzero)
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"CountSketch.peel: dtype must be a floating dtype, got {dtype!r}")

    @staticmethod
    def _peel_rounds(
        cells: torch.Tensor, sg: torch.Tensor, pos: torch.Tensor, values: torch.Tensor,
        residual: torch.Tensor, count: torch.Tensor, ids: torch.Tensor, resolved: torch.Tensor,
        max_rounds: int,
    ) -> tuple[int, int, bool]:
        """The peeling rounds (module doc, "Peeling"), in place on ``values``, ``residual``,
        ``count``, ``ids`` and ``resolved``: each round reads every pure cell's element
        (``value = sign · cell``) and subtracts it from all its cells; round 1 looks at every
        element, each later round only at the elements of the cells the previous round left
        pure. Returns (rounds, element-cell visits, capped at ``max_rounds``)."""
        E, k = cells.shape
        dev = cells.device
        cand: torch.Tensor | None = None  # None: round 1 looks at every element
        rounds = visits = 0
        capped = False
        while cand is None or cand.numel():
            if rounds == max_rounds:
                capped = True
                break
            if cand is None:
                c_c, s_c = cells, sg
            else:
                c_c, s_c = torch.index_select(cells, 0, cand), torch.index_select(sg, 0, cand)
            visits += c_c.numel()
            pure = (torch.index_select(count, 0, c_c.view(-1)) == 1).view(-1, k)
            if cand is None:  # later candidates all hold a pure cell (they come from one)
                cand = flatnonzero(pure.any(dim=1))
                if not cand.numel():
                    break
                c_c, s_c = torch.index_select(c_c, 0, cand), torch.index_select(s_c, 0, cand)
                pure = torch.index_select(pure, 0, cand)
            rounds += 1
            j = pure.to(torch.int8).argmax(dim=1, keepdim=True)  # first pure cell
            v = s_c.gather(1, j).view(-1) * torch.index_select(residual, 0,
                                                               c_c.gather(1, j).view(-1))
            values.index_copy_(0, torch.index_select(pos, 0, cand), v)
            resolved.index_fill_(0, cand, True)
            # Subtract the resolved elements from all their cells (pure ones become 0).
            flat = c_c.view(-1)
            residual.index_add_(0, flat, (s_c * v.unsqueeze(1)).neg_().view(-1))
            count.index_add_(0, flat, torch.full((flat.numel(),), -1, dtype=count.dtype,
                                                 device=dev))
            ids.index_add_(0, flat, cand.repeat_interleave(k).neg_())
            cand = CountSketch._next_frontier(flat, count, ids, E)
        return rounds, visits, capped

    @staticmethod
    def _next_frontier(flat: torch.Tensor, count: torch.Tensor, ids: torch.Tensor,
                       E: int) -> torch.Tensor:
        """The next round's candidates: the one element (``ids``) of every cell among ``flat``
        (the cells this round touched) that it left pure, each once."""
        left1 = torch.index_select(flat, 0, flatnonzero(torch.index_select(count, 0, flat) == 1))
        nxt = torch.index_select(ids, 0, left1)
        if nxt.numel() > E // 8:  # dedupe by a mark: O(E), in at most 8 rounds
            return flatnonzero(torch.zeros(E, dtype=torch.bool, device=flat.device)
                               .index_fill_(0, nxt, True))
        return torch.unique(nxt)  # O(f log f) on a small frontier

    @staticmethod
    def _median_estimate(cells: torch.Tensor, sg: torch.Tensor, residual: torch.Tensor,
                         left: torch.Tensor) -> torch.Tensor:
        """Count-sketch estimate of the unresolved elements ``left``: the median of their
        sign-corrected (residual) cells."""
        k = cells.shape[1]
        c_l = torch.index_select(cells, 0, left)
        est = (torch.index_select(sg, 0, left)
               * torch.index_select(residual, 0, c_l.view(-1)).view(-1, k))
        if k == 3:  # the median of three, by comparisons only (exact, as median is)
            lo, hi = torch.minimum(est[:, 0], est[:, 1]), torch.maximum(est[:, 0], est[:, 1])
            return torch.maximum(lo, torch.minimum(hi, est[:, 2]))
        # torch.median's lower median by a sort: median(dim) has no deterministic CUDA kernel
        # and raises under torch.use_deterministic_algorithms
        return est.sort(dim=1).values[:, (k - 1) // 2]


# -- the bit index (TAGC's names for formats.wire's bit packing) ----------------------------
#: Bytes of a packed index of ``n`` elements: ``ceil(n · index_bits / 8)``.
index_wire_bytes = packed_bytes
#: ``bool[n]`` -> uint8 wire buffer of ``index_wire_bytes(n, index_bits)`` bytes.
pack_index = pack_bits
#: uint8 wire buffer -> per-element counter ``uint8[n]`` (0/1 for a 1-bit bitmap); validates.
unpack_counts = unpack_bits


def unpack_index(buf: torch.Tensor, n: int, index_bits: int = 1) -> torch.Tensor:
    """uint8 wire buffer -> ``bool[n]`` (for 4-bit counters: count > 0); validates."""
    return unpack_bits(buf, n, index_bits) > 0
