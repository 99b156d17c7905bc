"""Hugging Face ``Trainer``: gradsync's DDP comm hook on the model ``Trainer`` wraps itself.

Usage (``torchrun --nproc-per-node 2 train.py``; ``args`` a ``TrainingArguments``)::

    from transformers import Trainer
    import gradsync

    cfg = gradsync.Config(scheme="per_tensor", density=0.1)
    callback = gradsync.transformers.GradSyncCallback(cfg)
    trainer = Trainer(model=model, args=args, train_dataset=dataset, callbacks=[callback])
    trainer.train()  # torchrun --nproc-per-node 2 train.py; checkpoints keep each rank's state
    print(callback.stats()["total"]["bytes_sent"])  # this rank's gradsync traffic

and, to resume, the same set-up with ``trainer.train(resume_from_checkpoint="out/checkpoint-8")``
(or ``resume_from_checkpoint=True``: the last checkpoint in ``args.output_dir``).
``tests/test_transformers.py`` runs the snippet as it stands, then resumes its first checkpoint
with a new Trainer, on 2 CPU ranks.

Why a callback: ``Trainer`` creates its Accelerator and wraps the model in
``DistributedDataParallel`` inside ``train()``, so before ``train()`` there is no DDP model to
give :func:`gradsync.ddp.register`, and Trainer has no comm-hook setting (its
``ddp_*`` arguments do not take one). A ``TrainerCallback`` is what Trainer runs inside
``train()``: ``on_train_begin`` is the first event after the wrapping (and after a resumed
checkpoint's weights, optimizer and scheduler are loaded) and before the first backward.
Callbacks are handed the unwrapped model only, not the Trainer, and not the checkpoint being
resumed; the callback reads both from the ``Trainer.train`` call that is running it (its
``self`` and its ``resume_from_checkpoint`` argument, already resolved from ``True`` to a path),
then installs the hook on ``trainer.model_wrapped``, the DDP model. With fp16 AMP the hook
follows the accelerator's GradScaler (:meth:`gradsync.ddp.HookState.follow`), which needs
``Config(nonfinite="skip_step")`` (``ValueError`` otherwise).

Without DDP: one process (``python train.py`` on a CPU or one GPU) exchanges no gradients, so
there is nothing to compress. The callback then warns once per ``train()`` and does nothing:
gradients are not sparsified, ``stats()`` counts no traffic, checkpoints get no gradsync files.
Anything else that is not DDP is refused with ``RuntimeError`` when ``train()`` begins:
``torch.nn.DataParallel`` (one process driving several GPUs: launch one process per GPU with
``torchrun``), and FSDP or DeepSpeed, which reduce gradients their own way.

Checkpoints: Trainer writes the model, optimizer and scheduler on the main process and an RNG
file per process (``rng_state_{r}.pth``). The hook's state (residuals, sparsifier generators)
differs from rank to rank, so at every checkpoint (``on_save``: ``save_steps``,
``save_strategy``) each rank writes its own :meth:`gradsync.ddp.HookState.state_dict` beside
them, ``checkpoint-N/gradsync_rank{r}.pt`` (no collective; written to a temporary name and
renamed, so a crash leaves no truncated file; Trainer's ``save_total_limit`` deletes it with its
folder). Resuming, each rank reads its own file and :meth:`~gradsync.ddp.HookState.load_state_dict`
checks it (rank, world size, configuration, model); a checkpoint from another world size or
configuration, one without gradsync files, or one where a rank's file is missing is refused with
a ``ValueError``. The ranks compare their verdicts first (one small all-gather), so every rank
raises before training starts and none is left waiting in a collective. A one-process run
refuses a checkpoint that holds gradsync state (its residuals belong to several ranks).
"""

from __future__ import annotations

import glob
import inspect
import os
import sys
import warnings
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from gradsync.collectives.comm import exchange_objects
from gradsync.engine.config import Config, require_config
from gradsync.engine.state import check_identity
from gradsync.integrations import adamw, ddp

__all__ = ["STATE_FILE", "GradSyncCallback"]

STATE_FILE = "gradsync_rank{rank}.pt"  # in each checkpoint-N folder, one per rank


def _calling(method: Any) -> dict[str, Any] | None:
    """The local variables of the running call of the ``Trainer`` method ``method`` that is
    calling back (``None``: there is none)."""
    code = inspect.unwrap(method).__code__
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code is code:
            return frame.f_locals
        frame = frame.f_back
    return None


def _running_train() -> tuple[Trainer, str | None, Any]:
    """The ``Trainer`` whose ``train()`` is calling back, the checkpoint it resumes (``None``:
    none) and its hyperparameter-search ``trial``: that call's ``self``,
    ``resume_from_checkpoint`` and ``trial`` (``train()`` has resolved ``True`` to a path before
    any callback runs)."""
    local = _calling(Trainer.train)
    if local is not None:
        resume = local.get("resume_from_checkpoint")
        resume = None if resume is None or resume is False else os.fspath(resume)
        return local["self"], resume, local.get("trial")
    raise RuntimeError("GradSyncCallback runs inside transformers.Trainer.train(): pass it in "
                       "Trainer(..., callbacks=[callback]) and call trainer.train() (it found no "
                       "Trainer.train call running it)")


def _on(entry: dict[str, Any], device: torch.device | str) -> dict[str, Any]:
    """``entry`` with its residuals and velocities on ``device`` (the sparsifiers' generator
    states stay on the CPU)."""
    fb = dict(entry["feedback"])
    for k in ("residual", "velocity"):
        if k in fb:
            fb[k] = {n: t.to(device) for n, t in fb[k].items()}
    return {**entry, "feedback": fb}


class GradSyncCallback(TrainerCallback):
    """A ``TrainerCallback`` that synchronizes Trainer's gradients through gradsync's DDP hook.

    Args:
        cfg: the hook's :class:`gradsync.Config` (schemes ``dense``, ``per_tensor``,
            ``ssfusion``, ``ssfusion_oi``, ``auto``).
        small_numel: SSFusion's size threshold (see :func:`gradsync.ddp.hook`).

    ``hook_state`` is the hook's :class:`gradsync.ddp.HookState` once ``train()`` has begun.
    """

    def __init__(self, cfg: Config, small_numel: int = ddp.SMALL_NUMEL) -> None:
        require_config(cfg, "gradsync.transformers.GradSyncCallback")
        if cfg.scheme not in ddp.DDP_SCHEMES:
            raise ValueError(f"GradSyncCallback runs the DDP hook, which supports schemes "
                             f"{ddp.DDP_SCHEMES}; got {cfg.scheme!r}")
        ddp.HookState(cfg=cfg, small_numel=small_numel)  # its checks (plan, small_numel) now
        self.cfg = cfg
        self.small_numel = small_numel
        self.hook_state: ddp.HookState | None = None
        self._ddp: nn.parallel.DistributedDataParallel | None = None  # where the hook is
        self._trainer: Trainer | None = None
        self._trial: Any = None
        self._clip: float | None = None  # Trainer's max_grad_norm, while the recipe clips

    # -- Trainer events -------------------------------------------------------------------
    def on_init_end(self, args: TrainingArguments, state: TrainerState,
                    control: TrainerControl, **kwargs: Any) -> None:
        """Have the Trainer's Accelerator build DDP with ``gradient_as_bucket_view=True``,
        which Trainer's ``ddp_*`` arguments do not offer: each ``.grad`` then lives in its DDP
        bucket, which the hook writes in place, so DDP copies nothing back into ``.grad`` and
        keeps no second copy of the gradients (the hook computes the same bits either way:
        docs/results/speed.md, "Gradients as DDP's bucket views")."""
        local = _calling(Trainer.__init__)
        trainer = None if local is None else local.get("self")
        handler = getattr(getattr(trainer, "accelerator", None), "ddp_handler", None)
        if hasattr(handler, "gradient_as_bucket_view"):
            handler.gradient_as_bucket_view = True

    def on_train_begin(self, args: TrainingArguments, state: TrainerState,
                       control: TrainerControl, **kwargs: Any) -> None:
        """Install the hook on the DDP model (once per DDP model: a second ``train()`` of the
        same Trainer keeps the hook and its residuals) and, when resuming, restore this rank's
        state from the checkpoint."""
        trainer, resume, self._trial = _running_train()
        self._trainer = trainer
        wrapped = trainer.model_wrapped
        if isinstance(wrapped, nn.parallel.DistributedDataParallel):
            found = adamw.adam_in(trainer.optimizer)
            if wrapped is not self._ddp:
                cfg = self._recipe(found, args, state)
                self.hook_state = ddp.register(wrapped, cfg, self.small_numel)
                self._ddp = wrapped
                scaler = getattr(trainer.accelerator, "scaler", None)  # fp16 AMP's GradScaler
                if scaler is not None:
                    self.hook_state.follow(scaler)
            self._adopt(found, args)
            self.hook_state.follow(trainer.optimizer)  # the scheduler's rates (Units)
        else:
            self._refuse_or_idle(wrapped, args)
            if self._ddp is not None or self.hook_state is None:
                self.hook_state = ddp.hook(self.cfg, trainer.model, small_numel=self.small_numel)[0]
                self._ddp = None
        if resume is not None:
            self._restore(resume, args.device)

    def on_train_end(self, args: TrainingArguments, state: TrainerState,
                     control: TrainerControl, **kwargs: Any) -> None:
        """Give Trainer back its ``max_grad_norm`` (the recipe clipped in its place)."""
        if self._clip is not None:
            args.max_grad_norm, self._clip = self._clip, None

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                **kwargs: Any) -> None:
        """Write this rank's hook state into the checkpoint folder Trainer has just written
        (``checkpoint-{global_step}`` in the run's output folder: ``args.output_dir``, or a
        hyperparameter-search trial's folder inside it, which ``Trainer._get_output_dir``
        names)."""
        if self._ddp is None or self.hook_state is None or self._trainer is None:
            return  # one process without DDP: nothing to keep
        run_dir = self._trainer._get_output_dir(trial=self._trial)
        folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        os.makedirs(folder, exist_ok=True)  # another node's copy, or save_only_model
        path = os.path.join(folder, STATE_FILE.format(rank=self.hook_state.identity().rank))
        torch.save(self.hook_state.state_dict(), path + ".tmp")
        os.replace(path + ".tmp", path)

    # -- public ---------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """This rank's hook statistics (:meth:`gradsync.ddp.HookState.stats`): ``last`` and
        ``total`` traffic (``bytes_sent``, ``bytes_recv``, ``messages``, ``seconds``), ``calls``
        and ``missing_rate``. Raises ``RuntimeError`` before ``trainer.train()`` has begun."""
        if self.hook_state is None:
            raise RuntimeError("no gradsync hook yet: stats() is available once trainer.train() "
                               "has begun (Trainer wraps the model in DDP there)")
        return self.hook_state.stats()

    # -- internals ------------------------------------------------------------------------
    def _recipe(self, found: tuple[Any, torch.optim.Adam] | None, args: TrainingArguments,
                state: TrainerState) -> Config:
        """The hook's configuration: AdamW's recipe (:mod:`gradsync.integrations.adamw`) when
        Trainer's optimizer is torch's Adam/AdamW and the scheme compresses, with Trainer's
        ``max_grad_norm`` as the hook's local clipping; the given one otherwise."""
        if found is None:
            return self.cfg
        adam = found[1]
        why = adamw.refusal(self.cfg, adam, "GradSyncCallback",
                            "Pass Trainer(optimizers=(gradsync.optim.FrozenVarianceAdamW(...), "
                            "None)) with Config(momentum=beta1) yourself (docs/usage.md, "
                            "'With AdamW'), or train with Config(scheme='dense').")
        if why is not None:
            raise ValueError(why)
        cfg = adamw.recipe_config(self.cfg, adam, adamw.freeze_step_for(state.max_steps))
        if cfg is not self.cfg and args.max_grad_norm and self.cfg.clip_norm is None:
            cfg = replace(cfg, clip_norm=float(args.max_grad_norm))
        return cfg

    def _adopt(self, found: tuple[Any, torch.optim.Adam] | None, args: TrainingArguments
               ) -> None:
        """Put ``FrozenVarianceAdamW`` where Trainer's Adam/AdamW is, once the hook runs the
        recipe, and take Trainer's clipping out of the way: ``.grad`` holds the averaged
        (preconditioned) momentum then, whose norm is not the gradient's."""
        assert self.hook_state is not None
        cfg = self.hook_state.cfg
        if found is None or cfg is self.cfg or cfg.momentum == 0.0:
            return
        holder, adam = found
        new = adamw.frozen_variance(adam, cfg.density_warmup_steps, self.hook_state)
        if holder is None:  # Trainer's optimizer itself (Accelerate wraps it in train())
            self._trainer.optimizer = new
        else:
            adamw.put(holder, new)
        if args.max_grad_norm:
            self._clip, args.max_grad_norm = args.max_grad_norm, 0.0
    def _refuse_or_idle(self, wrapped: nn.Module, args: TrainingArguments) -> None:
        """The model is not DDP: warn when one process trains alone, refuse anything else."""
        if isinstance(wrapped, nn.DataParallel):
            raise RuntimeError(
                f"GradSyncCallback: Trainer wrapped the model in torch.nn.DataParallel (one "
                f"process driving {args.n_gpu} GPUs), which has no comm hook: launch one process "
                f"per GPU, e.g. `torchrun --nproc-per-node {args.n_gpu} train.py`")
        procs = max(args.world_size, int(os.environ.get("WORLD_SIZE", "1")))
        if procs > 1:
            raise RuntimeError(
                f"GradSyncCallback installs a DDP comm hook, but Trainer runs {procs} processes "
                f"with the model in {type(wrapped).__name__}, not DistributedDataParallel (FSDP "
                f"and DeepSpeed reduce gradients their own way): train with plain DDP, without "
                f"fsdp/deepspeed in TrainingArguments")
        warnings.warn("GradSyncCallback: Trainer runs one process and did not wrap the model in "
                      "DistributedDataParallel, so no gradients are exchanged and the callback "
                      "does nothing (gradients are not sparsified); launch several processes, "
                      "e.g. `torchrun --nproc-per-node 2 train.py`, to synchronize them through "
                      "gradsync", stacklevel=2)

    def _read(self, folder: str) -> dict[str, Any] | None:
        """This rank's saved state in ``folder``; ``None`` when it holds no gradsync file;
        ``ValueError`` when it holds another world size's files or lacks this rank's."""
        assert self.hook_state is not None
        me = self.hook_state.identity()
        mine = os.path.join(folder, STATE_FILE.format(rank=me.rank))
        if os.path.isfile(mine):
            return torch.load(mine, map_location="cpu", weights_only=True)
        files = sorted(glob.glob(os.path.join(folder, STATE_FILE.format(rank="*"))))
        if not files:
            return None
        saved = torch.load(files[0], map_location="cpu", weights_only=True)
        if not isinstance(saved, dict) or saved.get("world_size") != me.world_size:
            check_identity(saved, me, "the checkpoint's gradsync")  # names the world sizes
        raise ValueError(f"{folder!r} holds gradsync state for {len(files)} of "
                         f"{me.world_size} ranks, not for rank {me.rank} ({mine}): the save did "
                         f"not finish on every rank; resume from an earlier checkpoint")

    def _restore(self, folder: str, device: torch.device | str) -> None:
        """Load this rank's state from checkpoint ``folder`` once every rank found its own
        acceptable; otherwise raise on every rank."""
        state = self.hook_state
        assert state is not None
        me = state.identity()
        saved, error = None, None
        try:
            saved = self._read(folder)
            if saved is None and self._ddp is not None:
                raise ValueError(
                    f"the checkpoint {folder!r} has no gradsync state "
                    f"({STATE_FILE.format(rank='*')}): it was not saved with GradSyncCallback, "
                    f"so the ranks' residuals are lost; resume from a GradSyncCallback "
                    f"checkpoint (or load only the weights, from_pretrained({folder!r}), and "
                    f"train without resume_from_checkpoint)")
            if saved is not None:
                state.check_compatible(saved)
        except Exception as e:  # every rank learns of it before anyone trains
            error = e
        mine = None if error is None else f"{type(error).__name__}: {error}"
        verdicts = ([mine] if self._ddp is None or me.world_size == 1
                    else exchange_objects(mine, me.group))
        assert verdicts is not None
        if error is not None:
            raise error
        others = [(r, v) for r, v in enumerate(verdicts) if v is not None]
        if others:
            r, v = others[0]
            raise ValueError(f"rank {r} refused the checkpoint's gradsync state in {folder!r}: {v}")
        if saved is not None:
            state.load_state_dict(_on(saved, device))
