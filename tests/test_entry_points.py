"""Every command-line entry point prints its help and exits 0 with `--help`.

The entry points are found in the tree, not listed: each module of `flashcp` run with `python -m`
(a package's `__main__.py`, or a module guarded by `if __name__ == "__main__"`), each script so guarded
in `scripts/` and `benchmarks/`, and `train.py`; a new one is covered when it is added.

Each runs in a process of its own, forked from one server process that has imported torch and
`flashcp.titan.config` (TorchTitan and `datasets` with it: the imports nearly all share, 15 s of CPU
each on a loaded machine), as `python -m` / `python script.py` would run it (`runpy`, with its own
argv, stdout and stderr). `test_docs.py` starts `python -m flashcp.plan --help` as a fresh interpreter.
"""

from __future__ import annotations

import json
import os
import re
import select
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


SERVER = r"""
import json, os, runpy, sys, traceback
import torch, flashcp.titan.config  # noqa: F401  (torch, TorchTitan, datasets: imported once, then forked)

for line in sys.stdin:
    argv, out, err = json.loads(line)
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        os.dup2(os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 1)
        os.dup2(os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        code = 0
        try:
            if argv[0] == "-m":
                sys.argv = [argv[1], *argv[2:]]
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv = list(argv)
                sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
                runpy.run_path(argv[0], run_name="__main__")
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
            if isinstance(stop.code, str):
                print(stop.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    print(json.dumps(os.waitstatus_to_exitcode(status)), flush=True)
"""


@pytest.fixture(scope="module")
def run_entry_point(tmp_path_factory):
    """`run_entry_point(argv) -> (exit code, stdout, stderr)`, each in a process forked from the server."""
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    server = subprocess.Popen([sys.executable, "-c", SERVER], cwd=ROOT, env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    folder = tmp_path_factory.mktemp("entry_points")

    def run(argv: list[str]) -> tuple[int, str, str]:
        out, err = folder / "stdout", folder / "stderr"
        server.stdin.write(json.dumps([argv, str(out), str(err)]) + "\n")
        server.stdin.flush()
        ready, _, _ = select.select([server.stdout], [], [], 300)  # a hang bound only
        assert ready, f"{argv}: no exit within 300 s"
        return json.loads(server.stdout.readline()), out.read_text(), err.read_text()

    yield run
    server.stdin.close()
    server.wait(timeout=60)


@pytest.mark.parametrize("argv", ENTRY_POINTS, ids=lambda argv: argv[-1])
def test_help_prints_and_exits_0(run_entry_point, argv):
    code, stdout, stderr = run_entry_point([*argv, "--help"])
    assert code == 0, stderr[-2000:]
    assert len(stdout.strip().splitlines()) >= 3, f"{argv}: --help printed {stdout!r}"
    assert "Traceback" not in stderr, stderr[-2000:]
