"""The training loop: one rank trains every scheme of a spec in turn and records each step.

Each rank trains on its own seeded, disjoint shard (:class:`~.shards.RankData`); all ranks start
from the same model (``gradsync.apps.models.build(name, seed)``); the loss is
``gradsync.apps.models.loss``. A step is timed from ``zero_grad`` to the end of the optimizer
step (CUDA synchronized at both ends); the runner (:mod:`.runners`) adds its breakdown.

Divergence. A scheme diverges at step N when a loss or a gradient there is NaN/Inf, and every
rank must see it at the same step: a rank that stopped while its peers went on would leave them
in a collective it never joins. Two checks, both alike on every rank:

* a non-finite gradient makes the gradsync schemes raise on every rank at the same step
  (``Config.nonfinite="raise"``: the engine's ranks agree on it before raising, the DDP hook
  fails the bucket's future on every rank, whose sum carries the NaN); the loop catches those
  errors (their message says ``non-finite gradient``);
* after every step the ranks all-reduce which of them saw a non-finite loss (one small
  all-reduce, outside the timed step), so torch's DDP peers — whose hooks average a NaN
  without complaint — stop at the first step whose loss is NaN/Inf on any rank.

:func:`train_scheme` then ends the run there, every rank alike: no evaluation, the records up to
that step (the step itself when its loss was recorded) and ``status`` ``"diverged at step N"``.
:func:`train_worker` goes on with the next scheme (``keep_going``) or raises :class:`Diverged`
on every rank.

Progress. After each completed step (and each evaluation batch) a rank calls
:func:`gradsync.testing.distributed.heartbeat`, which feeds ``run_distributed``'s progress
watchdog (``TrainSpec.timeout``) and is a no-op elsewhere.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradsync.apps.train.metering import RunQueueClock
from gradsync.apps.train.runners import make_lr_schedule, make_optimizer, make_runner
from gradsync.apps.train.shards import RankData
from gradsync.apps.train.spec import SchemeChoice, TrainSpec
from gradsync.testing.distributed import heartbeat

__all__ = ["OK", "Diverged", "evaluate", "mixed_precision", "progress_bar", "train_scheme",
           "train_worker"]

OK = "ok"  # a run's "status" when it ran every step
NONFINITE_GRADIENT = "non-finite gradient"  # what the gradsync schemes' errors say (docstring)


class Diverged(RuntimeError):
    """A scheme diverged (module docstring, "Divergence"), raised alike on every rank by
    :func:`train_worker` without ``keep_going``; ``run`` is this rank's record of it."""

    def __init__(self, run: dict):
        self.run = run
        super().__init__(f"{run['scheme']} {run['status']}: {run['reason']}")


def _nonfinite_loss_ranks(loss: float, rank: int, P: int, comm: Any) -> list[int]:
    """The ranks whose loss of this step is NaN/Inf, the same list on every rank (one
    all-reduce of P flags on ``comm``, the default group's
    :class:`~gradsync.collectives.Comm`; ``None``: this rank alone). It runs while a DDP peer's
    ``counting_all_reduce`` counts ``dist.all_reduce``: counted after the step's record was
    taken and before the next step starts its count (``Meter.start_step``), it lands in no
    record."""
    flags = torch.zeros(P, dtype=torch.int64)
    flags[rank] = 0 if math.isfinite(loss) else 1
    if comm is not None:
        comm.all_reduce(flags, op=dist.ReduceOp.MAX)
    return [r for r, f in enumerate(flags.tolist()) if f]


def _stall(rank: int, step: int) -> None:
    """``TrainSpec.stall_at``: stop making progress, as a hung rank does, until stopped."""
    while True:  # the watchdog (or the launcher's end) terminates this process
        time.sleep(3600)


def train_scheme(choice: SchemeChoice, rank: int, P: int, spec: TrainSpec,
                 device: torch.device, progress: Any = None) -> dict:
    """Train one scheme on this rank; returns ``{"scheme", "task", "records", "phases", "eval",
    "history", "plan", "topk_shares", "status", "diverged_at", "reason"}`` (``records``: one
    dict per step, the ``steps`` fields of ``metrics.json``; ``phases``: one dict per record,
    its ``time_s`` in four consecutive wall-clock parts — ``forward_s`` (``zero_grad``, the
    forward pass and the loss), ``backward_call_s`` (``loss.backward()``, hooks included),
    ``after_backward_s`` (the runner's work after it: the engine's ``synchronize()``) and
    ``optimizer_s`` (the optimizer step), host times (on CUDA the last part ends with the
    device synchronized), and per part of those three (``forward_``, ``backward_``,
    ``optimizer_``) the training thread's CPU time (``*_main_cpu_s``) and the CPU time the
    process's other threads (communication, offload, gloo's) spent meanwhile
    (``*_others_cpu_s``) and the time the training thread waited for a core
    (``*_main_runq_s``, :class:`RunQueueClock`; NaN off Linux);
    ``bench anatomy`` reads them, ``metrics.json`` does not keep them;
    ``eval``: rank 0's evaluation, empty elsewhere; ``history``: with ``spec.eval_every``,
    rank 0's ``{"step", "elapsed_s", **evaluation}`` every ``eval_every`` steps and at the
    end; ``plan``: the engine's plan at the end, ``Plan.to_dict()``, or ``None`` outside the
    engine; ``topk_shares``: ``TrainSpec.topk_shares``'s record on rank 0, else ``None``;
    ``status``: :data:`OK` or ``"diverged at step N"``, alike on every rank, with
    ``diverged_at`` N and ``reason`` what was non-finite, else ``None`` — module docstring,
    "Divergence")."""
    from gradsync.apps import models

    model = models.build(spec.model, seed=spec.seed).to(device)
    task = models.task(spec.model)
    data = RankData(spec.data, task, rank, P, spec.batch_size, spec.seed, device, spec.model,
                    model, spec.text_fallback)
    steps = spec.steps or max(1, round(spec.epochs * data.steps_per_epoch()))
    runner = make_runner(choice, model, spec, device, P, steps)
    heartbeat()  # built: progress
    inject = spec.injects(choice.name)
    agree = None  # the ranks agree on a non-finite loss (module docstring, "Divergence")
    if P > 1 and dist.is_initialized():
        from gradsync.collectives.comm import Comm

        agree = Comm(None)
    opt = make_optimizer(model, spec.adamw, spec.lr, runner.momentum_correction,
                         spec.adam_freeze_step(steps), sync=runner.preconditioner)
    lr_schedule = make_lr_schedule(opt, spec.lr_schedule, steps)
    runner.follow(opt)  # as a user does: error feedback follows the learning rate
    autocast, scaler = mixed_precision(spec.amp, device)
    if scaler is not None:
        runner.follow(scaler)
    records: list[dict] = []
    phases: list[dict] = []  # the step's wall time in four parts (docstring)
    history: list[dict] = []
    elapsed = 0.0
    diverged: tuple[int, str] | None = None
    evaluation: dict = {}
    task_id = None
    if progress is not None:
        task_id = progress.add_task(choice.name, total=steps, loss=float("nan"), sps=0.0)
    runq = RunQueueClock()  # this thread's: the training thread's
    try:
        with runner.metering():
            for step in range(steps):
                if inject and spec.fail_rank == rank and step == 1:
                    raise RuntimeError(f"injected failure on rank {rank} at step {step} "
                                       "(--fail-rank)")
                xb, yb = data.next()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t0, c0, m0, q0 = (time.perf_counter(), time.process_time(), time.thread_time(),
                                  runq())
                opt.zero_grad(set_to_none=True)
                try:
                    with autocast():
                        loss = models.loss(runner.net(xb), yb)
                    runner.before_backward()
                    tb, pb, mb, qb = (time.perf_counter(), time.process_time(),
                                      time.thread_time(), runq())
                    (loss if scaler is None else scaler.scale(loss)).backward()
                    tw, pw, mw, qw = (time.perf_counter(), time.process_time(),
                                      time.thread_time(), runq())
                    runner.after_backward()
                    ta, pa, ma, qa = (time.perf_counter(), time.process_time(),
                                      time.thread_time(), runq())
                except Exception as e:  # the gradsync schemes' non-finite gradient: every rank
                    if NONFINITE_GRADIENT not in str(e):
                        raise
                    diverged = (step, f"{NONFINITE_GRADIENT} ({_nonfinite_message(e)})")
                    break
                if scaler is None:
                    opt.step()
                else:  # skips the step when a gradient overflowed, and backs off
                    scaler.step(opt)
                    scaler.update()
                if lr_schedule is not None:
                    lr_schedule.step()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t1, p1, m1, q1 = (time.perf_counter(), time.process_time(), time.thread_time(),
                                  runq())
                dt = t1 - t0
                cpu = p1 - c0  # every thread of this rank's process
                elapsed += dt
                rec = {"step": step, "loss": float(loss.detach()), "time_s": dt, "cpu_s": cpu,
                       "elapsed_s": elapsed, "samples_per_s": P * spec.batch_size / dt,
                       "warmup": step <= spec.warmup_steps, "probing": False,  # auto: engine's
                       "hooks_s": math.nan,  # the engine's gradient hooks (StepStats.hooks_s)
                       "hook_blocked_s": math.nan,  # DDP's hook calls' blocks (metering)
                       **runner.step_metrics(tb, tw)}
                if scaler is not None:  # the scale for the next step (halved: skipped)
                    rec["loss_scale"] = float(scaler.get_scale())
                records.append(rec)
                phases.append({"forward_s": tb - t0, "backward_call_s": tw - tb,
                               "forward_main_cpu_s": mb - m0, "backward_main_cpu_s": mw - mb,
                               "optimizer_main_cpu_s": m1 - ma,
                               "forward_others_cpu_s": (pb - c0) - (mb - m0),
                               "backward_others_cpu_s": (pw - pb) - (mw - mb),
                               "optimizer_others_cpu_s": (p1 - pa) - (m1 - ma),
                               "forward_main_runq_s": qb - q0, "backward_main_runq_s": qw - qb,
                               "optimizer_main_runq_s": q1 - qa,
                               "after_backward_s": ta - tw, "optimizer_s": t1 - ta})
                bad = _nonfinite_loss_ranks(rec["loss"], rank, P, agree)
                if bad:
                    diverged = (step, f"non-finite loss on rank{'s' if len(bad) > 1 else ''} "
                                      f"{', '.join(map(str, bad))}")
                    break
                if inject and spec.step_sleep:
                    time.sleep(spec.step_sleep)
                if inject and spec.stall_at == (rank, step):
                    _stall(rank, step)
                heartbeat(step)
                if (spec.eval_every and (step + 1) % spec.eval_every == 0
                        and step + 1 < steps):  # the final point is added below
                    point = evaluate(model, task, data, spec.eval_batches, P, rank)
                    if rank == 0:
                        history.append({"step": step + 1, "elapsed_s": elapsed, **point})
                if progress is not None:
                    progress.update(task_id, advance=1, loss=rec["loss"],
                                    sps=rec["samples_per_s"])
        if diverged is None:  # a diverged model's scores would mean nothing
            # every rank scores a share of the batches; rank 0 keeps the result
            point = evaluate(model, task, data, spec.eval_batches, P, rank)
            evaluation = point if rank == 0 else {}
            if spec.eval_every and rank == 0:
                history.append({"step": steps, "elapsed_s": elapsed, **evaluation})
        plan = runner.plan()
        shares = runner.topk_shares()
    finally:
        runq.close()
        runner.close()
    if dist.is_initialized() and P > 1:
        dist.barrier()  # the next scheme starts together
    status = OK if diverged is None else f"diverged at step {diverged[0]}"
    return {"scheme": choice.name, "task": task, "records": records, "phases": phases,
            "eval": evaluation, "history": history, "plan": plan, "topk_shares": shares,
            "status": status,
            "diverged_at": None if diverged is None else diverged[0],
            "reason": None if diverged is None else diverged[1]}


def _nonfinite_message(e: BaseException) -> str:
    """gradsync's own words in ``e``: the line naming the non-finite gradient, from where
    gradsync's message starts (torch wraps a DDP hook's error in lines of its own and a stack
    after it)."""
    line = next(ln for ln in str(e).splitlines() if NONFINITE_GRADIENT in ln).strip()
    start = line.find("gradsync")
    return line[start:] if start >= 0 else line


def mixed_precision(amp: str | None, device: torch.device
                    ) -> tuple[Any, torch.amp.GradScaler | None]:
    """``TrainSpec.amp``: a context factory for the forward pass (``torch.autocast`` in bf16
    or fp16, or nothing) and the fp16 run's ``GradScaler`` (``None`` otherwise)."""
    if amp is None:
        return contextlib.nullcontext, None
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[amp]

    def autocast() -> contextlib.AbstractContextManager:
        return torch.autocast(device.type, dtype=dtype)

    return autocast, (torch.amp.GradScaler(device.type) if amp == "fp16" else None)


@torch.no_grad()
def evaluate(model: nn.Module, task: str, data: RankData, n: int, P: int = 1,
             rank: int = 0) -> dict:
    """Test accuracy over ``n`` test batches (images), or the mean loss over the target tokens
    and its perplexity (language models; masked LMs: the masked tokens). ``n <= 0``: ``{}``.

    With ``P > 1`` ranks of an initialized process group every rank calls it, and it scores
    rank 0's model: rank 0's parameters and buffers (BatchNorm's running statistics, which
    differ by rank where nothing broadcasts them) are broadcast into a copy on the other ranks,
    batch ``b`` of the ``n`` is scored on rank ``b mod P`` and the sums are all-reduced. Every
    rank returns what rank 0 alone would have measured (accuracy exactly; a loss up to the
    order of its sum) in about 1/P of the time where ranks have cores of their own; ``model``
    itself is left as it was."""
    if n <= 0:
        return {}
    from gradsync.apps import models

    shared = P > 1 and dist.is_initialized()
    net = _rank0_model(model, rank) if shared else model
    was_training = model.training
    net.eval()
    sums = torch.zeros(4, dtype=torch.float64)  # loss x tokens, correct, images, tokens
    try:
        for b, (xb, yb) in enumerate(data.eval_batches(n)):
            heartbeat()  # evaluating is progress too
            if shared and b % P != rank:
                continue
            out = net(xb)
            if task != "image":  # mean over target tokens (masked LMs: the masked ones)
                t = int((yb != -100).sum())
                sums[0] += float(models.loss(out, yb)) * t
                sums[3] += t
            else:
                sums[1] += int((out.argmax(1) == yb).sum())
                sums[2] += len(yb)
    finally:
        model.train(was_training)
    if shared:
        on = sums.to(data.device)
        dist.all_reduce(on)
        sums = on.cpu()
    if task != "image":
        tokens = int(sums[3])
        mean = float(sums[0]) / max(tokens, 1)
        return {"eval_loss": mean, "perplexity": math.exp(min(mean, 50.0)),
                "eval_tokens": tokens}
    return {"test_accuracy": int(sums[1]) / max(int(sums[2]), 1), "test_samples": int(sums[2])}


def _rank0_model(model: nn.Module, rank: int) -> nn.Module:
    """Rank 0's model on every rank (a collective of the default group): rank 0's own, and on
    the other ranks a copy of theirs with rank 0's parameters and buffers broadcast into it."""
    net = model if rank == 0 else copy.deepcopy(model)
    with torch.no_grad():
        for t in [*net.parameters(), *net.buffers()]:
            dist.broadcast(t.data, src=0)
    return net


def progress_bar(rank: int, enabled: bool) -> contextlib.AbstractContextManager:
    """Rank 0's rich progress bars (one per scheme), or nothing."""
    if rank != 0 or not enabled:
        return contextlib.nullcontext(None)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    return Progress(TextColumn("{task.description:>18}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("loss {task.fields[loss]:.3f}"),
                    TextColumn("{task.fields[sps]:.0f} samples/s"))


def train_worker(rank: int, world_size: int, spec: TrainSpec, keep_going: bool = False,
                 on_run: Callable[[dict], Any] | None = None) -> dict:
    """One rank: train every scheme of ``spec.schemes`` in turn; returns its records
    ``{"rank", "runs"}``.

    A scheme that diverges (module docstring) raises :class:`Diverged` on every rank, or, with
    ``keep_going``, is recorded as such (its ``status``) and the next scheme runs.
    ``on_run(run)`` is called on every rank after each scheme (``python -m gradsync train``
    under torchrun gathers and writes the runs so far there).

    A module-level function so that :func:`gradsync.testing.run_distributed` and
    :func:`gradsync.testing.netem.run_shaped` can start it on every rank.
    """
    device = torch.device(spec.device or "cpu")
    runs = []
    with progress_bar(rank, spec.progress) as progress:
        for choice in spec.choices:
            run = train_scheme(choice, rank, world_size, spec, device, progress)
            if run["status"] != OK and not keep_going:
                raise Diverged(run)
            runs.append(run)
            if on_run is not None:
                on_run(run)
    return {"rank": rank, "runs": runs}
