"""Replica consistency and configuration agreement across ranks.

``check_consistency(model, group)`` hashes every parameter's bytes on each rank, all-gathers the
hashes (32 bytes per rank) and raises :class:`ReplicaDivergence` naming the ranks and the first
diverging parameter when they differ. ``signature_check(sig, group)`` all-gathers a small
description of the configuration and model (scheme, density, parameter names and shapes) at
engine construction and raises ``ValueError`` naming the difference, so mismatched ranks fail
at once instead of hanging in a collective later.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["ReplicaDivergence", "check_consistency", "parameter_digest", "signature_check"]


class ReplicaDivergence(RuntimeError):
    """Parameters differ across ranks."""


def _tensor_digest(t: torch.Tensor) -> bytes:
    data = t.detach().to("cpu").contiguous().reshape(-1)
    if data.dtype in (torch.bfloat16, torch.float16):
        data = data.view(torch.int16)
    return hashlib.sha256(data.numpy().tobytes()).digest()


def parameter_digest(model: nn.Module) -> tuple[bytes, list[tuple[str, bytes]]]:
    """SHA-256 over all parameters (and per parameter), bit-exact."""
    per = [(n, _tensor_digest(p)) for n, p in model.named_parameters()]
    h = hashlib.sha256()
    for n, d in per:
        h.update(n.encode())
        h.update(d)
    return h.digest(), per


def _gather_bytes(blob: bytes, group: dist.ProcessGroup | None) -> list[bytes]:
    world = dist.get_world_size(group)
    t = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    out = torch.empty(world * t.numel(), dtype=torch.uint8)
    dist.all_gather_single(out, t, group=group)
    return [bytes(c.tolist()) for c in out.view(world, -1)]


def check_consistency(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Raise :class:`ReplicaDivergence` unless every rank holds bit-identical parameters."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return
    total, per = parameter_digest(model)
    digests = _gather_bytes(total, group)
    if len(set(digests)) == 1:
        return
    ref = digests[0]
    bad = [r for r, d in enumerate(digests) if d != ref]
    # find the first diverging parameter (one more small gather per parameter name)
    first = "?"
    for name, d in per:
        if len(set(_gather_bytes(d, group))) > 1:
            first = name
            break
    raise ReplicaDivergence(
        f"parameters differ across ranks: ranks {bad} disagree with rank 0 "
        f"(first diverging parameter: {first})"
    )


def signature_check(signature: Any, group: dist.ProcessGroup | None = None) -> None:
    """All ranks must pass equal ``signature`` objects; otherwise raise ``ValueError``."""
    world = dist.get_world_size(group)
    sigs: list[Any] = [None] * world
    dist.all_gather_object(sigs, signature, group=group)
    mine = dist.get_rank(group)
    for r, s in enumerate(sigs):
        if s != sigs[0]:
            raise ValueError(
                f"ranks disagree on the gradsync set-up: rank {r} differs from rank 0 "
                f"(this is rank {mine}): {_describe(sigs[0], s)}"
            )


def _describe(a: Any, b: Any) -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                return f"{k}: {_describe(a.get(k), b.get(k))}"
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        if len(a) != len(b):
            return f"{len(a)} entries vs {len(b)}"
        for x, y in zip(a, b):
            if x != y:
                return f"{x!r} vs {y!r}"
    return f"{a!r} vs {b!r}"
