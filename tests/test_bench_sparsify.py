"""Smoke test: ``python -m gradsync bench sparsify`` with tiny sizes writes a complete JSON."""

from __future__ import annotations

import json

import pytest
import torch

from gradsync import sparsify
from gradsync.apps import cli
from gradsync.apps.bench.sparsify import heavy_tailed


def test_bench_sparsify_quick(tmp_path, capsys):
    out = tmp_path / "b"
    rc = cli.main(["bench", "sparsify", "--sizes", "500,3000", "--density", "0.02",
                   "--repeats", "2", "--out", str(out)])
    assert rc == 0
    data = json.loads((out / "sparsify.json").read_text())
    assert (out / "sparsify.png").stat().st_size > 0
    rows = data["rows"]
    names = sparsify.names()
    assert {(r["sparsifier"], r["n"]) for r in rows} == {(s, n) for s in names
                                                         for n in (500, 3000)}
    for r in rows:
        assert r["k"] == max(1, round(0.02 * r["n"]))
        assert 0 <= r["count"] <= r["n"]
        assert r["deviation"] == pytest.approx((r["count"] - r["k"]) / r["k"])
        assert r["median_s"] > 0 and r["pass_s"] > 0
        assert r["x_pass"] == pytest.approx(r["median_s"] / r["pass_s"])
        if r["sparsifier"] in ("topk", "randomk"):
            assert r["count"] == r["k"]
    assert "sparsify" in capsys.readouterr().out


def test_bench_sparsify_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError):
        cli.main(["bench", "sparsify", "--sizes", "0", "--out", str(tmp_path)])
    with pytest.raises(ValueError):
        cli.main(["bench", "sparsify", "--sparsifiers", "nope", "--quick",
                  "--out", str(tmp_path)])


def test_heavy_tailed_is_seeded_and_heavy():
    a, b = heavy_tailed(50_000, seed=4), heavy_tailed(50_000, seed=4)
    assert torch.equal(a, b)
    m = a.abs()
    # heavy tail: the max is far above the mean, unlike a Gaussian (≈ 4.5σ at this size)
    assert float(m.max()) > 50 * float(m.mean())
    assert float((a > 0).float().mean()) == pytest.approx(0.475, abs=0.02)  # signs, 5% zeros
