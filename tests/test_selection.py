"""Selection fixes of issue 11: SSFusion's model-wide density-aware compensation in the engine's
planner and in the DDP hook (SSFusion §IV-B(i)), Ok-Topk's local threshold reuse in the engine
(Algorithm 1 lines 2–4) and SIDCo's adaptive stages.

Expected values are computed here (sizes, k = max(1, round(d·n)), the densities a plan must
give), not taken from the code under test.
"""

from __future__ import annotations

import pytest
import torch

import gradsync.integrations.ddp
from conftest import image_batch
from gradsync.apps.models import build
from gradsync.engine import GradSync
from gradsync.engine.config import Config
from gradsync.integrations.ddp import _densities
from gradsync.schedule import make_plan, selective_buffers
from gradsync.schedule.costmodel import AffineFit, AlphaBeta, CostModel
from gradsync.sparsify.base import target_k

DENSITY = 0.01


def _cnn():
    torch.manual_seed(0)
    model = build("cnn")
    names = [n for n, _ in model.named_parameters()][::-1]  # backward order
    numel = {n: p.numel() for n, p in model.named_parameters()}
    return model, names, numel


def _cnn_cost(names, numel, P=4):
    """A cost model of the CNN in which every tensor's backward is 0.2 ms and sparsifying costs
    1 ms + 1 ns per element (so a start-up-bound small tensor is cheaper sent whole)."""
    return CostModel(P=P, order=names, numel=dict(numel), elem_bytes=4,
                     backward=dict.fromkeys(names, 2e-4), sparsify=AffineFit(1e-3, 1e-9),
                     offload=AffineFit(2e-3, 3e-9), allreduce=AlphaBeta(1e-4, 1e-9),
                     allgather=AlphaBeta(1e-4, 1e-9))


def _model_wide_density(numel, excluded, density=DENSITY):
    """d′ with Σ_{sparsified} k(n, d′) ≈ density·Σn − Σ_{excluded} n, by a fine scan."""
    sparse = [n for name, n in numel.items() if name not in excluded]
    k_s = density * sum(numel.values()) - sum(numel[n] for n in excluded)
    grid = [0.001 + (density - 0.001) * i / 20_000 for i in range(20_001)]
    return min(grid, key=lambda d: abs(sum(target_k(n, d) for n in sparse) - k_s))


# the CNN's tensors in backward order, cut into fusion buffers three ways
GROUPINGS = {
    "one buffer": [[f"classifier.3.{x}" for x in ("bias", "weight")]
                   + [f"classifier.1.{x}" for x in ("bias", "weight")]
                   + [f"features.3.{x}" for x in ("bias", "weight")]
                   + [f"features.0.{x}" for x in ("bias", "weight")]],
    "classifier | features": [["classifier.3.bias", "classifier.3.weight", "classifier.1.bias",
                               "classifier.1.weight"],
                              ["features.3.bias", "features.3.weight", "features.0.bias",
                               "features.0.weight"]],
    "per layer": [["classifier.3.bias", "classifier.3.weight"],
                  ["classifier.1.bias", "classifier.1.weight"],
                  ["features.3.bias", "features.3.weight"],
                  ["features.0.bias", "features.0.weight"]],
}


@pytest.mark.parametrize("P", [1, 4, 8])
@pytest.mark.parametrize("grouping", list(GROUPINGS))
def test_cnn_densities_do_not_collapse_and_the_model_sends_the_target(grouping, P):
    _, names, numel = _cnn()
    groups = GROUPINGS[grouping]
    assert sorted(n for g in groups for n in g) == sorted(names)
    buffers, _ = selective_buffers(groups, numel, _cnn_cost(names, numel, P), DENSITY)
    tensors = [t for b in buffers for t in b.tensors]
    excluded = {t.name for t in tensors if t.density is None}
    sparse = [t for t in tensors if t.density is not None]
    assert excluded and sparse and all(numel[n] < 10_000 for n in excluded)
    d = _model_wide_density(numel, excluded)
    for t in sparse:  # one density for all, the model-wide one; no weight collapses
        assert t.density == pytest.approx(d, rel=0.01)
        assert t.k >= 0.5 * DENSITY * t.numel
    total = sum(numel.values())
    assert abs(sum(t.k for t in tensors) - DENSITY * total) <= len(tensors)


def test_engine_and_ddp_hook_give_the_same_densities():
    model, names, numel = _cnn()
    plan = make_plan("ssfusion", names, numel, DENSITY, _cnn_cost(names, numel))
    planned = {t.name: t.density for b in plan.buffers for t in b.tensors}
    excluded = {n for n, d in planned.items() if d is None}
    # the hook excludes by size: choose the cut that excludes the same tensors
    cut = max(numel[n] for n in excluded) + 1
    assert excluded == {n for n in names if numel[n] < cut}
    cfg = Config(scheme="ssfusion", density=DENSITY)
    state, _ = gradsync.integrations.ddp.hook(cfg, model=model, small_numel=cut)
    # DDP's buckets split the model arbitrarily; the densities must not depend on the split
    for bucket in (names, names[:3], names[3:], [names[0]], [names[-1], names[1]]):
        ds = _densities(state, [numel[n] for n in bucket])
        assert ds == [planned[n] for n in bucket]


def test_engine_runs_the_planned_model_wide_densities():
    model, _, numel = _cnn()
    sync = GradSync(model, Config(scheme="ssfusion", density=DENSITY, warmup_steps=1))
    try:
        for step in range(3):
            x, y = image_batch(0, step, 16)
            model.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            sync.synchronize()
        planned = {t.name: t.density for b in sync.plan.buffers for t in b.tensors}
        excluded = {n for n, d in planned.items() if d is None}
        d = _model_wide_density(numel, excluded)
        ran = {k: s.density for k, s in sync._parts.sparsifiers.items()}
        assert any(dp is not None for dp in planned.values())
        for name, dp in planned.items():
            if dp is not None:  # (warm-up sparsified every tensor at the target density)
                assert dp == pytest.approx(d, rel=0.01) and ran[name] == dp
    finally:
        sync.close()
