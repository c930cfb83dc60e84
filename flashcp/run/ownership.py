"""Who owns a run's output folder, and whether the run can write there at all.

Two launches into one dump folder used to load each other's checkpoints, write the same steps and
mix their TensorBoard files. `RunLock` makes one run the owner of a folder: an exclusive
`fcntl.flock` on `<dump_folder>/.flashcp-run.lock`, which the kernel drops when the holder dies
however it dies, so a crash never leaves a lock that blocks the next launch. The file also names
the holder (host, PID, start time) so that a refused launch can say who holds the folder, and a
launch that takes over from a holder that died without releasing it says so.

`check_writable` runs before any rank starts: a read-only or unwritable output folder used to
surface only when the first checkpoint was saved, after all the training steps of an interval.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

LOCK_NAME = ".flashcp-run.lock"


class FolderInUse(RuntimeError):
    """Another live run holds the output folder."""


class NotWritable(RuntimeError):
    """An output folder cannot be created or written."""


class LockUnavailable(RuntimeError):
    """The folder's lock cannot be taken for a reason other than another run holding it."""


NO_LOCK_HINT = ("set FLASHCP_LOCK=<a file on a local file system> to hold the lock there, or FLASHCP_LOCK=off to "
                "run without one (then nothing stops a second run from writing into this folder)")  # fmt: skip


def check_writable(folders: Iterable[str | Path]) -> None:
    """Create each folder and write (then remove) a probe file there; NotWritable names the first failure."""
    for folder in folders:
        folder = Path(folder)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=folder, prefix=".flashcp-probe-"):
                pass
        except OSError as e:
            reason = e.strerror or type(e).__name__
            raise NotWritable(f"output folder {folder} is not writable: {type(e).__name__}: {reason}") from e


def check_free_space(folder: str | Path, need: int, what: str) -> None:
    """NotWritable when the file system holding `folder` has fewer than `need` bytes free.

    A full disk is otherwise found only when a save fails, and then even the rank logs that would
    say so cannot be written.
    """
    free = shutil.disk_usage(folder).free
    if free < need:
        raise NotWritable(
            f"{folder} has {free / 2**30:.2f} GiB free, less than {what} needs (at least {need / 2**30:.2f} GiB)"
        )


class RunLock:
    """Exclusive ownership of a folder for the life of this process (or until `release`).

    The lock file is `<folder>/.flashcp-run.lock`, or the file `FLASHCP_LOCK` names (for file
    systems without locks; `off`: no lock at all). It is opened without following symbolic links.
    `FLASHCP_BREAK_LOCK=1` breaks a lock whose holder is on another host (a dead node keeps an NFS
    lock for its lease, or forever): the old file is removed and a new one locked, and this says so.
    """

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        chosen = os.environ.get("FLASHCP_LOCK", "")
        self.disabled = chosen == "off"
        self.path = Path(chosen) if chosen and not self.disabled else self.folder / LOCK_NAME
        self._fd: int | None = None
        self.taken_over: dict | None = None  # the previous holder's record when it died holding the lock
        self.broken: dict | None = None  # the holder whose lock FLASHCP_BREAK_LOCK broke

    def acquire(self) -> RunLock:
        """Take the folder or raise FolderInUse naming the holder (LockUnavailable: no lock possible)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        if self.disabled:
            return self
        fd = self._open()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_record(fd)
            os.close(fd)
            if os.environ.get("FLASHCP_BREAK_LOCK") == "1" and holder.get("host") != socket.gethostname():
                self.broken = holder
                os.unlink(self.path)
                return self.acquire()
            hint = ("; if that host is dead, FLASHCP_BREAK_LOCK=1 breaks its lock"
                    if holder.get("host") not in (None, socket.gethostname()) else "")  # fmt: skip
            raise FolderInUse(f"{self.folder} is in use by {_describe(holder)} (lock {self.path}); "
                              f"wait for that run to end or give this one another job.dump_folder{hint}") from None
        except OSError as e:  # ENOLCK, ENOSYS, EOPNOTSUPP: a file system without (working) locks
            os.close(fd)
            raise LockUnavailable(f"cannot lock {self.path}: {e.strerror or e}; {NO_LOCK_HINT}") from None
        self.taken_over = _read_record(fd) or None  # a record left behind: its holder died holding it
        record = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(), "argv": sys.argv}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        os.fsync(fd)
        self._fd = fd
        return self

    def _open(self) -> int:
        try:
            return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            if e.errno == errno.ELOOP:
                why = "is a symbolic link (refused: locking it would write through the link)"
            elif e.errno == errno.EISDIR:
                why = "is a directory"
            else:
                why = f"cannot be opened: {e.strerror or e}"
            raise LockUnavailable(f"lock file {self.path} {why}") from None

    def intact(self) -> bool:
        """Whether the lock file is still the one this process locked (not removed or replaced)."""
        if self._fd is None:
            return True
        try:
            now = os.stat(self.path, follow_symlinks=False)
        except OSError:
            return False
        held = os.fstat(self._fd)
        return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)

    def release(self) -> None:
        """Clear the holder record and drop the lock (a crash drops it too, leaving the record)."""
        if self._fd is None:
            return
        os.ftruncate(self._fd, 0)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def describe_stale(record: dict) -> str:
    """One line for the log when a launch takes over a folder whose previous run died holding it."""
    return f"{_describe(record)} ended without releasing its output folder (crashed or killed); taking it over"


def describe_broken(record: dict) -> str:
    return f"FLASHCP_BREAK_LOCK=1: broke the lock of {_describe(record)}"


def _read_record(fd: int) -> dict:
    try:
        data = os.pread(fd, 65536, 0)
        return json.loads(data) if data.strip() else {}
    except (OSError, ValueError):
        return {"unreadable": True}


def _describe(record: dict) -> str:
    if not record or "pid" not in record:
        return "another run (its lock file names no holder)"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.get("started", 0)))
    return f"the run of PID {record['pid']} on host {record.get('host', '?')} since {since}"
