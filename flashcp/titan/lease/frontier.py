"""Part d of the lease: Llama 3 8B's layers at 128K tokens on one rank, at the memory frontier.

One rank of 1M tokens over CP 8 holds 128K tokens; on one GPU the tallest stack of 8B layers that
fits (`jobs.frontier_layers`, at most 4) trains with the full-size embedding and loss, full activation
checkpointing and automatic MLP tiles: plain, with automatic head groups (each attention layer over
groups of KV heads), with the offload, and one layer plain (in that order: a budget cut short loses the
last). The allocator's peaks of the two heights give the measured per-layer and fixed terms (part c
sets the dry run's beside them, and beside every job's peak); everything goes to OUTDIR/frontier.json
as each run ends.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flashcp.titan.lease.jobs import frontier_jobs
from flashcp.titan.lease.results import gpu_memory_gib, Results
from flashcp.titan.lease.train import MIN_RUN_S, time_left, train_and_measure


def terms(peaks: dict[int, float | None]) -> dict[str, float] | None:
    """Per-layer and fixed GiB from the peaks of the lowest and highest stacks: peak = fixed + layers x
    per_layer. None unless two heights have a peak."""
    known = sorted((n, p) for n, p in peaks.items() if p is not None)
    if len(known) < 2:
        return None
    (low, p_low), (high, p_high) = known[0], known[-1]
    per_layer = (p_high - p_low) / (high - low)
    return {"per_layer_gib": per_layer, "fixed_gib": p_low - low * per_layer}


def headline(runs: dict[str, dict[str, Any]], measured: dict[str, float] | None) -> str:
    parts = []
    for name, r in runs.items():
        if r.get("status") != "trained":
            parts.append(f"{name}: {r.get('status')}")
        elif r.get("peak_allocated_gib") is not None:
            parts.append(f"{name}: {r['peak_allocated_gib']:.1f} GiB allocated, {r['step_s']:.2f} s/step")
        else:
            parts.append(f"{name}: trained, peak RSS {r.get('peak_rss_gib', 0):.2f} GiB (no CUDA memory on a CPU)")
    if measured:
        parts.append(f"per layer {measured['per_layer_gib']:.2f} GiB, fixed {measured['fixed_gib']:.1f} GiB (measured)")
    return "; ".join(parts)


def run(out: Path, device: str, quick: bool, deadline: float, run_cap: float) -> int:
    """Part d: train the stacks the budget allows; 1 if one failed."""
    results = Results(out, "frontier", device, quick)
    work = results.work
    gpu_gib = gpu_memory_gib()
    jobs = frontier_jobs(gpu_gib, quick)
    runs: dict[str, dict[str, Any]] = {}
    for job in jobs:
        left = time_left(deadline, run_cap)
        if left < MIN_RUN_S:
            runs[job.name] = {"status": f"skipped: the part's budget is spent ({left:.0f} s left)"}
        else:
            print(f"{job.name}: {' '.join(job.args(work / job.name))}", flush=True)
            runs[job.name] = train_and_measure(job, work, device, left)
        print(f"{job.name}: {runs[job.name]['status']}", flush=True)
        results.save(gpu_gib=gpu_gib, variants=runs)
    plain = {int(n.removeprefix("layers")): r.get("peak_allocated_gib") for n, r in runs.items()
             if n.removeprefix("layers").isdigit()}  # fmt: skip
    measured = terms(plain)
    results.save(measured_terms=measured, headline=headline(runs, measured), done=True)
    return 0 if all(r["status"] == "trained" or r["status"].startswith("skipped") for r in runs.values()) else 1
