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

Schemes (``--scheme a,b,c`` runs each in turn with the same seed and data, one table at the end;
local workers start afresh for each scheme):

* every engine scheme of :data:`gradsync.schedule.SCHEMES` (``ssfusion_oi``, ``oktopk``,
  ``densestream``, …) through :class:`gradsync.GradSync`;
* torch's own DDP as peers: ``ddp`` (torch's ``allreduce_hook``, the same all-reduce as DDP's
  built-in one, but through Python so its bytes are counted), ``ddp_powersgd``
  (``powerSGD_hook``, rank 1, error feedback, compression from step 2), ``ddp_fp16``
  (``fp16_compress_hook``);
* ``ddp_gradsync_<s>``: DDP with gradsync's comm hook (:mod:`gradsync.ddp`) for every scheme
  ``s`` whose record in :mod:`gradsync.schedule.schemes` has ``ddp_hook`` (``dense``,
  ``per_tensor``, ``ssfusion``, ``ssfusion_oi``).

DDP peers run with ``broadcast_buffers=False`` (the engine does not synchronize buffers
either). Their bytes are counted at the call: ``torch.distributed.all_reduce`` is wrapped in the
worker while a DDP peer trains, with the ring accounting of :class:`gradsync.collectives.Comm`
(``2(P−1)/P·B`` per all-reduce of B bytes). ``ddp_powersgd``'s hook is made blocking per bucket
(gloo cannot launch its second all-reduce from a callback while another bucket's is queued;
see docs/architecture.md, "torch.distributed facts"), so its overlap is understated.

Each rank trains on its own seeded, disjoint shard of the training data; all ranks start from
the same model (``gradsync.apps.models.build(name, seed)``); SGD with momentum 0.9 (AdamW for the
transformers: GPT, BERT, ViT); for sparse schemes the momentum moves into error feedback as
DGC's momentum correction (§3.2) and SGD itself runs without momentum — measured on the CNN
at 1% density, 4 ranks, 100 steps: ssfusion_oi 71.7% → 76.3% test accuracy, oktopk 76.7% →
77.5% (dense 80.1%). With AdamW the first moment moves into error feedback the same way and
the optimizer is :class:`gradsync.optim.FrozenVarianceAdamW` (exact AdamW for the first
``TrainSpec.adam_warmup`` steps, sent whole, then its variance frozen) — measured on TinyGPT at
1% density, 4 ranks, 200 steps, one seed: topka perplexity 15.71 → 13.15 (AdamW with DDP
10.74). The loss is ``gradsync.apps.models.loss``. Data: ``fashion-mnist``
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

``ddp_gradsync_<s>`` (gradsync's DDP hook) is a DDP peer here: its calls are metered as
torch's hooks' are; its bytes and missing rate are the hook's own counts.

``--out DIR`` writes ``metrics.json``, ``plans.json`` (scheme → the plan each engine run ended
with), ``loss_vs_time.png`` and ``throughput.png``. ``--plan FILE`` replays such a
``plans.json`` (``Config.plan``): the schemes that plan from times measured in their warm-up
(``multi_tensor``, ``cupcake``, ``ssfusion*``, ``auto``, …) may otherwise plan differently, and
so train differently, in two runs with the same seed.
Schemes that do not finish (:mod:`.command`, :mod:`.loop`): a scheme whose loss or gradient
turns NaN/Inf at step N — detected alike on every rank — is recorded as ``"diverged at step
N"``, one that fails (a rank raised or died, or no rank completed a step for ``--timeout``
seconds: the message names the stalled ranks and their step) as ``"failed: <reason>"``; the
remaining schemes run, the table marks them in a ``status`` column and the exit status is 1,
the last line naming them. As each scheme finishes a line reports it and ``metrics.json`` is
rewritten with the runs so far (``"complete": false`` until the end), so a crash or kill later
keeps the finished schemes. ``--timeout`` bounds progress, not the whole run: local workers are
watched by ``run_distributed``'s progress watchdog (``progress_timeout``; a step, or an
evaluation batch, is progress); under torchrun it is the collectives' timeout; on shaped links
(``--bandwidth`` as root) it bounds each scheme's whole run.

``metrics.json`` schema (``"schema": "gradsync.train/1"``)::

    {
      "schema": "gradsync.train/1",
      "complete": false while schemes are still to run, then true,
      "config": {model, data, schemes, world_size, steps, batch_size, lr, optimizer, density,
                 sparsifier, seed, warmup_steps, eval_batches, bandwidth, latency, amp,
                 text_fallback, replayed_plans (the schemes run with ``--plan``)},
      "environment": {torch, python, machine, cpus, load_avg, time, launcher
                      ("local"|"torchrun"), backend, device, link ("loopback"|"tbf …"),
                      shaped, bandwidth_bps, propagation_delay},
      "runs": [{
        "scheme": str, "task": "image" | "causal_lm" | "masked_lm",
        "status": "ok" | "diverged at step N" | "failed: <reason>",
        "diverged_at_step": N | null, "reason": what was non-finite, or why it failed | null,
        "steps": [{"step", "loss", "time_s", "cpu_s", "elapsed_s", "samples_per_s", "bytes_sent",
                   "bytes_recv", "backward_s", "sparsify_s", "comm_s", "wait_s",
                   "missing_rate", "warmup", "probing" (a trial of auto's or of the
                   DDP hook's merged buckets still measuring), "hooks_s" (the
                   engine's gradient hooks launching jobs, ``StepStats.hooks_s``; NaN for
                   others), "hook_blocked_s" (DDP's comm hook calls' blocks: their wall
                   time minus the thread's CPU and wait for a core; NaN without a DDP
                   hook), "loss_scale" (``--amp fp16``: the scale after the step; halved
                   where it overflowed)},
                  …],  # rank 0's records
        "bytes_sent_per_rank": [[per-step bytes of rank r] for r in ranks],
        "summary": {"scheme", "measured_steps", "samples_per_s", "step_s", "backward_s",
                    "sparsify_s", "comm_s", "wait_s", "cpu_s", "bytes_per_step", "mb_per_step",
                    "run_bytes_per_step" (over every step, the warm-up and a density
                    schedule's denser steps included), "missing_rate", "final_loss",
                    "speedup_vs_ddp" (null without ddp), "s_to_ddp",
                    "time_speedup_vs_ddp" (with --eval-every and a ddp run: training seconds
                    until the evaluation curve reaches ddp's final score, linear between
                    points, null when never, and ddp's seconds over them, 0 when never),
                    "probing_steps", "settled_samples_per_s", "settled_bytes_per_step" (auto,
                    the DDP hook's trials: measured steps up to the last probing one, and the
                    median samples/s and mean bytes per rank and step after them),
                    "test_accuracy", "test_samples" (images) | "eval_loss", "perplexity",
                    "eval_tokens" (language models; masked LMs: over the masked tokens),
                    "plan_digest" (``Plan.digest()``; null outside the engine),
                    "status" (as the run's; not "ok": final_loss NaN, no evaluation)},
        "plan": the engine's plan at the end (``Plan.to_dict()``) | null,
        "history": with --eval-every, rank 0's [{"step", "elapsed_s", score}, …],
        "topk_shares": ``--topk-shares``: {"density", "steps", "tensors": {name: {"numel",
                       "topk_share", "entry_share"}}} (gradsync.apps.train.shares) | null
      }, …]
    }

``samples_per_s`` is global (all ranks) and, like the times, the median over the steps after
the ``warmup_steps + 1`` first ones; ``cpu_s`` is a step's process CPU time (every thread of
the rank: training, communication, gloo), the busiest rank's per step, then the median — with
more ranks than cores it is what sets the step time; ``bytes_per_step`` is the mean over ranks
and measured steps; ``final_loss`` the mean over ranks of the last step's loss; test accuracy is
measured on rank 0 on the first ``eval_batches × batch_size`` images of the real test split.

Programmatic use (what ``demo`` and ``bench schemes`` do)::

    spec = train.resolve_data(train.parse_args(["--scheme", "ddp,oktopk", "--steps", "20"]))
    results, link = train.launch(spec)            # or train.TrainSpec(...) directly
    # one launch for all schemes; a divergence raises (DistributedError), or with
    # train.launch(spec, keep_going=True) is recorded in the run's "status"
    runs = train.summarize(results, spec.warmup_steps)
    train.write_metrics(out, spec.config(len(results)), train.environment(...), runs)

Modules: :mod:`.spec` (:class:`TrainSpec`, the accepted schemes), :mod:`.shards` (each rank's
data), :mod:`.runners` (engine, gradsync DDP hook, torch DDP peers; the optimizer),
:mod:`.metering` (bytes and hook times of torch's DDP hooks), :mod:`.loop` (the training loop,
evaluation), :mod:`.summary` (medians, table, ``metrics.json``, plots), :mod:`.command` (the
command line, local and torchrun launch).
"""

from gradsync.apps.train.command import build_parser, launch, main, parse_args, torchrun_env
from gradsync.apps.train.loop import evaluate, train_scheme, train_worker
from gradsync.apps.train.runners import make_optimizer, make_runner
from gradsync.apps.train.shards import RankData, load_images, resolve_data
from gradsync.apps.train.spec import (
    DATASETS,
    DDP_PEERS,
    SchemeChoice,
    TrainSpec,
    all_schemes,
    scheme_choice,
    scheme_choices,
    uses_adamw,
)
from gradsync.apps.train.summary import (
    SCHEMA,
    environment,
    report,
    summarize,
    table_rows,
    write_metrics,
)

__all__ = ["DATASETS", "DDP_PEERS", "SCHEMA", "RankData", "SchemeChoice", "TrainSpec",
           "all_schemes", "build_parser", "environment", "evaluate", "launch", "load_images",
           "main", "make_optimizer", "make_runner", "parse_args", "report", "resolve_data",
           "scheme_choice", "scheme_choices", "summarize", "table_rows", "torchrun_env",
           "train_scheme", "train_worker", "uses_adamw", "write_metrics"]
