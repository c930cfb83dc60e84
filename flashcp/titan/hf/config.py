"""A model's architecture as Hugging Face's config.json describes it, in both directions.

    arch = read_hf_config("path/to/hf_model")            # folder or its config.json; HFConfigError
    arch = architecture_from_hf(json_dict, where="...")  # the same from a parsed config.json
    to_hf_config(arch, torch_dtype="bfloat16", base=None) -> dict  # the config.json an export writes

`Architecture` (`flashcp.titan.hf.architecture`, importable from here too) is FlashCP's description
of a decoder (Llama 3.x: model_type "llama"; Qwen3: "qwen3", with QK-norm and its own head_dim;
Qwen3-MoE: "qwen3_moe", Qwen3 whose every feed-forward is a top-k routed mixture of experts;
DeepSeek-V3: "deepseek_v3", latent attention; gpt-oss: "gpt_oss", read and written by
`flashcp.titan.hf.gpt_oss`; Qwen3.5: "qwen3_5_text" and "qwen3_5_moe_text", hybrid Gated DeltaNet, by
`flashcp.titan.hf.qwen3_5`; Qwen3-Next: "qwen3_next", by `flashcp.titan.hf.qwen3_next`), the one value every consumer reads: the pre-launch checks
(`flashcp.titan.config.model_dims`), the TorchTitan model config
(`flashcp.titan.models.decoders.titan_config(arch, attn_backend, max_seq_len)`), the job's model
(`flashcp.titan.models.decoders.job_architecture(model_cfg, tokenizer_vocab, seq_len)`, also for named
flavors) and HF import / export (`flashcp.titan.models.decoders.state_dict_adapter(model_config,
hf_assets_path)`, the adapters of `flashcp.titan.hf.adapters`).
`to_hf_config` writes the RoPE actually trained (`rope_theta`, `rope_scaling`) and the context
(`max_position_embeddings`), starting from the base model's config.json when given so that its
other entries (token ids, ...) carry over.

Pure Python (json only): the launcher reads config.json before any rank starts.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from flashcp.titan.hf import gpt_oss, qwen3_5, qwen3_next
from flashcp.titan.hf.architecture import Architecture, Experts, HFConfigError, Latent
from flashcp.titan.hf.files import FolderFileError, load_json, read_member
from flashcp.titan.models.rope import Rope, rope_from_hf, rope_to_hf, RopeError

# HF model_type -> FlashCP / TorchTitan model name, and back with its HF class.
MODEL_TYPES = {
    "llama": "llama3", "qwen3": "qwen3", "qwen3_moe": "qwen3", "deepseek_v3": "deepseek_v3", "gpt_oss": "gpt_oss",
    "qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5", "qwen3_next": "qwen3_5",
}  # fmt: skip
HF_NAMES = {
    "llama3": ("llama", "LlamaForCausalLM"), "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "deepseek_v3": ("deepseek_v3", "DeepseekV3ForCausalLM"), "gpt_oss": ("gpt_oss", "GptOssForCausalLM"),
}  # fmt: skip
HF_MOE_NAME = ("qwen3_moe", "Qwen3MoeForCausalLM")  # a qwen3 architecture with experts
HF_DEFAULT_THETA = 10000.0  # transformers' default rope_theta for both
MAX_CONFIG_BYTES = 1 << 20


def read_hf_config(path: str | Path) -> Architecture:
    """The architecture in `path` (an HF model folder or its config.json); HFConfigError names the problem."""
    file, hf = read_hf_json(path)
    return architecture_from_hf(hf, where=str(file))


def read_hf_json(path: str | Path) -> tuple[Path, dict[str, Any]]:
    """(the file, its parsed object) of `path`, an HF model folder or its config.json: bounded in size and
    nesting (`flashcp.titan.hf.files`); HFConfigError names the problem."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise HFConfigError(f"{file}: no such file (an HF model folder holds config.json)")
    try:
        # A folder's config.json is its own file (flashcp.titan.hf.files); one named directly is the user's.
        if path.is_dir():
            data = read_member(file.parent, file.name, MAX_CONFIG_BYTES)
        else:
            with open(file, "rb") as f:
                data = f.read(MAX_CONFIG_BYTES + 1)
        if len(data) > MAX_CONFIG_BYTES:
            raise HFConfigError(
                f"{file} is larger than {MAX_CONFIG_BYTES >> 20} MiB: not a model's config.json"
            )
        hf = load_json(data, file)
    except FolderFileError as e:
        raise HFConfigError(str(e)) from e
    except OSError as e:
        raise HFConfigError(f"cannot read {file}: {e}") from e
    if not isinstance(hf, dict):
        raise HFConfigError(f"{file} must hold a JSON object, got {type(hf).__name__}")
    return file, hf


def size_keys(hf: dict[str, Any]) -> dict[str, str]:
    """The config.json key each size of its `Architecture` is read from ("experts.num_experts": the
    key of `Experts.num_experts`), to name the one a check refuses."""
    keys = {"dim": "hidden_size", "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
            "n_kv_heads": "num_key_value_heads", "head_dim": "head_dim", "hidden_dim": "intermediate_size",
            "vocab_size": "vocab_size", "experts.num_experts": _experts_key(hf),
            "experts.hidden_dim": "moe_intermediate_size", "experts.shared": "n_shared_experts"}  # fmt: skip
    if hf.get("model_type") == "deepseek_v3":
        keys |= {f"latent.{name}": name for name in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
                                                      "qk_rope_head_dim", "v_head_dim")}  # fmt: skip
    return keys


def _experts_key(hf: dict[str, Any]) -> str:
    """Where a config.json counts its routed experts: DeepSeek's n_routed_experts, Qwen3-MoE's num_experts
    (transformers 5 writes num_local_experts)."""
    if hf.get("model_type") == "deepseek_v3":
        return "n_routed_experts"
    return "num_local_experts" if "num_experts" not in hf and "num_local_experts" in hf else "num_experts"


def architecture_from_hf(hf: dict[str, Any], where: str = "config.json") -> Architecture:
    """The architecture of a parsed config.json (transformers 4.x or 5.x layout)."""
    _check_numbers(hf, where)
    model_type = hf.get("model_type")
    classes = hf.get("architectures") if isinstance(hf.get("architectures"), list) else []
    if "vision_config" in hf or any("ConditionalGeneration" in str(c) for c in classes):
        raise HFConfigError(f"{where}: a vision-language config (vision_config / *ForConditionalGeneration): FlashCP "
                            "trains text decoders only (Qwen3.5: its text config.json, model_type qwen3_5_text)")
    if model_type not in MODEL_TYPES:
        moe = " (of mixture-of-experts models, qwen3_moe, deepseek_v3, gpt_oss, qwen3_5_moe_text and qwen3_next only)" if "moe" in str(model_type) else ""
        raise HFConfigError(
            f"{where}: model_type {model_type!r} is not supported{moe}; supported: {', '.join(MODEL_TYPES)}"
        )

    def value(key: str, kind: type, default: Any = None) -> Any:
        got = hf.get(key, default)
        if got is None:
            raise HFConfigError(f"{where}: {key} is missing")
        if kind is float and isinstance(got, int) and not isinstance(got, bool):
            got = float(got)
        if (
            not isinstance(got, kind)
            or (kind is int and isinstance(got, bool))
            or (kind is not bool and got <= 0)
        ):
            raise HFConfigError(f"{where}: {key} must be a positive {kind.__name__}, got {got!r}")
        return got

    dim, n_heads = value("hidden_size", int), value("num_attention_heads", int)
    n_kv = value("num_key_value_heads", int, n_heads)
    head_dim = value("head_dim", int, dim // n_heads)
    name = MODEL_TYPES[model_type]
    unsupported = [
        f"{key} = {hf[key]!r}" for key, ok in (
            # gpt-oss's projections have biases (TorchTitan builds them), the others' none
            ("hidden_act", "silu"), ("attention_bias", name == "gpt_oss"), ("mlp_bias", False),
            ("use_sliding_window", False), ("swiglu_alpha", gpt_oss.SWIGLU_ALPHA),
        ) if key in hf and hf[key] != ok
    ]  # fmt: skip
    if name == "llama3" and head_dim != dim // n_heads:
        unsupported.append(
            f"head_dim = {head_dim} (Llama needs hidden_size / num_attention_heads = {dim // n_heads})"
        )
    if name == "deepseek_v3":
        unsupported += [f"{key} = {hf[key]!r}" for key, ok in (("rope_interleave", True), ("scoring_func", "sigmoid"))
                        if key in hf and hf[key] != ok]  # fmt: skip
        if n_kv != n_heads:
            unsupported.append(f"num_key_value_heads = {n_kv} (MLA has one key per head: num_attention_heads)")
    elif n_heads % n_kv:
        unsupported.append(f"num_attention_heads = {n_heads} not a multiple of num_key_value_heads = {n_kv}")
    if unsupported:
        raise HFConfigError(f"{where}: {'; '.join(unsupported)} is not supported")
    try:
        if name == "gpt_oss":
            rope = rope_from_hf(gpt_oss.with_default_rope(hf), gpt_oss.THETA)
        else:
            rope = rope_from_hf(hf, HF_DEFAULT_THETA)
    except (RopeError, KeyError, TypeError, ValueError) as e:
        raise HFConfigError(f"{where}: {e}") from e
    n_layers = value("num_hidden_layers", int)
    if name == "deepseek_v3":
        return _deepseek_v3(hf, value, rope, where)
    if name == "qwen3_5":
        read = qwen3_next.architecture if model_type == "qwen3_next" else qwen3_5.architecture
        return read(hf, value, rope, _norm_eps(value("rms_norm_eps", float, 1e-6), where), where)
    if name == "gpt_oss":
        return gpt_oss.architecture(hf, value, rope, _norm_eps(value("rms_norm_eps", float, 1e-5), where), where,
                                    _experts_key(hf))  # fmt: skip
    return Architecture(
        name=name,
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        hidden_dim=value("intermediate_size", int),
        vocab_size=value("vocab_size", int),
        norm_eps=_norm_eps(value("rms_norm_eps", float, 1e-6), where),
        rope=rope,
        tie_embeddings=value("tie_word_embeddings", bool, False),
        max_position_embeddings=value("max_position_embeddings", int, 8192),
        experts=_experts(hf, value, n_layers, where) if model_type == "qwen3_moe" else None,
    )


def _deepseek_v3(hf: dict[str, Any], value, rope: Rope, where: str) -> Architecture:
    """A deepseek_v3 config.json: MLA attention, `first_k_dense_replace` dense layers, then routed and
    shared experts behind a sigmoid router (DeepseekV3ForCausalLM's only one)."""
    dim, n_heads, n_layers = value("hidden_size", int), value("num_attention_heads", int), value("num_hidden_layers", int)
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.yarn_attention_factor != 1.0:
        raise HFConfigError(
            f"{where}: rope_scaling's attention factor {rope.yarn_attention_factor:.4g} (mscale "
            f"{params.get('mscale')} != mscale_all_dim {params.get('mscale_all_dim')}) would scale only the RoPE part "
            "of MLA's logits: not supported"
        )
    q_lora = hf.get("q_lora_rank")
    latent = Latent(
        kv_lora_rank=value("kv_lora_rank", int), q_lora_rank=0 if q_lora is None else value("q_lora_rank", int),
        qk_nope_head_dim=value("qk_nope_head_dim", int), qk_rope_head_dim=value("qk_rope_head_dim", int),
        v_head_dim=value("v_head_dim", int),
        mscale=float(params.get("mscale_all_dim") or 0.0) if rope.scaling == "yarn" else 0.0,
    )  # fmt: skip
    if latent.qk_rope_head_dim % 2:
        raise HFConfigError(f"{where}: qk_rope_head_dim must be even (pairs rotate), got {latent.qk_rope_head_dim}")
    dense = hf.get("first_k_dense_replace", 0)
    if not isinstance(dense, int) or isinstance(dense, bool) or not 0 <= dense <= n_layers:
        raise HFConfigError(f"{where}: first_k_dense_replace must be an integer in 0..{n_layers}, got {dense!r}")
    groups, limited = value("n_group", int, 1), value("topk_group", int, 1)
    experts = Experts(
        num_experts=value(_experts_key(hf), int), top_k=value("num_experts_per_tok", int),
        hidden_dim=value("moe_intermediate_size", int), route_norm=hf.get("norm_topk_prob", False) is True,
        shared=_shared_experts(hf, where), score_func="sigmoid",
        route_scale=value("routed_scaling_factor", float, 1.0),
        groups=None if groups == 1 else groups, limited_groups=None if groups == 1 else limited,
    )  # fmt: skip
    if experts.top_k > experts.num_experts or experts.num_experts % groups or experts.num_experts // groups < 2 \
            or limited > groups or experts.top_k > limited * (experts.num_experts // groups):
        raise HFConfigError(
            f"{where}: {experts.num_experts} experts in n_group = {groups} groups (at least 2 each), "
            f"topk_group = {limited} and num_experts_per_tok = {experts.top_k} do not fit together"
        )  # fmt: skip
    return Architecture(
        name="deepseek_v3", dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_heads,
        head_dim=latent.qk_nope_head_dim + latent.qk_rope_head_dim, hidden_dim=value("intermediate_size", int),
        vocab_size=value("vocab_size", int), norm_eps=_norm_eps(value("rms_norm_eps", float, 1e-6), where),
        rope=rope, tie_embeddings=value("tie_word_embeddings", bool, False),
        max_position_embeddings=value("max_position_embeddings", int, 8192), experts=experts, latent=latent,
        n_dense_layers=dense,
    )  # fmt: skip


def _shared_experts(hf: dict[str, Any], where: str) -> int:
    """DeepSeek's n_shared_experts: a count, 0 (or null) for none."""
    shared = hf.get("n_shared_experts") or 0
    if not isinstance(shared, int) or isinstance(shared, bool) or shared < 0:
        raise HFConfigError(f"{where}: n_shared_experts must be an integer >= 0, got {shared!r}")
    return shared


def _experts(hf: dict[str, Any], value, n_layers: int, where: str) -> Experts:
    """A qwen3_moe config.json's experts; every layer must be sparse (TorchTitan builds no mix)."""
    dense = [layer for layer in hf.get("mlp_only_layers") or [] if isinstance(layer, int) and layer < n_layers]
    if dense or hf.get("decoder_sparse_step", 1) != 1:
        raise HFConfigError(f"{where}: dense layers among the experts (mlp_only_layers = {hf.get('mlp_only_layers')}, "
                            f"decoder_sparse_step = {hf.get('decoder_sparse_step', 1)}) are not supported: "
                            "every layer must route through experts")  # fmt: skip
    if hf.get("shared_expert_intermediate_size"):
        raise HFConfigError(f"{where}: a shared expert (shared_expert_intermediate_size) is not supported")
    experts = Experts(
        num_experts=value(_experts_key(hf), int),
        top_k=value("num_experts_per_tok", int),
        hidden_dim=value("moe_intermediate_size", int),
        route_norm=hf.get("norm_topk_prob", False) is True,
    )
    if experts.top_k > experts.num_experts:
        raise HFConfigError(f"{where}: num_experts_per_tok = {experts.top_k} exceeds num_experts = {experts.num_experts}")
    return experts


def _check_numbers(hf: dict[str, Any], where: str) -> None:
    """HFConfigError naming the first number that is NaN or infinite anywhere in config.json (JSON's
    Infinity / NaN, or 1e999), and the RoPE entries that must be positive integers."""
    stack: list[tuple[str, Any]] = [(key, value) for key, value in hf.items()]
    while stack:
        key, value = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            raise HFConfigError(f"{where}: {key} = {value} is not a finite number")
        if isinstance(value, dict):
            stack += [(f"{key}.{k}", v) for k, v in value.items()]
        elif isinstance(value, list):
            stack += [(f"{key}[{i}]", v) for i, v in enumerate(value)]
    for section in ("rope_scaling", "rope_parameters"):
        got = hf.get(section)
        count = got.get("original_max_position_embeddings") if isinstance(got, dict) else None
        if count is not None and (not isinstance(count, int) or isinstance(count, bool) or count < 1):
            raise HFConfigError(f"{where}: {section}.original_max_position_embeddings must be a positive "
                                f"integer, got {count!r}")  # fmt: skip


def _norm_eps(eps: float, where: str) -> float:
    """RMSNorm's epsilon, refused from 1 on: it would swamp the mean square of unit-scale activations."""
    if eps >= 1:
        raise HFConfigError(f"{where}: rms_norm_eps must be below 1 (typically 1e-5 or 1e-6), got {eps!r}")
    return eps


def to_hf_config(
    arch: Architecture, torch_dtype: str = "bfloat16", base: dict[str, Any] | None = None
) -> dict:
    """config.json for `arch` (AutoModelForCausalLM loads it), over the base model's config.json if given."""
    if arch.hybrid:
        write = qwen3_next.hf_config if arch.hybrid.model_type == "qwen3_next" else qwen3_5.hf_config
        return write(arch, torch_dtype, base)
    model_type, hf_class = HF_MOE_NAME if arch.experts and arch.name == "qwen3" else HF_NAMES[arch.name]
    # An export's weights are unquantized whatever the base's were (gpt-oss publishes MXFP4 experts).
    dropped = ("rope_parameters", "transformers_version", "quantization_config")
    out = {k: v for k, v in (base or {}).items() if k not in dropped}
    if base is not None and base.get("model_type") != model_type:
        out = {}  # another family's entries would not load
    out |= {
        "architectures": [hf_class],
        "model_type": model_type,
        "hidden_size": arch.dim,
        "num_hidden_layers": arch.n_layers,
        "num_attention_heads": arch.n_heads,
        "num_key_value_heads": arch.n_kv_heads,
        "head_dim": arch.head_dim,
        "intermediate_size": arch.hidden_dim,
        "vocab_size": arch.vocab_size,
        "rms_norm_eps": arch.norm_eps,
        "tie_word_embeddings": arch.tie_embeddings,
        "max_position_embeddings": arch.max_position_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "torch_dtype": torch_dtype,
        "dtype": torch_dtype,  # transformers 5's name for it
        **rope_to_hf(arch.rope),
    }
    if arch.name == "deepseek_v3":
        return out | _deepseek_v3_entries(arch, out["rope_scaling"])
    if arch.name == "gpt_oss":
        return out | gpt_oss.hf_entries(arch)
    if arch.name == "llama3":
        out["mlp_bias"] = False
    else:
        out["use_sliding_window"] = False
    if arch.experts:
        out |= {
            "num_experts": arch.experts.num_experts, "num_experts_per_tok": arch.experts.top_k,
            "moe_intermediate_size": arch.experts.hidden_dim, "norm_topk_prob": arch.experts.route_norm,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "output_router_logits": False,
        }  # fmt: skip
    return out


def _deepseek_v3_entries(arch: Architecture, rope_scaling: dict[str, Any] | None) -> dict[str, Any]:
    """DeepseekV3ForCausalLM's own entries; HFConfigError for a model it cannot hold (a softmax router)."""
    latent, experts = arch.latent, arch.experts
    if experts.score_func != "sigmoid":
        raise HFConfigError(f"this deepseek_v3 model routes by {experts.score_func}; DeepseekV3ForCausalLM routes by "
                            "sigmoid only: no Hugging Face class holds it")  # fmt: skip
    if latent.norm_eps != 1e-6:
        raise HFConfigError(f"this deepseek_v3 model's latent RMSNorm eps is {latent.norm_eps:g}; DeepseekV3ForCausalLM "
                            "fixes it at 1e-06")  # fmt: skip
    out = {
        "head_dim": latent.qk_rope_head_dim,  # transformers' own value for this model type
        "kv_lora_rank": latent.kv_lora_rank, "q_lora_rank": latent.q_lora_rank or None,
        "qk_nope_head_dim": latent.qk_nope_head_dim, "qk_rope_head_dim": latent.qk_rope_head_dim,
        "v_head_dim": latent.v_head_dim, "rope_interleave": True, "first_k_dense_replace": arch.n_dense_layers,
        "n_routed_experts": experts.num_experts, "num_experts_per_tok": experts.top_k,
        "moe_intermediate_size": experts.hidden_dim, "n_shared_experts": experts.shared,
        "norm_topk_prob": experts.route_norm, "routed_scaling_factor": experts.route_scale,
        "n_group": experts.groups or 1, "topk_group": experts.limited_groups or 1,
        "num_nextn_predict_layers": 0,  # no multi-token-prediction head is trained
    }  # fmt: skip
    if arch.rope.scaling == "yarn":  # the softmax scale's correction; cos / sin unscaled (attention factor 1)
        out["rope_scaling"] = rope_scaling | {"mscale": latent.mscale, "mscale_all_dim": latent.mscale}
    return out


def with_rope(arch: Architecture, rope: Rope, context: int) -> Architecture:
    """`arch` trained with `rope` at `context` tokens: what an export's config.json says."""
    return dataclasses.replace(
        arch, rope=rope, max_position_embeddings=max(arch.max_position_embeddings, context)
    )
