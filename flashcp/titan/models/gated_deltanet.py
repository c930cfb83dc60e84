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
`qwen3_5_decoder` builds the whole text decoder from its `Architecture` (`[model] hf_config`, read
by `flashcp.titan.hf.config`; `qwen3_5_text_config` from a parsed config.json): TorchTitan's Qwen3.5
blocks (its gated full attention with partial RoPE keeps its own MRoPE, FlashCP's attention inside)
in a plain TorchTitan `Decoder`, without Qwen3.5's vision encoder. The MoE text decoder (Qwen3.5-MoE,
Qwen3-Next: `Architecture.experts`) takes TorchTitan's Qwen3.5 MoE blocks (softmax router, grouped
experts in the weights' dtype, a sigmoid-gated shared expert); with expert parallelism its experts are
split over the "ep" mesh as FlashCP's Qwen3-MoE's (`shard_experts`, from `update_from_config`; tokens
are routed one by one, so CP needs nothing more of the MoE layer). The trainer builds each window's
`HybridDispatches` where it builds a dispatch (the loader's thread or plan worker) and hands the
blocks `hybrid_masks`.

    model = qwen3_5_text_config(config_json, max_seq_len).build()
    masks, positions = hybrid_step(plan, rank, group)            # once per step
    logits = model(tokens[masks["deltanet"].dispatch.token_index][None], positions, masks)

Checked against transformers per document: the layer at CP 1 and 2 (`tests/titan/test_gdn_layer.py`),
the decoder at CP 1, 2 and 4 (`tests/titan/test_gdn_oracle.py`, every strategy and exchange); in the trainer CP 2
and 4 train CP 1's losses (`tests/titan/test_hybrid_train.py`); the MoE decoders at CP 1, 2 and 4
with EP 1 and 2 (`tests/titan/test_gdn_moe_oracle.py`). The linear layers run flash-linear-attention's
kernel on CUDA and the torch reference elsewhere (`flashcp.attention.gdn_kernels`, "auto"). Not yet:
tensor parallelism (heads split), DTensor inputs, compile, pipeline parallelism. HF weights: text-only
folders in and out, Qwen3-Next's too (`flashcp.titan.hf.adapters`). The metrics and the balance count
the linear layers' FLOPs per token (`HybridDecoder`) and what cut documents add (`Workload.linear`), the
full layers' per attended pair (`flashcp.titan.models.windows.planner_workload`).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torchtitan.models import llama3 as titan_llama3
from torchtitan.models.common import Embedding, Linear
from torchtitan.models.common.decoder import Decoder
from torchtitan.models.common.moe_sharding import set_moe_sharding_config
from torchtitan.models.utils import get_moe_model_nparams_and_flops

from flashcp.attention.linear_cp import cp_causal_conv1d, cp_gated_delta
from flashcp.attention.linear_dispatch import LinearDispatch
from flashcp.dispatch import build_dispatch
from flashcp.plan.plan import Plan
from flashcp.titan.compat import import_qwen3_5
from flashcp.titan.hf.config import Architecture, architecture_from_hf
from flashcp.titan.models.attention import CPStep, FlashCPAttention
from flashcp.titan.models.experts import use_param_dtype_experts
from flashcp.titan.models.windows import build_hybrid_dispatches, HybridDispatches

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



def deltanet_flops_per_token(config: Decoder.Config) -> int:
    """FLOPs per token of the Gated DeltaNet layers' recurrence, forward + backward: per value head three
    products with its d_k x d_v state (read by k, written, read by q; the recurrent form's count, as
    TorchTitan counts attention without its kernels' recomputation), 2 FLOPs a multiply-add, x3 with
    backward. Linear in the tokens: it belongs to the per-token count, not to the attended pairs."""
    return sum(18 * layer.delta_net.key_head_dim * layer.delta_net.in_proj_v.out_features
               for layer in config.layers if layer.delta_net is not None)  # fmt: skip


class HybridDecoder(Decoder):
    """TorchTitan's plain Decoder counted as its Qwen3.5 model counts (`Qwen35Model`, whose vision
    encoder is not built here), plus the Gated DeltaNet recurrence that count leaves out."""

    @dataclass(kw_only=True, slots=True)
    class Config(Decoder.Config):
        hf_layout: str = "qwen3_5_text"
        """The HF model_type whose folders its weights map to and from (`Hybrid.model_type`; the adapter
        fuses Qwen3-Next's projections, `flashcp.titan.hf.adapters`)."""

        def update_from_config(self, *, config, **kwargs) -> None:
            """TorchTitan's, then the experts' layout: over the "ep" mesh with expert parallelism."""
            Decoder.Config.update_from_config(self, config=config, **kwargs)
            shard_experts(self, enable_ep=config.parallelism.expert_parallel_degree > 1)

        def get_nparams_and_flops(self, model: torch.nn.Module, seq_len: int) -> tuple[int, int]:
            """Per token: 6 x the non-embedding parameters (a Gated DeltaNet layer's projections, convolution
            and gates among them), the full-attention layers' QK^T and PV over seq_len keys (TorchTitan's
            count skips layers without attention), and the Gated DeltaNet layers' recurrence."""
            attention = self.first_attention
            head_dims = 2 * attention.head_dim
            nparams, flops = get_moe_model_nparams_and_flops(self, model, attention.n_heads, head_dims, seq_len)
            return nparams, flops + deltanet_flops_per_token(self)


def shard_experts(config: Decoder.Config, enable_ep: bool) -> None:
    """The MoE layers' sharding as TorchTitan's Qwen3.5 sets it (`set_qwen35_sharding_config`'s MoE part,
    without sequence parallelism: no TP here): with `enable_ep` the experts split over the "ep" mesh,
    tokens sent to them by TorchTitan's all-to-all, as FlashCP's Qwen3-MoE; `model.parallelize` applies it."""
    for layer in config.layers:
        if layer.moe is not None:
            set_moe_sharding_config(layer.moe, enable_ep=enable_ep, enable_sp=False,
                                    expert_param_layout=qwen3_5.sharding._GROUPED_EXPERTS_PARAM_LAYOUT)  # fmt: skip


def qwen3_5_text_config(hf: dict, max_seq_len: int, backend: str = "auto", chunk_size: int = 64
                        ) -> Decoder.Config:  # fmt: skip
    """The decoder of a parsed Qwen3.5 text config.json (`Qwen3_5TextConfig`), read as the trainer
    reads `[model] hf_config`; HFConfigError names what it does not build."""
    return qwen3_5_decoder(architecture_from_hf(hf), max_seq_len, backend, chunk_size)


def qwen3_5_decoder(arch: Architecture, max_seq_len: int, backend: str = "auto", chunk_size: int = 64
                    ) -> Decoder.Config:  # fmt: skip
    """The decoder of a qwen3_5 `arch` by TorchTitan's builder (`_build_qwen35_layers`: OffsetRMSNorm,
    gated full attention with partial RoPE, SwiGLU; with experts `_build_qwen35_moe_layers`: a softmax
    router, routed experts computed in the weights' dtype and a sigmoid-gated shared expert), its
    Gated DeltaNet layers FlashCP's and its full attention's inner attention `FlashCPAttention` (q and
    k arrive rotated by the layer's MRoPE, given the step's in-document positions)."""
    hybrid, dim, eps, experts = arch.hybrid, arch.dim, arch.norm_eps, arch.experts
    kinds = arch.layer_types
    interval = kinds.index("full_attention") + 1 if "full_attention" in kinds else arch.n_layers + 1
    sections = {"mrope_section": list(hybrid.mrope_section)} if hybrid.mrope_section else {}
    linear = {"n_key_heads": hybrid.key_heads, "n_value_heads": hybrid.value_heads,
              "key_head_dim": hybrid.key_head_dim, "value_head_dim": hybrid.value_head_dim}
    common = dict(
        n_layers=arch.n_layers, dim=dim, n_heads=arch.n_heads, n_kv_heads=arch.n_kv_heads,
        head_dim=arch.head_dim, rotary_dim=hybrid.rotary_dim, **linear,
        rope=qwen3_5.MRoPE.Config(dim=hybrid.rotary_dim, max_seq_len=max_seq_len, theta=arch.rope.theta,
                                  **sections),
        full_attention_interval=interval, attn_backend="flex",
    )  # fmt: skip
    if experts is None:
        layers = qwen3_5._build_qwen35_layers(hidden_dim=arch.hidden_dim, **common)
    else:
        layers = qwen3_5._build_qwen35_moe_layers(
            moe_hidden_dim=experts.hidden_dim, num_experts=experts.num_experts, top_k=experts.top_k,
            shared_expert_hidden_dim=experts.gated_shared_dim, moe_comm_backend="standard", **common)  # fmt: skip
        for layer in layers:  # TorchTitan's flavors renormalise the top-k scores; Qwen3-Next's config may not
            layer.moe.router.route_norm = experts.route_norm
        use_param_dtype_experts(layers)
    for layer_id, layer in enumerate(layers):
        layer.attention_norm.eps = layer.ffn_norm.eps = eps
        if layer.delta_net is not None:
            titan = qwen3_5._qwen35_deltanet_config(
                dim=dim, layer_id=layer_id, conv_kernel_size=hybrid.conv_width, **linear)
            layer.delta_net = flashcp_deltanet(titan, chunk_size)
            layer.delta_net.norm.eps = eps
        else:
            layer.attention.q_norm.eps = layer.attention.k_norm.eps = eps
            layer.attention.inner_attention = FlashCPAttention.Config(backend=backend)
    vocab = arch.vocab_size
    return HybridDecoder.Config(
        dim=dim, vocab_size=vocab, layers=layers, enable_weight_tying=arch.tie_embeddings, hf_layout=hybrid.model_type,
        # TorchTitan's Qwen3.5 initialisers; a tied embedding is the output projection's weight, initialised there.
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=(
            titan_llama3._EMBEDDING_SKIP_INIT if arch.tie_embeddings else qwen3_5._EMBEDDING_INIT)),
        norm=qwen3_5.OffsetRMSNorm.Config(dim=dim, eps=eps, param_init=qwen3_5._OFFSET_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=qwen3_5._output_linear_init(dim)),
    )  # fmt: skip


def hybrid_masks(dispatches: HybridDispatches, group: dist.ProcessGroup | None,
                 ropes: dict[tuple, Any] | None = None) -> dict[str, CPStep | LinearStep]:  # fmt: skip
    """One window's `attention_masks` for a qwen3_5 model, under Qwen3.5's block keys: the full
    layers' `CPStep` (with the rows of `ropes`, `flashcp_ropes(model)`) and the linear layers' `LinearStep`."""
    return {"quadratic_attention": CPStep.of(ropes or {}, dispatches.full, group),
            "deltanet": LinearStep(dispatches.linear, group)}  # fmt: skip


def deltanet_conv_width(model: torch.nn.Module) -> int | None:
    """The convolution width of the Gated DeltaNet layers of `model` (None: it has none); one
    `LinearDispatch` serves them all, so they must share it."""
    widths = {m.conv_kernel_size for m in model.modules() if isinstance(m, FlashCPGatedDeltaNet)}
    if len(widths) > 1:
        raise ValueError(f"Gated DeltaNet layers of conv widths {sorted(widths)}: one linear dispatch serves one")
    return widths.pop() if widths else None


def hybrid_step(plan: Plan, rank: int, group: dist.ProcessGroup | None, comm: str = "compact",
                conv_width: int = 4) -> tuple[dict, torch.Tensor]:  # fmt: skip
    """One window's `attention_masks` for `qwen3_5_text_config`'s model (`hybrid_masks`) and the
    `positions [1, T]` its MRoPE reads, for this rank's rows in the two dispatches' shared order."""
    d = build_hybrid_dispatches(plan, functools.partial(build_dispatch, rank=rank, comm=comm), rank, conv_width)
    return hybrid_masks(d, group), d.positions[None]
