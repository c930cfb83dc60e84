"""Planning and dispatching in a worker process, so that the loader's thread does not hold the GIL.

The loader's thread plans each window and builds this rank's dispatch while the training thread
launches kernels. Both are pure Python / small-tensor work that holds the GIL, and on a busy
training thread every switch to the loader's thread and back costs the step time (measured by
`benchmarks/loader_stall.py`). In a worker process the same functions run on their own
interpreter; the loader's thread only waits for the result (without the GIL) and receives the
plan and the dispatch's tensors. The planner and the dispatcher must be picklable (e.g.
`functools.partial(plan_shards, ...)`, `functools.partial(build_dispatch, rank=..., comm=...)`);
the outputs are those of calling them in the thread.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any


def _plan_and_dispatch(
    planner: Callable, dispatcher: Callable | None, doc_lens: Sequence[int]
) -> tuple[Any, Any]:
    plan = planner(doc_lens)
    return plan, dispatcher(plan) if dispatcher is not None else None


def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)  # index building on small tensors: threads only add synchronisation


class PlanWorker:
    """One spawned process (safe next to CUDA and threads) planning windows one at a time."""

    def __init__(self) -> None:
        spawn = multiprocessing.get_context("spawn")
        self._pool = ProcessPoolExecutor(1, mp_context=spawn, initializer=_one_thread)

    def run(self, planner: Callable, dispatcher: Callable | None, doc_lens: Sequence[int]) -> tuple[Any, Any]:
        """(planner(doc_lens), dispatcher(plan)), computed in the worker."""
        return self._pool.submit(_plan_and_dispatch, planner, dispatcher, list(doc_lens)).result()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
