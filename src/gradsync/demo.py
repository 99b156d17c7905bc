"""``make demo`` / ``python -m gradsync demo``: a short, real tour of what gradsync measures.

Until the training comparison lands (``gradsync train``), the demo runs three real
measurements on this machine and prints their tables:

1. every sparsifier on a heavy-tailed 1e6-element gradient: time, count vs k, ratio to one
   streaming pass (``bench sparsify``);
2. every collective on 4 real gloo ranks (loopback) at 1% density: time, bytes per rank, and
   bytes relative to the Ok-Topk Theorem 3.1 lower bound (``bench collectives``);
3. DenseStream vs COO size on a real CNN's accumulated Fashion-MNIST gradients
   (``bench formats``).

Each step writes JSON and a PNG under ``--out`` (default ``bench-out/demo``).
"""

from __future__ import annotations

import argparse
import importlib
import time

STEPS = [
    ("sparsify", ["--sizes", "1e5,1e6", "--repeats", "3"]),
    ("collectives", ["--world-size", "4", "--numel", "1e6", "--density", "0.01", "--repeats", "3"]),
    ("formats", ["--densities", "0.01,0.05,0.1"]),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gradsync demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench-out/demo")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    for name, extra in STEPS:
        mod = importlib.import_module(f"gradsync.bench.{name}")
        print(f"\n=== gradsync demo: bench {name} {' '.join(extra)}")
        rc = int(mod.main([*extra, "--out", f"{args.out}/{name}"]) or 0)
        if rc:
            return rc
    print(f"\nDemo finished in {time.perf_counter() - t0:.0f} s; JSON and PNG files are in "
          f"{args.out}/")
    return 0
