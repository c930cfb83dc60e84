"""The package layout holds: no import circles between modules, and each package imports only the
packages its `__init__` docstring allows (imports inside functions count: they are circles too)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "flashcp"

# Which packages of flashcp (and which outside libraries) each room may import. `core` is the
# planner, dispatch and attention engine.
CORE = {"flashcp", "flashcp.plan", "flashcp.dispatch", "flashcp.attention"}
ALLOWED = {
    "flashcp.plan": {"flashcp.plan"},
    "flashcp.dispatch": {"flashcp.plan"},
    "flashcp.attention": {"flashcp.plan", "flashcp.dispatch", "flashcp.attention"},
    "flashcp.data": CORE | {"flashcp.data"},
    "flashcp.run": {"flashcp.run"},
    "flashcp.costmodel": CORE | {"flashcp.data", "flashcp.costmodel"},
    "flashcp.gpucheck": CORE | {"flashcp.data", "flashcp.costmodel", "flashcp.gpucheck"},
}
# flashcp.titan's rooms, as their `__init__` docstrings say: each may import the rooms outside
# flashcp.titan that the TorchTitan layer may, the package's own top-level modules (`compat`,
# `trainer`, `export`) and the rooms listed here.
TITAN = CORE | {"flashcp.data", "flashcp.run", "flashcp.costmodel", "flashcp.titan"}
TITAN_ROOMS = {
    "flashcp.titan": {"flashcp.titan.components", "flashcp.titan.hf", "flashcp.titan.models", "flashcp.titan.probe"},
    "flashcp.titan.config": {"flashcp.titan.components", "flashcp.titan.hf", "flashcp.titan.models"},
    "flashcp.titan.models": {"flashcp.titan.config", "flashcp.titan.hf"},
    "flashcp.titan.hf": {"flashcp.titan.models"},
    "flashcp.titan.components": {"flashcp.titan.hf"},
    "flashcp.titan.launch": {"flashcp.titan.config", "flashcp.titan.components", "flashcp.titan.hf",
                             "flashcp.titan.models", "flashcp.titan.probe"},
    # The dry run plans an HF import's load as the checkpointer does (its key map, the folder's check).
    "flashcp.titan.dryrun": {"flashcp.titan.components", "flashcp.titan.config", "flashcp.titan.hf",
                             "flashcp.titan.launch", "flashcp.titan.models"},
    # The retrieval probe scores through validation's token scoring and the trainer's path; its CLI
    # builds a job as train.py does (config, launch) and checks a checkpoint as the export does (hf).
    "flashcp.titan.probe": {"flashcp.titan.components", "flashcp.titan.config", "flashcp.titan.hf",
                            "flashcp.titan.launch"},
    # The GPU lease's TorchTitan parts: jobs for the launcher (forked on a CPU), and the dry runs they
    # are checked against.
    "flashcp.titan.lease": {"flashcp.titan.config", "flashcp.titan.dryrun", "flashcp.titan.launch"},
}
ALLOWED.update({name: TITAN | rooms | {name} for name, rooms in TITAN_ROOMS.items()})
TORCHTITAN_ALLOWED = set(TITAN_ROOMS)
# Command-line tools beside a library room: the planner CLI draws windows from length distributions.
ENTRY_POINTS = {"flashcp.plan.__main__": {"flashcp.data"}}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports(path: Path) -> set[str]:
    """Every module `path` imports, at any depth of its code (absolute names)."""
    found = set()
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base]).strip(".")
            found.add(base)
            for alias in node.names:  # `from package import module`
                if is_module(f"{base}.{alias.name}"):
                    found.add(f"{base}.{alias.name}")
    return found


def graph() -> dict[str, set[str]]:
    """Module -> the modules it imports; packages' `__init__` re-exports are left out (not ideas)."""
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"}
    return {name: {m for m in imports(path) if m in paths and m != name} for name, path in paths.items()}


def room(module: str) -> str:
    """flashcp.X for a top-level room; flashcp.titan.X for a room of flashcp.titan, whose top-level
    modules (compat, trainer, export) belong to flashcp.titan itself."""
    parts = module.split(".")
    if parts[:2] == ["flashcp", "titan"] and len(parts) > 2 and (PACKAGE / "titan" / parts[2]).is_dir():
        return ".".join(parts[:3])
    return ".".join(parts[:2]) if len(parts) > 1 else module


def test_no_module_imports_itself_through_others() -> None:
    edges = graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for start in sorted(edges):
        if start not in state:
            visit(start, [start])
    assert not [" -> ".join(c) for c in cycles]


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_each_room_imports_only_what_it_may(package: str) -> None:
    bad = []
    for path in PACKAGE.rglob("*.py"):
        name = module_name(path)
        if room(name) != package:
            continue
        for imported in imports(path):
            top = imported.split(".")[0]
            if top == "torchtitan" and package not in TORCHTITAN_ALLOWED:
                bad.append(f"{name} imports {imported}")
            allowed = ALLOWED[package] | ENTRY_POINTS.get(name, set())
            if top == "flashcp" and imported != "flashcp" and room(imported) not in allowed:
                bad.append(f"{name} imports {imported}")
    assert not bad, "\n".join(bad)


def test_every_package_says_what_it_holds_and_may_import() -> None:
    for init in [*PACKAGE.glob("*/__init__.py"), *PACKAGE.glob("titan/*/__init__.py")]:
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "may import" in doc.lower(), f"{init.relative_to(ROOT)}: its docstring does not say what it may import"
