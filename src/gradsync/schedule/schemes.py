"""The table of schemes: what each ``Config.scheme`` is, in one place.

A scheme is a planner (how tensors are grouped into fusion buffers and how each buffer is sent)
plus the collective its sparse buffers are reduced with. The engine, ``Config``, the DDP hook,
the simulator and ``train`` all read this table; adding a scheme is one :class:`Scheme` record
here plus its algorithm files (a planner in ``schedule/``, a collective in ``collectives/``).

Planners (``Scheme.planner``):

=============  =============================================================================
``fixed``      DDP-style ``bucket_mb`` buckets, all-reduced dense (fixed.py)
``single``     one buffer with every tensor, sparsified as one vector (the collectives' papers)
``mgwfbp``     MG-WFBP/OMGS merging on the cost model, fused sparsification (mgwfbp.py)
``cupcake``    Cupcake's exact DP over contiguous groupings, fused sparsification (cupcake.py)
``per_tensor`` DDP-style ``bucket_mb`` buckets, every tensor sparsified on its own (SSFusion
               §II-D: fusion after sparsification, as Horovod and PyTorch DDP fuse)
``ssfusion``   Cupcake's buffers + SSFusion's selective sparsification (ssfusion.py), with
               SSFusion-O offloading (``offload``) and SSFusion-I interleaving (``interleave``)
``hipress``    HiPress: compress-or-not per tensor from a static cost model, compressed tensors
               alone, the others bulk-synchronized (hipress.py)
``espresso``   Espresso: per tensor dense, sparsified inline or offloaded, chosen on the
               timeline of ready times; one message per tensor, no fusion (espresso.py)
``auto``       per fusion buffer a dense all-reduce or a sparse all-gather, from the measured
               cost model, never predicted slower than DDP; re-planned on drift (auto.py)
=============  =============================================================================
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from gradsync.schedule.budget import BUDGETS
from gradsync.schedule.plan import MIN_K

__all__ = ["DGC_WARMUP", "PLANNERS", "SCHEMES", "THIRD", "Scheme", "get", "names"]

THIRD = 1.0 / 3.0  # a third of the velocity tail sent ahead (Scheme.momentum_ahead)
# DGC's exponential warm-up as (periods, steps per period): 4 periods of 9 steps from
# density^(1/5) down to density^(4/5) (Scheme.dgc_warmup)
DGC_WARMUP = (4, 9)
PLANNERS = ("fixed", "single", "mgwfbp", "cupcake", "per_tensor", "ssfusion", "hipress",
            "espresso", "auto")


@dataclass(frozen=True)
class Scheme:
    """One row of the table.

    Attributes:
        name: the ``Config.scheme`` value.
        planner: one of :data:`PLANNERS`.
        collective: the ``gradsync.collectives`` name sparse buffers are reduced with; dense
            buffers are always all-reduced.
        collective_options: ``Config`` fields passed to the collective's constructor under the
            same name (Ok-Topk sizes its buckets from ``density``).
        collective_kwargs: fixed keyword arguments of that collective (Ok-Topk:
            ``nonfinite="skip_step"``, a sum of NaN where it finds a NaN/Inf: the engine applies
            ``Config.nonfinite`` to the sums itself, alike on every rank).
        sparsifier: the sparsifier this scheme always uses (the Gaussian-k scheme runs
            Gaussian-k, as Ok-Topk's paper does; Ok-Topk selects locally by threshold reuse,
            Algorithm 1 lines 2–4); ``None`` uses ``Config.sparsifier``.
        sparsifier_options: fixed keyword arguments of that sparsifier (Ok-Topk: its period is
            counted in training steps, ``clock="step"``).
        sparsifier_config: ``(keyword, Config field)`` pairs passed to that sparsifier
            (Ok-Topk: ``period`` ← ``Config.local_tau_prime``, τ′). A field set to 0 turns the
            scheme's own sparsifier off: ``Config.sparsifier`` is used instead.
        needs_cost_model: plans from the cost model measured during warm-up.
        overlap: buffers are sent during the backward pass (``False``: after it).
        offload: SSFusion-O, sparsification offloaded to a worker thread.
        interleave: SSFusion-I, a buffer's dense tensors are all-reduced, the rest all-gathered.
        ddp_hook: available as a DDP comm hook (``gradsync.ddp``), inside DDP's own buckets.
        min_k: ``Config.min_k``'s default: a tensor sparsified on its own at fewer entries is
            sent whole (:data:`~gradsync.schedule.plan.MIN_K`, 8, as DGC sends biases whole).
            In the SSFusion family, whose compensation pays for every tensor sent whole with the
            others' density, only where those tensors fit half of its byte budget
            (:func:`~gradsync.schedule.ssfusion.starved`, ``MIN_K_SHARE``); beyond it its own
            budgeted exclusions (Eq. 2) decide. Measured (1 %, P = 4, paired by seed;
            docs/results/accuracy-history.md, "min_k in the SSFusion family"): ResNet-20's small
            tensors take 40 % of the budget, and SSFusion with them whole ends 74.19 % against
            64.17 % with none forced (5 seeds, each better); TinyGPT's take 66 %, and forcing them
            cost 21.79 against 19.92 perplexity (60 steps, 3 seeds; d′ 0.0079 → 0.0034) and 7.74
            against 7.45 (SSFusion-OI, 1000 steps). The CNN's plans are the same either way.
            Under the pooled budget (``budget``) ``Config`` takes 1 instead: a pool's K counts.
        momentum_ahead: ``Config.momentum_ahead``'s default: the share of a sent entry's
            velocity tail it carries ahead under DGC momentum correction without masking
            (``gradsync.feedback``, "Ahead"). Chosen per scheme from 1/3 and 1 at 1 %, P = 4
            (docs/results/accuracy-history.md, "Momentum sent ahead"), in points against DDP on the
            CNN (10 seeds) and ResNet-20 (5 seeds): 1/3 for TopkA (CNN +0.48 against −0.19 at
            1; ResNet-20 −4.04 against −11.89), DenseStream (+0.62, +0.17), Ok-Topk (−0.01;
            1 diverged on one seed with its thresholds reused between exact ones, and trained
            with either computed every step) and per_tensor (−0.71 against +0.74, but
            ResNet-20 −2.17 against −9.51, one seed at 43 %); 1 for the SSFusion family
            (SSFusion-OI: CNN +0.34 against −0.95 at 1/3; ResNet-20 −2.52 against −4.73
            without); ``Config`` caps it at 1/3 below 1 % density (at 0.1 % SSFusion-OI
            diverged on 2 of 5 CNN seeds at 1, and trained at 1/3). 0 for the schemes not
            measured.
        dgc_warmup: ``Config.density_warmup``'s default as ``(periods, steps per period)`` of
            DGC's exponential warm-up (``Config.dgc_warmup``); ``(0, 0)``: none. 4 periods of 9
            steps (:data:`DGC_WARMUP`: 39.8, 15.8, 6.3 and 2.5 % at 1 %) for every scheme
            measured with it (TopkA, Ok-Topk, DenseStream, per_tensor, the SSFusion family),
            the lead following the density there, and a selection of 1/P of a job's entries
            or more all-reduced densified where TopkA's collective would all-gather it
            (``engine.jobs.at_density``). Measured at 1 %, P = 4 (docs/results/accuracy-history.md,
            "The warm-up's selection all-reduced"): on ResNet-20 (cosine schedule, 5 seeds)
            TopkA −0.61 and per_tensor −1.28 points vs DDP (−2.27 and −2.41 without); on the
            CNN (10 seeds) TopkA +1.03, SSFusion-OI +0.99, DenseStream +0.98, Ok-Topk +0.37,
            per_tensor +0.03. The price is bytes: 40 % is 40 times a step's at 1 %, so over a
            160-step run TopkA sends 3.6× the fixed density's (SSFusion-OI 1.41×, whose small
            tensors travel whole anyway), and on a 100 Mbit/s link (CNN, 960 steps) TopkA
            reaches 99 % of DDP's accuracy 3.61× as fast as DDP instead of 4.12×. Warm-ups
            within 1.5× the bytes (9 % for 9 steps, 25 % for 3, 2 → 1.25 % over 120) gained at
            most a third of that on ResNet-20. None for the schemes not measured.
        budget: ``Config.budget``'s default for a plan that sparsifies tensors one by one
            (:mod:`gradsync.schedule.budget`): ``"blend"`` for ``per_tensor``, HiPress and
            Espresso; ``"pooled"`` for the SSFusion family, whose sparsified tensors of one
            fusion buffer then share the buffer's entries through one selection, as TopkA's
            global top-k shares the model's. Measured at 1 %, P = 4
            (docs/results/accuracy-history.md, "SSFusion's buffers pooled"). Other planners
            ignore it.
        paper: where the scheme comes from.
    """

    name: str
    planner: str
    collective: str = "topka"
    collective_options: tuple[str, ...] = ()
    collective_kwargs: tuple[tuple[str, object], ...] = ()
    sparsifier: str | None = None
    sparsifier_options: tuple[tuple[str, object], ...] = ()
    sparsifier_config: tuple[tuple[str, str], ...] = ()
    needs_cost_model: bool = False
    overlap: bool = True
    offload: bool = False
    interleave: bool = False
    ddp_hook: bool = False
    min_k: int = MIN_K
    momentum_ahead: float = 0.0
    dgc_warmup: tuple[int, int] = (0, 0)
    budget: str = "blend"
    paper: str = ""

    def __post_init__(self) -> None:
        if self.planner not in PLANNERS:
            raise ValueError(f"scheme {self.name!r}: planner must be one of {PLANNERS}, "
                             f"got {self.planner!r}")
        if (self.offload or self.interleave) and self.planner != "ssfusion":
            raise ValueError(f"scheme {self.name!r}: offload/interleave are SSFusion's")
        if not 0.0 <= self.momentum_ahead <= 1.0:
            raise ValueError(f"scheme {self.name!r}: momentum_ahead must be in [0, 1]")
        if self.budget not in BUDGETS:
            raise ValueError(f"scheme {self.name!r}: budget must be one of {BUDGETS}")
        periods, steps = self.dgc_warmup
        if periods < 0 or steps < 0 or bool(periods) != bool(steps):
            raise ValueError(f"scheme {self.name!r}: dgc_warmup must be (0, 0) or two "
                             f"integers >= 1")

    def min_k_under(self, pooled: bool) -> int:
        """``Config.min_k``'s default: 1 where a buffer's tensors are pooled (``Config.budget``
        ``"pooled"``: a pool's K counts, not a tensor's k), else :attr:`min_k`."""
        return 1 if pooled else self.min_k

    @property
    def sparse(self) -> bool:
        """Whether gradients are compressed (error feedback, momentum correction apply)."""
        return self.planner != "fixed"


_TABLE = (
    Scheme("dense", "fixed", overlap=False, ddp_hook=True,
           paper="PyTorch DDP without overlap (SSFusion §II 'Dense')"),
    Scheme("dense_ovlp", "fixed", paper="wait-free backpropagation (SSFusion §II 'DenseOvlp')"),
    Scheme("topka", "single", "topka", momentum_ahead=THIRD, dgc_warmup=DGC_WARMUP,
           paper="DenseStream §II 'TopkA' (all-gather of COO)"),
    Scheme("topkdsa", "single", "topkdsa", paper="DenseStream §II 'TopkDSA' (SparCML)"),
    Scheme("gtopk", "single", "gtopk", paper="Ok-Topk §2 'gTop-k' (Shi et al.)"),
    Scheme("gaussiank", "single", "topka", sparsifier="gaussiank",
           paper="Ok-Topk §2 'Gaussian-k' (Shi et al.)"),
    Scheme("oktopk", "single", "oktopk", collective_options=("density",),
           collective_kwargs=(("nonfinite", "skip_step"),),
           sparsifier="threshold", sparsifier_options=(("clock", "step"),),
           sparsifier_config=(("period", "local_tau_prime"),), momentum_ahead=THIRD,
           dgc_warmup=DGC_WARMUP,
           paper="Ok-Topk §3, Algorithm 1 (local threshold reuse: lines 2–4)"),
    Scheme("densestream", "single", "densestream", momentum_ahead=THIRD,
           dgc_warmup=DGC_WARMUP, paper="DenseStream §IV"),
    Scheme("per_tensor", "per_tensor", ddp_hook=True, momentum_ahead=THIRD,
           dgc_warmup=DGC_WARMUP, paper="SSFusion §II-D per-tensor"),
    Scheme("multi_tensor", "mgwfbp", needs_cost_model=True,
           paper="SSFusion §II-D multi-tensor (MG-WFBP / OMGS)"),
    Scheme("omgs", "mgwfbp", needs_cost_model=True, paper="OMGS-SGD (= multi_tensor)"),
    Scheme("cupcake", "cupcake", needs_cost_model=True, paper="Cupcake (SSFusion §II-D)"),
    Scheme("ssfusion", "ssfusion", needs_cost_model=True, ddp_hook=True, momentum_ahead=1.0,
           dgc_warmup=DGC_WARMUP, budget="pooled",
           paper="SSFusion §IV-B selective sparsification"),
    Scheme("ssfusion_o", "ssfusion", needs_cost_model=True, offload=True, momentum_ahead=1.0,
           dgc_warmup=DGC_WARMUP, budget="pooled", paper="SSFusion §IV-C (SSFusion-O)"),
    Scheme("ssfusion_oi", "ssfusion", needs_cost_model=True, offload=True, interleave=True,
           ddp_hook=True, momentum_ahead=1.0, dgc_warmup=DGC_WARMUP, budget="pooled",
           paper="SSFusion §IV-C/D (SSFusion-O + SSFusion-I)"),
    Scheme("hipress", "hipress", needs_cost_model=True,
           paper="HiPress (SOSP'21) CaSync selective compression + bulk synchronization"),
    Scheme("espresso", "espresso", needs_cost_model=True,
           paper="Espresso (EuroSys'23) per-tensor compression option and CPU offload"),
    Scheme("spardl", "single", "spardl", collective_options=("density",),
           paper="SparDL (ICDE'24) Spar-Reduce-Scatter + Spar-All-Gather"),
    Scheme("auto", "auto", "topka", needs_cost_model=True, ddp_hook=True,
           paper="cost-model choice dense vs sparse per buffer (SSFusion §IV-A model, HiPress "
                 "compress-or-not, Espresso's walk)"),
)


# name → Scheme, read-only; iterating yields the names in table order.
SCHEMES: Mapping[str, Scheme] = MappingProxyType({s.name: s for s in _TABLE})


def get(name: str) -> Scheme:
    """The record of scheme ``name``; an unknown name raises ``ValueError`` naming the choices."""
    try:
        return SCHEMES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown scheme {name!r}; choose one of {', '.join(SCHEMES)}") from None


def names() -> list[str]:
    """Every scheme name, in table order."""
    return list(SCHEMES)
