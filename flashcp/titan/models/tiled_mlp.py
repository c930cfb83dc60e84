"""The SwiGLU MLP over sequence tiles: its intermediate never exists for all of a rank's tokens at once.

TorchTitan's `FeedForward` computes `w2(silu(w1 x) * w3 x)` for every token of the rank at once, and
autograd keeps w1 x, w3 x and their product (3 x tokens x hidden, hidden ~3.5 x dim) for backward.
`TiledFeedForward` runs that same forward on `tiles` slices of the sequence, each under a
non-reentrant `torch.utils.checkpoint`: autograd keeps only each tile's input (a view of the normed
input, which w1 / w3 kept anyway) and backward recomputes one tile's intermediate at a time (as
Arctic Long Sequence Training's TiledMLP), at the cost of recomputing w1 and w3. Inside full
activation checkpointing the block's recompute tiles the same way (the checkpoints nest).

The weights and their names (w1, w2, w3) are TorchTitan's: FSDP gathers them once per block as
before and checkpoints load either way. Under tensor parallelism each tile runs TorchTitan's TP plan
(w1 / w3 split along the hidden dim, w2 reduced per tile) and the joined output is put back into the
placement the untiled MLP returns. The MLP is token-wise, so tiles change only summation order.

`flashcp.titan.models.tiled_block.use_tiled_blocks` installs it (inside Llama 3's and Qwen3's
blocks the norm and residual add are tiled with it). `tiles = AUTO` picks the count from the shapes
each call sees (no host sync): the fewest tiles whose intermediates (w1 x, w3 x, silu and the
product: 4 x tile x hidden) fit `TILE_BYTES`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint
from torchtitan.models.common.feed_forward import FeedForward

AUTO = -1  # [activation_checkpoint] mlp_tiles = -1: tiles sized by TILE_BYTES
TILE_BYTES = 2**30  # one tile's four hidden-sized intermediates with AUTO


def tile_count(tiles: int, tokens: int, hidden: int, element_bytes: int) -> int:
    """Tiles for `tokens` rows: `tiles` as given, or with AUTO the fewest that keep one tile's
    intermediates within TILE_BYTES (`hidden`: this rank's share of the MLP's width)."""
    if tiles != AUTO:
        return tiles
    return max(1, math.ceil(4 * tokens * hidden * element_bytes / TILE_BYTES))


def run_tiled(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tile_len: int) -> torch.Tensor:
    """Token-wise `fn` over tiles of `tile_len` positions of `x` (dim 1), each under a non-reentrant
    checkpoint: autograd keeps only each tile's input, and backward recomputes one tile at a time."""
    parts = [checkpoint(fn, t, use_reentrant=False, preserve_rng_state=False) for t in x.split(tile_len, dim=1)]
    out = torch.cat(parts, dim=1)
    if isinstance(out, DTensor):  # TP: joining tiles sharded along the sequence may change placement
        out = out.redistribute(placements=parts[0].placements)
    return out


class TiledFeedForward(FeedForward):
    """TorchTitan's SwiGLU FeedForward, run over at most `tiles` sequence tiles (dim 1 of `[B, L, D]`)."""

    @dataclass(kw_only=True, slots=True)
    class Config(FeedForward.Config):
        tiles: int = 2

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.tiles = config.tiles

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w1 = self.w1.weight
        hidden = w1.to_local().shape[0] if isinstance(w1, DTensor) else w1.shape[0]
        tiles = tile_count(self.tiles, x.shape[0] * x.shape[1], hidden, x.element_size())
        return run_tiled(partial(FeedForward.forward, self), x, math.ceil(x.shape[1] / tiles))
