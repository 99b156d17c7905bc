"""Hugging Face ``Trainer``: ``GradSyncCallback(cfg)`` installs gradsync's DDP hook in Trainer.

Needs ``transformers`` (imported here, not by ``import gradsync``). The implementation lives
in :mod:`gradsync.integrations.transformers`; this module is its public name.
"""

try:
    from gradsync.integrations.transformers import GradSyncCallback
except ModuleNotFoundError as e:  # pragma: no cover - exercised by tests/test_packaging.py
    if e.name != "transformers" and not (e.name or "").startswith("transformers."):
        raise
    raise ModuleNotFoundError(
        "gradsync.transformers needs Hugging Face transformers: pip install transformers",
        name=e.name) from e

__all__ = ["GradSyncCallback"]
