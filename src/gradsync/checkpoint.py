"""Per-rank checkpoints of gradsync's state with the model and optimizer.

``save``/``load`` write one ``torch.save`` file per rank; ``save_dcp``/``load_dcp`` use
``torch.distributed.checkpoint``.

The implementation lives in :mod:`gradsync.integrations.checkpoint`; this module is its public name.
"""

from gradsync.integrations.checkpoint import (
    load,
    load_dcp,
    save,
    save_dcp,
)

__all__ = ["load", "load_dcp", "save", "save_dcp"]
