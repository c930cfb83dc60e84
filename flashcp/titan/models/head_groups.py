"""Attention over groups of KV heads: q, K/V, o and their gradients exist for one group at a time.

TorchTitan's `GQAttention` projects q, k, v for all heads, runs the inner attention (FlashCP's op:
the KV exchange and the varlen kernel) and projects the output, and autograd keeps q, k, v, the
gathered K/V buffer and o of every head for backward. `HeadGroupedAttention` runs the same layer as
G groups of n_kv_heads / G KV heads and their n_heads / G query heads: for each group it projects
that group's q/k/v with rows of the fused `wqkv` weight (TorchTitan lays it out per KV head, so a
group's rows are contiguous), applies the QK-norm (per head) and RoPE, calls FlashCP's op on those
heads (the exchange sends the group's K/V rows: the bytes over all groups are unchanged), and adds
`o_g @ wo[:, cols_g].T` into the output. Each group runs under a non-reentrant
`torch.utils.checkpoint`: autograd keeps only the layer's input, and backward recomputes one group
at a time (its projection, exchange and kernel) before its transposed exchange, so the K/V buffer,
q, o, dq and dK/dV working set shrinks by G, at the cost of recomputing the projections and running
the exchange once more per layer. Inside full activation checkpointing the checkpoints nest. The
groups change only the output projection's summation order.

The parameters and their names are TorchTitan's (`qkv_linear.wqkv`, `wo`, `q_norm`, `k_norm`): FSDP
gathers them once per block as before and checkpoints load either way. Not done: tensor parallelism
(the job check refuses it) and other attention classes (MLA, gpt-oss's sinks and sliding windows,
the hybrids' gated attention).

`prefetch` (`[activation_checkpoint] head_group_prefetch`): group g + 1's KV exchange is launched
before group g's kernel, so it crosses the wire while g computes; in backward, where the groups'
recomputes run last to first, g - 1's before g's. The launch runs outside the groups' autograd: it
projects the next group's k and v again from their rows of wqkv (under no_grad, k-normed and rotated
as the op would; a pass's first group launches its own, already projected), starts the exchange
(`FlashCPAttention.launch_exchange`) and hands its handle to that group's op call, which consumes it
instead of launching its own; the group's own k and v keep the gradient path (the same values, up to
the rounding of a narrower GEMM on GPUs). So it costs a second k/v projection for every group but a
pass's first, and holds one more group's exchange buffer, for hiding each group's exchange but the
first of a pass; `benchmarks/head_groups.py --model-only` prices both. Eager code only (a compiled
block, like one without groups, launches each exchange in its op), never with the ring or one CP rank
(nothing to exchange ahead). Collectives are issued in the same order on every rank, a group's own
exchange before the one it launches ahead, so NCCL's in-order execution never makes a group wait for
one launched after it.

`groups = AUTO` picks G from the shapes each call sees: the fewest groups (a divisor of n_kv_heads)
whose q, k, v and o for this rank's tokens fit `GROUP_BYTES`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint
from torchtitan.models.common.attention import FusedQKVLinear, GQAttention

from flashcp.titan.models.attention import FlashCPAttention

AUTO = -1  # [activation_checkpoint] head_groups = -1: groups sized by GROUP_BYTES
GROUP_BYTES = 2**30  # one group's q, k, v and o with AUTO


def group_count(groups: int, tokens: int, n_heads: int, n_kv_heads: int, head_dim: int, element_bytes: int) -> int:
    """G for a layer: `groups` as given, or with AUTO the fewest groups dividing `n_kv_heads` that keep
    one group's q, k, v and o (`tokens` rows each) within GROUP_BYTES (at most n_kv_heads)."""
    if groups != AUTO:
        return groups
    layer_bytes = 2 * (n_heads + n_kv_heads) * tokens * head_dim * element_bytes
    return next((g for g in range(1, n_kv_heads + 1) if n_kv_heads % g == 0 and layer_bytes <= g * GROUP_BYTES),
                n_kv_heads)  # fmt: skip


class HeadGroupedAttention(GQAttention):
    """TorchTitan's `GQAttention` (fused QKV, FlashCP's inner attention) run over `head_groups` groups of
    KV heads (see the module docstring); 1 runs the plain layer."""

    @dataclass(kw_only=True, slots=True)
    class Config(GQAttention.Config):
        head_groups: int = 2
        prefetch: bool = False
        """Launch group g + 1's KV exchange before group g's kernel (eager; see the module docstring)."""

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        if not isinstance(self.qkv_linear, FusedQKVLinear):
            raise TypeError(f"head groups slice the fused wqkv projection; got {type(self.qkv_linear).__name__}")
        if config.head_groups != AUTO and (config.head_groups < 1 or self.n_kv_heads % config.head_groups):
            raise ValueError(f"head_groups ({config.head_groups}) must divide the layer's {self.n_kv_heads} KV heads")
        self.head_groups = config.head_groups
        self.prefetch = config.prefetch

    def forward(self, x_BLD: torch.Tensor, attention_masks, positions: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(self.wo.weight, DTensor):
            raise TypeError("head groups do not run under tensor parallelism (its heads are split already)")
        groups = group_count(self.head_groups, x_BLD.shape[0] * x_BLD.shape[1], self.n_heads, self.n_kv_heads,
                             self.head_dim, x_BLD.element_size())  # fmt: skip
        if groups == 1:
            return super().forward(x_BLD, attention_masks, positions)
        ahead = _Ahead() if self.prefetch and _launches_ahead(attention_masks) else None
        out = None
        for group in range(groups):
            part = checkpoint(self._group, x_BLD, attention_masks, positions, group, groups, ahead,
                              use_reentrant=False, preserve_rng_state=False)  # fmt: skip
            out = part if out is None else out + part
        if ahead is not None:
            ahead.backward = True  # the groups' recomputes run in backward, last group first
        return out if self.wo.bias is None else out + self.wo.bias

    def _group(self, x_BLD: torch.Tensor, attention_masks, positions: torch.Tensor | None, group: int,
               groups: int, ahead: _Ahead | None) -> torch.Tensor:  # fmt: skip
        """Group `group`'s share of the layer's output: its heads' attention through its columns of wo.
        With `ahead`, its exchange is the one launched ahead (or launched now), and the next group's
        is launched before its kernel runs."""
        xq, xk, xv = self._project(x_BLD, group, groups, keys_only=False)
        exchange = None
        if ahead is not None:
            exchange = ahead.pending.pop(group, None)  # a 0-d handle: never test its truth
            if exchange is None:  # a pass's first group: its own k and v, as its op would send them
                with torch.no_grad():
                    exchange = self.inner_attention.launch_exchange(xk, xv, attention_masks)
            after = group - 1 if ahead.backward else group + 1
            if 0 <= after < groups:
                ahead.pending[after] = self._launch(x_BLD, attention_masks, after, groups)
        xq, xk = self.rope(xq, xk, positions)
        out = self.inner_attention(xq, xk, xv, attention_masks=attention_masks, scale=self.scaling,
                                   enable_gqa=self.enable_gqa, exchange=exchange)  # fmt: skip
        cols = xq.shape[2] * self.head_dim
        return F.linear(out.flatten(2), self.wo.weight.narrow(1, group * cols, cols))

    def _project(self, x_BLD: torch.Tensor, group: int, groups: int, keys_only: bool) -> tuple[torch.Tensor, ...]:
        """Group `group`'s q, k, v `[B, L, heads, head_dim]` after the QK-norm, from its rows of `wqkv`
        (TorchTitan's layout: per KV head its heads_per_kv query heads, then k, then v); `keys_only`:
        (k, v) from the k and v rows alone."""
        fused, hd = self.qkv_linear, self.head_dim
        kv_heads = self.n_kv_heads // groups
        rows = kv_heads * fused.r_dim * hd
        weight = fused.wqkv.weight.narrow(0, group * rows, rows)
        bias = None if fused.wqkv.bias is None else fused.wqkv.bias.narrow(0, group * rows, rows)
        split = [fused.heads_per_kv, 1, 1]
        if keys_only:  # the k and v rows of each KV head, side by side

            def keys(t: torch.Tensor) -> torch.Tensor:
                return t.unflatten(0, (kv_heads, fused.r_dim, hd))[:, fused.heads_per_kv :].flatten(0, 2)

            weight, bias, split = keys(weight), None if bias is None else keys(bias), [1, 1]
        qkv = F.linear(x_BLD, weight, bias).view(*x_BLD.shape[:2], kv_heads, sum(split), hd)
        parts = [t.reshape(*x_BLD.shape[:2], -1, hd).contiguous() for t in torch.split(qkv, split, dim=-2)]
        if self.q_norm is not None:  # per head, as in GQAttention
            parts = ([self.k_norm(t) for t in parts[:1]] + parts[1:] if keys_only
                     else [self.q_norm(parts[0]), self.k_norm(parts[1]), parts[2]])  # fmt: skip
        return tuple(parts)

    @torch.no_grad()
    def _launch(self, x_BLD: torch.Tensor, attention_masks, group: int, groups: int) -> torch.Tensor:
        """Group `group`'s k and v, projected ahead of its call from its rows of wqkv, and their exchange
        launched."""
        xk, xv = self._project(x_BLD, group, groups, keys_only=True)
        return self.inner_attention.launch_exchange(xk, xv, attention_masks)


@dataclass
class _Ahead:
    """One forward's exchanges launched ahead, by group, until that group's call consumes it; the groups run
    first to last in forward, last to first in the recomputes of backward (`backward` once forward is done)."""

    pending: dict[int, torch.Tensor] = field(default_factory=dict)
    backward: bool = False


def _launches_ahead(attention_masks) -> bool:
    """Whether this step's layers exchange K/V in a collective one can launch ahead: eager code, more than
    one CP rank, not the ring."""
    dispatch = getattr(attention_masks, "dispatch", None)
    return (not torch.compiler.is_compiling() and dispatch is not None and dispatch.cp_size > 1
            and dispatch.comm != "ring")  # fmt: skip


def use_head_groups(model_config, groups: int, prefetch: bool = False) -> None:
    """Make every layer's attention of a TorchTitan decoder config a `HeadGroupedAttention`, in place
    (groups 1: unchanged; AUTO: sized by GROUP_BYTES at each call; `prefetch`: each group's KV exchange
    launched while the one before computes). Every layer must be a full-attention `GQAttention` with
    FlashCP's inner attention (`use_flashcp_attention` first): ValueError otherwise."""
    if groups == 1:
        return
    for i, layer in enumerate(model_config.layers):
        attention = getattr(layer, "attention", None)
        inner = getattr(attention, "inner_attention", None)
        if type(attention) is not GQAttention.Config or not isinstance(inner, FlashCPAttention.Config) or inner.window:
            raise ValueError(f"head groups run full-attention GQAttention layers with FlashCP's attention; layer {i} "
                             f"is {type(attention).__qualname__}")  # fmt: skip
        n_kv_heads = attention.n_kv_heads or attention.n_heads
        if groups != AUTO and (groups < 1 or n_kv_heads % groups):
            raise ValueError(f"head_groups ({groups}) must divide the model's {n_kv_heads} KV heads")
        fields = {f.name: getattr(attention, f.name) for f in dataclasses.fields(attention)}
        layer.attention = HeadGroupedAttention.Config(**fields, head_groups=groups, prefetch=prefetch)
