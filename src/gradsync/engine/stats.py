"""`StepStats`: what one synchronization step cost a rank (and the sums over steps).

Bytes and messages are counted by :class:`~gradsync.collectives.comm.Comm` at the
torch.distributed call; the times split a step the way SSFusion's cost model does (§IV-A):
backward, sparsification (inline and offloaded), communication, and the part of communication
the backward pass did not hide (``wait_s``). ``missing`` counts the tensors of which no entry
was synchronized in the step (SSFusion Table I, the "tensor missing" of multi-tensor fusion).
"""

from __future__ import annotations

from dataclasses import dataclass

from gradsync.collectives.comm import CommStats

__all__ = ["StepStats"]


@dataclass
class StepStats:
    """One step's (or the cumulative) figures of a rank."""

    bytes_sent: int = 0
    bytes_recv: int = 0
    messages: int = 0
    backward_s: float = 0.0  # first to last gradient hook
    sparsify_s: float = 0.0  # inline + offloaded sparsification
    # the gradient hooks' time launching jobs, inside the backward pass (gathering, error
    # feedback, inline selection, the hand-off): the inline part of sparsify_s included
    hooks_s: float = 0.0
    comm_s: float = 0.0  # time inside collectives (communication thread)
    wait_s: float = 0.0  # synchronize() blocked on communication: the exposed part
    selected: int = 0  # entries this rank sent that entered the result
    numel: int = 0
    tensors: int = 0
    missing: int = 0  # tensors of which no entry was synchronized (SSFusion Table I)
    skipped: int = 0  # steps skipped for non-finite gradients

    @property
    def missing_rate(self) -> float:
        return self.missing / self.tensors if self.tensors else 0.0

    def add(self, other: StepStats) -> None:
        for k, v in vars(other).items():
            setattr(self, k, getattr(self, k) + v)

    def add_traffic(self, comm: CommStats) -> None:
        """Count a collective's bytes and messages (its seconds go to ``comm_s`` separately:
        the engine's own agreement all-reduce is not part of the plan's communication)."""
        self.bytes_sent += comm.bytes_sent
        self.bytes_recv += comm.bytes_recv
        self.messages += comm.messages

    def as_dict(self) -> dict[str, float]:
        d = dict(vars(self))
        d["missing_rate"] = self.missing_rate
        return d

    @classmethod
    def from_dict(cls, d: dict[str, float]) -> StepStats:
        """Inverse of :meth:`as_dict` (``missing_rate`` and unknown keys are ignored)."""
        out = cls()
        for k, v in d.items():
            if k != "missing_rate" and hasattr(out, k):
                setattr(out, k, v)
        return out
