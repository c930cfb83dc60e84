"""Multi-node launches on one host playing two nodes (gloo): one job per rendezvous, one lock
holder, shared folders only, settings agreed, waiting nodes that stop, elastic restarts, and locks
that hold for every folder a run writes."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from harness import tiny_job
from ports import free_port

from flashcp.run import ownership, rendezvous
from flashcp.run.ownership import FolderInUse, LockUnavailable, RunLock
from flashcp.titan.launch import node as launch

ROOT = Path(__file__).resolve().parents[2]
TWO_RANKS = ["--config", "debug_cpu", "--parallelism.data_parallel_shard_degree", "1",
             "--parallelism.context_parallel_degree", "2"]  # fmt: skip


def node(dump: Path, env: dict[str, str], *args: str) -> subprocess.Popen:
    """One node's launcher with one CPU rank."""
    full = {**os.environ, "PYTHONPATH": str(ROOT), "NGPU": "1", "NNODES": "2", **env}
    return subprocess.Popen([sys.executable, "-m", "flashcp.titan.launch", *TWO_RANKS, f"--job.dump_folder={dump}",
                             *args], cwd=ROOT, env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)  # fmt: skip


def finish(proc: subprocess.Popen, timeout: float = 600) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    return proc.returncode, out, err


STEP_LINE = re.compile(r"step:\s+(\d+)/\d+\s+loss:\s+(\S+)")


def losses(out: str) -> dict[int, str]:
    """{step: loss} from a launcher's console (rank 0's log lines, colours removed)."""
    plain = re.sub(r"\x1b\[[0-9;]*m", "", out)
    return {int(m.group(1)): m.group(2) for m in STEP_LINE.finditer(plain)}


@pytest.mark.slow
def test_rdzv_endpoint_nodes_train_and_refuse_another_job_or_other_settings(tmp_path, capsys, monkeypatch):
    env = {"RDZV_ENDPOINT": f"127.0.0.1:{free_port()}"}
    dump, other = tmp_path / "job", tmp_path / "other"
    # The job trains far longer than the checks take, so its coordinator is surely still there for
    # the two refused nodes (a finished coordinator leaves a late node waiting for one); it is
    # stopped by SIGTERM once it trains, which saves and exits 0 on both nodes. The refused nodes'
    # launchers run in this process (they end at the meeting, before starting any rank).
    long_job = ("--training.steps", "2000", "--checkpoint.interval", "1000")
    nodes = [node(dump, env, *long_job) for _ in range(2)]
    try:
        line = nodes[0].stdout.readline() + nodes[1].stdout.readline()  # both past the meeting
        assert line.count("flashcp: ") == 2, line
        for name, value in {"NGPU": "1", "NNODES": "2", **env}.items():
            monkeypatch.setenv(name, value)
        capsys.readouterr()
        assert launch.main([*TWO_RANKS, f"--job.dump_folder={other}", *long_job]) == 2
        err = capsys.readouterr().err
        assert err.strip().splitlines()[-1].startswith(
            f"error: the rendezvous at {env['RDZV_ENDPOINT']} belongs to job {rendezvous.run_id(str(dump))} "
            f"(dump folder {dump}), not to this node's job"
        ), err
        assert launch.main([*TWO_RANKS, f"--job.dump_folder={dump}", *long_job, "--optimizer.lr", "0.2"]) == 2
        err = capsys.readouterr().err
        assert err.strip().splitlines()[-1] == (
            "error: this node's settings differ from the coordinator's: optimizer.lr = 0.2 here, 0.002 on the "
            "coordinator"
        ), err
        deadline = time.monotonic() + 600  # only catches a hang
        while not any(losses(p.read_text()) for p in (dump / "logs").rglob("stdout.log")):
            assert time.monotonic() < deadline and all(n.poll() is None for n in nodes), "no step trained"
            time.sleep(0.5)  # the ranks catch SIGTERM from their first step on
    finally:
        for n in nodes:
            n.send_signal(signal.SIGTERM)
        results = [finish(n) for n in nodes]
    assert [r[0] for r in results] == [0, 0], [r[2][-2000:] for r in results]
    assert not other.exists()  # the refused job wrote nothing, anywhere
    assert [p.name for p in (dump / "checkpoint").iterdir() if p.name.startswith("step-")], "nothing saved"
    assert sorted(p.name.split("-")[2] for p in (dump / "logs").iterdir()) == ["node0", "node1"]


def test_a_node_slot_taken_and_a_folder_not_shared_are_refused(tmp_path, monkeypatch):
    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    card = rendezvous.JobCard("job", {"job.dump_folder": str(tmp_path / "shared")}, "code")
    released = []
    coordinator = rendezvous.meet(card, str(tmp_path / "shared"), 3, 0, 30, lambda: lambda: released.append(1))
    try:
        with pytest.raises(rendezvous.JobMismatch, match="on this host holds no node token: .* must be on a "
                                                         "file system that every node shares"):  # fmt: skip
            rendezvous.meet(card, str(tmp_path / "node-local"), 3, 1, 30, lambda: None)
        rendezvous.meet(card, str(tmp_path / "shared"), 3, 2, 30, lambda: None)
        with pytest.raises(rendezvous.JobMismatch, match="NODE_RANK=2 is already taken by another node of job job"):
            rendezvous.meet(card, str(tmp_path / "shared"), 3, 2, 30, lambda: None)
        code = rendezvous.JobCard("job", card.settings, "other code")
        with pytest.raises(rendezvous.JobMismatch, match="runs other code than the coordinator"):
            rendezvous.meet(code, str(tmp_path / "shared"), 3, 1, 30, lambda: None)
    finally:
        coordinator.close()
    assert released == [1]


def test_a_node_waiting_for_its_coordinator_stops_on_sigterm_and_gives_up_in_time(
    tmp_path, capsys, monkeypatch
):
    env = {"NODE_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    waiting = node(tmp_path / "job", env)
    assert waiting.stdout.readline().startswith("flashcp: waiting for the coordinator at 127.0.0.1:")
    waiting.send_signal(signal.SIGTERM)
    code, _, err = finish(waiting, 60)
    assert code == 2 and err.strip().splitlines()[-1].startswith(
        "error: SIGTERM while waiting for the coordinator at 127.0.0.1:"), err  # fmt: skip
    # The same node's launcher, in this process: no coordinator ever answers.
    for name, value in {"NGPU": "1", "NNODES": "2", **env}.items():
        monkeypatch.setenv(name, value)
    capsys.readouterr()
    code = launch.main([*TWO_RANKS, f"--job.dump_folder={tmp_path / 'job'}",
                        "--comm.init_timeout_seconds", "3"])  # fmt: skip
    err = capsys.readouterr().err
    port = int(env["MASTER_PORT"]) + 1
    assert code == 2 and err.strip().splitlines()[-1].startswith(
        f"error: no coordinator answered at 127.0.0.1:{port} within 3 s (comm.init_timeout_seconds)"), err
    assert not (tmp_path / "job").exists()


@pytest.mark.parametrize("port, message", [("99999", "rendezvous port '99999' must be an integer in 1..65534"),
                                           ("busy", "cannot be used: .*choose another MASTER_PORT")])  # fmt: skip
def test_a_bad_or_busy_port_is_one_line(tmp_path, capsys, monkeypatch, port, message):
    with socket.socket() as busy:
        if port == "busy":
            busy.bind(("127.0.0.1", 0))
            busy.listen()
            port = str(busy.getsockname()[1] - 1)
        monkeypatch.setenv("NGPU", "1")
        monkeypatch.setenv("NNODES", "2")
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", port)
        assert launch.main([*TWO_RANKS, f"--job.dump_folder={tmp_path / 'job'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and re.search(message, err[0]), err


@pytest.mark.slow
def test_an_elastic_restart_after_a_killed_rank_resumes_exactly(tmp_path):
    args = [*TWO_RANKS, "--training.steps", "4", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "0"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NGPU": "2"}
    whole = subprocess.run([sys.executable, "-m", "flashcp.titan.launch", *args, f"--job.dump_folder={tmp_path / 'a'}"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert whole.returncode == 0, whole.stderr[-2000:]
    dump = tmp_path / "b"
    run = subprocess.Popen([sys.executable, "-m", "flashcp.titan.launch", *args, f"--job.dump_folder={dump}"],
                           cwd=ROOT, env={**env, "MAX_RESTARTS": "1"}, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 600
    while not (dump / "checkpoint" / "step-2").is_dir() and time.monotonic() < deadline and run.poll() is None:
        time.sleep(0.05)
    rank = next(int(p) for p in os.listdir("/proc") if p.isdigit() and _is_rank(int(p), dump))
    os.kill(rank, signal.SIGKILL)
    code, out, err = finish(run)
    assert code == 0, err[-3000:]
    first, resumed = losses(whole.stdout), losses(out)
    assert [s for s in first] == [1, 2, 3, 4]
    assert all(resumed[s] == first[s] for s in (3, 4)), (first, resumed)  # after the restart
    assert "preempted" not in out + err  # the agent's stop of a failed group is not a preemption


def _is_rank(pid: int, dump: Path) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"train.py" in cmdline and str(dump).encode() in cmdline


# ---------------------------------------------------------------- locks


def test_a_file_system_without_locks_is_one_line_and_flashcp_lock_off_runs_unlocked(tmp_path, capsys, monkeypatch):
    def no_locks(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    # Only the run lock's file system lacks locks (the data loader's own file locks still work).
    monkeypatch.setattr(ownership, "fcntl", SimpleNamespace(flock=no_locks, LOCK_EX=fcntl.LOCK_EX, LOCK_NB=fcntl.LOCK_NB))
    monkeypatch.setenv("NGPU", "2")
    assert launch.main([*TWO_RANKS, f"--job.dump_folder={tmp_path / 'job'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot lock" in err[0] and "No locks available" in err[0], err
    assert "FLASHCP_LOCK=<a file on a local file system>" in err[0] and "FLASHCP_LOCK=off" in err[0]
    monkeypatch.setenv("FLASHCP_LOCK", "off")
    lock = RunLock(tmp_path / "unlocked").acquire()
    assert lock.disabled and lock.intact() and not (tmp_path / "unlocked" / ".flashcp-run.lock").exists()


def test_a_symlinked_or_directory_lock_file_is_refused(tmp_path):
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / ".flashcp-run.lock").symlink_to(target)
    with pytest.raises(LockUnavailable, match="is a symbolic link"):
        RunLock(tmp_path / "a").acquire()
    assert target.read_text() == "keep me"
    (tmp_path / "b" / ".flashcp-run.lock").mkdir(parents=True)
    with pytest.raises(LockUnavailable, match="is a directory"):
        RunLock(tmp_path / "b").acquire()


HOLDER = """
import fcntl, json, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, json.dumps({"host": "dead-node", "pid": 4242, "started": 0}).encode())
print("held", flush=True)
time.sleep(600)
"""


def test_a_dead_hosts_lock_is_named_and_broken_only_when_asked(tmp_path, monkeypatch):
    (tmp_path / "job").mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / "job" / ".flashcp-run.lock")],
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(FolderInUse, match="PID 4242 on host dead-node .*FLASHCP_BREAK_LOCK=1 breaks its lock"):
            RunLock(tmp_path / "job").acquire()
        monkeypatch.setenv("FLASHCP_BREAK_LOCK", "1")
        lock = RunLock(tmp_path / "job").acquire()
        assert lock.broken["host"] == "dead-node" and lock.intact()
        record = json.loads((tmp_path / "job" / ".flashcp-run.lock").read_text())
        assert record["pid"] == os.getpid()
        lock.release()
    finally:
        holder.kill()
        holder.wait()


def test_every_folder_a_run_writes_is_held(tmp_path):
    shared = str(tmp_path / "checkpoints")
    a = tiny_job(tmp_path / "a", checkpoint={"enable": True, "folder": shared})
    b = tiny_job(tmp_path / "b", checkpoint={"enable": True, "folder": shared})
    held = launch.hold_folders(a)
    try:
        assert sorted(str(lock.folder) for lock in held) == sorted([str(tmp_path / "a"), shared])
        with pytest.raises(FolderInUse, match=f"^{shared} is in use by the run of PID {os.getpid()}"):
            launch.hold_folders(b)
        RunLock(tmp_path / "b").acquire().release()  # the refused run left its own folder unlocked
    finally:
        launch.release(held)


def train_until(dump: Path, step: int, disturb, *args: str) -> tuple[int, str, str]:
    """Launch an endless two-rank job, call `disturb()` once rank 0 logged `step`; the run's outcome."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NGPU": "2"}
    run = subprocess.Popen([sys.executable, "-m", "flashcp.titan.launch", *TWO_RANKS, "--training.steps", "100000",
                            f"--job.dump_folder={dump}", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    try:
        for line in run.stdout:
            if step in losses(line):
                break
        disturb()
        return finish(run)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)


@pytest.mark.slow
def test_a_lock_file_removed_while_the_ranks_run_stops_the_run(tmp_path):
    dump = tmp_path / "job"
    code, out, err = train_until(dump, 1, (dump / ".flashcp-run.lock").unlink, "--checkpoint.interval", "100000")
    assert code == 1, err[-2000:]
    assert err.strip().splitlines()[-1].startswith(
        f"error: the run's lock file {dump / '.flashcp-run.lock'} was removed or replaced while the ranks ran"), err
    assert list((dump / "checkpoint").glob("step-*")), "the ranks saved where they stopped"


@pytest.mark.slow
def test_a_frozen_rank_is_named_not_the_rank_that_timed_out_waiting_for_it(tmp_path):
    dump = tmp_path / "job"
    frozen = []

    def freeze_rank_1() -> None:
        frozen.append(next(int(p) for p in os.listdir("/proc") if p.isdigit() and _is_rank(int(p), dump)
                           and b"\0RANK=1\0" in b"\0" + Path(f"/proc/{p}/environ").read_bytes()))  # fmt: skip
        os.kill(frozen[0], signal.SIGSTOP)

    # From step 3 on: past the first step, whose collective timeout is the longer one.
    code, out, err = train_until(dump, 3, freeze_rank_1, "--comm.train_timeout_seconds", "5")
    assert code == 1, err[-2000:]
    assert err.strip().splitlines()[-1].startswith(
        f"error: rank 1 (PID {frozen[0]}) was stopped (SIGSTOP or a debugger) and stopped answering; rank 0 then failed"
    ), err[-2000:]
