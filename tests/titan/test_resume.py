"""Around the training loop: a SIGTERM / SIGINT stops at a step boundary with a checkpoint (also
through the launcher, which exits 0), a resumed run applies the config's learning-rate schedule
(and logs the rate it applies), a run restored past its end is an error, and TensorBoard keeps
one run across launches."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from unittest.mock import patch

import pytest
import torch
from harness import single_rank, tiny_job, train
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from flashcp.titan.components.checkpoint import CheckpointError
from flashcp.run.preemption import child_pids, ForwardStop, StopRequest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def rank():
    with single_rank():
        yield


@dataclass
class Run:
    logged: dict[int, float] = field(default_factory=dict)  # step -> lr logged
    applied: dict[int, float] = field(default_factory=dict)  # step -> lr in the optimizer during the step
    changed: dict[int, bool] = field(default_factory=dict)  # step -> whether the step changed the weights


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def run_trainer(cfg: dict, on_step=None, on_init=None) -> Run:
    """Train `cfg` in this process, recording what each step logged and applied.

    `on_step(trainer)` runs after every optimizer step, `on_init()` while the trainer is built.
    """
    from flashcp.titan.launch.job import trainer_config
    from flashcp.titan.trainer import FlashCPTrainer

    configure = FlashCPTrainer._configure_metrics

    def building(self):
        if on_init is not None:
            on_init()
        configure(self)

    with patch.object(FlashCPTrainer, "_configure_metrics", building):
        trainer = FlashCPTrainer(trainer_config(cfg))
    run = Run()
    log, opt_step = trainer.metrics_processor.log, trainer.optimizers.step

    def record_log(step, *args, extra_metrics=None, **kwargs):
        run.logged[step] = next(v for k, v in (extra_metrics or {}).items() if k.startswith("lr/"))
        log(step, *args, extra_metrics=extra_metrics, **kwargs)

    def record_step(*args, **kwargs):
        params = [p for m in trainer.model_parts for p in m.parameters()]
        before = [local(p).detach().clone() for p in params]
        run.applied[trainer.step] = trainer.optimizers.optimizers[0].param_groups[0]["lr"]
        opt_step(*args, **kwargs)
        run.changed[trainer.step] = any(not torch.equal(b, local(p)) for b, p in zip(before, params))
        if on_step is not None:
            on_step(trainer)

    trainer.metrics_processor.log = record_log
    trainer.optimizers.step = record_step
    try:
        trainer.train()
    finally:
        trainer.close()
    return run


def job(dump: Path, steps: int, **sections):
    return tiny_job(dump, training={"steps": steps}, lr_scheduler={"warmup_steps": 1},
                    checkpoint={"enable": True, "interval": 100}, **sections)  # fmt: skip


# ---------------------------------------------------------------- resuming with another schedule


def test_an_extended_run_applies_and_logs_the_config_schedule(tmp_path, rank, caplog):
    """A 4-step run decays the lr to 0; extended to 6 steps, step 5 must train at the new rate."""
    run_trainer(job(tmp_path, 4))
    run = run_trainer(job(tmp_path, 6))
    assert sorted(run.applied) == [5, 6]
    assert run.applied[5] > 0 and all(run.logged[s] == pytest.approx(run.applied[s], rel=1e-9) for s in (5, 6))
    assert run.changed[5]
    assert caplog.text.count("lr schedule differs from the checkpoint's") == 1
    assert "following the config from step 5" in caplog.text


def test_an_unchanged_schedule_resumes_silently(tmp_path, rank, caplog):
    cfg = tiny_job(tmp_path, training={"steps": 6}, lr_scheduler={"warmup_steps": 1},
                   checkpoint={"enable": True, "interval": 3})  # fmt: skip
    train(cfg, stop_after=4)
    run = run_trainer(cfg)
    assert sorted(run.applied) == [4, 5, 6] and all(run.logged[s] == run.applied[s] for s in (4, 5, 6))
    assert "lr schedule differs" not in caplog.text


def test_a_run_restored_past_its_steps_is_an_error_and_at_its_end_says_complete(tmp_path, rank, caplog, capsys):
    run_trainer(job(tmp_path, 4))
    with pytest.raises(CheckpointError, match=r"restored is at step 4, past \[training\] steps = 3: nothing to train"):
        run_trainer(job(tmp_path, 3))
    with pytest.raises(CheckpointError, match=r"restored is at step 4, past \[training\] steps = 1: nothing to train"):
        run_trainer(job(tmp_path, 1))  # a schedule of warmup only: TorchTitan cannot evaluate it past its end
    capsys.readouterr()
    caplog.clear()
    assert run_trainer(job(tmp_path, 4)).applied == {}
    out = capsys.readouterr().out
    assert out.count("flashcp: the run is already complete: the checkpoint at step 4 reached [training] steps = 4; "
                     "nothing to train. To extend it, raise training.steps; to start afresh") == 1
    assert "Training starts" not in caplog.text and "Training completed" not in caplog.text


# ---------------------------------------------------------------- stopping on a signal, in a rank


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_at_the_step_boundary_with_a_checkpoint(tmp_path, rank, capsys, signum):
    def signal_at_2(trainer):
        if trainer.step == 2:
            os.kill(os.getpid(), signum)

    run = run_trainer(job(tmp_path, 6), on_step=signal_at_2)
    assert sorted(run.applied) == [1, 2]  # no KeyboardInterrupt, no further step
    folder = tmp_path / "checkpoint" / "step-2"
    assert f"flashcp: preempted at step 2: checkpoint saved to {folder}\n" in capsys.readouterr().out
    assert sorted(run_trainer(job(tmp_path, 6)).applied) == [3, 4, 5, 6]


def test_a_signal_without_checkpoints_says_nothing_was_saved(tmp_path, rank, capsys):
    cfg = tiny_job(tmp_path, training={"steps": 6}, lr_scheduler={"warmup_steps": 1})
    run_trainer(cfg, on_step=lambda t: t.step == 1 and os.kill(os.getpid(), signal.SIGTERM))
    assert "flashcp: preempted at step 1: checkpoints are disabled, nothing saved" in capsys.readouterr().out
    assert not (tmp_path / "checkpoint").exists()


@pytest.fixture
def sigterm_fails_the_test():
    """SIGTERM's default would kill pytest: raise instead, wherever the trainer does not catch it."""

    def uncaught(signum, frame):
        raise AssertionError("SIGTERM reached the process's own handler")

    previous = signal.signal(signal.SIGTERM, uncaught)
    yield
    signal.signal(signal.SIGTERM, previous)


def test_a_signal_while_the_trainer_is_built_stops_at_the_restored_step(tmp_path, rank, capsys, sigterm_fails_the_test):
    run_trainer(job(tmp_path, 6), on_step=lambda t: t.step == 2 and os.kill(os.getpid(), signal.SIGTERM))
    folder = tmp_path / "checkpoint" / "step-2"
    manifest = (folder / "manifest.json").stat()
    capsys.readouterr()
    run = run_trainer(job(tmp_path, 6), on_init=lambda: os.kill(os.getpid(), signal.SIGTERM))
    assert run.applied == {}
    assert f"flashcp: preempted at step 2: checkpoint saved to {folder}\n" in capsys.readouterr().out
    assert (folder / "manifest.json").stat().st_mtime_ns == manifest.st_mtime_ns  # the restored one, not saved again
    assert signal.getsignal(signal.SIGTERM).__name__ == "uncaught"  # given back on close


@pytest.mark.parametrize("second, code", [(signal.SIGINT, 128 + signal.SIGINT), (signal.SIGTERM, 0)])
def test_a_second_ctrl_c_ends_a_rank_at_once_a_repeated_sigterm_does_not(second, code):
    script = (f"import os, signal, time; from flashcp.run.preemption import StopRequest; s = StopRequest(); "
              f"os.kill(os.getpid(), signal.SIGTERM); os.kill(os.getpid(), {int(second)}); time.sleep(0.5); "
              f"assert s.agreed() == signal.SIGTERM")  # fmt: skip
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == code, result.stderr


def stop_where_rank_1_is_signalled(rank: int, group, at: int) -> list[int]:
    """DistributedPool task: 4 step boundaries; only rank 1 gets a SIGTERM, before boundary `at`."""
    stop = StopRequest()
    stop.connect()
    try:
        seen = []
        for step in range(1, 5):
            if rank == 1 and step == at:
                os.kill(os.getpid(), signal.SIGTERM)
            seen.append(stop.agreed())
        return seen
    finally:
        stop.close()


def test_all_ranks_agree_on_the_step_when_one_rank_is_signalled(gloo_pool):
    pool = gloo_pool(2)
    assert pool.run(stop_where_rank_1_is_signalled, (3,)) == [[0, 0, signal.SIGTERM, signal.SIGTERM]] * 2


# ---------------------------------------------------------------- stopping on a signal, the launcher

RANK_CODE = """
import signal, sys, time
got = []
signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
signal.signal(signal.SIGINT, lambda s, f: got.append(s))
print("ready", flush=True)
deadline = time.monotonic() + 600
while time.monotonic() < deadline and not (got and sys.argv[1] == "obeys"):
    time.sleep(0.01)
print(*got, flush=True)
sys.exit(0 if got else 3)
"""


@pytest.fixture
def fake_ranks():
    """Start stand-ins for ranks in sessions of their own (as torchrun does); 'obeys' ones exit 0 on a signal."""
    procs = []

    def start(*kinds: str) -> list[subprocess.Popen]:
        for kind in kinds:
            proc = subprocess.Popen([sys.executable, "-c", RANK_CODE, kind], stdout=subprocess.PIPE,
                                    text=True, start_new_session=True)  # fmt: skip
            assert proc.stdout.readline() == "ready\n"
            procs.append(proc)
        return procs

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    yield start
    for sig, handler in previous.items():
        signal.signal(sig, handler)
    for proc in procs:
        proc.kill()
        proc.wait()


def forward(procs: list[subprocess.Popen], timeout_s: float) -> ForwardStop:
    stop = ForwardStop(timeout_s, ranks=lambda: [p.pid for p in procs if p.poll() is None])
    stop.install()
    return stop


def test_the_launcher_forwards_ctrl_c_as_sigterm_and_lets_the_ranks_finish(fake_ranks, capfd):
    procs = fake_ranks("obeys", "obeys")
    stop = forward(procs, 60)
    os.kill(os.getpid(), signal.SIGINT)
    assert [p.communicate(timeout=120)[0] for p in procs] == [f"{int(signal.SIGTERM)}\n"] * 2
    assert [p.returncode for p in procs] == [0, 0]
    stop.close()
    assert stop.signum == signal.SIGINT and stop.forced == ""
    assert "flashcp: SIGINT: the ranks stop after their next step and save a checkpoint" in capfd.readouterr().err


def test_a_second_ctrl_c_to_the_launcher_kills_the_ranks(fake_ranks):
    procs = fake_ranks("lingers")
    stop = forward(procs, 60)
    os.kill(os.getpid(), signal.SIGINT)
    os.kill(os.getpid(), signal.SIGTERM)  # a scheduler's too: changes nothing
    time.sleep(0.5)
    assert procs[0].poll() is None and not stop.forced  # asked, not killed
    os.kill(os.getpid(), signal.SIGINT)
    assert procs[0].wait(timeout=120) == -signal.SIGKILL
    stop.close()
    assert stop.forced == "a second SIGINT"


def test_ranks_still_running_after_the_stop_timeout_are_killed(fake_ranks):
    procs = fake_ranks("lingers")
    stop = forward(procs, 1)
    os.kill(os.getpid(), signal.SIGTERM)
    assert procs[0].wait(timeout=120) == -signal.SIGKILL
    assert stop.forced == "FLASHCP_STOP_TIMEOUT = 1 s"


def test_a_signal_before_the_ranks_start_interrupts_the_launch(fake_ranks):
    forward([], 60)
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)


def launch(dump: Path, *args: str) -> subprocess.Popen:
    """run_train.sh's launcher in a session of its own (a terminal's Ctrl-C signals that whole group)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NGPU": "2"}
    env.pop("LOG_RANK", None)
    return subprocess.Popen(
        [sys.executable, "-m", "flashcp.titan.launch", "--config", "debug_cpu",
         "--parallelism.data_parallel_shard_degree", "1", "--job.dump_folder", str(dump), *args],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip


@pytest.mark.parametrize("signum", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)])
def test_a_signal_to_the_launcher_saves_and_exits_zero(tmp_path, signum):
    dump = tmp_path / "out"
    launcher = launch(dump, "--training.steps", "100000", "--checkpoint.interval", "100000")
    try:
        deadline = time.monotonic() + 900  # only catches a hang: on a loaded machine start-up took over 180 s
        while not any("step: 2/" in p.read_text() for p in (dump / "logs").rglob("stdout.log")):
            assert time.monotonic() < deadline and launcher.poll() is None, "the job never reached step 2"
            time.sleep(0.5)
        os.killpg(launcher.pid, signum)
        out, err = launcher.communicate(timeout=300)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, err[-3000:]
    found = re.search(r"flashcp: preempted at step (\d+): checkpoint saved to (\S+)$", out, re.M)
    assert found, out[-3000:]
    step, folder = int(found[1]), Path(found[2])
    assert folder == dump / "checkpoint" / f"step-{step}" and (folder / "manifest.json").is_file()
    assert "Traceback" not in out + err and "death signal" not in err
    if signum == signal.SIGTERM:  # resumed with fewer steps than it trained: one line, exit 2
        result = launch(dump, "--training.steps", str(step - 1))
        out, err = result.communicate(timeout=300)
        assert result.returncode == 2, err[-3000:]
        assert err.strip().splitlines()[-1] == (
            f"error: CheckpointError: the checkpoint restored is at step {step}, past [training] steps = {step - 1}: "
            "nothing to train; raise training.steps to continue this run (or pick checkpoint.load_step)"
        )


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # it ended meanwhile
        return b""


def test_ctrl_c_while_the_ranks_start_ends_the_launch_without_a_traceback(tmp_path):
    launcher = launch(tmp_path / "out", "--training.steps", "100000")
    try:
        first = launcher.stdout.readline()  # printed just before torchrun starts
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not any(b"train.py" in cmdline(p) for p in child_pids(launcher.pid)):
            time.sleep(0.02)
        os.killpg(launcher.pid, signal.SIGINT)  # the ranks are still importing torch
        out, err = launcher.communicate(timeout=300)
        out = first + out
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 128 + signal.SIGINT, out[-3000:] + err[-3000:]
    assert "flashcp: SIGINT while the ranks started: nothing saved" in out
    assert "Traceback" not in out + err


# ---------------------------------------------------------------- TensorBoard


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


def test_tensorboard_of_a_restart_from_scratch_replaces_the_earlier_launch(tmp_path, rank):
    cfg = tiny_job(tmp_path, training={"steps": 3}, metrics={"enable_tensorboard": True})
    train(cfg)
    train(cfg)
    assert scalar_steps(tmp_path, "loss_metrics/global_avg_loss") == [1, 2, 3]
