"""PyTorch Lightning: ``GradSyncStrategy(cfg)``, a DDP strategy that syncs through gradsync.

Needs ``pytorch-lightning`` (imported here, not by ``import gradsync``). The implementation
lives in :mod:`gradsync.integrations.lightning`; this module is its public name.
"""

try:
    from gradsync.integrations.lightning import CHECKPOINT_KEY, GradSyncStrategy
except ModuleNotFoundError as e:  # pragma: no cover - exercised by tests/test_packaging.py
    if e.name not in ("pytorch_lightning", "lightning_fabric", "lightning"):
        raise
    raise ModuleNotFoundError(
        "gradsync.lightning needs PyTorch Lightning: pip install pytorch-lightning",
        name=e.name) from e

__all__ = ["CHECKPOINT_KEY", "GradSyncStrategy"]
