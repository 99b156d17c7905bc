"""``python -m gradsync demo`` (``make demo``): its table reports test accuracy on the whole
test split (README: "test accuracy on the whole 10,000-image test split")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gradsync.apps import demo
from gradsync.apps.data import FASHION_MNIST_DIR


@pytest.mark.skipif(not (Path(FASHION_MNIST_DIR) / "t10k-images-idx3-ubyte.gz").exists(),
                    reason="needs the real Fashion-MNIST (make install puts it in as root)")
def test_demo_evaluates_the_whole_test_split(tmp_path: Path, capsys) -> None:
    rc = demo.main(["--steps", "8", "--world-size", "2", "--schemes", "ddp,topka",
                    "--bandwidth", "loopback", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "test accuracy: 10000 images of the fashion-mnist test split" in out
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    runs = metrics["runs"]
    assert [r["summary"]["scheme"] for r in runs] == ["ddp", "topka"]
    assert all(r["summary"]["test_samples"] == 10_000 for r in runs)
    assert all(0.0 <= r["summary"]["test_accuracy"] <= 1.0 for r in runs)
    # the time to DDP's final accuracy, read from the evaluation curve (4 points of the run)
    ddp, topka = (r["summary"] for r in runs)
    assert [p["step"] for p in runs[0]["history"]] == [2, 4, 6, 8]
    assert ddp["time_speedup_vs_ddp"] == pytest.approx(1.0)
    assert 0 < ddp["s_to_ddp"] <= runs[0]["history"][-1]["elapsed_s"]
    assert "speed-up vs ddp (time)" in out
    reached = topka["s_to_ddp"] is not None
    assert reached == (max(p["test_accuracy"] for p in runs[1]["history"])
                       >= ddp["test_accuracy"])
    assert ("not reached" in out) == (not reached)
    # the MB column is what the run sent, every step counted (DGC's warm-up included), not the
    # steady state after the first warmup_steps + 1 steps that the samples/s column reads
    every, after = (f" {topka[k] / 1e6:.4g} " for k in ("run_bytes_per_step", "bytes_per_step"))
    assert every != after and every in out and after not in out
    assert "MB sent/step/rank: the mean over every step, DGC's denser first steps included" in out
