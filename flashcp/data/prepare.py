"""Tokenise a corpus once into a memory-mapped token store (`flashcp.data.store`).

    python -m flashcp.data.prepare SOURCE --tokenizer T --out DIR [--workers K]
                                   [--text-field F] [--txt-sample-by document|paragraph|line]

SOURCE is what `[data] source` accepts for local text (a file, directory or glob of .jsonl / .json /
.parquet / .txt, optionally compressed, or `default`), T a tokenizer path or `default`. Texts are
read through HF `datasets` (Arrow, memory-mapped: corpora larger than memory stream through), in
chunks of documents that K worker processes tokenise in order, so the store is the same for any K.
Tokens and offsets are appended to files as chunks come back; nothing holds the corpus in memory.

Atomic: the store is built in `DIR.partial-<pid>` and renamed to DIR after its manifest is written
and everything is synced, so an interrupted prepare leaves no store that opens, and the next one
removes the leftover. An existing DIR is never overwritten.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from flashcp.data.store import file_fingerprint, FORMAT, MANIFEST, StoreError, VERSION

CHUNK_DOCS = 256  # documents per task handed to a worker

_tokenizer: Any = None  # the worker's tokenizer, loaded once per process


def _load_worker(path: str) -> None:
    global _tokenizer
    from flashcp.titan.tokenizer import load_tokenizer

    _tokenizer = load_tokenizer(path)


def _encode(texts: list[str | None]) -> list[list[int]]:
    return _tokenizer.encode_batch([t or "" for t in texts])


def _chunks(ds, n: int) -> Iterator[list[str | None]]:
    for start in range(0, n, CHUNK_DOCS):
        yield ds[start : start + CHUNK_DOCS]["text"]


def prepare(
    source: str,
    tokenizer: str,
    out: str | Path,
    workers: int = 1,
    text_field: str = "text",
    txt_sample_by: str = "document",
    progress: bool = True,
) -> Path:
    """Build the store at `out` (see the module docstring); returns its path."""
    from tqdm import tqdm

    from flashcp.titan.sources import data_files, DataConfig, DEFAULT_CORPUS, DEFAULT_TOKENIZER, load_files
    from flashcp.titan.tokenizer import tokenizer_file

    out = Path(out).absolute()
    if out.exists():
        raise StoreError(f"{out} already exists; a store is never overwritten (remove it or pick another --out)")
    if workers < 1:
        raise StoreError(f"--workers must be >= 1, got {workers}")
    tok_path = tokenizer_file(DEFAULT_TOKENIZER if tokenizer == "default" else tokenizer)
    _load_worker(str(tok_path))
    vocab = _tokenizer.vocab_size
    dtype = np.dtype(np.uint16 if vocab <= 1 << 16 else np.uint32)
    files = data_files(str(DEFAULT_CORPUS) if source == "default" else source)
    ds = load_files(files, DataConfig(text_field=text_field, txt_sample_by=txt_sample_by))

    for leftover in out.parent.glob(f"{out.name}.partial-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    partial = out.with_name(f"{out.name}.partial-{os.getpid()}")
    partial.mkdir(parents=True)
    try:
        n_docs, n_tokens = _write(ds, tok_path, partial, dtype, workers, tqdm(
            total=len(ds), unit="doc", desc=f"prepare {out.name}", disable=not progress))  # fmt: skip
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "n_docs": n_docs,
            "n_tokens": n_tokens,
            "dtype": dtype.name,
            "tokenizer": {"fingerprint": file_fingerprint(tok_path), "name": tok_path.name, "vocab_size": vocab,
                          "bos_id": _tokenizer.bos_id, "eos_id": _tokenizer.eos_id},  # fmt: skip
            "source": {
                "fingerprint": file_fingerprint_many(files),
                "files": [{"name": f.name, "size": f.stat().st_size} for f in files],
                "text_field": text_field,
                "txt_sample_by": txt_sample_by,
            },
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        with open(partial / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.rename(partial, out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return out


def file_fingerprint_many(files: list[Path]) -> str:
    """One fingerprint over the files' names and contents (order kept)."""
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.name.encode() + b"\0" + file_fingerprint(f).encode() + b"\0")
    return f"sha256:{digest.hexdigest()}"


def _write(ds, tok_path: Path, folder: Path, dtype: np.dtype, workers: int, bar) -> tuple[int, int]:
    """Tokenise `ds` chunk by chunk (in order) into tokens.bin / offsets.bin; (documents, tokens)."""
    n_docs = n_tokens = 0
    with open(folder / "tokens.bin", "wb") as tokens, open(folder / "offsets.bin", "wb") as offsets, bar:
        offsets.write(np.zeros(1, dtype=np.int64).tobytes())
        if workers == 1:
            encoded = map(_encode, _chunks(ds, len(ds)))
            pool = None
        else:
            pool = multiprocessing.get_context("spawn").Pool(workers, _load_worker, (str(tok_path),))
            encoded = pool.imap(_encode, _chunks(ds, len(ds)))
        try:
            for chunk in encoded:
                lens = np.array([len(ids) for ids in chunk if ids], dtype=np.int64)
                if lens.size:
                    tokens.write(np.concatenate([np.asarray(ids, dtype=dtype) for ids in chunk if ids]).tobytes())
                    offsets.write((n_tokens + np.cumsum(lens)).tobytes())
                    n_docs, n_tokens = n_docs + lens.size, n_tokens + int(lens.sum())
                bar.update(len(chunk))
                bar.set_postfix(tokens=f"{n_tokens:,}")
        finally:
            if pool is not None:
                pool.terminate()
        for f in (tokens, offsets):
            f.flush()
            os.fsync(f.fileno())
    if n_docs == 0:
        raise StoreError("the source holds no document with any tokens")
    return n_docs, n_tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="file, directory or glob of text data, or 'default'")
    parser.add_argument("--tokenizer", required=True, help="tokenizer.json / SentencePiece .model, or 'default'")
    parser.add_argument("--out", required=True, help="the store directory to create")
    parser.add_argument("--workers", type=int, default=1, help="tokenising processes")
    parser.add_argument("--text-field", default="text", help="column holding the text (.jsonl/.json/.parquet)")
    parser.add_argument("--txt-sample-by", default="document", choices=("document", "paragraph", "line"))
    args = parser.parse_args(argv)
    from flashcp.titan.sources import DataError
    from flashcp.titan.tokenizer import TokenizerError

    try:
        out = prepare(args.source, args.tokenizer, args.out, args.workers, args.text_field, args.txt_sample_by)
    except (StoreError, DataError, TokenizerError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted; no store was written", file=sys.stderr)
        return 130
    manifest = json.loads((out / MANIFEST).read_text())
    print(f"{out}: {manifest['n_docs']:,} documents, {manifest['n_tokens']:,} tokens ({manifest['dtype']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
