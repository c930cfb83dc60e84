"""`python -m flashcp.gpucheck --out DIR [--device cuda|cpu] [--quick]`: see flashcp.gpucheck."""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

import torch

from flashcp.gpucheck import SECTIONS, backends_for
from flashcp.gpucheck.report import Budget, Report
from flashcp.gpucheck.sizes import GPU, QUICK


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m flashcp.gpucheck",
        description="Verify and measure FlashCP's kernels, CP op and decoder layer on this machine's GPU.",
    )
    p.add_argument("--out", type=Path, required=True, help="folder for the CSV/JSON results and summary.md")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="toy sizes (every section, in seconds; the CPU test)")
    p.add_argument("--sections", nargs="+", choices=list(SECTIONS), default=list(SECTIONS))
    p.add_argument("--budget-scale", type=float, default=1.0, help="multiply every section's time budget")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA GPU here (use --device cpu --quick for a dry run)")
    if not args.budget_scale > 0:
        p.error("--budget-scale must be positive")

    device = torch.device(args.device)
    sizes = QUICK if args.quick else GPU
    if device.type == "cpu" and not args.quick:
        print("note: full sizes on a CPU use the reference kernel and will mostly be cut by the budgets")
    command = "python -m flashcp.gpucheck " + shlex.join(argv if argv is not None else sys.argv[1:])
    report = Report(args.out, command, device)
    backends = backends_for(device)
    print(f"gpucheck on {report.environment['device']}: torch {torch.__version__}, backends {backends}", flush=True)
    start = time.perf_counter()
    for key in args.sections:
        title, run = SECTIONS[key]
        with report.section(key, title) as sec:
            run(report, sec, device, sizes, Budget(sizes.budgets_s[key] * args.budget_scale), backends)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    report.close()
    bad = [k for k, s in report.sections.items() if s.status not in ("passed", "measured", "cut short")]
    took = time.perf_counter() - start
    if bad:
        print(f"gpucheck: FAILED in {', '.join(bad)} ({took:.0f} s); see {args.out / 'summary.md'}")
        return 1
    print(f"gpucheck: {len(report.sections)} sections passed or measured in {took:.0f} s; results in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
