"""Calibrated cost model of one context-parallel attention layer (torch-free: numpy only).

    model, fit = load_cost_model(["nccl_tables/"], ["attn_profile.csv"])
    plans = {s: plan_shards(doc_lens, 8, s) for s in ("per_seq", "per_doc", "flashcp")}
    t = model.step("flashcp", AttentionShape(heads=32), plans)   # StepTime, in ms
    t.training, t.inference, t.as_dict()

Calibration comes only from measured tables (see `profiles` for their formats): nccl-tests
all-gather / reduce-scatter bus bandwidth by message size, and FlashAttention call times (a
per-document profile or per-rank measurements). `kernel` fits the attention time model,
`comm` prices collectives, `model` composes them per CP system; `fabric` prices CP and FSDP groups
that span nodes (`multinode_model(model)`), `step` a whole training step.

May import: numpy, the engine (`flashcp.plan`, `flashcp.dispatch`, `flashcp.attention`) and
`flashcp.data` (length distributions); never TorchTitan.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from flashcp.costmodel.comm import CommModel
from flashcp.costmodel.kernel import DEFAULT_BWD_RATIO, FitReport, KernelModel, fit_kernel_model
from flashcp.costmodel.model import (
    COLLECTIVE_SYSTEMS,
    RING_SYSTEMS,
    SYSTEMS,
    AttentionShape,
    CostModel,
    MemoryCosts,
    StepTime,
)
from flashcp.costmodel.profiles import (
    PER_DOC_PROFILE_HEADS,
    ProfileError,
    load_collective_tables,
    load_kernel_samples,
)


def load_cost_model(
    collective_paths: Iterable[str | Path],
    kernel_paths: Iterable[str | Path],
    profile_heads: int = PER_DOC_PROFILE_HEADS,
    bwd_ratio: float = DEFAULT_BWD_RATIO,
    memory: MemoryCosts | None = None,
) -> tuple[CostModel, dict[str, FitReport]]:
    """Build a CostModel from measured tables (files or directories); also return fit residuals."""
    comm = CommModel(load_collective_tables(collective_paths))
    kernel, reports = fit_kernel_model(load_kernel_samples(kernel_paths, profile_heads), bwd_ratio)
    return CostModel(kernel, comm, memory), reports


__all__ = [
    "COLLECTIVE_SYSTEMS",
    "RING_SYSTEMS",
    "SYSTEMS",
    "AttentionShape",
    "CommModel",
    "CostModel",
    "FitReport",
    "KernelModel",
    "MemoryCosts",
    "ProfileError",
    "StepTime",
    "fit_kernel_model",
    "load_cost_model",
]
