"""Peak memory and CPU time per rank of the reference (CPU) attention kernel under a CP plan.

    python benchmarks/cpu_kernel.py                          # 16K and 32K windows, CP 1 and 4
    python benchmarks/cpu_kernel.py --source /tmp/old       # the same with an older checkout's kernel

For each window (one document of C tokens, and the first packed Pile window of C tokens), CP size
N and rank, the rank's local varlen problem is built from the FlashCP plan's dispatch (its shards
as queries, document prefix + shard as keys) and run as a layer stack would: `--layers` attention
calls forward (each kept for the backward), then one backward, at the tiny debug model's head
counts (train_configs/debug_cpu.toml: 4 query heads, 2 KV heads, head dim 16), float32, one
thread. Memory: each rank in a fresh process, its peak resident memory (`ru_maxrss`) above its
resident memory just before the first call. Time: every rank's problem in one process, after a
first run of each (first touches of memory), then `--repeats` rounds in which the ranks take
turns, each forward + backward timed with `process_time`; per rank the least of its runs (what
other processes on a shared machine add least) and the median. A run's time moves by up to a
fifth on this shared VM, in fresh processes as much as in one. The per-rank spread max / min is
printed beside the plan's imbalance (max / mean of attended pairs, which is modelled: the
planner's count, not a timing).
The kernel comes from `--source` (default: this checkout), so an export of an older commit
(`git archive <commit> flashcp | tar -x -C DIR`) gives the "before" figures. Results go to
benchmarks/results/cpu_kernel.json (or `--out`).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
TINY = {"heads": 4, "kv_heads": 2, "head_dim": 16}  # train_configs/debug_cpu.toml: dim 64, 4 heads, 2 KV


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def make_step(q_lens: list[int], k_lens: list[int], layers: int, generator) -> Callable[[], float]:
    """A rank's problem with its inputs made: calling it runs `layers` forwards and their backward
    and returns the CPU time that took."""
    import torch

    from flashcp.attention import varlen_attention

    h, kv, d = TINY["heads"], TINY["kv_heads"], TINY["head_dim"]
    cu_q = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0, *k_lens]).cumsum(0).to(torch.int32)
    shapes = ((q_lens, h), (k_lens, kv), (k_lens, kv))
    inputs = [[torch.randn(sum(n), heads, d, generator=generator).requires_grad_() for n, heads in shapes]
              for _ in range(layers)]  # fmt: skip
    weight = torch.randn(sum(q_lens), h, d, generator=generator)
    longest = max(q_lens), max(k_lens)

    def step() -> float:
        t0 = time.process_time()
        outs = [varlen_attention(q, k, v, cu_q, cu_k, *longest, backend="reference") for q, k, v in inputs]
        torch.autograd.backward([o * weight for o in outs], [torch.ones_like(weight)] * layers)
        return time.process_time() - t0

    return step


def run_rank(q_lens: list[int], k_lens: list[int], layers: int, threads: int) -> dict:
    """Forward of `layers` calls then their backward, twice on this process: the first run's peak
    memory, and the CPU time of both."""
    import torch

    torch.set_num_threads(threads)
    step = make_step(q_lens, k_lens, layers, torch.Generator().manual_seed(0))
    base = _rss_mib()
    cold = step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return {"base_rss_mib": base, "peak_rss_mib": peak, "peak_above_base_mib": peak - base,
            "cold_cpu_s": cold, "fwd_bwd_cpu_s": step()}  # fmt: skip


def time_ranks(problems: list[list[list[int]]], layers: int, threads: int, repeats: int) -> dict:
    """Every rank's (q_lens, k_lens) in this process: a first run each, then `repeats` rounds of
    one run per rank in turn; the CPU time of every run."""
    import torch

    torch.set_num_threads(threads)
    generator = torch.Generator().manual_seed(0)
    steps = [make_step(q_lens, k_lens, layers, generator) for q_lens, k_lens in problems]
    for step in steps:
        step()
    runs: list[list[float]] = [[] for _ in steps]
    for _ in range(repeats):
        for rank, step in enumerate(steps):
            runs[rank].append(step())
    return {"runs": runs}


def in_fresh_process(mode: str, spec: dict, source: Path) -> dict:
    """`run_rank` (mode "--worker") or `time_ranks` ("--timing") in a fresh process, the kernel
    from `source`."""
    command = [sys.executable, __file__, "--source", str(source), mode, json.dumps(spec)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"worker failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def windows(context: int) -> dict[str, list[int]]:
    from flashcp.data import length_sampler, pack_windows

    return {"1 doc": [context], "pile": pack_windows(length_sampler("pile", seed=0), context, 1)[0]}


def measure_plan(doc_lens: list[int], cp: int, args) -> dict:
    """Every rank of the FlashCP plan of one window: peak memory in a fresh process per rank, CPU
    time of all ranks in turns in one process."""
    from flashcp import build_dispatch, plan_shards

    plan = plan_shards(doc_lens, cp, "flashcp")
    problems = []
    for rank in range(cp):
        d = build_dispatch(plan, rank)
        problems.append((d.cu_seqlens_q.diff().tolist(), d.cu_seqlens_k.diff().tolist()))
    memory = [in_fresh_process("--worker", {"q_lens": q, "k_lens": k, "layers": args.layers,
                                            "threads": args.threads}, args.source) for q, k in problems]  # fmt: skip
    spec = {"problems": problems, "layers": args.layers, "threads": args.threads, "repeats": args.repeats}
    runs = in_fresh_process("--timing", spec, args.source)["runs"]
    ranks = [
        {
            "pairs": plan.workloads()[rank],
            "peak_above_base_mib": memory[rank]["peak_above_base_mib"],
            "peak_rss_mib": memory[rank]["peak_rss_mib"],
            "fwd_bwd_cpu_s": min(runs[rank]),
            "fwd_bwd_cpu_s_median": statistics.median(runs[rank]),
            "fwd_bwd_cpu_s_runs": runs[rank],
        }
        for rank in range(cp)
    ]
    least = [r["fwd_bwd_cpu_s"] for r in ranks]
    median = [r["fwd_bwd_cpu_s_median"] for r in ranks]
    return {"cp": cp, "docs": len(doc_lens), "planned_imbalance": plan.metrics()["imbalance"],
            "cpu_spread": max(least) / min(least), "cpu_spread_median": max(median) / min(median),
            "ranks": ranks}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, nargs="+", default=[16384, 32768])
    p.add_argument("--cp", type=int, nargs="+", default=[1, 4])
    p.add_argument("--window", choices=["1 doc", "pile"], nargs="+", default=["1 doc", "pile"])
    p.add_argument("--layers", type=int, default=2,
                   help="attention calls held for the backward (the tiny model has 2)")  # fmt: skip
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5, help="timed runs per rank (after a first one)")
    p.add_argument("--source", type=Path, default=ROOT, help="checkout whose flashcp kernel is measured")
    p.add_argument("--out", type=Path, default=RESULTS / "cpu_kernel.json")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--timing", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker or args.timing:
        sys.path.insert(0, str(args.source))
        run = run_rank if args.worker else time_ranks
        print(json.dumps(run(**json.loads(args.worker or args.timing))))
        return 0
    sys.path.insert(0, str(ROOT))
    print(f"Reference kernel from {args.source}: {TINY['heads']} heads ({TINY['kv_heads']} KV) x "
          f"{TINY['head_dim']}, float32, {args.layers} layers fwd + bwd, {args.threads} thread(s), "
          f"ranks in turns, {args.repeats} runs each; CPU time per rank: the least run.")
    print("Measured: peak RSS above the pre-call RSS, CPU time (process_time) per rank. "
          "Modelled: the plan's imbalance (max / mean attended pairs).")
    print(f"{'window':>7} {'C':>6} {'N':>2} {'docs':>5} {'peak MiB/rank':>14} {'cpu s/rank (min-max)':>21} "
          f"{'spread':>7} {'(median)':>8} {'plan imb':>9}")
    rows = []
    for context in args.context:
        for name, doc_lens in windows(context).items():
            if name not in args.window:
                continue
            for cp in args.cp:
                r = measure_plan(doc_lens, cp, args)
                cpu = [x["fwd_bwd_cpu_s"] for x in r["ranks"]]
                peak = max(x["peak_above_base_mib"] for x in r["ranks"])
                cpu_range = f"{min(cpu):.2f}-{max(cpu):.2f}"
                print(f"{name:>7} {context:>6} {cp:>2} {r['docs']:>5} {peak:>14.0f} {cpu_range:>21} "
                      f"{r['cpu_spread']:>7.3f} {r['cpu_spread_median']:>8.3f} {r['planned_imbalance']:>9.3f}",
                      flush=True)  # fmt: skip
                rows.append({"window": name, "context": context, **r})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    setup = {"source": str(args.source), "layers": args.layers, "threads": args.threads,
             "repeats": args.repeats}  # fmt: skip
    args.out.write_text(json.dumps({**setup, **TINY, "rows": rows}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
