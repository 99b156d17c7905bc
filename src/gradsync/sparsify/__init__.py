"""Sparsifiers: choose which gradient entries to send.

``gradsync.sparsify.get(name, density=…, **options) -> Sparsifier``; ``names()`` lists them.
One file per algorithm; each names the paper section it implements.
"""

from __future__ import annotations

from gradsync._registry import Registry
from gradsync.sparsify.base import (
    Sparsifier,
    seed_for,
    select_each,
    target_k,
    validate_density,
)

registry: Registry[Sparsifier] = Registry("sparsifier")


def get(name: str, **options: object) -> Sparsifier:
    """Build the sparsifier ``name`` (e.g. ``get("dgc", density=0.01)``)."""
    return registry.get(name, **options)


def names() -> list[str]:
    return registry.names()


# Importing the modules registers them.
from gradsync.sparsify import (  # noqa: E402,F401
    dgc,
    fraction,
    gaussiank,
    randomk,
    redsync,
    sidco,
    threshold,
    topk,
)
from gradsync.sparsify.segments import select_buffer  # noqa: E402

__all__ = ["Sparsifier", "get", "names", "registry", "seed_for", "select_buffer", "select_each",
           "target_k", "validate_density"]
