"""Scale simulator: predicted iteration time per scheme at large P (a planning tool).

``python -m gradsync simulate`` (:mod:`gradsync.apps.sim.simulate`); the collectives' step-by-step
α-β patterns in :mod:`gradsync.apps.sim.patterns`; ``--validate`` compares predictions with measured
GradSync runs on shaped links (:mod:`gradsync.apps.sim.validate`).
"""

from gradsync.apps.sim.patterns import Step, comm_time, pattern, union_density, volume

__all__ = ["Step", "comm_time", "pattern", "union_density", "volume"]
