"""Section 4: the per-rank critical path of each planner at the paper's setting.

A CP step waits for its slowest rank. For each packed window, CP size, (query, key/value) head
count of a shipped model on one rank and strategy,
every rank's single varlen kernel call (its shards as queries, document prefix + shard as keys,
exactly what its dispatch hands the kernel) is timed forward and forward+backward; the window's
critical path is the slowest rank. Windows are cut from the wlbllm and pile length
distributions; all strategies see the same windows. Every timed call also goes to
kernel_calls.csv, which re-fits the cost model.

The two ring systems (`comm = "ring"`: Ring-Attn on the `ring` layout, Ring-Attn (Zigzag) on
`per_doc`'s) run every rank's calls of every ring step on simulated ranks, one after the other:
each step's call with its LSE merge forward, and its kernel backward from the merged output with
the dK/dV accumulation, timed as the op runs them (`flashcp.attention.ring.forward_step`,
`backward_step`). The ring waits for its slowest rank at every step, so its critical path is the
sum over steps of the slowest rank's time. Its communication is MODELLED, not measured: each
step's transfer (`flashcp.plan.ring.ring_transfers`) priced from the nccl-tests tables
(`flashcp.costmodel.CommModel`, shared/data/gpu_profiles when the checkout has them, up to 8 GPUs),
overlapped with the step's kernels (`with_comm_modelled_ms`: per step the longer of the two).
"""

from __future__ import annotations

import functools
import itertools
import math
import statistics
from pathlib import Path

import torch

from flashcp import plan_shards
from flashcp.attention.kernels import resolve_lse_backend
from flashcp.attention.ring import backward_step, build_ring_dispatch, forward_step
from flashcp.costmodel import CommModel, ProfileError
from flashcp.costmodel.model import RING_LAYOUTS
from flashcp.costmodel.profiles import load_collective_tables
from flashcp.data import length_sampler, pack_windows
from flashcp.dispatch import build_dispatch
from flashcp.plan.ring import ring_transfers
from flashcp.gpucheck.report import Budget, Report, Section
from flashcp.gpucheck.sizes import Sizes
from flashcp.gpucheck.timing import KERNEL_CALL_COLUMNS, Timer, time_and_log

DATASETS = ("wlbllm", "pile")
STRATEGIES = ("per_seq", "per_doc", "flashcp", *RING_LAYOUTS)  # planners, then the ring systems
COLUMNS = ["dataset", "window", "cp", "heads", "kv_heads", "head_dim", "strategy", "backend", "critical_fwd_ms",
           "critical_fwd_bwd_ms", "mean_fwd_bwd_ms", "measured_imbalance", "planned_imbalance",
           "comm_full_tokens", "comm_compact_tokens", "comm_needed_tokens", "documents", "comm_modelled_ms",
           "with_comm_modelled_ms"]  # fmt: skip
REPO = Path(__file__).resolve().parents[2]
NCCL_TABLES = [p / "shared" / "data" / "gpu_profiles" for p in (REPO, REPO.parent)]


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
    comm = _comm_model()
    sec.lines.append("- ring systems: kernels and merges measured per rank and step; communication "
                     + ("MODELLED from the nccl-tests tables (with_comm_modelled_ms)" if comm else
                        "not modelled (no nccl-tests tables in shared/data/gpu_profiles)"))  # fmt: skip
    # Window-major: a run cut by its budget still has every configuration on the first windows.
    configs = itertools.product(range(sizes.path_windows), DATASETS, sizes.path_cp_sizes, sizes.path_heads,
                                backends, STRATEGIES)  # fmt: skip
    for w, ds, n, h, backend, strategy in configs:
        if budget.spent():
            sec.status = "cut short"
            sec.lines.append(f"- budget spent during window {w + 1} of {sizes.path_windows}")
            break
        doc_lens = windows[ds][w]
        plan = plan_shards(doc_lens, n, RING_LAYOUTS.get(strategy, strategy))
        m = plan.metrics(num_kv_heads=h[1], head_dim=d, dtype_bytes=2)
        if strategy in RING_LAYOUTS:
            times = ring_critical_path(plan, h, d, dtype, backend, timer, comm)
        else:
            ranks = [time_and_log(calls, "critical_path", ql, kl, h, d, dtype, backend, timer)
                     for ql, kl in rank_calls(plan)]  # fmt: skip
            fb = [r["fwd_bwd_ms"] for r in ranks]
            times = dict(critical_fwd_ms=max(r["fwd_ms"] for r in ranks), critical_fwd_bwd_ms=max(fb),
                         mean_fwd_bwd_ms=statistics.mean(fb), comm_modelled_ms="", with_comm_modelled_ms="")  # fmt: skip
        row = table.add(
            dataset=ds, window=w, cp=n, heads=h[0], kv_heads=h[1], head_dim=d, strategy=strategy, backend=backend,
            measured_imbalance=times["critical_fwd_bwd_ms"] / times["mean_fwd_bwd_ms"],
            planned_imbalance=m["imbalance"], comm_full_tokens=m["comm_full_tokens"],
            comm_compact_tokens=m["comm_compact_tokens"], comm_needed_tokens=m["comm_needed_tokens"],
            documents=len(doc_lens), **times,
        )  # fmt: skip
        results.setdefault((ds, n, h, backend, strategy), []).append(row["critical_fwd_bwd_ms"])
        print(f"{ds} w{w} N={n} H={h[0]}/{h[1]} {backend} {strategy}: critical fwd+bwd {row['critical_fwd_bwd_ms']:.2f} ms "
              f"(imbalance {row['measured_imbalance']:.2f})", flush=True)
    else:
        sec.status = "measured"
    _summarize(sec, results)


def _comm_model() -> CommModel | None:
    """The nccl-tests tables' collective model, if this checkout has them."""
    for path in NCCL_TABLES:
        if path.is_dir():
            try:
                return CommModel(load_collective_tables([path]))
            except ProfileError:
                return None
    return None


def ring_critical_path(plan, heads: tuple[int, int], head_dim: int, dtype: torch.dtype, backend: str,
                       timer: Timer, comm: CommModel | None) -> dict[str, float | str]:  # fmt: skip
    """The ring's step-synchronous critical path on `plan`: every rank's forward (call + merge) and
    backward (kernel backward + dK/dV accumulation) at every step, timed on this device one rank at
    a time; with `comm`, each step's modelled transfer overlapped with the step's slowest rank."""
    n, tokens, device = plan.cp_size, plan.tokens_per_rank, timer.device
    scale = 1.0 / math.sqrt(head_dim)
    fwd = [[0.0] * n for _ in range(n)]  # [step][rank]
    bwd = [[0.0] * n for _ in range(n)]
    for rank in range(n):
        dispatch = build_ring_dispatch(plan, rank).to(device)
        q, grad = (torch.randn(tokens, heads[0], head_dim, device=device, dtype=dtype) for _ in "qg")
        k, v = (torch.randn(tokens, heads[1], head_dim, device=device, dtype=dtype) for _ in "kv")
        kernel = resolve_lse_backend(backend, q, k)
        out = torch.zeros(q.shape, device=device, dtype=torch.float32)
        lse = torch.full((heads[0], tokens), -math.inf, device=device)
        dq, part = torch.zeros_like(out), torch.zeros(tokens, 2, *k.shape[1:], device=device)
        for s, step in enumerate(dispatch.steps):
            if step is None:
                continue
            fwd[s][rank] = timer(functools.partial(forward_step, q, k, v, step, kernel, scale, out, lse))
            bwd[s][rank] = timer(functools.partial(backward_step, grad, q, k, v, out.to(dtype), lse, step, kernel,
                                                   scale, dq, part))  # fmt: skip
    critical_f = [max(row) for row in fwd]
    critical_b = [max(row) for row in bwd]
    times: dict[str, float | str] = dict(
        critical_fwd_ms=sum(critical_f), critical_fwd_bwd_ms=sum(critical_f) + sum(critical_b),
        mean_fwd_bwd_ms=statistics.mean(sum(fwd[s][r] + bwd[s][r] for s in range(n)) for r in range(n)),
        comm_modelled_ms="", with_comm_modelled_ms="",
    )  # fmt: skip
    if comm is not None and 1 < n and ("all_gather", n) in comm.tables:
        row = 2 * heads[1] * head_dim * torch.finfo(dtype).bits // 8
        sent_f, sent_b = ring_transfers(tokens, n, row, 2 * heads[1] * head_dim * 4)
        step_f = [comm.ring_step_ms(b, n) for b in sent_f]
        step_b = [comm.ring_step_ms(b, n) for b in sent_b]
        times["comm_modelled_ms"] = sum(step_f) + sum(step_b)
        times["with_comm_modelled_ms"] = sum(max(c, t) for c, t in zip(step_f + step_b, critical_f + critical_b + [0.0]))
    return times


def _summarize(sec: Section, results: dict[tuple, list[float]]) -> None:
    """Mean critical path per configuration and FlashCP's speedup over the baselines."""
    for (ds, n, h, backend, strategy), times in results.items():
        if strategy != "flashcp":
            continue
        mean = statistics.mean(times)
        vs = []
        for base in ("per_seq", "per_doc", *RING_LAYOUTS):
            other = results.get((ds, n, h, backend, base), [])[: len(times)]
            if len(other) == len(times):
                vs.append(f"{statistics.mean(other) / mean:.2f}x vs {base}")
        sec.lines.append(f"- {ds} N={n} H={h[0]}/{h[1]} {backend}: FlashCP critical fwd+bwd {mean:.2f} ms over "
                         f"{len(times)} windows ({', '.join(vs)})")
