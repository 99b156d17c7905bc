"""``python -m gradsync bench rounds``: what one collective call costs a step, against a socket.

``python -m gradsync bench rounds [--world-size 2,4] [--calls 400] [--work-ms 0,0.5]
[--bytes 8,37000] [--out DIR] [--write-docs]``

A sparse step makes a few calls: TopkA one all-gather, DenseStream and Ok-Topk one exchange at
P = 2, and beyond it their rounds (Ok-Topk about four) and the engine's agreement word (an
all-reduce). Timed in lock-step, back to back, one gloo call costs about 0.2 ms on loopback
(docs/results/speed.md, "One round fewer"). A training step is not lock-step: the ranks
compute between the calls (select, encode, decode), and each call then starts from threads
that were busy or asleep. This command measures that: ``--world-size`` gloo ranks on this
machine make ``--calls`` calls of each op, with ``--work-ms`` of computation before each (a
multiply and a sum over a float tensor sized on rank 0 to take that long on one core; 0:
lock-step), every rank the same work, as ranks running the same step do.

Each call is timed on every rank from just before it starts to its return. Its **latency** is
its return less the last start it depends on (one machine, one monotonic clock): the latest of
every rank's for the collectives, the later of its own and the previous rank's (whose message
it receives) for the exchanges. A peer that arrives late costs nothing here; what is left is
the call itself and the threads behind it.
Per op, payload and work: the mean, median, 90th and 99th percentile over every rank's calls
but the first :data:`SKIP`; the mean and median of the slowest rank's latency per call (what
the ranks' next step waits for); and the mean over the socket's at the same P, payload and
work.

Ops (``--bytes`` per rank):

* ``exchange``: gloo point-to-point, each rank sends to the next and receives from the
  previous (one round of :meth:`~gradsync.collectives.comm.Comm.sendrecv`; at P = 2 the pair
  exchange of DenseStream's allreduce and of Ok-Topk's split and reduce);
* ``all_gather``, ``all_reduce``: gloo's own (the all-reduce sums float32 of that size);
* ``socket``: the exchange over plain TCP sockets between the same ranks (``TCP_NODELAY``,
  blocking calls on the rank's own thread): what a transport costs on this machine
  without gloo's threads;
* ``gather_doubling``, ``gather_ring`` (not run by default): gradsync's own gloo all-gather
  (:meth:`~gradsync.collectives.comm.Comm.all_gather`) held to Bruck's doubling (⌈log2 P⌉
  rounds) or to the ring (P − 1 rounds) whatever the size (at P ≤ 3, where the doubling
  saves no round, both are the ring): the measurement behind
  :data:`~gradsync.collectives.comm.LONG_BLOCK_BYTES`, the block per round saved from which it
  takes the ring.
  Without ``socket`` among the ops ``--bytes`` may exceed 1 MiB (up to 64 MiB).

Writes ``rounds-cpu.json``, ``.md`` and ``.png`` (to ``--out``, or ``docs/results/`` with
``--write-docs``).
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gradsync.apps.bench._harness import (
    add_output_args,
    bench_parser,
    print_rows,
    print_written,
)
from gradsync.apps.bench.overhead import DOCS_DIR, code_label
from gradsync.apps.common import cpu_description, grouped_bars, write_outputs
from gradsync.collectives.comm import Comm
from gradsync.testing import run_distributed

DEFAULT_OPS = ("exchange", "all_gather", "all_reduce", "socket")
OPS = (*DEFAULT_OPS, "gather_doubling", "gather_ring")
SKIP = 20  # unmeasured first calls of each case (connections, allocator)
MAX_BYTES = 1 << 20  # both ends send before they receive: a socket's buffer holds the message
MAX_GLOO_BYTES = 64 << 20  # without the socket: gloo's receives are posted before the sends


def _work(x: torch.Tensor, n: int) -> None:
    """The computation between two calls: one pass over ``n`` floats (a fresh product, summed)."""
    if n:
        (x[:n] * 1.0001).sum()


def _elements_per_ms(x: torch.Tensor) -> float:
    """How many floats :func:`_work` passes over per millisecond on this core (median of 21)."""
    n = x.numel()
    times = []
    for _ in range(21):
        t = time.perf_counter()
        _work(x, n)
        times.append(time.perf_counter() - t)
    return n / (1e3 * sorted(times)[len(times) // 2])


def _sockets(rank: int, world: int) -> tuple[socket.socket, socket.socket]:
    """TCP connections to the next rank (to send) and from the previous one (to receive)."""
    import torch.distributed as dist

    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    ports: list[Any] = [None] * world
    dist.all_gather_object(ports, server.getsockname()[1])
    out = socket.create_connection(("127.0.0.1", ports[(rank + 1) % world]))
    inn, _ = server.accept()
    server.close()
    for s in (out, inn):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return out, inn


def _op(name: str, nbytes: int, rank: int, world: int,
        socks: tuple[socket.socket, socket.socket]) -> Callable[[], None]:
    """One call of ``name`` with ``nbytes`` per rank."""
    import torch.distributed as dist

    nxt, prv = (rank + 1) % world, (rank - 1) % world
    msg = torch.full((nbytes,), rank % 251, dtype=torch.uint8)
    if name == "exchange":
        def call() -> None:
            buf = torch.empty_like(msg)
            r = dist.irecv(buf, prv)
            s = dist.isend(msg, nxt)
            r.wait()
            s.wait()
    elif name == "all_gather":
        def call() -> None:
            dist.all_gather([torch.empty_like(msg) for _ in range(world)], msg)
    elif name.startswith("gather_"):
        comm = Comm()
        comm.long_block_bytes = 0 if name == "gather_ring" else math.inf

        def call() -> None:
            comm.all_gather(msg)
    elif name == "all_reduce":
        vals = torch.ones(max(1, nbytes // 4), dtype=torch.float32)

        def call() -> None:
            dist.all_reduce(vals.clone())
    else:
        out, inn = socks
        raw = msg.numpy().tobytes()
        got = bytearray(nbytes)

        def call() -> None:
            out.sendall(raw)
            view, at = memoryview(got), 0
            while at < nbytes:
                at += inn.recv_into(view[at:], nbytes - at)
    return call


def _rank(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Every case on one rank: per case, the start and the return of each call."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    x = torch.randn(1 << 21)
    rate = torch.tensor([_elements_per_ms(x) if rank == 0 else 0.0], dtype=torch.float64)
    dist.broadcast(rate, 0)  # the others waited: rank 0 timed a core of its own
    sizes = {w: min(x.numel(), round(w * float(rate))) for w in cfg["work_ms"]}
    socks = _sockets(rank, world)
    cases: dict[str, Any] = {}
    try:
        for w in cfg["work_ms"]:
            for nbytes in cfg["bytes"]:
                for name in cfg["ops"]:
                    call = _op(name, nbytes, rank, world, socks)
                    starts, ends = [], []
                    for _ in range(cfg["calls"] + SKIP):
                        _work(x, sizes[w])
                        t = time.perf_counter()
                        call()
                        starts.append(t)
                        ends.append(time.perf_counter())
                    cases[f"{w}/{nbytes}/{name}"] = (starts[SKIP:], ends[SKIP:])
                    dist.barrier()
    finally:
        for s in socks:
            s.close()
    return {"cases": cases, "elements_per_ms": float(rate)}


def _summary(per_rank: list[dict[str, Any]], world: int, cfg: dict[str, Any]
             ) -> list[dict[str, Any]]:
    """The rows of one world size: each call's latency on every rank (its return less the last
    start it depends on: module doc), summarised per case."""
    rows = []
    for w in cfg["work_ms"]:
        for nbytes in cfg["bytes"]:
            at: dict[str, dict[str, Any]] = {}
            for name in cfg["ops"]:
                key = f"{w}/{nbytes}/{name}"
                starts = np.array([r["cases"][key][0] for r in per_rank])
                ends = np.array([r["cases"][key][1] for r in per_rank])
                if name in ("exchange", "socket"):  # rank r receives from rank r − 1
                    ready = np.maximum(starts, np.roll(starts, 1, axis=0))
                else:
                    ready = np.broadcast_to(starts.max(axis=0), starts.shape)
                lat = (ends - ready) * 1e3
                p50, p90, p99 = np.percentile(lat, [50, 90, 99])
                slowest = lat.max(axis=0)  # per call, the rank that finished last
                at[name] = {"P": world, "work_ms": w, "bytes": nbytes, "op": name,
                            "mean_ms": float(lat.mean()), "p50_ms": float(p50),
                            "p90_ms": float(p90), "p99_ms": float(p99),
                            "slowest_mean_ms": float(slowest.mean()),
                            "slowest_p50_ms": float(np.median(slowest)),
                            "calls": int(lat.size)}
            base = at.get("socket")
            for row in at.values():
                row["x_socket"] = None if base is None else row["mean_ms"] / base["mean_ms"]
                rows.append(row)
    return rows


COLUMNS = ("P", "work ms", "bytes", "op", "mean ms", "median", "p90", "p99",
           "slowest rank: mean", "median", "mean × socket's")


def _cells(r: dict[str, Any]) -> list[Any]:
    ratio = "" if r["x_socket"] is None else f"{r['x_socket']:.1f}"
    return [r["P"], f"{r['work_ms']:g}", r["bytes"], r["op"], f"{r['mean_ms']:.3f}",
            f"{r['p50_ms']:.3f}", f"{r['p90_ms']:.3f}", f"{r['p99_ms']:.3f}",
            f"{r['slowest_mean_ms']:.3f}", f"{r['slowest_p50_ms']:.3f}", ratio]


def findings(rows: list[dict[str, Any]]) -> list[str]:
    """One line per P and work: the gloo ops' mean latencies against the socket's."""
    lines = []
    for p in dict.fromkeys(r["P"] for r in rows):
        for w in dict.fromkeys(r["work_ms"] for r in rows if r["P"] == p):
            mine = [r for r in rows if r["P"] == p and r["work_ms"] == w]
            gloo = [r["mean_ms"] for r in mine if r["op"] != "socket"]
            sock = [r["mean_ms"] for r in mine if r["op"] == "socket"]
            how = "in lock-step" if w == 0 else f"with {w:g} ms of work before each call"
            line = (f"P = {p}, {how}: a gloo call's mean latency {min(gloo):.3f}–"
                    f"{max(gloo):.3f} ms")
            if sock:
                line += f", the socket's {min(sock):.3f}–{max(sock):.3f} ms"
            lines.append(line + ".")
            lines += _gather_findings(mine, p, how)
    return lines


def _gather_findings(rows: list[dict[str, Any]], p: int, how: str) -> list[str]:
    """Per payload where both ran: the all-gather's ring against its doubling (the mean over
    every rank's calls, and the slowest rank's per call, which the step waits for)."""
    by = {(r["bytes"], r["op"]): f"{r['mean_ms']:.3f} ms (slowest rank {r['slowest_mean_ms']:.3f})"
          for r in rows}
    return [f"P = {p}, {how}, {b} bytes per rank: the all-gather in P − 1 rounds (ring) "
            f"{by[b, 'gather_ring']}, in ⌈log2 P⌉ (doubling) {by[b, 'gather_doubling']}."
            for b in dict.fromkeys(r["bytes"] for r in rows)
            if (b, "gather_ring") in by and (b, "gather_doubling") in by]


def write_markdown(path: Path, rows: list[dict[str, Any]], meta: dict[str, Any]) -> Path:
    lines = ["# One collective call's latency in a step (`python -m gradsync bench rounds`)", "",
             "Written by the command, not by hand. What one call costs when the ranks compute "
             "between calls, as a training step does, against lock-step and against a plain TCP "
             "socket; the method is in `src/gradsync/apps/bench/rounds.py`'s docstring.", "",
             f"- date: {meta['date']}", f"- command: `{meta['command']}`",
             f"- machine: {os.cpu_count()} cores ({meta['cpu']}); 1-min load average "
             f"{meta['load'][0]:.1f} at the start, {meta['load_end'][0]:.1f} at the end; "
             f"wall time {meta['wall_s']:.0f} s",
             f"- code: {meta['code']}",
             f"- {meta['calls']} calls per case after {SKIP} unmeasured; work sized on rank 0 "
             f"({meta['elements_per_ms']:.0f} floats per ms); gloo ranks on loopback", "",
             "## What this shows", "", *(f"- {x}" for x in findings(rows)), "",
             "## Latency per call", "", "Latency: a call's return less the last start it "
             "depends on (every rank's for a collective, the sender's and its own for an "
             "exchange), over every rank's calls; the slowest rank's: per call, the latest "
             "of the ranks' latencies.", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(str(c) for c in _cells(r)) + " |" for r in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def _plot(rows: list[dict[str, Any]]) -> Callable[[Any], None]:
    def plot(ax: Any) -> None:
        big = max(r["bytes"] for r in rows)
        mine = [dict(r, case=f"P={r['P']}, {r['work_ms']:g} ms") for r in rows
                if r["bytes"] == big]
        grouped_bars(ax, mine, "op", "case", lambda r: r["mean_ms"], rotation=0)
        ax.set_ylabel("mean latency per call, ms")
        ax.set_title(f"one call of {big} bytes per rank: lock-step and with work between calls",
                     fontsize=9)
        ax.legend(fontsize=8)

    return plot


def _floats(p: argparse.ArgumentParser, flag: str, text: str) -> list[float]:
    try:
        vals = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        p.error(f"{flag}: comma-separated numbers, got {text!r}")
    if not vals:
        p.error(f"{flag}: give at least one value")
    return vals


def build_parser() -> argparse.ArgumentParser:
    p = bench_parser("rounds", __doc__)
    p.add_argument("--world-size", default="2,4", help="comma-separated world sizes (2,4)")
    p.add_argument("--calls", type=int, default=400, help="measured calls per case")
    p.add_argument("--work-ms", default="0,0.5",
                   help="comma-separated ms of computation before each call (0: lock-step)")
    p.add_argument("--bytes", default="8,37000", help="comma-separated payloads per rank")
    p.add_argument("--ops", default=",".join(DEFAULT_OPS),
                   help=f"comma-separated, of {', '.join(OPS)}")
    add_output_args(p, "rounds", 900.0)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = build_parser()
    a = p.parse_args(argv)
    worlds = [int(w) for w in _floats(p, "--world-size", a.world_size)]
    work = _floats(p, "--work-ms", a.work_ms)
    nbytes = [int(b) for b in _floats(p, "--bytes", a.bytes)]
    ops = [o.strip() for o in a.ops.split(",") if o.strip()]
    if min(worlds) < 2:
        p.error("--world-size: a call needs at least 2 ranks")
    if min(work) < 0:
        p.error("--work-ms: must be >= 0")
    if not ops or set(ops) - set(OPS):
        p.error(f"--ops: of {', '.join(OPS)}, got {a.ops!r}")
    most = MAX_BYTES if "socket" in ops else MAX_GLOO_BYTES
    if not all(1 <= b <= most for b in nbytes):
        p.error(f"--bytes: each in [1, {most}]" + (" with the socket" if "socket" in ops else ""))
    if a.calls < 1:
        p.error("--calls must be >= 1")
    cfg = {"work_ms": work, "bytes": nbytes, "ops": ops, "calls": a.calls}
    meta: dict[str, Any] = {
        "command": "python -m gradsync bench rounds " + shlex.join(argv),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "code": code_label(),
        "cpu": cpu_description(), "load": os.getloadavg(), **cfg, "world_sizes": worlds}
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for world in worlds:
        print(f"bench rounds: P = {world}, {len(ops) * len(work) * len(nbytes)} cases",
              flush=True)
        per_rank = run_distributed(_rank, world, cfg, timeout=a.timeout)
        meta["elements_per_ms"] = per_rank[0]["elements_per_ms"]
        rows.extend(_summary(per_rank, world, cfg))
    meta.update(wall_s=round(time.perf_counter() - t0, 1), load_end=os.getloadavg())
    out = DOCS_DIR if a.write_docs else Path(a.out)
    jpath, ppath = write_outputs("rounds-cpu", rows, out, plot=_plot(rows), meta=meta)
    mpath = write_markdown(out / "rounds-cpu.md", rows, meta)
    print_rows("bench rounds: latency per call (ms), its return less the last start it needs",
               [dict(zip(COLUMNS, _cells(r))) for r in rows])
    for line in findings(rows):
        print(line)
    print_written(jpath, mpath, ppath, lead=f"bench rounds: {meta['wall_s']:.0f} s; ")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
