"""DenseStream allreduce (DSA) on real gloo ranks: exact SUM, bitwise equal on every rank.

One ``run_distributed`` call per world size runs every case. Each rank regenerates its input
from the case's seed; the parent regenerates all ranks' inputs the same way and sums them
with plain torch (in float64) as the independent reference.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import gradsync.collectives.densestream  # noqa: F401  (registers "densestream")
from gradsync.collectives import get
from gradsync.collectives.densestream import DenseStreamAllreduce
from gradsync.sparsegrad import SparseGrad
from gradsync.testing import run_distributed

KINDS = ["overlap", "disjoint", "clustered", "empty_some", "empty_all", "dense", "runs"]


def make_sel(case: dict, rank: int, world_size: int) -> SparseGrad:
    """Rank ``rank``'s selection for ``case`` (deterministic in the case's seed)."""
    n, kind, dtype = case["numel"], case["kind"], case["dtype"]
    g = torch.Generator().manual_seed(case["seed"] * 1000 + rank)
    shared = torch.Generator().manual_seed(case["seed"])
    if kind == "overlap":      # a shared part plus a private part: partial overlap
        common = torch.randperm(n, generator=shared)[: n // 20]
        own = torch.randperm(n, generator=g)[: n // 10]
        idx = torch.unique(torch.cat([common, own]))
    elif kind == "disjoint":
        idx = torch.arange(rank, n, world_size)
        idx = idx[torch.rand(idx.numel(), generator=g) < 0.3]
    elif kind == "clustered":  # everything in one narrow window: one region gets it all
        lo = (3 * n) // 4
        idx = torch.unique(lo + torch.randint(0, 40, (25,), generator=g))
    elif kind == "empty_some":
        idx = (torch.empty(0, dtype=torch.int64) if rank % 2 == 0
               else torch.randperm(n, generator=g)[: n // 8])
    elif kind == "empty_all":
        idx = torch.empty(0, dtype=torch.int64)
    elif kind == "dense":
        idx = torch.arange(n)
    elif kind == "runs":       # short runs with small gaps: multi-element DenseStream blocks
        starts = torch.randperm(n - 6, generator=g)[: n // 30]
        idx = torch.unique((starts[:, None] + torch.arange(5)[None, :]).reshape(-1))
        idx = idx[torch.rand(idx.numel(), generator=g) < 0.7]
    else:
        raise AssertionError(kind)
    idx = torch.sort(idx.to(torch.int64)).values
    if case["values"] == "int":  # small integers: every summation order is exact
        vals = torch.randint(-8, 9, (idx.numel(),), generator=g).to(dtype)
    else:
        vals = torch.randn(idx.numel(), generator=g).to(dtype)
    return SparseGrad(idx, vals, n)


def reference(case: dict, world_size: int) -> torch.Tensor:
    acc = torch.zeros(case["numel"], dtype=torch.float64)
    for r in range(world_size):
        s = make_sel(case, r, world_size)
        acc[s.indices] += s.values.double()
    return acc


def cases() -> list[dict]:
    out, seed = [], 1
    for dtype in (torch.float32, torch.bfloat16):
        for kind in KINDS:
            for values in ("int", "normal"):
                numel = 1009 if seed % 2 else 1000        # 1009: not divisible by any P
                out.append({"kind": kind, "dtype": dtype, "values": values, "numel": numel,
                            "seed": seed})
                seed += 1
    out.append({"kind": "overlap", "dtype": torch.float16, "values": "int", "numel": 777,
                "seed": seed})
    out.append({"kind": "runs", "dtype": torch.float32, "values": "normal", "numel": 1009,
                "seed": seed + 1, "index_bytes": 8})
    return out


def _rank_cases(rank: int, world_size: int, case_list: list[dict], pair: bool = True
                ) -> list[dict]:
    results = []
    for case in case_list:
        coll = get("densestream", index_bytes=case.get("index_bytes"), pair=pair)
        sel = make_sel(case, rank, world_size)
        res = coll(sel, step=0)
        results.append({"dense": res.dense, "kept": res.kept,
                        "sent": res.stats.bytes_sent, "recv": res.stats.bytes_recv,
                        "messages": res.stats.messages,
                        "info": {k: v for k, v in res.info.items() if k != "boundaries"},
                        "bounds": res.info.get("boundaries")})
    return results


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.element_size() == 4 else t.view(torch.int16)


@pytest.mark.usefixtures("kernels")
@pytest.mark.accelerator_at(world_size=3)
@pytest.mark.parametrize("world_size, pair", [  # P = 8: test_collectives' shared run
    pytest.param(1, True, id="P1"), pytest.param(2, True, id="P2-pair"),
    pytest.param(2, False, id="P2-phases"), pytest.param(3, True, id="P3")])
def test_dsa_sum_exact_and_bitwise_identical(world_size, pair):
    case_list = cases()
    per_rank = run_distributed(_rank_cases, world_size, case_list, pair, timeout=240)
    for c, case in enumerate(case_list):
        outs = [per_rank[r][c] for r in range(world_size)]
        what = f"P={world_size} {case}"
        dense0 = outs[0]["dense"]
        assert dense0.dtype == case["dtype"] and dense0.shape == (case["numel"],), what
        for r, o in enumerate(outs):
            # bitwise identical on every rank
            assert torch.equal(_bits(o["dense"]), _bits(dense0)), f"{what}: rank {r} differs"
            # exact collective: every local index is kept
            assert torch.equal(o["kept"], make_sel(case, r, world_size).indices), what
            # global_nnz: the result's nonzeros (bit patterns other than +0.0), on every rank
            if world_size > 1:
                assert o["info"]["global_nnz"] == int(torch.count_nonzero(_bits(o["dense"]))), \
                    what
        ref = reference(case, world_size)
        if case["values"] == "int":   # exact in any order: must match bit for bit
            assert torch.equal(dense0, ref.to(case["dtype"])), what
        else:
            tol = 1e-5 if case["dtype"] == torch.float32 else 4e-2
            torch.testing.assert_close(dense0.double(), ref, rtol=tol, atol=tol * 4, msg=what)
        # every byte sent is received by someone
        assert sum(o["sent"] for o in outs) == sum(o["recv"] for o in outs), what
        if world_size > 1:
            bounds = outs[0]["bounds"]
            assert bounds[0] == 0 and bounds[-1] == case["numel"], what
            assert bool((bounds[1:] >= bounds[:-1]).all()), what
            for o in outs:
                assert torch.equal(o["bounds"], bounds), what


# -- traffic, boundaries and state ---------------------------------------------------------
def _rank_traffic(rank: int, world_size: int, n: int) -> dict:
    coll = DenseStreamAllreduce(tau=3)
    # Every rank selects everything: regions are equal slices, each one dense block.
    sel = SparseGrad(torch.arange(n), torch.full((n,), float(rank + 1)), n)
    r0 = coll(sel, step=0)
    r1 = coll(sel, step=1)                       # same τ window: boundaries reused
    r3 = coll(sel, step=3)                       # next window: re-evaluated
    state = coll.state_dict()
    fresh = DenseStreamAllreduce(tau=3)
    fresh.load_state_dict(state)
    r4 = fresh(sel, step=4)                      # restored state: reused, no all-reduce
    # The period rule is Ok-Topk's (collectives/regions.py): a step earlier than the step the
    # boundaries were evaluated at re-evaluates, even inside the same τ-window.
    late = DenseStreamAllreduce(tau=3)
    r5 = late(sel, step=5)                       # first call: evaluated mid-window
    r4b = late(sel, step=4)                      # same window, before the evaluation
    # Clustered selections move the boundaries towards the cluster.
    clustered = SparseGrad(torch.arange(n - 64, n), torch.ones(64), n)
    rc = DenseStreamAllreduce()(clustered, step=0)
    return {"sent": [r.stats.bytes_sent for r in (r0, r1, r3, r4, r5, r4b)],
            "recomputed": [r.info["boundaries_recomputed"] for r in (r0, r1, r3, r4, r5, r4b)],
            "phases": r0.info["bytes_sent_by_phase"], "bounds": r0.info["boundaries"],
            "dense": r4.dense, "clustered_bounds": rc.info["boundaries"],
            "clustered_regions": rc.info["region_nnz"]}


def test_dsa_traffic_boundaries_and_state_at_p4():
    n, P = 4000, 4
    outs = run_distributed(_rank_traffic, P, n, timeout=240)
    for o in outs:
        assert o["recomputed"] == [True, False, True, False, True, True]
        assert torch.equal(o["dense"], torch.full((n,), float(sum(range(1, P + 1)))))
        # equal-count cut points of arange(n): j·n/P
        assert o["bounds"].tolist() == [0, 1000, 2000, 3000, 4000]
        # Exact bytes (Comm's ring accounting for all-reduces: 2(P−1)/P · bytes):
        shape_check = 2 * 3 * 32 // 4               # base class: 4 int64 words
        split = 2 * 3 * (8 * P) // 4                # P′ = 4 int64 words
        def block(m):                               # one DenseStream block of m fp32 values
            return 32 + 8 + 4 * m
        # each message: the headers of its encodings (32 bytes each), then the encodings
        halving = (32 + block(2000)) + (32 + block(1000))
        # the allgather forwards each region's own encoding: 1, then 2 regions of 1000, each
        # message led by its sender's verdict word (8 bytes)
        doubling = (8 + 32 + block(1000)) + (8 + 2 * 32 + 2 * block(1000))
        assert o["phases"] == {"balanced_split": split, "fold": 0,
                               "scatter_reduce": halving, "allgather": doubling, "unfold": 0}
        assert o["sent"] == [shape_check + split + halving + doubling,
                             shape_check + halving + doubling,
                             shape_check + split + halving + doubling,
                             shape_check + halving + doubling,
                             shape_check + split + halving + doubling,
                             shape_check + split + halving + doubling]
        cb = o["clustered_bounds"].tolist()
        assert cb == [0, n - 48, n - 32, n - 16, n]
    assert [o["clustered_regions"] for o in outs] == [16, 16, 16, 16]


def test_state_dict_validation_and_single_rank():
    coll = DenseStreamAllreduce(tau=5)
    sel = SparseGrad(torch.tensor([1, 4]), torch.tensor([2.0, -1.0]), 6)
    res = coll(sel)
    assert torch.equal(res.dense, torch.tensor([0, 2.0, 0, 0, -1.0, 0]))
    assert torch.equal(res.kept, sel.indices) and res.stats.bytes_sent == 0
    state = {"tau": 5, "boundaries": [{"numel": 10, "regions": 2, "step": 0,
                                       "bounds": torch.tensor([0, 4, 10])}]}
    coll.load_state_dict(state)
    assert coll.state_dict()["boundaries"][0]["bounds"].tolist() == [0, 4, 10]
    with pytest.raises(ValueError, match="tau"):
        DenseStreamAllreduce(tau=6).load_state_dict(state)
    with pytest.raises(ValueError, match="keys"):
        coll.load_state_dict({"tau": 5})
    bad = {"tau": 5, "boundaries": [{"numel": 10, "regions": 2, "step": 0,
                                     "bounds": torch.tensor([0, 7, 4])}]}
    with pytest.raises(ValueError, match="boundaries"):
        coll.load_state_dict(bad)
    with pytest.raises(ValueError, match="tau"):
        DenseStreamAllreduce(tau=0)
    with pytest.raises(ValueError, match="index_bytes"):
        DenseStreamAllreduce(index_bytes=2)


# -- malformed messages -----------------------------------------------------------------------
class _Corrupting(DenseStreamAllreduce):
    """Rank 0 corrupts the ``call``-th message it receives (0: the scatter-reduce's at P = 2,
    1: the allgather's), as a faulty link or peer would, before anything looks at it."""

    def __init__(self, call: int, how: str, pair: bool) -> None:
        super().__init__(pair=pair)
        self.call, self.how, self.calls = call, how, 0

    def _match(self, buf, ann, sizes, checks):
        self.calls += 1
        if dist.get_rank() != 0 or self.calls - 1 != self.call or buf is None:
            return super()._match(buf, ann, sizes, checks)
        buf = buf.clone()
        iw, nb = buf[5].item(), int(buf[16:24].view(torch.int64))
        if self.how == "rule 1":      # the first stored value becomes +0.0
            buf[32 + 2 * nb * iw:32 + 2 * nb * iw + 4] = 0
        elif self.how == "outside":   # the first block starts past the tensor's end
            buf[32:32 + iw].view(torch.int32 if iw == 4 else torch.int64).fill_(
                int(buf[8:16].view(torch.int64)) - 1)
        elif self.how == "truncated":
            buf = buf[:-1]
        elif self.how == "announced":  # the message's header is not the one announced
            buf[7] = 1
        return super()._match(buf, ann, sizes, checks)


def _rank_corrupt(rank: int, world_size: int, n: int, plan: list[tuple[int, str]],
                  pair: bool) -> list:
    g = torch.Generator().manual_seed(rank)
    sel = SparseGrad(torch.randperm(n, generator=g)[: n // 10].sort().values,
                     torch.randn(n // 10, generator=g).abs_().add_(1), n)
    out = []
    for call, how in plan:
        coll = _Corrupting(call, how, pair)
        try:
            res = coll(sel, step=0)
            out.append(("ok", res.dense, res.info["boundaries"].tolist()))
        except ValueError as e:
            out.append(("raised", str(e), None))
        checks: list = []
        try:  # deferred: the result comes back with the failed check among `checks`
            res = _Corrupting(call, how, pair)(sel, step=0, deferred=checks)
            failed = [m for ok, m in checks if not bool(ok)]
            out.append(("deferred", res.dense, failed, res.info["boundaries"].tolist()))
        except ValueError as e:
            out.append(("raised", str(e), None))
    return out


@pytest.mark.parametrize("pair", [False, True], ids=["phases", "pair"])
def test_malformed_messages_fail_the_receiving_rank_and_write_only_inside_the_senders_range(
        pair):
    """A message that breaks the format's rules, lands outside its sender's range or differs
    from the headers announced for it: the rank that received it raises ``ValueError`` naming
    the rule, after the collective completed (no peer is left waiting); with ``deferred`` the
    failed check comes back instead, and the result outside the sender's range is the exact
    sum. In the phases its peer hears of a scatter-reduce message's fault in the allgather and
    fails too ("another rank"). A truncated message is refused at once. At P = 2 in one
    exchange (``pair``) the one message is the sender's whole range."""
    n, P = 2000, 2
    plan = [(0, "rule 1"), (0, "outside"), (0, "announced"), (1, "rule 1"), (1, "outside"),
            (1, "truncated")]
    if pair:
        plan = [(0, "rule 1"), (0, "outside"), (0, "announced"), (0, "truncated")]
    outs = run_distributed(_rank_corrupt, P, n, plan, pair, timeout=240)
    ref = torch.zeros(n, dtype=torch.float64)
    for r in range(P):
        g = torch.Generator().manual_seed(r)
        idx = torch.randperm(n, generator=g)[: n // 10].sort().values
        ref[idx] += torch.randn(n // 10, generator=g).abs_().add_(1).double()
    for j, (call, how) in enumerate(plan):
        strict, deferred = outs[0][2 * j], outs[0][2 * j + 1]
        assert strict[0] == "raised" and how in strict[1], (call, how, strict)
        # rank 1 received nothing malformed; in the phases it hears rank 0's verdict on the
        # scatter-reduce's message in the allgather (module doc, "Verdicts in the allgather"),
        # and nothing of a fault in the allgather, the last round (one rank's link)
        other, other_deferred = outs[1][2 * j], outs[1][2 * j + 1]
        if call == 0 and not pair and how != "truncated":
            heard = "densestream: another rank received a malformed message"
            assert other[0] == "raised" and heard in other[1], (call, how, other)
            assert other_deferred[0] == "deferred" and len(other_deferred[2]) == 1 and \
                heard in other_deferred[2][0], (call, how, other_deferred)
        else:
            assert other[0] == "ok" and other_deferred[2] == [], (call, how)
        if how == "truncated":
            assert deferred[0] == "raised" and "truncated" in deferred[1]
            continue
        assert deferred[0] == "deferred" and deferred[2] and how in deferred[2][0], deferred
        if pair:  # the sender's range is the whole tensor
            continue
        # rank 0 kept region [0, B1) in the scatter-reduce and received region 1 = [B1, n)
        b1 = deferred[3][1]
        good = slice(b1, n) if call == 0 else slice(0, b1)
        torch.testing.assert_close(deferred[1][good].double(), ref[good])


# -- verdicts in the allgather (module doc) ------------------------------------------------------
def _rank_region_fault(rank: int, world_size: int, how: str) -> list[str]:
    """At steps 0–2 a DenseStream allreduce in its phases; at step 1 the last rank encodes its
    reduced region malformed (``how="region"``: its first value +0.0, as a faulty rank would)
    or its verdict word reaches its peers as 7 (``"word"``: corrupted on the way, the sender's
    own checks passed). Each step's outcome."""
    import gradsync.formats.densestream as dsfmt

    encode, coll = dsfmt.encode_announced, DenseStreamAllreduce(pair=False)
    verdict, allgather, armed = coll._verdict, coll._allgather, [False]

    def in_allgather(*args):  # the region's encoding, not the scatter-reduce's or the fold's
        armed.append(True)
        try:
            return allgather(*args)
        finally:
            armed.pop()

    def bad_encode(part, index_bytes=4):
        enc, head = encode(part, index_bytes)
        if armed[0] and len(armed) > 1 and enc.numel() > 32:
            armed[0] = False
            enc = enc.clone()
            nb = int(enc[16:24].view(torch.int64))
            enc[32 + 2 * nb * index_bytes:32 + 2 * nb * index_bytes + 4] = 0
        return enc, head

    def bad_verdict(checks, device):
        word = verdict(checks, device)
        return torch.full((1,), 7, dtype=torch.int64).view(torch.uint8) if armed[0] else word

    if how == "region":
        dsfmt.encode_announced, coll._allgather = bad_encode, in_allgather
    else:
        coll._verdict = bad_verdict
    n, out = 4000, []
    try:
        for step in range(3):
            g = torch.Generator().manual_seed(10 * rank + step)
            idx = torch.randperm(n, generator=g)[:400].sort().values
            sel = SparseGrad(idx, torch.randn(400, generator=g).abs_().add_(1), n)
            armed[0] = step == 1 and rank == world_size - 1  # never folded away
            try:
                coll(sel, step=step)
                out.append("ok")
            except ValueError as e:
                out.append(str(e))
    finally:
        dsfmt.encode_announced = encode
    return out


@pytest.mark.parametrize("P", [3, 4, 8])
@pytest.mark.parametrize("how", ["region", "word"])
def test_a_fault_on_one_rank_fails_every_rank_without_an_agreement_round(how, P):
    """A rank whose reduced region is encoded malformed: every rank decodes that encoding
    (its owner too, as its peers do), so every rank fails at that step, each with the rule or
    with "another rank" where a verdict reached it first. A verdict word that is not 0 or 1
    fails every rank that hears it, and through them every rank but its sender, whose checks
    passed (a link's fault: docs/usage.md). The steps before and after pass: nothing hangs."""
    outs = run_distributed(_rank_region_fault, P, how, timeout=240)
    for rank, out in enumerate(outs):
        assert out[0] == out[2] == "ok", (rank, out)
        if how == "word" and rank == P - 1:
            assert out[1] == "ok", out
            continue
        want = ("rule 1", "another rank received a malformed message") if how == "region" else \
            ("not 0 or 1", "another rank received a malformed message")
        assert any(w in out[1] for w in want), (rank, out)
    # the rank that made the fault decodes its region as its peers do (region), and its first
    # peer in the allgather hears the word (word): each names it
    assert want[0] in outs[P - 1 if how == "region" else P - 2][1], outs


# -- one round per exchange (gloo) -------------------------------------------------------------
def _rank_rounds(rank: int, world_size: int, case_list: list[dict]) -> list[dict]:
    """Each case twice: as gloo allows (announcement and encodings in one message) and with
    the announcement in a round of its own (``BOUNDED_MAX`` 0); the point-to-point calls each
    made, counted at ``Comm``."""
    import gradsync.collectives.densestream as ds
    from gradsync.collectives.comm import Comm

    calls = {"n": 0}
    originals = {name: getattr(Comm, name)
                 for name in ("send", "recv", "isend", "irecv", "irecv_bounded")}

    def counted(name):
        def call(self, *a, **k):
            calls["n"] += 1
            return originals[name](self, *a, **k)
        return call

    for name in originals:
        setattr(Comm, name, counted(name))
    out, bound = [], ds.BOUNDED_MAX
    try:
        for case in case_list:
            sel = make_sel(case, rank, world_size)
            row = {}
            for mode, limit in (("one", bound), ("two", 0)):
                ds.BOUNDED_MAX, calls["n"] = limit, 0
                res = DenseStreamAllreduce(pair=False)(sel, step=0)
                row[mode] = {"dense": res.dense, "sent": res.stats.bytes_sent,
                             "recv": res.stats.bytes_recv, "messages": res.stats.messages,
                             "calls": calls["n"]}
            out.append(row)
    finally:
        ds.BOUNDED_MAX = bound
        for name, fn in originals.items():
            setattr(Comm, name, fn)
    return out


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_one_round_per_exchange_sends_the_same_bytes_and_bits(world_size):
    """On gloo an exchange's announcement travels inside its message: the same bytes counted
    sent and received, the same sum bit for bit, on no rank more messages or point-to-point
    calls than announcing first, fewer in all (half the calls where no partition is empty);
    an all-empty case sends announcements only, one message either way."""
    case_list = [c for c in cases() if c["dtype"] == torch.float32 and c["values"] == "normal"]
    per_rank = run_distributed(_rank_rounds, world_size, case_list, timeout=240)
    for c, case in enumerate(case_list):
        for r in range(world_size):
            one, two = per_rank[r][c]["one"], per_rank[r][c]["two"]
            what = f"P={world_size} rank {r} {case['kind']}"
            assert torch.equal(_bits(one["dense"]), _bits(two["dense"])), what
            assert (one["sent"], one["recv"]) == (two["sent"], two["recv"]), what
            if case["kind"] == "empty_all":
                assert one["messages"] == two["messages"], what
                continue
            assert one["messages"] <= two["messages"] and one["calls"] <= two["calls"], what
            if case["kind"] in ("dense", "overlap") and world_size != 3:
                assert 2 * one["calls"] == two["calls"], what
        if case["kind"] != "empty_all":
            assert sum(per_rank[r][c]["one"]["messages"] for r in range(world_size)) < sum(
                per_rank[r][c]["two"]["messages"] for r in range(world_size)), case["kind"]


def _rank_overclaim(rank: int, world_size: int, n: int, pair: bool) -> str:
    class Overclaiming(DenseStreamAllreduce):
        """Rank 0 reads its peer's last announcement as claiming more than the range holds."""

        calls = 0

        def _announced(self, ann, like, heard=None):
            heads, sizes = super()._announced(ann, like, heard)
            self.calls += 1
            # the allgather's, the last exchange at P = 2 (the one exchange with ``pair``)
            if rank == 0 and self.calls == (1 if pair else 2):
                sizes = [s + 10 * n * 12 for s in sizes]
            return heads, sizes

    sel = SparseGrad(torch.arange(rank, n, 3), torch.ones(len(range(rank, n, 3))), n)
    try:
        Overclaiming(pair=pair)(sel, step=0)
    except ValueError as e:
        return str(e)
    return "ok"


@pytest.mark.parametrize("pair", [False, True], ids=["phases", "pair"])
def test_an_announcement_beyond_the_ranges_bound_fails_after_the_exchange(pair):
    """A message that announces more bytes than its ranges can hold raises ``ValueError`` on
    the rank that received it, once both directions of the exchange are done: its peer,
    which received a well-formed message, is not left waiting."""
    outs = run_distributed(_rank_overclaim, 2, 600, pair, timeout=120)
    assert "announced" in outs[0] and "hold at most" in outs[0], outs[0]
    assert outs[1] == "ok"


# -- P = 2 in one exchange (module doc) ----------------------------------------------------------
def test_pair_exchange_is_the_phases_bit_for_bit_in_fewer_bytes_and_rounds():
    """At P = 2 on gloo each rank sends its whole selection's encoding once and forms both
    regions' sums itself: the same sum bit for bit as scatter-reduce and allgather, never more
    bytes (a selection is at most the union the allgather sends) and one message a rank where
    the phases send at least two (and, at step 0, the boundaries' all-reduce)."""
    case_list = cases()
    pair = run_distributed(_rank_cases, 2, case_list, True, timeout=240)
    phases = run_distributed(_rank_cases, 2, case_list, False, timeout=240)
    for c, case in enumerate(case_list):
        for r in range(2):
            a, b, what = pair[r][c], phases[r][c], f"rank {r} {case}"
            assert torch.equal(_bits(a["dense"]), _bits(b["dense"])), what
            assert torch.equal(a["kept"], b["kept"]), what
            assert a["info"]["pair"] and "pair" not in b["info"], what
            assert a["sent"] <= b["sent"] and a["recv"] <= b["recv"], what
            assert a["messages"] < b["messages"], what
            assert a["info"]["bytes_sent_by_phase"]["pair"] <= b["sent"], what
