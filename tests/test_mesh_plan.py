"""The mesh-scope planner (`flashcp.plan.mesh.plan_mesh`): one plan over all DP x CP ranks.

Random global batches: every rank holds the same tokens, every token is held exactly once (checked
token by token), documents that fit a rank's share of tokens and work stay whole, the plan depends on
the lengths alone, and with one node it is the per-group FlashCP plan. Constructed batches: a
document too heavy for a rank but not for a node is cut inside one node; one longer than a node
spans two nodes of two; heavy ones span the fewest nodes their work needs, so a rank receives few
documents' rows.
"""

from __future__ import annotations

import random

from hypothesis import given, HealthCheck, settings
from hypothesis import strategies as st

from flashcp import plan_shards
from flashcp.plan.mesh import plan_mesh
from flashcp.plan.plan import shard_workload

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# (dp, cp, ranks per node): one node, nodes of whole groups, groups over nodes, nodes of several groups
MESHES = [(1, 4, 8), (2, 4, 4), (4, 2, 4), (3, 4, 2), (4, 4, 8)]


@st.composite
def batches(draw: st.DrawFn) -> tuple[list[int], int, int, int]:
    """Document lengths of a global batch and its mesh; the last document is trimmed to fill it."""
    dp, cp, per_node = draw(st.sampled_from(MESHES))
    per_rank = draw(st.integers(1, 64))
    total = dp * cp * per_rank
    lens: list[int] = []
    while sum(lens) < total:
        lens.append(draw(st.integers(1, max(1, total // draw(st.sampled_from([1, 2, 8, 64]))))))
    lens[-1] -= sum(lens) - total
    return [x for x in lens if x], dp, cp, per_node


@SETTINGS
@given(batch=batches(), target=st.sampled_from([1.0, 1.03, 1.3]))
def test_every_token_once_and_equal_tokens(batch, target):
    lens, dp, cp, per_node = batch
    plan = plan_mesh(lens, dp, cp, per_node, target)
    assert plan.cp_size == dp * cp
    assert [sum(s.length for s in shards) for shards in plan.ranks] == [sum(lens) // (dp * cp)] * (dp * cp)
    held = [[0] * x for x in lens]
    for shards in plan.ranks:
        for s in shards:
            for t in range(s.start, s.start + s.length):
                held[s.doc][t] += 1
    assert all(count == 1 for doc in held for count in doc)


@SETTINGS
@given(batch=batches())
def test_deterministic_from_lengths(batch):
    lens, dp, cp, per_node = batch
    assert plan_mesh(lens, dp, cp, per_node).ranks == plan_mesh(list(lens), dp, cp, per_node).ranks


@SETTINGS
@given(batch=batches(), target=st.sampled_from([1.03, 1.05]))
def test_one_node_is_the_group_plan(batch, target):
    lens, dp, cp, _ = batch
    mesh = plan_mesh(lens, dp, cp, dp * cp, target)
    assert mesh.ranks == plan_shards(lens, dp * cp, "flashcp", target).ranks
    assert mesh.info["node_cut"] == []


def nodes_of(plan, doc: int) -> set[int]:
    g = plan.info["ranks_per_node"]
    return {r // g for r, shards in enumerate(plan.ranks) for s in shards if s.doc == doc}


def test_short_documents_stay_whole():
    """Many documents far below a rank's share of tokens and work: as in a group's plan, only the few
    cut where exact token counts need it (5 of 125 at CP 8), fewer than one a node across nodes."""
    lens = [(7 * i) % 50 + 10 for i in range(1000)]
    lens[-1] += (-sum(lens)) % 64
    plan = plan_mesh(lens, 8, 8, 8, 1.05)
    assert plan.metrics()["split_docs"] <= 0.05 * len(lens)
    assert len(plan.info["node_cut"]) <= 8
    assert plan.metrics()["imbalance"] <= 1.05


def test_heavy_document_cut_inside_one_node():
    """A document of half a rank's tokens, twice a rank's share of the work (the node holding it
    takes short documents beside it), is cut over the ranks of one node only."""
    per_rank, dp, cp = 4096, 4, 4
    lens = [per_rank // 2] + [128] * 336 + [1024] * 20
    plan = plan_mesh(lens, dp, cp, 4, 1.05)
    assert len(nodes_of(plan, 0)) == 1
    assert sum(1 for shards in plan.ranks if any(s.doc == 0 for s in shards)) > 1
    assert plan.info["node_cut"] == []
    assert plan.metrics()["imbalance"] <= 1.05 * 1.05


def test_long_document_spans_two_nodes():
    """Longer than a node: cut, over the two nodes of a two-node mesh; of the short ones at most one, to fill."""
    per_rank, cp = 1024, 4
    lens = [5 * per_rank] + [32] * (3 * per_rank // 32)
    plan = plan_mesh(lens, 2, cp, 4)
    assert nodes_of(plan, 0) == {0, 1}
    assert plan.info["node_cut"][0] == 0 and len(plan.info["node_cut"]) <= 2  # at most one filler besides
    work = [sum(shard_workload(s.start, s.length) for s in shards) for shards in plan.ranks]
    assert max(work) / (sum(work) / len(work)) <= 1.05 * 1.05


def test_heavy_documents_span_the_fewest_nodes():
    """Eight nodes of two ranks, four documents 1.5-2.4 times a node's mean work among short ones: each is
    cut over the fewest nodes its work needs (ceil(work / mean), plus at most one), not over all eight,
    so no rank receives more than two documents' rows (spreading all four over every node gave 9968 rows,
    three of them)."""
    rng = random.Random(1)
    lens = [3000, 2800, 2600, 2400]
    while sum(lens) < 8 * 4096:
        lens.append(rng.choice([8, 16, 32, 64]))
    lens[-1] -= sum(lens) - 8 * 4096
    plan = plan_mesh(lens, 8, 2, 2, 1.05)
    mean = sum(shard_workload(0, x) for x in lens) / 8
    for d in range(4):
        assert 1 < len(nodes_of(plan, d)) <= -(-shard_workload(0, lens[d]) // mean) + 1
        assert plan.info["spans"][d] >= len(nodes_of(plan, d))
    assert max(plan.needed_tokens()) <= 2 * max(lens)
    assert plan.metrics()["imbalance"] <= 1.05 * 1.05
