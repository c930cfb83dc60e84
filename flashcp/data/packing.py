"""Packing: a document source cut into windows of exactly `seq_len` tokens, and a step's windows
balanced over the whole mesh.

`WindowPacker` lays documents back to back (no padding): the document that does not fit into the
rest of a window is cut at the window's end; with `overflow="carry"` its remaining tokens open the
next window as a new piece (positions restart at 0 there), with `overflow="truncate"` they are
dropped. Its cursor is (epoch, doc, offset), which is all a loader state needs.

`balanced_step` takes the pieces of the windows one optimizer step would train in stream order (all
DP ranks x micro steps, `WindowPacker.next_step`) and packs them again with
`flashcp.data.balance.layout_step` so that every window's predicted cost is close to the mean:
as they are (the same attention context as stream order, but for the short pieces a window's end
cuts), or, given a target, with the pieces of a document joined again and the longest documents
cut until every window is within the target. Each rank materialises only its own windows.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np

from flashcp.data.balance import layout_step, WindowCost
from flashcp.data.deferral import Deferral, DocSpan, step_figures
from flashcp.data.errors import DataError
from flashcp.data.sources import DocSource

IGNORE_INDEX = -100


class Piece(NamedTuple):
    """`length` tokens of a document from `start` on; `tokens` is the document (an array, or a
    lazily read store document) so that a piece is materialised only by the rank that trains it."""

    tokens: Any
    start: int
    length: int


class Window(NamedTuple):
    doc_lens: list[int]
    input: np.ndarray | None  # None for windows packed only to advance the cursor
    labels: np.ndarray | None

    @classmethod
    def of(cls, pieces: Sequence[Piece]) -> Window:
        """Tokens and labels: the next token of the same document, -100 after its last token."""
        inputs, labels = [], []
        for tokens, start, take in pieces:
            inputs.append(tokens[start : start + take])
            following = tokens[start + 1 : start + take + 1]
            piece = np.full(take, IGNORE_INDEX, dtype=np.int64)
            piece[: len(following)] = following
            labels.append(piece)
        return cls([p.length for p in pieces], np.concatenate(inputs), np.concatenate(labels))


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

    def next_pieces(self) -> list[Piece] | None:
        """The next window's pieces, or None when the data ended (loop=False) before it was full."""
        pieces: list[Piece] = []
        space = self.seq_len
        while space:
            tokens = self._document()
            if tokens is None:
                return None
            start, n = self.offset, len(tokens)
            take = min(n - start, space)
            pieces.append(Piece(tokens, start, take))
            space -= take
            if start + take == n or self.overflow == "truncate":
                self.doc, self.offset, self._current = self.doc + 1, 0, None
            else:
                self.offset = start + take
        return pieces

    def next_window(self, materialize: bool = True) -> Window | None:
        """The next window, or None when the data ended (loop=False) before it was full."""
        pieces = self.next_pieces()
        if pieces is None:
            return None
        return Window.of(pieces) if materialize else Window([p.length for p in pieces], None, None)

    def _knows_lengths(self) -> bool:
        """Whether windows can be laid out from document offsets alone: a source that knows its
        lengths (a token store), looping epochs, carried overflow."""
        return self.overflow == "carry" and self.loop and hasattr(self.source, "epoch_starts")

    def _epoch_spans(self, count: int) -> Iterator[tuple[int, np.ndarray, int, int]]:
        """(epoch, its document offsets, first token, end token) of each epoch the next `count`
        windows cross, the cursor advanced past each as it is yielded."""
        space = count * self.seq_len
        while space:
            starts = self.source.epoch_starts(self.epoch)  # each document's token offset, then the total
            if self.doc == len(starts) - 1:  # past the epoch's last document
                self.restore(self.epoch + 1, 0, 0)
                continue
            pos = int(starts[self.doc]) + self.offset
            end = min(pos + space, int(starts[-1]))
            yield self.epoch, starts, pos, end
            last = int(np.searchsorted(starts, end, side="right")) - 1  # the document holding token `end`
            self.restore(self.epoch, last, end - int(starts[last]))
            space -= end - pos
        self._epoch_empty = False

    def skip_windows(self, count: int) -> bool:
        """Advance `count` windows without reading or packing them, from document offsets alone.

        O(log n) per epoch crossed, whatever `count`, where `_knows_lengths`; False (nothing done)
        otherwise. The cursor ends where packing the windows one by one would leave it.
        """
        if not self._knows_lengths():
            return False
        for _ in self._epoch_spans(count):
            pass
        return True

    def read_docs(self, tokens: int) -> DocSpan:
        """The stream's next whole documents (the first from the cursor's offset on) covering at
        least `tokens` tokens, the cursor moved past them; fewer (maybe none) when the data ended
        first (loop = false). From document offsets alone where `_knows_lengths` (a DP = 64 step
        holds ~20K documents)."""
        if not self._knows_lengths():
            rows, left = [], tokens
            while left > 0 and (doc := self._document()) is not None:
                rows.append((self.epoch, self.doc, self.offset, len(doc) - self.offset, doc))
                left -= len(doc) - self.offset
                self.doc, self.offset, self._current = self.doc + 1, 0, None
            *columns, docs = zip(*rows) if rows else ((),) * 5
            return DocSpan(*(np.asarray(c, dtype=np.int64) for c in columns), list(docs))
        columns: list[list[np.ndarray]] = [[], [], [], []]
        left = tokens
        while left > 0:
            starts = self.source.epoch_starts(self.epoch)
            if self.doc == len(starts) - 1:  # past the epoch's last document
                self.restore(self.epoch + 1, 0, 0)
                continue
            pos = int(starts[self.doc]) + self.offset
            last = min(int(np.searchsorted(starts, pos + left, side="left")), len(starts) - 1)
            index = np.arange(self.doc, last)
            start = np.zeros(index.size, dtype=np.int64)
            start[0] = self.offset
            for column, values in zip(columns, (np.full(index.size, self.epoch), index, start,
                                                np.diff(starts[self.doc : last + 1]) - start)):  # fmt: skip
                column.append(values)
            left -= int(starts[last]) - pos
            self.restore(self.epoch, last, 0)
        self._epoch_empty = False
        epochs, positions, start, length = (np.concatenate(c).astype(np.int64) for c in columns)
        return DocSpan(epochs, positions, start, length, _EpochDocuments(self.source, epochs, positions))

    def document(self, epoch: int, position: int) -> Any:
        """The document at `position` of `epoch` (a deferred one, after a resume)."""
        if hasattr(self.source, "document"):
            return self.source.document(epoch, position)
        found = next(self.source.epoch(epoch, position), None)
        if found is None or found[0] != position:
            raise DataError(f"{self.source.name}: deferred document {position} of epoch {epoch} is gone")
        return found[1]

    def next_step(self, count: int) -> StepPieces | None:
        """The pieces of the next `count` windows in stream order, or None when the data ended
        before they were full. From document offsets alone (vectorised, no document read) where
        `_knows_lengths`: a DP = 64 step at 128K holds ~20K pieces, which one Python iteration
        per document would take ~0.3 s to walk."""
        if not self._knows_lengths():
            windows = [self.next_pieces() for _ in range(count)]
            if any(w is None for w in windows):
                return None
            return StepPieces.of([p for w in windows for p in w])
        epochs, positions, doc, start, length, done, n_docs = [], [], [], [], [], 0, 0
        for epoch, starts, pos, end in self._epoch_spans(count):
            first = int(np.searchsorted(starts, pos, side="right")) - 1
            last = int(np.searchsorted(starts, end, side="left"))  # documents [first, last) meet [pos, end)
            window_ends = pos - done + self.seq_len * np.arange(-(-done // self.seq_len), count + 1)
            cuts = np.unique(np.concatenate(([pos, end], starts[first + 1 : last], window_ends)))
            cuts = cuts[(cuts >= pos) & (cuts <= end)]
            at = np.searchsorted(starts, cuts[:-1], side="right") - 1  # the document of each piece
            doc.append(at - first + n_docs)
            start.append(cuts[:-1] - starts[at])
            length.append(np.diff(cuts))
            epochs.append(np.full(last - first, epoch))
            positions.append(np.arange(first, last))
            done, n_docs = done + end - pos, n_docs + last - first
        columns = (epochs, positions, doc, start, length)
        epochs, positions, *pieces = (np.concatenate(c) for c in columns)
        return StepPieces(_EpochDocuments(self.source, epochs, positions), *pieces)


class _EpochDocuments:
    """The documents of a step by (epoch, position), each fetched from the source when first
    indexed and then kept, so that the pieces of one document share its tokens (read once)."""

    def __init__(self, source: Any, epochs: np.ndarray, positions: np.ndarray):
        self.source, self.epochs, self.positions = source, epochs, positions
        self._fetched: dict[int, Any] = {}

    def __getitem__(self, i: int) -> Any:
        if i not in self._fetched:
            self._fetched[i] = self.source.document(int(self.epochs[i]), int(self.positions[i]))
        return self._fetched[i]


class StepPieces(NamedTuple):
    """A step's pieces in stream order as arrays: `docs[doc[i]]` holds piece i's tokens, from
    `start[i]` on, `length[i]` of them. A document's pieces are consecutive."""

    docs: Any  # indexable by document
    doc: np.ndarray
    start: np.ndarray
    length: np.ndarray

    @classmethod
    def of(cls, pieces: Sequence[Piece]) -> StepPieces:
        """From pieces in stream order; those of one document share its `tokens` object."""
        new = [i == 0 or p.tokens is not pieces[i - 1].tokens for i, p in enumerate(pieces)]
        columns = (np.cumsum(new) - 1, [p.start for p in pieces], [p.length for p in pieces])
        docs = [p.tokens for p, first in zip(pieces, new) if first]
        return cls(docs, *(np.asarray(c, dtype=np.int64) for c in columns))

    def take(self, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The tokens and labels (as `Window.of` makes them) at window positions `index`, in that order,
        reading from each document only the runs of consecutive positions asked for and the token after
        each (its label): a mesh-scope rank reads its shards alone, not the DP x C window."""
        ends = np.cumsum(self.length)
        piece = np.searchsorted(ends, index, side="right")
        heads = np.flatnonzero((np.diff(index, prepend=-2) != 1) | (np.diff(piece, prepend=-1) != 0))
        tokens, labels = np.empty(index.size, dtype=np.int64), np.full(index.size, IGNORE_INDEX, dtype=np.int64)
        for h, t in zip(heads.tolist(), [*heads[1:].tolist(), index.size]):
            k = int(piece[h])
            lo = int(self.start[k] + index[h] - ends[k] + self.length[k])
            doc = self.docs[int(self.doc[k])]
            got = doc.span(lo, lo + t - h + 1) if hasattr(doc, "span") else doc[lo : lo + t - h + 1]
            tokens[h:t], labels[h : h + len(got) - 1] = got[: t - h], got[1:]
        return tokens, labels

    def documents(self) -> StepPieces:
        """The pieces that stream packing cut at a window's end and carried into the next joined
        again: one piece per document of the step (or per run of one, if its head came earlier)."""
        joined = np.zeros(self.doc.size, dtype=bool)
        joined[1:] = (self.doc[1:] == self.doc[:-1]) & (self.start[1:] == self.start[:-1] + self.length[:-1])
        head = np.flatnonzero(~joined)
        lengths = np.add.reduceat(self.length, head) if head.size else self.length
        return StepPieces(self.docs, self.doc[head], self.start[head], lengths)


def balanced_step(
    step: StepPieces,
    dp: int,
    micro: int,
    dp_rank: int,
    seq_len: int,
    cost: WindowCost,
    cut_target: float | None,
) -> list[list[Piece]]:
    """This DP rank's `micro` windows of a step whose stream-order pieces (`dp * micro` windows of
    them, in the loader's order) are given: the same tokens, balanced over the mesh
    (`layout_step`), the stream's pieces kept (`cut_target` None) or documents cut to reach
    `cut_target`. Every rank computes the same assignment from the lengths alone."""
    if cut_target is not None:
        step = step.documents()
    placed = layout_step(step.length, dp, micro, seq_len, cost, cut_target).rank(dp_rank)
    return [[Piece(step.docs[int(step.doc[p.doc])], int(step.start[p.doc]) + p.start, p.length) for p in window]
            for window in placed]  # fmt: skip


def deferred_step(
    deferral: Deferral,
    packer: WindowPacker,
    dp: int,
    micro: int,
    dp_rank: int,
    cut_target: float | None,
) -> tuple[list[list[Piece]], dict[str, float]] | None:
    """This DP rank's `micro` windows of the next step under bounded deferral (`Deferral`), and the
    step's figures (the same on every rank); None when the data ended. The step's documents are
    packed by `layout_step`, cutting only documents over a window (`cut_target` None) or also
    what deferral could not bring within `cut_target`.

    With loop = false the steps from where less than three steps of the stream are left flush the
    pending queue (`Deferral.final_step`, pending documents first): a normal step takes at most
    two steps' tokens of the stream (a step's worth may join the queue), so at least one step of
    stream is left then and the flush trains every pending document; only the last incomplete
    step's tokens, from the stream's tail, are dropped, as stream packing drops them. Finding that
    point reads the next three steps' documents ahead (read again for the step: loop = false only).
    """
    start = packer.cursor()
    step, total = None, dp * micro * packer.seq_len
    ahead = packer.loop or int(packer.read_docs(3 * total).length.sum()) >= 3 * total
    if not packer.loop:
        packer.restore(start["epoch"], start["doc"], start["offset"])
    if ahead:
        step = deferral.next_step(packer.read_docs)
    if step is None:
        packer.restore(start["epoch"], start["doc"], start["offset"])
        step = deferral.final_step(packer.read_docs)
        if step is None:
            return None
    if step.cursor is not None:
        packer.restore(*step.cursor)
    layout = deferral.layout(step, dp, micro, cut_target)

    def tokens(i: int) -> Any:
        ref = step.tokens[i]
        return packer.document(int(step.epoch[i]), int(step.position[i])) if ref is None else ref[0][ref[1]]

    fetched = functools.lru_cache(maxsize=None)(tokens)  # a document cut into pieces is read once
    mine = [[Piece(fetched(p.doc), int(step.start[p.doc]) + p.start, p.length) for p in window]
            for window in layout.rank(dp_rank)]  # fmt: skip
    return mine, {**step_figures(step, layout, packer.seq_len), "run_pairs_kept": deferral.kept / deferral.reference}
