"""Sliding windows and learned sinks: the kernel, the window dispatch and its byte prediction.

The kernels (reference, float64) and the whole CP op (all ranks in one process through
`flashcp.attention.simulate`) are compared with `dense_attention`, a plain masked softmax with a
sink column built apart from every kernel: outputs and the gradients of q, k, v and the sinks
within 1e-10 (observed ~1e-14). The rows the op's exchange delivers must equal
`flashcp.plan.window`'s prediction, counted apart from the dispatch's tensors.
"""

from __future__ import annotations

import pytest
import torch
from dense_attention import dense_attention
from hypothesis import given, settings
from hypothesis import strategies as st

from flashcp import plan_shards
from flashcp.attention import (BackendUnavailable, build_two_level_dispatch, cp_varlen_attention, record_comm,
                               varlen_attention)
from flashcp.attention import kernels, reference
from flashcp.attention.ring import build_ring_dispatch
from flashcp.attention.simulate import run_ranks
from flashcp.attention.sinks import sink_attention
from flashcp.dispatch import build_dispatch, COMM_MODES
from flashcp.plan.window import window_recv_tokens

TOL = dict(rtol=1e-10, atol=1e-12)


def tensors(tokens: int, heads: tuple[int, int, int], seed: int) -> list[torch.Tensor]:
    """q, k, v, sinks and an output weight, float64."""
    hq, hkv, d = heads
    g = torch.Generator().manual_seed(seed)
    shapes = [(tokens, hq, d), (tokens, hkv, d), (tokens, hkv, d), (hq,), (tokens, hq, d)]
    return [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]


def oracle(doc_lens, heads, seed, window, with_sinks):
    """Output and gradients (q, k, v, then sinks if any) of the dense reference."""
    q, k, v, sinks, weight = tensors(sum(doc_lens), heads, seed)
    leaves = [t.requires_grad_() for t in (q, k, v, *([sinks] if with_sinks else []))]
    out = dense_attention(q, k, v, doc_lens, window, sinks if with_sinks else None)
    return [out.detach(), *torch.autograd.grad((out * weight).sum(), leaves)]


def assert_all_close(got, want, what: str) -> None:
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), got, want):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"{what} {name}: {m}")


# A 700-token document spans two 512-key tiles and six 128-query blocks: windows cut tiles on
# both sides; 1 and >= every document are the edges.
@pytest.mark.parametrize("with_sinks", [False, True], ids=["plain", "sinks"])
@pytest.mark.parametrize("window", [1, 3, 129, 600, 1000])
def test_reference_kernel_matches_dense(window, with_sinks):
    doc_lens, heads = [700, 5, 130, 1], (4, 2, 8)
    q, k, v, sinks, weight = tensors(sum(doc_lens), heads, seed=window)
    leaves = [t.requires_grad_() for t in (q, k, v, *([sinks] if with_sinks else []))]
    cu = torch.tensor([0, *doc_lens]).cumsum(0).to(torch.int32)
    shape = (cu, cu, max(doc_lens), max(doc_lens))
    if with_sinks:
        out = sink_attention(q, k, v, sinks, *shape, backend="reference", window=window)
    else:
        out = varlen_attention(q, k, v, *shape, backend="reference", window=window)
    got = [out.detach(), *torch.autograd.grad((out * weight).sum(), leaves)]
    assert_all_close(got, oracle(doc_lens, heads, window, window, with_sinks), f"window={window}")


def test_window_skips_tiles_left_of_every_window():
    """A 4096-token sequence with a 100-key window: each 128-query block gets one tile of at most
    128 + 99 keys, starting at its first query's window (without the window, up to eight tiles)."""
    rows = list(reference.tiles([0, 4096], [0, 4096], True, window=100))
    assert len(rows) == 32 and all(len(row) == 1 for row in rows)
    assert all(t.k0 == max(0, t.q0 - 99) and t.k1 == t.q1 and t.low is not None for (t,) in rows)


def test_torch_backend_passes_hf_window_as_flash_window(monkeypatch):
    """HF sliding_window 128 is FlashAttention's window_size (127, 0) in torch's varlen_attn (its
    forward, with and without the LSE); full attention stays (-1, 0). Checked on the CPU by
    standing in for the GPU-only call."""
    import torch.nn.attention.varlen as varlen

    seen = []
    monkeypatch.setattr(varlen, "varlen_attn", lambda *a, **kw: seen.append(kw["window_size"]) or (0, 0))
    t, cu = torch.zeros(4, 1, 8), torch.tensor([0, 4], dtype=torch.int32)
    args = (t, t, t, cu, cu, 4, 4, True, 1.0)
    kernels._torch_run(*args, window=128)
    kernels._torch_run_lse(*args, window=128)
    kernels._torch_run(*args)
    assert seen == [(127, 0), (127, 0), (-1, 0)]


def test_torch_private_backward_schema_is_pinned():
    """The sinks' GPU backward calls aten._flash_attention_backward by its argument names; the
    installed torch must have exactly the schema it was written for."""
    assert kernels._flash_backward_schema_problem() is None, torch.__version__


@st.composite
def windows(draw):
    cp_size = draw(st.sampled_from([2, 4]))
    doc_lens = draw(st.lists(st.integers(1, 30), min_size=1, max_size=6))
    if sum(doc_lens) % cp_size:
        doc_lens.append(-sum(doc_lens) % cp_size)
    strategy = draw(st.sampled_from(["per_doc", "flashcp", "per_seq", "whole_doc", "ring"]))
    window = draw(st.integers(1, 40))
    return plan_shards(doc_lens, cp_size, strategy), window, draw(st.integers(0, 2**16))


def run_op(plan, comm, window, heads, seed, sinks=True, overlap=False, dispatch=build_dispatch):
    """Every rank's forward and backward in one process: the window's output and gradients in
    window order (the sinks' summed over ranks) and each rank's forward rows received."""
    q, k, v, s, weight = tensors(plan.context, heads, seed)

    def program(rank, group):
        d = dispatch(plan, rank, comm, overlap=overlap, window=window)
        local = [t[d.token_index].clone().requires_grad_() for t in (q, k, v)]
        sink = s.clone().requires_grad_() if sinks else None
        with record_comm() as log:
            out = cp_varlen_attention(*local, d, group, comm, "reference", overlap=overlap, window=window,
                                      sinks=sink)  # fmt: skip
            (out * weight[d.token_index]).sum().backward()
        grads = [t.grad for t in local] + ([sink.grad] if sinks else [])
        return d.token_index, out.detach(), grads, sum(r.recv_rows for r in log if r.pass_ == "forward")

    got = [torch.zeros_like(t) for t in (q, q, k, v, *([s] if sinks else []))]
    received = []
    for idx, out, grads, rows in run_ranks(plan.cp_size, program):
        for full, part in zip(got, (out, *grads[:3])):
            full[idx] = part
        if sinks:
            got[4] += grads[3]
        received.append(rows)
    return got, received


@settings(max_examples=15, deadline=None)
@given(windows(), st.sampled_from(COMM_MODES), st.booleans())
def test_random_windows_match_dense_and_prediction(window_case, comm, overlap):
    plan, window, seed = window_case
    heads = (2, 1, 4)
    got, received = run_op(plan, comm, window, heads, seed, overlap=overlap)
    assert_all_close(got, oracle(list(plan.doc_lens), heads, seed, window, True), f"{plan.ranks} W={window}")
    assert received == window_recv_tokens(plan, window, comm)


def test_sinks_run_on_the_two_level_exchange():
    plan = plan_shards([37, 2, 11, 5, 1, 23, 9, 7, 1], 4, "flashcp")

    def two_level(plan, rank, comm, overlap, window):
        return build_two_level_dispatch(plan, rank, ranks_per_node=2, overlap=overlap)

    got, _ = run_op(plan, "two_level", None, (2, 1, 4), 5, overlap=True, dispatch=two_level)
    assert_all_close(got, oracle(list(plan.doc_lens), (2, 1, 4), 5, None, True), "two_level")


def test_window_receives_at_most_w_minus_1_rows_per_piece():
    """One 4000-token document cut over 4 ranks: with W = 128 a rank receives 127 rows per cut
    piece (the document's length does not matter); whole documents need nothing."""
    cut = plan_shards([4000], 4, "per_doc")
    for rank, shards in enumerate(cut.ranks):
        d = build_dispatch(cut, rank, "needed", window=128)
        assert d.recv_size == sum(min(s.start, 127) for s in shards) > 0
        assert d.max_seqlen_k == max(s.length + min(s.start, 127) for s in shards)
    whole = plan_shards([8, 8, 8, 8], 2, "whole_doc")
    assert all(s.start == 0 for shards in whole.ranks for s in shards)
    for comm in ("compact", "needed"):
        assert window_recv_tokens(whole, 5, comm) == [0, 0]
        assert build_dispatch(whole, 0, comm, window=5).recv_size == 0


def test_bad_window_and_sinks_are_refused_in_one_line():
    plan = plan_shards([8, 8], 2, "per_doc")
    t, cu = torch.zeros(8, 2, 4), torch.tensor([0, 8], dtype=torch.int32)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="window must be a positive number of keys"):
            build_dispatch(plan, 0, window=bad)
        with pytest.raises(ValueError, match="window must be a positive number of keys"):
            varlen_attention(t, t, t, cu, cu, 8, 8, window=bad)
    with pytest.raises(ValueError, match="needs causal=True"):
        varlen_attention(t, t, t, cu, cu, 8, 8, causal=False, window=4)
    with pytest.raises(ValueError, match=r"sinks must be one float per query head, \[2\]"):
        sink_attention(t, t, t, torch.zeros(3), cu, cu, 8, 8)
    with pytest.raises(BackendUnavailable, match="'flash_attn' has no .*sinks runs on torch, reference"):
        sink_attention(t, t, t, torch.zeros(2), cu, cu, 8, 8, backend="flash_attn")
    d = build_dispatch(plan, 0, window=4)
    with pytest.raises(ValueError, match=r"built for window=4 but window=None .* window=None\)"):
        cp_varlen_attention(t, t, t, d, comm="compact")
    with pytest.raises(ValueError, match="comm='ring' runs full attention only"):
        cp_varlen_attention(t, t, t, build_ring_dispatch(plan, 0), comm="ring", window=4)
    with pytest.raises(ValueError, match="comm='ring' takes no sinks"):
        cp_varlen_attention(t, t, t, build_ring_dispatch(plan, 0), comm="ring", sinks=torch.zeros(2))
