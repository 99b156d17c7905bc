"""Sparse and dense collectives: turn each rank's selection into the global SUM.

``gradsync.collectives.get(name, **options) -> Collective``; ``names()`` lists them. Every
collective talks to the network only through :class:`Comm`, which counts the bytes.
"""

from __future__ import annotations

from gradsync._registry import Registry
from gradsync.collectives.base import Collective, SyncResult
from gradsync.collectives.comm import Comm, CommStats

registry: Registry[Collective] = Registry("collective")


def get(name: str, **options: object) -> Collective:
    """Build the collective ``name`` (e.g. ``get("oktopk", density=0.01)``)."""
    return registry.get(name, **options)


def names() -> list[str]:
    return registry.names()


from gradsync.collectives import (  # noqa: E402,F401
    dense,
    densestream,
    gtopk,
    lhc,
    oktopk,
    spardl,
    topka,
    topkdsa,
)

__all__ = ["Collective", "Comm", "CommStats", "SyncResult", "get", "names", "registry"]
