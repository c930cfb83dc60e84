"""Part c of the lease: the dry run's memory against the CUDA allocator's, for every job parts b and d train.

It runs on the CPU beside the GPU parts (the orchestrator hides the GPU from it, so the dry run takes
its CPU path and leaves the GPU to the runs it is compared with): first `dry_run` on each job, one rank,
as `python -m flashcp.titan.dryrun` would (a compiled job as its eager self: the dry run does not model
the compiler), each prediction written to OUTDIR/dryrun.json as it comes; then, once the GPU parts are
over, their measured peaks beside it: `torch.cuda.max_memory_allocated()` and `max_memory_reserved()`
over the run, and their ratios to the prediction (the tracked peak plus modelled Float8 casts), and for
part d's stacks the per-layer and fixed terms, measured and predicted, from two stack heights.
"""

from __future__ import annotations

import time
import traceback
from pathlib import Path
from typing import Any

from flashcp.titan.dryrun.run import dry_run
from flashcp.titan.lease.frontier import terms
from flashcp.titan.lease.jobs import frontier_jobs, Job, train_jobs
from flashcp.titan.lease.results import gpu_memory_gib, read, Results

MEASURED = ("work", "measured")  # the orchestrator's mark: the GPU parts are over


def predict(job: Job, work: Path, gpu_gib: float) -> dict[str, Any]:
    """The dry run of `job` on one rank: tracked peak, modelled casts, by category, the estimate."""
    args = list(job.overrides)
    if "--compile.enable" in args:  # the dry run traces the eager model; the compiler's memory is measured only
        i = args.index("--compile.enable")
        args[i + 1] = "false"
    start = time.monotonic()
    report = dry_run(Job(job.name, job.config, tuple(args)).load(work / job.name), 1, gpu_gib=gpu_gib)
    return {"predicted_gib": report.peak_gib + report.casts_gib, "tracked_gib": report.peak_gib,
            "casts_gib": report.casts_gib, "by_category": report.by_category,
            "estimate_gib": report.estimate_gib["peak"], "host_gib": report.host_gib, "fits": report.fits,
            "seconds": time.monotonic() - start, "eager_model": "--compile.enable" in job.overrides}  # fmt: skip


def compare(pred: dict[str, Any], measured: dict[str, Any]) -> dict[str, Any]:
    """One job's prediction beside what its run measured, and their ratios."""
    if measured.get("status") != "trained":
        return {"measured": f"none: the run's status is {measured.get('status', 'not run')!r}"}
    if "peak_allocated_gib" not in measured:
        return {"measured": measured.get("cuda_memory", "unavailable")}
    out = {"allocated_gib": measured["peak_allocated_gib"], "reserved_gib": measured["peak_reserved_gib"]}
    for key in ("allocated", "reserved"):
        value = measured[f"peak_{key}_gib"]
        out[f"{key}_over_predicted"] = value / pred["predicted_gib"] if value is not None else None
    return out


def frontier_terms(jobs: list[Job], preds: dict[str, Any], runs: dict[str, Any]) -> dict[str, Any]:
    """Part d's stacks without offload: per-layer and fixed terms, predicted and measured (allocated)."""
    plain = {int(j.name.removeprefix("layers")): j.name for j in jobs if j.name.removeprefix("layers").isdigit()}
    predicted = terms({n: preds.get(name, {}).get("predicted_gib") for n, name in plain.items()})
    measured = terms({n: runs.get(name, {}).get("peak_allocated_gib") for n, name in plain.items()})
    if predicted:  # the dry run's own categories, per layer: which term a difference comes from
        low, high = min(plain), max(plain)
        cats = [preds.get(plain[n], {}).get("by_category", {}) for n in (low, high)]
        predicted["per_layer_by_category_gib"] = {k: (cats[1].get(k, 0) - cats[0].get(k, 0)) / (high - low)
                                                  for k in cats[1]}  # fmt: skip
    return {"predicted": predicted, "measured": measured or "unavailable (needs both heights measured on a GPU)"}


def headline(comparisons: dict[str, Any], frontier: dict[str, Any], predictions: dict[str, Any]) -> str:
    ratios = [f"{name} {c['allocated_over_predicted']:.2f}x" for name, c in comparisons.items()
              if isinstance(c.get("allocated_over_predicted"), float)]  # fmt: skip
    parts = [f"{len(predictions)} dry runs"]
    parts.append("allocated / predicted: " + ", ".join(ratios) if ratios else "no GPU measurement to compare")
    p, m = frontier.get("predicted"), frontier.get("measured")
    if isinstance(p, dict):
        parts.append(f"frontier: per layer {p['per_layer_gib']:.3g} GiB + fixed {p['fixed_gib']:.3g} GiB predicted")
    if isinstance(m, dict):
        parts.append(f"measured {m['per_layer_gib']:.3g} + {m['fixed_gib']:.3g} GiB")
    return "; ".join(parts)


def run(out: Path, device: str, quick: bool, deadline: float) -> int:
    """Part c: predict every job, wait for the GPU parts, then compare; 1 if a dry run failed."""
    results = Results(out, "dryrun", device, quick)
    work = results.work
    gpu_gib = gpu_memory_gib()
    trained, stacks = train_jobs(quick), frontier_jobs(gpu_gib, quick)
    predictions: dict[str, Any] = {}
    for part, jobs in (("train", trained), ("frontier", stacks)):
        for job in jobs:
            key = f"{part}/{job.name}"
            if time.time() > deadline:
                predictions[key] = {"error": "not run: the part's budget is spent"}
                continue
            try:
                predictions[key] = predict(job, work, gpu_gib or 80.0)
                print(f"{key}: predicted {predictions[key]['predicted_gib']:.2f} GiB "
                      f"({predictions[key]['seconds']:.0f} s)", flush=True)  # fmt: skip
            except Exception as e:  # one job's dry run failing leaves the others
                predictions[key] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
                print(f"{key}: dry run failed: {type(e).__name__}: {e}", flush=True)
            results.save(gpu_gib=gpu_gib, predictions=predictions)
    # The GPU parts' figures: the orchestrator marks their end (and ends this process if it never comes).
    marker = out.joinpath(*MEASURED)
    while not marker.exists():
        time.sleep(1)
    comparisons = {}
    for part in ("train", "frontier"):
        runs = (read(out, part) or {}).get("variants", {})
        for key, pred in predictions.items():
            if key.startswith(f"{part}/") and "error" not in pred:
                comparisons[key] = compare(pred, runs.get(key.split("/", 1)[1], {}))
    frontier_runs = (read(out, "frontier") or {}).get("variants", {})
    preds = {k.split("/", 1)[1]: v for k, v in predictions.items() if k.startswith("frontier/")}
    frontier = frontier_terms(stacks, preds, frontier_runs)
    results.save(comparisons=comparisons, frontier_terms=frontier, headline=headline(comparisons, frontier, predictions),
                 done=True, measured_parts_over=marker.exists())  # fmt: skip
    return 1 if any("error" in p for p in predictions.values()) else 0
