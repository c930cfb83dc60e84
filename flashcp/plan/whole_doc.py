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
   is queued again as a piece that will be sent, placed on the rank that sends least.
2. `rebalance`: while the busiest rank exceeds the goal it trades a whole document x for a
   shorter whole document y of a rank with room. x moves but for a head of h tokens, y moves
   but for a head of g = h - (|x| - |y|) tokens, so both ranks keep their token counts and the
   workload moved, W(|x|) - W(h) - W(|y|) + W(g), falls by |x| - |y| per token of h. The move
   costs h + g sent tokens, least when x and y are long and of similar length (h is then about
   the workload moved divided by |x|): balance is bought with short heads.

`flashcp.plan.hybrid` uses the same two steps for the documents it keeps out of Per-Doc.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_right
from collections.abc import Iterable, Sequence

from flashcp.plan.plan import Shard, shard_workload

# Rebalance until the busiest rank is within this share of the allowed excess over the mean
# workload: the headroom keeps plans inside the target after integer rounding of later steps.
GOAL_SHARE = 0.8
# Trades per rank before rebalancing gives up (each trade fixes the busiest rank; the bound
# only keeps pathological inputs cheap).
MOVES_PER_RANK = 4
# Partner documents examined per candidate: enough to skip ranks that lack room.
PARTNER_SCAN = 8


class RankFill:
    """Shards and running totals of every rank while a plan is being built.

    `room` is how many more tokens a rank should take and `spare` how many beyond that it may
    take (0 when token counts must come out exact). `work` is the exact workload of the shards
    placed, `sent` their tokens in non-last shards, and `bias` a per-rank workload the caller
    expects the rank to carry besides them (shards placed elsewhere, estimates); decisions use
    `bias + work`.
    """

    def __init__(
        self,
        room: Sequence[int],
        spare: Sequence[int] | None = None,
        bias: Sequence[float] | None = None,
        sent: Sequence[int] | None = None,
    ) -> None:
        n = len(room)
        self.shards: list[list[Shard]] = [[] for _ in range(n)]
        self.room = list(room)
        self.spare = list(spare) if spare is not None else [0] * n
        self.bias = list(bias) if bias is not None else [0.0] * n
        self.sent = list(sent) if sent is not None else [0] * n
        self.work = [0] * n

    def add(self, rank: int, doc: int, start: int, length: int, last: bool) -> None:
        self.shards[rank].append(Shard(doc, start, length))
        self.room[rank] -= length
        self.work[rank] += shard_workload(start, length)
        if not last:
            self.sent[rank] += length


def place_documents(doc_lens: tuple[int, ...], docs: Iterable[int], fill: RankFill) -> None:
    """Place `docs` whole where possible (step 1 of the module docstring), cutting only to fit."""
    n = len(fill.room)
    room, spare, work, bias, sent = fill.room, fill.spare, fill.work, fill.bias, fill.sent
    # Queue items are [0, length) of a document. `last` marks a whole document; otherwise the
    # item is a head whose tail is placed already, so all of it will be sent.
    queue = [(-doc_lens[d], d, True) for d in docs]
    heapq.heapify(queue)
    rest_tokens = sum(doc_lens[d] for d in docs)
    rest_work = sum(shard_workload(0, doc_lens[d]) for d in docs)
    while queue:
        neg, d, last = heapq.heappop(queue)
        length = -neg
        rest_tokens -= length
        rest_work -= shard_workload(0, length)
        density = rest_work / rest_tokens if rest_tokens else 0.0
        best, best_sent, best_load = -1, 0, math.inf
        for r in range(n):
            left = room[r] - length
            if left >= 0:
                predicted = bias[r] + work[r] + left * density
                if last:
                    if predicted < best_load:
                        best, best_load = r, predicted
                elif best < 0 or sent[r] < best_sent or (sent[r] == best_sent and predicted < best_load):
                    best, best_sent, best_load = r, sent[r], predicted
        if best < 0:
            # No rank wants it whole: overflow the rank with the most room, within its spare...
            over = [r for r in range(n) if room[r] + spare[r] >= length]
            if over:
                best = max(over, key=lambda r: (room[r], -r))
        if best >= 0:
            fill.add(best, d, 0, length, last)
            continue
        # ... or cut it: the tail fills the rank with the most room, the head is queued again.
        r = max(range(n), key=lambda r: (room[r] + spare[r], -r))
        take = room[r] + spare[r]
        if take <= 0:
            raise AssertionError("place_documents: more tokens to place than room on all ranks")
        fill.add(r, d, length - take, take, last)
        head = length - take
        heapq.heappush(queue, (-head, d, False))
        rest_tokens += head
        rest_work += shard_workload(0, head)


def rebalance(doc_lens: tuple[int, ...], fill: RankFill, goal: float, max_sent: float = math.inf) -> int:
    """Trade documents between ranks (step 2 of the module docstring) until no rank exceeds `goal`.

    Token counts per rank are unchanged, and no trade may leave a rank sending more than
    `max_sent` tokens. Returns the number of trades made.
    """
    n = len(fill.room)
    load = [b + w for b, w in zip(fill.bias, fill.work)]
    sent = fill.sent
    # Whole documents as (length, doc, rank), sorted: the partner search bisects by length.
    whole = sorted(
        (s.length, s.doc, r)
        for r, shards in enumerate(fill.shards)
        for s in shards
        if s.start == 0 and s.length == doc_lens[s.doc]
    )
    whole_lens = [x[0] for x in whole]
    moves = 0
    for _ in range(MOVES_PER_RANK * n):
        a = max(range(n), key=lambda r: (load[r], -r))
        need = load[a] - goal
        if need <= 0:
            break
        top = max(sent)
        best = None
        for lx, x, owner in reversed(whole):
            if lx * lx < 4 * need:  # even the best partner (|y| = |x| / 2) moves too little
                break
            if owner == a:
                found = _best_partner(lx, x, a, need, goal, whole, whole_lens, load, sent, top, max_sent)
                if found is not None and (best is None or found[0] < best[0]):
                    best = found
        if best is None:
            break
        _, x, lx, y, ly, b, h, g = best
        moved = _trade(fill, a, b, x, lx, y, ly, h, g)
        load[a] -= moved
        load[b] += moved
        for item in ((lx, x, a), (ly, y, b)):
            i = bisect_right(whole, item) - 1
            del whole[i], whole_lens[i]
        moves += 1
    return moves


def _best_partner(lx, x, a, need, goal, whole, whole_lens, load, sent, top, max_sent):
    """Cheapest trade of whole document x on rank a against a shorter whole document elsewhere.

    With partner y, the trade moves the most workload at h = |x| - |y|, g = 0:
    W(|x|) - W(|y|) - W(|x| - |y|) = |y| (|x| - |y|). So the partners that can move `need` have
    lengths between the roots of |y| (|x| - |y|) = need, and the longest of them needs the
    shortest heads: scan down from there.
    """
    root = math.sqrt(lx * lx - 4 * need)
    shortest = (lx - root) / 2
    best = None
    i = bisect_right(whole_lens, min(lx - 1, (lx + root) / 2))
    scanned = 0
    while i > 0 and scanned < PARTNER_SCAN:
        i -= 1
        ly, y, b = whole[i]
        if ly < shortest:
            break
        room = goal - load[b]
        if b == a or room < need:
            continue
        scanned += 1
        dl = lx - ly
        most = shard_workload(0, lx) - shard_workload(0, ly) - shard_workload(0, dl)
        # The smallest h whose move still fits b's room (each token of h moves dl less).
        h = dl + max(0, math.ceil((most - room) / dl))
        g = h - dl
        if most - dl * g < need or h >= lx or max(sent[a] + h, sent[b] + g) > max_sent:
            continue
        key = (max(top, sent[a] + h, sent[b] + g), h + g, y)
        if best is None or key < best[0]:
            best = (key, x, lx, y, ly, b, h, g)
    return best


def _trade(fill: RankFill, a, b, x, lx, y, ly, h, g) -> int:
    """x's tail [h, |x|) goes from rank a to b and y's tail [g, |y|) from b to a; returns the
    workload moved from a to b."""
    fill.shards[a] = [s for s in fill.shards[a] if s.doc != x] + [Shard(x, 0, h), Shard(y, g, ly - g)]
    fill.shards[b] = [s for s in fill.shards[b] if s.doc != y] + [Shard(x, h, lx - h)] + ([Shard(y, 0, g)] if g else [])
    moved = shard_workload(h, lx - h) - shard_workload(g, ly - g)
    fill.work[a] -= moved
    fill.work[b] += moved
    fill.sent[a] += h
    fill.sent[b] += g
    return moved


def plan_whole_doc(
    doc_lens: tuple[int, ...], cp_size: int, target_imbalance: float = 1.05
) -> tuple[list[list[Shard]], dict]:
    """Whole-Doc sharding alone: exact tokens per rank, workload balanced as far as whole
    documents and short heads allow. A document much heavier than a rank's share of the work
    leaves the plan imbalanced; `flashcp` hands such documents to Per-Doc."""
    n = cp_size
    mean = sum(shard_workload(0, x) for x in doc_lens) / n
    fill = RankFill([sum(doc_lens) // n] * n)
    place_documents(doc_lens, range(len(doc_lens)), fill)
    moves = rebalance(doc_lens, fill, mean * (1 + GOAL_SHARE * (target_imbalance - 1)))
    return fill.shards, {"rebalance_moves": moves}
