"""MLA under FlashCP: bytes per layer per rank of the latent exchange vs the K/V exchange, and the
modelled attention layer (MODELLED: planner counts and the cost model, nothing measured).

    python benchmarks/mla_exchange.py          # 128K and 1M, CP 8-64, wlbllm and pile

For Moonlight-16B-A3B (16 heads) and DeepSeek-V3 (128 heads), both kv_lora_rank 512, rope 64,
qk_nope 128, v 128, bf16: FlashCP plans (`flashcp` strategy, target imbalance 1.05) of `--windows`
packed windows per setting; per window the busiest rank's received bytes per layer
(`python -m flashcp.plan --mla ...`'s `latent_metrics`), averaged over windows. K/V rows are
heads x (192 + 128) values, latent rows 576, so the latent exchange is the K/V one's bytes / 8.9
(16 heads) or / 71 (128 heads) in every mode; `x full` is relative to the K/V all-gather of the
same plan (Llama3 / Per-Doc CP).

With the calibration tables (--profiles, default ../shared/data/gpu_profiles as benchmarks/step_model.py), also one
attention layer's modelled forward + backward (ms) on the slowest rank, K/V vs latent exchange,
compact and needed: `flashcp.costmodel` with the kernel at head dim 192 (V padded), the exchange
at each row size, and the latent path's up-projection of its key rows; CP > 8 spans nodes
(`multinode_model`, 8 GPUs a node). Results: benchmarks/results/mla_exchange.{json,md}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.sweep import sweep_parser  # noqa: E402
from flashcp import plan_shards  # noqa: E402
from flashcp.data import length_sampler, pack_windows  # noqa: E402
from flashcp.plan.__main__ import MLA_SHAPES, latent_metrics  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
MODES = ("compact", "needed")


def shapes():
    from flashcp.costmodel import AttentionShape

    out = {}
    for name, (rank, rope, heads, nope, v) in MLA_SHAPES.items():
        kv = AttentionShape(heads=heads, head_dim=nope + rope, v_head_dim=v)
        out[name] = (kv, AttentionShape(heads=heads, head_dim=nope + rope, v_head_dim=v, kv_lora_rank=rank,
                                        rope_dim=rope))  # fmt: skip
    return out


def cost_models(cps: list[int], profiles: Path):
    """{cp: CostModel} from the calibration tables in `profiles`, or None without them."""
    if not profiles.exists():
        return None
    from flashcp.costmodel import load_cost_model
    from flashcp.costmodel.fabric import multinode_model

    model, _ = load_cost_model([profiles], [profiles])
    return {cp: model if cp <= 8 else multinode_model(model) for cp in cps}


def setting(dist: str, context: int, cp: int, windows: int, models) -> dict:
    lens_list = pack_windows(length_sampler(dist, seed=0), context, windows)
    sums: dict[str, float] = {}
    for lens in lens_list:
        plan = plan_shards(lens, cp, "flashcp")
        for name, dims in MLA_SHAPES.items():
            m = latent_metrics(plan, dims)
            kv_per_latent = dims[2] * (dims[3] + dims[1] + dims[4]) / (dims[0] + dims[1])
            values = {"kv_full_mib": m["kv_full_mib"], **{f"latent_{c}_mib": m[f"latent_{c}_mib"] for c in MODES},
                      **{f"latent_{c}_kv_full": m[f"latent_{c}_kv_full"] for c in MODES},
                      **{f"kv_{c}_mib": m[f"latent_{c}_mib"] * kv_per_latent for c in MODES}}  # fmt: skip
            if models:
                kv, latent = shapes()[name]
                for c in MODES:
                    a = models[cp].collective_step(plan, c, kv)
                    b = models[cp].collective_step(plan, c, latent)
                    values.update({f"layer_kv_{c}_ms": a.training, f"layer_latent_{c}_ms": b.training,
                                   f"comm_kv_{c}_ms": a.comm_fwd + a.comm_bwd,
                                   f"comm_latent_{c}_ms": b.comm_fwd + b.comm_bwd})  # fmt: skip
            for key, value in values.items():
                sums[f"{name}.{key}"] = sums.get(f"{name}.{key}", 0.0) + value / windows
    return {"dist": dist, "context": context, "cp": cp, "windows": windows, **sums}


def markdown(rows: list[dict], modelled: bool) -> str:
    head = ["window", "CP", "K/V all-gather MiB (M / DS)", "FlashCP K/V compact / needed MiB (M)",
            "(DS)", "latent compact / needed MiB", "latent x K/V full (M)", "(DS)"]  # fmt: skip
    if modelled:
        head += ["layer ms K/V -> latent, compact / needed (M)", "(DS)"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        m, d = (lambda k: r[f"moonlight.{k}"]), (lambda k: r[f"deepseek_v3.{k}"])
        cells = [
            f"{r['dist']} {r['context'] // 1024}K", str(r["cp"]),
            f"{m('kv_full_mib'):,.0f} / {d('kv_full_mib'):,.0f}",
            f"{m('kv_compact_mib'):,.0f} / {m('kv_needed_mib'):,.0f}",
            f"{d('kv_compact_mib'):,.0f} / {d('kv_needed_mib'):,.0f}",
            f"{m('latent_compact_mib'):,.1f} / {m('latent_needed_mib'):,.1f}",
            f"{m('latent_compact_kv_full'):.4f} / {m('latent_needed_kv_full'):.4f}",
            f"{d('latent_compact_kv_full'):.5f} / {d('latent_needed_kv_full'):.5f}",
        ]  # fmt: skip
        if modelled:
            for f in (m, d):
                cells.append(" / ".join(f"{f(f'layer_kv_{c}_ms'):.1f} -> {f(f'layer_latent_{c}_ms'):.1f}" for c in MODES))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = sweep_parser(__doc__.splitlines()[0], windows=5)
    p.add_argument("--out", type=Path, default=RESULTS / "mla_exchange")
    args = p.parse_args(argv)
    models = cost_models(args.cp, args.profiles)
    rows = [setting(dist, c, cp, args.windows, models)
            for dist in args.datasets for c in args.contexts for cp in args.cp]  # fmt: skip
    table = markdown(rows, models is not None)
    args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(table + "\n")
    print(table)
    if models is None:
        print(f"(no modelled layer times: calibration tables not found at {args.profiles})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
