"""Ok-Topk O(k) sparse allreduce (collectives/oktopk.py), checked against independent references.

Every rank's selection is regenerated in the parent from its seed; the reference is the exact
SUM of all ranks' selections (float64, rounded once to the dtype) and the global-threshold rule
``|R| >= θ`` applied to it. One ``run_distributed`` call per world size runs every case (cached,
shared by the tests of that world size).
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Iterator

import pytest
import torch

from gradsync import collectives
from gradsync.collectives.regions import balanced_boundaries, due
from gradsync.sparsegrad import SparseGrad, target_k
from gradsync.testing import run_distributed

WORLDS = [1, 2, 3]  # P = 8 (several buckets of messages): test_collectives' shared run
# (P, pair): at P = 2 on gloo one exchange by default (module doc, 6.), and the rounds
RUNS = [pytest.param(1, True, id="P1"), pytest.param(2, True, id="P2-pair"),
        pytest.param(2, False, id="P2-rounds"), pytest.param(3, True, id="P3")]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


# -- inputs (used by the ranks and, independently, by the parent) ----------------------------
def _selection(case: dict, rank: int, world: int, step: int) -> SparseGrad:
    """Rank ``rank``'s local selection for ``case`` at ``step`` (deterministic from the seed)."""
    n, kloc, kind = case["numel"], case["kloc"], case["kind"]
    dtype = DTYPES[case["dtype"]]
    g = torch.Generator().manual_seed(case["seed"] * 100_003 + step * 1009 + rank)
    jump_step, jump = case.get("jump", (step + 1, 1.0))
    scale = case.get("decay", 1.0) ** step * (jump if step >= jump_step else 1.0)
    if kind == "empty_all" or (kind == "empty_some" and rank % 2 == 1):
        return SparseGrad.empty(n, dtype)
    if kind in ("heavy", "empty_some"):  # top-k of a heavy-tailed gradient (realistic)
        x = torch.randn(n, generator=g) * torch.exp(1.5 * torch.randn(n, generator=g))
        idx = x.abs().topk(min(kloc, n)).indices
    elif kind == "laplace":  # top-k of a Laplace gradient: a slowly drifting distribution
        u = torch.rand(n, generator=g) * 0.999999 + 0.0000005
        x = torch.where(u < 0.5, torch.log(2 * u), -torch.log(2 - 2 * u))
        idx = x.abs().topk(min(kloc, n)).indices
    elif kind == "overlap":  # every rank picks the same indices: maximal duplicates
        x = torch.randn(n, generator=g)
        idx = torch.randperm(n, generator=torch.Generator().manual_seed(case["seed"]))[:kloc]
    elif kind == "clustered":  # Fig. 1: a 1/(2P) share of every rank's picks in a narrow
        x = torch.rand(n, generator=g)  # band inside region 0, with the largest magnitudes:
        lo, width = 0, max(1, n // 40)  # the global top-k (k = kloc/2) crowds into region 0
        x[lo:lo + width] += 10.0 * (1.0 + torch.rand(width, generator=g))
        nb = max(1, kloc // (2 * world))
        band = lo + torch.randperm(width, generator=g)[:nb]
        rest = torch.randperm(n, generator=g)
        rest = rest[(rest < lo) | (rest >= lo + width)][: kloc - nb]
        idx = torch.cat([band, rest])
        x = x * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    elif kind == "tail":  # a few entries near the end of a > 2**24 tensor (float32-inexact)
        idx = torch.tensor([3 + rank, n - 1 - 2 * rank, n - 2, 2**24 + 1 + 2 * rank])
        x = torch.zeros(n)
        x[idx] = torch.tensor([1.0, -2.0, 3.0, 4.0]) * (rank + 1)
    else:
        raise AssertionError(kind)
    return SparseGrad.from_indices((scale * x).to(dtype), idx)


def _reference(case: dict, world: int, step: int):
    """(R in the dtype, union mask, per-rank selections): the exact SUM of all selections."""
    sels = [_selection(case, r, world, step) for r in range(world)]
    acc = torch.zeros(case["numel"], dtype=torch.float64)
    union = torch.zeros(case["numel"], dtype=torch.bool)
    for s in sels:  # plain torch, rank order, float64: exact for these magnitudes
        acc[s.indices] += s.values.double()
        union[s.indices] = True
    return acc.to(DTYPES[case["dtype"]]), union, sels


def _cases(world: int) -> list[dict]:
    base = {"numel": 20_000, "kloc": 200, "steps": [0, 1], "opts": {"density": 0.01}}
    balance = {} if world >= 5 else {"balance_factor": 1.0}  # 4× cannot trigger at P <= 4
    return [
        {**base, "name": "heavy-fp32", "kind": "heavy", "dtype": "fp32", "seed": 1},
        {**base, "name": "heavy-bf16", "kind": "heavy", "dtype": "bf16", "seed": 2},
        {**base, "name": "clustered-fp32", "kind": "clustered", "dtype": "fp32", "seed": 3,
         "opts": {"k": 100, **balance}},
        {**base, "name": "clustered-bf16", "kind": "clustered", "dtype": "bf16", "seed": 4,
         "opts": {"k": 100, **balance}},
        {**base, "name": "empty-some", "kind": "empty_some", "dtype": "fp32", "seed": 5},
        {**base, "name": "empty-all", "kind": "empty_all", "dtype": "bf16", "seed": 6,
         "steps": [0]},
        {"name": "overlap-fp16-odd-numel", "kind": "overlap", "dtype": "fp16", "seed": 7,
         "numel": 10_007, "kloc": 60, "steps": [0, 1], "opts": {"k": 40}},
        {"name": "tiny", "kind": "heavy", "dtype": "fp32", "seed": 8, "numel": 3, "kloc": 2,
         "steps": [0], "opts": {}},  # numel < P for P >= 4; k = mean local count
    ]


# -- rank side -------------------------------------------------------------------------------
def _run_case(rank: int, world: int, case: dict, pair: bool = True) -> list[dict]:
    coll = collectives.get("oktopk", **case["opts"], pair=pair)
    out = []
    for step in case["steps"]:
        res = coll(_selection(case, rank, world, step), step=step)
        out.append({"dense": res.dense, "kept": res.kept, "info": res.info,
                    "sent": res.stats.bytes_sent, "recv": res.stats.bytes_recv,
                    "state": copy.deepcopy(coll.state_dict())})
    return out


def _reuse_case(band: tuple[float, float] | None = (2 / 3, 4 / 3)) -> dict:
    # Gradients shrink 1% a step (threshold nudges must follow), then drop 100× from step 14.
    opts = {"density": 0.02, "tau": 6, "tau_prime": 4}
    return {"name": "reuse", "kind": "laplace", "dtype": "fp32", "seed": 11, "numel": 20_000,
            "kloc": 400, "decay": 0.99, "jump": (14, 0.01), "steps": list(range(16)),
            "opts": opts if band is None else {**opts, "recompute_band": band}}


def _rank_main(rank: int, world: int, cases: list[dict], pair: bool) -> dict:
    out = {"cases": [_run_case(rank, world, c, pair) for c in cases]}
    # Threshold reuse schedule and a state_dict round trip: B resumes from A's state at step 7.
    case = _reuse_case()
    out["reuse"] = _run_case(rank, world, case, pair)
    b = collectives.get("oktopk", **case["opts"], pair=pair)
    b.load_state_dict(copy.deepcopy(out["reuse"][6]["state"]))
    out["resumed"] = [b(_selection(case, rank, world, s), step=s) for s in case["steps"][7:]]
    out["resumed"] = [{"dense": r.dense, "kept": r.kept, "info": r.info} for r in out["resumed"]]
    out["pure"] = _run_case(rank, world, _reuse_case(band=None), pair)  # the paper's reuse
    # Non-finite input on one rank: a ValueError on every rank, nothing hangs.
    bad = _selection(_cases(world)[0], rank, world, 0)
    if rank == world - 1:
        bad.values[0] = float("nan")
    try:
        collectives.get("oktopk", density=0.01, pair=pair)(bad)
        out["nan"] = None
    except ValueError as e:
        out["nan"] = str(e)
    # the same under skip_step: a sum of NaN on every rank, nothing kept, and θ and the
    # boundaries as they were (here: after one good step)
    b = collectives.get("oktopk", density=0.01, nonfinite="skip_step", pair=pair)
    good = _selection(_cases(world)[0], rank, world, 0)
    b(good, step=0)
    before = copy.deepcopy(b.state_dict())
    res = b(bad, step=1)
    out["skip"] = {"all_nan": bool(torch.isnan(res.dense).all()), "n": res.dense.numel(),
                   "kept": res.kept.numel(), "why": res.info.get("nonfinite"),
                   "state_kept": _same_state(before, b.state_dict())}
    return out


@contextlib.contextmanager
def _counting(*names: str) -> Iterator[dict[str, int]]:
    """``Comm``'s methods ``names`` counted while inside (the caller zeroes the counts it
    reads), restored on the way out; yields the counts by name."""
    from gradsync.collectives.comm import Comm

    calls = dict.fromkeys(names, 0)
    real = {name: getattr(Comm, name) for name in names}

    def counted(name: str):
        def call(self, *a, **k):
            calls[name] += 1
            return real[name](self, *a, **k)
        return call

    try:
        for name in names:
            setattr(Comm, name, counted(name))
        yield calls
    finally:
        for name, fn in real.items():
            setattr(Comm, name, fn)


def _same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


@functools.cache
def _results(world: int, pair: bool = True) -> list[dict]:
    return run_distributed(_rank_main, world, _cases(world), pair, timeout=240)


# -- checks ----------------------------------------------------------------------------------
def _check_step(case: dict, world: int, step: int, per_rank: list[dict]) -> None:
    R, union, sels = _reference(case, world, step)
    dtype = DTYPES[case["dtype"]]
    infos = [p["info"] for p in per_rank]
    theta = infos[0]["threshold"]
    assert all(i["threshold"] == theta and i["selected"] == infos[0]["selected"] for i in infos)
    # 1. dense is bitwise identical on every rank.
    d0 = per_rank[0]["dense"]
    assert d0.dtype == dtype and d0.numel() == case["numel"]
    for p in per_rank[1:]:
        assert torch.equal(p["dense"].view(BITS[dtype]), d0.view(BITS[dtype]))
    # 2. its support is what the global threshold admits, with the exact SUM there.
    admitted = union & (R.abs().float() >= theta) if theta > 0 else union.clone()
    assert infos[0]["selected"] == int(admitted.sum())
    assert torch.equal(d0[admitted].view(BITS[dtype]), R[admitted].view(BITS[dtype]))
    assert not bool(d0[~admitted].any())
    # 3. kept = local ∩ global; Σ over ranks of the kept local values == dense there.
    acc = torch.zeros(case["numel"], dtype=torch.float64)
    for s, p in zip(sels, per_rank):
        expect_kept = s.indices[admitted[s.indices]]
        assert torch.equal(p["kept"], expect_kept)
        pos = torch.searchsorted(s.indices, p["kept"])
        acc[p["kept"]] += s.values[pos].double()
    assert torch.equal(acc.to(dtype)[admitted].view(BITS[dtype]),
                       d0[admitted].view(BITS[dtype]))
    # 4. the count: exactly k after an exact evaluation (continuous data); a reused θ keeps it
    # in [lo·k, hi·k] when a recompute band is set, else only within the union (the paper).
    k, u, sel = infos[0]["k"], int(union.sum()), infos[0]["selected"]
    band = case["opts"].get("recompute_band")
    if theta == 0.0:  # the union holds at most k entries: all of them
        assert sel == u and infos[0]["threshold_exact"] and u <= k
    elif infos[0]["threshold_exact"]:
        assert sel == k or (dtype != torch.float32 and k <= sel <= 4 * k / 3)  # bf16/fp16 ties
    elif band is not None:
        assert band[0] * k <= sel <= band[1] * k
    else:
        assert sel <= u


@pytest.mark.usefixtures("kernels")
@pytest.mark.accelerator_at(world=3)
@pytest.mark.parametrize("world, pair", RUNS)
def test_matches_dense_reference(world, pair):
    out = _results(world, pair)
    cases = _cases(world)
    for ci, case in enumerate(cases):
        for si, step in enumerate(case["steps"]):
            per_rank = [out[r]["cases"][ci][si] for r in range(world)]
            try:
                _check_step(case, world, step, per_rank)
            except AssertionError as e:
                raise AssertionError(f"{case['name']} step {step} P={world}: {e}") from e


@pytest.mark.parametrize("world, pair", RUNS)
def test_clustered_selection_triggers_data_balancing(world, pair):
    out = _results(world, pair)
    names = [c["name"] for c in _cases(world)]
    for name in ("clustered-fp32", "clustered-bf16"):
        info = out[0]["cases"][names.index(name)][0]["info"]
        counts = info["counts"]
        if world == 1 or (world == 2 and pair):  # one exchange: nothing to balance
            assert not info["balanced"] and info.get("pair", False) == (world == 2)
            assert counts == [info["selected"]] or world == 1
            continue
        # Balancing runs exactly when the largest count exceeds the factor × the mean.
        factor = 4.0 if world >= 5 else 1.0
        assert info["balanced"] == (max(counts) > factor * sum(counts) / world)
        assert info["balanced"], (name, counts)
        if world >= 5:  # the Fig. 1 band concentrates the global top-k on few ranks
            assert max(counts) > 4 * sum(counts) / world
    # Balanced split: every region receives about the same number of local entries (Fig. 1c).
    heavy = [out[r]["cases"][0][0]["info"]["region_entries"] for r in range(world)]
    assert max(heavy) <= 2 * (sum(heavy) / world) + 10


@pytest.mark.parametrize("world, pair", RUNS[1:])
def test_bytes_within_table1_bound(world, pair):
    """Realistic selections (top-k of heavy-tailed gradients) at a step that reuses the
    boundaries and θ: payload ≤ 6k(P−1)/P words (Table 1; COO = 2 words per entry, i.e.
    3k(P−1)/P entries) + O(P) control words; some rank receives ≥ the Theorem 3.1 bound."""
    out = _results(world, pair)
    for ci in (0, 1):  # heavy fp32, heavy bf16
        case = _cases(world)[ci]
        eb = 4 + torch.empty(0, dtype=DTYPES[case["dtype"]]).element_size()
        per_rank = [out[r]["cases"][ci][1] for r in range(world)]
        info = per_rank[0]["info"]
        assert not info["threshold_exact"] and not info["boundaries_recomputed"]
        assert info.get("pair", False) == (world == 2 and pair)
        k, sel = info["k"], info["selected"]
        control = 8 * (4 * world + 8)  # sizes, counts, shape check: O(P) words
        for p in per_rank:
            assert p["sent"] <= 3 * k * (world - 1) / world * eb + control, (p["sent"], k)
        lower = sel * (world - 1) / world * eb  # Theorem 3.1 (2 words per entry)
        assert max(p["recv"] for p in per_rank) >= lower


@pytest.mark.parametrize("world, pair", [RUNS[0], RUNS[1], RUNS[3]])
def test_threshold_reuse_schedule_and_state_round_trip(world, pair):
    out = _results(world, pair)
    case = _reuse_case()
    steps = case["steps"]
    reuse = [[out[r]["reuse"][i] for r in range(world)] for i in range(len(steps))]
    for i, step in enumerate(steps):
        _check_step(case, world, step, reuse[i])
    infos = [reuse[i][0]["info"] for i in range(len(steps))]
    reasons = {s: i["threshold_reason"] for s, i in zip(steps, infos) if i["threshold_exact"]}
    # τ′ = 4: exact θ at 0, 4, 8, 12; the 100× drop at step 14 forces one out-of-range recompute.
    assert reasons == {0: "periodic", 4: "periodic", 8: "periodic", 12: "periodic",
                       14: "out_of_range"}
    # τ = 6: boundaries at 0, 6, 12 only, reused (unchanged) in between; one exchange at
    # P = 2 needs none
    recomputed = [s for s, i in zip(steps, infos) if i["boundaries_recomputed"]]
    assert recomputed == ([] if world == 2 else [0, 6, 12])
    assert infos[1]["boundaries"] == infos[5]["boundaries"]
    assert reuse[-1][0]["state"]["exact_evaluations"] == 5
    assert reuse[-1][0]["state"]["boundary_evaluations"] == (0 if world == 2 else 3)
    # Between exact evaluations θ is reused and nudged: shrinking gradients lower it.
    nudged = [i for i in infos if i["next_threshold"] < i["threshold"]]
    assert nudged, "the 1%/step decay should have nudged θ down at least once"
    for i in infos:
        assert 2 * i["k"] / 3 <= i["selected"] <= 4 * i["k"] / 3
    # The default (no band, the paper's reuse): θ is exact only on the τ′ schedule; after the
    # 100× drop the reused θ admits almost nothing until the next exact evaluation (step 16).
    pure = [[out[r]["pure"][i] for r in range(world)] for i in range(len(steps))]
    for i, step in enumerate(steps):
        _check_step(_reuse_case(band=None), world, step, pure[i])
    pinfos = [pure[i][0]["info"] for i in range(len(steps))]
    assert {s: i["threshold_reason"] for s, i in zip(steps, pinfos) if i["threshold_exact"]} \
        == {0: "periodic", 4: "periodic", 8: "periodic", 12: "periodic"}
    assert pure[-1][0]["state"]["exact_evaluations"] == 4
    assert pinfos[14]["selected"] < 2 * pinfos[14]["k"] / 3
    # The resumed collective continues bit for bit.
    for j, step in enumerate(steps[7:]):
        for r in range(world):
            a, b = out[r]["reuse"][7 + j], out[r]["resumed"][j]
            assert torch.equal(a["dense"], b["dense"]), step
            assert torch.equal(a["kept"], b["kept"]), step
            assert a["info"] == b["info"], step


@pytest.mark.parametrize("world", [2, 3])
def test_nonfinite_input_raises_on_every_rank(world):
    msgs = [o["nan"] for o in _results(world)]
    assert all(m is not None and f"selection on ranks [{world - 1}]," in m for m in msgs), msgs
    assert msgs[0] == msgs[-1]


@pytest.mark.parametrize("world", [2, 3])
def test_nonfinite_input_under_skip_step_gives_nan_on_every_rank_and_keeps_the_state(world):
    """``nonfinite="skip_step"`` (what the engine passes under that policy, so that a loss
    scaler's overflow skips the step instead of failing it): the same finding as above, but a
    sum of NaN on every rank for the owner to skip, nothing kept, θ and boundaries unchanged."""
    outs = [o["skip"] for o in _results(world)]
    n = _selection(_cases(world)[0], 0, world, 0).numel
    for o in outs:
        assert o["all_nan"] and o["n"] == n and o["kept"] == 0, o
        assert f"selection on ranks [{world - 1}]," in o["why"] and o["state_kept"], o
    with pytest.raises(ValueError, match="nonfinite must be 'raise' or 'skip_step'"):
        collectives.get("oktopk", density=0.01, nonfinite="ignore")


def _tampered(rank: int, world: int, where: str) -> dict:
    """One call of Ok-Topk whose gathered global selection (``where="gathered"``: every rank
    receives the same corrupted block) or a peer's split-and-reduce message to rank 0
    (``"peer"``) carries an index outside its range."""
    from gradsync.collectives import comm as comm_mod
    from gradsync.collectives import oktopk as ok_mod

    n = 1000
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(n, generator=g)
    sel = SparseGrad.from_indices(x, x.abs().topk(50).indices)
    if where == "gathered":  # the allgatherv's blocks, or its bounded ones with their heads
        real, real_bounded = comm_mod.Comm.all_gather_v, comm_mod.Comm.all_gather_bounded
        head = (4 + world) * 8

        def corrupt(blocks, skip):
            first = next(b for b in blocks if b.numel() > skip)
            first[skip:skip + 4] = torch.tensor([n + 7], dtype=torch.int32).view(torch.uint8)
            return blocks
        comm_mod.Comm.all_gather_v = lambda self, buf, sizes: corrupt(real(self, buf, sizes), 0)
        comm_mod.Comm.all_gather_bounded = lambda self, *a, **k: corrupt(
            real_bounded(self, *a, **k), head)
    else:
        real_unpack = ok_mod.unpack_entries

        def unpack(buf, count, *args):
            i, v = real_unpack(buf, count, *args)
            if rank == 0 and i.numel():
                i = i.clone()
                i[0] = -3  # below rank 0's region
            return i, v
        ok_mod.unpack_entries = unpack
    try:
        collectives.get("oktopk", k=40, pair=False)(sel, step=0)
        return {"error": None}
    except ValueError as e:  # anything else (a scatter out of range) fails the test
        return {"error": str(e)}
    finally:
        if where == "gathered":
            comm_mod.Comm.all_gather_v, comm_mod.Comm.all_gather_bounded = real, real_bounded
        else:
            ok_mod.unpack_entries = real_unpack


@pytest.mark.parametrize("world", [2, 3, 5])  # 5: the counts in an all-gather of their own
def test_malformed_wire_indices_raise_and_write_nowhere(world):
    """Ok-Topk checks the indices it receives on the device (no read; the caller reads the
    checks with its own) and moves a bad one into range before writing: an index outside the
    tensor in the gathered selection raises on every rank, one below rank 0's region in a
    peer's message raises on rank 0, and on the others through rank 0's verdict in its head
    (module doc, 7.); neither crashes in a scatter."""
    out = run_distributed(_tampered, world, "gathered")
    assert all(o["error"] is not None and "gathered global selection" in o["error"]
               for o in out), out
    out = run_distributed(_tampered, world, "peer")
    assert out[0]["error"] is not None and "a peer's entries" in out[0]["error"], out
    assert all("another rank received a malformed message (ranks [0]" in o["error"]
               for o in out[1:]), out


# -- indices above 2**24 (float32 cannot hold them) ------------------------------------------
def _tail_rank(rank: int, world: int, case: dict) -> dict:
    res = collectives.get("oktopk", k=8)(_selection(case, rank, world, 0))
    nz = res.dense.nonzero().view(-1)
    return {"idx": nz, "val": res.dense[nz], "kept": res.kept, "info": res.info}


@pytest.mark.usefixtures("kernels")
@pytest.mark.accelerator_at(world=3)
@pytest.mark.parametrize("world", [2, 3])
def test_indices_above_2_pow_24_are_exact(world):
    case = {"kind": "tail", "numel": 2**24 + 9, "kloc": 4, "dtype": "fp32", "seed": 0}
    out = run_distributed(_tail_rank, world, case, timeout=240)
    acc: dict[int, float] = {}
    sels = [_selection(case, r, world, 0) for r in range(world)]
    for s in sels:
        for i, v in zip(s.indices.tolist(), s.values.tolist()):
            acc[i] = acc.get(i, 0.0) + v
    top = sorted(acc, key=lambda i: -abs(acc[i]))[:8]
    theta = sorted((abs(v) for v in acc.values()), reverse=True)[min(8, len(acc)) - 1]
    expect = sorted(i for i in acc if abs(acc[i]) >= theta and acc[i] != 0.0)
    assert set(top) <= set(expect)
    assert any(i > 2**24 and i % 2 == 1 for i in expect)  # not representable in float32
    for o in out:
        assert o["idx"].tolist() == expect
        assert o["val"].tolist() == [acc[i] for i in expect]
    for s, o in zip(sels, out):
        assert o["kept"].tolist() == [i for i in s.indices.tolist() if i in set(expect)]


# -- single process: argument and state validation -------------------------------------------
@pytest.mark.parametrize("opts, match", [
    ({"density": 0.0}, "density"), ({"density": 1.5}, "density"), ({"k": 0}, "k must"),
    ({"density": 0.1, "k": 3}, "not both"), ({"tau": 0}, "tau"), ({"tau_prime": 2.5}, "tau_prime"),
    ({"bucket": 0}, "bucket"), ({"balance_factor": 0.5}, "balance_factor"),
    ({"nudge": 0.0}, "nudge"), ({"recompute_band": (1.2, 2.0)}, "recompute_band"),
    ({"recompute_band": (0.5, 0.9)}, "recompute_band"), ({"recompute_band": 3}, "pair"),
    ({"recompute_band": (0.5, float("inf"))}, "recompute_band"),
])
def test_bad_options_raise(opts, match):
    with pytest.raises(ValueError, match=match):
        collectives.get("oktopk", **opts)


def test_bad_state_raises_and_good_state_round_trips():
    c = collectives.get("oktopk", density=0.1)
    x = torch.randn(100, generator=torch.Generator().manual_seed(0))
    c(SparseGrad.from_indices(x, x.abs().topk(10).indices), step=0)
    state = c.state_dict()
    with pytest.raises(ValueError, match="state keys"):
        c.load_state_dict({"theta": 1.0})
    with pytest.raises(ValueError, match="boundaries"):
        c.load_state_dict({**state, "boundaries": [0, 100]})
    d = collectives.get("oktopk", density=0.1)
    d.load_state_dict(state)
    assert d.state_dict()["theta"] == state["theta"]
    assert torch.equal(d.state_dict()["boundaries"], state["boundaries"])
    with pytest.raises(ValueError, match="SparseGrad"):
        c(x)


# -- the balanced split and its period rule (collectives/regions.py, shared with DenseStream) --
def test_period_rule_is_algorithm_1s_every_tau_steps():
    """Ok-Topk Algorithm 1 re-evaluates when (t − 1) mod τ == 0, t = step + 1: steps 0, τ, 2τ…"""
    tau = 64

    def run(steps):
        last, at = None, []
        for s in steps:
            if due(s, last, tau):
                at.append(s)
                last = s
        return at

    steps = list(range(300))
    assert run(steps) == [s for s in steps if s % tau == 0] == [0, 64, 128, 192, 256]
    # A skipped step (e.g. a non-finite gradient at step 64) does not skip the re-evaluation.
    assert run([s for s in steps if s != 64]) == [0, 65, 128, 192, 256]
    # The first call evaluates whatever the step; a step earlier than the last evaluation (a new
    # run, an older checkpoint) evaluates again, even inside the same τ-window; a step that is
    # only earlier than the previous call does not.
    assert run([70, 71, 65, 66, 130]) == [70, 65, 130]
    assert run([70, 75, 72, 127]) == [70]
    assert due(0, None, 1) and due(5, 4, 1) and not due(4, 4, 1)


class _Votes:
    """A stand-in for Comm over ``P`` ranks whose all-reduce returns the SUM of the ranks'
    words, which the test collects in a first pass (the split is deterministic)."""

    def __init__(self, P: int, total: torch.Tensor | None = None) -> None:
        self.size, self.total, self.seen = P, total, None

    def all_reduce(self, t: torch.Tensor) -> None:
        self.seen = t.clone()
        if self.total is not None:
            t.copy_(self.total)


@pytest.mark.parametrize("P", [1, 2, 3, 4, 7])
def test_balanced_boundaries_match_a_plain_python_reference(P):
    n = 10_007
    g = torch.Generator().manual_seed(P)
    sels = []
    for r in range(P):
        m = 0 if r == 1 else int(torch.randint(1, 400, (1,), generator=g))  # rank 1: no vote
        sels.append(torch.sort(torch.randperm(n, generator=g)[:m]).values)
    words = []
    for idx in sels:
        c = _Votes(P)
        balanced_boundaries(idx, n, P, c)
        words.append(c.seen)
    total = torch.stack(words).sum(0)
    got = [balanced_boundaries(idx, n, P, _Votes(P, total)) for idx in sels]
    # Reference: each voting rank's cut points idx[j·m // P], averaged with floor division.
    votes = [[int(idx[j * len(idx) // P]) for j in range(1, P)] for idx in sels if len(idx)]
    cuts = [sum(v[j] for v in votes) // len(votes) for j in range(P - 1)]
    ref = [0, *cuts, n]
    for b in got:
        assert b.dtype == torch.int64 and b.device.type == "cpu" and b.tolist() == ref
    # Nobody selected anything: an even split.
    empty = torch.empty(0, dtype=torch.int64)
    even = balanced_boundaries(empty, n, P, _Votes(P, torch.zeros(P, dtype=torch.int64)))
    assert even.tolist() == [j * n // P for j in range(P + 1)]
    with pytest.raises(ValueError, match="too large"):
        balanced_boundaries(empty, 2**62, P + 1, _Votes(P + 1))


def test_k_from_density_is_target_k_and_an_empty_tensor_selects_nothing():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    sel = SparseGrad.from_indices(x, x.abs().topk(40).indices)
    for d in (0.011, 0.02, 0.0004):
        res = collectives.get("oktopk", density=d)(sel, step=0)
        assert res.info["k"] == target_k(1000, d)
    res = collectives.get("oktopk", density=0.5)(SparseGrad.empty(0), step=0)
    assert res.info["k"] == 0 and res.dense.numel() == 0 and res.kept.numel() == 0
    assert res.info["threshold"] == 0.0


# -- the engine's oktopk scheme: local selection by threshold reuse (Algorithm 1 lines 2–4) --
def _engine_oktopk(rank, world_size, tau_prime, steps, resume_at):
    import gradsync.engine.consistency
    from conftest import image_batch
    from gradsync.apps.models import build
    from gradsync.engine import GradSync
    from gradsync.engine.config import Config

    def make():
        model = build("mlp", seed=1)
        # compress_single_rank: world size 1 selects too (by default it would be plain training)
        cfg = Config(scheme="oktopk", density=0.01, local_tau_prime=tau_prime, warmup_steps=1,
                     compress_single_rank=True, density_warmup=())  # one k throughout
        return model, GradSync(model, cfg)

    def step(model, sync, s):
        model.zero_grad()
        x, y = image_batch(rank, s, 16)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        sync.synchronize()
        (key, sp), = [(k, v) for k, v in sync._parts.sparsifiers.items()
                      if k.startswith("buffer:")]
        return {"key": key, "name": sp.name, "clock": getattr(sp, "clock", None),
                "period": getattr(sp, "period", None), "exact": getattr(sp, "last_exact", None),
                "count": sp.last_count, "k": sp.last_k, "thr": getattr(sp, "thr", None)}

    model, sync = make()
    log, saved = [], None
    for s in range(steps):
        log.append(step(model, sync, s))
        if s == resume_at:
            saved = (copy.deepcopy(model.state_dict()), sync.state_dict())
    final = gradsync.engine.consistency.parameter_digest(model)[0]
    sync.close()
    model2, sync2 = make()
    model2.load_state_dict(saved[0])
    sync2.load_state_dict(saved[1])
    log2 = [step(model2, sync2, s) for s in range(resume_at + 1, steps)]
    resumed = gradsync.engine.consistency.parameter_digest(model2)[0]
    sync2.close()
    return log, log2, final == resumed


@pytest.mark.usefixtures("kernels")
@pytest.mark.accelerator_at(world=2)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_engine_oktopk_reuses_the_local_threshold_between_exact_steps(world):
    tau, steps, resume_at = 4, 11, 5
    out = run_distributed(_engine_oktopk, world, tau, steps, resume_at, timeout=300)
    for log, log2, same in out:
        assert {e["name"] for e in log} == {"threshold"}
        assert {(e["clock"], e["period"]) for e in log} == {("step", tau)}
        exact = [s for s, e in enumerate(log) if e["exact"]]
        # Algorithm 1 line 2: exact when t mod τ′ = 0, reused in between (these gradients
        # never push the nudged count out of [2k/3, 4k/3], which would force a recompute)
        assert exact == [0, 4, 8]
        for e in log:
            if e["exact"]:
                assert e["count"] == e["k"]
            else:
                assert 2 * e["k"] <= 3 * e["count"] <= 4 * e["k"]
        # the threshold and its counters travel in state_dict: the resumed run is the same
        assert log2 == log[resume_at + 1:]
        assert same


def test_engine_oktopk_threshold_reuse_is_configurable():
    from gradsync.engine.components import Components
    from gradsync.engine.config import Config

    parts = Components(Config(scheme="oktopk", local_tau_prime=7), 0)
    sp = parts.sparsifier("buffer:0", 0.01)
    assert (sp.name, sp.period, sp.clock) == ("threshold", 7, "step")
    off = Components(Config(scheme="oktopk", local_tau_prime=0, sparsifier="topk"), 0)
    assert off.sparsifier("buffer:0", 0.01).name == "topk"
    # other schemes keep Config.sparsifier
    assert Components(Config(scheme="topka"), 0).sparsifier("buffer:0", 0.01).name == "dgc"
    for bad in (-1, 1.5, "4", True):
        with pytest.raises(ValueError, match="local_tau_prime"):
            Config(scheme="oktopk", local_tau_prime=bad)


# -- the counts inside the split-and-reduce messages (gloo) -------------------------------------
def _rank_rounds(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """Each case's steps with the counts inside the messages (gloo's bounded receives) and
    with them in a round of their own (``BOUNDED_MAX`` 0), on fresh collectives."""
    from gradsync.collectives import oktopk as ok_mod

    bound, out = ok_mod.BOUNDED_MAX, []
    try:
        for case in cases:
            row = {}
            for mode, limit in (("one", bound), ("two", 0)):
                ok_mod.BOUNDED_MAX = limit
                row[mode] = _run_case(rank, world, case, pair=False)
                coll = collectives.get("oktopk", **case["opts"], pair=False)
                res = coll(_selection(case, rank, world, case["steps"][0]),
                           step=case["steps"][0])
                row[mode + "_messages"] = res.stats.messages
            out.append(row)
    finally:
        ok_mod.BOUNDED_MAX = bound
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_counts_inside_the_messages_send_the_same_bytes_and_bits(world):
    """Split and reduce on gloo: each message carries its count, so the counts' round goes,
    with the same bytes sent and received, the same sum, selection and state bit for bit, and
    no more messages on any rank, fewer in all (a peer's count and entries in one)."""
    cases = _cases(world)
    per_rank = run_distributed(_rank_rounds, world, cases, timeout=240)
    for c, case in enumerate(cases):
        for r in range(world):
            one, two = per_rank[r][c]["one"], per_rank[r][c]["two"]
            what = f"P={world} rank {r} {case['name']}"
            for a, b in zip(one, two, strict=True):
                assert torch.equal(a["dense"].view(BITS[a["dense"].dtype]),
                                   b["dense"].view(BITS[b["dense"].dtype])), what
                assert torch.equal(a["kept"], b["kept"]), what
                assert (a["sent"], a["recv"]) == (b["sent"], b["recv"]), what
                assert _same_state(a["state"], b["state"]), what
            assert per_rank[r][c]["one_messages"] <= per_rank[r][c]["two_messages"], what
        if case["kind"] != "empty_all":  # a rank with entries to send saves a message a peer
            assert sum(per_rank[r][c]["one_messages"] for r in range(world)) < sum(
                per_rank[r][c]["two_messages"] for r in range(world)), case["name"]


def _overcounted(rank: int, world: int) -> str:
    """Rank 0 receives, from rank 1, a count of more entries than its region holds."""
    from gradsync.collectives.comm import Comm

    real = Comm.irecv_bounded

    class Corrupted:
        def __init__(self, work, buf):
            self.work, self.buf = work, buf

        def wait(self):
            self.work.wait()
            self.buf[:8] = torch.tensor([10_000], dtype=torch.int64).view(torch.uint8)
            return True

    def irecv_bounded(self, buf, src):
        work = real(self, buf, src)
        return Corrupted(work, buf) if rank == 0 else work

    return _one_call(rank, Comm, "irecv_bounded", irecv_bounded)


def _one_call(rank: int, owner: type, name: str, replacement, pair: bool = False) -> str:
    """One Ok-Topk call (k = 40) on this rank's top 50 of 1000 with ``owner.name`` replaced:
    ``"ok"``, or the ``ValueError``'s message."""
    n = 1000
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(n, generator=g)
    sel = SparseGrad.from_indices(x, x.abs().topk(50).indices)
    real = getattr(owner, name)
    setattr(owner, name, replacement)
    try:
        collectives.get("oktopk", k=40, pair=pair)(sel, step=0)
        return "ok"
    except ValueError as e:
        return str(e)
    finally:
        setattr(owner, name, real)


def test_a_count_beyond_the_region_fails_the_receiving_rank():
    """A message that announces more entries than the receiver's region can hold fails that
    rank's checks (``ValueError`` naming the sender) once the collective is done: nothing is
    unpacked from it, and its peer, which received well-formed messages, finishes the call and
    fails too, told by the receiver's verdict in its head (module doc, 7.)."""
    out = run_distributed(_overcounted, 2, timeout=120)
    assert "rank 1's message announces 10000 entries" in out[0], out
    assert "another rank received a malformed message (ranks [0]" in out[1], out


# -- the counts inside the allgatherv's blocks (gloo, P <= balance_factor) ----------------------
def _rank_inline(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """Each case with the counts inside the allgatherv's blocks (the default here) and in an
    all-gather of their own (``_counts_inline`` off), on fresh collectives, with the calls of
    ``Comm.all_gather`` and the ring's receives counted."""
    from gradsync.collectives import oktopk as ok_mod

    inline, out = ok_mod.OkTopk._counts_inline, []
    with _counting("all_gather", "all_gather_bounded") as calls, contextlib.ExitStack() as undo:
        undo.callback(setattr, ok_mod.OkTopk, "_counts_inline", inline)
        for case in cases:
            row = {}
            for mode in ("inline", "counts"):
                if mode == "counts":
                    ok_mod.OkTopk._counts_inline = lambda *a: False
                for name in calls:
                    calls[name] = 0
                row[mode] = _run_case(rank, world, case, pair=False)
                row[mode + "_calls"] = dict(calls)
                ok_mod.OkTopk._counts_inline = inline
            out.append(row)
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
def test_counts_inside_the_allgatherv_send_the_same_bytes_and_bits_in_one_call_fewer(world):
    """Where data balancing cannot run (P <= balance_factor) and gloo's receives may be longer
    than their messages, each region's selected entries travel with their counts, non-finite
    flags and per-source counts ahead: no all-gather of the counts, the same bytes sent and
    received, the same sum, kept entries, selection and state bit for bit. The cases that
    balance (balance_factor 1) keep the counts' all-gather, which balancing needs first."""
    cases = _cases(world)
    per_rank = run_distributed(_rank_inline, world, cases, timeout=300)
    for c, case in enumerate(cases):
        balances = case["opts"].get("balance_factor", 4.0) < world
        for r in range(world):
            row = per_rank[r][c]
            what = f"P={world} rank {r} {case['name']}"
            for a, b in zip(row["inline"], row["counts"], strict=True):
                assert torch.equal(a["dense"].view(BITS[a["dense"].dtype]),
                                   b["dense"].view(BITS[b["dense"].dtype])), what
                assert torch.equal(a["kept"], b["kept"]), what
                assert (a["sent"], a["recv"]) == (b["sent"], b["recv"]), what
                assert _same_state(a["state"], b["state"]), what
                assert (a["info"]["counts"], a["info"]["selected"]) == (
                    b["info"]["counts"], b["info"]["selected"]), what
            steps = len(case["steps"])
            # the exact θ's all-gather (k magnitudes) in the steps that compute it
            exact = sum(1 for a in row["counts"] if a["info"]["threshold_exact"])
            assert exact == sum(1 for a in row["inline"] if a["info"]["threshold_exact"]) >= 1
            assert row["counts_calls"] == {"all_gather": steps + exact,
                                           "all_gather_bounded": 0}, what
            assert row["inline_calls"] == ({"all_gather": steps + exact, "all_gather_bounded": 0}
                                           if balances else
                                           {"all_gather": exact, "all_gather_bounded": steps}), what


def _overcounted_block(rank: int, world: int) -> str:
    """Rank 1's allgatherv block reaches its peers announcing more selected entries than its
    region holds (rank 1's own copy is well formed)."""
    from gradsync.collectives.comm import Comm

    real, first = Comm.sendrecv_bounded, [True]

    def sendrecv_bounded(self, send, dst, buf, src, size_of):
        def tampered(b):  # the ring's first step from rank 1 brings rank 1's own block
            if src == 1 and first[0]:
                b[:8] = torch.tensor([50_000], dtype=torch.int64).view(torch.uint8)
            first[0] = first[0] and src != 1
            return size_of(b)
        return real(self, send, dst, buf, src, tampered)

    return _one_call(rank, Comm, "sendrecv_bounded", sendrecv_bounded)


@pytest.mark.parametrize("world", [2, 3])
def test_a_block_count_beyond_its_region_fails_every_rank_that_receives_it(world):
    """A block that announces more entries than its region can hold fails the checks of every
    rank that receives it (``ValueError`` naming the block's rank, once the collective is
    done; nothing unpacked from it), and the ring goes on: no rank hangs, its sender finishes."""
    out = run_distributed(_overcounted_block, world, timeout=120)
    for r in range(world):
        if r == 1:
            assert out[r] == "ok", out
        else:
            assert "rank 1's block announces 50000 selected entries" in out[r], out


# -- the exact threshold: one all-gather of the regions' k largest, or the radix select ------
def _region_mags(rank: int, case: str) -> torch.Tensor:
    """Rank ``rank``'s reduced-region magnitudes (float32) for a threshold case."""
    g = torch.Generator().manual_seed(100 + rank)
    if case == "empty_rank" and rank == 1:
        return torch.empty(0)
    m = torch.rand(50 + 37 * rank, generator=g)
    if case == "ties":
        m = (m * 4).floor() / 4  # five distinct values, many of each
    if case == "nonfinite":
        m[::7] = float("nan")
        m[3::11] = float("inf")
    if case == "zeros":
        m[: m.numel() // 2] = 0.0
    return m


def _thresholds(rank: int, world: int, cases: list[tuple[str, int]]) -> list[tuple[float, ...]]:
    from gradsync.collectives import oktopk as ok_mod
    from gradsync.collectives.comm import Comm

    out, limit = [], ok_mod.EXACT_GATHER_MAX
    try:
        for case, k in cases:
            mags, got = _region_mags(rank, case), []
            for gather_max in (limit, 0):  # the all-gather, then the radix select
                ok_mod.EXACT_GATHER_MAX = gather_max
                c = Comm()
                got += [ok_mod.OkTopk(density=0.01)._exact_threshold(mags, k, c),
                        c.stats.messages]
            out.append(tuple(got))
    finally:
        ok_mod.EXACT_GATHER_MAX = limit
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
def test_the_exact_threshold_by_one_all_gather_equals_the_radix_selects(world):
    """θ is the k-th largest finite magnitude of the union of the regions (0.0 when fewer than
    k): computed in the parent from every rank's magnitudes, it is what both the all-gather of
    each region's k largest and the radix select return, on every rank; the all-gather takes
    its ⌈log2 P⌉ rounds (the ring's P − 1 at P ≤ 3), the radix select 4 all-reduces."""
    cases = [("plain", 1), ("plain", 10), ("plain", 60), ("ties", 25), ("nonfinite", 40),
             ("zeros", 200), ("empty_rank", 30), ("plain", 10_000)]
    per_rank = run_distributed(_thresholds, world, cases, timeout=120)
    for i, (case, k) in enumerate(cases):
        union = torch.cat([_region_mags(r, case) for r in range(world)])
        union = union[torch.isfinite(union)]
        want = float(union.sort(descending=True).values[k - 1]) if union.numel() >= k else 0.0
        for r in range(world):
            gathered, g_msgs, radix, r_msgs = per_rank[r][i]
            assert gathered == radix == want, (case, k, r, gathered, radix, want)
            assert g_msgs == (world - 1 if world <= 3 else (world - 1).bit_length())
            # 4 all-reduces (ring accounting: 2(P − 1) messages each), fewer when the union
            # holds fewer than k entries (one round shows it)
            assert r_msgs == (4 if union.numel() >= k else 1) * 2 * (world - 1)


# -- P = 2 in one exchange (module doc, 6.) ----------------------------------------------------
def _rank_pair(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """Each case's steps in one exchange and by the rounds (``pair=False``), on fresh
    collectives, with the Comm calls of each counted."""
    out = []
    with _counting("all_gather", "all_gather_bounded", "all_reduce") as calls:
        for case in cases:
            row = {}
            for mode, pair in (("pair", True), ("rounds", False)):
                for name in calls:
                    calls[name] = 0
                row[mode] = _run_case(rank, world, case, pair)
                row[mode + "_calls"] = dict(calls)
            row["sizes"] = [len(_selection(case, rank, world, s)) for s in case["steps"]]
            out.append(row)
    return out


def test_pair_exchange_is_the_rounds_bit_for_bit_in_one_call():
    """At P = 2 on gloo both ranks exchange their whole selections once and reduce both
    regions themselves: the same sum, kept entries, selection and θ (and its schedule) bit
    for bit as the rounds, in one bounded all-gather a step (plus the shape check's
    all-reduce): no boundaries' all-reduce, no exact θ's all-gather, no counts; each rank
    sends its count and its entries, nothing else."""
    cases = [*_cases(2), _reuse_case()]
    per_rank = run_distributed(_rank_pair, 2, cases, timeout=240)
    for c, case in enumerate(cases):
        eb = 4 + torch.empty(0, dtype=DTYPES[case["dtype"]]).element_size()
        steps = len(case["steps"])
        for r in range(2):
            row, what = per_rank[r][c], f"rank {r} {case['name']}"
            for a, b in zip(row["pair"], row["rounds"], strict=True):
                assert torch.equal(a["dense"].view(BITS[a["dense"].dtype]),
                                   b["dense"].view(BITS[b["dense"].dtype])), what
                assert torch.equal(a["kept"], b["kept"]), what
                for key in ("k", "threshold", "threshold_exact", "threshold_reason",
                            "next_threshold", "selected"):
                    assert a["info"][key] == b["info"][key], (what, key)
                assert a["info"]["pair"] and "pair" not in b["info"], what
                for key in ("theta", "theta_step", "exact_evaluations"):
                    assert a["state"][key] == b["state"][key], (what, key)
            # the shape check's all-reduce (and, with neither k nor density, k's own)
            ask = 1 if {"k", "density"} & set(case["opts"]) else 2
            assert row["pair_calls"] == {"all_gather": 0, "all_gather_bounded": steps,
                                         "all_reduce": ask * steps}, what
            assert row["rounds_calls"]["all_gather_bounded"] + row["rounds_calls"][
                "all_gather"] >= steps, what
            extra = [a["sent"] - 8 - size * eb for a, size in zip(row["pair"], row["sizes"])]
            # the shape check's 4 words (ring accounting at P = 2: each rank sends 32 bytes)
            # and k's one word
            assert extra == [32 + 8 * (ask - 1)] * steps, (what, extra)


def _pair_tampered(rank: int, world: int, where: str) -> str:
    """One exchange at P = 2 whose block from rank 1 reaches rank 0 announcing more entries
    than the tensor holds (``"count"``), or holding an index outside it (``"index"``)."""
    from gradsync.collectives import oktopk as ok_mod
    from gradsync.collectives.comm import Comm

    if where == "count":
        real = Comm.sendrecv_bounded

        def sendrecv_bounded(self, send, dst, buf, src, size_of):
            def tampered(b):
                if rank == 0:
                    b[:8] = torch.tensor([50_000], dtype=torch.int64).view(torch.uint8)
                return size_of(b)
            return real(self, send, dst, buf, src, tampered)
        return _one_call(rank, Comm, "sendrecv_bounded", sendrecv_bounded, pair=True)

    real_unpack, calls = ok_mod.unpack_entries, []

    def unpack(buf, count, *args):  # rank 0 unpacks its own block, then rank 1's
        i, v = real_unpack(buf, count, *args)
        calls.append(count)
        if rank == 0 and len(calls) == 2 and i.numel():
            i = i.clone()
            i[-1] = 1000 + 7  # past the tensor
        return i, v
    return _one_call(rank, ok_mod, "unpack_entries", unpack, pair=True)


@pytest.mark.parametrize("where, message", [
    ("count", "rank 1's selection announces 50000 entries for a tensor of 1000"),
    ("index", "rank 1's selection (step 0): indices must be strictly increasing in [0, 1000)"),
])
def test_a_malformed_block_of_the_pair_exchange_fails_the_rank_that_receives_it(where, message):
    """A block that announces more entries than the tensor holds, or holds an index outside
    it, fails the checks of the rank that receives it (``ValueError`` naming the sender, once
    the collective is done; nothing written from it), and its sender finishes."""
    out = run_distributed(_pair_tampered, 2, where, timeout=120)
    assert message in out[0], out
    assert out[1] == "ok", out
