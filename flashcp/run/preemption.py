"""Stop a run at a step boundary when the scheduler or the user asks, instead of dying mid-step.

Ranks (`StopRequest`): SIGTERM (a cluster scheduler's preemption notice) and SIGINT (Ctrl-C)
only set a flag, from the moment the trainer starts building (a signal during model building or
checkpoint loading waits for the first step boundary too). At each step boundary the ranks agree
on it -- a one-int all-reduce on a CPU (gloo) group, so no device synchronisation is added to the
step -- and all stop after the same step, where the trainer saves a checkpoint. The signal
reaches the ranks at different moments; without the agreement they would stop at different steps
and hang in a collective. A second SIGINT to a rank ends it at once; a repeated SIGTERM does
not cut the save short (a scheduler such as Slurm signals every process of the job, the ranks
included, and the launcher forwards its own copy too).

Launcher (`ForwardStop`): torchelastic's own handling raises in its agent, forwards the signal and
SIGKILLs the ranks after a grace period, then reports the run as interrupted whatever the ranks
did. Instead the launcher sends the ranks SIGTERM itself (for a Ctrl-C too: a SIGINT reaching a
rank still starting Python prints a KeyboardInterrupt traceback, a SIGTERM ends it quietly) and
lets the agent keep watching: ranks that saved and exited 0 make a successful run (exit 0), a
rank that failed during the save is reported as a failure, ranks still running `timeout_s` after
the signal are killed, and a second SIGINT kills them at once (a rank blocked in a collective
could not run its own handler).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGTERM, signal.SIGINT)
TORCHRUN_SIGNALS = "SIGHUP,SIGQUIT"  # the signals torchelastic still handles (stopping the ranks at once)


class StopRequest:
    """Catches SIGTERM / SIGINT in this process; `agreed()` is the collective verdict.

    Created before the process group exists; `connect()` makes the agreement's CPU group once
    it does (every rank calls it at the same point).
    """

    def __init__(self) -> None:
        self.signum = 0
        self._group: dist.ProcessGroup | None = None
        self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}

    def _handle(self, signum: int, frame: object) -> None:
        if self.signum and signum == signal.SIGINT:  # Ctrl-C again: stop now
            os._exit(128 + signum)
        self.signum = self.signum or signum

    def connect(self) -> None:
        """Create the gloo group the ranks agree over (collective: all ranks, same point).

        Not under TorchTitan's fake backend (the dry run): its process group cannot create groups
        of another backend, and one rank simulating a job receives no signals to agree on."""
        if dist.is_initialized() and dist.get_world_size() > 1 and dist.get_backend() != "fake":
            self._group = dist.new_group(backend="gloo")

    def agreed(self) -> int:
        """The signal some rank received (0: none). Every rank must call it at the same step."""
        if self._group is None:
            return self.signum
        flag = torch.tensor([self.signum], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return int(flag.item())

    def close(self) -> None:
        """Give the signals back to their previous handlers."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


def child_pids(parent: int | None = None) -> list[int]:
    """The live children of `parent` (default: this process), read from /proc (Linux)."""
    parent = os.getpid() if parent is None else parent
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):  # the process ended meanwhile
            continue
        if int(fields[1]) == parent and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


class ForwardStop:
    """The launcher's SIGTERM / SIGINT handling while torchelastic's agent runs the ranks.

    Install it before starting the agent, which is told to leave these two signals alone.
    `ranks()` lists the ranks' PIDs (the launcher's children). `signum` is the first signal
    received (0: none), `forced` why the ranks were killed ("": they were not) -- a second
    SIGINT, or still running `timeout_s` after the first signal.
    """

    def __init__(self, timeout_s: float, ranks: Callable[[], list[int]] = child_pids) -> None:
        self.timeout_s = timeout_s
        self.ranks = ranks
        self.signum = 0
        self.forced = ""  # why the ranks were killed, if they were
        self._timer: threading.Timer | None = None

    def install(self) -> None:
        """Take SIGTERM / SIGINT (torchrun must be given `--signals-to-handle=TORCHRUN_SIGNALS`)."""
        for sig in SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if self.signum:  # a second Ctrl-C stops at once; a repeated SIGTERM changes nothing
            if signum == signal.SIGINT:
                self._kill(f"a second {name}")
            return
        self.signum = signum
        if not self.ranks():  # the ranks are not started yet: nothing to save
            raise KeyboardInterrupt
        self.stop_ranks(name)

    def stop_ranks(self, why: str) -> None:
        """Ask the ranks to stop after their next step with a checkpoint, killing them after `timeout_s`."""
        _signal_groups(self.ranks(), signal.SIGTERM)
        _say(f"flashcp: {why}: the ranks stop after their next step and save a checkpoint "
             f"(up to {self.timeout_s:g} s, FLASHCP_STOP_TIMEOUT); Ctrl-C again to stop at once")  # fmt: skip
        self._timer = threading.Timer(self.timeout_s, self._kill, [f"FLASHCP_STOP_TIMEOUT = {self.timeout_s:g} s"])
        self._timer.daemon = True
        self._timer.start()

    def _kill(self, why: str) -> None:
        self.forced = why
        _signal_groups(self.ranks(), signal.SIGKILL)

    def close(self) -> None:
        """Cancel the stop's deadline (the ranks have ended)."""
        if self._timer is not None:
            self._timer.cancel()


def _signal_groups(pids: list[int], signum: int) -> None:
    """Signal each rank's process group (torchrun starts each rank in a session of its own)."""
    for pid in pids:
        try:
            os.killpg(pid, signum)
        except ProcessLookupError:
            pass


def _say(line: str) -> None:
    """Write a line from a signal handler (os.write: print could re-enter a busy stream)."""
    os.write(2, (line + "\n").encode())
