"""The exact pure-torch attention kernel: a blocked online softmax, forward and backward.

    out = reference_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=True)

Same interface and semantics as `varlen_attention` (see `flashcp.attention.kernels`): packed
sequences, bottom-right causal mask, GQA, a query without a visible key outputs zeros, and V's
head dim may differ from Q's and K's (MLA: 192 / 128); the output has V's. `window=W` (HF's
`sliding_window`) keeps each query's last W visible keys only; tiles left of every window are skipped.

Each sequence is cut into tiles of `BLOCK_Q` queries x `BLOCK_K` keys. Tiles above the causal
diagonal are never computed and only tiles crossing it are masked, so the work follows the
attended (query, key) pairs: a query block's masked corner wastes about `BLOCK_Q / 2` keys per
query, hence few queries per tile (counted on FlashCP plans of packed Pile windows at 16K-32K,
CP 4 and 8: at most 1.11x the attended pairs on a rank, and that ratio equal on all ranks of a
plan to 0.4 %; 512-query tiles waste up to 1.40x and 6.6 %). 512 keys keep a tile's arrays in a
core's cache (1 MiB at the tiny model's 4 query heads): with 2048, ranks whose documents have long
prefixes (full 2048-key tiles) took up to 10 % longer per pair than ranks of short documents, and
every rank 5-10 % longer (measured at 16K-32K, CP 4, the tiny model's heads). The forward keeps a
running maximum and sum per query row (the online softmax) and saves only the output and each
row's log-sum-exp; the backward recomputes every tile's probabilities from them. Memory is
therefore the inputs plus O(BLOCK_Q x BLOCK_K x heads) per step, whatever the sequence lengths,
instead of a saved probability per attended pair. Those per-tile arrays are written into buffers
allocated once per call (`_Workspace`): allocated afresh, each multi-MiB array is mapped and faulted
in again by the C allocator, which cost a rank 10-50 % of its time, varying with its tiles' sizes
and order rather than its attended pairs (measured at 16K / CP 4, see docs/results.md).

Scores and probabilities are computed in `compute_dtype` (float64 for float64 inputs, float32
otherwise); running statistics and accumulators in at least float32, as flash kernels keep them.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch.autograd.function import once_differentiable

BLOCK_Q, BLOCK_K = 128, 512  # queries and keys per tile


class Tile(NamedTuple):
    """Query rows [q0, q1) against key rows [k0, k1) of the packed tensors. `diagonal` is None when
    every query sees every key of the tile, else query row i of the tile sees keys 0 .. i + diagonal;
    `low` is None unless a window hides some, else query row i sees keys i + low onwards only."""

    q0: int
    q1: int
    k0: int
    k1: int
    diagonal: int | None
    low: int | None = None


def tiles(
    bounds_q: list[int], bounds_k: list[int], causal: bool, block_q: int = BLOCK_Q, block_k: int = BLOCK_K,
    window: int | None = None,
) -> Iterator[list[Tile]]:
    """Per query block (in order), the tiles holding at least one visible (query, key) pair
    (`window`: each query's last `window` causal keys only)."""
    for s in range(len(bounds_q) - 1):
        q_start, q_end, k_start, k_end = bounds_q[s], bounds_q[s + 1], bounds_k[s], bounds_k[s + 1]
        shift = (k_end - k_start) - (q_end - q_start)  # query i of the sequence sees keys 0 .. i + shift
        for q0 in range(q_start, q_end, block_q):
            q1 = min(q_end, q0 + block_q)
            first = q0 - q_start + shift  # the last key the block's first query sees
            last = min(k_end - k_start, q1 - q_start + shift) if causal else k_end - k_start
            # With a window, query i sees keys from i + shift - window + 1: the block's first from `lowest`.
            lowest = 0 if window is None else max(0, first - window + 1)
            row = []
            for c0 in range(lowest, max(0, last), block_k):
                c1 = min(last, c0 + block_k)
                diagonal = first - c0 if causal and c1 - 1 > first else None
                cut = window is not None and first - window + q1 - q0 > c0  # the last query hides keys
                low = first - window + 1 - c0 if cut else None
                row.append(Tile(q0, q1, k_start + c0, k_start + c1, diagonal, low))
            yield row


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    causal: bool = True,
    scale: float | None = None,
    compute_dtype: torch.dtype | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Exact masked softmax attention `[Tq, Hq, D]` of packed sequences (see the module docstring).

    `compute_dtype` overrides the precision of scores and probabilities (the GPU check computes
    in half precision too, as the yardstick of how far a half precision kernel may be from the
    exact result)."""
    plan, scale, compute = _setup(q, cu_seqlens_q, cu_seqlens_k, causal, scale, compute_dtype, window)
    return _BlockedAttention.apply(q, k, v, plan, scale, compute)


def _setup(q, cu_seqlens_q, cu_seqlens_k, causal, scale, compute_dtype=None, window=None):
    """The call's tiles, softmax scale and compute dtype."""
    compute = compute_dtype or (torch.float64 if q.dtype == torch.float64 else torch.float32)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    bounds = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    return list(tiles(*bounds, causal, BLOCK_Q, BLOCK_K, window)), scale, compute


def _heads_first(x: torch.Tensor, kv_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """[T, H, D] -> [Hkv, T * H / Hkv, D]: a query block's rows of one KV head's group are adjacent,
    so one batched matmul per tile serves every query head of the group."""
    t, h, d = x.shape
    group = h // kv_heads
    return x.to(dtype).reshape(t, kv_heads, group, d).transpose(0, 1).reshape(kv_heads, t * group, d)


def _tokens_first(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The inverse of `_heads_first` as a new tensor of `like`'s tokens, heads and dtype (x's head
    dim): [Hkv, T * G, D] -> [T, H, D]."""
    t, h, d = *like.shape[:2], x.shape[-1]
    y = x.view(x.shape[0], t, h // x.shape[0], d).transpose(0, 1)
    return y.to(like.dtype, copy=True, memory_format=torch.contiguous_format).view(t, h, d)


class _Workspace:
    """Flat buffers sized for the plan's largest tile, reused by every tile of one call: `take(i, ...)`
    views buffer i as a contiguous array (0: scores or probabilities, 1: their gradient, 2: a tile's
    product with V, dO, K or Q), and `hidden` writes a tile's causal mask from one precomputed band."""

    def __init__(self, like: torch.Tensor, plan: list[list[Tile]], kv_heads: int, group: int, width: int):
        rows = max((t.q1 - t.q0 for row in plan for t in row), default=0)
        cols = max((t.k1 - t.k0 for row in plan for t in row), default=0)
        sizes = (rows * group * cols, rows * group * cols, max(rows * group, cols) * width)
        self.buffers = [like.new_empty(kv_heads * n) for n in sizes]
        # band[i, j] = j - i: a tile hides key j from its query row i where j - i > diagonal.
        self.band = torch.arange(cols, device=like.device) - torch.arange(rows, device=like.device)[:, None]
        self.mask = torch.empty(rows * cols, dtype=torch.bool, device=like.device)

    def take(self, i: int, *shape: int) -> torch.Tensor:
        return self.buffers[i][: math.prod(shape)].view(shape)

    def hidden(self, tile: Tile) -> torch.Tensor:
        rows, cols = tile.q1 - tile.q0, tile.k1 - tile.k0
        band, mask = self.band[:rows, :cols], self.mask[: rows * cols].view(rows, cols)
        if tile.diagonal is None:
            mask.zero_()
        else:
            torch.gt(band, tile.diagonal, out=mask)
        return mask if tile.low is None else mask.logical_or_(band < tile.low)


def _scores(q: torch.Tensor, k: torch.Tensor, tile: Tile, group: int, ws: _Workspace) -> torch.Tensor:
    """The tile's scores [Hkv, Bq * G, Bk] (q comes scaled) in workspace buffer 0, -inf where the
    causal mask hides a key."""
    hkv, rows, cols = q.shape[0], q.shape[1], k.shape[1]
    scores = torch.matmul(q, k.transpose(-1, -2), out=ws.take(0, hkv, rows, cols))
    if tile.diagonal is not None or tile.low is not None:
        scores.view(hkv, -1, group, cols).masked_fill_(ws.hidden(tile).unsqueeze(1), float("-inf"))
    return scores


def _blocked_forward(q, k, v, plan: list[list[Tile]], scale: float, compute: torch.dtype):
    """The output [Hkv, T * G, D] and log-sum-exp [Hkv, T * G] (+inf where a row sees no key, so
    its recomputed probabilities are 0), heads first, in the statistics' dtype."""
    stat = torch.promote_types(compute, torch.float32)
    hkv, group = k.shape[1], q.shape[1] // k.shape[1]
    qs = _heads_first(q, hkv, compute) * scale
    ks, vs = _heads_first(k, hkv, compute), _heads_first(v, hkv, compute)
    out = qs.new_zeros((*qs.shape[:2], vs.shape[-1]), dtype=stat)
    lse = qs.new_full(qs.shape[:2], math.inf, dtype=stat)
    ws = _Workspace(qs, plan, hkv, group, max(qs.shape[-1], vs.shape[-1]))
    for row in plan:
        if not row:
            continue
        r0, r1 = row[0].q0 * group, row[0].q1 * group
        qb = qs[:, r0:r1]
        peak = qs.new_full((hkv, r1 - r0, 1), -math.inf, dtype=stat)
        total = qs.new_zeros((hkv, r1 - r0, 1), dtype=stat)
        acc = out[:, r0:r1]
        for tile in row:
            scores = _scores(qb, ks[:, tile.k0 : tile.k1], tile, group, ws)
            new_peak = torch.maximum(peak, scores.amax(-1, keepdim=True).to(stat))
            # A row with no visible key so far keeps peak -inf: subtract 0 instead (its exps are 0).
            base = new_peak.masked_fill(new_peak == -math.inf, 0.0)
            probs = scores.to(stat).sub_(base).exp_().to(compute)
            decay = torch.exp(peak - base)
            total.mul_(decay).add_(probs.sum(-1, keepdim=True, dtype=stat))
            pv = ws.take(2, hkv, r1 - r0, vs.shape[-1])
            acc.mul_(decay).add_(torch.matmul(probs, vs[:, tile.k0 : tile.k1], out=pv))
            peak = new_peak
        seen = total > 0
        acc.div_(total.masked_fill(~seen, 1.0))
        lse[:, r0:r1] = torch.where(seen, peak + total.log(), math.inf).squeeze(-1)
    return out, lse


def _blocked_backward(grad_out, q, k, v, out, lse, plan: list[list[Tile]], scale: float, compute: torch.dtype):
    """dq, dk, dv (tokens first) from the output and log-sum-exp of `_blocked_forward`'s layout."""
    stat = out.dtype
    hkv, group = k.shape[1], q.shape[1] // k.shape[1]
    qs = _heads_first(q, hkv, compute) * scale
    ks, vs = _heads_first(k, hkv, compute), _heads_first(v, hkv, compute)
    dos = _heads_first(grad_out, hkv, compute)
    # softmax backward: dS = P * (dP - rowsum(dO * O)), one sum per query row.
    delta = (dos.to(stat) * out).sum(-1, keepdim=True)
    dq, dk, dv = (qs.new_zeros(t.shape, dtype=stat) for t in (qs, ks, vs))
    ws = _Workspace(qs, plan, hkv, group, max(qs.shape[-1], vs.shape[-1]))
    for row in plan:
        if not row:
            continue
        r0, r1 = row[0].q0 * group, row[0].q1 * group
        qb, dob, lse_b, delta_b = qs[:, r0:r1], dos[:, r0:r1], lse[:, r0:r1, None], delta[:, r0:r1]
        for tile in row:
            kt, vt = ks[:, tile.k0 : tile.k1], vs[:, tile.k0 : tile.k1]
            rows, cols, width = r1 - r0, tile.k1 - tile.k0, qs.shape[-1]
            by_key, by_query = ws.take(2, hkv, cols, width), ws.take(2, hkv, rows, width)
            probs = _scores(qb, kt, tile, group, ws).to(stat).sub_(lse_b).exp_().to(compute)
            dvt = ws.take(2, hkv, cols, vs.shape[-1])
            dv[:, tile.k0 : tile.k1] += torch.matmul(probs.transpose(-1, -2), dob, out=dvt)
            dscores = torch.matmul(dob, vt.transpose(-1, -2), out=ws.take(1, hkv, rows, cols))
            dscores.sub_(delta_b).mul_(probs)
            dq[:, r0:r1] += torch.matmul(dscores, kt, out=by_query)
            dk[:, tile.k0 : tile.k1] += torch.matmul(dscores.transpose(-1, -2), qb, out=by_key)
    dq.mul_(scale)  # the tiles used q * scale
    return tuple(_tokens_first(g, t) for g, t in ((dq, q), (dk, k), (dv, v)))


class _BlockedAttention(torch.autograd.Function):
    """Forward and backward by tiles; autograd would keep every tile's probabilities instead."""

    @staticmethod
    def forward(ctx, q, k, v, plan: list[list[Tile]], scale: float, compute: torch.dtype):  # type: ignore
        out, lse = _blocked_forward(q, k, v, plan, scale, compute)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.scale, ctx.compute = plan, scale, compute
        return _tokens_first(out, q)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        grads = _blocked_backward(grad_out, q, k, v, out, lse, ctx.plan, ctx.scale, ctx.compute)
        return (*grads, None, None, None)


# --- the pieces of a ring: forward with the log-sum-exp, backward from the merged output ---


def reference_attention_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    causal: bool = True, scale: float | None = None, window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`reference_attention`'s output (no autograd) and each query row's log-sum-exp [Hq, Tq] in at
    least float32, -inf where a row sees no key (the layout of FlashAttention's varlen LSE)."""
    plan, scale, compute = _setup(q, cu_seqlens_q, cu_seqlens_k, causal, scale, window=window)
    out, lse = _blocked_forward(q, k, v, plan, scale, compute)
    hkv, group = k.shape[1], q.shape[1] // k.shape[1]
    by_head = lse.view(hkv, q.shape[0], group).transpose(1, 2).reshape(q.shape[1], q.shape[0])
    return _tokens_first(out, q), by_head.masked_fill(by_head == math.inf, -math.inf)


def reference_attention_backward(
    grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, causal: bool = True,
    scale: float | None = None, window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """dq, dk, dv of one call given an output and log-sum-exp [Hq, Tq] that need not be the call's
    own: with a ring's merged ones, each call's gradients are its share of the whole attention's
    (with a sink's corrected ones, the gradients of attention with that sink)."""
    plan, scale, compute = _setup(q, cu_seqlens_q, cu_seqlens_k, causal, scale, window=window)
    hkv, group = k.shape[1], q.shape[1] // k.shape[1]
    stat = torch.promote_types(compute, torch.float32)
    rows = lse.to(stat).masked_fill(lse == -math.inf, math.inf)
    rows = rows.view(hkv, group, q.shape[0]).transpose(1, 2).reshape(hkv, q.shape[0] * group)
    return _blocked_backward(grad_out, q, k, v, _heads_first(out, hkv, stat), rows, plan, scale, compute)
