"""Stop a run at a step boundary when the scheduler or the user asks, instead of dying mid-step.

SIGTERM (a cluster scheduler's preemption notice) and SIGINT (Ctrl-C, forwarded to every rank by
the launcher) only set a flag here. At the next step boundary the ranks agree on it -- a one-int
all-reduce on a CPU (gloo) group, so no device synchronisation is added to the step -- and all
stop after the same step, where the trainer saves a checkpoint. The signal reaches the ranks at
different moments; without the agreement they would stop at different steps and hang in a
collective. A second signal to a rank ends it at once.
"""

from __future__ import annotations

import os
import signal

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """Catches SIGTERM / SIGINT in this process; `agreed()` is the collective verdict."""

    def __init__(self) -> None:
        self.signum = 0
        multi = dist.is_initialized() and dist.get_world_size() > 1
        self._group = dist.new_group(backend="gloo") if multi else None
        self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}

    def _handle(self, signum: int, frame: object) -> None:
        if self.signum:  # asked twice: stop now
            os._exit(128 + signum)
        self.signum = signum

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
