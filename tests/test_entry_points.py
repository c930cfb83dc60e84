"""Every command-line entry point prints its help and exits 0 with `--help`.

The entry points are found in the tree, not listed: each module of `flashcp` run with `python -m`
(a package's `__main__.py`, or a module guarded by `if __name__ == "__main__"`), each script so guarded
in `scripts/` and `benchmarks/`, and `train.py`; a new one is covered when it is added.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAIN_GUARD = re.compile(r"""^if __name__ == ["']__main__["']:""", re.MULTILINE)


def entry_points() -> list[list[str]]:
    """The argv (after the interpreter) that starts each entry point."""
    modules = set()
    for path in sorted((ROOT / "flashcp").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if path.name == "__main__.py":
            modules.add(".".join(parts[:-1]))
        elif MAIN_GUARD.search(path.read_text()):
            modules.add(".".join(parts))
    files = [*sorted((ROOT / "scripts").glob("*.py")), *sorted((ROOT / "benchmarks").glob("*.py")), ROOT / "train.py"]
    scripts = [path for path in files if MAIN_GUARD.search(path.read_text())]  # not benchmarks/sweep.py, a library
    return [["-m", name] for name in sorted(modules)] + [[str(p.relative_to(ROOT))] for p in scripts]


ENTRY_POINTS = entry_points()


def test_the_tree_holds_the_known_entry_points():
    """The search finds what it must (a broken search would make the test below vacuous)."""
    found = {" ".join(argv) for argv in ENTRY_POINTS}
    known = {"-m flashcp.titan.launch", "-m flashcp.titan.export", "-m flashcp.titan.probe",
             "-m flashcp.data.prepare", "-m flashcp.data.plan_worker", "-m flashcp.plan", "benchmarks/balance.py",
             "scripts/make_tiny_hf.py", "train.py"}  # fmt: skip
    assert known <= found, known - found


@pytest.mark.parametrize("argv", ENTRY_POINTS, ids=lambda argv: argv[-1])
def test_help_prints_and_exits_0(argv):
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, *argv, "--help"], cwd=ROOT, env=env, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(done.stdout.strip().splitlines()) >= 3, f"{argv}: --help printed {done.stdout!r}"
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
