"""DGC's sampled threshold (Deep Gradient Compression, Lin et al. 2018; SSFusion §II, [44]).

The top-k threshold is estimated on a strided sample instead of the whole tensor:

1. sample: ``s = max(⌈1% · n⌉, ⌈2/density⌉)`` elements with stride ``⌊n/s⌋`` from a random
   start, so the sample holds ≥ 1% of the elements and ≥ 2 expected top-k entries. The start
   comes from the sparsifier's own Python generator (``random.Random``, seeded with its
   seed): drawing it costs no tensor operation and no read of a tensor, which a
   ``torch.randint`` per tensor would (one per tensor and step);
2. threshold: ``thr`` = the smallest of the sample's top-k′, ``k′ = ⌈density · |sample|⌉``;
3. select ``|x| ≥ thr``; up to 10 adjustments: when fewer than ``0.8·k`` are selected,
   lower the threshold by 0.8 (round j's is ``thr·0.8^j``, one product with the power the host
   computes) and select again; when more than ``1.3·k``, take the exact top-k among the
   candidates and stop;
4. truncate to k.

docs/papers.md, "DGC" (the threshold): the
reference truncates to the *first* k candidates by position, which drops large entries at high
indices; here the truncation keeps the k largest candidates (a top-k over at most 1.3·k values,
cheap). The result therefore never exceeds k and, unless
all 10 adjustments were used, holds at least 0.8·k entries.
"""

from __future__ import annotations

import functools
import math
import random
import struct
from typing import Any

import torch

from gradsync.sparsegrad import positions_above
from gradsync.sparsify import registry
from gradsync.sparsify.base import Sparsifier, magnitudes
from gradsync.sparsify.segments import (
    Segments,
    bincount,
    constant,
    descending_keys,
    iota,
    key_base,
    key_bases,
    order_in_segments,
    segment_keys,
    to_device,
    top_by_keys,
)


@registry.register("dgc")
class DGC(Sparsifier):
    at_most_k = True  # step 4 keeps the k largest of the candidates

    def __init__(self, density: float, *, seed: int = 0, sample_ratio: float = 0.01,
                 max_adjust: int = 10, lower: float = 0.8, upper: float = 1.3) -> None:
        super().__init__(density, seed=seed)
        if not 0.0 < sample_ratio <= 1.0:
            raise ValueError(f"dgc: sample_ratio must be in (0, 1], got {sample_ratio}")
        if max_adjust < 0:
            raise ValueError(f"dgc: max_adjust must be >= 0, got {max_adjust}")
        if not 0.0 < lower < 1.0 < upper:
            raise ValueError(f"dgc: need 0 < lower < 1 < upper, got {lower}, {upper}")
        self.sample_ratio = float(sample_ratio)
        self.max_adjust = int(max_adjust)
        self.lower, self.upper = float(lower), float(upper)
        self.last_adjustments = 0
        self.draws = random.Random(self.seed)  # the samples' starts (step 1)

    def _sample_size(self, n: int) -> int:
        """Step 1's s: at least ``sample_ratio`` of the ``n`` elements and 2 expected top-k
        entries."""
        return max(math.ceil(self.sample_ratio * n), math.ceil(2.0 / self.density))

    def _sample(self, a: torch.Tensor) -> torch.Tensor:
        n = a.numel()
        s = self._sample_size(n)
        if s >= n:
            return a
        stride = n // s  # ⌈(n − start)/stride⌉ ≥ s for every start < stride
        return a[self.draws.randrange(stride)::stride]

    def _select(self, x: torch.Tensor, k: int, step: int) -> torch.Tensor:
        a = magnitudes(x)
        sample = self._sample(a)
        k_s = min(sample.numel(), max(1, math.ceil(self.density * sample.numel())))
        # thr in float64 on the device, as a Python float would be, without reading it back:
        # the comparisons round it to fp32 either way, and ×0.8 is the same IEEE product
        theta = torch.topk(sample, k_s, sorted=False).values.min().double()
        thr = theta
        idx = positions_above(a, thr)
        adjustments = 0
        while adjustments < self.max_adjust:
            count = idx.numel()
            if count > self.upper * k:
                # Too many: exact top-k among the candidates, done.
                idx = idx[torch.topk(a[idx], k, sorted=False).indices]
                break
            if count >= self.lower * k:
                break
            adjustments += 1  # too few: lower the threshold by 0.8 and select again
            thr = theta * self.lower ** adjustments
            idx = positions_above(a, thr)
        if idx.numel() > k:  # truncate to k, keeping the largest candidates
            idx = idx[torch.topk(a[idx], k, sorted=False).indices]
        self.last_threshold = thr
        self.last_adjustments = adjustments
        return idx

    # -- every tensor of a buffer at once (gradsync.sparsify.segments) -------------------
    @classmethod
    def segments_compatible(cls, sparsifiers: list[DGC]) -> bool:
        first = sparsifiers[0]
        return all((sp.lower, sp.upper, sp.max_adjust) == (first.lower, first.upper,
                                                           first.max_adjust)
                   for sp in sparsifiers)

    @classmethod
    def _select_segments(cls, sparsifiers: list[DGC], x: torch.Tensor, seg: Segments,
                         ks: list[int], step: int) -> torch.Tensor:
        """Steps 1–4 for every tensor of the buffer ``x`` at once. The samples' start positions
        come from each tensor's own generator, in tensor order (the same draws as tensor by
        tensor); the samples are gathered and ranked in one pass; θ_i is a vector, and every
        tensor's count in every adjustment round comes from one histogram of the entries'
        levels (:func:`_levels`), so the whole selection reads the host once."""
        first = sparsifiers[0]
        a = magnitudes(x)
        # 1. the samples: tensors with k < n only (k = n sends the whole tensor, no draw)
        sampled, starts, strides, lengths, kth = _draw_samples(sparsifiers, seg, ks)
        # 2. θ_i = the kth_i largest of sample i (0 for a tensor sent whole)
        thr = _sample_thresholds(a, len(seg), sampled, starts, strides, lengths, kth)
        # 3. select |x| >= θ_i, lowering θ_i by 0.8 where too few (up to max_adjust times)
        # (upper: step 4 keeps k either way)
        keys, mask, counts, done, theta = _adjust(a, thr, seg, ks, first.lower,
                                                  first.max_adjust)
        adjustments = {i: done[i] for i in sampled}
        # 4. more than k candidates: the k largest of them (= the tensor's top-k)
        cand = torch.nonzero_static(mask, size=sum(counts)).view(-1)
        keep = [min(c, k) for c, k in zip(counts, ks)]
        if keep != counts:
            cand = cand[top_by_keys(keys[cand], counts, keep)]
        powers = _powers(first.lower, first.max_adjust)
        for i, (sp, k) in enumerate(zip(sparsifiers, ks)):
            sp.last_k, sp.last_count = k, keep[i]
            if i in adjustments:  # round j's threshold, the product tensor by tensor makes
                sp.last_threshold = _as_float(theta[i]) * powers[adjustments[i]]
                sp.last_adjustments = adjustments[i]
        return cand

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = self.draws.getstate()
        return {**super().state_dict(), "last_threshold": self.last_threshold,
                "draws": [version, list(internal), gauss]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A state saved before the starts had their own generator draws them afresh from
        the seed."""
        super().load_state_dict(state)
        self.last_threshold = state.get("last_threshold")
        saved = state.get("draws")
        draws = random.Random(self.seed)
        if saved is not None:
            try:
                version, internal, gauss = saved
                draws.setstate((int(version), tuple(int(v) for v in internal), gauss))
            except (TypeError, ValueError) as e:
                raise ValueError(f"dgc: the saved draws are malformed ({e})") from None
        self.draws = draws


def _draw_samples(sparsifiers: list[DGC], seg: Segments, ks: list[int]
                  ) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
    """Step 1 for every tensor of a buffer with k < n: its strided sample, the start drawn
    from its own generator, in tensor order (the draws tensor by tensor selection makes).
    Returns, per sampled tensor, its number, the sample's first position in the buffer, its
    stride, its length m and its rank kth = ⌈density · m⌉ (at least 1, at most m); no tensor
    operation."""
    sampled, starts, strides, lengths, kth = [], [], [], [], []
    for i, (sp, n, k) in enumerate(zip(sparsifiers, seg.sizes, ks)):
        if k >= n:
            continue
        s = sp._sample_size(n)
        start, stride = 0, 1
        if s < n:
            stride = n // s
            start = sp.draws.randrange(stride)
        m = len(range(start, n, stride))
        sampled.append(i)
        starts.append(seg.offsets[i] + start)
        strides.append(stride)
        lengths.append(m)
        kth.append(min(m, max(1, math.ceil(sp.density * m))))
    return sampled, starts, strides, lengths, kth


def _sample_thresholds(a: torch.Tensor, S: int, sampled: list[int], starts: list[int],
                       strides: list[int], lengths: list[int], kth: list[int]) -> torch.Tensor:
    """Step 2 for the ``S`` tensors of a buffer (``a``: its magnitudes): θ_i = the kth_i
    largest of sample i (:func:`_draw_samples`), all samples gathered and ranked in one pass;
    θ_i = 0, which every entry meets, for a tensor sent whole (k >= n)."""
    dev = a.device
    thr = None
    if sampled:
        # θ_i = the kth_i largest of sample i: gather, rank within samples, pick
        M, T = sum(lengths), len(sampled)
        first_of = [0]
        for m in lengths[:-1]:
            first_of.append(first_of[-1] + m)
        # entry t of the samples (counted over all of them) that belongs to sample i sits
        # at starts[i] + strides[i]·(t − first_of[i]) = offset_i + strides[i]·t: each
        # sample's (offset, stride, key base) spread over its entries by one repeat
        packed = to_device([*(v for i, f in enumerate(first_of)
                              for v in (starts[i] - strides[i] * f, strides[i], key_base(i))),
                            *lengths, *sampled, *(f + k - 1 for f, k in zip(first_of, kth))],
                           torch.int64, dev)
        ln, which, pick = packed[3 * T:].split(T)
        off, sd, base = torch.repeat_interleave(packed[:3 * T].view(T, 3), ln, dim=0,
                                                output_size=M).unbind(1)
        sample = a[torch.addcmul(off, sd, iota(M, dev))]
        thr = sample[order_in_segments(sample, base)[pick]]
    if len(sampled) < S:  # tensors sent whole (k >= n): θ = 0, which every entry meets
        whole = torch.zeros(S, dtype=torch.float32, device=dev)
        thr = whole if thr is None else whole.index_copy_(0, which, thr)
    return thr  # type: ignore[return-value]  # S >= 1: set above


def _adjust(a: torch.Tensor, thr: torch.Tensor, seg: Segments, ks: list[int], lower: float,
            J: int) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int], list[int]]:
    """Step 3 for every tensor of a buffer: select ``|x| >= θ_i``, lowering θ_i by ``lower``
    where too few (fewer than lower·k), up to J = max_adjust times.

    Every round's threshold is known in advance, θ_i·0.8^j (the products the rounds make), so
    each entry's level (the first round whose threshold it meets) and, from a histogram of the
    levels, every tensor's count in every round come without a read; the rule then picks each
    tensor's round on the device (the first with at least 0.8·k, else the last), and one read
    brings the counts and rounds back. Returns the entries' ranking keys (step 4's too), the
    candidates' mask, and per tensor its count, its round and θ_i's fp32 bits."""
    S, dev = len(seg), a.device
    powers = _powers(lower, J)
    # (S, J + 1), each row non-increasing: every round's threshold, the same products as
    # tensor by tensor (fp32 θ·0.8^j in float64), rounded to fp32 as its comparisons round
    # them: one operation, the product in float64 and the rounding on the way out
    table = torch.mul(thr[:, None], constant(powers, torch.float64, dev),
                      out=torch.empty(S, J + 1, dtype=torch.float32, device=dev))
    keys = descending_keys(a, segment_keys(seg.sizes, dev))  # also step 4's ranking
    pos = _levels(keys, table)  # i·(J + 2) + ℓ: per tensor and level
    by_round = bincount(pos, S * (J + 2)).view(S, J + 2).cumsum(1)  # count in round j
    # the counts grow with the rounds, so the first round with enough is the number of
    # rounds before J without (J when none has enough); a tensor sent whole (θ = 0) has
    # every entry at level 0 and reports no round. An integer count c < 0.8·k exactly
    # when c < ⌈0.8·k⌉ (0.8·k the same product as tensor by tensor)
    need = constant(tuple(math.ceil(lower * k) for k in ks), torch.int64, dev)
    rounds = (by_round[:, :J] < need[:, None]).sum(1)
    # an entry is a candidate when its level ℓ <= its tensor's round: a lookup of its
    # place pos in the (S, J + 2) table of which levels each tensor's round takes in
    levels = constant(tuple(range(J + 2)), torch.int64, dev)
    mask = (levels <= rounds[:, None]).view(-1)[pos]
    counts_dev = by_round.gather(1, rounds[:, None]).view(S)
    # the one read, all int64: counts, rounds, and θ (fp32, as its bits). No check
    # of its own for NaN/Inf: select_buffer checked x, or its caller the gradients (an
    # accumulator that overflowed is not read here, on one rank only: its +Inf or NaN
    # magnitudes key before every threshold, so they are selected and reach the
    # collective's sum on every rank, where the caller's check sees them)
    values = torch.cat([counts_dev, rounds, thr.view(torch.int32)]).tolist()
    return keys, mask, values[:S], values[S:2 * S], values[2 * S:]


@functools.lru_cache(maxsize=16)
def _powers(lower: float, J: int) -> tuple[float, ...]:
    """The rounds' factors ``lower^j`` for ``j ≤ J``: the powers tensor-by-tensor selection
    takes."""
    return tuple(lower ** j for j in range(J + 1))


def _as_float(bits: int) -> float:
    """The fp32 whose bits are the int32 ``bits``, as a Python float (exact)."""
    return struct.unpack("<f", struct.pack("<i", bits))[0]


def _levels(keys: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """For each entry of a buffer (``keys``: the :func:`descending_keys` of its fp32
    magnitudes, whose bases give each entry's tensor), its level ℓ — the first column ``j`` of
    its tensor's row of ``table`` (fp32, ``(S, J + 1)``, non-increasing thresholds
    θ·lower^j) with ``magnitude >= table[j]``, ``J + 1`` when it meets none — returned as its
    place among all rows, ``i · (J + 2) + ℓ``. A row's non-increasing thresholds meet a suffix
    of its columns, so ℓ is the number of the row's thresholds above the entry: one binary
    search of every entry among every row's keys, each row ascending as it stands (a threshold
    of 0 or below keys at or above the base, which every magnitude meets) and closed by its
    base (+0.0, which every magnitude meets), in a fixed number of operations. The base
    bounds every level, whatever a row holds (a NaN θ included): ℓ <= J + 1."""
    bases = key_bases(table.shape[0], table.device)[:, None]
    return torch.searchsorted(torch.cat([descending_keys(table, bases), bases], 1).view(-1),
                              keys)
