"""``python -m gradsync profile-cluster --out FILE.json``: a GPU-cluster cost profile for
``report cluster --profile FILE.json``, with what one GPU can measure measured on this machine's
GPU instead of derived from published figures (the bundled ``apps/cluster_profile.json``).

Measured (on ``--device``, by default the GPU):

* per workload of the profile whose model we can build (ResNet-152, BERT-large, GPT2-large, at
  the batch and sequence length the profile states), on the published definition
  (:func:`gradsync.apps.models.reference`) with fp32 weights under bf16 autocast:
  the forward time, the step time (forward + backward, synchronised; medians after warm-ups),
  the optimizer's step (SGD with momentum), and
  **when each parameter's gradient is ready** — a CUDA event recorded in its post-accumulate-grad
  hook relative to one recorded just before ``backward()`` (no synchronisation inside the
  pass). Each tensor's backward time T_b is the gap to the previous ready time, in ready order
  — SSFusion §IV-A's trace of "each tensor's computation start and end" — rescaled so that they
  add up to the backward pass measured without hooks (step − forward): the hooks' host work
  slows a launch-bound pass (``hooked_pass_s`` keeps the pass as measured with them);
* DGC's sparsification at 1 % on the GPU, and with SSFusion-O's offload (device→host copy,
  selection on a host thread, copy back), fitted a + b·n;
* the sparse collectives' merge (``index_add_``) and COO pack/unpack on the GPU;
* COO and DenseStream encode/decode throughput on the GPU (recorded, not used by the simulator).

Kept from the bundled profile, and labelled so: the links (one GPU cannot measure a cluster's
network), and the workloads we do not build at their published size (Ok-Topk's BERT,
DenseStream's VGG16 and ResNet-50). Those keep their GPUs; the measured workloads run on this
GPU, so ``report cluster`` then predicts the papers' experiments *as if run on this GPU*, beside
the papers' numbers measured on theirs.

``shape_error``: the largest gap, over the backward pass, between the measured fraction of
backward time elapsed and the bundled profile's approximation (T_b in proportion to element
counts) when the same fraction of the gradient elements is ready. ``mfu``: the profile's training
FLOPs (``report_cluster.cost_model``'s formula) over the step time × the GPU's datasheet peak.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from gradsync import sparsify
from gradsync.apps import models
from gradsync.apps.common import cpu_description, median_time, print_table
from gradsync.apps.report_cluster import load_profile, training_flops
from gradsync.schedule import costmodel

# Datasheet peaks of the GPUs we may be lent: (bf16 dense Tensor Core FLOP/s, memory B/s).
PEAKS = {
    "H100": (989.4e12, 3.35e12, "NVIDIA H100 SXM5 datasheet: 989 TFLOPS BF16 dense, 3.35 TB/s "
                                "HBM3"),
    "H200": (989.4e12, 4.8e12, "NVIDIA H200 SXM datasheet: 989 TFLOPS BF16 dense, 4.8 TB/s HBM3e"),
    "A100": (312e12, 2.039e12, "NVIDIA A100 80 GB SXM datasheet: 312 TFLOPS BF16 dense, "
                               "2,039 GB/s HBM2e"),
}
WORKLOADS = ("resnet152", "bert_large", "gpt2_large")
DENSITY = 0.01
SPARSIFIER = "dgc"  # SSFusion Table III's


def gpu_key(name: str) -> str | None:
    """The PEAKS entry a device name matches (None: unknown GPU, or the CPU)."""
    return next((k for k in PEAKS if k in name), None)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _inputs(wl: dict[str, Any], dev: torch.device, quick: bool):
    g = torch.Generator().manual_seed(0)
    b = 2 if quick else wl["batch"]
    if wl["kind"] == "cnn":
        px = 32 if quick else 224
        return (torch.randn(b, 3, px, px, generator=g).to(dev),
                torch.randint(1000, (b,), generator=g).to(dev))
    t = 16 if quick else wl["tokens"]
    return (torch.randint(1000, (b, t), generator=g).to(dev),
            torch.randint(1000, (b, t), generator=g).to(dev))


def measure_workload(wl: dict[str, Any], prof: dict[str, Any], dev: torch.device,
                     repeats: int, quick: bool) -> dict[str, Any]:
    """Forward, step and per-tensor ready times of one workload (module docstring)."""
    net = models.reference(wl["model"], device=dev)
    x, y = _inputs(wl, dev, quick)
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda")
    params = [(n, p) for n, p in net.named_parameters() if p.requires_grad]

    def loss() -> torch.Tensor:
        with autocast:
            return models.loss(net(x), y)

    def step() -> None:
        net.zero_grad(set_to_none=True)
        loss().backward()

    forward_s = median_time(loss, repeats, warmup=1 if quick else 3, device=dev)
    step_s = median_time(step, repeats, device=dev)
    # one more pass, with a timestamp per gradient
    stamps: dict[str, Any] = {}

    def hook_for(n: str):
        def hook(_p) -> None:
            if dev.type == "cuda":
                stamps[n] = torch.cuda.Event(enable_timing=True)
                stamps[n].record()
            else:
                stamps[n] = time.perf_counter()
        return hook

    opt = torch.optim.SGD(net.parameters(), lr=1e-6, momentum=0.9)  # grads exist: step()
    optimizer_s = median_time(opt.step, repeats, device=dev)
    net.zero_grad(set_to_none=True)
    out = loss()
    handles = [p.register_post_accumulate_grad_hook(hook_for(n)) for n, p in params]
    try:
        _sync(dev)
        if dev.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            out.backward()
            _sync(dev)
            ready = {n: start.elapsed_time(e) / 1e3 for n, e in stamps.items()}
        else:
            t0 = time.perf_counter()
            out.backward()
            ready = {n: t - t0 for n, t in stamps.items()}
    finally:
        for h in handles:
            h.remove()
    numel = dict((n, p.numel()) for n, p in params)
    order = sorted(numel, key=lambda n: ready[n])
    times = [ready[n] for n in order]
    gaps = [max(0.0, t - (times[i - 1] if i else 0.0)) for i, t in enumerate(times)]
    # The hooks' host work delays a launch-bound pass (ResNet-152's took 1.8x as long with
    # them on an H100; the transformers' within 4 %): keep the measured shape, rescaled to
    # the pass without hooks (step - forward).
    plain = step_s - forward_s
    scale = plain / times[-1] if plain > 0 and times[-1] > 0 else 1.0
    backward = [t * scale for t in gaps]
    n_all, acc, err, err_at = sum(numel.values()), 0, 0.0, 0.0
    for n, t in zip(order, times):
        acc += numel[n]
        gap = abs(t / times[-1] - acc / n_all)
        if gap > err:
            err, err_at = gap, acc / n_all
    batch = 2 if quick else wl["batch"]
    tokens = None if wl["kind"] == "cnn" else (16 if quick else wl["tokens"])
    flops = training_flops(prof, wl, n_all, batch, tokens)
    return {"batch": batch, "tokens": tokens, "params": n_all,
            "precision": "fp32 weights, bf16 autocast" if dev.type == "cuda" else "fp32",
            "forward_s": forward_s, "step_s": step_s, "backward_pass_s": sum(backward),
            "hooked_pass_s": times[-1], "ready_s": times,
            "optimizer_s": optimizer_s,
            "order": order, "numel": [numel[n] for n in order], "backward_s": backward,
            "training_flops": flops, "achieved_flops": flops / step_s,
            "shape_error": err, "shape_error_at_elements": err_at}


def copy_bandwidth(dev: torch.device, quick: bool) -> float:
    """Bytes read + written per second by a device-to-device copy of 256 MiB (4 MiB quick)."""
    x = torch.ones((1 << 20 if quick else 1 << 26), device=dev)
    y = torch.empty_like(x)
    t = median_time(lambda: y.copy_(x), 2 if quick else 10, device=dev)
    return 2 * x.numel() * x.element_size() / t


def measure_codecs(dev: torch.device, n: int, repeats: int) -> list[dict[str, Any]]:
    """COO and DenseStream encode/decode throughput on ``dev`` (``bench formats``' timing),
    of the top-k selection of a seeded heavy-tailed tensor of ``n`` elements (random positions:
    short DenseStream blocks, its hard case)."""
    from gradsync.apps.bench.formats import codec_throughput
    from gradsync.sparsegrad import SparseGrad

    rows = []
    for density in (0.01, 0.1):
        x = costmodel.profiling_input(n, 1, dev)
        idx = x.abs().topk(max(1, int(density * n))).indices.sort().values
        t = codec_throughput(SparseGrad(idx, x[idx], n), 4, repeats)
        rows += [{"format": f, "density": density, "n": n,
                  **{k: t[f"{f}_{k}"] for k in ("bytes", "encode_s", "decode_s",
                                                "encode_MBps", "decode_MBps")}}
                 for f in ("coo", "densestream")]
    return rows


def measure(dev: torch.device, workloads: Sequence[str], repeats: int,
            quick: bool) -> dict[str, Any]:
    """The cluster profile (module docstring): the bundled one with this GPU's measurements."""
    prof = load_profile()
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else cpu_description()
    key = gpu_key(name) if dev.type == "cuda" else None
    gkey = key or "measured-device"
    peak = PEAKS.get(key) if key else None
    when = time.strftime("%Y-%m-%d")
    env = {"device": name, "torch": torch.__version__, "cuda": torch.version.cuda,
           "host_cpu": cpu_description(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
           "quick": quick}
    prof["label"] = f"measured on {name}"
    prof["note"] = (f"Measured on one {name} on {when} by `python -m gradsync profile-cluster`"
                    f"{' --quick (tiny inputs: a smoke test, not a profile)' if quick else ''}:"
                    " per-tensor backward and forward times of the workloads named 'measured', "
                    "GPU sparsification and offload, merge and codec. Links, the other "
                    "workloads and everything else: as in the bundled profile, derived from "
                    "published figures.")
    copy_bw = copy_bandwidth(dev, quick)
    prof["gpus"][gkey] = {
        "peak_flops": peak[0] if peak else float("nan"),
        "mem_bytes_per_s": peak[1] if peak else copy_bw,
        "copy_bytes_per_s": copy_bw,
        "source": (peak[2] if peak else "unknown device: no datasheet peak FLOP/s; memory "
                   "bandwidth: the measured copy") + f"; the workloads' times and the copy "
                  f"bandwidth (bytes read + written) were measured on it ({when})"}
    prof["measured"] = {"env": env, "workloads": list(workloads)}
    reps = 2 if quick else repeats
    for wl_name in workloads:
        wl = prof["workloads"][wl_name]
        t0 = time.perf_counter()
        m = measure_workload(wl, prof, dev, reps, quick)
        if peak:
            m["mfu"] = m["achieved_flops"] / peak[0]
        prof["workloads"][wl_name] = {
            **wl, "gpu": gkey, "measured": m,
            "source": f"times measured on {name} ({when}); shapes: {wl['source']}"}
        print(f"{wl_name}: step {m['step_s'] * 1e3:.1f} ms (forward {m['forward_s'] * 1e3:.1f}"
              f" ms), {m['achieved_flops'] / 1e12:.1f} TFLOP/s, measured in "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    sizes = (256, 4096) if quick else (2560, 25_600, 256_000, 2_560_000)
    sp = sparsify.get(SPARSIFIER, density=DENSITY, seed=0)
    inline = costmodel.profile_sparsifier(sp, sizes=sizes, repeats=reps, device=dev)
    off = costmodel.profile_sparsifier(sp, sizes=sizes, repeats=reps, device=dev, offload=True)
    topk = costmodel.profile_sparsifier(sparsify.get("topk", density=DENSITY), sizes=sizes,
                                        repeats=reps, device=dev)
    src = f"measured: {SPARSIFIER} at {DENSITY:.0%} on {name}, sizes {list(sizes)} elements"
    prof["sparsify"] = {
        "gpu": {"a": inline.a, "b": inline.b, "source": src},
        "cpu": {"a": off.a, "b": off.b, "source": src + ", offloaded (device->host copy, "
                f"selection on a host thread of {cpu_description()}, copy back)"},
        "reference_gpu": gkey,
        "scale_by_memory_bandwidth": f"other GPUs: the {gkey} fit's slope scaled by the "
                                     f"{gkey}/GPU memory-bandwidth ratio",
        "topk_gpu": {"a": topk.a, "b": topk.b, "source": "measured (recorded, unused)"}}
    comp = costmodel.profile_compute(sizes=(256, 4096, 32_768, 131_072), repeats=reps,
                                     numel=1 << 22, device=dev)
    prof["compute"] = {"message": prof["compute"]["message"],
                       "merge": {"a": comp.merge.a, "b": comp.merge.b},
                       "codec": {"a": comp.codec.a, "b": comp.codec.b},
                       "source": f"measured on {name}: index_add_ of m entries into 4 Mi "
                                 "elements (merge), COO pack + unpack of m entries (codec), "
                                 "m = 256..131072; message: as in the bundled profile"}
    prof["measured"]["codecs"] = measure_codecs(dev, 40_000 if quick else 4_000_000, reps)
    return prof


def _print(prof: dict[str, Any], derived: dict[str, Any]) -> None:
    rows = []
    for wl_name in prof["measured"]["workloads"]:
        m = prof["workloads"][wl_name]["measured"]
        d = derived["workloads"][wl_name]
        gpu = derived["gpus"][d["gpu"]]
        assumed = derived["mfu"][d["kind"]]["value"]
        bundled = m["training_flops"] / (gpu["peak_flops"] * assumed)
        rows.append([wl_name, f"{m['batch']}" + (f" x {m['tokens']}" if m["tokens"] else ""),
                     f"{m['step_s'] * 1e3:.1f}", f"{m['achieved_flops'] / 1e12:.1f}",
                     f"{m.get('mfu', float('nan')):.3f}",
                     f"{bundled * 1e3:.1f} ({d['gpu']}, mfu {assumed})",
                     f"{m['shape_error']:.2f} at {m['shape_error_at_elements']:.2f}"])
    print_table(f"profile-cluster — {prof['label']}",
                ["workload", "batch", "step ms", "TFLOP/s", "mfu", "bundled profile's step ms",
                 "T_b shape error at elements"], rows)
    s = prof["sparsify"]
    c = prof["compute"]
    print(f"sparsify {SPARSIFIER} on the device: {s['gpu']['a'] * 1e3:.3f} ms + "
          f"{s['gpu']['b'] * 1e9:.4f} ns/element; offloaded: {s['cpu']['a'] * 1e3:.3f} ms + "
          f"{s['cpu']['b'] * 1e9:.4f} ns/element (bundled, DGC on the A100 testbed: "
          f"{derived['sparsify']['gpu']['a'] * 1e3:.2f} ms + "
          f"{derived['sparsify']['gpu']['b'] * 1e9:.3f} ns/element)")
    print(f"merge {c['merge']['a'] * 1e6:.1f} us + {c['merge']['b'] * 1e12:.2f} ps/entry; codec "
          f"{c['codec']['a'] * 1e6:.1f} us + {c['codec']['b'] * 1e12:.2f} ps/entry")
    for r in prof["measured"]["codecs"]:
        print(f"{r['format']} at {r['density']:.0%} of {r['n']:,}: encode "
              f"{r['encode_MBps']:,.0f} MB/s, decode {r['decode_MBps']:,.0f} MB/s")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gradsync profile-cluster",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the cluster profile JSON to write")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--quick", action="store_true",
                    help="tiny inputs, 2 repeats (a smoke test on any device)")
    a = ap.parse_args(argv)
    wls = [w for w in a.workloads.split(",") if w]
    unknown = sorted(set(wls) - set(WORKLOADS))
    if unknown or not wls:
        ap.error(f"--workloads: choose from {', '.join(WORKLOADS)}")
    if a.repeats < 1:
        ap.error("--repeats must be >= 1")
    dev = torch.device(a.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is visible to this torch")
    if dev.type != "cuda" and not a.quick:
        print(f"note: --device {a.device}: the profile's times will be this CPU's, not a GPU's")
    prof = measure(dev, wls, a.repeats, a.quick)
    _print(prof, load_profile())
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(prof, indent=1))
    print(f"wrote {a.out}  (use: python -m gradsync report cluster --profile {a.out})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
