"""Documents from a prepared token store (`python -m flashcp.data.prepare`), read lazily.

A window's tokens are read only when that window is materialised: every rank still walks the
step's whole window sequence (its state stays independent of the DP layout), but for the other
ranks' windows it only needs document lengths, which the store's offsets give without touching
the token file. So each rank reads just its own windows, whatever the DP size.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from flashcp.data.store import file_fingerprint, open_store, StoreChanged, StoreError, TokenStore
from flashcp.data.errors import DataChanged, DataError


class StoreDoc:
    """One stored document framed by BOS / EOS, whose tokens are read (a checked copy,
    `TokenStore.read`) at the first slice."""

    __slots__ = ("_store", "_index", "_bos", "_eos", "_tokens")

    def __init__(self, store: TokenStore, index: int, bos: int | None, eos: int | None):
        self._store, self._index, self._bos, self._eos = store, index, bos, eos
        self._tokens: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self._store.lengths[self._index]) + (self._bos is not None) + (self._eos is not None)

    def __getitem__(self, index: slice) -> np.ndarray:
        if self._tokens is None:
            self._tokens = self.span(0, len(self))
        return self._tokens[index]

    def span(self, lo: int, hi: int) -> np.ndarray:
        """Tokens [lo, hi) of the framed document (clipped to its end), reading only those from the
        store and keeping nothing: what a mesh-scope rank takes of a document it shares."""
        b, n = int(self._bos is not None), int(self._store.lengths[self._index])
        hi = min(hi, len(self))
        parts = [[self._bos]] if b and lo == 0 < hi else []
        if max(lo - b, 0) < min(hi - b, n):
            try:
                parts.append(self._store.read(self._index, max(lo - b, 0), min(hi - b, n)))
            except StoreChanged as e:
                raise DataChanged(str(e)) from e
            except StoreError as e:
                raise DataError(str(e)) from e
        if self._eos is not None and hi == len(self) > lo:
            parts.append([self._eos])
        return np.concatenate([np.asarray(p, dtype=np.int64) for p in parts]) if parts else np.zeros(0, np.int64)


class StoreSource:
    """A DocSource over a token store, shuffled per epoch like the text sources."""

    def __init__(self, path: str | Path, tokenizer_path: Path, bos: int | None, eos: int | None,
                 shuffle: bool, seed: int):  # fmt: skip
        try:
            self._store = open_store(path)
        except StoreError as e:
            raise DataError(str(e)) from e
        saved = self._store.manifest["tokenizer"]
        now = file_fingerprint(tokenizer_path)
        if saved["fingerprint"] != now:
            raise DataError(
                f"token store {path} was prepared with tokenizer {saved['name']} ({saved['fingerprint'][:19]}), "
                f"not [data] tokenizer {tokenizer_path} ({now[:19]}); prepare it again with this tokenizer"
            )
        self.name = f"token store {path}"
        self.ident = f"store:{self._store.manifest['source']['fingerprint']}:{self._store.n_docs}"
        self._bos, self._eos, self._shuffle, self._seed = bos, eos, shuffle, seed

    @functools.lru_cache(maxsize=2)
    def _order(self, epoch: int) -> np.ndarray:
        n = self._store.n_docs
        return np.random.default_rng((self._seed, epoch)).permutation(n) if self._shuffle else np.arange(n)

    @functools.lru_cache(maxsize=2)
    def epoch_starts(self, epoch: int) -> np.ndarray:
        """Token offset of each document of the epoch (BOS / EOS included), then the epoch's total."""
        framed = self._store.lengths[self._order(epoch)] + (self._bos is not None) + (self._eos is not None)
        return np.concatenate(([0], np.cumsum(framed)))

    def document(self, epoch: int, position: int) -> StoreDoc:
        """The document at `position` of the epoch's order, read at its first slice."""
        return StoreDoc(self._store, int(self._order(epoch)[position]), self._bos, self._eos)

    def epoch(self, epoch: int, start: int) -> Iterator[tuple[int, StoreDoc]]:
        order = self._order(epoch)
        for position in range(start, self._store.n_docs):
            yield position, StoreDoc(self._store, int(order[position]), self._bos, self._eos)
