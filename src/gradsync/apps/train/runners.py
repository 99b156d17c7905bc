"""How each scheme synchronizes one step's gradients: the three runners and the optimizer.

* :class:`EngineRunner`: every engine scheme through :class:`gradsync.GradSync` (hooks on the
  model; ``synchronize()`` after ``loss.backward()``); its step breakdown is
  ``GradSync.stats()["last"]``.
* :class:`DDPHookRunner`: ``ddp_gradsync_<s>``, torch DDP with gradsync's comm hook
  (:func:`gradsync.ddp.hook`, installed as ``register`` installs it, through
  :func:`~gradsync.apps.train.metering.metered_hook`): its times are metered as torch's hooks'
  are, its bytes and missing rate are the hook's own counts.
* :class:`TorchDDPRunner`: torch's own DDP as peers: ``ddp`` (torch's ``allreduce_hook``, the
  same all-reduce as DDP's built-in one, but through Python so its bytes are counted),
  ``ddp_powersgd`` (``powerSGD_hook``, rank 1, error feedback, compression from step 2; made
  blocking per bucket, so its overlap is understated), ``ddp_fp16`` (``fp16_compress_hook``);
  metered by :mod:`gradsync.apps.train.metering`.
* :class:`LocalRunner`, :class:`MeetRunner`: no gradient exchanged (``bench anatomy``'s
  floors): each rank trains alone, and under the second the ranks meet once a step.

DDP runs with ``broadcast_buffers=False`` (the engine does not synchronize buffers either).

Momentum (DGC §3.2): with sparse updates SGD's momentum moves into error feedback (momentum
correction; the velocity of sent entries carries on, ``Config.momentum_masking=False``) and
the optimizer itself runs
without momentum; otherwise the momentum of entries that are sent late is applied to stale
values and the loss spikes. Tensors sent whole keep ordinary momentum inside error feedback
(``gradsync.feedback``), so at density 1 this is exactly SGD with momentum. Dense schemes,
and torch's hooks keep the optimizer's own state. AdamW with a sparse scheme moves its first
moment into error feedback the same way and runs :class:`gradsync.optim.FrozenVarianceAdamW`:
exact AdamW while the gradients are sent whole (``TrainSpec.adam_freeze_step`` steps, the
engine's ``density_warmup`` starts with them), then the variance frozen (1-bit Adam's recipe)
and handed to error feedback as preconditioning scales, so the selection ranks entries by what
they move (``Runner.preconditioner``; :mod:`gradsync.optim`). Error feedback keeps the velocity
of the entries it sends (``Config.momentum_masking=False``, the default), with SGD and AdamW.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradsync.apps.train.metering import (
    Meter,
    MeteredHookState,
    counting_all_reduce,
    metered_hook,
)
from gradsync.apps.train.shares import TopkShares
from gradsync.apps.train.spec import SchemeChoice, TrainSpec
from gradsync.collectives.comm import Comm, CommStats

__all__ = ["MOMENTUM", "DDPHookRunner", "EngineRunner", "LocalRunner", "MeetRunner", "Runner",
           "TorchDDPRunner",
           "collective_timeout", "make_optimizer", "make_runner", "momentum_correction", "wrap_ddp"]

MOMENTUM = 0.9
NAN = float("nan")


def momentum_correction(choice: SchemeChoice, adamw: bool, density: float) -> bool:
    """Whether the optimizer's momentum (SGD's, AdamW's first moment) moves into error feedback
    (DGC §3.2, module docstring): for every sparse scheme, except AdamW at density 1.

    At density 1 nothing is compressed. SGD's momentum in error feedback is then SGD with
    momentum to float tolerance (issue 11, cause 1; ``tests/test_parity.py``), but AdamW's is
    :class:`~gradsync.optim.FrozenVarianceAdamW`, whose variance freezes after 10 % of the steps:
    measured on TinyGPT (P = 4, 60 steps, 3 seeds) TopkA at density 1 reached perplexity
    17.40 ± 0.55 against DDP's 17.03 ± 0.43. So AdamW at density 1 runs as torch's AdamW on the
    averaged gradient, as DDP does."""
    return choice.sparse and not (adamw and density >= 1)


def collective_timeout(timeout: float) -> float:
    """The engine's collective timeout (``Config.timeout_s``) for ``TrainSpec.timeout``: the
    timeout itself, or, on a rank watched by ``run_distributed``'s progress watchdog, a
    multiple of it (:data:`gradsync.testing.distributed.COLLECTIVE_TIMEOUT_FACTOR`), so that a
    stalled peer is reported by the watchdog, which names it, rather than by a waiting rank's
    collective timing out first."""
    from gradsync.testing.distributed import COLLECTIVE_TIMEOUT_FACTOR, progress_limit

    return timeout if progress_limit() is None else COLLECTIVE_TIMEOUT_FACTOR * timeout


def make_optimizer(model: nn.Module, adamw: bool, lr: float,
                   momentum_correction: bool = False,
                   freeze_step: int | None = None, sync: Any = None) -> torch.optim.Optimizer:
    """AdamW (weight decay 0.01; under momentum correction
    :class:`~gradsync.optim.FrozenVarianceAdamW` with β1 = 0.9, its variance frozen after
    ``freeze_step`` steps and handed to ``sync``'s error feedback as preconditioning scales)
    or SGD with momentum 0.9 (0 under momentum correction)."""
    if adamw and momentum_correction:
        from gradsync.optim import FrozenVarianceAdamW

        if freeze_step is None:
            raise ValueError("AdamW under momentum correction needs freeze_step")
        return FrozenVarianceAdamW(model.parameters(), lr=lr, betas=(MOMENTUM, 0.999),
                                   weight_decay=0.01, freeze_step=freeze_step, sync=sync)
    if adamw:
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    return torch.optim.SGD(model.parameters(), lr=lr,
                           momentum=0.0 if momentum_correction else MOMENTUM)


def make_lr_schedule(opt: torch.optim.Optimizer, schedule: str | None, steps: int
                     ) -> torch.optim.lr_scheduler.LRScheduler | None:
    """``TrainSpec.lr_schedule`` for a run of ``steps`` optimizer steps: ``"cosine"`` anneals
    every group's learning rate to 0 at the last step; ``None``: constant (no scheduler)."""
    if schedule is None:
        return None
    return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)


class Runner:
    """One scheme on one rank. The loop calls, per step: the forward through :attr:`net`,
    :meth:`before_backward`, ``loss.backward()``, :meth:`after_backward`, the optimizer step,
    then :meth:`step_metrics`; :meth:`metering` is entered around all steps and :meth:`close`
    is called once at the end."""

    def __init__(self, choice: SchemeChoice, model: nn.Module, spec: TrainSpec,
                 steps: int | None = None) -> None:
        self.choice = choice
        self.net: nn.Module = model  # what the forward pass calls
        self.momentum_correction = momentum_correction(choice, spec.adamw, spec.density)
        self.steps = spec.steps if steps is None else steps  # of this run
        # what FrozenVarianceAdamW hands its scales at the freeze (gradsync.optim): the
        # engine or the DDP hook's state; None for torch's own hooks
        self.preconditioner: Any = None

    def gradsync_config(self, spec: TrainSpec, **extra):
        """The gradsync ``Config`` of this scheme under ``spec``."""
        from gradsync.engine.config import Config

        if self.choice.scheme is None:
            raise ValueError(f"{self.choice.name!r} is not a gradsync scheme")
        warm, period = spec.engine_warmup(self.steps or 1, self.momentum_correction)
        # the profiling steps: the engine's cost model and, through either door, the steps
        # whose gradients Config.budget weighs
        extra.setdefault("warmup_steps", spec.warmup_steps)
        if spec.amp == "fp16":  # a GradScaler skips overflowing steps: so must gradsync
            extra.setdefault("nonfinite", "skip_step")
        if spec.min_k is not None:
            extra.setdefault("min_k", spec.min_k)
        if spec.momentum_masking is not None:
            extra.setdefault("momentum_masking", spec.momentum_masking)
        if spec.momentum_ahead is not None:
            extra.setdefault("momentum_ahead", spec.momentum_ahead)
        if spec.density_schedule is not None:
            extra.setdefault("density_schedule", spec.density_schedule)
        if spec.budget is not None:
            extra.setdefault("budget", spec.budget)
        return Config(scheme=self.choice.scheme.name, density=spec.density,
                      sparsifier=spec.sparsifier, seed=spec.seed,
                      momentum=MOMENTUM if self.momentum_correction else 0.0,
                      density_warmup=warm, density_warmup_steps=period,
                      clip_norm=spec.clip_norm, **extra)

    def metering(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def follow(self, what: Any) -> None:
        """The optimizer (its learning rate) and an fp16 run's loss scaler
        (``TrainSpec.amp``): gradsync's error feedback follows them
        (``GradSync.follow``); torch's own hooks need nothing."""

    def plan(self) -> dict[str, Any] | None:
        """The plan the run ended with (``Plan.to_dict()``); ``None`` outside the engine."""
        return None

    def topk_shares(self) -> dict[str, Any] | None:
        """``TrainSpec.topk_shares``'s record (:class:`~gradsync.apps.train.shares.TopkShares`)
        on rank 0 of an engine scheme; ``None`` otherwise."""
        return None

    def before_backward(self) -> None:
        pass

    def after_backward(self) -> None:
        pass

    def step_metrics(self, backward_start: float, backward_end: float) -> dict[str, float]:
        """bytes_sent, bytes_recv, backward_s, sparsify_s, comm_s, wait_s, missing_rate."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class EngineRunner(Runner):
    """An engine scheme: :class:`gradsync.GradSync` on the bare model."""

    def __init__(self, choice: SchemeChoice, model: nn.Module, spec: TrainSpec,
                 steps: int | None = None) -> None:
        from gradsync.engine import GradSync

        super().__init__(choice, model, spec, steps)
        cfg = self.gradsync_config(spec, timeout_s=collective_timeout(spec.timeout),
                                   plan=(spec.plans or {}).get(choice.name))
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        self._shares = TopkShares(cfg.density) if spec.topk_shares and rank0 else None
        self.sync = self.preconditioner = GradSync(model, cfg, audit=self._shares or False)

    def plan(self) -> dict[str, Any] | None:
        return self.sync.plan.to_dict() if self.sync.plan is not None else None

    def topk_shares(self) -> dict[str, Any] | None:
        return self._shares.result() if self._shares is not None else None

    def follow(self, what: Any) -> None:
        self.sync.follow(what)

    def after_backward(self) -> None:
        self.sync.synchronize()  # False on an overflow: .grad holds NaN, the scaler skips

    def step_metrics(self, backward_start: float, backward_end: float) -> dict[str, float]:
        st = self.sync.stats()
        last = st["last"]
        return {**{k: last[k] for k in ("bytes_sent", "bytes_recv", "backward_s", "sparsify_s",
                                        "comm_s", "wait_s", "missing_rate", "hooks_s")},
                "probing": st["probing"]}

    def close(self) -> None:
        self.sync.close()


def wrap_ddp(model: nn.Module, device: torch.device, bucket_views: bool = False) -> nn.Module:
    """torch DDP around ``model``, without buffer broadcasts (module docstring); with
    ``bucket_views``, each ``.grad`` a view of its bucket (``gradient_as_bucket_view``), as
    gradsync's hook runs from Lightning's strategy and the Trainer's callback (torch's own DDP
    keeps torch's default)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    ids = [device.index] if device.type == "cuda" else None
    with warnings.catch_warnings():  # broadcast_buffers=False is what we mean
        warnings.simplefilter("ignore", FutureWarning)
        return DDP(model, device_ids=ids, broadcast_buffers=False,
                   gradient_as_bucket_view=bucket_views)


class DDPHookRunner(Runner):
    """``ddp_gradsync_<s>``: torch DDP with gradsync's comm hook running scheme ``s``."""

    def __init__(self, choice: SchemeChoice, model: nn.Module, spec: TrainSpec,
                 device: torch.device, P: int, steps: int | None = None) -> None:
        from gradsync.integrations import ddp as gddp

        super().__init__(choice, model, spec, steps)
        self.net = wrap_ddp(model, device, bucket_views=True)
        # what gradsync.ddp.register installs, through the meter (the hook calls' times)
        self.state, hook = gddp.hook(self.gradsync_config(spec), model, self.net.process_group)
        self.preconditioner = self.state
        self.meter = Meter(P)
        self.net.register_comm_hook(MeteredHookState(hook, self.state, self.meter),
                                    metered_hook)
        self.before_backward()

    def follow(self, what: Any) -> None:
        self.state.follow(what)

    def before_backward(self) -> None:
        s = self.state.counts
        self.b0, self.r0 = s.total.bytes_sent, s.total.bytes_recv
        self.miss0, self.tens0 = s.missing, s.tensors
        self.meter.start_step()

    def step_metrics(self, backward_start: float, backward_end: float) -> dict[str, float]:
        s = self.state.counts
        tensors = s.tensors - self.tens0
        # a trial of the hook's (auto's, or merged buckets') still measuring: as auto's probing
        trials = (self.state.auto.trial, self.state.fusion.trial)
        return {**self.meter.step_metrics(backward_start, backward_end),
                "bytes_sent": s.total.bytes_sent - self.b0,
                "bytes_recv": s.total.bytes_recv - self.r0,
                "missing_rate": (s.missing - self.miss0) / tensors if tensors else 0.0,
                "probing": any(t is not None and t["verdict"] is None for t in trials)}


class TorchDDPRunner(Runner):
    """torch DDP with one of torch's own comm hooks, metered (:mod:`.metering`)."""

    def __init__(self, choice: SchemeChoice, model: nn.Module, spec: TrainSpec,
                 device: torch.device, P: int) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

        super().__init__(choice, model, spec)
        self.net = wrap_ddp(model, device)
        if choice.name == "ddp":
            inner, inner_state, blocking = default_hooks.allreduce_hook, None, False
        elif choice.name == "ddp_fp16":
            inner, inner_state, blocking = default_hooks.fp16_compress_hook, None, False
        elif choice.name == "ddp_powersgd":
            inner = psgd.powerSGD_hook
            inner_state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                             start_powerSGD_iter=2, random_seed=spec.seed)
            blocking = True
        else:
            raise ValueError(f"{choice.name!r} is not one of torch's DDP hooks")
        self.meter = Meter(P, blocking=blocking)
        self.net.register_comm_hook(MeteredHookState(inner, inner_state, self.meter),
                                    metered_hook)

    @contextlib.contextmanager
    def metering(self) -> Iterator[None]:
        with counting_all_reduce(self.meter):
            yield

    def before_backward(self) -> None:
        self.meter.start_step()

    def step_metrics(self, backward_start: float, backward_end: float) -> dict[str, float]:
        return self.meter.step_metrics(backward_start, backward_end)


class LocalRunner(Runner):
    """No exchange: the bare model trains alone on each rank (:data:`~.spec.LOCAL`, the
    no-sync floor ``bench anatomy`` measures a step against). ``backward_s`` is all of
    ``loss.backward()``; nothing is sent."""

    def step_metrics(self, backward_start: float, backward_end: float) -> dict[str, float]:
        return {"bytes_sent": 0, "bytes_recv": 0, "backward_s": backward_end - backward_start,
                "sparsify_s": 0.0, "comm_s": 0.0, "wait_s": 0.0, "missing_rate": 0.0}


class MeetRunner(LocalRunner):
    """No gradient exchanged, but the ranks meet once a step (:data:`~.spec.MEET`): after each
    backward one 8-byte all-reduce (:class:`~gradsync.collectives.comm.Comm`, counted there),
    whose time is the step's wait and communication. Against the no-exchange floor it is what
    meeting costs before any gradient travels: on shared cores, mostly the ranks' skew."""

    def __init__(self, choice: SchemeChoice, model: nn.Module, spec: TrainSpec,
                 steps: int | None = None) -> None:
        super().__init__(choice, model, spec, steps)
        device = next(model.parameters()).device
        self._word = torch.zeros(1, dtype=torch.int64, device=device)
        self._comm = Comm()
        self._wait_s = 0.0

    def after_backward(self) -> None:
        t0 = time.perf_counter()
        self._comm.all_reduce(self._word)
        self._wait_s = time.perf_counter() - t0

    def step_metrics(self, backward_start: float, backward_end: float) -> dict[str, float]:
        stats, self._comm.stats = self._comm.stats, CommStats()
        return {**super().step_metrics(backward_start, backward_end),
                "bytes_sent": stats.bytes_sent, "bytes_recv": stats.bytes_recv,
                "comm_s": self._wait_s, "wait_s": self._wait_s}


def make_runner(choice: SchemeChoice, model: nn.Module, spec: TrainSpec, device: torch.device,
                P: int, steps: int | None = None) -> Runner:
    """The runner of ``choice`` (``choice.runner`` picks it) for ``model`` on this rank, in a
    run of ``steps`` steps (``None``: ``spec.steps``)."""
    if choice.runner == "engine":
        return EngineRunner(choice, model, spec, steps)
    if choice.runner == "ddp_hook":
        return DDPHookRunner(choice, model, spec, device, P, steps)
    if choice.runner == "torch_ddp":
        return TorchDDPRunner(choice, model, spec, device, P)
    if choice.runner == "local":
        return LocalRunner(choice, model, spec, steps)
    if choice.runner == "meet":
        return MeetRunner(choice, model, spec, steps)
    raise ValueError(f"unknown runner {choice.runner!r}")
