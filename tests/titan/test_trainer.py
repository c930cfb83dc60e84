"""The trainer in this process (one gloo rank): resuming, checkpoint safety, errors and metrics."""

from __future__ import annotations

import re
import shutil

import pytest
from harness import single_rank, tiny_job, train

import train as train_py
from flashcp.titan.components.checkpoint import CheckpointError
from flashcp.titan.components.metrics import attention_pairs


@pytest.fixture
def rank():
    with single_rank():
        yield


def checkpoint_job(dump, checkpoint=None, training=None, **sections):
    """The tiny job for 6 steps with a checkpoint every 3."""
    return tiny_job(
        dump,
        training={"steps": 6, **(training or {})},
        checkpoint={"enable": True, "interval": 3, **(checkpoint or {})},
        **sections,
    )


def test_resume_continues_exactly(tmp_path):
    """6 steps in one run == 3 steps, a stop, a resumed run of 3 more (same losses, bit for bit)."""
    with single_rank():
        whole = train(checkpoint_job(tmp_path / "whole"))
    with single_rank():
        first = train(checkpoint_job(tmp_path / "split"), stop_after=3)
    # A save of step 5 that was interrupted before DCP wrote its metadata must not be resumed from.
    (tmp_path / "split/checkpoint/step-5").mkdir()
    (tmp_path / "split/checkpoint/step-5/__0_0.distcp").write_bytes(b"partial")
    with single_rank():
        rest = train(checkpoint_job(tmp_path / "split"))
    assert sorted(whole) == [1, 2, 3, 4, 5, 6]
    assert first == {s: whole[s] for s in (1, 2, 3)}
    assert rest == {s: whole[s] for s in (4, 5, 6)}  # exact: same data cursor, weights, optimizer, LR


def test_chosen_missing_incomplete_and_mismatched_checkpoints(tmp_path, rank):
    train(checkpoint_job(tmp_path / "a"), stop_after=3)
    (tmp_path / "a/checkpoint/step-5").mkdir()
    with pytest.raises(CheckpointError, match=r"= 4: .*step-4 does not exist; complete checkpoints: \[3\]"):
        train(checkpoint_job(tmp_path / "a", checkpoint={"load_step": 4}))
    with pytest.raises(CheckpointError, match=r"step-5 is damaged: no \.metadata \(an incomplete save, or not a DCP"):
        train(checkpoint_job(tmp_path / "a", checkpoint={"load_step": 5}))
    shutil.rmtree(tmp_path / "a/checkpoint/step-5")
    with pytest.raises(CheckpointError, match=r"step-3 does not fit this job"):
        train(checkpoint_job(tmp_path / "a", model={"dim": 64}))
    resumed = train(checkpoint_job(tmp_path / "a", checkpoint={"load_step": 3}, training={"steps": 4}))
    assert resumed.keys() == {4}


@pytest.mark.parametrize(
    "case, args, message",
    [
        ("empty dataset", ["--data.source", "{tmp}/empty.jsonl"], "DataError: empty dataset"),
        ("document too long", ["--data.max_doc_tokens", "50"], "DataError: .* more than .*max_doc_tokens=50"),
        ("missing tokenizer", ["--data.tokenizer", "{tmp}/no.json"], "TokenizerError: tokenizer file not"),
        ("bad override", ["--flashcp.comm", "zigzag"], r"ConfigError: \[flashcp\] comm must be one of"),
    ],
)
def test_bad_data_and_config_end_with_one_line(tmp_path, capsys, case, args, message):
    (tmp_path / "empty.jsonl").write_text("")
    job = tmp_path / "job.toml"
    job.write_text(
        f'[job]\ndump_folder = "{tmp_path}/out"\n'
        '[model]\nflavor = "custom"\ndim = 32\nn_layers = 1\nn_heads = 2\n'
        '[training]\nseq_len = 128\nsteps = 2\nmixed_precision_param = "float32"\n[data]\nprefetch = 0\n'
        '[parallelism]\ndata_parallel_shard_degree = 1\n[flashcp]\nbackend = "reference"\n'
        '[lr_scheduler]\nwarmup_steps = 1\n'
    )
    with single_rank():
        code = train_py.main(["--config", str(job), *[a.format(tmp=tmp_path) for a in args]])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, case
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert re.search(message, err[0]), err[0]


def test_seed_checkpoint_fixes_initial_weights(tmp_path, rank):
    seed = checkpoint_job(tmp_path / "seed", checkpoint={"create_seed_checkpoint": True})
    train(seed, seed_checkpoint=True)
    assert (tmp_path / "seed/checkpoint/step-0/.metadata").is_file()
    start = {"enable": True, "initial_load_path": str(tmp_path / "seed/checkpoint/step-0")}
    a = train(tiny_job(tmp_path / "a", checkpoint=start))
    b = train(tiny_job(tmp_path / "b", checkpoint=start, training={"seed": 7}))
    assert a == b  # the weights come from the seed; the data order does not depend on training.seed


def test_attention_is_swapped_from_outside(tmp_path):
    """FlashCP replaces only the inner attention; TorchTitan's own attention keeps its CP path."""
    from torchtitan.models.common.attention import FlexAttention

    from flashcp.titan.models.attention import FlashCPAttention
    from flashcp.titan.launch.job import trainer_config
    from flashcp.titan.models.spec import parallelize_flashcp

    ours = trainer_config(tiny_job(tmp_path, flashcp={"backend": "reference", "overlap": True},
                                   parallelism={"context_parallel_degree": 2}))  # fmt: skip
    inner = [layer.attention.inner_attention for layer in ours.model_spec.model.layers]
    assert all(isinstance(a, FlashCPAttention.Config) for a in inner)
    assert all(a.backend == "reference" and a.overlap for a in inner)
    assert ours.model_spec.parallelize_fn is parallelize_flashcp
    assert ours.dataloader.cp_size == 2 and ours.dataloader.planner["strategy"] == "flashcp"
    assert ours.training.local_batch_size == 1 and ours.training.disable_cuda_graphs

    theirs = trainer_config(tiny_job(tmp_path, model={"attention": "flex"}, flashcp=None,
                                     parallelism={"context_parallel_degree": 2}))  # fmt: skip
    assert isinstance(theirs.model_spec.model.layers[0].attention.inner_attention, FlexAttention.Config)
    assert theirs.model_spec.parallelize_fn is not parallelize_flashcp and not theirs.flashcp.enable
    assert theirs.dataloader.cp_size == 1  # TorchTitan shards the window itself


def test_document_positions_restart_per_document():
    from flashcp.titan.trainer import document_positions

    assert document_positions([3, 1, 2]).tolist() == [0, 1, 2, 0, 0, 1]


def test_metrics_count_document_masked_flops_and_plan_figures():
    """FLOPs count the (query, key) pairs the document mask keeps; plan figures are per window."""
    from torchtitan.distributed import ParallelDims

    from flashcp import plan_shards
    from flashcp.titan.components.metrics import FlashCPMetrics

    assert attention_pairs([1, 2, 3]) == 1 + 3 + 6
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=2, tp=1, pp=1, ep=1, world_size=2)
    metrics = FlashCPMetrics(FlashCPMetrics.Config(peak_tflops=1.0), parallel_dims=dims)
    metrics.dense_flops_per_token, metrics.attention_flops_per_pair, metrics.kv_row_bytes = 600, 12, 8
    logged = []
    metrics.logger.log = lambda values, step: logged.append(values)
    plans = [plan_shards([96, 32], 2, "flashcp"), plan_shards([128], 2, "per_doc")]
    for plan in plans:
        metrics.record_window(plan, plan_ms=2.0)
        metrics.ntokens_since_last_log += plan.context
    metrics.data_loading_times.append(0.0)
    metrics.log(step=1, global_avg_loss=5.0, global_max_loss=6.0, grad_norm=1.0)

    m = logged[0]
    flops = 600 * 256 + 12 * (96 * 97 // 2 + 32 * 33 // 2 + 128 * 129 // 2)  # not 12 * 2 * 128**2
    assert m["tflops"] * 1e12 / m["throughput(tps)"] == pytest.approx(flops / 256)
    assert m["mfu(%)"] == pytest.approx(100 * m["tflops"])
    expected = [p.metrics(num_kv_heads=1, head_dim=1, dtype_bytes=1) for p in plans]
    assert m["flashcp/imbalance"] == pytest.approx(sum(e["imbalance"] for e in expected) / 2)
    assert m["flashcp/kv_recv_bytes_per_layer_compact"] == 8 * sum(e["comm_compact_tokens"] for e in expected) / 2
    assert m["flashcp/split_docs"] == sum(e["split_docs"] for e in expected) / 2
    assert m["flashcp/planning_ms"] == 2.0 and "loss_metrics/global_max_loss" not in m  # CP > 1
    compact, full = (sum(e[f"comm_{mode}_tokens"] for e in expected) for mode in ("compact", "full"))
    assert m["flashcp/comm_compact_over_full"] == pytest.approx(compact / full)

    # MLA: the exchange moves latent rows (here 2 bytes against K/V's 8), `kv: x full` is still
    # against the K/V all-gather of the same plans
    metrics.exchange_row_bytes = 2
    for plan in plans:
        metrics.record_window(plan, plan_ms=2.0)
        metrics.ntokens_since_last_log += plan.context
    metrics.log(step=2, global_avg_loss=5.0, global_max_loss=6.0, grad_norm=1.0)
    m = logged[1]
    assert m["flashcp/kv_recv_bytes_per_layer_compact"] == 2 * compact / 2
    assert m["flashcp/kv_recv_bytes_per_layer_full"] == 2 * full / 2
    assert m["flashcp/comm_compact_over_full"] == pytest.approx(2 * compact / (8 * full))


def test_metrics_log_a_mixtures_shares_of_the_steps_since_the_last_log_and_so_far():
    """A mixture's `mix:` shares are of the tokens the batches since the last log added, `so far`
    (data/tokens, data/token_share) the loader's totals of the last batch."""
    from torchtitan.distributed import ParallelDims

    from flashcp import plan_shards
    from flashcp.titan.components.metrics import FlashCPMetrics

    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1)
    metrics = FlashCPMetrics(FlashCPMetrics.Config(peak_tflops=1.0), parallel_dims=dims)
    logged = []
    metrics.logger.log = lambda values, step: logged.append(values)
    # (long, short) so far and of them new, of each batch: two at step 1, one at step 2
    for step, batches in enumerate(([(96, 32, 96, 32), (160, 96, 64, 64)], [(160, 224, 0, 128)]), start=1):
        for so_far_long, so_far_short, new_long, new_short in batches:
            metrics.record_window(plan_shards([128], 1, "per_doc"), 1.0, None,
                                  {"long": so_far_long, "short": so_far_short},
                                  {"long": new_long, "short": new_short})  # fmt: skip
            metrics.ntokens_since_last_log += 128
        metrics.log(step=step, global_avg_loss=5.0, global_max_loss=6.0, grad_norm=1.0)

    assert [m["data/step_token_share/long"] for m in logged] == [160 / 256, 0.0]
    assert [m["data/token_share/long"] for m in logged] == [160 / 256, 160 / 384]
    assert [(m["data/tokens/long"], m["data/tokens/short"]) for m in logged] == [(160, 96), (160, 224)]
    line = metrics._console_line(2, logged[1], 0.0)
    assert "mix: long 0.0% short 100.0% (so far long 41.7% short 58.3%)" in line


def test_dispatch_is_built_in_the_loader_thread_not_the_main_thread(tmp_path, rank, monkeypatch):
    """With prefetching, the main thread only receives each window's dispatch ready-made."""
    import threading

    from flashcp import dispatch as dispatch_module
    from flashcp.titan import trainer

    threads = []

    def recording(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return dispatch_module.build_dispatch(*args, **kwargs)

    monkeypatch.setattr(trainer, "build_dispatch", recording)
    losses = train(tiny_job(tmp_path, data={"prefetch": 2}, parallelism={"context_parallel_degree": 1}))
    assert sorted(losses) == [1, 2, 3, 4]
    assert len(threads) >= 4 and set(threads) == {"flashcp-data"}


def test_the_log_names_the_data_and_the_tokenizer_once(tmp_path, rank, caplog):
    from flashcp.data.sources import DEFAULT_CORPUS, DEFAULT_TOKENIZER

    train(tiny_job(tmp_path, training={"steps": 1}))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("data: ")]
    assert len(lines) == 1, lines
    assert DEFAULT_CORPUS.name.removesuffix(".gz") in lines[0], lines[0]
    assert f"tokenizer {DEFAULT_TOKENIZER} (4096 tokens)" in lines[0], lines[0]


@pytest.mark.parametrize("mla", [False, True], ids=["GQA", "MLA"])
def test_the_trainer_tells_the_metrics_its_kv_and_exchange_rows(mla):
    """GQA: K/V rows of the KV heads this rank holds, the exchange moving them; MLA (DeepSeek-V3's
    128 heads of 192 + 128, latent 512 + 64): K/V rows of every head for `kv: x full`, the exchange
    moving 576-value latent rows; attention FLOPs per pair count QK at its head dim and PV at V's."""
    from types import SimpleNamespace as NS

    from flashcp.titan.trainer import FlashCPTrainer

    if mla:
        attention = NS(n_heads=128, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    else:
        attention = NS(n_heads=32, n_kv_heads=8, head_dim=128)
    trainer = NS(metrics_processor=NS(num_flops_per_token=10**12), parallel_dims=NS(tp=2 if not mla else 1),
                 model_config=NS(first_attention=attention, layers=[None] * 4, dim=4096), cp_ranks_per_node=0,
                 config=NS(training=NS(steps=10, seq_len=1024, mixed_precision_param="bfloat16")),
                 flashcp=NS(comm="compact"))  # fmt: skip
    FlashCPTrainer._configure_metrics(trainer)
    m = trainer.metrics_processor
    if mla:
        assert (m.kv_row_bytes, m.exchange_row_bytes) == (128 * (192 + 128) * 2, 576 * 2)
        assert m.attention_flops_per_pair == 6 * 4 * 128 * (192 + 128)
    else:
        assert (m.kv_row_bytes, m.exchange_row_bytes) == (2 * 4 * 128 * 2, 0)
        assert m.attention_flops_per_pair == 12 * 4 * 32 * 128
