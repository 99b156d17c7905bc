"""``python -m gradsync bench fsdp``: plain FSDP2 vs TAGC, like TAGC Table 2 (§4.2).

Trains a GPT-like model (:class:`gradsync.apps.models.TinyGPT`, each block and the root
``fully_shard``-ed) on the bytes of this package's sources on ``--world-size`` gloo ranks and
times iterations (forward + backward + Adam step) of three variants, interleaved step by step so
that load changes on a shared machine hit all of them alike:

* ``FSDP``: FSDP2's own reduce-scatter;
* ``TAGC all``: every parameter compressed (:func:`gradsync.fsdp.all_layers`);
* ``TAGC non-attn``: the non-attention linear layers only (the paper's selective setting).

TAGC runs at Table 2's setting: 10x sketch, 1-bit index, θ = 0.99 (``--ratio``,
``--index-bits``, ``--theta`` change it). Reported per variant: median iteration seconds and the
ratio to FSDP in the same run, gradient-exchange milliseconds per step (time inside the
reduce-scatter calls) and per MB of gradient, bytes this rank sent per step in the
reduce-scatters (counted by :class:`~gradsync.collectives.comm.Comm` at the call; for FSDP from
its exact shard layout with the same ring accounting), lossy peels and unresolved nonzeros summed
over ranks, and the last loss. Runs on loopback, or with ``--bandwidth`` on per-rank
tbf-shaped links (:mod:`gradsync.testing.netem`, root; otherwise a one-line note and loopback).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

from gradsync.apps.bench._harness import bench_parser, print_rows, print_written
from gradsync.apps.common import add_common_args, write_outputs

if TYPE_CHECKING:
    from gradsync.integrations.fsdp import TAGC

VARIANTS = ("FSDP", "TAGC all", "TAGC non-attn")


def _text() -> torch.Tensor:
    import gradsync

    raw = b"".join(p.read_bytes() for p in sorted(Path(gradsync.__file__).parent.rglob("*.py")))
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.int64)


class _TimedReduceScatter(DefaultReduceScatter):
    """FSDP2's own reduce-scatter, timed (blocking, like TAGC's, so the clocks compare)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        t0 = time.perf_counter()
        super().__call__(output_tensor, input_tensor, group, op, async_op=False)
        self.seconds += time.perf_counter() - t0


def _variants(opts: dict[str, Any]
              ) -> tuple[dict[str, torch.nn.Module], dict[str, TAGC], _TimedReduceScatter,
                         list[int]]:
    """Each variant's sharded model; the TAGCs of the two compressed ones; the timed
    reduce-scatter plain FSDP runs; and plain FSDP's shard sizes, for its bytes."""
    from torch.distributed.fsdp import fully_shard

    from gradsync.apps.models import build
    from gradsync.integrations.fsdp import TAGCConfig, all_layers, compress, non_attention_linear

    def model():
        m = build("gpt_tiny", seed=0, dim=opts["dim"], layers=opts["layers"],
                  heads=opts["heads"], context=opts["context"])
        for blk in m.blocks:
            fully_shard(blk)
        fully_shard(m)
        return m

    def cfg(policy):
        return TAGCConfig(ratio=opts["ratio"], index_bits=opts["index_bits"],
                          theta=opts["theta"], policy=policy, seed=0)

    models, tagcs = {}, {}
    for v in VARIANTS:
        models[v] = model()
    # FSDP's own bytes: read its exact layout through a TAGC that compresses nothing, then
    # give the default reduce-scatter back.
    probe = compress(models["FSDP"], cfg(lambda name, mod: False))
    shard_numels = [u.shard_numel for u in probe.units.values()]
    probe.remove()
    timed = _TimedReduceScatter()
    for u in probe.units.values():
        u.module.set_custom_reduce_scatter(timed)
    tagcs["TAGC all"] = compress(models["TAGC all"], cfg(all_layers))
    tagcs["TAGC non-attn"] = compress(models["TAGC non-attn"], cfg(non_attention_linear))
    return models, tagcs, timed, shard_numels


def _rank(rank: int, world: int, opts: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    from gradsync.apps.models import build

    models, tagcs, timed, shard_numels = _variants(opts)
    opt = {v: torch.optim.Adam(models[v].parameters(), lr=opts["lr"]) for v in VARIANTS}
    n_params = sum(p.numel() for p in build("gpt_tiny", seed=0, dim=opts["dim"],
                                            layers=opts["layers"], heads=opts["heads"],
                                            context=opts["context"]).parameters())

    data, g = _text(), torch.Generator().manual_seed(1000 + rank)
    ctx, bs = opts["context"], opts["batch"]
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    losses: dict[str, float] = {}
    for step in range(opts["warmup"] + opts["steps"]):
        st = torch.randint(len(data) - ctx - 1, (bs,), generator=g).tolist()
        xb = torch.stack([data[i: i + ctx] for i in st])
        yb = torch.stack([data[i + 1: i + ctx + 1] for i in st])
        if step == opts["warmup"]:
            for t in tagcs.values():
                t.reset_stats()
            timed.seconds = 0.0
        for v in VARIANTS:
            dist.barrier()
            t0 = time.perf_counter()
            out = models[v](xb)
            loss = torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]),
                                                     yb.reshape(-1))
            opt[v].zero_grad(set_to_none=True)
            loss.backward()
            opt[v].step()
            dt = time.perf_counter() - t0
            if step >= opts["warmup"]:
                times[v].append(dt)
            losses[v] = float(loss.detach())
    res: dict[str, Any] = {}
    for v in VARIANTS:
        if v == "FSDP":
            st = {"bytes_sent_per_step": float(sum((world - 1) * s * 4 for s in shard_numels)),
                  "seconds_per_step": timed.seconds / opts["steps"], "lossy_peels": 0,
                  "unresolved": 0}
        else:
            st = tagcs[v].stats()
        lossy = torch.tensor([st["lossy_peels"], st["unresolved"]], dtype=torch.int64)
        dist.all_reduce(lossy)
        res[v] = {"median_s": statistics.median(times[v]), "times": times[v],
                  "bytes_sent_per_step": st["bytes_sent_per_step"],
                  "exchange_s_per_step": st["seconds_per_step"],
                  "lossy_peels": int(lossy[0]), "unresolved": int(lossy[1]),
                  "loss": losses[v],
                  "compressed_params": (sum(len(u["compressed"])
                                            for u in tagcs[v].plan().values())
                                        if v in tagcs else 0)}
    res["n_params"] = n_params
    return res


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """The options, ``--quick``'s settings applied; a bad one raises ``ValueError`` before
    anything starts."""
    ap = bench_parser("fsdp", __doc__)
    add_common_args(ap, "fsdp")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20, help="timed iterations per variant")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--ratio", type=int, default=10)
    ap.add_argument("--index-bits", type=int, default=1)
    ap.add_argument("--theta", type=float, default=0.99)
    ap.add_argument("--timeout", type=float, default=1200.0)
    ap.add_argument("--bandwidth", default=None,
                    help="per-rank tbf-shaped links of this rate (root; e.g. 100mbit, 1gbit); "
                         "default loopback")
    ap.add_argument("--quick", action="store_true",
                    help="tiny model and 3 steps (smoke test, seconds)")
    a = ap.parse_args(argv)
    if a.quick:
        a.dim, a.layers, a.context, a.batch, a.steps, a.warmup = 64, 2, 32, 4, 3, 1
    if a.world_size < 2:
        raise ValueError("--world-size must be >= 2 (FSDP does not reduce-scatter on 1 rank)")
    if a.steps < 1:
        raise ValueError("--steps must be >= 1")
    from gradsync.integrations.fsdp import TAGCConfig

    TAGCConfig(ratio=a.ratio, index_bits=a.index_bits, theta=a.theta)  # validates early
    if a.bandwidth is not None:
        from gradsync.testing import netem

        netem.parse_bandwidth(a.bandwidth)  # a bad rate fails before anything starts
    return a


def _launch(a: argparse.Namespace, opts: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
    """Every rank's :func:`_rank` result, on tbf-shaped links with ``--bandwidth`` (loopback
    where they cannot be made), and the link they ran on, in words."""
    if a.bandwidth is None:
        from gradsync.testing import run_distributed

        return run_distributed(_rank, a.world_size, opts, timeout=a.timeout), "loopback gloo"
    from gradsync.testing import netem

    out = netem.run_shaped(_rank, a.world_size, opts, bandwidth=a.bandwidth, timeout=a.timeout)
    return out, (f"tbf {a.bandwidth} per rank and direction" if out.shaped
                 else f"loopback ({a.bandwidth} requested; {out.reason})")


def _rows(out: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per variant from every rank's results: times over ranks, the rest rank 0's."""
    r0 = out[0]
    mb = r0["n_params"] * 4 / 2**20
    base_b = r0["FSDP"]["bytes_sent_per_step"]
    rows: list[dict[str, Any]] = []
    for v in VARIANTS:
        # iteration time: the slowest rank's median (ranks wait for each other anyway)
        med = max(o[v]["median_s"] for o in out)
        ex = r0[v]["exchange_s_per_step"]
        rows.append({
            "variant": v,
            "comp_params": r0[v]["compressed_params"],
            "iter_s": med,
            "iter/FSDP": med / max(o["FSDP"]["median_s"] for o in out),
            "xchg_ms": ex * 1e3,
            "xchg_ms/MB": ex * 1e3 / mb,
            "sent_B/step": r0[v]["bytes_sent_per_step"],
            "B/FSDP": r0[v]["bytes_sent_per_step"] / base_b,
            "lossy": r0[v]["lossy_peels"],
            "unresolved": r0[v]["unresolved"],
            "loss": r0[v]["loss"],
        })
    return rows


def _plot(rows: list[dict[str, Any]], a: argparse.Namespace) -> Callable[[Any], None]:
    """The PNG: each variant's iteration time and bytes sent over plain FSDP2's."""
    def plot(ax: Any) -> None:
        xs = range(len(rows))
        ax.bar([x - 0.2 for x in xs], [r["iter/FSDP"] for r in rows], 0.4,
               label="iteration time / FSDP")
        ax.bar([x + 0.2 for x in xs], [r["B/FSDP"] for r in rows], 0.4,
               label="bytes sent / FSDP")
        ax.set_xticks(list(xs), [r["variant"] for r in rows])
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_ylabel("ratio to plain FSDP2 (same run)")
        ax.set_title(f"TAGC vs FSDP2, P={a.world_size}, {a.ratio}x, θ={a.theta}")
        ax.legend()

    return plot


def main(argv: list[str] | None = None) -> int:
    a = _parse(argv)
    opts = {k: getattr(a, k) for k in ("dim", "layers", "heads", "context", "batch", "lr",
                                       "ratio", "index_bits", "theta", "steps", "warmup")}
    out, link = _launch(a, opts)
    r0 = out[0]
    rows = _rows(out)
    print_rows(
        f"FSDP2 vs TAGC (P={a.world_size}, TinyGPT dim {a.dim} × {a.layers} layers, "
        f"{r0['n_params']:,} params; {a.ratio}x, {a.index_bits}-bit index, θ={a.theta}; "
        f"median of {a.steps} steps; {link})", rows)
    print("iter_s: slowest rank's median iteration (fwd+bwd+Adam); xchg_ms: rank 0's seconds "
          "inside the reduce-scatter calls per step (ms/MB of fp32 gradient); sent_B/step: rank "
          "0's reduce-scatter payload; lossy/unresolved: peels summed over ranks.")
    meta = {**opts, "world_size": a.world_size, "n_params": r0["n_params"],
            "link": link,
            "per_rank": [{v: {k: o[v][k] for k in ("median_s", "bytes_sent_per_step")}
                          for v in VARIANTS} for o in out]}
    print_written(*write_outputs("fsdp", rows, a.out, plot=_plot(rows, a), meta=meta))
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
