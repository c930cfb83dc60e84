"""`python -m flashcp.data.prepare`: a token store that round-trips the corpus, is the same for any
number of workers, streams with bounded memory, is never left half-written or overwritten, records
what it was made from, and reports bad input in one line."""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from flashcp.data import prepare as prep
from flashcp.data.store import file_fingerprint, is_store, open_store, StoreError
from flashcp.data.sources import DEFAULT_TOKENIZER
from flashcp.data.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
TEXTS = [f"Document {i}: " + "wörd " * (i % 37) for i in range(700)] + ["", "last one"]


def corpus(folder: Path, texts: list[str] = TEXTS, field: str = "text") -> Path:
    path = folder / "corpus" / "docs.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({field: t}) + "\n" for t in texts))
    return path


def cli(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "flashcp.data.prepare", *args]
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT)


def test_the_store_round_trips_the_corpus_in_order(tmp_path):
    source = corpus(tmp_path)
    store = open_store(prep.prepare(str(source), "default", tmp_path / "store", progress=False))
    tok = load_tokenizer(DEFAULT_TOKENIZER)
    kept = [t for t in TEXTS if t]  # the empty document is not stored
    assert store.n_docs == len(kept) and store.n_tokens == int(store.lengths.sum())
    assert [tok.decode(store.document(i).tolist()) for i in range(store.n_docs)] == kept
    assert store.lengths.tolist() == [len(tok.encode(t)) for t in kept]  # raw: no BOS / EOS stored
    every = store.tokens(0, store.n_tokens)
    assert tok.bos_id not in every and tok.eos_id not in every
    m = store.manifest
    assert (m["n_docs"], m["n_tokens"], m["dtype"]) == (store.n_docs, store.n_tokens, "uint16")
    assert m["tokenizer"] == {
        "fingerprint": file_fingerprint(DEFAULT_TOKENIZER),
        "vocab_size": tok.vocab_size,
        "bos_id": tok.bos_id,
        "eos_id": tok.eos_id,
        "name": "tokenizer.json",
    }
    assert m["source"]["files"] == [{"name": "docs.jsonl", "size": source.stat().st_size,
                                     "sha256": file_fingerprint(source)}]  # fmt: skip
    assert (m["source"]["text_field"], m["source"]["txt_sample_by"]) == ("text", "document") and m["created"]
    assert is_store(store.path) and not list(tmp_path.glob("store.partial-*"))


def test_text_field_and_txt_paragraphs(tmp_path):
    tok = load_tokenizer(DEFAULT_TOKENIZER)
    source = corpus(tmp_path, ["a b", "c"], field="body")
    out = prep.prepare(str(source), "default", tmp_path / "j", text_field="body", progress=False)
    store = open_store(out)
    assert [tok.decode(store.document(i).tolist()) for i in range(store.n_docs)] == ["a b", "c"]
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "book.txt").write_text("first paragraph\nstill first\n\nsecond\n")
    store = open_store(prep.prepare(str(tmp_path / "t"), "default", tmp_path / "p", txt_sample_by="paragraph",
                                    progress=False))  # fmt: skip
    assert store.n_docs == 2 and store.manifest["source"]["txt_sample_by"] == "paragraph"


def test_two_workers_write_the_same_store_as_one(tmp_path, monkeypatch):
    monkeypatch.setattr(prep, "CHUNK_DOCS", 16)  # many chunks, so the order of results matters
    source = str(corpus(tmp_path))
    one = prep.prepare(source, "default", tmp_path / "one", workers=1, progress=False)
    two = prep.prepare(source, "default", tmp_path / "two", workers=2, progress=False)
    assert sorted(p.name for p in one.iterdir()) == sorted(p.name for p in two.iterdir())
    for name in ("tokens.bin", "offsets.npy"):
        assert (one / name).read_bytes() == (two / name).read_bytes()
    manifests = [{**json.loads((d / "manifest.json").read_text()), "created": None} for d in (one, two)]
    assert manifests[0] == manifests[1]


def test_ordered_imap_keeps_order_with_a_bounded_window():
    pulled = []

    def items():
        for i in range(40):
            pulled.append(i)
            yield list(range(i % 7))

    with multiprocessing.get_context("spawn").Pool(2) as pool:
        results = []
        for result in prep.ordered_imap(pool, len, items(), window=3):
            results.append(result)
            assert len(pulled) - len(results) <= 3  # never more than the window read ahead
    assert results == [i % 7 for i in range(40)]


def test_memory_stays_bounded_by_the_chunks_in_flight(tmp_path, monkeypatch):
    """Tokenising and writing hold a few chunks, not the corpus: the traced peak of that phase is a
    small fraction of what the corpus's token lists would take."""
    texts = [f"{i} " + "plenty of words in a long document " * 60 for i in range(3000)]  # 6.4 MB of text
    source = str(corpus(tmp_path, texts))
    monkeypatch.setattr(prep, "CHUNK_DOCS", 32)
    peaks = []
    write = prep._write

    def traced(*args):
        tracemalloc.start()
        try:
            return write(*args)
        finally:
            peaks.append(tracemalloc.get_traced_memory()[1])
            tracemalloc.stop()

    monkeypatch.setattr(prep, "_write", traced)
    store = open_store(prep.prepare(source, "default", tmp_path / "store", workers=2, progress=False))
    whole = store.n_tokens * 36  # a Python list of all the ids: 8-byte pointer + 28-byte int each
    assert whole > 40e6 and peaks[0] < whole / 10, (peaks, whole)


def test_an_exception_mid_way_leaves_nothing(tmp_path, monkeypatch):
    calls = []

    def dying(texts):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return prep._tokenizer.encode_batch([t or "" for t in texts])

    monkeypatch.setattr(prep, "_encode", dying)
    with pytest.raises(KeyboardInterrupt):
        prep.prepare(str(corpus(tmp_path)), "default", tmp_path / "store", progress=False)
    assert len(calls) == 2 and sorted(p.name for p in tmp_path.iterdir()) == ["corpus"]


KILLED_MID_WAY = """
import os, signal, sys
from flashcp.data import prepare as prep
calls = []
def encode(texts):
    calls.append(1)
    if len(calls) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return prep._tokenizer.encode_batch(texts)
prep._encode = encode
prep.prepare(sys.argv[1], "default", sys.argv[2], progress=False)
"""


def test_a_killed_prepare_leaves_a_partial_folder_that_never_opens_and_a_rerun_works(tmp_path):
    source, out = str(corpus(tmp_path)), tmp_path / "store"
    command = [sys.executable, "-c", KILLED_MID_WAY, source, str(out)]
    killed = subprocess.run(command, cwd=ROOT, capture_output=True)
    assert killed.returncode == -9
    (partial,) = tmp_path.glob("store.partial-*")
    assert (partial / "tokens.bin").exists() and not out.exists() and not is_store(partial)
    with pytest.raises(StoreError, match="no manifest.json"):
        open_store(partial)
    live = tmp_path / f"store.partial-{socket.gethostname()}-{os.getppid()}"  # another prepare, still running
    elsewhere = tmp_path / "store.partial-other-host-1"  # a dead-looking PID, but on a host this one cannot see
    live.mkdir()
    elsewhere.mkdir()
    assert open_store(prep.prepare(source, "default", out, progress=False)).n_docs == len(TEXTS) - 1
    assert not partial.exists() and live.exists() and elsewhere.exists()


def test_an_existing_store_is_never_overwritten(tmp_path):
    source = str(corpus(tmp_path))
    out = prep.prepare(source, "default", tmp_path / "store", progress=False)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    result = cli(source, "--tokenizer", "default", "--out", str(out))
    assert result.returncode == 2
    assert result.stderr.splitlines() == [f"error: {out} already exists; a store is never overwritten "
                                          "(remove it or pick another --out)"]  # fmt: skip
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


@pytest.mark.parametrize("out, extra, message", [
    ("link", [], "link already exists (a symbolic link); a store is never overwritten"),
    ("dangling", [], "dangling already exists (a symbolic link); a store is never overwritten"),
    ("file", [], "file already exists; a store is never overwritten"),
    ("file/store", [], "File exists"),
    ("/proc/flashcp-store", [], "/proc/flashcp-store"),  # read-only for root too
    ("store", ["--max-doc-tokens", "0"], "--max-doc-tokens must be >= 1, got 0"),
    ("store", ["--workers", "-1"], "--workers must be >= 1, got -1"),
])  # fmt: skip
def test_a_bad_output_or_number_is_one_line_and_touches_nothing(tmp_path, capsys, out, extra, message):
    source = str(corpus(tmp_path / "text"))
    (tmp_path / "file").write_text("mine")
    (tmp_path / "saved").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "saved", target_is_directory=True)
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    before = sorted((str(p), p.is_symlink()) for p in tmp_path.rglob("*"))
    assert prep.main([source, "--tokenizer", "default", "--out", str(tmp_path / out), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert sorted((str(p), p.is_symlink()) for p in tmp_path.rglob("*")) == before


def test_fingerprints_follow_the_source_and_the_tokenizer(tmp_path):
    def fingerprints(source: Path, tokenizer: str, name: str) -> tuple[str, str]:
        m = open_store(prep.prepare(str(source), tokenizer, tmp_path / name, progress=False)).manifest
        return m["source"]["fingerprint"], m["tokenizer"]["fingerprint"]

    source = corpus(tmp_path / "a")
    base = fingerprints(source, "default", "s0")
    assert fingerprints(source, "default", "s1") == base  # deterministic
    source.write_text(source.read_text().replace("last one", "last two"))  # same size, other content
    changed = fingerprints(source, "default", "s2")
    assert changed[0] != base[0] and changed[1] == base[1]
    source.rename(source.with_name("renamed.jsonl"))
    assert fingerprints(source.with_name("renamed.jsonl"), "default", "s3")[0] not in (base[0], changed[0])
    other = tmp_path / "other.json"  # the same tokenizer with one merge rule less is another tokenizer
    spec = json.loads(DEFAULT_TOKENIZER.read_text())
    spec["model"]["merges"] = spec["model"]["merges"][:-1]
    other.write_text(json.dumps(spec))
    assert fingerprints(source.with_name("renamed.jsonl"), str(other), "s4")[1] != base[1]


def test_token_dtype_fits_the_vocabulary():
    assert prep.token_dtype(4096) == np.uint16 and prep.token_dtype(1 << 16) == np.uint16
    assert prep.token_dtype((1 << 16) + 1) == np.uint32 and prep.token_dtype(1 << 32) == np.uint32
    with pytest.raises(StoreError, match="^big.json: a vocabulary of 4,294,967,297 ids does not fit"):
        prep.token_dtype((1 << 32) + 1, "big.json")


@pytest.mark.parametrize(
    "content, tokenizer, message",
    [
        (b'{"text": "ok"}\n{"text": oops}\n', "default", "cannot read json data: {data}: line 2: not a JSON"),
        (
            b'{"text": "ok"}\n{"text": "\xff"}\n',
            "default",
            "cannot read json data: {data}: line 2: not UTF-8",
        ),
        (b'{"body": "ok"}\n', "default", "{data} has no column 'text' (columns: ['body']); set --text-field"),
        (b'{"text": "ok"}\n', "{tmp}/bad.json", "cannot read tokenizer {tmp}/bad.json: "),
        (b'{"text": "ok"}\n', "{tmp}/none.model", "tokenizer file not found: {tmp}/none.model"),
    ],
)
def test_bad_input_is_one_line_naming_the_file(tmp_path, content, tokenizer, message):
    data = tmp_path / "data.jsonl"
    data.write_bytes(content)
    (tmp_path / "bad.json").write_text("not a tokenizer")
    result = cli(str(data), "--tokenizer", tokenizer.format(tmp=tmp_path), "--out", str(tmp_path / "s"))
    assert result.returncode == 2
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stderr.startswith("error: " + message.format(data=data, tmp=tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.json", "data.jsonl"]


def test_verify_checks_every_chunk_and_names_a_changed_one(tmp_path, capsys):
    out = prep.prepare(str(corpus(tmp_path)), "default", tmp_path / "store", progress=False)
    assert prep.main(["--verify", str(out)]) == 0
    assert f"{out}: intact (701 documents" in capsys.readouterr().out
    with open(out / "tokens.bin", "r+b") as f:  # a same-size edit near the end
        f.seek(-4, 2)
        f.write(b"\x01\x00\x02\x00")
    assert prep.main(["--verify", str(out)]) == 2
    assert "tokens.bin changed since it was prepared (checksum mismatch in tokens [0, " in capsys.readouterr().err


def test_a_document_the_loader_would_refuse_is_refused(tmp_path):
    with pytest.raises(StoreError, match="document 1 has [0-9,]+ tokens, more than --max-doc-tokens 5"):
        prep.prepare(str(corpus(tmp_path)), "default", tmp_path / "store", progress=False, max_doc_tokens=5)
    assert not any(p.name.startswith("store") for p in tmp_path.iterdir())
