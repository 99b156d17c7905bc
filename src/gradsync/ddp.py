"""DDP comm hook: ``register(ddp_model, cfg)`` sparsifies inside DDP's buckets.

The implementation lives in :mod:`gradsync.integrations.ddp`; this module is its public name.
"""

from gradsync.integrations.ddp import (
    DDP_SCHEMES,
    HookState,
    hook,
    register,
)

__all__ = ["DDP_SCHEMES", "HookState", "hook", "register"]
