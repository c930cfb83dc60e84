"""gpt-oss's sliding-window layers under CP: K/V rows per layer per rank, and the step (MODELLED).

    python benchmarks/window_rows.py          # 128K and 1M, CP 8-64, wlbllm and pile, 3 windows each
    python benchmarks/window_rows.py --contexts 131072 --cp 8 --windows 5 --json out.json

gpt-oss-20b and -120b have the same attention (64 query / 8 KV heads of 64; half the layers a
128-key sliding window, HF `sliding_window`), so a K/V row is 8 x 2 x 64 bf16 values (2 KiB) in
both and their FlashCP plans are the same: Algorithm 1 balancing both layer kinds' work
(`LlamaShape.workload`, one full : one window layer). Per setting, `--windows` packed windows
(`flashcp.data.length_sampler`, `pack_windows`), the busiest rank's rows per layer, means over
the windows:
- all-gather: (N - 1) C / N, what Llama3 and Per-Doc CP receive in every full layer;
- FlashCP full: a full layer's compact all-gather (`Plan.metrics`);
- FlashCP window: a window layer's compact all-gather / needed rows (`flashcp.plan.window`);
- halo Llama3 / Per-Doc: the rows the windows of the per_seq (contiguous head-tail split,
  at most 2 (W - 1)) and Per-Doc plans reach, exchanged point to point.
Then the modelled training step (s) of each model per system (`flashcp.costmodel.step.StepModel`:
one window per step, DP 1, EP 8, full AC; window layers priced by `CostModel.step(..., window=W)`
with the exchange the trainer's default `[flashcp] window_comm = "auto"` runs: FlashCP's window
layers the needed rows, the baselines' a halo), and FlashCP's with its window layers all-gathering
their compact rows (`window_comm = "compact"`, what every window layer ran before window_comm).
The layer model is unscaled (`paper_ratio_scales` calibrates causal layers on one node); CP > 8
spans nodes of 8 GPUs (`multinode_model`). Calibration: ../shared/data/gpu_profiles (H100
FlashAttention profile, H200 nccl-tests), --profiles to change; without them only the rows are
printed. `--json X` also writes the table to X with the suffix .md.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.sweep import sweep_parser  # noqa: E402
from flashcp import plan_shards  # noqa: E402
from flashcp.costmodel import CostModel, load_cost_model  # noqa: E402
from flashcp.costmodel.fabric import multinode_model  # noqa: E402
from flashcp.costmodel.step import GPT_OSS_20B, GPT_OSS_120B, MeshAssumptions, StepModel  # noqa: E402
from flashcp.data import length_sampler, pack_windows  # noqa: E402
from flashcp.plan.window import window_needed_tokens, window_recv_tokens  # noqa: E402

MODELS = {"20b": GPT_OSS_20B, "120b": GPT_OSS_120B}
SYSTEMS = ("llama3", "per_doc", "flashcp")
# (column suffix, system, window_comm): the step columns, auto's exchange then FlashCP's compact window layers
STEPS = (*((s, s, "auto") for s in SYSTEMS), ("flashcp_window_compact", "flashcp", "compact"))
ROWS = ("all_gather", "flashcp_full", "flashcp_window_compact", "flashcp_window_needed", "halo_llama3",
        "halo_per_doc", "flashcp_imbalance")  # fmt: skip
EP = 8


def rows(lens: list[int], cp: int, window: int, plans: dict) -> dict[str, float]:
    """The busiest rank's rows per layer of one window (`ROWS`), its plans kept in `plans`."""
    workload = GPT_OSS_20B.workload
    for strategy in ("per_seq", "per_doc", "flashcp"):  # the keys StepModel.plan looks up
        plans[(strategy, tuple(lens), workload)] = plan_shards(lens, cp, strategy, workload=workload)
    per_seq, per_doc, flashcp = (plans[(s, tuple(lens), workload)] for s in ("per_seq", "per_doc", "flashcp"))
    m = flashcp.metrics()
    return {
        "all_gather": m["comm_full_tokens"],
        "flashcp_full": m["comm_compact_tokens"],
        "flashcp_window_compact": max(window_recv_tokens(flashcp, window, "compact")),
        "flashcp_window_needed": max(window_needed_tokens(flashcp, window)),
        "halo_llama3": max(window_needed_tokens(per_seq, window)),
        "halo_per_doc": max(window_needed_tokens(per_doc, window)),
        "flashcp_imbalance": m["imbalance"],
    }


def setting(dist: str, context: int, cp: int, windows: int, attention: CostModel | None) -> dict:
    """Means over `windows` packed windows of the rows and (with an attention model) step seconds."""
    sums: dict[str, list[float]] = {}
    window = GPT_OSS_20B.window
    plans: dict = {}
    for lens in pack_windows(length_sampler(dist, seed=0), context, windows):
        values = rows(lens, cp, window, plans)
        if attention is not None:
            for name, shape in MODELS.items():
                for column, system, window_comm in STEPS:
                    model = StepModel(attention, shape, cp, 1, MeshAssumptions(), plans, ep=EP, window_comm=window_comm)
                    values[f"{name}.{column}_s"] = model.step(system, [[lens]]).total / 1e3
        for key, value in values.items():
            sums.setdefault(key, []).append(value)
    return {"dist": dist, "context": context, "cp": cp, "windows": windows,
            **{k: float(np.mean(v)) for k, v in sums.items()}}  # fmt: skip


def markdown(results: list[dict]) -> str:
    modelled = any("20b.flashcp_s" in r for r in results)
    head = ["window", "CP", "all-gather", "FlashCP full", "FlashCP window compact / needed",
            "halo Llama3 / Per-Doc", "FlashCP imbalance"]  # fmt: skip
    if modelled:
        head += [f"{n} step s: Llama3 / Per-Doc / FlashCP (window compact)" for n in MODELS]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in results:
        cells = [
            f"{r['dist']} {r['context'] // 1024}K", str(r["cp"]), f"{r['all_gather']:,.0f}",
            f"{r['flashcp_full']:,.0f}",
            f"{r['flashcp_window_compact']:,.0f} / {r['flashcp_window_needed']:,.0f}",
            f"{r['halo_llama3']:,.0f} / {r['halo_per_doc']:,.0f}", f"{r['flashcp_imbalance']:.3f}",
        ]
        if modelled:
            compact = (f" ({r[f'{n}.flashcp_window_compact_s']:.2f})" for n in MODELS)
            cells += [" / ".join(f"{r[f'{n}.{s}_s']:.2f}" for s in SYSTEMS) + c for n, c in zip(MODELS, compact)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def attention_models(cps: list[int], profiles: Path) -> dict[int, CostModel] | None:
    """{cp: attention model}: one node's for up to 8 ranks, the many-node model beyond; None
    without the calibration tables."""
    if not profiles.exists():
        return None
    model, _ = load_cost_model([profiles], [profiles])
    return {cp: model if cp <= MeshAssumptions.gpus_per_node else multinode_model(model) for cp in cps}


def main(argv: list[str] | None = None) -> int:
    p = sweep_parser(__doc__.splitlines()[0], windows=3)
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    models = attention_models(args.cp, args.profiles)
    results = []
    for dist in args.datasets:
        for context in args.contexts:
            for cp in args.cp:
                results.append(setting(dist, context, cp, args.windows, models[cp] if models else None))
                print(f"{dist} {context // 1024}K CP {cp} done", file=sys.stderr, flush=True)
    table = (f"gpt-oss (W = {GPT_OSS_20B.window}, 1 full : 1 window layer): K/V rows the busiest rank receives "
             f"per layer (2 KiB each, counted), means of {args.windows} windows per setting; step seconds modelled, "
             "window layers by window_comm auto (FlashCP's in parentheses: compact)\n" + markdown(results))  # fmt: skip
    print(table)
    if models is None:
        print(f"(no modelled step times: calibration tables not found at {args.profiles})")
    if args.json:
        payload = {"command": "python benchmarks/window_rows.py " + " ".join(argv or sys.argv[1:]),
                   "modelled": "rows are counted from plans; step seconds are modelled (window layers by "
                               "window_comm auto; flashcp_window_compact: FlashCP's with window_comm compact)",
                   "results": results}  # fmt: skip
        args.json.write_text(json.dumps(payload, indent=1) + "\n")
        args.json.with_suffix(".md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
