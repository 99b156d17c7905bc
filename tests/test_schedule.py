"""Planners and the timeline simulator (pure; no processes).

Expected values are computed here from the formulas (Eq. 2, 3, 4, §IV-C, §IV-D), not taken from
the code under test.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradsync.schedule import (
    DDP_FIRST_BUCKET_BYTES,
    SCHEMES,
    BufferPlan,
    Plan,
    TensorPlan,
    allgather_charge,
    allreduce_charge,
    best_split,
    bucket_bytes_of,
    compensate,
    cupcake_groups,
    entries,
    fixed_buckets,
    make_plan,
    mgwfbp_groups,
    needs_cost_model,
    selective_buffers,
    simulate,
)
from gradsync.schedule.costmodel import AffineFit, AlphaBeta, CostModel, cores_per_rank
from gradsync.sparsify.base import target_k


def cost_model(numel, tb, *, P=4, sp=(2e-4, 1e-9), off=(4e-4, 3e-9), ar=(5e-5, 1e-9),
               ag=(5e-5, 1e-9), elem_bytes=4):
    names = list(numel)
    return CostModel(P=P, order=names, numel=dict(numel), elem_bytes=elem_bytes,
                     backward=dict(tb), sparsify=AffineFit(*sp), offload=AffineFit(*off),
                     allreduce=AlphaBeta(*ar), allgather=AlphaBeta(*ag))


def random_model(seed, L=None, sizes=(32, 300, 4096, 50_000, 400_000)):
    rng = random.Random(seed)
    L = L or rng.randint(3, 40)
    names = [f"p{i}" for i in range(L)]
    numel = {n: rng.choice(sizes) for n in names}
    tb = {n: rng.uniform(2e-5, 2e-4) + numel[n] * rng.uniform(0, 3e-9) for n in names}
    cm = cost_model(numel, tb, P=rng.choice([2, 4, 8, 16]),
                    sp=(rng.uniform(0, 4e-4), rng.uniform(0, 3e-9)),
                    off=(rng.uniform(0, 8e-4), rng.uniform(0, 6e-9)),
                    ar=(rng.uniform(1e-6, 2e-4), rng.uniform(1e-11, 3e-9)),
                    ag=(rng.uniform(1e-6, 2e-4), rng.uniform(1e-11, 3e-9)))
    return names, numel, cm


# ---- the comm formulas, written out here (Eq. 3 and Eq. 4) ---------------------------------
def t_ar(cm, nbytes):
    return 2 * (cm.P - 1) * cm.allreduce.alpha + 2 * (cm.P - 1) / cm.P * nbytes * cm.allreduce.beta


def t_ag(cm, nbytes):
    return (cm.P - 1) * cm.allgather.alpha + (cm.P - 1) * nbytes * cm.allgather.beta


# ---------------------------------------------------------------------------------------------
def test_every_scheme_covers_every_tensor_once_in_backward_order():
    for seed in range(6):
        names, numel, cm = random_model(seed)
        for scheme in SCHEMES:
            # one selection per tensor (the pooled budget sends nothing whole: below)
            plan = make_plan(scheme, names, numel, 0.01, cm, pooled=False)
            assert plan.names == names, scheme
            if SCHEMES[scheme].budget == "pooled":  # the scheme's default: its pools
                pooled = make_plan(scheme, names, numel, 0.01, cm)
                assert pooled.names == names and pooled.info["whole_below_min_k"] == []
                assert all(t.density == 0.01 for b in pooled.buffers for t in b.tensors)
            assert plan.scheme == scheme
            for b in plan.buffers:
                for t in b.tensors:
                    assert t.numel == numel[t.name]
            # the scheme's min_k (8): no planner sparsifies on its own a tensor that the target
            # density would give fewer entries, but SSFusion where those tensors would take over
            # half its budget (starved); SSFusion adds those under min_k at its d′
            k_min = SCHEMES[scheme].min_k
            forced = plan.info["whole_below_min_k"]
            if SCHEMES[scheme].planner == "ssfusion":
                below = [n for n in names if target_k(numel[n], 0.01) < k_min]
                share = sum(numel[n] for n in below) * allgather_charge(cm.P, cm.elem_bytes)
                if share > 0.5 * 0.01 * sum(numel.values()):
                    assert forced == []
                else:
                    assert set(below) <= set(forced)
                    d = [t.density for b in plan.buffers for t in b.tensors
                         if t.density is not None]
                    assert all(target_k(numel[n], max(d)) < k_min for n in forced
                               if n not in below), (scheme, forced, below)
            else:
                assert all(target_k(t.numel, 0.01) >= k_min for b in plan.buffers
                           for t in b.tensors if b.mode == "per_tensor" and t.density is not None)
            assert all(t.density is None for b in plan.buffers for t in b.tensors
                       if t.name in forced), scheme
            if scheme in ("per_tensor",):  # but tensors of k < Config.min_k = 8: whole
                assert all(t.density == (None if target_k(t.numel, 0.01) < 8 else 0.01)
                           for b in plan.buffers for t in b.tensors)
            # the plan's predicted time is the simulator's
            assert plan.info["predicted"]["iteration"] == pytest.approx(
                simulate(plan, cm).iteration)
        for scheme in ("dense", "dense_ovlp", "topka", "oktopk", "per_tensor"):
            assert make_plan(scheme, names, numel, 0.05).names == names  # no cost model needed


def test_scheme_shapes():
    names, numel, cm = random_model(3, L=12)
    d = make_plan("dense", names, numel, 0.01, bucket_bytes=1 << 20)
    o = make_plan("dense_ovlp", names, numel, 0.01, bucket_bytes=1 << 20)
    assert not d.overlap and o.overlap
    assert [b.names for b in d.buffers] == [b.names for b in o.buffers]
    assert all(b.mode == "dense" for b in d.buffers)
    for s in ("topka", "topkdsa", "gtopk", "gaussiank", "oktopk", "densestream"):
        p = make_plan(s, names, numel, 0.02)
        assert len(p.buffers) == 1 and p.buffers[0].mode == "fused"
        assert p.buffers[0].density == 0.02
    for s in ("multi_tensor", "omgs", "cupcake"):
        assert all(b.mode == "fused" for b in make_plan(s, names, numel, 0.01, cm).buffers)
    cup = make_plan("cupcake", names, numel, 0.01, cm)
    for s in ("ssfusion", "ssfusion_o", "ssfusion_oi"):
        p = make_plan(s, names, numel, 0.01, cm)
        assert [b.names for b in p.buffers] == [b.names for b in cup.buffers], s
        assert all(b.mode == "per_tensor" for b in p.buffers)
    pt = make_plan("per_tensor", names, numel, 0.01, cm, bucket_bytes=1 << 20)
    assert [b.names for b in pt.buffers] == [b.names for b in o.buffers]  # DDP's buckets
    assert all(b.mode == "per_tensor" for b in pt.buffers)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 5000), min_size=1, max_size=40), st.integers(1, 20000),
       st.integers(1, 20000))
def test_fixed_buckets_are_ddps_buckets(sizes, first, cap):
    """The reference is torch's own assignment, the function DDP's Reducer rebuilds its
    buckets with (limits: the first bucket's, then every later one's)."""
    import torch
    import torch.distributed as dist

    names = [f"t{i}" for i in range(len(sizes))]
    numel = dict(zip(names, sizes))
    groups = fixed_buckets(names, numel, 4, cap, first)
    tensors = [torch.empty(n) for n in sizes]
    ref, _ = dist._compute_bucket_assignment_by_size(tensors, [first, cap],
                                                     [False] * len(sizes))
    assert groups == [[names[i] for i in b] for b in ref]
    # no first limit: every bucket at the cap (DDP given bucket_cap_mb)
    uniform, _ = dist._compute_bucket_assignment_by_size(tensors, [cap], [False] * len(sizes))
    assert fixed_buckets(names, numel, 4, cap) == [[names[i] for i in b] for b in uniform]
    assert DDP_FIRST_BUCKET_BYTES == dist._DEFAULT_FIRST_BUCKET_BYTES


def test_fixed_buckets_close_once_the_limit_is_reached():
    numel = {"a": 100, "b": 200, "c": 40, "d": 300, "e": 1}
    # first limit 400 B: a (400 B) fills it; later limit 1000 B: b+c = 960 B, +d = 2160 B closes it
    assert fixed_buckets(list(numel), numel, 4, 1000, 400) == [["a"], ["b", "c", "d"], ["e"]]
    assert fixed_buckets(list(numel), numel, 4, 10_000, 10_000) == [list(numel)]
    with pytest.raises(ValueError, match="limits must be > 0"):
        fixed_buckets(list(numel), numel, 4, 1000, 0)
    # Config.bucket_mb / --bucket-mb in MiB, as bytes
    assert bucket_bytes_of(1.0) == DDP_FIRST_BUCKET_BYTES and bucket_bytes_of(25) == 25 << 20
    assert bucket_bytes_of(None) is None and bucket_bytes_of(1e-9) == 1


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 10**7), st.floats(1e-6, 1.0))
def test_entries_is_the_sparsifier_k(n, d):
    assert entries(n, d) == target_k(n, d)
    assert entries(n, None) == n


# ---- simulator on hand-built timelines ------------------------------------------------------
def test_simulate_dense_buckets_with_and_without_overlap():
    # P=2: T_AR(B) = 2α + B·β; α = 0.5, β = 0.01 s/B; every bucket is 200 B → 3 s.
    numel = {"a": 25, "b": 25, "c": 50}
    cm = cost_model(numel, {"a": 1.0, "b": 2.0, "c": 1.0}, P=2, ar=(0.5, 0.01))
    buckets = [BufferPlan((TensorPlan("a", 25, None), TensorPlan("b", 25, None)), "dense"),
               BufferPlan((TensorPlan("c", 50, None),), "dense")]
    # overlap: bucket 1 ready at 3, sent 3→6; bucket 2 ready at 4, waits, 6→9.
    tl = simulate(Plan("dense_ovlp", buckets, overlap=True), cm)
    assert tl.iteration == pytest.approx(9.0)
    assert tl.backward == pytest.approx(4.0) and tl.sparsify == 0
    assert tl.comm == pytest.approx(6.0) and tl.exposed_comm == pytest.approx(5.0)
    # no overlap: the channel opens at 4: 4→7, 7→10.
    tl = simulate(Plan("dense", buckets, overlap=False), cm)
    assert tl.iteration == pytest.approx(10.0) and tl.exposed_comm == pytest.approx(6.0)
    assert [r["start"] for r in tl.buffers] == pytest.approx([4.0, 7.0])


def test_simulate_fused_buffers():
    # P=3: T_AG(B) = 2α + 2Bβ, α=0.1, β=0.001; T_sp = 0.2 + 1e-4·n.
    numel = {"x": 1000, "y": 3000}
    cm = cost_model(numel, {"x": 1.0, "y": 1.0}, P=3, sp=(0.2, 1e-4), ag=(0.1, 0.001))
    plan = Plan("cupcake", [BufferPlan((TensorPlan("x", 1000, None),), "fused", 0.01),
                            BufferPlan((TensorPlan("y", 3000, None),), "fused", 0.01)])
    # x: ready 1 + (0.2+0.1) = 1.3; k=10 → 80 B → 0.2 + 0.16 = 0.36 → ends 1.66
    # y: compute 1.3 + 1 = 2.3, sparsify 0.2+0.3 → ready 2.8; k=30 → 240 B → 0.68 → 3.48
    tl = simulate(plan, cm)
    assert tl.iteration == pytest.approx(3.48)
    assert tl.sparsify == pytest.approx(0.8)
    assert tl.comm == pytest.approx(0.36 + 0.68)
    one = Plan("topka", [BufferPlan((TensorPlan("x", 1000, None), TensorPlan("y", 3000, None)),
                                    "fused", 0.01)])
    # one buffer: ready 2 + 0.2 + 0.4 = 2.6; k=40 → 320 B → 0.84 → 3.44
    assert simulate(one, cm).iteration == pytest.approx(3.44)


def test_simulate_per_tensor_offload_and_interleaving():
    # P=2: T_AR(B) = 2α_r + Bβ_r (α_r=0.05, β_r=0.001), T_AG(B) = α_g + Bβ_g (α_g=0.1,
    # β_g=0.002). Inline T_sp = 0.5, offloaded 1.5 (b = 0).
    numel = {"u": 100, "v": 1000, "w": 2000, "z": 10}
    tb = {"u": 1.0, "v": 1.0, "w": 1.0, "z": 1.0}
    cm = cost_model(numel, tb, P=2, sp=(0.5, 0.0), off=(1.5, 0.0), ar=(0.05, 0.001),
                    ag=(0.1, 0.002))
    buf = BufferPlan((TensorPlan("u", 100, None, allreduce=True),
                      TensorPlan("v", 1000, 0.01),
                      TensorPlan("w", 2000, 0.01, offload=True),
                      TensorPlan("z", 10, None)), "per_tensor")
    # compute: u ready 1; v ready 2, inline sparsify → 2.5; w grad at 3.5, worker 3.5→5.0;
    # z ready 4.5. AR part (u, 400 B): ready 1 → 0.1 + 0.4 = 0.5 → 1.0..1.5.
    # AG part: v k=10, w k=20 → 30 entries × 8 B, z sent whole → 10 values × 4 B (no index):
    # 280 B → 0.1+0.56=0.66; ready = max(2.5, 5.0, 4.5) = 5.0 → 5.0..5.66.
    tl = simulate(Plan("ssfusion_oi", [buf]), cm)
    row = tl.buffers[0]
    assert row["ar_start"] == pytest.approx(1.0) and row["ar_end"] == pytest.approx(1.5)
    assert row["ag_start"] == pytest.approx(5.0) and row["ag_end"] == pytest.approx(5.66)
    assert tl.iteration == pytest.approx(5.66)
    assert tl.sparsify == pytest.approx(2.0)
    assert tl.exposed_comm == pytest.approx(5.66 - 4.5)
    # the same buffer with w inline: w done at 4.0, z ready at 5.0 → AG 5.0..5.66 as well,
    # but the compute stream now ends at 5.0
    inline = BufferPlan(tuple(TensorPlan(t.name, t.numel, t.density, False, t.allreduce)
                              for t in buf.tensors), "per_tensor")
    tl2 = simulate(Plan("ssfusion_i", [inline]), cm)
    assert tl2.iteration == pytest.approx(5.66) and tl2.exposed_comm == pytest.approx(0.66)


# ---- Cupcake's DP -----------------------------------------------------------------------------
def contiguous_groupings(names):
    L = len(names)
    for cuts in itertools.product([False, True], repeat=L - 1):
        groups, cur = [], [names[0]]
        for n, cut in zip(names[1:], cuts):
            if cut:
                groups.append(cur)
                cur = []
            cur.append(n)
        groups.append(cur)
        yield groups


def fused_plan(groups, numel, density):
    return Plan("x", [BufferPlan(tuple(TensorPlan(n, numel[n], None) for n in g), "fused",
                                 density) for g in groups])


def test_cupcake_dp_equals_brute_force_over_contiguous_groupings():
    for seed in range(12):
        names, numel, cm = random_model(100 + seed, L=random.Random(seed).randint(1, 10))
        density = random.Random(seed).choice([0.001, 0.01, 0.1])
        groups, t_dp = cupcake_groups(names, numel, cm, density)
        brute = min(simulate(fused_plan(g, numel, density), cm).iteration
                    for g in contiguous_groupings(names))
        got = simulate(fused_plan(groups, numel, density), cm).iteration
        assert got == pytest.approx(brute, rel=1e-9, abs=1e-12)
        assert t_dp == pytest.approx(got, rel=1e-9, abs=1e-12)


def test_cupcake_without_a_spare_core_counts_each_buffers_start_ups_in_the_backward():
    """Where the communication threads have no core beside the training thread's
    (``info["cores_per_rank"]`` below two), each buffer's all-gather start-ups, (P−1)α and the
    collective's fixed CPU, hold the backward's core: FindOptFusion is then exactly the DP of
    a model whose sparsifier start-up carries them (checked by brute force over every
    contiguous grouping), which changes some plans; where two buffers overlap with a spare
    core, without one they fuse."""
    fewer = 0
    for seed in range(12):
        names, numel, cm = random_model(300 + seed, L=random.Random(seed).randint(2, 9))
        density = random.Random(seed).choice([0.001, 0.01, 0.1])
        spare, _ = cupcake_groups(names, numel, cm, density)
        cm.info = {"device": "cpu", "cores_per_rank": 1.0}
        groups, t_dp = cupcake_groups(names, numel, cm, density)
        host = (cm.P - 1) * cm.allgather.alpha + cm.t_compute_allgather(0)
        folded = dataclasses.replace(cm, info={}, sparsify=AffineFit(cm.sparsify.a + host,
                                                                     cm.sparsify.b))
        brute = min(simulate(fused_plan(g, numel, density), folded).iteration
                    for g in contiguous_groupings(names))
        assert t_dp == pytest.approx(brute, rel=1e-9, abs=1e-12), seed
        fewer += len(groups) < len(spare)
    assert fewer  # the rule changes some plans, not none
    # start-ups that dominate: with a spare core two buffers overlap, without one they fuse
    names, numel = ["a", "b"], {"a": 400_000, "b": 400_000}
    cm = cost_model(numel, {"a": 4e-3, "b": 4e-3}, P=4, sp=(0.0, 1e-9), ag=(1e-3, 3e-8))
    assert len(cupcake_groups(names, numel, cm, 0.01)[0]) == 2
    cm.info = {"device": "cpu", "cores_per_rank": 1.0}
    assert len(cupcake_groups(names, numel, cm, 0.01)[0]) == 1


def test_cupcake_is_never_worse_than_fixed_wfbp_or_one_buffer():
    for seed in range(15):
        names, numel, cm = random_model(200 + seed)
        cup = simulate(make_plan("cupcake", names, numel, 0.01, cm), cm).iteration
        others = {
            "single": [names],
            "wfbp": [[n] for n in names],
            "mgwfbp": mgwfbp_groups(names, numel, cm, 0.01),
            "fixed": fixed_buckets(names, numel, 4, 1 << 20),
        }
        for what, groups in others.items():
            t = simulate(fused_plan(groups, numel, 0.01), cm).iteration
            assert cup <= t * (1 + 1e-12), (seed, what)


def test_single_rank_fuses_everything():
    names, numel, cm = random_model(7, L=15)
    cm.P = 1  # no communication cost at all: one sparsification start-up is best
    assert len(make_plan("cupcake", names, numel, 0.01, cm).buffers) == 1


def test_mgwfbp_merges_when_startup_dominates_and_splits_when_it_does_not():
    names = [f"t{i}" for i in range(6)]
    numel = dict.fromkeys(names, 1000)
    tb = dict.fromkeys(names, 1e-3)
    # huge start-up, free bytes → merging never delays enough to pay: one buffer
    cm = cost_model(numel, tb, P=4, sp=(0, 0), ag=(1.0, 0))
    assert len(mgwfbp_groups(names, numel, cm, 0.1)) == 1
    # no start-up, bytes cost → sending each gradient when ready is as good: never merge
    # would delay; WFBP (one per tensor)
    cm = cost_model(numel, tb, P=4, sp=(0, 0), ag=(0, 1e-7))
    assert len(mgwfbp_groups(names, numel, cm, 0.1)) == len(names)


# ---- SSFusion: Eq. 2 selection and compensation -----------------------------------------------
def eq2_comp(buf, cm):
    """Σ_j (T_b^j + T_gpu^j) over the buffer, T_gpu = 0 for a dense tensor."""
    return sum(cm.backward[t.name] + (cm.sparsify.a + cm.sparsify.b * t.numel
                                      if t.density is not None else 0.0) for t in buf.tensors)


def comm_time(buf, cm):
    """T_cm of a per-tensor buffer without an all-reduce part (everything all-gathered)."""
    # a tensor sent whole: its values only (no index); a sparsified one: index + value per entry
    nbytes = sum(t.numel * cm.elem_bytes if t.density is None
                 else target_k(t.numel, t.density) * (4 + cm.elem_bytes) for t in buf.tensors)
    return t_ag(cm, nbytes)


def test_eq2_holds_with_the_fewest_exclusions_of_the_smallest_tensors():
    # buffer 0: one big tensor whose all-gather takes T_cm^1; buffer 1: three small tensors
    # and a large one. Inline T_sp = 1 ms each (b = 0), T_b = 0.1 ms each.
    numel = {"big0": 2_000_000, "s1": 300, "s2": 100, "s3": 200, "big4": 1_000_000}
    tb = dict.fromkeys(numel, 1e-4)
    # T_cm^1 = 3α + 3·k·8·β with k = 20000 → choose β so that T_cm^1 = 2.45 ms:
    # all sparsified: 0.4 + 4 = 4.4 ms; −s2: 3.4; −s3: 2.4 ≤ 2.45 → exactly two exclusions.
    beta = (2.45e-3 - 3 * 1e-5) / (3 * 20000 * 8)
    cm = cost_model(numel, tb, P=4, sp=(1e-3, 0.0), ag=(1e-5, beta))
    groups = [["big0"], ["s1", "s2", "s3", "big4"]]
    bufs, info = selective_buffers(groups, numel, cm, 0.01)
    assert info[0]["eq2"] == "n/a" and all(t.density is not None for t in bufs[0].tensors)
    assert info[1]["eq2"] == "holds"
    assert sorted(info[1]["excluded"]) == ["s2", "s3"]  # the two smallest
    dense = {t.name for t in bufs[1].tensors if t.density is None}
    assert dense == {"s2", "s3"}
    assert comm_time(bufs[0], cm) >= eq2_comp(bufs[1], cm)  # Eq. 2
    # one exclusion fewer (only s2) would violate it
    assert comm_time(bufs[0], cm) < eq2_comp(bufs[1], cm) + 1e-3


def _model_wide(groups, numel, excluded, density=0.01, floor=0.001):
    """Per-tensor buffers with ``excluded`` whole and the others at the model-wide d′, found
    here by scanning d′ on a fine grid (not by the code under test's bisection)."""
    names = [n for g in groups for n in g]
    k_s = density * sum(numel.values()) - sum(numel[n] for n in excluded)
    S = [numel[n] for n in names if n not in excluded]

    def f(d):
        return sum(target_k(n, d) for n in S)

    grid = [floor + (density - floor) * i / 20_000 for i in range(20_001)]
    d = min(grid, key=lambda d: (abs(f(d) - k_s), -d)) if f(floor) < k_s else floor
    return [BufferPlan(tuple(TensorPlan(n, numel[n], None if n in excluded else d) for n in g),
                       "per_tensor") for g in groups]


def test_eq2_on_random_plans_holds_where_reported_and_excludes_smallest_first():
    holds = unreachable = first_excludes = 0
    for seed in range(25):
        names, numel, cm = random_model(300 + seed)
        # Eq. 2 as published: one selection per tensor, no min_k
        plan = make_plan("ssfusion", names, numel, 0.01, cm, min_k=1, pooled=False)
        groups = [[t.name for t in b.tensors] for b in plan.buffers]
        excluded_before: set[str] = set()
        for i, (buf, inf) in enumerate(zip(plan.buffers, plan.info["eq2"])):
            dense = [t for t in buf.tensors if t.density is None]
            sparse = [t for t in buf.tensors if t.density is not None]
            assert sorted(inf["excluded"]) == sorted(t.name for t in dense)
            if dense and sparse:  # excluded tensors are never larger than sparsified ones
                assert max(t.numel for t in dense) <= min(t.numel for t in sparse)
            if i == 0:  # no earlier communication: Eq. 2 undefined, least simulated time
                assert inf["eq2"] == "n/a"
                first_excludes += bool(dense)
            else:
                # T_cm^{i−1} with the exclusions decided so far, compensated model-wide
                prev = comm_time(_model_wide(groups, numel, excluded_before)[i - 1], cm)
                assert inf["T_cm_prev"] == pytest.approx(prev, rel=2e-3)
                if inf["eq2"] == "holds":
                    holds += 1
                    assert inf["T_cm_prev"] >= eq2_comp(buf, cm) * (1 - 1e-12)
                else:
                    unreachable += 1
                    assert inf["eq2"] == "unreachable"
            excluded_before |= {t.name for t in dense}
    assert holds and unreachable and first_excludes  # every path exercised


def test_first_buffer_excludes_its_small_tensors_as_in_fig_8b():
    # Fig. 7(b)/8(b): Buffer_1 = [G7, G6, G5, G4] (backward order), Buffer_2 = [G3, G2, G1];
    # G5, G4 (in Buffer_1) and G2, G1 are small. With a sparsification start-up of 2 ms and
    # a cheap link, sparsifying a 100-element tensor costs more than sending it whole: the
    # plan leaves G5, G4, G2, G1 unsparsified, Buffer_1 included (Fig. 8(b)'s caption).
    numel = {"G7": 1_000_000, "G6": 800_000, "G5": 100, "G4": 60,
             "G3": 900_000, "G2": 80, "G1": 40}
    tb = dict.fromkeys(numel, 1e-3)
    cm = cost_model(numel, tb, P=4, sp=(2e-3, 0.0), ag=(1e-5, 1e-11))
    groups = [["G7", "G6", "G5", "G4"], ["G3", "G2", "G1"]]
    bufs, info = selective_buffers(groups, numel, cm, 0.01)
    dense = {t.name for b in bufs for t in b.tensors if t.density is None}
    assert dense == {"G5", "G4", "G2", "G1"}
    assert info[0]["eq2"] == "n/a" and sorted(info[0]["excluded"]) == ["G4", "G5"]
    # and it is faster than keeping Buffer_1 per-tensor sparsified
    keep = _model_wide(groups, numel, {"G2", "G1"})
    assert simulate(Plan("s", bufs), cm).iteration < simulate(Plan("k", keep), cm).iteration


def test_eq2_unreachable_falls_back_sensibly():
    # previous buffer's communication is tiny; the backward alone exceeds it → unreachable.
    numel = {"a": 1_000_000, "b": 50, "c": 80, "d": 500_000}
    tb = dict.fromkeys(numel, 1e-2)
    # sparsification costs nothing: excluding cannot help → everything stays sparsified
    cm = cost_model(numel, tb, P=4, sp=(0.0, 0.0), ag=(1e-6, 1e-12))
    bufs, info = selective_buffers([["a"], ["b", "c", "d"]], numel, cm, 0.01)
    assert info[1]["eq2"] == "unreachable"
    assert info[1]["excluded"] == [] and all(t.density == 0.01 for t in bufs[1].tensors)
    # expensive sparsification start-up: excluding the small ones now shortens the iteration
    cm = cost_model(numel, tb, P=4, sp=(5e-3, 0.0), ag=(1e-6, 1e-12))
    bufs, info = selective_buffers([["a"], ["b", "c", "d"]], numel, cm, 0.01)
    assert info[1]["eq2"] == "unreachable"
    assert sorted(info[1]["excluded"]) == ["b", "c"]
    base = [BufferPlan(tuple(TensorPlan(n, numel[n], 0.01) for n in g), "per_tensor")
            for g in (["a"], ["b", "c", "d"])]
    assert simulate(Plan("s", bufs), cm).iteration < simulate(Plan("p", base), cm).iteration


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(20_000, 2_000_000), min_size=1, max_size=8),
       st.lists(st.integers(1, 2000), min_size=0, max_size=10),
       st.sampled_from([0.005, 0.01, 0.05]))
def test_compensation_keeps_the_buffer_at_the_target_density(large, small, density):
    numels = small + large
    sparse = [False] * len(small) + [True] * len(large)
    d, info = compensate(numels, sparse, density, min_density=0.001)
    k_target = density * sum(numels)
    k = sum(small) + sum(target_k(n, d) for n in large)
    assert info["k_sent"] == k
    assert d >= 0.001 and d <= density
    if info["floor"]:
        assert d == 0.001
        assert sum(target_k(n, 0.001) for n in large) >= k_target - sum(small)
    else:
        assert abs(k - k_target) <= 0.03 * k_target + len(large)


def test_compensation_floor_and_no_op_cases():
    d, info = compensate([1000, 10**6], [False, True], 0.01)
    assert d == pytest.approx((0.01 * 1_001_000 - 1000) / 10**6, rel=1e-3)
    d, info = compensate([50_000, 10**6], [False, True], 0.01)  # dense part too big
    assert d == 0.001 and info["floor"]
    d, info = compensate([10**6, 10**6], [True, True], 0.01)  # nothing excluded
    assert d == 0.01
    d, info = compensate([10**6], [True], 0.0005)  # target below the floor: never raised
    assert d == 0.0005
    assert compensate([10, 20], [False, False], 0.01)[0] is None


def test_compensation_charges_excluded_tensors_at_their_wire_cost():
    # an all-reduced fp32 element at P = 4 costs 2·(3/4)·4 = 6 bytes, an all-gathered entry
    # 3·8 = 24: a quarter of an entry
    assert allreduce_charge(4, 4) == 0.25 and allreduce_charge(2, 4) == 0.5
    assert allreduce_charge(4, 2) == pytest.approx(2 * 2 / (4 * 6))  # bf16 values, int32 index
    assert allreduce_charge(1, 4) == 1.0  # one rank sends nothing either way
    d, info = compensate([1000, 10**6], [False, True], 0.01, charge=0.25)
    assert d == pytest.approx((0.01 * 1_001_000 - 250) / 10**6, rel=1e-3)
    assert info["dense_numel"] == 1000 and info["dense_charged"] == 250
    three = ([1000, 500, 10**6], [False, False, True], 0.01)  # charge per tensor
    d1, d2, d3 = (compensate(*three, charge=c)[0] for c in (1.0, [1.0, 0.5, 1.0], 0.5))
    assert d1 < d2 < d3
    assert d2 == pytest.approx((0.01 * 1_001_500 - 1250) / 10**6, rel=1e-3)
    for bad in ([1.0], [1.0, 0.0], [1.0, float("nan")]):
        with pytest.raises(ValueError, match="charge"):
            compensate([1000, 10**6], [False, True], 0.01, charge=bad)
    with pytest.raises(ValueError, match="integers"):
        allreduce_charge(0, 4)


def test_ssfusion_plan_sends_about_the_target_volume_with_one_model_wide_density():
    checked = 0
    for seed in range(10):
        names, numel, cm = random_model(400 + seed, sizes=(64, 512, 200_000, 1_000_000))
        plan = make_plan("ssfusion", names, numel, 0.01, cm, pooled=False)
        ds = {t.density for b in plan.buffers for t in b.tensors if t.density is not None}
        assert len(ds) <= 1  # §IV-B(i): one compensated density over the model
        # bytes per rank and peer: index + value per sparse entry, values only for a tensor
        # sent whole (P = 4, fp32)
        sent = sum(t.numel * 4 if t.density is None else t.k * 8
                   for b in plan.buffers for t in b.tensors)
        target = 0.01 * sum(numel.values()) * 8
        if not plan.info["compensation"]["floor"]:
            assert abs(sent - target) <= 0.01 * target + 8 * len(names)
            checked += 1
        for t in (t for b in plan.buffers for t in b.tensors):
            assert t.density is None or t.density >= 0.001
    assert checked


def test_compensation_is_model_wide_not_per_buffer():
    # a buffer holding small excluded tensors and one small weight: per-buffer compensation
    # would push that weight to the floor (1 entry of 288, as conv1 of the CNN); model-wide,
    # the large tensors of other buffers absorb the dense entries and every sparsified tensor
    # keeps nearly the target density
    numel = {"fc1.w": 401_408, "fc1.b": 128, "fc2.w": 1280, "fc2.b": 10,
             "conv2.w": 18_432, "conv2.b": 64, "conv1.w": 288, "conv1.b": 32}
    groups = [["fc2.b", "fc2.w", "fc1.b", "fc1.w"], ["conv2.b", "conv2.w", "conv1.b", "conv1.w"]]
    tb = dict.fromkeys(numel, 1e-4)
    cm = cost_model(numel, tb, P=4, sp=(2e-3, 0.0), ag=(1e-5, 1e-11))
    bufs, _ = selective_buffers(groups, numel, cm, 0.01)
    dense = [t for b in bufs for t in b.tensors if t.density is None]
    sparse = [t for b in bufs for t in b.tensors if t.density is not None]
    assert {t.name for t in dense} >= {"conv1.b", "conv2.b"}  # some small ones excluded
    d = {t.density for t in sparse}
    assert len(d) == 1
    (d,) = d
    total = sum(numel.values())
    expect = (0.01 * total - sum(t.numel for t in dense)) / sum(t.numel for t in sparse)
    assert d == pytest.approx(expect, rel=0.01) and d > 0.005
    assert abs(sum(t.k for b in bufs for t in b.tensors) - 0.01 * total) <= len(numel)
    assert all(t.k >= 2 for t in sparse if t.numel >= 288)  # no weight collapses to 1 entry


# ---- SSFusion-O ------------------------------------------------------------------------------
def test_offload_marks_exactly_the_tensors_that_finish_within_the_buffer_backward():
    checked = 0
    for seed in range(25):
        names, numel, cm = random_model(500 + seed)
        plan = make_plan("ssfusion_o", names, numel, 0.01, cm, pooled=False)
        for buf in plan.buffers:
            bound = sum(cm.backward[t.name] for t in buf.tensors)
            clock = worker = 0.0
            for t in buf.tensors:
                clock += cm.backward[t.name]
                if t.density is None:
                    assert not t.offload
                    continue
                finish = max(clock, worker) + cm.offload.a + cm.offload.b * t.numel
                if t.offload:
                    assert finish <= bound * (1 + 1e-12)
                    worker = finish
                    checked += 1
                else:  # kept inline only when offloading it would overrun the backward
                    assert finish > bound
                    clock += cm.sparsify.a + cm.sparsify.b * t.numel
    assert checked > 0


def test_offload_on_a_gpu_host_only_where_the_worker_is_also_faster():
    """On a GPU host (cost.info["device"] == "cuda") a tensor that would fit in the backward is
    still kept inline when its offloaded sparsification (copies included) is slower than the
    inline kernels: the copies would be paid for nothing. Where the worker is faster, the CPU
    rule applies unchanged. On a CPU that selects each buffer at once (info["segmented"],
    ``--segments-on-cpu``) nothing is offloaded, however fast the worker."""
    numel = {"a": 400_000, "b": 400_000, "c": 32}
    tb = {"a": 1.0, "b": 1.0, "c": 1.0}  # a long backward: every offload fits in it
    slow_worker = cost_model(numel, tb, sp=(1e-5, 1e-12), off=(4e-4, 3e-9))
    fast_worker = cost_model(numel, tb, sp=(4e-4, 3e-9), off=(1e-5, 1e-12))

    def offloaded(cm) -> list[bool]:
        plan = make_plan("ssfusion_o", list(numel), numel, 0.01, cm, pooled=False)
        return [t.offload for b in plan.buffers for t in b.tensors if t.density is not None]

    for cm, offloaded_on_gpu in ((slow_worker, False), (fast_worker, True)):
        cpu = offloaded(cm)
        cm.info["device"] = "cuda"
        gpu = offloaded(cm)
        cm.info.update(device="cpu", segmented=True)
        segmented = offloaded(cm)
        assert any(cpu)  # the CPU host: what fits in the backward is offloaded
        assert gpu == (cpu if offloaded_on_gpu else [False] * len(cpu))
        assert segmented == [False] * len(cpu)


def test_a_cpu_host_offloads_only_where_the_worker_has_a_core_of_its_own(monkeypatch):
    """SSFusion-O on a CPU host whose cores, shared out over its ranks, leave each rank fewer
    than two (info["cores_per_rank"]): nothing is offloaded, however well it would fit in the
    backward, and the plan's info says why. With two or more, and for a cost model profiled
    before the key, the rule is unchanged. ``cores_per_rank`` shares the process's cores out
    over LOCAL_WORLD_SIZE."""
    numel = {"a": 400_000, "b": 400_000, "c": 32}
    tb = {"a": 1.0, "b": 1.0, "c": 1.0}
    cm = cost_model(numel, tb, sp=(4e-4, 3e-9), off=(1e-5, 1e-12))

    def offloaded(cores):
        cm.info.pop("cores_per_rank", None)
        if cores is not None:
            cm.info["cores_per_rank"] = cores
        plan = make_plan("ssfusion_o", list(numel), numel, 0.01, cm, pooled=False)
        return plan, [t.offload for b in plan.buffers for t in b.tensors if t.density is not None]

    _, before = offloaded(None)
    assert any(before)
    for cores in (2.0, 16.0):
        assert offloaded(cores)[1] == before
    for cores in (0.5, 1.0, 1.5):
        plan, marks = offloaded(cores)
        assert marks == [False] * len(before)
        assert all(o.get("cores_per_rank") == cores for o in plan.info["offload"])
    cm.info["device"] = "cuda"  # an accelerator's worker is the host's, not the rank's core
    assert offloaded(0.5)[1] == offloaded(None)[1]

    # the function as imported with this module: conftest.pin_profiles replaces the module's
    # attribute (for the engine's plans) in whichever process runs it first
    cores = len(os.sched_getaffinity(0))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert cores_per_rank() == cores / 4
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert cores_per_rank() == cores


# ---- SSFusion-I -------------------------------------------------------------------------------
def brute_t1_t2(tb, tsp, dense, dbytes, agbytes, P, ar, ag, host=False):
    """``host``: Buffer_AR's start-ups run on the backward's core (no core of its own)."""
    n = len(tb)
    best = math.inf
    for l in range(n + 1):
        in_ar = [j < l and dense[j] for j in range(n)]
        t1 = sum(tb[j] + tsp[j] for j in range(l))
        rest = sum(tb[j] + tsp[j] for j in range(l, n))
        ar_b = sum(dbytes[j] for j in range(n) if in_ar[j])
        ag_b = sum(agbytes[j] for j in range(n) if not in_ar[j])
        tar = (2 * (P - 1) * ar[0] + 2 * (P - 1) / P * ar_b * ar[1]) if any(in_ar) else 0.0
        tag = ((P - 1) * ag[0] + (P - 1) * ag_b * ag[1]) if not all(in_ar) else 0.0
        extra = 2 * (P - 1) * ar[0] if host and any(in_ar) else 0.0
        best = min(best, t1 + max(tar, rest + extra) + tag)
    return best


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_best_split_is_the_brute_force_minimum_of_t1_plus_t2(data):
    n = data.draw(st.integers(1, 9))
    f = st.floats(0, 1e-2)
    tb = data.draw(st.lists(f, min_size=n, max_size=n))
    tsp = data.draw(st.lists(f, min_size=n, max_size=n))
    dense = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    tsp = [0.0 if d else s for d, s in zip(dense, tsp)]
    dbytes = data.draw(st.lists(st.integers(4, 10**6), min_size=n, max_size=n))
    agbytes = [b * 2 if d else data.draw(st.integers(8, 10**5)) for b, d in zip(dbytes, dense)]
    P = data.draw(st.integers(1, 64))
    ar = (data.draw(st.floats(0, 1e-3)), data.draw(st.floats(0, 1e-8)))
    ag = (data.draw(st.floats(0, 1e-3)), data.draw(st.floats(0, 1e-8)))
    cm = cost_model({"x": 1}, {"x": 0.0}, P=P, ar=ar, ag=ag)
    host = data.draw(st.booleans())
    l, v = best_split(tb, tsp, dense, dbytes, agbytes, cm.t_allreduce, cm.t_allgather,
                      cm.t_allreduce_host if host else None)
    assert 0 <= l <= n
    expect = brute_t1_t2(tb, tsp, dense, dbytes, agbytes, P, ar, ag, host)
    assert v == pytest.approx(expect, rel=1e-9, abs=1e-15)


def test_ssfusion_i_splits_without_a_spare_core_only_where_the_bytes_saved_pay():
    """Four small dense tensors early in the backward, one large sparse tensor after them: with
    a core beside the training thread the all-reduce hides behind the rest of the backward and
    the split is taken (it moves bytes off the all-gather for free); with one core per rank its
    2(P−1) start-ups delay that backward, and the split is taken only where the all-gather's
    bytes it saves cost more than they do."""
    numel = {"d0": 10, "d1": 1280, "d2": 128, "d3": 64, "w": 400_000}
    tb = {"d0": 1e-4, "d1": 1e-4, "d2": 1e-4, "d3": 1e-4, "w": 5e-3}

    def split(cores: float, ag_beta: float, call: float | None = None) -> int:
        cm = cost_model(numel, tb, P=2, ar=(1e-4, 8e-9), ag=(1e-4, ag_beta))
        cm.info = {"device": "cpu", "cores_per_rank": cores}
        if call is not None:  # the warm-up's measured cost of a call above its start-ups
            cm.info["call_overhead_s"] = call
        plan = make_plan("ssfusion_oi", list(numel), numel, 0.01, cm, min_k=1, pooled=False)
        return sum(t.allreduce for b in plan.buffers for t in b.tensors)

    assert split(cores=2.0, ag_beta=8e-9) == 4  # a spare core: the all-reduce is hidden
    assert split(cores=2.0, ag_beta=8e-9, call=1e-3) == 4  # ... and so is its call
    # one core per rank: 2 start-ups of 0.1 ms against 1482 floats' all-gather bytes
    assert split(cores=1.0, ag_beta=8e-9) == 0  # 1 Gbit/s: 47 us saved, 200 us spent
    assert split(cores=1.0, ag_beta=8e-7) == 4  # 10 Mbit/s: 4.7 ms saved
    # with the call's own cost (1 ms above its start-ups): 100 Mbit/s's 0.47 ms saved no
    # longer pays, 10 Mbit/s's 4.7 ms still does
    assert split(cores=1.0, ag_beta=8e-8) == 4 and split(cores=1.0, ag_beta=8e-8, call=1e-3) == 0
    assert split(cores=1.0, ag_beta=8e-7, call=1e-3) == 4


def test_ssfusion_oi_splits_every_buffer_at_its_best_split():
    seen_ar = 0
    for seed in range(20):
        names, numel, cm = random_model(600 + seed)
        cm.allgather = AlphaBeta(cm.allgather.alpha, cm.allreduce.beta * 20)  # AG expensive
        plan = make_plan("ssfusion_oi", names, numel, 0.01, cm, pooled=False)
        base = make_plan("ssfusion_o", names, numel, 0.01, cm, pooled=False)
        for buf, ref, sp in zip(plan.buffers, base.buffers, plan.info["split"]):
            # same exclusions and offloads as SSFusion-O; the all-reduce flags differ, and d′
            # only rises (compensation charges all-reduced tensors at their bytes)
            assert [(t.name, t.density is None, t.offload) for t in buf.tensors] == \
                   [(t.name, t.density is None, t.offload) for t in ref.tensors]
            assert all(t.density >= r.density for t, r in zip(buf.tensors, ref.tensors)
                       if t.density is not None)
            l = sp["split"]
            flags = [t.allreduce for t in buf.tensors]
            assert flags == [j < l and t.density is None for j, t in enumerate(buf.tensors)]
            seen_ar += sum(flags)
            # the split is decided at the element-count d′ (the selection's compensation)
            d0 = plan.info["eq2"][-1]["density"]
            ts = [t if t.density is None else dataclasses.replace(t, density=d0)
                  for t in ref.tensors]
            tsp = [0.0 if t.density is None or t.offload else
                   cm.sparsify.a + cm.sparsify.b * t.numel for t in ts]
            expect = brute_t1_t2([cm.backward[t.name] for t in ts], tsp,
                                 [t.density is None for t in ts], [t.numel * 4 for t in ts],
                                 [t.numel * 4 if t.density is None else t.k * 8
                                  for t in ts], cm.P,
                                 (cm.allreduce.alpha, cm.allreduce.beta),
                                 (cm.allgather.alpha, cm.allgather.beta))
            assert sp["T1+T2"] == pytest.approx(expect, rel=1e-9)
    assert seen_ar > 0


@pytest.mark.parametrize("P", [1, 2, 4, 8])
def test_ssfusion_oi_sends_the_target_bytes_with_all_reduced_tensors_charged_at_theirs(P):
    """Each rank's bytes, counted as the torch.distributed calls send them (ring all-reduce
    2(P−1)/P·4 bytes per element, all-gather (P−1)·8 per entry): SSFusion-I's plan sends what
    every tensor at the target density through the all-gather would, within k's rounding; at
    the element count (the d′ of the selection) it sends less; and from P = 3 on it sends less
    with SSFusion-O's d′ (whole tensors in the all-gather charged at their values, 1/2 of an
    entry, against 2/P in the all-reduce) whenever it all-reduces something."""
    below = 0
    for seed in range(12):
        names, numel, cm = random_model(900 + seed, sizes=(64, 512, 200_000, 1_000_000))
        cm.P = P
        cm.allgather = AlphaBeta(cm.allgather.alpha, cm.allreduce.beta * 20)  # AG expensive
        plan = make_plan("ssfusion_oi", names, numel, 0.01, cm, pooled=False)
        base = make_plan("ssfusion_o", names, numel, 0.01, cm, pooled=False)
        ts = [t for b in plan.buffers for t in b.tensors]
        if plan.info["compensation"]["floor"] or not any(t.allreduce for t in ts):
            continue

        def sent(tensors, flags):  # bytes per rank; flags: all-reduced or not
            if P == 1:  # nothing travels: the paper's element count
                return sum(t.k for t in tensors)
            return sum(t.numel * 4 * 2 * (P - 1) / P if ar
                       else t.numel * 4 * (P - 1) if t.density is None  # values only
                       else t.k * 8 * (P - 1)
                       for t, ar in zip(tensors, flags))

        target = 0.01 * sum(numel.values()) * (1 if P == 1 else 8 * (P - 1))
        n_sparse = sum(1 for t in ts if t.density is not None)
        slack = 0.01 * target + n_sparse * (1 if P == 1 else 8 * (P - 1))
        now = sent(ts, [t.allreduce for t in ts])
        assert abs(now - target) <= slack
        flags = [t.allreduce for t in ts]
        d0 = plan.info["eq2"][-1]["density"]
        counted = [t if t.density is None else dataclasses.replace(t, density=d0) for t in ts]
        before = sent([t for b in base.buffers for t in b.tensors], flags)
        if P > 1:
            assert sent(counted, flags) < now
            assert before <= now
            below += before < now
    assert below or P <= 2  # P = 2: the all-reduce sends 4 bytes per element, as the all-gather


# ---- round trips and bad inputs ---------------------------------------------------------------
def test_plan_round_trips_through_json():
    names, numel, cm = random_model(11, L=20)
    for scheme in SCHEMES:
        plan = make_plan(scheme, names, numel, 0.01, cm)
        back = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
        assert back.buffers == plan.buffers
        assert back.overlap == plan.overlap and back.scheme == plan.scheme
        assert back.to_dict() == plan.to_dict()


def test_bad_inputs_raise_value_error():
    names, numel, cm = random_model(12, L=6)
    with pytest.raises(ValueError, match="unknown scheme"):
        make_plan("nope", names, numel, 0.01, cm)
    with pytest.raises(ValueError, match="unknown scheme"):
        needs_cost_model("nope")
    for s in ("multi_tensor", "omgs", "cupcake", "ssfusion", "ssfusion_o", "ssfusion_oi"):
        assert needs_cost_model(s)
        with pytest.raises(ValueError, match="cost model"):
            make_plan(s, names, numel, 0.01)
    assert not needs_cost_model("dense") and not needs_cost_model("per_tensor")
    for d in (0, -0.1, 1.5, float("nan"), "x", None):
        with pytest.raises(ValueError, match="density"):
            make_plan("topka", names, numel, d)
    assert make_plan("topka", names, numel, 1.0).buffers[0].density == 1.0
    with pytest.raises(ValueError):
        make_plan("dense", [], {}, 0.01)
    with pytest.raises(ValueError, match="duplicate"):
        make_plan("dense", ["a", "a"], {"a": 1}, 0.01)
    with pytest.raises(ValueError, match="numel"):
        make_plan("dense", ["a", "b"], {"a": 1}, 0.01)
    with pytest.raises(ValueError, match="backward time"):
        make_plan("cupcake", [*names, "extra"], {**numel, "extra": 5}, 0.01, cm)
    with pytest.raises(ValueError):
        make_plan("dense", names, numel, 0.01, bucket_bytes=0)
    with pytest.raises(ValueError):
        TensorPlan("a", 10, None, offload=True)
    with pytest.raises(ValueError):
        TensorPlan("a", 10, 0.1, allreduce=True)
    with pytest.raises(ValueError):
        BufferPlan((TensorPlan("a", 10, 0.1),), "dense")
    with pytest.raises(ValueError):
        BufferPlan((TensorPlan("a", 10, None),), "fused")  # fused needs a density
    with pytest.raises(ValueError):
        BufferPlan((), "dense")
    with pytest.raises(ValueError, match="more than once"):
        Plan("x", [BufferPlan((TensorPlan("a", 1, None),), "dense")] * 2)
    with pytest.raises(ValueError):
        Plan.from_dict({"buffers": []})
    with pytest.raises(ValueError, match="backward time"):
        simulate(Plan("x", [BufferPlan((TensorPlan("zz", 1, None),), "dense")]), cm)


def test_schemes_without_a_cost_model_plan_as_the_engine_runs_them():
    """The engine gives a scheme that does not need a cost model none (warm-up: one step for
    the backward order), so the simulator, which always has one, must get the same plan:
    per_tensor is DDP's buckets with every tensor sparsified on its own, never Cupcake's."""
    names, numel, cm = random_model(12, L=6)
    bucket = 4 * sum(numel.values()) // 2  # DDP's buckets: two or three
    kw = {"elem_bytes": 4, "bucket_bytes": bucket}
    for s in SCHEMES:
        if needs_cost_model(s):
            continue
        with_cost = make_plan(s, names, numel, 0.01, cm, **kw)
        without = make_plan(s, names, numel, 0.01, **kw)
        assert (with_cost.buffers, with_cost.overlap) == (without.buffers, without.overlap), s
    pt = make_plan("per_tensor", names, numel, 0.01, cm, **kw)
    ddp = make_plan("dense_ovlp", names, numel, 0.01, cm, **kw)
    assert len(ddp.buffers) >= 2
    assert [[t.name for t in b.tensors] for b in pt.buffers] == \
        [[t.name for t in b.tensors] for b in ddp.buffers]
    assert all(b.mode == "per_tensor" and all(
        t.density == (None if target_k(t.numel, 0.01) < 8 else 0.01) for t in b.tensors)
        for b in pt.buffers)


def test_every_planner_of_the_table_is_registered_once():
    from gradsync.schedule import PLANNER_FUNCTIONS, planner, schemes
    assert sorted(PLANNER_FUNCTIONS) == sorted(schemes.PLANNERS)
    assert {s.planner for s in SCHEMES.values()} <= set(PLANNER_FUNCTIONS)
    with pytest.raises(ValueError, match="PLANNERS"):
        planner("nope")


# -- SSFusion in the DDP hook: small tensors whole only within the budget -------------------
@settings(max_examples=200, deadline=None)
@given(numels=st.lists(st.integers(1, 300_000), min_size=1, max_size=40),
       density=st.sampled_from([0.001, 0.01, 0.05, 0.3]),
       small=st.sampled_from([0, 1000, 102_400]), charge=st.sampled_from([0.25, 0.5, 1.0]),
       min_k=st.sampled_from([1, 8]))
def test_small_within_budget_excludes_the_smallest_until_the_budget(numels, density, small,
                                                                  charge, min_k):
    """Whole: every tensor that ``density`` gives fewer than ``min_k`` entries, when together
    they take at most half the budget (else none of them for that reason), and every tensor
    under ``min_k`` at the compensated d′ those leave, unless adding them would break that half;
    then, below the returned size, the smallest sizes below ``small`` while the whole ones take
    at most a quarter of the budget and the others, at the density floor, can still absorb
    them; one size more would not fit (or is not small)."""
    from gradsync.schedule.ssfusion import compensate, small_within_budget

    floor = min(0.001, density)
    cut, info = small_within_budget(numels, small, density, 0.001, charge, min_k)
    k_target = density * sum(numels)

    def spent(marks: list[bool]) -> float:
        return sum(charge * n for n, b in zip(numels, marks) if b)

    def under(d: float | None) -> list[bool]:
        return [d is not None and max(1, min(n, round(d * n))) < min_k for n in numels]

    below = under(density)
    forced = info["starved"]
    if spent(below) > 0.5 * k_target:
        assert forced == [False] * len(numels)
    else:
        assert all(f or not b for f, b in zip(forced, below))  # the target's marks, and more
        assert spent(forced) <= 0.5 * k_target
        d, _ = compensate(numels, [not f for f in forced], density, 0.001, charge)
        more = [f or u for f, u in zip(forced, under(d))]
        assert more == forced or spent(more) > 0.5 * k_target  # closed at its own d′

    def fits(c: int) -> bool:  # forced and the others below c whole: within a quarter, absorbed?
        whole = [f or n < c for n, f in zip(numels, forced)]
        sent = sum(charge * n for n, w in zip(numels, whole) if w)
        return sent <= 0.25 * k_target and sent + sum(
            max(1, round(floor * n)) for n, w in zip(numels, whole) if not w) < k_target

    for n, f in zip(numels, forced):
        if n < cut and not f:
            assert n < small
    if any(n < cut and not f for n, f in zip(numels, forced)):
        assert fits(cut)
    above = sorted(n for n, f in zip(numels, forced) if n >= cut and not f)
    if above and above[0] < small:
        assert not fits(above[0] + 1)  # maximal: the next size would break the budget
        assert info["budget"]


def test_small_within_budget_keeps_insight_2_where_small_tensors_are_few():
    """On models whose small tensors are a small share of the budget (VGG-16's shapes at 1 %:
    4.5 % of it at half an entry per element), every tensor below 102,400 entries stays whole,
    as the fixed threshold had it. Where they would take more than a quarter (ResNet-50 at 5 %:
    its 126 tensors below 102,400 entries hold 3 % of its 25.6 M, 30 % of the budget), the
    smallest stay whole up to that quarter: 119 of the 126, the BatchNorm vectors among them; on
    a model whose tensors are all below it (TinyGPT-sized), sending them whole would send the
    model dense: most are sparsified."""
    from gradsync.apps.models import reference
    from gradsync.schedule.ssfusion import WHOLE_SHARE, small_within_budget

    assert WHOLE_SHARE == 0.25
    numels = [p.numel() for p in reference("vgg16", device="meta").parameters()]
    cut, info = small_within_budget(numels, 102_400, 0.01, 0.001, 0.5, 8)
    assert not info["budget"] and all((n < cut) == (n < 102_400) for n in numels)
    numels = [p.numel() for p in reference("resnet50", device="meta").parameters()]
    cut, info = small_within_budget(numels, 102_400, 0.05, 0.001, 0.5, 8)
    whole = [n for n in numels if n < cut]
    assert info["budget"] and len(whole) == 119 and max(whole) < 102_400
    nxt = min(n for n in numels if n >= cut)  # the next size would break the quarter
    assert 0.5 * sum(whole) <= 0.25 * 0.05 * sum(numels)
    assert 0.5 * sum(n for n in numels if n <= nxt) > 0.25 * 0.05 * sum(numels)
    assert all(n < cut for n in numels if n <= 2048)  # every BatchNorm vector
    tiny = [16_384] * 8 + [4096] * 8 + [64] * 20 + [256] * 4
    cut, info = small_within_budget(tiny, 102_400, 0.01, 0.001, 0.5, 8)
    assert info["budget"] and cut <= 4096
    assert sum(n for n in tiny if n < cut) * 0.5 < 0.01 * sum(tiny)
