"""Host work per step at CP 8-64 and windows of 128K-4M tokens: planning and each rank's dispatch.

    python benchmarks/planner_scale.py                      # ~10 minutes on a shared 2-core VM
    python benchmarks/planner_scale.py --quick              # smoke run, results to a temp dir
    python benchmarks/planner_scale.py --label before --out DIR   # another checkout's figures,
                                                            # run with PYTHONPATH=that checkout
    python benchmarks/planner_scale.py --against f5e0f2d    # also plan with that commit's
                                                            # flashcp/plan, interleaved
    python benchmarks/planner_scale.py --collector          # garbage collector running

For wlbllm and pile lengths, C in {128K, 512K, 1M, 2M, 4M} and N in {8, 16, 32, 64}: W windows
packed by `flashcp.data.pack_windows` (seed 0), each planned by `plan_shards` (flashcp, target
1.05; normalisation and validation included); a window's plan time is the least of R repeats of
`time.process_time` (CPU time of this one thread, so other processes on a shared machine count
little; the least of repeats drops what they still add), with the cyclic garbage collector
paused and the imports frozen, as the planning worker runs it (`--collector`: running, as a
process that does neither; its collections scan torch's ~170K objects). Reported: plan ms p50 / p99 / max per
(dataset, C, N), the plans' mean imbalance and compact/needed comm ratios, and `build_dispatch`
ms for one rank (rank 0, torch on one thread) in each comm mode on the first D windows (p50).
Everything is measured; nothing is modelled.

Runs at different times of a shared machine differ by its load (recorded: the 1-minute load
average at the start and end). `--against COMMIT` plans every window with that commit's
`flashcp/plan` too (a copy imported as another package), alternating the two repeat by repeat,
so both see the same load: their p50 / p99 and how many plans are identical.

Writes benchmarks/results/planner_scale_<label>.json, and planner_scale.md with the `after` run
beside `before` when both JSON files are there.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import gc
import importlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from flashcp import plan_shards
from flashcp.data import length_sampler, pack_windows
from flashcp.data.balance import gc_paused
from flashcp.dispatch import build_dispatch

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
DATASETS = ("wlbllm", "pile")
CONTEXTS = (131072, 524288, 1 << 20, 2 << 20, 4 << 20)
CP_SIZES = (8, 16, 32, 64)
COMMS = ("compact", "full", "needed")
TARGET = 1.05


def cpu_ms(fn, repeats: int, collector: bool = False) -> tuple[float, object]:
    """The least CPU milliseconds of `repeats` calls of fn, and its result; the cyclic garbage
    collector paused during each call as in the planning worker, unless `collector`."""
    best, out = float("inf"), None
    for _ in range(repeats):
        with contextlib.nullcontext() if collector else gc_paused():
            t0 = time.process_time()
            out = fn()
            best = min(best, (time.process_time() - t0) * 1e3)
    return best, out


def reference_planner(commit: str):
    """`plan_shards` of `commit`'s flashcp/plan, imported beside this checkout's as `flashcp_ref_plan`."""
    repo = RESULTS.parents[1]
    try:
        tar = subprocess.run(["git", "archive", commit, "flashcp/plan"], cwd=repo, capture_output=True, check=True)
    except (subprocess.CalledProcessError, OSError):
        sys.exit(f"--against {commit}: not a commit of the git repository at {repo} with flashcp/plan")
    root = Path(tempfile.mkdtemp(prefix="planner_ref_"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    tarfile.open(fileobj=io.BytesIO(tar.stdout)).extractall(root, filter="data")
    package = (root / "flashcp" / "plan").rename(root / "flashcp_ref_plan")
    for f in package.glob("*.py"):
        f.write_text(f.read_text().replace("flashcp.plan", "flashcp_ref_plan"))
    sys.path.insert(0, str(root))
    return importlib.import_module("flashcp_ref_plan").plan_shards


def percentiles(times: list[float]) -> dict:
    t = np.asarray(times)
    return {"p50": float(np.percentile(t, 50)), "p99": float(np.percentile(t, 99)), "max": float(t.max())}


def run_config(
    windows: list[list[int]], n: int, repeats: int, dispatch_windows: int, reference=None, collector: bool = False
) -> dict:
    times, ref_times, same, imbalance, compact, needed = [], [], 0, [], [], []
    disp: dict[str, list[float]] = {c: [] for c in COMMS}
    for i, lens in enumerate(windows):
        if reference is None:
            ms, plan = cpu_ms(lambda: plan_shards(lens, n, "flashcp", TARGET), repeats, collector)
        else:  # alternate the two planners repeat by repeat
            ms = ref_ms = float("inf")
            for _ in range(repeats):
                t, ref = cpu_ms(lambda: reference(lens, n, "flashcp", TARGET), 1, collector)
                ref_ms = min(ref_ms, t)
                t, plan = cpu_ms(lambda: plan_shards(lens, n, "flashcp", TARGET), 1, collector)
                ms = min(ms, t)
            ref_times.append(ref_ms)
            same += ref.ranks == plan.ranks
        times.append(ms)
        m = plan.metrics()
        imbalance.append(m["imbalance"])
        compact.append(m["comm_compact_ratio"])
        needed.append(m["comm_needed_ratio"])
        if i < dispatch_windows:
            for comm in COMMS:
                disp[comm].append(cpu_ms(lambda: build_dispatch(plan, 0, comm), 1, collector)[0])
    reference_figures = {"ref_plan_ms": percentiles(ref_times), "same_plans": same} if ref_times else {}
    return {
        "windows": len(windows), "docs_per_window": float(np.mean([len(w) for w in windows])),
        "plan_ms": percentiles(times), **reference_figures,
        "imbalance_mean": float(np.mean(imbalance)), "imbalance_max": float(np.max(imbalance)),
        "comm_compact_ratio": float(np.mean(compact)), "comm_needed_ratio": float(np.mean(needed)),
        "dispatch_ms_p50": {c: float(np.median(v)) for c, v in disp.items()},
        "dispatch_windows": len(disp["compact"]),
    }  # fmt: skip


def markdown(runs: dict[str, dict]) -> str:
    labels = [x for x in ("before", "after") if x in runs] or list(runs)
    cfg = runs[labels[-1]]["config"]
    commits = ", ".join(f"{x}: {runs[x]['commit']}" for x in labels)
    lines = [
        "# Planner and dispatch at scale",
        "",
        f"`python benchmarks/planner_scale.py` ({commits}): "
        f"{cfg['windows']} windows per (dataset, C, N), seed 0, target {TARGET}; plan ms = CPU time of one "
        f"thread, least of {cfg['repeats']} repeats per window, through `plan_shards` (validation included); "
        f"dispatch ms = `build_dispatch` for rank 0 (torch on one thread), median of the first "
        f"{cfg['dispatch_windows']} windows. Measured on a shared 2-core VM; 1-minute load average at "
        "start / end: " + ", ".join(f"{x} {_load(runs[x])}" for x in labels) + ".",
        "",
        "| dataset | C | N | docs | " + " | ".join(f"plan p50 / p99 / max ({x})" for x in labels)
        + " | " + " | ".join(f"dispatch compact / full / needed ({x})" for x in labels)
        + " | imbalance mean (" + " / ".join(labels) + ") | compact comm (" + " / ".join(labels) + ") |",
        "|---|---|---|---|" + "---|" * (2 * len(labels) + 2),
    ]
    keys = [(r["dataset"], r["context"], r["cp"]) for r in runs[labels[-1]]["rows"]]
    index = {x: {(r["dataset"], r["context"], r["cp"]): r for r in runs[x]["rows"]} for x in labels}
    for key in keys:
        rows = [index[x].get(key) for x in labels]
        if any(r is None for r in rows):
            continue
        plan = [f"{r['plan_ms']['p50']:.1f} / {r['plan_ms']['p99']:.1f} / {r['plan_ms']['max']:.1f}" for r in rows]
        disp = [" / ".join(f"{r['dispatch_ms_p50'][c]:.1f}" for c in COMMS) for r in rows]
        lines.append(
            f"| {key[0]} | {key[1] // 1024}K | {key[2]} | {rows[-1]['docs_per_window']:.0f} | " + " | ".join(plan)
            + " | " + " | ".join(disp) + " | " + " / ".join(f"{r['imbalance_mean']:.4f}" for r in rows)
            + " | " + " / ".join(f"{r['comm_compact_ratio']:.4f}" for r in rows) + " |"
        )
    last = runs[labels[-1]]
    if "against" in last["config"]:
        lines += [
            "",
            f"Interleaved in the `{labels[-1]}` run: every window also planned by {last['config']['against']}'s "
            "`flashcp/plan`, alternating repeat by repeat (the same load for both).",
            "",
            f"| dataset | C | N | plan p50 / p99 / max ({last['config']['against']}) | plan p50 / p99 / max "
            f"({last['commit']}) | identical plans |",
            "|---|---|---|---|---|---|",
        ]
        for r in last["rows"]:
            ms = [" / ".join(f"{r[k][q]:.1f}" for q in ("p50", "p99", "max")) for k in ("ref_plan_ms", "plan_ms")]
            lines.append(f"| {r['dataset']} | {r['context'] // 1024}K | {r['cp']} | {ms[0]} | {ms[1]} | "
                         f"{r['same_plans']} / {r['windows']} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def _load(run: dict) -> str:
    load = run["config"].get("load_average")
    return " / ".join(f"{x:.1f}" for x in load) if load else "not recorded"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="3 windows, C <= 512K")
    p.add_argument("--windows", type=int, default=100, help="windows per configuration")
    p.add_argument("--repeats", type=int, default=2, help="plans per window (the least CPU time is kept)")
    p.add_argument("--dispatch-windows", type=int, default=5, help="windows whose dispatch is timed")
    p.add_argument("--label", default="after", help="name of this run in the results (before / after)")
    p.add_argument("--commit", default="working tree", help="what was measured, for the table's header")
    p.add_argument("--against", metavar="COMMIT", help="also plan with this commit's flashcp/plan, interleaved")
    p.add_argument("--out", type=Path, help="results directory (default benchmarks/results; a temp dir with --quick)")
    p.add_argument("--collector", action="store_true",
                   help="time with the cyclic garbage collector running (the worker pauses it)")  # fmt: skip
    args = p.parse_args(argv)
    contexts = CONTEXTS
    if args.quick:
        args.windows, args.repeats, args.dispatch_windows, contexts = 3, 1, 1, CONTEXTS[:2]
    out = args.out or (Path(tempfile.mkdtemp(prefix="planner_scale_")) if args.quick else RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    reference = reference_planner(args.against) if args.against else None
    if not args.collector:
        gc.freeze()  # as the planning worker after its imports
    load_start = os.getloadavg()[0]
    rows = []
    for dataset in DATASETS:
        for context in contexts:
            windows = pack_windows(length_sampler(dataset, 0), context, args.windows)
            for n in CP_SIZES:
                row = {"dataset": dataset, "context": context, "cp": n,
                       **run_config(windows, n, args.repeats, args.dispatch_windows, reference, args.collector)}  # fmt: skip
                rows.append(row)
                pm, d = row["plan_ms"], row["dispatch_ms_p50"]
                ref = f" ({args.against}: p50 {row['ref_plan_ms']['p50']:.1f} p99 {row['ref_plan_ms']['p99']:.1f}, " \
                    f"identical plans {row['same_plans']})" if reference else ""  # fmt: skip
                print(f"{dataset} C={context} N={n}: plan ms p50 {pm['p50']:.1f} p99 {pm['p99']:.1f} max "
                      f"{pm['max']:.1f}{ref}; dispatch ms " + " ".join(f"{c} {d[c]:.1f}" for c in COMMS), flush=True)
    config = {"windows": args.windows, "repeats": args.repeats, "dispatch_windows": args.dispatch_windows,
              "collector": "running" if args.collector else "paused, imports frozen",
              "contexts": list(contexts), "cp": list(CP_SIZES), "target": TARGET,
              "load_average": [load_start, os.getloadavg()[0]]}  # fmt: skip
    if args.against:
        config["against"] = args.against
    result = {"label": args.label, "commit": args.commit, "config": config, "rows": rows}
    (out / f"planner_scale_{args.label}.json").write_text(json.dumps(result, indent=1))
    runs = {x: json.loads(f.read_text()) for x in ("before", "after") if (f := out / f"planner_scale_{x}.json").exists()}
    (out / "planner_scale.md").write_text(markdown(runs))
    print(f"wrote {out}/planner_scale_{args.label}.json and planner_scale.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
