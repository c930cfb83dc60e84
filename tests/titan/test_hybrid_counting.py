"""A hybrid Qwen3.5 model is counted by what it computes: its Gated DeltaNet layers attend no (query,
key) pairs, so the planner's workload, the MFU's attention FLOPs and the loader's balance count the full
layers' pairs only, and the linear layers' projections and recurrence go into the per-token FLOPs."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import torch

from flashcp import plan_shards
from flashcp.costmodel.proxy import window_cost
from flashcp.plan import Workload
from flashcp.plan.linear import linear_comm, LinearLayers
from flashcp.titan.config import load_job, resolve_config_path  # flashcp.titan before torchtitan: its shims
from flashcp.titan.launch.job import trainer_config
from test_window_metrics import _log_window, _metrics, _pairs, _trainer, LENS, SEQ_LEN

CONFIG = Path(__file__).resolve().parents[2] / "train_configs/hf/tiny_qwen3_5/config.json"


@pytest.fixture(scope="module")
def job():
    """debug_hybrid_cpu (tiny_qwen3_5: 3 Gated DeltaNet layers, 1 full) as the launcher builds it."""
    return trainer_config(load_job(resolve_config_path("debug_hybrid_cpu")))


@pytest.fixture(scope="module")
def hybrid(job):
    return job.model_spec.model


def _full_layers() -> int:
    return json.loads(CONFIG.read_text())["layer_types"].count("full_attention")


def test_the_planner_balances_the_full_layers_pairs_and_the_linear_layers_per_token(job, hybrid):
    """The full layers' pairs, and the Gated DeltaNet layers by the config.json's sizes (`LinearLayers`:
    per token, plus what cuts add), weighed against a full layer's pair and bf16 K/V row."""
    hf = json.loads(CONFIG.read_text())
    key_dim = hf["linear_num_key_heads"] * hf["linear_key_head_dim"]
    linear = LinearLayers(
        layers=hf["layer_types"].count("linear_attention"), heads=hf["linear_num_value_heads"],
        key_dim=hf["linear_key_head_dim"], value_dim=hf["linear_value_head_dim"],
        pair_flops=4 * hf["num_attention_heads"] * hf["head_dim"],
        kv_row_bytes=hf["num_key_value_heads"] * 2 * hf["head_dim"] * 2, full_layers=_full_layers(),
        conv_channels=2 * key_dim + hf["linear_num_value_heads"] * hf["linear_value_head_dim"],
        conv_width=hf["linear_conv_kernel_dim"],
    )  # fmt: skip
    assert _full_layers() == 1 < len(hybrid.layers)
    assert job.dataloader.planner["workload"] == Workload(full_layers=_full_layers(), linear=linear)


def test_the_metrics_report_the_linear_layers_state_and_halo_bytes(hybrid):
    """Beside the K/V bytes: what a Gated DeltaNet layer's forward receives (busiest rank and mean),
    the plan's `linear_comm` (which tests/test_linear_cp.py holds the op's sends to)."""
    from flashcp.titan.trainer import FlashCPTrainer

    metrics = _metrics()
    FlashCPTrainer._configure_metrics(_trainer(hybrid, metrics))
    plan = plan_shards(LENS, 2, "per_doc")  # every document cut: summaries and halos both ways
    logged = _log_window(metrics, plan)
    lin = metrics.attention_workload.linear
    comm = linear_comm(plan, lin.heads, lin.key_dim, lin.value_dim, lin.conv_channels, dtype_bytes=2)
    assert min(comm.state_recv) > 0 and min(comm.halo_recv) > 0
    for kind, rows in (("state", comm.state_recv), ("halo", comm.halo_recv)):
        assert logged[f"flashcp/{kind}_recv_bytes_per_layer"] == max(rows)
        assert logged[f"flashcp/{kind}_recv_bytes_per_layer_mean"] == sum(rows) / 2
    assert logged["flashcp/kv_recv_bytes_per_layer_compact"] > 0


def test_the_mfu_counts_the_full_layers_pairs_and_the_linear_layers_per_token(hybrid):
    from flashcp.titan.trainer import FlashCPTrainer

    metrics = _metrics()
    FlashCPTrainer._configure_metrics(_trainer(hybrid, metrics))
    logged = [_log_window(metrics, plan_shards(LENS, 2, "flashcp"))]

    attention = hybrid.first_attention
    per_pair = 12 * attention.n_heads * attention.head_dim  # QK^T and PV: 2 FLOPs a multiply-add, x3 backward
    attended = _full_layers() * _pairs(LENS, None)
    flops = metrics.dense_flops_per_token * SEQ_LEN + per_pair * attended
    per_token = logged[0]["tflops"] * 1e12 / logged[0]["throughput(tps)"]
    assert per_token == pytest.approx(flops / SEQ_LEN, rel=1e-12)
    # TorchTitan's count takes the full layers as full over seq_len keys: the rest is per token
    assert metrics.dense_flops_per_token == 10**12 - per_pair * _full_layers() * SEQ_LEN


def test_the_per_token_count_holds_the_linear_layers_projections_and_recurrence(hybrid):
    """6 x the non-embedding parameters (the linear layers' among them), the full layer's pairs over
    seq_len keys, and per Gated DeltaNet layer and value head three products with its d_k x d_v state."""
    with torch.device("meta"):
        model = hybrid.build()
    nparams, flops = hybrid.get_nparams_and_flops(model, SEQ_LEN)
    params = {name: p.numel() for name, p in model.named_parameters()}
    matmul = sum(n for name, n in params.items() if not name.startswith("tok_embeddings"))
    assert any(name.endswith("attn.A_log") for name in params) and nparams == sum(params.values())
    hf = json.loads(CONFIG.read_text())
    linear = hf["layer_types"].count("linear_attention")
    value_dim = hf["linear_num_value_heads"] * hf["linear_value_head_dim"]
    attention = 6 * _full_layers() * hf["num_attention_heads"] * 2 * hf["head_dim"] * SEQ_LEN
    assert flops == 6 * matmul + attention + linear * 18 * hf["linear_key_head_dim"] * value_dim


def test_the_balance_does_not_price_linear_layers_as_quadratic(hybrid):
    """The loader's cost prices the full layer per causal pair: below pricing every layer as full (the
    control: the same per-token FLOPs, the attention of all layers), by the linear layers' pairs."""
    from flashcp.titan.trainer import FlashCPTrainer

    metrics = NS(num_flops_per_token=10**12)
    trainer = _trainer(hybrid, metrics)
    FlashCPTrainer._configure_metrics(trainer)
    cost = FlashCPTrainer._window_cost(trainer)
    attention = hybrid.first_attention
    per_layer = 12 * attention.n_heads * attention.head_dim
    control = window_cost(metrics.dense_flops_per_token, per_layer * len(hybrid.layers), 2, True)
    exact = window_cost(metrics.dense_flops_per_token, per_layer, 2, True)
    assert cost(LENS) == pytest.approx(exact(LENS), rel=1e-12)
    assert cost(LENS) < control(LENS)
    # a rank of one long document: the linear layers would have weighed 4 x its attention
    long_doc, short_docs = cost([SEQ_LEN]), cost([SEQ_LEN // 8] * 8)
    assert control([SEQ_LEN]) - control([SEQ_LEN // 8] * 8) > 3 * (long_doc - short_docs) > 0


@pytest.mark.parametrize("name, flavor", [("qwen3_5_9b", "9B"), ("qwen3_5_27b", "27B")])
def test_the_named_hybrid_shapes_are_torchtitans(name: str, flavor: str):
    """The planner CLI's --linear shapes (config.json keys) price what TorchTitan's registry builds."""
    from torchtitan.models.qwen3_5 import qwen3_5_configs

    from flashcp.plan.linear import hybrid_shape
    from flashcp.titan.models.windows import linear_layers

    assert linear_layers(qwen3_5_configs[flavor](attn_backend="varlen")) == hybrid_shape(name)
