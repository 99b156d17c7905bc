"""Replica consistency and configuration agreement across ranks.

``check_consistency(model, group)`` hashes every parameter's bytes on each rank, all-gathers the
hashes (32 bytes per rank) and raises :class:`ReplicaDivergence` naming the ranks and the first
diverging parameter when they differ. ``signature_check(sig, group)`` all-gathers a small
description of the configuration and model (scheme, density, parameter names and shapes) at
engine construction and raises ``ValueError`` naming the difference, so mismatched ranks fail
at once instead of hanging in a collective later. ``broadcast_states(model, group)`` copies the
source rank's parameters and buffers to every rank (what ``DistributedDataParallel`` does at
construction), so replicas start bit-identical.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradsync.collectives.comm import Comm, CommStats, exchange_objects

__all__ = ["ReplicaDivergence", "broadcast_states", "check_consistency", "check_same_tensors",
           "parameter_digest", "signature_check", "state_signature"]

# Largest flat buffer one broadcast moves (DDP coalesces its initial broadcast the same way).
_BROADCAST_BUCKET_BYTES = 64 * 1024 * 1024


class ReplicaDivergence(RuntimeError):
    """Parameters differ across ranks."""


def _tensor_digest(t: torch.Tensor) -> bytes:
    data = t.detach().to("cpu").contiguous().reshape(-1)
    if data.dtype in (torch.bfloat16, torch.float16):
        data = data.view(torch.int16)
    return hashlib.sha256(data.numpy().tobytes()).digest()


def _digests(named: Sequence[tuple[str, torch.Tensor]]) -> tuple[bytes, list[tuple[str, bytes]]]:
    """SHA-256 over every tensor (and per tensor), bit-exact, names included."""
    per = [(n, _tensor_digest(t)) for n, t in named]
    h = hashlib.sha256()
    for n, d in per:
        h.update(n.encode())
        h.update(d)
    return h.digest(), per


def parameter_digest(model: nn.Module) -> tuple[bytes, list[tuple[str, bytes]]]:
    """SHA-256 over all parameters (and per parameter), bit-exact."""
    return _digests(list(model.named_parameters()))


def _divergence(named: Sequence[tuple[str, torch.Tensor]], group: dist.ProcessGroup | None
                ) -> tuple[list[int], str] | None:
    """None when every rank holds bit-identical ``named`` tensors; else the ranks that differ
    from rank 0 and the first differing name (one more small gather per name)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return None
    total, per = _digests(named)
    # the count travels too: the per-name gathers below must run as often on every rank
    digests = exchange_objects(total + len(per).to_bytes(8, "little"), group)
    if len(set(digests)) == 1:
        return None
    bad = [r for r, d in enumerate(digests) if d != digests[0]]
    if len({d[-8:] for d in digests}) > 1:
        return bad, "the ranks pass different numbers of tensors"
    first = "?"
    for name, d in per:
        if len(set(exchange_objects(d, group))) > 1:
            first = name
            break
    return bad, first


def check_consistency(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Raise :class:`ReplicaDivergence` unless every rank holds bit-identical parameters."""
    found = _divergence(list(model.named_parameters()), group)
    if found is not None:
        raise ReplicaDivergence(
            f"parameters differ across ranks: ranks {found[0]} disagree with rank 0 "
            f"(first diverging parameter: {found[1]})"
        )


def check_same_tensors(named: Sequence[tuple[str, torch.Tensor]], what: str,
                       group: dist.ProcessGroup | None = None) -> None:
    """``ValueError`` on every rank unless every rank passes bit-identical ``named`` tensors
    (same names, same order); ``what`` names them in the message."""
    found = _divergence(named, group)
    if found is not None:
        raise ValueError(f"{what} differ across ranks: ranks {found[0]} disagree with rank 0 "
                         f"(first: {found[1]})")


def signature_check(signature: Any, group: dist.ProcessGroup | None = None) -> None:
    """All ranks must pass equal ``signature`` objects; otherwise raise ``ValueError``."""
    sigs = exchange_objects(signature, group)  # also in the DDP hook's first call
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


def _module_states(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter (frozen ones too) and every buffer, each once, in module order."""
    return ([(f"param:{n}", p) for n, p in model.named_parameters()]
            + [(f"buffer:{n}", b) for n, b in model.named_buffers()])


def state_signature(model: nn.Module) -> list[tuple[str, tuple[int, ...], str]]:
    """Name, shape and dtype of every tensor :func:`broadcast_states` moves (for
    :func:`signature_check`: ranks whose tensors differ would otherwise hang in the broadcast)."""
    return [(n, tuple(t.shape), str(t.dtype)) for n, t in _module_states(model)]


def broadcast_states(model: nn.Module, group: dist.ProcessGroup | None = None,
                     src: int = 0) -> CommStats:
    """Overwrite every rank's parameters and buffers with group rank ``src``'s, in place.

    Tensors are flattened into buckets of one device and dtype (at most 64 MiB each) and each
    bucket is broadcast once, so a model costs a few collectives, not one per tensor. Every
    rank of ``group`` must call it with the same model structure (check with
    :func:`state_signature` first). Returns the traffic, counted by :class:`Comm`.
    """
    comm = Comm(group)
    if comm.size == 1:
        return comm.stats
    buckets: dict[tuple[torch.device, torch.dtype], list[list[torch.Tensor]]] = {}
    for _, t in _module_states(model):
        if t.numel() == 0:
            continue
        chunks = buckets.setdefault((t.device, t.dtype), [[]])
        used = sum(x.numel() for x in chunks[-1]) * t.element_size()
        if chunks[-1] and used + t.numel() * t.element_size() > _BROADCAST_BUCKET_BYTES:
            chunks.append([])
        chunks[-1].append(t)
    with torch.no_grad():
        for (_, dtype), chunks in buckets.items():
            for chunk in chunks:
                flat = torch.cat([t.detach().reshape(-1) for t in chunk])
                wire = flat.view(torch.uint8) if dtype == torch.bool else flat
                comm.broadcast(wire, src)
                offset = 0
                for t in chunk:
                    t.copy_(flat[offset:offset + t.numel()].view_as(t))
                    offset += t.numel()
    return comm.stats
