"""PyTorch Lightning: a DDP strategy that synchronizes gradients through gradsync's comm hook.

Usage (``torchrun --nproc-per-node 2 train.py``, or let Lightning start the processes)::

    import pytorch_lightning as pl
    import gradsync

    cfg = gradsync.Config(scheme="per_tensor", density=0.1)
    strategy = gradsync.lightning.GradSyncStrategy(cfg)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=2)
    trainer.fit(module, loader)  # torchrun --nproc-per-node 2 train.py
    print(strategy.stats()["total"]["bytes_sent"])  # this rank's gradsync traffic
    trainer.save_checkpoint("last.ckpt")  # every rank's gradsync state, each its own

(``tests/test_lightning.py`` runs this snippet as it stands, on 2 CPU ranks.)

Why a strategy and not ``DDPStrategy(ddp_comm_hook=…)``: Lightning registers comm hooks on CUDA
devices only, so on CPU the hook is silently dropped. :class:`GradSyncStrategy` wraps the model
in DDP as :class:`~pytorch_lightning.strategies.DDPStrategy` does and then installs
:func:`gradsync.ddp.register`'s hook itself, whatever the device.

fp16 AMP (``precision="16-mixed"``): the hook follows the precision plugin's GradScaler
(:meth:`gradsync.ddp.HookState.follow`), so error feedback stays in the units of each step's
loss scale; give the strategy ``Config(nonfinite="skip_step")`` so that the scaler, not the
hook, handles overflowing steps (the default ``"raise"`` is refused when ``fit`` starts).

Checkpoints: Lightning writes its checkpoint file on rank 0 only and every rank reads it back.
The hook's state (residuals, sparsifier generators) differs from rank to rank, so
:meth:`GradSyncStrategy.save_checkpoint` gathers every rank's state to rank 0 and stores it
under the key ``"gradsync"`` (:func:`gradsync.integrations.ranks.gather`); resuming
(``trainer.fit(…, ckpt_path=…)``) gives each rank its own entry, and a checkpoint from another
world size, configuration or model, or one without gradsync state, is refused with a
``ValueError`` on every rank before training starts.

AdamW: when ``configure_optimizers`` returns torch's Adam/AdamW and the scheme compresses, the
strategy applies gradsync's frozen-variance recipe (:mod:`gradsync.integrations.adamw`): the hook
sends every gradient whole for the first 10 % of ``trainer.estimated_stepping_batches`` (at
least 10 steps), and the
optimizer is replaced, for the strategy and its schedulers, by a ``FrozenVarianceAdamW`` over the
same parameter groups; where the recipe cannot run, ``fit`` refuses with the fix.
"""

from __future__ import annotations

import math
from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.strategies import DDPStrategy

from gradsync.engine.config import Config
from gradsync.integrations import adamw, ddp, ranks

__all__ = ["CHECKPOINT_KEY", "GradSyncStrategy"]

CHECKPOINT_KEY = "gradsync"
_MISSING = object()


class GradSyncStrategy(DDPStrategy):
    """``DDPStrategy`` whose gradients travel through gradsync's DDP comm hook.

    Args:
        config: the hook's :class:`gradsync.Config` (schemes ``dense``, ``per_tensor``,
            ``ssfusion``, ``ssfusion_oi``).
        small_numel: SSFusion's size threshold (see :func:`gradsync.ddp.hook`).
        **ddp_kwargs: everything ``DDPStrategy`` takes (``find_unused_parameters``,
            ``process_group_backend``, ``start_method``, …) except the comm-hook arguments,
            which this strategy fills itself. ``gradient_as_bucket_view`` defaults to ``True``
            here (torch's default is ``False``): each ``.grad`` then lives in its DDP bucket,
            which the hook writes in place, so DDP copies nothing back into ``.grad`` and keeps
            no second copy of the gradients; the hook computes the same bits either way
            (``tests/test_ddp.py``; docs/results/speed.md, "Gradients as DDP's bucket views").
    """

    def __init__(self, config: Config, small_numel: int = ddp.SMALL_NUMEL,
                 **ddp_kwargs: Any) -> None:
        taken = sorted({"ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper",
                        "model_averaging_period"} & set(ddp_kwargs))
        if taken:
            raise TypeError(f"GradSyncStrategy installs gradsync's comm hook itself; do not pass "
                            f"{taken}")
        if not isinstance(config, Config):
            raise TypeError(f"config must be a gradsync.Config, got {type(config).__name__}")
        if config.scheme not in ddp.DDP_SCHEMES:
            raise ValueError(f"GradSyncStrategy runs the DDP hook, which supports schemes "
                             f"{ddp.DDP_SCHEMES}; got {config.scheme!r}")
        super().__init__(**{"gradient_as_bucket_view": True, **ddp_kwargs})
        self.config = config
        self.small_numel = small_numel
        self.hook_state: ddp.HookState | None = None
        self._resume: Any = None  # the checkpoint's gradsync entry, until the hook exists
        self._previous: Any = _MISSING  # the last fit's hook, until setup_optimizers

    def configure_ddp(self) -> None:
        """Wrap the module in DDP (as ``DDPStrategy`` does) and install gradsync's hook on any
        device; :meth:`setup_optimizers`, which ``DDPStrategy.setup`` calls next, fits it to the
        optimizer and restores each rank's state."""
        assert isinstance(self.model, pl.LightningModule)
        self.model = self._setup_model(self.model)
        self._previous = self.hook_state
        self.hook_state = ddp.register(self.model, self.config, self.small_numel)
        scaler = getattr(self.precision_plugin, "scaler", None)  # fp16 AMP's GradScaler
        if scaler is not None:
            self.hook_state.follow(scaler)

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """Create the optimizers (as Lightning does), apply the AdamW recipe (module docstring)
        and restore each rank's hook state when resuming (from the checkpoint, or from the
        previous ``fit`` of this strategy when the model is the same)."""
        super().setup_optimizers(trainer)
        if self._previous is _MISSING or self.hook_state is None:
            return  # not fitting: no hook this time
        previous, self._previous = self._previous, _MISSING
        found = [(i, f) for i, f in enumerate(map(adamw.adam_in, self.optimizers)) if f]
        if found:
            self._adopt(found, trainer)
        if len(self.optimizers) == 1:  # its schedule's rate changes keep the residual's debt
            self.hook_state.follow(self.optimizers[0])
        self._restore(previous)

    def _adopt(self, found: list[tuple[int, tuple[Any, Any]]], trainer: pl.Trainer) -> None:
        """The AdamW recipe for the hook and the optimizers, or ``ValueError`` with the fix."""
        assert self.hook_state is not None
        fix = ("Return gradsync.optim.FrozenVarianceAdamW(..., sync=strategy.hook_state) from "
               "configure_optimizers with Config(momentum=beta1) yourself (docs/usage.md, "
               "'With AdamW'), or train with Config(scheme='dense').")
        for _, (_, adam) in found:
            why = adamw.refusal(self.config, adam, "GradSyncStrategy", fix)
            if why is not None:
                raise ValueError(why)
        if len(found) > 1:
            raise ValueError(f"GradSyncStrategy: configure_optimizers returned {len(found)} "
                             f"Adam optimizers; the AdamW recipe takes one. {fix}")
        i, (holder, adam) = found[0]
        total = trainer.estimated_stepping_batches  # inf: max_epochs=-1 without max_steps
        freeze = (adamw.freeze_step_for(int(total)) if math.isfinite(total)
                  else adamw.MIN_WARMUP)
        cfg = adamw.recipe_config(self.config, adam, freeze)
        if cfg is self.config:
            return
        self.hook_state.reconfigure(cfg)
        new = adamw.frozen_variance(adam, cfg.density_warmup_steps, self.hook_state)
        if holder is None:
            self.optimizers[i] = new
        else:
            adamw.put(holder, new)
        for sc in self.lr_scheduler_configs:
            if getattr(sc.scheduler, "optimizer", None) is adam:
                sc.scheduler.optimizer = new

    def _restore(self, previous: ddp.HookState | None) -> None:
        assert self.hook_state is not None
        resume, self._resume = self._resume, None
        if resume is None and previous is not None:  # another fit() of the same Trainer
            carried = previous.state_dict()
            try:
                self.hook_state.check_compatible(carried)
            except ValueError:  # another model: its residuals do not apply
                carried = None
            if carried is not None:
                self.hook_state.load_state_dict(carried)
        if resume is _MISSING:
            raise ValueError(f"the checkpoint has no {CHECKPOINT_KEY!r} entry: it was not saved "
                             f"with GradSyncStrategy, so the ranks' residuals are lost; resume "
                             f"from a GradSyncStrategy checkpoint (or load only the weights)")
        if resume is not None:
            ranks.restore(self.hook_state, resume, self.root_device)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Any | None = None) -> None:
        """Add every rank's hook state (gathered to rank 0) and write as Lightning does.

        A collective: call ``Trainer.save_checkpoint`` on every rank, as Lightning requires
        (``ModelCheckpoint`` does), never under ``if trainer.is_global_zero``."""
        if self.hook_state is not None:
            gathered = ranks.gather(self.hook_state)
            if gathered is not None:
                checkpoint[CHECKPOINT_KEY] = gathered
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_checkpoint(self, checkpoint_path: Any,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Read the checkpoint as Lightning does and keep its gradsync entry for
        :meth:`configure_ddp` (the hook does not exist yet when Lightning reads it)."""
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._resume = checkpoint.get(CHECKPOINT_KEY, _MISSING)
        return checkpoint

    def stats(self) -> dict[str, Any]:
        """This rank's hook statistics (:meth:`gradsync.ddp.HookState.stats`): ``last`` and
        ``total`` traffic (``bytes_sent``, ``bytes_recv``, ``messages``, ``seconds``), ``calls``
        and ``missing_rate``. Raises ``RuntimeError`` before ``fit`` has wrapped the model."""
        if self.hook_state is None:
            raise RuntimeError("no gradsync hook yet: stats() is available once Trainer.fit has "
                               "set the strategy up")
        return self.hook_state.stats()

    def teardown(self) -> None:
        self._resume = None
        super().teardown()
