"""`python -m flashcp.data.prepare`: a token store that round-trips the corpus, is the same for any
number of workers, is never left half-written or overwritten, and whose reader refuses bad stores."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from flashcp.data import prepare as prep
from flashcp.data.store import is_store, open_store, StoreError
from flashcp.titan.sources import DEFAULT_TOKENIZER
from flashcp.titan.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
TEXTS = [f"Document {i}: " + "word " * (i % 37) for i in range(700)] + ["", "last one"]


def corpus(tmp_path: Path, texts: list[str] = TEXTS) -> Path:
    path = tmp_path / "corpus" / "docs.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def test_the_store_round_trips_the_corpus_in_order(tmp_path):
    out = prep.prepare(str(corpus(tmp_path)), "default", tmp_path / "store", progress=False)
    store = open_store(out)
    tok = load_tokenizer(DEFAULT_TOKENIZER)
    expected = [tok.encode(t) for t in TEXTS if t]  # the empty document is not stored
    assert store.n_docs == len(expected) == len(store.lengths)
    assert all(store.document(i).tolist() == ids for i, ids in enumerate(expected))
    assert store.lengths.tolist() == [len(ids) for ids in expected]  # raw: no BOS / EOS
    assert store.manifest["tokenizer"]["vocab_size"] == tok.vocab_size and store.manifest["dtype"] == "uint16"
    assert is_store(out)


def test_two_workers_write_the_same_bytes_as_one(tmp_path):
    source = str(corpus(tmp_path))
    one = prep.prepare(source, "default", tmp_path / "one", workers=1, progress=False)
    two = prep.prepare(source, "default", tmp_path / "two", workers=2, progress=False)
    for name in ("tokens.bin", "offsets.npy"):
        assert (one / name).read_bytes() == (two / name).read_bytes()


def test_an_interrupted_prepare_leaves_nothing_that_opens_and_a_rerun_works(tmp_path, monkeypatch):
    source, out = str(corpus(tmp_path)), tmp_path / "store"
    calls = []

    def dying(texts):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return prep._tokenizer.encode_batch([t or "" for t in texts])

    monkeypatch.setattr(prep, "_encode", dying)
    with pytest.raises(KeyboardInterrupt):
        prep.prepare(source, "default", out, progress=False)
    assert not out.exists() and not list(tmp_path.glob("store.partial-*"))
    monkeypatch.undo()
    leftover = tmp_path / "store.partial-999999"  # as a SIGKILLed prepare would leave it
    leftover.mkdir()
    (leftover / "tokens.bin").write_bytes(b"\0" * 10)
    with pytest.raises(StoreError, match="no manifest.json"):
        open_store(leftover)
    assert open_store(prep.prepare(source, "default", out, progress=False)).n_docs == len(TEXTS) - 1
    assert not leftover.exists()


def test_an_existing_store_is_never_overwritten(tmp_path):
    source = str(corpus(tmp_path))
    out = prep.prepare(source, "default", tmp_path / "store", progress=False)
    before = (out / "tokens.bin").read_bytes()
    result = subprocess.run(
        [sys.executable, "-m", "flashcp.data.prepare", source, "--tokenizer", "default", "--out", str(out)],
        capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"error: {out} already exists; a store is never overwritten "
                                                  "(remove it or pick another --out)"]  # fmt: skip
    assert (out / "tokens.bin").read_bytes() == before


def test_fingerprints_follow_the_source_and_the_tokenizer(tmp_path):
    a = open_store(prep.prepare(str(corpus(tmp_path / "a")), "default", tmp_path / "sa", progress=False))
    b = open_store(prep.prepare(str(corpus(tmp_path / "b", TEXTS[:-1] + ["changed"])), "default", tmp_path / "sb",
                                progress=False))  # fmt: skip
    assert a.manifest["source"]["fingerprint"] != b.manifest["source"]["fingerprint"]
    assert a.manifest["tokenizer"]["fingerprint"] == b.manifest["tokenizer"]["fingerprint"]
    other = tmp_path / "other.json"  # the same tokenizer with one merge rule less is another tokenizer
    spec = json.loads(DEFAULT_TOKENIZER.read_text())
    spec["model"]["merges"] = spec["model"]["merges"][:-1]
    other.write_text(json.dumps(spec))
    c = open_store(prep.prepare(str(corpus(tmp_path / "a")), str(other), tmp_path / "sc", progress=False))
    assert c.manifest["tokenizer"]["fingerprint"] != a.manifest["tokenizer"]["fingerprint"]


def test_the_reader_refuses_inconsistent_stores(tmp_path):
    out = prep.prepare(str(corpus(tmp_path)), "default", tmp_path / "store", progress=False)
    with pytest.raises(StoreError, match="no such directory"):
        open_store(tmp_path / "nowhere")
    tokens = out / "tokens.bin"
    tokens.write_bytes(tokens.read_bytes()[:-2])
    with pytest.raises(StoreError, match=r"tokens.bin holds \d+ bytes, the manifest says \d+"):
        open_store(out)
    manifest = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps({**manifest, "version": 99}))
    with pytest.raises(StoreError, match=r"99\), expected 'flashcp-token-store' version 1"):
        open_store(out)


def test_bad_input_is_one_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": oops}\n')
    result = subprocess.run(
        [sys.executable, "-m", "flashcp.data.prepare", str(bad), "--tokenizer", "default", "--out",
         str(tmp_path / "s")], capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith(f"error: cannot read json data: {bad}: line 2")
    assert not (tmp_path / "s").exists()
