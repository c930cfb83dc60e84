"""A pre-tokenised corpus as memory-mapped files: any rank reads any document without the rest.

    store = open_store("data/corpus.tokens")
    store.lengths            # int64 [n_docs], raw token counts (no BOS/EOS: the loader adds them)
    store.document(i)        # a memory-mapped view of document i's token ids

Layout, format version 1 (the one Megatron's and nanoGPT's pretraining data use: one flat token
file plus document offsets, so reading a window costs its own bytes, whatever the corpus size or
the DP degree; plain numpy memmaps need no reader beyond numpy and page in only what is touched):
  tokens.bin     every document's token ids back to back, uint16 when the vocabulary fits, else uint32
  offsets.npy    int64 [n_docs + 1]: document i is tokens[offsets[i]:offsets[i+1]]; offsets[-1] = n_tokens
  manifest.json  written last: format, counts, dtype, the tokenizer's and the source's fingerprints

`python -m flashcp.data.prepare` writes it (atomically); this module only reads, with numpy.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = "flashcp-token-store"
VERSION = 1
MANIFEST = "manifest.json"
TOKENS = "tokens.bin"
OFFSETS = "offsets.npy"
_REQUIRED = ("n_docs", "n_tokens", "dtype", "tokenizer", "source")
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


def is_store(path: str | Path) -> bool:
    """Whether `path` is a directory holding a token store's manifest."""
    manifest = Path(path) / MANIFEST
    if not manifest.is_file():
        return False
    try:
        return json.loads(manifest.read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


class TokenStore:
    """A complete store, its files memory-mapped (opened by `open_store`, which checks them)."""

    def __init__(self, path: Path, manifest: dict[str, Any], offsets: np.ndarray):
        self.path, self.manifest, self.offsets = path, manifest, offsets
        self.n_docs, self.n_tokens = int(manifest["n_docs"]), int(manifest["n_tokens"])
        dtype = np.dtype(manifest["dtype"])
        self._tokens = np.memmap(path / TOKENS, dtype=dtype, mode="r", shape=(self.n_tokens,))

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
    return TokenStore(path, manifest, offsets)
