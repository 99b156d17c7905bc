"""The balanced split of the index space into regions, and when to re-evaluate it.

Ok-Topk §3.1.1 (Algorithm 1 lines 5–7), which DenseStream's Algorithm 2 (lines 15–16) adopts:
the index space ``[0, numel)`` is cut into R regions so that every region receives about the
same number of selected entries. Each rank takes the R − 1 equal-count cut points of its own
sorted selection (cut point j is its (j·m/R)-th selected index, m = its selection size); one
all-reduce of R integers (the R − 1 cut sums and the number of ranks that voted, i.e. had a
non-empty selection) averages them into the boundaries ``B[0] = 0 ≤ B[1] ≤ … ≤ B[R] = numel``.
When no rank selected anything the split is even, ``B[j] = ⌊j·numel / R⌋``.

The boundaries are re-evaluated every τ steps (the paper's τ = 64) and reused in between. The
one period rule, :func:`due`, is Ok-Topk Algorithm 1's ``(t − 1) mod τ == 0`` (t = step + 1):
re-evaluate at steps 0, τ, 2τ, …. It is written as "the step entered a new τ-window since the
last evaluation" so that a skipped step (e.g. one whose gradient was non-finite) cannot make a
re-evaluation be missed. It also re-evaluates on the first call and whenever the step is earlier
than the step of the last evaluation (a new run, or an older checkpoint), because boundaries
evaluated at a later step are not the ones the schedule would hold. Ok-Topk schedules its exact
global threshold (period τ′) with the same rule.
"""

from __future__ import annotations

import torch

from gradsync.collectives.comm import Comm

__all__ = ["balanced_boundaries", "due"]


def due(step: int, last: int | None, period: int) -> bool:
    """Whether a quantity last evaluated at step ``last`` (None: never) is re-evaluated at
    ``step`` with period ``period``: on the first call, when ``step < last``, and when ``step``
    lies in another window ``[j·period, (j+1)·period)`` than ``last``."""
    return last is None or step < last or step // period != last // period


def balanced_boundaries(indices: torch.Tensor, numel: int, regions: int,
                        comm: Comm) -> torch.Tensor:
    """The boundaries ``B`` (int64, CPU, ``regions + 1`` entries, non-decreasing, ``B[0] = 0``,
    ``B[regions] = numel``) of ``regions`` regions with balanced counts: the mean over the voting
    ranks of each rank's equal-count cut points of its sorted local ``indices`` (module doc).
    One all-reduce of ``regions`` int64 words on ``indices``' device; every rank gets the same
    boundaries."""
    if regions < 1:
        raise ValueError(f"balanced_boundaries: regions must be >= 1, got {regions}")
    if numel * comm.size >= 2**63:
        raise ValueError(f"balanced_boundaries: numel {numel} too large to average boundaries "
                         f"over {comm.size} ranks in int64")
    dev, m = indices.device, indices.numel()
    vote = torch.zeros(regions, dtype=torch.int64, device=dev)
    if m:  # cut point j = this rank's (j·m/R)-th selected index; the last word says "voted"
        vote[: regions - 1] = indices[torch.arange(1, regions, device=dev) * m // regions]
        vote[regions - 1] = 1
    comm.all_reduce(vote)
    voters = int(vote[regions - 1])
    if voters:
        cuts = vote[: regions - 1].cpu() // voters  # integer mean: exact, identical everywhere
    else:  # nobody selected anything: an even split
        cuts = torch.arange(1, regions) * numel // regions
    return torch.cat([torch.zeros(1, dtype=torch.int64), cuts,
                      torch.full((1,), numel, dtype=torch.int64)])
