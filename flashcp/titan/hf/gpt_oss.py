"""gpt-oss's config.json (`GptOssForCausalLM`) in both directions, and its MXFP4 folders refused by name.

    arch = architecture(hf, value, rope, where)  # called by flashcp.titan.hf.config.architecture_from_hf
    entries = hf_entries(arch)                   # its own entries of the config.json an export writes
    mxfp4_problem(folder, stored_names)          # the one line that refuses an MXFP4 folder, or None

gpt-oss differs from the other families in config.json by its sliding-window layers (HF
layer_types), a sink per head, biased projections and experts, and a SwiGLU clamped at
swiglu_limit with a fixed gain. The released checkpoints (openai/gpt-oss-20b / 120b) store the
experts' matrices in MXFP4 (`*_blocks` / `*_scales`, `quantization_config.quant_method = "mxfp4"`):
FlashCP imports only unquantized folders, so such a folder is refused in one line naming
`python -m flashcp.titan.hf.dequant`, which writes the unquantized bf16 folder once.

Pure Python (json only), as `flashcp.titan.hf.config`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from flashcp.titan.hf.architecture import Architecture, Experts, HFConfigError, LAYER_TYPES
from flashcp.titan.models.rope import Rope

# transformers' defaults where a config.json leaves them out (GptOssConfig).
THETA = 150000.0
ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 4096}  # fmt: skip
SWIGLU_ALPHA = 1.702  # the SwiGLU gain, fixed in TorchTitan's experts (torchtitan.models.gpt_oss.moe.swiglu)
MXFP4_SUFFIXES = ("_blocks", "_scales")  # an MXFP4 matrix's packed FP4 pairs and its per-32 exponents
CONVERTER = "python -m flashcp.titan.hf.dequant"


def with_default_rope(hf: dict[str, Any]) -> dict[str, Any]:
    """`hf` with transformers' YaRN when it names no RoPE scaling (GptOssConfig's default)."""
    return hf if hf.get("rope_parameters") or hf.get("rope_scaling") else hf | {"rope_scaling": ROPE}


def architecture(hf: dict[str, Any], value: Callable[..., Any], rope: Rope, norm_eps: float, where: str,
                 experts_key: str) -> Architecture:  # fmt: skip
    """A gpt_oss config.json: sliding-window layers among full ones (HF layer_types, transformers'
    alternation from a sliding layer 0 when absent), a sink per head, and in every layer top-k experts
    of intermediate_size, routed by a softmax over the chosen experts' logits. `value(key, kind,
    default)` reads a positive entry (HFConfigError otherwise); `norm_eps` is rms_norm_eps, checked."""
    n_layers = value("num_hidden_layers", int)
    types = hf.get("layer_types")
    if types is None:
        types = [LAYER_TYPES[i % 2] for i in range(n_layers)]
    if not isinstance(types, list) or len(types) != n_layers or any(t not in LAYER_TYPES for t in types):
        shown = repr(types) if len(repr(types)) <= 120 else repr(types)[:117] + "..."
        raise HFConfigError(f"{where}: layer_types must name 'sliding_attention' or 'full_attention' for each of "
                            f"the {n_layers} layers (num_hidden_layers), got {shown}")  # fmt: skip
    sliding = LAYER_TYPES[0] in types
    experts = Experts(
        num_experts=value(experts_key, int), top_k=value("num_experts_per_tok", int),
        hidden_dim=value("intermediate_size", int), swiglu_limit=value("swiglu_limit", float, 7.0),
    )  # fmt: skip
    if experts.top_k > experts.num_experts:
        raise HFConfigError(f"{where}: num_experts_per_tok = {experts.top_k} exceeds num_local_experts = "
                            f"{experts.num_experts}")  # fmt: skip
    n_heads = value("num_attention_heads", int)
    return Architecture(
        name="gpt_oss", dim=value("hidden_size", int), n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=value("num_key_value_heads", int, n_heads), head_dim=value("head_dim", int, 64),
        hidden_dim=experts.hidden_dim, vocab_size=value("vocab_size", int), norm_eps=norm_eps, rope=rope,
        tie_embeddings=value("tie_word_embeddings", bool, False),
        max_position_embeddings=value("max_position_embeddings", int, 131072), experts=experts,
        layer_types=tuple(types) if sliding else (), sliding_window=value("sliding_window", int) if sliding else None,
    )  # fmt: skip


def hf_entries(arch: Architecture) -> dict[str, Any]:
    """GptOssForCausalLM's own entries of an export's config.json (its weights unquantized: no
    quantization_config)."""
    return {
        "attention_bias": True, "num_local_experts": arch.experts.num_experts,
        "num_experts_per_tok": arch.experts.top_k, "swiglu_limit": arch.experts.swiglu_limit,
        "swiglu_alpha": SWIGLU_ALPHA, "layer_types": list(arch.layer_types) or [LAYER_TYPES[1]] * arch.n_layers,
        "sliding_window": arch.sliding_window, "output_router_logits": False,
    }  # fmt: skip


def mxfp4_problem(folder: Path, stored: Iterable[str]) -> str | None:
    """The line refusing `folder` when it stores MXFP4 matrices (any tensor named `*_blocks` /
    `*_scales`, as the released gpt-oss checkpoints), naming the converter; None otherwise."""
    packed = next((name for name in stored if name.endswith(MXFP4_SUFFIXES)), None)
    if packed is None:
        return None
    return (f"{folder} stores MXFP4-quantized experts ({packed}; quantization_config mxfp4, as the released gpt-oss "
            f"checkpoints), which FlashCP does not import: write an unquantized bf16 copy once with `{CONVERTER} "
            f"{folder} <new folder>` and import that")  # fmt: skip
