"""Section 3: the per-rank critical path of each planner at the paper's setting.

A CP step waits for its slowest rank. For each packed window, CP size, (query, key/value) head
count of a shipped model on one rank and strategy,
every rank's single varlen kernel call (its shards as queries, document prefix + shard as keys,
exactly what its dispatch hands the kernel) is timed forward and forward+backward; the window's
critical path is the slowest rank. Windows are cut from the wlbllm and pile length
distributions; all strategies see the same windows. Every timed call also goes to
kernel_calls.csv, which re-fits the cost model.
"""

from __future__ import annotations

import itertools
import statistics

import torch

from flashcp import plan_shards
from flashcp.data import length_sampler, pack_windows
from flashcp.dispatch import build_dispatch
from flashcp.gpucheck.report import Budget, Report, Section
from flashcp.gpucheck.sizes import Sizes
from flashcp.gpucheck.timing import KERNEL_CALL_COLUMNS, Timer, time_and_log

DATASETS = ("wlbllm", "pile")
STRATEGIES = ("per_seq", "per_doc", "flashcp")
COLUMNS = ["dataset", "window", "cp", "heads", "kv_heads", "head_dim", "strategy", "backend", "critical_fwd_ms",
           "critical_fwd_bwd_ms", "mean_fwd_bwd_ms", "measured_imbalance", "planned_imbalance",
           "comm_full_tokens", "comm_compact_tokens", "comm_needed_tokens", "documents"]  # fmt: skip


def rank_calls(plan) -> list[tuple[list[int], list[int]]]:
    """(q_lens, k_lens) of every rank's kernel call under `plan`."""
    calls = []
    for rank in range(plan.cp_size):
        d = build_dispatch(plan, rank, "compact")
        calls.append((d.cu_seqlens_q.diff().tolist(), d.cu_seqlens_k.diff().tolist()))
    return calls


def run(report: Report, sec: Section, device: torch.device, sizes: Sizes, budget: Budget,
        backends: list[str]) -> None:  # fmt: skip
    table = report.table("critical_path", COLUMNS)
    calls = report.table("kernel_calls", KERNEL_CALL_COLUMNS)
    timer, d, dtype = Timer(device, sizes.repeats), sizes.path_head_dim, torch.bfloat16
    windows = {ds: pack_windows(length_sampler(ds, seed=0), sizes.path_context, sizes.path_windows)
               for ds in DATASETS}  # fmt: skip
    results: dict[tuple, list[float]] = {}
    # Window-major: a run cut by its budget still has every configuration on the first windows.
    configs = itertools.product(range(sizes.path_windows), DATASETS, sizes.path_cp_sizes, sizes.path_heads,
                                backends, STRATEGIES)  # fmt: skip
    for w, ds, n, h, backend, strategy in configs:
        if budget.spent():
            sec.status = "cut short"
            sec.lines.append(f"- budget spent during window {w + 1} of {sizes.path_windows}")
            break
        doc_lens = windows[ds][w]
        plan = plan_shards(doc_lens, n, strategy)
        m = plan.metrics(num_kv_heads=h[1], head_dim=d, dtype_bytes=2)
        ranks = [time_and_log(calls, "critical_path", ql, kl, h, d, dtype, backend, timer) for ql, kl in rank_calls(plan)]
        fb = [r["fwd_bwd_ms"] for r in ranks]
        row = table.add(
            dataset=ds, window=w, cp=n, heads=h[0], kv_heads=h[1], head_dim=d, strategy=strategy, backend=backend,
            critical_fwd_ms=max(r["fwd_ms"] for r in ranks), critical_fwd_bwd_ms=max(fb),
            mean_fwd_bwd_ms=statistics.mean(fb), measured_imbalance=max(fb) / statistics.mean(fb),
            planned_imbalance=m["imbalance"], comm_full_tokens=m["comm_full_tokens"],
            comm_compact_tokens=m["comm_compact_tokens"], comm_needed_tokens=m["comm_needed_tokens"],
            documents=len(doc_lens),
        )  # fmt: skip
        results.setdefault((ds, n, h, backend, strategy), []).append(row["critical_fwd_bwd_ms"])
        print(f"{ds} w{w} N={n} H={h[0]}/{h[1]} {backend} {strategy}: critical fwd+bwd {row['critical_fwd_bwd_ms']:.2f} ms "
              f"(imbalance {row['measured_imbalance']:.2f})", flush=True)
    else:
        sec.status = "measured"
    _summarize(sec, results)


def _summarize(sec: Section, results: dict[tuple, list[float]]) -> None:
    """Mean critical path per configuration and FlashCP's speedup over the two baselines."""
    for (ds, n, h, backend, strategy), times in results.items():
        if strategy != "flashcp":
            continue
        mean = statistics.mean(times)
        vs = []
        for base in ("per_seq", "per_doc"):
            other = results.get((ds, n, h, backend, base), [])[: len(times)]
            if len(other) == len(times):
                vs.append(f"{statistics.mean(other) / mean:.2f}x vs {base}")
        sec.lines.append(f"- {ds} N={n} H={h[0]}/{h[1]} {backend}: FlashCP critical fwd+bwd {mean:.2f} ms over "
                         f"{len(times)} windows ({', '.join(vs)})")
