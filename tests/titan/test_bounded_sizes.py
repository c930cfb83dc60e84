"""A model's sizes are checked by arithmetic before anything is built (`flashcp.titan.config.sizes`)
and a model folder's JSON by its nesting (`flashcp.titan.hf.files.load_json`): 10^9 experts in a
config.json, or any other size no machine holds, is one line naming its key, refused at once and
without allocating; a config nested deeper than JSON needs is one line, not a RecursionError."""

from __future__ import annotations

import json
import time
import tracemalloc
from pathlib import Path

import pytest
import torch

import flashcp.titan  # noqa: F401  (TorchTitan shims first)
from flashcp.titan.config import check_layout, ConfigError, validate
from flashcp.titan.config.sizes import named_tensors, parameters
from flashcp.titan.hf.config import architecture_from_hf, HFConfigError, read_hf_config
from flashcp.titan.hf.files import FolderFileError, load_json, MAX_JSON_DEPTH
from flashcp.titan.hf.sidefiles import side_files
from flashcp.titan.launch import node as launch
from flashcp.titan.models.decoders import state_dict_adapter, titan_config
from tests.titan.test_hf_config import hf_folder, LLAMA31_8B, QWEN3_30B_A3B, QWEN3_8B
from tests.titan.test_mla_config import DEEPSEEK_V3

HANG_S = 60  # only catches a hang: each refusal takes milliseconds
HEAP_BYTES = 64 << 20  # Python heap a refusal may use at its peak (the bomb grew to 22.7 GB)
# transformers 5 counts Qwen3-MoE's experts in num_local_experts
QWEN3_MOE_5 = {key: value for key, value in QWEN3_30B_A3B.items() if key != "num_experts"} | {"num_local_experts": 128}
DEEPSEEK_ONE_GROUP = DEEPSEEK_V3 | {"n_group": 1, "topk_group": 1}


def bounded(call):
    """`call()`, which must take little time and Python heap at its peak."""
    tracemalloc.start()
    start = time.monotonic()
    try:
        result = call()
        elapsed, peak = time.monotonic() - start, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert elapsed < HANG_S and peak < HEAP_BYTES, (elapsed, peak)
    return result


def refusal(check) -> str:
    """The one-line ConfigError `check()` raises, bounded in time and memory."""

    def refused() -> str:
        with pytest.raises(ConfigError) as raised:
            check()
        return str(raised.value)

    line = bounded(refused)
    assert "\n" not in line
    return line


@pytest.mark.parametrize("config, named", [
    (QWEN3_MOE_5 | {"num_local_experts": 10**9}, "num_local_experts = 1,000,000,000 makes a model of 48 layers and "
                                                 "144,000,000,339 named tensors"),
    (QWEN3_30B_A3B | {"num_experts": 10**9}, "num_experts = 1,000,000,000 makes a model of 48 layers"),
    (DEEPSEEK_ONE_GROUP | {"n_routed_experts": 2**31}, "n_routed_experts = 2,147,483,648 makes a model of 61 layers"),
    (LLAMA31_8B | {"num_hidden_layers": 10**9}, "num_hidden_layers = 1,000,000,000 makes a model of 1,000,000,000 "
                                                "layers"),
    (LLAMA31_8B | {"vocab_size": 10**12}, "vocab_size = 1,000,000,000,000 makes a model of 8.19e+15 parameters: "
                                          "one rank's share of its bf16 weights over the job's 256 rank(s)"),
    (LLAMA31_8B | {"hidden_size": 2**35}, "hidden_size = 34,359,738,368 makes a model of"),
    (QWEN3_8B | {"num_attention_heads": 2**30, "num_key_value_heads": 2**30}, "num_attention_heads = 1,073,741,824"),
    (QWEN3_8B | {"head_dim": 2**40}, "head_dim = 1,099,511,627,776"),
    (LLAMA31_8B | {"intermediate_size": 10**12}, "intermediate_size = 1,000,000,000,000"),
    (QWEN3_30B_A3B | {"moe_intermediate_size": 10**12}, "moe_intermediate_size = 1,000,000,000,000"),
    (DEEPSEEK_V3 | {"intermediate_size": 10**12}, "intermediate_size = 1,000,000,000,000"),  # its 3 dense layers'
    (DEEPSEEK_V3 | {"n_shared_experts": 10**9}, "n_shared_experts = 1,000,000,000"),
    (DEEPSEEK_V3 | {"kv_lora_rank": 10**12}, "kv_lora_rank = 1,000,000,000,000"),
    (DEEPSEEK_V3 | {"q_lora_rank": 10**12}, "q_lora_rank = 1,000,000,000,000"),
    (DEEPSEEK_V3 | {"v_head_dim": 10**12}, "v_head_dim = 1,000,000,000,000"),
    (QWEN3_8B | {"vocab_size": 10**40}, "vocab_size is a 41-digit number, beyond 2**63 - 1, the largest size torch"),
], ids=lambda value: value.split()[0] if isinstance(value, str) else "config")  # fmt: skip
def test_a_config_json_size_no_machine_holds_is_refused_naming_its_key(tmp_path, config, named):
    """Refused by `--check`'s path (validate, then the layout of 256 ranks), which the launcher, the dry
    run and train.py take before building anything."""
    folder = hf_folder(tmp_path, config)
    line = refusal(lambda: check_layout(validate({"model": {"hf_config": str(folder)}}), 256, has_cuda=False))
    assert line.startswith(f"[model] hf_config: {folder / 'config.json'}: {named}"), line


CUSTOM = {"name": "qwen3", "flavor": "custom", "dim": 64, "n_layers": 2, "n_heads": 4}


@pytest.mark.parametrize("sizes, named", [
    ({"num_experts": 10**9, "num_experts_per_tok": 2, "moe_hidden_dim": 32}, "[model] num_experts = 1,000,000,000"),
    ({"n_layers": 10**9}, "[model] n_layers = 1,000,000,000"),
    ({"vocab_size": 10**15}, "[model] vocab_size = 1,000,000,000,000,000"),
    ({"dim": 2**40}, "[model] dim = 1,099,511,627,776"),
    ({"n_heads": 2**30, "head_dim": 64}, "[model] n_heads = 1,073,741,824"),
    ({"multiple_of": 2**50}, "the feed-forward width ([model] dim, ffn_dim_multiplier, multiple_of) = "
                             "1,125,899,906,842,624"),
    ({"dim": 2**70}, "[model] dim is a 22-digit number"),
], ids=lambda value: value.split()[1] if isinstance(value, str) else "sizes")  # fmt: skip
def test_a_custom_size_no_machine_holds_is_refused_naming_its_key(sizes, named):
    line = refusal(lambda: check_layout(validate({"model": CUSTOM | sizes}), 256, has_cuda=False))
    assert line.startswith(named), line


def test_the_launcher_refuses_a_folder_of_a_billion_experts_before_importing_it(tmp_path, capsys):
    """The reported bomb: the launcher's HF import check built one key per expert of such a folder."""
    folder = hf_folder(tmp_path, QWEN3_MOE_5 | {"num_local_experts": 10**9, "hidden_size": 64, "num_hidden_layers": 2,
                                                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                                                "moe_intermediate_size": 32, "vocab_size": 4096})  # fmt: skip
    job = tmp_path / "job.toml"
    job.write_text(f'[job]\ndump_folder = "{tmp_path / "out"}"\n[model]\nname = "qwen3"\n[checkpoint]\nenable = true\n'
                   f'initial_load_in_hf = true\ninitial_load_path = "{folder}"\n')  # fmt: skip
    assert bounded(lambda: launch.main(["--config", str(job)])) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: [model] hf_config: {folder / 'config.json'}: num_local_experts = 1,000,000,000 "
                          "makes a model of 2 layers and 6,000,000,017 named tensors") and err.count("\n") == 1, err


def test_published_models_pass_at_their_usual_sizes(tmp_path):
    for name, config, world in [("llama", LLAMA31_8B, 8), ("qwen3", QWEN3_30B_A3B, 64), ("deepseek", DEEPSEEK_V3, 1024)]:
        check_layout(validate({"model": {"hf_config": str(hf_folder(tmp_path, config, name))}}), world, has_cuda=False)


SMALL = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96,
         "moe_intermediate_size": 32, "vocab_size": 256, "num_hidden_layers": 3}  # fmt: skip
SMALL_MLA = SMALL | {
    "num_key_value_heads": 4, "n_routed_experts": 8, "n_group": 2, "topk_group": 1, "num_experts_per_tok": 2,
    "kv_lora_rank": 32, "q_lora_rank": 24, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
    "first_k_dense_replace": 1, "n_shared_experts": 2,
}  # fmt: skip


@pytest.mark.parametrize("config", [
    LLAMA31_8B | SMALL | {"head_dim": 16}, QWEN3_8B | SMALL, QWEN3_30B_A3B | SMALL | {"num_experts": 8},
    DEEPSEEK_V3 | SMALL_MLA, DEEPSEEK_V3 | SMALL_MLA | {"q_lora_rank": None, "tie_word_embeddings": True},
], ids=["llama3", "qwen3", "qwen3_moe", "deepseek_v3", "deepseek_v3_tied_no_q_lora"])  # fmt: skip
def test_the_counts_are_the_model_torchtitan_builds(config):
    """Exactly its parameters, and no more named tensors than its Hugging Face checkpoint holds."""
    arch = architecture_from_hf(config)
    model_config = titan_config(arch, attn_backend="flex", max_seq_len=64)
    with torch.device("meta"):
        model = model_config.build()
    assert parameters(arch) == sum(p.numel() for p in model.parameters())
    assert named_tensors(arch) <= len(state_dict_adapter(model_config).to_hf(model.state_dict()))


def nested(depth: int) -> bytes:
    """A JSON object holding objects `depth` deep in all."""
    return ('{"a": ' * (depth - 1) + "{}" + "}" * (depth - 1)).encode()


def test_json_nested_deeper_than_any_config_needs_is_one_line():
    assert load_json(nested(MAX_JSON_DEPTH), "x.json") is not None
    line = fr"^x\.json nests objects or arrays more than {MAX_JSON_DEPTH} deep, which no model's config needs: fix"
    for depth in (MAX_JSON_DEPTH + 1, 100_000):  # the second: json's own RecursionError
        with pytest.raises(FolderFileError, match=line + " or remove it$"):
            load_json(nested(depth), "x.json")
    with pytest.raises(FolderFileError, match=r"^x\.json is not valid JSON \(Exceeds the limit"):
        load_json(b'{"n": 1' + b"0" * 5000 + b"}", "x.json")  # more digits than Python converts


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 100_000])
def test_an_export_source_or_model_folder_nesting_too_deep_is_one_line(tmp_path, depth):
    """An export's generation_config.json (read before the job starts and by the export) and a
    model's config.json: before, a RecursionError traceback."""
    (tmp_path / "generation_config.json").write_bytes(nested(depth))
    (tmp_path / "config.json").write_bytes(nested(depth))
    with pytest.raises(FolderFileError, match=fr"^{tmp_path / 'generation_config.json'} nests objects or arrays more"):
        side_files(None, str(tmp_path))
    with pytest.raises(HFConfigError, match=fr"^{tmp_path / 'config.json'} nests objects or arrays more"):
        read_hf_config(tmp_path)
