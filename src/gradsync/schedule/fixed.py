"""Fixed-size buckets in backward order: PyTorch DDP's bucketing (Dense, DenseOvlp, and the
fusion of per-tensor sparsification when no cost model is available).

A bucket collects consecutive gradients (backward order) while its size stays within
``bucket_bytes``; a gradient larger than the cap gets a bucket of its own.
"""

from __future__ import annotations

__all__ = ["fixed_buckets"]


def fixed_buckets(
    names: list[str], numel: dict[str, int], elem_bytes: int, bucket_bytes: int
) -> list[list[str]]:
    """Contiguous groups of ``names`` with at most ``bucket_bytes`` bytes each (unless a single
    tensor is larger than the cap)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    groups: list[list[str]] = []
    cur: list[str] = []
    size = 0
    for n in names:
        b = numel[n] * elem_bytes
        if cur and size + b > bucket_bytes:
            groups.append(cur)
            cur, size = [], 0
        cur.append(n)
        size += b
    if cur:
        groups.append(cur)
    return groups
