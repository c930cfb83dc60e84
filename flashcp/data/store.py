"""A pre-tokenised corpus as memory-mapped files: any rank reads any document without the rest.

    store = open_store("data/corpus.tokens")
    store.lengths            # int64 [n_docs], raw token counts (no BOS/EOS: the loader adds them)
    store.document(i)        # a memory-mapped view of document i's token ids

Layout, format version 2 (the one Megatron's and nanoGPT's pretraining data use: one flat token
file plus document offsets, so reading a window costs its own bytes, whatever the corpus size or
the DP degree; plain numpy memmaps need no reader beyond numpy and page in only what is touched):
  tokens.bin     every document's token ids back to back, uint16 when the vocabulary fits, else uint32
  offsets.npy    int64 [n_docs + 1]: document i is tokens[offsets[i]:offsets[i+1]]; offsets[-1] = n_tokens
  checksums.npy  uint32 [n_chunks]: CRC-32 of each `chunk_bytes` chunk of tokens.bin
  manifest.json  written last: format, counts, dtype, chunk_bytes, the CRC-32 of offsets.npy, the
                 tokenizer's and the source's fingerprints

`python -m flashcp.data.prepare` writes it (atomically); this module only reads, with numpy.

Data must not change under a run. Opening checks offsets.npy whole (its CRC, monotonic, within the
token file); a chunk of tokens.bin is checked against its CRC the first time a document in it is
read (`TokenStore.read`), with every id below the vocabulary the store was prepared with, so a
changed byte or an id the model has no embedding for is named with the store and the position
instead of training silently (or failing deep in the model with a bare IndexError).
`python -m flashcp.data.prepare --verify DIR` checks every chunk at once. Version 1 stores have no
checksums and are refused (prepare them again).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import zlib
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = "flashcp-token-store"
VERSION = 2
MANIFEST = "manifest.json"
TOKENS = "tokens.bin"
OFFSETS = "offsets.npy"
CHECKSUMS = "checksums.npy"
CHUNK_BYTES = 1 << 20  # one CRC per MiB of tokens.bin: a window's first read checks little more than it reads
_REQUIRED = ("n_docs", "n_tokens", "dtype", "tokenizer", "source", "chunk_bytes", "offsets_crc32")
_OFFSET_BLOCK = 1 << 22  # offsets checked this many at a time (a store may hold billions of documents)
_DTYPES = ("uint16", "uint32")


class StoreError(ValueError):
    """A directory that is not a complete token store, or a store that cannot be written; says why."""


def file_fingerprint(path: str | Path) -> str:
    """"sha256:<hex>" of a file's bytes, streamed (a corpus file may be larger than memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return f"sha256:{digest.hexdigest()}"


def source_manifest(files: list[Path]) -> dict[str, Any]:
    """Names (relative to the files' common folder), sizes and sha256 of the source files, and one
    fingerprint over them all, so a changed, added, removed or renamed file is recognised."""
    root = Path(os.path.commonpath([f.parent.absolute() for f in files]))
    entries = [{"name": f.absolute().relative_to(root).as_posix(), "size": f.stat().st_size,
                "sha256": file_fingerprint(f)} for f in files]  # fmt: skip
    digest = hashlib.sha256(json.dumps(entries, sort_keys=True).encode())
    return {"fingerprint": f"sha256:{digest.hexdigest()}", "files": entries}


def is_store(path: str | Path) -> bool:
    """Whether `path` is a directory holding a token store's manifest."""
    manifest = Path(path) / MANIFEST
    if not manifest.is_file():
        return False
    try:
        return json.loads(manifest.read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def crc32(data: Any) -> int:
    return zlib.crc32(memoryview(data).cast("B"))


class ChunkHasher:
    """CRC-32 of each `chunk_bytes` chunk of a byte stream fed in pieces of any size."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES):
        self.chunk_bytes, self.crcs, self._crc, self._filled = chunk_bytes, [], 0, 0

    def update(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            take = min(len(view), self.chunk_bytes - self._filled)
            self._crc, self._filled = zlib.crc32(view[:take], self._crc), self._filled + take
            view = view[take:]
            if self._filled == self.chunk_bytes:
                self.crcs.append(self._crc)
                self._crc = self._filled = 0

    def finish(self) -> np.ndarray:
        """The CRCs, the last (short) chunk included."""
        return np.array(self.crcs + ([self._crc] if self._filled else []), dtype=np.uint32)


class TokenStore:
    """A complete store, its files memory-mapped (opened by `open_store`, which checks them)."""

    def __init__(self, path: Path, manifest: dict[str, Any], offsets: np.ndarray, checksums: np.ndarray):
        self.path, self.manifest, self.offsets = path, manifest, offsets
        self.n_docs, self.n_tokens = int(manifest["n_docs"]), int(manifest["n_tokens"])
        dtype = np.dtype(manifest["dtype"])
        self._tokens = np.memmap(path / TOKENS, dtype=dtype, mode="r", shape=(self.n_tokens,))
        self._bytes = np.memmap(path / TOKENS, dtype=np.uint8, mode="r")
        self.chunk_tokens = int(manifest["chunk_bytes"]) // dtype.itemsize
        self.vocab_size = manifest["tokenizer"].get("vocab_size")
        self._checksums = checksums
        self._verified = np.zeros(len(checksums), dtype=bool)

    def verify_chunk(self, c: int) -> None:
        """StoreError unless chunk `c` matches its CRC and holds only ids below the vocabulary."""
        lo, hi = c * self.chunk_tokens, min((c + 1) * self.chunk_tokens, self.n_tokens)
        itemsize = self._tokens.dtype.itemsize
        if crc32(self._bytes[lo * itemsize : hi * itemsize]) != int(self._checksums[c]):
            raise StoreError(f"token store {self.path}: {TOKENS} changed since it was prepared (checksum mismatch in "
                             f"tokens [{lo:,}, {hi:,})); prepare it again")  # fmt: skip
        if self.vocab_size is not None:
            chunk = self._tokens[lo:hi]
            above = np.flatnonzero(chunk >= self.vocab_size)
            if len(above):
                at = lo + int(above[0])
                doc = int(np.searchsorted(self.offsets, at, side="right")) - 1
                raise StoreError(f"token store {self.path}: token {at:,} (document {doc}) is id {int(chunk[above[0]])}, "
                                 f"beyond the tokenizer's vocabulary of {self.vocab_size}")  # fmt: skip
        self._verified[c] = True

    def read(self, i: int) -> np.ndarray:
        """Document i's token ids, its chunks verified on their first read (`verify_chunk`)."""
        view = self.document(i)
        start, stop = int(self.offsets[i]), int(self.offsets[i + 1])
        for c in range(start // self.chunk_tokens, (stop - 1) // self.chunk_tokens + 1):
            if not self._verified[c]:
                self.verify_chunk(c)
        return view

    @functools.cached_property
    def lengths(self) -> np.ndarray:
        """Raw token counts per document, computed on first use (it reads every offset)."""
        return np.diff(self.offsets)

    def document(self, i: int) -> np.ndarray:
        """Document i's token ids, a view of the memory-mapped token file."""
        if not 0 <= i < self.n_docs:
            raise IndexError(f"token store {self.path}: document {i} out of range [0, {self.n_docs})")
        return self._tokens[self.offsets[i] : self.offsets[i + 1]]

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """The flat token range [start, stop), across document boundaries."""
        return self._tokens[start:stop]


def open_store(path: str | Path) -> TokenStore:
    """The store at `path`; StoreError when it is missing, unfinished or inconsistent."""
    path = Path(path)
    where = f"token store {path}"
    if not path.is_dir():
        raise StoreError(f"{where}: no such directory")
    if not (path / MANIFEST).is_file():
        raise StoreError(f"{where}: no {MANIFEST} (not a store, or its prepare was interrupted)")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise StoreError(f"{where}: unreadable {MANIFEST}: {e}") from e
    found = (manifest.get("format"), manifest.get("version")) if isinstance(manifest, dict) else manifest
    if found == (FORMAT, 1):
        raise StoreError(f"{where}: format version 1 (no checksums); prepare it again with this FlashCP")
    if found != (FORMAT, VERSION):
        raise StoreError(f"{where}: {MANIFEST} describes {found!r}, expected {FORMAT!r} version {VERSION}")
    missing = [key for key in _REQUIRED if key not in manifest]
    if missing:
        raise StoreError(f"{where}: {MANIFEST} lacks {', '.join(missing)}")
    if manifest["dtype"] not in _DTYPES:
        raise StoreError(f"{where}: {MANIFEST} has dtype {manifest['dtype']!r}, not one of {_DTYPES}")
    n_docs, n_tokens = int(manifest["n_docs"]), int(manifest["n_tokens"])
    if n_docs < 1 or n_tokens < 1:
        raise StoreError(f"{where}: {MANIFEST} says {n_docs} documents, {n_tokens} tokens (none)")
    expected = n_tokens * np.dtype(manifest["dtype"]).itemsize
    if not (path / TOKENS).is_file():
        raise StoreError(f"{where}: no {TOKENS}")
    actual = (path / TOKENS).stat().st_size
    if actual != expected:
        raise StoreError(f"{where}: {TOKENS} holds {actual} bytes, the manifest says {expected}")
    try:
        offsets = np.load(path / OFFSETS, mmap_mode="r")
    except (OSError, ValueError) as e:
        raise StoreError(f"{where}: unreadable {OFFSETS}: {e}") from e
    if offsets.dtype != np.int64 or offsets.shape != (n_docs + 1,):
        raise StoreError(
            f"{where}: {OFFSETS} holds {offsets.dtype} {offsets.shape}, the manifest says int64 "
            f"({n_docs + 1},)"
        )
    if offsets[0] != 0 or offsets[-1] != n_tokens:
        raise StoreError(
            f"{where}: {OFFSETS} spans [{offsets[0]}, {offsets[-1]}], the manifest says [0, {n_tokens}]"
        )
    _check_offsets(where, offsets, path / OFFSETS, manifest["offsets_crc32"])
    chunk_bytes = manifest["chunk_bytes"]
    if not isinstance(chunk_bytes, int) or chunk_bytes < 1 or chunk_bytes % np.dtype(manifest["dtype"]).itemsize:
        raise StoreError(f"{where}: {MANIFEST} has chunk_bytes {chunk_bytes!r}, not a positive multiple of the id size")
    try:
        checksums = np.load(path / CHECKSUMS)
    except (OSError, ValueError) as e:
        raise StoreError(f"{where}: unreadable {CHECKSUMS}: {e}") from e
    n_chunks = -(-expected // chunk_bytes)
    if checksums.dtype != np.uint32 or checksums.shape != (n_chunks,):
        raise StoreError(f"{where}: {CHECKSUMS} holds {checksums.dtype} {checksums.shape}, expected uint32 ({n_chunks},)")
    return TokenStore(path, manifest, offsets, checksums)


def _check_offsets(where: str, offsets: np.ndarray, path: Path, crc: Any) -> None:
    """Offsets as prepared (CRC of the file) and increasing: every document holds at least one token."""
    for lo in range(0, len(offsets) - 1, _OFFSET_BLOCK):
        block = np.asarray(offsets[lo : lo + _OFFSET_BLOCK + 1])
        bad = np.flatnonzero(np.diff(block) < 1)
        if len(bad):
            i = lo + int(bad[0])
            raise StoreError(f"{where}: {OFFSETS} is not increasing: document {i} spans [{offsets[i]}, {offsets[i + 1]})")
    if crc32(np.memmap(path, dtype=np.uint8, mode="r")) != crc:
        raise StoreError(f"{where}: {OFFSETS} changed since it was prepared (checksum mismatch); prepare it again")
