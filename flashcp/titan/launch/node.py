"""Check a job, then start `train.py` on every device of this node through torchrun.

    python -m flashcp.titan.launch [--config NAME_OR_PATH] [--section.key value ...]

Ranks per node: `NGPU`, else the visible GPUs, else (no GPU: gloo on CPU) the world size the
job's layout fixes, or 2. Multi-node jobs pass torchrun's rendezvous through the environment:
`NNODES`, `NODE_RANK`, `MASTER_ADDR`, `MASTER_PORT`, or `RDZV_ENDPOINT` (+ `RDZV_BACKEND`);
`RUN_ID` names the job (default: derived from the dump folder), `MAX_RESTARTS` lets torchrun
restart a failed group, which resumes from the newest complete checkpoint. `LOG_RANK` (default 0)
picks the local ranks shown on the console; every rank's full log goes to
`<dump_folder>/logs/<time>-node<k>-<host>/`. SIGTERM / Ctrl-C stop the run at the next step
boundary with a checkpoint; `FLASHCP_STOP_TIMEOUT` (default 600 s) is how long the ranks get for
that save before they are killed; a second Ctrl-C stops at once.

Before anything is spawned the job file is validated for the resulting world size and its inputs
are opened. The nodes of a multi-node job then meet (`flashcp.run.rendezvous`): one holds the
locks, the others refuse another job, other settings, a taken node slot or a folder they do not
share; each then waits for all of them (up to `comm.init_timeout_seconds`; Ctrl-C / SIGTERM stop
it). The output folders are checked (writable, room for a checkpoint) and held by a lock
(`flashcp.run.ownership`; `FLASHCP_LOCK` = a lock file elsewhere or `off`, `FLASHCP_BREAK_LOCK=1`
breaks a dead host's lock) while the ranks run (`flashcp.run.launch`), so a second launch into
the same folders is refused with the holder's host and PID.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

from flashcp.data.errors import DataError
from flashcp.data.tokenizer import TokenizerError
from flashcp.run import launch as ranks
from flashcp.run import rendezvous
from flashcp.run.ownership import check_free_space, check_writable, describe_broken, describe_stale, FolderInUse
from flashcp.run.ownership import LockUnavailable, NotWritable, RunLock
from flashcp.titan.config import check_layout, ConfigError, load_job, resolve_config_path, world_size_hint
from flashcp.titan.launch.preflight import check_cpu_memory, check_inputs, check_offload_memory, checkpoint_bytes

ROOT = Path(__file__).resolve().parents[3]


def output_folders(cfg: dict) -> list[str]:
    """The folders a run writes to: dump folder, rank logs, checkpoints and TensorBoard when enabled."""
    dump = cfg["job"]["dump_folder"]
    folders = [dump, os.path.join(dump, "logs")]
    if cfg["checkpoint"]["enable"]:
        folders.append(os.path.join(dump, cfg["checkpoint"]["folder"]))
    if cfg["metrics"]["enable_tensorboard"]:
        folders.append(os.path.join(dump, cfg["metrics"]["save_tb_folder"]))
    return folders


def check_cpu_ranks(cfg: dict, nproc: int, nnodes: int, on_gpu: bool) -> None:
    """The layout for this many ranks; on a machine without GPUs, first whether the model fits its
    memory, and a layout that does not fit the assumed world size says it was assumed."""
    world = nproc * nnodes
    if on_gpu:
        check_layout(cfg, world, has_cuda=True)
        return
    check_cpu_memory(cfg, nproc, world)
    try:
        check_layout(cfg, world, has_cuda=False)
    except ConfigError as e:
        if os.environ.get("NGPU"):
            raise
        how = "the job's layout" if world_size_hint(cfg) else "the default for CPU runs"
        raise ConfigError(
            f"no GPU found, so the job was laid out on {world} CPU rank(s) ({how}; set NGPU to the ranks per "
            f"node to choose): {e}"
        ) from e


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


def hold_folders(cfg: dict) -> list[RunLock]:
    """Lock every folder the run writes that is not inside another one (the dump folder, and a
    checkpoint or TensorBoard folder configured elsewhere); FolderInUse names a holder."""
    roots: list[Path] = []
    for folder in sorted({Path(f).resolve() for f in output_folders(cfg)}, key=lambda f: len(f.parts)):
        if not any(folder.is_relative_to(root) for root in roots):
            roots.append(folder)
    held: list[RunLock] = []
    try:
        for root in roots:
            held.append(RunLock(root).acquire())
    except BaseException:
        release(held)
        raise
    return held


def release(locks: list[RunLock]) -> None:
    for lock in locks:
        lock.release()


def settings(cfg: dict) -> dict[str, object]:
    """The resolved job as "section.key" -> value: what every node of a job must agree on."""
    return {f"{section}.{key}": value for section, keys in cfg.items() if isinstance(keys, dict)
            for key, value in keys.items()}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        return 0
    locks: list[RunLock] = []
    meeting = None
    try:
        config_name, overrides = parse_args(argv)
        nnodes = ranks.nodes()
        stop_timeout = ranks.env_int("FLASHCP_STOP_TIMEOUT", 600)
        ranks.restarts()
        path = resolve_config_path(config_name)
        cfg = load_job(path, overrides)
        nproc, on_gpu = ranks.ranks_per_node(world_size_hint(cfg), nnodes)
        check_cpu_ranks(cfg, nproc, nnodes, on_gpu)
        check_offload_memory(cfg, nproc, nproc * nnodes)
        vocab = check_inputs(cfg)
        dump = cfg["job"]["dump_folder"]
        run_id = rendezvous.run_id(dump)
        if ranks.multi_node(nnodes):  # nothing is written before this node is known to belong to the job
            card = rendezvous.JobCard(run_id, settings(cfg), rendezvous.code_fingerprint(ROOT))

            def take_locks() -> Callable[[], None]:
                check_writable(output_folders(cfg))
                locks.extend(hold_folders(cfg))
                return lambda: release(locks)

            timeout = cfg["comm"]["init_timeout_seconds"]
            meeting = rendezvous.meet(card, dump, nnodes, ranks.node_rank(), timeout, take_locks)
            meeting.wait_for_nodes(nnodes, timeout)
        else:
            check_writable(output_folders(cfg))
            locks = hold_folders(cfg)
        if cfg["checkpoint"]["enable"]:
            folder = os.path.join(dump, cfg["checkpoint"]["folder"])
            check_free_space(folder, checkpoint_bytes(cfg, vocab), "one checkpoint of this model")
    except (ConfigError, ranks.LaunchError, rendezvous.JobMismatch, DataError, TokenizerError, FolderInUse,
            NotWritable, LockUnavailable) as e:  # fmt: skip
        if meeting is not None:  # refused after the meeting: its secret, store and slot go too
            meeting.close()
        release(locks)
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        for lock in locks:
            if lock.broken:
                print(f"flashcp: {describe_broken(lock.broken)}", flush=True)
            elif lock.taken_over:
                print(f"flashcp: {describe_stale(lock.taken_over)}", flush=True)
        for line in cfg["_warnings"]:  # after every check passed: a refused job prints only its error
            print(f"flashcp: warning: {line}", flush=True)
        device = "GPU" if on_gpu else "CPU (gloo)"
        print(f"flashcp: {path.resolve()} on {nnodes} node(s) x {nproc} {device} rank(s), output in {dump}",
              flush=True)  # fmt: skip
        if cfg["model"]["attention"] == "flashcp":  # how the DP groups are planned, once (scope.resolve_scope)
            print(f"flashcp: {cfg['_scope']}", flush=True)
        argv = [f"--config={path}", *overrides, f"--job.dump_folder={dump}"]  # absolute: every rank agrees
        return ranks.launch(dump, argv, nproc, nnodes, on_gpu, stop_timeout, run_id, locks)
    finally:
        if meeting is not None:
            meeting.close()
        release(locks)

