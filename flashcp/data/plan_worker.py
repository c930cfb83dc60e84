"""Planning and dispatching in a worker process, so that the loader's thread does not hold the GIL.

The loader's thread plans each window and builds this rank's dispatch while the training thread
launches kernels. Both are pure Python / small-tensor work that holds the GIL, and on a busy
training thread every switch to the loader's thread and back costs the step time (measured by
`benchmarks/loader_stall.py`). In a worker process the same functions run on their own
interpreter; the loader's thread only waits for the result (without the GIL) and receives the
plan and the dispatch's tensors. The planner and the dispatcher must be picklable (e.g.
`functools.partial(plan_shards, ...)`, `functools.partial(build_dispatch, rank=..., comm=...)`);
the outputs are those of calling them in the thread.

The worker is a plain child process (`python -m flashcp.data.plan_worker`) exchanging pickles
(length-prefixed) over its stdin / stdout pipes, not a multiprocessing pool: a pool cannot start
from a daemonic process, and a child reading its stdin ends by itself when the parent closes it or
dies (no orphans). Both ends
of the pipes are processes FlashCP started; nothing else is unpickled. The child runs in its own
session and ignores SIGINT, so a Ctrl-C reaches only the ranks, which stop at a step boundary and
then close the worker. The planner and the dispatcher are pickled by reference: they must be
importable from `flashcp`'s directory and PYTHONPATH (not from a script's `__main__`).

A worker that fails is a WorkerError naming it, its PID and how: how it ended (its exit code or the
signal that killed it), stopped (SIGSTOP, a debugger: named within a second) or silent for longer
than its time-out (`[flashcp] plan_worker_timeout_seconds`, by default half of the 100 s after
which the rank's peers would fail in a collective naming nothing); a stopped or silent worker is
killed, so the rank ends at once with that line.
"""

from __future__ import annotations

import argparse
import gc
import io
import os
import pickle
import select
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import torch

from flashcp.data.balance import gc_paused

_ROOT = str(Path(__file__).resolve().parents[2])  # the directory holding the flashcp package
TIMEOUT_S = 50.0  # a library default; the trainer's is [flashcp] plan_worker_timeout_seconds
WATCH_S = 1.0  # how often a worker that has not answered yet is looked at (stopped?)
START_S = 300.0  # the longest a worker's start may take (importing torch on a loaded machine), if longer than the above


class WorkerError(RuntimeError):
    """The worker process ended or could not be reached; the message names the cause."""


class PlanWorker:
    """One child process planning windows one at a time; `timeout_s`: how long a window's plan may take
    before the worker counts as hung (its first, which includes the worker's start, too)."""

    def __init__(self, timeout_s: float = TIMEOUT_S) -> None:
        self.timeout_s, self._started = timeout_s, False
        path = os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")]))
        # Started in flashcp's directory: `-m` puts the working directory first on the path, and
        # another checkout there would answer with other code.
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "flashcp.data.plan_worker"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            env=dict(os.environ, PYTHONPATH=path), cwd=_ROOT, start_new_session=True,
        )  # fmt: skip

    @property
    def pid(self) -> int:
        return self._proc.pid

    def run(self, planner: Callable, dispatcher: Callable | None, doc_lens: Sequence[int]) -> tuple[Any, Any]:
        """(planner(doc_lens), dispatcher(plan)), computed in the worker; its exception is raised here.

        WorkerError names the worker, its PID and how it failed: how it ended (its exit code or signal),
        stopped (SIGSTOP or a debugger: named within WATCH_S) or silent for `timeout_s` (then it is
        killed; its start, up to START_S, is not counted)."""
        try:
            failure = None
            if not self._started:  # its start (a Python with torch) is not an answer's time: a message says it is up
                limit = max(self.timeout_s, START_S)
                failure = self._await_reply(limit, f"did not start within {limit:g} s")
                self._started = failure is None and _receive(self._proc.stdout) is not None
            if failure is None:
                _send(self._proc.stdin, pickle.dumps((planner, dispatcher, [int(n) for n in doc_lens])))
                failure = self._await_reply(self.timeout_s, f"did not answer within {self.timeout_s:g} s ([flashcp] "
                                                            "plan_worker_timeout_seconds)")  # fmt: skip
            if failure is None:
                data, buffers = _receive(self._proc.stdout)
                ok, value = pickle.loads(data, buffers=buffers)
        except (OSError, EOFError) as e:
            failure = f"{self._ended()} ({type(e).__name__}: {e})"
        if failure is not None:  # raised outside the handler: the rank's reason is the worker's, not the pipe's
            raise WorkerError(f"the planning worker process (pid {self.pid}) {failure}")
        if not ok:
            raise value
        return value

    def _await_reply(self, limit_s: float, silent: str) -> str | None:
        """Wait until the worker's next message (or its end) can be read; else why not, the worker killed.

        Between two messages the reader's buffer is empty (one request, one reply), so the pipe's
        descriptor says whether the next one has begun."""
        deadline = time.monotonic() + limit_s
        out = self._proc.stdout.fileno()
        while not select.select([out], [], [], max(0.0, min(WATCH_S, deadline - time.monotonic())))[0]:
            if _state(self.pid) in ("T", "t"):
                failure = "is stopped (SIGSTOP or a debugger) and does not answer"
            elif time.monotonic() >= deadline:
                failure = silent
            else:
                continue
            self._proc.kill()  # a stopped process dies of SIGKILL too: the rank does not wait for it to end
            self._proc.wait()
            return f"{failure}; it was killed"
        return None

    def _ended(self) -> str:
        """How the worker ended, in words (its pipes close as it exits: give it a moment to be reaped)."""
        try:
            code = self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return "stopped answering"
        if code < 0:
            return f"exited with code {code} (killed by {signal.Signals(-code).name})"
        return f"exited with code {code}"


    def close(self) -> None:
        """End the worker (it exits at the end of its input) and wait for it."""
        if self._proc.poll() is None:
            try:
                self._proc.stdin.close()
                self._proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
        for pipe in (self._proc.stdin, self._proc.stdout):
            try:  # a request left unsent to a dead worker fails to flush: nothing to report beyond its end
                pipe.close()
            except OSError:
                pass


def _state(pid: int) -> str | None:
    """The process's state letter in /proc (R, S, T: stopped, ...); None where it cannot be read."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


class _ReplyPickler(pickle.Pickler):
    """Tensors as numpy arrays, whose bytes pickle out of band (protocol 5): the receiver reads them
    straight into their arrays' memory, a copy the pipe's read makes without the GIL. Unpickled in
    band, their copy held the loader thread's GIL for ~0.5 ms per 1M-token CP 16 dispatch (3.4 MB),
    and torch's own pickling ~1.3 ms."""

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is torch.Tensor and obj.device.type == "cpu" and not obj.requires_grad:
            try:
                return torch.from_numpy, (obj.numpy(),)
            except TypeError:  # a dtype numpy lacks (bfloat16): torch's own pickling
                pass
        return NotImplemented


def _dumps_reply(reply: Any) -> tuple[bytes, list[pickle.PickleBuffer]]:
    out, buffers = io.BytesIO(), []
    _ReplyPickler(out, protocol=5, buffer_callback=buffers.append).dump(reply)
    return out.getvalue(), buffers


def _starts(sizes: Sequence[int]) -> list[int]:
    """Where each part of a message's body begins: parts follow each other, each at a multiple of
    64 bytes, so that arrays read into the body are as aligned as the body (at least 16 bytes)."""
    starts = [0]
    for n in sizes[:-1]:
        starts.append(-(-(starts[-1] + n) // 64) * 64)
    return starts


def _send(pipe: BinaryIO, data: bytes, buffers: Sequence[pickle.PickleBuffer] = ()) -> None:
    """One message: how many parts, their sizes, then the body: the pickle and its out-of-band buffers
    (a message that fails to unpickle leaves the next intact)."""
    parts = [memoryview(data), *(b.raw() for b in buffers)]
    sizes = [len(part) for part in parts]
    pipe.write(b"".join(n.to_bytes(8, "little") for n in [len(parts), *sizes]))
    end = 0
    for start, part in zip(_starts(sizes), parts):
        pipe.write(bytes(start - end))
        pipe.write(part)
        end = start + len(part)
    pipe.flush()


def _receive(pipe: BinaryIO) -> tuple[memoryview, list[memoryview]]:
    """The next message's pickle and buffers, views of one body read in one call (the copy out of
    the pipe is made without the GIL). EOFError at the end of the stream."""
    head = pipe.read(8)
    count = int.from_bytes(head, "little")
    raw = pipe.read(8 * count) if len(head) == 8 else b""
    if len(head) < 8 or len(raw) < 8 * count or count < 1:
        raise EOFError("the pipe closed" + (" inside a message" if head else ""))
    sizes = [int.from_bytes(raw[i : i + 8], "little") for i in range(0, 8 * count, 8)]
    starts = _starts(sizes)
    body = bytearray(starts[-1] + sizes[-1])
    if pipe.readinto(body) < len(body):
        raise EOFError("the pipe closed inside a message")
    data, *buffers = (memoryview(body)[start : start + n] for start, n in zip(starts, sizes))
    return data, buffers


def _serve(requests: BinaryIO, replies: BinaryIO) -> None:
    """Answer each (planner, dispatcher, doc_lens) with (True, (plan, dispatch)) or (False, exception).

    A plan allocates tens of thousands of small tuples, without cycles: the cyclic collector is
    paused while one is made (the collections they triggered, each scanning torch's ~170K objects,
    made the p99 of planning 3-4x its median), and collects between requests."""
    while True:
        try:
            request, _ = _receive(requests)
        except EOFError:
            return
        try:
            planner, dispatcher, doc_lens = pickle.loads(request)
            with gc_paused():
                plan = planner(doc_lens)
                dispatch = dispatcher(plan) if dispatcher is not None else None
            reply = (True, (plan, dispatch))
        except Exception as e:
            e.add_note(f"in the planning worker process:\n{traceback.format_exc()}")
            reply = (False, e)
        try:
            data, buffers = _dumps_reply(reply)
        except Exception as e:  # an exception that does not pickle: its type and message
            error = RuntimeError(f"{type(reply[1]).__name__}: {reply[1]} ({e})")
            data, buffers = pickle.dumps((False, error)), []
        _send(replies, data, buffers)


def main(argv: list[str] | None = None) -> None:
    """The worker's loop on stdin / stdout; the loader starts it (`PlanWorker`), not a user."""
    argparse.ArgumentParser(prog="python -m flashcp.data.plan_worker", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)  # fmt: skip
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything the planner prints goes to stderr, not into the replies
    torch.set_num_threads(1)  # index building on small tensors: threads only add synchronisation
    gc.freeze()  # what the imports made lives as long as the process: collections need not scan it
    _send(replies, b"")  # up: from here on, every request is answered within the parent's time-out
    _serve(sys.stdin.buffer, replies)


if __name__ == "__main__":
    main()
