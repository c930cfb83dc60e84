"""Pipeline parallelism with tensor parallelism and with a compiled model, against the runs without PP.

PP 2 x TP 2 x CP 2 on 8 gloo ranks, and PP 2 x CP 2 with `[compile] enable` (the blocks, inductor),
under 1F1B and Interleaved1F1B (two stages a rank, each with its own TP plan and compiled blocks),
train the four windows a step as four pipeline microbatches; CP 1 on one rank trains them as four
gradient-accumulation micro steps (test_pp_train.py's reference, from its seed checkpoint): the first
two steps' losses and every parameter's first gradient agree to its float32 tolerance, 1e-5
(observed: losses 9.5e-7 absolute, gradients 3.9e-7 relative, for all four runs). Each stage's
weights are DTensors over (fsdp, tp); a compiled rank's blocks are one graph with no break. The three
together, compiled PP 2 x TP 2 x CP 2, too (observed: 9.5e-7 and 4.5e-7).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_pp_train import _relative, _train_rank, cp1, MODEL, SPLIT, TOLERANCE, WINDOWS  # noqa: F401

STEPS = 2  # of the reference's 4 (its learning-rate schedule): the second runs after an optimizer step
# 1F1B holds a stage per rank, microbatch i+1's forward before i's backward; Interleaved1F1B two stages
# per rank (each its own TP plan, its own compiled blocks).
SCHEDULES = ["1F1B", "Interleaved1F1B"]


def _pipelined(runs: list, stage_ranks: int) -> tuple[dict[int, float], dict[str, torch.Tensor]]:
    """The last stage's losses and the union of the stages' first gradients, after checking that every
    rank planned the same windows and that the `stage_ranks` ranks of each stage agree."""
    losses: dict[int, float] = {}
    grads: dict[str, torch.Tensor] = {}
    assert sum(last for _, _, last, _ in runs) == stage_ranks  # one PP rank holds the last stage
    for rank_losses, rank_grads, last, windows in runs:
        assert windows == runs[0][3] and len(windows) == STEPS * WINDOWS
        if last:
            assert not losses or rank_losses == losses
            losses = rank_losses
        for name, grad in rank_grads.items():
            assert name not in grads or torch.equal(grads[name], grad), name
            grads[name] = grad
    return losses, grads


def _differences(losses, grads, ref_losses, ref_grads) -> tuple[float, float]:
    """The worst absolute loss difference and relative gradient difference, checked against TOLERANCE."""
    assert sorted(losses) == list(range(1, STEPS + 1)) and grads.keys() == ref_grads.keys()
    loss = max(abs(losses[s] - ref_losses[s]) for s in losses)
    grad = max(_relative(grads[name], g) for name, g in ref_grads.items())
    assert loss <= TOLERANCE and grad <= TOLERANCE, (loss, grad, losses, ref_losses)
    return loss, grad


def _train_rank_probed(rank: int, group: Any, cfg: dict) -> tuple:
    """`_train_rank`'s results for the first STEPS steps, with the TP degree the trainer ran, an attention
    weight's mesh and placements, and the graphs dynamo compiled and its graph breaks (counters start empty)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from flashcp.titan.trainer import FlashCPTrainer

    window_inputs, more, layout = FlashCPTrainer.window_inputs, FlashCPTrainer.should_continue_training, []

    def recording(self: FlashCPTrainer, batch: dict[str, Any]) -> Any:
        if not layout:
            name, weight = next((n, p) for n, p in self.model_parts[0].named_parameters() if ".attention." in n)
            layout[:] = [self.parallel_dims.tp, name, weight.device_mesh.mesh_dim_names, str(weight.placements)]
        return window_inputs(self, batch)

    torch._dynamo.reset()
    counters.clear()
    FlashCPTrainer.window_inputs = recording
    FlashCPTrainer.should_continue_training = lambda self: self.step < STEPS and more(self)
    try:
        runs = _train_rank(rank, group, cfg)
    finally:
        FlashCPTrainer.window_inputs, FlashCPTrainer.should_continue_training = window_inputs, more
    return *runs, layout, (counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()))


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pp2_x_tp2_x_cp2_reproduces_cp1(tmp_path, gloo_pool, cp1, schedule):
    """PP 2 x TP 2 x CP 2: every stage's weights are split over TP (and sharded over CP's FSDP), its
    four ranks' gathered gradients agree, and they and the last stage's losses are CP 1's."""
    from harness import tiny_job

    seed, ref_losses, ref_grads = cp1
    parallelism = {"context_parallel_degree": 2, "tensor_parallel_degree": 2, "pipeline_parallel_degree": 2,
                   "pipeline_parallel_schedule": schedule, **SPLIT}  # fmt: skip
    cfg = tiny_job(tmp_path / "pp", model=MODEL, checkpoint=seed, parallelism=parallelism,
                   training={"local_batch_size": WINDOWS})  # fmt: skip
    runs = gloo_pool(8).run(_train_rank_probed, (cfg,))
    layouts = {str(run[4]) for run in runs}
    print(f"layouts: {layouts}")
    assert all(run[4][0] == 2 and "tp" in run[4][2] for run in runs), layouts
    loss, grad = _differences(*_pipelined([run[:4] for run in runs], 4), ref_losses, ref_grads)
    print(f"PP 2 x TP 2 x CP 2 ({schedule}) vs CP 1: losses {loss:.1e}, gradients (relative) {grad:.1e}")


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_compiled_pp2_x_cp2_reproduces_cp1(tmp_path, gloo_pool, cp1, schedule):
    """PP 2 x CP 2 with the blocks compiled: the eager CP 1's losses and first gradients, one graph per
    rank for its stage's blocks and no graph break."""
    from harness import tiny_job

    seed, ref_losses, ref_grads = cp1
    parallelism = {"context_parallel_degree": 2, "pipeline_parallel_degree": 2,
                   "pipeline_parallel_schedule": schedule, **SPLIT}  # fmt: skip
    cfg = tiny_job(tmp_path / "pp", model=MODEL, checkpoint=seed, parallelism=parallelism,
                   training={"local_batch_size": WINDOWS}, compile={"enable": True, "components": ["model"]})  # fmt: skip
    runs = gloo_pool(4).run(_train_rank_probed, (cfg,))
    graphs = [run[5] for run in runs]
    loss, grad = _differences(*_pipelined([run[:4] for run in runs], 2), ref_losses, ref_grads)
    print(f"compiled PP 2 x CP 2 ({schedule}) vs eager CP 1: losses {loss:.1e}, gradients (relative) {grad:.1e}; "
          f"(graphs, breaks) per rank {graphs}")  # fmt: skip
    assert graphs == [(1, 0)] * 4, graphs  # a rank's blocks (one or two stages) share one graph


@pytest.mark.slow
def test_compiled_pp2_x_tp2_x_cp2_reproduces_cp1(tmp_path, gloo_pool, cp1):
    """The three together (the large jobs' layout, PP x TP x CP, compiled) under 1F1B: CP 1's losses and
    first gradients, and no graph break."""
    from harness import tiny_job

    seed, ref_losses, ref_grads = cp1
    parallelism = {"context_parallel_degree": 2, "tensor_parallel_degree": 2, "pipeline_parallel_degree": 2, **SPLIT}
    cfg = tiny_job(tmp_path / "pp", model=MODEL, checkpoint=seed, parallelism=parallelism,
                   training={"local_batch_size": WINDOWS}, compile={"enable": True, "components": ["model"]})  # fmt: skip
    runs = gloo_pool(8).run(_train_rank_probed, (cfg,))
    graphs = [run[5] for run in runs]
    loss, grad = _differences(*_pipelined([run[:4] for run in runs], 4), ref_losses, ref_grads)
    print(f"compiled PP 2 x TP 2 x CP 2 (1F1B) vs eager CP 1: losses {loss:.1e}, gradients (relative) {grad:.1e}; "
          f"(graphs, breaks) per rank {graphs}")  # fmt: skip
    assert all(run[4][0] == 2 for run in runs)
    # As without PP (test_parity.py), the first block's input from the embedding is an AsyncCollectiveTensor
    # under TP, the later blocks' a plain tensor: the first stage's blocks compile two graphs, the last's one
    # (its input is the tensor received from the first stage).
    assert graphs == [(1 if run[2] else 2, 0) for run in runs], graphs
