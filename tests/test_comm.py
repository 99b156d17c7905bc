"""Comm's byte accounting, checked against the formulas of its contract (comm.py docstring).

One ``run_distributed`` call per world size runs every operation on a fresh ``Comm`` and returns
its stats and results; the parent checks them against independently written formulas.
"""

from __future__ import annotations

import pytest
import torch

from gradsync.collectives.comm import Comm, exchange_objects
from gradsync.testing import run_distributed

WORLD_SIZES = [1, 2, 3, 5]


def _block(owner: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Rank ``owner``'s all_gather_v block: uneven lengths, rank 0's is empty."""
    return (torch.arange(2 * owner) + 100 * owner).to(dtype)


def _comm_rank(rank: int, world_size: int) -> dict:
    P = world_size
    out: dict = {}

    # send/recv: rank 0 sends 3·j fp32 to each j, then each j answers with j bf16
    # (P = 1: no peer, nothing moves and nothing is counted).
    c = Comm()
    if rank == 0:
        for j in range(1, P):
            c.send(torch.full((3 * j,), float(j)), j)
        got = []
        for j in range(1, P):
            buf = torch.empty(j, dtype=torch.bfloat16)
            c.recv(buf, j)
            got.append(buf)
        out["p2p_got"] = got
    else:
        buf = torch.empty(3 * rank)
        c.recv(buf, 0)
        out["p2p_got"] = [buf]
        c.send(torch.full((rank,), -float(rank), dtype=torch.bfloat16), 0)
    out["p2p"] = c.stats

    if P > 1:
        # sendrecv around the ring: 5·(r+1) int32 to the right, from the left.
        c = Comm()
        buf = torch.empty(5 * ((rank - 1) % P + 1), dtype=torch.int32)
        c.sendrecv(torch.full((5 * (rank + 1),), rank, dtype=torch.int32), (rank + 1) % P,
                   buf, (rank - 1) % P)
        out["sendrecv"], out["sendrecv_got"] = c.stats, buf
        # bounded: 3·(r+1) + 1 int64 to the right (its length first), into a buffer of 64
        c = Comm()
        buf = torch.full((64,), -1, dtype=torch.int64)
        m = 3 * (rank + 1)
        msg = torch.cat([torch.tensor([m]), torch.full((m,), rank, dtype=torch.int64)])
        out["bounded_n"] = c.sendrecv_bounded(msg, (rank + 1) % P, buf, (rank - 1) % P,
                                              lambda b: 8 * (1 + int(b[0])))
        out["bounded"], out["bounded_got"] = c.stats, buf
        out["bounded_ok"] = c.bounded("cpu")

    # all_gather_v: uneven blocks (rank 0 empty), counts gathered by Comm.
    c = Comm()
    out["agv_got"] = c.all_gather_v(_block(rank))
    out["agv"] = c.stats
    # all_gather_v with counts given: nothing but the payload travels.
    c = Comm()
    out["agv_counts_got"] = c.all_gather_v(_block(rank, torch.float32),
                                           [2 * j for j in range(P)])
    out["agv_counts"] = c.stats
    # the same, as long blocks: round the ring (LONG_BLOCK_BYTES lowered to 1 byte)
    c = Comm()
    c.long_block_bytes = 1
    out["agv_ring_got"] = c.all_gather_v(_block(rank), [2 * j for j in range(P)])
    out["agv_ring"] = c.stats
    c = Comm()
    c.long_block_bytes = 1
    out["ag_ring_got"] = c.all_gather(torch.full((3,), rank, dtype=torch.int64))
    out["ag_ring"] = c.stats
    # all_gather_bounded: rank j's block is its length word then 3·j int64, in buffers of the
    # longest; an expected size of the bound chooses the ring, of 8 bytes the doubling
    if P > 1:
        m = 3 * rank
        mine = torch.cat([torch.tensor([m]), torch.full((m,), rank)]).view(torch.uint8)
        for key, expected in (("bounded_ring", 8.0 * (1 + 3 * (P - 1))), ("bounded_dbl", 8.0)):
            c = Comm()
            c.long_block_bytes = 16
            got = c.all_gather_bounded(mine, [8 * (1 + 3 * (P - 1))] * P,
                                       lambda q, b: 8 * (1 + int(b[:8].clone().view(torch.int64))),
                                       expected=expected)
            out[key], out[key + "_got"] = c.stats, [g.view(torch.int64) for g in got]
    # all_gather_v with every block empty.
    c = Comm()
    out["agv_empty_got"] = c.all_gather_v(torch.empty(0, dtype=torch.bfloat16))
    out["agv_empty"] = c.stats

    # all_reduce of 10 fp32 (40 bytes) and of 7 bf16 (14 bytes, not divisible by P).
    c = Comm()
    t = torch.full((10,), float(rank + 1))
    c.all_reduce(t)
    out["ar_got"], out["ar"] = t, c.stats
    c = Comm()
    t = torch.full((7,), float(rank), dtype=torch.bfloat16)
    c.all_reduce(t)
    out["ar16_got"], out["ar16"] = t, c.stats

    # broadcast of 6 fp32 (24 bytes) from the last rank.
    c = Comm()
    t = torch.arange(6, dtype=torch.float32) if rank == P - 1 else torch.zeros(6)
    c.broadcast(t, P - 1)
    out["bc_got"], out["bc"] = t, c.stats

    # all_gather of 3 int64 (24 bytes) and reduce_scatter of P × 4 fp32.
    c = Comm()
    out["ag_got"] = c.all_gather(torch.full((3,), rank, dtype=torch.int64))
    out["ag"] = c.stats
    c = Comm()
    rs = torch.empty(4)
    c.reduce_scatter(rs, torch.arange(4.0 * P) + rank)
    out["rs_got"], out["rs"] = rs, c.stats
    return out


@pytest.fixture(scope="module", params=WORLD_SIZES)
def world(request):
    P = request.param
    return P, run_distributed(_comm_rank, P, timeout=120)


def test_send_recv_bytes_exact(world):
    P, outs = world  # P = 1: no peer, nothing sent or received
    sent0, recv0 = sum(12 * j for j in range(1, P)), sum(2 * j for j in range(1, P))
    assert (outs[0]["p2p"].bytes_sent, outs[0]["p2p"].bytes_recv) == (sent0, recv0)
    assert outs[0]["p2p"].messages == P - 1
    for j in range(1, P):
        s = outs[j]["p2p"]
        assert (s.bytes_sent, s.bytes_recv, s.messages) == (2 * j, 12 * j, 1)
        assert torch.equal(outs[j]["p2p_got"][0], torch.full((3 * j,), float(j)))
        assert torch.equal(outs[0]["p2p_got"][j - 1],
                           torch.full((j,), -float(j), dtype=torch.bfloat16))


@pytest.mark.parametrize("world", [2, 3], indirect=True)  # a ring needs a peer
def test_sendrecv_ring_bytes_exact(world):
    P, outs = world
    for r, o in enumerate(outs):
        s, left = o["sendrecv"], (r - 1) % P
        assert (s.bytes_sent, s.bytes_recv, s.messages) == (20 * (r + 1), 20 * (left + 1), 1)
        assert torch.equal(o["sendrecv_got"], torch.full((5 * (left + 1),), left,
                                                         dtype=torch.int32))


@pytest.mark.parametrize("world", [2, 3], indirect=True)
def test_sendrecv_bounded_counts_the_message_not_the_buffer(world):
    """A receive into a buffer longer than its message (gloo delivers it): the length the
    message gives of itself is what is counted and returned; the buffer past it is untouched."""
    P, outs = world
    for r, o in enumerate(outs):
        left = (r - 1) % P
        mine, theirs = 8 * (1 + 3 * (r + 1)), 8 * (1 + 3 * (left + 1))
        s = o["bounded"]
        assert o["bounded_ok"] and o["bounded_n"] == theirs
        assert (s.bytes_sent, s.bytes_recv, s.messages) == (mine, theirs, 1)
        got = o["bounded_got"]
        assert int(got[0]) == 3 * (left + 1)
        assert torch.equal(got[1:1 + 3 * (left + 1)], torch.full((3 * (left + 1),), left))
        assert bool((got[1 + 3 * (left + 1):] == -1).all())


def _refuse_unbounded(rank: int, world_size: int) -> str:
    import os

    os.environ["GRADSYNC_EMULATE_BACKEND"] = "cpu:nccl"  # NCCL's rules on gloo's bytes
    c = Comm()
    try:
        c.sendrecv_bounded(torch.zeros(1), 1 - rank, torch.zeros(4), 1 - rank, lambda b: 4)
    except ValueError as e:
        return f"{c.bounded('cpu')} {e}"
    return "sent"


def test_sendrecv_bounded_refuses_where_the_receive_needs_the_exact_size():
    outs = run_distributed(_refuse_unbounded, 2, timeout=60)
    assert all(o.startswith("False ") and "exact size" in o for o in outs), outs


def _sent(P: int, r: int) -> list[list[int]]:
    """The blocks rank r sends in each round of a short all-gather: Bruck's doubling where it
    saves rounds (P >= 4; in the round of distance d the min(d, P − d) blocks held from its own
    on), else the ring (P − 1 rounds, each passing on the block received before)."""
    if P < 4:
        return [[(r - s) % P] for s in range(P - 1)]
    return [[(r + i) % P for i in range(min(d, P - d))]
            for d in (2**j for j in range(P.bit_length())) if d < P]


def test_all_gather_v_uneven_and_empty(world):
    P, outs = world
    block_bytes = [16 * j for j in range(P)]  # 2j int64
    counts_bytes = 8 * (P - 1)  # the counts' all_gather of one int64
    for r, o in enumerate(outs):
        rounds = _sent(P, r)
        assert [g.tolist() for g in o["agv_got"]] == [_block(j).tolist() for j in range(P)]
        s = o["agv"]
        # received: every other rank's block exactly once, no padding
        assert s.bytes_recv == counts_bytes + sum(block_bytes) - block_bytes[r]
        # sent: the rounds' blocks; one message a round, the counts' rounds too
        sent = sum(block_bytes[q] for blocks in rounds for q in blocks)
        assert s.bytes_sent == counts_bytes + sent
        assert s.messages == 2 * len(rounds) - sum(  # a round with nothing to send posts none
            1 for blocks in rounds if not sum(block_bytes[q] for q in blocks))
        c = o["agv_counts"]
        assert [g.tolist() for g in o["agv_counts_got"]] == [
            _block(j, torch.float32).tolist() for j in range(P)]
        assert c.bytes_recv == (sum(block_bytes) - block_bytes[r]) // 2  # fp32: 4 bytes
        assert c.bytes_sent == sent // 2
        e = o["agv_empty"]
        assert [g.numel() for g in o["agv_empty_got"]] == [0] * P
        assert all(g.dtype == torch.bfloat16 for g in o["agv_empty_got"])
        assert (e.bytes_sent, e.bytes_recv) == (counts_bytes, counts_bytes)
    # over the group, every byte sent is received
    assert sum(o["agv"].bytes_sent for o in outs) == sum(o["agv"].bytes_recv for o in outs)


def test_long_blocks_go_round_the_ring(world):
    """At or above ``long_block_bytes`` (mean block) per round the doubling saves the
    all-gathers take the ring: P − 1 rounds of one block, each rank sending every block but its
    right neighbour's."""
    P, outs = world
    block_bytes = [16 * j for j in range(P)]
    for r, o in enumerate(outs):
        assert [g.tolist() for g in o["agv_ring_got"]] == [_block(j).tolist() for j in range(P)]
        s = o["agv_ring"]
        assert s.bytes_recv == sum(block_bytes) - block_bytes[r]
        assert s.bytes_sent == sum(block_bytes) - block_bytes[(r + 1) % P]
        assert s.messages == sum(1 for j in range(P) if j != (r + 1) % P and block_bytes[j])
        assert torch.equal(o["ag_ring_got"], torch.arange(P).repeat_interleave(3).view(P, 3))
        s = o["ag_ring"]
        assert (s.bytes_sent, s.bytes_recv, s.messages) == (24 * (P - 1), 24 * (P - 1), P - 1)


@pytest.mark.parametrize("world", [2, 3, 5], indirect=True)
def test_bounded_gather_takes_the_rounds_its_expected_size_chooses(world):
    """``all_gather_bounded`` chooses its rounds from ``expected``, whatever its bounds:
    the ring's P − 1 messages or the doubling's ⌈log2 P⌉ (the ring's at P <= 3), each block
    arriving whole."""
    P, outs = world
    for r, o in enumerate(outs):
        for key, messages in (("bounded_ring", P - 1), ("bounded_dbl", len(_sent(P, r)))):
            assert [g.tolist() for g in o[key + "_got"]] == [
                [3 * j] + [j] * (3 * j) for j in range(P)], key
            s = o[key]
            assert s.bytes_recv == sum(8 * (1 + 3 * j) for j in range(P) if j != r), key
            assert s.messages == messages, key


def test_all_reduce_ring_formula(world):
    P, outs = world
    for o in outs:
        assert torch.equal(o["ar_got"], torch.full((10,), float(P * (P + 1) // 2)))
        assert torch.equal(o["ar16_got"],
                           torch.full((7,), float(P * (P - 1) // 2), dtype=torch.bfloat16))
        for key, b in (("ar", 40), ("ar16", 14)):
            s = o[key]
            assert s.bytes_sent == s.bytes_recv == 2 * (P - 1) * b // P
            assert s.messages == 2 * (P - 1)


def test_broadcast_binomial_tree(world):
    P, outs = world
    B = 24
    for r, o in enumerate(outs):
        assert torch.equal(o["bc_got"], torch.arange(6, dtype=torch.float32))
        assert o["bc"].bytes_recv == (0 if r == P - 1 else B)
    assert sum(o["bc"].bytes_sent for o in outs) == (P - 1) * B
    assert sum(o["bc"].bytes_recv for o in outs) == (P - 1) * B
    assert sum(o["bc"].messages for o in outs) == P - 1
    # a binomial tree: the root sends ⌈log2 P⌉ copies, nobody sends more
    assert outs[P - 1]["bc"].bytes_sent == B * (P - 1).bit_length()
    assert max(o["bc"].bytes_sent for o in outs) == B * (P - 1).bit_length()


def test_all_gather_and_reduce_scatter(world):
    P, outs = world
    for r, o in enumerate(outs):
        assert torch.equal(o["ag_got"], torch.arange(P).repeat_interleave(3).view(P, 3))
        assert o["ag"].bytes_sent == o["ag"].bytes_recv == (P - 1) * 24
        expected = (torch.arange(4.0 * P) * P + P * (P - 1) / 2)[4 * r: 4 * r + 4]
        assert torch.equal(o["rs_got"], expected)
        assert o["rs"].bytes_sent == o["rs"].bytes_recv == (P - 1) * 16


def test_single_rank_comm_without_process_group():
    import torch.distributed as dist

    assert not dist.is_initialized()
    c = Comm()
    assert (c.rank, c.size, c.global_rank(0)) == (0, 1, 0)
    t = torch.arange(5.0)
    assert c.all_reduce(t) is None
    assert torch.equal(t, torch.arange(5.0))
    assert torch.equal(c.all_gather(t), torch.arange(5.0).view(1, 5))
    got = c.all_gather_v(torch.arange(3))
    assert len(got) == 1 and torch.equal(got[0], torch.arange(3))
    assert c.all_gather_counts(7) == [7]
    c.broadcast(t, 0)
    rs = torch.empty(5)
    c.reduce_scatter(rs, t)
    assert torch.equal(rs, t)
    c.barrier()
    assert (c.stats.bytes_sent, c.stats.bytes_recv, c.stats.messages) == (0, 0, 0)
    with pytest.raises(ValueError, match="counts"):
        c.all_gather_v(torch.arange(3), [4])
    with pytest.raises(ValueError, match="reduce_scatter"):
        c.reduce_scatter(torch.empty(2), torch.empty(5))


def _exit_safety_rank(rank: int, world_size: int) -> dict:
    """Inside a backward pass: autograd's stashed context is lifted while Comm calls
    torch.distributed and put back after; every call's work is kept (comm.py, "Exit safety")."""
    from gradsync.collectives import comm as comm_mod

    seen: dict = {}
    c = Comm()
    x = torch.ones(4, requires_grad=True)

    def grad_hook(g: torch.Tensor) -> torch.Tensor:
        seen["in_backward"] = torch._C._is_key_in_tls("context")
        with comm_mod.outside_backward():
            seen["lifted"] = torch._C._is_key_in_tls("context")
        seen["restored"] = torch._C._is_key_in_tls("context")
        before = len(comm_mod._KEPT)
        out = g.clone()
        c.all_reduce(out)
        c.all_gather(out)
        c.broadcast(out, 0)
        seen["kept_after_three"] = min(len(comm_mod._KEPT) - before, 3)
        seen["still_restored"] = torch._C._is_key_in_tls("context")
        return out

    x.register_hook(grad_hook)
    (x * (rank + 1)).sum().backward()
    seen["grad"] = x.grad.tolist()
    seen["after_backward"] = torch._C._is_key_in_tls("context")
    return seen


@pytest.mark.parametrize("world", [1, 2, 3])
def test_comm_calls_outside_backward_context_and_keeps_works(world):
    # torch 2.13 stashes the context in every backward; 2.11 (the GPU machines') stashes
    # none, and lifting it is then a no-op
    stashes = torch.__version__ >= "2.13"
    for seen in run_distributed(_exit_safety_rank, world, timeout=120):
        assert seen["in_backward"] is stashes and not seen["lifted"]
        assert seen["restored"] is seen["still_restored"] is stashes
        assert not seen["after_backward"]
        assert seen["kept_after_three"] == (3 if world > 1 else 0)  # P = 1 sends nothing
        assert seen["grad"] == [float(sum(range(1, world + 1)))] * 4  # summed over ranks


def _broadcast_object_rank(rank: int, world_size: int) -> dict:
    c = Comm()
    obj = {"plan": [1, 2, 3], "who": "rank 1", "x": 0.5} if rank == 1 % world_size else None
    got = c.broadcast_object(obj, 1 % world_size)
    return {"got": got, "sent": c.stats.bytes_sent, "recv": c.stats.bytes_recv}


@pytest.mark.parametrize("world", [1, 2, 3])
def test_broadcast_object_arrives_everywhere_and_is_counted(world):
    import pickle

    obj = {"plan": [1, 2, 3], "who": "rank 1", "x": 0.5}
    blob = 8 + len(pickle.dumps(obj))  # the length word, then the pickle
    out = run_distributed(_broadcast_object_rank, world, timeout=120)
    assert all(o["got"] == obj for o in out)
    if world == 1:
        assert out[0]["sent"] == out[0]["recv"] == 0
        return
    root = 1 % world
    assert out[root]["recv"] == 0 and all(o["recv"] == blob for r, o in enumerate(out) if r != root)
    assert sum(o["sent"] for o in out) == (world - 1) * blob  # a tree: each non-root gets it once


def _exchange_rank(rank: int, world_size: int) -> dict:
    """Objects of different pickled sizes per rank, exchanged to everyone and to the last rank."""
    from gradsync.collectives import comm as comm_mod

    obj = {"rank": rank, "pad": "x" * (7 * rank), "t": torch.arange(rank, dtype=torch.int16)}
    before = len(comm_mod._KEPT)
    everyone = exchange_objects(obj)
    last = exchange_objects(obj, dst=world_size - 1)
    return {"everyone": everyone, "last": last,
            "kept": len(comm_mod._KEPT) - before if world_size > 1 else None}


@pytest.mark.parametrize("world", [1, 2, 3])
def test_exchange_objects_all_gather_and_gather_keep_their_works(world):
    """``exchange_objects`` gives what ``dist.all_gather_object``/``gather_object`` give, and
    keeps its works (two per call: lengths, then bytes), so gloo's thread never frees them."""
    out = run_distributed(_exchange_rank, world, timeout=120)
    expected = [{"rank": r, "pad": "x" * (7 * r)} for r in range(world)]
    for rank, o in enumerate(out):
        got = o["everyone"]
        assert [{k: g[k] for k in ("rank", "pad")} for g in got] == expected
        assert all(torch.equal(g["t"], torch.arange(r, dtype=torch.int16))
                   for r, g in enumerate(got))
        if rank == world - 1:
            assert [g["pad"] for g in o["last"]] == [e["pad"] for e in expected]
        else:
            assert o["last"] is None
        if world > 1:
            assert o["kept"] == 4  # two calls of two works each, all kept


def _older_torch_rank(rank: int, world_size: int) -> dict:
    """torch 2.11's API (the CUDA image ``make gpu-check`` ran on): no ``all_gather_single`` or
    ``reduce_scatter_single``, only their older names. Removed in this rank only."""
    import torch.distributed as dist

    old = {}
    for name in ("all_gather_single", "reduce_scatter_single"):
        if hasattr(dist, name):  # a torch that is 2.11 already has neither
            old[name] = getattr(dist, name)
            delattr(dist, name)
    try:
        P = world_size
        c = Comm()
        ag = c.all_gather(torch.full((3,), float(rank)))
        rs = torch.empty(2)
        c.reduce_scatter(rs, torch.arange(2.0 * P) * (rank + 1))
        blobs = exchange_objects(f"rank {rank}".encode())
        return {"ag": ag, "rs": rs, "blobs": blobs,
                "missing": not hasattr(dist, "all_gather_single")}
    finally:
        for name, fn in old.items():
            setattr(dist, name, fn)


@pytest.mark.parametrize("P", [1, 2, 3])
def test_comm_runs_on_torch_without_the_single_collectives(P):
    for r, o in enumerate(run_distributed(_older_torch_rank, P, timeout=120)):
        assert o["missing"]
        assert torch.equal(o["ag"], torch.arange(P, dtype=torch.float32).repeat_interleave(3)
                           .view(P, 3))
        scale = P * (P + 1) / 2
        assert o["rs"].tolist() == [2 * r * scale, (2 * r + 1) * scale]
        assert o["blobs"] == [f"rank {j}".encode() for j in range(P)]


@pytest.mark.parametrize(("P", "block_bytes", "ring"), [
    (2, 8, True), (3, 8, True),  # no round to save: the ring (P − 1 rounds either way)
    (4, 900_000, False), (4, 1 << 20, True),  # the doubling saves 1 round: 1 MiB
    (5, 3_000_000, True), (6, 2_000_000, False), (6, 2 << 20, True),  # saves 1, 2
    (8, 3_200_000, False), (8, 4 << 20, True), (16, 10 << 20, False), (16, 11 << 20, True),
])
def test_the_rounds_take_the_ring_for_blocks_long_for_the_rounds_saved(P, block_bytes, ring):
    """Bruck's doubling unless the mean block reaches LONG_BLOCK_BYTES per round it saves
    (P − 1 − ⌈log2 P⌉); every rank's rounds send and receive each other block once."""
    from gradsync.collectives.comm import LONG_BLOCK_BYTES

    assert LONG_BLOCK_BYTES == 1 << 20
    for r in range(P):
        c = Comm()
        c.size, c.rank = P, r
        rounds = list(c._rounds(block_bytes))
        if ring:
            assert rounds == [(-1, (r - s) % P, 1) for s in range(P - 1)]
        else:
            assert len(rounds) == (P - 1).bit_length()
            assert all(shift == 2**j and first == r for j, (shift, first, _) in enumerate(rounds))
        got = [(first + shift + i) % P for shift, first, n in rounds for i in range(n)]
        assert sorted(got) == sorted(set(range(P)) - {r})
