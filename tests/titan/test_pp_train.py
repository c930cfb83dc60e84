"""Pipeline parallelism x FlashCP in the trainer: PP 2 x CP 2 on 4 gloo ranks = CP 2 alone = CP 1.

Every pipeline microbatch is one packed window with its own plan, planned on every rank of every
stage (they read the same windows, so the plans agree); its CPStep reaches each stage as the
microbatch's kwargs and lives until the schedule has run that microbatch's backward there. Four
microbatches a step, each a different window (so a different plan), over 4 layers: 1F1B runs
microbatch i+1's forward before i's backward, Interleaved1F1B and LoopedBFS hold two stages per
rank. From one seed checkpoint, every step's loss and every parameter's first gradient match the
runs without PP, where the same four windows are four gradient-accumulation micro steps: in
float32 to 1e-5 under all seven schedules, and in float64 (tests/titan/harness.py's `float64`) to
1e-10 under GPipe, 1F1B and Interleaved1F1B, against one float64 CP 1 and CP 2 run they share.
"""

from __future__ import annotations

import contextlib
import gc
import tomllib
from typing import Any

import pytest
import torch

from flashcp.titan.config.pipeline import SCHEDULES

# Absolute on losses (near 8.3) and relative (to the largest entry) on gradients; float32 and float64.
TOLERANCES = {"float32": 1e-5, "float64": 1e-10}
TOLERANCE = TOLERANCES["float32"]
FLOAT64_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")
MODEL = {"n_layers": 4}
WINDOWS = 4  # per step: PP's microbatches, the others' gradient-accumulation micro steps
# Stages hold a layer each (Interleaved1F1B / LoopedBFS: 4 stages) or two (GPipe / 1F1B: 2 stages).
SPLIT = {"pipeline_parallel_first_stage_less_layers": 0, "pipeline_parallel_last_stage_less_layers": 0}


def _relative(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def _dtype(dtype: str) -> contextlib.AbstractContextManager:
    from harness import float64

    return float64() if dtype == "float64" else contextlib.nullcontext()


def _reference(tmp, dtype: str) -> tuple[dict, dict[int, float], dict[str, torch.Tensor]]:
    """A seed checkpoint in `dtype` every run starts from, and CP = 1's losses and first gradients."""
    from harness import single_rank, tiny_job, train

    with single_rank(), _dtype(dtype):
        train(tiny_job(tmp / "seed", model=MODEL, checkpoint={"enable": True, "create_seed_checkpoint": True}),
              seed_checkpoint=True)  # fmt: skip
    seed = {"enable": True, "initial_load_path": str(tmp / "seed/checkpoint/step-0")}
    grads: dict[str, torch.Tensor] = {}
    with single_rank(), _dtype(dtype):
        losses = train(tiny_job(tmp / "cp1", model=MODEL, checkpoint=seed, training={"global_batch_size": WINDOWS}),
                       first_grads=grads)  # fmt: skip
    assert len(losses) == 4 and len(grads) == 4 * 7 + 3  # 4 blocks of 7 parameters, embedding, norm, lm_head
    assert {g.dtype for g in grads.values()} == {getattr(torch, dtype)}
    return seed, losses, grads


@pytest.fixture(scope="module")
def cp1(tmp_path_factory) -> tuple[dict, dict[int, float], dict[str, torch.Tensor]]:
    """The float32 seed checkpoint, and CP = 1's losses and first gradients from it."""
    return _reference(tmp_path_factory.mktemp("pp"), "float32")


@pytest.fixture(scope="module")
def float64_references(tmp_path_factory, gloo_pool) -> tuple[dict, list[tuple[dict, dict]]]:
    """The float64 seed checkpoint, and the (losses, first gradients) of CP 1 and of CP 2 from it."""
    from harness import tiny_job

    tmp = tmp_path_factory.mktemp("pp64")
    seed, losses, grads = _reference(tmp, "float64")
    cfg = tiny_job(tmp / "cp2", model=MODEL, checkpoint=seed, parallelism={"context_parallel_degree": 2},
                   training={"global_batch_size": WINDOWS})  # fmt: skip
    runs = gloo_pool(2).run(_train_rank, (cfg, "float64"))
    for name, grad in runs[0][1].items():
        assert torch.equal(runs[1][1][name], grad), name  # the CP ranks' gathered gradients agree
    return seed, [(losses, grads), (runs[0][0], runs[0][1])]


def _assert_losses(losses: dict[int, float], ref: dict[int, float], tolerance: float = TOLERANCE) -> float:
    assert losses.keys() == ref.keys()
    worst = max(abs(losses[s] - ref[s]) for s in ref)
    assert worst <= tolerance, (losses, ref)
    return worst


def _assert_grads(grads: dict[str, torch.Tensor], ref_grads: dict[str, torch.Tensor],
                  tolerance: float = TOLERANCE) -> float:  # fmt: skip
    assert grads.keys() == ref_grads.keys()
    for name, grad in ref_grads.items():
        assert grads[name].dtype == grad.dtype and _relative(grads[name], grad) <= tolerance, name
    return max(_relative(grads[name], grad) for name, grad in ref_grads.items())


@pytest.mark.slow
def test_cp2_reproduces_cp1(tmp_path, gloo_pool, cp1):
    """The reference the pipelines are also held to: CP 2 with four micro steps a step."""
    from harness import tiny_job

    seed, losses, grads = cp1
    cfg = tiny_job(tmp_path / "cp2", model=MODEL, checkpoint=seed, parallelism={"context_parallel_degree": 2},
                   training={"global_batch_size": WINDOWS})  # fmt: skip
    for rank_losses, rank_grads, _, _ in gloo_pool(2).run(_train_rank, (cfg,)):
        _assert_losses(rank_losses, losses)
        _assert_grads(rank_grads, grads)


@pytest.mark.parametrize("schedule", [s if s in ("1F1B", "Interleaved1F1B") else pytest.param(s, marks=pytest.mark.slow)
                                      for s in SCHEDULES])
def test_pp2_x_cp2_reproduces_cp1(tmp_path, gloo_pool, cp1, schedule):
    """PP 2 x CP 2: the last stage's losses and the union of the stages' gradients are CP = 1's
    (and so CP 2's, the test above); every rank planned the step's four windows, all different."""
    seed, losses, grads = cp1
    pp_losses, pp_grads = _pipelined(tmp_path, gloo_pool, seed, schedule, "float32")
    _assert_losses(pp_losses, losses)
    _assert_grads(pp_grads, grads)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", FLOAT64_SCHEDULES)
def test_pp2_x_cp2_reproduces_cp2_and_cp1_in_float64(tmp_path, gloo_pool, float64_references, schedule):
    """The same in float64, where the runs differ only in summation order: PP 2 x CP 2's losses and
    gradients are CP 2's and CP 1's to 1e-10."""
    seed, references = float64_references
    pp_losses, pp_grads = _pipelined(tmp_path, gloo_pool, seed, schedule, "float64")
    for (losses, grads), name in zip(references, ("cp1", "cp2"), strict=True):
        worst = _assert_losses(pp_losses, losses, TOLERANCES["float64"]), \
            _assert_grads(pp_grads, grads, TOLERANCES["float64"])  # fmt: skip
        print(f"float64 {schedule} vs {name}: losses {worst[0]:.2e}, gradients (relative) {worst[1]:.2e}")


def _pipelined(tmp_path, gloo_pool, seed: dict, schedule: str, dtype: str) -> tuple[dict[int, float], dict]:
    """PP 2 x CP 2 under `schedule` from `seed`: the last stage's losses and the union of the stages'
    first gradients, after checking that every rank planned the step's four windows, all different."""
    from harness import tiny_job

    parallelism = {"context_parallel_degree": 2, "pipeline_parallel_degree": 2,
                   "pipeline_parallel_schedule": schedule, **SPLIT}  # fmt: skip
    cfg = tiny_job(tmp_path / "pp", model=MODEL, checkpoint=seed, parallelism=parallelism,
                   training={"local_batch_size": WINDOWS})  # fmt: skip
    runs = gloo_pool(4).run(_train_rank, (cfg, dtype))
    stage_grads: dict[str, torch.Tensor] = {}
    assert sum(last for _, _, last, _ in runs) == 2  # one PP rank (2 CP ranks) holds the last stage
    for rank_losses, rank_grads, last, windows in runs:
        assert windows == runs[0][3] and len(windows) == 4 * WINDOWS  # every rank read and planned the same windows
        assert len(set(windows[:WINDOWS])) == WINDOWS  # the step's microbatches differ, and so do their plans
        if last:
            losses = rank_losses
        for name, grad in rank_grads.items():
            assert name not in stage_grads or torch.equal(stage_grads[name], grad), name  # CP ranks agree
            stage_grads[name] = grad
    return losses, stage_grads


def _train_rank(rank: int, group: Any, cfg: dict, dtype: str = "float32") -> tuple[dict[int, float],
                dict[str, torch.Tensor], bool, list]:  # fmt: skip
    """A pool rank's losses, first gradients (of the stages it holds), whether it holds the last stage, and
    each window it planned (its documents' lengths), with no CP step left registered after the run."""
    from flashcp.attention.op import live_entries
    from flashcp.titan.trainer import FlashCPTrainer
    from harness import train_on_pool_rank

    window_inputs, windows, last = FlashCPTrainer.window_inputs, [], []

    def recording(self: FlashCPTrainer, batch: dict[str, Any]) -> Any:
        windows.append(tuple(int(n) for n in batch["doc_lens"]))
        last[:] = [not self.parallel_dims.pp_enabled or self.pp_has_last_stage]
        return window_inputs(self, batch)

    grads: dict[str, torch.Tensor] = {}
    gc.collect()  # a step lives while its key does: objects in cycles hold keys until a collection
    start = live_entries()[0]  # the pool's worker may hold an earlier test's steps
    FlashCPTrainer.window_inputs = recording
    try:
        with _dtype(dtype):
            losses = train_on_pool_rank(rank, group, cfg, first_grads=grads)
    finally:
        FlashCPTrainer.window_inputs = window_inputs
    gc.collect()
    assert live_entries()[0] == start  # each microbatch's step released once its backward ran
    return losses, grads, last[0], windows


@pytest.mark.slow
def test_debug_pp_cpu_reproduces_its_run_without_pp(tmp_path, gloo_pool):
    """train_configs/debug_pp_cpu.toml's 20 steps (fp32, 4 windows a step through 1F1B) give the losses of
    the same job without PP: CP 2 on 2 ranks, the four windows as gradient-accumulation micro steps."""
    from harness import single_rank, train

    from flashcp.titan.config import resolve_config_path, validate

    job = tomllib.loads(resolve_config_path("debug_pp_cpu").read_text())
    pp = {name: job["parallelism"].pop(name) for name in list(job["parallelism"]) if name.startswith("pipeline_")}
    job["training"].update(local_batch_size=1, global_batch_size=WINDOWS)  # without PP: 4 micro steps

    def variant(name: str, **sections: dict[str, Any]) -> dict:
        raw = {section: dict(values) for section, values in job.items()}
        raw["job"]["dump_folder"] = str(tmp_path / name)
        for section, values in sections.items():
            raw[section] = raw.get(section, {}) | values
        return validate(raw)

    with single_rank():
        train(variant("seed", checkpoint={"create_seed_checkpoint": True},
                      parallelism={"context_parallel_degree": 1}), seed_checkpoint=True)  # fmt: skip
    seed = {"initial_load_path": str(tmp_path / "seed/checkpoint/step-0")}
    runs = gloo_pool(2).run(_train_rank, (variant("cp2", checkpoint=seed),))
    piped = variant("pp2", checkpoint=seed, parallelism=pp, training={"local_batch_size": WINDOWS, "global_batch_size": -1})
    pp_runs = gloo_pool(4).run(_train_rank, (piped,))
    reference = runs[0][0]
    assert len(reference) == 20
    for losses, _, last, _ in pp_runs:
        if last:
            _assert_losses(losses, reference)
