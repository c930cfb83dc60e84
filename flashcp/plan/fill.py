"""Shards and running totals of every rank while a Whole-Doc plan is built.

Both steps of Whole-Doc sharding (placement in `flashcp.plan.whole_doc`, trades in
`flashcp.plan.rebalance`) and the hybrid (`flashcp.plan.hybrid`) work on one `RankFill`; it
lives apart so that each of them imports it without importing the others.
"""

from __future__ import annotations

from collections.abc import Sequence

from flashcp.plan.plan import CAUSAL, Shard, Workload


class RankFill:
    """Shards and running totals of every rank while a plan is being built.

    `room` is how many more tokens a rank should take and `spare` how many beyond that it may
    take (0 when token counts must come out exact). `work` is the exact workload of the shards
    placed, `sent` their tokens in non-last shards, and `bias` a per-rank workload the caller
    expects the rank to carry besides them (shards placed elsewhere, estimates); decisions use
    `bias + work`. Workloads are `workload`'s, which every step of the plan shares through this.
    """

    def __init__(
        self,
        room: Sequence[int],
        spare: Sequence[int] | None = None,
        bias: Sequence[float] | None = None,
        sent: Sequence[int] | None = None,
        workload: Workload = CAUSAL,
    ) -> None:
        n = len(room)
        self.shards: list[list[Shard]] = [[] for _ in range(n)]
        self.room = list(room)
        self.spare = list(spare) if spare is not None else [0] * n
        self.bias = list(bias) if bias is not None else [0.0] * n
        self.sent = list(sent) if sent is not None else [0] * n
        self.work = [0] * n
        self.workload = workload

    def add(self, rank: int, doc: int, start: int, length: int, last: bool) -> None:
        self.shards[rank].append(Shard(doc, start, length))
        self.room[rank] -= length
        self.work[rank] += self.workload.shard(start, length)
        if not last:
            self.sent[rank] += length
