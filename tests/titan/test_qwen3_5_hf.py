"""Qwen3.5 text folders (`Qwen3_5ForCausalLM`, `model.*`) imported into FlashCP's trainer and mapped back.

- Names: FlashCP's adapter maps transformers' names as test_gdn_oracle's mapping does (proven there
  against transformers), and back; a tied folder stores the embedding only.
- Import: a tiny transformers Qwen3.5 (train_configs/hf/tiny_qwen3_5's config: 3 Gated DeltaNet
  layers, 1 full), saved by `save_pretrained`, is imported (`initial_load_in_hf`) on 1 rank and on
  2 gloo ranks (CP 2, FSDP over them): the first step's loss agrees to TOLERANCE and every gradient
  to GRAD_TOLERANCE.
- Back: the imported checkpoint exported (`python -m flashcp.titan.export`) is a qwen3_5_text folder
  transformers loads, with the original's keys and logits (fp32, one document at a time: transformers'
  torch Gated DeltaNet ignores packing).
- A folder with a tensor missing or reshaped is refused on every rank in one line naming the key.
- A vision-language folder (`model.language_model.*`, `model.visual.*`) is refused before launch.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the test extra (pip install -e .[test]) provides transformers")
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig  # noqa: E402
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM  # noqa: E402

from titan.harness import load_export, single_rank, tiny_job, train  # noqa: E402
from titan.test_hf_import_ranks import _refusal, first_step, import_job  # noqa: E402
from titan.test_gdn_layer import torch_kernels  # noqa: E402
from titan.test_gdn_oracle import CONFIG as ORACLE_CONFIG, hf_model, to_titan  # noqa: E402
from titan.test_hybrid_train import GATE  # noqa: E402

from flashcp.titan.config import ConfigError  # noqa: E402
from flashcp.titan.launch.preflight import check_inputs  # noqa: E402
from flashcp.titan.models.decoders import state_dict_adapter  # noqa: E402
from flashcp.titan.models.gated_deltanet import qwen3_5_text_config  # noqa: E402

TINY = Path(__file__).resolve().parents[2] / "train_configs/hf/tiny_qwen3_5"
TOLERANCE = 1e-6  # relative, on the loss
# Each gradient's |difference| / |one-rank gradient| (norms, the decay gate's at its block's: `_scales`).
# float32: CP 2 sums a gradient's per-token terms in another order (measured 1.2e-6 on a conv weight);
# test_gdn_oracle checks the same mapping and CP 2 in float64 to 1e-10.
GRAD_TOLERANCE = 1e-5
LOGITS_TOLERANCE = 1e-5  # max |ours - original| / max |original|, fp32
DOC_LENS = (1, 3, 17, 40)  # a 1-token document, one shorter than the conv width


def _job(dump: Path, hf: Path, **parallelism: int) -> dict:
    """test_hf_import_ranks' one-step import, at lr 1e-12 so the saved step-1 holds the folder's weights."""
    cfg = import_job(dump, hf, **parallelism)
    cfg["optimizer"]["lr"] = 1e-12
    return cfg


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> tuple[Path, Qwen3_5ForCausalLM, Path, float, dict[str, torch.Tensor]]:
    """The tiny folder, its transformers model, the one-rank import's step-1 checkpoint, loss and gradients."""
    root = tmp_path_factory.mktemp("qwen3_5")
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig.from_pretrained(TINY)).eval()
    with torch.no_grad():
        for p in model.parameters():  # off every initial value (zero norms, ones, A_log's range)
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(root / "hf")
    grads: dict[str, torch.Tensor] = {}
    with single_rank():
        losses = train(_job(root / "cp1", root / "hf"), first_grads=grads)
    assert any(name.endswith("A_log") for name in grads) and any("attn.wq" in name for name in grads)
    return root / "hf", model, root / "cp1/checkpoint/step-1", losses[1], grads


@pytest.mark.parametrize("tied", [False, True])
def test_the_adapter_maps_transformers_names_as_the_oracle_does(tied):
    """test_gdn_oracle's mapping (TorchTitan's VLM adapter under `model.language_model.`), proven against
    transformers in float64, and back; a tied folder stores the embedding only."""
    hf = hf_model().state_dict()
    config = qwen3_5_text_config(ORACLE_CONFIG.to_dict() | {"tie_word_embeddings": tied}, max_seq_len=32)
    adapter = state_dict_adapter(config)
    folder = {k: v for k, v in hf.items() if not (tied and k == "lm_head.weight")}
    ours, expected = adapter.from_hf(folder), to_titan(hf)
    if tied:
        expected["lm_head.weight"] = expected["tok_embeddings.weight"]
    assert ours.keys() == expected.keys() and all(torch.equal(v, expected[k]) for k, v in ours.items())
    back = adapter.to_hf(ours)
    assert back.keys() == folder.keys() and all(torch.equal(v, folder[k]) for k, v in back.items())


def _scales(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What each gradient's difference is measured against: its norm, or for the decay gate's nearly
    cancelling ones (test_hybrid_train's GATE: float32 rounds them at the scale of their terms) the
    norm of their block's (`layers.i`) whole gradient."""
    blocks: dict[str, torch.Tensor] = {}
    for name, grad in grads.items():
        block = ".".join(name.split(".")[:2])
        blocks[block] = blocks.get(block, torch.zeros(())) + grad.square().sum()
    return {name: blocks[".".join(name.split(".")[:2])].sqrt() if name.endswith(GATE) else grad.norm()
            for name, grad in grads.items()}  # fmt: skip


def test_import_on_two_ranks_gives_the_one_rank_step(imported, gloo_pool, tmp_path):
    hf, _, _, loss, grads = imported
    runs = gloo_pool(2).run(first_step, (_job(tmp_path, hf, context_parallel_degree=2),))
    check_first_steps(runs, loss, grads, "CP 2")


def check_first_steps(runs: list, loss: float, grads: dict[str, torch.Tensor], what: str) -> None:
    """Every rank's (loss, gradients) of its first step against the one-rank import's."""
    scales = _scales(grads)
    for rank, (rank_loss, rank_grads) in enumerate(runs):
        assert rank_grads.keys() == grads.keys()
        gaps = {name: float((rank_grads[name] - ref).norm() / scales[name]) for name, ref in grads.items()}
        worst = max(gaps, key=gaps.get)
        print(f"{what} rank {rank}: loss {rank_loss!r} vs {loss!r}, worst gradient {worst} {gaps[worst]:.1e}")
        assert abs(rank_loss - loss) <= TOLERANCE * abs(loss), f"{what} rank {rank}: loss {rank_loss} vs {loss}"
        assert gaps[worst] <= GRAD_TOLERANCE, f"{what} rank {rank}: {worst}'s gradient off by {gaps[worst]:.1e}"


def test_the_export_of_the_import_gives_transformers_logits(imported, tmp_path):
    """`python -m flashcp.titan.export` of the imported step-1: a qwen3_5_text folder transformers
    loads, holding the folder's keys, with the original's logits."""
    from flashcp.titan.export import main as export_main

    hf, original, step, _, _ = imported
    out = tmp_path / "export"
    assert export_main(["--checkpoint", str(step), "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_text" and config["architectures"] == ["Qwen3_5ForCausalLM"]
    assert config["layer_types"] == original.config.layer_types
    assert load_file(out / "model.safetensors").keys() == load_file(hf / "model.safetensors").keys()
    exported = load_export(out)
    ids = torch.randint(0, original.config.vocab_size, (sum(DOC_LENS),), generator=torch.Generator().manual_seed(0))
    worst = 0.0
    with torch.no_grad(), torch_kernels():  # transformers' torch Gated DeltaNet, also where fla is installed
        for doc in ids.split(DOC_LENS):
            reference, ours = original(doc[None]).logits, exported(doc[None]).logits
            worst = max(worst, float((ours - reference).abs().max() / reference.abs().max()))
    print(f"import -> export -> transformers: logits off by {worst:.1e} (relative)")
    assert worst <= LOGITS_TOLERANCE


@pytest.mark.parametrize("change", ["missing", "reshaped"])
def test_a_folder_that_does_not_fit_is_refused_on_every_rank(imported, gloo_pool, tmp_path, change):
    hf = imported[0]
    key = "model.layers.0.linear_attn.in_proj_qkv.weight"  # fused in the folder, split in FlashCP's model
    (tmp_path / "hf").mkdir()
    for f in hf.iterdir():
        (tmp_path / "hf" / f.name).write_bytes(f.read_bytes())
    tensors = load_file(hf / "model.safetensors")
    if change == "missing":
        del tensors[key]
    else:
        tensors[key] = tensors[key][:, :-1].contiguous()
    save_file(tensors, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    cfg = import_job(tmp_path / "run", tmp_path / "hf", context_parallel_degree=2)
    with pytest.raises(ConfigError) as before_launch:
        check_inputs(cfg)
    assert key in str(before_launch.value) and "\n" not in str(before_launch.value), str(before_launch.value)
    for rank, line in enumerate(gloo_pool(2).run(_refusal, (cfg,))):
        assert key in line and "\n" not in line, f"rank {rank}: {line}"


def test_a_vision_language_folder_is_refused_in_one_line(imported, tmp_path):
    folder = tmp_path / "vlm"
    folder.mkdir()
    config = json.loads((imported[0] / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"architectures": ["Qwen3_5ForConditionalGeneration"]}))
    checkpoint = {"enable": True, "initial_load_path": str(folder), "initial_load_in_hf": True}
    with pytest.raises(ConfigError) as e:  # the architecture from a text config, the weights from the folder
        tiny_job(tmp_path / "run", ("model",), model={"hf_config": str(TINY)}, checkpoint=checkpoint)
    line = str(e.value)
    assert "\n" not in line and "vision-language" in line and "model.language_model.*" in line, line
