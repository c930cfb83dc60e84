"""Context-parallel varlen attention: exchange the KV each rank needs, then one local kernel call.

    out = cp_varlen_attention(q, k, v, dispatch, group)

`q, k, v` hold this rank's tokens in `dispatch.token_index` order. The op launches the KV
exchange the dispatch was built for (`compact`: FlashCP's compacted all-gather of non-last-shard
rows; `full`: the Llama3 / Per-Doc all-gather of every row; `needed`: an all-to-all-v of exactly
the prefix rows each rank attends to), gathers each local shard's keys (its document prefix then
its own tokens) and runs one varlen kernel over all local shards with the causal mask aligned to
the bottom right. Autograd runs the kernel backward and the transposed collective.

With `overlap=True` the shards whose keys are all local (whole documents, first shards) are
computed while the collective is in flight, and only the others wait for it. That costs a second
kernel call plus gathers of q and the output, so it only pays when the exchange is slow relative
to the local-only attention; `benchmarks/attention.py` measures it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from flashcp.attention.collectives import gather_kv, launch_kv_exchange
from flashcp.attention.kernels import varlen_attention
from flashcp.dispatch import Dispatch


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dispatch: Dispatch, comm: str) -> None:
    if dispatch.comm != comm:
        raise ValueError(
            f"dispatch was built for comm={dispatch.comm!r} but comm={comm!r} was requested: "
            f"build it with plan.dispatch(rank, comm={comm!r})"
        )
    rows = dispatch.token_index.numel()
    if {q.shape[0], k.shape[0], v.shape[0]} != {rows}:
        raise ValueError(
            f"q, k, v must hold this rank's {rows} tokens, got {q.shape[0]}, {k.shape[0]}, {v.shape[0]}"
        )
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if dispatch.kv_index.device != q.device:
        raise ValueError(
            f"dispatch tensors are on {dispatch.kv_index.device} but q is on {q.device}: "
            "move the dispatch once per step with dispatch.to(device)"
        )


def cp_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dispatch: Dispatch,
    group: dist.ProcessGroup | None = None,
    comm: str = "compact",
    backend: str = "auto",
    *,
    softmax_scale: float | None = None,
    overlap: bool = False,
) -> torch.Tensor:
    """Document-masked causal attention of this rank's tokens over the whole CP window.

    `q [T, Hq, D]`, `k, v [T, Hkv, D]` are this rank's rows; `dispatch = plan.dispatch(rank, comm)`
    (on q's device); `group` is the CP process group. Returns `[T, Hq, D]` in the same row order.
    """
    _check(q, k, v, dispatch, comm)
    if overlap:
        split = _local_split(dispatch)
        if split.local.rows.numel() and split.remote.rows.numel():
            return _overlapped(q, k, v, dispatch, group, split, backend, softmax_scale)
    exchange = launch_kv_exchange(k, v, dispatch, group)
    k_all, v_all = gather_kv(k, v, exchange, dispatch.kv_index, dispatch, group)
    return varlen_attention(
        q, k_all, v_all, dispatch.cu_seqlens_q, dispatch.cu_seqlens_k,
        dispatch.max_seqlen_q, dispatch.max_seqlen_k, softmax_scale=softmax_scale, backend=backend,
    )  # fmt: skip


@dataclass(frozen=True)
class _Shards:
    """A subset of the local shards as a varlen problem of its own."""

    rows: torch.Tensor  # local query rows, in order
    kv_index: torch.Tensor  # key rows (into [recv | local] or, for local-only shards, into local)
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int


@dataclass(frozen=True)
class _Split:
    local: _Shards  # shards whose keys are all on this rank
    remote: _Shards  # shards that need received rows
    inverse: torch.Tensor  # cat([local.rows, remote.rows])[inverse] == arange(T)


_splits: dict[int, tuple[weakref.ref, _Split]] = {}


def _local_split(dispatch: Dispatch) -> _Split:
    """Partition the shards by whether they need remote KV; cached per dispatch object.

    Computed on the host from the dispatch metadata once (the same dispatch serves every layer
    of a step), so the per-layer path stays free of host-device synchronisation.
    """
    key = id(dispatch)
    hit = _splits.get(key)
    if hit is not None and hit[0]() is dispatch:
        return hit[1]
    device = dispatch.kv_index.device
    cu_q, cu_k = dispatch.cu_seqlens_q.tolist(), dispatch.cu_seqlens_k.tolist()
    kv_index = dispatch.kv_index.cpu()
    is_local = [
        bool((kv_index[cu_k[s] : cu_k[s + 1]] >= dispatch.recv_size).all()) for s in range(len(cu_q) - 1)
    ]

    def subset(want: bool) -> _Shards:
        ids = [s for s, loc in enumerate(is_local) if loc == want]
        q_len = [cu_q[s + 1] - cu_q[s] for s in ids]
        k_len = [cu_k[s + 1] - cu_k[s] for s in ids]
        none = torch.zeros(0, dtype=torch.long)
        rows = torch.cat([torch.arange(cu_q[s], cu_q[s + 1]) for s in ids] or [none])
        keys = torch.cat([kv_index[cu_k[s] : cu_k[s + 1]] for s in ids] or [none])
        if want:  # local-only shards read the local K/V directly
            keys = keys - dispatch.recv_size
        return _Shards(
            rows.to(device), keys.to(device), _cu_seqlens(q_len).to(device), _cu_seqlens(k_len).to(device),
            max(q_len, default=0), max(k_len, default=0),
        )  # fmt: skip

    local, remote = subset(True), subset(False)
    inverse = torch.argsort(torch.cat([local.rows, remote.rows]))
    split = _Split(local, remote, inverse)
    _splits[key] = (weakref.ref(dispatch, lambda _: _splits.pop(key, None)), split)
    return split


def _cu_seqlens(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0).to(torch.int32)


def _overlapped(q, k, v, dispatch, group, split: _Split, backend, softmax_scale) -> torch.Tensor:
    """Local-only shards run between launching the exchange and waiting for it."""
    exchange = launch_kv_exchange(k, v, dispatch, group, async_op=True)
    loc, rem = split.local, split.remote
    out_local = varlen_attention(
        q.index_select(0, loc.rows), k.index_select(0, loc.kv_index), v.index_select(0, loc.kv_index),
        loc.cu_seqlens_q, loc.cu_seqlens_k, loc.max_seqlen_q, loc.max_seqlen_k,
        softmax_scale=softmax_scale, backend=backend,
    )  # fmt: skip
    k_rem, v_rem = gather_kv(k, v, exchange, rem.kv_index, dispatch, group)
    out_remote = varlen_attention(
        q.index_select(0, rem.rows), k_rem, v_rem,
        rem.cu_seqlens_q, rem.cu_seqlens_k, rem.max_seqlen_q, rem.max_seqlen_k,
        softmax_scale=softmax_scale, backend=backend,
    )  # fmt: skip
    return torch.cat([out_local, out_remote]).index_select(0, split.inverse)
