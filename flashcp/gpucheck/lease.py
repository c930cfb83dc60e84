"""One GPU lease, fully used: every check a rare, brief GPU is for, in one command (`scripts/gpu_lease.sh`).

    python -m flashcp.gpucheck.lease OUTDIR [--device cpu --quick] [--only PART ...] [--skip PART ...]

OUTDIR is new or empty, so that no rerun replaces a result; every input is checked before anything
starts (`lease_start`, which the script runs first, also installing the carried wheels).

Parts, each a process of its own under its own time limit (a part that fails, hangs or dies costs
only itself: rerun it with `--only`), each writing its results the moment they exist:

- a `gpucheck`: `python -m flashcp.gpucheck`, every section;
- b `train`: the trainer through the launcher on a ~1B Llama 3, variant by variant
  (`flashcp.titan.lease.train`);
- c `dryrun`: the dry run's predicted peak of every trained job beside the allocator's
  (`flashcp.titan.lease.memory`); it runs on the CPU while the GPU parts run, then joins their figures;
- d `frontier`: Llama 3 8B layer stacks at 128K tokens on one rank, measured against the dry
  run's per-layer and fixed terms (`flashcp.titan.lease.frontier`).

Parts b-d need TorchTitan: this module imports none of it, so the GPU check runs whatever happens
to them. At the end the summary (`summary.md`, also printed) gives each part's status, time and
headline figures, and OUTDIR is packed into at most 8 files of at most 16 MiB: summary.md, lease.json,
the parts' JSON, gpucheck.tar.gz (the check's own folder, which `benchmarks/costmodel.py refit
--gpucheck` also reads packed) and logs.tar.gz (every part's output and the runs' rank logs and
TensorBoard events, each log cut to its last MiB).
"""

from __future__ import annotations

import io
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from flashcp.gpucheck.lease_start import PARTS, check_args, outdir

# Seconds per part on one H100 (the GPU parts run one after another, the dry run beside them on the
# CPU): 210 + 195 + 150 = 555 s, so that with the wheels' install (~30 s) and the packing the lease
# fits one 10-minute command of a lent machine.
BUDGETS_S = {"gpucheck": 210, "train": 195, "dryrun": 420, "frontier": 150}
# The rehearsal's: a few seconds of work per run, but each run is a process that imports torch and
# TorchTitan, which on a loaded 2-core machine takes tens of seconds.
QUICK_BUDGETS_S = {"gpucheck": 200, "train": 420, "dryrun": 300, "frontier": 240}
# The check's sections within its part: the four correctness sections whole (window_sinks: about 10-20 s
# on an H100, estimated; gdn: fla's Triton kernels compiled for two dtypes, then small runs, estimated),
# the measuring ones shortened.
GPUCHECK_BUDGETS_S = {"exactness": 48, "cp": 55, "window_sinks": 15, "critical_path": 20, "efficiency": 8,
                      "decoder": 8, "gdn": 45}  # fmt: skip
MAX_FILES, MAX_FILE_BYTES, LOG_TAIL_BYTES = 8, 16 * 2**20, 2**20
WORK = "work"  # OUTDIR/work: the parts' raw output, packed at the end
MEASURED = "measured"  # OUTDIR/work/measured: the GPU parts are over (the dry run part then joins)
JOIN_S = 30  # what the dry run part gets after that to compare
DEADLINE_GRACE_S = 10  # a part stops starting runs this long before it would be killed
RUN_CAP_S = 150  # at most one trained run's time (scaled with the budgets): a hang leaves the rest to the others


@dataclass
class Outcome:
    part: str
    status: str = "not run"  # passed | failed (exit N) | timed out | skipped: why
    seconds: float = 0.0
    headline: str = ""


def _command(part: str, out: Path, device: str, quick: bool, budget: float, scale: float) -> list[str]:
    if part == "gpucheck":
        cmd = [sys.executable, "-m", "flashcp.gpucheck", "--out", str(out / WORK / "gpucheck"), "--device", device]
        if quick:  # the rehearsal runs every section whole; the part's own budget still catches a hang
            return [*cmd, "--quick", "--no-budgets"]
        return [*cmd, "--budget", *(f"{k}={v}" for k, v in GPUCHECK_BUDGETS_S.items())]
    # An absolute deadline: the part's own clock starts only after its imports
    cmd = [sys.executable, "-m", "flashcp.titan.lease", part, "--out", str(out), "--device", device,
           "--deadline", f"{time.time() + budget - DEADLINE_GRACE_S:.0f}", "--run-cap", f"{RUN_CAP_S * scale:g}"]  # fmt: skip
    return [*cmd, "--quick"] if quick else cmd


def _start(part: str, out: Path, device: str, quick: bool, budget: float,
           scale: float) -> tuple[subprocess.Popen, Any, float]:
    log = (out / WORK / f"{part}.log").open("w")
    print(f"\n=== {part}: {shlex.join(_command(part, out, device, quick, budget, scale))} (budget {budget:g} s)", flush=True)
    env = dict(os.environ)
    if part == "dryrun":  # the CPU path of the dry run, and the GPU left to the runs it is compared with
        env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "4"))
    if device == "cpu":
        # Two parts at a time (the dry run beside the others) share the cores: half each. More threads
        # than cores make each small op's parallel region wait for a descheduled thread; the CP
        # check's toy sizes ran 25x slower so on a loaded 2-core machine (563 s against 22 s).
        env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // 2)))
    proc = subprocess.Popen(_command(part, out, device, quick, budget, scale), stdout=log, stderr=subprocess.STDOUT,
                            env=env, start_new_session=True)  # fmt: skip
    return proc, log, time.monotonic()


def _finish(part: str, proc: subprocess.Popen, log: Any, started: float, budget: float, out: Path,
            at_least: float = 0.0) -> Outcome:  # fmt: skip
    """Wait for `part` until its budget (from its start) is spent, or `at_least` seconds from now; a part
    past that is killed, process group and all."""
    try:
        code = proc.wait(timeout=max(at_least, started + budget - time.monotonic()))
        status = "passed" if code == 0 else f"failed (exit {code})"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
        status = f"timed out ({budget:g} s)"
    log.close()
    outcome = Outcome(part, status, time.monotonic() - started, headline(part, out))
    print(f"--- {part}: {outcome.status} in {outcome.seconds:.0f} s; {outcome.headline}", flush=True)
    tail = (out / WORK / f"{part}.log").read_text(errors="replace").splitlines()[-12:]
    print("\n".join(f"    {line}" for line in tail), flush=True)
    return outcome


def headline(part: str, out: Path) -> str:
    """A part's figures in one line, from what it wrote (its `headline` field; the check's summary)."""
    if part == "gpucheck":
        summary = out / WORK / "gpucheck" / "summary.md"
        if not summary.exists():
            return "no results"
        lines = summary.read_text().splitlines()
        return "; ".join(f"{t.removeprefix('## ')}: {s.removeprefix('status: ')}"
                         for t, s in zip(lines, lines[2:]) if t.startswith("## "))  # fmt: skip
    path = out / f"{part}.json"
    if not path.exists():
        return "no results"
    try:
        return json.loads(path.read_text()).get("headline", "")
    except json.JSONDecodeError:
        return "results unreadable (cut off while writing)"


def run(out: Path, device: str, quick: bool, parts: list[str], budget_scale: float = 1.0) -> list[Outcome]:
    """Run `parts` (GPU parts one after another, the dry run beside them) and return their outcomes."""
    (out / WORK).mkdir(parents=True, exist_ok=True)
    (out / WORK / MEASURED).unlink(missing_ok=True)
    budgets = {k: v * budget_scale for k, v in (QUICK_BUDGETS_S if quick else BUDGETS_S).items()}
    outcomes = {p: Outcome(p, "skipped: not selected") for p in PARTS}
    side = _start("dryrun", out, device, quick, budgets["dryrun"], budget_scale) if "dryrun" in parts else None
    for part in (p for p in parts if p != "dryrun"):
        started = _start(part, out, device, quick, budgets[part], budget_scale)
        outcomes[part] = _finish(part, *started, budgets[part], out)
    (out / WORK / MEASURED).touch()
    if side is not None:
        # its comparison starts once the GPU parts are over: it gets the time to write it whatever its budget
        outcomes["dryrun"] = _finish("dryrun", *side, budgets["dryrun"], out, at_least=JOIN_S)
    return [outcomes[p] for p in PARTS]


def environment() -> dict[str, Any]:
    env: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "host": platform.node(),
                           "python": platform.python_version()}  # fmt: skip
    try:
        import torch

        env["torch"] = torch.__version__
        env["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    except Exception as e:  # the summary is written whatever is broken
        env["torch"] = f"unavailable: {type(e).__name__}: {e}"
    return env


def write_summary(out: Path, command: str, outcomes: list[Outcome], took: float) -> str:
    env = environment()
    lines = ["# FlashCP GPU lease", "", f"`{command}`", "", *(f"- {k}: {v}" for k, v in env.items()), "",
             "| part | status | seconds | headline |", "| --- | --- | --- | --- |",
             *(f"| {o.part} | {o.status} | {o.seconds:.0f} | {o.headline} |" for o in outcomes), "",
             f"total {took:.0f} s"]  # fmt: skip
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(text)
    (out / "lease.json").write_text(json.dumps({"command": command, "environment": env, "seconds": took,
                                                "parts": [asdict(o) for o in outcomes]}, indent=1) + "\n")  # fmt: skip
    return text


def pack(out: Path) -> list[Path]:
    """OUTDIR as at most 8 files of at most 16 MiB: the check's folder and the logs as tarballs, the rest as is."""
    work = out / WORK
    if (work / "gpucheck").is_dir():
        with tarfile.open(out / "gpucheck.tar.gz", "w:gz") as tar:
            tar.add(work / "gpucheck", arcname="gpucheck")
    with tarfile.open(out / "logs.tar.gz", "w:gz") as tar:
        for path in sorted(p for p in work.rglob("*") if p.is_file() and _is_log(p.relative_to(work))):
            info = tar.gettarinfo(str(path), arcname=str(path.relative_to(work)))
            with path.open("rb") as f:
                f.seek(max(0, info.size - LOG_TAIL_BYTES))
                data = f.read()
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    shutil.rmtree(work)
    files = sorted(p for p in out.iterdir())
    if len(files) > MAX_FILES or any(p.is_dir() or p.stat().st_size > MAX_FILE_BYTES for p in files):
        raise RuntimeError(f"{out} holds {[p.name for p in files]}: more than {MAX_FILES} files or one over 16 MiB")
    return files


def _is_log(rel: Path) -> bool:
    """Everything in the work folder but the check's own folder (packed apart) and checkpoints."""
    return rel.parts[0] != "gpucheck" and "checkpoint" not in rel.parts


def main(argv: list[str] | None = None) -> int:
    """The lease, its inputs checked as `scripts/gpu_lease.sh` checks them (one line and exit 2 each)."""
    argv = sys.argv[1:] if argv is None else argv
    args, parts = check_args(argv)
    outdir(args.out)
    if args.device is None:
        import torch  # there: check_args refuses a python without it

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    command = "bash scripts/gpu_lease.sh " + shlex.join(argv)
    start = time.monotonic()
    outcomes = run(args.out, args.device, args.quick, parts, args.budget_scale)
    took = time.monotonic() - start
    print("\n" + write_summary(args.out, command, outcomes, took), flush=True)
    files = pack(args.out)
    print(f"lease: {len(files)} files in {args.out}: {', '.join(f.name for f in files)}", flush=True)
    failed = [o.part for o in outcomes if o.part in parts and o.status != "passed"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
