"""`[flashcp] scope = "mesh"`: what one plan over the whole DP x CP mesh does not run, refused before launch.

The mesh scope (`flashcp.titan.mesh_scope`) plans the step's global batch with `plan_mesh`, FlashCP's
planner over nodes and ranks: it exchanges the rows other ranks need (compact, needed or two_level),
never the full all-gather over the mesh nor a ring around it; the plan is already the balance across
DP groups, so the loader's step balancing is off; and the held-out loaders (validation, the probe), the
pipeline schedule and the window / Gated DeltaNet dispatches still plan per CP group.

`scope = "auto"` (the default) is resolved once the DP degree is known (`resolve_scope`, from `check_layout`):
the mesh scope when DP > 1, seq_len >= `MESH_MIN_SEQ_LEN` and the job sets nothing the mesh scope does not
run, else per-group planning with the loader's balance. The threshold is the modelled step's
(benchmarks/step_model_mesh.py, docs/training.md "Scope"): at equal attended pairs the two-level mesh scope
wins or ties within 1 % of deferral-cut in every setting at 1M and loses by up to 18 % in some below it.
"""

from __future__ import annotations

from flashcp.titan.config.keys import ConfigError


MESH_MIN_SEQ_LEN = 1 << 20  # scope = "auto": the mesh scope from this seq_len with DP > 1 (module docstring)
# [data] keys of per-group balancing: any set in the job keeps scope = "auto" per group (the user asked for it)
BALANCE_KEYS = ("balance", "balance_target", "max_delay_steps", "min_pairs_kept")


def mesh_refusal(cfg: dict, balance: bool = True) -> str | None:
    """The first setting of a validated job the mesh scope does not run, or None; `balance`: count
    `[data] balance` other than "off" among them (auto scope turns the default off itself)."""
    fcp, data, model = cfg["flashcp"], cfg["data"], cfg["model"]
    refused = [
        (model["attention"] != "flashcp", f"[model] attention = {model['attention']!r} (the mesh scope is "
                                          "FlashCP's plan; set attention = 'flashcp')"),
        (fcp["strategy"] != "flashcp", f"[flashcp] strategy = {fcp['strategy']!r} (the mesh is planned by FlashCP's "
                                       "planner over nodes and ranks, flashcp.plan.mesh)"),
        (fcp["comm"] == "full", "[flashcp] comm = 'full' (the full all-gather over the whole mesh; use 'needed', "
                                "'two_level' or 'compact')"),
        (fcp["comm"] == "ring", "[flashcp] comm = 'ring' (a ring around the whole mesh; use 'needed' or "
                                "'two_level')"),
        (balance and data["balance"] != "off", f"[data] balance = {data['balance']!r} (the mesh-wide plan is the balance across "
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
    return next((what for bad, what in refused if bad), None)


def check_mesh_scope(cfg: dict) -> None:
    """One line for the first setting the mesh scope does not run (a validated job's sections)."""
    what = mesh_refusal(cfg) if cfg["flashcp"]["scope"] == "mesh" else None
    if what:
        raise ConfigError(f"{what}: not with [flashcp] scope = 'mesh'")


def resolve_scope(cfg: dict, dp: int, cp: int) -> str:
    """`[flashcp] scope = "auto"` made "group" or "mesh" for DP x CP ranks (with mesh, `[data] balance`
    "off"), in place; returns the one line saying which and why. A job's explicit scope is kept; a
    second call (the same job checked again) returns the first's line."""
    fcp, given = cfg["flashcp"], cfg["_given"]
    if "_scope" in cfg:
        return cfg["_scope"]
    seq_len, g = cfg["training"]["seq_len"], fcp["ranks_per_node"]
    balance = next((k for k in BALANCE_KEYS if k in given.get("data", ())), None)
    refusal = mesh_refusal(cfg, balance=False)
    why = ("set in the job" if fcp["scope"] != "auto" else
           "auto, DP = 1: one group" if dp == 1 else
           f"auto, seq_len {seq_len} < {MESH_MIN_SEQ_LEN}: below it per-group deferral-cut is modelled faster "
           "on some distributions at equal attended pairs" if seq_len < MESH_MIN_SEQ_LEN else
           f"auto, [data] {balance} is set: the loader balances per group" if balance else
           f"auto, {refusal}" if refusal else
           f"auto, ranks_per_node {g} does not divide DP x CP = {dp} x {cp}" if g and (dp * cp) % g else
           None)  # fmt: skip
    if why is None:
        fcp["scope"], cfg["data"]["balance"] = "mesh", "off"
        why = (f"auto, DP = {dp} > 1 and seq_len {seq_len} >= {MESH_MIN_SEQ_LEN}: one plan over the mesh is modelled "
               "as fast as per-group deferral-cut or faster; [data] balance = 'off'")  # fmt: skip
    elif fcp["scope"] == "auto":
        fcp["scope"] = "group"
    cfg["_scope"] = f"[flashcp] scope = {fcp['scope']!r} ({why})"
    return cfg["_scope"]


def check_mesh_layout(cfg: dict, dp: int, cp: int) -> None:
    """`[flashcp] ranks_per_node`, set, divides the mesh's DP x CP ranks (its nodes are whole)."""
    g = cfg["flashcp"]["ranks_per_node"]
    if cfg["flashcp"]["scope"] == "mesh" and g and (dp * cp) % g:
        raise ConfigError(f"[flashcp] ranks_per_node ({g}) must divide the mesh's DP x CP = {dp} x {cp} ranks with "
                          "scope = 'mesh': the ranks of one node")  # fmt: skip
