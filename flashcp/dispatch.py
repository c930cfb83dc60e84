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

A dispatch is built on the host. On a GPU the trainer pins it (`pin_memory`) and copies it with
`to(device)`, which is non-blocking, so the per-step copy never stalls the host; everything the
attention op reads as Python numbers (lengths, splits, the overlap partition) is computed here,
so the per-layer path never reads device memory back.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass, replace
from typing import Callable, TypeVar

import torch

from flashcp.plan.plan import Plan

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
    """A copy of dataclass `obj` with `fn` applied to every tensor, nested dataclasses included."""
    changes = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, torch.Tensor):
            changes[f.name] = fn(value)
        elif is_dataclass(value):
            changes[f.name] = _map_tensors(value, fn)
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

    def to(self, device: torch.device | str, non_blocking: bool = True) -> Dispatch:
        """This dispatch on `device`. The copies are asynchronous when the tensors are pinned."""
        return _map_tensors(self, lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> Dispatch:
        """A copy in page-locked host memory, so that `to(cuda)` overlaps with the host's work.

        Needs an accelerator (torch refuses to pin memory without one)."""
        return _map_tensors(self, torch.Tensor.pin_memory)


def _expand(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Concatenate the ranges [starts[i], starts[i] + lengths[i]) without a Python loop."""
    total = int(lengths.sum())
    seg_begin = torch.cumsum(lengths, 0) - lengths
    return torch.repeat_interleave(starts - seg_begin, lengths, output_size=total) + torch.arange(total)


def _cumsum0(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x.new_zeros(1), torch.cumsum(x, 0)])


def build_dispatch(plan: Plan, rank: int, comm: str = "compact", overlap: bool = False) -> Dispatch:
    """Rank `rank`'s dispatch under `plan`; with `overlap`, also its `OverlapSplit`."""
    if comm not in COMM_MODES:
        raise ValueError(f"unknown comm mode {comm!r}; choose one of {', '.join(COMM_MODES)}")
    n, context, per_rank = plan.cp_size, plan.context, plan.tokens_per_rank
    if not 0 <= rank < n:
        raise ValueError(f"rank {rank} out of range for cp_size {n}")
    doc_lens = torch.tensor(plan.doc_lens, dtype=torch.long)
    doc_off = _cumsum0(doc_lens)[:-1]

    # All shards of all ranks in rank-major local order: concatenated, they list the window's
    # positions such that row i of the concatenation is local row i % T of rank i // T.
    flat = [(r, *s) for r, shards in enumerate(plan.ranks) for s in shards]
    owner_of_shard, doc, start, length = torch.tensor(flat, dtype=torch.long).unbind(1)
    glob_start = doc_off[doc] + start
    order = _expand(glob_start, length)
    rows = torch.arange(context)
    owner = torch.empty(context, dtype=torch.long)
    owner[order] = rows // per_rank
    local_pos = torch.empty(context, dtype=torch.long)
    local_pos[order] = rows % per_rank

    mine = owner_of_shard == rank
    my_doc, my_start, my_len = doc[mine], start[mine], length[mine]
    token_index = order[rank * per_rank : (rank + 1) * per_rank]
    positions = _expand(my_start, my_len)
    key_len = my_start + my_len
    key_glob = _expand(doc_off[my_doc], key_len)

    send_splits: list[int] = []
    recv_splits: list[int] = []
    buf_pos = torch.full((context,), -1, dtype=torch.long)
    if comm == "full":
        send_pad = per_rank
        send_index = torch.arange(per_rank)
        buf_pos = owner * per_rank + local_pos
        recv_size = n * per_rank
    elif comm == "compact":
        nonlast = (start + length) < doc_lens[doc]
        row_sent = torch.repeat_interleave(nonlast, length, output_size=context)
        sent_count = torch.zeros(n, dtype=torch.long).index_add_(0, rows // per_rank, row_sent.long())
        send_pad = int(sent_count.max())
        # k-th sent row of its rank -> that rank's buffer segment at offset k.
        rank_base = _cumsum0(sent_count)[:-1]
        k = torch.cumsum(row_sent.long(), 0) - 1 - rank_base[rows // per_rank]
        sent_glob = order[row_sent]
        buf_pos[sent_glob] = owner[sent_glob] * send_pad + k[row_sent]
        mine_rows = row_sent[rank * per_rank : (rank + 1) * per_rank]
        send_index = torch.nonzero(mine_rows).flatten()
        recv_size = n * send_pad
    else:
        need = _needed_masks(plan, doc_off, doc, start, owner_of_shard, owner)
        send_index, recv_order = _needed_exchange(need, owner, local_pos, rank)
        send_splits = [int((need[q] & (owner == rank)).sum()) for q in range(n)]
        recv_splits = [int(x) for x in torch.bincount(owner[recv_order], minlength=n)]
        send_pad = 0
        recv_size = len(recv_order)
        buf_pos[recv_order] = torch.arange(recv_size)

    kv_index = torch.where(owner[key_glob] == rank, recv_size + local_pos[key_glob], buf_pos[key_glob])
    if bool((kv_index < 0).any()):  # a prefix row no collective delivers: a planner bug
        raise AssertionError(f"rank {rank}: {comm} dispatch misses prefix rows of plan {plan.strategy}")
    cu_q, cu_k = _cumsum0(my_len).to(torch.int32), _cumsum0(key_len).to(torch.int32)
    return Dispatch(
        rank=rank,
        cp_size=n,
        comm=comm,
        token_index=token_index,
        positions=positions,
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
    )


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


def _needed_masks(
    plan: Plan,
    doc_off: torch.Tensor,
    doc: torch.Tensor,
    start: torch.Tensor,
    owner_of_shard: torch.Tensor,
    owner: torch.Tensor,
) -> torch.Tensor:
    """[N, C] bool: the rows each rank attends to but does not hold (its remote prefix rows)."""
    n, num_docs = plan.cp_size, len(plan.doc_lens)
    # Per (rank, document): the furthest shard start, i.e. the prefix that rank needs.
    prefix = torch.zeros(n * num_docs, dtype=torch.long)
    prefix.scatter_reduce_(0, owner_of_shard * num_docs + doc, start, reduce="amax")
    prefix = prefix.view(n, num_docs)
    need = torch.zeros(n, plan.context, dtype=torch.bool)
    for r in range(n):
        need[r, _expand(doc_off, prefix[r])] = True
    need &= owner.unsqueeze(0) != torch.arange(n).unsqueeze(1)
    return need


def _needed_exchange(
    need: torch.Tensor, owner: torch.Tensor, local_pos: torch.Tensor, rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Local rows `rank` sends (grouped by destination) and the global rows it receives (by source).

    Within each (source, destination) pair rows travel in window order, so sender and receiver
    agree on the layout without exchanging it.
    """
    n = need.shape[0]
    mine = owner == rank
    send_rows = [local_pos[need[q] & mine] for q in range(n)]
    recv_glob = torch.nonzero(need[rank]).flatten()
    recv_glob = recv_glob[torch.argsort(owner[recv_glob], stable=True)]
    return torch.cat(send_rows), recv_glob
