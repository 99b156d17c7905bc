"""SparDL: Spar-Reduce-Scatter with global residual collection, then Spar-All-Gather
(Zhao et al., "SparDL: Distributed Deep Learning Training with Efficient Sparse
Communication", ICDE'24, §IV).

SparDL attacks the *sparse gradient accumulation dilemma*: when sparse vectors are added
along a reduce-scatter they fill in, and the volume of later rounds grows towards dense. Its
Spar-Reduce-Scatter (SRS) keeps every round at O(k) by sparsifying again after each addition.

Notation: P ranks, k entries per rank (``k = target_k(numel, density)``, or the largest
local selection when no density is given), P blocks of the index space, block b owned by rank
b, and the per-block budget ``k_B = ⌈k / P⌉``.

1. **Blocks.** The index space is cut into P balanced regions (Ok-Topk's boundary consensus,
   :mod:`gradsync.collectives.regions`, re-evaluated every τ = 64 steps), so that each rank
   holds about k/P of its entries in every block.
2. **Spar-Reduce-Scatter**, S = ⌈log2 P⌉ rounds, for any P (not only powers of two). Let
   ``j = (b − r) mod P`` be block b's distance from rank r. In round s (distance d = 2^s)
   rank r holds the blocks whose j is a multiple of d; it

   * sends to rank (r + d) mod P the held blocks with bit s of j set, each *sparsified* to its
     k_B largest magnitudes (ties: smaller index first),
   * receives from rank (r − d) mod P the blocks that rank forwards — they are at distance
     j − d from r, a multiple of 2d — adds them to its own partial sums (``index_add``) and
     *re-sparsifies* every block it received to k_B.

   A contribution of rank q to block b travels along the binary digits of (b − q) mod P and
   reaches b after S rounds; after the last round rank r holds only block r, summed over every
   rank (what survived), with at most k_B entries. Each round sends at most
   ``k_B · #blocks`` entries, O(k), instead of the fill-in of a plain sparse reduce-scatter.
3. **Spar-All-Gather**: the P reduced blocks (≤ k_B entries each) are all-gathered (exact-size
   all-gather-v of ``[indices][values]``); every rank writes the same owner's bits into
   ``dense``, so ``dense`` is bitwise identical everywhere.

**Global residual collection.** Whatever a round drops — at the sparsification before a send
or the re-sparsification after an addition — must not be lost. In SparDL the dropping worker
adds it to its own residual. gradsync's collective contract returns ``kept``, the local indices
whose value entered ``dense``, and the caller keeps everything else as *this rank's* residual
(docs/architecture.md, "Conservation"); so the collective tells every rank which of its own
entries survived: after the reduce-scatter the rounds are walked backwards and each receiver
returns one bit per entry it received ("still alive at the end"), packed with
:func:`gradsync.formats.wire.pack_bits`. A dropped partial sum thus goes back, contribution by
contribution, into the residuals of the ranks that contributed it: no gradient mass is lost in
any round, and per rank ``accumulated == consumed + residual`` holds exactly. The bits cost
``⌈|R_s| / 8⌉`` bytes per round, where |R_s| is the number of entries received in round s.

Wire, per rank: round s sends one message of a fixed capacity, ``C_s = Σ min(k_B, |block|)``
over the blocks it forwards, which the receiver knows too (the boundaries are agreed):
an int64 count, the ``|T_s|`` entries of ``index_bytes + value bytes`` (int32 indices when
numel < 2**31) and zeros up to ``C_s`` entries (:func:`~gradsync.formats.wire.pack_entries_fixed`).
The reverse walk sends ``⌈|R_s| / 8⌉`` bytes back; the all-gather sends one message of capacity
k_B per rank (ring all-gather). One message per round and one all-gather instead of a count
exchange before every payload and a count all-gather before a ring all-gather-v: P = 4 ranks on
2 cores spent most of a call waiting for those exchanges (1 % density, n = 4e6: 22 of 43 ms).
The padding is counted like any byte sent: a forwarded block holds fewer than k_B entries only
where a rank's selection is thin in it. Every received count is validated on the host (it is
read to size the entries) and every index on the device, without a read: sorted, inside the
tensor, in the blocks the schedule says the sender forwards, at most k_B per block; a bad index
is moved into range with its value zeroed, and the checks go to the caller with the step's
others (``Collective``'s ``CHECKS``), so a malformed message fails its receiver once the
collective is done, not in the middle of a round its peers are waiting in.

**Verdicts in the all-gather (ours).** So that every rank fails such a step with no agreement
round after it: each rank's block in the Spar-All-Gather leads with its verdict, an int64 made
on the device from the checks of its rounds (1 when one failed), and every rank checks every
block's word as it checks its entries (a check on the device, nothing read): "another rank
received a malformed message". Every rank unpacks every block, its own included, so a
malformed block fails every rank; a rank's NaN (``prepare.carry``) ranks above every
magnitude at each re-sparsification and so reaches its block's owner and every rank's sum. A
block corrupted on its way to one rank (a fault of its link) fails that rank only
(docs/usage.md).

Not exact (``exact = False``): with density 1 (k = numel) nothing is ever dropped and the
result is the exact SUM.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from gradsync.collectives import registry
from gradsync.collectives.base import CHECKS, Collective, any_failed
from gradsync.collectives.comm import Comm
from gradsync.collectives.regions import balanced_boundaries, due
from gradsync.formats.wire import (
    COUNT_BYTES,
    fixed_entries_bytes,
    pack_bits,
    pack_entries_fixed,
    packed_bytes,
    unpack_bits,
    unpack_entries_fixed,
    view_as,
    wire_index_dtype,
)
from gradsync.sparsegrad import (
    SparseGrad,
    checked_entries,
    densify,
    flatnonzero,
    isin_sorted,
    sparse_sum,
    target_k,
    top_k_mask,
    validate_density,
)

__all__ = ["SparDL", "capacity", "forwarded", "rounds"]


def rounds(P: int) -> int:
    """S = ⌈log2 P⌉, the number of Spar-Reduce-Scatter rounds (0 for one rank)."""
    return (P - 1).bit_length()


def forwarded(r: int, s: int, P: int) -> list[int]:
    """The blocks rank ``r`` forwards in round ``s``: distance j = (b − r) mod P ≡ 2^s
    (mod 2^(s+1)), the held blocks with bit s of j set."""
    d = 1 << s
    return [(r + j) % P for j in range(d, P, 2 * d)]


def capacity(blocks: list[int], bl: list[int], k_b: int) -> int:
    """Most entries a round's message can hold: k_B per block, or the whole block if smaller
    (``bl``: the boundaries)."""
    return sum(min(k_b, bl[b + 1] - bl[b]) for b in blocks)


class _Blocks(NamedTuple):
    """One call's constants: the block boundaries on the device (``dev``) and as ints
    (``bl``), the per-block budget k_B, the tensor's numel n, the wire's index dtype, the
    values' dtype, and an empty index tensor (made once per call)."""

    dev: torch.Tensor
    bl: list[int]
    k_b: int
    n: int
    wire: torch.dtype
    dtype: torch.dtype
    empty: torch.Tensor


def _segments(i: torch.Tensor, B_dev: torch.Tensor) -> list[int]:
    """Block b's entries are ``i[cuts[b]:cuts[b + 1]]`` (``i`` sorted; blocks are contiguous
    index ranges): P + 1 binary searches instead of one per entry."""
    return torch.searchsorted(i, B_dev).tolist()


def _top(v: torch.Tensor, a: int, b: int, k_b: int) -> torch.Tensor:
    """Positions in ``[a, b)`` of the k_B largest ``|v|`` there (all if at most k_B)."""
    if b - a <= k_b:
        return torch.arange(a, b, device=v.device)
    return flatnonzero(top_k_mask(v[a:b], k_b)) + a


@registry.register("spardl")
class SparDL(Collective):
    """SparDL's Spar-Reduce-Scatter + Spar-All-Gather for any P (module doc).

    Args:
        density: k = ``target_k(numel, density)`` entries per rank (the engine passes
            ``Config.density``).
        k: k directly, instead of ``density``. With neither, k is the largest local selection
            (one 8-byte MAX all-reduce per call).
        tau: steps between re-evaluations of the block boundaries (τ).
    """

    exact = False

    def __init__(self, density: float | None = None, k: int | None = None, *, tau: int = 64,
                 check_shapes: bool | str = True) -> None:
        super().__init__(check_shapes=check_shapes)
        if density is not None and k is not None:
            raise ValueError("spardl: give density or k, not both")
        if density is not None:
            density = validate_density(density, "spardl: density")
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
            raise ValueError(f"spardl: k must be an int >= 0, got {k!r}")
        if isinstance(tau, bool) or not isinstance(tau, int) or tau < 1:
            raise ValueError(f"spardl: tau must be an int >= 1, got {tau!r}")
        self.density, self.k, self.tau = density, k, tau
        # (numel, P) → (step of the last evaluation, boundaries B[0..P])
        self._bounds: dict[tuple[int, int], tuple[int, torch.Tensor]] = {}

    def __repr__(self) -> str:
        return f"SparDL(density={self.density}, k={self.k}, tau={self.tau})"

    # -- k and blocks ----------------------------------------------------------------------
    def _target_k(self, sel: SparseGrad, comm: Comm) -> int:
        if self.k is not None:
            return self.k
        if self.density is not None:
            return target_k(sel.numel, self.density)
        word = torch.tensor([len(sel)], dtype=torch.int64, device=sel.device)
        comm.all_reduce(word, op=dist.ReduceOp.MAX)
        return int(word)

    def _blocks(self, sel: SparseGrad, comm: Comm, step: int) -> tuple[torch.Tensor, bool]:
        key = (sel.numel, comm.size)
        held = self._bounds.get(key)
        if held is not None and not due(step, held[0], self.tau):
            return held[1], False
        bounds = balanced_boundaries(sel.indices, sel.numel, comm.size, comm)
        self._bounds[key] = (step, bounds)
        return bounds, True

    def alike(self, sel: SparseGrad, group: dist.ProcessGroup | None = None) -> bool:
        """Always: the verdicts travel in the all-gather (module doc)."""
        return True

    # -- the algorithm ---------------------------------------------------------------------
    def _reduce(
        self, sel: SparseGrad, comm: Comm, step: int
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        P, n = comm.size, sel.numel
        if P == 1:
            return sel.to_dense(), sel.indices, {"rounds": 0, "dropped": 0}
        dev, dtype = sel.device, sel.dtype
        k = self._target_k(sel, comm)
        k_b = math.ceil(k / P)
        B, recomputed = self._blocks(sel, comm, step)
        B_dev, bl = B.to(dev), B.tolist()
        blk = _Blocks(B_dev, bl, k_b, n, wire_index_dtype(n), dtype,
                      torch.empty(0, dtype=torch.int64, device=dev))
        checks: list[tuple[torch.Tensor, str]] = []  # the received messages', on the device
        # 2. Spar-Reduce-Scatter: this rank's block, summed, at most k_B entries
        idx, val, history = self._spar_reduce_scatter(sel, comm, blk, checks)
        # Global residual collection: which of this rank's entries reached a final block
        kept = self._collect_residual(idx, history, comm)
        # 3. Spar-All-Gather of the reduced blocks
        dense, counts = self._spar_all_gather(idx, val, comm, blk, checks)
        info = {"k": k, "k_block": k_b, "rounds": len(history), "boundaries": B,
                "boundaries_recomputed": recomputed, "block_nnz": idx.numel(),
                "global_nnz": sum(counts), "dropped": len(sel) - kept.numel(),
                "sent_per_round": [h["sent"].numel() for h in history], CHECKS: checks}
        return dense, kept, info

    def _spar_reduce_scatter(
        self, sel: SparseGrad, comm: Comm, blk: _Blocks, checks: list[tuple[torch.Tensor, str]],
    ) -> tuple[torch.Tensor, torch.Tensor, list[dict[str, torch.Tensor]]]:
        """Spar-Reduce-Scatter (module doc, 2.): S = ⌈log2 P⌉ rounds from the selection to
        this rank's reduced block. Returns its (indices, values) and, per round, what the
        backward walk of the residual collection needs."""
        idx, val = sel.indices, sel.values  # the partial sums this rank holds, index order
        history: list[dict[str, torch.Tensor]] = []
        for s in range(rounds(comm.size)):
            idx, val, h = self._srs_round(idx, val, s, comm, blk, checks)
            history.append(h)
        return idx, val, history

    def _srs_round(
        self, idx: torch.Tensor, val: torch.Tensor, s: int, comm: Comm, blk: _Blocks,
        checks: list[tuple[torch.Tensor, str]],
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """Round ``s`` (distance d = 2^s) of Spar-Reduce-Scatter on the partial sums
        ``(idx, val)``: forward the blocks whose distance j = (b − r) mod P has bit s set,
        each sparsified to k_B, keep the others whole (block order = index order), add what
        rank r − d forwards, and re-sparsify every block this round delivered to. Returns the
        new partial sums and the round's history entry."""
        P, r, d = comm.size, comm.rank, 1 << s
        fwd, kp = self._split_blocks(idx, val, r, d, P, blk)
        t_idx, t_val = torch.index_select(idx, 0, fwd), torch.index_select(val, 0, fwd)
        k_idx, k_val = torch.index_select(idx, 0, kp), torch.index_select(val, 0, kp)
        # one message of the round's fixed capacity: count, entries, padding
        cap = capacity(forwarded(r, s, P), blk.bl, blk.k_b)
        r_idx, r_val = self._receive(comm, pack_entries_fixed(t_idx, t_val, blk.wire, cap), s,
                                     blk.dev, blk.bl, blk.k_b, blk.n, blk.wire, blk.dtype,
                                     checks)
        # add, then re-sparsify every block this round delivered to (the sum's indices
        # are sorted whatever a malformed message held)
        m_idx, m_val = sparse_sum([(k_idx, k_val), (r_idx, r_val)], within=(0, blk.n))
        keep = self._resparsify(m_idx, m_val, r, d, P, blk)
        h = {"state": idx, "fwd": fwd, "kp": kp, "sent": t_idx, "kept_part": k_idx,
             "recv": r_idx}
        if keep is None:
            return m_idx, m_val, h
        at = flatnonzero(keep)
        return torch.index_select(m_idx, 0, at), torch.index_select(m_val, 0, at), h

    @staticmethod
    def _split_blocks(idx: torch.Tensor, val: torch.Tensor, r: int, d: int, P: int,
                     blk: _Blocks) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions in ``idx`` of the entries rank ``r`` forwards at distance ``d`` (its
        nonempty blocks at a distance j = (b − r) mod P ≡ d mod 2d, each to its k_B largest
        ``|val|``) and of those it keeps (j ≡ 0 mod 2d, whole). Entries in a block it does not
        hold (j not a multiple of d) can only come from a malformed message, whose check
        fails the step: they are dropped, so every message's fixed capacity holds whatever
        arrived."""
        cuts = _segments(idx, blk.dev)
        fwd_p, kp_p = [], []
        for b in range(P):
            j = (b - r) % P
            if cuts[b + 1] > cuts[b]:
                if j % (2 * d) == d:
                    fwd_p.append(_top(val, cuts[b], cuts[b + 1], blk.k_b))
                elif j % (2 * d) == 0:
                    kp_p.append(torch.arange(cuts[b], cuts[b + 1], device=val.device))
        fwd = torch.cat(fwd_p) if fwd_p else blk.empty
        kp = torch.cat(kp_p) if kp_p else blk.empty
        return fwd, kp

    @staticmethod
    def _resparsify(m_idx: torch.Tensor, m_val: torch.Tensor, r: int, d: int, P: int,
                    blk: _Blocks) -> torch.Tensor | None:
        """The mask over the merged entries that keeps the k_B largest ``|m_val|`` of every
        block this round delivered to (distance j a multiple of 2d, with j + d < P) holding
        more than k_B; ``None`` when no block needs it (keep everything)."""
        cuts = _segments(m_idx, blk.dev)
        keep = None
        for b in range(P):
            j = (b - r) % P
            if j % (2 * d) == 0 and j + d < P and cuts[b + 1] - cuts[b] > blk.k_b:
                if keep is None:
                    keep = torch.ones(m_idx.numel(), dtype=torch.bool, device=m_idx.device)
                keep[cuts[b]:cuts[b + 1]] = top_k_mask(m_val[cuts[b]:cuts[b + 1]], blk.k_b)
        return keep

    @staticmethod
    def _collect_residual(idx: torch.Tensor, history: list[dict[str, torch.Tensor]],
                          comm: Comm) -> torch.Tensor:
        """Global residual collection (module doc): walk the rounds backwards; an entry is
        alive when it reached the owner's final block. ``alive`` is the set of live indices
        in the state after round s (a subset of that round's merged entries); each receiver
        returns one bit per entry it received. Returns the live entries of the state before
        round 0, i.e. this rank's ``kept`` (sel.indices that entered ``dense``)."""
        P, r, dev = comm.size, comm.rank, idx.device
        alive = idx
        for s in reversed(range(len(history))):
            d = 1 << s
            dst, src = (r + d) % P, (r - d) % P
            h = history[s]
            recv_alive = isin_sorted(h["recv"], alive)
            bits = torch.empty(packed_bytes(h["sent"].numel(), 1), dtype=torch.uint8,
                               device=dev)
            comm.sendrecv(pack_bits(recv_alive), src, bits, dst)
            sent_alive = unpack_bits(bits, h["sent"].numel()) > 0
            live = torch.zeros(h["state"].numel(), dtype=torch.bool, device=dev)
            live.index_copy_(0, h["kp"], isin_sorted(h["kept_part"], alive))
            live.index_copy_(0, h["fwd"], sent_alive)
            alive = torch.index_select(h["state"], 0, flatnonzero(live))  # index order
        return alive

    @staticmethod
    def _spar_all_gather(idx: torch.Tensor, val: torch.Tensor, comm: Comm, blk: _Blocks,
                         checks: list[tuple[torch.Tensor, str]]) -> tuple[torch.Tensor, list[int]]:
        """Spar-All-Gather (module doc, 3.): the reduced blocks hold at most k_B entries each,
        so one all-gather of a fixed capacity (no counts first), each block led by its owner's
        verdict (module doc, "Verdicts in the all-gather"); each block checked against its
        owner's range, its own too. Returns ``dense`` and the entries per block."""
        cap = blk.k_b  # the same on every rank
        verdict = any_failed(checks, idx.device).to(torch.int64).reshape(1).view(torch.uint8)
        msgs = comm.all_gather(torch.cat([verdict,
                                          pack_entries_fixed(idx, val, blk.wire, cap)]))
        words = torch.cat([view_as(m, 0, 1, torch.int64) for m in msgs])
        checks.append(((words == 0).all(), "spardl: another rank received a malformed message "
                                           "(its error names the check)"))
        parts = []
        for owner in range(comm.size):
            what = f"spardl: block of rank {owner}"
            g_idx, g_val = unpack_entries_fixed(msgs[owner][COUNT_BYTES:], cap, blk.wire,
                                                blk.dtype, what)
            parts.append(checked_entries(g_idx, g_val, blk.bl[owner + 1], blk.bl[owner], checks,
                                         what))
        # blocks are disjoint: one writer per index
        dense = densify(parts, blk.n, blk.dtype, idx.device)
        return dense, [p[0].numel() for p in parts]

    @staticmethod
    def _receive(comm: Comm, payload: torch.Tensor, s: int, B: torch.Tensor, bl: list[int],
                 k_b: int, n: int, wire: torch.dtype, dtype: torch.dtype,
                 checks: list[tuple[torch.Tensor, str]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Round ``s``: send ``payload`` to rank r + 2^s while receiving the fixed-capacity
        message of rank r − 2^s, checked on the device against the blocks the schedule lets
        that rank forward (``B``: the block boundaries on the payload's device, ``bl`` as a
        list): the checks go to ``checks``, a bad index is moved into range with its value
        zeroed, and nothing is read."""
        P, r, d = comm.size, comm.rank, 1 << s
        src = (r - d) % P
        blocks = forwarded(src, s, P)  # the same as [(r + j) % P for j = 0, 2d, … < P − d]
        cap = capacity(blocks, bl, k_b)
        buf = torch.empty(fixed_entries_bytes(cap, wire, dtype), dtype=torch.uint8,
                          device=payload.device)
        comm.sendrecv(payload, (r + d) % P, buf, src)
        what = f"spardl: round {s} from rank {src}"
        r_idx, r_val = checked_entries(*unpack_entries_fixed(buf, cap, wire, dtype, what), n, 0,
                                       checks, what)
        # per block, how many received entries fall in it: only forwarded blocks, at most
        # k_B in each
        per_block = torch.diff(torch.searchsorted(r_idx, B))
        allowed = torch.zeros(P, dtype=torch.bool)
        allowed[blocks] = True
        allowed = allowed.to(per_block.device)
        checks.append(((per_block[~allowed] == 0).all(),
                       f"spardl: rank {src} sent indices outside the blocks it forwards in "
                       f"round {s} (it forwards {blocks[:5]})"))
        checks.append(((per_block <= k_b).all(), f"spardl: rank {src} sent more than k_B = "
                                                 f"{k_b} entries of a block in round {s}"))
        return r_idx, r_val

    # -- state ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"tau": self.tau,
                "boundaries": [{"numel": n, "regions": p, "step": s, "bounds": b.clone()}
                               for (n, p), (s, b) in sorted(self._bounds.items())]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if set(state) != {"tau", "boundaries"}:
            raise ValueError(f"spardl: unexpected state keys {sorted(state)}")
        if int(state["tau"]) != self.tau:
            raise ValueError(f"spardl: state saved with tau={state['tau']}, this collective "
                             f"has tau={self.tau}")
        loaded: dict[tuple[int, int], tuple[int, torch.Tensor]] = {}
        for e in state["boundaries"]:
            n, p, b = int(e["numel"]), int(e["regions"]), e["bounds"].to(torch.int64)
            if b.shape != (p + 1,) or int(b[0]) != 0 or int(b[-1]) != n or bool(
                    (b[1:] < b[:-1]).any()):
                raise ValueError(f"spardl: bad saved boundaries for numel={n}, P={p}")
            loaded[(n, p)] = (int(e["step"]), b.clone())
        self._bounds = loaded
