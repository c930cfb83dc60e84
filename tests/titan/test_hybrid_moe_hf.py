"""Qwen3.5-MoE text (`Qwen3_5MoeForCausalLM`) and Qwen3-Next (`Qwen3NextForCausalLM`) folders in and out of FlashCP.

- config.json: each kind reads into the Architecture it writes back (Qwen3-Next's layer kinds also
  from full_attention_interval); what TorchTitan's Qwen3.5 MoE builder cannot lay out (dense layers
  among the experts: mlp_only_layers, decoder_sparse_step; a layer pattern it does not build) is
  refused in one line naming the key.
- Weights: the adapter's import and export are inverse and bit-exact (Qwen3-Next's fused in_proj_qkvz /
  in_proj_ba split per key-head group and fused back); that the split is transformers' own is proven by
  test_gdn_moe_oracle (logits and gradients equal in float64).
- Import: an unmodified `scripts/make_tiny_hf.py` folder of each kind (`initial_load_in_hf`) on 4 gloo
  ranks, FSDP 2 x CP 2 with EP 2 and with EP 1, gives the one-rank import's first-step loss
  (TOLERANCE) and every gradient (test_qwen3_5_hf's GRAD_TOLERANCE at its scales: float32 sums the
  linear layers' terms in another order at CP 2; measured 4.3e-7 at worst, a shared expert's gate).
- Export: the imported checkpoint exported is a folder of the same kind that transformers loads, with
  the folder's keys and the original's logits (fp32, one document at a time).
- A multi-token-prediction head (`mtp.*`, in the released folders) is left unread, as transformers does.
- Refusals, on every rank in one line: an expert too many, one missing, one reshaped (naming the key,
  test_hf_import_ranks' crafted folders), and a folder whose layer holds another kind's weights than
  config.json's layer_types say (naming the layer), also before launch.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the test extra (pip install -e .[test]) provides transformers")
import transformers  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from scripts.make_tiny_hf import make_tiny_hf, tiny_config  # noqa: E402
from titan.harness import load_export, single_rank, train  # noqa: E402
from titan.test_gdn_layer import torch_kernels  # noqa: E402
from titan.test_hf_import_ranks import _refusal, _rewrite, first_step, import_job, LAYOUTS  # noqa: E402
from titan.test_hf_oracle import _per_expert  # noqa: E402
from titan.test_qwen3_5_hf import _job, check_first_steps, DOC_LENS, LOGITS_TOLERANCE  # noqa: E402

from flashcp.titan.config import ConfigError  # noqa: E402
from flashcp.titan.hf.config import architecture_from_hf, HFConfigError, to_hf_config  # noqa: E402
from flashcp.titan.launch.preflight import check_inputs  # noqa: E402
from flashcp.titan.models.decoders import state_dict_adapter  # noqa: E402
from flashcp.titan.models.gated_deltanet import qwen3_5_text_config  # noqa: E402

KINDS = {"qwen3_5_moe_text": "Qwen3_5MoeForCausalLM", "qwen3_next": "Qwen3NextForCausalLM"}
MODELING = {"qwen3_5_moe_text": transformers.models.qwen3_5_moe.modeling_qwen3_5_moe,
            "qwen3_next": transformers.models.qwen3_next.modeling_qwen3_next}  # fmt: skip


@pytest.fixture(scope="module", params=sorted(KINDS))
def folder(request, tmp_path_factory) -> Path:
    """The tiny folder of the kind, as `scripts/make_tiny_hf.py` writes it."""
    return make_tiny_hf(tmp_path_factory.mktemp(request.param) / "hf", model_type=request.param)


def _config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def test_config_json_reads_into_what_it_writes(folder):
    hf = _config(folder)
    arch = architecture_from_hf(hf)
    written = to_hf_config(arch, torch_dtype="float32", base=hf)
    assert written["model_type"] == hf["model_type"] and written["architectures"] == [KINDS[hf["model_type"]]]
    assert architecture_from_hf(written) == arch and arch.experts.gated_shared_dim == 24
    assert transformers.AutoConfig.for_model(**written).layer_types == hf["layer_types"]


def test_qwen3_next_layer_kinds_come_from_the_interval_too():
    hf = tiny_config("qwen3_next").to_dict()
    interval = {k: v for k, v in hf.items() if k != "layer_types"}
    assert architecture_from_hf(interval | {"full_attention_interval": 4}) == architecture_from_hf(hf)
    every_other = architecture_from_hf(interval | {"full_attention_interval": 2}).layer_types
    assert every_other == ("linear_attention", "full_attention") * 2


def test_a_transformers_4_qwen3_next_config_reads_as_transformers_reads_it():
    """The released layout: RoPE at the top level, the layer kinds by interval, no partial_rotary_factor
    (transformers' default 0.25)."""
    hf = tiny_config("qwen3_next").to_dict()
    released = {k: v for k, v in hf.items() if k not in ("layer_types", "rope_parameters")} | {
        "rope_theta": 1e7, "full_attention_interval": 2}  # fmt: skip
    theirs = transformers.Qwen3NextConfig(**{k: v for k, v in released.items() if k != "model_type"})
    arch = architecture_from_hf(released)
    assert arch.layer_types == tuple(theirs.layer_types) and arch.rope.theta == theirs.rope_parameters["rope_theta"]
    assert arch.hybrid.rotary_dim == int(theirs.head_dim * theirs.rope_parameters["partial_rotary_factor"]) == 2


GENERAL = [
    ({"layer_types": ["linear_attention", "full_attention", "linear_attention", "linear_attention"]},
     r"layer_types .*: TorchTitan's builder makes layer i full exactly where"),
    ({"linear_num_value_heads": 3}, r"linear_num_value_heads = 3 is not a multiple of linear_num_key_heads = 2"),
    ({"num_experts_per_tok": 9}, r"num_experts_per_tok = 9 exceeds num_experts = 8"),
]  # fmt: skip
NEXT = [
    ({"mlp_only_layers": [1]}, r"mlp_only_layers = \[1\] puts dense feed-forwards among the experts"),
    ({"decoder_sparse_step": 2}, r"decoder_sparse_step = 2 makes some layers dense"),
    ({"layer_types": None, "full_attention_interval": 0}, r"full_attention_interval must be a positive integer"),
]  # fmt: skip


@pytest.mark.parametrize("kind, change, message", [(kind, *case) for kind in KINDS for case in GENERAL]
                         + [("qwen3_next", *case) for case in NEXT])  # fmt: skip
def test_what_flashcp_cannot_build_is_refused_in_one_line(kind, change, message):
    with pytest.raises(HFConfigError, match=r"^x\.json: " + message) as e:
        architecture_from_hf(tiny_config(kind).to_dict() | change, where="x.json")
    assert "\n" not in str(e.value)


def test_the_adapter_round_trip_is_bit_exact(folder):
    hf = _per_expert(transformers.AutoModelForCausalLM.from_pretrained(folder).state_dict())
    adapter = state_dict_adapter(qwen3_5_text_config(_config(folder), max_seq_len=64))
    titan = adapter.from_hf(dict(hf))
    assert not any("in_proj_qkvz" in k or "experts.0." in k for k in titan)
    back = adapter.to_hf(titan)
    assert back.keys() == hf.keys() and all(torch.equal(back[k], v) for k, v in hf.items())


@pytest.fixture(scope="module")
def imported(folder, tmp_path_factory) -> tuple[Path, Path, float, dict[str, torch.Tensor]]:
    """The folder, its one-rank import's step-1 checkpoint (lr 1e-12: the folder's weights), loss and gradients."""
    root = tmp_path_factory.mktemp("import")
    grads: dict[str, torch.Tensor] = {}
    with single_rank():
        losses = train(_job(root / "cp1", folder), first_grads=grads)
    assert any("experts" in name for name in grads) and any(name.endswith("A_log") for name in grads)
    return folder, root / "cp1/checkpoint/step-1", losses[1], grads


@pytest.mark.parametrize("layout", ["fsdp2-cp2-ep2", pytest.param("fsdp2-cp2-ep1", marks=pytest.mark.slow)])
def test_import_on_four_ranks_gives_the_one_rank_step(imported, gloo_pool, tmp_path, layout):
    folder, _, loss, grads = imported
    runs = gloo_pool(4).run(first_step, (_job(tmp_path, folder, **LAYOUTS[layout]),))
    check_first_steps(runs, loss, grads, f"{folder.parent.name} {layout}")


def test_the_export_of_the_import_gives_transformers_logits(imported, tmp_path):
    from flashcp.titan.export import main as export_main

    folder, step, _, _ = imported
    out = tmp_path / "export"
    assert export_main(["--checkpoint", str(step), "--out", str(out)]) == 0
    config, original = _config(out), _config(folder)
    assert (config["model_type"], config["architectures"]) == (original["model_type"], original["architectures"])
    assert load_file(out / "model.safetensors").keys() == load_file(folder / "model.safetensors").keys()
    reference, exported = transformers.AutoModelForCausalLM.from_pretrained(folder), load_export(out)
    ids = torch.randint(0, config["vocab_size"], (sum(DOC_LENS),), generator=torch.Generator().manual_seed(0))
    worst = 0.0
    with torch.no_grad(), torch_kernels(MODELING[config["model_type"]]):
        for doc in ids.split(DOC_LENS):
            theirs, ours = reference(doc[None]).logits, exported(doc[None]).logits
            worst = max(worst, float((ours - theirs).abs().max() / theirs.abs().max()))
    print(f"{config['model_type']} import -> export -> transformers: logits off by {worst:.1e} (relative)")
    assert worst <= LOGITS_TOLERANCE


def test_a_multi_token_prediction_head_is_left_unread(imported, tmp_path):
    """Released Qwen3.5 / Qwen3-Next folders store an `mtp.*` head beside the causal LM, which
    transformers' *ForCausalLM ignores: imported, the folder trains the first step without it."""
    folder, _, loss, _ = imported
    (tmp_path / "hf").mkdir()
    for f in folder.iterdir():
        (tmp_path / "hf" / f.name).write_bytes(f.read_bytes())
    tensors = load_file(folder / "model.safetensors")
    tensors |= {"mtp.fc.weight": torch.ones(32, 64), "mtp.norm.weight": torch.ones(32)}
    save_file(tensors, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    with single_rank():
        assert train(_job(tmp_path / "run", tmp_path / "hf"))[1] == loss


@pytest.mark.parametrize("change", ["extra", "missing", "reshaped"])
@pytest.mark.slow
def test_an_expert_that_does_not_fit_is_refused_on_every_rank(folder, gloo_pool, tmp_path, change):
    named = _rewrite(folder, tmp_path / "hf", change)
    cfg = import_job(tmp_path / "run", tmp_path / "hf", **LAYOUTS["fsdp2-cp2-ep2"])
    for rank, line in enumerate(gloo_pool(4).run(_refusal, (cfg,))):
        assert named in line and "\n" not in line, f"rank {rank}: {line}"


@pytest.mark.slow
def test_a_layer_holding_another_kinds_weights_is_refused_on_every_rank(folder, gloo_pool, tmp_path):
    """Layer 3 is full attention by config.json; the folder holds layer 2's Gated DeltaNet there instead."""
    (tmp_path / "hf").mkdir()
    for f in folder.iterdir():
        (tmp_path / "hf" / f.name).write_bytes(f.read_bytes())
    tensors = {k: v for k, v in load_file(folder / "model.safetensors").items() if ".3.self_attn." not in k}
    tensors |= {k.replace(".2.", ".3.", 1): v.clone() for k, v in tensors.items() if ".2.linear_attn." in k}
    save_file(tensors, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    cfg = import_job(tmp_path / "run", tmp_path / "hf", **LAYOUTS["fsdp2-cp2-ep2"])
    expected = r"layer 3 holds linear_attn weights, but config.json's layer_types makes it full_attention"
    with pytest.raises(ConfigError, match=expected) as before_launch:
        check_inputs(cfg)
    assert "\n" not in str(before_launch.value)
    for rank, line in enumerate(gloo_pool(4).run(_refusal, (cfg,))):
        assert "layer 3 holds linear_attn weights" in line and "\n" not in line, f"rank {rank}: {line}"
