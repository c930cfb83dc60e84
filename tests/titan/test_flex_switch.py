"""One override switches a FlashCP job to TorchTitan's own attention and CP (`--model.attention flex`),
to compare both on the same job: its `[flashcp]` table is then ignored with one warning line, the
model is built with TorchTitan's attention and parallelised by TorchTitan's recipe, and where flex
cannot train (CPU) the refusal stays one line with no warning before it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from harness import tiny_job

from flashcp.titan.config import check_layout, ConfigError, load_job, resolve_config_path
from flashcp.titan.launch import node as launch

ROOT = Path(__file__).resolve().parents[2]
FLEX = ["--model.attention", "flex"]
WARNING = "[flashcp] is ignored: model.attention = 'flex' runs TorchTitan's own attention and CP"
CPU_REFUSAL = ("model.attention = 'flex' cannot train on CPU (FlexAttention has no CPU backward, varlen attention "
               "no CPU kernel); use 'flashcp'")  # fmt: skip


def test_the_default_job_switches_with_one_override_and_one_warning():
    cfg = load_job(resolve_config_path("default"), FLEX)
    assert cfg["_warnings"] == [WARNING]
    assert load_job(resolve_config_path("default"))["_warnings"] == []  # FlashCP's own run warns of nothing
    check_layout(cfg, 2, has_cuda=True)  # a GPU machine takes it as it is
    with pytest.raises(ConfigError) as refused:
        check_layout(cfg, 2, has_cuda=False)
    assert str(refused.value) == CPU_REFUSAL


def test_the_ignored_table_is_dropped_and_the_warning_names_no_cp_without_it(tmp_path):
    cfg = tiny_job(tmp_path, model={"attention": "flex"}, flashcp={"backend": "reference", "overlap": True})
    assert cfg["_warnings"] == ["[flashcp] is ignored: model.attention = 'flex' runs TorchTitan's own attention"]
    assert cfg["flashcp"]["backend"] == "auto" and cfg["flashcp"]["overlap"] is False  # the defaults, unused


def test_the_switched_job_builds_torchtitans_attention_and_recipe():
    from torchtitan.models.common.attention import FlexAttention

    from flashcp.titan.launch.job import trainer_config
    from flashcp.titan.models.spec import parallelize_flashcp

    config = trainer_config(load_job(resolve_config_path("default"), FLEX))
    inner = [layer.attention.inner_attention for layer in config.model_spec.model.layers]
    assert all(isinstance(a, FlexAttention.Config) for a in inner)
    assert config.model_spec.parallelize_fn is not parallelize_flashcp and not config.flashcp.enable
    assert config.parallelism.context_parallel_degree == 2  # TorchTitan's CP over the same 2 ranks
    assert config.dataloader.cp_size == 1 and config.dataloader.planner == {"strategy": "per_seq"}


def test_check_prints_the_warning_and_the_cpu_launch_refuses_in_one_line(tmp_path, capsys, monkeypatch):
    from flashcp.titan.config import main as check

    monkeypatch.setattr("torch.cuda.is_available", lambda: True)  # --check on a GPU machine: OK, then the warning
    assert check(["--check", "default", *FLEX]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1:] == [f"warning: {WARNING}"] and "OK for 2 ranks" in out[0]
    monkeypatch.undo()
    monkeypatch.delenv("NGPU", raising=False)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 0)  # the launcher on a machine without GPUs
    assert launch.main([*FLEX, "--job.dump_folder", str(tmp_path / "out")]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # no warning before a refusal
    assert captured.err.splitlines() == [
        "error: no GPU found, so the job was laid out on 2 CPU rank(s) (the job's layout; set NGPU to the ranks "
        f"per node to choose): {CPU_REFUSAL}"
    ]


def test_check_on_cpu_refuses_in_one_line():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # a machine without GPUs, whichever runs the test
    proc = subprocess.run([sys.executable, "-m", "flashcp.titan.config", "--check", "default", *FLEX],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [f"error: {CPU_REFUSAL}"]
