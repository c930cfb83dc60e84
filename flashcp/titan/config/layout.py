"""Checks of a validated job that depend on the number of ranks and on the machine.

The parallel degrees must multiply to the world size, one rank's share of the weights must fit
(`sizes.check_weights`), the context must split evenly over the CP and sequence-parallel ranks,
TP must divide the heads, and the kernels and GPU features a job names must exist on this machine.
The launcher, the dry run and `--check` call `check_layout` before any rank starts.
"""

from __future__ import annotations

from flashcp.attention.kernels import gpu_backend_problem
from flashcp.titan.config.converters import converter_problem
from flashcp.titan.config.keys import ConfigError
from flashcp.titan.config.model import model_dims
from flashcp.titan.config.schema import GPU_BACKENDS, RANKS_PER_NODE_COMMS
from flashcp.titan.config.scope import check_mesh_layout, resolve_scope
from flashcp.titan.config.sizes import check_weights


def degrees(cfg: dict, world_size: int) -> dict[str, int]:
    """Parallel degrees for `world_size` ranks (dp_shard = -1 resolved); ConfigError if they do not fit."""
    if cfg["checkpoint"]["create_seed_checkpoint"]:
        if world_size != 1:
            raise ConfigError(
                f"[checkpoint] create_seed_checkpoint runs on 1 rank (NGPU=1), not {world_size}"
            )
        return {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, "pp": 1}
    par = cfg["parallelism"]
    rep, shard = par["data_parallel_replicate_degree"], par["data_parallel_shard_degree"]
    cp, tp, pp = par["context_parallel_degree"], par["tensor_parallel_degree"], par["pipeline_parallel_degree"]
    fixed = pp * rep * cp * tp
    named = f"pipeline_parallel_degree ({pp}) x " if pp > 1 else ""
    if shard == -1:
        if world_size % fixed:
            raise ConfigError(
                f"world size {world_size} is not divisible by {named}data_parallel_replicate_degree ({rep}) x "
                f"context_parallel_degree ({cp}) x tensor_parallel_degree ({tp}) = {fixed}"
            )
        shard = world_size // fixed
    elif fixed * shard != world_size:
        raise ConfigError(
            f"[parallelism] degrees multiply to {fixed * shard} ({f'pp {pp} x ' if pp > 1 else ''}replicate {rep} x "
            f"shard {shard} x cp {cp} x tp {tp}) but the job has {world_size} ranks; set data_parallel_shard_degree "
            f"= -1 or launch {fixed * shard} ranks (NGPU / NNODES)"
        )
    return {"dp_replicate": rep, "dp_shard": shard, "cp": cp, "tp": tp, "pp": pp}


def world_size_hint(cfg: dict) -> int | None:
    """The rank count the layout fixes, or None when data_parallel_shard_degree = -1 leaves it open."""
    if cfg["checkpoint"]["create_seed_checkpoint"]:
        return 1
    par = cfg["parallelism"]
    if par["data_parallel_shard_degree"] == -1:
        return None
    return (
        par["pipeline_parallel_degree"] * par["data_parallel_replicate_degree"] * par["data_parallel_shard_degree"]
        * par["context_parallel_degree"] * par["tensor_parallel_degree"]
    )  # fmt: skip


def check_layout(cfg: dict, world_size: int, has_cuda: bool | None = None) -> dict[str, int]:
    """Everything that depends on the number of ranks and the machine; returns the degrees."""
    deg = degrees(cfg, world_size)
    check_weights(cfg, world_size)
    cp, tp = deg["cp"], deg["tp"]
    seq_len = cfg["training"]["seq_len"]
    sp = tp if cfg["parallelism"]["enable_sequence_parallel"] else 1
    divisor = sp * (2 * cp if cp > 1 else 1)  # TorchTitan 0.3.0's Trainer requires this
    if seq_len % divisor:
        tp_part = f" x tensor_parallel_degree {tp} for sequence parallel" if sp > 1 else ""
        raise ConfigError(
            f"[training] seq_len ({seq_len}) must be divisible by {divisor} (= 2 x context_parallel_degree "
            f"{cp}{tp_part}): every CP rank holds seq_len / cp tokens"
        )
    _, _, n_heads, n_kv, _ = model_dims(cfg)
    if n_heads % tp or n_kv % tp:
        raise ConfigError(
            f"[parallelism] tensor_parallel_degree ({tp}) must divide n_heads ({n_heads}) "
            f"and n_kv_heads ({n_kv})"
        )
    ep = cfg["parallelism"]["expert_parallel_degree"]
    borrowed = deg["dp_shard"] * cp * tp
    if ep > 1 and borrowed % ep:
        raise ConfigError(
            f"[parallelism] expert_parallel_degree ({ep}) must divide the ranks it borrows from, data_parallel_shard "
            f"x context_parallel x tensor_parallel ({deg['dp_shard']} x {cp} x {tp} = {borrowed}); experts are "
            f"FSDP-sharded over the rest"
        )
    global_bs = cfg["training"]["global_batch_size"]
    dp = deg["dp_replicate"] * deg["dp_shard"]
    resolved = resolve_scope(cfg, dp, cp)  # scope = "auto" becomes group or mesh here, where DP is known
    fcp = cfg["flashcp"]
    if fcp["scope"] == "group" and fcp["comm"] not in RANKS_PER_NODE_COMMS and "ranks_per_node" in cfg["_given"].get(
            "flashcp", ()):  # the config check let it pass for "auto", which might have become "mesh"
        raise ConfigError(f"[flashcp] ranks_per_node = {fcp['ranks_per_node']} has no effect with comm = "
                          f"{fcp['comm']!r} and {resolved}: only comm = 'two_level' or scope = 'mesh' uses it")
    check_mesh_layout(cfg, dp, cp)
    if global_bs != -1 and (global_bs < 1 or global_bs % (dp * cfg["training"]["local_batch_size"])):
        raise ConfigError(
            f"[training] global_batch_size ({global_bs}) must be a positive multiple of local_batch_size x "
            f"data-parallel degree ({cfg['training']['local_batch_size']} x {dp})"
        )
    if has_cuda is None:
        import torch

        has_cuda = torch.cuda.is_available()
    _check_machine(cfg, has_cuda)
    return deg


def _check_machine(cfg: dict, has_cuda: bool) -> None:
    """Kernels and GPU features the job names exist here."""
    attention, backend = cfg["model"]["attention"], cfg["flashcp"]["backend"]
    if has_cuda and attention == "flashcp" and backend in GPU_BACKENDS:
        problem = gpu_backend_problem(backend)
        if problem:
            raise ConfigError(f"[flashcp] backend = {backend!r} cannot run on this machine: {problem}; "
                              "or set backend = 'auto'")  # fmt: skip
    if cfg["parallelism"]["enable_fsdp_symm_mem"]:
        import torch

        if not has_cuda or (torch.version.hip is None and torch.cuda.get_device_capability() < (9, 0)):
            raise ConfigError("[parallelism] enable_fsdp_symm_mem needs NVIDIA GPUs of compute capability 9.0 "
                              "or newer (or AMD GPUs)")  # fmt: skip
    for name in cfg["model"]["converters"]:
        import torch

        capability = torch.cuda.get_device_capability() if has_cuda else None
        problem = converter_problem(name, cfg["float8"]["emulate"], has_cuda, capability,
                                    rocm=has_cuda and torch.version.hip is not None)  # fmt: skip
        if problem:
            raise ConfigError(f"[model] converters = [{name!r}] cannot run on this machine: {problem}")
    if not has_cuda:
        if attention == "flashcp" and backend in GPU_BACKENDS:
            raise ConfigError(
                f"[flashcp] backend = {backend!r} needs CUDA and this machine has no GPU; "
                "use 'auto' or 'reference'"
            )
        if attention in ("flex", "varlen"):
            raise ConfigError(
                f"model.attention = {attention!r} cannot train on CPU (FlexAttention has no CPU backward, "
                "varlen attention no CPU kernel); use 'flashcp'"
            )
