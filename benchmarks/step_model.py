"""Predicted training-step time of Llama 3 on a DP x CP mesh, per CP system (MODELLED, not measured).

    python benchmarks/step_model.py [--models 8b 70b] [--contexts 131072 524288] [--dp 1 8 64]
                                    [--datasets wlbllm pile] [--cp 8] [--steps S] [--seed X]
                                    [--dense-tflops T] [--inter-node-gbps B] [--json]

Each step draws documents from the length distribution until dp x C tokens (one window per DP
group and step, the last document cut): the tokens one optimizer step trains. Every system trains
the same documents:
  llama3     Llama3-style CP (per-sequence plan, full KV all-gather), windows in stream order
  per_doc    Per-Doc CP (every document split over the ranks, full all-gather), stream order
  flashcp    FlashCP (Algorithm 1, compact all-gather), stream order
  flashcp+balance      the stream's pieces moved between the DP groups' windows (`[data] balance =
                       "mesh"`): the same tokens and, but for a few short pieces cut at a window's
                       end, the same attended pairs
  flashcp+balance-cut  the step's documents joined and the longest cut until every window is within
                       1.05 x the mean (`balance = "mesh-cut"`): fewer attended pairs, so part of
                       its gain is work not done; `attention_pairs_kept` says how much
The step model is `flashcp.costmodel.step` (dense GEMMs at an assumed efficiency, the calibrated
attention-layer model, FSDP traffic, the slowest DP group); the attention layer is calibrated from
the shared H100 FlashAttention profile and H200 nccl-tests tables in ../shared/data/gpu_profiles
(or --kernel / --collectives). Results: benchmarks/results/step_model.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from balance import steps  # noqa: E402

from flashcp.costmodel import load_cost_model, ProfileError  # noqa: E402
from flashcp.costmodel.step import LLAMA3_8B, LLAMA3_70B, MeshAssumptions, StepModel  # noqa: E402
from flashcp.data.balance import balance_step, stream_windows, WindowCost  # noqa: E402
from flashcp.data.lengths import length_sampler  # noqa: E402

SHARED_PROFILES = ROOT.parent / "shared" / "data" / "gpu_profiles"
MODELS = {"8b": LLAMA3_8B, "70b": LLAMA3_70B}
SYSTEMS = ("llama3", "per_doc", "flashcp", "flashcp+balance", "flashcp+balance-cut")
TARGET = {"flashcp+balance": None, "flashcp+balance-cut": 1.05}


def pairs(windows) -> float:
    return float(sum(n * (n + 1) / 2 for w in windows for n in w))


def evaluate(model: StepModel, doc_lens_per_step: list[list[int]], context: int) -> dict:
    m, dp, cp = model.model, model.dp, model.cp
    cost = WindowCost(m.dense_flops_per_token, 12.0 * m.dim * m.n_layers, cp)
    totals = {s: [] for s in SYSTEMS}
    spread = {s: [] for s in SYSTEMS}
    parts = {s: np.zeros(3) for s in SYSTEMS}
    kept = {s: [] for s in TARGET}
    for lens in doc_lens_per_step:
        stream = [[w] for w in stream_windows(lens, context)]
        pieces = [n for w in stream for n in w[0]]
        for system in SYSTEMS:
            if system in TARGET:
                docs = pieces if TARGET[system] is None else lens
                placed = balance_step(docs, dp, 1, context, cost, TARGET[system])
                windows = [[[p.length for p in w] for w in rank] for rank in placed]
                kept[system].append(pairs(w[0] for w in windows) / pairs(w[0] for w in stream))
                result = model.step("flashcp", windows)
            else:
                result = model.step(system, stream)
            totals[system].append(result.total)
            spread[system].append(float(np.mean(result.group_spread)))
            parts[system] += (result.dense, result.attention, result.fsdp_exposed)
    n = len(doc_lens_per_step)
    step_s = {s: float(np.mean(v)) / 1e3 for s, v in totals.items()}
    return {
        "step_s": step_s,
        "speedup_vs_llama3": {s: step_s["llama3"] / t for s, t in step_s.items()},
        "dp_group_max_over_mean": {s: float(np.mean(v)) for s, v in spread.items()},
        "breakdown_s": {s: dict(zip(("dense", "attention", "fsdp_exposed"), (p / n / 1e3).tolist()))
                        for s, p in parts.items()},  # fmt: skip
        "attention_pairs_kept": {s: float(np.mean(v)) for s, v in kept.items()},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--contexts", nargs="+", type=int, default=[131072, 524288])
    p.add_argument("--dp", nargs="+", type=int, default=[1, 8, 64])
    p.add_argument("--datasets", nargs="+", default=["wlbllm", "pile"])
    p.add_argument("--cp", type=int, default=8)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dense-tflops", type=float, default=MeshAssumptions.dense_tflops)
    p.add_argument("--inter-node-gbps", type=float, default=MeshAssumptions.inter_node_busbw_gbps)
    p.add_argument("--kernel", nargs="+", type=Path, default=[SHARED_PROFILES])
    p.add_argument("--collectives", nargs="+", type=Path, default=[SHARED_PROFILES])
    p.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")
    args = p.parse_args(argv)
    try:
        attention, _ = load_cost_model(args.collectives, args.kernel)
    except (OSError, ProfileError) as e:
        p.error(f"cannot load the attention model's calibration: {e}")
    assume = MeshAssumptions(dense_tflops=args.dense_tflops, inter_node_busbw_gbps=args.inter_node_gbps)
    runs = []
    for dataset in args.datasets:
        for context in args.contexts:
            for dp in args.dp:
                draws = steps(length_sampler(dataset, seed=args.seed), dp * context)
                lens = [next(draws) for _ in range(args.steps)]
                plans: dict = {}  # plans depend on the windows only: shared by the models
                for name in args.models:
                    model = StepModel(attention, MODELS[name], args.cp, dp, assume, plans)
                    out = evaluate(model, lens, context)
                    out["setting"] = {"model": MODELS[name].name, "dataset": dataset, "context": context,
                                      "dp": dp, "cp": args.cp, "steps": args.steps, "seed": args.seed}  # fmt: skip
                    runs.append(out)
                    speed = "  ".join(f"{s} {v:.2f}x" for s, v in out["speedup_vs_llama3"].items() if s != "llama3")
                    print(f"{MODELS[name].name:12s} {dataset:7s} C={context // 1024}K DP={dp:<3d} Llama3 CP "
                          f"{out['step_s']['llama3']:7.2f} s/step  {speed}", file=sys.stderr, flush=True)  # fmt: skip
    payload = {
        "command": "python benchmarks/step_model.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "modelled": "every figure is predicted by flashcp.costmodel.step, none is measured",
        "assumptions": asdict(assume),
        "calibration": {"kernel": [str(k) for k in args.kernel], "collectives": [str(c) for c in args.collectives]},
        "runs": runs,
    }
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "step_model.json").write_text(json.dumps(payload, indent=1) + "\n")
    if args.json:
        print(json.dumps(payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
