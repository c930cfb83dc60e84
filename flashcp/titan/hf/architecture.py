"""FlashCP's description of a decoder, the one value every consumer of a model's shape reads.

`Architecture` (with `Experts` and `Latent`) is what `flashcp.titan.hf.config` reads from and writes
to config.json, what the pre-launch checks count and what `flashcp.titan.models.decoders` builds;
its own module so that the families' config.json readers (`config`, `gpt_oss`) share it without
importing each other. Pure Python: the launcher reads it before any rank starts.
"""

from __future__ import annotations

from dataclasses import dataclass

from flashcp.titan.models.rope import Rope

LAYER_TYPES = ("sliding_attention", "full_attention")  # HF layer_types
LINEAR_ATTENTION = "linear_attention"  # HF layer_types: a Qwen3.5 Gated DeltaNet layer


class HFConfigError(ValueError):
    """A config.json FlashCP cannot train; the message names the file and the entry."""


@dataclass(frozen=True)
class Experts:
    """The feed-forward as routed experts: Qwen3-MoE's (softmax router, no shared expert, every layer)
    by default; DeepSeek-V3's add shared experts, a sigmoid router with group-limited choice and a
    scale on the routed output."""

    num_experts: int
    top_k: int  # experts per token (HF num_experts_per_tok)
    hidden_dim: int  # one expert's width (HF moe_intermediate_size)
    route_norm: bool = True  # the top-k scores renormalised to sum to 1 (HF norm_topk_prob)
    shared: int = 0  # shared experts, each hidden_dim wide, run on every token (HF n_shared_experts)
    score_func: str = "softmax"  # softmax | sigmoid
    route_scale: float = 1.0  # multiplies the top-k scores (HF routed_scaling_factor)
    groups: int | None = None  # expert groups, of which each token picks `limited_groups` (HF n_group)
    limited_groups: int | None = None  # HF topk_group
    swiglu_limit: float | None = None
    """gpt-oss's experts: biased projections and a SwiGLU whose gate and up inputs are clamped to this
    (HF swiglu_limit; gain 1.702); None: an unbiased SiLU-gated feed-forward (Qwen3-MoE, DeepSeek-V3)."""
    gated_shared_dim: int = 0
    """Qwen3.5-MoE / Qwen3-Next: one shared expert this wide (HF shared_expert_intermediate_size) whose
    output a per-token sigmoid gate scales; 0: none (DeepSeek-V3's ungated ones are `shared`)."""


@dataclass(frozen=True)
class Latent:
    """Multi-head latent attention (DeepSeek-V2/V3): K and V up-projected per head from one normalised
    latent row (kv_lora_rank) per token, plus one RoPE key shared by all heads (qk_rope_head_dim)."""

    kv_lora_rank: int
    q_lora_rank: int  # 0: q projected directly from the hidden state (HF q_lora_rank null)
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    mscale: float = 1.0  # YaRN's softmax-scale correction, squared in the scale (HF rope_scaling.mscale_all_dim)
    norm_eps: float = 1e-6  # RMSNorm eps of the latent (and q's) norm: transformers' fixed 1e-6


@dataclass(frozen=True)
class Hybrid:
    """Qwen3.5's (and Qwen3-Next's) hybrid text decoder: Gated DeltaNet layers (HF linear_*) between gated full-attention
    ones that rotate `rotary_dim` of each head's columns (HF partial_rotary_factor x head_dim) by MRoPE,
    which on text (one position per token) is plain RoPE whatever its sections."""

    key_heads: int  # HF linear_num_key_heads
    value_heads: int  # HF linear_num_value_heads
    key_head_dim: int
    value_head_dim: int
    conv_width: int  # the causal convolution's taps (HF linear_conv_kernel_dim)
    rotary_dim: int
    mrope_section: tuple[int, ...] = ()  # (): TorchTitan's default
    model_type: str = "qwen3_5_text"
    """The HF layout its folders use: qwen3_5_text, qwen3_5_moe_text (experts), or qwen3_next (experts;
    q, k, v, z and b, a fused per key-head group in two projections, `flashcp.titan.hf.qwen3_next`)."""


@dataclass(frozen=True)
class Architecture:
    """A decoder: everything that fixes its parameters' shapes and its forward pass."""

    name: str  # llama3 | qwen3 (RMSNorm on q and k per head before RoPE) | deepseek_v3 (latent) | gpt_oss | qwen3_5
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_dim: int  # feed-forward width (HF intermediate_size; deepseek_v3: its dense layers')
    vocab_size: int
    norm_eps: float
    rope: Rope
    tie_embeddings: bool = False
    max_position_embeddings: int = 8192  # the context the model is meant for (export writes the trained one)
    experts: Experts | None = None  # None: a dense feed-forward of hidden_dim in every layer
    latent: Latent | None = None  # deepseek_v3's attention (head_dim: qk_nope + qk_rope; n_kv_heads = n_heads)
    n_dense_layers: int = 0  # with experts: the first layers keep a dense feed-forward (HF first_k_dense_replace)
    layer_types: tuple[str, ...] = ()
    """Each layer's attention, "sliding_attention" or "full_attention" (HF layer_types); (): every layer
    full. Not empty only when some layer slides, or with `hybrid` ("linear_attention" or "full_attention")."""
    sliding_window: int | None = None  # keys a sliding layer's query sees, itself included (HF sliding_window)
    hybrid: Hybrid | None = None  # qwen3_5: its Gated DeltaNet layers and partial RoPE

    @property
    def qk_norm(self) -> bool:
        return self.name == "qwen3"

    @property
    def sinks(self) -> bool:
        """A learned sink logit per head in every softmax (gpt-oss), with biased q, k, v and o projections."""
        return self.name == "gpt_oss"

    def window(self, layer: int) -> int | None:
        """The sliding window of layer `layer`; None: full attention."""
        return self.sliding_window if self.layer_types and self.layer_types[layer] == LAYER_TYPES[0] else None
