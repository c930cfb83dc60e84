"""A model with sliding-window layers (gpt-oss) is counted by what it computes: the MFU's attention FLOPs,
the loader's window cost and the logged exchange count a window layer's query at most W keys and its
exchange at most W - 1 rows before each cut shard, against brute-force counts over (query, key) pairs
and rows."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from flashcp import plan_shards
from flashcp.costmodel.proxy import ATTENTION_TFLOPS, attention_factor, DENSE_MFU, H100_BF16_TFLOPS, window_cost
from flashcp.plan import CAUSAL, Workload
from flashcp.titan.config import load_job, resolve_config_path  # flashcp.titan before torchtitan: its shims
from flashcp.titan.launch.job import trainer_config
from torchtitan.distributed.activation_checkpoint import FullAC  # noqa: I001

SEQ_LEN = 1024
LENS = [700, 60, 128, 136]  # one longer than a rank's 512 tokens: the plan cuts it


@pytest.fixture(scope="module")
def gpt_oss():
    """The tiny gpt-oss of debug_gpt_oss_cpu (4 layers, window 128 in layers 0 and 2) as the trainer builds it."""
    return trainer_config(load_job(resolve_config_path("debug_gpt_oss_cpu"))).model_spec.model


def _trainer(model_config, metrics) -> NS:
    return NS(metrics_processor=metrics, model_config=model_config, parallel_dims=NS(tp=1, cp=2),
              cp_ranks_per_node=0, flashcp=NS(comm="compact"),
              config=NS(training=NS(steps=1, seq_len=SEQ_LEN, mixed_precision_param="bfloat16"),
                        activation_checkpoint=FullAC.Config()))  # fmt: skip


def _metrics():
    from torchtitan.distributed import ParallelDims

    from flashcp.titan.components.metrics import FlashCPMetrics

    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=2, tp=1, pp=1, ep=1, world_size=2)
    metrics = FlashCPMetrics(FlashCPMetrics.Config(peak_tflops=1.0), parallel_dims=dims)
    metrics.num_flops_per_token = 10**12
    return metrics


def _log_window(metrics, plan, tokens: int = SEQ_LEN) -> dict:
    """What `metrics.log` writes for one step over `plan`'s window of `tokens` tokens."""
    logged = []
    metrics.logger.log = lambda values, step: logged.append(values)
    metrics.record_window(plan, plan_ms=1.0)
    metrics.ntokens_since_last_log += tokens
    metrics.log(step=1, global_avg_loss=1.0, global_max_loss=1.0, grad_norm=1.0)
    return logged[0]


def _windows(model_config) -> list[int | None]:
    return [layer.attention.inner_attention.window for layer in model_config.layers]


def _pairs(lens: list[int], window: int | None) -> int:
    """(query, key) pairs of one layer, pair by pair: a key at or before its query in the same document,
    fewer than `window` positions back."""
    return sum(1 for d in lens for q in range(d) for k in range(q + 1) if window is None or q - k < window)


def window_rows(plan, window: int) -> tuple[int, int]:
    """The busiest rank's rows one window layer receives, token by token: compact, the (N - 1) x largest
    sum over a rank's non-last shards of their last min(length, W - 1) rows; needed, the rows of other
    ranks within W - 1 before a shard's start."""
    owner = {(s.doc, t): r for r, shards in enumerate(plan.ranks) for s in shards
             for t in range(s.start, s.start + s.length)}  # fmt: skip
    last = {doc: max(t for d, t in owner if d == doc) for doc, _ in owner}
    sent = [sum(min(s.length, window - 1) for s in shards if s.start + s.length - 1 != last[s.doc])
            for shards in plan.ranks]  # fmt: skip
    needed = [len({(s.doc, t) for s in shards for t in range(max(0, s.start - window + 1), s.start)
                   if owner[s.doc, t] != r}) for r, shards in enumerate(plan.ranks)]  # fmt: skip
    return (plan.cp_size - 1) * max(sent), max(needed)


def test_the_mfu_counts_window_layers_by_the_pairs_they_attend(gpt_oss):
    from flashcp.titan.trainer import FlashCPTrainer

    windows = _windows(gpt_oss)
    assert windows == [128, None, 128, None]
    metrics = _metrics()
    FlashCPTrainer._configure_metrics(_trainer(gpt_oss, metrics))
    logged = [_log_window(metrics, plan_shards(LENS, 2, "flashcp"))]

    attention = gpt_oss.first_attention
    per_pair = 12 * attention.n_heads * attention.head_dim  # QK^T and PV: 2 FLOPs a multiply-add, x3 with backward
    attended = sum(_pairs(LENS, w) for w in windows)
    flops = metrics.dense_flops_per_token * SEQ_LEN + per_pair * attended
    assert logged[0]["tflops"] * 1e12 / logged[0]["throughput(tps)"] == pytest.approx(flops / SEQ_LEN, rel=1e-12)
    assert attended < 0.8 * len(windows) * _pairs(LENS, None)  # what it counted before: every layer full
    # TorchTitan's count takes every layer as full over seq_len keys: the dense part is what remains
    assert metrics.dense_flops_per_token == 10**12 - per_pair * len(windows) * SEQ_LEN


@pytest.mark.parametrize("window_comm", [None, "compact", "full", "two_level"])
def test_the_log_reports_a_window_layers_rows_apart(gpt_oss, window_comm):
    """A window layer's compact exchange sends the last min(length, W - 1) rows of each non-last shard;
    its needed one the rows of other ranks within W - 1 before each shard's start; the exchange its
    layers run (`window`) is the metrics' `window_comm`: needed by default (auto beside compact), the
    full all-gather's rows with full, the needed rows with two_level."""
    from flashcp.titan.trainer import FlashCPTrainer

    metrics, window = _metrics(), 128
    FlashCPTrainer._configure_metrics(_trainer(gpt_oss, metrics))
    if window_comm is not None:
        metrics.window_comm = window_comm
    plan = plan_shards(LENS, 4, "flashcp")  # on 4 ranks, where compact pads to the busiest sender
    logged = [_log_window(metrics, plan)]

    compact, needed = window_rows(plan, window)
    assert plan.metrics()["split_docs"] >= 1 and compact > needed
    m, row = logged[0], metrics.kv_row_bytes
    assert m["flashcp/kv_recv_bytes_per_layer_window_compact"] == compact * row
    assert m["flashcp/kv_recv_bytes_per_layer_window_needed"] == needed * row
    assert m["flashcp/kv_recv_bytes_per_layer_window_compact"] < m["flashcp/kv_recv_bytes_per_layer_compact"]
    used = {None: needed, "compact": compact, "full": 3 * SEQ_LEN // 4, "two_level": needed}[window_comm]
    assert m["flashcp/kv_recv_bytes_per_layer_window"] == used * row


def test_a_model_without_window_layers_logs_no_window_rows():
    metrics = _metrics()
    metrics.kv_row_bytes = 8
    logged = [_log_window(metrics, plan_shards(LENS, 2, "flashcp"), tokens=0)]
    assert metrics.attention_workload is CAUSAL
    assert "flashcp/kv_recv_bytes_per_layer_compact" in logged[0]
    assert not any("per_layer_window" in key for key in logged[0])


def test_the_balance_prices_window_layers_by_the_keys_they_see(gpt_oss):
    """The loader's cost of a window (seconds on one rank) prices the full layers per causal pair and the
    window layers at W keys per token: at or above the pair-by-pair price, by at most W (W - 1) / 2
    pairs per document, and far below pricing every layer as full."""
    from flashcp.titan.trainer import FlashCPTrainer

    metrics = NS(num_flops_per_token=10**12)
    trainer = _trainer(gpt_oss, metrics)
    FlashCPTrainer._configure_metrics(trainer)
    cost = FlashCPTrainer._window_cost(trainer)
    assert metrics.attention_workload == Workload(full_layers=2, window_layers=2, window=128)

    windows = _windows(gpt_oss)
    per_layer_pair = metrics.attention_flops_per_pair / len(windows) * attention_factor(True) / (
        ATTENTION_TFLOPS * 1e12)  # fmt: skip
    dense = metrics.dense_flops_per_token * 8 / 6 / (DENSE_MFU * H100_BF16_TFLOPS * 1e12)
    exact = (dense * SEQ_LEN + per_layer_pair * sum(_pairs(LENS, w) for w in windows)) / 2
    slack = per_layer_pair * windows.count(128) * len(LENS) * 128 * 127 / 2 / 2
    assert exact <= cost(LENS) <= exact + slack
    causal = window_cost(metrics.dense_flops_per_token, metrics.attention_flops_per_pair, 2, True)
    assert cost(LENS) < causal(LENS)
    assert causal == window_cost(metrics.dense_flops_per_token, metrics.attention_flops_per_pair, 2, True, CAUSAL)


def test_a_model_of_window_layers_only_is_not_balanced():
    with pytest.raises(ValueError, match=r"sliding-window layers only .*balance = 'off'"):
        window_cost(6e9, 1e5, 2, workload=Workload(full_layers=0, window_layers=4, window=128))
