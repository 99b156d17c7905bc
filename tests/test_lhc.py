"""The ``lhc`` collective (collectives/lhc.py) on real gloo ranks, against a dense reference.

One ``run_distributed`` call per world size; the rank function loops over every case. Each
rank's input is regenerated in the parent from its seed and summed with plain torch.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import gradsync.collectives.lhc  # noqa: F401  (registers "lhc")
from gradsync import collectives
from gradsync.collectives.comm import Comm
from gradsync.collectives.lhc import all_or_index
from gradsync.formats.sketch import PeelError, index_wire_bytes, pack_index, unpack_index
from gradsync.sparsegrad import SparseGrad
from gradsync.testing import run_distributed

N = 40_000 + 123  # not a multiple of 1024
LIMIT = {2: 0.40, 4: 0.20, 10: 0.08}  # ≈ peeling thresholds (docs/papers.md, TAGC and LHC)


def make_input(case: dict, rank: int) -> torch.Tensor:
    """Rank's dense input: nonzeros shared by every rank plus rank-private ones."""
    n, P, target = case["n"], case["P"], case["union"]
    g = torch.Generator().manual_seed(case["seed"])
    shared = torch.rand(n, generator=g) < target / 2  # same on every rank
    g = torch.Generator().manual_seed(case["seed"] * 1000 + rank + 1)
    private = torch.rand(n, generator=g) < target / (2 * P)
    if case.get("integer", True):  # integer values: sums and peeling are exact in fp32
        v = torch.randint(1, 40, (n,), generator=g).float()
        v = v * (torch.randint(0, 2, (n,), generator=g).float() * 2 - 1)
    else:
        v = torch.randn(n, generator=g)
    return (v * (shared | private)).to(case["dtype"])


def cases_for(P: int) -> list[dict]:
    out = []
    seed = 1
    for ratio in (2, 4, 10):
        for bits, method in ((1, "auto"), (4, "auto")):
            seed += 1
            out.append(dict(kind="ok", n=N, P=P, union=0.3 * LIMIT[ratio], ratio=ratio,
                            bits=bits, method=method, dtype=torch.float32, seed=seed))
    for method in ("bor", "gather", "max", "count4"):
        seed += 1
        out.append(dict(kind="ok", n=N, P=P, union=0.05, ratio=4, bits=4 if method ==
                        "count4" else 1, method=method, dtype=torch.float32, seed=seed))
    for dt in (torch.bfloat16, torch.float16):
        seed += 1
        out.append(dict(kind="ok", n=N, P=P, union=0.02, ratio=10, bits=1, method="auto",
                        dtype=dt, seed=seed))
    out.append(dict(kind="ok", n=N, P=P, union=0.05, ratio=4, bits=1, method="auto",
                    dtype=torch.float32, seed=90, integer=False))
    out.append(dict(kind="ok", n=5, P=P, union=0.9, ratio=10, bits=1, method="auto",
                    dtype=torch.float32, seed=91))  # tiny tensor: identity layout
    out.append(dict(kind="lossy", n=N, P=P, union=0.5, ratio=10, bits=1, method="auto",
                    dtype=torch.float32, seed=92))
    out.append(dict(kind="raise", n=N, P=P, union=0.5, ratio=10, bits=1, method="auto",
                    dtype=torch.float32, seed=93))
    return out


def _rank_cases(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    torch.set_num_threads(1)
    results = []
    for case in cases:
        x = make_input(case, rank)
        sel = SparseGrad.from_dense(x)
        coll = collectives.get("lhc", ratio=case["ratio"], index_bits=case["bits"],
                               index_method=case["method"],
                               on_failure="raise" if case["kind"] == "raise" else "report")
        try:
            res = coll(sel)
        except PeelError as e:
            results.append({"raised": True, "unresolved": e.report.unresolved})
            continue
        results.append({"raised": False, "dense": res.dense, "kept": res.kept,
                        "info": res.info, "sent": res.stats.bytes_sent,
                        "recv": res.stats.bytes_recv,
                        "length": coll.sketch_for(case["n"], sel.device).length})
    # Index OR, every method, shared nonzeros; and what a SUM of packed bitmaps would give.
    n = 3001
    g = torch.Generator().manual_seed(7)
    shared = torch.rand(n, generator=g) < 0.3
    g = torch.Generator().manual_seed(100 + rank)
    mask = shared | (torch.rand(n, generator=g) < 0.1)
    comm = Comm()
    ors = {}
    for method in ("bor", "gather", "max", "count4", "auto"):
        for bits in (1, 4):
            ors[(method, bits)] = all_or_index(mask, comm, bits, method)
    summed = pack_index(mask, 1)
    if world_size > 1:
        dist.all_reduce(summed, op=dist.ReduceOp.SUM)  # TAGC's index sync: wrong
    return {"cases": results, "ors": ors, "summed_bitmap": summed}


def _ring(P: int, b: int) -> int:
    return 2 * (P - 1) * b // P  # Comm's all-reduce accounting


@pytest.mark.parametrize("P", [1, 2, 3])  # P = 8: test_collectives' shared run
def test_lhc_against_dense_reference(P):
    cases = cases_for(P)
    out = run_distributed(_rank_cases, P, cases, timeout=240)
    for ci, case in enumerate(cases):
        ranks = [o["cases"][ci] for o in out]
        xs = [make_input(case, r) for r in range(P)]
        if case["kind"] == "raise":
            assert all(r["raised"] for r in ranks), case
            assert len({r["unresolved"] for r in ranks}) == 1
            continue
        assert not any(r["raised"] for r in ranks)
        d0 = ranks[0]["dense"]
        for r in ranks:  # bitwise identical on every rank
            assert torch.equal(r["dense"], d0)
        for r, x in zip(ranks, xs):  # kept = every local nonzero
            assert torch.equal(r["kept"], torch.nonzero(x).view(-1))
        ref = torch.stack([x.float() for x in xs]).sum(0)
        union = torch.stack([x != 0 for x in xs]).any(0)
        info = ranks[0]["info"]
        assert info["union_nnz"] == int(union.sum())
        assert info["union_density"] == int(union.sum()) / case["n"]
        if case["kind"] == "lossy":
            assert info["lossy"] and info["unresolved"] > 0, info
            assert info["estimated"] == info["unresolved"]
            continue
        assert not info["lossy"], (case, info)
        assert d0.dtype == case["dtype"]
        if case.get("integer", True):
            assert torch.equal(d0, ref.to(case["dtype"])), case  # lossless: exact
        else:
            torch.testing.assert_close(d0, ref, rtol=1e-5, atol=1e-5)
        # Bytes on the wire (Comm accounting): shape check + index + sketch.
        nb = index_wire_bytes(case["n"], 1)
        method = info["index_method"]
        if P == 1:
            expect = 0
        else:
            idx = {"bor": _ring(P, nb), "gather": (P - 1) * nb,
                   "max": _ring(P, case["n"]),
                   "count4": _ring(P, index_wire_bytes(case["n"], 4))}[method]
            expect = _ring(P, 32) + idx + _ring(P, 4 * ranks[0]["length"])
        assert [r["sent"] for r in ranks] == [expect] * P, (case, method)
        if case["method"] == "auto" and P > 1:
            assert method == ("count4" if case["bits"] == 4 else "bor")  # gloo
    # Index OR: every method equals the OR computed here, on every rank.
    n = 3001
    g = torch.Generator().manual_seed(7)
    shared = torch.rand(n, generator=g) < 0.3
    masks = []
    for r in range(P):
        g = torch.Generator().manual_seed(100 + r)
        masks.append(shared | (torch.rand(n, generator=g) < 0.1))
    true_or = torch.stack(masks).any(0)
    for o in out:
        for (method, bits), (got, used) in o["ors"].items():
            assert torch.equal(got, true_or), (method, bits, used)
            if method != "auto":
                assert used == method
    if P > 1:  # shared nonzeros exist, so TAGC's SUM of packed bitmaps is wrong
        try:
            wrong = unpack_index(out[0]["summed_bitmap"], n, 1)
        except ValueError:
            wrong = None
        assert wrong is None or not torch.equal(wrong, true_or)


def test_lhc_options_validated():
    for bad in [dict(ratio=0), dict(ratio=2.0), dict(index_bits=2), dict(on_failure="x"),
                dict(index_method="sum")]:
        with pytest.raises(ValueError):
            collectives.get("lhc", **bad)
    with pytest.raises(ValueError):
        all_or_index(torch.ones(4, dtype=torch.bool), Comm(), 1, "sum")
