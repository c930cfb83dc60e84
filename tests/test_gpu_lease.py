"""The GPU lease (`scripts/gpu_lease.sh`): budgets enforced, a failing part leaving the others, the
output packed; and the whole lease rehearsed on the CPU at toy sizes, every part end to end (its
arguments, OUTDIR and wheel site checked before anything starts: tests/test_lease_args.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from flashcp.gpucheck import lease
from test_gpucheck import check_quick_output

ROOT = Path(__file__).resolve().parents[1]


def fake_parts(monkeypatch, scripts: dict[str, str]) -> None:
    """Each part a tiny python program instead of its real command."""
    monkeypatch.setattr(lease, "_command", lambda part, out, *a: [sys.executable, "-c", scripts[part].format(out=out)])


def test_a_failing_or_hanging_part_costs_only_itself(tmp_path, monkeypatch) -> None:
    """The check fails, training hangs past its budget (killed), the dry run waits for the GPU parts'
    mark and then writes; the frontier still runs and passes; the summary names each outcome."""
    mark = Path(tmp_path, lease.WORK, lease.MEASURED)
    fake_parts(monkeypatch, {
        "gpucheck": "raise SystemExit(3)",
        "train": "import time; time.sleep(600)",
        "dryrun": f"import json, pathlib, time\nwhile not pathlib.Path({str(mark)!r}).exists(): time.sleep(0.1)\n"
                  "pathlib.Path('{out}', 'dryrun.json').write_text(json.dumps({{'headline': 'joined'}}))",
        "frontier": "import json, pathlib; pathlib.Path('{out}', 'frontier.json').write_text(json.dumps({{'headline': '4 layers'}}))",
    })  # fmt: skip
    monkeypatch.setattr(lease, "QUICK_BUDGETS_S", {"gpucheck": 60, "train": 2, "dryrun": 1, "frontier": 60})
    outcomes = {o.part: o for o in lease.run(tmp_path, "cpu", True, list(lease.PARTS))}
    assert outcomes["gpucheck"].status == "failed (exit 3)"
    assert outcomes["train"].status == "timed out (2 s)"
    assert outcomes["frontier"].status == "passed" and outcomes["frontier"].headline == "4 layers"
    assert outcomes["dryrun"].status == "passed" and outcomes["dryrun"].headline == "joined"
    text = lease.write_summary(tmp_path, "bash scripts/gpu_lease.sh X", list(outcomes.values()), 3.0)
    assert "| train | timed out (2 s) |" in text and "| frontier | passed |" in text


def test_a_scaled_budget_scales_each_trained_run_s_cap_too(tmp_path) -> None:
    """`--budget-scale X` stretches the parts' budgets and the cap on one trained run alike: on a loaded
    machine a run slower than the GPU-sized cap must not be cut while its part still has time."""
    command = lease._command("train", tmp_path, "cpu", True, 420 * 30, 30)
    assert command[command.index("--run-cap") + 1] == f"{lease.RUN_CAP_S * 30:g}"
    assert "--run-cap" not in lease._command("gpucheck", tmp_path, "cpu", True, 200, 30)


def test_the_output_is_packed_into_few_small_files(tmp_path) -> None:
    """The check's folder and the logs become tarballs, a long log keeps its last MiB, checkpoints stay out."""
    work = tmp_path / lease.WORK
    (work / "gpucheck").mkdir(parents=True)
    (work / "gpucheck" / "kernel_calls.csv").write_text("section\n")
    (work / "train" / "eager" / "checkpoint").mkdir(parents=True)
    (work / "train" / "eager" / "checkpoint" / "step-1").write_bytes(b"x" * 100)
    (work / "train.log").write_bytes(b"a" * lease.LOG_TAIL_BYTES + b"the end")
    (tmp_path / "train.json").write_text("{}")
    files = lease.pack(tmp_path)
    assert {f.name for f in files} == {"gpucheck.tar.gz", "logs.tar.gz", "train.json"}
    assert not work.exists()
    with tarfile.open(tmp_path / "logs.tar.gz") as tar:
        assert tar.getnames() == ["train.log"]
        log = tar.extractfile("train.log").read()
    assert len(log) == lease.LOG_TAIL_BYTES and log.endswith(b"the end")
    with tarfile.open(tmp_path / "gpucheck.tar.gz") as tar:
        assert "gpucheck/kernel_calls.csv" in tar.getnames()


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """`bash scripts/gpu_lease.sh OUTDIR --device cpu --quick`, once for the tests below: its process and OUTDIR."""
    tmp = tmp_path_factory.mktemp("rehearsal")
    out = tmp / "lease"
    env = {**os.environ, "PYTHON": sys.executable, "FLASHCP_LEASE_SITE": str(tmp / "site"), "PYTHONPATH": str(ROOT)}
    # The parts' budgets are sized for a GPU's time; here, scaled up, they only catch hangs (a loaded CI
    # machine ran them over 10x slower than an idle one: a train variant 150 s+ at load 20 on 2 cores).
    proc = subprocess.run(["bash", "scripts/gpu_lease.sh", str(out), "--device", "cpu", "--quick", "--budget-scale", "30"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=6000)  # fmt: skip
    return proc, out


@pytest.mark.slow
def test_the_lease_rehearses_every_part_on_the_cpu(rehearsal) -> None:
    """`bash scripts/gpu_lease.sh OUTDIR --device cpu --quick`: every part ends passed, at most 8 files of
    at most 16 MiB, every trained variant's figures and checks, the dry run's predictions with the CUDA
    comparisons said to be unavailable, and the frontier's stacks (Float8 needs torchao: skipped, saying
    so, where neither this venv nor the carried wheels have it)."""
    proc, out = rehearsal
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    files = sorted(out.iterdir())
    assert len(files) <= 8 and all(f.stat().st_size <= 16 * 2**20 for f in files)
    assert {f.name for f in files} == {"summary.md", "lease.json", "gpucheck.tar.gz", "logs.tar.gz", "train.json",
                                       "dryrun.json", "frontier.json"}  # fmt: skip
    summary = json.loads((out / "lease.json").read_text())
    assert [(p["part"], p["status"]) for p in summary["parts"]] == [(p, "passed") for p in lease.PARTS]
    assert "| gpucheck | passed |" in (out / "summary.md").read_text()

    train = json.loads((out / "train.json").read_text())
    variants = train["variants"]
    assert train["done"] and set(variants) == {"eager", "offload", "tiles", "compile", "float8", "probe"}
    for name, run in variants.items():
        if run["status"].startswith("skipped"):
            assert name == "float8" and "torchao" in run["status"], (name, run["status"])
            continue
        assert run["status"] == "trained", (name, run.get("last_line"))
        assert len(run["losses"]) == 3 and run["step_s"] > 0 and run["tokens_per_s"] > 0
        assert run["cuda_memory"].startswith("unavailable: no CUDA device")
    checks = {c["check"]: c for c in train["checks"]}
    for name in ("offload", "tiles", "compile"):
        assert checks[f"{name} reproduces eager's losses"]["passed"]
    assert checks["offload reproduces eager's losses"]["max_relative_difference"] == 0.0  # the same numbers
    assert all(c["passed"] for c in train["checks"])

    dry = json.loads((out / "dryrun.json").read_text())
    assert dry["done"] and dry["measured_parts_over"]
    assert not [k for k, p in dry["predictions"].items() if "error" in p]
    assert {k.split("/")[0] for k in dry["predictions"]} == {"train", "frontier"}
    skipped = {f"train/{name}" for name, run in variants.items() if run["status"].startswith("skipped")}
    assert all(c["measured"].startswith("none: the run's status is 'skipped" if k in skipped else
                                        "unavailable: no CUDA device")
               for k, c in dry["comparisons"].items() if "measured" in c)  # fmt: skip
    assert dry["frontier_terms"]["predicted"]["per_layer_gib"] > 0

    frontier = json.loads((out / "frontier.json").read_text())
    assert frontier["done"] and set(frontier["variants"]) == {"layers2", "layers2_offload", "layers1",
                                                              "layers2_groups"}
    assert all(r["status"] == "trained" for r in frontier["variants"].values())
    with tarfile.open(out / "gpucheck.tar.gz") as tar:
        assert {"gpucheck/summary.md", "gpucheck/kernel_calls.csv"} <= set(tar.getnames())


@pytest.mark.slow
def test_quick_check_runs_every_section(rehearsal, tmp_path) -> None:
    """Part a is `python -m flashcp.gpucheck --device cpu --quick --no-budgets` as a user runs it (a
    subprocess from the repository root): every section's results, as tests/test_gpucheck.py requires."""
    proc, out = rehearsal
    parts = {p["part"]: p for p in json.loads((out / "lease.json").read_text())["parts"]}
    assert parts["gpucheck"]["status"] == "passed", proc.stdout[-6000:]
    with tarfile.open(out / "gpucheck.tar.gz") as tar:
        tar.extractall(tmp_path, filter="data")
    with tarfile.open(out / "logs.tar.gz") as tar:
        log = tar.extractfile("gpucheck.log").read().decode()
    check_quick_output(tmp_path / "gpucheck", log.strip().splitlines()[-1])
