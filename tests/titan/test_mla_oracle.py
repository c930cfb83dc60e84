"""Oracle for DeepSeek-V3 (MLA): transformers' `DeepseekV3ForCausalLM` decides whether FlashCP's is right.

Tiny random models are built locally: 3 layers (the first dense, then MoE layers with a shared
expert, a sigmoid router with a random correction bias and a routed scale), 4 heads, kv_lora_rank
32, a V head (12) other than the QK head (16 + 8), YaRN RoPE with DeepSeek's mscale correction of
the softmax scale; q projected through q_lora_rank 24 ("q-lora") or directly ("q-direct"). Ours is
built from the saved config.json through FlashCP's one build path (TorchTitan's DeepSeek-V3 layers,
`FlashCPLatentAttention` exchanging latent rows) and loaded with TorchTitan's adapter. On one packed
window of documents, a 1-token one among them, ours must give transformers' logits and gradients
(each document alone, fp32) to RELATIVE_TOLERANCE, with the same experts chosen for every token
(`test_hf_oracle.check`).

Matrix (module-scoped models and gloo pools; about a minute on 2 cores): CP = 1 for both models;
CP = 2 and CP = 4 under every planner strategy with the compact exchange for "q-lora"; the needed and
two_level exchanges (nodes of cp / 2 ranks) once each per CP for "q-lora", and one CP = 2
case for "q-direct". Each CP, strategy and exchange is covered at least once.
"""

from __future__ import annotations

import pytest
import torch

from flashcp.plan import plan_shards, STRATEGIES

from tests.titan.test_hf_oracle import check, PLAN_OPTIONS, reference, ROUTE_MARGIN, run_window, transformers, VOCAB

DOC_LENS = (23, 9, 1, 29, 2)  # 64 tokens, a 1-token document among them
COMMON = {
    "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
    "num_hidden_layers": 3, "first_k_dense_replace": 1, "num_attention_heads": 4, "num_key_value_heads": 4,
    "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
    "norm_topk_prob": True, "routed_scaling_factor": 2.5, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
    "initializer_range": 0.2, "num_mtp_layers": 0,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
                        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707},
}  # fmt: skip
MODELS = {"q-lora": COMMON | {"q_lora_rank": 24}, "q-direct": COMMON | {"q_lora_rank": None}}


def _random_bias(model) -> None:
    """The routers' correction bias nonzero, so that choosing by score + bias is tested."""
    g = torch.Generator().manual_seed(1)
    for name, module in model.named_modules():
        if name.endswith("mlp.gate"):
            module.e_score_correction_bias.copy_(0.05 * torch.randn(module.e_score_correction_bias.shape, generator=g))


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    tokens = torch.randint(0, VOCAB, (sum(DOC_LENS),), generator=torch.Generator().manual_seed(0))
    return {name: reference(tmp_path_factory.mktemp(name), "DeepseekV3Config", kwargs, tokens, DOC_LENS, _random_bias)
            for name, kwargs in MODELS.items()}  # fmt: skip


def _run(pool, models, name: str, cp: int, strategy: str, comm: str) -> None:
    folder, ref = models[name]
    plan = plan_shards(DOC_LENS, cp, strategy, **PLAN_OPTIONS.get(strategy, {}))
    if cp == 1:
        parts = [run_window(0, None, folder, ref["tokens"], plan, comm, DOC_LENS)]
    else:
        parts = pool.run(run_window, (folder, ref["tokens"], plan, comm, DOC_LENS, cp // 2), size=cp)
    errors = check(parts, ref, f"{name} CP={cp} {strategy}/{comm}")
    print(f"{name} CP={cp} {strategy}/{comm}: logits {errors[0]:.1e}, gradients {errors[1]:.1e} (relative)")


def test_windows_have_no_router_ties(models):
    """Every MoE window's routing is decided by margins far above float32 rounding (ROUTE_MARGIN)."""
    for name, (_, ref) in models.items():
        assert ref["margin"] > ROUTE_MARGIN, f"{name}: a near-tie in the routers (gap {ref['margin']:.2e})"


@pytest.mark.parametrize("name", MODELS)
def test_cp1_matches_transformers(models, name):
    _run(None, models, name, 1, "per_seq", "compact")


def test_yarn_mscale_and_bias_matter(models):
    """Without the softmax scale's mscale correction or the routers' bias, transformers' own logits move
    far beyond the tolerance: the CP tests compare both, not only the rest of the model."""
    folder, ref = models["q-lora"]
    tokens = ref["tokens"]
    for change in ("mscale", "bias"):
        config = transformers.AutoConfig.from_pretrained(folder)
        if change == "mscale":
            config.rope_parameters = config.rope_parameters | {"mscale_all_dim": 0.0, "mscale": 0.0}
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, config=config, attn_implementation="eager")
        if change == "bias":
            for name, module in model.named_modules():
                if name.endswith("mlp.gate"):
                    module.e_score_correction_bias.zero_()
        logits = torch.cat([model(input_ids=doc[None]).logits[0] for doc in tokens.split(list(DOC_LENS))]).detach()
        assert ((logits - ref["logits"]).abs().max() / ref["logits"].abs().max()).item() > 1e-3, change


@pytest.fixture(scope="module")
def pool(gloo_pool):
    return gloo_pool(4, sizes=(2, 4))


CP_CASES = [(cp, "q-lora", s, "compact") for cp in (2, 4) for s in STRATEGIES] + [
    (2, "q-lora", "flashcp", "needed"), (4, "q-lora", "flashcp", "needed"),
    (2, "q-lora", "flashcp", "two_level"), (4, "q-lora", "flashcp", "two_level"),
    (2, "q-direct", "flashcp", "compact"),
]  # fmt: skip


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_matches_transformers(models, pool, cp):
    for case_cp, name, strategy, comm in CP_CASES:
        if case_cp == cp:
            _run(pool, models, name, cp, strategy, comm)
