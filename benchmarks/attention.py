"""Measured attention time of CP plans: every rank's kernel work, timed on one device.

    python benchmarks/attention.py                      # CPU, small sizes (reference kernel)
    python benchmarks/attention.py --preset paper       # GPU: C = 128K, N in {4, 8}, 16/32 heads

A CP step waits for its slowest rank, so for each packed window and strategy the benchmark builds
every rank's local varlen problem from the plan's dispatch (its shards as queries, document
prefix + shard as keys) and times forward and forward+backward of that rank's single kernel call;
the critical path is the maximum over ranks. Sections:

- kernel: the paper's kernel-efficiency comparison: one C-token document vs 16 documents of C/16,
  cut by Per-Doc and by Whole-Doc sharding (finer shards give the kernel shorter sequences);
- strategies: per N and head count, the mean critical-path time of each planner on the same
  packed windows, with the KV tokens one rank receives per layer under the full all-gather
  (Llama3 / Per-Doc), FlashCP's compact all-gather and the "needed" all-to-all-v;
- gloo (CPU only): the real op on `--gloo-cp` spawned processes: the KV exchange alone and the
  whole op per comm mode, with and without overlapping local-only shards with the collective.
  One GPU cannot host an NCCL CP group, so on a GPU this section is left out with a message.

CPU timings default to one thread per process (`--threads`): on a small shared machine that is
what gives repeatable numbers. Results go to benchmarks/results/attention_<device>.json, plus a
per-rank CSV (heads,head_dim,q_lens,k_lens,fwd_ms,fwd_bwd_ms) that the cost model reads
(`benchmarks/costmodel.py --kernel`) to re-calibrate from these measurements.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flashcp import plan_shards  # noqa: E402
from flashcp.attention import cp_varlen_attention  # noqa: E402
from flashcp.attention.collectives import gather_kv, launch_kv_exchange  # noqa: E402
from flashcp.data import length_sampler, pack_windows  # noqa: E402
from flashcp.dispatch import build_dispatch, COMM_MODES, Dispatch  # noqa: E402
from flashcp.gpucheck.timing import Timer, time_varlen  # noqa: E402
from flashcp.plan import STRATEGIES, Plan  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
PRESETS = {
    # Small enough for the reference kernel on two CPU cores in a few minutes; "pile" rather than
    # "wlbllm" because at C = 2K a WLB-LLM window holds 1-2 documents, a Pile window 3-4.
    "cpu": dict(dist="pile", context=2048, cp=[2, 4], heads=[4], head_dim=32, windows=3, repeats=3,
                dtype="float32"),
    # The paper's configuration: 128K window, bf16, head dim 128.
    "paper": dict(dist="wlbllm", context=131072, cp=[4, 8], heads=[16, 32], head_dim=128, windows=8,
                  repeats=5, dtype="bfloat16"),
}


def time_rank(dispatch: Dispatch, heads: int, kv_heads: int, args, timer: Timer) -> dict:
    """Forward and forward+backward time of one rank's kernel call on random q/k/v."""
    q_lens, k_lens = dispatch.cu_seqlens_q.diff().tolist(), dispatch.cu_seqlens_k.diff().tolist()
    return time_varlen(q_lens, k_lens, heads, kv_heads, args.head_dim, getattr(torch, args.dtype), args.backend, timer)


def run_plan(plan: Plan, heads: int, kv_heads: int, args, timer: Timer, csv_rows: list[str]) -> dict:
    """Per-rank times of a plan, its critical path and its communication volumes."""
    ranks = []
    for rank in range(plan.cp_size):
        dispatch = build_dispatch(plan, rank)
        ranks.append(time_rank(dispatch, heads, kv_heads, args, timer))
        q_lens = " ".join(map(str, dispatch.cu_seqlens_q.diff().tolist()))
        k_lens = " ".join(map(str, dispatch.cu_seqlens_k.diff().tolist()))
        t = ranks[-1]
        csv_rows.append(f"{heads},{args.head_dim},{q_lens},{k_lens},{t['fwd_ms']:.4f},{t['fwd_bwd_ms']:.4f}")
    itemsize = getattr(torch, args.dtype).itemsize
    m = plan.metrics(num_kv_heads=kv_heads, head_dim=args.head_dim, dtype_bytes=itemsize)
    fb = [r["fwd_bwd_ms"] for r in ranks]
    return {
        "critical_fwd_ms": max(r["fwd_ms"] for r in ranks),
        "critical_fwd_bwd_ms": max(fb),
        "sum_fwd_bwd_ms": sum(fb),
        "measured_imbalance": max(fb) / statistics.mean(fb),
        "planned_imbalance": m["imbalance"],
        "num_shards": m["num_shards"],
        **{f"comm_{c}_tokens": m[f"comm_{c}_tokens"] for c in COMM_MODES},
        **{f"comm_{c}_mib": m[f"comm_{c}_bytes"] / 2**20 for c in COMM_MODES},
        "ranks": ranks,
    }


def make_plan(doc_lens: list[int], n: int, strategy: str, args) -> Plan:
    options = {"time_limit": args.ilp_time_limit} if strategy == "ilp" else {}
    return plan_shards(doc_lens, n, strategy, **options)


def kernel_efficiency(args, timer: Timer, csv_rows: list[str]) -> list[dict]:
    """One C-token document vs 16 x C/16 documents, Per-Doc vs Whole-Doc shards."""
    c, n, h = args.context, max(args.cp), args.heads[0]
    inputs = {f"1 x {c}": [c], f"16 x {c // 16}": [c // 16] * 16}
    print(f"\n== Kernel efficiency: N={n}, {h} heads x {args.head_dim}, {args.dtype}, fwd+bwd ms ==")
    print(f"{'input':>14} {'strategy':>10} {'shards':>7} {'critical':>9} {'all ranks':>10}")
    rows = []
    for name, docs in inputs.items():
        for strategy in ("per_doc", "whole_doc"):
            r = run_plan(make_plan(docs, n, strategy, args), h, args.kv_heads or h, args, timer, csv_rows)
            print(f"{name:>14} {strategy:>10} {r['num_shards']:>7} {r['critical_fwd_bwd_ms']:>9.2f} "
                  f"{r['sum_fwd_bwd_ms']:>10.2f}")
            rows.append({"input": name, "strategy": strategy, "cp_size": n, "heads": h, **r})
    return rows


def _mean(rows: list[dict]) -> dict:
    return {k: statistics.mean(r[k] for r in rows) for k in rows[0] if k != "ranks"}


def strategies(args, windows: list[list[int]], timer: Timer, csv_rows: list[str]) -> list[dict]:
    """Mean critical-path time of every strategy on the same packed windows."""
    rows = []
    for n in args.cp:
        for h in args.heads:
            kv = args.kv_heads or h
            print(f"\n== {args.dist}, C={args.context}, N={n}, {h} heads ({kv} kv) x {args.head_dim}, "
                  f"{args.dtype}, {len(windows)} windows: mean per window ==")
            print(f"{'strategy':>10} {'fwd ms':>9} {'fwd+bwd':>9} {'imb meas':>9} {'imb plan':>9} "
                  f"{'full tok':>9} {'compact':>9} {'needed':>9} {'needed<compact':>15}")
            for strategy in args.strategies:
                per_window = [run_plan(make_plan(w, n, strategy, args), h, kv, args, timer, csv_rows)
                              for w in windows]
                mean = _mean(per_window)
                fewer = sum(r["comm_needed_tokens"] < r["comm_compact_tokens"] for r in per_window)
                print(f"{strategy:>10} {mean['critical_fwd_ms']:>9.2f} {mean['critical_fwd_bwd_ms']:>9.2f} "
                      f"{mean['measured_imbalance']:>9.3f} {mean['planned_imbalance']:>9.3f} "
                      f"{mean['comm_full_tokens']:>9.0f} {mean['comm_compact_tokens']:>9.0f} "
                      f"{mean['comm_needed_tokens']:>9.0f} {f'{fewer}/{len(windows)}':>15}")
                rows.append({"dist": args.dist, "cp_size": n, "heads": h, "kv_heads": kv,
                             "strategy": strategy, "mean": mean, "windows": per_window})
    return rows


# --- gloo: the real op on spawned CPU processes ---------------------------------------------


def _gloo_worker(rank: int, n: int, port: int, plans: list[Plan], args, out) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
    timer = Timer(torch.device("cpu"), args.repeats)
    h, kv, dim = args.heads[0], args.kv_heads or args.heads[0], args.head_dim
    dtype = getattr(torch, args.dtype)
    results = []
    for i, plan in enumerate(plans):
        for comm in COMM_MODES:
            d = build_dispatch(plan, rank, comm, overlap=True)
            rows = d.token_index.numel()
            q = torch.randn(rows, h, dim, dtype=dtype, requires_grad=True)
            k, v = (torch.randn(rows, kv, dim, dtype=dtype, requires_grad=True) for _ in "kv")

            def exchange() -> None:
                dist.barrier()  # every rank starts together: the time includes waiting for peers
                k_all, v_all = gather_kv(k, v, launch_kv_exchange(k, v, d), d.kv_index, d)
                torch.autograd.backward([k_all, v_all], [k_all.detach(), v_all.detach()])

            def op(overlap: bool) -> Callable[[], None]:
                def run() -> None:
                    dist.barrier()
                    cp_varlen_attention(q, k, v, d, comm=comm, overlap=overlap).sum().backward()

                return run

            times = {"exchange_ms": timer(exchange), "op_ms": timer(op(False)),
                     "op_overlap_ms": timer(op(True))}
            results.append({"plan": i, "strategy": plan.strategy, "comm": comm, **times})
    out.put((rank, results))
    dist.destroy_process_group()


GLOO_TIMES = ("exchange_ms", "op_ms", "op_overlap_ms")


def gloo_comm(args, windows: list[list[int]]) -> list[dict]:
    """Exchange-only and whole-op fwd+bwd time per comm mode on `--gloo-cp` gloo processes."""
    n = args.gloo_cp
    plans = [make_plan(w, n, s, args) for w in windows for s in args.strategies]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_gloo_worker, args=(r, n, port, plans, args, out)) for r in range(n)]
    for p in procs:
        p.start()
    per_rank = dict(out.get() for _ in procs)
    for p in procs:
        p.join()
    # The step waits for the slowest rank.
    rows = [{**base, **{k: max(per_rank[r][i][k] for r in per_rank) for k in GLOO_TIMES}}
            for i, base in enumerate(per_rank[0])]
    print(f"\n== gloo, N={n} CPU processes, {args.dist}, C={args.context}, {len(windows)} windows: "
          "slowest rank, fwd+bwd ms ==")
    print(f"{'strategy':>10} {'comm':>8} {'exchange':>9} {'op':>9} {'op+overlap':>11}")
    for strategy in args.strategies:
        for comm in COMM_MODES:
            mean = _mean([{k: r[k] for k in GLOO_TIMES} for r in rows
                          if r["strategy"] == strategy and r["comm"] == comm])
            print(f"{strategy:>10} {comm:>8} {mean['exchange_ms']:>9.2f} {mean['op_ms']:>9.2f} "
                  f"{mean['op_overlap_ms']:>11.2f}")
    return rows


def summarize(payload: dict) -> list[str]:
    """The answers the benchmark exists for, in words, from the measured rows."""
    lines = []
    kernel = {(r["input"], r["strategy"]): r for r in payload.get("kernel_efficiency", [])}
    for name in dict.fromkeys(i for i, _ in kernel):
        pd, wd = kernel[name, "per_doc"], kernel[name, "whole_doc"]
        ratio = pd["sum_fwd_bwd_ms"] / wd["sum_fwd_bwd_ms"]
        lines.append(f"kernel, {name}: Per-Doc shards take {ratio:.2f}x "
                     f"the Whole-Doc shards' kernel time summed over ranks ({pd['num_shards']} vs "
                     f"{wd['num_shards']} shards; critical path {pd['critical_fwd_bwd_ms']:.1f} vs "
                     f"{wd['critical_fwd_bwd_ms']:.1f} ms)")
    for row in payload.get("strategies", []):
        ws = row["windows"]
        fewer = [w for w in ws if w["comm_needed_tokens"] < w["comm_compact_tokens"]]
        ratio = statistics.mean(w["comm_needed_tokens"] / max(1, w["comm_compact_tokens"]) for w in ws)
        lines.append(f"N={row['cp_size']} H={row['heads']} {row['strategy']}: needed < compact volume in "
                     f"{len(fewer)}/{len(ws)} windows (mean needed/compact {ratio:.2f})")
    gloo = payload.get("gloo", [])
    by_plan: dict[int, dict[str, dict]] = {}
    for r in gloo:
        by_plan.setdefault(r["plan"], {})[r["comm"]] = r
    for a, b in (("needed", "compact"), ("compact", "full")):
        if by_plan:
            wins = sum(m[a]["exchange_ms"] < m[b]["exchange_ms"] for m in by_plan.values())
            lines.append(f"gloo exchange fwd+bwd: {a} faster than {b} in {wins}/{len(by_plan)} plans")
    if gloo:
        gain = [1 - r["op_overlap_ms"] / r["op_ms"] for r in gloo]
        lines.append(f"gloo overlap: faster in {sum(g > 0 for g in gain)}/{len(gain)} runs, "
                     f"mean time change {-100 * statistics.mean(gain):+.1f}%")
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=PRESETS, help="default: paper on CUDA, cpu otherwise")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dist", help="length distribution name or JSON file of lengths")
    p.add_argument("--context", type=int, help="window length C")
    p.add_argument("--cp", type=int, nargs="+", help="CP sizes N")
    p.add_argument("--heads", type=int, nargs="+", help="query heads")
    p.add_argument("--kv-heads", type=int, default=0, help="key/value heads (default: = heads)")
    p.add_argument("--head-dim", type=int)
    p.add_argument("--dtype", choices=["float32", "float64", "bfloat16", "float16"])
    p.add_argument("--windows", type=int, help="packed windows per configuration")
    p.add_argument("--repeats", type=int, help="timed runs per measurement (the best counts)")
    p.add_argument("--strategies", nargs="+", default=[s for s in STRATEGIES if s != "ilp"],
                   choices=list(STRATEGIES), help="default: all but ilp (slow at large C)")
    p.add_argument("--ilp-time-limit", type=float, default=30.0)
    p.add_argument("--backend", default="auto", help="auto | flash_attn | torch | reference")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per process")
    p.add_argument("--gloo-cp", type=int, default=2, help="CPU processes of the gloo section")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sections", nargs="+", default=["kernel", "strategies", "gloo"],
                   choices=["kernel", "strategies", "gloo"])
    p.add_argument("--out", type=Path, help="default: benchmarks/results/attention_<device>.json")
    args = p.parse_args(argv)
    preset = PRESETS[args.preset or ("paper" if args.device.startswith("cuda") else "cpu")]
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    bad = [n for n in {*args.cp, args.gloo_cp} if args.context % n]
    if bad:
        p.error(f"--context {args.context} is not divisible by CP size(s) {bad}")
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    timer = Timer(device, args.repeats)
    windows = pack_windows(length_sampler(args.dist, seed=args.seed), args.context, args.windows)
    tag = torch.cuda.get_device_name(device).replace(" ", "_") if device.type == "cuda" else "cpu"
    out = args.out or RESULTS / f"attention_{tag}.json"
    csv_rows = ["heads,head_dim,q_lens,k_lens,fwd_ms,fwd_bwd_ms"]
    payload: dict = {"config": {k: v for k, v in vars(args).items() if k != "out"}, "device": tag,
                     "torch": torch.__version__}
    if "kernel" in args.sections:
        payload["kernel_efficiency"] = kernel_efficiency(args, timer, csv_rows)
    if "strategies" in args.sections:
        payload["strategies"] = strategies(args, windows, timer, csv_rows)
    if "gloo" in args.sections:
        if device.type == "cuda":
            print("\ngloo section left out: it runs CPU processes, and one GPU cannot host an NCCL CP group")
        else:
            payload["gloo"] = gloo_comm(args, windows)
    payload["summary"] = summarize(payload)
    print("\n== Summary ==\n" + "\n".join(payload["summary"]))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=1))
    out.with_suffix(".csv").write_text("\n".join(csv_rows) + "\n")
    print(f"\nwrote {out} and {out.with_suffix('.csv')}")


if __name__ == "__main__":
    main()
