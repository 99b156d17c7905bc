"""``python -m gradsync bench soak``: long runs at P ranks — memory, replica drift, faults.

For each scheme, ``--world-size`` gloo ranks train a small MLP (Fashion-MNIST-shaped synthetic
data labelled by a fixed random teacher, so the loss goes down) for ``--steps`` steps through
:class:`gradsync.GradSync` and record, per rank:

* **RSS** (resident set size, ``/proc/self/statm``) every ``--sample-every`` steps. The growth
  is measured from the first sample at or after ``--warmup`` steps (allocator pools, plans and
  cost-model profiling settle during warm-up) to the last sample. **Bound:** the growth of
  every rank must stay within ``--rss-bound-mb`` (default 16 MiB over the measured steps: a
  leak of one gradient-sized buffer per step of this model, 0.2 MiB, would exceed it within
  100 steps);
* **replica divergence**: every ``--check-every`` steps the ranks all-gather a SHA-256 of their
  parameters (:func:`gradsync.engine.consistency.parameter_digest`) and count mismatches; at the end
  they all-gather the flat parameters and report ``max |θ_r − θ_0|`` over ranks and entries.
  Both must be 0 (the engine promises bitwise-identical replicas);
* **faults injected and survived**: every ``--nan-every`` steps one rank (rotating) gets a NaN
  in one gradient during backward; with ``Config(nonfinite="skip_step")`` every rank must skip
  exactly that step (``synchronize()`` returns False, no optimizer step) and carry on; every
  ``--stall-every`` steps one rank sleeps ``--stall-ms`` (a straggler, well below the group
  timeout), which the others must simply wait out.

The command exits 0 only if, for every scheme, every rank's RSS growth is within the bound, the
divergence is 0 with no digest mismatch, skipped steps equal injected NaN steps on every rank,
and the final loss is finite. It prints a table and writes ``soak.json`` and ``soak.png`` (RSS
growth vs step per scheme and rank). ``--quick`` runs a few dozen steps at P = 2 (smoke test).
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from gradsync.apps.bench._harness import bench_parser, print_rows, print_written
from gradsync.apps.common import add_common_args, write_outputs

SCHEMES = ("dense_ovlp", "topka", "oktopk", "densestream", "ssfusion_oi")
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    """Resident set size of this process (Linux ``/proc/self/statm``; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):  # pragma: no cover - not Linux
        return 0


def _data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` 28×28 inputs labelled by a fixed random linear teacher (learnable, finite)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 28, 28, generator=g)
    teacher = torch.randn(784, 10, generator=g)
    return x, (x.view(n, -1) @ teacher).argmax(dim=1)


def _rank(rank: int, world: int, scheme: str, o: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist
    from torch import nn

    from gradsync.apps.models import build
    from gradsync.engine import GradSync
    from gradsync.engine.config import Config
    from gradsync.engine.consistency import parameter_digest

    torch.set_num_threads(1)
    model = build("mlp", seed=o["seed"], hidden=o["hidden"])
    opt = torch.optim.SGD(model.parameters(), lr=o["lr"], momentum=0.9)
    sync = GradSync(model, Config(scheme=scheme, density=o["density"], sparsifier="topk",
                                  warmup_steps=o["engine_warmup"], nonfinite="skip_step",
                                  timeout_s=o["timeout_s"], bucket_mb=o["bucket_mb"]))
    xs, ys = _data(o["samples"], o["seed"])
    g = torch.Generator().manual_seed(1_000_003 * (rank + 1) + o["seed"])
    target = model.net[3].weight  # the hidden layer's weight receives the injected NaN
    samples: list[tuple[int, int]] = []
    injected = skipped = stalls = mismatches = 0
    first_loss = last_loss = float("nan")
    t_start = time.perf_counter()
    for step in range(o["steps"]):
        idx = torch.randint(0, o["samples"], (o["batch"],), generator=g)
        opt.zero_grad(set_to_none=True)
        nan_step = o["nan_every"] > 0 and step % o["nan_every"] == o["nan_every"] - 1
        handle = None
        if nan_step:
            if (step // o["nan_every"]) % world == rank:
                def poison(grad: torch.Tensor) -> torch.Tensor:
                    grad = grad.clone()
                    grad.view(-1)[7] = float("nan")
                    return grad
                handle = target.register_hook(poison)
            injected += 1  # counted on every rank: every rank must skip it
        if (o["stall_every"] > 0 and step % o["stall_every"] == o["stall_every"] // 2
                and (step // o["stall_every"]) % world == rank):
            time.sleep(o["stall_ms"] / 1e3)  # a straggler: the others wait for it
            stalls += 1
        loss = nn.functional.cross_entropy(model(xs[idx]), ys[idx])
        loss.backward()
        if handle is not None:
            handle.remove()
        if sync.synchronize():
            opt.step()
        else:
            skipped += 1
        last_loss = float(loss.detach())
        if step == 0:
            first_loss = last_loss
        if step % o["sample_every"] == 0 or step == o["steps"] - 1:
            samples.append((step, rss_bytes()))
        if o["check_every"] and (step + 1) % o["check_every"] == 0:
            digest = torch.frombuffer(bytearray(parameter_digest(model)[0]), dtype=torch.uint8)
            all_d = [torch.empty_like(digest) for _ in range(world)]
            dist.all_gather(all_d, digest)
            mismatches += int(any(not torch.equal(d, all_d[0]) for d in all_d))
    seconds = time.perf_counter() - t_start
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    divergence = max(float((t - gathered[0]).abs().max()) for t in gathered)
    stats = sync.stats()
    sync.close()
    return {"rank": rank, "samples": samples, "injected": injected, "skipped": skipped,
            "engine_skipped": int(stats["total"]["skipped"]), "stalls": stalls,
            "digest_mismatches": mismatches, "divergence": divergence,
            "first_loss": first_loss, "last_loss": last_loss, "seconds": seconds,
            "bytes_sent": int(stats["total"]["bytes_sent"]),
            "n_params": int(flat.numel())}


def _growth(samples: list[tuple[int, int]], warmup: int) -> tuple[int, int, int]:
    """(baseline step, baseline RSS, end RSS): baseline = first sample at step >= warmup."""
    base = next(((s, r) for s, r in samples if s >= warmup), samples[-1])
    return base[0], base[1], samples[-1][1]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """The options, ``--quick``'s settings applied; a bad one raises ``ValueError`` before
    anything starts."""
    ap = bench_parser("soak", __doc__)
    add_common_args(ap, "soak")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--world-size", type=int, default=None, help="ranks (4; --quick: 2)")
    ap.add_argument("--schemes", nargs="+", default=list(SCHEMES))
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--hidden", type=int, default=64, help="MLP hidden width")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--warmup", type=int, default=200,
                    help="steps before the RSS baseline sample")
    ap.add_argument("--sample-every", type=int, default=20, help="RSS sampling period")
    ap.add_argument("--check-every", type=int, default=100, help="digest check period")
    ap.add_argument("--nan-every", type=int, default=97, help="NaN gradient period (0: off)")
    ap.add_argument("--stall-every", type=int, default=250, help="straggler period (0: off)")
    ap.add_argument("--stall-ms", type=float, default=300.0)
    ap.add_argument("--rss-bound-mb", type=float, default=16.0,
                    help="allowed RSS growth per rank after warm-up (MiB)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="per scheme, seconds")
    ap.add_argument("--quick", action="store_true",
                    help="P=2, 40 steps, 2 schemes (smoke test, seconds)")
    a = ap.parse_args(argv)
    if a.quick:
        a.steps, a.warmup, a.sample_every = 40, 10, 5
        a.world_size = 2 if a.world_size is None else a.world_size
        a.check_every, a.nan_every, a.stall_every, a.stall_ms = 10, 9, 20, 50.0
        if a.schemes == list(SCHEMES):
            a.schemes = ["dense_ovlp", "topka"]
    a.world_size = 4 if a.world_size is None else a.world_size
    from gradsync.engine.config import Config

    for s in a.schemes:
        Config(scheme=s, density=a.density)  # validates early: ValueError naming the field
    if a.world_size < 2:
        raise ValueError(f"--world-size must be >= 2, got {a.world_size}")
    if a.steps <= a.warmup or a.warmup < 0:
        raise ValueError(f"--steps ({a.steps}) must exceed --warmup ({a.warmup}) >= 0")
    if a.sample_every < 1 or a.check_every < 0 or a.nan_every < 0 or a.stall_every < 0:
        raise ValueError("--sample-every must be >= 1; --check-every, --nan-every, "
                         "--stall-every >= 0")
    return a


def _row(scheme: str, out: list[dict[str, Any]], a: argparse.Namespace,
         wall: float) -> dict[str, Any]:
    """One scheme's row from every rank's :func:`_rank` result, ``pass`` its verdict."""
    grow = [_growth(o["samples"], a.warmup) for o in out]
    growth = [end - base for _, base, end in grow]
    injected = out[0]["injected"]
    ok = (max(growth) <= a.rss_bound_mb * 2**20
          and all(o["divergence"] == 0 and o["digest_mismatches"] == 0 for o in out)
          and all(o["skipped"] == o["engine_skipped"] == injected for o in out)
          and all(math.isfinite(o["last_loss"]) for o in out))
    return {
        "scheme": scheme, "steps": a.steps, "P": a.world_size,
        "rss_start_MiB": max(b for _, b, _ in grow) / 2**20,
        "rss_end_MiB": max(e for _, _, e in grow) / 2**20,
        "growth_MiB": max(growth) / 2**20,
        "bound_MiB": a.rss_bound_mb,
        "divergence": max(o["divergence"] for o in out),
        "digest_mism": max(o["digest_mismatches"] for o in out),
        "nan_injected": injected,
        "skipped": min(o["skipped"] for o in out),
        "stalls": sum(o["stalls"] for o in out),
        "loss_first": out[0]["first_loss"], "loss_last": out[0]["last_loss"],
        "ms/step": 1e3 * max(o["seconds"] for o in out) / a.steps,
        "wall_s": wall,
        "pass": ok,
        "per_rank_growth_MiB": [g / 2**20 for g in growth],
        "baseline_step": grow[0][0],
    }


def _plot(curves: dict[str, list[list[tuple[int, int]]]],
          a: argparse.Namespace) -> Callable[[Any], None]:
    """The PNG: each rank's RSS growth against the step, per scheme, and the bound."""
    def plot(ax: Any) -> None:
        colors = ["C0", "C1", "C2", "C3", "C4", "C5", "C6"]
        for i, (scheme, per_rank) in enumerate(curves.items()):
            for r, samples in enumerate(per_rank):
                base = _growth(samples, a.warmup)[1]
                ax.plot([s for s, _ in samples], [(v - base) / 2**20 for _, v in samples],
                        color=colors[i % len(colors)], lw=0.8, alpha=0.8,
                        label=scheme if r == 0 else None)
        ax.axhline(a.rss_bound_mb, color="red", ls="--", lw=0.8, label="bound")
        ax.axvline(a.warmup, color="grey", ls=":", lw=0.8)
        ax.set_xlabel("step")
        ax.set_ylabel("RSS − RSS at warm-up end (MiB)")
        ax.set_title(f"Soak RSS per rank, P={a.world_size}")
        ax.legend(fontsize=7)

    return plot


def main(argv: list[str] | None = None) -> int:
    a = _parse(argv)
    opts = {"steps": a.steps, "density": a.density, "hidden": a.hidden, "batch": a.batch,
            "lr": a.lr, "sample_every": a.sample_every, "check_every": a.check_every,
            "nan_every": a.nan_every, "stall_every": a.stall_every, "stall_ms": a.stall_ms,
            "seed": 0, "samples": 4096, "engine_warmup": 5, "timeout_s": 120.0,
            "bucket_mb": 0.05}
    from gradsync.testing import run_distributed

    rows: list[dict[str, Any]] = []
    curves: dict[str, list[list[tuple[int, int]]]] = {}
    for scheme in a.schemes:
        t0 = time.perf_counter()
        out = run_distributed(_rank, a.world_size, scheme, opts, timeout=a.timeout)
        wall = time.perf_counter() - t0
        curves[scheme] = [o["samples"] for o in out]
        rows.append(_row(scheme, out, a, wall))
    print_rows(
        f"Soak: P={a.world_size}, {a.steps} steps per scheme, MLP hidden {a.hidden} "
        f"({out[0]['n_params']:,} params), density {a.density}; NaN every {a.nan_every} "
        f"steps (skip_step), {a.stall_ms:g} ms straggler every {a.stall_every}; loopback gloo",
        rows, skip=("per_rank_growth_MiB", "baseline_step"))
    print(f"RSS: per rank, from the first sample at step >= {a.warmup} to the last; start/end "
          "are the largest over ranks, growth the largest per-rank growth (bound "
          f"{a.rss_bound_mb:g} MiB). divergence: max |θ_r − θ_0| at the end; digest_mism: "
          f"checks (every {a.check_every} steps) with differing parameter hashes. ms/step: "
          "slowest rank, faults and checks included.")
    meta = {**opts, "world_size": a.world_size, "warmup": a.warmup,
            "rss_bound_mb": a.rss_bound_mb, "load": os.getloadavg(),
            "rss_samples": curves}
    print_written(*write_outputs("soak", rows, a.out, plot=_plot(curves, a), meta=meta))
    passed = all(r["pass"] for r in rows)
    print("PASS" if passed else "FAIL: " + ", ".join(r["scheme"] for r in rows
                                                      if not r["pass"]))
    return 0 if passed else 1

if __name__ == "__main__":
    raise SystemExit(main())
