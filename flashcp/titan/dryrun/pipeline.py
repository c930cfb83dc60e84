"""A pipelined job's memory per stage: one stage measured on fake tensors, every stage derived from it.

The dry run does not run torch's pipeline schedules on fake tensors (their send / receive pairs
need every stage's process, and a schedule's peak is one microbatch's layer backward with the
others' saved activations waiting). It measures instead, with the real FSDP / TP / EP / FlashCP
parallelisation, one stage as a job of its own: the job without PP at world size W / pp (the
stage's DP x CP x TP ranks: TorchTitan's mesh puts pp outermost), its model cut to the layers of
the stage with the most layers (of those, the last such stage: DeepSeek's dense first layers are
not the ones measured), one microbatch (one packed window), FSDP resharding after forward as the
job's policy resolves under PP (TorchTitan's "default" keeps a stage's weights gathered between
microbatches: measured with "never"). That run holds the embedding and the output, norm and loss
as well. Each pipeline rank r (its stages r, r + pp, ... for v stages per rank) is then:

- parameters, gradients, optimizer states: the measured ones times the rank's parameters over the
  measured model's (local, sharded elements: its layers', each charged the largest measured layer's,
  plus the embedding on the first stage and norm + output on the last);
- activations: the measured ones plus, for every other microbatch-stage in flight
  (`in_flight_chunks`: torch's schedules), that stage's layers' saved activations: under full AC
  each layer's input, tokens / CP x dim bf16 values (/ TP under sequence parallelism); otherwise
  the measured activations per measured layer (an upper bound: it holds one layer's working set);
- gradients: torch's PipelineStage runs the backward of every microbatch but the step's last without
  FSDP's gradient sync, so the unsharded gradients of the rank's layers (their TP / EP shard, in the
  reduce dtype) accumulate across microbatches: the larger of those and the measured (scaled) ones;
- FlashCP buffers and model buffers as measured (one layer's at a time);
- the loss: on the last stage; the other stages are charged it too when the measured peak fell in
  it (their own peak, in a layer's backward, was not measured apart: an upper bound).
"""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

from flashcp.costmodel.pipeline import in_flight
from flashcp.titan.config.pipeline import PIPELINE_KEYS
from flashcp.titan.config.schema import SCHEMA

STATE = ("parameters", "gradients", "optimizer_states")


def stage_split(cfg: dict[str, Any]) -> tuple[list[list[str]], int]:
    """TorchTitan's split of the job's layers into stages (module names per stage) and stages per rank."""
    from torchtitan.distributed.pipeline_parallel import _generate_llm_fqn_per_model_part, _get_pipeline_metadata

    from flashcp.titan.config.model import model_dims

    par = cfg["parallelism"]
    n_layers = model_dims(cfg)[1]
    stages, _, first, last = _get_pipeline_metadata(SimpleNamespace(pp=par["pipeline_parallel_degree"]),
                                                    SimpleNamespace(**par), SimpleNamespace(layers=range(n_layers)))  # fmt: skip
    split = par["module_fqns_per_model_part"] or _generate_llm_fqn_per_model_part(stages, n_layers, first, last)
    return split, len(split) // par["pipeline_parallel_degree"]


def layer_ids(names: list[str]) -> list[int]:
    return [int(name.split(".")[1]) for name in names if name.startswith("layers.")]


def measured_layers(split: list[list[str]]) -> list[int]:
    """The layers of the stage the dry run measures: the most layers, the last such stage."""
    most = max(len(layer_ids(s)) for s in split)
    return layer_ids([s for s in split if len(layer_ids(s)) == most][-1])


def stage_job(cfg: dict[str, Any]) -> dict[str, Any]:
    """The job one stage runs, without PP: one microbatch, FSDP's weights kept as PP keeps them."""
    out = copy.deepcopy(cfg)
    par = out["parallelism"]
    par["pipeline_parallel_degree"] = 1
    for name in PIPELINE_KEYS:
        par[name] = SCHEMA["parallelism"][name].default
    if par["fsdp_reshard_after_forward"] == "default":  # TorchTitan: under PP, not resharded after forward
        par["fsdp_reshard_after_forward"] = "never"
    out["training"]["local_batch_size"] = 1
    out["training"]["global_batch_size"] = -1
    return out


def in_flight_chunks(schedule: str, p: int, m: int, rank: int, v: int) -> int:
    """Microbatch-stages in flight on pipeline rank `rank` (torch's schedules; `costmodel.pipeline.in_flight`).
    LoopedBFS runs every forward before any backward (v m); the zero-bubble schedules and DualPipeV
    are not derived here and are charged v m, an upper bound."""
    name = schedule.lower()
    if name in ("gpipe", "1f1b", "interleaved1f1b"):
        return in_flight(schedule, p, m, rank, v)
    if name == "interleavedzerobubble":
        from torch.distributed.pipelining.schedules import _get_warmup_ops

        rounds = max(1, m // p)
        return min(v * m, _get_warmup_ops(rank, v, m // rounds, p, m, multiply_factor=1) + 1)
    return v * m


def _local_numel(module) -> int:
    total = 0
    for p in module.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel()
    return total


def _unsharded_numel(module) -> int:
    """Elements of the module's parameters as FSDP gathers them on this rank: their TP / EP shard."""
    total = 0
    for p in module.parameters():
        mesh = getattr(p, "device_mesh", None)
        if mesh is None:
            total += p.numel()
            continue
        names = mesh.mesh_dim_names or ()
        split = 1
        for i, placement in enumerate(p.placements):
            if placement.is_shard() and names[i] in ("tp", "ep"):
                split *= mesh.size(i)
        total += p.numel() // split
    return total


def per_stage(cfg: dict[str, Any], trainer, by_category: dict[str, float], split: list[list[str]], v: int,
              layer_input_gib: float) -> list[dict[str, Any]]:
    """Every pipeline rank's GiB by category, from the measured stage's (module doc)."""
    par = cfg["parallelism"]
    p, m = par["pipeline_parallel_degree"], cfg["training"]["local_batch_size"]
    schedule = par["pipeline_parallel_schedule"]
    model = trainer.model_parts[0]
    layer_numel = [_local_numel(block) for block in model.layers.values()]
    embed = _local_numel(model.tok_embeddings)
    final = sum(_local_numel(getattr(model, name)) for name in ("norm", "lm_head", "output") if hasattr(model, name))
    measured_numel = sum(layer_numel) + embed + final
    per_layer = max(layer_numel)  # every stage's layers are charged the largest measured one's
    # torch's PipelineStage runs every microbatch's backward but the last without FSDP's gradient sync
    # (set_requires_gradient_sync(False)): a stage's unsharded gradients accumulate, in the reduce dtype
    reduce_bytes = 4 if cfg["training"]["mixed_precision_reduce"] == "float32" else 2
    grad_per_layer = max(_unsharded_numel(block) for block in model.layers.values()) * reduce_bytes / 2**30
    k = len(layer_numel)
    full_ac = cfg["activation_checkpoint"]["mode"] == "full"
    saved_per_layer = layer_input_gib if full_ac else by_category["activations"] / k
    out = []
    for rank in range(p):
        mine = [split[rank + i * p] for i in range(v)]
        layers = [layer_ids(s) for s in mine]
        first, last = any("tok_embeddings" in s for s in mine), any("norm" in s for s in mine)
        numel = per_layer * sum(len(ids) for ids in layers) + embed * first + final * last
        chunks = in_flight_chunks(schedule, p, m, rank, v)
        chunk_layers = max(len(ids) for ids in layers)
        gib = {name: value * numel / measured_numel if name in STATE else value for name, value in by_category.items()}
        gib["activations"] = by_category["activations"] + saved_per_layer * max(0, chunks * chunk_layers - k)
        if m > 1:
            gib["gradients"] = max(gib["gradients"], grad_per_layer * sum(len(ids) for ids in layers))
        out.append({
            "rank": rank, "stages": [rank + i * p for i in range(v)], "layers": sum(len(ids) for ids in layers),
            "embedding": first, "output": last, "in_flight": chunks, "parameters_share": numel / measured_numel,
            "by_category": gib, "peak_gib": sum(gib.values()),
        })  # fmt: skip
    return out
