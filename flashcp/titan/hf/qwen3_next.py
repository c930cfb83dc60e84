"""Qwen3-Next's config.json (`Qwen3NextForCausalLM`, model_type qwen3_next) in both directions.

    arch = architecture(hf, value, rope, norm_eps, where)  # called by flashcp.titan.hf.config.architecture_from_hf
    config = hf_config(arch, torch_dtype, base)             # what an export writes (flashcp.titan.hf.config.to_hf_config)

Qwen3-Next is the Qwen3.5-MoE text decoder (Gated DeltaNet layers, every interval-th layer gated full
attention with partial RoPE, routed experts and a sigmoid-gated shared expert in every layer), read
through `flashcp.titan.hf.qwen3_5.architecture`. Its config.json has keys of its own: the layer kinds
may come as `full_attention_interval` instead of layer_types, and `mlp_only_layers` /
`decoder_sparse_step` can put dense feed-forwards among the experts, which TorchTitan's Qwen3.5 MoE
builder cannot lay out: refused in one line naming the key. Its checkpoints fuse the Gated DeltaNet
projections per key-head group (`in_proj_qkvz`, `in_proj_ba`: `flashcp.titan.hf.adapters`). Pure
Python, as `flashcp.titan.hf.config`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flashcp.titan.hf import qwen3_5
from flashcp.titan.hf.architecture import Architecture, HFConfigError, LINEAR_ATTENTION
from flashcp.titan.models.rope import Rope

INTERVAL = 4  # transformers' full_attention_interval when a config.json gives neither it nor layer_types


def architecture(hf: dict[str, Any], value: Callable[..., Any], rope: Rope, norm_eps: float, where: str) -> Architecture:
    """A qwen3_next config.json: Qwen3.5-MoE's text decoder (`qwen3_5.architecture`), its layer kinds from
    layer_types or full_attention_interval, every layer's feed-forward routed."""
    n_layers = value("num_hidden_layers", int)
    dense = hf.get("mlp_only_layers") or []
    if not isinstance(dense, list) or any(isinstance(i, int) and 0 <= i < n_layers for i in dense):
        raise HFConfigError(f"{where}: mlp_only_layers = {dense!r} puts dense feed-forwards among the experts: "
                            "FlashCP builds routed experts in every layer (TorchTitan's Qwen3.5 MoE layers)")  # fmt: skip
    step = hf.get("decoder_sparse_step", 1)
    if step != 1 or isinstance(step, bool):  # transformers: layer i routed where (i + 1) % step == 0
        raise HFConfigError(f"{where}: decoder_sparse_step = {step!r} makes some layers dense: FlashCP builds "
                            "routed experts in every layer (decoder_sparse_step 1)")  # fmt: skip
    kinds = hf.get("layer_types")
    if kinds is None:
        interval = hf.get("full_attention_interval", INTERVAL)
        if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
            raise HFConfigError(f"{where}: full_attention_interval must be a positive integer, got {interval!r}")
        kinds = [LINEAR_ATTENTION if (i + 1) % interval else "full_attention" for i in range(n_layers)]
    return qwen3_5.architecture(hf | {"layer_types": kinds}, value, rope, norm_eps, where)


def hf_config(arch: Architecture, torch_dtype: str, base: dict[str, Any] | None) -> dict[str, Any]:
    """Qwen3NextForCausalLM's config.json: Qwen3.5's text entries (`qwen3_5.hf_config`) and its own."""
    return qwen3_5.hf_config(arch, torch_dtype, base) | {
        "norm_topk_prob": arch.experts.route_norm, "decoder_sparse_step": 1, "mlp_only_layers": [],
    }  # fmt: skip
