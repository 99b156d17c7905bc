"""Error feedback: what compression does not send stays in a residual and is sent later.

Per named tensor ``w`` and step ``t`` (SSFusion §II-B, DGC §3.2, Ok-Topk Algorithm 2):

    acc_t      = residual_{t-1} + g_t                       (plain error feedback)
    consumed_t = acc_t at the indices the collective used
    residual_t = acc_t − consumed_t                         (exactly what was not sent)

so ``acc == consumed + residual`` holds bit for bit at every step: gradient mass is never lost
or invented by compression. When the caller sends values in a lower precision than the
residual (e.g. residuals in fp32 for bf16 gradients), it passes the values it really sent and
the rounding error stays in the residual: ``residual[i] = acc[i] − sent[i]``, exact because
``sent[i]`` is a rounding of ``acc[i]`` (Sterbenz).

DGC momentum correction (DGC §3.2, "momentum correction" and "momentum factor masking"), with
momentum ``m``:

    u_t = m · u_{t-1} + g_t           (velocity, local)
    acc_t = v_{t-1} + u_t             (v: the residual, accumulated velocity)
    v_t = acc_t − consumed_t ;  u_t[consumed] = 0   (factor masking, compressed tensors only)

Factor masking is for **compressed** tensors: DGC masks the momentum of the entries a sparse
update sends, so that they do not keep pushing in a stale direction. A tensor whose every entry
is consumed in a step (sent whole: the ``dense`` scheme with momentum, SSFusion's excluded
tensors, SSFusion-I's all-reduce part, any scheme at density 1) keeps its velocity, so
``acc_t = u_t`` is exactly the update of SGD with momentum ``m`` (gradients 1, 2, 3 give
1, 2.9, 5.61): a compressed run with ``SGD(momentum=0)`` then follows DDP with
``SGD(momentum=m)`` wherever nothing is compressed.

**Masking** (``masking=False``, ``Config.momentum_masking``). Factor masking drops the velocity
of every entry a compressed tensor sends, so the momentum's tail (``m·u + m²·u + …``) of that
entry is never applied: an entry sent at every step moves by ``u = g`` instead of dense
momentum's ``g / (1 − m)``, ten times less at ``m = 0.9``, and the more often entries are sent
(the higher the density) the more of the momentum is lost. Without masking the velocity
carries on after a send, and each entry's cumulative update is exactly dense momentum's,
delayed until the entry is sent. Measured, masking cost TopkA accuracy on the CNN and
perplexity on TinyGPT, more at 10 % density than at 1 % (docs/results/accuracy-history.md, "Momentum
factor masking"). ``ErrorFeedback`` keeps DGC's rule by default (``masking=True``); the
engine's ``Config.momentum_masking`` defaults to ``False``.

**Ahead** (``ahead=a``, ``Config.momentum_ahead``; ours, not DGC's). Without masking, an
entry sent at step ``t`` still owes the update its velocity will add in the steps after:
``m·u + m²·u + … = m/(1 − m)·u``. With ``a > 0`` a compressed entry's sent value carries
``c = a·m/(1 − m)`` velocities of it now, borrowed from that future: the collective sends
``acc + c·u`` at the positions the selection chose (still chosen by ``|acc|``), and the
residual keeps ``acc − sent = −c·u`` there, a debt the velocity repays over the next steps.
Nothing is invented or lost: every entry's cumulative update is still exactly dense
momentum's (the debt is repaid in full), the sent part only arrives sooner. Conservation
then holds as ``acc = sent + residual`` to one rounding per sent value (``sent`` is
``acc + c·u`` rounded), not bit for bit. Entries of tensors sent whole (a dense prefix, an
all-reduce) keep ordinary momentum and carry nothing ahead, and so, for the step, do those of
a tensor of which the selection takes over a fifth of the entries (``engine.jobs.resent``: a
classifier whose entries are sent step after step, where a lead only amplifies what
oscillates; it broke TopkA on ResNet-18). Measured on the CNN at 1 % (P = 4, SGD, 10 seeds):
``a = 1/3`` turned TopkA's gap to DDP into a gain, almost all of it from the tensors the
selection takes most of, below a fifth (the output layer's 14 %; docs/results/accuracy-history.md,
"Momentum sent ahead" and "... skips the tensors a step resends"). A preconditioned buffer
(AdamW's frozen variance) has a share of its own, ``ahead_preconditioned``: ``Config``'s
default sends nothing ahead there (measured: TinyGPT, 2 ranks, 8 steps, AdamW's recipe with
one exact step, TopkA's loss reached 56 at 1/3 and 110 at 1, 4.4 without).

**Residual dtype.** ``residual_dtype="auto"`` keeps residuals and velocities of 16-bit
(bf16/fp16) gradients in fp32 and every other gradient in its own dtype; a 16-bit residual
loses the small entries it accumulates to rounding (measured: 0.3% of the gradient mass over 60
bf16 steps). The values then travel in the gradient's dtype and the rounding stays in the
residual (``sent_values`` below).

**Preconditioning** (:meth:`ErrorFeedback.precondition`). A tensor may carry a fixed,
positive per-entry scale ``s``; from then on its gradient enters as ``s ⊙ g_t`` (in the residual
dtype), and the residual and velocity it already holds are multiplied by ``s`` once, so
everything accumulated stays in one unit. The selection then ranks entries by ``|s ⊙ acc|``, what
they contribute to the update of an optimizer that divides by a frozen ``1/s``
(:class:`gradsync.optim.FrozenVarianceAdamW`), instead of by the raw gradient's magnitude.

**Buffers** (:meth:`ErrorFeedback.accumulate_buffer`). The same two steps for a fusion buffer at
once: the gradients of several tensors, concatenated, in one residual and one velocity, so a
step costs a few operations per buffer instead of a few per tensor (on a GPU each operation is a
kernel launch). The per-tensor arithmetic and results are the same; a buffer's entries are
still answered per name (:meth:`ErrorFeedback.residual`, :meth:`ErrorFeedback.state_dict`), and
a per-name call on a buffered tensor first splits its buffer back into per-name entries.

NaN/Inf gradients are rejected with ``ValueError`` *before* any state changes, so a residual is
never polluted by a non-finite value; the engine decides whether to raise or skip the step.
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from gradsync.sparsegrad import bincount, check_finite, constant

__all__ = ["ErrorFeedback", "Units", "check_scale", "clip_local", "saved_rates", "saved_scale"]


@dataclass
class _Buffer:
    """The residual and velocity of a fusion buffer's tensors, concatenated in ``names`` order
    (:meth:`ErrorFeedback.accumulate_buffer`)."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    residual: torch.Tensor | None = None  # None: nothing held yet
    velocity: torch.Tensor | None = None
    spare: torch.Tensor | None = None  # the velocity a commit replaced (computed into next)
    scale: torch.Tensor | None = None  # the tensors' preconditioning scales (1 elsewhere)
    zero: bool = True  # the residual holds zeros only (or nothing)
    pending: bool = False
    pending_velocity: torch.Tensor | None = None
    pending_acc: torch.Tensor | None = None  # the acc accumulate_buffer made, when new (not
    # the velocity): update_buffer takes it over as the residual

    def slices(self) -> list[tuple[str, int, int]]:
        out, o = [], 0
        for n, k in zip(self.names, self.sizes):
            out.append((n, o, o + k))
            o += k
        return out


class ErrorFeedback:
    """Residual memory keyed by tensor name.

    Args:
        momentum: DGC momentum-correction factor ``m`` in [0, 1); 0 is plain error feedback.
        masking: DGC's momentum factor masking on compressed tensors (default ``True``;
            module docstring, "Masking").
        residual_dtype: dtype of the residual (and velocity): a floating dtype, ``None`` (each
            gradient's own dtype) or ``"auto"`` (fp32 for bf16/fp16 gradients, the gradient's
            own dtype otherwise; module docstring).
        ahead: the share ``a`` in [0, 1] of a compressed entry's velocity tail sent with it
            (module docstring, "Ahead"; 0: none); excludes ``masking``. The caller sends
            ``acc + c·u`` at the selected positions (:meth:`lead`) and passes those values to
            :meth:`update_buffer` as ``sent_values``.
        ahead_preconditioned: the share for a buffer whose tensors are preconditioned
            (:meth:`precondition`: AdamW's frozen variance); ``None`` (default): ``ahead``.
    """

    def __init__(self, momentum: float = 0.0,
                 residual_dtype: torch.dtype | str | None = None, masking: bool = True,
                 ahead: float = 0.0, ahead_preconditioned: float | None = None) -> None:
        if not 0.0 <= float(momentum) < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
        ahead_preconditioned = ahead if ahead_preconditioned is None else ahead_preconditioned
        for a in (ahead, ahead_preconditioned):
            if isinstance(a, bool) or not 0.0 <= float(a) <= 1.0:
                raise ValueError(f"ahead must be in [0, 1], got {a!r}")
        if (ahead or ahead_preconditioned) and masking and momentum:
            raise ValueError("ahead and masking exclude each other: masking drops the "
                             "velocity that ahead sends early (module docstring)")
        if isinstance(residual_dtype, str):
            if residual_dtype != "auto":
                raise ValueError(f"residual_dtype must be a floating dtype, None or 'auto', got "
                                 f"{residual_dtype!r}")
        elif residual_dtype is not None and not (isinstance(residual_dtype, torch.dtype)
                                                 and residual_dtype.is_floating_point):
            raise ValueError(f"residual_dtype must be floating point, got {residual_dtype}")
        if not isinstance(masking, bool):
            raise ValueError(f"masking must be True or False, got {masking!r}")
        self.momentum = float(momentum)
        self.masking = masking
        self.ahead = float(ahead)
        self.ahead_preconditioned = float(ahead_preconditioned)
        self.residual_dtype = residual_dtype
        self._residual: dict[str, torch.Tensor] = {}
        self._velocity: dict[str, torch.Tensor] = {}
        self._pending: set[str] = set()  # accumulated, not yet updated
        self._pending_velocity: dict[str, torch.Tensor] = {}
        # the velocity a commit replaced: the next step's velocity is computed into it (no
        # allocation; the committed one stays intact until then, so discard() can keep it)
        self._spare: dict[str, torch.Tensor] = {}
        self._zero: set[str] = set()  # residuals known to be all zeros (sent whole)
        self._scale: dict[str, torch.Tensor] = {}  # precondition(): fixed per-entry scales
        self._buffers: dict[Hashable, _Buffer] = {}  # accumulate_buffer(): per buffer key
        self._buffer_of: dict[str, Hashable] = {}  # a buffered name → its buffer's key

    def dtype_for(self, grad_dtype: torch.dtype) -> torch.dtype:
        """The dtype a gradient of ``grad_dtype`` accumulates in."""
        if self.residual_dtype == "auto":
            return torch.float32 if grad_dtype in (torch.bfloat16, torch.float16) else grad_dtype
        return self.residual_dtype or grad_dtype

    def transforms(self, name: str) -> bool:
        """Whether :meth:`accumulate` changes ``name``'s gradient even when it is sent whole
        (momentum or a scale): a dense all-reduce must then carry ``acc``, not the gradient."""
        return bool(self.momentum) or name in self._scale

    def precondition(self, name: str, scale: torch.Tensor) -> None:
        """From the next :meth:`accumulate` on, ``name``'s gradient enters multiplied by
        ``scale`` (finite, > 0, as many entries, flat or shaped alike); a residual and velocity
        already held are multiplied by it now (module docstring, "Preconditioning"). A second
        call replaces the scale and rescales the state by the ratio. ``ValueError`` between
        :meth:`accumulate` and :meth:`update`, or for a bad scale."""
        if name in self._pending or self._buffer_pending(name):
            raise ValueError(f"precondition({name!r}) between accumulate() and update(): "
                             "scales change between steps only")
        self._split(name)
        s = check_scale(name, scale)
        old = self._scale.get(name)
        if old is not None and old.numel() != s.numel():
            raise ValueError(f"the scale of {name!r} has {s.numel()} entries, its previous "
                             f"scale {old.numel()}")
        factor = s if old is None else s / old.reshape(s.shape)
        for store in (self._residual, self._velocity):  # held flat or shaped: entries match
            held = store.get(name)
            if held is None:
                continue
            if held.numel() != s.numel():
                raise ValueError(f"the scale of {name!r} has {s.numel()} entries, its "
                                 f"residual {held.numel()}")
            store[name] = held * factor.reshape(held.shape).to(held.device, held.dtype)
        self._scale[name] = s.clone()
        # a zero residual stays zero: _zero still holds

    def rescale(self, factor: float) -> None:
        """Multiply every residual and velocity held by ``factor`` (finite, > 0): the gradients
        that arrive from now on are ``factor`` times those held before, e.g. a loss scale that
        changed from S to ``factor``·S (``torch.amp.GradScaler``: factor 2 or 1/2, a power of
        two, so the held state is rescaled exactly). ``ValueError`` between :meth:`accumulate`
        and :meth:`update`, or for a bad factor."""
        f = self._between_updates(factor, "rescale")
        for store in (self._residual, self._velocity):
            for t in store.values():
                t.mul_(f)  # a zero residual stays zero: _zero still holds
        for b in self._buffers.values():
            for t in (b.residual, b.velocity):
                if t is not None:
                    t.mul_(f)

    def _between_updates(self, factor: float, what: str) -> float:
        """``factor`` as a float, or ``ValueError`` for a bad one or within a step."""
        f = float(factor)
        if not (math.isfinite(f) and f > 0):
            raise ValueError(f"{what}: factor must be finite and > 0, got {factor!r}")
        pending = sorted(self._pending) + [n for b in self._buffers.values() if b.pending
                                           for n in b.names]
        if pending:
            raise ValueError(f"{what}() between accumulate() and update() of "
                             f"{pending[:3]}: {what} between steps only")
        return f

    def rescale_residual(self, factor: float) -> None:
        """Multiply every residual held, not the velocities, by ``factor`` (finite, > 0): the
        learning rate changed from η to η/``factor`` (:class:`Units`), and the residual stays
        the same debt of update. One op for all of them. ``ValueError`` between
        :meth:`accumulate` and :meth:`update`, or for a bad factor."""
        f = self._between_updates(factor, "rescale_residual")
        held = [*self._residual.values(),
                *(b.residual for b in self._buffers.values() if b.residual is not None)]
        if held:
            torch._foreach_mul_(held, f)  # a zero residual stays zero: _zero still holds

    def scale(self, name: str) -> torch.Tensor | None:
        """``name``'s preconditioning scale (fp32), or None."""
        return self._scale.get(name)

    # -- the two steps of every iteration ---------------------------------------------
    def accumulate(self, name: str, grad: torch.Tensor, check: bool = True) -> torch.Tensor:
        """Return ``acc = residual + grad`` (with momentum correction when enabled).

        ``acc`` is a new tensor of ``grad``'s shape in the residual dtype; the caller selects
        from it and then calls :meth:`update` with what was consumed. ``check=False`` skips the
        NaN/Inf check, for a caller that has just checked ``grad`` itself.
        """
        if check:
            check_finite(grad, f"gradient of {name!r}")
        if self._buffer_pending(name):
            raise ValueError(f"accumulate({name!r}) while its buffer's accumulate_buffer() "
                             "awaits update_buffer()")
        self._split(name)
        dtype = self.dtype_for(grad.dtype)
        g = grad.detach().to(dtype)
        s = self._scale.get(name)
        if s is not None:
            if s.numel() != g.numel():
                raise ValueError(f"gradient of {name!r} has {g.numel()} entries, its scale "
                                 f"{s.numel()}")
            g = g * s.reshape(g.shape).to(g.device, dtype)  # new: never the caller's gradient
        res = self._residual.get(name)
        if res is not None and (res.shape != g.shape or res.dtype != dtype):
            raise ValueError(
                f"gradient of {name!r} has shape {tuple(g.shape)}/{dtype}, but its residual has "
                f"{tuple(res.shape)}/{res.dtype} (did the model change?)"
            )
        if self.momentum:
            u = self._velocity.get(name)
            if u is None:
                u = g if s is not None else g.clone()  # g is already a copy when scaled
            else:  # SGD's rounding, into the spare buffer when there is one
                spare = self._spare.pop(name, None)
                if (spare is None or spare.shape != u.shape or spare.dtype != u.dtype
                        or spare.device != u.device):
                    spare = torch.empty_like(u)
                u = torch.mul(u, self.momentum, out=spare).add_(g)
            self._pending_velocity[name] = u  # committed by update(), dropped by discard()
            g = u
        # a residual of zeros (the tensor was sent whole) adds nothing: no pass over it. With
        # momentum, acc is then the pending velocity itself (no copy): nothing writes to acc,
        # and update() masks the velocity only after it has copied acc into the residual
        if res is None or name in self._zero:
            acc = g if self.momentum or s is not None else g.clone()
        else:
            acc = res + g
        self._pending.add(name)
        return acc

    def update(
        self,
        name: str,
        acc: torch.Tensor,
        consumed_indices: torch.Tensor | None,
        sent_values: torch.Tensor | None = None,
        check: bool = True,
    ) -> torch.Tensor:
        """Keep in the residual exactly what was not consumed; return the new residual.

        ``consumed_indices`` index the flattened ``acc``; ``None`` means every entry was
        consumed (the tensor was sent whole: no index work, and the velocity carries on).
        ``sent_values`` (optional, one per consumed entry) are the values actually sent, when
        they differ from ``acc`` there (lower precision): their rounding error stays in the
        residual. ``check=False`` skips the range check of ``consumed_indices`` (a read back
        to the host), for a caller that has checked them itself.
        """
        if name not in self._pending:
            raise ValueError(f"update({name!r}) without a preceding accumulate({name!r})")
        flat = acc.detach().reshape(-1)
        whole = consumed_indices is None
        if whole:
            if sent_values is None and name in self._zero:
                # still all zeros (accumulate checked its shape and dtype): nothing to write
                residual = self._residual[name].view(-1)
            elif sent_values is None:
                residual = torch.zeros_like(flat)
            elif sent_values.numel() != flat.numel():
                raise ValueError(f"{flat.numel()} consumed entries (all of {name!r}) but "
                                 f"{sent_values.numel()} sent values")
            else:
                residual = flat - sent_values.reshape(-1).to(flat.dtype)
        else:
            idx = consumed_indices.reshape(-1).to(torch.int64)
            if check and idx.numel():
                lo, hi = torch.stack(torch.aminmax(idx)).tolist()  # one read-back
                if lo < 0 or hi >= flat.numel():
                    raise ValueError(f"consumed indices of {name!r} out of range "
                                     f"[0, {flat.numel()})")
            whole = idx.numel() == flat.numel()  # distinct indices (a selection): all of it
            residual = flat.clone()
            if sent_values is None:
                # index_fill_, not ``residual[idx] = 0``: on CUDA the Python 0 is copied to the
                # device first, a host-to-device copy that waits for the stream (once per
                # tensor and step: 66 of TopkA's 70 syncs per ResNet-18 step on an H100)
                residual.index_fill_(0, idx, 0)
            else:
                if sent_values.numel() != idx.numel():
                    raise ValueError(
                        f"{idx.numel()} consumed indices but {sent_values.numel()} sent values"
                    )
                residual[idx] = flat[idx] - sent_values.reshape(-1).to(flat.dtype)
        if self.momentum:
            u = self._pending_velocity.pop(name)
            if not whole and self.masking:  # compressed: momentum factor masking (DGC §3.2)
                u.view(-1).index_fill_(0, idx, 0)  # no host-to-device copy (above)
            # else sent whole: the velocity carries on, as SGD's momentum buffer does
            old = self._velocity.get(name)
            if old is not None and old is not u:
                self._spare[name] = old  # nothing else holds it once this step is done
            self._velocity[name] = u
        self._residual[name] = residual.view_as(acc)
        if whole and sent_values is None:
            self._zero.add(name)
        else:
            self._zero.discard(name)
        self._pending.discard(name)
        return self._residual[name]

    def discard(self, name: str) -> None:
        """Drop a pending :meth:`accumulate` of ``name``: residual and velocity stay as they
        were before it (a skipped step). For a buffered tensor, its whole buffer's pending step
        is dropped (:meth:`discard_buffer`)."""
        key = self._buffer_of.get(name)
        if key is not None:
            self.discard_buffer(key)
        self._pending.discard(name)
        u = self._pending_velocity.pop(name, None)
        if u is not None and u is not self._velocity.get(name):
            self._spare[name] = u  # free again: the next step computes into it

    # -- a fusion buffer at once (module docstring, "Buffers") -----------------------------
    def accumulate_buffer(self, key: Hashable, names: Sequence[str], sizes: Sequence[int],
                          grad: torch.Tensor) -> torch.Tensor:
        """:meth:`accumulate` of every tensor of a buffer at once: ``grad`` is their flat
        gradients concatenated in ``names`` order (``sizes`` entries each, checked finite by
        the caller); returns the flat ``acc``, new, in the residual dtype. ``key`` names the
        buffer from step to step; when its tensors change (another plan), the residuals and
        velocities they hold move into the new buffer."""
        b = self._buffers.get(key)
        if b is None or b.names != tuple(names) or b.sizes != tuple(sizes):
            if grad.dim() != 1 or grad.numel() != sum(sizes) or len(names) != len(sizes):
                raise ValueError(f"accumulate_buffer: {len(names)} names and {len(sizes)} sizes "
                                 f"({sum(sizes)} entries) for a gradient of shape "
                                 f"{tuple(grad.shape)}")
            b = self._form(key, tuple(names), tuple(sizes), grad)
        if b.pending:
            raise ValueError(f"accumulate_buffer({key!r}) twice without update_buffer()")
        dtype = self.dtype_for(grad.dtype)
        g = grad.detach().to(dtype)
        owned = dtype != grad.dtype or b.scale is not None  # g is a new tensor, not grad
        if b.scale is not None:
            g = g * b.scale.to(g.device, dtype)  # new: never the caller's gradient
        if b.residual is not None and (b.residual.numel() != g.numel()
                                       or b.residual.dtype != dtype):
            raise ValueError(f"buffer {key!r}: gradient of {g.numel()} entries/{dtype}, its "
                             f"residual {b.residual.numel()}/{b.residual.dtype}")
        if self.momentum:
            u = b.velocity
            if u is None:
                u = g if owned else g.clone()
            else:
                spare, b.spare = b.spare, None
                if spare is None or spare.shape != u.shape or spare.dtype != u.dtype:
                    spare = torch.empty_like(u)
                u = torch.mul(u, self.momentum, out=spare).add_(g)
            b.pending_velocity = u
            g, owned = u, True
        acc = (g if owned else g.clone()) if b.residual is None or b.zero else b.residual + g
        b.pending = True
        b.pending_acc = None if acc is b.pending_velocity else acc
        return acc

    def lead(self, key: Hashable) -> tuple[torch.Tensor, float] | None:
        """Buffer ``key``'s pending velocity ``u`` and the factor ``c = ahead·m/(1 − m)``
        by which a compressed entry's sent value leads its accumulator, ``acc + c·u``
        (module docstring, "Ahead"); None without ``ahead`` or momentum, or outside a pending
        :meth:`accumulate_buffer`. A buffer with a preconditioned tensor
        (:meth:`precondition`) leads by ``ahead_preconditioned``'s share instead."""
        b = self._buffers.get(key)
        if not self.momentum or b is None or b.pending_velocity is None:
            return None
        a = (self.ahead_preconditioned if self._scale and any(n in self._scale for n in b.names)
             else self.ahead)
        return (b.pending_velocity, a * self.momentum / (1.0 - self.momentum)) if a else None

    def writable(self, key: Hashable, acc: torch.Tensor) -> bool:
        """Whether ``acc`` is the accumulator :meth:`accumulate_buffer` made new for buffer
        ``key``'s pending step (not the velocity): the caller may then write into the positions
        it reports consumed, with no value sent back (:meth:`update_buffer` zeroes them), e.g.
        an all-reduce that sums in place."""
        b = self._buffers.get(key)
        return b is not None and b.pending and acc is b.pending_acc

    def update_buffer(self, key: Hashable, acc: torch.Tensor, consumed: torch.Tensor | None,
                      sent_values: torch.Tensor | None = None, *, whole: int = 0
                      ) -> torch.Tensor:
        """:meth:`update` of a buffer: ``consumed`` are positions in the flat ``acc`` (in range,
        distinct: the caller checked them), ``None`` when every entry was sent; ``sent_values``
        as in :meth:`update`. Returns the buffer's new residual (flat). Masking leaves the
        velocity of a tensor whose every entry was consumed, as :meth:`update` does. The
        ``acc`` that :meth:`accumulate_buffer` returned, when it made a new one (not the
        velocity), becomes the residual in place (no copy of the buffer): the caller is done
        with it. ``whole``: the buffer's first ``whole`` entries (whole tensors: SSFusion-I's
        all-reduce part) were sent too, ``consumed`` then being positions in ``acc[whole:]``
        and ``sent_values`` holding those entries' values first."""
        b = self._buffers.get(key)
        if b is None or not b.pending:
            raise ValueError(f"update_buffer({key!r}) without a preceding accumulate_buffer()")
        flat = acc.detach().reshape(-1)
        if consumed is not None:
            return self._update_consumed(b, key, acc, flat, consumed, sent_values, whole)
        if sent_values is not None:  # every entry sent
            if sent_values.numel() != flat.numel():
                raise ValueError(f"{flat.numel()} consumed entries (all of buffer {key!r}) "
                                 f"but {sent_values.numel()} sent values")
            residual = flat - sent_values.reshape(-1).to(flat.dtype)
        elif b.zero and b.residual is not None and b.residual.shape == flat.shape:
            residual = b.residual  # still all zeros: nothing to write
        else:
            residual = torch.zeros_like(flat)
        b.zero = sent_values is None
        if self.momentum:  # sent whole: the velocity carries on
            self._commit_velocity(b, b.pending_velocity)
        return self._commit(b, residual)

    def _update_consumed(self, b: _Buffer, key: Hashable, acc: torch.Tensor,
                         flat: torch.Tensor, consumed: torch.Tensor,
                         sent_values: torch.Tensor | None, whole: int) -> torch.Tensor:
        """:meth:`update_buffer` of the positions ``consumed`` after the first ``whole``
        entries (sent whole too; 0: none)."""
        first = 0  # the first tensor after those sent whole
        if whole:  # a walk over the tensors only then (SSFusion-I's buckets), not every step
            ends = list(itertools.accumulate(b.sizes))
            if whole not in ends:
                raise ValueError(f"update_buffer({key!r}): {whole} entries sent whole end "
                                 f"inside a tensor (tensors end at {ends[:4]}…)")
            first = ends.index(whole) + 1
        idx = consumed.reshape(-1).to(torch.int64)
        residual = flat if acc is b.pending_acc else flat.clone()
        # the part after those sent whole (no slicing without any: views are ops too)
        tail = residual[whole:] if whole else residual
        if sent_values is None:
            if whole:
                residual[:whole].zero_()
            tail.index_fill_(0, idx, 0)  # no host-to-device copy (update())
        else:
            sent = sent_values.reshape(-1).to(flat.dtype)
            if sent.numel() != whole + idx.numel():
                head_s = f"{whole} entries sent whole and " if whole else ""
                raise ValueError(f"{head_s}{idx.numel()} consumed indices but {sent.numel()} "
                                 "sent values")
            if whole:
                residual[:whole].copy_(flat[:whole] - sent[:whole])
                tail[idx] = flat[whole:][idx] - sent[whole:]
            else:
                tail[idx] = flat[idx] - sent
        b.zero = sent_values is None and idx.numel() == tail.numel()
        if self.momentum:
            u = b.pending_velocity
            if self.masking and idx.numel() < tail.numel():  # DGC §3.2, compressed tensors only
                self._mask(b, u, idx, first)
            self._commit_velocity(b, u)
        return self._commit(b, residual)

    @staticmethod
    def _commit_velocity(b: _Buffer, u: torch.Tensor) -> None:
        if b.velocity is not None and b.velocity is not u:
            b.spare = b.velocity
        b.velocity = u

    @staticmethod
    def _commit(b: _Buffer, residual: torch.Tensor) -> torch.Tensor:
        b.residual = residual
        b.pending, b.pending_velocity, b.pending_acc = False, None, None
        return residual

    def discard_pending(self) -> None:
        """:meth:`discard_buffer` of every buffer accumulated and not yet updated: a step
        abandoned midway (a collective that raised) leaves every residual and velocity as
        before it."""
        for key in [k for k, b in self._buffers.items() if b.pending]:
            self.discard_buffer(key)

    def discard_buffer(self, key: Hashable) -> None:
        """:meth:`discard` of a buffer: its residual and velocity stay as before the step."""
        b = self._buffers.get(key)
        if b is None:
            return
        u = b.pending_velocity
        if u is not None and u is not b.velocity:
            b.spare = u
        b.pending, b.pending_velocity, b.pending_acc = False, None, None

    @staticmethod
    def _mask(b: _Buffer, u: torch.Tensor, idx: torch.Tensor, first: int = 0) -> None:
        """Masking of the velocity ``u`` at the consumed positions ``idx`` that lie in tensors
        not consumed whole; no read (the positions are not selected, their values are).
        ``first``: the positions count from tensor ``first``'s start (the tensors before it
        travelled whole)."""
        tail = b.sizes[first:]
        ends = constant(tuple(itertools.accumulate(tail)), torch.int64, idx.device)
        sizes = constant(tail, torch.int64, idx.device)
        owner = torch.searchsorted(ends, idx, right=True)
        whole = (bincount(owner, len(tail)) == sizes)[owner]
        u = u[sum(b.sizes[:first]):]
        u.index_put_((idx,), torch.where(whole, u[idx], 0))

    def _form(self, key: Hashable, names: tuple[str, ...], sizes: tuple[int, ...],
              like: torch.Tensor) -> _Buffer:
        """A buffer over ``names``: what each name holds (per name or in another buffer),
        concatenated; a name that holds nothing holds zeros."""
        if self._buffer_pending(*names) or any(n in self._pending for n in names):
            raise ValueError(f"accumulate_buffer({key!r}): a tensor of it awaits update()")
        old = self._buffers.pop(key, None)
        if old is not None:
            self._unbuffer(old)
        for n in names:
            self._split(n)
        b = _Buffer(names, sizes)
        for field_, store in (("residual", self._residual), ("velocity", self._velocity)):
            held = [store.get(n) for n in names]
            if all(t is None for t in held):
                continue
            proto = next(t for t in held if t is not None)
            setattr(b, field_, torch.cat([
                t.reshape(-1) if t is not None else proto.new_zeros(k)
                for t, k in zip(held, sizes)]))
        b.zero = all(n in self._zero or n not in self._residual for n in names)
        if any(n in self._scale for n in names):
            b.scale = torch.cat([
                self._scale[n].reshape(-1).to(like.device) if n in self._scale
                else torch.ones(k, dtype=torch.float32, device=like.device)
                for n, k in zip(names, sizes)])
        for n in names:
            for store in (self._residual, self._velocity, self._spare):
                store.pop(n, None)
            self._zero.discard(n)
            self._buffer_of[n] = key
        self._buffers[key] = b
        return b

    def _split(self, name: str) -> None:
        """Move ``name``'s buffer, if any, back to per-name entries (views of it)."""
        key = self._buffer_of.get(name)
        if key is not None:
            self._unbuffer(self._buffers.pop(key))

    def _unbuffer(self, b: _Buffer) -> None:
        if b.pending:
            raise ValueError(f"a per-name call on {b.names[0]!r} while its buffer awaits "
                             "update_buffer()")
        for n, lo, hi in b.slices():
            self._buffer_of.pop(n, None)
            if b.residual is not None:
                self._residual[n] = b.residual[lo:hi]
                if b.zero:
                    self._zero.add(n)
            if b.velocity is not None:
                self._velocity[n] = b.velocity[lo:hi]

    def _buffer_pending(self, *names: str) -> bool:
        return any(self._buffers[k].pending for k in
                   {self._buffer_of[n] for n in names if n in self._buffer_of})

    def _entry(self, key: Hashable, name: str, field_: str) -> torch.Tensor | None:
        b = self._buffers[key]
        flat = getattr(b, field_)
        if flat is None:
            return None
        i = b.names.index(name)
        lo = sum(b.sizes[:i])
        return flat[lo:lo + b.sizes[i]]

    def _held(self, field_: str) -> dict[str, torch.Tensor]:
        """Every name's residual or velocity, buffered ones as views."""
        out = dict(self._residual if field_ == "residual" else self._velocity)
        for b in self._buffers.values():
            flat = getattr(b, field_)
            if flat is not None:
                out.update({n: flat[lo:hi] for n, lo, hi in b.slices()})
        return out

    # -- inspection and state -----------------------------------------------------------
    def residual(self, name: str) -> torch.Tensor | None:
        """``name``'s residual (flat when it was accumulated flat), or None."""
        key = self._buffer_of.get(name)
        if key is None:
            return self._residual.get(name)
        return self._entry(key, name, "residual")

    def velocity(self, name: str) -> torch.Tensor | None:
        """``name``'s DGC velocity ``u`` (committed by the last update), or None."""
        key = self._buffer_of.get(name)
        if key is None:
            return self._velocity.get(name)
        return self._entry(key, name, "velocity")

    def names(self) -> list[str]:
        return sorted({*self._residual, *(n for b in self._buffers.values()
                                          if b.residual is not None for n in b.names)})

    def reset(self, name: str | None = None) -> None:
        """Forget the residual (and velocity) of ``name``, or of every tensor; scales stay."""
        if name is None:
            self._buffers.clear()
            self._buffer_of.clear()
        else:
            self.discard(name)
            self._split(name)
        for store in (self._residual, self._velocity, self._spare):
            if name is None:
                store.clear()
            else:
                store.pop(name, None)
        if name is None:
            self._pending.clear()
            self._pending_velocity.clear()
            self._zero.clear()
        else:
            self.discard(name)
            self._zero.discard(name)

    def state_dict(self) -> dict[str, Any]:
        return {
            "momentum": self.momentum,
            "masking": self.masking,
            "ahead": self.ahead,
            "ahead_preconditioned": self.ahead_preconditioned,
            "residual_dtype": _dtype_name(self.residual_dtype),
            "residual": {k: v.clone() for k, v in self._held("residual").items()},
            "velocity": {k: v.clone() for k, v in self._held("velocity").items()},
            "scale": {k: v.clone() for k, v in self._scale.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if float(state["momentum"]) != self.momentum:
            raise ValueError(
                f"state has momentum {state['momentum']}, this ErrorFeedback has {self.momentum}"
            )
        if bool(state.get("masking", True)) != self.masking:  # saved before: masking on
            raise ValueError(f"state has masking={state.get('masking', True)}, this "
                             f"ErrorFeedback has masking={self.masking} (a checkpoint saved "
                             f"before the option had it on: Config(momentum_masking=True))")
        # saved before the option: none; without momentum ahead sends nothing, whatever it is;
        # saved before ahead_preconditioned: ahead's share applied to every buffer
        saved = float(state.get("ahead", 0.0))
        theirs = (saved, float(state.get("ahead_preconditioned", saved)))
        if self.momentum and theirs != (self.ahead, self.ahead_preconditioned):
            raise ValueError(f"state has ahead={theirs[0]} (preconditioned: {theirs[1]}), this "
                             f"ErrorFeedback has ahead={self.ahead} (preconditioned: "
                             f"{self.ahead_preconditioned}) (the residual holds debts under "
                             "ahead: resume with the saved Config.momentum_ahead)")
        mine = _dtype_name(self.residual_dtype)
        if state.get("residual_dtype") != mine:
            raise ValueError(
                f"state has residual_dtype {state.get('residual_dtype')}, this one has {mine}"
            )
        self._buffers.clear()
        self._buffer_of.clear()
        self._residual = {k: v.clone() for k, v in state["residual"].items()}
        self._velocity = {k: v.clone() for k, v in state["velocity"].items()}
        # saved before preconditioning existed: no scales
        self._scale = {k: v.to(torch.float32).clone() for k, v in state.get("scale", {}).items()}
        self._spare.clear()
        self._zero.clear()
        self._pending.clear()
        self._pending_velocity.clear()


def check_scale(name: str, scale: object) -> torch.Tensor:
    """``scale`` as fp32 if it is a floating tensor, finite and > 0 everywhere; else
    ``ValueError`` naming ``name``."""
    if not (isinstance(scale, torch.Tensor) and scale.is_floating_point()):
        raise ValueError(f"the scale of {name!r} must be a floating tensor, got "
                         f"{type(scale).__name__}")
    s = scale.detach().to(torch.float32)
    if not bool(torch.isfinite(s).all()) or not bool((s > 0).all()):
        raise ValueError(f"the scale of {name!r} must be finite and > 0 everywhere")
    return s


def _dtype_name(d: torch.dtype | str | None) -> str | None:
    return d if d is None or isinstance(d, str) else str(d)


# -- what an owner follows: a dynamic loss scale, a learning rate schedule ----------------
# Gradients arrive multiplied by the loss scale S (torch.amp.GradScaler), so residuals and
# velocities hold S-scaled values: an owner of error feedback (GradSync, the DDP hook) that
# follows a scaler reads S at each step's first gradient and brings what it holds to it.
# The residual is also a debt of update: what dense SGD would have moved the weights by, η_s·u_s
# for each step s, not yet sent. Held in gradient units, an entry sent at step t is applied at
# η_t instead of the η_s it was owed at; under a schedule an entry held for many steps then
# moves the weights by η_t/η_s times what it owed (Stich et al. 2018 keep the memory as
# η·g for this reason). An owner that follows the optimizer reads η at each step's first
# gradient and multiplies the residual by η_{t−1}/η_t, so that it stays the same debt in
# update units; velocities stay in gradient units, as dense momentum's buffer does. The S and
# η the contents are in travel in the owner's state_dict, so a resumed job is brought there.
@dataclass
class Units:
    """What an owner of error feedback (:class:`gradsync.GradSync`, the DDP hook) follows —
    a GradScaler, an optimizer — and the loss scale S and learning rates η (one per param
    group) its error feedback's contents are in."""

    scaler: Any = field(default=None, repr=False)
    loss_scale: float | None = None
    optimizer: Any = field(default=None, repr=False)
    lr: tuple[float, ...] | None = None
    uneven: bool = False  # warned once: the groups' rates changed by different factors

    def follow(self, what: Any, nonfinite: str, who: str) -> None:
        """Follow ``what`` from the next step on: an optimizer (anything with
        ``param_groups``, each with an ``"lr"``) or a ``torch.amp.GradScaler``. ``ValueError``
        for anything else, or for an enabled scaler unless the owner's ``Config.nonfinite`` is
        ``"skip_step"``: a scaler skips the steps whose gradients overflow (and backs off),
        which ``"raise"`` would turn into errors."""
        groups = getattr(what, "param_groups", None)
        if groups is not None:
            if not groups or not all(isinstance(g, dict) and "lr" in g for g in groups):
                raise ValueError(f"{who}.follow: {type(what).__name__}'s param_groups need an "
                                 f"'lr' each")
            self.optimizer = what  # the held rates stay: they are the residual's units
            return
        if not (callable(getattr(what, "get_scale", None))
                and callable(getattr(what, "is_enabled", None))):
            raise ValueError(f"{who}.follow takes a torch.amp.GradScaler or an optimizer, got "
                             f"{type(what).__name__}")
        if what.is_enabled() and nonfinite != "skip_step":
            raise ValueError(f"{who}.follow: a GradScaler skips the steps whose gradients "
                             f"overflow, and Config.nonfinite={nonfinite!r} raises on them: use "
                             f"Config(nonfinite='skip_step') with a loss scaler")
        self.scaler = what

    def update(self, rescale: Callable[[float], None],
               rescale_residual: Callable[[float], None]) -> None:
        """At a step's first gradient: when following a scaler, S′ = its scale now and, when
        what the owner holds (error feedback's contents, reused thresholds) is in another S,
        ``rescale(S′ / S)`` first; when following an optimizer, η′ = its rates now and, when
        the residual is in other rates, ``rescale_residual(η / η′)``. A rate of 0 (or one
        not finite) leaves the held units as they were (nothing is owed at it); groups whose
        rates changed by different factors leave them too, with one warning."""
        if self.scaler is not None:
            now = float(self.scaler.get_scale())
            if self.loss_scale is not None and now != self.loss_scale:
                rescale(now / self.loss_scale)
            self.loss_scale = now
        if self.optimizer is None:
            return
        rates = tuple(float(g["lr"]) for g in self.optimizer.param_groups)
        held = self.lr if self.lr is not None and len(self.lr) == len(rates) else rates
        factors = [h / r for h, r in zip(held, rates) if h > 0 and 0 < r < math.inf]
        if all(math.isclose(f, factors[0], rel_tol=1e-9) for f in factors):
            if factors and factors[0] != 1:
                rescale_residual(factors[0])
        elif not self.uneven:
            self.uneven = True
            warnings.warn("gradsync: the optimizer's param groups changed their learning rates "
                          "by different factors; error feedback keeps its residual in the "
                          "rates it holds", stacklevel=2)
        self.lr = tuple(r if 0 < r < math.inf else h for h, r in zip(held, rates))


def saved_scale(value: Any, who: str) -> float | None:
    """A state_dict's ``loss_scale`` entry, checked: ``None`` or finite and > 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and value > 0):
        raise ValueError(f"{who}: the saved loss_scale must be finite and > 0, got {value!r}")
    return float(value)


def saved_rates(value: Any, who: str) -> tuple[float, ...] | None:
    """A state_dict's ``lr`` entry (:class:`Units`), checked: ``None`` or a list of finite
    rates >= 0 (a checkpoint saved before the entry existed has none: the next step reads the
    optimizer's rates afresh)."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not value or not all(
            not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
            and v >= 0 for v in value):
        raise ValueError(f"{who}: the saved lr must be a list of finite rates >= 0, got "
                         f"{value!r}")
    return tuple(float(v) for v in value)


def clip_local(grads: list[torch.Tensor], max_norm: float, world_size: int
               ) -> list[torch.Tensor]:
    """DGC's local gradient clipping (§3.3): this rank's gradients scaled down, before they
    enter error feedback, so that each tensor's L2 norm is at most ``max_norm / √P``. The N^{-1/2}
    is DGC's: the share of a global threshold that one of P ranks with alike gradient
    distributions holds. Clipping is per tensor because the engine and the DDP hook accumulate
    each fusion buffer while the backward is still running, before the whole gradient's norm
    exists. Returns new tensors (the gradients are not modified); the scale is one op per list
    (``torch._foreach_norm``/``_foreach_mul``), computed in fp32 as ``clip_grad_norm_`` does."""
    if not grads:
        return []
    threshold = float(max_norm) / math.sqrt(world_size)
    norms = torch.stack([n.float() for n in torch._foreach_norm(grads)])
    coef = (threshold / (norms + 1e-6)).clamp(max=1.0)
    return list(torch._foreach_mul(grads, list(coef.unbind())))
