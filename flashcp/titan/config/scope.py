"""`[flashcp] scope = "mesh"`: what one plan over the whole DP x CP mesh does not run, refused before launch.

The mesh scope (`flashcp.titan.mesh_scope`) plans the step's global batch with `plan_mesh`, FlashCP's
planner over nodes and ranks: it exchanges the rows other ranks need (compact, needed or two_level),
never the full all-gather over the mesh nor a ring around it; the plan is already the balance across
DP groups, so the loader's step balancing is off; and the held-out loaders (validation, the probe), the
pipeline schedule and the window / Gated DeltaNet dispatches still plan per CP group.
"""

from __future__ import annotations

from flashcp.titan.config.keys import ConfigError


def check_mesh_scope(cfg: dict) -> None:
    """One line for the first setting the mesh scope does not run (a validated job's sections)."""
    fcp, data, model = cfg["flashcp"], cfg["data"], cfg["model"]
    if fcp["scope"] != "mesh":
        return
    refused = [
        (model["attention"] != "flashcp", f"[model] attention = {model['attention']!r} (the mesh scope is "
                                          "FlashCP's plan; set attention = 'flashcp')"),
        (fcp["strategy"] != "flashcp", f"[flashcp] strategy = {fcp['strategy']!r} (the mesh is planned by FlashCP's "
                                       "planner over nodes and ranks, flashcp.plan.mesh)"),
        (fcp["comm"] == "full", "[flashcp] comm = 'full' (the full all-gather over the whole mesh; use 'needed', "
                                "'two_level' or 'compact')"),
        (fcp["comm"] == "ring", "[flashcp] comm = 'ring' (a ring around the whole mesh; use 'needed' or "
                                "'two_level')"),
        (data["balance"] != "off", f"[data] balance = {data['balance']!r} (the mesh-wide plan is the balance across "
                                   "DP groups; set balance = 'off')"),
        (cfg["parallelism"]["pipeline_parallel_degree"] > 1, "[parallelism] pipeline_parallel_degree > 1 (the "
                                                             "pipeline's microbatches are planned per CP group)"),
        (cfg["validation"]["enable"], "[validation] enable = true (held-out windows are planned per CP group)"),
        (cfg["probe"]["enable"], "[probe] enable = true (probe prompts are planned per CP group)"),
        (model["name"] == "gpt_oss", "[model] name = 'gpt_oss' (its sliding-window layers' dispatch is planned per "
                                     "CP group)"),
        (model["name"] == "qwen3_5", "[model] name = 'qwen3_5' (its Gated DeltaNet layers' dispatch is planned per "
                                     "CP group)"),
    ]  # fmt: skip
    for bad, what in refused:
        if bad:
            raise ConfigError(f"{what}: not with [flashcp] scope = 'mesh'")


def check_mesh_layout(cfg: dict, dp: int, cp: int) -> None:
    """`[flashcp] ranks_per_node`, set, divides the mesh's DP x CP ranks (its nodes are whole)."""
    g = cfg["flashcp"]["ranks_per_node"]
    if cfg["flashcp"]["scope"] == "mesh" and g and (dp * cp) % g:
        raise ConfigError(f"[flashcp] ranks_per_node ({g}) must divide the mesh's DP x CP = {dp} x {cp} ranks with "
                          "scope = 'mesh': the ranks of one node")  # fmt: skip
