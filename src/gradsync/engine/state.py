"""The :class:`Stateful` protocol: per-rank synchronization state that checkpoints carry.

Error-feedback residuals, DGC velocities, sparsifier generators, Ok-Topk thresholds and TAGC
accumulators differ from rank to rank: a resumed rank must get back exactly its own, from a
run with the same world size and the same trajectory-relevant configuration. Everything
stateful in gradsync — :class:`~gradsync.engine.GradSync`, the DDP hook's state, TAGC —
implements this protocol, and :mod:`gradsync.checkpoint` relies on it alone (it never guesses a
type from attribute names).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch.distributed as dist

__all__ = ["Identity", "Stateful", "check_identity", "check_params"]


@dataclass(frozen=True)
class Identity:
    """Who saved a state: ``kind`` (the scheme, ``"ddp_hook:<scheme>"``, ``"tagc"``), the
    ``rank`` and ``world_size`` that produced it, and the process ``group`` it syncs over."""

    kind: str
    rank: int
    world_size: int
    group: dist.ProcessGroup | None = None

    def header(self) -> dict[str, Any]:
        """The JSON-safe part (the group is a live object)."""
        return {"kind": self.kind, "rank": self.rank, "world_size": self.world_size}


@runtime_checkable
class Stateful(Protocol):
    """Per-rank state with an identity.

    ``state_dict()`` returns this rank's state including ``"rank"``, ``"world_size"`` and the
    configuration it depends on; ``load_state_dict(state)`` restores it and raises
    ``ValueError`` — before changing anything — when the state comes from another rank, world
    size or configuration; ``check_compatible(state)`` runs those checks alone (a checkpoint
    calls it before touching the model and optimizer).
    """

    def identity(self) -> Identity: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def check_compatible(self, state: dict[str, Any]) -> None: ...


def check_identity(state: Any, me: Identity, what: str) -> None:
    """Raise ``ValueError`` unless ``state`` was saved by rank ``me.rank`` of ``me.world_size``.

    The common first check of every ``check_compatible``; ``what`` names the object in the
    message (``"GradSync"``, ``"the DDP hook"``, ``"TAGC"``).
    """
    if not isinstance(state, dict) or "world_size" not in state or "rank" not in state:
        raise ValueError(f"not a {what} state_dict (no rank/world_size entries)")
    if int(state["world_size"]) != me.world_size:
        raise ValueError(f"{what} state was saved by {state['world_size']} ranks, this job has "
                         f"{me.world_size}: residuals are per rank and cannot be re-sharded")
    if int(state["rank"]) != me.rank:
        raise ValueError(f"{what} state belongs to rank {state['rank']}, this is rank "
                         f"{me.rank}: every rank must load its own state")


def check_params(saved: dict[str, list[int]], mine: dict[str, list[int]], what: str) -> None:
    """Raise ``ValueError`` unless ``saved`` (parameter name → shape) is this model's
    ``mine``, naming what differs: missing and new parameters, other shapes."""
    if saved == mine:
        return
    missing = sorted(set(saved) - set(mine))
    extra = sorted(set(mine) - set(saved))
    shapes = sorted(n for n in set(saved) & set(mine) if list(saved[n]) != list(mine[n]))
    raise ValueError(f"{what} is for a different model: missing here {missing[:5]}, new here "
                     f"{extra[:5]}, other shapes {shapes[:5]}")
