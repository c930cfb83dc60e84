"""The tiled block (flashcp.titan.models.tiled_block) is TorchTitan's dense decoder block: the same output
and gradients in float64 for any tile count (uneven tiles and AUTO included), the same losses when the
trainer runs it, and its norms' float32 temporaries never exist for more than one tile's tokens."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

import flashcp.titan  # noqa: F401  (TorchTitan shims before torchtitan)
from flashcp.titan.models import tiled_mlp
from flashcp.titan.models.tiled_block import TiledRMSNorm, TiledTransformerBlock, use_tiled_blocks
from torchtitan.models.common import ComplexRoPE
from torchtitan.models.common.nn_modules import RMSNorm
from torchtitan.models.llama3 import _build_llama3_layers
from torchtitan.protocols.module import Module

from harness import single_rank, tiny_job, train

DIM, HEADS, HIDDEN, LENGTH = 16, 2, 40, 10


class CausalAttention(Module):
    """Plain causal attention as the block's inner attention (the block is tested, not the CP op)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        pass

    def __init__(self, config: Config) -> None:
        super().__init__()

    def forward(self, q, k, v, *, attention_masks=None, scale=None, enable_gqa=False) -> torch.Tensor:
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale, enable_gqa=enable_gqa
        )
        return out.transpose(1, 2)


def _blocks(tiles: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A Llama 3 block and the same block tiled (`use_tiled_blocks`; tiles = 1, which leaves the config as
    it is, set on the tiled block's), equal weights, float64."""
    rope = ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=64, theta=10000.0)
    model = type("Layers", (), {})()
    model.layers = _build_llama3_layers(n_layers=1, dim=DIM, n_heads=HEADS, hidden_dim=HIDDEN, rope=rope,
                                        n_kv_heads=1, attn_backend="flex")  # fmt: skip
    model.layers[0].attention.inner_attention = CausalAttention.Config()
    plain = model.layers[0].build()
    use_tiled_blocks(model, 2)
    model.layers[0].tiles = tiles
    tiled = model.layers[0].build()
    for block in (plain, tiled):
        block.init_states(buffer_device=torch.device("cpu"))
        block.to(torch.float64)
        for p in block.parameters():  # norm weights off 1, so their gradients are not trivial
            p.data.add_(0.1 * torch.randn_like(p))
    tiled.load_state_dict(plain.state_dict())
    return plain, tiled


def _run(block: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor) -> tuple[list[torch.Tensor], list]:
    """Output, the input's and every parameter's gradient, and the shapes autograd saved."""
    x = x.clone().requires_grad_()
    saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = block(x, None)
    y.backward(dy)
    return [y.detach(), x.grad, *(p.grad for _, p in sorted(block.named_parameters()))], saved


@pytest.mark.parametrize("tiles", [1, 2, 3, tiled_mlp.AUTO])
def test_tiled_block_equals_torchtitans_block_in_float64(tiles: int, monkeypatch) -> None:
    """Tiles change only summation order: forward and every gradient within 1e-12 in float64. AUTO
    here with a budget of 4 tokens' MLP intermediates (10 tokens -> 3 tiles of 4, 4, 2)."""
    monkeypatch.setattr(tiled_mlp, "TILE_BYTES", 4 * 4 * HIDDEN * 8)
    torch.manual_seed(0)
    plain, tiled = _blocks(tiles)
    assert isinstance(tiled, TiledTransformerBlock) and type(plain) is not TiledTransformerBlock
    assert set(tiled.state_dict()) == set(plain.state_dict())  # checkpoints load either way
    x, dy = torch.randn(1, LENGTH, DIM, dtype=torch.float64), torch.randn(1, LENGTH, DIM, dtype=torch.float64)
    ref, _ = _run(plain, x, dy)
    got, saved = _run(tiled, x, dy)
    for a, b in zip(got, ref, strict=True):
        assert (a - b).abs().max().item() <= 1e-12
    # Of the activations of all tokens, forward saves only the projections' inputs (the normed x for
    # q/k/v, the attention's output for wo); the norms' and MLP's are recomputed a tile at a time.
    if tiles == 1:  # one tile: its input is all tokens
        return
    tile = math.ceil(LENGTH / (3 if tiles == tiled_mlp.AUTO else tiles))
    assert not [s for s in saved if s[-1] == HIDDEN and math.prod(s[:-1]) > tile], saved
    assert [s for s in saved if s in ((LENGTH, DIM), (1, LENGTH, DIM))] == [(LENGTH, DIM)] * 2, saved


@pytest.mark.parametrize("tiles", [2, 3, tiled_mlp.AUTO])
def test_the_tiled_final_norm_equals_rmsnorm_with_float32_work_for_one_tile(tiles: int, monkeypatch) -> None:
    """The decoder's final norm over tiles: the plain RMSNorm's output and gradients (float64, 1e-12), and
    autograd keeps no more than one tile's rows of any tensor, so its float32 work is recomputed a tile
    at a time (AUTO: a budget of four float32 temporaries of 4 tokens -> 3 tiles)."""
    monkeypatch.setattr(tiled_mlp, "TILE_BYTES", 16 * 4 * DIM)
    monkeypatch.setattr("flashcp.titan.models.tiled_block.TILE_BYTES", 16 * 4 * DIM)
    config = RMSNorm.Config(normalized_shape=DIM)
    plain, tiled = config.build(), TiledRMSNorm.Config(normalized_shape=DIM, tiles=tiles).build()
    torch.manual_seed(0)
    plain.to(torch.float64).weight.data.add_(0.1 * torch.randn(DIM, dtype=torch.float64))
    tiled.to(torch.float64).load_state_dict(plain.state_dict())
    x, dy = torch.randn(1, LENGTH, DIM, dtype=torch.float64), torch.randn(1, LENGTH, DIM, dtype=torch.float64)
    outs = []
    for norm in (plain, tiled):
        xi = x.clone().requires_grad_()
        made = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: made.append(tuple(t.shape)) or t, lambda t: t):
            y = norm(xi)
        y.backward(dy)
        outs.append(([y.detach(), xi.grad, norm.weight.grad], made))
    (ref, _), (got, saved) = outs
    for a, b in zip(got, ref, strict=True):
        assert (a - b).abs().max().item() <= 1e-12
    tile = math.ceil(LENGTH / (3 if tiles == tiled_mlp.AUTO else tiles))
    assert saved and not [s for s in saved if s[-1] == DIM and tile < math.prod(s[:-1])], saved  # only tiles' inputs


def test_use_tiled_blocks_tiles_the_final_norm_of_a_dense_llama3() -> None:
    from flashcp.titan.launch.job import trainer_config

    model = trainer_config(tiny_job("unused", activation_checkpoint={"mode": "full", "mlp_tiles": 3})).model_spec.model
    assert type(model.norm) is TiledRMSNorm.Config and model.norm.tiles == 3
    plain = trainer_config(tiny_job("unused", activation_checkpoint={"mode": "full"})).model_spec.model
    assert type(plain.norm) is RMSNorm.Config


def test_the_trainer_with_tiled_blocks_trains_the_plain_losses(tmp_path) -> None:
    """mlp_tiles = 3 (not dividing the rank's tokens) under full AC: Llama 3's blocks are tiled blocks,
    and the losses are the untiled run's (fp32, summation order only)."""
    from flashcp.titan.launch.job import trainer_config

    def job(name: str, tiles: int) -> dict:
        return tiny_job(tmp_path / name, training={"steps": 3},
                        activation_checkpoint={"mode": "full", "mlp_tiles": tiles})  # fmt: skip

    layers = trainer_config(job("spec", 3)).model_spec.model.layers
    assert all(type(layer) is TiledTransformerBlock.Config and layer.tiles == 3 for layer in layers)
    with single_rank():
        plain = train(job("plain", 0))
    with single_rank():
        tiled = train(job("tiled", 3))
    assert tiled[3] < tiled[1]  # it trains
    assert max(abs(tiled[s] - plain[s]) / abs(plain[s]) for s in plain) <= 1e-6, (tiled, plain)
