"""gradsync.lightning.GradSyncStrategy with a real pytorch-lightning Trainer on 2 CPU ranks.

The test launches this file under torchrun (``python -m torch.distributed.run``, gloo): each
process is one rank and Lightning detects the torchrun environment. The worker trains with the
README's snippet (README_SNIPPET, executed verbatim), then again for one epoch, saves a
checkpoint, resumes it in a fresh Trainer and compares the final parameters bitwise; finally it
tries to resume with another configuration. Each rank writes what it saw to ``rank{r}.pt``.
"""

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from gradsync import Config
from gradsync.integrations import ranks
from gradsync.integrations.ddp import hook

# The README's Lightning snippet; `module` and `loader` are defined around it.
README_SNIPPET = """\
import pytorch_lightning as pl
import gradsync

cfg = gradsync.Config(scheme="per_tensor", density=0.1)
strategy = gradsync.lightning.GradSyncStrategy(cfg)
trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=2)
trainer.fit(module, loader)  # torchrun --nproc-per-node 2 train.py
print(strategy.stats()["total"]["bytes_sent"])  # this rank's gradsync traffic
trainer.save_checkpoint("last.ckpt")  # every rank's gradsync state, each its own
"""
CONFIG = {"scheme": "per_tensor", "density": 0.1}  # the snippet's
EPOCHS, SAMPLES, BATCH = 2, 256, 16


def _worker(out: str, phase: str) -> None:
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader, TensorDataset

    from gradsync.integrations.lightning import GradSyncStrategy

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))
            self.losses: list[float] = []
            self.momentum = 0.9

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=self.momentum)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 16, generator=g)
    y = torch.tanh(x @ torch.randn(16, 4, generator=g)) + 0.01 * torch.randn(SAMPLES, 4,
                                                                            generator=g)
    loader = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)

    def model(seed: int, momentum: float = 0.9) -> Regression:
        torch.manual_seed(seed)
        m = Regression()
        m.momentum = momentum
        return m

    def trainer(strategy, epochs: int, devices: int = 2) -> pl.Trainer:
        return pl.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_epochs=epochs,
                          logger=False, enable_checkpointing=False, enable_progress_bar=False,
                          enable_model_summary=False, num_sanity_val_steps=0)

    def params(m: nn.Module) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in m.state_dict().items()}

    os.chdir(out)
    ckpt = os.path.join(out, "epoch1.ckpt")
    cfg = Config(**CONFIG)
    res: dict = {}
    if phase == "one":  # a 1-rank job resuming the 2-rank checkpoint
        try:
            trainer(GradSyncStrategy(cfg), EPOCHS, devices=1).fit(model(0), loader, ckpt_path=ckpt)
        except ValueError as e:
            res["refused"] = str(e)
        torch.save(res, os.path.join(out, "one.pt"))
        return
    # 1. the README snippet, uninterrupted (under "popen" Lightning starts rank 1 itself)
    ns = {"module": model(0), "loader": loader}
    exec(README_SNIPPET, ns)
    rank = ns["trainer"].global_rank
    res["stats"] = ns["strategy"].stats()
    res["losses"] = ns["module"].losses
    res["full"] = params(ns["module"])
    if phase == "main":
        # 2. one epoch, checkpoint, resume in a fresh Trainer (and a differently initialised
        # model)
        first = model(0)
        t = trainer(GradSyncStrategy(cfg), 1)
        t.fit(first, loader)
        t.save_checkpoint(ckpt)
        second = model(1)
        resumed = GradSyncStrategy(cfg)
        trainer(resumed, EPOCHS).fit(second, loader, ckpt_path=ckpt)
        res["resumed"] = params(second)
        res["resumed_calls"] = resumed.stats()["calls"]
        # a second fit() of the same Trainer goes on with the residuals of the first (its
        # optimizer is created anew, so without momentum to compare with one fit)
        for name, fits in (("once", (EPOCHS,)), ("twice", (1, EPOCHS))):
            m = model(0, momentum=0.0)
            t = trainer(GradSyncStrategy(cfg), fits[0])
            for epochs in fits:
                t.fit_loop.max_epochs = epochs
                t.fit(m, loader)
            res[name] = params(m)
        # 3. the same checkpoint with another configuration is refused, and so is one without
        # gradsync state
        res["refused"] = {}
        plain = os.path.join(out, "plain.ckpt")
        if rank == 0:
            c = torch.load(ckpt, weights_only=False)
            del c["gradsync"]
            torch.save(c, plain)
        torch.distributed.barrier()
        for what, c, path in (("config", Config(**{**CONFIG, "density": 0.2}), ckpt),
                              ("missing", cfg, plain)):
            try:
                trainer(GradSyncStrategy(c), EPOCHS).fit(model(0), loader, ckpt_path=path)
            except ValueError as e:
                res["refused"][what] = str(e)
    torch.save(res, os.path.join(out, f"{phase}{rank}.pt"))
    if phase == "popen":  # the same two processes go on with fp16 AMP (one launch, not two)
        _amp(out, Regression, loader)
        return
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _amp(out: str, module_class, loader) -> None:
    """fp16 AMP (Lightning's MixedPrecision with a GradScaler that doubles its scale every
    step): the strategy hands the plugin's scaler to the hook, which brings its residuals to
    each step's scale. Per step, before the optimizer runs, the scale the hook's residuals are
    in and the scaler's scale are recorded; a configuration that would raise on overflow is
    refused at fit."""
    import pytorch_lightning as pl
    from pytorch_lightning.plugins import MixedPrecision

    from gradsync.integrations.lightning import GradSyncStrategy

    class Recording(module_class):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[tuple[float, float | None]] = []

        def on_before_optimizer_step(self, optimizer):
            strategy = self.trainer.strategy
            self.seen.append((strategy.precision_plugin.scaler.get_scale(),
                              strategy.hook_state.units.loss_scale))
            self.views = strategy.model.gradient_as_bucket_view  # the DDP it built

    def amp_trainer(cfg: Config) -> tuple[object, object]:
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=1)
        strategy = GradSyncStrategy(cfg)
        t = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=1,
                       plugins=[MixedPrecision("16-mixed", "cpu", scaler)], logger=False,
                       enable_checkpointing=False, enable_progress_bar=False,
                       enable_model_summary=False, num_sanity_val_steps=0)
        return t, strategy

    res: dict = {}
    torch.manual_seed(0)
    module = Recording()
    t, strategy = amp_trainer(Config(**CONFIG, nonfinite="skip_step"))
    t.fit(module, loader)
    res["seen"], res["losses"] = module.seen, module.losses
    res["follows"] = (strategy.hook_state.units.scaler is t.precision_plugin.scaler
                      and strategy.hook_state.units.optimizer is strategy.optimizers[0])
    res["bucket_views"] = module.views
    t, _ = amp_trainer(Config(**CONFIG))  # nonfinite="raise": refused
    try:
        t.fit(Recording(), loader)
    except ValueError as e:
        res["refused"] = str(e)
    res["adamw"] = _adamw(module_class, loader)
    rank = torch.distributed.get_rank()
    torch.save(res, os.path.join(out, f"amp{rank}.pt"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _adamw(module_class, loader) -> dict:
    """configure_optimizers returns torch's AdamW and a scheduler: the strategy applies the
    frozen-variance recipe (FrozenVarianceAdamW for the strategy and the scheduler, AdamW's
    beta1 into error feedback, the first 10 steps whole) over 3 epochs of 8 steps."""
    import pytorch_lightning as pl

    from gradsync.integrations.lightning import GradSyncStrategy

    class WithAdamW(module_class):
        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
            return [opt], [torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / 100)]

    torch.manual_seed(0)
    module = WithAdamW()
    strategy = GradSyncStrategy(Config(**CONFIG))
    t = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=3, logger=False,
                   enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, num_sanity_val_steps=0)
    t.fit(module, loader)
    opt = strategy.optimizers[0]
    return {"optimizer": type(opt).__name__, "config": strategy.hook_state.cfg.to_dict(),
            "scheduler_follows": strategy.lr_scheduler_configs[0].scheduler.optimizer is opt,
            "lr": opt.param_groups[0]["lr"], "losses": module.losses,
            "steps": sorted({st["step"] for st in opt.state.values()})}


def _command(out, phase: str, nproc: int | None = 2) -> tuple[list[str], dict[str, str]]:
    """This file as a worker: under torchrun with ``nproc`` processes, or (None) as a plain
    script whose Trainer starts the other rank itself."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [os.path.join(os.path.dirname(__file__), "..", "src"), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1"}
    launch = [] if nproc is None else ["-m", "torch.distributed.run", "--standalone",
                                       f"--nproc-per-node={nproc}"]
    return [sys.executable, *launch, os.path.abspath(__file__), str(out), phase], env


def _run(out, phase: str, nproc: int | None = 2) -> None:
    argv, env = _command(out, phase, nproc)
    r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]


def test_lightning_train_checkpoint_resume_refuse(tmp_path):
    _run(tmp_path, "main")
    res = [torch.load(tmp_path / f"main{i}.pt") for i in range(2)]
    for rk in res:
        # the hook ran and counted its traffic, whatever the device (CPU here)
        assert rk["stats"]["calls"] >= EPOCHS * SAMPLES // (2 * BATCH)
        assert rk["stats"]["total"]["bytes_sent"] > 0
        # the loss falls
        losses = rk["losses"]
        assert sum(losses[-4:]) / 4 < 0.5 * sum(losses[:4]) / 4, losses
        # resuming at the end of epoch 1 ends bitwise where the uninterrupted run ended
        assert rk["resumed_calls"] == rk["stats"]["calls"] // EPOCHS
        for k, v in rk["full"].items():
            assert torch.equal(rk["resumed"][k], v), k
            assert torch.equal(rk["twice"][k], rk["once"][k]), k
        assert "different configuration" in rk["refused"]["config"]
        assert "density: saved 0.1, here 0.2" in rk["refused"]["config"]
        assert "has no 'gradsync' entry" in rk["refused"]["missing"]
    # the replicas agree
    for k, v in res[0]["full"].items():
        assert torch.equal(res[1]["full"][k], v), k
    # the checkpoint holds each rank's own, different residuals (rank 0 saved it alone)
    ckpt = torch.load(tmp_path / "epoch1.ckpt", weights_only=False)
    saved = ckpt["gradsync"]
    assert saved["world_size"] == 2 and [s["rank"] for s in saved["ranks"]] == [0, 1]
    r0, r1 = (s["feedback"]["residual"] for s in saved["ranks"])
    assert set(r0) == set(r1) and set(r0) == {n for n, _ in
                                              nn.Sequential(nn.Linear(16, 64), nn.Tanh(),
                                                            nn.Linear(64, 4)).named_parameters(
                                                  prefix="net")}
    assert any(not torch.equal(r0[n], r1[n]) for n in r0)
    # a tensor of 80 entries or more is sparsified (k >= 8 at density 0.1) and the budget
    # (Config.budget, settled and saved) gives it a density; a smaller one travels whole
    # (Config.min_k) and leaves no residual. At this step DGC's warm-up scales the densities,
    # so a tensor the budget favours may travel whole too: the others leave a residual
    density = saved["ranks"][0]["budget"]["density"]
    sparse = {n for n, d in density.items() if d is not None}
    assert sparse == {n for n in r0 if r0[n].numel() >= 80}
    assert any(r0[n].abs().sum() > 0 for n in sparse)
    assert all(r0[n].abs().sum() == 0 for n in set(r0) - sparse)
    # a 1-rank job cannot take the 2-rank checkpoint
    _run(tmp_path, "one", nproc=1)
    refused = torch.load(tmp_path / "one.pt")["refused"]
    assert "saved by 2 ranks, this job has 1" in refused


@pytest.mark.slow
def test_lightning_jobs_exit_cleanly_three_at_a_time(tmp_path):
    """The main phase's job, 42 launches three at a time: none aborts at exit. With torch's
    ``all_gather_object`` in gradsync's set-up check and checkpoint gather, 4 of these 42
    launches aborted ("terminate called without an active exception": gloo's worker thread
    freeing an all-gather's tensors in ``Py_FinalizeEx``; collectives/comm.py, "Exit
    safety"); with ``exchange_objects``, none."""
    failures = []
    for start in range(0, 42, 3):
        procs = []
        for i in range(3):
            out = tmp_path / f"launch{start + i}"
            out.mkdir()
            argv, env = _command(out, "main")
            procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
        for i, p in enumerate(procs):
            text, _ = p.communicate(timeout=600)
            if p.returncode != 0 or "terminate called" in text:
                failures.append(f"launch {start + i}: rc={p.returncode}\n{text[-1500:]}")
    assert not failures, f"{len(failures)} of 42 launches failed:\n" + "\n".join(failures)


@pytest.fixture(scope="module")
def popen_run(tmp_path_factory):
    """`python train.py` with devices=2 (Lightning launches rank 1), then fp16 AMP in the same
    two processes: one launch for both tests below."""
    out = tmp_path_factory.mktemp("popen")
    _run(out, "popen", nproc=None)
    return out


def test_lightning_fp16_amp_follows_the_grad_scaler(popen_run):
    for rank in range(2):
        res = torch.load(popen_run / f"amp{rank}.pt")
        assert res["follows"]
        seen = res["seen"]
        assert len(seen) == SAMPLES // (2 * BATCH)
        assert all(scale == held for scale, held in seen), seen
        assert len({scale for scale, _ in seen}) > 3  # the scale changed step after step
        assert "nonfinite='skip_step'" in res["refused"]


def test_the_strategy_builds_ddp_with_gradients_as_bucket_views(popen_run):
    """GradSyncStrategy wraps the module with ``gradient_as_bucket_view=True`` unless told
    otherwise: the hook writes each bucket in place and DDP copies nothing back (the hook's bits
    are the same either way: test_ddp.py)."""
    from gradsync.integrations.lightning import GradSyncStrategy

    for rank in range(2):
        assert torch.load(popen_run / f"amp{rank}.pt")["bucket_views"] is True
    mine = GradSyncStrategy(Config(**CONFIG), gradient_as_bucket_view=False)
    assert mine._ddp_kwargs["gradient_as_bucket_view"] is False


def test_lightning_applies_the_adamw_recipe(popen_run):
    """torch's AdamW from configure_optimizers: FrozenVarianceAdamW for the strategy and its
    scheduler (which keeps driving the learning rate), AdamW's beta1 in error feedback, the
    first 10 of 24 steps whole, every step applied, and the loss falls."""
    steps = 3 * SAMPLES // (2 * BATCH)
    for rank in range(2):
        a = torch.load(popen_run / f"amp{rank}.pt")["adamw"]
        assert a["optimizer"] == "FrozenVarianceAdamW" and a["scheduler_follows"]
        assert a["config"]["momentum"] == 0.9
        assert (a["config"]["density_warmup"], a["config"]["density_warmup_steps"]) == ((1.0,), 10)
        assert a["lr"] == pytest.approx(1e-2 * (1.0 - 3 / 100))  # stepped once per epoch
        assert a["steps"] == [steps]
        assert sum(a["losses"][-3:]) < 0.5 * sum(a["losses"][:3]), a["losses"]


def test_lightning_starts_its_own_processes(popen_run):
    """`python train.py` with devices=2: Lightning launches rank 1; the hook runs on both."""
    res = [torch.load(popen_run / f"popen{i}.pt") for i in range(2)]
    for rk in res:
        assert rk["stats"]["calls"] == EPOCHS * SAMPLES // (2 * BATCH)
        assert rk["stats"]["total"]["bytes_sent"] > 0
    # 2 ranks: what one sends (all-gathers) the other receives
    for a, b in ((0, 1), (1, 0)):
        assert res[a]["stats"]["total"]["bytes_sent"] == res[b]["stats"]["total"]["bytes_recv"]
    for k, v in res[0]["full"].items():
        assert torch.equal(res[1]["full"][k], v), k


def test_restore_refuses_other_world_size_and_foreign_dicts():
    """ranks.restore checks the world size before picking an entry (one process: P = 1)."""
    state, _ = hook(Config(**CONFIG), nn.Linear(3, 2))
    mine = ranks.gather(state)
    assert mine is not None and mine["world_size"] == 1
    ranks.restore(state, mine)  # its own state loads
    two = {**mine, "world_size": 2, "ranks": [mine["ranks"][0]] * 2}
    with pytest.raises(ValueError, match="saved by 2 ranks, this job has 1"):
        ranks.restore(state, two)
    with pytest.raises(ValueError, match="not gradsync DDP-hook state"):
        ranks.restore(state, {"rank": 0})
    other, _ = hook(Config(**{**CONFIG, "density": 0.2}), nn.Linear(3, 2))
    with pytest.raises(ValueError, match="different configuration"):
        ranks.restore(other, mine)


def test_strategy_refuses_comm_hook_arguments():
    from gradsync.integrations.lightning import GradSyncStrategy

    with pytest.raises(TypeError, match="installs gradsync's comm hook itself"):
        GradSyncStrategy(Config(**CONFIG), ddp_comm_hook=lambda s, b: None)
    with pytest.raises(ValueError, match="supports schemes"):
        GradSyncStrategy(Config(scheme="oktopk"))
    with pytest.raises(RuntimeError, match="no gradsync hook yet"):
        GradSyncStrategy(Config(**CONFIG)).stats()


def test_docstring_shows_the_tested_snippet():
    import textwrap

    import gradsync.integrations.lightning as mod

    assert textwrap.indent(README_SNIPPET, "    ") in mod.__doc__


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
