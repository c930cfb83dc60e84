"""Qwen3.5's Gated DeltaNet layers on FlashCP's linear-attention ops, swapped in from outside.

TorchTitan's `GatedDeltaNet` (torchtitan.models.qwen3_5, imported through `compat.import_qwen3_5`)
runs flash-linear-attention's CUDA kernels over the window's documents. `FlashCPGatedDeltaNet` is
that module with its forward replaced, as `FlashCPLatentAttention` is MLA's: the same parameters
(names, shapes, initialisation, so TorchTitan's Qwen3.5 HF adapter applies) and the math of
transformers' torch fallback (`Qwen3_5GatedDeltaNet`), on this rank's rows in the dispatch's order:

- q / k / v: one `cp_causal_conv1d` over the three projections' channels (one halo exchange for
  cut documents), then SiLU;
- g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b), q and k L2-normalised (eps 1e-6, q
  scaled by d_k^-0.5, key heads repeated to the value heads), then `cp_gated_delta` (states
  passed only for cut documents);
- the gated RMSNorm (weight * norm(o), times silu(z)), then out_proj.

Gating, normalisation and the recurrence compute in at least float32 (transformers and fla do, for
bf16 models) and in float64 for a float64 model, which the exactness tests need. The step's dispatch
arrives as a `LinearStep` in `attention_masks` (Qwen3.5's block hands a linear layer
`attention_masks["deltanet"]`). Not yet: tensor parallelism (heads split), DTensor inputs, compile,
and a GPU kernel (`flashcp.attention.linear_cp`). Checked against transformers' layer per document
at CP 1 and 2 (`tests/titan/test_gdn_layer.py`).

    layer_config = flashcp_deltanet(titan_deltanet_config)     # TorchTitan's GatedDeltaNet.Config
    y = layer(x, LinearStep(build_linear_dispatch(plan, rank, conv_width), group))
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from flashcp.attention.linear_cp import cp_causal_conv1d, cp_gated_delta
from flashcp.attention.linear_dispatch import LinearDispatch
from flashcp.titan.compat import import_qwen3_5

GatedDeltaNet = import_qwen3_5().GatedDeltaNet

_L2_EPS = 1e-6  # transformers' l2norm and fla's use_qk_l2norm_in_kernel


@dataclass(frozen=True)
class LinearStep:
    """What every Gated DeltaNet layer needs for one window: this rank's linear dispatch (built once
    per step, `build_linear_dispatch(plan, rank, conv_width)`) and the CP group (None at CP 1)."""

    dispatch: LinearDispatch
    group: dist.ProcessGroup | None


class FlashCPGatedDeltaNet(GatedDeltaNet):
    """TorchTitan's Gated DeltaNet over the CP window through FlashCP's state and halo exchanges."""

    @dataclass(kw_only=True, slots=True)
    class Config(GatedDeltaNet.Config):
        chunk_size: int = 64
        """Tokens per chunk of the chunked gated delta kernel (`flashcp.attention.gated_delta`)."""

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.chunk_size = config.chunk_size

    def forward(self, x_BLD: torch.Tensor, attention_masks: LinearStep) -> torch.Tensor:
        if not isinstance(attention_masks, LinearStep):
            raise TypeError(f"FlashCP's Gated DeltaNet needs a LinearStep as attention_masks, "
                            f"got {type(attention_masks).__name__}")  # fmt: skip
        if x_BLD.shape[0] != 1:
            raise ValueError(f"FlashCP's Gated DeltaNet takes one window per step (batch 1), "
                             f"got {x_BLD.shape[0]}")  # fmt: skip
        d, group = attention_masks.dispatch, attention_masks.group
        width = self.conv_kernel_size
        if d.conv_index.shape[1] != width:
            raise ValueError(f"the LinearStep's dispatch has conv width {d.conv_index.shape[1]}, the layer "
                             f"{width}: build it with conv_width={width}")  # fmt: skip
        x = x_BLD[0]
        tokens, dtype = x.shape[0], torch.promote_types(x.dtype, torch.float32)
        projections = (self.in_proj_q(x), self.in_proj_k(x), self.in_proj_v(x))
        weight = torch.cat([conv.weight for conv in (self.conv_q, self.conv_k, self.conv_v)])[:, 0]
        mixed = F.silu(cp_causal_conv1d(torch.cat(projections, -1), weight, d, group))
        q, k, v = mixed.split([p.shape[-1] for p in projections], -1)
        q = q.reshape(tokens, -1, self.key_head_dim).to(dtype)
        k = k.reshape(tokens, -1, self.key_head_dim).to(dtype)
        v = v.reshape(tokens, -1, self.value_head_dim)
        if q.shape[1] != v.shape[1]:  # grouped value heads: each key head serves consecutive value heads
            q, k = (t.repeat_interleave(v.shape[1] // t.shape[1], dim=1) for t in (q, k))
        q = _l2norm(q) * self.key_head_dim**-0.5
        a = self.in_proj_a(x).to(dtype)
        g = -self.A_log.to(dtype).exp() * F.softplus(a + self.dt_bias.to(dtype))
        beta = torch.sigmoid(self.in_proj_b(x))
        o = cp_gated_delta(q, _l2norm(k), v, g, beta, d, group, chunk_size=self.chunk_size).to(x.dtype)
        z = self.in_proj_z(x).reshape(o.shape)
        return self.out_proj(self._gated_norm(o, z).reshape(1, tokens, -1))

    def _gated_norm(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """transformers' `Qwen3_5RMSNormGated` (normalise in at least float32, weight in o's dtype,
        then the SiLU gate) with this module's `norm` parameters."""
        dtype = torch.promote_types(o.dtype, torch.float32)
        h = o.to(dtype)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.norm.eps)
        h = self.norm.weight * h.to(o.dtype)
        return (h * F.silu(z.to(dtype))).to(o.dtype)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + _L2_EPS)


def flashcp_deltanet(config: GatedDeltaNet.Config, chunk_size: int = 64) -> FlashCPGatedDeltaNet.Config:
    """`config` (TorchTitan's `_qwen35_deltanet_config`) as FlashCP's layer, every field kept."""
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    return FlashCPGatedDeltaNet.Config(**fields, chunk_size=chunk_size)
