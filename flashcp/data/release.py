"""Which waiting documents a deferral step trains: the release choice of `flashcp.data.deferral`.

A step balances without cuts only when each window holds similar long-document work. The choice
fills the windows longest document first up to a "level" of long-document work per window
(`_fill`) and takes the highest level whose windows stay within the aimed max / mean; documents
whose delay reached its bound are released whatever the balance (forced), and what they leave
unbalanced the layout cuts (`deferral-cut`).

The aim is relative to the mean of the step as released, not to that of a step of short documents:
a step that gathers many long documents has a mean several times higher, so its windows may differ
by as many more pairs. Measured against the short documents' mean, a release of 64 similar long
documents looked as unbalanced as one outlier, and long documents waited until forced out together
with whatever else fit under their level, a step the layout could only balance by cutting most of
them (wlbllm 128K DP 8, seed 1: 91 % of stream packing's pairs kept; 98 % with the relative aim).

When no level is within the aim and documents are forced, the layout (`layout_step`) will cut the
step's longest documents to a cap, and which documents go decides how much that cut loses. Filling
up to the forced documents' level stacks long documents in every window (a step of ~100 long
documents, nearly every window 0.9 C of them, cut to 0.4 C: 65 % of stream packing's pairs);
releasing only the forced ones leaves the step's mean low and cuts them short. So each candidate
level is priced: the pairs its documents keep after the cut net of `KEEP_SHARE` of what stream
packing would have kept of them (what a document held back may expect later), and the best is
released. Levels are ranked with a vectorised estimate of the fill (each document under the level
while the windows' total load and tokens allow) and the cut `length_cap` predicts; the best `EXACT`
of them and the forced documents' own level are filled exactly and priced by the cut the layout
makes of the step the stream walk will build (`layout_step`). The prediction assumes one capped
piece per window; where the capped pieces outnumber the windows, those holding two are over the
bound and the layout cuts further (a ProLong-like step at 128K / DP 64 of 33 window-long pieces and
12 documents of 100K+: cap 64K predicted, 49K made, 56 % of stream packing's pairs kept), so
ranking the finalists by the prediction chose such releases.
"""

from __future__ import annotations

import heapq
from typing import NamedTuple

import numpy as np

from flashcp.data.balance import CAP_SHARE, layout_step, length_cap, weight, WindowCost

LEVELS = 12  # candidate levels per step (the largest pool documents, geometrically spaced; bisected)
KEEP_SHARE = 0.75  # a forced step prices its cut against this share of stream packing's pairs
EXACT = 1  # levels of a forced step, the best by the estimate, filled exactly and priced by the layout's cut
PRICE_ROUNDS = 16  # the predicted cap's fixed-point rounds: to where it settles (see `_Price`)


class StepAim(NamedTuple):
    """What a release is measured against: the step's windows, its short documents, the aim."""

    n_windows: int
    window: int
    density: float  # pairs per token of the step's short documents
    base: float  # a window of short documents only, in attended pairs (dense work included)
    tolerance: float  # max / mean - 1 aimed at
    short: np.ndarray  # the stream's short documents that fill the step (what the layout's cap counts)
    cost: WindowCost
    # Per pool document, the short documents' tokens before it in the stream (-1: a waiting one,
    # trained first). The step walks the stream in order, so a released one is trained only if the
    # short ones before it leave room (None: all are).
    short_before: np.ndarray | None = None


def _fill(order: np.ndarray, lens: np.ndarray, w: np.ndarray, forced: np.ndarray, n_windows: int, window: int,
          level: float) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """Documents in `order`, each into the least loaded window with room, if it stays within
    `level` (forced ones always): (released mask, window loads)."""
    room, load = np.full(n_windows, window, dtype=np.int64), np.zeros(n_windows)
    heap = [(0.0, k) for k in range(n_windows)]
    released = np.zeros(lens.size, dtype=bool)
    shortest = int(lens.min()) if lens.size else 0  # a window with less room takes no more
    for i in order.tolist():
        n, parked = int(lens[i]), []
        while heap and room[heap[0][1]] < n:  # windows too full for this document
            parked.append(heapq.heappop(heap))
        if heap and (forced[i] or heap[0][0] + w[i] <= level):
            k = heapq.heappop(heap)[1]
        elif forced[i]:  # fits nowhere whole: the roomiest window (balance_step cuts it)
            k = int(np.argmax(room))
            heap = [h for h in heap if h[1] != k]
            parked = [h for h in parked if h[1] != k]
            heapq.heapify(heap)
        else:
            for h in parked:
                heapq.heappush(heap, h)
            continue
        released[i] = True
        room[k] -= min(n, int(room[k]))
        load[k] += w[i]
        for h in parked:
            heapq.heappush(heap, h)
        if room[k] >= shortest:
            heapq.heappush(heap, (float(load[k]), k))
    return released, load


def _balanced(load: np.ndarray, aim: StepAim) -> bool:
    """Max / mean of the windows' predicted cost within the aim (load: pairs above `aim.base`)."""
    return float(load.max() - load.mean()) <= aim.tolerance * (aim.base + float(load.mean()))


def choose_release(lens: np.ndarray, reference: np.ndarray, forced: np.ndarray, aim: StepAim) -> np.ndarray:
    """Which pool documents (`reference`: the pairs stream packing keeps of each) the step trains:
    the forced ones, then, longest first, those that fit under the highest level whose windows stay
    within the aim; when none is and some are forced, under the level whose cut costs least."""
    n_windows, window = aim.n_windows, aim.window
    w = weight(lens.astype(np.float64), aim.density)
    order = np.lexsort((np.arange(lens.size), -lens, ~forced))
    n_forced = int(forced.sum())
    _, load = _fill(order[:n_forced], lens, w, forced, n_windows, window, 0.0)
    # Up to the forced documents' level, or to the slack, a document never makes the step worse.
    slack = aim.tolerance * aim.base
    floor, forced_load = max(float(load.max()), slack), float(load.sum())
    free = order[n_forced:]
    picks = np.unique(np.geomspace(1, max(free.size, 1), LEVELS).astype(int) - 1)
    levels = sorted({float(w[free].clip(0).sum()) / n_windows, *w[free[picks]].tolist()}
                    if free.size else set(), reverse=True)  # fmt: skip
    # The highest level within the aim, by bisection (a lower level releases less long work, so
    # the aim is met from some level down, nearly always): 4 fills instead of up to LEVELS.
    levels0, levels = levels, [level for level in levels if level > floor]
    if levels:  # the top level: every window one of the longest pieces (window-long ones gathered)
        released, load = _fill(order, lens, w, forced, n_windows, window, levels[0])
        if _balanced(load, aim):
            return released
    best, lo, hi = None, 1, len(levels)  # levels[hi:] meet the aim (as far as bisection assumes)
    while lo < hi:
        mid = (lo + hi) // 2
        released, load = _fill(order, lens, w, forced, n_windows, window, levels[mid])
        if _balanced(load, aim):
            best, hi = released, mid
        else:
            lo = mid + 1
    if best is not None:
        return best
    if not n_forced:  # nothing is cut: what stays within the slack
        return _fill(order, lens, w, forced, n_windows, window, floor)[0]
    price = _Price(lens, reference, aim)
    free_w, free_n = w[free], lens[free]
    room = n_windows * window - int(lens[forced].sum())
    estimates = []
    for level in sorted({floor, *levels0}):
        under = free_w <= level
        under &= np.cumsum(np.where(under, free_w.clip(0), 0)) <= n_windows * level - forced_load
        under &= np.cumsum(np.where(under, free_n, 0)) <= room
        released = forced.copy()
        released[free[under]] = True
        estimates.append((price(released), level))
    # The forced documents' own level too: the prediction undervalues it most (it stacks long
    # documents, which the prediction cuts as if each had its own window).
    best_levels = {floor, *(level for _, level in sorted(estimates)[-EXACT:])}
    fills = {}  # levels that release the same documents are laid out once
    for level in best_levels:
        released = _fill(order, lens, w, forced, n_windows, window, level)[0]
        fills.setdefault(released.tobytes(), released)
    if len(fills) == 1:
        return released
    return max(fills.values(), key=price.layout)


class _Price:
    """What releasing a set of pool documents is worth in a step that will be cut: the attended
    pairs they keep after the predicted cap, net of `KEEP_SHARE` of stream packing's.

    The cap is iterated to where it settles: the layout's few rounds may stop high on a slow
    descent, but a release whose cap settles low cannot be packed within the bound at the high
    one either (a wlbllm 128K DP 64 release priced at a cap near 0.7 C was cut to 0.36 C, keeping
    57 % of stream packing's pairs where a lower level kept 116 %)."""

    def __init__(self, lens: np.ndarray, reference: np.ndarray, aim: StepAim):
        self.lens, self.reference, self.aim = lens, reference, aim
        short = aim.short.astype(np.float64)
        self.ends, self.pairs = np.cumsum(short), np.cumsum(short * (short + 1) / 2)  # of the first k
        self.rank = np.argsort(aim.short, kind="stable")  # the short ones ascending, by stream index

    def __call__(self, released: np.ndarray) -> float:
        """The short documents that fill the rest of the step are the stream's next ones (a prefix)."""
        a, lens = self.aim, self.lens[released]
        k = self._fillers(int(lens.sum()))
        # The step's shortest documents fill the capped windows: two sorted runs, merged in linear time.
        fillers = np.sort(np.concatenate((a.short[self.rank[self.rank < k]], np.sort(lens))), kind="stable")
        cap = length_cap(lens, a.n_windows, a.window, a.cost, 1 + CAP_SHARE * a.tolerance,
                         float(self.pairs[k - 1]) if k else 0.0, fillers, PRICE_ROUNDS)  # fmt: skip
        full, rest = np.divmod(lens.astype(np.float64), cap)
        kept = float((full * (cap * (cap + 1) / 2) + rest * (rest + 1) / 2).sum())
        return kept - KEEP_SHARE * float(self.reference[released].sum())

    def _fillers(self, released_tokens: int) -> int:
        """How many of the stream's short documents fill the rest of the step (the last one cut)."""
        need = self.aim.n_windows * self.aim.window - released_tokens
        return min(int(np.searchsorted(self.ends, need)) + 1, self.ends.size) if need > 0 else 0

    def layout(self, released: np.ndarray) -> float:
        """The same price with the cut the layout makes of the step the release gives. That step is
        built as `Deferral` walks the stream: the released waiting documents, then the stream in order,
        short documents and released ones while the step has room (one the short documents before it
        left no room for waits again, and keeps nothing now), the last short one cut; where the span
        holds too few short documents, they repeat (the stream's next ones are drawn alike)."""
        a = self.aim
        taken = released.copy()
        if a.short_before is not None:
            need = a.n_windows * a.window - int(self.lens[released & (a.short_before < 0)].sum())
            order = np.flatnonzero(released & (a.short_before >= 0))
            for i in order[np.argsort(a.short_before[order], kind="stable")].tolist():
                if int(a.short_before[i]) >= need or self.lens[i] > need - int(a.short_before[i]):
                    taken[i] = False
                else:
                    need -= int(self.lens[i])
        lens = self.lens[taken]
        need = a.n_windows * a.window - int(lens.sum())
        if need > 0 and not a.short.size:
            return self(released)
        short = np.zeros(0, dtype=np.int64)
        if need > 0:
            short = np.resize(a.short, a.short.size * -(-need // int(self.ends[-1])))
            short = short[: int(np.searchsorted(np.cumsum(short), need)) + 1]
            short[-1] -= int(short.sum()) - need
        layout = layout_step(np.concatenate((lens, short)), a.n_windows, 1, a.window, a.cost, 1 + a.tolerance)
        pieces = layout.length[layout.doc < lens.size].astype(np.float64)
        return float((pieces * (pieces + 1) / 2).sum()) - KEEP_SHARE * float(self.reference[taken].sum())
