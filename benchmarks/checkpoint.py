"""What checkpoint verification costs: DCP save, manifest (CRC-32 of every file), verify, load.

    python benchmarks/checkpoint.py [--gib 2] [--dir DIR] [--json]

One process saves a state dict of `--gib` GiB of fp32 tensors shaped like Llama 3 8B's (4096 x
4096 attention and 4096 x 14336 feed-forward matrices) with torch.distributed.checkpoint, the way
one rank writes its shard, then times what FlashCP adds: hashing the files it wrote
(`manifest.rank_entries`, at save) and checking them (`manifest.verify_files`, at load), against
the save and the load themselves. Measured on this machine; the file system and page cache decide
the absolute figures (a load right after a save reads from memory), the checksum's share is what
the benchmark is for.

The Llama 3 8B line is modelled from the measured rates: 8.03e9 parameters x 12 bytes (fp32
weights + AdamW's two fp32 moments) = 96 GB, 12 GB per rank on 8 ranks, each rank hashing and
verifying its own share in parallel.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from flashcp.run.manifest import rank_entries, verify_files
from flashcp.run.safe_load import SafeReader, StrictPlanner

LLAMA8B_BYTES = 8.03e9 * 12
RANKS = 8
SHAPES = [(4096, 4096), (4096, 14336)]


def state_dict(gib: float) -> dict[str, torch.Tensor]:
    """fp32 tensors of Llama 3 8B's matrix shapes totalling about `gib` GiB."""
    target, total, out = gib * 2**30, 0, {}
    gen = torch.Generator().manual_seed(0)
    while total < target:
        shape = SHAPES[len(out) % len(SHAPES)]
        out[f"layers.{len(out)}.weight"] = torch.randn(shape, generator=gen)
        total += out[f"layers.{len(out) - 1}.weight"].numel() * 4
    return out


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def run(gib: float, root: Path) -> dict:
    states = state_dict(gib)
    nbytes = sum(t.numel() * 4 for t in states.values())
    folder = root / "step-1"
    save_s, _ = timed(lambda: dcp.save(states, checkpoint_id=str(folder), no_dist=True))
    hash_s, entries = timed(lambda: rank_entries(folder, 0))
    manifest = {"files": entries}
    verify_s, problems = timed(lambda: verify_files(folder, manifest, 0, 1))
    assert not problems, problems
    target = {k: torch.empty_like(v) for k, v in states.items()}
    load_s, _ = timed(lambda: dcp.load(target, checkpoint_id=str(folder), no_dist=True))
    assert all(torch.equal(target[k], states[k]) for k in states)
    strict = {k: torch.empty_like(v) for k, v in states.items()}  # as the trainer loads: data only, strict keys
    strict_s, _ = timed(lambda: dcp.load(strict, storage_reader=SafeReader(folder), planner=StrictPlanner(folder),
                                         no_dist=True))  # fmt: skip
    assert all(torch.equal(strict[k], states[k]) for k in states)
    gbps = {name: nbytes / s / 1e9 for name, s in (("save", save_s), ("hash", hash_s), ("verify", verify_s),
                                                    ("load", load_s))}  # fmt: skip
    per_rank = LLAMA8B_BYTES / RANKS
    return {
        "measured": {
            "bytes": nbytes,
            "seconds": {"save": save_s, "hash_at_save": hash_s, "verify_at_load": verify_s, "load": load_s,
                        "safe_strict_load": strict_s},
            "safe_strict_over_load_pct": 100 * (strict_s - load_s) / load_s,
            "GB_per_s": gbps,
            "hash_over_save_pct": 100 * hash_s / save_s,
            "verify_over_load_pct": 100 * verify_s / load_s,
        },
        "modelled_llama3_8b": {
            "bytes_total": LLAMA8B_BYTES,
            "ranks": RANKS,
            "bytes_per_rank": per_rank,
            "seconds_per_rank": {
                "save": per_rank / gbps["save"] / 1e9,
                "hash_at_save": per_rank / gbps["hash"] / 1e9,
                "verify_at_load": per_rank / gbps["verify"] / 1e9,
                "load": per_rank / gbps["load"] / 1e9,
            },
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=2.0, help="checkpoint size to write (GiB)")
    parser.add_argument("--dir", type=Path, help="where to write it (default: a temporary folder)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="flashcp-ckpt-bench-", dir=args.dir))
    try:
        result = run(args.gib, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    m, p = result["measured"], result["modelled_llama3_8b"]
    print(f"measured on this machine, {m['bytes'] / 2**30:.2f} GiB in one process:")
    for name, key in (("save", "save"), ("CRC-32 at save", "hash_at_save"), ("verify at load", "verify_at_load"),
                      ("load", "load")):  # fmt: skip
        rate = m["GB_per_s"][{"hash_at_save": "hash", "verify_at_load": "verify"}.get(key, key)]
        print(f"  {name:15s} {m['seconds'][key]:7.2f} s  {rate:6.2f} GB/s")
    print(f"  checksums add {m['hash_over_save_pct']:.0f} % to a save and {m['verify_over_load_pct']:.0f} % to a load")
    print(f"  a safe, strict load takes {m['seconds']['safe_strict_load']:.2f} s "
          f"({m['safe_strict_over_load_pct']:+.0f} % against DCP's plain load)")
    print(f"modelled, Llama 3 8B ({p['bytes_total'] / 1e9:.0f} GB with AdamW) on {p['ranks']} ranks, "
          f"{p['bytes_per_rank'] / 1e9:.0f} GB per rank:")  # fmt: skip
    for key, seconds in p["seconds_per_rank"].items():
        print(f"  {key:15s} {seconds:7.1f} s per rank (in parallel)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
