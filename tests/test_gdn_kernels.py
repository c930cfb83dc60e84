"""The Gated DeltaNet kernel choice (`flashcp.attention.gdn_kernels`) and fla's kernel itself.

Choice: the reference by name and on a CPU, fla when it accepts the inputs, and one line naming the
reason when a backend named cannot run them. The kernel: fla-core's Triton kernels on CPU tensors
under Triton's interpreter (`tests/fla_interpret.py`, a process of its own), forward and backward
in float32 against the float64 reference: one varlen call with initial and final states (a 1-token
document, pieces shorter than a chunk), the middle pieces' [B | M] summary, and the CP op on
simulated ranks (N = 2, a document across both ranks twice beside 1-token documents).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashcp import plan_shards
from flashcp.attention import gdn_kernels
from flashcp.attention.gated_delta import chunk_gated_delta
from flashcp.attention.gdn_kernels import _fla_run, BackendUnavailable, gdn_kernel
from flashcp.attention.linear_cp import cp_gated_delta
from flashcp.attention.linear_dispatch import build_linear_dispatch

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5  # float32 fla against the float64 reference, relative to the tensor's scale (observed ~1e-6)


@pytest.fixture
def interpreter(monkeypatch):
    """CPU tensors acceptable to fla (as under TRITON_INTERPRET=1), fla importable whatever is installed."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(gdn_kernels, "fla_import_problem", lambda: None)


def test_reference_by_name_and_on_a_cpu(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q = torch.zeros(4, 1, 8)
    assert gdn_kernel("auto", q, q) is chunk_gated_delta
    assert gdn_kernel("reference", q, q) is chunk_gated_delta


def test_fla_when_it_accepts_the_inputs(interpreter):
    q = torch.zeros(4, 1, 8)
    assert gdn_kernel("auto", q, q) is _fla_run
    assert gdn_kernel("fla", q.bfloat16(), q.bfloat16(), 32) is _fla_run
    assert gdn_kernel("auto", q.double(), q.double()) is chunk_gated_delta  # float64 stays exact


@pytest.mark.parametrize(
    "shape, dtype, chunk, match",
    [
        ((4, 1, 8), torch.float64, 64, "fla takes float32, bfloat16 or float16, got q torch.float64"),
        ((4, 1, 320), torch.float32, 64, "key head dim <= 256, got 320"),
        ((4, 1, 8), torch.float32, 8, "chunk_size 16, 32 or 64, got 8"),
    ],
)
def test_fla_refuses_what_it_cannot_run_in_one_line(interpreter, shape, dtype, chunk, match):
    q = torch.zeros(shape, dtype=dtype)
    with pytest.raises(BackendUnavailable, match=match) as e:
        gdn_kernel("fla", q, q, chunk)
    assert "\n" not in str(e.value) and str(e.value).startswith("Gated DeltaNet backend 'fla' unavailable")


def test_fla_on_cpu_tensors_and_unknown_names_are_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q = torch.zeros(4, 1, 8)
    with pytest.raises(BackendUnavailable, match="fla's Triton kernels need CUDA tensors, got device cpu"):
        gdn_kernel("fla", q, q)
    with pytest.raises(ValueError, match="unknown Gated DeltaNet backend 'flash'; choose auto or one of fla"):
        gdn_kernel("flash", q, q)
    d = build_linear_dispatch(plan_shards([3, 1], 1, "per_doc"), 0)
    with pytest.raises(BackendUnavailable, match="need CUDA tensors"):  # the op asks before any work
        cp_gated_delta(q, q, q, q[..., 0], q[..., 0], d, backend="fla")


def test_missing_fla_is_named_with_its_pin(monkeypatch):
    find_spec = importlib.util.find_spec
    hidden = lambda name, *a: None if name == "fla" else find_spec(name, *a)  # noqa: E731
    monkeypatch.setattr(importlib.util, "find_spec", hidden)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gdn_kernels.fla_import_problem.cache_clear()
    try:
        q = torch.zeros(4, 1, 8)
        with pytest.raises(BackendUnavailable, match=r"not installed \(pip install fla-core==0\.6\.0"):
            gdn_kernel("fla", q, q)
        assert gdn_kernel("auto", q, q) is chunk_gated_delta
    finally:
        gdn_kernels.fla_import_problem.cache_clear()


@pytest.mark.skipif(importlib.util.find_spec("fla") is None or importlib.util.find_spec("triton") is None,
                    reason="fla's kernel unchecked: flash-linear-attention or triton is not installed "
                           "(pip install fla-core==0.6.0, the test extra)")  # fmt: skip
@pytest.mark.slow
def test_fla_kernel_under_triton_interpreter_matches_the_reference():
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "fla_interpret.py")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1800)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    cases = {r["case"] for r in rows}
    assert cases == {"kernel", "summary", "op"}, cases
    kernel = {r["tensor"] for r in rows if r["case"] == "kernel"}
    assert kernel >= {"o", "final", "dq", "dg", "dbeta", "dinitial"}, kernel
    bad = [r for r in rows if not r["error"] <= TOL * max(1.0, r["scale"])]
    assert not bad, bad
