"""Espresso: a compression option and a placement per tensor, chosen on the timeline
(Wang et al., "Hi-Speed DNN Training with Espresso: Unleashing the Full Potential of Gradient
Compression with Near-Optimal Usage Strategies", EuroSys'23, §4–5; the baseline of SSFusion
§II-E and §V).

Espresso's observation is that compression decisions interact: sparsifying a tensor on the GPU
delays the backward computation of every later tensor, offloading it to the CPU competes with
the other offloaded tensors, and sending a tensor dense occupies the link that later tensors
wait for. So it decides per tensor, from a cost model and the tensors' *ready times* in the
backward pass, among

* ``dense``: not compressed; all-reduced alone (Eq. 4);
* ``inline``: sparsified on the compute stream (T_gpu, delays the rest of the backward) and
  all-gathered (Eq. 3);
* ``offload``: sparsified on the (single, serial) CPU worker (T_offload) and all-gathered —
  Espresso's CPU offloading, the same worker SSFusion-O uses; not offered where the worker has
  no core of its own (a CPU host whose ranks take every core:
  :attr:`~gradsync.schedule.costmodel.CostModel.worker_has_a_core`), since the timeline runs
  it beside the backward.

Espresso has no tensor fusion: every tensor is its own message (SSFusion's argument against it:
the per-message start-up cost). Its other options (fp16, two-level all-gather) are outside
gradsync's transports and are not offered.

**Decision.** The iteration time of a candidate assignment is the timeline of
:func:`gradsync.schedule.timeline.simulate` (compute stream, offload worker, one serial
channel; every tensor ready after its T_b). Espresso's search is greedy per tensor over the
timeline, then refined; here:

1. start from every tensor ``dense``;
2. walk the tensors in backward order and give each the option that minimises the simulated
   iteration time with every other tensor's current option fixed (a later tensor's option is
   its current one, so the delay an inline sparsification causes downstream is charged);
3. repeat the walk until no tensor changes (at most ``passes`` walks; each walk can only lower
   the iteration time, so it terminates).

Ties (within 1 ppm) go to the simpler option, in the order dense, inline, offload.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gradsync.schedule.costmodel import CostModel
from gradsync.schedule.plan import BufferPlan, Plan, TensorPlan
from gradsync.schedule.timeline import buffer_parts, simulate

__all__ = ["OPTIONS", "espresso_buffers"]

OPTIONS = ("dense", "inline", "offload")


def _tensor(name: str, numel: int, option: str, density: float) -> TensorPlan:
    if option == "dense":
        return TensorPlan(name, numel, None, allreduce=True)
    return TensorPlan(name, numel, density, offload=option == "offload")


def _timeline(names: list[str], variants: dict[tuple[str, str], BufferPlan], cost: CostModel
              ) -> Callable[[dict[str, str]], float]:
    """``iteration(choice)``: :func:`~gradsync.schedule.timeline.simulate`'s iteration time of
    the plan whose buffer for tensor n is ``variants[n, choice[n]]``, bit for bit, computed from
    per-tensor constants taken once (T_b, the option's sparsification and message times).

    The walk evaluates 2 options per tensor per pass; with the whole simulation each time it was
    O(n²) object work — ResNet-152's 467 tensors took a minute to plan. The recurrence below is
    simulate's for one-tensor ``per_tensor`` buffers without CPU contention (what the planner
    asks for): the same operations in the same order."""
    simulate(Plan("espresso", [variants[n, "dense"] for n in names]), cost)  # its checks
    tb = [cost.backward[n] for n in names]
    run: dict[tuple[str, str], float] = {}
    send: dict[tuple[str, str], float] = {}
    for n in names:
        for o in OPTIONS:
            ar, ag = buffer_parts(variants[n, o], cost)
            t = variants[n, o].tensors[0]
            run[n, o] = 0.0 if o == "dense" else cost.t_sparsify(t.numel, offload=o == "offload")
            send[n, o] = cost.t_allreduce(ar) if o == "dense" else cost.t_allgather(ag)

    def iteration(ch: dict[str, str]) -> float:
        clock = worker = channel = 0.0
        for n, b in zip(names, tb):
            o = ch[n]
            clock += b
            if o == "offload":
                worker = max(worker, clock) + run[n, o]
                ready = worker
            else:
                if o == "inline":
                    clock += run[n, o]
                ready = clock
            # the channel is serial and a buffer's ready time depends on earlier ones only
            channel = max(ready, channel) + send[n, o]
        return max(channel, clock, worker)

    return iteration


def espresso_buffers(names: list[str], numel: dict[str, int], cost: CostModel, density: float,
                     passes: int = 4) -> tuple[list[BufferPlan], dict[str, Any]]:
    """One buffer per tensor (backward order), each with Espresso's option (module doc), and
    the decision record (options, predicted iteration time, walks)."""
    # where the worker has no core of its own it would not run beside the backward (the
    # timeline's assumption): no offloading (CostModel.worker_has_a_core)
    options = OPTIONS if cost.worker_has_a_core else OPTIONS[:2]
    choice = dict.fromkeys(names, "dense")
    variants = {(n, o): BufferPlan((_tensor(n, numel[n], o, density),), "per_tensor")
                for n in names for o in OPTIONS}  # built once: the walk only looks them up
    iteration = _timeline(names, variants, cost)
    best = iteration(choice)
    walks = 0
    for walks in range(1, passes + 1):  # noqa: B007 - the count is reported
        changed = False
        for n in names:
            current = choice[n]
            for opt in options:
                if opt == current:
                    continue
                t = iteration({**choice, n: opt})
                if t < best * (1 - 1e-6) or (t <= best * (1 + 1e-6)
                                            and OPTIONS.index(opt) < OPTIONS.index(choice[n])):
                    best, choice[n], changed = t, opt, True
        if not changed:
            break
    buffers = [variants[n, choice[n]] for n in names]
    return buffers, {"options": choice, "iteration": best, "walks": walks}
