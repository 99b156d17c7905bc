"""Fixed-size buckets in backward order: PyTorch DDP's bucketing (Dense, DenseOvlp, and the
fusion of per-tensor sparsification when no cost model is available).

DDP's rule (``torch.distributed._compute_bucket_assignment_by_size``, which the Reducer uses
when it rebuilds its buckets in the order gradients became ready after the first iteration):
gradients join the open bucket in backward order, and the bucket closes as soon as its size
*reaches* its limit, so a bucket overshoots its limit by less than its last gradient. The first
bucket's limit is ``first_bucket_bytes``, every later bucket's ``bucket_bytes``. DDP itself
uses a 1 MiB first bucket (:data:`DDP_FIRST_BUCKET_BYTES`) when ``bucket_cap_mb`` is left at
its default and ``bucket_cap_mb`` for every bucket when it is given; ``first_bucket_bytes=None``
(gradsync's default, ``Config.first_bucket_mb``) is the latter. The small first bucket starts
the all-reduce of the gradients ready first while the backward pass runs. Where ranks share few
cores that early all-reduce takes CPU from the backward instead: measured step by step in one
job (CNN, P = 4, 2 cores), the engine's dense plan ran 0.93–0.97× DDP's step rate with DDP's
two buckets and 1.00–1.03× with one on loopback, 0.94–0.97× and 0.93–0.96× at 1 Gbit/s
(docs/results/speed.md, "DDP's buckets").
"""

from __future__ import annotations

__all__ = ["DDP_FIRST_BUCKET_BYTES", "bucket_bytes_of", "fixed_buckets"]

DDP_FIRST_BUCKET_BYTES = 1024 * 1024  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES


def bucket_bytes_of(mb: float | None) -> int | None:
    """A bucket limit in MiB (``Config.bucket_mb``, ``--bucket-mb``) as bytes, at least 1;
    ``None`` stays ``None`` (the first bucket's limit that follows the others)."""
    return None if mb is None else max(1, int(mb * 2**20))


def fixed_buckets(
    names: list[str], numel: dict[str, int], elem_bytes: int, bucket_bytes: int,
    first_bucket_bytes: int | None = None,
) -> list[list[str]]:
    """Contiguous groups of ``names`` (backward order), DDP's buckets: the first closes once it
    holds ``first_bucket_bytes`` bytes or more (None: ``bucket_bytes``), every later one at
    ``bucket_bytes``."""
    if first_bucket_bytes is None:
        first_bucket_bytes = bucket_bytes
    if bucket_bytes <= 0 or first_bucket_bytes <= 0:
        raise ValueError(f"bucket limits must be > 0, got first_bucket_bytes="
                         f"{first_bucket_bytes}, bucket_bytes={bucket_bytes}")
    groups: list[list[str]] = []
    cur: list[str] = []
    size = 0
    for n in names:
        cur.append(n)
        size += numel[n] * elem_bytes
        if size >= (bucket_bytes if groups else first_bucket_bytes):
            groups.append(cur)
            cur, size = [], 0
    if cur:
        groups.append(cur)
    return groups
