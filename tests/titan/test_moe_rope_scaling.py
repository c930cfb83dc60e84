"""Qwen3 with Llama 3.1's RoPE scaling: a qwen3_moe (and a dense qwen3) config.json whose
`rope_scaling` is llama3, which transformers runs, trains in FlashCP as transformers computes it.

TorchTitan's cos / sin RoPE (Qwen3's) has no llama3 scaling; FlashCP's rotation rows
(`flashcp.titan.models.rotary.inverse_frequencies`) compute its wavelength bands for both RoPE
formats, and `ScaledCosSinRoPE` gives a table from them wherever a model holds one. Tiny random
models are built by transformers and compared as `test_hf_oracle` compares the others: logits and
gradients on one packed window to RELATIVE_TOLERANCE, every router choosing the same experts, at
CP = 1 and (the MoE) CP = 2 with and without expert parallelism. The control: transformers' own
logits without the scaling are far from those with it, so a model ignoring it fails.
"""

from __future__ import annotations

import pytest
import torch

from flashcp.plan import plan_shards
from flashcp.titan.config import validate
from flashcp.titan.hf.config import read_hf_config
from flashcp.titan.models.decoders import titan_rope
from flashcp.titan.models.spec import model_spec

from tests.titan.test_hf_oracle import (
    _relative, check, COMMON, DOC_LENS, LLAMA3_SCALING, reference, RELATIVE_TOLERANCE, ROUTE_MARGIN,
    run_window, transformers, VOCAB, WINDOW,
)  # fmt: skip

QWEN3 = COMMON | {"head_dim": 32, "rms_norm_eps": 1e-6, "rope_parameters": LLAMA3_SCALING}
MODELS = {  # name -> (transformers config class, its arguments)
    "qwen3-moe-llama3": ("Qwen3MoeConfig", QWEN3 | {"moe_intermediate_size": 32, "num_experts": 8,
                                                     "num_experts_per_tok": 2, "norm_topk_prob": True}),
    "qwen3-llama3": ("Qwen3Config", QWEN3),
}  # fmt: skip


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    tokens = torch.randint(0, VOCAB, (WINDOW,), generator=torch.Generator().manual_seed(0))
    return {name: reference(tmp_path_factory.mktemp(name), config_class, kwargs, tokens)
            for name, (config_class, kwargs) in MODELS.items()}  # fmt: skip


def test_the_job_trains_the_folders_llama3_scaling(models):
    folder, _ = models["qwen3-moe-llama3"]
    cfg = validate({"model": {"hf_config": str(folder)}, "training": {"seq_len": WINDOW}})
    rope = model_spec(cfg["model"], cfg["flashcp"], VOCAB, WINDOW).model.first_attention.rope
    assert (rope.scaling, rope.scaling_factor, rope.original_max_position_embeddings) == ("llama", 8.0, 16)


def test_the_scaling_moves_transformers_logits(models):
    for name, (folder, ref) in models.items():
        config = transformers.AutoConfig.from_pretrained(folder)
        config.rope_parameters = {"rope_type": "default", "rope_theta": LLAMA3_SCALING["rope_theta"]}
        plain = transformers.AutoModelForCausalLM.from_pretrained(folder, config=config,
                                                                  attn_implementation="eager")  # fmt: skip
        logits = torch.cat([plain(input_ids=doc[None]).logits[0] for doc in ref["tokens"].split(DOC_LENS)])
        assert _relative(logits.detach(), ref["logits"]) > 100 * RELATIVE_TOLERANCE, name


@pytest.mark.parametrize("name", MODELS)
def test_cp1_matches_transformers(models, name):
    folder, ref = models[name]
    plan = plan_shards(DOC_LENS, 1, "per_seq")
    check([run_window(0, None, folder, ref["tokens"], plan, "compact")], ref, f"{name} CP=1")


def test_the_rope_table_is_transformers_cos_sin(models):
    """The table a model holds where it builds one (TorchTitan's own attention, the pre-launch check of
    an HF folder, the export): transformers' cos | sin rows of the same config.json."""
    folder, _ = models["qwen3-llama3"]
    config = transformers.AutoConfig.from_pretrained(folder)
    rotary = transformers.models.qwen3.modeling_qwen3.Qwen3RotaryEmbedding(config)
    cos, sin = rotary(torch.zeros(1), torch.arange(WINDOW)[None])
    table = titan_rope(read_hf_config(folder), WINDOW).build().cache
    assert (table - torch.cat([cos[0], sin[0]], dim=-1)).abs().max().item() <= 1e-6


def test_moe_at_cp2_matches_transformers_with_and_without_ep(models, gloo_pool):
    folder, ref = models["qwen3-moe-llama3"]
    assert ref["margin"] > ROUTE_MARGIN, f"a near-tie in the routers (gap {ref['margin']:.2e})"
    plan = plan_shards(DOC_LENS, 2, "flashcp")
    for ep in (1, 2):
        parts = gloo_pool(2).run(run_window, (folder, ref["tokens"], plan, "compact", DOC_LENS, 1, ep))
        check(parts, ref, f"qwen3-moe-llama3 CP=2 EP={ep}")
