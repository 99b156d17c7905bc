"""Smoke test of ``python -m gradsync bench fsdp`` with tiny settings."""

from __future__ import annotations

import json

import pytest

from gradsync.apps.bench import fsdp


def test_bench_fsdp_quick(tmp_path):
    assert fsdp.main(["--world-size", "2", "--quick", "--steps", "2",
                      "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "fsdp.json").read_text())
    rows = {r["variant"]: r for r in doc["rows"]}
    assert set(rows) == {"FSDP", "TAGC all", "TAGC non-attn"}
    assert (tmp_path / "fsdp.png").stat().st_size > 0
    fsdp_b = rows["FSDP"]["sent_B/step"]
    # plain FSDP2 sends its fp32 shards in a ring: (P − 1) · S · 4 bytes, S > 0
    assert fsdp_b > 0 and fsdp_b % 4 == 0
    # 10x sketch + 1-bit index send less than plain FSDP2; compressing fewer layers sends more
    assert 0 < rows["TAGC all"]["sent_B/step"] < rows["TAGC non-attn"]["sent_B/step"] < fsdp_b
    assert rows["FSDP"]["comp_params"] == 0
    assert 0 < rows["TAGC non-attn"]["comp_params"] < rows["TAGC all"]["comp_params"]
    for r in rows.values():
        assert r["iter_s"] > 0 and r["lossy"] >= 0


def test_bench_fsdp_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError):
        fsdp.main(["--world-size", "1", "--quick", "--out", str(tmp_path)])
    with pytest.raises(ValueError):
        fsdp.main(["--ratio", "3", "--quick", "--out", str(tmp_path)])
    with pytest.raises(ValueError):
        fsdp.main(["--bandwidth", "fast", "--quick", "--out", str(tmp_path)])
