"""TOML job files for `train.py`: read, override and check a job before any process starts.

    cfg = load_job("train_configs/debug_cpu.toml", ["--training.steps", "20"])
    check_layout(cfg, world_size=4)
    python -m flashcp.titan.config --check train_configs/debug_cpu.toml --world-size 4
    python -m flashcp.titan.config --keys [SECTION]        # every key with its type and default

A job file has TorchTitan 0.3.0's `Trainer.Config` sections, their keys read from TorchTitan's
config classes (`titan`), plus FlashCP's own `[job]`, `[model]`, `[data]`, `[loss]`,
`[flashcp]` and `[validation]` (`schema`, `model`); `flashcp.titan.launch.job` turns a validated job
into `Trainer.Config`. The modules of this package: `keys` (one key and its value check),
`file` (TOML, bounds, `--section.key value` overrides), `checks` (names, types and every check
needing no world size), `families` (what each model family refuses), `sizes` (the model's sizes
against memory), `layout` (the world size and the machine). This front door holds the names others import and the `--check` / `--keys` command line
(`__main__`).

A bad file fails with one `error: ...` line naming the key and what it accepts. Only TorchTitan's
config modules and model registries are imported, not its trainer: `--check` takes about as long
as importing them (docs/training.md, "Job files").

May import: torch, TorchTitan's config classes and registries, `compat`, and from the other rooms of
flashcp.titan only what describes a key: `models` (flavors, RoPE), `hf` (config.json) and
`components` (the checkpoint and metrics configs).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from flashcp.titan.config.checks import validate
from flashcp.titan.config.file import apply_overrides, CONFIG_DIR, load_job, resolve_config_path
from flashcp.titan.config.keys import ConfigError, Key, type_name
from flashcp.titan.config.layout import check_layout, degrees, world_size_hint
from flashcp.titan.config.model import custom_experts, model_dims, model_head_dim, TOKENIZER_SIZED_FLAVORS
from flashcp.titan.config.schema import SCHEMA

__all__ = [
    "CONFIG_DIR", "ConfigError", "Key", "SCHEMA", "TOKENIZER_SIZED_FLAVORS", "custom_experts",
    "apply_overrides", "check_layout", "degrees", "dryrun_command", "load_job", "main", "model_dims",
    "model_head_dim", "resolve_config_path", "validate", "world_size_hint",
]  # fmt: skip


def dryrun_command(path: str | Path, world_size: int, overrides: list[str] | None = None) -> str:
    """The command that measures a job's memory per GPU on a machine without GPUs (`flashcp.titan.dryrun`):
    named wherever a check passes or fails for lack of GPUs, since no other check sees activations."""
    argv = ["python", "-m", "flashcp.titan.dryrun", "--config", str(path), "--world-size", str(world_size)]
    return shlex.join([*argv, *(overrides or [])])


def key_lines(sections: list[str] | None = None) -> list[str]:
    """`[section] key = default  (type; choices) doc`, one line per key, as TOML would write the default."""
    lines = []
    for section in sections or SCHEMA:
        if section not in SCHEMA:
            raise ConfigError(f"unknown section [{section}]; allowed sections: {', '.join(SCHEMA)}")
        for name, key in SCHEMA[section].items():
            kind = type_name(key.type) + (f", one of {', '.join(map(str, key.choices))}" if key.choices else "")
            # JSON writes these values (booleans, numbers, strings, lists) as TOML does.
            default = "(unset)" if key.default is None else json.dumps(key.default)
            lines.append(f"[{section}] {name} = {default}  ({kind})" + (f"  {key.doc}" if key.doc else ""))
    return lines


def _warn(cfg: dict) -> None:
    """The job's warnings (settings it ignores), once it is known to pass."""
    for line in cfg["_warnings"]:
        print(f"warning: {line}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Check a FlashCP job file without launching anything.")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", metavar="CONFIG", help="job file or name in train_configs/")
    mode.add_argument("--keys", nargs="*", metavar="SECTION", help="list every key (of SECTIONs), its default")
    parser.add_argument("--world-size", type=int, help="number of ranks to check the layout for")
    args, overrides = parser.parse_known_args(argv)
    try:
        if args.keys is not None:
            print("\n".join(key_lines(args.keys)))
            return 0
        path = resolve_config_path(args.check)
        cfg = load_job(path, overrides)
        world = args.world_size or world_size_hint(cfg)
        if world is None:
            print(f"{path}: OK (data_parallel_shard_degree = -1: pass --world-size to check a layout)")
            _warn(cfg)
            return 0
        deg = check_layout(cfg, world)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{path}: OK for {world} ranks: " + ", ".join(f"{k}={v}" for k, v in deg.items()))
    _warn(cfg)
    if cfg["model"]["attention"] == "flashcp":  # the jobs the dry run builds
        print(cfg["_scope"])  # how the DP groups are planned (scope.resolve_scope)
        print(f"memory per GPU, checked without GPUs: {dryrun_command(path, world, overrides)}")
    return 0
