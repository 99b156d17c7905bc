"""AdamW where users train: the integrations apply the frozen-variance recipe themselves.

Hugging Face's Trainer trains with AdamW by default, and so do most Lightning and Accelerate
scripts. Under gradient compression plain AdamW runs far behind: an entry whose accumulated
gradient arrives once in many steps is divided by its second moment and moves about as far as
one dense step (:mod:`gradsync.optim`). Measured on a tiny GPT-2 under the Trainer (2 CPU ranks,
``per_tensor`` at 5 %): loss 1.66 at step 40 against the plain Trainer's 0.23.

So the DDP hook's doors (``GradSyncCallback``, ``GradSyncStrategy``, ``accelerate.register``)
detect ``torch.optim.Adam``/``AdamW`` and, for a sparse scheme, run 1-bit Adam's recipe on top
of DGC's momentum correction (:class:`gradsync.optim.FrozenVarianceAdamW`):

* the hook's configuration (:func:`recipe_config`) moves AdamW's first moment into error
  feedback (``Config.momentum = β1``) and sends every gradient whole for the warm-up
  (``density_warmup=(1.0,)`` for ``freeze_step`` steps, :data:`WARMUP_SHARE` of the run's
  optimizer steps when the door knows them);
* the user's optimizer is replaced, in the object that holds it (Accelerate's
  ``AcceleratedOptimizer``, Lightning's strategy), by a ``FrozenVarianceAdamW`` that shares its
  parameter groups (:func:`frozen_variance`): the learning-rate scheduler, which writes into
  those groups, drives it unchanged, and the hyperparameters (lr, betas, eps, weight decay per
  group) are the user's;
* after the warm-up the variance freezes and the optimizer hands the hook its scales
  ``1/(√v̂ + eps)`` (preconditioned selection: ``HookState.precondition``).

A door that cannot apply it refuses with the one-line fix (:func:`refusal`): AMSGrad or
``maximize`` (the recipe has neither), a ``Config.momentum`` other than 0 or β1, a
``density_warmup`` of the user's own, or no known run length (Accelerate: pass
``adam_warmup=``). ``Config.momentum=β1`` with ``FrozenVarianceAdamW`` wired by hand is left
alone: the doors only replace torch's Adam/AdamW.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch

from gradsync.engine.config import Config
from gradsync.optim import FrozenVarianceAdamW
from gradsync.schedule import schemes

__all__ = ["MIN_WARMUP", "WARMUP_SHARE", "adam_in", "freeze_step_for", "frozen_variance", "put",
           "recipe_config", "refusal"]

# The share of a run's optimizer steps spent in exact AdamW, gradients sent whole, before the
# variance freezes (apps/train's default too), and the fewest such steps: a variance estimated
# from one or two steps is noise, and frozen it preconditions every later step (a tiny GPT-2
# under the Trainer, 16 steps at lr 1e-2, per_tensor at 10 %: the loss rose after a freeze at
# step 2, where plain AdamW's fell).
WARMUP_SHARE = 0.1
MIN_WARMUP = 10


def adam_in(optimizer: Any) -> tuple[Any, torch.optim.Adam] | None:
    """``(holder, adam)``: the torch Adam/AdamW inside ``optimizer`` (through wrappers that keep
    it as ``.optimizer``: Accelerate's, Lightning's) and the object that holds it (``None``
    when ``optimizer`` is Adam itself); ``None`` when there is no Adam."""
    holder, inner = None, optimizer
    for _ in range(8):  # wrappers of wrappers, never a cycle
        if isinstance(inner, torch.optim.Adam):
            return holder, inner
        nxt = getattr(inner, "optimizer", None)
        if nxt is None or nxt is inner:
            return None
        holder, inner = inner, nxt
    return None


def freeze_step_for(total_steps: int) -> int:
    """The warm-up of a run of ``total_steps`` optimizer steps: :data:`WARMUP_SHARE` of them,
    at least :data:`MIN_WARMUP`."""
    return max(MIN_WARMUP, math.ceil(WARMUP_SHARE * total_steps))


def refusal(cfg: Config, adam: torch.optim.Adam, where: str, fix: str) -> str | None:
    """Why the recipe cannot run for ``cfg`` and ``adam`` (``None``: it can), with ``fix``,
    the door's one-line way out, in the message."""
    group = adam.param_groups[0]
    b1 = group["betas"][0]
    why = None
    if any(g.get("amsgrad") or g.get("maximize") for g in adam.param_groups):
        why = "the optimizer uses amsgrad or maximize, which FrozenVarianceAdamW does not have"
    elif len({g["betas"] for g in adam.param_groups}) > 1:
        why = "its parameter groups have different betas"
    elif cfg.momentum not in (0.0, b1):
        why = f"Config.momentum={cfg.momentum} is neither 0 nor the optimizer's beta1={b1}"
    elif cfg.density_warmup:
        why = "Config.density_warmup is set (the recipe's warm-up sends every gradient whole)"
    if why is None:
        return None
    return (f"{where}: the optimizer is torch's {type(adam).__name__}, which runs far behind "
            f"under compressed gradients unless gradsync applies its frozen-variance recipe "
            f"(gradsync.optim.FrozenVarianceAdamW), and it cannot here: {why}. {fix}")


def recipe_config(cfg: Config, adam: torch.optim.Adam, freeze_step: int) -> Config:
    """``cfg`` for the recipe: AdamW's β1 as DGC momentum, every gradient whole for
    ``freeze_step`` steps. Dense schemes and density 1 are returned unchanged (nothing is
    compressed, AdamW runs as it is)."""
    if not schemes.get(cfg.scheme).sparse or cfg.density >= 1.0:
        return cfg
    return replace(cfg, momentum=float(adam.param_groups[0]["betas"][0]),
                   density_warmup=(1.0,), density_warmup_steps=freeze_step)


def frozen_variance(adam: torch.optim.Adam, freeze_step: int, sync: Any
                    ) -> FrozenVarianceAdamW:
    """A ``FrozenVarianceAdamW`` over ``adam``'s own parameter groups (the same dicts, so a
    scheduler that writes ``lr`` into them drives it), handing its scales to ``sync``. A state
    this optimizer saved earlier (a resumed checkpoint loaded into ``adam``) carries over."""
    groups = adam.param_groups
    for g in groups:
        g["freeze_step"] = freeze_step
    new = FrozenVarianceAdamW(groups, lr=groups[0]["lr"], betas=tuple(groups[0]["betas"]),
                              eps=groups[0]["eps"], weight_decay=groups[0]["weight_decay"],
                              freeze_step=freeze_step, sync=sync)
    for p, st in adam.state.items():
        if "exp_avg_sq" in st and "exp_avg" not in st:  # saved by FrozenVarianceAdamW
            new.state[p] = {k: (int(v) if k == "step" else v) for k, v in st.items()}
    return new


def put(holder: Any, new: torch.optim.Optimizer) -> None:
    """Make ``holder`` (a wrapper that keeps its optimizer as ``.optimizer``) hold ``new``.
    Accelerate's wrapper under fp16 AMP also keeps the optimizer's bound ``step`` for its
    GradScaler: it is rebuilt for ``new``."""
    holder.optimizer = new
    if hasattr(holder, "_optimizer_original_step_method"):
        from accelerate.optimizer import patch_optimizer_step

        holder._optimizer_original_step_method = new.step
        holder._optimizer_patched_step_method = patch_optimizer_step(holder, new.step)
