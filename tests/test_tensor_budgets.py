"""docs/results/accuracy-history.md, "One density for every tensor": every figure of the section
recomputed from what it names — the `train --topk-shares` runs saved in
docs/results/resnet18-budget/ and docs/results/resnet20-cosine/budget/, the plans replayed
there, and the study pages — here, not by the code under test."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from gradsync.apps.models import build
from gradsync.engine.config import Config
from gradsync.engine.warmup import given_plan
from test_bench_convergence import (
    HISTORY,
    WARMUP_CNN,
    WARMUP_R18,
    WARMUP_R20,
    _by_scheme,
    _gap_cell,
    _interval_cell,
    _mean_gap_points,
    _mean_sd,
    _results,
)

ROOT = Path(__file__).resolve().parents[1]
BUDGET = ROOT / "docs/results/resnet18-budget"
R20 = ROOT / "docs/results/resnet20-cosine/budget"
PAGE = "resnet18-budget/per-tensor-by-topka-shares"
PAGE_FC = "resnet18-budget/per-tensor-classifier-by-topka-share"
PAGE_WHOLE = "resnet18-budget/per-tensor-classifier-whole"
MIN_K = 8  # Config.min_k's default: what the plans keep as each tensor's floor


def _k(n: int, d: float) -> int:
    """Entries a density selects: max(1, round(d·n)), at most n (the sparsifiers' rule)."""
    return min(n, max(1, round(d * n)))


def _section() -> str:
    text = HISTORY.read_text()
    body = text.split("## One density for every tensor: per_tensor on ResNet-18, SSFusion-OI "
                      "on ResNet-20")[1]
    return " ".join(body.split("\n## ")[0].split())


def _shares(where: Path = BUDGET) -> dict[str, dict[str, dict]]:
    runs = json.loads((where / "topk-shares-seed1.json").read_text())["runs"]
    return {s: r["topk_shares"]["tensors"] for s, r in runs.items()}


def _numel(model: str) -> dict[str, int]:
    return {n: p.numel() for n, p in build(model, seed=0).named_parameters()}


def _per_tensor_budget(numel: dict[str, int]) -> tuple[set[str], int]:
    """per_tensor's default plan at 1 %: the tensors its ``min_k`` rule sends whole, and the
    entries a step the others send."""
    whole = {n for n, c in numel.items() if _k(c, 0.01) < MIN_K}
    return whole, sum(_k(c, 0.01) for n, c in numel.items() if n not in whole)


def _densities(plan_raw: dict, scheme: str, numel: dict[str, int]) -> dict[str, float | None]:
    """A saved plan as the engine takes it (``Config.plan``): each tensor's density."""
    plan = given_plan(Config(scheme=scheme, density=0.01, plan=plan_raw), numel)
    return {t.name: t.density for b in plan.buffers for t in b.tensors}


EARLY = ("stem.", "layers.0.", "layers.1.", "layers.2.", "layers.3.", "fc.")


def test_shares_fit_resnet18_and_the_section_quotes_them():
    numel = _numel("resnet18")
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


def _check_plan(plan_raw: dict, scheme: str, numel: dict[str, int], shares: dict[str, dict],
                whole: set[str], budget: int) -> None:
    """A replayed plan: ``whole`` sent whole, ``budget`` entries in all, each sparsified
    tensor's entries in proportion to its share, floor MIN_K entries, cap its size."""
    d = _densities(plan_raw, scheme, numel)
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


def test_plans_give_each_tensor_its_topka_share_at_per_tensor_budget():
    numel = _numel("resnet18")
    whole, budget = _per_tensor_budget(numel)
    for seed in (1, 2, 3):
        raw = json.loads((BUDGET / f"plans/plans-resnet18-seed{seed}.json").read_text())
        _check_plan(raw["per_tensor"], "per_tensor", numel, _shares()["topka"], whole, budget)


def test_classifier_plans_change_only_the_classifier_share():
    """The plans of the third row: per_tensor's, the classifier at its density in the plans by
    TopkA's shares, every other sparsified tensor at one density, the same total entries."""
    numel = _numel("resnet18")
    whole, budget = _per_tensor_budget(numel)
    by = json.loads((BUDGET / "plans/plans-resnet18-seed1.json").read_text())["per_tensor"]
    fc = next(t["density"] for b in by["buffers"] for t in b["tensors"] if t["name"] == "fc.weight")
    text = _section()
    for seed in (1, 2, 3):
        raw = json.loads((BUDGET / f"plans-classifier/plans-resnet18-seed{seed}.json").read_text())
        d = _densities(raw["per_tensor"], "per_tensor", numel)
        assert {n for n, x in d.items() if x is None} == whole
        assert d["fc.weight"] == fc
        rest = {x for n, x in d.items() if x is not None and n != "fc.weight"}
        assert len(rest) == 1
        assert sum(x * numel[n] for n, x in d.items() if x is not None) == pytest.approx(budget)
        assert (f"the classifier at {100 * fc:.1f} % ({round(fc * numel['fc.weight']):,} entries"
                f" a step), every other tensor at {100 * rest.pop():.2f} %") in text
    shares = _by_scheme(PAGE)["per_tensor"]["finals"]
    page = _by_scheme(PAGE_FC, "--model resnet18 --schemes ddp,per_tensor --seeds 3 --steps 160 "
                               "--eval-points 1 --plans docs/results/resnet18-budget/"
                               "plans-classifier")
    dflt = _by_scheme(WARMUP_R18, "--model resnet18")["per_tensor"]["finals"]
    fcf, ddp = page["per_tensor"]["finals"], page["ddp"]["finals"]
    assert ddp == _by_scheme(PAGE)["ddp"]["finals"]
    assert f"| {_mean_sd(fcf)} % | {_interval_cell(fcf, ddp)} vs DDP |" in text
    assert f"{_interval_cell(fcf, dflt)} paired" in text
    assert all(a > b for a, b in zip(fcf, shares, strict=True))
    assert f"{_interval_cell(fcf, shares)} against the plans by TopkA's shares, every seed" in text
    tk = _shares()["topka"]["fc.weight"]
    sent = tk["topk_share"] * 0.01 * sum(numel.values())
    assert (f"the classifier sends {_k(numel['fc.weight'], 0.01)} of its "
            f"{numel['fc.weight']:,} weights a step, where TopkA sends about "
            f"{round(sent, -1):,.0f}") in text
    whole_page = _by_scheme(PAGE_WHOLE, "--model resnet18 --schemes ddp,per_tensor --seeds 3 "
                                        "--steps 160 --eval-points 1 --min-k 52")
    whole = whole_page["per_tensor"]["finals"]
    assert whole_page["ddp"]["finals"] == ddp
    assert f"| {_mean_sd(whole)} % | {_interval_cell(whole, ddp)} vs DDP |" in text
    assert f"| {_interval_cell(whole, dflt)} paired |" in text
    assert f"{_mean_sd(whole)} %, {_interval_cell(whole, dflt).split(' ')[0]} paired" in text
    assert ("its share against whole, seed by seed: "
            + ", ".join(f"{100 * (a - b):+.2f}" for a, b in zip(fcf, whole, strict=True))
            .replace("-", "−") + ")") in text
    assert f"one {100 * min(whole):.2f} %" in text
    for row in (page["per_tensor"], whole_page["per_tensor"]):
        assert (f"| {row['bytes_per_step'] / 1e6:.2f} ({row['run_bytes_per_step'] / 1e6:.2f}) |"
                in text)


def test_resnet20_plans_and_study_as_the_section_says():
    """SSFusion-OI on ResNet-20: each seed's plan of the 10-seed page (its whole tensors, its
    entries at d′) with the convolutions' entries by TopkA's shares; the study against the
    10-seed page's seeds 1–5 and their DDP runs."""
    numel = _numel("resnet20")
    shares = _shares(R20)
    assert {n: v["numel"] for n, v in shares["topka"].items()} == numel
    text = _section()
    N = sum(numel.values())
    for name, label in (("layer1.0.conv2.weight", "of the first block's second convolution"),
                        ("layer3.2.conv2.weight", "of the last")):
        frac = shares["topka"][name]["topk_share"] * 0.01 * N / numel[name]
        assert f"{frac * 100:.2f} % {label}" in text, (name, frac)
    own = _by_scheme("resnet20-cosine/lead-follows-dgc-warmup-ssfusion-oi", "--model resnet20")
    assert own["ssfusion_oi"]["seeds"][:5] == [1, 2, 3, 4, 5]
    for seed in (1, 2, 3, 4, 5):
        raw = json.loads((R20 / f"plans/plans-resnet20-seed{seed}.json").read_text())
        ts = [t for b in raw["ssfusion_oi"]["buffers"] for t in b["tensors"]]
        whole = {t["name"] for t in ts if t["density"] is None}
        assert len(whole) == 41
        d0 = raw["ssfusion_oi"]["info"]["compensation"]["density"]  # the plan's own d′
        budget = sum(_k(numel[n], d0) for n in numel if n not in whole)
        assert f"the same {budget:,} entries a step" in text
        _check_plan(raw["ssfusion_oi"], "ssfusion_oi", numel, shares["topka"], whole, budget)
    page = _by_scheme("resnet20-cosine/ssfusion-oi-by-topka-shares", "--model resnet20 --steps 160 "
                      "--eval-points 4 --lr-schedule cosine --seeds 5 --schemes ddp,ssfusion_oi "
                      "--plans docs/results/resnet20-cosine/budget/plans")
    ddp = page["ddp"]["finals"]
    assert ddp == own["ddp"]["finals"][:5]
    by, o5 = page["ssfusion_oi"]["finals"], own["ssfusion_oi"]["finals"][:5]
    assert f"| {_mean_sd(o5)} % | {_interval_cell(o5, ddp)} vs DDP |" in text
    assert f"| {_mean_sd(by)} % | {_interval_cell(by, ddp)} vs DDP |" in text
    ups = sum(a > b for a, b in zip(by, o5, strict=True))
    assert f"{_interval_cell(by, o5)} paired, {ups} of 5 seeds higher" in text
    for row in (own["ssfusion_oi"], page["ssfusion_oi"]):
        assert f"| {row['bytes_per_step'] / 1e6:.3f} |" in text
    assert _interval_cell(by, ddp).startswith("−0.") and ups >= 4
    gain = _mean_gap_points(by, ddp) - _mean_gap_points(o5, ddp)
    assert (f"of its {-_mean_gap_points(o5, ddp):.2f} points, about {gain:.2f} are the one "
            "density for every convolution") in text
    topka = _by_scheme(WARMUP_R20, "--model resnet20")
    assert f"What remains (TopkA {_gap_cell(topka['topka']['finals'], topka['ddp']['finals'])})" \
        in text


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
    assert ("Every seed gains with the shares (" + ", ".join(f"{g:+.2f}" for g in gains)
            + " points)") in text
    assert (f"the spread falls from {100 * statistics.stdev(dflt):.2f} to "
            f"{100 * statistics.stdev(by):.2f}") in text
    for row in (default["per_tensor"], page["per_tensor"]):
        assert (f"| {row['bytes_per_step'] / 1e6:.2f} ({row['run_bytes_per_step'] / 1e6:.2f}) |"
                in text)
    assert page["per_tensor"]["run_bytes_per_step"] < default["per_tensor"]["run_bytes_per_step"]
    assert statistics.mean(ddp) == pytest.approx(0.8311, abs=5e-5)


# accuracy-history.md, "Entries by the gradient's mass": Config.budget="gradient" against the even
# budget's runs of the same seeds (label of the row, its page, the even budget's page, scheme)
GRADIENT_ROWS = (
    ("ResNet-18 (3), per_tensor", "budget-gradient/resnet18", WARMUP_R18, "per_tensor"),
    ("ResNet-18 (3), SSFusion-OI", "budget-gradient/resnet18", WARMUP_R18, "ssfusion_oi"),
    ("ResNet-20 cosine (5), per_tensor", "budget-gradient/resnet20-cosine", WARMUP_R20,
     "per_tensor"),
    ("ResNet-20 cosine (5), SSFusion-OI", "budget-gradient/resnet20-cosine",
     "resnet20-cosine/lead-follows-dgc-warmup-ssfusion-oi", "ssfusion_oi"),
    ("CNN (10), per_tensor", "budget-gradient/cnn", WARMUP_CNN, "per_tensor"),
    ("CNN (10), SSFusion-OI and SSFusion (the same plans)", "budget-gradient/cnn", WARMUP_CNN,
     "ssfusion_oi"),
)


def _table_row(section: str, label: str) -> str:
    """The markdown row of ``section`` that starts with ``label``, bold marks dropped."""
    (line,) = [ln for ln in section.splitlines() if ln.startswith(f"| {label} |")]
    return line.replace("**", "")


def test_the_gradients_mass_table_holds_in_the_written_results():
    """Every cell of the table recomputed from the pages: the runs of `--budget gradient`, the
    even budget's of the same seeds, one set of DDP runs per model, the same bytes a step."""
    text = HISTORY.read_text()
    section = text.split("## Entries by the gradient's mass")[1].split("\n## ")[0]
    for label, page, even_page, scheme in GRADIENT_ROWS:
        rows = _by_scheme(page, "--model")
        got, ddp = rows[scheme], rows["ddp"]["finals"]
        n = len(got["finals"])
        even = _by_scheme(even_page)[scheme]
        assert even["seeds"][:n] == got["seeds"] == rows["ddp"]["seeds"], label
        base = even["finals"][:n]
        row = _table_row(section, label)
        assert f"| {_mean_sd(base)} % | {_mean_sd(got['finals'])} % | " in row, label
        assert f"| {_interval_cell(got['finals'], ddp)} |" in row, label
        assert f"| {_interval_cell(got['finals'], base)}" in row, label
        up = all(x > y for x, y in zip(got["finals"], base))
        down = all(x < y for x, y in zip(got["finals"], base))
        assert ("every seed lower" in row) == down, label
        assert ("every seed" in row and not down) == up, label
        mb = (even["bytes_per_step"] / 1e6, got["bytes_per_step"] / 1e6)
        assert row.endswith(f"| {mb[0]:.3f} → {mb[1]:.3f} |") or row.endswith(
            f"| {mb[0]:.2f} → {mb[1]:.2f} |"), (label, mb)
        assert got["bytes_per_step"] == pytest.approx(even["bytes_per_step"], rel=0.01)
    # SSFusion and SSFusion-OI train the same CNN plans: one row for both
    cnn = _by_scheme("budget-gradient/cnn")
    assert cnn["ssfusion"]["finals"] == cnn["ssfusion_oi"]["finals"]
    # TinyGPT: perplexity, against the 1000-step page's runs
    lm, before = _by_scheme("budget-gradient/lm-1000"), _by_scheme("convergence-lm-1000-2026-12-06")
    assert lm["ddp"]["finals"] == before["ddp"]["finals"]
    g, e = lm["ssfusion_oi"]["finals"], before["ssfusion_oi"]["finals"]
    d = [x - y for x, y in zip(g, e, strict=True)]
    m, h = statistics.mean(d), 4.303 * statistics.stdev(d) / 3 ** 0.5
    row = _table_row(section, "TinyGPT, 1000 steps (3), SSFusion-OI (perplexity)")
    assert (f"| {statistics.mean(e):.2f} ± {statistics.stdev(e):.2f} | "
            f"{statistics.mean(g):.2f} ± {statistics.stdev(g):.2f} | "
            f"+{statistics.mean(g) - statistics.mean(lm['ddp']['finals']):.2f} (+"
            f"{100 * (statistics.mean(g) / statistics.mean(lm['ddp']['finals']) - 1):.1f} % of "
            f"DDP's {statistics.mean(lm['ddp']['finals']):.2f}) | "
            f"{m:+.2f} [{m - h:+.2f}, {m + h:+.2f}] (worse)").replace("-", "−") in row.replace(
                "-", "−")
    # the bars: per_tensor on ResNet-18 within 1.5 of DDP, SSFusion-OI on ResNet-20 within 1.0
    r18, r20 = _by_scheme("budget-gradient/resnet18"), _by_scheme("budget-gradient/resnet20-cosine")
    assert abs(_mean_gap_points(r18["per_tensor"]["finals"], r18["ddp"]["finals"])) <= 1.5
    assert abs(_mean_gap_points(r20["ssfusion_oi"]["finals"], r20["ddp"]["finals"])) <= 1.0


# accuracy-history.md, "Half evenly, half by mass": Config.budget="blend" against the even budget's
# and the gradient's runs of the same seeds (label, its page, the even budget's page, scheme)
BLEND_ROWS = tuple((label, page.replace("gradient", "blend"), even, scheme)
                   for label, page, even, scheme in GRADIENT_ROWS if "ResNet" in label)


def test_the_blend_table_holds_in_the_written_results():
    """Every cell recomputed from the pages: the runs of `--budget blend`, those of the even
    budget and of `--budget gradient` of the same seeds, the blend page's own DDP runs."""
    section = HISTORY.read_text().split(
        "## Half evenly, half by mass")[1].split("\n## ")[0]
    for label, page, even_page, scheme in BLEND_ROWS:
        rows = _by_scheme(page, "--model")
        got, ddp = rows[scheme], rows["ddp"]["finals"]
        n = len(got["finals"])
        even = _by_scheme(even_page)[scheme]
        mass = _by_scheme(page.replace("blend", "gradient"), "--model")[scheme]
        assert even["seeds"][:n] == got["seeds"] == mass["seeds"] == rows["ddp"]["seeds"]
        base = even["finals"][:n]
        row = _table_row(section, label)
        assert (f"| {_mean_sd(base)} % | {_mean_sd(mass['finals'])} % | "
                f"{_mean_sd(got['finals'])} % | {_interval_cell(got['finals'], ddp)} | "
                f"{_interval_cell(got['finals'], base)} |") in row, label
        assert f"| {_interval_cell(got['finals'], mass['finals'])} |" in row, label
        mb = (even["bytes_per_step"] / 1e6, got["bytes_per_step"] / 1e6)
        assert row.endswith(f"| {mb[0]:.3f} → {mb[1]:.3f} |") or row.endswith(
            f"| {mb[0]:.2f} → {mb[1]:.2f} |"), (label, mb)
        assert got["bytes_per_step"] == pytest.approx(even["bytes_per_step"], rel=0.01)


def test_the_budget_pages_ran_the_budget():
    """Each page's command asked for it, and each run's plan shares its entries by mass."""
    for page in ("budget-gradient/resnet18", "budget-gradient/resnet20-cosine",
                 "budget-gradient/cnn", "budget-gradient/lm-1000", "budget-blend/resnet18",
                 "budget-blend/resnet20-cosine"):
        data = _results(page)
        rule = page.split("/")[0].removeprefix("budget-")
        assert f" --budget {rule} " in data["meta"]["command"], page


def test_the_blend_bars_hold_in_the_written_results():
    """accuracy.md's bullets on "blend": issue 68's ResNet bars recomputed from the pages, each
    rule's misses, and what it costs SSFusion-OI on ResNet-18 (the README's BatchNorm bullet:
    test_bench_convergence.py)."""
    section = HISTORY.read_text().split(
        "## Half evenly, half by mass")[1].split("\n## ")[0]
    r18, r20 = _by_scheme("budget-blend/resnet18"), _by_scheme("budget-blend/resnet20-cosine")
    gap = {(m, s): _mean_gap_points(r[s]["finals"], r["ddp"]["finals"])
           for m, r in (("r18", r18), ("r20", r20)) for s in ("per_tensor", "ssfusion_oi")}
    assert f"`per_tensor` on\n  ResNet-18 ends {gap['r18', 'per_tensor']:+.2f} vs DDP" in section
    assert f"SSFusion-OI there {gap['r18', 'ssfusion_oi']:+.2f} (within 1.0" in section
    def pts(x: float) -> str:  # the pages' minus sign
        return f"{x:+.2f}".replace("-", "−")

    assert f"`per_tensor` on ResNet-20\n  {pts(gap['r20', 'per_tensor'])} (within 1.5)" in section
    assert abs(gap["r18", "per_tensor"]) <= 1.5 and abs(gap["r18", "ssfusion_oi"]) <= 1.0
    assert abs(gap["r20", "per_tensor"]) <= 1.5 and 1.0 < abs(gap["r20", "ssfusion_oi"]) < 1.03
    intel = _by_scheme("budget-gradient/resnet20-cosine")["ddp"]["finals"]
    edge = _mean_gap_points(r20["ssfusion_oi"]["finals"], intel)
    assert (f"SSFusion-OI on ResNet-20 {pts(gap['r20', 'ssfusion_oi'])} against this machine's "
            f"DDP runs and {pts(edge)}") in section.replace("\n  ", " ")
    oi, even = r18["ssfusion_oi"]["finals"], _by_scheme(WARMUP_R18)["ssfusion_oi"]["finals"]
    seeds = ", ".join(pts(100 * (a - b)) for a, b in zip(oi, even))
    assert f"(seeds {seeds})" in section.replace("\n  ", " ")


def test_the_blend_default_figures_hold_in_the_written_results():
    """accuracy-history.md, "Blend, the default": Config's default budget, every scheme's CNN gap to
    DDP (10 seeds) and issue 68's CNN bars, TinyGPT's SSFusion-OI over 1000 steps against DDP and
    paired with the even budget's runs, and the 60-step rows, recomputed from the pages' JSON
    (each trained with --budget blend)."""
    # per_tensor's default still; the SSFusion family's was until it pooled (test_pooled.py)
    assert Config(scheme="per_tensor").effective_budget == "blend"
    section = " ".join(HISTORY.read_text().split(
        "## Blend, the default: the CNN and TinyGPT")[1].split("\n## ")[0].split())
    for page in ("convergence-cnn-2026-12-07-blend", "budget-blend/lm-1000",
                 "convergence-lm-2026-12-07-blend"):
        data = _results(page)
        assert " --budget blend " in data["meta"]["command"] + " ", page
    cnn = _by_scheme("convergence-cnn-2026-12-07-blend")
    ddp = cnn["ddp"]["finals"]
    gap = {s: _gap_cell(cnn[s]["finals"], ddp) for s in cnn if s != "ddp"}
    assert all(len(r["finals"]) == 10 for r in cnn.values())
    assert (f"DDP {_mean_sd(ddp)} %, TopkA {gap['topka']}, SSFusion and SSFusion-OI "
            f"{gap['ssfusion']}, DenseStream {gap['densestream']}") in section
    assert gap["ssfusion"] == gap["ssfusion_oi"]
    assert f"Ok-Topk {gap['oktopk']}, per_tensor {gap['per_tensor']} (within 1.0)" in section
    pts = {s: _mean_gap_points(cnn[s]["finals"], ddp) for s in gap}
    assert all(pts[s] >= -0.5 for s in ("topka", "ssfusion", "ssfusion_oi", "densestream"))
    assert pts["oktopk"] >= -1.0 and pts["per_tensor"] >= -1.0
    even = _by_scheme(WARMUP_CNN)
    assert (f"moved from {_gap_cell(even['topka']['finals'], even['ddp']['finals'])} to "
            f"{gap['topka']} between the two machines") in section
    # TinyGPT, 1000 steps: perplexity, its gap to DDP in percent, paired with the even runs
    lm, lm_even = _by_scheme("budget-blend/lm-1000"), _by_scheme("convergence-lm-1000-2026-12-06")
    d = statistics.mean(lm["ddp"]["finals"])
    assert max(abs(a - b) for a, b in zip(lm["ddp"]["finals"], lm_even["ddp"]["finals"])) < 4e-6

    def ppl(s: str) -> str:
        f = lm[s]["finals"]
        return (f"{statistics.mean(f):.2f} ± {statistics.stdev(f):.2f} "
                f"(+{100 * (statistics.mean(f) / d - 1):.2f} %")

    assert f"SSFusion-OI {ppl('ssfusion_oi')} of DDP's {d:.2f})" in section
    assert f"per_tensor {ppl('per_tensor')};" in section
    paired = [a - b for a, b in zip(lm["ssfusion_oi"]["finals"], lm_even["ssfusion_oi"]["finals"])]
    seeds = ", ".join(f"{x:+.2f}".replace("-", "−") for x in paired)
    assert f"{statistics.mean(paired):+.2f} of perplexity (seeds {seeds})" in section
    # TinyGPT, 60 steps: the per-tensor schemes move, the others are the even study's runs
    short, before = (_by_scheme("convergence-lm-2026-12-07-blend"),
                     _by_scheme("convergence-lm-2026-12-05-defaults"))
    assert {s for s in short if short[s]["finals"] != before[s]["finals"]} == {
        "ssfusion", "ssfusion_oi", "per_tensor"}

    def sd(r: dict) -> str:
        return f"{statistics.mean(r['finals']):.2f} ± {statistics.stdev(r['finals']):.2f}"

    assert (f"SSFusion and SSFusion-OI {sd(short['ssfusion_oi'])} "
            f"({sd(before['ssfusion_oi'])} with one density), per_tensor "
            f"{sd(short['per_tensor'])} ({sd(before['per_tensor'])})") in section
    assert f"DDP's {sd(short['ddp'])}" in section
    # usage.md's bullet on the budget: per_tensor on ResNet-18, one density against the blend
    usage = " ".join((ROOT / "docs/usage.md").read_text().split())
    r18, even18 = _by_scheme("budget-blend/resnet18"), _by_scheme(WARMUP_R18)
    ddp18 = r18["ddp"]["finals"]
    assert (f"`per_tensor` went from {-_mean_gap_points(even18['per_tensor']['finals'], ddp18):.2f}"
            f" points below DDP to {_mean_gap_points(r18['per_tensor']['finals'], ddp18):.2f} "
            "above") in usage
    # the time to DDP's accuracy at 100 Mbit/s: the same machine and sources, DDP's finals
    # those of the 2026-12-05 run on the AMD machine
    tta = _by_scheme("convergence-cnn-960-100mbit-2026-12-07-blend")
    assert " --budget blend " in _results("convergence-cnn-960-100mbit-2026-12-07-blend")[
        "meta"]["command"] + " "
    assert tta["ddp"]["finals"] == _by_scheme("convergence-cnn-960-100mbit-2026-12-05")["ddp"][
        "finals"]
    order = ("topka", "ssfusion", "ssfusion_oi", "oktopk")
    first = tta["ddp"]["seconds_to_target"]
    near = [first / tta[s]["seconds_to_target"] for s in order]
    steps = [tta[s]["step_speedup"] for s in order]
    kept = sorted(100 * a / b for a, b in zip(near, steps))
    assert (f"TopkA is {near[0]:.2f}×, SSFusion {near[1]:.2f}×, SSFusion-OI {near[2]:.2f}× and "
            f"Ok-Topk {near[3]:.2f}× as fast as DDP, for steps {steps[0]:.2f}×, {steps[1]:.2f}×, "
            f"{steps[2]:.2f}× and {steps[3]:.2f}× as fast: {kept[0]:.0f}–{kept[-1]:.0f} % of the "
            f"step speed-up kept") in section
    oi = 100 * near[2] / steps[2]
    assert oi >= 85 and f"SSFusion-OI, the default, {oi:.0f} %)" in section
    full = [f"{tta[s]['time_speedup']:.2f}×" for s in order]
    assert f"To all of it: {full[0]}, {full[1]}, {full[2]} and {full[3]}, TopkA and Ok-Topk on 2 " \
           "seeds of 3" in section
    assert [tta[s]["reached_ddp"] for s in order] == [2, 3, 3, 2]
    assert f"DDP {_mean_sd(tta['ddp']['finals'])} %" in section
    # the even budget on the same machine, seeds and DDP runs: the blend paired with it
    even_here = _by_scheme("budget-blend/cnn-even")
    assert even_here["ddp"]["finals"] == ddp
    cells = {s: (_mean_sd(even_here[s]["finals"]), _interval_cell(even_here[s]["finals"], ddp),
                 _interval_cell(cnn[s]["finals"], even_here[s]["finals"]))
             for s in ("per_tensor", "ssfusion_oi")}
    assert (f"per_tensor {cells['per_tensor'][0]} % ({cells['per_tensor'][1]} vs DDP) and "
            f"SSFusion-OI {cells['ssfusion_oi'][0]} % ({cells['ssfusion_oi'][1]})") in section
    assert (f"the blend paired with it is {cells['per_tensor'][2]} points for per_tensor and "
            f"{cells['ssfusion_oi'][2]} for SSFusion-OI") in section
    mb = [f"{cnn[s]['bytes_per_step'] / 1e6:.4f}" for s in ("per_tensor", "ssfusion_oi")]
    assert f"at the same bytes ({mb[0]} and {mb[1]} MB a step)" in section
    assert all(abs(cnn[s]["bytes_per_step"] / even_here[s]["bytes_per_step"] - 1) < 1e-3
               for s in ("per_tensor", "ssfusion_oi"))
    # SSFusion-OI on ResNet-20 over 10 seeds, the default budget, this machine's DDP runs
    r20 = _by_scheme("budget-blend/resnet20-cosine-10-seeds")
    meta = json.loads((ROOT / "docs/results/budget-blend/resnet20-cosine-10-seeds.json").read_text(
    ))["meta"]
    assert "--budget" not in meta["command"] and "--lr-schedule cosine" in meta["command"]
    oi, base = r20["ssfusion_oi"]["finals"], r20["ddp"]["finals"]
    assert len(oi) == len(base) == 10
    assert (f"DDP {_mean_sd(base)} %, SSFusion-OI {_mean_sd(oi)} %, "
            f"**{_interval_cell(oi, base)}** points; seeds 1–5 alone "
            f"{_gap_cell(oi[:5], base[:5])} here") in section
    assert _mean_gap_points(oi, base) < -1.0  # the bar is missed
    avx2 = _by_scheme("budget-blend/resnet20-cosine")
    assert all(a != b for a, b in zip(avx2["ddp"]["finals"], base[:5]))
    lead = _by_scheme("resnet20-cosine/lead-follows-dgc-warmup-ssfusion-oi")
    assert (f"one density gave {_gap_cell(lead['ssfusion_oi']['finals'], lead['ddp']['finals'])} "
            "over 10 seeds") in section
