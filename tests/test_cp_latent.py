"""The latent exchange (`cp_latent_attention`) over spawned gloo ranks equals single-device MLA.

The oracle shares nothing with the op but torch: it up-projects every token of the window with
`wkv_b`, broadcasts `k_pe` over the heads and runs torch's SDPA under the window's document mask
(causal inside each document), in float64. Each case runs the op forward and backward on every
rank, maps the rows back through `token_index` and compares the output and the gradients of q,
the latent rows and `k_pe` (to their owners) and of `wkv_b` (each rank's local gradient, summed
over ranks as FSDP would) to 1e-10, with and without `overlap`. The same runs record what every collective moves, which must
equal the planner's prediction in latent bytes (`Plan.metrics(latent_dim=...)`, `row_bytes`).
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashcp import plan_shards
from flashcp.attention import build_two_level_dispatch, cp_latent_attention, record_comm
from flashcp.attention.latent import up_project
from flashcp.dispatch import build_dispatch
from flashcp.plan import Plan
from flashcp.plan.nodes import node_traffic
from flashcp.plan.plan import row_bytes

HEADS, RANK, ROPE, NOPE, V = 3, 6, 2, 4, 3  # heads, kv_lora_rank, qk_rope, qk_nope, v head dims
LATENT = RANK + ROPE
STRATEGIES = ("flashcp", "per_doc", "per_seq")
COMMS = ("compact", "needed", "two_level", "full")


class Case(NamedTuple):
    plan: Plan
    comm: str
    ranks_per_node: int = 1  # two_level only
    seed: int = 0
    overlap: bool = False


def window_tensors(context: int, seed: int) -> list[torch.Tensor]:
    """q, latent, k_pe, the output weight and wkv_b of the whole window, identical in every process."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(context, HEADS, NOPE + ROPE), (context, RANK), (context, ROPE), (context, HEADS, V),
              (HEADS * (NOPE + V), RANK)]  # fmt: skip
    return [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]


def dispatch_of(case: Case, rank: int):
    if case.comm == "two_level":
        return build_two_level_dispatch(case.plan, rank, case.ranks_per_node, overlap=case.overlap)
    return build_dispatch(case.plan, rank, case.comm, overlap=case.overlap)


def run_cases(rank: int, group, cases: list[Case]):
    """Worker: forward + backward of every case on this rank; rows in local order."""
    results = []
    for case in cases:
        d = dispatch_of(case, rank)
        q, latent, k_pe, weight, wkv_b = window_tensors(case.plan.context, case.seed)
        q, latent, k_pe, weight = (t[d.token_index].clone() for t in (q, latent, k_pe, weight))
        inputs = [t.requires_grad_() for t in (q, latent, k_pe, wkv_b)]
        with record_comm() as log:
            out = cp_latent_attention(*inputs, d, group, comm=case.comm, backend="reference", overlap=case.overlap)
            (out * weight).sum().backward()
        results.append((d.token_index, out.detach(), *(t.grad for t in inputs), list(log)))
    return results


def oracle(plan: Plan, seed: int) -> list[torch.Tensor]:
    """Single-device MLA over the whole window: up-project everything, SDPA with a document mask."""
    q, latent, k_pe, weight, wkv_b = window_tensors(plan.context, seed)
    inputs = [t.requires_grad_() for t in (q, latent, k_pe, wkv_b)]
    kv = (latent @ wkv_b.t()).view(plan.context, HEADS, NOPE + V)
    k = torch.cat([kv[..., :NOPE], k_pe[:, None].expand(-1, HEADS, -1)], -1)
    doc = torch.repeat_interleave(torch.arange(len(plan.doc_lens)), torch.tensor(plan.doc_lens))
    pos = torch.arange(plan.context)
    mask = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), kv[..., NOPE:].transpose(0, 1), attn_mask=mask
    ).transpose(0, 1)
    (out * weight).sum().backward()
    return [out.detach(), *(t.grad for t in inputs)]


def check(pool, cases: list[Case]) -> list[list]:
    """Run `cases` (one CP size) on the pool and compare with the oracle; returns the comm logs."""
    size = cases[0].plan.cp_size
    per_rank = pool.run(run_cases, (cases,), size=size)
    for i, case in enumerate(cases):
        want = oracle(case.plan, case.seed)
        got = [torch.empty_like(w) for w in want[:4]]
        dw = torch.zeros_like(want[4])
        for results in per_rank:
            idx, out, dq, dlatent, dpe, dwkv, _ = results[i]
            for full, local in zip(got, (out, dq, dlatent, dpe)):
                full[idx] = local
            dw += dwkv
        what = f"{case.plan.strategy}/{case.comm} N={size} docs={case.plan.doc_lens}"
        for name, a, b in zip(("out", "dq", "dlatent", "dk_pe", "dwkv_b"), [*got, dw], want):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=lambda m: f"{what} {name}: {m}")
    return [[r[i][-1] for r in per_rank] for i in range(len(cases))]


def cases_of(doc_lens: list[int], cp: int, seed: int = 0) -> list[Case]:
    plans = [plan_shards(doc_lens, cp, s) for s in STRATEGIES]
    rpn = 2 if cp % 2 == 0 and cp > 2 else 1  # two nodes of two at CP 4, one rank per node else
    return [Case(p, c, rpn if c == "two_level" else 1, seed) for p in plans for c in COMMS]


@pytest.fixture(scope="module")
def pool(gloo_pool):
    return gloo_pool(4, sizes=(2, 3, 4))


WINDOWS = {
    "split documents and a 1-token one": [29, 1, 7, 3, 12, 20],  # 72 tokens
    "one document": [36],
}


@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("window", WINDOWS, ids=list(WINDOWS))
def test_latent_exchange_matches_single_device_mla(pool, window, cp):
    doc_lens = list(WINDOWS[window])
    doc_lens[-1] += -sum(doc_lens) % cp
    check(pool, cases_of(doc_lens, cp, seed=cp))


@pytest.mark.parametrize("cp", [2, 4])
def test_overlap_gives_the_same_result(pool, cp):
    """`overlap=True`: the local-only shards up-projected and computed under the exchange, then the
    others; the same outputs and gradients (every strategy and exchange)."""
    doc_lens = [40, 3, 9, 1, 17, 2, 8]  # 80 tokens: whole documents and split ones
    cases = [c._replace(overlap=True) for c in cases_of(doc_lens, cp, seed=3)]
    both = [c for c in cases if any(
        dispatch_of(c, r).overlap.local.max_seqlen_q and dispatch_of(c, r).overlap.remote.max_seqlen_q
        for r in range(cp))]  # fmt: skip
    assert both, "no rank has both local-only and remote shards: the overlapped path would not run"
    check(pool, cases)


@st.composite
def windows(draw):
    cp = draw(st.sampled_from([2, 3, 4]))
    doc_lens = draw(st.lists(st.integers(1, 20), min_size=1, max_size=8))
    if sum(doc_lens) % cp:
        doc_lens.append(cp - sum(doc_lens) % cp)
    return doc_lens, cp, draw(st.integers(0, 2**16))


@settings(max_examples=8, deadline=None)
@given(windows())
def test_random_windows_match_single_device_mla(pool, window):
    doc_lens, cp, seed = window
    check(pool, cases_of(doc_lens, cp, seed))


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_latent_bytes_sent_equal_plan_prediction(pool, cp):
    """Every rank sends and receives exactly the planner's rows at `row_bytes(latent_dim=...)`, and
    the busiest rank's received bytes are `Plan.metrics(latent_dim=...)`'s; the backward moves the
    same rows transposed."""
    doc_lens = [37, 2, 11, 5, 1, 23, 9, 7, 1]  # 96 tokens
    cases = cases_of(doc_lens, cp, seed=7)
    row = row_bytes(latent_dim=LATENT, dtype_bytes=8)
    assert row == (RANK + ROPE) * 8
    for case, logs in zip(cases, check(pool, cases)):
        plan, what = case.plan, f"{case.plan.strategy}/{case.comm} N={cp}"
        sent = [sum(r.sent_bytes for r in log if r.pass_ == "forward") for log in logs]
        recv = [sum(r.recv_bytes for r in log if r.pass_ == "forward") for log in logs]
        assert [sum(r.recv_bytes for r in log if r.pass_ == "backward") for log in logs] == sent, what
        assert [sum(r.sent_bytes for r in log if r.pass_ == "backward") for log in logs] == recv, what
        if case.comm == "two_level":
            t = node_traffic(plan, case.ranks_per_node)
            assert sent == [(a + b) * row for a, b in zip(t.stage1_send, t.stage2_send)], what
            assert recv == [(a + b) * row for a, b in zip(t.stage1_recv, t.stage2_recv)], what
            continue
        m = plan.metrics(HEADS, NOPE + ROPE, 8, v_head_dim=V, latent_dim=LATENT)
        if case.comm == "needed":
            needed = node_traffic(plan, cp).needed  # needed[r][s]: rows r receives from s
            assert sent == [sum(needed[r][s] for r in range(cp)) * row for s in range(cp)], what
            assert recv == [n * row for n in plan.needed_tokens()], what
        else:  # the all-gather: every rank sends its padded rows to every other rank
            assert sent == recv == [m[f"comm_{case.comm}_tokens"] * row] * cp, what
        assert max(recv) == m[f"comm_{case.comm}_bytes"], what
        assert m["comm_kv_full_bytes"] == m["comm_full_tokens"] * HEADS * (NOPE + ROPE + V) * 8, what


def test_single_rank_needs_no_process_group():
    plan = plan_shards([5, 1, 10], 1, "per_doc")
    ((idx, *got, log),) = run_cases(0, None, [Case(plan, "compact")])
    assert torch.equal(idx, torch.arange(plan.context)) and not log
    for name, a, b in zip(("out", "dq", "dlatent", "dk_pe", "dwkv_b"), got, oracle(plan, 0)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)


def test_up_project_lays_out_heads_as_deepseek():
    """wkv_b's rows are per head: qk_nope key rows, then v rows (DeepSeek-V3's `kv.view(..., H,
    qk_nope + v).split`); k_pe is the same for every head; K and V own their storage."""
    g = torch.Generator().manual_seed(1)
    latent, k_pe = torch.randn(4, RANK, generator=g), torch.randn(4, ROPE, generator=g)
    wkv_b = torch.randn(HEADS * (NOPE + V), RANK, generator=g)
    k, v = up_project(latent, k_pe, wkv_b, HEADS, NOPE)
    assert k.shape == (4, HEADS, NOPE + ROPE) and v.shape == (4, HEADS, V)
    # what the kernel keeps for its backward is K and V alone, not a product they are views of
    assert [t.untyped_storage().nbytes() for t in (k, v)] == [t.numel() * 4 for t in (k, v)]
    for h in range(HEADS):
        rows = wkv_b[h * (NOPE + V) : (h + 1) * (NOPE + V)]
        torch.testing.assert_close(k[:, h, :NOPE], latent @ rows[:NOPE].t())
        torch.testing.assert_close(v[:, h], latent @ rows[NOPE:].t())
        assert torch.equal(k[:, h, NOPE:], k_pe)


def test_bad_shapes_are_named():
    plan = plan_shards([8], 1, "per_doc")
    d = build_dispatch(plan, 0)
    q, latent, k_pe = torch.zeros(8, HEADS, NOPE + ROPE), torch.zeros(8, RANK), torch.zeros(8, ROPE)
    with pytest.raises(ValueError, match="wkv_b"):
        cp_latent_attention(q, latent, k_pe, torch.zeros(HEADS * NOPE, RANK), d)
    with pytest.raises(ValueError, match="8 tokens"):
        cp_latent_attention(q, latent[:5], k_pe, torch.zeros(HEADS * (NOPE + V), RANK), d)
    with pytest.raises(ValueError, match="latent and k_pe dtypes differ"):
        cp_latent_attention(q, latent, k_pe.double(), torch.zeros(HEADS * (NOPE + V), RANK), d)
    with pytest.raises(ValueError, match="comm='compact'"):
        cp_latent_attention(q, latent, k_pe, torch.zeros(HEADS * (NOPE + V), RANK), d, comm="needed")
