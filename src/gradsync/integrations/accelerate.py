"""Hugging Face Accelerate: gradsync's DDP comm hook on the model ``accelerator.prepare`` wrapped.

Usage (``torchrun --nproc-per-node 2 train.py``)::

    from accelerate import Accelerator, DistributedDataParallelKwargs as DDPKwargs
    import gradsync

    accelerator = Accelerator(cpu=True, kwargs_handlers=[DDPKwargs(gradient_as_bucket_view=True)])
    model, optimizer = accelerator.prepare(model, optimizer)
    cfg = gradsync.Config(scheme="per_tensor", density=0.1)
    hook_state = gradsync.accelerate.register(accelerator, model, cfg)  # after prepare()
    for x, y in batches:
        optimizer.zero_grad()
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
    accelerator.save_state("ckpt")  # with each rank's gradsync state
    print(hook_state.stats()["total"]["bytes_sent"])  # this rank's gradsync traffic

and, to resume in a new process, the same set-up followed by ``accelerator.load_state("ckpt")``
(``tests/test_accelerate.py`` runs both as they stand, on 2 CPU ranks).

Accelerate has no comm-hook slot that it honours (``DistributedDataParallelKwargs(comm_hook=…)``
takes only its built-in hooks), so :func:`register` installs the hook on the
``DistributedDataParallel`` that ``prepare`` returned. ``save_state`` writes registered objects
on the main process only and ``load_state`` reads that one file on every process; the hook's
state is per rank, so the object :func:`register` hands to ``register_for_checkpointing``
gathers every rank's state into that file (:func:`gradsync.integrations.ranks.gather`) and
gives each rank its own entry back, refusing one from another world size, configuration or
model with a ``ValueError``.

AdamW: when an optimizer the accelerator prepared is torch's Adam/AdamW and the scheme
compresses, :func:`register` applies gradsync's frozen-variance recipe
(:mod:`gradsync.integrations.adamw`): it replaces the optimizer inside its
``AcceleratedOptimizer`` (the object the script holds) by a ``FrozenVarianceAdamW`` over the same
parameter groups, and the hook sends every gradient whole for ``adam_warmup`` steps. Accelerate
does not know the run's length, so ``adam_warmup`` must be given then (about 10 % of the
optimizer steps); without it ``register`` refuses with that fix.
"""

from __future__ import annotations

import os
from typing import Any

from torch import nn

from gradsync.engine.config import Config, require_config
from gradsync.integrations import adamw, ddp, ranks

__all__ = ["HookCheckpoint", "register"]


class HookCheckpoint:
    """What :func:`register` hands to ``accelerator.register_for_checkpointing``.

    ``state_dict()`` is a collective (``save_state`` calls it on every process, in the same
    order): it returns every rank's hook state on the process that writes the file (the main
    process, or each node's local main with ``save_on_each_node``) and a marker elsewhere.
    ``load_state_dict`` restores this rank's own entry onto the accelerator's device.
    """

    def __init__(self, state: ddp.HookState, accelerator: Any) -> None:
        self.state = state
        self.accelerator = accelerator

    def state_dict(self) -> dict[str, Any]:
        each_node = bool(getattr(self.accelerator.project_configuration, "save_on_each_node",
                                 False))
        gathered = ranks.gather(self.state, everywhere=each_node)
        return gathered if gathered is not None else {"format": "not written by this rank"}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        ranks.restore(self.state, saved, self.accelerator.device)


def register(accelerator: Any, model: nn.Module, cfg: Config,
             small_numel: int = ddp.SMALL_NUMEL, adam_warmup: int | None = None
             ) -> ddp.HookState:
    """Install gradsync's comm hook on ``model`` (``accelerator.prepare``'s result) and register
    its per-rank state for ``accelerator.save_state``/``load_state``; returns the hook's state
    (``stats()``).

    With ``mixed_precision="fp16"`` the hook follows the accelerator's GradScaler
    (:meth:`gradsync.ddp.HookState.follow`: error feedback stays in the units of each step's
    loss scale), which needs ``Config(nonfinite="skip_step")`` (``ValueError`` otherwise: the
    scaler, not the hook, handles the steps that overflow).

    With torch's Adam/AdamW among the prepared optimizers and a compressing scheme, the hook
    runs the frozen-variance recipe (module docstring): ``adam_warmup`` optimizer steps of exact
    AdamW with gradients sent whole, then the variance frozen; ``ValueError`` without
    ``adam_warmup``, or where the recipe cannot run (:func:`gradsync.integrations.adamw.refusal`).

    Raises ``TypeError`` when ``model`` is not wrapped in ``DistributedDataParallel``: Accelerate
    wraps it only when it runs several processes.
    """
    require_config(cfg, "gradsync.accelerate.register")
    if not isinstance(model, nn.parallel.DistributedDataParallel):
        procs = int(os.environ.get("WORLD_SIZE", "1"))
        hint = (f"{procs} processes were launched but Accelerate runs each on its own "
                f"(distributed type {accelerator.distributed_type}): on CPU create "
                f"Accelerator(cpu=True)" if procs > 1 else
                "launch the script with several processes, e.g. "
                "`torchrun --nproc-per-node 2 train.py`")
        raise TypeError(
            f"gradsync.accelerate.register needs the DistributedDataParallel model that "
            f"accelerator.prepare() returns when several processes run; got "
            f"{type(model).__name__}: {hint}, and pass prepare()'s result")
    found = [f for f in map(adamw.adam_in, getattr(accelerator, "_optimizers", [])) if f]
    recipe = cfg
    if found:
        recipe = _recipe(cfg, found, adam_warmup)
    state = ddp.register(model, recipe, small_numel)
    if recipe is not cfg:
        for holder, adam in found:
            adamw.put(holder, adamw.frozen_variance(adam, recipe.density_warmup_steps, state))
    scaler = getattr(accelerator, "scaler", None)  # mixed_precision="fp16"'s GradScaler
    if scaler is not None:
        state.follow(scaler)
    if len(getattr(accelerator, "_optimizers", [])) == 1:  # a schedule's rates (Units)
        state.follow(accelerator._optimizers[0])
    accelerator.register_for_checkpointing(HookCheckpoint(state, accelerator))
    return state


def _recipe(cfg: Config, found: list[tuple[Any, Any]], adam_warmup: int | None) -> Config:
    """The hook's configuration under the frozen-variance recipe (module docstring), or
    ``ValueError`` with the fix."""
    fix = ("Pass gradsync.accelerate.register(accelerator, model, cfg, adam_warmup=N), N about "
           "10 % of your optimizer steps, or wire gradsync.optim.FrozenVarianceAdamW yourself "
           "(docs/usage.md, 'With AdamW').")
    where = "gradsync.accelerate.register"
    for _, adam in found:
        why = adamw.refusal(cfg, adam, where, fix)
        if why is not None:
            raise ValueError(why)
    recipe = adamw.recipe_config(cfg, found[0][1], adam_warmup or 1)
    if recipe is cfg:  # nothing compressed: AdamW runs as it is
        return cfg
    if len(found) > 1 or adam_warmup is None or isinstance(adam_warmup, bool) or adam_warmup < 1:
        raise ValueError(
            f"{where}: the optimizer is torch's {type(found[0][1]).__name__}, which runs far "
            f"behind under compressed gradients unless gradsync applies its frozen-variance "
            f"recipe, and "
            + ("there are several Adam optimizers (the recipe takes one)" if len(found) > 1
               else f"it needs the warm-up length (adam_warmup, got {adam_warmup!r})")
            + f". {fix}")
    return recipe
