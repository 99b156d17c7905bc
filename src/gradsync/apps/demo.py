"""``make demo`` / ``python -m gradsync demo``: does sparse synchronization pay on a slow link?

Trains the default model (the CNN) on real Fashion-MNIST on 4 local workers joined by an
emulated 100 Mbit/s link per rank (``tc tbf`` in network namespaces, :mod:`gradsync.testing.netem`;
root only — otherwise it says so and uses loopback, where communication is nearly free and the
comparison says little), once per scheme with the same seed, data and number of steps:

* ``ddp``: PyTorch DDP's all-reduce (the baseline),
* ``ddp_powersgd``: PyTorch's PowerSGD comm hook (rank 1),
* ``ssfusion_oi``: SSFusion with selective sparsification, offload and the interleaved
  all-reduce/all-gather split,
* ``oktopk``: the Ok-Topk O(k) sparse allreduce,
* ``densestream``: the DenseStream allreduce,

the sparse schemes at 1% density (DGC selection, error feedback). It prints ONE table:
samples/s (median after warm-up, all ranks), speed-up over ``ddp``, MB each rank sends per step
and test accuracy on the whole 10,000-image test split after the same number of steps (160 by
default: DDP reaches about 84% there, so a gap between schemes means something; one seed — for
mean ± std over seeds use ``python -m gradsync bench convergence``), and the time to DDP's
accuracy: the training seconds until each scheme's test accuracy (evaluated at
:data:`EVAL_POINTS` points of the run) reaches DDP's final accuracy, and DDP's time over it,
the speed-up a user gets once accuracy is counted ("not reached" when the scheme ends below
DDP). It writes
``metrics.json`` and the plots (loss vs time, throughput) under ``--out`` (default
``bench-out/demo``). It is ``python -m gradsync train`` with fixed settings; use that command
for anything else.
"""

from __future__ import annotations

import argparse
import time

SCHEMES = ("ddp", "ddp_powersgd", "ssfusion_oi", "oktopk", "densestream")
EVAL_BATCHES = 313  # × 32 images: the whole 10,000-image test split (evaluation stops at its end)
EVAL_POINTS = 4  # evaluations per run: the curve the time to DDP's accuracy is read from


def main(argv: list[str] | None = None) -> int:
    from gradsync.apps import train
    from gradsync.apps.common import print_table
    from gradsync.testing import DistributedError, DistributedTimeout

    parser = argparse.ArgumentParser(prog="python -m gradsync demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench-out/demo")
    parser.add_argument("--steps", type=int, default=160, help="training steps per scheme")
    parser.add_argument("--bandwidth", default="100mbit",
                        help="emulated link per rank, or 'loopback' for none")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--schemes", default=",".join(SCHEMES))
    d = parser.parse_args(argv)
    link_args = [] if d.bandwidth == "loopback" else ["--bandwidth", d.bandwidth]
    spec = train.parse_args([
        "--model", "cnn", "--scheme", d.schemes, "--world-size", str(d.world_size),
        "--steps", str(d.steps), "--batch-size", "32", "--density", "0.01", *link_args,
        "--eval-batches", str(EVAL_BATCHES), "--eval-every", str(max(1, d.steps // EVAL_POINTS)),
        "--out", d.out, "--no-progress",
    ], parser=train.build_parser("python -m gradsync demo"))
    spec = train.resolve_data(spec)
    print(f"gradsync demo: {spec.model} on {spec.data}, {spec.world_size} workers, {spec.steps} "
          f"steps of {spec.batch_size} samples per worker and scheme, density {spec.density}, "
          f"link {spec.bandwidth} per rank (tbf; no propagation delay)")
    print(f"schemes: {', '.join(spec.schemes)}  (a few minutes on 2 cores)", flush=True)
    t0 = time.perf_counter()
    try:
        results, link = train.launch(spec)
    except (DistributedError, DistributedTimeout) as e:
        print(f"demo failed: {e}")
        return 1
    env = train.environment("local", "gloo", "cpu", link)
    runs = train.summarize(results, spec.warmup_steps)
    rows = []
    for r in runs:
        s = r["summary"]
        t, x = s.get("s_to_ddp"), s.get("time_speedup_vs_ddp")
        rows.append([s["scheme"], s["samples_per_s"],
                     f"{s['speedup_vs_ddp']:.2f}x" if s["speedup_vs_ddp"] else "-",
                     s["run_bytes_per_step"] / 1e6, 100 * s.get("test_accuracy", float("nan")),
                     "not reached" if t is None else f"{t:.1f}",
                     "-" if t is None or x is None else f"{x:.2f}x"])
    print_table(f"gradsync demo — {spec.model}, P={spec.world_size}, {link['link']}, "
                f"{spec.steps} steps",
                ["scheme", "samples/s", "speed-up vs ddp (step)", "MB sent/step/rank",
                 "test accuracy %", "s to ddp's accuracy", "speed-up vs ddp (time)"], rows)
    paths = train.write_metrics(spec.out, spec.config(len(results)), env, runs)
    if not link["shaped"]:
        print("note: ran on loopback (no shaped links, see the note above): communication is "
              "almost free here, so speed-ups understate what a slow link shows")
    seen = {r["summary"].get("test_samples") for r in runs} - {None}
    print(f"test accuracy: {', '.join(str(n) for n in sorted(seen)) or 'no'} images of the "
          f"{spec.data} test split, after the same number of steps for every scheme (one "
          "seed; `python -m gradsync bench convergence` gives mean ± std over seeds)")
    print(f"samples/s and the step speed-up: the median step after the first "
          f"{spec.warmup_steps + 1} (the cost model's profiling); MB sent/step/rank: the mean "
          "over every step, DGC's denser first steps included, what the run sent")
    print(f"time to ddp's accuracy: training seconds until a scheme's test accuracy reaches "
          f"ddp's final one, read from {EVAL_POINTS} evaluations per run (linear between them); "
          "speed-up vs ddp (time) is ddp's seconds to it over the scheme's, the gain a user "
          "gets, where the step speed-up ignores what compression costs in accuracy")
    print(f"demo finished in {time.perf_counter() - t0:.0f} s; metrics and plots: "
          + ", ".join(str(p) for p in paths))
    return 0
