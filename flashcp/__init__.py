"""FlashCP: load-balanced, communication-efficient context parallelism for packed documents.

Plan once per window (`plan_shards`), dispatch each rank's tokens (`build_dispatch`), then run
attention with only the KV other ranks need (`cp_varlen_attention`; MLA models exchange their
latent rows instead, `cp_latent_attention`).

The planner is pure Python; the torch-backed names below load on first use, so planning tools
(`python -m flashcp.plan`, `flashcp.data`) start without importing torch.
"""

from typing import Any

from flashcp.plan import Plan, Shard, plan_shards

_LAZY = {
    "Dispatch": "flashcp.dispatch",
    "build_dispatch": "flashcp.dispatch",
    "cp_latent_attention": "flashcp.attention",
    "cp_varlen_attention": "flashcp.attention",
    "varlen_attention": "flashcp.attention",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'flashcp' has no attribute {name!r}")


__all__ = [
    "Dispatch", "build_dispatch", "Plan", "Shard", "cp_latent_attention", "cp_varlen_attention", "plan_shards",
    "varlen_attention",
]  # fmt: skip
