"""CP attention over spawned gloo ranks equals single-process document-masked attention.

Each case plans a window in the parent, runs `cp_varlen_attention` forward and backward on every
rank of a pool started once for the module, maps each rank's rows back through `token_index`
and compares output and dq/dk/dv with the reference kernel run over the whole window with one
sequence per document. Tolerances: float64 rtol 1e-10 / atol 1e-12 (only summation order
differs; observed errors are ~2e-15); float32 rtol 1e-4 / atol 1e-5 against the float64 oracle
(observed ~1.2e-6 absolute).

The same runs record the rows every collective moves (`record_comm`), which must equal the
planner's `comm_*_tokens` / `comm_*_bytes` predictions.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import pytest
import torch
from distributed_pool import DistributedPool
from hypothesis import given, settings
from hypothesis import strategies as st

from flashcp import plan_shards
from flashcp.attention import cp_varlen_attention, record_comm, varlen_attention
from flashcp.attention.collectives import gather_kv, launch_kv_exchange
from flashcp.attention.simulate import run_ranks
from flashcp.dispatch import build_dispatch, COMM_MODES
from flashcp.plan import STRATEGIES, Plan

TOL = {torch.float64: dict(rtol=1e-10, atol=1e-12), torch.float32: dict(rtol=1e-4, atol=1e-5)}


class Case(NamedTuple):
    plan: Plan
    comm: str
    dtype: torch.dtype = torch.float64
    heads: tuple[int, int, int] = (2, 2, 8)  # Hq, Hkv, D
    seed: int = 0
    overlap: bool = False


def window_tensors(context: int, heads: tuple[int, int, int], dtype: torch.dtype, seed: int):
    """Q, K, V and the output weight G of the whole window, identical in every process."""
    hq, hkv, d = heads
    g = torch.Generator().manual_seed(seed)
    shapes = [(context, hq, d), (context, hkv, d), (context, hkv, d), (context, hq, d)]
    return [torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for s in shapes]


def run_cases(rank: int, group, cases: list[Case]):
    """Worker: forward + backward of every case on this rank; rows are in local order."""
    results = []
    for case in cases:
        dispatch = build_dispatch(case.plan, rank, case.comm, overlap=case.overlap)
        idx = dispatch.token_index
        window = window_tensors(case.plan.context, case.heads, case.dtype, case.seed)
        q, k, v, g = (t[idx].clone() for t in window)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        with record_comm() as log:
            out = cp_varlen_attention(
                q, k, v, dispatch, group, comm=case.comm, backend="reference", overlap=case.overlap
            )
            (out * g).sum().backward()
        results.append((idx, out.detach(), q.grad, k.grad, v.grad, list(log)))
    return results


def oracle(case: Case):
    """Single-process document-masked causal attention over the whole window, and its grads."""
    q, k, v, g = window_tensors(case.plan.context, case.heads, torch.float64, case.seed)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    cu = torch.tensor([0, *case.plan.doc_lens]).cumsum(0).to(torch.int32)
    longest = max(case.plan.doc_lens)
    out = varlen_attention(q, k, v, cu, cu, longest, longest, backend="reference")
    (out * g).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def check_cases(pool: DistributedPool, cases: list[Case]) -> list[list]:
    """Run `cases` on the pool (all with the same cp_size) and compare with the oracle."""
    size = cases[0].plan.cp_size
    per_rank = pool.run(run_cases, (cases,), size=size)
    oracles: dict[tuple, tuple] = {}
    for i, case in enumerate(cases):
        key = (case.plan.doc_lens, case.heads, case.seed)
        if key not in oracles:
            oracles[key] = oracle(case)
        want = oracles[key]
        got = [torch.empty_like(w) for w in want]
        for rank_results in per_rank:
            idx, *tensors, _ = rank_results[i]
            for full, local in zip(got, tensors):
                full[idx] = local.double()
        what = f"{case.plan.strategy}/{case.comm} N={size} docs={case.plan.doc_lens} {case.dtype}"
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            torch.testing.assert_close(a, b, **TOL[case.dtype], msg=lambda m: f"{what} {name}: {m}")
    return [[r[i][-1] for r in per_rank] for i in range(len(cases))]


# The MILP is solved to a loose target under a time limit: these tests need its plans (shards
# cut at arbitrary points), not their optimality.
PLAN_OPTIONS = {"ilp": dict(target_imbalance=2.0, time_limit=60.0)}  # the limit only catches a hang


def all_cases(doc_lens, cp_size: int, strategies=tuple(STRATEGIES), **kw) -> list[Case]:
    """Every (strategy, comm mode) pair on one window."""
    plans = [plan_shards(doc_lens, cp_size, s, **PLAN_OPTIONS.get(s, {})) for s in strategies]
    return [Case(plan, comm, **kw) for plan in plans for comm in COMM_MODES]


@pytest.fixture(scope="module")
def pool(gloo_pool):
    return gloo_pool(4, sizes=(2, 4))


EDGE_WINDOWS = {
    "one document fills the window": [48],
    "many one-token documents": [1] * 24,
    "documents shorter than N": [1, 2, 3, 1, 2, 3, 1, 2, 3, 2],
    "lengths not divisible by 2N": [13, 7, 5, 11, 3, 9],
    "one long document and short ones": [29, 3, 1, 2, 5, 4],
}


@pytest.mark.parametrize("cp_size", [2, 4])
@pytest.mark.parametrize("window", EDGE_WINDOWS, ids=list(EDGE_WINDOWS))
def test_edge_windows_match_single_process(pool, window, cp_size):
    doc_lens = list(EDGE_WINDOWS[window])
    doc_lens[-1] += -sum(doc_lens) % cp_size
    cases = all_cases(doc_lens, cp_size)
    check_cases(pool, cases + [c._replace(heads=(4, 1, 4), seed=1) for c in cases])


@pytest.mark.parametrize("cp_size", [2, 4])
def test_float32_and_head_layouts(pool, cp_size):
    cases = all_cases([19, 6, 1, 14, 8], cp_size, dtype=torch.float32, seed=2)  # 48 tokens
    heads = [(1, 1, 8), (6, 2, 4), (4, 4, 16)]
    check_cases(pool, [c._replace(heads=h) for h in heads for c in cases])


@st.composite
def windows(draw):
    cp_size = draw(st.sampled_from([2, 4]))
    doc_lens = draw(st.lists(st.integers(1, 24), min_size=1, max_size=10))
    if sum(doc_lens) % cp_size:
        doc_lens.append(-sum(doc_lens) % cp_size)
    heads = draw(st.sampled_from([(1, 1, 4), (2, 1, 4), (3, 3, 2)]))
    return doc_lens, cp_size, heads, draw(st.integers(0, 2**16))


@settings(max_examples=25, deadline=None)
@given(windows())
def test_random_windows_match_single_process(pool, window):
    """All strategies but "ilp", whose solver needs about a second per window (the fixed
    windows above cover it)."""
    doc_lens, cp_size, heads, seed = window
    strategies = [s for s in STRATEGIES if s != "ilp"]
    check_cases(pool, all_cases(doc_lens, cp_size, strategies, heads=heads, seed=seed))


@pytest.mark.parametrize("cp_size", [2, 4])
def test_overlap_gives_the_same_result(pool, cp_size):
    doc_lens = [40, 3, 9, 1, 17, 2, 8]  # 80 tokens: whole documents and split ones
    cases = [c._replace(overlap=True) for c in all_cases(doc_lens, cp_size, heads=(4, 2, 8), seed=3)]
    check_cases(pool, cases)


@pytest.mark.parametrize("cp_size", [2, 4])
def test_bytes_moved_equal_plan_prediction(pool, cp_size):
    doc_lens = [37, 2, 11, 5, 1, 23, 9, 7, 1]  # 96 tokens
    hq, hkv, d = 4, 2, 8
    cases = [c._replace(dtype=torch.float32) for c in all_cases(doc_lens, cp_size, heads=(hq, hkv, d))]
    logs = check_cases(pool, cases)
    for case, per_rank in zip(cases, logs):
        metrics = case.plan.metrics(num_kv_heads=hkv, head_dim=d, dtype_bytes=4)
        what = f"{case.plan.strategy}/{case.comm}"
        fwd = [[r for r in log if r.pass_ == "forward"] for log in per_rank]
        bwd = [[r for r in log if r.pass_ == "backward"] for log in per_rank]

        def total(records, field):  # per rank
            return [sum(getattr(r, field) for r in rs) for rs in records]

        # One collective each way at most; backward moves what forward moved, transposed.
        assert all(len(rs) <= 1 for rs in fwd + bwd), what
        assert total(bwd, "sent_rows") == total(fwd, "recv_rows"), what
        assert total(bwd, "recv_rows") == total(fwd, "sent_rows"), what
        assert sum(total(fwd, "sent_rows")) == sum(total(fwd, "recv_rows")), what
        predicted = metrics[f"comm_{case.comm}_tokens"]
        if case.comm == "needed":
            assert total(fwd, "recv_rows") == case.plan.needed_tokens(), what
        else:  # an all-gather delivers the same padded buffer to every rank
            assert total(fwd, "recv_rows") == [predicted] * cp_size, what
        assert max(total(fwd, "recv_rows")) == predicted, what
        assert max(total(fwd, "recv_bytes")) == metrics[f"comm_{case.comm}_bytes"], what


def run_mismatched(rank: int, group, plan: Plan):
    qkv = [torch.zeros(plan.tokens_per_rank, 1, 4) for _ in range(3)]
    try:
        cp_varlen_attention(*qkv, build_dispatch(plan, rank), group)
    except ValueError as e:
        return str(e)
    return None


def test_dispatch_for_another_world_size_is_rejected(pool):
    plan = plan_shards([8, 8, 8, 8], 4, "per_doc")
    messages = pool.run(run_mismatched, (plan,), size=2)
    assert all(m and "process group" in m for m in messages), messages


def test_dispatch_for_another_comm_mode_is_rejected():
    plan = plan_shards([8, 8], 2, "per_doc")
    t = torch.zeros(8, 1, 4)
    with pytest.raises(ValueError, match="comm='compact'"):
        cp_varlen_attention(t, t, t, build_dispatch(plan, 0, "compact"), comm="full")


@pytest.mark.parametrize("comm", COMM_MODES)
def test_single_rank_needs_no_process_group(comm):
    plan = plan_shards([5, 9, 2], 1, "per_doc")
    (idx, *got, log), = run_cases(0, None, [Case(plan, comm)])
    assert torch.equal(idx, torch.arange(plan.context)) and not log
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, oracle(Case(plan, comm))):
        torch.testing.assert_close(a, b, **TOL[torch.float64], msg=name)


@pytest.mark.parametrize("comm", COMM_MODES)
def test_exchange_buffers_are_freed_once_used(comm):
    """The forward's `[recv | local]` KV buffer is freed once the keys are gathered (not after the
    kernel), and the gradients handed back for k and v live in a tensor of the local rows only
    (the received rows' gradient is freed when the backward returns)."""
    plan = plan_shards([40, 3, 9, 1, 17, 2, 8], 2, "flashcp")  # 80 tokens, split documents
    heads, dim = 2, 4

    def program(rank, group):
        d = build_dispatch(plan, rank, comm)
        g = torch.Generator().manual_seed(rank)
        q, k, v = (torch.randn(plan.tokens_per_rank, heads, dim, generator=g, requires_grad=True) for _ in range(3))
        exchange = launch_kv_exchange(k, v, d, group)
        buffer = weakref.ref(exchange.buffer)
        k_all, v_all = gather_kv(k, v, exchange, d.kv_index, d, group)
        freed = buffer() is None
        handed = []
        k.register_hook(lambda grad: handed.append(grad.untyped_storage().nbytes()))
        out = varlen_attention(q, k_all, v_all, d.cu_seqlens_q, d.cu_seqlens_k, d.max_seqlen_q, d.max_seqlen_k)
        out.sum().backward()
        return freed, handed, d.recv_size

    local_kv_bytes = plan.tokens_per_rank * 2 * heads * dim * 4  # K and V side by side, float32
    for freed, handed, recv_size in run_ranks(2, program):
        assert freed and handed == [local_kv_bytes] and recv_size > 0
