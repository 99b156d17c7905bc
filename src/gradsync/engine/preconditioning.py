"""Preconditioned error feedback: per-entry scales set once, agreed by every rank.

An optimizer that divides every entry by a *frozen* factor (1-bit Adam's frozen variance,
:class:`gradsync.optim.FrozenVarianceAdamW`) moves an entry by ``lr · acc / d``. Compressing the
raw accumulated gradient ``acc`` then ranks entries by the wrong measure: a tensor whose gradients
are small (a LayerNorm, a deep layer) but whose ``d`` is small too moves as much per unit of
``acc / d`` as any other, yet loses every top-k contest to the layers with large raw gradients.
With the scale ``s = 1 / d`` handed to error feedback (:meth:`ErrorFeedback.precondition`), the
selection ranks ``|s ⊙ acc|`` — the entries' contributions to the update — and the optimizer
applies what arrives without dividing. Sent whole, nothing changes: the update is linear in
``acc`` either way (tests/test_preconditioning.py checks it at density 1 across the freeze).

:func:`apply_scales` is the one helper :meth:`gradsync.GradSync.precondition` and the DDP hook's
:meth:`~gradsync.integrations.ddp.HookState.precondition` share: it names the tensors, checks
shapes, checks that every rank passes bit-identical scales (they are, when they come from the
optimizer state of synchronized replicas; otherwise the ranks would compress different
quantities), then hands them to error feedback. Call it between steps.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from gradsync.engine.consistency import check_same_tensors
from gradsync.feedback import ErrorFeedback, check_scale

__all__ = ["apply_scales", "resolver"]

Resolve = Callable[[object], tuple[str, tuple[int, ...]]]  # key -> (name, parameter shape)


def resolver(shapes: Mapping[str, Sequence[int]] | None,
             name_of: Callable[[torch.Tensor], str | None], owner: str) -> Resolve:
    """The ``resolve`` of :func:`apply_scales` for a key that is a parameter (named by
    ``name_of``; None: not one ``owner`` synchronizes) or a parameter's name (one of
    ``shapes``; None: names unknown); anything else is a ``ValueError``."""

    def resolve(key: object) -> tuple[str, tuple[int, ...]]:
        if isinstance(key, torch.Tensor):
            name = name_of(key)
            if name is None:
                raise ValueError(f"{owner}.precondition: a parameter {owner} does not "
                                 "synchronize")
            return name, tuple(key.shape)
        if not isinstance(key, str):
            raise ValueError(f"{owner}.precondition: keys are parameters or their names, got "
                             f"{type(key).__name__}")
        if shapes is None or key not in shapes:
            raise ValueError(f"{owner}.precondition: no parameter named {key!r}"
                             + (" (names need the model)" if shapes is None else ""))
        return key, tuple(shapes[key])

    return resolve


def apply_scales(ef: ErrorFeedback, scales: Mapping[object, torch.Tensor], resolve: Resolve,
                 group: dist.ProcessGroup | None, owner: str) -> list[str]:
    """Give ``ef`` the scales of ``scales`` (keyed as ``resolve`` understands: a parameter or
    its name). Every check runs before anything changes; the cross-rank check is one small
    all-gather (more only on a mismatch). Returns the names, sorted."""
    named: dict[str, torch.Tensor] = {}
    for key, s in scales.items():
        name, shape = resolve(key)
        if not isinstance(s, torch.Tensor):
            raise ValueError(f"{owner}.precondition: the scale of {name!r} must be a tensor, "
                             f"got {type(s).__name__}")
        if tuple(s.shape) != tuple(shape):
            raise ValueError(f"{owner}.precondition: the scale of {name!r} has shape "
                             f"{tuple(s.shape)}, the parameter {tuple(shape)}")
        if name in named:
            raise ValueError(f"{owner}.precondition: {name!r} given twice")
        named[name] = s.detach()  # stays on its device and in its dtype until checked
    order = sorted(named)
    check_same_tensors([(n, named[n]) for n in order], f"{owner}.precondition: the scales",
                       group)
    # identical on every rank now, so a bad value fails on every rank alike, before any change
    checked = {}
    for n in order:
        try:
            checked[n] = check_scale(n, named[n])
        except ValueError as e:
            raise ValueError(f"{owner}.precondition: {e}") from None
    for n in order:
        ef.precondition(n, checked[n])
    return order
