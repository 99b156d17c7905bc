"""GradSync engine on real gloo ranks: equivalence at density 1, consistency, conservation,
tensor missing, no_sync, frozen/unused parameters, checkpointing, bad configuration."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import gradsync
from conftest import batch, pin_profiles, probe_bytes_at_two_ranks, segmented
from conftest import loss as model_loss
from gradsync import sparsegrad, sparsify
from gradsync.apps.models import build
from gradsync.engine import GradSync, Stateful
from gradsync.engine.components import Components
from gradsync.engine.config import Config
from gradsync.engine.jobs import Mode, Transport, plan_jobs
from gradsync.schedule import SCHEMES, BufferPlan, Plan, TensorPlan, schemes
from gradsync.testing import run_distributed

ALL_SCHEMES = list(SCHEMES)





def _small(model_name: str):
    if model_name == "gpt_tiny":
        return build("gpt_tiny", dim=32, layers=1, heads=2, context=16)
    return build("cnn")


def _density_one(rank, world_size, model_names, schemes):
    """At density 1 every scheme's averaged gradient equals the plain all-reduce average; at
    world size 1 the scheme runs too (``compress_single_rank``), else nothing would be tested.
    The cost model's measurements are pinned (the plans do not matter here; measuring them
    for every scheme cost the test half its time)."""
    pin_profiles()
    errs = {}
    for model_name in model_names:
        for scheme in schemes:
            model = _small(model_name)
            cfg = Config(scheme=scheme, density=1.0, sparsifier="topk", warmup_steps=2,
                         bucket_mb=0.05, compress_single_rank=True)
            sync = GradSync(model, cfg)
            worst = 0.0
            for step in range(3):  # 2 profiling steps, then the final plan
                model.zero_grad(set_to_none=True)
                x, y = batch(model_name, rank, step)
                model_loss(model, model_name, x, y).backward()
                ref = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
                for t in ref.values():  # the reference: plain torch.distributed, as DDP does
                    dist.all_reduce(t)
                    t.div_(world_size)
                sync.synchronize()
                for n, p in model.named_parameters():
                    scale = ref[n].abs().max().item() + 1e-12
                    worst = max(worst, (p.grad - ref[n]).abs().max().item() / scale)
            errs[(model_name, scheme)] = worst
            sync.close()
    return errs


@pytest.mark.usefixtures("kernels")
@pytest.mark.accelerator_at(world_size=3)
@pytest.mark.parametrize("world_size", [1, 2, 3])  # one rank, a power of two, another size
def test_density_one_equals_allreduce(world_size):
    # every scheme on the CNN; a representative subset on the transformer (time budget)
    out = run_distributed(_density_one, world_size, ["cnn"], ALL_SCHEMES, timeout=600)
    out_t = run_distributed(_density_one, world_size, ["gpt_tiny"],
                            ["dense", "topka", "oktopk", "ssfusion_oi", "cupcake"], timeout=600)
    for errs in out + out_t:
        for key, err in errs.items():
            assert err < 1e-5, f"{key}: relative error {err}"


def _train_sparse(rank, world_size, schemes, steps, **cfg):
    """At 1% density, parameters stay bitwise identical across ranks; collect digests. The
    cost model's measurements are pinned (test_reliability trains on measured plans too).
    ``cfg``: more ``Config`` fields."""
    pin_profiles()
    out = {}
    for scheme in schemes:
        model = build("cnn", seed=3)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        sync = GradSync(model, Config(scheme=scheme, density=0.01, warmup_steps=2, **cfg))
        for step in range(steps):
            opt.zero_grad(set_to_none=True)
            x, y = batch("cnn", rank, step)
            model_loss(model, "cnn", x, y).backward()
            sync.synchronize()
            opt.step()
        out[scheme] = gradsync.engine.consistency.parameter_digest(model)[0]
        sync.close()
    return out


@pytest.mark.usefixtures("kernels")
@pytest.mark.accelerator_at(scheme=("topka", "oktopk", "densestream", "per_tensor",
                                    "ssfusion_oi", "gaussiank", "auto"))
@pytest.mark.parametrize("scheme", ALL_SCHEMES)
def test_sparse_training_keeps_replicas_identical(scheme):
    """At P = 3, past the warm-up and the plan it fixes: 12 steps; for Ok-Topk 34, past its
    exact global threshold at τ′ = 32 (its reuse steps before), and for auto past three of its
    drift windows (10 steps each)."""
    steps = 34 if scheme in ("oktopk", "auto") else 12
    out = run_distributed(_train_sparse, 3, [scheme], steps, timeout=300)
    assert len({o[scheme] for o in out}) == 1, scheme


def _where_topka_sums(rank, world_size):
    """The threads on which TopkA's fixed-capacity sums are written during 3 engine steps."""
    import threading

    from gradsync.collectives import topka

    names = []
    add_at = topka.add_at

    def spy(*args, **kwargs):
        names.append(threading.current_thread().name)
        return add_at(*args, **kwargs)

    topka.add_at = spy
    try:
        # at the target density (a warm-up period's messages have no fixed capacity)
        out = _train_sparse(rank, world_size, ["topka"], 3, density_warmup=())
    finally:
        topka.add_at = add_at
    return names, out


def test_the_cpu_engine_writes_topka_sums_on_the_training_thread():
    """On the CPU the communication thread only exchanges TopkA's messages; the training
    thread, which reads the sum, writes it (Collective's ``lazy``): a buffer another core wrote
    is several times slower to read first. Replicas stay identical."""
    out = run_distributed(_where_topka_sums, 2, timeout=300)
    for names, _ in out:
        assert names and not any(n.startswith("gradsync-comm") for n in names), names
    assert len({o["topka"] for _, o in out}) == 1


class TwoScale(nn.Module):
    """Two branches whose gradients differ by ~6 orders of magnitude."""

    def __init__(self):
        super().__init__()
        self.big = nn.Linear(64, 64)
        self.small = nn.Linear(64, 64)

    def forward(self, x):
        return self.big(x) * 1e3 + self.small(x) * 1e-3


def _buckets_beside_ddp(rank, world_size, cap_mb):
    """DDP's buckets after its rebuild (gradient-ready order) and the dense plan's buffers,
    each as a list of sets of parameter names; ``cap_mb`` None: both defaults."""
    import copy

    model = build("cnn", seed=3)
    ddp = nn.parallel.DistributedDataParallel(
        copy.deepcopy(model), **({} if cap_mb is None else {"bucket_cap_mb": cap_mb}))
    # DDP's default layout is Config.first_bucket_mb=1; given a cap, DDP uses it for every
    # bucket, as the engine's default does
    kw = {"first_bucket_mb": 1.0} if cap_mb is None else {"bucket_mb": cap_mb}
    sync = GradSync(model, Config(scheme="dense_ovlp", warmup_steps=2, **kw))
    for step in range(4):
        x, y = batch("cnn", rank, step)
        for m in (ddp, model):
            m.zero_grad(set_to_none=True)
            model_loss(m, "cnn", x, y).backward()
        sync.synchronize()
    names = [n for n, _ in model.named_parameters()]
    data = ddp._get_ddp_logging_data()
    ddp_buckets = [{names[int(i)] for i in b.split()}
                   for b in data["rebuilt_per_bucket_param_indices"].split(",")]
    ours = [set(b.names) for b in sync.plan.buffers]
    sync.close()
    return ddp_buckets, ours


@pytest.mark.parametrize("cap_mb", [None, 0.05])
def test_dense_plan_has_the_buckets_of_a_real_ddp(cap_mb):
    """DDP's first bucket (1 MiB by default) holds the gradients ready first, so their
    all-reduce overlaps the rest of the backward pass; the engine's dense plan is the same."""
    for ddp_buckets, ours in run_distributed(_buckets_beside_ddp, 2, cap_mb, timeout=180):
        assert ours == ddp_buckets
        assert len(ours) >= 2  # the CNN is 1.7 MB: one 25 MB bucket would not overlap


def _missing(rank, world_size, scheme, budget=None):
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = TwoScale()
    plan = None
    if scheme == "multi_tensor":
        # MG-WFBP merges buffers by measured times: under load it may keep every tensor in a
        # buffer of its own, where nothing can go missing. One fused buffer, as it plans when
        # communication outlasts the backward, makes the test independent of the timings.
        plan = {"scheme": scheme, "overlap": True, "buffers": [
            {"mode": "fused", "density": 0.01, "tensors": [
                {"name": n, "numel": q.numel(), "density": None, "offload": False,
                 "allreduce": False} for n, q in reversed(list(model.named_parameters()))]}]}
    sync = GradSync(model, Config(scheme=scheme, density=0.01, sparsifier="topk",
                                  warmup_steps=1, bucket_mb=25, plan=plan, budget=budget))
    rates = []
    for step in range(4):
        model.zero_grad()
        g = torch.Generator().manual_seed(rank * 100 + step)
        model(torch.randn(16, 64, generator=g)).pow(2).mean().backward()
        sync.synchronize()
        rates.append(sync.stats()["last"]["missing_rate"])
    sync.close()
    return rates[-1]


@pytest.mark.parametrize("scheme,budget,missing", [
    ("per_tensor", None, False), ("ssfusion", "even", False), ("ssfusion_o", "blend", False),
    ("ssfusion_oi", "even", False), ("multi_tensor", None, True), ("topka", None, True),
    # the SSFusion family's default budget pools its sparsified tensors: one may send nothing
    ("ssfusion", None, True), ("ssfusion_oi", None, True)])
def test_tensor_missing_rate(scheme, budget, missing):
    """SSFusion §III-A, Table I: one selection per tensor leaves none out (``per_tensor``,
    SSFusion with one density per tensor); one over several tensors can (multi-tensor, TopkA,
    and SSFusion's pooled budget, the default: TwoScale's small-gradient tensor)."""
    rates = run_distributed(_missing, 2, scheme, budget, timeout=300)
    for r in rates:
        assert (r > 0) == missing, (scheme, r)


def _conservation(rank, world_size, scheme):
    """Σ_steps Σ_ranks g == Σ_steps P·avg + Σ_ranks residual (mass is neither lost nor made)."""
    model = build("mlp", seed=1)
    sync = GradSync(model, Config(scheme=scheme, density=0.02, sparsifier="topk",
                                  warmup_steps=1))
    total_g = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    total_avg = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for step in range(6):
        model.zero_grad()
        x, y = batch("cnn", rank, step)
        model_loss(model, "cnn", x, y).backward()
        for n, p in model.named_parameters():
            total_g[n] += p.grad
        sync.synchronize()
        for n, p in model.named_parameters():
            total_avg[n] += p.grad * world_size
    residual = {n: (sync.ef.residual(n).view_as(p) if sync.ef.residual(n) is not None
                    else torch.zeros_like(p)) for n, p in model.named_parameters()}
    sync.close()
    return total_g, total_avg, residual


@pytest.mark.usefixtures("kernels")
@pytest.mark.accelerator_at(scheme='ssfusion_oi')
@pytest.mark.parametrize("scheme", ["topka", "oktopk", "gtopk", "ssfusion_oi", "multi_tensor"])
def test_conservation_across_ranks(scheme):
    out = run_distributed(_conservation, 3, scheme, timeout=300)
    for n in out[0][0]:
        grads = sum(o[0][n] for o in out)
        sent = out[0][1][n]  # identical on every rank
        residual = sum(o[2][n] for o in out)
        scale = grads.abs().max().item() + 1e-12
        assert (grads - (sent + residual)).abs().max().item() / scale < 1e-4, (scheme, n)


# SSFusion's plan with tensors sent whole between sparsified ones (backward order), given as
# Config.plan so that no timing decides it: one per-tensor buffer.
_EXCLUDED_PLAN = Plan("ssfusion", [BufferPlan((
    TensorPlan("net.5.bias", 10, None), TensorPlan("net.5.weight", 2560, 0.02),
    TensorPlan("net.3.bias", 256, None), TensorPlan("net.3.weight", 65536, 0.02),
    TensorPlan("net.1.bias", 256, None), TensorPlan("net.1.weight", 200704, 0.02)),
    "per_tensor")]).to_dict()


def _excluded_rank(rank, world_size, dtype=torch.float32):
    # the bytes the tests below count are the CPU's own path's: exact-size messages after a
    # count exchange (a CPU standing in for an accelerator would send capped ones, whose
    # bytes test_collectives counts)
    sparsegrad.bind(segmented(False))
    model = build("mlp", seed=1).to(dtype)
    sync = GradSync(model, Config(scheme="ssfusion", density=0.02, sparsifier="topk",
                                  warmup_steps=1, check_every=0, plan=_EXCLUDED_PLAN,
                                  compress_single_rank=True, density_warmup=()))
    sent = []
    for step in range(4):
        model.zero_grad()
        x, y = batch("cnn", rank, step)
        model_loss(model, "cnn", x.to(dtype), y).backward()
        mine = {n: p.grad.clone() for n, p in model.named_parameters()}
        sync.synchronize()
        sent.append(sync.last.bytes_sent)
    residual = {n: sync.ef.residual(n) for n, _ in model.named_parameters()}
    avg = {n: p.grad.clone() for n, p in model.named_parameters()}
    sync.close()
    return sent, residual, avg, mine


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_ssfusion_sends_the_tensors_it_excluded_as_values_without_indices(world_size):
    """The tensors SSFusion sent whole travel first in their job's all-gather, values only:
    each rank sends (P − 1)·(4 bytes per excluded element + 8 per sparse entry), plus the
    shape check and the counts; the excluded tensors keep no residual and arrive as the exact
    sum of every rank's gradient (their average is identical on every rank). World size 1
    compresses too (``compress_single_rank``): it sends nothing, and keeps the residuals."""
    out = run_distributed(_excluded_rank, world_size, timeout=300)
    P = world_size
    whole = 10 + 256 + 256
    k = sum(max(1, round(0.02 * n)) for n in (2560, 65536, 200704))
    def ring(nbytes):  # what one rank sends in a ring all-reduce (rounded down)
        return 2 * (P - 1) * nbytes // P

    # the payload at its capacity (whole + k: the 8-byte count first, no count exchange) and
    # nothing else: every rank unpacks every message, which carries its rank's finiteness
    # (no agreement word); the shape check (4 int64 words) only the first time the buffer is
    # sent so (the engine's collectives agree once per description: check_shapes="changes")
    expect = (P - 1) * (8 + whole * 4 + k * 8)
    for sent, residual, avg, _ in out:
        assert sent[1:] == [expect + ring(32), expect, expect], (sent, expect)  # after warm-up
        for n in ("net.1.bias", "net.3.bias", "net.5.bias"):
            r = residual[n]
            assert r is None or not r.any(), n
            assert torch.equal(avg[n], out[0][2][n]), n  # bitwise alike on every rank
            reference = sum(o[3][n].double() for o in out) / P  # the last step's gradients
            assert torch.allclose(avg[n].double(), reference, rtol=1e-6, atol=1e-9), n


@pytest.mark.parametrize("world_size", [2, 3])
def test_ssfusion_sends_excluded_bf16_tensors_as_two_byte_values(world_size):
    """The same with bf16 parameters: values travel in bf16 (2 bytes, no index), sparse
    entries as an int32 index and a bf16 value (6 bytes); the residuals stay fp32."""
    out = run_distributed(_excluded_rank, world_size, torch.bfloat16, timeout=300)
    P = world_size
    whole = 10 + 256 + 256
    k = sum(max(1, round(0.02 * n)) for n in (2560, 65536, 200704))
    # each part of the capped message padded to 8 bytes: the count, k int32 indices, the
    # whole + k bf16 values (formats.wire.capped_entries_bytes)
    def pad8(n):
        return -(-n // 8) * 8

    expect = (P - 1) * (8 + pad8(k * 4) + pad8((whole + k) * 2))
    check = 2 * (P - 1) * 32 // P  # the shape check, at the first step after the warm-up
    for sent, residual, avg, _ in out:
        assert sent[1:] == [expect + check, expect, expect], (sent, expect)
        assert residual["net.1.weight"].dtype == torch.float32
        assert avg["net.1.bias"].dtype == torch.bfloat16


def _no_sync_frozen_unused(rank, world_size):
    model = build("cnn", seed=2)
    model.features[0].weight.requires_grad_(False)  # frozen: never synchronized
    sync = GradSync(model, Config(scheme="topka", density=1.0, sparsifier="topk",
                                  warmup_steps=1))
    frozen_before = model.features[0].weight.detach().clone()
    outs = []
    for step in range(3):
        model.zero_grad(set_to_none=True)
        with sync.no_sync():
            for micro in range(2):
                x, y = batch("cnn", rank, 10 * step + micro)
                model_loss(model, "cnn", x, y).backward()
        local = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        ref = {n: g.clone() for n, g in local.items()}
        for t in ref.values():
            dist.all_reduce(t)
            t.div_(world_size)
        sync.synchronize()
        err = max((p.grad - ref[n]).abs().max().item()
                  for n, p in model.named_parameters() if n in ref)
        outs.append(err)
    assert model.features[0].weight.grad is None
    assert torch.equal(model.features[0].weight, frozen_before)
    # a parameter that gets no gradient on this step (unused branch): synchronized as zeros
    model.zero_grad(set_to_none=True)
    x, y = batch("cnn", rank, 99)
    feats = model.features(x).flatten(1)
    loss = nn.functional.cross_entropy(model.classifier[3](torch.relu(
        model.classifier[1](feats))), y) if rank == 0 else model.classifier[1](feats).sum()
    loss.backward()
    sync.synchronize()
    last = model.classifier[3].weight.grad.clone()
    sync.close()
    return outs, last


def test_no_sync_frozen_and_unused_parameters():
    out = run_distributed(_no_sync_frozen_unused, 2, timeout=300)
    for errs, _ in out:
        assert max(errs) < 1e-5
    # rank 1 had no gradient for the head; its averaged gradient is rank 0's / 2 everywhere
    assert torch.equal(out[0][1], out[1][1])
    assert out[0][1].abs().sum() > 0


def _checkpoint(rank, world_size, scheme, path):
    def run(steps, model, opt, sync, start=0):
        for step in range(start, start + steps):
            opt.zero_grad(set_to_none=True)
            x, y = batch("cnn", rank, step)
            model_loss(model, "cnn", x, y).backward()
            sync.synchronize()
            opt.step()

    cfg = Config(scheme=scheme, density=0.01, warmup_steps=2)
    model = build("cnn", seed=5)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sync = GradSync(model, cfg)
    run(4, model, opt, sync)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                "sync": sync.state_dict()}, f"{path}/ckpt{rank}.pt")
    run(4, model, opt, sync, start=4)
    straight = gradsync.engine.consistency.parameter_digest(model)[0]
    sync.close()
    # resume in a fresh engine from the checkpoint
    model2 = build("cnn", seed=99)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.05, momentum=0.9)
    sync2 = GradSync(model2, cfg)
    ck = torch.load(f"{path}/ckpt{rank}.pt", weights_only=False)
    model2.load_state_dict(ck["model"])
    opt2.load_state_dict(ck["opt"])
    sync2.load_state_dict(ck["sync"])
    run(4, model2, opt2, sync2, start=4)
    resumed = gradsync.engine.consistency.parameter_digest(model2)[0]
    errors = []
    for bad in (Config(scheme="topka", density=0.01), ):
        try:
            GradSync(build("cnn"), bad).load_state_dict(ck["sync"])
        except ValueError as e:
            errors.append(str(e))
    sync2.close()
    return straight == resumed, errors


@pytest.mark.usefixtures("kernels")
@pytest.mark.accelerator_at(scheme='ssfusion_oi')
@pytest.mark.parametrize("scheme", ["ssfusion_oi", "oktopk"])
def test_checkpoint_resume_is_bitwise(scheme, tmp_path):
    out = run_distributed(_checkpoint, 2, scheme, str(tmp_path), timeout=300)
    for same, errors in out:
        assert same
        assert errors and "scheme" in errors[0]


def _mismatch(rank, world_size):
    cfg = Config(scheme="topka", density=0.01 if rank == 0 else 0.02)
    GradSync(build("cnn"), cfg)


def test_mismatched_configuration_fails_on_every_rank():
    with pytest.raises(gradsync.testing.DistributedError, match="density"):
        run_distributed(_mismatch, 2, timeout=120)


def test_config_validation():
    for bad in ({"scheme": "nope"}, {"density": 0.0}, {"density": 1.5}, {"sparsifier": "x"},
                {"nonfinite": "ignore"}, {"warmup_steps": 0}, {"min_density": 0.5},
                {"momentum_masking": "no"}, {"bucket_mb": 0.0}, {"first_bucket_mb": 0.0},
                {"first_bucket_mb": float("inf")}):
        with pytest.raises(ValueError):
            Config(**bad)
    # the masking option reaches error feedback, in the engine and in the DDP hook
    cfg = Config(scheme="per_tensor", momentum=0.9)  # the default: no masking
    assert not cfg.momentum_masking and not cfg.new_feedback().masking
    assert Config(momentum=0.9, momentum_masking=True).new_feedback().masking
    assert not gradsync.ddp.HookState(cfg=cfg).ef.masking
    sync = GradSync(build("mlp"), cfg)
    assert not sync.ef.masking
    sync.close()
    with pytest.raises(ValueError, match="unknown Config keys"):
        Config.from_dict({"scheme": "topka", "densty": 0.1})
    assert Config.from_dict({"scheme": "topka"}).scheme == "topka"


@pytest.mark.parametrize("compress", [False, True])
def test_single_process_without_process_group(compress):
    """One process without a process group is world size 1. By default a step is plain
    training: no hooks, ``.grad`` stays the local gradient, nothing held. With
    ``compress_single_rank`` the pipeline runs there as well: it sends nothing, but after the
    warm-up (all-reduced whole: its provisional plan) the sparsified tensors' entries wait in
    residuals, so ``.grad`` differs."""
    model = build("mlp")
    sync = GradSync(model, Config(scheme="ssfusion_oi", density=0.1, warmup_steps=1,
                                  compress_single_rank=compress))
    assert sync.passthrough is not compress
    for step in range(3):
        model.zero_grad()
        x, y = batch("cnn", 0, step)
        model_loss(model, "cnn", x, y).backward()
        local = {n: p.grad.clone() for n, p in model.named_parameters()}
        assert sync.synchronize() is True
        same = all(torch.equal(p.grad, local[n]) for n, p in model.named_parameters())
        assert same is (not compress or step == 0), step  # step 0: the warm-up
    s = sync.stats()
    assert s["world_size"] == 1 and s["step"] == 3 and s["last"]["bytes_sent"] == 0
    assert bool(sync.ef.names()) is compress
    sync.close()


def _nonfinite(rank, world_size, policy, bad_rank, scheme):
    model = build("mlp", seed=1)
    sync = GradSync(model, Config(scheme=scheme, density=0.05, sparsifier="topk",
                                  warmup_steps=1, nonfinite=policy, density_warmup=()))
    results = []
    for step in range(4):
        model.zero_grad()
        x, y = batch("cnn", rank, step)
        handle = None
        if step == 2 and rank == bad_rank:  # the NaN appears during backward, as in real life
            def poison(g):
                g = g.clone()
                g[3, 5] = float("nan")
                return g
            handle = model.net[1].weight.register_hook(poison)
        model_loss(model, "cnn", x, y).backward()
        if handle is not None:
            handle.remove()
        before = {n: (sync.ef.residual(n).clone() if sync.ef.residual(n) is not None else None)
                  for n in sync.params}
        reduces = []
        try:
            with _counting_all_reduces(reduces):
                ok = sync.synchronize()
            results.append(("ok", ok))
        except ValueError as e:
            results.append(("raised", str(e)))
        if step == 2:
            agreed = len(reduces)
        after = {n: sync.ef.residual(n) for n in sync.params}
        if step == 2:
            untouched = all(b is None or torch.equal(b, after[n]) for n, b in before.items())
            grads_zero = all(float(p.grad.abs().sum()) == 0 for p in model.parameters())
            results.append(("untouched", untouched, grads_zero))
        for r in after.values():
            assert r is None or bool(torch.isfinite(r).all())
    sync.close()
    return [*results, ("all-reduces at step 2", agreed)]


@contextlib.contextmanager
def _counting_all_reduces(calls: list):
    """Appends the numel of every ``Comm.all_reduce`` made inside to ``calls``."""
    from unittest.mock import patch

    from gradsync.collectives.comm import Comm

    real = Comm.all_reduce

    def counting(self, t, *args, **kwargs):
        calls.append(t.numel())
        return real(self, t, *args, **kwargs)

    with patch.object(Comm, "all_reduce", counting):
        yield


@pytest.mark.parametrize("scheme", ["ssfusion_oi", "dense_ovlp"])
@pytest.mark.parametrize("bad_rank", [0, 1, 2])  # every rank position of P = 3
def test_nonfinite_raise_on_every_rank(bad_rank, scheme):
    out = run_distributed(_nonfinite, 3, "raise", bad_rank, scheme, timeout=300)
    for rank, res in enumerate(out):
        assert res[2][0] == "raised"
        if rank == bad_rank:
            assert "net.1.weight" in res[2][1]
        else:
            assert "another rank" in res[2][1]
        assert res[3][1]  # residuals untouched
        assert res[4] == ("ok", True)  # training continues afterwards


@pytest.mark.usefixtures("kernels")
@pytest.mark.accelerator_at(scheme='oktopk', bad_rank=1)
@pytest.mark.parametrize("bad_rank", [0, 1])
@pytest.mark.parametrize("scheme", ["dense", "oktopk", "densestream"])
def test_nonfinite_skip_step(scheme, bad_rank):
    out = run_distributed(_nonfinite, 2, "skip_step", bad_rank, scheme, timeout=300)
    for res in out:
        assert res[2] == ("ok", False)
        assert res[3] == ("untouched", True, True)
        assert res[4] == ("ok", True)


@pytest.mark.usefixtures("kernels")
@pytest.mark.accelerator_at(scheme=("densestream", "topka"), P=2)
@pytest.mark.parametrize(("scheme", "P"), [("densestream", 2), ("densestream", 3),
                                           ("densestream", 4), ("oktopk", 2), ("oktopk", 3),
                                           ("oktopk", 4), ("gtopk", 3), ("gtopk", 4),
                                           ("spardl", 3), ("spardl", 4), ("topka", 2),
                                           ("gaussiank", 2)])
def test_a_nonfinite_gradient_travels_in_a_message_every_rank_decodes(scheme, P):
    """DenseStream and Ok-Topk at P = 2 (one exchange, each rank checks both messages),
    DenseStream in its phases (the NaN summed into its region's, which every rank decodes),
    Ok-Topk in its rounds (the bad rank's flag in its head, which every rank reads), gTop-k
    and SparDL (the NaN outranks every magnitude in each merge or re-sparsification, so the
    result every rank sums holds it),
    TopkA and Gaussian-k's TopkA (no capacity: an empty selection gets an entry for the NaN):
    the bad rank's NaN rides in its message, so every rank raises at that step with no
    agreement all-reduce, the bad one naming its tensor; residuals as before, training goes
    on. On an accelerator's kernels too for the two whose messages have a capacity (DGC's)."""
    out = run_distributed(_nonfinite, P, "raise", 1, scheme, timeout=300)
    for rank, res in enumerate(out):
        assert res[2][0] == "raised", (rank, res)
        assert ("net.1.weight" if rank == 1 else "another rank") in res[2][1], (rank, res)
        assert res[3][1] and res[4] == ("ok", True), (rank, res)
        assert res[-1] == ("all-reduces at step 2", 0), (rank, res)


def test_a_message_with_no_entry_carries_the_nan_in_an_entry_of_its_own():
    """``carry_message``: a selection's first value divided by the finiteness flag (x/1 = x
    exactly, 0/0 a NaN); an empty one, on the CPU, replaced by one entry holding the NaN."""
    from gradsync.engine.prepare import carry_message
    from gradsync.sparsegrad import SparseGrad

    good, bad = torch.tensor(True), torch.tensor(False)
    empty = SparseGrad(torch.empty(0, dtype=torch.int64), torch.empty(0), 10)
    one = carry_message(empty, bad)
    assert one.indices.tolist() == [0] and one.numel == 10 and bool(one.values.isnan().all())
    assert len(carry_message(empty, good)) == 0 and len(carry_message(empty, None)) == 0

    def two():
        return SparseGrad(torch.tensor([2, 5]), torch.tensor([0.1, -2.0]), 10)

    assert carry_message(two(), good).values.tolist() == two().values.tolist()
    zeros = SparseGrad(torch.tensor([2, 5]), torch.zeros(2), 10)  # a bad rank's: accumulate's
    got = carry_message(zeros, bad)
    assert got.indices.tolist() == [2, 5] and got.values[0].isnan() and got.values[1] == 0.0


def _poisoned_backward(model, rank: int, step: int, poison: bool, value: float) -> None:
    """One backward of the MLP on this rank's batch; with ``poison``, ``value`` (NaN/Inf)
    appears in net.1.weight's gradient during the backward, as in real life."""
    x, y = batch("cnn", rank, step)
    handle = model.net[1].weight.register_hook(
        lambda g: g.index_put((torch.tensor([3]), torch.tensor([5])), torch.tensor(value))
    ) if poison else None
    model_loss(model, "cnn", x, y).backward()
    if handle is not None:
        handle.remove()


def _mixed_nonfinite(rank, world_size, policy, bad_rank):
    """A plan of a dense buffer and a sparse one; a NaN in the dense buffer's tensor on one rank."""
    model = build("mlp", seed=1)
    sync = GradSync(model, Config(scheme="topka", density=0.05, warmup_steps=1, nonfinite=policy))
    names = list(reversed(sync.params))
    dense = [n for n in names if n == "net.1.weight"]
    sparse = [n for n in names if n not in dense]
    plan = Plan("topka", [BufferPlan(tuple(TensorPlan(n, sync.params[n].numel(), None)
                                           for n in sparse), "fused", 0.05),
                          BufferPlan(tuple(TensorPlan(n, sync.params[n].numel(), None)
                                           for n in dense), "dense")])
    out = []
    for step in range(4):
        model.zero_grad()
        _poisoned_backward(model, rank, step, step == 2 and rank == bad_rank, float("inf"))
        try:
            out.append(("ok", sync.synchronize()))
        except ValueError as e:
            out.append(("raised", str(e)))
        if step == 0:  # warm-up over: pin the mixed plan (a checkpoint carrying it)
            st = sync.state_dict()
            sync.load_state_dict({**st, "plan": plan.to_dict()})
            assert [j.mode for j in sync._layout.jobs] == [Mode.FUSED, Mode.DENSE]
        if step == 2:
            out.append(all(p.grad is None or bool(torch.isfinite(p.grad).all())
                           for p in model.parameters()))
    sync.close()
    return out


@pytest.mark.parametrize("policy", ["raise", "skip_step"])
def test_a_nonfinite_gradient_in_a_dense_buffer_of_a_mixed_plan_is_caught(policy):
    """Dense buffers carry the raw gradient (no per-tensor check); an Inf in one still stops
    the step on every rank, names the tensor on its rank, and never reaches ``.grad``."""
    out = run_distributed(_mixed_nonfinite, 3, policy, 1, timeout=300)
    for rank, res in enumerate(out):
        assert res[0] == ("ok", True) and res[1] == ("ok", True)
        if policy == "raise":
            assert res[2][0] == "raised"
            assert ("net.1.weight" in res[2][1]) == (rank == 1), res[2][1]
        else:
            assert res[2] == ("ok", False)
            assert res[3] is True  # skipped: gradients zeroed, nothing non-finite
        assert res[-1] == ("ok", True)  # training goes on


def _dense_momentum_nonfinite(rank, world_size, policy):
    """dense_ovlp with DGC momentum: a NaN on rank 1 at step 2 rides in its velocity."""
    model = build("mlp", seed=1)
    sync = GradSync(model, Config(scheme="dense_ovlp", warmup_steps=1, momentum=0.9,
                                  nonfinite=policy))
    out = []
    for step in range(4):
        model.zero_grad()
        _poisoned_backward(model, rank, step, step == 2 and rank == 1, float("nan"))
        before = sync.ef.state_dict()["velocity"]
        try:
            out.append(("ok", sync.synchronize()))
        except ValueError as e:
            out.append(("raised", str(e)))
        after = sync.ef.state_dict()["velocity"]
        if step == 2:
            out.append(("velocity untouched", sorted(before) == sorted(after) and all(
                torch.equal(before[n], after[n]) for n in before)))
        assert all(bool(torch.isfinite(v).all()) for v in after.values())
    sync.close()
    return out


@pytest.mark.parametrize("policy", ["raise", "skip_step"])
def test_a_nonfinite_gradient_in_a_dense_buffer_with_momentum_leaves_the_velocity(policy):
    """Dense buffers with momentum send the velocity unchecked; a NaN in it shows in the sum,
    and the pending velocity is dropped on every rank (residual and velocity as before)."""
    for rank, res in enumerate(run_distributed(_dense_momentum_nonfinite, 2, policy,
                                               timeout=300)):
        assert res[0] == res[1] == ("ok", True)
        if policy == "raise":
            assert res[2][0] == "raised"
            assert ("net.1.weight" in res[2][1]) == (rank == 1), res[2][1]
        else:
            assert res[2] == ("ok", False)
        assert res[3] == ("velocity untouched", True)
        assert res[4] == ("ok", True)


def _dense_messages(rank, world_size):
    model = build("mlp", seed=1)
    sync = GradSync(model, Config(scheme="dense_ovlp", warmup_steps=1))
    for step in range(3):
        model.zero_grad()
        x, y = batch("cnn", rank, step)
        model_loss(model, "cnn", x, y).backward()
        sync.synchronize()
    out = (sync.last.messages, len(sync.plan.buffers))
    sync.close()
    return out


@pytest.mark.parametrize("P", [2, 3])
def test_a_dense_step_needs_no_agreement_collective(P):
    """Plain all-reduces carry a rank's non-finite gradient as a NaN, so the ranks agree on the
    step from the sums themselves: a step sends the buffers' ring all-reduces and nothing
    else (the skip and raise policies on dense schemes are tested above)."""
    for messages, buffers in run_distributed(_dense_messages, P, timeout=300):
        assert messages == buffers * 2 * (P - 1)


def _corrupt_densestream(rank, armed, who):
    """Patches DenseStream so that, while ``armed``, the first stored value of a message
    becomes +0.0 (against rule 1): the one rank 0 encodes (``who="sender"``: a faulty rank 0,
    whose message every peer receives so) or one the last rank receives (``"link"``: a
    faulty link or peer, seen by that rank alone). Returns a function that undoes it."""
    from gradsync.collectives.densestream import DenseStreamAllreduce

    def zero_first_value(buf):
        buf = buf.clone()
        iw, nb = buf[5].item(), int(buf[16:24].view(torch.int64))
        buf[32 + 2 * nb * iw:32 + 2 * nb * iw + 4] = 0
        return buf

    if who == "sender":
        encode = DenseStreamAllreduce._encode

        def bad_encode(part, iw):
            enc = encode(part, iw)
            if armed[0] and rank == 0 and enc.numel() > 32:
                armed[0] = False
                enc = zero_first_value(enc)
            return enc

        DenseStreamAllreduce._encode = staticmethod(bad_encode)
        return lambda: setattr(DenseStreamAllreduce, "_encode", staticmethod(encode))
    match = DenseStreamAllreduce._match

    def bad_match(buf, ann, sizes, checks):
        if armed[0] and buf is not None:
            armed[0] = False
            buf = zero_first_value(buf)
        return match(buf, ann, sizes, checks)

    DenseStreamAllreduce._match = staticmethod(bad_match)
    return lambda: setattr(DenseStreamAllreduce, "_match", staticmethod(match))


def _corrupt_oktopk(rank, armed, who):
    """Patches Ok-Topk's P = 2 exchange so that, while ``armed``, rank 0's block holds the
    index −1: the block rank 0 packs (``who="sender"``, as every rank then gets it) or the one
    the last rank receives (``"link"``). Returns a function that undoes it."""
    import gradsync.collectives.oktopk as ok

    pack, gather = ok.pack_entries_counted, ok.Comm.all_gather_bounded

    def bad(block):
        block = block.clone()
        block[8:12] = 255  # the first index, int32: −1
        return block

    def bad_pack(*args):
        block = pack(*args)
        if armed[0] and rank == 0:
            armed[0] = False
            return bad(block)
        return block

    def bad_gather(self, *args, **kwargs):
        blocks = gather(self, *args, **kwargs)
        if armed[0]:
            armed[0] = False
            blocks[0] = bad(blocks[0])
        return blocks

    if who == "sender":
        ok.pack_entries_counted = bad_pack
        return lambda: setattr(ok, "pack_entries_counted", pack)
    ok.Comm.all_gather_bounded = bad_gather
    return lambda: setattr(ok.Comm, "all_gather_bounded", gather)


def _corrupt_unpacked(name, armed):
    """Patches collective ``name`` (Ok-Topk, gTop-k, SparDL) so that, while ``armed``, the first
    peer message this rank unpacks (split and reduce's; a child's; a round's) holds the index
    −3. Returns a function that undoes it."""
    import importlib

    ok = importlib.import_module(f"gradsync.collectives.{name}")
    attr = "unpack_entries_fixed" if name == "spardl" else "unpack_entries"
    unpack = getattr(ok, attr)

    def bad(buf, count, *args):
        i, v = unpack(buf, count, *args)
        if armed[0] and i.numel():
            armed[0] = False
            i = i.clone()
            i[0] = -3
        return i, v

    setattr(ok, attr, bad)
    return lambda: setattr(ok, attr, unpack)


def _malformed_on_one_rank(rank, world_size, scheme):
    """DenseStream in its phases, Ok-Topk in its rounds, gTop-k (P > 2); at step 2 the last
    rank (never folded away: it swaps messages at every P) receives a malformed message in the
    scatter-reduce (split and reduce), or gTop-k's root one from a child, as from a faulty
    link or peer; the all-reduces steps 1 and 2 made in ``synchronize()``, as the last item."""
    model = build("mlp", seed=1)
    sync = GradSync(model, Config(scheme=scheme, density=0.1, warmup_steps=1))
    armed, reduces = [False], []
    undo = (_corrupt_densestream(rank, armed, "link") if scheme == "densestream" else
            _corrupt_unpacked(scheme, armed))
    bad = 0 if scheme == "gtopk" else world_size - 1
    out = []
    try:
        for step in range(3):
            model.zero_grad()
            x, y = batch("cnn", rank, step)
            # before the backward: its hooks may launch the collective
            armed[0] = step == 2 and rank == bad
            model_loss(model, "cnn", x, y).backward()
            grads = [p.grad.clone() for p in model.parameters()]
            try:
                # step 0 also agrees on shapes and evaluates the boundaries (every τ steps)
                with _counting_all_reduces(reduces if step else []):
                    sync.synchronize()
                out.append("applied")
            except ValueError as e:
                untouched = all(torch.equal(g, p.grad)
                                for g, p in zip(grads, model.parameters()))
                out.append((str(e), untouched))
    finally:  # the pool's ranks serve the next test
        undo()
    sync.close()
    return [*out, len(reduces)]


@pytest.mark.parametrize("scheme", ["densestream", "oktopk", "gtopk", "spardl"])
@pytest.mark.parametrize("P", [3, 4])
def test_a_malformed_message_stops_every_rank_with_a_clear_error(P, scheme):
    """The rank whose collective received a malformed message raises its check's message; the
    others raise too, at the same step (its verdict reaches them in the allgather, in Ok-Topk's
    heads, down gTop-k's tree: the module docs of collectives/densestream.py, oktopk.py and
    gtopk.py), instead of
    waiting for it at the next collective, and no step makes an agreement all-reduce. No
    ``.grad`` was written. (At P = 2 in one exchange: the next test.)"""
    outs = run_distributed(_malformed_on_one_rank, P, scheme, timeout=240)
    for rank, out in enumerate(outs):
        assert out[:2] == ["applied", "applied"], (rank, out)
        assert out[3] == 0, (rank, out)  # no agreement all-reduce, nor any other
        msg, untouched = out[2]
        assert untouched, (rank, msg)
        if rank == (0 if scheme == "gtopk" else P - 1):
            assert {"densestream": "rule 1", "oktopk": "a peer's entries",
                    "gtopk": "gtopk: entries from rank", "spardl": "spardl: round"}[scheme] \
                in msg, msg
        else:
            assert "another rank received a malformed message" in msg, (rank, msg)


def _malformed_alike(rank, world_size, scheme, who):
    """TopkA at its capacity, or DenseStream at P = 2 (one exchange), through the engine; at
    step 2 rank 0's message is malformed for every rank (``who="sender"``: a faulty rank 0)
    or for rank P − 1 alone (``"link"``); each step's outcome, the agreement all-reduces
    made, whether the residuals stayed, and the final parameters."""
    from unittest.mock import patch

    import gradsync.collectives.topka as topka_mod
    from gradsync.collectives.comm import Comm

    model = build("mlp", seed=1)
    sync = GradSync(model, Config(scheme=scheme, density=0.1, warmup_steps=1,
                                  density_warmup=()))  # a fixed capacity from the start
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    capped, armed, reduces = topka_mod.unpack_entries_capped, [False], []

    def bad(msgs, *args):
        if armed[0]:
            armed[0] = False
            msgs = msgs.clone()
            msgs[0, 8:12] = 255  # rank 0's first index: int32 −1
        return capped(msgs, *args)

    real_reduce = Comm.all_reduce

    def counting(self, t, *args, **kwargs):
        reduces.append(t.numel())
        return real_reduce(self, t, *args, **kwargs)

    undo = (_corrupt_densestream(rank, armed, who) if scheme == "densestream" else
            _corrupt_oktopk(rank, armed, who) if scheme == "oktopk" else None)
    out = []
    try:
        with patch.object(topka_mod, "unpack_entries_capped", bad), \
                patch.object(Comm, "all_reduce", counting):
            for step in range(4):
                model.zero_grad()
                x, y = batch("cnn", rank, step)
                # before the backward: the job is sent during it, on the communication thread
                armed[0] = step == 2 and (who == "sender" or rank == world_size - 1)
                model_loss(model, "cnn", x, y).backward()
                before = {n: sync.ef.residual(n) for n in sync.params}
                before = {n: None if r is None else r.clone() for n, r in before.items()}
                reduces.clear()
                try:
                    sync.synchronize()
                    out.append(("applied", len(reduces)))
                    opt.step()
                except ValueError as e:
                    same = all(b is None or torch.equal(b, sync.ef.residual(n))
                               for n, b in before.items())
                    out.append((str(e), same))
    finally:
        if undo is not None:
            undo()
    sync.close()
    return out, gradsync.engine.consistency.parameter_digest(model)[0]


@pytest.mark.usefixtures("kernels")
@pytest.mark.accelerator_at(scheme=("topka", "densestream"), P=2)
@pytest.mark.parametrize(("scheme", "P"), [("topka", 2), ("topka", 3), ("densestream", 2),
                                         ("oktopk", 2)])
@pytest.mark.parametrize("who", ["sender", "link"])
def test_a_collective_whose_ranks_decode_every_message_needs_no_agreement_word(scheme, P, who):
    """TopkA at a fixed capacity, and DenseStream at P = 2, where each rank checks both
    messages: every rank decodes every message, so their checks (and a NaN a rank's message
    carries) show alike on every rank and the step makes no agreement all-reduce. A faulty
    sender's malformed message fails that step on every rank with the check's message,
    residuals as before; a message one rank alone receives corrupted (a link fault) fails that
    rank only, as usage.md documents, and its peers take the step. Nothing hangs either way."""
    outs = run_distributed(_malformed_alike, P, scheme, who, timeout=240)
    for rank, (out, _) in enumerate(outs):
        assert out[0][0] == out[1][0] == out[3][0] == "applied", (rank, out)
        assert out[1][1] == out[3][1] == 0, (rank, out)  # no agreement all-reduce
        if who == "sender" or rank == P - 1:
            msg, same = out[2]
            want = {"topka": "topka: a rank's message", "densestream": "rule 1",
                    "oktopk": "oktopk: rank 0's selection"}[scheme]
            assert want in msg and same, (rank, out[2])
        else:
            assert out[2] == ("applied", 0), (rank, out[2])
    digests = {d for _, d in outs}
    assert len(digests) == (1 if who == "sender" else 2)


def _diverge(rank, world_size):
    model = build("mlp", seed=1)
    sync = GradSync(model, Config(scheme="topka", density=0.1, warmup_steps=1, check_every=2))
    for step in range(4):
        model.zero_grad()
        x, y = batch("cnn", rank, step)
        model_loss(model, "cnn", x, y).backward()
        if step == 3 and rank == 1:
            with torch.no_grad():
                model.net[1].bias[0] += 1.0  # a replica drifts
        sync.synchronize()
    return "no error"


def test_check_every_detects_divergence():
    with pytest.raises(gradsync.testing.DistributedError,
                       match=r"first diverging parameter: net\.1\.bias"):
        run_distributed(_diverge, 2, timeout=120)


def test_gradsync_is_stateful_and_checks_identity_first():
    sync = GradSync(build("mlp"), Config(scheme="oktopk", density=0.05, warmup_steps=1))
    assert isinstance(sync, Stateful)
    me = sync.identity()
    assert (me.kind, me.rank, me.world_size, me.group) == ("oktopk", 0, 1, None)
    st = sync.state_dict()
    assert st["rank"] == 0 and st["world_size"] == 1
    with pytest.raises(ValueError, match="saved by 2 ranks"):
        sync.check_compatible({**st, "world_size": 2})
    with pytest.raises(ValueError, match="no rank/world_size"):
        sync.check_compatible({"config": st["config"]})
    with pytest.raises(ValueError, match="no config"):
        sync.check_compatible({k: v for k, v in st.items() if k != "config"})
    sync.check_compatible(st)  # its own state passes
    sync.close()


def test_plan_jobs_split_ssfusion_i_buffers_and_use_the_scheme_collective():
    """A per-tensor buffer becomes Buffer_AR (all-reduce) then Buffer_AG (the collective)."""
    tensors = (TensorPlan("a", 10, None, allreduce=True), TensorPlan("b", 100, 0.1),
               TensorPlan("c", 5, None), TensorPlan("d", 100, 0.1, offload=True))
    plan = Plan("ssfusion_oi", [BufferPlan((TensorPlan("x", 3, None),), "dense"),
                                BufferPlan(tensors, "per_tensor"),
                                BufferPlan((TensorPlan("y", 7, None),), "fused", 0.5)])
    jobs = plan_jobs(plan, "oktopk", ["a", "b", "c", "d", "x", "y"])
    assert [(j.names, j.mode, j.transport, j.wire) for j in jobs] == [
        (("x",), Mode.DENSE, Transport.ALLREDUCE, "allreduce"),
        (("a",), Mode.PER_TENSOR, Transport.ALLREDUCE, "allreduce"),
        # the tensors sent whole first: the selection's dense prefix (values, no indices)
        (("c", "b", "d"), Mode.PER_TENSOR, Transport.COLLECTIVE, "oktopk"),
        (("y",), Mode.FUSED, Transport.COLLECTIVE, "oktopk")]
    assert jobs[2].densities == {"b": 0.1, "c": None, "d": 0.1}
    assert jobs[2].offload == frozenset({"d"}) and jobs[3].density == 0.5
    with pytest.raises(ValueError, match="exactly once"):
        plan_jobs(plan, "oktopk", ["a", "b", "c", "d", "x", "y", "z"])


@pytest.mark.parametrize("scheme", ALL_SCHEMES)
def test_components_follow_the_table_of_schemes(scheme):
    spec = schemes.get(scheme)
    parts = Components(Config(scheme=scheme, density=0.05, sparsifier="randomk", seed=3), rank=1)
    coll = parts.collective("job:0")
    assert coll.name == spec.collective and parts.collective("job:0") is coll
    if "density" in spec.collective_options:  # Ok-Topk sizes its buckets from the density
        assert coll.density == 0.05
    sp = parts.sparsifier("net.1.weight", 0.05)
    assert sp.name == (spec.sparsifier or "randomk")
    assert parts.sparsifier("net.1.weight", 0.05) is sp  # cached while the density holds
    assert parts.sparsifier("net.1.weight", 0.02) is not sp
    # seeded by the one rule seed_for(seed, key, rank): random-k picks the same entries as a
    # sparsifier built by hand with that seed, and other entries on another rank
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))

    def picks(seed):
        return sparsify.get(sp.name, density=0.05, seed=seed).select(x, 0).indices

    mine = parts.new_sparsifier("net.1.weight", 0.05).select(x, 0).indices
    assert torch.equal(mine, picks(sparsify.seed_for(3, "net.1.weight", 1)))
    if sp.name == "randomk":
        assert not torch.equal(mine, picks(sparsify.seed_for(3, "net.1.weight", 0)))


# ------------------------------------------------------------------ start from rank 0's state
def _seeded_replica(seed: int) -> nn.Module:
    """A model whose parameters AND buffers depend on ``seed``: BatchNorm running statistics,
    a frozen layer and a bool buffer (set from the seed, so rebuilding it is bit-exact)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3),
                          nn.Linear(3, 3))
    model[4].requires_grad_(False)
    model.register_buffer("mask", torch.rand(5) > 0.5)
    model[1].running_mean.copy_(torch.randn(8))
    model[1].running_var.copy_(torch.rand(8) + 0.5)
    model[1].num_batches_tracked.fill_(seed)
    return model


def _states(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _start(rank, world_size, broadcast):
    model = _seeded_replica(100 + rank)
    before = _states(model)
    sync = GradSync(model, Config(scheme="topka", density=0.1, sparsifier="topk",
                                  warmup_steps=1, broadcast_initial=broadcast))
    after = _states(model)
    sync.close()
    return before, after


@pytest.mark.parametrize("P", [2, 3])
def test_every_rank_starts_from_rank_zeros_parameters_and_buffers(P):
    out = run_distributed(_start, P, True, timeout=120)
    ref = _states(_seeded_replica(100))  # rank 0's model, rebuilt here independently
    assert set(ref) >= {"0.weight", "1.running_mean", "1.running_var", "4.weight", "mask"}
    for rank, (before, after) in enumerate(out):
        assert set(after) == set(ref)
        for k in ref:
            assert after[k].dtype == ref[k].dtype and torch.equal(after[k], ref[k]), (rank, k)
        if rank:  # the broadcast did something: this rank started elsewhere
            assert not torch.equal(before["0.weight"], ref["0.weight"])
            assert not torch.equal(before["1.running_mean"], ref["1.running_mean"])
            assert not torch.equal(before["1.num_batches_tracked"], ref["1.num_batches_tracked"])
            assert not torch.equal(before["4.weight"], ref["4.weight"])  # frozen, too


@pytest.mark.parametrize("P", [2, 3])
def test_broadcast_initial_off_leaves_each_rank_its_own_start(P):
    out = run_distributed(_start, P, False, timeout=120)
    for rank, (before, after) in enumerate(out):
        mine = _states(_seeded_replica(100 + rank))
        for k in mine:
            assert torch.equal(after[k], mine[k]) and torch.equal(before[k], mine[k]), (rank, k)
    assert not torch.equal(out[0][1]["0.weight"], out[1][1]["0.weight"])
    assert not torch.equal(out[0][1]["1.running_var"], out[1][1]["1.running_var"])


def test_broadcast_initial_is_validated():
    with pytest.raises(ValueError, match="broadcast_initial"):
        Config(broadcast_initial=1)
    assert Config().broadcast_initial is True


def _warmup_traffic_rank(rank: int, world_size: int, cores: float, budget: str | None
                         ) -> list[int]:
    from conftest import image_batch
    from gradsync.schedule import costmodel

    costmodel.cores_per_rank = lambda: cores  # a spare core per rank, or none
    model = build("mlp", seed=1)
    sync = GradSync(model, Config(scheme="ssfusion", density=0.05, sparsifier="topk",
                                  warmup_steps=2, check_every=0, budget=budget))
    sent = []
    for step in range(2):  # the two profiling steps; the plan is made after the second
        model.zero_grad(set_to_none=True)
        x, y = image_batch(rank, step)
        nn.functional.cross_entropy(model(x), y).backward()
        sync.synchronize()
        sent.append(sync.last.bytes_sent)
    sync.close()
    return sent


@pytest.mark.parametrize(("cores", "budget"), [(4.0, None), (1.0, None), (4.0, "blend")])
def test_warmup_profiling_and_plan_broadcast_are_counted(cores, budget):
    """The step that ends the warm-up also sends the cost model's collective probes and the
    plan's broadcast, and counts them. P = 2, the default probes
    (:func:`conftest.probe_bytes_at_two_ranks`); rank 0 also broadcasts the plan (a length
    word and a pickle). Without a spare core the warm-up also
    times the scheme's sparse call (``profile_sparse_call``): 1 + 5 TopkA calls of one entry
    (its count, 8 B, then the entry, 8 B), the first behind a shape check (four int64 words),
    and the max-reduce of the medians (8 B). SSFusion's default budget (``"pooled"``) weighs
    nothing; ``"blend"`` sums the profiling steps' masses, one float64 per tensor
    (:mod:`gradsync.engine.warmup`)."""
    masses = 8 * len(list(build("mlp", seed=1).parameters())) * (budget == "blend")
    probes = (probe_bytes_at_two_ranks() + masses
              + (0 if cores >= 2 else 6 * 16 + 32 + 8))
    out = run_distributed(_warmup_traffic_rank, 2, cores, budget, timeout=180)
    extra = [s[1] - s[0] for s in out]  # the two profiling steps send the same gradients
    assert extra[1] == probes
    assert extra[0] > probes + 8  # rank 0: the probes and the plan it broadcasts


def test_an_all_reduce_in_flight_is_timed_to_its_completion_not_to_the_wait(monkeypatch):
    """The communication thread issues an all-reduce and returns (``JobResult.in_flight``);
    its seconds run from issue to the backend's completion, however late the training thread
    waits, and ``dense`` is read only after :meth:`JobResult.settle`. On an injected clock."""
    from gradsync.collectives.comm import CommStats
    from gradsync.engine import jobs
    from gradsync.engine.jobs import InFlight, JobResult

    class Clock:
        now = 100.0

        def perf_counter(self):
            return self.now

    clock = Clock()
    monkeypatch.setattr(jobs, "time", clock)

    class Work:  # a backend handle: completes when its future is set
        def __init__(self):
            self.fut = torch.futures.Future()
            self.waited = False

        def get_future(self):
            return self.fut

        def wait(self):
            self.waited = True
            return self.fut.wait()

    work, stats = Work(), CommStats()
    res = JobResult(torch.zeros(3), None, stats, in_flight=InFlight(work, stats, clock.now))
    clock.now += 0.05
    work.fut.set_result(None)  # the sum arrives 50 ms after issue
    clock.now += 0.2  # the training thread comes to wait much later
    assert res.settle() is res and work.waited and res.in_flight is None
    assert stats.seconds == pytest.approx(0.05)
    # no work (one rank, or a staged call that completed at issue): done at issue
    stats2 = CommStats()
    pending = JobResult(torch.zeros(1), None, stats2,
                        in_flight=InFlight(None, stats2, clock.now))
    clock.now += 1.0
    pending.settle()
    assert stats2.seconds == 0.0


@pytest.mark.parametrize("kept", [[0, 4], [4, 0], [1, 5], [-1, 2], []])
def test_apply_keeps_the_rest_and_refuses_kept_indices_outside_the_job(kept):
    """``apply`` on a fused job of tensors a (3 entries) and b (2): the residual is the
    accumulated gradient with the kept positions zeroed, whether the collective returned them
    sorted or not; a kept position outside [0, 5) is refused before any residual changes
    (``settle`` checks every job of a step in one read, before any is applied)."""
    from concurrent.futures import Future

    from gradsync.collectives.comm import CommStats
    from gradsync.engine.apply import apply, settle
    from gradsync.engine.audit import AuditSink
    from gradsync.engine.jobs import Job, JobResult, Launched
    from gradsync.engine.stats import StepStats
    from gradsync.feedback import ErrorFeedback

    params = {"a": nn.Parameter(torch.zeros(3)), "b": nn.Parameter(torch.zeros(2))}
    job = Job(("a", "b"), Mode.FUSED, Transport.COLLECTIVE, collective="topka", density=0.4)
    ef = ErrorFeedback()
    grads = {"a": torch.tensor([1.0, 2.0, 3.0]), "b": torch.tensor([4.0, 5.0])}
    acc = ef.accumulate_buffer(0, ("a", "b"), (3, 2), torch.cat([grads["a"], grads["b"]]))
    launched = Launched(job, 0, (3, 2), acc, Future())
    total = torch.arange(5, dtype=torch.float32)
    result = JobResult(dense=total.clone(), kept=torch.tensor(kept, dtype=torch.int64),
                       stats=CommStats())
    if any(not 0 <= i < 5 for i in kept):
        with pytest.raises(ValueError, match=r"outside the job's buffer"):
            settle([(launched, result)])
        res = ef.residual("a")  # nothing applied: no residual kept yet
        assert res is None or not res.any()
        return
    stats = StepStats()
    missing, _ = settle([(launched, result)])
    apply(launched, result, params, 2, ef, stats, 0, AuditSink(False))
    flat = torch.cat([grads["a"], grads["b"]])
    flat[kept] = 0
    assert torch.equal(torch.cat([ef.residual("a"), ef.residual("b")]), flat)
    assert torch.equal(torch.cat([params["a"].grad, params["b"].grad]), total / 2)
    assert stats.selected == len(kept) and stats.tensors == 2
    assert missing == (0 if len(kept) == 2 else 2)


class _ComputeOps(TorchDispatchMode):
    """Counts the aten ops that compute (not views, not allocations) on this thread: on a GPU
    each is at least one kernel launch."""

    FREE = frozenset({"empty", "empty_like", "empty_strided", "detach", "lift_fresh"})

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not (func.is_view or func.overloadpacket.__name__ in self.FREE):
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("scheme", ["topka", "oktopk"])
def test_the_training_thread_runs_few_ops_per_tensor(scheme):
    """On a GPU the engine's per-step cost is its kernel launches, made per tensor: a step of a
    40-tensor MLP (momentum on, after the warm-up) may add at most 10 ops per tensor to the
    forward and backward pass. The finiteness check alone took ten per tensor when each
    tensor's extremes went through torch.isfinite."""
    def mlp() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(*[m for _ in range(20) for m in (nn.Linear(16, 16), nn.Tanh())])

    x = torch.randn(8, 16)
    plain = mlp()  # without gradsync: the forward and backward pass alone
    plain(x).square().mean().backward()
    with _ComputeOps() as alone:
        plain(x).square().mean().backward()
    model = mlp()
    # one process: compress_single_rank, else a step is plain training and adds no op at all
    sync = GradSync(model, Config(scheme=scheme, density=0.05, momentum=0.9, warmup_steps=2,
                                  compress_single_rank=True))
    for _ in range(4):
        model.zero_grad(set_to_none=False)
        model(x).square().mean().backward()
        sync.synchronize()
    model.zero_grad(set_to_none=False)
    with _ComputeOps() as step:
        model(x).square().mean().backward()
        sync.synchronize()
    per_tensor = (step.count - alone.count) / len(list(model.parameters()))
    assert 0 < per_tensor <= 10, per_tensor
    sync.close()


@pytest.mark.parametrize("scheme", ["dense", "topka"])
def test_grad_views_the_job_storage_and_mixed_dtypes_fall_back_to_copies(scheme):
    """Every ``.grad`` of a job is a view of the job's flat storage after ``synchronize()``,
    whether autograd made a fresh gradient (``zero_grad()``) or accumulated into the view
    (``set_to_none=False``, step 2: the same tensor as before); a job of mixed dtypes has no
    storage and gets its averages copied, in each parameter's dtype. The averages are the
    compressed run's either way (density 1 here: the local gradients, at P = 1)."""

    class Mixed(nn.Module):
        def __init__(self, dtype):
            super().__init__()
            self.a = nn.Linear(6, 6)
            self.b = nn.Linear(6, 3).to(dtype)

        def forward(self, x):
            return self.b(self.a(x).to(self.b.weight.dtype)).float()

    for dtype, viewed in ((torch.float32, True), (torch.bfloat16, False)):
        torch.manual_seed(0)
        model = Mixed(dtype)
        sync = GradSync(model, Config(scheme=scheme, density=1.0, warmup_steps=1,
                                      compress_single_rank=True))
        seen = {}
        for step in range(3):
            model.zero_grad(set_to_none=step != 2)
            model(torch.randn(4, 6)).square().mean().backward()
            local = {n: p.grad.clone() for n, p in model.named_parameters()}
            sync.synchronize()
            for n, p in model.named_parameters():
                assert p.grad.dtype == p.dtype and torch.equal(p.grad, local[n]), (n, step)
                if step == 2:  # accumulated in place (step 0 ran the provisional plan)
                    assert p.grad is seen[n], (n, step)
                seen[n] = p.grad
        bases = {p.grad._base is not None for p in model.parameters()}
        assert bases == {viewed}
        sync.close()


def test_the_engine_keeps_its_state_by_role():
    """GradSync's own attributes are at most 15, each a role (the replica, the plan's layout,
    planning, counts, mixed precision, the engine's modes…); the figures users read
    (``step``, ``last``, ``total``, ``plan``, ``rank``, ``P``) follow the steps taken."""
    model = build("mlp", seed=1)
    sync = GradSync(model, Config(scheme="per_tensor", density=0.05, warmup_steps=1,
                                  compress_single_rank=True))
    try:
        assert len(vars(sync)) <= 15, sorted(vars(sync))
        for step in range(3):
            model_loss(model, "mlp", *batch("mlp", 0, step)).backward()
            sync.synchronize()
        assert (sync.step, sync.rank, sync.P, sync.passthrough) == (3, 0, 1, False)
        assert sync.total.bytes_sent == 0 and sync.total.numel > 0  # one rank sends nothing
        assert sync.plan is not None and sync.plan.scheme == "per_tensor"
        assert sync.stats()["step"] == 3
    finally:
        sync.close()
