"""Measured tables the cost model is calibrated from, parsed into checked numpy arrays.

Two kinds of measurements feed the model, each in the format its tool writes so that a user can
drop in tables measured on their own cluster:

Collective bandwidth (`CollectiveTable`), either
- nccl-tests output (`all_gather_perf` / `reduce_scatter_perf` stdout, saved as text): the op
  comes from the command line or the `redop` column, the rank count from `nGpus N` (or the
  number of `Rank` lines); the out-of-place `size` and `busbw` columns are used; or
- a CSV with header `op,n_ranks,size_bytes,busbw_gbps` (op: all_gather | reduce_scatter), one
  row per message size, possibly several ops / rank counts in one file.
`size` follows nccl-tests: the whole buffer, i.e. N times one rank's chunk, and
busbw = algbw * (N - 1) / N with algbw = size / time.

Attention kernel time (`KernelSample`: one varlen call on one GPU), either
- a per-document profile CSV `L,cp,tp,duration_per_doc` (ms; one causal document of length L per
  call, forward only). A row stands for one rank's Per-Doc share of that document: L / cp
  queries attending to a bottom-right causal window of L * (1/2 + 1/(2 cp)) keys, which is
  exactly 1/cp of the document's work, with `profile_heads / tp` query heads; or
- a measured per-rank table CSV `heads,head_dim,q_lens,k_lens,fwd_ms[,fwd_bwd_ms]` where
  q_lens / k_lens are space-separated per-sequence lengths of one causal varlen call (this is
  what a per-rank GPU benchmark writes, and what re-calibration from GPU measurements reads).
  The fit ignores other columns; `kernel_csv_labels` reads them (e.g. the `section` and `backend`
  of `python -m flashcp.gpucheck`'s kernel_calls.csv) row for row with the samples.

Every parser raises `ProfileError` naming the file, the line and the problem.
"""

from __future__ import annotations

import csv
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

COLLECTIVE_OPS = ("all_gather", "reduce_scatter")
COLLECTIVE_CSV_HEADER = ("op", "n_ranks", "size_bytes", "busbw_gbps")
PER_DOC_HEADER = ("L", "cp", "tp", "duration_per_doc")
KERNEL_CSV_REQUIRED = ("heads", "q_lens", "k_lens", "fwd_ms")

# Query heads of the shared per-document profile (tp = 1). Its 64K-token row runs at ~340
# TFLOP/s with 64 heads of dim 128, the forward peak of FlashAttention on an H100; fewer heads
# would put it below, more above, what the kernel can do. Override with `profile_heads=`.
PER_DOC_PROFILE_HEADS = 64


class ProfileError(ValueError):
    """A measurement table is missing, malformed or physically implausible (message says which)."""


@dataclass(frozen=True)
class CollectiveTable:
    """Bus bandwidth of one collective on `n_ranks` GPUs, by message size (bytes, GB/s)."""

    op: str
    n_ranks: int
    sizes: np.ndarray  # bytes of the whole buffer, strictly increasing
    busbw: np.ndarray  # GB/s (1e9 bytes per second)
    source: str

    def __post_init__(self) -> None:
        where = f"{self.source}: {self.op} on {self.n_ranks} ranks"
        if self.op not in COLLECTIVE_OPS:
            raise ProfileError(f"{self.source}: unknown collective {self.op!r}; expected {COLLECTIVE_OPS}")
        if self.n_ranks < 2:
            raise ProfileError(f"{where}: a collective table needs n_ranks >= 2")
        if len(self.sizes) < 2 or len(self.sizes) != len(self.busbw):
            raise ProfileError(f"{where}: need at least two (size, busbw) rows, got {len(self.sizes)}")
        if np.any(np.diff(self.sizes) <= 0) or self.sizes[0] <= 0:
            raise ProfileError(f"{where}: message sizes must be positive and strictly increasing")
        if np.any(~np.isfinite(self.busbw)) or np.any(self.busbw <= 0):
            raise ProfileError(f"{where}: bus bandwidths must be positive numbers")

    def algbw(self) -> np.ndarray:
        """Algorithm bandwidth (GB/s) at the table sizes: busbw * N / (N - 1)."""
        return self.busbw * self.n_ranks / (self.n_ranks - 1)

    def times_ms(self) -> np.ndarray:
        """Measured time (ms) at the table sizes: size / algbw."""
        return self.sizes / (self.algbw() * 1e9) * 1e3


@dataclass(frozen=True)
class KernelSample:
    """One timed causal varlen attention call: per-sequence query / key lengths and heads."""

    q_lens: tuple[int, ...]
    k_lens: tuple[int, ...]
    heads: int
    head_dim: int
    fwd_ms: float
    fwd_bwd_ms: float | None = None
    source: str = ""


# --- collectives -----------------------------------------------------------------------------

_NCCL_ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+\S+\s+(\S+)\s+-?\d+\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s")


def parse_nccl_tests(text: str, source: str = "<nccl-tests>") -> CollectiveTable:
    """Parse the stdout of nccl-tests `all_gather_perf` or `reduce_scatter_perf`."""
    op = None
    m = re.search(r"(all_gather|reduce_scatter)_perf", text)
    if m:
        op = m.group(1)
    n_ranks = None
    m = re.search(r"nGpus\s+(\d+)", text)
    if m:
        n_ranks = int(m.group(1))
    ranks_listed = len(re.findall(r"^#\s+Rank\s+\d+", text, flags=re.M))
    if n_ranks is None or (n_ranks == 1 and ranks_listed > 1):
        n_ranks = ranks_listed or None  # multi-process runs report nGpus per process
    sizes, busbw, redops = [], [], set()
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith(("#", "$")):
            continue
        row = _NCCL_ROW.match(line)
        if row is None:
            raise ProfileError(f"{source}:{lineno}: not an nccl-tests result row: {line.strip()[:80]!r}")
        sizes.append(int(row.group(1)))
        busbw.append(float(row.group(6)))
        redops.add(row.group(3))
    if not sizes:
        raise ProfileError(f"{source}: no nccl-tests result rows found")
    if op is None:  # no command line saved: all_gather has no reduction, reduce_scatter sums
        op = "all_gather" if redops == {"none"} else "reduce_scatter" if redops else None
    if op is None or n_ranks is None:
        raise ProfileError(
            f"{source}: cannot tell the collective or the rank count; keep the nccl-tests command line "
            "and header in the file, or use the CSV format op,n_ranks,size_bytes,busbw_gbps"
        )
    return CollectiveTable(op, n_ranks, np.array(sizes, float), np.array(busbw, float), source)


def parse_collective_csv(text: str, source: str = "<csv>") -> list[CollectiveTable]:
    """Parse `op,n_ranks,size_bytes,busbw_gbps` rows into one table per (op, n_ranks)."""
    rows = _csv_rows(text, source, COLLECTIVE_CSV_HEADER)
    groups: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for lineno, row in rows:
        op = row["op"].strip()
        n = _number(row["n_ranks"], int, source, lineno, "n_ranks")
        size = _number(row["size_bytes"], float, source, lineno, "size_bytes")
        bw = _number(row["busbw_gbps"], float, source, lineno, "busbw_gbps")
        groups.setdefault((op, n), []).append((size, bw))
    tables = []
    for (op, n), pts in groups.items():
        pts.sort()
        sizes, busbw = np.array(pts, dtype=float).T
        tables.append(CollectiveTable(op, n, sizes, busbw, source))
    return tables


def load_collective_tables(paths: Iterable[str | Path]) -> list[CollectiveTable]:
    """Read collective tables from files (nccl-tests text or CSV) and directories of them."""
    tables: list[CollectiveTable] = []
    for path, kind in _tables_of(paths, ("nccl", "collective_csv"), "collective"):
        text = path.read_text()
        tables.extend(parse_collective_csv(text, str(path)) if kind == "collective_csv" else
                      [parse_nccl_tests(text, str(path))])
    seen: dict[tuple[str, int], str] = {}
    for t in tables:
        key = (t.op, t.n_ranks)
        if key in seen:
            raise ProfileError(f"two tables for {t.op} on {t.n_ranks} ranks: {seen[key]} and {t.source}")
        seen[key] = t.source
    return tables


# --- kernels ---------------------------------------------------------------------------------


def parse_per_doc_csv(
    text: str, source: str = "<per-doc csv>", profile_heads: int = PER_DOC_PROFILE_HEADS, head_dim: int = 128
) -> list[KernelSample]:
    """Per-document forward profile (`L,cp,tp,duration_per_doc` in ms) as one sample per row."""
    samples = []
    for lineno, row in _csv_rows(text, source, PER_DOC_HEADER):
        length = _number(row["L"], int, source, lineno, "L")
        cp = _number(row["cp"], int, source, lineno, "cp")
        tp = _number(row["tp"], int, source, lineno, "tp")
        ms = _number(row["duration_per_doc"], float, source, lineno, "duration_per_doc")
        if profile_heads % tp:
            raise ProfileError(f"{source}:{lineno}: tp={tp} does not divide {profile_heads} profile heads")
        q = length // cp
        k = int((0.5 + 0.5 / cp) * length)
        if q < 1:
            raise ProfileError(f"{source}:{lineno}: L={length} is shorter than cp={cp}")
        where = f"{source}:{lineno}"
        samples.append(KernelSample((q,), (k,), profile_heads // tp, head_dim, ms, None, where))
    return samples


def parse_kernel_csv(text: str, source: str = "<kernel csv>") -> list[KernelSample]:
    """Measured per-call table `heads,head_dim,q_lens,k_lens,fwd_ms[,fwd_bwd_ms]`."""
    samples = []
    for lineno, row in _csv_rows(text, source, KERNEL_CSV_REQUIRED):
        heads = _number(row["heads"], int, source, lineno, "heads")
        head_dim = _number(row.get("head_dim") or "128", int, source, lineno, "head_dim")
        q = tuple(_number(x, int, source, lineno, "q_lens") for x in row["q_lens"].split())
        k = tuple(_number(x, int, source, lineno, "k_lens") for x in row["k_lens"].split())
        if not q or len(q) != len(k):
            raise ProfileError(f"{source}:{lineno}: q_lens and k_lens must list the same number of sequences")
        if any(qi > ki for qi, ki in zip(q, k)):
            raise ProfileError(f"{source}:{lineno}: a causal sequence needs k_len >= q_len")
        fwd = _number(row["fwd_ms"], float, source, lineno, "fwd_ms")
        fb = row.get("fwd_bwd_ms")
        fwd_bwd = _number(fb, float, source, lineno, "fwd_bwd_ms") if fb not in (None, "") else None
        if fwd_bwd is not None and fwd_bwd <= fwd:  # the backward is fitted to the difference
            raise ProfileError(f"{source}:{lineno}: fwd_bwd_ms {fwd_bwd} is not above fwd_ms {fwd}: "
                               "the backward pass takes no time (a timing glitch?)")
        samples.append(KernelSample(q, k, heads, head_dim, fwd, fwd_bwd, f"{source}:{lineno}"))
    return samples


def kernel_csv_labels(text: str, source: str, columns: tuple[str, ...]) -> list[dict[str, str]]:
    """The named extra columns of a per-call table, one dict per sample `parse_kernel_csv` returns
    (same rows, same order: both skip the same empty rows), so the samples can be grouped by them."""
    rows = _csv_rows(text, source, (*KERNEL_CSV_REQUIRED, *columns))
    return [{c: row[c] for c in columns} for _, row in rows]


def load_kernel_samples(
    paths: Iterable[str | Path], profile_heads: int = PER_DOC_PROFILE_HEADS
) -> list[KernelSample]:
    """Read kernel samples from per-doc profiles and per-call tables (files or directories)."""
    samples: list[KernelSample] = []
    for path, kind in _tables_of(paths, ("per_doc", "kernel_csv"), "kernel"):
        text = path.read_text()
        samples.extend(parse_per_doc_csv(text, str(path), profile_heads) if kind == "per_doc" else
                       parse_kernel_csv(text, str(path)))
    return samples


# --- helpers ---------------------------------------------------------------------------------


def table_kind(path: Path) -> str | None:
    """Which table format a file holds: nccl, collective_csv, per_doc, kernel_csv (None: unknown)."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError):
        return None
    first = next((ln for ln in text.splitlines() if ln.strip()), "")
    header = {h.strip() for h in first.split(",")}
    if set(COLLECTIVE_CSV_HEADER) <= header:
        return "collective_csv"
    if set(PER_DOC_HEADER) <= header:
        return "per_doc"
    if set(KERNEL_CSV_REQUIRED) <= header:
        return "kernel_csv"
    if re.search(r"(all_gather|reduce_scatter)_perf|busbw", text):
        return "nccl"
    return None


def _tables_of(paths: Iterable[str | Path], kinds: tuple[str, ...], what: str) -> list[tuple[Path, str]]:
    """Files of the wanted kinds: a named file must be one; a directory contributes those it has."""
    out: list[tuple[Path, str]] = []
    for p in map(Path, paths):
        if p.is_dir():
            out.extend((f, k) for f in sorted(p.iterdir()) if f.is_file() and (k := table_kind(f)) in kinds)
        elif p.is_file():
            kind = table_kind(p)
            if kind not in kinds:
                raise ProfileError(
                    f"{p}: not a {what} table; expected "
                    + (f"nccl-tests output or a {','.join(COLLECTIVE_CSV_HEADER)} CSV" if what == "collective"
                       else f"a {','.join(PER_DOC_HEADER)} profile or a per-call CSV with "
                       f"{','.join(KERNEL_CSV_REQUIRED)}")
                )
            out.append((p, kind))
        else:
            raise ProfileError(f"{what} table {p} does not exist")
    return out


def _csv_rows(text: str, source: str, required: tuple[str, ...]) -> list[tuple[int, dict[str, str]]]:
    lines = [ln for ln in text.splitlines()]
    reader = csv.DictReader(lines, skipinitialspace=True)
    header = tuple(h.strip() for h in (reader.fieldnames or ()))
    missing = [c for c in required if c not in header]
    if missing:
        raise ProfileError(f"{source}: missing column(s) {', '.join(missing)}; the header is {header}")
    rows = [(i + 2, {k.strip(): (v or "").strip() for k, v in r.items() if k}) for i, r in enumerate(reader)]
    rows = [(i, r) for i, r in rows if any(r.values())]
    if not rows:
        raise ProfileError(f"{source}: no data rows")
    return rows


def _number(text: str, kind: type, source: str, lineno: int, column: str):
    try:
        value = kind(text)
    except (TypeError, ValueError):
        problem = f"column {column} has {text!r}, not a {kind.__name__}"
        raise ProfileError(f"{source}:{lineno}: {problem}") from None
    if not (math.isfinite(value) and value > 0):
        raise ProfileError(f"{source}:{lineno}: column {column} must be positive, got {text!r}")
    return value
