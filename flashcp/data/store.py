"""A pre-tokenised corpus as memory-mapped files: any rank reads any document without the rest.

    store = open_store("data/corpus.tokens")
    store.lengths            # int64 [n_docs], raw token counts (no BOS/EOS: the loader adds them)
    store.document(i)        # a memory-mapped view of document i's token ids

Layout (the one Megatron's and nanoGPT's pretraining data use: one flat token file plus document
offsets, so reading a window costs its own bytes, whatever the corpus size or the DP degree):
  tokens.bin     every document's token ids back to back, uint16 when the vocabulary fits, else uint32
  offsets.bin    int64 [n_docs + 1]: document i is tokens[offsets[i]:offsets[i+1]]
  manifest.json  written last: format, counts, dtype, the tokenizer's and the source's fingerprints

`python -m flashcp.data.prepare` writes it (atomically); this module only reads, with numpy.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = "flashcp-token-store"
VERSION = 1
MANIFEST = "manifest.json"


class StoreError(ValueError):
    """A directory that is not a complete token store; says which and why."""


def file_fingerprint(path: str | Path) -> str:
    """sha256 of a file's bytes, streamed."""
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
    except (OSError, ValueError):
        return False


class TokenStore:
    """A complete store, its files memory-mapped (opened by `open_store`)."""

    def __init__(self, path: Path, manifest: dict[str, Any]):
        self.path, self.manifest = path, manifest
        self.n_docs, self.n_tokens = int(manifest["n_docs"]), int(manifest["n_tokens"])
        self.offsets = np.memmap(path / "offsets.bin", dtype=np.int64, mode="r", shape=(self.n_docs + 1,))
        self._tokens = np.memmap(path / "tokens.bin", dtype=np.dtype(manifest["dtype"]), mode="r",
                                 shape=(self.n_tokens,))  # fmt: skip
        self.lengths = np.diff(self.offsets)

    def document(self, i: int) -> np.ndarray:
        return self._tokens[self.offsets[i] : self.offsets[i + 1]]

    def tokens(self, start: int, stop: int) -> np.ndarray:
        return self._tokens[start:stop]


def open_store(path: str | Path) -> TokenStore:
    """The store at `path`; StoreError when it is missing, unfinished or inconsistent."""
    path = Path(path)
    manifest_path = path / MANIFEST
    if not path.is_dir():
        raise StoreError(f"token store {path}: no such directory")
    if not manifest_path.is_file():
        raise StoreError(f"token store {path}: no {MANIFEST} (not a store, or its prepare was interrupted)")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as e:
        raise StoreError(f"token store {path}: unreadable {MANIFEST}: {e}") from e
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise StoreError(f"token store {path}: format {manifest.get('format')!r} version "
                         f"{manifest.get('version')!r}, expected {FORMAT!r} version {VERSION}")  # fmt: skip
    itemsize = np.dtype(manifest["dtype"]).itemsize
    expected = {"tokens.bin": manifest["n_tokens"] * itemsize, "offsets.bin": (manifest["n_docs"] + 1) * 8}
    for name, size in expected.items():
        actual = (path / name).stat().st_size if (path / name).is_file() else None
        if actual != size:
            raise StoreError(f"token store {path}: {name} holds {actual} bytes, the manifest says {size}")
    return TokenStore(path, manifest)
