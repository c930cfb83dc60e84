"""DeepseekV3ForCausalLM folders in and out (`initial_load_in_hf`, `python -m flashcp.titan.export`),
with transformers as the judge, and the crafted-folder checks of the dense path for DeepSeek-V3.

A tiny random DeepSeek-V3 (scripts/make_tiny_hf.py: MLA with q_lora_rank, YaRN with mscale, a dense
first layer, then 8 routed experts and a shared one behind a sigmoid router with a correction bias)
is imported, trained one step at a negligible learning rate through FlashCP's latent attention,
exported, loaded by transformers: the original logits (fp32, <= 1e-5), it generates, bf16 shards
load. Tied and untied embeddings both. Folders FlashCP cannot take are one line before launch.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers", reason="the test extra (pip install -e .[test]) provides transformers")
import transformers  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from scripts.make_tiny_hf import make_tiny_hf  # noqa: E402
from titan.harness import single_rank, train  # noqa: E402
from titan.test_hf_checkpoint import hf_job, IDS, logits, negligible_export  # noqa: E402

from flashcp.titan.config import ConfigError  # noqa: E402
from flashcp.titan.export import main as export_main  # noqa: E402
from flashcp.titan.launch.preflight import check_inputs  # noqa: E402


def _with_bias(folder):
    """The routers' correction bias nonzero in the folder (transformers initialises it to zero)."""
    tensors = load_file(folder / "model.safetensors")
    g = torch.Generator().manual_seed(3)
    for name in [n for n in tensors if n.endswith("e_score_correction_bias")]:
        tensors[name] = 0.05 * torch.randn(tensors[name].shape, generator=g)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_deepseek_v3_round_trip_generates_and_exports_bf16(tmp_path, tied):
    hf = _with_bias(make_tiny_hf(tmp_path / "dsv3", model_type="deepseek_v3", tie_word_embeddings=tied))
    step, out, config = negligible_export(tmp_path, hf)
    assert config["model_type"] == "deepseek_v3" and config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert (config["kv_lora_rank"], config["q_lora_rank"], config["first_k_dense_replace"]) == (32, 24, 1)
    assert config["tie_word_embeddings"] is tied and config["num_nextn_predict_layers"] == 0
    with safe_open(out / "model.safetensors", "pt") as f:
        names = set(f.keys())
        bias = f.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias")
    assert {f"model.layers.2.mlp.experts.{e}.down_proj.weight" for e in range(8)} <= names
    assert {"model.layers.0.mlp.gate_proj.weight", "model.layers.1.mlp.shared_experts.up_proj.weight",
            "model.layers.1.self_attn.kv_b_proj.weight", "model.layers.1.self_attn.q_a_layernorm.weight"} <= names
    assert ("lm_head.weight" in names) is not tied
    # The imported routing bias (about 0.05), moved by one aux-loss-free update (1e-3 x sign, centred).
    moved = bias - load_file(hf / "model.safetensors")["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert 0 < moved.abs().max() <= 2e-3 and bias.abs().max() > 0.02
    expected = _logits_with_biases(hf, out)
    assert (logits(out, IDS) - expected).abs().max() <= 1e-5
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert model.generate(IDS[:1, :8], max_new_tokens=4, do_sample=False).shape == (1, 12)
    half = tmp_path / "export-bf16"
    assert export_main(["--checkpoint", str(step), "--out", str(half), "--dtype", "bfloat16"]) == 0
    with safe_open(half / "model.safetensors", "pt") as f:
        assert {f.get_tensor(name).dtype for name in f.keys()} == {torch.bfloat16}
    assert (logits(half, IDS) - expected).abs().max() <= 0.1


def _logits_with_biases(source, export):
    """The source folder's logits with the export's routing biases: the step moved those (routing
    choices), its learning rate of 1e-12 nothing else."""
    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    exported = load_file(export / "model.safetensors")
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith("mlp.gate"):
                module.e_score_correction_bias.copy_(exported[f"{name}.e_score_correction_bias"])
        return model(IDS).logits


def _crafted(tmp_path, how: str):
    folder = make_tiny_hf(tmp_path / "dsv3", model_type="deepseek_v3")
    config = json.loads((folder / "config.json").read_text())
    tensors = load_file(folder / "model.safetensors")
    if how == "mtp":  # DeepSeek-V3's published folders hold one: layer n_layers
        tensors["model.layers.3.eh_proj.weight"] = torch.zeros(32, 64)
    elif how == "kv_lora_rank":
        (folder / "config.json").write_text(json.dumps(config | {"kv_lora_rank": 16}))
    elif how == "dense":  # the MoE layer's expert tensors, but config.json says every layer is dense
        (folder / "config.json").write_text(json.dumps(config | {"first_k_dense_replace": 3}))
    elif how == "bf16 shards":
        names = sorted(tensors)
        shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
                  "model-00002-of-00002.safetensors": names[len(names) // 2:]}  # fmt: skip
        for file, part in shards.items():
            save_file({n: tensors[n].bfloat16() for n in part}, folder / file, metadata={"format": "pt"})
        (folder / "model.safetensors").unlink()
        index = {"weight_map": {n: file for file, part in shards.items() for n in part}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
        return folder
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("how, named", [
    ("mtp", "holds a multi-token-prediction layer (model.layers.3.*), which FlashCP does not train"),
    ("kv_lora_rank", "model.layers.0.self_attn.kv_a_proj_with_mqa.weight is [40, 32] in model.safetensors, the "
                     "model needs [24, 32] (and 8 more)"),
    ("dense", "model.layers.1.mlp.gate_proj.weight, model.layers.1.mlp.down_proj.weight (and 4 more) missing (the "
              "model needs [96, 32]); model.layers.1.mlp.experts.0.down_proj.weight"),
])  # fmt: skip
def test_a_deepseek_folder_flashcp_cannot_take_is_one_line_before_launch(tmp_path, how, named):
    folder = _crafted(tmp_path, how)
    with pytest.raises(ConfigError) as e:
        check_inputs(hf_job(tmp_path / "out", folder))
    assert named in str(e.value) and "\n" not in str(e.value)


def test_bf16_shards_are_imported(tmp_path):
    """A sharded bf16 folder (as DeepSeek publishes its own, with an index) passes the checks and loads."""
    folder = _crafted(tmp_path, "bf16 shards")
    cfg = hf_job(tmp_path / "run", folder, training={"steps": 1}, optimizer={"lr": 1e-12})
    check_inputs(cfg)
    with single_rank():
        losses = train(cfg)
    assert torch.isfinite(torch.tensor(losses[1]))
