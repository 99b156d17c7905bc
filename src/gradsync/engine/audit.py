"""Audit (opt-in, for tests and debugging): what each parameter's synchronization consumed.

``GradSync(model, cfg, audit=True)`` keeps, for the last step, one :class:`AuditRecord` per
parameter in ``sync.audit_log`` (``audit=callable`` calls it with each record instead): the
accumulated gradient ``acc``, the indices and values this rank really put on the wire that
entered the result (taken from the payload handed to the collective, before it ran) and the new
residual, so that the error-feedback conservation law of ``docs/architecture.md`` ("Contracts")

    acc == scatter(sent_indices, sent_values) + residual

can be checked bit for bit. It clones every accumulated gradient and payload; leave it off in
training.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["AuditRecord", "AuditSink", "values_at"]


@dataclass
class AuditRecord:
    """What one parameter's synchronization did on this rank in one step (``audit=True``).

    All tensors are flat copies in the accumulator's dtype / int64. For ``dense`` jobs (no
    error feedback) ``acc`` is the raw gradient, every index is sent and ``residual`` is zeros.
    """

    step: int
    name: str
    mode: str  # the job's mode: "dense", "fused", "per_tensor"
    transport: str  # "allreduce" or the collective's name
    acc: torch.Tensor  # accumulated gradient (residual + gradient, momentum-corrected)
    sent_indices: torch.Tensor  # positions in ``acc`` consumed by the collective
    sent_values: torch.Tensor  # the values at those positions as they were handed to it
    residual: torch.Tensor  # residual after the step


class AuditSink:
    """Where records go: ``False`` nowhere, ``True`` the list :attr:`log` (the last step's),
    a callable each record as it is made."""

    def __init__(self, audit: bool | Callable[[AuditRecord], None]) -> None:
        if not (isinstance(audit, bool) or callable(audit)):
            raise ValueError(f"audit must be a bool or a callable, got {type(audit).__name__}")
        self._to = audit
        self.enabled = bool(audit)
        self.log: list[AuditRecord] = []

    def new_step(self) -> None:
        self.log = []

    def record(self, rec: AuditRecord) -> None:
        if callable(self._to):
            self._to(rec)
        else:
            self.log.append(rec)


def values_at(indices: torch.Tensor, values: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """``values`` of the selection ``(indices, values)`` at positions ``at``.

    A position the selection does not hold gets NaN, so an audit comparison fails loudly.
    """
    at = at.to(torch.int64)
    if indices.numel() == 0:
        return torch.full(at.shape, float("nan"), dtype=values.dtype, device=values.device)
    order = torch.argsort(indices.to(torch.int64))
    srt = indices.to(torch.int64)[order]
    pos = torch.searchsorted(srt, at).clamp_(max=srt.numel() - 1)
    # a where, not a masked write: that would read the mask's count to the host
    return torch.where(srt[pos] == at, values[order[pos]], float("nan"))
