"""The multi-node collective model (`flashcp.costmodel.fabric`) against hand-computed alpha-beta times,
the step model's FSDP on it, and `benchmarks/step_model_multinode.py` on a tiny grid."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_costmodel import SHARED_PROFILES, synthetic_comm, synthetic_model

from flashcp import plan_shards
from flashcp.costmodel import ProfileError
from flashcp.costmodel.comm import interpolated_busbw
from flashcp.costmodel.fabric import Fabric, MultiNodeComm, multinode_model
from flashcp.costmodel.step import LLAMA3_8B, MeshAssumptions, StepModel
from flashcp.plan.nodes import node_traffic

ROOT = Path(__file__).resolve().parents[1]
SIZE = 1 << 30  # a buffer where the synthetic tables give 350-365 GB/s


def comm(**fabric) -> MultiNodeComm:
    return MultiNodeComm(synthetic_comm().tables.values(), Fabric(**fabric))


def test_inside_one_node_the_measured_tables_price_it():
    flat, multi = synthetic_comm(), comm()
    for n in (2, 4, 8):
        assert multi.all_gather_ms(SIZE / n, n) == flat.all_gather_ms(SIZE / n, n)
        assert multi.reduce_scatter_ms(SIZE / n, n) == flat.reduce_scatter_ms(SIZE / n, n)


@pytest.mark.parametrize("n", [16, 32, 64])
def test_ring_over_whole_nodes_runs_at_the_slower_of_nvlink_and_eight_nics(n):
    nodes = n // 8
    latency = (8.4 + (n - 1 - (nodes - 1)) * 3.4 + (nodes - 1) * 9.6) / 1e3
    moved = SIZE * (n - 1) / n
    nvlink = interpolated_busbw(synthetic_comm().table("all_gather", 8), SIZE)  # 350-365 GB/s
    fast = comm(nic_gbps=50.0, nic_efficiency=1.0)  # 8 x 50 = 400 GB/s: NVLink is the bound
    assert fast.all_gather_ms(SIZE / n, n) == pytest.approx(latency + moved / (nvlink * 1e9) * 1e3)
    slow = comm(nic_gbps=25.0, nic_efficiency=0.8)  # 8 x 20 = 160 GB/s: the fabric is
    assert slow.all_gather_ms(SIZE / n, n) == pytest.approx(latency + moved / 160e9 * 1e3)


def test_one_rank_per_node_gets_one_nic():
    one = comm(group_ranks_per_node=1)  # e.g. tensor parallelism fills each node
    n = 8  # eight nodes of one rank: every ring step crosses the fabric
    latency = (8.4 + 7 * 9.6) / 1e3
    assert one.all_gather_ms(SIZE / n, n) == pytest.approx(latency + SIZE * 7 / 8 / 45e9 * 1e3)
    assert one.all_gather_ms(SIZE / 8, 8) > 7 * comm().all_gather_ms(SIZE / 8, 8)


def test_a_group_that_does_not_fill_its_nodes_is_refused():
    with pytest.raises(ProfileError, match="a group of 12 ranks does not fill nodes of 8 ranks"):
        comm().all_gather_ms(1e6, 12)


def test_two_level_saves_the_duplicate_fabric_rows():
    """Llama3 CP's chunks of [40, 8, 30, 2] on 2 nodes x 2: the flat exchange's busiest rank moves
    twice the rows over the fabric that the two-level stage 1 does (tests/test_two_level.py)."""
    plan = plan_shards([40, 8, 30, 2], 4, "per_seq")
    traffic = node_traffic(plan, 2)
    multi = comm(group_ranks_per_node=2, nic_gbps=1e-3)  # the fabric dominates: times follow its rows
    row = 1 << 20
    flat = max(max(traffic.flat_inter_send), max(traffic.flat_inter_recv))
    staged = max(max(traffic.stage1_send), max(traffic.stage1_recv))
    assert staged < flat
    nic = 1e-3 * 0.9 * 1e9
    assert multi.needed_ms(traffic, row) == pytest.approx(flat * row / nic * 1e3, rel=1e-3)
    assert multi.two_level_ms(traffic, row) == pytest.approx(staged * row / nic * 1e3, rel=1e-3)


def test_cost_model_prices_two_level_and_needed_the_same_on_one_node_and_apart_on_many():
    model = multinode_model(synthetic_model(), Fabric(nic_gbps=5.0))
    doc_lens = [4096, 2048, 30000, 1024, 6000, 20000, 500, 1868] * 4  # 262144 tokens
    shape = LLAMA3_8B.attention
    for n, same in ((8, True), (32, False)):
        plans = {"flashcp": plan_shards(doc_lens, n, "flashcp")}
        needed = model.step("flashcp_needed", shape, plans)
        two = model.step("flashcp_two_level", shape, plans)
        assert (needed.comm_fwd == two.comm_fwd) is same
        assert needed.attn_fwd == two.attn_fwd and needed.attn_bwd == two.attn_bwd


def test_fsdp_across_nodes_uses_the_fabric_model():
    model = multinode_model(synthetic_model())
    step = StepModel(model, LLAMA3_8B, cp=8, dp=4, assumptions=MeshAssumptions())
    total = LLAMA3_8B.params * 8.0
    assert step.fsdp_ms() == pytest.approx(model.comm.all_gather_ms(total / 32, 32))
    single_rail = StepModel(synthetic_model(), LLAMA3_8B, cp=8, dp=4).fsdp_ms()  # the 40 GB/s assumption
    assert step.fsdp_ms() < single_rail


@pytest.mark.skipif(not SHARED_PROFILES.is_dir(), reason="needs ../shared/data/gpu_profiles (calibration)")
def test_benchmark_writes_every_system_and_where_it_stops_hiding(tmp_path):
    command = [sys.executable, str(ROOT / "benchmarks" / "step_model_multinode.py"), "--datasets", "wlbllm",
               "--contexts", "131072", "--cp", "8", "16", "--windows", "1", "--no-validate",
               "--results", str(tmp_path)]  # fmt: skip
    subprocess.run(command, capture_output=True, text=True, timeout=600, check=True)
    payload = json.loads((tmp_path / "step_model_multinode.json").read_text())
    assert [(r["context"], r["cp"]) for r in payload["runs"]] == [(131072, 8), (131072, 16)]
    for run in payload["runs"]:
        for name in ("llama3", "per_doc", "flashcp", "flashcp_needed", "flashcp_two_level"):
            r = run["systems"][name]
            assert r["hide_fwd"] == pytest.approx(r["comm_fwd"] / r["attn_fwd"])
            assert r["hide_bwd"] == pytest.approx(r["comm_bwd"] / r["attn_bwd"])
        assert ("flashcp_node_traffic" in run["systems"]) is (run["cp"] > 8)
    (row,) = payload["stops_hiding"]
    for name in ("llama3", "flashcp", "flashcp_two_level"):
        ratios = [max(r["systems"][name][k] for k in ("hide_fwd", "hide_bwd")) for r in payload["runs"]]
        first = next((n for n, x in zip((8, 16), ratios) if x > 1), None)
        assert row[name] == first
    assert "MODELLED" in (tmp_path / "step_model_multinode.md").read_text()
