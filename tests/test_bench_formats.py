"""Smoke test of ``python -m gradsync bench formats``: runs tiny, writes JSON and PNG."""

from __future__ import annotations

import json

import pytest

from gradsync.apps.cli import main as cli_main


def test_bench_formats_quick(tmp_path, capsys):
    # needs real Fashion-MNIST (make install provides it): DatasetUnavailable fails the test
    rc = cli_main(["bench", "formats", "--quick", "--densities", "0.01,0.1",
                   "--out", str(tmp_path)])
    assert rc == 0
    doc = json.loads((tmp_path / "formats.json").read_text())
    assert (tmp_path / "formats.png").stat().st_size > 0
    rows = doc["rows"]
    assert doc["meta"]["densities"] == [0.01, 0.1]
    flat = {r["density"]: r for r in rows if r["kind"] == "model_flat"}
    assert sorted(flat) == [0.01, 0.1]
    for d, r in flat.items():
        assert r["nnz"] == max(1, round(d * r["numel"]))  # exact top-k at that density
        # Sizes obey the format's bounds: ≥ one pair + values, ≤ COO plus one length each.
        assert 8 + 4 * r["nnz"] <= r["ds_payload"] <= 12 * r["nnz"]
        assert r["coo_payload"] == 8 * r["nnz"]
        assert r["ratio"] == pytest.approx(r["ds_payload"] / r["coo_payload"])
    # The sum row adds up the per-tensor rows.
    for d in (0.01, 0.1):
        per = [r for r in rows if r["kind"] == "tensor" and r["density"] == d]
        tot = next(r for r in rows if r["kind"] == "model_sum" and r["density"] == d)
        assert tot["ds_payload"] == sum(r["ds_payload"] for r in per)
        assert tot["coo_payload"] == sum(r["coo_payload"] for r in per)
    tp = [r for r in rows if r["kind"] == "throughput"]
    assert len(tp) == 2 and all(r["densestream_decode_MBps"] > 0 for r in tp)
    paper = [r for r in rows if r["kind"] == "paper"]
    assert {(r["tensor"], r["density"], r["epoch1"]) for r in paper} >= {
        ("paper VGG16", 0.01, 1.11), ("paper ResNet50", 0.1, 0.82)}
    out = capsys.readouterr().out
    assert "paper VGG16" in out and "DenseStream / COO" in out


def test_payload_sizes_are_the_encoded_lengths():
    """``payload_sizes`` (which ``report densestream`` also uses) against the real encoders."""
    import torch

    from gradsync.apps.bench.formats import payload_sizes, top_k
    from gradsync.formats import coo
    from gradsync.formats import densestream as ds

    x = torch.randn(5000, generator=torch.Generator().manual_seed(3))
    x[1000:1400] *= 50  # a run of large entries: DenseStream blocks longer than 1
    sel = top_k(x, 0.05)
    assert len(sel) == 250
    assert set(sel.indices.tolist()) == set(x.abs().topk(250).indices.tolist())
    for iw in (4, 8):
        s = payload_sizes(sel, iw)
        assert s["coo_bytes"] == coo.encode(sel, index_bytes=iw).numel()
        assert s["ds_bytes"] == ds.encode(sel, index_bytes=iw).numel()
        assert s["ratio"] == (s["ds_bytes"] - ds.HEADER_BYTES) / (s["coo_bytes"]
                                                                  - coo.HEADER_BYTES)
        assert s["blocks"] < s["nnz"] == 250 and s["mean_block_len"] > 1
