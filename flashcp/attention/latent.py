"""Context-parallel multi-head latent attention (MLA): exchange the latent rows, not K and V.

    out = cp_latent_attention(q, latent, k_pe, wkv_b, dispatch, group, comm="compact")

DeepSeek-V2/V3, Kimi K2 and Moonlight store per token one normalised latent `kv_norm(c_kv)`
(`kv_lora_rank` wide, 512) and one RoPE key `k_pe` shared by all heads (64): 576 values, from which
each head's key `[k_nope, k_pe]` (128 + 64) and value (128) are up-projected with `wkv_b`. So this
op sends other ranks exactly the rows the dispatch says they need (the same collectives as the K/V
path: compact, full, needed and two_level) as `[latent | k_pe]` rows, 576 values instead of
`heads x (192 + 128)`: 8.9x fewer bytes at 16 heads, 71x at 128. Each rank then up-projects its
shards' key rows locally and runs one varlen kernel (qk head dim 192, v head dim 128).

Autograd gives the backward: the kernel's dK/dV, the up-projection's gradient for the key rows
(and `wkv_b`'s, summed over this rank's key rows: a parameter gradient that FSDP reduces like any
other), and the exchange's transpose, which sends the latent and `k_pe` gradients of the received
rows back to their owners in the same 576-wide rows.

Up-projection: once over the gathered key rows (every local shard's document prefix and itself,
`dispatch.kv_index`), not the local and received rows separately before the gather. The
gathered latent rows are what the kernel attends to, so nothing is up-projected that no shard
uses (the compact all-gather's buffer also holds its padding and rows meant for other ranks),
and the only per-head K/V tensors are the kernel's own inputs: up-projecting first would hold a
second K/V copy of the buffer until the gather. It costs rows a rank's shards share (two shards of
one document both read its prefix) a second up-projection; the local rows cannot be up-projected
while the exchange is in flight. Measured and modelled in docs/results.md ("MLA: the latent
exchange"): the same CPU time, FLOPs within -20 % .. +12 % of the other way, less memory.

`overlap=True` computes the shards whose keys are all local (their up-projection and kernel) while
the exchange is in flight, then the others, as `cp_varlen_attention(overlap=True)`.
`flashcp.attention.op.latent_attention` runs it as a registered op for `torch.compile`, like
`flashcp.attention.op.cp_attention`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from flashcp.attention.collectives import Collectives, gather_rows, launch_exchange
from flashcp.attention.cp import check_dispatch
from flashcp.attention.kernels import varlen_attention
from flashcp.dispatch import Dispatch


def up_project(latent: torch.Tensor, k_pe: torch.Tensor, wkv_b: torch.Tensor, heads: int, qk_nope_dim: int
               ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Per-head keys `[n, H, qk_nope + rope]` and values `[n, H, v]` of latent rows `[n, R]` and
    their RoPE keys `[n, rope]`; `wkv_b [H * (qk_nope + v), R]` (an `nn.Linear` weight) holds
    each head's key then value rows, as DeepSeek-V3 lays it out.

    Two matmuls on wkv_b's key and value rows (copies the weight's size) rather than one whose
    output is split: v would then be a view keeping the whole product alive while the kernel
    holds it, k_nope's columns included, which `cat` has already copied into k."""
    n, rope = k_pe.shape
    w = wkv_b.view(heads, -1, wkv_b.shape[1])
    w_k, w_v = (part.reshape(-1, wkv_b.shape[1]) for part in w.split([qk_nope_dim, w.shape[1] - qk_nope_dim], 1))
    k_nope = torch.matmul(latent, w_k.t()).view(n, heads, qk_nope_dim)
    v = torch.matmul(latent, w_v.t()).view(n, heads, -1)
    return torch.cat([k_nope, k_pe[:, None].expand(n, heads, rope)], -1), v


def _check(q, latent, k_pe, wkv_b, dispatch: Dispatch, comm: str) -> None:
    if q.dim() != 3 or latent.dim() != 2 or k_pe.dim() != 2 or wkv_b.dim() != 2:
        raise ValueError(
            f"expected q [T, H, qk_nope + rope], latent [T, R], k_pe [T, rope], wkv_b [H * (qk_nope + v), R]; "
            f"got {tuple(q.shape)}, {tuple(latent.shape)}, {tuple(k_pe.shape)}, {tuple(wkv_b.shape)}"
        )
    check_dispatch(dispatch, comm, "q, latent, k_pe", q, latent, k_pe)
    if latent.dtype != k_pe.dtype:  # one packed row buffer carries both
        raise ValueError(f"latent and k_pe dtypes differ: {latent.dtype} vs {k_pe.dtype}")
    heads, nope = q.shape[1], q.shape[2] - k_pe.shape[1]
    if nope < 1 or wkv_b.shape[1] != latent.shape[1] or wkv_b.shape[0] % heads or wkv_b.shape[0] // heads <= nope:
        raise ValueError(
            f"wkv_b {tuple(wkv_b.shape)} must be [{heads} heads x (qk_nope {nope} + v), kv_lora_rank "
            f"{latent.shape[1]}] for q {tuple(q.shape)} and k_pe {tuple(k_pe.shape)}"
        )


def cp_latent_attention(
    q: torch.Tensor,
    latent: torch.Tensor,
    k_pe: torch.Tensor,
    wkv_b: torch.Tensor,
    dispatch: Dispatch,
    group: dist.ProcessGroup | Collectives | None = None,
    comm: str = "compact",
    backend: str = "auto",
    *,
    softmax_scale: float | None = None,
    overlap: bool = False,
) -> torch.Tensor:
    """Document-masked causal MLA of this rank's tokens over the whole CP window.

    `q [T, H, qk_nope + rope]` (RoPE applied to its last `rope` columns), `latent [T, R]`
    (`kv_norm(c_kv)`), `k_pe [T, rope]` (after RoPE) are this rank's rows in `dispatch.token_index`
    order; `wkv_b [H * (qk_nope + v), R]`. `dispatch` and `group` as for `cp_varlen_attention`
    (a two-level dispatch for comm "two_level"). The scale defaults to 1 / sqrt(qk_nope + rope).
    Returns `[T, H, v]` in the same row order. `overlap=True` (a dispatch built with `overlap=True`):
    the shards whose keys are all local are up-projected and computed while the exchange is in flight,
    as `cp_varlen_attention(overlap=True)` does.
    """
    _check(q, latent, k_pe, wkv_b, dispatch, comm)
    split = dispatch.overlap if overlap else None
    if overlap and split is None:
        raise ValueError("overlap=True needs the dispatch's overlap split: build it with "
                         "build_dispatch(plan, rank, comm, overlap=True)")  # fmt: skip
    if split is not None and split.local.max_seqlen_q and split.remote.max_seqlen_q:  # both parts hold shards
        exchange = launch_exchange((latent, k_pe), dispatch, group, async_op=True)
        loc, rem = split.local, split.remote
        local_keys = latent.index_select(0, loc.kv_index), k_pe.index_select(0, loc.kv_index)
        out_local = _kernel(q.index_select(0, loc.rows), *local_keys, wkv_b, loc, backend, softmax_scale)
        remote_keys = gather_rows((latent, k_pe), exchange, rem.kv_index, dispatch, group)
        out_remote = _kernel(q.index_select(0, rem.rows), *remote_keys, wkv_b, rem, backend, softmax_scale)
        return torch.cat([out_local, out_remote]).index_select(0, split.inverse)
    exchange = launch_exchange((latent, k_pe), dispatch, group)
    latent_keys, pe_keys = gather_rows((latent, k_pe), exchange, dispatch.kv_index, dispatch, group)
    return _kernel(q, latent_keys, pe_keys, wkv_b, dispatch, backend, softmax_scale)


def _kernel(q, latent_keys, pe_keys, wkv_b, shards, backend, softmax_scale) -> torch.Tensor:
    """The up-projection of `shards`' gathered key rows and one varlen kernel call over them."""
    k, v = up_project(latent_keys, pe_keys, wkv_b, q.shape[1], q.shape[2] - pe_keys.shape[1])
    return varlen_attention(
        q, k, v, shards.cu_seqlens_q, shards.cu_seqlens_k, shards.max_seqlen_q, shards.max_seqlen_k,
        softmax_scale=softmax_scale, backend=backend,
    )  # fmt: skip
