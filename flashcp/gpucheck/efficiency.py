"""Section 5: how kernel efficiency depends on shard length (the paper's Fig. 3), per backend.

Two measurements on one rank's share of a C-token window (N ranks, T = C / N tokens):

- fig3: one C-token document vs 16 documents of C / 16, sharded Per-Doc (every document cut
  into 2N head-tail chunks) and Whole-Doc (documents kept whole where they fit): the kernel time
  summed over ranks and the slowest rank. Per-Doc turns long sequences into short shards with
  long prefixes, which the kernel runs less efficiently.
- sweep: T tokens as sequences of one length s, either whole documents (s queries over s keys) or
  Per-Doc shards (pairs of head and tail chunks of s tokens of 2 N s-token documents), and the
  achieved TFLOP/s counting only the pairs the causal mask keeps.
"""

from __future__ import annotations

import torch

from flashcp import plan_shards
from flashcp.gpucheck.critical_path import rank_calls
from flashcp.gpucheck.report import Budget, Report, Section
from flashcp.gpucheck.sizes import Sizes
from flashcp.gpucheck.timing import KERNEL_CALL_COLUMNS, Timer, causal_flops, time_and_log

COLUMNS = ["kind", "backend", "input", "layout", "shard_len", "sequences", "q_tokens", "k_tokens",
           "fwd_ms", "fwd_bwd_ms", "tflops_fwd", "tflops_fwd_bwd", "critical_fwd_bwd_ms"]  # fmt: skip


def sweep_calls(context: int, s: int, cp: int) -> dict[str, tuple[list[int], list[int]]]:
    """(q_lens, k_lens) of rank 0's T = context / N query rows as whole s-token documents, or as
    the Per-Doc shards it holds of 2N s-token-chunk documents: the first chunk (s keys) and the
    last (the whole document as keys). Only layouts a `context`-token window can hold: a whole
    document fits the rank (s <= T), a Per-Doc document the window (2 N s <= context)."""
    tokens = context // cp
    calls = {}
    if s <= tokens:
        calls["whole"] = ([s] * (tokens // s),) * 2
    if 2 * cp * s <= context:
        pairs = tokens // (2 * s)
        calls["per_doc"] = ([s, s] * pairs, [s, 2 * cp * s] * pairs)
    return calls


def run(report: Report, sec: Section, device: torch.device, sizes: Sizes, budget: Budget,
        backends: list[str]) -> None:  # fmt: skip
    table = report.table("efficiency", COLUMNS)
    calls = report.table("kernel_calls", KERNEL_CALL_COLUMNS)
    timer, h, d, dtype = Timer(device, sizes.repeats), sizes.eff_heads, sizes.path_head_dim, torch.bfloat16
    c, n = sizes.eff_context, sizes.eff_cp
    inputs = {f"1 x {c}": [c], f"16 x {c // 16}": [c // 16] * 16}
    for backend in backends:
        for name, docs in inputs.items():
            summed = {}
            for strategy in ("per_doc", "whole_doc"):
                if budget.spent():
                    return _cut(sec)
                ranks = [time_and_log(calls, "efficiency", ql, kl, h, d, dtype, backend, timer)
                         for ql, kl in rank_calls(plan_shards(docs, n, strategy))]  # fmt: skip
                summed[strategy] = sum(r["fwd_bwd_ms"] for r in ranks)
                table.add(kind="fig3", backend=backend, input=name, layout=strategy, fwd_ms=sum(r["fwd_ms"] for r in ranks),
                          fwd_bwd_ms=summed[strategy], critical_fwd_bwd_ms=max(r["fwd_bwd_ms"] for r in ranks))  # fmt: skip
            line = (f"- {backend}, {name} at N={n}: Per-Doc shards take {summed['per_doc'] / summed['whole_doc']:.2f}x "
                    "the Whole-Doc kernel time (fwd+bwd, summed over ranks)")
            sec.lines.append(line)
            print(line[2:], flush=True)
        for s in sizes.eff_shard_lens:
            for layout, (q_lens, k_lens) in sweep_calls(c, s, n).items():
                if budget.spent():
                    return _cut(sec)
                t = time_and_log(calls, "efficiency", q_lens, k_lens, h, d, dtype, backend, timer)
                flops = causal_flops(q_lens, k_lens, h[0], d)
                row = table.add(kind="sweep", backend=backend, layout=layout, shard_len=s, sequences=len(q_lens),
                                q_tokens=sum(q_lens), k_tokens=sum(k_lens), **t,
                                tflops_fwd=flops["fwd"] / t["fwd_ms"] / 1e9,
                                tflops_fwd_bwd=flops["fwd_bwd"] / t["fwd_bwd_ms"] / 1e9)  # fmt: skip
                print(f"{backend} {layout} s={s}: {row['tflops_fwd']:.3g} TFLOP/s fwd, "
                      f"{row['tflops_fwd_bwd']:.3g} fwd+bwd", flush=True)
        sweep = [r for r in table.rows if r["kind"] == "sweep" and r["backend"] == backend]
        for layout in ("whole", "per_doc"):
            pts = ", ".join(f"{r['shard_len']}: {r['tflops_fwd_bwd']:.3g}" for r in sweep if r["layout"] == layout)
            sec.lines.append(f"- {backend} {layout} TFLOP/s fwd+bwd by shard length: {pts}")
    sec.status = "measured"


def _cut(sec: Section) -> None:
    sec.status = "cut short"
    sec.lines.append("- budget spent before the last measurement")
