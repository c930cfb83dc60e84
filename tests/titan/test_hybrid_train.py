"""Qwen3.5's hybrid text decoder (Gated DeltaNet + full attention) in FlashCPTrainer: CP 2 and 4 = CP 1.

The shipped tiny config.json (train_configs/hf/tiny_qwen3_5: 3 Gated DeltaNet layers, 1 full) through
the job's one build path (`[model] hf_config`), full activation checkpointing and FSDP over the CP
ranks. The plan cuts every document (`per_doc`), so each cut document's recurrent state and its
convolution's last rows cross from one rank to the other in the linear layers, and K/V in the full one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

CONFIG = Path(__file__).resolve().parents[2] / "train_configs/hf/tiny_qwen3_5"
TOLERANCE = 1e-5  # absolute on losses and relative on gradients, float32
# Every document cut over both ranks (states pass); full AC recomputes each block in backward.
JOB = {"model": {"hf_config": str(CONFIG)}, "activation_checkpoint": {"mode": "full"},
       "flashcp": {"strategy": "per_doc"}}  # fmt: skip


# The decay gate's gradients (A_log, dt_bias, in_proj_a) are sums of per-token terms that nearly
# cancel (entries near 1e-6 where the block's others reach 1e-3): float32 rounds them at the scale of
# the terms, up to 2e-4 of their own size. They are compared at their block's largest gradient;
# tests/titan/test_gdn_oracle.py checks them exactly (float64, 1e-10 of their own size).
GATE = ("A_log", "dt_bias", "in_proj_a.weight")


def _relative(ours: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor | None = None) -> float:
    return float((ours - ref).abs().max() / (ref.abs().max() if scale is None else scale).clamp_min(1e-30))


def _block_scales(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each parameter's name -> the largest gradient entry of its block (`layers.i`, else itself)."""
    block = {name: ".".join(name.split(".")[:2]) if name.startswith("layers.") else name for name in grads}
    scales: dict[str, torch.Tensor] = {}
    for name, grad in grads.items():
        scales[block[name]] = torch.maximum(scales.get(block[name], torch.zeros(())), grad.abs().max())
    return {name: scales[block[name]] for name in grads}


@pytest.fixture(scope="module")
def cp1(tmp_path_factory) -> tuple[dict, dict[int, float], dict[str, torch.Tensor]]:
    """The seed checkpoint every run starts from, and CP = 1's 4 losses and first gradients."""
    from harness import single_rank, tiny_job, train

    tmp = tmp_path_factory.mktemp("hybrid")
    with single_rank():
        train(tiny_job(tmp / "seed", ("model",), checkpoint={"enable": True, "create_seed_checkpoint": True},
                       **JOB), seed_checkpoint=True)  # fmt: skip
    seed = {"enable": True, "initial_load_path": str(tmp / "seed/checkpoint/step-0")}
    grads: dict[str, torch.Tensor] = {}
    with single_rank():
        losses = train(tiny_job(tmp / "cp1", ("model",), checkpoint=seed, **JOB), first_grads=grads)
    assert len(losses) == 4 and any(name.endswith("A_log") for name in grads)
    return seed, losses, grads


# CP 2 with the compact exchange of the full layers; CP 4 over two nodes of two ranks with the two-level one.
@pytest.mark.parametrize(("cp", "flashcp"), [(2, {}), pytest.param(4, {"comm": "two_level", "ranks_per_node": 2}, marks=pytest.mark.slow)])
def test_trainer_reproduces_cp1(tmp_path, gloo_pool, cp1, cp, flashcp):
    """From one seed checkpoint, CP = 2's and 4's losses and first gradients (every parameter's: the
    Gated DeltaNet layers' A_log, dt_bias, conv and projections, the full layer's) are CP = 1's, with
    the linear layers' dispatch built per step beside the full one's and documents continued on other ranks."""
    from harness import tiny_job

    seed, losses, grads = cp1
    job = JOB | {"flashcp": JOB["flashcp"] | flashcp}
    cfg = tiny_job(tmp_path / f"cp{cp}", ("model",), checkpoint=seed, parallelism={"context_parallel_degree": cp}, **job)
    runs = gloo_pool(cp).run(_train_rank, (cfg,))
    assert sum(continued for _, _, continued in runs) > 0  # some rank started a document another rank began
    scales = _block_scales(grads)
    for rank_losses, rank_grads, _ in runs:
        assert max(abs(rank_losses[s] - losses[s]) for s in losses) <= TOLERANCE, (rank_losses, losses)
        for name, grad in grads.items():
            scale = scales[name] if name.endswith(GATE) else None
            assert _relative(rank_grads[name], grad, scale) <= TOLERANCE, name


def _train_rank(rank: int, group, cfg: dict) -> tuple[dict[int, float], dict[str, torch.Tensor], int]:
    """A pool rank's losses, first gradients and how many pieces of its windows continue a document
    (the linear dispatches the trainer built, recorded in the loader's thread)."""
    import flashcp.titan.trainer as trainer
    from harness import train_on_pool_rank

    build, continued = trainer.build_hybrid_dispatches, []

    def recording(*args: Any, **kwargs: Any) -> Any:
        dispatches = build(*args, **kwargs)
        continued.append(len(dispatches.linear.continued.lens))
        return dispatches

    grads: dict[str, torch.Tensor] = {}
    trainer.build_hybrid_dispatches = recording
    try:
        losses = train_on_pool_rank(rank, group, cfg, first_grads=grads)
    finally:
        trainer.build_hybrid_dispatches = build
    return losses, grads, sum(continued)
