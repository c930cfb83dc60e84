"""The two big pipelined jobs' step with its bubble (MODELLED, not measured).

    python benchmarks/step_model_pipeline.py [--windows-seed S] [--profiles DIR]

For `train_configs/llama3_405b_128k.toml` (PP 8 x TP 8 x CP 8, 1F1B, 16 microbatches) and
`train_configs/deepseek_v3_671b_128k.toml` (PP 8 x CP 8 x FSDP 8, EP 64, 1F1B, 16 microbatches):

- one microbatch (one packed 128K WLB-LLM window) on one pipeline rank: `flashcp.costmodel.step`'s
  window time (dense GEMMs at the published MFU, FlashCP's attention layer model over the nodes of
  `flashcp.costmodel.fabric`, full AC's recompute, an MoE model's expert all-to-all over its EP ranks)
  times the largest stage's share of the layers (the pipeline runs at its slowest stage's pace);
  405B's TP 8 as a rank's share of the model (parameters, vocabulary and heads / 8: 16 query heads,
  1 K/V head), TP's own NVLink collectives not priced;
- the schedule (`flashcp.costmodel.pipeline`): (m + p - 1) slots of it, the bubble (p - 1) / (m + p - 1),
  and at every slot one stage boundary's send each way of a microbatch's activations over a NIC;
- FSDP: under PP TorchTitan keeps a stage's weights gathered between microbatches, so a step gathers
  and reduce-scatters the stage's parameters once; shown apart, assumed hidden behind the step.

Results: benchmarks/results/step_model_pipeline.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from step_model import SHARED_PROFILES  # noqa: E402
from step_model_multinode import stream_windows  # noqa: E402

from flashcp.costmodel import load_cost_model, ProfileError  # noqa: E402
from flashcp.costmodel.fabric import Fabric, multinode_model  # noqa: E402
from flashcp.costmodel.pipeline import p2p_ms, pipeline_step  # noqa: E402
from flashcp.costmodel.step import DEEPSEEK_V3_671B, LlamaShape, MeshAssumptions, StepModel  # noqa: E402

# Llama 3.1 405B: 126 layers of 3.19e9 (q, o 16384^2, k, v 16384 x 1024, MLP 3 x 16384 x 53248) and
# the embedding and output (128256 x 16384 each): 405.85e9
LLAMA3_405B = LlamaShape("Llama 3 405B", 405.85e9, 16384, 126, 128, 8, 128256)

JOBS = {
    # name: (shape, tp, cp, dp_shard, ep, pp, microbatches, the largest stage's layers)
    "llama3_405b_128k": (LLAMA3_405B, 8, 8, 1, 1, 8, 16, 16),
    "deepseek_v3_671b_128k": (DEEPSEEK_V3_671B, 1, 8, 8, 64, 8, 16, 8),
}
CONTEXT = 131072


def per_tp_rank(shape: LlamaShape, tp: int) -> LlamaShape:
    """A TP rank's share: its parameters, vocabulary shard and heads (TP's collectives not priced)."""
    if tp == 1:
        return shape
    return replace(shape, name=f"{shape.name} / TP {tp}", params=shape.params / tp, heads=shape.heads // tp,
                   kv_heads=max(1, shape.kv_heads // tp), vocab=shape.vocab // tp)  # fmt: skip


def job_step(model, name: str, seed: int) -> dict:
    shape, tp, cp, dp, ep, pp, m, stage_layers = JOBS[name]
    rank_shape = per_tp_rank(shape, tp)
    step_model = StepModel(model, rank_shape, cp, dp, MeshAssumptions(), ep=ep)
    windows = stream_windows("wlbllm", CONTEXT, m, seed)
    share = stage_layers / shape.n_layers
    parts = [step_model.window_ms("flashcp", lens) for lens in windows]
    microbatch = sum(sum(p) for p in parts) / len(parts) * share
    send = p2p_ms(CONTEXT // cp, shape.dim, tp=tp, sequence_parallel=tp > 1, across_nodes=True)
    step = pipeline_step("1F1B", pp, m, microbatch, send)
    dense, attention, recompute = (sum(p[i] for p in parts) / len(parts) * share for i in range(3))
    return {
        "job": name, "model": shape.name, "pp": pp, "tp": tp, "cp": cp, "dp_shard": dp, "ep": ep,
        "gpus": pp * tp * cp * dp, "schedule": "1F1B", "microbatches": m, "stage_layers": stage_layers,
        "microbatch_ms": microbatch, "microbatch_dense_ms": dense, "microbatch_attention_ms": attention,
        "microbatch_recompute_ms": recompute, "send_ms": send, **{f"step_{k}_ms": v for k, v in asdict(step).items()
                                                                     if k != "bubble_fraction"},
        "bubble_fraction": step.bubble_fraction, "bubble_share_of_step": step.bubble / step.total,
        "fsdp_once_per_step_ms": step_model.fsdp_ms() * share,
        "tokens_per_s_per_gpu": m * CONTEXT * dp / (step.total / 1e3) / (pp * tp * cp * dp),
    }  # fmt: skip


def markdown(rows: list[dict]) -> str:
    head = ("| job | GPUs (PP x TP x CP x FSDP, EP) | microbatch ms (one rank's stage) | send ms | step s | "
            "bubble s (fraction) | sends s | tokens/s/GPU |")  # fmt: skip
    lines = ["MODELLED, not measured (benchmarks/step_model_pipeline.py).", "", head, "|" + "---|" * 8]
    for r in rows:
        lines.append(
            f"| {r['job']} | {r['gpus']} ({r['pp']} x {r['tp']} x {r['cp']} x {r['dp_shard']}, EP {r['ep']}) | "
            f"{r['microbatch_ms']:.0f} | {r['send_ms']:.2f} | {r['step_total_ms'] / 1e3:.1f} | "
            f"{r['step_bubble_ms'] / 1e3:.1f} ({r['bubble_fraction']:.2f}) | {r['step_p2p_ms'] / 1e3:.2f} | "
            f"{r['tokens_per_s_per_gpu']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profiles", nargs="+", type=Path, default=[SHARED_PROFILES])
    p.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args(argv)
    try:
        flat, _ = load_cost_model(args.profiles, args.profiles)
    except (OSError, ProfileError) as e:
        p.error(f"cannot load the attention model's calibration: {e}")
    model = multinode_model(flat, Fabric())
    rows = [job_step(model, name, args.seed) for name in JOBS]
    payload = {"modelled": "MODELLED, not measured: flashcp.costmodel.step and .pipeline", "rows": rows}
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "step_model_pipeline.json").write_text(json.dumps(payload, indent=1) + "\n")
    text = markdown(rows)
    (args.results / "step_model_pipeline.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
