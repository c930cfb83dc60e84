"""Building a dispatch: equal to the row-by-row construction it replaced, sized by what the rank
holds and receives; moving it to the device: every tensor (the overlap split's too), pinned,
non-blocking."""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.core_memory import LargestTensor
from flashcp import plan_shards
from flashcp.dispatch import build_dispatch, COMM_MODES, Dispatch
from flashcp.plan import STRATEGIES, Plan, Shard
from flashcp.plan.plan import normalize, validate


def _tensors(d: Dispatch) -> list[torch.Tensor]:
    split = d.overlap
    nested = [] if split is None else [split.inverse, *vars(split.local).values(), *vars(split.remote).values()]
    return [t for t in [*vars(d).values(), *nested] if isinstance(t, torch.Tensor)]


def _dispatch() -> Dispatch:
    return build_dispatch(plan_shards([40, 3, 9, 1, 17, 2, 8], 2, "flashcp"), 1, "compact", overlap=True)


def test_to_moves_every_tensor_without_blocking(monkeypatch):
    d = _dispatch()
    calls = []
    original = torch.Tensor.to

    def to(self, *args, **kwargs):
        calls.append(kwargs.get("non_blocking"))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    moved = d.to("meta")
    assert len(calls) == len(_tensors(d)) == 15 and all(calls)
    assert all(t.device.type == "meta" for t in _tensors(moved))
    assert (moved.max_seqlen_q, moved.overlap.local.max_seqlen_k) == (d.max_seqlen_q, d.overlap.local.max_seqlen_k)


def test_pin_memory_pins_every_tensor(monkeypatch):
    """torch pins only where an accelerator exists; here the pinning call is recorded instead."""
    d = _dispatch()
    pinned = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: pinned.append(t) or t.clone())
    out = d.pin_memory()
    assert len(pinned) == len(_tensors(d))
    assert all(torch.equal(a, b) for a, b in zip(_tensors(out), _tensors(d)))


def test_overlap_split_partitions_the_shards():
    d = _dispatch()
    split = d.overlap
    rows = torch.cat([split.local.rows, split.remote.rows])
    assert torch.equal(rows[split.inverse], torch.arange(d.token_index.numel()))
    assert bool((split.remote.kv_index < d.recv_size).any())  # remote shards read received rows
    assert bool((split.local.kv_index >= 0).all()) and bool((split.local.kv_index < d.token_index.numel()).all())
    assert build_dispatch(plan_shards([8, 8], 2, "per_doc"), 0).overlap is None  # only on request


def reference_dispatch(plan: Plan, rank: int, comm: str) -> dict:
    """Rank `rank`'s dispatch from tables over every window row, the construction `build_dispatch`
    replaced (O(C) per rank, O(N C) for "needed"): each row's owner, local row and buffer row."""
    n, per_rank, context = plan.cp_size, plan.tokens_per_rank, plan.context
    doc_off = [0, *itertools.accumulate(plan.doc_lens)]
    owner, local, sent, order = [0] * context, [0] * context, [False] * context, []
    for r, shards in enumerate(plan.ranks):
        for s in shards:
            for g in range(doc_off[s.doc] + s.start, doc_off[s.doc] + s.start + s.length):
                owner[g], local[g], sent[g] = r, len(order) - r * per_rank, not plan.is_last(s)
                order.append(g)
    send_splits, recv_splits = [], []
    if comm == "full":
        buf, send, pad = {g: owner[g] * per_rank + local[g] for g in order}, list(range(per_rank)), per_rank
        recv = n * per_rank
    elif comm == "compact":
        rows = [[g for g in order[r * per_rank : (r + 1) * per_rank] if sent[g]] for r in range(n)]
        pad = max(map(len, rows))
        buf = {g: r * pad + k for r in range(n) for k, g in enumerate(rows[r])}
        send, recv = [local[g] for g in rows[rank]], n * pad
    else:
        reach = [{} for _ in range(n)]  # per rank: document -> start of its furthest shard there
        for r, shards in enumerate(plan.ranks):
            for s in shards:
                reach[r][s.doc] = max(reach[r].get(s.doc, 0), s.start)
        need = [
            [g for d, end in sorted(reach[q].items()) for g in range(doc_off[d], doc_off[d] + end) if owner[g] != q]
            for q in range(n)
        ]
        to_peer = [[local[g] for g in need[q] if owner[g] == rank] for q in range(n)]
        received = sorted(need[rank], key=lambda g: owner[g])  # stable: window order within a source
        buf, send, pad, recv = {g: i for i, g in enumerate(received)}, sum(to_peer, []), 0, len(received)
        send_splits = [len(rows) for rows in to_peer]
        recv_splits = [sum(owner[g] == q for g in received) for q in range(n)]
    mine = plan.ranks[rank]
    keys = [g for s in mine for g in range(doc_off[s.doc], doc_off[s.doc] + s.start + s.length)]
    return dict(
        token_index=[g for s in mine for g in range(doc_off[s.doc] + s.start, doc_off[s.doc] + s.start + s.length)],
        positions=[p for s in mine for p in range(s.start, s.start + s.length)],
        cu_seqlens_q=[0, *itertools.accumulate(s.length for s in mine)],
        cu_seqlens_k=[0, *itertools.accumulate(s.start + s.length for s in mine)],
        send_index=send,
        send_pad=pad,
        send_splits=send_splits,
        recv_splits=recv_splits,
        recv_size=recv,
        kv_index=[recv + local[g] if owner[g] == rank else buf[g] for g in keys],
    )


def shuffled_plan(doc_lens: list[int], cp_size: int, cuts: list[int], seed: int) -> Plan:
    """An arbitrary valid plan: the window cut at `cuts` (and between documents), the pieces in a
    random order, dealt out tokens_per_rank rows per rank (which may cut them again)."""
    rows = [(d, i) for d, length in enumerate(doc_lens) for i in range(length)]
    bounds = sorted({0, len(rows), *cuts, *itertools.accumulate(doc_lens)})
    pieces = [rows[a:b] for a, b in zip(bounds, bounds[1:])]
    random.Random(seed).shuffle(pieces)
    dealt = [row for piece in pieces for row in piece]
    per_rank = len(rows) // cp_size
    ranks = [[Shard(d, i, 1) for d, i in dealt[r * per_rank : (r + 1) * per_rank]] for r in range(cp_size)]
    plan = Plan(tuple(doc_lens), cp_size, normalize(ranks), "shuffled")
    validate(plan)
    return plan


@st.composite
def plans(draw) -> Plan:
    cp_size = draw(st.sampled_from([1, 2, 3, 4, 8]))
    doc_lens = draw(st.lists(st.integers(1, 30), min_size=1, max_size=12))
    if sum(doc_lens) % cp_size:
        doc_lens.append(-sum(doc_lens) % cp_size)
    strategy = draw(st.sampled_from([s for s in STRATEGIES if s != "ilp"] + ["shuffled"]))
    if strategy != "shuffled":
        return plan_shards(doc_lens, cp_size, strategy)
    cuts = draw(st.lists(st.integers(1, sum(doc_lens) - 1), max_size=8)) if sum(doc_lens) > 1 else []
    return shuffled_plan(doc_lens, cp_size, cuts, draw(st.integers(0, 2**16)))


def assert_matches_reference(plan: Plan) -> None:
    for comm in COMM_MODES:
        for rank in range(plan.cp_size):
            d, want = build_dispatch(plan, rank, comm), reference_dispatch(plan, rank, comm)
            got = {k: v.tolist() if isinstance(v := getattr(d, k), torch.Tensor) else v for k in want}
            assert got == want, f"{plan.strategy} {comm} rank {rank}: {plan.ranks}"
            assert d.kv_index.dtype == torch.long and d.cu_seqlens_k.dtype == torch.int32


@settings(max_examples=150, deadline=None)
@given(plans())
def test_dispatch_equals_the_window_table_construction(plan):
    """Every strategy but "ilp" (a second per window; below) and arbitrary shuffled plans."""
    assert_matches_reference(plan)


@pytest.mark.parametrize("cp_size", [2, 4])
def test_ilp_dispatch_equals_the_window_table_construction(cp_size):
    assert_matches_reference(plan_shards([13, 7, 5, 11, 3, 9], cp_size, "ilp", target_imbalance=2.0, time_limit=60.0))


# 12 documents of 6 to 3000 tokens, 24 times over: a window of 146,736 tokens (9,171 per rank at N = 16).
SIZED_WINDOW = [600, 6, 90, 1500, 33, 250, 8, 420, 60, 3000, 17, 130] * 24


@pytest.mark.parametrize("strategy", ["flashcp", "whole_doc", "per_seq", "per_doc"])
@pytest.mark.parametrize("comm", COMM_MODES)
def test_dispatch_is_sized_by_the_rank_not_the_window(strategy, comm):
    """A dispatch's tensors, and every temporary made while building them, are bounded by the
    rank's tokens, the rows it sends and receives and its shards' keys (which re-read a
    document's rows once per piece of it the rank holds), not by the window."""
    plan = plan_shards(SIZED_WINDOW, 16, strategy)
    per_rank, pieces = plan.tokens_per_rank, sum(map(len, plan.ranks))
    largest = 0
    for rank in range(plan.cp_size):
        with LargestTensor() as made:
            d = build_dispatch(plan, rank, comm, overlap=True)
        shards = plan.ranks[rank]
        pieces_per_doc = max(Counter(s.doc for s in shards).values())
        assert d.token_index.numel() == d.positions.numel() == per_rank
        assert d.cu_seqlens_q.numel() == d.cu_seqlens_k.numel() == len(shards) + 1
        sent = sum(d.send_splits) if comm == "needed" else per_rank
        assert d.send_index.numel() <= sent
        assert d.kv_index.numel() == int(d.cu_seqlens_k[-1])
        assert d.kv_index.numel() <= pieces_per_doc * (per_rank + plan.needed_tokens()[rank])
        assert made.numel <= max(per_rank, sent, d.kv_index.numel(), 3 * pieces)  # 3 * pieces: the plan
        largest = max(largest, made.numel)
    if strategy in ("flashcp", "whole_doc") and comm != "full":  # where those bounds are far below C
        assert largest < plan.context // 2, largest
