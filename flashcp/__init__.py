"""FlashCP: load-balanced, communication-efficient context parallelism for packed documents.

Plan once per window (`plan_shards`), dispatch each rank's tokens (`Plan.dispatch`), then run
attention with only the KV other ranks need (`cp_varlen_attention`).
"""

from flashcp.plan import Plan, Shard, plan_shards

__all__ = ["Plan", "Shard", "plan_shards"]
