"""Qwen3.5's Gated DeltaNet layers under CP: state bytes per layer per rank (COUNTED) and the step (MODELLED).

    python benchmarks/linear_state.py          # 128K and 1M, CP 8-64, wlbllm and pile, 3 windows each
    python benchmarks/linear_state.py --contexts 131072 --cp 8 --windows 5 --json out.json

The shape is the shipped job's (qwen3_5_9b_128k): TorchTitan's qwen3_5 9B flavor, read from its registry
(`flashcp.titan.models.windows.linear_layers`: 24 Gated DeltaNet layers of 32 value heads, d_k = d_v =
128, beside 8 full layers of 4 K/V heads of 256). Per setting, `--windows` packed windows
(`length_sampler`, `pack_windows`), means over the windows, in MiB one layer's forward receives:
- K/V all-gather: a full layer's (N - 1) C / N rows, what Llama3 / Per-Doc CP receive (bf16);
- FlashCP K/V: a full layer's compact all-gather under the hybrid plan;
- state contiguous: every rank all-gathering each contiguous chunk's summary [B | M] in float32
  (flash-linear-attention's CP layout: one summary per rank);
- FlashCP state: the summaries of cut pieces a rank receives (`linear_comm`), busiest rank / mean,
  planned by the shipped default planner (flashcp, target 1.05) "before" (the workload of the full
  layers alone, what the planner balanced before it priced linear layers) and "after"
  (`Workload.linear`: their work per token and a cut's state bytes); cut documents before / after.
Then the modelled step of the job (`StepModel`, QWEN3_5_9B: DP 1, full AC, FSDP over the CP ranks) at
128K on CP 8 per system, with the linear layers' state exchange apart. The layer model is unscaled
(`paper_ratio_scales` calibrates causal layers on one node); the Gated DeltaNet kernel's rate is
ASSUMED (`MeshAssumptions.linear_tflops`). Calibration: ../shared/data/gpu_profiles. `--json X` also
writes the table to X with the suffix .md.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.sweep import sweep_parser  # noqa: E402
from flashcp import plan_shards  # noqa: E402
from flashcp.costmodel import load_cost_model  # noqa: E402
from flashcp.costmodel.step import QWEN3_5_9B, StepModel  # noqa: E402
from flashcp.data import length_sampler, pack_windows  # noqa: E402
from flashcp.plan import Workload  # noqa: E402
from flashcp.plan.linear import LinearLayers, linear_metrics  # noqa: E402

MIB = 2**20


def registry_shape() -> LinearLayers:
    """TorchTitan's qwen3_5 9B flavor as the planner prices it (the step model's QWEN3_5_9B is the same)."""
    import flashcp.titan  # noqa: F401  (its shims before TorchTitan's models)
    from torchtitan.models.qwen3_5 import qwen3_5_configs

    from flashcp.titan.models.windows import linear_layers

    shape = linear_layers(qwen3_5_configs["9B"](attn_backend="varlen"))
    assert shape == QWEN3_5_9B.linear, (shape, QWEN3_5_9B.linear)
    return shape


def setting(dist: str, context: int, cp: int, windows: int, lin: LinearLayers) -> dict:
    before, after = Workload(full_layers=lin.full_layers), Workload(full_layers=lin.full_layers, linear=lin)
    sums: dict[str, list[float]] = {}
    for lens in pack_windows(length_sampler(dist, seed=0), context, windows):
        values = {}
        for name, workload in (("before", before), ("after", after)):
            start = time.perf_counter()
            plan = plan_shards(lens, cp, workload=workload)
            values[f"{name}_plan_ms"] = (time.perf_counter() - start) * 1e3
            m = linear_metrics(plan, lin)
            values |= {f"{name}_{k}": v for k, v in m.items()}
            values[f"{name}_split_docs"] = plan.metrics()["split_docs"]
            values[f"{name}_kv_compact_bytes"] = plan.metrics()["comm_compact_tokens"] * lin.kv_row_bytes
        for key, value in values.items():
            sums.setdefault(key, []).append(value)
    return {"dist": dist, "context": context, "cp": cp, "windows": windows,
            **{k: float(np.mean(v)) for k, v in sums.items()}}  # fmt: skip


def markdown(results: list[dict]) -> str:
    head = ["window", "CP", "K/V all-gather", "FlashCP K/V", "state contiguous", "FlashCP state before: busiest / mean",
            "FlashCP state after: busiest / mean", "cut docs before / after", "plan ms after"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in results:
        lines.append("| " + " | ".join([
            f"{r['dist']} {r['context'] // 1024}K", str(r["cp"]), f"{r['after_kv_all_gather_bytes'] / MIB:,.0f}",
            f"{r['after_kv_compact_bytes'] / MIB:,.0f}", f"{r['after_state_contiguous_bytes'] / MIB:,.0f}",
            f"{r['before_state_recv_bytes'] / MIB:,.0f} / {r['before_state_recv_bytes_mean'] / MIB:,.0f}",
            f"{r['after_state_recv_bytes'] / MIB:,.0f} / {r['after_state_recv_bytes_mean'] / MIB:,.0f}",
            f"{r['before_split_docs']:.1f} / {r['after_split_docs']:.1f}", f"{r['after_plan_ms']:.0f}",
        ]) + " |")  # fmt: skip
    return "\n".join(lines)


def modelled_step(profiles: Path, windows: int) -> list[dict]:
    """The job's step (s) at 128K on CP 8 per system and distribution, the linear layers' exchange apart."""
    attention, _ = load_cost_model([profiles], [profiles])
    rows = []
    for dist in ("wlbllm", "pile"):
        lens = pack_windows(length_sampler(dist, seed=0), 131072, windows)
        for system in ("llama3", "per_doc", "flashcp"):
            model = StepModel(attention, QWEN3_5_9B, cp=8, dp=1)
            step = model.step(system, [lens])
            plans = [model.plan(attention.systems[system][0], w) for w in lens]
            exchange = float(np.mean([model.linear_ms(p)[1] for p in plans]))
            rows.append({"dist": dist, "system": system, "step_s": step.total / len(lens) / 1e3,
                         "attention_s": step.attention / len(lens) / 1e3,
                         "linear_exchange_forward_ms": exchange})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    p = sweep_parser(__doc__.splitlines()[0], windows=3)
    p.add_argument("--json", type=Path, help="write the results here (and the table beside it, .md)")
    args = p.parse_args(argv)
    lin = registry_shape()
    results = [setting(d, c, n, args.windows, lin) for c in args.contexts for d in args.datasets for n in args.cp]
    table = markdown(results)
    print("COUNTED: MiB one layer's forward receives per rank (means over windows); Qwen3.5 9B (TorchTitan registry)")
    print(table)
    steps = modelled_step(args.profiles, args.windows) if args.profiles.exists() else []
    if steps:
        print("\nMODELLED: qwen3_5_9b_128k's step at 128K, CP 8 (s per window; the linear layers' state exchange, "
              "forward, all 24 layers, ms)")
        for r in steps:
            print(f"  {r['dist']:7} {r['system']:8} step {r['step_s']:.3f} s  attention {r['attention_s']:.3f} s  "
                  f"state exchange {r['linear_exchange_forward_ms']:.2f} ms")
    if args.json:
        args.json.write_text(json.dumps({"shape": lin.__dict__, "results": results, "modelled_step": steps}, indent=1))
        args.json.with_suffix(".md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
