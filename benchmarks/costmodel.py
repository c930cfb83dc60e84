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
with --collectives / --kernel (files or directories; formats in flashcp/costmodel/profiles.py).
`validate --measured T.csv` compares the model with measured per-rank times.

Re-calibrating from a GPU check: `python -m flashcp.gpucheck --out DIR` on a GPU writes
DIR/kernel_calls.csv (every varlen call it timed), then

    python benchmarks/costmodel.py refit --gpucheck DIR

fits the kernel model to those calls and prints the rms / max / mean log error, forward and
forward+backward, over all calls and per section and backend: of the re-fitted model, of fits
that did not see the calls they predict (each section held out, 5-fold), and of the calibration
in use (--kernel, by default the shared per-document profile), so one sees how far that was off.
It writes DIR/costmodel_refit.json. Every figure then runs on the re-fitted kernel model with
`--kernel DIR/kernel_calls.csv` (the same calls, every backend's together, fitted the same way), e.g.
`fig5 --kernel DIR/kernel_calls.csv --results DIR` (--results keeps the shipped figures intact).
DIR may also be a GPU lease's folder (`scripts/gpu_lease.sh OUTDIR`): the check it packed as
OUTDIR/gpucheck.tar.gz is unpacked to OUTDIR/gpucheck/, which then is DIR.

Windows are packed from the named length distributions (flashcp.data); every system sees the
same windows. A speedup is the ratio of mean layer times over the windows (a throughput ratio).
Results go to benchmarks/results/costmodel_<figure>.{json,png} (or --results).
"""

from __future__ import annotations

import argparse
import json
import sys
import tarfile
import time
from collections import Counter
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
from flashcp.costmodel.profiles import (  # noqa: E402
    KernelSample,
    kernel_csv_labels,
    load_collective_tables,
    load_kernel_samples,
)
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


def kernel_paths(args: argparse.Namespace) -> list[Path]:
    """The kernel tables the model is fitted to: --kernel, else the shared H100 per-document profile."""
    return args.kernel or [SHARED_PROFILES]


def load_model(args: argparse.Namespace) -> tuple[CostModel, dict]:
    coll = args.collectives or [SHARED_PROFILES]
    kern = kernel_paths(args)
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
        "kernel": [str(p) for p in kernel_paths(args)],
        "kernel_fwd": k.fwd.__dict__,
        "kernel_bwd": k.bwd.__dict__,
        "peak_fwd_tflops": k.peak_tflops(),
        "memory": model.memory.__dict__,
        "windows": args.windows, "seed": args.seed, "target_imbalance": args.target_imbalance,
        "kv_heads": args.kv_heads or "= heads",
    }


def save(name: str, payload: dict, fig=None, folder: Path = RESULTS) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"costmodel_{name}.json").write_text(json.dumps(payload, indent=1))
    if fig is not None:
        fig.savefig(folder / f"costmodel_{name}.png", dpi=130, bbox_inches="tight")
    print(f"wrote {folder / f'costmodel_{name}'}.json" + (" and .png" if fig is not None else ""))


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
    kernel = "H100 per-doc FA profile"  # the default calibration, else the tables given
    if args.kernel:
        kernel = ", ".join(f"{p.parent.name}/{p.name}" for p in args.kernel)
    comm = "H200 nccl-tests" if args.collectives is None else ", ".join(p.name for p in args.collectives)
    fig.suptitle(f"Modelled CP attention-layer speedup, C={args.context}, 8-GPU NVLink node "
                 f"(kernel: {kernel}; comm: {comm})", fontsize=10)
    payload = {"model": describe(model, args), "speedup_of_flashcp": table, "average": avg, "raw": results}
    save("fig5", payload, fig, args.results)
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
    save("fig6", payload, fig, args.results)
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
    save("fig7", payload, fig, args.results)
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
    save("fig3", payload, fig, args.results)
    return payload


def validate(args: argparse.Namespace) -> dict:
    """How well the model reproduces what it was calibrated from, and what it was not fitted to."""
    model, reports = load_model(args)
    samples = load_kernel_samples(kernel_paths(args), args.profile_heads)
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
        err = held_out(train, test, args.bwd_ratio)["fwd"]
        big = np.array([call_counts(s.q_lens, s.k_lens, s.heads)[0] >= 2048 for s in test])
        row = {**summarise(err), "rms_large": summarise(err[big])["rms"] if big.any() else None}
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
                  f"max {row['max']:.3f} bias {row['bias']:+.3f}")
    else:
        print("\nno --measured per-rank table given: per-rank GPU timings (fwd, fwd+bwd) are still owed "
              "(python -m flashcp.gpucheck --out DIR, then refit --gpucheck DIR)")
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
    save("validate", out, fig, args.results)
    return out


def log_errors(k: KernelModel, measured: list[KernelSample]) -> dict[str, np.ndarray]:
    """log(predicted / measured) per call: forward, and forward+backward for the calls that timed it."""
    fwd = [k.forward_ms(s.q_lens, s.k_lens, s.heads, True, s.head_dim) for s in measured]
    both = [(f + k.backward_ms(s.q_lens, s.k_lens, s.heads, True, s.head_dim)) / s.fwd_bwd_ms
            for f, s in zip(fwd, measured) if s.fwd_bwd_ms is not None]
    measured_fwd = np.array([s.fwd_ms for s in measured])
    return {"fwd": np.log(np.array(fwd) / measured_fwd), "fwd_bwd": np.log(np.array(both))}


def summarise(err: np.ndarray) -> dict:
    """rms, largest and mean log error: the typical miss, the worst call, and a calibration that is
    off as a whole (another GPU, another kernel)."""
    return {"n": int(err.size), "rms": float(np.sqrt(np.mean(err**2))), "max": float(np.abs(err).max()),
            "bias": float(err.mean())}


def compare_measured(k: KernelModel, measured: list[KernelSample]) -> dict[str, dict]:
    """Log errors of a kernel model against measured per-rank calls, forward and forward+backward."""
    return {key: summarise(e) for key, e in log_errors(k, measured).items() if e.size}


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
    save("sensitivity", {"model": describe(base, args), "speedup_of_flashcp": out}, folder=args.results)
    return out


def with_memory(model: CostModel, **changes) -> CostModel:
    return CostModel(model.kernel, model.comm, replace(model.memory, **changes))


def replace_kernel(model: CostModel, cta: float) -> CostModel:
    """The model with per-block costs scaled by `cta` (tile costs unchanged)."""
    k = model.kernel
    fwd = replace(k.fwd, cta_ms=k.fwd.cta_ms * cta)
    bwd = replace(k.bwd, cta_ms=k.bwd.cta_ms * cta)
    return CostModel(replace(k, fwd=fwd, bwd=bwd), model.comm, model.memory)


# --- re-fitting to a GPU check's timed calls -------------------------------------------------

GPUCHECK_LABELS = ("section", "backend")  # kernel_calls.csv columns the residuals are grouped by
FOLDS = 5


def gpucheck_folder(folder: Path) -> Path:
    """The GPU check's own folder: `folder` itself, or in a GPU lease's folder (scripts/gpu_lease.sh)
    the check it packed as gpucheck.tar.gz, unpacked beside it the first time."""
    packed, unpacked = folder / "gpucheck.tar.gz", folder / "gpucheck"
    if (folder / "kernel_calls.csv").is_file() or not (packed.is_file() or unpacked.is_dir()):
        return folder
    if not unpacked.is_dir():
        with tarfile.open(packed) as tar:
            tar.extractall(folder, filter="data")
    return unpacked


def load_gpucheck(folder: Path, profile_heads: int) -> tuple[Path, list[KernelSample], list[dict], dict]:
    """kernel_calls.csv of a gpucheck --out folder (its calls and their section / backend) and its
    env.json; read as `--kernel` reads it, so the figures fit the very samples refit reports on."""
    table = folder / "kernel_calls.csv"
    if not table.is_file():
        raise ProfileError(f"{table} not found: run python -m flashcp.gpucheck --out {folder} on a GPU first "
                           "(its critical_path and efficiency sections write it)")
    samples = load_kernel_samples([table], profile_heads)
    labels = kernel_csv_labels(table.read_text(), str(table), GPUCHECK_LABELS)
    env_file = folder / "env.json"
    try:
        env = json.loads(env_file.read_text()) if env_file.is_file() else {}
    except json.JSONDecodeError as e:
        raise ProfileError(f"{env_file}: not JSON ({e})") from None
    if not isinstance(env, dict):
        raise ProfileError(f"{env_file}: expected a JSON object, got {type(env).__name__}")
    return table, samples, labels, env


def grouped_residuals(k: KernelModel, samples: list[KernelSample], labels: list[dict]) -> dict[str, dict]:
    """`compare_measured` over all calls and per section and backend: a model can be right on
    average and off for the short-shard sweeps, or for one backend only."""
    out = {"all": compare_measured(k, samples)}
    for col in GPUCHECK_LABELS:
        for value in sorted({lab[col] for lab in labels}):
            mine = [s for s, lab in zip(samples, labels) if lab[col] == value]
            out[f"{col}={value}"] = compare_measured(k, mine)
    return out


def held_out(train: list[KernelSample], test: list[KernelSample], bwd_ratio: float) -> dict[str, np.ndarray]:
    """Log errors on `test` of the kernel model fitted to `train` alone: how it predicts calls it
    has not seen, which is what the figures ask of it."""
    return log_errors(fit_kernel_model(train, bwd_ratio)[0], test)


def cross_validate(samples: list[KernelSample], labels: list[dict], bwd_ratio: float) -> dict[str, dict]:
    """Each section predicted by a fit to the others (e.g. C = 128K rank calls predicting the
    short-shard sweeps), and FOLDS-fold over contiguous blocks of rows, so that the other ranks of
    one plan (near copies of a held-out call) mostly sit in its fold rather than in the fit."""
    sections = sorted({lab["section"] for lab in labels})
    splits = {f"section={sec} held out": [np.array([lab["section"] == sec for lab in labels])]
              for sec in sections if len(sections) > 1}  # fmt: skip
    idx = np.arange(len(samples))
    splits[f"{FOLDS}-fold"] = [np.isin(idx, block) for block in np.array_split(idx, FOLDS)]
    return {name: pooled_held_out(samples, masks, bwd_ratio) for name, masks in splits.items()}


def pooled_held_out(samples: list[KernelSample], masks: list[np.ndarray], bwd_ratio: float) -> dict:
    """Residuals of each mask's calls under a fit to the other calls, pooled over the masks; or why
    no fit was possible (too few or degenerate calls left): said, not guessed around."""
    errs: dict[str, list] = {"fwd": [], "fwd_bwd": []}
    try:
        for held in masks:
            train = [s for s, h in zip(samples, held) if not h]
            for key, e in held_out(train, [s for s, h in zip(samples, held) if h], bwd_ratio).items():
                errs[key].append(e)
    except ProfileError as e:
        return {"skipped": str(e)}
    return {key: summarise(np.concatenate(e)) for key, e in errs.items() if sum(map(len, e))}


def calibration(args: argparse.Namespace) -> tuple[KernelModel | None, str]:
    """The kernel model the figures use without a refit (fitted to --kernel, by default the shared
    H100 per-document profile), or why there is none here."""
    try:
        samples = load_kernel_samples(kernel_paths(args), args.profile_heads)
        return fit_kernel_model(samples, args.bwd_ratio)[0], ""
    except ProfileError as e:
        return None, str(e)


def kernel_summary(k: KernelModel) -> dict:
    return {"fwd": k.fwd.__dict__, "bwd": k.bwd.__dict__, "peak_fwd_tflops": k.peak_tflops()}


def refit(args: argparse.Namespace) -> dict:
    """Re-fit the kernel model to the calls a GPU check timed (`--gpucheck DIR`), and report how
    far the re-fitted model and the calibration the figures use are from those measurements."""
    if args.gpucheck is None:
        raise ProfileError("refit needs --gpucheck DIR (the --out folder of python -m flashcp.gpucheck)")
    args.gpucheck = gpucheck_folder(args.gpucheck)
    table, samples, labels, env = load_gpucheck(args.gpucheck, args.profile_heads)
    try:
        model, _ = fit_kernel_model(samples, args.bwd_ratio)
    except ProfileError as e:
        raise ProfileError(f"{table}: cannot fit the kernel model: {e}") from None
    shipped, why_not = calibration(args)
    out = {
        "table": str(table), "device": env.get("device"), "torch": env.get("torch"), "calls": len(samples),
        "counts": {col: dict(Counter(lab[col] for lab in labels)) for col in GPUCHECK_LABELS},
        "refit": grouped_residuals(model, samples, labels),
        "cross_validation": cross_validate(samples, labels, args.bwd_ratio),
        "calibration": {"kernel": [str(p) for p in kernel_paths(args)]},
        "refit_kernel": kernel_summary(model),
    }  # fmt: skip
    if shipped is None:
        out["calibration"]["skipped"] = why_not
    else:
        out["calibration"]["residuals"] = grouped_residuals(shipped, samples, labels)
        out["calibration_kernel"] = kernel_summary(shipped)
    print_refit(out)
    path = args.gpucheck / "costmodel_refit.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}\nfigures on the re-fitted kernel: "
          f"python benchmarks/costmodel.py fig5 --kernel {table} --results {args.gpucheck}")
    return out


def print_refit(out: dict) -> None:
    """One line per (model, calls) pair: rms / max / bias of the log error, fwd and fwd+bwd."""
    print(f"\nkernel model vs {out['calls']} calls timed on {out['device']} (torch {out['torch']}); "
          "log error = log(predicted / measured)")
    print(f"  {'model':12s} {'calls':34s} {'n':>4s}   fwd: rms    max   bias   fwd+bwd: rms    max   bias")
    cal = out["calibration"]
    rows = [("re-fitted", out["refit"]), ("cross-val", out["cross_validation"]),
            ("calibration", cal.get("residuals", {"all": {"skipped": cal.get("skipped")}}))]  # fmt: skip
    for model, table in rows:
        for calls, res in table.items():
            if "skipped" in res:
                print(f"  {model:12s} {calls:34s} skipped: {res['skipped']}")
                continue
            cells = [f"{r['rms']:6.3f} {r['max']:6.3f} {r['bias']:+6.3f}" if r else f"{'-':>6s}{'':14s}"
                     for r in (res.get("fwd"), res.get("fwd_bwd"))]  # fmt: skip
            print(f"  {model:12s} {calls:34s} {res['fwd']['n']:4d}   {cells[0]}   {'':5s}{cells[1]}")
    models = (("re-fitted", "refit_kernel"), ("calibration", "calibration_kernel"))
    peaks = [f"{name} {out[key]['peak_fwd_tflops']:.3g}" for name, key in models if key in out]
    print("  peak forward TFLOP/s: " + ", ".join(peaks))


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
    p.add_argument("--gpucheck", type=Path, help="refit: the --out folder of python -m flashcp.gpucheck, or a GPU "
                   "lease's OUTDIR (scripts/gpu_lease.sh; its gpucheck.tar.gz is unpacked there)")
    p.add_argument("--results", type=Path, default=RESULTS, help="where the figures' .json / .png go")
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
