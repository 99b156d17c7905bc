"""``python -m gradsync bench overhead``: the per-step tax of every scheme at world size 1.

``python -m gradsync bench overhead [--model resnet50,gpt2 | resnet50,mlp8,mlp64]
[--schemes ddp,ddp_powersgd,topka,…,hook:per_tensor,…] [--pairs 3] [--steps N]
[--warmup-steps W] [--device auto|cpu|cuda] [--time-limit S] [--code LABEL] [--out DIR]
[--write-docs]``

At P = 1 nothing travels, so whatever a scheme's step costs beyond torch DDP's is the scheme's
own work: sparsification, error feedback, encoding, bookkeeping, and on a GPU the kernel
launches and host synchronisations that come with it. Every scheme runs with compression on
(``Config.compress_single_rank=True`` where the option exists), density 0.01, the ``dgc``
sparsifier and momentum 0.9 (``--density``, ``--sparsifier``, ``--momentum``): the engine
schemes through :class:`gradsync.GradSync`, the DDP-hook schemes (``hook:<scheme>``, any of
``gradsync.ddp.DDP_SCHEMES``) through :func:`gradsync.ddp.register`, and as references torch
DDP (``ddp``) and torch's PowerSGD hook (``ddp_powersgd``, rank ``--powersgd-rank`` = 4,
compressing from the second step; on gloo waited for inside the hook call, as ``train`` does,
since gloo deadlocks on its callbacks otherwise).
Sparse schemes keep SGD's momentum in error feedback (DGC's momentum correction: the optimizer
is plain SGD); DDP, PowerSGD and the dense schemes run SGD with momentum 0.9, as ``train`` does.

Per model and scheme:

* **step time / DDP's**, in interleaved pairs: a DDP run, then the scheme's run, ``--pairs``
  times (3 by default), each run on a fresh copy of one model built from the seed (built once
  per model: GPT-2's initialisation alone takes seconds); a run's step time is the
  median of ``--steps`` steps after ``--warmup-steps`` + 2 unmeasured ones (the engine's
  ``Config.warmup_steps`` is ``--warmup-steps``, so its plan is fixed before timing; ``auto``
  may still be measuring its runners-up, shown as ``probing``). Reported: the median of the
  pair ratios and their range, and the **tax** = median over the pairs of (scheme − DDP) ms.
* **counts per step**, from ``torch.profiler`` over ``--count-steps`` steps of the first run
  (:func:`count_step`), on every thread of the process (the engine's communication and
  sparsification workers too, through the profiler's ``profile_all_threads`` option; a torch
  without it follows fewer threads, and ``all_threads`` in the JSON says which it was):

  - ``aten_ops``: every ``aten::`` op the dispatcher records, nested calls included (an
    ``aten::item`` counts with the ``aten::_local_scalar_dense`` it calls), and
    ``ops_beyond_ddp`` = the scheme's ``aten_ops`` − DDP's, with the op names that grew most;
  - ``host_reads``: reads of tensor values on the host, which on a GPU make the host wait
    for the device: the ops :data:`HOST_READ_OPS` — ``aten::_local_scalar_dense``
    (``.item()``, ``float(t)``, ``int(t)``…), ``aten::nonzero``, ``aten::masked_select``,
    ``aten::is_nonzero`` (``bool(t)``), ``aten::equal`` and every ``aten::unique*`` /
    ``aten::_unique*`` — and the copies to the host. On CUDA a listed op or an
    ``aten::copy_``/``_to_copy``/``to`` counts when a ``Memcpy DtoH`` ran under it (so reads
    of CPU tensors do not count; ``read_ops_any_device`` counts the listed ops whatever the
    device). On the CPU every listed op counts, and ``Tensor.tolist()`` and ``Tensor.numpy()``
    too (they dispatch no aten op: :func:`count_step` wraps them in a profiler range while it
    counts; ``tolist`` is a copy on a GPU, and gradsync's CPU path calls ``numpy`` where a
    GPU calls ``nonzero``, ``sparsegrad.flatnonzero``). A CPU count is therefore an upper
    bound on a GPU's: it includes reads of tensors that stay on the host there (e.g. DGC's
    sampling offset, drawn from a CPU generator). A read counts once: one inside another
    (the ``_local_scalar_dense`` of an ``is_nonzero``) is not counted again;
  - ``work_ops``: the ``aten::`` ops that do work at the bottom of the call tree: not a view,
    reshape, allocation or wrapper (``to``, ``contiguous``…), not a Python number's wrapping
    (``scalar_tensor``), and calling no op that does work (``aten::zeros`` does not count, the
    ``fill_`` it calls does). On a GPU each is about one kernel launch or copy, so on the CPU
    ``work_ops`` − DDP's (``work_beyond_ddp``) stands in for the launches a scheme adds; on
    CUDA both are counted, which calibrates the stand-in; ``buffers``: the engine's fusion
    buffers or the DDP hook's buckets per step, and ``work_per_buffer`` = ``work_beyond_ddp``
    / ``buffers`` (the GPU target: at most 40 launches per buffer beyond DDP's);
  - on CUDA also ``launches`` (``cudaLaunchKernel``-like runtime calls), ``syncs``
    (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``, ``cudaEventSynchronize`` and
    their driver-API names) and ``d2h_copies`` (``Memcpy DtoH`` device activities: a check
    on ``host_reads`` that does not depend on how the profiler attributes device work);
    and where the time goes: ``device_busy_ms``, the time the device's kernels and copies
    cover per counted step (several streams' overlaps once), and per scheme its growth over
    DDP's and the kernels that grew most (``top_device_ms_beyond_ddp``, ms per step). The
    tax minus that growth is time the device waited on the host (launches, syncs, Python):
    the profile the GPU-tax issue asks for where a scheme stays above 1.10× DDP's step.
* the **floor**: one read pass over the model's gradient, ``flat.abs().max()`` over a tensor of
  the model's parameter count (median time), and the tax in such passes (``tax / floor``).

Models: ``resnet50`` (on CUDA the published ImageNet ResNet-50, 3 × 224 × 224, 1000 classes,
batch 32; on the CPU the zoo's Fashion-MNIST ResNet-50, 1 × ``--image-size`` pixels, batch 1;
``gradsync.apps.models``), ``gpt2`` (transformers' ``GPT2LMHeadModel``, random init, GPT-2
small: 12 layers, 768 wide, vocabulary 50257; batch 8 × 512 on CUDA, 1 × 64 on the CPU),
``mlp<N>`` (``N`` square linear layers, so 2N tensors with the biases, holding
``--mlp-params`` parameters in all, 2²³ by default, batch 32: ``mlp8,mlp64`` compare 16 and
128 tensors of the same total size; at the default every weight, 362 × 362 in ``mlp64``, is
above the 102,400 elements under which the DDP hook's SSFusion schemes send a tensor whole,
``gradsync.ddp``'s ``SMALL_NUMEL``; the engine's SSFusion decides that from its cost model),
and any image model of the zoo (1 × 28 × 28). ``--batch-size`` overrides every model's
batch.

Defaults. CUDA: ``resnet50,gpt2``, 10 timed steps, ``--warmup-steps`` 5, 3 counted steps,
TF32 on (put back at the end). CPU: ``resnet50,mlp8,mlp64``, ResNet-50 at 16 × 16 pixels,
3 timed steps, ``--warmup-steps`` 1, 2 counted steps and one torch thread (``--threads``; the
tax is host work, and on shared cores a second intra-op thread's waits swamp it): about ten
minutes on two busy cores.

World size 1: without a process group the command starts one (gloo on the CPU, NCCL on CUDA,
rank 0, a free port on 127.0.0.1) and destroys it at the end. Writes
``overhead-<device>.json`` (rows + settings + environment), ``.md`` (the tables, the command,
date, device and code) and ``.png`` (step ratio per scheme) under ``--out``, or under
docs/results/ with ``--write-docs``; ``<device>`` is ``cpu`` or the GPU's short name (``h100``,
``h200``). The JSON and the page are rewritten after every row, marked incomplete until the
end (the plot comes last), so a run stopped from outside leaves what it measured.
``--time-limit S`` fits the run into S seconds (a lent GPU's time is counted): each model gets
an even share of what is left when it starts, and a scheme whose turn comes after its model's
share is not run, its row saying so (a row that has started finishes). ``--code`` names the
code on the page where the checkout has no git history (the default asks git).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import math
import os
import re
import shlex
import socket
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gradsync import sparsegrad
from gradsync.apps.bench._harness import bench_parser, print_written
from gradsync.apps.common import (
    cpu_description,
    grouped_bars,
    median_time,
    print_table,
    write_outputs,
)

__all__ = ["HOST_READ_OPS", "Workload", "count_step", "device_slug", "gpu_slug", "main",
           "parse_schemes", "workload"]

# Ops that read a device value on the host (the host waits for the device): exact names, and
# prefixes for the unique family (unique, unique_dim, unique_consecutive, _unique, _unique2…).
HOST_READ_OPS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select",
                 "aten::is_nonzero", "aten::equal", "aten::unique*", "aten::_unique*")
_READ_EXACT = frozenset(n for n in HOST_READ_OPS if not n.endswith("*"))
_READ_PREFIX = tuple(n[:-1] for n in HOST_READ_OPS if n.endswith("*"))
_COPY_OPS = frozenset({"aten::copy_", "aten::_to_copy", "aten::to", "aten::_copy_from",
                       "aten::_copy_from_and_resize"})
_LAUNCH_PREFIX = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchCooperativeKernel",
                  "cuLaunchCooperativeKernel")
_SYNC_PREFIX = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
                "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize")
_MARK = "gradsync.bench.overhead::drain"  # the closing device sync, not part of a step

DEFAULT_ENGINE = ("dense", "topka", "per_tensor", "multi_tensor", "ssfusion", "ssfusion_oi",
                  "oktopk", "densestream", "auto")
REFERENCES = ("ddp", "ddp_powersgd")
DOCS_DIR = Path("docs/results")


# ---------------------------------------------------------------------------------------------
# Counting a step
# ---------------------------------------------------------------------------------------------
def _is_read_name(name: str) -> bool:
    return name in _READ_EXACT or name.startswith(_READ_PREFIX)


def _profile_kwargs() -> tuple[dict[str, Any], bool]:
    """``profile(...)`` keyword arguments that follow every thread, where torch can."""
    try:
        from torch._C._profiler import _ExperimentalConfig

        return {"experimental_config": _ExperimentalConfig(profile_all_threads=True)}, True
    except (ImportError, TypeError):  # torch without the option: the default threads
        return {}, False


_CPU_READ = "Tensor."  # the ranges _marked_cpu_reads opens: "Tensor.tolist", "Tensor.numpy"


@contextlib.contextmanager
def _marked_cpu_reads() -> Iterator[None]:
    """While counting on the CPU: ``Tensor.tolist()`` and ``Tensor.numpy()`` run inside a
    profiler range of their name. They dispatch no aten op, yet they are where the CPU path
    reads values on the host that a GPU would copy from the device (``tolist`` copies there;
    ``sparsegrad.flatnonzero`` calls ``numpy`` where a GPU calls ``nonzero``)."""
    from torch.profiler import record_function

    names = ("tolist", "numpy")
    own = {n: torch.Tensor.__dict__.get(n) for n in names}  # None: inherited from TensorBase

    def marked(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            with record_function(_CPU_READ + name):
                return fn(self, *args, **kwargs)
        return run

    for n in names:
        setattr(torch.Tensor, n, marked(n, getattr(torch.Tensor, n)))
    try:
        yield
    finally:
        for n in names:
            if own[n] is None:
                delattr(torch.Tensor, n)
            else:
                setattr(torch.Tensor, n, own[n])


def count_step(step_fn: Callable[[], Any], steps: int = 3,
               device: torch.device | str | None = None, *, all_threads: bool = True,
               ) -> dict[str, Any]:
    """Run ``step_fn()`` ``steps`` times under ``torch.profiler`` and count per step what it
    dispatched (module docstring, the counts): ``aten_ops``, ``host_reads`` (with
    ``host_read_ops``, per op name), ``ops`` (every ``aten::`` name → count) and, on a CUDA
    ``device``, ``launches``, ``syncs``, ``d2h_copies`` and ``read_ops_any_device`` (the
    listed ops on tensors of any device, as the CPU counts them; ``None`` elsewhere). Every figure
    is the total over the steps divided by ``steps``. ``all_threads``: follow every thread of
    the process where torch supports it (``all_threads`` in the result says whether it did).
    A closing device synchronisation (CUDA) is excluded from the counts."""
    from torch.profiler import ProfilerActivity, profile, record_function

    if int(steps) != steps or steps < 1:
        raise ValueError(f"count_step: steps must be an integer >= 1, got {steps!r}")
    cuda = device is not None and torch.device(device).type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    kwargs, followed = _profile_kwargs() if all_threads else ({}, False)
    if cuda:
        torch.cuda.synchronize(device)
    with (contextlib.nullcontext() if cuda else _marked_cpu_reads()), \
            profile(activities=acts, **kwargs) as prof:
        for _ in range(steps):
            step_fn()
        with record_function(_MARK):
            if cuda:
                torch.cuda.synchronize(device)
    t = _tally(prof.events(), cuda)

    def per(n: float) -> float:
        return round(n / steps, 2)

    return {
        "steps": int(steps), "all_threads": followed,
        "aten_ops": per(sum(t["ops"].values())), "work_ops": per(t["work"]),
        "host_reads": per(sum(t["reads"].values())),
        "launches": per(t["launches"]) if cuda else None,
        "syncs": per(t["syncs"]) if cuda else None,
        "d2h_copies": per(t["d2h_copies"]) if cuda else None,
        "read_ops_any_device": per(t["listed"]) if cuda else None,
        "device_busy_ms": per(t["busy_us"] / 1e3) if cuda else None,
        "device_ms": ({k: round(v / steps / 1e3, 4) for k, v in
                       t["device_us"].most_common(40)} if cuda else {}),
        "host_read_ops": {k: per(v) for k, v in sorted(t["reads"].items())},
        "ops": {k: per(v) for k, v in sorted(t["ops"].items())},
    }


def _tally(events: Any, cuda: bool) -> dict[str, Any]:
    """Totals over the profiler's ``events`` (``FunctionEvent`` s: ``name``, ``cpu_parent``,
    ``cpu_children``, ``kernels``, ``device_type``): ``ops`` and ``reads`` (name → count),
    ``listed`` (the listed read ops, any device), ``launches``, ``syncs``, ``d2h_copies``.
    Events under the closing synchronisation's range are left out."""

    def ancestors(e: Any) -> Iterator[Any]:
        p = e.cpu_parent
        while p is not None:
            yield p
            p = p.cpu_parent

    memo: dict[int, bool] = {}

    def dtoh(e: Any) -> bool:
        """A device-to-host copy ran under ``e`` (the profiler hangs device work on the op
        that issued it)."""
        key = id(e)
        if key not in memo:
            memo[key] = (any(str(getattr(k, "name", "")).startswith("Memcpy DtoH")
                             for k in getattr(e, "kernels", None) or ())
                         or any(dtoh(c) for c in getattr(e, "cpu_children", None) or ()))
        return memo[key]

    def is_read(e: Any) -> bool:
        if cuda:  # the device's values reach the host: a listed op or a copy, with a DtoH
            return (_is_read_name(e.name) or e.name in _COPY_OPS) and dtoh(e)
        return _is_read_name(e.name) or e.name.startswith(_CPU_READ)

    ops: Counter[str] = Counter()
    reads: Counter[str] = Counter()
    device_us: Counter[str] = Counter()
    spans: list[tuple[float, float]] = []
    listed = launches = syncs = copies = work = 0
    for e in events:
        name = e.name
        if str(getattr(e, "device_type", "")).endswith("CUDA"):  # device activity
            copies += name.startswith("Memcpy DtoH")
            span = getattr(e, "time_range", None)
            if span is not None:
                spans.append((span.start, span.end))
                device_us[_kernel_name(name)] += span.end - span.start
            continue
        if name == _MARK or any(a.name == _MARK for a in ancestors(e)):
            continue
        if name.startswith(_LAUNCH_PREFIX):
            launches += 1
        elif name.startswith(_SYNC_PREFIX):
            syncs += 1
        elif name.startswith("aten::"):
            ops[name] += 1
            work += _works(e)
            if is_read(e) and not any(is_read(a) for a in ancestors(e)):
                reads[name] += 1
            if _is_read_name(name) and not any(_is_read_name(a.name) for a in ancestors(e)):
                listed += 1
        elif name.startswith(_CPU_READ) and not any(is_read(a) for a in ancestors(e)):
            reads[name] += 1
    return {"ops": ops, "reads": reads, "listed": listed, "launches": launches,
            "syncs": syncs, "d2h_copies": copies, "work": work, "device_us": device_us,
            "busy_us": _covered(spans)}


def _kernel_name(name: str, width: int = 80) -> str:
    """A device activity's name, short: without ``void``, torch's and std's namespaces and the
    argument list (``void at::native::vectorized_elementwise_kernel<4, at::native::
    CUDAFunctor_add<float>, …>(int, …)`` → ``vectorized_elementwise_kernel<4,
    CUDAFunctor_add<float>, …``), at most ``width`` characters."""
    short = re.sub(r"\(anonymous namespace\)::|at::native::|at::cuda::|std::|c10::", "",
                   name.removeprefix("void "))
    return (short.split("(")[0].strip() or name)[:width]


def _covered(spans: list[tuple[float, float]]) -> float:
    """The time the ``(start, end)`` spans cover together (the device's busy time: kernels of
    several streams overlapping count once)."""
    total, end = 0.0, -math.inf
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _works(e: Any) -> bool:
    """``e`` (an ``aten::`` event) does work at the bottom of its call tree: it is not a view,
    reshape, allocation or wrapper (:data:`_NO_KERNEL`), calls no op that does, and is not a
    host scalar's making (``aten::scalar_tensor``, which wraps a Python number, and what it
    calls). On a GPU such an op is about one kernel launch or copy: the CPU's stand-in for
    ``launches``."""
    if e.name in _NO_KERNEL:
        return False
    p = e.cpu_parent
    if p is not None and p.name == "aten::scalar_tensor":
        return False
    return not any(c.name.startswith("aten::") and c.name not in _NO_KERNEL
                   for c in getattr(e, "cpu_children", None) or ())


# ---------------------------------------------------------------------------------------------
# Models and their inputs
# ---------------------------------------------------------------------------------------------
class LayeredMLP(nn.Module):
    """``layers`` square ``width`` × ``width`` linear layers with ReLU between them."""

    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        mods: list[nn.Module] = []
        for i in range(layers):
            mods.append(nn.Linear(width, width))
            if i < layers - 1:
                mods.append(nn.ReLU())
        self.net = nn.Sequential(*mods)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@dataclass
class Workload:
    """A model to build afresh for every run, and its fixed batch."""

    name: str
    describe: str
    build: Callable[[], nn.Module]  # on the CPU, seeded
    batch: Callable[[torch.device], tuple[Any, ...]]  # inputs on the device
    loss: Callable[[nn.Module, tuple[Any, ...]], torch.Tensor]


def _ce(model: nn.Module, b: tuple[Any, ...]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(b[0]), b[1])


def _seeded(seed: int, fn: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return fn()
    return build


def _batch_of(shape: tuple[int, ...], classes: int, seed: int, *, ids: bool = False,
              ) -> Callable[[torch.device], tuple[Any, ...]]:
    def make(device: torch.device) -> tuple[Any, ...]:
        g = torch.Generator().manual_seed(seed + 1)
        if ids:
            x = torch.randint(0, classes, shape, generator=g)
            return (x.to(device),)
        x = torch.randn(shape, generator=g)
        y = torch.randint(0, classes, (shape[0],), generator=g)
        return x.to(device), y.to(device)
    return make


def workload(name: str, cuda: bool, *, batch_size: int | None = None, image_size: int = 28,
             seq_len: int | None = None, mlp_params: int = 1 << 23, seed: int = 0,
             resnet_width: int = 64) -> Workload:
    """The model ``name`` of ``--model`` (module docstring, Models) for a CUDA or CPU run;
    ``resnet_width``: the CPU ResNet-50's base width (its 161 tensors whatever the width)."""
    from gradsync.apps import models

    m = re.fullmatch(r"mlp(\d+)", name)
    if m:
        layers = int(m.group(1))
        if layers < 1:
            raise ValueError(f"{name}: an MLP needs at least one layer")
        width = max(2, round(math.sqrt(mlp_params / layers)))
        b = batch_size or 32
        return Workload(name, f"{layers} × Linear({width}, {width}), batch {b}",
                        _seeded(seed, lambda: LayeredMLP(layers, width)),
                        _batch_of((b, width), width, seed), _ce)
    if name == "resnet50":
        if cuda:
            b = batch_size or 32
            return Workload(name, f"ResNet-50 (ImageNet stem), 3 × 224 × 224, batch {b}",
                            _seeded(seed, lambda: models.ResNet(50)),
                            _batch_of((b, 3, 224, 224), 1000, seed), _ce)
        b = batch_size or 1
        wide = "" if resnet_width == 64 else f", base width {resnet_width}"
        return Workload(name, f"ResNet-50 (zoo, small stem{wide}), 1 × {image_size} × "
                              f"{image_size}, batch {b}",
                        lambda: models.build("resnet50", seed=seed, base_width=resnet_width),
                        _batch_of((b, 1, image_size, image_size), 10, seed), _ce)
    if name == "gpt2":
        b = batch_size or (8 if cuda else 1)
        t = seq_len or (512 if cuda else 64)

        def gpt2() -> nn.Module:
            config, model = models.hf_classes("gpt2", "GPT2Config", "GPT2LMHeadModel")
            dims = dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257,
                        n_positions=max(1024, t))
            try:
                cfg = config(**dims, attn_implementation="sdpa")
            except (TypeError, ValueError):  # a transformers without the option
                cfg = config(**dims)
            return model(cfg)

        def lm_loss(model: nn.Module, bt: tuple[Any, ...]) -> torch.Tensor:
            return model(input_ids=bt[0], labels=bt[0]).loss

        return Workload(name, f"GPT-2 small (GPT2LMHeadModel, 12 × 768), batch {b} × {t}",
                        _seeded(seed, gpt2), _batch_of((b, t), 50257, seed, ids=True),
                        lm_loss)
    if name in models.names() and models.task(name) == "image":
        b = batch_size or 4
        return Workload(name, f"zoo {name}, 1 × 28 × 28, batch {b}",
                        lambda: models.build(name, seed=seed),
                        _batch_of((b, 1, 28, 28), 10, seed), _ce)
    raise ValueError(f"unknown model {name!r}: resnet50, gpt2, mlp<N> (e.g. mlp8) or an image "
                     f"model of the zoo")


# ---------------------------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------------------------
def device_slug(device: torch.device) -> str:
    """``cpu``, or the GPU's short name (:func:`gpu_slug`)."""
    if device.type != "cuda":
        return device.type
    return gpu_slug(torch.cuda.get_device_name(device))


def gpu_slug(name: str) -> str:
    """A GPU's short name: ``h100`` for "NVIDIA H100 80GB HBM3", ``a100`` for
    "NVIDIA A100-SXM4-80GB", else the name in lower case with hyphens."""
    m = re.search(r"\b([A-Za-z]{1,3}\d{2,4}[A-Za-z]?)\b", name.replace("NVIDIA", ""))
    if m:
        return m.group(1).lower()
    return re.sub(r"[^a-z0-9]+", "-", name.lower().replace("nvidia", "")).strip("-") or "cuda"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def config_for(scheme: str, a: argparse.Namespace):
    """The run's :class:`gradsync.Config` of ``scheme`` (``ValueError`` on bad options)."""
    from gradsync import Config

    kw: dict[str, Any] = dict(scheme=scheme, density=a.density, sparsifier=a.sparsifier,
                              momentum=a.momentum, warmup_steps=a.warmup_steps,
                              density_warmup=())  # the step at the target density
    if "compress_single_rank" in Config.__dataclass_fields__:
        kw["compress_single_rank"] = True
    return Config(**kw)


def _sparse(scheme: str) -> bool:
    from gradsync.schedule import schemes

    return schemes.get(scheme).sparse


@dataclass
class Label:
    """A row of ``--schemes``: its label, kind (ddp, powersgd, engine, hook) and scheme."""

    label: str
    kind: str
    scheme: str


def parse_schemes(text: str) -> list[Label]:
    """``--schemes``: ``ddp``, ``ddp_powersgd``, engine scheme names, ``hook:<scheme>``;
    ``all`` every one. DDP always comes first (it is the reference)."""
    from gradsync import ddp
    from gradsync.schedule import SCHEMES

    items = [s.strip() for s in text.split(",") if s.strip()]
    if items == ["all"]:
        items = [*REFERENCES, *SCHEMES, *(f"hook:{s}" for s in ddp.DDP_SCHEMES)]
    out = [Label("ddp", "ddp", "ddp")]
    for s in items:
        if s == "ddp":
            continue
        if s in ("ddp_powersgd", "powersgd"):
            lab = Label("ddp_powersgd", "powersgd", "powersgd")
        elif s.startswith("hook:"):
            name = s.split(":", 1)[1]
            if name not in ddp.DDP_SCHEMES:
                raise ValueError(f"--schemes: {s!r}: the DDP hook runs {ddp.DDP_SCHEMES}")
            lab = Label(s, "hook", name)
        elif s in SCHEMES:
            lab = Label(s, "engine", s)
        else:
            raise ValueError(f"--schemes: unknown {s!r}; engine schemes {tuple(SCHEMES)}, "
                             f"hook:<{'|'.join(ddp.DDP_SCHEMES)}>, ddp, ddp_powersgd or all")
        if any(x.label == lab.label for x in out):
            raise ValueError(f"--schemes: {s!r} is given twice")
        out.append(lab)
    return out


def _waited(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook`` waited for inside the call, returning a completed future: PowerSGD's hook waits
    on its second all-reduce from inside a gloo callback, and with two buckets in flight both of
    a gloo group's worker threads block there for good (seen here on ResNet-50). ``train``'s
    metered hook does the same on gloo (:mod:`gradsync.apps.train.metering`)."""

    def run(state, bucket):  # unannotated: DDP checks a hook's annotations
        value = hook(state, bucket).wait()
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(value)
        return fut

    return run


class Run:
    """One run: a fresh copy of ``template`` (the model as built, on the device) wrapped for
    ``lab``, its optimizer and its step."""

    def __init__(self, wl: Workload, template: nn.Module, lab: Label, a: argparse.Namespace,
                 device: torch.device, group: Any) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        import gradsync

        self.engine: Any = None
        self.hook: Any = None
        model = copy.deepcopy(template)
        self.inputs = wl.batch(device)
        ids = [device.index or 0] if device.type == "cuda" else None
        sgd_momentum = 0.9
        if lab.kind == "engine":
            self.engine = gradsync.GradSync(model, config_for(lab.scheme, a), group=group)
            net: nn.Module = model
            sgd_momentum = 0.0 if _sparse(lab.scheme) else 0.9
        else:
            net = DDP(model, device_ids=ids)
            if lab.kind == "powersgd":
                from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

                state = psgd.PowerSGDState(process_group=None,
                                           matrix_approximation_rank=a.powersgd_rank,
                                           start_powerSGD_iter=2, random_seed=a.seed)
                hook = psgd.powerSGD_hook if device.type == "cuda" else _waited(psgd.powerSGD_hook)
                net.register_comm_hook(state, hook)
            elif lab.kind == "hook":
                self.hook = gradsync.ddp.register(net, config_for(lab.scheme, a))
                sgd_momentum = 0.0 if _sparse(lab.scheme) else 0.9
        self.net = net
        self.loss = wl.loss
        self.opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=sgd_momentum)

    def step(self) -> None:
        self.opt.zero_grad()
        self.loss(self.net, self.inputs).backward()
        if self.engine is not None:
            self.engine.synchronize()
        self.opt.step()

    def buffers(self, since: int, steps: int) -> float | None:
        """Buffers per step: the engine's fusion buffers, or the DDP hook's buckets (its calls
        beyond ``since`` over ``steps`` steps); ``None`` for torch's own DDP and PowerSGD."""
        if self.engine is not None:
            return None if self.engine.plan is None else len(self.engine.plan.buffers)
        return None if self.hook is None else (self.hook.counts.calls - since) / steps

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        self.engine = self.net = self.opt = self.inputs = self.hook = None


def _measure(wl: Workload, template: nn.Module, lab: Label, a: argparse.Namespace,
             device: torch.device, group: Any, count: bool) -> dict[str, Any]:
    """One run: warm-up, ``a.steps`` timed steps (median ms), and the counts when ``count``."""
    run = Run(wl, template, lab, a, device, group)
    try:
        for _ in range(a.warmup_steps + 2):
            run.step()
        _sync(device)
        times, cpu = [], []
        for _ in range(a.steps):
            t0, c0 = time.perf_counter(), time.process_time()
            run.step()
            _sync(device)
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        out: dict[str, Any] = {"ms": 1e3 * statistics.median(times),
                               "cpu_ms": 1e3 * statistics.median(cpu)}
        if run.engine is not None:
            st = run.engine.stats()
            out["probing"] = bool(st.get("probing"))
        if count:
            calls = 0 if run.hook is None else run.hook.counts.calls
            out["counts"] = count_step(run.step, a.count_steps, device)
            out["buffers"] = run.buffers(calls, a.count_steps)
        return out
    finally:
        run.close()
        del run
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _floor_ms(n: int, device: torch.device, repeats: int) -> float:
    """One read pass over ``n`` fp32 values: ``flat.abs().max()`` (median ms)."""
    g = torch.Generator().manual_seed(0)
    flat = torch.randn(n, generator=g).to(device)
    return 1e3 * median_time(lambda: flat.abs().max(), repeats=repeats, warmup=2, device=device)


# Ops that run no kernel of their own: views, reshapes, allocations, in-place changes of a
# tensor's metadata (``detach_``, ``as_strided_``), and wrappers whose work is an op counted
# beneath them (``to`` → ``_to_copy`` → ``copy_``). Left out of the "where the ops go" list
# and of the work ops, not out of the aten ops.
_NO_KERNEL = frozenset("aten::" + n for n in (
    "view", "as_strided", "as_strided_", "reshape", "_reshape_alias", "_unsafe_view",
    "detach", "detach_", "alias",
    "slice", "select", "narrow", "unsqueeze", "squeeze", "expand", "expand_as", "view_as", "t",
    "transpose", "permute", "flatten", "unflatten", "split", "split_with_sizes", "chunk",
    "unbind", "empty", "empty_like", "empty_strided", "resize_", "lift_fresh", "to",
    "_to_copy", "contiguous", "result_type", "is_same_size", "item", "resolve_conj",
    "resolve_neg", "numpy_T", "_has_compatible_shallow_copy_type", "scalar_tensor",
    "_nnpack_available"))


def _top_growth(ops: dict[str, float], base: dict[str, float], k: int = 8,
                kernels_only: bool = False) -> dict[str, float]:
    """The ``k`` op names whose per-step count grew most over ``base`` (DDP's)."""
    diff = {n: round(v - base.get(n, 0.0), 2) for n, v in ops.items()
            if not (kernels_only and n in _NO_KERNEL)}
    diff = {n: d for n, d in diff.items() if d > 0}
    return dict(sorted(diff.items(), key=lambda kv: -kv[1])[:k])


def measure_model(wl: Workload, labels: list[Label], a: argparse.Namespace,
                  device: torch.device, group: Any, *, deadline: float | None = None,
                  progress: Callable[[list[dict[str, Any]]], None] | None = None,
                  ) -> list[dict[str, Any]]:
    """Rows of one model: DDP's, then every scheme's against DDP in interleaved pairs.

    The model is built once (seeded, on the CPU) and moved to the device; every run trains a
    fresh copy of it. A scheme whose turn comes after ``deadline`` (a ``time.perf_counter()``
    value) is not run: its row says so. ``progress(rows)`` is called after each row with the
    rows so far (DDP's first, its figures over the DDP runs so far)."""
    template = wl.build().to(device)
    n_params = sum(p.numel() for p in template.parameters() if p.requires_grad)
    n_tensors = sum(1 for p in template.parameters() if p.requires_grad)
    floor = _floor_ms(n_params, device, a.repeats)
    common = {"model": wl.name, "workload": wl.describe, "params": n_params,
              "tensors": n_tensors, "floor_ms": floor}
    print(f"bench overhead: {wl.name}: {wl.describe}; {n_params / 1e6:.2f} M parameters in "
          f"{n_tensors} tensors; one read pass {floor:.3f} ms", flush=True)
    ddp_lab = labels[0]
    base = _measure(wl, template, ddp_lab, a, device, group, count=True)
    ddp_runs: list[float] = [base["ms"]]
    ddp_cpu: list[float] = [base["cpu_ms"]]
    base_c = base["counts"]
    rows: list[dict[str, Any]] = []
    for lab in labels[1:]:
        row = {**common, "scheme": lab.label, "kind": lab.kind}
        if deadline is not None and time.perf_counter() > deadline:
            row.update(error="not run: past its model's share of --time-limit", not_run=True)
            print(f"  {lab.label}: not run (past its model's share of --time-limit)", flush=True)
            rows.append(row)
            continue
        pairs: list[tuple[float, float]] = []
        cpu_pairs: list[tuple[float, float]] = []
        counts = buffers = None
        probing = None
        err = None
        t0 = time.perf_counter()
        try:
            for i in range(a.pairs):
                d = _measure(wl, template, ddp_lab, a, device, group, count=False)
                s = _measure(wl, template, lab, a, device, group, count=(i == 0))
                ddp_runs.append(d["ms"])
                pairs.append((d["ms"], s["ms"]))
                cpu_pairs.append((d["cpu_ms"], s["cpu_ms"]))
                ddp_cpu.append(d["cpu_ms"])
                if i == 0:
                    counts = s["counts"]
                    buffers = s.get("buffers")
                probing = s.get("probing", probing)
        except Exception as e:  # one scheme failing must not end the benchmark: its row says
            err = f"{type(e).__name__}: {e}"[:300]
        if err is not None:
            row["error"] = err
            print(f"  {lab.label}: error {err}", flush=True)
        else:
            assert counts is not None
            _scheme_figures(row, pairs, cpu_pairs, counts, base_c, buffers, probing, floor)
            print(f"  {lab.label}: {row['ratio']:.2f}× DDP, {row['aten_ops']:.0f} aten ops "
                  f"(+{row['ops_beyond_ddp']:.0f}), {row['host_reads']:.0f} host reads per "
                  f"step ({time.perf_counter() - t0:.0f} s)", flush=True)
        rows.append(row)
        if progress is not None:
            progress([_ddp_row(common, base_c, ddp_runs, ddp_cpu), *rows])
    del template
    return [_ddp_row(common, base_c, ddp_runs, ddp_cpu), *rows]


def _scheme_figures(row: dict[str, Any], pairs: list[tuple[float, float]],
                    cpu_pairs: list[tuple[float, float]], counts: dict[str, Any],
                    base_c: dict[str, Any], buffers: float | None, probing: bool | None,
                    floor: float) -> None:
    """A scheme's row: its pairs' times and ratios, and its counts against DDP's."""
    ratios = [s / d for d, s in pairs]
    tax = statistics.median(s - d for d, s in pairs)
    row.update(_row_figures(counts, base_c))
    row["buffers"] = buffers
    row["work_per_buffer"] = (None if not buffers
                              else round(row["work_beyond_ddp"] / buffers, 1))
    row.update({
        "ms": statistics.median(s for _, s in pairs),
        "ddp_ms": statistics.median(d for d, _ in pairs),
        "ratio": statistics.median(ratios), "ratio_min": min(ratios),
        "ratio_max": max(ratios), "pairs": [[round(d, 3), round(s, 3)] for d, s in pairs],
        "tax_ms": tax, "tax_floors": tax / floor if floor > 0 else None,
        "cpu_ms": statistics.median(s for _, s in cpu_pairs),
        "cpu_ratio": statistics.median(s / d for d, s in cpu_pairs if d > 0)
        if all(d > 0 for d, _ in cpu_pairs) else None,
        "probing": probing,
        "top_ops_beyond_ddp": _top_growth(counts["ops"], base_c["ops"], 12),
        "top_kernel_ops_beyond_ddp": _top_growth(counts["ops"], base_c["ops"], 8, True),
    })
    if counts.get("device_busy_ms") is not None:  # CUDA: where the step's time goes
        row["device_busy_beyond_ddp_ms"] = round(
            counts["device_busy_ms"] - base_c["device_busy_ms"], 3)
        grew = {n: round(v - base_c["device_ms"].get(n, 0.0), 4)
                for n, v in counts["device_ms"].items()}
        row["top_device_ms_beyond_ddp"] = dict(
            sorted(((n, d) for n, d in grew.items() if d > 0), key=lambda kv: -kv[1])[:8])


def _ddp_row(common: dict[str, Any], base_c: dict[str, Any], ddp_runs: list[float],
             ddp_cpu: list[float]) -> dict[str, Any]:
    """DDP's row: its counts, and its runs' median and spread (every pair's DDP run)."""
    mid = statistics.median(ddp_runs)
    return {**common, "scheme": "ddp", "kind": "ddp", **_row_figures(base_c, base_c),
            "ms": mid, "ddp_ms": mid, "ratio": 1.0, "ratio_min": min(ddp_runs) / mid,
            "ratio_max": max(ddp_runs) / mid, "pairs": [], "tax_ms": 0.0, "tax_floors": 0.0,
            "probing": None, "cpu_ms": statistics.median(ddp_cpu), "cpu_ratio": 1.0,
            "top_ops_beyond_ddp": {}, "top_kernel_ops_beyond_ddp": {},
            "buffers": None, "work_per_buffer": None,
            "ddp_runs_ms": [round(x, 3) for x in ddp_runs],
            "ddp_runs_cpu_ms": [round(x, 3) for x in ddp_cpu]}


def _row_figures(c: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    return {"aten_ops": c["aten_ops"], "ops_beyond_ddp": round(c["aten_ops"] - base["aten_ops"], 2),
            "work_ops": c["work_ops"],
            "work_beyond_ddp": round(c["work_ops"] - base["work_ops"], 2),
            "host_reads": c["host_reads"], "reads_beyond_ddp":
                round(c["host_reads"] - base["host_reads"], 2),
            "launches": c["launches"], "syncs": c["syncs"], "d2h_copies": c["d2h_copies"],
            "device_busy_ms": c.get("device_busy_ms"),
            "read_ops_any_device": c["read_ops_any_device"],
            "host_read_ops": c["host_read_ops"], "all_threads": c["all_threads"],
            "count_steps": c["steps"]}


# ---------------------------------------------------------------------------------------------
# Process group, output
# ---------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _world_of_one(device: torch.device) -> Iterator[Any]:
    """A world-size-1 process group (started here when none exists, destroyed at the end)
    and one dedicated group for the engines (as ``GradSync`` makes by default)."""
    import torch.distributed as dist

    mine = not dist.is_initialized()
    if mine:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    elif dist.get_world_size() != 1:
        raise RuntimeError(f"bench overhead measures world size 1; this process group has "
                           f"{dist.get_world_size()} ranks")
    try:
        yield dist.new_group()
    finally:
        if mine:
            dist.destroy_process_group()


def cell(v: Any) -> str:
    """A count per step: whole numbers as such, others to one decimal."""
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.0f}" if v == int(v) else f"{v:.1f}"
    return str(v)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _columns(cuda: bool) -> list[str]:
    return ["scheme", "step ms", "× DDP [range]", "CPU ms", "CPU × DDP",
            *(["launches", "syncs", "device busy ms"] if cuda else []),
            "host reads", "aten ops", "ops beyond DDP", "work ops", "work beyond DDP",
            "buffers", "work beyond DDP / buffer", "tax ms", "tax / floor"]


def _cells(r: dict[str, Any], cuda: bool) -> list[str]:
    if "error" in r:
        what = ["not run", "past --time-limit"] if r.get("not_run") else ["error",
                                                                         r["error"][:60]]
        return [r["scheme"], *what] + ["-"] * (len(_columns(cuda)) - 3)
    span = f"{r['ratio']:.2f}× [{r['ratio_min']:.2f}–{r['ratio_max']:.2f}]"
    if r.get("probing"):
        span += " (probing)"
    cpu = "-" if r.get("cpu_ratio") is None else f"{r['cpu_ratio']:.2f}×"
    return [r["scheme"], f"{r['ms']:.1f}", span, f"{r['cpu_ms']:.1f}", cpu,
            *([cell(r["launches"]), cell(r["syncs"]), _ms(r.get("device_busy_ms"))]
              if cuda else []),
            cell(r["host_reads"]), cell(r["aten_ops"]), cell(r["ops_beyond_ddp"]),
            cell(r["work_ops"]), cell(r["work_beyond_ddp"]), cell(r.get("buffers")),
            cell(r.get("work_per_buffer")), f"{r['tax_ms']:.1f}",
            "-" if r["tax_floors"] is None else f"{r['tax_floors']:.0f}"]


def code_label() -> str:
    """The checkout's commit, ``+ changes`` when its tracked files differ from it (or
    ``unknown`` outside a git checkout)."""
    import subprocess

    root = Path(__file__).resolve().parents[4]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, text=True,
                              capture_output=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=root, text=True, capture_output=True, timeout=10,
                               check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + (" + uncommitted changes" if dirty else "")


def _machine(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    cpus = os.cpu_count() or 0
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"CPU: {cpus} cores ({cpu_description()}), 1-min load average {load:.1f} at the "
            f"end, {torch.get_num_threads()} torch threads, torch {torch.__version__}")


def write_markdown(path: Path, rows: list[dict[str, Any]], meta: dict[str, Any],
                   cuda: bool) -> Path:
    """The markdown page: one table per model, the command, the date and the device."""
    lines = [f"# Per-step overhead at P = 1 on {meta['device_name']} "
             "(`python -m gradsync bench overhead`)", "",
             "Written by the command, not by hand.", "",
             f"- date: {meta['date']}",
             f"- command: `{meta['command']}`",
             f"- device: {meta['machine']}; wall time {meta['wall_s'] / 60:.1f} min",
             f"- code: {meta['code']}",
             *([] if meta.get("complete", True) else [
                 f"- **incomplete**: {meta['rows_written']} of {meta['rows_expected']} rows. "
                 "The files are rewritten after every row: this run was stopped here, or is "
                 "still running"]),
             *([] if meta.get("time_limit_s") is None else [
                 f"- --time-limit {meta['time_limit_s']:g} s, shared evenly by the models: "
                 + _not_run(rows)]),
             f"- settings: density {meta['density']}, sparsifier {meta['sparsifier']}, "
             f"momentum {meta['momentum']}, Config.warmup_steps {meta['warmup_steps']}, "
             f"compression at P = 1: {meta['compress_single_rank']}; {meta['pairs']} "
             f"interleaved pairs (DDP run, scheme run) of {meta['steps']} timed steps after "
             f"{meta['warmup_steps'] + 2} unmeasured; counts over {meta['count_steps']} "
             f"steps, every thread: {meta['all_threads']}"
             + ("; the accelerators' path and kernels on the CPU (`--segments-on-cpu`: "
                "per-tensor buffers selected at once, compactions at known counts)"
                if meta.get("segments_on_cpu") else ""),
             "- step ms: median over the pairs of each run's median step; × DDP: median of "
             "the pair ratios [min–max]; ddp's own range is its runs' spread around their "
             "median; CPU ms, CPU × DDP: the same for the process's CPU time per step (every "
             "thread; steadier than wall time on shared cores); tax ms: median of (scheme − DDP) "
             "over the pairs; tax / floor: the tax in "
             "read passes over the model's gradient (`flat.abs().max()`, floor ms below)",
             "- per step: aten ops (every `aten::` op, nested ones included, all threads), "
             "host reads (" + ", ".join(f"`{n}`" for n in HOST_READ_OPS)
             + (", copies to the host" if cuda else ", `Tensor.tolist()`, `Tensor.numpy()`")
             + "; counted once, outermost)"
             + ("; launches: `cudaLaunchKernel`-like calls; syncs: stream/device/event "
                "synchronisations; device busy ms: the time the device's kernels and copies "
                "cover per counted step (profiled)" if cuda else "")
             + "; ops beyond DDP: scheme − ddp aten ops; "
             "work ops: the aten ops that do work at the bottom of the call tree (no view, "
             "reshape, allocation, wrapper or host scalar; none that calls another such op): "
             "on a GPU each is about one kernel launch or copy, so on the CPU they stand in for "
             "the launches; work beyond DDP: scheme − ddp work ops; buffers: the engine's "
             "fusion buffers or the DDP hook's buckets per step",
             "- (probing): `auto` was still measuring its runners-up when timed", ""]
    for model in dict.fromkeys(r["model"] for r in rows):
        lines += _md_model([r for r in rows if r["model"] == model], cuda)
    for p in meta.get("artifacts", []):
        lines.append(f"- [{p}]({p})")
    path.write_text("\n".join(lines) + "\n")
    return path


def _md_model(mine: list[dict[str, Any]], cuda: bool) -> list[str]:
    """One model's section of the page: its rows' table, then where the ops and the time
    beyond DDP's go."""
    r0 = mine[0]
    lines = [f"## {r0['model']}: {r0['workload']}", "",
             f"{r0['params'] / 1e6:.2f} M parameters in {r0['tensors']} tensors; one "
             f"read pass (floor) {r0['floor_ms']:.3f} ms.", "",
             "| " + " | ".join(_columns(cuda)) + " |", "|" + "---|" * len(_columns(cuda))]
    lines += ["| " + " | ".join(_cells(r, cuda)) + " |" for r in mine]
    lines.append("")
    grew = [r for r in mine if r.get("top_kernel_ops_beyond_ddp")]
    if grew:
        lines += ["Where the ops beyond DDP go: the largest growths per step among the ops "
                  "that do work (views, reshapes, allocations and wrappers such as `to` "
                  "left out; every op is in the JSON's `top_ops_beyond_ddp`):", ""]
        for r in grew:
            tops = ", ".join(f"`{k[6:]}` +{v:g}" for k, v in
                             list(r["top_kernel_ops_beyond_ddp"].items())[:6])
            lines.append(f"- {r['scheme']}: {tops}")
        lines.append("")
    timed = [r for r in mine if r.get("device_busy_beyond_ddp_ms") is not None]
    if timed:
        lines += ["Where the time goes: the step's time beyond DDP's (tax) against the "
                  "device's busy time beyond DDP's (kernels and copies, counted steps, "
                  "overlaps once); the rest is time the device waited on the host "
                  "(launches, syncs, Python). The kernels that grew most, ms per step:",
                  ""]
        for r in timed:
            busy = r["device_busy_beyond_ddp_ms"]
            tops = ", ".join(f"`{k}` +{v:.3f}" for k, v in
                             list(r["top_device_ms_beyond_ddp"].items())[:4])
            lines.append(f"- {r['scheme']}: tax {r['tax_ms']:.2f} ms; device busy "
                         f"{busy:+.2f} ms; waiting on the host ≈ "
                         f"{r['tax_ms'] - busy:.2f} ms" + (f" ({tops})" if tops else ""))
        lines.append("")
    return lines


def _not_run(rows: list[dict[str, Any]]) -> str:
    """The schemes past ``--time-limit``, by model."""
    late = {m: [r["scheme"] for r in rows if r["model"] == m and r.get("not_run")]
            for m in dict.fromkeys(r["model"] for r in rows)}
    parts = [f"{m}: {len(v)} not run ({', '.join(v)})" for m, v in late.items() if v]
    return "; ".join(parts) if parts else "every scheme ran"


def _plot(rows: list[dict[str, Any]]):
    def plot(ax) -> None:
        grouped_bars(ax, rows, "model", "scheme", lambda r: r.get("ratio") or None,
                     rotation=60)
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
        ax.set_ylabel("step time / DDP's (median of pairs)")
        ax.set_title("per-step overhead at P = 1", fontsize=9)
        ax.legend(fontsize=8)

    return plot


# ---------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = bench_parser("overhead", __doc__)
    p.add_argument("--model", default=None,
                   help="comma-separated (default resnet50,gpt2 on CUDA, resnet50,mlp8,mlp64 "
                        "on the CPU)")
    p.add_argument("--schemes", default=None,
                   help="comma-separated: ddp, ddp_powersgd, engine schemes, hook:<scheme>; "
                        "all: every one (default: ddp,ddp_powersgd,"
                        f"{','.join(DEFAULT_ENGINE)} and hook: every DDP-hook scheme)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--sparsifier", default="dgc")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--powersgd-rank", type=int, default=4)
    p.add_argument("--pairs", type=int, default=3, help="interleaved DDP/scheme pairs (3)")
    p.add_argument("--steps", type=int, default=None,
                   help="timed steps per run (default 10 on CUDA, 3 on the CPU)")
    p.add_argument("--warmup-steps", type=int, default=None,
                   help="Config.warmup_steps; runs take 2 more unmeasured steps "
                        "(default 5 on CUDA, 1 on the CPU)")
    p.add_argument("--count-steps", type=int, default=None,
                   help="profiled steps for the counts (default 3 on CUDA, 2 on the CPU)")
    p.add_argument("--batch-size", type=int, default=None, help="every model's batch")
    p.add_argument("--image-size", type=int, default=16,
                   help="pixels of the CPU ResNet-50's grey images (default 16)")
    p.add_argument("--resnet-width", type=int, default=64,
                   help="the CPU ResNet-50's base width (default 64: 23.5 M parameters; its "
                        "161 tensors at any width)")
    p.add_argument("--seq-len", type=int, default=None, help="gpt2's sequence length")
    p.add_argument("--mlp-params", type=float, default=float(1 << 23),
                   help="total parameters of the mlp<N> models (default 8.39e6: mlp64's "
                        "tensors, 362 × 362, stay above the SSFusion small-tensor cut)")
    p.add_argument("--repeats", type=int, default=10, help="timings of the read pass (median)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default 1 on the CPU: the tax is host work, "
                        "and on shared cores a second thread's waits swamp it; on CUDA "
                        "torch's setting; 0: torch's setting)")
    p.add_argument("--segments-on-cpu", action="store_true",
                   help="run the accelerators' path (per-tensor buffers selected at once) "
                        "and kernels (sparsegrad.ACCELERATOR: without the tests' count "
                        "checks) on the CPU: what a GPU "
                        "launches and reads, as bench syncs counts it; the files are named "
                        "overhead-cpu-segments")
    p.add_argument("--time-limit", type=float, default=None, metavar="S",
                   help="wall-time budget in seconds, shared evenly by the models (what one "
                        "leaves over goes to the next): a scheme whose turn comes after its "
                        "model's share is not run, and its row says so (default: none)")
    p.add_argument("--code", default=None,
                   help="the code measured, for the page (default: the checkout's commit from "
                        "git; give it where the checkout travels without its history)")
    p.add_argument("--out", default="bench-out/overhead")
    p.add_argument("--write-docs", action="store_true",
                   help=f"write into {DOCS_DIR} instead of --out")
    return p


def _settings(argv: list[str]) -> tuple[argparse.Namespace, torch.device, list[Label],
                                         list[str], list[Workload]]:
    """The options (the device's defaults filled in), the device, the rows' labels, the model
    names and their workloads; a bad option exits through the parser's error."""
    p = build_parser()
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device")
    cuda = a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    for name, gpu, cpu in (("steps", 10, 3), ("warmup_steps", 5, 1), ("count_steps", 3, 2),
                           ("threads", 0, 1)):
        if getattr(a, name) is None:
            setattr(a, name, gpu if cuda else cpu)
    for name in ("pairs", "steps", "warmup_steps", "count_steps", "repeats", "powersgd_rank"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.threads < 0:
        p.error("--threads must be >= 0")
    if a.time_limit is not None and not a.time_limit > 0:
        p.error("--time-limit must be > 0 seconds")
    try:
        labels = parse_schemes(a.schemes or ",".join(
            [*REFERENCES, *DEFAULT_ENGINE, *(f"hook:{s}" for s in _hook_schemes())]))
        names = [m.strip() for m in (a.model or ("resnet50,gpt2" if cuda else
                                                 "resnet50,mlp8,mlp64")).split(",") if m.strip()]
        loads = [workload(n, cuda, batch_size=a.batch_size, image_size=a.image_size,
                          seq_len=a.seq_len, mlp_params=int(a.mlp_params), seed=a.seed,
                          resnet_width=a.resnet_width)
                 for n in names]
        config_for("dense", a)  # checks density, sparsifier, momentum
    except ValueError as e:
        p.error(str(e))
    return a, device, labels, names, loads


def _meta(a: argparse.Namespace, argv: list[str], device: torch.device, labels: list[Label],
          names: list[str], threads: int) -> dict[str, Any]:
    """The run's settings for the JSON and the page (``threads``: torch's own setting)."""
    from gradsync import Config

    cuda = device.type == "cuda"
    return {"command": "python -m gradsync bench overhead " + shlex.join(argv),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "device": device_slug(device),
            "device_name": torch.cuda.get_device_name(device) if cuda else "the CPU",
            "code": a.code or code_label(), "density": a.density,
            "sparsifier": a.sparsifier, "momentum": a.momentum,
            "warmup_steps": a.warmup_steps, "pairs": a.pairs, "steps": a.steps,
            "count_steps": a.count_steps, "powersgd_rank": a.powersgd_rank,
            "segments_on_cpu": a.segments_on_cpu, "time_limit_s": a.time_limit,
            "compress_single_rank": ("Config.compress_single_rank=True"
                                     if "compress_single_rank" in Config.__dataclass_fields__
                                     else "no such option (the engine compresses at P = 1)"),
            "threads": a.threads or threads, "tf32": cuda,
            "host_read_ops": list(HOST_READ_OPS) + (
                ["copies to the host (Memcpy DtoH)"] if cuda
                else ["Tensor.tolist()", "Tensor.numpy()"]),
            "models": names, "schemes": [x.label for x in labels],
            "rows_expected": len(names) * len(labels)}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a, device, labels, names, loads = _settings(argv)
    cuda = device.type == "cuda"
    slug = device_slug(device)
    threads = torch.get_num_threads()
    if a.threads:
        torch.set_num_threads(a.threads)
    tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    print(f"bench overhead on {slug}: models {', '.join(names)}; {len(labels)} rows "
          f"({', '.join(x.label for x in labels)}); {a.pairs} pairs × {a.steps} steps",
          flush=True)
    name = f"overhead-{slug}" + ("-segments" if a.segments_on_cpu else "")
    out = DOCS_DIR if a.write_docs else Path(a.out)
    meta = _meta(a, argv, device, labels, names, threads)
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []

    def save(now: list[dict[str, Any]], final: bool) -> tuple[Path, Path | None, Path]:
        """The files as they stand: after every row (so a run stopped from outside leaves
        what it measured, marked incomplete), then once more at the end with the plot."""
        meta.update(wall_s=time.perf_counter() - t0, machine=_machine(device),
                    complete=final, rows_written=len(now),
                    all_threads=all(r.get("all_threads", True) for r in now),
                    artifacts=[f"{name}.json"] + ([f"{name}.png"] if final else []))
        jpath, ppath = write_outputs(name, now, out, meta=meta,
                                     plot=_plot(now) if final and now else None)
        if final and ppath is None:
            meta["artifacts"] = [f"{name}.json"]
        return jpath, ppath, write_markdown(out / f"{name}.md", now, meta, cuda)

    def partial(now: list[dict[str, Any]]) -> None:  # the models done, then this one's rows
        save(rows + now, False)

    # --segments-on-cpu: what a GPU runs, its kernels without the tests' count checks
    chosen = sparsegrad.ACCELERATOR if a.segments_on_cpu else sparsegrad.cpu_kernels()
    try:
        with sparsegrad.using(chosen), _world_of_one(device) as group:
            for i, wl in enumerate(loads):
                deadline = None
                if a.time_limit is not None:  # an even share of what is left
                    left = a.time_limit - (time.perf_counter() - t0)
                    deadline = time.perf_counter() + left / (len(loads) - i)
                try:
                    mine = measure_model(wl, labels, a, device, group, deadline=deadline,
                                         progress=partial)
                except ImportError as e:  # transformers missing: skip that model
                    print(f"bench overhead: {wl.name} skipped: {e}", flush=True)
                    continue
                rows.extend(mine)
                print_table(f"bench overhead — {wl.name}: {wl.describe}, P = 1, {slug}",
                            _columns(cuda), [_cells(r, cuda) for r in mine])
    finally:
        if cuda:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
        torch.set_num_threads(threads)
    jpath, ppath, mpath = save(rows, True)
    print_written(jpath, mpath, ppath, lead=f"bench overhead: {meta['wall_s']:.0f} s; ")
    return 0

def _hook_schemes() -> tuple[str, ...]:
    from gradsync import ddp

    return tuple(ddp.DDP_SCHEMES)
