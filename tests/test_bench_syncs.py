"""``python -m gradsync bench syncs``: host reads per step at P real gloo ranks, counted on
every rank, and the page and JSON it writes."""

from __future__ import annotations

import json

import pytest

from gradsync.apps.bench import syncs


def test_bench_syncs_counts_every_rank_at_every_world_size(tmp_path):
    """Ok-Topk at P = 1 meets issue 42's sync bar (2 + its one buffer); at P = 2 each rank
    reads at most 2 more: the regions' offsets with the peers' sizes and the merge's union
    (the accelerators' kernels: the merge sorts on the device and compacts at known counts,
    where the CPU's own kernels read twice more through numpy).
    TopkA reads as often at P = 2 as at P = 1 on rank 0 (rank 1 once more every other step):
    the collective's shape check is agreed once, not every step, and the engine's agreement
    on the finiteness flag travels before the step's one read of its checks; DGC's selection
    of the buffer carries its capacity k, so no count is exchanged. Before the offsets
    travelled with the sizes, the owners counted each rank's kept entries, the shape check
    was made once and the agreement read on its own, the same run read 5 at P = 1 and 14 / 15
    at P = 2 (Ok-Topk), 5 / 5.5 at P = 2 (TopkA); before the capacity, 3 and 3 / 3.5 (TopkA).
    torch DDP reads nothing."""
    rc = syncs.main(["--ranks", "1,2", "--model", "mlp8", "--mlp-params", "65536",
                     "--schemes", "oktopk,topka", "--out", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "syncs-cpu.json").read_text())
    rows = {(r["ranks"], r["scheme"]): r for r in data["rows"]}
    assert set(rows) == {(p, s) for p in (1, 2) for s in ("ddp", "oktopk", "topka")}
    for (p, s), r in rows.items():
        assert len(r["reads_per_rank"]) == p
        assert r["reads_max"] == max(r["reads_per_rank"])
        if s == "ddp":
            assert r["reads_per_rank"] == [0] * p and r["buffers"] is None
        else:
            assert r["buffers"] == 1 and r["p1_bar"] == 3
    assert rows[1, "oktopk"]["reads_per_rank"] == [3]
    assert rows[1, "oktopk"]["read_ops_rank0"] == {"Tensor.tolist": 3}
    assert rows[1, "topka"]["reads_per_rank"] == [2]
    assert rows[1, "topka"]["read_ops_rank0"] == {"Tensor.tolist": 1, "aten::nonzero": 1}
    assert all(3 < n <= 3 + 2 for n in rows[2, "oktopk"]["reads_per_rank"])
    assert "Tensor.numpy" not in rows[2, "oktopk"]["read_ops_rank0"]
    assert rows[2, "topka"]["reads_per_rank"][0] == 2
    assert all(n < 3 for n in rows[2, "topka"]["reads_per_rank"])
    assert data["meta"]["ranks"] == [1, 2] and data["meta"]["model"] == "mlp8"
    page = (tmp_path / "syncs-cpu.md").read_text()
    assert "python -m gradsync bench syncs --ranks 1,2" in page
    assert "| 2 | oktopk | 1 |" in page


@pytest.mark.parametrize("args, match", [
    (["--ranks", "0"], "world sizes"), (["--ranks", "two"], "integers"),
    (["--count-steps", "0"], "count-steps"), (["--schemes", "nope"], "unknown"),
    (["--model", "vgg"], "vgg"),
])
def test_bench_syncs_rejects_bad_arguments(args, match, capsys):
    with pytest.raises(SystemExit):
        syncs.main(args)
    assert match in capsys.readouterr().err
