"""Part b of the lease: the trainer on one GPU through the launcher, variant by variant.

Each variant of `jobs.train_jobs` is one `python -m flashcp.titan.launch` (what `./run_train.sh` runs
once its venv exists; without a GPU its `main` in a forked child, see `launch`) on one rank, within
what is left of the part's budget; its figures come from the run's TensorBoard events (loss, step
time, tokens/s, MFU, the allocator's peaks per step) and are written to OUTDIR/train.json as soon as
the run ends. Then the checks: every loss finite, the offload
and the MLP tiles reproduce eager's losses, compile stays close to them (`Job.tolerance`).
"""

from __future__ import annotations

import math
import multiprocessing
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from flashcp.titan.config.converters import converter_problem
from flashcp.titan.launch.node import main as launcher
from flashcp.titan.lease.jobs import Job, train_jobs
from flashcp.titan.lease.results import gpu_query, Results

MIN_RUN_S = 20  # a variant with less of the budget left is skipped, not started
TAGS = {"loss": "loss_metrics/global_avg_loss", "step_s": "time_metrics/end_to_end(s)", "tokens_per_s": "throughput(tps)",
        "tflops": "tflops", "mfu_pct": "mfu(%)", "max_allocated_gib": "memory/max_allocated(GiB)",
        "max_active_gib": "memory/max_active(GiB)", "max_reserved_gib": "memory/max_reserved(GiB)"}  # fmt: skip
NO_CUDA = "unavailable: no CUDA device (a CPU rehearsal; max_active_gib is the process's peak RSS)"


def unavailable(job: Job, device: str) -> str | None:
    """Why this machine cannot run `job` (None: it can), e.g. Float8 without torchao or an sm89+ GPU."""
    if job.converter is None:
        return None
    cap = gpu_query("compute_cap") if device == "cuda" else None
    capability = tuple(int(x) for x in cap.split(".")) if cap else None
    return converter_problem(job.converter, emulate="--float8.emulate" in job.overrides, has_cuda=cap is not None,
                             capability=capability)  # fmt: skip


def launch(job: Job, work: Path, device: str, timeout: float) -> dict[str, Any]:
    """Train `job` on one rank through the launcher; its status, wall time and last output line.

    With a GPU the launcher is a process of its own, `python -m flashcp.titan.launch`. Without one it
    is the same `main` in a child forked from this process, which has imported all the launcher
    imports: a new interpreter would spend seconds of a CPU's time importing torch and TorchTitan
    again, each run. (Forking after CUDA's driver started, as TorchTitan's import does on a GPU
    machine, is not safe.)"""
    dump = work / job.name
    log = work / f"{job.name}.log"
    args = job.args(dump)
    cmd = [sys.executable, "-m", "flashcp.titan.launch", *args]
    start = time.monotonic()
    with log.open("w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        if device == "cpu":
            proc: Any = multiprocessing.get_context("fork").Process(target=_forked_launcher, args=(args, f.fileno()))
            proc.start()
            proc.join(timeout)
            code = proc.exitcode
        else:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "NGPU": "1"},
                                    start_new_session=True)  # fmt: skip
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                code = None
        if code is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its rank
            except ProcessLookupError:  # it ended meanwhile
                pass
            (proc.join if device == "cpu" else proc.wait)()
            status = f"timed out ({timeout:.0f} s)"
        else:
            status = "trained" if code == 0 else f"failed (exit {code})"
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return {"status": status, "seconds": time.monotonic() - start, "last_line": lines[-1] if lines else "",
            "command": "python -m flashcp.titan.launch " + " ".join(args)}  # fmt: skip


def _forked_launcher(argv: list[str], log_fd: int) -> None:
    """`python -m flashcp.titan.launch ARGV` on one rank, in a forked child: its own session (so that
    a timeout kills it with its rank) and its output into the run's log."""
    os.setsid()
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__  # the interpreter's own, on those descriptors
    os.environ["NGPU"] = "1"
    sys.exit(launcher(argv))


def read_steps(dump: Path) -> dict[int, dict[str, float]]:
    """Per step, the figures of `TAGS` the run logged to TensorBoard (every step: log_freq = 1)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    steps: dict[int, dict[str, float]] = {}
    for folder in sorted({p.parent for p in dump.glob("tb/**/events.out.tfevents.*")}):
        events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
        events.Reload()
        tags = set(events.Tags()["scalars"])
        for key, tag in TAGS.items():
            if tag in tags:
                for event in events.Scalars(tag):
                    steps.setdefault(event.step, {})[key] = event.value
    return dict(sorted(steps.items()))


def summarise(steps: dict[int, dict[str, float]], device: str) -> dict[str, Any]:
    """Medians over the steps after the first (warm-up, compilation) and the allocator's peaks over all."""
    later = [s for step, s in steps.items() if step > 1] or list(steps.values())

    def median(key: str) -> float | None:
        values = [s[key] for s in later if key in s]
        return statistics.median(values) if values else None

    def peak(key: str) -> float | None:
        values = [s[key] for s in steps.values() if key in s]
        return max(values) if values else None

    out: dict[str, Any] = {"losses": {step: s.get("loss") for step, s in steps.items()},
                           "step_s": median("step_s"), "tokens_per_s": median("tokens_per_s"),
                           "tflops": median("tflops"), "mfu_pct": median("mfu_pct")}  # fmt: skip
    if device == "cuda":
        out.update(peak_allocated_gib=peak("max_allocated_gib"), peak_active_gib=peak("max_active_gib"),
                   peak_reserved_gib=peak("max_reserved_gib"))  # fmt: skip
    else:
        out.update(cuda_memory=NO_CUDA, peak_rss_gib=peak("max_active_gib"))
    return out


def train_and_measure(job: Job, work: Path, device: str, timeout: float) -> dict[str, Any]:
    run = launch(job, work, device, timeout)
    steps = read_steps(work / job.name)
    return {**run, **summarise(steps, device), "steps": steps}


def check(jobs: list[Job], runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Finite losses for every trained run; each `compare_to` pair's losses within the tolerance."""
    out = []
    for job in jobs:
        run = runs.get(job.name, {})
        if run.get("status") != "trained":
            continue
        losses = {int(k): v for k, v in run["losses"].items()}
        finite = bool(losses) and all(v is not None and math.isfinite(v) for v in losses.values())
        out.append({"check": f"{job.name}: losses finite", "passed": finite, "steps": len(losses)})
        base = runs.get(job.compare_to or "", {})
        if job.compare_to is None or base.get("status") != "trained":
            continue
        ref = {int(k): v for k, v in base["losses"].items()}
        common = sorted(set(losses) & set(ref))
        worst = max((abs(losses[s] - ref[s]) / max(abs(ref[s]), 1e-12) for s in common), default=math.inf)
        out.append({"check": f"{job.name} reproduces {job.compare_to}'s losses", "passed": worst <= job.tolerance,
                    "max_relative_difference": worst, "tolerance": job.tolerance, "steps": len(common)})  # fmt: skip
    return out


def headline(runs: dict[str, dict[str, Any]], checks: list[dict[str, Any]]) -> str:
    trained = [name for name, r in runs.items() if r.get("status") == "trained"]
    parts = [f"{len(trained)}/{len(runs)} variants trained, {sum(c['passed'] for c in checks)}/{len(checks)} checks passed"]
    for name in trained:
        r = runs[name]
        figures = [f"{r['step_s']:.3g} s/step" if r.get("step_s") else "",
                   f"{r['tokens_per_s']:,.0f} tok/s" if r.get("tokens_per_s") else "",
                   f"MFU {r['mfu_pct']:.1f}%" if r.get("mfu_pct") else "",
                   f"peak {r['peak_allocated_gib']:.1f} GiB allocated" if r.get("peak_allocated_gib") else ""]  # fmt: skip
        parts.append(f"{name}: " + ", ".join(f for f in figures if f))
    return "; ".join(parts)


def time_left(deadline: float, run_cap: float) -> float:
    """Seconds one more run may take: at most `run_cap` (a run that hangs leaves the rest of the budget
    to the others), and never past the part's deadline (seconds since the epoch)."""
    return min(deadline - time.time(), run_cap)


def run(out: Path, device: str, quick: bool, deadline: float, run_cap: float) -> int:
    """Part b: train every variant that the budget and the machine allow; 1 if any failed or a check did."""
    results = Results(out, "train", device, quick)
    work = results.work
    jobs = train_jobs(quick)
    runs: dict[str, dict[str, Any]] = {}
    for job in jobs:
        left = time_left(deadline, run_cap)
        why = unavailable(job, device)
        if why is None and left < MIN_RUN_S:
            why = f"the part's budget is spent ({left:.0f} s left)"
        if why:
            runs[job.name] = {"status": f"skipped: {why}"}
            print(f"{job.name}: skipped: {why}", flush=True)
        else:
            print(f"{job.name}: {' '.join(job.args(work / job.name))}", flush=True)
            runs[job.name] = train_and_measure(job, work, device, left)
            r = runs[job.name]
            print(f"{job.name}: {r['status']} in {r['seconds']:.0f} s; losses {list(r['losses'].values())}; "
                  f"{r['last_line'] if r['status'] != 'trained' else ''}", flush=True)  # fmt: skip
        results.save(variants=runs)
    checks = check(jobs, runs)
    for c in checks:
        print(f"{'PASS' if c['passed'] else 'FAIL'}: {c['check']} {c.get('max_relative_difference', '')}", flush=True)
    results.save(variants=runs, checks=checks, headline=headline(runs, checks), done=True)
    failed = [n for n, r in runs.items() if not r["status"].startswith(("trained", "skipped"))]
    return 1 if failed or not all(c["passed"] for c in checks) else 0
