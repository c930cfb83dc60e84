"""Window layers and sinks through the CP op on spawned gloo ranks, against a dense float64 oracle.

Every case runs `cp_varlen_attention(..., window=W, sinks=...)` forward and backward on each rank
and compares the window's output and the gradients of q, k, v and the sinks (summed over ranks,
as for any replicated parameter) with `dense_attention` (1e-10; observed ~1e-14). Windows: 1, one
that ends exactly at the start of the piece before a cut shard (and one row past it), and one
longer than every document. The rows and bytes each rank receives must equal
`flashcp.plan.window`'s prediction, and the backward must send back what the forward received.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
from dense_attention import dense_attention

from flashcp import plan_shards
from flashcp.attention import cp_varlen_attention, record_comm
from flashcp.dispatch import build_dispatch, COMM_MODES
from flashcp.plan import Plan
from flashcp.plan.window import window_recv_bytes

TOL = dict(rtol=1e-10, atol=1e-12)
HEADS = (4, 2, 8)  # Hq, Hkv, D
DOC_LENS = [37, 2, 11, 5, 1, 23, 9, 7, 1]  # 96 tokens: cut documents and whole ones


class Case(NamedTuple):
    plan: Plan
    comm: str
    window: int
    overlap: bool = False


def window_tensors(tokens: int, seed: int = 0) -> list[torch.Tensor]:
    """q, k, v, sinks and the output weight, float64, identical in every process."""
    hq, hkv, d = HEADS
    g = torch.Generator().manual_seed(seed)
    shapes = [(tokens, hq, d), (tokens, hkv, d), (tokens, hkv, d), (hq,), (tokens, hq, d)]
    return [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]


def run_cases(rank: int, group, cases: list[Case]):
    """Worker: forward + backward of every case on this rank."""
    results = []
    for case in cases:
        d = build_dispatch(case.plan, rank, case.comm, overlap=case.overlap, window=case.window)
        q, k, v, sinks, weight = window_tensors(case.plan.context)
        q, k, v = (t[d.token_index].clone().requires_grad_() for t in (q, k, v))
        sinks.requires_grad_()
        with record_comm() as log:
            out = cp_varlen_attention(q, k, v, d, group, case.comm, "reference", overlap=case.overlap,
                                      window=case.window, sinks=sinks)  # fmt: skip
            (out * weight[d.token_index]).sum().backward()
        results.append((d.token_index, [out.detach(), q.grad, k.grad, v.grad], sinks.grad, list(log)))
    return results


def oracle(case: Case) -> list[torch.Tensor]:
    q, k, v, sinks, weight = window_tensors(case.plan.context)
    leaves = [t.requires_grad_() for t in (q, k, v, sinks)]
    out = dense_attention(q, k, v, list(case.plan.doc_lens), case.window, sinks)
    return [out.detach(), *torch.autograd.grad((out * weight).sum(), leaves)]


def boundary_windows(plan: Plan) -> list[int]:
    """Windows whose first key is the first row of the piece just before a cut shard (on another
    rank), and one row before it."""
    pieces = sorted((s.doc, s.start, s.length, r) for r, shards in enumerate(plan.ranks) for s in shards)
    for (doc, start, length, owner), (next_doc, next_start, _, next_owner) in zip(pieces, pieces[1:]):
        if doc == next_doc and owner != next_owner and start > 0:
            return [length + 1, length + 2]  # a - (W - 1) = start, then start - 1
    raise AssertionError(f"no cut piece after a cut piece in {plan.ranks}")


@pytest.fixture(scope="module")
def pool(gloo_pool):
    return gloo_pool(4, sizes=(2, 4))


@pytest.mark.parametrize("cp_size", [2, 4])
def test_window_and_sinks_match_dense(pool, cp_size):
    plans = [plan_shards(DOC_LENS, cp_size, s) for s in ("per_doc", "flashcp")]
    cases = [Case(plan, comm, w) for plan in plans for w in (1, *boundary_windows(plan), 64)
             for comm in COMM_MODES]  # fmt: skip
    cases += [c._replace(overlap=True) for c in cases if c.window == boundary_windows(c.plan)[0]]
    per_rank = pool.run(run_cases, (cases,), size=cp_size)
    worst = 0.0
    for i, case in enumerate(cases):
        what = f"{case.plan.strategy}/{case.comm} N={cp_size} W={case.window} overlap={case.overlap}"
        want = oracle(case)
        got = [torch.empty_like(w) for w in want[:4]] + [torch.zeros_like(want[4])]
        for idx, tensors, dsinks, _ in (r[i] for r in per_rank):
            for full, local in zip(got, tensors):
                full[idx] = local
            got[4] += dsinks
        for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), got, want):
            torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"{what} {name}: {m}")
            worst = max(worst, float((a - b).abs().max()))
        check_bytes(case, [r[i][-1] for r in per_rank], what)
    print(f"max abs error over {len(cases)} cases: {worst:.1e}")


def check_bytes(case: Case, logs: list, what: str) -> None:
    """Each rank's forward bytes equal the prediction; backward sends back what forward received."""
    hq, hkv, d = HEADS
    fwd = [[r for r in log if r.pass_ == "forward"] for log in logs]
    bwd = [[r for r in log if r.pass_ == "backward"] for log in logs]
    predicted = window_recv_bytes(case.plan, case.window, case.comm, num_kv_heads=hkv, head_dim=d, dtype_bytes=8)
    assert [sum(r.recv_bytes for r in rs) for rs in fwd] == predicted, what
    assert [sum(r.sent_rows for r in rs) for rs in bwd] == [sum(r.recv_rows for r in rs) for rs in fwd], what
