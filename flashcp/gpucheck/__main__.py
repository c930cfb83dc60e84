"""`python -m flashcp.gpucheck --out DIR [--device cuda|cpu] [--quick]`: see flashcp.gpucheck."""

from __future__ import annotations

import argparse
import math
import shlex
import sys
import time
from pathlib import Path

import torch

from flashcp.gpucheck import CORRECTNESS, SECTIONS, backends_for
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
    p.add_argument("--budget", nargs="+", default=[], metavar="SECTION=SECONDS",
                   help="a section's own time budget, instead of its default times --budget-scale")
    p.add_argument("--no-budgets", action="store_true",
                   help="run every case whatever it takes (a loaded machine then finishes every check)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA GPU here (use --device cpu --quick for a dry run)")
    if not args.budget_scale > 0:
        p.error("--budget-scale must be positive")
    own = _section_budgets(p, args.budget)

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
            seconds = math.inf if args.no_budgets else own.get(key, sizes.budgets_s[key] * args.budget_scale)
            run(report, sec, device, sizes, Budget(seconds), backends)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    report.close()
    bad = [k for k, s in report.sections.items() if s.status not in ("passed", "measured", "cut short")]
    unchecked = [k for k, s in report.sections.items() if k in CORRECTNESS and s.status == "cut short"]
    took = time.perf_counter() - start
    if bad:
        print(f"gpucheck: FAILED in {', '.join(bad)} ({took:.0f} s); see {args.out / 'summary.md'}")
        return 1
    if unchecked:  # a correctness check that did not run every case has not passed
        print(f"gpucheck: NOT ALL CHECKED: {', '.join(unchecked)} cut short by the time budget ({took:.0f} s); "
              f"rerun with --budget-scale 2 or --no-budgets")
        return 1
    print(f"gpucheck: {len(report.sections)} sections passed or measured in {took:.0f} s; results in {args.out}")
    return 0


def _section_budgets(p: argparse.ArgumentParser, items: list[str]) -> dict[str, float]:
    """`--budget exactness=50 cp=60`: seconds per named section."""
    out = {}
    for item in items:
        key, _, value = item.partition("=")
        try:
            seconds = float(value)
        except ValueError:
            seconds = -1.0
        if key not in SECTIONS or not seconds > 0:
            p.error(f"--budget {item}: expected SECTION=SECONDS with a section of {', '.join(SECTIONS)} "
                    "and a positive number of seconds")
        out[key] = seconds
    return out


if __name__ == "__main__":
    sys.exit(main())
