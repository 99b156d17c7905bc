"""Error feedback: conservation bit for bit, DGC momentum correction, state, bad input."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradsync.feedback import ErrorFeedback

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _grad(n: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * torch.rand(n, generator=g).pow(4)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_conservation_bit_for_bit_over_steps(dtype):
    ef = ErrorFeedback()
    n = 997
    g = torch.Generator().manual_seed(1)
    for step in range(20):
        grad = _grad(n, step, dtype)
        acc = ef.accumulate("w", grad)
        k = int(torch.randint(0, n, (1,), generator=g))
        idx = torch.randperm(n, generator=g)[:k]
        consumed = torch.zeros_like(acc)
        consumed[idx] = acc[idx]
        res = ef.update("w", acc, idx)
        assert torch.equal(consumed + res, acc)  # acc == consumed + residual, exactly
        assert torch.equal(res[idx], torch.zeros_like(res[idx]))


def test_residual_carries_what_was_not_sent():
    ef = ErrorFeedback()
    g1 = torch.tensor([1.0, 2.0, 3.0, 4.0])
    acc = ef.accumulate("w", g1)
    ef.update("w", acc, torch.tensor([3]))
    g2 = torch.tensor([0.5, 0.5, 0.5, 0.5])
    acc2 = ef.accumulate("w", g2)
    # independent reference: entries 0..2 were not sent at step 1 and come back
    assert torch.equal(acc2, torch.tensor([1.5, 2.5, 3.5, 0.5]))


def test_lower_precision_send_keeps_rounding_error():
    ef = ErrorFeedback(residual_dtype=torch.float32)
    grad = _grad(4096, 3, torch.bfloat16)
    acc = ef.accumulate("w", grad)
    assert acc.dtype == torch.float32
    acc = acc + _grad(4096, 4) * 1e-3  # values not representable in bf16
    idx = torch.arange(0, 4096, 3)
    sent = acc[idx].to(torch.bfloat16)
    res = ef.update("w", acc, idx, sent_values=sent)
    consumed = torch.zeros_like(acc)
    consumed[idx] = sent.float()
    assert torch.equal(consumed + res, acc)
    assert bool((res[idx] != 0).any())  # rounding error really is kept, not dropped


def test_dgc_momentum_correction_matches_recurrence():
    m = 0.9
    ef = ErrorFeedback(momentum=m)
    n = 64
    u = torch.zeros(n)
    v = torch.zeros(n)
    for step in range(6):
        grad = _grad(n, 10 + step)
        acc = ef.accumulate("w", grad)
        u = m * u + grad
        v_acc = v + u
        assert torch.allclose(acc, v_acc, rtol=0, atol=1e-6)
        idx = torch.topk(acc.abs(), 8).indices
        res = ef.update("w", acc, idx)
        v = v_acc.clone()
        v[idx] = 0
        u[idx] = 0  # factor masking
        assert torch.allclose(res, v, rtol=0, atol=1e-6)


def test_state_dict_round_trip_exact():
    ef = ErrorFeedback(momentum=0.5)
    for step in range(3):
        for name in ("a", "b"):
            acc = ef.accumulate(name, _grad(50, step))
            ef.update(name, acc, torch.arange(step, 50, 7))
    state = ef.state_dict()
    ef2 = ErrorFeedback(momentum=0.5)
    ef2.load_state_dict(state)
    grad = _grad(50, 99)
    a1, a2 = ef.accumulate("a", grad), ef2.accumulate("a", grad)
    assert torch.equal(a1, a2)
    with pytest.raises(ValueError, match="momentum"):
        ErrorFeedback(momentum=0.1).load_state_dict(state)


def test_nonfinite_rejected_without_pollution():
    ef = ErrorFeedback()
    acc = ef.accumulate("w", torch.ones(8))
    ef.update("w", acc, torch.tensor([0]))
    before = ef.residual("w").clone()
    for bad in (float("nan"), float("inf"), -float("inf")):
        g = torch.ones(8)
        g[3] = bad
        with pytest.raises(ValueError, match="'w'"):
            ef.accumulate("w", g)
        assert torch.equal(ef.residual("w"), before)


def test_bad_input():
    with pytest.raises(ValueError):
        ErrorFeedback(momentum=1.0)
    with pytest.raises(ValueError):
        ErrorFeedback(residual_dtype=torch.int32)
    ef = ErrorFeedback()
    with pytest.raises(ValueError, match="without a preceding"):
        ef.update("w", torch.ones(3), torch.tensor([0]))
    acc = ef.accumulate("w", torch.ones(3))
    for bad in ([3], [-1], [0, 3]):
        with pytest.raises(ValueError, match="out of range"):
            ef.update("w", acc, torch.tensor(bad))
    with pytest.raises(ValueError, match="sent values"):
        ef.update("w", acc, torch.tensor([0, 1]), sent_values=torch.ones(1))
    ef.update("w", acc, torch.tensor([0]))
    with pytest.raises(ValueError, match="shape"):
        ef.accumulate("w", torch.ones(4))


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 300),
    steps=st.integers(1, 5),
    frac=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from(DTYPES),
    momentum=st.sampled_from([0.0, 0.9]),
)
def test_conservation_property(n, steps, frac, seed, dtype, momentum):
    ef = ErrorFeedback(momentum=momentum)
    g = torch.Generator().manual_seed(seed)
    for t in range(steps):
        acc = ef.accumulate("p", _grad(n, seed + t, dtype))
        idx = torch.randperm(n, generator=g)[: int(frac * n)]
        res = ef.update("p", acc, idx)
        consumed = torch.zeros_like(acc)
        consumed[idx] = acc[idx]
        assert torch.equal(consumed + res, acc)


def test_discard_leaves_state_as_before():
    ef = ErrorFeedback(momentum=0.9)
    acc = ef.accumulate("w", torch.ones(6))
    ef.update("w", acc, torch.tensor([1]))
    before = ef.state_dict()
    ef.accumulate("w", torch.full((6,), 5.0))
    ef.discard("w")
    after = ef.state_dict()
    assert torch.equal(before["residual"]["w"], after["residual"]["w"])
    assert torch.equal(before["velocity"]["w"], after["velocity"]["w"])
    with pytest.raises(ValueError, match="without a preceding"):
        ef.update("w", acc, torch.tensor([0]))


def test_velocity_sent_whole_reuses_two_buffers_and_follows_sgd_bit_for_bit():
    """A tensor sent whole every step: its velocity is torch SGD's momentum buffer bit for bit
    (computed independently here), computed into the buffer the last commit replaced (two
    buffers alternate, no allocation per step), and a discarded step leaves the committed
    velocity untouched even though its buffer is the next one written."""
    ef = ErrorFeedback(momentum=0.9)
    p = torch.nn.Parameter(torch.zeros(1000))
    sgd = torch.optim.SGD([p], lr=1.0, momentum=0.9)
    ptrs = []
    for step in range(8):
        grad = _grad(1000, step)
        acc = ef.accumulate("w", grad)
        if step == 4:  # a skipped step: nothing of it may remain
            ef.discard("w")
            continue
        p.grad = grad.clone()
        sgd.step()
        assert torch.equal(acc, sgd.state[p]["momentum_buffer"]), step
        ptrs.append(acc.data_ptr())
        ef.update("w", acc, None)
        assert torch.equal(ef.state_dict()["velocity"]["w"], sgd.state[p]["momentum_buffer"])
    assert len(set(ptrs[1:])) == 2 and ptrs[1] != ptrs[2]  # two buffers, alternating


@pytest.mark.parametrize("wire", [torch.float32, torch.bfloat16])
def test_sent_whole_without_indices_equals_every_index(wire):
    """``update(name, acc, None)`` (sent whole, no index work) leaves the residual and the
    velocity exactly as consuming every index does, in any order; the rounding of a 16-bit
    wire stays in the residual."""
    a, b = ErrorFeedback(momentum=0.9), ErrorFeedback(momentum=0.9)
    n = 513
    for step in range(6):
        grad = _grad(n, step)
        acc_a, acc_b = a.accumulate("w", grad), b.accumulate("w", grad)
        assert torch.equal(acc_a, acc_b)  # same velocities so far
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(step))
        sent = acc_a.to(wire)
        ra = a.update("w", acc_a, None, None if wire == torch.float32 else sent)
        rb = b.update("w", acc_b, perm, None if wire == torch.float32 else sent[perm])
        assert torch.equal(ra, rb)
        assert torch.equal(acc_a, sent.float() + ra)  # conservation, bit for bit
    # the velocity kept going as SGD's buffer: gradients 1, 2, 3 give 1, 2.9, 5.61
    ef = ErrorFeedback(momentum=0.9)
    out = []
    for g in (1.0, 2.0, 3.0):
        acc = ef.accumulate("w", torch.full((4,), g))
        out.append(acc[0].item())
        ef.update("w", acc, None)
    assert out == pytest.approx([1.0, 2.9, 5.61])


def test_sent_whole_checks_the_sent_values():
    ef = ErrorFeedback()
    acc = ef.accumulate("w", torch.ones(8))
    with pytest.raises(ValueError, match="8 consumed entries"):
        ef.update("w", acc, None, torch.ones(7))


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_zero_residual_shortcut_matches_plain_arithmetic(momentum):
    """After a whole send the residual is known to be zeros and is neither re-added nor
    re-allocated; a mixed sequence of whole, partial and rounded sends must still equal the
    recurrence written out in float64 (acc = u + r, r = acc − sent)."""
    ef = ErrorFeedback(momentum=momentum)
    n, u, r = 64, torch.zeros(64, dtype=torch.float64), torch.zeros(64, dtype=torch.float64)
    gen = torch.Generator().manual_seed(3)
    plan = ["whole", "whole", "partial", "whole", "rounded", "partial", "whole", "whole"]
    for step, how in enumerate(plan):
        g = torch.randn(n, generator=gen)
        acc = ef.accumulate("w", g)
        u = momentum * u + g.double() if momentum else g.double()
        ref_acc = u + r
        torch.testing.assert_close(acc.double(), ref_acc, rtol=1e-6, atol=1e-6)
        if how == "whole":
            res = ef.update("w", acc, None)
            r = torch.zeros_like(r)
        elif how == "rounded":  # whole, over a bf16 wire: the rounding stays behind
            sent = acc.to(torch.bfloat16)
            res = ef.update("w", acc, None, sent)
            r = acc.double() - sent.double()
        else:
            idx = torch.arange(step % 3, n, 3)
            res = ef.update("w", acc, idx)
            r = acc.double().clone()
            r[idx] = 0
            if momentum:
                u[idx] = 0  # factor masking
        torch.testing.assert_close(res.double(), r, rtol=0, atol=1e-7)
        if how == "rounded":
            assert res.abs().sum() > 0  # a real rounding residual, not the zeros shortcut


# -- preconditioning (gradsync.engine.preconditioning; the optimizer's frozen variance) ------
def test_precondition_rescales_what_is_held_and_what_enters():
    m, s = 0.9, torch.tensor([2.0, 0.5, 4.0, 1.0])
    g1, g2 = torch.tensor([1.0, -2.0, 3.0, 0.25]), torch.tensor([0.5, 1.0, -1.0, 2.0])
    ef = ErrorFeedback(momentum=m)
    acc = ef.accumulate("w", g1)
    ef.update("w", acc, torch.tensor([2]))  # entry 2 sent: residual and velocity zero there
    ef.precondition("w", s)
    assert ef.transforms("w")
    # written out in float64: residual [1, -2, 0, 0.25] and velocity [1, -2, 0, 0.25] scaled
    held = torch.tensor([1.0, -2.0, 0.0, 0.25], dtype=torch.float64) * s.double()
    u2 = m * held + s.double() * g2.double()
    acc2 = ef.accumulate("w", g2)
    torch.testing.assert_close(acc2.double(), held + u2)
    res = ef.update("w", acc2, torch.tensor([0, 3]))
    assert torch.equal(res[[0, 3]], torch.zeros(2)) and torch.equal(res[[1, 2]], acc2[[1, 2]])


def test_precondition_without_momentum_makes_a_whole_send_carry_the_scaled_gradient():
    ef = ErrorFeedback()
    assert not ef.transforms("w")  # a plain all-reduce may send the raw gradient
    ef.precondition("w", torch.full((3,), 8.0))
    assert ef.transforms("w")  # now it must send acc
    g = torch.tensor([1.0, 2.0, 3.0])
    acc = ef.accumulate("w", g)
    assert torch.equal(acc, 8 * g) and torch.equal(g, torch.tensor([1.0, 2.0, 3.0]))


def test_a_second_precondition_rescales_by_the_ratio():
    ef = ErrorFeedback()
    ef.accumulate("w", torch.tensor([1.0, 1.0]))
    ef.update("w", torch.tensor([1.0, 1.0]), torch.tensor([0]))  # residual [0, 1]
    ef.precondition("w", torch.tensor([2.0, 2.0]))
    ef.precondition("w", torch.tensor([6.0, 6.0]))  # as if scaled by 6 from the start
    assert torch.equal(ef.residual("w"), torch.tensor([0.0, 6.0]))


def test_precondition_state_round_trip_and_old_states():
    ef = ErrorFeedback(momentum=0.5)
    ef.precondition("w", torch.tensor([3.0, 1.0]))
    ef.update("w", ef.accumulate("w", torch.tensor([1.0, 1.0])), torch.tensor([1]))
    state = ef.state_dict()
    again = ErrorFeedback(momentum=0.5)
    again.load_state_dict(state)
    g = torch.tensor([0.5, 0.25])
    assert torch.equal(again.accumulate("w", g), ef.accumulate("w", g))
    old = ErrorFeedback(momentum=0.5)
    old.load_state_dict({k: v for k, v in state.items() if k != "scale"})  # before scales
    assert old.scale("w") is None


@pytest.mark.parametrize("scale, what", [(torch.tensor([1.0, 0.0]), "> 0"),
                                         (torch.tensor([1.0, float("inf")]), "finite"),
                                         (torch.tensor([1, 2]), "floating"),
                                         (torch.ones(3), "entries")])
def test_bad_scales_are_refused(scale, what):
    ef = ErrorFeedback()
    ef.update("w", ef.accumulate("w", torch.ones(2)), torch.tensor([0]))
    with pytest.raises(ValueError, match=what):
        ef.precondition("w", scale)
    assert torch.equal(ef.residual("w"), torch.tensor([0.0, 1.0])) and ef.scale("w") is None


def test_precondition_between_accumulate_and_update_is_refused():
    ef = ErrorFeedback()
    ef.accumulate("w", torch.ones(2))
    with pytest.raises(ValueError, match="between"):
        ef.precondition("w", torch.ones(2))


# -- momentum factor masking (Config.momentum_masking) ----------------------------------------
@pytest.mark.parametrize("masking", [True, False])
def test_an_entry_sent_every_step_with_and_without_masking(masking):
    # entry 0 is sent at every step, entry 1 never; gradient 1 for both, m = 0.9
    m, steps = 0.9, 100
    ef = ErrorFeedback(momentum=m, masking=masking)
    sent = []
    for _ in range(steps):
        acc = ef.accumulate("w", torch.ones(2, dtype=torch.float64))
        sent.append(float(acc[0]))
        ef.update("w", acc, torch.tensor([0]))
    # dense SGD momentum's buffer, written out: b_t = m·b_{t-1} + 1
    dense, b = [], 0.0
    for _ in range(steps):
        b = m * b + 1.0
        dense.append(b)
    if masking:  # DGC: the velocity is zeroed at each send, so each step moves by g only
        assert sent == [1.0] * steps
        assert sum(dense) / sum(sent) > 8  # ~1/(1 − m) of the momentum's steps are lost
    else:  # the velocity carries on: exactly dense momentum's steps
        assert sent == pytest.approx(dense, rel=1e-12)
    # entry 1 (never sent) accumulates the same velocities either way
    assert float(ef.residual("w")[1]) == pytest.approx(sum(dense), rel=1e-12)


def test_masking_is_validated_and_part_of_the_state():
    with pytest.raises(ValueError, match="masking"):
        ErrorFeedback(momentum=0.9, masking=1)
    saved = ErrorFeedback(momentum=0.9, masking=False).state_dict()
    with pytest.raises(ValueError, match="masking"):
        ErrorFeedback(momentum=0.9).load_state_dict(saved)
    old = {k: v for k, v in ErrorFeedback(momentum=0.9).state_dict().items() if k != "masking"}
    ErrorFeedback(momentum=0.9).load_state_dict(old)  # saved before the option: masking on
    with pytest.raises(ValueError, match="masking"):
        ErrorFeedback(momentum=0.9, masking=False).load_state_dict(old)


# -- buffers: several tensors at once (accumulate_buffer / update_buffer) -----------------------
def _per_name_step(ef, names, sizes, grads, consumed, wire):
    """The reference: one accumulate/update per tensor, with each tensor's share of the buffer
    positions ``consumed`` (None: every entry, which a tensor consumed whole also gets)."""
    out, lo = [], 0
    for n, k, g in zip(names, sizes, grads):
        acc = ef.accumulate(n, g)
        local = None if consumed is None else consumed[(consumed >= lo) & (consumed < lo + k)] - lo
        whole = local is None or local.numel() == k
        sent = None if acc.dtype == wire else (acc if whole else acc[local]).to(wire)
        kept = acc.clone()  # acc may be the velocity, which masking changes in update
        out.append((kept, ef.update(n, acc, None if whole else local, sent)))
        lo += k
    return out


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(1, 40), min_size=1, max_size=6), steps=st.integers(1, 5),
       frac=st.floats(0.0, 1.0), seed=st.integers(0, 10_000),
       momentum=st.sampled_from([0.0, 0.9]), masking=st.booleans(),
       dtype=st.sampled_from(DTYPES), scaled=st.booleans(), head=st.booleans())
def test_a_buffer_is_bitwise_its_tensors_one_by_one(sizes, steps, frac, seed, momentum, masking,
                                                    dtype, scaled, head):
    """accumulate_buffer/update_buffer give every tensor the accumulator, residual and velocity
    of the per-tensor calls, bit for bit: momentum with and without masking (a tensor consumed
    whole keeps its velocity), 16-bit gradients with fp32 residuals (the rounding stays),
    preconditioning scales, and steps where nothing or everything is consumed. ``head``: the
    first tensor travels whole as a part of its own (``whole=``, the DDP hook's SSFusion-I
    all-reduce part), summed in the accumulator itself when error feedback says it may."""
    names = [f"t{i}" for i in range(len(sizes))]
    mk = dict(momentum=momentum, masking=masking, residual_dtype="auto")
    ref, buf = ErrorFeedback(**mk), ErrorFeedback(**mk)
    gen = torch.Generator().manual_seed(seed)
    if scaled:
        s = torch.rand(sizes[0], generator=gen) + 0.5
        ref.precondition(names[0], s)
        buf.precondition(names[0], s)
    n = sum(sizes)
    for step in range(steps):
        grads = [_grad(k, seed + 7 * step + i, dtype) for i, k in enumerate(sizes)]
        pick = torch.rand(n, generator=gen) < frac
        if step == 1 and len(sizes) > 1:  # the first tensor consumed whole, the rest not at all
            pick[:] = False
            pick[:sizes[0]] = True
        whole = sizes[0] if head and len(sizes) > 1 else 0
        pick[:whole] = True
        consumed = None if bool(pick.all()) else pick.nonzero().view(-1)
        want = _per_name_step(ref, names, sizes, grads, consumed, dtype)
        acc = buf.accumulate_buffer("b", names, sizes, torch.cat(grads))
        assert torch.equal(acc, torch.cat([a for a, _ in want]))
        sent = (None if acc.dtype == dtype
                else (acc if consumed is None else acc[consumed]).to(dtype))
        if whole and consumed is not None:
            if sent is None and buf.writable("b", acc):  # an all-reduce summed in place
                acc[:whole] = 123.0
            res = buf.update_buffer("b", acc, consumed[whole:] - whole, sent, whole=whole)
        else:
            res = buf.update_buffer("b", acc, consumed, sent)
        assert torch.equal(res, torch.cat([r.reshape(-1) for _, r in want]))
        for name in names:
            assert torch.equal(buf.residual(name), ref.residual(name).reshape(-1))
            if momentum:
                assert torch.equal(buf.velocity(name), ref.velocity(name).reshape(-1))


def test_a_buffer_takes_over_what_its_tensors_held_and_gives_it_back():
    """A new buffer over tensors held per name (or in another buffer: another plan) starts from
    what they held; a per-name call splits the buffer back; the state is per name either way,
    and discarding a buffered tensor drops its buffer's pending step."""
    ef = ErrorFeedback(momentum=0.9)
    a, b, c = torch.tensor([1.0, -2.0]), torch.tensor([3.0]), torch.tensor([0.5, 4.0, -1.0])
    for name, g in (("a", a), ("b", b), ("c", c)):
        ef.update(name, ef.accumulate(name, g), torch.tensor([0]))
    held = {n: (ef.residual(n).clone(), ef.velocity(n).clone()) for n in "abc"}
    acc = ef.accumulate_buffer(0, ("a", "b"), (2, 1), torch.zeros(3))
    assert torch.equal(acc, torch.cat([held["a"][0] + 0.9 * held["a"][1],
                                       held["b"][0] + 0.9 * held["b"][1]]))
    ef.discard("b")  # a skipped step: the pending buffer is dropped, nothing changes
    assert torch.equal(ef.residual("a"), held["a"][0])
    assert torch.equal(ef.velocity("b"), held["b"][1])
    state = ef.state_dict()
    assert sorted(state["residual"]) == ["a", "b", "c"] and ef.names() == ["a", "b", "c"]
    # another plan: (b, c) in one buffer takes b out of buffer 0
    acc = ef.accumulate_buffer(1, ("b", "c"), (1, 3), torch.zeros(4))
    ef.update_buffer(1, acc, None)
    assert torch.equal(ef.residual("b"), torch.zeros(1))
    assert torch.equal(ef.residual("a"), held["a"][0])
    g = torch.tensor([0.25, 0.5, 0.75])
    acc = ef.accumulate("c", g)  # per name again: the buffer splits, nothing is lost
    assert torch.equal(acc, torch.zeros(3) + (0.9 * ef.velocity("c") + g))
    with pytest.raises(ValueError, match="without a preceding"):
        ef.update_buffer(7, acc, None)
    with pytest.raises(ValueError, match="names and"):
        ef.accumulate_buffer(2, ("a",), (5,), torch.zeros(3))
    restored = ErrorFeedback(momentum=0.9)
    restored.load_state_dict(state)
    assert all(torch.equal(restored.residual(n).reshape(-1), state["residual"][n].reshape(-1))
               for n in "abc")


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_a_buffer_never_holds_the_callers_gradient(momentum):
    """The engine hands error feedback its gradient storage, which then receives the average:
    ``acc`` (and the velocity) must be new tensors, not views of the gradient, at every step."""
    ef = ErrorFeedback(momentum=momentum)
    grad = torch.tensor([1.0, -2.0, 3.0])
    for _ in range(2):
        acc = ef.accumulate_buffer("b", ("w",), (3,), grad)
        want = acc.clone()
        grad.fill_(7.0)  # the average lands in the storage
        assert torch.equal(acc, want)
        ef.update_buffer("b", acc, torch.tensor([0]))
        grad.copy_(torch.tensor([1.0, -2.0, 3.0]))


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_update_buffer_takes_a_new_acc_over_as_the_residual_never_the_velocity(momentum):
    """The ``acc`` accumulate_buffer made becomes the residual in place (no copy of the
    buffer); an ``acc`` that is the velocity itself (momentum, nothing held yet) is copied, so
    the residual and the velocity never share storage, and the values are those of the copy."""
    ef = ErrorFeedback(momentum=momentum)
    grads = [torch.tensor([1.0, -2.0, 3.0, 0.5]), torch.tensor([0.25, 4.0, -1.0, 2.0])]
    r_ref = torch.zeros(4)
    u_ref = torch.zeros(4)
    for step, g in enumerate(grads):
        acc = ef.accumulate_buffer("b", ("w",), (4,), g)
        u_ref = momentum * u_ref + g
        want = r_ref + (u_ref if momentum else g)
        assert torch.equal(acc, want)
        is_velocity = momentum and step == 0  # nothing held yet: acc is the new velocity
        res = ef.update_buffer("b", acc, torch.tensor([1]))
        want[1] = 0.0
        assert torch.equal(res, want)
        assert (res.data_ptr() == acc.data_ptr()) is (not is_velocity)
        if momentum:
            u_ref[1] = 0.0  # masking: the velocity at the sent entry
            v = ef.velocity("w").reshape(-1)
            assert torch.equal(v, u_ref) and v.data_ptr() != res.data_ptr()
        r_ref = want.clone()


def test_update_buffer_with_entries_sent_whole_needs_them_to_be_whole_tensors():
    """``whole`` (a part sent whole ahead of the selected positions) must end where a tensor
    ends, and the values sent must cover it and the positions: clear errors, nothing kept."""
    ef = ErrorFeedback()
    acc = ef.accumulate_buffer("b", ("a", "c"), (2, 3), torch.ones(5))
    with pytest.raises(ValueError, match="end inside a tensor"):
        ef.update_buffer("b", acc, torch.tensor([0]), whole=1)
    with pytest.raises(ValueError, match="2 entries sent whole and 1 consumed"):
        ef.update_buffer("b", acc, torch.tensor([0]), torch.ones(2), whole=2)
    res = ef.update_buffer("b", acc, torch.tensor([1]), whole=2)
    assert res.tolist() == [0.0, 0.0, 1.0, 0.0, 1.0]


def test_a_buffer_sent_whole_twice_keeps_its_zero_residual_and_checks_the_values_sent():
    """A buffer sent whole (``consumed`` None, no values: a dense all-reduce) leaves a zero
    residual; sent whole again, that same zero residual stands, with nothing written. Sent
    whole with its values, the residual is what was accumulated minus what was sent, and values
    of another length are refused."""
    ef = ErrorFeedback()
    acc = ef.accumulate_buffer("b", ("x", "y"), (2, 1), torch.tensor([1.0, -2.0, 3.0]))
    first = ef.update_buffer("b", acc, None)
    assert torch.equal(first, torch.zeros(3))
    acc = ef.accumulate_buffer("b", ("x", "y"), (2, 1), torch.tensor([4.0, 5.0, 6.0]))
    assert torch.equal(acc, torch.tensor([4.0, 5.0, 6.0]))  # nothing was left behind
    again = ef.update_buffer("b", acc, None)
    assert again.data_ptr() == first.data_ptr() and torch.equal(again, torch.zeros(3))
    acc = ef.accumulate_buffer("b", ("x", "y"), (2, 1), torch.tensor([1.0, 1.0, 1.0]))
    with pytest.raises(ValueError, match=r"3 consumed entries .* but 2 sent values"):
        ef.update_buffer("b", acc, None, torch.tensor([1.0, 1.0]))
    res = ef.update_buffer("b", acc, None, torch.tensor([0.5, 1.0, 0.25]))
    assert torch.equal(res, torch.tensor([0.5, 0.0, 0.75]))


def test_discard_pending_leaves_every_buffer_of_an_abandoned_step_as_before():
    """A step abandoned midway (the DDP hook's collective raised): every buffer accumulated
    and not updated keeps its residual and velocity, and the next step accumulates anew."""
    ef = ErrorFeedback(momentum=0.9)
    g = torch.Generator().manual_seed(0)
    for key in ("a", "b"):  # one finished step: residuals and velocities held
        acc = ef.accumulate_buffer(key, [f"{key}0"], [6], torch.randn(6, generator=g))
        ef.update_buffer(key, acc, torch.tensor([1, 4]))
    before = {k: {n: t.clone() for n, t in v.items()} if isinstance(v, dict) else v
              for k, v in ef.state_dict().items()}
    for key in ("a", "b"):  # the abandoned step: both accumulated, neither updated
        ef.accumulate_buffer(key, [f"{key}0"], [6], torch.randn(6, generator=g))
    ef.discard_pending()
    after = ef.state_dict()
    for k, v in before.items():
        if isinstance(v, dict):
            assert v.keys() == after[k].keys()
            assert all(torch.equal(v[n], after[k][n]) for n in v), k
    # the next step accumulates (without discard_pending: "accumulate_buffer('a') twice")
    ef.accumulate_buffer("a", ["a0"], [6], torch.zeros(6))
