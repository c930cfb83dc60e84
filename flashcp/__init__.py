"""FlashCP: load-balanced, communication-efficient context parallelism for packed documents.

Plan once per window (`plan_shards`), dispatch each rank's tokens (`Plan.dispatch`), then run
attention with only the KV other ranks need (`cp_varlen_attention`).
"""

from flashcp.attention import cp_varlen_attention, varlen_attention
from flashcp.dispatch import Dispatch
from flashcp.plan import Plan, Shard, plan_shards

__all__ = ["Dispatch", "Plan", "Shard", "cp_varlen_attention", "plan_shards", "varlen_attention"]
