"""DenseStream vs COO on a real model's gradients (DenseStream §IV-B, Table I).

``python -m gradsync bench formats [--model cnn] [--densities 0.01,0.05,0.1] [--steps N]``

Takes the model's accumulated gradients (``real_gradients(model, steps, accumulate=True)``:
what a residual holds when nothing is sent), selects the exact top-k at each density, and
measures the encoded size of DenseStream against COO ("key-value"), both with 4-byte indices
(the paper's ``unsigned int``) and the gradient's fp32 values:

* per tensor (top-k of each tensor) and for the whole model: the sum over tensors, and the
  model as one flat vector with a global top-k (what a fusion buffer would send);
* ratio = DenseStream / COO of the payload (the paper's "overhead"; the fixed 24/32-byte
  headers are reported separately in the JSON), beside Table I's VGG16 and ResNet50 figures;
* encode/decode throughput of both formats on the whole-model selection (median of
  ``--repeats``), as MB/s of encoded bytes.

Sizes are exact (``size_bytes == len(encode(...))``); times are medians on a shared machine.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from gradsync.apps.common import add_common_args, median_time, print_table, write_outputs
from gradsync.formats import coo
from gradsync.formats import densestream as ds
from gradsync.sparsegrad import SparseGrad

# DenseStream Table I: compression ratio DenseStream / key-value, epochs 1, 5, 50.
__all__ = ["PAPER_TABLE_I", "codec_throughput", "main", "payload_sizes", "top_k"]

PAPER_TABLE_I: dict[str, dict[float, tuple[float, float, float]]] = {
    "VGG16": {0.01: (1.11, 0.99, 1.03), 0.05: (0.86, 0.89, 0.85), 0.10: (0.75, 0.77, 0.75)},
    "ResNet50": {0.01: (0.98, 1.09, 1.11), 0.05: (0.86, 0.89, 0.94), 0.10: (0.82, 0.85, 0.89)},
}


def top_k(x: torch.Tensor, density: float) -> SparseGrad:
    """The exact top-k of ``x`` flattened, k from ``density`` (what the formats are sized on)."""
    from gradsync.sparsify import get

    return get("topk", density=density).select(x.reshape(-1))


def payload_sizes(sel: SparseGrad, iw: int) -> dict[str, Any]:
    """Exact encoded sizes of ``sel`` as DenseStream and as COO with ``iw``-byte indices.

    Returns numel, nnz, DenseStream's block count and mean block length, both formats' sizes
    with (``*_bytes``) and without (``*_payload``) their headers, and the ratios DenseStream /
    COO of the payloads (``ratio``, Table I's figure) and of the whole buffers.
    """
    starts, lengths = ds.blocks(sel, iw)
    coo_b, ds_b = coo.size_bytes(sel, iw), ds.size_bytes(sel, iw)
    coo_p, ds_p = coo_b - coo.HEADER_BYTES, ds_b - ds.HEADER_BYTES
    return {"numel": sel.numel, "nnz": len(sel), "blocks": int(starts.numel()),
            "mean_block_len": float(lengths.double().mean()) if lengths.numel() else 0.0,
            "coo_bytes": coo_b, "ds_bytes": ds_b, "coo_payload": coo_p, "ds_payload": ds_p,
            "ratio": ds_p / coo_p if coo_p else float("nan"),
            "ratio_with_headers": ds_b / coo_b}


def codec_throughput(sel: SparseGrad, iw: int, repeats: int) -> dict[str, Any]:
    """COO's and DenseStream's encode and decode of ``sel`` (on its device): medians in
    seconds and MB of wire buffer per second."""
    out: dict[str, Any] = {"nnz": len(sel), "numel": sel.numel}
    dev = sel.indices.device
    for name, fmt in (("coo", coo), ("densestream", ds)):
        buf = fmt.encode(sel, index_bytes=iw)
        t_enc = median_time(lambda fmt=fmt: fmt.encode(sel, index_bytes=iw), repeats,
                            device=dev)
        t_dec = median_time(lambda fmt=fmt, buf=buf: fmt.decode(buf), repeats, device=dev)
        mb = buf.numel() / 1e6
        out[f"{name}_bytes"] = buf.numel()
        out[f"{name}_encode_s"], out[f"{name}_decode_s"] = t_enc, t_dec
        out[f"{name}_encode_MBps"], out[f"{name}_decode_MBps"] = mb / t_enc, mb / t_dec
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gradsync bench formats", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="cnn", help="cnn | mlp | gpt_tiny")
    p.add_argument("--densities", default="0.01,0.05,0.1")
    p.add_argument("--steps", type=int, default=20, help="SGD steps whose gradients accumulate")
    p.add_argument("--index-bytes", type=int, default=4, choices=(4, 8))
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads while timing (1: small ops on a shared machine "
                        "are slower and noisier with more)")
    p.add_argument("--quick", action="store_true", help="2 steps, 2 repeats (smoke test)")
    add_common_args(p, "formats")
    a = p.parse_args(argv)
    try:
        densities = [float(d) for d in a.densities.split(",") if d.strip()]
    except ValueError:
        p.error(f"--densities: expected comma-separated numbers, got {a.densities!r}")
    if not densities or not all(0 < d <= 1 for d in densities):
        p.error("--densities must lie in (0, 1]")
    steps, repeats = (2, 2) if a.quick else (a.steps, a.repeats)
    iw = a.index_bytes

    from gradsync.apps.models import real_gradients

    grads = real_gradients(a.model, steps=steps, accumulate=True)
    flat = torch.cat([g.reshape(-1) for g in grads.values()])
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, a.threads))
    try:
        rows = _measure(grads, flat, densities, iw, repeats)
    finally:
        torch.set_num_threads(threads)

    _report(rows, grads, flat, densities, iw, steps, repeats, a)
    return 0


def _measure(grads: dict[str, torch.Tensor], flat: torch.Tensor, densities: list[float],
             iw: int, repeats: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for d in densities:
        per = []
        for name, g in grads.items():
            r = {"kind": "tensor", "tensor": name, "density": d, **payload_sizes(top_k(g, d), iw)}
            rows.append(r)
            per.append(r)
        tot = {k: sum(r[k] for r in per) for k in ("numel", "nnz", "blocks", "coo_bytes",
                                                   "ds_bytes", "coo_payload", "ds_payload")}
        rows.append({"kind": "model_sum", "tensor": "ALL (per-tensor top-k)", "density": d,
                     **tot, "ratio": tot["ds_payload"] / tot["coo_payload"],
                     "ratio_with_headers": tot["ds_bytes"] / tot["coo_bytes"]})
        sel = top_k(flat, d)
        rows.append({"kind": "model_flat", "tensor": "ALL (flat, global top-k)", "density": d,
                     **payload_sizes(sel, iw)})
        rows.append({"kind": "throughput", "tensor": "ALL (flat, global top-k)", "density": d,
                     **codec_throughput(sel, iw, repeats)})
    for model, by_d in PAPER_TABLE_I.items():
        for d, (e1, e5, e50) in by_d.items():
            rows.append({"kind": "paper", "tensor": f"paper {model}", "density": d,
                         "epoch1": e1, "epoch5": e5, "epoch50": e50})
    return rows


def _report(rows: list[dict[str, Any]], grads: dict[str, torch.Tensor], flat: torch.Tensor,
            densities: list[float], iw: int, steps: int, repeats: int,
            a: argparse.Namespace) -> None:

    # -- tables ---------------------------------------------------------------------------
    def ratio_of(kind: str, tensor: str, d: float) -> Any:
        for r in rows:
            if r["kind"] == kind and r["tensor"] == tensor and r["density"] == d:
                return r["ratio"]
        return "-"

    def paper(model: str, d: float) -> str:
        for pd, e in PAPER_TABLE_I[model].items():
            if abs(pd - d) < 1e-9:
                return "/".join(f"{v:.2f}" for v in e)
        return "-"

    cols = ["tensor", "numel"] + [f"d={d:g}" for d in densities]
    table = [[name, g.numel()] + [ratio_of("tensor", name, d) for d in densities]
             for name, g in grads.items()]
    table.append(["ALL (per-tensor top-k)", flat.numel()]
                 + [ratio_of("model_sum", "ALL (per-tensor top-k)", d) for d in densities])
    table.append(["ALL (flat, global top-k)", flat.numel()]
                 + [ratio_of("model_flat", "ALL (flat, global top-k)", d) for d in densities])
    for model in PAPER_TABLE_I:
        table.append([f"paper {model} (ep 1/5/50)", "-"] + [paper(model, d) for d in densities])
    print_table(f"DenseStream / COO payload ratio ({a.model}, {steps} accumulated steps, "
                f"{iw}-byte index, fp32)", cols, table)
    tp = [r for r in rows if r["kind"] == "throughput"]
    print_table("encode / decode throughput, whole model (MB/s of encoded bytes, median)",
                ["density", "nnz", "COO enc", "COO dec", "DS enc", "DS dec"],
                [[r["density"], r["nnz"], r["coo_encode_MBps"], r["coo_decode_MBps"],
                  r["densestream_encode_MBps"], r["densestream_decode_MBps"]] for r in tp])

    def plot(ax):
        xs = [100 * d for d in densities]
        for kind, label, marker in (("model_flat", "ours: whole model (flat)", "o"),
                                    ("model_sum", "ours: sum of per-tensor", "s")):
            ys = [next(r["ratio"] for r in rows if r["kind"] == kind and r["density"] == d)
                  for d in densities]
            ax.plot(xs, ys, marker=marker, label=f"{label} ({a.model})")
        for model, by_d in PAPER_TABLE_I.items():
            pd = sorted(by_d)
            ax.plot([100 * d for d in pd], [sum(by_d[d]) / 3 for d in pd], linestyle="--",
                    marker="x", label=f"paper {model} (mean of epochs 1/5/50)")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xlabel("density (%)")
        ax.set_ylabel("DenseStream / COO size")
        ax.set_title("DenseStream Table I: compression ratio")
        ax.legend(fontsize=8)

    jpath, ppath = write_outputs("formats", rows, a.out, plot=plot,
                                 meta={"model": a.model, "steps": steps, "index_bytes": iw,
                                       "densities": densities, "repeats": repeats,
                                       "threads": a.threads,
                                       "coo_header": coo.HEADER_BYTES,
                                       "densestream_header": ds.HEADER_BYTES})
    print(f"wrote {jpath} and {ppath}")


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
