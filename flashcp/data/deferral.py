"""Bounded deferral: long documents wait up to `max_delay` steps for company instead of being cut.

With windows of exactly C tokens, a window that draws one long document costs several times the
mean (attention grows with its square), and moving the stream's pieces cannot fix that: no other
window of the step has a similar document. WLB-LLM delays such outliers to later iterations and
releases them together. Here a document of at least `threshold` tokens enters a pending queue
when the stream reaches it (one longer than a window as window-long pieces and a rest, which
stream packing would not keep together either); each step releases the set of pending
documents that keeps the step's windows within the aimed max / mean of predicted cost
(`flashcp.data.release.choose_release`: the highest "level" of long-document work per window
that the pool can fill evenly, the aim relative to the step's mean as released), plus every
document whose delay reached `max_delay` (forced). Short documents fill the rest of the step in
stream order, the last one cut and carried like stream packing does. The step's documents are
then packed into windows by `flashcp.data.balance.layout_step`.

Guarantees, from the lengths alone (every rank computes the same): a step holds exactly
`n_windows * window` tokens; a document is trained whole in the step it is released in, at most
`max_delay` steps after the stream reached it (the forced ones of a step arrived in one step, and
forced documents always fit: each step queues at most one step's tokens); every document of the
stream is trained exactly once; with a cut target (`deferral-cut`), every step's windows hold at
least `min_kept` (`[data] min_pairs_kept`, 99 %) of the attended pairs stream packing keeps of
that step's documents (`Deferral.layout`). "That step's documents" are the spans it trains: whole
documents, window-long pieces of longer ones, and the one the step's end cuts, each at the stream
offset stream packing would give it; their reference is what stream packing's windows keep of
those tokens (cut where its windows end, `stream_pairs`). With `loop = false` the data's end
flushes the queue (`final_step`): the remaining steps hold the pending documents, oldest first,
then the rest of the stream, and only the last incomplete step is dropped, as stream packing drops
it.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from flashcp.data.balance import layout_step, StepLayout, WindowCost
from flashcp.data.release import choose_release, StepAim

AIM_SHARE = 1.0  # the release aims at this share of the tolerated imbalance (deferral-cut cuts the rest)
MIN_KEPT = 0.99  # each step keeps at least this share of the pairs stream packing keeps of its documents


class DocSpan(NamedTuple):
    """Documents of the stream in order: `length` tokens of each from `start` on (only the first
    document may start inside); `docs[i]` is document i's tokens (lazily read)."""

    epoch: np.ndarray
    position: np.ndarray
    start: np.ndarray
    length: np.ndarray
    docs: Any


class Pending(NamedTuple):
    """A deferred document: where it is, how long, when the stream reached it, its stream offset."""

    epoch: int
    position: int
    length: int
    arrival: int  # the step whose stream span held it
    offset: int  # tokens the stream held before it (where stream packing would have put it)
    start: int = 0  # tokens of it already trained (only when the data's end cut it, `final_step`)


class _Refs:
    """Row i's tokens as `(docs, index)` (`docs[index]` reads them) or None (fetch the document),
    stored per run of rows so that a step's ~20K documents need no Python object each."""

    def __init__(self) -> None:
        self.first: list[int] = []  # first row of each run
        self.runs: list[tuple[Any, int]] = []  # (docs, index of the run's first row) or (None, 0)

    def add(self, row: int, docs: Any, index: int) -> None:
        self.first.append(row)
        self.runs.append((docs, index))

    def __getitem__(self, i: int) -> tuple[Any, int] | None:
        k = bisect.bisect_right(self.first, i) - 1
        docs, index = self.runs[k]
        return None if docs is None else (docs, index + i - self.first[k])


COLUMNS = ("epoch", "position", "start", "length", "offset", "delay")


@dataclass
class StepDocs:
    """One step's documents in the order `layout_step` gets them, where the stream stops, figures.
    Built from runs of rows (`add`), read as arrays after `finish`."""

    epoch: np.ndarray | None = None
    position: np.ndarray | None = None
    start: np.ndarray | None = None
    length: np.ndarray | None = None
    offset: np.ndarray | None = None  # stream offset of each piece's first token
    delay: np.ndarray | None = None  # steps each document waited
    tokens: _Refs = field(default_factory=_Refs)  # each document's tokens
    cursor: tuple[int, int, int] | None = None  # (epoch, doc, offset) of the stream after the step
    # (None: where the last read left it, the data's end)
    parts: list[tuple[np.ndarray, ...]] = field(default_factory=list)
    rows: int = 0
    total: int = 0  # tokens so far

    def release(self, p: Pending, take: int, step: int, tokens: tuple[Any, int] | None) -> None:
        """The first `take` tokens still waiting of pending document `p`."""
        self.add((p.epoch,), (p.position,), (p.start,), (take,), (p.offset + p.start,), step - p.arrival,
                 *(tokens or (None, 0)))  # fmt: skip

    def add(self, epoch: Any, position: Any, start: Any, length: Any, offset: Any, delay: int, docs: Any,
            index: int) -> None:  # fmt: skip
        """Rows of documents (array-likes of one length); their tokens are `docs[index]`,
        `docs[index + 1]`, ... (docs None: fetched by position)."""
        columns = tuple(np.asarray(c, dtype=np.int64) for c in (epoch, position, start, length, offset))
        n = columns[0].size
        if n:
            self.parts.append((*columns, np.full(n, delay, dtype=np.int64)))
            self.tokens.add(self.rows, docs, index)
            self.rows += n
            self.total += int(columns[3].sum())

    def finish(self) -> StepDocs:
        """The columns as arrays."""
        for k, name in enumerate(COLUMNS):
            setattr(self, name, np.concatenate([p[k] for p in self.parts]) if self.parts
                    else np.zeros(0, dtype=np.int64))  # fmt: skip
        return self


def stream_pairs(offset: np.ndarray, length: np.ndarray, window: int) -> np.ndarray:
    """Attended pairs of each stretch [offset, offset + length) of the stream as stream packing
    trains it: cut wherever a window ends (at multiples of `window`)."""
    tri = lambda n: n * (n + 1) // 2  # noqa: E731
    head = np.minimum(length, window - offset % window)
    full, tail = np.divmod(length - head, window)
    return tri(head) + full * tri(window) + tri(tail)


@dataclass
class Deferral:
    """The pending queue and the step counter: all the state deferral adds to the loader's."""

    window: int
    n_windows: int
    max_delay: int
    cost: WindowCost
    target: float = 1.05
    threshold: int = 0  # 0: window // 16
    min_kept: float = MIN_KEPT  # `[data] min_pairs_kept`
    pending: list[Pending] = field(default_factory=list)
    tokens: dict[tuple[int, int], Any] = field(default_factory=dict)  # pending documents' tokens, when read
    step: int = 0
    stream_tokens: int = 0  # tokens of the stream passed so far (trained or pending)
    kept: int = 0  # attended pairs of the steps laid out so far (the run's figure)
    reference: int = 0  # and those stream packing keeps of the same documents

    def state(self) -> dict[str, Any]:
        """Plain ints and lists: survives any checkpoint format."""
        return {"step": self.step, "stream_tokens": self.stream_tokens, "kept": self.kept,
                "reference": self.reference, "pending": [list(p) for p in self.pending]}  # fmt: skip

    def load(self, state: dict[str, Any]) -> None:
        self.step, self.stream_tokens = int(state["step"]), int(state["stream_tokens"])
        # A state saved before the pairs were counted starts counting afresh (no credit).
        self.kept, self.reference = int(state.get("kept", 0)), int(state.get("reference", 0))
        self.pending = [Pending(*map(int, p)) for p in state["pending"]]
        self.tokens = {}

    def layout(self, step: StepDocs, dp: int, micro: int, cut_target: float | None) -> StepLayout:
        """The step's windows (`layout_step`), counted into the run's pairs. Cuts made for
        `cut_target` keep at least `min_kept` of the attended pairs stream packing keeps of this
        step's own documents (`stream_pairs` of the spans it trains, at their stream offsets): a
        step may spend what its documents gain over stream packing's cuts (trained whole where its
        windows end), never another step's."""
        reference = int(stream_pairs(step.offset, step.length, self.window).sum())
        layout = layout_step(step.length, dp, micro, self.window, self.cost, cut_target,
                             None if cut_target is None else self.min_kept * reference)  # fmt: skip
        self.kept += int((layout.length * (layout.length + 1) // 2).sum())
        self.reference += reference
        return layout

    def next_step(self, read: Callable[[int], DocSpan]) -> StepDocs | None:
        """The next step's documents; `read(tokens)` gives the stream's next whole documents
        covering at least `tokens` tokens (fewer at the end of the data: then None, and the caller
        rewinds the stream to the step's start for `final_step`). The queue and counters advance
        only when a step is returned."""
        total = self.n_windows * self.window
        span = read(total)
        if int(span.length.sum()) < total:
            return None
        candidate = self._candidates(span)
        pend = np.array([p.length for p in self.pending], dtype=np.int64)
        forced = np.array([self.step - p.arrival >= self.max_delay for p in self.pending], dtype=bool)
        short = span.length[~candidate]
        density = float((short * (short + 1) / 2).sum() / max(int(short.sum()), 1))
        base = density * self.window + self.cost.dense_per_token * self.window / self.cost.attn_per_pair
        short_tokens = np.where(candidate, 0, span.length)
        before = (np.cumsum(short_tokens) - short_tokens)[candidate]  # short tokens before each candidate
        aim = StepAim(self.n_windows, self.window, density, base, AIM_SHARE * (self.target - 1), short,
                      self.cost, np.concatenate((np.full(pend.size, -1), before)))  # fmt: skip
        pool = np.concatenate((pend, span.length[candidate]))
        forced = np.concatenate((forced, np.zeros(pool.size - pend.size, dtype=bool)))
        waiting = np.array([p.offset + p.start for p in self.pending], dtype=np.int64)
        arriving = self.stream_tokens + np.cumsum(span.length) - span.length  # where the stream holds them
        offset = np.concatenate((waiting, arriving[candidate]))
        release = choose_release(pool, stream_pairs(offset, pool, self.window), forced, aim)
        out, queue = StepDocs(), []
        for p, go in zip(self.pending, release[: pend.size].tolist()):
            if go:
                out.release(p, p.length, self.step, self.tokens.get((p.epoch, p.position)))
            else:
                queue.append(p)
        walk = _Walk(self, out, queue, total - out.total)
        released = set(np.flatnonzero(candidate)[release[pend.size :]].tolist())
        while not walk.over(span, candidate, released):
            need = walk.need
            span = read(need)
            if int(span.length.sum()) < need:
                return None
            candidate, released = self._candidates(span), set()  # too late to be released with this step
        return self._advance(out, queue, walk)

    def final_step(self, read: Callable[[int], DocSpan]) -> StepDocs | None:
        """A step at the data's end (`loop = false`, `next_step` found too few tokens; the stream
        rewound to the step's start): the pending documents that fit, oldest first, then the rest
        of the stream in order (nothing new waits), then, if the stream ran out, the next pending
        documents, the last one cut (its rest waits, as it would have waited). None when pending and
        stream together hold less than a step: that last incomplete step is dropped."""
        total = self.n_windows * self.window
        out, queue, room = StepDocs(), [], total
        for p in self.pending:
            if p.length <= room:
                out.release(p, p.length, self.step, self.tokens.get((p.epoch, p.position)))
                room -= p.length
            else:
                queue.append(p)
        walk = _Walk(self, out, queue, room)
        if room:
            span = read(room)
            if not walk.over(span, np.zeros(span.length.size, dtype=bool), set()):
                if sum(q.length for q in queue) < walk.need:
                    return None
                while walk.need:  # the stream ran out: waiting documents fill the rest
                    p = queue.pop(0)
                    take = min(p.length, walk.need)
                    out.release(p, take, self.step, self.tokens.get((p.epoch, p.position)))
                    walk.need -= take
                    if take < p.length:
                        queue.insert(0, p._replace(start=p.start + take, length=p.length - take))
        return self._advance(out, queue, walk)

    def _advance(self, out: StepDocs, queue: list[Pending], walk: _Walk) -> StepDocs:
        """The step is made: the queue and counters move on."""
        kept = {(q.epoch, q.position) for q in queue}
        self.tokens = {k: v for k, v in self.tokens.items() if k in kept}
        self.pending, self.step, self.stream_tokens = queue, self.step + 1, walk.offset
        return out.finish()

    def _candidates(self, span: DocSpan) -> np.ndarray:
        """Documents that may wait: long and whole (one longer than a window waits as window-long
        pieces, `_Walk.over`)."""
        thr = self.threshold or max(1, self.window // 16)
        return (span.start == 0) & (span.length >= thr)


class _Walk:
    """The stream walked in order for one step: short documents fill it (the last one cut where the
    step is full), released long ones are trained whole, the others join the queue."""

    def __init__(self, deferral: Deferral, out: StepDocs, queue: list[Pending], need: int):
        self.d, self.out, self.queue, self.need = deferral, out, queue, need
        self.offset = deferral.stream_tokens
        self.queued = 0  # tokens this step added to the queue: at most a step's, so they fit when forced

    def _take(self, span: DocSpan, a: int, b: int, offsets: np.ndarray) -> None:
        """Documents a..b-1 of the span whole."""
        self.out.add(span.epoch[a:b], span.position[a:b], span.start[a:b], span.length[a:b], offsets[a:b], 0,
                     span.docs, a)  # fmt: skip

    def over(self, span: DocSpan, candidate: np.ndarray, released: set[int]) -> bool:
        """Walk `span`; True when the step is full (the cursor set), False when it needs more."""
        if not self.need:  # the released documents fill the step: the stream waits
            if span.length.size:
                self.out.cursor = (int(span.epoch[0]), int(span.position[0]), int(span.start[0]))
            return True
        offsets = self.offset + np.concatenate(([0], np.cumsum(span.length)))
        fill = np.concatenate(([0], np.cumsum(np.where(candidate, 0, span.length))))
        prev = 0
        for j in [*np.flatnonzero(candidate).tolist(), span.length.size]:
            if fill[j] - fill[prev] >= self.need:  # the step ends inside the short documents before j
                k = int(np.searchsorted(fill, fill[prev] + self.need, side="left")) - 1
                self._take(span, prev, k, offsets)
                take = self.need - int(fill[k] - fill[prev])
                self._piece(span, k, take, offsets)
                return True
            self._take(span, prev, j, offsets)
            self.need -= int(fill[j] - fill[prev])
            if j == span.length.size:
                break
            e, pos, n = int(span.epoch[j]), int(span.position[j]), int(span.length[j])
            if j in released and n <= self.need:
                self._take(span, j, j + 1, offsets)
                self.need -= n
            elif self.d.max_delay and self.queued + n <= self.d.n_windows * self.d.window:
                # A document longer than a window waits as window-long pieces from its head on (each
                # a whole window, attending within itself as in stream packing's windows), released
                # once enough company for a whole window's attention has gathered.
                window = self.d.window
                self.queue.extend(Pending(e, pos, min(window, n - s), self.d.step, int(offsets[j]), s)
                                  for s in range(0, n, window))  # fmt: skip
                self.d.tokens[(e, pos)] = (span.docs, j)
                self.queued += n
            else:  # this step queued a step's worth already: it fills in stream order
                self._piece(span, j, min(n, self.need), offsets)
                if self.need == 0:
                    return True
            prev = j + 1
            if self.need == 0:
                self.out.cursor = (e, pos + 1, 0)
                self.offset = int(offsets[j + 1])
                return True
        self.offset = int(offsets[-1])
        return False

    def _piece(self, span: DocSpan, k: int, take: int, offsets: np.ndarray) -> None:
        """The first `take` tokens of document k (all of it: the stream moves past it)."""
        e, pos, s, n = int(span.epoch[k]), int(span.position[k]), int(span.start[k]), int(span.length[k])
        self.out.add((e,), (pos,), (s,), (take,), (int(offsets[k]),), 0, span.docs, k)
        self.need -= take
        self.out.cursor = (e, pos, s + take) if take < n else (e, pos + 1, 0)
        self.offset = int(offsets[k]) + take


def step_figures(step: StepDocs, layout: StepLayout, window: int) -> dict[str, float]:
    """What deferral did to one step (`layout`: its balanced pieces): tokens of documents that
    waited, their mean and longest wait (steps), documents trained in more than one piece, attended
    pairs kept relative to stream packing of the same documents (cut where the stream's windows end)."""
    delay, length = np.asarray(step.delay), np.asarray(step.length)
    waited = delay > 0
    pieces = np.bincount(layout.doc, minlength=length.size)
    trained = float((layout.length * (layout.length + 1) / 2).sum())
    reference = float(stream_pairs(np.asarray(step.offset), length, window).sum())
    return {
        "delayed_tokens": float(length[waited].sum()),
        "delay_mean": float(delay[waited].mean()) if waited.any() else 0.0,
        "delay_max": float(delay.max()) if delay.size else 0.0,
        "cut_docs": float((pieces > 1).sum()),
        "pairs_kept": trained / reference if reference else 1.0,
    }
