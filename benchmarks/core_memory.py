"""Per-rank size of FlashCP's core at a 4M-token window: what a rank's dispatch holds, the KV
buffers one attention layer allocates, and the dispatch's CPU time, before and after the
dispatch was built from the plan's pieces instead of tables over the window.

    python benchmarks/core_memory.py > benchmarks/results/core_memory.txt
    python benchmarks/core_memory.py --baseline ''    # without the "before" figures

Each setting plans `--windows` windows (flashcp strategy) of `--lengths` documents and builds
every rank's dispatch; KV figures are bytes for Llama 3 8B's K and V (8 KV heads x 128 dims,
bf16) from the dispatch's real row counts (no tensors allocated), the largest over ranks and
windows. "Before" is `flashcp/dispatch.py` at git revision `--baseline`, timed on the same
ranks in turn with the current one; its dispatches must be identical. CPU times are single
threaded, p50 over `--timed-ranks` ranks of every window.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import fields
from pathlib import Path
from types import ModuleType

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from flashcp import plan_shards
from flashcp.data.lengths import length_sampler, pack_windows
from flashcp.dispatch import build_dispatch, Dispatch

ROOT = Path(__file__).resolve().parent.parent
KV_ROW_BYTES = 8 * 128 * 2  # one token's K (or V) in Llama 3 8B: 8 KV heads x 128 dims, bf16
# The last revision with the window-table dispatch (O(C) per rank, O(N C) for "needed").
BASELINE = "82d3476"
MIB = 2**20


class LargestTensor(TorchDispatchMode):
    """The largest tensor any torch op makes inside the block: its elements (`numel`) and the most
    bytes (`nbytes`); tests/test_dispatch.py bounds the first."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = self.nbytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
                self.nbytes = max(self.nbytes, t.numel() * t.element_size())
        return out


def load_baseline(rev: str) -> ModuleType:
    """`flashcp/dispatch.py` as of git revision `rev`, as a module of its own."""
    source = subprocess.run(
        ["git", "show", f"{rev}:flashcp/dispatch.py"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout
    path = Path(tempfile.mkdtemp()) / "baseline_dispatch.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("baseline_dispatch", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def dispatch_bytes(d: Dispatch) -> int:
    return sum(getattr(d, f.name).nbytes for f in fields(d) if isinstance(getattr(d, f.name), torch.Tensor))


def same(a: Dispatch, b) -> bool:
    """Whether two dispatches (of the current class and the baseline's) hold equal fields."""
    pairs = [(getattr(a, f.name), getattr(b, f.name)) for f in fields(a)]
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in pairs)


def timed(build, plan, rank: int, comm: str) -> tuple[Dispatch, float]:
    t0 = time.perf_counter()
    d = build(plan, rank, comm)
    return d, time.perf_counter() - t0


def layer_rows(d: Dispatch) -> dict[str, int]:
    """Rows (tokens) of K and V each buffer of one attention layer holds on this rank."""
    local = d.token_index.numel()
    sent = d.send_index.numel() if d.comm == "needed" else d.send_pad
    return {
        "recv": d.recv_size,
        "keys": d.kv_index.numel(),
        # forward: [recv | local] K and V, freed once the keys are gathered; the send rows
        "buffer": d.recv_size + local + sent,
        # the kernel's gathered K and V, saved for backward
        "saved": d.kv_index.numel(),
        # backward: the buffer's gradient, the rows sent back, the local gradient handed back
        "grad": d.recv_size + local + sent + local,
    }


def measure(doc_windows: list[list[int]], cp: int, comm: str, baseline: ModuleType | None, timed_ranks: int):
    per_rank = []
    times: dict[str, list[float]] = {"before": [], "after": []}
    peak = {"before": 0, "after": 0}
    identical = True
    for window in doc_windows:
        plan = plan_shards(window, cp, "flashcp")
        ranks = sorted({round(i * (cp - 1) / max(1, timed_ranks - 1)) for i in range(timed_ranks)})
        for rank in range(cp):
            d, seconds = timed(build_dispatch, plan, rank, comm)
            per_rank.append((layer_rows(d), dispatch_bytes(d)))
            if rank not in ranks:
                continue
            times["after"].append(seconds)
            with LargestTensor() as made:
                build_dispatch(plan, rank, comm)
            peak["after"] = max(peak["after"], made.nbytes)
            if baseline is not None:
                old, seconds = timed(baseline.build_dispatch, plan, rank, comm)
                times["before"].append(seconds)
                identical &= same(d, old)
                del old
                with LargestTensor() as made:
                    baseline.build_dispatch(plan, rank, comm)
                peak["before"] = max(peak["before"], made.nbytes)
    rows = {k: max(r[k] for r, _ in per_rank) for k in per_rank[0][0]}
    return {
        "tokens": plan.tokens_per_rank,
        "rows": rows,
        "dispatch_bytes": max(b for _, b in per_rank),
        "peak": peak,
        "ms": {k: statistics.median(v) * 1e3 if v else None for k, v in times.items()},
        "identical": identical if baseline is not None else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=4_194_304)
    parser.add_argument("--cp", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--lengths", nargs="+", default=["wlbllm", "pile"])
    parser.add_argument("--comm", nargs="+", default=["compact", "needed"])
    parser.add_argument("--windows", type=int, default=3)
    parser.add_argument("--timed-ranks", type=int, default=3, help="ranks timed per window (spread over 0..N-1)")
    parser.add_argument("--baseline", default=BASELINE, help="git revision of the 'before' dispatch; '' for none")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    baseline = load_baseline(args.baseline) if args.baseline else None

    print(f"C = {args.context:,} tokens, flashcp plans, {args.windows} windows per setting, seed {args.seed}; "
          f"KV bytes for 8 KV heads x 128 dims bf16 (K and V), per layer, largest rank; baseline {args.baseline or '-'}")  # fmt: skip
    print("buffer: forward [recv | local] K/V + send rows (freed once the keys are gathered); saved: the kernel's "
          "gathered K/V (kept for backward); grad: backward buffer + rows sent back + local gradient")  # fmt: skip
    print("peak: largest tensor made while building one dispatch; ms: dispatch CPU time p50, before -> after")
    head = (f"{'lengths':<7} {'N':>3} {'comm':<8} {'T':>8} {'recv rows':>10} {'key rows':>9} {'dispatch MiB':>12} "
            f"{'buffer MiB':>10} {'saved MiB':>9} {'grad MiB':>9} {'peak MiB before->after':>22} "
            f"{'ms before->after':>18} same")  # fmt: skip
    print(head)
    for name in args.lengths:
        windows = pack_windows(length_sampler(name, args.seed), args.context, args.windows)
        for cp in args.cp:
            for comm in args.comm:
                r = measure(windows, cp, comm, baseline, args.timed_ranks)
                rows, kv = r["rows"], 2 * KV_ROW_BYTES / MIB
                peak = f"{r['peak']['before'] / MIB:.1f} -> {r['peak']['after'] / MIB:.1f}" if baseline else f"{r['peak']['after'] / MIB:.1f}"  # fmt: skip
                ms = f"{r['ms']['before']:.1f} -> {r['ms']['after']:.1f}" if baseline else f"{r['ms']['after']:.1f}"
                print(
                    f"{name:<7} {cp:>3} {comm:<8} {r['tokens']:>8} {rows['recv']:>10} {rows['keys']:>9} "
                    f"{r['dispatch_bytes'] / MIB:>12.1f} {rows['buffer'] * kv:>10.0f} {rows['saved'] * kv:>9.0f} "
                    f"{rows['grad'] * kv:>9.0f} {peak:>22} {ms:>18} {r['identical']}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
