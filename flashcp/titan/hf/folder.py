"""A Hugging Face model folder checked against the model that will load it, before anything loads.

An HF folder has no FlashCP manifest (no checksums written by a save we saw), so what can be
verified is verified from the files themselves, reading only their JSON headers:

- `config.json` describes an architecture FlashCP supports (`flashcp.titan.hf.config`).
- The weights are safetensors: `model.safetensors`, or the files `model.safetensors.index.json`
  lists, every listed file present (a regular file inside the folder, as the index and
  config.json: `flashcp.titan.hf.files`) and no other `*.safetensors` beside them (DCP's HF reader
  reads every such file in the folder: a stray one would mix into the weights). A folder with
  only `pytorch_model.bin` / `*.pt` is refused: those are pickles, which can run code.
- Each file is whole: its header is a JSON object whose entries each give a dtype, a shape and
  data offsets that fit the shape, the tensors' bytes tile the data without gaps or overlaps and
  the last one ends exactly at the end of the file (a truncated copy is named); the index maps
  tensor names to file names.
- A folder of MXFP4 experts (the released gpt-oss checkpoints) is refused naming the command that
  writes an unquantized copy (`flashcp.titan.hf.gpt_oss`).
- Every tensor the model needs is present with its shape and a floating dtype, and no tensor is
  left unused (another size or architecture is named by its first keys). A tied model (one
  embedding for input and output) also loads a folder that stores `lm_head.weight` as well,
  as transformers does, when that copy equals the embedding.
- `check_finite`, run once before launch (it reads every tensor: about the time of reading the
  folder from disk), refuses a tensor holding NaN or inf, which would otherwise show only as a
  non-finite loss at the first step.

Bit flips inside the tensor data cannot be seen without checksums; safetensors itself cannot run
code, and nothing here trusts remote code.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from flashcp.titan.hf.files import FolderFileError, member, read_member
from flashcp.titan.hf.gpt_oss import mxfp4_problem
from flashcp.titan.hf.qwen3_5 import layer_kind_problem

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
# Bytes per element of the safetensors dtypes with whole-byte elements (others: sizes not checked).
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8,
               "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}  # fmt: skip
MAX_HEADER = 100 << 20  # the safetensors library's own bound on a header
TIED_HEAD, EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"
# Qwen3.5's and Qwen3-Next's multi-token-prediction head: stored beside the causal LM, which does not
# hold it (transformers' *ForCausalLM ignores it on load too).
PREDICTION_HEAD = "mtp"
CHUNK_BYTES = 64 << 20  # check_finite reads a large tensor in row blocks of about this size


class HFFolderError(ValueError):
    """An HF model folder that cannot be imported; the message is one line naming the problem."""


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files holding the model's weights (see the module docstring)."""
    folder = Path(folder)
    present = sorted(p.name for p in folder.glob("*.safetensors"))
    index = folder / INDEX
    if index.exists() or index.is_symlink():  # anything by that name: a fifo or a link out is named
        listed = sorted(set(_weight_map(index).values()))
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
    for name in names:
        _member(folder, name)
    return [folder / name for name in names]


def _member(folder: Path, name: str) -> None:
    """HFFolderError unless `folder / name` is a regular file inside the folder (`flashcp.titan.hf.files`)."""
    try:
        member(folder, name)
    except FolderFileError as e:
        raise HFFolderError(str(e)) from None


def _weight_map(index: Path) -> dict[str, str]:
    """The index's {tensor name: file name}; HFFolderError naming the index unless it is one."""
    try:
        content = json.loads(read_member(index.parent, index.name, MAX_HEADER))
    except FolderFileError as e:
        raise HFFolderError(str(e)) from None
    except ValueError as e:
        raise HFFolderError(f"{index} is unreadable ({type(e).__name__}: {e})") from None
    weight_map = content.get("weight_map") if isinstance(content, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise HFFolderError(f"{index} has no weight_map object (tensor name -> file name)")
    for name, file in weight_map.items():
        if not isinstance(file, str) or Path(file).name != file or not file.endswith(".safetensors"):
            raise HFFolderError(f"{index}: weight_map[{name!r}] = {file!r} is not a .safetensors file name")
    return weight_map


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
    if not isinstance(header, dict):
        raise HFFolderError(f"{path}: the safetensors header is a JSON {type(header).__name__}, not an object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise HFFolderError(f"{path}: the header's __metadata__ is not an object of strings")
    end = 0
    for name, entry in sorted(header.items(), key=lambda item: _offsets(item[1])):
        problem = _entry_problem(entry)
        if problem is None and entry["data_offsets"][0] != end:
            problem = f"starts at byte {entry['data_offsets'][0]} of the data, not at {end} where the previous ends"
        if problem is not None:
            raise HFFolderError(f"{path}: tensor {name} in the header {problem}")
        end = entry["data_offsets"][1]
    if 8 + length + end != size:
        raise HFFolderError(f"{path} is {size} bytes, its header describes {8 + length + end}: "
                            "truncated or damaged")  # fmt: skip
    return header


def _offsets(entry: Any) -> tuple[int, int]:
    """An entry's data offsets for sorting (anything malformed first, to be named)."""
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    valid = isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(n) for n in offsets)
    return tuple(offsets) if valid else (-1, -1)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _entry_problem(entry: Any) -> str | None:
    """What is wrong with one tensor's header entry, or None."""
    if not isinstance(entry, dict):
        return f"is a JSON {type(entry).__name__}, not an object (dtype, shape, data_offsets)"
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str):
        return f"has no dtype string (dtype = {dtype!r})"
    if not isinstance(shape, list) or not all(_is_int(n) for n in shape):
        return f"has no valid shape (shape = {shape!r})"
    if _offsets(entry) == (-1, -1) or offsets[0] > offsets[1]:
        return f"has no valid data_offsets (data_offsets = {offsets!r})"
    if dtype in DTYPE_BYTES and offsets[1] - offsets[0] != math.prod(shape) * DTYPE_BYTES[dtype]:
        return (f"has {offsets[1] - offsets[0]} bytes of data, its shape {_shape(shape)} of {dtype} needs "
                f"{math.prod(shape) * DTYPE_BYTES[dtype]}")  # fmt: skip
    return None


def check_weights(folder: Path, expected: dict[str, tuple[int, ...]]) -> tuple[str, ...]:
    """HFFolderError naming the first problem when the folder's tensors are not exactly `expected`
    ({HF name: shape}) with floating dtypes. Returns the top-level HF modules stored but left unread
    on purpose: "lm_head" for a tied model's redundant copy of the embedding, "mtp" for a multi-token
    prediction head the model does not hold."""
    stored: dict[str, dict[str, Any]] = {}
    for path in weight_files(folder):
        for name, entry in read_header(path).items():
            if name in stored:
                raise HFFolderError(f"{folder}: tensor {name} is stored twice ({path.name} and another file)")
            stored[name] = entry | {"file": path.name}
    problem = mxfp4_problem(folder, stored) or layer_kind_problem(folder, stored, expected)
    if problem:
        raise HFFolderError(problem)
    tied = TIED_HEAD not in expected and EMBEDDING in expected
    redundant = tied and TIED_HEAD in stored and EMBEDDING in stored
    if redundant:
        _check_tied_copy(folder, stored)
        del stored[TIED_HEAD]
    predicting = [k for k in stored if k.startswith(PREDICTION_HEAD + ".")]
    for k in predicting:
        del stored[k]
    unread = ((TIED_HEAD.removesuffix(".weight"),) if redundant else ()) + ((PREDICTION_HEAD,) if predicting else ())
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
    return unread


def _check_tied_copy(folder: Path, stored: dict[str, dict[str, Any]]) -> None:
    """HFFolderError unless the stored lm_head.weight equals the embedding the tied model uses for it."""
    tensors = []
    for name in (TIED_HEAD, EMBEDDING):
        with _opened(folder / stored[name]["file"]) as f:
            tensors.append(f.get_tensor(name))
    if tensors[0].shape != tensors[1].shape or not (tensors[0] == tensors[1]).all():
        raise HFFolderError(f"{folder / stored[TIED_HEAD]['file']}: {TIED_HEAD} differs from {EMBEDDING}, but "
                            "config.json ties them (tie_word_embeddings): the model would drop it; untie "
                            f"them in config.json or remove {TIED_HEAD}")  # fmt: skip


def check_finite(folder: Path) -> None:
    """HFFolderError naming the first tensor (and its file) that holds NaN or inf, reading every
    tensor once, large ones in row blocks of about CHUNK_BYTES."""
    for path in weight_files(folder):
        with _opened(path) as f:
            for name in f.keys():
                block = f.get_slice(name)
                shape = block.get_shape()
                row_bytes = math.prod(shape[1:]) * DTYPE_BYTES.get(block.get_dtype(), 8)
                step = max(1, CHUNK_BYTES // max(row_bytes, 1))
                rows = range(0, shape[0], step) if len(shape) > 1 else ()
                blocks = (block[i : i + step] for i in rows) if rows else [f.get_tensor(name)]
                if not all(_finite(b) for b in blocks):
                    raise HFFolderError(f"{path}: tensor {name} holds NaN or inf values: refused (training "
                                        "would start from a non-finite loss)")  # fmt: skip


def _finite(block: Any) -> bool:
    """Whether every value is finite: a sum is (NaN and inf propagate), 50x faster than isfinite
    on CPU; an overflowing sum of finite values is told apart by the exact check."""
    import torch

    return bool(torch.isfinite(block.sum())) or bool(torch.isfinite(block).all())


@contextmanager
def _opened(path: Path) -> Iterator[Any]:
    """safe_open(path), its errors as HFFolderError naming the file (checked headers make them rare)."""
    from safetensors import safe_open

    try:
        with safe_open(path, "pt") as f:
            yield f
    except HFFolderError:
        raise
    except Exception as e:  # safetensors raises its own SafetensorError, an Exception
        raise HFFolderError(f"{path} cannot be read by safetensors ({type(e).__name__}: {e})") from None


def _first(keys: list[str]) -> str:
    return ", ".join(keys[:2]) + (f" (and {len(keys) - 2} more)" if len(keys) > 2 else "")


def _shape(shape: Any) -> str:
    return f"[{', '.join(map(str, shape))}]"
