"""Segmented selection: every tensor of a fusion buffer its own k, in one pass over the buffer.

SSFusion §IV-B sparsifies each tensor of a buffer on its own (no tensor missing), at the density
the plan gave it. Done tensor by tensor, that is a dozen operations and one or two host reads
per tensor: on a GPU a kernel launch each, and a wait for the device each, so the cost grows
with the number of tensors, not of buffers. Here the buffer ``x = cat(t_1, …, t_S)`` is
selected as a whole: the per-tensor quantities (k_i, thresholds θ_i, counts) are vectors of S
entries on the device, every operation runs over the buffer once, and the host reads the
segments' counts once per buffer (DGC: every adjustment round at once) instead of once per tensor.

The selections equal the per-tensor ones: the same entries (up to the order among entries of
exactly equal magnitude at a tensor's k-th place, where both pick any), the same random draws
from each tensor's own generator, the same thresholds and ``last_*`` figures on each tensor's
sparsifier. A sparsifier class takes part by defining ``_select_segments`` (DGC, exact top-k);
:func:`select_buffer` returns ``None`` for the others, and the caller selects tensor by tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from gradsync.sparsegrad import (
    SparseGrad,
    all_finite,
    bincount,
    check_finite,
    constant,
    iota,
    kernels_for,
    target_k,
    to_device,
)

__all__ = ["Segments", "bincount", "constant", "descending_keys", "iota", "key_base",
           "key_bases", "name_nonfinite", "order_in_segments", "pays_on", "ranges", "segment_keys",
           "select_buffer", "to_device", "top_by_keys", "top_in_segments"]


def pays_on(device: torch.device) -> bool:
    """Whether selecting a buffer at once beats selecting it tensor by tensor on ``device``.
    On a GPU it does: there every operation is a kernel launch and every read of a count a wait
    for the device, and those grow with the tensors. On the CPU an operation costs little more
    than its arithmetic, and the segmented forms make more passes over the buffer (exact top-k
    sorts it where ``torch.topk`` does not), so the per-tensor selections are faster there
    (docs/results/speed.md, "Segmented selection on the CPU"). The device's kernels say which
    (:attr:`gradsync.sparsegrad.Kernels.segmented`; the tests run the CPU as an accelerator
    through :func:`gradsync.sparsegrad.using`)."""
    return kernels_for(device).segmented


@dataclass(frozen=True)
class Segments:
    """The layout of a buffer: tensor ``i`` is ``x[offsets[i] : offsets[i] + sizes[i]]``."""

    sizes: tuple[int, ...]

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        out, o = [], 0
        for n in self.sizes:
            out.append(o)
            o += n
        return tuple(out)

    @property
    def numel(self) -> int:
        return sum(self.sizes)

    def __len__(self) -> int:
        return len(self.sizes)


def ranges(starts: Sequence[int], lengths: Sequence[int], device: torch.device
           ) -> torch.Tensor:
    """``cat(arange(s, s + l))`` over the pairs, built on ``device`` in a few operations
    (however many pairs) from one small host-to-device copy."""
    total = sum(lengths)
    shift, seen = [], 0
    for s, n in zip(starts, lengths):
        shift.append(s - seen)  # position j of this range is j + (s − entries before it)
        seen += n
    packed = to_device([*shift, *lengths], torch.int64, device)
    return iota(total, device) + torch.repeat_interleave(
        packed[:len(shift)], packed[len(shift):], output_size=total)


def key_base(i: int) -> int:
    """Segment ``i``'s key base, ``i · 2³² + 2³¹ − 1``: :func:`descending_keys` of a value of
    segment ``i`` is its base minus the value's bits, so every key of segment ``i`` lies in
    ``[i · 2³², (i + 1) · 2³²)``."""
    return (i << 32) + (1 << 31) - 1


def key_bases(count: int, device: torch.device) -> torch.Tensor:
    """:func:`key_base` of the segments ``0 … count − 1`` (int64, made once per count and
    device)."""
    return constant(tuple(key_base(i) for i in range(count)), torch.int64, device)


def segment_keys(lengths: Sequence[int], device: torch.device) -> torch.Tensor:
    """The :func:`key_bases` of every entry of contiguous segments of ``lengths`` (each
    segment's base repeated its length), from the layout's cached vectors: one repeat on the
    device."""
    return torch.repeat_interleave(key_bases(len(lengths), device),
                                   constant(tuple(lengths), torch.int64, device),
                                   output_size=sum(lengths))


def descending_keys(values: torch.Tensor, bases: torch.Tensor) -> torch.Tensor:
    """int64 keys that order fp32 magnitudes ``values`` by their segment, then by descending
    value: ``bases − bits(values)``, ``bases`` the segments' :func:`key_bases` (int64,
    broadcast against ``values``). A non-negative fp32 orders as its bit pattern, so the keys
    of a segment ascend as its values descend, +0.0 keying as the base itself and a NaN below
    +Inf (first, as ``argsort`` ranks it). A negative value (a threshold of -Inf or -0.0, which
    every magnitude meets) keys above the base, still within its segment: after every
    magnitude of it (negative values are not ordered among themselves)."""
    if values.dtype != torch.float32:
        raise TypeError(f"descending_keys: fp32 magnitudes, got {values.dtype}")
    return bases - values.view(torch.int32)


def order_in_segments(values: torch.Tensor, bases: torch.Tensor) -> torch.Tensor:
    """The permutation that sorts ``values`` (fp32 magnitudes) by their segment (``bases``: each
    value's :func:`key_bases` entry, ascending: the segments are contiguous), and within each
    segment by descending value, ties in position order: one stable sort of
    :func:`descending_keys`, whatever the number of segments."""
    return torch.sort(descending_keys(values, bases), stable=True).indices


def top_by_keys(keys: torch.Tensor, lengths: Sequence[int], keep: Sequence[int]
                ) -> torch.Tensor:
    """Positions (ascending) of the ``keep[i]`` smallest of the :func:`descending_keys`
    ``keys`` of each contiguous segment ``i`` of ``lengths`` (its ``keep[i]`` largest values,
    ties in position order): one stable sort, a pick of each segment's head, one sort back."""
    if all(k >= n for k, n in zip(keep, lengths)):
        return torch.arange(keys.numel(), device=keys.device)
    order = torch.sort(keys, stable=True).indices
    starts = [0]
    for n in lengths[:-1]:
        starts.append(starts[-1] + n)
    take = ranges(starts, [min(k, n) for k, n in zip(keep, lengths)], keys.device)
    return torch.sort(order[take]).values


def top_in_segments(values: torch.Tensor, lengths: Sequence[int], keep: Sequence[int]
                    ) -> torch.Tensor:
    """Positions (ascending) of the ``keep[i]`` largest ``values`` (fp32 magnitudes) of each
    segment ``i``."""
    return top_by_keys(descending_keys(values, segment_keys(lengths, values.device)), lengths,
                       keep)


def select_buffer(sparsifiers: Sequence[object], x: torch.Tensor, sizes: Sequence[int],
                  step: int = 0, *, checked: bool = False) -> SparseGrad | None:
    """Select every tensor of the buffer ``x`` (flat, the tensors of ``sizes`` concatenated)
    with its own sparsifier, as ``[sp.select(t_i) for …]`` concatenated would, in a number of
    operations independent of the number of tensors. The indices are positions in ``x``.

    ``None`` when the sparsifiers are not all of one class that has a segmented form (the
    caller then selects per tensor). A NaN/Inf in ``x`` raises ``ValueError`` naming the first
    tensor that holds one, before any random draw (as the per-tensor selections do).
    ``checked=True``: the caller has checked the gradients that ``x`` accumulates (the engine's
    and the DDP hook's non-finite policy), so that read is not made again, and nothing here
    raises for an accumulator that overflowed (on one rank only, that would leave the others
    waiting in the collective): its +Inf entries are the largest and are selected (DGC's
    segmented selection selects NaN magnitudes too), so they reach the sums every rank checks.
    """
    kind = type(sparsifiers[0]) if sparsifiers else None
    if (kind is None or getattr(kind, "_select_segments", None) is None
            or any(type(sp) is not kind for sp in sparsifiers)
            or not kind.segments_compatible(sparsifiers)):
        return None
    if len(sizes) != len(sparsifiers) or sum(sizes) != x.numel() or x.dim() != 1:
        raise ValueError(f"select_buffer: {len(sparsifiers)} sparsifiers for {len(sizes)} "
                         f"tensors of {sum(sizes)} entries in a buffer of shape "
                         f"{tuple(x.shape)}")
    for sp in sparsifiers:
        sp._check_input(x)
    seg = Segments(tuple(sizes))
    if not checked and not all_finite(x):  # rare: name the tensor, as its own selection would
        name_nonfinite(sparsifiers, x, seg)
    ks = [target_k(n, sp.density) for sp, n in zip(sparsifiers, sizes)]
    idx = kind._select_segments(sparsifiers, x, seg, ks, step)
    return SparseGrad(idx, x[idx], x.numel(), validate=False,
                      capacity=sum(ks) if kind.at_most_k else None)


def name_nonfinite(sparsifiers: Sequence[object], x: torch.Tensor, seg: Segments) -> None:
    """``ValueError`` naming the first tensor of ``x`` that holds a NaN/Inf, as its own
    selection would (a read per tensor: only once a buffer is known to hold one)."""
    for sp, o, n in zip(sparsifiers, seg.offsets, seg.sizes):
        check_finite(x[o:o + n], f"{sp.name}: input gradient")  # type: ignore[attr-defined]
    raise ValueError(f"{sparsifiers[0].name}: input gradient holds NaN/Inf")  # type: ignore
