"""Deferral (`[data] balance = "deferral"`): every document trained once per epoch in windows of
exactly seq_len, none waiting longer than its bound, the pending queue in the loader's state so
that a resume (same or another DP size) continues exactly, every rank agreeing without talking.

Runs on the list-backed source of test_loader, whose token ids spell out (document, position).
"""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import torch
from test_loader import list_loader, STRIDE

from flashcp.data.balance import WindowCost
from flashcp.data.deferral import stream_pairs
from flashcp.data.errors import DataError

COST = WindowCost(dense_per_token=40.0, attn_per_pair=1.0)  # attention dominates long documents
SEQ = 128
LENS = [int(n) for n in np.random.default_rng(1).choice([5, 9, 17, 30, 50, 90, 128], 400)]


def deferring(dp_rank, dp, micro=2, max_delay=3, loop=False, prefetch=0, lens=LENS, cut=None, min_kept=0.99):
    loader = list_loader(lens, SEQ, dp_rank=dp_rank, dp_world=dp, loop=loop, prefetch=prefetch)
    loader.balance_with(micro, COST, cut, max_delay=max_delay, min_kept=min_kept)
    return loader


def run_steps(loaders, micro, steps=None):
    """Batches of every rank, step by step, until the data ends (or `steps` steps)."""
    out = []
    while steps is None or len(out) < steps:
        try:
            out.append([[next(loader) for _ in range(micro)] for loader in loaders])
        except StopIteration:
            break
    return out


def trained(steps) -> Counter:
    return Counter(t for step in steps for rank in step for b in rank for t in b["input"].tolist())


def check_once(tokens: Counter, lens=LENS):
    """No token twice; a document is trained whole or not at all (the data ended while it waited or
    before the stream reached it)."""
    assert max(tokens.values()) == 1
    docs = Counter(t // STRIDE for t in tokens)
    partial = [d for d, n in docs.items() if n != lens[d]]
    assert len(partial) <= 1  # at most the document the last step's window end cut


@pytest.mark.parametrize("dp, micro, max_delay", [(1, 1, 0), (2, 2, 3), (3, 1, 6)])
def test_every_document_once_in_full_windows_within_its_delay(dp, micro, max_delay):
    steps = run_steps([deferring(r, dp, micro, max_delay) for r in range(dp)], micro)
    assert len(steps) > 10
    check_once(trained(steps))
    for step in steps:
        figures = [b["deferral"] for rank in step for b in rank]
        assert all(f == figures[0] for f in figures)  # the same on every rank and micro step
        assert figures[0]["delay_max"] <= max_delay
        assert all(b["input"].numel() == SEQ and sum(b["doc_lens"]) == SEQ for rank in step for b in rank)
    delayed = sum(s[0][0]["deferral"]["delayed_tokens"] for s in steps)
    assert (delayed > 0) == (max_delay > 0)  # it deferred where allowed


@pytest.mark.parametrize("dp, micro, max_delay", [(1, 1, 3), (2, 2, 3), (3, 1, 6), (2, 1, 40)])
def test_the_data_end_flushes_the_queue_and_drops_only_the_last_incomplete_step(dp, micro, max_delay):
    """loop = false: as many steps as stream packing makes, every document that ever waited trained
    whole, and what is left untrained is less than one step (the last incomplete one)."""
    step_tokens = dp * micro * SEQ
    loaders = [deferring(r, dp, micro, max_delay) for r in range(dp)]
    steps, waited = [], set()
    while True:
        try:
            steps.append([[next(loader) for _ in range(micro)] for loader in loaders])
        except StopIteration:
            break
        waited |= {p[1] for p in loaders[0].state_dict()["deferral"]["pending"]}
    assert len(steps) == sum(LENS) // step_tokens  # stream packing's count
    tokens = trained(steps)
    assert max(tokens.values()) == 1 and sum(LENS) - len(tokens) < step_tokens
    docs = Counter(t // STRIDE for t in tokens)
    assert waited and all(docs[d] == LENS[d] for d in waited)
    assert all(b["input"].numel() == SEQ for step in steps for rank in step for b in rank)


def test_a_document_longer_than_a_window_waits_as_window_long_pieces():
    """Stream packing would cut it where its windows end (at 28, 156, ...: it starts 540 tokens in);
    waiting, it is trained as pieces of a whole window from its head on, and a rest."""
    lens = [9] * 60 + [300] + [9] * 200
    dp, micro = 2, 2
    steps = run_steps([deferring(r, dp, micro, max_delay=4, lens=lens) for r in range(dp)], micro)
    check_once(trained(steps), lens)
    pieces = []
    for step in steps:
        for b in (b for rank in step for b in rank):
            ends = np.cumsum(b["doc_lens"])
            for end, n in zip(ends.tolist(), b["doc_lens"]):
                first = int(b["input"][end - n])
                if first // STRIDE == 60:
                    pieces.append((first % STRIDE, n, b["deferral"]["delay_max"]))
    assert sorted(p[:2] for p in pieces) == [(0, 128), (128, 128), (256, 44)]
    assert all(p[2] > 0 for p in pieces)


def test_an_epoch_trains_each_document_once_with_looping():
    """1.5 epochs of a looping source: no document's tokens come more than twice, and all of the
    first epoch's (but the few still pending) come at least once."""
    lens = LENS[:120]
    steps = run_steps([deferring(r, 2, lens=lens, loop=True) for r in range(2)], 2, steps=3 * sum(lens) // (8 * SEQ))
    tokens = trained(steps)
    assert max(tokens.values()) <= 2
    docs = {t // STRIDE for t in tokens}
    assert len(docs) >= len(lens) - 8 and any(n == 2 for n in tokens.values())


@pytest.mark.parametrize("prefetch", [0, 2])
def test_resuming_with_a_pending_queue_continues_exactly(prefetch):
    dp, micro = 2, 2
    reference = deferring(1, dp, micro, prefetch=prefetch)
    want = [next(reference) for _ in range(20)]
    reference.close()
    for taken in (3, 6, 9):  # inside a step and after one
        first = deferring(1, dp, micro, prefetch=prefetch)
        for _ in range(taken):
            next(first)
        state = first.state_dict()
        first.close()
        assert state["deferral"]["pending"], "the queue travels in the state"
        json.loads(json.dumps(state))  # plain data: any checkpoint format keeps it
        again = deferring(1, dp, micro, prefetch=prefetch)
        again.load_state_dict(state)
        for w in want[taken:]:
            got = next(again)
            assert torch.equal(got["input"], w["input"]) and got["window"] == w["window"]
        again.close()


def test_resuming_under_another_dp_size_trains_every_document_once():
    micro = 2
    before = [deferring(r, 2, micro) for r in range(2)]
    first = run_steps(before, micro, steps=8)
    state = before[0].state_dict()
    assert state == before[1].state_dict() and state["deferral"]["pending"]
    after = [deferring(r, 3, micro) for r in range(3)]
    for loader in after:
        loader.load_state_dict(state)
    second = run_steps(after, micro)
    check_once(trained(first) + trained(second))
    pending = {p[1] for p in state["deferral"]["pending"]}
    assert pending <= {t // STRIDE for t in trained(second)}  # the queue was trained after the resume


def test_a_state_with_pending_documents_needs_deferral_to_resume():
    loader = deferring(0, 1, micro=1)
    next(loader)
    state = loader.state_dict()
    assert state["deferral"]["pending"]
    plain = list_loader(LENS, SEQ, loop=False)
    with pytest.raises(DataError, match="deferred documents"):
        plain.load_state_dict(state)


def test_deferral_cut_cuts_only_what_waiting_could_not_balance():
    steps = run_steps([deferring(r, 2, cut=1.05) for r in range(2)], 2)
    check_once(trained(steps))
    plain = run_steps([deferring(r, 2) for r in range(2)], 2)

    def spread(run):
        return np.mean([max(c) / np.mean(c) for c in ([COST(b["doc_lens"]) for r in s for b in r] for s in run)])

    assert spread(steps) < spread(plain)


def test_stream_pairs_cut_at_the_stream_windows():
    assert stream_pairs(np.array([0, 100, 6]), np.array([10, 60, 4]), 64).tolist() == [55.0, 406 + 528, 10.0]


def test_forced_steps_priced_by_the_layout_train_every_token_once_within_the_delay(monkeypatch):
    """A long-document mix (window-long and longer documents, which can only wait until forced):
    the forced steps' releases priced by the layout's cut keep the guarantees."""
    import flashcp.data.release as release

    priced = []
    layout = release._Price.layout
    monkeypatch.setattr(release._Price, "layout", lambda self, r: priced.append(1) or layout(self, r))
    rng = np.random.default_rng(3)
    lens = [int(n) for n in np.clip(rng.lognormal(np.log(40), 1.0, 600), 1, 400)]
    dp, micro, max_delay = 4, 1, 3
    steps = run_steps([deferring(r, dp, micro, max_delay, lens=lens, cut=1.05) for r in range(dp)], micro)
    assert len(steps) > 20 and priced
    check_once(trained(steps), lens)
    for step in steps:
        assert step[0][0]["deferral"]["delay_max"] <= max_delay
        assert all(b["input"].numel() == SEQ and sum(b["doc_lens"]) == SEQ for rank in step for b in rank)


def test_every_step_keeps_its_floor_of_stream_packings_pairs_and_a_resume_keeps_counting():
    """Long documents forced out without company: deferral-cut's cuts never take a step below
    `min_pairs_kept` (99 %) of the pairs stream packing keeps of that step's documents (a step may
    not spend what earlier ones gained), and the run's count travels in the state. With the floor
    at 0, balance takes what it needs."""
    rng = np.random.default_rng(3)
    lens = [int(n) for n in np.clip(rng.lognormal(np.log(40), 1.0, 600), 1, 400)]
    dp, micro = 4, 1
    steps = run_steps([deferring(r, dp, micro, 3, lens=lens, cut=1.05) for r in range(dp)], micro)
    figures = [step[0][0]["deferral"] for step in steps]
    assert min(f["pairs_kept"] for f in figures) >= 0.99
    free = run_steps([deferring(r, dp, micro, 3, lens=lens, cut=1.05, min_kept=0.0) for r in range(dp)], micro)
    assert min(step[0][0]["deferral"]["pairs_kept"] for step in free) < 0.9  # what the floor refuses
    first = deferring(0, dp, micro, 3, lens=lens, cut=1.05)
    for _ in range(10):
        next(first)
    state = first.state_dict()
    first.close()
    again = deferring(0, dp, micro, 3, lens=lens, cut=1.05)
    again.load_state_dict(json.loads(json.dumps(state)))
    assert [next(again)["deferral"] for _ in range(10)] == figures[10:20]
    again.close()
