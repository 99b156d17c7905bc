"""``python -m gradsync profile``: measure the cost model the fusion planners read.

SSFusion §IV-A "Various time estimation": a model's per-tensor backward times T_b^l, the
sparsifier's inline and offloaded cost, the collectives' CPU work (issue 14: merge and codec
fits of :func:`~gradsync.schedule.costmodel.profile_compute`, and the per-message software cost,
the all-gather α measured on the group), and — on several ranks — the α-β fits of all-reduce and
all-gather, measured with :mod:`gradsync.schedule.costmodel`'s profilers, printed as a table and
written as the JSON that ``CostModel.from_dict`` reads back. On several ranks it also runs the
sparse schemes' collectives on the model's real gradient and stores their process CPU per call
under ``"collective_cpu"`` (:mod:`gradsync.apps.sim.callcpu`; ``python -m gradsync simulate
--cost-model`` uses it at that P).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from gradsync import sparsify
from gradsync.apps import models
from gradsync.apps.sim.callcpu import CollectiveCPU
from gradsync.schedule.costmodel import (
    AlphaBeta,
    CostModel,
    profile_backward,
    profile_collectives,
    profile_compute,
    profile_sparsifier,
)
from gradsync.testing import run_distributed


def _collectives_rank(rank: int, world_size: int, sizes, repeats,
                      call_cpu: tuple | None = None) -> tuple[dict, dict, dict]:
    ar, ag = profile_collectives(None, sizes=sizes, repeats=repeats, lean=False)
    return vars(ar), vars(ag), _collective_cpu(rank, call_cpu)


def _collective_cpu(rank: int, call_cpu: tuple | None) -> dict:
    """Every rank: the process CPU per call of the schemes' collectives on this rank's real
    gradient (:func:`~gradsync.apps.sim.callcpu.profile_collective_cpu`); {} when not asked."""
    if not call_cpu:
        return {}
    from gradsync.apps.sim.callcpu import profile_collective_cpu

    model, batch, seed, density, schemes, device = call_cpu
    net, step = models.model_step(model, batch, seed, rank, device=device)
    step().backward()
    flat = torch.cat([p.grad.reshape(-1) for p in net.parameters() if p.grad is not None])
    return profile_collective_cpu(schemes, flat, density)


def build_cost_model(args, P: int, collectives: tuple[AlphaBeta, AlphaBeta]) -> CostModel:
    dev = torch.device(args.device)
    sizes = [int(s) for s in args.sizes.split(",")]
    net, step = models.model_step(args.model, args.batch, args.seed, device=dev)
    order, numel, backward = profile_backward(net, step, repeats=args.repeats)
    sp = sparsify.get(args.sparsifier, density=args.density, seed=args.seed)
    inline = profile_sparsifier(sp, sizes=sizes, repeats=args.repeats, device=dev)
    off = profile_sparsifier(sp, sizes=sizes, repeats=args.repeats, device=dev, offload=True)
    elem = next(net.parameters()).element_size()
    n = sum(numel.values())
    message = args.message_s if args.message_s is not None else collectives[1].alpha
    compute = profile_compute(sizes=[min(s, n) for s in (1 << 8, 1 << 12, 1 << 15, 1 << 17)],
                              repeats=args.repeats, message_s=message, numel=n, device=dev,
                              seed=args.seed)
    return CostModel(
        P=P, order=order, numel=numel, elem_bytes=elem, backward=backward, sparsify=inline,
        offload=off, allreduce=collectives[0], allgather=collectives[1],
        info={"model": args.model, "batch": args.batch, "sparsifier": args.sparsifier,
              "density": args.density, "device": str(dev), "sizes": sizes,
              "repeats": args.repeats, "threads": torch.get_num_threads(),
              "message_s_source": ("--message-s" if args.message_s is not None else
                                   f"all-gather α on {P} ranks" if P > 1 else
                                   "none (P = 1: give --world-size or --message-s)")},
        compute=compute,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m gradsync profile``: measure a cost model, print it, write it as JSON."""
    parser = argparse.ArgumentParser(
        prog="python -m gradsync profile",
        description="Profile backward, sparsification and collective times (SSFusion §IV-A) "
        "into a cost model JSON the fusion planners read.")
    parser.add_argument("--model", default="cnn", choices=models.names())
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--sparsifier", default="topk", choices=sparsify.names())
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--world-size", type=int, default=0,
                        help="profile collectives on N local gloo ranks (run_distributed); "
                        "under torchrun the launched group is used")
    parser.add_argument("--sizes", default=",".join(str(1 << e) for e in (10, 14, 17, 20)),
                        help="comma-separated tensor sizes (sparsifier: elements; "
                        "collectives: bytes)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--message-s", type=float, default=None,
                        help="per-message software cost (s) of the collectives; default: the "
                        "all-gather α measured with --world-size (0 on one rank)")
    parser.add_argument("--collective-cpu", default="topka,oktopk,densestream",
                        help="schemes whose collectives' CPU per call is measured on the "
                        "group (needs --world-size or torchrun; '' for none)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="small sizes, 2 repeats")
    parser.add_argument("--out", default="bench-out/profile/costmodel.json")
    args = parser.parse_args(list(argv) if argv is not None else None)
    if args.quick:
        args.sizes, args.repeats = "256,4096,16384", 2
    if args.repeats < 1 or args.batch < 1:
        raise ValueError("--repeats and --batch must be >= 1")
    if args.message_s is not None and not args.message_s >= 0:
        raise ValueError(f"--message-s must be >= 0, got {args.message_s}")
    sizes = [int(s) for s in args.sizes.split(",")]
    from gradsync.schedule import schemes as scheme_table

    call_schemes = [s.strip() for s in args.collective_cpu.split(",") if s.strip()]
    for s in call_schemes:
        scheme_table.get(s)  # an unknown name raises ValueError naming the choices
    call_cpu = ((args.model, args.batch, args.seed, args.density, call_schemes, "cpu")
                if call_schemes else None)

    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ and args.world_size == 0
    rank = 0
    if torchrun:
        if args.device.startswith("cuda"):  # before NCCL initialises: one GPU per rank
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            args.device = f"cuda:{torch.cuda.current_device()}"
        if not dist.is_initialized():
            dist.init_process_group("nccl" if args.device.startswith("cuda") else "gloo")
        rank, P = dist.get_rank(), dist.get_world_size()
        coll = profile_collectives(None, sizes=sizes, repeats=args.repeats, lean=False)
        # the collectives run on CPU tensors: a gloo group only
        gloo = dist.get_backend() == "gloo"
        samples = _collective_cpu(rank, call_cpu) if P > 1 and gloo else {}
    elif args.world_size > 1:
        P = args.world_size
        res = run_distributed(_collectives_rank, P, sizes, args.repeats, call_cpu, timeout=600)
        coll = (AlphaBeta(**res[0][0]), AlphaBeta(**res[0][1]))
        samples = res[0][2]
    else:
        P, coll, samples = 1, (AlphaBeta(0.0, 0.0), AlphaBeta(0.0, 0.0)), {}
    cost = build_cost_model(args, P, coll)
    calls = CollectiveCPU.from_samples(P, samples) if samples else None
    if rank == 0:
        table = Table(title=f"cost model: {args.model}, {args.sparsifier} on {args.device}, "
                      f"P={P}")
        table.add_column("quantity")
        table.add_column("value", justify="right")
        for q, v in cost.table_rows():
            table.add_row(str(q), f"{v:.4g}" if isinstance(v, float) else str(v))
        Console(width=100).print(table)
        if calls is not None:
            print(f"collectives' CPU per call at P={P}: {calls.describe(P)}")
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        doc = cost.to_dict() | ({"collective_cpu": calls.to_dict()} if calls else {})
        out.write_text(json.dumps(doc, indent=2))
        print(f"wrote {out}")
    if torchrun and dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":  # pragma: no cover
    import sys

    sys.exit(main())
