"""CP = 2 training with the plan worker (`[flashcp] plan_worker`): the same losses as planning in the
loader's thread, a checkpoint taken with it resumes exactly, every worker process ends with its
trainer, and a worker that dies ends the run with one line naming it."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
from harness import tiny_job, train_on_pool_rank

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data"))
from test_plan_worker_process import running  # noqa: E402

CP2 = {"context_parallel_degree": 2}


def train_watching_workers(
    rank: int, group: Any, cfg: dict, stop_after: int | None = None, kill_at: int | None = None
) -> tuple[dict[int, float] | None, list[int], list[int], str | None]:
    """DistributedPool task: (losses, worker pids, those still running after training, error line).
    With `kill_at`, the worker is killed before the plan of that window (counted from 1)."""
    from flashcp.data.plan_worker import PlanWorker

    pids: list[int] = []
    calls = [0]
    start, run = PlanWorker.__init__, PlanWorker.run

    def recording(self: PlanWorker, *args: Any) -> None:
        start(self, *args)
        pids.append(self.pid)

    def killing(self: PlanWorker, *args: Any) -> Any:
        calls[0] += 1
        if calls[0] == kill_at:
            os.kill(self.pid, signal.SIGKILL)
        return run(self, *args)

    PlanWorker.__init__, PlanWorker.run = recording, killing
    losses, error = None, None
    try:
        losses = train_on_pool_rank(rank, group, cfg, stop_after=stop_after)
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    finally:
        PlanWorker.__init__, PlanWorker.run = start, run
    return losses, pids, [pid for pid in pids if running(pid)], error


def job(dump: Path, worker: bool, **sections: Any) -> dict:
    return tiny_job(dump, training={"steps": 6}, parallelism=CP2, data={"prefetch": 2},
                    flashcp={"plan_worker": worker}, **sections)  # fmt: skip


def test_cp2_with_the_plan_worker_trains_resumes_and_ends_like_without(tmp_path, gloo_pool) -> None:
    saving = {"checkpoint": {"enable": True, "interval": 3}}
    pool = gloo_pool(2)
    (thread, pids, _, error), _ = pool.run(train_watching_workers, (job(tmp_path / "thread", False),))
    assert error is None and pids == [] and sorted(thread) == [1, 2, 3, 4, 5, 6]

    first = pool.run(train_watching_workers, (job(tmp_path / "worker", True, **saving), 3))
    rest = pool.run(train_watching_workers, (job(tmp_path / "worker", True, **saving),))
    for losses, pids, alive, error in first + rest:
        assert error is None and len(pids) == 1 and alive == []  # one worker per rank and run, ended
    # The same windows, plans and dispatches: bit for bit the same losses, across the resume too.
    assert first[0][0] == {s: thread[s] for s in (1, 2, 3)}
    assert rest[0][0] == {s: thread[s] for s in (4, 5, 6)}
    print(f"CP 2 losses, loader thread: {thread}\nCP 2 losses, plan worker (3 + resumed 3): "
          f"{first[0][0] | rest[0][0]}")  # fmt: skip

    failed = pool.run(train_watching_workers, (job(tmp_path / "killed", True), None, 3))
    for losses, pids, alive, error in failed:
        assert losses is None and alive == []
        assert error is not None and "\n" not in error
        expected = f"WorkerError: the planning worker process (pid {pids[0]}) exited with code -9"
        assert error.startswith(expected)
