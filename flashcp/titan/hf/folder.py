"""A Hugging Face model folder checked against the model that will load it, before anything loads.

An HF folder has no FlashCP manifest (no checksums written by a save we saw), so what can be
verified is verified from the files themselves, reading only their JSON headers:

- `config.json` describes an architecture FlashCP supports (`flashcp.titan.hf.config`).
- The weights are safetensors: `model.safetensors`, or the files `model.safetensors.index.json`
  lists, every listed file present and no other `*.safetensors` beside them (DCP's HF reader
  reads every such file in the folder: a stray one would mix into the weights). A folder with
  only `pytorch_model.bin` / `*.pt` is refused: those are pickles, which can run code.
- Each file is whole: its header parses and the last tensor ends exactly at the end of the file
  (a truncated copy is named).
- Every tensor the model needs is present with its shape and a floating dtype, and no tensor is
  left unused (another size or architecture is named by its first keys).

Bit flips inside the tensor data cannot be seen without checksums; safetensors itself cannot run
code, and nothing here trusts remote code.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
MAX_HEADER = 100 << 20  # the safetensors library's own bound on a header


class HFFolderError(ValueError):
    """An HF model folder that cannot be imported; the message is one line naming the problem."""


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files holding the model's weights (see the module docstring)."""
    folder = Path(folder)
    present = sorted(p.name for p in folder.glob("*.safetensors"))
    index = folder / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            listed = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            problem = f"{type(e).__name__}: {e}"
            raise HFFolderError(f"{index} is unreadable or has no weight_map ({problem})") from None
        missing = [name for name in listed if name not in present]
        if missing:
            raise HFFolderError(f"{folder / missing[0]} is missing (listed in {INDEX})"
                                + (f", and {len(missing) - 1} more" if len(missing) > 1 else ""))  # fmt: skip
        names = listed
    elif SINGLE in present:
        names = [SINGLE]
    else:
        pickles = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
        hint = (f" ({pickles[0]} is a pickle, which can run code: refused; convert it to safetensors)"
                if pickles else "")  # fmt: skip
        raise HFFolderError(f"{folder}: no {SINGLE} or {INDEX}{hint}")
    stray = [name for name in present if name not in names]
    if stray:
        raise HFFolderError(f"{folder / stray[0]} is not part of the model ({INDEX} does not list it): "
                            "move it out of the folder")  # fmt: skip
    return [folder / name for name in names]


def read_header(path: Path) -> dict[str, dict[str, Any]]:
    """{tensor name: {"dtype", "shape"}} of one safetensors file, checking that the file is whole."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise HFFolderError(f"{path} is truncated ({len(raw)} bytes): not a safetensors file")
            (length,) = struct.unpack("<Q", raw)
            if length > MAX_HEADER:
                raise HFFolderError(f"{path}: header of {length} bytes: not a safetensors file")
            header = json.loads(f.read(length))
        size = path.stat().st_size
    except OSError as e:
        raise HFFolderError(f"{path} is unreadable ({type(e).__name__}: {e})") from None
    except ValueError as e:
        raise HFFolderError(f"{path}: unreadable safetensors header ({e})") from None
    header.pop("__metadata__", None)
    end = 0
    for name, entry in header.items():
        try:
            end = max(end, int(entry["data_offsets"][1]))
            entry["shape"] = [int(n) for n in entry["shape"]]
        except (KeyError, TypeError, ValueError, IndexError):
            problem = f"{path}: tensor {name} has no valid shape / data_offsets in the header"
            raise HFFolderError(problem) from None
    if 8 + length + end != size:
        raise HFFolderError(f"{path} is {size} bytes, its header describes {8 + length + end}: "
                            "truncated or damaged")  # fmt: skip
    return header


def check_weights(folder: Path, expected: dict[str, tuple[int, ...]]) -> None:
    """HFFolderError naming the first problem when the folder's tensors are not exactly `expected`
    ({HF name: shape}) with floating dtypes."""
    stored: dict[str, dict[str, Any]] = {}
    for path in weight_files(folder):
        for name, entry in read_header(path).items():
            if name in stored:
                raise HFFolderError(f"{folder}: tensor {name} is stored twice ({path.name} and another file)")
            stored[name] = entry | {"file": path.name}
    problems = []
    missing = [k for k in expected if k not in stored]
    if missing:
        problems.append(f"{_first(missing)} missing (the model needs {_shape(expected[missing[0]])})")
    unused = [k for k in stored if k not in expected]
    if unused:
        problems.append(f"{_first(unused)} which the model has no place for")
    reshaped = [k for k in expected if k in stored and tuple(stored[k]["shape"]) != tuple(expected[k])]
    if reshaped:
        k = reshaped[0]
        more = f" (and {len(reshaped) - 1} more)" if len(reshaped) > 1 else ""
        problems.append(f"{k} is {_shape(stored[k]['shape'])} in {stored[k]['file']}, the model needs "
                        f"{_shape(expected[k])}{more}")  # fmt: skip
    not_float = [k for k in expected if k in stored and stored[k]["dtype"] not in FLOAT_DTYPES]
    if not_float:
        k = not_float[0]
        problems.append(f"{k} is stored as {stored[k]['dtype']}, not a float "
                        "(quantized weights are not supported)")  # fmt: skip
    if problems:
        raise HFFolderError(f"{folder} does not fit the job's model (another size or architecture?): "
                            + "; ".join(problems))  # fmt: skip


def _first(keys: list[str]) -> str:
    return ", ".join(keys[:2]) + (f" (and {len(keys) - 2} more)" if len(keys) > 2 else "")


def _shape(shape: Any) -> str:
    return f"[{', '.join(map(str, shape))}]"
