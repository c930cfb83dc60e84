"""Hugging Face import (`initial_load_in_hf`) and export (`python -m flashcp.titan.export`,
`last_save_in_hf`) against transformers itself, on tiny random models written with transformers.

- Round trip: import -> one step at a negligible learning rate -> export gives the original
  model's logits (fp32, <= 1e-5), on one rank and on two (CP = 2, TP = 2), Llama, Qwen3 and
  Qwen3-MoE (which also generates, and exports in bf16); after real steps the exported weights
  differ and load.
- The export refuses a non-empty folder, shards above --max-shard-size with an index that
  transformers loads, writes --dtype, copies the job's tokenizer, names a damaged checkpoint.
- A bad HF folder (missing / truncated safetensors, wrong shapes, unsupported model_type, only a
  pickle) is one line before launch (`preflight.check_inputs`), and at load.
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the test extra (pip install -e .[test]) provides transformers")
import transformers  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from scripts.make_tiny_hf import make_tiny_hf  # noqa: E402
from titan.harness import load_export, single_rank, tiny_job, train, train_on_pool_rank  # noqa: E402

from flashcp.run.manifest import checksum  # noqa: E402
from flashcp.titan.components.checkpoint import CheckpointError  # noqa: E402
from flashcp.titan.config import ConfigError  # noqa: E402
from flashcp.titan.export import main as export_main  # noqa: E402
from flashcp.titan.hf.export import export  # noqa: E402
from flashcp.titan.launch.preflight import check_inputs  # noqa: E402


def hf_job(dump: Path, hf: Path, **sections: dict) -> dict:
    """The tiny job with its architecture and weights from the HF folder `hf`."""
    checkpoint = {"enable": True, "interval": 1, "initial_load_path": str(hf), "initial_load_in_hf": True}
    checkpoint |= sections.pop("checkpoint", {})
    return tiny_job(dump, model=None, checkpoint=checkpoint, **sections)


def logits(folder: Path, ids: torch.Tensor, exported: bool = True) -> torch.Tensor:
    """The logits of the model in `folder`: an export loaded as `load_export` does (with its
    GenerationConfig), a source folder (`exported=False`) as transformers saved it."""
    model = (load_export(folder) if exported else
             transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32))  # fmt: skip
    with torch.no_grad():
        return model(ids).logits


def negligible_export(tmp_path: Path, hf: Path) -> tuple[Path, Path, dict]:
    """One step at lr 1e-12 from the HF folder `hf`, then exported: the step's checkpoint, the export
    and the export's config.json."""
    with single_rank():
        train(hf_job(tmp_path / "run", hf, training={"steps": 1}, optimizer={"lr": 1e-12}))
    step = tmp_path / "run" / "checkpoint" / "step-1"
    out = tmp_path / "export"
    assert export_main(["--checkpoint", str(step), "--out", str(out)]) == 0
    return step, out, json.loads((out / "config.json").read_text())


CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
GENERATION = {"bos_token_id": 0, "eos_token_id": [7, 1], "temperature": 0.6, "top_p": 0.9, "do_sample": True}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    """The tiny Llama with what newer transformers saves beside a chat model: the chat template in
    its own file and sampling defaults with an extra EOS id."""
    folder = make_tiny_hf(tmp_path_factory.mktemp("hf") / "llama")
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (folder / "generation_config.json").write_text(json.dumps(GENERATION))
    return folder


@pytest.fixture(scope="module")
def negligible_step(tmp_path_factory, tiny_llama) -> Path:
    """The checkpoint after importing the tiny Llama and one step at lr 1e-12."""
    dump = tmp_path_factory.mktemp("negligible")
    with single_rank():
        train(hf_job(dump, tiny_llama, training={"steps": 1}, optimizer={"lr": 1e-12}))
    return dump / "checkpoint" / "step-1"


IDS = torch.randint(0, 4096, (2, 48), generator=torch.Generator().manual_seed(0))


def test_round_trip_at_negligible_lr_gives_the_original_logits(negligible_step, tiny_llama, tmp_path):
    out = tmp_path / "export"
    assert export_main(["--checkpoint", str(negligible_step), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["chat_template.jinja", "config.json", "generation_config.json",
                                                     "model.safetensors", "tokenizer.json",
                                                     "tokenizer_config.json"]  # fmt: skip
    assert (out / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    assert json.loads((out / "generation_config.json").read_text()) == GENERATION | {"eos_token_id": [1, 7]}
    assert transformers.GenerationConfig.from_pretrained(out).eos_token_id == [1, 7]
    original, exported = logits(tiny_llama, IDS, exported=False), logits(out, IDS)
    assert (exported - original).abs().max() <= 1e-5
    config = json.loads((out / "config.json").read_text())
    assert config["torch_dtype"] == "float32" and config["max_position_embeddings"] == 512
    assert config["eos_token_id"] == 1  # the base model's entries carry over
    assert not list(tmp_path.glob(".export.partial-*"))


def test_round_trip_on_two_ranks(tiny_llama, tmp_path, gloo_pool):
    """The HF weights go through the adapter as FSDP (dp_shard x cp) or TP shards, in and out."""
    pool = gloo_pool(2)
    for name, layout in (("cp2", {"context_parallel_degree": 2}), ("tp2", {"tensor_parallel_degree": 2})):
        cfg = hf_job(tmp_path / name, tiny_llama, training={"steps": 1}, optimizer={"lr": 1e-12},
                     parallelism=layout)  # fmt: skip
        pool.run(train_on_pool_rank, (cfg,))
        export(tmp_path / name / "checkpoint" / "step-1", tmp_path / f"{name}-hf")
        difference = logits(tmp_path / f"{name}-hf", IDS) - logits(tiny_llama, IDS, exported=False)
        assert difference.abs().max() <= 1e-5, name


def test_qwen3_round_trip_with_tied_embeddings(tmp_path):
    hf = make_tiny_hf(tmp_path / "qwen3", model_type="qwen3")
    with single_rank():
        train(hf_job(tmp_path / "run", hf, training={"steps": 1}, optimizer={"lr": 1e-12}))
    out = tmp_path / "export"
    export(tmp_path / "run" / "checkpoint" / "step-1", out)
    with safe_open(out / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys()  # tied: the embedding is the output projection
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["tie_word_embeddings"] and config["head_dim"] == 16
    assert (logits(out, IDS) - logits(hf, IDS, exported=False)).abs().max() <= 1e-5


def test_qwen3_moe_round_trip_generates_and_exports_bf16(tmp_path):
    """Qwen3MoeForCausalLM in and out: every expert's three projections through TorchTitan's
    adapter, the router's gate; the export loads in transformers, gives the original logits and
    generates; `--dtype bfloat16` writes bf16 shards that load."""
    hf = make_tiny_hf(tmp_path / "moe", model_type="qwen3_moe")
    step, out, config = negligible_export(tmp_path, hf)
    assert config["model_type"] == "qwen3_moe" and config["architectures"] == ["Qwen3MoeForCausalLM"]
    assert (config["num_experts"], config["num_experts_per_tok"], config["moe_intermediate_size"]) == (8, 2, 16)
    with safe_open(out / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert {f"model.layers.1.mlp.experts.{e}.down_proj.weight" for e in range(8)} <= names
    assert "model.layers.0.mlp.gate.weight" in names
    assert (logits(out, IDS) - logits(hf, IDS)).abs().max() <= 1e-5
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    generated = model.generate(IDS[:1, :8], max_new_tokens=4, do_sample=False)
    assert generated.shape == (1, 12)
    half = tmp_path / "export-bf16"
    assert export_main(["--checkpoint", str(step), "--out", str(half), "--dtype", "bfloat16"]) == 0
    with safe_open(half / "model.safetensors", "pt") as f:
        assert {f.get_tensor(name).dtype for name in f.keys()} == {torch.bfloat16}
    assert (logits(half, IDS) - logits(hf, IDS)).abs().max() <= 0.1


@pytest.mark.parametrize("head", ["equal", "different"])
def test_a_tied_folder_may_also_store_lm_head_when_it_equals_the_embedding(tmp_path, head):
    """transformers loads a tied folder that stores lm_head.weight as well; FlashCP too, if it is the
    embedding (the model has no place for another one)."""
    hf = make_tiny_hf(tmp_path / "qwen3", model_type="qwen3")
    tensors = load_file(hf / "model.safetensors")
    embedding = tensors["model.embed_tokens.weight"]
    tensors["lm_head.weight"] = embedding.clone() if head == "equal" else embedding + 1
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    cfg = hf_job(tmp_path / "run", hf, training={"steps": 1}, optimizer={"lr": 1e-12})
    if head == "different":
        with pytest.raises(ConfigError, match=r"model\.safetensors: lm_head\.weight differs from "
                                              r"model\.embed_tokens\.weight, but config\.json ties them"):  # fmt: skip
            check_inputs(cfg)
        return
    check_inputs(cfg)
    with single_rank():
        train(cfg)
    export(tmp_path / "run" / "checkpoint" / "step-1", tmp_path / "export")
    assert (logits(tmp_path / "export", IDS) - logits(hf, IDS, exported=False)).abs().max() <= 1e-5


def test_real_steps_change_the_weights_and_last_save_in_hf_exports_them(tiny_llama, tmp_path):
    hf_export = {"last_save_in_hf": True, "export_dtype": "bfloat16"}
    cfg = hf_job(tmp_path, tiny_llama, training={"steps": 3}, checkpoint=hf_export)
    with single_rank():
        losses = train(cfg)
    assert losses[3] < losses[1]
    folder = tmp_path / "checkpoint"
    out = folder / "step-3-hf"
    assert (folder / "step-3" / ".metadata").is_file()  # the final checkpoint stays a resumable DCP one
    first = (out / "model.safetensors").read_bytes()
    shutil.rmtree(out)  # as if the run had died while exporting: starting it again exports, trains nothing
    (folder / ".step-3-hf.partial-0123456789ab").mkdir()  # that crashed export's temporary folder
    with single_rank():
        assert train(cfg) == {}
    assert (out / "model.safetensors").read_bytes() == first
    assert not list(folder.glob(".step-3-hf.partial-*"))
    with safe_open(out / "model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    exported = load_export(out, dtype=torch.bfloat16)
    original = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama)
    before = original.state_dict()
    changed = {k: (v.float() - before[k]).abs().max().item() for k, v in exported.state_dict().items()}
    assert min(changed.values()) > 1e-4, changed
    assert torch.isfinite(logits(out, IDS)).all()
    assert (out / "tokenizer.json").read_bytes() == (tiny_llama / "tokenizer.json").read_bytes()


def test_export_shards_above_the_size_limit_and_casts(negligible_step, tiny_llama, tmp_path):
    out = tmp_path / "sharded"
    files = export(negligible_step, out, dtype="bfloat16", max_shard_bytes=200_000)
    shards = [p.name for p in files if p.suffix == ".safetensors"]
    assert len(shards) > 1 and "model.safetensors" not in shards
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == sorted(shards)
    for name in shards:
        with safe_open(out / name, "pt") as f:
            assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    original, exported = logits(tiny_llama, IDS, exported=False), logits(out, IDS)
    assert 0 < (exported - original).abs().max() < 0.05  # bf16 rounding only


def test_a_bf16_checkpoint_exports_in_bf16_unless_dtype_says_otherwise(tiny_llama, tmp_path):
    bf16 = {"dtype": "bfloat16", "mixed_precision_param": "bfloat16", "steps": 1}
    with single_rank():
        train(hf_job(tmp_path / "run", tiny_llama, training=bf16, optimizer={"lr": 1e-12}))
    step = tmp_path / "run" / "checkpoint" / "step-1"
    for dtype, stored in ((None, "BF16"), ("float32", "F32")):
        out = tmp_path / f"export-{dtype}"
        args = ["--checkpoint", str(step), "--out", str(out)] + (["--dtype", dtype] if dtype else [])
        assert export_main(args) == 0
        with safe_open(out / "model.safetensors", "pt") as f:
            assert {f.get_slice(k).get_dtype() for k in f.keys()} == {stored}
        assert json.loads((out / "config.json").read_text())["torch_dtype"] == (dtype or "bfloat16")
        difference = logits(out, IDS) - logits(tiny_llama, IDS, exported=False)
        assert difference.abs().max() < 0.05  # the weights, rounded to bf16


def test_export_without_the_jobs_tokenizer_says_so(negligible_step, tmp_path, caplog):
    copy = tmp_path / "step-1"
    shutil.copytree(negligible_step, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["model"]["tokenizer"] = str(tmp_path / "moved" / "tokenizer.json")
    (copy / "manifest.json").write_text(json.dumps(manifest))
    manifest["model"]["hf_folder"] = str(tmp_path / "moved")
    (copy / "manifest.json").write_text(json.dumps(manifest))
    files = export(copy, tmp_path / "out")
    assert sorted(p.name for p in files) == ["config.json", "generation_config.json", "model.safetensors"]
    assert "no longer exists: exported without it" in caplog.text
    assert "no longer exists: exported without its tokenizer-side files" in caplog.text
    # Written anew from config.json's ids, which the base model's config.json carried over.
    assert json.loads((tmp_path / "out" / "generation_config.json").read_text()) == {"bos_token_id": 0,
                                                                                   "eos_token_id": 1}  # fmt: skip
    load_export(tmp_path / "out")


@pytest.mark.parametrize("change, named", [
    ("no record", "does not record the model"),
    ("no manifest", "is not a complete FlashCP checkpoint (no manifest.json)"),
    ("manifest a list", "step-1 is damaged: manifest.json: malformed (a JSON list, not an object)"),
    ("entry without size", "step-1 is damaged: manifest.json: malformed (files[0] .metadata: size = None is not"),
    ("tokenizer a number", "manifest.json: model.tokenizer = 3 is not a path"),
    ("unfinished", "step-1.partial-0123456789ab is an unfinished save (never published)"),
    ("unfinished, no manifest", "step-1.partial-0123456789ab is an unfinished save (never published)"),
    ("not a step folder", "my-checkpoint is not a published checkpoint folder (step-N"),
])  # fmt: skip
def test_export_names_a_checkpoint_it_cannot_read_the_model_of(negligible_step, tmp_path, capsys, change,
                                                               named):  # fmt: skip
    names = {"unfinished": "step-1.partial-0123456789ab", "not a step folder": "my-checkpoint"}
    copy = tmp_path / names.get(change.removesuffix(", no manifest"), "step-1")
    shutil.copytree(negligible_step, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    if change.endswith("no manifest"):
        (copy / "manifest.json").unlink()
    elif change == "no record":
        del manifest["model"]
    elif change == "manifest a list":
        manifest = [manifest]
    elif change == "entry without size":
        del manifest["files"][0]["size"]
    elif change == "tokenizer a number":
        manifest["model"]["tokenizer"] = 3
    if (copy / "manifest.json").exists():
        (copy / "manifest.json").write_text(json.dumps(manifest))
    before = sorted(p.name for p in copy.iterdir())
    assert export_main(["--checkpoint", str(copy), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and named in err, err
    assert not (tmp_path / "out").exists() and sorted(p.name for p in copy.iterdir()) == before


def _target(tmp_path: Path, kind: str) -> Path:
    """An --out the export must refuse, beside something already saved."""
    (tmp_path / "saved").mkdir()
    (tmp_path / "saved" / "keep.txt").write_text("mine")
    if kind == "symlink":
        (tmp_path / "link").symlink_to(tmp_path / "saved" / "empty", target_is_directory=True)
        (tmp_path / "saved" / "empty").mkdir()
        return tmp_path / "link"
    if kind == "dangling symlink":
        (tmp_path / "link").symlink_to(tmp_path / "nowhere")
        return tmp_path / "link"
    if kind == "read-only":  # a file system no one may write, also root (who passes permission bits)
        return Path("/proc/flashcp-export")
    return {"non-empty": tmp_path / "saved", "a file": tmp_path / "saved" / "keep.txt",
            "in a file": tmp_path / "saved" / "keep.txt" / "out"}[kind]  # fmt: skip


@pytest.mark.parametrize("kind, named", [
    ("non-empty", "is not empty: refusing to write there"),
    ("a file", "exists and is not a folder: refusing"),
    ("in a file", "keep.txt is not a folder"),
    ("symlink", "is a symbolic link: refusing"),
    ("dangling symlink", "is a symbolic link to nothing: refusing"),
    ("read-only", "/proc/flashcp-export"),
])  # fmt: skip
def test_export_refuses_every_bad_output_path_and_touches_nothing(negligible_step, tmp_path, capsys, kind,
                                                                   named):  # fmt: skip
    out = _target(tmp_path, kind)
    before = sorted((str(p), p.is_symlink()) for p in tmp_path.rglob("*"))
    assert export_main(["--checkpoint", str(negligible_step), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and named in err, err
    assert sorted((str(p), p.is_symlink()) for p in tmp_path.rglob("*")) == before
    assert (tmp_path / "saved" / "keep.txt").read_text() == "mine"


def test_export_names_a_damaged_checkpoint(negligible_step, tmp_path, capsys):
    copy = tmp_path / "step-1"
    shutil.copytree(negligible_step, copy)
    data = next(copy.glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    assert export_main(["--checkpoint", str(copy), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{data.name}: contents changed since the save" in err
    assert not (tmp_path / "out").exists()


class _Exploit:
    def __reduce__(self):
        return (print, ("ran code from the checkpoint",))


def test_export_runs_no_code_from_a_crafted_checkpoint(negligible_step, tmp_path, capsys):
    """A .metadata pickle that would call a function, with a manifest made to match: refused, not run."""
    copy = tmp_path / "step-1"
    shutil.copytree(negligible_step, copy)
    (copy / ".metadata").write_bytes(pickle.dumps(_Exploit()))
    manifest = json.loads((copy / "manifest.json").read_text())
    entry = next(e for e in manifest["files"] if e["name"] == ".metadata")
    entry |= {"size": (copy / ".metadata").stat().st_size, "checksum": checksum(copy / ".metadata")}
    (copy / "manifest.json").write_text(json.dumps(manifest))
    assert export_main(["--checkpoint", str(copy), "--out", str(tmp_path / "out")]) == 2
    captured = capsys.readouterr()
    assert "ran code" not in captured.out and "refused, nothing of it was run" in captured.err
    assert captured.err.count("\n") == 1 and not (tmp_path / "out").exists()


def _broken(tiny_llama: Path, tmp_path: Path, how: str) -> Path:
    folder = tmp_path / how
    shutil.copytree(tiny_llama, folder)
    config = json.loads((folder / "config.json").read_text())
    if how == "missing":
        (folder / "model.safetensors").unlink()
    elif how == "pickle":
        (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    elif how == "truncated":
        data = (folder / "model.safetensors").read_bytes()
        (folder / "model.safetensors").write_bytes(data[:-100])
    elif how == "shape":  # config.json says a narrower feed-forward than the weights hold
        (folder / "config.json").write_text(json.dumps(config | {"intermediate_size": 64}))
    elif how == "model_type":
        (folder / "config.json").write_text(json.dumps(config | {"model_type": "mixtral"}))
    elif how == "shard":
        (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
        index = {"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors",
                                "lm_head.weight": "model-00002-of-00002.safetensors"}}  # fmt: skip
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    elif how in ("header list", "offsets"):  # the header replaced, the data left as it is
        data = (folder / "model.safetensors").read_bytes()
        header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
        header["model.norm.weight"]["data_offsets"][0] += 4
        raw = json.dumps(list(header) if how == "header list" else header).encode()
        (folder / "model.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + len(raw) :])
    elif how == "index of ints":
        (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
        index = {"weight_map": {"model.norm.weight": 1}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    elif how == "nan":
        tensors = load_file(folder / "model.safetensors")
        tensors["model.layers.1.mlp.up_proj.weight"][5, 7] = float("nan")
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    elif how in ("rope_theta", "rms_norm_eps"):
        (folder / "config.json").write_text(json.dumps(config | {how: float("inf")}))
    return folder


@pytest.mark.parametrize("how, named", [
    ("missing", "no model.safetensors or model.safetensors.index.json"),
    ("pickle", "pytorch_model.bin is a pickle, which can run code: refused"),
    ("truncated", "truncated or damaged"),
    ("shape", "model.layers.0.mlp.gate_proj.weight is [96, 32] in model.safetensors, "
              "the model needs [64, 32] (and 5 more)"),
    ("model_type", "model_type 'mixtral' is not supported"),
    ("shard", "model-00002-of-00002.safetensors is missing (listed in model.safetensors.index.json)"),
    ("header list", "model.safetensors: the safetensors header is a JSON list, not an object"),
    ("offsets", "model.safetensors: tensor model.norm.weight in the header has 124 bytes of data, its "
                "shape [32] of F32 needs 128"),
    ("index of ints", "model.safetensors.index.json: weight_map['model.norm.weight'] = 1 is not a "
                      ".safetensors file name"),
    ("nan", "model.safetensors: tensor model.layers.1.mlp.up_proj.weight holds NaN or inf values"),
    ("rope_theta", "config.json: rope_theta = inf is not a finite number"),
    ("rms_norm_eps", "config.json: rms_norm_eps = inf is not a finite number"),
])  # fmt: skip
def test_a_bad_hf_folder_is_one_line_before_launch(tiny_llama, tmp_path, how, named):
    folder = _broken(tiny_llama, tmp_path, how)
    with pytest.raises(ConfigError) as e:
        check_inputs(hf_job(tmp_path / "out", folder))
    assert named in str(e.value) and "\n" not in str(e.value)
    assert str(e.value).startswith("[") and str(folder) in str(e.value)


def test_quantized_hf_weights_are_refused_by_the_config_check(tiny_llama, tmp_path):
    with pytest.raises(ConfigError, match=r"initial_load_in_hf_quantized: quantized .* not supported"):
        hf_job(tmp_path, tiny_llama, checkpoint={"initial_load_in_hf_quantized": True})


def test_a_folder_damaged_after_launch_is_refused_at_load(tiny_llama, tmp_path):
    """The checkpointer checks the headers again: the ranks never read a truncated file."""
    cfg = hf_job(tmp_path / "out", tiny_llama)
    folder = _broken(tiny_llama, tmp_path, "truncated")
    cfg["checkpoint"]["initial_load_path"] = str(folder)
    with single_rank(), pytest.raises(CheckpointError, match="truncated or damaged"):
        train(cfg)
