"""`python -m flashcp.titan.probe`: the retrieval probe on a checkpoint or a Hugging Face folder, no training.

    python -m flashcp.titan.probe --checkpoint outputs/job/checkpoint/step-20 --config JOB [--section.key value ...]
    python -m flashcp.titan.probe --hf outputs/job/checkpoint/step-20-hf --config JOB

The job gives everything but the weights: model, layout (CP, TP, FSDP degrees; the ranks a
training job would use: `NGPU`, else the visible GPUs, else the layout's world on CPU), tokenizer,
`[validation] source` (the haystack) and `[probe]` (the grid). The ranks are started through
torchrun; each builds the job's trainer with the weights as its initial load (`--checkpoint`: a
FlashCP / DCP step folder, model only; `--hf`: safetensors, as `initial_load_in_hf`), runs the probe
once, and rank 0 prints the table and writes `<out>/probe.json` and `<out>/probe/step-<N>.png`
(`--out`, default outputs/probe/<the weights' folder name>). Exit 2 with one line for a bad job,
folder or data, checked before any rank starts (`check_weights`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from flashcp.attention import NodeLayoutError
from flashcp.data.errors import DataError
from flashcp.data.tokenizer import TokenizerError
from flashcp.run import launch as ranks
from flashcp.titan.config import check_layout, ConfigError, load_job, resolve_config_path, world_size_hint


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="python -m flashcp.titan.probe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    weights = parser.add_mutually_exclusive_group(required=True)
    weights.add_argument("--checkpoint", type=Path, help="a checkpoint's step folder (DCP)")
    weights.add_argument("--hf", type=Path, help="a Hugging Face model folder (config.json, safetensors)")
    parser.add_argument("--config", required=True, help="job file path or name in train_configs/")
    parser.add_argument("--out", type=Path, help="where the table, JSON and PNG go")
    return parser.parse_known_args(argv)


def job_overrides(args: argparse.Namespace) -> list[str]:
    """The job's overrides that load the weights and probe them: no validation, nothing saved."""
    folder = (args.checkpoint or args.hf).resolve()
    out = (args.out or Path("outputs/probe") / folder.name).resolve()
    return ["--probe.enable", "true", "--validation.enable", "false", "--checkpoint.enable", "true",
            "--checkpoint.initial_load_path", str(folder), "--checkpoint.initial_load_in_hf",
            "true" if args.hf else "false", "--checkpoint.initial_load_model_only", "true",
            "--checkpoint.last_save_in_hf", "false", "--checkpoint.create_seed_checkpoint", "false",
            "--job.dump_folder", str(out)]  # fmt: skip


def load(argv: list[str]) -> dict:
    """The job with the probe's overrides, checked; ConfigError for a bad job or weights folder."""
    args, overrides = parse(argv)
    folder = args.checkpoint or args.hf
    if not folder.is_dir():
        raise ConfigError(f"{'--checkpoint' if args.checkpoint else '--hf'} {folder}: no such folder")
    if args.hf and not (folder / "config.json").is_file():
        raise ConfigError(f"--hf {folder}: no config.json, not a Hugging Face model folder")
    return load_job(resolve_config_path(args.config), [*overrides, *job_overrides(args)])


def check_weights(cfg: dict) -> None:
    """What the ranks will read, checked here before any starts (one line, not a rank's traceback):
    a checkpoint is a published step-N folder whose files match its manifest, as the export requires
    (`flashcp.titan.hf.export.verified_manifest`); an HF folder, the tokenizer and the haystack get
    the launcher's checks (`flashcp.titan.launch.preflight.check_inputs`)."""
    from flashcp.titan.hf.export import ExportError, verified_manifest
    from flashcp.titan.launch.preflight import check_inputs

    ckpt = cfg["checkpoint"]
    if not ckpt["initial_load_in_hf"]:
        try:
            verified_manifest(Path(ckpt["initial_load_path"]), unverified=ckpt["load_unverified"])
        except ExportError as e:
            raise ConfigError(f"--checkpoint: {e}") from e
    check_inputs(cfg)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg = load(argv)
        if "WORLD_SIZE" in os.environ:  # a rank started by torchrun
            return _rank(cfg)
        nproc, on_gpu = ranks.ranks_per_node(world_size_hint(cfg), 1)
        check_layout(cfg, nproc, has_cuda=on_gpu)
        check_weights(cfg)
    except (ConfigError, DataError, TokenizerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "-m", "flashcp.titan.probe", *argv]  # fmt: skip
    return subprocess.run(command).returncode


def _rank(cfg: dict) -> int:
    """One rank: the job's trainer, the weights loaded, the probe run once; rank 0 reports."""
    import torch
    from torchtitan.tools.logging import init_logger

    from flashcp.titan.components.checkpoint import CheckpointError
    from flashcp.titan.launch.job import trainer_config
    from flashcp.titan.probe import loop
    from flashcp.titan.probe.report import table
    from flashcp.titan.trainer import FlashCPTrainer

    init_logger()
    rank = int(os.environ.get("RANK", "0"))
    try:
        check_layout(cfg, int(os.environ["WORLD_SIZE"]), has_cuda=torch.cuda.is_available())
        trainer = FlashCPTrainer(trainer_config(cfg))
    except (ConfigError, DataError, TokenizerError, CheckpointError, NodeLayoutError) as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        trainer.checkpointer.load(step=-1)  # the output folder holds no checkpoint: the initial load
        result = loop.run(trainer, trainer.probe, trainer.step)
    except (DataError, CheckpointError) as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        trainer.close()
    if rank == 0:
        out = Path(cfg["job"]["dump_folder"])
        record = {"step": result.step, "lengths": result.lengths, "depths": result.depths,
                  "accuracy": result.accuracy.tolist(), "logprob": result.logprob.tolist(),
                  "tokens": result.tokens}  # fmt: skip
        (out / "probe.json").write_text(json.dumps(record, indent=1) + "\n")
        print(f"probe of {cfg['checkpoint']['initial_load_path']}: accuracy {result.mean_accuracy:.3f} "
              f"({result.tokens:,} tokens); accuracy / log-prob of an answer token by depth and length:\n"
              f"{table(result)}\nwritten to {out}", flush=True)  # fmt: skip
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0
