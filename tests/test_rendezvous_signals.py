"""Nodes that met wait for the rest of the job (`Meeting.wait_for_nodes`): they go on once all are
there, and otherwise end with one line, releasing what they hold, after `comm.init_timeout_seconds`,
on SIGTERM or SIGINT, or when the coordinator goes away. Before, node 0 went on into torchrun's own
rendezvous, which waits 900 s whatever the setting and acts on no signal meanwhile."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
from ports import free_port
from torch.distributed import TCPStore

from flashcp.run import rendezvous
from flashcp.run.ownership import RunLock
from flashcp.titan.launch import node as launch

ROOT = Path(__file__).resolve().parents[1]
TWO_RANKS = ["--config", "debug_cpu", "--parallelism.data_parallel_shard_degree", "1",
             "--parallelism.context_parallel_degree", "2"]  # fmt: skip
HANG_S = 60  # only catches a hang: the waits end within a second of their cause


@pytest.fixture
def coordinator(tmp_path, monkeypatch):
    """Node 0 of a 2-node job on 127.0.0.1; yields (its meeting, the shared folder, the card)."""
    monkeypatch.delenv("RDZV_ENDPOINT", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    shared = tmp_path / "shared"
    card = rendezvous.JobCard("job", {"job.dump_folder": str(shared)}, "code")
    meeting = rendezvous.meet(card, str(shared), 2, 0, 30, lambda: lambda: None)
    yield meeting, shared, card
    meeting.close()


def test_node_0_goes_on_once_the_other_node_joins_and_gives_up_in_time_without_it(coordinator, capsys):
    meeting, shared, card = coordinator
    start = time.monotonic()
    with pytest.raises(rendezvous.JobMismatch) as alone:
        meeting.wait_for_nodes(2, 1)
    assert time.monotonic() - start < HANG_S
    port = int(os.environ["MASTER_PORT"]) + 1
    assert str(alone.value) == (
        f"only 1 of the job's NNODES=2 nodes arrived at 127.0.0.1:{port} within 1 s (comm.init_timeout_seconds): "
        "start the others with the same MASTER_ADDR / MASTER_PORT (or RDZV_ENDPOINT)")  # fmt: skip
    assert capsys.readouterr().out == (f"flashcp: waiting for the other nodes at 127.0.0.1:{port}: 1 of 2 here (up to "
                                       "1 s, comm.init_timeout_seconds; Ctrl-C stops)\n")  # fmt: skip
    node_1 = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    joins = threading.Timer(1.0, lambda: node_1.compare_set("flashcp/node/1", "", "node 1"))  # as `meet` claims it
    joins.start()
    meeting.wait_for_nodes(2, HANG_S)  # returns once node 1 holds its slot
    joins.join()


def test_a_joined_node_whose_coordinator_goes_away_stops_waiting(coordinator):
    meeting, shared, card = coordinator
    node = rendezvous.meet(card, str(shared), 3, 1, 30, lambda: None)
    threading.Timer(1.0, meeting.close).start()  # node 0 gives up (its store goes with it)
    with pytest.raises(rendezvous.JobMismatch, match=r"^the coordinator at 127\.0\.0\.1:\d+ went away while this node "
                                                     r"waited for the other nodes: nothing started$"):  # fmt: skip
        node.wait_for_nodes(3, HANG_S)


def node_0(dump: Path, *args: str) -> subprocess.Popen:
    """Node 0's launcher of a 2-node job (one CPU rank each) on localhost."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NGPU": "1", "NNODES": "2", "NODE_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}  # fmt: skip
    return subprocess.Popen([sys.executable, "-m", "flashcp.titan.launch", *TWO_RANKS, f"--job.dump_folder={dump}",
                             *args], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)  # fmt: skip


def ended(proc: subprocess.Popen) -> tuple[int, str]:
    """(exit code, stderr) of a launcher, killed if it hangs."""
    try:
        _, err = proc.communicate(timeout=HANG_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
    return proc.returncode, err


def released(dump: Path) -> bool:
    """Node 0 holds nothing any more: its secret is gone and the folder's lock can be taken."""
    with RunLock(dump):
        return not (dump / rendezvous.TOKEN_NAME).exists()


def test_node_0_waiting_for_the_other_node_gives_up_after_init_timeout_seconds(tmp_path, capsys, monkeypatch):
    for name, value in {"NGPU": "1", "NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(free_port())}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("RDZV_ENDPOINT", raising=False)
    dump = tmp_path / "job"
    assert launch.main([*TWO_RANKS, f"--job.dump_folder={dump}", "--comm.init_timeout_seconds", "3"]) == 2
    out, err = capsys.readouterr()
    assert out.startswith("flashcp: waiting for the other nodes at 127.0.0.1:"), out
    assert err.startswith("error: only 1 of the job's NNODES=2 nodes arrived at 127.0.0.1:") and err.count("\n") == 1
    assert "within 3 s (comm.init_timeout_seconds)" in err
    assert released(dump)


@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)], ids=lambda sig: sig.name)
def test_node_0_waiting_for_the_other_node_stops_on_a_signal(tmp_path, sig):
    proc = node_0(tmp_path / "job")  # comm.init_timeout_seconds: 600 by default
    assert proc.stdout.readline().startswith("flashcp: waiting for the other nodes at 127.0.0.1:")
    signalled = time.monotonic()
    proc.send_signal(sig)
    code, err = ended(proc)
    assert time.monotonic() - signalled < HANG_S
    assert code == 2 and err == f"error: {sig.name} while waiting for the other nodes (1 of 2 here): nothing started\n"
    assert released(tmp_path / "job")
