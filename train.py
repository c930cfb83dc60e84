"""One rank of a FlashCP training job (run_train.sh starts one per device through torchrun).

    torchrun --nproc_per_node 4 train.py --config debug_cpu --training.steps 20

The job file is read and checked against the launch's world size before any process group
exists; then TorchTitan's trainer (with FlashCP's context-parallel dimension) runs it. Errors
of the job itself (config, data, tokenizer, checkpoint, attention backend) end the rank with
exit code 2 and one line naming the problem, also recorded for the launcher to print once.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _record_for_launcher(message: str) -> None:
    """Write the message where torchrun's agent reads a failed worker's reason."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        with open(path, "w") as f:
            json.dump({"message": message, "timestamp": str(int(time.time()))}, f)


def run(config_name: str | None, overrides: list[str]) -> None:
    from flashcp.titan.config import check_layout, ConfigError, load_job, resolve_config_path

    cfg = load_job(resolve_config_path(config_name), overrides)
    check_layout(cfg, int(os.environ.get("WORLD_SIZE", "1")))

    import torch
    from torchtitan.tools.logging import init_logger, logger

    from flashcp.titan.sources import DataError
    from flashcp.titan.job import trainer_config
    from flashcp.titan.tokenizer import TokenizerError
    from flashcp.titan.trainer import FlashCPTrainer

    init_logger()
    try:
        config = trainer_config(cfg)
    except (ConfigError, DataError, TokenizerError):
        raise
    except ValueError as e:  # TorchTitan's own config checks
        raise ConfigError(str(e)) from e
    logger.info(f"job {cfg['_path']}: {cfg['job']['description']}")
    trainer = FlashCPTrainer(config)
    try:
        if config.checkpoint.create_seed_checkpoint:
            trainer.checkpointer.save(curr_step=0, last_step=True)
            logger.info(f"seed checkpoint saved under {trainer.checkpointer.folder}/step-0")
        else:
            trainer.train()
    finally:
        trainer.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", help="job file path or name in train_configs/ (default: default.toml)")
    args, overrides = parser.parse_known_args(argv)

    from torch.distributed.elastic.multiprocessing.errors import record

    from flashcp.attention import BackendUnavailable
    from flashcp.titan.components import CheckpointError
    from flashcp.titan.config import ConfigError
    from flashcp.titan.sources import DataError
    from flashcp.titan.tokenizer import TokenizerError

    try:
        record(run)(args.config, overrides)
    except (ConfigError, DataError, TokenizerError, CheckpointError, BackendUnavailable) as e:
        message = f"{type(e).__name__}: {e}"
        _record_for_launcher(message)
        if not os.environ.get("FLASHCP_LAUNCHER") and os.environ.get("RANK", "0") == "0":
            print(f"error: {message}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
