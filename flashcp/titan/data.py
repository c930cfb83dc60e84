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
  dispatch  flashcp.Dispatch  this rank's dispatch of the plan, when `dispatch_with` was called
  window    int             index of this window in the job's global window sequence
  load_ms   float           time to read, tokenise and pack this step's windows
  plan_ms   float           time to plan this window and build its dispatch
  wait_ms   float           time `next()` blocked the caller (near 0 when prefetching keeps up)
Reading, tokenising, packing, planning and the rank's dispatch (index building, pinning) run in a
background thread `prefetch` batches ahead (`prefetch=0`: in the caller), so they stay off the
training step's critical path: the trainer's main thread only copies the dispatch to the device.

Sources (`DataConfig.source`: the shipped corpus, local files, a hub dataset, synthetic
lengths) are `flashcp.titan.sources`.

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
CP group share a dp_rank and so get the same window and plan. Every rank walks all windows of the
round, which keeps the state independent of the layout: from a token store it passes over the other
ranks' windows with the document offsets alone (`WindowPacker.skip_windows`), so its work does not
grow with dp_world; text sources tokenise every window of the round.

Resuming: `state_dict()` (the same on every rank) holds the global window counter, the cursor
(epoch, document, token offset) and a fingerprint of the packing settings, as of the last batch
handed out (prefetched batches are not counted). Loading it continues with the next unseen
window, also under a different dp_world / dp_rank / cp_size; a state whose packing differs
(source, tokenizer, seq_len, overflow, BOS/EOS, seed, shuffle) raises DataError naming what differs.
Bad data raises DataError (see `flashcp.titan.sources`).
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import numpy as np
import torch

from flashcp import plan_shards
from flashcp.titan.sources import DEFAULT_TOKENIZER, DataConfig, DataError, DocSource, build_source
from flashcp.titan.tokenizer import Tokenizer, load_tokenizer

IGNORE_INDEX = -100
STATE_FORMAT = 1


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


    def skip_windows(self, count: int) -> bool:
        """Advance `count` windows without reading or packing them, from document offsets alone.

        For sources that know their lengths (a token store) with looping epochs and carried
        overflow: O(log n) per epoch crossed, whatever `count`. False (nothing done) otherwise.
        The cursor ends where packing the windows one by one would leave it.
        """
        if not (self.overflow == "carry" and self.loop and hasattr(self.source, "epoch_starts")):
            return False
        space = count * self.seq_len
        while space:
            starts = self.source.epoch_starts(self.epoch)  # each document's token offset, then the total
            if self.doc == len(starts) - 1:  # past the epoch's last document
                self.restore(self.epoch + 1, 0, 0)
                continue
            pos = int(starts[self.doc]) + self.offset
            end = min(pos + space, int(starts[-1]))
            last = int(np.searchsorted(starts, end, side="right")) - 1  # the document holding token `end`
            self.restore(self.epoch, last, end - int(starts[last]))
            space -= end - pos
        self._epoch_empty = False
        return True


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
        self._dispatcher: Callable[[Any], Any] | None = None
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
        if not self._advance(self.dp_rank):
            return None
        mine = self._packer.next_window()
        if mine is None or not self._advance(self.dp_world - self.dp_rank - 1):
            return None
        index = self._window + self.dp_rank
        self._window += self.dp_world
        t1 = time.perf_counter()
        plan = self._planner(mine.doc_lens)
        dispatch = self._dispatcher(plan) if self._dispatcher is not None else None
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
        if dispatch is not None:
            batch["dispatch"] = dispatch
        return batch, self._snapshot()

    def _advance(self, count: int) -> bool:
        """Pass over other ranks' windows (from offsets alone when the source allows); False at the end."""
        if self._packer.skip_windows(count):
            return True
        return all(self._packer.next_window(materialize=False) is not None for _ in range(count))

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

    def dispatch_with(self, dispatcher: Callable[[Any], Any]) -> None:
        """Build each window's dispatch with `dispatcher(plan)` in the producer (before iterating)."""
        self._stop_producer()
        self._dispatcher = dispatcher

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
