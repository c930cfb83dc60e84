"""Where the GPU check writes: one CSV per section (rows flushed as they are measured), JSON where a
section's result is a record, and a Markdown summary rewritten after every section.

Everything is on disk the moment it is measured, so a run that is cut off (a time limit, a crash,
a lost machine) still leaves every finished row and a summary saying which section stopped where.
"""

from __future__ import annotations

import csv
import json
import platform
import subprocess
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import torch


class Budget:
    """Seconds a section may still spend; sections stop adding cases once it is used up."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def spent(self) -> bool:
        return self.left() <= 0


class Table:
    """A CSV file with a fixed header; every row is flushed as soon as it is added."""

    def __init__(self, path: Path, columns: list[str]) -> None:
        self.path, self.columns, self.rows = path, columns, []
        self._file = path.open("w", newline="")
        self._writer = csv.DictWriter(self._file, columns)
        self._writer.writeheader()
        self._file.flush()

    def add(self, **row: Any) -> dict:
        unknown = set(row) - set(self.columns)
        if unknown:
            raise KeyError(f"{self.path.name}: no columns {sorted(unknown)}")
        self._writer.writerow({k: _fmt(v) for k, v in row.items()})
        self._file.flush()
        self.rows.append(row)
        return row

    def close(self) -> None:
        self._file.close()


def _fmt(value: Any) -> Any:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value))
    return value


@dataclass
class Section:
    title: str
    status: str = "not run"
    seconds: float = 0.0
    lines: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)


class Report:
    """The check's output folder: tables, records and `summary.md`."""

    def __init__(self, out: Path, command: str, device: torch.device) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.out, self.command, self.device = out, command, device
        self.sections: dict[str, Section] = {}
        self.tables: dict[str, Table] = {}
        self.environment = environment(device)
        self.write_json("env", self.environment)
        self.write_summary()

    def table(self, name: str, columns: list[str]) -> Table:
        """`name`.csv, created on first use; later sections asking for it append to it."""
        if name not in self.tables:
            self.tables[name] = Table(self.out / f"{name}.csv", columns)
        elif self.tables[name].columns != columns:
            raise ValueError(f"{name}.csv already has columns {self.tables[name].columns}")
        return self.tables[name]

    def write_json(self, name: str, payload: Any) -> None:
        path = self.out / f"{name}.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(payload, indent=1, default=str) + "\n")
        tmp.replace(path)

    @contextmanager
    def section(self, key: str, title: str) -> Iterator[Section]:
        """Run one section: its status, time and any exception end up in the summary, and a
        failing section does not stop the next one."""
        sec = self.sections[key] = Section(title, status="running")
        self.write_summary()
        print(f"\n== {title} ==", flush=True)
        start = time.perf_counter()
        try:
            yield sec
            if sec.status == "running":
                sec.status = "failed" if sec.failures else "passed"
        except Exception as e:  # a broken section is reported, the others still run
            sec.status = f"error: {type(e).__name__}: {e}"
            sec.lines.append("```\n" + traceback.format_exc().rstrip() + "\n```")
            print(f"section {key} raised {type(e).__name__}: {e}", flush=True)
        finally:
            sec.seconds = time.perf_counter() - start
            print(f"-- {key}: {sec.status} ({sec.seconds:.0f} s)", flush=True)
            self.write_summary()

    def write_summary(self) -> None:
        env = self.environment
        lines = [
            "# FlashCP GPU check",
            "",
            f"`{self.command}`",
            "",
            "| | |",
            "| --- | --- |",
            *(f"| {k} | {v} |" for k, v in env.items()),
            "",
        ]
        for key, sec in self.sections.items():
            lines += [f"## {sec.title}", "", f"status: **{sec.status}** ({sec.seconds:.0f} s)", ""]
            lines += [f"- FAILED: {f}" for f in sec.failures] + sec.lines + [""]
        path = self.out / "summary.md"
        tmp = path.with_suffix(".md.tmp")
        tmp.write_text("\n".join(lines))
        tmp.replace(path)

    def close(self) -> None:
        for table in self.tables.values():
            table.close()
        self.write_summary()


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _driver() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20, check=True,
        )  # fmt: skip
        return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "unknown (nvidia-smi unavailable)"


def environment(device: torch.device) -> dict[str, Any]:
    """What the numbers were measured on."""
    from flashcp.attention.kernels import BACKENDS

    env: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "host": platform.node(),
                           "python": platform.python_version(), "torch": torch.__version__,
                           "flash-attn": _version("flash-attn"), "fla-core": _version("fla-core")}  # fmt: skip
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update({
            "device": props.name,
            "compute capability": f"{props.major}.{props.minor}",
            "multiprocessors": props.multi_processor_count,
            "memory GiB": round(props.total_memory / 2**30, 1),
            "driver": _driver(),
            "CUDA (torch)": torch.version.cuda,
        })  # fmt: skip
        probe = torch.zeros(1, 1, 64, device=device, dtype=torch.bfloat16)
    else:
        env.update({"device": f"cpu ({platform.processor() or platform.machine()})",
                    "threads": torch.get_num_threads()})  # fmt: skip
        probe = torch.zeros(1, 1, 64, dtype=torch.bfloat16)
    for name, backend in BACKENDS.items():
        env[f"backend {name}"] = backend.reject(probe, probe) or "available"
    return env


def device_tag(env: dict[str, Any]) -> str:
    """A folder name for results from this device, e.g. NVIDIA_H100_80GB_HBM3."""
    return "".join(c if c.isalnum() or c in "-." else "_" for c in str(env["device"]))
