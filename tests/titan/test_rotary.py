"""RoPE from the step's rows (flashcp.titan.models.rotary) is TorchTitan's RoPE: the rows equal its
table's at the same positions, and a model with table-less layers gives the logits and gradients of
the same model with TorchTitan's per-layer tables (llama3 and yarn scaling, Llama 3 and Qwen3,
packed documents), with the same state_dict keys (the table was never a checkpointed buffer)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import flashcp.titan  # noqa: F401  (TorchTitan shims before torchtitan)
from flashcp.dispatch import build_dispatch
from flashcp.plan import plan_shards
from flashcp.titan.config import validate
from flashcp.titan.models.attention import CPStep, flashcp_ropes
from flashcp.titan.models.rotary import rotation, StepComplexRoPE, StepCosSinRoPE
from flashcp.titan.models.spec import model_spec
from torchtitan.models.common.rope import ComplexRoPE, CosSinRoPE

TOLERANCE = 1e-7  # absolute, fp32; measured: 0 (the same operations on the same values)
DOC_LENS = (40, 7, 60, 21)  # one packed window; positions restart at each document
WINDOW = sum(DOC_LENS)
SCALED = {"rope_factor": 4.0, "rope_original_max_position_embeddings": 16}
MODELS = {  # name -> [model] keys (custom sizes; head_dim 16)
    "llama3-llama3": {"name": "llama3", "rope_scaling": "llama3"} | SCALED,
    "llama3-yarn": {"name": "llama3", "rope_scaling": "yarn"} | SCALED,
    "qwen3-none": {"name": "qwen3"},
    "qwen3-yarn": {"name": "qwen3", "rope_scaling": "yarn"} | SCALED,
}
TITAN_CLASS = {StepComplexRoPE.Config: ComplexRoPE.Config, StepCosSinRoPE.Config: CosSinRoPE.Config}


def _configs(keys: dict) -> tuple:
    """(our model config, the same with TorchTitan's RoPE tables in every layer)."""
    model = {"flavor": "custom", "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "multiple_of": 32,
             "vocab_size": 97} | keys  # fmt: skip
    cfg = validate({"model": model, "flashcp": {"backend": "reference"}, "training": {"seq_len": WINDOW}})
    ours = model_spec(cfg["model"], cfg["flashcp"], 97, WINDOW).model
    titan = copy.deepcopy(ours)
    for layer in titan.layers:
        rope = layer.attention.rope
        layer.attention.rope = TITAN_CLASS[type(rope)](**{f.name: getattr(rope, f.name) for f in dataclasses.fields(rope)})
        layer.attention.inner_attention.rope = None  # q and k arrive rotated, as before
    return ours, titan


@pytest.mark.parametrize("name", MODELS)
def test_step_rows_are_torchtitans_table_rows(name):
    ours, titan = _configs(MODELS[name])
    rope = titan.layers[0].attention.rope
    positions = torch.tensor([0, 5, 1, WINDOW - 1, 3, 3, 17])
    table = rope.build().cache
    assert (rotation(rope, positions) - table[positions]).abs().max().item() <= TOLERANCE
    assert (rotation(ours.layers[0].attention.rope, torch.arange(WINDOW)) - table).abs().max().item() <= TOLERANCE


def _run(config, tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor], set[str]]:
    torch.manual_seed(0)
    model = config.build()
    model.init_states()
    dispatch = build_dispatch(plan_shards(DOC_LENS, 1, "per_seq"), 0, "compact")
    logits = model(tokens[None], positions=dispatch.positions[None], attention_masks=CPStep.of(flashcp_ropes(model), dispatch, None))
    logits.square().mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return logits.detach(), grads, set(model.state_dict())


@pytest.mark.parametrize("name", MODELS)
def test_logits_and_gradients_equal_torchtitans_tables(name):
    ours, titan = _configs(MODELS[name])
    tokens = torch.randint(0, 97, (WINDOW,), generator=torch.Generator().manual_seed(1))
    logits, grads, keys = _run(ours, tokens)
    ref_logits, ref_grads, ref_keys = _run(titan, tokens)
    assert keys == ref_keys  # checkpoints: the same state_dict, no table in either
    assert not any("rope" in k for k in keys)
    assert (logits - ref_logits).abs().max().item() <= TOLERANCE
    assert max((grads[n] - ref_grads[n]).abs().max().item() for n in grads) <= TOLERANCE
