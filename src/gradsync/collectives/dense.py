"""Dense: all-reduce of the densified selection (the "Dense" baseline of Ok-Topk Table 1).

Volume per rank 2n(P−1)/P words (ring). Exact: every local entry is kept.
"""

from __future__ import annotations

from typing import Any

import torch

from gradsync.collectives import registry
from gradsync.collectives.base import Collective
from gradsync.collectives.comm import Comm
from gradsync.sparsegrad import SparseGrad


@registry.register("dense")
class Dense(Collective):
    def _reduce(
        self, sel: SparseGrad, comm: Comm, step: int
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        dense = sel.to_dense()
        comm.all_reduce(dense)
        return dense, sel.indices, {}
