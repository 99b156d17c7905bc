"""``python -m gradsync bench rounds``: a small run end to end, and the latency it derives."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gradsync.apps.bench import rounds


def test_bench_rounds_small_run(tmp_path):
    assert rounds.main(["--world-size", "2", "--calls", "30", "--work-ms", "0,0.2",
                        "--bytes", "8", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "rounds-cpu.json").read_text())
    rows = doc["rows"]
    assert [(r["work_ms"], r["op"]) for r in rows] == [
        (w, op) for w in (0.0, 0.2) for op in rounds.DEFAULT_OPS]
    for r in rows:
        assert r["P"] == 2 and r["bytes"] == 8 and r["calls"] == 2 * 30
        # a call returns after the last start it needs, up to the clock's reading order
        assert r["p50_ms"] > -0.05 and r["p50_ms"] <= r["p90_ms"] <= r["p99_ms"]
        assert np.isfinite(r["mean_ms"])
    assert all(r["x_socket"] == pytest.approx(1.0) for r in rows if r["op"] == "socket")
    page = (tmp_path / "rounds-cpu.md").read_text()
    assert page.count("\n| 2 | ") == len(rows)
    assert "with 0.2 ms of work before each call" in page and "in lock-step" in page
    assert (tmp_path / "rounds-cpu.png").stat().st_size > 0


def test_bench_rounds_times_the_all_gathers_rounds_past_the_sockets_limit(tmp_path):
    """The ring and the doubling of gradsync's all-gather, at a payload the socket could not
    take (2 MiB per rank); a finding line compares them per payload."""
    big = 2 << 20
    assert rounds.main(["--world-size", "4", "--calls", "4", "--work-ms", "0",
                        "--bytes", f"8,{big}", "--ops", "gather_ring,gather_doubling",
                        "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "rounds-cpu.json").read_text())["rows"]
    assert [(r["bytes"], r["op"]) for r in rows] == [
        (b, op) for b in (8, big) for op in ("gather_ring", "gather_doubling")]
    assert all(r["calls"] == 4 * 4 and r["x_socket"] is None and r["p50_ms"] > 0 for r in rows)
    page = (tmp_path / "rounds-cpu.md").read_text()
    for b in (8, big):
        assert f"P = 4, in lock-step, {b} bytes per rank: the all-gather in P − 1 rounds" in page



@pytest.mark.parametrize("name", ["exchange", "all_reduce"])
def test_latency_counts_from_the_last_start_a_call_needs(name):
    # three ranks, two calls: rank r's exchange needs rank r − 1's message (rank 0: rank 2's),
    # a collective every rank's
    starts = [[0.0, 10.0], [1.0, 10.0], [3.0, 14.0]]
    ends = [[5.0, 15.0], [5.0, 16.0], [6.0, 17.0]]
    per_rank = [{"cases": {f"0.0/8/{name}": (s, e)}} for s, e in zip(starts, ends)]
    cfg = {"work_ms": [0.0], "bytes": [8], "ops": [name], "calls": 2}
    (row,) = rounds._summary(per_rank, 3, cfg)
    if name == "exchange":
        ready = [[3.0, 14.0], [1.0, 10.0], [3.0, 14.0]]  # max(own, previous rank's)
    else:
        ready = [[3.0, 14.0]] * 3
    lat = [1e3 * (e - r) for er, rr in zip(ends, ready) for e, r in zip(er, rr)]
    assert row["mean_ms"] == pytest.approx(sum(lat) / len(lat))
    assert row["p50_ms"] == pytest.approx(float(np.median(lat)))
    slowest = [max(1e3 * (ends[r][c] - ready[r][c]) for r in range(3)) for c in range(2)]
    assert row["slowest_mean_ms"] == pytest.approx(sum(slowest) / 2)
    assert row["slowest_p50_ms"] == pytest.approx(float(np.median(slowest)))
    assert row["x_socket"] is None  # no socket row to compare with


@pytest.mark.parametrize("argv", [["--world-size", "1"], ["--work-ms", "-1"],
                                  ["--bytes", "0"], ["--ops", "all_gather,nope"],
                                  ["--calls", "0"], ["--bytes", "x"],
                                  ["--bytes", str(2 << 20)]])  # the socket's limit: 1 MiB
def test_bench_rounds_rejects_bad_arguments(argv, tmp_path):
    with pytest.raises(SystemExit):
        rounds.main([*argv, "--out", str(tmp_path)])
