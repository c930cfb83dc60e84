"""Whole-Doc sharding: keep documents whole and split only the few that balance requires.

Under the compact all-gather (Eq. 5) a rank sends the tokens of its non-last shards, so a
document kept whole on one rank costs no communication and a split one costs only its pieces
before the last. The plan is built in two steps that both keep those pieces short:

1. `place_documents`: longest first, each document goes to the rank whose *predicted* final
   workload is lowest, where the prediction fills the rank's remaining room at the average
   density (workload per token) of the documents still to come. Plain least-loaded (LPT) would
   pile short documents onto the rank that took a dense long one until its tokens ran out; the
   prediction charges that rank for the room it must still fill. A document that fits on no
   rank is cut: its tail fills the rank with the most room (the last piece is free) and its head
   is queued again as a piece that will be sent, placed on the rank that sends least. With many
   ranks the short documents, most of a window's, are placed in rounds of one per rank.
2. `flashcp.plan.rebalance`: while the busiest rank exceeds the goal, trade pieces of its
   documents for pieces of shorter ones of ranks with room, token for token (see that module).

The ranks' shards and running totals of both steps are a `flashcp.plan.fill.RankFill`.

`flashcp.plan.hybrid` uses the same two steps for the documents it keeps out of Per-Doc.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left, insort
from collections.abc import Iterable
from itertools import repeat
from typing import NamedTuple

import numpy as np

from flashcp.plan.fill import RankFill
from flashcp.plan.plan import CAUSAL, Shard, Workload, shards_of
from flashcp.plan.rebalance import rebalance

# Rebalance until the busiest rank is within this share of the allowed excess over the mean
# workload: the headroom keeps plans inside the target after integer rounding of later steps.
GOAL_SHARE = 0.8
# From this many ranks on, `place_documents` scans the ranks in numpy (below it the loop over
# ranks is faster than numpy's per-call overhead).
VECTOR_RANKS = 24
# Whole documents of at most this share of the mean room per rank are placed in rounds
# (`_place_rounds`) in plans of at least ROUND_FROM ranks, while ROUND_RANKS ranks have room
# for them.
ROUND_SHARE = 1 / 16
ROUND_FROM = 32
ROUND_RANKS = 4
# Ranks with room for a document up to which `_Mirror` compares them in Python.
FEW_RANKS = 8


class Sorted(NamedTuple):
    """Whole documents for `place_documents`, longest first: (-length, doc, True) items (the
    order of its heap of documents to place), each one's shard, and, for `_place_rounds`, their
    lengths and workloads (`Workload`'s) in numpy and the tokens and workload of every suffix
    (entry i: of items[i:]). The hybrid's attempts share one and place suffixes of it."""

    items: list[tuple[int, int, bool]]
    shards: list[Shard]
    lens: np.ndarray
    costs: np.ndarray
    tokens: list[int]
    work: list[int]

    @staticmethod
    def of(doc_lens: tuple[int, ...], docs: Iterable[int], workload: Workload = CAUSAL) -> Sorted:
        docs = np.sort(np.fromiter(docs, dtype=np.int64))
        lens = np.asarray(doc_lens, dtype=np.int64)[docs]
        by_length = np.argsort(-lens, kind="stable")  # ties by document
        order, lens = docs[by_length].tolist(), lens[by_length]
        costs, length = workload.shards(np.zeros_like(lens), lens), lens.tolist()
        tokens, work = (np.append(np.cumsum(x[::-1])[::-1], 0).tolist() for x in (lens, costs))
        items = list(zip([-x for x in length], order, repeat(True)))
        shards = shards_of(order, repeat(0), length)
        return Sorted(items, shards, lens, costs, tokens, work)


def place_documents(
    doc_lens: tuple[int, ...], docs: Iterable[int] | Sorted, fill: RankFill, first: int = 0
) -> None:
    """Place `docs` whole where possible (step 1 of the module docstring), cutting only to fit.
    `docs` may come sorted already, and then only its items from `first` on are placed (the
    hybrid's attempts place suffixes of one order). The whole documents are taken from the
    sorted list and only the heads of cut ones go through a heap: popping ~1,000 whole
    documents off one heap per attempt cost more than placing them in rounds."""
    n = len(fill.room)
    room, spare, work, bias, sent = fill.room, fill.spare, fill.work, fill.bias, fill.sent
    whole = docs if isinstance(docs, Sorted) else Sorted.of(doc_lens, docs, fill.workload)
    items, count, i = whole.items, len(whole.items), first
    heads: list[tuple[int, int, bool]] = []  # (-length, doc, False), a heap
    rest_tokens, rest_work = whole.tokens[i], whole.work[i]
    shards, cost_of = fill.shards, fill.workload.shard
    load = [b + w for b, w in zip(bias, work)]  # what decisions use (see RankFill)
    mirror = _Mirror(fill) if n >= VECTOR_RANKS else None
    short = ROUND_SHARE * sum(room) / n if n >= ROUND_FROM else 0
    while i < count or heads:
        if heads and (i == count or heads[0] < items[i]):
            neg, d, last = heapq.heappop(heads)
            shard = Shard(d, 0, -neg)
        elif -items[i][0] <= short:
            end = bisect_left(items, heads[0], i) if heads else count  # whole ones before any head
            i, rest_tokens, rest_work = _place_rounds(fill, whole, i, end, rest_tokens, rest_work)
            load = [b + w for b, w in zip(bias, work)]
            if mirror is not None:
                mirror = _Mirror(fill)
            if i < end:
                short = 0  # too few ranks with room for rounds: one document at a time from here on
            continue  # (else a head comes first, placed alone; rounds go on after it)
        else:
            (neg, d, last), shard = items[i], whole.shards[i]
            i += 1
        length = -neg
        cost = cost_of(0, length)
        rest_tokens -= length
        rest_work -= cost
        density = rest_work / rest_tokens if rest_tokens else 0.0
        if mirror is not None:
            best = mirror.best(length, last, density)
        elif last:  # the first lowest prediction (the loop runs once per document and rank)
            best, best_load = -1, math.inf
            for r in range(n):
                left = room[r] - length
                if left >= 0:
                    predicted = load[r] + left * density
                    if predicted < best_load:
                        best, best_load = r, predicted
        else:  # a head: the rank sending least, then the first lowest prediction
            keys = [(sent[r], load[r] + (m - length) * density, r) for r, m in enumerate(room) if m >= length]
            best = min(keys)[2] if keys else -1
        if best < 0:
            # No rank wants it whole: overflow the rank with the most room, within its spare...
            if mirror is not None:
                best = mirror.overflow(length)
            else:
                over = [r for r in range(n) if room[r] + spare[r] >= length]
                best = max(over, key=lambda r: (room[r], -r)) if over else -1
        if best >= 0:  # (RankFill.add, inlined: this loop runs once per document)
            shards[best].append(shard)
            room[best] -= length
            work[best] += cost
            load[best] = bias[best] + work[best]
            if not last:
                sent[best] += length
            if mirror is not None:
                mirror.update(best)
            continue
        # ... or cut it: the tail fills the rank with the most room, the head is queued again.
        r = mirror.roomiest() if mirror is not None else max(range(n), key=lambda r: (room[r] + spare[r], -r))
        take = room[r] + spare[r]
        if take <= 0:
            raise AssertionError("place_documents: more tokens to place than room on all ranks")
        fill.add(r, d, length - take, take, last)
        load[r] = bias[r] + work[r]
        if mirror is not None:
            mirror.update(r)
        head = length - take
        heapq.heappush(heads, (-head, d, False))
        rest_tokens += head
        rest_work += cost_of(0, head)


def _place_rounds(
    fill: RankFill, docs: Sorted, i: int, end: int, rest_tokens: int, rest_work: int
) -> tuple[int, int, int]:
    """Short whole documents placed in rounds, one per rank a round: the i-th longest of a round
    goes to the rank with the i-th lowest predicted workload among those with room for the
    round's longest (the prediction of `place_documents`, at the density left after the round).

    With many documents per rank most of a window's documents are short, and one at a time each
    cost a scan over the ranks; a round costs a few numpy calls for up to half the ranks with
    room. Ranks and documents are paired by the same prediction, longest first, so balance and
    communication come out as placing them one by one (benchmarks/planner_scale.py reports both).
    Rounds take `docs.items[i:end]` while at least ROUND_RANKS ranks have room for a round's
    first. Returns the index after the last document placed and the tokens and workload left."""
    room = np.array(fill.room, dtype=np.int64)
    load = np.add(fill.bias, fill.work, dtype=np.float64)
    work = np.zeros(len(fill.room), dtype=np.int64)
    first, placed = i, []
    while i < end:
        fits = np.flatnonzero(room >= docs.lens[i])
        if len(fits) < ROUND_RANKS:
            break
        j = min(end, i + len(fits))
        rest_tokens -= docs.tokens[i] - docs.tokens[j]
        rest_work -= docs.work[i] - docs.work[j]
        density = rest_work / rest_tokens if rest_tokens else 0.0
        lens, costs = docs.lens[i:j], docs.costs[i:j]
        ranks = fits[np.argsort(load[fits] + room[fits] * density, kind="stable")[: j - i]]
        room[ranks] -= lens
        load[ranks] += costs
        work[ranks] += costs
        placed.append(ranks)
        i = j
    fill.room[:] = room.tolist()
    fill.work[:] = [w + x for w, x in zip(fill.work, work.tolist())]
    add = [shards.append for shards in fill.shards]
    for r, shard in zip(np.concatenate(placed).tolist() if placed else (), docs.shards[first:i]):
        add[r](shard)
    return i, rest_tokens, rest_work


class _Mirror:
    """`place_documents`' choice of rank in numpy, for many ranks: the same predicted workloads
    (the same floating-point operations in the same order), the same first-lowest tie-breaking,
    hence the same placement as the loop over ranks.

    Most documents of a window fit on only a few ranks (those with room left are mostly full):
    the ranks sorted by room give those with room for a document, and when they are at most
    FEW_RANKS they are compared in Python, cheaper than numpy's calls over all ranks. Otherwise
    a rank without room can take nothing more, its load here is infinite, and the lowest
    prediction of all ranks, if it has room for the document, needs no masking."""

    def __init__(self, fill: RankFill) -> None:
        self.fill = fill
        self.room = np.array(fill.room, dtype=np.int64)
        self.load = np.array([b + w for b, w in zip(fill.bias, fill.work)], dtype=np.float64)
        self.load[self.room <= 0] = np.inf
        self.sent = np.array(fill.sent, dtype=np.int64)
        self.spare = np.array(fill.spare, dtype=np.int64)
        self.by_room = sorted(zip(fill.room, range(len(fill.room))))
        self.rooms = list(fill.room)  # as in by_room
        n = len(fill.room)  # scratch buffers: a call makes no new arrays
        self.left, self.predicted, self.full = np.empty(n, np.int64), np.empty(n), np.empty(n, bool)

    def update(self, r: int) -> None:
        fill, by_room = self.fill, self.by_room
        room = self.room[r] = fill.room[r]
        self.load[r] = fill.bias[r] + fill.work[r] if room > 0 else np.inf
        self.sent[r] = fill.sent[r]
        del by_room[bisect_left(by_room, (self.rooms[r], r))]
        insort(by_room, (room, r))
        self.rooms[r] = room

    def overflow(self, length: int) -> int:
        """The rank with the most room (the first) of those with room and spare for `length`; -1 if none."""
        over = np.flatnonzero(self.room + self.spare >= length)
        return int(over[self.room[over].argmax()]) if len(over) else -1

    def roomiest(self) -> int:
        """The rank with the most room and spare (the first)."""
        return int((self.room + self.spare).argmax())

    def best(self, length: int, last: bool, density: float) -> int:
        """The rank with room for `length` tokens and the lowest predicted workload (a whole
        document), or sending least, then lowest predicted (a head); -1 if none has room."""
        first = bisect_left(self.by_room, (length, -1))
        if len(self.by_room) - first <= FEW_RANKS:
            fill = self.fill
            room, bias, work, sent = fill.room, fill.bias, fill.work, fill.sent
            keys = [
                ((0 if last else sent[r]), bias[r] + work[r] + (room[r] - length) * density, r)
                for _, r in self.by_room[first:]
            ]
            return min(keys)[2] if keys else -1
        left, predicted, full = self.left, self.predicted, self.full
        np.subtract(self.room, length, out=left)
        np.multiply(left, density, out=predicted)
        np.add(self.load, predicted, out=predicted)
        if last:
            best = int(predicted.argmin())
            if left[best] >= 0:  # the first lowest of all ranks, so of those with room
                return best
        np.less(left, 0, out=full)
        if last:
            np.copyto(predicted, np.inf, where=full)
            best = int(predicted.argmin())
            return -1 if full[best] else best
        fits = np.flatnonzero(~full)
        return int(fits[np.lexsort((predicted[fits], self.sent[fits]))[0]]) if len(fits) else -1


def plan_whole_doc(
    doc_lens: tuple[int, ...], cp_size: int, target_imbalance: float = 1.05, workload: Workload = CAUSAL
) -> tuple[list[list[Shard]], dict]:
    """Whole-Doc sharding alone: exact tokens per rank, `workload` balanced as far as whole
    documents and short heads allow. A document much heavier than a rank's share of the work
    leaves the plan imbalanced; `flashcp` hands such documents to Per-Doc."""
    n = cp_size
    mean = sum(workload.shard(0, x) for x in doc_lens) / n
    fill = RankFill([sum(doc_lens) // n] * n, workload=workload)
    place_documents(doc_lens, range(len(doc_lens)), fill)
    moves = rebalance(doc_lens, fill, mean * (1 + GOAL_SHARE * (target_imbalance - 1)))
    return fill.shards, {"rebalance_moves": moves}
