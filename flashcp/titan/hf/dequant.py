"""An MXFP4 gpt-oss folder written once as an unquantized one, which FlashCP imports.

    python -m flashcp.titan.hf.dequant openai-gpt-oss-20b gpt-oss-20b-bf16 [--dtype bfloat16] [--max-shard-size 5GB]

The released gpt-oss checkpoints store each layer's expert matrices in MXFP4: `<name>_blocks`
[E, out, in / 32, 16] uint8, two FP4 (e2m1) values a byte, low nibble first, and `<name>_scales`
[E, out, in / 32] uint8, one power of two (exponent + 127) per 32 values. The copy holds `<name>`
as transformers' `GptOssExperts` reads it, [E, in, out] (gate and up interleaved in gate_up_proj's
last dim, as stored), with the values transformers' own MXFP4 dequantization gives
(`transformers.integrations.mxfp4.convert_moe_packed_tensors`, tests/titan/test_gpt_oss_hf.py), every
other tensor cast to `--dtype`, config.json without its quantization_config, and the folder's other
top-level files (tokenizer, generation_config.json, chat template) copied.

Memory stays bounded: each output file is streamed tensor by tensor, an expert matrix one expert
at a time, other tensors in row blocks of about 64 MiB: one gpt-oss-120b expert's gate_up_proj
raises the peak by about 140 MiB (measured), under 1 GiB for the whole process, whatever the model. Disk: the copy is about 2 bytes a parameter (bf16): about 39 GiB for gpt-oss-20b and 218
GiB for gpt-oss-120b (the MXFP4 folders: 13 and 61 GiB). It is written into a temporary folder
renamed to DST at the end; DST must be absent or empty. Bad input: one `error:` line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from flashcp.titan.hf.config import HFConfigError, read_hf_json
from flashcp.titan.hf.export import (check_target, DTYPES, ExportError, parse_size, shard_groups, shard_names,
                                     staged_folder, write_index)
from flashcp.titan.hf.files import FolderFileError, member
from flashcp.titan.hf.folder import CONFIG, DTYPE_BYTES, FLOAT_DTYPES, HFFolderError, INDEX, read_header, weight_files

# FP4 e2m1: sign, 2 exponent bits, 1 mantissa bit, indexed by the nibble (transformers' FP4_VALUES).
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127
BLOCKS, SCALES = "_blocks", "_scales"
CHUNK_BYTES = 64 << 20
SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}


class DequantError(ValueError):
    """A folder that cannot be converted; one line naming the problem."""


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """MXFP4 [..., G, B] uint8 blocks with [..., G] uint8 scales -> [..., G * 2B] values in `dtype`:
    each byte's low nibble then its high one through the FP4 table, times 2**(scale - 127)."""
    table = torch.tensor(FP4_VALUES, dtype=dtype)
    pairs = torch.stack([table[(blocks & 0x0F).int()], table[(blocks >> 4).int()]], dim=-1)
    values = pairs.flatten(-2)
    torch.ldexp(values, scales.to(torch.int32)[..., None] - SCALE_BIAS, out=values)
    return values.flatten(-2)


@dataclass(frozen=True)
class _Tensor:
    """One tensor of the copy: its name, safetensors dtype and shape, and where it comes from."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path  # the source file holding it (an MXFP4 matrix: its blocks)
    source: str  # the source tensor (an MXFP4 matrix: `<name>_blocks`)
    scales: tuple[Path, str] | None = None  # an MXFP4 matrix's scales
    cast: bool = False  # a floating tensor, cast to the copy's dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]


def plan(folder: Path, dtype: torch.dtype) -> list[_Tensor]:
    """The copy's tensors, in the source's order; DequantError unless `folder` holds MXFP4 matrices,
    each with its scales."""
    headers = {path: read_header(path) for path in weight_files(folder)}
    where = {name: (path, entry) for path, header in headers.items() for name, entry in header.items()}
    out, target = [], SAFETENSORS_DTYPES[dtype]
    for path, header in headers.items():
        for name, entry in sorted(header.items(), key=lambda item: item[1]["data_offsets"]):
            if name.endswith(SCALES) and name.removesuffix(SCALES) + BLOCKS in where:
                continue
            if not name.endswith(BLOCKS):
                cast = entry["dtype"] in FLOAT_DTYPES
                out.append(_Tensor(name, target if cast else entry["dtype"], tuple(entry["shape"]), path, name, cast=cast))
                continue
            base = name.removesuffix(BLOCKS)
            scales = where.get(base + SCALES)
            shape = tuple(entry["shape"])
            if scales is None or len(shape) != 4 or tuple(scales[1]["shape"]) != shape[:-1] \
                    or entry["dtype"] != "U8" or scales[1]["dtype"] != "U8":  # fmt: skip
                raise DequantError(f"{path}: {name} {list(shape)} ({entry['dtype']}) has no matching {base + SCALES} "
                                   "(uint8, its shape without the last dim): not an MXFP4 matrix")  # fmt: skip
            experts, rows, groups, width = shape
            out.append(_Tensor(base, target, (experts, groups * width * 2, rows), path, name, (scales[0], base + SCALES)))
    if not any(t.scales for t in out):
        raise DequantError(f"{folder} holds no MXFP4 matrices (*{BLOCKS} with *{SCALES}): nothing to convert, "
                           "import it as it is")  # fmt: skip
    return out


def _chunks(tensor: _Tensor, dtype: torch.dtype) -> Iterator[torch.Tensor]:
    """The tensor's values in storage order, a bounded piece at a time (see the module docstring)."""
    with safe_open(tensor.file, "pt") as f:
        source = f.get_slice(tensor.source)
        if tensor.scales is None:
            shape = source.get_shape()
            rows = max(1, CHUNK_BYTES * max(1, shape[0]) // max(1, tensor.nbytes)) if shape else 1
            pieces = (source[i : i + rows] for i in range(0, shape[0], rows)) if shape else [f.get_tensor(tensor.source)]
            for piece in pieces:
                yield piece.to(dtype) if tensor.cast else piece
            return
        with safe_open(tensor.scales[0], "pt") as g:
            scales = g.get_slice(tensor.scales[1])
            for expert in range(tensor.shape[0]):  # [out, in] dequantized, written as [in, out]
                yield dequantize(source[expert], scales[expert], dtype).t().contiguous()


def _write_file(path: Path, tensors: list[_Tensor], dtype: torch.dtype) -> None:
    """One safetensors file, its header first, then each tensor's bytes streamed."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors aligns the data to 8 bytes
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for t in tensors:
            written = 0
            for chunk in _chunks(t, dtype):
                data = chunk.contiguous().reshape(-1).view(torch.uint8).numpy()
                f.write(data)
                written += data.nbytes
            if written != t.nbytes:
                raise DequantError(f"{t.source}: wrote {written} bytes, its shape needs {t.nbytes}")
        f.flush()
        os.fsync(f.fileno())


def convert(src: Path, dst: Path, dtype: str = "bfloat16", max_shard_bytes: int = 5 * 10**9) -> list[Path]:
    """Write the MXFP4 folder `src` as the unquantized folder `dst` (see the module docstring); the
    files written. DequantError / ExportError / HFFolderError / HFConfigError name what is wrong."""
    src, dst, torch_dtype = Path(src), Path(dst), DTYPES[dtype]
    check_target(dst)
    _, config = read_hf_json(src)
    tensors = plan(src, torch_dtype)
    side = [p.name for p in sorted(src.iterdir()) if p.name not in (CONFIG, INDEX) and p.suffix != ".safetensors"
            and not p.is_dir()]  # fmt: skip
    for name in side:
        member(src, name)  # a regular file inside the folder, before anything is written
    config = {k: v for k, v in config.items() if k != "quantization_config"} | {"torch_dtype": dtype, "dtype": dtype}
    groups = shard_groups([t.nbytes for t in tensors], max_shard_bytes)
    with staged_folder(dst) as partial:
        files = shard_names(len(groups))
        for file, group in zip(files, groups):
            _write_file(partial / file, [tensors[i] for i in group], torch_dtype)
        write_index(partial, files, [[tensors[i].name for i in group] for group in groups], sum(t.nbytes for t in tensors))
        (partial / CONFIG).write_text(json.dumps(config, indent=2))
        for name in side:
            shutil.copyfile(member(src, name), partial / name)
    return sorted(dst.iterdir())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("src", type=Path, help="the MXFP4 folder (e.g. openai/gpt-oss-20b downloaded)")
    parser.add_argument("dst", type=Path, help="the unquantized folder to write (absent or empty)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16", help="the copy's dtype (default bfloat16)")
    parser.add_argument("--max-shard-size", default="5GB", help="one safetensors file up to this size (default 5GB)")
    args = parser.parse_args(argv)
    try:
        files = convert(args.src, args.dst, args.dtype, parse_size(args.max_shard_size))
    except (DequantError, ExportError, HFFolderError, HFConfigError, FolderFileError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: cannot write {args.dst}: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.dst} (unquantized, {args.dtype}): {', '.join(p.name for p in files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
