"""TorchTitan's model registries read as FlashCP's architectures: which flavors a job may name, their sizes.

    dense_flavors("qwen3")                  # ("debugmodel", "0.6B", ..., "30B-A3B"), as TorchTitan registers them
    flavor_architecture("llama3", "8B")     # its Architecture: dims, heads, KV heads, head_dim, RoPE, ...
    refusal("qwen3", "debugmodel_non_fused_qkv")  # why FlashCP does not train a registered flavor, else None

The job-file checks (`flashcp.titan.config.model`) and the model builder (`decoders`) both read the
flavors here, from TorchTitan's own configs (`llama3_configs`, `qwen3_configs`), so a flavor
TorchTitan adds or changes needs no edit in FlashCP. A flavor is trained when FlashCP's one build
path (`decoders.titan_config`: fused QKV, a dense feed-forward or Qwen3-MoE's routed experts in every
layer; DeepSeek-V3's MLA with its dense first layers and shared experts; gpt-oss's sliding-window and
full layers with sinks and biased experts) rebuilds it; a Llama 3 /
Qwen3 flavor that keeps Q, K and V apart, mixes dense and expert layers or adds shared experts is
refused, recognised from its config, not its name. Families FlashCP does not train at all are
`REFUSED_FAMILIES`, each with its reason. (`dense_flavors` is the historical name:
the trained flavors, Qwen3-MoE's included.)
Building every flavor's config takes milliseconds (dataclasses, no weights).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from torchtitan.models.common import FusedQKVLinear
from torchtitan.models.common.decoder import Decoder
from torchtitan.models.deepseek_v3 import deepseekv3_configs, DeepSeekV3Model
from torchtitan.models.gpt_oss import GptOssModel, gptoss_configs
from torchtitan.models.llama3 import llama3_configs, Llama3Model
from torchtitan.models.qwen3 import Qwen3Model, qwen3_configs

from flashcp.titan.hf.config import Architecture, Experts, Latent
from flashcp.titan.models.rope import Rope

REGISTRIES: dict[str, dict[str, Callable[..., Decoder.Config]]] = {
    "llama3": llama3_configs,
    "qwen3": qwen3_configs,
    "deepseek_v3": deepseekv3_configs,
    "gpt_oss": gptoss_configs,
}
# Families TorchTitan registers that FlashCP does not train, and why.
REFUSED_FAMILIES = {
    "kimi_k2_7": "is a vision-language model (TorchTitan's KimiK25Model: a vision encoder before an MLA decoder); "
                 "FlashCP trains text decoders only (Kimi K2's text model is a deepseek_v3 hf_config)",
}  # fmt: skip
# Families FlashCP builds from an `[model] hf_config` only (TorchTitan's registered flavors are not text decoders).
HF_ONLY_FAMILIES = {
    "qwen3_5": "is built from an hf_config only (a Qwen3.5 text config.json): TorchTitan registers its "
               "vision-language flavors",
}  # fmt: skip
# FlashCP's name of each RoPE scaling -> TorchTitan's.
TITAN_SCALING = {"none": "none", "llama3": "llama", "yarn": "yarn"}


def family(model_config: Decoder.Config) -> str:
    """The family of a TorchTitan model config: "llama3", "qwen3", "deepseek_v3", "gpt_oss" or "qwen3_5"
    (a plain Decoder with Gated DeltaNet layers, `flashcp.titan.models.gated_deltanet`)."""
    if any(getattr(layer, "delta_net", None) is not None for layer in model_config.layers):
        return "qwen3_5"
    if isinstance(model_config, DeepSeekV3Model.Config):
        return "deepseek_v3"
    if isinstance(model_config, GptOssModel.Config):
        return "gpt_oss"
    if isinstance(model_config, Qwen3Model.Config):
        return "qwen3"
    if isinstance(model_config, Llama3Model.Config):
        return "llama3"
    raise TypeError(f"not a Llama 3, Qwen3, DeepSeek-V3 or gpt-oss config: {type(model_config).__name__}")


def architecture_of(model_config: Decoder.Config) -> Architecture:
    """The architecture of a TorchTitan Llama 3 / Qwen3 / DeepSeek-V3 / gpt-oss config (e.g. a registry flavor)."""
    attention = model_config.first_attention
    windows = [getattr(layer.attention, "sliding_window_size", None) for layer in model_config.layers]
    if len(set(windows) - {None}) > 1:
        raise ValueError(f"sliding windows of {sorted(set(windows) - {None})} keys: FlashCP's layers share one")
    rope = attention.rope
    moe = next((layer.moe for layer in model_config.layers if layer.moe is not None), None)
    dense = next((layer.feed_forward for layer in model_config.layers if layer.feed_forward is not None), None)
    scaling = {titan: ours for ours, titan in TITAN_SCALING.items()}[rope.scaling]
    if scaling == "llama3":
        ours = Rope(
            theta=float(rope.theta), scaling=scaling, factor=rope.scaling_factor,
            original_max_position_embeddings=rope.original_max_position_embeddings,
            low_freq_factor=rope.low_freq_factor, high_freq_factor=rope.high_freq_factor,
        )  # fmt: skip
    elif scaling == "yarn":
        ours = Rope(
            theta=float(rope.theta), scaling=scaling, factor=rope.rope_factor,
            original_max_position_embeddings=rope.original_seq_len, beta_fast=rope.beta_fast,
            beta_slow=rope.beta_slow, truncate=rope.truncate,
            # MLA's RoPE is a pure rotation: its YaRN correction is in the softmax scale (`Latent.mscale`).
            attention_factor=1.0 if isinstance(model_config, DeepSeekV3Model.Config) else None,
        )  # fmt: skip
    else:
        ours = Rope(theta=float(rope.theta))
    latent = getattr(attention, "kv_lora_rank", None) and Latent(
        kv_lora_rank=attention.kv_lora_rank, q_lora_rank=attention.q_lora_rank,
        qk_nope_head_dim=attention.qk_nope_head_dim, qk_rope_head_dim=attention.qk_rope_head_dim,
        v_head_dim=attention.v_head_dim, mscale=attention.mscale, norm_eps=attention.kv_norm.eps,
    )  # fmt: skip
    return Architecture(
        name=family(model_config),
        dim=model_config.dim,
        n_layers=len(model_config.layers),
        n_heads=attention.n_heads,
        n_kv_heads=attention.n_heads if latent else attention.n_kv_heads or attention.n_heads,
        head_dim=(latent.qk_nope_head_dim + latent.qk_rope_head_dim if latent
                  else attention.head_dim or model_config.dim // attention.n_heads),  # fmt: skip
        # An MoE model's dense width is unused; HF's Qwen3-MoE configs give the active experts' (768 x 8 in 30B-A3B).
        hidden_dim=(dense.w1.out_features if dense else moe.routed_experts.inner_experts.hidden_dim
                    * (1 if isinstance(model_config, GptOssModel.Config) else moe.router.top_k)),  # fmt: skip
        vocab_size=model_config.vocab_size,
        norm_eps=model_config.norm.eps,
        rope=ours,
        tie_embeddings=model_config.enable_weight_tying,
        max_position_embeddings=rope.max_seq_len,
        experts=moe and Experts(
            num_experts=moe.num_experts, top_k=moe.router.top_k,
            hidden_dim=moe.routed_experts.inner_experts.hidden_dim, route_norm=moe.router.route_norm,
            shared=(moe.shared_experts.w1.out_features // moe.routed_experts.inner_experts.hidden_dim
                    if moe.shared_experts else 0),
            score_func=moe.router.score_func, route_scale=moe.router.route_scale,
            groups=moe.router.num_expert_groups, limited_groups=moe.router.num_limited_groups,
            swiglu_limit=getattr(moe.routed_experts.inner_experts, "swiglu_limit", None),
        ),  # fmt: skip
        latent=latent or None,
        n_dense_layers=sum(layer.moe is None for layer in model_config.layers) if moe else 0,
        layer_types=tuple("sliding_attention" if w else "full_attention" for w in windows) if any(windows) else (),
        sliding_window=next((w for w in windows if w), None),
    )


def registered_config(name: str, flavor: str) -> Decoder.Config:
    """TorchTitan's own config of a registered flavor (FlexAttention; DeepSeek-V3's and gpt-oss's MoE
    without TorchTitan's all-to-all backends, whose expert parallelism FlashCP sets up as Qwen3-MoE's)."""
    extra = {"moe_comm_backend": "standard"} if name in ("deepseek_v3", "gpt_oss") else {}
    return REGISTRIES[name][flavor](attn_backend="flex", **extra)


def dense_flavors(name: str) -> tuple[str, ...]:
    """The flavors of family `name` FlashCP trains, in TorchTitan's order."""
    return tuple(_read(name)[0])


def flavor_architecture(name: str, flavor: str) -> Architecture:
    """The architecture of a flavor in `dense_flavors(name)` (KeyError for any other)."""
    return _read(name)[0][flavor]


def refusal(name: str, flavor: str) -> str | None:
    """Why FlashCP does not train the registered `flavor` of `name` (a phrase); None: trained or unknown."""
    return _read(name)[1].get(flavor)


@functools.cache
def _read(name: str) -> tuple[dict[str, Architecture], dict[str, str]]:
    """(each trained flavor's architecture, each refused flavor's reason), read once per family."""
    trained, refused = {}, {}
    for flavor in REGISTRIES[name]:
        config = registered_config(name, flavor)
        layers = config.layers
        moe = [layer.moe is not None for layer in layers]
        if isinstance(config, DeepSeekV3Model.Config):
            trained[flavor] = architecture_of(config)  # MLA, dense first layers, shared experts: all built
        elif any(moe) and not all(moe):
            refused[flavor] = "mixes dense and mixture-of-experts layers: FlashCP builds one kind for all layers"
        elif any(layer.moe.shared_experts is not None for layer in layers if layer.moe is not None):
            refused[flavor] = "has shared experts: FlashCP builds routed experts only (Qwen3-MoE)"
        elif not all(isinstance(layer.attention.qkv_linear, FusedQKVLinear.Config) for layer in layers):
            refused[flavor] = "keeps Q, K and V as separate projections: FlashCP builds them fused only"
        else:
            trained[flavor] = architecture_of(config)
    return trained, refused
