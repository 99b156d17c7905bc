"""gradsync: cheaper gradient synchronization for PyTorch data-parallel training.

Sparsify → encode → reduce with sparse collectives → schedule behind the backward pass.
Layers (DESIGN.md), data flowing down, imports never pointing up::

    sparsify/     which entries to send (topk, randomk, dgc, gaussiank, redsync, sidco, …)
    feedback      error feedback: what is not sent stays in a residual
    formats/      wire encodings (coo, densestream, sketch) with exact sizes
    collectives/  sparse/dense collectives returning the global SUM, with byte accounting
    testing       run_distributed(): real multi-rank gloo jobs on loopback
"""

from gradsync.sparsegrad import SparseGrad

__version__ = "0.1.0"
__all__ = ["SparseGrad", "__version__"]
