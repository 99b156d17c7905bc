"""Where a per-tensor plan's entries go: one density for every tensor, or each tensor's share
of the gradient (``Config.budget``).

SSFusion (§IV-B) and ``per_tensor`` select every tensor they sparsify at one density d (d′
after compensation), so each tensor sends k_i = d·n_i entries a step. A global top-k with error
feedback (TopkA) sends instead what crosses one threshold θ over the whole model: an entry
whose gradient averages |g| crosses it about every θ/|g| steps, so tensor i's share of the k
entries a step is close to its share of the gradient's L1 mass, m_i / Σ m. Measured on
ResNet-18 and ResNet-20 (docs/results/accuracy-history.md, "One density for every tensor"), TopkA
gives its classifier 48 % of its weights a step and per_tensor 1 %: per_tensor ended 3.28 points
below DDP, and +0.28 with its entries moved by TopkA's shares (the same entries a step).

:func:`apportion` keeps a plan's sparsified tensors, its tensors sent whole and its total
entries K = Σ k_i, and gives tensor i

    k_i = K · m_i / Σ m,  at least ``min_k`` (or n_i), at most n_i,

the bounds met by water-filling: a tensor pushed past one is fixed at it and the rest of K is
shared again by mass among the others. ``"blend"`` shares half of K each way,

    k_i = K · (m_i / Σ m + n_i / Σ n) / 2,

so that no tensor gets less than half of what either rule gives it (bounds aside): at 1 % on
ResNet-18, the mass alone lifted per_tensor (whose classifier had 1 % of its weights) by 4.17
points but cost SSFusion-OI (its classifier already whole) 2.38, its wide convolutions left far
below 1 %. ``"blend"`` is ``per_tensor``'s, HiPress's and Espresso's default
(``Scheme.budget``): it kept the CNN's SSFusion family and ``per_tensor`` within issue 68's
bars and left TinyGPT where one density did (docs/results/accuracy-history.md, "Blend, the
default"). The masses are the engine's sums of |g| over its profiling steps
(:mod:`gradsync.engine.warmup`); every rank plans from the same sums.

``"pooled"``, the SSFusion family's default, shares nothing in the plan: it stays the even
one, and each job selects its sparsified tensors' Σ k_i entries with one top-k over all of
them, step by step (:attr:`gradsync.engine.jobs.Job.pools`; docs/results/accuracy-history.md,
"SSFusion's buffers pooled").
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from gradsync.schedule.plan import BufferPlan, Plan, TensorPlan

__all__ = ["APPORTIONED", "BUDGETS", "apportion", "shares", "weighs"]

# Config.budget: "even" (one density, the papers' rule), "gradient" (by L1 mass), "blend"
# (half of the entries each way) or "pooled" (one selection over a job's sparsified tensors,
# engine.jobs.Job.pools)
BUDGETS = ("even", "gradient", "blend", "pooled")
WEIGHED = ("gradient", "blend")  # the rules that share entries by the profiling steps' mass
# the planners whose plans sparsify tensors one by one, planned once after the warm-up (auto
# re-plans on drift, the others fuse): Config.budget applies to them
APPORTIONED = ("per_tensor", "ssfusion", "hipress", "espresso")


def weighs(rule: str, planner: str) -> bool:
    """Whether a plan by ``planner`` shares its entries by the gradient's mass under ``rule``
    (a ``Config.budget``): the engine and the DDP hook then weigh the profiling steps'
    gradients."""
    return rule in WEIGHED and planner in APPORTIONED


def shares(k_total: int, numel: Mapping[str, int], mass: Mapping[str, float], min_k: int
           ) -> dict[str, int]:
    """Entries per tensor: ``k_total`` shared by ``mass`` within [min(min_k, n), n] for each
    tensor of ``numel`` (water-filling; the sum is ``k_total`` up to rounding, or the bounds'
    sum where they leave no choice). A tensor of no mass gets its floor, unless only such
    tensors are left below their bounds: they then share the rest by size."""
    if k_total < 0 or min_k < 1 or not all(0 <= m < math.inf for m in mass.values()):
        raise ValueError(f"shares: k_total >= 0, min_k >= 1 and finite masses >= 0 needed, got "
                         f"{k_total!r}, {min_k!r}, {[m for m in mass.values() if not m >= 0][:1]}")
    lo = {n: min(min_k, numel[n]) for n in numel}
    fixed: dict[str, int] = {}
    while True:
        free = [n for n in numel if n not in fixed]
        left = k_total - sum(fixed.values())
        m = sum(mass[n] for n in free)
        w = mass if m > 0 else numel  # only massless tensors left: the rest by size, evenly
        total = sum(w[n] for n in free)
        want = {n: left * w[n] / total for n in free}
        over = {n for n in free if want[n] > numel[n]}
        under = {n for n in free if want[n] < lo[n]}
        if not (over or under):
            return {**fixed, **{n: max(lo[n], min(numel[n], round(want[n]))) for n in free}}
        # fix the side that is further out of bounds first, so one pass cannot overshoot
        if sum(want[n] - numel[n] for n in over) >= sum(lo[n] - want[n] for n in under):
            fixed.update({n: numel[n] for n in over})
        else:
            fixed.update({n: lo[n] for n in under})


def apportion(plan: Plan, mass: Mapping[str, float], min_k: int, rule: str = "gradient"
              ) -> Plan:
    """``plan`` with the entries of its sparsified tensors (``per_tensor`` buffers, density
    not None) shared by ``mass`` (:func:`shares`; ``rule="blend"``: by m_i/Σm + n_i/Σn, half of
    K by the mass and half evenly); the total and everything else is kept:
    buffers, modes, tensors sent whole, offload and all-reduce choices. A plan without such
    tensors, or whose masses are all zero, comes back unchanged."""
    sparse = {t.name: t for b in plan.buffers if b.mode == "per_tensor"
              for t in b.tensors if t.density is not None and t.numel > 0}
    if not sparse or not any(mass.get(n, 0.0) > 0 for n in sparse):
        return plan
    missing = sorted(set(sparse) - set(mass))
    if missing:
        raise ValueError(f"apportion: no mass for {missing[:5]}")
    if rule not in BUDGETS[1:]:
        raise ValueError(f"apportion: rule must be one of {BUDGETS[1:]}, got {rule!r}")
    numel = {n: t.numel for n, t in sparse.items()}
    m = {n: float(mass[n]) for n in sparse}
    m_sum, n_sum = sum(m.values()), sum(numel.values())
    if rule == "blend" and math.isfinite(m_sum):  # (shares refuses a non-finite mass)
        m = {n: m[n] / m_sum + numel[n] / n_sum for n in sparse}
    k = shares(sum(t.k for t in sparse.values()), numel, m, min_k)
    bufs = [b if b.mode != "per_tensor" else BufferPlan(
        tuple(TensorPlan(t.name, t.numel, k[t.name] / t.numel, t.offload, t.allreduce)
              if t.name in k else t for t in b.tensors), "per_tensor") for b in plan.buffers]
    info = {**plan.info, "budget": rule}
    return Plan(scheme=plan.scheme, buffers=bufs, overlap=plan.overlap, info=info)
