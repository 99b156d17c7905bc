"""Timeline of one iteration under a :class:`Plan` and a :class:`CostModel`.

The pipeline of SSFusion Fig. 1 / Fig. 7 / Fig. 8 / Fig. 10 as a recurrence:

* the **compute stream** produces gradients in backward order, gradient l after T_b^l; inline
  sparsification (T_gpu, per tensor in a ``per_tensor`` buffer, once per buffer over the
  concatenation in a ``fused`` buffer when its last gradient is ready) runs on the same stream,
  so it delays the rest of the backward;
* **offloaded** sparsification (SSFusion-O) runs on one serial worker thread: a tensor starts
  when its gradient is ready and the worker is free, and takes T_offload;
* **communication** is one serial channel. Buffer i starts at max(its ready time, end of
  buffer i−1's communication) and takes ``dense``: T_AR(n·elem_bytes) (Eq. 4);
  ``fused``/``per_tensor``: T_AG(k·(4 + elem_bytes)) (Eq. 3) for its k sparse entries (a dense
  tensor in the all-gather part counts all its n entries). A buffer with an all-reduce part
  (SSFusion-I) runs T_AR(dense part) as soon as that part's tensors are ready and the channel
  is free, then T_AG(sparse part) once both the all-reduce and the sparse part are done —
  T2 = max(T_AR, compute of the rest) + T_AG of §IV-D.
* ``overlap=False`` (Dense vs DenseOvlp): the channel opens only after the last gradient.
* ``round_s`` (CPU contention, ``gradsync.apps.sim.contention``; 0 by default): while the
  compute stream runs, every part's call costs what the profiled 8-byte all-reduce call cost
  above its idle price, L = 2(P − 1)·``round_s`` (``round_s`` spreads that extra over the
  ring's rounds, ``CostModel.startups_allreduce``). An all-gather part pays a whole call's L
  too, whatever its rounds: a call waits once for the ranks' threads, and its rounds follow
  (docs/results/simulator.md, "An all-gather's rounds on shared cores"). Once the compute
  stream ends they run at the idle price. A part of idle duration b that starts at s
  therefore progresses at the rate b/(b + L) until the compute stream ends at E and at full
  speed after: it takes b + min(L, (E − s)·L/(b + L)). (Charging the whole L to every part
  that starts before E made a part that starts just before the end of the backward wait as
  if the backward went on: per-tensor plans at P = 8 were over-predicted by up to +59 %.) A
  part that starts after the compute stream ends pays nothing more.
* ``steal`` (CPU contention; 0 by default): the share of a part's CPU (``CostModel.
  t_compute_allreduce``/``t_compute_allgather``: message software, merges and codec, or the
  collective's measured CPU per call) that the compute stream loses while both run, for
  ranks with at most one core each (``Contention.steal``). A part that runs d seconds, o of
  them before the compute stream ends, pushes the rest of the compute stream (later
  gradients, the end of the backward) back by steal·cpu·o/d.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gradsync.schedule.costmodel import INDEX_BYTES, CostModel
from gradsync.schedule.plan import BufferPlan, Plan

__all__ = ["Timeline", "buffer_parts", "simulate"]


@dataclass
class Timeline:
    iteration: float  # seconds from the start of the backward to the end of the last message
    backward: float  # Σ T_b
    sparsify: float  # total sparsification work (inline + offloaded)
    comm: float  # total time the channel is busy
    exposed_comm: float  # iteration − end of the compute stream (communication not hidden)
    round_wait: float = 0.0  # the part of ``comm`` that ``round_s`` added
    buffers: list[dict[str, Any]] = field(default_factory=list)


def buffer_parts(buf: BufferPlan, cost: CostModel) -> tuple[int, int]:
    """(all-reduce bytes, all-gather bytes per rank) of one buffer."""
    if buf.mode == "dense":
        return buf.numel * cost.elem_bytes, 0
    if buf.mode == "fused":
        return 0, buf.k() * cost.entry_bytes
    ar = sum(t.numel for t in buf.tensors if t.allreduce) * cost.elem_bytes
    # a tensor sent whole in the all-gather: its values only (the selection's dense prefix)
    whole = sum(t.numel for t in buf.tensors if t.density is None and not t.allreduce)
    return ar, buf.k() * cost.entry_bytes - whole * INDEX_BYTES


def buffer_comm_time(buf: BufferPlan, cost: CostModel) -> float:
    """T_cm of one buffer alone (both parts, back to back)."""
    ar, ag = _parts(buf, cost)
    return (cost.t_allreduce(ar[1]) if ar[0] else 0.0) + (cost.t_allgather(ag[1]) if ag[0] else 0.0)


def _parts(buf: BufferPlan, cost: CostModel) -> tuple[tuple[bool, int], tuple[bool, int]]:
    """((has AR part, bytes), (has AG part, bytes per rank)): an empty part launches nothing."""
    ar_bytes, ag_bytes = buffer_parts(buf, cost)
    if buf.mode == "dense":
        return (True, ar_bytes), (False, 0)
    if buf.mode == "fused":
        return (False, 0), (True, ag_bytes)
    has_ar = any(t.allreduce for t in buf.tensors)
    has_ag = any(not t.allreduce for t in buf.tensors)
    return (has_ar, ar_bytes), (has_ag, ag_bytes)


def _loaded_extra(base: float, loaded: float, remaining: float) -> float:
    """What loaded rounds add to a part of idle duration ``base`` whose start-ups cost
    ``loaded`` more in all while the compute stream runs, ``remaining`` seconds more after the
    part starts: it progresses at the rate base/(base + loaded) until then, at full speed
    after (module docs)."""
    if loaded <= 0.0 or remaining <= 0.0:
        return 0.0
    return min(loaded, remaining * loaded / (base + loaded))


def simulate(plan: Plan, cost: CostModel, round_s: float = 0.0, steal: float = 0.0) -> Timeline:
    """Predict one iteration of ``plan`` under ``cost`` (see the module docstring)."""
    missing = [n for n in plan.names if n not in cost.backward]
    if missing:
        raise ValueError(f"the cost model has no backward time for {missing[:5]}")
    ready, compute_end, worker, backward, sparsify = _compute_stream(plan, cost)
    ch = _Channel(free=0.0 if plan.overlap else compute_end, end=compute_end, steal=steal)
    rows = [_communicate(buf, cost, r_ar, r_ag, ch, round_s)
            for buf, (r_ar, r_ag) in zip(plan.buffers, ready)]
    iteration = max(ch.free, ch.end, worker)
    return Timeline(iteration=iteration, backward=backward, sparsify=sparsify, comm=ch.busy,
                    exposed_comm=iteration - ch.end, buffers=rows, round_wait=ch.wait)


def _compute_stream(plan: Plan, cost: CostModel
                    ) -> tuple[list[tuple[float, float]], float, float, float, float]:
    """The compute stream and the offload worker (module doc): the gradients in backward
    order, each after T_b^l, inline sparsification on the stream, offloaded on the worker.
    Returns per buffer (AR part ready, AG part ready), the end of the compute stream, the
    time the worker is free from, Σ T_b and the sparsification work."""
    clock = 0.0  # compute stream
    worker = 0.0  # offload thread: free from this time on
    backward = sparsify = 0.0
    ready: list[tuple[float, float]] = []  # per buffer: (AR part ready, AG part ready)
    for buf in plan.buffers:
        t_ar = t_ag = 0.0
        for t in buf.tensors:
            clock += cost.backward[t.name]  # T_b^l
            backward += cost.backward[t.name]
            done = clock
            if buf.mode == "per_tensor" and t.density is not None:
                if t.offload:
                    run = cost.t_sparsify(t.numel, offload=True)
                    worker = max(worker, clock) + run
                    done = worker
                else:
                    run = cost.t_sparsify(t.numel)
                    clock += run
                    done = clock
                sparsify += run
            if t.allreduce:
                t_ar = max(t_ar, done)
            else:
                t_ag = max(t_ag, done)
        if buf.mode == "fused":  # one sparsification of the concatenated buffer
            run = cost.t_sparsify(buf.numel)
            clock += run
            sparsify += run
            t_ag = clock
        elif buf.mode == "dense":
            t_ar, t_ag = t_ag, 0.0
        ready.append((t_ar, t_ag))
    return ready, clock, worker, backward, sparsify


@dataclass
class _Channel:
    """The serial communication channel: free from ``free`` on; ``end``, the end of the
    compute stream, pushed back by the CPU the parts have stolen from it (``shift`` so far,
    ``steal``: module doc); ``busy``, its total busy time; ``wait``, what ``round_s`` added."""

    free: float
    end: float
    steal: float
    busy: float = 0.0
    wait: float = 0.0
    shift: float = 0.0

    def run(self, ready: float, base: float, loaded: float, cpu: float) -> float:
        """One part, ready at ``ready``, of idle duration ``base``, whose call costs ``loaded``
        more while the compute stream runs and whose CPU is ``cpu``: it starts when it is ready
        and the channel is free. Returns its start; the channel is free at its end."""
        s = max(ready, self.free)
        extra = _loaded_extra(base, loaded, self.end - s)
        d = base + extra
        overlap = max(0.0, min(s + d, self.end) - s)
        x = self.steal * cpu * overlap / d if d > 0 else 0.0
        self.shift, self.end = self.shift + x, self.end + x
        self.wait += extra
        self.free = s + d
        self.busy += d
        return s


def _communicate(buf: BufferPlan, cost: CostModel, r_ar: float, r_ag: float, ch: _Channel,
                 round_s: float) -> dict[str, Any]:
    """Buffer ``buf``'s parts on the channel ``ch``: T_AR of its all-reduce part as soon as
    that part is ready (``r_ar``), then T_AG of its all-gather part (``r_ag``), both pushed
    back by what the communication so far stole from the compute stream. Returns its row."""
    r_ar, r_ag = r_ar + ch.shift, r_ag + ch.shift
    (has_ar, ar_bytes), (has_ag, ag_bytes) = _parts(buf, cost)
    row: dict[str, Any] = {"mode": buf.mode, "tensors": len(buf.tensors),
                           "ar_bytes": ar_bytes, "ag_bytes": ag_bytes}
    start, loaded = None, cost.startups_allreduce() * round_s  # one call's (module doc)
    if has_ar:
        s = ch.run(r_ar, cost.t_allreduce(ar_bytes), loaded, cost.t_compute_allreduce(ar_bytes))
        start = s
        row.update(ar_ready=r_ar, ar_start=s, ar_end=ch.free)
    if has_ag:
        s = ch.run(r_ag, cost.t_allgather(ag_bytes), loaded, cost.t_compute_allgather(ag_bytes))
        start = s if start is None else start
        row.update(ag_ready=r_ag, ag_start=s, ag_end=ch.free)
    row.update(ready=max(r_ar if has_ar else 0.0, r_ag if has_ag else 0.0), start=start,
               end=ch.free)
    return row
