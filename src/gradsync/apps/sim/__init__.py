"""Scale simulator: predicted iteration time per scheme at large P (a planning tool).

Modules, each importing only the ones listed after it:

* :mod:`gradsync.apps.sim.simulate`: the command line, ``python -m gradsync simulate``;
* :mod:`gradsync.apps.sim.validate`: ``--validate``, predictions vs measured GradSync runs on
  shaped links;
* :mod:`gradsync.apps.sim.predict`: the prediction (:func:`~gradsync.apps.sim.predict.predict`,
  the α-β :class:`~gradsync.apps.sim.predict.Network`, the compute it starts from);
* :mod:`gradsync.apps.sim.contention`: P ranks sharing C cores (the CPU work floor, the
  loaded price of a synchronising round);
* :mod:`gradsync.apps.sim.callcpu`: the collectives' own CPU per call, measured on the group
  at the job's P (a floor over the merge and codec terms);
* :mod:`gradsync.apps.sim.patterns`: the collectives' step-by-step α-β patterns.
"""

from gradsync.apps.sim.patterns import Step, comm_time, pattern, union_density, volume

__all__ = ["Step", "comm_time", "pattern", "union_density", "volume"]
