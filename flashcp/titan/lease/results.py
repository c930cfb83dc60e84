"""One part's results as a JSON file, rewritten whole (atomically) each time a result arrives, so a
part cut off by its time limit leaves everything it finished."""

from __future__ import annotations

import json
import math
import subprocess
import time
from pathlib import Path
from typing import Any

GIB = 2**30


class Results:
    """OUTDIR/<part>.json: {"part", "device", "quick", "headline", "done", ...the part's own keys}."""

    def __init__(self, out: Path, part: str, device: str, quick: bool) -> None:
        self.path = out / f"{part}.json"
        self.work = out / "work" / part  # the part's runs' own folders
        self.work.mkdir(parents=True, exist_ok=True)
        self.data: dict[str, Any] = {"part": part, "device": device, "quick": quick, "headline": "", "done": False,
                                     "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}  # fmt: skip
        self.save()

    def save(self, **updates: Any) -> None:
        self.data.update(updates)
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(_finite(self.data), indent=1, default=str) + "\n")
        tmp.replace(self.path)


def _finite(value: Any) -> Any:
    """JSON has no NaN or infinity: such a float is written as the string naming it."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def read(out: Path, part: str) -> dict[str, Any] | None:
    """A part's results as written so far (None: the part has not run into this folder)."""
    path = out / f"{part}.json"
    return json.loads(path.read_text()) if path.exists() else None


def gpu_query(field: str) -> str | None:
    """One nvidia-smi field of the first GPU (memory.total, compute_cap, name): asking torch would create
    a CUDA context in a process that must leave the GPU to the runs it measures. None without a GPU."""
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True)  # fmt: skip
        return out.stdout.strip().splitlines()[0].strip()
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def gpu_memory_gib() -> float | None:
    """The first GPU's memory in GiB (nvidia-smi reports MiB); None without a GPU."""
    mib = gpu_query("memory.total")
    try:
        return float(mib) / 1024 if mib is not None else None
    except ValueError:
        return None
