"""The sharding plan of one packed context window and what it costs.

A plan says which rank holds which contiguous piece (a `Shard`) of which document. Everything the
rest of FlashCP needs is derived from it: the per-rank attention workload (to judge balance), the
KV each rank must receive (to judge communication) and, through `flashcp.dispatch.build_dispatch`,
the index tensors the attention op runs on. Plans are plain Python over document lengths so that planning stays cheap,
deterministic and independent of any device.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np


class Shard(NamedTuple):
    """Tokens `[start, start + length)` of document `doc` (index into the window's documents)."""

    doc: int
    start: int
    length: int


def shards_of(docs: Iterable[int], starts: Iterable[int], lengths: Iterable[int]) -> list[Shard]:
    """`Shard(d, s, x)` for each triple, about twice as fast as calling the named tuple (which goes
    through a Python-level `__new__`): plans of many Per-Doc documents hold tens of thousands."""
    return list(map(tuple.__new__, itertools.repeat(Shard), zip(docs, starts, lengths)))


def shard_workload(start: int, length: int) -> int:
    """Causal attention workload of a shard: sum over its queries of the keys each one sees.

    A query at document position `start + i` sees `start + i + 1` keys, so the shard costs
    `(2 * start + length + 1) * length / 2` score entries (the paper's W_i), always an integer.
    """
    return (2 * start + length + 1) * length // 2


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class Workload:
    """The attention workload planners balance: causal pairs summed over a model's layer kinds.

    A full layer's query at document position p sees p + 1 keys; a sliding-window layer's
    (Hugging Face `sliding_window` = `window`, gpt-oss: 128) sees min(p + 1, window): W per
    token wherever the token lies past a document's first W positions, fewer before them. A shard
    costs `full_layers` x its causal pairs + `window_layers` x its window pairs; only the ratio of
    the two counts matters to balance. The default, `CAUSAL`, is `shard_workload` exactly: plans
    made without window layers are the causal planners' own.

    A hybrid model's linear-attention layers (`linear`, `flashcp.plan.linear.LinearLayers`: Gated
    DeltaNet) attend no pairs; their work is linear in tokens, plus what cutting a document adds (a
    summary pass, folds, state bytes), which only a whole plan shows (`linear.cut_work`). With them
    the unit is forward FLOPs: a pair costs `linear.pair_flops` per attending layer.
    """

    full_layers: int = 1
    window_layers: int = 0
    window: int | None = None
    linear: Any = None  # flashcp.plan.linear.LinearLayers (it imports this module)

    def __post_init__(self) -> None:
        counts = (self.full_layers, self.window_layers)
        if not all(_integer(c) and c >= 0 for c in counts) or not any(counts):
            raise ValueError(f"layer counts must be integers >= 0, not both 0, got {counts}")
        if self.window is not None and not (_integer(self.window) and self.window > 0):
            raise ValueError(f"window must be a positive number of keys, got {self.window!r}")
        if self.window_layers and self.window is None:
            raise ValueError("window layers need a window (keys a query sees, HF sliding_window)")

    def shard(self, start: int, length: int) -> int:
        """Work of the queries [start, start + length) of a document. A window query sees its
        p + 1 causal keys less the max(0, p + 1 - W) beyond the window: the causal pairs of the
        same positions shifted back by W (those before the document's start count 0)."""
        work = (self.full_layers + self.window_layers) * shard_workload(start, length)
        if self.window_layers:
            lo, hi = max(0, start - self.window), max(0, start + length - self.window)
            work -= self.window_layers * shard_workload(lo, hi - lo)
        return work if self.linear is None else self.linear.pair_flops * work + self.linear.token_flops * length

    def shards(self, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """`shard` of every (start, length) pair, in int64 numpy."""
        s, x = np.asarray(starts, dtype=np.int64), np.asarray(lengths, dtype=np.int64)
        work = (self.full_layers + self.window_layers) * ((2 * s + x + 1) * x // 2)
        if self.window_layers:
            lo, hi = np.maximum(s - self.window, 0), np.maximum(s + x - self.window, 0)
            work -= self.window_layers * ((lo + hi + 1) * (hi - lo) // 2)
        return work if self.linear is None else self.linear.pair_flops * work + self.linear.token_flops * x


CAUSAL = Workload()


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
    workload: Workload = field(default=CAUSAL, compare=False)  # what `workloads` and "imbalance" count

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
        """Per rank, the plan's `workload` (causal pairs unless the plan was made for window layers;
        a hybrid model's FLOPs, with what its cut documents add to the linear layers)."""
        cost = self.workload.shard
        work = [sum(cost(s.start, s.length) for s in shards) for shards in self.ranks]
        if self.workload.linear is not None:
            work = [w + c for w, c in zip(work, self.workload.linear.cut_work(self))]
        return work

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

    def metrics(self, num_kv_heads: int = 1, head_dim: int = 1, dtype_bytes: int = 2, *,
                v_head_dim: int | None = None, latent_dim: int | None = None) -> dict[str, Any]:  # fmt: skip
        """Balance, communication and shape figures of this plan.

        Communication is counted in tokens of KV one rank receives in the forward pass of one
        layer (the critical path); `*_bytes` multiply by `row_bytes(...)` of the arguments: K and
        V over all KV heads, or MLA's latent rows with `latent_dim`. `comm_kv_full_bytes` is the
        K/V all-gather's either way (the baseline a latent exchange is compared with). Ratios are
        relative to the full all-gather of the Llama3 / Per-Doc baselines.
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
        bytes_per_token = row_bytes(num_kv_heads, head_dim, dtype_bytes, v_head_dim, latent_dim)
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
            "comm_kv_full_bytes": full * row_bytes(num_kv_heads, head_dim, dtype_bytes, v_head_dim),
            "comm_compact_ratio": compact / full if full else 0.0,
            "comm_needed_ratio": needed / full if full else 0.0,
            "num_shards": len(shards),
            "split_docs": sum(1 for c in docs_per if c > 1),
            "min_shard_len": min(s.length for s in shards),
        }


def row_bytes(num_kv_heads: int = 1, head_dim: int = 1, dtype_bytes: int = 2, v_head_dim: int | None = None,
              latent_dim: int | None = None) -> int:  # fmt: skip
    """Bytes one exchanged token carries: its K (`head_dim`) and V (`v_head_dim`, default the
    same) over all KV heads, or with `latent_dim` (MLA: kv_lora_rank + qk_rope_head_dim, 576 for
    DeepSeek-V3) the latent row the latent exchange sends instead, whatever the heads."""
    if latent_dim is not None:
        return latent_dim * dtype_bytes
    return num_kv_heads * (head_dim + (head_dim if v_head_dim is None else v_head_dim)) * dtype_bytes


def shard_array(ranks: Sequence[Sequence[Shard]]) -> tuple[np.ndarray, np.ndarray]:
    """All shards as an int64 array of (doc, start, length) rows and the rank of each row: plans
    with thousands of shards (many Per-Doc documents over many ranks) are checked and sorted in
    numpy rather than shard by shard."""
    counts = [len(shards) for shards in ranks]
    flat = itertools.chain.from_iterable(itertools.chain.from_iterable(ranks))
    rows = np.fromiter(flat, dtype=np.int64, count=3 * sum(counts)).reshape(-1, 3)
    return rows, np.repeat(np.arange(len(ranks)), counts)


def _sorting(*columns: np.ndarray) -> np.ndarray:
    """Indices sorting rows by `columns`, most significant first: `np.lexsort(columns[::-1])`,
    but as one stable argsort of the columns packed into an int64 key, several times faster on
    the tens of thousands of shards of a plan (lexsort when the key would overflow)."""
    if not len(columns[0]):
        return np.arange(0)
    key, span = 0, 1
    for column in columns:
        low = int(column.min())
        width = int(column.max()) - low + 1
        span *= width
        if span >= 2**63:
            return np.lexsort(columns[::-1])
        key = key * width + (column - low)
    return np.argsort(key, kind="stable")


def normalize(ranks: Sequence[Sequence[Shard]]) -> tuple[tuple[Shard, ...], ...]:
    """Sort each rank's shards by (doc, start), drop empty ones and merge adjacent pieces."""
    return normalized(ranks)[0]


def normalized(ranks: Sequence[Sequence[Shard]]) -> tuple[tuple[tuple[Shard, ...], ...], np.ndarray, np.ndarray]:
    """`normalize(ranks)` and its `shard_array`, which `validate` takes instead of rebuilding it."""
    rows, rank = shard_array(ranks)
    # The shard objects too, in numpy: gathering the kept ones is then one indexing.
    objects = np.fromiter(itertools.chain.from_iterable(ranks), dtype=object, count=len(rows))
    kept = np.flatnonzero(rows[:, 2] > 0)
    doc, start, length = rows[kept].T
    # By rank, document and start: shards of a valid plan never tie (they would overlap).
    order = _sorting(rank[kept], doc, start)
    kept, doc, start, length, rank = kept[order], doc[order], start[order], length[order], rank[kept][order]
    # A piece continues the previous one (same rank and document, starting where it ends).
    joins = (rank[1:] == rank[:-1]) & (doc[1:] == doc[:-1]) & (start[1:] == start[:-1] + length[:-1])
    heads = np.flatnonzero(np.concatenate(([True], ~joins)))
    sizes = np.diff(np.append(heads, len(kept)))
    length = np.add.reduceat(length, heads) if len(heads) else length
    shards = objects[kept[heads]].tolist()  # unmerged shards stay the objects given
    for g in np.flatnonzero(sizes > 1).tolist():
        shards[g] = Shard(int(doc[heads[g]]), int(start[heads[g]]), int(length[g]))
    rank = rank[heads]
    bounds = np.searchsorted(rank, np.arange(len(ranks) + 1))
    out = tuple(tuple(shards[a:b]) for a, b in zip(bounds[:-1], bounds[1:]))
    return out, np.stack((doc[heads], start[heads], length), axis=1).reshape(-1, 3), rank


def validate(plan: Plan, rows: tuple[np.ndarray, np.ndarray] | None = None) -> None:
    """Raise AssertionError unless every token is held exactly once and ranks hold equal tokens.
    `rows`: the plan's `shard_array` when the caller has it (from `normalized`)."""
    rows, rank = shard_array(plan.ranks) if rows is None else rows
    doc, start, length = rows.T
    held = np.bincount(rank, weights=length, minlength=plan.cp_size)
    for r in np.flatnonzero(held != plan.tokens_per_rank)[:1]:
        raise AssertionError(
            f"{plan.strategy}: rank {r} holds {int(held[r])} tokens, expected {plan.tokens_per_rank}"
        )
    bad = (doc < 0) | (doc >= len(plan.doc_lens)) | (length <= 0) | (start < 0)
    for i in np.flatnonzero(bad)[:1]:
        raise AssertionError(Shard(*rows[i].tolist()))
    lens = np.asarray(plan.doc_lens, dtype=np.int64)
    order = _sorting(doc, start)  # ties overlap, and fail below in any order
    doc, start, end = doc[order], start[order], (start + length)[order]
    # Per document, pieces sorted by start must tile [0, length): each starts where the last ended.
    first = np.ones(len(doc), dtype=bool)
    first[1:] = doc[1:] != doc[:-1]
    expected = np.where(first, 0, np.concatenate(([0], end[:-1])))
    for i in np.flatnonzero(start != expected)[:1]:
        raise AssertionError(
            f"{plan.strategy}: document {doc[i]} covered with a gap or overlap at {expected[i]}"
        )
    covered = np.zeros(len(lens), dtype=np.int64)
    last = np.append(first[1:], True) if len(doc) else first
    covered[doc[last]] = end[last]
    for d in np.flatnonzero(covered != lens)[:1]:
        raise AssertionError(f"{plan.strategy}: document {d} covered up to {covered[d]} of {lens[d]}")
