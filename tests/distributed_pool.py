"""A pool of gloo processes started once and reused by many multi-process test cases.

Spawning processes and importing torch costs seconds, and the first trainer built in a worker
imports TorchTitan (~10 s of CPU per rank); a collective on loopback gloo takes well under a
millisecond. So tests take a shared pool from the `gloo_pool` fixture (conftest.py) and send it
batches of cases:

    def test_something(gloo_pool):
        pool = gloo_pool(4, sizes=(2, 4))
        results = pool.run(fn, args, size=2)   # fn(rank, group, *args) on ranks 0..size-1

`fn` must be importable by the workers (a module-level function of a test module). Ranks outside
`size` sit the call out; the process group of the first `size` ranks is created at start-up for
every size in `sizes`, since creating groups is itself a collective over all ranks. So a call that
builds a mesh or a group (EP's ParallelDims) must run on all of the pool's ranks: one that created
groups on some ranks only fails, naming itself, since the pool's next group would hang.

`gloo_pool` (`shared` below) keeps one pool per world size in each test process, from one test
file to the next. A worker restores its environment variables and the garbage collector's state
after every call; a pool whose call failed (which may have left a rank waiting in a collective)
is never handed out again. A pool of one's own: `with DistributedPool(world_size=2) as pool: ...`.
"""

from __future__ import annotations

import gc
import os
import queue
import socket
import time
import traceback
from datetime import timedelta
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _group_count() -> int:
    """How many process groups this rank has created: torch names each new group by this count, so a
    rank whose count differs from the others' would wait forever for its peers in the next new group."""
    return dist.distributed_c10d._world.group_count


def _worker(rank: int, world_size: int, port: int, sizes: Sequence[int], tasks, results) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    # A collective timeout turns a rank that died mid-collective into an error,
    # not a hang; it only bounds hangs, so it is generous for a loaded machine (a 4-rank float64 MoE oracle
    # call took over 300 s in a loaded CI run and 70 s alone). It is shorter than the pool's own limit,
    # so that a rank stuck in a collective comes back as gloo's error naming the collective.
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
        timeout=timedelta(seconds=900),
    )
    groups = {n: dist.new_group(list(range(n))) if n < world_size else dist.group.WORLD for n in sizes}
    results.put((rank, "ready", None, _group_count()))
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, size = task
        environ, collecting = dict(os.environ), gc.isenabled()
        try:
            out = fn(rank, groups[size], *args) if rank < size else None
            results.put((rank, "ok", out, _group_count()))
        except Exception:  # the parent re-raises it with the worker's traceback
            results.put((rank, "error", traceback.format_exc(), _group_count()))
        finally:  # what one call set (RANK, WORLD_SIZE, ...; a trainer turns off gc) is not seen by the next
            os.environ.clear()
            os.environ.update(environ)
            gc.enable() if collecting else gc.disable()
    dist.destroy_process_group()


class DistributedPool:
    """`world_size` spawned gloo workers; `run` executes one function on the first `size` ranks."""

    def __init__(self, world_size: int, sizes: Sequence[int] | None = None, timeout: float = 1200.0):
        self.world_size, self.timeout = world_size, timeout
        self.failed = False  # a call raised: some rank may still be inside a collective
        self.groups = 0  # process groups each rank has created (all ranks agree, or the pool failed)
        self.sizes = tuple(sorted(set(sizes or (world_size,))))
        if max(self.sizes) > world_size:
            raise ValueError(f"group sizes {self.sizes} exceed world size {world_size}")
        ctx = mp.get_context("spawn")
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        port = _free_port()
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, port, self.sizes, self._tasks[r], self._results),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self._collect("start-up")

    def _next_result(self, what: str) -> tuple[int, str, Any, int]:
        """The next worker reply; a worker that died or a call past `timeout` raises."""
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                return self._results.get(timeout=1.0)
            except queue.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(self._procs) if not p.is_alive()]
                if dead:
                    self.failed = True
                    raise RuntimeError(f"{what}: worker(s) exited (rank, exit code): {dead}") from None
                if time.monotonic() > deadline:
                    self.failed = True
                    raise TimeoutError(f"{what}: no reply within {self.timeout} s") from None

    def _collect(self, what: str) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        counts = [0] * self.world_size
        errors = []
        for _ in range(self.world_size):
            rank, status, value, counts[rank] = self._next_result(what)
            if status == "error":
                errors.append(f"rank {rank}:\n{value}")
            out[rank] = value
        if errors:
            self.failed = True
            raise RuntimeError(f"{what} failed on {len(errors)} worker(s):\n" + "\n".join(errors))
        if len(set(counts)) > 1:  # the next group created on all ranks would hang: this pool is done
            self.failed = True
            raise RuntimeError(f"{what} created process groups on some ranks only (each rank's count: {counts}); "
                               "a call that builds a mesh or group must run on all of a pool's ranks")
        self.groups = counts[0]
        return out

    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (), size: int | None = None) -> list[Any]:
        """Results of `fn(rank, group, *args)` for ranks 0..size-1 (default: all ranks)."""
        size = self.world_size if size is None else size
        if size not in self.sizes:
            raise ValueError(f"no process group of size {size}; the pool was started with {self.sizes}")
        for q in self._tasks:
            q.put((fn, tuple(args), size))
        return self._collect(getattr(fn, "__name__", "task"))[:size]

    def close(self) -> None:
        for q in self._tasks:
            q.put(None)
        for p in self._procs:
            p.join(timeout=5 if self.failed else 30)  # a failed pool's ranks may wait in a collective
            if p.is_alive():
                p.kill()
                p.join()

    def __enter__(self) -> DistributedPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_SHARED: dict[int, DistributedPool] = {}  # world size -> the pool this test process shares
# A gloo group keeps its threads polling while it lives (torch 2.13: ~0.12 % of a core per group per
# rank, idle), and a trainer's meshes leave a few groups in a worker with every run: a pool past this
# many is replaced, or a long session's idle pools spend whole cores (measured: 137 groups a rank,
# 16 % of a core each, on ranks waiting for their next call).
MAX_GROUPS = 64


def shared(world_size: int, sizes: Sequence[int] | None = None) -> DistributedPool:
    """This process's pool of `world_size` ranks with a group for each of `sizes`, started on first
    use and reused by later tests (of any file); a failed pool, or one lacking a group size, is
    replaced, and so is one whose ranks hold more than `MAX_GROUPS` process groups. At most two pools
    are kept (the least recently used other one is closed)."""
    wanted = set(sizes or (world_size,)) | {world_size}
    pool = _SHARED.pop(world_size, None)
    if pool is not None and (pool.failed or pool.groups > MAX_GROUPS or not wanted <= set(pool.sizes)):
        wanted |= set(pool.sizes) if not pool.failed else set()
        pool.close()
        pool = None
    if pool is None:
        while len(_SHARED) >= 2:
            _SHARED.pop(next(iter(_SHARED))).close()
        pool = DistributedPool(world_size, sizes=sorted(wanted))
    _SHARED[world_size] = pool  # most recently used last
    return pool


def close_shared() -> None:
    while _SHARED:
        _SHARED.popitem()[1].close()
