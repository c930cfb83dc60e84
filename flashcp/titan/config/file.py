"""Reading a job file: find it, bound it, parse its TOML, apply `--section.key value` overrides.

    cfg = load_job(resolve_config_path("debug_cpu"), ["--training.steps", "20"])

A mangled or hostile file fails in milliseconds with one line: its size and nesting are bounded
before `tomllib` sees it (it recurses once per level: RecursionError at ~1,000 levels, minutes at
10^6). `load_job` then validates the whole job (`flashcp.titan.config.checks.validate`).
"""

from __future__ import annotations

import re
import typing
from pathlib import Path
from typing import Any

import tomllib

from flashcp.titan.config.checks import validate
from flashcp.titan.config.keys import ConfigError, Key
from flashcp.titan.config.schema import SCHEMA

CONFIG_DIR = Path(__file__).resolve().parents[3] / "train_configs"
DEFAULT_CONFIG = "default.toml"
# A setting is copied into every rank's log and every node's job card: a job file stays small.
MAX_JOB_BYTES = 1 << 20
MAX_NESTING = 32  # arrays / inline tables inside each other; real jobs nest 2 deep


def resolve_config_path(name: str | None) -> Path:
    """A job file by path of any name, or by name (with or without .toml) inside train_configs/.

    A path that exists but is no file (a directory, a pipe) is returned too, so that reading it
    says what it is instead of "not found"."""
    name = name or DEFAULT_CONFIG
    path = Path(name)
    named = path if path.suffix == ".toml" else path.with_name(path.name + ".toml")
    candidates = [path, named]
    if len(path.parts) == 1:
        candidates.append(CONFIG_DIR / named.name)
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    if path.exists():
        return path
    shipped = ", ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.toml")))
    raise ConfigError(f"config {name!r} not found (as a path or in {CONFIG_DIR}); shipped configs: {shipped}")


def _check_nesting(text: str, where: str) -> None:
    """ConfigError when arrays / inline tables nest deeper than MAX_NESTING, found on the raw text
    (brackets outside strings and comments) before tomllib, which recurses once per level."""
    depth = 0
    for token in _TOML_TOKENS.finditer(text):
        bracket = token.group()
        if bracket in ("[", "{"):
            depth += 1
            if depth > MAX_NESTING:
                line = text.count("\n", 0, token.start()) + 1
                raise ConfigError(f"{where}: line {line}: arrays or tables nested more than {MAX_NESTING} deep; "
                                  "a job file may nest at most that")  # fmt: skip
        elif bracket in ("]", "}"):
            depth = max(depth - 1, 0)


# Strings (basic, literal, multi-line) and comments, matched whole so that their brackets are
# skipped, or a single bracket.
_TOML_TOKENS = re.compile(
    r'"""(?:\\.|[^\\])*?"""' r"|'''.*?'''" r'|"(?:\\.|[^"\\\n])*"' r"|'[^'\n]*'" r"|#[^\n]*" r"|[\[\]{}]",
    re.DOTALL,
)


def _parse_value(text: str, where: str, key: Key | None) -> Any:
    """A CLI value as a TOML value (20, 1e-3, true, ["a"]) or else the plain string; for a list of
    strings or numbers also TorchTitan's comma form (`--compile.components model,loss`,
    `--probe.depths -0.1,0.5`), one value being a list of one."""
    _check_nesting(text, where)
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text
    item = typing.get_args(key.type) if key is not None and typing.get_origin(key.type) is list else ()
    if isinstance(value, list) or item not in ((str,), (int,), (float,)):
        return value
    if item == (str,):
        return (value if isinstance(value, str) else text).split(",")
    return [_parse_value(part, where, None) for part in text.split(",")]


def _is_table(section: str, name: str) -> bool:
    key = SCHEMA.get(section, {}).get(name)
    return key is not None and (typing.get_origin(key.type) or key.type) is dict


def apply_overrides(raw: dict[str, Any], args: list[str]) -> dict[str, Any]:
    """TorchTitan-style `--section.key value` / `--section.key=value` overrides, in order."""
    out = {section: dict(values) if isinstance(values, dict) else values for section, values in raw.items()}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(f"unexpected argument {arg!r}; overrides look like --section.key value")
        name, _, value = arg[2:].partition("=")
        if not _:
            if i + 1 < len(args) and not args[i + 1].startswith("--"):
                value, i = args[i + 1], i + 1
            else:
                value = "true"  # a bare flag switches a boolean on
        section, _, key = name.partition(".")
        path = key.split(".")
        if not section or not all(path) or (len(path) > 1 and not _is_table(section, path[0])):
            raise ConfigError(f"override {arg!r} must name one key as --section.key (--section.table.key "
                              "inside a table key such as data.mix)")  # fmt: skip
        if not isinstance(out.get(section, {}), dict):
            raise ConfigError(f"[{section}] is not a table")
        table = out.setdefault(section, {})
        for depth, part in enumerate(path[:-1]):  # copied on the way down: `raw` stays as read
            inner = table.get(part, {})
            if not isinstance(inner, dict):
                raise ConfigError(f"[{section}] {'.'.join(path[: depth + 1])} is not a table")
            table[part] = dict(inner)
            table = table[part]
        table[path[-1]] = _parse_value(value, f"override --{name}", SCHEMA.get(section, {}).get(key))
        i += 1
    return out


def load_job(path: str | Path, overrides: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """Read, override and validate a job file (see the module docstring)."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{path} is a directory, not a job file")
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_JOB_BYTES + 1)  # bounded: a path may be a device or a pipe
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e}") from e
    if len(data) > MAX_JOB_BYTES:
        raise ConfigError(f"{path} is larger than {MAX_JOB_BYTES >> 20} MiB, the most a job file may hold")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path} is not UTF-8 text (byte {e.start}): not a job file") from e
    _check_nesting(text, str(path))
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path} is not valid TOML: {e}") from e
    cfg = validate(apply_overrides(raw, overrides or []))
    cfg["_path"] = str(path)
    return cfg
