"""Memory per GPU at 512K-4M tokens, from the dry run (fake tensors: tracked, not measured on GPUs).

    python benchmarks/dryrun_frontier.py [--out benchmarks/results/dryrun_frontier.jsonl] [--only 8b|70b]

Llama 3 8B (`llama8b_128k`, full AC) at 512K / 1M / 2M / 4M tokens on 8, 16 and 32 ranks, all of
them one CP group, offload off and on; Llama 3 70B at 1M on 64 ranks (TP 8 x CP 8). Every row
tiles the MLP to at most 16K tokens a tile (`mlp_tiles`). Each row is one
`python -m flashcp.titan.dryrun ... --json` run whose command is stored beside its report; the
table printed at the end is the README's (docs/dryrun.md).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
K = 1024
TILE_TOKENS = 16 * K


def rows(only: str | None) -> list[tuple[str, int, int, list[str]]]:
    """(config, seq_len, world size, overrides) for every row."""
    out = []
    if only in (None, "8b"):
        for seq_len in (512 * K, 1024 * K, 2048 * K, 4096 * K):
            for ranks in (8, 16, 32):
                for offload in ("false", "true"):
                    out.append(("llama8b_128k", seq_len, ranks, [
                        "--parallelism.context_parallel_degree", str(ranks),
                        "--activation_checkpoint.offload", offload]))  # fmt: skip
    if only in (None, "70b"):
        out.append(("llama70b_128k", 1024 * K, 64, ["--parallelism.context_parallel_degree", "8",
                                                    "--activation_checkpoint.offload", "false"]))  # fmt: skip
    return out


def command(config: str, seq_len: int, ranks: int, overrides: list[str]) -> list[str]:
    tp = 8 if config.startswith("llama70b") else 1
    cp = int(overrides[overrides.index("--parallelism.context_parallel_degree") + 1])
    tiles = max(1, seq_len // cp // tp // TILE_TOKENS)
    return ["python", "-m", "flashcp.titan.dryrun", "--config", config, "--world-size", str(ranks), "--json",
            "--training.seq_len", str(seq_len), "--activation_checkpoint.mlp_tiles", str(tiles), *overrides]


def run(cmd: list[str]) -> dict:
    proc = subprocess.run([sys.executable, *cmd[1:]], cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if proc.returncode not in (0, 1):  # 1: does not fit, still a report
        raise SystemExit(f"{' '.join(cmd)} failed: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def table(reports: list[dict]) -> str:
    lines = ["| model | tokens | ranks | offload | GPU GiB (tracked + 6 reserve) | activations | host GiB/rank "
             "| copy / layer fwd (ms, modelled) | fits 80 GiB |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in reports:
        o = r["offload"]
        copy = f"{o['copy_ms']:.1f} / {o['layer_forward_ms_at_peak']:.1f}" if o else "-"
        model = "70B" if "70b" in r["config"] else "8B"
        lines.append(f"| {model} | {r['seq_len'] // K}K | {r['world_size']} | {'on' if o else 'off'} "
                     f"| {r['peak_gib'] + r['reserve_gib']:.1f} | {r['by_category']['activations']:.1f} "
                     f"| {r['host_gib']:.1f} | {copy} | {'yes' if r['fits'] else 'no'} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/dryrun_frontier.jsonl")
    parser.add_argument("--only", choices=("8b", "70b"))
    args = parser.parse_args()
    reports = []
    with args.out.open("w") as out:
        for config, seq_len, ranks, overrides in rows(args.only):
            cmd = command(config, seq_len, ranks, overrides)
            report = {**run(cmd), "seq_len": seq_len, "command": " ".join(cmd)}
            print(f"{' '.join(cmd)}: peak {report['peak_gib']:.1f} GiB, host {report['host_gib']:.1f} GiB, "
                  f"fits {report['fits']}", flush=True)  # fmt: skip
            out.write(json.dumps(report) + "\n")
            out.flush()
            reports.append(report)
    print(table(reports))


if __name__ == "__main__":
    main()
