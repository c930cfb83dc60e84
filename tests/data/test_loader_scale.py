"""Training from a prepared token store: the same windows as tokenising on the fly, each rank
reading only its own windows' tokens, the store checked against the job's tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flashcp.data.prepare import prepare
from flashcp.data import store_source
from flashcp.data.loader import build_loader
from flashcp.data.errors import DataError
from flashcp.data.sources import DataConfig

TEXTS = [f"Document number {i} says " + "hello world " * (i % 29 + 1) for i in range(300)]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("store")
    corpus = root / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    return corpus, prepare(str(corpus), "default", root / "tokens", progress=False)


def windows(source: Path, n: int, dp_rank: int = 0, dp_world: int = 1, state=None) -> list:
    loader = build_loader(DataConfig(source=str(source), prefetch=0), 128, dp_rank, dp_world,
                          planner_kwargs={"strategy": "per_doc"})  # fmt: skip
    if state is not None:
        loader.load_state_dict(state)
    out = [next(loader) for _ in range(n)]
    return [(b["input"].tolist(), b["labels"].tolist(), b["doc_lens"]) for b in out], loader.state_dict()


def test_a_store_gives_the_windows_the_text_gives(data):
    corpus, store = data
    assert windows(store, 12)[0] == windows(corpus, 12)[0]


def test_each_rank_reads_only_its_own_windows(data, store_reads):
    _, store = data
    mine, _ = windows(store, 3, dp_rank=5, dp_world=8)
    pieces = sum(len(doc_lens) for _, _, doc_lens in mine)
    assert 0 < len(store_reads) <= pieces  # documents of the other 7 ranks' windows are never read
    assert sum(store_reads) < 3 * 128 * 3  # far below the 8 x 3 windows of the steps walked


def test_resuming_a_store_under_another_dp_size_continues_exactly(data):
    _, store = data
    full, _ = windows(store, 6)
    _, state = windows(store, 2, dp_rank=1, dp_world=2)  # 2 steps of 2 windows: windows 0-3 consumed
    rest, _ = windows(store, 2, state=state)
    assert rest == full[4:6]


def test_a_store_from_another_tokenizer_is_refused(data, tmp_path):
    _, store = data
    other = tmp_path / "tok.json"
    spec = json.loads((Path(store_source.__file__).parents[2] / "data/default/tokenizer.json").read_text())
    spec["model"]["merges"] = spec["model"]["merges"][:-1]
    other.write_text(json.dumps(spec))
    with pytest.raises(DataError, match=f"token store {store} was prepared with tokenizer tokenizer.json .* "
                                        f"not \\[data\\] tokenizer {other}"):  # fmt: skip
        build_loader(DataConfig(source=str(store), tokenizer=str(other), prefetch=0), 128)


def test_skipping_windows_from_offsets_lands_where_packing_them_does(data):
    """Across several epochs, with documents cut at window ends and windows ending on boundaries."""
    from flashcp.data.loader import WindowPacker
    from flashcp.data.sources import build_source, DEFAULT_TOKENIZER
    from flashcp.data.tokenizer import load_tokenizer

    _, store = data
    source = build_source(DataConfig(source=str(store)), load_tokenizer(DEFAULT_TOKENIZER))
    for seq_len in (7, 128, 1000):
        read, skip = WindowPacker(source, seq_len), WindowPacker(source, seq_len)
        for count in [0, 1, 2, 5, 13, 40] * 8:
            for _ in range(count):
                read.next_window(materialize=False)
            assert skip.skip_windows(count)
            assert skip.cursor() == read.cursor(), (seq_len, count)
            assert skip.next_window().doc_lens == read.next_window().doc_lens


def test_a_steps_pieces_laid_out_from_offsets_are_the_pieces_packing_reads(data):
    """`next_step` on a store (vectorised, no document read) against packing window by window."""
    from flashcp.data.loader import WindowPacker
    from flashcp.data.sources import build_source, DEFAULT_TOKENIZER
    from flashcp.data.tokenizer import load_tokenizer

    _, store = data
    source = build_source(DataConfig(source=str(store)), load_tokenizer(DEFAULT_TOKENIZER))
    for seq_len in (7, 128, 1000):
        read, laid = WindowPacker(source, seq_len), WindowPacker(source, seq_len)
        for count in [1, 2, 5, 13, 40] * 6:  # crosses epochs, starts inside documents
            pieces = [p for _ in range(count) for p in read.next_pieces()]
            step = laid.next_step(count)
            assert laid.cursor() == read.cursor(), (seq_len, count)
            assert step.length.tolist() == [p.length for p in pieces]
            assert step.start.tolist() == [p.start for p in pieces]
            for i, p in enumerate(pieces):
                got = step.docs[int(step.doc[i])][p.start : p.start + p.length]
                assert got.tolist() == p.tokens[p.start : p.start + p.length].tolist()
            assert len(set(step.doc.tolist())) == len({id(p.tokens) for p in pieces})


@pytest.mark.parametrize("target", [None, 1.05])
def test_a_balanced_store_gives_the_batches_the_text_gives(data, target):
    """The loader's balanced step from a store's offsets (`next_step`'s vectorised path) equals
    the one from tokenising the same corpus window by window."""
    from flashcp.data.balance import WindowCost

    cost = WindowCost(dense_per_token=40.0, attn_per_pair=1.0)
    got = {}
    for source in data:
        loaders = [build_loader(DataConfig(source=str(source), prefetch=0), 64, r, 4,
                                planner_kwargs={"strategy": "per_doc"}) for r in range(4)]  # fmt: skip
        for loader in loaders:
            loader.balance_with(2, cost, target)
        batches = [next(loader) for _ in range(6) for loader in loaders]  # 3 steps of 2 micro batches
        got[source] = [(b["input"].tolist(), b["labels"].tolist(), b["doc_lens"]) for b in batches]
    corpus, store = data
    assert got[store] == got[corpus]
    assert any(len(doc_lens) > 1 for _, _, doc_lens in got[store])
