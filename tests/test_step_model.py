"""The end-to-end step model: dense work, attention layers, activation-checkpoint recompute, FSDP
traffic and the slowest DP group, each compared with an independent computation on the synthetic
attention model of test_costmodel; balance in the model; `benchmarks/step_model.py validate`."""

from __future__ import annotations

import re
from dataclasses import replace
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_costmodel import SHARED_PROFILES, synthetic_model

from flashcp import plan_shards
from flashcp.costmodel import load_cost_model
from flashcp.costmodel.proxy import (
    ATTENTION_TFLOPS,
    CALIBRATION_CALL,
    DENSE_MFU,
    H100_BF16_TFLOPS,
    kernel_tflops,
    window_cost,
)
from flashcp.costmodel.step import (
    DEEPSEEK_V3_16B,
    DEEPSEEK_V3_671B,
    LLAMA3_8B,
    LLAMA3_70B,
    LlamaShape,
    MeshAssumptions,
    QWEN3_30B_A3B,
    StepModel,
    paper_ratio_scales,
)
from flashcp.data.balance import balance_step, stream_windows
from flashcp.data.lengths import length_sampler, pack_windows

ROOT = Path(__file__).resolve().parents[1]
NO_AC = MeshAssumptions(full_ac=False)

TINY = LlamaShape("tiny", params=1e9, dim=2048, n_layers=4, heads=16, kv_heads=4, vocab=32000)
C = 16384
LONG = [C]  # one document: attention-heavy
SHORT = [512] * (C // 512)


def attention_ms(system: str, strategy: str, doc_lens: list[int], model: LlamaShape, cp: int) -> float:
    plan = plan_shards(doc_lens, cp, strategy=strategy)
    return synthetic_model().step(system, model.attention, {strategy: plan}).training * model.n_layers


def test_one_rank_is_dense_plus_every_layers_attention():
    assume = MeshAssumptions(dense_tflops=400.0, full_ac=False)
    model = StepModel(synthetic_model(), TINY, cp=1, dp=1, assumptions=assume)
    result = model.step("flashcp", [[LONG]])
    dense = 6 * (1e9 - 32000 * 2048) * C / 400e12 * 1e3
    assert result.dense == pytest.approx(dense)
    assert result.attention == pytest.approx(attention_ms("flashcp", "flashcp", LONG, TINY, 1))
    assert result.fsdp_exposed == result.recompute == 0.0
    assert result.total == pytest.approx(result.dense + result.attention)


@pytest.mark.parametrize("system", ["llama3", "per_doc", "flashcp"])
def test_full_activation_checkpointing_adds_a_second_forward(system):
    attention, cp = synthetic_model(), 4
    strategy = {"llama3": "per_seq", "per_doc": "per_doc", "flashcp": "flashcp"}[system]
    plan = plan_shards(SHORT + LONG, cp, strategy=strategy)
    layer = attention.step(system, TINY.attention, {strategy: plan})
    plain = StepModel(attention, TINY, cp=cp, dp=1, assumptions=NO_AC).step(system, [[SHORT + LONG]])
    ac = StepModel(attention, TINY, cp=cp, dp=1).step(system, [[SHORT + LONG]])
    assert MeshAssumptions().full_ac  # the shipped configs' setting is the default
    assert ac.dense == pytest.approx(plain.dense) and ac.attention == pytest.approx(plain.attention)
    assert ac.recompute == pytest.approx(plain.dense / 3 + layer.inference * TINY.n_layers)  # 2 of 6 FLOPs
    assert ac.total == pytest.approx(plain.total + ac.recompute) and ac.recompute > 0


def test_dense_work_is_priced_at_the_one_published_mfu_the_balancer_uses():
    assert MeshAssumptions().dense_tflops == pytest.approx(DENSE_MFU * H100_BF16_TFLOPS)
    model = StepModel(synthetic_model(), TINY, cp=2, dp=1)
    cost = window_cost(TINY.dense_flops_per_token, 1.0, cp=2)
    assert model.dense_ms(1000) == pytest.approx(cost.dense_per_token * 1000 * 1e3)


@pytest.mark.skipif(not SHARED_PROFILES.is_dir(), reason="needs ../shared/data/gpu_profiles (the calibration)")
def test_the_balancers_cost_and_the_step_model_price_a_window_alike():
    """One source of numbers: the proxy's attention TFLOP/s is the calibrated kernel model's, and a
    window on one rank (no KV exchange) costs the same in both, dense, attention and AC recompute."""
    attention, _ = load_cost_model([SHARED_PROFILES], [SHARED_PROFILES])
    assert kernel_tflops(attention.kernel, *CALIBRATION_CALL) == pytest.approx(ATTENTION_TFLOPS, rel=0.005)
    model = LLAMA3_8B
    for full_ac in (True, False):
        step = StepModel(attention, model, cp=1, dp=1, assumptions=MeshAssumptions(full_ac=full_ac))
        cost = window_cost(model.dense_flops_per_token, 12.0 * model.heads * model.head_dim * model.n_layers, 1,
                           full_ac)  # fmt: skip
        for lens in ([32768], [65536], [4096] * 16):
            dense, attn, again = step.window_ms("llama3", lens)
            assert dense + attn + again == pytest.approx(cost(lens) * 1e3, rel=0.05), lens
            assert dense * (1 + (1 / 3 if full_ac else 0)) == pytest.approx(cost.dense_per_token * sum(lens) * 1e3)


def test_an_attention_scale_multiplies_only_its_systems_attention():
    attention, windows = synthetic_model(), [[SHORT + LONG]]
    plain = StepModel(attention, TINY, cp=4, dp=1)
    scale = MeshAssumptions(attention_scale={"flashcp": 1.5})
    scaled = StepModel(attention, TINY, cp=4, dp=1, assumptions=scale)
    a, b = plain.step("flashcp", windows), scaled.step("flashcp", windows)
    assert b.attention == pytest.approx(1.5 * a.attention) and b.dense == pytest.approx(a.dense)
    assert b.recompute - b.dense / 3 == pytest.approx(1.5 * (a.recompute - a.dense / 3))
    assert scaled.step("llama3", windows).total == pytest.approx(plain.step("llama3", windows).total)


def test_paper_ratio_scales_reproduce_the_measured_speedups_keeping_llama3():
    modelled = {"llama3": 2.0, "per_doc": 1.8, "ring": 3.1, "zigzag": 2.5}
    measured = {"llama3": 1.38, "per_doc": 1.63, "ring": 1.97, "zigzag": 2.14}
    scale = paper_ratio_scales(modelled, measured)
    assert scale["llama3"] == 1.0 and scale["flashcp"] > 1.0  # the model's FlashCP was too fast
    assert set(scale) == {*measured, "flashcp"}
    for base in modelled:  # FlashCP's speedup over `base` once both times are scaled
        assert modelled[base] * scale[base] / scale["flashcp"] == pytest.approx(measured[base])


def test_the_cp_systems_scales_leave_one_rank_alone():
    """On one rank every system runs the same kernel: the scales, measured on CP groups, do not apply."""
    attention, windows = synthetic_model(), [[SHORT + LONG]]
    scale = MeshAssumptions(attention_scale={"flashcp": 1.5, "zigzag": 2.0})
    for system in ("flashcp", "zigzag"):
        one = StepModel(attention, TINY, cp=1, dp=1, assumptions=scale).step(system, windows)
        assert one.total == pytest.approx(StepModel(attention, TINY, cp=1, dp=1).step(system, windows).total)
        four = StepModel(attention, TINY, cp=4, dp=1, assumptions=scale).step(system, windows)
        assert four.attention == pytest.approx(
            scale.attention_scale[system] * StepModel(attention, TINY, cp=4, dp=1).step(system, windows).attention)


@pytest.mark.parametrize("system", ["per_doc", "flashcp"])
@pytest.mark.parametrize("dataset", ["wlbllm", "pile"])
def test_mesh_balance_never_slows_a_balanced_cp_system_down(system, dataset):
    """The balancer prices a window as if its CP group were balanced: true of Per-Doc CP and FlashCP
    (within 1 %: it balances a proxy, not this model), not of Llama3 CP (up to 4 % slower here)."""
    attention, context, dp, cp = synthetic_model(), 16384, 4, 2
    model = StepModel(attention, TINY, cp=cp, dp=dp)
    cost = window_cost(TINY.dense_flops_per_token, 12.0 * TINY.dim * TINY.n_layers, cp, True)
    for seed in range(8):
        lens = [n for w in pack_windows(length_sampler(dataset, seed=seed), context, dp) for n in w]
        stream = [[w] for w in stream_windows(lens, context)]
        placed = balance_step([n for w in stream for n in w[0]], dp, 1, context, cost, None)
        mesh = [[[p.length for p in w] for w in rank] for rank in placed]
        assert model.step(system, mesh).total <= model.step(system, stream).total * 1.01


@pytest.mark.parametrize("system, strategy", [("llama3", "per_seq"), ("per_doc", "per_doc"), ("flashcp", "flashcp")])
def test_the_slowest_dp_group_sets_each_micro_step_and_micro_steps_add_up(system, strategy):
    model = StepModel(synthetic_model(), TINY, cp=4, dp=2, assumptions=NO_AC)
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
    slow_net = MeshAssumptions(inter_node_busbw_gbps=1.0, full_ac=False)  # 16 ranks: across nodes
    across = StepModel(attention, TINY, cp=4, dp=4, assumptions=slow_net)
    traffic = 8e9 * 15 / 16 / 1e9 * 1e3
    assert across.fsdp_ms() == pytest.approx(traffic)
    result = across.step("flashcp", [[SHORT]] * 4)
    compute = result.dense + result.attention + result.recompute
    assert traffic > compute and result.fsdp_exposed == pytest.approx(traffic - compute)
    fast_net = StepModel(attention, TINY, cp=4, dp=4, assumptions=MeshAssumptions(inter_node_busbw_gbps=1e6))
    assert fast_net.step("flashcp", [[SHORT]] * 4).fsdp_exposed == 0.0


def test_llama_shapes_count_their_dense_flops_without_the_embedding():
    assert LLAMA3_8B.dense_flops_per_token == pytest.approx(6 * (8.03e9 - 128256 * 4096))
    assert LLAMA3_70B.attention.heads == 64 and LLAMA3_70B.attention.n_kv == 8


def test_a_mixture_of_experts_costs_its_active_parameters_and_its_all_to_all():
    """Qwen3-30B-A3B: 3.35e9 of its 30.5e9 parameters per token; with EP 8 each layer adds two
    all-to-alls of tokens x top_k x dim bf16 over the 8 ranks per pass (forward, backward and the
    recompute's forward), and FSDP gathers an eighth of the experts."""
    m = QWEN3_30B_A3B
    assert m.active_params == pytest.approx(3.353e9, rel=1e-3)
    assert m.dense_flops_per_token == pytest.approx(6 * (3.353e9 - 151936 * 2048), rel=1e-3)
    attention = synthetic_model()
    local, ep = StepModel(attention, m, cp=8, dp=1), StepModel(attention, m, cp=8, dp=1, ep=8)
    tokens = C // 8
    one_pass = 2 * m.n_layers * attention.comm.all_gather_ms(tokens * 8 * 2048 * 2 / 8, 8)
    assert local.all_to_all_ms(tokens) == 0 and one_pass > 0 and ep.all_to_all_ms(tokens) == pytest.approx(one_pass)
    (d1, a1, r1), (d8, a8, r8) = local.window_ms("flashcp", SHORT), ep.window_ms("flashcp", SHORT)
    assert d8 - d1 == pytest.approx(2 * one_pass) and r8 - r1 == pytest.approx(one_pass) and a8 == a1
    assert ep.fsdp_ms() < local.fsdp_ms()
    with pytest.raises(ValueError, match="ep = 8 needs a mixture of experts"):
        StepModel(attention, TINY, cp=8, dp=1, ep=8)


def test_mla_models_count_their_published_parameters_and_price_the_latent_exchange():
    """DeepSeek-V3 (671B, 37B active as published; 37.6e9 here with the untied output head) and
    TorchTitan's 16B flavor (DeepSeek-V2-Lite's 15.7B); the same plan and model priced with latent
    rows on the wire moves 576 values per token where K/V moves heads x 320, the step model
    passing the MLA dims through to the attention layer's shape."""
    assert DEEPSEEK_V3_671B.params == pytest.approx(671e9, rel=2e-3)
    assert DEEPSEEK_V3_671B.active_params == pytest.approx(37.55e9, rel=2e-3)
    assert DEEPSEEK_V3_16B.params == pytest.approx(15.7e9, rel=2e-3)
    shape = DEEPSEEK_V3_671B.attention
    assert (shape.head_dim, shape.v_dim, shape.kernel_head_dim) == (192, 128, 192)
    assert shape.exchange_row_bytes == 576 * 2 and shape.kv_row_bytes == 128 * 320 * 2
    kv = replace(DEEPSEEK_V3_671B, kv_lora_rank=None)
    assert kv.attention.exchange_row_bytes == kv.attention.kv_row_bytes
    model = synthetic_model()
    latent_ms = StepModel(model, DEEPSEEK_V3_671B, cp=8, dp=1).attention_ms("flashcp", LONG)[0]
    kv_ms = StepModel(model, kv, cp=8, dp=1).attention_ms("flashcp", LONG)[0]
    assert 0 < latent_ms < kv_ms


def test_windows_must_give_every_dp_rank_the_same_micro_steps():
    model = StepModel(synthetic_model(), TINY, cp=2, dp=2)
    with pytest.raises(ValueError, match="expected windows\\[dp=2\\]\\[micro\\]"):
        model.step("flashcp", [[LONG]])
    with pytest.raises(ValueError, match="expected windows"):
        model.step("flashcp", [[LONG], [LONG, SHORT]])


@pytest.mark.skipif(not SHARED_PROFILES.is_dir(), reason="needs ../shared/data/gpu_profiles (the calibration)")
def test_validate_prints_every_public_measurement_with_its_error(tmp_path):
    command = [sys.executable, str(ROOT / "benchmarks" / "step_model.py"), "validate", "--ratio-windows", "1",
               "--results", str(tmp_path)]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, timeout=600, check=True)
    lines = out.stdout.strip().splitlines()
    assert re.match(r"measurement +measured +predicted +error +note", lines[0])
    rows = [re.match(r"(.+?) +([\d.]+) +([\d.]+) +([+-][\d.]+)% +(.+)$", line) for line in lines[1:]]
    assert all(rows), lines
    measured = {float(r[2]) for r in rows}
    assert {1.38, 1.63, 1.97, 2.14, 0.236, 0.345, 5762.0, 5605.0, 3890.0, 2540.0, 1071.0, 548.0} <= measured
    for r in rows:  # the error column is the prediction's relative error
        assert float(r[4]) == pytest.approx(100 * (float(r[3]) / float(r[2]) - 1), abs=0.2)
    assert all(r[5] for r in rows) and (tmp_path / "step_model_validate.json").is_file()
    notes = {r[1].strip(): r[5] for r in rows}
    fitted = [w for w, n in notes.items() if "fitted to this row" in n]
    assert {"TorchTitan Table 1: FSDP 8, 8K, compile + Float8", "TorchTitan Table 1: FSDP 8, 8K, compile"} <= set(
        fitted)  # fmt: skip
    for r in rows:  # a row the model was fitted to reproduces its measurement and says it tests nothing
        if "fitted to this row" in r[5]:
            assert abs(float(r[4])) < 0.1, r[0]
    held = [w for w, n in notes.items() if "held out" in n]  # the tests: rows the model was not fitted to
    assert all(any(w.startswith(f"TorchTitan Table {t}") for w in held) for t in (2, 3))
    assert {8380.0, 6514.0} <= measured


def test_the_table_compares_each_system_in_stream_order_mesh_and_the_default_balance():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from step_model import table

    args = SimpleNamespace(datasets=["wlbllm"], contexts=[131072], dp=[2], models=["8b"], cp=8, steps=2, seed=0)
    (run,) = table(args, synthetic_model(), MeshAssumptions())
    names = {f"{s}{layout}" for s in ("llama3", "per_doc", "flashcp") for layout in ("", "+mesh", "+default")}
    assert set(run["step_s"]) == names and run["speedup_vs_llama3"]["llama3"] == 1.0
    for parts, step_s in zip(run["breakdown_s"].values(), run["step_s"].values()):  # a step: its parts' sum
        assert sum(parts.values()) == pytest.approx(step_s, rel=1e-6)
    assert 0.5 < run["default_attention_pairs_kept"] < 2.0
    assert run["dp_group_max_over_mean"]["flashcp+default"] < run["dp_group_max_over_mean"]["flashcp"]


def test_the_default_balance_trains_the_same_documents_in_as_many_full_steps():
    """The default's windows, flushed at the data's end, hold stream packing's data: every window
    C tokens, all of the data's tokens, in the same number of steps."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from balance import Stream, sampler
    from step_model import default_windows

    cost = window_cost(TINY.dense_flops_per_token, 12.0 * TINY.dim * TINY.n_layers, 2, True)
    for dataset in ("pile", "wlbllm"):
        windows, kept = default_windows(dataset, 0, C, 4, 6, cost)
        assert len(windows) == 6 and kept > 0.5
        for step in windows:
            assert len(step) == 4 and all(len(rank) == 1 and sum(rank[0]) == C for rank in step)
        docs = Stream(sampler(dataset, 0), 6 * 4 * C).lens
        assert sum(n for step in windows for rank in step for n in rank[0]) == docs.sum() == 6 * 4 * C
        assert max(n for step in windows for rank in step for n in rank[0]) <= C
