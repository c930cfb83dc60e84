"""The wheels carried to a GPU machine (scripts/gpu_wheels.txt) are what the lease needs there: every
distribution that importing FlashCP's TorchTitan layer loads, and every requirement of those carried,
is either on the GPU machine's image or in the list; each one left out says why and is not imported.

No network: the list is read from the file and the requirements from this venv's installed metadata.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
LIST = ROOT / "scripts" / "gpu_wheels.txt"


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_list() -> tuple[dict[str, str], set[str], dict[str, str]]:
    """(pinned name -> version, the GPU image's packages, skipped name -> reason)."""
    pins, image, skips = {}, set(), {}
    for line in LIST.read_text().splitlines():
        if m := re.match(r"^([A-Za-z0-9_.-]+)==(\S+)", line):
            pins[norm(m[1])] = m[2]
        elif m := re.match(r"^# on the GPU machine: (.+)$", line):
            image = {norm(n) for n in m[1].split()}
        elif m := re.match(r"^# skip: (\S+)\s+#\s*(.+)$", line):
            skips[norm(m[1])] = m[2]
    return pins, image, skips


def requirements(dist: str) -> list[Requirement]:
    """`dist`'s requirements that apply without extras on Linux / CPython 3.12."""
    env = {"extra": "", "python_version": "3.12", "python_full_version": "3.12.0", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
           "platform_python_implementation": "CPython", "os_name": "posix"}  # fmt: skip
    out = []
    for text in metadata.requires(dist) or []:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate(env):
            out.append(req)
    return out


def closure(roots: set[str]) -> set[str]:
    """Every installed distribution `roots` need, transitively (as installed in this venv)."""
    seen, todo = set(), list(roots)
    while todo:
        name = norm(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            todo += [req.name for req in requirements(name)]
        except metadata.PackageNotFoundError:
            pass
    return seen


def test_the_list_reads_and_is_pinned_once() -> None:
    pins, image, skips = read_list()
    assert {"torchtitan", "datasets", "matplotlib", "torchao"} <= set(pins)
    assert {"torch", "numpy", "transformers"} <= image
    assert not set(pins) & set(skips), "a package is both carried and skipped"
    names = [norm(m[1]) for m in re.finditer(r"^([A-Za-z0-9_.-]+)==", LIST.read_text(), re.M)]
    assert len(names) == len(set(names)), "a package is pinned twice"


def test_every_requirement_of_a_carried_wheel_travels_or_is_there() -> None:
    """TorchTitan's (and every carried package's) requirements, transitively, minus the GPU image's,
    are carried or skipped with a reason; and each pinned version meets what its dependents ask for."""
    pins, image, skips = read_list()
    on_image = closure(image)
    missing, unmet, not_here = [], [], []
    for name in pins:
        try:
            reqs = requirements(name)
        except metadata.PackageNotFoundError:
            not_here.append(name)
            continue
        for req in reqs:
            dep = norm(req.name)
            if dep in pins:
                if not req.specifier.contains(pins[dep], prereleases=True):
                    unmet.append(f"{name} requires {req}, the list pins {dep}=={pins[dep]}")
            elif dep not in on_image and dep not in skips:
                missing.append(f"{name} requires {req}")
    # torchao is not installed in the development venv; its wheel declares no requirements.
    assert set(not_here) <= {"torchao"}, f"pinned but not installed here, requirements unchecked: {not_here}"
    if not_here:
        print(f"requirements not checked (not installed in this venv): {not_here}")
    assert not missing, "neither carried nor on the GPU image:\n" + "\n".join(missing)
    assert not unmet, "\n".join(unmet)
    for name in ("torchtitan", "datasets", "matplotlib"):  # what FlashCP imports is the installed version
        assert metadata.version(name) == pins[name], f"{name}: the list pins {pins[name]}, tested with {metadata.version(name)}"


IMPORTED = """
import importlib, json, pkgutil, re, sys
from importlib.machinery import PathFinder
from importlib.metadata import packages_distributions

allowed = set(json.loads(sys.argv[1]))
owners = packages_distributions()  # top-level module -> distributions
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
hidden = {top for top, dists in owners.items() if not {norm(d) for d in dists} & allowed}


class Hidden:
    # the path finder, blind to the distributions neither carried nor on the GPU image: as if not installed
    @staticmethod
    def find_spec(name, path=None, target=None):
        return None if name.split(".")[0] in hidden else PathFinder.find_spec(name, path, target)

    @staticmethod
    def find_distributions(*args, **kwargs):
        return [d for d in PathFinder.find_distributions(*args, **kwargs) if norm(d.metadata["Name"]) in allowed]

    @staticmethod
    def invalidate_caches():
        PathFinder.invalidate_caches()


sys.meta_path = [Hidden if finder is PathFinder else finder for finder in sys.meta_path]
import flashcp.titan

for pkg in ("flashcp.titan", "flashcp.gpucheck"):
    for info in pkgutil.walk_packages(importlib.import_module(pkg).__path__, pkg + "."):
        if not info.name.endswith("__main__"):  # command-line entry points run on import
            importlib.import_module(info.name)
# a top-level name some allowed distribution shares (a namespace such as google) counts as theirs
loaded = {norm(d) for top in {m.split(".")[0] for m in sys.modules} for d in owners.get(top, [])}
shared = {norm(d) for top, dists in owners.items() if top not in hidden for d in dists} - allowed
print(json.dumps(sorted(loaded - shared)))
"""


def test_flashcp_titan_imports_with_only_what_travels_or_is_there() -> None:
    """Every module of flashcp.titan and flashcp.gpucheck (the lease's parts) imports with only the GPU
    image's distributions and the carried ones installed (the others hidden from the import system),
    and TorchTitan's own and the probe's are among those loaded."""
    pins, image, skips = read_list()
    allowed = closure(image) | set(pins) | {"flashcp"}
    out = subprocess.run([sys.executable, "-c", IMPORTED, json.dumps(sorted(allowed))], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    loaded = {norm(d) for d in json.loads(out.stdout.strip().splitlines()[-1])}
    assert loaded <= allowed, loaded - allowed
    assert not loaded & set(skips)
    assert {"torchtitan", "datasets", "matplotlib"} <= loaded
