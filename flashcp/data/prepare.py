"""Tokenise a corpus once into a memory-mapped token store (`flashcp.data.store`).

    python -m flashcp.data.prepare SOURCE --tokenizer T --out DIR [--workers K] [--max-doc-tokens N]
                                   [--text-field F] [--txt-sample-by document|paragraph|line]
    python -m flashcp.data.prepare --verify DIR     # every chunk against its checksum, ids in the vocabulary

SOURCE is what `[data] source` accepts for local text (a file, directory or glob of .jsonl / .json /
.parquet / .txt, optionally compressed, or `default`), T a tokenizer path or `default`.

Texts are read through HF `datasets`, which converts the files to Arrow on disk and memory-maps it,
so a corpus larger than memory streams through. Chunks of documents go to K worker processes with
at most 2K chunks in flight, and come back in order: the store is byte-identical for any K, and
memory holds a few chunks, never the corpus. Tokens and offsets are appended to files as chunks
come back. The output is plain numpy memmaps, the layout Megatron and nanoGPT use, because the
loader reads random windows of it on every rank: a flat file plus offsets does that with numpy
alone, paging in only the bytes read.

Atomic: the store is built in `DIR.partial-<host>-<pid>`, and renamed to DIR after its manifest is
written last and everything is synced, so an interrupted prepare leaves no store that opens; the
next prepare removes leftovers it can prove dead (its own host's, of ended processes) and names the
others. An existing DIR is never overwritten.
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing
import os
import shutil
import socket
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from flashcp.data.store import CHECKSUMS, ChunkHasher, CHUNK_BYTES, crc32, file_fingerprint, FORMAT, MANIFEST
from flashcp.data.store import OFFSETS, open_store, source_manifest, StoreError, TOKENS, VERSION

CHUNK_DOCS = 256  # documents per task handed to a worker
_IN_FLIGHT_PER_WORKER = 2  # chunks queued per worker: keeps each busy, bounds memory
_RAW_OFFSETS = "offsets.raw"  # offsets streamed here, then given their .npy header

_tokenizer: Any = None  # this process's tokenizer, loaded once


def _load_tokenizer(path: str) -> None:
    global _tokenizer
    from flashcp.data.tokenizer import load_tokenizer

    _tokenizer = load_tokenizer(path)


def _encode(texts: list[str | None]) -> list[list[int]]:
    return _tokenizer.encode_batch([t or "" for t in texts])


def _chunks(ds) -> Iterator[list[str | None]]:
    for start in range(0, len(ds), CHUNK_DOCS):
        yield ds[start : start + CHUNK_DOCS]["text"]


def ordered_imap(pool, fn: Callable, items: Iterable, window: int) -> Iterator:
    """`fn(item)` for each item, computed in `pool`, yielded in order with at most `window` pending.

    `Pool.imap` pulls its whole input as fast as it can and keeps every finished result that waits
    for an earlier slow one; a bounded window keeps memory at a few chunks whatever the corpus.
    """
    pending: collections.deque = collections.deque()
    for item in items:
        if len(pending) == window:
            yield pending.popleft().get()
        pending.append(pool.apply_async(fn, (item,)))
    while pending:
        yield pending.popleft().get()


def token_dtype(vocab_size: int, tokenizer: str | Path = "the tokenizer") -> np.dtype:
    """uint16 when every id fits, else uint32; StoreError for a vocabulary beyond uint32."""
    for dtype in (np.uint16, np.uint32):
        if vocab_size <= 1 + int(np.iinfo(dtype).max):
            return np.dtype(dtype)
    raise StoreError(f"{tokenizer}: a vocabulary of {vocab_size:,} ids does not fit the store's uint32 ids")


def _partial(out: Path) -> Path:
    """This process's build folder: its name says which host and process own it."""
    return out.with_name(f"{out.name}.partial-{socket.gethostname()}-{os.getpid()}")


def _remove_leftovers(out: Path) -> None:
    """Delete the partial folders of `out` whose prepare is provably gone: built on this host by a
    process that no longer exists. A folder of another host (a shared file system) or of a live
    process is kept, and one of another host is named, since only that host can tell."""
    host = socket.gethostname()
    for leftover in out.parent.glob(f"{out.name}.partial-*"):
        owner, _, pid = leftover.name.removeprefix(f"{out.name}.partial-").rpartition("-")
        if owner != host or not pid.isdigit():
            print(f"prepare: leaving {leftover}: built by {owner or 'an unknown host'} (PID {pid}), which this "
                  "host cannot check; remove it once that prepare has ended", file=sys.stderr)  # fmt: skip
            continue
        try:
            os.kill(int(pid), 0)
            continue  # still building
        except ProcessLookupError:
            shutil.rmtree(leftover, ignore_errors=True)
        except PermissionError:  # alive, another user's
            continue


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def prepare(
    source: str,
    tokenizer: str,
    out: str | Path,
    workers: int = 1,
    text_field: str = "text",
    txt_sample_by: str = "document",
    progress: bool = True,
    max_doc_tokens: int = 1 << 20,
) -> Path:
    """Build the store at `out` (see the module docstring); returns its path."""
    from tqdm import tqdm

    from flashcp.data.sources import data_files, DataConfig, DEFAULT_CORPUS, DEFAULT_TOKENIZER, load_files
    from flashcp.data.tokenizer import tokenizer_file

    out = Path(out).absolute()
    if out.exists() or out.is_symlink():
        link = " (a symbolic link)" if out.is_symlink() else ""
        raise StoreError(f"{out} already exists{link}; a store is never overwritten (remove it or pick another --out)")
    if workers < 1:
        raise StoreError(f"--workers must be >= 1, got {workers}")
    if max_doc_tokens < 1:
        raise StoreError(f"--max-doc-tokens must be >= 1, got {max_doc_tokens}")
    tok_path = tokenizer_file(DEFAULT_TOKENIZER if tokenizer == "default" else tokenizer)
    _load_tokenizer(str(tok_path))
    dtype = token_dtype(_tokenizer.vocab_size, tok_path)
    files = data_files(str(DEFAULT_CORPUS) if source == "default" else source)
    ds = load_files(files, DataConfig(text_field=text_field, txt_sample_by=txt_sample_by), "--text-field")

    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(out)
    partial = _partial(out)
    partial.mkdir()
    try:
        bar = tqdm(total=len(ds), unit="doc", desc=f"prepare {out.name}", disable=not progress)
        n_docs, n_tokens = _write(ds, tok_path, partial, dtype, workers, bar, max_doc_tokens)
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "n_docs": n_docs,
            "n_tokens": n_tokens,
            "dtype": dtype.name,
            "chunk_bytes": CHUNK_BYTES,
            "offsets_crc32": crc32(np.memmap(partial / OFFSETS, dtype=np.uint8, mode="r")),
            "tokenizer": {
                "fingerprint": file_fingerprint(tok_path),
                "vocab_size": _tokenizer.vocab_size,
                "bos_id": _tokenizer.bos_id,
                "eos_id": _tokenizer.eos_id,
                "name": tok_path.name,
            },
            "source": {**source_manifest(files), "text_field": text_field, "txt_sample_by": txt_sample_by},
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        with open(partial / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _fsync(partial)
        if out.exists():  # another prepare finished first; rename would replace an empty DIR
            raise StoreError(f"{out} appeared while preparing; a store is never overwritten")
        os.rename(partial, out)
        _fsync(out.parent)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return out


def _write(ds, tok_path: Path, folder: Path, dtype: np.dtype, workers: int, bar,
           max_doc_tokens: int) -> tuple[int, int]:  # fmt: skip
    """Tokenise `ds` chunk by chunk, in order, into the token, offset and checksum files; (documents, tokens).

    A document longer than `max_doc_tokens` is refused, as the loader refuses it from text
    (`data.max_doc_tokens`): a store must not hold what the same text would not train on.
    """
    n_docs = n_tokens = 0
    hasher = ChunkHasher()
    pool = None
    with open(folder / TOKENS, "wb") as tokens, open(folder / _RAW_OFFSETS, "wb") as offsets, bar:
        offsets.write(np.zeros(1, dtype=np.int64).tobytes())
        if workers == 1:
            encoded = map(_encode, _chunks(ds))
        else:
            pool = multiprocessing.get_context("spawn").Pool(workers, _load_tokenizer, (str(tok_path),))
            encoded = ordered_imap(pool, _encode, _chunks(ds), _IN_FLIGHT_PER_WORKER * workers)
        try:
            for row, chunk in enumerate(encoded):
                kept = [ids for ids in chunk if ids]  # an empty document is not stored
                if kept:
                    lens = np.array([len(ids) for ids in kept], dtype=np.int64)
                    if lens.max() > max_doc_tokens:
                        i = next(i for i, ids in enumerate(chunk) if len(ids) > max_doc_tokens)
                        raise StoreError(f"document {row * CHUNK_DOCS + i} has {len(chunk[i]):,} tokens, more than --max-doc-tokens "
                                         f"{max_doc_tokens:,} (a mangled or non-text file? raise the limit if intended)")  # fmt: skip
                    data = np.concatenate([np.asarray(ids, dtype=dtype) for ids in kept]).tobytes()
                    hasher.update(data)
                    tokens.write(data)
                    offsets.write((n_tokens + np.cumsum(lens)).tobytes())
                    n_docs, n_tokens = n_docs + len(kept), n_tokens + int(lens.sum())
                bar.update(len(chunk))
                bar.set_postfix(tokens=f"{n_tokens:,}", refresh=False)
        finally:
            if pool is not None:
                pool.terminate()
        tokens.flush()
        os.fsync(tokens.fileno())
    if n_docs == 0:
        raise StoreError("the source holds no document with any tokens")
    np.save(folder / CHECKSUMS, hasher.finish())
    _to_npy(folder / _RAW_OFFSETS, folder / OFFSETS, n_docs + 1)
    return n_docs, n_tokens


def _to_npy(raw: Path, npy: Path, n: int) -> None:
    """Give the streamed int64 offsets a .npy header (self-describing: dtype and shape checked on
    load); the header needs the count, known only at the end."""
    with open(npy, "wb") as dst, open(raw, "rb") as src:
        descr = np.lib.format.dtype_to_descr(np.dtype(np.int64))
        np.lib.format.write_array_header_1_0(dst, {"descr": descr, "fortran_order": False, "shape": (n,)})
        shutil.copyfileobj(src, dst, 1 << 20)
        dst.flush()
        os.fsync(dst.fileno())
    raw.unlink()


def verify(path: str | Path) -> str:
    """Check a whole store (offsets, every chunk's checksum and ids); a line saying what was checked."""
    store = open_store(path)
    n_chunks = -(-store.n_tokens // store.chunk_tokens)
    for c in range(n_chunks):
        store.verify_chunk(c)
    return f"{store.path}: intact ({store.n_docs:,} documents, {store.n_tokens:,} tokens, {n_chunks:,} chunks verified)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m flashcp.data.prepare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("source", nargs="?", help="file, directory or glob of text data, or 'default'")
    parser.add_argument("--tokenizer", help="tokenizer.json, .model, or 'default'")
    parser.add_argument("--out", help="the store directory to create")
    parser.add_argument("--verify", metavar="DIR", help="check an existing store whole instead of preparing one")
    parser.add_argument("--max-doc-tokens", type=int, default=1 << 20, help="refuse longer documents")
    parser.add_argument("--workers", type=int, default=1, help="tokenising processes")
    parser.add_argument("--text-field", default="text", help="the text column of .jsonl/.json/.parquet")
    parser.add_argument("--txt-sample-by", default="document", choices=("document", "paragraph", "line"))
    args = parser.parse_args(argv)
    if args.verify:
        try:
            print(verify(args.verify))
        except StoreError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
    if not (args.source and args.tokenizer and args.out):
        parser.error("SOURCE, --tokenizer and --out are required (or --verify DIR)")
    import datasets

    from flashcp.data.errors import DataError
    from flashcp.data.tokenizer import TokenizerError

    datasets.disable_progress_bars()  # this command's bar counts documents; an error stays one line
    try:
        out = prepare(
            args.source, args.tokenizer, args.out, args.workers, args.text_field, args.txt_sample_by,
            max_doc_tokens=args.max_doc_tokens,
        )
    except (StoreError, DataError, TokenizerError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"error: interrupted; no store was written at {args.out}", file=sys.stderr)
        return 130
    manifest = json.loads((out / MANIFEST).read_text())
    print(f"{out}: {manifest['n_docs']:,} documents, {manifest['n_tokens']:,} tokens ({manifest['dtype']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
