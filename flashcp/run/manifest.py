"""What a checkpoint save wrote: every file's size and CRC-32, checked before anything is loaded.

A DCP checkpoint is one `.metadata` plus per-rank `__<rank>_<n>.distcp` files. DCP itself checks
neither: bytes overwritten in place, or one rank's file from another save under the same
`.metadata`, load silently. Each rank hashes the files it wrote (its `__<rank>_*` files; rank 0 also
`.metadata`), rank 0 writes them all to `manifest.json` under the save's id, and a load first
checks every listed file (and that no other data file is present), each rank a share of them.

CRC-32 (zlib) because it is in the standard library and runs at memory-bandwidth-like speed; it
detects accidental damage, which is what this guards against, not tampering.
(`python benchmarks/checkpoint.py` measures its cost.)
"""

from __future__ import annotations

import json
import os
import re
import zlib
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
FORMAT = 1
CHUNK = 16 << 20


def checksum(path: Path) -> str:
    crc = 0
    with open(path, "rb", buffering=0) as f:
        while block := f.read(CHUNK):
            crc = zlib.crc32(block, crc)
    return f"crc32:{crc:08x}"


def rank_entries(folder: Path, rank: int) -> list[dict[str, Any]]:
    """Name, size and checksum of the files `rank` wrote into a checkpoint folder."""
    mine = re.compile(rf"__{rank}_\d+\.distcp")
    names = sorted(p.name for p in folder.iterdir() if mine.fullmatch(p.name))
    if rank == 0:
        names.append(".metadata")
    return [{"name": n, "size": (folder / n).stat().st_size, "checksum": checksum(folder / n), "rank": rank}
            for n in names]  # fmt: skip


def write_manifest(folder: Path, save_id: str, entries: list[dict[str, Any]],
                   model: dict[str, Any] | None = None) -> None:  # fmt: skip
    """`model`: what the checkpoint holds, for tools that read it without the job (the HF export)."""
    path = folder / MANIFEST
    manifest = {"format": FORMAT, "save_id": save_id, "files": sorted(entries, key=lambda e: e["name"])}
    if model is not None:
        manifest["model"] = model
    with open(path, "w") as f:
        json.dump(manifest, f)
        f.flush()
        os.fsync(f.fileno())


def read_manifest(folder: Path) -> dict[str, Any]:
    """The manifest, or one with a `problem` (and no files) when it cannot be read or is malformed.

    Every caller treats the `problem` as a damaged checkpoint (`verify_files` reports it), so a
    manifest that is JSON but not a manifest (a list, an entry without its size, a number for a
    name) is one line naming manifest.json, never an AttributeError or KeyError further on.
    """
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        return {"problem": f"{MANIFEST}: unreadable ({type(e).__name__}: {e})", "files": []}
    problem = _malformed(manifest)
    if problem is not None:
        return {"problem": f"{MANIFEST}: {problem}", "files": []}
    return manifest


def _malformed(manifest: Any) -> str | None:
    """What makes parsed JSON not a manifest this version wrote, or None."""
    if not isinstance(manifest, dict):
        return f"malformed (a JSON {type(manifest).__name__}, not an object)"
    if manifest.get("format") != FORMAT:
        return f"unknown format {manifest.get('format')!r} (this version reads format {FORMAT})"
    files = manifest.get("files")
    if not isinstance(files, list):
        return f"malformed (files is {type(files).__name__}, not a list)"
    for i, entry in enumerate(files):
        if not isinstance(entry, dict):
            return f"malformed (files[{i}] is a JSON {type(entry).__name__}, not an object)"
        name, size, check = entry.get("name"), entry.get("size"), entry.get("checksum")
        if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name:
            return f"malformed (files[{i}].name = {name!r} is not a file name)"
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            return f"malformed (files[{i}] {name}: size = {size!r} is not a byte count)"
        if not isinstance(check, str):
            return f"malformed (files[{i}] {name}: checksum = {check!r} is not a string)"
    return None


def verify_files(folder: Path, manifest: dict[str, Any], rank: int, world: int) -> list[str]:
    """Problems with this rank's share (every world-th listed file) of a checkpoint; [] when intact.

    Rank 0 also reports a manifest it cannot read and data files the manifest does not list.
    """
    problems = []
    if rank == 0:
        if "problem" in manifest:
            return [manifest["problem"]]
        listed = {e["name"] for e in manifest["files"]}
        problems += [f"{p.name}: not written by this save" for p in sorted(folder.glob("*.distcp"))
                     if p.name not in listed]  # fmt: skip
    for entry in manifest["files"][rank::world]:
        path = folder / entry["name"]
        if not path.is_file():
            problems.append(f"{entry['name']}: missing")
        elif path.stat().st_size != entry["size"]:
            problems.append(f"{entry['name']}: {path.stat().st_size} bytes, the save wrote {entry['size']}")
        elif checksum(path) != entry["checksum"]:
            problems.append(f"{entry['name']}: contents changed since the save (checksum mismatch)")
    return problems
