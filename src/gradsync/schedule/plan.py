"""What a planner returns: fusion buffers, and how each tensor in them is sent.

A :class:`Plan` is a list of :class:`BufferPlan` in backward order; every buffer lists its
:class:`TensorPlan` entries in backward order, and the buffers together cover every gradient
tensor exactly once. Buffer modes (SSFusion §II-D):

* ``"dense"`` — the buffer is all-reduced as it is (Dense / DenseOvlp / WFBP buckets);
* ``"fused"`` — multi-tensor sparsification: the concatenated buffer is sparsified as one
  vector at ``density`` (OMGS, Cupcake, TopkA/Ok-Topk/… with one buffer);
* ``"per_tensor"`` — each tensor as its :class:`TensorPlan` says: sparsified at its own
  ``density`` or sent dense (``density=None``), sparsified inline or on the worker thread
  (``offload``, SSFusion-O), and dense tensors either in the buffer's all-gather part or in its
  all-reduce part (``allreduce``, SSFusion-I).

Plans are JSON-safe (``to_dict`` / ``from_dict``) so rank 0 can plan and broadcast, and a run's
plan can be saved and handed back (``Config.plan``) to replay it. ``digest()`` names a plan's
structure (what decides the numerics: buffers, modes, densities, offload and all-reduce
choices, overlap), not its ``info``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from gradsync.sparsegrad import target_k, validate_density

__all__ = ["MIN_K", "MODES", "BufferPlan", "Plan", "TensorPlan", "below_min_k", "entries",
           "whole_below"]

MODES = ("dense", "fused", "per_tensor")

# A tensor sparsified on its own at fewer entries than this is sent whole (Config.min_k).
MIN_K = 8


def entries(numel: int, density: float | None) -> int:
    """Entries a tensor contributes: ``target_k(numel, density)`` = max(1, round(density·n))
    capped at n (the sparsifier contract), or all n when it is sent dense (``density is None``).
    """
    if density is None:
        return max(numel, 0)
    return target_k(numel, density)


@dataclass(frozen=True)
class TensorPlan:
    name: str
    numel: int
    density: float | None  # None: sent dense; else sparsified at this density
    offload: bool = False  # SSFusion-O: sparsify on the worker thread
    allreduce: bool = False  # SSFusion-I: travels in the buffer's all-reduce part

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"TensorPlan.name must be a non-empty string, got {self.name!r}")
        if int(self.numel) != self.numel or self.numel < 0:
            raise ValueError(f"TensorPlan {self.name!r}: numel must be an integer >= 0")
        if self.density is not None:
            object.__setattr__(self, "density",
                               validate_density(self.density, f"density of {self.name!r}"))
        if self.density is None and self.offload:
            raise ValueError(f"TensorPlan {self.name!r}: a dense tensor cannot be offloaded")
        if self.density is not None and self.allreduce:
            raise ValueError(f"TensorPlan {self.name!r}: only dense tensors can be all-reduced")

    @property
    def k(self) -> int:
        return entries(self.numel, self.density)


@dataclass(frozen=True)
class BufferPlan:
    tensors: tuple[TensorPlan, ...]  # in backward order
    mode: str  # "dense" | "fused" | "per_tensor"
    density: float | None = None  # for mode "fused"

    def __post_init__(self) -> None:
        object.__setattr__(self, "tensors", tuple(self.tensors))
        if not self.tensors:
            raise ValueError("a BufferPlan needs at least one tensor")
        if self.mode not in MODES:
            raise ValueError(f"buffer mode must be one of {MODES}, got {self.mode!r}")
        if self.mode == "fused":
            object.__setattr__(self, "density", validate_density(self.density, "fused density"))
        elif self.density is not None:
            raise ValueError(f"buffer mode {self.mode!r} takes no buffer density")
        if self.mode != "per_tensor" and any(
            t.density is not None or t.offload or t.allreduce for t in self.tensors
        ):
            raise ValueError(f"in a {self.mode!r} buffer every TensorPlan must be plain "
                             "(density None, no offload, no allreduce)")

    @property
    def numel(self) -> int:
        return sum(t.numel for t in self.tensors)

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tensors]

    def k(self) -> int:
        """Entries this buffer puts into all-gather (0 for a dense buffer)."""
        if self.mode == "dense":
            return 0
        if self.mode == "fused":
            return entries(self.numel, self.density)
        return sum(t.k for t in self.tensors if not t.allreduce)

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "density": self.density,
                "tensors": [{"name": t.name, "numel": t.numel, "density": t.density,
                             "offload": t.offload, "allreduce": t.allreduce}
                            for t in self.tensors]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BufferPlan:
        return cls(tensors=tuple(TensorPlan(**t) for t in d["tensors"]), mode=d["mode"],
                   density=d.get("density"))


def below_min_k(numel: int, density: float, min_k: int) -> bool:
    """Whether a tensor of ``numel`` entries sparsified at ``density`` would send fewer than
    ``min_k`` entries (``Config.min_k``), and so travels whole."""
    if isinstance(min_k, bool) or int(min_k) != min_k or min_k < 1:
        raise ValueError(f"min_k must be an integer >= 1, got {min_k!r}")
    return entries(numel, density) < min_k


def whole_below(buffers: list[BufferPlan], min_k: int) -> tuple[list[BufferPlan], list[str]]:
    """Send whole every tensor of a ``per_tensor`` buffer whose k at its density would be below
    ``min_k``; returns the buffers and the names it changed (in plan order).

    DGC's reference sends biases, BatchNorm and small tensors whole: at k of a few entries a
    tensor's selection is its one or two largest residuals, so the rest of it (a BatchNorm
    scale, a classifier row) waits many steps and then lands as one stale, outsized step.
    Measured on ResNet-20 at 1 %, 5 seeds (docs/results/convergence-resnet20.md): per_tensor
    ended 11.98 points below DDP [-17.0, -6.9] sparsifying every tensor, and +1.97 [-4.9, +8.8]
    with its tensors of k < 8 sent whole (the classifier, the first conv, every BatchNorm and
    bias: 0.8 % of the parameters)."""
    out, changed = [], []
    for b in buffers:
        if b.mode != "per_tensor":
            out.append(b)
            continue
        ts = []
        for t in b.tensors:
            if t.density is not None and below_min_k(t.numel, t.density, min_k):
                t = TensorPlan(t.name, t.numel, None)
                changed.append(t.name)
            ts.append(t)
        out.append(BufferPlan(tuple(ts), "per_tensor"))
    return out, changed


@dataclass
class Plan:
    scheme: str
    buffers: list[BufferPlan]
    overlap: bool = True  # False: communication starts only after the whole backward
    info: dict = field(default_factory=dict)  # predicted times, Eq. 2 status, split points, …

    def __post_init__(self) -> None:
        self.buffers = list(self.buffers)
        if not self.buffers:
            raise ValueError("a Plan needs at least one buffer")
        names = self.names
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"plan lists tensors more than once: {dup[:5]}")

    @property
    def names(self) -> list[str]:
        """Every tensor, in the plan's (backward) order."""
        return [t.name for b in self.buffers for t in b.tensors]

    @property
    def sparsified(self) -> set[str]:
        """The tensors that send fewer entries than they hold (a fused buffer's, or a
        per-tensor buffer's at a density below 1); the others travel whole."""
        return {t.name for b in self.buffers for t in b.tensors
                if (b.mode == "fused" and entries(b.numel, b.density) < b.numel)
                or (b.mode == "per_tensor" and t.k < t.numel)}

    def to_dict(self) -> dict[str, Any]:
        return {"scheme": self.scheme, "overlap": self.overlap,
                "buffers": [b.to_dict() for b in self.buffers],
                "info": json.loads(json.dumps(self.info, default=str))}

    def digest(self) -> str:
        """12 hex digits of SHA-256 over the plan's structure (scheme, overlap, buffers; not
        ``info``): two runs with the same digest sent every tensor the same way."""
        d = self.to_dict()
        del d["info"]
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        try:
            return cls(scheme=str(d["scheme"]),
                       buffers=[BufferPlan.from_dict(b) for b in d["buffers"]],
                       overlap=bool(d.get("overlap", True)), info=dict(d.get("info", {})))
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"not a Plan dict: {e!r}") from None
