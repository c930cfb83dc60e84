"""The launcher owns its run: ranks die with it, one run per dump folder, output folders checked
before launch, a failed run's last line names the real cause and rank, `--help`, `--config=`."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed.checkpoint.api as dcp_api

import train
from flashcp.titan.launch import node as launch
from flashcp.run.ownership import check_writable, FolderInUse, LOCK_NAME, NotWritable, RunLock

ROOT = Path(__file__).resolve().parents[2]
PYTHON = sys.executable


def ranks_of(launcher_pid: int, marker: bytes = b"train.py") -> list[int]:
    """PIDs of train.py processes (or others whose command line holds `marker`) started by the launcher
    `launcher_pid` (found by their environment)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if marker in cmdline and f"FLASHCP_LAUNCHER={launcher_pid}".encode() in env:
            found.append(int(proc.name))
    return found


def wait_for(predicate, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.5)
    return predicate()


def test_ranks_die_when_the_launcher_is_sigkilled(tmp_path):
    dump = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NGPU": "2"}
    launcher = subprocess.Popen(
        [PYTHON, "-m", "flashcp.titan.launch", "--config", "debug_cpu", "--training.steps", "100000",
         "--parallelism.data_parallel_shard_degree", "1", "--checkpoint.enable", "false",
         "--job.dump_folder", str(dump)],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        assert wait_for(lambda: len(ranks_of(launcher.pid)) == 2, 600), "the ranks never started"
        # Each rank is in a session of its own, so killing the launcher alone must take them down.
        assert all(os.getsid(pid) != os.getsid(launcher.pid) for pid in ranks_of(launcher.pid))
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        assert wait_for(lambda: not ranks_of(launcher.pid), 300), f"orphaned ranks: {ranks_of(launcher.pid)}"
    finally:
        for pid in ranks_of(launcher.pid):
            os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()


@pytest.mark.parametrize("sig, how", [(signal.SIGKILL, r"exited with code -9 \(killed by SIGKILL\) \(.*\)"),
                                      pytest.param(signal.SIGSTOP, r"is stopped \(SIGSTOP or a debugger\) and does not "
                                                   "answer; it was killed", marks=pytest.mark.slow)])  # fmt: skip
def test_a_planning_worker_killed_or_stopped_is_the_launchers_last_line(tmp_path, sig, how):
    """CP = 2 with the planning worker (the default): one rank's worker SIGKILLed or SIGSTOPped mid-run
    ends the run with its rank's line naming the worker, its PID and what happened, not a broken
    pipe, nor a collective's time-out 100 s later."""
    launcher = subprocess.Popen(
        [PYTHON, "-m", "flashcp.titan.launch", "--config", "debug_cpu", "--training.steps", "100000",
         "--parallelism.data_parallel_shard_degree", "1", "--checkpoint.enable", "false",
         "--validation.enable", "false", "--job.dump_folder", str(tmp_path / "out")],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "NGPU": "2"}, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert wait_for(lambda: len(ranks_of(launcher.pid, b"flashcp.data.plan_worker")) == 2, 600), "no workers"
        worker = ranks_of(launcher.pid, b"flashcp.data.plan_worker")[0]
        os.kill(worker, sig)
        _, stderr = launcher.communicate(timeout=600)  # only catches a hang
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for pid in ranks_of(launcher.pid) + ranks_of(launcher.pid, b"flashcp.data.plan_worker"):
            os.kill(pid, signal.SIGKILL)
    last = stderr.strip().splitlines()[-1]
    assert launcher.returncode == 1, stderr[-2000:]
    assert re.fullmatch(rf"error: rank [01] failed \(exit code 1\): WorkerError: the planning worker process "
                        rf"\(pid {worker}\) {how}", last), last


def test_a_second_launch_into_a_held_folder_is_refused_naming_the_holder(tmp_path, capsys):
    dump = tmp_path / "out"
    with RunLock(dump):
        code = launch.main(["--config", "debug_cpu", "--job.dump_folder", str(dump)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert f"{dump} is in use by the run of PID {os.getpid()} on host" in err[0]
    assert not (dump / "logs").exists() or not any((dump / "logs").iterdir())  # nothing was started


def test_a_lock_left_by_a_killed_run_is_taken_over_and_named(tmp_path):
    dump = tmp_path / "out"
    holder = subprocess.Popen(
        [PYTHON, "-c", "import sys, time; from flashcp.run.ownership import RunLock; "
         f"RunLock({str(dump)!r}).acquire(); print('held', flush=True); time.sleep(600)"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(FolderInUse, match=f"PID {holder.pid} on host"):
        RunLock(dump).acquire()
    holder.kill()
    holder.wait()
    lock = RunLock(dump).acquire()
    try:
        assert lock.taken_over["pid"] == holder.pid
    finally:
        lock.release()
    again = RunLock(dump).acquire()  # a clean release leaves no holder behind
    assert again.taken_over is None
    again.release()
    assert (dump / LOCK_NAME).read_text() == ""


def test_unwritable_output_folders_fail_before_launch(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    with pytest.raises(NotWritable, match=f"output folder {blocker / 'out'} is not writable: NotADirectoryError"):
        check_writable([blocker / "out"])
    code = launch.main(["--config", "debug_cpu", "--job.dump_folder", str(blocker / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "is not writable: NotADirectoryError" in err[0]


def test_a_checkpoint_exception_is_recorded_with_its_real_cause(tmp_path, monkeypatch, capsys):
    """DCP's CheckpointException is a BaseException; the rank records the first rank's real error."""
    def fail(*args):
        raise dcp_api.CheckpointException("save", {3: (OSError(30, "Read-only file system"), None)})

    error_file = tmp_path / "error.json"
    monkeypatch.setattr(train, "run", fail)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.delenv("FLASHCP_LAUNCHER", raising=False)
    monkeypatch.setenv("RANK", "0")
    assert train.main(["--config", "debug_cpu"]) == 1
    assert "OSError: [Errno 30] Read-only file system" in error_file.read_text()
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == "error: rank 0 failed: OSError: [Errno 30] Read-only file system"


def test_help_prints_usage_and_an_empty_config_is_an_error(capsys):
    assert launch.main(["--help"]) == 0
    assert "--config NAME_OR_PATH" in capsys.readouterr().out
    for argv in (["--config="], ["--config"], ["--config", "--training.steps", "3"]):
        assert launch.main(argv) == 2
        assert capsys.readouterr().err.strip() == "error: --config needs a job file: a path or a name in train_configs/"
    result = subprocess.run([PYTHON, str(ROOT / "train.py"), "--help"], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0 and "--config" in result.stdout


def test_too_little_free_space_for_a_checkpoint_fails_before_launch(tmp_path):
    from flashcp.titan.config import load_job, resolve_config_path
    from flashcp.run.ownership import check_free_space
    from flashcp.titan.launch.preflight import checkpoint_bytes

    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(NotWritable, match=rf"{tmp_path} has .* GiB free, less than one checkpoint needs"):
        check_free_space(tmp_path, 2 * free, "one checkpoint")
    check_free_space(tmp_path, free // 2, "one checkpoint")
    # The estimate is a lower bound: Llama 3 8B has 8.03e9 parameters, 12 bytes each with AdamW.
    estimate = checkpoint_bytes(load_job(resolve_config_path("llama8b_128k")), 128256)
    assert 0.75 * 12 * 8.03e9 < estimate <= 12 * 8.03e9


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tiny tmpfs needs root")
def test_a_disk_filled_by_a_save_is_named_in_the_last_line(tmp_path):
    """Room for one checkpoint and not two: the second save fills the disk mid-run. The failing rank's
    traceback and reason still fit (it held a reservation), so the run ends naming ENOSPC and the rank.
    FlashCP CP = 2 on 2 ranks: a checkpoint takes 7.7 MB of the 10 MB (on 4 ranks, FSDP 2 x CP 2, the
    ranks' reservations leave room for none)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=10m", "tmpfs", str(disk)], check=True)
    try:
        result = subprocess.run(
            [str(ROOT / "run_train.sh"), "--config", "debug_cpu", "--parallelism.data_parallel_shard_degree", "1",
             "--training.steps", "30", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "0",
             "--metrics.enable_tensorboard", "false", "--job.dump_folder", str(disk / "run")],
            cwd=ROOT, env={**os.environ, "NGPU": "2"}, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        last = result.stderr.strip().splitlines()[-1]
        assert result.returncode == 1, result.stderr[-2000:]
        assert re.fullmatch(r"error: rank \d+ failed \(exit code 1\): OSError: \[Errno 28\] No space left on device(: '.*')?", last), last
        logs = "".join(p.read_text() for p in (disk / "run" / "logs").rglob("stderr.log"))
        assert "Traceback" in logs and "No space left on device" in logs
        assert (disk / "run" / "checkpoint" / "step-2" / "manifest.json").is_file()  # the first save fit
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_the_root_cause_is_the_os_error_beneath_a_wrapper():
    from flashcp.run.publish import root_cause

    try:
        try:
            raise OSError(28, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    except RuntimeError as e:
        wrapped = dcp_api.CheckpointException("save", {1: (e, None)})
    assert root_cause(wrapped) == "OSError: [Errno 28] No space left on device"
    assert root_cause(ValueError("bad\nvalue")) == "ValueError: bad"


def test_a_save_failing_on_a_full_disk_is_named_as_such(tmp_path, monkeypatch):
    """torch's zip writer reports a short write as a RuntimeError with no OSError beneath: when the
    checkpoint's file system is full afterwards, the failure is ENOSPC, the original chained."""
    from flashcp.titan.components import checkpoint as checkpoint
    from flashcp.run.publish import full_disk_named, root_cause

    folder = tmp_path / "checkpoint" / "step-4.partial-ab"  # not created yet: its parent is measured
    short_write = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda p: usage._replace(free=4096))
    with pytest.raises(OSError) as raised:
        with full_disk_named(folder):
            raise dcp_api.CheckpointException("save", {2: (short_write, None)})
    assert raised.value.errno == 28 and raised.value.filename == str(folder)
    assert root_cause(raised.value) == f"OSError: [Errno 28] No space left on device: '{folder}'"
    assert isinstance(raised.value.__cause__, dcp_api.CheckpointException)
    with pytest.raises(PermissionError):  # an OSError already names the cause
        with full_disk_named(folder):
            raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda p: usage._replace(free=64 << 20))
    with pytest.raises(RuntimeError, match="unexpected pos"):  # room left: not a full disk
        with full_disk_named(folder):
            raise short_write
