"""Loader throughput per rank as data parallelism grows, and the main thread's share of it.

    python benchmarks/loader.py --dp K --context C [--source DIR] [--cp N] [--windows W]
                                [--balance off|mesh|mesh-cut] [--step-ms S] [--json]

One rank (DP rank K // 2) of a DP = K job pulls W windows of C tokens from the window loader with
prefetching off, so all loader work is in the caller and timed: `tokens_per_s_per_rank` is the
tokens this rank receives per second of reading, tokenising and packing (`load_ms`; planning and
the dispatch are reported apart as `plan_ms`). With a token store (`--source DIR`, or, without
--source, the shipped corpus prepared into a temporary store) a rank reads only its own windows, so
the figure should hardly depend on K. `main_thread_ms`: with prefetching on and the dispatch of CP
rank 0 of N built in the loader's thread, what `next()` costs the training loop's main thread
while a step of S ms (default 50) runs between calls (p50 / p99); the loader's thread keeps up
when its work per window is below S. `--balance` balances every step as the trainer
does for `[data] balance` (Llama 3 8B's cost, one micro step): each rank then also packs the
lengths of every window of the step and balances them, which `load_ms` includes: work that grows
with K, unlike the reading.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from flashcp.data.balance import WindowCost
from flashcp.dispatch import build_dispatch
from flashcp.data.prepare import prepare
from flashcp.data.store import TokenStore
from flashcp.data.loader import build_loader
from flashcp.data.sources import DataConfig

TARGETS = {mode: DataConfig(balance=mode).balance_args() for mode in ("deferral", "deferral-cut", "mesh", "mesh-cut")}


def loader_for(source: str, dp: int, context: int, cp: int, balance: str, prefetch: int):
    loader = build_loader(DataConfig(source=source, prefetch=prefetch), context, dp // 2, dp, cp,
                          planner_kwargs={"strategy": "flashcp"})  # fmt: skip
    if balance != "off":
        loader.balance_with(1, WindowCost.llama(8.03e9, 4096, 32, cp), **TARGETS[balance])
    return loader


def throughput(source: str, dp: int, context: int, cp: int, n: int, balance: str) -> dict[str, float]:
    loader = loader_for(source, dp, context, cp, balance, prefetch=0)
    next(loader)  # opens the source
    batches = [next(loader) for _ in range(n)]
    load_s = sum(b["load_ms"] for b in batches) / 1e3
    return {"tokens_per_s_per_rank": n * context / load_s, "load_ms": 1e3 * load_s / n,
            "plan_ms": float(np.mean([b["plan_ms"] for b in batches]))}  # fmt: skip


def main_thread(source: str, dp: int, context: int, cp: int, n: int, balance: str,
                step_ms: float) -> dict[str, float]:  # fmt: skip
    loader = loader_for(source, dp, context, cp, balance, prefetch=2)
    loader.dispatch_with(lambda plan: build_dispatch(plan, 0, "compact"))
    waits = []
    with loader:
        next(loader)
        for _ in range(n):
            time.sleep(step_ms / 1e3)  # the training step the loader overlaps with
            waits.append(next(loader)["wait_ms"])
    return {"p50": float(np.percentile(waits, 50)), "p99": float(np.percentile(waits, 99))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dp", type=int, required=True)
    parser.add_argument("--context", type=int, required=True)
    parser.add_argument("--source", help="a token store or any [data] source (default: the shipped corpus as a store)")
    parser.add_argument("--cp", type=int, default=8)
    parser.add_argument("--windows", type=int, default=10)
    parser.add_argument("--step-ms", type=float, default=50.0, help="the training step simulated between next() calls")
    parser.add_argument("--balance", choices=("off", *TARGETS), default="off")
    parser.add_argument("--no-verify", action="store_true",
                        help="read a token store through its memory map, unchecked (to measure what the checks cost)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # as the launcher does: 2 threads on a loaded machine slowed a dispatch 10-30x
    if args.no_verify:  # the training path reads through TokenStore.read: a copy, its 4 KiB blocks checked
        TokenStore.read = TokenStore.document
    if min(args.dp, args.context, args.cp, args.windows) < 1 or args.context % args.cp or args.step_ms < 0:
        parser.error("--dp, --context, --cp, --windows must be >= 1, --context divisible by --cp, --step-ms >= 0")
    with tempfile.TemporaryDirectory() as tmp:
        source = args.source or str(prepare("default", "default", Path(tmp) / "store", progress=False))
        result = {
            "source": args.source or "shipped corpus, prepared into a temporary token store",
            "dp": args.dp, "context": args.context, "cp": args.cp, "windows": args.windows, "balance": args.balance,
            "verify": not args.no_verify,
            "step_ms": args.step_ms,
            **throughput(source, args.dp, args.context, args.cp, args.windows, args.balance),
            "main_thread_ms": main_thread(source, args.dp, args.context, args.cp, args.windows, args.balance,
                                          args.step_ms),
        }  # fmt: skip
    if args.json:
        print(json.dumps(result))
    else:
        print(f"DP={args.dp} C={args.context}: {result['tokens_per_s_per_rank']:,.0f} tokens/s per rank "
              f"({result['load_ms']:.1f} ms per window to read, pack and balance ({args.balance}), {result['plan_ms']:.1f} ms to plan and "
              f"dispatch); main thread per next() between {args.step_ms:g} ms steps: p50 {result['main_thread_ms']['p50']:.3f} ms, "
              f"p99 {result['main_thread_ms']['p99']:.3f} ms")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
