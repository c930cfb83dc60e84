"""The sharding plan of one packed context window and what it costs.

A plan says which rank holds which contiguous piece (a `Shard`) of which document. Everything the
rest of FlashCP needs is derived from it: the per-rank attention workload (to judge balance), the
KV each rank must receive (to judge communication) and, through `flashcp.dispatch.build_dispatch`,
the index tensors the attention op runs on. Plans are plain Python over document lengths so that planning stays cheap,
deterministic and independent of any device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple


class Shard(NamedTuple):
    """Tokens `[start, start + length)` of document `doc` (index into the window's documents)."""

    doc: int
    start: int
    length: int


def shard_workload(start: int, length: int) -> int:
    """Causal attention workload of a shard: sum over its queries of the keys each one sees.

    A query at document position `start + i` sees `start + i + 1` keys, so the shard costs
    `(2 * start + length + 1) * length / 2` score entries (the paper's W_i), always an integer.
    """
    return (2 * start + length + 1) * length // 2


@dataclass(frozen=True)
class Plan:
    """Assignment of every token of a window to one of `cp_size` ranks.

    `ranks[r]` is the ordered tuple of shards rank r holds, sorted by (doc, start), with adjacent
    pieces of one document merged. Construct plans through `flashcp.plan_shards`, which validates
    them; `info` carries strategy-specific extras (documents sent to Per-Doc, ILP optimality, ...).
    """

    doc_lens: tuple[int, ...]
    cp_size: int
    ranks: tuple[tuple[Shard, ...], ...]
    strategy: str
    info: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def context(self) -> int:
        return sum(self.doc_lens)

    @property
    def tokens_per_rank(self) -> int:
        return self.context // self.cp_size

    def is_last(self, shard: Shard) -> bool:
        """Whether `shard` ends its document; only non-last shards are ever sent to other ranks."""
        return shard.start + shard.length == self.doc_lens[shard.doc]

    def workloads(self) -> list[int]:
        return [sum(shard_workload(s.start, s.length) for s in shards) for shards in self.ranks]

    def send_tokens(self) -> list[int]:
        """Per rank, tokens in non-last shards: its contribution to the compact all-gather (Eq. 5)."""
        return [sum(s.length for s in shards if not self.is_last(s)) for shards in self.ranks]

    def needed_tokens(self) -> list[int]:
        """Per rank, prefix tokens its shards attend to that live on other ranks."""
        needed = []
        for shards in self.ranks:
            prefix_end: dict[int, int] = {}
            own: dict[int, int] = {}
            for s in shards:
                prefix_end[s.doc] = max(prefix_end.get(s.doc, 0), s.start)
            for s in shards:
                # Own tokens inside the needed prefix [0, max start) are not received.
                own[s.doc] = own.get(s.doc, 0) + max(0, min(s.start + s.length, prefix_end[s.doc]) - s.start)
            needed.append(sum(end - own[d] for d, end in prefix_end.items()))
        return needed

    def metrics(self, num_kv_heads: int = 1, head_dim: int = 1, dtype_bytes: int = 2) -> dict[str, Any]:
        """Balance, communication and shape figures of this plan.

        Communication is counted in tokens of KV one rank receives in the forward pass of one
        layer (the critical path); `*_bytes` multiply by K and V, heads, head dim and dtype size.
        Ratios are relative to the full all-gather of the Llama3 / Per-Doc baselines.
        """
        n = self.cp_size
        work = self.workloads()
        mean_work = sum(work) / n
        shards = [s for rs in self.ranks for s in rs]
        full = (n - 1) * self.context // n
        compact = (n - 1) * max(self.send_tokens())
        needed = max(self.needed_tokens())
        docs_per = [0] * len(self.doc_lens)
        for s in shards:
            docs_per[s.doc] += 1
        bytes_per_token = 2 * num_kv_heads * head_dim * dtype_bytes
        return {
            "workloads": work,
            "imbalance": max(work) / mean_work if mean_work else 1.0,
            "tokens": [sum(s.length for s in rs) for rs in self.ranks],
            "comm_full_tokens": full,
            "comm_compact_tokens": compact,
            "comm_needed_tokens": needed,
            "comm_full_bytes": full * bytes_per_token,
            "comm_compact_bytes": compact * bytes_per_token,
            "comm_needed_bytes": needed * bytes_per_token,
            "comm_compact_ratio": compact / full if full else 0.0,
            "comm_needed_ratio": needed / full if full else 0.0,
            "num_shards": len(shards),
            "split_docs": sum(1 for c in docs_per if c > 1),
            "min_shard_len": min(s.length for s in shards),
        }


def normalize(ranks: list[list[Shard]]) -> tuple[tuple[Shard, ...], ...]:
    """Sort each rank's shards by (doc, start), drop empty ones and merge adjacent pieces."""
    out = []
    for shards in ranks:
        merged: list[Shard] = []
        for s in sorted(s for s in shards if s.length > 0):
            last = merged[-1] if merged else None
            if last is not None and last.doc == s.doc and last.start + last.length == s.start:
                merged[-1] = Shard(s.doc, last.start, last.length + s.length)
            else:
                merged.append(s)
        out.append(tuple(merged))
    return tuple(out)


def validate(plan: Plan) -> None:
    """Raise AssertionError unless every token is held exactly once and ranks hold equal tokens."""
    covered: dict[int, list[tuple[int, int]]] = {}
    for r, shards in enumerate(plan.ranks):
        held = sum(s.length for s in shards)
        assert held == plan.tokens_per_rank, (
            f"{plan.strategy}: rank {r} holds {held} tokens, expected {plan.tokens_per_rank}"
        )
        for s in shards:
            assert 0 <= s.doc < len(plan.doc_lens) and s.length > 0 and s.start >= 0, s
            covered.setdefault(s.doc, []).append((s.start, s.start + s.length))
    for d, length in enumerate(plan.doc_lens):
        pos = 0
        for a, b in sorted(covered.get(d, [])):
            assert a == pos, f"{plan.strategy}: document {d} covered with a gap or overlap at {pos}"
            pos = b
        assert pos == length, f"{plan.strategy}: document {d} covered up to {pos} of {length}"
