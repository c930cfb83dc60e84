"""`python -m flashcp.gpucheck --device cpu --quick`: every section runs and writes its results, the
checks catch a wrong kernel and a broken exchange, and a failing section does not stop the rest."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from flashcp.attention import kernels
from flashcp.attention.simulate import SimulatedGroup
from flashcp.costmodel.profiles import KERNEL_CSV_REQUIRED
from flashcp.gpucheck import SECTIONS
from flashcp.gpucheck.__main__ import main

ROOT = Path(__file__).resolve().parents[1]
FILES = ["summary.md", "env.json", "exactness.csv", "cp.csv", "critical_path.csv", "efficiency.csv",
         "decoder.json", "kernel_calls.csv"]  # fmt: skip


def _rows(path: Path) -> list[dict]:
    with path.open() as f:
        return list(csv.DictReader(f))


def test_quick_check_runs_every_section(tmp_path):
    """As a user runs it: a subprocess from the repository root, no test imports. Without budgets,
    so that a loaded machine runs every case too (the timeout only catches a hang)."""
    out = tmp_path / "check"
    cmd = [sys.executable, "-m", "flashcp.gpucheck", "--out", str(out), "--device", "cpu", "--quick", "--no-budgets"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "sections passed or measured" in proc.stdout.splitlines()[-1]
    assert sorted(p.name for p in out.iterdir()) == sorted(FILES)
    summary = (out / "summary.md").read_text()
    for title, _ in SECTIONS.values():
        assert f"## {title}" in summary
    assert summary.count("status: **passed**") == 2 and summary.count("status: **measured**") == 3
    env = json.loads((out / "env.json").read_text())
    assert env["backend reference"] == "available" and env["torch"]

    exact = _rows(out / "exactness.csv")
    assert {r["gqa"] for r in exact} == {"1", "4", "8"} and {r["dtype"] for r in exact} == {"float16", "bfloat16"}
    assert {"1-token documents", "more keys than queries"} <= {r["case"] for r in exact}
    assert all(r["ok"] == "True" for r in exact)
    cp = _rows(out / "cp.csv")
    assert {(r["cp"], r["comm"]) for r in cp} >= {(n, c) for n in "248" for c in ("compact", "full", "needed")}
    assert {r["strategy"] for r in cp} >= {"per_seq", "per_doc", "whole_doc", "flashcp"}
    assert all(r["ok"] == "True" for r in cp)
    assert {r["strategy"] for r in _rows(out / "critical_path.csv")} == {"per_seq", "per_doc", "flashcp"}
    assert {r["kind"] for r in _rows(out / "efficiency.csv")} == {"fig3", "sweep"}
    assert json.loads((out / "decoder.json").read_text())
    # The timed calls are in the cost model's per-rank table format (tests/test_costmodel.py parses
    # that format; toy CPU timings are too noisy for its plausibility checks, so only the shape here).
    calls = _rows(out / "kernel_calls.csv")
    assert calls and set(KERNEL_CSV_REQUIRED) <= set(calls[0])
    assert all(len(r["q_lens"].split()) == len(r["k_lens"].split()) > 0 for r in calls)


def test_a_wrong_kernel_fails_the_exactness_section(tmp_path, monkeypatch):
    good = kernels.BACKENDS["reference"]

    def off_by_a_bit(q, k, v, *args):  # 1 % too large: far beyond half-precision rounding
        return good.run(q, k, v, *args) * 1.01

    monkeypatch.setitem(kernels.BACKENDS, "reference", kernels.Backend("reference", good.reject, off_by_a_bit))
    assert main(["--out", str(tmp_path), "--device", "cpu", "--quick", "--no-budgets", "--sections", "exactness"]) == 1
    assert "status: **failed**" in (tmp_path / "summary.md").read_text()
    assert not all(r["ok"] == "True" for r in _rows(tmp_path / "exactness.csv"))


def test_a_broken_exchange_fails_the_cp_section(tmp_path, monkeypatch):
    """Gradients of rows another rank used never come back: only the CP check can see this."""
    monkeypatch.setattr(SimulatedGroup, "reduce_scatter", lambda self, out, inp: out.zero_())
    assert main(["--out", str(tmp_path), "--device", "cpu", "--quick", "--no-budgets", "--sections", "cp"]) == 1
    failed = {r["tensor"] for r in _rows(tmp_path / "cp.csv") if r["ok"] == "False"}
    assert failed == {"dk", "dv"}


def test_a_crashing_section_is_reported_and_the_rest_still_run(tmp_path, monkeypatch, capsys):
    def crash(*args):
        raise MemoryError("out of device memory")

    monkeypatch.setitem(SECTIONS, "critical_path", (SECTIONS["critical_path"][0], crash))
    argv = ["--out", str(tmp_path), "--device", "cpu", "--quick", "--no-budgets", "--sections", "critical_path", "efficiency"]
    code = main(argv)
    assert code == 1
    summary = (tmp_path / "summary.md").read_text()
    assert "status: **error: MemoryError: out of device memory**" in summary
    assert "## 4. Kernel efficiency\n\nstatus: **measured**" in summary
    assert capsys.readouterr().out.splitlines()[-1].startswith("gpucheck: FAILED in critical_path")


def test_a_spent_budget_cuts_sections_short_and_says_so(tmp_path):
    assert main(["--out", str(tmp_path), "--device", "cpu", "--quick", "--budget-scale", "1e-9",
                 "--sections", "critical_path", "efficiency"]) == 0  # fmt: skip
    assert (tmp_path / "summary.md").read_text().count("status: **cut short**") == 2


def test_a_correctness_section_cut_short_has_not_passed(tmp_path, capsys):
    assert main(["--out", str(tmp_path), "--device", "cpu", "--quick", "--budget-scale", "1e-9",
                 "--sections", "exactness"]) == 1  # fmt: skip
    assert "status: **cut short**" in (tmp_path / "summary.md").read_text()
    assert capsys.readouterr().out.splitlines()[-1].startswith("gpucheck: NOT ALL CHECKED: exactness cut short")


def test_cuda_without_a_gpu_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        main(["--out", str(tmp_path), "--device", "cuda"])
    assert e.value.code == 2 and "sees no CUDA GPU" in capsys.readouterr().err
