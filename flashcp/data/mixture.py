"""A data mixture: several document sources interleaved into one stream by token weights.

    source = build_data(cfg, tokenizer)   # a MixedSource for [data.mix.NAME] tables, else build_source

The rule: at every document boundary the stream takes the next document of the source whose
tokens so far, divided by its share, are fewest (ties: the first name in order), i.e. weighted
fair queueing by tokens. Each source's token count then stays within one of its documents of
share x total, so the fractions are exact up to a document whatever the length distributions,
and the choice depends on document lengths alone: every rank computes the same stream, and a
token store's documents are still read only by the rank whose window holds them (`len()` of a
store document comes from the store's offsets). The randomness is each source's own seeded
shuffle (`[data] seed`, `shuffle`). Packing, planning and `[data] balance` see one stream.

Epochs: each source loops over its own epochs (reshuffled each) independently: an epoch of the
small source ending neither ends the mixture nor restarts the others. The mixture is one endless
stream (the packer's epoch 0); with `[data] loop = false` it ends where a source it draws from
has finished its first epoch.

Length filter: a document is kept when min_tokens <= length <= max_tokens, counted as packed
(BOS and EOS included); a source whose epoch keeps no document is a DataError naming the entry.

State (`state` / `load`, kept by the loader in its state_dict): the stream position it refers to
and, for each source, the (epoch, position) of its next document and the tokens taken from it
so far. Later positions are found again by replaying lengths from there; the state is anchored at
the oldest position the loader may still need (its cursor, or a deferred document before it).
The state also says how many tokens of each source the windows so far trained (informational,
never loaded: recomputed from the cursor and the pending documents, so older states resume).
Not a fast path: the stream is walked document by document on every rank (token stores' lengths
only), where a single store lays windows out from its offsets in bulk.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from flashcp.data.errors import DataError
from flashcp.data.settings import DataConfig, mix_entries, NO_LIMIT
from flashcp.data.sources import build_source, DocSource
from flashcp.data.tokenizer import Tokenizer

# Documents in a row the length filter may drop from an endless source (synthetic) before it is
# taken to keep none: such a source has no epoch end at which to say so.
MAX_SKIPPED = 10_000


@dataclass(frozen=True)
class Part:
    """One source of a mixture: its share of the tokens, the lengths it keeps, whether it loops."""

    name: str
    share: float
    source: DocSource
    min_tokens: int = 0
    max_tokens: int = NO_LIMIT
    loop: bool = True

    def documents(self, epoch: int, position: int) -> Iterator[tuple[int, int, Any]]:
        """(epoch, position, tokens) of the kept documents from `position` of `epoch` on, epoch
        after epoch (only to the end of `epoch` without `loop`)."""
        while True:
            kept, skipped = False, 0
            for pos, tokens in self.source.epoch(epoch, position):
                if self.min_tokens <= len(tokens) <= self.max_tokens:
                    kept, skipped = True, 0
                    yield epoch, pos, tokens
                elif (skipped := skipped + 1) == MAX_SKIPPED and getattr(self.source, "endless", False):
                    raise self._keeps_none(f" among {MAX_SKIPPED:,} documents in a row")
            if position == 0 and not kept:
                raise self._keeps_none("")
            if not self.loop:
                return
            epoch, position = epoch + 1, 0

    def kept(self) -> str:
        """The length filter in words ("" when there is none)."""
        low, high = self.min_tokens > 0, self.max_tokens < NO_LIMIT
        return (f" of {self.min_tokens} tokens or more" * (low and not high)
                + f" of at most {self.max_tokens} tokens" * (high and not low)
                + f" of {self.min_tokens} to {self.max_tokens} tokens" * (low and high))  # fmt: skip

    def _keeps_none(self, where: str) -> DataError:
        what = f"{self.kept()}{where} (min_tokens / max_tokens, BOS and EOS included)" if self.kept() else \
            " with any tokens"
        return DataError(f"[data.mix.{self.name}] {self.source.name} holds no document{what}")


class MixState(NamedTuple):
    """The mixer at one stream position: each source's next (epoch, position) and tokens taken."""

    position: int
    cursors: tuple[tuple[int, int], ...]
    taken: tuple[int, ...]


class _Log:
    """The mixer's choices from its anchor on, one row per stream document (part, epoch, position,
    length), in int64 columns: the mixer at a logged position is then a few numpy reductions
    (with deferral the log spans up to `max_delay_steps` steps, ~10^5 documents at scale)."""

    def __init__(self) -> None:
        self.columns = [array("q") for _ in range(4)]

    def __len__(self) -> int:
        return len(self.columns[0])

    def append(self, *row: int) -> None:
        for column, value in zip(self.columns, row):
            column.append(value)

    def drop(self, n: int) -> None:
        """Forget the first `n` rows."""
        self.columns = [column[n:] for column in self.columns]

    def replay(self, state: MixState, n: int) -> MixState:
        """`state` advanced over the first `n` rows."""
        part, epoch, pos, length = (np.frombuffer(column[:n], dtype=np.int64) for column in self.columns)
        cursors, taken = list(state.cursors), list(state.taken)
        for i in range(len(taken)):
            rows = np.flatnonzero(part == i)
            if rows.size:
                cursors[i] = (int(epoch[rows[-1]]), int(pos[rows[-1]]) + 1)
                taken[i] += int(length[rows].sum())
        return MixState(state.position + n, tuple(cursors), tuple(taken))


class MixedSource:
    """A DocSource whose one endless epoch interleaves `parts` by token shares (module docstring)."""

    def __init__(self, parts: list[Part]):
        self.parts = parts  # distinct names (the keys of [data.mix])
        self.name = "mixture of " + "; ".join(
            f"{p.name} {100 * p.share:.1f}% ({p.source.name}, documents{p.kept() or ' of any length'})" for p in parts
        )
        self.ident = "mix:" + ";".join(f"{p.name}={p.share!r}:{p.min_tokens}-{p.max_tokens}:{p.source.ident}"
                                       for p in parts)  # fmt: skip
        self._anchor = MixState(0, ((0, 0),) * len(parts), (0,) * len(parts))
        self._log = _Log()

    def _state_at(self, position: int) -> MixState:
        """The mixer before stream document `position` (at or after the anchor), walking the
        stream on (lengths only from a token store) where the log does not reach it yet."""
        a, end = self._anchor, self._anchor.position + len(self._log)
        if position > end:
            for done, _ in self._walk(self._state_at(end)):
                if done + 1 == position:
                    break
        if not 0 <= position - a.position <= len(self._log):
            raise DataError(f"{self.name}: stream position {position} is outside the mixer's known span "
                            f"[{a.position}, {a.position + len(self._log)}]")  # fmt: skip
        return self._log.replay(a, position - a.position)

    def epoch(self, epoch: int, start: int) -> Iterator[tuple[int, Any]]:
        if epoch:  # one endless epoch; a finite mixture (loop = false) ends inside it
            return
        yield from self._walk(self._state_at(start))

    def _walk(self, state: MixState) -> Iterator[tuple[int, Any]]:
        """The stream from `state` on, logging each choice the log does not hold yet."""
        docs: list[Iterator | None] = [None] * len(self.parts)
        taken = list(state.taken)
        for position in range(state.position, 2**62):
            i = min(range(len(self.parts)), key=lambda j: taken[j] / self.parts[j].share)
            if docs[i] is None:
                docs[i] = self.parts[i].documents(*state.cursors[i])
            item = next(docs[i], None)
            if item is None:
                return
            epoch, pos, tokens = item
            if position == self._anchor.position + len(self._log):
                self._log.append(i, epoch, pos, len(tokens))
            taken[i] += len(tokens)
            yield position, tokens

    def state(self, cursor: int, offset: int, pending: Sequence[tuple[int, int]]) -> dict[str, Any]:
        """Plain data for the loader's state, whose packing cursor is `offset` tokens into stream
        document `cursor` and whose deferral still holds `pending` (position, tokens) before it: the
        mixer at the oldest of these positions (the loader may go back there; logged positions
        before it are dropped) and each source's tokens trained so far, i.e. taken before the
        cursor, plus the cursor document's first `offset`, less the pending (from the first step
        on, where whole documents would show nothing until a source's first one ends)."""
        anchor = min([cursor, *(position for position, _ in pending)])
        s = self._state_at(anchor)
        if offset:
            self._state_at(cursor + 1)  # walks the stream on until the log holds the cursor's document
        trained = np.array(self._state_at(cursor).taken, dtype=np.int64)
        changes = [(cursor, offset)] * bool(offset) + [(position, -tokens) for position, tokens in pending]
        positions, tokens = np.array(changes, dtype=np.int64).reshape(-1, 2).T
        logged_part = np.frombuffer(self._log.columns[0], dtype=np.int64)
        np.add.at(trained, logged_part[positions - self._anchor.position], tokens)
        self._log.drop(anchor - self._anchor.position)
        self._anchor = s
        return {
            "position": s.position,
            "sources": {p.name: [*c, t] for p, c, t in zip(self.parts, s.cursors, s.taken)},
            "tokens": {p.name: int(t) for p, t in zip(self.parts, trained)},
        }

    def load(self, state: Mapping[str, Any] | None) -> None:
        """Continue from a `state()`; DataError if it is not one of this mixture's."""
        names = [p.name for p in self.parts]
        saved = (state or {}).get("sources", {})
        if sorted(saved) != sorted(names):
            raise DataError(f"the data loader state holds the mixer of sources {sorted(saved)}, not of "
                            f"{sorted(names)}")  # fmt: skip
        cursors = tuple((int(saved[n][0]), int(saved[n][1])) for n in names)
        self._anchor = MixState(int(state["position"]), cursors, tuple(int(saved[n][2]) for n in names))
        self._log = _Log()


def build_data(cfg: DataConfig, tokenizer: Tokenizer) -> DocSource:
    """The document stream `cfg` describes: its `[data.mix.NAME]` sources mixed, else `cfg.source`."""
    if not cfg.mix:
        return build_source(cfg, tokenizer)
    parts = []
    for entry in mix_entries(cfg):
        try:
            source = build_source(cfg.of_entry(entry), tokenizer)
        except DataError as e:
            raise DataError(f"[data.mix.{entry.name}] {e}") from e
        parts.append(Part(entry.name, entry.share, source, entry.min_tokens, entry.max_tokens, cfg.loop))
    return MixedSource(parts)


def open_first(source: DocSource) -> None:
    """Read the first document of `source`, or of each source of a mixture (its first kept one):
    what the launcher opens before any rank starts."""
    if isinstance(source, MixedSource):
        for part in source.parts:
            next(part.documents(0, 0), None)
    else:
        next(iter(source.epoch(0, 0)), None)
