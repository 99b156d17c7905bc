"""Checkpoint and resume of a compressed data-parallel job: model, optimizer and sync state.

What makes these checkpoints special is the synchronization state: error-feedback residuals
(and DGC velocities), sparsifier generators and TAGC accumulators are *per rank* — every rank
keeps what *it* did not send — while model and optimizer are replicated (DDP-style engine) or
sharded (FSDP2). Resuming must give every rank back its own residuals, or the mass they hold
is lost or sent twice and the trajectory changes.

Two storage layouts, same contract (a resumed job continues bitwise like the uninterrupted one):

* :func:`save` / :func:`load`: plain ``torch.save``, one file per rank (``rank{r}.pt``) holding
  a header, the sync state, the model and optimizer ``state_dict`` s.
* :func:`save_dcp` / :func:`load_dcp`: ``torch.distributed.checkpoint`` (DCP). DCP
  de-duplicates entries with the same key across ranks — a plain tensor or object saved under
  one key by every rank is written once and every rank loads that one copy (verified against
  torch 2.13 in ``tests/test_checkpoint.py``). That is right for replicated model/optimizer
  state and wrong for residuals, so the sync state lives under ``gradsync/rank{r}/…`` keys:
  its tensors as tensors (``gradsync/rank{r}/t{i}``) and the rest of its structure as one
  pickled skeleton (``gradsync/rank{r}/skeleton``). Model and optimizer go through
  ``torch.distributed.checkpoint.state_dict`` (sharded DTensors for FSDP2).

``sync`` is any :class:`gradsync.engine.state.Stateful`: a :class:`gradsync.GradSync`, the
DDP hook's :class:`gradsync.ddp.HookState` or a :class:`gradsync.fsdp.TAGC`. Its ``identity()``
gives the header (kind — the scheme, ``"ddp_hook:<scheme>"`` or ``"tagc"`` — and world size),
the rank whose state a file holds and the process group DCP runs over. Loading checks, before
anything changes, that the checkpoint comes from the same kind, world size and model (parameter
names and shapes), that it holds this rank's state, and then asks ``sync.check_compatible`` about
its own state (configuration, rank); every mismatch raises ``ValueError`` naming the difference.
"""

from __future__ import annotations

import glob
import io
import os
from typing import Any

import torch
from torch import nn

from gradsync.engine.state import Identity, Stateful, check_identity

__all__ = ["load", "load_dcp", "save", "save_dcp"]

FORMAT = 2  # 2: the header names the Stateful's kind (1 named a scheme)


# ---------------------------------------------------------------------------------- identity
def _identity(sync: Stateful) -> Identity:
    if not isinstance(sync, Stateful):
        raise TypeError("sync= must be the object whose state is saved: a gradsync.GradSync, "
                        "the HookState gradsync.ddp.register returned, or the TAGC "
                        f"gradsync.fsdp.compress returned; got {type(sync).__name__}")
    return sync.identity()


def _model_signature(model: nn.Module | None) -> dict[str, list[int]] | None:
    if model is None:
        return None
    return {n: list(p.shape) for n, p in model.named_parameters()}  # DTensor: global shape


def _header(me: Identity, model: nn.Module | None, optimizer: Any) -> dict[str, Any]:
    """Identical on every rank (DCP stores it once): no rank in it."""
    return {"format": FORMAT, "kind": me.kind, "world_size": me.world_size,
            "model": _model_signature(model), "optimizer": optimizer is not None}


def _check_header(h: dict[str, Any], rank: int, me: Identity, model: nn.Module | None,
                  optimizer: Any) -> None:
    """The header against this job, then ``rank`` (whose state this rank's entry holds)."""
    if h.get("format") != FORMAT:
        raise ValueError(f"checkpoint format {h.get('format')!r} is not {FORMAT}")
    check_identity({"rank": rank, "world_size": h["world_size"]}, me, "checkpoint")
    if h["kind"] != me.kind:
        raise ValueError(f"checkpoint holds the state of {h['kind']!r}, this job runs "
                         f"{me.kind!r} (another scheme or integration)")
    mine = _model_signature(model)
    if model is not None:
        if h["model"] is None:
            raise ValueError("checkpoint holds no model state")
        if h["model"] != mine:
            saved = h["model"]
            diff = sorted(set(saved) ^ set(mine))[:5] or sorted(
                n for n in saved if saved[n] != mine[n])[:5]
            raise ValueError(f"checkpoint is for a different model (parameters {diff} differ)")
    if optimizer is not None and not h["optimizer"]:
        raise ValueError("checkpoint holds no optimizer state")


# ------------------------------------------------------------------------- plain torch.save
def _rank_file(path: str, rank: int) -> str:
    return os.path.join(path, f"rank{rank}.pt")


def save(path: str, *, sync: Stateful, model: nn.Module | None = None, optimizer: Any = None,
         extra: dict[str, Any] | None = None) -> str:
    """Write this rank's checkpoint to ``path/rank{r}.pt`` (every rank calls it)."""
    me = _identity(sync)
    rank = me.rank
    os.makedirs(path, exist_ok=True)
    blob = {"header": _header(me, model, optimizer), "rank": rank,
            "sync": sync.state_dict(),
            "model": model.state_dict() if model is not None else None,
            "optimizer": optimizer.state_dict() if optimizer is not None else None,
            "extra": extra or {}}
    f = _rank_file(path, rank)
    tmp = f + ".tmp"
    torch.save(blob, tmp)
    os.replace(tmp, f)  # a crash mid-write never leaves a truncated rank file behind
    return f


def load(path: str, *, sync: Stateful, model: nn.Module | None = None,
         optimizer: Any = None) -> dict[str, Any]:
    """Load this rank's file written by :func:`save`; returns its ``extra`` dict."""
    me = _identity(sync)
    world, rank = me.world_size, me.rank
    files = glob.glob(os.path.join(path, "rank*.pt"))
    if not files:
        raise ValueError(f"no checkpoint files rank*.pt in {path!r}")
    if len(files) != world or not os.path.exists(_rank_file(path, rank)):
        raise ValueError(f"checkpoint in {path!r} was saved by {len(files)} ranks, this job "
                         f"has {world}: residuals are per rank and cannot be re-sharded")
    blob = torch.load(_rank_file(path, rank), weights_only=False, map_location="cpu")
    _check_header(blob["header"], blob["rank"], me, model, optimizer)
    sync.check_compatible(blob["sync"])  # before the model and optimizer change
    if model is not None:
        model.load_state_dict(blob["model"])
    if optimizer is not None:
        optimizer.load_state_dict(blob["optimizer"])
    sync.load_state_dict(blob["sync"])
    return blob["extra"]


# -------------------------------------------------------------------------------------- DCP
class _Ref:
    """Placeholder of a tensor inside the pickled skeleton of a per-rank state."""

    def __init__(self, i: int, t: torch.Tensor) -> None:
        self.i, self.shape, self.dtype = i, tuple(t.shape), t.dtype

    def __eq__(self, other: object) -> bool:  # pragma: no cover - debugging aid
        return isinstance(other, _Ref) and (self.i, self.shape) == (other.i, other.shape)


def _split(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """Replace every tensor in ``obj`` by a :class:`_Ref`; collect the tensors in order."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj.detach().cpu().contiguous())
        return _Ref(len(tensors) - 1, obj)
    if isinstance(obj, dict):
        return {k: _split(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_split(v, tensors) for v in obj)
    return obj


def _join(obj: Any, tensors: dict[int, torch.Tensor]) -> Any:
    if isinstance(obj, _Ref):
        return tensors[obj.i]
    if isinstance(obj, dict):
        return {k: _join(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_join(v, tensors) for v in obj)
    return obj


def _refs(obj: Any) -> list[_Ref]:
    if isinstance(obj, _Ref):
        return [obj]
    if isinstance(obj, dict):
        return [r for v in obj.values() for r in _refs(v)]
    if isinstance(obj, list | tuple):
        return [r for v in obj for r in _refs(v)]
    return []


def _pickle(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _unpickle(b: Any) -> Any:
    if isinstance(b, bytes | bytearray):
        return torch.load(io.BytesIO(b), weights_only=False)
    return b


def save_dcp(path: str, *, sync: Stateful, model: nn.Module | None = None, optimizer: Any = None,
             extra: dict[str, Any] | None = None) -> None:
    """Save with ``torch.distributed.checkpoint`` (every rank calls it, collectively)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    me = _identity(sync)
    rank = me.rank
    if optimizer is not None and model is None:
        raise ValueError("save_dcp: an optimizer needs its model (for parameter names)")
    tensors: list[torch.Tensor] = []
    skeleton = _split({"sync": sync.state_dict(), "extra": extra or {}}, tensors)
    state: dict[str, Any] = {
        # identical on every rank: de-duplicated to one copy, which is what we want
        "gradsync/header": _pickle(_header(me, model, optimizer)),
        f"gradsync/rank{rank}/skeleton": _pickle({"rank": rank, "skeleton": skeleton}),
    }
    for i, t in enumerate(tensors):
        state[f"gradsync/rank{rank}/t{i}"] = t
    if model is not None:
        state["model"] = get_model_state_dict(model)
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    dcp.save(state, checkpoint_id=path, process_group=me.group)


def load_dcp(path: str, *, sync: Stateful, model: nn.Module | None = None,
             optimizer: Any = None) -> dict[str, Any]:
    """Load a :func:`save_dcp` checkpoint: this rank's own sync state, model and optimizer.

    Returns the ``extra`` dict this rank saved.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    me = _identity(sync)
    rank, group = me.rank, me.group
    if optimizer is not None and model is None:
        raise ValueError("load_dcp: an optimizer needs its model (for parameter names)")
    if not os.path.isdir(path):
        raise ValueError(f"no DCP checkpoint directory {path!r}")
    keys = set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
    if "gradsync/header" not in keys:
        raise ValueError(f"{path!r} is not a gradsync DCP checkpoint (no gradsync/header)")
    head = {"gradsync/header": b""}
    dcp.load(head, checkpoint_id=path, process_group=group)
    header = _unpickle(head["gradsync/header"])
    _check_header(header, rank, me, model, optimizer)
    own = f"gradsync/rank{rank}/skeleton"
    if own not in keys:  # defensive: the header's world size already matched
        raise ValueError(f"{path!r} holds no state for rank {rank}")
    sk = {own: b""}
    dcp.load(sk, checkpoint_id=path, process_group=group)
    got = _unpickle(sk[own])
    check_identity({"rank": got["rank"], "world_size": header["world_size"]}, me, "checkpoint")
    refs = _refs(got["skeleton"])
    state: dict[str, Any] = {f"gradsync/rank{rank}/t{r.i}": torch.empty(r.shape, dtype=r.dtype)
                             for r in refs}
    if model is not None:
        state["model"] = get_model_state_dict(model)
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    # check the sync state before the model or optimizer change (its tensors are not loaded
    # yet: meta tensors of their shapes and dtypes stand in for them)
    sync.check_compatible(_join(got["skeleton"], {
        r.i: torch.empty(r.shape, dtype=r.dtype, device="meta") for r in refs})["sync"])
    dcp.load(state, checkpoint_id=path, process_group=group)
    restored = _join(got["skeleton"],
                     {r.i: state[f"gradsync/rank{rank}/t{r.i}"] for r in refs})
    if model is not None:
        set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optimizer"])
    sync.load_state_dict(restored["sync"])
    return restored["extra"]
