"""A dense decoder block whose token-wise work runs over sequence tiles, the norms and residual adds included.

`TiledFeedForward` tiles the MLP's hidden-sized intermediate, but TorchTitan's block still computes
`ffn_norm(h)` for all of a rank's tokens, and RMSNorm works in float32: in the block's recompute
and backward its float32 temporaries (x.float(), its square, the rstd products; tokens x dim x 4
bytes each) existed for every token at once. In the dry run of Llama 3 8B at 2M tokens on 8 ranks
(262144 tokens a rank) the 8 largest tensors at the peak were such float32 [262144, 4096] tensors,
4 GiB each, made in ffn_norm's backward and around w2's backward.

`TiledTransformerBlock` computes the same `x + attention(attention_norm(x))` and
`h + feed_forward(ffn_norm(h))`, with
- the FFN half as one unit per sequence tile, `h_t + w2(silu(w1 n_t) * w3 n_t)` with
  `n_t = ffn_norm(h_t)`, each tile under a non-reentrant checkpoint: autograd keeps only the tile's
  input (a view of h), and backward recomputes one tile's norm and MLP at a time;
- attention_norm per tile, each under a checkpoint: its float32 temporaries exist for one tile
  (the normed x is joined, since the attention op needs q, k and v whole).
The q/k/v and output projections stay whole: the projections' outputs are needed whole by the
attention op anyway, and tiling them would mean re-implementing the attention module's forward.
Measured (dry run, that job without offload, mlp_tiles = 16): 116.3 GiB tracked before, 102.6 after,
the peak then in the final norm's backward (outside the blocks); the attention_norm tiles were not
measured apart from the FFN half's (an untiled attention_norm has the same float32 temporaries).
The decoder's final norm, before the output projection, is the same RMSNorm over the same tokens,
so it is tiled too (`TiledRMSNorm`).

Tiles change only summation order. The count is `[activation_checkpoint] mlp_tiles` (AUTO sized as
the tiled MLP's, by its hidden-sized intermediates): the norms and residual adds are tiled whenever
the MLP is, for every layer of Llama 3 and dense Qwen3 (a model with experts refuses mlp_tiles; any
other block with a dense FeedForward, Qwen3.5's, keeps only its MLP tiled).
Parameter names are TorchTitan's, so checkpoints load either way. Under tensor parallelism (with
sequence parallelism the block's input is sharded along the sequence) the tiles are taken from each
rank's local rows and go through the norms' and MLP's own sharding hooks as the whole would:
every op tiled is token-wise, so which rows share a tile does not matter.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import partial

import torch
from torch.distributed.tensor import DTensor
from torchtitan.models.common.attention import AttentionMasksType
from torchtitan.models.common.decoder import TransformerBlock
from torchtitan.models.common.feed_forward import FeedForward
from torchtitan.models.common.nn_modules import RMSNorm
from torchtitan.models.llama3.model import Llama3TransformerBlock
from torchtitan.models.qwen3.model import Qwen3TransformerBlock

from flashcp.titan.models.tiled_mlp import AUTO, run_tiled, TiledFeedForward, tile_count, TILE_BYTES

# The dense blocks whose forward is exactly `x + attn(attention_norm(x)); x + ffn(ffn_norm(x))`.
DENSE_BLOCKS = (Llama3TransformerBlock.Config, Qwen3TransformerBlock.Config)


def _sequence_tiled(fn, x: torch.Tensor, tiles: int) -> torch.Tensor:
    """`run_tiled` over `tiles` tiles of x. A DTensor (TP, x sequence-sharded under SP) is tiled by its
    local rows, each tile handed to `fn` with x's placements: splitting it as a DTensor would gather
    the sequence, and the norms' sharding hooks expect their input and output sharded as x."""
    if not isinstance(x, DTensor):
        return run_tiled(fn, x, math.ceil(x.shape[1] / tiles))
    mesh, placements = x.device_mesh, x.placements

    def local_fn(tile: torch.Tensor) -> torch.Tensor:
        return fn(DTensor.from_local(tile, mesh, placements, run_check=False)).to_local(grad_placements=placements)

    local = x.to_local(grad_placements=placements)
    out = run_tiled(local_fn, local, math.ceil(local.shape[1] / tiles))
    return DTensor.from_local(out, mesh, placements, run_check=False)


class TiledTransformerBlock(TransformerBlock):
    """A dense TorchTitan decoder block with its norms, MLP and FFN residual run over sequence tiles."""

    @dataclass(kw_only=True, slots=True)
    class Config(TransformerBlock.Config):
        tiles: int = 2

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.attention = config.attention.build()
        self.attention_norm = config.attention_norm.build()
        self.ffn_norm = config.ffn_norm.build()
        self.feed_forward = config.feed_forward.build()
        self.moe_enabled = False
        self.tiles = config.tiles

    def forward(
        self, x: torch.Tensor, attention_masks: AttentionMasksType | None, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        w1 = self.feed_forward.w1.weight
        hidden = w1.to_local().shape[0] if isinstance(w1, DTensor) else w1.shape[0]
        tiles = tile_count(self.tiles, x.shape[0] * x.shape[1], hidden, x.element_size())
        h = x + self.attention(_sequence_tiled(self.attention_norm, x, tiles), attention_masks, positions)
        return _sequence_tiled(self._ffn_half, h, tiles)

    def _ffn_half(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.feed_forward(self.ffn_norm(h))


class TiledRMSNorm(RMSNorm):
    """TorchTitan's RMSNorm over sequence tiles, each recomputed in backward: the decoder's final norm,
    whose float32 temporaries would otherwise exist for all of a rank's tokens. AUTO: the fewest tiles
    whose four float32 temporaries of one tile fit TILE_BYTES."""

    @dataclass(kw_only=True, slots=True)
    class Config(RMSNorm.Config):
        tiles: int = 2

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.tiles = config.tiles

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.shape[0] * x.shape[1]
        tiles = self.tiles if self.tiles != AUTO else math.ceil(16 * tokens * x.shape[-1] / TILE_BYTES)
        if tiles <= 1:
            return super().forward(x)
        return _sequence_tiled(partial(RMSNorm.forward, self), x, tiles)


def use_tiled_blocks(model_config, tiles: int) -> None:
    """Tile the token-wise work of every dense layer of a TorchTitan decoder config, in place: a
    Llama 3 / Qwen3 dense block becomes a `TiledTransformerBlock`, any other layer's
    dense FeedForward a `TiledFeedForward`, and the final RMSNorm of a model with such a block a
    `TiledRMSNorm` (tiles 0 or 1: unchanged; AUTO: sized at each call)."""
    if tiles in (0, 1):
        return
    norm = getattr(model_config, "norm", None)
    if type(norm) is RMSNorm.Config and any(type(layer) in DENSE_BLOCKS for layer in model_config.layers):
        fields = {f.name: getattr(norm, f.name) for f in dataclasses.fields(norm)}
        model_config.norm = TiledRMSNorm.Config(**fields, tiles=tiles)
    for i, layer in enumerate(model_config.layers):
        ffn = getattr(layer, "feed_forward", None)
        if type(ffn) is not FeedForward.Config:
            continue
        if type(layer) in DENSE_BLOCKS:
            model_config.layers[i] = TiledTransformerBlock.Config(
                attention=layer.attention, feed_forward=ffn, attention_norm=layer.attention_norm,
                ffn_norm=layer.ffn_norm, param_init=layer.param_init, sharding_config=layer.sharding_config,
                tiles=tiles,
            )  # fmt: skip
        else:
            layer.feed_forward = TiledFeedForward.Config(
                w1=ffn.w1, w2=ffn.w2, w3=ffn.w3, param_init=ffn.param_init,
                sharding_config=ffn.sharding_config, tiles=tiles,
            )  # fmt: skip
