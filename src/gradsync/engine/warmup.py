"""Warm-up: the backward order, the cost model, and the plan (SSFusion §IV-A).

Schemes that need a cost model (MG-WFBP/OMGS, Cupcake, SSFusion*) first run
``Config.warmup_steps`` profiling iterations without overlap (SSFusion §IV-B uses 5): the
gradient hooks only time the backward pass, and the step runs on a *provisional plan*
(:func:`provisional_plan`: DDP's fixed buckets in reversed registration order; all-reduced for
the per-tensor planners, so no residual is left for the planned step to flush at once).
Then (:func:`final_plan`) every rank profiles the group's
α/β (all-reduce and all-gather, Eq. 3/4), rank 0 profiles sparsification inline and offloaded,
turns the hook timestamps into the backward order and T_b per tensor (:func:`backward_profile`),
builds the :class:`~gradsync.schedule.costmodel.CostModel` and plans; the plan and the cost
model are broadcast so every rank runs the same one. Every scheme runs at least one such step to
observe the real backward order of the gradients.

``auto`` profiles like the cost-model schemes but on DDP's dense buckets, and afterwards keeps
checking its plan (:mod:`gradsync.engine.drift`).

The measurements are looked up at call time — ``costmodel.profile_collectives``,
``costmodel.profile_sparse_call``,
``costmodel.profile_sparsifier`` and this module's ``backward_profile`` — so a test can pin them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from gradsync import schedule, sparsify
from gradsync.collectives.comm import Comm
from gradsync.engine.config import Config
from gradsync.schedule import BufferPlan, Plan, budget, costmodel, schemes

__all__ = ["Masses", "Warmup", "backward_profile", "final_plan", "from_rank0", "link_costs",
           "plan_kwargs", "provisional_plan"]

# The planners whose buffers are sparsified as one fused vector (the others: per tensor).
_FUSED_PLANNERS = ("single", "mgwfbp", "cupcake")


class Masses:
    """Each tensor's Σ|g| over the profiling steps (``Config.budget`` ``"blend"`` and
    ``"gradient"``), kept on the gradients' device per job: one fused L1 norm, one stack and
    one add per job and step, one host read when the plan is made (:meth:`totals`)."""

    def __init__(self, saved: dict[str, float] | None = None,
                 device: torch.device | None = None) -> None:
        # per job (its tensors' names): their masses so far; a checkpoint's, one per tensor
        self._jobs: dict[tuple[str, ...], torch.Tensor] = {
            (n,): torch.tensor([float(v)], device=device) for n, v in (saved or {}).items()}

    def weigh(self, names: Sequence[str], sizes: Sequence[int], grad: torch.Tensor) -> None:
        """Add a job's local gradient (``grad``: its tensors' flat concatenation). A tensor
        whose gradient holds a NaN or Inf (an overflow a GradScaler skips) adds nothing."""
        key = tuple(names)
        v = torch.stack(torch._foreach_norm(list(grad.detach().split(list(sizes))), 1)).float()
        v = torch.nan_to_num(v, nan=0.0, posinf=0.0)
        self._jobs[key] = v if key not in self._jobs else self._jobs[key].add_(v)

    def rescale(self, factor: float) -> None:
        """The gradients are ``factor`` times larger from now on (a loss scale that changed):
        the masses so far are brought to the new units, as residuals are, so a step weighs
        what its unscaled gradient does (a power of two: bit for bit the unscaled run's)."""
        for v in self._jobs.values():
            v.mul_(factor)

    def saved(self) -> dict[str, float]:
        """The masses so far by tensor, for a checkpoint (a host read, at saving only)."""
        out: dict[str, float] = {}
        for key, v in self._jobs.items():
            for n, x in zip(key, v.tolist()):
                out[n] = out.get(n, 0.0) + x
        return out

    def totals(self, names: Sequence[str], comm: Comm,
               device: torch.device | None = None) -> dict[str, float]:
        """Every rank's masses of ``names`` summed (one all-reduce of one value per tensor,
        through ``comm``, which counts it, on ``device``: the gradients', which the group's
        backend takes; default: the masses'); a tensor never weighed counts 0."""
        dev = device or (next(iter(self._jobs.values())).device if self._jobs
                         else torch.device("cpu"))
        t = torch.zeros(len(names), dtype=torch.float64, device=dev)
        at = {n: i for i, n in enumerate(names)}
        for key, v in self._jobs.items():
            t.index_add_(0, torch.tensor([at[n] for n in key], device=dev), v.to(t))
        if comm.size > 1:
            comm.all_reduce(t)
        return dict(zip(names, t.tolist()))


@dataclass
class Warmup:
    """Profiling progress: steps left, the hook timestamps observed so far and, under
    ``Config.budget`` ``"blend"`` or ``"gradient"``, the gradient's masses (:class:`Masses`)."""

    left: int
    samples: list[dict[str, float]] = field(default_factory=list)
    mass: Masses | None = None  # None: the plan's budget is even

    @classmethod
    def for_config(cls, cfg: Config) -> Warmup:
        """``warmup_steps`` for cost-model schemes and for a budget by the gradient's mass,
        one step (the backward order) otherwise."""
        weighs = cfg.plan is None and budget.weighs(cfg.effective_budget,
                                                    schemes.get(cfg.scheme).planner)
        steps = cfg.warmup_steps if schemes.get(cfg.scheme).needs_cost_model or weighs else 1
        return cls(steps, mass=Masses() if weighs else None)

    @classmethod
    def loaded(cls, cfg: Config, state: dict[str, Any], device: torch.device) -> Warmup:
        """The progress a ``GradSync.state_dict`` saved (its masses onto ``device``)."""
        out = cls.for_config(cfg)
        out.left = int(state["warmup_left"])
        out.samples = [dict(t) for t in state.get("bwd_times", [])]
        if out.mass is not None:
            out.mass = Masses(state.get("warmup_mass"), device)
        return out

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


def plan_kwargs(cfg: Config) -> dict[str, Any]:
    return {"bucket_bytes": schedule.bucket_bytes_of(cfg.bucket_mb),
            "first_bucket_bytes": schedule.bucket_bytes_of(cfg.first_bucket_mb),
            "min_density": cfg.min_density, "min_k": cfg.effective_min_k, "pooled": cfg.pooled}


def provisional_plan(cfg: Config, order: list[str], numel: dict[str, int]) -> Plan:
    """The plan before the backward order is observed (``order``: reversed registration, as
    DDP assumes); a scheme without a cost model gets its real plan."""
    spec = schemes.get(cfg.scheme)
    if not spec.needs_cost_model:
        return schedule.make_plan(cfg.scheme, order, numel, cfg.density, **plan_kwargs(cfg))
    if spec.planner == "auto":  # DDP's buckets, all-reduced (nothing is compressed yet)
        base = schedule.make_plan("dense_ovlp", order, numel, cfg.density, **plan_kwargs(cfg))
        return Plan(scheme=cfg.scheme, buffers=base.buffers, info={"provisional": True})
    if spec.planner in _FUSED_PLANNERS:
        # fixed buckets, sparsified as fused vectors: multi-tensor semantics while profiling
        base = schedule.make_plan("dense_ovlp", order, numel, cfg.density, **plan_kwargs(cfg))
        bufs = [BufferPlan(tensors=b.tensors, mode="fused", density=cfg.density)
                for b in base.buffers]
        return Plan(scheme=cfg.scheme, buffers=bufs, info={"provisional": True})
    # SSFusion*: DDP's buckets, all-reduced. Sparsified tensor by tensor at the target density
    # instead, the warm-up left residuals that the tensors the final plan sends whole flushed in
    # one step: ResNet-18 seed 1's loss jumped 5x at the first planned step and spiked on to
    # 54.4 %; warmed up dense, 85.76 % and no spike (docs/results/resnet18-seed1)
    base = schedule.make_plan("dense_ovlp", order, numel, cfg.density, **plan_kwargs(cfg))
    return Plan(scheme=cfg.scheme, buffers=base.buffers, info={"provisional": True})


def given_plan(cfg: Config, numel: dict[str, int]) -> Plan | None:
    """``Config.plan`` as a :class:`Plan`, checked against the synchronized tensors (``numel``:
    name → size): every one listed exactly once, with its size; ``None`` without one."""
    if cfg.plan is None:
        return None
    plan = Plan.from_dict(cfg.plan)
    listed = {t.name: t.numel for b in plan.buffers for t in b.tensors}
    missing = sorted(set(numel) - set(listed))
    unknown = sorted(set(listed) - set(numel))
    sizes = sorted(n for n in set(listed) & set(numel) if listed[n] != numel[n])
    if missing or unknown or sizes:
        why = [f"{what} {names[:5]}" for what, names in (
            ("missing", missing), ("not synchronized here", unknown), ("sizes differ for", sizes))
            if names]
        raise ValueError(f"Config.plan does not fit this model: {'; '.join(why)}")
    return plan


def final_plan(cfg: Config, samples: list[dict[str, float]], names: Sequence[str],
               numel: dict[str, int], elem_bytes: int, sparsifier: str,
               group: dist.ProcessGroup | None, rank: int, P: int, device=None,
               comm: Comm | None = None,
               new_collective: Callable[[], Any] | None = None,
               mass: dict[str, float] | None = None,
               ) -> tuple[Plan, costmodel.CostModel | None]:
    """After the profiling steps: cost model → plan on rank 0 → broadcast (every rank calls).
    The collectives' probes and the plan's broadcast go through ``comm``, which counts them.

    ``samples``: the hook timestamps of the profiling steps; ``names``, ``numel``,
    ``elem_bytes``: the synchronized tensors (registration order); ``sparsifier``: the name of
    the engine's sparsifier, whose cost is profiled on ``device`` (the parameters'; None: CPU),
    where the job's collectives are profiled too. ``auto`` also times one call of a fresh
    instance of the scheme's sparse collective (``new_collective``;
    ``costmodel.profile_sparse_call``) and adds that fixed cost per call to the all-gather's α
    (``costmodel.with_call_cost``): without it the model priced a sparse buffer as a raw
    all-gather and chose sparse plans slower than DDP's dense buckets, until the trials replaced
    them (docs/results/speed.md, "The warm-up's windows and trials"). Every other cost-model
    scheme does too where no core is spare (``costmodel.spare_core``), where each buffer's call
    takes the backward's core: there SSFusion-OI's CNN plan at P = 2, 1 Gbit/s, had a second
    buffer of 320 entries sent whole, 1.5 ms a step slower than one (speed.md, "A sparse call
    is not a raw all-gather"). ``mass`` (:meth:`Masses.totals`, the same on every rank):
    the plan's sparse entries are shared by it (``Config.budget`` ``"blend"``, ``"gradient"``,
    :func:`~gradsync.schedule.budget.apportion`).
    """
    order, backward = backward_profile(samples, list(names))
    spec = schemes.get(cfg.scheme)
    needs = spec.needs_cost_model
    payload: list[Any] = [None]
    call_s = call_extra = None
    dev = torch.device(device or "cpu")
    if needs:
        ar, ag = costmodel.profile_collectives(group, device=device, comm=comm)
        if (new_collective is not None and P > 1
                and (spec.planner == "auto" or not costmodel.spare_core(dev.type))):
            call_s = costmodel.profile_sparse_call(new_collective(), group, device=device,
                                                   comm=comm)
            ag, raw = costmodel.with_call_cost(ag, call_s, P), ag
            call_extra = (ag.alpha - raw.alpha) * (P - 1)  # its cost above a raw call
    if rank == 0:
        cost = None
        if needs:
            probe = sparsify.get(sparsifier, density=cfg.density, seed=cfg.seed)
            inline = costmodel.profile_sparsifier(probe, device=device)
            offload = costmodel.profile_sparsifier(probe, offload=True, device=device)
            cost = costmodel.CostModel(
                P=P, order=order, numel=dict(numel), elem_bytes=elem_bytes,
                backward=backward, sparsify=inline, offload=offload,
                allreduce=ar, allgather=ag,
                info={"device": dev.type,
                      # buffers selected at once (sparsify.segments): SSFusion-O's rule
                      "segmented": sparsify.segments.pays_on(dev),
                      # whether SSFusion-O's worker has a core of its own (rank 0's host)
                      "cores_per_rank": costmodel.cores_per_rank(),
                      **({} if call_s is None else {"sparse_call_s": call_s,
                                                    "call_overhead_s": call_extra})})
        plan = schedule.make_plan(cfg.scheme, order, numel, cfg.density, cost, **plan_kwargs(cfg))
        if mass is not None:
            plan = budget.apportion(plan, mass, cfg.effective_min_k, cfg.effective_budget)
        payload = [{"plan": plan.to_dict(), "cost": cost.to_dict() if cost else None}]
    return from_rank0(payload, group, P, comm)


def from_rank0(payload: list[Any], group: dist.ProcessGroup | None, P: int,
                comm: Comm | None = None) -> tuple[Plan, costmodel.CostModel | None]:
    """Rank 0's ``{"plan", "cost"}`` on every rank (through ``comm``, which counts it)."""
    got = payload[0]
    if P > 1:
        got = (comm or Comm(group)).broadcast_object(got, 0)
    cost = costmodel.CostModel.from_dict(got["cost"]) if got["cost"] else None
    return Plan.from_dict(got["plan"]), cost


def link_costs(sparsifier: sparsify.Sparsifier, group: dist.ProcessGroup | None,
               comm: Comm | None = None, device: torch.device | None = None
               ) -> tuple[costmodel.AlphaBeta, costmodel.AlphaBeta, costmodel.AffineFit]:
    """The DDP hook's cost model for ``auto`` (a collective): all-reduce and all-gather α/β of
    ``group`` and the inline cost of ``sparsifier`` on ``device`` (the gradients'; default the
    CPU), max-reduced over the ranks so that every rank decides every bucket alike. Its
    traffic goes through ``comm``, which counts it."""
    comm = comm if comm is not None else Comm(group)
    ar, ag = costmodel.profile_collectives(group, comm=comm)
    sp = costmodel.profile_sparsifier(sparsifier, device=device)
    if comm.size > 1:
        t = torch.tensor([sp.a, sp.b], dtype=torch.float64)
        comm.all_reduce(t, op=dist.ReduceOp.MAX)
        sp = costmodel.AffineFit(*t.tolist())
    return ar, ag, sp
