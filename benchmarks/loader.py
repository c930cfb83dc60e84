"""Loader throughput per rank as data parallelism grows, and the main thread's share of it.

    python benchmarks/loader.py --dp K --context C [--source DIR] [--cp N] [--windows W]
                                [--balance off|mesh|mesh-cut] [--step-ms S] [--json]

One rank (DP rank K // 2) of a DP = K job pulls W windows of C tokens from the window loader with
prefetching off, so all loader work is in the caller and timed: `tokens_per_s_per_rank` is the
tokens this rank receives per second of reading, tokenising and packing (`load_ms`; planning and
the dispatch are reported apart as `plan_ms`). With a token store (`--source DIR`, or, without
--source, the shipped corpus prepared into a temporary store) a rank reads only its own windows, so
the figure should hardly depend on K. `main_thread_ms`: with prefetching on and the dispatch of CP
rank 0 of N built in the loader's thread, what `next()` costs the training loop's main thread
while a step of S ms (default 50) runs between calls (p50 / p99); the loader's thread keeps up
when its work per window is below S. `--balance` balances every step as the trainer
does for `[data] balance` (Llama 3 8B's cost, one micro step): each rank then also packs the
lengths of every window of the step and balances them, which `load_ms` includes: work that grows
with K, unlike the reading.

`--mesh` measures the mesh scope instead (`[flashcp] scope = "mesh"`): mesh rank (K // 2) x N of
DP K x CP N pulls W windows of K x C tokens planned by `plan_mesh` (nodes of 8 ranks), once as the
loader read them before each rank read its own tokens (`whole`: the K x C window read and packed,
then indexed by the dispatch) and once as it reads them now (`rank`: the pieces from the document
offsets alone, then only this rank's shards and the token after each run). Per window: `cpu_ms`
(the thread's CPU time in `next()`: reading, packing, planning, the dispatch), `load_ms` and
`plan_ms` (wall; planning and the dispatch run in the loader's thread or the plan worker, off the
training step), and the bytes read from tokens.bin, split into first-read chunk checks (1 MiB each,
once per chunk per process) and the ranges read. `--store-lengths NAME` writes a synthetic token store
(random ids, document lengths from a `flashcp.data.lengths` distribution, e.g. prolong-pool) of
`--store-windows` x K x C tokens to read from.
"""

from __future__ import annotations

import argparse
import functools
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from flashcp.data.balance import WindowCost
from flashcp.data.lengths import length_sampler
from flashcp.data.prepare import prepare
from flashcp.data.sources import DEFAULT_TOKENIZER
from flashcp.data.store import ChunkHasher, CHUNK_BYTES, crc32, file_fingerprint, TokenStore
from flashcp.data.tokenizer import load_tokenizer, tokenizer_file
from flashcp.dispatch import build_dispatch
from flashcp.plan.mesh import plan_mesh
from flashcp.data.loader import build_loader
from flashcp.data.sources import DataConfig

TARGETS = {mode: DataConfig(balance=mode).balance_args() for mode in ("deferral", "deferral-cut", "mesh", "mesh-cut")}


def loader_for(source: str, dp: int, context: int, cp: int, balance: str, prefetch: int):
    loader = build_loader(DataConfig(source=source, prefetch=prefetch), context, dp // 2, dp, cp,
                          planner_kwargs={"strategy": "flashcp"})  # fmt: skip
    if balance != "off":
        loader.balance_with(1, WindowCost.llama(8.03e9, 4096, 32, cp), **TARGETS[balance])
    return loader


def throughput(source: str, dp: int, context: int, cp: int, n: int, balance: str) -> dict[str, float]:
    loader = loader_for(source, dp, context, cp, balance, prefetch=0)
    next(loader)  # opens the source
    batches = [next(loader) for _ in range(n)]
    load_s = sum(b["load_ms"] for b in batches) / 1e3
    return {"tokens_per_s_per_rank": n * context / load_s, "load_ms": 1e3 * load_s / n,
            "plan_ms": float(np.mean([b["plan_ms"] for b in batches]))}  # fmt: skip


def main_thread(source: str, dp: int, context: int, cp: int, n: int, balance: str,
                step_ms: float) -> dict[str, float]:  # fmt: skip
    loader = loader_for(source, dp, context, cp, balance, prefetch=2)
    loader.dispatch_with(lambda plan: build_dispatch(plan, 0, "compact"))
    waits = []
    with loader:
        next(loader)
        for _ in range(n):
            time.sleep(step_ms / 1e3)  # the training step the loader overlaps with
            waits.append(next(loader)["wait_ms"])
    return {"p50": float(np.percentile(waits, 50)), "p99": float(np.percentile(waits, 99))}


def synthetic_store(path: Path, lengths: str, tokens: int, seed: int = 0) -> Path:
    """A token store of random ids below the default tokenizer's vocabulary, document lengths drawn from
    `lengths` until they hold `tokens`, written as `prepare` lays it out (its manifest names that tokenizer)."""
    tok_path = tokenizer_file(DEFAULT_TOKENIZER)
    vocab = load_tokenizer(tok_path).vocab_size
    sampler, rng, lens = length_sampler(lengths, seed), np.random.default_rng(seed), np.zeros(0, dtype=np.int64)
    while lens.sum() < tokens:
        lens = np.concatenate((lens, sampler.sample(4096)))
    lens = lens[: int(np.searchsorted(np.cumsum(lens), tokens)) + 1]
    path.mkdir()
    hasher = ChunkHasher()
    with open(path / "tokens.bin", "wb") as f:
        for block in np.array_split(np.arange(lens.size), max(1, int(lens.sum()) // (1 << 24))):
            data = rng.integers(0, vocab, int(lens[block].sum()), dtype=np.uint16).tobytes()
            hasher.update(data)
            f.write(data)
    np.save(path / "checksums.npy", hasher.finish())
    np.save(path / "offsets.npy", np.concatenate(([0], np.cumsum(lens))).astype(np.int64))
    manifest = {"format": "flashcp-token-store", "version": 2, "n_docs": int(lens.size), "n_tokens": int(lens.sum()),
                "dtype": "uint16", "chunk_bytes": CHUNK_BYTES,
                "offsets_crc32": crc32((path / "offsets.npy").read_bytes()),
                "tokenizer": {"fingerprint": file_fingerprint(tok_path), "vocab_size": vocab, "name": tok_path.name},
                "source": {"fingerprint": f"synthetic:{lengths}:{seed}:{tokens}"}}  # fmt: skip
    (path / "manifest.json").write_text(json.dumps(manifest))
    return path


def mesh(source: str, dp: int, context: int, cp: int, n: int) -> dict[str, dict[str, float]]:
    """Per window of dp x context tokens, mesh rank (dp // 2) x cp's loader work and bytes read: as it read
    the whole window before (`whole`) and its own tokens now (`rank`)."""
    read = {"chunk_checks": 0, "ranges": 0}
    pread, verify = TokenStore._pread, TokenStore.verify_chunk

    def counting(self, lo: int, hi: int) -> bytearray:
        read["ranges"] += hi - lo
        return pread(self, lo, hi)

    def checking(self, c: int) -> None:
        verify(self, c)
        size = min(self.chunk_bytes, self.n_bytes - c * self.chunk_bytes)  # read by `_pread`, counted apart
        read["chunk_checks"], read["ranges"] = read["chunk_checks"] + size, read["ranges"] - size

    TokenStore._pread, TokenStore.verify_chunk = counting, checking
    rank, out, plan_cpu = dp // 2 * cp, {}, [0.0]

    def timed(fn):  # the planner's and the dispatch's CPU time, apart from the reading
        def run(*args):
            t0 = time.thread_time()
            try:
                return fn(*args)
            finally:
                plan_cpu[0] += (time.thread_time() - t0) * 1e3
        return run

    for path in ("whole", "rank"):
        loader = build_loader(DataConfig(source=source, prefetch=0), context, cp_size=cp)
        loader.mesh_with(dp, timed(functools.partial(plan_mesh, dp=dp, cp=cp, ranks_per_node=8)))
        loader.dispatch_with(timed(functools.partial(build_dispatch, rank=rank, comm="needed")))
        loader._mesh = path == "rank"  # False: the loader's path before ranks read their own tokens
        next(loader)  # opens the source (and numpy's lazy imports)
        first = read["chunk_checks"]
        read.update(chunk_checks=0, ranges=0)
        plan_cpu[0] = 0.0
        cpu, batches = [], []
        for _ in range(n):
            t0 = time.thread_time()
            batches.append(next(loader))
            cpu.append((time.thread_time() - t0) * 1e3)
            if path == "whole":  # what the trainer then took of the window
                batches[-1]["input"][batches[-1]["dispatch"].token_index]
        out[path] = {"cpu_ms": float(np.mean(cpu)), "plan_cpu_ms": plan_cpu[0] / n,
                     "first_chunk_check_bytes": first, "load_ms": float(np.mean([b["load_ms"] for b in batches])),
                     "plan_ms": float(np.mean([b["plan_ms"] for b in batches])),
                     "chunk_check_bytes": read["chunk_checks"] / n, "range_bytes": read["ranges"] / n,
                     "tokens": int(batches[-1]["input"].numel())}  # fmt: skip
    TokenStore._pread, TokenStore.verify_chunk = pread, verify
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dp", type=int, required=True)
    parser.add_argument("--context", type=int, required=True)
    parser.add_argument("--source", help="a token store or any [data] source (default: the shipped corpus as a store)")
    parser.add_argument("--cp", type=int, default=8)
    parser.add_argument("--windows", type=int, default=10)
    parser.add_argument("--step-ms", type=float, default=50.0, help="the training step simulated between next() calls")
    parser.add_argument("--balance", choices=("off", *TARGETS), default="off")
    parser.add_argument("--no-verify", action="store_true",
                        help="read a token store through its memory map, unchecked (to measure what the checks cost)")
    parser.add_argument("--mesh", action="store_true", help="the mesh scope's window of DP x C (see above)")
    parser.add_argument("--store-lengths", help="read a synthetic token store with lengths from this distribution")
    parser.add_argument("--store-windows", type=int, default=8, help="the synthetic store's size in DP x C windows")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # as the launcher does: 2 threads on a loaded machine slowed a dispatch 10-30x
    if args.no_verify:  # the training path reads through TokenStore.read: a copy, its 4 KiB blocks checked
        TokenStore.read = TokenStore.document
    if min(args.dp, args.context, args.cp, args.windows) < 1 or args.context % args.cp or args.step_ms < 0:
        parser.error("--dp, --context, --cp, --windows must be >= 1, --context divisible by --cp, --step-ms >= 0")
    with tempfile.TemporaryDirectory() as tmp:
        if args.store_lengths:
            args.source = str(synthetic_store(Path(tmp) / "store", args.store_lengths,
                                              args.store_windows * args.dp * args.context))  # fmt: skip
        source = args.source or str(prepare("default", "default", Path(tmp) / "store", progress=False))
        if args.mesh:
            result = {"source": args.store_lengths or source, "dp": args.dp, "context": args.context, "cp": args.cp,
                      "windows": args.windows, **mesh(source, args.dp, args.context, args.cp, args.windows)}  # fmt: skip
            print(json.dumps(result) if args.json else "\n".join(
                f"mesh DP={args.dp} x CP={args.cp} C={args.context}, {path}: {r['cpu_ms']:.0f} ms CPU per window "
                f"({r['plan_cpu_ms']:.0f} of it planning and the dispatch; wall: load {r['load_ms']:.0f} ms, plan + dispatch "
                f"{r['plan_ms']:.0f} ms), read {r['range_bytes'] / 2**20:.2f} MiB + {r['chunk_check_bytes'] / 2**20:.1f} MiB "
                f"first-read chunk checks ({r['first_chunk_check_bytes'] / 2**20:.0f} MiB in the first window), "
                f"{r['tokens']:,} tokens" for path, r in result.items() if isinstance(r, dict)))  # fmt: skip
            return 0
        result = {
            "source": args.source or "shipped corpus, prepared into a temporary token store",
            "dp": args.dp, "context": args.context, "cp": args.cp, "windows": args.windows, "balance": args.balance,
            "verify": not args.no_verify,
            "step_ms": args.step_ms,
            **throughput(source, args.dp, args.context, args.cp, args.windows, args.balance),
            "main_thread_ms": main_thread(source, args.dp, args.context, args.cp, args.windows, args.balance,
                                          args.step_ms),
        }  # fmt: skip
    if args.json:
        print(json.dumps(result))
    else:
        print(f"DP={args.dp} C={args.context}: {result['tokens_per_s_per_rank']:,.0f} tokens/s per rank "
              f"({result['load_ms']:.1f} ms per window to read, pack and balance ({args.balance}), {result['plan_ms']:.1f} ms to plan and "
              f"dispatch); main thread per next() between {args.step_ms:g} ms steps: p50 {result['main_thread_ms']['p50']:.3f} ms, "
              f"p99 {result['main_thread_ms']['p99']:.3f} ms")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
