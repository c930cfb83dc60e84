"""`python -m flashcp.titan.dryrun`: a tiny job as rank 0 of 8 on fake tensors prints one JSON object
with the peak by category, and a GPU too small for it exits 1 with one line naming the biggest term."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
JOB = """
[model]
flavor = "custom"
dim = 64
n_layers = 2
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
mixed_precision_param = "bfloat16"
[lr_scheduler]
warmup_steps = 1
[parallelism]
context_parallel_degree = 4
[activation_checkpoint]
mode = "full"
[loss]
chunk_tokens = 256
"""


def _dry_run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    job = tmp_path / "tiny.toml"
    job.write_text(JOB)
    cmd = [sys.executable, "-m", "flashcp.titan.dryrun", "--config", str(job), "--world-size", "8", "--json", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)


def test_dry_run_prints_the_peak_by_category_as_one_json_object(tmp_path):
    proc = _dry_run(tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = proc.stdout.strip().splitlines()
    report = json.loads(line)
    assert report["fits"] is True and report["gpu_gib"] == 80.0
    assert set(report["by_category"]) >= {"parameters", "gradients", "optimizer_states", "activations",
                                          "flashcp_buffers", "loss"}  # fmt: skip
    assert report["peak_gib"] > 0 and report["peak_gib"] >= max(report["by_category"].values())
    assert report["degrees"] == {"dp_replicate": 1, "dp_shard": 2, "cp": 4, "tp": 1}
    assert report["loss_chunks"] == 4 and 0 < report["plan"]["imbalance"]


def test_a_gpu_too_small_exits_1_naming_the_biggest_term(tmp_path):
    proc = _dry_run(tmp_path, "--gpu-gib", "1e-6", "--reserve-gib", "0")
    assert proc.returncode == 1
    assert json.loads(proc.stdout)["fits"] is False
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: does not fit:") and "biggest term:" in last
