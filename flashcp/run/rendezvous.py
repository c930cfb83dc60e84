"""Before any rank starts, every node of a multi-node job agrees that it is the same job.

torchrun's rendezvous joins whoever reaches its address: a second job's node given the same
address joined a running job and wrote into its folder, a node with other settings trained beside
node 0, a duplicate NODE_RANK or a node without a node 0 hung for many minutes. Here the launchers
meet first, on a small store of their own at the rendezvous port + 1 (`meet`):

- the coordinator (NODE_RANK 0, or with `RDZV_ENDPOINT` whichever launcher binds the address)
  holds the dump folder's lock, writes a random secret (the node token) into the folder and
  publishes the job's card: its identity (`RUN_ID`, else the dump folder), the resolved settings,
  a fingerprint of the code, signed with the secret (HMAC). The store is not authenticated: anyone
  reaching the port can write it, so a node believes the card only once its signature checks with
  the secret it reads from its own dump folder;
- every other node refuses, with one line, another job's card, a dump folder that does not hold
  the coordinator's secret (a node-local folder: the folder must be shared), a card not signed
  with it, other settings (naming the first setting that differs), or a node slot that a running
  launcher holds. A node claims its slot last, so a refused node holds none, frees it when its
  launcher ends, and beats while it runs, so the slot of a SIGKILLed launcher is taken over;
- a node waiting for its coordinator stops on Ctrl-C / SIGTERM within seconds, and gives up after
  `comm.init_timeout_seconds` naming the address it waited for; once met, every node waits for all
  the others the same way (`Meeting.wait_for_nodes`), naming how many arrived, so that none enters
  torchrun's rendezvous alone (its wait ignores both signals and the setting for 900 s);
- a node 0 that cannot serve says why: the address is not one of its host's, the job's node 0 is
  already running (its card signed with the secret in this dump folder), another job's
  coordinator holds the port, or another program does (only the last two ask for another port);
- the secret is written readable by its owner only (a file system that shows it readable by others
  is refused), a node refuses to join with a secret others may have read, and the coordinator
  removes it from the dump folder when its launcher ends.

The store listens on the rendezvous host's own address only (`listen`), not on every interface.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import ipaddress
import json
import os
import secrets
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

TOKEN_NAME = ".flashcp-node-token"
CONNECT_TRY_S = 2.0  # one connection attempt; a signal is acted on between attempts
BEAT_S = 1.0  # a joined node's launcher says it is alive this often ...
DEAD_AFTER_S = 10.0  # ... and its slot is taken over when it has not for this long
WAIT_POLL_S = 0.5  # a node waiting for the others looks this often


class JobMismatch(RuntimeError):
    """This node cannot join the job at the rendezvous address; the message says why."""


class BadAddress(JobMismatch):
    """The rendezvous host is not an address of this node that the other nodes reach; the message
    names the fix (another port would not help)."""


class PortTaken(JobMismatch):
    """Something on this host already listens on the port (`holder` says what)."""


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
    host, port = rendezvous_address()
    return host, port + 1


def rendezvous_address() -> tuple[str, int]:
    """(host, port) of torchrun's rendezvous: RDZV_ENDPOINT, else MASTER_ADDR:MASTER_PORT."""
    endpoint = os.environ.get("RDZV_ENDPOINT")
    if endpoint:
        host, _, port = endpoint.rpartition(":")
        if not host:
            raise JobMismatch(f"RDZV_ENDPOINT={endpoint!r} must be host:port")
    else:
        host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), os.environ.get("MASTER_PORT", "29500")
    if not port.isdigit() or not 1 <= int(port) <= 65534:
        raise JobMismatch(f"rendezvous port {port!r} must be an integer in 1..65534 (it and port + 1 are used)")
    return host, int(port)


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


def listen(host: str, port: int) -> socket.socket:
    """A socket listening on `port` of `host`'s own address only (a TCPStore server left to itself
    listens on every interface of the machine); JobMismatch names why it cannot."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise BadAddress(f"the rendezvous host {host!r} cannot be resolved: {e.strerror or e}; set MASTER_ADDR / "
                         "RDZV_ENDPOINT to an address of this node that the other nodes reach") from None
    if host != "localhost" and all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos):
        try:
            ipaddress.ip_address(host)
        except ValueError:  # a name this host maps to loopback (127.0.1.1 in /etc/hosts): other nodes differ
            raise BadAddress(f"the rendezvous host {host} is {infos[0][4][0]} on this host, which no other node "
                             "reaches: set MASTER_ADDR / RDZV_ENDPOINT to an address of this node that the other "
                             "nodes reach") from None  # fmt: skip
    error: OSError | None = None
    for family, kind, proto, _, address in infos:
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
            sock.listen(128)
            return sock
        except OSError as e:
            sock.close()
            error = e
    if error.errno == errno.EADDRNOTAVAIL:
        raise BadAddress(f"the rendezvous host {host} ({infos[0][4][0]}) is not an address of this host, so this "
                         "node cannot be node 0: start node 0 on that host, or set MASTER_ADDR / RDZV_ENDPOINT to an "
                         "address of this node that the other nodes reach") from None  # fmt: skip
    kind = PortTaken if error.errno == errno.EADDRINUSE else JobMismatch
    raise kind(f"port {port} on {host} cannot be used: {error.strerror or error}")


def serve(host: str, port: int, timeout_s: float, multi_tenant: bool = False) -> Any:
    """A TCPStore server on `listen(host, port)`. With `multi_tenant`, torch's own stores for that
    port in this process (torchrun's rendezvous) use this server, so they listen there too."""
    from torch.distributed import TCPStore

    sock = listen(host, port)
    try:
        store = TCPStore(host, sock.getsockname()[1], is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_s), multi_tenant=multi_tenant,
                         master_listen_fd=sock.fileno())  # fmt: skip
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store's server owns the socket now
    return store


class Meeting:
    """This node's place in the job until `close`: the coordinator's store and lock, or a joined
    node's slot (freed on close, so a restarted node can take it)."""

    def __init__(self, store: Any, release: Callable[[], None]):
        self.store, self._release = store, release

    def close(self) -> None:
        if self.store is not None:
            self._release()
            self.store = None

    def wait_for_nodes(self, nnodes: int, timeout_s: float) -> None:
        """Return once all `nnodes` nodes of the job have joined (the coordinator and a claimed slot
        each); JobMismatch naming how many had after `timeout_s`, on SIGTERM / SIGINT, or when the
        coordinator's store goes away. Asked in short calls, so a signal is acted on within one."""
        host, port = self.store.host, self.store.port
        deadline, here, waited = time.monotonic() + timeout_s, 1, False
        with _stoppable() as got:
            try:
                while (here := _nodes_here(self.store, nnodes, host, port)) < nnodes:
                    if time.monotonic() > deadline:
                        raise JobMismatch(f"only {here} of the job's NNODES={nnodes} nodes arrived at {host}:{port} "
                                          f"within {timeout_s:g} s (comm.init_timeout_seconds): start the others with "
                                          "the same MASTER_ADDR / MASTER_PORT (or RDZV_ENDPOINT)")  # fmt: skip
                    if not waited:
                        print(f"flashcp: waiting for the other nodes at {host}:{port}: {here} of {nnodes} here (up to "
                              f"{timeout_s:g} s, comm.init_timeout_seconds; Ctrl-C stops)", flush=True)  # fmt: skip
                        waited = True
                    time.sleep(WAIT_POLL_S)
            except _Stop:
                raise JobMismatch(f"{signal.Signals(got[0]).name} while waiting for the other nodes ({here} of "
                                  f"{nnodes} here): nothing started") from None  # fmt: skip


def _nodes_here(store: Any, nnodes: int, host: str, port: int) -> int:
    """The coordinator and the nodes holding a slot; JobMismatch when the store no longer answers."""
    slots = [f"flashcp/node/{k}" for k in range(1, nnodes)]
    try:
        if _up(store):
            return 1 + sum(store.check([slot]) and store.get(slot) != b"" for slot in slots)
    except (RuntimeError, OSError, TimeoutError):
        pass
    raise JobMismatch(f"the coordinator at {host}:{port} went away while this node waited for the other nodes: "
                      "nothing started")


def meet(card: JobCard, dump_folder: str, nnodes: int, node_rank: int | None, timeout_s: float,
         take_lock: Callable[[], Callable[[], None]]) -> Meeting:  # fmt: skip
    """Join the job at the rendezvous address (see the module docstring); JobMismatch says why not.

    `node_rank` is None with `RDZV_ENDPOINT` (ranks are given at rendezvous); `take_lock()` takes
    the dump folder's lock and returns its release.
    """
    host, port = job_address()
    if node_rank is not None and node_rank >= nnodes:
        raise JobMismatch(f"NODE_RANK={node_rank} must be below NNODES={nnodes}")
    store = None
    if node_rank == 0 or (node_rank is None and is_local(host)):
        try:
            store = serve(host, port, timeout_s)
        except BadAddress:
            if node_rank == 0:  # its line names the fix: the address, not the port
                raise
        except PortTaken as e:
            if node_rank == 0:
                raise JobMismatch(_port_holder(card, Path(dump_folder), host, port) or
                                  f"{e} (another program listens there): the job's launchers meet on the rendezvous "
                                  "port + 1; choose another MASTER_PORT") from None  # fmt: skip
        except (JobMismatch, RuntimeError) as e:
            if node_rank == 0:
                raise JobMismatch(f"{e}: the job's launchers meet on the rendezvous port + 1; "
                                  "choose another MASTER_PORT") from None  # fmt: skip
    if store is not None:
        return _coordinate(store, card, Path(dump_folder), take_lock)
    store = _connect(host, port, timeout_s)
    _check_card(store, card, Path(dump_folder), host, port)
    slots = range(1, nnodes) if node_rank is None else [node_rank]  # the coordinator is node 0
    me = secrets.token_hex(8)
    slot = next((f"flashcp/node/{k}" for k in slots if _claim(store, f"flashcp/node/{k}", me)), None)
    if slot is not None:  # claimed last: a node refused for anything else holds no slot
        return Meeting(store, _hold(store, slot, me))
    if node_rank is not None:
        raise JobMismatch(f"NODE_RANK={node_rank} is already taken by another node of job {card.run_id}, "
                          "whose launcher is running")  # fmt: skip
    raise JobMismatch(f"job {card.run_id} already has all its NNODES={nnodes} nodes")


def _port_holder(mine: JobCard, folder: Path, host: str, port: int) -> str | None:
    """Who holds the meeting port on this host, in words, when it is a FlashCP coordinator: this job's
    node 0 (its card signed with the secret in this node's dump folder) or another job's; else None."""
    store = _client_or_none(host, port)
    if store is None:
        return None
    try:
        published, token_id = store.get("flashcp/card"), store.get("flashcp/token").decode()
        theirs = json.loads(published)
        run, dump = theirs["run_id"], theirs["settings"].get("job.dump_folder")
    except (RuntimeError, OSError, TimeoutError, ValueError, TypeError, KeyError, AttributeError):
        return None
    if run != mine.run_id:
        return (f"the meeting port {host}:{port} (the rendezvous port + 1) is held by the coordinator of another job, "
                f"{run} (dump folder {dump}): choose another MASTER_PORT for this job")  # fmt: skip
    token = _read_token(folder, check_mode=False)
    signed = token is not None and _token_id(token) == token_id and hmac.compare_digest(
        _sign(token, published, token_id), store.get("flashcp/signature").decode())  # fmt: skip
    if not signed:
        return None
    return (f"node 0 of job {run} is already running: its launcher holds the meeting at {host}:{port} and the dump "
            f"folder {folder}; a second node 0 is refused (another node takes NODE_RANK 1..NNODES-1; to restart "
            "node 0, stop the running one first)")  # fmt: skip


def _client_or_none(host: str, port: int) -> Any:
    """A client of the TCPStore at host:port, or None when none answers within 2 x CONNECT_TRY_S: torch's
    client waits forever on a listener that accepts and never speaks its protocol, so it is made in a
    daemon thread that is left behind in that case."""
    from torch.distributed import TCPStore

    made: list[Any] = []

    def connect() -> None:
        try:
            made.append(TCPStore(host, port, is_master=False, timeout=timedelta(seconds=CONNECT_TRY_S)))
        except (RuntimeError, OSError, TimeoutError):
            pass

    thread = threading.Thread(target=connect, daemon=True, name="flashcp-port-holder")
    thread.start()
    thread.join(2 * CONNECT_TRY_S)
    return made[0] if made else None


def _coordinate(store: Any, card: JobCard, folder: Path, take_lock: Callable[[], Callable[[], None]]) -> Meeting:
    """Hold the lock, write a fresh secret into the dump folder, publish the card signed with it; the
    meeting's release removes the secret, then the lock."""
    release = take_lock()
    token = secrets.token_hex(32)

    def end() -> None:
        try:
            _remove_token(folder, token)
        finally:
            release()

    try:
        _write_token(folder, token)
        published, token_id = json.dumps(asdict(card)).encode(), _token_id(token)
        store.set("flashcp/token", token_id)
        store.set("flashcp/signature", _sign(token, published, token_id))
        store.set("flashcp/card", published)  # last: a node that sees the card sees the rest
    except BaseException:
        end()
        raise
    return Meeting(store, end)


def _token_id(token: str) -> str:
    """What the store may show of the secret: a hash that names it without giving it away."""
    return hashlib.sha256(f"flashcp node token {token}".encode()).hexdigest()[:16]


def _sign(token: str, published: bytes, token_id: str) -> str:
    return hmac.new(token.encode(), published + b"\n" + token_id.encode(), hashlib.sha256).hexdigest()


def _check_card(store: Any, mine: JobCard, folder: Path, host: str, port: int) -> None:
    """Refuse another job, a folder without the coordinator's secret, an unsigned card, other settings or code.

    Anyone reaching the port can write the store: nothing read from it is believed before its
    signature is checked with the secret that only the shared dump folder holds.
    """
    published, token_id = store.get("flashcp/card"), store.get("flashcp/token").decode()
    try:
        theirs = json.loads(published)
        other = (theirs["run_id"], theirs["settings"].get("job.dump_folder"))
    except (ValueError, TypeError, KeyError, AttributeError):
        other = None  # not a card at all: refused below, as not signed
    if other is not None and other[0] != mine.run_id:
        raise JobMismatch(
            f"the rendezvous at {host}:{port - 1} belongs to job {other[0]} (dump folder {other[1]}), not to this "
            f"node's job {mine.run_id} (dump folder {mine.settings.get('job.dump_folder')}): give each job its own "
            "rendezvous address"
        )
    token = _read_token(folder)
    if token is None or _token_id(token) != token_id:
        state = "holds no node token" if token is None else "holds another node token than the coordinator published"
        raise JobMismatch(
            f"job.dump_folder {folder} on this host {state}: it is not the folder the coordinator writes; the dump "
            f"folder must be on a file system that every node shares (or someone else wrote the store at {host}:{port})"
        )
    if not hmac.compare_digest(_sign(token, published, token_id), store.get("flashcp/signature").decode()):
        raise JobMismatch(
            f"the job card at {host}:{port} is not signed with this job's secret (the node token in {folder}): "
            "someone other than the coordinator wrote it; the rendezvous ports must be reachable only by the job's nodes"
        )
    if theirs["settings"] != mine.settings:
        diff = first_difference(mine.settings, theirs["settings"])
        raise JobMismatch(f"this node's settings differ from the coordinator's: {diff}")
    if theirs["code"] != mine.code:
        raise JobMismatch("this node runs other code than the coordinator (another FlashCP version or local edits)")


def _claim(store: Any, key: str, me: str) -> bool:
    """Take the node slot `key` if it is free or its holder's launcher no longer beats."""
    holder = store.compare_set(key, "", me).decode()
    if holder == me:
        return True
    return not _beating(store, holder) and store.compare_set(key, holder, me).decode() == me


def _beating(store: Any, holder: str) -> bool:
    """Whether the launcher holding a slot as `holder` is alive: its beat count moves within DEAD_AFTER_S."""
    key, deadline = f"flashcp/beat/{holder}", time.monotonic() + DEAD_AFTER_S
    first = store.add(key, 0)
    while time.monotonic() < deadline:
        time.sleep(BEAT_S / 4)
        if store.add(key, 0) != first:
            return True
    return False


def _hold(store: Any, slot: str, me: str) -> Callable[[], None]:
    """Beat every BEAT_S while this launcher runs (a SIGKILLed one stops beating, and its slot is
    taken over); returns the release that stops the beat and frees the slot."""
    done, beats = threading.Event(), store.clone()  # its own connection: the beat never waits on another call

    def beat() -> None:
        try:
            while not done.wait(BEAT_S) and _up(beats):
                beats.add(f"flashcp/beat/{me}", 1)
        except RuntimeError:  # the coordinator's store went away: the job has ended
            pass

    thread = threading.Thread(target=beat, daemon=True, name="flashcp-node-slot")
    thread.start()

    def release() -> None:
        done.set()
        thread.join()
        try:
            if _up(store):  # else the coordinator has ended, and the slot with its store
                store.compare_set(slot, me, "")
        except RuntimeError:
            pass

    return release


def _up(store: Any) -> bool:
    """Whether the store's server still answers (asked with a plain socket: c10d's client logs a
    server gone away with a stack trace on the console)."""
    try:
        socket.create_connection((store.host, store.port), timeout=CONNECT_TRY_S).close()
    except OSError:
        return False
    return True


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
    """The secret, readable by its owner only; JobMismatch where the file system shows it readable by
    others (one that does not keep permissions would hand the secret to anyone who can read the folder)."""
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / f"{TOKEN_NAME}.partial"
    partial.unlink(missing_ok=True)
    with os.fdopen(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:  # a secret
        f.write(token)
        mode = os.fstat(f.fileno()).st_mode & 0o777
    if mode & 0o077:
        partial.unlink(missing_ok=True)
        raise JobMismatch(f"the dump folder's file system shows the node token {folder / TOKEN_NAME} as mode "
                          f"{mode:04o} although it was written 0600: it does not keep permissions, so others could "
                          "read the job's secret; use a dump folder on a file system that keeps them")  # fmt: skip
    os.replace(partial, folder / TOKEN_NAME)


def _read_token(folder: Path, check_mode: bool = True) -> str | None:
    """The secret in the dump folder (None: no token); JobMismatch when others may have read it."""
    path = folder / TOKEN_NAME
    try:
        with open(path) as f:
            mode = os.fstat(f.fileno()).st_mode & 0o777
            token = f.read().strip()
    except OSError:
        return None
    if check_mode and mode & 0o077:
        raise JobMismatch(f"the node token {path} is mode {mode:04o}, not 0600: others may have read the job's "
                          "secret and could sign a job card; this node refuses to join (restart node 0, which writes "
                          "a fresh one readable by its owner only)")  # fmt: skip
    return token


def _remove_token(folder: Path, token: str) -> None:
    """Remove the secret when the job ends, unless the file holds another one by now."""
    if _read_token(folder, check_mode=False) == token:
        (folder / TOKEN_NAME).unlink(missing_ok=True)
