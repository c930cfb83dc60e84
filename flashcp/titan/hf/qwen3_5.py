"""Qwen3.5's text config.json (`Qwen3_5ForCausalLM`, model_type qwen3_5_text) in both directions.

    arch = architecture(hf, value, rope, norm_eps, where)  # called by flashcp.titan.hf.config.architecture_from_hf
    config = hf_config(arch, torch_dtype, base)             # what an export writes (flashcp.titan.hf.config.to_hf_config)

Qwen3.5 differs from the other families by its layer kinds (HF layer_types: Gated DeltaNet
"linear_attention" layers and every interval-th one "full_attention", as TorchTitan's builder lays
them out), the linear layers' own head counts and conv width, and RoPE on part of each head
(partial_rotary_factor). Pure Python, as `flashcp.titan.hf.config`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flashcp.titan.hf.architecture import Architecture, HFConfigError, Hybrid, LINEAR_ATTENTION
from flashcp.titan.models.rope import Rope


def architecture(hf: dict[str, Any], value: Callable[..., Any], rope: Rope, norm_eps: float, where: str) -> Architecture:
    """A Qwen3.5 text config.json: its layer kinds as TorchTitan's builder lays them out (every
    interval-th layer full, the rest Gated DeltaNet) and default RoPE on part of each head."""
    n_layers, head_dim = value("num_hidden_layers", int), value("head_dim", int)
    kinds = hf.get("layer_types")
    if not isinstance(kinds, list) or len(kinds) != n_layers or set(kinds) - {LINEAR_ATTENTION, "full_attention"}:
        raise HFConfigError(f"{where}: layer_types must name 'linear_attention' or 'full_attention' for each of "
                            f"the {n_layers} layers")  # fmt: skip
    interval = kinds.index("full_attention") + 1 if "full_attention" in kinds else n_layers + 1
    if [(i + 1) % interval == 0 for i in range(n_layers)] != [k == "full_attention" for k in kinds]:
        raise HFConfigError(f"{where}: layer_types {kinds}: TorchTitan's builder makes layer i full exactly "
                            f"where (i + 1) % {interval} == 0")  # fmt: skip
    if rope.scaling != "none":
        raise HFConfigError(f"{where}: rope type {rope.scaling!r}: FlashCP builds Qwen3.5's default RoPE only")
    params = hf.get("rope_parameters") or {}
    factor = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise HFConfigError(f"{where}: partial_rotary_factor must be in (0, 1], got {factor!r}")
    return Architecture(
        name="qwen3_5", dim=value("hidden_size", int), n_layers=n_layers, n_heads=value("num_attention_heads", int),
        n_kv_heads=value("num_key_value_heads", int), head_dim=head_dim, hidden_dim=value("intermediate_size", int),
        vocab_size=value("vocab_size", int), norm_eps=norm_eps,
        rope=rope, tie_embeddings=value("tie_word_embeddings", bool, False),
        max_position_embeddings=value("max_position_embeddings", int, 8192), layer_types=tuple(kinds),
        hybrid=Hybrid(
            key_heads=value("linear_num_key_heads", int), value_heads=value("linear_num_value_heads", int),
            key_head_dim=value("linear_key_head_dim", int), value_head_dim=value("linear_value_head_dim", int),
            conv_width=value("linear_conv_kernel_dim", int), rotary_dim=int(head_dim * factor),
            mrope_section=tuple(params.get("mrope_section", ())),
        ),
    )  # fmt: skip


def hf_config(arch: Architecture, torch_dtype: str, base: dict[str, Any] | None) -> dict[str, Any]:
    """Qwen3_5ForCausalLM's text config.json (transformers 5: RoPE in rope_parameters, partial over each
    head), over a qwen3_5_text base's other entries."""
    hybrid = arch.hybrid
    same = base is not None and base.get("model_type") == "qwen3_5_text"
    out = {k: v for k, v in base.items() if k not in ("transformers_version", "quantization_config")} if same else {}
    rope = {"rope_type": "default", "rope_theta": arch.rope.theta, "partial_rotary_factor": hybrid.rotary_dim / arch.head_dim}
    if hybrid.mrope_section:
        rope["mrope_section"] = list(hybrid.mrope_section)
    return out | {
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "hidden_size": arch.dim,
        "num_hidden_layers": arch.n_layers, "num_attention_heads": arch.n_heads, "num_key_value_heads": arch.n_kv_heads,
        "head_dim": arch.head_dim, "intermediate_size": arch.hidden_dim, "vocab_size": arch.vocab_size,
        "rms_norm_eps": arch.norm_eps, "tie_word_embeddings": arch.tie_embeddings,
        "max_position_embeddings": arch.max_position_embeddings, "hidden_act": "silu", "attention_bias": False,
        "layer_types": list(arch.layer_types), "linear_num_key_heads": hybrid.key_heads,
        "linear_num_value_heads": hybrid.value_heads, "linear_key_head_dim": hybrid.key_head_dim,
        "linear_value_head_dim": hybrid.value_head_dim, "linear_conv_kernel_dim": hybrid.conv_width,
        "rope_parameters": rope, "torch_dtype": torch_dtype, "dtype": torch_dtype,
    }  # fmt: skip
