"""FSDP2: ``compress(model, TAGCConfig(...))`` runs TAGC as the sharded units' reduce-scatter.

The implementation lives in :mod:`gradsync.integrations.fsdp`; this module is its public name.
"""

from gradsync.integrations.fsdp import (
    TAGC,
    TAGCConfig,
    all_layers,
    compress,
    compressed_parameters,
    compressed_share,
    linear_like,
    non_attention_linear,
)

__all__ = ["TAGC", "TAGCConfig", "all_layers", "compress", "compressed_parameters",
           "compressed_share", "linear_like", "non_attention_linear"]
