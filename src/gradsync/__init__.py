"""gradsync: cheaper gradient synchronization for PyTorch data-parallel training.

Sparsify → encode → reduce with sparse collectives → schedule behind the backward pass.
Layers (DESIGN.md), data flowing down, imports never pointing up::

    sparsify/     which entries to send (topk, randomk, dgc, gaussiank, redsync, sidco, …)
    feedback      error feedback: what is not sent stays in a residual
    formats/      wire encodings (coo, densestream, sketch) with exact sizes
    collectives/  sparse/dense collectives returning the global SUM, with byte accounting
    schedule/     fusion planners (SSFusion, Cupcake, OMGS, …) over a measured cost model
    engine        GradSync: hooks → fusion buffers → overlapped sparse sync → .grad
    ddp, fsdp     integrations: DDP comm hook, TAGC for FSDP2
    testing       run_distributed(): real multi-rank gloo jobs on loopback
"""

from typing import Any

from gradsync.sparsegrad import SparseGrad

__version__ = "0.1.0"
__all__ = ["Config", "GradSync", "SparseGrad", "__version__", "check_consistency"]

# Imported on first use (PEP 562): ``import gradsync`` stays light and free of import cycles.
_LAZY = {"GradSync": "gradsync.engine", "Config": "gradsync.config",
         "check_consistency": "gradsync.consistency"}


# Submodules reachable as attributes (``gradsync.ddp.register``) without an explicit import.
_SUBMODULES = {"checkpoint", "collectives", "ddp", "feedback", "formats", "fsdp", "models",
               "schedule", "sparsify", "testing"}


def __getattr__(name: str) -> Any:
    import importlib

    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"gradsync.{name}")
    raise AttributeError(f"module 'gradsync' has no attribute {name!r}")
