"""Check a job, then start `train.py` on every device of this node through torchrun.

    python -m flashcp.run.launch [--config NAME_OR_PATH] [--section.key value ...]

Ranks per node: `NGPU`, else the visible GPUs, else (no GPU: gloo on CPU) the world size the
job's layout fixes, or 2. Multi-node jobs pass torchrun's rendezvous through the environment:
`NNODES`, `NODE_RANK`, `MASTER_ADDR`, `MASTER_PORT`, or `RDZV_ENDPOINT` (+ `RDZV_ID`,
`RDZV_BACKEND`). `LOG_RANK` (default 0) picks the local ranks shown on the console; every
rank's full log goes to `<dump_folder>/logs/`. SIGTERM / Ctrl-C stop the run at the next step
boundary with a checkpoint; `FLASHCP_STOP_TIMEOUT` (default 600 s) is how long the ranks get for
that save before they are killed; a second Ctrl-C stops at once.

The launcher owns its run: it holds the dump folder's lock (`flashcp.run.ownership`) while the
ranks run, so a second launch into the same folder is refused with the holder's host and PID, and
the ranks die with it (train.py arms a parent-death signal), also when it is SIGKILLed.

The job file is validated for the resulting world size before anything is spawned, and a failed
run ends with the failing rank's one-line reason instead of torchrun's traceback.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from flashcp.titan.config import check_layout, ConfigError, load_job, resolve_config_path, world_size_hint
from flashcp.run.ownership import check_free_space, check_writable, describe_stale, FolderInUse, NotWritable
from flashcp.run.ownership import RunLock
from flashcp.run.preemption import ForwardStop, TORCHRUN_SIGNALS
from flashcp.titan.preflight import check_inputs, checkpoint_bytes
from flashcp.data.sources import DataError
from flashcp.data.tokenizer import TokenizerError

TRAIN_PY = Path(__file__).resolve().parents[2] / "train.py"
SHOWN_RANKS = os.environ.get("LOG_RANK", "0")  # local ranks whose output reaches the console


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name) or str(default)
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(f"environment variable {name} must be a positive integer, got {value!r}")
    return int(value)


def ranks_per_node(hint: int | None, nnodes: int) -> tuple[int, bool]:
    """(ranks on this node, whether they use GPUs)."""
    import torch

    gpus = torch.cuda.device_count()
    if os.environ.get("NGPU"):
        return env_int("NGPU", 1), gpus > 0
    if gpus:
        return gpus, True
    if hint is not None and hint % nnodes == 0:
        return hint // nnodes, False
    return 2, False


def torchrun_args(nproc: int, nnodes: int, log_dir: str, argv: list[str]) -> list[str]:
    env = os.environ
    args = [f"--nproc_per_node={nproc}", f"--nnodes={nnodes}"]
    if env.get("RDZV_ENDPOINT"):
        args += [
            f"--rdzv_endpoint={env['RDZV_ENDPOINT']}",
            f"--rdzv_backend={env.get('RDZV_BACKEND', 'c10d')}",
            f"--rdzv_id={env.get('RDZV_ID', 'flashcp')}",
        ]
    elif nnodes > 1 or env.get("MASTER_ADDR"):
        args += [
            f"--node_rank={env.get('NODE_RANK', '0')}",
            f"--master_addr={env.get('MASTER_ADDR', '127.0.0.1')}",
            f"--master_port={env.get('MASTER_PORT', '29500')}",
        ]
    else:
        args.append("--standalone")
    args.append(f"--signals-to-handle={TORCHRUN_SIGNALS}")  # SIGTERM / SIGINT: flashcp.run.preemption
    args += [f"--local-ranks-filter={SHOWN_RANKS}", "--tee=3", f"--log-dir={log_dir}"]
    return [*args, str(TRAIN_PY), *argv]


def output_folders(cfg: dict) -> list[str]:
    """The folders a run writes to: dump folder, rank logs, checkpoints and TensorBoard when enabled."""
    dump = cfg["job"]["dump_folder"]
    folders = [dump, os.path.join(dump, "logs")]
    if cfg["checkpoint"]["enable"]:
        folders.append(os.path.join(dump, cfg["checkpoint"]["folder"]))
    if cfg["metrics"]["enable_tensorboard"]:
        folders.append(os.path.join(dump, cfg["metrics"]["save_tb_folder"]))
    return folders


def parse_args(argv: list[str]) -> tuple[str | None, list[str]]:
    """(config name or None for the default, overrides); ConfigError for a `--config` without a value."""
    config_name, overrides = None, []
    i = 0
    while i < len(argv):
        if argv[i] == "--config" or argv[i].startswith("--config="):
            name, _, value = argv[i].partition("=")
            if not _:
                value = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else ""
                i += 1
            if not value:
                raise ConfigError("--config needs a job file: a path or a name in train_configs/")
            config_name, i = value, i + 1
        else:
            overrides.append(argv[i])
            i += 1
    return config_name, overrides


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        return 0
    try:
        config_name, overrides = parse_args(argv)
        nnodes = env_int("NNODES", 1)
        stop_timeout = env_int("FLASHCP_STOP_TIMEOUT", 600)
        if nnodes > 1 and not (os.environ.get("MASTER_ADDR") or os.environ.get("RDZV_ENDPOINT")):
            raise ConfigError(f"NNODES={nnodes} needs MASTER_ADDR (node 0's address) or RDZV_ENDPOINT")
        path = resolve_config_path(config_name)
        cfg = load_job(path, overrides)
        nproc, on_gpu = ranks_per_node(world_size_hint(cfg), nnodes)
        check_layout(cfg, nproc * nnodes, has_cuda=on_gpu)
        vocab = check_inputs(cfg)
        check_writable(output_folders(cfg))
        if cfg["checkpoint"]["enable"]:
            folder = os.path.join(cfg["job"]["dump_folder"], cfg["checkpoint"]["folder"])
            check_free_space(folder, checkpoint_bytes(cfg, vocab), "one checkpoint of this model")
        # One launcher owns the folder: node 0's (the others share it on a shared file system).
        lock = RunLock(cfg["job"]["dump_folder"]).acquire() if os.environ.get("NODE_RANK", "0") == "0" else None
    except (ConfigError, DataError, TokenizerError, FolderInUse, NotWritable) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        if lock is not None and lock.taken_over:
            print(f"flashcp: {describe_stale(lock.taken_over)}", flush=True)
        return _launch(cfg, path, nproc, nnodes, on_gpu, overrides, stop_timeout)
    finally:
        if lock is not None:
            lock.release()


def _launch(cfg: dict, path: Path, nproc: int, nnodes: int, on_gpu: bool, overrides: list[str],
            stop_timeout: int) -> int:  # fmt: skip
    """Run torchrun's agent in this process until every rank has ended; the exit code of the run."""
    os.environ["FLASHCP_LAUNCHER"] = str(os.getpid())  # the ranks' parent: they die with it
    os.environ.setdefault("PYTHONUNBUFFERED", "1")  # rank logs written as they come, whole up to a crash
    if not on_gpu:  # share the cores between the ranks instead of oversubscribing them
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    log_dir = os.path.join(cfg["job"]["dump_folder"], "logs")
    device = "GPU" if on_gpu else "CPU (gloo)"
    print(f"flashcp: {path.resolve()} on {nnodes} node(s) x {nproc} {device} rank(s), "
          f"output in {cfg['job']['dump_folder']}", flush=True)

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    stop = ForwardStop(stop_timeout)  # SIGTERM / SIGINT: the ranks save at their next step boundary
    stop.install()
    try:
        dump = f"--job.dump_folder={cfg['job']['dump_folder']}"  # absolute: every rank agrees
        args = torchrun_args(nproc, nnodes, log_dir, [f"--config={path}", *overrides, dump])
        run(get_args_parser().parse_args(args))
    except KeyboardInterrupt:
        print(f"flashcp: {signal.Signals(stop.signum).name} before the ranks started: nothing saved", flush=True)
        return 128 + stop.signum
    except SignalException as e:  # SIGHUP / SIGQUIT: torchelastic stopped the ranks
        print(f"flashcp: {e.sigval.name}: the ranks were stopped without a checkpoint", flush=True)
        return 128 + e.sigval
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        if stop.forced:
            print(f"flashcp: ranks killed on {stop.forced}: no checkpoint at this step; full logs: {log_dir}",
                  file=sys.stderr)  # fmt: skip
            return 128 + stop.signum
        if stop.signum and failure.exitcode == -signal.SIGTERM:  # a rank not yet catching signals
            print(f"flashcp: {signal.Signals(stop.signum).name} while the ranks started: nothing saved", flush=True)
            return 128 + stop.signum
        message = failure.message  # a dict when train.py recorded its reason in the error file
        detail = message if isinstance(message, str) else message.get("message", "")
        if failure.exitcode == 2:  # a job error train.py already explained in one line
            print(f"error: {detail}", file=sys.stderr)
            return 2
        print(f"full logs of every rank: {log_dir}", file=sys.stderr)
        print(f"error: rank {rank} failed (exit code {failure.exitcode}): {detail}", file=sys.stderr)
        return 1
    finally:
        stop.close()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # Ctrl-C before the ranks started: nothing to save, no traceback
        sys.exit(128 + signal.SIGINT)
