"""FlashCP's `Architecture` <-> TorchTitan's Llama 3 / Qwen3 / DeepSeek-V3 / gpt-oss model configs, built with TorchTitan's own code.

    arch = job_architecture(cfg["model"], tokenizer_vocab, seq_len)  # named flavor, custom or HF config.json
    model_config = titan_config(arch, attn_backend="flex", max_seq_len=seq_len)
    adapter = state_dict_adapter(model_config, hf_assets_path)       # HF <-> TorchTitan (flashcp.titan.hf.adapters)

Every model is built through one path: a named flavor's config from TorchTitan's registry is read
back into an `Architecture` (`flashcp.titan.models.registry`), then every architecture is built with TorchTitan's
per-layer builders and initialisers (`_build_llama3_layers`, `_build_qwen3_layers`, ...), so named
flavors, custom sizes and HF config.json models differ only in their numbers. Each family keeps its
RoPE convention: Llama 3 rotates adjacent pairs (ComplexRoPE; its adapter permutes HF's q / k
weights), Qwen3 rotates halves (CosSinRoPE) after its per-head QK-norm, gpt-oss rotates halves.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torchtitan.models import deepseek_v3 as titan_deepseek_v3
from torchtitan.models import gpt_oss as titan_gpt_oss
from torchtitan.models import llama3 as titan_llama3
from torchtitan.models import qwen3 as titan_qwen3
from torchtitan.models.common import (
    ComplexRoPE,
    compute_ffn_hidden_dim,
    CosSinRoPE,
    Embedding,
    Linear,
    RMSNorm,
)
from torchtitan.models.common.decoder import Decoder
from torchtitan.models.deepseek_v3 import DeepSeekV3Model
from torchtitan.models.gpt_oss import GptOssModel
from torchtitan.models.llama3 import Llama3Model
from torchtitan.models.qwen3 import Qwen3Model
from torchtitan.protocols.state_dict_adapter import BaseStateDictAdapter

from flashcp.titan.config import ConfigError, custom_experts, TOKENIZER_SIZED_FLAVORS
from flashcp.titan.hf.adapters import ADAPTERS
from flashcp.titan.hf.config import Architecture, HFConfigError, read_hf_config, with_rope
from flashcp.titan.models.experts import use_param_dtype_experts
from flashcp.titan.models.gated_deltanet import qwen3_5_decoder
from flashcp.titan.models.registry import family, flavor_architecture, TITAN_SCALING
from flashcp.titan.models.rope import FAMILY_ROPE, rope_for_job, RopeError
from flashcp.titan.models.rotary import ScaledCosSinRoPE

# The RMSNorm eps of each family's flavors, which a custom size takes with the family's RoPE.
_NORM_EPS = {"llama3": 1e-5, "qwen3": 1e-6}


def titan_rope(arch: Architecture, max_seq_len: int):
    """TorchTitan's RoPE config for `arch`: CosSinRoPE for Qwen3 and gpt-oss (with llama3 scaling FlashCP's
    `ScaledCosSinRoPE`), else ComplexRoPE (DeepSeek-V3: over each head's qk_rope_head_dim RoPE columns)."""
    rope = arch.rope
    if arch.name in ("qwen3", "gpt_oss"):
        cls = ScaledCosSinRoPE if rope.scaling == "llama3" else CosSinRoPE
    else:
        cls = ComplexRoPE
    scaling: dict[str, Any] = {"scaling": TITAN_SCALING[rope.scaling]}
    if rope.scaling == "llama3":
        scaling |= {
            "scaling_factor": rope.factor, "low_freq_factor": rope.low_freq_factor,
            "high_freq_factor": rope.high_freq_factor,
            "original_max_position_embeddings": rope.original_max_position_embeddings,
        }  # fmt: skip
    elif rope.scaling == "yarn":
        scaling |= {
            "rope_factor": rope.factor, "beta_fast": rope.beta_fast, "beta_slow": rope.beta_slow,
            "original_seq_len": rope.original_max_position_embeddings, "truncate": rope.truncate,
        }  # fmt: skip
    dim = arch.latent.qk_rope_head_dim if arch.latent else arch.head_dim
    return cls.Config(dim=dim, max_seq_len=max_seq_len, theta=rope.theta, **scaling)


def titan_config(arch: Architecture, attn_backend: str, max_seq_len: int) -> Decoder.Config:
    """TorchTitan's model config for `arch`, its RoPE cache covering positions < max_seq_len.

    YaRN's attention factor is not in it (TorchTitan's RoPE is a pure rotation): FlashCP's attention
    applies it (`rope.attention_scale_factor`, see flashcp.titan.models.spec). Qwen3.5 (`arch.hybrid`)
    is built with FlashCP's Gated DeltaNet and attention whatever `attn_backend` (fla's kernels and
    TorchTitan's CP do not run here; the job check refuses other attentions)."""
    if arch.hybrid:
        return qwen3_5_decoder(arch, max_seq_len)
    rope = titan_rope(arch, max_seq_len)
    tied, dim, vocab = arch.tie_embeddings, arch.dim, arch.vocab_size
    if arch.name == "llama3":
        lib, cls, head_init = titan_llama3, Llama3Model.Config, titan_llama3._output_linear_init(dim)
        layers = titan_llama3._build_llama3_layers(
            n_layers=arch.n_layers, dim=dim, n_heads=arch.n_heads, hidden_dim=arch.hidden_dim, rope=rope,
            # None for MHA, as TorchTitan's flavors
            n_kv_heads=None if arch.n_kv_heads == arch.n_heads else arch.n_kv_heads,
            attn_backend=attn_backend, fuse_qkv=True,
        )  # fmt: skip
    elif arch.latent:
        lib, cls, head_init = titan_deepseek_v3, DeepSeekV3Model.Config, titan_deepseek_v3._output_linear_init(dim)
        layers = _deepseek_v3_layers(arch, rope, attn_backend)
    elif arch.name == "gpt_oss":
        lib, cls, head_init = titan_gpt_oss, GptOssModel.Config, titan_gpt_oss._output_linear_init(dim)
        layers = _gpt_oss_layers(arch, rope, attn_backend)
    elif arch.experts:
        lib, cls, head_init = titan_qwen3, Qwen3Model.Config, titan_qwen3._LINEAR_INIT
        layers = titan_qwen3._build_qwen3_moe_layers(
            n_layers=arch.n_layers, dim=dim, n_heads=arch.n_heads, n_kv_heads=arch.n_kv_heads,
            head_dim=arch.head_dim, moe_hidden_dim=arch.experts.hidden_dim, num_experts=arch.experts.num_experts,
            top_k=arch.experts.top_k, rope=rope, attn_backend=attn_backend, moe_comm_backend="standard",
            fuse_qkv=True,
        )  # fmt: skip
        for layer in layers:  # TorchTitan's flavors renormalise the top-k scores; a config.json may not
            layer.moe.router.route_norm = arch.experts.route_norm
        use_param_dtype_experts(layers)
    else:
        lib, cls, head_init = titan_qwen3, Qwen3Model.Config, titan_qwen3._LINEAR_INIT
        layers = titan_qwen3._build_qwen3_layers(
            n_layers=arch.n_layers, dim=dim, n_heads=arch.n_heads, n_kv_heads=arch.n_kv_heads,
            head_dim=arch.head_dim, hidden_dim=arch.hidden_dim, rope=rope, attn_backend=attn_backend,
            fuse_qkv=True,
        )  # fmt: skip
    model = cls(
        dim=dim,
        vocab_size=vocab,
        enable_weight_tying=tied,
        # A tied embedding is the output projection's weight, initialised there (TorchTitan's flavors).
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab,
            embedding_dim=dim,
            param_init=titan_llama3._EMBEDDING_SKIP_INIT if tied else lib._EMBEDDING_INIT,
        ),
        norm=RMSNorm.Config(normalized_shape=dim, eps=arch.norm_eps, param_init=lib._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=head_init),
        layers=layers,
    )
    for layer in model.layers:  # TorchTitan's builders fix each family's eps; a config.json may differ
        for norm in (layer.attention_norm, layer.ffn_norm, getattr(layer.attention, "qk_norm", None)):
            if norm is not None:
                norm.eps = arch.norm_eps
        if arch.latent:
            layer.attention.q_norm.eps = layer.attention.kv_norm.eps = arch.latent.norm_eps
    return model


def _deepseek_v3_layers(arch: Architecture, rope, attn_backend: str) -> list:
    """DeepSeek-V3's layers by TorchTitan's builder: MLA everywhere, the first `n_dense_layers` with a
    dense feed-forward, the rest routed and shared experts (computed in the weights' dtype)."""
    latent, experts = arch.latent, arch.experts
    layers = titan_deepseek_v3._build_dsv3_layers(
        n_layers=arch.n_layers, n_dense_layers=arch.n_dense_layers, dim=arch.dim, n_heads=arch.n_heads,
        q_lora_rank=latent.q_lora_rank, kv_lora_rank=latent.kv_lora_rank, qk_nope_head_dim=latent.qk_nope_head_dim,
        qk_rope_head_dim=latent.qk_rope_head_dim, v_head_dim=latent.v_head_dim, mscale=latent.mscale,
        dense_hidden_dim=arch.hidden_dim, moe_hidden_dim=experts.hidden_dim, num_experts=experts.num_experts,
        num_shared_experts=experts.shared, router_top_k=experts.top_k, router_score_func=experts.score_func,
        router_num_expert_groups=experts.groups, router_num_limited_groups=experts.limited_groups,
        router_route_scale=experts.route_scale, router_route_norm=experts.route_norm, attn_backend=attn_backend,
        moe_comm_backend="standard", non_blocking_capacity_factor=None, rope=rope,
    )  # fmt: skip
    for layer in layers:
        if layer.moe is not None and not experts.shared:  # the builder always adds them
            layer.moe.shared_experts = None
    use_param_dtype_experts(layers)
    return layers


def _gpt_oss_layers(arch: Architecture, rope, attn_backend: str) -> list:
    """gpt-oss's layers by TorchTitan's builder (router, biased experts, its load-balancing coefficient),
    each attention rebuilt by its per-layer builder with the heads and the window of `arch`, which
    the layer builder fixes (64 heads of 64, 8 KV heads, 128 keys in even layers)."""
    experts = arch.experts
    layers = titan_gpt_oss._build_gptoss_layers(
        dim=arch.dim, n_layers=arch.n_layers, hidden_dim=experts.hidden_dim, num_experts=experts.num_experts,
        top_k=experts.top_k, load_balance_coeff=1e-3, attn_backend=attn_backend, fuse_qkv=True,
        moe_comm_backend="standard", rope=rope,
    )  # fmt: skip
    for layer_id, layer in enumerate(layers):
        layer.attention = titan_gpt_oss._make_gptoss_attn_config(
            dim=arch.dim, layer_id=layer_id, attn_backend=attn_backend, n_heads=arch.n_heads,
            n_kv_heads=arch.n_kv_heads, head_dim=arch.head_dim, sliding_window_size=arch.window(layer_id),
            fuse_qkv=True, rope=rope,
        )  # fmt: skip
        layer.moe.routed_experts.inner_experts.swiglu_limit = experts.swiglu_limit
    use_param_dtype_experts(layers)
    return layers


def job_architecture(model_cfg: dict[str, Any], tokenizer_vocab: int, seq_len: int) -> Architecture:
    """The job's model: `[model] hf_config` (a config.json), a named flavor or a custom size, with the
    job's RoPE keys applied and trained at `seq_len`. ConfigError names what cannot be built."""
    name, flavor = model_cfg["name"], model_cfg["flavor"]
    try:
        if model_cfg.get("hf_config"):
            arch = read_hf_config(model_cfg["hf_config"])
        elif flavor == "custom":
            arch = _custom(model_cfg, tokenizer_vocab)
        else:
            arch = flavor_architecture(name, flavor)
            if flavor in TOKENIZER_SIZED_FLAVORS:
                arch = dataclasses.replace(arch, vocab_size=tokenizer_vocab)
        rope = rope_for_job(arch.rope, model_cfg)
        if arch.latent and rope.scaling == "yarn":  # MLA's RoPE is a pure rotation (its correction: Latent.mscale)
            rope = dataclasses.replace(rope, attention_factor=1.0)
    except (HFConfigError, RopeError) as e:
        raise ConfigError(f"[model] {e}") from e
    return with_rope(arch, rope, seq_len)


def _custom(model_cfg: dict[str, Any], tokenizer_vocab: int) -> Architecture:
    """A size given by its dims, built like the family's flavors."""
    name, dim, n_heads = model_cfg["name"], model_cfg["dim"], model_cfg["n_heads"]
    hidden = compute_ffn_hidden_dim(
        dim, multiple_of=model_cfg["multiple_of"] or 256, ffn_dim_multiplier=model_cfg["ffn_dim_multiplier"]
    )
    return Architecture(
        name=name,
        dim=dim,
        n_layers=model_cfg["n_layers"],
        n_heads=n_heads,
        n_kv_heads=model_cfg["n_kv_heads"] or n_heads,
        head_dim=model_cfg.get("head_dim") or dim // n_heads,
        hidden_dim=hidden,
        vocab_size=model_cfg["vocab_size"] or tokenizer_vocab,
        norm_eps=_NORM_EPS[name],
        rope=FAMILY_ROPE[name],
        tie_embeddings=False,
        experts=custom_experts(model_cfg),
    )


def state_dict_adapter(
    model_config: Decoder.Config, hf_assets_path: str | None = None
) -> BaseStateDictAdapter:
    """The model's HF adapter (`flashcp.titan.hf.adapters`): `from_hf(hf_state) -> titan_state`, `to_hf(titan_state)`.

    `hf_assets_path` (a folder with model.safetensors.index.json) only sets how `to_hf` shards an
    HF save; None writes one file."""
    return ADAPTERS[family(model_config)](model_config, hf_assets_path)
