"""Context-parallel varlen attention: exchange the KV each rank needs, then one local kernel call.

    out = cp_varlen_attention(q, k, v, dispatch, group)

`q, k, v` hold this rank's tokens in `dispatch.token_index` order. The op launches the KV
exchange the dispatch was built for (`compact`: FlashCP's compacted all-gather of non-last-shard
rows; `full`: the Llama3 / Per-Doc all-gather of every row; `needed`: an all-to-all-v of exactly
the prefix rows each rank attends to; `ring` instead passes KV blocks around a ring with one
kernel call per step, `flashcp.attention.ring`), gathers each local shard's keys (its document prefix then
its own tokens) and runs one varlen kernel over all local shards with the causal mask aligned to
the bottom right. Autograd runs the kernel backward and the transposed collective.

With `overlap=True` the shards whose keys are all local (whole documents, first shards) are
computed while the collective is in flight, and only the others wait for it (the partition comes
with the dispatch, built on the host: `build_dispatch(plan, rank, comm, overlap=True)`). That costs a
second kernel call plus gathers of q and the output, so it only pays when the exchange is slow
relative to the local-only attention; `benchmarks/attention.py` measures it.

An exchange launched earlier (`launch_kv_exchange(k, v, dispatch, group, async_op=True)` on k and v
of the same values; head groups launch the next group's this way) is passed as `exchange=` and
consumed in place of the op's own launch, with the same gradients.

Sliding-window layers (gpt-oss, HF `sliding_window = W`) pass `window=W` with a dispatch built for
it (`build_dispatch(plan, rank, comm, window=W)`, `build_two_level_dispatch(..., window=W)`): each
cut shard receives at most the W - 1 rows before it. Learned sinks (`sinks [Hq]`,
`flashcp.attention.sinks`) are applied exactly on each kernel call's final LSE, with no exchange;
their gradient is this rank's share (sum it over the CP group, as every replicated parameter's).
The ring runs neither.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from flashcp.attention.collectives import collectives, Collectives, gather_kv, KVExchange, launch_kv_exchange
from flashcp.attention.kernels import varlen_attention
from flashcp.attention.ring import ring_attention
from flashcp.attention.sinks import sink_attention
from flashcp.dispatch import Dispatch, OverlapSplit, ShardSubset


def check_dispatch(dispatch: Dispatch, comm: str, names: str, *rows: torch.Tensor) -> None:
    """The dispatch fits the call: built for `comm`, on the device of the row tensors `rows`
    (`names` them in messages), each holding this rank's tokens."""
    if dispatch.comm != comm:
        raise ValueError(
            f"dispatch was built for comm={dispatch.comm!r} but comm={comm!r} was requested: "
            f"build it with build_dispatch(plan, rank, comm={comm!r})"
        )
    tokens = dispatch.token_index.numel()
    if {t.shape[0] for t in rows} != {tokens}:
        raise ValueError(f"{names} must hold this rank's {tokens} tokens, got {', '.join(str(t.shape[0]) for t in rows)}")
    if dispatch.kv_index.device != rows[0].device:
        raise ValueError(
            f"dispatch tensors are on {dispatch.kv_index.device} but {names.split(',')[0]} is on {rows[0].device}: "
            "move the dispatch once per step with dispatch.to(device)"
        )


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dispatch: Dispatch, comm: str) -> None:
    check_dispatch(dispatch, comm, "q, k, v", q, k, v)
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")


def cp_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dispatch: Dispatch,
    group: dist.ProcessGroup | Collectives | None = None,
    comm: str = "compact",
    backend: str = "auto",
    *,
    softmax_scale: float | None = None,
    overlap: bool = False,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    exchange: KVExchange | None = None,
) -> torch.Tensor:
    """Document-masked causal attention of this rank's tokens over the whole CP window.

    `q [T, Hq, D]`, `k, v [T, Hkv, D]` are this rank's rows; `dispatch = build_dispatch(plan, rank, comm)`
    (on q's device); `group` is the CP process group (or any `Collectives`). Returns `[T, Hq, D]`
    in the same row order. `window`: each query's last W keys (the dispatch must be built for it);
    `sinks`: one learned sink logit per query head (see the module docstring); `exchange`: the KV
    exchange of these k, v's values, launched ahead (`launch_kv_exchange(..., async_op=True)`), which
    the op consumes instead of launching its own.
    """
    _check(q, k, v, dispatch, comm)
    if exchange is not None:
        _check_exchange(exchange, k, v, dispatch, comm)
    if window is not None and comm == "ring":
        raise ValueError("comm='ring' runs full attention only: window layers exchange by compact, full, needed "
                         "or two_level")  # fmt: skip
    if dispatch.window != window:
        raise ValueError(
            f"dispatch was built for window={dispatch.window} but window={window} was requested: "
            f"build it with build_dispatch(plan, rank, comm, window={window})"
        )
    if comm == "ring":
        if sinks is not None:
            raise ValueError("comm='ring' takes no sinks: use compact, full, needed or two_level")
        if overlap:
            raise ValueError("overlap=True is for the collective exchanges; the ring overlaps every step already")
        return ring_attention(q, k, v, dispatch, collectives(group), backend, softmax_scale)
    if overlap:
        split = dispatch.overlap
        if split is None:
            raise ValueError(
                "overlap=True needs the dispatch's overlap split: build it with "
                "build_dispatch(plan, rank, comm, overlap=True)"
            )
        if split.local.max_seqlen_q and split.remote.max_seqlen_q:  # both parts hold shards
            return _overlapped(q, k, v, dispatch, group, split, backend, softmax_scale, sinks, exchange)
    if exchange is None:
        exchange = launch_kv_exchange(k, v, dispatch, group)
    k_all, v_all = gather_kv(k, v, exchange, dispatch.kv_index, dispatch, group)
    return _kernel(q, k_all, v_all, dispatch, backend, softmax_scale, window, sinks)


def _check_exchange(exchange: KVExchange, k: torch.Tensor, v: torch.Tensor, dispatch: Dispatch, comm: str) -> None:
    """A KV exchange launched ahead fits the call: not consumed yet, and its buffer holds the rows and
    widths this call's exchange would (`[recv | local]`, K and V side by side)."""
    if comm == "ring":
        raise ValueError("comm='ring' passes K/V blocks around the ring: it takes no exchange launched ahead")
    if exchange.buffer is None:
        raise ValueError("the KV exchange launched ahead was consumed already: launch one per call")
    want = (dispatch.recv_size + k.shape[0], k[0].numel() + v[0].numel())
    if tuple(exchange.buffer.shape) != want:
        raise ValueError(f"the KV exchange launched ahead holds {tuple(exchange.buffer.shape)} rows x widths, this "
                         f"call's would hold {want}: launch it on this call's k and v with this dispatch")  # fmt: skip


def _kernel(q, k, v, shards: Dispatch | ShardSubset, backend, softmax_scale, window, sinks) -> torch.Tensor:
    """One kernel call over `shards`' varlen layout, with the sinks when there are any."""
    shape = (shards.cu_seqlens_q, shards.cu_seqlens_k, shards.max_seqlen_q, shards.max_seqlen_k)
    if sinks is None:
        return varlen_attention(q, k, v, *shape, softmax_scale=softmax_scale, backend=backend, window=window)
    return sink_attention(q, k, v, sinks, *shape, softmax_scale=softmax_scale, backend=backend, window=window)


def _overlapped(q, k, v, dispatch, group, split: OverlapSplit, backend, softmax_scale, sinks,
                exchange: KVExchange | None) -> torch.Tensor:  # fmt: skip
    """Local-only shards run between launching the exchange (unless it was launched ahead) and waiting for it."""
    if exchange is None:
        exchange = launch_kv_exchange(k, v, dispatch, group, async_op=True)
    loc, rem = split.local, split.remote
    window = dispatch.window
    local_kv = k.index_select(0, loc.kv_index), v.index_select(0, loc.kv_index)
    out_local = _kernel(q.index_select(0, loc.rows), *local_kv, loc, backend, softmax_scale, window, sinks)
    k_rem, v_rem = gather_kv(k, v, exchange, rem.kv_index, dispatch, group)
    out_remote = _kernel(q.index_select(0, rem.rows), k_rem, v_rem, rem, backend, softmax_scale, window,
                         sinks)  # fmt: skip
    return torch.cat([out_local, out_remote]).index_select(0, split.inverse)
