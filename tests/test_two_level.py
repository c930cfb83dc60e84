"""The two-level KV exchange (CP groups spanning nodes) equals single-process attention on gloo.

Four gloo ranks play two nodes of two (`ranks_per_node=2`), four nodes of one and one node of
four; each case runs `cp_varlen_attention(comm="two_level")` forward and backward and compares
output and dq/dk/dv with the float64 oracle of tests/test_cp_attention.py (same tolerances). The
rows every stage moves, recorded per rank (`record_comm`: "two_level_inter" over the fabric,
"two_level_intra" over NVLink), must equal `flashcp.plan.nodes.node_traffic`'s counts, and the
fabric rows must never exceed the flat needed exchange's. Window layers (`window=W`) and sinks
run in one process (flashcp.attention.simulate) against the dense oracle of tests/dense_attention.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from distributed_pool import DistributedPool
from hypothesis import given, settings
from hypothesis import strategies as st
from test_cp_attention import EDGE_WINDOWS, TOL, Case, oracle, window_tensors
from test_window_sinks import assert_all_close, run_op, windows as window_layers
from test_window_sinks import oracle as window_oracle

from flashcp import plan_shards
from flashcp.attention import build_two_level_dispatch, cp_varlen_attention, record_comm
from flashcp.dispatch import build_dispatch
from flashcp.plan.nodes import node_metrics, node_traffic
from flashcp.plan.plan import Plan, Shard
from flashcp.plan.window import window_needed_tokens

STRATEGIES = ("flashcp", "per_doc", "per_seq", "whole_doc")


def run_two_level(rank: int, group, cases: list[tuple]):
    """Worker: forward + backward of every (plan, ranks_per_node, heads, dtype, seed) on this rank."""
    results = []
    for plan, g, heads, dtype, seed, *overlap in cases:
        overlap = bool(overlap and overlap[0])
        dispatch = build_two_level_dispatch(plan, rank, g, overlap)
        idx = dispatch.token_index
        q, k, v, w = (t[idx].clone() for t in window_tensors(plan.context, heads, dtype, seed))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        with record_comm() as log:
            out = cp_varlen_attention(q, k, v, dispatch, group, comm="two_level", backend="reference",
                                      overlap=overlap)  # fmt: skip
            (out * w).sum().backward()
        results.append((idx, out.detach(), q.grad, k.grad, v.grad, list(log)))
    return results


@pytest.fixture(scope="module")
def pool():
    with DistributedPool(world_size=4, sizes=(2, 4)) as p:
        yield p


def check(pool: DistributedPool, cases: list[tuple]) -> None:
    """Run `cases` (all on one CP size), compare with the oracle and the plan's row counts."""
    size = cases[0][0].cp_size
    per_rank = pool.run(run_two_level, (cases,), size=size)
    for i, (plan, g, heads, dtype, seed, *_) in enumerate(cases):
        what = f"{plan.strategy} N={size} g={g} docs={plan.doc_lens} {dtype}"
        want = oracle(Case(plan, "two_level", heads=heads, seed=seed))
        got = [torch.empty_like(x) for x in want]
        for rank_results in per_rank:
            idx, *tensors, _ = rank_results[i]
            for full, local in zip(got, tensors):
                full[idx] = local.double()
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            torch.testing.assert_close(a, b, **TOL[dtype], msg=lambda m: f"{what} {name}: {m}")
        t = node_traffic(plan, g)
        for r, rank_results in enumerate(per_rank):
            log = rank_results[i][-1]
            rows = {(x.op, x.pass_): (x.sent_rows, x.recv_rows) for x in log}
            assert len(rows) == len(log) == 4, (what, log)  # two stages each way, once
            assert rows[("two_level_inter", "forward")] == (t.stage1_send[r], t.stage1_recv[r]), what
            assert rows[("two_level_intra", "forward")] == (t.stage2_send[r], t.stage2_recv[r]), what
            # the backward moves the same rows back
            assert rows[("two_level_inter", "backward")] == (t.stage1_recv[r], t.stage1_send[r]), what
            assert rows[("two_level_intra", "backward")] == (t.stage2_recv[r], t.stage2_send[r]), what


@pytest.mark.parametrize("layout", [(4, 2), (4, 1), (4, 4), (2, 1)], ids=lambda x: f"N{x[0]}g{x[1]}")
@pytest.mark.parametrize("window", EDGE_WINDOWS, ids=list(EDGE_WINDOWS))
def test_edge_windows_match_single_process(pool, window, layout):
    n, g = layout
    doc_lens = list(EDGE_WINDOWS[window])
    doc_lens[-1] += -sum(doc_lens) % n
    plans = [plan_shards(doc_lens, n, s) for s in STRATEGIES]
    check(pool, [(p, g, h, torch.float64, 1) for p in plans for h in ((2, 2, 8), (4, 1, 4))])


@pytest.mark.parametrize("g", [1, 2])
def test_overlap_gives_the_same_result(pool, g):
    """Local-only shards run while stage 1 is in flight; stage 2 runs at the wait."""
    plans = [plan_shards([40, 3, 9, 1, 17, 2, 8], 4, s) for s in STRATEGIES]  # whole and split documents
    check(pool, [(p, g, (4, 2, 8), torch.float64, 3, True) for p in plans])


def test_float32(pool):
    plans = [plan_shards([19, 6, 1, 14, 8], 4, s) for s in STRATEGIES]
    check(pool, [(p, 2, (6, 2, 4), torch.float32, 2) for p in plans])


@st.composite
def windows(draw):
    doc_lens = draw(st.lists(st.integers(1, 30), min_size=1, max_size=10))
    if sum(doc_lens) % 4:
        doc_lens.append(-sum(doc_lens) % 4)
    return doc_lens, draw(st.sampled_from(STRATEGIES)), draw(st.integers(0, 2**16))


@settings(max_examples=20, deadline=None)
@given(windows())
def test_random_windows_two_nodes_of_two(pool, window):
    doc_lens, strategy, seed = window
    check(pool, [(plan_shards(doc_lens, 4, strategy), 2, (2, 1, 4), torch.float64, seed)])


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(1, 400), min_size=1, max_size=40),
    st.sampled_from([(8, 2), (8, 4), (16, 4), (16, 8)]),
    st.sampled_from(STRATEGIES),
)
def test_fabric_rows_never_exceed_the_flat_exchange(doc_lens, layout, strategy):
    """Each piece crosses into a node at most once, where the flat exchange sends it to every rank
    of that node that needs it; with one rank per node the two are the same."""
    n, g = layout
    doc_lens.append(-sum(doc_lens) % n or n)
    plan = plan_shards(doc_lens, n, strategy)
    t, flat = node_traffic(plan, g), node_traffic(plan, 1)
    totals = t.totals()
    assert totals["two_level_inter"] <= totals["flat_inter"]
    assert flat.totals()["two_level_inter"] == flat.totals()["flat_inter"]
    # every rank still gets every row it needs: from the fabric (its own stage 1 share or a
    # node-mate's forward) or from a node-mate's own rows
    assert [sum(row) for row in t.needed] == plan.needed_tokens()
    same_node = sum(t.needed[r][s] for r in range(n) for s in range(n) if r // g == s // g)
    assert sum(t.flat_inter_recv) + same_node == sum(plan.needed_tokens())
    # every fabric row leaves through one NIC (its node's on the receiver's rail) and enters one
    assert sum(t.flat_inter_send) == sum(t.flat_inter_recv) == totals["flat_inter"]


def test_shared_prefix_crosses_the_fabric_once():
    """Llama3 CP's chunks cut document 0 (40 tokens) into one piece per rank: with nodes {0, 1}
    and {2, 3}, ranks 2 and 3 both need rank 0's and rank 1's pieces (40 rows flat, 20 two-level);
    document 2 (30 tokens) runs back from rank 3 to rank 0, so ranks 0 and 1 need rank 3's 2 and
    rank 2's 10 rows (24 flat, 12 two-level)."""
    plan = plan_shards([40, 8, 30, 2], 4, "per_seq")
    m = node_metrics(plan, 2, row_bytes=16)
    assert (m["fabric_rows_flat"], m["fabric_rows_two_level"]) == (64, 32)
    assert m["fabric_saving"] == 0.5
    assert m["two_level_inter_bytes"] == 16 * m["two_level_inter_rows"]


def test_ranks_per_node_must_divide_the_cp_size():
    plan = plan_shards([12, 12], 4, "flashcp")
    with pytest.raises(ValueError, match="ranks_per_node=3 must be a positive divisor of the CP size 4"):
        build_two_level_dispatch(plan, 0, 3)
    with pytest.raises(ValueError, match="ranks_per_node=3 must divide the CP size 4"):
        node_traffic(plan, 3)


def test_planner_cli_reports_the_fabric_rows_of_both_exchanges(capsys):
    from flashcp.plan.__main__ import main

    assert main(["--lengths", "40,8,30,2", "--cp", "4", "--strategy", "per_seq", "--ranks-per-node", "2",
                 "--json"]) == 0  # fmt: skip
    summary = json.loads(capsys.readouterr().out)["per_seq"]
    plan = plan_shards([40, 8, 30, 2], 4, "per_seq")
    t, full = node_traffic(plan, 2), plan.metrics()["comm_full_tokens"]
    flat = max(max(t.flat_inter_send), max(t.flat_inter_recv))
    staged = max(max(t.stage1_send), max(t.stage1_recv))
    assert summary["fabric_flat_inter_ratio"]["mean"] == pytest.approx(flat / full)
    assert summary["fabric_two_level_inter_ratio"]["mean"] == pytest.approx(staged / full)
    assert staged < flat
    with pytest.raises(SystemExit) as bad:
        main(["--lengths", "12,12", "--cp", "4", "--ranks-per-node", "3"])
    assert bad.value.code == 2
    assert "ranks_per_node=3 must divide the CP size 4" in capsys.readouterr().err


def test_one_rank_needs_no_process_group():
    plan = plan_shards([29, 3, 1, 2, 5, 4], 1, "flashcp")
    ((idx, *got, log),) = run_two_level(0, None, [(plan, 1, (2, 2, 8), torch.float64, 0)])
    assert log == [] and idx.tolist() == list(range(plan.context))
    for a, b in zip(got, oracle(Case(plan, "two_level"))):
        torch.testing.assert_close(a, b, **TOL[torch.float64])


def _check_window(plan, g: int, window: int, seed: int, overlap: bool = False) -> None:
    """Dense oracle (sinks included); each rank receives exactly the rows its windows reach, and the
    fabric carries at most the flat needed exchange's inter-node rows."""
    n = plan.cp_size

    def dispatch(plan, rank, comm, overlap, window):
        return build_two_level_dispatch(plan, rank, g, overlap, window)

    what = f"{plan.strategy} {plan.ranks} g={g} W={window} overlap={overlap}"
    got, _ = run_op(plan, "two_level", window, (2, 1, 4), seed, overlap=overlap, dispatch=dispatch)
    assert_all_close(got, window_oracle(list(plan.doc_lens), (2, 1, 4), seed, window, True), what)
    two = [dispatch(plan, r, "two_level", overlap, window) for r in range(n)]
    assert [d.recv_size for d in two] == window_needed_tokens(plan, window), what
    flat = [build_dispatch(plan, r, "needed", window=window) for r in range(n)]
    flat_inter = sum(d.recv_splits[s] for r, d in enumerate(flat) for s in range(n) if s // g != r // g)
    assert sum(sum(d.route.stage1_recv_splits) for d in two) <= flat_inter, what


def test_window_forwards_each_rank_its_own_suffix():
    """One 64-token document in four 16-row pieces, nodes {0, 1} and {2, 3}, W = 24: rank 1's piece
    [16, 32) crosses the fabric once as the 16 rows rank 2 needs, and rank 3 keeps the 7 it needs
    (rank 0's piece: 7 rows for rank 2, none for rank 3)."""
    plan = Plan((64,), 4, tuple((Shard(0, 16 * r, 16),) for r in range(4)), "hand")
    routes = [build_two_level_dispatch(plan, r, 2, window=24).route for r in range(4)]
    assert routes[1].stage1_send_splits == [0, 0, 0, 16] and routes[0].stage1_send_splits == [0, 0, 7, 0]
    assert routes[3].stage2_send_splits == [0, 0, 16, 7]
    _check_window(plan, 2, 24, seed=0)


@pytest.mark.parametrize("g", [1, 2, 4])
def test_window_layers_match_dense(g):
    doc_lens = [37, 2, 11, 5, 1, 23, 9, 7, 1]
    for strategy in ("flashcp", "per_seq"):  # a few cut documents; every document cut over all ranks
        for window in (1, 6, 64):
            _check_window(plan_shards(doc_lens, 4, strategy), g, window, seed=window, overlap=window == 6)


@settings(max_examples=10, deadline=None)
@given(window_layers())
def test_random_window_layers_match_dense(case):
    plan, window, seed = case
    _check_window(plan, plan.cp_size // 2, window, seed)
