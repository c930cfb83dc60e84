"""Compare sharding strategies on packed windows: balance, communication, fragmentation, speed.

    python -m flashcp.plan --distribution pile --cp 8 --windows 200
    python -m flashcp.plan --lengths 60000,40000,20000,11072 --cp 4 --strategy flashcp --json
    python -m flashcp.plan --lengths-file my_lengths.json --context 65536 --strategy all --strategy ilp

Windows come from one explicit window (--lengths), or are packed to --context tokens from a JSON
pool of lengths (--lengths-file) or a named distribution (--distribution, default wlbllm). Each
strategy plans every window through `flashcp.plan_shards`; the table (or --json) summarises,
per strategy, the workload imbalance (max / mean), the compact and needed KV communication as
ratios of the full all-gather, the documents split over several ranks, the shortest shard and
the planning time in milliseconds; run over a ring (`comm = "ring"`), the step-synchronous
imbalance (sum over ring steps of the busiest rank's work, over the mean rank's) and the KV the
ring moves per layer, forward and backward with float32 dK/dV sums, as a ratio of the full
all-gather and its reduce-scatter (`flashcp.plan.ring`); with --ranks-per-node G (CP ranks per node), also the busiest
rank's rows of the needed exchange that cross the fabric, flat and two-level (`flashcp.plan.nodes`).

With --mla (a named shape, moonlight or deepseek_v3, or kv_lora_rank,rope,heads,qk_nope,v) the
table also gives the latent exchange's bytes per layer on the busiest rank, compact and needed
(and over the fabric, two-level, with --ranks-per-node), in bf16, and each relative to the K/V
all-gather of the same plan (`kv: ... x full`): what `cp_latent_attention` sends instead of K/V.

With --window W (HF sliding_window: a query sees its last W keys) and --window-layers SHARE (the
share of layers with that window, 0.5 or 12/24; default 1/2, as gpt-oss) the strategies balance
the mixed workload of both layer kinds (`flashcp.plan.Workload`), the imbalance column is that
workload's, and the table adds the busiest rank's K/V rows per layer, compact / needed, of a full
layer and of a window layer (`flashcp.plan.window`): on `per_seq` the window's needed rows are a
contiguous split's halo, W - 1 rows before each of its chunks.

With --linear SHAPE (a hybrid: qwen3_5_9b, qwen3_5_27b or the path of its text config.json) the
strategies balance its full layers' pairs and its Gated DeltaNet layers' work (`LinearLayers`), and
the table adds one linear layer's state summaries the busiest rank receives, and the mean rank, in
MiB (`flashcp.plan.linear`), each over a contiguous split's summary all-gather (fla's layout).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from fractions import Fraction
from typing import Any, NoReturn

import numpy as np

from flashcp.data.lengths import DISTRIBUTIONS, LengthPool, LengthSampler, length_sampler, pack_windows
from flashcp.plan import CAUSAL, STRATEGIES, Plan, Workload, plan_shards
from flashcp.plan.linear import HYBRID_SHAPES, hybrid_shape, linear_metrics
from flashcp.plan.nodes import node_metrics
from flashcp.plan.plan import row_bytes
from flashcp.plan.ring import ring_metrics
from flashcp.plan.window import window_metrics

# MLA shapes: kv_lora_rank, qk_rope_head_dim, heads, qk_nope_head_dim, v_head_dim (their HF configs)
MLA_SHAPES: dict[str, tuple[int, int, int, int, int]] = {
    "moonlight": (512, 64, 16, 128, 128),  # Moonlight-16B-A3B, DeepSeek-V2-Lite
    "deepseek_v3": (512, 64, 128, 128, 128),  # DeepSeek-V3 / R1, Kimi K2 (64 heads: give the numbers)
}
MLA_DTYPE_BYTES = 2  # bf16
METRICS = ("imbalance", "comm_compact_ratio", "comm_needed_ratio", "ring_step_imbalance", "ring_comm_ratio",
           "split_docs", "min_shard_len", "plan_ms")
DEFAULT_STRATEGIES = [s for s in STRATEGIES if s != "ilp"]
# with --window: the busiest rank's rows of one full layer and of one window layer
WINDOW_METRICS = ("comm_compact_tokens", "comm_needed_tokens", "window_compact_tokens",
                  "window_needed_tokens")  # fmt: skip


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (usage stays available through --help)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _lengths(text: str) -> list[int]:
    try:
        lens = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--lengths must be comma-separated integers, got {text!r}"
        ) from None
    if any(x < 1 for x in lens):
        raise argparse.ArgumentTypeError("--lengths must all be positive")
    return lens


def _finite(text: str) -> float:
    """A finite float: inf or nan would pass the planner's own `>=` checks as no limit at all."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _window(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"--window takes the keys a query sees (HF sliding_window), a positive integer, got {text!r}"
        )
    return value


def _share(text: str) -> Fraction:
    """A fraction in [0, 1], as a decimal or a count of layers (12/24)."""
    try:
        value = Fraction(text)
    except (ValueError, ZeroDivisionError):
        value = Fraction(-1)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(
            f"--window-layers takes the share of layers with the window in [0, 1] (0.5 or 12/24), "
            f"got {text!r}"
        )
    return value.limit_denominator(1000)


def workload_from(args: argparse.Namespace) -> Workload:
    """The workload of --window / --window-layers (layer counts in the share's ratio) or --linear."""
    if args.linear is not None:
        if args.window is not None:
            raise ValueError("--linear and --window: the planner balances one kind besides full layers")
        lin = hybrid_shape(args.linear)
        return Workload(full_layers=lin.full_layers, linear=lin)
    if args.window is None:
        if args.window_layers is not None:
            raise ValueError("--window-layers needs --window (the keys a window layer's query sees)")
        return CAUSAL
    share = Fraction(1, 2) if args.window_layers is None else args.window_layers
    return Workload(share.denominator - share.numerator, share.numerator, args.window)


def _mla(text: str) -> tuple[str, tuple[int, ...]]:
    """A named MLA shape or five positive integers: (name, (kv_lora_rank, rope, heads, qk_nope, v))."""
    if text in MLA_SHAPES:
        return text, MLA_SHAPES[text]
    try:
        dims = tuple(int(x) for x in text.split(","))
    except ValueError:
        dims = ()
    if len(dims) != 5 or min(dims) < 1:
        raise argparse.ArgumentTypeError(
            f"--mla takes {' or '.join(MLA_SHAPES)} or kv_lora_rank,rope,heads,qk_nope,v (five positive "
            f"integers), got {text!r}"
        )
    return text, dims


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m flashcp.plan", description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--lengths", type=_lengths, help="one window: comma-separated document lengths")
    src.add_argument("--lengths-file", help="JSON list of document lengths, sampled with replacement")
    src.add_argument(
        "--distribution", help=f"named length distribution: {', '.join(DISTRIBUTIONS)} (default wlbllm)"
    )
    p.add_argument("--context", type=_positive, help="tokens per packed window (default 131072)")
    p.add_argument("--windows", type=_positive, default=200, help="windows to pack (default 200)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--cp", type=_positive, default=8, help="context-parallel size N (default 8)")
    p.add_argument(
        "--strategy",
        action="append",
        choices=[*STRATEGIES, "all"],
        help=f"strategy to run, repeatable (default all = {', '.join(DEFAULT_STRATEGIES)}; "
        "ilp is slow and runs only when named)",
    )
    p.add_argument(
        "--target-imbalance", type=_finite, default=1.05, help="target max/mean workload (default 1.05)"
    )
    p.add_argument(
        "--ilp-block", type=_positive, help="ilp last-shard granularity in tokens (default C / (8 N))"
    )
    p.add_argument("--ilp-time-limit", type=_finite, default=60.0, help="ilp seconds per window (default 60)")
    p.add_argument(
        "--ranks-per-node", type=_positive,
        help="CP ranks per node: also the needed exchange's fabric rows, flat vs two-level (busiest rank)",
    )
    p.add_argument(
        "--mla", type=_mla, metavar="SHAPE",
        help=f"also the latent exchange's bytes per layer: {', '.join(MLA_SHAPES)} or "
        "kv_lora_rank,rope,heads,qk_nope,v",
    )  # fmt: skip
    p.add_argument(
        "--window", type=_window, metavar="W",
        help="sliding-window layers of W keys (HF sliding_window, gpt-oss: 128): balance both layer kinds' "
        "workload and add each kind's K/V rows per layer",
    )
    p.add_argument(
        "--window-layers", type=_share, metavar="SHARE",
        help="share of the layers with --window, in [0, 1]: 0.5 or a count such as 12/24 "
        "(default 1/2, gpt-oss)",
    )  # fmt: skip
    p.add_argument("--linear", metavar="SHAPE", help=f"a hybrid's linear layers: {', '.join(HYBRID_SHAPES)} or "
                   "its text config.json; adds their state bytes per layer")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print one JSON object keyed by strategy")
    return p


def windows_from(args: argparse.Namespace) -> tuple[list[list[int]], str]:
    """The windows to plan and a phrase naming where they came from."""
    if args.lengths is not None:
        if args.context is not None:
            raise ValueError("--context applies to packed windows; --lengths is the window itself")
        return [args.lengths], f"{len(args.lengths)} documents"
    context = 131072 if args.context is None else args.context
    if args.lengths_file is not None:
        sampler = LengthSampler(LengthPool.from_json(args.lengths_file), args.seed, args.lengths_file)
    else:
        sampler = length_sampler(args.distribution or "wlbllm", args.seed)
    return pack_windows(sampler, context, args.windows), f"{sampler.name} (seed {args.seed})"


def evaluate(
    windows: Sequence[Sequence[int]], cp: int, strategies: Sequence[str], target: float, ilp: dict[str, Any],
    ranks_per_node: int | None = None, mla: tuple[int, ...] | None = None, workload: Workload = CAUSAL,
) -> dict[str, dict[str, list[float]]]:
    """Per strategy, each metric of `METRICS` for every window (and the fabric rows of the needed
    exchange as ratios of the full all-gather, flat and two-level, with `ranks_per_node`; the
    latent exchange's MiB per layer and ratios to the K/V all-gather with an `mla` shape; and
    with a `workload` with a window, its balance and `WINDOW_METRICS`)."""
    out: dict[str, dict[str, list[float]]] = {}
    for name in strategies:
        per = out.setdefault(name, {m: [] for m in METRICS})
        options = ilp if name == "ilp" else {}
        for lens in windows:
            t0 = time.perf_counter()
            plan = plan_shards(lens, cp, strategy=name, target_imbalance=target, workload=workload, **options)
            per["plan_ms"].append((time.perf_counter() - t0) * 1e3)
            m = plan.metrics() | ring_metrics(plan)
            for key in METRICS[:-1]:
                per[key].append(m[key])
            if workload.window is not None:
                m |= window_metrics(plan, workload.window)
                for key in WINDOW_METRICS:
                    per.setdefault(key, []).append(m[key])
            for key, value in (linear_metrics(plan, workload.linear) if workload.linear else {}).items():
                per.setdefault(key, []).append(value)
            nodes = node_metrics(plan, ranks_per_node) if ranks_per_node else None
            if nodes:
                full = m["comm_full_tokens"] or 1
                for key in ("flat_inter_rows", "two_level_inter_rows"):
                    per.setdefault(f"fabric_{key[:-5]}_ratio", []).append(nodes[key] / full)
            if mla:
                fabric = nodes["two_level_inter_rows"] if nodes else None
                for key, value in latent_metrics(plan, mla, fabric).items():
                    per.setdefault(key, []).append(value)
    return out


def latent_metrics(plan: Plan, mla: tuple[int, ...], fabric_rows: int | None = None) -> dict[str, float]:
    """The latent exchange of `plan` for MLA shape `mla`: MiB per layer the busiest rank receives
    (compact, needed; with `fabric_rows`, the busiest rank's two-level fabric rows, those too),
    each also as a multiple of the K/V all-gather of the same plan (`_kv_full`), and that
    all-gather's MiB."""
    rank, rope, heads, nope, v = mla
    latent = rank + rope
    m = plan.metrics(heads, nope + rope, MLA_DTYPE_BYTES, v_head_dim=v, latent_dim=latent)
    kv_full = m["comm_kv_full_bytes"]
    sent = {mode: m[f"comm_{mode}_bytes"] for mode in ("compact", "needed")}
    if fabric_rows is not None:
        sent["fabric_two_level"] = fabric_rows * row_bytes(latent_dim=latent, dtype_bytes=MLA_DTYPE_BYTES)
    out = {f"latent_{mode}_mib": b / 2**20 for mode, b in sent.items()}
    out.update({f"latent_{mode}_kv_full": b / kv_full if kv_full else 0.0 for mode, b in sent.items()})
    out["kv_full_mib"] = kv_full / 2**20
    return out


def summarise(values: Sequence[float]) -> dict[str, float]:
    a = np.asarray(values, dtype=float)
    p50, p95 = np.percentile(a, [50, 95])
    return {"mean": float(a.mean()), "p50": float(p50), "p95": float(p95), "max": float(a.max())}


def render(summary: dict[str, dict[str, dict[str, float]]], header: str) -> str:
    cols = [
        "strategy", "imbalance mean/p95/max", "compact comm", "needed comm", "ring steps imbalance",
        "ring comm", "split docs", "min shard p50", "plan ms p50/p95",
    ]
    rows = []
    for name, s in summary.items():
        imb, plan = s["imbalance"], s["plan_ms"]
        rows.append([
            name,
            f"{imb['mean']:.3f} / {imb['p95']:.3f} / {imb['max']:.3f}",
            f"{s['comm_compact_ratio']['mean']:.3f}",
            f"{s['comm_needed_ratio']['mean']:.3f}",
            f"{s['ring_step_imbalance']['mean']:.3f}",
            f"{s['ring_comm_ratio']['mean']:.3f}",
            f"{s['split_docs']['mean']:.1f}",
            f"{s['min_shard_len']['p50']:.0f}",
            f"{plan['p50']:.2f} / {plan['p95']:.2f}",
        ] + ([f"{s['fabric_flat_inter_ratio']['mean']:.3f} / {s['fabric_two_level_inter_ratio']['mean']:.3f}"]
             if "fabric_flat_inter_ratio" in s else []))  # fmt: skip
    if rows and "fabric_flat_inter_ratio" in next(iter(summary.values())):
        cols.append("fabric needed flat / two-level")
    if rows and "window_compact_tokens" in next(iter(summary.values())):
        cols += ["full-layer rows compact / needed", "window rows compact / needed"]
        for row, s in zip(rows, summary.values()):
            mean = {k: v["mean"] for k, v in s.items()}
            row.append(f"{mean['comm_compact_tokens']:.0f} / {mean['comm_needed_tokens']:.0f}")
            row.append(f"{mean['window_compact_tokens']:.0f} / {mean['window_needed_tokens']:.0f}")
    if rows and "latent_compact_mib" in next(iter(summary.values())):
        fabric = "latent_fabric_two_level_mib" in next(iter(summary.values()))
        cols += ["latent MiB compact / needed", "kv: x full compact / needed"]
        cols += ["latent fabric MiB (x full)"] if fabric else []
        for row, s in zip(rows, summary.values()):
            mean = {k: v["mean"] for k, v in s.items()}
            row.append(f"{mean['latent_compact_mib']:.2f} / {mean['latent_needed_mib']:.2f}")
            row.append(f"{mean['latent_compact_kv_full']:.4f} / {mean['latent_needed_kv_full']:.4f}")
            if fabric:
                row.append(f"{mean['latent_fabric_two_level_mib']:.2f} ({mean['latent_fabric_two_level_kv_full']:.4f})")
    if rows and "state_recv_bytes" in next(iter(summary.values())):
        cols.append("state MiB busiest / mean (x contiguous)")
        for row, s in zip(rows, summary.values()):
            mean = {k: v["mean"] / 2**20 for k, v in s.items()}
            row.append(f"{mean['state_recv_bytes']:.1f} / {mean['state_recv_bytes_mean']:.1f} "
                       f"({mean['state_recv_bytes'] / mean['state_contiguous_bytes']:.2f})")  # fmt: skip
    width = [max(len(r[i]) for r in [cols, *rows]) for i in range(len(cols))]
    lines = [header, "  ".join(c.ljust(w) for c, w in zip(cols, width))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, width)) for r in rows]
    lines.append(
        "comm columns are means of the per-window ratio to the full all-gather (1.0 = Llama3 / Per-Doc CP); "
        "ring comm: forward + backward (bf16 KV, float32 dK/dV sums) over the all-gather's + reduce-scatter's"
    )
    if "window rows compact / needed" in cols:
        lines.append(
            "rows: K/V rows (tokens) the busiest rank receives per layer, means over windows; a window layer "
            "receives the rows its windows reach (per_seq: the halo of W - 1 rows before each chunk)"
        )
    if "latent MiB compact / needed" in cols:
        lines.append(
            "latent: MiB per layer the busiest rank receives (bf16), and as a multiple of the K/V all-gather "
            "(kv: x full) of the same plan"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    strategies = list(dict.fromkeys(
        s for name in (args.strategy or ["all"]) for s in (DEFAULT_STRATEGIES if name == "all" else [name])
    ))
    ilp = {"time_limit": args.ilp_time_limit} | ({"block": args.ilp_block} if args.ilp_block else {})
    try:
        windows, source = windows_from(args)
        mla = args.mla[1] if args.mla else None
        workload = workload_from(args)
        results = evaluate(windows, args.cp, strategies, args.target_imbalance, ilp, args.ranks_per_node, mla,
                           workload)  # fmt: skip
    except (ValueError, RuntimeError) as e:
        parser.error(str(e))
    summary = {name: {m: summarise(v) for m, v in per.items()} for name, per in results.items()}
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        docs = np.mean([len(w) for w in windows])
        header = (
            f"{len(windows)} window(s) of {sum(windows[0])} tokens from {source}, "
            f"{docs:.1f} documents per window, CP size {args.cp}, target imbalance {args.target_imbalance}"
        )
        if workload.window is not None:
            header += (f"\nworkload: {workload.full_layers} full : {workload.window_layers} window layers, "
                       f"W = {workload.window} (the imbalance counts both)")  # fmt: skip
        if workload.linear is not None:
            header += (f"\nhybrid: {workload.full_layers} full : {workload.linear.layers} Gated DeltaNet layers "
                       "(the imbalance counts both, in FLOPs)")  # fmt: skip
        if args.mla:
            rank, rope, heads, nope, v = args.mla[1]
            latent, kv = rank + rope, heads * (nope + rope + v)
            header += (f"\nMLA {args.mla[0]}: latent row {rank} + {rope} = {latent} values vs K/V row "
                       f"{heads} x ({nope + rope} + {v}) = {kv} ({kv / latent:.1f}x)")  # fmt: skip
        print(render(summary, header))
    return 0


if __name__ == "__main__":
    sys.exit(main())
