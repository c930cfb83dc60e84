"""scripts/setup_env.sh refuses an interpreter older than torchtitan 0.3.0 needs before it creates or
installs anything (rather than failing deep inside pip), also inside a venv an earlier run left."""

from __future__ import annotations

import fcntl
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _fake_python(path: Path, version: str) -> Path:
    """An executable at `path` that answers the version probe like Python `version` and fails at
    anything else (a venv's package check, `-m venv`, pip); it logs every call to `path`.log."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> "{path}.log"\n'
        f'case "$*" in *version_info*) echo "{version}" ;; *) exit 1 ;; esac\n'
    )
    path.chmod(0o755)
    return path


def _calls(python: Path) -> list[str]:
    log = Path(f"{python}.log")
    return log.read_text().splitlines() if log.exists() else []


def _setup(tmp_path: Path, python: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": str(python), "FLASHCP_VENV": str(tmp_path / "venv")}
    script = str(ROOT / "scripts/setup_env.sh")
    return subprocess.run(["bash", script], env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("version", ["3.10", "3.9"])
def test_an_old_python_is_refused_before_anything_is_created(tmp_path, version):
    python = _fake_python(tmp_path / "bin/python3", version)
    proc = _setup(tmp_path, python)
    assert proc.returncode != 0
    assert f"{python} is Python {version} but FlashCP (torchtitan 0.3.0) needs >= 3.11" in proc.stderr
    assert "PYTHON=python3.11" in proc.stderr and len(proc.stderr.splitlines()) == 1
    assert not (tmp_path / "venv").exists()
    assert all("version_info" in call for call in _calls(python))  # no `-m venv`, no pip


@pytest.mark.parametrize("version", ["3.11", "3.12"])
def test_a_new_enough_python_goes_on_to_create_the_venv(tmp_path, version):
    python = _fake_python(tmp_path / "bin/python3", version)
    proc = _setup(tmp_path, python)  # fails after the check: the fake cannot make a venv
    assert "needs >= 3.11" not in proc.stderr
    assert any(call.startswith("-m venv") for call in _calls(python))


def test_a_venv_left_by_an_old_python_is_refused_before_pip(tmp_path):
    old = _fake_python(tmp_path / "venv/bin/python", "3.10")  # the first run made it, then pip failed
    new = _fake_python(tmp_path / "bin/python3.11", "3.11")
    proc = _setup(tmp_path, new)
    assert proc.returncode != 0
    assert f"{old} is Python 3.10" in proc.stderr and f"remove {tmp_path / 'venv'}" in proc.stderr
    assert not any("pip" in call for call in _calls(old)) and _calls(new) == []


def test_a_missing_interpreter_is_named(tmp_path):
    proc = _setup(tmp_path, tmp_path / "no-such-python")
    assert proc.returncode != 0 and "cannot run" in proc.stderr and not (tmp_path / "venv").exists()


def test_the_declared_requirement_matches():
    assert 'requires-python = ">=3.11"' in (ROOT / "pyproject.toml").read_text()


def test_a_second_node_waits_for_the_first_ones_setup(tmp_path):
    """Two nodes sharing a checkout: while one holds the set-up lock, another does nothing; it goes on
    (and finds the venv made or makes it) once the lock is free."""
    python = _fake_python(tmp_path / "bin/python3", "3.11")
    lock = os.open(tmp_path / "venv.setup.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(lock, fcntl.LOCK_EX)  # the first node, setting up
    try:
        env = {**os.environ, "PYTHON": str(python), "FLASHCP_VENV": str(tmp_path / "venv")}
        waiting = subprocess.Popen(["bash", str(ROOT / "scripts/setup_env.sh")], env=env, stderr=subprocess.PIPE)
        with pytest.raises(subprocess.TimeoutExpired):
            waiting.wait(timeout=3)
        assert _calls(python) == []  # waited before the version check, so before creating anything
    finally:
        os.close(lock)
    assert waiting.wait(timeout=300) != 0  # the fake cannot make a venv, but it went on to try
    assert any(call.startswith("-m venv") for call in _calls(python))
