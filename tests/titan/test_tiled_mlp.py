"""The tiled MLP (flashcp.titan.models.tiled_mlp) is TorchTitan's FeedForward: the same output and
gradients for any tile count and length (tiles that do not divide it, more tiles than tokens), and
autograd never holds a hidden-sized intermediate longer than one tile."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flashcp.titan  # noqa: F401  (TorchTitan shims before torchtitan)
from flashcp.titan.models.tiled_mlp import TiledFeedForward
from torchtitan.models.common.feed_forward import FeedForward
from torchtitan.models.common.linear import Linear

DIM, HIDDEN = 16, 40
TOLERANCE = 1e-6  # max |tiled - untiled| / max |untiled|, fp32; measured < 2e-7 (summation order)


def _config(cls=FeedForward, **kwargs):
    return cls.Config(
        w1=Linear.Config(in_features=DIM, out_features=HIDDEN), w2=Linear.Config(in_features=HIDDEN, out_features=DIM),
        w3=Linear.Config(in_features=DIM, out_features=HIDDEN), **kwargs,
    )  # fmt: skip


def _grads(module: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x = x.clone().requires_grad_()
    shapes = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        shapes.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = module(x)
    y.backward(dy)
    return (y.detach(), x.grad, *(p.grad for p in module.parameters())), shapes


@settings(max_examples=30, deadline=None)
@given(length=st.integers(1, 50), tiles=st.integers(2, 9), seed=st.integers(0, 2**16))
def test_tiles_equal_the_untiled_mlp(length: int, tiles: int, seed: int) -> None:
    torch.manual_seed(seed)
    plain = _config().build()
    tiled = _config(TiledFeedForward, tiles=tiles).build()
    tiled.load_state_dict(plain.state_dict())
    assert set(tiled.state_dict()) == set(plain.state_dict())  # checkpoints load either way
    x, dy = torch.randn(1, length, DIM), torch.randn(1, length, DIM)
    ref, _ = _grads(plain, x, dy)
    got, saved = _grads(tiled, x, dy)
    for a, b in zip(got, ref, strict=True):
        assert ((a - b).abs().max() / b.abs().max()).item() <= TOLERANCE
    # Forward keeps no hidden-sized tensor at all (each tile is recomputed in backward).
    tile = math.ceil(length / tiles)
    assert not [s for s in saved if s[-1] == HIDDEN and math.prod(s[:-1]) > tile], saved


def test_automatic_tiles_keep_one_tiles_intermediates_within_the_budget(monkeypatch) -> None:
    """mlp_tiles = -1: the fewest tiles whose four hidden-sized intermediates fit TILE_BYTES, from the
    shapes of the call (here a budget of 3 tokens' worth: 10 tokens -> 4 tiles); same output."""
    from flashcp.titan.models import tiled_mlp

    assert tiled_mlp.tile_count(7, 10**6, 10**4, 2) == 7
    assert tiled_mlp.tile_count(tiled_mlp.AUTO, 131072, 14336, 2) == 14  # Llama 3 8B, 1M / CP 8: 1 GiB a tile
    monkeypatch.setattr(tiled_mlp, "TILE_BYTES", 3 * 4 * HIDDEN * 4)
    torch.manual_seed(0)
    plain = _config().build()
    auto = _config(TiledFeedForward, tiles=tiled_mlp.AUTO).build()
    auto.load_state_dict(plain.state_dict())
    x, dy = torch.randn(1, 10, DIM), torch.randn(1, 10, DIM)
    ref, _ = _grads(plain, x, dy)
    got, saved = _grads(auto, x, dy)
    for a, b in zip(got, ref, strict=True):
        assert ((a - b).abs().max() / b.abs().max()).item() <= TOLERANCE
    assert [s[1] for s in saved if len(s) == 3 and s[-1] == DIM] == [3, 3, 3, 1]  # the tiles' inputs
