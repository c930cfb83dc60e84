"""The planning worker process ends with its loader, with its parent, and says why it failed."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from flashcp.data.loader import build_loader
from flashcp.data.plan_worker import PlanWorker, WorkerError
from flashcp.data.sources import DataConfig
from flashcp.dispatch import build_dispatch


def running(pid: int) -> bool:
    """The process exists and is not a zombie (an exited child nobody reaped yet)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def wait_gone(pid: int, limit: float = 60.0) -> bool:
    deadline = time.monotonic() + limit  # only catches a hang; a clean exit is far quicker
    while running(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not running(pid)


def worker_loader(prefetch: int):
    cfg = DataConfig(source="synthetic", synthetic_lengths="pile", prefetch=prefetch)
    loader = build_loader(cfg, 4096, 0, 1, 2, planner_kwargs={"strategy": "flashcp"})
    loader.dispatch_with(functools.partial(build_dispatch, rank=1, comm="compact"), worker=True)
    return loader


@pytest.mark.parametrize("prefetch", [0, 2])
def test_close_ends_the_worker_and_iteration_continues_with_a_new_one(prefetch: int) -> None:
    loader = worker_loader(prefetch)
    with loader:
        first = next(loader)
        pid = loader._worker.pid
        assert running(pid)
    assert not running(pid)  # close() waited for it
    with loader:
        second = next(loader)
        assert loader._worker.pid != pid
    assert second["window"] == first["window"] + 1


def test_a_killed_worker_is_one_line_naming_it_its_pid_and_the_signal() -> None:
    """The rank's reason (what the launcher prints last, `root_cause`) is the worker's death, not the
    broken pipe it was found by."""
    from flashcp.run.publish import root_cause

    loader = worker_loader(0)
    with loader:
        next(loader)
        pid = loader._worker.pid
        os.kill(pid, signal.SIGKILL)
        assert wait_gone(pid)  # dead before the next request: its write finds the pipe broken
        with pytest.raises(WorkerError) as raised:
            next(loader)
    message = root_cause(raised.value)
    assert "\n" not in message
    assert message.startswith(f"WorkerError: the planning worker process (pid {pid}) exited with code -9 (killed by "
                              "SIGKILL)")  # fmt: skip


def next_or_hang(loader, limit: float = 120.0):
    """next(loader) in a thread, the exception it raised; a hang (no answer within `limit`, far more
    than the worker's time-out) fails the test and kills the worker, which ends the thread's wait."""
    outcome: list = []

    def pull() -> None:
        try:
            outcome.append(next(loader))
        except BaseException as e:
            outcome.append(e)

    thread = threading.Thread(target=pull, daemon=True)
    thread.start()
    thread.join(limit)
    if thread.is_alive():
        os.kill(loader._worker.pid, signal.SIGKILL)
        thread.join()
        pytest.fail(f"next() still waited for the stopped planning worker after {limit:g} s")
    return outcome[0]


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_stopped_worker_is_named_and_killed_not_waited_for(prefetch: int) -> None:
    loader = worker_loader(prefetch)
    with loader:
        next(loader)
        pid = loader._worker.pid
        os.kill(pid, signal.SIGSTOP)
        for _ in range(prefetch + 2):  # the batches prefetched before the stop, then the error
            error = next_or_hang(loader)
            if isinstance(error, BaseException):
                break
    assert isinstance(error, WorkerError)
    assert str(error) == f"the planning worker process (pid {pid}) is stopped (SIGSTOP or a debugger) and does not " \
                         "answer; it was killed"  # fmt: skip
    assert wait_gone(pid)


def test_a_worker_silent_past_its_time_out_is_named_and_killed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker that runs but never answers (played by a stopped one that /proc is made to show running)."""
    from flashcp.data import plan_worker

    monkeypatch.setattr(plan_worker, "_state", lambda pid: "S")
    loader = worker_loader(0)
    loader.dispatch_with(functools.partial(build_dispatch, rank=1, comm="compact"), worker=True, worker_timeout_s=2.0)
    with loader:
        next(loader)
        pid = loader._worker.pid
        os.kill(pid, signal.SIGSTOP)
        error = next_or_hang(loader)
    assert isinstance(error, WorkerError)
    assert str(error) == (f"the planning worker process (pid {pid}) did not answer within 2 s ([flashcp] "
                          "plan_worker_timeout_seconds); it was killed")  # fmt: skip
    assert wait_gone(pid)


def test_the_worker_plans_with_the_collector_paused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planning allocates tens of thousands of tuples without cycles: the worker pauses the cyclic
    collector for a request, and what its imports made (torch's objects) is never scanned."""
    from collector_probe import collector_state

    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))  # the worker imports the probe too
    worker = PlanWorker()
    try:
        enabled, frozen = worker.run(collector_state, None, [1])[0]
    finally:
        worker.close()
    assert not enabled and frozen > 10_000


def test_the_worker_ends_when_its_parent_is_killed() -> None:
    """No orphan: the worker reads its requests from the parent and ends at their end."""
    script = ("from flashcp.data.plan_worker import PlanWorker\n"
              "w = PlanWorker(); print(w.pid, flush=True)\n"
              "assert w.run(len, None, [3, 4]) == (2, None)\n"
              "print('ready', flush=True); import time; time.sleep(600)\n")  # fmt: skip
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(parent.stdout.readline())
        assert parent.stdout.readline().strip() == "ready"
        assert running(pid)
    finally:
        parent.kill()
        parent.wait()
    assert wait_gone(pid)


def planner_the_worker_cannot_import(doc_lens: list[int]) -> int:
    return len(doc_lens)


def test_a_request_the_worker_cannot_read_fails_alone() -> None:
    """This test module is not importable in the worker: that request fails, the next one works."""
    from flashcp.data.plan_worker import PlanWorker

    worker = PlanWorker()
    try:
        with pytest.raises(ModuleNotFoundError, match="test_plan_worker_process"):
            worker.run(planner_the_worker_cannot_import, None, [1, 2])
        assert worker.run(len, None, [1, 2, 3]) == (3, None)
    finally:
        worker.close()


def test_a_reply_carries_its_arrays_out_of_band_intact_and_aligned() -> None:
    """A reply's tensors travel as out-of-band buffers read straight into one message body (the
    copy happens in the pipe's read, without the GIL); every dtype comes back equal, a bfloat16 or
    non-contiguous tensor through ordinary pickling, and each array is aligned for its dtype."""
    import pickle
    import threading

    import torch

    from flashcp.data.plan_worker import _dumps_reply, _receive, _send

    tensors = [torch.arange(n).to(dtype) for n, dtype in
               [(0, torch.int64), (3, torch.int32), (5, torch.bool), (100_003, torch.int64),
                (7, torch.float64), (9, torch.bfloat16)]] + [torch.arange(40).view(8, 5).t()]  # fmt: skip
    data, buffers = _dumps_reply((True, ({"plan": "x"}, tensors)))
    assert len(buffers) >= 5  # the numpy-representable contiguous ones
    read_fd, write_fd = os.pipe()  # 64 KiB: the writer runs beside the reader, as the worker does
    with os.fdopen(read_fd, "rb") as reader, os.fdopen(write_fd, "wb") as writer:
        sender = threading.Thread(target=_send, args=(writer, data, buffers))
        sender.start()
        body, received = _receive(reader)
        sender.join()
    ok, (plan, got) = pickle.loads(body, buffers=received)
    assert ok and plan == {"plan": "x"}
    for want, have in zip(tensors, got, strict=True):
        assert have.dtype == want.dtype and torch.equal(have, want)
        assert have.numel() == 0 or have.data_ptr() % have.element_size() == 0


def test_the_worker_runs_this_flashcp_whatever_the_working_directory(tmp_path, monkeypatch) -> None:
    """Started from a directory holding another `flashcp`, the worker still imports the parent's:
    `python -m` puts the working directory first on its path."""
    (tmp_path / "flashcp").mkdir()
    (tmp_path / "flashcp" / "__init__.py").write_text("raise ImportError('another flashcp')\n")
    monkeypatch.chdir(tmp_path)
    worker = PlanWorker()
    try:
        assert worker.run(len, None, [1, 2, 3]) == (3, None)
    finally:
        worker.close()
