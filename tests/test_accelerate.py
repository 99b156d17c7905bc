"""gradsync.accelerate.register with a real Accelerator under torchrun, 2 CPU ranks (gloo).

Launch 1 runs the README's snippet (README_SNIPPET, verbatim) for K steps, which ends with
``accelerator.save_state``, then trains N more steps. Launch 2, in new processes, runs the
README's resume snippet (RESUME_SNIPPET: the same set-up and ``accelerator.load_state``) and
the same N steps; every rank must end bitwise where launch 1 ended. Each rank writes what it
saw to ``{phase}{rank}.pt``.
"""

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

SETUP = """\
from accelerate import Accelerator, DistributedDataParallelKwargs as DDPKwargs
import gradsync

accelerator = Accelerator(cpu=True, kwargs_handlers=[DDPKwargs(gradient_as_bucket_view=True)])
model, optimizer = accelerator.prepare(model, optimizer)
cfg = gradsync.Config(scheme="per_tensor", density=0.1)
hook_state = gradsync.accelerate.register(accelerator, model, cfg)  # after prepare()
"""
# The README's Accelerate snippets; `model`, `optimizer`, `batches` and `torch` come before.
README_SNIPPET = SETUP + """\
for x, y in batches:
    optimizer.zero_grad()
    accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
    optimizer.step()
accelerator.save_state("ckpt")  # with each rank's gradsync state
print(hook_state.stats()["total"]["bytes_sent"])  # this rank's gradsync traffic
"""
RESUME_SNIPPET = SETUP + """\
accelerator.load_state("ckpt")  # each rank gets its own gradsync state back
"""
K, N, BATCH = 6, 6, 8
BUILT = "(gradient_as_bucket_view=True)])\n"  # the end of the line that builds the accelerator


def _net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s batch at `step`: a fixed regression task, different data per rank."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(BATCH, 16, generator=g)
    w = torch.randn(16, 4, generator=torch.Generator().manual_seed(7))
    return x, torch.tanh(x @ w)


def _steps(model, optimizer, accelerator, rank: int, steps) -> list[float]:
    """The training loop of the snippets over ``steps``; each step's loss."""
    losses = []
    for s in steps:
        x, y = _batch(s, rank)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        losses.append(loss.item())
    return losses


def _worker(out: str, phase: str) -> None:
    os.chdir(out)
    rank = int(os.environ["RANK"])
    model = _net(0 if phase == "train" else 1)  # the resumed run starts elsewhere on purpose
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ns = {"torch": torch, "model": model, "optimizer": optimizer,
          "batches": [_batch(s, rank) for s in range(K)]}
    exec(README_SNIPPET if phase == "train" else RESUME_SNIPPET, ns)
    model, optimizer, accelerator = ns["model"], ns["optimizer"], ns["accelerator"]
    losses = _steps(model, optimizer, accelerator, rank, range(K, K + N))
    res = {"stats": ns["hook_state"].stats(), "losses": losses,
           "distributed_type": accelerator.distributed_type.name,
           "bucket_views": model.gradient_as_bucket_view,
           "params": {k: v.detach().clone() for k, v in model.module.state_dict().items()}}
    if phase == "resume":  # then another configuration must not take the same checkpoint
        other = {"torch": torch, "model": _net(1)}
        other["optimizer"] = torch.optim.SGD(other["model"].parameters(), lr=0.05,
                                             momentum=0.9)
        try:
            exec(RESUME_SNIPPET.replace("density=0.1", "density=0.2"), other)
            res["refused"] = None
        except ValueError as e:
            res["refused"] = str(e)
    torch.save(res, os.path.join(out, f"{phase}{rank}.pt"))
    if phase == "resume":  # the same processes go on with the grad-scaler runs (one launch)
        accelerator.wait_for_everyone()
        _scaler_runs(out, rank)
        return
    accelerator.wait_for_everyone()
    torch.distributed.destroy_process_group()


def _scaler_runs(out: str, rank: int) -> None:
    """The set-up with a GradScaler in the accelerator (what ``Accelerator(mixed_precision=
    "fp16")`` creates on a GPU; on CPU Accelerate makes none, so one is handed to it before
    ``prepare``): the scale doubles every 2 steps, and ``register`` has the hook follow it.
    The model stays fp32, so with the scales powers of two the run must end bitwise where the
    same run without a scaler ends. A third run has the hook not follow the scaler."""
    runs = {}
    for name in ("plain", "scaled", "stale"):
        ns = {"torch": torch, "model": _net(0)}
        ns["optimizer"] = torch.optim.SGD(ns["model"].parameters(), lr=0.05, momentum=0.9)
        setup = SETUP.replace('density=0.1)', 'density=0.1, nonfinite="skip_step")')
        if name != "plain":
            setup = setup.replace(BUILT, BUILT + "accelerator.scaler = torch.amp.GradScaler("
                                  "'cpu', init_scale=2.0 ** 10, growth_interval=2)\n")
        exec(setup, ns)
        model, optimizer, accelerator = ns["model"], ns["optimizer"], ns["accelerator"]
        if name == "stale":
            ns["hook_state"].units.scaler = None
        scales = []
        for s in range(K + N):
            x, y = _batch(s, rank)
            optimizer.zero_grad()
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            scales.append(1.0 if accelerator.scaler is None else accelerator.scaler.get_scale())
        runs[name] = {"scales": scales, "params": {
            k: v.detach().clone() for k, v in model.module.state_dict().items()},
            "follows_rate": ns["hook_state"].units.optimizer is accelerator._optimizers[0]}
    runs["adamw"] = _adamw_runs(rank)
    torch.save(runs, os.path.join(out, f"scaler{rank}.pt"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _adamw_runs(rank: int) -> dict:
    """torch's AdamW prepared by the accelerator: ``register`` refuses it without
    ``adam_warmup``, and with it (and a GradScaler, whose bound step Accelerate keeps) puts
    FrozenVarianceAdamW in the AcceleratedOptimizer the script holds."""
    res: dict = {}
    for warmup in (None, 3):
        ns = {"torch": torch, "model": _net(0)}
        ns["optimizer"] = torch.optim.AdamW(ns["model"].parameters(), lr=1e-2)
        setup = SETUP.replace('density=0.1)', 'density=0.1, nonfinite="skip_step")').replace(
            BUILT, BUILT + "accelerator.scaler = torch.amp.GradScaler('cpu', "
                           "init_scale=2.0 ** 10)\n")
        if warmup is not None:
            setup = setup.replace("(accelerator, model, cfg)",
                                  f"(accelerator, model, cfg, adam_warmup={warmup})")
        try:
            exec(setup, ns)
        except ValueError as e:
            res["refused"] = str(e)
            continue
        model, optimizer, accelerator = ns["model"], ns["optimizer"], ns["accelerator"]
        losses = _steps(model, optimizer, accelerator, rank, range(K + N))
        res.update(losses=losses, optimizer=type(optimizer.optimizer).__name__,
                   config=ns["hook_state"].cfg.to_dict(),
                   steps=[st["step"] for st in optimizer.optimizer.state.values()])
    return res


def _torchrun(out, phase: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [os.path.join(os.path.dirname(__file__), "..", "src"), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node=2", __file__, str(out), phase],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """The training launch, then the resumed one, which goes on with the grad-scaler runs."""
    out = tmp_path_factory.mktemp("accelerate")
    _torchrun(out, "train")
    _torchrun(out, "resume")
    return out


def test_accelerate_save_state_load_state_bitwise(launched):
    tmp_path = launched
    full = [torch.load(tmp_path / f"train{r}.pt") for r in range(2)]
    resumed = [torch.load(tmp_path / f"resume{r}.pt") for r in range(2)]
    for f, g in zip(full, resumed):
        assert f["distributed_type"] == "MULTI_CPU"
        assert f["bucket_views"] is True  # the snippet keeps .grad in the buckets
        assert f["stats"]["calls"] == K + N and f["stats"]["total"]["bytes_sent"] > 0
        assert g["stats"]["calls"] == N and g["stats"]["total"]["bytes_sent"] > 0
        assert f["losses"][-1] < f["losses"][0]
        assert f["losses"] == g["losses"]
        for k, v in f["params"].items():
            assert torch.equal(g["params"][k], v), k
    for k, v in full[0]["params"].items():
        assert torch.equal(full[1]["params"][k], v), k
    # the main process wrote one file holding both ranks' own (different) residuals
    saved = torch.load(tmp_path / "ckpt" / "custom_checkpoint_0.pkl", weights_only=False)
    assert saved["world_size"] == 2 and [s["rank"] for s in saved["ranks"]] == [0, 1]
    r0, r1 = (s["feedback"]["residual"] for s in saved["ranks"])
    assert set(r0) == {n for n, _ in _net(0).named_parameters()} == set(r1)
    assert any(not torch.equal(r0[n], r1[n]) for n in r0)
    # another configuration is refused on every rank (after the resumed run, same launch)
    for g in resumed:
        assert g["refused"] is not None and "density: saved 0.1, here 0.2" in g["refused"]


def test_register_follows_the_accelerators_grad_scaler_bit_for_bit(launched):
    for r in range(2):
        runs = torch.load(launched / f"scaler{r}.pt")
        assert len(set(runs["scaled"]["scales"])) > 3  # the scale grew step after step
        assert runs["scaled"]["follows_rate"]  # and the hook follows the optimizer's rate
        plain, scaled, stale = (runs[k]["params"] for k in ("plain", "scaled", "stale"))
        assert all(torch.equal(scaled[k], v) for k, v in plain.items())
        assert not all(torch.equal(stale[k], v) for k, v in plain.items())


def test_register_applies_the_adamw_recipe(launched):
    """torch's AdamW: refused without ``adam_warmup`` (the message gives the fix); with it,
    FrozenVarianceAdamW steps in the AcceleratedOptimizer (under a GradScaler), AdamW's beta1
    goes into error feedback, the warm-up travels whole, and the loss falls."""
    for r in range(2):
        a = torch.load(launched / f"scaler{r}.pt")["adamw"]
        assert "adam_warmup=N" in a["refused"] and "AdamW" in a["refused"]
        assert a["optimizer"] == "FrozenVarianceAdamW"
        assert a["config"]["momentum"] == 0.9
        assert (a["config"]["density_warmup"], a["config"]["density_warmup_steps"]) == ((1.0,), 3)
        assert a["steps"] and set(a["steps"]) == {K + N}  # every step reached the optimizer
        assert sum(a["losses"][-3:]) < 0.5 * sum(a["losses"][:3]), a["losses"]


def test_register_refuses_a_model_without_ddp(monkeypatch):
    from accelerate import Accelerator

    import gradsync

    accelerator = Accelerator(cpu=True)  # one process: prepare() does not wrap in DDP
    model = accelerator.prepare(_net(0))
    cfg = gradsync.Config(scheme="per_tensor")
    with pytest.raises(TypeError, match=r"DistributedDataParallel.*torchrun --nproc-per-node"):
        gradsync.accelerate.register(accelerator, model, cfg)
    # torchrun's processes without cpu=True: Accelerate runs each alone, and says so
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(TypeError, match=r"2 processes were launched.*Accelerator\(cpu=True\)"):
        gradsync.accelerate.register(accelerator, model, cfg)


def test_docstring_shows_the_tested_snippet():
    import textwrap

    import gradsync.integrations.accelerate as mod

    assert textwrap.indent(README_SNIPPET, "    ") in mod.__doc__


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
