"""DeepSeek-V3 (MLA) through FlashCP's one build path: flavors, config.json both ways, refusals in one line."""

from __future__ import annotations

import dataclasses

import pytest

import flashcp.titan  # noqa: F401  (TorchTitan shims first)
from flashcp.titan.config import check_layout, ConfigError, validate
from flashcp.titan.hf.config import architecture_from_hf, HFConfigError, to_hf_config
from flashcp.titan.models.decoders import job_architecture, titan_config
from flashcp.titan.models.registry import architecture_of, flavor_architecture, registered_config

from tests.titan.test_hf_config import _shapes, hf_folder, QWEN3_8B

# DeepSeek-V3's published config.json (the entries transformers reads).
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "attention_bias": False,
    "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "moe_intermediate_size": 2048, "n_group": 8,
    "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False, "topk_group": 4,
    "topk_method": "noaux_tc", "v_head_dim": 128, "vocab_size": 129280,
}  # fmt: skip


def test_deepseek_v3_config_json_builds_torchtitans_671b_flavor(tmp_path):
    """DeepSeek-V3's config.json gives TorchTitan's 671B flavor (but for RMSNorm's eps: TorchTitan's flavors
    keep its default 1e-5, DeepSeek 1e-6), and an export's config.json reads back to the same architecture."""
    cfg = validate({"model": {"hf_config": str(hf_folder(tmp_path, DEEPSEEK_V3))}})
    arch = job_architecture(cfg["model"], 4096, 8192)
    flavor = architecture_of(registered_config("deepseek_v3", "671B"))
    flavor = dataclasses.replace(flavor, norm_eps=1e-6, latent=dataclasses.replace(flavor.latent, norm_eps=1e-6))
    assert _shapes(titan_config(arch, "flex", 8192)) == _shapes(titan_config(flavor, "flex", 8192))
    assert architecture_from_hf(to_hf_config(arch)) == arch
    assert arch.latent.mscale == 1.0 and arch.rope.softmax_scale_factor == 1.0  # mscale only in the softmax scale


def test_flavors_without_an_hf_class_are_refused_at_export():
    """debugmodel / 16B / 236B route by softmax (DeepSeek-V2's router): DeepseekV3ForCausalLM cannot hold them."""
    for flavor in ("debugmodel", "16B", "236B"):
        with pytest.raises(HFConfigError, match=r"^this deepseek_v3 model routes by softmax; DeepseekV3ForCausalLM"):
            to_hf_config(flavor_architecture("deepseek_v3", flavor))
    with pytest.raises(HFConfigError, match=r"latent RMSNorm eps is 1e-05; DeepseekV3ForCausalLM fixes it at 1e-06"):
        to_hf_config(flavor_architecture("deepseek_v3", "671B"))


@pytest.mark.parametrize(
    "change, message",
    [
        ({"rope_interleave": False}, r"rope_interleave = False is not supported"),
        ({"scoring_func": "softmax"}, r"scoring_func = 'softmax' is not supported"),
        ({"num_key_value_heads": 8}, r"num_key_value_heads = 8 \(MLA has one key per head"),
        ({"rope_scaling": DEEPSEEK_V3["rope_scaling"] | {"mscale": 0.7}},
         r"rope_scaling.s attention factor 0.9192 \(mscale 0.7 != mscale_all_dim 1.0\) would scale only the RoPE part"),
        ({"n_group": 7}, r"256 experts in n_group = 7 groups"),
        ({"first_k_dense_replace": 62}, r"first_k_dense_replace must be an integer in 0..61, got 62"),
        ({"kv_lora_rank": None}, r"kv_lora_rank is missing"),
    ],
)  # fmt: skip
def test_a_deepseek_config_json_flashcp_cannot_train_is_one_line(tmp_path, change, message):
    with pytest.raises(ConfigError, match=r"^\[model\] hf_config: .*config\.json: " + message) as e:
        validate({"model": {"hf_config": str(hf_folder(tmp_path, DEEPSEEK_V3 | change))}})
    assert "\n" not in str(e.value)


MLA = {"name": "deepseek_v3", "flavor": "16B"}


@pytest.mark.parametrize(
    "job, message",
    [
        ({"flashcp": {"comm": "ring"}}, r"^\[flashcp\] comm = 'ring' \(the latent exchange runs compact"),
        ({"model": {"name": "kimi_k2_7"}}, r"^\[model\] name = 'kimi_k2_7' is a vision-language model"),
        ({"model": MLA | {"rope_attention_factor": 1.2}}, r"^\[model\] rope_attention_factor does not apply to MLA"),
        ({"model": {"name": "deepseek_v3", "flavor": "custom", "dim": 64, "n_layers": 2, "n_heads": 4}},
         r"^\[model\] flavor = 'custom' builds llama3 and qwen3 sizes; a deepseek_v3 of another size is an hf_config"),
    ],
)  # fmt: skip
def test_what_mla_does_not_run_is_one_line_before_launch(job, message):
    with pytest.raises(ConfigError, match=message) as e:
        check_layout(validate({"model": MLA} | job), 2, has_cuda=True)
    assert "\n" not in str(e.value)


def test_every_deepseek_flavor_is_trained():
    job = validate({"model": MLA, "parallelism": {"expert_parallel_degree": 2, "context_parallel_degree": 2}})
    assert check_layout(job, 2, has_cuda=True) == {"cp": 2, "dp_replicate": 1, "dp_shard": 1, "pp": 1, "tp": 1}
    compiled = validate({"model": MLA, "compile": {"enable": True}, "parallelism": {"context_parallel_degree": 2}})
    assert check_layout(compiled, 2, has_cuda=True)["cp"] == 2  # the latent exchange is a registered op
    tp = validate({"model": MLA, "parallelism": {"tensor_parallel_degree": 2, "context_parallel_degree": 2}})
    assert check_layout(tp, 4, has_cuda=True)["tp"] == 2  # heads split by TP, the latent exchanged whole
    for flavor in ("debugmodel", "16B", "236B", "671B"):
        assert validate({"model": {"name": "deepseek_v3", "flavor": flavor}})["model"]["flavor"] == flavor


@pytest.mark.parametrize("folder, model, message", [
    (QWEN3_8B, MLA, r"holds a qwen3 model but the job's model \(\[model\] name 'deepseek_v3'\) is deepseek_v3"),
    (DEEPSEEK_V3, {"name": "qwen3", "flavor": "30B-A3B"},
     r"holds a deepseek_v3 model but the job's model \(\[model\] name 'qwen3'\) is qwen3"),
])  # fmt: skip
def test_another_familys_hf_folder_is_one_line(tmp_path, folder, model, message):
    from flashcp.titan.launch.preflight import check_hf_import

    path = str(hf_folder(tmp_path, folder))
    cfg = validate({"model": model, "checkpoint": {"enable": True, "initial_load_path": path,
                                                   "initial_load_in_hf": True}})  # fmt: skip
    with pytest.raises(ConfigError, match=r"^\[checkpoint\] initial_load_path: .*" + message):
        check_hf_import(cfg, 4096)


def test_yarn_chosen_by_the_job_stays_a_pure_rotation_for_mla(tmp_path):
    """A deepseek_v3 config.json without scaling, given YaRN by the job: no attention factor on its RoPE
    (what the export writes, attention_factor 1, transformers then applies as trained)."""
    plain = DEEPSEEK_V3 | {"rope_scaling": None}
    cfg = validate({"model": {"hf_config": str(hf_folder(tmp_path, plain)), "rope_scaling": "yarn", "rope_factor": 4.0,
                              "rope_original_max_position_embeddings": 4096}})  # fmt: skip
    arch = job_architecture(cfg["model"], 4096, 16384)
    assert arch.rope.scaling == "yarn" and arch.rope.yarn_attention_factor == 1.0 and arch.latent.mscale == 0.0
    assert to_hf_config(arch)["rope_scaling"]["attention_factor"] == 1.0
