"""A pre-tokenised corpus as memory-mapped files: any rank reads any document without the rest.

    store = open_store("data/corpus.tokens")
    store.lengths            # int64 [n_docs], raw token counts (no BOS/EOS: the loader adds them)
    store.read(i)            # document i's token ids, read and checked (what training uses)
    store.document(i)        # a memory-mapped view of document i's token ids (unchecked)

Layout, format version 2 (the one Megatron's and nanoGPT's pretraining data use: one flat token
file plus document offsets, so reading a window costs its own bytes, whatever the corpus size or
the DP degree; plain numpy memmaps need no reader beyond numpy and page in only what is touched):
  tokens.bin     every document's token ids back to back, uint16 when the vocabulary fits, else uint32
  offsets.npy    int64 [n_docs + 1]: document i is tokens[offsets[i]:offsets[i+1]]; offsets[-1] = n_tokens
  checksums.npy  uint32 [n_chunks]: CRC-32 of each `chunk_bytes` chunk of tokens.bin
  manifest.json  written last: format, counts, dtype, chunk_bytes, the CRC-32 of offsets.npy, the
                 tokenizer's and the source's fingerprints

`python -m flashcp.data.prepare` writes it (atomically); this module only reads, with numpy.

Data must not change under a run. Opening reads offsets.npy whole into memory and checks it (its
CRC, monotonic, within the token file). Training reads a document with `TokenStore.read`: a copy
read from tokens.bin (pread, never the memory map, where a file cut short under the job would end
the process with SIGBUS), checked before it is returned. The first read of a chunk checks the whole
chunk against its CRC and every id below the vocabulary the store was prepared with, and keeps the
CRC of each 4 KiB block of the bytes it verified; every later read checks the blocks it copies
against those (its own bytes plus at most a block at each end: ~0.1 ms per MiB read). So a byte
changed since the store was prepared, or since the job first read it, a file cut short, or an id
the model has no embedding for is named with the store and the span (StoreChanged, StoreError)
before any of it reaches a window. `python -m flashcp.data.prepare --verify DIR` checks every chunk
at once. Version 1 stores have no checksums and are refused (prepare them again).
"""

from __future__ import annotations

import functools
import hashlib
import io
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
BLOCK_BYTES = 1 << 12  # a verified chunk's CRCs per 4 KiB: every later read checks little more than it reads
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


class StoreChanged(StoreError):
    """tokens.bin no longer holds what was prepared (a checksum mismatch) or was cut short: data
    changed under the job, so nothing trained after it may be published."""


class TokenStore:
    """A complete store (opened by `open_store`, which checks it): training reads each document
    with `read`, a copy checked against the checksums; `document` / `tokens` are memory-mapped views."""

    def __init__(self, path: Path, manifest: dict[str, Any], offsets: np.ndarray, checksums: np.ndarray):
        self.path, self.manifest, self.offsets = path, manifest, offsets
        self.n_docs, self.n_tokens = int(manifest["n_docs"]), int(manifest["n_tokens"])
        self.dtype = np.dtype(manifest["dtype"])
        self.n_bytes = self.n_tokens * self.dtype.itemsize
        self._tokens = np.memmap(path / TOKENS, dtype=self.dtype, mode="r", shape=(self.n_tokens,))
        self._fd = os.open(path / TOKENS, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self._file = os.fdopen(self._fd, "rb", buffering=0)  # closes the descriptor with the store
        self.chunk_bytes = int(manifest["chunk_bytes"])
        self.chunk_tokens = self.chunk_bytes // self.dtype.itemsize
        self.vocab_size = manifest["tokenizer"].get("vocab_size")
        self._checksums = checksums
        self._verified = np.zeros(len(checksums), dtype=bool)
        # Blocks of a verified chunk, each with the CRC of the bytes verified (zeros: pages never touched
        # stay unallocated, so the array costs memory only for what this process reads).
        self.block_bytes = BLOCK_BYTES if self.chunk_bytes % BLOCK_BYTES == 0 else self.chunk_bytes
        self._block_crcs = np.zeros(-(-self.n_bytes // self.block_bytes), dtype=np.uint32)

    def _span(self, lo: int, hi: int) -> str:
        size = self.dtype.itemsize
        return f"tokens [{lo // size:,}, {-(-hi // size):,}) (bytes [{lo:,}, {hi:,}) of {TOKENS})"

    def _pread(self, lo: int, hi: int) -> bytearray:
        """Bytes [lo, hi) of tokens.bin, read (never through the map, where a file cut short since it
        was opened raises SIGBUS); StoreChanged when the file no longer holds them."""
        data = bytearray(hi - lo)
        view, done = memoryview(data), 0
        while done < len(data):
            n = os.preadv(self._fd, [view[done:]], lo + done)
            if n == 0:
                size = os.fstat(self._fd).st_size
                raise StoreChanged(f"token store {self.path}: {TOKENS} is {size:,} bytes now, not the {self.n_bytes:,} "
                                   f"it was opened with (cut short under the job): {self._span(lo, hi)} cannot be "
                                   "read")  # fmt: skip
            done += n
        return data

    def verify_chunk(self, c: int) -> None:
        """StoreChanged unless chunk `c` matches its CRC, StoreError unless it holds only ids below the
        vocabulary; then its blocks' CRCs are kept for `read`."""
        lo, hi = c * self.chunk_bytes, min((c + 1) * self.chunk_bytes, self.n_bytes)
        data = self._pread(lo, hi)
        if crc32(data) != int(self._checksums[c]):
            raise StoreChanged(f"token store {self.path}: {TOKENS} changed since it was prepared (checksum mismatch in "
                               f"tokens [{lo // self.dtype.itemsize:,}, {hi // self.dtype.itemsize:,})); prepare it "
                               "again")  # fmt: skip
        if self.vocab_size is not None:
            chunk = np.frombuffer(data, dtype=self.dtype)
            above = np.flatnonzero(chunk >= self.vocab_size)
            if len(above):
                at = lo // self.dtype.itemsize + int(above[0])
                doc = int(np.searchsorted(self.offsets, at, side="right")) - 1
                raise StoreError(f"token store {self.path}: token {at:,} (document {doc}) is id {int(chunk[above[0]])}, "
                                 f"beyond the tokenizer's vocabulary of {self.vocab_size}")  # fmt: skip
        step = self.block_bytes
        self._block_crcs[lo // step : -(-hi // step)] = [crc32(data[i : i + step]) for i in range(0, hi - lo, step)]
        self._verified[c] = True

    def read(self, i: int, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """Document i's token ids [lo, hi) (all by default): a copy read from the file, each block of it
        checked against the CRC of what was verified at its chunk's first read (`verify_chunk`), so a
        change made since, or a file cut short, is StoreChanged naming the span before any of it is
        returned. Only the chunks and blocks the range touches are read (a mesh-scope rank reads its
        shards' ranges alone)."""
        if not 0 <= i < self.n_docs:
            raise IndexError(f"token store {self.path}: document {i} out of range [0, {self.n_docs})")
        n = int(self.offsets[i + 1] - self.offsets[i])
        hi = n if hi is None else hi
        if not 0 <= lo < hi <= n:
            raise IndexError(f"token store {self.path}: tokens [{lo}, {hi}) of document {i} not within [0, {n})")
        size, step = self.dtype.itemsize, self.block_bytes
        start, stop = (int(self.offsets[i]) + lo) * size, (int(self.offsets[i]) + hi) * size
        for c in range(start // self.chunk_bytes, (stop - 1) // self.chunk_bytes + 1):
            if not self._verified[c]:
                self.verify_chunk(c)
        lo, hi = start // step * step, min(-(-stop // step) * step, self.n_bytes)
        data = self._pread(lo, hi)
        view = memoryview(data)
        crcs = [zlib.crc32(view[j : j + step]) for j in range(0, hi - lo, step)]  # plain ints: a few us per document
        kept = self._block_crcs[lo // step : -(-hi // step)].tolist()
        if crcs != kept:
            bad = [k for k, (a, b) in enumerate(zip(crcs, kept)) if a != b]
            raise StoreChanged(f"token store {self.path}: {TOKENS} changed under the job: "
                               f"{self._span(lo + bad[0] * step, min(lo + (bad[-1] + 1) * step, hi))} no longer hold "
                               f"what was verified when the job first read them (document {i}); restore the store "
                               "or prepare it again")  # fmt: skip
        return np.frombuffer(data, dtype=self.dtype)[(start - lo) // size : (stop - lo) // size]

    @functools.cached_property
    def lengths(self) -> np.ndarray:
        """Raw token counts per document, computed on first use (it reads every offset)."""
        return np.diff(self.offsets)

    def document(self, i: int) -> np.ndarray:
        """Document i's token ids, a view of the memory-mapped token file (unchecked: see `read`)."""
        if not 0 <= i < self.n_docs:
            raise IndexError(f"token store {self.path}: document {i} out of range [0, {self.n_docs})")
        return self._tokens[self.offsets[i] : self.offsets[i + 1]]

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """The flat token range [start, stop), across document boundaries (a memory-mapped view)."""
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
        raw, offsets = _read_npy(path / OFFSETS)
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
    _check_offsets(where, offsets, raw, manifest["offsets_crc32"])
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


def _read_npy(path: Path) -> tuple[bytearray, np.ndarray]:
    """A .npy file's bytes, read whole, and the array they hold (a view of them): the offsets a job
    uses are the bytes whose CRC was checked, and a file cut short later cannot fault a read."""
    with open(path, "rb") as f:
        raw = bytearray(os.fstat(f.fileno()).st_size)
        if f.readinto(raw) != len(raw):
            raise ValueError("the file changed while it was read")
    header = io.BytesIO(raw)
    version = np.lib.format.read_magic(header)
    read_header = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
    if version not in read_header:
        raise ValueError(f".npy format version {version}")
    shape, fortran, dtype = read_header[version](header)
    count = int(np.prod(shape))
    if fortran or len(shape) != 1 or header.tell() + count * dtype.itemsize != len(raw):
        raise ValueError(f"not a flat array of {shape} {dtype} filling the file")
    return raw, np.frombuffer(raw, dtype=dtype, count=count, offset=header.tell())


def _check_offsets(where: str, offsets: np.ndarray, raw: bytearray, crc: Any) -> None:
    """Offsets as prepared (CRC of the file) and increasing: every document holds at least one token."""
    for lo in range(0, len(offsets) - 1, _OFFSET_BLOCK):
        block = np.asarray(offsets[lo : lo + _OFFSET_BLOCK + 1])
        bad = np.flatnonzero(np.diff(block) < 1)
        if len(bad):
            i = lo + int(bad[0])
            raise StoreError(f"{where}: {OFFSETS} is not increasing: document {i} spans [{offsets[i]}, {offsets[i + 1]})")
    if crc32(raw) != crc:
        raise StoreError(f"{where}: {OFFSETS} changed since it was prepared (checksum mismatch); prepare it again")
