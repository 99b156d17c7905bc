"""Integrations: thin adapters that put the library where people train.

:mod:`.ddp` (a ``DistributedDataParallel`` comm hook), :mod:`.fsdp` (TAGC as FSDP2's custom
reduce-scatter) and :mod:`.checkpoint` (per-rank state with the model and optimizer, via
``torch.save`` or ``torch.distributed.checkpoint``). Each is reachable from a bare
``import gradsync`` as ``gradsync.ddp``, ``gradsync.fsdp`` and ``gradsync.checkpoint``.
"""
