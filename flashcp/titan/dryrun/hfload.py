"""A job importing a Hugging Face folder: plan rank 0's load as the checkpointer does, without bytes.

The import's failures depend on the layout: TorchTitan's adapter names only the experts a rank
holds, and DCP's plan reads each rank's shards of the others. So the dry run, holding rank 0 of W
ranks with its real sharding (fake tensors), maps the model to HF keys and creates the strict load
plan (`flashcp.run.safe_load.StrictPlanner`, its `elsewhere` the other ranks' keys) against the
folder's safetensors headers, or, where the folder is absent, against the headers the job's model
implies (said in the report's line). A plan that cannot be made is one ConfigError line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata, Metadata, TensorProperties, TensorStorageMetadata,
)  # fmt: skip
from torchtitan.components.checkpointer.base import ModelWrapper

from flashcp.run.safe_load import MismatchedCheckpoint, StrictPlanner
from flashcp.titan.components.checkpoint import hf_shapes
from flashcp.titan.config import ConfigError
from flashcp.titan.hf.folder import check_weights, HFFolderError


def plan_hf_import(trainer: Any, folder: str) -> str:
    """Rank 0's strict load plan of the HF folder; one line saying what it reads, or ConfigError."""
    spec = trainer.config.model_spec
    if spec.state_dict_adapter is None:
        raise ConfigError("[checkpoint] initial_load_in_hf: this model has no Hugging Face state_dict adapter")
    adapter = spec.state_dict_adapter(trainer.model_config, None)
    state = ModelWrapper(trainer.model_parts).state_dict()
    whole = hf_shapes(adapter, state)
    path = Path(folder)
    try:
        if path.is_dir():
            unread = check_weights(path, whole)
            metadata, source = adapter.get_hf_storage_reader(str(path)).read_metadata(), str(path)
        else:
            unread, metadata = (), _implied(whole)
            source = f"the headers the job's model implies ({path} is absent here)"
    except HFFolderError as e:
        raise ConfigError(f"[checkpoint] initial_load_path: {e}") from None
    local = adapter.to_hf(state)
    planner = StrictPlanner(path, unread, whole.keys() - local.keys())
    planner.set_up_planner(local, metadata, is_coordinator=True)
    try:
        reads = len(planner.create_local_plan().items)
    except MismatchedCheckpoint as e:
        raise ConfigError(f"[checkpoint] initial_load_path, as rank 0 of {trainer.parallel_dims.world_size} "
                          f"loads it: {e}") from None  # fmt: skip
    return (f"rank 0 of {trainer.parallel_dims.world_size} loads {len(local)} of the {len(whole)} HF tensors "
            f"({reads} reads; the rest are other ranks' experts) from {source}")  # fmt: skip


def _implied(shapes: dict[str, tuple[int, ...]]) -> Metadata:
    """DCP metadata of a folder holding exactly `shapes`, one whole chunk a tensor, as the HF reader makes it."""
    whole = {key: ChunkStorageMetadata(torch.Size((0,) * len(shape)), torch.Size(shape)) for key, shape in shapes.items()}
    return Metadata(state_dict_metadata={key: TensorStorageMetadata(TensorProperties(), chunk.sizes, [chunk])
                                         for key, chunk in whole.items()})  # fmt: skip
