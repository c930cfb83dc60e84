"""Training windows for FlashCP: documents -> packed token windows -> one sharding plan per window.

    loader = build_loader(cfg: DataConfig, seq_len, dp_rank=0, dp_world=1, cp_size=1,
                          planner_kwargs={"strategy": "flashcp", "target_imbalance": 1.05},
                          tokenizer=None) -> WindowLoader
    batch = next(loader)
    loader.state_dict() / loader.load_state_dict(state)      # saved in checkpoints

One batch is ONE window (local batch size 1); more windows per optimizer step come from gradient
accumulation, i.e. calling `next()` several times. A batch is a dict:
  input     LongTensor [C]  token ids of the window, C = seq_len
  labels    LongTensor [C]  labels[i] = the token that follows input[i] in the same document,
                            -100 where that document ends at i: labels never cross a boundary
  doc_lens  list[int]       lengths of the document pieces in window order, summing to C
  plan      flashcp.Plan    plan_shards(doc_lens, cp_size, **planner_kwargs)
  window    int             index of this window in the job's global window sequence
  load_ms   float           time to read, tokenise and pack this step's windows
  plan_ms   float           time to plan this window
  wait_ms   float           time `next()` blocked the caller (near 0 when prefetching keeps up)
Reading, tokenising, packing and planning run in a background thread `prefetch` batches ahead
(`prefetch=0`: in the caller), so they stay off the training step's critical path.

Sources (`DataConfig.source`):
  "default"    data/default/train.jsonl.gz, real English text shipped with FlashCP (data/README.md)
  PATH         a local file, a directory (searched recursively; files of other types, such as a
               README, are ignored) or a glob of .jsonl / .json / .parquet / .txt files, each
               optionally .gz / .bz2 / .xz, read through HF `datasets`; the text is in column
               `text_field`; a .txt file is one document (`txt_sample_by` = "paragraph" / "line")
  "hf:NAME"    the hub dataset NAME (`hf_config`, `hf_split`), streamed; needs network (a
               local dataset directory also works); resuming re-reads the epoch up to the cursor
  "synthetic"  random token ids, document lengths drawn from `synthetic_lengths` (a distribution
               of `flashcp.data.lengths`, e.g. "wlbllm", "pile", or a JSON list of lengths):
               benchmarking at scale without text; `max_doc_tokens` applies to text only

Packing: documents are shuffled per epoch (seeded by `seed`) and laid back to back into windows of
exactly `seq_len` tokens, with no padding. The document that does not fit into the rest of a window
is cut at the window's end; with `overflow="carry"` its remaining tokens open the next window as a
new piece (positions restart at 0 there; earlier tokens of the document are not visible), with
`overflow="truncate"` they are dropped. Documents with no tokens are skipped. Epochs repeat
forever unless `loop=False`, which ends iteration at the end of the data, dropping the last
incomplete step so every data-parallel rank stops after the same number of batches.

BOS/EOS: every document gets the tokenizer's BOS in front (`add_bos`) and EOS at its end
(`add_eos`) before packing, so a carried piece has no BOS of its own and a truncated document
loses its EOS. The token before EOS is trained to predict EOS; EOS itself is labelled -100.
Synthetic documents have exactly their drawn length: BOS and EOS replace their first and last
random token. Special-token strings inside the text are encoded as plain text.

Ranks: every rank walks the same global window sequence. Each `next()` consumes one round of
`dp_world` windows, of which data-parallel rank r takes window `round_start + r`; the ranks of one
CP group share a dp_rank and so get the same window and plan. (Every rank tokenises all windows
of the round, dp_world windows per step, which keeps the state independent of the layout.)

Resuming: `state_dict()` (the same on every rank) holds the global window counter, the cursor
(epoch, document, token offset) and a fingerprint of the packing settings, as of the last batch
handed out (prefetched batches are not counted). Loading it continues with the next unseen
window, also under a different dp_world / dp_rank / cp_size; a state whose packing differs
(source, tokenizer, seq_len, overflow, BOS/EOS, seed, shuffle) raises DataError naming what differs.

Bad data raises DataError (or TokenizerError), both ValueError, naming the problem: missing or
unsupported files, an empty dataset or one without any tokens, a missing or non-text column, a
document longer than `max_doc_tokens`, a tokenizer without the BOS/EOS asked for, a bad state.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import itertools
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol
from urllib.parse import urlparse

import numpy as np
import torch

from flashcp import plan_shards
from flashcp.titan.tokenizer import Tokenizer, load_tokenizer

DATA_DIR = Path(__file__).resolve().parents[2] / "data"
DEFAULT_CORPUS = DATA_DIR / "default" / "train.jsonl.gz"
DEFAULT_TOKENIZER = DATA_DIR / "default" / "tokenizer.json"
IGNORE_INDEX = -100
STATE_FORMAT = 1

_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}
_COMPRESSIONS = (".gz", ".bz2", ".xz")
_SUPPORTED = "/".join(_BUILDERS) + " (optionally " + "/".join(_COMPRESSIONS) + ")"
_READ_CHUNK = 256  # rows fetched from a dataset at once
_TOKENIZE_CHUNK = 64  # documents tokenised in one batch call
_SYNTHETIC_BLOCK = 4096  # synthetic lengths are drawn in seeded blocks of this many documents
_HUB_SHUFFLE_BUFFER = 10_000


class DataError(ValueError):
    """The data (files, contents, loader state) cannot give training windows; says why."""


@dataclass
class DataConfig:
    """Where documents come from and how they are packed; see the module docstring."""

    source: str = "default"
    tokenizer: str = "default"  # tokenizer.json, SentencePiece .model, or a directory holding one
    text_field: str = "text"  # column with the text in .jsonl/.json/.parquet and hub datasets
    txt_sample_by: str = "document"  # .txt files: "document" (whole file), "paragraph" or "line"
    hf_config: str | None = None
    hf_split: str = "train"
    overflow: str = "carry"  # "carry" or "truncate": what happens to a document cut by a window end
    add_bos: bool = True
    add_eos: bool = True
    max_doc_tokens: int = 1 << 20  # a longer text document is an error (a mangled or non-text file)
    shuffle: bool = True
    seed: int = 0
    loop: bool = True
    prefetch: int = 2
    synthetic_lengths: str = "wlbllm"  # a flashcp.data.lengths name or a JSON list of lengths
    cache_dir: str | None = None  # HF datasets cache (default: HF's own)

    def __post_init__(self) -> None:
        choices = {"overflow": ("carry", "truncate"), "txt_sample_by": ("document", "paragraph", "line")}
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                raise DataError(f"data.{key} must be one of {allowed}, got {getattr(self, key)!r}")
        if self.max_doc_tokens < 1 or self.prefetch < 0:
            raise DataError(
                f"data.max_doc_tokens must be >= 1 and data.prefetch >= 0, got "
                f"{self.max_doc_tokens} and {self.prefetch}"
            )


# ----------------------------------------------------------------------------- document sources


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
                if ids:
                    yield position, np.array(self._prefix + ids + self._suffix, dtype=np.int64)
                position += 1


class SyntheticSource:
    """One endless epoch of random-token documents whose lengths follow a named distribution.

    Lengths are drawn in blocks seeded by (seed, block) and each document's tokens by
    (seed, position), so any position can be regenerated exactly on resume. `distribution` is a
    name of `flashcp.data.lengths.DISTRIBUTIONS` or the path of a JSON list of lengths.
    """

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


def load_files(files: list[Path], cfg: DataConfig):
    """One `datasets.Dataset` with a single string column "text" over all `files`."""
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
            problem = f"{type(e).__name__}: {e}"
            raise DataError(f"cannot read {builder} data in {_describe(group)}: {problem}") from e
        if column not in ds.column_names:
            raise DataError(
                f"{_describe(group)} has no column {column!r} (columns: {ds.column_names}); "
                "set data.text_field"
            )
        if getattr(ds.features[column], "dtype", None) not in ("string", "large_string"):
            raise DataError(f"column {column!r} of {_describe(group)} holds {ds.features[column]}, not text")
        ds = ds.select_columns([column])
        parts.append(ds.rename_column(column, "text") if column != "text" else ds)
    ds = datasets.concatenate_datasets(parts)
    if len(ds) == 0:
        raise DataError(f"empty dataset: no documents in {_describe(files)}")
    return ds


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
    if cfg.source.startswith("hf:"):
        hub_name = cfg.source[3:]
        texts = _hub_texts(hub_name, cfg)
        name, ident = f"hub dataset {hub_name!r}", f"hub:{hub_name}:{cfg.hf_config}:{cfg.hf_split}"
    else:
        files = data_files(str(DEFAULT_CORPUS) if cfg.source == "default" else cfg.source)
        ds = load_files(files, cfg)
        texts = _dataset_texts(ds, cfg.shuffle, cfg.seed)
        # Names and row count, not absolute paths: a moved dataset still resumes.
        digest = hashlib.sha1("\n".join(f.name for f in files).encode()).hexdigest()[:12]
        name, ident = _describe(files), f"files:{len(files)}:{digest}:{len(ds)}"
    return TextSource(name, ident, texts, tokenizer, cfg.add_bos, cfg.add_eos, cfg.max_doc_tokens)


# ----------------------------------------------------------------------------- packing


class Window(NamedTuple):
    doc_lens: list[int]
    input: np.ndarray | None  # None for windows packed only to advance the cursor
    labels: np.ndarray | None


class WindowPacker:
    """Cuts a document source into windows of `seq_len` tokens; its cursor is (epoch, doc, offset).

    `doc` is the position (in the epoch's order) of the document being packed and `offset` how
    many of its tokens earlier windows already took (always 0 with overflow="truncate").
    """

    def __init__(self, source: DocSource, seq_len: int, overflow: str = "carry", loop: bool = True):
        if seq_len < 1:
            raise DataError(f"seq_len must be >= 1, got {seq_len}")
        if overflow not in ("carry", "truncate"):
            raise DataError(f"overflow must be 'carry' or 'truncate', got {overflow!r}")
        self.source, self.seq_len, self.overflow, self.loop = source, seq_len, overflow, loop
        self.restore(0, 0, 0)

    def cursor(self) -> dict[str, int]:
        return {"epoch": self.epoch, "doc": self.doc, "offset": self.offset}

    def restore(self, epoch: int, doc: int, offset: int) -> None:
        self.epoch, self.doc, self.offset = epoch, doc, offset
        self._docs: Iterator[tuple[int, np.ndarray]] | None = None
        self._current: np.ndarray | None = None
        self._epoch_empty = doc == 0  # no document seen yet in an epoch read from its start

    def _document(self) -> np.ndarray | None:
        """Tokens of the document under the cursor, opening new epochs as needed; None at the end."""
        while self._current is None:
            if self._docs is None:
                self._docs = self.source.epoch(self.epoch, self.doc)
            item = next(self._docs, None)
            if item is None:
                if self._epoch_empty:
                    raise DataError(f"{self.source.name}: the data holds no document with any tokens")
                if not self.loop:
                    return None
                self.restore(self.epoch + 1, 0, 0)
                continue
            position, tokens = item
            if self.offset and position != self.doc:
                raise DataError(
                    f"{self.source.name}: the resume cursor points into document {self.doc}, which is gone"
                )
            self.doc, self._current, self._epoch_empty = position, tokens, False
        return self._current

    def next_window(self, materialize: bool = True) -> Window | None:
        """The next window, or None when the data ended (loop=False) before it was full."""
        doc_lens: list[int] = []
        inputs: list[np.ndarray] = []
        labels: list[np.ndarray] = []
        space = self.seq_len
        while space:
            tokens = self._document()
            if tokens is None:
                return None
            start, n = self.offset, len(tokens)
            take = min(n - start, space)
            doc_lens.append(take)
            if materialize:
                inputs.append(tokens[start : start + take])
                # The next token of the same document; -100 after its last token.
                following = tokens[start + 1 : start + take + 1]
                piece = np.full(take, IGNORE_INDEX, dtype=np.int64)
                piece[: len(following)] = following
                labels.append(piece)
            space -= take
            if start + take == n or self.overflow == "truncate":
                self.doc, self.offset, self._current = self.doc + 1, 0, None
            else:
                self.offset = start + take
        if not materialize:
            return Window(doc_lens, None, None)
        return Window(doc_lens, np.concatenate(inputs), np.concatenate(labels))


# ----------------------------------------------------------------------------- loader


class WindowLoader:
    """Iterator of batches for one rank (see the module docstring); stateful for checkpoints."""

    def __init__(
        self,
        packer: WindowPacker,
        planner: Callable[[list[int]], Any],
        fingerprint: Mapping[str, Any],
        dp_rank: int = 0,
        dp_world: int = 1,
        prefetch: int = 0,
    ):
        if not 0 <= dp_rank < dp_world:
            raise DataError(f"dp_rank must be in [0, dp_world={dp_world}), got {dp_rank}")
        self._packer, self._planner = packer, planner
        self._fingerprint = dict(fingerprint)
        self.dp_rank, self.dp_world, self.prefetch = dp_rank, dp_world, prefetch
        self._window = 0  # global index of the next round's first window (producer side)
        self._state = self._snapshot()  # state after the last batch handed out (consumer side)
        self._thread: threading.Thread | None = None
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()
        self._done = False

    def _snapshot(self) -> dict[str, Any]:
        cursor = self._packer.cursor()
        return {"format": STATE_FORMAT, "window": self._window, **cursor, "packing": dict(self._fingerprint)}

    def _produce(self) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """Pack this step's round of dp_world windows, keep ours, plan it."""
        t0 = time.perf_counter()
        mine = None
        for k in range(self.dp_world):
            window = self._packer.next_window(materialize=k == self.dp_rank)
            if window is None:
                return None
            mine = window if k == self.dp_rank else mine
        index = self._window + self.dp_rank
        self._window += self.dp_world
        t1 = time.perf_counter()
        plan = self._planner(mine.doc_lens)
        t2 = time.perf_counter()
        batch = {
            "input": torch.from_numpy(mine.input),
            "labels": torch.from_numpy(mine.labels),
            "doc_lens": mine.doc_lens,
            "plan": plan,
            "window": index,
            "load_ms": (t1 - t0) * 1e3,
            "plan_ms": (t2 - t1) * 1e3,
        }
        return batch, self._snapshot()

    def _run(self) -> None:
        """Producer thread: fill the queue until stopped, the data ends or an error occurs."""
        while not self._stop.is_set():
            try:
                item = self._produce()
            except BaseException as e:  # handed to the consumer, which re-raises it
                item = e
            self._queue.put(item)
            if item is None or isinstance(item, BaseException):
                return

    def _stop_producer(self) -> None:
        """Stop the producer and rewind the packer to the last batch handed out."""
        if self._thread is None:
            return
        self._stop.set()
        while self._thread.is_alive():
            try:  # make room for a pending put so the thread can see the stop flag
                self._queue.get(timeout=0.05)
            except queue.Empty:
                pass
        self._thread = None
        self._restore(self._state)

    def __iter__(self) -> WindowLoader:
        return self

    def __next__(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        if self._done:
            raise StopIteration
        if self.prefetch == 0:
            item = self._produce()
        else:
            if self._thread is None:
                self._stop.clear()
                self._queue = queue.Queue(maxsize=self.prefetch)
                self._thread = threading.Thread(target=self._run, name="flashcp-data", daemon=True)
                self._thread.start()
            item = self._queue.get()
            if isinstance(item, BaseException):
                self._thread = None
                self._restore(self._state)  # a retry reproduces the same error
                raise item
        if item is None:
            self._done = True
            raise StopIteration
        batch, self._state = item
        batch["wait_ms"] = (time.perf_counter() - t0) * 1e3
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {**self._state, "packing": dict(self._state["packing"])}

    def _restore(self, state: Mapping[str, Any]) -> None:
        self._packer.restore(state["epoch"], state["doc"], state["offset"])
        self._window = state["window"]
        self._state = self._snapshot()
        self._done = False

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue after the batches `state` counts; the DP/CP layout may differ from the saver's."""
        keys = {"format", "window", "epoch", "doc", "offset", "packing"}
        if not isinstance(state, Mapping) or not keys <= set(state):
            raise DataError(f"not a data loader state: expected keys {sorted(keys)}")
        if state["format"] != STATE_FORMAT:
            raise DataError(f"data loader state format {state['format']} is not {STATE_FORMAT}")
        saved, now = state["packing"], self._fingerprint
        changed = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
        diff = [f"{k}: saved {saved.get(k)!r}, now {now.get(k)!r}" for k in changed]
        if diff:
            raise DataError("cannot resume the data loader, its packing changed (" + "; ".join(diff) + ")")
        self._stop_producer()
        self._restore(state)

    def close(self) -> None:
        """Stop the prefetch thread; iteration may continue afterwards from the same point."""
        self._stop_producer()

    def __enter__(self) -> WindowLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def build_loader(
    cfg: DataConfig,
    seq_len: int,
    dp_rank: int = 0,
    dp_world: int = 1,
    cp_size: int = 1,
    planner_kwargs: Mapping[str, Any] | None = None,
    tokenizer: Tokenizer | None = None,
) -> WindowLoader:
    """The loader for one rank. `tokenizer` defaults to loading `cfg.tokenizer`."""
    if seq_len < 1 or cp_size < 1 or seq_len % cp_size:
        raise DataError(f"seq_len ({seq_len}) must be a positive multiple of cp_size ({cp_size})")
    if tokenizer is None:
        tokenizer = load_tokenizer(DEFAULT_TOKENIZER if cfg.tokenizer == "default" else cfg.tokenizer)
    planner = functools.partial(plan_shards, cp_size=cp_size, **dict(planner_kwargs or {}))
    planner([seq_len])  # a bad strategy or option fails here, at start-up, not in the producer
    source = build_source(cfg, tokenizer)
    fingerprint = {
        "source": source.ident,
        # Strings and numbers only, so the state survives any checkpoint format unchanged.
        "tokenizer": f"{type(tokenizer).__name__} vocab={tokenizer.vocab_size} "
        f"bos={tokenizer.bos_id} eos={tokenizer.eos_id}",
        "seq_len": seq_len,
        "overflow": cfg.overflow,
        "add_bos": cfg.add_bos,
        "add_eos": cfg.add_eos,
        "seed": cfg.seed,
        "shuffle": cfg.shuffle,
    }
    packer = WindowPacker(source, seq_len, cfg.overflow, cfg.loop)
    return WindowLoader(packer, planner, fingerprint, dp_rank, dp_world, cfg.prefetch)
