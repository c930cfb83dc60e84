"""`python -m flashcp.titan.dryrun`: a job's memory per GPU (and host) from one rank on fake tensors.

    python -m flashcp.titan.dryrun --config llama8b_128k --world-size 8 [--json] [--gpu-gib 80] [--host-gib 256]
                                   [--ranks-per-node 8]

Exit 0 when it fits, 1 when not (one line: the biggest term and the levers this job does not
use), 2 for a bad job or argument (one line). A file the job names and this machine lacks (its
tokenizer, data, HF folder) is stood in for, one line each (`flashcp.titan.dryrun.standin`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from flashcp.attention import NodeLayoutError
from flashcp.data.errors import DataError
from flashcp.data.tokenizer import TokenizerError
from flashcp.titan.config import ConfigError, load_job, resolve_config_path, world_size_hint
from flashcp.titan.dryrun.report import advice, format_report
from flashcp.titan.dryrun.run import dry_run
from flashcp.titan.dryrun.standin import with_stand_ins


def _gib(minimum: float, strict: bool) -> Any:
    """An argparse type: a finite number of GiB above (or at) `minimum`."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value) or value < minimum or (strict and value == minimum):
            raise argparse.ArgumentTypeError(f"{text} must be a finite number {'>' if strict else '>='} {minimum:g}")
        return value

    return parse


def _ranks(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be a whole number >= 1")
    return int(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m flashcp.titan.dryrun",
        description="Peak memory per rank of a job, measured on fake tensors (no GPU needed). "
        "Overrides (--section.key value) apply as in training.",
    )
    parser.add_argument("--config", required=True, help="job file or name in train_configs/")
    parser.add_argument("--world-size", type=_ranks, help="ranks of the job (default: what its layout fixes)")
    parser.add_argument("--gpu-gib", type=_gib(0, strict=True), default=80.0,
                        help="GPU memory to check against (default 80)")
    parser.add_argument("--reserve-gib", type=_gib(0, strict=False), default=6.0,
                        help="untracked memory: CUDA context, NCCL buffers, fragmentation (default 6)")
    parser.add_argument("--host-gib", type=_gib(0, strict=False), default=256.0,
                        help="host memory per rank the offloads may hold (default 256: 1/8 of a 2 TB node)")
    parser.add_argument("--ranks-per-node", type=_ranks, default=8,
                        help="ranks (GPUs) per node, for the host memory a node needs (default 8)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args, overrides = parser.parse_known_args(argv)
    try:
        cfg, stand_ins = with_stand_ins(load_job(resolve_config_path(args.config), overrides))
        for line in stand_ins:
            print(f"note: {line}", file=sys.stderr, flush=True)
        world = args.world_size or world_size_hint(cfg)
        if world is None:
            raise ConfigError("data_parallel_shard_degree = -1 leaves the world open: pass --world-size")
        report = dry_run(cfg, world, args.gpu_gib, args.reserve_gib, args.host_gib, args.ranks_per_node)
    except (ConfigError, NodeLayoutError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (DataError, TokenizerError) as e:  # present but unreadable: absent files are stood in for
        print(f"error: {e}; the dry run draws one window from the job's data: --data.source synthetic "
              "(a mixture: --data.mix.NAME.source synthetic) stands in for it", file=sys.stderr)  # fmt: skip
        return 2
    print(json.dumps(report.as_json()) if args.json else format_report(report), flush=True)
    if not report.fits_gpu:
        biggest = report.biggest()
        need = report.peak_gib + report.casts_gib
        print(f"error: does not fit: {need:.1f} GiB + {report.reserve_gib:g} GiB reserve > "
              f"{report.gpu_gib:g} GiB; biggest term: {biggest} {report.by_category[biggest]:.1f} GiB: "
              f"{advice(biggest, cfg)}", file=sys.stderr)  # fmt: skip
        return 1
    if not report.fits:
        print(f"error: does not fit: {report.host_gib:.1f} GiB of host memory per rank > {report.host_limit_gib:g} "
              f"GiB (--host-gib), {report.host_gib_per_node:.0f} GiB per node of {report.ranks_per_node} ranks: "
              f"{advice('host', cfg)}", file=sys.stderr)  # fmt: skip
        return 1
    return 0

