"""Hugging Face Accelerate: ``register(accelerator, model, cfg)`` after ``accelerator.prepare``.

The implementation lives in :mod:`gradsync.integrations.accelerate`; this module is its public name.
"""

from gradsync.integrations.accelerate import (
    HookCheckpoint,
    register,
)

__all__ = ["HookCheckpoint", "register"]
