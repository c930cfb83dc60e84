"""run_train.sh end to end on gloo ranks: FSDP2 x FlashCP on 4 ranks, FlashCP CP=2 on 2 ranks,
and job errors that end with one line instead of a traceback. Each launch costs ~10-20 s of
process start-up, so the many other cases live in the in-process tests (the job errors, found
before any rank starts, once through run_train.sh and each through the launcher's `main`)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = Path(__file__).resolve().parents[2]
FLASHCP_SCALARS = (
    "flashcp/imbalance",
    "flashcp/kv_recv_bytes_per_layer_compact",
    "flashcp/kv_recv_bytes_per_layer_full",
    "flashcp/split_docs",
    "flashcp/planning_ms",
)


def run_train(*args: str, ngpu: int | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("NGPU", "LOG_RANK")}
    if ngpu is not None:
        env["NGPU"] = str(ngpu)
    return subprocess.run(
        [str(ROOT / "run_train.sh"), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )


def scalars(dump: Path) -> dict[str, list[float]]:
    runs = sorted((dump / "tb").iterdir())
    assert len(runs) == 1, runs
    events = EventAccumulator(str(runs[0]))
    events.Reload()
    return {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


@pytest.mark.slow
def test_fsdp2_x_flashcp2_on_4_ranks(tmp_path):
    dump = tmp_path / "out"
    result = run_train("--config", "debug_cpu", "--training.steps", "3", "--job.dump_folder", str(dump))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "4 CPU (gloo) rank(s)" in result.stdout and "step: 3/3" in result.stdout
    tb = scalars(dump)
    assert len(tb["loss_metrics/global_avg_loss"]) == 3
    assert all(len(tb[name]) == 3 for name in FLASHCP_SCALARS)
    assert all(x >= 1.0 for x in tb["flashcp/imbalance"])
    assert tb["flashcp/kv_recv_bytes_per_layer_compact"] <= tb["flashcp/kv_recv_bytes_per_layer_full"]
    assert (dump / "checkpoint/step-3/.metadata").is_file()
    # [validation] of debug_cpu: after step 1 (freq 5), through FSDP 2 x FlashCP 2
    assert len(tb["validation/loss"]) == 1 and "validation step 1: loss" in result.stdout
    assert {"validation/loss_by_position/0-128", "validation/loss_by_position/256-512"} <= set(tb)


def test_flashcp_cp2_on_2_ranks(tmp_path):
    dump = tmp_path / "out"
    result = run_train(
        "--config", "debug_cpu", "--parallelism.data_parallel_shard_degree", "1", "--training.steps", "3",
        "--checkpoint.enable", "false", "--job.dump_folder", str(dump), ngpu=2,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "2 CPU (gloo) rank(s)" in result.stdout
    tb = scalars(dump)
    assert len(tb["loss_metrics/global_avg_loss"]) == 3 and all(len(tb[n]) == 3 for n in FLASHCP_SCALARS)


ERRORS = [
    ("bad config", ["--flashcp.backend", "cuda"], "error: [flashcp] backend must be one of auto, "),
    ("impossible layout", [], "error: [parallelism] degrees multiply to 4 (replicate 1 x shard 2 x cp 2"),
    ("empty dataset",
     ["--data.source", "{tmp}/empty.jsonl", "--parallelism.data_parallel_shard_degree", "1",
      "--parallelism.context_parallel_degree", "1"],
     "error: empty dataset"),
]  # fmt: skip
NGPU = {"empty dataset": 1, "impossible layout": 3}


def test_a_job_error_through_run_train_sh_ends_with_one_line(tmp_path):
    case, args, message = ERRORS[0]
    result = run_train("--config", "debug_cpu", "--job.dump_folder", str(tmp_path / "out"), *args)
    assert result.returncode == 2, case
    assert "Traceback" not in result.stdout + result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(message), result.stderr[-2000:]
    assert "rank(s)" not in result.stdout  # found before any rank was started


@pytest.mark.parametrize("case, args, message", ERRORS)
def test_job_errors_end_with_one_line(tmp_path, capsys, monkeypatch, case, args, message):
    """The launcher's checks (its `main`, here in this process; run_train.sh execs it, see above)."""
    from flashcp.titan.launch import node

    (tmp_path / "empty.jsonl").write_text("")
    args = [a.format(tmp=tmp_path) for a in args]
    monkeypatch.delenv("LOG_RANK", raising=False)
    if case in NGPU:
        monkeypatch.setenv("NGPU", str(NGPU[case]))
    else:
        monkeypatch.delenv("NGPU", raising=False)
    capsys.readouterr()
    assert node.main(["--config", "debug_cpu", "--job.dump_folder", str(tmp_path / "out"), *args]) == 2, case
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    assert err.strip().splitlines()[-1].startswith(message), err[-2000:]
    assert "rank(s)" not in out  # found before any rank was started
