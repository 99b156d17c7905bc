"""Smoke test of ``python -m gradsync bench soak --quick`` (the full soak is a command)."""

from __future__ import annotations

import json

import pytest

from gradsync.apps.bench import soak


def test_bench_soak_quick(tmp_path):
    rc = soak.main(["--quick", "--schemes", "topka", "--out", str(tmp_path)])
    doc = json.loads((tmp_path / "soak.json").read_text())
    assert (tmp_path / "soak.png").stat().st_size > 0
    (row,) = doc["rows"]
    steps, nan_every, P = 40, 9, 2  # what --quick sets
    assert row["scheme"] == "topka" and row["steps"] == steps and row["P"] == P
    # one NaN step every 9: steps 8, 17, 26, 35; every rank skips each of them
    assert row["nan_injected"] == len([s for s in range(steps) if s % nan_every == 8]) == 4
    assert row["skipped"] == row["nan_injected"]
    assert row["divergence"] == 0 and row["digest_mism"] == 0
    assert row["stalls"] >= 1
    assert row["loss_last"] == row["loss_last"]  # finite, not NaN
    samples = doc["meta"]["rss_samples"]["topka"]
    assert len(samples) == P and all(len(s) >= steps // 5 for s in samples)
    assert all(rss > 0 for s in samples for _, rss in s)
    assert len(row["per_rank_growth_MiB"]) == P
    assert row["growth_MiB"] == pytest.approx(max(row["per_rank_growth_MiB"]))
    # the exit status is the verdict: bound, divergence, skipped == injected
    assert row["pass"] == (row["growth_MiB"] <= row["bound_MiB"])
    assert rc == (0 if row["pass"] else 1)


def test_growth_baseline_is_first_sample_after_warmup():
    samples = [(0, 100), (5, 150), (10, 160), (15, 170), (19, 175)]
    assert soak._growth(samples, 10) == (10, 160, 175)
    assert soak._growth(samples, 0) == (0, 100, 175)


def test_bench_soak_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="scheme"):
        soak.main(["--quick", "--schemes", "nope", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="world-size"):
        soak.main(["--quick", "--world-size", "1", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="warmup"):
        soak.main(["--steps", "10", "--warmup", "20", "--out", str(tmp_path)])
