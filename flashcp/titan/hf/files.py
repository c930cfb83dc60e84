"""Files read from a model folder: regular files that lie inside it, each read with a bound.

What FlashCP reads from a Hugging Face folder (config.json, the safetensors and their index on
import; the tokenizer-side files an export carries) and what an export carries from beside the
job's tokenizer must be the folder's own. A symbolic link is followed only where it stays inside
the folder -- or, in a Hugging Face hub cache snapshot (`<repo>/snapshots/<revision>/`), into the
repository's `blobs/`, where the hub keeps every file the snapshot links to -- and what it reaches
must be a regular file: not a device, a fifo (whose read would block) or a folder. A link out of
the folder is how an export, made to be published, would carry /etc/hostname, another user's key
or another job's node token; it is refused, naming the file. Reads are bounded (`read_member`):
a sparse 1 GiB file is refused by its size, never read whole, and JSON by its nesting too
(`load_json`).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

MAX_JSON_DEPTH = 32  # objects and arrays inside each other; Hugging Face's configs nest 3 deep


class FolderFileError(ValueError):
    """A file of a model folder that must not be read; the message is one line naming it."""


def _roots(folder: Path) -> list[Path]:
    """Where the folder's files may lie: the folder, and a hub snapshot's `blobs/`."""
    real = folder.resolve()
    if real.parent.name == "snapshots":
        return [real, real.parent.parent / "blobs"]
    return [real]


def _kind(mode: int) -> str:
    kinds = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a fifo"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))  # fmt: skip
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def member(folder: Path, name: str) -> Path:
    """The real path of `folder / name` (which must exist, link or not); FolderFileError unless it is a
    regular file inside the folder (see the module docstring)."""
    path = Path(folder) / name
    real = path.resolve()
    if not any(real.is_relative_to(root) for root in _roots(Path(folder))):
        raise FolderFileError(f"{path} is a symbolic link to {real}, outside {folder}: refused (an export is "
                              "published; copy the file into the folder if it belongs to the model)")  # fmt: skip
    try:
        mode = real.stat().st_mode
    except OSError as e:
        raise FolderFileError(f"{path} cannot be read ({type(e).__name__}: {e})") from None
    if not stat.S_ISREG(mode):
        raise FolderFileError(f"{path} is {_kind(mode)}, not a regular file: refused")
    return real


def read_member(folder: Path, name: str, limit: int) -> bytes:
    """The content of `folder / name`, a `member`, refused by name when larger than `limit` bytes;
    opened without following links and without blocking, and checked again once open."""
    path = Path(folder) / name
    real = member(folder, name)
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise FolderFileError(f"{path} is {_kind(info.st_mode)}, not a regular file: refused")
            data = f.read(limit + 1) if info.st_size <= limit else b""
    except OSError as e:
        raise FolderFileError(f"{path} cannot be read ({type(e).__name__}: {e})") from None
    if info.st_size > limit or len(data) > limit:
        raise FolderFileError(f"{path} is {max(info.st_size, len(data)):,} bytes, more than the {limit:,} bytes "
                              "such a file may hold: refused")  # fmt: skip
    return data


def load_json(data: bytes, where: Path | str) -> Any:
    """`data` parsed; FolderFileError naming `where` when it is not JSON or nests deeper than
    MAX_JSON_DEPTH: json's parser, and every reader that recurses after it (json.dumps, transformers),
    would exhaust the stack with a RecursionError instead of a line."""
    too_deep = f"{where} nests objects or arrays more than {MAX_JSON_DEPTH} deep, which no model's config needs: " \
               "fix or remove it"  # fmt: skip
    try:
        value = json.loads(data)
    except RecursionError:
        raise FolderFileError(too_deep) from None
    except ValueError as e:  # also bad UTF-8, and an integer of more digits than Python converts
        raise FolderFileError(f"{where} is not valid JSON ({e}): fix or remove it") from None
    level, depth = [value], 0
    while level := [v for v in level if isinstance(v, (dict, list))]:
        depth += 1
        if depth > MAX_JSON_DEPTH:
            raise FolderFileError(too_deep)
        level = [v for item in level for v in (item.values() if isinstance(item, dict) else item)]
    return value
