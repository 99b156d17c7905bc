"""HiPress: selective compression and bulk synchronization from a static cost model
(Bai et al., "Gradient Compression Supercharged High-Performance Data Parallel DNN Training",
SOSP'21, §3–4, "CaSync"; the baseline of SSFusion §II-E and §V).

HiPress decides, per gradient and before training, whether compressing it pays. Its model is
*static*: it uses only the link (α, β), the codec's measured cost, the tensor's size and P — not
where the tensor sits in the backward pass or what else is on the link (SSFusion §II-E: "relies
solely on a theoretical cost model"). In gradsync's terms, for gradient l with n_l elements of
K bytes and k_l = ``target_k(n_l, density)`` selected entries of E = 4 + K bytes:

* **compressed**, its own message: ``T_cpr(l) = T_sp(n_l) + T_AG(k_l · E)`` — the sparsifier
  (HiPress's encode; the decode is a scatter-add that the cost model folds into T_AG) and the
  ring all-gather of Eq. 3, whose (P−1)α start-up the tensor pays alone;
* **not compressed**, bulk-synchronized: small gradients are batched into one synchronization
  round so that they share its start-up cost, so a dense gradient adds only its bandwidth term
  of Eq. 4, ``T_dense(l) = 2(P−1)/P · n_l K · β``.

Gradient l is compressed iff ``T_cpr(l) < T_dense(l)``. A tiny gradient is therefore always
bulk-synchronized dense (its compressed message alone costs (P−1)α); a large one is compressed
when the link is slow (β large) and sent dense when the link is fast enough that the codec costs
more than it saves.

**Bulk synchronization.** Consecutive uncompressed gradients (backward order) are batched into
one all-reduce of at most ``bucket_bytes`` (a gradient larger than the cap travels alone); every
compressed gradient is its own message, sparsified on its own (layer-wise sparsification: no
tensor misses the step). Nothing is fused by overlap, as SSFusion points out. Bulk buffers
travel in the buffer's all-reduce part (``TensorPlan.allreduce``) so that error feedback still
runs on them (a residual left from the warm-up steps is sent with the gradient, not lost).

**Partitioning.** HiPress also cuts a large compressed gradient into partitions that its
parameter servers or ring neighbours aggregate and that pipeline encoding with sending. gradsync
sends a sparse gradient as one all-gather message, which every rank aggregates itself, so there
is no aggregator to balance and no sub-tensor message to pipeline: every compressed gradient is
one partition. This part of HiPress is not reproduced.
"""

from __future__ import annotations

from typing import Any

from gradsync.schedule.costmodel import CostModel
from gradsync.schedule.plan import BufferPlan, TensorPlan, entries

__all__ = ["hipress_buffers", "hipress_decision"]


def hipress_decision(numel: int, cost: CostModel, density: float) -> dict[str, Any]:
    """HiPress's static test for one gradient of ``numel`` elements: ``T_cpr``, ``T_dense`` and
    ``compress = T_cpr < T_dense`` (module doc)."""
    p = cost.P
    t_cpr = cost.t_sparsify(numel) + cost.t_allgather(entries(numel, density) * cost.entry_bytes)
    t_dense = (2 * (p - 1) / p * numel * cost.elem_bytes * cost.allreduce.beta) if p > 1 else 0.0
    return {"T_cpr": t_cpr, "T_dense": t_dense, "compress": p > 1 and t_cpr < t_dense}


def hipress_buffers(names: list[str], numel: dict[str, int], cost: CostModel, density: float,
                    bucket_bytes: int) -> tuple[list[BufferPlan], list[dict[str, Any]]]:
    """HiPress's plan over ``names`` (backward order): compressed gradients alone, runs of
    uncompressed ones bulk-synchronized in all-reduces of at most ``bucket_bytes``; and the
    per-gradient decisions."""
    buffers: list[BufferPlan] = []
    decisions: list[dict[str, Any]] = []
    bulk: list[TensorPlan] = []
    bulk_bytes = 0

    def flush() -> None:
        nonlocal bulk, bulk_bytes
        if bulk:
            buffers.append(BufferPlan(tuple(bulk), "per_tensor"))
            bulk, bulk_bytes = [], 0

    for n in names:
        dec = hipress_decision(numel[n], cost, density)
        decisions.append({"name": n, **dec})
        if dec["compress"]:
            flush()
            buffers.append(BufferPlan((TensorPlan(n, numel[n], density),), "per_tensor"))
            continue
        b = numel[n] * cost.elem_bytes
        if bulk and bulk_bytes + b > bucket_bytes:
            flush()
        bulk.append(TensorPlan(n, numel[n], None, allreduce=True))
        bulk_bytes += b
    flush()
    return buffers, decisions
