"""The token store reader: documents and ranges read back from the memory-mapped files, and every
incomplete or inconsistent directory refused with a StoreError naming it."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import numpy as np
import pytest

from flashcp.data.store import file_fingerprint, is_store, open_store, StoreChanged, StoreError

DOCS = [[5, 6, 7], [8], [9, 10, 11, 65535]]


CHUNK = 4  # bytes per checksummed chunk: two uint16 ids, so documents span chunks


def write_store(path: Path, docs: list[list[int]] = DOCS, dtype: str = "uint16", chunk: int = CHUNK,
                **manifest) -> Path:  # fmt: skip
    """A store as `prepare` lays it out, written directly (the reader must not need prepare)."""
    path.mkdir(parents=True)
    data = np.concatenate([np.asarray(d, dtype=dtype) for d in docs]).tobytes()
    (path / "tokens.bin").write_bytes(data)
    np.save(path / "checksums.npy", np.array([zlib.crc32(data[i : i + chunk]) for i in range(0, len(data), chunk)],
                                             dtype=np.uint32))  # fmt: skip
    np.save(path / "offsets.npy", np.concatenate([[0], np.cumsum([len(d) for d in docs])]).astype(np.int64))
    fields = {"format": "flashcp-token-store", "version": 2, "n_docs": len(docs), "n_tokens": sum(map(len, docs)),
              "dtype": dtype, "tokenizer": {}, "source": {}, "chunk_bytes": chunk,
              "offsets_crc32": zlib.crc32((path / "offsets.npy").read_bytes())}  # fmt: skip
    (path / "manifest.json").write_text(json.dumps({**fields, **manifest}))
    return path


def test_documents_and_ranges_read_back(tmp_path):
    store = open_store(write_store(tmp_path / "s"))
    assert (store.n_docs, store.n_tokens) == (3, 8)
    assert [store.document(i).tolist() for i in range(3)] == DOCS
    assert store.lengths.tolist() == [3, 1, 4] and store.offsets.tolist() == [0, 3, 4, 8]
    assert store.tokens(2, 5).tolist() == [7, 8, 9]
    assert isinstance(store.document(2).base, np.memmap) or isinstance(store.document(2), np.memmap)
    with pytest.raises(IndexError, match=r"document 3 out of range \[0, 3\)"):
        store.document(3)
    with pytest.raises(IndexError, match="document -1"):
        store.document(-1)


def test_a_range_of_a_document_reads_only_its_chunks(tmp_path):
    """A mesh-scope rank reads part of a document: only the chunks under it are checked and read."""
    path = write_store(tmp_path / "s")
    write_token(path, 6, 12)  # document 2's third token, chunk [6, 8)
    store = open_store(path)
    assert store.read(2, 0, 2).tolist() == [9, 10] and store.read(0, 1).tolist() == [6, 7]
    with pytest.raises(StoreChanged, match=r"checksum mismatch in tokens \[6, 8\)"):
        store.read(2, 1, 3)
    with pytest.raises(IndexError, match=r"tokens \[2, 5\) of document 2 not within \[0, 4\)"):
        store.read(2, 2, 5)


def test_uint32_tokens(tmp_path):
    docs = [[1, 70000], [2**32 - 1]]
    store = open_store(write_store(tmp_path / "s", docs, dtype="uint32"))
    assert [store.document(i).tolist() for i in range(2)] == docs


def test_is_store(tmp_path):
    assert is_store(write_store(tmp_path / "s"))
    assert not is_store(tmp_path / "nowhere")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "manifest.json").write_text('{"format": "something else"}')
    assert not is_store(tmp_path / "other")
    (tmp_path / "other" / "manifest.json").write_text("[1, 2]")
    assert not is_store(tmp_path / "other")


def test_file_fingerprint_is_the_sha256_of_the_bytes(tmp_path):
    f = tmp_path / "f"
    f.write_bytes(b"x" * (3 << 20))  # several read blocks
    assert file_fingerprint(f) == "sha256:" + hashlib.sha256(b"x" * (3 << 20)).hexdigest()


def damage(path: Path, what: str) -> None:
    manifest = json.loads((path / "manifest.json").read_text())
    if what == "no manifest":
        (path / "manifest.json").unlink()
    elif what == "bad json":
        (path / "manifest.json").write_text('{"format": ')
    elif what == "version":
        (path / "manifest.json").write_text(json.dumps({**manifest, "version": 99}))
    elif what == "missing key":
        del manifest["source"]
        (path / "manifest.json").write_text(json.dumps(manifest))
    elif what == "dtype":
        (path / "manifest.json").write_text(json.dumps({**manifest, "dtype": "float32"}))
    elif what == "short tokens":
        (path / "tokens.bin").write_bytes((path / "tokens.bin").read_bytes()[:-2])
    elif what == "no tokens":
        (path / "tokens.bin").unlink()
    elif what == "offsets shape":
        np.save(path / "offsets.npy", np.array([0, 3, 8], dtype=np.int64))
    elif what == "offsets dtype":
        np.save(path / "offsets.npy", np.array([0, 3, 4, 8], dtype=np.int32))
    elif what == "offsets end":
        np.save(path / "offsets.npy", np.array([0, 3, 4, 7], dtype=np.int64))
    elif what == "offsets decreasing":  # same size, its checksum recomputed: only the order gives it away
        np.save(path / "offsets.npy", np.array([0, 5, 4, 8], dtype=np.int64))
        manifest["offsets_crc32"] = zlib.crc32((path / "offsets.npy").read_bytes())
        (path / "manifest.json").write_text(json.dumps(manifest))
    elif what == "offsets edited":
        np.save(path / "offsets.npy", np.array([0, 2, 4, 8], dtype=np.int64))
    elif what == "version 1":
        (path / "manifest.json").write_text(json.dumps({**manifest, "version": 1}))
    elif what == "no checksums":
        (path / "checksums.npy").unlink()
    elif what == "offsets garbage":
        (path / "offsets.npy").write_bytes(b"not numpy")
    elif what == "empty":
        (path / "manifest.json").write_text(json.dumps({**manifest, "n_docs": 0, "n_tokens": 0}))


@pytest.mark.parametrize(
    "what, message",
    [
        ("no manifest", r"no manifest.json \(not a store, or its prepare was interrupted\)"),
        ("bad json", "unreadable manifest.json"),
        ("version", r"describes \('flashcp-token-store', 99\), expected 'flashcp-token-store' version 2"),
        ("missing key", "manifest.json lacks source"),
        ("dtype", "manifest.json has dtype 'float32'"),
        ("short tokens", "tokens.bin holds 14 bytes, the manifest says 16"),
        ("no tokens", "no tokens.bin"),
        ("offsets shape", r"offsets.npy holds int64 \(3,\), the manifest says int64 \(4,\)"),
        ("offsets dtype", r"offsets.npy holds int32 \(4,\)"),
        ("offsets end", r"offsets.npy spans \[0, 7\], the manifest says \[0, 8\]"),
        ("offsets garbage", "unreadable offsets.npy"),
        ("offsets decreasing", r"offsets.npy is not increasing: document 1 spans \[5, 4\)"),
        ("offsets edited", "offsets.npy changed since it was prepared"),
        ("version 1", r"format version 1 \(no checksums\); prepare it again"),
        ("no checksums", "unreadable checksums.npy"),
        ("empty", "says 0 documents, 0 tokens"),
    ],
)
def test_bad_stores_are_refused_naming_the_directory(tmp_path, what, message):
    path = write_store(tmp_path / "s")
    damage(path, what)
    with pytest.raises(StoreError, match=message) as info:
        open_store(path)
    assert str(info.value).startswith(f"token store {path}: ") and "\n" not in str(info.value)


def test_a_missing_directory_is_refused(tmp_path):
    with pytest.raises(StoreError, match=f"token store {tmp_path / 'nowhere'}: no such directory"):
        open_store(tmp_path / "nowhere")


def test_a_changed_token_is_caught_on_the_first_read_of_its_chunk(tmp_path):
    path = write_store(tmp_path / "s")
    with open(path / "tokens.bin", "r+b") as f:  # token 5 (document 2), same size
        f.seek(10)
        f.write(np.array([12], dtype=np.uint16).tobytes())
    store = open_store(path)  # opening reads no token
    assert store.read(0).tolist() == [5, 6, 7] and store.read(1).tolist() == [8]  # other chunks read fine
    with pytest.raises(StoreError, match=rf"token store {path}: tokens.bin changed since it was prepared "
                                         r"\(checksum mismatch in tokens \[4, 6\)\)"):
        store.read(2)


def test_an_id_beyond_the_vocabulary_is_named_with_store_and_position(tmp_path):
    path = write_store(tmp_path / "s", tokenizer={"vocab_size": 1000})
    store = open_store(path)
    assert store.read(0).tolist() == [5, 6, 7]
    with pytest.raises(StoreError, match=rf"token store {path}: token 7 \(document 2\) is id 65535, beyond the "
                                         "tokenizer's vocabulary of 1000"):
        store.read(2)


def write_token(path: Path, at: int, value: int) -> None:
    """Overwrite token `at` of a uint16 store in place (same size, as an edit under a running job would)."""
    with open(path / "tokens.bin", "r+b") as f:
        f.seek(2 * at)
        f.write(np.array([value], dtype=np.uint16).tobytes())


def test_a_token_changed_after_its_first_read_is_caught_on_every_later_read(tmp_path):
    path = write_store(tmp_path / "s")
    store = open_store(path)
    assert [store.read(i).tolist() for i in range(3)] == DOCS  # every chunk verified
    write_token(path, 5, 12)  # document 2, chunk [4, 6)
    assert store.read(0).tolist() == [5, 6, 7] and store.read(1).tolist() == [8]  # other blocks read fine
    for _ in range(2):
        with pytest.raises(StoreChanged, match=rf"^token store {path}: tokens.bin changed under the job: tokens "
                                               r"\[4, 6\) \(bytes \[8, 12\) of tokens.bin\) no longer hold what was "
                                               r"verified when the job first read them \(document 2\)"):
            store.read(2)
    write_token(path, 5, 10)  # changed back: the verified bytes again
    assert store.read(2).tolist() == DOCS[2]


def test_a_read_checks_the_4_kib_blocks_it_copies_not_the_whole_mib(tmp_path):
    """With MiB chunks, a later read checks only its 4 KiB blocks against the CRCs kept at the first read."""
    docs = [list(range(1000 + i, 1000 + i + 3000)) for i in range(8)]  # 6,000 bytes each, 48,000 in all
    path = write_store(tmp_path / "s", docs, chunk=1 << 20)
    store = open_store(path)
    assert store.block_bytes == 4096 and [store.read(i).tolist() for i in range(8)] == docs
    write_token(path, 3 * 3000 + 10, 7)  # document 3, byte 18,020: block [16,384, 20,480)
    assert store.read(1).tolist() == docs[1] and store.read(5).tolist() == docs[5]  # their blocks are intact
    with pytest.raises(StoreChanged, match=r"tokens \[8,192, 10,240\) \(bytes \[16,384, 20,480\) of tokens.bin\)"):
        store.read(3)


TRUNCATED = """
import os, sys
from flashcp.data.store import open_store, StoreError
store = open_store(sys.argv[1])
store.read(0)  # verified, then the file is cut short under the job
os.truncate(os.path.join(sys.argv[1], "tokens.bin"), 4)
for i in (0, 2):
    try:
        store.read(i).tolist()
    except StoreError as e:
        print(type(e).__name__, e)
"""


def test_a_store_cut_short_under_the_job_is_one_line_naming_it_not_sigbus(tmp_path):
    """Run in a child: reading a memory map past a file's new end kills the process with SIGBUS."""
    path = write_store(tmp_path / "s", [list(range(1, 5000)), list(range(5000, 9000)), list(range(9000, 12000))],
                       chunk=4096)  # fmt: skip
    done = subprocess.run([sys.executable, "-c", TRUNCATED, str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines == [f"StoreChanged token store {path}: tokens.bin is 4 bytes now, not the 23,998 it was opened "
                     f"with (cut short under the job): tokens [{a:,}, {b:,}) (bytes [{2 * a:,}, {2 * b:,}) of "
                     "tokens.bin) cannot be read" for a, b in ((0, 6144), (8192, 10240))]  # fmt: skip
