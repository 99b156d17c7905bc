"""The sparsifier contract: ``select(x, step=…) -> SparseGrad`` on a flat tensor.

Every sparsifier targets ``k = target_k(n, density) = max(1, round(density · n))`` entries of
an ``n``-element tensor (all of them when ``density == 1``), never modifies ``x``, draws any
randomness from its own seeded ``torch.Generator`` (never the global RNG), rejects NaN/Inf input
with ``ValueError`` (the engine decides the policy), and works on fp32, bf16 and fp16.
``target_k`` and ``validate_density`` are :mod:`gradsync.sparsegrad`'s, re-exported here and as
``gradsync.sparsify.target_k`` / ``gradsync.sparsify.validate_density``.

Threshold estimators do not hit ``k`` exactly; each reports the relative deviation of its last
count from ``k`` in ``last_deviation`` so callers and benchmarks can see how far off it was.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch

from gradsync.sparsegrad import (
    SparseGrad,
    all_finite_each,
    check_finite,
    sort_positions,
    target_k,
    validate_density,
)

__all__ = ["Sparsifier", "magnitudes", "seed_for", "select_each", "target_k",
           "validate_density"]


def seed_for(seed: int, key: str, rank: int) -> int:
    """The seed of one sparsifier's generator: the run's ``seed``, the tensor or buffer ``key``
    and the ``rank`` mixed (FNV-1a of the key, stable across processes and Python versions), so
    that no two tensors and no two ranks draw the same random stream. Every integration uses
    this one rule."""
    h = 1469598103934665603
    for b in key.encode():
        h = ((h ^ b) * 1099511628211) % 2**64
    return (int(seed) * 1_000_003 + h * 31 + int(rank)) % 2**62


def magnitudes(x: torch.Tensor) -> torch.Tensor:
    """|x| in fp32: thresholds are Python floats (DGC's a float64 0-dim tensor), and comparing
    them against a bf16/fp16 tensor would round the threshold to the tensor's dtype. fp32
    magnitudes compare exactly."""
    return x.abs().float()


class LazyScalar:
    """A per-selection figure (a threshold, a count of corrections) that a selection may leave
    as a 0-dim tensor on the input's device: read back, cast, only when asked for (reading it
    waits for the device; the selection itself does not)."""

    def __init__(self, cast: type) -> None:
        self.cast = cast

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = "_" + name

    def __get__(self, obj: object, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        value = obj.__dict__.get(self.slot)
        if isinstance(value, torch.Tensor):
            value = obj.__dict__[self.slot] = self.cast(value)
        return value

    def __set__(self, obj: object, value: Any) -> None:
        obj.__dict__[self.slot] = value

    def raw(self, obj: object) -> Any:
        """The value as stored, a 0-dim tensor while unread: for code that keeps it on the
        device (``type(obj).<name>.raw(obj)``)."""
        return obj.__dict__.get(self.slot)


class Sparsifier(ABC):
    """Base class: validation, k, deviation reporting, state; subclasses implement ``_select``.

    ``_select(x, k, step)`` receives a 1-D, finite, floating tensor with ``0 < k < n`` and
    returns the selected int64 indices (any order, no duplicates). The base class handles
    ``k == n`` (density 1 or tiny tensors), sorting, gathering the values and the deviation.
    """

    name: str = "?"  # set by ``registry.register(name)``
    # the threshold of the last selection (None: a selector without one)
    last_threshold = LazyScalar(float)

    def __init__(self, density: float, *, seed: int = 0) -> None:
        self.density = validate_density(density)
        self.seed = int(seed)
        self.generator = torch.Generator().manual_seed(self.seed)
        self.last_k = 0
        self.last_count = 0
        # Threshold estimators record the magnitude threshold of their last selection (every
        # selected entry has |x| >= last_threshold); None for selectors without one.
        self.last_threshold = None

    # -- public -----------------------------------------------------------------------
    def select(self, x: torch.Tensor, step: int = 0, *, checked: bool = False) -> SparseGrad:
        """Select about ``k`` entries of the flat tensor ``x`` (not modified). A NaN/Inf in
        ``x`` raises ``ValueError``, unless ``checked``: the caller has checked the gradients
        that ``x`` accumulates (the engine's non-finite policy, read with the step's other
        checks), so the selection makes no read of its own for it (as ``select_buffer``)."""
        self._check_input(x)
        if not checked:
            check_finite(x, f"{self.name}: input gradient")
        return self._select_finite(x, step)

    def _check_input(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{self.name}: expected a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 1:
            raise ValueError(f"{self.name}: expected a 1-D tensor, got shape {tuple(x.shape)}")
        if not x.is_floating_point():
            raise ValueError(f"{self.name}: expected a floating tensor, got {x.dtype}")

    def _select_finite(self, x: torch.Tensor, step: int) -> SparseGrad:
        """:meth:`select` of an ``x`` already checked (shape, dtype, finite)."""
        n = x.numel()
        k = target_k(n, self.density)
        if k >= n:
            idx = torch.arange(n, device=x.device)
        else:
            idx = self._select(x, k, step)
            idx = sort_positions(idx.to(torch.int64))
        self.last_k, self.last_count = k, int(idx.numel())
        # at most min(k, n) entries, a bound every rank knows (SparseGrad.capacity): on the
        # accelerators' path TopkA then exchanges no counts, as for a buffer's segmented one
        return SparseGrad(idx, x[idx], n, validate=False,
                          capacity=min(k, n) if self.at_most_k else None)

    @property
    def last_deviation(self) -> float:
        """(count − k) / k of the last call (0.0 before any call)."""
        return (self.last_count - self.last_k) / self.last_k if self.last_k else 0.0

    def rescale(self, factor: float) -> None:
        """The inputs are ``factor`` times larger from the next call on (a loss scale that
        changed): a threshold kept between calls is multiplied by ``factor``, so it selects
        what it would have selected from the unscaled inputs. Nothing to do for a sparsifier
        that estimates its threshold from every call's input (the default)."""
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"density": self.density, "seed": self.seed,
                "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if float(state["density"]) != self.density:
            raise ValueError(
                f"{self.name}: state was saved with density {state['density']}, "
                f"this sparsifier has {self.density}"
            )
        self.seed = int(state["seed"])
        self.generator.set_state(state["generator"])

    def __repr__(self) -> str:
        return f"{type(self).__name__}(density={self.density:g})"

    # -- segmented selection (gradsync.sparsify.segments) ----------------------------
    # A subclass that can select every tensor of a buffer at once defines
    # ``_select_segments(sparsifiers, x, segments, ks, step) -> indices`` as a classmethod:
    # ``x`` is the finite buffer, ``ks`` each tensor's k; it returns the sorted buffer
    # positions that selecting each tensor with its own sparsifier would give, and leaves
    # each sparsifier's generator and ``last_*`` figures as those selections would.
    _select_segments = None
    # whether a selection never holds more than its k entries (exact top-k; DGC keeps the k
    # largest candidates): a buffer's selection is then at most Σ k_i, a capacity every rank
    # knows (SparseGrad.capacity)
    at_most_k: bool = False

    @classmethod
    def segments_compatible(cls, sparsifiers: Sequence[Sparsifier]) -> bool:
        """Whether ``sparsifiers`` (all of this class) can be selected as one buffer."""
        return True

    # -- subclass hook ----------------------------------------------------------------
    @abstractmethod
    def _select(self, x: torch.Tensor, k: int, step: int) -> torch.Tensor:
        """Indices (int64, unique, any order) of about k entries of x; 0 < k < n."""


def select_each(pairs: Sequence[tuple[Sparsifier, torch.Tensor]],
                step: int = 0, *, checked: bool = False) -> list[SparseGrad]:
    """``[sp.select(x, step) for sp, x in pairs]`` with one finiteness read for all of them
    (:func:`~gradsync.sparsegrad.all_finite_each`: one device-to-host transfer per device,
    where each ``select`` waits on the device once): the same selections, and the same
    ``ValueError`` for a NaN/Inf input (the first such pair's), raised before any selection
    runs; none with ``checked`` (as :meth:`Sparsifier.select`'s). The engine selects a
    buffer's tensors with it. A subclass that overrides ``select`` itself (the contract asks
    for ``_select``) is called through its own ``select``."""
    for sp, x in pairs:
        sp._check_input(x)
    flags = [True] * len(pairs) if checked else all_finite_each([x for _, x in pairs])
    for (sp, x), finite in zip(pairs, flags):
        if not finite:
            check_finite(x, f"{sp.name}: input gradient")  # raises, with the counts
    return [sp._select_finite(x, step) if type(sp).select is Sparsifier.select
            else sp.select(x, step) for sp, x in pairs]
