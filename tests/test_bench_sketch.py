"""Smoke test of ``python -m gradsync bench sketch`` with tiny arguments."""

from __future__ import annotations

import json

import torch

from gradsync.apps.cli import main


def test_bench_sketch_smoke(tmp_path):
    out = tmp_path / "sketch"
    rc = main(["bench", "sketch", "--quick", "--n", "6000", "--world-size", "2", "--trials", "1",
               "--out", str(out)])
    assert rc == 0
    data = json.loads((out / "sketch.json").read_text())
    assert (out / "sketch.png").stat().st_size > 0
    rows = data["rows"]
    wire = [r for r in rows if r["table"] == "wire"]
    assert {(r["ratio"], r["index_bits"]) for r in wire} == {(2, 1), (2, 4), (4, 1), (4, 4),
                                                             (10, 1), (10, 4)}
    for r in wire:
        # Fewer bits than the dense fp32 all-reduce measured in the same run (32 bits/param at
        # P = 2); TAGC's accounting is index bits + 32/ratio.
        assert 0 < r["lhc_bits_per_param_sent"] < r["dense_bits_per_param_sent"]
        assert abs(r["tagc_accounting_bits"] - (r["index_bits"] + 32 / r["ratio"])) < 1e-9
    peel = [r for r in rows if r["table"] == "peel"]
    assert {r["ratio"] for r in peel} == {2, 4, 10}
    assert all(0.0 <= r["success_rate"] <= 1.0 for r in peel)
    assert {r["ratio"] for r in rows if r["table"] == "throughput"} == {2, 4, 10}


def test_sparse_input_is_seeded_and_masked():
    from gradsync.apps.bench.sketch import sparse_input

    x, mask = sparse_input(20_000, 0.1, 5)
    assert torch.equal(x != 0, mask)  # non-zero exactly where the mask says
    assert 1800 < int(mask.sum()) < 2200  # about density · n
    y, _ = sparse_input(20_000, 0.1, 5)
    assert torch.equal(x, y) and not torch.equal(x, sparse_input(20_000, 0.1, 6)[0])
