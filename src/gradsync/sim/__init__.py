"""Scale simulator: predicted iteration time per scheme at large P (a planning tool).

``python -m gradsync simulate`` (:mod:`gradsync.sim.simulate`); the collectives' step-by-step
α-β patterns in :mod:`gradsync.sim.patterns`; ``--validate`` compares predictions with measured
GradSync runs on shaped links (:mod:`gradsync.sim.validate`).
"""

from gradsync.sim.patterns import Step, comm_time, pattern, union_density, volume

__all__ = ["Step", "comm_time", "pattern", "union_density", "volume"]
