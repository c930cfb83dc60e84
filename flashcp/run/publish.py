"""Publishing a checkpoint folder whole: what makes a save atomic, whatever writes its files.

Every rank writes into `step-N.partial-<save id>/`; once all of them have written and the manifest
(`flashcp.run.manifest`) is in place, the folder is published by a rename. An existing `step-N` is
first renamed to `step-N.replaced-<save id>` and removed only after the new one is in place, so a
kill at any moment leaves a complete, loadable step N under one name or the other. A checkpoint is
complete when its `.metadata` (DCP's, written last) and its manifest are in a published folder.

Also here: naming the real cause of a failed save or load (an OSError beneath DCP's wrappers, a
full disk that torch's zip writer reports only as a bad position).
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint.api as dcp_api

from flashcp.run.manifest import MANIFEST

STEP_DIR = re.compile(r"step-(\d+)(?:\.replaced-[0-9a-f]+)?")
LEFTOVER_DIR = re.compile(r"step-(\d+)\.(partial|replaced)-[0-9a-f]+")


@dataclass(frozen=True)
class Candidate:
    step: int
    path: Path
    problem: str | None  # why it cannot be verified: no .metadata, or no manifest


def published_checkpoints(folder: Path) -> list[Candidate]:
    """Every published step folder, newest step first (at one step, `step-N` before a `.replaced-` copy).

    One without `.metadata` (DCP's, written last) or without a manifest carries its `problem`:
    verification cannot be switched off by deleting a file, so such a folder is damaged, not skipped
    in silence and not loaded unverified.
    """
    if not folder.is_dir():
        return []
    found = []
    for path in folder.iterdir():
        match = STEP_DIR.fullmatch(path.name)
        if match and path.is_dir():
            problem = ("no .metadata (an incomplete save, or not a DCP checkpoint)" if not (path / ".metadata").is_file()
                       else f"no {MANIFEST}, so its files cannot be verified" if not (path / MANIFEST).is_file()
                       else None)  # fmt: skip
            found.append(Candidate(int(match.group(1)), path, problem))
    return sorted(found, key=lambda c: (c.step, c.path.name == f"step-{c.step}"), reverse=True)


def agreed_token() -> str:
    """A fresh id, the same on every rank (rank 0's)."""
    token = [uuid.uuid4().hex[:12] if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(token, src=0)
    return token[0]


def publish(partial: Path, target: Path, save_id: str) -> Path | None:
    """Rename `partial` to `target`; an existing target stays complete under another name until
    then, which is returned for deletion."""
    replaced = target.with_name(f"{target.name}.replaced-{save_id}")
    if target.exists():
        os.rename(target, replaced)
    os.rename(partial, target)
    fsync_dir(target.parent)
    return replaced if replaced.exists() else None


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


FULL_DISK_BYTES = 4 << 20  # less free than this after a failed save: the disk is full


@contextmanager
def full_disk_named(folder: Path) -> Iterator[None]:
    """Re-raise a failed save as ENOSPC when its file system is full.

    torch's zip writer reports a short write as `RuntimeError: ... unexpected pos 704 vs 598`, with
    no OSError beneath it: the real cause would appear nowhere. The original error stays chained.
    """
    try:
        yield
    except BaseException as e:
        if isinstance(e, (KeyboardInterrupt, SystemExit)) or os_error_in(e) is not None:
            raise
        existing = next((p for p in (folder, *folder.parents) if p.exists()), None)
        if existing is None or shutil.disk_usage(existing).free >= FULL_DISK_BYTES:
            raise
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(folder)) from e


def os_error_in(e: BaseException) -> OSError | None:
    """The first OSError among `e`, the rank failures a DCP exception carries, and their causes."""
    return error_in(e, OSError)


def error_in(e: BaseException, kind: type[BaseException]) -> Any:
    """The first `kind` among `e`, the rank failures a DCP exception carries, and their causes."""
    if isinstance(e, dcp_api.CheckpointException) and e.failures:
        e = next(iter(e.failures.values()))[0]
    chain, link = [], e
    while link is not None and link not in chain:
        chain.append(link)
        link = link.__cause__ or link.__context__
    return next((link for link in chain if isinstance(link, kind)), None)


def root_cause(e: BaseException) -> str:
    """The first rank's underlying error of a DCP failure, in one line."""
    os_error = os_error_in(e)
    if os_error is not None:
        e = os_error
    elif isinstance(e, dcp_api.CheckpointException) and e.failures:
        e = next(iter(e.failures.values()))[0]
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__
