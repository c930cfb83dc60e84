"""Sliding-window layers in the planners' workload and in the step model.

`Workload` against pairs counted query by query; plans balancing it (valid, their bookkeeping
and reported imbalance recounted, the default exactly today's causal plans); the kernel's tiles
under a window against an enumeration; one window layer's exchange, kernel and copies on a
hand-built plan; gpt-oss in the step model, layer kind by layer kind.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_costmodel import make_plan, synthetic_model

from flashcp import plan_shards
from flashcp.costmodel import AttentionShape
from flashcp.costmodel.fabric import multinode_model
from flashcp.costmodel.kernel import call_counts
from flashcp.costmodel.model import window_exchange
from flashcp.costmodel.step import GPT_OSS_20B, GPT_OSS_120B, LLAMA3_8B, MeshAssumptions, StepModel
from flashcp.plan import CAUSAL, Workload
from flashcp.plan.fill import RankFill
from flashcp.plan.hybrid import balanced_head_tail
from flashcp.plan.plan import shard_workload
from flashcp.plan.rebalance import rebalance
from flashcp.plan.whole_doc import place_documents
from flashcp.plan.window import window_needed_tokens

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def brute_work(workload: Workload, start: int, length: int) -> int:
    """Keys each query sees, query by query: p + 1 in a full layer, min(p + 1, W) in a window one."""
    window = workload.window or 0
    return sum(workload.full_layers * (p + 1) + workload.window_layers * min(p + 1, window)
               for p in range(start, start + length))  # fmt: skip


workloads = st.builds(
    Workload, st.integers(0, 4), st.integers(1, 4), st.integers(1, 300)
).filter(lambda w: w.full_layers + w.window_layers > 0)


@st.composite
def windows(draw) -> tuple[list[int], int]:
    """Short documents and a long one, padded onto a multiple of the CP size."""
    n = draw(st.sampled_from([2, 3, 4, 8]))
    lens = draw(st.lists(st.integers(1, 400), min_size=1, max_size=25))
    if draw(st.booleans()):
        lens.insert(draw(st.integers(0, len(lens))), draw(st.integers(400, 4000)))
    lens[-1] += (-sum(lens)) % n
    return lens, n


@SETTINGS
@given(workloads, st.integers(0, 600), st.integers(0, 600))
def test_workload_counts_the_pairs_of_both_layer_kinds(workload: Workload, start: int, length: int) -> None:
    assert workload.shard(start, length) == brute_work(workload, start, length)
    starts, lengths = np.array([start, 0, start + 7]), np.array([length, length, 1])
    expected = [workload.shard(s, x) for s, x in zip(starts, lengths)]
    assert workload.shards(starts, lengths).tolist() == expected


def test_the_default_workload_is_causal_pairs() -> None:
    for start, length in [(0, 0), (0, 1), (5, 9), (1000, 4096)]:
        assert CAUSAL.shard(start, length) == shard_workload(start, length)
        assert CAUSAL.shard(start, length) == brute_work(CAUSAL, start, length)
    # a window layer at W = 1 sees one key a query; W beyond the document is a full layer
    assert Workload(0, 1, 1).shard(3, 10) == 10
    assert Workload(0, 1, 10**6).shard(3, 10) == shard_workload(3, 10)


@pytest.mark.parametrize(
    ("args", "problem"),
    [((0, 0, None), "not both 0"), ((-1, 1, 4), ">= 0"), ((1, 1, None), "need a window"),
     ((1, 1, 0), "positive number of keys"), ((1, 0, True), "positive number of keys"),
     ((1.5, 0, None), "integers")],
)  # fmt: skip
def test_bad_workloads_are_refused(args: tuple, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        Workload(*args)


@SETTINGS
@given(windows(), st.sampled_from(["flashcp", "whole_doc"]))
def test_default_plans_are_todays(window: tuple[list[int], int], strategy: str) -> None:
    lens, n = window
    plain = plan_shards(lens, n, strategy)
    assert plain.workload == CAUSAL
    explicit = plan_shards(lens, n, strategy, workload=CAUSAL)
    assert (explicit.ranks, explicit.info) == (plain.ranks, plain.info)


@SETTINGS
@given(windows(), workloads, st.sampled_from([1.02, 1.05, 1.3]),
       st.sampled_from(["flashcp", "whole_doc", "per_doc"]))  # fmt: skip
def test_plans_balance_and_report_the_mixed_workload(
    window: tuple[list[int], int], workload: Workload, target: float, strategy: str
) -> None:
    """Plans for a mixed workload are valid (plan_shards validates), report its pairs recounted
    query by query, and the hybrid's target_met is judged on them."""
    lens, n = window
    plan = plan_shards(lens, n, strategy, target, workload=workload)
    work = [sum(brute_work(workload, s.start, s.length) for s in shards) for shards in plan.ranks]
    metrics = plan.metrics()
    assert metrics["workloads"] == work and plan.workloads() == work
    assert metrics["imbalance"] == pytest.approx(max(work) / (sum(work) / n))
    if strategy == "flashcp":
        assert plan.info["target_met"] == (metrics["imbalance"] <= target)


@SETTINGS
@given(windows(), workloads)
def test_placement_and_trades_keep_the_mixed_totals(
    window: tuple[list[int], int], workload: Workload
) -> None:
    lens, n = window
    lens = tuple(lens)
    fill = RankFill([sum(lens) // n] * n, workload=workload)
    place_documents(lens, range(len(lens)), fill)
    rebalance(lens, fill, 1.02 * sum(workload.shard(0, x) for x in lens) / n)
    for r, shards in enumerate(fill.shards):
        assert sum(s.length for s in shards) == sum(lens) // n
        assert fill.work[r] == sum(workload.shard(s.start, s.length) for s in shards)


def test_balanced_head_tail_solves_the_mixed_workload() -> None:
    """Per-Doc chunks sized for targets of a mixed workload: tokens exact, the returned workloads
    its own, and past the outermost rank (whose chunk starts the document) within a token's
    worth of what was asked (targets some nested layout reaches)."""
    workload, length, tokens = Workload(1, 3, 128), 12000, [2000, 3000, 4000, 3000]
    cost = workload.shard
    reference, _, _ = balanced_head_tail(3, length, tokens, [cost(0, length) / 4] * 4, 0, cost)
    wanted = [sum(cost(s.start, s.length) for s in shards) for shards in reference]
    out, got, _ = balanced_head_tail(3, length, tokens, wanted, 0, cost)
    assert got == [sum(cost(s.start, s.length) for s in shards) for shards in out]
    assert [sum(s.length for s in shards) for shards in out] == tokens
    assert sum(got) == cost(0, length)
    assert got == pytest.approx(wanted, abs=4 * length)  # a token's worth: 1 x length + 3 x W


# --- the step model --------------------------------------------------------------------------

W = 128
SHAPE = AttentionShape(heads=8, kv_heads=2, head_dim=64)


def brute_window_counts(q_lens, k_lens, heads, window, bq, bk):
    """Every (query block, key block) tile whose band some row of the block reaches, row by row."""
    ctas = tiles = 0
    for q, k in zip(q_lens, k_lens):
        if q == 0 or k == 0:
            continue
        for qb in range(0, q, bq):
            ctas += 1
            blocks: set[int] = set()
            for j in range(qb, min(qb + bq, q)):
                key = k - q + j  # the row's last key (bottom-right aligned)
                blocks.update(range(max(0, key - window + 1) // bk, key // bk + 1))
            tiles += len(blocks)
    return heads * ctas, heads * tiles


@SETTINGS
@given(
    st.lists(st.tuples(st.integers(0, 700), st.integers(0, 400)), min_size=1, max_size=4),
    st.integers(1, 3), st.integers(1, 500), st.sampled_from([(128, 128), (128, 64), (64, 64)]),
)  # fmt: skip
def test_window_tiles_match_enumeration(seqs, heads, window, blocks):
    q_lens = [q for q, _ in seqs]
    k_lens = [q + p for q, p in seqs]
    assert call_counts(q_lens, k_lens, heads, True, *blocks, window=window) == brute_window_counts(
        q_lens, k_lens, heads, window, *blocks
    )
    # a window reaching every key is the causal call
    everything = call_counts(q_lens, k_lens, heads, True, *blocks, window=10**6)
    assert everything == call_counts(q_lens, k_lens, heads, True, *blocks)


def test_a_window_layer_exchanges_the_rows_its_windows_reach():
    """Rank 0 holds the heads of both documents (3000 and 1000 tokens, not last), rank 1 their
    tails. A window layer all-gathers the last W - 1 = 127 rows of each head (254 on rank 0) or
    sends rank 1 exactly those; rank 1's calls see 2000 queries over 2000 + 127 keys, band only;
    each rank copies local + sent + key rows: 4000 + 254 + 4000 = 4000 + 0 + 4254."""
    plan = make_plan([5000, 3000], [[(0, 0, 3000), (1, 0, 1000)], [(0, 3000, 2000), (1, 1000, 2000)]])
    model, row = synthetic_model(), SHAPE.kv_row_bytes
    compact = model.collective_step(plan, "compact", SHAPE, window=W)
    assert compact.comm_fwd == pytest.approx(model.comm.all_gather_ms(254 * row, 2))
    assert compact.comm_bwd == pytest.approx(model.comm.reduce_scatter_ms(254 * row, 2))
    needed = model.collective_step(plan, "needed", SHAPE, window=W)
    assert needed.comm_fwd == needed.comm_bwd == pytest.approx(model.comm.all_to_all_ms(254 * row, 2))
    k = model.kernel
    calls = [([3000, 1000], [3000, 1000]), ([2000, 2000], [2127, 2127])]
    assert compact.per_rank_fwd == [k.fwd.time_ms(*k.counts(q, kk, 8, True, 64, W)) for q, kk in calls]
    assert compact.per_rank_bwd == [k.bwd.time_ms(*k.counts(q, kk, 8, True, 64, W)) for q, kk in calls]
    assert compact.other_fwd == pytest.approx(model.memory.ms(2 * row * 8254))
    full = model.collective_step(plan, "compact", SHAPE)
    assert compact.attn_fwd < full.attn_fwd and compact.comm_fwd < full.comm_fwd
    # On one node the two-level exchange is the needed one, window layers included (the fabric model
    # prices groups spanning nodes).
    assert model.collective_step(plan, "two_level", SHAPE, window=W) == needed


def test_the_baselines_window_layers_exchange_a_halo():
    """Llama3 CP's per_seq plan of [300, 200] on 2 ranks, W = 16: rank 0 holds document 0's
    [0, 125) and document 1's [75, 200), rank 1 the rest; each needs the 15 rows before its cut
    (a halo, point to point), where its full layers all-gather 250 rows a rank. FlashCP's system
    with window_comm = "compact" all-gathers the 15 rows its one non-last shard a rank can send.
    Ring systems take no window."""
    plan = plan_shards([300, 200], 2, "per_seq")
    expected = [[(0, 0, 125), (1, 75, 125)], [(0, 125, 175), (1, 0, 75)]]
    assert [list(shards) for shards in plan.ranks] == expected
    model, row = synthetic_model(), SHAPE.kv_row_bytes
    halo = model.step("llama3", SHAPE, {"per_seq": plan}, window=16)
    assert halo.comm_fwd == halo.comm_bwd == pytest.approx(model.comm.all_to_all_ms(15 * row, 2))
    assert model.step("llama3", SHAPE, {"per_seq": plan}).comm_fwd == pytest.approx(
        model.comm.all_gather_ms(250 * row, 2))  # fmt: skip
    compact = model.step("flashcp", SHAPE, {"flashcp": plan}, window=16, window_comm="compact")
    assert compact.comm_fwd == pytest.approx(model.comm.all_gather_ms(15 * row, 2))
    with pytest.raises(ValueError, match="ring systems take no window"):
        model.step("zigzag", SHAPE, {"per_seq": plan}, window=16)


def test_a_halo_across_nodes_is_priced_at_the_ring_rate():
    plan = plan_shards([4096] * 8, 16, "per_seq")
    model, row = multinode_model(synthetic_model()), SHAPE.kv_row_bytes
    rows = max(window_needed_tokens(plan, W))
    assert rows == 2 * (W - 1)  # both chunks of a rank but the first start mid-document
    t = model.step("llama3", SHAPE, {"per_seq": plan}, window=W)
    assert t.comm_fwd == pytest.approx(model.comm.all_to_all_ms(rows * row, 16))


def test_gpt_oss_steps_price_each_layer_kind():
    """gpt-oss-20b: 12 full and 12 window layers, each kind priced on the same plan, FlashCP's
    plan balancing both kinds; the shapes' counted active parameters are the model card's."""
    attention, cp, lens = synthetic_model(), 4, [512] * 24 + [4096]
    assert GPT_OSS_20B.workload == GPT_OSS_120B.workload == Workload(1, 1, W)
    assert LLAMA3_8B.workload == CAUSAL
    assert GPT_OSS_20B.dense_flops_per_token / 6 == pytest.approx(3.61e9, rel=0.01)
    assert GPT_OSS_120B.dense_flops_per_token / 6 == pytest.approx(5.13e9, rel=0.01)
    model = StepModel(attention, GPT_OSS_20B, cp, 1, MeshAssumptions(full_ac=False))
    for system, strategy in (("llama3", "per_seq"), ("per_doc", "per_doc"), ("flashcp", "flashcp")):
        plan = plan_shards(lens, cp, strategy, workload=Workload(1, 1, W))
        assert model.plan(strategy, lens) == plan and model.plan(strategy, lens).workload == Workload(1, 1, W)
        full = attention.step(system, GPT_OSS_20B.attention, {strategy: plan})
        window = attention.step(system, GPT_OSS_20B.attention, {strategy: plan}, window=W)
        expected = 12 * full.training + 12 * window.training
        assert model.step(system, [[lens]]).attention == pytest.approx(expected)
        assert window.training < full.training


def test_window_layers_exchange_by_the_rule_the_trainer_follows():
    """window_exchange: auto picks needed beside compact, full and needed, two_level beside two_level;
    an explicit mode is kept; two_level beside another comm, the ring and unknown names are refused."""
    for comm in ("compact", "full", "needed"):
        assert window_exchange(comm) == "needed"
        assert [window_exchange(comm, w) for w in ("compact", "full", "needed")] == ["compact", "full", "needed"]
        refused = f"^window_comm = 'two_level' needs comm = 'two_level' .*got comm = '{comm}'$"
        with pytest.raises(ValueError, match=refused):
            window_exchange(comm, "two_level")
    assert window_exchange("two_level") == window_exchange("two_level", "two_level") == "two_level"
    assert window_exchange("two_level", "compact") == "compact"
    with pytest.raises(ValueError, match="not comm = 'ring'"):
        window_exchange("ring")
    with pytest.raises(ValueError, match="^unknown window exchange 'halo'"):
        window_exchange("compact", "halo")


def test_flashcp_window_layers_are_priced_needed_unless_told_otherwise():
    """On a plan that cuts most documents (five of 3000 tokens on 8 ranks of 2048), FlashCP's compact
    all-gather of a window layer pads every rank to the busiest sender: the step model prices FlashCP's
    window layers with the needed all-to-all-v under auto, the compact all-gather only when asked, and
    its full layers compact either way."""
    attention, lens = synthetic_model(), [3000] * 5 + [1384]
    model = StepModel(attention, GPT_OSS_20B, 8, 1, MeshAssumptions(full_ac=False))
    plan = model.plan("flashcp", lens)
    shape, row = GPT_OSS_20B.attention, GPT_OSS_20B.attention.exchange_row_bytes
    needed = attention.collective_step(plan, "needed", shape, window=W)
    compact = attention.collective_step(plan, "compact", shape, window=W)
    assert needed.comm_fwd == pytest.approx(attention.comm.all_to_all_ms(max(window_needed_tokens(plan, W)) * row, 8))
    assert needed.comm_fwd < compact.comm_fwd
    full = attention.collective_step(plan, "compact", shape)
    assert model.step("flashcp", [[lens]]).attention == pytest.approx(12 * full.training + 12 * needed.training)
    told = StepModel(attention, GPT_OSS_20B, 8, 1, MeshAssumptions(full_ac=False), window_comm="compact")
    assert told.step("flashcp", [[lens]]).attention == pytest.approx(12 * full.training + 12 * compact.training)
    with pytest.raises(ValueError, match="^unknown window exchange 'halo'"):
        StepModel(attention, GPT_OSS_20B, 8, 1, window_comm="halo")
