"""Around the training loop: a SIGTERM / SIGINT stops at a step boundary with a checkpoint, a
resumed run applies the config's learning-rate schedule (and logs the rate it applies), a run
restored past its end says so, and TensorBoard keeps one run across launches."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import single_rank, tiny_job, train
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from flashcp.titan.checkpoint import CheckpointError

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def rank():
    with single_rank():
        yield


def run_trainer(cfg: dict, on_step=None) -> tuple[dict[int, float], dict[int, float]]:
    """Train `cfg` in this process: ({step: logged lr}, {step: lr the optimizer applied}).

    `on_step(trainer)` runs after every optimizer step.
    """
    from flashcp.titan.job import trainer_config
    from flashcp.titan.trainer import FlashCPTrainer

    trainer = FlashCPTrainer(trainer_config(cfg))
    logged, applied = {}, {}
    log, opt_step = trainer.metrics_processor.log, trainer.optimizers.step

    def record_log(step, *args, extra_metrics=None, **kwargs):
        logged[step] = next(v for k, v in (extra_metrics or {}).items() if k.startswith("lr/"))
        log(step, *args, extra_metrics=extra_metrics, **kwargs)

    def record_step(*args, **kwargs):
        applied[trainer.step] = trainer.optimizers.optimizers[0].param_groups[0]["lr"]
        opt_step(*args, **kwargs)
        if on_step is not None:
            on_step(trainer)

    trainer.metrics_processor.log = record_log
    trainer.optimizers.step = record_step
    try:
        trainer.train()
    finally:
        trainer.close()
    return logged, applied


def job(dump: Path, steps: int, **sections):
    return tiny_job(dump, training={"steps": steps}, lr_scheduler={"warmup_steps": 1},
                    checkpoint={"enable": True, "interval": 100}, **sections)  # fmt: skip


def test_an_extended_run_applies_and_logs_the_config_schedule(tmp_path, rank, caplog):
    """A 4-step run decays the lr to 0; extended to 6 steps, step 5 must train at the new rate."""
    run_trainer(job(tmp_path, 4))
    logged, applied = run_trainer(job(tmp_path, 6))
    assert sorted(applied) == [5, 6]
    assert applied[5] > 0 and all(logged[s] == pytest.approx(applied[s], rel=1e-9) for s in (5, 6))
    assert "lr schedule differs from the checkpoint's" in caplog.text
    assert "following the config from step 5" in caplog.text


def test_a_run_restored_past_its_steps_is_an_error_and_at_its_end_says_complete(tmp_path, rank, caplog):
    run_trainer(job(tmp_path, 4))
    with pytest.raises(CheckpointError, match=r"restored is at step 4, past \[training\] steps = 3: nothing to train"):
        run_trainer(job(tmp_path, 3))
    assert run_trainer(job(tmp_path, 4))[1] == {}
    assert "the run is already complete (restored step 4 = [training] steps)" in caplog.text


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_at_the_step_boundary_with_a_checkpoint(tmp_path, rank, capsys, signum):
    def signal_at_2(trainer):
        if trainer.step == 2:
            os.kill(os.getpid(), signum)

    _, applied = run_trainer(job(tmp_path, 6), on_step=signal_at_2)
    assert sorted(applied) == [1, 2]  # no KeyboardInterrupt, no further step
    out = capsys.readouterr().out
    folder = tmp_path / "checkpoint" / "step-2"
    assert f"flashcp: {signal.Signals(signum).name}: stopped at step 2, checkpoint saved to {folder}" in out
    _, applied = run_trainer(job(tmp_path, 6))
    assert sorted(applied) == [3, 4, 5, 6]


def test_a_signal_without_checkpoints_says_nothing_was_saved(tmp_path, rank, capsys):
    cfg = tiny_job(tmp_path, training={"steps": 6}, lr_scheduler={"warmup_steps": 1})
    run_trainer(cfg, on_step=lambda t: t.step == 1 and os.kill(os.getpid(), signal.SIGTERM))
    assert "SIGTERM: stopped at step 1, checkpoints are disabled: nothing saved" in capsys.readouterr().out


def scalar_steps(dump: Path, tag: str) -> list[int]:
    runs = sorted((dump / "tb").iterdir())
    assert [r.name for r in runs] == ["run"]
    events = EventAccumulator(str(runs[0]))
    events.Reload()
    return [e.step for e in events.Scalars(tag)]


def test_tensorboard_keeps_one_run_across_a_resume(tmp_path, rank):
    """Steps 1-4 logged, checkpoint at 3, killed; the resumed launch logs 4-6 again: one run, each step once."""
    cfg = tiny_job(tmp_path, training={"steps": 6}, lr_scheduler={"warmup_steps": 1},
                   checkpoint={"enable": True, "interval": 3}, metrics={"enable_tensorboard": True})  # fmt: skip
    train(cfg, stop_after=4)
    train(cfg)
    assert scalar_steps(tmp_path, "loss_metrics/global_avg_loss") == [1, 2, 3, 4, 5, 6]


def test_sigterm_to_the_launcher_saves_and_exits_zero(tmp_path):
    dump = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NGPU": "2"}
    launcher = subprocess.Popen(
        [sys.executable, "-m", "flashcp.titan.launch", "--config", "debug_cpu", "--training.steps", "100000",
         "--parallelism.data_parallel_shard_degree", "1", "--checkpoint.interval", "100000",
         "--job.dump_folder", str(dump)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        log = dump / "logs"
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not any("step: 2/" in p.read_text() for p in log.rglob("stdout.log")):
            time.sleep(0.5)
        launcher.send_signal(signal.SIGTERM)
        out, err = launcher.communicate(timeout=300)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, err[-3000:]
    line = next(s for s in out.splitlines() if "SIGTERM: stopped at step" in s)
    step = int(line.split("stopped at step ")[1].split(",")[0])
    assert (dump / "checkpoint" / f"step-{step}" / "manifest.json").is_file(), line
    assert "Traceback" not in out + err
