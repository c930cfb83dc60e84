"""A compiled DeepSeek-V3 (MLA) block is one graph and gives the eager block's gradients.

FlashCP's MLA (flashcp.titan.models.latent) runs the latent exchange as the registered op
`flashcp::cp_latent_attention` (flashcp.attention.op.latent_attention), keyed by the step like the
dense op: a block traces to one graph with no break for every one-level exchange, and
inductor's float64 block (the `[compile] enable` backend) matches the eager one at CP 1 and CP 2, as
test_compile.py checks for Llama 3 and Qwen3 (its helpers). The block is the dense first layer of a
tiny config.json (4 heads, kv_lora_rank 32, q_lora_rank 24, qk 16 + 8, v 16: heads x v = dim, the
size at which inductor once reused the op's buffers, test_compile.py).
"""

from __future__ import annotations

import gc

import pytest
import torch

import flashcp.titan  # noqa: F401  (TorchTitan shims before torchtitan)
from flashcp.attention.op import live_entries
from flashcp.attention.simulate import run_ranks
from flashcp.dispatch import build_dispatch, COMM_MODES
from flashcp.plan import plan_shards
from flashcp.titan.config import validate
from flashcp.titan.models.attention import CPStep, flashcp_ropes
from flashcp.titan.models.spec import model_spec

from tests.titan.test_compile import _train_window, WINDOW
from tests.titan.test_hf_config import hf_folder
from tests.titan.test_mla_config import DEEPSEEK_V3

TINY = DEEPSEEK_V3 | {
    "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 2,
    "first_k_dense_replace": 1, "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 32,
    "q_lora_rank": 24, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 8,
    "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "num_nextn_predict_layers": 0, "vocab_size": 97,
    "max_position_embeddings": WINDOW,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 4, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 24, "type": "yarn"},
}  # fmt: skip
TOLERANCE = 1e-12  # relative, float64, inductor vs eager: summation order only; observed <= 6e-16


@pytest.fixture(scope="module")
def block(tmp_path_factory) -> tuple[torch.nn.Module, dict]:
    folder = hf_folder(tmp_path_factory.mktemp("mla"), TINY)
    cfg = validate({"model": {"hf_config": str(folder)}, "flashcp": {"backend": "reference"},
                    "training": {"seq_len": WINDOW}})  # fmt: skip
    torch.manual_seed(0)
    decoder = model_spec(cfg["model"], cfg["flashcp"], 97, WINDOW).model.build()
    decoder.init_states()
    layer = decoder.layers["0"].double()
    assert type(layer.attention).__name__ == "FlashCPLatentAttention"
    return layer, flashcp_ropes(decoder)


@pytest.mark.parametrize("comm", COMM_MODES)
@pytest.mark.parametrize("overlap", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_explain_finds_one_graph_and_no_break(block, comm, overlap):
    layer, ropes = block
    layer.attention.overlap = overlap  # as [flashcp] overlap builds it
    plan = plan_shards([40, 3, 30, 23], 2, "flashcp")
    dispatches = [build_dispatch(plan, r, comm, overlap=overlap) for r in range(2)]
    x = torch.randn(1, plan.tokens_per_rank, 64, dtype=torch.float64)

    def explain(rank, group):
        d = dispatches[rank]
        return torch._dynamo.explain(layer)(x, CPStep.of(ropes, d, group), d.positions[None])

    try:
        explained = run_ranks(2, explain)[0]
    finally:
        layer.attention.overlap = False
    print(f"MLA {comm} overlap={overlap}: {explained.graph_count} graph(s), {explained.graph_break_count} break(s), "
          f"{explained.op_count} ops")  # fmt: skip
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    assert any("flashcp.cp_latent_attention" in str(node.target) for g in explained.graphs for node in g.graph.nodes)


@pytest.mark.parametrize("cp", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_inductor_block_matches_eager_gradients(block, cp):
    """Inductor vs eager, float64: the block's output, its input's gradient and every parameter's
    (wkv_b's included: this rank's share of the up-projection's), on every rank."""
    layer, ropes = block
    compiled = torch.compile(layer, backend="inductor", fullgraph=True)
    plan = plan_shards([40, 3, 30, 23], cp, "flashcp")
    x, g = torch.randn(2, 1, WINDOW, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    want = _train_window(layer, ropes, plan, "compact", x, g)
    got = _train_window(compiled, ropes, plan, "compact", x, g)
    names = ["output", "input", *(n for n, _ in layer.named_parameters())]
    worst = {n: max((a - b).norm().item() / a.norm().item() for a, b in ((w[i], o[i]) for w, o in zip(want, got)))
             for i, n in enumerate(names)}  # fmt: skip
    print(f"MLA CP {cp} inductor vs eager, worst relative error over ranks: "
          + ", ".join(f"{n} {e:.1e}" for n, e in worst.items()))
    assert max(worst.values()) <= TOLERANCE, worst
    del compiled, want, got
    gc.collect()
    assert live_entries() == (0, 0, 0)
