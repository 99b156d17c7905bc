"""Density that follows training: Accordion's critical regimes (Agarwal et al., MLSys 2021).

Sparse training loses most where the gradients change fastest: the first steps, and the steps
after a learning-rate drop. What it loses there it does not win back later (DGC's density
warm-up, §3.4, exists for this; ``docs/results/accuracy.md``). Accordion detects these
*critical regimes* from the relative change of the gradient norm between windows, and uses low
compression only inside them: with ``n_w`` the window's statistic,

    critical(w+1)  ⇔  |n_{w-1} − n_w| / n_{w-1} ≥ η        (η = 0.5, Accordion's)

and the first window is critical (Accordion's first epoch). This module is that rule on
gradsync's steps, as both doors run it (:class:`gradsync.GradSync` and the DDP hook):

* the window is :data:`WINDOW` synchronized steps, and ``n_w`` is the sum over its steps and
  over the ranks of each rank's squared local gradient norm ``‖g‖²`` (one norm per fusion
  buffer or DDP bucket, added on the device: no host read per step);
* at a window's end the ranks all-reduce ``n_w`` (one 4-byte word, counted at the call) and read
  it: one collective and one host read per window, so every rank decides alike;
* inside a critical window the density is ``density × CRITICAL_FACTOR`` (capped at 1), outside
  it the target ``density``;
* **a byte cap**: after the first window, a window is critical only if the mean density over
  the run, that window included, stays at most ``BUDGET × density``, so the schedule never
  spends more than half again what a fixed density would beyond its first window, whatever
  the norms do; the first window alone costs ``WINDOW × (CRITICAL_FACTOR − 1)`` steps at the
  target density, once per run.

``Config(density_schedule="adaptive")`` turns it on; the default, ``"fixed"``, sends the target
density at every step (DGC's warm-up, ``Config.density_warmup``, is the fixed schedule's
warm-up; with the adaptive one the larger of the two densities applies). The schedule's state
(the last statistic, the regime, the densities spent) is in each door's ``state_dict()``.

**Measured, and why it is not the default** (CNN on Fashion-MNIST, P = 4, 160 steps, 1 %,
paired by seed with the fixed schedule's runs of the same seeds, whole test split; `bench
convergence --model cnn --schemes topka,ssfusion_oi --density-schedule adaptive`, seeds 1–10,
95 % intervals): TopkA −0.59 ± 0.67 points, SSFusion-OI −0.14 ± 0.59, for 1.08–1.14× the
bytes per step after the warm-up. Spending the cap's budget harder at the start, DGC's warm-up
at 10 % for 8 steps (``--density-schedule fixed --density-warmup 1:8``, about 1.45× the bytes)
did no better: TopkA −0.43 ± 0.63, SSFusion-OI −0.09 ± 0.56; nor did spreading it over 80 steps
(3×, 2×, 1.5×, 1.25× the density for 20 steps each, ``--density-warmup
0.03,0.02,0.015,0.0125:20``, 1.47× TopkA's bytes over the run): TopkA −0.03 ± 0.91, SSFusion-OI
+0.01 ± 0.59 (docs/results/convergence-cnn-density-warmup-20.md). On this workload the first
steps are not where a compressed run loses accuracy, and within a byte cap of 1.5× no schedule of
them measured a gain, so the default stays the fixed density. On ResNet-20 (BatchNorm, 5 seeds,
paired with the fixed schedule's runs; `--model resnet20 --seeds 5 --eval-points 2`) it did
not help either: TopkA −2.07 [−12.86, +8.71] points, SSFusion-OI −0.72 [−6.84, +5.39], at
1.05–1.08× the bytes (docs/results/convergence-resnet20-adaptive-density.md). Within a
160-step run the cap allows no critical window after the first before step 110; the regime
detection is for long runs (Accordion's learning-rate drops), which these studies do not
cover.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from gradsync.collectives.comm import Comm, CommStats
from gradsync.engine.config import Config
from gradsync.schedule import schemes

__all__ = ["BUDGET", "CRITICAL_FACTOR", "ETA", "WINDOW", "DensitySchedule"]

WINDOW = 10  # steps per window (Accordion: an epoch; here short runs need short windows)
ETA = 0.5  # Accordion's η: a relative change of the norm at least this marks a critical regime
CRITICAL_FACTOR = 4.0  # the density inside a critical regime, × Config.density
BUDGET = 1.5  # after the first window: mean density over the run at most BUDGET × density


class DensitySchedule:
    """The density of each synchronized step (module docstring).

    The door calls :meth:`at` for a step's density, :meth:`observe` with each buffer's
    gradient of the step, and :meth:`end_step` once per step, on every rank alike.
    """

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        # dense schemes send everything whatever the schedule: nothing to decide
        self.adaptive = cfg.density_schedule == "adaptive" and schemes.get(cfg.scheme).sparse
        self.critical = self.adaptive  # the first window is critical
        self.previous: float | None = None  # the last window's statistic n_w
        self.steps = 0  # synchronized steps seen
        self.spent = 0.0  # Σ density over them (the byte cap)
        self.critical_windows = int(self.adaptive)
        self._sum: torch.Tensor | None = None  # this window's Σ ‖g‖², on the device

    @property
    def critical_density(self) -> float:
        return min(1.0, self.cfg.density * CRITICAL_FACTOR)

    def at(self, step: int) -> float:
        """Step ``step``'s density: the regime's, or DGC's warm-up where that is larger."""
        d = self.critical_density if self.critical else self.cfg.density
        return max(d, self.cfg.density_at(step))

    def observe(self, grad: torch.Tensor) -> None:
        """Add ``‖grad‖²`` (one buffer of this step's local gradients) to the window's sum."""
        if not self.adaptive:
            return
        sq = torch.linalg.vector_norm(grad.detach(), dtype=torch.float32).square()
        if self._sum is None:
            self._sum = sq
        else:  # (a resumed sum is on the CPU)
            self._sum = self._sum.to(sq.device).add_(sq)

    def end_step(self, step: int, group: dist.ProcessGroup | None) -> CommStats | None:
        """Step ``step`` is done on every rank. At a window's end, agree on the window's
        statistic (one all-reduce, whose traffic is returned for the door to count) and decide
        the next window's regime; None at the other steps."""
        self.spent += self.at(step)
        self.steps += 1
        if not self.adaptive or (step + 1) % WINDOW:
            return None
        word = (torch.zeros(1, dtype=torch.float32) if self._sum is None
                else self._sum.reshape(1))
        comm = Comm(group)
        word = word.to(comm.device)
        comm.all_reduce(word)
        self._sum = None
        self.decide(float(word), step + 1)  # the window's one host read
        return comm.stats

    def decide(self, n: float, steps: int) -> bool:
        """The regime of the window after ``steps`` steps, from the window's statistic ``n``
        (alike on every rank): critical when ``n`` changed by at least η of the previous
        window's and the byte cap allows it."""
        prev, self.previous = self.previous, n
        if prev is None or not (math.isfinite(n) and math.isfinite(prev)):
            changed = False  # one statistic says nothing yet; a non-finite one nothing at all
        else:
            changed = abs(prev - n) >= ETA * prev if prev > 0 else n > 0
        affordable = (self.spent + WINDOW * self.critical_density
                      <= BUDGET * self.cfg.density * (steps + WINDOW))
        self.critical = changed and affordable
        self.critical_windows += int(self.critical)
        return self.critical

    def summary(self) -> dict[str, Any]:
        """What ``stats()`` reports: the schedule, the regime now, the windows that were
        critical and the mean density so far."""
        return {"schedule": self.cfg.density_schedule, "critical": self.critical,
                "critical_windows": self.critical_windows,
                "mean_density": self.spent / self.steps if self.steps else None}

    def state_dict(self) -> dict[str, Any]:
        return {"critical": self.critical, "previous": self.previous, "spent": self.spent,
                "steps": self.steps,
                "critical_windows": self.critical_windows,
                "sum": None if self._sum is None else float(self._sum)}

    @classmethod
    def loaded(cls, cfg: Config, state: dict[str, Any] | None) -> DensitySchedule:
        """A schedule for ``cfg`` resumed from :meth:`state_dict` (``None``: a checkpoint saved
        before schedules were kept, which resumes a fresh one); ``ValueError`` on a malformed
        entry."""
        out = cls(cfg)
        if state is None:
            return out
        try:
            out.critical = bool(state["critical"])
            out.previous = None if state["previous"] is None else float(state["previous"])
            out.spent = float(state["spent"])
            out.steps = int(state["steps"])
            out.critical_windows = int(state["critical_windows"])
            s = state["sum"]
            out._sum = None if s is None else torch.tensor(float(s))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"malformed density_schedule entry in the saved state: {e!r}"
                             ) from None
        return out
