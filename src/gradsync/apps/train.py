"""``python -m gradsync train``: train a model with one or more sync schemes and compare them.

Two ways to run:

* **local workers** (default): ``--world-size N`` real gloo processes on loopback
  (:func:`gradsync.testing.run_distributed`), or, with ``--bandwidth 100mbit``, one network
  namespace per rank on tbf-shaped links (:func:`gradsync.testing.netem.run_shaped`; root only,
  otherwise it says so in one line and uses loopback). ``--latency`` is tbf's queueing bound,
  **not** a propagation delay (not emulated; see :mod:`gradsync.testing.netem`).
* **one worker of a torchrun job**, when ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and
  ``MASTER_ADDR`` are set: ``init_process_group`` with NCCL when CUDA is available (model and
  data on ``cuda:LOCAL_RANK``), else gloo; rank 0 prints the summary and writes ``--out``.

Schemes (``--scheme a,b,c`` runs each in turn with the same seed and data, one table at the end):

* every engine scheme of :data:`gradsync.schedule.SCHEMES` (``ssfusion_oi``, ``oktopk``,
  ``densestream``, …) through :class:`gradsync.GradSync`;
* torch's own DDP as peers: ``ddp`` (torch's ``allreduce_hook``, the same all-reduce as DDP's
  built-in one, but through Python so its bytes are counted), ``ddp_powersgd``
  (``powerSGD_hook``, rank 1, error feedback, compression from step 2), ``ddp_fp16``
  (``fp16_compress_hook``);
* ``ddp_gradsync_<s>``: DDP with gradsync's comm hook (:mod:`gradsync.ddp`, ``s`` in
  ``dense``, ``per_tensor``, ``ssfusion``, ``ssfusion_oi``).

DDP peers run with ``broadcast_buffers=False`` (the engine does not synchronize buffers
either). Their bytes are counted at the call: ``torch.distributed.all_reduce`` is wrapped in the
worker while a DDP peer trains, with the ring accounting of :class:`gradsync.collectives.Comm`
(``2(P−1)/P·B`` per all-reduce of B bytes). ``ddp_powersgd``'s hook is made blocking per bucket
(gloo cannot launch its second all-reduce from a callback while another bucket's is queued;
see DESIGN.md), so its overlap is understated.

Each rank trains on its own seeded, disjoint shard of the training data; all ranks start from
the same model (``gradsync.apps.models.build(name, seed)``); SGD with momentum 0.9 (AdamW for the
transformers: GPT, BERT, ViT); for sparse schemes the momentum moves into error feedback as
DGC's momentum correction (§3.2) and SGD itself runs without momentum — measured on the CNN
at 1% density, 4 ranks, 100 steps: ssfusion_oi 71.7% → 76.3% test accuracy, oktopk 76.7% →
77.5% (dense 80.1%). The loss is ``gradsync.apps.models.loss``. Data: ``fashion-mnist``
for image models, ``text`` for language models (``gradsync.apps.data.text_corpus``, byte ids, word
ids for ``lstm``; causal or masked targets per ``gradsync.apps.models.task``), ``synthetic`` only
when asked for. When the real data is not installed it says so in one line and uses synthetic
images, or gradsync's own source text for the language models.

Time breakdown per step (SSFusion Fig. 13), in seconds:

* ``backward_s``: engine — first to last gradient hook (``GradSync.stats()``); DDP peers — from
  the start of ``loss.backward()`` to the last bucket's hook call;
* ``sparsify_s``: engine — sparsification, inline and offloaded; DDP peers — the synchronous
  part of the comm hooks (PowerSGD/fp16 compression, launches);
* ``comm_s``: engine — time inside collectives; DDP peers — union of the hooks' launch→done
  intervals minus their synchronous part;
* ``wait_s``: the exposed communication — engine: ``synchronize()`` blocked on
  communication; DDP peers: end of the last hook call to ``loss.backward()`` returning.

For ``ddp_gradsync_<s>`` only ``backward_s`` (all of ``loss.backward()``, its blocking hook
included), bytes and the missing rate are recorded; the other three are NaN.

``--out DIR`` writes ``metrics.json``, ``loss_vs_time.png`` and ``throughput.png``.
``metrics.json`` schema (``"schema": "gradsync.train/1"``)::

    {
      "schema": "gradsync.train/1",
      "config": {model, data, schemes, world_size, steps, batch_size, lr, optimizer, density,
                 sparsifier, seed, warmup_steps, eval_batches, bandwidth, latency,
                 text_fallback},
      "environment": {torch, python, machine, cpus, load_avg, time, launcher
                      ("local"|"torchrun"), backend, device, link ("loopback"|"tbf …"),
                      shaped, bandwidth_bps, propagation_delay},
      "runs": [{
        "scheme": str, "task": "image" | "causal_lm" | "masked_lm",
        "steps": [{"step", "loss", "time_s", "elapsed_s", "samples_per_s", "bytes_sent",
                   "bytes_recv", "backward_s", "sparsify_s", "comm_s", "wait_s",
                   "missing_rate", "warmup"}, …],          # rank 0's records
        "bytes_sent_per_rank": [[per-step bytes of rank r] for r in ranks],
        "summary": {"scheme", "measured_steps", "samples_per_s", "step_s", "backward_s",
                    "sparsify_s", "comm_s", "wait_s", "bytes_per_step", "mb_per_step",
                    "missing_rate", "final_loss", "speedup_vs_ddp" (null without ddp),
                    "test_accuracy", "test_samples" (images) | "eval_loss", "perplexity",
                    "eval_tokens" (language models; masked LMs: over the masked tokens)}
      }, …]
    }

``samples_per_s`` is global (all ranks) and, like the times, the median over the steps after
the ``warmup_steps + 1`` first ones; ``bytes_per_step`` is the mean over ranks and measured
steps; ``final_loss`` the mean over ranks of the last step's loss; test accuracy is measured
on rank 0 on the first ``eval_batches × batch_size`` images of the real test split.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["DDP_PEERS", "all_schemes", "launch", "main", "parse_args", "summarize",
           "train_worker"]

SCHEMA = "gradsync.train/1"
DDP_PEERS = ("ddp", "ddp_powersgd", "ddp_fp16")
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")
DATASETS = ("fashion-mnist", "text", "synthetic")


def all_schemes() -> list[str]:
    """Every accepted ``--scheme`` value."""
    from gradsync.integrations import ddp as gddp
    from gradsync.schedule import SCHEMES

    return [*DDP_PEERS, *SCHEMES, *(f"ddp_gradsync_{s}" for s in gddp.DDP_SCHEMES)]


# ------------------------------------------------------------------------------ arguments
def _density(s: str) -> float:
    from gradsync.sparsify import validate_density  # the one rule every layer applies

    try:
        return validate_density(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {s!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {s!r}")
    return v


def _positive_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {s!r}") from None
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {s!r}")
    return v


def build_parser(prog: str = "python -m gradsync train") -> argparse.ArgumentParser:
    from gradsync.apps import models
    from gradsync.engine.config import ENGINE_SPARSIFIERS

    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Schemes: " + ", ".join(all_schemes()))
    p.add_argument("--model", default="cnn", choices=models.names())
    p.add_argument("--data", choices=DATASETS, default=None,
                   help="default: the model's real dataset (fashion-mnist, or text for LMs)")
    p.add_argument("--scheme", default="ssfusion_oi",
                   help="one scheme or a comma-separated list run in turn (see below)")
    p.add_argument("--world-size", type=_positive_int, default=2,
                   help="local workers (ignored under torchrun)")
    p.add_argument("--density", type=_density, default=0.01)
    p.add_argument("--sparsifier", default="dgc", choices=ENGINE_SPARSIFIERS)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--steps", type=_positive_int, default=None, help="default 50")
    g.add_argument("--epochs", type=_positive_float, default=None,
                   help="passes over each rank's shard (instead of --steps)")
    p.add_argument("--batch-size", type=_positive_int, default=32, help="per rank")
    p.add_argument("--lr", type=_positive_float, default=None,
                   help="default 0.05 (SGD, momentum 0.9) or 3e-3 (AdamW, language models)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup-steps", type=_positive_int, default=5,
                   help="engine profiling steps; the first warmup+1 steps are not measured")
    p.add_argument("--bandwidth", default=None,
                   help="emulate per-rank links of this rate (tbf, root): 100mbit, 1gbit, …")
    p.add_argument("--latency", default=None,
                   help="tbf queueing bound (e.g. 50ms); NOT a propagation delay, which is not "
                        "emulated (see gradsync.testing.netem)")
    p.add_argument("--out", default=None, help="write metrics.json and PNG plots here")
    p.add_argument("--eval-batches", type=int, default=20,
                   help="test batches for accuracy / perplexity (0 = no evaluation)")
    p.add_argument("--timeout", type=_positive_float, default=900.0,
                   help="seconds before a hung job is stopped")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--fail-rank", type=int, default=None, help=argparse.SUPPRESS)  # tests
    return p


def parse_args(argv: list[str] | None, parser: argparse.ArgumentParser | None = None
               ) -> argparse.Namespace:
    """Parse and validate; bad values exit with status 2 (argparse errors)."""
    from gradsync.testing import netem

    p = parser or build_parser()
    a = p.parse_args(argv)
    a.schemes = [s.strip() for s in a.scheme.split(",") if s.strip()]
    known = all_schemes()
    bad = [s for s in a.schemes if s not in known]
    if not a.schemes or bad:
        p.error(f"--scheme: unknown {bad or a.scheme!r}; choose from {', '.join(known)}")
    if len(set(a.schemes)) != len(a.schemes):
        p.error(f"--scheme: {a.scheme!r} names a scheme twice")
    if a.eval_batches < 0:
        p.error(f"--eval-batches must be >= 0, got {a.eval_batches}")
    if a.bandwidth is not None:
        try:
            a.bandwidth_bps = netem.parse_bandwidth(a.bandwidth)
        except ValueError as e:
            p.error(f"--bandwidth: {e}")
    else:
        a.bandwidth_bps = None
        if a.latency is not None:
            p.error("--latency shapes links: give --bandwidth too")
    if a.latency is not None:
        try:
            netem.parse_time(a.latency)
        except ValueError as e:
            p.error(f"--latency: {e}")
    from gradsync.apps import models

    try:  # a model needing a missing optional dependency fails here, not in every rank
        models.build(a.model, seed=0, device="meta")
    except (ImportError, RuntimeError) as e:
        p.error(f"--model {a.model}: {e}")
    is_lm = models.task(a.model) != "image"
    natural = "text" if is_lm else "fashion-mnist"
    if a.data is None:
        a.data = natural
    elif a.data != "synthetic" and a.data != natural:
        p.error(f"--data {a.data} does not fit model {a.model} (use {natural} or synthetic)")
    a.text_fallback = False
    if a.steps is None and a.epochs is None:
        a.steps = 50
    if a.lr is None:
        a.lr = 3e-3 if _uses_adamw(a.model) else 0.05
    return a


def _uses_adamw(name: str) -> bool:
    """Transformers (GPT, BERT, ViT) train with AdamW; the others with SGD + momentum."""
    return name.startswith(("gpt", "bert", "vit"))


# ------------------------------------------------------------------------------ data
class _Data:
    """One rank's shard of the training data and the evaluation set (seeded, disjoint).

    Images: a seeded permutation of the training set, rank r takes every P-th image from r;
    each epoch visits the shard in a new seeded order. Text: the first 90 % of the corpus
    tokens cut into P contiguous, disjoint regions; batches are seeded random windows of a
    rank's region (``gradsync.apps.data.lm_batches``: causal or masked targets); the last 10 % is
    the evaluation text.
    """

    def __init__(self, kind: str, task: str, rank: int, P: int, batch: int, seed: int,
                 device: torch.device, model_name: str = "", model: nn.Module | None = None,
                 text_fallback: bool = False) -> None:
        self.kind, self.task, self.rank, self.P, self.batch = kind, task, rank, P, batch
        self.seed, self.device = seed, device
        self._epoch, self._order, self._pos = -1, None, 0
        if task == "image":
            x, y, self.test_x, self.test_y = _images(kind, seed)
            perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
            mine = perm[rank::P]  # disjoint by rank, same permutation everywhere
            self.x, self.y = x[mine], y[mine]
            self.shard_len = len(mine)
            return
        from gradsync.apps import data

        tok = (data.word_tokenizer(max_vocab=getattr(model, "vocab", 10_000),
                                   fallback=text_fallback)
               if model_name == "lstm" else data.ByteTokenizer())
        if kind == "text":
            tokens = _text_tokens(tok, text_fallback)
        else:
            tokens = torch.randint(tok.regular_size, (400_000,),
                                   generator=torch.Generator().manual_seed(seed))
        self.T = int(min(getattr(model, "context", None) or 128, 128))
        split = int(len(tokens) * 0.9)
        train, self.test = tokens[:split], tokens[split:]
        per = len(train) // P
        self.train = train[rank * per:(rank + 1) * per]
        if len(self.train) < self.T + 2 or len(self.test) < self.T + 2:
            raise ValueError(f"text too small for {P} ranks at sequence length {self.T}")
        self.shard_len = len(self.train) // self.T
        self._lm_kw = {"kind": "masked" if task == "masked_lm" else "causal",
                       "mask_id": tok.mask_id, "random_high": tok.regular_size}
        self._stream = data.lm_batches(self.train, batch, self.T, seed=self._seed(0),
                                       **self._lm_kw)

    def steps_per_epoch(self) -> int:
        return max(1, self.shard_len // self.batch)

    def _seed(self, epoch: int) -> int:
        return (self.seed * 1_000_003 + self.rank) * 7919 + epoch

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.task != "image":
            xb, yb = next(self._stream)
            return xb.to(self.device), yb.to(self.device)
        if self._order is None or self._pos + self.batch > len(self._order):
            self._epoch += 1
            g = torch.Generator().manual_seed(self._seed(self._epoch))
            self._order = torch.randperm(self.shard_len, generator=g)
            self._pos = 0
        i = self._order[self._pos:self._pos + self.batch]
        self._pos += self.batch
        return self.x[i].to(self.device), self.y[i].to(self.device)

    def eval_batches(self, n: int):
        if n <= 0:
            return
        if self.task != "image":
            from gradsync.apps import data

            for xb, yb in data.lm_batches(self.test, self.batch, self.T, seed=self.seed + 12345,
                                          steps=n, **self._lm_kw):
                yield xb.to(self.device), yb.to(self.device)
            return
        for b in range(n):
            lo = b * self.batch
            if lo >= len(self.test_x):
                return
            yield (self.test_x[lo:lo + self.batch].to(self.device),
                   self.test_y[lo:lo + self.batch].to(self.device))


_CACHE: dict[tuple, Any] = {}  # per process: the data is read once for all schemes


def _images(kind: str, seed: int) -> tuple[torch.Tensor, ...]:
    key = ("images", kind, seed)
    if key not in _CACHE:
        if kind == "fashion-mnist":
            from gradsync.apps.data import fashion_mnist

            _CACHE[key] = (*fashion_mnist(train=True), *fashion_mnist(train=False))
        else:
            from gradsync.apps.data import synthetic_images

            _CACHE[key] = (*synthetic_images(8192, seed=seed),
                           *synthetic_images(2048, seed=seed + 1))
    return _CACHE[key]


def _text_tokens(tok: Any, fallback: bool) -> torch.Tensor:
    """The offline text corpus (``gradsync.apps.data.text_corpus``) encoded by ``tok``."""
    from gradsync.apps import data

    return data.corpus_tokens(tok, fallback=fallback)


# ------------------------------------------------------------------------------ DDP peers
class _Meter:
    """Bytes handed to torch.distributed and comm-hook timestamps while a DDP peer trains."""

    def __init__(self, P: int) -> None:
        self.P = P
        self.lock = threading.Lock()
        self.bytes_sent = 0
        self.blocking = False  # all-reduces complete inside the call (timed as comm)
        self.reset()

    def reset(self) -> None:
        self.calls: list[float] = []
        self.returns: list[float] = []
        self.done: list[float] = []
        self.sync_s = 0.0
        self.blocking_comm_s = 0.0

    def count_allreduce(self, t: torch.Tensor) -> None:
        b = t.numel() * t.element_size()
        with self.lock:  # ring accounting, as Comm.all_reduce
            self.bytes_sent += round(2 * (self.P - 1) / self.P * b) if self.P > 1 else 0


@contextlib.contextmanager
def _counting_all_reduce(meter: _Meter):
    """Wrap ``torch.distributed.all_reduce`` (what torch's comm hooks call) to count bytes."""
    orig = dist.all_reduce

    def all_reduce(tensor, *args, **kwargs):
        meter.count_allreduce(tensor)
        if not meter.blocking:
            return orig(tensor, *args, **kwargs)
        t0 = time.perf_counter()
        work = orig(tensor, *args, **kwargs)
        if work is not None:
            work.wait()
        with meter.lock:
            meter.blocking_comm_s += time.perf_counter() - t0
        return work

    dist.all_reduce = all_reduce
    try:
        yield
    finally:
        dist.all_reduce = orig


class _HookState:
    def __init__(self, inner, inner_state, meter: _Meter, blocking: bool) -> None:
        self.inner, self.inner_state, self.meter, self.blocking = (inner, inner_state, meter,
                                                                   blocking)


def _metered_hook(state: _HookState, bucket):
    """Delegate to torch's own hook; record call, return and completion times."""
    m = state.meter
    t0 = time.perf_counter()
    fut = state.inner(state.inner_state, bucket)
    if state.blocking:
        value = fut.wait()
        fut = torch.futures.Future()
        fut.set_result(value)
    t1 = time.perf_counter()
    with m.lock:
        m.calls.append(t0)
        m.returns.append(t1)
        m.sync_s += t1 - t0

    def done(f):
        with m.lock:
            m.done.append(time.perf_counter())
        return f.value()

    if state.blocking:
        with m.lock:
            m.done.append(t1)
        return fut
    return fut.then(done)


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


# ------------------------------------------------------------------------------ the worker
MOMENTUM = 0.9


def _momentum_correction(scheme: str, adamw: bool) -> bool:
    """DGC §3.2: with sparse updates, SGD's momentum moves into error feedback (momentum
    correction + factor masking) and the optimizer itself runs without momentum; otherwise
    the momentum of entries that are sent late is applied to stale values and the loss
    spikes. Dense schemes and AdamW keep the optimizer's own state."""
    sparse = scheme.startswith("ddp_gradsync_") or not scheme.startswith("ddp")
    return not adamw and sparse and scheme not in ("dense", "dense_ovlp",
                                                   "ddp_gradsync_dense")


def _optimizer(model: nn.Module, adamw: bool, lr: float,
               momentum_correction: bool = False) -> torch.optim.Optimizer:
    if adamw:
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    return torch.optim.SGD(model.parameters(), lr=lr,
                           momentum=0.0 if momentum_correction else MOMENTUM)


def _train_scheme(scheme: str, rank: int, P: int, spec: dict, device: torch.device,
                  progress: Any) -> dict:
    from gradsync.apps import models
    from gradsync.engine import GradSync
    from gradsync.engine.config import Config
    from gradsync.schedule import SCHEMES

    model = models.build(spec["model"], seed=spec["seed"]).to(device)
    task = models.task(spec["model"])
    data = _Data(spec["data"], task, rank, P, spec["batch_size"], spec["seed"], device,
                 spec["model"], model, spec.get("text_fallback", False))
    steps = spec["steps"] or max(1, round(spec["epochs"] * data.steps_per_epoch()))
    warm = spec["warmup_steps"]
    sync = ddp_model = gstate = meter = None
    counting = contextlib.nullcontext()
    net: nn.Module = model
    if scheme in SCHEMES:
        mc = _momentum_correction(scheme, _uses_adamw(spec["model"]))
        sync = GradSync(model, Config(scheme=scheme, density=spec["density"],
                                      sparsifier=spec["sparsifier"], seed=spec["seed"],
                                      warmup_steps=warm, timeout_s=spec["timeout"],
                                      momentum=MOMENTUM if mc else 0.0))
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [device.index] if device.type == "cuda" else None
        with warnings.catch_warnings():  # broadcast_buffers=False is what we mean (see above)
            warnings.simplefilter("ignore", FutureWarning)
            ddp_model = DDP(model, device_ids=ids, broadcast_buffers=False)
        net = ddp_model
        if scheme.startswith("ddp_gradsync_"):
            from gradsync.integrations import ddp as gddp

            mc = _momentum_correction(scheme, _uses_adamw(spec["model"]))
            gstate = gddp.register(ddp_model, Config(
                scheme=scheme.removeprefix("ddp_gradsync_"), density=spec["density"],
                sparsifier=spec["sparsifier"], seed=spec["seed"],
                momentum=MOMENTUM if mc else 0.0))
        else:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

            meter = _Meter(P)
            if scheme == "ddp":
                inner, inner_state, blocking = default_hooks.allreduce_hook, None, False
            elif scheme == "ddp_fp16":
                inner, inner_state, blocking = default_hooks.fp16_compress_hook, None, False
            else:
                inner = psgd.powerSGD_hook
                inner_state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                                 start_powerSGD_iter=2,
                                                 random_seed=spec["seed"])
                blocking = True
            meter.blocking = blocking
            ddp_model.register_comm_hook(_HookState(inner, inner_state, meter, blocking),
                                         _metered_hook)
            counting = _counting_all_reduce(meter)
    opt = _optimizer(model, _uses_adamw(spec["model"]), spec["lr"],
                     _momentum_correction(scheme, _uses_adamw(spec["model"])))
    records: list[dict] = []
    elapsed = 0.0
    fail_rank = spec.get("fail_rank")
    task_id = None
    if progress is not None:
        task_id = progress.add_task(f"{scheme}", total=steps, loss=float("nan"), sps=0.0)
    try:
        with counting:
            for step in range(steps):
                if fail_rank == rank and step == 1:
                    raise RuntimeError(f"injected failure on rank {rank} at step {step} "
                                       "(--fail-rank)")
                xb, yb = data.next()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                loss = models.loss(net(xb), yb)
                if meter is not None:
                    meter.reset()
                    b0 = meter.bytes_sent
                elif gstate is not None:
                    b0, miss0, tens0 = (gstate.total.bytes_sent, gstate.missing, gstate.tensors)
                    r0 = gstate.total.bytes_recv
                tb = time.perf_counter()
                loss.backward()
                tw = time.perf_counter()
                if sync is not None:
                    sync.synchronize()
                opt.step()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t1 = time.perf_counter()
                dt = t1 - t0
                elapsed += dt
                rec = {"step": step, "loss": float(loss.detach()), "time_s": dt,
                       "elapsed_s": elapsed, "samples_per_s": P * spec["batch_size"] / dt,
                       "warmup": step <= warm}
                if sync is not None:
                    last = sync.stats()["last"]
                    rec.update({k: last[k] for k in ("bytes_sent", "bytes_recv", "backward_s",
                                                     "sparsify_s", "comm_s", "wait_s",
                                                     "missing_rate")})
                elif meter is not None:
                    with meter.lock:
                        calls, rets, done = list(meter.calls), list(meter.returns), list(meter.done)
                        sent, sync_s = meter.bytes_sent - b0, meter.sync_s
                        blocking_comm = meter.blocking_comm_s
                    last_call = max(calls) if calls else tw
                    last_ret = max(rets) if rets else tw
                    if meter.blocking:  # communication ran inside the hook, timed at the call
                        comm, sync_s = blocking_comm, max(0.0, sync_s - blocking_comm)
                    else:
                        comm = _union(list(zip(calls, done))) - sync_s if done else 0.0
                    rec.update({"bytes_sent": sent, "bytes_recv": sent,
                                "backward_s": max(0.0, last_call - tb),
                                "sparsify_s": sync_s, "comm_s": max(0.0, comm),
                                "wait_s": max(0.0, tw - last_ret), "missing_rate": 0.0})
                else:
                    tensors = gstate.tensors - tens0
                    rec.update({"bytes_sent": gstate.total.bytes_sent - b0,
                                "bytes_recv": gstate.total.bytes_recv - r0,
                                "backward_s": tw - tb, "sparsify_s": float("nan"),
                                "comm_s": float("nan"), "wait_s": float("nan"),
                                "missing_rate": (gstate.missing - miss0) / tensors
                                if tensors else 0.0})
                records.append(rec)
                if progress is not None:
                    progress.update(task_id, advance=1, loss=rec["loss"],
                                    sps=rec["samples_per_s"])
        evaluation = _evaluate(model, task, data, spec["eval_batches"]) if rank == 0 else {}
    finally:
        if sync is not None:
            sync.close()
    if dist.is_initialized() and P > 1:
        dist.barrier()  # the next scheme starts together
    return {"scheme": scheme, "task": task, "records": records, "eval": evaluation}


@torch.no_grad()
def _evaluate(model: nn.Module, task: str, data: _Data, n: int) -> dict:
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


def _progress(rank: int, enabled: bool):
    if rank != 0 or not enabled:
        return contextlib.nullcontext(None)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    return Progress(TextColumn("{task.description:>18}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("loss {task.fields[loss]:.3f}"),
                    TextColumn("{task.fields[sps]:.0f} samples/s"))


def train_worker(rank: int, world_size: int, spec: dict) -> dict:
    """One rank: train every scheme of ``spec["schemes"]`` in turn; returns its records.

    A module-level function so that :func:`gradsync.testing.run_distributed` and
    :func:`gradsync.testing.netem.run_shaped` can start it on every rank.
    """
    if spec.get("device"):
        device = torch.device(spec["device"])
    else:
        device = torch.device("cpu")
    runs = []
    with _progress(rank, spec.get("progress", False)) as progress:
        for scheme in spec["schemes"]:
            runs.append(_train_scheme(scheme, rank, world_size, spec, device, progress))
    return {"rank": rank, "runs": runs}


# ------------------------------------------------------------------------------ launching
def _spec(a: argparse.Namespace) -> dict:
    return {"model": a.model, "data": a.data, "schemes": list(a.schemes),
            "steps": a.steps, "epochs": a.epochs, "batch_size": a.batch_size, "lr": a.lr,
            "density": a.density, "sparsifier": a.sparsifier, "seed": a.seed,
            "warmup_steps": a.warmup_steps, "eval_batches": a.eval_batches,
            "timeout": a.timeout, "progress": not a.no_progress, "fail_rank": a.fail_rank,
            "text_fallback": getattr(a, "text_fallback", False)}


def _resolve_data(a: argparse.Namespace, quiet: bool = False) -> None:
    """Real data by default; a stand-in only by choice or, with a note, when it is missing."""
    from gradsync.apps.data import DatasetUnavailable, fashion_mnist, text_corpus

    if a.data == "text":
        try:
            text_corpus(limit=1)
        except DatasetUnavailable as e:
            if not quiet:
                print(f"note: {e}; training on gradsync's own SOURCE TEXT instead")
            a.text_fallback = True
        return
    if a.data != "fashion-mnist":
        return

    try:
        fashion_mnist(train=False, limit=1)
    except DatasetUnavailable as e:
        if not quiet:
            print(f"note: {e}; training on SYNTHETIC images instead (accuracy is "
                  "meaningless)")
        a.data = "synthetic"


def launch(a: argparse.Namespace) -> tuple[list[dict], dict]:
    """Run the local workers; returns (per-rank results, link info)."""
    from gradsync.testing import netem, run_distributed

    spec = _spec(a)
    if a.bandwidth is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            res = netem.run_shaped(train_worker, a.world_size, spec, bandwidth=a.bandwidth_bps,
                                   latency=a.latency, timeout=a.timeout)
        if res.shaped:
            link = f"tbf {a.bandwidth} per rank and direction"
        else:
            link = "loopback"
            print(f"note: no shaped links ({res.reason}); ran on loopback instead")
        return list(res), {"link": link, "shaped": res.shaped, "bandwidth_bps": a.bandwidth_bps}
    out = run_distributed(train_worker, a.world_size, spec, timeout=a.timeout)
    return out, {"link": "loopback", "shaped": False, "bandwidth_bps": None}


def _median(xs: list[float]) -> float:
    xs = [x for x in xs if not (isinstance(x, float) and math.isnan(x))]
    return statistics.median(xs) if xs else float("nan")


def summarize(results: list[dict], warmup_steps: int) -> list[dict]:
    """Per scheme: the summary and the records (see the module docstring for the fields)."""
    runs = []
    by_rank = sorted(results, key=lambda r: r["rank"])
    for i, run0 in enumerate(by_rank[0]["runs"]):
        recs = run0["records"]
        skip = min(warmup_steps + 1, max(0, len(recs) - 1))
        meas = recs[skip:]
        per_rank = [r["runs"][i]["records"] for r in by_rank]
        sent = [[x["bytes_sent"] for x in rr] for rr in per_rank]
        measured_bytes = [b for rr in sent for b in rr[skip:]]
        bytes_per_step = statistics.fmean(measured_bytes) if measured_bytes else 0.0
        s = {"scheme": run0["scheme"], "measured_steps": len(meas),
             "samples_per_s": _median([x["samples_per_s"] for x in meas]),
             "step_s": _median([x["time_s"] for x in meas])}
        for k in ("backward_s", "sparsify_s", "comm_s", "wait_s"):
            s[k] = _median([x[k] for x in meas])
        s["bytes_per_step"] = bytes_per_step
        s["mb_per_step"] = bytes_per_step / 1e6
        s["missing_rate"] = statistics.fmean([x["missing_rate"] for x in meas]) if meas else 0.0
        s["final_loss"] = statistics.fmean([rr[-1]["loss"] for rr in per_rank if rr])
        s.update(run0["eval"])
        runs.append({"scheme": run0["scheme"], "task": run0["task"], "steps": recs,
                     "bytes_sent_per_rank": sent, "summary": s})
    base = next((r["summary"] for r in runs if r["scheme"] == "ddp"), None)
    for r in runs:
        s = r["summary"]
        s["speedup_vs_ddp"] = (s["samples_per_s"] / base["samples_per_s"]
                               if base and base["samples_per_s"] > 0 else None)
    return runs


def table_rows(runs: list[dict]) -> tuple[list[str], list[list[Any]]]:
    lm = any(r["task"] != "image" for r in runs)
    cols = ["scheme", "samples/s", "vs ddp", "step ms", "bwd ms", "sparsify ms", "comm ms",
            "exposed ms", "MB/step", "missing %", "final loss",
            "eval ppl" if lm else "test acc %"]
    rows = []
    for r in runs:
        s = r["summary"]
        q = s.get("perplexity") if lm else (100 * s["test_accuracy"]
                                            if "test_accuracy" in s else None)
        rows.append([s["scheme"], s["samples_per_s"],
                     f"{s['speedup_vs_ddp']:.2f}x" if s["speedup_vs_ddp"] else "-",
                     1e3 * s["step_s"], 1e3 * s["backward_s"], 1e3 * s["sparsify_s"],
                     1e3 * s["comm_s"], 1e3 * s["wait_s"], s["mb_per_step"],
                     100 * s["missing_rate"], s["final_loss"], "-" if q is None else q])
    return cols, rows


def environment(launcher: str, backend: str, device: str, link: dict) -> dict:
    return {"torch": torch.__version__, "python": platform.python_version(),
            "machine": platform.machine(), "cpus": os.cpu_count(),
            "load_avg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "launcher": launcher,
            "backend": backend, "device": device, **link,
            "propagation_delay": "not emulated"}


def write_metrics(out: str | Path, config: dict, env: dict, runs: list[dict]) -> list[Path]:
    """``metrics.json`` plus ``loss_vs_time.png`` and ``throughput.png``; returns the paths."""
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    paths = [d / "metrics.json"]
    paths[0].write_text(json.dumps({"schema": SCHEMA, "config": config, "environment": env,
                                    "runs": runs}, indent=1, default=_json_default))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in runs:
        ax.plot([x["elapsed_s"] for x in r["steps"]], [x["loss"] for x in r["steps"]],
                label=r["scheme"])
    ax.set_xlabel("training time on rank 0 (s)")
    ax.set_ylabel("training loss (rank 0)")
    ax.set_title(f"loss vs time — {env.get('link', '')}")
    ax.legend()
    fig.tight_layout()
    paths.append(d / "loss_vs_time.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = [r["scheme"] for r in runs]
    ax.bar(names, [r["summary"]["samples_per_s"] for r in runs], color="tab:blue")
    ax.set_ylabel("samples/s (median after warm-up, all ranks)")
    ax.set_title(f"throughput per scheme — {env.get('link', '')}")
    ax.tick_params(axis="x", rotation=45)
    fig.tight_layout()
    paths.append(d / "throughput.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def _json_default(o: Any) -> Any:
    if isinstance(o, float | int):
        return o
    return str(o)


def _config(a: argparse.Namespace, world_size: int) -> dict:
    return {"model": a.model, "data": a.data, "schemes": list(a.schemes),
            "world_size": world_size, "steps": a.steps, "epochs": a.epochs,
            "batch_size": a.batch_size, "lr": a.lr,
            "optimizer": "adamw" if _uses_adamw(a.model) else (
                "sgd(momentum=0.9; sparse schemes: momentum 0 in SGD, DGC momentum "
                "correction 0.9 in error feedback)"),
            "text_fallback": a.text_fallback,
            "density": a.density, "sparsifier": a.sparsifier, "seed": a.seed,
            "warmup_steps": a.warmup_steps, "eval_batches": a.eval_batches,
            "bandwidth": a.bandwidth, "latency": a.latency}


def report(a: argparse.Namespace, results: list[dict], env: dict, title: str) -> list[dict]:
    """Print the comparison table (and write --out); returns the runs."""
    from gradsync.apps.common import print_table

    runs = summarize(results, a.warmup_steps)
    cols, rows = table_rows(runs)
    print_table(title, cols, rows)
    if a.out:
        paths = write_metrics(a.out, _config(a, len(results)), env, runs)
        print("wrote " + ", ".join(str(p) for p in paths))
    return runs


def _torchrun_env() -> bool:
    return all(v in os.environ for v in TORCHRUN_VARS)


def _main_torchrun(a: argparse.Namespace) -> int:
    from datetime import timedelta

    cuda = torch.cuda.is_available()
    local = int(os.environ["LOCAL_RANK"])
    if cuda:
        torch.cuda.set_device(local)
    backend = "nccl" if cuda else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timedelta(seconds=a.timeout))
    rank, P = dist.get_rank(), dist.get_world_size()
    spec = _spec(a)
    spec["device"] = f"cuda:{local}" if cuda else "cpu"
    try:
        mine = train_worker(rank, P, spec)
        gathered: list[Any] = [None] * P
        dist.all_gather_object(gathered, mine)
        if rank == 0:
            env = environment("torchrun", backend, spec["device"],
                              {"link": "torchrun job", "shaped": False, "bandwidth_bps": None})
            report(a, gathered, env, f"gradsync train — {a.model}, P={P}, torchrun "
                                     f"({backend})")
    finally:
        dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if _torchrun_env():
        _resolve_data(a, quiet=os.environ["RANK"] != "0")
        if a.bandwidth is not None and os.environ["RANK"] == "0":
            print("note: --bandwidth/--latency shape only local workers; ignored under torchrun")
        return _main_torchrun(a)
    from gradsync.testing import DistributedError, DistributedTimeout

    _resolve_data(a)
    t0 = time.perf_counter()
    try:
        results, link = launch(a)
    except DistributedError as e:
        last = e.remote_traceback.strip().splitlines()[-1] if e.remote_traceback else ""
        print(f"error: training failed on rank {e.rank}: {last}", file=sys.stderr)
        print(str(e), file=sys.stderr)
        return 1
    except DistributedTimeout as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    env = environment("local", "gloo", "cpu", link)
    report(a, results, env, f"gradsync train — {a.model} on {a.data}, P={a.world_size}, "
                            f"{link['link']}, density {a.density}, "
                            f"{time.perf_counter() - t0:.0f} s")
    return 0
