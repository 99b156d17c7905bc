"""Launchers for tests and benchmarks: real multi-rank jobs and emulated links.

:func:`run_distributed` (:mod:`.distributed`) runs a function on real gloo ranks on loopback;
:mod:`.netem` runs ranks in network namespaces joined by ``tc tbf``-shaped links. The library
never imports this package; tests and the applications do.
"""

from gradsync.testing.distributed import DistributedError, DistributedTimeout, run_distributed

__all__ = ["DistributedError", "DistributedTimeout", "run_distributed"]
