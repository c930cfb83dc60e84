"""One setting of a job file (`Key`) and the check of a value against it.

A key's type is a Python type hint as dataclasses declare them (`int`, `float | int`, `str | None`,
`Literal[...]`, `list[str]`, `dict[str, Any]`), so the same code checks FlashCP's own keys and
those read from TorchTitan's config classes (`flashcp.titan.config.titan`). Every failure is one
`ConfigError` line naming the key and what it accepts.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass
from typing import Any

MAX_STRING_CHARS = 4096  # PATH_MAX on Linux: no path or description needs more


class ConfigError(ValueError):
    """A job file, override or layout that cannot run; the message names the key."""


@dataclass(frozen=True)
class Key:
    """One setting: its type, default (None: unset, the consumer decides) and allowed values."""

    type: Any
    default: Any = None
    choices: tuple | None = None
    doc: str = ""


_SCALARS = (bool, int, float, str)
_NAMES = {bool: ("true or false", "booleans"), int: ("an integer", "integers"), float: ("a number", "numbers"),
          str: ("a string", "strings"), Any: ("any value", "values")}  # fmt: skip


def key_from_hint(hint: Any, default: Any, where: str) -> Key:
    """The Key of a dataclass field: Optional and `float | int` collapse to one type, Literal gives choices.
    TypeError for a type a TOML value cannot hold (the caller lists such fields as not settable)."""
    if typing.get_origin(hint) is typing.Annotated:
        hint = typing.get_args(hint)[0]
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if set(rest) == {float, int}:
            return Key(float, default)
        if len(rest) != 1:
            raise TypeError(f"{where}: a union of {hint} has no TOML form")
        return key_from_hint(rest[0], default, where)
    if typing.get_origin(hint) is typing.Literal:
        kinds = {type(a) for a in args}
        if len(kinds) != 1 or not kinds <= set(_SCALARS):
            raise TypeError(f"{where}: Literal{list(args)} mixes types")
        return Key(kinds.pop(), default, tuple(args))
    if not _checkable(hint):
        raise TypeError(f"{where}: {hint} has no TOML form")
    return Key(hint, default)


def _checkable(hint: Any) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in _SCALARS or hint is Any or hint in (list, dict):
        return True
    if origin is list and len(args) == 1:
        return _checkable(args[0])
    return origin is dict and len(args) == 2 and args[0] is str and _checkable(args[1])


def type_name(hint: Any, plural: bool = False) -> str:
    """'an integer', 'a list of strings', 'a table of tables' ..."""
    if hint in _NAMES:
        return _NAMES[hint][plural]
    origin, args = typing.get_origin(hint) or hint, typing.get_args(hint)
    kind = {list: ("a list", "lists"), dict: ("a table", "tables")}[origin][plural]
    return f"{kind} of {type_name(args[-1], plural=True)}" if args and args[-1] is not Any else kind


def _conforms(value: Any, hint: Any) -> bool:
    if hint is Any:
        return True
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    origin, args = typing.get_origin(hint) or hint, typing.get_args(hint)
    if not isinstance(value, origin):
        return False
    if origin is list and args:
        return all(_conforms(v, args[0]) for v in value)
    if origin is dict and args:
        return all(isinstance(k, str) and _conforms(v, args[1]) for k, v in value.items())
    return True


def _strings(value: Any) -> typing.Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, (list, dict)):
        for item in value.values() if isinstance(value, dict) else value:
            yield from _strings(item)


def _floats(value: Any) -> Any:
    """int -> float where the key is a number (TOML writes 1 for 1.0)."""
    return float(value) if isinstance(value, int) and not isinstance(value, bool) else value


def shown(value: Any) -> str:
    """repr(value), cut short: a message stays one readable line whatever a file holds."""
    text = repr(value)
    return text if len(text) <= 200 else f"{text[:200]}... ({len(text)} characters)"


def check_value(section: str, name: str, key: Key, value: Any) -> Any:
    """`value` as the key holds it (an int given for a number becomes a float), or ConfigError."""
    where = f"[{section}] {name}"
    if not _conforms(value, key.type):
        raise ConfigError(f"{where} must be {type_name(key.type)}, got {shown(value)} ({type(value).__name__})")
    if key.type is float:
        value = _floats(value)
        if not math.isfinite(value):
            raise ConfigError(f"{where} must be finite, got {value!r}")
    for text in _strings(value):
        if len(text) > MAX_STRING_CHARS:
            raise ConfigError(f"{where} is {len(text)} characters long; a setting may hold at most "
                              f"{MAX_STRING_CHARS} (it is copied into every log)")  # fmt: skip
    if key.choices is not None and value not in key.choices:
        raise ConfigError(f"{where} must be one of {', '.join(map(str, key.choices))}; got {value!r}")
    return value


def field_default(f: dataclasses.Field) -> Any:
    """A dataclass field's default, a fresh one where it has a factory."""
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
