"""Pipeline parallelism's settings refused before launch, one line each naming the problem
(the runs themselves: test_pp_train.py; debug_pp_cpu through run_train.sh: test_pp_e2e.py)."""

from __future__ import annotations

import pytest
from harness import tiny_job

from flashcp.titan import compat
from flashcp.titan.config import ConfigError, resolve_config_path

PP = {"context_parallel_degree": 2, "pipeline_parallel_degree": 2}
CASES = [
    ("layers", {"model": {"n_layers": 2}, "parallelism": PP | {"pipeline_parallel_schedule": "Interleaved1F1B"},
                "training": {"local_batch_size": 4}},
     "[parallelism] pipeline_parallel_degree = 2 splits the model's 2 layers into 4 stages, and stage 0 holds none"),
    ("stages per rank", {"model": {"n_layers": 4}, "parallelism": PP | {"pipeline_parallel_layers_per_stage": 2},
                         "training": {"local_batch_size": 4}},
     "[parallelism] pipeline_parallel_degree = 2 cannot split the model's 4 layers: Number of virtual stages (3) "
     "must be divisible by pipeline parallel size (2)"),
    ("microbatches", {"parallelism": PP, "training": {"local_batch_size": 1}},
     "[training] local_batch_size (1, the pipeline's microbatches) must be >= its 2 stages for schedule '1F1B'"),
    ("interleaved rounds", {"model": {"n_layers": 4}, "parallelism": PP | {"pipeline_parallel_schedule": "Interleaved1F1B",
     "pipeline_parallel_first_stage_less_layers": 0, "pipeline_parallel_last_stage_less_layers": 0},
                            "training": {"local_batch_size": 5}},
     "[training] local_batch_size (5, the pipeline's microbatches) must be a multiple of 2"),
    ("microbatch size", {"parallelism": PP | {"pipeline_parallel_microbatch_size": 2}, "training": {"local_batch_size": 4}},
     "[parallelism] pipeline_parallel_microbatch_size must be 1 with FlashCP"),
    ("ring", {"parallelism": PP, "training": {"local_batch_size": 2}, "flashcp": {"comm": "ring"}},
     "[parallelism] pipeline_parallel_degree > 1 does not run with [flashcp] comm = 'ring'"),
    ("overlap", {"parallelism": PP, "training": {"local_batch_size": 2}, "flashcp": {"overlap": True}},
     "[parallelism] pipeline_parallel_degree > 1 does not run with [flashcp] overlap = true"),
    ("compiled zero bubble", {"model": {"n_layers": 4}, "parallelism": PP | {"pipeline_parallel_schedule": "ZBVZeroBubble",
     "pipeline_parallel_first_stage_less_layers": 0, "pipeline_parallel_last_stage_less_layers": 0},
                              "training": {"local_batch_size": 4}, "compile": {"enable": True, "components": ["model"]}},
     "[parallelism] pipeline_parallel_schedule = 'ZBVZeroBubble' does not run with [compile] enable"),
    ("tensor parallel GPipe", {"parallelism": PP | {"pipeline_parallel_schedule": "GPipe", "tensor_parallel_degree": 2},
                               "training": {"local_batch_size": 2}},
     "[parallelism] pipeline_parallel_schedule = 'GPipe' does not run with [parallelism] tensor_parallel_degree > 1"),
    ("hf import", {"parallelism": PP, "training": {"local_batch_size": 2},
                   "checkpoint": {"enable": True, "initial_load_in_hf": True, "initial_load_path": "/nonexistent"}},
     "[parallelism] pipeline_parallel_degree > 1 does not run with [checkpoint] initial_load_in_hf"),
    ("schedule", {"parallelism": PP | {"pipeline_parallel_schedule": "PipelineScheduleMulti"},
                  "training": {"local_batch_size": 2}},
     "[parallelism] pipeline_parallel_schedule = 'PipelineScheduleMulti': FlashCP runs GPipe, 1F1B,"),
    ("stray key", {"parallelism": {"pipeline_parallel_schedule": "GPipe"}},
     "[parallelism] pipeline_parallel_schedule only applies to pipeline parallelism"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "sections", "message"), CASES, ids=[c[0] for c in CASES])
def test_refused_in_one_line(tmp_path, case, sections, message):
    with pytest.raises(ConfigError) as e:
        tiny_job(tmp_path, **sections)
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


def test_tensor_parallelism_and_compile_are_accepted(tmp_path):
    """PP x TP x CP and a compiled PP x CP run (tests/titan/test_pp_tp.py): the check lets them through."""
    cfg = tiny_job(tmp_path, parallelism=PP | {"tensor_parallel_degree": 2}, training={"local_batch_size": 2},
                   compile={"enable": True, "components": ["model"]})  # fmt: skip
    assert cfg["parallelism"]["tensor_parallel_degree"] == 2 and cfg["compile"]["enable"]


def test_a_mixture_of_experts_model_is_accepted(tmp_path):
    """Qwen3-MoE with expert parallelism over a stage's CP ranks (PP 2 x CP 2 x EP 2 = the run without
    PP, routing biases and expert counts included: tests/titan/test_pp_moe.py): the check lets it through."""
    cfg = tiny_job(tmp_path, model={"name": "qwen3", "num_experts": 4, "num_experts_per_tok": 2, "moe_hidden_dim": 32},
                   parallelism=PP | {"expert_parallel_degree": 2}, training={"local_batch_size": 2})  # fmt: skip
    assert cfg["parallelism"]["pipeline_parallel_degree"] == 2 and cfg["parallelism"]["expert_parallel_degree"] == 2


def test_a_hybrid_model_is_refused(tmp_path):
    """Qwen3.5 (Gated DeltaNet): its linear layers' steps do not travel as pipeline kwargs yet."""
    hf = resolve_config_path("debug_hybrid_cpu").parent / "hf/tiny_qwen3_5"
    with pytest.raises(ConfigError, match=r"^\[parallelism\] pipeline_parallel_degree > 1 does not run with a qwen3_5"):
        tiny_job(tmp_path, ("model",), model={"hf_config": str(hf)}, parallelism=PP, training={"local_batch_size": 2})


def test_a_torch_that_cannot_pipeline_is_refused(tmp_path, monkeypatch):
    """torch < 2.13 (PipelineStage without get_mesh): one line naming the version, before any rank starts."""
    monkeypatch.setattr(compat, "pipeline_problem", lambda: "torch 2.11.0's PipelineStage takes no get_mesh")
    with pytest.raises(ConfigError, match=r"^\[parallelism\] pipeline_parallel_degree > 1 cannot run here: torch 2"):
        tiny_job(tmp_path, parallelism=PP, training={"local_batch_size": 2})


def test_this_torch_pipelines():
    assert compat.pipeline_problem() is None
