"""Ok-Topk: the O(k) sparse allreduce (Li & Hoefler, PPoPP'22, §3.1, Algorithm 1).

Semantics (§3.1): ``Top_k( Σ_{i<P} Top_k(G_i) )``. The inner Top_k is the *caller's* local
selection: every rank passes ``sel``, already sparsified to about k entries (Algorithm 1 line 3,
e.g. a top-k or a threshold-reuse sparsifier). This collective implements lines 5–14:

1. **Balanced split** (§3.1.1, lines 5–7). The index space is cut into P regions; rank d owns
   region d = ``[b_d, b_{d+1})``. Every τ steps the boundaries are re-evaluated: each rank takes
   the P equal-count cut points of its local indices, and one all-reduce of P numbers
   (P−1 cut sums and the number of contributing ranks) averages them. In between they are reused
   (:mod:`gradsync.collectives.regions`: ``balanced_boundaries`` and the period rule ``due``,
   shared with DenseStream).
2. **Split and reduce** (§3.1.1, line 8). P−1 steps; step j sends the local entries of region
   (r+j) mod P to rank (r+j) mod P and receives from (r−j) mod P (destination rotation, Fig. 2b).
   The entry counts are exchanged first; the payloads go out in buckets of min(4, P) non-blocking
   messages, and a bucket is reduced (merged) while the next one is in flight (Fig. 2c). Where
   a receive may be longer than its message (gloo, :meth:`~gradsync.collectives.comm.Comm.
   bounded`; ours) and the CPU's own kernels run, each message carries its count ahead of its
   entries instead, into a buffer that holds one entry per position of the region: the same
   bytes, one round fewer a step, for one more host read (the counts, on arrival: a CPU
   tensor's; the accelerators' kernels keep the offsets and sizes in one read).
   Contributions are added in float64 and rounded once to the gradient's dtype: the sum of a
   few fp32/bf16/fp16 values is exact in float64 (unless their exponents span more than about
   29 bits), so the reduced value does not depend on the arrival order of the buckets.
3. **Global top-k by threshold reuse** (§3.1.3, lines 9–12). Each rank keeps the entries of its
   reduced region with ``|v| >= θ``. θ is computed exactly every τ′ steps — the k-th largest
   magnitude of the union of the reduced regions, found by one all-gather of each region's k
   largest magnitudes where they are short (ours), else by a distributed radix select
   (4 all-reduces of 256 counts, never the entries themselves) — and reused in between, with small
   multiplicative nudges after every step (ours; the paper reuses θ unchanged). By default a
   reused θ is kept whatever count it admits, as in the paper: the count is then bounded only
   by the union of the local selections (at most P·k entries, TopkA's volume). With
   ``recompute_band=(lo, hi)`` a reused θ whose count falls outside [lo·k, hi·k] is recomputed
   exactly in the same step (reason ``"out_of_range"``), which caps the bytes at the price of
   8 more all-reduces in those steps; early in training that is most steps, and it cost the
   CNN both speed and accuracy (docs/results/speed.md, "Ok-Topk's count guard").
4. **Balance and allgatherv** (§3.1.2, line 13). The selected counts are all-gathered; if the
   largest exceeds 4× the average (§5.3), the selected entries are re-distributed into P equal
   contiguous chunks by point-to-point messages (order preserved), then all-gathered with an
   exact-size allgatherv. Every rank receives the same list, so ``dense`` is bitwise identical.
   Where balancing cannot run (P ≤ ``balance_factor``: the largest count is at most the total)
   and nothing else needs the counts first (no ``recompute_band``), on gloo with the CPU's own
   kernels, the counts (with the non-finite flags and the per-source counts) travel ahead of
   each region's entries instead, in bounded receives: the same bytes, one call
   fewer a step (ours; at P = 2 a gloo call costs a step 0.3–1 ms on a 2-core machine,
   docs/results/rounds-cpu.md).
5. ``kept`` = local indices ∩ global selection (line 14; Algorithm 2 line 6 zeroes the residual
   only there), through a bitmap of the global selection (no search, no read).
6. **P = 2 in one exchange** (ours, ``pair=True``, the default). At P = 2 each rank is the
   other's only peer: split and reduce sends it the entries of its region (about half the
   selection), and the allgatherv brings back its selected sums: two rounds. Exchanging the
   whole selections instead (one bounded all-gather of ``[count][indices][values]``, about k
   entries a rank: the bytes of the two rounds' k/2 and k/2) lets both ranks form both
   regions' sums themselves (two contributions per index, added in float64 and rounded once:
   the owner's bits), and θ is then the k-th largest magnitude of the whole union, found with
   no call; no boundaries are needed. Every rank decides alike, where a receive may be
   longer than its message (gloo), the CPU's own kernels run and a whole tensor's entries fit
   in :data:`BOUNDED_MAX`; elsewhere (NCCL, larger tensors), the rounds. Measured on the CNN
   at 1 %, P = 2: 3 calls a step → 2 (the engine's agreement word stays), the step's median
   14.2 → 11.6 ms, the parameters bit for bit the same (docs/results/speed.md, "Ok-Topk at
   P = 2 in one exchange"). Each rank also checks its own block as its peer does
   (:meth:`OkTopk.alike`), so both ranks hold both blocks' checks and flags, and the engine's
   step spends no agreement word either (speed.md, "One round fewer").
7. **Verdicts in the heads** (ours). A rank's checks of the messages it reduced in split and
   reduce would show on that rank only, and the engine's step would spend an agreement round
   telling the others. Each region owner's head (the counts' all-gather, or its block in
   step 4) carries its verdict instead, a word made on the device from its checks (1 when
   one failed): every rank reads every head, so every rank fails that step alike ("another
   rank received a malformed message"), for 8 bytes a rank and no round. Every rank unpacks
   every block of the global selection, its own included, and on the CPU's kernels counts its
   own entries in it itself (free there) instead of checking the owners' counts, so
   :meth:`OkTopk.alike` holds there at every P. What one rank alone receives corrupted in the
   allgather (a fault of its link) fails that rank only (docs/usage.md).

Host reads. The indices received (the peers' split-and-reduce messages, the gathered global
selection) are checked on the device: a bad one is moved into range with its value zeroed
before anything is written, and the checks go to the caller (:data:`~gradsync.collectives.base.
CHECKS`), which reads them with the step's other checks. A reuse step then reads once the
regions' counts with the non-finite flags, the verdicts (7.) and, on the accelerators' kernels,
per region, how many of its selected entries each rank sent (one all-gather): so each rank
knows the size of its ``kept`` before the global selection arrives (with the counts in the
blocks, step 4, on the CPU's kernels: its own count, then each block's on arrival, then every
head in one read; there each rank counts its ``kept`` itself, free). At P > 1 it also reads
the regions' offsets in its selection with the sizes
of the peers' messages (one read; two on the CPU's own kernels over gloo, the counts arriving
inside the messages, step 2), and the merge of the messages reads the size of their union
(:func:`~gradsync.sparsegrad.sparse_sum`, given the region's ends); an exact θ adds one (the
all-gather's k-th largest) or, for large k, the radix select's four.
A malformed message raises after θ and the boundaries are committed (a non-finite value, before;
or, with ``nonfinite="skip_step"``, gives a sum of NaN on every rank for the owner to skip).

Volume per rank (Table 1, COO = 2 words per entry): between the Theorem 3.1 lower bound
2k(P−1)/P and 6k(P−1)/P words, plus O(P) control words per step (sizes, counts) and, every τ′
steps, the exact threshold's k·(P−1) words (one all-gather) or, for large k, the radix
select's 4×256 int64 counts. Every message is ``[indices][values]``
(:func:`gradsync.formats.wire.pack_entries`): indices travel as int32 when numel < 2**31, int64
otherwise, never through a float buffer (the reference code sends them as float32, which is
wrong above 2**24), and data balancing is always available (the reference enables it only for
BERT).
"""

from __future__ import annotations

import functools
import itertools
import math
import struct
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from gradsync.collectives import registry
from gradsync.collectives.base import CHECKS, Collective, any_failed, heard
from gradsync.collectives.comm import Comm
from gradsync.collectives.regions import balanced_boundaries, due
from gradsync.formats.wire import (
    COUNT_BYTES,
    entry_bytes,
    pack_entries,
    pack_entries_counted,
    unpack_entries,
    wire_index_dtype,
)
from gradsync.sparsegrad import (
    SparseGrad,
    bincount,
    checked_entries,
    flatnonzero,
    host_kernels,
    mark_at,
    put_at,
    sparse_sum,
    target_k,
    validate_density,
)

__all__ = ["BALANCE_FACTOR", "BOUNDED_MAX", "OkTopk", "counts_fit_inline", "exact_threshold_calls",
           "pair_fits"]

# Split and reduce where a receive may be longer than its message (gloo): each message carries
# its entry count ahead of its entries (wire.pack_entries_counted), one round instead of the
# counts' and the entries', into a buffer of at most this many bytes (else the counts go first).
BOUNDED_MAX = 64 * 2**20
RADIX_BITS = 8  # radix select: 256 bins per round, over the 32 bits of a float32
RADIX_ROUNDS = 32 // RADIX_BITS  # all-reduces per exact threshold
BALANCE_FACTOR = 4.0  # data balancing when the largest count > this × the mean (§5.3)
EXACT_GATHER_MAX = 64 << 10  # a rank's k float32 magnitudes up to this: θ from one all-gather


def pair_fits(P: int, n: int, eb: int) -> bool:
    """Whether Ok-Topk's one exchange at P = 2 fits a bounded receive: a whole tensor's
    entries of ``eb`` bytes, their count ahead, in :data:`BOUNDED_MAX` (:meth:`OkTopk._pair`;
    the simulator's pattern asks the same)."""
    return P == 2 and COUNT_BYTES + n * eb <= BOUNDED_MAX


def counts_fit_inline(P: int, widest: float, eb: int,
                      balance_factor: float = BALANCE_FACTOR) -> bool:
    """Whether Ok-Topk's counts can travel ahead of each region's entries (no balancing can run
    at P ≤ ``balance_factor``, and the widest region's bounded receive fits
    :data:`BOUNDED_MAX`: :meth:`OkTopk._counts_inline`; the simulator's pattern asks the
    same)."""
    return balance_factor >= P and (4 + P) * COUNT_BYTES + widest * eb <= BOUNDED_MAX


def exact_threshold_calls(k: int) -> int:
    """The collective calls of one exact θ for k (:meth:`OkTopk._exact_threshold`): one
    all-gather of k float32 magnitudes while their 4k bytes fit in :data:`EXACT_GATHER_MAX`,
    else the radix select's :data:`RADIX_ROUNDS` all-reduces."""
    return 1 if 4 * k <= EXACT_GATHER_MAX else RADIX_ROUNDS
_STATE_KEYS = (
    "numel", "world_size", "boundaries", "boundary_step", "theta", "theta_step",
    "boundary_evaluations", "exact_evaluations",
)


def _nonfinite_flag(x: torch.Tensor) -> torch.Tensor:
    """1 on the device when ``x`` holds a NaN/Inf (NaN propagates through max; ±Inf is its
    own extreme), else 0; nothing is read back."""
    if not x.numel():
        return torch.zeros((), dtype=torch.int64, device=x.device)
    lo, hi = torch.aminmax(x)
    return (~(torch.isfinite(lo) & torch.isfinite(hi))).to(torch.int64)


def _as_f32(x: float) -> float:
    """``x`` rounded to float32 (on the host: no tensor, no read)."""
    return struct.unpack("f", struct.pack("f", x))[0]


@registry.register("oktopk")
class OkTopk(Collective):
    """Ok-Topk O(k) sparse allreduce (Algorithm 1); stateful (boundaries, θ).

    Args:
        density: target global density; k = ``target_k(numel, density)``
            = max(1, round(density·numel)).
        k: target global count (instead of ``density``). With neither, k is the mean of the
            ranks' local selection sizes (one extra all-reduce of one word per step).
        tau: τ, the period (in steps) of the region-boundary re-evaluation (paper: 64).
        tau_prime: τ′, the period of the exact global-threshold re-evaluation (paper: 32).
        balance_factor: data balancing runs when max count > balance_factor × mean (paper: 4).
        bucket: messages per bucket in split and reduce; min(bucket, P) (paper: 4).
        nudge: multiplicative step of θ between exact evaluations (count > 1.1k → θ·(1+nudge),
            count < 0.9k → θ/(1+nudge)).
        recompute_band: ``(lo, hi)`` with 0 ≤ lo ≤ 1 ≤ hi: recompute a reused θ exactly when
            its count leaves [lo·k, hi·k] (module docstring, 3.). ``None`` (default): the
            paper's pure reuse.
        nonfinite: a NaN/Inf in a rank's selection or in a region's reduced sum (found by
            every rank at once, in the count's all-gather): ``"raise"`` (default), a
            ``ValueError`` on every rank; ``"skip_step"``, a sum of NaN on every rank, for its
            owner to skip the step (the engine passes ``Config.nonfinite``). Either way θ and
            the boundaries are left as they were.
        pair: at P = 2 on gloo, one exchange of the two selections instead of the rounds
            of lines 5–13 (module doc, 6.; default ``True``); ``False`` runs the rounds.

    ``step`` must be the same on every rank (it drives the τ and τ′ schedules).
    """

    exact = False

    def __init__(
        self,
        *,
        density: float | None = None,
        k: int | None = None,
        tau: int = 64,
        tau_prime: int = 32,
        balance_factor: float = BALANCE_FACTOR,
        bucket: int = 4,
        nudge: float = 0.02,
        recompute_band: tuple[float, float] | None = None,
        nonfinite: str = "raise",
        pair: bool = True,
        check_shapes: bool | str = True,
    ) -> None:
        super().__init__(check_shapes=check_shapes)
        if not isinstance(pair, bool):
            raise ValueError(f"oktopk: pair must be True or False, got {pair!r}")
        self.pair = pair
        if nonfinite not in ("raise", "skip_step"):
            raise ValueError(f"oktopk: nonfinite must be 'raise' or 'skip_step', got "
                             f"{nonfinite!r}")
        self.nonfinite = nonfinite
        if density is not None and k is not None:
            raise ValueError("oktopk: give density or k, not both")
        if density is not None:
            density = validate_density(density, "oktopk: density")
        if k is not None and (int(k) != k or k < 1):
            raise ValueError(f"oktopk: k must be a positive integer, got {k}")
        for nm, v in (("tau", tau), ("tau_prime", tau_prime), ("bucket", bucket)):
            if int(v) != v or v < 1:
                raise ValueError(f"oktopk: {nm} must be a positive integer, got {v}")
        if not balance_factor >= 1.0:
            raise ValueError(f"oktopk: balance_factor must be >= 1, got {balance_factor}")
        if not 0.0 < nudge < 1.0:
            raise ValueError(f"oktopk: nudge must be in (0, 1), got {nudge}")
        if recompute_band is not None:
            try:
                lo, hi = (float(b) for b in recompute_band)
            except (TypeError, ValueError):
                raise ValueError(f"oktopk: recompute_band must be a pair (lo, hi) or None, "
                                 f"got {recompute_band!r}") from None
            if not 0.0 <= lo <= 1.0 <= hi < math.inf:
                raise ValueError(f"oktopk: recompute_band needs 0 <= lo <= 1 <= hi < inf, "
                                 f"got {recompute_band!r}")
            recompute_band = (lo, hi)
        self.recompute_band = recompute_band
        self.density = density
        self.k = None if k is None else int(k)
        self.tau, self.tau_prime, self.bucket = int(tau), int(tau_prime), int(bucket)
        self.balance_factor, self.nudge = float(balance_factor), float(nudge)
        self._state: dict[str, Any] = {key: None for key in _STATE_KEYS}
        self._state["boundary_evaluations"] = 0
        self._state["exact_evaluations"] = 0
        # the boundaries as host ints and on the device, kept while they are reused
        self._edges: tuple[torch.Tensor, torch.device, list[int], torch.Tensor] | None = None

    def __repr__(self) -> str:
        target = f"density={self.density}" if self.density is not None else f"k={self.k}"
        band = "" if self.recompute_band is None else f", recompute_band={self.recompute_band}"
        return f"OkTopk({target}, tau={self.tau}, tau_prime={self.tau_prime}{band})"

    # -- state ------------------------------------------------------------------------
    def rescale(self, factor: float) -> None:
        """The reused global θ (lines 9–12) follows the values' scale."""
        if self._state["theta"] is not None:
            self._state["theta"] = _as_f32(self._state["theta"] * float(factor))

    def state_dict(self) -> dict[str, Any]:
        s = dict(self._state)
        if s["boundaries"] is not None:
            s["boundaries"] = s["boundaries"].clone()
        return s

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if set(state) != set(_STATE_KEYS):
            raise ValueError(
                f"oktopk: state keys {sorted(state)} != expected {sorted(_STATE_KEYS)}"
            )
        b = state["boundaries"]
        if b is not None and (not isinstance(b, torch.Tensor) or b.dtype != torch.int64
                              or b.dim() != 1):
            raise ValueError("oktopk: state 'boundaries' must be a 1-D int64 tensor or None")
        self._state = dict(state)
        self._edges = None
        if b is not None:
            self._state["boundaries"] = b.clone()

    # -- Algorithm 1 ------------------------------------------------------------------
    def _reduce(
        self, sel: SparseGrad, comm: Comm, step: int
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        P, n, dev = comm.size, sel.numel, sel.device
        st = self._state
        if st["numel"] != n or st["world_size"] != P:  # a different tensor: start afresh
            st.update(numel=n, world_size=P, boundaries=None, boundary_step=None,
                      theta=None, theta_step=None)
        k = self._target_k(sel, comm)
        wire = wire_index_dtype(n)
        eb = entry_bytes(wire, sel.dtype)
        if self.pair and self._pair(comm, n, eb, sel.indices):  # P = 2 (module doc, 6.)
            return self._reduce_pair(sel, comm, step, k, wire, eb)

        # Lines 5–7: balanced split, boundaries re-evaluated every τ steps.
        new_bounds = due(step, st["boundary_step"], self.tau)
        bounds = (balanced_boundaries(sel.indices, n, P, comm) if new_bounds
                  else st["boundaries"])
        edges, edges_dev = self._host_and_device(bounds, dev)
        checks: list[tuple[torch.Tensor, str]] = []  # read by the caller with its own
        region = (edges[comm.rank], edges[comm.rank + 1])

        # Line 8: split and reduce → the reduced entries of this rank's region.
        r_idx, r_val, received, sources = self._split_and_reduce(sel, edges, edges_dev, comm,
                                                                 wire, eb, checks)
        mags = r_val.abs().to(torch.float32)

        # Lines 9–12: global threshold θ, exact every τ′ steps, reused (and nudged) in between;
        # line 13: data balancing (if the largest count > 4× the mean), then allgatherv. The
        # counts travel in an all-gather of their own, or inside the allgatherv's blocks.
        heads = self._head_words(sel, r_idx, mags, sources, region, P, checks)
        inline = self._counts_inline(comm, edges, eb, sel.indices)
        if inline:
            theta, reason = self._theta(mags, k, comm, step)
            mask = mags >= theta
            all_idx, dense, cb = self._allgather_counted(mask, heads(mask), r_idx, r_val, comm,
                                                         wire, eb, edges, checks, step, k)
            why, balanced = self._nonfinite_why(cb, step), False
        else:
            theta, reason, mask, cb, why = self._global_threshold(
                mags, k, comm, step, lambda m: comm.all_gather(heads(m)).tolist())
        self._heard(cb, checks, dev)
        if why is not None:  # non-finite, and ``nonfinite="skip_step"``
            nan = torch.full((n,), math.nan, dtype=sel.dtype, device=dev)
            return nan, sel.indices[:0], {"k": k, "nonfinite": why, CHECKS: checks}
        counts = [int(c[0]) for c in cb]
        total = sum(counts)
        # this rank's entries in the global selection: counted by the regions' owners (on the
        # CPU's kernels by itself, in _kept)
        n_kept = None if host_kernels(sel.indices) else sum(int(c[4 + comm.rank]) for c in cb)
        if not inline:
            all_idx, dense, balanced = self._allgather_selection(
                mask, r_idx, r_val, counts, comm, wire, eb, checks, step)

        # Line 14: the local entries that made it into the global selection.
        kept = self._kept(sel, all_idx, n_kept, checks, step)

        # Commit the state only now: a non-finite value raised above leaves it untouched on every
        # rank (the wire checks are read by the caller, after this)
        self._commit(step, bounds if new_bounds else None, theta, reason, total, k)
        info = {
            "k": k,
            "threshold": theta,
            "threshold_exact": reason is not None,
            "threshold_reason": reason,
            "next_threshold": st["theta"],
            "selected": total,
            "counts": counts,  # selected per region owner, before balancing
            "balanced": balanced,
            "boundaries": list(edges),
            "boundaries_recomputed": new_bounds,
            "region_entries": int(r_idx.numel()),
            "received_entries": received,
            CHECKS: checks,
        }
        return dense, kept, info

    def _global_threshold(
        self, mags: torch.Tensor, k: int, comm: Comm, step: int,
        gather: Callable[[torch.Tensor], list[list[int]]],
    ) -> tuple[float, str | None, torch.Tensor, list[list[int]], str | None]:
        """Lines 9–12: θ, exact every τ′ steps (reason ``"periodic"``) and reused in between,
        the mask ``|v| >= θ`` of the reduced region, and its counts (``gather``:
        :meth:`_gather_counts`). With ``recompute_band``, a reused θ whose count leaves
        [lo·k, hi·k] is recomputed in the same step (reason ``"out_of_range"``). Returns
        ``(θ, reason, mask, counts, why)``; ``why`` names a non-finite value found by every
        rank at once (raised, or returned with ``nonfinite="skip_step"``), else ``None``."""
        theta, reason = self._theta(mags, k, comm, step)
        mask = mags >= theta
        # the count, both flags and the count per contributing rank travel in one all-gather
        # and come back in one read
        cb = gather(mask)
        why = self._nonfinite_why(cb, step)
        if why is not None:
            return theta, reason, mask, cb, why
        total = sum(int(c[0]) for c in cb)
        if self._out_of_band(reason, total, theta, k):
            theta, reason = self._exact_threshold(mags, k, comm), "out_of_range"
            mask = mags >= theta
            cb = gather(mask)
        return theta, reason, mask, cb, None

    def _out_of_band(self, reason: str | None, total: int, theta: float, k: int) -> bool:
        """Whether a reused θ (``reason`` None) admitted a count outside ``recompute_band``'s
        [lo·k, hi·k] and is recomputed exactly in the same step (class doc)."""
        band = self.recompute_band
        return reason is None and band is not None and (
            (total < band[0] * k and theta > 0.0) or total > band[1] * k)

    def _theta(self, mags: torch.Tensor, k: int, comm: Comm | None, step: int
               ) -> tuple[float, str | None]:
        """θ and why it was computed exactly (``"periodic"``, every τ′ steps; ``None``:
        reused); ``comm`` as in :meth:`_exact_threshold`."""
        theta = self._state["theta"]
        if due(step, self._state["theta_step"], self.tau_prime) or theta is None:
            return self._exact_threshold(mags, k, comm), "periodic"
        return theta, None

    @staticmethod
    def _heard(cb: list[list[int]], checks: list[tuple[torch.Tensor, str]],
               dev: torch.device) -> None:
        """The ranks' verdicts in their heads (:meth:`_heads`, read by every rank): a rank
        that received a malformed message in split and reduce fails every rank's step, as a
        check that failed (module doc, 7.)."""
        bad = [q for q, c in enumerate(cb) if c[3]]
        if bad:
            worst = next((cb[q][3] for q in bad if cb[q][3] != 1), 1)
            checks.extend(heard("oktopk", worst, dev, f" (ranks {bad})"))

    def _nonfinite_why(self, cb: list[list[int]], step: int) -> str | None:
        """The ranks' non-finite flags (:meth:`_heads`, every rank's, so every rank decides
        alike: nothing hangs): ``None`` when there are none, else ``ValueError`` under
        ``nonfinite="raise"``, or the reason under ``"skip_step"``."""
        if not any(c[1] or c[2] for c in cb):
            return None
        inputs = [i for i, c in enumerate(cb) if c[1]]
        sums = [i for i, c in enumerate(cb) if c[2]]
        return self._nonfinite(f"oktopk: non-finite values in the selection on ranks {inputs}, "
                               f"in the reduced sums of the regions of ranks {sums} (step {step})")

    def _nonfinite(self, why: str) -> str:
        """``ValueError(why)`` under ``nonfinite="raise"``, else ``why``, for the caller to
        return a sum of NaN."""
        if self.nonfinite == "raise":
            raise ValueError(why)
        return why

    def _counts_inline(self, comm: Comm, edges: list[int], eb: int, idx: torch.Tensor) -> bool:
        """Whether the counts travel inside the allgatherv's blocks (:meth:`_allgather_counted`)
        instead of an all-gather of their own (ours): where data balancing cannot run (P ≤
        ``balance_factor``: the largest count is at most the total, so never above
        ``balance_factor`` × the mean), nothing needs the counts before the allgatherv (no
        ``recompute_band``), a receive may be longer than its message (:meth:`Comm.bounded`)
        and the CPU's own kernels run (a block's count is read on arrival: free there). Every
        rank decides alike."""
        widest = max(b - a for a, b in itertools.pairwise(edges))
        return (self.recompute_band is None and host_kernels(idx) and comm.bounded(idx.device)
                and counts_fit_inline(comm.size, widest, eb, self.balance_factor))

    @staticmethod
    def _pair(comm: Comm, n: int, eb: int, idx: torch.Tensor) -> bool:
        """Whether Ok-Topk runs in one exchange (:meth:`_reduce_pair`): P = 2, a receive may
        be longer than its message (:meth:`Comm.bounded`, gloo), the CPU's own kernels run,
        and a buffer of a whole tensor's entries fits in :data:`BOUNDED_MAX`. Every rank
        decides alike (n and the entry size are checked alike by the shape check)."""
        return pair_fits(comm.size, n, eb) and host_kernels(idx) and comm.bounded(idx.device)

    def alike(self, sel: SparseGrad, group: dist.ProcessGroup | None = None) -> bool:
        """On the CPU's kernels: at P = 2 in one exchange (:meth:`_reduce_pair`) each rank
        checks both selections, the one it sent as its peer does, and sums both; in the rounds
        every rank reads every rank's verdict on the messages it reduced and its non-finite
        flags (the heads), unpacks every block of the global selection, its own included, and
        counts its own entries in it (module doc, 7.). So its checks and a NaN a selection
        carries show alike on every rank, and the step needs no agreement word. On the
        accelerators' kernels the regions' owners count each rank's entries, and a rank alone
        checks its count."""
        return host_kernels(sel.indices)

    def _reduce_pair(self, sel: SparseGrad, comm: Comm, step: int, k: int,
                     wire: torch.dtype, eb: int) -> tuple[torch.Tensor, torch.Tensor,
                                                          dict[str, Any]]:
        """Lines 5–14 at P = 2 in one exchange (module doc, 6.): the two selections, each
        ``[count][indices][values]``, swapped by one bounded all-gather; both ranks then sum
        them (float64, rounded once, as the owners do), compute θ over the whole union (the
        same k-th largest, no call), select ``|v| >= θ`` and keep their entries in it."""
        n, r, checks = sel.numel, comm.rank, []

        def size_of(q: int, buf: torch.Tensor) -> int:  # one read per block
            c = int(buf[:COUNT_BYTES].clone().view(torch.int64))
            if 0 <= c <= n:
                return COUNT_BYTES + c * eb
            checks.append((torch.zeros((), dtype=torch.bool, device=buf.device),
                           f"oktopk: rank {q}'s selection announces {c} entries for a tensor "
                           f"of {n} (step {step})"))
            return COUNT_BYTES

        blocks = comm.all_gather_bounded(pack_entries_counted(sel.indices, sel.values, wire),
                                         [COUNT_BYTES + n * eb] * 2, size_of,
                                         expected=COUNT_BYTES + eb * k)
        parts = []
        for q, b in enumerate(blocks):
            if q == r:  # this rank's block, checked as its peer checks it (:meth:`alike`)
                b = b[:size_of(q, b)]
            got = checked_entries(*unpack_entries(b[COUNT_BYTES:], (b.numel() - COUNT_BYTES)
                                                  // eb, wire, sel.dtype, "oktopk"),
                                  n, 0, checks, f"oktopk: rank {q}'s selection (step {step})")
            parts.append((sel.indices, sel.values) if q == r else got)
        r_idx, r_val = sparse_sum(parts, torch.float64)
        r_val = r_val.to(sel.dtype)
        mags = r_val.abs().to(torch.float32)
        theta, reason = self._theta(mags, k, None, step)
        mask = mags >= theta
        # the count and the non-finite flags (both selections, the sum): one read
        total, *bad = torch.stack([mask.sum(), *(_nonfinite_flag(v) for _, v in parts),
                                   _nonfinite_flag(mags)]).tolist()
        if any(bad):
            why = self._nonfinite(f"oktopk: non-finite values in the selection on ranks "
                                  f"{[q for q in range(2) if bad[q]]}, in the reduced sum: "
                                  f"{bool(bad[2])} (step {step})")
            nan = torch.full((n,), math.nan, dtype=sel.dtype, device=sel.device)
            return nan, sel.indices[:0], {"k": k, "nonfinite": why, CHECKS: checks}
        if self._out_of_band(reason, total, theta, k):
            theta, reason = self._exact_threshold(mags, k, None), "out_of_range"
            mask = mags >= theta
            total = int(mask.sum())
        at = flatnonzero(mask, total)
        all_idx = torch.index_select(r_idx, 0, at)
        dense = SparseGrad(all_idx, torch.index_select(r_val, 0, at), n,
                           validate=False).to_dense()
        kept = self._kept(sel, all_idx, None, checks, step)
        self._commit(step, None, theta, reason, total, k)
        return dense, kept, {
            "k": k, "threshold": theta, "threshold_exact": reason is not None,
            "threshold_reason": reason, "next_threshold": self._state["theta"],
            "selected": total, "counts": [total], "balanced": False, "boundaries": [0, n],
            "boundaries_recomputed": False, "region_entries": int(r_idx.numel()),
            "received_entries": len(parts[1 - r][0]), "pair": True, CHECKS: checks}

    def _allgather_counted(
        self, mask: torch.Tensor, head: torch.Tensor, r_idx: torch.Tensor, r_val: torch.Tensor,
        comm: Comm, wire: torch.dtype, eb: int, edges: list[int],
        checks: list[tuple[torch.Tensor, str]], step: int, k: int,
    ) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
        """Line 13 with the counts inside the blocks (:meth:`_counts_inline`): each rank's block
        is its ``head`` (:meth:`_heads`, P + 4 int64 words) then its selected entries, gathered
        by bounded receives (:meth:`Comm.all_gather_bounded`, its rounds chosen for blocks of
        k/P entries, as the exact-size allgatherv would for a selection of k); the same bytes as the
        counts' all-gather and the exact-size allgatherv, one call fewer. A block whose count
        its region cannot hold fails a check and travels on as its head alone, so every rank
        but its sender fails alike. Returns (global indices, the dense sum, every block's head
        words)."""
        P, n = comm.size, self._state["numel"]
        hb = (4 + P) * COUNT_BYTES
        own = head.tolist()  # this rank's count: one read (the CPU's kernels: free)
        at = flatnonzero(mask, own[0])
        mine = torch.cat([head.view(torch.uint8),
                          pack_entries(torch.index_select(r_idx, 0, at),
                                       torch.index_select(r_val, 0, at), wire)])
        cap = [edges[q + 1] - edges[q] for q in range(P)]

        def size_of(q: int, buf: torch.Tensor) -> int:  # one read per block (any alignment)
            c = int(buf[:COUNT_BYTES].clone().view(torch.int64))
            if 0 <= c <= cap[q]:
                return hb + c * eb
            checks.append((torch.zeros((), dtype=torch.bool, device=buf.device),
                           f"oktopk: rank {q}'s block announces {c} selected entries for a "
                           f"region that holds at most {cap[q]} (step {step})"))
            return hb

        size_of(comm.rank, mine)  # this rank's block, checked as its peers check it
        blocks = comm.all_gather_bounded(mine, [hb + c * eb for c in cap], size_of,
                                         expected=hb + eb * k / P)
        cb = torch.cat([b[:hb] for b in blocks]).view(torch.int64).view(P, -1).tolist()
        counts = [(b.numel() - hb) // eb for b in blocks]  # what arrived, not what was said
        parts = [unpack_entries(b[hb:], c, wire, r_val.dtype, "oktopk")
                 for b, c in zip(blocks, counts)]
        all_idx, all_val = checked_entries(
            torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), n, 0, checks,
            f"oktopk: the gathered global selection (step {step})")
        for row, c in zip(cb, counts):
            row[0] = c
        return all_idx, SparseGrad(all_idx, all_val, n, validate=False).to_dense(), cb

    def _allgather_selection(
        self, mask: torch.Tensor, r_idx: torch.Tensor, r_val: torch.Tensor, counts: list[int],
        comm: Comm, wire: torch.dtype, eb: int, checks: list[tuple[torch.Tensor, str]],
        step: int,
    ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """Line 13: the selected entries of the reduced region, balanced (§3.1.2) when the
        largest count exceeds ``balance_factor`` × the mean, then all-gathered with an
        exact-size allgatherv. Returns (global indices, the dense sum, balanced)."""
        P, n = comm.size, self._state["numel"]
        total = sum(counts)
        at = flatnonzero(mask, counts[comm.rank])  # its count is known
        g_idx, g_val = torch.index_select(r_idx, 0, at), torch.index_select(r_val, 0, at)
        balanced = total > 0 and max(counts) > self.balance_factor * total / P
        chunks = counts
        if balanced:
            g_idx, g_val, chunks = self._balance(g_idx, g_val, counts, comm, wire, eb)
        blocks = comm.all_gather_v(pack_entries(g_idx, g_val, wire), [c * eb for c in chunks])
        parts = [unpack_entries(b, c, wire, r_val.dtype, "oktopk")
                 for b, c in zip(blocks, chunks)]
        # region order = index order: sorted; checked on the device (no read), and a malformed
        # index is moved into range with its value zeroed before anything is written
        all_idx, all_val = checked_entries(
            torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), n, 0, checks,
            f"oktopk: the gathered global selection (step {step})")
        return all_idx, SparseGrad(all_idx, all_val, n, validate=False).to_dense(), balanced

    @staticmethod
    def _kept(sel: SparseGrad, all_idx: torch.Tensor, n_kept: int | None,
              checks: list[tuple[torch.Tensor, str]], step: int) -> torch.Tensor:
        """Line 14: the local entries that made it into the global selection (a bitmap of it
        over the tensor), at their count ``n_kept`` from the owners (no read; checked with the
        rest, and a count that disagrees, from a malformed message, pads with a valid
        position). ``None``: no owner counted them (:meth:`_reduce_pair`, the CPU's kernels),
        nothing to check."""
        chosen = mark_at(torch.zeros(sel.numel, dtype=torch.bool, device=sel.device), all_idx)
        hit = torch.index_select(chosen, 0, sel.indices)
        if n_kept is None:
            return torch.index_select(sel.indices, 0, flatnonzero(hit))
        at = flatnonzero(hit, min(n_kept, len(sel)), fill_value=0)
        kept = torch.index_select(sel.indices, 0, at)
        checks.append((hit.sum() == n_kept, f"oktopk: the regions' owners counted {n_kept} of "
                                            f"this rank's entries in the global selection, "
                                            f"the gathered selection holds another number "
                                            f"(step {step})"))
        return kept

    def _commit(self, step: int, bounds: torch.Tensor | None, theta: float, reason: str | None,
                total: int, k: int) -> None:
        """The step's state: new boundaries (``None``: reused), the step of an exact θ, and
        the θ for the next step, nudged by ``nudge`` when the count left [0.9k, 1.1k]."""
        st = self._state
        if bounds is not None:
            st["boundaries"], st["boundary_step"] = bounds, step
            st["boundary_evaluations"] += 1
        if reason is not None:
            st["theta_step"] = step
            st["exact_evaluations"] += 1
        next_theta = theta
        if theta > 0.0 and total > 1.1 * k:
            next_theta = theta * (1.0 + self.nudge)
        elif theta > 0.0 and total < 0.9 * k:
            next_theta = theta / (1.0 + self.nudge)
        st["theta"] = _as_f32(next_theta)

    def _host_and_device(self, bounds: torch.Tensor, dev: torch.device
                         ) -> tuple[list[int], torch.Tensor]:
        """The boundaries (a host tensor) as ints and on ``dev``, made once per boundaries
        (every τ steps), not once per step."""
        e = self._edges
        if e is None or e[0] is not bounds or e[1] != dev:
            e = self._edges = (bounds, dev, bounds.tolist(), bounds.to(dev))
        return e[2], e[3]

    # -- pieces -----------------------------------------------------------------------
    def _head_words(self, sel: SparseGrad, r_idx: torch.Tensor, mags: torch.Tensor,
                    sources: list[tuple[int, torch.Tensor]], region: tuple[int, int], P: int,
                    checks: list[tuple[torch.Tensor, str]]
                    ) -> Callable[[torch.Tensor], torch.Tensor]:
        """:meth:`_heads` of a mask, with this rank's flags on the device (nothing read): a
        NaN/Inf in its selection, in its region's reduced sum (a NaN received, or an fp16/bf16
        overflow), and its verdict on the messages it reduced (``checks``; module doc, 7.). On
        the CPU's kernels no owner counts each rank's entries: each counts its own in the
        gathered selection, free there (line 14, :meth:`_kept`)."""
        verdict = any_failed(checks, mags.device)
        return functools.partial(
            self._heads, r_idx=r_idx, sources=[] if host_kernels(sel.indices) else sources,
            region=region, P=P, bad=_nonfinite_flag(sel.values), bad_sum=_nonfinite_flag(mags),
            verdict=verdict)

    @staticmethod
    def _heads(mask: torch.Tensor, r_idx: torch.Tensor, sources: list[tuple[int, torch.Tensor]],
               region: tuple[int, int], P: int, bad: torch.Tensor, bad_sum: torch.Tensor,
               verdict: torch.Tensor) -> torch.Tensor:
        """This region owner's head words (int64, on the device), all-gathered and read once
        (or carried in its block, :meth:`_allgather_counted`): ``[selected, bad, bad_sum,
        verdict, c_0 … c_{P−1}]``, ``verdict`` 1 when a message it reduced was malformed
        (module doc, 7.), ``c_s`` the selected entries of its region that rank s sent (or
        holds: its own), so every rank knows its own count in the global selection before
        it arrives. ``sources``: ``(rank, indices)`` of every contribution to the region
        ``[lo, hi)`` (indices inside it; ``r_idx``, their sorted union); none: every ``c_s``
        0 (on the CPU's kernels, where each rank counts its own).

        The selection is marked over the region once, and each contribution counts its marks
        by a gather: O(region + entries), no search (a ``searchsorted`` per contribution cost
        Ok-Topk a third of its CPU step at P = 4, n = 4e6, 10 %)."""
        dev = mask.device
        per = torch.zeros(P, dtype=torch.int64, device=dev)
        if len(sources) == 1:  # the region is this contribution alone: no marks
            per[sources[0][0]] = mask.sum()
        elif sources:
            lo, hi = region
            marks = torch.zeros(hi - lo, dtype=torch.bool, device=dev)
            put_at(marks, r_idx - lo if lo else r_idx, mask)
            for s, i in sources:
                if i.numel():  # every rank contributes once
                    local = i - lo if lo else i
                    per[s] = torch.index_select(marks, 0, local).sum()
        head = torch.stack([mask.sum(), bad, bad_sum, verdict]).to(torch.int64)
        return torch.cat([head, per])

    def _target_k(self, sel: SparseGrad, comm: Comm) -> int:
        if self.k is not None:
            return self.k
        if self.density is not None:
            return target_k(sel.numel, self.density)
        c = torch.tensor([len(sel)], dtype=torch.int64, device=sel.device)
        comm.all_reduce(c)
        return max(1, math.ceil(int(c) / comm.size))

    def _split_and_reduce(
        self, sel: SparseGrad, edges: list[int], edges_dev: torch.Tensor, comm: Comm,
        wire: torch.dtype, eb: int, checks: list[tuple[torch.Tensor, str]],
    ) -> tuple[torch.Tensor, torch.Tensor, int, list[tuple[int, torch.Tensor]]]:
        """P−1 steps with destination rotation; buckets of min(bucket, P) messages, each
        reduced while the next is in flight. Returns (indices, values, entries received,
        ``(rank, indices)`` of every contribution); the checks of the peers' entries (sorted,
        inside this rank's region) go to ``checks``. One read: the regions' offsets in the
        selection with the sizes of the messages to receive (at P = 1, none: the one region
        is the whole selection and nothing travels)."""
        P, r, dev = comm.size, comm.rank, sel.device
        if P == 1:
            return sel.indices, sel.values, 0, [(0, sel.indices)]
        off_dev = torch.searchsorted(sel.indices, edges_dev)

        def region(d: int) -> tuple[torch.Tensor, torch.Tensor]:
            return sel.indices[off[d]:off[d + 1]], sel.values[off[d]:off[d + 1]]

        lo, hi = edges[r], edges[r + 1]
        # The counts in the messages (one round) where a receive may be longer than its
        # message: a peer sends at most one entry per position of this rank's region. Every
        # rank decides alike, from the largest region. It costs a read of the counts on
        # arrival, free on the CPU's own kernels; the accelerators' keep one read a step.
        widest = max(b - a for a, b in itertools.pairwise(edges))
        bounded = (host_kernels(sel.indices) and comm.bounded(dev)
                   and COUNT_BYTES + widest * eb <= BOUNDED_MAX)
        # the one read: the offsets, with the counts when they travel first
        off, n_in = (off_dev.tolist(), []) if bounded else self._sizes_first(off_dev, comm)
        own_i, own_v = region(r)
        acc_i, acc_v = own_i, own_v.to(torch.float64)
        sources = [(r, own_i)]

        def post(js: list[int]) -> tuple[list, list]:
            pending, got = [], []
            for j in js:
                src, dst = (r - j) % P, (r + j) % P
                di, dv = region(dst)
                if bounded:  # [count][indices][values], into a buffer of the region's bound
                    buf = torch.empty(COUNT_BYTES + (hi - lo) * eb, dtype=torch.uint8, device=dev)
                    pending.append((comm.irecv_bounded(buf, src), buf))
                    got.append((buf, None, src))
                    msg = pack_entries_counted(di, dv, wire)
                    pending.append((comm.isend(msg, dst), msg))  # keep msg alive until wait
                    continue
                buf = torch.empty(n_in[j - 1] * eb, dtype=torch.uint8, device=dev)
                if buf.numel():
                    pending.append((comm.irecv(buf, src), buf))
                    got.append((buf, n_in[j - 1], src))
                if di.numel():
                    msg = pack_entries(di, dv, wire)
                    pending.append((comm.isend(msg, dst), msg))  # keep msg alive until wait
            return pending, got

        B = min(self.bucket, P)
        buckets = [list(range(s, min(s + B, P))) for s in range(1, P, B)]
        inflight = post(buckets[0])
        for b in range(len(buckets)):
            current = inflight
            if b + 1 < len(buckets):
                inflight = post(buckets[b + 1])  # the next bucket flies while we reduce
            for w, _ in current[0]:
                w.wait()
            if bounded:  # the bucket's counts: one read
                current = (current[0], self._counted(current[1], eb, comm, n_in, checks))
            if current[1]:
                parts = []
                for buf, c, src in current[1]:  # sorted, inside this rank's region: checked
                    i, v = unpack_entries(buf, c, wire, sel.dtype, "oktopk")  # on the device
                    i, v = checked_entries(i, v, hi, lo, checks,
                                           "oktopk: a peer's entries for this rank's region")
                    parts.append((i, v))
                    sources.append((src, i))
                acc_i, acc_v = sparse_sum([(acc_i, acc_v), *parts], torch.float64,
                                          within=(lo, hi))  # its ends known: no read
        return acc_i, acc_v.to(sel.dtype), sum(n_in), sources

    @staticmethod
    def _sizes_first(off_dev: torch.Tensor, comm: Comm) -> tuple[list[int], list[int]]:
        """The counts in a round of their own: step j sends |region (r+j)| to (r+j) and
        receives from (r−j); the sizes go out from the device, and the offsets ``off_dev``
        come back with those received (one read). Returns both."""
        P, r = comm.size, comm.rank
        out_sizes = torch.roll(off_dev[1:] - off_dev[:-1], -(r + 1))[:P - 1]
        in_sizes = torch.empty(P - 1, dtype=torch.int64, device=off_dev.device)
        works = []
        for j in range(1, P):
            works.append(comm.irecv(in_sizes[j - 1:j], (r - j) % P))
            works.append(comm.isend(out_sizes[j - 1:j], (r + j) % P))
        for w in works:
            w.wait()
        both = torch.cat([off_dev, in_sizes]).tolist()
        return both[:P + 1], both[P + 1:]

    @staticmethod
    def _counted(got: list[tuple[torch.Tensor, None, int]], eb: int, comm: Comm,
                 n_in: list[int], checks: list[tuple[torch.Tensor, str]]
                 ) -> list[tuple[torch.Tensor, int, int]]:
        """The bounded messages of a bucket (:meth:`_split_and_reduce`) with the counts they
        carry (one read), each counted as received (and appended to ``n_in``); the empty ones
        dropped. A count its buffer cannot hold fails a check (read by the caller with the
        step's others, so every rank finishes the collective) and its message counts as
        empty."""
        counts = torch.cat([buf[:COUNT_BYTES] for buf, _, _ in got]).view(torch.int64).tolist()
        out = []
        for (buf, _, src), c in zip(got, counts):
            cap = (buf.numel() - COUNT_BYTES) // eb
            if not 0 <= c <= cap:
                checks.append((torch.zeros((), dtype=torch.bool, device=buf.device),
                               f"oktopk: rank {src}'s message announces {c} entries for a "
                               f"region that holds at most {cap}"))
                c = 0
            comm.received(COUNT_BYTES + c * eb)
            n_in.append(c)
            if c:
                out.append((buf[COUNT_BYTES:COUNT_BYTES + c * eb], c, src))
        return out

    def _exact_threshold(self, mags: torch.Tensor, k: int, comm: Comm | None) -> float:
        """θ = the k-th largest magnitude over the union of all ranks' reduced regions; 0.0
        when the union holds fewer than k finite entries or none at all (select everything; k
        is 0 only for an empty tensor, ``target_k(0, density) == 0``). ``comm`` ``None``:
        ``mags`` is the whole union (:meth:`_reduce_pair`), nothing travels.

        Where a rank's k magnitudes fit in :data:`EXACT_GATHER_MAX` bytes, one all-gather
        (ours): each region's k largest (all of them when fewer, padded with −1), whose union
        holds the global top-k, so the k-th largest of what every rank gathers is θ, the same
        value on every rank; one call where the radix select makes :data:`RADIX_ROUNDS`, for
        (P − 1)·4k bytes every τ′ steps. Beyond, the radix select
        (:meth:`_radix_threshold`): its histograms' bytes do not grow with k."""
        if k == 0:
            return 0.0
        finite = mags[torch.isfinite(mags)]
        if comm is None:
            return (float(torch.topk(finite, k, sorted=False).values.min())
                    if finite.numel() >= k else 0.0)
        if exact_threshold_calls(k) > 1:
            return self._radix_threshold(finite, k, comm)
        top = torch.full((k,), -1.0, dtype=torch.float32, device=mags.device)
        c = min(k, finite.numel())
        if c:
            top[:c] = torch.topk(finite, c, sorted=False).values
        union = comm.all_gather(top).view(-1)
        theta = float(torch.topk(union, k, sorted=False).values.min())  # the one read
        return max(theta, 0.0)  # −1: fewer than k finite entries in the union

    def _radix_threshold(self, finite: torch.Tensor, k: int, comm: Comm) -> float:
        """:meth:`_exact_threshold` by radix select on the bit patterns of the ``finite``
        float32 magnitudes (non-negative floats order like their bits): :data:`RADIX_ROUNDS`
        (4) rounds, each one all-reduce of a 256-bin histogram of the next 8 bits among the
        candidates that share the prefix found so far (a gloo call costs the same for 2 KiB
        as for 128 B: docs/results/rounds-cpu.md, so 8 bits a round halve the 4-bit digits'
        8 calls)."""
        bits = finite.contiguous().view(torch.int32).to(torch.int64)
        nbins = 1 << RADIX_BITS
        prefix, remaining = 0, k
        cand = bits
        for shift in range(32 - RADIX_BITS, -1, -RADIX_BITS):
            digit = (cand >> shift) & (nbins - 1)
            hist = bincount(digit, nbins)
            comm.all_reduce(hist)
            h = hist.tolist()  # the counts: one read per round, the digit found on the host
            if shift == 32 - RADIX_BITS and (sum(h) < k or not sum(h)):
                return 0.0
            # candidates with this digit or more
            above = list(itertools.accumulate(reversed(h)))[::-1]
            d = max(i for i in range(nbins) if above[i] >= remaining)
            remaining -= above[d] - h[d]
            prefix |= d << shift
            cand = cand[digit == d]
        return float(torch.tensor([prefix], dtype=torch.int32).view(torch.float32))

    def _balance(
        self, idx: torch.Tensor, val: torch.Tensor, counts: list[int], comm: Comm,
        wire: torch.dtype, eb: int,
    ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Re-distribute the selected entries into P equal contiguous chunks of their
        rank-ordered concatenation (§3.1.2 data balancing): rank r's block covers positions
        [S_r, S_r + c_r); rank d receives [T_d, T_{d+1}), T_d = ⌊d·total/P⌋. Order is kept."""
        P, r, dev = comm.size, comm.rank, idx.device
        total = sum(counts)
        S = [0]
        for c in counts:
            S.append(S[-1] + c)
        T = [d * total // P for d in range(P + 1)]

        def overlap(a0: int, a1: int, b0: int, b1: int) -> tuple[int, int]:
            return max(a0, b0), min(a1, b1)

        works, incoming = [], []
        for s in range(P):  # receive from s the part of its block in my target range
            lo, hi = overlap(S[s], S[s + 1], T[r], T[r + 1])
            if hi > lo and s != r:
                buf = torch.empty((hi - lo) * eb, dtype=torch.uint8, device=dev)
                works.append((comm.irecv(buf, s), buf))
                incoming.append((s, buf, hi - lo))
        for d in range(P):  # send to d the part of my block in its target range
            lo, hi = overlap(S[r], S[r + 1], T[d], T[d + 1])
            if hi > lo and d != r:
                msg = pack_entries(idx[lo - S[r]:hi - S[r]], val[lo - S[r]:hi - S[r]], wire)
                works.append((comm.isend(msg, d), msg))
        for w, _ in works:
            w.wait()
        pieces: dict[int, tuple[torch.Tensor, torch.Tensor]] = {
            s: unpack_entries(buf, c, wire, val.dtype, "oktopk") for s, buf, c in incoming
        }
        lo, hi = overlap(S[r], S[r + 1], T[r], T[r + 1])
        if hi > lo:
            pieces[r] = (idx[lo - S[r]:hi - S[r]], val[lo - S[r]:hi - S[r]])
        order = sorted(pieces)
        if not order:
            return idx[:0], val[:0], [T[d + 1] - T[d] for d in range(P)]
        return (torch.cat([pieces[s][0] for s in order]), torch.cat([pieces[s][1] for s in order]),
                [T[d + 1] - T[d] for d in range(P)])
