"""TAGC for FSDP2: a compressed reduce-scatter installed into ``fully_shard`` (TAGC §3).

TAGC §3.1 / Algorithm 1 ("THLC communication hook"), run by every rank for each FSDP unit:

    1  g_shard ← g_shard + acc                       # local accumulation (§3.2)       here
    2  g_shard, acc_next ← sparsify(g_shard, θ)      # zero a fraction θ of the values  here
    3  local_index ← create_index(g_shard)           # ┐
    4  index ← All-Reduce(local_index)               # │ gradsync.collectives.tagc:
    5  local_count_sketch ← compress(g_shard, index) # │ OR and SUM reduce-scatters,
    6  Reduce(local_count_sketch, d)                 # │ peeling on the owner
    10 g ← peeling_decompress(index, count_sketch)   # ┘

FSDP2 hands its reduce-scatter the flat ``P × S`` buffer (chunk ``j`` holds this rank's
gradient of the shard rank ``j`` owns, every parameter of the unit padded along dim 0) and
expects this rank's shard ``S`` back. :class:`_TAGCReduceScatter` replaces that call through
``FSDPModule.set_custom_reduce_scatter``: for each destination chunk ``j`` it adds the
accumulator ``acc`` (what θ zeroed last step) and keeps the ``round((1 − θ)·S)`` largest
magnitudes (``sparsify.get("fraction")``);
:func:`gradsync.collectives.tagc.compressed_reduce_scatter` then reduce-scatters the chunks'
bit indices (OR) and count sketches (SUM) and peels this rank's shard, which is written into
FSDP's output. ``TAGCConfig.index_method`` picks how the
index OR travels (``"auto"``: bitwise-OR reduce-scatter on gloo, a pairwise bitmap exchange
elsewhere, summed 4-bit counters for ``index_bits=4``; table in that module).

Selective compression (§3.2): ``TAGCConfig.policy(module_name, module)`` decides per module;
inside one FSDP unit the parameters of compressed modules travel as above and the others in a
plain reduce-scatter, so a transformer block wrapped as one unit sends its q/k/v projection and
norms uncompressed and its MLP and attention output projection compressed. The default
:func:`non_attention_linear` is the paper's "non-attention linear layers": feed-forward linears,
embeddings, the LM head and the attention output projection, with linear layers recognised by
duck typing (:func:`linear_like`: ``nn.Linear``, Hugging Face's ``Conv1D`` in GPT-2, other
modules with ``in_features``/``out_features``). :func:`compressed_share` reports the fraction of
a model's parameters a policy compresses.

θ = 0 means "no sparsification": the compressed path then carries the raw gradients and is exact
whenever the union of the ranks' nonzeros is peelable (density below ≈ 0.82/ratio — sparse
gradients such as embedding rows of unused tokens); dense gradients need θ > 0 (TAGC Table 1:
80% zeros at 2x, 90% at 4x, 98.75% at 10x). A failed peel is reported (``TAGC.stats()``) or, with
``on_failure="raise"``, raised on every rank (one 8-byte all-reduce of the lossy flag per unit
call keeps the ranks in step, so none is left waiting in a collective).

Reduction: :func:`compress` calls ``set_force_sum_reduction_for_comms(True)`` so FSDP passes
``ReduceOp.SUM`` and divides by P itself afterwards (verified against torch 2.13's
``foreach_reduce``; docs/architecture.md, "torch.distributed facts"); ``ReduceOp.AVG`` is still
accepted (the owner divides explicitly). Sketch and decoding are fp32 whatever the gradient
dtype (so bf16/fp16 gradients send fp32 sketches). Traffic goes only through
:class:`gradsync.collectives.comm.Comm`, so bytes are counted at the torch.distributed call.
The FSDP1 (``FullyShardedDataParallel``) path is not implemented.

:class:`TAGC` implements :class:`gradsync.engine.state.Stateful` (identity ``"tagc"``): its
per-rank accumulators go into checkpoints with the rank, world size and configuration they
depend on.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

from gradsync import sparsify
from gradsync.collectives.comm import Comm
from gradsync.collectives.lhc import INDEX_METHODS
from gradsync.collectives.tagc import agree_lossless, compressed_reduce_scatter
from gradsync.engine.consistency import signature_check
from gradsync.engine.state import Identity, check_identity
from gradsync.formats.sketch import CountSketch

__all__ = ["TAGC", "TAGCConfig", "all_layers", "compress", "compressed_parameters",
           "compressed_share", "linear_like", "non_attention_linear"]

RATIOS = (2, 4, 10)  # TAGC compression levels (Table 1)
INDEX_BITS = (1, 4)

# Leaf names of attention *input* projections (q, k, v and their fused forms).
_ATTN_INPUT = re.compile(
    r"(^|_)(q|k|v|qk|kv|qkv|wq|wk|wv|wqkv|query|key|value|c_attn|in_proj)(_proj|_linear)?$"
)


def linear_like(module: nn.Module) -> bool:
    """Whether ``module`` is a dense linear layer, recognised by duck typing.

    True for ``nn.Linear`` and its subclasses; for Hugging Face's
    ``transformers.pytorch_utils.Conv1D`` (GPT-2's ``c_attn``, ``c_proj``, ``c_fc``: a linear
    layer whose weight is stored transposed, ``(in, out)``), recognised by its class name so that
    transformers is never imported here; and for any other module that carries
    ``in_features``/``out_features`` and a 2-D ``weight`` (quantised or adapter linears). Its own
    parameters must be that 2-D ``weight`` and at most a 1-D ``bias``; embeddings, norms and
    convolutions (3-D or 4-D weights) are not linear-like.
    """
    if isinstance(module, nn.Linear):
        return True
    own = dict(module.named_parameters(recurse=False))
    weight = own.pop("weight", None)
    bias = own.pop("bias", None)
    if own or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return False
    if bias is not None and bias.dim() != 1:
        return False
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):  # transformers' Conv1D
        return True
    return isinstance(getattr(module, "in_features", None), int) and isinstance(
        getattr(module, "out_features", None), int)


def non_attention_linear(name: str, module: nn.Module) -> bool:
    """TAGC §3.2 default policy: compress non-attention linear layers.

    True for ``nn.Embedding`` (token/position embeddings) and for every linear-like module
    (:func:`linear_like`: ``nn.Linear``, Hugging Face ``Conv1D``, other linears by duck typing)
    except the attention input projections (leaf names like ``q``, ``k_proj``, ``attn_qkv``,
    ``c_attn``, ``query_key_value``): feed-forward linears (GPT-2's ``mlp.c_fc`` and
    ``mlp.c_proj``), the LM head and the attention output projection (``attn.c_proj``,
    ``out_proj``) are compressed. Norms, the fused ``in_proj_weight`` of
    ``nn.MultiheadAttention`` and any other module are sent uncompressed.
    :func:`compressed_share` says what fraction of a model this selects.
    """
    if isinstance(module, nn.Embedding):
        return True
    if linear_like(module):
        leaf = name.rsplit(".", 1)[-1].lower()
        return not (_ATTN_INPUT.search(leaf) or leaf.endswith("query_key_value"))
    return False


def compressed_parameters(model: nn.Module,
                          policy: Callable[[str, nn.Module], bool] | None = None) -> list[str]:
    """Names of the trainable parameters ``policy`` (default :func:`non_attention_linear`)
    compresses: those whose owning module it selects, as :func:`compress` decides per unit.

    A parameter shared by several modules (tied embeddings) counts once, under its first
    owner in ``model.named_modules()`` order.
    """
    policy = policy or non_attention_linear
    seen: set[int] = set()
    out = []
    for mname, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            if bool(policy(mname, module)):
                out.append(f"{mname}.{pname}" if mname else pname)
    return out


def compressed_share(model: nn.Module,
                     policy: Callable[[str, nn.Module], bool] | None = None) -> float:
    """Fraction of ``model``'s trainable parameter elements that ``policy`` (default
    :func:`non_attention_linear`) compresses, in [0, 1] (shared parameters counted once).

    TAGC §3.2 compresses the non-attention linear layers, most of a transformer's parameters;
    a low share means the policy misses the model's layers.
    """
    chosen = set(compressed_parameters(model, policy))
    total = comp = 0
    seen: set[int] = set()
    for mname, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            total += p.numel()
            if (f"{mname}.{pname}" if mname else pname) in chosen:
                comp += p.numel()
    return comp / total if total else 0.0


def all_layers(name: str, module: nn.Module) -> bool:
    """Policy that compresses every parameter ("TAGC, all layers" in Table 2)."""
    return True


@dataclass(frozen=True)
class TAGCConfig:
    """TAGC hyper-parameters, validated at construction (``ValueError``).

    ``ratio``: sketch compression level, 2, 4 or 10; ``index_bits``: 1 (bitmap, OR-reduced) or
    4 (counters, summed; P ≤ 15); ``theta``: fraction θ ∈ [0, 1) of each shard's values zeroed
    (and accumulated locally) before compression, 0 = no sparsification; ``policy``:
    ``(module_name, module) -> bool``, which modules' parameters are compressed;
    ``on_failure``: "report" (estimate unpeeled values, count them) or "raise";
    ``seed``: hash seed of the count sketches (identical on every rank);
    ``index_method``: how the bit index is OR-aggregated, ``"auto"`` or one of
    ``"bor"``, ``"gather"``, ``"max"``, ``"count4"`` (:mod:`gradsync.collectives.tagc`).
    """

    ratio: int = 10
    index_bits: int = 1
    theta: float = 0.99
    policy: Callable[[str, nn.Module], bool] = non_attention_linear
    on_failure: str = "report"
    seed: int = 0
    index_method: str = "auto"

    def __post_init__(self) -> None:
        if isinstance(self.ratio, bool) or self.ratio not in RATIOS:
            raise ValueError(f"ratio must be one of {RATIOS}, got {self.ratio!r}")
        if isinstance(self.index_bits, bool) or self.index_bits not in INDEX_BITS:
            raise ValueError(f"index_bits must be one of {INDEX_BITS}, got {self.index_bits!r}")
        try:
            theta = float(self.theta)
        except (TypeError, ValueError):
            raise ValueError(f"theta must be a number in [0, 1), got {self.theta!r}") from None
        if math.isnan(theta) or not 0.0 <= theta < 1.0:
            raise ValueError(f"theta must be in [0, 1), got {self.theta!r}")
        object.__setattr__(self, "theta", theta)
        if not callable(self.policy):
            raise ValueError(f"policy must be callable (name, module) -> bool, "
                             f"got {type(self.policy).__name__}")
        if self.on_failure not in ("report", "raise"):
            raise ValueError(f"on_failure must be 'report' or 'raise', got {self.on_failure!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {self.seed!r}")
        if self.index_method not in INDEX_METHODS:
            raise ValueError(f"index_method must be one of {INDEX_METHODS}, "
                             f"got {self.index_method!r}")


@dataclass
class UnitStats:
    """Traffic and peeling outcome of one FSDP unit on this rank (cumulative)."""

    calls: int = 0
    bytes_sent: int = 0
    bytes_recv: int = 0
    plain_bytes: int = 0  # bytes sent in the uncompressed reduce-scatter
    index_bytes: int = 0  # bytes sent for the OR of the bit index
    sketch_bytes: int = 0  # bytes sent in the sketch reduce-scatter
    lossy_peels: int = 0  # peels of shards this rank owns that were lossy
    unresolved: int = 0  # nonzeros those peels could not resolve (estimated instead)
    union_nnz: int = 0  # Σ nonzeros of the OR index of this rank's shards
    seconds: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


@dataclass
class _Unit:
    """One FSDP unit: its layout inside a shard chunk and its TAGC state on this rank."""

    name: str
    module: FSDPModule
    shard_numel: int  # S: elements per shard chunk (padded), as FSDP lays them out
    compressed_params: list[str]
    plain_params: list[str]
    comp_idx: torch.Tensor | None  # positions in the chunk that are compressed (None: all)
    plain_idx: torch.Tensor | None  # positions sent uncompressed (None: all)
    n_comp: int
    n_plain: int
    prev_force_sum: bool = False  # FSDP's setting before compress(), restored by remove()
    sketch: CountSketch | None = None
    acc: torch.Tensor | None = None  # (P, n_comp): what θ zeroed, per destination chunk
    stats: UnitStats = field(default_factory=UnitStats)

    @property
    def compressed(self) -> bool:
        return self.n_comp > 0


def _fsdp_param_group(module: FSDPModule):
    """The single FSDPParamGroup of ``module`` (None when it manages no parameters).

    torch 2.13 keeps a list (``_fsdp_param_groups``); torch 2.11 (the CUDA image
    ``make gpu-check`` has run on) one group or None (``_fsdp_param_group``)."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        single = state._fsdp_param_group
        groups = [] if single is None else [single]
    if len(groups) > 1:
        raise ValueError("TAGC: FSDP units with several parameter groups (per-parameter "
                         "meshes) are not supported by set_custom_reduce_scatter")
    return groups[0] if groups else None


def _positions(segments: list[tuple[int, int]], device: torch.device) -> torch.Tensor:
    if not segments:
        return torch.empty(0, dtype=torch.int64, device=device)
    return torch.cat([torch.arange(a, a + n, dtype=torch.int64, device=device)
                      for a, n in segments])


# Configuration a checkpoint's accumulators depend on (checked when loading).
_TRAJECTORY_FIELDS = ("theta", "ratio", "index_bits", "seed")


class TAGC:
    """TAGC installed on the FSDP2 units of a model; build it with :func:`compress`."""

    def __init__(self, model: nn.Module, config: TAGCConfig) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"gradsync.fsdp.compress takes the fully_shard-ed nn.Module, got "
                            f"{type(model).__name__}")
        if not isinstance(config, TAGCConfig):
            raise TypeError(f"gradsync.fsdp.compress takes a gradsync.fsdp.TAGCConfig, e.g. "
                            f"TAGCConfig(ratio=10), got {type(config).__name__}")
        self.config = config
        self.model = model
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        counters = config.index_method == "count4" or (
            config.index_bits == 4 and config.index_method == "auto")
        if counters and self.world_size > 15:
            raise ValueError(f"index_bits=4 sums 4-bit counters, exact only for P <= 15; "
                             f"this job has P = {self.world_size} (use index_bits=1)")
        self._sparsifier = None
        if config.theta > 0:  # TAGC §3.2: at least θ of each chunk's values become zero
            self._sparsifier = sparsify.get(
                "fraction", theta=config.theta,
                seed=sparsify.seed_for(config.seed, "tagc", self.rank))
        self.units: dict[str, _Unit] = {}
        self._comms: dict[str, _TAGCReduceScatter] = {}
        names = {id(m): n for n, m in model.named_modules()}
        fsdp_modules = [(n, m) for n, m in model.named_modules() if isinstance(m, FSDPModule)]
        if not fsdp_modules:
            raise ValueError("gradsync.fsdp.compress: the model has no fully_shard-ed (FSDP2) "
                             "module; call torch.distributed.fsdp.fully_shard on its blocks and "
                             "then on the model (after init_process_group), then compress it")
        for i, (mname, m) in enumerate(fsdp_modules):
            group = _fsdp_param_group(m)
            if group is None:
                continue
            unit = self._layout(mname or "root", m, group, names, i)
            unit.prev_force_sum = bool(getattr(group, "force_sum_reduction_for_comms", False))
            self.units[unit.name] = unit
        # Every rank must hash, sparsify and split identically, or each owner peels garbage
        # (a seed mismatch) or the collectives mismatch: agree before touching the model.
        if self.world_size > 1:
            signature_check(self._signature())
        for unit in self.units.values():
            self._comms[unit.name] = _TAGCReduceScatter(self, unit)
            unit.module.set_force_sum_reduction_for_comms(True)
            unit.module.set_custom_reduce_scatter(self._comms[unit.name])

    def _signature(self) -> dict:
        c = self.config
        policy = getattr(c.policy, "__qualname__", repr(c.policy))
        return {
            "ratio": c.ratio, "index_bits": c.index_bits, "theta": c.theta,
            "on_failure": c.on_failure, "seed": c.seed, "policy": policy,
            "index_method": c.index_method,
            "units": [(u.name, u.shard_numel, u.compressed_params, u.plain_params)
                      for u in self.units.values()],
        }

    def _layout(self, uname: str, m: FSDPModule, group, names: dict[int, str],
                i: int) -> _Unit:
        comp_seg: list[tuple[int, int]] = []
        plain_seg: list[tuple[int, int]] = []
        comp_names: list[str] = []
        plain_names: list[str] = []
        offset = 0
        device = None
        for fp in group.fsdp_params:
            if not fp.sharded_param.requires_grad:
                continue  # FSDP never reduce-scatters a frozen parameter
            info = fp._module_info
            owner = info.module
            owner_name = names.get(id(owner), type(owner).__name__)
            numel = fp.padded_sharded_param_size.numel()
            pname = f"{owner_name}.{info.param_name}" if owner_name else info.param_name
            device = fp.sharded_param.device
            if bool(self.config.policy(owner_name, owner)):
                comp_seg.append((offset, numel))
                comp_names.append(pname)
            else:
                plain_seg.append((offset, numel))
                plain_names.append(pname)
            offset += numel
        device = device or torch.device("cpu")
        n_comp = sum(n for _, n in comp_seg)
        n_plain = sum(n for _, n in plain_seg)
        unit = _Unit(
            name=uname, module=m, shard_numel=offset, compressed_params=comp_names,
            plain_params=plain_names,
            comp_idx=None if n_plain == 0 else _positions(comp_seg, device),
            plain_idx=None if n_comp == 0 else _positions(plain_seg, device),
            n_comp=n_comp, n_plain=n_plain,
        )
        if n_comp:
            unit.sketch = CountSketch(n_comp, self.config.ratio, seed=self.config.seed + i,
                                      device=device)
        return unit

    # -- reporting --------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """This rank's traffic and peeling outcome since the last :meth:`reset_stats`.

        ``steps`` is the largest number of reduce-scatter calls of any unit (one per
        backward that reduces gradients); ``bytes_sent_per_step`` the total sent bytes divided
        by it. Lossy peels and unresolved nonzeros count the shards this rank owns.
        """
        units = {n: u.stats.as_dict() for n, u in self.units.items()}
        steps = max((u.stats.calls for u in self.units.values()), default=0)
        tot = {k: sum(u.stats.as_dict()[k] for u in self.units.values())
               for k in UnitStats().as_dict()}
        per = max(steps, 1)
        return {
            "steps": steps,
            "bytes_sent": tot["bytes_sent"], "bytes_recv": tot["bytes_recv"],
            "bytes_sent_per_step": tot["bytes_sent"] / per,
            "bytes_recv_per_step": tot["bytes_recv"] / per,
            "plain_bytes_per_step": tot["plain_bytes"] / per,
            "index_bytes_per_step": tot["index_bytes"] / per,
            "sketch_bytes_per_step": tot["sketch_bytes"] / per,
            "lossy_peels": tot["lossy_peels"], "unresolved": tot["unresolved"],
            "seconds_per_step": tot["seconds"] / per,
            "units": units,
        }

    def reset_stats(self) -> None:
        for u in self.units.values():
            u.stats = UnitStats()

    def reduce_scatter(self, unit: str) -> ReduceScatter:
        """The ReduceScatter installed on ``unit`` (what FSDP calls for it)."""
        if unit not in self.units:
            raise ValueError(f"unknown unit {unit!r}; units: {sorted(self.units)}")
        return self._comms[unit]

    def plan(self) -> dict[str, dict[str, list[str]]]:
        """Per unit: which parameters travel compressed and which uncompressed."""
        return {n: {"compressed": list(u.compressed_params), "plain": list(u.plain_params)}
                for n, u in self.units.items()}

    # -- checkpointing (gradsync.engine.state.Stateful) ---------------------------------
    def identity(self) -> Identity:
        """``"tagc"``, this rank, the world size (TAGC runs over the default group)."""
        return Identity("tagc", self.rank, self.world_size)

    def _plan_state(self) -> dict[str, list[str]]:
        return {n: list(u.compressed_params) for n, u in self.units.items()}

    def state_dict(self) -> dict[str, Any]:
        """This rank's accumulators under per-rank keys ``rank{r}/{unit}``, with the rank,
        world size, trajectory configuration (θ, ratio, index width, sketch seed) and the
        compressed parameters of each unit they belong to.

        ``torch.distributed.checkpoint`` de-duplicates equal keys across ranks; the rank in
        the key keeps every rank's residual.
        """
        return {
            "rank": self.rank, "world_size": self.world_size,
            "config": {k: getattr(self.config, k) for k in _TRAJECTORY_FIELDS},
            "plan": self._plan_state(),
            "accumulators": {f"rank{self.rank}/{n}": u.acc.clone()
                             for n, u in self.units.items() if u.acc is not None},
        }

    def check_compatible(self, state: dict[str, Any]) -> None:
        """Raise ``ValueError`` unless ``state`` was saved by this rank of a job with the same
        world size, TAGC configuration (the accumulators mean something else otherwise) and
        units; changes nothing."""
        check_identity(state, self.identity(), "TAGC")
        saved = state.get("config")
        if not isinstance(saved, dict):
            raise ValueError("not a TAGC state_dict (no config entry)")
        for k in _TRAJECTORY_FIELDS:
            if saved.get(k) != getattr(self.config, k):
                raise ValueError(f"TAGC state was saved with {k}={saved.get(k)!r}, this "
                                 f"TAGCConfig has {k}={getattr(self.config, k)!r}")
        plan = self._plan_state()
        if state.get("plan") != plan:
            raise ValueError(f"TAGC state was saved for other units or another policy: saved "
                             f"{state.get('plan')}, here {plan}")
        prefix = f"rank{self.rank}/"
        accs = state.get("accumulators", {})
        unknown = [k for k in accs if not k.startswith(prefix)
                   or k[len(prefix):] not in self.units]
        if unknown:
            raise ValueError(f"TAGC state holds accumulators {unknown} that are not this "
                             f"rank's units")
        for k, t in accs.items():
            want = (self.world_size, self.units[k[len(prefix):]].n_comp)
            if tuple(t.shape) != want:
                raise ValueError(f"TAGC accumulator {k} has shape {tuple(t.shape)}, "
                                 f"expected {want}")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` after :meth:`check_compatible` (nothing changes when
        it raises)."""
        self.check_compatible(state)
        accs = state.get("accumulators", {})
        for n, u in self.units.items():
            t = accs.get(f"rank{self.rank}/{n}")
            u.acc = None if t is None else t.detach().clone()

    def remove(self) -> None:
        """Give every unit FSDP's default reduce-scatter back (accumulators are dropped)."""
        for u in self.units.values():
            u.module.set_custom_reduce_scatter(DefaultReduceScatter())
            u.module.set_force_sum_reduction_for_comms(u.prev_force_sum)
            u.acc = None


def compress(model: nn.Module, config: TAGCConfig | None = None) -> TAGC:
    """Install TAGC on every FSDP2 unit of ``model`` (call after ``fully_shard``)."""
    return TAGC(model, config if config is not None else TAGCConfig())


class _TAGCReduceScatter(ReduceScatter):
    """FSDP2 reduce-scatter of one unit: plain part + TAGC Algorithm 1 for the rest."""

    def __init__(self, tagc: TAGC, unit: _Unit) -> None:
        self.tagc = tagc
        self.unit = unit

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op=dist.ReduceOp.SUM,
                 async_op: bool = False) -> None:
        t0 = time.perf_counter()
        u = self.unit
        comm = Comm(group)
        P, S = comm.size, output_tensor.numel()
        if op == dist.ReduceOp.SUM:
            average = False
        elif op == dist.ReduceOp.AVG:
            average = True
        else:
            raise ValueError(f"TAGC reduce-scatter supports SUM and AVG, got {op!r} "
                             "(do not combine with set_gradient_divide_factor)")
        if input_tensor.numel() != P * S or u.shard_numel != S:
            raise ValueError(
                f"TAGC unit {u.name!r}: reduce-scatter of {input_tensor.numel()} -> {S} "
                f"elements does not match its layout ({P} x {u.shard_numel}); a parameter "
                "without a gradient changes FSDP's buffer layout — use "
                "set_reduce_scatter_unused_params(True) for conditionally used parameters")
        x = input_tensor.view(P, S)
        out = output_tensor.view(-1)
        st = u.stats
        if u.n_plain:
            xp = x if u.plain_idx is None else x.index_select(1, u.plain_idx)
            yp = out if u.plain_idx is None else out.new_empty(u.n_plain)
            before = comm.stats.bytes_sent
            comm.reduce_scatter(yp, xp.reshape(-1))
            st.plain_bytes += comm.stats.bytes_sent - before
            if u.plain_idx is not None:
                out[u.plain_idx] = yp  # index_put_: deterministic on CUDA, index_copy_ not
        if u.n_comp:
            xc = x if u.comp_idx is None else x.index_select(1, u.comp_idx)
            yc = self._compressed(xc, comm)
            if u.comp_idx is None:
                out.copy_(yc)
            else:
                out[u.comp_idx] = yc.to(out.dtype)
        if average:
            out.div_(P)
        st.calls += 1
        st.bytes_sent += comm.stats.bytes_sent
        st.bytes_recv += comm.stats.bytes_recv
        st.seconds += time.perf_counter() - t0
        return None

    # -- TAGC Algorithm 1 for the compressed part of the unit -----------------------------
    def _compressed(self, g: torch.Tensor, comm: Comm) -> torch.Tensor:
        """(P, n) chunks of this rank -> this rank's shard of the SUM over ranks, (n,)."""
        cfg, u = self.tagc.config, self.unit
        # 1: g ← g + acc (local accumulation of what θ zeroed before)
        if u.acc is not None:
            g = g + u.acc.to(g.dtype)
        # 2: g, acc_next ← sparsify(g, θ), per destination chunk (each owner's shard)
        spars = self.tagc._sparsifier
        if spars is not None:
            q = torch.zeros_like(g)
            # the P chunks with one finiteness read (on a GPU: one wait instead of P)
            for j, sel in enumerate(sparsify.select_each([(spars, g[c])
                                                          for c in range(g.shape[0])])):
                q[j, sel.indices] = sel.values
            u.acc = g - q  # exact: selected entries leave 0, the rest stay
        else:
            q = g
        # 3-10: OR index and sketch reduce-scatters, peeling of this rank's shard
        res = compressed_reduce_scatter(q, u.sketch, comm, index_bits=cfg.index_bits,
                                        index_method=cfg.index_method)
        st = u.stats
        st.index_bytes += res.index_bytes
        st.sketch_bytes += res.sketch_bytes
        st.union_nnz += res.union_nnz
        if res.report.lossy:
            st.lossy_peels += 1
            st.unresolved += res.report.unresolved
        if cfg.on_failure == "raise":
            agree_lossless(res.report, comm, g.device, f"TAGC unit {u.name!r}")
        return res.values
