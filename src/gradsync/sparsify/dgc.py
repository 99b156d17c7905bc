"""DGC's sampled threshold (Deep Gradient Compression, Lin et al. 2018; SSFusion §II, [44]).

The top-k threshold is estimated on a strided sample instead of the whole tensor:

1. sample: ``s = max(⌈1% · n⌉, ⌈2/density⌉)`` elements with stride ``⌊n/s⌋`` from a random
   start, so the sample holds ≥ 1% of the elements and ≥ 2 expected top-k entries. The start
   comes from the sparsifier's own Python generator (``random.Random``, seeded with its
   seed): drawing it costs no tensor operation and no read of a tensor, which a
   ``torch.randint`` per tensor would (one per tensor and step);
2. threshold: ``thr`` = the smallest of the sample's top-k′, ``k′ = ⌈density · |sample|⌉``;
3. select ``|x| ≥ thr``; up to 10 adjustments: when fewer than ``0.8·k`` are selected,
   ``thr ← 0.8·thr`` and select again; when more than ``1.3·k``, take the exact top-k among the
   candidates and stop;
4. truncate to k.

docs/papers.md, "DGC" (the threshold): the
reference truncates to the *first* k candidates by position, which drops large entries at high
indices; here the truncation keeps the k largest candidates (a top-k over at most 1.3·k values,
cheap). The result therefore never exceeds k and, unless
all 10 adjustments were used, holds at least 0.8·k entries.
"""

from __future__ import annotations

import math
import random
from typing import Any

import torch

from gradsync.sparsify import registry
from gradsync.sparsify.base import Sparsifier, magnitudes
from gradsync.sparsify.segments import Segments, order_in_segments, to_device, top_in_segments


@registry.register("dgc")
class DGC(Sparsifier):
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

    def _sample(self, a: torch.Tensor) -> torch.Tensor:
        n = a.numel()
        s = max(math.ceil(self.sample_ratio * n), math.ceil(2.0 / self.density))
        if s >= n:
            return a
        stride = n // s  # ⌈(n − start)/stride⌉ ≥ s for every start < stride
        return a[self.draws.randrange(stride)::stride]

    @property
    def last_threshold(self) -> float | None:
        """The threshold of the last selection. It stays a 0-dim tensor on the input's device
        until read (reading it waits for the device; a selection itself does not)."""
        if isinstance(self._last_thr, torch.Tensor):
            self._last_thr = float(self._last_thr)
        return self._last_thr

    @last_threshold.setter
    def last_threshold(self, value: float | torch.Tensor | None) -> None:
        self._last_thr = value

    def _select(self, x: torch.Tensor, k: int, step: int) -> torch.Tensor:
        a = magnitudes(x)
        sample = self._sample(a)
        k_s = min(sample.numel(), max(1, math.ceil(self.density * sample.numel())))
        # thr in float64 on the device, as a Python float would be, without reading it back:
        # the comparisons round it to fp32 either way, and ×0.8 is the same IEEE product
        thr = torch.topk(sample, k_s, sorted=False).values.min().double()
        idx = torch.nonzero(a >= thr).view(-1)
        adjustments = 0
        while adjustments < self.max_adjust:
            count = idx.numel()
            if count > self.upper * k:
                # Too many: exact top-k among the candidates, done.
                idx = idx[torch.topk(a[idx], k, sorted=False).indices]
                break
            if count >= self.lower * k:
                break
            thr = thr * self.lower  # too few: lower the threshold by 0.8 and select again
            idx = torch.nonzero(a >= thr).view(-1)
            adjustments += 1
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
        tensor); the samples are gathered and ranked in one pass; θ_i is a vector, and the
        adjustments run in rounds over the whole buffer, each round reading the tensors'
        counts back once (a tensor that is done keeps its θ_i)."""
        dev, first = x.device, sparsifiers[0]
        lower, upper, max_adjust = first.lower, first.upper, first.max_adjust
        a = magnitudes(x)
        S, N = len(seg), seg.numel
        # 1. the samples: tensors with k < n only (k = n sends the whole tensor, no draw)
        sampled, starts, strides, lengths, kth = [], [], [], [], []
        for i, (sp, n, k) in enumerate(zip(sparsifiers, seg.sizes, ks)):
            if k >= n:
                continue
            s = max(math.ceil(sp.sample_ratio * n), math.ceil(2.0 / sp.density))
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
        thr = torch.full((S,), -math.inf, dtype=torch.float64, device=dev)
        if sampled:
            # 2. θ_i = the kth_i largest of sample i: gather, rank within samples, pick
            M, T = sum(lengths), len(sampled)
            first_of = [0]
            for m in lengths[:-1]:
                first_of.append(first_of[-1] + m)
            packed = to_device([*starts, *strides, *first_of, *lengths, *sampled,
                                *(f + k - 1 for f, k in zip(first_of, kth))], torch.int64, dev)
            st, sd, fo, ln, which, pick = packed.split(T)

            def each(v: torch.Tensor) -> torch.Tensor:
                return torch.repeat_interleave(v, ln, output_size=M)

            j = torch.arange(M, device=dev) - each(fo)
            sample = a[each(st) + each(sd) * j]
            thr[which] = sample[order_in_segments(sample, lengths, ln)[pick]].double()
        # 3. select |x| >= θ_i; lower θ_i by 0.8 where too few, in rounds
        sizes = to_device(list(seg.sizes), torch.int64, dev)
        ends = to_device([o + n - 1 for o, n in zip(seg.offsets, seg.sizes)], torch.int64, dev)
        adjustments = dict.fromkeys(sampled, 0)
        active = list(sampled)
        while True:
            mask = a >= torch.repeat_interleave(thr.float(), sizes, output_size=N)
            at_end = mask.cumsum(0)[ends]
            counts = torch.diff(at_end, prepend=at_end.new_zeros(1)).tolist()  # one read
            lowering = []
            for i in active:
                c, k = counts[i], ks[i]
                if not (c > upper * k or c >= lower * k or adjustments[i] >= max_adjust):
                    lowering.append(i)
                    adjustments[i] += 1
            if not lowering:
                break
            active = lowering
            lowered = to_device(lowering, torch.int64, dev)
            thr[lowered] = thr[lowered] * lower  # the same IEEE products as θ ← 0.8·θ
        # 4. more than k candidates: the k largest of them (= the tensor's top-k)
        cand = torch.nonzero_static(mask, size=sum(counts)).view(-1)
        keep = [min(c, k) for c, k in zip(counts, ks)]
        if keep != counts:
            cand = cand[top_in_segments(a[cand], counts, keep)]
        for i, (sp, k) in enumerate(zip(sparsifiers, ks)):
            sp.last_k, sp.last_count = k, keep[i]
            if i in adjustments:
                sp.last_threshold = thr[i]
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
