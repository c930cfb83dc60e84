"""The end-to-end step model: dense work, attention layers, FSDP traffic and the slowest DP group,
each compared with an independent computation on the synthetic attention model of test_costmodel."""

from __future__ import annotations

import pytest
from test_costmodel import synthetic_model

from flashcp import plan_shards
from flashcp.costmodel.step import LLAMA3_8B, LLAMA3_70B, LlamaShape, MeshAssumptions, StepModel

TINY = LlamaShape("tiny", params=1e9, dim=2048, n_layers=4, heads=16, kv_heads=4, vocab=32000)
C = 16384
LONG = [C]  # one document: attention-heavy
SHORT = [512] * (C // 512)


def attention_ms(system: str, strategy: str, doc_lens: list[int], model: LlamaShape, cp: int) -> float:
    plan = plan_shards(doc_lens, cp, strategy=strategy)
    return synthetic_model().step(system, model.attention, {strategy: plan}).training * model.n_layers


def test_one_rank_is_dense_plus_every_layers_attention():
    assume = MeshAssumptions(dense_tflops=400.0)
    model = StepModel(synthetic_model(), TINY, cp=1, dp=1, assumptions=assume)
    result = model.step("flashcp", [[LONG]])
    dense = 6 * (1e9 - 32000 * 2048) * C / 400e12 * 1e3
    assert result.dense == pytest.approx(dense)
    assert result.attention == pytest.approx(attention_ms("flashcp", "flashcp", LONG, TINY, 1))
    assert result.fsdp_exposed == 0.0 and result.total == pytest.approx(result.dense + result.attention)


@pytest.mark.parametrize("system, strategy", [("llama3", "per_seq"), ("per_doc", "per_doc"), ("flashcp", "flashcp")])
def test_the_slowest_dp_group_sets_each_micro_step_and_micro_steps_add_up(system, strategy):
    model = StepModel(synthetic_model(), TINY, cp=4, dp=2)
    long_ms, short_ms = (attention_ms(system, strategy, w, TINY, 4) for w in (LONG, SHORT))
    assert long_ms > short_ms
    dense, fsdp = model.dense_ms(C // 4), model.fsdp_ms()

    def micro(ms: float) -> float:  # a micro step of the slowest group `ms`, FSDP traffic beyond it exposed
        return ms + max(0.0, fsdp - ms)

    one = model.step(system, [[LONG], [SHORT]])
    assert one.total == pytest.approx(micro(dense + long_ms))
    assert one.group_spread == [pytest.approx((dense + long_ms) / (dense + (long_ms + short_ms) / 2))]
    assert model.step(system, [[SHORT], [LONG]]).total == pytest.approx(one.total)  # which group: no matter
    two = model.step(system, [[LONG, SHORT], [SHORT, SHORT]])
    assert two.total == pytest.approx(micro(dense + long_ms) + micro(dense + short_ms))
    assert two.attention == pytest.approx(long_ms + short_ms) and two.dense == pytest.approx(2 * dense)


def test_fsdp_traffic_is_exposed_only_beyond_the_compute():
    attention = synthetic_model()
    inside = StepModel(attention, TINY, cp=4, dp=2)  # 8 ranks: one node, the NVLink tables
    assert inside.fsdp_ms() == pytest.approx(attention.comm.all_gather_ms(8e9 / 8, 8))
    slow_net = MeshAssumptions(inter_node_busbw_gbps=1.0)  # 16 ranks: across nodes
    across = StepModel(attention, TINY, cp=4, dp=4, assumptions=slow_net)
    traffic = 8e9 * 15 / 16 / 1e9 * 1e3
    assert across.fsdp_ms() == pytest.approx(traffic)
    result = across.step("flashcp", [[SHORT]] * 4)
    compute = result.dense + result.attention
    assert traffic > compute and result.fsdp_exposed == pytest.approx(traffic - compute)
    fast_net = StepModel(attention, TINY, cp=4, dp=4, assumptions=MeshAssumptions(inter_node_busbw_gbps=1e6))
    assert fast_net.step("flashcp", [[SHORT]] * 4).fsdp_exposed == 0.0


def test_llama_shapes_count_their_dense_flops_without_the_embedding():
    assert LLAMA3_8B.dense_flops_per_token == pytest.approx(6 * (8.03e9 - 128256 * 4096))
    assert LLAMA3_70B.attention.heads == 64 and LLAMA3_70B.attention.n_kv == 8


def test_windows_must_give_every_dp_rank_the_same_micro_steps():
    model = StepModel(synthetic_model(), TINY, cp=2, dp=2)
    with pytest.raises(ValueError, match="expected windows\\[dp=2\\]\\[micro\\]"):
        model.step("flashcp", [[LONG]])
    with pytest.raises(ValueError, match="expected windows"):
        model.step("flashcp", [[LONG], [LONG, SHORT]])
