"""The rank's half of the launcher contract: die with the launcher, keep room to report, report.

Started by `flashcp.run.launch` (FLASHCP_LAUNCHER holds its PID), a rank dies with the launcher,
even a SIGKILLed one: torchrun starts each rank in a session of its own, where nothing else would
stop it. A rank holds 1 MiB next to its log so that its traceback and its one-line reason (the
error file torchrun's agent reads, written whole or not at all) still fit when the disk fills up.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import threading
import time

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
        release(path)
        return None
    return path


def release(reserved: str | None) -> None:
    if reserved:
        try:
            os.remove(reserved)
        except FileNotFoundError:
            pass


def record_for_launcher(message: str) -> None:
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
