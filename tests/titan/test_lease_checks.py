"""The lease's verdicts on its runs: losses finite, a variant reproducing another within its tolerance,
and the per-layer / fixed memory terms from two stack heights; and a CPU run's launcher, forked from
the part's process, failing or hanging as a process of its own would."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time

import pytest

from flashcp.titan.lease.frontier import terms
from flashcp.titan.lease.jobs import frontier_jobs, frontier_layers, Job, train_jobs
from flashcp.titan.lease import train
from flashcp.titan.lease.train import check, launch


def runs(**losses: list[float]) -> dict:
    return {name: {"status": "trained", "losses": {str(i + 1): v for i, v in enumerate(values)}}
            for name, values in losses.items()}  # fmt: skip


JOBS = [Job("eager", "debug_cpu", ()), Job("tiles", "debug_cpu", (), compare_to="eager", tolerance=1e-3)]


def verdicts(results: list[dict]) -> dict[str, bool]:
    return {c["check"]: c["passed"] for c in results}


def test_a_variant_within_its_tolerance_passes_and_one_beyond_fails() -> None:
    ok = verdicts(check(JOBS, runs(eager=[10.0, 9.0], tiles=[10.0, 9.005])))
    assert ok == {"eager: losses finite": True, "tiles: losses finite": True, "tiles reproduces eager's losses": True}
    off = check(JOBS, runs(eager=[10.0, 9.0], tiles=[10.0, 9.02]))
    assert verdicts(off)["tiles reproduces eager's losses"] is False
    assert off[-1]["max_relative_difference"] == pytest.approx(0.02 / 9)


def test_a_non_finite_loss_fails_and_a_run_that_did_not_train_is_not_compared() -> None:
    bad = verdicts(check(JOBS, runs(eager=[10.0, math.nan], tiles=[10.0, 9.0])))
    assert bad["eager: losses finite"] is False
    lone = check(JOBS, {**runs(tiles=[10.0]), "eager": {"status": "failed (exit 1)"}})
    assert verdicts(lone) == {"tiles: losses finite": True}


def test_terms_split_the_peak_into_per_layer_and_fixed() -> None:
    assert terms({1: 20.0, 4: 32.0}) == {"per_layer_gib": 4.0, "fixed_gib": 16.0}
    assert terms({1: 20.0, 4: None}) is None


def test_every_variant_is_in_the_rehearsal_and_on_the_gpu() -> None:
    """The rehearsal runs the GPU's variants (toy sizes); the frontier's tallest stack fits 80 GiB."""
    assert [j.name for j in train_jobs(True)] == [j.name for j in train_jobs(False)]
    assert 1 <= frontier_layers(79.1, quick=False) <= 4 and frontier_layers(8.0, quick=False) == 1
    names = [j.name for j in frontier_jobs(79.1, quick=False)]
    top = frontier_layers(79.1, quick=False)
    assert names == [f"layers{top}", f"layers{top}_groups", f"layers{top}_offload", *(["layers1"] if top > 1 else [])]


def test_a_forked_launcher_s_exit_and_output_are_the_run_s(tmp_path, monkeypatch) -> None:
    def refuse(argv: list[str]) -> int:
        print(f"error: refused {argv[:2]} with NGPU={os.environ['NGPU']}")
        return 2

    monkeypatch.setattr(train, "launcher", refuse)
    run = launch(JOBS[0], tmp_path, "cpu", timeout=300)
    assert run["status"] == "failed (exit 2)"
    assert run["last_line"] == "error: refused ['--config', 'debug_cpu'] with NGPU=1"
    assert run["command"] == f"python -m flashcp.titan.launch --config debug_cpu --job.dump_folder {tmp_path / 'eager'}"


def test_a_forked_launcher_that_hangs_is_killed_with_what_it_started(tmp_path, monkeypatch) -> None:
    pid_file = tmp_path / "rank.pid"

    def hang(argv: list[str]) -> int:  # a launcher whose rank never ends
        rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        pid_file.write_text(str(rank.pid))
        time.sleep(600)
        return 0

    monkeypatch.setattr(train, "launcher", hang)
    run = launch(JOBS[0], tmp_path, "cpu", timeout=5)
    assert run["status"] == "timed out (5 s)"
    rank = int(pid_file.read_text())
    for _ in range(100):  # killed: gone once its parent, init, has reaped it
        try:
            os.kill(rank, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the rank {rank} outlived its launcher's timeout")
