"""Replaying a plan (``Config.plan``; ``train --plan``).

The schemes that plan from times measured in their warm-up (``needs_cost_model``) can plan
differently in two runs with the same seed. ``Config.plan`` hands the engine a plan instead:

* a run given plan H is bitwise the run whose planner chose H (the planner is forced to return
  H in that run, after profiling as usual), at P = 1 (``compress_single_rank``), 2, 3, 5; and
  H differs from what the planner chooses under the pinned profiles, whose run ends with other
  parameters, so the equality is not that of two runs that could not differ;
* validation: not a dict, not a plan, made for another scheme, not fitting the model (missing,
  unknown, size), refused by the DDP hook, a checkpoint of another plan; ``auto`` with a plan
  keeps it and never probes;
* ``Plan.digest`` names the structure, not ``info``;
* ``train``: ``plans.json`` written, ``--plan`` replays it (same losses), bad files refused.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from conftest import image_batch, pin_profiles
from gradsync.apps.models import build
from gradsync.engine import GradSync
from gradsync.engine.config import Config
from gradsync.schedule import BufferPlan, Plan, TensorPlan
from gradsync.testing import run_distributed

D = 0.05
STEPS = 6
WARMUP = 2


def _names() -> list[tuple[str, int]]:
    return [(n, p.numel()) for n, p in build("mlp", seed=0).named_parameters()]


def _hand_plan(scheme: str = "multi_tensor") -> Plan:
    """Every tensor its own fused buffer, in backward (reversed registration) order."""
    bufs = [BufferPlan(tensors=(TensorPlan(n, k, None),), mode="fused", density=D)
            for n, k in reversed(_names())]
    return Plan(scheme=scheme, buffers=bufs, info={"made": "by hand"})


def _train(rank: int, P: int, cfg: Config) -> tuple[torch.Tensor, str, bool]:
    model = build("mlp", seed=0)
    sync = GradSync(model, cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        for step in range(STEPS):
            x, y = image_batch(rank, step)
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            sync.synchronize()
            opt.step()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        return flat, sync.plan.digest(), sync.cost is None
    finally:
        sync.close()


def _replay(rank: int, P: int, hand: dict) -> dict:
    from gradsync import schedule

    pin_profiles()
    base = dict(scheme="multi_tensor", density=D, sparsifier="topk", warmup_steps=WARMUP,
                momentum=0.9, compress_single_rank=True)  # P = 1 runs the plan too
    out = {"planned": _train(rank, P, Config(**base))}
    orig = schedule.make_plan

    def forced(scheme, order, numel, density, cost=None, **kw):
        if cost is None:  # the provisional plan: unchanged
            return orig(scheme, order, numel, density, cost, **kw)
        return Plan.from_dict(hand)

    schedule.make_plan = forced
    try:
        out["forced"] = _train(rank, P, Config(**base))
    finally:
        schedule.make_plan = orig
    out["given"] = _train(rank, P, Config(**base, plan=hand))
    return out


@pytest.mark.parametrize("P", [1, 2, 3])
def test_a_given_plan_replays_the_run_that_chose_it_bitwise(P):
    hand = _hand_plan()
    out = run_distributed(_replay, P, hand.to_dict(), timeout=300)
    for r in out:
        (p_plan, d_plan, _), (p_forced, d_forced, c_forced), (p_given, d_given, c_given) = (
            r["planned"], r["forced"], r["given"])
        assert d_forced == d_given == hand.digest() != d_plan
        assert torch.equal(p_given, p_forced)
        assert not torch.equal(p_given, p_plan)  # the plan matters: the check above could fail
        assert not c_forced and c_given  # the replay profiled nothing
    for r in out[1:]:  # every rank holds the same parameters
        assert torch.equal(r["given"][0], out[0]["given"][0])


def test_config_plan_validation():
    hand = _hand_plan()
    cfg = Config(scheme="multi_tensor", density=D, plan=hand.to_dict())
    assert cfg.plan == hand.to_dict() and cfg.plan is not hand.to_dict()
    assert Config.from_dict(cfg.to_dict()) == cfg  # the JSON/YAML round trip keeps it
    with pytest.raises(ValueError, match="must be a plan dict"):
        Config(scheme="multi_tensor", plan=[1, 2])
    with pytest.raises(ValueError, match="not a valid plan"):
        Config(scheme="multi_tensor", plan={"scheme": "multi_tensor"})
    with pytest.raises(ValueError, match="not a valid plan"):
        Config(scheme="multi_tensor", plan={**hand.to_dict(), "buffers": []})
    with pytest.raises(ValueError, match="made for scheme 'multi_tensor'"):
        Config(scheme="cupcake", plan=hand.to_dict())


def test_engine_refuses_a_plan_that_does_not_fit_the_model():
    d = _hand_plan().to_dict()
    short = {**d, "buffers": d["buffers"][1:]}  # the last layer's bias left out
    with pytest.raises(ValueError, match=r"missing \['net.5.bias'\]"):
        GradSync(build("mlp", seed=0), Config(scheme="multi_tensor", plan=short))
    extra = json.loads(json.dumps(d))
    extra["buffers"][0]["tensors"][0]["name"] = "head.bias"
    with pytest.raises(ValueError, match=r"not synchronized here \['head.bias'\]"):
        GradSync(build("mlp", seed=0), Config(scheme="multi_tensor", plan=extra))
    sized = json.loads(json.dumps(d))
    sized["buffers"][0]["tensors"][0]["numel"] += 1
    with pytest.raises(ValueError, match=r"sizes differ for \['net.5.bias'\]"):
        GradSync(build("mlp", seed=0), Config(scheme="multi_tensor", plan=sized))


def test_ddp_hook_refuses_a_plan():
    from gradsync.integrations import ddp

    plan = Plan(scheme="per_tensor", buffers=[BufferPlan(
        tensors=(TensorPlan("w", 4, D),), mode="per_tensor")])
    with pytest.raises(ValueError, match=r"takes no Config\.plan"):
        ddp.hook(Config(scheme="per_tensor", density=D, plan=plan.to_dict()))


def test_checkpoint_of_another_plan_is_refused():
    hand = _hand_plan()
    a = GradSync(build("mlp", seed=0), Config(scheme="multi_tensor", density=D,
                                              plan=hand.to_dict()))
    b = GradSync(build("mlp", seed=0), Config(scheme="multi_tensor", density=D))
    try:
        with pytest.raises(ValueError, match="plan"):
            b.load_state_dict(a.state_dict())
    finally:
        a.close()
        b.close()


def _auto_pinned(rank: int, P: int, plan: dict) -> tuple[str, bool, list]:
    model = build("mlp", seed=0)
    sync = GradSync(model, Config(scheme="auto", density=D, sparsifier="topk",
                                  warmup_steps=WARMUP, plan=plan))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    probing = []
    try:
        for step in range(WARMUP + 25):  # past two drift windows and a trial's start
            x, y = image_batch(rank, step)
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            sync.synchronize()
            opt.step()
            probing.append(sync.stats()["probing"])
        return sync.plan.digest(), sync.cost is None, probing
    finally:
        sync.close()


def test_auto_with_a_plan_keeps_it_and_never_probes():
    plan = _hand_plan("auto")
    for digest, no_cost, probing in run_distributed(_auto_pinned, 2, plan.to_dict(),
                                                     timeout=300):
        assert digest == plan.digest() and no_cost and not any(probing)


def test_digest_names_the_structure_not_the_info():
    a = _hand_plan()
    b = Plan.from_dict({**a.to_dict(), "info": {"predicted": 1.0}})
    assert a.digest() == b.digest() and len(a.digest()) == 12
    c = a.to_dict()
    c["buffers"][0]["density"] = 0.1
    assert Plan.from_dict(c).digest() != a.digest()
    assert Plan.from_dict({**a.to_dict(), "overlap": False}).digest() != a.digest()


def _train_argv(out, *extra: str) -> list[str]:
    return ["--model", "mlp", "--data", "synthetic", "--scheme", "multi_tensor,ddp",
            "--world-size", "2", "--steps", "5", "--warmup-steps", "2", "--batch-size", "8",
            "--eval-batches", "0", "--no-progress", "--out", str(out), *extra]


def test_train_writes_plans_and_replays_them(tmp_path, capsys):
    from gradsync.apps import train

    assert train.main(_train_argv(tmp_path / "a")) == 0
    plans = json.loads((tmp_path / "a" / "plans.json").read_text())
    assert set(plans) == {"multi_tensor"}  # torch's DDP has no plan
    # replay a plan other than the one the run chose: the run must end with it
    hand = _hand_plan().to_dict()
    (tmp_path / "hand.json").write_text(json.dumps({"multi_tensor": hand}))
    assert train.main(_train_argv(tmp_path / "b", "--plan", str(tmp_path / "hand.json"))) == 0
    m = json.loads((tmp_path / "b" / "metrics.json").read_text())
    run = next(r for r in m["runs"] if r["scheme"] == "multi_tensor")
    assert run["summary"]["plan_digest"] == Plan.from_dict(hand).digest()
    assert m["config"]["replayed_plans"] == ["multi_tensor"]
    # the same plan twice: the same losses, step for step
    assert train.main(_train_argv(tmp_path / "c", "--plan", str(tmp_path / "hand.json"))) == 0
    again = json.loads((tmp_path / "c" / "metrics.json").read_text())["runs"][0]
    assert [s["loss"] for s in again["steps"]] == [s["loss"] for s in run["steps"]]


@pytest.mark.parametrize("content, msg", [
    (None, "--plan"),                                        # no such file
    ("{not json", "--plan"),
    ({"cupcake": {}}, r"no plan for \['multi_tensor'\]"),
    ({"multi_tensor": {"scheme": "multi_tensor"}}, r"plans\['multi_tensor'\]: .*not a valid"),
    ({"multi_tensor": "CUPCAKE"}, "must be a plan dict"),
    ([1], "must map scheme names"),
])
def test_train_refuses_bad_plan_files(tmp_path, capsys, content, msg):
    from gradsync.apps import train

    path = tmp_path / "plans.json"
    if content is not None:
        path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(SystemExit) as e:
        train.parse_args(_train_argv(tmp_path / "o", "--plan", str(path)))
    assert e.value.code == 2
    assert re.search(msg, capsys.readouterr().err)


def test_train_refuses_a_plan_of_another_scheme(tmp_path, capsys):
    from gradsync.apps import train

    path = tmp_path / "plans.json"
    path.write_text(json.dumps({"multi_tensor": _hand_plan("cupcake").to_dict()}))
    with pytest.raises(SystemExit):
        train.parse_args(_train_argv(tmp_path / "o", "--plan", str(path)))
    assert "made for scheme 'cupcake'" in capsys.readouterr().err


def test_readme_replay_sentence_names_what_these_tests_run():
    """docs/usage.md: ``sync.plan.to_dict()``, ``Config(plan=...)`` replays bitwise (the replay
    test above), ``train --out`` writes ``plans.json`` and ``train --plan`` replays it (the train
    test above)."""
    from pathlib import Path

    text = " ".join((Path(__file__).resolve().parents[1] / "docs/usage.md").read_text().split())
    assert ("`sync.plan.to_dict()` is the plan a run used, and `Config(plan=...)` replays it "
            "bitwise") in text
    assert "`train --out` writes every run's plan to `plans.json`" in text
    assert "`train --plan plans.json` replays them" in text


def test_tinygpt_budget_plans_keep_the_budget_and_follow_the_shares():
    """docs/results/accuracy-history.md, "Why SSFusion trails on TinyGPT": the plans in
    docs/results/tinygpt-budget/ fit gpt_tiny, spend the entries of the plans they replace
    (per_tensor: 1 % of the model; SSFusion: the study's plan for that seed, the same tensors
    sent whole), and give each sparsified tensor a density in proportion to its measured
    top-k share wherever that share is worth more than the one-entry floor."""
    import math
    from pathlib import Path

    from gradsync.engine.warmup import given_plan
    from gradsync.sparsify import target_k

    root = Path(__file__).resolve().parents[1] / "docs/results"
    numel = {n: p.numel() for n, p in build("gpt_tiny", seed=0).named_parameters()}
    shares = json.loads((root / "tinygpt-budget/topka-shares-seed1.json").read_text())["tensors"]
    assert set(shares) == set(numel)
    assert math.isclose(sum(s["topk_share"] for s in shares.values()), 1.0, rel_tol=1e-9)

    def entries(plan: Plan) -> dict[str, float | None]:
        return {t.name: None if t.density is None else t.density * t.numel
                for b in plan.buffers for t in b.tensors}

    def check(scheme: str, path: Path, budget: float, whole: set[str]) -> None:
        raw = json.loads(path.read_text())[scheme]
        plan = given_plan(Config(scheme=scheme, density=0.01, plan=raw), numel)
        got = entries(plan)
        got_d = {t.name: t.density for b in plan.buffers for t in b.tensors}
        assert {n for n, e in got.items() if e is None} == whole
        sparse = {n: e for n, e in got.items() if e is not None}
        assert sum(sparse.values()) == pytest.approx(budget, rel=0.005)
        total = sum(shares[n]["topk_share"] for n in sparse)
        ratios = [e / (shares[n]["topk_share"] / total) for n, e in sparse.items() if e > 1.0001]
        assert len(ratios) >= 8 and max(ratios) / min(ratios) == pytest.approx(1.0, abs=1e-9)
        assert min(sparse.values()) >= 0.99  # the floor: about one entry (scaled to the budget)
        sent = sum(target_k(numel[n], got_d[n]) for n in sparse)  # as the sparsifiers round
        assert sent == pytest.approx(budget, rel=0.005)

    check("per_tensor", root / "tinygpt-budget/per_tensor-topka-shares.json",
          target_k(sum(numel.values()), 0.01), set())
    for seed in (1, 2, 3):
        study = Plan.from_dict(json.loads((root / f"convergence-plans/plans-gpt_tiny-seed{seed}"
                                                  ".json").read_text())["ssfusion"])
        before = entries(study)
        check("ssfusion", root / f"tinygpt-budget/ssfusion-topka-shares-seed{seed}.json",
              sum(e for e in before.values() if e is not None),
              {n for n, e in before.items() if e is None})


def test_readme_tinygpt_gap_split_is_the_saved_runs():
    """docs/results/accuracy.md: on TinyGPT at 60 steps SSFusion ends 1.63 above TopkA; the
    plans built from `train --topk-shares` split it into 0.66 (the weights' allocation), 0.56
    (the tensors sent whole, 40 % of the budget) and 0.41 (choosing anew every step).
    Recomputed from the default study's finals, the saved runs and the saved plans."""
    import re
    import statistics
    from pathlib import Path

    from gradsync.sparsify import target_k

    root = Path(__file__).resolve().parents[1]
    text = " ".join((root / "docs/results/accuracy-history.md").read_text().split())
    m = re.search(r"SSFusion ends ([\d.]+) of perplexity above TopkA at the same bytes\. "
                  r"`train --topk-shares` records.*?the weights' allocation \(([\d.]+)\), the "
                  r"LayerNorm and bias tensors SSFusion sends whole, which take (\d+) % of "
                  r"TinyGPT's budget \(([\d.]+)\), and TopkA's choosing anew every step "
                  r"\(([\d.]+)\)", text)
    assert m, "the accuracy page's sentence changed"
    gap, alloc, budget_pct, whole, anew = (float(g) for g in m.groups())
    study = {r["scheme"]: r["finals"] for r in json.loads(
        (root / "docs/results/convergence.json").read_text())["rows"] if r["model"] == "gpt_tiny"}
    runs = json.loads((root / "docs/results/tinygpt-budget/results.json").read_text())["runs"]
    mean = statistics.fmean
    ss, topka = mean(study["ssfusion"]), mean(study["topka"])
    ss_by = mean(runs["60"]["ssfusion_by_shares"]["finals"])
    pt_by = mean(runs["60"]["per_tensor_by_shares"]["finals"])
    assert round(ss - topka, 2) == gap
    assert round(ss - ss_by, 2) == alloc
    assert round(ss_by - pt_by, 2) == whole
    assert round(pt_by - topka, 2) == anew
    plan = Plan.from_dict(json.loads((root / "docs/results/convergence-plans/"
                                              "plans-gpt_tiny-seed1.json").read_text())["ssfusion"])
    sent_whole = sum(t.numel for b in plan.buffers for t in b.tensors if t.density is None)
    n = sum(t.numel for b in plan.buffers for t in b.tensors)
    assert round(100 * 0.5 * sent_whole / target_k(n, 0.01)) == budget_pct
    shares = json.loads((root / "docs/results/tinygpt-budget/topka-shares-seed1.json").read_text())
    assert "--topk-shares" in shares["command"] and shares["density"] == 0.01
