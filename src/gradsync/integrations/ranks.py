"""Every rank's DDP-hook state in one object, for frameworks that write one checkpoint file.

Lightning writes its checkpoint on rank 0 only and Accelerate writes registered objects on the
main process only; both read the file back on every rank. The hook's state is per rank
(residuals, sparsifier generators: docs/architecture.md, "Contracts"), so :func:`gather` collects
every rank's :meth:`HookState.state_dict` into one dict ``{"format", "world_size", "ranks"}``
and :func:`restore` hands each rank its own entry, which :meth:`HookState.load_state_dict`
checks (rank, world size, configuration, model).
"""

from __future__ import annotations

from typing import Any

import torch

from gradsync.collectives.comm import exchange_objects
from gradsync.integrations.ddp import HookState

__all__ = ["FORMAT", "gather", "restore"]

FORMAT = "gradsync.ddp_hook.ranks/1"


def _cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _cpu(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_cpu(v) for v in obj)
    return obj


def gather(state: HookState, everywhere: bool = False) -> dict[str, Any] | None:
    """Every rank's state on group rank 0 (or on every rank with ``everywhere``); others get
    ``None``. A collective: call it on every rank of the hook's group, in the same order."""
    me = state.identity()
    mine = _cpu(state.state_dict())
    ranks = ([mine] if me.world_size == 1  # also without a process group
             else exchange_objects(mine, me.group, dst=None if everywhere else 0))
    if ranks is None:
        return None
    return {"format": FORMAT, "world_size": me.world_size, "ranks": ranks}


def restore(state: HookState, saved: Any, device: torch.device | str | None = None) -> None:
    """Load this rank's entry of :func:`gather`'s dict into ``state``; residuals go to
    ``device``. Raises ``ValueError`` (before changing anything) on anything but a dict from a
    job of the same world size, rank, configuration and model."""
    if not isinstance(saved, dict) or saved.get("format") != FORMAT:
        raise ValueError("not gradsync DDP-hook state (expected the dict that "
                         "gradsync.integrations.ranks.gather returns)")
    me = state.identity()
    if int(saved["world_size"]) != me.world_size or len(saved["ranks"]) != me.world_size:
        raise ValueError(f"the gradsync state was saved by {saved['world_size']} ranks, this job "
                         f"has {me.world_size}: residuals are per rank and cannot be re-sharded")
    entry = dict(saved["ranks"][me.rank])
    if device is not None:  # generator states stay on the CPU; only the residuals move
        fb = dict(entry["feedback"])
        for k in ("residual", "velocity"):
            if k in fb:
                fb[k] = {n: t.to(device) for n, t in fb[k].items()}
        entry["feedback"] = fb
    state.load_state_dict(entry)
