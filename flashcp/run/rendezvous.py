"""Before any rank starts, every node of a multi-node job agrees that it is the same job.

torchrun's rendezvous joins whoever reaches its address: a second job's node given the same
address joined a running job and wrote into its folder, a node with other settings trained beside
node 0, a duplicate NODE_RANK or a node without a node 0 hung for many minutes. Here the launchers
meet first, on a small store of their own at the rendezvous port + 1 (`meet`):

- the coordinator (NODE_RANK 0, or with `RDZV_ENDPOINT` whichever launcher binds the address)
  holds the dump folder's lock, writes a random token into the folder and publishes the job's
  card: its identity (`RUN_ID`, else the dump folder), the resolved settings, a fingerprint of
  the code, and the token;
- every other node refuses, with one line, another job's card, other settings (naming the first
  setting that differs), a node slot already taken, or a dump folder that does not hold the
  coordinator's token (a node-local folder: the folder must be shared);
- a node waiting for its coordinator stops on Ctrl-C / SIGTERM within seconds, and gives up after
  `comm.init_timeout_seconds` naming the address it waited for.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import signal
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

TOKEN_NAME = ".flashcp-node-token"
CONNECT_TRY_S = 2.0  # one connection attempt; a signal is acted on between attempts


class JobMismatch(RuntimeError):
    """This node cannot join the job at the rendezvous address; the message says why."""


@dataclass(frozen=True)
class JobCard:
    """What every node of one job must share."""

    run_id: str  # RUN_ID, else derived from the dump folder
    settings: dict[str, Any]  # the resolved job, flattened to "section.key" -> value
    code: str  # fingerprint of the code the ranks run

    def __post_init__(self) -> None:  # as the other nodes see it: through JSON
        object.__setattr__(self, "settings", json.loads(json.dumps(self.settings, default=str)))


def run_id(dump_folder: str) -> str:
    """`RUN_ID` when set, else one derived from the (absolute) dump folder: one folder, one job."""
    return os.environ.get("RUN_ID") or "flashcp-" + hashlib.sha256(dump_folder.encode()).hexdigest()[:12]


def code_fingerprint(root: Path) -> str:
    """A hash of the Python sources the ranks run (the package and train.py)."""
    digest = hashlib.sha256()
    for path in sorted([*root.joinpath("flashcp").rglob("*.py"), root / "train.py"]):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def first_difference(mine: dict[str, Any], theirs: dict[str, Any]) -> str:
    for key in sorted(set(mine) | set(theirs)):
        if mine.get(key) != theirs.get(key):
            return f"{key} = {mine.get(key)!r} here, {theirs.get(key)!r} on the coordinator"
    return "none"


def job_address() -> tuple[str, int]:
    """(host, port) of the launchers' own store: the rendezvous address with its port + 1."""
    endpoint = os.environ.get("RDZV_ENDPOINT")
    if endpoint:
        host, _, port = endpoint.rpartition(":")
        if not host:
            raise JobMismatch(f"RDZV_ENDPOINT={endpoint!r} must be host:port")
    else:
        host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), os.environ.get("MASTER_PORT", "29500")
    if not port.isdigit() or not 1 <= int(port) <= 65534:
        raise JobMismatch(f"rendezvous port {port!r} must be an integer in 1..65534 (it and port + 1 are used)")
    return host, int(port) + 1


def is_local(host: str) -> bool:
    """Whether `host` names this machine (so its launcher may bind there)."""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    if any(a.startswith("127.") or a == "::1" for a in addresses):
        return True
    try:
        mine = {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None)}
    except OSError:
        mine = set()
    return bool(addresses & mine)


def port_problem(host: str, port: int) -> str | None:
    """Why this host cannot listen on `port`, or None."""
    with socket.socket() as s:
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("", port))
        except OSError as e:
            return f"port {port} on {host} cannot be used: {e.strerror or e}"
    return None


class Meeting:
    """This node's place in the job: the coordinator keeps its store (and the lock) until `close`."""

    def __init__(self, store: Any, release: Callable[[], None] | None = None):
        self.store, self._release = store, release

    def close(self) -> None:
        if self._release is not None:
            self._release()
        self.store = None


def meet(card: JobCard, dump_folder: str, nnodes: int, node_rank: int | None, timeout_s: float,
         take_lock: Callable[[], Callable[[], None]]) -> Meeting:  # fmt: skip
    """Join the job at the rendezvous address (see the module docstring); JobMismatch says why not.

    `node_rank` is None with `RDZV_ENDPOINT` (ranks are given at rendezvous); `take_lock()` takes
    the dump folder's lock and returns its release.
    """
    from torch.distributed import TCPStore

    host, port = job_address()
    store = None
    if node_rank == 0 or (node_rank is None and is_local(host)):
        try:
            store = TCPStore(host, port, is_master=True, wait_for_workers=False,
                             timeout=timedelta(seconds=timeout_s))  # fmt: skip
        except (RuntimeError, OSError) as e:
            if node_rank == 0:
                raise JobMismatch(f"{port_problem(host, port) or e}: the job's launchers meet on the rendezvous "
                                  "port + 1; choose another MASTER_PORT") from None  # fmt: skip
    if store is not None:
        release = take_lock()
        try:
            token = secrets.token_hex(16)
            _write_token(Path(dump_folder), token)
            store.set("flashcp/card", json.dumps(asdict(card)))
            store.set("flashcp/token", token)
            store.add("flashcp/nodes", 1)
            if node_rank is not None:
                store.add(f"flashcp/node/{node_rank}", 1)
        except BaseException:
            release()
            raise
        return Meeting(store, release)
    store = _connect(host, port, timeout_s)
    _check_card(json.loads(store.get("flashcp/card")), card, host, port)
    if node_rank is not None and store.add(f"flashcp/node/{node_rank}", 1) > 1:
        raise JobMismatch(f"NODE_RANK={node_rank} is already taken by another node of job {card.run_id}")
    if store.add("flashcp/nodes", 1) > nnodes:
        raise JobMismatch(f"job {card.run_id} already has all its NNODES={nnodes} nodes")
    token = store.get("flashcp/token").decode()
    seen = _read_token(Path(dump_folder))
    if seen != token:
        state = "holds no node token" if seen is None else "holds another job's node token"
        raise JobMismatch(
            f"job.dump_folder {dump_folder} on this host {state}: it is not the folder the coordinator writes; "
            "the dump folder must be on a file system that every node shares"
        )
    return Meeting(store)


def _check_card(theirs: dict[str, Any], mine: JobCard, host: str, port: int) -> None:
    if theirs["run_id"] != mine.run_id:
        raise JobMismatch(
            f"the rendezvous at {host}:{port - 1} belongs to job {theirs['run_id']} "
            f"(dump folder {theirs['settings'].get('job.dump_folder')}), not to this node's job {mine.run_id} "
            f"(dump folder {mine.settings.get('job.dump_folder')}): give each job its own rendezvous address"
        )
    if theirs["settings"] != mine.settings:
        diff = first_difference(mine.settings, theirs["settings"])
        raise JobMismatch(f"this node's settings differ from the coordinator's: {diff}")
    if theirs["code"] != mine.code:
        raise JobMismatch("this node runs other code than the coordinator (another FlashCP version or local edits)")


class _Stop(Exception):
    pass


@contextmanager
def _stoppable() -> Iterator[list[int]]:
    """SIGTERM / SIGINT end a wait between two connection attempts (their number in the list)."""
    got: list[int] = []
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

    def handle(signum: int, frame: object) -> None:
        got.append(signum)
        raise _Stop

    for sig in saved:
        signal.signal(sig, handle)
    try:
        yield got
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def _connect(host: str, port: int, timeout_s: float) -> Any:
    """A client of the coordinator's store, retried until `timeout_s`; JobMismatch on a signal or time-out."""
    from torch.distributed import TCPStore

    deadline, waited = time.monotonic() + timeout_s, False
    with _stoppable() as got:
        try:
            while True:
                try:
                    # A plain socket probes first: c10d's client logs every failed attempt on the console.
                    socket.create_connection((host, port), timeout=CONNECT_TRY_S).close()
                    store = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=CONNECT_TRY_S))
                    store.get("flashcp/card")  # a store that is not a FlashCP coordinator's times out here
                    return store
                except (RuntimeError, OSError, TimeoutError):
                    if not waited:
                        print(f"flashcp: waiting for the coordinator at {host}:{port} (up to {timeout_s:g} s, "
                              "comm.init_timeout_seconds; Ctrl-C stops)", flush=True)  # fmt: skip
                        waited = True
                    if time.monotonic() > deadline:
                        raise JobMismatch(
                            f"no coordinator answered at {host}:{port} within {timeout_s:g} s "
                            "(comm.init_timeout_seconds): is node 0 started, and MASTER_ADDR / RDZV_ENDPOINT right?"
                        ) from None
                    time.sleep(0.5)
        except _Stop:
            raise JobMismatch(
                f"{signal.Signals(got[0]).name} while waiting for the coordinator at {host}:{port}: nothing started"
            ) from None


def _write_token(folder: Path, token: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / f"{TOKEN_NAME}.partial"
    partial.write_text(token)
    os.replace(partial, folder / TOKEN_NAME)


def _read_token(folder: Path) -> str | None:
    try:
        return (folder / TOKEN_NAME).read_text().strip()
    except OSError:
        return None
