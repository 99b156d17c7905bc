"""gradsync: cheaper gradient synchronization for PyTorch data-parallel training.

Sparsify → encode → reduce with sparse collectives → schedule behind the backward pass.
The package is laid out in layers; each entry below may import only the entries above it
(``docs/architecture.md``; ``make lint`` enforces it)::

    sparsegrad      SparseGrad, the type every layer passes down
    sparsify/       which entries to send (topk, randomk, dgc, gaussiank, redsync, sidco, …)
    feedback        error feedback: what is not sent stays in a residual
    optim           FrozenVarianceAdamW: AdamW on velocities sent through error feedback
    formats/        wire encodings (coo, densestream, sketch) with exact sizes
    collectives/    sparse/dense collectives returning the global SUM, with byte accounting
    schedule/       the table of schemes, fusion planners, the cost model
    engine/         GradSync and Config: hooks → fusion buffers → overlapped sync → .grad
    integrations/   ddp (comm hook), fsdp (TAGC), checkpoint, lightning, accelerate
    testing/        launchers: run_distributed() on real gloo ranks, netem-shaped links
    apps/           the commands: train, bench, simulate, report, demo, profile
"""

from typing import Any

from gradsync.sparsegrad import SparseGrad

__version__ = "0.1.0"
__all__ = ["Config", "GradSync", "SparseGrad", "__version__", "check_consistency"]

# Imported on first use (PEP 562): ``import gradsync`` stays light and free of import cycles.
_LAZY = {"GradSync": "gradsync.engine", "Config": "gradsync.engine.config",
         "check_consistency": "gradsync.engine.consistency"}


# Submodules reachable as attributes (``gradsync.ddp.register``) without an explicit import; the
# integrations and the model zoo keep their short names (``gradsync.ddp`` is
# ``gradsync.ddp``).
_SUBMODULES = {"checkpoint": "checkpoint", "collectives": "collectives",
               "ddp": "ddp", "engine": "engine", "feedback": "feedback",
               "optim": "optim", "formats": "formats", "fsdp": "fsdp",
               "models": "apps.models",
               "lightning": "lightning", "accelerate": "accelerate", "transformers": "transformers",
               "schedule": "schedule", "sparsify": "sparsify", "testing": "testing"}


def __getattr__(name: str) -> Any:
    import importlib

    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"gradsync.{_SUBMODULES[name]}")
    raise AttributeError(f"module 'gradsync' has no attribute {name!r}")
