"""Qwen3.5's text config.json (`Qwen3_5ForCausalLM`, model_type qwen3_5_text; `Qwen3_5MoeForCausalLM`,
qwen3_5_moe_text) in both directions.

    arch = architecture(hf, value, rope, norm_eps, where)  # called by flashcp.titan.hf.config.architecture_from_hf
    config = hf_config(arch, torch_dtype, base)             # what an export writes (flashcp.titan.hf.config.to_hf_config)

Qwen3.5 differs from the other families by its layer kinds (HF layer_types: Gated DeltaNet
"linear_attention" layers and every interval-th one "full_attention", as TorchTitan's builder lays
them out), the linear layers' own head counts and conv width, and RoPE on part of each head
(partial_rotary_factor). The MoE text decoder routes every layer's feed-forward through
num_experts_per_tok of num_experts (softmax, the chosen scores renormalised) beside one shared expert
scaled by a sigmoid gate (`Experts.gated_shared_dim`); it has no dense width. Qwen3-Next
(`flashcp.titan.hf.qwen3_next`) reads its config through `architecture` too. Pure Python, as
`flashcp.titan.hf.config`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from flashcp.titan.hf.architecture import Architecture, Experts, HFConfigError, Hybrid, LINEAR_ATTENTION
from flashcp.titan.models.rope import Rope

MOE_TYPES = ("qwen3_5_moe_text", "qwen3_next")  # the model types whose every layer routes through experts
PARTIAL_ROTARY = 0.25  # transformers' partial_rotary_factor where a config.json gives none (all three kinds)
MIXERS = {"linear_attn": LINEAR_ATTENTION, "self_attn": "full_attention"}  # a layer's HF module -> its layer type
_MIXER = re.compile(r"model\.layers\.(\d+)\.(linear_attn|self_attn)\.")


def architecture(hf: dict[str, Any], value: Callable[..., Any], rope: Rope, norm_eps: float, where: str) -> Architecture:
    """A Qwen3.5 text config.json: its layer kinds as TorchTitan's builder lays them out (every
    interval-th layer full, the rest Gated DeltaNet) and default RoPE on part of each head; with
    experts (`MOE_TYPES`) its routed and gated shared experts."""
    n_layers, head_dim = value("num_hidden_layers", int), value("head_dim", int)
    model_type = hf["model_type"]
    experts = moe_experts(hf, value, where) if model_type in MOE_TYPES else None
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
    key_heads, value_heads = value("linear_num_key_heads", int), value("linear_num_value_heads", int)
    if value_heads % key_heads:
        raise HFConfigError(f"{where}: linear_num_value_heads = {value_heads} is not a multiple of "
                            f"linear_num_key_heads = {key_heads} (each key head serves a group of value heads)")
    params = hf.get("rope_parameters") or {}
    factor = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", PARTIAL_ROTARY))
    if not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise HFConfigError(f"{where}: partial_rotary_factor must be in (0, 1], got {factor!r}")
    return Architecture(
        name="qwen3_5", dim=value("hidden_size", int), n_layers=n_layers, n_heads=value("num_attention_heads", int),
        n_kv_heads=value("num_key_value_heads", int), head_dim=head_dim, vocab_size=value("vocab_size", int),
        # The MoE text decoder has no dense width: its active experts' (HF's Qwen3-MoE configs' convention).
        hidden_dim=experts.hidden_dim * experts.top_k if model_type == "qwen3_5_moe_text" else value(
            "intermediate_size", int), norm_eps=norm_eps, experts=experts,
        rope=rope, tie_embeddings=value("tie_word_embeddings", bool, False),
        max_position_embeddings=value("max_position_embeddings", int, 8192), layer_types=tuple(kinds),
        hybrid=Hybrid(
            key_heads=key_heads, value_heads=value_heads,
            key_head_dim=value("linear_key_head_dim", int), value_head_dim=value("linear_value_head_dim", int),
            conv_width=value("linear_conv_kernel_dim", int), rotary_dim=int(head_dim * factor),
            mrope_section=tuple(params.get("mrope_section", ())), model_type=model_type,
        ),
    )  # fmt: skip


def moe_experts(hf: dict[str, Any], value: Callable[..., Any], where: str) -> Experts:
    """The routed experts and the gated shared one of a qwen3_5_moe_text / qwen3_next config.json
    (transformers renormalises the chosen scores always in the first, as norm_topk_prob says in the second)."""
    experts = Experts(
        num_experts=value("num_experts", int), top_k=value("num_experts_per_tok", int),
        hidden_dim=value("moe_intermediate_size", int), gated_shared_dim=value("shared_expert_intermediate_size", int),
        route_norm=hf["model_type"] == "qwen3_5_moe_text" or hf.get("norm_topk_prob", True) is True,
    )  # fmt: skip
    if experts.top_k > experts.num_experts:
        raise HFConfigError(f"{where}: num_experts_per_tok = {experts.top_k} exceeds num_experts = {experts.num_experts}")
    return experts


HF_CLASSES = {"qwen3_5_text": "Qwen3_5ForCausalLM", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
              "qwen3_next": "Qwen3NextForCausalLM"}  # fmt: skip


def hf_config(arch: Architecture, torch_dtype: str, base: dict[str, Any] | None) -> dict[str, Any]:
    """The text config.json of `arch`'s model type (transformers 5: RoPE in rope_parameters, partial over
    each head), over a base of that type's other entries; Qwen3-Next's own entries are `qwen3_next`'s."""
    hybrid = arch.hybrid
    model_type = hybrid.model_type
    same = base is not None and base.get("model_type") == model_type
    out = {k: v for k, v in base.items() if k not in ("transformers_version", "quantization_config")} if same else {}
    rope = {"rope_type": "default", "rope_theta": arch.rope.theta, "partial_rotary_factor": hybrid.rotary_dim / arch.head_dim}
    if hybrid.mrope_section:
        rope["mrope_section"] = list(hybrid.mrope_section)
    experts = {} if arch.experts is None else {
        "num_experts": arch.experts.num_experts, "num_experts_per_tok": arch.experts.top_k,
        "moe_intermediate_size": arch.experts.hidden_dim,
        "shared_expert_intermediate_size": arch.experts.gated_shared_dim, "output_router_logits": False,
    }  # fmt: skip
    dense = {} if model_type == "qwen3_5_moe_text" else {"intermediate_size": arch.hidden_dim}
    return out | experts | dense | {
        "architectures": [HF_CLASSES[model_type]], "model_type": model_type, "hidden_size": arch.dim,
        "num_hidden_layers": arch.n_layers, "num_attention_heads": arch.n_heads, "num_key_value_heads": arch.n_kv_heads,
        "head_dim": arch.head_dim, "vocab_size": arch.vocab_size,
        "rms_norm_eps": arch.norm_eps, "tie_word_embeddings": arch.tie_embeddings,
        "max_position_embeddings": arch.max_position_embeddings, "hidden_act": "silu", "attention_bias": False,
        "layer_types": list(arch.layer_types), "linear_num_key_heads": hybrid.key_heads,
        "linear_num_value_heads": hybrid.value_heads, "linear_key_head_dim": hybrid.key_head_dim,
        "linear_value_head_dim": hybrid.value_head_dim, "linear_conv_kernel_dim": hybrid.conv_width,
        "rope_parameters": rope, "torch_dtype": torch_dtype, "dtype": torch_dtype,
    }  # fmt: skip


def layer_kind_problem(folder: Path, stored: Iterable[str], expected: Iterable[str]) -> str | None:
    """The line refusing `folder` when a layer's weights (`stored` names) are another kind's than the
    model's (`expected` names: config.json's layer_types), naming the first such layer; None otherwise.
    Any family's folder passes through here; only a hybrid model's layers differ in kind."""
    def kinds(names: Iterable[str]) -> dict[int, set[str]]:
        found: dict[int, set[str]] = {}
        for name in names:
            if match := _MIXER.match(name):
                found.setdefault(int(match[1]), set()).add(match[2])
        return found

    have, want = kinds(stored), kinds(expected)
    for layer in sorted(set(have) & set(want)):
        if have[layer] != want[layer]:
            held, needed = sorted(have[layer] - want[layer] or have[layer]), sorted(want[layer])
            return (f"{folder}: layer {layer} holds {' and '.join(held)} weights, but config.json's layer_types makes "
                    f"it {' / '.join(MIXERS[n] for n in needed)} ({' / '.join(needed)}): the folder's weights and its "
                    "config disagree")  # fmt: skip
    return None
