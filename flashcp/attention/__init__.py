"""Attention for FlashCP: one varlen kernel interface and the context-parallel op built on it.

May import: torch, `flashcp.plan` and `flashcp.dispatch` (the engine: plan -> dispatch -> attention).
"""

from flashcp.attention.collectives import CommRecord, record_comm
from flashcp.attention.cp import cp_varlen_attention
from flashcp.attention.kernels import BACKENDS, BackendUnavailable, varlen_attention
from flashcp.attention.latent import cp_latent_attention
from flashcp.attention.linear_cp import cp_causal_conv1d, cp_gated_delta
from flashcp.attention.linear_dispatch import build_linear_dispatch
from flashcp.attention.two_level import (build_two_level_dispatch, EXCHANGES, group_ranks_per_node,
                                         NodeLayoutError)

__all__ = [
    "BACKENDS",
    "BackendUnavailable",
    "build_linear_dispatch",
    "build_two_level_dispatch",
    "CommRecord",
    "cp_causal_conv1d",
    "cp_gated_delta",
    "cp_latent_attention",
    "cp_varlen_attention",
    "EXCHANGES",
    "group_ranks_per_node",
    "NodeLayoutError",
    "record_comm",
    "varlen_attention",
]
