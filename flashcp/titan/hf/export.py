"""A FlashCP checkpoint written out as a Hugging Face model folder, whole or not at all.

    export(Path("out/checkpoint/step-100"), Path("hf-model"), dtype="bfloat16", max_shard_bytes=5 * 10**9)

What the checkpoint holds is read from its manifest: every save records the model
(`model_record`: the HF `config.json` of the architecture trained, with the RoPE settings and
context actually used, the job's tokenizer file and the HF folder the job started from, if any),
so no job file is needed and a published `step-N` folder copied elsewhere still exports; an
unfinished save (`step-N.partial-*`) is refused even when it holds a manifest. The checkpoint is
verified against its manifest like every load, read as data only (`flashcp.run.safe_load`) and
strictly (the model's keys and shapes exactly), converted by the model's
state_dict_adapter (`flashcp.titan.hf.adapters`), and written as `model.safetensors` (or shards with
`model.safetensors.index.json` above `max_shard_bytes`), `config.json`, `generation_config.json`
and the tokenizer's files, into a fresh folder beside the target that is renamed into place at
the end: a crash leaves no half export under the target's name.

Side files (`flashcp.titan.hf.sidefiles`): every tokenizer-side file of the HF folder the job
started from, then the job's own tokenizer file and its companions over them (what trained), each
a regular file inside its folder, of bounded size; `generation_config.json` keeps the source's
(sampling defaults, extra EOS ids; checked) with the job tokenizer's BOS / EOS first; one is
written when the source had none. They are read before the weights: a bad one costs nothing.

The target must be absent or an empty, writable folder, not a symbolic link; anything else is
refused before the checkpoint is read, and nothing that exists is changed. The whole model is
held in host memory once, in the checkpoint's dtype.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import stat
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.api as dcp_api
from safetensors.torch import save_file
from torchtitan.components.checkpoint import DATALOADER, LR_SCHEDULER, OPTIMIZER, TRAIN_STATE

from flashcp.data.tokenizer import load_tokenizer, TokenizerError
from flashcp.run.manifest import MANIFEST, read_manifest, verify_files
from flashcp.run.publish import error_in, fsync_dir, LEFTOVER_DIR, root_cause, STEP_DIR
from flashcp.run.safe_load import MismatchedCheckpoint, SafeReader, StrictPlanner, UnsafeCheckpoint
from flashcp.titan.models.decoders import job_architecture, state_dict_adapter, titan_config
from flashcp.titan.hf.config import architecture_from_hf, HFConfigError, to_hf_config
from flashcp.titan.hf.files import FolderFileError
from flashcp.titan.hf.folder import CONFIG, INDEX, SINGLE
from flashcp.titan.hf.sidefiles import GENERATION, generation_config, side_files

NON_MODEL_STATES = (OPTIMIZER, LR_SCHEDULER, DATALOADER, TRAIN_STATE)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KIB|MIB|GIB|TIB)?", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip


logger = logging.getLogger(__name__)


class ExportError(ValueError):
    """A checkpoint that cannot be exported, or a target that must not be written; one line."""


def model_record(hf_config: dict[str, Any], tokenizer: str | Path | None,
                 hf_folder: str | Path | None = None) -> dict[str, Any]:  # fmt: skip
    """What a checkpoint's manifest says about its model: the HF config.json of the architecture
    trained, the job's tokenizer file and the HF folder it started from (absolute), for the export."""
    def absolute(path: str | Path | None) -> str | None:
        return str(Path(path).resolve()) if path else None

    return {"hf_config": hf_config, "tokenizer": absolute(tokenizer), "hf_folder": absolute(hf_folder)}


def job_model_record(cfg: dict[str, Any], tokenizer_vocab: int,
                     tokenizer: str | Path | None) -> dict[str, Any]:  # fmt: skip
    """The record of a validated job's model: its architecture as trained (RoPE, context) over the
    config.json it came from, if any, so that the base model's other entries (token ids, ...) carry over."""
    arch = job_architecture(cfg["model"], tokenizer_vocab, cfg["training"]["seq_len"])
    ckpt = cfg["checkpoint"]
    imported = ckpt["initial_load_path"] if ckpt["initial_load_in_hf"] else None
    source = cfg["model"].get("hf_config") or imported
    base = None
    if source:
        path = Path(source)
        base = json.loads(((path / CONFIG) if path.is_dir() else path).read_text())
    try:
        hf_config = to_hf_config(arch, torch_dtype=cfg["training"]["dtype"], base=base)
    except HFConfigError as e:  # a model no HF class holds (DeepSeek-V3 with a softmax router): trains, no export
        return model_record(None, tokenizer, imported) | {"no_hf_class": str(e)}
    return model_record(hf_config, tokenizer, imported)


def parse_size(text: str) -> int:
    """Bytes in "5GB" (10**9, as transformers counts), "500MiB", "1000"."""
    match = _SIZE.fullmatch(text.strip())
    if not match or float(match.group(1)) <= 0:
        raise ExportError(f"--max-shard-size {text!r}: expected a positive size such as 5GB, 500MB or 2GiB")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "b").lower()])


def check_target(out: Path) -> None:
    """ExportError unless `out` is absent or an empty folder, not a symbolic link, in a writable
    folder (a complete export, or anything else that exists, is never overwritten)."""
    problem = None
    if out.is_symlink():
        problem = "is a symbolic link" + ("" if out.exists() else " to nothing")
    elif out.exists() and not out.is_dir():
        problem = "exists and is not a folder"
    elif out.is_dir() and any(out.iterdir()):
        problem = "is not empty"
    if problem:
        raise ExportError(f"{out} {problem}: refusing to write there; choose another output folder")
    parent = next(p for p in out.absolute().parents if p.exists() or p.is_symlink())
    if not parent.is_dir():
        raise ExportError(f"{out}: {parent} is not a folder")
    for folder in (parent, out) if out.is_dir() else (parent,):
        if not os.access(folder, os.W_OK | os.X_OK):
            raise ExportError(f"{out}: {folder} is not writable")


def export(checkpoint: Path, out: Path, dtype: str | None = None,
           max_shard_bytes: int = 5 * 10**9) -> list[Path]:  # fmt: skip
    """Write `checkpoint` as an HF model folder `out`; the files written (see the module docstring)."""
    checkpoint, out = Path(checkpoint), Path(out)
    check_target(out)
    record = verified_record(checkpoint)
    tokenizer, source = record["tokenizer"], record["hf_folder"]
    try:
        side = side_files(tokenizer, source)
    except FolderFileError as e:
        raise ExportError(str(e)) from e
    try:
        arch = architecture_from_hf(record["hf_config"], where=f"{checkpoint / MANIFEST} (model.hf_config)")
    except HFConfigError as e:
        raise ExportError(str(e)) from e
    model_config = titan_config(arch, attn_backend="flex", max_seq_len=arch.max_position_embeddings)
    weights = read_weights(checkpoint, model_config)
    hf_weights = state_dict_adapter(model_config).to_hf(weights)
    target = DTYPES[dtype] if dtype else next(iter(weights.values())).dtype
    hf_weights = {k: v.to(target).contiguous() for k, v in hf_weights.items()}
    hf_config = dict(record["hf_config"]) | {"torch_dtype": _dtype_name(target), "dtype": _dtype_name(target)}
    hf_config |= token_ids(tokenizer)
    side[GENERATION] = generation_config(side.get(GENERATION), hf_config)
    return write_folder(out, hf_weights, hf_config, side, max_shard_bytes)


def verified_manifest(checkpoint: Path, unverified: bool = False) -> dict[str, Any]:
    """The manifest of a published checkpoint folder (step-N) whose files match it, read in this
    process alone; ExportError naming the first problem. `unverified` (the job's
    `checkpoint.load_unverified`) lets a folder without a manifest pass, as {}."""
    if not checkpoint.is_dir():
        state = "is not a folder" if checkpoint.exists() else "does not exist"
        raise ExportError(f"{checkpoint}: {state}")
    name = checkpoint.resolve().name
    if LEFTOVER_DIR.fullmatch(name) and ".partial-" in name:
        raise ExportError(f"{checkpoint} is an unfinished save (never published): use a published step-N folder")
    if not STEP_DIR.fullmatch(name):
        raise ExportError(f"{checkpoint} is not a published checkpoint folder (step-N, as the run names them)")
    if not (checkpoint / ".metadata").is_file():
        raise ExportError(f"{checkpoint} is not a complete FlashCP checkpoint (no .metadata)")
    if not (checkpoint / MANIFEST).is_file():
        if unverified:
            return {}
        raise ExportError(f"{checkpoint} is not a complete FlashCP checkpoint (no {MANIFEST})")
    manifest = read_manifest(checkpoint)  # a malformed one carries its `problem`, reported here
    problems = verify_files(checkpoint, manifest, 0, 1)
    if problems:
        raise ExportError(f"checkpoint {checkpoint} is damaged: {problems[0]}")
    return manifest


def verified_record(checkpoint: Path) -> dict[str, Any]:
    """The checkpoint's model record, once its files match its manifest."""
    manifest = verified_manifest(checkpoint)
    record = manifest.get("model")
    if isinstance(record, dict) and isinstance(record.get("no_hf_class"), str):
        raise ExportError(f"{checkpoint}: {record['no_hf_class']}")
    if not isinstance(record, dict) or not isinstance(record.get("hf_config"), dict):
        raise ExportError(f"{checkpoint / MANIFEST} does not record the model (saved before FlashCP "
                          "recorded it): resume the run for one step to save a checkpoint that does")
    paths = {key: record.get(key) for key in ("tokenizer", "hf_folder")}
    wrong = next((key for key, value in paths.items() if not isinstance(value, (str, type(None)))), None)
    if wrong:
        raise ExportError(f"{checkpoint / MANIFEST}: model.{wrong} = {paths[wrong]!r} is not a path")
    return record | paths


def read_weights(checkpoint: Path, model_config: Any) -> dict[str, torch.Tensor]:
    """The model's weights from a DCP checkpoint into plain host tensors of the stored dtype, strictly:
    exactly the model's keys and shapes (optimizer, schedule, loader and step states are skipped)."""
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in model_config.build().state_dict().items()}
    try:
        stored = SafeReader(checkpoint).read_metadata().state_dict_metadata
        weights = {k: torch.empty(shape, dtype=stored[k].properties.dtype if k in stored else torch.float32)
                   for k, shape in shapes.items()}  # fmt: skip
        # no_dist: read in this process alone, also on rank 0 of a finished run (last_save_in_hf)
        dcp.load(weights, storage_reader=SafeReader(checkpoint),
                 planner=StrictPlanner(checkpoint, NON_MODEL_STATES), no_dist=True)  # fmt: skip
    except (Exception, dcp_api.CheckpointException) as e:  # the latter is a BaseException
        for kind in (UnsafeCheckpoint, MismatchedCheckpoint):
            if error_in(e, kind) is not None:
                raise ExportError(str(error_in(e, kind))) from e
        raise ExportError(f"checkpoint {checkpoint} cannot be read (damaged?): {root_cause(e)}") from e
    return weights


def write_folder(out: Path, weights: dict[str, torch.Tensor], hf_config: dict[str, Any],
                 side: dict[str, bytes], max_shard_bytes: int) -> list[Path]:  # fmt: skip
    """Safetensors shards, index, config.json and the `side` files ({name: content}) into a
    temporary folder renamed to `out`; ExportError naming the path when the disk refuses."""
    check_target(out)
    try:
        return _write_folder(out, weights, hf_config, side, max_shard_bytes)
    except OSError as e:
        raise ExportError(f"cannot write {out}: {root_cause(e)}") from e


def _write_folder(out: Path, weights: dict[str, torch.Tensor], hf_config: dict[str, Any],
                  side: dict[str, bytes], max_shard_bytes: int) -> list[Path]:  # fmt: skip
    names = list(weights)
    groups = shard_groups([t.numel() * t.element_size() for t in weights.values()], max_shard_bytes)
    with staged_folder(out) as partial:
        files = shard_names(len(groups))
        for file, group in zip(files, groups):
            save_file({names[i]: weights[names[i]] for i in group}, partial / file, metadata={"format": "pt"})
        write_index(partial, files, [[names[i] for i in group] for group in groups],
                    sum(t.numel() * t.element_size() for t in weights.values()))  # fmt: skip
        (partial / CONFIG).write_text(json.dumps(hf_config, indent=2))
        for name, content in side.items():
            (partial / name).write_bytes(content)
    return sorted(out.iterdir())


def shard_groups(sizes: list[int], max_bytes: int) -> list[list[int]]:
    """Indices of `sizes` in order, a new shard whenever the next would pass `max_bytes` (a larger one alone)."""
    groups: list[list[int]] = [[]]
    size = 0
    for i, nbytes in enumerate(sizes):
        if groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += nbytes
    return groups


def shard_names(count: int) -> list[str]:
    """HF's file names for `count` safetensors shards."""
    return [SINGLE] if count == 1 else [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def write_index(folder: Path, files: list[str], keys: list[list[str]], total_bytes: int) -> None:
    """`model.safetensors.index.json` (which file holds each key) when there is more than one file."""
    if len(files) > 1:
        weight_map = {key: file for file, group in zip(files, keys) for key in group}
        index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
        (folder / INDEX).write_text(json.dumps(index, indent=2))


@contextmanager
def staged_folder(out: Path) -> Iterator[Path]:
    """A fresh folder beside `out` to write into, renamed to `out` when the block ends without error
    (its files synced, with the umask's mode: safetensors writes 0600), removed when it raises; `out`
    is checked again just before the rename, so nothing that appeared meanwhile is replaced."""
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.partial-{uuid.uuid4().hex[:12]}")
    partial.mkdir()
    try:
        yield partial
        probe = partial / f".mode-{uuid.uuid4().hex[:8]}"
        probe.touch()
        mode = stat.S_IMODE(probe.stat().st_mode)  # a new file's (the umask's)
        probe.unlink()
        for path in partial.iterdir():
            path.chmod(mode)
            with open(path, "rb") as f:
                os.fsync(f.fileno())
        check_target(out)
        if out.exists():
            out.rmdir()
        os.rename(partial, out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def token_ids(tokenizer: str | None) -> dict[str, int]:
    """The BOS / EOS ids the job's tokenizer gave its documents ({} when it cannot be read)."""
    if not tokenizer or not Path(tokenizer).is_file():
        return {}
    try:
        tok = load_tokenizer(tokenizer)
    except TokenizerError as e:
        logger.warning(f"{e}: the BOS / EOS ids of config.json are kept")
        return {}
    ids = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id}
    return {key: value for key, value in ids.items() if value is not None}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
