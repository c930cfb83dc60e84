"""The loader's mesh balance (`[data] balance`): a step trains the documents stream packing would
give it, each token once over the DP ranks, in windows of exactly seq_len whose labels follow the
documents; pieces are cut only as the mode allows; every rank agrees without talking; resuming
inside or after a step continues exactly; a token store is read only for this rank's windows.

Runs on the list-backed source of test_loader, whose token ids spell out (document, position).
"""

from __future__ import annotations

import functools
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_loader import check_pieces, list_loader, ListSource, STRIDE

from flashcp import plan_shards
from flashcp.data.balance import WindowCost
from flashcp.data.loader import WindowLoader, WindowPacker
from flashcp.data.errors import DataError
from flashcp.data.sources import DataConfig

COST = WindowCost(dense_per_token=40.0, attn_per_pair=1.0)  # attention dominates long documents
MODES = {"mesh": None, "mesh-cut": 1.05}


def balanced(lens, seq_len, dp_rank, dp, micro, target, prefetch=0, loop=True) -> WindowLoader:
    loader = list_loader(lens, seq_len, dp_rank=dp_rank, dp_world=dp, prefetch=prefetch, loop=loop)
    loader.balance_with(micro, COST, target)
    return loader


def step_tokens(loaders, micro) -> Counter:
    """The tokens the ranks' loaders give in one step of `micro` batches each."""
    return Counter(t for loader in loaders for _ in range(micro) for t in next(loader)["input"].tolist())


@settings(max_examples=40, deadline=None)
@given(
    lens=st.lists(st.integers(1, 400), min_size=1, max_size=30),
    seq_len=st.integers(8, 120),
    dp=st.integers(1, 4),
    micro=st.integers(1, 3),
    mode=st.sampled_from(sorted(MODES)),
    steps=st.integers(1, 3),
)
def test_a_balanced_step_trains_the_stream_steps_tokens_each_once(lens, seq_len, dp, micro, mode, steps):
    off = [list_loader(lens, seq_len, dp_rank=r, dp_world=dp) for r in range(dp)]
    on = [balanced(lens, seq_len, r, dp, micro, MODES[mode]) for r in range(dp)]
    for _ in range(steps):
        assert step_tokens(on, micro) == step_tokens(off, micro)
    for rank, loader in enumerate(on):  # after the steps: the same cursor, and further windows well formed
        assert loader.state_dict() == off[rank].state_dict()
        batch = next(loader)
        assert sum(batch["doc_lens"]) == seq_len == len(batch["input"])
        check_balanced_pieces(batch, lens)


def check_balanced_pieces(batch, lens):
    """Each piece is consecutive tokens of one document; labels follow the document, -100 at its end."""
    tokens, labels = batch["input"].numpy(), batch["labels"].numpy()
    a = 0
    for n in batch["doc_lens"]:
        doc, pos = divmod(tokens[a : a + n], STRIDE)
        assert n > 0 and (doc == doc[0]).all() and np.array_equal(pos, pos[0] + np.arange(n))
        assert np.array_equal(labels[a : a + n - 1], tokens[a + 1 : a + n])
        ends = pos[-1] + 1 == lens[doc[0]]
        assert labels[a + n - 1] == (-100 if ends else tokens[a + n - 1] + 1)
        a += n


def test_one_window_per_step_is_stream_packing():
    lens = [50, 300, 7, 120, 64, 9, 200]
    stream, one = list_loader(lens, 96), balanced(lens, 96, 0, 1, 1, 1.05)
    for _ in range(12):
        a, b = next(stream), next(one)
        assert torch.equal(a["input"], b["input"]) and a["doc_lens"] == b["doc_lens"]
        check_pieces(b, lens, 96)


def test_mesh_moves_the_stream_pieces_and_mesh_cut_cuts_documents_to_its_target():
    """A step of 8 windows of 256 tokens with four 100-token documents: stream order puts two of them
    and part of a third into the first window; "mesh" moves the stream's pieces apart (cutting only
    short pieces where a window is full); "mesh-cut" also cuts the long documents and gets within
    its target."""
    seq_len, dp = 256, 4
    lens = [100] * 4 + [16] * 103  # 2048 tokens: exactly one step
    worst = {}
    stream_pieces = None
    for mode, target in [("off", None), *MODES.items()]:
        if mode == "off":
            loaders = [list_loader(lens, seq_len, dp_rank=r, dp_world=dp) for r in range(dp)]
        else:
            loaders = [balanced(lens, seq_len, r, dp, 2, target) for r in range(dp)]
        windows = [next(loader) for _ in range(2) for loader in loaders]
        costs = [COST(w["doc_lens"]) for w in windows]
        worst[mode] = max(costs) / np.mean(costs)
        pieces = [(int(head) // STRIDE, int(head) % STRIDE, n) for w in windows for head, n in _piece_heads(w)]
        if mode == "off":
            stream_pieces = pieces
        elif mode == "mesh":  # inside one stream piece each; at most one extra cut per window
            assert all(any(d == sd and s <= p and p + n <= s + sn for sd, s, sn in stream_pieces) for d, p, n in pieces)
            assert len(pieces) <= len(stream_pieces) + len(windows)
        else:
            assert max(Counter(d for d, _, _ in pieces)[d] for d in range(4)) > 1  # long documents cut
    assert worst["mesh-cut"] <= 1.05 < worst["mesh"] < worst["off"], worst


def _piece_heads(batch):
    starts = np.cumsum([0] + batch["doc_lens"][:-1])
    return [(batch["input"][s], n) for s, n in zip(starts, batch["doc_lens"])]


@pytest.mark.parametrize("prefetch", [0, 2])
def test_resuming_inside_and_after_a_step_continues_exactly(prefetch):
    lens = [int(n) for n in np.random.default_rng(0).integers(1, 500, 200)]
    dp, micro = 3, 3
    loader = balanced(lens, 64, 1, dp, micro, 1.05, prefetch=prefetch)
    reference = [next(loader) for _ in range(10)]
    loader.close()
    for taken in (1, 2, 3, 4, 7):  # inside a step (in_step > 0) and at its end
        first = balanced(lens, 64, 1, dp, micro, 1.05, prefetch=prefetch)
        for _ in range(taken):
            next(first)
        state = first.state_dict()
        first.close()
        assert state.get("in_step", 0) == taken % micro
        again = balanced(lens, 64, 1, dp, micro, 1.05, prefetch=prefetch)
        again.load_state_dict(state)
        for want in reference[taken:]:
            got = next(again)
            assert torch.equal(got["input"], want["input"]) and got["window"] == want["window"]
        again.close()


def test_a_state_saved_inside_a_balanced_step_needs_balancing_to_resume():
    lens = [30, 90, 12, 200, 41]
    loader = balanced(lens, 32, 0, 1, 2, 1.05)
    next(loader)
    with pytest.raises(DataError, match='saved inside a balanced step: resume with \\[data\\] balance = "mesh"'):
        list_loader(lens, 32).load_state_dict(loader.state_dict())


def test_the_end_of_the_data_drops_the_incomplete_step():
    lens = [40] * 10  # 400 tokens: one step of 2 x 2 windows of 64, not two
    loader = balanced(lens, 64, 0, 2, 2, 1.05, loop=False)
    assert len(list(loader)) == 2


def test_bad_balance_settings_are_refused():
    with pytest.raises(DataError, match="data.balance must be one of"):
        DataConfig(balance="global")
    with pytest.raises(DataError, match="data.balance_target must be >= 1.0"):
        DataConfig(balance_target=0.9)
    loader = list_loader([10], 8)
    with pytest.raises(DataError, match="micro steps per optimizer step must be >= 1"):
        loader.balance_with(0, COST)


def test_each_rank_reads_only_its_own_windows_of_a_balanced_step(monkeypatch):
    """Lengths come from the documents' sizes; tokens are read for this rank's windows only."""
    read = []

    class CountingDoc:
        def __init__(self, tokens):
            self.tokens = tokens

        def __len__(self):
            return len(self.tokens)

        def __getitem__(self, index):
            read.append(id(self))
            return self.tokens[index]

    source = ListSource([int(n) for n in np.random.default_rng(1).integers(1, 300, 400)])
    source.docs = [CountingDoc(d) for d in source.docs]
    planner = functools.partial(plan_shards, cp_size=1, strategy="per_seq")
    loader = WindowLoader(WindowPacker(source, 128), planner, {"source": "list"}, 5, 8)
    loader.balance_with(2, COST, 1.05)
    mine = [next(loader) for _ in range(2)]
    pieces = sum(len(b["doc_lens"]) for b in mine)
    assert 0 < len(set(read)) <= pieces  # the documents of the other 7 ranks' 14 windows are never read
