"""The training loop: one rank trains every scheme of a spec in turn and records each step.

Each rank trains on its own seeded, disjoint shard (:class:`~.shards.RankData`); all ranks start
from the same model (``gradsync.apps.models.build(name, seed)``); the loss is
``gradsync.apps.models.loss``. A step is timed from ``zero_grad`` to the end of the optimizer
step (CUDA synchronized at both ends); the runner (:mod:`.runners`) adds its breakdown.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradsync.apps.train.runners import make_optimizer, make_runner
from gradsync.apps.train.shards import RankData
from gradsync.apps.train.spec import SchemeChoice, TrainSpec

__all__ = ["evaluate", "mixed_precision", "progress_bar", "train_scheme", "train_worker"]


def train_scheme(choice: SchemeChoice, rank: int, P: int, spec: TrainSpec,
                 device: torch.device, progress: Any = None) -> dict:
    """Train one scheme on this rank; returns ``{"scheme", "task", "records", "eval",
    "history", "plan", "topk_shares"}`` (``records``: one dict per step, the ``steps`` fields of
    ``metrics.json``; ``eval``: rank 0's evaluation, empty elsewhere; ``history``: with
    ``spec.eval_every``, rank 0's ``{"step", "elapsed_s", **evaluation}`` every ``eval_every``
    steps and at the end; ``plan``: the engine's plan at the end, ``Plan.to_dict()``, or
    ``None`` outside the engine; ``topk_shares``: ``TrainSpec.topk_shares``'s record on rank 0,
    else ``None``)."""
    from gradsync.apps import models

    model = models.build(spec.model, seed=spec.seed).to(device)
    task = models.task(spec.model)
    data = RankData(spec.data, task, rank, P, spec.batch_size, spec.seed, device, spec.model,
                    model, spec.text_fallback)
    steps = spec.steps or max(1, round(spec.epochs * data.steps_per_epoch()))
    runner = make_runner(choice, model, spec, device, P, steps)
    opt = make_optimizer(model, spec.adamw, spec.lr, runner.momentum_correction,
                         spec.adam_freeze_step(steps), sync=runner.preconditioner)
    autocast, scaler = mixed_precision(spec.amp, device)
    if scaler is not None:
        runner.follow(scaler)
    records: list[dict] = []
    history: list[dict] = []
    elapsed = 0.0
    task_id = None
    if progress is not None:
        task_id = progress.add_task(choice.name, total=steps, loss=float("nan"), sps=0.0)
    try:
        with runner.metering():
            for step in range(steps):
                if spec.fail_rank == rank and step == 1:
                    raise RuntimeError(f"injected failure on rank {rank} at step {step} "
                                       "(--fail-rank)")
                xb, yb = data.next()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t0, c0 = time.perf_counter(), time.process_time()
                opt.zero_grad(set_to_none=True)
                with autocast():
                    loss = models.loss(runner.net(xb), yb)
                runner.before_backward()
                tb = time.perf_counter()
                (loss if scaler is None else scaler.scale(loss)).backward()
                tw = time.perf_counter()
                runner.after_backward()
                if scaler is None:
                    opt.step()
                else:  # skips the step when a gradient overflowed, and backs off
                    scaler.step(opt)
                    scaler.update()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                dt = time.perf_counter() - t0
                cpu = time.process_time() - c0  # every thread of this rank's process
                elapsed += dt
                rec = {"step": step, "loss": float(loss.detach()), "time_s": dt, "cpu_s": cpu,
                       "elapsed_s": elapsed, "samples_per_s": P * spec.batch_size / dt,
                       "warmup": step <= spec.warmup_steps, "probing": False,  # auto: engine's
                       **runner.step_metrics(tb, tw)}
                if scaler is not None:  # the scale for the next step (halved: skipped)
                    rec["loss_scale"] = float(scaler.get_scale())
                records.append(rec)
                if (rank == 0 and spec.eval_every and (step + 1) % spec.eval_every == 0
                        and step + 1 < steps):  # the final point is added below
                    history.append({"step": step + 1, "elapsed_s": elapsed,
                                    **evaluate(model, task, data, spec.eval_batches)})
                if progress is not None:
                    progress.update(task_id, advance=1, loss=rec["loss"],
                                    sps=rec["samples_per_s"])
        evaluation = evaluate(model, task, data, spec.eval_batches) if rank == 0 else {}
        if rank == 0 and spec.eval_every:
            history.append({"step": steps, "elapsed_s": elapsed, **evaluation})
        plan = runner.plan()
        shares = runner.topk_shares()
    finally:
        runner.close()
    if dist.is_initialized() and P > 1:
        dist.barrier()  # the next scheme starts together
    return {"scheme": choice.name, "task": task, "records": records, "eval": evaluation,
            "history": history, "plan": plan, "topk_shares": shares}


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
def evaluate(model: nn.Module, task: str, data: RankData, n: int) -> dict:
    """Test accuracy over ``n`` test batches (images), or the mean loss over the target tokens
    and its perplexity (language models; masked LMs: the masked tokens). ``n <= 0``: ``{}``."""
    if n <= 0:
        return {}
    from gradsync.apps import models

    model.eval()
    total_loss, correct, count, tokens = 0.0, 0, 0, 0
    try:
        for xb, yb in data.eval_batches(n):
            out = model(xb)
            if task != "image":  # mean over target tokens (masked LMs: the masked ones)
                t = int((yb != -100).sum())
                total_loss += float(models.loss(out, yb)) * t
                tokens += t
            else:
                correct += int((out.argmax(1) == yb).sum())
                count += len(yb)
    finally:
        model.train()
    if task != "image":
        mean = total_loss / max(tokens, 1)
        return {"eval_loss": mean, "perplexity": math.exp(min(mean, 50.0)),
                "eval_tokens": tokens}
    return {"test_accuracy": correct / max(count, 1), "test_samples": count}


def progress_bar(rank: int, enabled: bool) -> contextlib.AbstractContextManager:
    """Rank 0's rich progress bars (one per scheme), or nothing."""
    if rank != 0 or not enabled:
        return contextlib.nullcontext(None)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    return Progress(TextColumn("{task.description:>18}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("loss {task.fields[loss]:.3f}"),
                    TextColumn("{task.fields[sps]:.0f} samples/s"))


def train_worker(rank: int, world_size: int, spec: TrainSpec) -> dict:
    """One rank: train every scheme of ``spec.schemes`` in turn; returns its records.

    A module-level function so that :func:`gradsync.testing.run_distributed` and
    :func:`gradsync.testing.netem.run_shaped` can start it on every rank.
    """
    device = torch.device(spec.device or "cpu")
    runs = []
    with progress_bar(rank, spec.progress) as progress:
        for choice in spec.choices:
            runs.append(train_scheme(choice, rank, world_size, spec, device, progress))
    return {"rank": rank, "runs": runs}
