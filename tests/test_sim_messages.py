"""The simulator's message counts are the ones gradsync's collectives send on gloo.

Each one-buffer scheme trains a one-layer model through the engine on real gloo ranks
(``Config`` defaults but DGC's warm-up, which would change the density mid-measurement), and
every rank records the point-to-point calls of its steady steps. A rank's messages on the
critical path are its blocking sends and receives (``Comm.send``/``Comm.recv``: a fold, a tree's
round) and its exchanges (a non-blocking receive and send posted together, one round), counted
here independently of ``gradsync.apps.sim.patterns``; the busiest rank's count must be the
pattern's start-ups (``implementation="gloo"``), and the small all-reduces of a step must be the
agreement word of :data:`~gradsync.apps.sim.patterns.AGREEMENT` alone.
"""

from __future__ import annotations

import pytest
import torch

from gradsync.apps.sim import patterns
from gradsync.schedule import entries
from gradsync.testing import run_distributed

SCHEMES = ("topka", "gaussiank", "topkdsa", "gtopk", "oktopk", "densestream", "spardl")
WARM, MEASURED = 8, 3  # steps before the measured ones (the plan, θ's first exact step)
N_IN, N_OUT = 200, 100


def _rounds(events: list[str]) -> int:
    """Messages on a rank's critical path: each blocking send ``S`` or receive ``R``, and each
    exchange: a non-blocking receive ``r`` and send ``s`` posted one after the other."""
    lone = sum(e in "SR" for e in events)
    rest = [e for e in events if e in "rs"]
    rounds, i = 0, 0
    while i < len(rest):
        pair = i + 1 < len(rest) and {rest[i], rest[i + 1]} == {"r", "s"}
        rounds += 1
        i += 2 if pair else 1
    return lone + rounds


def _steady_calls(rank: int, world_size: int, scheme: str) -> tuple[list[int], list[int]]:
    import torch.distributed as dist

    import gradsync
    from gradsync.collectives.comm import Comm

    events: list[str] = []
    all_reduces = [0]
    state = {"lone": False}
    real_isend, real_irecv, real_all_reduce = dist.isend, dist.irecv, dist.all_reduce
    real_send, real_recv = Comm.send, Comm.recv

    def isend(*a, **k):
        events.append("S" if state["lone"] else "s")
        return real_isend(*a, **k)

    def irecv(*a, **k):
        events.append("R" if state["lone"] else "r")
        return real_irecv(*a, **k)

    def all_reduce(*a, **k):
        all_reduces[0] += 1
        return real_all_reduce(*a, **k)

    def lone(real):
        def call(self, *a, **k):
            state["lone"] = True
            try:
                return real(self, *a, **k)
            finally:
                state["lone"] = False
        return call

    dist.isend, dist.irecv, dist.all_reduce = isend, irecv, all_reduce
    Comm.send, Comm.recv = lone(real_send), lone(real_recv)
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(N_IN, N_OUT, bias=False)
        sync = gradsync.GradSync(model, gradsync.Config(scheme=scheme, density=0.01,
                                                        density_warmup=()))
        g = torch.Generator().manual_seed(rank)
        rounds, reduces = [], []
        for step in range(WARM + MEASURED):
            events.clear()
            all_reduces[0] = 0
            model.zero_grad()
            model(torch.randn(8, N_IN, generator=g)).square().mean().backward()
            sync.synchronize()
            if step >= WARM:
                rounds.append(_rounds(events))
                reduces.append(all_reduces[0])
        sync.close()
        return rounds, reduces
    finally:
        dist.isend, dist.irecv, dist.all_reduce = real_isend, real_irecv, real_all_reduce
        Comm.send, Comm.recv = real_send, real_recv


@pytest.mark.parametrize("P", [2, 3, 4, 8])
def test_patterns_count_the_messages_the_collectives_send(P):
    n = N_IN * N_OUT
    k = entries(n, 0.01)
    for scheme in SCHEMES:
        got = run_distributed(_steady_calls, P, scheme, timeout=240)
        busiest = max(max(rounds) for rounds, _ in got)
        assert all(len(set(rounds)) == 1 for rounds, _ in got), (scheme, P, got)
        coll = patterns.collective_of(scheme)
        want = sum(s.messages for s in patterns.pattern(coll, P, n, k) if s.nbytes > 0)
        assert busiest == want, f"{scheme} at P = {P}: the code's {busiest}, the pattern's {want}"
        agreement = int(coll in patterns.AGREEMENT)
        assert {r for _, reduces in got for r in reduces} == {agreement}, (scheme, P, got)
        w = patterns.work(coll, patterns.pattern(coll, P, n, k), P, k)
        assert w.control == pytest.approx(agreement * 2 * max(1, (P - 1).bit_length()))


def test_rounds_counts_exchanges_once_and_lone_messages_each():
    assert _rounds(list("rsrs")) == 2  # two exchanges
    assert _rounds(list("SSRR")) == 4  # a fold: header and stream out, then back
    assert _rounds(list("RRsr")) == 3
    assert _rounds(list("sss")) == 3


def test_simulator_page_message_table_is_the_patterns():
    """docs/results/simulator.md, "The messages gradsync sends": each cell of its table is the
    gloo pattern's messages at the CNN's n (checked against the code above), TopkDSA's agreement
    word as ``+ 1``, and in brackets the papers' pattern's payload + control messages."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs/results/simulator.md").read_text()
    n = 421_642
    k = entries(n, 0.01)
    names = ("topka", "gaussiank", "topkdsa", "gtopk", "oktopk", "densestream", "spardl")
    for P in (2, 3, 4, 8):
        cells = []
        for name in names:
            gloo = patterns.pattern(name, P, n, k)
            papers = patterns.pattern(name, P, n, k, implementation="papers")
            sent = sum(s.messages for s in gloo if s.nbytes > 0)
            before = sum(s.messages for s in papers if s.nbytes > 0)
            control = patterns.work(name, papers, P, k, implementation="papers").control
            agree = " + 1" if name in patterns.AGREEMENT else ""
            cells.append(f"{sent:g}{agree} ({before:g} + {control:g})")
        assert f"| {P} | " + " | ".join(cells) + " |" in text, (P, cells)
