"""Start `train.py` on every device of this node through torchrun's agent, and own the run.

The job front end (`flashcp.titan.launch`) checks the job; this module knows nothing of job files:
it gets the dump folder and the ranks' arguments. Ranks per node: `NGPU`, else the visible GPUs,
else (no GPU: gloo on CPU) the world size the job's layout fixes, or 2. Multi-node jobs pass
torchrun's rendezvous through the environment: `NNODES`, `NODE_RANK`, `MASTER_ADDR`,
`MASTER_PORT`, or `RDZV_ENDPOINT` (+ `RDZV_BACKEND`); `MAX_RESTARTS` allows elastic restarts.
`LOG_RANK` (default 0) picks the local ranks shown on the console; every rank's full log goes to
`<dump_folder>/logs/<time>-node<k>-<host>/`.

SIGTERM / Ctrl-C stop the run at the next step boundary with a checkpoint (`flashcp.run.preemption`);
`FLASHCP_STOP_TIMEOUT` (default 600 s) is how long the ranks get for that save before they are
killed; a second Ctrl-C stops at once. The ranks die with the launcher (`flashcp.run.rank` arms a
parent-death signal), also when it is SIGKILLed. A failed run ends with the failing rank's one-line
reason instead of torchrun's traceback.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from flashcp.run.preemption import ForwardStop, TORCHRUN_SIGNALS

TRAIN_PY = Path(__file__).resolve().parents[2] / "train.py"
SHOWN_RANKS = os.environ.get("LOG_RANK", "0")  # local ranks whose output reaches the console
STORE_TIMEOUT_S = 60  # of the launcher's own client of torchrun's store (the agent has its own)


class LaunchError(ValueError):
    """The launch environment (NNODES, NGPU, ...) cannot start this job; the message names it."""


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name) or str(default)
    if not value.isdigit() or int(value) < 1:
        raise LaunchError(f"environment variable {name} must be a positive integer, got {value!r}")
    return int(value)


def nodes() -> int:
    """NNODES, checked to come with a rendezvous address."""
    nnodes = env_int("NNODES", 1)
    if nnodes > 1 and not (os.environ.get("MASTER_ADDR") or os.environ.get("RDZV_ENDPOINT")):
        raise LaunchError(f"NNODES={nnodes} needs MASTER_ADDR (node 0's address) or RDZV_ENDPOINT")
    return nnodes


def ranks_per_node(hint: int | None, nnodes: int) -> tuple[int, bool]:
    """(ranks on this node, whether they use GPUs)."""
    import torch

    gpus = torch.cuda.device_count()
    if os.environ.get("NGPU"):
        return env_int("NGPU", 1), gpus > 0
    if gpus:
        return gpus, True
    if hint is not None and hint % nnodes == 0:
        return hint // nnodes, False
    return 2, False


def owns_folder() -> bool:
    """Whether this node's launcher holds the dump folder's lock: node 0's (the others share it)."""
    return os.environ.get("NODE_RANK", "0") == "0"


def multi_node(nnodes: int) -> bool:
    """Whether the launchers of several nodes meet (`flashcp.run.rendezvous`) before their ranks start."""
    return nnodes > 1 or bool(os.environ.get("RDZV_ENDPOINT") or os.environ.get("MASTER_ADDR"))


def node_rank() -> int | None:
    """NODE_RANK for a static rendezvous; None with RDZV_ENDPOINT (given at rendezvous)."""
    if os.environ.get("RDZV_ENDPOINT"):
        return None
    value = os.environ.get("NODE_RANK", "0")
    if not value.isdigit():
        raise LaunchError(f"environment variable NODE_RANK must be an integer >= 0, got {value!r}")
    return int(value)


def serve_rendezvous(nnodes: int) -> Any:
    """torchrun's rendezvous store, served here on the rendezvous address only where this node hosts
    it (else None): the agent's own would listen on every interface of the machine, but its store is
    multi-tenant, so it uses this server instead. A single-node run gets a loopback port of its own.
    """
    from flashcp.run.rendezvous import JobMismatch, is_local, rendezvous_address, serve

    if not multi_node(nnodes):
        return serve("127.0.0.1", 0, STORE_TIMEOUT_S, multi_tenant=True)
    host, port = rendezvous_address()
    if not (is_local(host) if os.environ.get("RDZV_ENDPOINT") else node_rank() == 0):
        return None
    try:
        return serve(host, port, STORE_TIMEOUT_S, multi_tenant=True)
    except (JobMismatch, RuntimeError):  # another launcher on this host serves it, or torch names the problem
        return None


def torchrun_args(nproc: int, nnodes: int, log_dir: str, run_id: str, argv: list[str], store: Any) -> list[str]:
    """torchrun's arguments; `store` is `serve_rendezvous`'s, whose port a single-node run uses."""
    env = os.environ
    args = [f"--nproc_per_node={nproc}", f"--nnodes={nnodes}", f"--rdzv_id={run_id}"]
    if env.get("RDZV_ENDPOINT"):
        args += [f"--rdzv_endpoint={env['RDZV_ENDPOINT']}", f"--rdzv_backend={env.get('RDZV_BACKEND', 'c10d')}"]
    elif multi_node(nnodes):
        args += [
            f"--node_rank={node_rank()}",
            f"--master_addr={env.get('MASTER_ADDR', '127.0.0.1')}",
            f"--master_port={env.get('MASTER_PORT', '29500')}",
        ]
    else:  # torchrun's --standalone: a private rendezvous on a free (loopback) port
        args += ["--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{store.port}"]
    args += [f"--max-restarts={restarts()}", f"--signals-to-handle={TORCHRUN_SIGNALS}"]  # SIGTERM/INT: ours
    args += [f"--local-ranks-filter={SHOWN_RANKS}", "--tee=3", f"--log-dir={log_dir}"]
    return [*args, str(TRAIN_PY), *argv]


def restarts() -> int:
    """MAX_RESTARTS: how often torchrun restarts a failed group (each restart resumes from the newest
    complete checkpoint); 0 by default."""
    value = os.environ.get("MAX_RESTARTS", "0")
    if not value.isdigit():
        raise LaunchError(f"environment variable MAX_RESTARTS must be an integer >= 0, got {value!r}")
    return int(value)


def node_logs(log_dir: str) -> Any:
    """torchrun's log layout with the run folder named by time, node and host instead of
    `none_<random>`: `<log_dir>/<YYYYmmdd-HHMMSS>-node<k>-<host>/attempt_<n>/<local rank>/`."""
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, Std

    class NodeLogs(DefaultLogsSpecs):
        # Sets DefaultLogsSpecs' own run folder (`_run_log_dir`, torch 2.11-2.13) before it makes one.
        def reify(self, envs: dict[int, dict[str, str]]) -> Any:
            if not self._run_log_dir and envs:
                node = envs[0].get("GROUP_RANK", "0")
                name = f"{time.strftime('%Y%m%d-%H%M%S')}-node{node}-{socket.gethostname()}"
                self._run_log_dir = tempfile.mkdtemp(prefix=f"{name}-", dir=self.root_log_dir)
            return super().reify(envs)

    return NodeLogs(log_dir=log_dir, tee=Std.from_str("3"), local_ranks_filter=set(map(int, SHOWN_RANKS.split(","))))


def launch(dump_folder: str, argv: list[str], nproc: int, nnodes: int, on_gpu: bool, stop_timeout: int,
           run_id: str, locks: list[Any] = ()) -> int:  # fmt: skip
    """Run torchrun's agent in this process until every rank has ended; the exit code of the run.

    `argv` goes to every rank's train.py; `dump_folder` (absolute) holds the rank logs. While the
    ranks run, each of `locks` is checked every few seconds: a lock file removed or replaced stops
    the ranks (they save at their next step) and the run fails saying so.
    """
    os.environ["FLASHCP_LAUNCHER"] = str(os.getpid())  # the ranks' parent: they die with it
    if restarts():  # torch 2.13's agent cannot re-rendezvous on a TCP store it shares with the ranks
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    os.environ.setdefault("PYTHONUNBUFFERED", "1")  # rank logs written as they come, whole up to a crash
    if not on_gpu:  # share the cores between the ranks instead of oversubscribing them
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    log_dir = os.path.join(dump_folder, "logs")

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, get_args_parser

    store = serve_rendezvous(nnodes)  # kept until the agent ends
    stop = ForwardStop(stop_timeout)  # SIGTERM / SIGINT: the ranks save at their next step boundary
    stop.install()
    watch = RunWatch(locks, stop)
    try:
        config, cmd, cmd_args = config_from_args(get_args_parser().parse_args(
            torchrun_args(nproc, nnodes, log_dir, run_id, argv, store)))  # fmt: skip
        config.logs_specs = node_logs(log_dir)
        elastic_launch(config=config, entrypoint=cmd)(*cmd_args)
    except KeyboardInterrupt:
        print(f"flashcp: {signal.Signals(stop.signum).name} before the ranks started: nothing saved", flush=True)
        return 128 + stop.signum
    except SignalException as e:  # SIGHUP / SIGQUIT: torchelastic stopped the ranks
        print(f"flashcp: {e.sigval.name}: the ranks were stopped without a checkpoint", flush=True)
        return 128 + e.sigval
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        if stop.forced:
            print(f"flashcp: ranks killed on {stop.forced}: no checkpoint at this step; full logs: {log_dir}",
                  file=sys.stderr)  # fmt: skip
            return 128 + stop.signum
        if stop.signum and failure.exitcode == -signal.SIGTERM:  # a rank not yet catching signals
            print(f"flashcp: {signal.Signals(stop.signum).name} while the ranks started: nothing saved", flush=True)
            return 128 + stop.signum
        message = failure.message  # a dict when train.py recorded its reason in the error file
        detail = message if isinstance(message, str) else message.get("message", "")
        if failure.exitcode == 2:  # a job error train.py already explained in one line
            print(f"error: {detail}", file=sys.stderr)
            return 2
        print(f"full logs of every rank: {log_dir}", file=sys.stderr)
        if watch.stopped and rank not in watch.stopped:
            frozen = min(watch.stopped)
            print(f"error: rank {frozen} (PID {watch.stopped[frozen]}) was stopped (SIGSTOP or a debugger) and "
                  f"stopped answering; rank {rank} then failed (exit code {failure.exitcode}): {detail}",
                  file=sys.stderr)  # fmt: skip
            return 1
        print(f"error: rank {rank} failed (exit code {failure.exitcode}): {detail}", file=sys.stderr)
        return 1
    finally:
        watch.close()
        stop.close()
    if watch.lost:
        print(f"error: {watch.lost}: the ranks were stopped after their last step; full logs: {log_dir}",
              file=sys.stderr)  # fmt: skip
        return 1
    return 0


class RunWatch:
    """Every `period_s` while the ranks run: are the run's locks intact, is any local rank stopped?

    A lost lock stops the ranks (they save at their next step). A rank stopped by SIGSTOP or a
    debugger is only noted: its peers then time out in a collective and the agent reports one of
    *them* as failing, so the failure line names the stopped rank instead.
    """

    def __init__(self, locks: list[Any], stop: ForwardStop, period_s: float = 2.0) -> None:
        self.lost = ""
        self.stopped: dict[int, int] = {}  # rank -> pid of ranks seen stopped
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(locks, stop, period_s), daemon=True,
                                        name="flashcp-run-watch")  # fmt: skip
        self._thread.start()

    def _watch(self, locks: list[Any], stop: ForwardStop, period_s: float) -> None:
        while not self._done.wait(period_s):
            self.stopped.update(stopped_ranks(stop.ranks()))
            lost = next((lock for lock in locks if not lock.intact()), None)
            if lost is not None and not self.lost:
                self.lost = f"the run's lock file {lost.path} was removed or replaced while the ranks ran"
                stop.stop_ranks(self.lost)

    def close(self) -> None:
        self._done.set()


def stopped_ranks(pids: list[int]) -> dict[int, int]:
    """{rank: pid} of the processes among `pids` that are stopped (state T / t in /proc)."""
    found = {}
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except (OSError, IndexError):
            continue
        rank = next((e[5:].decode() for e in environ if e.startswith(b"RANK=")), "")
        if state in ("T", "t") and rank.isdigit():
            found[int(rank)] = pid
    return found
