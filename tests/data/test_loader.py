"""The data pipeline: packing, rank assignment, resuming, sources, tokenizers and bad data.

Packing properties run on a list-backed document source whose token ids spell out (document,
position), so every window can be checked token by token against the documents. The other tests
run the real pipeline on the shipped default corpus, on small files written here, on synthetic
lengths and with a SentencePiece model trained here.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashcp import plan_shards
from flashcp.data.loader import IGNORE_INDEX, WindowLoader, WindowPacker, build_loader
from flashcp.data.errors import DataError
from flashcp.data.sources import DEFAULT_CORPUS, DEFAULT_TOKENIZER, DataConfig
from flashcp.data.tokenizer import HFTokenizer, TokenizerError, load_tokenizer

PLANNER = {"strategy": "per_doc"}  # planning itself is tested elsewhere; any strategy does
STRIDE = 1000  # token id = STRIDE * document + position, so documents stay shorter than this


class ListSource:
    """Documents held in memory, in the same order every epoch (a DocSource for property tests)."""

    name = ident = "list"

    def __init__(self, lens: list[int]):
        self.docs = [STRIDE * i + np.arange(n, dtype=np.int64) for i, n in enumerate(lens)]

    def epoch(self, epoch: int, start: int):
        for i in range(start, len(self.docs)):
            if len(self.docs[i]):
                yield i, self.docs[i]


def list_loader(lens, seq_len, overflow="carry", dp_rank=0, dp_world=1, loop=True, prefetch=0):
    packer = WindowPacker(ListSource(lens), seq_len, overflow, loop)
    planner = functools.partial(plan_shards, cp_size=1, strategy="per_seq")
    return WindowLoader(packer, planner, {"source": "list"}, dp_rank, dp_world, prefetch)


def take(loader, n):
    return [next(loader) for _ in range(n)]


def same(a: dict, b: dict) -> bool:
    return (
        torch.equal(a["input"], b["input"])
        and torch.equal(a["labels"], b["labels"])
        and a["doc_lens"] == b["doc_lens"]
        and a["window"] == b["window"]
        and a["plan"] == b["plan"]
    )


doc_lens_st = st.lists(st.integers(0, 60), min_size=1, max_size=12).filter(any)


# ----------------------------------------------------------------------------- packing


@settings(max_examples=60, deadline=None)
@given(lens=doc_lens_st, seq_len=st.integers(1, 80), steps=st.integers(1, 8))
def test_carry_windows_are_the_document_stream_cut_into_seq_len(lens, seq_len, steps):
    batches = take(list_loader(lens, seq_len), steps)
    stream = np.concatenate([STRIDE * i + np.arange(n) for i, n in enumerate(lens) if n])
    stream = np.resize(stream, steps * seq_len)  # epochs repeat the same order
    assert np.array_equal(torch.cat([b["input"] for b in batches]).numpy(), stream)
    for b in batches:
        assert sum(b["doc_lens"]) == seq_len == len(b["input"]) == len(b["labels"])
        assert b["input"].dtype == b["labels"].dtype == torch.int64
        assert b["plan"].doc_lens == tuple(b["doc_lens"])
        check_pieces(b, lens, seq_len)


def check_pieces(batch, lens, seq_len):
    """Each piece is consecutive tokens of one document; labels follow it, -100 at its end."""
    tokens, labels = batch["input"].numpy(), batch["labels"].numpy()
    a = 0
    for k, n in enumerate(batch["doc_lens"]):
        doc, pos = divmod(tokens[a : a + n], STRIDE)
        assert n > 0 and (doc == doc[0]).all() and np.array_equal(pos, pos[0] + np.arange(n))
        ends = pos[-1] + 1 == lens[doc[0]]
        # A piece starts its document or opens the window; it ends its document or the window.
        assert pos[0] == 0 or a == 0
        assert ends or a + n == seq_len
        assert np.array_equal(labels[a : a + n - 1], tokens[a + 1 : a + n])
        assert labels[a + n - 1] == (IGNORE_INDEX if ends else tokens[a + n - 1] + 1)
        a += n


@settings(max_examples=60, deadline=None)
@given(lens=doc_lens_st, seq_len=st.integers(1, 80), steps=st.integers(1, 8))
def test_truncate_drops_the_rest_of_a_cut_document(lens, seq_len, steps):
    batches = take(list_loader(lens, seq_len, overflow="truncate"), steps)
    order = [i for i, n in enumerate(lens) if n]
    expected_doc = 0  # index into `order`, cycling over epochs
    for b in batches:
        check_pieces(b, lens, seq_len)
        starts = np.cumsum([0] + b["doc_lens"][:-1])
        for a, n in zip(starts, b["doc_lens"]):
            doc, pos = divmod(int(b["input"][a]), STRIDE)
            assert pos == 0, "with truncate every piece starts its document"
            assert doc == order[expected_doc % len(order)], "documents keep their order, none repeats"
            expected_doc += 1


def test_carry_and_truncate_on_a_known_example():
    # Documents of 5, 3 and 6 tokens into windows of 4.
    carry = [b["doc_lens"] for b in take(list_loader([5, 3, 6], 4), 4)]
    assert carry == [[4], [1, 3], [4], [2, 2]]  # the last window opens the second epoch
    truncate = [b["doc_lens"] for b in take(list_loader([5, 3, 6], 4, overflow="truncate"), 3)]
    assert truncate == [[4], [3, 1], [4]]
    labels = next(list_loader([5, 3, 6], 4))["labels"].tolist()
    assert labels == [1, 2, 3, 4]  # document 0 continues into the next window: no -100 yet


# ----------------------------------------------------------------------------- ranks and resuming


@settings(max_examples=40, deadline=None)
@given(lens=doc_lens_st, seq_len=st.integers(1, 40), dp_world=st.integers(1, 4), steps=st.integers(1, 5))
def test_dp_ranks_take_disjoint_interleaved_windows(lens, seq_len, dp_world, steps):
    single = take(list_loader(lens, seq_len), steps * dp_world)
    for r in range(dp_world):
        got = take(list_loader(lens, seq_len, dp_rank=r, dp_world=dp_world), steps)
        assert [b["window"] for b in got] == [k * dp_world + r for k in range(steps)]
        assert all(same(b, single[k * dp_world + r]) for k, b in enumerate(got))


@settings(max_examples=40, deadline=None)
@given(
    lens=doc_lens_st,
    seq_len=st.integers(1, 40),
    overflow=st.sampled_from(["carry", "truncate"]),
    before=st.integers(0, 6),
    old_world=st.integers(1, 3),
    new_world=st.integers(1, 3),
)
def test_resume_continues_with_the_next_unseen_window_under_any_dp_layout(
    lens, seq_len, overflow, before, old_world, new_world
):
    reference = take(list_loader(lens, seq_len, overflow), (before + 2) * max(old_world, new_world) + 4)
    savers = [list_loader(lens, seq_len, overflow, r, old_world) for r in range(old_world)]
    for saver in savers:
        take(saver, before)
    states = [s.state_dict() for s in savers]
    assert all(s == states[0] for s in states), "every rank saves the same state"
    for r in range(new_world):
        resumed = list_loader(lens, seq_len, overflow, r, new_world)
        resumed.load_state_dict(states[0])
        for k in range(2):
            assert same(next(resumed), reference[before * old_world + k * new_world + r])


def test_state_is_that_of_the_last_batch_handed_out_when_prefetching():
    lens = [7, 3, 11, 2, 9]
    plain = list_loader(lens, 6)
    with list_loader(lens, 6, prefetch=3) as ahead:
        for _ in range(4):
            assert same(next(plain), next(ahead))
        assert ahead.state_dict() == plain.state_dict()
        resumed = list_loader(lens, 6)
        resumed.load_state_dict(ahead.state_dict())
        assert same(next(resumed), next(ahead))
        next(plain)  # catch up with `ahead`, which handed out one more batch
        ahead.close()  # iteration goes on from the same point after closing
        assert same(next(ahead), next(plain))


def test_loop_false_stops_every_dp_rank_after_the_same_step():
    # 17 tokens make four windows of 4 (the 17th token is dropped); 2 ranks take 2 steps each.
    for r in range(2):
        loader = list_loader([5, 3, 9], 4, dp_rank=r, dp_world=2, loop=False)
        assert [b["window"] for b in loader] == [r, 2 + r]
    assert len(list(list_loader([5, 3, 9], 4, dp_world=3, loop=False))) == 1  # 1 full round of 3


def test_producer_errors_reach_the_caller_on_next():
    packer = WindowPacker(ListSource([0, 0]), 4)
    planner = functools.partial(plan_shards, cp_size=1)
    for prefetch in (0, 2):
        loader = WindowLoader(packer, planner, {}, prefetch=prefetch)
        for _ in range(2):  # and again on a retry
            with pytest.raises(DataError, match="no document with any tokens"):
                next(loader)


# ----------------------------------------------------------------------------- real sources


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("hf_cache"))


@pytest.fixture(scope="module")
def default_tokenizer():
    return load_tokenizer(DEFAULT_TOKENIZER)


def test_default_corpus_gives_real_text_windows_with_many_boundaries(cache_dir, default_tokenizer):
    cfg = DataConfig(cache_dir=cache_dir, prefetch=0)
    batches = take(build_loader(cfg, seq_len=2048, cp_size=4, planner_kwargs=PLANNER), 8)
    tok = default_tokenizer
    for b in batches:
        ids = b["input"].tolist()
        starts = np.cumsum([0] + b["doc_lens"][:-1])
        # Every piece but a carried first one starts with BOS; EOS is labelled -100 and preceded
        # by a token trained to predict it.
        assert all(ids[a] == tok.bos_id for a in starts[1:])
        eos = [i for i, t in enumerate(ids) if t == tok.eos_id]
        assert all(b["labels"][i] == IGNORE_INDEX for i in eos)
        assert all(b["labels"][i - 1] == tok.eos_id for i in eos if i > 0)
        assert b["plan"].cp_size == 4 and b["plan"].doc_lens == tuple(b["doc_lens"])
        assert b["plan_ms"] >= 0 and b["load_ms"] >= 0 and b["wait_ms"] >= 0
    lens = [n for b in batches for n in b["doc_lens"]]
    assert len(lens) > 3 * len(batches) and max(lens) > 8 * min(lens), "documents of varied lengths"
    text = tok.decode(batches[0]["input"].tolist())
    assert sum(w in text.split() for w in ("the", "of", "a", "is")) >= 3, text[:300]


def test_cp_ranks_of_one_group_get_identical_windows_and_plans(cache_dir, default_tokenizer):
    def loader(cp_size):
        cfg = DataConfig(cache_dir=cache_dir, prefetch=1)
        return build_loader(cfg, 1024, dp_rank=1, dp_world=2, cp_size=cp_size, planner_kwargs=PLANNER,
                            tokenizer=default_tokenizer)

    with loader(2) as a, loader(2) as b, loader(4) as c:
        for x, y, z in zip(take(a, 3), take(b, 3), take(c, 3)):
            assert same(x, y)
            assert torch.equal(x["input"], z["input"]) and x["doc_lens"] == z["doc_lens"]
            assert z["plan"].cp_size == 4


def test_shuffle_is_seeded_and_epochs_are_reshuffled(tmp_path, cache_dir, default_tokenizer):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"document number {i}."}) + "\n" for i in range(30)))

    def firsts(seed, n):
        cfg = DataConfig(source=str(path), seed=seed, add_eos=False, cache_dir=cache_dir, prefetch=0)
        batches = take(build_loader(cfg, 64, planner_kwargs=PLANNER, tokenizer=default_tokenizer), n)
        ids = torch.cat([b["input"] for b in batches]).tolist()
        text = default_tokenizer.decode(ids)
        return [int(part.split(".")[0]) for part in text.split("document number ")[1:]]

    order = firsts(0, 30)
    assert order == firsts(0, 30) and order[:30] != firsts(1, 30)[:30]
    epoch0, epoch1 = order[:30], order[30:60]
    assert sorted(epoch0) == sorted(epoch1) == list(range(30)) and epoch0 != epoch1


def test_streamed_dataset_resumes_exactly_under_a_new_dp_layout(tmp_path, cache_dir, default_tokenizer):
    # "hf:" streams a hub dataset; a local dataset directory runs the same code offline.
    (tmp_path / "docs").mkdir()
    docs = [f"streamed document {i}." for i in range(40)]
    (tmp_path / "docs" / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))

    def loader(**kwargs):
        cfg = DataConfig(source=f"hf:{tmp_path / 'docs'}", add_bos=False, cache_dir=cache_dir, prefetch=0)
        return build_loader(cfg, 32, planner_kwargs=PLANNER, tokenizer=default_tokenizer, **kwargs)

    reference = take(loader(), 24)
    text = default_tokenizer.decode(torch.cat([b["input"] for b in reference]).tolist())
    first_epoch = text.split("<|eos|>")[: len(docs)]
    assert sorted(first_epoch) == sorted(docs) and first_epoch != docs  # shuffled, each once
    saver = loader(dp_world=2)
    take(saver, 7)
    resumed = loader(dp_rank=1, dp_world=3)
    resumed.load_state_dict(saver.state_dict())
    assert same(next(resumed), reference[15]) and same(next(resumed), reference[18])


def write_files(root: Path) -> dict[str, str]:
    """One small file of every supported kind (and a README); returns each file's documents."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = {}
    (root / "sub").mkdir(parents=True)
    texts["a.jsonl"] = ["jsonl one", "jsonl two"]
    (root / "a.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in texts["a.jsonl"]))
    texts["b.json"] = ["json array one"]
    (root / "b.json").write_text(json.dumps([{"body": t} for t in texts["b.json"]]))
    texts["c.jsonl.gz"] = ["gzip one"]
    (root / "c.jsonl.gz").write_bytes(gzip.compress(json.dumps({"body": "gzip one"}).encode()))
    texts["d.parquet"] = ["parquet one", "parquet two"]
    pq.write_table(pa.table({"body": texts["d.parquet"], "n": [1, 2]}), root / "d.parquet")
    texts["sub/e.txt"] = ["a text file is one document.\n\nEven with paragraphs.\n"]
    (root / "sub" / "e.txt").write_text(texts["sub/e.txt"][0])
    (root / "README.md").write_text("not data: ignored in a directory")
    return texts


def test_every_supported_file_type_is_read_from_a_directory(tmp_path, cache_dir, default_tokenizer):
    texts = write_files(tmp_path / "data")
    cfg = DataConfig(source=str(tmp_path / "data"), text_field="body", add_bos=False, shuffle=False,
                     loop=False, cache_dir=cache_dir, prefetch=0)
    loader = build_loader(cfg, 1, planner_kwargs=PLANNER, tokenizer=default_tokenizer)  # loses no token
    ids = [int(b["input"]) for b in loader]
    docs = default_tokenizer.decode(ids).split("<|eos|>")[:-1]
    assert sorted(docs) == sorted(t for ts in texts.values() for t in ts)


def test_txt_files_can_be_split_into_paragraphs(tmp_path, cache_dir, default_tokenizer):
    (tmp_path / "a.txt").write_text("First paragraph.\n\nSecond one.\n")
    cfg = DataConfig(source=str(tmp_path / "*.txt"), txt_sample_by="paragraph", add_bos=False, shuffle=False,
                     loop=False, cache_dir=cache_dir, prefetch=0)
    ids = [int(b["input"]) for b in build_loader(cfg, 1, planner_kwargs=PLANNER, tokenizer=default_tokenizer)]
    assert default_tokenizer.decode(ids) == "First paragraph.<|eos|>Second one.\n<|eos|>"


def synthetic(seed=0, lengths="wlbllm", **kwargs):
    cfg = DataConfig(source="synthetic", synthetic_lengths=lengths, seed=seed, prefetch=0)
    return build_loader(cfg, kwargs.pop("seq_len", 8192), planner_kwargs=PLANNER, **kwargs)


def test_synthetic_documents_follow_the_named_distribution_and_resume_exactly(default_tokenizer):
    from flashcp.data.lengths import length_sampler

    batches = take(synthetic(lengths="pile", seq_len=1 << 16, tokenizer=default_tokenizer), 3)
    pieces = [n for b in batches for n in b["doc_lens"]]
    draws = length_sampler("pile").dist.draw(np.random.default_rng(0), 4096)  # scale of the lengths
    assert 0.2 < np.median(pieces[1:-1]) / np.median(draws) < 5
    for b in batches:
        starts = np.cumsum([0] + b["doc_lens"][:-1])
        assert all(int(b["input"][a]) == default_tokenizer.bos_id for a in starts[1:])
        assert int(b["input"].max()) < default_tokenizer.vocab_size
    again = take(synthetic(lengths="pile", seq_len=1 << 16, tokenizer=default_tokenizer), 3)
    assert all(same(x, y) for x, y in zip(batches, again))
    assert not same(batches[0], next(synthetic(seed=1, lengths="pile", seq_len=1 << 16)))

    saver = synthetic(seq_len=4096, dp_world=2, tokenizer=default_tokenizer)
    take(saver, 5)
    reference = take(synthetic(seq_len=4096, tokenizer=default_tokenizer), 14)
    resumed = synthetic(seq_len=4096, dp_rank=2, dp_world=3, tokenizer=default_tokenizer)
    resumed.load_state_dict(saver.state_dict())
    assert same(next(resumed), reference[12])


def test_shipped_default_data_matches_its_manifest_and_rebuilds_byte_for_byte(tmp_path):
    import platform

    import tokenizers

    manifest = json.loads((DEFAULT_CORPUS.parent / "manifest.json").read_text())
    for name, digest in manifest["sha256"].items():
        assert hashlib.sha256((DEFAULT_CORPUS.parent / name).read_bytes()).hexdigest() == digest, name
    built_with = (manifest["python"], manifest["tokenizers"])
    here = (platform.python_version(), tokenizers.__version__)
    if here != built_with:
        pytest.skip(f"data/default was built with Python, tokenizers {built_with}, this is {here}: a rebuild differs")
    script = DEFAULT_CORPUS.parents[2] / "scripts" / "build_default_data.py"
    spec = importlib.util.spec_from_file_location("build_default_data", script)
    builder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builder)
    assert builder.build(tmp_path)["sha256"] == manifest["sha256"]


# ----------------------------------------------------------------------------- tokenizers


def test_hf_tokenizer_round_trips_and_keeps_special_strings_as_text(default_tokenizer):
    tok = default_tokenizer
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == 4096 and (tok.bos_id, tok.eos_id) == (0, 1)
    text = "Return the <|eos|> of a list, naïvely — “quoted” 🙂.\n\tindented"
    ids = tok.encode(text)
    assert tok.decode(ids) == text and tok.eos_id not in ids
    assert tok.encode_batch([text, ""]) == [ids, []]


@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory) -> Path:
    import sentencepiece as spm

    lines = [json.loads(line)["text"] for line in gzip.open(DEFAULT_CORPUS, "rt")][:300]
    path = tmp_path_factory.mktemp("spm") / "tiny.model"
    with open(path, "wb") as f:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines), model_writer=f, vocab_size=400, model_type="bpe",
            byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
            minloglevel=2,
        )
    return path


def test_sentencepiece_model_round_trips_and_feeds_the_loader(sentencepiece_model, tmp_path, cache_dir):
    tok = load_tokenizer(sentencepiece_model)
    assert tok.vocab_size == 400 and (tok.bos_id, tok.eos_id) == (1, 2)
    text = "Return a new list of the items, naïvely."
    assert tok.decode(tok.encode(text)) == text
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": text}) + "\n")
    cfg = DataConfig(
        source=str(tmp_path / "d.jsonl"), tokenizer=str(sentencepiece_model), cache_dir=cache_dir, prefetch=0
    )
    n = len(tok.encode(text)) + 2
    b = next(build_loader(cfg, seq_len=3 * n, planner_kwargs=PLANNER))
    assert b["doc_lens"] == [n, n, n]
    assert b["input"][:n].tolist() == [tok.bos_id, *tok.encode(text), tok.eos_id]


def test_tokenizer_errors_name_the_problem(tmp_path, sentencepiece_model):
    with pytest.raises(TokenizerError, match="not found"):
        load_tokenizer(tmp_path / "missing.json")
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "vocab.txt").write_text("a\nb\n")
    with pytest.raises(TokenizerError, match="unsupported tokenizer file"):
        load_tokenizer(tmp_path / "vocab.txt")
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="cannot read tokenizer"):
        load_tokenizer(tmp_path)
    (tmp_path / "broken.model").write_bytes(b"\x00garbage")
    with pytest.raises(TokenizerError, match="cannot read SentencePiece"):
        load_tokenizer(tmp_path / "broken.model")
    assert load_tokenizer(sentencepiece_model.parent).vocab_size == 400  # a directory holding a .model


# ----------------------------------------------------------------------------- bad data and config


@pytest.fixture
def bad(tmp_path, cache_dir, default_tokenizer):
    """build_loader on `source` (a file name under tmp_path, created with `content` when given)."""

    def build(source: str, content: str | bytes | None = None, **cfg):
        path = tmp_path / source
        if isinstance(content, str):
            path.write_text(content)
        elif content is not None:
            path.write_bytes(content)
        tokenizer = cfg.pop("tokenizer", default_tokenizer)
        config = DataConfig(source=str(path), cache_dir=cache_dir, prefetch=0, **cfg)
        return next(build_loader(config, 16, tokenizer=tokenizer, planner_kwargs=PLANNER))

    return build


@pytest.mark.parametrize(
    "source, content, options, message",
    [
        ("missing.jsonl", None, {}, "data path not found"),
        ("table.csv", "text\nhello\n", {}, "unsupported data file type"),
        ("empty.jsonl", "", {}, "empty dataset"),
        ("empty.jsonl.gz", gzip.compress(b"", mtime=0), {}, "empty dataset"),
        ("blank.jsonl", '{"text": ""}\n{"text": null}\n', {}, "no document with any tokens"),
        ("other.jsonl", '{"body": "x"}\n', {}, "no column 'text'.*columns: \\['body'\\]\\); set data.text_field"),
        ("numbers.jsonl", '{"text": 5}\n', {}, "holds Value\\('int64'\\), not text"),
        ("broken.jsonl", '{"text": "x"\n', {}, "cannot read json data: .*broken.jsonl: line 1: not a JSON object"),
        ("partial.jsonl", '{"text": "a"}\n{"body": "x"}\n{"text": "b"}\n', {},  # datasets: a bare KeyError
         r"cannot read json data: \S*partial.jsonl: line 2: no field 'text' \(fields: \['body'\]\); set data.text_field$"),
        ("mixed.jsonl", '{"text": "a"}\n{"text": "b"}\n{"text": [1]}\n', {},
         r"column 'text' of \S*mixed.jsonl holds Json\(decode=True\), not text \(first at \S*mixed.jsonl: line 3: field "
         r"'text' is not text: \[1\]\)$"),
        ("long.jsonl", json.dumps({"text": "word " * 200}), {"max_doc_tokens": 50}, "max_doc_tokens=50"),
    ],
)
def test_bad_data_fails_naming_the_problem(bad, source, content, options, message):
    with pytest.raises(DataError, match=message):
        bad(source, content, **options)


def test_directories_and_globs_without_data_fail_clearly(bad, tmp_path):
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "notes.md").write_text("x")
    with pytest.raises(DataError, match="no supported data files in .*found .md"):
        bad("dir")
    with pytest.raises(DataError, match="matches no files"):
        bad("*.parquet")


def test_tokenizer_without_bos_is_refused_unless_bos_is_off(tmp_path, bad):
    from tokenizers import Tokenizer, models, pre_tokenizers

    plain = Tokenizer(models.WordLevel({"[UNK]": 0, "x": 1}, unk_token="[UNK]"))
    plain.pre_tokenizer = pre_tokenizers.Whitespace()
    plain.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path / "tokenizer.json")
    with pytest.raises(DataError, match="no BOS token; set data.add_bos=false"):
        bad("d.jsonl", '{"text": "x x"}\n', tokenizer=tok)
    assert bad("d.jsonl", add_bos=False, add_eos=False, tokenizer=tok)["doc_lens"] == [2] * 8


def test_a_token_id_past_the_tokenizer_size_is_named_with_the_document(tmp_path, bad):
    """ids with gaps: 4 ids, one of them 9000, which the embedding (4 rows) would meet as a bare IndexError."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    gaps = Tokenizer(models.WordLevel({"<s>": 0, "</s>": 1, "[UNK]": 2, "far": 9000}, unk_token="[UNK]"))
    gaps.pre_tokenizer = pre_tokenizers.Whitespace()
    gaps.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path / "tokenizer.json")
    with pytest.raises(DataError, match=r"d.jsonl: document 1: token id 9000 is outside the tokenizer's vocabulary "
                                        r"of 4 ids"):  # fmt: skip
        bad("d.jsonl", '{"text": "x x"}\n{"text": "x far"}\n', tokenizer=tok, shuffle=False)


def test_bad_config_and_mismatched_state_fail_naming_the_problem(default_tokenizer, cache_dir):
    with pytest.raises(DataError, match="data.overflow must be one of"):
        DataConfig(overflow="wrap")
    cfg = DataConfig(cache_dir=cache_dir, prefetch=0)
    with pytest.raises(DataError, match="positive multiple of cp_size"):
        build_loader(cfg, 1000, cp_size=3, planner_kwargs=PLANNER, tokenizer=default_tokenizer)
    with pytest.raises(DataError, match="dp_rank must be in"):
        build_loader(cfg, 64, dp_rank=2, dp_world=2, planner_kwargs=PLANNER, tokenizer=default_tokenizer)
    with pytest.raises(ValueError, match="unknown strategy"):
        build_loader(cfg, 64, planner_kwargs={"strategy": "zigzag"}, tokenizer=default_tokenizer)
    with pytest.raises(DataError, match="data.synthetic_lengths: unknown length distribution"):
        synthetic(lengths="nope", seq_len=64, tokenizer=default_tokenizer)
    saved = build_loader(cfg, 64, planner_kwargs=PLANNER, tokenizer=default_tokenizer).state_dict()
    other = build_loader(cfg, 128, planner_kwargs=PLANNER, tokenizer=default_tokenizer)
    with pytest.raises(DataError, match="packing changed .*seq_len: saved 64, now 128"):
        other.load_state_dict(saved)
    with pytest.raises(DataError, match="not a data loader state"):
        other.load_state_dict({"window": 3})


def test_resume_compares_the_tokenizer_by_content_not_by_file_name(tmp_path, cache_dir):
    """The same tokenizer copied under another name resumes; one whose bytes changed is refused."""
    renamed = tmp_path / "renamed" / "my-tokenizer.json"
    renamed.parent.mkdir()
    renamed.write_bytes(Path(DEFAULT_TOKENIZER).read_bytes())
    cfg = DataConfig(cache_dir=cache_dir, prefetch=0)
    saver = build_loader(cfg, 64, planner_kwargs=PLANNER, tokenizer=load_tokenizer(DEFAULT_TOKENIZER))
    take(saver, 2)
    state = saver.state_dict()
    resumed = build_loader(cfg, 64, planner_kwargs=PLANNER, tokenizer=load_tokenizer(renamed))
    resumed.load_state_dict(state)
    assert same(next(resumed), next(saver))
    changed = json.loads(renamed.read_text())
    changed["model"]["vocab"]["zzzz-new"] = max(changed["model"]["vocab"].values()) + 1
    renamed.write_text(json.dumps(changed))
    other = build_loader(cfg, 64, planner_kwargs=PLANNER, tokenizer=load_tokenizer(renamed))
    with pytest.raises(DataError, match="packing changed .*tokenizer: saved 'tokenizer.json sha256:.*my-tokenizer"):
        other.load_state_dict(state)


def test_hub_dataset_fails_fast_and_clearly_when_offline(monkeypatch, default_tokenizer):
    import huggingface_hub.constants as hub

    cfg = DataConfig(source="hf:allenai/c4", hf_config="en")
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    with pytest.raises(DataError, match="'allenai/c4' requested but HF_HUB_OFFLINE is set"):
        build_loader(cfg, 64, planner_kwargs=PLANNER, tokenizer=default_tokenizer)
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    with pytest.raises(DataError, match="127.0.0.1 cannot be reached .*looks offline"):
        build_loader(cfg, 64, planner_kwargs=PLANNER, tokenizer=default_tokenizer)
