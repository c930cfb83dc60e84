"""Pipeline parallelism x FlashCP with Qwen3-MoE: PP 2 x CP 2 x EP 2 on 4 gloo ranks = the run without PP.

A tiny custom Qwen3-MoE (4 layers of 4 experts, top-2, full activation checkpointing) trains 4
steps of four windows from one seed checkpoint: without PP on 2 ranks (CP 2, EP 2 over the CP ranks,
the windows four gradient-accumulation micro steps), and with PP 2 x CP 2 (EP 2 over each stage's
CP ranks, the windows four microbatches). Each step's aux-loss-free routing-bias update moves every
expert's bias by coeff x sign(mean - count) of the step's token counts, so one token counted more
moves a bias the other way, and the next steps' routing and losses with it. The counts must be
the same integers, the biases equal, the losses and first gradients within TOLERANCE (float32, GPipe,
1F1B, Interleaved1F1B) and FLOAT64_TOLERANCE (float64, 1F1B). torch 2.13's
schedules run each stage once before the first microbatch to learn its shapes; that forward used to
count a microbatch's tokens again (`flashcp.titan.models.spec.uncounted_pipeline_inference`).

EP 2 is the most this layout allows: expert parallelism borrows its ranks from data_parallel_shard x
context_parallel inside a pipeline stage (2 ranks here), and the tiny experts divide by it.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any

import pytest
import torch

TOLERANCE = 1e-5  # absolute on losses (near 8.3), relative on gradients; float32
FLOAT64_TOLERANCE = 1e-10  # the same in float64 (tests/titan/harness.py's `float64`)
MOE = {"name": "qwen3", "num_experts": 4, "num_experts_per_tok": 2, "moe_hidden_dim": 32, "n_layers": 4}
STEPS = 4
WINDOWS = 4
LAYOUT = {"context_parallel_degree": 2, "expert_parallel_degree": 2}
# Stages hold a layer each (Interleaved1F1B: 4 stages) or two (GPipe / 1F1B: 2 stages).
SPLIT = {"pipeline_parallel_first_stage_less_layers": 0, "pipeline_parallel_last_stage_less_layers": 0}


def _job(dump, seed: dict, parallelism: dict, training: dict) -> dict:
    from harness import tiny_job

    return tiny_job(dump, model=MOE, checkpoint=seed, parallelism=LAYOUT | parallelism,
                    training={"steps": STEPS} | training, activation_checkpoint={"mode": "full"})  # fmt: skip


def _dtype(dtype: str) -> contextlib.AbstractContextManager:
    from harness import float64

    return float64() if dtype == "float64" else contextlib.nullcontext()


def _without_pp(tmp, gloo_pool, dtype: str) -> tuple[dict, tuple]:
    """A seed checkpoint in `dtype`, and CP 2 x EP 2's run from it without PP (see `_combined`)."""
    from harness import single_rank, tiny_job, train

    with single_rank(), _dtype(dtype):
        train(tiny_job(tmp / "seed", model=MOE, checkpoint={"enable": True, "create_seed_checkpoint": True}),
              seed_checkpoint=True)  # fmt: skip
    seed = {"enable": True, "initial_load_path": str(tmp / "seed/checkpoint/step-0")}
    runs = gloo_pool(2).run(_rank, (_job(tmp / "cp2", seed, {}, {"global_batch_size": WINDOWS}), dtype))
    reference = _combined(runs)
    assert len(reference[0]) == STEPS and len(reference[1]) == MOE["n_layers"]
    assert all(bias.abs().sum() > 0 for bias in reference[1].values())  # every layer's routing bias moved
    assert {g.dtype for g in reference[3].values()} == {getattr(torch, dtype)}
    return seed, reference


@pytest.fixture(scope="module")
def without_pp(tmp_path_factory, gloo_pool) -> tuple[dict, tuple]:
    return _without_pp(tmp_path_factory.mktemp("pp_moe"), gloo_pool, "float32")


@pytest.mark.parametrize("schedule", [pytest.param("GPipe", marks=pytest.mark.slow), "1F1B", pytest.param("Interleaved1F1B", marks=pytest.mark.slow)])
def test_pp2_x_cp2_x_ep2_reproduces_the_run_without_pp(tmp_path, gloo_pool, without_pp, schedule):
    _check(tmp_path, gloo_pool, without_pp, schedule, "float32", TOLERANCE)


def test_pp2_x_cp2_x_ep2_reproduces_the_run_without_pp_in_float64(tmp_path, gloo_pool, tmp_path_factory):
    """In float64 the runs differ in summation order only: 1e-10 (1F1B)."""
    reference = _without_pp(tmp_path_factory.mktemp("pp_moe64"), gloo_pool, "float64")
    _check(tmp_path, gloo_pool, reference, "1F1B", "float64", FLOAT64_TOLERANCE)


def _check(tmp_path, gloo_pool, without_pp: tuple, schedule: str, dtype: str, tolerance: float) -> None:
    seed, (losses, biases, counts, grads) = without_pp
    pp = {"pipeline_parallel_degree": 2, "pipeline_parallel_schedule": schedule, **SPLIT}
    runs = gloo_pool(4).run(_rank, (_job(tmp_path / "pp", seed, pp, {"local_batch_size": WINDOWS}), dtype))
    pp_losses, pp_biases, pp_counts, pp_grads = _combined(runs)
    assert pp_counts.keys() == counts.keys()
    for layer, per_step in counts.items():
        for step, (ours, ref) in enumerate(zip(pp_counts[layer], per_step, strict=True), start=1):
            assert torch.equal(ours, ref), f"layer {layer}, step {step}: expert counts {ours} vs {ref}"
    for layer, bias in biases.items():
        assert torch.equal(pp_biases[layer], bias), f"layer {layer}'s routing bias {pp_biases[layer]} vs {bias}"
    assert pp_losses.keys() == losses.keys()
    worst_loss = max(abs(pp_losses[s] - losses[s]) for s in losses)
    assert worst_loss <= tolerance, (pp_losses, losses)
    assert pp_grads.keys() == grads.keys()
    relative = {name: float((pp_grads[name] - g).abs().max() / g.abs().max().clamp_min(1e-30)) for name, g in grads.items()}
    assert max(relative.values()) <= tolerance, max(relative.items(), key=lambda item: item[1])
    print(f"MoE PP 2 x CP 2 x EP 2, {schedule}, {dtype}: losses within {worst_loss:.1e}, gradients {max(relative.values()):.1e}")


def _combined(runs: list) -> tuple[dict[int, float], dict[int, torch.Tensor], dict[int, list], dict[str, torch.Tensor]]:
    """The ranks' runs as one: the last stage's losses, each layer's final routing bias (the ranks
    holding it agree), each layer's expert counts per step summed over the ranks holding it, and the
    union of the first gradients (the ranks holding a parameter agree)."""
    losses: dict[int, float] = {}
    biases: dict[int, torch.Tensor] = {}
    counts: dict[int, list] = {}
    grads: dict[str, torch.Tensor] = {}
    for rank_losses, rank_biases, rank_counts, rank_grads in runs:
        if all(loss > 0 for loss in rank_losses.values()):  # a stage before the last logs no loss (-2)
            assert not losses or rank_losses == losses
            losses = rank_losses
        for layer, bias in rank_biases.items():
            assert layer not in biases or torch.equal(biases[layer], bias), layer
            biases[layer] = bias
        for layer, per_step in rank_counts.items():
            counts[layer] = [a + b for a, b in zip(counts[layer], per_step, strict=True)] if layer in counts else per_step
        for name, grad in rank_grads.items():
            assert name not in grads or torch.equal(grads[name], grad), name
            grads[name] = grad
    return losses, biases, counts, grads


def _rank(rank: int, group: Any, cfg: dict, dtype: str = "float32") -> tuple[dict[int, float], dict[int, torch.Tensor], dict[int, list], dict]:
    """A pool rank's losses, and by layer index (of the stages it holds) its final routing biases and
    its expert counts per step; its first gradients by parameter name."""
    from harness import train_on_pool_rank

    biases: list[torch.Tensor] = []
    counts: list[torch.Tensor] = []
    grads: dict[str, torch.Tensor] = {}
    with _dtype(dtype):
        losses = train_on_pool_rank(rank, group, cfg, expert_biases=biases, expert_counts=counts, first_grads=grads)
    # The harness lists a rank's MoE layers stage by stage, each stage's in order: ascending indices.
    layers = sorted({int(m.group(1)) for name in grads if (m := re.match(r"layers\.(\d+)\.", name))})
    assert len(layers) == len(biases) and len(counts) == STEPS
    return (losses, dict(zip(layers, biases, strict=True)),
            {layer: [step[i] for step in counts] for i, layer in enumerate(layers)}, grads)  # fmt: skip
