"""``python -m gradsync bench sketch``: LHC/TAGC wire cost, peeling limits, codec throughput.

TAGC §2.2–3.1, Table 1 and Figures 1–2. Three tables:

1. **Wire**: per compression ratio (2/4/10) and index width (1/4 bit), the bits per parameter
   each rank *sends*, measured by ``Comm`` over real gloo ranks running the ``lhc`` collective at
   TAGC Table 1's sparsity (union of all ranks), next to the ``dense`` collective (fp32 ring
   all-reduce, 2(P−1)/P · 32 bits) measured in the same run, and next to TAGC's own Fig. 1–2
   accounting (index bits + 32/ratio sketch bits per parameter, against 32 for a plain fp32
   exchange — the per-parameter payload, not the ring's 2(P−1)/P factor).
2. **Peeling vs union density**: success rate (fraction of seeds decoded losslessly) over a sweep
   of union densities, per ratio; the last density with 100% success and the first with < 50%.
   Also LHC's unrotated layout (``shift=False``) against gradsync's default at Table 1's points.
3. **Throughput**: median encode and peel time at Table 1's sparsity, elements per second.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import torch

from gradsync.apps.bench._harness import bench_parser, print_written
from gradsync.apps.common import add_common_args, median_time, print_table, write_outputs

RATIOS = (2, 4, 10)
TABLE1 = {2: 0.20, 4: 0.10, 10: 0.0125}  # union density at TAGC Table 1's θ (80/90/98.75%)
SWEEP = (0.01, 0.02, 0.04, 0.06, 0.07, 0.08, 0.09, 0.10, 0.12, 0.15, 0.18, 0.20, 0.22, 0.25,
         0.30, 0.35, 0.38, 0.40, 0.42, 0.45, 0.50, 0.60)
QUICK_SWEEP = (0.01, 0.04, 0.08, 0.12, 0.2, 0.3, 0.4, 0.5, 0.6)


def sparse_input(n: int, density: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A seeded length-``n`` vector with about ``density·n`` Gaussian non-zeros, and its mask."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(n, generator=g) < density
    return torch.randn(n, generator=g) * mask, mask


def _wire_rank(rank: int, world_size: int, n: int, threads: int) -> list[dict[str, Any]]:
    """Each rank: the lhc collective per (ratio, index bits) at Table 1 density; dense too."""
    import gradsync.collectives.lhc  # noqa: F401  (registers "lhc")
    from gradsync import collectives
    from gradsync.sparsegrad import SparseGrad

    torch.set_num_threads(threads)
    rows = []
    dense_coll = collectives.get("dense")
    for ratio in RATIOS:
        # Union density = Table 1's: half shared by all ranks, half split among them.
        d = TABLE1[ratio]
        g = torch.Generator().manual_seed(ratio)
        shared = torch.rand(n, generator=g) < d / 2
        g = torch.Generator().manual_seed(ratio * 100 + rank)
        mask = shared | (torch.rand(n, generator=g) < d / (2 * world_size))
        sel = SparseGrad.from_dense(torch.randn(n, generator=g) * mask)
        for bits in (1, 4):
            res = collectives.get("lhc", ratio=ratio, index_bits=bits)(sel)
            rows.append({"ratio": ratio, "index_bits": bits, "sent": res.stats.bytes_sent,
                         "lossy": res.info["lossy"], "method": res.info["index_method"],
                         "union_density": res.info["union_density"],
                         "seconds": res.stats.seconds})
        res = dense_coll(sel)
        rows.append({"ratio": ratio, "index_bits": 0, "sent": res.stats.bytes_sent,
                     "seconds": res.stats.seconds})
    return rows


def _wire(n: int, P: int, threads: int) -> list[dict[str, Any]]:
    """The wire table: bits per parameter each rank sends, lhc against dense, on ``P`` ranks."""
    from gradsync.testing import run_distributed

    per_rank = run_distributed(_wire_rank, P, n, max(1, threads), timeout=600)
    wire_rows = []
    for i, r0 in enumerate(per_rank[0]):
        sent = statistics.median(pr[i]["sent"] for pr in per_rank)
        bpp = sent * 8 / n
        if r0["index_bits"] == 0:
            dense_bpp = bpp
            continue
        wire_rows.append((r0, bpp))
    rows, table = [], []
    for r0, bpp in wire_rows:
        ratio, bits = r0["ratio"], r0["index_bits"]
        tagc = bits + 32 / ratio
        rows.append({"table": "wire", "ratio": ratio, "index_bits": bits, "P": P, "n": n,
                     "index_method": r0["method"], "union_density": r0["union_density"],
                     "lossy": r0["lossy"], "lhc_bits_per_param_sent": bpp,
                     "dense_bits_per_param_sent": dense_bpp,
                     "measured_ratio_vs_dense": dense_bpp / bpp,
                     "tagc_accounting_bits": tagc, "tagc_ratio_vs_32": 32 / tagc})
        table.append((f"{ratio}x", bits, r0["method"], f"{r0['union_density']:.4f}",
                      r0["lossy"], bpp, dense_bpp, dense_bpp / bpp, tagc, 32 / tagc))
    print_table(f"Wire: bits per parameter sent per rank, P={P}, n={n} (Comm, ring accounting)",
                ["ratio", "index bits", "index OR", "union dens.", "lossy", "lhc bits/param",
                 "dense fp32 bits/param", "dense/lhc", "TAGC acct bits", "32/TAGC acct"], table)
    return rows


def _peeling(n: int, sweep: Sequence[float], trials: int
             ) -> tuple[list[dict[str, Any]], dict[int, list[float]]]:
    """The peeling tables: the lossless rate over ``sweep``'s union densities per ratio, then
    at TAGC Table 1's points with and without gradsync's lane rotation; the rows and the
    curves."""
    from gradsync.formats.sketch import CountSketch

    rows: list[dict[str, Any]] = []
    curves: dict[int, list[float]] = {}
    table = []
    for ratio in RATIOS:
        rates = []
        for d in sweep:
            ok = 0
            for t in range(trials):
                x, mask = sparse_input(n, d, 1000 * t + 7)
                cs = CountSketch(n, ratio, seed=t)
                ok += not cs.peel(cs.encode(x), mask)[1].lossy
            rates.append(ok / trials)
            rows.append({"table": "peel", "ratio": ratio, "union_density": d,
                         "success_rate": ok / trials, "trials": trials, "n": n})
        curves[ratio] = rates
        last_ok = max((d for d, r in zip(sweep, rates) if r == 1.0), default=None)
        first_bad = min((d for d, r in zip(sweep, rates) if r < 0.5), default=None)
        table.append((f"{ratio}x", f"{0.82 / ratio:.3f}", last_ok, first_bad,
                      " ".join(f"{r:.2f}" for r in rates)))
        rows.append({"table": "peel_limit", "ratio": ratio, "last_all_lossless": last_ok,
                     "first_below_half": first_bad})
    print_table(f"Peeling success vs union density, n={n}, {trials} seeds per point "
                f"(densities {', '.join(f'{d:g}' for d in sweep)})",
                ["ratio", "theory 0.82/r", "last 100% density", "first <50% density",
                 "success rates"], table)

    table = []
    for ratio in RATIOS:
        d = TABLE1[ratio]
        ok = {True: 0, False: 0}
        for t in range(trials):
            x, mask = sparse_input(n, d, 1000 * t + 7)
            for shift in (True, False):
                cs = CountSketch(n, ratio, seed=t, shift=shift)
                ok[shift] += not cs.peel(cs.encode(x), mask)[1].lossy
        table.append((f"{ratio}x", d, ok[True] / trials, ok[False] / trials))
        rows.append({"table": "layout", "ratio": ratio, "union_density": d,
                     "success_rotated": ok[True] / trials, "success_lhc_layout": ok[False] / trials,
                     "trials": trials, "n": n})
    print_table(f"Table 1 points: lossless rate, gradsync lane rotation vs LHC layout, n={n}",
                ["ratio", "union density", "rotated (default)", "LHC layout"], table)
    return rows, curves


def _throughput(n: int, repeats: int, threads: int) -> list[dict[str, Any]]:
    """The throughput table: median encode and peel time at TAGC Table 1's sparsity, per
    ratio."""
    from gradsync.formats.sketch import CountSketch

    rows, table = [], []
    for ratio in RATIOS:
        x, mask = sparse_input(n, TABLE1[ratio], 3)
        cs = CountSketch(n, ratio, seed=0)
        s = cs.encode(x)
        t_enc = median_time(lambda cs=cs, x=x: cs.encode(x), repeats)
        t_peel = median_time(lambda cs=cs, s=s, m=mask: cs.peel(s, m), repeats)
        rows.append({"table": "throughput", "ratio": ratio, "n": n,
                     "union_density": TABLE1[ratio], "encode_s": t_enc, "peel_s": t_peel,
                     "threads": threads})
        table.append((f"{ratio}x", TABLE1[ratio], t_enc * 1e3, n / t_enc / 1e6,
                      t_peel * 1e3, n / t_peel / 1e6, t_peel / t_enc))
    print_table(f"Codec throughput (median of {repeats}), n={n}, {threads} thread(s)",
                ["ratio", "union density", "encode ms", "encode Melem/s", "peel ms",
                 "peel Melem/s", "peel/encode"], table)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = bench_parser("sketch", __doc__)
    ap.add_argument("--n", type=float, default=1e6, help="parameters per tensor (default 1e6)")
    ap.add_argument("--world-size", type=int, default=4, help="gloo ranks for the wire table")
    ap.add_argument("--trials", type=int, default=10, help="seeds per sweep point")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--quick", action="store_true", help="small n, few seeds, short sweep")
    add_common_args(ap, "sketch")
    args = ap.parse_args(argv)
    n = int(args.n)
    sweep, trials, repeats = SWEEP, args.trials, args.repeats
    if args.quick:
        n, sweep, trials, repeats = min(n, 100_000), QUICK_SWEEP, min(trials, 2), 1
    if n < 1 or args.world_size < 1 or trials < 1 or args.threads < 1:
        raise SystemExit("--n, --world-size, --trials and --threads must be >= 1")
    torch.set_num_threads(args.threads)
    P = args.world_size
    rows = _wire(n, P, args.threads)
    peel_rows, curves = _peeling(n, sweep, trials)
    rows += peel_rows + _throughput(n, repeats, args.threads)

    def plot(ax: Any) -> None:
        for ratio in RATIOS:
            ax.plot(sweep, curves[ratio], marker="o", label=f"{ratio}x")
            ax.axvline(0.82 / ratio, linestyle=":", linewidth=0.8)
        ax.set_xlabel("union density of nonzeros")
        ax.set_ylabel("lossless peeling rate")
        ax.set_title(f"LHC peeling success vs density (n={n}, {trials} seeds)")
        ax.legend()

    print_written(*write_outputs("sketch", rows, args.out, plot=plot,
                                 meta={"n": n, "P": P, "trials": trials, "quick": args.quick,
                                       "threads": args.threads, "sweep": list(sweep)}))
    return 0
