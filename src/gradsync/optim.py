"""AdamW for compressed gradients: momentum correction with a frozen variance.

DGC's momentum correction (DGC §3.2, :mod:`gradsync.feedback`) moves SGD's momentum into error
feedback: each rank keeps a velocity ``u_t = β1 · u_{t-1} + g_t``, compresses ``u`` and the
optimizer applies the average of what was sent. Adam cannot simply follow: it divides every
coordinate by the root of its second moment ``v``, so a coordinate whose accumulated gradient
arrives once every hundred steps moves about as far as one dense step would, not a hundred —
compressed AdamW runs behind (TinyGPT, 1 % density, P = 4, 200 steps, one seed: TopkA with
AdamW reached held-out perplexity 15.71 against DDP's 10.74; with this optimizer 13.15).

The recipe of 1-bit Adam (Tang et al., ICML 2021, §3): run exact Adam while gradients travel
uncompressed for a short warm-up, then **freeze** ``v`` and compress the momentum with error
feedback; with ``v`` fixed the update is linear in the momentum, so error feedback's guarantee
(every entry is applied eventually) carries over to the parameters. :class:`FrozenVarianceAdamW`
is the optimizer half of that recipe on top of DGC's momentum correction:

* its ``.grad`` is the averaged velocity ``ū_t`` that :class:`gradsync.GradSync` writes with
  ``Config(momentum=β1)``;
* warm-up, steps ``t ≤ freeze_step``: gradients must be sent whole (``Config.density_warmup =
  (1.0,)`` for those steps), so ``ū_t = β1 · ū_{t-1} + ḡ_t`` and the optimizer recovers
  ``ḡ_t = ū_t − β1 · ū_{t-1}`` and updates ``v`` exactly as AdamW does; the update equals
  AdamW's on ``ḡ`` up to rounding;
* afterwards ``v`` stays as it was at step ``freeze_step`` (bias-corrected there), and the
  update is ``p ← p − lr · m̂_t / (√v̂ + eps)`` with ``m̂_t = (1 − β1) · ū_t / (1 − β1^t)``;
  decoupled weight decay as AdamW.

**Preconditioned compression** (``sync=``). With the variance frozen the update of entry ``i``
is ``lr · m̂_i / d_i``, ``d = √v̂ + eps``, so an entry's importance is ``|acc_i| / d_i``, not
``|acc_i|``: the raw magnitudes that top-k ranks favour the layers with large gradients even where
Adam would move a small-gradient layer (LayerNorm, embeddings) as far. Given the engine (a
:class:`gradsync.GradSync`, or the DDP hook's :class:`~gradsync.integrations.ddp.HookState`) as
``sync``, the optimizer hands it ``s = 1 / d`` at the freeze (``sync.precondition``): error
feedback then accumulates and compresses ``s ⊙ u``, and the optimizer applies
``p ← p − lr · m̂_t`` without dividing. Sent whole this is the same update (linear in ``u``);
compressed, the selection ranks entries by what they move. Measured on TinyGPT (1 %, P = 4,
3 seeds, held-out perplexity, 60 steps, DDP 17.03; momentum factor masking still on then): TopkA
23.05 → 20.15, SSFusion 27.85 → 24.15, Ok-Topk 24.18 → 21.35; per_tensor, whose budget is per
tensor, gains least (22.36 → 20.93). At 600 steps (2 seeds, DDP 7.74): TopkA 8.53 → 8.40,
SSFusion 9.45 → 9.19, per_tensor 8.50 → 8.54.

**Safeguard.** An entry with (almost) no gradient during the warm-up has a variance near 0, and a
frozen 0 would turn its first later gradient into a step of ``lr / eps``; at the freeze every
entry's variance is raised to at least :data:`VARIANCE_FLOOR` of its tensor's mean (an entry then
moves at most ten times as far as a typical one of its tensor for the same momentum).

Frozen ``v`` on its own costs nothing measurable: TinyGPT with every gradient sent whole and ``v``
frozen after 10 of 200 steps reached perplexity 10.63 against AdamW's 10.74.

State (``state_dict()``): per parameter ``step``, ``exp_avg_sq`` (fp32), during the warm-up
``prev_velocity`` (fp32) and, once preconditioned, ``preconditioned`` (True: ``.grad`` arrives
scaled); ``freeze_step`` and the betas are part of each parameter group. Resume the engine from
the same step's checkpoint: its state holds the scales.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import torch

__all__ = ["VARIANCE_FLOOR", "FrozenVarianceAdamW", "Preconditionable"]

# At the freeze, each entry's variance is at least this share of its tensor's mean variance
# (module docstring, "Safeguard").
VARIANCE_FLOOR = 1e-2


class Preconditionable(Protocol):
    """What ``sync=`` must offer: :meth:`gradsync.GradSync.precondition`'s method."""

    def precondition(self, scales: Mapping[Any, torch.Tensor]) -> None: ...


class FrozenVarianceAdamW(torch.optim.Optimizer):
    """AdamW whose ``.grad`` is a DGC velocity (module docstring).

    Args:
        params: parameters or parameter groups, as for :class:`torch.optim.AdamW`.
        lr: learning rate (> 0).
        betas: ``(β1, β2)`` in [0, 1); ``β1`` must equal the engine's ``Config.momentum``.
        eps: added to ``√v̂`` (> 0).
        weight_decay: decoupled weight decay (>= 0).
        freeze_step: the warm-up length in optimizer steps (>= 1); during it every gradient
            must arrive whole.
        sync: the engine whose error feedback compresses this optimizer's momentum; at the
            freeze it gets the scales ``1 / (√v̂ + eps)`` and ``.grad`` arrives preconditioned
            afterwards (module docstring). ``None``: the optimizer divides by ``√v̂ + eps``.
            A ``sync`` with ``follow`` (GradSync, the hook) follows this optimizer's learning
            rate (:meth:`gradsync.GradSync.follow`).
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, freeze_step: int = 10,
                 sync: Preconditionable | None = None) -> None:
        if not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr!r}")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
        if not eps > 0:
            raise ValueError(f"eps must be > 0, got {eps!r}")
        if not weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")
        if isinstance(freeze_step, bool) or not isinstance(freeze_step, int) or freeze_step < 1:
            raise ValueError(f"freeze_step must be an integer >= 1, got {freeze_step!r}")
        if sync is not None and not callable(getattr(sync, "precondition", None)):
            raise ValueError(f"sync must have a precondition() method (a GradSync or the DDP "
                             f"hook's HookState), got {type(sync).__name__}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps,
                                  "weight_decay": weight_decay, "freeze_step": freeze_step})
        self.sync = sync
        if callable(getattr(sync, "follow", None)):
            sync.follow(self)  # a schedule's rate changes keep the residual's debt (Units)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        scales: dict[torch.Tensor, torch.Tensor] = {}  # parameters freezing in this step
        for group in self.param_groups:
            b1, b2 = group["betas"]
            lr, frozen_at = group["lr"], group["freeze_step"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("FrozenVarianceAdamW does not take sparse .grad tensors")
                u = p.grad.detach().to(torch.float32, copy=True)
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg_sq"] = torch.zeros_like(u)
                    state["prev_velocity"] = torch.zeros_like(u)
                t = state["step"] = state["step"] + 1
                v = state["exp_avg_sq"]
                if t <= frozen_at:  # warm-up: ḡ = ū_t − β1·ū_{t-1}, exact AdamW
                    prev = state["prev_velocity"]
                    g = u - b1 * prev
                    v.mul_(b2).addcmul_(g, g, value=1 - b2)
                    if t < frozen_at:
                        prev.copy_(u)
                update = u.mul_((1 - b1) / (1 - b1 ** t))
                if not state.get("preconditioned"):  # a preconditioned .grad is divided already
                    update.div_(self._denominator(v, b2, min(t, frozen_at), group["eps"]))
                if t == frozen_at:  # the variance freezes (this step was still AdamW's)
                    del state["prev_velocity"]
                    # no (or almost no) gradient during the warm-up leaves a variance near 0,
                    # and a frozen 0 would turn the first later gradient into a step of lr/eps
                    v.clamp_(min=VARIANCE_FLOOR * float(v.mean()))
                    if self.sync is not None:
                        scales[p] = self._denominator(v, b2, frozen_at, group["eps"]
                                                      ).reciprocal_()
                        state["preconditioned"] = True
                if group["weight_decay"]:
                    p.mul_(1 - lr * group["weight_decay"])
                p.add_(update.to(p.dtype), alpha=-lr)
        if scales:  # one call (one cross-rank check) for every parameter freezing now
            assert self.sync is not None
            self.sync.precondition(scales)
        return loss

    @staticmethod
    def _denominator(v: torch.Tensor, b2: float, t: int, eps: float) -> torch.Tensor:
        """``√(v / (1 − β2^t)) + eps``, a new tensor."""
        return (v / (1 - b2 ** t)).sqrt_().add_(eps)
