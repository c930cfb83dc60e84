"""The dry run of a pipelined job: one stage measured on fake tensors, GiB per GPU of every pipeline
rank derived from it (flashcp/titan/dryrun/pipeline.py): the first rank holds the embedding, the last
the output, and each rank the saved layer inputs of its schedule's microbatches in flight."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flashcp.titan.dryrun.cli import main
from flashcp.titan.models.offload import layer_input_bytes

JOB = """
[model]
flavor = "custom"
dim = 128
n_layers = 4
n_heads = 4
n_kv_heads = 2
multiple_of = 64
[data]
source = "synthetic"
synthetic_lengths = "wlbllm"
balance = "off"
[training]
seq_len = 4096
steps = 10
local_batch_size = 4
mixed_precision_param = "bfloat16"
[lr_scheduler]
warmup_steps = 1
[parallelism]
context_parallel_degree = 2
pipeline_parallel_degree = 2
pipeline_parallel_schedule = "1F1B"
pipeline_parallel_first_stage_less_layers = 0
pipeline_parallel_last_stage_less_layers = 0
[activation_checkpoint]
mode = "full"
[loss]
chunk_tokens = 256
"""
GIB = 2**30


def _report(tmp_path: Path, capsys, *args: str) -> dict:
    job = tmp_path / "pp.toml"
    job.write_text(JOB)
    assert main(["--config", str(job), "--world-size", "8", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_pipelined_job_reports_every_stage(tmp_path, capsys):
    r = _report(tmp_path, capsys)
    assert r["degrees"]["pp"] == 2 and r["degrees"]["dp_shard"] == 2 and r["degrees"]["cp"] == 2
    pp = r["pipeline"]
    assert (pp["stages"], pp["stages_per_rank"], pp["microbatches"], pp["schedule"]) == (2, 1, 4, "1F1B")
    assert pp["measured"]["world_size"] == 4 and pp["measured"]["layers"] == 2
    first, last = pp["per_rank"]
    assert (first["embedding"], first["output"], last["embedding"], last["output"]) == (True, False, False, True)
    assert (first["in_flight"], last["in_flight"]) == (2, 1)  # 1F1B: p - rank
    measured = pp["measured"]["by_category"]
    one_input = layer_input_bytes(4096, 2, 128, 2) / GIB  # full AC: a layer input per layer and microbatch
    assert first["by_category"]["activations"] == pytest.approx(measured["activations"] + (2 * 2 - 2) * one_input)
    assert last["by_category"]["activations"] == pytest.approx(measured["activations"])
    # the state splits the measured model's (embedding, 2 layers, norm + output) between the ranks
    assert 0 < first["parameters_share"] < 1 and 0 < last["parameters_share"] < 1
    assert first["parameters_share"] + last["parameters_share"] > 1  # the measured model's layers, twice
    # the unsharded float32 gradients of a rank's 2 layers accumulate over the microbatches (no FSDP sync
    # but the last's): per layer q, o 128 x 128, k, v 128 x 64, MLP 3 x 128 x 384, 2 norms of 128
    layer = 2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 384 + 2 * 128
    assert first["by_category"]["gradients"] == pytest.approx(2 * layer * 4 / GIB)
    for s in (first, last):
        assert s["peak_gib"] == pytest.approx(sum(s["by_category"].values()))
    worst = max(pp["per_rank"], key=lambda s: s["peak_gib"])
    assert r["peak_gib"] == pytest.approx(worst["peak_gib"]) and pp["worst_rank"] == worst["rank"]
    for key in ("fits", "by_category", "estimate_gib", "plan", "loss_chunks"):  # the keys of a job without PP
        assert key in r


def test_gpipe_holds_every_microbatch_on_every_stage(tmp_path, capsys):
    pp = _report(tmp_path, capsys, "--parallelism.pipeline_parallel_schedule", "GPipe")["pipeline"]
    assert [s["in_flight"] for s in pp["per_rank"]] == [4, 4]
    one_input = layer_input_bytes(4096, 2, 128, 2) / GIB
    measured = pp["measured"]["by_category"]["activations"]
    assert pp["per_rank"][1]["by_category"]["activations"] == pytest.approx(measured + (4 * 2 - 2) * one_input)
