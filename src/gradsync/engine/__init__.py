"""The engine layer: :class:`GradSync` and its validated :class:`Config`.

Per-parameter gradient hooks → the jobs of a plan (:mod:`gradsync.schedule`) → sparsification
and collectives on background threads → averaged gradients in ``.grad``. :mod:`.sync` holds the
public front, :class:`GradSync`, and says which module does which part of a step (jobs,
prepare, executor, apply, warmup, components, audit, stats). :mod:`.state` is the
:class:`Stateful` protocol checkpoints rely on; :mod:`.consistency` holds the cross-rank checks
(configuration signatures, parameter digests) the engine and the integrations use.
"""

from gradsync.engine.audit import AuditRecord
from gradsync.engine.config import Config
from gradsync.engine.consistency import ReplicaDivergence, check_consistency, signature_check
from gradsync.engine.state import Identity, Stateful, check_identity
from gradsync.engine.stats import StepStats
from gradsync.engine.sync import GradSync

__all__ = ["AuditRecord", "Config", "GradSync", "Identity", "ReplicaDivergence", "Stateful",
           "StepStats", "check_consistency", "check_identity", "signature_check"]
