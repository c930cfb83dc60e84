"""train_configs/debug_pp_cpu.toml through run_train.sh: PP 2 x FlashCP 2 on 4 gloo ranks, the loss
(logged by the last stage's first rank, rank 2) in TensorBoard, a checkpoint of both stages."""

from __future__ import annotations

from test_e2e import run_train, scalars


def test_pp2_x_flashcp2_on_4_ranks(tmp_path):
    dump = tmp_path / "out"
    result = run_train("--config", "debug_pp_cpu", "--training.steps", "3", "--job.dump_folder", str(dump))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "4 CPU (gloo) rank(s)" in result.stdout and "step: 3/3" in result.stdout
    losses = scalars(dump)["loss_metrics/global_avg_loss"]
    assert len(losses) == 3 and all(7.0 < loss < 9.0 for loss in losses), losses  # ln(4096) = 8.3 at the start
    assert (dump / "checkpoint/step-3/.metadata").is_file()
