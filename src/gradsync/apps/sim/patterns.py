"""Communication patterns of the collectives, step by step, under the α-β model.

Ok-Topk §2 / §3.1 and Table 1, DenseStream §III-B (Eq. 4–6), SparCML's DSA as Ok-Topk describes
it, SSFusion §IV-A Eq. 3 / Eq. 4. Each function returns the *steps* one rank goes through: a
step is ``Step(messages, nbytes)`` — ``messages`` start-ups (each costs α) and ``nbytes`` on the
busiest direction of the busiest rank in that step (each byte costs β; links are bidirectional
and direct, the papers' assumption, so a step that sends and receives the same amount costs
``α + β·nbytes``). Then

    T = Σ_steps (messages·α + nbytes·β)            (comm_time)
    volume = Σ_steps nbytes                        (Table 1's bandwidth column, in bytes)

Notation: n gradient elements, k entries selected per rank (k = d·n), P ranks,
P′ = 2^⌊log2 P⌋, K bytes per value, E = index_bytes + K bytes per COO entry (Table 1's
"2 words per entry" with 4-byte words and fp32), u(m) the union density of m ranks'
selections (:func:`union_density`).

=============  ===========================================================  =================
collective     steps                                                        Table 1 volume
=============  ===========================================================  =================
dense (ring)   2(P−1) steps of n/P values (Eq. 4)                           2n(P−1)/P
topka          P−1 steps of k entries (ring all-gather, Eq. 3; on gloo      2k(P−1)
               ⌈log2 P⌉ doubling steps from P = 4)
topkdsa        log2 P′ halving steps: half the current range at density     [4k(P−1)/P,
               u(2^(s−1)), COO or dense, whichever is smaller (fill-in);     (2k+n)(P−1)/P]
               log2 P′ doubling steps of 2^t regions at density u(P)
gtopk          log2 P′ reduction rounds + log2 P′ broadcast rounds of k     4k·log2 P
               entries (the root's link)
oktopk         split and reduce: P−1 steps of k/P entries (balanced          [2k(P−1)/P,
               regions, destination rotation); balance: P−1 steps of k/P     6k(P−1)/P]
               (only when imbalanced); allgatherv of the k global entries:
               ⌈log2 P⌉ doubling steps; + amortised boundary / threshold
               re-evaluation (every τ = 64 / τ′ = 32 steps)
densestream    like topkdsa with balanced regions and every partition        [2k(P−1)/P entries,
               DenseStream-encoded (dense blocks; :func:`densestream_entry   Eq. 6 upper bound]
               _bytes`)
spardl         ⌈log2 P⌉ Spar-Reduce-Scatter rounds of ≤ k/P entries per     ≤ 4k(P−1)/P
               forwarded block, survival bits back, ring all-gather of the   (+ 1 bit per
               P reduced blocks                                             SRS entry)
=============  ===========================================================  =================

Latency terms: two implementations (:data:`IMPLEMENTATIONS`), the same bytes.

* ``"papers"`` (``report cluster``, which predicts the papers' experiments): Dense and TopkA as
  the ring algorithms (Eq. 3 / Eq. 4, what the fusion planners assume), so their α terms are
  2(P−1) and P−1 rather than Table 1's 2·log2 P (Rabenseifner) and log2 P (recursive
  doubling); TopkDSA as recursive halving/doubling (2·log2 P′ start-ups; Table 1 lists
  (P + 2 log P)α for SparCML's variant); Ok-Topk's counts all-gathered apart; :func:`work`
  charges every call a shape check and TopkA a counts all-gather.
* ``"gloo"`` (default: ``simulate`` and ``simulate --validate``, which run gradsync on gloo):
  the messages gradsync's collectives send there in the engine's steady state, counted in real
  calls at P = 2, 3, 4 and 8 (tests/test_sim_messages.py). Its all-gathers take Bruck's
  doubling from P = 4 (⌈log2 P⌉ messages, ``Comm``'s rounds); fixed-capacity selections need no
  counts; a buffer's description is agreed once, not every call; the count word ahead of a
  TopkDSA or gTop-k message is a message of its own; Ok-Topk and DenseStream make one exchange
  at P = 2, and Ok-Topk's counts travel inside its messages up to P = 4; TopkDSA's step
  all-reduces the engine's agreement word (:data:`AGREEMENT`).

Dense's ring all-reduce is Eq. 4 in both (gloo's own algorithm may differ, as ``Comm`` counts
it). gTop-k's one-bit-per-entry "kept" mask is not modelled.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gradsync import sparsify
from gradsync.collectives.comm import gather_rounds
from gradsync.collectives.densestream import fits_one_round
from gradsync.collectives.oktopk import counts_fit_inline, exact_threshold_calls, pair_fits
from gradsync.engine.config import Config
from gradsync.formats.wire import COUNT_BYTES
from gradsync.schedule import schemes

__all__ = [
    "AGREEMENT",
    "COLLECTIVES",
    "IMPLEMENTATIONS",
    "Step",
    "collective_of",
    "comm_time",
    "dense_ring",
    "densestream",
    "densestream_entry_bytes",
    "fixed_capacity",
    "gaussiank",
    "gtopk",
    "oktopk",
    "pattern",
    "spardl",
    "topka",
    "topkdsa",
    "union_density",
    "volume",
    "work",
]

#: ``"gloo"``: the messages gradsync's collectives send on gloo, as the engine calls them
#: (tests/test_sim_messages.py counts them in real calls at P = 2, 3, 4 and 8); ``"papers"``:
#: the papers' algorithms (rings, counts exchanged apart), what ``report cluster`` prices
IMPLEMENTATIONS = ("gloo", "papers")
#: the collectives whose result does not show a rank's NaN alike on every rank
#: (``Collective.alike`` False): the engine's step all-reduces one agreement word for them
AGREEMENT = ("topkdsa",)
HEADER_BYTES = 8  # a selection's count word: Gaussian-k's, all-gathered before its entries
TAU = 64  # Ok-Topk / DenseStream region re-evaluation period τ
TAU_PRIME = 32  # Ok-Topk threshold re-evaluation period τ′


@dataclass(frozen=True)
class Step:
    """One step of a collective on one rank: start-ups (α each) and bytes (β each);
    ``control``: counts or heads, not entries (no merge or codec: :func:`work`); ``calls``:
    the torch.distributed calls it makes (None: one per message; a small all-reduce is one
    call of 2⌈log2 P⌉ start-ups)."""

    messages: float
    nbytes: float
    control: bool = False
    calls: float | None = None

    @property
    def dist_calls(self) -> float:
        return self.messages if self.calls is None else self.calls


def comm_time(steps: list[Step], alpha: float, beta: float) -> float:
    """``Σ (messages·α + nbytes·β)`` seconds."""
    return sum(s.messages * alpha + s.nbytes * beta for s in steps)


def volume(steps: list[Step]) -> float:
    """Bytes on the busiest direction of the busiest rank, summed over steps."""
    return sum(s.nbytes for s in steps)


def _check(P: int, n: int, k: int) -> None:
    if isinstance(P, bool) or int(P) != P or P < 1:
        raise ValueError(f"P must be a positive integer, got {P!r}")
    if int(n) != n or n < 0:
        raise ValueError(f"n must be an integer >= 0, got {n!r}")
    if int(k) != k or not 0 <= k <= n:
        raise ValueError(f"k must be an integer in [0, n={n}], got {k!r}")


def union_density(d: float, m: float, gamma: float = 1.0) -> float:
    """Density of the union of m ranks' selections at density d each.

    ``u(m) = 1 − (1 − d)^(m^γ)``: γ = 1 is independent positions (every rank picks its entries
    as if at random — the fill-in of TopkDSA after s halving steps is then 1 − (1 − d)^(2^s));
    γ = 0 is full overlap (u = d, Ok-Topk's best case); in between, ranks agree partly, as real
    gradients do. γ is the parameter the simulator exposes (``--union-gamma``).
    """
    if not 0.0 <= d <= 1.0:
        raise ValueError(f"density must be in [0, 1], got {d!r}")
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma!r}")
    if m < 1:
        raise ValueError(f"m must be >= 1, got {m!r}")
    if d >= 1.0:
        return 1.0
    return 1.0 - (1.0 - d) ** (m**gamma)


Union = Callable[[float], float]  # m ranks → union density


def densestream_entry_bytes(rho: float, value_bytes: int = 4, index_bytes: int = 4) -> float:
    """Expected DenseStream bytes per nonzero of a stream whose nonzeros sit independently at
    density ρ (DenseStream §III-A, gap rule Z = ⌊2·index_bytes/K⌋ zeros).

    A nonzero preceded by g zeros (probability ρ(1−ρ)^g) joins the previous block when g ≤ Z
    (it costs its value and the g zeros, K·(g + 1)) and opens a block otherwise (a start and a
    length, 2·index_bytes, plus K). ρ → 0 gives 2·index_bytes + K (one block per nonzero: the
    Eq. 3 lower bound the paper calls "close to key-value"), ρ = 1 gives K (dense).
    """
    if not 0.0 <= rho <= 1.0:
        raise ValueError(f"rho must be in [0, 1], got {rho!r}")
    from gradsync.formats.densestream import max_zero_run

    K = value_bytes
    Z = max_zero_run(index_bytes, value_bytes)
    joined = sum(rho * (1 - rho) ** g * g * K for g in range(Z + 1))
    return K + joined + (1 - rho) ** (Z + 1) * 2 * index_bytes


# ---------------------------------------------------------------------------------------------
# The collectives
# ---------------------------------------------------------------------------------------------
def dense_ring(P: int, n: int, value_bytes: int = 4) -> list[Step]:
    """Ring all-reduce (SSFusion Eq. 4): reduce-scatter then all-gather, 2(P−1) steps of n/P."""
    _check(P, n, 0)
    return [Step(1, n / P * value_bytes) for _ in range(2 * (P - 1))]


def _implementation(implementation: str) -> None:
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got "
                         f"{implementation!r}")


def _rounds(P: int, block: float, control: bool = False) -> list[Step]:
    """A gloo all-gather of P blocks of ``block`` bytes in gradsync's rounds
    (:func:`gradsync.collectives.comm.gather_rounds`: Bruck's doubling from P = 4, else the
    ring), one message a round."""
    return [Step(1, b * block, control) for b in gather_rounds(P, block)]


def topka(P: int, n: int, k: int, value_bytes: int = 4, index_bytes: int = 4,
          implementation: str = "gloo") -> list[Step]:
    """TopkA (Ok-Topk §2): all-gather of every rank's k COO entries (Eq. 3). ``"papers"``:
    the ring, P − 1 steps; ``"gloo"``: gradsync's rounds (:func:`_rounds`), the same bytes in
    ⌈log2 P⌉ messages from P = 4 (fixed capacity: no counts first)."""
    _check(P, n, k)
    _implementation(implementation)
    block = k * (index_bytes + value_bytes)
    if implementation == "gloo":
        return _rounds(P, block)
    return [Step(1, block) for _ in range(P - 1)]


def gaussiank(P: int, n: int, k: int, value_bytes: int = 4, index_bytes: int = 4,
              implementation: str = "gloo") -> list[Step]:
    """Gaussian-k: TopkA's all-gather of selections whose sizes vary, so on gloo each rank's
    count goes first in rounds of its own (one 8-byte word per rank), then the entries in
    exact-size rounds (``Comm.all_gather_v``); ``"papers"``: TopkA's ring."""
    if implementation != "gloo":
        return topka(P, n, k, value_bytes, index_bytes, implementation)
    _check(P, n, k)
    return _rounds(P, HEADER_BYTES, True) + _rounds(P, k * (index_bytes + value_bytes))


def _sparse_or_dense(span: float, rho: float, entry: float, value_bytes: int) -> float:
    """Bytes of a stream over ``span`` elements at density ρ: COO, or dense when smaller."""
    return min(span * rho * entry, span * value_bytes)


def topkdsa(P: int, n: int, k: int, union: Union, value_bytes: int = 4,
            index_bytes: int = 4, implementation: str = "gloo") -> list[Step]:
    """TopkDSA (SparCML's dynamic sparse allreduce, Ok-Topk §2): recursive halving then
    recursive doubling on COO streams that switch to dense when COO would be larger.

    Before halving step s (s = 1 … log2 P′) a rank's stream is the union of 2^(s−1) ranks'
    selections (density ``union(2^(s−1))``); it sends the half of its range its partner keeps,
    n/2^s elements. The doubling steps send 2^t reduced regions of n/P′ at density
    ``union(P)``. With P ≠ P′ the extra ranks fold in (k entries) and out (the result) first and
    last. On gloo every step's stream is announced by a count word first: two messages a step.
    """
    _check(P, n, k)
    _implementation(implementation)
    if P == 1:
        return []
    E, K = index_bytes + value_bytes, value_bytes
    a = 2 if implementation == "gloo" else 1  # the count word, then the stream
    m = int(P).bit_length() - 1  # log2 P′
    Pp = 2**m
    steps: list[Step] = []
    if Pp != P:
        steps.append(Step(a, min(k * E, n * K)))
    for s in range(1, m + 1):
        steps.append(Step(a, _sparse_or_dense(n / 2**s, union(2 ** (s - 1)), E, K)))
    for t in range(m):
        steps.append(Step(a, _sparse_or_dense(2**t * n / Pp, union(P), E, K)))
    if Pp != P:
        steps.append(Step(a, _sparse_or_dense(n, union(P), E, K)))
    return steps


def gtopk(P: int, n: int, k: int, value_bytes: int = 4, index_bytes: int = 4,
          implementation: str = "gloo") -> list[Step]:
    """gTop-k (Ok-Topk §2, Shi et al.): log2 P′ reduction rounds then log2 P′ broadcast
    rounds; on the root's link every round carries k entries (Table 1: 4k·log2 P words). On
    gloo a header (the entry count) goes ahead of each round's entries: two messages a round.
    """
    _check(P, n, k)
    _implementation(implementation)
    if P == 1:
        return []
    E = index_bytes + value_bytes
    m = int(P).bit_length() - 1  # log2 P′
    fold = 1 if 2**m != P else 0
    a = 2 if implementation == "gloo" else 1
    return [Step(a, k * E) for _ in range(2 * m + 2 * fold)]


def oktopk(P: int, n: int, k: int, value_bytes: int = 4, index_bytes: int = 4, *,
           outside: float | None = None, balance: bool = False,
           amortised: bool = True, exact_rate: float | None = None,
           implementation: str = "gloo") -> list[Step]:
    """Ok-Topk's O(k) sparse allreduce (§3.1, Eq. 1–3, Algorithm 1).

    * split and reduce (Eq. 1): P−1 steps with destination rotation; a rank sends the local
      entries of the other ranks' regions, a fraction ``outside`` of its k (balanced regions:
      (P−1)/P, so k/P per step: ``(P−1)α + 2k(P−1)/P β``; 0 in Theorem 3.1's best case);
    * counts all-gather (⌈log2 P⌉ start-ups, P integers);
    * data balancing (only when the largest rank holds > 4× the average; ``balance=True`` models
      the worst case of Eq. 2, all k global entries on one rank: P−1 steps of k/P);
    * allgatherv of the k global top-k entries by recursive doubling: ⌈log2 P⌉ steps,
      k(P−1)/P entries in all;
    * ``amortised``: the region boundaries (one all-reduce of P numbers every τ = 64 steps) and
      the exact threshold as fractional start-ups, each call priced as a small all-reduce
      (the collective's ``exact_threshold_calls(k)``: one all-gather of k magnitudes, or for
      large k the radix select's all-reduces; the bytes of either are not modelled):
      ``exact_rate`` of the steps compute θ exactly, by default 1/τ′ (every τ′ = 32 steps, the
      paper's reuse, the collective's default). With ``OkTopk(recompute_band=…)`` it also
      recomputes θ when a reused one admits a count outside the band; with (2/3, 4/3) on the
      CNN that happened in 15 of 25 steps at P = 2 and 23 of 25 at P = 4, so ``simulate
      --validate`` passes the rate it measured.

    Volume: 2k(P−1)/P (outside = 0) … 4k(P−1)/P (balanced) … 6k(P−1)/P (+ balancing) words.

    ``implementation="gloo"``: what gradsync's collective sends there. At P = 2 one exchange
    of each rank's k entries, θ computed locally (``OkTopk._pair``); up to P = 4, where no
    balancing can run, the counts travel ahead of each message (``OkTopk._counts_inline``: no
    counts all-gather); the allgatherv in gradsync's rounds (:func:`_rounds`). Each where a
    bounded receive fits (``oktopk.pair_fits``, ``counts_fit_inline``), as the code decides.
    """
    _check(P, n, k)
    _implementation(implementation)
    if P == 1:
        return []
    E = index_bytes + value_bytes
    gloo = implementation == "gloo"
    if gloo and pair_fits(P, n, E):
        return [Step(1, k * E)]
    if outside is None:
        outside = (P - 1) / P
    if not 0.0 <= outside <= 1.0:
        raise ValueError(f"outside must be in [0, 1], got {outside!r}")
    steps = [Step(1, k * outside / (P - 1) * E) for _ in range(P - 1)]  # split and reduce
    lg = (int(P) - 1).bit_length()  # ⌈log2 P⌉
    inline = gloo and not balance and counts_fit_inline(P, n / P, E)
    if gloo and not inline:
        steps += _rounds(P, (4 + P) * COUNT_BYTES, True)  # the heads (counts, flags)
    elif not gloo:
        steps += [Step(1, min(2**t, P - 2**t) * 8, True) for t in range(lg)]  # counts
    if balance:
        steps += [Step(1, k / P * E) for _ in range(P - 1)]
    if gloo:
        steps += _rounds(P, k / P * E)  # allgatherv
    else:
        steps += [Step(1, min(2**t, P - 2**t) * k / P * E) for t in range(lg)]  # allgatherv
    if exact_rate is None:
        exact_rate = 1 / TAU_PRIME
    if not 0.0 <= exact_rate <= 1.0:
        raise ValueError(f"exact_rate must be in [0, 1], got {exact_rate!r}")
    if amortised:
        ar = 2 * lg  # start-ups of one small all-reduce
        calls = exact_threshold_calls(k)
        steps.append(Step(ar / TAU, 0.0, calls=1 / TAU))  # the boundaries' all-reduce
        if gloo and calls == 1:  # θ from one all-gather of k magnitudes, gradsync's rounds
            steps.append(Step(len(gather_rounds(P, 4 * k)) * exact_rate, 0.0))
        else:  # an all-gather priced as a small all-reduce, or the radix select's all-reduces
            steps.append(Step(calls * ar * exact_rate, 0.0, calls=calls * exact_rate))
    return steps


def densestream(P: int, n: int, k: int, union: Union, value_bytes: int = 4,
                index_bytes: int = 4, *, ratio: float | None = None,
                amortised: bool = True, implementation: str = "gloo") -> list[Step]:
    """DenseStream allreduce (DenseStream §III-B, Eq. 4–6): balanced split, recursive-halving
    scatter-reduce, recursive-doubling all-gather, every partition DenseStream-encoded.

    With balanced regions every partition holds k/P′ of each rank's entries over n/P′ elements,
    so a partition that has summed m ranks has density ``union(m)``. Halving step s sends P′/2^s
    partitions (n/2^s elements) at density ``union(2^(s−1))``; doubling step t sends 2^t regions
    at ``union(P)``. Bytes per nonzero: :func:`densestream_entry_bytes` at that density, or
    ``ratio``·E when a measured DenseStream/COO size ratio (Table I) is given; never more than
    the dense span plus one block header.

    ``implementation="gloo"``: what gradsync's collective sends there. Each exchange is one
    message where a receive of its span's longest encoding fits
    a bounded receive (``densestream.fits_one_round``; the announcement travels in it),
    else two (the announcement first); at P = 2 the whole selection in one exchange
    (``DenseStreamAllreduce._reduce_pair``), where that bound allows.
    """
    _check(P, n, k)
    _implementation(implementation)
    if P == 1:
        return []
    E, K = index_bytes + value_bytes, value_bytes
    if ratio is not None and not ratio > 0:
        raise ValueError(f"ratio must be > 0, got {ratio!r}")

    def size(span: float, rho: float) -> float:
        per = ratio * E if ratio is not None else densestream_entry_bytes(rho, K, index_bytes)
        return min(span * rho * per, span * K + 2 * index_bytes)

    def step(span: float, rho: float) -> Step:
        one = implementation != "gloo" or fits_one_round([[(0, span)]], index_bytes, K)
        return Step(1 if one else 2, size(span, rho))

    if implementation == "gloo" and P == 2 and fits_one_round([[(0, n)]], index_bytes, K):
        return [step(n, k / n if n else 0.0)]
    m = int(P).bit_length() - 1  # log2 P′
    Pp = 2**m
    steps: list[Step] = []
    if Pp != P:
        steps.append(step(n, k / n if n else 0.0))
    for s in range(1, m + 1):
        steps.append(step(n / 2**s, union(2 ** (s - 1))))
    for t in range(m):
        steps.append(step(2**t * n / Pp, union(P)))
    if Pp != P:
        steps.append(step(n, union(P)))
    if amortised:
        steps.append(Step(2 * m / TAU, 0.0, calls=1 / TAU))
    return steps


def spardl(P: int, n: int, k: int, value_bytes: int = 4, index_bytes: int = 4,
           implementation: str = "gloo") -> list[Step]:
    """SparDL (ICDE'24, ``gradsync.collectives.spardl``): ⌈log2 P⌉ Spar-Reduce-Scatter rounds,
    round s forwarding the blocks at distance ≡ 2^s (mod 2^(s+1)), each re-sparsified to at most
    k_B = ⌈k/P⌉ entries, in one message of that fixed capacity plus an 8-byte count (exact
    unless a block is smaller than k_B); the same rounds backwards with one survival bit per
    entry (an upper bound: every block full); then a ring all-gather of the P reduced blocks,
    each a message of capacity k_B plus its count; on gloo in gradsync's rounds
    (:func:`_rounds`), ⌈log2 P⌉ messages from P = 4."""
    _check(P, n, k)
    _implementation(implementation)
    E, kb = index_bytes + value_bytes, -(-k // P)
    blocks = [len(range(1 << s, P, 2 << s)) for s in range((P - 1).bit_length())]
    gather = (_rounds(P, 8 + kb * E) if implementation == "gloo"
              else [Step(1, 8 + kb * E) for _ in range(P - 1)])
    return ([Step(1, 8 + b * kb * E) for b in blocks]
            + [Step(1, -(-b * kb // 8)) for b in blocks] + gather)


COLLECTIVES = ("dense", "topka", "topkdsa", "gtopk", "oktopk", "densestream", "spardl")


def fixed_capacity(scheme: str) -> bool:
    """Whether ``scheme``'s selections have a capacity every rank knows (a sparsifier that
    keeps at most k: ``Sparsifier.at_most_k``), so its all-gather needs no counts first: its
    own sparsifier's (the table of schemes), else ``Config.sparsifier``'s default (DGC's)."""
    name = schemes.get(scheme).sparsifier or Config.sparsifier
    return bool(getattr(sparsify.registry.factory(name), "at_most_k", False))


def collective_of(scheme: str) -> str:
    """The pattern of ``scheme``'s collective: its collective in the table of schemes, or
    ``"gaussiank"`` for TopkA's all-gather of selections without a fixed capacity
    (:func:`fixed_capacity`; Gaussian-k's), whose counts go first."""
    coll = schemes.get(scheme).collective
    return "gaussiank" if coll == "topka" and not fixed_capacity(scheme) else coll


def pattern(name: str, P: int, n: int, k: int, *, union: Union | None = None,
            value_bytes: int = 4, index_bytes: int = 4,
            densestream_ratio: float | None = None,
            oktopk_exact_rate: float | None = None,
            implementation: str = "gloo") -> list[Step]:
    """The steps of collective ``name`` (one of :data:`COLLECTIVES`, or ``gaussiank``);
    ``oktopk_exact_rate``: :func:`oktopk`'s ``exact_rate``; ``implementation``: one of
    :data:`IMPLEMENTATIONS`."""
    _implementation(implementation)
    imp = {"implementation": implementation}
    if union is None:
        d = k / n if n else 0.0

        def union(m: float) -> float:
            return union_density(d, m)

    if name == "dense":
        return dense_ring(P, n, value_bytes)
    if name == "topka":
        return topka(P, n, k, value_bytes, index_bytes, **imp)
    if name == "gaussiank":
        return gaussiank(P, n, k, value_bytes, index_bytes, **imp)
    if name == "topkdsa":
        return topkdsa(P, n, k, union, value_bytes, index_bytes, **imp)
    if name == "gtopk":
        return gtopk(P, n, k, value_bytes, index_bytes, **imp)
    if name == "oktopk":
        return oktopk(P, n, k, value_bytes, index_bytes, exact_rate=oktopk_exact_rate, **imp)
    if name == "spardl":
        return spardl(P, n, k, value_bytes, index_bytes, **imp)
    if name == "densestream":
        return densestream(P, n, k, union, value_bytes, index_bytes, ratio=densestream_ratio,
                           **imp)
    raise ValueError(f"unknown collective {name!r}; available: {', '.join(COLLECTIVES)}")


@dataclass(frozen=True)
class Work:
    """A collective's CPU work on one rank (issue 14): ``control`` messages of control
    collectives, ``calls`` merge/codec calls (one per payload step), ``merged`` entries summed
    into the accumulator and ``encoded`` entries encoded for or decoded from the wire;
    ``dist_calls`` torch.distributed calls (one per payload step — a point-to-point exchange —,
    one per small all-reduce of an amortised step, one per control collective), each paying a
    call's software path (CPU contention, ``gradsync.apps.sim.contention``);
    ``amortised_calls`` those of them made only in some steps (Ok-Topk's and DenseStream's
    re-evaluations: the small all-reduces of the amortised step), which a CPU profile of the
    steps in between (:mod:`gradsync.apps.sim.callcpu`) does not contain."""

    control: float
    calls: float
    merged: float
    encoded: float
    dist_calls: float = 0.0
    amortised_calls: float = 0.0


def work(name: str, steps: list[Step], P: int, k: int, value_bytes: int = 4,
         index_bytes: int = 4, implementation: str = "gloo") -> Work:
    """The CPU work of collective ``name`` whose wire steps are ``steps``.

    Every received entry is decoded once and merged once, every sent entry encoded once, so
    with e = Σ nbytes / (index_bytes + value_bytes) entries over the steps that carry entries
    (not ``control`` ones), merged = e and encoded = 2e; TopkA and Gaussian-k scatter-add all
    P contributions (their own included: merged = P·k). ``"gloo"``: the engine's steady state,
    where the ranks agree on a buffer's description once (``check_shapes="changes"``), so no
    control collective runs but the agreement word of the collectives in :data:`AGREEMENT`
    (one small all-reduce). ``"papers"``: every call's shape check (one small all-reduce,
    2(P−1) messages, ring) and TopkA's counts all-gather (P−1 messages), as before fixed
    capacity. Dense ring all-reduce: no control collective, no codec; its reduction is part of
    gloo's time.
    """
    _implementation(implementation)
    if P == 1:
        return Work(0.0, 0.0, 0.0, 0.0)
    if name == "dense":
        return Work(0.0, 0.0, 0.0, 0.0, dist_calls=1.0)
    E = index_bytes + value_bytes
    payload = [s for s in steps if s.nbytes > 0 and not s.control]
    e = sum(s.nbytes for s in payload) / E
    small = 2 * max(1, (int(P) - 1).bit_length())  # start-ups of one small all-reduce
    merged = float(P * k) if name in ("topka", "gaussiank") else e
    if implementation == "gloo":
        agree = name in AGREEMENT
        control, control_calls = float(small * agree), float(agree)
    else:
        control, control_calls = 2.0 * (P - 1), 1.0  # the shape check: one small all-reduce
        if name in ("topka", "gaussiank"):
            control += P - 1
            control_calls += 1  # the counts all-gather
    amortised = sum(s.dist_calls for s in steps if s.nbytes <= 0)
    dist_calls = control_calls + sum(s.dist_calls for s in steps)
    return Work(control=control, calls=float(len(payload)), merged=merged, encoded=2.0 * e,
                dist_calls=dist_calls, amortised_calls=amortised)
