"""Reading a DCP checkpoint back as data only, and only into a state that it fits whole.

DCP reads its `.metadata` with `pickle.load` and every non-tensor item (the data loader's state,
the optimizer's hyper-parameters) with `torch.load(weights_only=False)`: a crafted checkpoint runs
any code it likes on every rank that loads it, whatever its manifest says (a manifest detects
damage, not tampering). Here:

- `.metadata` goes through an unpickler that builds only the classes DCP writes there (its metadata
  dataclasses, `torch.Size`, dtypes, layouts, a path); anything else is refused before it is built.
- Non-tensor items load with `torch.load(weights_only=True)` (plain containers, numbers, strings,
  tensors), tensors already do.
- The plan is strict both ways: every key of the state to load must be in the checkpoint with the
  same shape, and every checkpoint key must be loaded, unless it belongs to a state the caller drops
  on purpose (the optimizer of a model-only load). DCP alone ignores extra checkpoint keys, so a
  2-layer checkpoint loaded into a 1-layer model dropped a layer without a word. Keys are global
  (FQNs and global shapes), so loading into another sharding layout still works. A Hugging Face
  MoE folder is the exception: TorchTitan's adapter names only the experts a rank holds, so the
  caller passes the keys other ranks load (`elsewhere`), checked whole beforehand.

`UnsafeCheckpoint` and `MismatchedCheckpoint` say what was refused in one line.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem

# What DCP's FileSystemWriter pickles into `.metadata` (torch 2.13), by module.
_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}  # fmt: skip


class UnsafeCheckpoint(pickle.UnpicklingError):
    """A checkpoint file asks to build something that is not checkpoint data; nothing was built."""


class MismatchedCheckpoint(ValueError):
    """A checkpoint whose keys or shapes do not match the state it is loaded into."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, name: str):
        super().__init__(file)
        self._name = name

    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_CLASSES.get(module, ()) or (module == "torch" and _is_dtype(name)):
            return super().find_class(module, name)
        raise UnsafeCheckpoint(f"{self._name} asks to build {module}.{name}, which DCP never writes there: "
                               "refused, nothing of it was run")  # fmt: skip


def _is_dtype(name: str) -> bool:
    return isinstance(getattr(torch, name, None), torch.dtype)


class SafeReader(FileSystemReader):
    """A FileSystemReader whose `.metadata` is unpickled with only DCP's own classes allowed.

    DCP folds a failed metadata read into the text of an AssertionError; `refused` keeps the refusal
    itself so that the caller can raise it as what it is.
    """

    refused: UnsafeCheckpoint | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        try:
            with self.fs.create_stream(path, "rb") as f:
                metadata = _MetadataUnpickler(f, str(path)).load()
            if not isinstance(metadata, Metadata):
                raise UnsafeCheckpoint(f"{path} holds {type(metadata).__name__}, not DCP metadata: refused")
        except UnsafeCheckpoint as e:
            self.refused = e
            raise
        return self._finish_metadata(metadata)

    def _finish_metadata(self, metadata: Metadata) -> Metadata:
        """What FileSystemReader.read_metadata does after unpickling (a load id for this load)."""
        from torch.distributed.checkpoint.metadata import StorageMeta

        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class StrictPlanner(DefaultLoadPlanner):
    """DCP's load planner, strict in both directions and loading non-tensor items as plain data.

    `dropped`: names of top-level states (e.g. "optimizer") whose checkpoint keys are left unused on
    purpose; `elsewhere`: whole keys that other ranks load and this one does not; `across_ranks`: the
    keys any other rank holds are also its to load (pipeline stages each hold their own layers), so
    only a key no rank holds is refused (a collective: every rank plans with it).
    """

    def __init__(self, checkpoint: Path, dropped: Iterable[str] = (), elsewhere: Iterable[str] = (),
                 across_ranks: bool = False):  # fmt: skip
        super().__init__(allow_partial_load=False)
        self._checkpoint = checkpoint
        self._dropped = tuple(f"{name}." for name in dropped)
        self._elsewhere = frozenset(elsewhere)
        self._across_ranks = across_ranks

    def create_local_plan(self) -> Any:
        elsewhere = self._elsewhere
        if self._across_ranks and dist.is_initialized() and dist.get_world_size() > 1:
            held: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(held, sorted(self.state_dict))
            elsewhere = elsewhere | (set().union(*held) - self.state_dict.keys())
        check_fits(self.state_dict, self.metadata, self._dropped, self._checkpoint, elsewhere)
        return super().create_local_plan()

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            first = str(e).strip().splitlines()
            hint = next((line.strip() for line in first if "GLOBAL" in line or "Unsupported" in line), "")
            raise UnsafeCheckpoint(f"checkpoint {self._checkpoint}: item {read_item.dest_index.fqn} is not plain data "
                                   f"({hint or type(e).__name__}): refused, nothing of it was run") from None  # fmt: skip
        if self.flatten_state_dict:  # as DefaultLoadPlanner.load_bytes, which unpickles with weights_only=False
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def _shape(value: Any) -> str:
    return f"[{', '.join(map(str, value.size))}]" if isinstance(value, TensorStorageMetadata) else "(value)"


def check_fits(state: dict[str, Any], metadata: Metadata, dropped: tuple[str, ...], checkpoint: Path,
               elsewhere: frozenset[str] = frozenset()) -> None:  # fmt: skip
    """MismatchedCheckpoint naming the first keys (and shapes) that do not match, in one line."""
    stored = metadata.state_dict_metadata
    missing = [k for k in state if k not in stored]
    unused = [k for k in stored if k not in state and k not in elsewhere and not k.startswith(dropped)]
    reshaped = [k for k, v in state.items() if isinstance(v, torch.Tensor) and isinstance(stored.get(k), TensorStorageMetadata)
                and tuple(v.shape) != tuple(stored[k].size)]  # fmt: skip
    problems = []
    if missing:
        problems.append(f"this job needs {_listing(missing, state, None)} which the checkpoint lacks")
    if unused:
        problems.append(f"the checkpoint holds {_listing(unused, None, stored)} which this job has no place for")
    if reshaped:
        k = reshaped[0]
        problems.append(f"{k} is {_shape(stored[k])} in the checkpoint, [{', '.join(map(str, state[k].shape))}] here"
                        + (f" (and {len(reshaped) - 1} more)" if len(reshaped) > 1 else ""))  # fmt: skip
    if problems:
        raise MismatchedCheckpoint(f"checkpoint {checkpoint} does not fit this job (another model size, optimizer "
                                   f"or data loader?): {'; '.join(problems)}")  # fmt: skip


def _listing(keys: list[str], state: dict[str, Any] | None, stored: dict[str, Any] | None) -> str:
    def one(k: str) -> str:
        if stored is not None:
            return f"{k} {_shape(stored[k])}"
        v = state[k]
        return f"{k} [{', '.join(map(str, v.shape))}]" if isinstance(v, torch.Tensor) else k

    more = f" (and {len(keys) - 2} more)" if len(keys) > 2 else ""
    return ", ".join(one(k) for k in keys[:2]) + more
