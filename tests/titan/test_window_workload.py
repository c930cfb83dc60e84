"""The planner balances what a job's model computes: a gpt-oss job's loader plans with its full and
sliding-window layers counted apart (`planner_workload`), every other model with causal pairs as before."""

from __future__ import annotations

import pytest
import transformers
from harness import tiny_job

from flashcp.plan import CAUSAL, Workload
from flashcp.titan.launch.job import trainer_config
from test_gpt_oss_oracle import TRAIN_CONFIG


def _planner(cfg: dict) -> dict:
    return trainer_config(cfg).dataloader.planner


def test_a_gpt_oss_job_plans_its_window_layers_apart(tmp_path):
    folder = tmp_path / "model"
    layers = ["sliding_attention", "full_attention", "sliding_attention"]
    transformers.GptOssConfig(**TRAIN_CONFIG | {"num_hidden_layers": 3, "layer_types": layers}).save_pretrained(folder)
    planner = _planner(tiny_job(tmp_path / "run", ("model",), model={"hf_config": str(folder)}))
    assert planner["workload"] == Workload(full_layers=1, window_layers=2, window=TRAIN_CONFIG["sliding_window"])


def test_a_model_without_window_layers_plans_causal_pairs(tmp_path):
    assert _planner(tiny_job(tmp_path / "run"))["workload"] is CAUSAL


@pytest.mark.parametrize("strategy", ["per_doc", "ring"])
def test_every_strategy_takes_the_workload(tmp_path, strategy):
    """Fixed-grid strategies ignore it, as they ignore target_imbalance; the plan still reports it."""
    from flashcp.plan import plan_shards

    workload = Workload(full_layers=1, window_layers=1, window=4)
    plan = plan_shards([7, 9], 2, strategy, workload=workload)
    assert plan.workload == workload
