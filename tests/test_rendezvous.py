"""The launchers' meeting (`flashcp.run.rendezvous`) on real TCPStores on localhost: what a node
believes of a store anyone can write, and who holds a node slot."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import signal
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
from ports import free_port
from torch.distributed import TCPStore

from flashcp.run import rendezvous

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def job(tmp_path, monkeypatch):
    """A coordinator (node 0 of 3) serving on 127.0.0.1; yields (shared folder, card, its store's address)."""
    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    shared = tmp_path / "shared"
    card = rendezvous.JobCard("job", {"job.dump_folder": str(shared), "optimizer.lr": 0.002}, "code")
    coordinator = rendezvous.meet(card, str(shared), 3, 0, 30, lambda: lambda: None)
    yield shared, card, port + 1
    coordinator.close()


def intruder(port: int) -> TCPStore:
    """A client of the meeting store that is not one of the job's nodes."""
    return TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))


def join(card: rendezvous.JobCard, folder: Path, node_rank: int | None = 1) -> rendezvous.Meeting:
    return rendezvous.meet(card, str(folder), 3, node_rank, 30, lambda: None)


def test_a_forged_card_is_refused_and_the_secret_is_not_in_the_store(job):
    shared, card, port = job
    store = intruder(port)
    secret = (shared / rendezvous.TOKEN_NAME).read_text()
    assert all(secret.encode() not in store.get(key) for key in store.list_keys() if key.startswith("flashcp/"))
    # Another learning rate for every node that joins: one started with that rate would agree with the card.
    wanted = rendezvous.JobCard("job", {**card.settings, "optimizer.lr": 0.2}, "code")
    store.set("flashcp/card", json.dumps(vars(wanted)))
    with pytest.raises(rendezvous.JobMismatch, match=r"^the job card at 127.0.0.1:\d+ is not signed with this "
                                                     r"job's secret .* must be reachable only by the job's nodes$"):
        join(wanted, shared)
    assert not store.check(["flashcp/node/1"])  # the refused node holds no slot


def test_a_forged_token_is_refused(job):
    shared, card, port = job
    store = intruder(port)
    wanted = rendezvous.JobCard("job", {**card.settings, "optimizer.lr": 0.2}, "code")
    published, token = json.dumps(vars(wanted)).encode(), "the intruder's own secret"
    token_id = hashlib.sha256(f"flashcp node token {token}".encode()).hexdigest()[:16]
    store.set("flashcp/token", token_id)
    store.set("flashcp/signature", hmac.new(token.encode(), published + b"\n" + token_id.encode(), "sha256").hexdigest())
    store.set("flashcp/card", published)
    with pytest.raises(rendezvous.JobMismatch, match="holds another node token than the coordinator published: "
                                                     ".*or someone else wrote the store at 127.0.0.1:"):  # fmt: skip
        join(wanted, shared)


def test_a_corrected_node_and_a_restarted_one_take_the_slot_of_a_refused_or_ended_one(job, tmp_path, monkeypatch):
    shared, card, port = job
    with pytest.raises(rendezvous.JobMismatch, match="on this host holds no node token: .* must be on a file system "
                                                     "that every node shares"):  # fmt: skip
        join(card, tmp_path / "node-local")

    def probed(store, holder):  # a free slot is taken without asking whether its holder lives
        raise AssertionError(f"the slot was still held by {holder}")

    monkeypatch.setattr(rendezvous, "_beating", probed)
    corrected = join(card, shared)
    corrected.close()
    join(card, shared).close()  # restarted after its launcher ended


def test_a_live_duplicate_is_refused_and_a_full_job_too(job):
    shared, card, port = job
    first = join(card, shared)
    try:
        with pytest.raises(rendezvous.JobMismatch, match="^NODE_RANK=1 is already taken by another node of job job, "
                                                         "whose launcher is running$"):  # fmt: skip
            join(card, shared)
        with pytest.raises(rendezvous.JobMismatch, match="^NODE_RANK=3 must be below NNODES=3$"):
            join(card, shared, node_rank=3)
        second = join(card, shared, node_rank=None)  # RDZV_ENDPOINT's form: the first free slot, 2
        with pytest.raises(rendezvous.JobMismatch, match="^job job already has all its NNODES=3 nodes$"):
            join(card, shared, node_rank=None)
        second.close()
    finally:
        first.close()


HOLDER = """
import sys
from flashcp.run import rendezvous
card = rendezvous.JobCard("job", {"job.dump_folder": sys.argv[1], "optimizer.lr": 0.002}, "code")
rendezvous.meet(card, sys.argv[1], 3, 1, 30, lambda: None)
print("joined", flush=True)
sys.stdin.read()
"""


def test_the_slot_of_a_killed_launcher_is_taken_over(job, monkeypatch):
    shared, card, port = job
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(shared)], cwd=ROOT, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout.readline() == "joined\n"
        with pytest.raises(rendezvous.JobMismatch, match="NODE_RANK=1 is already taken"):
            join(card, shared)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    monkeypatch.setattr(rendezvous, "DEAD_AFTER_S", 2.0)  # a dead launcher never beats again, however long
    join(card, shared).close()


def listening(port: int) -> set[str]:
    """The local addresses (hex, as /proc/net shows them) listening on `port`."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.add(address)
    return found


def test_the_meeting_store_listens_on_the_rendezvous_address_only(job):
    assert listening(job[2]) == {"0100007F"}  # 127.0.0.1, not every interface (0.0.0.0 / ::)


def test_a_host_name_that_is_loopback_only_here_is_refused(monkeypatch):
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: [(socket.AF_INET, socket.SOCK_STREAM, 6, "",
                                                                 ("127.0.1.1", 0))])  # fmt: skip
    with pytest.raises(rendezvous.JobMismatch, match="^the rendezvous host node0 is 127.0.1.1 on this host, which "
                                                     "no other node reaches"):  # fmt: skip
        rendezvous.listen("node0", 0)


@pytest.mark.parametrize("addresses, problem", [
    ([("127.0.1.1", 0)], "is 127.0.1.1 on this host, which no other node reaches"),
    (OSError(-2, "Name or service not known"), "'node0' cannot be resolved: Name or service not known"),
])  # fmt: skip
def test_node_0_with_an_address_no_other_node_reaches_is_told_to_fix_the_address_not_the_port(
        tmp_path, monkeypatch, addresses, problem):  # fmt: skip
    def resolve(*args, **kwargs):
        if isinstance(addresses, OSError):
            raise addresses
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", address) for address in addresses]

    monkeypatch.delenv("RDZV_ENDPOINT", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "node0")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    card = rendezvous.JobCard("job", {}, "code")
    with pytest.raises(rendezvous.JobMismatch) as refused:
        rendezvous.meet(card, str(tmp_path), 2, 0, 30, lambda: lambda: None)
    line = str(refused.value)
    assert problem in line and "\n" not in line, line
    assert line.endswith("set MASTER_ADDR / RDZV_ENDPOINT to an address of this node that the other nodes reach")
    assert "MASTER_PORT" not in line


def test_node_0_whose_port_is_taken_is_told_to_choose_another_port(tmp_path, monkeypatch):
    port = free_port()
    monkeypatch.delenv("RDZV_ENDPOINT", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port + 1))
        taken.listen(1)
        with pytest.raises(rendezvous.JobMismatch, match=f"^port {port + 1} on 127.0.0.1 cannot be used: .* \\(another "
                                                         "program listens there\\): .*choose another MASTER_PORT$"):
            rendezvous.meet(rendezvous.JobCard("job", {}, "code"), str(tmp_path), 2, 0, 30, lambda: lambda: None)


def test_a_second_node_0_of_a_running_job_is_named_as_such_not_sent_to_another_port(job):
    shared, card, port = job
    with pytest.raises(rendezvous.JobMismatch) as refused:
        rendezvous.meet(card, str(shared), 3, 0, 30, lambda: lambda: None)
    assert str(refused.value) == (
        f"node 0 of job job is already running: its launcher holds the meeting at 127.0.0.1:{port} and the dump "
        f"folder {shared}; a second node 0 is refused (another node takes NODE_RANK 1..NNODES-1; to restart node 0, "
        "stop the running one first)")
    assert (shared / rendezvous.TOKEN_NAME).is_file()  # the running node 0's secret is left alone


def test_node_0_of_another_job_on_the_port_is_named(job, tmp_path):
    other = rendezvous.JobCard("other", {"job.dump_folder": str(tmp_path / "other")}, "code")
    with pytest.raises(rendezvous.JobMismatch, match=rf"^the meeting port 127.0.0.1:{job[2]} \(the rendezvous port "
                                                     rf"\+ 1\) is held by the coordinator of another job, job \(dump "
                                                     rf"folder {job[0]}\): choose another MASTER_PORT for this job$"):
        rendezvous.meet(other, str(tmp_path / "other"), 3, 0, 30, lambda: lambda: None)


def test_node_0_whose_master_addr_is_not_an_address_of_its_host_is_told_so(tmp_path, monkeypatch):
    monkeypatch.delenv("RDZV_ENDPOINT", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "192.0.2.1")  # TEST-NET-1: documentation only, no host's address
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    with pytest.raises(rendezvous.JobMismatch) as refused:
        rendezvous.meet(rendezvous.JobCard("job", {}, "code"), str(tmp_path), 2, 0, 30, lambda: lambda: None)
    assert str(refused.value) == (
        "the rendezvous host 192.0.2.1 (192.0.2.1) is not an address of this host, so this node cannot be node 0: "
        "start node 0 on that host, or set MASTER_ADDR / RDZV_ENDPOINT to an address of this node that the other "
        "nodes reach")


def test_the_node_token_is_readable_by_its_owner_only_and_removed_when_the_job_ends(tmp_path, monkeypatch):
    monkeypatch.delenv("RDZV_ENDPOINT", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    shared = tmp_path / "shared"
    card = rendezvous.JobCard("job", {"job.dump_folder": str(shared)}, "code")
    coordinator = rendezvous.meet(card, str(shared), 3, 0, 30, lambda: lambda: None)
    token = shared / rendezvous.TOKEN_NAME
    try:
        assert token.stat().st_mode & 0o777 == 0o600
        token.chmod(0o644)
        with pytest.raises(rendezvous.JobMismatch) as refused:
            join(card, shared)
        assert str(refused.value) == (
            f"the node token {token} is mode 0644, not 0600: others may have read the job's secret and could sign a "
            "job card; this node refuses to join (restart node 0, which writes a fresh one readable by its owner only)")
        token.chmod(0o600)
        join(card, shared).close()
    finally:
        coordinator.close()
    assert not token.exists()
    assert sorted(p.name for p in shared.iterdir()) == []


def test_a_file_system_that_shows_the_token_readable_by_others_is_refused(tmp_path, monkeypatch):
    real = rendezvous.os.fstat
    monkeypatch.setattr(rendezvous.os, "fstat", lambda fd: os.stat_result((real(fd).st_mode | 0o777, *real(fd)[1:])))
    with pytest.raises(rendezvous.JobMismatch, match=rf"^the dump folder's file system shows the node token "
                                                     rf"{tmp_path}/.flashcp-node-token as mode 0777 although it was "
                                                     "written 0600: it does not keep permissions"):  # fmt: skip
        rendezvous._write_token(tmp_path, "secret")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("nnodes, node_rank", [(1, "0"), (2, "0"), (2, "1")])
def test_torchruns_store_is_served_on_the_rendezvous_address_only(monkeypatch, nnodes, node_rank):
    from flashcp.run import launch

    monkeypatch.delenv("RDZV_ENDPOINT", raising=False)
    monkeypatch.setenv("NODE_RANK", node_rank)
    if nnodes > 1:
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(free_port()))
    else:
        monkeypatch.delenv("MASTER_ADDR", raising=False)
    store = launch.serve_rendezvous(nnodes)
    if node_rank != "0":
        assert store is None  # node 0's agent hosts it
        return
    agent = TCPStore("127.0.0.1", store.port, 1, True, timedelta(seconds=10), multi_tenant=True)  # as torch makes it
    agent.set("flashcp/test", "served here")
    assert store.get("flashcp/test") == b"served here"
    assert listening(store.port) == {"0100007F"}
