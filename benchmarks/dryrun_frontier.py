"""Memory per GPU at 512K-6M tokens, from the dry run (fake tensors: tracked, not measured on GPUs).

    python benchmarks/dryrun_frontier.py [--rows base|levers|70b] [--tokens 4M] [--out benchmarks/results/dryrun_frontier.jsonl]

Row sets:
- `base`: Llama 3 8B (`llama8b_128k`, full AC) at 512K / 1M / 2M / 4M tokens on 8, 16 and 32 ranks,
  all of them one CP group, offload off and on, the MLP (and the blocks' norms) tiled; Llama 3 70B at
  1M on 64 ranks (TP 8 x CP 8).
- `levers`: 8B on one 8-GPU node at 1M, 2M, 4M, 5M and 6M with every memory lever: the layer
  inputs offloaded, the tiles, and attention over 8 head groups (`head_groups`); the rows that do not
  fit again with FSDP's CPU offload of the sharded parameters, gradients and optimizer states
  (`training.enable_cpu_offload`).
- `70b`: Llama 3 70B at 2M on 32 (TP 8 x CP 4) and 64 ranks (TP 8 x CP 8), offload on (head groups
  do not run under TP), and with `--cpu-offload` FSDP's CPU offload where that does not fit.
Every row tiles to at most 16K tokens a tile (`mlp_tiles`). Each row is one
`python -m flashcp.titan.dryrun ... --json` run whose command is stored beside its report; a rerun
replaces the rows with the same command in `--out` and keeps the others. The table printed at the
end (every row in `--out`) is docs/dryrun.md's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
K = 1024
M = K * K
TILE_TOKENS = 16 * K
LEVERS = ["--activation_checkpoint.offload", "true", "--activation_checkpoint.head_groups", "8"]
CPU_OFFLOAD = ["--training.enable_cpu_offload", "true"]


def cp(ranks: int) -> list[str]:
    return ["--parallelism.context_parallel_degree", str(ranks)]


def rows(which: str) -> list[tuple[str, int, int, list[str]]]:
    """(config, seq_len, world size, overrides) for every row of a set."""
    if which == "base":
        out = [("llama8b_128k", seq_len, ranks, [*cp(ranks), "--activation_checkpoint.offload", offload])
               for seq_len in (512 * K, M, 2 * M, 4 * M) for ranks in (8, 16, 32) for offload in ("false", "true")]  # fmt: skip
        return [*out, ("llama70b_128k", M, 64, [*cp(8), "--activation_checkpoint.offload", "false"])]
    if which == "levers":
        return [("llama8b_128k", seq_len, 8, [*cp(8), *LEVERS]) for seq_len in (M, 2 * M, 4 * M, 5 * M, 6 * M)]
    return [("llama70b_128k", 2 * M, ranks, [*cp(ranks // 8), "--activation_checkpoint.offload", "true"])
            for ranks in (32, 64)]  # fmt: skip


def command(config: str, seq_len: int, ranks: int, overrides: list[str]) -> list[str]:
    tp = 8 if config.startswith("llama70b") else 1
    degree = int(overrides[overrides.index("--parallelism.context_parallel_degree") + 1])
    tiles = max(1, seq_len // degree // tp // TILE_TOKENS)
    return ["python", "-m", "flashcp.titan.dryrun", "--config", config, "--world-size", str(ranks), "--json",
            "--training.seq_len", str(seq_len), "--activation_checkpoint.mlp_tiles", str(tiles), *overrides]


def run(cmd: list[str]) -> dict:
    proc = subprocess.run([sys.executable, *cmd[1:]], cwd=ROOT, capture_output=True, text=True, timeout=7200)
    if proc.returncode not in (0, 1):  # 1: does not fit, still a report
        raise SystemExit(f"{' '.join(cmd)} failed: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _lever(report: dict, flag: str) -> str | None:
    words = report["command"].split()
    return words[words.index(flag) + 1] if flag in words else None


def _tokens(seq_len: int) -> str:
    return f"{seq_len // M}M" if seq_len >= M else f"{seq_len // K}K"


def table(reports: list[dict]) -> str:
    lines = ["| model | tokens | ranks | offload | head groups | FSDP CPU offload | GPU GiB (tracked + 6 reserve) "
             "| activations | host GiB/rank | largest at the peak | fits 80 GiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in sorted(reports, key=lambda r: ("70b" in r["config"], r["seq_len"], r["world_size"], r["command"])):
        model = "70B" if "70b" in r["config"] else "8B"
        tokens = _tokens(r["seq_len"])
        top = r.get("peak_tensors") or []
        largest = f"{top[0]['gib']:.1f} GiB {top[0]['dtype']} ({top[0]['name']})" if top else "-"
        lines.append(f"| {model} | {tokens} | {r['world_size']} | {'on' if r['offload'] else 'off'} "
                     f"| {_lever(r, '--activation_checkpoint.head_groups') or 1} "
                     f"| {'on' if _lever(r, '--training.enable_cpu_offload') == 'true' else 'off'} "
                     f"| {r['peak_gib'] + r['reserve_gib']:.1f} | {r['by_category']['activations']:.1f} "
                     f"| {r['host_gib']:.1f} | {largest} | {'yes' if r['fits'] else 'no'} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/dryrun_frontier.jsonl")
    parser.add_argument("--rows", choices=("base", "levers", "70b"), action="append",
                        help="row sets to run (repeatable; default all)")  # fmt: skip
    parser.add_argument("--tokens", action="append", help="only rows of these context lengths (e.g. 4M, 512K)")
    parser.add_argument("--cpu-offload", action="store_true",
                        help="rows of levers and 70b that do not fit: again with FSDP's CPU offload")
    args = parser.parse_args()
    kept = {}
    if args.out.exists():
        kept = {r["command"]: r for r in map(json.loads, args.out.read_text().splitlines())}
    for which in args.rows or ("base", "levers", "70b"):
        for config, seq_len, ranks, overrides in rows(which):
            if args.tokens and _tokens(seq_len) not in args.tokens:
                continue
            todo = [overrides]
            while todo:
                cmd = command(config, seq_len, ranks, todo.pop())
                report = {**run(cmd), "seq_len": seq_len, "command": " ".join(cmd)}
                print(f"{report['command']}: peak {report['peak_gib']:.1f} GiB, host {report['host_gib']:.1f} GiB, "
                      f"fits {report['fits']}", flush=True)  # fmt: skip
                kept[report["command"]] = report
                args.out.write_text("".join(json.dumps(r) + "\n" for r in kept.values()))
                if which != "base" and args.cpu_offload and not report["fits"] and CPU_OFFLOAD[0] not in cmd:
                    todo.append([*overrides, *CPU_OFFLOAD])
    print(table(list(kept.values())))


if __name__ == "__main__":
    main()
