"""Predicted training-step time of Llama 3 on a DP x CP mesh, per CP system (MODELLED, not measured).

    python benchmarks/step_model.py [--models 8b 70b 30b-a3b dsv3-16b ...] [--ep 8] [--contexts 131072 524288] [--dp 1 8 64]
                                    [--datasets wlbllm pile] [--cp 8] [--steps S] [--seed X]
                                    [--dense-tflops T] [--inter-node-gbps B] [--no-ac]
                                    [--no-paper-ratio] [--ratio-windows W] [--json]
    python benchmarks/step_model.py validate [the same calibration options]

Models: Llama 3 8B / 70B (the default), Qwen3-30B-A3B, and the MLA models of TorchTitan's
deepseek_v3 flavors (`dsv3-16b`, `dsv3-671b`: every system exchanging latent rows, as
`flashcp.attention.latent` does; `dsv3-16b-kv`, `dsv3-671b-kv`: the same models exchanging K/V).

Each step is stream packing's next dp x C tokens of documents drawn from the length distribution
(`prolong`: benchmarks/balance.py's ProLong-like mix), the last one carried into the next step:
the tokens one optimizer step trains (one window per DP group). The data ends after S steps'
tokens, as data without looping does, so every layout trains exactly the same documents in S
steps (the default balance's first steps fill its queue, its last ones flush it), each system in
three layouts, so that what the CP system adds and what balance adds are separate figures:
  llama3    Llama3 CP (per-sequence plan, full KV all-gather)
  per_doc   Per-Doc CP (every document split over the ranks, full all-gather)
  flashcp   FlashCP (Algorithm 1, compact all-gather)
  +mesh     the same documents, the stream's pieces moved between the DP groups' windows (`[data]
            balance = "mesh"`): the same tokens and, but for a few short pieces cut at a window's
            end, the same attended pairs
  +default  the trainer's default balance (`deferral-cut`, delay <= 8 steps): long documents wait
            for company, the rest cut to 1.05 x the mean; the attended pairs its windows keep vs
            stream packing's are reported (`default_attention_pairs_kept`)
Balance is data order, so any CP system can use either. The model is `flashcp.costmodel.step`:
dense GEMMs at TorchTitan's published 33 % MFU (one number, `flashcp.costmodel.proxy.DENSE_MFU`,
which the balancer's cost uses too), full activation checkpointing's recompute (the shipped
configs), the attention-layer model calibrated from the shared H100 FlashAttention profile and
H200 nccl-tests tables (or --kernel / --collectives), each system's attention scaled to the
paper's measured speedups (`paper_ratio_scales`, evaluated here on the paper's setting with
--ratio-windows windows per dataset; --no-paper-ratio once a GPU check's per-rank timings
calibrate the kernel model), FSDP traffic and the slowest DP group. A CP group larger than a
node (--cp > 8) is priced by `flashcp.costmodel.fabric`'s many-node model (NVLink inside a node,
the inter-node fabric between) with the layer model's own times, as step_model_multinode.py does
(the paper's ratios calibrate one node).
Results: benchmarks/results/step_model.json.

`validate` prints the model's prediction next to every public measurement it can predict, with
the error of each, whether it is like for like and whether the model was fitted to it: the paper's
attention speedups (layer model alone, and calibrated: fitted), its communication saving, and
TorchTitan's published Llama 3.1 8B throughputs, whose torch.compile and Float8 dense rates are
fitted to its Table 1 and every other row held out (results/step_model_validate.json).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from scipy.optimize import brentq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from balance import pairs, sampler, Stream, window_lengths  # noqa: E402
from costmodel import PAPER_SPEEDUP, evaluate as layer_times  # noqa: E402

from flashcp.costmodel import load_cost_model, CostModel, ProfileError  # noqa: E402
from flashcp.costmodel.fabric import multinode_model  # noqa: E402
from flashcp.costmodel.proxy import window_cost  # noqa: E402
from flashcp.costmodel.step import (  # noqa: E402
    LLAMA3_8B,
    LLAMA3_70B,
    MeshAssumptions,
    DEEPSEEK_V3_16B,
    DEEPSEEK_V3_671B,
    QWEN3_30B_A3B,
    StepModel,
    paper_ratio_scales,
)
from flashcp.data.balance import balance_step, stream_windows, WindowCost  # noqa: E402
from flashcp.data.deferral import Deferral  # noqa: E402
from flashcp.data.settings import DataConfig  # noqa: E402

SHARED_PROFILES = ROOT.parent / "shared" / "data" / "gpu_profiles"
MODELS = {"8b": LLAMA3_8B, "70b": LLAMA3_70B, "30b-a3b": QWEN3_30B_A3B, "dsv3-16b": DEEPSEEK_V3_16B,
          "dsv3-671b": DEEPSEEK_V3_671B}  # fmt: skip
# the MLA models again, every system exchanging up-projected K/V rows instead of latent rows
MODELS |= {f"{k}-kv": replace(MODELS[k], name=MODELS[k].name + " K/V", kv_lora_rank=None) for k in ("dsv3-16b", "dsv3-671b")}
SYSTEMS = ("llama3", "per_doc", "flashcp")
PARTS = ("dense", "attention", "recompute", "fsdp_exposed")
LAYOUTS = ("", "+mesh", "+default")  # stream packing, "mesh", the trainer's default balance
PAPER_COMM_CUT = {"wlbllm": 0.236, "pile": 0.345}  # paper Sec. 5.3: FlashCP's comm below Per-Doc CP's, N = 8
# TorchTitan docs/performance.md (torchtitan 9dec370, 2024-12): Llama 3.1 8B on H100s at 500 W, one causal
# sequence per window, tokens/s/GPU. (table, technique, DP, CP, sequence, local batch, full AC, measured)
TORCHTITAN = (
    ("Table 1: FSDP 8, 8K", "eager", 8, 1, 8192, 2, False, 5762.0),
    ("Table 1: FSDP 8, 8K", "compile", 8, 1, 8192, 2, False, 6667.0),
    ("Table 1: FSDP 8, 8K", "compile + Float8", 8, 1, 8192, 2, False, 8532.0),
    ("Table 3: FSDP 128, 8K", "eager", 128, 1, 8192, 2, False, 5605.0),
    ("Table 3: FSDP 128, 8K", "compile", 128, 1, 8192, 2, False, 6514.0),
    ("Table 3: FSDP 128, 8K", "compile + Float8", 128, 1, 8192, 2, False, 8380.0),
    ("Table 2: FSDP 8, CP 1, 32K", "compile + Float8", 8, 1, 32768, 1, True, 3890.0),
    ("Table 2: FSDP 4, CP 2, 64K", "compile + Float8", 4, 2, 65536, 1, True, 2540.0),
    ("Table 2: FSDP 2, CP 4, 128K", "compile + Float8", 2, 4, 131072, 1, True, 1071.0),
    ("Table 2: FSDP 1, CP 8, 256K", "compile + Float8", 1, 8, 262144, 1, True, 548.0),
)
DENSE_FIT_TABLE = "Table 1: FSDP 8, 8K"  # compile's and Float8's dense rates are fitted to this table's rows


def paper_layer_times(attention: CostModel, windows: int, seed: int) -> dict:
    """The layer model on the paper's Fig. 5 setting: 128K, 3 datasets, N in {4, 8}, H in {16, 32}, MHA."""
    args = SimpleNamespace(windows=windows, seed=seed, target_imbalance=1.05, kv_heads=None)
    return {(d, n): layer_times(attention, d, 131072, n, (16, 32), args)
            for d in ("wlbllm", "pile", "redpajama") for n in (4, 8)}  # fmt: skip


def modelled_speedups(times: dict) -> dict[str, float]:
    """FlashCP's speedup over every system, averaged over the paper's configurations (training)."""
    per = [{s: t[s]["training"] / t["flashcp"]["training"] for s in t}
           for r in times.values() for t in r["heads"].values()]  # fmt: skip
    return {s: float(np.mean([p[s] for p in per])) for s in per[0]}


def default_windows(dataset: str, seed: int, context: int, dp: int, steps: int,
                    cost: WindowCost) -> tuple[list[list[list[list[int]]]], float]:  # fmt: skip
    """The trainer's default `[data] balance` (`DataConfig.balance_args`, a deferral mode) on the same
    data as stream packing's `steps` steps, ending there as data without looping ends (the last steps
    flush the queue): windows `[step][dp rank][0]` that train exactly the same documents, and the
    attended pairs they keep vs stream packing of them."""
    balance = DataConfig().balance_args()  # the trainer's own settings of the default
    if balance is None or balance["max_delay"] is None:
        raise SystemExit(f"step_model: the default balance {DataConfig.balance!r} is no deferral mode; "
                         "its column needs one")  # fmt: skip
    stream = Stream(sampler(dataset, seed), steps * dp * context)
    deferral = Deferral(context, dp, balance["max_delay"], cost, balance["target"])
    out, kept = [], 0.0
    while True:
        start = (0, stream.doc, stream.offset)
        step = deferral.next_step(stream.read)
        if step is None:  # the data's end: the queue flushes
            stream.restore(*start)
            step = deferral.final_step(stream.read)
            if step is None:
                break
        if step.cursor is not None:
            stream.restore(*step.cursor)
        out.append(window_lengths(deferral.layout(step, dp, 1, balance["cut_target"])))
        kept += pairs([n for rank in out[-1] for w in rank for n in w])
    if len(out) != steps:
        raise RuntimeError(f"the default balance made {len(out)} steps of {steps} steps' tokens")
    return out, kept / pairs([n for w in stream_windows(stream.lens.tolist(), context) for n in w])


def evaluate(model: StepModel, doc_lens_per_step: list[list[int]], context: int,
             default: list[list[list[list[int]]]], cost: WindowCost) -> dict:  # fmt: skip
    """Every system on stream packing's windows of each step, on the same documents moved by "mesh"
    (balanced by `cost`) and on `default`: the trainer's default balance of the same data
    (`default_windows`)."""
    names = [f"{s}{layout}" for s in SYSTEMS for layout in LAYOUTS]
    totals, spread, kept = {n: [] for n in names}, {n: [] for n in names}, []
    parts = {n: np.zeros(4) for n in names}
    for i, lens in enumerate(doc_lens_per_step):
        stream = [[w] for w in stream_windows(lens, context)]
        placed = balance_step([n for w in stream for n in w[0]], model.dp, 1, context, cost, None)
        mesh = [[[p.length for p in w] for w in rank] for rank in placed]
        kept.append(pairs([n for rank in mesh for w in rank for n in w]) / pairs([n for w in stream for n in w[0]]))
        windows = {"": stream, "+mesh": mesh, "+default": default[i]}
        for name in names:
            system, plus, layout = name.partition("+")
            result = model.step(system, windows[plus + layout])
            totals[name].append(result.total)
            spread[name].append(float(np.mean(result.group_spread)))
            parts[name] += (result.dense, result.attention, result.recompute, result.fsdp_exposed)
    n = len(doc_lens_per_step)
    step_s = {s: float(np.mean(v)) / 1e3 for s, v in totals.items()}
    return {
        "step_s": step_s,
        "tokens_per_s_per_gpu": {s: context / model.cp / t for s, t in step_s.items()},
        "speedup_vs_llama3": {s: step_s["llama3"] / t for s, t in step_s.items()},
        "dp_group_max_over_mean": {s: float(np.mean(v)) for s, v in spread.items()},
        "breakdown_s": {s: dict(zip(PARTS, (p / n / 1e3).tolist()))
                        for s, p in parts.items()},  # fmt: skip
        "mesh_attention_pairs_kept": float(np.mean(kept)),
    }


def throughput(system: str, attention: CostModel, assume: MeshAssumptions, dp: int, cp: int,
               seq: int, batch: int, full_ac: bool) -> float:  # fmt: skip
    """Predicted Llama 3 8B tokens/s/GPU of `batch` causal sequences of `seq` tokens per DP group."""
    step = StepModel(attention, LLAMA3_8B, cp, dp, replace(assume, full_ac=full_ac))
    ms = step.step(system, [[[seq] * batch]] * dp).total
    return batch * seq / cp / (ms / 1e3)


def dense_rates(attention: CostModel, assume: MeshAssumptions) -> dict[str, float]:
    """Dense TFLOP/s per TorchTitan technique: eager is the model's published MFU; torch.compile's and
    Float8's are the rates at which the model reproduces their rows of `DENSE_FIT_TABLE` (attention,
    FSDP and the rest as modelled), so every other row using them is a held-out prediction."""
    def miss(tflops: float, dp: int, cp: int, seq: int, batch: int, full_ac: bool, tps: float) -> float:
        return throughput("llama3", attention, replace(assume, dense_tflops=tflops), dp, cp, seq, batch, full_ac) - tps

    rates = {"eager": assume.dense_tflops}
    for what, technique, *row in TORCHTITAN:
        if what == DENSE_FIT_TABLE and technique not in rates:
            rates[technique] = brentq(miss, 10.0, 10_000.0, args=tuple(row))
    return rates


def validate(attention: CostModel, assume: MeshAssumptions, times: dict, raw: dict[str, float]) -> list[dict]:
    """Every public measurement the model predicts: what, measured, predicted, error and a note saying
    whether the row is like for like and whether the model was fitted to it (then it tests nothing)."""
    rows = []
    for base, label in (("llama3", "Llama3 CP"), ("per_doc", "Per-Doc CP"), ("ring", "Ring-Attn"),
                        ("zigzag", "Ring-Attn (Zigzag)")):  # fmt: skip
        rows.append({"what": f"paper Fig. 5: FlashCP / {label}, layer model alone",
                     "measured": PAPER_SPEEDUP[base], "predicted": raw[base],
                     "note": "like for like (avg of 12 configs, training)"})  # fmt: skip
        scale = assume.attention_scale
        rows.append({"what": f"paper Fig. 5: FlashCP / {label}, calibrated", "measured": PAPER_SPEEDUP[base],
                     "predicted": raw[base] * scale.get(base, 1.0) / scale.get("flashcp", 1.0),
                     "note": "fitted to this row (no test)" if base in scale else "held out"})  # fmt: skip
    for d, cut in PAPER_COMM_CUT.items():
        t = times[(d, 8)]["heads"]["32"]
        comm = {s: t[s]["comm_fwd"] + t[s]["comm_bwd"] for s in ("flashcp", "per_doc")}
        rows.append({"what": f"paper Sec. 5.3: FlashCP comm below Per-Doc CP, {d}, N = 8",
                     "measured": cut, "predicted": 1 - comm["flashcp"] / comm["per_doc"],
                     "note": "layer model alone; paper's H not stated (H = 32 here)"})  # fmt: skip
    rates = dense_rates(attention, assume)
    for what, technique, dp, cp, seq, batch, full_ac, tps in TORCHTITAN:
        fitted = what == DENSE_FIT_TABLE and technique != "eager"
        at = replace(assume, dense_tflops=rates[technique])
        note = f"{technique}: dense at {rates[technique]:.0f} TFLOP/s; " + (
            "fitted to this row (no test)" if fitted else
            "partly circular: the 33 % MFU was published with this table" if what == DENSE_FIT_TABLE else "held out")
        note += "" if full_ac else "; selective op AC modelled as none"
        # PyTorch's context_parallel (head-tail load balance, KV all-gathered by default, then one blockwise
        # kernel per rotation and partial-result merges): its kernels as zigzag ring attention's, its
        # KV exchange as Llama3 CP's.
        for system in ("zigzag", "llama3") if cp > 1 else ("llama3",):
            rows.append({"what": f"TorchTitan {what}, {technique}" + (f", as {system}" if cp > 1 else ""),
                         "measured": tps, "note": note,
                         "predicted": throughput(system, attention, at, dp, cp, seq, batch, full_ac)})
    for r in rows:
        r["error"] = r["predicted"] / r["measured"] - 1.0
    return rows


def main(argv: list[str] | None = None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    command, options = (given[0], given[1:]) if given[:1] == ["validate"] else ("table", given)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=["8b", "70b"])
    p.add_argument("--ep", type=int, default=8, help="expert-parallel ranks of a mixture of experts (30b-a3b)")
    p.add_argument("--contexts", nargs="+", type=int, default=[131072, 524288])
    p.add_argument("--dp", nargs="+", type=int, default=[1, 8, 64])
    p.add_argument("--datasets", nargs="+", default=["wlbllm", "pile"])
    p.add_argument("--cp", type=int, default=8)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dense-tflops", type=float, default=MeshAssumptions.dense_tflops)
    p.add_argument("--inter-node-gbps", type=float, default=MeshAssumptions.inter_node_busbw_gbps)
    p.add_argument("--no-ac", action="store_true", help="no activation checkpointing (no recompute)")
    p.add_argument("--no-paper-ratio", action="store_true", help="the layer model's attention times unscaled")
    p.add_argument("--ratio-windows", type=int, default=30, help="windows per dataset of the paper's setting")
    p.add_argument("--kernel", nargs="+", type=Path, default=[SHARED_PROFILES])
    p.add_argument("--collectives", nargs="+", type=Path, default=[SHARED_PROFILES])
    p.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")
    args = p.parse_args(options)
    try:
        attention, _ = load_cost_model(args.collectives, args.kernel)
    except (OSError, ProfileError) as e:
        p.error(f"cannot load the attention model's calibration: {e}")
    times = paper_layer_times(attention, args.ratio_windows, args.seed)
    raw = modelled_speedups(times)
    scales = {} if args.no_paper_ratio else paper_ratio_scales(raw, PAPER_SPEEDUP)
    if args.cp > MeshAssumptions.gpus_per_node:  # across nodes: the paper's ratios calibrate one node only
        attention, scales = multinode_model(attention), {}
    assume = MeshAssumptions(dense_tflops=args.dense_tflops, full_ac=not args.no_ac, attention_scale=scales,
                             inter_node_busbw_gbps=args.inter_node_gbps)  # fmt: skip
    payload = {
        "command": "python benchmarks/step_model.py " + " ".join(given),
        "modelled": "predictions are modelled (flashcp.costmodel.step); only 'measured' values are measured",
        "assumptions": {**asdict(assume), "attention_scale": dict(scales)},
        "calibration": {"kernel": [str(k) for k in args.kernel],
                        "collectives": [str(c) for c in args.collectives],
                        "paper_ratio_windows": args.ratio_windows, "layer_model_speedups": raw},  # fmt: skip
    }
    if command == "validate":
        payload["rows"] = validate(attention, assume, times, raw)
        print(f"{'measurement':68s} {'measured':>9s} {'predicted':>9s} {'error':>7s}  note")
        for r in payload["rows"]:
            print(f"{r['what']:68s} {r['measured']:9.3f} {r['predicted']:9.3f} {100 * r['error']:+6.1f}%  "
                  + r["note"])
        name = "step_model_validate.json"
    else:
        payload["runs"] = table(args, attention, assume)
        name = "step_model.json"
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / name).write_text(json.dumps(payload, indent=1) + "\n")
    if args.json:
        print(json.dumps(payload))
    return 0


def table(args: argparse.Namespace, attention: CostModel, assume: MeshAssumptions) -> list[dict]:
    """Every (dataset, context, DP, model) setting of the options; one line of speedups each on stderr."""
    runs = []
    for dataset in args.datasets:
        for context in args.contexts:
            for dp in args.dp:
                stream = Stream(sampler(dataset, args.seed), args.steps * dp * context)
                lens = [stream.step(dp * context)[0] for _ in range(args.steps)]
                plans: dict = {}  # plans depend on the windows only: shared by the models
                for name in args.models:
                    ep = args.ep if MODELS[name].experts else 1
                    model = StepModel(attention, MODELS[name], args.cp, dp, assume, plans, ep=ep)
                    m = model.model
                    cost = window_cost(m.dense_flops_per_token, 12.0 * m.heads * m.head_dim * m.n_layers, args.cp,
                                       assume.full_ac)  # fmt: skip
                    default, default_kept = default_windows(dataset, args.seed, context, dp, args.steps, cost)
                    out = evaluate(model, lens, context, default, cost)
                    out["default_attention_pairs_kept"] = default_kept
                    out["setting"] = {"model": MODELS[name].name, "dataset": dataset, "context": context,
                                      "dp": dp, "cp": args.cp, "steps": args.steps, "seed": args.seed,
                                      "default_balance": f"{DataConfig.balance}, max_delay_steps {DataConfig.max_delay_steps}"}  # fmt: skip
                    runs.append(out)
                    speed = "  ".join(f"{s} {v:.2f}x" for s, v in out["speedup_vs_llama3"].items() if s != "llama3")
                    print(f"{MODELS[name].name:12s} {dataset:7s} C={context // 1024}K DP={dp:<3d} Llama3 CP "
                          f"{out['step_s']['llama3']:7.2f} s/step  {speed}", file=sys.stderr, flush=True)  # fmt: skip
    return runs


if __name__ == "__main__":
    sys.exit(main())
