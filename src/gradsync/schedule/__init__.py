"""Planners: which gradients share a fusion buffer and how each buffer is sent.

Pure functions of tensor names/sizes (backward order), a target density and, for the schemes
that need one, a measured :class:`~gradsync.schedule.costmodel.CostModel` — no processes, no
torch.distributed. :data:`SCHEMES` (:mod:`.schemes`) is the table of schemes;
``make_plan(scheme, names, numel, density, cost)`` runs the scheme's planner and returns a
JSON-safe :class:`Plan`; ``simulate(plan, cost)`` (:mod:`.timeline`) predicts its timeline.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gradsync.schedule import schemes
from gradsync.schedule.auto import auto_buffers
from gradsync.schedule.costmodel import CostModel, missing_rate
from gradsync.schedule.cupcake import cupcake_groups
from gradsync.schedule.espresso import espresso_buffers
from gradsync.schedule.fixed import DDP_FIRST_BUCKET_BYTES, bucket_bytes_of, fixed_buckets
from gradsync.schedule.hipress import hipress_buffers
from gradsync.schedule.mgwfbp import mgwfbp_groups
from gradsync.schedule.plan import (
    MIN_K,
    BufferPlan,
    Plan,
    TensorPlan,
    entries,
    whole_below,
)
from gradsync.schedule.schemes import SCHEMES, Scheme
from gradsync.schedule.ssfusion import (
    allgather_charge,
    allreduce_charge,
    best_split,
    charge_bytes,
    compensate,
    interleave_buffer,
    offload_buffer,
    selective_buffers,
)
from gradsync.schedule.timeline import Timeline, buffer_comm_time, buffer_parts, simulate
from gradsync.sparsegrad import validate_density

__all__ = [
    "DDP_FIRST_BUCKET_BYTES",
    "MIN_K",
    "PLANNER_FUNCTIONS",
    "SCHEMES",
    "BufferPlan",
    "Plan",
    "PlanInputs",
    "Scheme",
    "TensorPlan",
    "Timeline",
    "allgather_charge",
    "allreduce_charge",
    "best_split",
    "bucket_bytes_of",
    "buffer_comm_time",
    "buffer_parts",
    "charge_bytes",
    "compensate",
    "cupcake_groups",
    "entries",
    "fixed_buckets",
    "make_plan",
    "mgwfbp_groups",
    "missing_rate",
    "needs_cost_model",
    "planner",
    "simulate",
    "whole_below",
]

@dataclass(frozen=True)
class PlanInputs:
    """What :func:`make_plan` hands a planner, checked: the scheme's row, the tensors in
    backward order with their sizes, the target density, the cost model (``None`` for the
    planners that need none) and the limits of ``make_plan``'s keywords."""

    spec: Scheme
    names: list[str]
    numel: dict[str, int]
    density: float
    cost: CostModel | None
    elem_bytes: int
    bucket_bytes: int
    first_bucket_bytes: int | None
    min_density: float
    min_k: int
    pooled: bool = False

    def groups(self, mode: str, groups: list[list[str]]) -> list[BufferPlan]:
        """Buffers over ``groups``: all-reduced (``dense``), sparsified as one vector
        (``fused``) or tensor by tensor at the density (``per_tensor``)."""
        d = self.density if mode == "per_tensor" else None
        return [BufferPlan(tuple(TensorPlan(n, self.numel[n], d) for n in g), mode,
                           self.density if mode == "fused" else None) for g in groups]

    def ddp_buckets(self) -> list[list[str]]:
        return fixed_buckets(self.names, self.numel, self.elem_bytes, self.bucket_bytes,
                             self.first_bucket_bytes)


Planner = Callable[[PlanInputs], tuple[list[BufferPlan], dict[str, Any]]]
# Scheme.planner → the function that plans it (its buffers and the plan's info entries);
# every name of schemes.PLANNERS has one (tests/test_schedule.py).
PLANNER_FUNCTIONS: dict[str, Planner] = {}


def planner(name: str) -> Callable[[Planner], Planner]:
    """Register the function that plans ``Scheme.planner == name``."""
    if name not in schemes.PLANNERS:
        raise ValueError(f"planner {name!r} is not in the table's PLANNERS")

    def register(fn: Planner) -> Planner:
        PLANNER_FUNCTIONS[name] = fn
        return fn
    return register


@planner("fixed")
def _fixed(job: PlanInputs) -> tuple[list[BufferPlan], dict[str, Any]]:
    return job.groups("dense", job.ddp_buckets()), {}


@planner("single")
def _single(job: PlanInputs) -> tuple[list[BufferPlan], dict[str, Any]]:
    return job.groups("fused", [job.names]), {}


@planner("mgwfbp")
def _mgwfbp(job: PlanInputs) -> tuple[list[BufferPlan], dict[str, Any]]:
    return job.groups("fused", mgwfbp_groups(job.names, job.numel, job.cost, job.density)), {}


@planner("cupcake")
def _cupcake(job: PlanInputs) -> tuple[list[BufferPlan], dict[str, Any]]:
    groups, t = cupcake_groups(job.names, job.numel, job.cost, job.density)
    return job.groups("fused", groups), {"dp_iteration": t}


@planner("per_tensor")
def _per_tensor(job: PlanInputs) -> tuple[list[BufferPlan], dict[str, Any]]:
    # fusion after sparsification, DDP's buckets (SSFusion §II-D)
    return job.groups("per_tensor", job.ddp_buckets()), {}


@planner("hipress")
def _hipress(job: PlanInputs) -> tuple[list[BufferPlan], dict[str, Any]]:
    buffers, info = hipress_buffers(job.names, job.numel, job.cost, job.density,
                                    job.bucket_bytes)
    return buffers, {"hipress": info}


@planner("espresso")
def _espresso(job: PlanInputs) -> tuple[list[BufferPlan], dict[str, Any]]:
    buffers, info = espresso_buffers(job.names, job.numel, job.cost, job.density)
    return buffers, {"espresso": info}


@planner("auto")
def _auto(job: PlanInputs) -> tuple[list[BufferPlan], dict[str, Any]]:
    buffers, info = auto_buffers(job.names, job.numel, job.cost, job.density, job.bucket_bytes,
                                 first_bucket_bytes=job.first_bucket_bytes)
    return buffers, {"auto": info}


@planner("ssfusion")
def _ssfusion(job: PlanInputs) -> tuple[list[BufferPlan], dict[str, Any]]:
    """Cupcake's buffers, Eq. 2's selection with model-wide compensation, then SSFusion-O's
    offloading and SSFusion-I's split where the scheme's row says."""
    cost, spec = job.cost, job.spec
    assert cost is not None  # make_plan: the ssfusion rows need a cost model
    groups, _ = cupcake_groups(job.names, job.numel, cost, job.density)
    buffers, eq2 = selective_buffers(groups, job.numel, cost, job.density, job.min_density,
                                     job.min_k, pooled=job.pooled)
    forced = {n for buf in eq2 for n in buf["forced"]}
    info: dict[str, Any] = {"eq2": eq2, "whole_below_min_k": [
        n for n in job.names if n in forced]}
    if spec.offload:
        pairs = [offload_buffer(b, cost) for b in buffers]
        buffers, info["offload"] = [p[0] for p in pairs], [p[1] for p in pairs]
    if spec.interleave:
        pairs = [interleave_buffer(b, cost) for b in buffers]
        buffers, info["split"] = [p[0] for p in pairs], [p[1] for p in pairs]
    buffers, info["compensation"] = charge_bytes(buffers, cost.P, cost.elem_bytes, job.density,
                                                 job.min_density)
    return buffers, info


def needs_cost_model(scheme: str) -> bool:
    """Whether ``make_plan(scheme, …)`` needs a cost model."""
    return schemes.get(scheme).needs_cost_model


def make_plan(
    scheme: str,
    names: list[str],
    numel: dict[str, int],
    density: float,
    cost: CostModel | None = None,
    *,
    elem_bytes: int = 4,
    bucket_bytes: int = 25 * 2**20,
    first_bucket_bytes: int | None = None,
    min_density: float = 0.001,
    min_k: int | None = None,
    pooled: bool | None = None,
) -> Plan:
    """Plan ``scheme`` for the tensors ``names`` (backward order) at target ``density``.

    ``bucket_bytes`` and ``first_bucket_bytes`` (None: ``bucket_bytes``) are DDP's bucket limits
    (:mod:`.fixed`), used by the schemes that fuse as DDP does (``dense``, ``dense_ovlp``,
    ``per_tensor``, and ``auto``'s dense reference); HiPress caps its bulk all-reduces at
    ``bucket_bytes``.

    ``min_k``: a tensor that a ``per_tensor`` buffer would sparsify at fewer entries is sent
    whole instead (:func:`~gradsync.schedule.plan.whole_below`, ``Config.min_k``); 1 keeps
    every planner's own choice; ``None``: the scheme's (``Scheme.min_k``: 8), so the simulator
    plans what the engine runs. SSFusion's Eq. 2 and its compensation see the result, when the
    tensors it sends whole fit half of SSFusion's byte budget
    (:func:`~gradsync.schedule.ssfusion.starved`).

    ``pooled``: each buffer's sparsified tensors are selected as one (``Config.budget``
    ``"pooled"``); ``None``: the scheme's budget (``Scheme.budget``). Then ``min_k``'s default
    is 1 (a pool's K counts, not a tensor's k) and SSFusion's Eq. 2 excludes nothing
    (:func:`~gradsync.schedule.ssfusion.selective_buffers`).
    """
    spec = schemes.get(scheme)  # raises on an unknown scheme
    pooled = spec.budget == "pooled" if pooled is None else bool(pooled)
    min_k = spec.min_k_under(pooled) if min_k is None else min_k
    needs = spec.needs_cost_model
    density = validate_density(density, "density")
    min_density = validate_density(min_density, "min_density")
    names = [str(n) for n in names]
    if not names:
        raise ValueError("make_plan needs at least one tensor")
    if len(set(names)) != len(names):
        raise ValueError("make_plan: duplicate tensor names")
    for n in names:
        if n not in numel:
            raise ValueError(f"make_plan: no numel for tensor {n!r}")
        v = numel[n]
        if isinstance(v, bool) or int(v) != v or v < 0:
            raise ValueError(f"make_plan: numel[{n!r}] must be an integer >= 0, got {v!r}")
    numel = {n: int(numel[n]) for n in names}
    if int(elem_bytes) != elem_bytes or elem_bytes < 1:
        raise ValueError(f"elem_bytes must be a positive integer, got {elem_bytes!r}")
    for key, v in (("bucket_bytes", bucket_bytes), ("first_bucket_bytes", first_bucket_bytes)):
        if v is not None and (isinstance(v, bool) or int(v) != v or v < 1):
            raise ValueError(f"{key} must be a positive integer, got {v!r}")
    if cost is not None:
        if not isinstance(cost, CostModel):
            raise ValueError(f"cost must be a CostModel, got {type(cost).__name__}")
        missing = [n for n in names if n not in cost.backward]
        if missing:
            raise ValueError(f"the cost model has no backward time for {missing[:5]}")
    elif needs:
        raise ValueError(f"scheme {scheme!r} needs a cost model (gradsync.schedule.costmodel)")

    job = PlanInputs(spec, names, numel, density, cost, elem_bytes, bucket_bytes,
                     first_bucket_bytes, min_density, min_k, pooled)
    buffers, info = PLANNER_FUNCTIONS[spec.planner](job)
    info = {"density": density, **info}
    if "whole_below_min_k" not in info:  # the other planners: after the fact
        buffers, info["whole_below_min_k"] = whole_below(buffers, min_k)
    plan = Plan(scheme, buffers, overlap=spec.overlap, info=info)
    if cost is not None:
        tl = simulate(plan, cost)
        info["predicted"] = {"iteration": tl.iteration, "backward": tl.backward,
                             "sparsify": tl.sparsify, "comm": tl.comm,
                             "exposed_comm": tl.exposed_comm}
    return plan
