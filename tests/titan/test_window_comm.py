"""`[flashcp] window_comm`: sliding-window layers choose their own K/V exchange.

The config's default and its one-line refusals; the trainer's dispatcher building the full layers'
dispatch with `comm` and the window layers' with `window_exchange(comm, window_comm)`, checked by
each dispatch's comm and receive size against `flashcp.plan`'s independent counts."""

from __future__ import annotations

import pickle
from types import SimpleNamespace as NS

import pytest
import torch
from harness import tiny_job

from flashcp import plan_shards
from flashcp.plan import Workload
from flashcp.plan.window import window_recv_tokens
from flashcp.titan.config import ConfigError
from flashcp.titan.models.windows import LayerDispatches
from flashcp.titan.trainer import FlashCPTrainer

W = 128
LENS = [3000] * 5 + [1384]  # five documents longer than a rank's 2048 tokens on 8 ranks: most are cut


def test_the_default_is_auto(tmp_path):
    assert tiny_job(tmp_path)["flashcp"]["window_comm"] == "auto"
    told = tiny_job(tmp_path, flashcp={"comm": "two_level", "window_comm": "compact"})
    assert told["flashcp"]["window_comm"] == "compact"


@pytest.mark.parametrize(
    "flashcp, message",
    [
        ({"window_comm": "halo"}, "[flashcp] window_comm must be one of auto, full, compact, needed, two_level; "
                                  "got 'halo'"),
        ({"window_comm": 1}, "[flashcp] window_comm must be a string, got 1 (int)"),
        ({"window_comm": "two_level"}, "[flashcp] window_comm = 'two_level' needs comm = 'two_level' (the node layout "
                                       "it routes by), got comm = 'compact'"),
        ({"comm": "ring", "window_comm": "needed"}, "[flashcp] window_comm = 'needed' has no effect with comm = "
                                                    "'ring': only a collective comm uses it; remove it or choose "
                                                    "that mode"),
    ],
)  # fmt: skip
def test_bad_values_are_refused_in_one_line(tmp_path, flashcp, message):
    with pytest.raises(ConfigError) as e:
        tiny_job(tmp_path, flashcp=flashcp)
    assert str(e.value) == message


def _dispatcher(rank: int, comm: str, window_comm: str = "auto", ranks_per_node: int = 0):
    """The trainer's `window_dispatcher()` for CP rank `rank` of a model with one sliding window W."""
    trainer = object.__new__(FlashCPTrainer)
    trainer.flashcp = NS(comm=comm, window_comm=window_comm, overlap=False)
    trainer.cp_rank, trainer.cp_ranks_per_node, trainer._flashcp_windows = rank, ranks_per_node, (W,)
    trainer._flashcp_conv_width = 0  # no Gated DeltaNet layers (Qwen3.5's dispatch, read first where present)
    return trainer.window_dispatcher()


def _plan(cp: int = 8):
    return plan_shards(LENS, cp, "flashcp", workload=Workload(1, 1, W))


@pytest.mark.parametrize("comm", ["compact", "full", "needed"])
def test_auto_window_layers_run_the_needed_exchange(comm):
    """Beside compact, full and needed full layers the window layers receive exactly the rows their
    windows reach (`window_needed_tokens`), fewer than a window layer's compact all-gather here."""
    plan = _plan()
    needed = window_recv_tokens(plan, W, "needed")
    assert max(needed) < max(window_recv_tokens(plan, W, "compact"))
    for rank in range(plan.cp_size):
        dispatches = _dispatcher(rank, comm)(plan)
        assert isinstance(dispatches, LayerDispatches) and set(dispatches.windows) == {W}
        full, window = dispatches.full, dispatches.windows[W]
        assert (full.comm, full.window, window.comm, window.window) == (comm, None, "needed", W)
        assert window.recv_size == needed[rank]
    assert pickle.loads(pickle.dumps(_dispatcher(0, comm)))(plan).windows[W].comm == "needed"  # the plan worker's


def test_an_explicit_window_comm_is_used_as_given():
    """window_comm = "compact" beside compact full layers: the window layers all-gather the last W - 1
    rows of every non-last shard, padded to the busiest sender (`window_send_tokens`); the full layers'
    dispatch is the same as under auto."""
    plan = _plan()
    compact = window_recv_tokens(plan, W, "compact")
    for rank in range(plan.cp_size):
        told, auto = _dispatcher(rank, "compact", "compact")(plan), _dispatcher(rank, "compact")(plan)
        window = told.windows[W]
        assert (told.full.comm, window.comm) == ("compact", "compact")
        assert window.recv_size - window.send_pad == compact[rank]  # N segments of send_pad, this rank's own among them
        assert torch.equal(told.full.kv_index, auto.full.kv_index) and told.full.recv_size == auto.full.recv_size


@pytest.mark.parametrize("window_comm, expected", [("auto", "two_level"), ("needed", "needed")])
def test_two_level_jobs_window_layers(window_comm, expected):
    """A two_level job (nodes of 2 CP ranks): auto keeps the window layers on two_level, which delivers
    the rows the windows reach, as the needed exchange does."""
    plan = _plan(4)
    needed = window_recv_tokens(plan, W, "needed")
    for rank in range(4):
        dispatches = _dispatcher(rank, "two_level", window_comm, ranks_per_node=2)(plan)
        assert (dispatches.full.comm, dispatches.windows[W].comm) == ("two_level", expected)
        assert dispatches.windows[W].recv_size == needed[rank]
