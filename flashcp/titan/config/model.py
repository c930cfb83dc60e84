"""`[model]`: which architecture a job trains, its keys and the checks that need no process.

The architecture is named once: a flavor TorchTitan registers for the family (dense or Qwen3-MoE) (read from its
registry, `flashcp.titan.models.registry`), `custom` sizes, or a Hugging Face `config.json` (`hf_config`,
read now); RoPE keys (`flashcp.titan.models.rope`) override the model's own. `model_dims` and
`model_head_dim` give the layout checks and the pre-launch estimates the sizes without building it,
`model_experts` the experts of a mixture-of-experts model (None for a dense one), `model_latent`
DeepSeek-V3's latent attention (None for the others).
"""

from __future__ import annotations

from flashcp.titan.config.keys import ConfigError, Key
from flashcp.titan.hf.config import Architecture, Experts, HFConfigError, Latent, read_hf_config
from flashcp.titan.models.registry import (
    dense_flavors, flavor_architecture, HF_ONLY_FAMILIES, REFUSED_FAMILIES, REGISTRIES, refusal,
)  # fmt: skip
from flashcp.titan.models.rope import attention_scale_factor, FAMILY_ROPE, rope_for_job, RopeError, SCALINGS

CUSTOM_MODEL_KEYS = (
    "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size", "ffn_dim_multiplier", "multiple_of",
    "num_experts", "num_experts_per_tok", "moe_hidden_dim",
)  # fmt: skip
EXPERT_KEYS = ("num_experts", "num_experts_per_tok", "moe_hidden_dim")  # a custom Qwen3-MoE: all three
# A debug model has no vocabulary of its own: it takes the tokenizer's, so that the defaults
# (debugmodel, 2048 in TorchTitan, and the shipped 4,096-token tokenizer) train together.
TOKENIZER_SIZED_FLAVORS = ("debugmodel",)

MODEL_KEYS: dict[str, Key] = {
    "name": Key(str, "llama3", (*REGISTRIES, *HF_ONLY_FAMILIES, *REFUSED_FAMILIES),
                "the model family (TorchTitan's registry)"),
    "flavor": Key(str, "debugmodel", doc="a flavor TorchTitan registers for the family (Qwen3-MoE's included), "
                  "or custom"),
    "hf_config": Key(str, doc="a Hugging Face model folder (or its config.json) giving the architecture "
                     "instead of flavor; default with [checkpoint] initial_load_in_hf: initial_load_path"),
    "attention": Key(
        str, "flashcp", ("flashcp", "flex", "varlen"),
        "flashcp: FlashCP's op (CP through [flashcp]); flex / varlen: TorchTitan's own "
        "attention, with TorchTitan's built-in CP for flex",
    ),
    "converters": Key(list[str], [], doc="TorchTitan's low-precision linears, applied to the model config before "
                      "TP, compile and FSDP: float8 ([float8]) | mx ([mx]); needs torchao and a recent GPU"),
    # flavor = "custom" only; vocab_size defaults to the tokenizer's.
    "dim": Key(int),
    "n_layers": Key(int),
    "n_heads": Key(int),
    "n_kv_heads": Key(int),
    "head_dim": Key(int, doc="qwen3 only; default dim / n_heads"),
    "vocab_size": Key(int),
    "ffn_dim_multiplier": Key(float),
    "multiple_of": Key(int),
    "num_experts": Key(int, doc="qwen3 only: routed experts per layer (a Qwen3-MoE model, with the next two)"),
    "num_experts_per_tok": Key(int, doc="qwen3 MoE: experts each token is routed to (top-k)"),
    "moe_hidden_dim": Key(int, doc="qwen3 MoE: one expert's feed-forward width"),
    # RoPE (flashcp.titan.models.rope); unset: the model's own (flavor, config.json; custom: the family's).
    "rope_theta": Key(float, doc="RoPE base"),
    "rope_scaling": Key(str, None, SCALINGS, "RoPE scaling type; unset keeps the model's"),
    "rope_factor": Key(float, doc="llama3 / yarn: context extension factor"),
    "rope_original_max_position_embeddings": Key(int, doc="llama3 / yarn: the context before scaling"),
    "rope_low_freq_factor": Key(float, doc="llama3 (HF default 1)"),
    "rope_high_freq_factor": Key(float, doc="llama3 (HF default 4)"),
    "rope_beta_fast": Key(float, doc="yarn (HF default 32)"),
    "rope_beta_slow": Key(float, doc="yarn (HF default 1)"),
    "rope_attention_factor": Key(float, doc="yarn: logits scale factor (squared); default 0.1 ln(factor) + 1"),
}


def check_model(cfg: dict) -> None:
    """The architecture named once (flavor of the family, or an HF config.json read now) and its RoPE.

    With [checkpoint] initial_load_in_hf and no flavor given, the architecture is the loaded folder's:
    `hf_config` is set to initial_load_path and `flavor` to "hf"."""
    model = cfg["model"]
    _check_architecture(cfg)
    custom = [k for k in CUSTOM_MODEL_KEYS if model[k] is not None]
    if model["flavor"] == "custom":
        missing = [k for k in ("dim", "n_layers", "n_heads") if model[k] is None]
        if missing:
            raise ConfigError(f"[model] flavor = 'custom' needs {', '.join(missing)}")
        given = [k for k in EXPERT_KEYS if model[k] is not None]
        if given and (len(given) < len(EXPERT_KEYS) or model["name"] != "qwen3"):
            raise ConfigError(f"[model] {', '.join(EXPERT_KEYS)} together make a custom Qwen3-MoE (name = 'qwen3'); "
                              f"got {', '.join(given)} for name = {model['name']!r}")  # fmt: skip
        if given and model["num_experts_per_tok"] > model["num_experts"]:
            raise ConfigError(f"[model] num_experts_per_tok ({model['num_experts_per_tok']}) exceeds num_experts "
                              f"({model['num_experts']})")  # fmt: skip
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "multiple_of", *EXPERT_KEYS):
            if model[name] is not None and model[name] < 1:
                raise ConfigError(f"[model] {name} must be >= 1, got {model[name]}")
        n_kv = model["n_kv_heads"] or model["n_heads"]
        if (model["head_dim"] is None and model["dim"] % model["n_heads"]) or model["n_heads"] % n_kv:
            raise ConfigError(
                f"[model] dim ({model['dim']}) must be divisible by n_heads ({model['n_heads']}) and "
                f"n_heads by n_kv_heads ({n_kv})"
            )
    elif custom:
        raise ConfigError(
            f"[model] {', '.join(custom)} only apply to flavor = 'custom'; "
            f"flavor {model['flavor']!r} fixes them"
        )


def _check_architecture(cfg: dict) -> None:
    model, given = cfg["model"], cfg["_given"].get("model", [])
    ckpt = cfg["checkpoint"]
    if model["name"] in REFUSED_FAMILIES:
        raise ConfigError(f"[model] name = {model['name']!r} {REFUSED_FAMILIES[model['name']]}")
    if model["hf_config"] is None and ckpt.get("initial_load_in_hf") and "flavor" not in given:
        model["hf_config"] = ckpt["initial_load_path"]
    if model["hf_config"] is not None:
        if "flavor" in given:
            raise ConfigError("[model] flavor and hf_config both name the architecture; give one of them")
        arch = _hf_architecture(model["hf_config"])
        if "name" in given and model["name"] != arch.name:
            raise ConfigError(f"[model] name = {model['name']!r} but {model['hf_config']} holds a {arch.name} model")
        model["name"], model["flavor"], base = arch.name, "hf", arch.rope
    elif model["name"] in HF_ONLY_FAMILIES:
        raise ConfigError(f"[model] name = {model['name']!r} {HF_ONLY_FAMILIES[model['name']]}")
    else:
        name, flavor, flavors = model["name"], model["flavor"], dense_flavors(model["name"])
        if reason := refusal(name, flavor):
            raise ConfigError(f"[model] flavor {flavor!r} of {name} {reason} ({', '.join(flavors)}, custom)")
        if flavor not in (*flavors, "custom"):
            raise ConfigError(f"[model] flavor must be one of {', '.join((*flavors, 'custom'))} for "
                              f"name = {name!r}; got {flavor!r}")  # fmt: skip
        if flavor == "custom" and name in ("deepseek_v3", "gpt_oss"):
            raise ConfigError(f"[model] flavor = 'custom' builds llama3 and qwen3 sizes; a {name} of another size "
                              "is an hf_config (a config.json)")  # fmt: skip
        base = FAMILY_ROPE[name]
    if model["name"] == "deepseek_v3" and model["rope_attention_factor"] is not None:
        raise ConfigError("[model] rope_attention_factor does not apply to MLA (deepseek_v3): its RoPE is a pure "
                          "rotation, YaRN's correction the softmax scale's mscale (config.json "
                          "rope_scaling.mscale_all_dim)")  # fmt: skip
    try:
        rope = rope_for_job(base, model)
    except RopeError as e:
        raise ConfigError(f"[model] {e}") from e
    if attention_scale_factor(model["name"], rope) != 1.0 and model["attention"] != "flashcp":
        raise ConfigError(
            f"[model] yarn RoPE's attention factor ({rope.yarn_attention_factor:.4g}) is applied by FlashCP's "
            f"attention; model.attention = {model['attention']!r} would drop it: use 'flashcp'"
        )
    if model["head_dim"] is not None and model["name"] != "qwen3":
        raise ConfigError("[model] head_dim applies to name = 'qwen3' only; Llama 3's is dim / n_heads")


def _hf_architecture(path: str) -> Architecture:
    try:
        return read_hf_config(path)
    except HFConfigError as e:
        raise ConfigError(f"[model] hf_config: {e}") from e


def model_dims(cfg: dict) -> tuple[int, int, int, int, int | None]:
    """(dim, n_layers, n_heads, n_kv_heads, vocab_size or None = the tokenizer's) of the job's model."""
    model = cfg["model"]
    if model["flavor"] == "custom":
        n_kv = model["n_kv_heads"] or model["n_heads"]
        return model["dim"], model["n_layers"], model["n_heads"], n_kv, model["vocab_size"]
    arch = _architecture(model)
    vocab = None if model["flavor"] in TOKENIZER_SIZED_FLAVORS else arch.vocab_size
    return arch.dim, arch.n_layers, arch.n_heads, arch.n_kv_heads, vocab


def model_head_dim(cfg: dict) -> int:
    """The job's attention head size (Qwen3's is not always dim / n_heads; MLA's: its qk head, nope + rope)."""
    model = cfg["model"]
    if model["flavor"] == "custom":
        return model["head_dim"] or model["dim"] // model["n_heads"]
    return _architecture(model).head_dim


def model_experts(cfg: dict) -> Experts | None:
    """The experts of the job's model when it is a mixture of experts, else None."""
    model = cfg["model"]
    if model["flavor"] == "custom":
        return custom_experts(model)
    return _architecture(model).experts


def model_latent(cfg: dict) -> Latent | None:
    """The job's multi-head latent attention (DeepSeek-V3), or None for Llama 3 / Qwen3 attention."""
    model = cfg["model"]
    return None if model["flavor"] == "custom" else _architecture(model).latent


def custom_experts(model: dict) -> Experts | None:
    """A custom size's experts: its three expert keys (checked together), or None for a dense model."""
    if model["num_experts"] is None:
        return None
    return Experts(num_experts=model["num_experts"], top_k=model["num_experts_per_tok"],
                   hidden_dim=model["moe_hidden_dim"])  # fmt: skip


def _architecture(model: dict) -> Architecture:
    """A checked `[model]`'s architecture: its config.json's or its flavor's."""
    if model["hf_config"] is not None:
        return _hf_architecture(model["hf_config"])
    return flavor_architecture(model["name"], model["flavor"])
