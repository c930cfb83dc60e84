"""Section 7 of `python -m flashcp.gpucheck` (the Gated DeltaNet CP op, `flashcp/gpucheck/gdn.py`) on a
CPU: every layout, N and dtype within tolerance with the reference kernel, its timing row, and wrong
middle-piece summaries failing it (only a sharded run can see those)."""

from __future__ import annotations

import csv
import dataclasses
from pathlib import Path

import torch

import flashcp.gpucheck.__main__ as entry
from flashcp.attention import linear_cp
from flashcp.gpucheck.__main__ import main
from flashcp.gpucheck.gdn import TENSORS
from flashcp.gpucheck.sizes import QUICK

ARGS = ["--device", "cpu", "--quick", "--no-budgets", "--sections", "gdn"]


def _rows(path: Path) -> list[dict]:
    with path.open() as f:
        return list(csv.DictReader(f))


def check_gdn_rows(rows: list[dict]) -> None:
    """The section's rows on a CPU (also the lease rehearsal's, through `check_quick_output`)."""
    assert {r["layout"] for r in rows} == {"flashcp", "per_doc", "spanning + 1-token"}
    assert {r["cp"] for r in rows} == {"2", "4", "8"}
    assert {r["dtype"] for r in rows} == {"float32", "bfloat16"}
    assert {r["tensor"] for r in rows} == set(TENSORS) and {r["backend"] for r in rows} == {"reference"}
    spanning = [r for r in rows if r["layout"] == "spanning + 1-token"]
    assert all(r["documents"] == "6" and int(r["cut_documents"]) >= 1 for r in spanning)
    assert all(r["ok"] == "True" for r in rows)


def test_the_gdn_section_passes_on_the_cpu(tmp_path):
    assert main(["--out", str(tmp_path), *ARGS]) == 0
    check_gdn_rows(_rows(tmp_path / "gdn.csv"))
    (timing,) = _rows(tmp_path / "gdn_timing.csv")
    assert timing["backend"] == "reference" and float(timing["fwd_bwd_ms"]) > 0
    assert "status: **passed**" in (tmp_path / "summary.md").read_text()


def test_wrong_middle_piece_summaries_fail_the_gdn_section(tmp_path, monkeypatch):
    """M rows of zeros: a piece after a middle piece starts from that piece's B alone. The convolution's
    outputs stay right, the recurrence's are caught."""
    summary = linear_cp.affine_summary

    def no_m(*args, **kwargs):
        b, m = summary(*args, **kwargs)
        return b, torch.zeros_like(m)

    monkeypatch.setattr(linear_cp, "affine_summary", no_m)
    monkeypatch.setattr(entry, "QUICK", dataclasses.replace(QUICK, gdn_cp_sizes=(2,)))
    assert main(["--out", str(tmp_path), *ARGS]) == 1
    failed = {r["tensor"] for r in _rows(tmp_path / "gdn.csv") if r["ok"] == "False"}
    assert "o" in failed and not failed & {"y", "dx", "dconv_weight"}, failed
    assert "status: **failed**" in (tmp_path / "summary.md").read_text()
