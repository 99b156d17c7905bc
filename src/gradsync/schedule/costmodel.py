"""The cost model the fusion planners consume: SSFusion §IV-A "Various time estimation".

Every number is measured, never hard-coded:

* ``T_b^l`` (``backward``): seconds between the previous gradient becoming ready and gradient l
  becoming ready, in backward order — :func:`profile_backward` records it with per-parameter
  post-accumulate-grad hooks (the paper traces 100 iterations; we take the median of a few).
* ``T_cm`` via the α-β model (Eq. 1): ring all-reduce ``T_AR(B) = 2(P−1)α + 2(P−1)/P·B·β``
  (Eq. 4) and ring all-gather of B bytes per rank ``T_AG(B) = (P−1)α + (P−1)·B·β`` (Eq. 3).
  :func:`profile_collectives` times both on the real group and :func:`fit_alpha_beta` inverts
  Eq. 3 / Eq. 4 by least squares.
* ``T_gpu^l`` (``sparsify``, "inline": on the compute stream) and the offloaded sparsification
  time of SSFusion-O (``offload``: on a worker thread, hand-off and host copies included), each an
  affine fit ``t(n) = a + b·n`` in the tensor's element count (:func:`profile_sparsifier`).

``python -m gradsync profile`` (``gradsync.apps.profile``) measures a model's backward, the
sparsifiers and — under several ranks — the collectives with these functions, prints the model
as a table and writes it as JSON that ``CostModel.from_dict`` reads back.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "LONG_PROBE",
    "LONG_REPEATS",
    "SPARE_CORE",
    "AffineFit",
    "AlphaBeta",
    "ComputeCost",
    "CostModel",
    "cores_per_rank",
    "fit_affine",
    "fit_alpha_beta",
    "fit_compute",
    "missing_rate",
    "profile_backward",
    "profile_collectives",
    "profile_compute",
    "profile_sparse_call",
    "profile_sparsifier",
    "profiling_input",
    "spare_core",
    "with_call_cost",
]

INDEX_BYTES = 4  # a sparse entry travels as an int32 index + one value (numel < 2**31)


def _finite(x: Any, what: str) -> float:
    try:
        v = float(x)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a number, got {x!r}") from None
    if not math.isfinite(v):
        raise ValueError(f"{what} must be finite, got {x!r}")
    return v


# ---------------------------------------------------------------------------------------------
# Fits
# ---------------------------------------------------------------------------------------------
@dataclass
class AffineFit:
    """``t(n) = a + b·n`` seconds; a, b ≥ 0."""

    a: float
    b: float

    def __post_init__(self) -> None:
        self.a, self.b = _finite(self.a, "AffineFit.a"), _finite(self.b, "AffineFit.b")
        if self.a < 0 or self.b < 0:
            raise ValueError(f"AffineFit needs a, b >= 0, got a={self.a}, b={self.b}")

    def __call__(self, n: float) -> float:
        return self.a + self.b * n


@dataclass
class AlphaBeta:
    """Per-message latency α (s) and per-byte time β (s/B) of Eq. 1."""

    alpha: float
    beta: float

    def __post_init__(self) -> None:
        self.alpha = _finite(self.alpha, "alpha")
        self.beta = _finite(self.beta, "beta")
        if self.alpha < 0 or self.beta < 0:
            raise ValueError(f"AlphaBeta needs α, β >= 0, got α={self.alpha}, β={self.beta}")


@dataclass
class ComputeCost:
    """A collective's CPU work beyond the wire (issue 14), fitted by :func:`profile_compute`.

    * ``message``: software cost of one point-to-point message or collective start-up (gloo,
      Python, the kernel's socket path) on top of the link's α, seconds per message; it also
      prices the control collectives (shape check, count exchanges) as their messages;
    * ``merge``: ``t(m) = a + b·m`` to merge m received sparse entries into a dense
      accumulator (``index_add_``), one call per received message;
    * ``codec``: ``t(m) = a + b·m`` to encode and decode m entries for the wire
      (``pack_entries`` + ``unpack_entries``), one call per message.

    :meth:`collective` prices a collective's messages and merged / encoded entries.
    """

    message: float = 0.0
    merge: AffineFit = field(default_factory=lambda: AffineFit(0.0, 0.0))
    codec: AffineFit = field(default_factory=lambda: AffineFit(0.0, 0.0))

    def __post_init__(self) -> None:
        self.message = _finite(self.message, "ComputeCost.message")
        if self.message < 0:
            raise ValueError(f"ComputeCost.message must be >= 0 s, got {self.message}")
        for name in ("merge", "codec"):
            v = getattr(self, name)
            if isinstance(v, dict):
                v = AffineFit(**v)
                setattr(self, name, v)
            if not isinstance(v, AffineFit):
                raise ValueError(f"ComputeCost.{name} must be an AffineFit or a dict a, b")

    def collective(self, messages: float, merged: float = 0.0, encoded: float = 0.0,
                   calls: float | None = None) -> float:
        """Seconds of CPU work: ``messages``·message + merge and codec of the entries, with
        the affine start-up ``a`` paid once per call (default: per message)."""
        c = messages if calls is None else calls
        t = messages * self.message
        if merged > 0:
            t += c * self.merge.a + self.merge.b * merged
        if encoded > 0:
            t += c * self.codec.a + self.codec.b * encoded
        return t

    def to_dict(self) -> dict[str, Any]:
        return {"message": self.message, "merge": vars(self.merge).copy(),
                "codec": vars(self.codec).copy()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ComputeCost:
        try:
            return cls(message=d.get("message", 0.0), merge=AffineFit(**d["merge"]),
                       codec=AffineFit(**d["codec"]))
        except (KeyError, TypeError) as e:
            raise ValueError(f"not a ComputeCost dict: {e!r}") from None


def fit_compute(message_s: float, merge: tuple[Sequence[float], Sequence[float]],
                codec: tuple[Sequence[float], Sequence[float]]) -> ComputeCost:
    """A :class:`ComputeCost` from micro-benchmark samples: ``message_s`` seconds per message,
    ``merge`` / ``codec`` as (entries, seconds) pairs fitted with :func:`fit_affine`."""
    return ComputeCost(message=max(0.0, _finite(message_s, "message_s")),
                       merge=fit_affine(*merge), codec=fit_affine(*codec))


def fit_affine(xs: Sequence[float], ts: Sequence[float]) -> AffineFit:
    """Least-squares ``t = a + b·x`` with a, b ≥ 0 (the constrained optimum, not a clip).

    When the unconstrained fit has a < 0 the best fit through the origin is taken; when b < 0
    the best constant. With a single distinct x the slope is unidentifiable: b = 0, a = mean t.
    """
    xs = [_finite(x, "x") for x in xs]
    ts = [_finite(t, "t") for t in ts]
    if not xs or len(xs) != len(ts):
        raise ValueError(f"fit_affine needs equally many (≥ 1) xs and ts, got {len(xs)}, "
                         f"{len(ts)}")
    n = len(xs)
    mx, mt = sum(xs) / n, sum(ts) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    mean_only = AffineFit(max(0.0, mt), 0.0)
    if sxx == 0:
        return mean_only
    b = sum((x - mx) * (t - mt) for x, t in zip(xs, ts)) / sxx
    a = mt - b * mx
    if a >= 0 and b >= 0:
        return AffineFit(a, b)
    candidates = [mean_only]
    sx2 = sum(x * x for x in xs)
    if sx2 > 0:
        candidates.append(AffineFit(0.0, max(0.0, sum(x * t for x, t in zip(xs, ts)) / sx2)))

    def sse(f: AffineFit) -> float:
        return sum((f(x) - t) ** 2 for x, t in zip(xs, ts))

    return min(candidates, key=sse)


def fit_alpha_beta(
    kind: str, P: int, nbytes: Sequence[int], seconds: Sequence[float]
) -> AlphaBeta:
    """Invert Eq. 4 (``kind="allreduce"``) or Eq. 3 (``"allgather"``) by least squares.

    A fit ``t(B) = a + b·B`` of the measurements gives, for the ring all-reduce,
    α = a / 2(P−1) and β = b·P / 2(P−1); for the ring all-gather (B bytes per rank)
    α = a / (P−1) and β = b / (P−1). With P = 1 no collective costs anything: α = β = 0.
    """
    if kind not in ("allreduce", "allgather"):
        raise ValueError(f"kind must be 'allreduce' or 'allgather', got {kind!r}")
    if int(P) != P or P < 1:
        raise ValueError(f"P must be a positive integer, got {P!r}")
    fit = fit_affine(nbytes, seconds)
    if P == 1:
        return AlphaBeta(0.0, 0.0)
    if kind == "allreduce":
        return AlphaBeta(fit.a / (2 * (P - 1)), fit.b * P / (2 * (P - 1)))
    return AlphaBeta(fit.a / (P - 1), fit.b / (P - 1))


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------
# The cores per rank that give the offload worker one of its own beside the training thread
# (CostModel.worker_has_a_core).
SPARE_CORE = 2.0


@dataclass
class CostModel:
    """Everything the planners know about one training job (SSFusion §IV-A)."""

    P: int
    order: list[str]  # tensor names in backward order (the order gradients become ready)
    numel: dict[str, int]
    elem_bytes: int  # bytes per gradient element (4 for fp32)
    backward: dict[str, float]  # T_b^l
    sparsify: AffineFit  # T_gpu: inline sparsification time vs numel
    offload: AffineFit  # SSFusion-O: sparsification on the worker thread, copies included
    allreduce: AlphaBeta  # Eq. 4
    allgather: AlphaBeta  # Eq. 3
    info: dict[str, Any] = field(default_factory=dict)  # provenance (device, sparsifier, …)
    compute: ComputeCost | None = None  # CPU work of the collectives (issue 14); None = none

    def __post_init__(self) -> None:
        if int(self.P) != self.P or self.P < 1:
            raise ValueError(f"CostModel.P must be a positive integer, got {self.P!r}")
        self.P = int(self.P)
        self.order = [str(n) for n in self.order]
        if len(set(self.order)) != len(self.order):
            raise ValueError("CostModel.order has duplicate tensor names")
        missing = [n for n in self.order if n not in self.numel or n not in self.backward]
        if missing:
            raise ValueError(f"CostModel: no numel/backward time for {missing[:5]}")
        for n in self.order:
            if int(self.numel[n]) != self.numel[n] or self.numel[n] < 0:
                raise ValueError(f"CostModel.numel[{n!r}] must be an integer >= 0")
            t = _finite(self.backward[n], f"backward[{n!r}]")
            if t < 0:
                raise ValueError(f"CostModel.backward[{n!r}] must be >= 0, got {t}")
        if int(self.elem_bytes) != self.elem_bytes or self.elem_bytes < 1:
            raise ValueError(f"CostModel.elem_bytes must be a positive integer, "
                             f"got {self.elem_bytes!r}")
        for name, cls in (("sparsify", AffineFit), ("offload", AffineFit),
                          ("allreduce", AlphaBeta), ("allgather", AlphaBeta)):
            if not isinstance(getattr(self, name), cls):
                raise ValueError(f"CostModel.{name} must be a {cls.__name__}")
        if isinstance(self.compute, dict):
            self.compute = ComputeCost.from_dict(self.compute)
        if self.compute is not None and not isinstance(self.compute, ComputeCost):
            raise ValueError("CostModel.compute must be a ComputeCost or None")

    @property
    def worker_has_a_core(self) -> bool:
        """Whether the offload worker (SSFusion-O, Espresso) runs beside the training thread,
        as the planners' timelines assume: on an accelerator host (the worker is the host's
        CPU), and on a CPU host only where each rank has :data:`SPARE_CORE` cores
        (``info["cores_per_rank"]``, :func:`cores_per_rank`; a model profiled before that key:
        yes). Otherwise its selection takes the core of the backward it was meant to hide
        behind, or another rank's, and adds a hand-off between threads to the same work."""
        cores = self.info.get("cores_per_rank")
        return cores is None or spare_core(self.info.get("device", "cpu"), cores)

    # -- times -------------------------------------------------------------------------
    @property
    def entry_bytes(self) -> int:
        """Bytes of one sparse entry on the wire: int32 index + one value."""
        return INDEX_BYTES + self.elem_bytes

    def t_sparsify(self, numel: int, offload: bool = False) -> float:
        """T_gpu (inline) or the offloaded sparsification time of an ``numel``-element tensor."""
        return (self.offload if offload else self.sparsify)(numel)

    def t_allreduce(self, nbytes: int) -> float:
        """Eq. 4: ``2(P−1)α + 2(P−1)/P·B·β`` (0 with one rank): its host part
        (:meth:`t_allreduce_host`) and its bytes on the wire."""
        p = self.P
        return self.t_allreduce_host(nbytes) + 2 * (p - 1) / p * nbytes * self.allreduce.beta

    def t_allreduce_host(self, nbytes: int) -> float:
        """The part of Eq. 4 that is not bytes on the wire: the 2(P−1) start-ups and the CPU
        work (``compute``), what an all-reduce running beside the backward takes from its core
        where no core is spare (SSFusion-I's split, ``schedule/ssfusion.py``); 0 with one
        rank."""
        return 2 * (self.P - 1) * self.allreduce.alpha + self.t_compute_allreduce(nbytes)

    def t_allgather(self, nbytes_per_rank: int) -> float:
        """Eq. 3: ``(P−1)α + (P−1)·B·β`` with B bytes per rank (0 with one rank)."""
        p, ab = self.P, self.allgather
        return ((p - 1) * ab.alpha + (p - 1) * nbytes_per_rank * ab.beta
                + self.t_compute_allgather(nbytes_per_rank))

    def startups_allreduce(self) -> int:
        """Message start-ups of one ring all-reduce: 2(P−1)."""
        return 2 * (self.P - 1)

    def startups_allgather(self, nbytes_per_rank: float = 0.0) -> int:
        """The messages of one sparse all-gather call (TopkA, ``collectives/topka.py``) of
        ``nbytes_per_rank``, as the engine makes it on gloo: its rounds of point-to-point
        messages (:func:`~gradsync.collectives.comm.gather_rounds`: ⌈log2 P⌉ from P = 4, else
        P − 1); no shape check (agreed once per buffer) and no counts (fixed capacity), as
        ``apps/sim/patterns`` counts the one-buffer schemes' call (tests/test_sim_messages.py).
        Their software: :meth:`t_startups_allgather`."""
        from gradsync.collectives.comm import gather_rounds  # torch: not at import

        return len(gather_rounds(self.P, nbytes_per_rank))

    def t_compute_allreduce(self, nbytes: int) -> float:
        """CPU work of a ring all-reduce (``compute``): its start-ups' software cost."""
        if self.compute is None or self.P == 1:
            return 0.0
        return self.compute.collective(self.startups_allreduce())

    def t_startups_allgather(self, nbytes_per_rank: float) -> float:
        """The software cost of a sparse all-gather call's rounds (:meth:`startups_allgather`,
        ``compute.message`` each): the part of :meth:`t_compute_allgather` that is latency,
        not merges and codec; 0 without ``compute`` or with one rank. The simulator stretches
        it where ranks share cores (``apps/sim/predict``, docs/results/simulator.md, "An
        all-gather's rounds on shared cores")."""
        if self.compute is None or self.P == 1:
            return 0.0
        return self.startups_allgather(nbytes_per_rank) * self.compute.message

    def t_compute_allgather(self, nbytes_per_rank: int) -> float:
        """CPU work of a sparse all-gather of COO entries (``compute``): its start-ups'
        software cost (:meth:`t_startups_allgather`) and the P−1 received messages, each
        decoded and merged (``nbytes_per_rank`` / entry_bytes entries per message)."""
        if self.compute is None or self.P == 1:
            return 0.0
        p, m = self.P, nbytes_per_rank / self.entry_bytes
        return self.t_startups_allgather(nbytes_per_rank) + self.compute.collective(
            0, merged=(p - 1) * m, encoded=p * m, calls=p - 1)

    # -- JSON ----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "P": self.P,
            "order": list(self.order),
            "numel": {n: int(self.numel[n]) for n in self.order},
            "elem_bytes": self.elem_bytes,
            "backward": {n: float(self.backward[n]) for n in self.order},
            "sparsify": {"a": self.sparsify.a, "b": self.sparsify.b},
            "offload": {"a": self.offload.a, "b": self.offload.b},
            "allreduce": {"alpha": self.allreduce.alpha, "beta": self.allreduce.beta},
            "allgather": {"alpha": self.allgather.alpha, "beta": self.allgather.beta},
            "info": json.loads(json.dumps(self.info, default=str)),
        } | ({} if self.compute is None else {"compute": self.compute.to_dict()})

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CostModel:
        try:
            return cls(
                P=d["P"], order=list(d["order"]),
                numel={k: int(v) for k, v in d["numel"].items()},
                elem_bytes=d["elem_bytes"],
                backward={k: float(v) for k, v in d["backward"].items()},
                sparsify=AffineFit(**d["sparsify"]), offload=AffineFit(**d["offload"]),
                allreduce=AlphaBeta(**d["allreduce"]), allgather=AlphaBeta(**d["allgather"]),
                info=dict(d.get("info", {})),
                compute=(ComputeCost.from_dict(d["compute"]) if d.get("compute") else None),
            )
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"not a CostModel dict: {e!r}") from None

    def table_rows(self) -> list[list[Any]]:
        """(quantity, value) rows for ``print_table``."""
        rows: list[list[Any]] = [
            ["P", self.P], ["tensors", len(self.order)],
            ["elements", sum(self.numel[n] for n in self.order)],
            ["Σ T_b (s)", sum(self.backward[n] for n in self.order)],
            ["sparsify a (s)", self.sparsify.a], ["sparsify b (s/elem)", self.sparsify.b],
            ["offload a (s)", self.offload.a], ["offload b (s/elem)", self.offload.b],
            ["all-reduce α (s)", self.allreduce.alpha], ["all-reduce β (s/B)", self.allreduce.beta],
            ["all-gather α (s)", self.allgather.alpha], ["all-gather β (s/B)", self.allgather.beta],
        ]
        if self.compute is not None:
            c = self.compute
            rows += [["message software cost (s)", c.message], ["merge a (s)", c.merge.a],
                     ["merge b (s/entry)", c.merge.b], ["codec a (s)", c.codec.a],
                     ["codec b (s/entry)", c.codec.b]]
        return rows


def missing_rate(selected_counts: dict[str, int]) -> float:
    """Tensor missing rate (SSFusion §III-A, Table I): tensors with nothing selected / tensors."""
    if not selected_counts:
        raise ValueError("missing_rate needs at least one tensor")
    for n, c in selected_counts.items():
        if int(c) != c or c < 0:
            raise ValueError(f"selected count of {n!r} must be an integer >= 0, got {c!r}")
    return sum(1 for c in selected_counts.values() if c == 0) / len(selected_counts)


# ---------------------------------------------------------------------------------------------
# Profilers
# ---------------------------------------------------------------------------------------------
def spare_core(device: str, cores: float | None = None) -> bool:
    """Whether a rank's threads beside its training thread (SSFusion-O's worker, the
    communication thread, gloo's) have a core of their own: on an accelerator host (``device``
    not ``"cpu"``: they run on its CPU), and on a CPU host where each rank has
    :data:`SPARE_CORE` cores (``cores``; None: :func:`cores_per_rank`). The rule of
    :attr:`CostModel.worker_has_a_core`, and of the DDP hook, which has no cost model."""
    return device != "cpu" or (cores_per_rank() if cores is None else cores) >= SPARE_CORE


def cores_per_rank() -> float:
    """The CPU cores this process may run on, shared out over the ranks of its host
    (``LOCAL_WORLD_SIZE``, which torchrun and :mod:`gradsync.testing` set; 1 when unset), the
    cost model's ``info["cores_per_rank"]`` (:attr:`CostModel.worker_has_a_core`)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    return cores / local


def _sizes(sizes: Sequence[int]) -> list[int]:
    out = [int(s) for s in sizes]
    if not out or any(s < 1 for s in out):
        raise ValueError(f"sizes must be a non-empty list of positive integers, got {sizes!r}")
    return out


# profile_collectives' long transfers: sizes from this many bytes up are timed over at most
# LONG_REPEATS calls (after the warm-up), where the transfer outweighs the per-call noise.
LONG_PROBE = 1 << 17
LONG_REPEATS = 3


def profile_collectives(
    group=None, sizes: Sequence[int] = (1 << 10, 1 << 14, 1 << 17, 1 << 20), repeats: int = 5,
    device=None, comm=None, lean: bool = True,
) -> tuple[AlphaBeta, AlphaBeta]:
    """Time all-reduce and all-gather of ``sizes`` bytes on ``group``; fit α, β (Eq. 3, 4).

    Every rank must call it. Each point is the median over ``repeats`` (after one warm-up),
    each call bracketed by a barrier; the medians are then max-reduced over ranks (the slowest
    rank is what a synchronous step waits for), so every rank returns the same fit. ``comm``
    (a :class:`~gradsync.collectives.comm.Comm` of ``group``) counts the probes' traffic for the
    caller; by default a fresh one.

    ``lean`` (default; the planners' probes, sent once per run): each rank all-gathers
    ``size / P`` bytes, which puts about as many bytes on its link per call as the all-reduce
    of ``size`` (Eq. 3 and 4 are fitted per rank's bytes either way), and sizes of
    :data:`LONG_PROBE` bytes or more are timed over at most :data:`LONG_REPEATS` calls. At
    P = 4 the probes then send 10.9 MB per rank instead of 32.3, and took 1.1 s on a
    100 Mbit/s link instead of 3.0, with the same fit there and the same plans
    (docs/results/speed.md, "The cost model's probes, once per run"). ``lean=False`` times
    every size in full, as ``python -m gradsync profile`` and the simulator's validation do.
    """
    import torch
    import torch.distributed as dist

    from gradsync.collectives.comm import Comm

    sizes = _sizes(sizes)
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    comm = comm if comm is not None else Comm(group)
    if comm.size == 1:
        return AlphaBeta(0.0, 0.0), AlphaBeta(0.0, 0.0)
    dev = torch.device(device) if device is not None else (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend(group) == "nccl" else torch.device("cpu"))

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def timed(fn: Callable[[], Any], n: int) -> float:
        fn()  # warm-up
        sync()
        ts = []
        for _ in range(min(repeats, LONG_REPEATS) if lean and n >= LONG_PROBE else repeats):
            comm.barrier()
            t0 = time.perf_counter()
            fn()
            sync()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    nb = [max(1, s // 4) * 4 for s in sizes]  # each all-reduce's bytes (fp32 elements)
    nb_ag = [max(1, s // (4 * comm.size)) * 4 for s in sizes]  # per rank, if lean
    if not lean or len(set(nb_ag)) < len(set(nb)):  # (sizes too small to divide: in full)
        nb_ag = nb
    ar, ag = [], []
    for b, b_ag in zip(nb, nb_ag, strict=True):
        x, y = (torch.ones(n // 4, dtype=torch.float32, device=dev) for n in (b, b_ag))
        ar.append(timed(lambda x=x: comm.all_reduce(x), b))
        ag.append(timed(lambda y=y: comm.all_gather(y), b))  # as long as the all-reduce's
    t = torch.tensor(ar + ag, dtype=torch.float64, device=dev)
    comm.all_reduce(t, op=dist.ReduceOp.MAX)
    t = t.cpu().tolist()
    return (fit_alpha_beta("allreduce", comm.size, nb, t[: len(sizes)]),
            fit_alpha_beta("allgather", comm.size, nb_ag, t[len(sizes):]))


def profile_sparse_call(collective: Callable[..., Any], group=None, repeats: int = 5,
                        numel: int = 1024, device=None, comm=None) -> float:
    """Wall time of one call of the sparse ``collective`` on a selection of one entry per
    rank: its fixed cost per call — control collectives (counts, shapes), encoding, decoding,
    the merge's start-up and Python — which a raw all-gather's α does not contain (on 2 CPU
    cores, 3–7 ms per TopkA call at P = 4 against α ≈ 0.1 ms; docs/results/simulator.md).

    Every rank must call it. The median over ``repeats`` (after one warm-up), each call after
    a barrier, max-reduced over ranks, so every rank returns the same number. The calls'
    traffic is added to ``comm``'s counters (by default a fresh
    :class:`~gradsync.collectives.comm.Comm` of ``group``). ``collective`` is called as
    ``collective(selection, group=group, step=0)``; give it a fresh instance (stateful
    collectives keep what they see).
    """
    import torch
    import torch.distributed as dist

    from gradsync.collectives.comm import Comm
    from gradsync.sparsegrad import SparseGrad

    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    comm = comm if comm is not None else Comm(group)
    if comm.size == 1:
        return 0.0
    dev = torch.device(device) if device is not None else torch.device("cpu")
    sel = SparseGrad(torch.tensor([comm.rank % numel], device=dev),
                     torch.ones(1, device=dev), numel)

    def once() -> None:
        res = collective(sel, group=group, step=0)
        comm.stats += res.stats
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    once()  # warm-up
    ts = []
    for _ in range(repeats):
        comm.barrier()
        t0 = time.perf_counter()
        once()
        ts.append(time.perf_counter() - t0)
    t = torch.tensor([statistics.median(ts)], dtype=torch.float64, device=dev)
    comm.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def with_call_cost(allgather: AlphaBeta, call_s: float, P: int) -> AlphaBeta:
    """``allgather`` (Eq. 3's α, β) with a sparse collective's measured cost per call: the part
    of ``call_s`` above the (P − 1)·α a tiny all-gather already costs, spread over its P − 1
    messages, so T_AG = (P − 1)·α′ + (P − 1)·bytes·β prices it once per buffer."""
    if P <= 1:
        return allgather
    extra = max(0.0, _finite(call_s, "call_s") - (P - 1) * allgather.alpha)
    return AlphaBeta(allgather.alpha + extra / (P - 1), allgather.beta)


def profiling_input(n: int, seed: int, device) -> Any:
    """The seeded input the profilers time: a gradient-like vector, Gaussian with log-normal
    scales (heavy tails). Simpler than ``bench sparsify``'s layered ``heavy_tailed``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(1.5 * torch.randn(n, generator=g))
    return x.to(device)


class _Worker:
    """One long-lived worker thread (SSFusion-O's CPU sparsification thread)."""

    def __init__(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        from gradsync import sparsegrad

        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gradsync-offload",
                                       initializer=sparsegrad.bind,
                                       initargs=(sparsegrad.cpu_kernels(),))

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def _offloaded_select(sparsifier, x, step: int):
    """What SSFusion-O runs on the worker: copy to host, select there, copy the result back."""
    if x.is_cuda:
        import torch

        host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        host.copy_(x, non_blocking=True)
        torch.cuda.current_stream(x.device).synchronize()
        sel = sparsifier.select(host, step)
        return sel.to(x.device, non_blocking=True)
    return sparsifier.select(x, step)


def profile_sparsifier(
    sparsifier, sizes: Sequence[int] = (1 << 10, 1 << 14, 1 << 17, 1 << 20), repeats: int = 3,
    offload: bool = False, device=None, seed: int = 0,
) -> AffineFit:
    """Median time of ``sparsifier.select`` on seeded heavy-tailed tensors of ``sizes``
    elements, fitted as ``a + b·n``.

    ``offload=True`` times the hand-off to a worker thread and back (and, on CUDA, the
    device→host and host→device copies) — what SSFusion-O's T_offload contains.
    """
    import torch

    sizes = _sizes(sizes)
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    dev = torch.device(device) if device is not None else torch.device("cpu")

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    worker = _Worker() if offload else None
    try:
        ts = []
        for i, n in enumerate(sizes):
            x = profiling_input(n, seed + i, dev)

            def once(x=x) -> None:
                if worker is None:
                    sparsifier.select(x, 0)
                else:
                    worker.pool.submit(_offloaded_select, sparsifier, x, 0).result()
                sync()

            once()  # warm-up
            samples = []
            for _ in range(repeats):
                sync()
                t0 = time.perf_counter()
                once()
                samples.append(time.perf_counter() - t0)
            ts.append(statistics.median(samples))
    finally:
        if worker is not None:
            worker.close()
    return fit_affine(sizes, ts)


def profile_compute(
    sizes: Sequence[int] = (1 << 8, 1 << 12, 1 << 15, 1 << 17), repeats: int = 5,
    message_s: float = 0.0, numel: int = 1 << 20, device=None, seed: int = 0,
) -> ComputeCost:
    """Micro-benchmarks of a collective's CPU work, fitted (:func:`fit_compute`):

    * merge: ``index_add_`` of m seeded entries into a ``numel``-element accumulator;
    * codec: ``pack_entries`` then ``unpack_entries`` of m entries (the wire's COO format);
    * ``message_s``: the per-message software cost, measured by the caller on a real group
      (α of :func:`profile_collectives` on loopback, or on the link validated); a group is
      needed for it, so this function only records it.

    Each point is the median of ``repeats`` after one warm-up; sizes are entries (≤ numel).
    """
    import torch

    from gradsync.formats.wire import pack_entries, unpack_entries, wire_index_dtype

    sizes = [min(s, numel) for s in _sizes(sizes)]
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    dev = torch.device(device) if device is not None else torch.device("cpu")
    g = torch.Generator().manual_seed(seed)
    wire = wire_index_dtype(numel)
    acc = torch.zeros(numel, device=dev)

    def timed(fn: Callable[[], Any]) -> float:
        fn()
        out = []
        for _ in range(repeats):
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            fn()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            out.append(time.perf_counter() - t0)
        return statistics.median(out)

    merge_t, codec_t = [], []
    for m in sizes:
        idx = torch.randperm(numel, generator=g)[:m].sort().values.to(dev)
        val = torch.randn(m, generator=g).to(dev)
        merge_t.append(timed(lambda i=idx, v=val: acc.index_add_(0, i, v)))
        codec_t.append(timed(lambda i=idx, v=val, m=m: unpack_entries(
            pack_entries(i, v, wire), m, wire, v.dtype, "profile")))
    return fit_compute(message_s, (sizes, merge_t), (sizes, codec_t))


def profile_backward(
    model, step: Callable[[], Any], repeats: int = 3
) -> tuple[list[str], dict[str, int], dict[str, float]]:
    """Backward order and T_b^l of ``model``'s parameters (SSFusion §IV-A "T_b^l").

    ``step()`` runs the forward pass and returns the scalar loss; we call ``.backward()`` on it
    with a post-accumulate-grad hook on every parameter that records when its gradient is
    ready. T_b^l = ready(l) − ready(l−1) (the first from the start of ``backward()``), median
    over ``repeats`` (after one warm-up). Parameters without a gradient are left out.
    """
    import torch

    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    stamps: dict[str, float] = {}
    cuda = any(p.is_cuda for _, p in params)

    def hook_for(name: str):
        def hook(_p) -> None:
            if cuda:
                torch.cuda.synchronize()
            stamps[name] = time.perf_counter()

        return hook

    handles = [p.register_post_accumulate_grad_hook(hook_for(n)) for n, p in params]
    runs: list[dict[str, float]] = []
    order: list[str] = []
    try:
        for r in range(repeats + 1):
            model.zero_grad(set_to_none=True)
            loss = step()
            stamps.clear()
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss.backward()
            seq = sorted(stamps.items(), key=lambda kv: kv[1])
            if r == 0:
                order = [n for n, _ in seq]
                continue
            prev, tb = t0, {}
            for n, t in seq:
                tb[n] = t - prev
                prev = t
            runs.append(tb)
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
    if not order:
        raise ValueError("profile_backward: no parameter received a gradient")
    numel = {n: p.numel() for n, p in params if n in set(order)}
    backward = {n: statistics.median(r.get(n, 0.0) for r in runs) for n in order}
    return order, numel, backward
