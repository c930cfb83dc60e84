"""One rank of a FlashCP training job (run_train.sh starts one per device through torchrun).

    torchrun --nproc_per_node 4 train.py --config debug_cpu --training.steps 20

The job file is read and checked against the launch's world size before any process group
exists; then TorchTitan's trainer (with FlashCP's context-parallel dimension) runs it. Errors
of the job itself (config, data, tokenizer, checkpoint, attention backend, the nodes of a CP group
the two-level exchange cannot route) end the rank with exit code 2 and one line naming the
problem, also recorded for the launcher to print once; any other failure (DCP's
CheckpointException, a BaseException, included) is recorded as its root cause and exits 1, its
traceback kept in the rank's log; a rank holds 1 MiB next to its log so that both still fit when
the disk fills up (`flashcp.run.rank`). Started by the launcher, a rank dies with it; started by
plain torchrun, rank 0 takes the dump folder's lock itself.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import traceback

from flashcp.run.rank import die_with_launcher, record_for_launcher, release, reserve_room_to_report


def run(config_name: str | None, overrides: list[str]) -> None:
    from flashcp.run.ownership import check_writable
    from flashcp.titan.config import check_layout, load_job, resolve_config_path

    cfg = load_job(resolve_config_path(config_name), overrides)
    check_layout(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    if not os.environ.get("FLASHCP_LAUNCHER") and os.environ.get("RANK", "0") == "0":
        from flashcp.titan.launch.node import hold_folders, output_folders, release

        check_writable(output_folders(cfg))
        locks = hold_folders(cfg)
        try:
            _train(cfg)
        finally:
            release(locks)
    else:
        _train(cfg)


def _train(cfg: dict) -> None:
    import torch
    from torchtitan.tools.logging import init_logger, logger

    from flashcp.titan.config import ConfigError
    from flashcp.titan.launch.job import trainer_config
    from flashcp.data.errors import DataError
    from flashcp.data.tokenizer import TokenizerError
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
    die_with_launcher()

    from flashcp.attention import BackendUnavailable, NodeLayoutError
    from flashcp.data.errors import DataError
    from flashcp.data.tokenizer import TokenizerError
    from flashcp.run.ownership import FolderInUse, LockUnavailable, NotWritable
    from flashcp.run.publish import root_cause
    from flashcp.titan.components.checkpoint import CheckpointError
    from flashcp.titan.config import ConfigError

    job_errors = (ConfigError, DataError, TokenizerError, CheckpointError, BackendUnavailable, NodeLayoutError,
                  FolderInUse, NotWritable, LockUnavailable)  # fmt: skip
    rank = os.environ.get("RANK", "0")
    reserved = reserve_room_to_report()
    try:
        run(args.config, overrides)
    except job_errors as e:
        code, message = 2, f"{type(e).__name__}: {e}"
    except KeyboardInterrupt:  # before the trainer catches signals: nothing trained yet, no traceback
        return 128 + signal.SIGINT
    except SystemExit:
        raise
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        release(reserved)
        traceback.print_exc()  # into this rank's log, whole
        code, message = 1, root_cause(e)
    else:
        return 0
    finally:
        release(reserved)
    record_for_launcher(message)
    if not os.environ.get("FLASHCP_LAUNCHER") and rank == "0":
        print(f"error: {message}" if code == 2 else f"error: rank {rank} failed: {message}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
