"""The jobs a lease trains and dry-runs: shipped job files with command-line overrides, as a user
would start them (`./run_train.sh --config llama8b_128k --model.flavor 1B ...`).

Part b trains a ~1B Llama 3 (TorchTitan's Llama 3.2 1B flavor) at 32K tokens on one GPU, FlashCP's
op with CP = 1, full activation checkpointing, in variants: eager, the offload and the MLP tiles (which
must reproduce eager's losses), compile (close to eager), Float8 and the retrieval probe. Part d
trains Llama 3 8B's layer shape (the full-size embedding and output projection, 1..4 layers) at 128K
tokens on one rank, what one rank of 1M tokens over CP 8 holds. `quick` swaps in toy sizes on the
CPU, with the same variants and checks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flashcp.titan.config import load_job, resolve_config_path
from flashcp.titan.dryrun.estimate import estimate, Layout, ModelShape

ONE_RANK = ("--parallelism.data_parallel_shard_degree", "1", "--parallelism.context_parallel_degree", "1")
MEASURED = ("--checkpoint.enable", "false", "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "true",
            "--activation_checkpoint.mode", "full")  # fmt: skip


@dataclass(frozen=True)
class Job:
    name: str
    config: str  # a job file in train_configs/
    overrides: tuple[str, ...]
    compare_to: str | None = None  # a job whose losses this one must reproduce, within `tolerance`
    tolerance: float = 0.0  # relative, on every step's loss
    converter: str | None = None  # a [model] converter the machine must be able to run

    def args(self, dump: Path) -> list[str]:
        """The launcher's arguments: the job file, the overrides, the dump folder."""
        return ["--config", self.config, *self.overrides, "--job.dump_folder", str(dump)]

    def load(self, dump: Path) -> dict[str, Any]:
        """The checked job, as the launcher reads it."""
        return load_job(resolve_config_path(self.config), [*self.overrides, "--job.dump_folder", str(dump)])


def train_jobs(quick: bool) -> list[Job]:
    """Part b's variants, most important first (a part cut short by its budget loses the last)."""
    if quick:  # debug_cpu's tiny Llama 3 on one CPU rank, fp32, the exact reference kernel
        base = ("debug_cpu", (*ONE_RANK, *MEASURED, "--training.steps", "3", "--validation.enable", "false",
                              "--lr_scheduler.warmup_steps", "1"))  # fmt: skip
        tol = {"offload": 0.0, "tiles": 1e-5, "compile": 1e-4}
        lengths, emulate = "[256, 512]", ("--float8.emulate", "true")
    else:  # Llama 3.2 1B's shape, bf16 compute, at 32K tokens; llama8b_128k's data, optimizer and kernel
        base = ("llama8b_128k", (*ONE_RANK, *MEASURED, "--model.flavor", "1B", "--training.seq_len", "32768",
                                 "--training.steps", "5", "--lr_scheduler.warmup_steps", "2"))  # fmt: skip
        # Offload moves the same tensors (its forward is bit for bit eager's); tiles and compile change
        # how bf16 matmuls round, and the attention backward's atomics differ run to run on a GPU.
        tol = {"offload": 1e-3, "tiles": 2e-3, "compile": 1e-2}
        lengths, emulate = "[8192, 32768]", ()
    config, common = base

    def job(name: str, *extra: str, **kw: Any) -> Job:
        return Job(name, config, (*common, *extra), **kw)

    return [
        job("eager"),
        job("offload", "--activation_checkpoint.offload", "true", compare_to="eager", tolerance=tol["offload"]),
        job("tiles", "--activation_checkpoint.mlp_tiles", "4", compare_to="eager", tolerance=tol["tiles"]),
        job("compile", "--compile.enable", "true", compare_to="eager", tolerance=tol["compile"]),
        job("float8", "--model.converters", "float8", *emulate, converter="float8"),
        job("probe", "--probe.enable", "true", "--probe.freq", "2", "--probe.lengths", lengths,
            "--probe.samples", "1", "--validation.source", "default"),
    ]  # fmt: skip


# Llama 3 8B's layer (dim 4096, 32 / 8 heads, SwiGLU 14336) and vocabulary, as a custom size so that
# the number of layers can be chosen; at most MAX_LAYERS keeps part d within its minutes.
LLAMA8B = ("--model.flavor", "custom", "--model.dim", "4096", "--model.n_heads", "32", "--model.n_kv_heads", "8",
           "--model.ffn_dim_multiplier", "1.3", "--model.multiple_of", "1024", "--model.vocab_size", "128256",
           "--model.rope_theta", "500000")  # fmt: skip
FRONTIER_TOKENS = 131072  # one rank's share of 1M tokens over CP 8
MAX_LAYERS = 4
RESERVE_GIB = 6.0  # the dry run's default allowance for the CUDA context and fragmentation


def frontier_layers(gpu_gib: float | None, quick: bool) -> int:
    """The largest stack (<= MAX_LAYERS) whose estimated peak without offload, plus the reserve, fits
    the GPU (`flashcp.titan.dryrun.estimate`; the dry runs of part c then check it); 2 in the rehearsal."""
    if quick or gpu_gib is None:
        return 2
    for layers in range(MAX_LAYERS, 0, -1):
        shape = ModelShape(dim=4096, layers=layers, heads=32, kv_heads=8, head_dim=128, ffn=14336, vocab=128256,
                           rope_rows=FRONTIER_TOKENS, rope_row_bytes=4 * 128)  # fmt: skip
        tiles = math.ceil(4 * FRONTIER_TOKENS * 14336 * 2 / 2**30)  # mlp_tiles = -1: 1 GiB of intermediates a tile
        layout = Layout(fsdp=1, tp=1, sequence_parallel=False, tokens=FRONTIER_TOKENS, kv_rows=FRONTIER_TOKENS,
                        loss_tokens=2048, full_ac=True, mlp_tiles=tiles)  # fmt: skip
        if estimate(shape, layout)["peak"] + RESERVE_GIB <= gpu_gib:
            return layers
    return 1


def frontier_jobs(gpu_gib: float | None, quick: bool) -> list[Job]:
    """Part d: the tallest stack that fits, then the same with head groups (part c sets its dry run
    beside its peak), with offload, and one layer (the per-layer term is the difference of the two
    heights); a part cut short by its budget loses the last."""
    top = frontier_layers(gpu_gib, quick)
    steps = ("--training.steps", "2", "--lr_scheduler.warmup_steps", "1")  # the peak: the second step's
    if quick:
        config, common = "debug_cpu", (*ONE_RANK, *MEASURED, *steps, "--validation.enable", "false",
                                       "--training.seq_len", "1024", "--activation_checkpoint.mlp_tiles", "2")  # fmt: skip
    else:
        config, common = "llama8b_128k", (*ONE_RANK, *MEASURED, *LLAMA8B, *steps,
                                          "--training.seq_len", str(FRONTIER_TOKENS),
                                          "--activation_checkpoint.mlp_tiles", "-1")  # fmt: skip
    groups = ("--activation_checkpoint.head_groups", "2" if quick else "-1")  # automatic: 4 for 8B at 128K
    jobs = [Job(f"layers{top}", config, (*common, "--model.n_layers", str(top))),
            Job(f"layers{top}_groups", config, (*common, "--model.n_layers", str(top), *groups)),
            Job(f"layers{top}_offload", config, (*common, "--model.n_layers", str(top),
                                                 "--activation_checkpoint.offload", "true"))]  # fmt: skip
    if top > 1:
        jobs.append(Job("layers1", config, (*common, "--model.n_layers", "1")))
    return jobs
