"""What the loader's thread costs a busy training thread: the GIL it holds while it plans and dispatches.

    python benchmarks/loader_stall.py [--context 1048576] [--cp 16] [--steps 200] [--ops 4000]
                                      [--worker] [--json PATH]

The training thread runs a fake step that holds the GIL the way a step's host side does: a
Python loop launching `--ops` tiny torch ops (kernel launches, on a CPU). A background thread does
what the window loader's thread does for every window besides reading it: plan it (flashcp, CP
N, wlbllm lengths, windows of C tokens packed beforehand) and build CP rank 0's compact dispatch.
Steps alternate in blocks of 10 between idle (the thread waits) and busy (the thread plans and
dispatches one window while the step runs, as in every training step), each followed by the same
150 ms pause (so that neither kind of step starts from a longer sleep than the other), and each
step's wall time is measured (perf_counter). The training thread runs on CPU 0 and the loader's
work (its thread, or the worker process) on CPU 1, so that they compete for the GIL only, not for
a core (as on a training node, where the loader has cores of its own). The stall is busy minus
idle, at the median and at p99.

With `--worker` the thread hands the window to `flashcp.data.plan_worker.PlanWorker` (a worker
process, as `WindowLoader.dispatch_with(..., worker=True)` does) and waits without the GIL, and a
third kind of block joins the rotation: control, the same work in the worker answered with one
integer (the dispatch's row count) instead of the plan and dispatch. Its stall is the worker's
load on the machine (memory, caches, the hypervisor), not the GIL; busy minus control is what
receiving the result costs the training thread. Measured on a shared machine: other processes
add noise to every kind of step alike. Reading and packing (the loader's other work) are not
part of this measurement.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

from flashcp import plan_shards
from flashcp.data import length_sampler, pack_windows
from flashcp.data.plan_worker import PlanWorker
from flashcp.dispatch import build_dispatch

HERE = Path(__file__).resolve().parent
BLOCK = 10
GAP = 0.15  # seconds between steps


def fake_step(ops: int, x: torch.Tensor) -> float:
    """Wall ms of `ops` tiny torch ops launched from a Python loop."""
    t0 = time.perf_counter()
    for _ in range(ops):
        x.add_(1.0)
    return (time.perf_counter() - t0) * 1e3


def dispatched_rows(dispatcher: functools.partial, plan: object) -> int:
    """The control's dispatcher: the same dispatch, answered with its row count only."""
    return len(dispatcher(plan).token_index)


def pin(cpu: int, *_: object) -> None:
    """Run the calling thread (or the worker process, as its 'planner') on `cpu` only."""
    os.sched_setaffinity(0, {cpu})


def measure(context: int, cp: int, steps: int, ops: int, worker: bool) -> dict:
    windows = pack_windows(length_sampler("wlbllm", 0), context, 20)
    planner = functools.partial(plan_shards, cp_size=cp, strategy="flashcp")
    dispatcher = functools.partial(build_dispatch, rank=0, comm="compact")
    kinds = ("idle", "busy", "control") if worker else ("idle", "busy")
    pool = None
    if worker:  # the worker imports this script as loader_stall, the control's dispatcher by reference
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
        import loader_stall

        counting = functools.partial(loader_stall.dispatched_rows, dispatcher)
        pool = PlanWorker()
    pin(0)  # the training thread on CPU 0, the loader's work on CPU 1: they share the GIL, not a core
    if pool is not None:
        # The worker on CPU 1, through a function it can import (this script's `pin` is its __main__'s).
        pool.run(functools.partial(os.sched_setaffinity, 0), None, [1])
    go, done, stop, work_ms = threading.Event(), threading.Event(), threading.Event(), []
    kind = "idle"

    def producer() -> None:  # the loader thread's plan + dispatch of one window per step
        pin(1)
        i = 0
        while go.wait() and not stop.is_set():
            go.clear()
            t0 = time.perf_counter()
            lens = windows[i % len(windows)]
            if pool is not None:
                pool.run(planner, counting if kind == "control" else dispatcher, lens)
            else:
                dispatcher(planner(lens))
            work_ms.append((time.perf_counter() - t0) * 1e3)
            i += 1
            done.set()

    thread = threading.Thread(target=producer, daemon=True)
    thread.start()
    x = torch.zeros(16)
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for block in range(len(kinds) * (steps // BLOCK + 1)):
        kind = kinds[block % len(kinds)]
        for _ in range(BLOCK):
            if kind != "idle":
                done.clear()
                go.set()
            ms = fake_step(ops, x)
            if kind != "idle":
                done.wait()
            time.sleep(GAP)  # the same pause after every kind of step, longer than the loader's work
            if block >= len(kinds):  # the first round warms up (the worker, torch's first calls)
                times[kind].append(ms)
    stop.set()
    go.set()
    thread.join()
    if pool is not None:
        pool.close()
    pct = lambda a, q: float(np.percentile(a, q))  # noqa: E731
    ms = {k: {"p50": pct(t, 50), "p99": pct(t, 99)} for k, t in times.items()}
    less = lambda a, b: {q: ms[a][q] - ms[b][q] for q in ("p50", "p99")}  # noqa: E731
    return {
        "context": context, "cp": cp, "steps_each": len(times["idle"]), "ops_per_step": ops, "worker": worker,
        **{f"{k}_ms": v for k, v in ms.items()}, "stall_ms": less("busy", "idle"),
        **({"control_stall_ms": less("control", "idle"), "receive_ms": less("busy", "control")} if worker else {}),
        "plan_dispatch_ms_p50": pct(work_ms, 50),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=1 << 20)
    p.add_argument("--cp", type=int, default=16)
    p.add_argument("--steps", type=int, default=200, help="steps of each kind")
    p.add_argument("--ops", type=int, default=4000, help="tiny torch ops per fake step")
    p.add_argument("--worker", action="store_true", help="plan and dispatch in a worker process")
    p.add_argument("--json", type=Path, help="append the result as one JSON line to this file")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    r = measure(args.context, args.cp, args.steps, args.ops, args.worker)
    kinds = ("idle", "busy", "control") if args.worker else ("idle", "busy")
    steps = ", ".join(f"{k} p50 {r[k + '_ms']['p50']:.2f} p99 {r[k + '_ms']['p99']:.2f}" for k in kinds)
    print(f"C={r['context']} CP={r['cp']} worker={r['worker']}: step ms {steps}; stall p50 "
          f"{r['stall_ms']['p50']:.2f} ms, p99 {r['stall_ms']['p99']:.2f} ms (plan + dispatch per window, "
          f"wall: {r['plan_dispatch_ms_p50']:.1f} ms)")  # fmt: skip
    if args.worker:
        print(f"control (reply of one integer) stall p50 {r['control_stall_ms']['p50']:.2f} ms, p99 "
              f"{r['control_stall_ms']['p99']:.2f} ms; receiving the plan and dispatch (busy - control) p50 "
              f"{r['receive_ms']['p50']:.2f} ms, p99 {r['receive_ms']['p99']:.2f} ms")  # fmt: skip
    if args.json:
        with args.json.open("a") as f:
            f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
