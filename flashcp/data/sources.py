"""Where the window loader's documents come from: files, the hub, synthetic lengths.

    source = build_source(cfg: DataConfig, tokenizer) -> DocSource
    for position, tokens in source.epoch(epoch, start): ...

A `DocSource` yields the token ids (BOS/EOS added) of the non-empty documents of one epoch in a
fixed order, restartable at any position, which is all `flashcp.data.loader`'s packer needs.

Sources (`DataConfig.source`):
  "default"    data/default/train.jsonl.gz, real English text shipped with FlashCP (data/README.md)
  PATH         a local file, a directory (searched recursively; files of other types, such as a
               README, are ignored) or a glob of .jsonl / .json / .parquet / .txt files, each
               optionally .gz / .bz2 / .xz, read through HF `datasets`; the text is in column
               `text_field`; a .txt file is one document (`txt_sample_by` = "paragraph" / "line")
  "hf:NAME"    the hub dataset NAME (`hf_config`, `hf_split`), streamed; needs network (a
               local dataset directory also works); resuming re-reads the epoch up to the cursor
  DIR          a token store prepared by `python -m flashcp.data.prepare` (memory-mapped; each
               rank reads only its own windows' tokens, `flashcp.data.store_source`)
  "synthetic"  random token ids, document lengths drawn from `synthetic_lengths` (a distribution
               of `flashcp.data.lengths`, e.g. "wlbllm", "pile", or a JSON list of lengths):
               benchmarking at scale without text; `max_doc_tokens` applies to text only

Several sources mixed by token weights (`[data.mix.NAME]`) are `flashcp.data.mixture`; the
settings themselves are `flashcp.data.settings.DataConfig`.

Bad data raises DataError (or TokenizerError), both ValueError, naming the problem: missing or
unsupported files, an empty dataset or one without any tokens, a missing or non-text column, a
document longer than `max_doc_tokens`, a tokenizer without the BOS/EOS asked for, a bad state.
"""

from __future__ import annotations

import functools
import glob
import itertools
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol
from urllib.parse import urlparse

import numpy as np

from flashcp.data.errors import DataError
from flashcp.data.settings import DataConfig
from flashcp.data.store import is_store, source_manifest
from flashcp.data.store_source import StoreSource
from flashcp.data.tokenizer import Tokenizer, tokenizer_file

DATA_DIR = Path(__file__).resolve().parents[2] / "data"
DEFAULT_CORPUS = DATA_DIR / "default" / "train.jsonl.gz"
DEFAULT_TOKENIZER = DATA_DIR / "default" / "tokenizer.json"

_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}
_COMPRESSIONS = (".gz", ".bz2", ".xz")
_SUPPORTED = "/".join(_BUILDERS) + " (optionally " + "/".join(_COMPRESSIONS) + ")"
_READ_CHUNK = 256  # rows fetched from a dataset at once
_TOKENIZE_CHUNK = 64  # documents tokenised in one batch call
_SYNTHETIC_BLOCK = 4096  # synthetic lengths are drawn in seeded blocks of this many documents
_HUB_SHUFFLE_BUFFER = 10_000


class DocSource(Protocol):
    """A sequence of token-id documents per epoch, restartable at any position."""

    name: str  # names the data in error messages
    ident: str  # identifies the data in state fingerprints (stable when files move)

    def epoch(self, epoch: int, start: int) -> Iterator[tuple[int, np.ndarray]]:
        """(position, tokens) of the non-empty documents of `epoch` from position `start` on."""
        ...


class TextSource:
    """Documents as text (from files or the hub), tokenised on the fly with BOS/EOS added.

    `texts(epoch, start)` yields (row, text) from position `start` of the epoch's order, `row`
    being where the document sits in the data (for error messages).
    """

    def __init__(
        self,
        name: str,
        ident: str,
        texts: Callable[[int, int], Iterator[tuple[int, str | None]]],
        tokenizer: Tokenizer,
        add_bos: bool,
        add_eos: bool,
        max_doc_tokens: int,
    ):
        self.name, self.ident = name, ident
        self._max_tokens = max_doc_tokens
        self._texts = texts
        self._tok = tokenizer
        self._vocab = tokenizer.vocab_size
        self._prefix = [tokenizer.bos_id] if add_bos else []
        self._suffix = [tokenizer.eos_id] if add_eos else []

    def epoch(self, epoch: int, start: int) -> Iterator[tuple[int, np.ndarray]]:
        position = start
        rows = iter(self._texts(epoch, start))
        while chunk := list(itertools.islice(rows, _TOKENIZE_CHUNK)):
            encoded = self._tok.encode_batch([text or "" for _, text in chunk])
            for (row, _), ids in zip(chunk, encoded):
                if len(ids) > self._max_tokens:
                    raise DataError(
                        f"{self.name}: document {row} has {len(ids)} tokens, more than "
                        f"data.max_doc_tokens={self._max_tokens} (a mangled or non-text file? raise "
                        "the limit if such documents are intended)"
                    )
                # A tokenizer whose ids have gaps gives ids past its size, which the embedding
                # (sized to the tokenizer) would meet as a bare IndexError on some rank.
                if ids and max(ids) >= self._vocab:
                    raise DataError(
                        f"{self.name}: document {row}: token id {max(ids)} is outside the tokenizer's vocabulary "
                        f"of {self._vocab} ids (a tokenizer whose ids have gaps?)"
                    )
                if ids:
                    yield position, np.array(self._prefix + ids + self._suffix, dtype=np.int64)
                position += 1


class SyntheticSource:
    """One endless epoch of random-token documents whose lengths follow a named distribution.

    Lengths are drawn in blocks seeded by (seed, block) and each document's tokens by
    (seed, position), so any position can be regenerated exactly on resume. `distribution` is a
    name of `flashcp.data.lengths.DISTRIBUTIONS` or the path of a JSON list of lengths.
    """

    endless = True  # its epoch never ends (a mixture's length filter cannot wait for an epoch's end)

    def __init__(self, distribution: str, tokenizer: Tokenizer, add_bos: bool, add_eos: bool, seed: int):
        from flashcp.data.lengths import length_sampler

        try:
            length_sampler(distribution)
        except ValueError as e:
            raise DataError(f"data.synthetic_lengths: {e}") from e
        self.name = f"synthetic documents with {distribution} lengths"
        self.ident = f"synthetic:{distribution}"
        self._sampler = functools.partial(length_sampler, distribution)
        self._vocab = tokenizer.vocab_size
        self._bos = tokenizer.bos_id if add_bos else None
        self._eos = tokenizer.eos_id if add_eos else None
        self._seed = seed

    def _lengths(self, block: int) -> np.ndarray:
        seed = int(np.random.SeedSequence((self._seed, block)).generate_state(1)[0])
        return self._sampler(seed=seed).sample(_SYNTHETIC_BLOCK)

    def epoch(self, epoch: int, start: int) -> Iterator[tuple[int, np.ndarray]]:
        lengths = self._lengths(start // _SYNTHETIC_BLOCK)
        for position in itertools.count(start):
            block, offset = divmod(position, _SYNTHETIC_BLOCK)
            if offset == 0 and position != start:
                lengths = self._lengths(block)
            tokens = np.random.default_rng((self._seed, position)).integers(
                0, self._vocab, int(lengths[offset]), dtype=np.int64
            )
            if self._bos is not None:
                tokens[0] = self._bos
            if self._eos is not None and len(tokens) > 1:
                tokens[-1] = self._eos
            yield position, tokens


def _builder(path: Path) -> str | None:
    name = path.name
    for compression in _COMPRESSIONS:
        name = name.removesuffix(compression)
    return _BUILDERS.get(Path(name).suffix)


def data_files(source: str) -> list[Path]:
    """The supported data files a path, directory or glob names, sorted; DataError if none."""
    if any(c in source for c in "*?["):
        found = sorted(Path(p) for p in glob.glob(source, recursive=True) if Path(p).is_file())
        if not found:
            raise DataError(f"data glob {source!r} matches no files")
    else:
        path = Path(source)
        if not path.exists():
            raise DataError(f"data path not found: {path}")
        if path.is_file():
            if _builder(path) is None:
                raise DataError(f"unsupported data file type: {path}; supported: {_SUPPORTED}")
            return [path]
        found = sorted(
            p for p in path.rglob("*") if p.is_file() and not p.relative_to(path).as_posix().startswith(".")
        )
    files = [p for p in found if _builder(p)]
    if not files:
        kinds = sorted({"".join(p.suffixes) or p.name for p in found}) or ["no files at all"]
        raise DataError(
            f"no supported data files in {source}: found {', '.join(kinds)}; supported: {_SUPPORTED}"
        )
    return files


def _describe(files: list[Path]) -> str:
    return str(files[0]) if len(files) == 1 else f"{len(files)} files under {files[0].parent}"


def load_files(files: list[Path], cfg: DataConfig, field_setting: str = "data.text_field"):
    """One `datasets.Dataset` with a single string column "text" over all `files`; a missing column
    names `field_setting`, the setting that picks it where the caller reads it from."""
    import datasets

    groups: dict[str, list[Path]] = {}
    for f in files:
        if f.stat().st_size:  # datasets fails obscurely on a 0-byte file; it holds no documents anyway
            groups.setdefault(_builder(f), []).append(f)
    if not groups:
        raise DataError(f"empty dataset: {_describe(files)} holds only empty files")
    parts = []
    for builder, group in groups.items():
        options = {"sample_by": cfg.txt_sample_by} if builder == "text" else {}
        column = "text" if builder == "text" else cfg.text_field
        try:
            ds = datasets.load_dataset(
                builder, data_files=[str(f) for f in group], split="train", cache_dir=cfg.cache_dir, **options
            )
        except StopIteration as e:  # what datasets raises for a compressed file with no records
            raise DataError(f"empty dataset: no records in {_describe(group)}") from e
        except Exception as e:  # datasets raises many types for unreadable files; name the files
            problem = _locate_problem(group, column, field_setting) or f"{_describe(group)}: {_innermost(e)}"
            raise DataError(f"cannot read {builder} data: {problem}") from e
        if column not in ds.column_names:
            raise DataError(
                f"{_describe(group)} has no column {column!r} (columns: {ds.column_names}); "
                f"set {field_setting}"
            )
        if getattr(ds.features[column], "dtype", None) not in ("string", "large_string"):
            row = _locate_problem(group, column, field_setting)
            raise DataError(f"column {column!r} of {_describe(group)} holds {ds.features[column]}, not text"
                            + (f" (first at {row})" if row else ""))  # fmt: skip
        ds = ds.select_columns([column])
        parts.append(ds.rename_column(column, "text") if column != "text" else ds)
    ds = datasets.concatenate_datasets(parts)
    if len(ds) == 0:
        raise DataError(f"empty dataset: no documents in {_describe(files)}")
    return ds


def _innermost(e: BaseException) -> str:
    """The root of an exception chain (datasets wraps the real error in DatasetGenerationError)."""
    while e.__cause__ is not None or e.__context__ is not None:
        e = e.__cause__ or e.__context__
    return f"{type(e).__name__}: {e}"


def _open_binary(path: Path):
    import bz2
    import gzip
    import lzma

    opener = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}.get(path.suffix, open)
    return opener(path, "rb")


def _locate_problem(files: list[Path], column: str, field_setting: str) -> str | None:
    """`file: line N: cause` for the first line that is not UTF-8 (or, for JSON lines, not a JSON
    object with a text or null `column`).

    Run only after datasets failed, to say where: its own errors (a bare KeyError for a row
    without the column, a CastError for a file without it) name neither file nor line.
    """
    import json

    for path in files:
        with _open_binary(path) as f:
            for lineno, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    return f"{path}: line {lineno}: not UTF-8 text (byte {e.start} of the line: {e.reason})"
                if ".jsonl" in path.suffixes and line.strip():
                    try:
                        row = json.loads(line)
                    except ValueError as e:
                        return f"{path}: line {lineno}: not a JSON object ({e})"
                    if not isinstance(row, dict):
                        return f"{path}: line {lineno}: not a JSON object (a {type(row).__name__})"
                    if column not in row:
                        return f"{path}: line {lineno}: no field {column!r} (fields: {list(row)[:10]}); set {field_setting}"
                    if not isinstance(row[column], str | None):
                        return f"{path}: line {lineno}: field {column!r} is not text: {json.dumps(row[column])[:40]}"
    return None


def _dataset_texts(ds, shuffle: bool, seed: int) -> Callable[[int, int], Iterator[tuple[int, str | None]]]:
    n = len(ds)

    def texts(epoch: int, start: int) -> Iterator[tuple[int, str | None]]:
        order = np.random.default_rng((seed, epoch)).permutation(n) if shuffle else np.arange(n)
        for a in range(start, n, _READ_CHUNK):
            rows = order[a : a + _READ_CHUNK].tolist()
            yield from zip(rows, ds[rows]["text"])

    return texts


def _check_hub_reachable(name: str) -> None:
    """Fail fast and clearly when the hub cannot be reached, instead of retrying for minutes."""
    import huggingface_hub.constants as hub

    if hub.HF_HUB_OFFLINE:
        raise DataError(f"hub dataset {name!r} requested but HF_HUB_OFFLINE is set; use a local data path")
    url = urlparse(hub.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=5).close()
    except OSError as e:
        raise DataError(
            f"hub dataset {name!r} requested but {url.hostname} cannot be reached ({e}): this machine "
            "looks offline; use a local data path"
        ) from e


def _hub_texts(name: str, cfg: DataConfig) -> Callable[[int, int], Iterator[tuple[int, str | None]]]:
    """Stream a hub dataset (or a local dataset directory, through the same code, offline)."""
    if not Path(name).exists():
        _check_hub_reachable(name)
    import datasets

    try:
        ds = datasets.load_dataset(
            name, cfg.hf_config, split=cfg.hf_split, streaming=True, cache_dir=cfg.cache_dir
        )
    except Exception as e:  # network and hub errors come in many types; name the dataset
        raise DataError(f"cannot open hub dataset {name!r}: {type(e).__name__}: {e}") from e

    def texts(epoch: int, start: int) -> Iterator[tuple[int, str | None]]:
        stream = ds.shuffle(seed=cfg.seed, buffer_size=_HUB_SHUFFLE_BUFFER) if cfg.shuffle else ds
        stream.set_epoch(epoch)
        # Resuming re-reads the epoch up to `start`: `IterableDataset.skip` after `shuffle`
        # reshuffles the shards, so it would not continue the same order.
        for position, row in enumerate(itertools.islice(stream, start, None), start):
            if cfg.text_field not in row:
                raise DataError(
                    f"hub dataset {name!r} has no column {cfg.text_field!r} (columns: {list(row)})"
                )
            yield position, row[cfg.text_field]

    return texts


def build_source(cfg: DataConfig, tokenizer: Tokenizer) -> DocSource:
    """The document source `cfg.source` names (see the module docstring)."""
    wanted = {"BOS": (cfg.add_bos, tokenizer.bos_id), "EOS": (cfg.add_eos, tokenizer.eos_id)}
    for what, (flag, token_id) in wanted.items():
        if flag and token_id is None:
            raise DataError(f"the tokenizer defines no {what} token; set data.add_{what.lower()}=false")
    if cfg.source == "synthetic":
        return SyntheticSource(cfg.synthetic_lengths, tokenizer, cfg.add_bos, cfg.add_eos, cfg.seed)
    if is_store(cfg.source):
        bos, eos = tokenizer.bos_id if cfg.add_bos else None, tokenizer.eos_id if cfg.add_eos else None
        tok_path = tokenizer_file(DEFAULT_TOKENIZER if cfg.tokenizer == "default" else cfg.tokenizer)
        return StoreSource(cfg.source, tok_path, bos, eos, cfg.shuffle, cfg.seed)
    if cfg.source.startswith("hf:"):
        hub_name = cfg.source[3:]
        texts = _hub_texts(hub_name, cfg)
        name, ident = f"hub dataset {hub_name!r}", f"hub:{hub_name}:{cfg.hf_config}:{cfg.hf_split}"
    else:
        files = data_files(str(DEFAULT_CORPUS) if cfg.source == "default" else cfg.source)
        ds = load_files(files, cfg)
        texts = _dataset_texts(ds, cfg.shuffle, cfg.seed)
        # By content (size and sha256 of each file, named relative to their folder): a file replaced
        # by other text of the same name and row count is noticed; a moved dataset still resumes.
        name, ident = _describe(files), f"files:{source_manifest(files)['fingerprint']}:{len(ds)}"
    return TextSource(name, ident, texts, tokenizer, cfg.add_bos, cfg.add_eos, cfg.max_doc_tokens)
