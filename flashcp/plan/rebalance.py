"""Step 2 of Whole-Doc sharding: trades that even out the workload placement left uneven.

Placement (step 1, `flashcp.plan.whole_doc`) keeps documents whole. Then, while the busiest rank
exceeds the goal, it trades part of one of its documents for the end of a shorter whole document
y of a rank with room, token for token, so token counts never change. Giving the last t tokens
of a whole document x and keeping its head moves t (|x| - |y|) workload; the kept head of x and
the head y leaves behind are sent, so the trade costs (|x| - t) + (|y| - t) tokens, least when
x and y are long and of similar length (then t is close to |y| and the heads are about the
workload moved divided by |x|): balance is bought with short heads. Both documents end up
partially partitioned, as in the paper's Fig. 4. A rank holding only the tail of a cut document
trades the front of that tail instead (see `rebalance`).

With sliding-window layers (`flashcp.plan.Workload`) the trades are sized by the full layers
alone: past a document's first W positions a window layer's work per token is the same
everywhere, so swapping t tokens for t tokens moves none of it. Where y is shorter than W the
window layers move a little more; the trade's exact workload is what the totals record.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right

from flashcp.plan.fill import RankFill
from flashcp.plan.plan import Shard

# Trades per rank before rebalancing gives up (each trade fixes the busiest rank; the bound
# only keeps pathological inputs cheap).
MOVES_PER_RANK = 4
# Partner documents examined per candidate: enough to skip ranks that lack room.
PARTNER_SCAN = 8


def rebalance(doc_lens: tuple[int, ...], fill: RankFill, goal: float, max_sent: float = math.inf) -> int:
    """Trade pieces between ranks (step 2 of the module docstring) until no rank exceeds `goal`.

    The busiest rank a gives part of one of its last pieces [s, e) of a document x (a whole
    document has s = 0) for a whole document y of a rank b with room, which sends back the same
    number of tokens from y's end (keeping y's head of g tokens, now sent):
    - back trade: a gives x's last t tokens and keeps [s, e - t), now sent. Workload moved:
      t (e - |y|). This is the trade of the module docstring when s = 0.
    - front trade: a gives x's first d tokens [s, s + d) and keeps the rest, still x's last
      piece; b sends all of them and y's head. Workload moved: d (s - g). Only worth it when
      s is large, i.e. for the tail of a document already cut.
    Token counts per rank are unchanged and no trade may leave a rank sending more than
    `max_sent` tokens. Returns the number of trades made.
    """
    n, full_layers = len(fill.room), fill.workload.full_layers
    if not full_layers:  # window layers only: a trade moves (almost) no work
        return 0
    load = [b + w for b, w in zip(fill.bias, fill.work)]
    # Whole documents as (length, doc, rank), sorted: partner searches bisect by length.
    whole = sorted(
        (s.length, s.doc, r)
        for r, shards in enumerate(fill.shards)
        for s in shards
        if s.start == 0 and s.length == doc_lens[s.doc]
    )
    lens = [x[0] for x in whole]
    moves = 0
    for _ in range(MOVES_PER_RANK * n):
        a = max(range(n), key=lambda r: (load[r], -r))
        need = load[a] - goal
        if need <= 0:
            break
        pieces = [s for s in fill.shards[a] if s.length > 1 and s.start + s.length == doc_lens[s.doc]]
        search = _PartnerSearch(whole, lens, a, need, goal, load, fill.sent, max_sent, full_layers)
        best = min(
            (t for piece in pieces for t in (search.back(piece), search.front(piece)) if t is not None),
            default=None,
        )
        if best is None:
            break
        moved = _trade(fill, a, *best[1:])
        load[a] -= moved
        load[best[3]] += moved
        x, y = best[1], best[2]
        for gone in ([(x.length, x.doc, a)] if x.start == 0 else []) + [(y.length, y.doc, best[3])]:
            i = bisect_right(whole, gone) - 1  # no longer whole
            del whole[i], lens[i]
        moves += 1
    return moves


class _PartnerSearch:
    """The cheapest trade for the busiest rank `a`, partner by partner (see `rebalance`).

    A trade is (key, x piece on a, y on b, b, front, tokens moved); the key orders trades by
    the largest send buffer they leave, then by the sent tokens they add. `need` and the room
    of partners are counted in causal pairs of one full layer (workload / `full_layers`).
    """

    def __init__(self, whole, lens, a, need, goal, load, sent, max_sent, full_layers) -> None:
        self.whole, self.lens, self.a, self.need, self.goal = whole, lens, a, need / full_layers, goal
        self.load, self.sent, self.max_sent, self.top = load, sent, max_sent, max(sent)
        self.full_layers = full_layers

    def _partners(self, index: int, step: int):
        """Whole documents of ranks with room for `need`, from `index` on in direction `step`."""
        whole, found = self.whole, 0
        while 0 <= index < len(whole) and found < PARTNER_SCAN:
            ly, y, b = whole[index]
            index += step
            room = (self.goal - self.load[b]) / self.full_layers
            if b != self.a and room >= self.need:
                found += 1
                yield ly, y, b, room

    def _keyed(self, x, y, ly, b, front, t, cost_a, cost_b):
        sent = self.sent
        if max(sent[self.a] + cost_a, sent[b] + cost_b) > self.max_sent:
            return None
        key = (max(self.top, sent[self.a] + cost_a, sent[b] + cost_b), cost_a + cost_b, x.doc, y, front)
        return key, x, Shard(y, 0, ly), b, front, t

    def back(self, x: Shard):
        """Best back trade: t tokens from x's end move t (e - |y|), so |y| <= e - need / t."""
        e = x.start + x.length
        if e * e < 4 * self.need:  # t (e - |y|) with t <= |y| peaks at |y| = e / 2
            return None
        best = None
        root = math.sqrt(e * e - 4 * self.need)
        for ly, y, b, room in self._partners(bisect_right(self.lens, min(e - 1, (e + root) / 2)) - 1, -1):
            if ly < (e - root) / 2 - 1:
                break
            t = min(ly, x.length - 1, int(room // (e - ly)))
            if t <= 0 or t * (e - ly) < self.need:
                continue
            found = self._keyed(x, y, ly, b, False, t, x.length - t, ly - t)
            if found is not None and (best is None or found[0] < best[0]):
                best = found
        return best

    def front(self, x: Shard):
        """Best front trade: d tokens from x's start move d (s - |y| + d) <= |y| s, so |y| >= need / s."""
        s = x.start
        if s * (x.length - 1) < self.need:
            return None
        best = None
        for ly, y, b, room in self._partners(bisect_left(self.lens, self.need / s), 1):
            cap = min(ly, x.length - 1)
            # Largest d with d (s - ly + d) <= room.
            c = s - ly
            d = min(cap, int((-c + math.sqrt(c * c + 4 * room)) / 2))
            if d <= 0 or d * (c + d) < self.need:
                continue
            found = self._keyed(x, y, ly, b, True, d, 0, ly)
            if found is not None and (best is None or found[0] < best[0]):
                best = found
        return best


def _trade(fill: RankFill, a: int, x: Shard, y: Shard, b: int, front: bool, t: int) -> int:
    """Apply a trade (see `rebalance`); returns the workload moved from a to b."""
    g = y.length - t  # y's head, kept (and sent) by b
    if front:
        gives, keeps = Shard(x.doc, x.start, t), Shard(x.doc, x.start + t, x.length - t)
    else:
        gives, keeps = Shard(x.doc, x.start + x.length - t, t), Shard(x.doc, x.start, x.length - t)
    fill.shards[a] = [s for s in fill.shards[a] if s != x] + [keeps, Shard(y.doc, g, t)]
    fill.shards[b] = [s for s in fill.shards[b] if s != y] + [gives] + ([Shard(y.doc, 0, g)] if g else [])
    moved = fill.workload.shard(gives.start, t) - fill.workload.shard(g, t)
    fill.work[a] -= moved
    fill.work[b] += moved
    if front:
        fill.sent[b] += t + g
    else:
        fill.sent[a] += keeps.length
        fill.sent[b] += g
    return moved

