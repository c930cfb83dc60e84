"""scripts/setup_env.sh refuses an interpreter older than torchtitan 0.3.0 needs, before creating
anything (rather than failing deep inside pip)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _fake_python(tmp_path: Path, version: str) -> Path:
    """An executable that answers like `python3` of `version` to the script's version probes."""
    exe = tmp_path / f"python{version}"
    major, minor = version.split(".")
    exe.write_text(
        "#!/bin/sh\n"
        f'case "$2" in *version_info\\ \\<*) [ {minor} -ge 11 ] && [ {major} -ge 3 ]; exit $? ;; esac\n'
        f'echo "{version}"\n'
    )
    exe.chmod(0o755)
    return exe


def _setup(tmp_path: Path, python: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": str(python), "FLASHCP_VENV": str(tmp_path / "venv")}
    return subprocess.run(["bash", str(ROOT / "scripts/setup_env.sh")], env=env, capture_output=True, text=True,
                          timeout=60)  # fmt: skip


def test_python_3_10_is_refused_before_anything_is_created(tmp_path):
    proc = _setup(tmp_path, _fake_python(tmp_path, "3.10"))
    assert proc.returncode != 0
    assert "is Python 3.10 but FlashCP (torchtitan 0.3.0) needs >= 3.11" in proc.stderr
    assert "PYTHON=python3.11" in proc.stderr
    assert not (tmp_path / "venv").exists()


def test_a_missing_interpreter_is_named(tmp_path):
    proc = _setup(tmp_path, tmp_path / "no-such-python")
    assert proc.returncode != 0 and "cannot run" in proc.stderr and not (tmp_path / "venv").exists()


def test_the_declared_requirement_matches():
    assert 'requires-python = ">=3.11"' in (ROOT / "pyproject.toml").read_text()
