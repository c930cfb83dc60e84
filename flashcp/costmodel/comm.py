"""Time of the KV collectives from message size, interpolated in measured bandwidth tables.

All collectives are priced through nccl-tests' bus bandwidth, which is the rate at which one GPU
pushes bytes through its link for the ring algorithms NCCL uses inside an NVLink node:

- all-gather / reduce-scatter of `per_rank` bytes on N ranks: the buffer is size = N * per_rank,
  time = size / algbw with algbw = busbw(size) * N / (N - 1), busbw interpolated linearly in
  log(size) between table points. Below the smallest measured size the time follows the
  latency + size / bandwidth line through the two smallest points (never below zero); above
  the largest, busbw stays at its last value. Zero bytes cost nothing: no collective is issued.
- all-to-all-v (the "needed" mode): each rank sends and receives different amounts; the slowest
  rank moves max(sent, received) bytes through its link at the all-gather bus bandwidth of a
  buffer of the same per-link traffic. ASSUMPTION: NCCL's all-to-all on an NVSwitch node
  reaches the all-gather bus bandwidth; a measured all-to-all table would replace this.
- one ring P2P step (ring attention) of `per_rank` bytes: every rank sends to its neighbour at
  once, i.e. one step of a ring all-gather, so time = per_rank / busbw(N * per_rank).
  ASSUMPTION: PyTorch batched isend/irecv reach NCCL's ring rate.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from flashcp.costmodel.profiles import CollectiveTable, ProfileError


def interpolated_busbw(table: CollectiveTable, size: float) -> float:
    """Bus bandwidth (GB/s) at `size` bytes, linear in log(size) inside the table, flat above."""
    return float(np.interp(np.log(size), np.log(table.sizes), table.busbw))


def collective_ms(table: CollectiveTable, size: float) -> float:
    """Time (ms) of one collective whose whole buffer is `size` bytes (nccl-tests convention)."""
    if size <= 0:
        return 0.0
    n = table.n_ranks
    if size < table.sizes[0]:
        t = table.times_ms()
        slope = (t[1] - t[0]) / (table.sizes[1] - table.sizes[0])
        if slope <= 0:  # no latency visible in the two smallest sizes: scale the smallest time
            return float(t[0] * size / table.sizes[0])
        return max(t[0] - slope * (table.sizes[0] - size), 0.0)
    algbw = interpolated_busbw(table, size) * n / (n - 1)
    return size / (algbw * 1e9) * 1e3


class CommModel:
    """Collective times on one node, from tables keyed by (op, n_ranks)."""

    spans_nodes = False  # prices groups larger than one node (flashcp.costmodel.fabric) or not

    def __init__(self, tables: Iterable[CollectiveTable]):
        self.tables = {(t.op, t.n_ranks): t for t in tables}
        if not self.tables:
            raise ProfileError("no collective tables given: need nccl-tests all_gather / reduce_scatter runs")

    def table(self, op: str, n_ranks: int) -> CollectiveTable:
        try:
            return self.tables[(op, n_ranks)]
        except KeyError:
            have = ", ".join(f"{o}@{n}" for o, n in sorted(self.tables)) or "none"
            raise ProfileError(f"no {op} table for {n_ranks} ranks (have: {have})") from None

    def all_gather_ms(self, per_rank_bytes: float, n_ranks: int) -> float:
        return collective_ms(self.table("all_gather", n_ranks), n_ranks * per_rank_bytes)

    def reduce_scatter_ms(self, per_rank_bytes: float, n_ranks: int) -> float:
        return collective_ms(self.table("reduce_scatter", n_ranks), n_ranks * per_rank_bytes)

    def all_to_all_ms(self, max_link_bytes: float, n_ranks: int) -> float:
        """All-to-all-v whose busiest rank sends or receives `max_link_bytes` in total."""
        # An all-gather of buffer S moves S * (N-1) / N bytes through every link.
        return self.all_gather_ms(max_link_bytes / (n_ranks - 1), n_ranks)

    def ring_step_ms(self, per_rank_bytes: float, n_ranks: int) -> float:
        """One ring step: every rank sends `per_rank_bytes` to its neighbour concurrently."""
        if per_rank_bytes <= 0:
            return 0.0
        return self.all_gather_ms(per_rank_bytes, n_ranks) / (n_ranks - 1)
