"""Helpers shared by the test files (importable as ``conftest`` in the test processes and in
the ranks ``run_distributed`` starts, which import the test module that uses them).

Inputs are seeded per rank and step; nothing here touches the global RNG.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from gradsync.apps.models import build
from gradsync.engine import warmup
from gradsync.schedule import costmodel
from gradsync.testing.distributed import CPUS_ENV


def pytest_configure(config):
    """Under pytest-xdist, each worker's share of the cores: its own tests' torch threads and
    its ranks' (``gradsync.testing.distributed.CPUS_ENV``). With a thread per core in every
    worker and rank, the threads of one spin while another's run (on 2 cores, 4 % of the
    in-process tests' time)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    if workers > 1 and CPUS_ENV not in os.environ:
        share = max(1, (os.cpu_count() or 1) // workers)
        os.environ[CPUS_ENV] = str(share)
        torch.set_num_threads(share)


def pytest_generate_tests(metafunc):
    """A test that uses the ``kernels`` fixture runs with the CPU's kernels and path and again
    with the accelerators' (see ``kernels``)."""
    if "kernels" in metafunc.fixturenames:
        metafunc.parametrize("kernels", ["cpu", "accelerator"], indirect=True)


@pytest.fixture
def kernels(request):
    """The kernels and path of selection the test (and its ranks: ``run_distributed`` hands
    them on) takes: ``"cpu"``, the CPU's own; ``"accelerator"``, the CPU standing in for an
    accelerator (:data:`gradsync.sparsegrad.CPU_AS_ACCELERATOR`: ``nonzero_static`` at known
    counts, checked; ``index_*_`` scatters, torch sorts; buffers selected at once, fixed-capacity
    messages). CI has no GPU, so this is how the accelerators' branches run in ``make test``.
    ``@pytest.mark.accelerator_at(name=value, …)`` runs the accelerator variant only where the
    test's other parameters take those values (a tuple: any of them), one instance of a
    property per path."""
    from gradsync import sparsegrad

    chosen = (sparsegrad.CPU_AS_ACCELERATOR if request.param == "accelerator"
              else sparsegrad.CPU)
    with sparsegrad.using(chosen):
        yield request.param


def segmented(on: bool):
    """The kernels this process's CPU tensors take, with buffers selected at once (``on``: the
    accelerators' path) or tensor by tensor: for :func:`gradsync.sparsegrad.using` or, in a
    rank, :func:`gradsync.sparsegrad.bind`."""
    import dataclasses

    from gradsync import sparsegrad

    return dataclasses.replace(sparsegrad.cpu_kernels(), segmented=on)


def _accelerator_variant_wanted(item) -> bool:
    params = getattr(getattr(item, "callspec", None), "params", {})
    if params.get("kernels") != "accelerator":
        return True
    mark = item.get_closest_marker("accelerator_at")
    return mark is None or all(params.get(k) in v if isinstance(v, tuple) else params.get(k) == v
                               for k, v in mark.kwargs.items())


def pytest_collection_modifyitems(config, items):
    """Deselect the tests marked ``cuda`` where CUDA is absent (``make gpu-check`` runs them),
    and the accelerator variants that ``accelerator_at`` leaves out."""
    cuda = not torch.cuda.is_available()
    drop = [it for it in items if (cuda and it.get_closest_marker("cuda") is not None)
            or not _accelerator_variant_wanted(it)]
    if drop:
        config.hook.pytest_deselected(items=drop)
        gone = set(map(id, drop))
        items[:] = [it for it in items if id(it) not in gone]


@pytest.fixture(scope="session", autouse=True)
def _reused_ranks():
    """Every test's ``run_distributed`` call runs on ranks reused across the session (per
    world size; ``gradsync.testing.pool``) unless it asks for fresh processes."""
    from gradsync.testing import pooled

    with pooled():
        yield


def conserved(records) -> bool:
    """Per rank and step, accumulated = sent + residual, bit for bit, for every audit record of
    a step (``GradSync(..., audit=True).audit_log``): the sent entries scattered with
    accumulation (a repeated index would count twice) plus the residual equal the accumulated
    gradient exactly. Where values travelled ahead of the accumulator (momentum sent ahead,
    ``gradsync.feedback`` "Ahead"), the residual is ``acc − sent``, one rounding: it must then
    be exactly that difference."""
    ok = True
    for rec in records:
        recon = torch.zeros_like(rec.acc).index_put_((rec.sent_indices,), rec.sent_values,
                                                     accumulate=True)
        ok &= bool(torch.equal(rec.acc, recon + rec.residual)
                   or torch.equal(rec.residual, rec.acc - recon))
    return ok


def density_one_error(model: nn.Module, sync, rank: int, P: int, steps: int = 4) -> float:
    """Train ``steps`` steps of ``model`` under ``sync`` (an engine at density 1) and return
    the worst relative difference of its ``.grad`` from what DDP computes: the gradients
    all-reduced by ``torch.distributed`` directly and divided by P."""
    import torch.distributed as dist

    worst = 0.0
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        x, y = image_batch(rank, step)
        nn.functional.cross_entropy(model(x), y).backward()
        ref = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        for t in ref.values():
            if P > 1:
                dist.all_reduce(t)
            t.div_(P)
        sync.synchronize()
        for n, p in model.named_parameters():
            scale = ref[n].abs().max().item() + 1e-12
            worst = max(worst, (p.grad - ref[n]).abs().max().item() / scale)
    return worst


def ddp_reference_step(ref: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
                       y: torch.Tensor, P: int) -> None:
    """One step of what DDP computes, written without gradsync: cross-entropy, gradients
    averaged with ``torch.distributed.all_reduce``, then ``opt``."""
    ref.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(ref(x), y).backward()
    for p in ref.parameters():
        if P > 1:
            torch.distributed.all_reduce(p.grad)
        p.grad.div_(P)
    opt.step()


def image_batch(rank: int, step: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` random 1×28×28 images and labels of 10 classes, different per rank and step."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)


def batch(model_name: str, rank: int, step: int, n: int = 8) -> tuple[torch.Tensor, ...]:
    """:func:`image_batch`, or ``n`` random 16-byte sequences and targets for ``gpt_tiny``."""
    if model_name != "gpt_tiny":
        return image_batch(rank, step, n)
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randint(0, 256, (n, 16), generator=g)
    return x, torch.randint(0, 256, (n, 16), generator=g)


def loss(model: nn.Module, model_name: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of ``model(x)``; per token for ``gpt_tiny``."""
    out = model(x)
    if model_name == "gpt_tiny":
        return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    return nn.functional.cross_entropy(out, y)


def sharded_gpt(**kwargs) -> nn.Module:
    """A ``gpt_tiny`` (seed 0, ``kwargs`` to its constructor) with every block and the whole
    model under FSDP2's ``fully_shard`` (call inside a process group)."""
    from torch.distributed.fsdp import fully_shard

    m = build("gpt_tiny", seed=0, **kwargs)
    for blk in m.blocks:
        fully_shard(blk)
    fully_shard(m)
    return m


def pin_profiles(backward: bool = True) -> None:
    """Replace the engine's timing measurements in this process by fixed fits (α/β, inline and
    offloaded sparsification, no extra cost per sparse call, a spare core per rank) and, with
    ``backward``, fixed per-tensor backward times (the backward *order* is still observed), so
    cost-model plans are the same on every run."""
    costmodel.profile_collectives = lambda group=None, **kw: (
        costmodel.AlphaBeta(5e-5, 1e-9), costmodel.AlphaBeta(5e-5, 2e-9))
    costmodel.profile_sparsifier = lambda sp, offload=False, **kw: (
        costmodel.AffineFit(2e-5, 5e-10) if offload else costmodel.AffineFit(1e-5, 2e-9))
    costmodel.profile_sparse_call = lambda collective, group=None, **kw: 0.0
    # a host with a core for SSFusion-O's worker, whatever this machine has
    costmodel.cores_per_rank = lambda: 4.0
    orig = warmup.backward_profile
    if backward and not getattr(orig, "pinned", False):
        def pinned(samples, names):
            order, _ = orig(samples, names)
            return order, {n: 1e-5 * (i + 1) for i, n in enumerate(order)}
        pinned.pinned = True
        warmup.backward_profile = pinned


def probe_bytes_at_two_ranks() -> int:
    """What one rank of two sends for the cost model's default collective probes
    (``costmodel.profile_collectives``, lean): an all-reduce of s bytes and an all-gather of
    s/2 per rank for s = 1 KiB … 1 MiB, 1 + 5 calls each, 1 + 3 from 128 KiB up (a ring
    all-reduce of s bytes sends s at P = 2, an all-gather its s/2), then the max-reduce of the
    8 medians (fp64, 64 B)."""
    return sum((1 + (3 if s >= 1 << 17 else 5)) * (s + s // 2)
               for s in (1 << 10, 1 << 14, 1 << 17, 1 << 20)) + 64
