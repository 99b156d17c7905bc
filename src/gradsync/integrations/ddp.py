"""DDP integration: a comm hook that sparsifies inside each DDP bucket.

``gradsync.ddp.register(ddp_model, cfg)`` installs the hook; ``gradsync.ddp.hook(cfg, model)``
returns ``(state, hook)`` for frameworks that take the two separately (Lightning's
``DDPStrategy(ddp_comm_state=…, ddp_comm_hook=…)``, Accelerate's comm-hook slot).

Inside a bucket (SSFusion §III–IV applied to DDP's own fusion buffers):

* ``per_tensor``: every tensor is sparsified on its own (no tensor missing), the selections are
  concatenated and all-gathered (TopkA);
* ``ssfusion``: selective sparsification — tensors smaller than ``small_numel`` (SSFusion's
  102,400-element heuristic, Insight #2) are not sparsified; density-aware compensation lowers
  the large tensors' density (floor ``cfg.min_density``) so the bucket sends about
  ``density × bucket numel`` entries; everything travels in one all-gather;
* ``ssfusion_oi``: as ``ssfusion``, but the unsparsified tensors travel in an all-reduce and the
  sparsified ones in an all-gather (SSFusion-I's split, with the split fixed by sparsification);
* ``dense``: a plain all-reduce (a baseline through the same hook).

Facts this relies on (DESIGN.md): the hook's second parameter must be named ``bucket``;
``functools.partial`` and callable instances are rejected, plain functions work; buckets are
rebuilt after iteration 0, so residuals are keyed by parameter name, not by bucket; under
``no_sync()`` the hook is not called (gradients accumulate in DDP's buffers); on gloo a second
collective cannot be launched from ``Future.then``, so the hook runs its collectives blocking
and returns a completed future. (No ``from __future__ import annotations`` here: DDP compares
the ``bucket`` annotation with ``dist.GradBucket`` itself, not with its string.)
"""

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradsync import collectives, sparsify
from gradsync.collectives.comm import Comm, CommStats
from gradsync.engine.config import Config
from gradsync.engine.consistency import signature_check
from gradsync.feedback import ErrorFeedback
from gradsync.sparsegrad import SparseGrad

__all__ = ["HookState", "hook", "register"]

DDP_SCHEMES = ("dense", "per_tensor", "ssfusion", "ssfusion_oi")
SMALL_NUMEL = 102_400  # SSFusion Insight #2: ~200 KB of fp32


@dataclass
class HookState:
    """Everything the hook keeps between calls (pass it as DDP's comm ``state``)."""

    cfg: Config
    group: dist.ProcessGroup | None = None
    small_numel: int = SMALL_NUMEL
    names: dict[int, str] = field(default_factory=dict)  # id(param) -> name
    ef: ErrorFeedback = field(init=False)
    sparsifiers: dict[str, sparsify.Sparsifier] = field(default_factory=dict)
    allgather: collectives.Collective = field(init=False)
    last: CommStats = field(default_factory=CommStats)
    total: CommStats = field(default_factory=CommStats)
    calls: int = 0
    missing: int = 0
    tensors: int = 0
    shapes: list[tuple[str, tuple[int, ...]]] | None = None  # the model's, when known
    checked: bool = False  # configuration agreed across ranks

    def __post_init__(self) -> None:
        if self.cfg.scheme not in DDP_SCHEMES:
            raise ValueError(f"the DDP hook supports schemes {DDP_SCHEMES}, got "
                             f"{self.cfg.scheme!r} (use gradsync.GradSync for the others)")
        if self.small_numel < 0:
            raise ValueError(f"small_numel must be >= 0, got {self.small_numel}")
        self.ef = ErrorFeedback(momentum=self.cfg.momentum)
        self.allgather = collectives.get("topka")

    def name_of(self, p: torch.Tensor) -> str:
        name = self.names.get(id(p))
        if name is None:  # no model given: stable within the run only
            name = self.names[id(p)] = f"param{len(self.names)}:{tuple(p.shape)}"
        return name

    def sparsifier(self, name: str, density: float) -> sparsify.Sparsifier:
        sp = self.sparsifiers.get(name)
        if sp is None or sp.density != density:
            sp = sparsify.get(self.cfg.sparsifier, density=density, seed=self.cfg.seed)
            self.sparsifiers[name] = sp
        return sp

    def stats(self) -> dict[str, Any]:
        return {"last": self.last.as_dict(), "total": self.total.as_dict(),
                "calls": self.calls,
                "missing_rate": self.missing / self.tensors if self.tensors else 0.0}

    def state_dict(self) -> dict[str, Any]:
        return {"feedback": self.ef.state_dict(),
                "sparsifiers": {k: s.state_dict() for k, s in self.sparsifiers.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ef.load_state_dict(state["feedback"])
        for k, s in state["sparsifiers"].items():
            self.sparsifier(k, s["density"]).load_state_dict(s)


def _densities(state: HookState, numels: list[int]) -> list[float | None]:
    """Per-tensor density; None = not sparsified (selective sparsification + compensation)."""
    cfg = state.cfg
    if cfg.scheme == "per_tensor":
        return [cfg.density] * len(numels)
    small = [n < state.small_numel for n in numels]
    large_numel = sum(n for n, s in zip(numels, small) if not s)
    if not large_numel:
        return [None] * len(numels)
    # density-aware compensation: k_target = density × bucket numel, minus what travels dense
    k_target = cfg.density * sum(numels) - sum(n for n, s in zip(numels, small) if s)
    d = min(cfg.density, max(cfg.min_density, k_target / large_numel))
    return [None if s else d for s in small]


def _sparse_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The comm hook: blocking collectives inside, a completed future out."""
    if not state.checked:
        _agree(state)
    buf = bucket.buffer()
    comm = Comm(state.group)
    P = comm.size
    if state.cfg.scheme == "dense":
        comm.all_reduce(buf)
        buf.div_(P)
        return _done(state, comm.stats, buf)
    params = bucket.parameters()
    numels = [p.numel() for p in params]
    names = [state.name_of(p) for p in params]
    densities = _densities(state, numels)
    offsets = [0]
    for n in numels:
        offsets.append(offsets[-1] + n)
    accs, sparse_parts, dense_parts = {}, [], []
    to_allreduce = state.cfg.scheme == "ssfusion_oi"
    for i, (name, d) in enumerate(zip(names, densities)):
        acc = state.ef.accumulate(name, buf[offsets[i]:offsets[i + 1]])
        accs[name] = acc
        if d is None and to_allreduce:
            dense_parts.append(i)
        elif d is None:
            sparse_parts.append((i, SparseGrad(torch.arange(acc.numel(), device=acc.device),
                                               acc, acc.numel(), validate=False)))
        else:
            sparse_parts.append((i, state.sparsifier(name, d).select(acc)))
    out = torch.zeros_like(buf)
    kept_by_tensor: dict[int, torch.Tensor] = {}
    if dense_parts:
        flat = torch.cat([accs[names[i]] for i in dense_parts])
        work = comm.all_reduce(flat, async_op=True)  # interleaved with the all-gather below
    stats = comm.stats
    if sparse_parts:
        idx = torch.cat([s.indices + offsets[i] for i, s in sparse_parts])
        vals = torch.cat([s.values for _, s in sparse_parts])
        res = state.allgather(SparseGrad(idx, vals, buf.numel(), validate=False),
                              group=state.group)
        out += res.dense
        kept = res.kept
        for i, _ in sparse_parts:
            sel = kept[(kept >= offsets[i]) & (kept < offsets[i + 1])] - offsets[i]
            kept_by_tensor[i] = sel
        stats += res.stats
    if dense_parts:
        work.wait()
        pos = 0
        for i in dense_parts:
            out[offsets[i]:offsets[i + 1]] = flat[pos:pos + numels[i]]
            kept_by_tensor[i] = torch.arange(numels[i], device=buf.device)
            pos += numels[i]
    for i, name in enumerate(names):
        state.ef.update(name, accs[name], kept_by_tensor[i])
        state.tensors += 1
        state.missing += int(kept_by_tensor[i].numel() == 0)
    buf.copy_(torch.div(out, P))
    return _done(state, stats, buf)


def _done(state: HookState, stats: CommStats, buf: torch.Tensor) -> torch.futures.Future:
    state.last = stats
    state.total += stats
    state.calls += 1
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(buf)
    return fut


def hook(cfg: Config, model: nn.Module | None = None, group: dist.ProcessGroup | None = None,
         small_numel: int = SMALL_NUMEL) -> tuple[HookState, Any]:
    """``(state, hook)`` for frameworks with separate slots (Lightning, Accelerate).

    Pass ``model`` (the module DDP wraps) so residuals are keyed by parameter name, which
    makes ``state.state_dict()`` portable across restarts. The ranks' configurations and
    models are compared (one small all-gather) here when the process group already exists,
    otherwise at the hook's first call; a difference raises ``ValueError`` on every rank.
    """
    state = HookState(cfg=cfg, group=group, small_numel=small_numel)
    if model is not None:
        state.names = {id(p): n for n, p in model.named_parameters()}
        state.shapes = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    if dist.is_available() and dist.is_initialized():
        _agree(state)
    return state, _sparse_hook


def _agree(state: HookState) -> None:
    """All ranks must run the same hook configuration on the same model."""
    if not state.checked and dist.get_world_size(state.group) > 1:
        signature_check({"config": state.cfg.to_dict(), "small_numel": state.small_numel,
                         "params": state.shapes}, state.group)
    state.checked = True


def register(ddp_model: nn.parallel.DistributedDataParallel, cfg: Config,
             small_numel: int = SMALL_NUMEL) -> HookState:
    """Install the sparsifying comm hook on ``ddp_model``; returns its state (stats, ckpt)."""
    state, fn = hook(cfg, ddp_model.module, ddp_model.process_group, small_numel)
    ddp_model.register_comm_hook(state, fn)
    return state
