"""RoPE rotations for this rank's tokens, once per step, instead of a table in every layer.

TorchTitan's RoPE module holds a `seq_len x head_dim / 2` table in each layer (32 copies of 512
MiB at 1M tokens for Llama 3 8B, on every rank) and gathers its rows by position in each layer,
which autograd then saves once per layer. With FlashCP's attention each layer's RoPE module is a
table-less `StepComplexRoPE` / `StepCosSinRoPE` (q and k pass through) and the inner attention
rotates them with `rotation(config, positions)`: exactly the rows of TorchTitan's table at this
rank's in-document positions (seq_len / cp rows), computed once per step (`CPStep.of`) and
shared by every layer. The configs stay subclasses of TorchTitan's, so its HF adapters and
`max_seq_len` still read them. TorchTitan's table was a non-persistent buffer: no checkpoint held it.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torchtitan.models.common.rope import _yarn_inv_freq, ComplexRoPE, CosSinRoPE, RoPE
from torchtitan.protocols.module import Module

# RoPE.Config fields that do not change a rotation (the table's length and module plumbing).
_NOT_ROTATION = {"max_seq_len", "param_init", "sharding_config"}


def inverse_frequencies(config: RoPE.Config) -> torch.Tensor:
    """The `head_dim / 2` rotation frequencies of TorchTitan's `_precompute_cache`, scaling included."""
    dim, theta = config.dim, config.theta
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    if config.scaling == "llama":  # Llama 3.1's bands, both formats (TorchTitan's: ComplexRoPE only)
        factor, low, high = config.scaling_factor, config.low_freq_factor, config.high_freq_factor
        original = config.original_max_position_embeddings
        wavelen = 2 * math.pi / freqs
        freqs = torch.where(wavelen > original / low, freqs / factor, freqs)
        smooth = (original / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * freqs / factor + smooth * freqs
        medium = ~(wavelen < original / high) * ~(wavelen > original / low)
        freqs = torch.where(medium, smoothed, freqs)
    elif config.scaling == "yarn" and config.rope_factor > 1.0:
        freqs = _yarn_inv_freq(dim, theta, config.rope_factor, config.beta_fast, config.beta_slow,
                               config.original_seq_len, config.truncate)  # fmt: skip
    return freqs


def rotation(config: RoPE.Config, positions: torch.Tensor) -> torch.Tensor:
    """TorchTitan's RoPE table rows at `positions` ([T] int), computed for those positions only:
    `[T, head_dim / 2]` complex (ComplexRoPE) or `[T, 2 * head_dim]` cos | sin (CosSinRoPE)."""
    with torch.device(positions.device):
        freqs = inverse_frequencies(config)
    if isinstance(config, ComplexRoPE.Config):
        angles = torch.outer(positions, freqs).float()
        return torch.polar(torch.ones_like(angles), angles)
    angles = torch.outer(positions.to(freqs.dtype), freqs).float()
    angles = torch.cat([angles, angles], dim=-1)
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def rotate(config: RoPE.Config, q: torch.Tensor, k: torch.Tensor, rows: torch.Tensor):
    """q, k `[B, T, heads, head_dim]` rotated by `rows` (from `rotation`) with TorchTitan's own code."""
    cls = ComplexRoPE if isinstance(config, ComplexRoPE.Config) else CosSinRoPE
    return cls.apply_rotary_emb(q, k, rows[None, :, None, :])


def rotation_key(config: RoPE.Config) -> tuple:
    """What identifies a rotation: the format and every frequency setting, not the table length."""
    values = (getattr(config, f.name) for f in dataclasses.fields(RoPE.Config) if f.name not in _NOT_ROTATION)
    return (isinstance(config, ComplexRoPE.Config), *values)


class ScaledCosSinRoPE(CosSinRoPE):
    """TorchTitan's cos / sin RoPE with its table from `inverse_frequencies`, which has Llama 3.1's
    wavelength bands (TorchTitan's cos / sin table raises for them): a Qwen3 config.json with llama3
    `rope_scaling`, as transformers runs it, under any attention and wherever a model is built."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(CosSinRoPE.Config):
        pass

    def _precompute_cache(self) -> torch.Tensor:
        return rotation(self.config, torch.arange(self.config.max_seq_len))


class _TablelessRoPE:
    """A layer's RoPE without a table: q and k pass through, FlashCP's attention rotates them."""

    def __init__(self, config: RoPE.Config) -> None:
        Module.__init__(self)
        self.config = config

    def forward(self, query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor | None = None):
        return query, key

    def _init_self_buffers(self, *, buffer_device: torch.device | None = None) -> None:
        pass


class StepComplexRoPE(_TablelessRoPE, ComplexRoPE):
    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(ComplexRoPE.Config):
        pass


class StepCosSinRoPE(_TablelessRoPE, CosSinRoPE):
    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(CosSinRoPE.Config):
        pass


def tableless(config: RoPE.Config) -> RoPE.Config:
    """`config` (TorchTitan's ComplexRoPE / CosSinRoPE) as its table-less step variant, same numbers."""
    cls = StepComplexRoPE.Config if isinstance(config, ComplexRoPE.Config) else StepCosSinRoPE.Config
    return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)})
