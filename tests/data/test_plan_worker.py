"""Planning and dispatching in a worker process gives the loader the same batches as its thread."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from flashcp.data.loader import build_loader
from flashcp.data.sources import DataConfig
from flashcp.dispatch import build_dispatch


def batches(worker: bool, prefetch: int, count: int = 4) -> list[dict]:
    cfg = DataConfig(source="synthetic", synthetic_lengths="pile", seed=3, prefetch=prefetch)
    planner = {"strategy": "flashcp", "target_imbalance": 1.02}
    loader = build_loader(cfg, 16384, 0, 2, 8, planner_kwargs=planner)
    dispatcher = functools.partial(build_dispatch, rank=5, comm="needed", overlap=True)
    loader.dispatch_with(dispatcher, worker=worker)
    with loader:
        return [next(loader) for _ in range(count)]


def same_dispatch(a, b) -> bool:
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            if x.dtype != y.dtype or not torch.equal(x, y):
                return False
        elif dataclasses.is_dataclass(x):
            if not same_dispatch(x, y):
                return False
        elif x != y:
            return False
    return True


@pytest.mark.parametrize("prefetch", [0, 2])
def test_worker_gives_the_same_plans_and_dispatches(prefetch: int) -> None:
    here, there = batches(False, prefetch), batches(True, prefetch)
    for a, b in zip(here, there):
        assert torch.equal(a["input"], b["input"]) and a["doc_lens"] == b["doc_lens"]
        assert a["plan"] == b["plan"] and a["plan"].info == b["plan"].info
        assert same_dispatch(a["dispatch"], b["dispatch"])


def test_worker_errors_reach_the_caller() -> None:
    """An exception in the worker (here: a rank outside the CP group) is raised by next()."""
    cfg = DataConfig(source="synthetic", synthetic_lengths="pile", prefetch=2)
    loader = build_loader(cfg, 4096, 0, 1, 4, planner_kwargs={"strategy": "flashcp"})
    loader.dispatch_with(functools.partial(build_dispatch, rank=4, comm="compact"), worker=True)
    with loader, pytest.raises(ValueError, match="rank 4 out of range"):
        next(loader)
