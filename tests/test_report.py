"""``python -m gradsync report``: every table on tiny inputs produces rows and JSON, and the
numbers that can be worked out by hand (or are published) come out right."""

from __future__ import annotations

import json

import pytest
import torch

from gradsync.apps import cli, report


def _run(tmp_path, table: str) -> list[dict]:
    assert report.main([table, "--quick", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / f"report_{table.replace('-', '_')}.json").read_text())
    assert doc["meta"]["table"] == table and doc["rows"]
    return doc["rows"]


def test_census_matches_table_ii_counts(tmp_path, capsys):
    rows = {r["model"]: r for r in _run(tmp_path, "census")}
    assert "SSFusion Table II" in capsys.readouterr().out
    # ResNet-152: 155 convolutions/fc weights + 155 × 2 batch-norm + fc bias = 467 tensors.
    assert rows["ResNet-152"]["tensors"] == 467
    # GPT2-large: 36 blocks × 12 + wte + wpe + ln_f (2) = 436 (the LM head is tied to wte).
    assert rows["GPT2-large"]["tensors"] == 436
    for r in rows.values():  # the published number split is reproduced exactly
        assert r["small_number_pct"] == pytest.approx(r["paper_small_number_pct"], abs=0.01)
        assert r["small_size_pct"] == pytest.approx(r["paper_small_size_pct"], abs=0.1)


def test_census_of_the_published_vision_models():
    # Census rows as printed while models.reference() still came from torchvision 0.28.0
    # (`report census`): (tensors, small tensors, elements). Our own definitions must agree.
    from gradsync.apps import models

    before = {"resnet152": (467, 338, 60_192_808), "vit_large": (296, 197, 304_326_632)}
    for name, (tensors, small, elements) in before.items():
        c = report.census_of(models.reference(name, device="meta"))
        assert (c["tensors"], c["small_tensors"], c["elements"]) == (tensors, small, elements)


def test_census_of_by_hand():
    net = torch.nn.Sequential(torch.nn.Linear(400, 300), torch.nn.Linear(10, 10))
    c = report.census_of(net)  # tensors: 120000 (large), 300, 100, 10 (small)
    assert c["tensors"] == 4 and c["small_tensors"] == 3
    assert c["small_number_pct"] == pytest.approx(75.0)
    assert c["small_size_pct"] == pytest.approx(100 * 410 / 120_410)


def test_missing_rates_by_hand():
    g = torch.Generator().manual_seed(0)
    grads = {"a": torch.full((1000,), 1e-6), "b": torch.randn(1000, generator=g)}
    r = report.missing_rates(grads, density=0.01, degrees=(0.5, 1.0))
    assert r["per_tensor"] == 0.0  # every tensor keeps k >= 1 of its own
    assert r[0.5] == 0.0  # only "b" (first in backward order) is fused
    assert r[1.0] == 0.5  # both fused: the top 1 % all lie in "b"; "a" is missing


def test_missing_quick(tmp_path):
    rows = _run(tmp_path, "missing")
    ours = [r for r in rows if not r["model"].startswith("paper")]
    assert ours and ours[0]["per_tensor_pct"] == 0.0
    assert all(0 <= ours[0][f"degree_{d}_pct"] <= 100 for d in (20, 40, 60, 80, 100))
    assert {r["model"] for r in rows} >= {"paper ResNet-152", "paper BERT-large"}


def test_oktopk_volume_quick(tmp_path):
    rows = _run(tmp_path, "oktopk-volume")
    by = {(r["collective"], r["P"]): r for r in rows}
    assert {P for _, P in by} == {2, 4}
    for P in (2, 4):
        n, k = by["dense", P]["n"], by["dense", P]["k"]
        assert by["dense", P]["words_sent_max_rank"] == 2 * n * (P - 1) / P  # ring all-reduce
        topka = by["topka", P]["words_sent_max_rank"]
        assert 2 * k * (P - 1) <= topka <= 2 * k * (P - 1) + 4 * P  # + the counts
        ok = by["oktopk", P]
        assert 2 * k * (P - 1) / P <= ok["words_sent_max_rank"]  # Theorem 3.1
        assert all(r["within_table1"] for r in by.values()), by


def test_densestream_quick(tmp_path):
    rows = _run(tmp_path, "densestream")
    ours = [r for r in rows if "ratio_whole_model" in r]
    assert [r["density"] for r in ours] == [0.01, 0.05, 0.10]
    assert all(0.5 < r["ratio_whole_model"] < 1.5 for r in ours)
    assert any(r["model"] == "paper VGG16" for r in rows)


def test_tagc_quick_via_cli(tmp_path):
    assert cli.main(["report", "tagc", "--quick", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "report_tagc.json").read_text())["rows"]
    theta = {r["ratio"]: r["ours_theta_pct"] for r in rows}
    assert set(theta) == {2, 4, 10}
    assert theta[2] < theta[4] < theta[10]  # more compression needs sparser data
    assert [r["paper_theta_pct"] for r in rows] == [80.0, 90.0, 98.75]


def test_bad_arguments_exit():
    with pytest.raises(SystemExit):
        report.main(["nonsense"])
    with pytest.raises(SystemExit):
        report.main([])
