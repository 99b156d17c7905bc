"""CPU contention: P ranks sharing C cores (issue 14, simulator fidelity).

The timeline (:func:`gradsync.schedule.simulate`) runs the offload worker and the communication
thread in parallel with the backward pass for free, and prices a collective's rounds at the
per-message cost measured on an idle group. Both hold only while every thread has a core of
its own. With P ranks of up to three busy threads each (training, offload worker,
communication) on C < 3P cores, they do not; :class:`Contention` adds the terms that follow:

* **work floor** (Brent's bound, T ≥ work / processors): all P ranks' CPU work of one
  iteration has to run on C cores, so

      T ≥ P·σ·W / C,     W = forward + backward + sparsification + merges and codec + step

  per rank, each term the profiled wall time (a collective's per-message price is latency, not
  work, and stays out of W), and σ the core share a rank's thread had while
  those times were profiled (its CPU seconds per wall second). ``simulate --validate``
  profiles with all P ranks busy at once, one intra-op thread each, so σ = min(1, C/P) (the
  default, ``share=None``) and for P ≥ C the floor is W itself: nothing overlaps for free.
  A compute profile of one rank alone (``python -m gradsync profile``) has σ = 1. Each
  torch.distributed call adds ``call_cpu_s`` CPU seconds per rank to that work: a collective
  call's software path (Python, dispatch, gloo's threads, the socket system calls), measured
  as the process CPU time of one 8-byte all-reduce call on the idle group (0.2–0.5 ms on a
  2-core machine with 2–8 ranks, ten times the merge and codec start-ups; more under load).
  The calls are counted per collective (``dist_calls`` of
  :func:`gradsync.apps.sim.patterns.work`: one per point-to-point message and per control
  collective; a fusion buffer's all-reduce is one call, its sparse all-gather its rounds,
  ``CostModel.startups_allgather``):

      T ≥ P·(σ·W + calls·call_cpu_s) / C.

  Where a collective's own CPU per call was measured (:mod:`gradsync.apps.sim.callcpu`),
  that CPU X replaces its merges and codec in W and its calls in ``calls`` (it contains
  their CPU): T ≥ P·(σ·W + calls·call_cpu_s + X) / C.
* **loaded rounds**: a synchronising round that runs while the backward pass keeps the cores
  busy waits for each rank's communication thread to be scheduled. ``round_s`` is what one
  round costs above its idle price: the same 8-byte all-reduce timed on the group idle and
  with every rank running backward passes in a loop (:func:`profile_round_latency`), the
  difference spread over the ring's 2(P − 1) rounds (:func:`round_extra`). The timeline
  (:func:`gradsync.schedule.simulate`, ``round_s``) charges that call's extra, 2(P − 1)·
  ``round_s``, to each call of a buffer (its all-reduce, its all-gather, whatever the
  all-gather's rounds: a call waits once for the ranks' threads) that runs before the compute
  stream ends (WFBP overlap): a buffer that starts during the backward progresses at the
  loaded rate until the backward ends and at the idle rate after; a one-buffer collective
  (``planner="single"``) starts after the backward and sparsification, and its rounds pay the
  idle price (``ComputeCost.message``). Charging every round of every collective the loaded
  price over-predicted the sparse schemes at P = 8 by +28…+117 % (docs/results/simulator.md).

* **the collectives' CPU on the compute side** (:meth:`Contention.steal`): the other
  direction. A rank with at most one core runs its communication thread's CPU (message
  software, merges and codec, or the collective's measured CPU per call) on the core its
  backward pass needs, so a buffer sent during the backward pushes the rest of the backward
  back by its CPU (:func:`gradsync.schedule.simulate`, ``steal``). Measured on 2 cores at
  P = 2, 100 Mbit/s: the schemes that send during the backward measured a 13–18 ms backward,
  the one-buffer schemes 7 ms, as profiled; the loaded round was 0.01 ms, so the rounds were
  not what waited.

* **a one-buffer collective's CPU, every rank at once** (:meth:`Contention.busy`): such a
  collective starts after every rank's backward pass and sparsification, so all P ranks run
  its CPU (the measured CPU per call, or the merges and codec) at the same time, and on C < P
  cores that takes P/C of it in wall time. Without it the in-collective time of TopkA, Ok-Topk,
  DenseStream, gTop-k, SparDL, Gaussian-k and TopkDSA at P = 8 on 2 cores was under-predicted
  by 29–55 % (median over four sets of five validation runs; +2…−21 % with it), and the
  iteration held only through the work floor. A fusion buffer sent during the backward pass
  is priced by the loaded calls and ``steal`` instead, and the rounds of its all-gather,
  each a Python exchange whose peers must be scheduled, cost P/C of their idle software
  (``gradsync.apps.sim.predict``'s timed cost model).

``contention=None`` (the default of :func:`gradsync.apps.sim.predict.predict`) leaves every
prediction as it was.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Contention", "profile_round_latency", "round_extra"]


@dataclass(frozen=True)
class Contention:
    """P ranks on ``cores`` cores: the work floor and the loaded-round price (module docs).

    ``share``: σ, the core share of one rank's thread while its compute was profiled (None:
    min(1, cores/P), a profile taken with all P ranks busy); ``round_s``: seconds one
    synchronising round costs above its idle price under load; ``call_cpu_s``: CPU seconds
    one rank spends per torch.distributed call; ``steal_cpu``: whether the collectives' CPU
    delays the backward on a shared core (:meth:`steal`; off to see what it adds)."""

    cores: float
    round_s: float = 0.0
    share: float | None = None
    call_cpu_s: float = 0.0
    steal_cpu: bool = True

    def __post_init__(self) -> None:
        if not (math.isfinite(self.cores) and self.cores > 0):
            raise ValueError(f"cores must be a finite number > 0, got {self.cores!r}")
        for name in ("round_s", "call_cpu_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        if self.share is not None and not (math.isfinite(self.share) and self.share > 0):
            raise ValueError(f"share must be a finite number > 0, got {self.share!r}")

    def sigma(self, P: int) -> float:
        """σ at P ranks."""
        return self.share if self.share is not None else min(1.0, self.cores / P)

    def steal(self, P: int) -> float:
        """The share of a collective's CPU, run while the backward pass runs, that delays the
        backward: 1 when a rank has at most one core (P ≥ cores), 0 from two cores per rank
        up (a spare core runs the communication thread), linear in between."""
        if not self.steal_cpu:
            return 0.0
        return min(1.0, max(0.0, 2.0 - self.cores / P))

    def busy(self, P: int) -> float:
        """The wall seconds per CPU second of work that all P ranks run at once: P/C, at least
        1 (a one-buffer collective's CPU; module docs)."""
        return max(1.0, P / self.cores)

    def floor(self, work_s: float, P: int, calls: float = 0.0, cpu_s: float = 0.0) -> float:
        """Brent's bound: P ranks' CPU work (``work_s`` profiled wall seconds, ``calls``
        torch.distributed calls and ``cpu_s`` measured CPU seconds — the collectives' per
        call, :mod:`gradsync.apps.sim.callcpu` — each) on the cores."""
        return P * (self.sigma(P) * work_s + calls * self.call_cpu_s + cpu_s) / self.cores


def round_extra(idle_s: float, loaded_s: float, P: int) -> float:
    """``round_s`` from an 8-byte ring all-reduce timed idle and under load: the difference
    over its 2(P − 1) rounds (0 for one rank, never negative)."""
    if P < 2:
        return 0.0
    return max(0.0, (loaded_s - idle_s) / (2 * (P - 1)))


def profile_round_latency(load: Callable[[], Any], repeats: int = 20,
                          comm: Any = None) -> tuple[float, float, float]:
    """(idle, loaded, cpu) of an 8-byte all-reduce on the default group: the median seconds
    over ``repeats`` (each after a barrier, one warm-up), first with nothing else running, then
    while a thread of every rank calls ``load()`` in a loop (backward passes: what keeps the
    cores busy while the communication thread runs its rounds); and the process CPU seconds of
    one call on the idle group (``repeats`` calls back to back). Each the maximum over ranks.
    Every rank must call it."""
    import statistics
    import threading
    import time

    import torch
    import torch.distributed as dist

    from gradsync.collectives.comm import Comm

    comm = comm if comm is not None else Comm(None)
    if comm.size == 1:
        return 0.0, 0.0, 0.0
    x = torch.zeros(2, dtype=torch.float32)  # 8 bytes

    def timed() -> float:
        comm.all_reduce(x)
        ts = []
        for _ in range(repeats):
            comm.barrier()
            t0 = time.perf_counter()
            comm.all_reduce(x)
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    idle = timed()
    comm.barrier()
    c0 = time.process_time()
    for _ in range(repeats):
        comm.all_reduce(x)
    cpu = (time.process_time() - c0) / repeats
    stop = threading.Event()

    def busy() -> None:
        while not stop.is_set():
            load()

    th = threading.Thread(target=busy, name="gradsync-load", daemon=True)
    th.start()
    try:
        loaded = timed()
    finally:
        stop.set()
        th.join()
    t = torch.tensor([idle, loaded, cpu], dtype=torch.float64)
    comm.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0]), float(t[1]), float(t[2])
