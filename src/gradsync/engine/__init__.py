"""The engine layer: :class:`GradSync` and its validated :class:`Config`.

Per-parameter gradient hooks → the jobs of a plan (:mod:`gradsync.schedule`) → sparsification
and collectives on background threads → averaged gradients in ``.grad``. :mod:`.consistency`
holds the cross-rank checks (configuration signatures, parameter digests) the engine and the
integrations use.
"""

from gradsync.engine.config import Config
from gradsync.engine.consistency import ReplicaDivergence, check_consistency, signature_check
from gradsync.engine.sync import AuditRecord, GradSync, StepStats

__all__ = ["AuditRecord", "Config", "GradSync", "ReplicaDivergence", "StepStats",
           "check_consistency", "signature_check"]
