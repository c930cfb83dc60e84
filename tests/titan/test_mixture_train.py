"""A data mixture through the trainer: a run resumed from its checkpoint trains exactly what an
uninterrupted run trains, and TensorBoard gets every source's tokens (the mixer itself is
tests/data/test_mixture.py)."""

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
    # Stream order (balance off): the tokens logged are then exactly the documents the trained windows
    # reached. Deferral's queue runs the stream ahead of training by the documents waiting (at most
    # max_delay_steps steps, docs/data.md "Mixtures"); its exact resume with a mixture is tested in
    # test_mixture.py.
    return tiny_job(dump, data={"mix": mix, "balance": "off"}, training={"steps": 4, "global_batch_size": 2},
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
    for name in ("long", "short"):
        assert sorted(tb[f"data/tokens/{name}"]) == list(range(1, 5))
        assert tb[f"data/tokens/{name}"] == tb_whole[f"data/tokens/{name}"]  # the mixer resumed too
    tokens = {name: tb[f"data/tokens/{name}"][4] for name in ("long", "short")}
    # The documents the stream passed, up to the one the last window cut: 4 steps of 2 windows of 256.
    assert 4 * 2 * 256 - 700 < sum(tokens.values()) <= 4 * 2 * 256
    assert abs(tb["data/token_share/long"][4] - 0.4) <= 700 / sum(tokens.values())  # within a document
