"""One command per paper figure / table; each prints its numbers and writes benchmarks/results/.

    python benchmarks/paper_eval.py list
    python benchmarks/paper_eval.py fig5 [options of benchmarks/costmodel.py]

Each entry names what it runs and whether its numbers are measured or modelled. GPU entries
need a CUDA device and say so when there is none.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

# figure -> (script under benchmarks/, arguments placed before the user's, description)
ENTRIES: dict[str, tuple[str, list[str], str]] = {
    "planner": ("planner.py", [], "planner study + Table 2, heuristic vs ILP (measured, CPU)"),
    "attention-gpu": ("attention.py", ["--preset", "paper"], "Fig. 3 + per-rank critical path (measured, GPU)"),
    "fig3-model": ("costmodel.py", ["fig3"], "kernel efficiency, whole vs Per-Doc shards (modelled, CPU)"),
    "fig5": ("costmodel.py", ["fig5"], "speedup per dataset x heads x N at 128K (modelled, CPU)"),
    "fig6": ("costmodel.py", ["fig6"], "training latency breakdown, N=8 (modelled, CPU)"),
    "fig7": ("costmodel.py", ["fig7"], "speedup across context sizes 64K-128K, wlbllm (modelled, CPU)"),
    "model-validate": ("costmodel.py", ["validate"], "cost-model fit residuals and held-out checks (CPU)"),
    "model-sensitivity": ("costmodel.py", ["sensitivity"], "speedups under perturbed assumptions (CPU)"),
}


def main(argv: list[str]) -> None:
    if not argv or argv[0] in ("list", "-h", "--help"):
        print(__doc__)
        for name, (script, pre, what) in ENTRIES.items():
            print(f"  {name:18s} {what}  [benchmarks/{script} {' '.join(pre)}]")
        return
    name, rest = argv[0], argv[1:]
    if name not in ENTRIES:
        raise SystemExit(f"unknown figure {name!r}; run `python benchmarks/paper_eval.py list`")
    script, pre, _ = ENTRIES[name]
    sys.argv = [str(HERE / script), *pre, *rest]
    runpy.run_path(str(HERE / script), run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
