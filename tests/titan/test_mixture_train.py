"""A data mixture through the trainer: a run resumed from its checkpoint trains exactly what an
uninterrupted run trains, and TensorBoard gets every source's tokens, per step and so far, from the
first step (the mixer and the loader's counts themselves are tests/data/test_mixture.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from harness import single_rank, tiny_job, train


@pytest.fixture
def rank():
    with single_rank():
        yield


def mixed_job(dump: Path, lengths: Path) -> dict:
    """Long synthetic documents (kept from 300 tokens on) for 40 % of the tokens, short ones for 60 %."""
    (lengths / "long.json").write_text(json.dumps([200, 350, 500, 700]))
    (lengths / "short.json").write_text(json.dumps([8, 20, 40, 90]))
    mix = {"long": {"source": "synthetic", "synthetic_lengths": str(lengths / "long.json"), "weight": 0.4,
                    "min_tokens": 300},
           "short": {"source": "synthetic", "synthetic_lengths": str(lengths / "short.json"), "weight": 0.6}}  # fmt: skip
    # The default balance (deferral-cut): documents wait for later steps, and count where they train.
    return tiny_job(dump, data={"mix": mix}, training={"steps": 4, "global_batch_size": 2},
                    checkpoint={"enable": True, "interval": 2}, metrics={"enable_tensorboard": True})  # fmt: skip


def scalars(dump: Path) -> dict[str, dict[int, float]]:
    events = EventAccumulator(str(dump / "tb" / "run"))
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def test_a_mixture_resumes_exactly_from_a_checkpoint_and_logs_tokens_per_source(tmp_path, rank):
    whole = train(mixed_job(tmp_path / "whole", tmp_path))
    dump = tmp_path / "run"
    train(mixed_job(dump, tmp_path), stop_after=2)
    resumed = train(mixed_job(dump, tmp_path))
    assert resumed == {s: whole[s] for s in (3, 4)}
    tb, tb_whole = scalars(dump), scalars(tmp_path / "whole")
    names, per_step = ("long", "short"), 2 * 256  # 2 windows of 256 tokens a step
    for tag in [f"data/{kind}/{name}" for kind in ("tokens", "step_token_share") for name in names]:
        assert sorted(tb[tag]) == list(range(1, 5))
        assert tb[tag] == tb_whole[tag]  # the counts resumed too
    tokens = {name: {0: 0.0, **tb[f"data/tokens/{name}"]} for name in names}
    for step in range(1, 5):  # every token trained so far; each step's shares are of its own tokens
        assert sum(tokens[name][step] for name in names) == step * per_step
        for name in names:
            added = tokens[name][step] - tokens[name][step - 1]
            assert tb[f"data/step_token_share/{name}"][step] * per_step == pytest.approx(added, abs=1e-3)
    assert abs(tb["data/token_share/long"][4] - 0.4) <= 700 / (4 * per_step)  # within a document
