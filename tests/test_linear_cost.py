"""What the planner charges a hybrid model's Gated DeltaNet layers (`LinearLayers`): FLOPs equal to a
brute-force count of every token's recurrence, pair and cut piece; and plans that send no more state
than those made for the attention layers alone."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from flashcp import plan_shards
from flashcp.data import length_sampler, pack_windows
from flashcp.plan import CAUSAL, Workload
from flashcp.plan.linear import composers, linear_comm, LinearLayers

# Qwen3.5-9B: 8 full layers (16 heads of 256, 4 K/V heads), 24 Gated DeltaNet (32 value heads of 128)
QWEN3_5_9B = LinearLayers(layers=24, heads=32, key_dim=128, value_dim=128, pair_flops=4 * 16 * 256,
                          kv_row_bytes=4 * 2 * 256 * 2, full_layers=8,
                          conv_channels=2 * 16 * 128 + 32 * 128)  # fmt: skip
HYBRID = Workload(full_layers=8, linear=QWEN3_5_9B)
ATTENTION_ONLY = Workload(full_layers=8)


def _brute_force(plan, lin: LinearLayers, full_layers: int) -> list[int]:
    """Per rank, token by token: each query's pairs in every full layer, each token's three state
    products per value head in every linear layer, a middle piece's tokens once more with d_k + d_v
    columns, and the composer's folds of its document's summaries, all but the first and the last's."""
    h, dk, dv = lin.heads, lin.key_dim, lin.value_dim
    pieces = {}
    for rank, shards in enumerate(plan.ranks):
        for s in shards:
            pieces.setdefault(s.doc, []).append((s.start, s.length, rank))
    work = [0] * plan.cp_size
    for doc, held in pieces.items():
        held.sort()
        for j, (start, length, rank) in enumerate(held):
            for pos in range(start, start + length):
                work[rank] += full_layers * (pos + 1) * 2 * 2 * 16 * 256  # QK^T and PV, multiply-adds x 2
                work[rank] += lin.layers * 3 * h * dk * dv * 2
                if 0 < j < len(held) - 1:
                    work[rank] += lin.layers * 3 * h * dk * (dk + dv) * 2
        for _ in range(max(0, len(held) - 2)):
            work[composers(plan)[doc]] += lin.layers * h * dk * dk * dv * 2
    return work


@pytest.mark.parametrize("strategy", ["flashcp", "per_doc", "per_seq"])
def test_the_cost_equals_a_brute_force_count(strategy: str) -> None:
    rng = random.Random(0)
    most_pieces = 0
    for cp in (2, 3, 4):
        lens = [rng.randint(1, 90) for _ in range(rng.randint(1, 6))]
        lens[-1] += -sum(lens) % cp
        plan = plan_shards(lens, cp, strategy, workload=HYBRID)
        pieces = [sum(s.doc == d for r in plan.ranks for s in r) for d in range(len(lens))]
        most_pieces = max(most_pieces, *pieces)
        assert plan.workloads() == _brute_force(plan, QWEN3_5_9B, 8)
    assert most_pieces >= 3 or strategy == "flashcp"  # fixed layouts: middle pieces and folds counted


def test_without_linear_layers_the_workload_is_the_attention_one() -> None:
    lens = [300, 20, 100, 60, 32]
    assert Workload() == CAUSAL and Workload(full_layers=8).linear is None
    for strategy in ("flashcp", "per_doc"):
        plan = plan_shards(lens, 4, strategy, workload=ATTENTION_ONLY)
        assert plan.workloads() == [8 * sum(s.length * (2 * s.start + s.length + 1) // 2 for s in r)
                                    for r in plan.ranks]  # fmt: skip


def test_a_whole_document_plan_sends_no_state_and_costs_no_cut() -> None:
    plan = plan_shards([64, 64, 64, 64], 4, "flashcp", workload=HYBRID)
    assert plan.metrics()["split_docs"] == 0
    assert QWEN3_5_9B.cut_work(plan) == [0] * 4 and QWEN3_5_9B.exchange_tokens(plan) == 0


def _state_recv(plan) -> int:
    comm = linear_comm(plan, QWEN3_5_9B.heads, QWEN3_5_9B.key_dim, QWEN3_5_9B.value_dim, QWEN3_5_9B.conv_channels)
    return max(comm.state_recv)


@pytest.mark.parametrize("dist", ["wlbllm", "pile"])
def test_hybrid_plans_send_no_more_state_than_attention_only_plans(dist: str) -> None:
    """128K windows at CP 8 and 32: the plans made for the hybrid model's cost receive no more state
    bytes in all than those made for its full layers alone (a window's layout may differ either way),
    and less at CP 32, where cut documents span 64 pieces."""
    for cp in (8, 32):
        hybrid = attention = 0
        for lens in pack_windows(length_sampler(dist, seed=0), 131072, 6):
            hybrid += _state_recv(plan_shards(lens, cp, workload=HYBRID))
            attention += _state_recv(plan_shards(lens, cp, workload=ATTENTION_ONLY))
        assert hybrid < attention or (cp == 8 and hybrid == attention)


def test_bad_linear_shapes_are_one_line() -> None:
    with pytest.raises(ValueError, match="positive integers"):
        LinearLayers(layers=0, heads=32, key_dim=128, value_dim=128, pair_flops=1)


def test_the_planner_cli_adds_the_state_bytes(capsys) -> None:
    from flashcp.plan.__main__ import main

    assert main(["--linear", "qwen3_5_9b", "--cp", "8", "--windows", "2", "--strategy", "flashcp", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["flashcp"]
    windows = pack_windows(length_sampler("wlbllm", seed=0), 131072, 2)
    plans = [plan_shards(lens, 8, workload=Workload(full_layers=8, linear=QWEN3_5_9B)) for lens in windows]
    assert out["state_recv_bytes"]["mean"] == sum(_state_recv(p) for p in plans) / 2
    assert out["state_contiguous_bytes"]["max"] == 7 * 32 * 128 * 256 * 4  # B and M per rank, float32


@pytest.mark.parametrize("argv, message", [
    (["--linear", "nope.json"], "neither qwen3_5_9b nor qwen3_5_27b nor a readable hybrid config.json"),
    (["--linear", "qwen3_5_9b", "--window", "128"], "--linear and --window"),
])  # fmt: skip
def test_the_planner_cli_refuses_a_bad_hybrid_in_one_line(argv, message, capsys) -> None:
    from flashcp.plan.__main__ import main

    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--windows", "1"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and err.count("\n") == 1


def test_the_step_model_prices_linear_layers_beside_the_full_ones() -> None:
    """A hybrid's attention time: its full layers as a full model's, plus per linear layer the slowest
    rank's kernel (recurrence and cut work at linear_tflops, x3 with the backward) and the state and
    halo all-to-all-v both ways; full AC runs their forward again."""
    from test_costmodel import synthetic_model

    from flashcp.costmodel.step import LlamaShape, MeshAssumptions, QWEN3_5_9B, StepModel

    attention, cp = synthetic_model(), 4
    lens = [9000, 3000, 2000, 1000, 1000, 384]  # the longest cut over several ranks
    model = StepModel(attention, QWEN3_5_9B, cp=cp, dp=1)
    plan = model.plan("flashcp", lens)
    assert plan.workload == Workload(full_layers=8, linear=QWEN3_5_9B.linear) and plan.metrics()["split_docs"]
    comm = linear_comm(plan, 32, 128, 128, QWEN3_5_9B.linear.conv_channels)
    link = max(max(map(sum, zip(comm.state_sent, comm.halo_sent))),
               max(map(sum, zip(comm.state_recv, comm.halo_recv))))
    work = max(QWEN3_5_9B.linear.token_flops * plan.tokens_per_rank + c for c in QWEN3_5_9B.linear.cut_work(plan))
    compute = work / (MeshAssumptions().linear_tflops * 1e12) * 1e3
    exchange = 24 * attention.comm.all_to_all_ms(link, cp)
    assert model.linear_ms(plan) == pytest.approx((compute, exchange)) and exchange > 0

    full = dataclasses.replace(QWEN3_5_9B, linear=None, n_layers=8)  # the 8 full layers alone, same plan
    layer = attention.step("flashcp", full.attention, {"flashcp": plan})
    training, again = model.attention_ms("flashcp", lens)
    assert training == pytest.approx(8 * layer.training + 3 * compute + 2 * exchange)
    assert again == pytest.approx(8 * layer.inference + compute + exchange)
    assert isinstance(full, LlamaShape) and full.workload == CAUSAL


def test_a_whole_document_plan_has_no_state_exchange_in_the_step_model() -> None:
    from test_costmodel import synthetic_model

    from flashcp.costmodel.step import QWEN3_5_9B, StepModel

    model = StepModel(synthetic_model(), QWEN3_5_9B, cp=4, dp=1)
    assert model.linear_ms(model.plan("flashcp", [1024] * 4))[1] == 0.0
