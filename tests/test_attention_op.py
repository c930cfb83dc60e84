"""`flashcp::cp_attention` (flashcp.attention.op) is `cp_varlen_attention`, bit for bit, forward and
backward, for every KV exchange with and without overlap; it keeps nothing after its step: no
forward graph under no_grad, none after the backward, none when activation checkpointing drops
the forward's, and a step key released too early is an error that says so. All CP ranks run in
this process (flashcp.attention.simulate)."""

from __future__ import annotations

import gc

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from flashcp import plan_shards
from flashcp.attention import cp_varlen_attention, record_comm
from flashcp.attention.op import cp_attention, launch_exchange_ahead, live_entries, step_key
from flashcp.attention.ring import build_ring_dispatch
from flashcp.attention.simulate import run_ranks
from flashcp.dispatch import build_dispatch, COMM_MODES

DOC_LENS = [61, 3, 1, 27, 9, 1, 40, 18, 4]  # 164 tokens
HEADS = (4, 2, 8)  # GQA: Hq, Hkv, D


def _window(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hq, hkv, d = HEADS
    return [torch.randn(sum(DOC_LENS), h, d, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv, hq)]


def _run(comm: str, overlap: bool, attend, scale: float | None = None) -> list[tuple[torch.Tensor, ...]]:
    """Every rank's output and dq, dk, dv of `attend(q, k, v, dispatch, group)` over one window."""
    plan = plan_shards(DOC_LENS, 2, "flashcp")
    dispatches = [build_dispatch(plan, r, comm, overlap=overlap) for r in range(2)]
    window = _window()

    def program(rank, group):
        d = dispatches[rank]
        q, k, v = (t[d.token_index].clone().requires_grad_() for t in window[:3])
        out = attend(q, k, v, d, group)
        out.backward(window[3][d.token_index])
        return out.detach(), q.grad, k.grad, v.grad

    return run_ranks(2, program)


def _same_results(want: list[tuple[torch.Tensor, ...]], got: list[tuple[torch.Tensor, ...]], *case) -> None:
    for rank_want, rank_got in zip(want, got, strict=True):
        for name, a, b in zip(("out", "dq", "dk", "dv"), rank_want, rank_got):
            assert torch.equal(a, b), (*case, name)


def _one_rank():
    """A compact dispatch of the window on one rank, and its q, k, v and output gradient in its order."""
    d = build_dispatch(plan_shards(DOC_LENS, 1, "flashcp"), 0, "compact")
    return d, *(t[d.token_index] for t in _window())


@pytest.mark.parametrize("comm", COMM_MODES)
@pytest.mark.parametrize("overlap", [False, True])
def test_the_op_is_cp_varlen_attention_bit_for_bit(comm, overlap):
    def eager(q, k, v, d, group):
        return cp_varlen_attention(q, k, v, d, group, comm=comm, backend="reference", overlap=overlap,
                                   softmax_scale=0.3)  # fmt: skip

    def op(q, k, v, d, group):
        return cp_attention(q, k, v, step_key(d, group), "reference", overlap=overlap, softmax_scale=0.3)

    with record_comm() as eager_log:
        want = _run(comm, overlap, eager)
    with record_comm() as op_log:
        got = _run(comm, overlap, op)
    _same_results(want, got, comm, overlap)
    assert op_log == eager_log  # the same collectives: no second exchange, no recompute
    gc.collect()
    assert live_entries() == (0, 0, 0)


@pytest.mark.parametrize("comm", [c for c in COMM_MODES if c != "ring"])
@pytest.mark.parametrize("overlap", [False, True])
def test_an_exchange_launched_ahead_gives_the_ops_results_bit_for_bit(comm, overlap):
    """`launch_exchange_ahead` then `cp_attention(exchange=)`: the op's output and gradients and the same
    collectives, and the exchange is gone once consumed."""
    def op(q, k, v, d, group):
        return cp_attention(q, k, v, step_key(d, group), "reference", overlap=overlap, softmax_scale=0.3)

    def ahead(q, k, v, d, group):
        key = step_key(d, group)
        exchange = launch_exchange_ahead(k.detach(), v.detach(), key)
        assert live_entries()[2] >= 1
        return cp_attention(q, k, v, key, "reference", overlap=overlap, softmax_scale=0.3, exchange=exchange)

    with record_comm() as op_log:
        want = _run(comm, overlap, op)
    with record_comm() as ahead_log:
        got = _run(comm, overlap, ahead)
    _same_results(want, got, comm, overlap)
    assert ahead_log == op_log
    gc.collect()
    assert live_entries() == (0, 0, 0)


def test_an_exchange_launched_ahead_is_refused_when_it_does_not_fit():
    d, q, k, v, _ = _one_rank()
    key = step_key(d)
    exchange = launch_exchange_ahead(k, v, key)
    cp_attention(q, k, v, key, "reference", exchange=exchange)
    with pytest.raises(RuntimeError, match="exchange launched ahead was consumed"):
        cp_attention(q, k, v, key, "reference", exchange=exchange)  # one exchange, one call
    with pytest.raises(ValueError, match=r"holds \(164, 32\) rows x widths, this call's would hold \(164, 64\)"):
        cp_attention(q, torch.cat([k, k], 1), torch.cat([v, v], 1), key, "reference",
                     exchange=launch_exchange_ahead(k, v, key))  # fmt: skip
    ring = step_key(build_ring_dispatch(plan_shards(DOC_LENS, 2, "flashcp"), 0))
    with pytest.raises(ValueError, match="comm='ring' passes K/V blocks around the ring"):
        launch_exchange_ahead(k, v, ring)
    del key, ring, exchange
    gc.collect()
    assert live_entries() == (0, 0, 0)


def test_no_grad_keeps_no_graph_and_checkpointing_drops_the_forwards():
    d, q, k, v, g = _one_rank()
    key = step_key(d)
    with torch.no_grad():
        cp_attention(q, k, v, key, "reference")
    assert live_entries() == (1, 0, 0)  # the step, no forward graph

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = cp_attention(*leaves, key, "reference")
    assert live_entries() == (1, 1, 0)
    out.backward(g)
    assert live_entries() == (1, 0, 0)  # the backward consumed it
    plain = [t.grad for t in leaves]

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = checkpoint(lambda *qkv: cp_attention(*qkv, key, "reference"), *leaves, use_reentrant=False)
    assert live_entries() == (1, 0, 0)  # the forward's graph went with its unsaved handle
    out.backward(g)  # recomputes the op, whose graph the backward then uses and drops
    assert live_entries() == (1, 0, 0)
    assert all(torch.equal(t.grad, p) for t, p in zip(leaves, plain))
    del key
    gc.collect()
    assert live_entries() == (0, 0, 0)


def test_a_released_step_key_is_an_error_naming_it():
    d, q, k, v, _ = _one_rank()
    key = step_key(d)
    stale = torch.tensor(int(key))  # the same number, but not the registered tensor
    del key
    gc.collect()
    with pytest.raises(RuntimeError, match="step key was released"):
        cp_attention(q, k, v, stale, "reference")
