"""Smoke test of ``python -m gradsync bench collectives``: tiny run on loopback, JSON rows."""

from __future__ import annotations

import json

import pytest

from gradsync import collectives
from gradsync.apps.bench import collectives as bench


def test_bench_collectives_smoke(tmp_path, capsys):
    numel, p, densities = 3000, 2, (0.02, 0.1)
    rc = bench.main(["--world-size", str(p), "--numel", str(numel), "--density",
                     ",".join(map(str, densities)), "--repeats", "2", "--quick",
                     "--out", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "collectives.json").read_text())
    assert (tmp_path / "collectives.png").stat().st_size > 0
    assert data["meta"]["shaped"] is False and data["meta"]["link"] == "loopback"
    rows = {(r["collective"], r["density"]): r for r in data["rows"]}
    bench.import_collectives()
    names = collectives.names()
    assert {"dense", "topka"} <= set(names)
    assert set(rows) == {(n, d) for n in names for d in densities}  # every collective ran
    for d in densities:
        k = max(1, round(d * numel))
        bound = 2 * k * (p - 1) / p * (4 + 4)  # Thm 3.1: int32 index + fp32 value per entry
        dense, topka = rows[("dense", d)], rows[("topka", d)]
        for r in (dense, topka):
            assert "error" not in r, r
            assert r["k"] == k and r["lower_bound_bytes"] == pytest.approx(bound)
            assert len(r["times_s"]) == 2 and r["time_s"] > 0
            assert r["rel_err"] < 1e-5  # exact: matches the plain-torch sum of selections
        # ring all-reduce of n fp32 values sends 2(P-1)/P · 4n bytes, plus the same ring for
        # the shape consensus of four int64 words (Collective._agree)
        assert dense["bytes_sent_mean"] == 2 * (p - 1) / p * (4 * numel + 4 * 8)
        assert dense["sent_over_bound_mean"] == pytest.approx(dense["bytes_sent_mean"] / bound)
        # TopkA with P = 2 sends its k entries once: exactly the bound plus a few header words
        assert bound <= topka["bytes_sent_mean"] <= bound + 64
        assert topka["bytes_sent_max"] >= topka["bytes_sent_mean"]
        assert dense["time_over_dense"] == pytest.approx(1.0)
        assert dense["time_over_dense_interleaved"] == pytest.approx(1.0)
        # the dense all-reduce timed after every TopkA call, in the same rank processes
        assert len(topka["dense_interleaved_times_s"]) == 2
        ratios = [t / d for t, d in zip(topka["times_s"], topka["dense_interleaved_times_s"])]
        assert topka["time_over_dense_interleaved"] == pytest.approx(sum(ratios) / 2)
        # and its process CPU: the busiest rank's per repetition, over the dense call's after it
        assert len(topka["cpus_s"]) == len(topka["dense_interleaved_cpus_s"]) == 2
        assert topka["cpu_s"] > 0 and min(topka["dense_interleaved_cpus_s"]) > 0
        cpu_ratios = [c / d for c, d in zip(topka["cpus_s"], topka["dense_interleaved_cpus_s"])]
        assert topka["cpu_over_dense_interleaved"] == pytest.approx(sum(cpu_ratios) / 2)
        assert dense["cpu_over_dense_interleaved"] == pytest.approx(1.0)
    for r in data["rows"]:
        assert "error" in r or r["bytes_sent_mean"] > 0
    out = capsys.readouterr().out
    assert "topka" in out and "cpu × dense" in out


@pytest.mark.parametrize("argv", [["--density", "0"], ["--density", "x"], ["--numel", "1.5"],
                                  ["--threads", "0"],
                                  ["--bandwidth", "10mbps"], ["--latency", "5ms"]])
def test_bench_collectives_rejects_bad_arguments(argv, tmp_path):
    with pytest.raises(SystemExit) as e:
        bench.main([*argv, "--out", str(tmp_path)])
    assert e.value.code == 2
