"""TAGC for FSDP2 (gradsync.fsdp): exactness, selective compression, training, checkpoints.

One ``run_distributed`` call per world size; the rank function runs every case and returns the
raw results, and the parent checks them against references it computes itself (inputs are
regenerated from their seeds and summed with plain torch; plain FSDP2 runs side by side).
"""

from __future__ import annotations

import functools
import io
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from conftest import sharded_gpt
from gradsync.integrations.fsdp import (
    TAGCConfig,
    all_layers,
    compressed_parameters,
    compressed_share,
    linear_like,
    non_attention_linear,
)
from gradsync.testing import run_distributed

# -- synthetic reduce-scatter inputs, regenerated in the parent ------------------------------
ROWS, COLS = 480, 1024  # one Linear weight: a shard holds ROWS / P blocks of 1024 lanes


@functools.lru_cache(maxsize=64)
def _sparse_input(case: int, rank: int, world: int, density: float) -> torch.Tensor:
    """Rank's flat P×S buffer: half its nonzeros shared by all ranks (OR ≠ SUM there)."""
    n = ROWS * COLS
    shared = torch.Generator().manual_seed(10_000 + case)
    own = torch.Generator().manual_seed(1000 * case + rank)
    k = max(1, int(density * n / 2))
    x = torch.zeros(n)
    x[torch.randperm(n, generator=shared)[:k]] = torch.randn(k, generator=own)
    x[torch.randperm(n, generator=own)[:k]] = torch.randn(k, generator=own)
    return x


@functools.lru_cache(maxsize=16)
def _dense_input(case: int, rank: int) -> torch.Tensor:
    return torch.randn(ROWS * COLS, generator=torch.Generator().manual_seed(1000 * case + rank))


# (case id, ratio, index_bits, index method, op, per-rank density)
EXACT_CASES = [
    (1, 2, 1, "auto", "sum", 0.05),  # gloo: bitwise-OR reduce-scatter
    (2, 4, 4, "auto", "sum", 0.02),  # summed 4-bit counters
    (3, 10, 1, "gather", "avg", 0.004),  # the pairwise exchange other backends use
    (4, 10, 4, "auto", "sum", 0.004),
    (5, 4, 1, "max", "sum", 0.02),  # a byte per element, MAX
]
LOSSY_CASE = 6  # density 0.5 at 10x: peeling must fail and say so
THETA_CASE = 7  # θ = 0.95, dense input, two steps: accumulation


def _fc_tagc(config):
    from torch.distributed.fsdp import fully_shard

    from gradsync.integrations.fsdp import compress

    model = nn.Sequential()
    model.add_module("fc", nn.Linear(COLS, ROWS, bias=False))
    fully_shard(model)
    return compress(model, config)


def _call(tagc, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
    world = dist.get_world_size()
    out = torch.empty(x.numel() // world)
    rs = tagc.reduce_scatter("root")
    red = dist.ReduceOp.AVG if op == "avg" else dist.ReduceOp.SUM
    rs(out, x, dist.group.WORLD, red)
    return out


def _synthetic_cases(rank: int, world: int) -> dict:
    res: dict = {"exact": {}}
    for case, ratio, bits, method, op, density in EXACT_CASES:
        t = _fc_tagc(TAGCConfig(ratio=ratio, index_bits=bits, theta=0.0, policy=all_layers,
                                index_method=method))
        out = _call(t, _sparse_input(case, rank, world, density), op)
        u = t.units["root"]
        res["exact"][case] = {"out": out, "stats": t.stats(), "length": u.sketch.length,
                              "direct": u.sketch.direct, "n": u.n_comp}
    # Lossy: report, then raise on every rank.
    t = _fc_tagc(TAGCConfig(ratio=10, theta=0.0, policy=all_layers))
    out = _call(t, _sparse_input(LOSSY_CASE, rank, world, 0.5))
    res["lossy"] = {"stats": t.stats(), "out": out}
    t = _fc_tagc(TAGCConfig(ratio=10, theta=0.0, policy=all_layers, on_failure="raise"))
    try:
        _call(t, _sparse_input(LOSSY_CASE, rank, world, 0.5))
        res["raised"] = None
    except RuntimeError as e:  # PeelError is a RuntimeError
        res["raised"] = type(e).__name__
    # θ > 0: two steps on the same dense input; accumulators returned for the parent.
    t = _fc_tagc(TAGCConfig(ratio=2, theta=0.95, policy=all_layers))
    x = _dense_input(THETA_CASE, rank)
    out1 = _call(t, x)
    acc1 = t.units["root"].acc.clone()
    out2 = _call(t, x)
    acc2 = t.units["root"].acc.clone()
    res["theta"] = {"out1": out1, "acc1": acc1, "out2": out2, "acc2": acc2, "stats": t.stats()}
    return res


# -- TinyGPT under fully_shard ---------------------------------------------------------------



def _lm_loss(m, xb, yb):
    out = m(xb)
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), yb.reshape(-1))


VOCAB = 4096


def _equivalence(rank: int, world: int) -> dict:
    """θ = 0, embedding compressed; inputs use 32 of 4096 tokens (sparse embedding grads)."""
    from gradsync.integrations.fsdp import compress

    plain = sharded_gpt(vocab=VOCAB)
    tagc_model = sharded_gpt(vocab=VOCAB)
    t = compress(tagc_model, TAGCConfig(ratio=4, theta=0.0,
                                        policy=lambda name, mod: name == "embed"))
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(7))[:32]
    diffs = {}
    for _ in range(2):
        xb = tokens[torch.randint(0, 32, (4, 32), generator=g)]
        yb = torch.randint(0, VOCAB, (4, 32), generator=g)
        for m in (plain, tagc_model):
            for p in m.parameters():
                p.grad = None
            _lm_loss(m, xb, yb).backward()
        for (n, a), (_, b) in zip(plain.named_parameters(), tagc_model.named_parameters()):
            ga, gb = a.grad.to_local(), b.grad.to_local()
            d = float((ga - gb).abs().max()) if ga.numel() else 0.0
            scale = float(ga.abs().max()) if ga.numel() else 0.0
            diffs[n] = max(diffs.get(n, 0.0), d)
            diffs[n + "/scale"] = max(diffs.get(n + "/scale", 0.0), scale)
    u = t.units["root"]
    return {"diffs": diffs, "stats": t.stats(), "direct": u.sketch.direct,
            "plan": t.plan()}


def _text() -> torch.Tensor:
    import gradsync

    root = Path(gradsync.__file__).parent
    raw = b"".join(p.read_bytes() for p in sorted(root.rglob("*.py")))
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.int64)


def _train(rank: int, world: int, steps: int = 30) -> dict:
    """Default TAGC (θ = 0.99, 10x, 1-bit, non-attention linear) on real text."""
    from gradsync.integrations.fsdp import compress

    m = sharded_gpt()
    t = compress(m, TAGCConfig())
    data, g = _text(), torch.Generator().manual_seed(rank)
    opt = torch.optim.Adam(m.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        st = torch.randint(len(data) - 33, (8,), generator=g).tolist()
        xb = torch.stack([data[i: i + 32] for i in st])
        yb = torch.stack([data[i + 1: i + 33] for i in st])
        loss = _lm_loss(m, xb, yb)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    # Checkpoint round trip through bytes, into a fresh model of the same layout.
    sd = t.state_dict()
    buf = io.BytesIO()
    torch.save(sd, buf)
    t2 = compress(sharded_gpt(), TAGCConfig())
    t2.load_state_dict(torch.load(io.BytesIO(buf.getvalue())))
    same = {n: bool(torch.equal(t.units[n].acc, t2.units[n].acc)) for n in t.units}
    errors = []
    cfg = sd["config"]
    for bad in ({**sd, "world_size": world + 1},
                {**sd, "accumulators": {k: v[:, :-1] for k, v in sd["accumulators"].items()}},
                {**sd, "config": {**cfg, "seed": cfg["seed"] + 1}},
                {**sd, "config": {**cfg, "ratio": 4}}, {**sd, "config": {**cfg, "theta": 0.5}},
                {**sd, "rank": (rank + 1) % world},
                {**sd, "plan": {**sd["plan"], "root": []}}):
        try:
            t2.load_state_dict(bad)
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    identity = t.identity()
    return {"losses": losses, "stats": t.stats(), "keys": sorted(sd["accumulators"]),
            "same": same, "errors": errors, "plan": t.plan(),
            "identity": (identity.kind, identity.rank, identity.world_size),
            "header": (sd["rank"], sd["world_size"], sd["config"])}


def _rank_fn(rank: int, world: int, train: bool) -> dict:
    out = {"synthetic": _synthetic_cases(rank, world), "equiv": _equivalence(rank, world)}
    if train:
        out["train"] = _train(rank, world)
    return out


@pytest.fixture(scope="module", params=[2, 4])
def runs(request):
    world = request.param
    return world, _run(world)


@functools.lru_cache(maxsize=2)
def _run(world: int):
    return run_distributed(_rank_fn, world, world == 2, timeout=300)


@pytest.fixture(scope="module")
def train_run():
    """The training run (2 ranks only, for time): shared with the P=2 equivalence checks."""
    return 2, _run(2)


# -- checks ----------------------------------------------------------------------------------
def _expected(world: int, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    total = torch.stack(inputs).sum(0).view(world, -1)
    return [total[r] for r in range(world)]


def test_compressed_path_exact_when_peelable(runs):
    world, res = runs
    for case, _ratio, bits, method, op, density in EXACT_CASES:
        want = _expected(world, [_sparse_input(case, r, world, density) for r in range(world)])
        for r in range(world):
            got = res[r]["synthetic"]["exact"][case]
            exp = want[r] / world if op == "avg" else want[r]
            assert not got["direct"], "the sketch must really hash (not the identity layout)"
            assert got["stats"]["lossy_peels"] == 0
            torch.testing.assert_close(got["out"], exp, rtol=1e-5, atol=1e-6)
            # Bytes: ring reduce-scatter of P sketches (fp32) and of P packed indices.
            n, length = got["n"], got["length"]
            assert length < n  # a real compression
            assert got["stats"]["sketch_bytes_per_step"] == (world - 1) * length * 4
            index_bytes = n if method == "max" else math.ceil(n * bits / 8)
            assert got["stats"]["index_bytes_per_step"] == (world - 1) * index_bytes
            assert got["stats"]["plain_bytes_per_step"] == 0


def test_lossy_peel_is_reported_and_raised_everywhere(runs):
    world, res = runs
    for r in range(world):
        st = res[r]["synthetic"]["lossy"]["stats"]
        assert st["lossy_peels"] == 1 and st["unresolved"] > 0
        assert res[r]["synthetic"]["raised"] in ("PeelError", "RuntimeError")


def test_theta_accumulates_what_it_zeroed(runs):
    world, res = runs
    xs = [_dense_input(THETA_CASE, r) for r in range(world)]
    s = ROWS * COLS // world
    k = round(0.05 * s)
    q1 = [xs[r] - res[r]["synthetic"]["theta"]["acc1"].reshape(-1) for r in range(world)]
    # step 2 sends x + acc1 − acc2
    q2 = [xs[r] + res[r]["synthetic"]["theta"]["acc1"].reshape(-1)
          - res[r]["synthetic"]["theta"]["acc2"].reshape(-1) for r in range(world)]
    for r in range(world):
        # each destination chunk keeps exactly k = round((1 − θ)·S) values, the largest
        for q, x in ((q1[r], xs[r]),):
            nz = (q.view(world, s) != 0).sum(1)
            assert nz.tolist() == [k] * world
            kept = q.view(world, s).abs()
            zeroed = (x.view(world, s) - q.view(world, s)).abs()
            assert bool((kept.max(1).values >= zeroed.max(1).values).all())
            assert bool((kept.masked_fill(kept == 0, math.inf).min(1).values
                         >= zeroed.max(1).values).all())
    want1, want2 = _expected(world, q1), _expected(world, q2)
    for r in range(world):
        th = res[r]["synthetic"]["theta"]
        assert th["stats"]["lossy_peels"] == 0
        torch.testing.assert_close(th["out1"], want1[r], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(th["out2"], want2[r], rtol=1e-5, atol=1e-5)


def test_theta0_fsdp_gradients_equal_plain_fsdp2(runs):
    world, res = runs
    for r in range(world):
        eq = res[r]["equiv"]
        assert not eq["direct"]
        assert eq["stats"]["lossy_peels"] == 0
        assert eq["stats"]["sketch_bytes_per_step"] > 0
        assert eq["plan"]["root"]["compressed"] == ["embed.weight"]
        names = [n for n in eq["diffs"] if not n.endswith("/scale")]
        assert "embed.weight" in names and len(names) == 29
        for n in names:
            tol = 1e-5 * max(1.0, eq["diffs"][n + "/scale"])
            assert eq["diffs"][n] <= tol, (n, eq["diffs"][n])
    # the compared embedding gradients are not all zero
    assert max(res[r]["equiv"]["diffs"]["embed.weight/scale"] for r in range(world)) > 0


def test_default_theta_training_loss_goes_down(train_run):
    world, res = train_run
    for r in range(world):
        tr = res[r]["train"]
        losses = tr["losses"]
        assert all(math.isfinite(v) for v in losses)
        first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
        assert last < first - 0.5, (first, last)
        st = tr["stats"]
        assert st["steps"] == 30
        assert st["sketch_bytes_per_step"] > 0 and st["plain_bytes_per_step"] > 0
        # the compressed parameters cost far less than their plain fp32 reduce-scatter would
        assert st["sketch_bytes_per_step"] + st["index_bytes_per_step"] < st["plain_bytes_per_step"]


def test_policy_selects_by_module(train_run):
    _, res = train_run
    plan = res[0]["train"]["plan"]
    comp = {p for u in plan.values() for p in u["compressed"]}
    plain = {p for u in plan.values() for p in u["plain"]}
    for i in range(2):
        b = f"blocks.{i}."
        assert {b + "attn_qkv.weight", b + "attn_qkv.bias", b + "ln1.weight",
                b + "ln2.bias"} <= plain
        assert {b + "mlp_fc.weight", b + "mlp_proj.weight", b + "attn_out.weight",
                b + "attn_out.bias"} <= comp
    assert {"embed.weight", "pos.weight", "lm_head.weight"} <= comp
    assert {"ln_f.weight", "ln_f.bias"} <= plain
    assert not comp & plain


def test_state_dict_round_trip(train_run):
    world, res = train_run
    for r in range(world):
        tr = res[r]["train"]
        assert tr["keys"] == [f"rank{r}/{u}" for u in ("blocks.0", "blocks.1", "root")]
        assert all(tr["same"].values()) and len(tr["same"]) == 3
        assert tr["errors"][0] is not None and f"{world + 1} ranks" in tr["errors"][0]
        assert tr["errors"][1] is not None and "shape" in tr["errors"][1]
        # accumulators of another TAGC configuration are refused
        for err, field in zip(tr["errors"][2:5], ("seed", "ratio", "theta")):
            assert err is not None and f"{field}=" in err
        assert tr["errors"][5] is not None and f"rank {(r + 1) % world}" in tr["errors"][5]
        assert tr["errors"][6] is not None and "other units" in tr["errors"][6]
        assert tr["identity"] == ("tagc", r, world)
        assert tr["header"] == (r, world, {"theta": 0.99, "ratio": 10, "index_bits": 1,
                                           "seed": 0})


# -- single-process checks -------------------------------------------------------------------
@pytest.mark.parametrize("kwargs", [
    {"ratio": 3}, {"ratio": 1}, {"ratio": True}, {"index_bits": 2}, {"index_bits": 8},
    {"theta": -0.1}, {"theta": 1.0}, {"theta": float("nan")}, {"theta": "high"},
    {"policy": "non_attention_linear"}, {"on_failure": "ignore"}, {"seed": -1}, {"seed": 1.5},
    {"index_method": "xor"}, {"index_method": None},
])
def test_bad_config_raises(kwargs):
    with pytest.raises(ValueError):
        TAGCConfig(**kwargs)


def test_good_config_accepted():
    for ratio in (2, 4, 10):
        for bits in (1, 4):
            c = TAGCConfig(ratio=ratio, index_bits=bits, theta=0.0)
            assert (c.ratio, c.index_bits, c.theta) == (ratio, bits, 0.0)


def test_auto_index_method():
    """OR on gloo, summed counters for 4 bits up to P = 15, else the pairwise exchange
    (never a byte-per-element MAX: in a reduce-scatter the bitmaps are cheaper at every P)."""
    from gradsync.collectives.tagc import choose_method

    for P in (2, 15, 16, 64):
        assert choose_method(1, P, "gloo") == "bor"
        assert choose_method(1, P, "nccl") == "gather"
        assert choose_method(4, P, "nccl") == ("count4" if P <= 15 else "gather")


def test_sparse_chunk_encoding_equals_the_sketch_encode():
    from gradsync.collectives.tagc import encode_chunks as _encode_chunks
    from gradsync.formats.sketch import CountSketch

    g = torch.Generator().manual_seed(3)
    for n, ratio in ((50_000, 10), (3000, 2), (700, 4)):  # hashed, and the identity layout
        sk = CountSketch(n, ratio, seed=5)
        q = torch.randn(3, n, generator=g) * (torch.rand(3, n, generator=g) < 0.05)
        want = torch.stack([sk.encode(q[j]) for j in range(3)])
        torch.testing.assert_close(_encode_chunks(sk, q), want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(_encode_chunks(sk, q.to(torch.bfloat16)),
                                   torch.stack([sk.encode(q[j].to(torch.bfloat16))
                                                for j in range(3)]), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError):
        _encode_chunks(sk, torch.full((1, 700), float("nan")))


def test_default_policy_on_module_names():
    lin, emb, ln = nn.Linear(4, 4), nn.Embedding(4, 4), nn.LayerNorm(4)
    for name in ("blocks.0.attn_qkv", "attn.q_proj", "attn.k_proj", "attn.v_proj", "h.0.c_attn",
                 "layer.query_key_value", "attn.to_q", "attn.wq", "self_attn.query"):
        assert not non_attention_linear(name, lin), name
    for name in ("blocks.0.attn_out", "attn.o_proj", "self_attn.out_proj", "mlp.fc1",
                 "mlp_proj", "lm_head", "ffn.up_proj", "mlp.c_fc"):
        assert non_attention_linear(name, lin), name
    assert non_attention_linear("embed", emb)
    assert not non_attention_linear("ln1", ln)
    assert not non_attention_linear("attn", nn.MultiheadAttention(4, 2))


# -- the policy on Hugging Face GPT-2 (Conv1D layers) -----------------------------------------
class _DuckLinear(nn.Module):
    """A linear layer that is no nn.Linear (as quantised and adapter linears are)."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.in_features, self.out_features = n_in, n_out
        self.weight = nn.Parameter(torch.zeros(n_out, n_in))
        self.bias = nn.Parameter(torch.zeros(n_out))


def test_linear_like_by_duck_typing():
    from transformers.pytorch_utils import Conv1D

    hf = Conv1D(12, 4)  # nf=12 outputs, nx=4 inputs: weight (in, out), transposed vs Linear
    assert tuple(hf.weight.shape) == (4, 12) and not isinstance(hf, nn.Linear)
    for m in (nn.Linear(4, 3), hf, _DuckLinear(4, 3)):
        assert linear_like(m), type(m).__name__
    for m in (nn.Embedding(4, 3), nn.LayerNorm(4), nn.Conv1d(2, 3, 1), nn.Conv2d(2, 3, 1),
              nn.MultiheadAttention(4, 2), nn.Sequential(nn.Linear(2, 2)), nn.Bilinear(2, 2, 2)):
        assert not linear_like(m), type(m).__name__
    assert non_attention_linear("h.0.mlp.c_fc", hf) and non_attention_linear("h.0.attn.c_proj", hf)
    assert not non_attention_linear("h.0.attn.c_attn", hf)
    assert non_attention_linear("mlp.up", _DuckLinear(4, 3))
    assert not non_attention_linear("attn.q_proj", _DuckLinear(4, 3))


def _gpt2_expected():
    """The names TAGC §3.2 compresses in gpt2_small and their share, from its config alone."""
    from gradsync.apps.models import build

    model = build("gpt2_small")
    cfg = model.hf.config
    E, L, V, N = cfg.n_embd, cfg.n_layer, cfg.vocab_size, cfg.n_positions
    inner = cfg.n_inner or 4 * E
    comp = {"hf.transformer.wte.weight", "hf.transformer.wpe.weight"}
    plain = {"hf.transformer.ln_f.weight", "hf.transformer.ln_f.bias"}
    for i in range(L):
        b = f"hf.transformer.h.{i}."
        comp |= {b + f"{m}.{p}" for m in ("attn.c_proj", "mlp.c_fc", "mlp.c_proj")
                 for p in ("weight", "bias")}
        plain |= {b + f"{m}.{p}" for m in ("attn.c_attn", "ln_1", "ln_2")
                  for p in ("weight", "bias")}
    per_block_comp = (E * E + E) + (E * inner + inner) + (inner * E + E)
    per_block_plain = (E * 3 * E + 3 * E) + 4 * E
    n_comp = V * E + N * E + L * per_block_comp  # lm_head is tied to wte: counted once
    n_all = n_comp + L * per_block_plain + 2 * E
    return model, comp, plain, n_comp / n_all


def test_gpt2_small_feed_forward_and_post_attention_projections_are_compressed():
    from transformers.pytorch_utils import Conv1D

    model, comp, plain, share = _gpt2_expected()
    blk = model.hf.transformer.h[0]
    assert all(isinstance(m, Conv1D) for m in (blk.attn.c_attn, blk.attn.c_proj, blk.mlp.c_fc,
                                               blk.mlp.c_proj))
    chosen = compressed_parameters(model)
    assert set(chosen) == comp and not set(chosen) & plain
    assert compressed_share(model) == pytest.approx(share, abs=1e-12)
    assert 0.7 < compressed_share(model) < 0.85  # "roughly 80%" (TAGC §3.2), not 9.4%
    # the share follows the policy: all layers -> 1, nothing -> 0
    assert compressed_share(model, all_layers) == 1.0
    assert compressed_share(model, lambda n, m: False) == 0.0


def _gpt2_tagc(rank: int, world: int) -> dict:
    """gpt2_small under FSDP2 (every block and the model) with default TAGC: one step."""
    from torch.distributed.fsdp import fully_shard

    from gradsync.apps.models import build
    from gradsync.integrations.fsdp import compress

    m = build("gpt2_small", seed=0)
    for blk in m.hf.transformer.h:
        fully_shard(blk)
    fully_shard(m)
    t = compress(m, TAGCConfig())
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, 256, (4, 16), generator=g)
    out = m(x)
    nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), x.reshape(-1)).backward()
    return {"plan": t.plan(), "stats": t.stats()}


def test_gpt2_small_under_fsdp2_compresses_those_layers():
    _, comp, plain, _ = _gpt2_expected()
    res = run_distributed(_gpt2_tagc, 2, timeout=300)
    for r in res:
        got_comp = {p for u in r["plan"].values() for p in u["compressed"]}
        got_plain = {p for u in r["plan"].values() for p in u["plain"]}
        assert got_comp == comp and got_plain == plain


def test_param_group_found_in_either_torch_layout():
    """torch 2.13 keeps FSDP's parameter groups in a list, torch 2.11 (the CUDA image
    ``make gpu-check`` ran on) one group or None; TAGC reads both."""
    from types import SimpleNamespace

    from gradsync.integrations.fsdp import _fsdp_param_group

    def module(**state):
        return SimpleNamespace(_get_fsdp_state=lambda: SimpleNamespace(**state))

    g = object()
    assert _fsdp_param_group(module(_fsdp_param_groups=[g])) is g
    assert _fsdp_param_group(module(_fsdp_param_groups=[])) is None
    assert _fsdp_param_group(module(_fsdp_param_group=g)) is g
    assert _fsdp_param_group(module(_fsdp_param_group=None)) is None
    with pytest.raises(ValueError, match="several parameter groups"):
        _fsdp_param_group(module(_fsdp_param_groups=[g, object()]))
