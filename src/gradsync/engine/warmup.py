"""Warm-up: the backward order, the cost model, and the plan (SSFusion §IV-A).

Schemes that need a cost model (MG-WFBP/OMGS, Cupcake, SSFusion*) first run
``Config.warmup_steps`` profiling iterations without overlap (SSFusion §IV-B uses 5): the
gradient hooks only time the backward pass, and the step runs on a *provisional plan*
(:func:`provisional_plan`: DDP's fixed buckets in reversed registration order, sent the way the
scheme's planner sends its buffers). Then (:func:`final_plan`) every rank profiles the group's
α/β (all-reduce and all-gather, Eq. 3/4), rank 0 profiles sparsification inline and offloaded,
turns the hook timestamps into the backward order and T_b per tensor (:func:`backward_profile`),
builds the :class:`~gradsync.schedule.costmodel.CostModel` and plans; the plan and the cost
model are broadcast so every rank runs the same one. Every scheme runs at least one such step to
observe the real backward order of the gradients.

The measurements are looked up at call time — ``costmodel.profile_collectives``,
``costmodel.profile_sparsifier`` and this module's ``backward_profile`` — so a test can pin them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from gradsync import schedule, sparsify
from gradsync.engine.config import Config
from gradsync.schedule import BufferPlan, Plan, costmodel, schemes

__all__ = ["Warmup", "backward_profile", "final_plan", "provisional_plan"]

# The planners whose buffers are sparsified as one fused vector (the others: per tensor).
_FUSED_PLANNERS = ("single", "mgwfbp", "cupcake")


@dataclass
class Warmup:
    """Profiling progress: steps left and the hook timestamps observed so far."""

    left: int
    samples: list[dict[str, float]] = field(default_factory=list)

    @classmethod
    def for_config(cls, cfg: Config) -> Warmup:
        """``warmup_steps`` for cost-model schemes, one step (the backward order) otherwise."""
        return cls(cfg.warmup_steps if schemes.get(cfg.scheme).needs_cost_model else 1)

    def observe(self, hook_times: dict[str, float]) -> None:
        if hook_times:
            self.samples.append(dict(hook_times))


def backward_profile(
    samples: list[dict[str, float]], names: list[str]
) -> tuple[list[str], dict[str, float]]:
    """Backward order (by median ready time) and T_b per tensor from hook timestamps."""
    if not samples:
        return list(reversed(names)), {n: 0.0 for n in names}
    rel = {n: [] for n in names}
    for s in samples:
        t0 = min(s.values())
        for n in names:
            rel[n].append(s.get(n, float("inf")) - t0)
    med = {n: sorted(v)[len(v) // 2] for n, v in rel.items()}
    pos = {n: i for i, n in enumerate(names)}
    order = sorted(names, key=lambda n: (med[n], -pos[n]))  # ties: reverse registration
    finite = [med[n] for n in order if med[n] != float("inf")]
    backward, prev = {}, 0.0
    for n in order:
        t = med[n] if med[n] != float("inf") else (finite[-1] if finite else 0.0)
        backward[n] = max(0.0, t - prev)
        prev = max(prev, t)
    if len(order) > 1:  # the first tensor's own T_b is unobserved: use the mean of the others
        rest = [backward[n] for n in order[1:]]
        backward[order[0]] = sum(rest) / len(rest)
    return order, backward


def _plan_kw(cfg: Config) -> dict[str, Any]:
    return {"bucket_bytes": int(cfg.bucket_mb * 2**20), "min_density": cfg.min_density}


def provisional_plan(cfg: Config, order: list[str], numel: dict[str, int]) -> Plan:
    """The plan before the backward order is observed (``order``: reversed registration, as
    DDP assumes); a scheme without a cost model gets its real plan."""
    spec = schemes.get(cfg.scheme)
    if not spec.needs_cost_model:
        return schedule.make_plan(cfg.scheme, order, numel, cfg.density, **_plan_kw(cfg))
    if spec.planner in _FUSED_PLANNERS:
        # fixed buckets, sparsified as fused vectors: multi-tensor semantics while profiling
        base = schedule.make_plan("dense_ovlp", order, numel, cfg.density, **_plan_kw(cfg))
        bufs = [BufferPlan(tensors=b.tensors, mode="fused", density=cfg.density)
                for b in base.buffers]
        return Plan(scheme=cfg.scheme, buffers=bufs, info={"provisional": True})
    # fixed buckets, every tensor sparsified on its own
    plan = schedule.make_plan("per_tensor", order, numel, cfg.density, **_plan_kw(cfg))
    plan.scheme = cfg.scheme
    plan.info["provisional"] = True
    return plan


def final_plan(cfg: Config, samples: list[dict[str, float]], names: Sequence[str],
               numel: dict[str, int], elem_bytes: int, sparsifier: str,
               group: dist.ProcessGroup | None, rank: int, P: int, device=None
               ) -> tuple[Plan, costmodel.CostModel | None]:
    """After the profiling steps: cost model → plan on rank 0 → broadcast (every rank calls).

    ``samples``: the hook timestamps of the profiling steps; ``names``, ``numel``,
    ``elem_bytes``: the synchronized tensors (registration order); ``sparsifier``: the name of
    the engine's sparsifier, whose cost is profiled on ``device`` (the parameters'; None: CPU),
    where the job's collectives are profiled too.
    """
    order, backward = backward_profile(samples, list(names))
    needs = schemes.get(cfg.scheme).needs_cost_model
    payload: list[Any] = [None]
    if needs:
        ar, ag = costmodel.profile_collectives(group, device=device)
    if rank == 0:
        cost = None
        if needs:
            probe = sparsify.get(sparsifier, density=cfg.density, seed=cfg.seed)
            inline = costmodel.profile_sparsifier(probe, device=device)
            offload = costmodel.profile_sparsifier(probe, offload=True, device=device)
            cost = costmodel.CostModel(
                P=P, order=order, numel=dict(numel), elem_bytes=elem_bytes,
                backward=backward, sparsify=inline, offload=offload,
                allreduce=ar, allgather=ag)
        plan = schedule.make_plan(cfg.scheme, order, numel, cfg.density, cost, **_plan_kw(cfg))
        payload = [{"plan": plan.to_dict(), "cost": cost.to_dict() if cost else None}]
    if P > 1:
        src = 0 if group is None else dist.get_global_rank(group, 0)
        dist.broadcast_object_list(payload, src=src, group=group)
    got = payload[0]
    cost = costmodel.CostModel.from_dict(got["cost"]) if got["cost"] else None
    return Plan.from_dict(got["plan"]), cost
