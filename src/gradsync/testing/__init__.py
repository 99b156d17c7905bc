"""Launchers for tests and benchmarks: real multi-rank jobs and emulated links.

:func:`run_distributed` runs a function on real gloo ranks on loopback: new processes per call
(:mod:`.distributed`), or, inside :func:`pooled` (the test suite's session), ranks that are
reused (:mod:`.pool`). :mod:`.netem` runs ranks in network namespaces joined by ``tc
tbf``-shaped links. The library never imports this package; tests and the applications do.
"""

from gradsync.testing.distributed import DistributedError, DistributedTimeout
from gradsync.testing.pool import pooled, run_distributed

__all__ = ["DistributedError", "DistributedTimeout", "pooled", "run_distributed"]
