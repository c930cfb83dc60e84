"""`flashcp::cp_attention` with a sliding window (the step dispatch's) and learned sinks.

The op must be `cp_varlen_attention(..., window=W, sinks=...)` for every exchange that runs
windows, eagerly (bit for bit) and under torch.compile (aot_eager for every exchange, one graph
for all of them; inductor once, with q and the sinks computed in the graph so that its buffer
reuse would show): the output and the gradients of q, k, v and the sinks. Both are held to the
dense float64 oracle (tests/dense_attention.py, 1e-10). The sinks' gradient is each rank's
share; summed over the ranks, as the trainer's FSDP over dp_shard x cp sums it, it is the
oracle's. All CP ranks run in this process (flashcp.attention.simulate), and nothing the op
registers outlives its step.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch._dynamo.testing
from dense_attention import dense_attention

from flashcp import plan_shards
from flashcp.attention import BackendUnavailable, build_two_level_dispatch, cp_varlen_attention
from flashcp.attention.op import cp_attention, live_entries, step_key
from flashcp.attention.ring import build_ring_dispatch
from flashcp.attention.simulate import run_ranks
from flashcp.dispatch import build_dispatch, COMM_MODES

TOL = dict(rtol=1e-10, atol=1e-12)
DOC_LENS = [37, 2, 11, 5, 1, 23, 9, 7, 1]  # 96 tokens: documents cut across the ranks and whole ones
HEADS = (4, 2, 8)  # GQA: Hq, Hkv, D
WINDOW = 6  # shorter than the cut documents, longer than the short ones
EXCHANGES = (*COMM_MODES, "two_level")
NAMES = ("out", "dq", "dk", "dv", "dsinks")


def _tensors() -> list[torch.Tensor]:
    """q, k, v, sinks and the output's gradient, float64, in window order."""
    hq, hkv, d = HEADS
    g = torch.Generator().manual_seed(0)
    shapes = [(96, hq, d), (96, hkv, d), (96, hkv, d), (hq,), (96, hq, d)]
    return [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]


def _dispatches(comm: str, overlap: bool = False) -> list:
    plan = plan_shards(DOC_LENS, 2, "flashcp")
    if comm == "two_level":  # two nodes of one rank: every piece crosses the fabric
        return [build_two_level_dispatch(plan, r, 1, overlap, WINDOW) for r in range(2)]
    return [build_dispatch(plan, r, comm, overlap=overlap, window=WINDOW) for r in range(2)]


def _run(dispatches: list, attend) -> list[torch.Tensor]:
    """Output, dq, dk, dv in window order and dsinks summed over the ranks, of
    `attend(q, k, v, sinks, dispatch, group)` on every rank."""
    q, k, v, sinks, grad = _tensors()

    def program(rank, group):
        d = dispatches[rank]
        leaves = [t[d.token_index].clone().requires_grad_() for t in (q, k, v)] + [sinks.clone().requires_grad_()]
        out = attend(*leaves, d, group)
        out.backward(grad[d.token_index])
        return d.token_index, out.detach(), *(t.grad for t in leaves)

    got = [torch.zeros_like(t) for t in (q, q, k, v, sinks)]
    for idx, *tensors in run_ranks(len(dispatches), program):
        for full, part in zip(got[:4], tensors):
            full[idx] = part
        got[4] += tensors[4]
    return got


def _dense(pre: float = 1.0) -> list[torch.Tensor]:
    """The oracle's output and gradients of `dense(q * pre, k, v, sinks * pre)`."""
    q, k, v, sinks, grad = _tensors()
    leaves = [t.requires_grad_() for t in (q, k, v, sinks)]
    out = dense_attention(q * pre, k, v, DOC_LENS, WINDOW, sinks * pre)
    return [out.detach(), *torch.autograd.grad(out, leaves, grad)]


def _engine(comm: str, overlap: bool = False, pre: float = 1.0):
    def attend(q, k, v, sinks, d, group):
        return cp_varlen_attention(q * pre, k, v, d, group, comm, "reference", overlap=overlap, window=WINDOW,
                                   sinks=sinks * pre)  # fmt: skip

    return attend


def _assert_close(got: list, want: list, what: str) -> None:
    for name, a, b in zip(NAMES, got, want):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"{what} {name}: {m}")


@pytest.mark.parametrize("comm", EXCHANGES)
@pytest.mark.parametrize("overlap", [False, True])
def test_eager_op_is_the_engine_bit_for_bit_and_matches_dense(comm, overlap):
    start = live_entries()

    def op(q, k, v, sinks, d, group):
        return cp_attention(q, k, v, step_key(d, group), "reference", overlap=overlap, sinks=sinks)

    dispatches = _dispatches(comm, overlap)
    want, got = _run(dispatches, _engine(comm, overlap)), _run(dispatches, op)
    for name, a, b in zip(NAMES, want, got):
        assert torch.equal(a, b), (comm, overlap, name)
    _assert_close(got, _dense(), f"{comm} overlap={overlap}")
    gc.collect()
    assert live_entries() == start


def _compiled_op(backend: str, pre: float):
    """A compiled block around the op (q and the sinks scaled inside the graph), and its frame counter."""
    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)

    @torch.compile(backend=counter, fullgraph=True)
    def block(q, k, v, sinks, key):
        return cp_attention(q * pre, k, v, key, "reference", sinks=sinks * pre)

    return (lambda q, k, v, sinks, d, group: block(q, k, v, sinks, step_key(d, group))), counter


def test_compiled_op_matches_the_engine_with_one_graph_for_every_exchange():
    start = live_entries()
    attend, counter = _compiled_op("aot_eager", 2.0)
    want = _dense(2.0)
    for comm in EXCHANGES:
        dispatches = _dispatches(comm)
        got = _run(dispatches, attend)
        _assert_close(got, _run(dispatches, _engine(comm, pre=2.0)), f"aot_eager {comm} vs engine")
        _assert_close(got, want, f"aot_eager {comm} vs dense")
    assert counter.frame_count == 1
    gc.collect()
    assert live_entries() == start


def test_inductor_op_matches_dense():
    start = live_entries()
    attend, counter = _compiled_op("inductor", 2.0)
    _assert_close(_run(_dispatches("compact"), attend), _dense(2.0), "inductor compact")
    assert counter.frame_count == 1
    gc.collect()
    assert live_entries() == start


def test_sinks_on_an_exchange_or_backend_without_them_are_refused():
    plan = plan_shards([8, 8], 1, "per_doc")
    t, sinks = torch.zeros(16, 2, 4), torch.zeros(2)
    with pytest.raises(BackendUnavailable, match="'flash_attn' has no .*sinks runs on torch, reference"):
        cp_attention(t, t, t, step_key(build_dispatch(plan, 0, window=4)), "flash_attn", sinks=sinks)
    with pytest.raises(ValueError, match="comm='ring' takes no sinks"):
        cp_attention(t, t, t, step_key(build_ring_dispatch(plan, 0)), "reference", sinks=sinks)
