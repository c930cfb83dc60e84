"""Qwen3.5's hybrid text decoder on FlashCP: Gated DeltaNet on FlashCP's linear-attention ops.

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
`attention_masks["deltanet"]`, a full one `["quadratic_attention"]`: `hybrid_step` builds both).
`qwen3_5_text_config` builds the whole text decoder from a config.json: TorchTitan's Qwen3.5 blocks
(its gated full attention with partial RoPE keeps its own MRoPE, FlashCP's attention inside) in a
plain TorchTitan `Decoder`, without Qwen3.5's vision encoder.

    model = qwen3_5_text_config(config_json, max_seq_len).build()
    masks, positions = hybrid_step(plan, rank, group)            # once per step
    logits = model(tokens[masks["deltanet"].dispatch.token_index][None], positions, masks)

Checked against transformers per document at CP 1 and 2: the layer (`tests/titan/test_gdn_layer.py`)
and the decoder (`tests/titan/test_gdn_oracle.py`). Not yet: tensor parallelism (heads split),
DTensor inputs, compile, a GPU kernel for the linear layers (`flashcp.attention.linear_cp`), the
trainer, job files and HF import.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torchtitan.models.common import Embedding, Linear
from torchtitan.models.common.decoder import Decoder

from flashcp.attention.linear_cp import cp_causal_conv1d, cp_gated_delta
from flashcp.attention.linear_dispatch import build_linear_dispatch, LinearDispatch
from flashcp.dispatch import build_dispatch
from flashcp.plan.plan import Plan
from flashcp.titan.compat import import_qwen3_5
from flashcp.titan.models.attention import CPStep, FlashCPAttention

qwen3_5 = import_qwen3_5()
GatedDeltaNet = qwen3_5.GatedDeltaNet

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



def qwen3_5_text_config(hf: dict, max_seq_len: int, backend: str = "auto", chunk_size: int = 64
                        ) -> Decoder.Config:  # fmt: skip
    """The decoder of a Qwen3.5 text config.json (`Qwen3_5TextConfig`) by TorchTitan's builder
    (`_build_qwen35_layers`: OffsetRMSNorm, gated full attention with partial RoPE, SwiGLU), its
    Gated DeltaNet layers FlashCP's and its full attention's inner attention `FlashCPAttention`
    (q and k arrive rotated by the layer's MRoPE, given the step's in-document positions).
    ValueError names what it does not build."""
    rope, kinds = hf["rope_parameters"], list(hf["layer_types"])
    interval = kinds.index("full_attention") + 1 if "full_attention" in kinds else len(kinds) + 1
    if [(i + 1) % interval == 0 for i in range(len(kinds))] != [k == "full_attention" for k in kinds]:
        raise ValueError(f"layer_types {kinds}: TorchTitan's builder makes every {interval}th layer full")
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"rope_type {rope['rope_type']!r}: FlashCP builds Qwen3.5's default RoPE only")
    dim, head_dim, eps = hf["hidden_size"], hf["head_dim"], hf["rms_norm_eps"]
    rotary_dim = int(head_dim * rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    sections = {"mrope_section": rope["mrope_section"]} if "mrope_section" in rope else {}
    linear = {"n_key_heads": hf["linear_num_key_heads"], "n_value_heads": hf["linear_num_value_heads"],
              "key_head_dim": hf["linear_key_head_dim"], "value_head_dim": hf["linear_value_head_dim"]}
    layers = qwen3_5._build_qwen35_layers(
        n_layers=len(kinds), dim=dim, n_heads=hf["num_attention_heads"], n_kv_heads=hf["num_key_value_heads"],
        head_dim=head_dim, rotary_dim=rotary_dim, hidden_dim=hf["intermediate_size"], **linear,
        rope=qwen3_5.MRoPE.Config(dim=rotary_dim, max_seq_len=max_seq_len, theta=rope["rope_theta"],
                                  **sections),
        full_attention_interval=interval, attn_backend="flex",
    )  # fmt: skip
    for layer_id, layer in enumerate(layers):
        layer.attention_norm.eps = layer.ffn_norm.eps = eps
        if layer.delta_net is not None:
            titan = qwen3_5._qwen35_deltanet_config(
                dim=dim, layer_id=layer_id, conv_kernel_size=hf["linear_conv_kernel_dim"], **linear)
            layer.delta_net = flashcp_deltanet(titan, chunk_size)
            layer.delta_net.norm.eps = eps
        else:
            layer.attention.q_norm.eps = layer.attention.k_norm.eps = eps
            layer.attention.inner_attention = FlashCPAttention.Config(backend=backend)
    vocab = hf["vocab_size"]
    return Decoder.Config(
        dim=dim, vocab_size=vocab, layers=layers, enable_weight_tying=hf.get("tie_word_embeddings", False),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim),
        norm=qwen3_5.OffsetRMSNorm.Config(dim=dim, eps=eps),
        lm_head=Linear.Config(in_features=dim, out_features=vocab),
    )  # fmt: skip


def hybrid_step(plan: Plan, rank: int, group: dist.ProcessGroup | None, comm: str = "compact",
                conv_width: int = 4) -> tuple[dict, torch.Tensor]:  # fmt: skip
    """One window's `attention_masks` for `qwen3_5_text_config`'s model (the full layers' `CPStep`,
    the linear layers' `LinearStep`, under Qwen3.5's block keys) and the `positions [1, T]` its MRoPE
    reads, for this rank's rows in the two dispatches' shared order."""
    d = build_dispatch(plan, rank, comm)
    linear = LinearStep(build_linear_dispatch(plan, rank, conv_width), group)
    return {"quadratic_attention": CPStep(d, group), "deltanet": linear}, d.positions[None]
