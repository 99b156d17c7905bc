"""Benchmark: every sparsifier on heavy-tailed fp32 tensors of growing size.

``python -m gradsync bench sparsify [--sizes 1e4,1e5,1e6,1e7] [--density 0.01] [--quick]``

For each size and each registered sparsifier: the median wall time of ``select``, the count it
achieved against k (and the relative deviation), and the ratio of the median time to one
streaming pass over the tensor (``x.abs().max()``, measured in the same run), the physical floor
of any selection on this machine. The content is :func:`heavy_tailed`, a seeded gradient-like
mix (SSFusion Fig. 4 / Ok-Topk Fig. 4 show real gradients are peaked and heavy-tailed, which is
what breaks the Gaussian estimator). Writes ``sparsify.json`` and ``sparsify.png`` (time vs size
per sparsifier, log-log).
"""

from __future__ import annotations

import argparse
import math

import torch

from gradsync.apps.common import add_common_args, median_time, print_table, write_outputs

__all__ = ["heavy_tailed", "main"]


def heavy_tailed(n: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A seeded gradient-like tensor: random signs, near-lognormal magnitudes, several scales.

    The tensor is cut into up to 8 "layers" of random sizes, each with its own scale drawn
    log-uniformly over three decades (layers of a network have very different gradient
    scales); within a layer the magnitudes are lognormal (σ = 1.2, peaked with a heavy tail),
    0.1% of the entries are outliers ×30, and 5% are exact zeros (dead units, unused rows).
    Uses its own ``torch.Generator``; the global RNG is untouched.
    """
    if n < 0:
        raise ValueError(f"heavy_tailed: n must be >= 0, got {n}")
    g = torch.Generator().manual_seed(seed)
    parts = min(8, max(1, n))
    cuts = torch.sort(torch.randint(n + 1, (parts - 1,), generator=g)).values
    bounds = [0, *cuts.tolist(), n]
    scale = torch.empty(n)
    for i in range(parts):
        s = 10.0 ** float(torch.empty(1).uniform_(-3.0, 0.0, generator=g))
        scale[bounds[i]: bounds[i + 1]] = s
    mag = torch.exp(1.2 * torch.randn(n, generator=g)) * scale
    u = torch.rand(n, generator=g)
    mag = torch.where(u < 0.001, mag * 30.0, mag)
    mag = torch.where(u > 0.95, torch.zeros_like(mag), mag)
    sign = torch.randint(2, (n,), generator=g).float() * 2.0 - 1.0
    return (mag * sign).to(dtype)


def _parse_sizes(text: str) -> list[int]:
    try:
        sizes = [int(float(s)) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--sizes must be comma-separated numbers, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--sizes must be positive, got {text!r}")
    return sizes


def main(argv: list[str] | None = None) -> int:
    from gradsync import sparsify

    parser = argparse.ArgumentParser(prog="python -m gradsync bench sparsify",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1e4,1e5,1e6,1e7", help="comma-separated sizes")
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--sparsifiers", default=",".join(sparsify.names()),
                        help="comma-separated names (default: every registered one)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0,
                        help="torch intra-op threads (default: leave torch's setting)")
    parser.add_argument("--quick", action="store_true",
                        help="sizes 1e3,1e4 and 2 repeats (smoke test)")
    add_common_args(parser, "sparsify")
    args = parser.parse_args(argv)
    sizes = _parse_sizes(args.sizes)
    if args.threads < 0:
        raise ValueError(f"--threads must be >= 0, got {args.threads}")
    if args.threads:
        torch.set_num_threads(args.threads)
    repeats = args.repeats
    if args.quick:
        sizes, repeats = [s for s in sizes if s <= 10_000] or [1000, 10_000], 2
    names = [s.strip() for s in args.sparsifiers.split(",") if s.strip()]
    for nm in names:
        if nm not in sparsify.names():
            raise ValueError(f"unknown sparsifier {nm!r}; available: {sparsify.names()}")

    rows = []
    for n in sizes:
        x = heavy_tailed(n, seed=args.seed)
        t_pass = median_time(lambda x=x: x.abs().max(), repeats=repeats)
        for nm in names:
            sp = sparsify.get(nm, density=args.density, seed=args.seed)
            t = median_time(lambda sp=sp, x=x: sp.select(x), repeats=repeats)
            sel = sp.select(x)
            k = sp.last_k
            rows.append({
                "sparsifier": nm, "n": n, "density": args.density, "k": k,
                "count": len(sel), "deviation": sp.last_deviation,
                "median_s": t, "pass_s": t_pass, "x_pass": t / t_pass if t_pass > 0 else math.inf,
            })
    print_table(
        f"sparsify: median select() time, density {args.density}, fp32 heavy-tailed, "
        f"{torch.get_num_threads()} threads",
        ["sparsifier", "n", "k", "count", "deviation", "median ms", "pass ms", "× pass"],
        [[r["sparsifier"], r["n"], r["k"], r["count"], round(r["deviation"], 4),
          r["median_s"] * 1e3, r["pass_s"] * 1e3, r["x_pass"]] for r in rows],
    )

    def plot(ax) -> None:
        for nm in names:
            pts = [(r["n"], r["median_s"]) for r in rows if r["sparsifier"] == nm]
            ax.plot(*zip(*pts), marker="o", label=nm)
        pts = sorted({(r["n"], r["pass_s"]) for r in rows})
        ax.plot(*zip(*pts), "k--", label="|x|.max() pass")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("tensor size n (fp32 elements)")
        ax.set_ylabel("median select() time (s)")
        ax.set_title(f"sparsifier time, density {args.density}")
        ax.legend(fontsize=8)

    jpath, ppath = write_outputs("sparsify", rows, args.out, plot=plot,
                                 meta={"sizes": sizes, "density": args.density,
                                       "repeats": repeats, "seed": args.seed})
    print(f"wrote {jpath} and {ppath}")
    return 0
