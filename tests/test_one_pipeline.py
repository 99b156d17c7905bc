"""One step pipeline (issue 42): the DDP hook and :class:`gradsync.GradSync` run the same code.

A DDP bucket is handed to the engine's jobs, ``prepare`` and ``commit``, so a hook whose bucket
holds the whole model must train exactly as the engine does with a plan of one per-tensor
buffer over the same tensors in the same order and at the same densities: parameters equal bit
for bit after several steps, with momentum correction, SSFusion-I's all-reduce part and DGC's
warm-up (a step at density 1, then lower densities) in play. The reference is the engine's
own run, not the hook's code: a difference in either path's selection, error feedback or
averaging fails it.
"""

import contextlib
import itertools
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsync.integrations.ddp
from conftest import batch, image_batch, pin_profiles
from conftest import loss as model_loss
from gradsync.apps.models import build
from gradsync.engine import GradSync
from gradsync.engine.config import Config
from gradsync.integrations.ddp import HookState, _densities
from gradsync.integrations.ddp import _sparse_hook as SPARSE_HOOK
from gradsync.schedule import BufferPlan, Plan, TensorPlan
from gradsync.schedule.ssfusion import hook_interleaves
from gradsync.testing import run_distributed

STEPS = 6
D = 0.05


def _model() -> nn.Module:
    """Small enough for one DDP bucket (DDP's first bucket holds 1 MiB)."""
    torch.manual_seed(3)
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 48), nn.ReLU(), nn.Linear(48, 32),
                         nn.ReLU(), nn.Linear(32, 10))


def _config(scheme: str, warmup: bool | tuple[float, ...], plan: dict | None = None,
            ahead: float = 0.0, budget: str = "even") -> Config:
    """``warmup``: True for DGC's warm-up (1.0, 0.25), 2 steps a period; a tuple: those
    periods' densities; False: none (not the scheme's default). One density for every tensor
    (``budget="even"``): the engine's run is given the hook's plan, which a budget by the
    gradient's mass would then leave behind (test_budget.py compares the two budgets); or
    ``budget="pooled"``, which weighs nothing."""
    periods = (1.0, 0.25) if warmup is True else warmup
    extra = (dict(density_warmup=periods, density_warmup_steps=2) if warmup
             else dict(density_warmup=()))
    return Config(scheme=scheme, density=D, sparsifier="topk", momentum=0.9, seed=7,
                  plan=plan, momentum_ahead=ahead, budget=budget, **extra)


def _plan(scheme: str, small_numel: int, P: int, order: list[str], pooled: bool = False
          ) -> dict:
    """The hook's one bucket as an engine plan: DDP's order, the hook's own densities (size
    threshold, compensation, Config.min_k), SSFusion-I's whole tensors in the all-reduce part;
    ``pooled``: the sparsified tensors by name, as the hook lays a pool out (engine.jobs), and
    nothing sent whole (a pool's K counts, not a tensor's k: schedule/ssfusion.py)."""
    model = _model()
    state, _ = gradsync.ddp.hook(_config(scheme, False, budget="pooled" if pooled else "even"),
                                 model=model, small_numel=small_numel)
    numel = {n: p.numel() for n, p in model.named_parameters()}
    numels = [numel[n] for n in order]

    class _Group:  # the hook charges tensors sent whole by the world size
        size = P

    dens = _densities(state, numels, 4, _Group())
    interleave = hook_interleaves(state.scheme.interleave, "cpu")
    tensors = tuple(TensorPlan(n, k, d, allreduce=d is None and interleave)
                    for n, k, d in zip(order, numels, dens))
    # both kinds; under the pooled budget every tensor in the pool
    assert any(d is None for d in dens) != pooled and any(d is not None for d in dens)
    if pooled:
        tensors = (*[t for t in tensors if t.density is None],
                   *sorted((t for t in tensors if t.density is not None), key=lambda t: t.name))
    return Plan(scheme, [BufferPlan(tensors, "per_tensor")]).to_dict()


ORDER: list[list[str]] = []  # the bucket's parameters at each hook call (DDP's order)


def _recording(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    ORDER.append([state.name_of(p) for p in bucket.parameters()])
    return SPARSE_HOOK(state, bucket)


def _train(rank: int, P: int, scheme: str, small_numel: int, warmup: bool | tuple[float, ...],
           plan: dict | None, ahead: float, budget: str = "even") -> torch.Tensor:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if plan is None:  # the hook
        net, sync = DDP(model, bucket_cap_mb=25), None
        state, _ = gradsync.ddp.hook(_config(scheme, warmup, ahead=ahead, budget=budget),
                                     model=model, small_numel=small_numel)
        net.register_comm_hook(state, _recording)
    else:
        net, sync = model, GradSync(model, _config(scheme, warmup, plan, ahead, budget))
    try:
        for step in range(STEPS):
            x, y = image_batch(rank, step, 16)
            opt.zero_grad(set_to_none=True)
            # DDP lays the bucket out in registration order at the first step and rebuilds it
            # in gradient order after; at P = 3 the order decides the all-reduce's rounding.
            # The first step's gradients are zero, so both paths hold zeros whatever the layout
            loss = nn.functional.cross_entropy(net(x), y) * (step > 0)
            loss.backward()
            if sync is not None:
                assert sync.synchronize()
            opt.step()
    finally:
        if sync is not None:
            sync.close()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _run(rank: int, P: int, scheme: str, small_numel: int, warmup: bool | tuple[float, ...],
         ahead: float = 0.0, budget: str = "even") -> dict:
    # the engine's profiling steps run a provisional plan (a cost-model scheme's: every tensor
    # whole) before it takes Config.plan; the hook has none. Here the given plan runs from the
    # first step, so the two paths start alike and only their pipelines are compared.
    from gradsync.engine import warmup as profiling
    from gradsync.schedule import costmodel

    costmodel.cores_per_rank = lambda: 4.0  # a spare core: the hook splits SSFusion-I's buckets
    profiling.provisional_plan = lambda cfg, order, numel: Plan.from_dict(cfg.plan)
    hook = _train(rank, P, scheme, small_numel, warmup, None, ahead, budget)
    assert len(ORDER) == STEPS and all(o == ORDER[1] for o in ORDER[1:])  # one bucket
    plan = _plan(scheme, small_numel, P, ORDER[1], budget == "pooled")  # after DDP's rebuild
    engine = _train(rank, P, scheme, small_numel, warmup, plan, ahead, budget)
    pooled = budget == "pooled" and not torch.equal(engine, _train(
        rank, P, scheme, small_numel, warmup, plan, ahead))  # the budget is in play
    start = torch.cat([p.detach().reshape(-1) for p in _model().parameters()])
    # the lead is in play: without it the engine trains to other parameters
    led = bool(ahead) and not torch.equal(engine, _train(rank, P, scheme, small_numel, warmup,
                                                         plan, 0.0))
    return {"hook": hook, "engine": engine, "moved": not torch.equal(hook, start), "led": led,
            "pooled": pooled}


@pytest.mark.usefixtures("kernels")
@pytest.mark.accelerator_at(P=3)
@pytest.mark.parametrize(("scheme", "small_numel", "warmup", "ahead"), [
    ("per_tensor", 0, False, 0.0), ("ssfusion_oi", 1000, False, 0.0),
    ("ssfusion", 1000, True, 0.0), ("per_tensor", 0, True, 0.0),
    ("ssfusion_oi", 1000, True, 0.0),
    # momentum sent ahead (Config.momentum_ahead): the lead on the selected entries only
    ("ssfusion_oi", 1000, True, 1 / 3), ("per_tensor", 0, False, 1 / 3),
    # a warm-up period below a fifth of each tensor (10 % at 5 %): the lead at half its share
    ("ssfusion_oi", 1000, (1.0, 0.1), 1 / 3),
    # 60 % selects over 1/P of the entries at P = 2 and 3: that selection all-reduced densified
    ("per_tensor", 0, (0.6, 0.1), 0.0), ("ssfusion_oi", 1000, (0.6, 0.1), 1 / 3)])
@pytest.mark.parametrize("P", [2, 3])
def test_the_hook_trains_as_the_engine_bit_for_bit(P, scheme, small_numel, warmup, ahead):
    out = run_distributed(_run, P, scheme, small_numel, warmup, ahead, timeout=300)
    for r in out:
        assert r["moved"] and r["led"] == bool(ahead)
        assert torch.equal(r["hook"], r["engine"]), (r["hook"] - r["engine"]).abs().max()


@pytest.mark.parametrize(("scheme", "small_numel", "warmup", "ahead"), [
    ("per_tensor", 0, False, 0.0), ("ssfusion_oi", 1000, True, 1 / 3)])
@pytest.mark.parametrize("P", [2, 3])
def test_the_hook_pools_as_the_engine_bit_for_bit(P, scheme, small_numel, warmup, ahead):
    """``Config.budget="pooled"`` through both doors: the same selections, bit for bit."""
    out = run_distributed(_run, P, scheme, small_numel, warmup, ahead, "pooled", timeout=300)
    for r in out:
        assert r["moved"] and r["pooled"] and r["led"] == bool(ahead)
        assert torch.equal(r["hook"], r["engine"]), (r["hook"] - r["engine"]).abs().max()


def _hook_warmup_bytes(rank: int, P: int, scheme: str) -> dict:
    """Bytes of each hook step with a 60 % period (steps 0-1), then 20 % (2-3), then 5 %."""
    from gradsync.collectives.comm import ring_allreduce_bytes

    model = _model()
    net = DDP(model, bucket_cap_mb=25)
    state = gradsync.ddp.register(net, Config(scheme=scheme, density=D, momentum=0.9,
                                              density_warmup=(0.6, 0.2), density_warmup_steps=2))
    sent = [0]
    for step in range(6):
        x, y = image_batch(rank, step, 16)
        net.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        sent.append(state.stats()["total"]["bytes_sent"])
    n = sum(p.numel() for p in model.parameters())
    return {"steps": [b - a for a, b in itertools.pairwise(sent)],
            "ring": ring_allreduce_bytes(4 * n, P)}


@pytest.mark.parametrize("scheme", ["per_tensor", "ssfusion_oi"])
def test_the_hook_all_reduces_a_warmup_selection_of_1_over_P_or_more(scheme):
    """Through the DDP hook, as through the engine (``engine.jobs.at_density``): at P = 3 a
    60 % period's selection travels densified in an all-reduce, about DDP's bytes (the ring's,
    with the agreement words), not the 2.4× an all-gather of it sends; 20 % (under 1/3)
    all-gathers again, and 5 % sends a fraction."""
    for r in run_distributed(_hook_warmup_bytes, 3, scheme, timeout=300):
        sent, ring = r["steps"], r["ring"]
        assert all(abs(b - ring) <= 0.01 * ring for b in sent[:2]), (sent, ring)
        assert all(b < 0.9 * ring for b in sent[2:4]), (sent, ring)
        assert all(b < 0.3 * ring for b in sent[4:]), (sent, ring)


class _Above(gradsync.sparsify.Sparsifier):
    """Selects the entries above 1 in magnitude: none, for a tensor of small values."""

    def _select(self, x: torch.Tensor, k: int, step: int) -> torch.Tensor:
        return torch.nonzero(x.abs() > 1.0).view(-1)


@pytest.mark.parametrize("segmented", [False, True])
def test_missing_tensors_known_on_the_host_equal_the_count_from_the_positions_kept(
        segmented, request):
    """A per-tensor job's missing tensors, counted on the host from its selections' sizes
    (``Payload.known_missing``: TopkA kept this rank's own selection), equal
    :func:`~gradsync.engine.apply.job_check`'s count from the positions kept, with tensors
    that select nothing, a tensor sent whole first, and the segmented selection (DGC, which
    never leaves a tensor empty); a collective that returns other positions is left to the
    device count (None)."""
    from conftest import segmented as segmented_kernels
    from gradsync import collectives, sparsegrad, sparsify
    from gradsync.engine.apply import job_check, settle_missing
    from gradsync.engine.jobs import Job, Mode, Transport
    from gradsync.engine.prepare import prepare
    from gradsync.feedback import ErrorFeedback

    stack = contextlib.ExitStack()
    stack.enter_context(sparsegrad.using(segmented_kernels(segmented)))
    request.addfinalizer(stack.close)
    g = torch.Generator().manual_seed(0)
    sizes = [30, 200, 50, 300, 40]
    names = tuple(f"t{i}" for i in range(len(sizes)))
    grad = torch.cat([torch.randn(n, generator=g) * (3.0 if i % 2 else 0.1)
                      for i, n in enumerate(sizes)])
    job = Job(names, Mode.PER_TENSOR, Transport.COLLECTIVE, "topka",
              densities={"t0": None, **{n: 0.1 for n in names[1:]}})
    make = (lambda key, d: sparsify.get("dgc", density=d)) if segmented else \
        (lambda key, d: _Above(d))
    prep = prepare(job, 0, grad, sizes, ErrorFeedback(), make, None, 0)
    msg = prep.payload.message(job, prep.payload.selections)
    res = collectives.get("topka")(msg)
    (device,), _ = settle_missing([job_check(sizes, res.kept)], "x")
    assert prep.payload.known_missing(msg, res.kept) == device == (0 if segmented else 2)
    assert prep.payload.known_missing(msg, res.kept.clone()) is None


@pytest.mark.usefixtures("kernels")
def test_a_fused_jobs_missing_tensors_are_counted_when_selected_on_the_cpus_kernels():
    """A fused job (one selection over the buffer: TopkA's) counts its tensors with no entry
    right after selecting, on the host, where the CPU's own kernels run: the count
    :func:`~gradsync.engine.apply.job_check` makes from the positions TopkA kept, which the
    step then skips; on the accelerators' kernels nothing is counted before the collective."""
    from gradsync import collectives, sparsegrad, sparsify
    from gradsync.engine.apply import job_check, settle_missing
    from gradsync.engine.jobs import Job, Mode, Transport
    from gradsync.engine.prepare import prepare
    from gradsync.feedback import ErrorFeedback

    g = torch.Generator().manual_seed(1)
    sizes = [30, 200, 50, 300, 40]
    names = tuple(f"t{i}" for i in range(len(sizes)))
    # tensors 0, 2 and 4 small enough that a 5 % top-k of the buffer skips them
    grad = torch.cat([torch.randn(n, generator=g) * (3.0 if i % 2 else 0.01)
                      for i, n in enumerate(sizes)])
    job = Job(names, Mode.FUSED, Transport.COLLECTIVE, "topka", density=0.05)
    prep = prepare(job, 0, grad, sizes, ErrorFeedback(),
                   lambda key, d: sparsify.get("topk", density=d), None, 0)
    msg = prep.payload.message(job, prep.payload.selections)
    res = collectives.get("topka")(msg)
    (device,), _ = settle_missing([job_check(sizes, res.kept)], "x")
    assert device == 3
    host = sparsegrad.host_kernels(grad)
    assert prep.payload.missing == (device if host else None)
    assert prep.payload.known_missing(msg, res.kept) == (device if host else None)


@pytest.mark.usefixtures("kernels")
@pytest.mark.parametrize("nan_in", ["t1", "t3"])
def test_a_job_with_a_non_finite_gradient_accumulates_as_zeros_on_every_device(nan_in):
    """The engine's non-finite rule is the hook's, whatever the kernels: ``prepare`` reads
    nothing, leaves the job's flag on the device, and a job whose gradients hold a NaN (in a
    tensor sent whole or a selected one) accumulates as zeros, so its selection carries no
    value and its residual no NaN; a finite job's flag is true and its accumulator is its
    gradients."""
    from gradsync import sparsify
    from gradsync.engine.jobs import Job, Mode, Transport
    from gradsync.engine.prepare import prepare
    from gradsync.feedback import ErrorFeedback

    g = torch.Generator().manual_seed(1)
    sizes = [30, 200, 50, 300]
    names = tuple(f"t{i}" for i in range(len(sizes)))
    job = Job(names, Mode.PER_TENSOR, Transport.COLLECTIVE, "topka",
              densities={"t0": None, "t1": None, "t2": 0.1, "t3": 0.1})
    grad = torch.randn(sum(sizes), generator=g)

    def make(key, d):
        return sparsify.get("topk", density=d)

    ok = prepare(job, 0, grad.clone(), sizes, ErrorFeedback(), make, None, 0)
    assert ok.finite is not None and bool(ok.finite) and torch.equal(ok.acc, grad)
    bad = grad.clone()
    at = {"t1": 30 + 7, "t3": 280 + 11}[nan_in]
    bad[at] = math.nan
    prep = prepare(job, 0, bad, sizes, ErrorFeedback(), make, None, 0)
    assert prep.finite is not None and not bool(prep.finite)
    assert torch.equal(prep.acc, torch.zeros_like(grad))
    assert all(float(sel.values.abs().sum()) == 0.0 for sel in prep.payload.selections)


def _bytes_both_paths(rank: int, P: int, model_name: str, scheme: str) -> dict:
    """The last step's bytes (after the engine's warm-up) of ``scheme`` at 1 % through the
    engine and through the DDP hook given the model, and what the hook says it sends."""
    import warnings

    pin_profiles()
    out = {}
    for path in ("engine", "hook"):
        model = build(model_name, seed=0)
        cfg = Config(scheme=scheme, density=0.01, density_warmup=())  # 1 % from the start
        if path == "engine":
            net, sync = model, GradSync(model, cfg)
        else:
            net, sync = DDP(model), None
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                state = gradsync.ddp.register(net, cfg)
                sent = []
                for step in range(2):
                    net.zero_grad()
                    model_loss(net, model_name, *batch(model_name, rank, step)).backward()
                    sent.append(state.stats()["total"]["bytes_sent"])
            out["warned"] = [str(w.message) for w in seen]
            out["density"] = state.stats()["density"]
            out["hook"] = sent[1] - sent[0]  # the second step's, every bucket's
            continue
        sent = []
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for step in range(cfg.warmup_steps + 2):
                net.zero_grad()
                model_loss(net, model_name, *batch(model_name, rank, step)).backward()
                sync.synchronize()
                sent.append(sync.stats()["total"]["bytes_sent"])
        out["engine_warned"] = [str(w.message) for w in seen if "gradsync" in str(w.message)]
        out["engine_density"] = sync.stats()["density"]
        out["engine"] = sent[-1] - sent[-2]
        sync.close()
    out["dense"] = 4 * sum(p.numel() for p in build(model_name, seed=0).parameters())
    return out


@pytest.mark.parametrize("model_name", ["cnn", "gpt_tiny"])
def test_the_hook_sends_what_the_engine_sends_for_ssfusion(model_name):
    """Issue 67: through the DDP hook (Lightning's, Accelerate's, the Trainer's path)
    SSFusion-I on TinyGPT sent the dense gradient whatever the density: every tensor is below
    the hook's 102,400-entry threshold, so none was sparsified. Now the hook keeps small
    tensors whole only within the density budget: at 1 % it sends within 5 % of the engine's
    bytes (planned from its cost model), and within 10 % of what 1 % of the entries cost
    all-gathered at P = 2 (an fp32 value and an int32 index each, to one peer; a selection
    sends fewer where it holds zeros). Summed over the two ranks: their selections differ in
    size step by step (±10 % on the CNN)."""
    out = run_distributed(_bytes_both_paths, 2, model_name, "ssfusion_oi", timeout=300)
    hook, engine = (sum(r[path] for r in out) for path in ("hook", "engine"))
    target = 2 * 0.01 * out[0]["dense"] / 4 * (4 + 4)
    assert abs(hook - target) <= 0.1 * target, (hook, engine, target)
    assert abs(hook - engine) <= 0.05 * engine, (hook, engine, target)
    for r in out:
        assert r["density"]["requested"] == 0.01
        assert r["density"]["sent"] == pytest.approx(0.01, rel=0.05)
        assert r["engine_density"]["sent"] == pytest.approx(0.01, rel=0.05)
        assert r["warned"] == [] and r["engine_warned"] == []


class _ManySmall(nn.Module):
    """30 tensors of 48 entries beside one of 262,144: at 1 %, with Config.min_k = 8, the 30 must
    travel whole (k would be 0.48 → 1 < 8; 27 % of the budget at half an entry per element,
    within ssfusion.MIN_K_SHARE), and with the density floor at the density (min_density
    0.01) the large one cannot pay for them."""

    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Linear(512, 512, bias=False)
        self.small = nn.ParameterList([nn.Parameter(torch.randn(48) * 0.1) for _ in range(30)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.big(x) + sum(p.sum() for p in self.small)


def _honoured(rank: int, P: int) -> dict:
    import warnings

    torch.manual_seed(0)
    model = _ManySmall()
    net = DDP(model)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        state = gradsync.ddp.register(net, Config(scheme="ssfusion_oi", density=0.01,
                                                  min_k=8, min_density=0.01, budget="blend"))
        for step in range(3):
            net.zero_grad()
            net(torch.randn(4, 512, generator=torch.Generator().manual_seed(step + rank))).sum(
            ).backward()
    return {"warned": [str(w.message) for w in seen if "gradsync" in str(w.message)],
            "density": state.stats()["density"]}


def _honoured_engine(rank: int, P: int) -> dict:
    import warnings

    pin_profiles()
    torch.manual_seed(0)
    model = _ManySmall()
    sync = GradSync(model, Config(scheme="ssfusion_oi", density=0.01, min_k=8,
                                  min_density=0.01))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for step in range(sync.cfg.warmup_steps + 2):
            model.zero_grad()
            model(torch.randn(4, 512, generator=torch.Generator().manual_seed(step + rank))).sum(
            ).backward()
            sync.synchronize()
    out = {"warned": [str(w.message) for w in seen if "gradsync" in str(w.message)],
           "density": sync.stats()["density"]}
    sync.close()
    return out


def test_the_engine_says_once_when_the_density_cannot_be_honoured():
    """The engine's SSFusion-I on the same model: its plan sends the 30 small tensors whole too
    (Config.min_k), so it says once, on rank 0, what it sends instead."""
    out = run_distributed(_honoured_engine, 2, timeout=120)
    for r in out:
        assert r["density"]["requested"] == 0.01 and r["density"]["sent"] > 0.0105
    assert len(out[0]["warned"]) == 1 and out[1]["warned"] == []
    assert "ssfusion_oi cannot send density 0.01" in out[0]["warned"][0]
    assert f"sends {out[0]['density']['sent']:.4g}" in out[0]["warned"][0]


def test_the_hook_says_once_when_the_density_cannot_be_honoured():
    from gradsync.schedule.ssfusion import allreduce_charge

    out = run_distributed(_honoured, 2, timeout=120)
    # the 30 all-reduced whole, at what that costs in entries; the large one at the floor d′ =
    # 0.01: k = round(2621.44) = 2621
    want = (30 * 48 * allreduce_charge(2, 4) + 2621) / (30 * 48 + 512 * 512)
    for r in out:
        assert r["density"]["sent"] == pytest.approx(want)
    assert len(out[0]["warned"]) == 1 and out[1]["warned"] == []  # once, rank 0 only
    assert "cannot send density 0.01" in out[0]["warned"][0]
    assert f"sends {want:.4g}" in out[0]["warned"][0]
