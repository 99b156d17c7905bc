"""``Config.budget`` (``"gradient"``, ``"blend"``) through the DDP hook
(:mod:`gradsync.schedule.budget`).

The engine weighs the gradient in its profiling steps and plans once. The hook has no plan: it
decides each bucket's densities at every call (``ddp._densities``). Here its first
``warmup_steps`` steps run at those (even) densities while every bucket's local gradient is
weighed (:class:`~gradsync.engine.warmup.Masses`, one fused norm per bucket); at the first
bucket of step ``warmup_steps`` the ranks sum the masses (one all-reduce), and the tensors the
hook's own rule sparsifies, over the whole model, share their entries by them
(:func:`~gradsync.schedule.budget.apportion`): the same densities on every rank from then on,
the tensors sent whole and the entries a step unchanged, as in the engine's plan. Without the
model (``gradsync.ddp.hook(cfg)``) the tensors are those its buckets brought in those steps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from gradsync.collectives.comm import Comm
from gradsync.engine.config import Config
from gradsync.engine.warmup import Masses
from gradsync.schedule import BufferPlan, Plan, TensorPlan, schemes
from gradsync.schedule.budget import apportion, weighs

__all__ = ["HookBudget"]


class HookBudget:
    """The hook's per-tensor densities under ``Config.budget``: the masses of the first
    ``warmup_steps`` steps (:meth:`weigh`), then the densities they give (:meth:`settle`,
    :meth:`densities`). Inactive (every method a no-op) for ``"even"`` and for schemes whose
    planner does not sparsify tensor by tensor."""

    def __init__(self, cfg: Config, sizes: Sequence[tuple[str, int]] | None) -> None:
        active = weighs(cfg.effective_budget, schemes.get(cfg.scheme).planner)
        # the trained parameters (name, numel); without the model, those the buckets brought
        self.sizes: dict[str, int] = dict(sizes or [])
        self.given = sizes is not None
        self.steps, self.min_k = cfg.warmup_steps, cfg.effective_min_k
        self.rule = cfg.effective_budget
        self.mass: Masses | None = Masses() if active else None
        self.density: dict[str, float | None] | None = None  # settled: each tensor's

    def weigh(self, step: int, names: Sequence[str], numels: Sequence[int],
              buf: torch.Tensor) -> None:
        """Add a bucket's local gradients (``buf``, before anything changes it) in the first
        ``warmup_steps`` steps."""
        if self.mass is not None and step < self.steps:
            self.mass.weigh(names, numels, buf)
            if not self.given:
                self.sizes.update(zip(names, numels))

    def rescale(self, factor: float) -> None:
        """The masses so far into a changed loss scale's units (:meth:`Masses.rescale`)."""
        if self.mass is not None:
            self.mass.rescale(factor)

    def settle(self, step: int, comm: Comm, even: Callable[[list[int]], list[float | None]],
               device: torch.device | None = None) -> None:
        """At the first bucket of step ``warmup_steps``, on every rank: the masses summed (on
        ``device``, the bucket's: a checkpoint's masses come back on the CPU, which NCCL does
        not take) and the model's densities shared by them; ``even(numels)``: the hook's own
        densities of tensors of these sizes (None: sent whole)."""
        if self.mass is None or step < self.steps:
            return
        names, numels = list(self.sizes), list(self.sizes.values())
        mass = self.mass.totals(names, comm, device)
        plan = Plan("ddp_hook", [BufferPlan(tuple(TensorPlan(n, k, d) for n, k, d in zip(
            names, numels, even(numels))), "per_tensor")])
        shared = apportion(plan, mass, self.min_k, self.rule)
        self.density = {t.name: t.density for b in shared.buffers for t in b.tensors}
        self.mass = None

    def densities(self, names: Sequence[str], chosen: list[float | None]
                  ) -> list[float | None]:
        """A bucket's densities: ``chosen`` (the hook's even ones) before :meth:`settle`,
        then each sparsified tensor's share."""
        if self.density is None:
            return chosen
        return [None if d is None else self.density.get(n, d) for n, d in zip(names, chosen)]

    def state_dict(self) -> dict[str, Any]:
        return {"budget": {"mass": None if self.mass is None else self.mass.saved(),
                           "density": self.density, "sizes": dict(self.sizes)}}

    def load(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (its masses on the CPU until :meth:`settle`); a state
        saved without one (or with an even budget) leaves this as built."""
        saved = state.get("budget")
        if saved is None or (self.mass is None and self.density is None):
            return
        self.density = saved["density"]
        self.mass = None if self.density is not None else Masses(saved["mass"])
        if not self.given:
            self.sizes.update(saved.get("sizes") or {})
