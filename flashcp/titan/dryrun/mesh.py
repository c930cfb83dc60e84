"""The dry run of a `[flashcp] scope = "mesh"` job: one rank measured, sized for the mesh's busiest.

In mesh scope the window is the step's global batch (DP x C tokens), planned by `plan_mesh` over all
DP x CP ranks on the trainer's node layout (`flashcp.titan.mesh_scope`). Every rank holds C / CP tokens,
but the K/V rows each one receives differ severalfold: a rank holding later pieces of documents cut
over ranks receives their prefixes. So the measured rank is the busiest: the rank receiving the most
needed rows (`busiest_rank`; the lowest such rank on a tie), dispatched and stepped as that rank of the
mesh's group, and its FlashCP buffers are the mesh-wide worst case (`compact`'s all-gather pads every
rank to the same rows: the busiest by needed rows is measured there too). As in per-group scope the
window is the stream's first, not the worst of several. Nothing here is sized by the window times the
layers: the per-rank rows are the plan's, pure Python over its pieces (`node_traffic`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from flashcp.attention.collectives import TorchCollectives
from flashcp.plan.nodes import node_traffic
from flashcp.plan.plan import Plan


def busiest_rank(plan: Plan) -> int:
    """The mesh rank receiving the most K/V rows a layer (the needed rows; the lowest rank on a tie)."""
    needed = plan.needed_tokens()
    return needed.index(max(needed))


class _AsRank(TorchCollectives):
    """The mesh's process group with this process as mesh rank `rank` (the fake backend's collectives
    take their shapes from the dispatch, so one process can stand for any rank)."""

    def __init__(self, group: Any, rank: int) -> None:
        super().__init__(group)
        self._rank = rank

    def rank(self) -> int:
        return self._rank


def as_busiest(trainer: Any) -> list[Plan]:
    """Make the loader dispatch each window as its plan's busiest rank, and the trainer step as that rank;
    the plans it dispatched, in order."""
    group, plans = trainer.cp_group, []

    def dispatch(plan: Plan) -> Any:
        plans.append(plan)
        rank = busiest_rank(plan)
        trainer.cp_rank, trainer.cp_group = rank, _AsRank(group, rank)
        trainer.mesh = dataclasses.replace(trainer.mesh, rank=rank)
        return trainer.window_dispatcher()(plan)

    trainer.dataloader.loader.dispatch_with(dispatch, finish=trainer.pin_dispatch)
    return plans


def mesh_figures(plan: Plan, row_bytes: int) -> dict[str, Any]:
    """The mesh window's K/V received per layer by rank (needed rows), the busiest and the mean, and the
    share of those rows crossing nodes (the flat needed exchange's fabric rows over all its rows)."""
    g = plan.info["ranks_per_node"]
    needed, rank = plan.needed_tokens(), busiest_rank(plan)
    fabric = node_traffic(plan, g).flat_inter_recv
    return {
        "ranks": plan.cp_size, "ranks_per_node": g, "nodes": plan.cp_size // g, "window_tokens": plan.context,
        "busiest_rank": rank, "kv_row_bytes": row_bytes,
        "kv_recv_rows_per_rank": needed, "kv_recv_rows_busiest": needed[rank],
        "kv_recv_rows_mean": sum(needed) / len(needed),
        "kv_fabric_rows_per_rank": fabric,
        "kv_fabric_share": sum(fabric) / sum(needed) if sum(needed) else 0.0,
        "node_cut_docs": len(plan.info["node_cut"]),
    }  # fmt: skip
