"""Where one global budget would go: each tensor's share of a global top-k of the accumulators.

SSFusion gives every tensor its own budget (§IV-B), TopkA one budget over the whole model; the
issue behind this (docs/results/accuracy-history.md, "Why SSFusion trails on TinyGPT, measured") is
which tensors a global selection would feed. ``train --topk-shares`` measures it on rank 0: the
engine's audit records (:class:`gradsync.engine.audit.AuditRecord`) hand over every tensor's
accumulator ``acc`` of a step — the gradient after error feedback, momentum correction and
preconditioning, what the scheme selects from — and for each step that sent anything sparse,
the global top ``k = target_k(N, density)`` of ``|acc|`` over all N entries is counted per
tensor. Steps in which every entry travelled (an AdamW warm-up sent whole, a dense plan) are left
out.

The accumulators carry the run's own history (what earlier selections left in the residuals),
so the shares belong to the scheme they were recorded under. Under ``topka`` they are close to
the allocation TopkA itself makes (its DGC selection estimates the same top k), summed over the
steps.
"""

from __future__ import annotations

from typing import Any

import torch

from gradsync.engine.audit import AuditRecord
from gradsync.sparsify import target_k

__all__ = ["TopkShares"]


class TopkShares:
    """An audit sink (``GradSync(..., audit=TopkShares(d))``) that counts, per step, how many
    of a global top-k of the accumulators each tensor holds; :meth:`result` sums the steps."""

    def __init__(self, density: float) -> None:
        if not 0.0 < density <= 1.0:
            raise ValueError(f"density must be in (0, 1], got {density!r}")
        self.density = float(density)
        self._step: int | None = None
        self._accs: dict[str, torch.Tensor] = {}
        self._sparse = False
        self._numel: dict[str, int] = {}
        self._counts: dict[str, int] = {}
        self._steps: list[int] = []

    def __call__(self, rec: AuditRecord) -> None:
        if self._step is not None and rec.step != self._step:
            self._close()
        self._step = rec.step
        self._accs[rec.name] = rec.acc.detach().reshape(-1).abs().float()
        # sparse: some entry stayed behind in a residual (not every entry travelled)
        self._sparse |= rec.sent_indices.numel() < rec.acc.numel()

    def _close(self) -> None:
        accs, sparse, step = self._accs, self._sparse, self._step
        self._accs, self._sparse, self._step = {}, False, None
        if not sparse or not accs:
            return
        names = list(accs)
        flat = torch.cat([accs[n] for n in names])
        k = target_k(flat.numel(), self.density)
        top = torch.topk(flat, k, sorted=False).indices
        sizes = torch.tensor([accs[n].numel() for n in names], device=flat.device)
        owner = torch.repeat_interleave(torch.arange(len(names), device=flat.device), sizes)
        counts = torch.bincount(owner[top], minlength=len(names)).tolist()
        for n, c in zip(names, counts):
            self._numel[n] = accs[n].numel()
            self._counts[n] = self._counts.get(n, 0) + int(c)
        self._steps.append(int(step))

    def result(self) -> dict[str, Any]:
        """``{"density", "steps": [counted steps], "tensors": {name: {"numel", "topk_share",
        "entry_share"}}}``, tensors in the order first seen; shares sum to 1 (empty when no
        step sent anything sparse)."""
        if self._step is not None:
            self._close()
        total = sum(self._counts.values())
        n_all = sum(self._numel.values())
        return {"density": self.density, "steps": list(self._steps),
                "tensors": {n: {"numel": self._numel[n],
                                "topk_share": self._counts[n] / total if total else 0.0,
                                "entry_share": self._numel[n] / n_all if n_all else 0.0}
                            for n in self._counts}}
