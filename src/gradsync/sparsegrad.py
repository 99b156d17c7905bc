"""`SparseGrad`: the sparse gradient every layer of gradsync passes down.

A SparseGrad is a selection of entries of a flat tensor of ``numel`` elements:
``indices`` (int64, strictly increasing, in ``[0, numel)``) and ``values`` (the gradient's
dtype, one per index). It is the contract between sparsifiers, formats and collectives
(docs/architecture.md, "Contracts").

The two rules every layer shares live here, at the bottom, so that no layer writes its own:
:func:`validate_density` (a density lies in (0, 1]) and :func:`target_k` (the number of entries
a density selects from n, ``max(1, round(density · n))`` capped at n).

So do the three scatters every sparse path makes, for *distinct* indices — :func:`put_at`
(``out[idx] = src``), :func:`add_at` (``out[idx] += src``) and :func:`mark_at`
(``mask[idx] = True``) — which pick the fastest kernel per device, and the three operations on
selections that the collectives share, each written once:
:func:`sparse_sum` (the sum of several selections, added in a fixed order so that every rank
gets the same bits), :func:`isin_sorted` (membership in a sorted index list) and
:func:`top_k_mask` (the k largest magnitudes, ties to the smaller position).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "ACCELERATOR",
    "CPU",
    "CPU_AS_ACCELERATOR",
    "Kernels",
    "SparseGrad",
    "add_at",
    "all_finite",
    "all_finite_each",
    "bincount",
    "bind",
    "check_finite",
    "check_indices",
    "checked_entries",
    "constant",
    "cpu_kernels",
    "densify",
    "finite_flag",
    "flatnonzero",
    "host_kernels",
    "indices_flag",
    "iota",
    "isin_sorted",
    "kernels_for",
    "largest",
    "mark_at",
    "positions_above",
    "put_at",
    "sort_positions",
    "sparse_sum",
    "target_k",
    "to_device",
    "top_k",
    "top_k_mask",
    "using",
    "validate_density",
    "zero_unless",
]


def validate_density(density: object, what: str = "density") -> float:
    """Return ``density`` as a float if it lies in (0, 1]; raise ``ValueError`` naming ``what``
    otherwise (NaN, ±Inf, non-numbers included). The one density rule of every layer."""
    try:
        d = float(density)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a number in (0, 1], got {density!r}") from None
    if math.isnan(d) or not 0.0 < d <= 1.0:
        raise ValueError(f"{what} must be in (0, 1], got {density!r}")
    return d


def target_k(n: int, density: float) -> int:
    """k = max(1, round(density · n)) for n > 0, capped at n; 0 for an empty tensor.

    The number of entries a density selects, for every sparsifier, planner and collective.
    ``round`` is Python's (ties to even), applied to the float64 product ``density · n``."""
    if n <= 0:
        return 0
    return min(n, max(1, round(density * n)))


def all_finite(x: torch.Tensor) -> bool:
    """True when ``x`` holds no NaN/Inf."""
    return all_finite_each([x])[0]


def finite_flag(x: torch.Tensor) -> torch.Tensor:
    """Whether ``x`` holds no NaN/Inf, as a bool on its device: no read (the caller reads it
    with others). :func:`largest` is below +Inf exactly when every entry is finite: two
    operations (``aminmax`` and three scalar ones were four).

    The CPU's own kernels (:attr:`Kernels.host`, where a read costs no wait) first sum ``x``:
    a NaN or ±Inf entry makes the sum NaN or ±Inf, so a finite sum proves every entry finite,
    in one vectorized reduction that writes nothing (21 µs against ``aminmax``'s 83 on
    422,000 fp32 entries, one core). A sum that is not finite (a non-finite entry, or finite
    entries whose sum overflows the dtype, as fp16's may) is judged by :func:`largest`."""
    if not x.numel() or not x.is_floating_point():
        return torch.ones((), dtype=torch.bool, device=x.device)
    if host_kernels(x) and math.isfinite(x.sum()):
        return torch.ones((), dtype=torch.bool)
    return largest(x) < math.inf


def zero_unless(flag: torch.Tensor, x: torch.Tensor) -> None:
    """``x`` ← 0 unless ``flag`` (a 0-dim bool on ``x``'s device, :func:`finite_flag`) is true:
    the same result on every device, only the kernel differs. The CPU's own kernels
    (:attr:`Kernels.host`) read the flag, which costs no wait there, and leave a finite ``x``
    untouched; the accelerators' path writes through ``torch.where``, one kernel and no read."""
    if host_kernels(x):
        if not bool(flag):
            x.zero_()
        return
    torch.where(flag, x, constant((0,), x.dtype, x.device)[0], out=x)


def largest(x: torch.Tensor) -> torch.Tensor:
    """The largest magnitude of ``x`` (its ∞-norm, in its dtype, on its device; 0 for an
    empty or integer tensor), NaN when it holds one: torch's max reductions propagate NaN on
    every device. One reduction: a caller that keeps several compares them with +Inf in one
    operation (``torch.stack(tops) < inf``), where :func:`finite_flag` compares each.

    Accelerators: ``vector_norm(x, inf)``, one kernel. The CPU's own kernels
    (:attr:`Kernels.host`): ``max(hi, −lo)`` of ``aminmax(x)``, the same value, NaN
    propagated alike, without a pass that writes: torch's CPU ∞-norm is a scalar loop, 1.48
    ms against 0.10 ms on 422,000 fp32 entries (one core)."""
    if not x.numel() or not x.is_floating_point():
        return torch.zeros((), dtype=torch.float32, device=x.device)
    if host_kernels(x):
        lo, hi = torch.aminmax(x)
        return torch.maximum(hi, -lo)
    return torch.linalg.vector_norm(x, math.inf)


def all_finite_each(xs: Sequence[torch.Tensor]) -> list[bool]:
    """:func:`all_finite` of each tensor of ``xs``: one reduction pass per tensor and one
    device-to-host transfer per device (on a GPU each transfer waits for the queued work).

    NaN propagates through min/max and ±Inf shows up in them, so each tensor's ``aminmax`` is
    all it takes; the extremes of every tensor on a device are read back in one copy and judged
    on the host (no per-tensor ``isfinite`` kernels: on a GPU those were ten launches per
    tensor). Empty and non-floating tensors are finite."""
    out = [True] * len(xs)
    by_device: dict[torch.device, list[int]] = {}
    extremes: dict[torch.device, list[torch.Tensor]] = {}
    for i, x in enumerate(xs):
        if x.is_floating_point() and x.numel():
            by_device.setdefault(x.device, []).append(i)
            extremes.setdefault(x.device, []).extend(torch.aminmax(x))
    for device, members in by_device.items():
        lo_hi = torch.stack(extremes[device]).tolist()
        for i, lo, hi in zip(members, lo_hi[0::2], lo_hi[1::2]):
            out[i] = math.isfinite(lo) and math.isfinite(hi)
    return out


def check_finite(x: torch.Tensor, what: str = "tensor") -> None:
    """Raise ``ValueError`` naming ``what`` when ``x`` holds a NaN or an Inf."""
    if not all_finite(x):
        n_nan = int(torch.isnan(x).sum())
        n_inf = int(torch.isinf(x).sum())
        raise ValueError(f"{what} holds non-finite values ({n_nan} NaN, {n_inf} Inf)")


def check_indices(indices: torch.Tensor, numel: int, what: str) -> None:
    """Raise ``ValueError`` (prefixed ``what``) unless the 1-D integer ``indices`` are strictly
    increasing (sorted, no duplicates) and lie in ``[0, numel)``. Vectorised: one comparison
    pass, and the range follows from the first and last index. Used by :class:`SparseGrad` and
    by every decoder that reads indices off the wire."""
    m = indices.numel()
    if not m:
        return
    if m > 1 and not bool((indices[1:] > indices[:-1]).all()):
        raise ValueError(f"{what}: indices must be strictly increasing (unsorted or duplicate)")
    lo, hi = int(indices[0]), int(indices[-1])
    if lo < 0 or hi >= numel:
        raise ValueError(f"{what}: indices out of range [0, {numel}): min {lo}, max {hi}")


def indices_flag(indices: torch.Tensor, hi: int, lo: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`check_indices` on the device, without a read: ``(safe, inside, ok)``. ``ok``
    (a bool tensor) says that the 1-D int64 ``indices`` are strictly increasing and lie in
    ``[lo, hi)``; ``inside`` marks the entries in that range and ``safe`` is ``indices`` with
    the others replaced by ``lo``, so that a malformed message writes nowhere before the
    caller reads ``ok`` with the step's other checks (zero the values outside ``inside``).
    The verdict comes from the extremes and the smallest step (reductions, several times
    cheaper than ``all()`` of a comparison on the CPU)."""
    dev = indices.device
    if not indices.numel():
        return indices, torch.ones(0, dtype=torch.bool, device=dev), \
            torch.ones((), dtype=torch.bool, device=dev)
    if hi > lo:
        inside = indices.clamp(lo, hi - 1) == indices
    else:  # an empty range holds nothing
        inside = torch.zeros(indices.shape, dtype=torch.bool, device=dev)
    first, last = torch.aminmax(indices)
    ok = (first >= lo) & (last < hi)
    if indices.numel() > 1:
        ok &= torch.diff(indices).min() > 0
    return torch.where(inside, indices, lo), inside, ok


def checked_entries(indices: torch.Tensor, values: torch.Tensor, hi: int, lo: int,
                    checks: list[tuple[torch.Tensor, str]], what: str
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """A peer's entries, whose indices must be strictly increasing in ``[lo, hi)``, made safe
    to use before anyone reads the verdict (:func:`indices_flag`): a bad index is moved into
    the range with its value zeroed, and ``(ok, "<what>: indices must be strictly increasing in
    [lo, hi)")``, ``ok`` a bool on the device, is appended to ``checks`` for the caller to
    read with the step's others. Every collective's received entries go through here."""
    safe, inside, ok = indices_flag(indices, hi, lo)
    checks.append((ok, f"{what}: indices must be strictly increasing in [{lo}, {hi})"))
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    return safe, torch.where(inside, values, zero)


# -- the kernels per device -----------------------------------------------------------------
@dataclass(frozen=True)
class Kernels:
    """The kernels and the path of selection a device's tensors take; chosen from the device
    (:func:`kernels_for`), never from a switch a run can flip.

    ``host``: compactions, sorts, selections and scatters take the CPU's own kernels (numpy's
    ``flatnonzero``, ``argsort``, ``partition`` and ``packbits``; ``scatter_``), else the
    accelerators' (``torch.nonzero`` / ``nonzero_static``, ``torch.sort``, ``kthvalue``, the
    ``index_*_`` scatters). Both give the same bits; the choice is one of speed.
    ``segmented``: a fusion buffer is selected at once (:func:`gradsync.sparsify.segments.
    pays_on`), with the device's reads deferred, else tensor by tensor.
    ``check_counts``: :func:`flatnonzero` checks a count it is told against the mask (one read,
    which a GPU could not afford): for the CPU standing in for an accelerator in the tests."""

    name: str
    host: bool
    segmented: bool
    check_counts: bool = False


#: The CPU's own kernels and path.
CPU = Kernels("cpu", host=True, segmented=False)
#: An accelerator's (CUDA, ROCm, MPS…), without checks it could not afford.
ACCELERATOR = Kernels("accelerator", host=False, segmented=True)
#: The CPU standing in for an accelerator, as the tests run it: the accelerators' kernels and
#: path, with the given counts checked. CI has no GPU; this is how its branches run there.
CPU_AS_ACCELERATOR = Kernels("cpu-as-accelerator", host=False, segmented=True,
                             check_counts=True)

#: ``GRADSYNC_CPU_AS_ACCELERATOR=1`` in the environment: the CPU's tensors take
#: :data:`CPU_AS_ACCELERATOR` wherever no caller chose otherwise (spawned ranks inherit it).
CPU_AS_ACCELERATOR_ENV = "GRADSYNC_CPU_AS_ACCELERATOR"

# Which kernels the CPU's tensors take in this context (a thread's, or a task's): set only
# through `using` and `bind`, so a choice never outlives the code that made it.
_CPU_KERNELS: contextvars.ContextVar[Kernels] = contextvars.ContextVar(
    "gradsync_cpu_kernels",
    default=CPU_AS_ACCELERATOR if os.environ.get(CPU_AS_ACCELERATOR_ENV, "") == "1" else CPU)


def kernels_for(device: torch.device) -> Kernels:
    """The kernels ``device``'s tensors take: an accelerator's are :data:`ACCELERATOR`; the
    CPU's are :data:`CPU` unless the caller chose others for it (:func:`using`)."""
    return _CPU_KERNELS.get() if device.type == "cpu" else ACCELERATOR


def cpu_kernels() -> Kernels:
    """The kernels the CPU's tensors take here: hand them to a thread or process you start
    (:func:`bind`), as the engine's threads and the test ranks take their caller's."""
    return _CPU_KERNELS.get()


@contextlib.contextmanager
def using(kernels: Kernels) -> Iterator[Kernels]:
    """Within the block (and the threads gradsync starts in it), the CPU's tensors take
    ``kernels``: a test or a benchmark runs the accelerators' branches on the CPU so."""
    token = _CPU_KERNELS.set(kernels)
    try:
        yield kernels
    finally:
        _CPU_KERNELS.reset(token)


def bind(kernels: Kernels) -> None:
    """This thread's CPU tensors take ``kernels`` from now on: for a thread's initializer or a
    rank's entry point, which hand on their starter's choice (:func:`cpu_kernels`)."""
    _CPU_KERNELS.set(kernels)


def host_kernels(t: torch.Tensor) -> bool:
    """Whether ``t``'s compactions, sorts, selections and scatters take the CPU's own kernels
    (:attr:`Kernels.host` of :func:`kernels_for` its device)."""
    return kernels_for(t.device).host


def _positions(mask: np.ndarray) -> torch.Tensor:
    """numpy's ``flatnonzero`` of a host mask, as an int64 tensor (zero-copy both ways)."""
    return torch.from_numpy(np.flatnonzero(mask).astype(np.int64, copy=False))


#: dtypes numpy compares as torch does (bf16 has no numpy dtype)
_NUMPY_FLOATS = (torch.float16, torch.float32, torch.float64)


def positions_above(a: torch.Tensor, thr: torch.Tensor | float, strict: bool = False
                    ) -> torch.Tensor:
    """:func:`flatnonzero` of ``a >= thr`` (``a > thr`` when ``strict``) for a 1-D ``a`` and
    a scalar (or 0-dim) ``thr``, compared in ``a``'s dtype as torch compares them (``thr``
    rounded to it): a threshold sparsifier's selection. On the CPU's own kernels numpy
    compares, without a torch bool pass: 0.05 ms against torch's 0.40 on 422,000 fp32
    entries (one core; torch's CPU comparisons to bool are not vectorized)."""
    if host_kernels(a) and a.dtype in _NUMPY_FLOATS:
        an = a.numpy()
        with np.errstate(over="ignore"):  # beyond the dtype's range: ±inf, as torch rounds
            t = np.asarray(float(thr), dtype=an.dtype)
        return _positions(np.greater(an, t) if strict else np.greater_equal(an, t))
    return flatnonzero(a > thr if strict else a >= thr)


def sort_positions(idx: torch.Tensor) -> torch.Tensor:
    """The distinct int64 positions ``idx`` (1-D) in increasing order: a selection's indices
    after a top-k that left them unordered. The CPU's own kernels sort with numpy, 0.02 ms
    against ``torch.sort``'s 0.15 on 4,216 positions (one core); distinct keys make both
    orders the same."""
    if host_kernels(idx):
        return torch.from_numpy(np.sort(idx.numpy()))
    return torch.sort(idx).values


def flatnonzero(mask: torch.Tensor, count: int | None = None, *,
                fill_value: int | None = None) -> torch.Tensor:
    """Positions (int64, increasing) of the True entries of a 1-D bool tensor: the compaction
    every sparse path needs. On CPU numpy's ``flatnonzero`` (zero-copy views both ways; torch's
    CPU ``nonzero`` is several times slower, ``nonzero_static`` ten times), elsewhere
    ``torch.nonzero``, or ``torch.nonzero_static`` when the caller knows the ``count`` (no
    wait for the device). A wrong ``count`` would pad the positions with −1 or drop some
    there, silently; the CPU standing in for an accelerator checks it (:attr:`Kernels.check_counts`,
    one read) and raises ``RuntimeError``.

    ``fill_value``: a count that may be wrong (one from a peer, which the caller checks
    itself): the accelerators' kernels pad with this valid position instead, unchecked; the
    CPU's return the positions there are."""
    if host_kernels(mask):
        return _positions(mask.numpy())
    if count is not None:
        if fill_value is not None:
            return torch.nonzero_static(mask, size=count, fill_value=fill_value).view(-1)
        if kernels_for(mask.device).check_counts:
            held = int(torch.count_nonzero(mask))
            if held != count:
                raise RuntimeError(f"flatnonzero: told {count} positions, the mask holds "
                                   f"{held}")
        return torch.nonzero_static(mask, size=count).view(-1)
    return torch.nonzero(mask).view(-1)


# The scatters of distinct indices. Measured on CPU (one thread, 1.3 M sorted distinct indices
# into 4 M fp32): index_copy_ 4.0 ms, scatter_ 2.0 ms; index_fill_ of a bool 4.2 ms, scatter_ of
# ones into its bytes 1.8 ms; index_add_ 2.3–2.8 ms, scatter_add_ 1.9–2.4 ms. With distinct
# indices every target is written (or added to) once, so both kernels give the same bits; on
# other devices the index_* kernels stay (their deterministic variants are the documented ones).
def put_at(out: torch.Tensor, idx: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``out[idx] = src`` along dim 0 of 1-D tensors, for distinct int64 ``idx``; returns
    ``out``. Moves values as they are (pass integer views to keep NaN payloads)."""
    if host_kernels(out):
        return out.scatter_(0, idx, src)
    return out.index_copy_(0, idx, src)


def add_at(out: torch.Tensor, idx: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``out[idx] += src`` along dim 0 of 1-D tensors, for distinct int64 ``idx``: one addition
    per target, so the same bits on every rank whichever kernel runs; returns ``out``."""
    if host_kernels(out):
        return out.scatter_add_(0, idx, src)
    return out.index_add_(0, idx, src)


def mark_at(mask: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``mask[idx] = True`` for a 1-D bool ``mask`` and int64 ``idx``; returns ``mask``."""
    if host_kernels(mask):
        mask.view(torch.uint8).scatter_(0, idx, torch.ones(idx.numel(), dtype=torch.uint8))
        return mask
    return mask.index_fill_(0, idx, True)


#: :func:`isin_sorted` marks a bitmap over ``ref``'s span when that span is at most this many
#: times the entries; otherwise it binary-searches.
DENSE_SPAN_FACTOR = 16

#: :func:`sparse_sum` scatters into a dense buffer over the parts' index span when the span is
#: at most this many times the number of entries; otherwise it merges the sorted parts. Measured
#: on CPU (one thread, fp32, 2 parts of 200 k entries): the scatter took 4.9 ms at span 5×, the
#: merge 4.5 ms; at span 10× 9.8 against 4.4 ms (a fresh 16 MB buffer costs its page faults);
#: at span 3× 1.7 against 3.7 ms; 8 parts of 100 k at span 5×: 12.9 against 19.5 ms.
SUM_SPAN_FACTOR = 8


def sparse_sum(parts: Sequence[tuple[torch.Tensor, torch.Tensor]],
               dtype: torch.dtype | None = None, *, within: tuple[int, int] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The sum of several sparse selections: the one merge of every collective.

    ``parts`` are ``(indices, values)`` pairs, each with 1-D int64 indices strictly increasing
    (as in a :class:`SparseGrad`; not re-checked here) and one value per index, all on one
    device. Returns ``(indices, sums)``: the sorted union of the indices and, per index, the
    sum in ``dtype`` (default: the first part's value dtype) of the values of the parts that
    hold it, formed as ``((0 + v_a) + v_b) + …`` in the order of ``parts``. The order is fixed
    and each index receives one addition per part that holds it, in part order, so the same
    parts in the same order give the same bits on every rank and device, whichever path runs.

    Two paths (:data:`SUM_SPAN_FACTOR`): when the parts' index span is at most that many times
    the entries m, a scatter into a dense buffer over the span, O(m + span); otherwise a merge
    of the sorted parts: a stable sort of their concatenation (on CPU numpy's timsort, which
    merges the P sorted runs in O(m log P)), then per index its first value and, level by level,
    the later parts' values (one :func:`add_at` per level, every target once).

    ``within=(lo, hi)``: every index lies in ``[lo, hi)`` (the caller knows it: a region it
    owns, whose indices it checked), which then stands for the parts' span instead of their
    first and last indices (two host reads per part on a GPU). The bits are the same.
    """
    if not parts:
        raise ValueError("sparse_sum: no parts")
    dtype = parts[0][1].dtype if dtype is None else dtype
    dev = parts[0][0].device
    parts = [(i, v) for i, v in parts if i.numel()]
    if not parts:
        return (torch.empty(0, dtype=torch.int64, device=dev),
                torch.empty(0, dtype=dtype, device=dev))
    if len(parts) == 1:
        i, v = parts[0]
        return i, torch.zeros(i.numel(), dtype=dtype, device=dev).add_(v)
    m = sum(i.numel() for i, _ in parts)
    if within is None:
        lo, hi = min(int(i[0]) for i, _ in parts), max(int(i[-1]) for i, _ in parts)
    else:
        lo, hi = within[0], within[1] - 1
    span = hi - lo + 1
    if span <= SUM_SPAN_FACTOR * m:
        acc = torch.zeros(span, dtype=dtype, device=dev)
        hit = torch.zeros(span, dtype=torch.bool, device=dev)
        for i, v in parts:
            local = i - lo if lo else i
            add_at(acc, local, v.to(dtype))
            mark_at(hit, local)
        at = flatnonzero(hit)
        return (at + lo if lo else at), torch.index_select(acc, 0, at)
    return _merge(parts, dtype)


def _merge(parts: Sequence[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sparse_sum` of two or more non-empty parts by merging them (see there)."""
    cat = torch.cat([i for i, _ in parts])
    if host_kernels(cat):  # timsort finds the parts' sorted runs and merges them
        order = torch.from_numpy(np.argsort(cat.numpy(), kind="stable"))
    else:
        order = torch.sort(cat, stable=True).indices
    idx_all = torch.index_select(cat, 0, order)
    val_all = torch.index_select(torch.cat([v.to(dtype) for _, v in parts]), 0, order)
    first = torch.ones(idx_all.numel(), dtype=torch.bool, device=cat.device)
    torch.ne(idx_all[1:], idx_all[:-1], out=first[1:])  # each index's first (earliest) part
    starts = flatnonzero(first)
    out = torch.zeros(starts.numel(), dtype=dtype, device=cat.device)
    out.add_(torch.index_select(val_all, 0, starts))
    if starts.numel() < idx_all.numel():
        # the later parts' entries, in part order per index (their count is known)
        later = flatnonzero(~first, idx_all.numel() - starts.numel())
        # the index a later entry belongs to: its position less the later entries up to it
        group = later - torch.arange(1, later.numel() + 1, device=cat.device)
        if len(parts) == 2:  # one later entry per index at most
            add_at(out, group, torch.index_select(val_all, 0, later))
        else:
            level = later - torch.index_select(starts, 0, group)  # 1: second part holding it
            # every level's count in one read: below len(parts), unless a part repeats an
            # index (a malformed message, which its caller's check rejects); then all of them
            depth = len(parts)
            sizes = bincount(level.clamp(max=depth), depth + 1).tolist()
            if sizes[depth]:
                sizes = bincount(level, int(level.max()) + 1).tolist()
            for j in range(1, len(sizes)):
                if not sizes[j]:
                    continue
                at = flatnonzero(level == j, sizes[j])
                add_at(out, torch.index_select(group, 0, at),
                       torch.index_select(val_all, 0, torch.index_select(later, 0, at)))
    return torch.index_select(idx_all, 0, starts), out


def isin_sorted(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``torch.isin(x, ref)`` for a strictly increasing int64 ``ref`` (``x``: any int64), without
    ``isin``'s sorts: a bitmap over ``ref``'s span when that span is at most
    ``DENSE_SPAN_FACTOR`` × the entries (O(span + |x| + |ref|)), else a binary search per
    element of ``x`` (O(|x| log |ref|)). The span is ``ref``'s least and greatest entry (one
    read), so an unsorted ``ref`` (from a malformed message, flagged elsewhere) gives a wrong
    answer but writes nothing out of place."""
    if ref.numel() == 0 or x.numel() == 0:
        return torch.zeros(x.shape, dtype=torch.bool, device=x.device)
    lo, hi = torch.stack(torch.aminmax(ref)).tolist()
    span = hi - lo + 1
    if span <= DENSE_SPAN_FACTOR * (x.numel() + ref.numel()):
        bitmap = torch.zeros(span + 2, dtype=torch.bool, device=x.device)  # ends: outside
        mark_at(bitmap, ref - (lo - 1))
        return torch.index_select(bitmap, 0, (x - (lo - 1)).clamp_(0, span + 1))
    pos = torch.searchsorted(ref, x).clamp_(max=ref.numel() - 1)
    return ref[pos] == x


# The candidates' share of the exact top-k (top_k): a threshold that a strided sample says
# about CANDIDATES · k entries pass.
CANDIDATES = 2


def top_k(a: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(a, k, sorted=False)`` of a 1-D ``a`` (magnitudes: the exact Top-k's
    selection, Ok-Topk's recomputed threshold). On the CPU's own kernels through candidates:
    the (CANDIDATES·k·s/n)-th largest of a strided sample of s entries is a threshold about
    CANDIDATES·k entries pass (:func:`positions_above`: one compare and compaction); when at
    least k pass, every entry left out lies below k of them, so their top-k is the top-k of all
    (the same entries; which of several equal to the k-th is taken may differ). One full
    ``torch.topk`` of 422,000 fp32 entries at k = 1 % took 2.9 ms on one core, its candidates'
    0.4 ms (docs/results/speed.md, "Ok-Topk's exact threshold"). Elsewhere, for n ≤ 4096 or
    k ≥ n/4, and where fewer than k pass: ``torch.topk`` of every entry."""
    n = a.numel()
    s = min(n, max(4096, n // 100))
    if not host_kernels(a) or k >= n // 4 or s == n:
        return torch.topk(a, k, sorted=False)
    stride = n // s
    q = min(s, math.ceil(CANDIDATES * k * s / n))
    thr = torch.topk(a[::stride], q, sorted=False).values.min()
    cand = positions_above(a, thr)
    if cand.numel() < k:
        return torch.topk(a, k, sorted=False)
    vals, j = torch.topk(a[cand], k, sorted=False)
    return vals, cand[j]


def top_k_mask(values: torch.Tensor, k: int) -> torch.Tensor:
    """Keep-mask of the ``k`` entries of largest ``|values|``, ties going to the smaller
    position: the first k of a stable descending sort by magnitude, found in O(m) by a
    selection of the k-th largest magnitude (NaN magnitudes rank above every number; with a
    NaN present the sort itself runs)."""
    m = values.numel()
    if k >= m:
        return torch.ones(m, dtype=torch.bool, device=values.device)
    if k <= 0:
        return torch.zeros(m, dtype=torch.bool, device=values.device)
    a = values.abs()
    if a.dtype in (torch.float16, torch.bfloat16):
        a = a.float()  # exact; kthvalue lacks half kernels on some backends
    nan = torch.isnan(a)
    if bool(nan.any()):  # the sort's order: NaN first
        keep = torch.zeros(m, dtype=torch.bool, device=values.device)
        keep[torch.argsort(a, descending=True, stable=True)[:k]] = True
        return keep
    if host_kernels(a):  # the k-th largest magnitude; numpy's selection is ~10x faster
        theta = float(np.partition(a.numpy(), m - k)[m - k])
    else:
        theta = float(torch.kthvalue(a, m - k + 1).values)
    # theta is one of a's values: the comparisons are exact in a's dtype. Without ties at
    # theta (the usual case) the entries >= theta are exactly k: one pass.
    keep = a >= theta
    if int(torch.count_nonzero(keep)) == k:
        return keep
    keep = a > theta  # ties at theta: the first ``need`` of them by position
    need = k - int(torch.count_nonzero(keep))
    keep.index_fill_(0, flatnonzero(a == theta)[:need], True)
    return keep


_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}  # same-width integer of a value dtype


def densify(parts: Sequence[tuple[torch.Tensor, torch.Tensor]], numel: int, dtype: torch.dtype,
            device: torch.device | str) -> torch.Tensor:
    """A zero tensor of ``numel`` elements with each part's values written at its indices, bit
    for bit (NaN payloads kept). The parts' indices must be disjoint (e.g. the regions of a
    reduce-scatter, one owner each): no concatenation of the parts first."""
    out = torch.zeros(numel, dtype=dtype, device=device)
    bits = _BITS.get(out.element_size())
    for idx, val in parts:
        if not idx.numel():
            continue
        if bits is None:
            out[idx] = val
        else:  # on the bit patterns: cheaper than out[i] = v, and NaN payloads kept
            put_at(out.view(bits), idx, val.contiguous().view(bits))
    return out


@dataclass(frozen=True, eq=False)
class SparseGrad:
    """Sparse selection ``(indices, values)`` of a flat tensor of ``numel`` elements.

    Construction validates: indices must be a 1-D int64 tensor, strictly increasing (so no
    duplicates), in ``[0, numel)``; values must be 1-D, floating point, of the same length and
    on the same device. Violations raise ``ValueError``. Pass ``validate=False`` only for
    indices you produced yourself in sorted order (the hot path of a collective).

    ``dense_prefix`` (m, default 0) says that the first m entries are the tensor's first m
    elements, indices ``0 … m−1``: tensors sent whole at the front of a fused buffer (SSFusion's
    excluded tensors). It is a promise about the indices, not a different selection, so every
    collective stays correct when it ignores it; TopkA uses it to send those m values without
    their indices (:func:`gradsync.formats.wire.pack_entries`); :meth:`to` keeps it. Validated
    like the indices (``0 ≤ m ≤ nnz``, ``m ≤ numel``, ``indices[m−1] == m−1``).

    ``capacity`` (default ``None``: unknown) bounds nnz by a number that every rank knows
    without asking the others: a selection of at most k_i entries per tensor of a plan that all
    ranks share (``sparsify.select_buffer`` of DGC or exact top-k: Σ k_i; a tensor sent whole:
    its size). TopkA then sends one message of that fixed size with the count inside, so no
    rank reads a count back before the values travel. Validated ``nnz ≤ capacity``.
    """

    indices: torch.Tensor
    values: torch.Tensor
    numel: int
    dense_prefix: int = 0
    capacity: int | None = None

    def __init__(
        self, indices: torch.Tensor, values: torch.Tensor, numel: int, *, validate: bool = True,
        dense_prefix: int = 0, capacity: int | None = None,
    ) -> None:
        object.__setattr__(self, "indices", indices)
        object.__setattr__(self, "values", values)
        object.__setattr__(self, "numel", int(numel))
        object.__setattr__(self, "dense_prefix", int(dense_prefix))
        object.__setattr__(self, "capacity", None if capacity is None else int(capacity))
        if validate:
            self._validate()

    def _validate(self) -> None:
        i, v, n = self.indices, self.values, self.numel
        if not isinstance(i, torch.Tensor) or not isinstance(v, torch.Tensor):
            raise ValueError("SparseGrad: indices and values must be torch.Tensors")
        if n < 0:
            raise ValueError(f"SparseGrad: numel must be >= 0, got {n}")
        if i.dtype != torch.int64:
            raise ValueError(f"SparseGrad: indices must be int64, got {i.dtype}")
        if i.dim() != 1 or v.dim() != 1:
            raise ValueError(
                f"SparseGrad: indices and values must be 1-D, got shapes "
                f"{tuple(i.shape)} and {tuple(v.shape)}"
            )
        if i.numel() != v.numel():
            raise ValueError(
                f"SparseGrad: {i.numel()} indices but {v.numel()} values (shape mismatch)"
            )
        if not v.is_floating_point():
            raise ValueError(f"SparseGrad: values must be floating point, got {v.dtype}")
        if i.device != v.device:
            raise ValueError(f"SparseGrad: indices on {i.device} but values on {v.device}")
        check_indices(i, n, "SparseGrad")
        m = self.dense_prefix
        if m < 0 or m > i.numel():
            raise ValueError(f"SparseGrad: dense_prefix must lie in [0, nnz={i.numel()}], "
                             f"got {m}")
        if self.capacity is not None and not i.numel() <= self.capacity:
            raise ValueError(f"SparseGrad: {i.numel()} entries exceed the capacity "
                             f"{self.capacity}")
        if m and int(i[m - 1]) != m - 1:  # strictly increasing from >= 0: then 0 … m−1
            raise ValueError(f"SparseGrad: dense_prefix={m} but the first {m} indices are not "
                             f"0 … {m - 1}")

    # -- construction ------------------------------------------------------------------
    @classmethod
    def empty(
        cls, numel: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
    ) -> SparseGrad:
        """The empty selection of a tensor of ``numel`` elements."""
        return cls(
            torch.empty(0, dtype=torch.int64, device=device),
            torch.empty(0, dtype=dtype, device=device),
            numel,
            validate=False,
        )

    @classmethod
    def from_dense(cls, x: torch.Tensor) -> SparseGrad:
        """Select the nonzeros of the flat view of ``x``."""
        flat = x.reshape(-1)
        idx = torch.nonzero(flat, as_tuple=False).reshape(-1)
        return cls(idx, flat[idx], flat.numel(), validate=False)

    @classmethod
    def from_indices(cls, x: torch.Tensor, indices: torch.Tensor) -> SparseGrad:
        """Gather ``x`` at ``indices`` (any order, no duplicates) into a valid SparseGrad."""
        flat = x.reshape(-1)
        idx = sort_positions(indices.to(torch.int64).reshape(-1))
        return cls(idx, flat[idx], flat.numel())

    # -- views -------------------------------------------------------------------------
    def __len__(self) -> int:
        return int(self.indices.numel())

    @property
    def nnz(self) -> int:
        return len(self)

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    @property
    def device(self) -> torch.device:
        return self.values.device

    @property
    def density(self) -> float:
        """Selected fraction of the tensor (0.0 for an empty tensor)."""
        return len(self) / self.numel if self.numel else 0.0

    def to_dense(self) -> torch.Tensor:
        """Dense flat tensor of ``numel`` elements with the selected values scattered in (a
        copy of the values when every entry is the dense prefix: no scatter)."""
        if self.dense_prefix == self.numel == self.values.numel():
            return self.values.clone()
        return densify([(self.indices, self.values)], self.numel, self.values.dtype,
                       self.values.device)

    def wire_bytes(self, index_bytes: int = 4) -> int:
        """COO size on the wire: ``nnz × (index_bytes + value bytes)`` (every index, the dense
        prefix's too; TopkA's message leaves those out: ``formats.wire.entries_bytes``)."""
        if index_bytes not in (4, 8):
            raise ValueError(f"index_bytes must be 4 or 8, got {index_bytes}")
        return len(self) * (index_bytes + self.values.element_size())

    def to(self, *args, **kwargs) -> SparseGrad:
        """Move/cast the values (``.to(dtype)``/``.to(device)``); indices follow the device."""
        v = self.values.to(*args, **kwargs)
        return SparseGrad(self.indices.to(v.device), v, self.numel, validate=False,
                          dense_prefix=self.dense_prefix, capacity=self.capacity)

    def __repr__(self) -> str:
        return (
            f"SparseGrad(nnz={len(self)}, numel={self.numel}, density={self.density:.4g}, "
            f"dtype={self.values.dtype}, device={self.values.device})"
        )


# -- small device vectors (every layer's: no read, no wait) ---------------------------------
def to_device(values: Sequence[float] | Sequence[int], dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
    """A small host vector on ``device`` without waiting for the device: on CUDA it is staged in
    pinned memory and copied asynchronously (a plain copy from pageable memory waits for the
    stream)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def bincount(idx: torch.Tensor, nbins: int) -> torch.Tensor:
    """``torch.bincount(idx, minlength=nbins)`` for ``idx`` in ``[0, nbins)`` (int64), without
    a wait: on CUDA ``bincount`` reads the input's minimum and maximum back to size its output.
    A scatter-add of ones instead (integer atomics: exact in any order; deterministic mode
    takes torch's deterministic path for a 1-D scatter-add)."""
    one = constant((1,), torch.int64, idx.device).expand(idx.numel())  # never written
    return torch.zeros(nbins, dtype=torch.int64, device=idx.device).scatter_add_(0, idx, one)


_IOTA: dict[torch.device, torch.Tensor] = {}


def iota(n: int, device: torch.device) -> torch.Tensor:
    """``torch.arange(n)`` (int64) on ``device`` as a view of one vector kept per device (made
    again, twice as long, when a longer one is asked for): no operation per call where a
    step's sizes vary (a sample's length, a step's counts). Never written to."""
    have = _IOTA.get(device)
    if have is None or have.numel() < n:
        have = torch.arange(max(n, 2 * (0 if have is None else have.numel())), device=device)
        _IOTA[device] = have
    return have[:n]


@functools.lru_cache(maxsize=256)
def constant(values: tuple[float, ...] | tuple[int, ...], dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
    """:func:`to_device` of a vector that a buffer's layout fixes (its sizes, its tensors'
    starts), made once per layout and device (no copy per step); never written to."""
    return to_device(values, dtype, device)
