"""Turn a plan into the index tensors one rank's attention runs on.

Every rank builds its own `Dispatch` from the replicated plan, so no metadata is communicated:
the planner's output is small (document lengths and shard tuples) and identical everywhere.

The attention op works on three row spaces:
- local rows: this rank's tokens, in `token_index` order (shard after shard);
- the receive buffer: rows the collective delivers from other ranks;
- key rows: every local shard's keys (its document prefix, then its own tokens), back to back,
  obtained with one gather `cat([recv_buffer, local_kv])[kv_index]`.

Communication modes differ only in what each rank sends and how the receive buffer is laid out:
- "compact": each rank sends the tokens of its non-last shards (the only ones any other rank can
  need), padded to `send_pad` rows, through one all-gather; the buffer is N segments of send_pad.
- "full": each rank sends all its rows (Llama3 / Per-Doc baselines); the buffer is the window.
- "needed": each rank sends every peer exactly the prefix rows that peer attends to, through one
  all-to-all-v; the buffer is the peers' segments back to back (`recv_splits`).

With `window=W` (a sliding-window layer, `flashcp.plan.window`) a shard's keys are only the last
W - 1 rows before it and itself: "compact" sends the last W - 1 rows of each non-last shard,
"needed" the rows of each piece some peer's windows reach (a suffix of the piece), "full" all.

A dispatch is built on the host. On a GPU the trainer pins it (`pin_memory`) and copies it with
`to(device)`, which is non-blocking, so the per-step copy never stalls the host; everything the
attention op reads as Python numbers (lengths, splits, the overlap partition) is computed here,
so the per-layer path never reads device memory back.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, fields, is_dataclass, replace
from typing import Callable, TypeVar

import torch

from flashcp.plan.plan import Plan
from flashcp.plan.window import check_window

COMM_MODES = ("compact", "full", "needed")


@dataclass(frozen=True)
class ShardSubset:
    """Some of a rank's shards as a varlen problem of their own (see `OverlapSplit`)."""

    rows: torch.Tensor  # local query rows, in order
    kv_index: torch.Tensor  # key rows: into [recv | local] for remote shards, into local K/V for local ones
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int


@dataclass(frozen=True)
class OverlapSplit:
    """The shards whose keys are all on this rank (computable before the KV exchange lands) and
    the others, for `cp_varlen_attention(overlap=True)`."""

    local: ShardSubset
    remote: ShardSubset
    inverse: torch.Tensor  # cat([local.rows, remote.rows])[inverse] == arange(T)


_T = TypeVar("_T")


def _map_tensors(obj: _T, fn: Callable[[torch.Tensor], torch.Tensor]) -> _T:
    """A copy of dataclass `obj` with `fn` applied to every tensor, nested dataclasses (alone or in a
    tuple) included."""
    changes = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, torch.Tensor):
            changes[f.name] = fn(value)
        elif is_dataclass(value):
            changes[f.name] = _map_tensors(value, fn)
        elif isinstance(value, tuple) and any(is_dataclass(x) for x in value):
            changes[f.name] = tuple(x if x is None else _map_tensors(x, fn) for x in value)
    return replace(obj, **changes)


@dataclass(frozen=True)
class Dispatch:
    """Everything rank `rank` needs for attention under one plan; all tensors are int64/int32."""

    rank: int
    cp_size: int
    comm: str
    token_index: torch.Tensor  # [T] global window position of each local row
    positions: torch.Tensor  # [T] position of each local row inside its document (RoPE)
    cu_seqlens_q: torch.Tensor  # [S+1] int32, local shards as varlen query sequences
    cu_seqlens_k: torch.Tensor  # [S+1] int32, each shard's keys: document prefix + itself
    max_seqlen_q: int
    max_seqlen_k: int
    send_index: torch.Tensor  # [n_send] local rows contributed to the collective
    send_pad: int  # all-gather modes: rows every rank contributes (zero padded)
    send_splits: list[int]  # needed mode: rows sent to each peer (in send_index order)
    recv_splits: list[int]  # needed mode: rows received from each peer
    recv_size: int  # rows of the receive buffer
    kv_index: torch.Tensor  # [sum_k] rows of cat([recv_buffer, local_kv]) giving all keys
    overlap: OverlapSplit | None = None  # built on request (`overlap=True`)
    window: int | None = None  # the sliding window the keys were cut to (None: full attention)

    def to(self, device: torch.device | str, non_blocking: bool = True) -> Dispatch:
        """This dispatch on `device`. The copies are asynchronous when the tensors are pinned."""
        return _map_tensors(self, lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> Dispatch:
        """A copy in page-locked host memory, so that `to(cuda)` overlaps with the host's work.

        Needs an accelerator (torch refuses to pin memory without one)."""
        return _map_tensors(self, torch.Tensor.pin_memory)


def expand_ranges(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Concatenate the ranges [starts[i], starts[i] + lengths[i]) without a Python loop."""
    total = int(lengths.sum())
    seg_begin = torch.cumsum(lengths, 0) - lengths
    return torch.repeat_interleave(starts - seg_begin, lengths, output_size=total) + torch.arange(total)


def _cumsum0(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x.new_zeros(1), torch.cumsum(x, 0)])


def build_dispatch(
    plan: Plan, rank: int, comm: str = "compact", overlap: bool = False, window: int | None = None
) -> Dispatch:
    """Rank `rank`'s dispatch under `plan`; with `overlap`, also its `OverlapSplit`; with `window`,
    for a sliding-window layer of W keys (HF `sliding_window`), exchanging only what windows reach.

    Works on the plan's pieces (every shard of every rank) and on this rank's rows only: the cost
    is O(the plan's shards + this rank's tokens, sent rows and key rows), never a table over the
    window (which cost every rank O(C), and O(N C) for "needed", at any CP size).
    """
    if comm not in COMM_MODES:
        raise ValueError(f"unknown comm mode {comm!r}; choose one of {', '.join(COMM_MODES)}")
    n, per_rank = plan.cp_size, plan.tokens_per_rank
    if not 0 <= rank < n:
        raise ValueError(f"rank {rank} out of range for cp_size {n}")
    check_window(window)
    pieces = _Pieces(plan, window)
    mine = torch.nonzero(pieces.owner == rank).flatten()  # in local order
    my_doc, my_start, my_len = pieces.doc[mine], pieces.start[mine], pieces.length[mine]
    key_len = my_start + my_len - pieces.reach_start[mine]
    # Each local shard's keys: its document's pieces up to itself, each cut to the shard's reach.
    prefix, shard = pieces.prefix_pieces(mine)
    cut_start = torch.maximum(pieces.start[prefix], pieces.reach_start[shard])
    cut_len = (pieces.start[prefix] + pieces.length[prefix] - cut_start).clamp_(min=0)

    # buf_start: the buffer row where each piece's row 0 would be (read only where delivered).
    send_splits: list[int] = []
    recv_splits: list[int] = []
    if comm == "full":
        send_pad, recv_size = per_rank, n * per_rank
        send_index = torch.arange(per_rank)
        buf_start = pieces.owner * per_rank + pieces.local_start
    elif comm == "compact":
        # A non-last piece sends its tail: every row without a window, else the last W - 1.
        sent = pieces.length * ~pieces.is_last
        if window is not None:
            sent = sent.clamp(max=window - 1)
        sent_by_rank = torch.zeros(n, dtype=torch.long).index_add_(0, pieces.owner, sent)
        send_pad = int(sent_by_rank.max())
        recv_size = n * send_pad
        # A sent piece's rows follow its owner's earlier sent pieces in the owner's buffer segment.
        sent_before = _cumsum0(sent)[:-1] - _cumsum0(sent_by_rank)[pieces.owner]
        buf_start = pieces.owner * send_pad + sent_before - (pieces.length - sent)
        mine_sent = mine[sent[mine] > 0]
        send_index = expand_ranges(pieces.local_start[mine_sent] + pieces.length[mine_sent] - sent[mine_sent],
                                   sent[mine_sent])  # fmt: skip
    else:
        received = torch.zeros_like(pieces.length).scatter_reduce_(
            0, prefix, cut_len * (pieces.owner[prefix] != rank), reduce="amax"
        )  # a suffix of each piece: the longest any local shard's window cuts from it
        recv_splits = torch.zeros(n, dtype=torch.long).index_add_(0, pieces.owner, received).tolist()
        buf_start = _cumsum0(received)[:-1] - (pieces.length - received)
        recv_size, send_pad = sum(recv_splits), 0
        send_index, send_splits = pieces.needed_send(rank, mine)

    local = pieces.owner[prefix] == rank
    base = torch.where(local, recv_size + pieces.local_start[prefix], buf_start[prefix])
    kv_index = expand_ranges(base + cut_start - pieces.start[prefix], cut_len)
    cu_q, cu_k = _cumsum0(my_len).to(torch.int32), _cumsum0(key_len).to(torch.int32)
    return Dispatch(
        rank=rank,
        cp_size=n,
        comm=comm,
        token_index=expand_ranges(pieces.doc_start[my_doc] + my_start, my_len),
        positions=expand_ranges(my_start, my_len),
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=int(my_len.max()),
        max_seqlen_k=int(key_len.max()),
        send_index=send_index,
        send_pad=send_pad,
        send_splits=send_splits,
        recv_splits=recv_splits,
        recv_size=recv_size,
        kv_index=kv_index,
        overlap=_overlap_split(my_len, key_len, kv_index, recv_size) if overlap else None,
        window=window,
    )


class _Pieces:
    """Every shard of every rank (a "piece"), rank-major and in each rank's local order.

    A plan's ranks hold their shards sorted by (doc, start), so within one rank local order is
    window order; `by_window` lists the pieces in window order over all ranks, where each
    document's pieces are consecutive and tile it.
    """

    def __init__(self, plan: Plan, window: int | None = None) -> None:
        self.cp_size = plan.cp_size
        flat = itertools.chain.from_iterable(itertools.chain.from_iterable(plan.ranks))
        self.doc, self.start, self.length = torch.tensor(list(flat), dtype=torch.long).view(-1, 3).unbind(1)
        per_rank = torch.tensor([len(shards) for shards in plan.ranks])
        self.owner = torch.repeat_interleave(torch.arange(plan.cp_size), per_rank)
        doc_lens = torch.tensor(plan.doc_lens, dtype=torch.long)
        self.doc_start = _cumsum0(doc_lens)[:-1]
        self.is_last = self.start + self.length == doc_lens[self.doc]
        self.local_start = _cumsum0(self.length)[:-1] - self.owner * plan.tokens_per_rank
        self.by_window = torch.argsort(self.doc_start[self.doc] + self.start)
        self.window_rank = torch.empty_like(self.by_window)  # position of each piece in by_window
        self.window_rank[self.by_window] = torch.arange(len(self.owner))
        per_doc = torch.bincount(self.doc, minlength=len(plan.doc_lens))
        self.doc_first = _cumsum0(per_doc)[:-1]  # window position of each document's first piece
        self.doc_end = self.doc_first + per_doc
        # The first row of its document each piece's queries attend (a window cuts the prefix).
        self.reach_start = torch.zeros_like(self.start)
        if window is not None:
            self.reach_start = (self.start - window + 1).clamp(min=0)

    def prefix_pieces(self, pieces: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For each of `pieces`, its document's pieces from the first up to itself, concatenated,
        and beside each of those the one of `pieces` whose prefix it belongs to."""
        first = self.doc_first[self.doc[pieces]]
        count = self.window_rank[pieces] - first + 1
        return self.by_window[expand_ranges(first, count)], torch.repeat_interleave(pieces, count)

    def needed_send(self, rank: int, mine: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """needed mode: the local rows `rank` sends, grouped by destination, and the rows per peer.

        A piece goes to every other rank holding a later piece of its document: the suffix of it
        that the windows of that rank's later pieces reach (all of it without a window)."""
        later = self.window_rank[mine] + 1
        count = self.doc_end[self.doc[mine]] - later
        reader = self.by_window[expand_ranges(later, count)]
        dest, piece = self.owner[reader], torch.repeat_interleave(mine, count)
        end = self.start[piece] + self.length[piece]
        rows = (end - torch.maximum(self.start[piece], self.reach_start[reader])).clamp_(min=0)
        keep = (dest != rank) & (rows > 0)
        # One entry per (destination, piece), sorted by destination then local (= window) order.
        pairs, which = torch.unique(dest[keep] * len(self.owner) + piece[keep], return_inverse=True)
        rows = torch.zeros(len(pairs), dtype=torch.long).scatter_reduce_(0, which, rows[keep], reduce="amax")
        dest, piece = pairs // len(self.owner), pairs % len(self.owner)
        splits = torch.zeros(self.cp_size, dtype=torch.long).index_add_(0, dest, rows)
        return expand_ranges(self.local_start[piece] + self.length[piece] - rows, rows), splits.tolist()


def _overlap_split(q_len: torch.Tensor, k_len: torch.Tensor, kv_index: torch.Tensor, recv_size: int) -> OverlapSplit:
    """Partition the local shards by whether any of their keys arrive through the exchange."""
    shards = torch.arange(len(q_len))
    shard_of_row = torch.repeat_interleave(shards, q_len)
    shard_of_key = torch.repeat_interleave(shards, k_len)
    remote = torch.zeros(len(q_len), dtype=torch.bool)
    remote[shard_of_key[kv_index < recv_size]] = True

    def subset(mask: torch.Tensor, key_offset: int) -> ShardSubset:
        lq, lk = q_len[mask], k_len[mask]
        return ShardSubset(
            rows=torch.nonzero(mask[shard_of_row]).flatten(),
            kv_index=kv_index[mask[shard_of_key]] - key_offset,
            cu_seqlens_q=_cumsum0(lq).to(torch.int32),
            cu_seqlens_k=_cumsum0(lk).to(torch.int32),
            max_seqlen_q=int(lq.max()) if len(lq) else 0,
            max_seqlen_k=int(lk.max()) if len(lk) else 0,
        )

    local, far = subset(~remote, recv_size), subset(remote, 0)
    return OverlapSplit(local, far, torch.argsort(torch.cat([local.rows, far.rows])))
