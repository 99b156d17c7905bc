"""docs/results/accuracy.md, "per_tensor on ResNet-18: one budget per tensor": every figure of
the section recomputed from what it names — the `train --topk-shares` runs saved in
docs/results/resnet18-budget/, the plans replayed there, and the study pages — here, not by
the code under test."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from gradsync.apps.models import build
from gradsync.engine.config import Config
from gradsync.engine.warmup import given_plan
from test_bench_convergence import WARMUP_R18, _by_scheme, _interval_cell, _mean_sd

ROOT = Path(__file__).resolve().parents[1]
BUDGET = ROOT / "docs/results/resnet18-budget"
PAGE = "resnet18-budget/per-tensor-by-topka-shares"
MIN_K = 8  # Config.min_k's default: what the plans keep as each tensor's floor


def _k(n: int, d: float) -> int:
    """Entries a density selects: max(1, round(d·n)), at most n (the sparsifiers' rule)."""
    return min(n, max(1, round(d * n)))


def _section() -> str:
    text = (ROOT / "docs/results/accuracy.md").read_text()
    body = text.split("## per_tensor on ResNet-18: one budget per tensor")[1]
    return " ".join(body.split("\n## ")[0].split())


def _shares() -> dict[str, dict[str, dict]]:
    runs = json.loads((BUDGET / "topk-shares-seed1.json").read_text())["runs"]
    return {s: r["topk_shares"]["tensors"] for s, r in runs.items()}


EARLY = ("stem.", "layers.0.", "layers.1.", "layers.2.", "layers.3.", "fc.")


def test_shares_fit_resnet18_and_the_section_quotes_them():
    numel = {n: p.numel() for n, p in build("resnet18", seed=0).named_parameters()}
    shares = _shares()
    assert set(shares) == {"per_tensor", "topka"}
    for t in shares.values():
        assert {n: v["numel"] for n, v in t.items()} == numel
        assert sum(v["topk_share"] for v in t.values()) == pytest.approx(1.0, rel=1e-9)
    N = sum(numel.values())
    text = _section()

    def pct(x: float) -> str:
        return f"{100 * x:.1f} %"

    early = [n for n in numel if n.startswith(EARLY)]
    entry = sum(numel[n] for n in early) / N
    tk = sum(shares["topka"][n]["topk_share"] for n in early)
    pt = sum(shares["per_tensor"][n]["topk_share"] for n in early)
    assert (f"hold {pct(entry)} of its entries and {pct(tk)} of TopkA's selection" in text)
    assert f"{pct(pt)} of a global top 1 % of per_tensor's own accumulators" in text
    # the sparsified tensors a global selection of per_tensor's accumulators would give less
    # than their 1 %
    sparse = [n for n in numel if _k(numel[n], 0.01) >= MIN_K]
    low = [n for n in sparse
           if shares["per_tensor"][n]["topk_share"] < shares["per_tensor"][n]["entry_share"]]
    got = sum(numel[n] for n in low) / sum(numel[n] for n in sparse)
    low_share = sum(shares["per_tensor"][n]["topk_share"] for n in low)
    assert f"spends {pct(got)} of its budget on {len(low)} tensors" in text
    assert f"which hold {pct(low_share)} of that top 1 %" in text
    k = 0.01 * N
    for name, label in (("layers.0.conv1.weight", "the first block's convolutions"),
                        ("fc.weight", "the classifier's weights"),
                        ("layers.7.conv2.weight", "the last convolution")):
        frac = shares["topka"][name]["topk_share"] * k / numel[name]
        assert f"{frac * 100:.2f} % of {label}" in text, (name, frac)


def test_plans_give_each_tensor_its_topka_share_at_per_tensor_budget():
    numel = {n: p.numel() for n, p in build("resnet18", seed=0).named_parameters()}
    shares = _shares()["topka"]
    whole = {n for n, c in numel.items() if _k(c, 0.01) < MIN_K}  # per_tensor's min_k rule
    budget = sum(_k(c, 0.01) for n, c in numel.items() if n not in whole)
    for seed in (1, 2, 3):
        raw = json.loads((BUDGET / f"plans/plans-resnet18-seed{seed}.json").read_text())
        plan = given_plan(Config(scheme="per_tensor", density=0.01, plan=raw["per_tensor"]),
                          numel)
        d = {t.name: t.density for b in plan.buffers for t in b.tensors}
        assert {n for n, x in d.items() if x is None} == whole
        e = {n: x * numel[n] for n, x in d.items() if x is not None}
        assert sum(e.values()) == pytest.approx(budget, rel=1e-9)
        assert sum(_k(numel[n], d[n]) for n in e) == pytest.approx(budget, abs=len(e))
        assert min(e.values()) >= MIN_K - 1e-9 and all(e[n] <= numel[n] for n in e)
        free = [n for n in e if MIN_K + 1e-6 < e[n] < numel[n] - 1e-6]
        ratios = [e[n] / shares[n]["topk_share"] for n in free]
        assert len(free) >= 15 and max(ratios) / min(ratios) == pytest.approx(1.0, abs=1e-9)
        # a tensor held at its floor would get fewer than MIN_K by its share; one at its cap more
        # than its entries
        for n in e:
            if n not in free:
                want = shares[n]["topk_share"] * ratios[0]
                assert want < MIN_K if e[n] <= MIN_K + 1e-6 else want > numel[n]


def test_study_of_the_plans_as_the_section_says():
    text = _section()
    page = _by_scheme(PAGE, "--model resnet18 --schemes ddp,per_tensor --seeds 3 --steps 160 "
                            "--eval-points 1 --plans docs/results/resnet18-budget/plans")
    default = _by_scheme(WARMUP_R18, "--model resnet18")
    by, dflt, ddp = page["per_tensor"]["finals"], default["per_tensor"]["finals"], \
        page["ddp"]["finals"]
    assert f"{_mean_sd(by)} %" in text and f"{_mean_sd(dflt)} %" in text
    assert f"{_interval_cell(by, ddp)} vs DDP" in text
    assert f"{_interval_cell(dflt, ddp)} vs DDP" in text
    assert f"{_interval_cell(by, dflt)} paired" in text
    gains = [100 * (a - b) for a, b in zip(by, dflt, strict=True)]
    assert all(g > 0 for g in gains) and "every seed higher" in text
    assert "Every seed gains (" + ", ".join(f"{g:+.2f}" for g in gains) + " points)" in text
    assert (f"the spread falls from {100 * statistics.stdev(dflt):.2f} to "
            f"{100 * statistics.stdev(by):.2f}") in text
    for row in (default["per_tensor"], page["per_tensor"]):
        assert (f"| {row['bytes_per_step'] / 1e6:.2f} ({row['run_bytes_per_step'] / 1e6:.2f}) |"
                in text)
    assert page["per_tensor"]["run_bytes_per_step"] < default["per_tensor"]["run_bytes_per_step"]
    assert statistics.mean(ddp) == pytest.approx(0.8311, abs=5e-5)
