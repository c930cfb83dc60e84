"""Architectures from TorchTitan's flavors and from HF config.json files, RoPE keys, and the
config.json an export writes: all checked before launch with one line per mistake."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

import flashcp.titan  # noqa: F401  (TorchTitan shims first)
from flashcp.titan.config import check_layout, ConfigError, model_dims, model_head_dim, validate
from flashcp.titan.config.model import TOKENIZER_SIZED_FLAVORS
from flashcp.titan.models.decoders import job_architecture, titan_config, titan_rope
from flashcp.titan.models.experts import use_param_dtype_experts
from flashcp.titan.hf.config import architecture_from_hf, read_hf_config, to_hf_config
from flashcp.titan.models.spec import model_spec
from flashcp.titan.models.registry import architecture_of, dense_flavors, flavor_architecture, registered_config, REGISTRIES
from flashcp.titan.models.rope import FAMILY_ROPE, Rope

# The config.json files Meta and Qwen publish (transformers 4.x layout: rope_theta + rope_scaling).
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 128256,
}
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 12288,
    "max_position_embeddings": 40960,
    "max_window_layers": 36,
    "model_type": "qwen3",
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
DENSE = [(name, flavor) for name in REGISTRIES for flavor in dense_flavors(name)]


def hf_folder(tmp_path: Path, config: dict, name: str = "model") -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _shapes(config) -> object:
    """A TorchTitan config without its initialiser functions (which are new closures per build)."""
    if dataclasses.is_dataclass(config):
        return (type(config), {f.name: _shapes(getattr(config, f.name)) for f in dataclasses.fields(config)
                               if f.name != "param_init"})  # fmt: skip
    if isinstance(config, list):
        return [_shapes(c) for c in config]
    return config


@pytest.mark.parametrize("name, flavor", DENSE)
def test_every_dense_flavor_rebuilds_as_torchtitan_registers_it(name, flavor):
    """One build path: a flavor read back into an Architecture builds TorchTitan's own config (Qwen3-MoE's
    experts computed in their weights' dtype, the one swap FlashCP makes, flashcp.titan.models.experts)."""
    registered = registered_config(name, flavor)
    arch = architecture_of(registered)
    use_param_dtype_experts(registered.layers)
    # The family's RoPE, at the flavor's base (235B-A22B's is 5e6)
    assert arch.rope == dataclasses.replace(FAMILY_ROPE[name], theta=float(registered.first_attention.rope.theta))
    assert _shapes(titan_config(arch, "flex", registered.first_attention.rope.max_seq_len)) == _shapes(
        registered
    )


@pytest.mark.parametrize("name, flavor", DENSE)
def test_every_dense_flavor_is_accepted_with_torchtitans_dims(name, flavor):
    registered = registered_config(name, flavor)
    attention = registered.first_attention
    cfg = validate({"model": {"name": name, "flavor": flavor}})
    vocab = None if flavor in TOKENIZER_SIZED_FLAVORS else registered.vocab_size  # None: the tokenizer's
    if name == "deepseek_v3":  # MLA: a key per head, of the QK head's size
        n_kv, head_dim = attention.n_heads, attention.qk_nope_head_dim + attention.qk_rope_head_dim
    else:
        n_kv, head_dim = attention.n_kv_heads or attention.n_heads, attention.head_dim or registered.dim // attention.n_heads
    assert model_dims(cfg) == (registered.dim, len(registered.layers), attention.n_heads, n_kv, vocab)
    assert model_head_dim(cfg) == head_dim


def test_flavors_are_told_apart_by_their_configs():
    """Both families' dense flavors and Qwen3's MoE flavors are trained, Qwen3's head_dim is its own
    (0.6B: 128, not 1024 / 16), and every other registered flavor is refused in one line with its reason."""
    assert {("llama3", "8B"), ("llama3", "405B"), ("qwen3", "0.6B"), ("qwen3", "32B")} <= set(DENSE)
    assert {("qwen3", "debugmodel_moe"), ("qwen3", "30B-A3B"), ("qwen3", "235B-A22B")} <= set(DENSE)
    assert model_head_dim(validate({"model": {"name": "qwen3", "flavor": "0.6B"}})) == 128
    refused = [(name, flavor) for name in REGISTRIES for flavor in REGISTRIES[name]
               if (name, flavor) not in DENSE]  # fmt: skip
    assert refused == [("qwen3", "debugmodel_non_fused_qkv")]
    for name, flavor in refused:
        why = "keeps Q, K and V as separate"
        dense = ", ".join((*dense_flavors(name), "custom"))
        with pytest.raises(ConfigError) as e:
            validate({"model": {"name": name, "flavor": flavor}})
        assert str(e.value).startswith(f"[model] flavor {flavor!r} of {name} {why}"), str(e.value)
        assert str(e.value).endswith(f"({dense})") and "\n" not in str(e.value)


@pytest.mark.parametrize("hf, name, flavor", [(LLAMA31_8B, "llama3", "8B"), (QWEN3_8B, "qwen3", "8B")])
def test_published_config_json_builds_torchtitans_flavor(tmp_path, hf, name, flavor):
    """Llama 3.1 8B's and Qwen3 8B's config.json give exactly TorchTitan's 8B flavors."""
    cfg = validate({"model": {"hf_config": str(hf_folder(tmp_path, hf))}})
    assert (cfg["model"]["name"], cfg["model"]["flavor"]) == (name, "hf")
    arch = job_architecture(cfg["model"], 4096, 8192)
    registered = REGISTRIES[name][flavor](attn_backend="flex")
    assert _shapes(titan_config(arch, "flex", 8192)) == _shapes(
        titan_config(architecture_of(registered), "flex", 8192)
    )
    flavor_arch = flavor_architecture(name, flavor)
    assert model_dims(cfg) == (
        flavor_arch.dim, flavor_arch.n_layers, flavor_arch.n_heads, flavor_arch.n_kv_heads, hf["vocab_size"]
    )


def test_initial_load_in_hf_without_flavor_takes_the_folders_architecture(tmp_path):
    folder = str(hf_folder(tmp_path, QWEN3_8B))
    ckpt = {"enable": True, "initial_load_path": folder, "initial_load_in_hf": True}
    cfg = validate({"checkpoint": ckpt})
    assert (cfg["model"]["hf_config"], cfg["model"]["name"], model_head_dim(cfg)) == (folder, "qwen3", 128)
    named = validate({"checkpoint": ckpt, "model": {"flavor": "1B"}})  # an explicit flavor wins
    assert (named["model"]["hf_config"], named["model"]["flavor"]) == (None, "1B")


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "mistral"}, r"model_type 'mistral' is not supported; supported: llama, qwen3"),
        ({"model_type": "qwen2_moe"}, r"model_type 'qwen2_moe' is not supported \(of mixture-of-experts models, qwen3_moe"),
        ({"use_sliding_window": True}, r"use_sliding_window = True is not supported"),
        ({"hidden_size": None}, r"hidden_size is missing"),
        ({"num_key_value_heads": 0}, r"num_key_value_heads must be a positive int, got 0"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, r"rope type 'dynamic' is not supported"),
        ({"rope_theta": float("inf")}, r"rope_theta = inf is not a finite number"),
        ({"rms_norm_eps": float("inf")}, r"rms_norm_eps = inf is not a finite number"),
        ({"rms_norm_eps": 2.0}, r"rms_norm_eps must be below 1"),
        ({"rope_scaling": LLAMA31_8B["rope_scaling"] | {"high_freq_factor": float("nan")}},
         r"rope_scaling\.high_freq_factor = nan is not a finite number"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "beta_fast": float("inf"),
                           "original_max_position_embeddings": 32768}},
         r"rope_scaling\.beta_fast = inf is not a finite number"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1e308}},
         r"rope_scaling\.original_max_position_embeddings must be a positive integer, got 1e\+308"),
    ],
)
def test_a_config_json_flashcp_cannot_train_is_one_line(tmp_path, change, message):
    folder = hf_folder(tmp_path, QWEN3_8B | change)
    with pytest.raises(ConfigError, match=r"^\[model\] hf_config: .*config\.json: " + message):
        validate({"model": {"hf_config": str(folder)}})


def test_a_missing_or_broken_config_json_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"config\.json: no such file"):
        validate({"model": {"hf_config": str(tmp_path)}})
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"config\.json is not valid JSON"):
        validate({"model": {"hf_config": str(tmp_path)}})
    with pytest.raises(ConfigError, match=r"flavor and hf_config both name the architecture"):
        validate({"model": {"hf_config": str(tmp_path), "flavor": "8B"}})


def test_model_checks_name_the_problem():
    with pytest.raises(ConfigError, match=r"'debugmodel_non_fused_qkv' of qwen3 keeps Q, K and V as separate"):
        validate({"model": {"name": "qwen3", "flavor": "debugmodel_non_fused_qkv"}})
    for name, flavor in [("qwen3", "70B"), ("llama3", "0.6B"), ("llama3", "debugmodel_moe")]:
        registered = ", ".join((*dense_flavors(name), "custom"))
        with pytest.raises(ConfigError) as e:
            validate({"model": {"name": name, "flavor": flavor}})
        assert str(e.value) == f"[model] flavor must be one of {registered} for name = {name!r}; got {flavor!r}"
    with pytest.raises(
        ConfigError, match=r"tensor_parallel_degree \(16\) must divide n_heads \(32\) and n_kv_heads \(8\)"
    ):
        job = {"model": {"name": "qwen3", "flavor": "8B"}, "parallelism": {"tensor_parallel_degree": 16}}
        check_layout(validate(job), 16, has_cuda=True)


def test_rope_keys_keep_or_replace_the_models_scaling(tmp_path):
    folder = str(hf_folder(tmp_path, LLAMA31_8B))
    kept = job_architecture(
        validate({"model": {"hf_config": folder, "rope_theta": 4e6}})["model"], 4096, 131072
    )
    assert kept.rope == Rope(theta=4e6, scaling="llama3", factor=8.0, original_max_position_embeddings=8192)
    yarn = {
        "hf_config": folder,
        "rope_scaling": "yarn",
        "rope_factor": 16.0,
        "rope_original_max_position_embeddings": 8192,
    }
    arch = job_architecture(validate({"model": yarn})["model"], 4096, 1 << 20)
    assert (arch.rope.scaling, arch.rope.factor, arch.rope.beta_fast, arch.max_position_embeddings) == (
        "yarn", 16.0, 32.0, 1 << 20)  # fmt: skip
    for model, message in [
        ({"rope_scaling": "yarn"}, r"rope_scaling = 'yarn' needs rope_factor and rope_original_max_position"),
        ({"rope_beta_fast": 16.0}, r"rope_beta_fast does not apply to rope scaling 'llama3' \(the model's"),
        ({"rope_scaling": "none", "rope_factor": 2.0}, r"rope_factor does not apply to rope scaling 'none'"),
        ({**yarn, "attention": "flex"}, r"yarn RoPE's attention factor \(1.277\) is applied by FlashCP's"),
        ({"rope_scaling": "llama3", "rope_low_freq_factor": 5.0},
         r"llama3 scaling needs 0 < rope_low_freq_factor < rope_high_freq_factor, got 5.0 and 4.0"),
    ]:  # fmt: skip
        with pytest.raises(ConfigError, match=r"^\[model\] " + message):
            validate({"model": model})


def test_rope_cache_covers_a_million_token_context():
    cfg = validate({"model": {"name": "qwen3", "flavor": "0.6B"}, "training": {"seq_len": 1 << 20}})
    spec = model_spec(cfg["model"], cfg["flashcp"], 4096, 1 << 20)
    assert {layer.attention.rope.max_seq_len for layer in spec.model.layers} == {1 << 20}


@pytest.mark.parametrize("hf", [LLAMA31_8B, QWEN3_8B])
@pytest.mark.parametrize(
    "rope", [None, Rope(theta=1e6, scaling="yarn", factor=4.0, original_max_position_embeddings=4096)]
)
def test_exported_config_json_reads_back_through_transformers(tmp_path, hf, rope):
    """to_hf_config -> transformers' AutoConfig (its own RoPE standardisation) -> the same architecture."""
    transformers = pytest.importorskip("transformers", reason="needs the test extra (transformers)")
    arch = architecture_from_hf(hf)
    if rope is not None:
        arch = dataclasses.replace(arch, rope=rope, max_position_embeddings=16384)
    config = to_hf_config(arch, "bfloat16", base=hf)
    assert config["bos_token_id"] == hf["bos_token_id"] and config["torch_dtype"] == "bfloat16"
    hf_folder(tmp_path, config, "export")
    loaded = transformers.AutoConfig.from_pretrained(tmp_path / "export")
    assert type(loaded).__name__ == config["architectures"][0].replace("ForCausalLM", "Config")
    if rope is not None:  # the export names YaRN's attention factor explicitly
        arch = dataclasses.replace(
            arch, rope=dataclasses.replace(rope, attention_factor=rope.yarn_attention_factor)
        )
    assert read_hf_config(tmp_path / "export") == arch
    assert architecture_from_hf(loaded.to_dict()) == arch


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 64},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 64, "beta_fast": 16.0,
         "beta_slow": 2.0, "mscale": 1.0, "mscale_all_dim": 0.5},
        {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "truncate": False},
    ],
)  # fmt: skip
def test_rope_frequencies_and_attention_factor_match_transformers(scaling):
    """TorchTitan's RoPE built from a config.json rotates by transformers' inverse frequencies, and
    FlashCP's attention factor is transformers' cos / sin multiplier."""
    transformers = pytest.importorskip("transformers", reason="needs the test extra (transformers)")
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(hidden_size=512, num_attention_heads=4, max_position_embeddings=4096,
                                      rope_parameters={"rope_theta": 10000.0, **scaling})  # fmt: skip
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, "cpu")
    arch = architecture_from_hf(config.to_dict())
    cache = titan_rope(arch, max_seq_len=2).build().cache  # complex: position 1 holds exp(i inv_freq)
    assert torch.allclose(cache[1].angle(), inv_freq, rtol=1e-6, atol=0)
    assert arch.rope.yarn_attention_factor == pytest.approx(attention_factor, rel=1e-12)


QWEN3_30B_A3B = QWEN3_8B | {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48,
    "num_key_value_heads": 4, "intermediate_size": 6144, "num_experts": 128, "num_experts_per_tok": 8,
    "moe_intermediate_size": 768, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
}  # fmt: skip


def test_qwen3_30b_a3b_config_json_builds_torchtitans_flavor(tmp_path):
    """Qwen3-30B-A3B's published config.json gives TorchTitan's 30B-A3B flavor, and an export's config.json
    reads back to the same architecture."""
    cfg = validate({"model": {"hf_config": str(hf_folder(tmp_path, QWEN3_30B_A3B))}})
    arch = job_architecture(cfg["model"], 4096, 8192)
    registered = REGISTRIES["qwen3"]["30B-A3B"](attn_backend="flex")
    use_param_dtype_experts(registered.layers)
    assert _shapes(titan_config(arch, "flex", 8192)) == _shapes(titan_config(architecture_of(registered), "flex", 8192))
    assert architecture_from_hf(to_hf_config(arch)) == arch


@pytest.mark.parametrize(
    "change, message",
    [
        ({"mlp_only_layers": [3]}, r"dense layers among the experts .* every layer must route through experts"),
        ({"decoder_sparse_step": 2}, r"dense layers among the experts"),
        ({"num_experts_per_tok": 200}, r"num_experts_per_tok = 200 exceeds num_experts = 128"),
        ({"moe_intermediate_size": None}, r"moe_intermediate_size is missing"),
    ],
)
def test_a_moe_config_json_flashcp_cannot_train_is_one_line(tmp_path, change, message):
    with pytest.raises(ConfigError, match=r"^\[model\] hf_config: .*config\.json: " + message):
        validate({"model": {"hf_config": str(hf_folder(tmp_path, QWEN3_30B_A3B | change))}})


@pytest.mark.parametrize(
    "job, world, message",
    [
        ({"model": {"name": "qwen3", "flavor": "30B-A3B"}, "parallelism": {"expert_parallel_degree": 3}}, 3,
         r"^\[parallelism\] expert_parallel_degree \(3\) must divide the model's 128 experts"),
        ({"model": {"name": "qwen3", "flavor": "30B-A3B"}, "parallelism": {"expert_parallel_degree": 16,
          "context_parallel_degree": 4}}, 8,
         r"^\[parallelism\] expert_parallel_degree \(16\) must divide the ranks it borrows from, data_parallel_shard "
         r"x context_parallel x tensor_parallel \(2 x 4 x 1 = 8\)"),
        ({"parallelism": {"expert_parallel_degree": 2}}, 2,
         r"^\[parallelism\] expert_parallel_degree applies to mixture-of-experts models; llama3 'debugmodel' is dense"),
        ({"model": {"name": "qwen3", "flavor": "debugmodel_moe"}, "debug": {"moe_force_load_balance": True},
          "checkpoint": {"enable": True}}, 1, r"^\[debug\] moe_force_load_balance routes tokens round-robin"),
        ({"model": {"name": "qwen3", "flavor": "debugmodel_moe"}, "activation_checkpoint": {"mode": "full",
          "mlp_tiles": 4}}, 1, r"^\[activation_checkpoint\] mlp_tiles = 4 tiles dense feed-forward layers"),
        ({"model": {"flavor": "custom", "dim": 64, "n_layers": 2, "n_heads": 4, "num_experts": 4}}, 1,
         r"^\[model\] num_experts, num_experts_per_tok, moe_hidden_dim together make a custom Qwen3-MoE"),
    ],
)
def test_bad_expert_settings_are_one_line_before_launch(job, world, message):
    with pytest.raises(ConfigError, match=message) as e:
        check_layout(validate(job), world, has_cuda=True)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("folder, flavor, message", [
    (QWEN3_8B, "30B-A3B", r"holds a dense qwen3 model but the job's model \(\[model\] flavor '30B-A3B'\) is a "
                          r"mixture-of-experts one"),
    (QWEN3_30B_A3B, "8B", r"holds a mixture-of-experts qwen3 model but the job's model \(\[model\] flavor '8B'\) "
                          r"is a dense one"),
])  # fmt: skip
def test_a_dense_hf_folder_for_a_moe_flavor_and_the_reverse_are_one_line(tmp_path, folder, flavor, message):
    from flashcp.titan.launch.preflight import check_hf_import

    path = str(hf_folder(tmp_path, folder))
    cfg = validate({"model": {"name": "qwen3", "flavor": flavor},
                    "checkpoint": {"enable": True, "initial_load_path": path, "initial_load_in_hf": True}})  # fmt: skip
    with pytest.raises(ConfigError, match=r"^\[checkpoint\] initial_load_path: .*" + message):
        check_hf_import(cfg, 4096)


# openai/gpt-oss-20b's config.json (its experts published as MXFP4 blocks).
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "initializer_range": 0.02, "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4,
    "num_hidden_layers": 24, "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False,
    "pad_token_id": 199999, "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn",
    "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"}, "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0", "use_cache": True, "vocab_size": 201088,
}  # fmt: skip


def test_gpt_oss_20b_config_json_builds_torchtitans_flavor_and_exports_back(tmp_path):
    """gpt-oss-20b's published config.json gives TorchTitan's 20b flavor (its sliding layers, YaRN
    without truncation); an export's config.json, without the MXFP4 quantization, reads back to the same
    architecture, through transformers' GptOssConfig too."""
    transformers = pytest.importorskip("transformers", reason="needs the test extra (transformers)")
    cfg = validate({"model": {"hf_config": str(hf_folder(tmp_path, GPT_OSS_20B))}})
    assert (cfg["model"]["name"], model_head_dim(cfg)) == ("gpt_oss", 64)
    arch = job_architecture(cfg["model"], 4096, 8192)
    assert (arch.sliding_window, arch.window(0), arch.window(1), arch.experts.swiglu_limit) == (128, 128, None, 7.0)
    registered = registered_config("gpt_oss", "20b")
    use_param_dtype_experts(registered.layers)
    assert _shapes(titan_config(arch, "flex", 131072)) == _shapes(registered)
    exported = to_hf_config(arch, base=GPT_OSS_20B)
    assert "quantization_config" not in exported and exported["eos_token_id"] == 200002
    named = dataclasses.replace(arch, rope=dataclasses.replace(arch.rope, attention_factor=arch.rope.yarn_attention_factor))
    assert architecture_from_hf(exported) == named
    hf_folder(tmp_path, exported, "export")
    loaded = transformers.AutoConfig.from_pretrained(tmp_path / "export")
    assert type(loaded).__name__ == "GptOssConfig" and architecture_from_hf(loaded.to_dict()) == named


def test_gpt_oss_layers_follow_layer_types_and_fold_yarns_scale_once(tmp_path):
    """layer_types decide which layers slide (all full: none, and no window dispatch); TorchTitan's gpt-oss
    attention applies YaRN's default factor itself, so FlashCP's multiplies only a config's own factor's
    difference, and TorchTitan's attention (flex) is refused only then."""
    from flashcp.titan.models.rope import attention_scale_factor

    full = architecture_from_hf(GPT_OSS_20B | {"layer_types": ["full_attention"] * 24})
    assert (full.layer_types, full.sliding_window) == ((), None)
    assert {layer.attention.sliding_window_size for layer in titan_config(full, "flex", 8192).layers} == {None}
    spec = model_spec(validate({"model": {"name": "gpt_oss", "flavor": "debugmodel"}})["model"],
                      validate({})["flashcp"], 4096, 1024)  # fmt: skip
    inner = [layer.attention.inner_attention for layer in spec.model.layers]
    assert [(a.window, a.scale_factor) for a in inner] == [(128, 1.0), (None, 1.0)] * 2
    assert attention_scale_factor("gpt_oss", dataclasses.replace(full.rope, attention_factor=1.0)) == pytest.approx(
        (1 / (0.1 * math.log(32) + 1)) ** 2)  # fmt: skip
    assert validate({"model": {"name": "gpt_oss", "flavor": "debugmodel", "attention": "flex"}})
    with pytest.raises(ConfigError, match=r"yarn RoPE's attention factor \(1\) is applied by FlashCP's"):
        validate({"model": {"name": "gpt_oss", "flavor": "debugmodel", "attention": "flex", "rope_attention_factor": 1.0}})


@pytest.mark.parametrize(
    "change, message",
    [
        ({"sliding_window": 0}, r"sliding_window must be a positive int, got 0"),
        ({"sliding_window": -128}, r"sliding_window must be a positive int, got -128"),
        ({"layer_types": ["sliding_attention"] * 23},
         r"layer_types must name 'sliding_attention' or 'full_attention' for each of the 24 layers \(num_hidden_layers\)"),
        ({"layer_types": ["sliding_attention", "chunked_attention"] * 12}, r"layer_types must name"),
        ({"swiglu_alpha": 1.0}, r"swiglu_alpha = 1.0 is not supported"),
        ({"attention_bias": False}, r"attention_bias = False is not supported"),
        ({"num_experts_per_tok": 40}, r"num_experts_per_tok = 40 exceeds num_local_experts = 32"),
    ],
)  # fmt: skip
def test_a_gpt_oss_config_json_flashcp_cannot_train_is_one_line(tmp_path, change, message):
    with pytest.raises(ConfigError, match=r"^\[model\] hf_config: .*config\.json: " + message) as e:
        validate({"model": {"hf_config": str(hf_folder(tmp_path, GPT_OSS_20B | change))}})
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"flashcp": {"comm": "ring"}}, r"^\[flashcp\] comm = 'ring' \(the ring takes neither sinks nor sliding "
                                        r"windows\): not with a gpt_oss model"),
        ({"flashcp": {"backend": "flash_attn"}}, r"^\[flashcp\] backend = 'flash_attn' \(its kernel returns no LSE"),
        ({"parallelism": {"tensor_parallel_degree": 2}}, r"^\[parallelism\] tensor_parallel_degree > 1 .*wo\.bias's "
                                                         r"gradient 1/TP"),
    ],
)  # fmt: skip
def test_gpt_oss_refuses_the_ring_tp_and_kernels_without_sinks(change, message):
    with pytest.raises(ConfigError, match=message):
        validate({"model": {"name": "gpt_oss", "flavor": "20b"}, **change})
    with pytest.raises(ConfigError, match=r"flavor = 'custom' builds llama3 and qwen3 sizes; a gpt_oss"):
        validate({"model": {"name": "gpt_oss", "flavor": "custom", "dim": 64, "n_layers": 2, "n_heads": 4}})


TINY_QWEN3_5 = Path(__file__).resolve().parents[2] / "train_configs/hf/tiny_qwen3_5"


@pytest.mark.parametrize(
    "change, message",
    [
        ({"parallelism": {"tensor_parallel_degree": 2}}, r"^\[parallelism\] tensor_parallel_degree > 1 \(no TP plan"),
        ({"compile": {"enable": True}}, r"^\[compile\] enable with 'model' \(the linear-attention ops are not "),
        ({"flashcp": {"comm": "ring"}}, r"^\[flashcp\] comm = 'ring' "),
        ({"flashcp": {"overlap": True}}, r"^\[flashcp\] overlap = true"),
        ({"model": {"attention": "flex"}}, r"^\[model\] attention = 'flex' \(its Gated DeltaNet layers run on "),
    ],
)  # fmt: skip
def test_qwen3_5_refuses_tp_compile_the_ring_and_overlap(change, message):
    model = {"hf_config": str(TINY_QWEN3_5)} | change.pop("model", {})
    with pytest.raises(ConfigError, match=message + r".*: not with a qwen3_5 model \(hybrid Gated DeltaNet\)$") as e:
        validate({"model": model, **change})
    assert "\n" not in str(e.value)
    assert validate({"model": {"hf_config": str(TINY_QWEN3_5)}})["model"]["name"] == "qwen3_5"


@pytest.mark.parametrize(
    "change, message",
    [
        ({"vision_config": {"depth": 2}}, r"a vision-language config \(vision_config / \*ForConditionalGeneration\): "
                                          r"FlashCP trains text decoders only"),
        ({"architectures": ["Qwen3_5ForConditionalGeneration"]}, r"a vision-language config"),
        ({"model_type": "qwen3_5_moe_text"}, r"num_experts is missing"),
        ({"layer_types": ["linear_attention", "full_attention", "linear_attention", "linear_attention"]},
         r"layer_types .*: TorchTitan's builder makes layer i full exactly where \(i \+ 1\) % 2 == 0"),
        ({"layer_types": ["linear_attention"] * 3}, r"layer_types must name 'linear_attention' or 'full_attention' "
                                                    r"for each of the 4 layers"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e7}}, r"rope type 'yarn': FlashCP "
                                                                                       r"builds Qwen3.5's default"),
    ],
)  # fmt: skip
def test_a_qwen3_5_config_json_flashcp_cannot_train_is_one_line(tmp_path, change, message):
    """Text decoders only (no vision tower; the MoE text decoder with its experts), in the layer layout
    TorchTitan builds."""
    hf = json.loads((TINY_QWEN3_5 / "config.json").read_text()) | change
    with pytest.raises(ConfigError, match=r"^\[model\] hf_config: .*config\.json: " + message) as e:
        validate({"model": {"hf_config": str(hf_folder(tmp_path, hf))}})
    assert "\n" not in str(e.value)


def test_qwen3_5_is_named_by_an_hf_config_only():
    with pytest.raises(ConfigError, match=r"^\[model\] name = 'qwen3_5' is built from an hf_config only"):
        validate({"model": {"name": "qwen3_5"}})
