"""The generic collective suite: every registered collective against an independent reference.

One ``run_distributed`` call per world size P ∈ {1, 2, 3, 4, 5, 8}: the rank function loops over
every collective, fp32 and bf16, and every selection case, and returns all results. The parent
regenerates each rank's selection from its seed and sums them with plain torch (float64).
Values are multiples of 1/2 of magnitude ≤ 8, so with P ≤ 8 every partial sum is exact in fp32
and bf16 and bitwise comparison against the reference is meaningful.

Checks (docs/architecture.md, "Contracts"): exact collectives return the SUM and keep every
local index; non-exact ones (``exact = False``) return a sum of kept entries (Σ over ranks of
the kept entries == ``dense``: conservation), supported on the union of the selections;
``dense`` is bitwise identical on all ranks; ``kept`` ⊆ local indices; every byte sent is received;
mismatched ``numel`` or dense prefixes raise ``ValueError`` on every rank; a selection with a
dense prefix (the "prefix" case) reduces like any other. At P ∈ {2, 4, 8} the bytes of TopkA,
TopkDSA and gTop-k are checked against Ok-Topk Table 1, and TopkA's dense prefix travels
without its indices.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import traceback

import pytest
import torch

import gradsync.collectives as collectives
from gradsync.sparsegrad import SparseGrad, target_k
from gradsync.testing import run_distributed
from gradsync.testing.distributed import caller_kernels

# Import every collective module that exists in the tree (they self-register).
for _mod in ("dense", "topka", "topkdsa", "gtopk", "oktopk", "densestream", "lhc", "spardl"):
    if importlib.util.find_spec(f"gradsync.collectives.{_mod}") is not None:
        importlib.import_module(f"gradsync.collectives.{_mod}")

NAMES = collectives.names()
WORLD_SIZES = [1, 2, 3, 8]  # the sizes whose code differs: one rank, two, not a power of two, 8
DTYPES = [torch.float32, torch.bfloat16]
# gTop-k drops an entry at an inner merge of its tree even if the same index re-enters from
# another subtree, so its values at the support are partial sums (of the kept entries), not the
# full SUM; SparDL's re-sparsification after each addition does the same to partial sums of
# its blocks. Every other non-exact collective reduces its selected indices completely.
PARTIAL_AT_SUPPORT = {"gtopk", "spardl"}

# case name → numel (7 cases; numel not divisible by P, and one smaller than P)
CASES = {
    "overlap": 997,
    "disjoint": 997,
    "clustered": 1001,
    "some_empty": 998,
    "all_empty": 513,
    "dense_ish": 301,
    "tiny": 3,
    "prefix": 600,
}


def selection(case: str, rank: int, P: int, dtype: torch.dtype) -> SparseGrad:
    """Rank ``rank``'s selection for ``case``: a pure function of its arguments (seeded)."""
    n = CASES[case]
    g = torch.Generator().manual_seed(1000 * list(CASES).index(case) + 10 * P + rank)
    if case == "overlap":  # random, plus a block that every rank selects
        idx = torch.cat([torch.randperm(n, generator=g)[:100], torch.arange(20)])
    elif case == "disjoint":  # rank r: a random half of the indices ≡ r (mod P)
        own = torch.arange(rank, n, P)
        idx = own[torch.randperm(own.numel(), generator=g)[: own.numel() // 2]]
    elif case == "clustered":  # everyone inside [500, 540)
        idx = 500 + torch.randperm(40, generator=g)[:25]
    elif case == "some_empty":  # odd ranks select nothing
        idx = torch.randperm(n, generator=g)[:80] if rank % 2 == 0 else torch.empty(0)
    elif case == "all_empty":
        idx = torch.empty(0)
    elif case == "dense_ish":  # 2/3 of the tensor per rank: forces fill-in
        idx = torch.randperm(n, generator=g)[:200]
    elif case == "tiny":  # numel 3 < P for P ≥ 4
        idx = torch.randperm(n, generator=g)[: int(torch.randint(0, 4, (1,), generator=g))]
    elif case == "prefix":  # tensors sent whole at the front (dense_prefix), then sparse ones
        idx = torch.cat([torch.arange(PREFIX), PREFIX + torch.randperm(n - PREFIX,
                                                                      generator=g)[:30]])
    else:
        raise AssertionError(case)
    idx = torch.unique(idx.to(torch.int64))  # sorted, no duplicates
    mag = torch.randint(1, 17, (idx.numel(),), generator=g).to(torch.float32) / 2
    sign = torch.randint(0, 2, (idx.numel(),), generator=g).to(torch.float32) * 2 - 1
    return SparseGrad(idx, (mag * sign).to(dtype), n,
                      dense_prefix=PREFIX if case == "prefix" else 0)


PREFIX = 40  # the "prefix" case's whole leading elements


def reference(case: str, P: int, dtype: torch.dtype) -> torch.Tensor:
    """The SUM of every rank's selection, in float64 with plain torch."""
    ref = torch.zeros(CASES[case], dtype=torch.float64)
    for r in range(P):
        s = selection(case, r, P, dtype)
        ref.index_add_(0, s.indices, s.values.to(torch.float64))
    return ref


# -- Table 1 volume cases (fp32, int32 indices on the wire: one entry = 2 words = 8 bytes) ------
VOL_N, VOL_K = 4096, 64


def volume_selection(case: str, rank: int, P: int) -> SparseGrad:
    g = torch.Generator().manual_seed(77 + 10 * P + (0 if case == "same" else rank))
    if case == "same":  # identical index sets on every rank (TopkDSA's best case)
        idx = torch.randperm(VOL_N, generator=g)[:VOL_K]
    elif case == "random":  # independent, low density: P·k ≤ n/8
        idx = torch.randperm(VOL_N, generator=g)[: VOL_K // 2]
    elif case == "fill":  # independent, density 3/8 per rank: TopkDSA switches to dense
        idx = torch.randperm(VOL_N, generator=g)[: 3 * VOL_N // 8]
    elif case == "prefix":  # VOL_M elements sent whole at the front, then k/2 random entries
        idx = torch.cat([torch.arange(VOL_M),
                         VOL_M + torch.randperm(VOL_N - VOL_M, generator=g)[: VOL_K // 2]])
    else:
        raise AssertionError(case)
    idx = torch.sort(idx).values
    val = torch.randint(1, 9, (idx.numel(),), generator=g).to(torch.float32) * (rank + 1)
    return SparseGrad(idx, val, VOL_N, dense_prefix=VOL_M if case == "prefix" else 0)


VOL_M = 100
VOLUME_RUNS = [("topka", "random"), ("topka", "prefix"), ("topkdsa", "same"),
               ("topkdsa", "random"), ("topkdsa", "fill"), ("gtopk", "same")]


# -- gTop-k cases worked out by hand ------------------------------------------------------
def gtopk_hand_case(P: int, rank: int) -> SparseGrad:
    if P == 2:  # merge {0:5, 1:1} + {1:1, 2:4} = {0:5, 1:2, 2:4}; top-2 = {0:5, 2:4}
        table = {0: ([0, 1], [5.0, 1.0]), 1: ([1, 2], [1.0, 4.0])}
    else:  # P = 4, k = 1. Round 1: 0 ← 1 keeps {0:3} (drops rank 1's {5:1}); 2 ← 3 gives
        # {5:4}. Round 2: 0 ← 2 keeps {5:4}. Index 5 is final but rank 1's value is not in it.
        table = {0: ([0], [3.0]), 1: ([5], [1.0]), 2: ([5], [2.0]), 3: ([5], [2.0])}
    idx, val = table[rank]
    return SparseGrad(torch.tensor(idx), torch.tensor(val), 8)


GTOPK_HAND = {  # P → (final dense as {index: value}, kept per rank)
    2: ({0: 5.0, 2: 4.0}, [[0], [2]]),
    4: ({5: 4.0}, [[], [], [5], [5]]),
}


def _rank_fn(rank: int, world_size: int, names: list[str]) -> dict:
    P = world_size
    out: dict = {"cases": {}, "mismatch": {}, "volume": {}, "hand": None, "errors": {}}
    for name in names:
        # An exception is recorded against its collective (if every rank raises alike, the
        # others still run); a rank raising alone makes its peers time out.
        try:
            for dtype in DTYPES:
                for case in CASES:
                    coll = collectives.get(name)  # fresh: stateful collectives start afresh
                    res = coll(selection(case, rank, P, dtype), step=0)
                    out["cases"][name, str(dtype), case] = (
                        res.dense, res.kept, res.stats.bytes_sent, res.stats.bytes_recv,
                    )
        except Exception:
            out["errors"][name] = f"{name} {dtype} {case}:\n{traceback.format_exc()}"
            continue
        if P > 1:  # mismatched numel: every rank must raise ValueError (and nobody hangs)
            try:
                collectives.get(name)(SparseGrad.empty(10 + (rank == 0)))
                out["mismatch"][name] = "returned"
            except ValueError as e:
                out["mismatch"][name] = f"ValueError: {e}"
            except Exception:
                out["mismatch"][name] = traceback.format_exc()
            try:  # the same numel, but rank 0 promises a dense prefix the others do not
                m = int(rank == 0)
                collectives.get(name)(SparseGrad(torch.arange(2), torch.ones(2), 10,
                                                 dense_prefix=m))
                out["mismatch"][name, "prefix"] = "returned"
            except ValueError as e:
                out["mismatch"][name, "prefix"] = f"ValueError: {e}"
            except Exception:
                out["mismatch"][name, "prefix"] = traceback.format_exc()
    # TopkA with a fixed capacity (SparseGrad.capacity, alike on every rank: the largest
    # count of any rank plus 3), every case, on the accelerators' path (segmented) and
    # on the CPU's; and, at P > 1, a capacity that differs on rank 0
    from conftest import segmented
    from gradsync import sparsegrad

    out["capped"], out["capped_cpu"], out["lazy"] = {}, {}, {}
    for dtype in DTYPES:
        for case in CASES:
            cap = 3 + max(len(selection(case, r, P, dtype)) for r in range(P))
            s = selection(case, rank, P, dtype)
            capped = SparseGrad(s.indices, s.values, s.numel, dense_prefix=s.dense_prefix,
                                capacity=cap)
            for on_cpu, into in ((True, out["capped"]), (False, out["capped_cpu"])):
                with sparsegrad.using(segmented(on_cpu)):
                    res = collectives.get("topka")(capped, step=0)
                into[str(dtype), case] = (res.dense, res.kept, res.stats.bytes_sent, cap,
                                          res.info)
            # lazy: the sum left to the caller (the engine's training thread writes it);
            # the exact-size exchange ignores it
            lazy = collectives.get("topka")(capped, step=0, lazy=True)
            eager = collectives.get("topka")(s, step=0, lazy=True)
            out["lazy"][str(dtype), case] = (lazy.dense, lazy.decode(), sorted(lazy.info),
                                             lazy.stats.bytes_sent, eager.decode is None,
                                             eager.dense)
    if P > 1:
        try:
            collectives.get("topka")(SparseGrad(torch.arange(2), torch.ones(2), 10,
                                                capacity=4 + (rank == 0)))
            out["capped_mismatch"] = "returned"
        except ValueError as e:
            out["capped_mismatch"] = f"ValueError: {e}"
        except Exception:
            out["capped_mismatch"] = traceback.format_exc()
    if P > 1:  # a rank that breaks its dense-prefix promise (fewer entries than the prefix,
        # built unchecked): TopkA sees every rank's count and every rank raises
        n = 1 if rank == 0 else 3
        bad = SparseGrad(torch.arange(n), torch.ones(n), 10, validate=False, dense_prefix=2)
        try:
            collectives.get("topka")(bad)
            out["short_prefix"] = "returned"
        except ValueError as e:
            out["short_prefix"] = f"ValueError: {e}"
        except Exception:
            out["short_prefix"] = traceback.format_exc()
    if P in (2, 4, 8):
        for name, case in VOLUME_RUNS:
            res = collectives.get(name, check_shapes=False)(volume_selection(case, rank, P))
            out["volume"][name, case] = (res.stats.bytes_sent, res.stats.bytes_recv, res.info,
                                         res.dense)
    if P in GTOPK_HAND:
        res = collectives.get("gtopk", check_shapes=False)(gtopk_hand_case(P, rank))
        out["hand"] = (res.dense, res.kept)
    return out


_RUNS: dict[tuple, list[dict]] = {}


def results(P: int) -> list[dict]:
    """One run_distributed call per world size and kernels, shared by every test below."""
    key = (P, caller_kernels())
    if key not in _RUNS:
        _RUNS[key] = run_distributed(_rank_fn, P, NAMES, timeout=180)
    return _RUNS[key]


def _no_errors(outs: list[dict], name: str) -> None:
    for r, o in enumerate(outs):
        if name in o["errors"]:
            pytest.fail(f"rank {r} raised in {o['errors'][name]}")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def test_expected_collectives_registered():
    for name in ("dense", "topka", "topkdsa", "gtopk"):
        assert name in NAMES
    assert collectives.get("topkdsa").exact and not collectives.get("gtopk").exact


@pytest.mark.parametrize("name", NAMES)
def test_registry_sets_the_name_once(name):
    """``@registry.register("gtopk")`` is the only place a collective's name is written."""
    c = collectives.get(name)
    assert c.name == name and type(c).name == name
    assert f'name = "{name}"' not in inspect.getsource(type(c))


@pytest.mark.usefixtures("kernels")
@pytest.mark.accelerator_at(P=3)
@pytest.mark.parametrize("P", WORLD_SIZES)
@pytest.mark.parametrize("name", NAMES)
def test_sum_kept_and_bitwise(P, name):
    outs = results(P)
    _no_errors(outs, name)
    exact = collectives.get(name).exact
    for dtype in DTYPES:
        for case in CASES:
            what = f"{name} P={P} {dtype} {case}"
            ref = reference(case, P, dtype)
            sels = [selection(case, r, P, dtype) for r in range(P)]
            dense0 = outs[0]["cases"][name, str(dtype), case][0]
            assert dense0.dtype == dtype and dense0.shape == (CASES[case],), what
            kept_sum = torch.zeros(CASES[case], dtype=torch.float64)
            for r, o in enumerate(outs):
                dense, kept = o["cases"][name, str(dtype), case][:2]
                assert torch.equal(_bits(dense), _bits(dense0)), f"{what}: rank {r} differs"
                assert kept.dtype == torch.int64, what
                assert bool(torch.isin(kept, sels[r].indices).all()), f"{what}: kept ⊄ local"
                assert torch.unique(kept).numel() == kept.numel(), what
                if exact:
                    assert torch.equal(torch.sort(kept).values, sels[r].indices), what
                pos = torch.searchsorted(sels[r].indices, kept)
                kept_sum.index_add_(0, kept, sels[r].values[pos].to(torch.float64))
            got = dense0.to(torch.float64)
            if exact:
                assert torch.equal(got, ref), f"{what}: dense != reference SUM"
            else:
                assert torch.equal(got, kept_sum), f"{what}: Σ kept != dense"
                union = torch.zeros(CASES[case], dtype=torch.bool)
                for s in sels:
                    union[s.indices] = True
                assert not bool((got != 0)[~union].any()), f"{what}: outside the selections"
                if name not in PARTIAL_AT_SUPPORT:
                    nz = got != 0
                    assert torch.equal(got[nz], ref[nz]), f"{what}: != reference at support"
            if P == 1 and exact:
                assert all(o["cases"][name, str(dtype), case][2] == 0 for o in outs), what


@pytest.mark.parametrize("P", WORLD_SIZES)
@pytest.mark.parametrize("name", NAMES)
def test_stats_counted(P, name):
    outs = results(P)
    _no_errors(outs, name)
    for dtype in DTYPES:
        for case in CASES:
            stats = [o["cases"][name, str(dtype), case][2:] for o in outs]
            sent = sum(s for s, _ in stats)
            assert sent == sum(r for _, r in stats), f"{name} {case}: bytes sent != received"
            anything = any(len(selection(case, r, P, dtype)) for r in range(P))
            if P > 1 and anything:
                # more than the 32-byte shape consensus (ring all-reduce) of every rank
                assert sent > P * (2 * (P - 1) * 32 // P), f"{name} {case}: no payload"


@pytest.mark.parametrize("P", [p for p in WORLD_SIZES if p > 1])
@pytest.mark.parametrize("name", NAMES)
def test_mismatched_numel_raises_everywhere(P, name):
    _no_errors(results(P), name)
    got = [o["mismatch"][name] for o in results(P)]
    assert all(g.startswith("ValueError") for g in got), got
    got = [o["mismatch"][name, "prefix"] for o in results(P)]
    assert all(g.startswith("ValueError") and "dense prefixes over [0, 1]" in g
               for g in got), got


def _vol(P: int, name: str, case: str) -> list[tuple[int, int, dict]]:
    """(bytes sent, bytes received, info) per rank."""
    return [o["volume"][name, case][:3] for o in results(P)]


@pytest.mark.parametrize("P", [2, 8])  # the shared runs: P = 4 takes the code of 2 and 8
def test_table1_topka(P):
    """TopkA: 2k(P−1) words per rank, plus the gathered counts (one int64 per peer)."""
    k = VOL_K // 2
    avg_sent = sum(s for s, _, _ in _vol(P, "topka", "random")) / P
    assert avg_sent == 2 * k * (P - 1) * 4 + 8 * (P - 1)
    for _, recv, _ in _vol(P, "topka", "random"):
        assert recv == 2 * k * (P - 1) * 4 + 8 * (P - 1)


@pytest.mark.parametrize("P", [p for p in WORLD_SIZES if p > 1])
def test_topka_refuses_a_rank_with_fewer_entries_than_the_dense_prefix(P):
    got = [o["short_prefix"] for o in results(P)]
    assert all(g.startswith("ValueError") and "fewer than the dense prefix" in g
               for g in got), got


@pytest.mark.usefixtures("kernels")
@pytest.mark.accelerator_at(P=3)
@pytest.mark.parametrize("P", WORLD_SIZES)
def test_topka_at_a_fixed_capacity_sums_like_the_exact_size_exchange(P):
    """A selection with a capacity every rank shares travels, with either kernel set, as
    one equal-size message per rank (an 8-byte count, room for the capacity's indices past the
    dense prefix and its values; no count exchange first): the sum is the float64
    reference's, bit for bit the exact-size exchange's, every entry is kept, and a capacity
    that differs between ranks fails on every rank."""
    from gradsync.collectives.comm import ring_allreduce_bytes
    from gradsync.formats.wire import capped_entries_bytes, wire_index_dtype

    outs = results(P)
    for dtype in DTYPES:
        for case in CASES:
            exact = [o["cases"]["topka", str(dtype), case] for o in outs]
            for r, o in enumerate(outs):
                s = selection(case, r, P, dtype)
                for kernels in ("capped", "capped_cpu"):
                    dense, kept, sent, cap, info = o[kernels][str(dtype), case]
                    assert torch.equal(_bits(dense), _bits(exact[r][0])), (case, dtype, r)
                    assert torch.equal(dense.double(), reference(case, P, dtype).to(dtype)
                                       .double()), (case, dtype)
                    assert torch.equal(kept, s.indices)
                    size = capped_entries_bytes(cap, wire_index_dtype(s.numel), dtype,
                                                s.dense_prefix)
                    # P − 1 messages of the capacity's size, plus the 32-byte shape check
                    shape = ring_allreduce_bytes(32, P) if P > 1 else 0
                    assert sent == (P - 1) * size + shape, (case, kernels, sent)
                    assert info["capacity"] == cap and "checks" not in info
                    assert "counts" not in info, kernels  # no count exchange
                dense, kept, sent, cap, info = o["capped"][str(dtype), case]
                none, decoded, keys, lazy_sent, eager_has_none, eager = o["lazy"][str(dtype),
                                                                                  case]
                assert none is None and keys == sorted(info) and lazy_sent == sent
                assert torch.equal(_bits(decoded), _bits(dense)), (case, dtype, r)
                assert eager_has_none and torch.equal(_bits(eager), _bits(exact[r][0]))
    if P > 1:
        got = [o["capped_mismatch"] for o in outs]
        assert all(g.startswith("ValueError") and "capacities differ" in g for g in got), got


@pytest.mark.parametrize("P", [2, 8])  # the shared runs: P = 4 takes the code of 2 and 8
def test_topka_sends_a_dense_prefix_without_its_indices(P):
    """Tensors sent whole at the front (``SparseGrad.dense_prefix``, m elements): their values
    travel, their indices do not — (c − m) indices and c values per peer, plus the counts."""
    c = VOL_M + VOL_K // 2
    for sent, recv, _ in _vol(P, "topka", "prefix"):
        assert sent == recv == ((c - VOL_M) * 4 + c * 4) * (P - 1) + 8 * (P - 1)
    ref = sum(volume_selection("prefix", r, P).to_dense() for r in range(P))
    for o in results(P):
        assert torch.equal(o["volume"]["topka", "prefix"][3], ref)


def _corrupted_runs(name: str, sel: SparseGrad, owner: object, attr: str, corrupt,
                   hows: list[str]) -> list[tuple]:
    """Collective ``name`` on ``sel`` with ``owner.attr`` replaced by ``corrupt(original,
    how)`` (a wrapper that corrupts what this rank receives, as a faulty link would), once
    strictly and once with ``deferred``, per way in ``hows``: ``("ok", dense, failed checks)``
    or ``("raised", message, None)`` each."""
    original, out = getattr(owner, attr), []
    for how in hows:
        for deferred in (None, []):
            setattr(owner, attr, corrupt(original, how))
            try:
                res = collectives.get(name)(sel, step=0, deferred=deferred)
                out.append(("ok", res.dense, [m for ok, m in deferred or [] if not ok]))
            except ValueError as e:
                out.append(("raised", str(e), None))
            finally:
                setattr(owner, attr, original)
    return out


def _topka_corrupt(rank: int, world_size: int, n: int, m: int, hows: list[str]) -> list:
    """Rank 0 corrupts the first index of the message it receives from the last rank."""
    import gradsync.collectives.topka as topka_mod

    g = torch.Generator().manual_seed(rank)
    rest = torch.randperm(n - m, generator=g)[: (n - m) // 10].sort().values + m
    idx = torch.cat([torch.arange(m), rest])
    sel = SparseGrad(idx, torch.randn(idx.numel(), generator=g), n, dense_prefix=m)

    def corrupt(unpack, how):
        seen = [0]

        def corrupting(buf, count, *args):
            seen[0] += 1
            i, v = unpack(buf, count, *args)
            if rank == 0 and seen[0] == world_size and i.numel():
                i = i.clone()
                i[0] = {"past the end": n + 5, "negative": -1, "in the prefix": m - 1}[how]
            return i, v
        return corrupting

    return _corrupted_runs("topka", sel, topka_mod, "unpack_entries", corrupt, hows)


@pytest.mark.parametrize("P", [2, 3])
def test_topka_malformed_indices_fail_the_receiving_rank_and_write_nowhere(P):
    """An index outside the tensor (or inside the dense prefix, which travels without
    indices) in a received message: the receiving rank raises ``ValueError`` naming the range
    once every message is in (no peer is left waiting); with ``deferred`` the failed check comes
    back instead, and the sum holds every other entry exactly, nothing written elsewhere."""
    n, m = 600, 40
    hows = ["past the end", "negative", "in the prefix"]
    outs = run_distributed(_topka_corrupt, P, n, m, hows, timeout=180)
    ref = torch.zeros(n, dtype=torch.float64)
    first = None
    for r in range(P):
        g = torch.Generator().manual_seed(r)
        rest = torch.randperm(n - m, generator=g)[: (n - m) // 10].sort().values + m
        vals = torch.randn(m + rest.numel(), generator=g).double()
        ref[:m] += vals[:m]
        ref[rest] += vals[m:]
        if r == P - 1:
            first = (int(rest[0]), vals[m])  # the entry rank 0 corrupts
    for j, how in enumerate(hows):
        strict, deferred = outs[0][2 * j], outs[0][2 * j + 1]
        assert strict[0] == "raised" and f"outside [{m}, {n})" in strict[1], (how, strict)
        assert deferred[0] == "ok" and len(deferred[2]) == 1, (how, deferred)
        want = ref.clone()
        want[first[0]] -= first[1]  # the corrupted entry was dropped, nothing else changed
        torch.testing.assert_close(deferred[1].double(), want, rtol=0, atol=1e-6)
        for r in range(1, P):  # the others received nothing malformed
            assert outs[r][2 * j][0] == "ok" and outs[r][2 * j + 1][2] == [], (how, r)
            torch.testing.assert_close(outs[r][2 * j][1].double(), ref, rtol=0, atol=1e-6)


def _topkdsa_corrupt(rank: int, world_size: int, n: int, hows: list[str]) -> list:
    """Rank 0 corrupts the first sparse stream it receives (the reduce-scatter's, for the
    half it keeps)."""
    from gradsync.collectives.topkdsa import _Wire

    g = torch.Generator().manual_seed(rank)
    idx = torch.randperm(n, generator=g)[: n // 20].sort().values
    sel = SparseGrad(idx, torch.randn(idx.numel(), generator=g), n)

    def corrupt(decode, how):
        armed = [rank == 0]

        def corrupting(self, header, payload, lo, hi):
            if armed[0] and header >= 2:
                armed[0] = False
                payload = payload.clone()
                _bad_indices(payload[: 4 * header].view(torch.int32), how, hi)
            return decode(self, header, payload, lo, hi)
        return corrupting

    return _corrupted_runs("topkdsa", sel, _Wire, "decode", corrupt, hows)


def _bad_indices(ix: torch.Tensor, how: str, end: int) -> None:
    """Corrupt the indices ``ix`` in place: ``how`` is "negative", "past the end" (``end``)
    or "unsorted"."""
    if how == "negative":
        ix[0] = -1
    elif how == "past the end":
        ix[-1] = end
    else:
        ix[:2] = ix[:2].flip(0).clone()


def test_topkdsa_malformed_streams_fail_the_receiving_rank_and_write_only_inside_the_range():
    """A received stream whose indices leave its range or are not strictly increasing: the
    receiving rank raises ``ValueError`` naming the range once the collective is done (no peer
    left waiting); with ``deferred`` the failed check comes back instead, and the half the
    stream did not cover is the exact sum on both ranks."""
    n, P = 1000, 2
    hows = ["negative", "past the end", "unsorted"]
    outs = run_distributed(_topkdsa_corrupt, P, n, hows, timeout=180)
    ref = torch.zeros(n, dtype=torch.float64)
    for r in range(P):
        g = torch.Generator().manual_seed(r)
        idx = torch.randperm(n, generator=g)[: n // 20].sort().values
        ref[idx] += torch.randn(idx.numel(), generator=g).double()
    half = slice(n // 2, n)  # rank 0 keeps [0, n/2) in the reduce-scatter: it got the bad one
    for j, how in enumerate(hows):
        strict, deferred = outs[0][2 * j], outs[0][2 * j + 1]
        assert strict[0] == "raised" and "topkdsa: a peer's stream" in strict[1] \
            and f"[0, {n // 2})" in strict[1], (how, strict)
        assert deferred[0] == "ok" and len(deferred[2]) == 1, (how, deferred)
        assert outs[1][2 * j][0] == "ok" and outs[1][2 * j + 1][2] == [], how
        for dense in (deferred[1], outs[1][2 * j + 1][1]):
            assert dense.shape == (n,)
            torch.testing.assert_close(dense[half].double(), ref[half], rtol=0, atol=1e-6)


def _first_received_corrupt(rank: int, world_size: int, n: int, hows: list[str], name: str,
                            attr: str) -> list:
    """Rank 0 corrupts the indices of the first message (of 2 entries or more) that
    collective ``name`` unpacks with its module's ``attr``."""
    import importlib

    g = torch.Generator().manual_seed(rank)
    idx = torch.randperm(n, generator=g)[: n // 20].sort().values
    sel = SparseGrad(idx, torch.randn(idx.numel(), generator=g), n)

    def corrupt(unpack, how):
        armed = [rank == 0]

        def corrupting(*args):
            i, v = unpack(*args)
            if armed[0] and i.numel() >= 2:
                armed[0] = False
                i = i.clone()
                _bad_indices(i, how, n)
            return i, v
        return corrupting

    module = importlib.import_module(f"gradsync.collectives.{name}")
    return _corrupted_runs(name, sel, module, attr, corrupt, hows)


@pytest.mark.parametrize("P", [2, 3])
@pytest.mark.parametrize(("name", "attr", "names"), [
    ("gtopk", "unpack_entries", "gtopk: entries from rank"),
    ("spardl", "unpack_entries_fixed", "spardl: round 0 from rank")])
def test_malformed_messages_fail_the_receiving_rank_after_the_tree_or_rounds(P, name, attr,
                                                                             names):
    """gTop-k's entries from a child, SparDL's first round message: indices that leave the
    tensor or are not strictly increasing make the receiver raise ``ValueError`` naming the
    sender once the collective is done (before, it raised mid-tree or mid-round and its peers
    waited for it until the timeout); with ``deferred`` the failed check comes back instead,
    and every rank still has the same result, of the right size. Every other rank fails too,
    told by the receiver's verdict: down gTop-k's broadcast tree (the receiver is its root),
    in SparDL's all-gather (the module docs, "Verdicts in the trees", "… in the all-gather")."""
    n = 1000
    hows = ["negative", "past the end", "unsorted"]
    outs = run_distributed(_first_received_corrupt, P, n, hows, name, attr, timeout=180)
    for j, how in enumerate(hows):
        strict, deferred = outs[0][2 * j], outs[0][2 * j + 1]
        assert strict[0] == "raised" and names in strict[1], (how, strict)
        assert deferred[0] == "ok" and deferred[2], (how, deferred)
        heard = f"{name}: another rank received a malformed message"
        for r in range(1, P):  # the others received well-formed messages, and the verdict
            assert outs[r][2 * j][0] == "raised" and heard in outs[r][2 * j][1], (how, r)
            assert [heard in m for m in outs[r][2 * j + 1][2]] == [True], (how, r)
        dense = [o[2 * j + 1][1] for o in outs]
        assert dense[0].shape == (n,)
        assert all(torch.equal(d, dense[0]) for d in dense), how


def _gtopk_down_fault(rank: int, world_size: int, how: str) -> str:
    """One gTop-k call; ``how="link"``: rank 2 receives the broadcast tree's message from rank
    0 with its first index −3; ``"sender"``: rank 0 packs the final entries it sends down with
    that index. ``"ok"`` or the ``ValueError``'s message."""
    import gradsync.collectives.gtopk as gt

    n = 1000
    g = torch.Generator().manual_seed(rank)
    idx = torch.randperm(n, generator=g)[: n // 20].sort().values
    sel = SparseGrad(idx, torch.randn(idx.numel(), generator=g), n)
    real_unpack, real_pack = gt.unpack_entries, gt.pack_entries

    def down_unpack(buf, count, *args):  # only inside _recv_down (the broadcast tree)
        i, v = real_unpack(buf, count, *args)
        if armed and i.numel():
            armed.clear()
            i = i.clone()
            i[0] = -3
        return i, v

    def packing(i, v, *args):  # only inside _packed_down
        i = i.clone()
        i[0] = -3
        return real_pack(i, v, *args)

    armed: list = []
    recv_down, packed_down = gt.GTopk._recv_down, gt.GTopk._packed_down

    def recv(self, comm, src):
        if how == "link" and rank == 2:
            armed.append(True)
            gt.unpack_entries = down_unpack
        try:
            return recv_down(self, comm, src)
        finally:
            gt.unpack_entries = real_unpack

    def pack(self, final):
        if how == "sender" and rank == 0:
            gt.pack_entries = packing
        try:
            return packed_down(self, final)
        finally:
            gt.pack_entries = real_pack

    gt.GTopk._recv_down, gt.GTopk._packed_down = recv, pack
    try:
        collectives.get("gtopk", k=20)(sel, step=0)
        return "ok"
    except ValueError as e:
        return str(e)
    finally:
        gt.GTopk._recv_down, gt.GTopk._packed_down = recv_down, packed_down


@pytest.mark.parametrize("how", ["link", "sender"])
def test_gtopk_broadcast_tree_faults(how):
    """P = 8. A message corrupted on the broadcast tree's link 0 → 2 fails rank 2 and the ranks
    below it (3), whose verdict comes from 2; the rest take the step (module doc). Final
    entries the root packs malformed fail every rank: its children and theirs check them, and
    the root checks what it sends as they do."""
    outs = run_distributed(_gtopk_down_fault, 8, how, timeout=180)
    named = "gtopk: final entries"
    heard = "gtopk: another rank received a malformed message"
    if how == "link":
        assert named in outs[2] and heard in outs[3], outs
        assert all(outs[r] == "ok" for r in (0, 1, 4, 5, 6, 7)), outs
    else:
        assert "gtopk: the final entries this rank sends" in outs[0], outs
        assert all(named in o or heard in o for o in outs[1:]), outs


@pytest.mark.parametrize("P", [2, 8])  # the shared runs: P = 4 takes the code of 2 and 8
def test_table1_topkdsa(P):
    """TopkDSA: between 4k(P−1)/P words (same indices everywhere) and the dense cap."""
    headers = 8 * 2 * int(math.log2(P))  # one int64 per step, 2·log2 P steps
    # Best case: identical, uniformly spread indices reach the lower bound exactly.
    same = _vol(P, "topkdsa", "same")
    assert sum(s for s, _, _ in same) / P == 4 * VOL_K * (P - 1) / P * 4 + headers
    assert all(info["dense_sends"] == 0 for _, _, info in same)
    # Independent low-density selections: inside Table 1's interval [4k(P−1)/P, (2k+n)(P−1)/P].
    k = VOL_K // 2
    avg = sum(s for s, _, _ in _vol(P, "topkdsa", "random")) / P - headers
    assert 4 * k * (P - 1) / P * 4 <= avg <= (2 * k + VOL_N) * (P - 1) / P * 4
    # Fill-in: the switch to dense caps the volume at a dense allreduce, 2n(P−1)/P words.
    k = 3 * VOL_N // 8
    fill = _vol(P, "topkdsa", "fill")
    avg = sum(s for s, _, _ in fill) / P - headers
    assert 4 * k * (P - 1) / P * 4 <= avg <= 2 * VOL_N * (P - 1) / P * 4
    assert all(info["dense_sends"] > 0 for _, _, info in fill)


@pytest.mark.parametrize("P", [2, 8])  # the shared runs: P = 4 takes the code of 2 and 8
def test_table1_gtopk(P):
    """gTop-k: at most 4k·log2 P words per rank (the root's volume) plus control words."""
    k, m = VOL_K, int(math.log2(P))
    # root: receives m × (24-byte header: count, k, verdict + k entries), sends m × (16-byte
    # header: count, verdict + k entries + k survival bits)
    control = m * (24 + 16 + (k + 7) // 8)
    vol = [s + r for s, r, _ in _vol(P, "gtopk", "same")]
    assert vol[0] == 4 * k * m * 4 + control
    assert max(vol) == vol[0]


@pytest.mark.parametrize("P", sorted(GTOPK_HAND))
def test_gtopk_hand_worked(P):
    final, kept = GTOPK_HAND[P]
    expected = torch.zeros(8)
    for i, v in final.items():
        expected[i] = v
    for r, o in enumerate(results(P)):
        dense, k = o["hand"]
        assert torch.equal(dense, expected)
        assert k.tolist() == kept[r]


@pytest.mark.parametrize("P", [2, 8])  # the shared runs: P = 4 takes the code of 2 and 8
def test_gtopk_full_overlap_is_exact(P):
    """With identical index sets nothing is dropped, so gTop-k returns the full SUM."""
    ref = sum(volume_selection("same", r, P).to_dense() for r in range(P))
    for o in results(P):
        assert torch.equal(o["volume"]["gtopk", "same"][3], ref)
        assert o["volume"]["gtopk", "same"][2]["global_count"] == VOL_K


def test_gtopk_density_k_is_target_k_round_not_ceil():
    """gTop-k's k from a density is the one rule, ``target_k`` (it used ⌈density·n⌉ before):
    0.07·100 is 7.000000000000001 in float64, so ceil kept 8 entries; 0.012·100 = 1.2, 2."""
    n = 100
    x = torch.arange(1, n + 1, dtype=torch.float32) * torch.tensor([1.0, -1.0]).repeat(n // 2)
    sel = SparseGrad(torch.arange(n), x, n)
    for density, k in [(0.07, 7), (0.012, 1), (0.12, 12), (0.015, 2), (0.001, 1), (1.0, 100)]:
        assert target_k(n, density) == k
        res = collectives.get("gtopk", density=density)(sel)
        assert res.info["k"] == k
        # The k largest magnitudes are n−k+1 … n (values ±(i+1)): a plain-Python reference.
        expect = torch.zeros(n)
        for i in range(n - k, n):
            expect[i] = x[i]
        assert torch.equal(res.dense, expect)
        assert res.kept.tolist() == list(range(n - k, n))
    assert math.ceil(0.07 * n) == 8 and math.ceil(0.012 * n) == 2  # what the old rule kept
    with pytest.raises(ValueError, match="gtopk: density"):
        collectives.get("gtopk", density=0.0)
    with pytest.raises(ValueError, match="gtopk: density"):
        collectives.get("gtopk", density=float("nan"))


# -- check_shapes="changes": the engine's and the DDP hook's agreement, once per description ---
def _agree_on_changes(rank: int, P: int) -> dict:
    def sel(n: int) -> SparseGrad:
        return SparseGrad(torch.arange(2), torch.ones(2), n)

    out: dict = {}
    for mode in (True, "changes"):
        coll = collectives.get("topka", check_shapes=mode)
        out[mode] = [coll(sel(n)).stats.bytes_sent for n in (10, 10, 12, 10, 12)]
    try:  # a description not agreed before, and rank 0 alone passes another numel
        coll(SparseGrad.empty(20 + (rank == 0)))
        out["mismatch"] = "returned"
    except ValueError as e:
        out["mismatch"] = str(e)
    return out


@pytest.mark.parametrize("P", [2, 3])
def test_check_shapes_changes_agrees_once_per_description(P):
    """With ``check_shapes="changes"`` the ranks agree on a tensor's description the first time
    it is passed (numel 10, then 12) and not again (the calls after it send the agreement's
    bytes fewer); the default agrees at every call; a description never agreed that differs
    between ranks still raises on every rank."""
    for o in run_distributed(_agree_on_changes, P, timeout=120):
        every, once = o[True], o["changes"]
        assert len(set(every)) == 1 and every[0] == once[0] == once[2]
        word = once[0] - once[1]
        assert word > 0 and once[1] == once[3] == once[4] == every[0] - word
        assert "ranks disagree on the tensor" in o["mismatch"]


def test_check_shapes_rejects_other_values():
    with pytest.raises(ValueError, match="check_shapes must be True, False or 'changes'"):
        collectives.get("topka", check_shapes="sometimes")
