"""`comm = "ring"` over spawned gloo ranks equals single-device document-masked attention.

The oracle is torch's SDPA over the whole window with a dense block mask (a query sees its own
document's keys at or before its position), in float64. Each case runs the ring forward and
backward on N = 2, 3 or 4 gloo ranks (`batch_isend_irecv`), on the Ring-Attn layout (`ring`),
Ring-Attn (Zigzag)'s (`per_doc`) and a FlashCP plan, and maps every rank's rows back through
`token_index`. Tolerances: float64 to 1e-10 (relative and absolute), float32 to 1e-5 against the
float64 oracle. The same runs check the bytes each rank logs per layer against
`ring_transfers`, the count the cost model prices.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashcp import plan_shards
from flashcp.attention import cp_varlen_attention, record_comm
from flashcp.attention.kernels import BACKENDS, Backend
from flashcp.attention.ring import build_ring_dispatch, ring_attention
from flashcp.attention.simulate import run_ranks
from flashcp.plan.ring import ring_schedule, ring_transfers

TOL = {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=1e-5, atol=1e-5)}
LAYOUTS = ("ring", "per_doc", "flashcp")
HEADS = (4, 2, 8)  # Hq, Hkv (GQA), D


def window(context: int, dtype: torch.dtype, seed: int = 0, heads=HEADS) -> list[torch.Tensor]:
    hq, hkv, d = heads
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(context, h, d, generator=g, dtype=torch.float64).to(dtype) for h in (hq, hkv, hkv, hq)]


def sdpa_oracle(doc_lens, heads=HEADS, seed: int = 0):
    """Whole-window attention with the document block mask, and dq, dk, dv of sum(out * g)."""
    q, k, v, g = window(sum(doc_lens), torch.float64, seed, heads)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    doc = torch.repeat_interleave(torch.arange(len(doc_lens)), torch.tensor(doc_lens))
    pos = torch.arange(len(doc))
    mask = (doc[:, None] == doc[None, :]) & (pos[:, None] >= pos[None, :])
    rep = heads[0] // heads[1]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(rep, 1).transpose(0, 1), v.repeat_interleave(rep, 1).transpose(0, 1),
        attn_mask=mask,
    ).transpose(0, 1)  # fmt: skip
    (out * g).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def run_ring(rank: int, group, cases):
    """Worker: forward + backward of every (plan, dtype) case; rows in local order, and the log."""
    results = []
    for plan, dtype in cases:
        d = build_ring_dispatch(plan, rank)
        q, k, v, g = (t[d.token_index].clone() for t in window(plan.context, dtype))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        with record_comm() as log:
            out = cp_varlen_attention(q, k, v, d, group, comm="ring", backend="reference")
            (out * g).sum().backward()
        results.append((d.token_index, out.detach(), q.grad, k.grad, v.grad, list(log)))
    return results


def check(per_rank, cases) -> None:
    for i, (plan, dtype) in enumerate(cases):
        want = sdpa_oracle(plan.doc_lens)
        got = [torch.full_like(w, float("nan")) for w in want]
        for results in per_rank:
            idx, *tensors, log = results[i]
            for full, local in zip(got, tensors):
                full[idx] = local.double()
            check_bytes(plan, dtype, log)
        what = f"{plan.strategy} N={plan.cp_size} docs={plan.doc_lens} {dtype}"
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            torch.testing.assert_close(a, b, **TOL[dtype], msg=lambda m: f"{what} {name}: {m}")


def check_bytes(plan, dtype, log) -> None:
    """The rank's logged bytes per layer and pass are `ring_transfers`' (KV in the input dtype,
    dK/dV sums in at least float32), sent and received alike."""
    hkv, d = HEADS[1], HEADS[2]
    elem = torch.empty(0, dtype=dtype).element_size()
    fwd, bwd = ring_transfers(plan.tokens_per_rank, plan.cp_size, 2 * hkv * d * elem, 2 * hkv * d * max(elem, 4))
    for pass_, want in (("forward", sum(fwd)), ("backward", sum(bwd))):
        entries = [e for e in log if e.pass_ == pass_]
        assert {e.op for e in entries} <= {"ring"}
        assert sum(e.sent_bytes for e in entries) == sum(e.recv_bytes for e in entries) == want


@pytest.fixture(scope="module")
def pool(gloo_pool):
    return gloo_pool(4, sizes=(2, 3, 4))


EDGE_WINDOWS = {
    "one document fills the window": [48],
    "one-token documents": [1] * 24,
    "documents shorter than N": [1, 2, 3, 1, 2, 3, 1, 2, 3, 2],
    "long and short documents": [29, 3, 1, 2, 5, 4, 13, 7],
}


@pytest.mark.parametrize("cp_size", [2, 3, 4])
@pytest.mark.parametrize("name", EDGE_WINDOWS, ids=list(EDGE_WINDOWS))
def test_the_ring_matches_single_device_attention(pool, name, cp_size):
    doc_lens = list(EDGE_WINDOWS[name])
    doc_lens[-1] += -sum(doc_lens) % cp_size
    cases = [(plan_shards(doc_lens, cp_size, s), dtype) for s in LAYOUTS for dtype in (torch.float64, torch.float32)]
    check(pool.run(run_ring, (cases,), size=cp_size), cases)


@settings(max_examples=20, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=10), st.sampled_from([2, 3, 4]), st.sampled_from(LAYOUTS))
def test_random_windows_over_the_ring(pool, doc_lens, cp_size, strategy):
    doc_lens[-1] += -sum(doc_lens) % cp_size
    cases = [(plan_shards(doc_lens, cp_size, strategy), torch.float64)]
    check(pool.run(run_ring, (cases,), size=cp_size), cases)


def test_the_ring_layout_cuts_every_document_in_rank_order():
    """Piece r of every document on rank r, contiguous, equal tokens per rank, no empty shard."""
    lens = [5, 1, 2, 9, 3, 4]
    plan = plan_shards(lens, 4, "ring")
    for d, length in enumerate(lens):
        pieces = [(r, s) for r, shards in enumerate(plan.ranks) for s in shards if s.doc == d]
        assert [r for r, _ in pieces] == sorted(r for r, _ in pieces)
        assert [s.start for _, s in pieces] == sorted(s.start for _, s in pieces)
        assert sum(s.length for _, s in pieces) == length and all(s.length for _, s in pieces)
        assert len(pieces) == min(length, 4)
        assert max(s.length for _, s in pieces) - min(s.length for _, s in pieces) <= 1


def test_steps_without_keys_call_no_kernel():
    """On the Ring-Attn layout rank r attends to ranks r-1 .. 0 only: the steps whose block comes
    from a later rank are None in the schedule and run no kernel (a counting kernel sees exactly
    the scheduled calls), though the blocks still pass on."""
    plan = plan_shards([16, 8, 8], 4, "ring")
    scheduled = [[c is not None for c in ring_schedule(plan, r)] for r in range(4)]
    assert scheduled == [[s <= r for s in range(4)] for r in range(4)]
    calls = [0] * 4
    ref = BACKENDS["reference"]

    def program(rank, group):
        def counted(*args):
            calls[rank] += 1
            return ref.run_lse(*args)

        d = build_ring_dispatch(plan, rank)
        q, k, v, _ = (t[d.token_index] for t in window(plan.context, torch.float64))
        kernel = Backend("counted", ref.reject, ref.run, counted, ref.run_backward)
        BACKENDS["counted"] = kernel
        try:
            return ring_attention(q, k, v, d, group, backend="counted")
        finally:
            del BACKENDS["counted"]

    passes = 0

    def counting(rank, group):
        nonlocal passes
        passes += rank == 0
        return program(rank, group)

    run_ranks(4, counting)
    assert [c // passes for c in calls] == [sum(row) for row in scheduled] == [1, 2, 3, 4]


def test_the_zigzag_layout_sends_whole_head_and_tail_chunks_as_one_sequence():
    """At a step whose source is an earlier rank, both of a rank's Per-Doc chunks see the source's
    head chunk: one query sequence (head and tail rows are adjacent) against one key range."""
    plan = plan_shards([64], 4, "per_doc")
    call = ring_schedule(plan, 3)[1]  # the block of rank 2
    assert (call.source, call.causal, call.q_ranges, call.k_ranges) == (2, False, ((0, 16),), ((0, 8),))


def test_overlap_and_a_plain_dispatch_are_refused():
    plan = plan_shards([8], 1, "ring")
    q, k, v, _ = window(8, torch.float64)
    d = build_ring_dispatch(plan, 0)
    with pytest.raises(ValueError, match="overlaps every step already"):
        cp_varlen_attention(q, k, v, d, comm="ring", overlap=True)
    from flashcp.dispatch import build_dispatch

    with pytest.raises(ValueError, match="build_ring_dispatch"):
        ring_attention(q, k, v, build_dispatch(plan, 0, "full"), None)


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_ring_metrics_of_one_document(n):
    """One document of N pieces of P tokens on the Ring-Attn layout: every step waits for a rank
    scoring a whole P x P block (step 0: the causal half), against C (C + 1) / 2N pairs per rank on
    average; zigzag's steps are balanced. The ring moves the full all-gather's KV forward, again
    backward, and float32 sums (twice bf16's bytes): 2x the all-gather and reduce-scatter's bytes."""
    from flashcp.plan.ring import ring_metrics

    p = 64
    c = n * p
    ring = ring_metrics(plan_shards([c], n, "ring"))
    assert ring["ring_step_imbalance"] == pytest.approx((p * (p + 1) / 2 + (n - 1) * p * p) / (c * (c + 1) / 2 / n))
    assert ring["ring_comm_ratio"] == 2.0
    assert ring_metrics(plan_shards([c], n, "per_doc"))["ring_step_imbalance"] < 1.02
    assert ring_metrics(plan_shards([c], n, "ring"), kv_bytes=4, sum_bytes=4)["ring_comm_ratio"] == 1.5
