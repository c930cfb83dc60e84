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
  source_tokens  dict[str, int]  a mixture only: tokens of each source trained so far (in all
                            ranks' windows up to this batch's round or balanced step; with
                            overflow="truncate" a cut document counts whole)
  new_source_tokens  dict[str, int]  of those, what this batch's `next()` added: the round's
                            dp_world windows, or a whole balanced step on its last batch (0 on the others)
  valid_labels  list[int]   mesh scope only: each DP group's labels other than -100 in its seq_len of
                            the window (what TorchTitan normalises the loss by), from the lengths alone
Reading, tokenising, packing, planning and the rank's dispatch (index building, pinning) run in a
background thread `prefetch` batches ahead (`prefetch=0`: in the caller), so they stay off the
training step's critical path: the trainer's main thread only copies the dispatch to the device.

Sources (`DataConfig.source`: the shipped corpus, local files, a hub dataset, synthetic
lengths) are `flashcp.data.sources`; several of them mixed by token weights (`DataConfig.mix`)
are `flashcp.data.mixture`, one stream for everything below.

Packing (`flashcp.data.packing`): documents are shuffled per epoch (seeded by `seed`) and laid
back to back into windows of exactly `seq_len` tokens, with no padding; a document cut at a
window's end carries its rest into the next window (`overflow="carry"`) or drops it ("truncate").
Epochs repeat forever unless `loop=False`, which ends iteration at the end of the data, dropping
the last incomplete step so every data-parallel rank stops after the same number of batches.

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

Mesh scope (`mesh_with(dp, planner)`, the trainer's `[flashcp] scope = "mesh"`): one window of
dp x seq_len tokens per `next()`, the stream's next dp windows as one (documents cut only at its end),
the same on every rank and planned over the whole DP x CP mesh. Its state counts windows of seq_len
and holds the same cursor, so either scope resumes the other's state with the next unseen tokens.
With a dispatcher, `input` and `labels` hold only this rank's tokens and their labels in dispatch
order (`dispatch.token_index`): the window is laid out from lengths (`WindowPacker.next_step`, from a
token store by the document offsets alone), planned, and only this rank's runs of tokens, and the
token after each (its label), are read (`StepPieces.take`); text sources tokenise the whole window.

Balance (`balance_with`, called by the trainer for `[data] balance = "mesh"` / "mesh-cut": it
needs the model's cost per token and per attended pair): the producer takes a whole optimizer
step at once, the pieces of the `dp_world x micro` windows stream packing would give it
(`WindowPacker.next_step`: from a token store, vectorised over the document offsets; lengths
only), and packs the same documents again over them (`flashcp.data.packing.balanced_step`).
That work grows with dp_world (~35 ms per step at DP = 64, C = 128K on one core), unlike
reading; this rank's `micro` windows are handed out one per `next()`. Every rank computes the
same assignment, and the cursor after a step is the one stream packing leaves, so a run may
resume with balancing on or off.

Resuming: `state_dict()` (the same on every rank) holds the global window counter, the cursor
(epoch, document, token offset), a mixture's mixer (each source's cursor and tokens taken) and a
fingerprint of the packing settings, as of the last batch handed out (prefetched batches are
not counted; inside a balanced step, the step's start and `in_step`, the batches of it already
handed out). Loading it continues with the next unseen
window, also under a different dp_world / dp_rank / cp_size; a state whose packing differs
(source, tokenizer, seq_len, overflow, BOS/EOS, seed, shuffle) raises DataError naming what differs.
Bad data raises DataError (see `flashcp.data.sources`). A token store whose bytes changed (or were
cut short) under the job raises DataChanged at the batch that would have held them; `fault` holds
it from the moment the producer found it, which may be batches earlier (the trainer then publishes
no checkpoint). No batch ever holds a changed token: each is read as a copy and checked
(`flashcp.data.store`).
"""

from __future__ import annotations

import collections
import functools
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from flashcp import plan_shards
from flashcp.data.balance import WindowCost
from flashcp.data.deferral import Deferral, MIN_KEPT
from flashcp.data.packing import balanced_step, deferred_step, IGNORE_INDEX, StepPieces, Window, WindowPacker
from flashcp.data.errors import DataChanged, DataError
from flashcp.data.mixture import build_data, MixedSource
from flashcp.data.plan_worker import PlanWorker, TIMEOUT_S as WORKER_TIMEOUT_S
from flashcp.data.sources import DEFAULT_TOKENIZER, DataConfig
from flashcp.data.store import file_fingerprint
from flashcp.data.tokenizer import Tokenizer, load_tokenizer

__all__ = ["IGNORE_INDEX", "WindowLoader", "WindowPacker", "build_loader"]

STATE_FORMAT = 1


# ----------------------------------------------------------------------------- loader


@dataclass(frozen=True)
class StepBalance:
    """How a step's windows are balanced over the mesh (`WindowLoader.balance_with`)."""

    micro: int  # windows per DP rank and optimizer step (gradient accumulation steps)
    cost: WindowCost  # a window's predicted cost on its CP group
    cut_target: float | None  # None: the stream's pieces are kept; else documents cut to this max / mean
    deferral: Deferral | None = None  # long documents may wait for later steps (bounded)


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
        self._finish: Callable[[Any], Any] | None = None  # applied to each dispatch in the producer's thread
        self._use_worker, self._worker_timeout_s = False, WORKER_TIMEOUT_S
        self._worker: PlanWorker | None = None  # started on first use, stopped by close()
        self._balance: StepBalance | None = None
        self._fingerprint = dict(fingerprint)
        self.dp_rank, self.dp_world, self.prefetch = dp_rank, dp_world, prefetch
        self._span, self._mesh = 1, False  # windows of seq_len one batch holds (`mesh_with`: DP), mesh scope
        self._window = 0  # global index of the next round's first window (producer side)
        self._skip = 0  # batches of the next balanced step already handed out before a restore
        self._ready: collections.deque = collections.deque()  # produced, not handed out (prefetch=0)
        self._state = self._snapshot()  # state after the last batch handed out (consumer side)
        self._thread: threading.Thread | None = None
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()
        self._done = False
        # Data found changed under the job (a token store's checksums), as soon as the producer found
        # it, although the batches before it are still handed out: no checkpoint may be published then.
        self.fault: DataChanged | None = None

    @property
    def source_name(self) -> str:
        """What the windows are cut from, in words (the data source's name)."""
        return self._packer.source.name
    def _snapshot(self, in_step: int = 0) -> dict[str, Any]:
        cursor = self._packer.cursor()
        state = {"format": STATE_FORMAT, "window": self._window, **cursor, "packing": dict(self._fingerprint)}
        deferral = self._balance.deferral if self._balance is not None else None
        if deferral is not None:
            state["deferral"] = deferral.state()
        if isinstance(self._packer.source, MixedSource):
            pending = [(p.position, p.length) for p in deferral.pending] if deferral is not None else []
            state["mix"] = self._packer.source.state(cursor["doc"], cursor["offset"], pending)
        return {**state, "in_step": in_step} if in_step else state

    def _produce(self) -> list[tuple[dict[str, Any], dict[str, Any]]] | None:
        """The next batches with the state after each: one window of a round, or this rank's
        windows of a balanced step; None when the data ended."""
        t0 = time.perf_counter()
        if self._balance is not None:
            return self._produce_step(t0)
        if not self._advance(self.dp_rank):
            return None
        mine = self._packer.next_step(1) if self._mesh and self._dispatcher is not None else self._packer.next_window()
        if mine is None or not self._advance(self.dp_world - self.dp_rank - 1):
            return None
        index = self._window + self.dp_rank
        self._window += self.dp_world * self._span
        return [(self._batch(mine, index, (time.perf_counter() - t0) * 1e3), self._snapshot())]

    def _produce_step(self, t0: float) -> list[tuple[dict[str, Any], dict[str, Any]]] | None:
        """Pack a whole step in stream order (lengths only), balance it, keep ours."""
        balance, start = self._balance, self._snapshot()
        figures = None
        if balance.deferral is not None:
            done = deferred_step(balance.deferral, self._packer, self.dp_world, balance.micro, self.dp_rank,
                                 balance.cut_target)  # fmt: skip
            if done is None:
                return None
            mine, figures = done
        else:
            step = self._packer.next_step(self.dp_world * balance.micro)
            if step is None:
                return None
            mine = balanced_step(step, self.dp_world, balance.micro, self.dp_rank, self._packer.seq_len,
                                 balance.cost, balance.cut_target)  # fmt: skip
        step_window, skip = self._window, self._skip
        self._window, self._skip = self._window + self.dp_world * balance.micro, 0
        load_ms = (time.perf_counter() - t0) * 1e3 / balance.micro
        items = []
        for m, pieces in enumerate(mine[skip:], start=skip):
            t1 = time.perf_counter()
            batch = self._batch(Window.of(pieces), step_window + m * self.dp_world + self.dp_rank,
                                load_ms + (time.perf_counter() - t1) * 1e3)  # fmt: skip
            if figures is not None:
                batch["deferral"] = figures
            state = {**start, "in_step": m + 1} if m + 1 < balance.micro else self._snapshot()
            items.append((batch, state))
        return items

    def _batch(self, window: Window | StepPieces, index: int, load_ms: float) -> dict[str, Any]:
        """A window as a batch, planned (and dispatched for this rank); a mesh window's pieces (`StepPieces`,
        lengths only) are read after planning, this rank's tokens alone."""
        t1 = time.perf_counter()
        doc_lens = window.doc_lens if isinstance(window, Window) else window.length.tolist()
        if self._use_worker:
            self._worker = self._worker or PlanWorker(self._worker_timeout_s)
            plan, dispatch = self._worker.run(self._planner, self._dispatcher, doc_lens)
        else:
            plan = self._planner(doc_lens)
            dispatch = self._dispatcher(plan) if self._dispatcher is not None else None
        if dispatch is not None and self._finish is not None:
            dispatch = self._finish(dispatch)
        t2 = time.perf_counter()
        if isinstance(window, Window):
            tokens, labels = window.input, window.labels
        else:
            tokens, labels = window.take(dispatch.token_index.numpy())
        batch = {
            "input": torch.from_numpy(tokens),
            "labels": torch.from_numpy(labels),
            "doc_lens": doc_lens,
            "plan": plan,
            "window": index,
            "load_ms": load_ms + (time.perf_counter() - t2) * 1e3,
            "plan_ms": (t2 - t1) * 1e3,
        }
        if dispatch is not None:
            batch["dispatch"] = dispatch
        if self._mesh:
            batch["valid_labels"] = self._valid_labels(window)
        return batch

    def _valid_labels(self, window: Window | StepPieces) -> list[int]:
        """A mesh window's labels other than -100 in each DP group's seq_len of it, from the lengths alone:
        a label is -100 where a document ends, i.e. at every piece's end but the window's last piece's
        when the window cut it (its label is the next token)."""
        c = self._packer.seq_len // self._span
        if isinstance(window, Window):
            return (window.labels.reshape(self._span, c) != IGNORE_INDEX).sum(1).tolist()
        ends = np.cumsum(window.length) - 1
        if window.start[-1] + window.length[-1] < len(window.docs[int(window.doc[-1])]):
            ends = ends[:-1]
        return (c - np.bincount(ends // c, minlength=self._span)).tolist()

    def _advance(self, count: int) -> bool:
        """Pass over other ranks' windows (from offsets alone when the source allows); False at the end."""
        if self._packer.skip_windows(count):
            return True
        return all(self._packer.next_window(materialize=False) is not None for _ in range(count))

    def _run(self) -> None:
        """Producer thread: fill the queue until stopped, the data ends or an error occurs."""
        while not self._stop.is_set():
            try:
                items = self._produce()
            except BaseException as e:  # handed to the consumer, which re-raises it
                if isinstance(e, DataChanged):
                    self.fault = e
                items = [e]
            for item in items or [None]:
                self._queue.put(item)
            if items is None or isinstance(items[0], BaseException):
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
            if not self._ready:
                try:
                    self._ready.extend(self._produce() or [None])
                except DataChanged as e:
                    self.fault = e
                    raise
            item = self._ready.popleft()
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
        batch, state = item
        batch["wait_ms"] = (time.perf_counter() - t0) * 1e3
        if "mix" in state:  # a mixture's tokens per source: so far, and what this batch's next() added
            before, after = self._state["mix"]["tokens"], state["mix"]["tokens"]
            batch["source_tokens"] = dict(after)
            batch["new_source_tokens"] = {name: after[name] - before[name] for name in after}
        self._state = state
        return batch

    def dispatch_with(self, dispatcher: Callable[[Any], Any] | None, worker: bool = False,
                      finish: Callable[[Any], Any] | None = None,
                      worker_timeout_s: float = WORKER_TIMEOUT_S) -> None:  # fmt: skip
        """Build each window's dispatch with `dispatcher(plan)` in the producer (before iterating).

        With `worker`, planning and the dispatch run in a worker process (`flashcp.data.plan_worker`:
        the planner and `dispatcher` must then be picklable), off the GIL of the training thread; a
        worker silent for `worker_timeout_s` is a WorkerError. `finish(dispatch)` (e.g. pinning its
        memory) runs in the producer's thread either way."""
        self._stop_producer()
        self._dispatcher, self._use_worker, self._finish = dispatcher, worker, finish
        self._worker_timeout_s = worker_timeout_s

    def mesh_with(self, dp: int, planner: Callable[[list[int]], Any]) -> None:
        """Mesh scope: each `next()` is the stream's next `dp` windows as one window of dp x seq_len tokens
        (documents cut only at its end), planned by `planner` over the whole mesh and the same on every
        rank. The state still counts windows of seq_len and its cursor is the stream's, so a run resumes
        in either scope, or under another DP, where it stopped. Call before iterating."""
        if dp < 1:
            raise DataError(f"the mesh scope's DP degree must be >= 1, got {dp}")
        self._stop_producer()
        old = self._packer
        self._packer = WindowPacker(old.source, old.seq_len * dp, old.overflow, old.loop)
        self._planner, self._span, self._mesh, self.dp_rank, self.dp_world = planner, dp, True, 0, 1
        self._restore(self._state)

    def balance_with(self, micro: int, cost: WindowCost, cut_target: float | None = None,
                     max_delay: int | None = None, target: float = 1.05,
                     min_kept: float = MIN_KEPT) -> None:  # fmt: skip
        """Balance each optimizer step (`micro` windows per DP rank) over the mesh by `cost`, moving
        the stream's pieces (`cut_target` None) or cutting documents to reach `cut_target`; with
        `max_delay`, long documents wait up to that many steps so that the step's windows stay
        within `target` x the mean (`flashcp.data.deferral`), and only what cannot wait is cut, each
        step keeping `min_kept` of the attended pairs stream packing keeps of its documents.

        Call at a step boundary (before iterating, or after a checkpoint's state was loaded)."""
        if micro < 1:
            raise DataError(f"micro steps per optimizer step must be >= 1, got {micro}")
        if self._span > 1:
            raise DataError("[data] balance and the mesh scope exclude each other: the mesh-wide plan is the balance")
        if cut_target is not None and not cut_target >= 1.0:
            raise DataError(f"the balance target must be >= 1.0, got {cut_target}")
        if max_delay is not None and max_delay < 0:
            raise DataError(f"data.max_delay_steps must be >= 0, got {max_delay}")
        if not 0.0 <= min_kept <= 1.0:
            raise DataError(f"data.min_pairs_kept must be within [0, 1], got {min_kept}")
        self._stop_producer()
        deferral = None
        if max_delay is not None:
            deferral = Deferral(self._packer.seq_len, self.dp_world * micro, max_delay, cost, target,
                                min_kept=min_kept)  # fmt: skip
        self._balance = StepBalance(micro, cost, cut_target, deferral)
        self._restore(self._state)

    def state_dict(self) -> dict[str, Any]:
        return {**self._state, "packing": dict(self._state["packing"])}

    def _restore(self, state: Mapping[str, Any]) -> None:
        self._packer.restore(state["epoch"], state["doc"], state["offset"])
        if isinstance(self._packer.source, MixedSource):
            self._packer.source.load(state.get("mix"))
        self._window, self._skip = state["window"], state.get("in_step", 0)
        if self._balance is not None and self._balance.deferral is not None:
            seq_len = self._packer.seq_len  # a state saved without deferral has nothing pending
            saved = state.get("deferral", {"step": 0, "stream_tokens": state["window"] * seq_len, "pending": []})
            self._balance.deferral.load(saved)
        self._state = self._snapshot(self._skip)
        self._ready.clear()
        self._done = False

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue after the batches `state` counts; the DP/CP layout may differ from the saver's."""
        keys = {"format", "window", "epoch", "doc", "offset", "packing"}
        if not isinstance(state, Mapping) or not keys <= set(state):
            raise DataError(f"not a data loader state: expected keys {sorted(keys)}")
        if state["format"] != STATE_FORMAT:
            raise DataError(f"data loader state format {state['format']} is not {STATE_FORMAT}")
        saved, now = state["packing"], self._fingerprint
        changed = sorted(k for k in set(saved) | set(now) if _compared(k, saved.get(k)) != _compared(k, now.get(k)))
        diff = [f"{k}: saved {saved.get(k)!r}, now {now.get(k)!r}" for k in changed]
        if diff:
            raise DataError("cannot resume the data loader, its packing changed (" + "; ".join(diff) + ")")
        deferring = self._balance is not None and self._balance.deferral is not None
        if state.get("deferral", {}).get("pending") and not deferring:
            raise DataError("the data loader state holds deferred documents: resume with [data] balance = "
                            "\"deferral\" (or \"deferral-cut\")")  # fmt: skip
        if state.get("in_step", 0) and self._balance is None:
            raise DataError("the data loader state was saved inside a balanced step: resume with [data] balance = "
                            "\"mesh\" and the same global batch")  # fmt: skip
        self._stop_producer()
        self._restore(state)

    def close(self) -> None:
        """Stop the prefetch thread and the worker process; iteration may continue afterwards from
        the same point."""
        self._stop_producer()
        if self._worker is not None:
            self._worker.close()
            self._worker = None

    def __enter__(self) -> WindowLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _compared(key: str, value: Any) -> Any:
    """A fingerprint entry as resuming compares it: the tokenizer by content (its sha256 and BOS /
    EOS), not by its file's name, which the entry leads with for the message."""
    if key == "tokenizer" and isinstance(value, str) and "sha256:" in value:
        return value[value.index("sha256:"):]
    return value


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
    source = build_data(cfg, tokenizer)
    fingerprint = {
        "source": source.ident,
        # Strings and numbers only, so the state survives any checkpoint format unchanged.
        # The tokenizer's file by content (its ids, not only its size and specials), and its BOS / EOS.
        "tokenizer": f"{tokenizer.path.name} {file_fingerprint(tokenizer.path)} "
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
