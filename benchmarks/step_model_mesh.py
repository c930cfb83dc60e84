"""Predicted step time of the mesh scope (one plan over all DP x CP ranks) beside per-group planning (MODELLED).

    python benchmarks/step_model_mesh.py [--models 8b 70b] [--contexts 131072 524288 1048576] [--dp 8 64]
                                         [--datasets wlbllm pile] [--cp 8] [--steps S] [--seeds X ...] [--json]

Each step is stream packing's next dp x C tokens, as in step_model.py (the same stream, calibration and
`StepModel`: dense at the published MFU, full activation checkpointing, FSDP, the paper-calibrated attention
layer), priced for:
  llama3, per_doc   Llama3 CP / Per-Doc CP on stream packing's windows (per CP group)
  flashcp+mesh      per-group FlashCP, the stream's pieces moved between the DP groups' windows
  flashcp+default   per-group FlashCP on the trainer's default balance (`deferral-cut`) of the same data
  mesh_scope        `flashcp.plan.mesh.plan_mesh` on each step's dp x C tokens (documents longer than C as
                    C-long pieces, as balance.py plans them) over all dp x cp ranks, 8 a node; flat needed exchange
  mesh_scope_two_level  the same plans, the two-level exchange (`[flashcp] comm = "two_level"`)
The mesh scope's attention layer is a collective system's over the whole mesh: every rank's kernels
(`CostModel.rank_attention_ms`) and KV copies as FlashCP's, the exchange's rows from
`flashcp.plan.nodes.node_traffic`: the busiest rank's NVLink rows at the measured 8-rank all-to-all rate and
its NIC rows at the inter-node bandwidth step_model.py uses for FSDP (`MeshAssumptions.inter_node_busbw_gbps`,
ASSUMED 40 GB/s); flat (one all-to-all-v, PXN: a NIC carries what its node owes its rail) the two concurrent
(the slower counts), two-level stage 1 (fabric, once per node) then stage 2 (NVLink); forward and backward
alike, then the slowest rank's kernel: every rank waits for the mesh's slowest each layer. FlashCP's
paper-ratio scale applies to it as to per-group FlashCP. Printed per setting: s/step of each, attended
pairs kept vs stream packing (the mesh scope and the default change what is attended), the mesh scope's
two-level layer (busiest rank's NIC and NVLink MiB, exchange and forward kernel ms), and the fastest FlashCP
layout, outright and per attended pair (s/step over pairs kept), and the two-level mesh scope's step at the
default's pairs (its attention time, exchange included, scaled by the pairs: a linear estimate).
Results: benchmarks/results/step_model_mesh.json (the printed table: step_model_mesh.txt).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from functools import lru_cache
from itertools import product
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from balance import pairs, sampler, Stream, window_pieces  # noqa: E402
from costmodel import PAPER_SPEEDUP  # noqa: E402
from step_model import default_windows, evaluate, MODELS, modelled_speedups, paper_layer_times  # noqa: E402

from flashcp.costmodel import load_cost_model, StepTime  # noqa: E402
from flashcp.costmodel.model import key_rows  # noqa: E402
from flashcp.costmodel.proxy import FULL_AC_DENSE, window_cost  # noqa: E402
from flashcp.costmodel.step import MeshAssumptions, paper_ratio_scales, StepModel  # noqa: E402
from flashcp.data.balance import stream_windows  # noqa: E402
from flashcp.plan import Plan  # noqa: E402
from flashcp.plan.mesh import plan_mesh  # noqa: E402
from flashcp.plan.nodes import node_traffic  # noqa: E402

SHARED_PROFILES = ROOT.parent / "shared" / "data" / "gpu_profiles"
PER_GROUP = ("llama3", "per_doc", "flashcp+mesh", "flashcp+default")
MESH = ("mesh_scope", "mesh_scope_two_level")  # the flat needed exchange, the two-level one
RANKS_PER_NODE = 8
MESH_TARGET = 1.02  # balance.py's


def _short(dataset: str) -> str:
    """A distribution's name, or a lengths file's file name."""
    return dataset if "/" not in dataset else Path(dataset).name


def mesh_layer(step: StepModel, plan: Plan, two_level: bool) -> tuple[StepTime, dict[str, float]]:
    """One attention layer of the mesh-wide plan (the module docstring) and its exchange's figures."""
    cost, shape, g = step.attention, step.model.attention, RANKS_PER_NODE
    row = shape.exchange_row_bytes
    fwd, bwd = cost.rank_attention_ms(plan, shape)
    t = node_traffic(plan, g)
    if two_level:  # stage 1 over the fabric, then stage 2 over NVLink
        nic = max(max(t.stage1_send), max(t.stage1_recv)) * row
        nvlink = max(max(t.stage2_send), max(t.stage2_recv)) * row
    else:
        nic = max(max(t.flat_inter_send), max(t.flat_inter_recv)) * row
        nvlink = max(max(t.flat_intra_send), max(t.flat_intra_recv)) * row
    fabric = nic / (step.assume.inter_node_busbw_gbps * 1e9) * 1e3
    local = cost.comm.all_to_all_ms(nvlink, g) if nvlink else 0.0
    comm = fabric + local if two_level else max(fabric, local)
    send, tokens = plan.send_tokens(), plan.tokens_per_rank
    copy = [cost.memory.ms(2 * row * (tokens + send[r] + sum(key_rows(s)))) for r, s in enumerate(plan.ranks)]
    r_f = int(np.argmax(np.add(fwd, copy)))
    r_b = int(np.argmax(np.add(bwd, [c * cost.memory.bwd_copy_ratio for c in copy])))
    layer = StepTime(comm, comm, fwd[r_f], bwd[r_b], copy[r_f], copy[r_b] * cost.memory.bwd_copy_ratio)
    return layer, {"nic_mib": nic / 2**20, "nvlink_mib": nvlink / 2**20, "exchange_ms": comm,
                   "kernel_fwd_ms": fwd[r_f] + copy[r_f]}  # fmt: skip


def mesh_step_ms(step: StepModel, plan: Plan, two_level: bool) -> tuple[float, dict[str, float]]:
    """The step of one mesh plan: every rank's dense work, the mesh's attention layers (slowest rank), full
    AC's recompute and FSDP beyond the compute; and the layer's exchange figures."""
    tokens, m = plan.tokens_per_rank, step.model
    layer, traffic = mesh_layer(step, plan, two_level)
    scale = step.assume.attention_scale.get("flashcp", 1.0)
    attention = layer.training * scale * m.full_layers
    again = layer.inference * scale * m.full_layers if step.assume.full_ac else 0.0
    dense = step.dense_ms(tokens)
    again += dense * (FULL_AC_DENSE - 1) if step.assume.full_ac else 0.0
    compute = dense + attention + again
    traffic["attention_ms"] = attention + layer.inference * scale * m.full_layers * step.assume.full_ac
    return compute + max(0.0, step.fsdp_ms() - compute), traffic


@lru_cache(maxsize=1)
def mesh_plans(dataset: str, context: int, dp: int, cp: int, steps: int, seed: int
               ) -> tuple[list[list[int]], list[Plan], list[float]]:  # fmt: skip
    """The steps' lengths, their mesh plans and pairs kept vs stream packing: the model does not change them,
    so the grid's models share one planning."""
    stream = Stream(sampler(dataset, seed), steps * dp * context)
    lens = [stream.step(dp * context)[0] for _ in range(steps)]
    plans, kept = [], []
    for batch in lens:
        pieces = window_pieces(batch, context)
        plans.append(plan_mesh(pieces, dp, cp, RANKS_PER_NODE, MESH_TARGET))
        kept.append(pairs(pieces) / pairs([n for w in stream_windows(batch, context) for n in w]))
    return lens, plans, kept


def setting(attention, assume: MeshAssumptions, name: str, dataset: str, context: int, dp: int, cp: int,
            steps: int, seed: int) -> dict:  # fmt: skip
    """Every system on `steps` steps of one setting (see the module docstring)."""
    lens, plans, kept = mesh_plans(dataset, context, dp, cp, steps, seed)
    step = StepModel(attention, MODELS[name], cp, dp, assume)
    m = step.model
    cost = window_cost(m.dense_flops_per_token, 12.0 * m.heads * m.head_dim * m.n_layers, cp, assume.full_ac)
    default, default_kept = default_windows(dataset, seed, context, dp, steps, cost)
    group = evaluate(step, lens, context, default, cost)
    mesh_ms, traffic = {s: [] for s in MESH}, {s: [] for s in MESH}
    for plan in plans:
        for system in MESH:
            ms, t = mesh_step_ms(step, plan, system.endswith("two_level"))
            mesh_ms[system].append(ms)
            traffic[system].append(t)
    imbalance = [plan.metrics()["imbalance"] for plan in plans]
    step_s = {s: group["step_s"][s] for s in PER_GROUP} | {s: float(np.mean(v)) / 1e3 for s, v in mesh_ms.items()}
    pairs_kept = {"llama3": 1.0, "per_doc": 1.0, "flashcp+mesh": group["mesh_attention_pairs_kept"],
                  "flashcp+default": default_kept} | {s: float(np.mean(kept)) for s in MESH}  # fmt: skip
    flashcp = ("flashcp+mesh", "flashcp+default", *MESH)
    # attention time taken as proportional to the pairs attended: the mesh scope at the default's pairs
    attention = float(np.mean([t["attention_ms"] for t in traffic[MESH[1]]])) / 1e3
    at_default = step_s[MESH[1]] - attention * (1 - default_kept / pairs_kept[MESH[1]])
    return {
        "setting": {"model": m.name, "dataset": dataset, "context": context, "dp": dp, "cp": cp, "steps": steps,
                    "seed": seed, "ranks_per_node": RANKS_PER_NODE},  # fmt: skip
        "step_s": step_s,
        "pairs_kept": pairs_kept,
        "mesh_pair_imbalance": {"mean": float(np.mean(imbalance)), "max": float(max(imbalance))},
        "mesh_layer": {s: {k: float(np.mean([t[k] for t in v])) for k in v[0]} for s, v in traffic.items()},
        "fastest_flashcp": min(flashcp, key=step_s.__getitem__),
        "fastest_per_pair": min(flashcp, key=lambda s: step_s[s] / pairs_kept[s]),
        "two_level_at_default_pairs_s": at_default,
    }


def save(path: Path, run: dict, assumptions: dict, argv: list[str] | None) -> dict:
    """Merge one setting's run into the results file (the same setting replaced, others kept), after every
    setting: a grid stopped part way keeps what it priced, and grids run one after another add up."""
    old = json.loads(path.read_text()) if path.exists() else {"runs": []}
    runs = [r for r in old["runs"] if r["setting"] != run["setting"]] + [run]
    command = "python benchmarks/step_model_mesh.py " + " ".join(sys.argv[1:] if argv is None else argv)
    commands = [c for c in old.get("commands", [old["command"]] if "command" in old else []) if c != command]
    payload = {"commands": [*commands, command],
               "modelled": "all step times are modelled (flashcp.costmodel.step); planner counts are CPU-computed",
               "assumptions": assumptions, "runs": runs}  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1) + "\n")
    return payload


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", choices=["8b", "70b"], default=["8b", "70b"])
    p.add_argument("--contexts", nargs="+", type=int, default=[131072, 524288, 1048576])
    p.add_argument("--dp", nargs="+", type=int, default=[8, 64])
    p.add_argument("--datasets", nargs="+", default=["wlbllm", "pile"])
    p.add_argument("--cp", type=int, default=8)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--ratio-windows", type=int, default=30, help="windows per dataset of the paper's setting")
    p.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.cp > RANKS_PER_NODE:
        p.error(f"--cp must be <= {RANKS_PER_NODE}: per-group baselines are priced on one node")
    attention, _ = load_cost_model([SHARED_PROFILES], [SHARED_PROFILES])
    scales = paper_ratio_scales(modelled_speedups(paper_layer_times(attention, args.ratio_windows, args.seeds[0])),
                                PAPER_SPEEDUP)  # fmt: skip
    assume = MeshAssumptions(attention_scale=scales)
    print("MODELLED s/step (pairs kept vs stream packing); the mesh scope's two-level layer: busiest rank's NIC / "
          "NVLink MiB, exchange / slowest rank's forward kernel and copies ms")
    for dataset, context, dp, seed, name in product(args.datasets, args.contexts, args.dp, args.seeds, args.models):
        r = setting(attention, assume, name, dataset, context, dp, args.cp, args.steps, seed)
        cols = "  ".join(f"{s} {r['step_s'][s]:7.2f} ({100 * r['pairs_kept'][s]:5.1f} %)" for s in r["step_s"])
        t = r["mesh_layer"]["mesh_scope_two_level"]
        print(f"{r['setting']['model']:11s} {_short(dataset):7s} C={context // 1024}K DP={dp:<2d} seed {seed}  "
              f"{cols}  NIC {t['nic_mib']:6.0f} NVLink {t['nvlink_mib']:6.0f} MiB, exchange {t['exchange_ms']:5.1f} "
              f"/ kernel {t['kernel_fwd_ms']:5.1f} ms  fastest {r['fastest_flashcp']}, per pair "
              f"{r['fastest_per_pair']}; two-level at the default's pairs {r['two_level_at_default_pairs_s']:.2f}",
              flush=True)  # fmt: skip
        payload = save(args.results / "step_model_mesh.json", r, {**asdict(assume), "attention_scale": dict(scales)},
                       argv)  # fmt: skip
    if args.json:
        print(json.dumps(payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
