"""The SSFusion paper's remaining baselines: SparDL (a collective), HiPress and Espresso (planners).

* SparDL against an independent single-process reference of its algorithm (per-entry
  contributor sets, float32 additions in the same order, top-k by sorting), P ∈ {1, 2, 3, 4, 5,
  8}: the result bit for bit, every rank's ``kept``, and the bytes counted at the
  torch.distributed call against the wire formula written out here; empty selections included.
* HiPress and Espresso decisions on hand-built cost models: a tiny tensor is synchronized dense
  (HiPress: in a bulk all-reduce), a large one is compressed on a slow link and not on a fast
  one, Espresso offloads when inline sparsification would delay the backward and has no fusion.
* The three schemes in the engine (``GradSync``) at P ∈ {1, 2, 3, 4, 5, 8}: density 1 equals a plain
  all-reduce average (the DDP reference, computed here with torch.distributed), replicas stay
  bitwise identical, and conservation holds bit for bit per rank, step and parameter.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from conftest import conserved as conserved_records
from conftest import density_one_error, image_batch, pin_profiles
from gradsync import collectives
from gradsync.apps.models import build
from gradsync.engine import GradSync
from gradsync.engine.config import Config
from gradsync.engine.consistency import parameter_digest
from gradsync.schedule import costmodel, make_plan, schemes
from gradsync.schedule.costmodel import AffineFit, AlphaBeta, CostModel
from gradsync.sparsegrad import SparseGrad, target_k
from gradsync.testing import run_distributed

WORLD_SIZES = [1, 2, 3]  # P = 8: test_collectives' shared run, against its own reference
BASELINES = ["hipress", "espresso", "spardl"]

# ------------------------------------------------------------------------------------ SparDL
# case → (numel, entries per rank, density of the collective, tie-heavy values)
CASES = {
    "random": (600, 60, 0.1, False),
    "ties": (257, 40, 0.05, True),
    "full": (97, 97, 1.0, False),
    "some_empty": (300, 30, 0.1, False),
    "all_empty": (64, 0, 0.1, False),
}


def _selection(case: str, rank: int, P: int) -> SparseGrad:
    n, m, _, ties = CASES[case]
    if case == "some_empty" and rank % 2 == 1:
        m = 0
    g = torch.Generator().manual_seed(7919 * P + 31 * rank + len(case))
    idx = torch.sort(torch.randperm(n, generator=g)[:m]).values
    if ties:  # multiples of 1/2 in [-4, 4]: many equal magnitudes, exact sums
        val = (torch.randint(-8, 9, (m,), generator=g) / 2).to(torch.float32)
    else:
        val = torch.randn(m, generator=g)
    return SparseGrad(idx, val, n)


def _spardl_rank(rank: int, P: int) -> dict:
    out = {}
    for case in CASES:
        sel = _selection(case, rank, P)
        coll = collectives.get("spardl", density=CASES[case][2])
        res = coll(sel, step=0)
        out[case] = (res.dense, res.kept, res.stats.bytes_sent, res.stats.bytes_recv)
    return out


def _top(entries: dict[int, tuple[np.float32, frozenset]], kb: int) -> dict:
    """The kb entries of largest |value| (ties: smaller index), as a dict."""
    order = sorted(entries, key=lambda i: (-abs(float(entries[i][0])), i))
    return {i: entries[i] for i in order[:kb]}


def spardl_reference(sels: list[SparseGrad], density: float) -> dict:
    """SparDL as described in the papers' terms, written independently of the collective:
    dicts index → (float32 value, contributing ranks), rounds simulated for all ranks at once."""
    P, n = len(sels), sels[0].numel
    k = target_k(n, density)
    kb = -(-k // P)
    # balanced blocks: each voting rank's equal-count cut points, averaged (integer mean)
    votes = [s.indices.tolist() for s in sels if len(s)]
    if votes:
        cuts = [sum(v[j * len(v) // P] for v in votes) // len(votes) for j in range(1, P)]
    else:
        cuts = [j * n // P for j in range(1, P)]
    B = [0, *cuts, n]

    def block(i: int) -> int:
        return max(b for b in range(P) if B[b] <= i)

    state = [{int(i): (np.float32(v), frozenset([r]))
              for i, v in zip(s.indices.tolist(), s.values.tolist())} for r, s in enumerate(sels)]
    sent = [[0] * max(P - 1, 0).bit_length() for _ in range(P)]
    S = (P - 1).bit_length()
    for s in range(S):
        d = 2**s
        outgoing = []
        for r in range(P):
            fwd_blocks = [b for b in range(P) if ((b - r) % P) & d]
            msg = {}
            for b in fwd_blocks:
                msg.update(_top({i: e for i, e in state[r].items() if block(i) == b}, kb))
            state[r] = {i: e for i, e in state[r].items() if block(i) not in fwd_blocks}
            outgoing.append(msg)
            sent[r][s] = len(msg)
        for r in range(P):
            for i, (v, c) in sorted(outgoing[(r - d) % P].items()):
                if i in state[r]:
                    w, c0 = state[r][i]
                    state[r][i] = (np.float32(w + v), c0 | c)
                else:
                    state[r][i] = (v, c)
            for b in range(P):
                j = (b - r) % P
                if j % (2 * d) == 0 and j + d < P:
                    others = {i: e for i, e in state[r].items() if block(i) != b}
                    state[r] = {**others, **_top({i: e for i, e in state[r].items()
                                                  if block(i) == b}, kb)}
    dense = torch.zeros(n, dtype=torch.float32)
    kept: list[set[int]] = [set() for _ in range(P)]
    final = [len(state[r]) for r in range(P)]
    for r in range(P):
        for i, (v, c) in state[r].items():
            assert block(i) == r
            dense[i] = float(v)
            for q in c:
                kept[q].add(i)
    # bytes each rank hands to torch.distributed (fp32 values, int32 indices: 8 B per entry)
    nbytes = []
    for r in range(P):
        if P == 1:
            nbytes.append(0)
            continue
        b = 2 * (P - 1) * 32 // P  # the shape consensus (ring all-reduce of 4 int64)
        b += 2 * (P - 1) * (8 * P) // P  # the block boundaries (P int64, ring all-reduce)
        # per round one message of fixed capacity: a count, then room for k_B entries (or the
        # whole block, if smaller) of every block r forwards: distance ≡ 2^s mod 2^(s+1)
        for s in range(S):
            room = sum(min(kb, B[blk + 1] - B[blk]) for blk in range(P)
                       if (blk - r) % P % 2 ** (s + 1) == 2**s)
            assert sent[r][s] <= room
            b += 8 + 8 * room
        b += sum(math.ceil(sent[(r - 2**s) % P][s] / 8) for s in range(S))  # survival bits
        # ring all-gather of a verdict word, a count and room for k_B entries
        b += (P - 1) * (8 + 8 + 8 * kb)
        assert max(final) <= kb
        nbytes.append(b)
    return {"dense": dense, "kept": [torch.tensor(sorted(x), dtype=torch.int64) for x in kept],
            "bytes": nbytes, "sent": sent}


@pytest.mark.usefixtures("kernels")
@pytest.mark.accelerator_at(P=3)
@pytest.mark.parametrize("P", WORLD_SIZES)
def test_spardl_equals_an_independent_reference(P):
    out = run_distributed(_spardl_rank, P, timeout=300)
    for case, (n, _, density, _) in CASES.items():
        sels = [_selection(case, r, P) for r in range(P)]
        ref = spardl_reference(sels, density)
        for r, o in enumerate(out):
            dense, kept, sent, _ = o[case]
            what = f"P={P} {case} rank {r}"
            assert torch.equal(dense, ref["dense"]), what
            assert torch.equal(kept, ref["kept"][r]), what
            assert sent == ref["bytes"][r], (what, sent, ref["bytes"][r])
        assert sum(o[case][2] for o in out) == sum(o[case][3] for o in out)
        # conservation across the group: the kept entries add up to the result exactly
        # (the "ties" case has exact sums; the others compare in float64 with fp32 rounding)
        total = torch.zeros(n, dtype=torch.float64)
        for r, o in enumerate(out):
            pos = torch.searchsorted(sels[r].indices, o[case][1])
            total.index_add_(0, o[case][1], sels[r].values[pos].double())
        if case == "ties":
            assert torch.equal(total, out[0][case][0].double()), P
        assert torch.allclose(total, out[0][case][0].double(), atol=1e-5), (P, case)
        if P > 1 and case in ("random", "ties"):  # the budget really dropped something
            assert sum(len(s) for s in sels) > sum(o[case][1].numel() for o in out), case
        if case == "full":  # density 1: nothing dropped, the exact SUM
            exact = torch.zeros(n, dtype=torch.float64)
            for s in sels:
                exact.index_add_(0, s.indices, s.values.double())
            assert torch.allclose(out[0][case][0].double(), exact, atol=1e-5)
            assert all(torch.equal(o[case][1], sels[r].indices) for r, o in enumerate(out))


def test_spardl_volume_stays_o_k_per_round():
    """Re-sparsification keeps every round at ≤ k_B entries per forwarded block."""
    P, n = 8, 4096
    sels = []
    for r in range(P):
        g = torch.Generator().manual_seed(r)
        idx = torch.sort(torch.randperm(n, generator=g)[:400]).values
        sels.append(SparseGrad(idx, torch.randn(400, generator=g), n))
    ref = spardl_reference(sels, 0.1)
    kb = -(-target_k(n, 0.1) // P)
    for r in range(P):
        for s, c in enumerate(ref["sent"][r]):
            assert c <= kb * len(range(2**s, P, 2 ** (s + 1)))


def _spardl_forged_rank(rank: int, P: int) -> dict:
    """Round 0 of SparDL's reduce-scatter between real gloo ranks: every rank sends an honest
    message (k_B entries in each block it forwards) except rank 0, which sends a forged one —
    first an entry in a block it does not forward, then (P ≥ 4, where its message holds two
    blocks) k_B + 1 entries of one forwarded block. Returns what each receive raised."""
    from gradsync.collectives.base import raise_failed
    from gradsync.collectives.comm import Comm
    from gradsync.collectives.spardl import SparDL, capacity, forwarded
    from gradsync.formats.wire import pack_entries_fixed

    n, k_b = 10 * P, 2
    bl = list(range(0, n + 1, 10))  # block b is [10 b, 10 b + 10)
    B = torch.tensor(bl)
    blocks = forwarded(rank, 0, P)
    cap = capacity(blocks, bl, k_b)
    honest = torch.tensor(sorted(10 * b + j for b in blocks for j in range(k_b)))
    forged = {"stray": torch.cat([torch.tensor([10 * rank]), honest[1:]]),  # block rank: held
              "over": torch.tensor(sorted([10 * blocks[0] + j for j in range(k_b + 1)]
                                          + [10 * blocks[-1]]))[:cap]}
    out = {}
    for case in ("stray", "over"):
        if case == "over" and P < 4:
            continue
        idx = forged[case] if rank == 0 else honest
        payload = pack_entries_fixed(idx, torch.ones(idx.numel()), torch.int32, cap)
        checks: list = []
        try:
            r_idx, _ = SparDL._receive(Comm(None), payload, 0, B, bl, k_b, n, torch.int32,
                                       torch.float32, checks)
            raise_failed(checks)  # the checks are made on the device, read here
            out[case] = ("ok", r_idx.numel())
        except ValueError as e:
            out[case] = ("error", str(e))
    return out


@pytest.mark.parametrize("P", [2, 3, 4])  # one round, not a power of two, two rounds
def test_spardl_rejects_a_peer_message_outside_its_schedule(P):
    """A received round message is checked against the schedule (on the device): entries in a
    block the sender does not forward, or more than k_B in one block, fail on the receiver
    (rank 1, which receives from rank 0 in round 0) with the sender and round named; every
    other rank's honest message passes."""
    out = run_distributed(_spardl_forged_rank, P, timeout=120)
    for case in ("stray", "over") if P >= 4 else ("stray",):
        got = out[1][case]
        assert got[0] == "error", (P, case, got)
        want = "outside the blocks it forwards" if case == "stray" else "more than k_B = 2"
        assert want in got[1] and "rank 0" in got[1] and "round 0" in got[1], got[1]
        for r in range(P):
            if r != 1:
                assert out[r][case][0] == "ok", (P, case, r, out[r][case])


def test_spardl_options_are_validated():
    with pytest.raises(ValueError, match="not both"):
        collectives.get("spardl", density=0.1, k=3)
    with pytest.raises(ValueError, match="tau"):
        collectives.get("spardl", tau=0)
    with pytest.raises(ValueError, match="density"):
        collectives.get("spardl", density=0.0)
    c = collectives.get("spardl")
    with pytest.raises(ValueError, match="unexpected state"):
        c.load_state_dict({"x": 1})


# -------------------------------------------------------------------------- planners' decisions
def _cost(numel: dict[str, int], *, beta: float, backward: dict[str, float] | None = None,
          inline: AffineFit | None = None, offload: AffineFit | None = None,
          P: int = 4) -> CostModel:
    order = list(numel)
    return CostModel(P=P, order=order, numel=numel, elem_bytes=4,
                     backward=backward or {n: 1e-4 for n in order},
                     sparsify=inline or AffineFit(1e-5, 1e-9),
                     offload=offload or AffineFit(5e-5, 1e-9),
                     allreduce=AlphaBeta(5e-5, beta), allgather=AlphaBeta(5e-5, beta))


def _options(plan) -> dict[str, str]:
    out = {}
    for b in plan.buffers:
        for t in b.tensors:
            out[t.name] = ("dense" if t.density is None else
                           "offload" if t.offload else "inline")
    return out


SLOW, FAST = 8 / 1e8, 8 / 1e11  # 100 Mbit/s and 100 Gbit/s, in s/B


def test_hipress_tiny_tensors_are_bulk_synchronized_dense_and_large_ones_compressed_on_slow_links():
    numel = {"b1": 10, "w1": 2_000_000, "b2": 64, "b3": 32, "w2": 1_000_000, "b4": 16}
    plan = make_plan("hipress", list(numel), numel, 0.01, _cost(numel, beta=SLOW))
    assert _options(plan) == {"b1": "dense", "w1": "inline", "b2": "dense", "b3": "dense",
                              "w2": "inline", "b4": "dense"}
    # compressed tensors travel alone; consecutive dense ones share one all-reduce (bulk)
    assert [b.names for b in plan.buffers] == [["b1"], ["w1"], ["b2", "b3"], ["w2"], ["b4"]]
    dense_bufs = [b for b in plan.buffers if b.tensors[0].density is None]
    assert all(t.allreduce for b in dense_bufs for t in b.tensors)
    dec = {d["name"]: d for d in plan.info["hipress"]}
    assert dec["w1"]["T_cpr"] < dec["w1"]["T_dense"] and dec["b1"]["T_cpr"] > dec["b1"]["T_dense"]
    # a fast link: the codec costs more than the bytes it saves, nothing is compressed
    fast = make_plan("hipress", list(numel), numel, 0.01, _cost(numel, beta=FAST))
    assert set(_options(fast).values()) == {"dense"}
    assert [b.names for b in fast.buffers] == [list(numel)]  # one bulk round
    # the bulk is capped at bucket_bytes
    capped = make_plan("hipress", list(numel), numel, 0.01, _cost(numel, beta=FAST),
                       bucket_bytes=5_000_000)
    assert [b.names for b in capped.buffers] == [["b1"], ["w1"], ["b2", "b3", "w2", "b4"]]
    # one rank: nothing to gain from compression
    one = make_plan("hipress", list(numel), numel, 0.01, _cost(numel, beta=SLOW, P=1))
    assert set(_options(one).values()) == {"dense"}


def test_espresso_chooses_per_tensor_from_the_timeline_and_never_fuses():
    numel = {"tiny": 10, "big": 2_000_000}
    # a sparsifier start-up (200 µs) above the start-ups an all-gather saves over a ring
    # all-reduce (3α = 150 µs at P = 4): a tiny tensor is not worth compressing
    fit = AffineFit(2e-4, 1e-9)
    slow = make_plan("espresso", list(numel), numel, 0.01,
                     _cost(numel, beta=SLOW, inline=fit, offload=fit))
    assert all(len(b.tensors) == 1 for b in slow.buffers)  # no fusion
    assert slow.names == ["tiny", "big"]
    opts = _options(slow)
    assert opts["tiny"] == "dense" and opts["big"] in ("inline", "offload")
    fast = make_plan("espresso", list(numel), numel, 0.01,
                     _cost(numel, beta=FAST, inline=fit, offload=fit))
    assert _options(fast) == {"tiny": "dense", "big": "dense"}
    # with a cheap sparsifier the α-β model prefers the all-gather of a tiny tensor's one entry
    # ((P−1)α) to its ring all-reduce (2(P−1)α): Espresso follows the model
    # (the planner as published: by default, Config.min_k, a one-entry tensor travels whole)
    cheap_cost = _cost(numel, beta=FAST, inline=AffineFit(1e-6, 1e-9))
    cheap = make_plan("espresso", list(numel), numel, 0.01, cheap_cost, min_k=1)
    assert _options(cheap) == {"tiny": "inline", "big": "dense"}
    by_default = make_plan("espresso", list(numel), numel, 0.01, cheap_cost)
    assert _options(by_default) == {"tiny": "dense", "big": "dense"}
    # inline sparsification of the first large tensor would delay a long backward: offload it
    numel = {"first": 1_000_000, "rest": 1_000_000}
    backward = {"first": 1e-3, "rest": 50e-3}
    cost = _cost(numel, beta=SLOW, backward=backward, inline=AffineFit(0, 20e-9),
                 offload=AffineFit(0, 20e-9))
    plan = make_plan("espresso", list(numel), numel, 0.01, cost)
    assert _options(plan)["first"] == "offload"
    t_off = plan.info["espresso"]["iteration"]
    again = make_plan("espresso", list(numel), numel, 0.01, cost)
    assert again.info["espresso"] == plan.info["espresso"]  # deterministic
    # a CPU host whose ranks take every core: the worker would not run beside the backward,
    # so nothing is offloaded; with a core per worker, the same choice as before
    for cores, offloads in ((1.0, False), (2.0, True)):
        cost.info.update(device="cpu", cores_per_rank=cores)
        opts = _options(make_plan("espresso", list(numel), numel, 0.01, cost))
        assert ("offload" in opts.values()) == offloads, cores
    cost.info.clear()
    # the chosen plan is no slower than any single-option plan
    from gradsync.schedule import BufferPlan, Plan, TensorPlan, simulate

    for opt in ("dense", "inline", "offload"):
        bufs = [BufferPlan((TensorPlan(n, v, None, allreduce=True) if opt == "dense" else
                            TensorPlan(n, v, 0.01, offload=opt == "offload"),), "per_tensor")
                for n, v in numel.items()]
        assert simulate(Plan("espresso", bufs), cost).iteration >= t_off * (1 - 1e-9), opt


def test_table_rows_and_planners():
    for name in BASELINES:
        spec = schemes.get(name)
        assert spec.sparse and spec.paper
    assert schemes.get("spardl").planner == "single"
    assert schemes.get("spardl").collective == "spardl"
    assert schemes.get("hipress").needs_cost_model and schemes.get("espresso").needs_cost_model
    with pytest.raises(ValueError, match="needs a cost model"):
        make_plan("hipress", ["a"], {"a": 3}, 0.1)


# ------------------------------------------------------------------------------------ engine
def _slow_link_profiles() -> None:
    """Fixed fits in this child (plans do not depend on timing noise): backward times as
    ``conftest.pin_profiles`` pins them, a 100 Mbit/s link and a sparsifier with a 1 ms start-up
    (more than the (P−1)α an all-gather saves over a ring all-reduce at P ≤ 8), so that HiPress
    compresses the large tensors and sends the small ones dense."""
    pin_profiles(backward=True)
    costmodel.profile_collectives = lambda group=None, **kw: (
        AlphaBeta(5e-5, SLOW), AlphaBeta(5e-5, SLOW))
    costmodel.profile_sparsifier = lambda sp, offload=False, **kw: (
        AffineFit(1.2e-3, 1e-9) if offload else AffineFit(1e-3, 1e-9))


def _engine(rank: int, P: int, steps: int) -> dict:
    _slow_link_profiles()
    out: dict = {}
    for scheme in BASELINES:
        # density 1 against the plain all-reduce average (what DDP computes); at P = 1 too the
        # scheme runs (compress_single_rank), else .grad would be the gradient untouched
        model = build("mlp", seed=1)
        sync = GradSync(model, Config(scheme=scheme, density=1.0, sparsifier="topk",
                                      warmup_steps=2, compress_single_rank=True))
        worst = density_one_error(model, sync, rank, P)
        sync.close()
        # 5% density: conservation per parameter and step, bit for bit; replicas identical
        model = build("mlp", seed=1)
        sync = GradSync(model, Config(scheme=scheme, density=0.05, sparsifier="topk",
                                      warmup_steps=2, compress_single_rank=True), audit=True)
        conserved, residual_left, sent = True, 0, 0
        for step in range(steps):
            model.zero_grad(set_to_none=True)
            x, y = image_batch(rank, step)
            nn.functional.cross_entropy(model(x), y).backward()
            sync.synchronize()
            conserved &= conserved_records(sync.audit_log)
            for rec in sync.audit_log:
                residual_left += int((rec.residual != 0).sum())
                sent += rec.sent_indices.numel()
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(p.grad, alpha=-0.1)
        options = (_options(sync.plan) if sync.plan.buffers[0].mode == "per_tensor"
                   else {"all": "fused"})
        out[scheme] = {"density_one": worst, "conserved": conserved, "residual": residual_left,
                       "sent": sent, "digest": parameter_digest(model)[0], "options": options}
        sync.close()
    return out


@pytest.mark.parametrize("P", WORLD_SIZES)
def test_baselines_in_the_engine(P):
    steps = 5
    out = run_distributed(_engine, P, steps, timeout=600)
    for scheme in BASELINES:
        for rank, o in enumerate(out):
            r = o[scheme]
            where = (scheme, P, rank)
            assert r["density_one"] < 1e-5, (where, r["density_one"])
            assert r["conserved"], where
            assert r["sent"] > 0, where
        assert len({o[scheme]["digest"] for o in out}) == 1, (scheme, P)
        if P > 1:  # compression really happened and left residuals behind
            assert out[0][scheme]["residual"] > 0, (scheme, P)
            opts = out[0][scheme]["options"]
            if scheme == "hipress":  # the slow link: large tensors compressed, small ones dense
                assert opts["net.1.weight"] == "inline" and opts["net.1.bias"] == "dense", opts
            if scheme == "espresso":  # whatever the timeline prefers, the largest is compressed
                assert opts["net.1.weight"] != "dense", opts


@pytest.mark.usefixtures("kernels")
@pytest.mark.accelerator_at(seed=0)
@pytest.mark.parametrize("seed", range(6))
def test_espresso_fast_timeline_is_simulate_bit_for_bit(seed):
    """The walk's recurrence (``espresso._timeline``) gives exactly simulate()'s iteration for
    every assignment of options, on random sizes, backward times, links and sparsifier costs
    (an independent reference: the full timeline of the plan)."""
    from gradsync.schedule import BufferPlan, Plan, simulate
    from gradsync.schedule.espresso import OPTIONS, _tensor, _timeline

    g = torch.Generator().manual_seed(seed)
    n = 40
    numel = {f"t{i}": int(v) for i, v in enumerate(torch.randint(1, 3_000_000, (n,), generator=g))}
    backward = {k: float(v) for k, v in zip(numel, torch.rand(n, generator=g) * 1e-3)}
    cost = _cost(numel, beta=(SLOW, FAST)[seed % 2], backward=backward,
                 inline=AffineFit(float(torch.rand(1, generator=g)) * 1e-3, 1e-9),
                 offload=AffineFit(float(torch.rand(1, generator=g)) * 1e-3, 3e-9), P=2 + seed)
    names = list(numel)
    variants = {(k, o): BufferPlan((_tensor(k, numel[k], o, 0.01),), "per_tensor")
                for k in names for o in OPTIONS}
    fast = _timeline(names, variants, cost)
    for _ in range(25):
        pick = torch.randint(0, 3, (n,), generator=g).tolist()
        choice = {k: OPTIONS[j] for k, j in zip(names, pick)}
        plan = Plan("espresso", [variants[k, choice[k]] for k in names])
        assert fast(choice) == simulate(plan, cost).iteration
