"""The probe inside the training loop: built from the trainer's own parts, run at `[probe] freq`.

`attach` builds the `Probe` once after the trainer (its tokenizer, CP planner settings, dispatch
and data-parallel rank); `run` scores it with the trainer's path, model, loss slicing and context,
sums over the DP x CP mesh and publishes (log and PNG on rank 0, TensorBoard on the metrics rank).
Its tokens per run are logged once at `attach`, its wall time at every run.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from torchtitan.tools.logging import logger

from flashcp.titan.probe.report import publish
from flashcp.titan.probe.score import Probe, ProbeResult


def attach(trainer: Any) -> Probe:
    """The probe of `trainer.config.probe` for this rank (`trainer`: a built `FlashCPTrainer`)."""
    config = trainer.config
    dims = trainer.parallel_dims
    if dims.dp_enabled:
        batch = dims.get_mesh("batch")
        dp_world, dp_rank = batch.size(), batch.get_local_rank()
    else:
        dp_world, dp_rank = 1, 0
    probe = Probe(
        config.probe, config.training.seq_len, trainer.tokenizer.tokenizer, bos=config.dataloader.data.add_bos,
        cp_size=config.dataloader.cp_size, planner=config.dataloader.planner, dispatch=trainer.dispatch_window,
        dp_rank=dp_rank, dp_world=dp_world,
    )  # fmt: skip
    cells = len(probe.lengths) * len(config.probe.depths)
    logger.info(f"probe: {cells} cells (lengths {probe.lengths}, depths {config.probe.depths}) x "
                f"{config.probe.samples} prompts, {probe.tokens:,} tokens per run "
                f"({probe.tokens // config.training.seq_len} windows), every {config.probe.freq} steps")  # fmt: skip
    return probe


def run(trainer: Any, probe: Probe, step: int) -> ProbeResult:
    """Score the probe on the trainer's current weights and publish the result."""
    dims = trainer.parallel_dims
    mesh = dims.get_optional_mesh("loss") if dims.dp_cp_enabled else None
    start = time.perf_counter()
    result = probe.run(trainer, trainer.model_parts[0], trainer.loss_fn, trainer.train_context, mesh, step)
    seconds = time.perf_counter() - start  # the summed scores reached the host: every window has run
    rank0 = torch.distributed.get_rank() == 0
    folder = Path(trainer.config.dump_folder) / "probe" if rank0 else None
    publish(result, trainer.metrics_processor.tensorboard, folder, seconds)
    return result
