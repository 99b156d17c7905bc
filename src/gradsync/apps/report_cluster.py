"""``python -m gradsync report cluster``: the papers' cluster experiments, predicted.

The simulator (:func:`gradsync.apps.sim.predict.predict`) run on a *GPU-cluster cost profile*
(``cluster_profile.json`` beside this file, or ``--profile``): per-tensor backward times, GPU and
CPU sparsification, the collectives' compute and the α/β of 10/50/100/200 Gbit/s, Aries and
1 Gbit/s links. The bundled profile is **derived from published figures**: each number cites
its source in the file, and the output says so on every row. ``python -m gradsync
profile-cluster`` writes one whose per-tensor backward times, GPU sparsification, merge and
codec costs are measured on the local GPU (``apps/profile_cluster.py``; one H100's is
``docs/results/cluster-profile-h100.json``); rows whose times were measured say so.

Layer shapes are the published model definitions (:func:`gradsync.apps.models.reference`, on
the meta device); a per-tensor backward time is the model's training FLOPs (3 × forward; He et
al. Table 1 for ResNets, 6·N per token for transformers, Kaplan et al.) at the GPU's peak times
an assumed utilisation, spread over the tensors in proportion to their element counts.

Rows, each beside the paper's number and the error:

* SSFusion Fig. 11 (§V-B Exp. 1; 200 Gbit/s, 16/32/64 A100s, DGC at 1 %): SSFusion-(O+I)'s
  throughput gain over HiPress, Ok-Topk, SparDL, Espresso, OMGS and Cupcake per model
  (ResNet-152, BERT-large, GPT2-large; the paper's ViT-large is not modelled) and the
  pairwise ranges of the analysis (1)–(4) and the ablation (Naive vs HiPress, O vs Naive,
  O+I vs O). The figure's bars are not in the text; its stated ranges are what we compare.
* SSFusion Fig. 16 (Exp. 6; 10/50/100 Gbit/s): SSFusion's gain over the other schemes per
  bandwidth; the paper does not name the model, we take ResNet-152 (stated as an assumption).
* Ok-Topk Fig. 12 (§5.4.3): BERT weak scaling 32 → 256 P100s on Aries, Ok-Topk's speed-up
  over Dense, DenseOvlp, TopkA, TopkDSA, gTop-k and Gaussiank at 256 and its parallel
  efficiency.
* DenseStream Table II (§IV-C): communication time (s; sparsification, decompression and
  accumulation included) of Dense, TopkA, TopkDA and DSA on 4 RTX2080Ti nodes over 1 Gbit/s.

Error: range rows, predicted − paper in percentage points at each end (or × for speed-ups);
scalar rows, (predicted − paper) / paper.
"""

from __future__ import annotations

import argparse
import json
import math
from functools import cache
from pathlib import Path
from typing import Any

from gradsync.apps.common import print_table, write_outputs

__all__ = ["LABEL", "PROFILE", "Predictor", "cost_model", "load_profile", "run",
           "training_flops"]

PROFILE = Path(__file__).with_name("cluster_profile.json")
LABEL = "derived from published figures"

# ---- the papers' numbers (read from /work/shared/papers) ----------------------------------------
OTHERS = ("hipress", "oktopk", "spardl", "espresso", "omgs", "cupcake")
# SSFusion §V-B Exp. 1, Fig. 11: SSFusion-(O+I) over the others, % throughput, per model.
FIG11_MODELS = {"resnet152": (28.7, 74.2), "bert_large": (29.1, 106.7),
                "gpt2_large": (27.5, 84.1)}
# Exp. 1 analysis (1)-(4) and the ablation: (scheme, over, lo %, hi %), across the 4 tasks.
FIG11_PAIRS = [
    ("ssfusion_oi", ("hipress",), 66.9, 106.7), ("ssfusion_o", ("hipress",), 22.6, 40.1),
    ("ssfusion_oi", ("oktopk", "spardl"), 51.7, 89.3),
    ("ssfusion_oi", ("espresso",), 41.5, 68.7), ("ssfusion_o", ("espresso",), 8.9, 21.4),
    ("ssfusion_oi", ("omgs", "cupcake"), 27.5, 65.4),
    ("ssfusion", ("hipress",), 14.8, 26.2), ("ssfusion_o", ("ssfusion",), 8.2, 12.7),
    ("ssfusion_oi", ("ssfusion_o",), 54.5, 64.0),
]
FIG11_P = (16, 32, 64)
# Exp. 6, Fig. 16: SSFusion over the other tensor fusion schemes, per bandwidth.
FIG16 = {"10gbit": (31.5, 86.1), "50gbit": (22.7, 63.3), "100gbit": (25.5, 98.5)}
# Ok-Topk §5.4.3, Fig. 12: at 256 GPUs Ok-Topk is 3.29x-12.95x faster; 76.3 % efficiency.
OKTOPK_OTHERS = ("dense", "dense_ovlp", "topka", "topkdsa", "gtopk", "gaussiank")
OKTOPK_SPEEDUP = (3.29, 12.95)
OKTOPK_EFFICIENCY = 76.3
OKTOPK_P = (32, 64, 128, 256)
# DenseStream Table II: seconds; Dense has one number per model.
DS_TABLE_II = {
    ("densestream_vgg16", "dense", None): 7.61, ("densestream_resnet50", "dense", None): 1.34,
    ("densestream_vgg16", "topka", 0.01): 0.39, ("densestream_vgg16", "topka", 0.05): 1.50,
    ("densestream_vgg16", "topka", 0.10): 2.91, ("densestream_vgg16", "topkdsa", 0.01): 0.36,
    ("densestream_vgg16", "topkdsa", 0.05): 1.32, ("densestream_vgg16", "topkdsa", 0.10): 2.59,
    ("densestream_vgg16", "densestream", 0.01): 0.34,
    ("densestream_vgg16", "densestream", 0.05): 1.01,
    ("densestream_vgg16", "densestream", 0.10): 1.54,
    ("densestream_resnet50", "topka", 0.01): 0.09, ("densestream_resnet50", "topka", 0.05): 0.32,
    ("densestream_resnet50", "topka", 0.10): 0.59,
    ("densestream_resnet50", "topkdsa", 0.01): 0.09,
    ("densestream_resnet50", "topkdsa", 0.05): 0.30,
    ("densestream_resnet50", "topkdsa", 0.10): 0.51,
    ("densestream_resnet50", "densestream", 0.01): 0.11,
    ("densestream_resnet50", "densestream", 0.05): 0.26,
    ("densestream_resnet50", "densestream", 0.10): 0.43,
}
# DenseStream Table I, epoch 5: DenseStream / key-value size (the measured ratio the
# simulator's DenseStream pattern takes).
DS_TABLE_I = {("densestream_vgg16", 0.01): 0.99, ("densestream_vgg16", 0.05): 0.89,
              ("densestream_vgg16", 0.10): 0.77, ("densestream_resnet50", 0.01): 1.09,
              ("densestream_resnet50", 0.05): 0.89, ("densestream_resnet50", 0.10): 0.85}
NAMES = {"resnet152": "ResNet-152", "bert_large": "BERT-large", "gpt2_large": "GPT2-large",
         "densestream_vgg16": "VGG16", "densestream_resnet50": "ResNet50"}


# ---- the profile -------------------------------------------------------------------------------
def load_profile(path: str | Path | None = None) -> dict[str, Any]:
    """The cluster profile JSON; it must carry the "derived from published figures" label
    (or a "measured" one) and a source for every GPU, link and workload."""
    p = Path(path) if path is not None else PROFILE
    try:
        prof = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cluster profile {p}: {e}") from None
    for key in ("label", "gpus", "links", "workloads", "sparsify", "compute", "mfu"):
        if key not in prof:
            raise ValueError(f"cluster profile {p}: missing {key!r}")
    for sect in ("gpus", "links", "workloads"):
        bad = [k for k, v in prof[sect].items() if not v.get("source")]
        if bad:
            raise ValueError(f"cluster profile {p}: {sect} {bad} cite no source")
    return prof


@cache
def _shapes(model: str) -> tuple[tuple[str, int], ...]:
    from gradsync.apps import models

    net = models.reference(model, device="meta")
    return tuple((n, p.numel()) for n, p in net.named_parameters())


QUICK_TENSORS = 12


def training_flops(prof: dict[str, Any], wl: dict[str, Any], params: int, batch: int,
                   tokens: int | None) -> float:
    """FLOPs of one training step (3 × forward; forward = 2 × multiply-adds): the profile's
    MACs for a CNN (He et al. Table 1), else 6 per parameter and token (Kaplan et al.)."""
    if wl["kind"] == "cnn":
        macs = prof["training_flops"].get(f"{wl['model']}_macs")
        return (6 * macs if macs else 6 * params) * batch
    return 6 * params * tokens * batch


def cost_model(prof: dict[str, Any], workload: str, quick: bool = False):
    """(CostModel at P = 1, forward_s, step_s, batch) of one workload of the profile.

    ``quick``: the published parameter total in QUICK_TENSORS equal tensors instead of the
    model's real shapes (a smoke test: every planner is then fast; the numbers are not the
    report's), also for workloads the profile measured (``profile-cluster``), whose measured
    per-tensor times are used otherwise."""
    from gradsync.schedule.costmodel import AffineFit, AlphaBeta, ComputeCost, CostModel

    wl = prof["workloads"][workload]
    gpu = prof["gpus"][wl["gpu"]]
    comp = prof["compute"]
    ref_gpu = prof["sparsify"].get("reference_gpu", "A100")  # the GPU the fit was taken on
    g, c = prof["sparsify"]["gpu"], prof["sparsify"]["cpu"]
    sp = AffineFit(g["a"], g["b"] if wl["gpu"] == ref_gpu else
                   g["b"] * prof["gpus"][ref_gpu]["mem_bytes_per_s"] / gpu["mem_bytes_per_s"])
    off = AffineFit(c["a"], c["b"])
    compute = ComputeCost(message=comp["message"], merge=AffineFit(**comp["merge"]),
                          codec=AffineFit(**comp["codec"]))
    m = wl.get("measured")
    if m is not None and not quick:  # profile-cluster: T_b per tensor in gradient-ready order
        order = list(m["order"])
        numel = dict(zip(order, m["numel"]))
        backward = dict(zip(order, m["backward_s"]))
        forward, step = m["forward_s"], m["optimizer_s"]
    else:
        if quick:
            shapes = tuple((f"t{i}", wl["params"] // QUICK_TENSORS)
                           for i in range(QUICK_TENSORS))
        else:
            shapes = _shapes(wl["model"])
        n0 = sum(n for _, n in shapes)
        scale = wl.get("params", n0) / n0
        order = [name for name, _ in reversed(shapes)]  # gradients become ready output-first
        numel = {name: max(1, round(n * scale)) for name, n in shapes}
        n = sum(numel.values())
        if not math.isfinite(gpu["peak_flops"]):  # profile-cluster on a device it has no peak of
            raise ValueError(f"report cluster --quick: {workload} was measured on "
                             f"{wl['gpu']!r}, whose peak FLOP/s the profile does not give, so "
                             "its times cannot be derived from FLOPs; run without --quick to "
                             "use the measured times")
        flops = training_flops(prof, wl, n, wl["batch"], wl.get("tokens"))
        t = flops / (gpu["peak_flops"] * prof["mfu"][wl["kind"]]["value"])
        backward_total, forward = t * 2 / 3, t / 3
        backward = {name: backward_total * numel[name] / n for name in order}
        step = 16 * n / gpu["mem_bytes_per_s"]  # optimizer: read/write weight, grad, momentum
    cost = CostModel(P=1, order=order, numel=numel, elem_bytes=4, backward=backward,
                     sparsify=sp, offload=off, allreduce=AlphaBeta(0.0, 0.0),
                     allgather=AlphaBeta(0.0, 0.0),
                     info={"workload": workload, "profile": prof["label"]}, compute=compute)
    return cost, forward, step, wl["batch"]


class Predictor:
    def __init__(self, prof: dict[str, Any], quick: bool = False) -> None:
        self.prof, self.quick = prof, quick
        self.costs: dict[str, Any] = {}
        self.cache: dict[tuple, dict[str, Any]] = {}

    def row(self, workload: str, scheme: str, P: int, link: str, density: float = 0.01,
            ratio: float | None = None) -> dict[str, Any]:
        from gradsync.apps.sim.predict import Network, predict

        key = (workload, scheme, P, link, density, ratio)
        if key not in self.cache:
            if workload not in self.costs:
                self.costs[workload] = cost_model(self.prof, workload, self.quick)
            cost, fwd, stp, _ = self.costs[workload]
            ln = self.prof["links"][link]
            net = Network(ln["alpha"], 8.0 / ln["bits_per_s"])
            # the papers' algorithms: the experiments it predicts ran them, not gradsync's
            self.cache[key] = predict(scheme, cost, P, net, density, forward_s=fwd, step_s=stp,
                                      densestream_ratio=ratio, implementation="papers")
        return self.cache[key]

    def label(self, *workloads: str) -> str:
        """Where the workloads' compute times come from: measured (``profile-cluster``) or the
        profile's derivation from published figures."""
        measured = {w for w in workloads if "measured" in self.prof["workloads"][w]}
        if not measured or self.quick:
            return LABEL
        return self.prof["label"] + ("" if measured == set(workloads) else f" ({LABEL} for "
                                     f"{', '.join(sorted(set(workloads) - measured))})")

    def time(self, *args: Any, **kw: Any) -> float:
        return self.row(*args, **kw)["iteration_s"]


def _gain(p: Predictor, wl: str, a: str, b: str, P: int, link: str) -> float:
    """% throughput of scheme a over b (same batch per GPU): t_b / t_a − 1."""
    return 100 * (p.time(wl, b, P, link) / p.time(wl, a, P, link) - 1)


def _range_row(fig: str, what: str, paper: tuple[float, float], vals: list[float],
               unit: str = "%", profile: str = LABEL) -> dict[str, Any]:
    lo, hi = min(vals), max(vals)
    return {"figure": fig, "row": what, "unit": unit, "paper_lo": paper[0], "paper_hi": paper[1],
            "predicted_lo": lo, "predicted_hi": hi, "error_lo": lo - paper[0],
            "error_hi": hi - paper[1], "profile": profile}


def _scalar_row(fig: str, what: str, paper: float, pred: float, unit: str,
                profile: str = LABEL) -> dict[str, Any]:
    return {"figure": fig, "row": what, "unit": unit, "paper": paper, "predicted": pred,
            "error_rel": (pred - paper) / paper, "profile": profile}


def run(a: argparse.Namespace) -> list[dict[str, Any]]:
    """Every paper row, predicted; prints the table and writes report_cluster.png."""
    prof = load_profile(getattr(a, "profile", None))
    quick = bool(getattr(a, "quick", False))
    p = Predictor(prof, quick)
    rows: list[dict[str, Any]] = []
    # SSFusion Fig. 11: 200 Gbit/s, 16-64 GPUs
    for wl, paper in FIG11_MODELS.items():
        vals = [_gain(p, wl, "ssfusion_oi", o, P, "200gbit") for o in OTHERS for P in FIG11_P]
        rows.append(_range_row("SSFusion Fig. 11", f"{NAMES[wl]}: SSFusion-(O+I) over "
                               "HiPress/Ok-Topk/SparDL/Espresso/OMGS/Cupcake, 16-64 GPUs",
                               paper, vals, profile=p.label(wl)))
    for scheme, over, lo, hi in FIG11_PAIRS:
        vals = [_gain(p, wl, scheme, o, P, "200gbit") for wl in FIG11_MODELS for o in over
                for P in FIG11_P]
        rows.append(_range_row("SSFusion Fig. 11", f"{scheme} over {'/'.join(over)} "
                               "(3 models, 16-64 GPUs)", (lo, hi), vals,
                               profile=p.label(*FIG11_MODELS)))
    # SSFusion Fig. 16: bandwidths (model: ResNet-152, assumed)
    for link, paper in FIG16.items():
        vals = [_gain(p, "resnet152", "ssfusion_oi", o, P, link) for o in OTHERS
                for P in FIG11_P]
        rows.append(_range_row("SSFusion Fig. 16", f"{link}: SSFusion over the others "
                               "(ResNet-152 assumed), 16-64 GPUs", paper, vals,
                               profile=p.label("resnet152")))
    # Ok-Topk Fig. 12: BERT on Aries, weak scaling to 256
    ok = [p.time("oktopk_bert", o, 256, "aries") / p.time("oktopk_bert", "oktopk", 256, "aries")
          for o in OKTOPK_OTHERS]
    rows.append(_range_row("Ok-Topk Fig. 12", "BERT, 256 GPUs: Ok-Topk speed-up over Dense/"
                           "DenseOvlp/TopkA/TopkDSA/gTopk/Gaussiank", OKTOPK_SPEEDUP, ok, "x",
                           profile=p.label("oktopk_bert")))
    eff = 100 * (p.time("oktopk_bert", "oktopk", 32, "aries")
                 / p.time("oktopk_bert", "oktopk", 256, "aries"))
    rows.append(_scalar_row("Ok-Topk Fig. 12", "BERT: Ok-Topk parallel efficiency 32 -> 256 "
                            "GPUs (weak scaling)", OKTOPK_EFFICIENCY, eff, "%",
                            profile=p.label("oktopk_bert")))
    # DenseStream Table II: P = 4, 1 Gbit/s; communication time incl. sparsification
    for (wl, scheme, d), paper in DS_TABLE_II.items():
        ratio = DS_TABLE_I.get((wl, d)) if scheme == "densestream" else None
        r = p.row(wl, scheme, 4, "1gbit", d if d is not None else 0.01, ratio)
        pred = r["comm_s"] + (r["sparsify_s"] if scheme != "dense" else 0.0)
        label = {"topkdsa": "TopkDA", "densestream": "DSA", "dense": "Dense",
                 "topka": "TopkA"}[scheme]
        dtxt = "" if d is None else f", density {d:.0%}"
        rows.append(_scalar_row("DenseStream Table II", f"{NAMES[wl]} {label}{dtxt} (s)",
                                paper, pred, "s", profile=p.label(wl)))
    for r in rows:
        r["quick"] = quick
    _print(rows, prof, quick)
    write_outputs("report_cluster", rows, a.out, plot=_plot(rows, prof["label"]),
                  meta={"profile": prof["label"], "note": prof["note"]})
    return rows


def _fmt_row(r: dict[str, Any]) -> list[Any]:
    u = r["unit"]
    if "paper_lo" in r:
        return [r["figure"], r["row"], f"{r['paper_lo']:.3g}-{r['paper_hi']:.3g}{u}",
                f"{r['predicted_lo']:.3g}-{r['predicted_hi']:.3g}{u}",
                f"{r['error_lo']:+.3g}/{r['error_hi']:+.3g}{' pp' if u == '%' else u}"]
    return [r["figure"], r["row"], f"{r['paper']:.3g}{u}", f"{r['predicted']:.3g}{u}",
            f"{100 * r['error_rel']:+.1f}%"]


def _print(rows: list[dict[str, Any]], prof: dict[str, Any], quick: bool) -> None:
    measured = prof["label"] != LABEL  # a profile-cluster profile (--quick: its T_b unused)
    if measured:
        print(f"report cluster: the simulator on a GPU-cluster cost profile {prof['label'].upper()}"
              f" — {prof['note']}")
    else:
        print(f"report cluster: the simulator on a GPU-cluster cost profile "
              f"{LABEL.upper()} (no GPU measured; sources in {PROFILE.name})")
    if quick:
        print(f"--quick: each model as {QUICK_TENSORS} equal tensors of its published total "
              "(smoke test; not the report's numbers)")
    cols = ["figure", "row", "paper", "predicted", "error"]
    body = [_fmt_row(r) for r in rows]
    if measured:  # sparsification, merge and codec: the profile's, for every row
        cols.append("T_b, forward")
        body = [[*b, "derived" if r["profile"] == LABEL else "measured"
                 if r["profile"] == prof["label"] else "partly measured"]
                for b, r in zip(body, rows)]
    print_table(f"the papers' cluster experiments, predicted — profile {prof['label']}", cols,
                body)


def _plot(rows: list[dict[str, Any]], label: str = LABEL):
    def plot(ax) -> None:
        xs, ys, lo, hi = [], [], [], []
        for i, r in enumerate(rows):
            if "paper_lo" in r:
                pm = (r["paper_lo"] + r["paper_hi"]) / 2
                ys.append(((r["predicted_lo"] + r["predicted_hi"]) / 2) / pm if pm else 0.0)
                lo.append(r["predicted_lo"] / pm if pm else 0.0)
                hi.append(r["predicted_hi"] / pm if pm else 0.0)
            else:
                ys.append(r["predicted"] / r["paper"])
                lo.append(ys[-1])
                hi.append(ys[-1])
            xs.append(i)
        ax.vlines(xs, lo, hi, color="tab:blue", alpha=0.5)
        ax.plot(xs, ys, "o", color="tab:blue", label="predicted / paper (range midpoints)")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(xs)
        ax.set_xticklabels([f"{r['figure'].split()[0]} {i}" for i, r in enumerate(rows)],
                           rotation=90, fontsize=5)
        ax.set_ylabel("predicted / paper")
        ax.set_title(f"report cluster — profile {label}", fontsize=9)
        ax.legend(fontsize=7)

    return plot
