"""gpt-oss Hugging Face folders (`GptOssForCausalLM`) in and out, and the released MXFP4 ones converted.

- Import: FlashCP's adapter maps transformers' unquantized names (experts [E, in, out], gate / up
  interleaved) exactly as the gpt-oss oracle's mapping, which test_gpt_oss_oracle.py proves
  against transformers, and back (the multi-rank import: test_hf_import_ranks.py).
- Round trip: import -> one step at lr 1e-12 -> export gives transformers' original logits (fp32),
  and `--dtype bfloat16` writes a bf16 folder that loads.
- MXFP4: a tiny synthetic MXFP4 folder (blocks and scales drawn at random, sharded with an index)
  is refused in one line naming the converter, before launch and by the ranks; `python -m flashcp.titan.hf.dequant`
  writes every expert matrix exactly as transformers' own MXFP4 dequantization
  (`convert_moe_packed_tensors`) gives it, a bf16 folder that transformers loads and FlashCP
  imports exactly, holding at most one expert's matrix (or a bounded row block) in memory at a time.
- Bad input is one line and nothing is written: layer_types that do not fit num_hidden_layers or
  name an unknown type, a folder with no MXFP4 matrices, blocks without scales, a target in use.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the test extra (pip install -e .[test]) provides transformers")
import transformers  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers.integrations.mxfp4 import convert_moe_packed_tensors  # noqa: E402

from scripts.make_tiny_hf import make_tiny_hf  # noqa: E402
from titan.harness import load_export, single_rank, train  # noqa: E402
from titan.test_gpt_oss_oracle import _our_model  # noqa: E402
from titan.test_hf_checkpoint import hf_job, IDS, negligible_export  # noqa: E402

from flashcp.titan.components.checkpoint import CheckpointError  # noqa: E402
from flashcp.titan.config import ConfigError  # noqa: E402
from flashcp.titan.hf import dequant  # noqa: E402
from flashcp.titan.launch.preflight import check_inputs  # noqa: E402
from flashcp.titan.models.decoders import state_dict_adapter  # noqa: E402

EXPERT_MATRICES = ("gate_up_proj", "down_proj")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """The tiny gpt-oss folder (`scripts/make_tiny_hf.py --model-type gpt_oss`: a sliding and a full
    layer, 8 biased experts of width 24, top-2)."""
    return make_tiny_hf(tmp_path_factory.mktemp("gpt_oss") / "hf", model_type="gpt_oss")


def test_the_adapter_maps_transformers_names_as_the_oracle_does(tiny):
    hf = load_file(tiny / "model.safetensors")
    model = _our_model(tiny)  # the oracle's own mapping, proven against transformers
    adapter = state_dict_adapter(model.config)
    ours = adapter.from_hf(hf)
    expected = {k: v for k, v in model.state_dict().items() if not k.endswith("moe.expert_bias_E")}
    assert ours.keys() == expected.keys()
    for name, value in ours.items():
        assert torch.equal(value.double(), expected[name]), name
    back = adapter.to_hf(ours)
    assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf)


def test_round_trip_gives_transformers_logits_and_exports_bf16(tiny, tmp_path):
    step, out, config = negligible_export(tmp_path, tiny)
    assert config["model_type"] == "gpt_oss" and config["architectures"] == ["GptOssForCausalLM"]
    assert config["layer_types"] == ["sliding_attention", "full_attention"] and config["sliding_window"] == 16
    assert "quantization_config" not in config
    with safe_open(out / "model.safetensors", "pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    assert shapes["model.layers.1.mlp.experts.gate_up_proj"] == (8, 32, 48)  # [E, hidden, 2 * intermediate]
    assert shapes["model.layers.1.mlp.experts.down_proj"] == (8, 24, 32)
    original = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    with torch.no_grad():
        reference, exported = original(IDS).logits, load_export(out)(IDS).logits
    gap = (exported - reference).abs().max() / reference.abs().max()
    print(f"gpt-oss round trip: max |logits - transformers'| / max |transformers'| = {gap:.1e}")
    assert gap <= 1e-6
    half = tmp_path / "export-bf16"
    from flashcp.titan.export import main as export_main

    assert export_main(["--checkpoint", str(step), "--out", str(half), "--dtype", "bfloat16"]) == 0
    with safe_open(half / "model.safetensors", "pt") as f:
        assert {f.get_tensor(name).dtype for name in f.keys()} == {torch.bfloat16}
    with torch.no_grad():
        assert (load_export(half)(IDS).logits - reference).abs().max() <= 0.1 * reference.abs().max()


def test_a_tied_gpt_oss_round_trips_storing_the_embedding_only(tmp_path):
    hf = make_tiny_hf(tmp_path / "tied", model_type="gpt_oss", tie_word_embeddings=True)
    _, out, config = negligible_export(tmp_path, hf)
    with safe_open(out / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys() and "model.embed_tokens.weight" in f.keys()
    assert config["tie_word_embeddings"] is True
    original = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    with torch.no_grad():
        reference, exported = original(IDS).logits, load_export(out)(IDS).logits
    assert (exported - reference).abs().max() <= 1e-6 * reference.abs().max()


def _mxfp4_folder(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A tiny gpt-oss stored as the released checkpoints are: bf16 tensors, each expert matrix as
    random MXFP4 blocks and scales (hidden 64 and intermediate 32: multiples of 32), in two files
    with an index, quantization_config mxfp4. Returns the folder and its tensors."""
    hf = make_tiny_hf(tmp_path / "unquantized", model_type="gpt_oss", hidden_size=64, intermediate_size=32,
                      head_dim=16)  # fmt: skip
    tensors = {k: v.to(torch.bfloat16) for k, v in load_file(hf / "model.safetensors").items()}
    g = torch.Generator().manual_seed(0)
    for name in [k for k in tensors if k.endswith(EXPERT_MATRICES)]:
        experts, inputs, outputs = tensors.pop(name).shape  # [E, in, out] stored as [E, out, in / 32, 16]
        tensors[f"{name}_blocks"] = torch.randint(0, 256, (experts, outputs, inputs // 32, 16), generator=g,
                                                  dtype=torch.uint8)  # fmt: skip
        tensors[f"{name}_scales"] = torch.randint(120, 130, (experts, outputs, inputs // 32), generator=g,
                                                  dtype=torch.uint8)  # fmt: skip
    folder = tmp_path / "mxfp4"
    folder.mkdir()
    names = sorted(tensors)
    files = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in files.items():
        save_file({k: tensors[k] for k in part}, folder / file, metadata={"format": "pt"})
    weight_map = {k: file for file, part in files.items() for k in part}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((hf / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                     "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(hf / name, folder / name)
    return folder, tensors


def test_an_mxfp4_folder_is_refused_in_one_line_naming_the_converter(tmp_path):
    folder, _ = _mxfp4_folder(tmp_path)
    with pytest.raises(ConfigError) as e:
        check_inputs(hf_job(tmp_path / "run", folder))
    with single_rank(), pytest.raises(CheckpointError) as at_load:  # the ranks check again before reading
        train(hf_job(tmp_path / "run", folder))
    for line in (str(e.value), str(at_load.value)):
        assert "\n" not in line and "MXFP4" in line and f"python -m flashcp.titan.hf.dequant {folder}" in line, line


def test_dequant_gives_transformers_values_and_a_folder_both_load(tmp_path, monkeypatch):
    folder, tensors = _mxfp4_folder(tmp_path)
    sizes: list[int] = []  # the bytes of each piece the converter held
    chunks = dequant._chunks

    def recorded(tensor, dtype):
        for piece in chunks(tensor, dtype):
            sizes.append(piece.numel() * piece.element_size())
            yield piece

    monkeypatch.setattr(dequant, "_chunks", recorded)
    monkeypatch.setattr(dequant, "CHUNK_BYTES", 4096)
    out = tmp_path / "bf16"
    assert dequant.main([str(folder), str(out), "--max-shard-size", "200KB"]) == 0
    one_expert = 64 * 64 * 2  # the largest expert matrix, [in, out] of bf16
    assert max(sizes) <= max(one_expert, 4096 + 4096 * 2)  # a row block may pass CHUNK_BYTES by one row
    converted: dict[str, torch.Tensor] = {}
    for file in out.glob("*.safetensors"):
        converted |= load_file(file)
    assert len(list(out.glob("*.safetensors"))) > 1 and (out / "model.safetensors.index.json").is_file()
    matrices = [k for k in converted if k.endswith(EXPERT_MATRICES)]
    assert len(matrices) == 4
    for name in matrices:  # transformers' MXFP4 dequantization is the oracle
        expected = convert_moe_packed_tensors(tensors[f"{name}_blocks"], tensors[f"{name}_scales"], dtype=torch.bfloat16)
        assert converted[name].dtype == torch.bfloat16 and torch.equal(converted[name], expected), name
    rest = {k: v for k, v in tensors.items() if not k.endswith(("_blocks", "_scales"))}
    assert all(torch.equal(converted[k], v) for k, v in rest.items())
    assert converted.keys() == rest.keys() | set(matrices)
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["torch_dtype"] == "bfloat16"
    assert (out / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    assert torch.equal(model.model.layers[1].mlp.experts.down_proj, converted["model.layers.1.mlp.experts.down_proj"])
    check_inputs(hf_job(tmp_path / "check", out))
    _, exported, _ = negligible_export(tmp_path, out)  # the bf16 folder imported exactly (fp32 training)
    weights = load_file(exported / "model.safetensors")
    assert weights.keys() == converted.keys()
    assert max((weights[k] - v.float()).abs().max() for k, v in converted.items()) <= 1e-9  # lr 1e-12


def _bad_layer_types(tiny: Path, tmp_path: Path, layer_types: list[str]) -> Path:
    folder = tmp_path / "bad"
    shutil.copytree(tiny, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"layer_types": layer_types}))
    return folder


@pytest.mark.parametrize("layer_types", [["sliding_attention"], ["sliding_attention", "chunked_attention"]])
def test_layer_types_that_do_not_fit_are_one_line_before_launch(tiny, tmp_path, layer_types):
    folder = _bad_layer_types(tiny, tmp_path, layer_types)
    before = sorted((p.name, p.stat().st_mtime_ns) for p in folder.iterdir())
    with pytest.raises(ConfigError) as e:
        check_inputs(hf_job(tmp_path / "run", folder))
    line = str(e.value)
    assert "\n" not in line and "layer_types must name 'sliding_attention' or 'full_attention' for each of the 2 " \
        "layers" in line and str(folder) in line, line  # fmt: skip
    assert sorted((p.name, p.stat().st_mtime_ns) for p in folder.iterdir()) == before
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("how, named", [
    ("unquantized", "holds no MXFP4 matrices"),
    ("no scales", "has no matching model.layers.0.mlp.experts.down_proj_scales"),
    ("target in use", "is not empty: refusing to write there"),
])  # fmt: skip
def test_the_converter_refuses_bad_input_in_one_line_and_writes_nothing(tiny, tmp_path, capsys, how, named):
    src, out = tiny, tmp_path / "out"
    if how == "no scales":
        src, _ = _mxfp4_folder(tmp_path)
        index = json.loads((src / "model.safetensors.index.json").read_text())
        file = src / index["weight_map"]["model.layers.0.mlp.experts.down_proj_scales"]
        save_file({k: v for k, v in load_file(file).items() if k != "model.layers.0.mlp.experts.down_proj_scales"},
                  file, metadata={"format": "pt"})  # fmt: skip
        index["weight_map"].pop("model.layers.0.mlp.experts.down_proj_scales")
        (src / "model.safetensors.index.json").write_text(json.dumps(index))
    if how == "target in use":
        src, _ = _mxfp4_folder(tmp_path)
        out.mkdir()
        (out / "keep.txt").write_text("mine")
    capsys.readouterr()  # what writing the source printed
    assert dequant.main([str(src), str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and named in err, err
    if how == "target in use":
        assert [p.name for p in out.iterdir()] == ["keep.txt"]
    else:
        assert not out.exists()
    assert not list(tmp_path.glob(".out.partial-*"))
