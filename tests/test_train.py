"""``python -m gradsync train``: CLI, real 2-rank runs (engine scheme + torch DDP peer),
metrics.json schema, argument validation, the failing-worker path, data shards."""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess

import pytest
import torch

from gradsync.apps import cli, models, train

FIELDS = {"step", "loss", "time_s", "cpu_s", "elapsed_s", "samples_per_s", "bytes_sent",
          "bytes_recv", "backward_s", "sparsify_s", "comm_s", "wait_s", "missing_rate", "warmup",
          "probing", "hooks_s", "hook_blocked_s"}


def _numel(name: str) -> int:
    return sum(p.numel() for p in models.build(name).parameters())


def test_help_lists_options_and_schemes(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for opt in ("--model", "--data", "--scheme", "--density", "--sparsifier", "--steps",
                "--epochs", "--batch-size", "--lr", "--seed", "--bandwidth", "--latency",
                "--out", "--eval-batches", "--world-size"):
        assert opt in out
    for scheme in ("ddp", "ddp_powersgd", "ddp_fp16", "ssfusion_oi", "oktopk",
                   "ddp_gradsync_ssfusion"):
        assert scheme in out
    assert "not" in out and "propagation" in out  # --latency says what it is not
    flat = " ".join(out.split())  # --timeout watches progress, not the whole run
    assert "--timeout" in flat and "seconds without progress" in flat
    assert "long, healthy run is never cut short" in flat
    for hidden in ("--fail-rank", "--stall-at", "--step-sleep", "--inject-scheme"):
        assert hidden not in out  # test knobs


def test_two_schemes_on_two_workers_metrics_and_table(tmp_path, capsys):
    P, B, steps, warm = 2, 8, 3, 1
    rc = train.main(["--world-size", str(P), "--steps", str(steps), "--scheme", "ddp,oktopk",
                     "--warmup-steps", str(warm), "--batch-size", str(B), "--eval-batches", "2",
                     "--density-warmup", "off",  # 3 steps: Ok-Topk at 1 %, not a warm-up's
                     "--out", str(tmp_path), "--no-progress"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "ddp" in out and "oktopk" in out and "samples/s" in out and "vs ddp" in out
    m = json.loads((tmp_path / "metrics.json").read_text())
    assert m["schema"] == "gradsync.train/1"
    assert m["config"]["schemes"] == ["ddp", "oktopk"] and m["config"]["world_size"] == P
    assert m["config"]["model"] == "cnn" and m["config"]["batch_size"] == B
    assert m["environment"]["link"] == "loopback" and m["environment"]["shaped"] is False
    assert {"torch", "python", "cpus", "load_avg", "launcher", "backend"} <= set(
        m["environment"])
    assert [r["scheme"] for r in m["runs"]] == ["ddp", "oktopk"]
    n = _numel("cnn")
    for run in m["runs"]:
        assert len(run["steps"]) == steps and len(run["bytes_sent_per_rank"]) == P
        for i, rec in enumerate(run["steps"]):
            assert set(rec) == FIELDS
            assert rec["step"] == i and rec["warmup"] == (i <= warm)
            assert math.isfinite(rec["loss"]) and rec["time_s"] > 0
            assert rec["samples_per_s"] == pytest.approx(P * B / rec["time_s"])
            assert 0.0 <= rec["missing_rate"] <= 1.0
        el = [r["elapsed_s"] for r in run["steps"]]
        assert el == sorted(el) and el[-1] == pytest.approx(sum(r["time_s"] for r in
                                                                 run["steps"]))
        s = run["summary"]
        meas = run["steps"][warm + 1:]
        assert s["measured_steps"] == len(meas) == steps - warm - 1
        assert s["samples_per_s"] == pytest.approx(statistics.median(
            P * B / r["time_s"] for r in meas))
        assert 0.0 <= s["test_accuracy"] <= 1.0 and s["test_samples"] == 2 * B
        assert math.isfinite(s["final_loss"])
    ddp, okt = (r["summary"] for r in m["runs"])
    # torch's all-reduce hook sends every fp32 gradient once per step: the ring's 2(P-1)/P·4n
    for per_rank in m["runs"][0]["bytes_sent_per_rank"]:
        assert per_rank == [2 * (P - 1) / P * 4 * n] * steps
    assert ddp["speedup_vs_ddp"] == 1.0
    assert okt["speedup_vs_ddp"] == pytest.approx(okt["samples_per_s"] / ddp["samples_per_s"])
    assert 0 < okt["bytes_per_step"] < ddp["bytes_per_step"] / 10  # 1% density
    for png in ("loss_vs_time.png", "throughput.png"):
        assert (tmp_path / png).stat().st_size > 1000


def test_language_model_on_text_reports_perplexity(tmp_path, capsys):
    rc = train.main(["--model", "gpt_tiny", "--world-size", "1", "--steps", "2",
                     "--scheme", "ssfusion_oi", "--warmup-steps", "1", "--batch-size", "4",
                     "--eval-batches", "2", "--out", str(tmp_path), "--no-progress"])
    assert rc == 0
    m = json.loads((tmp_path / "metrics.json").read_text())
    assert m["config"]["data"] == "text" and m["config"]["optimizer"].startswith("adamw(")
    assert "FrozenVarianceAdamW" in m["config"]["optimizer"]
    assert "preconditions" in m["config"]["optimizer"]
    s = m["runs"][0]["summary"]
    # untrained byte-level model: perplexity near the 256-symbol uniform, and exp(loss)
    assert 1.0 < s["perplexity"] < 1000 and s["perplexity"] == pytest.approx(
        math.exp(s["eval_loss"]))
    assert "eval ppl" in capsys.readouterr().out
    assert m["runs"][0]["task"] == "causal_lm"
    assert s["eval_tokens"] == 2 * 4 * 32  # every position of 2 batches × 4 windows × context


def test_masked_language_model_scores_only_masked_tokens(tmp_path):
    # bert_small needs transformers, which make install provides: missing, this test fails
    rc = train.main(["--model", "bert_small", "--world-size", "1", "--steps", "2",
                     "--scheme", "topka", "--warmup-steps", "1", "--batch-size", "2",
                     "--eval-batches", "2", "--out", str(tmp_path), "--no-progress"])
    assert rc == 0
    run = json.loads((tmp_path / "metrics.json").read_text())["runs"][0]
    assert run["task"] == "masked_lm"
    s = run["summary"]
    # BERT masks ~15% of the positions (at least one per row): far fewer than all of them
    assert 2 * 2 <= s["eval_tokens"] < 0.5 * 2 * 2 * 128
    assert math.isfinite(s["eval_loss"]) and s["perplexity"] > 1.0


@pytest.mark.parametrize("argv", [
    ["--density", "0"], ["--density", "1.5"], ["--density", "nan"], ["--density", "x"],
    ["--world-size", "0"], ["--bandwidth", "10mbps"], ["--bandwidth", "fast"],
    ["--latency", "5ms"], ["--scheme", "nope"], ["--scheme", "ddp,ddp"],
    ["--steps", "3", "--epochs", "1"], ["--steps", "0"], ["--model", "nope"],
    ["--model", "gpt_tiny", "--data", "fashion-mnist"], ["--eval-batches", "-1"],
    ["--sparsifier", "nope"], ["--lr", "-1"], ["--amp", "fp8"], ["--lr-schedule", "step"],
])
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        train.main(argv)
    assert e.value.code == 2
    assert "error" in capsys.readouterr().err



def _amp_worker(rank: int, world_size: int, spec) -> dict:
    """train's rank function, with a GradScaler whose first scale (2^19) overflows fp16."""
    from gradsync.apps.train import loop

    real = loop.mixed_precision

    def huge_first_scale(amp, device):
        autocast, _ = real(amp, device)
        return autocast, torch.amp.GradScaler(device.type, init_scale=2.0 ** 19,
                                              growth_interval=1000)

    loop.mixed_precision = huge_first_scale
    return loop.train_worker(rank, world_size, spec)


def test_fp16_amp_runs_every_runner_with_a_followed_grad_scaler():
    """``--amp fp16``: autocast in fp16 and a GradScaler for torch's DDP, the engine and the
    DDP hook; every step records the scale. A first scale that overflows (2^19) backs off at
    the first steps on every runner — the gradsync schemes skip those steps on every rank
    (``nonfinite="skip_step"``, following the scaler; ``tests/test_loss_scale.py`` checks
    what following does) — and training goes on with finite losses and equal replicas."""
    from gradsync.apps.train.spec import TrainSpec
    from gradsync.testing import run_distributed

    spec = TrainSpec(schemes=("ddp", "topka", "ddp_gradsync_per_tensor"), world_size=2,
                     steps=10, warmup_steps=1, data="synthetic", batch_size=8, eval_batches=1,
                     amp="fp16", progress=False)
    out = run_distributed(_amp_worker, 2, spec, timeout=300)
    for runs in zip(*(o["runs"] for o in out)):  # one scheme, both ranks
        for run in runs:
            steps = run["records"]
            scales = [r["loss_scale"] for r in steps]
            assert set(steps[0]) == FIELDS | {"loss_scale"}
            assert scales[0] < 2.0 ** 19 and scales == sorted(scales, reverse=True), scales
            assert scales[-1] == scales[-2] and scales[-1] >= 2.0 ** 10, scales  # settled
            assert all(math.isfinite(r["loss"]) for r in steps), run["scheme"]
        assert runs[0]["records"][-1]["loss_scale"] == runs[1]["records"][-1]["loss_scale"]


def _hook_worker(rank: int, world_size: int, spec) -> dict:
    from gradsync.apps.train import loop

    return loop.train_worker(rank, world_size, spec)


def test_the_ddp_hooks_steps_are_metered_like_torchs_hooks():
    """``ddp_gradsync_<s>``'s records carry the hook calls' times (metered as torch's hooks
    are: the synchronous part, the calls' launch→done union, the exposed wait), no NaN, and the
    hook's own bytes; its losses are the engine's per_tensor's bit for bit (the same
    selections, sent in other messages)."""
    from gradsync.apps.train.spec import TrainSpec
    from gradsync.testing import run_distributed

    spec = TrainSpec(schemes=("ddp_gradsync_per_tensor", "per_tensor"), world_size=2,
                     steps=6, warmup_steps=1, data="synthetic", batch_size=8, eval_batches=1,
                     progress=False)
    out = run_distributed(_hook_worker, 2, spec, timeout=300)
    for o in out:
        hook, engine = o["runs"]
        for r in hook["records"]:
            for k in ("sparsify_s", "comm_s", "wait_s", "backward_s"):
                assert math.isfinite(r[k]) and r[k] >= 0.0, (k, r[k])
            assert r["sparsify_s"] > 0.0 and r["bytes_sent"] > 0
        assert [r["loss"] for r in hook["records"]] == [r["loss"] for r in engine["records"]]
        # the hook's merged-buckets trial opens at step 1 (DDP's step 0: one bucket) and is
        # still measuring at step 6: every step after 0 probes, as auto's trials do
        assert [r["probing"] for r in hook["records"]] == [False] + [True] * 5
        assert not any(r["probing"] for r in engine["records"])


def test_amp_config_and_runner_wiring():
    """fp16 makes every gradsync scheme skip overflowing steps and follow the scaler; bf16
    needs no scaler; fp32 changes nothing."""
    from gradsync.apps.train import loop
    from gradsync.apps.train.runners import Runner
    from gradsync.apps.train.spec import TrainSpec, scheme_choice

    cpu = torch.device("cpu")
    for amp, policy in (("fp16", "skip_step"), ("bf16", "raise"), (None, "raise")):
        spec = TrainSpec(schemes=("topka",), amp=amp, progress=False)
        cfg = Runner(scheme_choice("topka"), models.build("cnn"), spec).gradsync_config(spec)
        assert cfg.nonfinite == policy
        autocast, scaler = loop.mixed_precision(amp, cpu)
        assert (scaler is not None) == (amp == "fp16")
        with autocast():
            y = torch.nn.Linear(4, 4)(torch.ones(2, 4))
        assert y.dtype == {"fp16": torch.float16, "bf16": torch.bfloat16, None: torch.float32}[amp]
    with pytest.raises(ValueError, match="amp"):
        TrainSpec(amp="fp8")


def test_scheme_choices_come_from_the_scheme_table():
    from gradsync.schedule.schemes import SCHEMES

    hooks = {"ddp_gradsync_dense", "ddp_gradsync_per_tensor", "ddp_gradsync_ssfusion",
             "ddp_gradsync_ssfusion_oi", "ddp_gradsync_auto"}  # schemes with a DDP comm hook
    assert set(train.all_schemes()) == {"ddp", "ddp_powersgd", "ddp_fp16"} | set(SCHEMES) | hooks
    assert len(train.all_schemes()) == 3 + len(SCHEMES) + len(hooks)
    assert {n for n, c in train.scheme_choices().items() if c.runner == "ddp_hook"} == hooks
    hook = train.scheme_choice("ddp_gradsync_ssfusion")
    assert hook.scheme is SCHEMES["ssfusion"] and hook.scheme.ddp_hook
    assert train.scheme_choice("oktopk").runner == "engine"
    assert train.scheme_choice("ddp_powersgd").runner == "torch_ddp"
    assert train.scheme_choice("ddp_powersgd").scheme is None
    for bad in ("ddp_gradsync_topka", "ddp_gradsync_", "ddp_other", "Dense"):
        with pytest.raises(ValueError, match="unknown scheme"):
            train.scheme_choice(bad)
        with pytest.raises(ValueError, match="scheme"):
            train.TrainSpec(schemes=(bad,))


def test_momentum_correction_exactly_for_sparse_gradsync_schemes():
    from gradsync.apps.train.runners import momentum_correction

    for name, choice in train.scheme_choices().items():
        # the rule as first written, on the names: sparse unless a torch hook or dense
        sparse = name.startswith("ddp_gradsync_") or not name.startswith("ddp")
        expect = sparse and name not in ("dense", "dense_ovlp", "ddp_gradsync_dense")
        for density in (0.01, 1.0):  # SGD: exact at density 1 too (tests/test_parity.py)
            assert momentum_correction(choice, False, density) == expect, name
        assert momentum_correction(choice, True, 0.01) == expect, name  # AdamW's β1 too
        # AdamW at density 1: nothing is compressed, torch's AdamW as DDP runs it
        assert momentum_correction(choice, True, 1.0) is False, name
    cnn = train.TrainSpec(model="cnn")
    opt = train.make_optimizer(models.build("cnn"), cnn.adamw, cnn.lr, True)
    assert isinstance(opt, torch.optim.SGD) and opt.defaults["momentum"] == 0.0
    opt = train.make_optimizer(models.build("cnn"), cnn.adamw, cnn.lr, False)
    assert opt.defaults["momentum"] == 0.9 and opt.defaults["lr"] == 0.05


def test_adamw_at_density_1_trains_as_ddp(tmp_path):
    """AdamW at density 1 compresses nothing, so a gradsync scheme must train as DDP does:
    torch's AdamW on the averaged gradient, not the frozen variance of compressed AdamW (which
    would freeze it after one of these 8 steps and end elsewhere)."""
    rc = train.main(["--model", "gpt_tiny", "--world-size", "2", "--steps", "8",
                     "--scheme", "ddp,topka,ssfusion,ddp_gradsync_ssfusion", "--density", "1",
                     "--batch-size", "4",
                     "--eval-batches", "2", "--out", str(tmp_path), "--no-progress"])
    assert rc == 0
    m = json.loads((tmp_path / "metrics.json").read_text())
    ppl = {r["scheme"]: r["summary"]["perplexity"] for r in m["runs"]}
    assert ppl["topka"] == pytest.approx(ppl["ddp"], rel=1e-4)
    assert ppl["ssfusion"] == pytest.approx(ppl["ddp"], rel=1e-4)
    assert ppl["ddp_gradsync_ssfusion"] == pytest.approx(ppl["ddp"], rel=1e-4)  # the DDP hook
    assert "at density 1 torch's AdamW" in m["config"]["optimizer"]


def test_adamw_sparse_schemes_warm_up_whole_then_freeze():
    from gradsync.apps.train.runners import EngineRunner
    from gradsync.optim import FrozenVarianceAdamW

    gpt = train.TrainSpec(model="gpt_tiny", schemes=("topka", "dense_ovlp"), steps=60)
    assert gpt.adam_freeze_step(60) == 6 and gpt.adam_freeze_step(3) == 1  # 10 %, at least 1
    assert train.TrainSpec(model="gpt_tiny", adam_warmup=9).adam_freeze_step(60) == 9
    assert gpt.engine_warmup(60, True) == ((1.0,), 6)  # the warm-up is sent whole
    assert gpt.engine_warmup(60, False) == (None, None)  # Config's default: the scheme's
    dgc = train.TrainSpec(model="gpt_tiny", density_warmup="2:4", adam_warmup=6)
    warm, period = dgc.engine_warmup(60, True)  # whole periods first, then DGC's schedule
    assert (warm[:2], period, len(warm)) == ((1.0, 1.0), 4, 4) and dgc.adam_freeze_step(60) == 8
    assert train.TrainSpec(model="cnn").engine_warmup(60, True) == (None, None)  # SGD: as is
    model = models.build("gpt_tiny")
    opt = train.make_optimizer(model, True, gpt.lr, True, 6)
    assert isinstance(opt, FrozenVarianceAdamW) and opt.defaults["freeze_step"] == 6
    assert opt.defaults["betas"][0] == 0.9
    assert isinstance(train.make_optimizer(model, True, gpt.lr, False), torch.optim.AdamW)
    runner = EngineRunner(gpt.choices[0], model, gpt, steps=60)
    try:
        cfg = runner.sync.cfg
        assert (cfg.momentum, cfg.density_warmup, cfg.density_warmup_steps) == (0.9, (1.0,), 6)
        assert cfg.density_at(5) == 1.0 and cfg.density_at(6) == gpt.density
        # the optimizer hands the engine its frozen variance (gradsync.optim, "Preconditioned")
        assert runner.preconditioner is runner.sync
        opt = train.make_optimizer(model, True, gpt.lr, True, 6, sync=runner.preconditioner)
        assert opt.sync is runner.sync
    finally:
        runner.close()
    # the AdamW recipe's warm-up replaces the scheme's own (SSFusion's DGC warm-up), as
    # gradsync.integrations.adamw's does for the doors through the DDP hook
    ss = train.TrainSpec(model="gpt_tiny", schemes=("ssfusion_oi",), steps=60)
    runner = EngineRunner(ss.choices[0], models.build("gpt_tiny"), ss, steps=60)
    try:
        assert runner.sync.cfg.warmup == ((1.0,), 6)
    finally:
        runner.close()
    with pytest.raises(ValueError, match="adam_warmup"):
        train.TrainSpec(model="gpt_tiny", adam_warmup=0)


def test_spec_fills_model_defaults_validates_and_pickles():
    import pickle

    cnn = train.TrainSpec(schemes=["ddp", "oktopk"])
    assert (cnn.data, cnn.lr, cnn.steps, cnn.adamw) == ("fashion-mnist", 0.05, 50, False)
    assert cnn.schemes == ("ddp", "oktopk") and cnn.bandwidth_bps is None
    assert [c.runner for c in cnn.choices] == ["torch_ddp", "engine"]
    gpt = train.TrainSpec(model="gpt_tiny", epochs=0.5)
    assert (gpt.data, gpt.lr, gpt.steps, gpt.epochs, gpt.adamw) == ("text", 3e-3, None, 0.5,
                                                                   True)
    assert train.TrainSpec(bandwidth="100mbit").bandwidth_bps == 100_000_000
    cfg = cnn.config(4)
    assert list(cfg) == ["model", "data", "schemes", "world_size", "steps", "epochs",
                         "batch_size", "lr", "lr_schedule", "optimizer", "text_fallback",
                         "density",
                         "sparsifier", "seed", "warmup_steps", "eval_batches",
                         "density_warmup", "density_schedule", "clip_norm", "min_k",
                         "momentum_masking", "momentum_ahead", "budget", "adam_warmup", "amp",
                         "bandwidth", "latency", "replayed_plans", "topk_shares"]
    assert cfg["world_size"] == 4 and cfg["schemes"] == ["ddp", "oktopk"]
    assert cfg["amp"] is None and cfg["lr_schedule"] == "constant"
    # "constant" is spelled None, so a study's kept runs (which never named it) stay comparable
    assert train.TrainSpec(lr_schedule="constant") == train.TrainSpec()
    assert train.TrainSpec(lr_schedule="cosine").config(2)["lr_schedule"] == "cosine"
    assert cfg["replayed_plans"] == [] and cfg["topk_shares"] is False
    assert pickle.loads(pickle.dumps(gpt)) == gpt  # every rank receives it
    clipped = train.TrainSpec(schemes=["topka"], clip_norm=2.5)
    assert clipped.config(2)["clip_norm"] == 2.5 and cfg["clip_norm"] is None
    (choice,) = clipped.choices
    from gradsync.apps.train.runners import Runner

    assert Runner(choice, torch.nn.Linear(2, 2), clipped).gradsync_config(clipped).clip_norm == 2.5
    # --min-k reaches Config.min_k; unset, Config's own default applies
    import gradsync

    wide = train.TrainSpec(schemes=["per_tensor"], min_k=52)
    assert wide.config(2)["min_k"] == 52 and cfg["min_k"] is None
    (pt,) = wide.choices
    assert Runner(pt, torch.nn.Linear(2, 2), wide).gradsync_config(wide).min_k == 52
    assert (Runner(choice, torch.nn.Linear(2, 2), clipped).gradsync_config(clipped).min_k
            == gradsync.Config().min_k)
    # --budget reaches Config.budget; unset, Config's default (the scheme's: per_tensor's
    # blend); a typo fails early
    shared = train.TrainSpec(schemes=["per_tensor"], budget="gradient")
    assert shared.config(2)["budget"] == "gradient" and cfg["budget"] is None
    assert Runner(pt, torch.nn.Linear(2, 2), shared).gradsync_config(shared).budget == "gradient"
    unset = Runner(pt, torch.nn.Linear(2, 2), wide).gradsync_config(wide)
    assert unset.budget is None and unset.effective_budget == "blend"
    # --warmup-steps reaches every door's Config (the DDP hook's too: the steps Config.budget
    # weighs), not only the engine's cost model
    brief = train.TrainSpec(schemes=["per_tensor"], warmup_steps=2)
    assert Runner(pt, torch.nn.Linear(2, 2), brief).gradsync_config(brief).warmup_steps == 2
    with pytest.raises(ValueError, match="budget"):
        train.TrainSpec(schemes=["per_tensor"], budget="global")
    # --momentum-masking reaches Config.momentum_masking; unset, Config's default (off)
    masked = train.TrainSpec(schemes=["topka"], momentum_masking=True)
    assert masked.config(2)["momentum_masking"] is True and cfg["momentum_masking"] is None
    (tk,) = masked.choices
    assert Runner(tk, torch.nn.Linear(2, 2), masked).gradsync_config(masked).momentum_masking
    assert not Runner(choice, torch.nn.Linear(2, 2), clipped).gradsync_config(
        clipped).momentum_masking
    # --momentum-ahead reaches Config.momentum_ahead; unset, Config's default (the scheme's)
    led = train.TrainSpec(schemes=["topka"], momentum_ahead=0.25)
    assert led.config(2)["momentum_ahead"] == 0.25 and cfg["momentum_ahead"] is None
    (tl,) = led.choices
    assert Runner(tl, torch.nn.Linear(2, 2), led).gradsync_config(led).momentum_ahead == 0.25
    assert Runner(choice, torch.nn.Linear(2, 2), clipped).gradsync_config(
        clipped).momentum_ahead is gradsync.Config().momentum_ahead is None
    for kw, field in [({"steps": 0}, "steps"), ({"steps": 2, "epochs": 1.0}, "epochs"),
                      ({"epochs": -1.0}, "epochs"), ({"latency": "5ms"}, "latency"),
                      ({"bandwidth": "fast"}, "bandwidth"), ({"schemes": ()}, "scheme"),
                      ({"schemes": ("ddp", "ddp")}, "twice"), ({"density": 0.0}, "density"),
                      ({"eval_batches": -1}, "eval_batches"), ({"model": "nope"}, "model"),
                      ({"data": "text"}, "does not fit"), ({"lr": float("inf")}, "lr"),
                      ({"sparsifier": "nope"}, "sparsifier"), ({"world_size": 0}, "world_size"),
                      ({"warmup_steps": 0}, "warmup_steps"), ({"batch_size": 1.5}, "batch_size"),
                      ({"timeout": 0}, "timeout"), ({"topk_shares": 1}, "topk_shares"),
                      ({"clip_norm": 0.0}, "clip_norm"), ({"clip_norm": "1"}, "clip_norm"),
                      ({"min_k": 0}, "min_k"), ({"min_k": 8.0}, "min_k"),
                      ({"momentum_masking": 1}, "momentum_masking"),
                      ({"momentum_masking": "yes"}, "momentum_masking"),
                      ({"momentum_ahead": 1.5}, "momentum_ahead"),
                      ({"momentum_ahead": True}, "momentum_ahead"),
                      ({"lr_schedule": "step"}, "lr_schedule")]:
        with pytest.raises(ValueError, match=field):
            train.TrainSpec(**kw)


@pytest.mark.parametrize("adamw", [False, True])
def test_cosine_lr_schedule_anneals_every_optimizer_to_zero_at_the_last_step(adamw):
    """``TrainSpec.lr_schedule="cosine"`` over 8 steps: the learning rate the optimizer uses
    at step t is lr·(1 + cos(π·t/8))/2, written out here, for SGD and for
    ``FrozenVarianceAdamW`` (the sparse schemes' AdamW); constant: no scheduler."""
    from gradsync.apps.train.runners import make_lr_schedule, make_optimizer

    net = torch.nn.Linear(3, 1)
    opt = make_optimizer(net, adamw, 0.4, momentum_correction=True, freeze_step=2)
    assert make_lr_schedule(opt, None, 8) is None
    sched = make_lr_schedule(opt, "cosine", 8)
    used = []
    for _ in range(8):
        used.append(opt.param_groups[0]["lr"])
        net(torch.ones(1, 3)).sum().backward()
        opt.step()
        sched.step()
    want = [0.4 * (1 + math.cos(math.pi * t / 8)) / 2 for t in range(8)]
    assert used == pytest.approx(want, abs=1e-12)
    assert used[0] == 0.4 and used[4] == pytest.approx(0.2)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)  # after the last step


def test_metered_hook_records_the_calls_blocks_not_their_cpu():
    """``metered_hook``'s ``hook_blocked_s``: a hook call that sleeps 40 ms (as gradsync's
    last bucket waits for its collectives) blocks about that long; one that computes for 40 ms
    on its thread blocks for (nearly) nothing. The step's record carries the sum."""
    import time as clock

    from gradsync.apps.train.metering import Meter, MeteredHookState, metered_hook

    def done() -> torch.futures.Future:
        fut = torch.futures.Future()
        fut.set_result(torch.zeros(1))
        return fut

    def sleeping(_state, _bucket):
        clock.sleep(0.04)
        return done()

    def busy(_state, _bucket):
        end = clock.thread_time() + 0.04
        x = 0
        while clock.thread_time() < end:
            x += 1
        return done()

    for inner, low, high in ((sleeping, 0.03, 0.2), (busy, 0.0, 0.01)):
        meter = Meter(1)
        t0 = clock.perf_counter()
        metered_hook(MeteredHookState(inner, None, meter), None).wait()
        got = meter.step_metrics(t0, clock.perf_counter())["hook_blocked_s"]
        assert low <= got <= high, (inner.__name__, got)


def test_union_length_of_hook_intervals():
    from gradsync.apps.train.metering import union_length

    assert union_length([]) == 0.0
    assert union_length([(3.0, 4.0), (0.0, 1.0), (0.5, 2.0), (1.5, 1.8)]) == 3.0
    assert union_length([(0.0, 1.0), (1.0, 2.0)]) == 2.0

def _our_namespaces() -> list[str]:
    if shutil.which("ip") is None:
        return []
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return [ln for ln in r.stdout.splitlines() if ln.startswith(f"gsne-{os.getpid()}-")]


def test_failing_worker_names_rank_exits_nonzero_and_cleans_up(capsys):
    rc = train.main(["--world-size", "2", "--steps", "3", "--scheme", "ddp", "--fail-rank", "1",
                     "--bandwidth", "1gbit", "--data", "synthetic", "--eval-batches", "0",
                     "--no-progress", "--timeout", "120"])
    assert rc == 1
    err = capsys.readouterr().err
    assert "training failed on rank 1" in err and "injected failure" in err
    assert _our_namespaces() == []  # shaped (root) or loopback: nothing is left behind


def test_rank_shards_are_disjoint_and_cover_the_data():
    P, B = 3, 16
    shards = [train.RankData("synthetic", "image", r, P, B, 7, torch.device("cpu"))
              for r in range(P)]
    x_all = train.load_images("synthetic", 7)[0]
    assert sum(s.shard_len for s in shards) == len(x_all)
    keys = torch.cat([s.x.flatten(1)[:, :4] for s in shards])
    assert len({tuple(k.tolist()) for k in keys}) == len(x_all)  # no image on two ranks
    # an epoch visits each of a rank's images once, in a seeded order
    a = train.RankData("synthetic", "image", 1, P, B, 7, torch.device("cpu"))
    seen = torch.cat([a.next()[0] for _ in range(a.steps_per_epoch())])
    assert len({tuple(k.tolist()) for k in seen.flatten(1)[:, :4]}) == len(seen)
    b = train.RankData("synthetic", "image", 1, P, B, 7, torch.device("cpu"))
    assert torch.equal(b.next()[0], seen[:B])


def test_summarize_medians_after_warmup_and_bytes_over_ranks():
    def recs(rank):
        return [{"step": i, "loss": 1.0 / (i + 1) + rank, "time_s": 0.1 * (i + 1),
                 "elapsed_s": 0.0, "samples_per_s": 10.0 * (i + 1), "bytes_sent": 100 * i + rank,
                 "bytes_recv": 0, "backward_s": 0.01 * i, "sparsify_s": float("nan"),
                 "comm_s": 0.0, "wait_s": 0.0, "missing_rate": 0.5 if i == 4 else 0.0,
                 "warmup": i <= 1} for i in range(5)]

    results = [{"rank": r, "runs": [{"scheme": s, "task": "image", "records": recs(r),
                                     "eval": {}} for s in ("ddp", "topka")]}
               for r in (1, 0)]
    runs = train.summarize(results, warmup_steps=1)
    s = runs[0]["summary"]
    assert s["measured_steps"] == 3  # steps 2, 3, 4
    assert s["samples_per_s"] == 40.0 and s["step_s"] == pytest.approx(0.4)
    assert s["backward_s"] == pytest.approx(0.03) and math.isnan(s["sparsify_s"])
    assert s["bytes_per_step"] == pytest.approx((200 + 300 + 400) / 3 + 0.5)
    assert s["missing_rate"] == pytest.approx(0.5 / 3)
    assert s["final_loss"] == pytest.approx(0.2 + 0.5)  # mean over ranks of the last loss
    assert runs[1]["summary"]["speedup_vs_ddp"] == 1.0
    assert s["probing_steps"] == 0 and s["settled_samples_per_s"] == 40.0  # never probed


def test_summarize_settled_throughput_after_autos_probing():
    probing = [False, False, True, True, False, True, False, False, False]  # steps 0..8
    sps = [1.0, 1.0, 5.0, 6.0, 50.0, 7.0, 60.0, 80.0, 70.0]
    sent = [5000, 5000, 900, 900, 30, 900, 10, 20, 30]  # the probes send a dense plan's bytes
    recs = [{"step": i, "loss": 1.0, "time_s": 1 / v, "elapsed_s": 0.0, "samples_per_s": v,
             "bytes_sent": b, "bytes_recv": 0, "backward_s": 0.0, "sparsify_s": 0.0,
             "comm_s": 0.0, "wait_s": 0.0, "missing_rate": 0.0, "warmup": i <= 1,
             "probing": p} for i, (v, p, b) in enumerate(zip(sps, probing, sent))]
    s = train.summarize([{"rank": 0, "runs": [{"scheme": "auto", "task": "image",
                                               "records": recs, "eval": {}}]}], 1)[0]["summary"]
    assert s["measured_steps"] == 7 and s["samples_per_s"] == 50.0  # median of steps 2..8
    assert s["probing_steps"] == 4  # measured steps 2..5: up to the last probing one
    assert s["settled_samples_per_s"] == 70.0  # median of steps 6, 7, 8
    assert s["settled_bytes_per_step"] == 20.0  # mean of steps 6, 7, 8
    assert s["bytes_per_step"] == pytest.approx((900 * 3 + 30 + 10 + 20 + 30) / 7)
    recs[-1]["probing"] = True  # ended while probing: no settled figure
    s = train.summarize([{"rank": 0, "runs": [{"scheme": "auto", "task": "image",
                                               "records": recs, "eval": {}}]}], 1)[0]["summary"]
    assert s["probing_steps"] == 7 and math.isnan(s["settled_samples_per_s"])
    assert math.isnan(s["settled_bytes_per_step"])


def test_missing_dataset_falls_back_to_synthetic_with_a_note(tmp_path, monkeypatch, capsys):
    from gradsync.apps import data

    monkeypatch.setattr(data, "FASHION_MNIST_DIR", tmp_path)  # an empty folder
    a = train.parse_args(["--scheme", "ddp"])
    assert a.data == "fashion-mnist"
    a = train.resolve_data(a)
    assert a.data == "synthetic"
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "SYNTHETIC" in out and "apt-get install" in out
    b = train.parse_args(["--data", "synthetic"])
    b = train.resolve_data(b)
    assert b.data == "synthetic" and capsys.readouterr().out == ""


@pytest.mark.slow
def test_torchrun_worker_mode(tmp_path):
    """Under torchrun each process is one rank (gloo on CPU); rank 0 writes the metrics."""
    import sys

    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    assert torchrun is not None, "torchrun is installed with torch next to this interpreter"
    r = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", "-m",
                        "gradsync", "train", "--scheme", "ddp,oktopk", "--steps", "3",
                        "--warmup-steps", "1", "--batch-size", "8", "--eval-batches", "1",
                        "--data", "synthetic", "--no-progress", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    m = json.loads((tmp_path / "metrics.json").read_text())
    assert m["environment"]["launcher"] == "torchrun" and m["config"]["world_size"] == 2
    n = _numel("cnn")
    assert m["runs"][0]["bytes_sent_per_rank"] == [[4 * n] * 3] * 2  # ring, P = 2


def test_torchrun_with_more_local_ranks_than_gpus_says_so(monkeypatch):
    """torchrun --nproc-per-node 2 on a one-GPU node: a clear error naming the fix, not CUDA's
    "invalid device ordinal" (and before any process group is made)."""
    from gradsync.apps.train import command

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: pytest.fail("set_device called"))
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(SystemExit, match=r"local rank 1 but this node has 1 GPU.*"
                                         r"--nproc-per-node.*CUDA_VISIBLE_DEVICES"):
        command._main_torchrun(train.parse_args(["--scheme", "ddp"]))


def test_local_launch_on_a_gpu_machine_says_where_it_trains(monkeypatch, capsys, tmp_path):
    """Local workers are gloo CPU processes; on a machine with CUDA the command says so and
    how to train on the GPUs instead (the run itself stays on the CPU)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert train.main(["--scheme", "ddp", "--world-size", "1", "--steps", "1",
                       "--warmup-steps", "1", "--batch-size", "4", "--eval-batches", "1",
                       "--data", "synthetic", "--no-progress", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "local workers train on the CPU (gloo)" in out and "torchrun --nproc-per-node" in out
    m = json.loads((tmp_path / "metrics.json").read_text())
    assert m["environment"]["device"] == "cpu"


def _rec(step: int, name: str, acc: list[float], sent: list[int], mode: str = "fused"):
    from gradsync.engine.audit import AuditRecord

    a = torch.tensor(acc)
    idx = torch.tensor(sent, dtype=torch.int64)
    return AuditRecord(step, name, mode, "topka", a, idx, a[idx], a.clone().index_fill_(0, idx, 0))


def test_topk_shares_counts_a_global_top_k_per_tensor_by_hand():
    """``TopkShares`` (``train --topk-shares``): per step, the global top k = round(d·N) of
    |acc| over every tensor, counted per tensor; a step in which every entry travelled is left
    out. Two tensors of 6 and 4 entries, d = 0.3 (k = 3):
    step 0: a = [9, 1, 1, 1, 1, 8], b = [-7, 0, 0, 0] → a 2, b 1;
    step 1: every entry sent → not counted;
    step 2: a = [0] * 6, b = [5, -6, 7, 0] → b 3.
    Shares over the counted steps: a 2/6, b 4/6; entry shares 6/10 and 4/10."""
    from gradsync.apps.train.shares import TopkShares

    s = TopkShares(0.3)
    s(_rec(0, "a", [9, 1, 1, 1, 1, 8], [0]))
    s(_rec(0, "b", [-7, 0, 0, 0], [0]))
    s(_rec(1, "a", [1, 2, 3, 4, 5, 6], list(range(6)), mode="dense"))
    s(_rec(1, "b", [9, 9, 9, 9], list(range(4)), mode="dense"))
    s(_rec(2, "a", [0] * 6, [0]))
    s(_rec(2, "b", [5, -6, 7, 0], [2]))
    r = s.result()
    assert r["steps"] == [0, 2] and r["density"] == 0.3
    assert r["tensors"]["a"] == {"numel": 6, "topk_share": pytest.approx(2 / 6),
                                 "entry_share": pytest.approx(0.6)}
    assert r["tensors"]["b"] == {"numel": 4, "topk_share": pytest.approx(4 / 6),
                                 "entry_share": pytest.approx(0.4)}
    assert TopkShares(0.5).result() == {"density": 0.5, "steps": [], "tensors": {}}
    with pytest.raises(ValueError, match="density"):
        TopkShares(0.0)


def test_train_topk_shares_writes_each_engine_schemes_shares(tmp_path):
    """``train --topk-shares``: each engine scheme's run in metrics.json carries rank 0's
    shares (one entry per parameter, summing to 1, over the steps that left entries in a
    residual); torch's DDP carries none."""
    out = tmp_path / "o"
    assert train.main(["--model", "mlp", "--data", "synthetic", "--scheme", "topka,ddp",
                       "--world-size", "2", "--steps", "4", "--warmup-steps", "1",
                       "--batch-size", "8", "--eval-batches", "0", "--no-progress",
                       "--topk-shares", "--out", str(out)]) == 0
    m = json.loads((out / "metrics.json").read_text())
    assert m["config"]["topk_shares"] is True
    runs = {r["scheme"]: r for r in m["runs"]}
    assert runs["ddp"]["topk_shares"] is None
    sh = runs["topka"]["topk_shares"]
    names = {n: p.numel() for n, p in models.build("mlp", seed=0).named_parameters()}
    assert {n: t["numel"] for n, t in sh["tensors"].items()} == names
    assert sum(t["topk_share"] for t in sh["tensors"].values()) == pytest.approx(1.0)
    assert sh["steps"] and set(sh["steps"]) <= {0, 1, 2, 3} and sh["density"] == 0.01


def _evaluate_shared(rank: int, P: int, task: str, n: int) -> dict:
    """Rank ``rank`` of ``P``: every rank's model differs (parameters and BatchNorm's running
    statistics); the shared evaluation must score rank 0's, which each rank rebuilds here
    and scores alone over all ``n`` batches as the reference."""
    from gradsync.apps.train.loop import evaluate

    name, kind = ("resnet20", "synthetic") if task == "image" else ("gpt_tiny", "synthetic")

    def model_of(r: int) -> torch.nn.Module:
        m = models.build(name, seed=3)
        g = torch.Generator().manual_seed(100 + r)
        with torch.no_grad():
            for t in [*m.parameters(), *m.buffers()]:
                if t.is_floating_point():
                    t.add_(0.05 * torch.randn(t.shape, generator=g))
        return m

    mine = model_of(rank)
    before = {k: v.clone() for k, v in mine.state_dict().items()}
    data = train.RankData(kind, task, rank, P, 16, 7, torch.device("cpu"), name, mine)
    got = evaluate(mine, task, data, n, P, rank)
    assert mine.training  # left as it was
    assert all(torch.equal(v, before[k]) for k, v in mine.state_dict().items())
    alone = evaluate(model_of(0), task, train.RankData(kind, task, 0, 1, 16, 7,
                                                       torch.device("cpu"), name, mine), n)
    return {"got": got, "alone": alone}


@pytest.mark.parametrize("P", [1, 2, 3])
@pytest.mark.parametrize("task", ["image", "lm"])
def test_evaluation_shared_over_ranks_scores_rank_0s_model(P, task):
    from gradsync.testing import run_distributed

    n = 3  # at P = 5 two ranks score no batch
    for out in run_distributed(_evaluate_shared, P, task, n, timeout=300):
        got, alone = out["got"], out["alone"]
        assert set(got) == set(alone)
        if task == "image":
            assert got == alone and got["test_samples"] == n * 16
        else:
            assert got["eval_tokens"] == alone["eval_tokens"] > 0
            assert got["eval_loss"] == pytest.approx(alone["eval_loss"], rel=1e-6)
