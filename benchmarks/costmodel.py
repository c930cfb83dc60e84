"""Cost-model predictions of a CP attention layer on one 8-GPU NVLink node: the paper's Fig. 5-7.

    python benchmarks/costmodel.py fig5        # speedup per dataset x heads x N, C = 128K
    python benchmarks/costmodel.py fig6        # training latency breakdown, N = 8
    python benchmarks/costmodel.py fig7        # speedup across context sizes 64K..128K, wlbllm
    python benchmarks/costmodel.py fig3        # modelled kernel efficiency (whole vs Per-Doc shards)
    python benchmarks/costmodel.py validate    # fit residuals, cross-validation, comm vs tables
    python benchmarks/costmodel.py refit --gpucheck DIR   # re-fit to a GPU check's timed calls
    python benchmarks/costmodel.py sensitivity # headline speedups under perturbed assumptions
    python benchmarks/costmodel.py all

Everything here is MODELLED, not measured: the model (flashcp.costmodel) is calibrated from
measured tables, by default the shared H100 FlashAttention per-document profile and the H200
nccl-tests all-gather / reduce-scatter tables in ../shared/data/gpu_profiles. Pass your own
with --collectives / --kernel (files or directories; formats in flashcp/costmodel/profiles.py),
e.g. a per-rank kernel table measured on a GPU, to re-calibrate: `python -m flashcp.gpucheck --out
DIR` writes DIR/kernel_calls.csv, `refit --gpucheck DIR` reports the re-fitted model's residuals
(overall, per section, each section held out) and the shipped calibration's against it, and
`--kernel DIR/kernel_calls.csv` makes every figure use the re-fitted kernel model. `validate --measured T.csv`
compares the model with measured per-rank times.

Windows are packed from the named length distributions (flashcp.data); every system sees the
same windows. A speedup is the ratio of mean layer times over the windows (a throughput ratio).
Results go to benchmarks/results/costmodel_<figure>.{json,png}.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flashcp import plan_shards  # noqa: E402
from flashcp.costmodel import (  # noqa: E402
    COLLECTIVE_SYSTEMS,
    SYSTEMS,
    AttentionShape,
    CostModel,
    ProfileError,
    load_cost_model,
)
from flashcp.costmodel.kernel import KernelModel, call_counts, fit_kernel_model  # noqa: E402
from flashcp.costmodel.comm import collective_ms  # noqa: E402
from flashcp.costmodel.profiles import load_collective_tables, load_kernel_samples  # noqa: E402
from flashcp.data import length_sampler, pack_windows  # noqa: E402

SHARED_PROFILES = ROOT.parent / "shared" / "data" / "gpu_profiles"
RESULTS = ROOT / "benchmarks" / "results"
DATASETS = ("wlbllm", "pile", "redpajama")
BASELINES = ("llama3", "per_doc", "ring", "zigzag")
FLASHCP = ("flashcp", "flashcp_needed", "flashcp_overlap")  # the default (compact) first
LABELS = {
    "llama3": "Llama3 CP",
    "per_doc": "Per-Doc CP",
    "ring": "Ring-Attn",
    "zigzag": "Ring-Attn (Zigzag)",
    "flashcp": "FlashCP (compact)",
    "flashcp_needed": "FlashCP (needed)",
    "flashcp_overlap": "FlashCP (compact+overlap)",
}
PAPER_SPEEDUP = {"llama3": 1.38, "per_doc": 1.63, "ring": 1.97, "zigzag": 2.14}  # 8xH100, 128K, averages


# --- evaluation ------------------------------------------------------------------------------


def evaluate(model: CostModel, dataset: str, context: int, cp_size: int, heads: tuple[int, ...],
             args: argparse.Namespace) -> dict:
    """Mean layer-time breakdown (ms) of every system over `args.windows` packed windows."""
    windows = pack_windows(length_sampler(dataset, seed=args.seed), context, args.windows)
    strategies = sorted({s for s, _, _ in COLLECTIVE_SYSTEMS.values()})
    sums = {h: {sys_: {} for sys_ in SYSTEMS} for h in heads}
    plan_s = {s: 0.0 for s in strategies}
    for doc_lens in windows:
        plans = {}
        for s in strategies:
            t0 = time.perf_counter()
            plans[s] = plan_shards(doc_lens, cp_size, s, target_imbalance=args.target_imbalance)
            plan_s[s] += time.perf_counter() - t0
        for h in heads:
            shape = AttentionShape(heads=h, kv_heads=args.kv_heads)
            for sys_ in SYSTEMS:
                for key, v in model.step(sys_, shape, plans).as_dict().items():
                    sums[h][sys_][key] = sums[h][sys_].get(key, 0.0) + float(v)
    n = len(windows)
    return {
        "dataset": dataset, "context": context, "cp_size": cp_size, "windows": n,
        "plan_ms": {s: 1e3 * t / n for s, t in plan_s.items()},
        "heads": {str(h): {sys_: {k: v / n for k, v in d.items()} for sys_, d in per.items()}
                  for h, per in sums.items()},
    }


def speedups(result: dict, heads: int, mode: str, over: str = "flashcp") -> dict[str, float]:
    """Every baseline's mean time divided by `over`'s: how much faster `over` is."""
    times = result["heads"][str(heads)]
    return {b: times[b][mode] / times[over][mode] for b in times}


def load_model(args: argparse.Namespace) -> tuple[CostModel, dict]:
    coll = args.collectives or [SHARED_PROFILES]
    kern = args.kernel or [SHARED_PROFILES]
    for p in [*coll, *kern]:
        if not Path(p).exists():
            raise SystemExit(
                f"profile {p} not found: pass measured tables with --collectives and --kernel "
                "(see flashcp/costmodel/profiles.py for the formats)"
            )
    try:
        return load_cost_model(coll, kern, args.profile_heads, args.bwd_ratio)
    except ProfileError as e:
        raise SystemExit(f"bad profile: {e}") from None


def describe(model: CostModel, args: argparse.Namespace) -> dict:
    k = model.kernel
    return {
        "collectives": [str(p) for p in (args.collectives or [SHARED_PROFILES])],
        "kernel": [str(p) for p in (args.kernel or [SHARED_PROFILES])],
        "kernel_fwd": k.fwd.__dict__,
        "kernel_bwd": k.bwd.__dict__,
        "peak_fwd_tflops": k.peak_tflops(),
        "memory": model.memory.__dict__,
        "windows": args.windows, "seed": args.seed, "target_imbalance": args.target_imbalance,
        "kv_heads": args.kv_heads or "= heads",
    }


def save(name: str, payload: dict, fig=None) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"costmodel_{name}.json").write_text(json.dumps(payload, indent=1))
    if fig is not None:
        fig.savefig(RESULTS / f"costmodel_{name}.png", dpi=130, bbox_inches="tight")
    print(f"wrote {RESULTS / f'costmodel_{name}'}.json" + (" and .png" if fig is not None else ""))


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# --- figures ---------------------------------------------------------------------------------


def fig5(args: argparse.Namespace) -> dict:
    model, _ = load_model(args)
    heads, sizes = (16, 32), (4, 8)
    results = [evaluate(model, d, args.context, n, heads, args) for d in DATASETS for n in sizes]
    systems = [*BASELINES, *FLASHCP]
    table = {}
    print(f"\nFig. 5 (modelled): layer time normalised to Llama3 CP, C = {args.context}, "
          f"{args.windows} windows per dataset; speedup of FlashCP (compact) over each baseline")
    for mode in ("inference", "training"):
        print(f"\n{mode}:  dataset    H  N  " + "  ".join(f"{b:>8s}" for b in BASELINES)
              + "   | needed / compact, overlap / compact")
        for r in results:
            for h in heads:
                sp = speedups(r, h, mode)
                table[f"{mode}/{r['dataset']}/H{h}/N{r['cp_size']}"] = sp
                print(f"{'':11s}{r['dataset']:10s} {h:2d} {r['cp_size']:2d}  "
                      + "  ".join(f"{sp[b]:8.2f}" for b in BASELINES)
                      + f"   | {1 / sp['flashcp_needed']:6.2f} {1 / sp['flashcp_overlap']:6.2f}")
    avg = {m: {b: float(np.mean([v[b] for k, v in table.items() if k.startswith(m)])) for b in systems}
           for m in ("inference", "training")}
    avg["all"] = {b: float(np.mean([v[b] for v in table.values()])) for b in systems}
    for m in ("inference", "training", "all"):
        print(f"average {m:9s}: " + ", ".join(f"{LABELS[b]} {avg[m][b]:.2f}x" for b in BASELINES)
              + "   (paper, 8xH100: " + ", ".join(f"{PAPER_SPEEDUP[b]}x" for b in BASELINES) + ")")
    for d in DATASETS:
        plan_ms = {f"N{r['cp_size']}": r["plan_ms"] for r in results if r["dataset"] == d}
        print(f"planning ms per window, {d}: {json.dumps(plan_ms)}")

    plt = _plt()
    fig, axes = plt.subplots(len(DATASETS), 2, figsize=(13, 3.4 * len(DATASETS)), squeeze=False,
                             constrained_layout=True)
    for i, d in enumerate(DATASETS):
        for j, mode in enumerate(("inference", "training")):
            ax = axes[i][j]
            configs = [(h, n) for h in heads for n in sizes]
            x = np.arange(len(configs))
            width = 0.8 / len(systems)
            for s_i, s in enumerate(systems):
                # normalised to Llama3 CP: llama3 time / system time
                cells = [table[f"{mode}/{d}/H{h}/N{n}"] for h, n in configs]
                vals = [c["llama3"] / c[s] for c in cells]
                ax.bar(x + (s_i - len(systems) / 2 + 0.5) * width, vals, width, label=LABELS[s])
            ax.axhline(1.0, color="k", lw=0.6)
            ax.set_xticks(x, [f"H={h}, N={n}" for h, n in configs])
            ax.set_ylabel("speedup vs Llama3 CP")
            ax.set_title(f"{d}: {mode} (modelled)")
    axes[0][0].legend(fontsize=7, ncol=2)
    fig.suptitle(f"Modelled CP attention-layer speedup, C={args.context}, 8-GPU NVLink node "
                 "(kernel: H100 per-doc FA profile; comm: H200 nccl-tests)", fontsize=10)
    payload = {"model": describe(model, args), "speedup_of_flashcp": table, "average": avg, "raw": results}
    save("fig5", payload, fig)
    return payload


def fig6(args: argparse.Namespace) -> dict:
    model, _ = load_model(args)
    h, n = args.heads, 8
    results = {d: evaluate(model, d, args.context, n, (h,), args) for d in ("wlbllm", "pile")}
    parts = [
        ("comm_fwd", "KV all-gather / A2A / exposed P2P"),
        ("comm_bwd", "dKV reduce-scatter / exposed P2P"),
        ("attn", "attention kernels"),
        ("other", "copies / ring merges"),
    ]
    systems = ["llama3", "per_doc", *FLASHCP, "zigzag", "ring"]
    print(f"\nFig. 6 (modelled): training layer-time breakdown (ms), N = {n}, H = {h}, C = {args.context}")
    table = {}
    for d, r in results.items():
        for s in systems:
            t = r["heads"][str(h)][s]
            row = {
                "comm_fwd": t["comm_fwd"], "comm_bwd": t["comm_bwd"], "attn": t["attn_fwd"] + t["attn_bwd"],
                "other": t["other_fwd"] + t["other_bwd"], "total": t["training"],
            }  # fmt: skip
            table[f"{d}/{s}"] = row
            print(f"  {d:8s} {LABELS[s]:20s} " + "  ".join(f"{k} {v:7.2f}" for k, v in row.items()))
        comm = {s: table[f"{d}/{s}"]["comm_fwd"] + table[f"{d}/{s}"]["comm_bwd"] for s in systems}
        print(f"  {d}: FlashCP comm is {100 * (1 - comm['flashcp'] / comm['per_doc']):.1f}% below Per-Doc CP "
              f"(paper: 23.6% wlbllm, 34.5% pile)")
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for ax, d in zip(axes, results):
        bottom = np.zeros(len(systems))
        for key, label in parts:
            vals = np.array([table[f"{d}/{s}"][key] for s in systems])
            ax.bar([LABELS[s] for s in systems], vals, bottom=bottom, label=label)
            bottom += vals
        ax.set_ylabel("ms per attention layer (fwd+bwd)")
        ax.set_title(f"{d}: training breakdown, N={n}, H={h} (modelled)")
        ax.tick_params(axis="x", rotation=30, labelsize=8)
    axes[0].legend(fontsize=8)
    payload = {"model": describe(model, args), "breakdown_ms": table}
    save("fig6", payload, fig)
    return payload


def fig7(args: argparse.Namespace) -> dict:
    model, _ = load_model(args)
    contexts = [65536, 81920, 98304, 114688, 131072]
    h, n = args.heads, 8
    results = {c: evaluate(model, "wlbllm", c, n, (h,), args) for c in contexts}
    table = {m: {c: speedups(results[c], h, m) for c in contexts} for m in ("inference", "training")}
    print(f"\nFig. 7 (modelled): FlashCP speedup across context sizes, wlbllm, N = {n}, H = {h}")
    for m in table:
        print(f"  {m:9s}   C  " + "  ".join(f"{b:>8s}" for b in BASELINES))
        for c in contexts:
            print(f"  {'':9s}{c // 1024:4d}K " + "  ".join(f"{table[m][c][b]:8.2f}" for b in BASELINES))
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for ax, m in zip(axes, table):
        for b in BASELINES:
            ys = [table[m][c][b] for c in contexts]
            ax.plot([c // 1024 for c in contexts], ys, "o-", label=f"over {LABELS[b]}")
        ax.axhline(1.0, color="k", lw=0.6)
        ax.set_xlabel("context window (K tokens)")
        ax.set_ylabel("FlashCP speedup")
        ax.set_title(f"{m} speedup, wlbllm, N={n}, H={h} (modelled)")
    axes[0].legend(fontsize=8)
    payload = {"model": describe(model, args), "speedup_of_flashcp": {m: {str(c): v for c, v in t.items()}
                                                                      for m, t in table.items()}}
    save("fig7", payload, fig)
    return payload


def fig3(args: argparse.Namespace) -> dict:
    """Modelled kernel efficiency: whole documents vs Per-Doc shards on one of N = 8 ranks."""
    model, _ = load_model(args)
    kernel, n, h = model.kernel, 8, args.heads

    def rank_calls(doc_lens):
        """Rank 0's (q, k) shard lists under whole-doc and per-doc sharding of equal-length docs."""
        per_doc = plan_shards(doc_lens, n, "per_doc").ranks[0]
        pd = ([s.length for s in per_doc], [s.start + s.length for s in per_doc])
        if len(doc_lens) >= n:
            per_rank = len(doc_lens) // n
            whole = ([doc_lens[0]] * per_rank, [doc_lens[0]] * per_rank)
        else:  # a document longer than a rank's share cannot stay whole: no whole-doc point
            whole = None
        return whole, pd

    out = {}
    print(f"\nFig. 3 (modelled): rank-0 attention time, N = {n}, H = {h} (fwd / fwd+bwd ms, TFLOP/s fwd)")
    for name, docs in (("1 x 128K", [131072]), ("16 x 8K", [8192] * 16)):
        whole, pd = rank_calls(docs)
        for label, call in (("whole", whole), ("per_doc", pd)):
            if call is None:
                continue
            fwd, bwd = kernel.forward_ms(*call, h), kernel.backward_ms(*call, h)
            flops = 4 * h * 128 * sum(q * (k - q) + q * q / 2 for q, k in zip(*call))
            out[f"{name}/{label}"] = {"fwd_ms": fwd, "fwd_bwd_ms": fwd + bwd, "tflops": flops / fwd / 1e9}
            print(f"  {name:9s} {label:8s} fwd {fwd:7.3f}  fwd+bwd {fwd + bwd:7.3f}  "
                  f"{flops / fwd / 1e9:6.1f} TFLOP/s")
    # Achieved TFLOP/s against shard length: a rank's 16K tokens as whole docs of length s, and
    # as s-token Per-Doc chunks taken from 8 x s documents (prefixes spread over the document).
    lengths = [64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
    curve = {"whole": [], "per_doc_chunk": []}
    for s in lengths:
        count = 16384 // s
        whole = ([s] * count, [s] * count)
        chunks = [(s, (i % (2 * n)) * s + s) for i in range(count)]
        for key, call in (("whole", whole), ("per_doc_chunk", tuple(map(list, zip(*chunks))))):
            fwd = kernel.forward_ms(*call, h)
            flops = 4 * h * 128 * sum(q * (k - q) + q * q / 2 for q, k in zip(*call))
            curve[key].append(flops / fwd / 1e9)
    print("  shard length: " + " ".join(f"{s:>6d}" for s in lengths))
    for key, vals in curve.items():
        print(f"  {key:13s} " + " ".join(f"{v:6.0f}" for v in vals) + "  TFLOP/s (modelled fwd)")
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    names = list(out)
    axes[0].bar(names, [out[k]["fwd_bwd_ms"] for k in names])
    axes[0].set_ylabel("rank-0 attention fwd+bwd (ms)")
    axes[0].set_title(f"whole vs Per-Doc shards, N={n}, H={h} (modelled)")
    for key, vals in curve.items():
        axes[1].semilogx(lengths, vals, "o-", label=key, base=2)
    axes[1].set_xlabel("shard length (tokens)")
    axes[1].set_ylabel("TFLOP/s (fwd)")
    axes[1].set_title("kernel efficiency vs shard length (modelled)")
    axes[1].legend()
    payload = {"model": describe(model, args), "fig3": out, "curve": {"lengths": lengths, **curve}}
    save("fig3", payload, fig)
    return payload


def validate(args: argparse.Namespace) -> dict:
    """How well the model reproduces what it was calibrated from, and what it was not fitted to."""
    model, reports = load_model(args)
    kern_paths = args.kernel or [SHARED_PROFILES]
    samples = load_kernel_samples(kern_paths, args.profile_heads)
    out: dict = {"fit": {}}
    print("\nKernel model fit (log error = log(predicted / measured)):")
    for name, rep in reports.items():
        for min_ctas in (0, 512, 2048):
            s = rep.summary(min_ctas)
            out["fit"][f"{name}/ctas>={min_ctas}"] = s
            print(f"  {name} calls with >= {min_ctas:4d} thread blocks: n={s['n']:3d} rms {s['rms']:.3f} "
                  f"max {s['max']:.3f} bias {s['bias']:+.3f}")
    k = model.kernel
    print(f"  fitted forward: launch {k.fwd.launch_ms * 1e3:.1f} us, per block {k.fwd.cta_ms * 1e6:.1f} ns "
          f"(= {k.fwd.cta_ms / k.fwd.tile_ms:.2f} tiles), per tile {k.fwd.tile_ms * 1e6:.2f} ns "
          f"({k.peak_tflops():.0f} TFLOP/s), half-rate at {k.fwd.half_ctas:.0f} blocks")
    ratio = np.array([round(sum(s.k_lens) / sum(s.q_lens), 2) for s in samples])
    fwd_err = reports["fwd"].log_errors
    print("  bias by keys per query (1.0: whole documents; 4.5: 1/8 Per-Doc shares with long prefixes):")
    out["bias_by_k_over_q"] = {}
    for r in np.unique(ratio):
        e = fwd_err[ratio == r]
        if e.size >= 4:
            out["bias_by_k_over_q"][str(r)] = float(e.mean())
            print(f"    k/q = {r:4.2f}: n={e.size:3d} bias {e.mean():+.3f} rms {np.sqrt(np.mean(e**2)):.3f}")
    # Held-out checks: refit without a group of samples and predict it.
    groups = {
        "short shards with long prefix (cp=8)": lambda s: s.k_lens[0] > s.q_lens[0] * 4,
        "largest documents (q >= 32K)": lambda s: s.q_lens[0] >= 32768,
    }
    out["held_out"] = {}
    for name, held in groups.items():
        train = [s for s in samples if not held(s)]
        test = [s for s in samples if held(s)]
        if len(test) < 2 or len(train) < 8:
            continue
        kern, _ = fit_kernel_model(train)
        err = np.array([np.log(kern.forward_ms(s.q_lens, s.k_lens, s.heads, True, s.head_dim) / s.fwd_ms)
                        for s in test])
        big = np.array([call_counts(s.q_lens, s.k_lens, s.heads)[0] >= 2048 for s in test])
        row = {"n": len(test), "rms": float(np.sqrt(np.mean(err**2))), "bias": float(err.mean()),
               "rms_large": float(np.sqrt(np.mean(err[big] ** 2))) if big.any() else None}
        out["held_out"][name] = row
        large = "" if row["rms_large"] is None else f", calls >= 2048 blocks rms {row['rms_large']:.3f}"
        print(f"  held out {name}: n={row['n']} rms {row['rms']:.3f} bias {row['bias']:+.3f}{large}")
    print("\nCollectives: model time at the measured sizes vs the measured time")
    out["comm"] = {}
    for t in load_collective_tables(args.collectives or [SHARED_PROFILES]):
        pred = np.array([collective_ms(t, s) for s in t.sizes])
        err = float(np.max(np.abs(pred / t.times_ms() - 1)))
        small = collective_ms(t, 1 << 20) * 1e3
        out["comm"][f"{t.op}@{t.n_ranks}"] = {"max_rel_err": err, "us_at_1MiB_extrapolated": small}
        print(f"  {t.op:14s} N={t.n_ranks}: max rel err {err:.2e}; 1 MiB (below the table) -> {small:.1f} us")
    if args.measured:
        measured = load_kernel_samples([args.measured], args.profile_heads)
        out["measured"] = compare_measured(model.kernel, measured)
        for key, row in out["measured"].items():
            print(f"measured per-rank {key} ({args.measured}): n={row['n']} rms {row['rms']:.3f} "
                  f"bias {row['bias']:+.3f}")
    else:
        print("\nno --measured per-rank table given: per-rank GPU timings (fwd, fwd+bwd) are still owed")
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    counts = np.array([k.counts(s.q_lens, s.k_lens, s.heads, True, s.head_dim) for s in samples])
    pred = np.array([k.fwd.time_ms(*c) for c in counts])
    meas = np.array([s.fwd_ms for s in samples])
    sc = ax.scatter(meas, pred, c=np.log2(counts[:, 0]), s=12, cmap="viridis")
    ax.plot([meas.min(), meas.max()], [meas.min(), meas.max()], "k--", lw=0.7)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured forward ms (profile)")
    ax.set_ylabel("modelled forward ms")
    ax.set_title("kernel model vs the per-doc profile")
    fig.colorbar(sc, label="log2 thread blocks")
    save("validate", out, fig)
    return out


def compare_measured(k: KernelModel, measured: list) -> dict[str, dict]:
    """Log errors of a kernel model against measured per-rank calls, forward and forward+backward."""
    fwd = {id(s): k.forward_ms(s.q_lens, s.k_lens, s.heads, True, s.head_dim) for s in measured}
    rows = {"fwd": [np.log(fwd[id(s)] / s.fwd_ms) for s in measured]}
    rows["fwd_bwd"] = [np.log((fwd[id(s)] + k.backward_ms(s.q_lens, s.k_lens, s.heads, True, s.head_dim))
                              / s.fwd_bwd_ms) for s in measured if s.fwd_bwd_ms is not None]
    return {key: {"n": len(e), "rms": float(np.sqrt(np.mean(np.square(e)))), "bias": float(np.mean(e))}
            for key, e in rows.items() if e}


def sensitivity(args: argparse.Namespace) -> dict:
    """Headline training speedups (N = 8, H = 32) when the least certain assumptions move."""
    base, _ = load_model(args)
    fwd = base.kernel.fwd
    variants = {
        "fitted": base,
        "per-block cost x0.25": replace_kernel(base, cta=0.25),
        "per-block cost x0": replace_kernel(base, cta=0.0),
        "bwd/fwd 3.5 (not 2.5)": CostModel(replace(base.kernel, bwd=fwd.scaled(3.5)), base.comm, base.memory),
        "HBM copies 2x faster": with_memory(base, hbm_gbps=2 * base.memory.hbm_gbps),
        "ring merge bytes / 4": with_memory(base, merge_bytes_per_elem=base.memory.merge_bytes_per_elem / 4),
    }
    out = {}
    print(f"\nSensitivity (modelled training speedup of FlashCP, N = 8, H = {args.heads}, "
          f"C = {args.context}):")
    print(f"  {'variant':24s} {'dataset':10s} " + " ".join(f"{b:>8s}" for b in BASELINES))
    for name, model in variants.items():
        for d in DATASETS:
            sp = speedups(evaluate(model, d, args.context, 8, (args.heads,), args), args.heads, "training")
            out[f"{name}/{d}"] = sp
            print(f"  {name:24s} {d:10s} " + " ".join(f"{sp[b]:8.2f}" for b in BASELINES))
    save("sensitivity", {"model": describe(base, args), "speedup_of_flashcp": out})
    return out


def with_memory(model: CostModel, **changes) -> CostModel:
    return CostModel(model.kernel, model.comm, replace(model.memory, **changes))


def replace_kernel(model: CostModel, cta: float) -> CostModel:
    """The model with per-block costs scaled by `cta` (tile costs unchanged)."""
    k = model.kernel
    fwd = replace(k.fwd, cta_ms=k.fwd.cta_ms * cta)
    bwd = replace(k.bwd, cta_ms=k.bwd.cta_ms * cta)
    return CostModel(replace(k, fwd=fwd, bwd=bwd), model.comm, model.memory)


def refit(args: argparse.Namespace) -> dict:
    """Re-fit the kernel model to the calls a GPU check timed (`--gpucheck DIR`), and report how
    far the re-fitted model and the shipped calibration are from those measurements."""
    if args.gpucheck is None:
        raise ProfileError("refit needs --gpucheck DIR (the --out folder of python -m flashcp.gpucheck)")
    table = args.gpucheck / "kernel_calls.csv"
    if not table.is_file():
        raise ProfileError(f"{table} not found: run python -m flashcp.gpucheck --out {args.gpucheck} on a GPU first")
    measured = load_kernel_samples([table], args.profile_heads)
    with table.open() as f:
        sections = [row["section"] for row in csv.DictReader(f)]
    env_file = args.gpucheck / "env.json"
    env = json.loads(env_file.read_text()) if env_file.is_file() else {}
    refitted, _ = fit_kernel_model(measured, args.bwd_ratio)
    try:
        shipped = compare_measured(load_model(args)[0].kernel, measured)
    except ProfileError as e:  # the shipped calibration's tables are not beside this checkout
        print(f"shipped calibration not compared: {e}")
        shipped = {}
    out = {"device": env.get("device"), "torch": env.get("torch"), "calls": len(measured),
           "refit": compare_measured(refitted, measured), "shipped": shipped, "by_section": {}}  # fmt: skip
    for section in sorted(set(sections)):
        mine = [s for s, sec in zip(measured, sections) if sec == section]
        rest = [s for s, sec in zip(measured, sections) if sec != section]
        row = {"refit": compare_measured(refitted, mine)}
        if len(rest) >= 8:  # held out: fitted on the other sections only
            row["held_out"] = compare_measured(fit_kernel_model(rest, args.bwd_ratio)[0], mine)
        out["by_section"][section] = row
    print(f"kernel model vs {len(measured)} calls timed on {out['device']} (log error = log(predicted / measured))")
    for name, res in [("re-fitted", out["refit"]), ("shipped calibration", out["shipped"])] + [
        (f"{sec} ({kind})", res) for sec, row in out["by_section"].items() for kind, res in row.items()
    ]:
        print(f"  {name:36s} " + "  ".join(f"{k}: n={v['n']} rms {v['rms']:.3f} bias {v['bias']:+.3f}"
                                              for k, v in res.items()))  # fmt: skip
    k = refitted
    out["refit_kernel"] = {"fwd": k.fwd.__dict__, "bwd": k.bwd.__dict__, "peak_tflops": k.peak_tflops()}
    path = args.gpucheck / "costmodel_refit.json"
    path.write_text(json.dumps(out, indent=1, default=float) + "\n")
    print(f"wrote {path}")
    return out


COMMANDS = {
    "fig3": fig3, "fig5": fig5, "fig6": fig6, "fig7": fig7, "validate": validate, "sensitivity": sensitivity,
    "refit": refit,
}  # fmt: skip
FIGURES = [name for name in COMMANDS if name != "refit"]  # what "all" runs: refit needs a GPU check's output


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("figure", choices=[*COMMANDS, "all"])
    p.add_argument("--collectives", action="append", type=Path, help="nccl-tests output / CSV (file or dir)")
    p.add_argument("--kernel", action="append", type=Path, help="attention profile / per-rank CSV")
    p.add_argument("--measured", type=Path, help="validate: measured per-rank table to compare against")
    p.add_argument("--gpucheck", type=Path, help="refit: the --out folder of python -m flashcp.gpucheck")
    p.add_argument("--profile-heads", type=int, default=64, help="query heads of the per-doc profile at tp=1")
    p.add_argument("--bwd-ratio", type=float, default=2.5, help="backward / forward cost when unmeasured")
    p.add_argument("--windows", type=int, default=100, help="packed windows per dataset and configuration")
    p.add_argument("--context", type=int, default=131072)
    p.add_argument("--heads", type=int, default=32, help="fig3 / fig6 / fig7 / sensitivity head count")
    p.add_argument("--kv-heads", type=int, help="KV heads (default: = query heads, MHA as in the paper)")
    p.add_argument("--target-imbalance", type=float, default=1.05)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.windows < 1:
        p.error("--windows must be >= 1")
    for name in (FIGURES if args.figure == "all" else [args.figure]):
        t0 = time.perf_counter()
        try:
            COMMANDS[name](args)
        except ProfileError as e:
            sys.exit(f"error: {e}")
        print(f"[{name}: {time.perf_counter() - t0:.1f} s]")


if __name__ == "__main__":
    main()
