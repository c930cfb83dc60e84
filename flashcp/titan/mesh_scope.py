"""`[flashcp] scope = "mesh"`: the step's global batch planned over all DP x CP ranks as one FlashCP group.

Per-group scope leaves each DP group its own window of C tokens, so a step waits for the group whose
window holds the most attention work. In mesh scope every rank's loader yields the same window of
DP x C tokens (the stream's next DP windows as one, documents cut only at its end;
`WindowLoader.mesh_with`), planned by `plan_mesh` over the mesh's nodes and ranks in the loader's
thread or plan worker; the FlashCP group is TorchTitan's flattened "loss" mesh (dp_replicate x dp_shard
x cp), whose rank m = dp group x CP + CP rank lies on global rank m x TP + t: node-major, as `plan_mesh`
numbers its ranks, since torchrun numbers ranks node by node. FSDP, TP and EP keep their meshes.

Loss: TorchTitan counts the valid labels each rank yields and sums them over DP only. The loader hands
each rank its own tokens and labels in dispatch order (read alone from a token store: `StepPieces.take`)
and each DP group's count of valid labels (`valid_labels`, from the lengths), so a rank yields a stand-in
of its DP group's C labels with that count for TorchTitan (the global batch's valid tokens, once) and its
own labels in the input dict (`rank_inputs`): each rank's loss is its tokens' sum over the global count,
as in per-group scope. Only C / CP of the window's DP x C tokens reach the device.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.distributed import ParallelDims

from flashcp.data.packing import IGNORE_INDEX
from flashcp.plan.mesh import plan_mesh

RANK_LABELS = "rank_labels"  # the input dict's key for this rank's labels, in dispatch order


@dataclass(frozen=True)
class MeshScope:
    """This rank's place in the mesh-wide FlashCP group."""

    dp: int  # data-parallel groups (dp_replicate x dp_shard)
    cp: int
    rank: int  # in the loss mesh: dp group x cp + CP rank
    group: Any  # its process group (None on one rank)
    groups: list[list[int]]  # every loss-mesh group's global ranks (one per PP and TP rank), in mesh-rank order

    @classmethod
    def of(cls, dims: ParallelDims) -> MeshScope:
        mesh = dims.get_optional_mesh("loss")
        rank, group = (mesh.get_local_rank(), mesh.get_group()) if mesh is not None else (0, None)
        dp, cp, tp = dims.dp_replicate * dims.dp_shard, dims.cp, dims.tp
        groups = [[(p * dp * cp + m) * tp + t for m in range(dp * cp)] for p in range(dims.pp) for t in range(tp)]
        return cls(dp, cp, rank, group, groups)

    @property
    def ranks(self) -> int:
        return self.dp * self.cp

    def planner(self, ranks_per_node: int, target_imbalance: float) -> functools.partial:
        """The loader's planner of a DP x C window over the mesh (picklable, for the plan worker)."""
        return functools.partial(plan_mesh, dp=self.dp, cp=self.cp, ranks_per_node=ranks_per_node,
                                 target_imbalance=target_imbalance)  # fmt: skip

    def rank_inputs(self, input_dict: dict[str, Any], labels: torch.Tensor, valid_labels: list[int],
                    tokens: int) -> tuple[dict[str, Any], torch.Tensor]:  # fmt: skip
        """This rank's labels (the loader's, in dispatch order, beside its tokens) in the input dict, and what
        TorchTitan counts: C = `tokens` / DP labels of which this DP group's `valid_labels` are not -100 (it
        reads only their number and that count)."""
        counted = torch.full((1, tokens // self.dp), IGNORE_INDEX, dtype=labels.dtype)
        counted[:, : valid_labels[self.rank // self.cp]] = 0
        return {**input_dict, RANK_LABELS: labels}, counted


def attach(trainer: Any, ranks_per_node: int) -> None:
    """Make `trainer`'s loader yield mesh windows planned by `plan_mesh` on nodes of `ranks_per_node`
    mesh ranks, and its metrics count one window's attention over all DP groups."""
    mesh, settings = trainer.mesh, trainer.flashcp
    trainer.dataloader.loader.mesh_with(mesh.dp, mesh.planner(ranks_per_node, settings.target_imbalance))
    trainer.metrics_processor.mesh_groups = mesh.dp
