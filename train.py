"""One rank of a FlashCP training job (run_train.sh starts one per device through torchrun).

    torchrun --nproc_per_node 4 train.py --config debug_cpu --training.steps 20

The job file is read and checked against the launch's world size before any process group
exists; then TorchTitan's trainer (with FlashCP's context-parallel dimension) runs it. Errors
of the job itself (config, data, tokenizer, checkpoint, attention backend) end the rank with
exit code 2 and one line naming the problem, also recorded for the launcher to print once; any
other failure (DCP's CheckpointException, a BaseException, included) is recorded as its root cause
and exits 1, its traceback kept in the rank's log; a rank holds 1 MiB next to its log so that both
still fit when the disk fills up.

Started by `flashcp.run.launch` (FLASHCP_LAUNCHER holds its PID), a rank dies with the launcher,
even a SIGKILLed one: torchrun starts each rank in a session of its own, where nothing else would
stop it. Started by plain torchrun, rank 0 takes the dump folder's lock itself.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import sys
import threading
import time
import traceback

PR_SET_PDEATHSIG = 1  # linux/prctl.h
RESERVED_BYTES = 1 << 20  # room for a traceback and the error file on a full disk


def reserve_room_to_report() -> str | None:
    """Hold RESERVED_BYTES on the file system of this rank's log and error file; the path, or None.

    A save that fills the disk used to leave no trace: the rank's log stopped at its last whole
    block and the error file came out empty (torchrun's agent then crashed parsing it). Released
    as the rank ends, the reservation is the room for its traceback and one-line reason.
    """
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not error_file:
        return None
    path = f"{error_file}.reserved"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.posix_fallocate(fd, 0, RESERVED_BYTES)
        finally:
            os.close(fd)
    except OSError:  # already this short of space: the launcher's free-space check reports that case
        _release(path)
        return None
    return path


def _release(reserved: str | None) -> None:
    if reserved:
        try:
            os.remove(reserved)
        except FileNotFoundError:
            pass


def _record_for_launcher(message: str) -> None:
    """Write the message where torchrun's agent reads a failed worker's reason (whole or not at all)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        with open(f"{path}.partial", "w") as f:
            json.dump({"message": message, "timestamp": str(int(time.time()))}, f)
        os.replace(f"{path}.partial", path)


def die_with_launcher() -> None:
    """Have the kernel SIGKILL this rank when the launcher dies (Linux), else poll for it."""
    launcher = int(os.environ.get("FLASHCP_LAUNCHER", "0") or 0)
    if launcher <= 1:
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        armed = libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):  # not Linux
        armed = False
    if os.getppid() != launcher:  # it died before the signal was armed
        os._exit(1)
    if not armed:
        def watch() -> None:
            while os.getppid() == launcher:
                time.sleep(1.0)
            os._exit(1)

        threading.Thread(target=watch, name="flashcp-launcher-watch", daemon=True).start()


def run(config_name: str | None, overrides: list[str]) -> None:
    from flashcp.titan.config import check_layout, load_job, resolve_config_path
    from flashcp.run.ownership import check_writable, RunLock

    cfg = load_job(resolve_config_path(config_name), overrides)
    check_layout(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    if not os.environ.get("FLASHCP_LAUNCHER") and os.environ.get("RANK", "0") == "0":
        from flashcp.run.launch import output_folders

        check_writable(output_folders(cfg))
        with RunLock(cfg["job"]["dump_folder"]):
            _train(cfg)
    else:
        _train(cfg)


def _train(cfg: dict) -> None:
    import torch
    from torchtitan.tools.logging import init_logger, logger

    from flashcp.titan.config import ConfigError
    from flashcp.titan.job import trainer_config
    from flashcp.data.sources import DataError
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

    from flashcp.attention import BackendUnavailable
    from flashcp.titan.checkpoint import CheckpointError, root_cause
    from flashcp.titan.config import ConfigError
    from flashcp.run.ownership import FolderInUse, NotWritable
    from flashcp.data.sources import DataError
    from flashcp.data.tokenizer import TokenizerError

    job_errors = (ConfigError, DataError, TokenizerError, CheckpointError, BackendUnavailable, FolderInUse,
                  NotWritable)  # fmt: skip
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
        _release(reserved)
        traceback.print_exc()  # into this rank's log, whole
        code, message = 1, root_cause(e)
    else:
        return 0
    finally:
        _release(reserved)
    _record_for_launcher(message)
    if not os.environ.get("FLASHCP_LAUNCHER") and rank == "0":
        print(f"error: {message}" if code == 2 else f"error: rank {rank} failed: {message}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
