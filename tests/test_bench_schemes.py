"""Smoke test of ``python -m gradsync bench schemes``: tiny run on 2 loopback ranks, JSON rows."""

from __future__ import annotations

import json
import math

import pytest

from gradsync.apps import models
from gradsync.apps.bench import schemes as bench


def test_bench_schemes_smoke(tmp_path, capsys):
    P, steps = 2, 3
    names = ["ddp", "ddp_powersgd", "topka", "ssfusion_oi"]
    rc = bench.main(["--quick", "--steps", str(steps), "--schemes", ",".join(names),
                     "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert all(n in out for n in names) and "exposed ms" in out
    data = json.loads((tmp_path / "schemes.json").read_text())
    assert (tmp_path / "schemes.png").stat().st_size > 1000
    rows = {r["scheme"]: r for r in data["rows"]}
    assert list(rows) == names
    assert data["meta"]["link"]["link"] == "loopback" and data["meta"]["quick"] is True
    n = sum(p.numel() for p in models.build("cnn").parameters())
    # torch's DDP all-reduce: every fp32 gradient in the ring, 2(P-1)/P·4n bytes per rank
    assert rows["ddp"]["bytes_per_step"] == 2 * (P - 1) / P * 4 * n
    assert rows["ddp"]["speedup_vs_ddp"] == 1.0
    for name in names[1:]:  # compressed: PowerSGD rank 1 and the 1% sparse schemes
        assert 0 < rows[name]["bytes_per_step"] < rows["ddp"]["bytes_per_step"] / 10, name
    for r in rows.values():
        assert r["measured_steps"] == steps - 2  # --quick: warm-up 1, so steps 0-1 excluded
        assert r["samples_per_s"] > 0 and r["step_ms"] > 0 and r["backward_ms"] >= 0
        assert r["comm_ms"] >= 0 and r["exposed_ms"] >= 0 and 0 <= r["missing_rate"] <= 1
        assert math.isfinite(r["final_loss"])
        assert r["samples_per_s"] == pytest.approx(P * 8 / (r["step_ms"] / 1e3))
    assert [run["scheme"] for run in data["meta"]["runs"]] == names


@pytest.mark.parametrize("argv", [["--density", "0"], ["--world-size", "0"],
                                  ["--bandwidth", "10mbps"], ["--schemes", "nope"]])
def test_bench_schemes_rejects_bad_arguments(argv, tmp_path):
    with pytest.raises(SystemExit) as e:
        bench.main([*argv, "--quick", "--out", str(tmp_path)])
    assert e.value.code == 2
