"""Balance one optimizer step's documents over the DP x micro-batch windows of the whole mesh.

FlashCP balances attention inside a CP group; a training step still waits for the slowest data-
parallel rank, and FSDP synchronises the DP ranks at every micro step. With windows packed in
stream order, the one that draws a long document costs several times the mean (attention grows
with the square of a document's length, dense work only with its tokens). `balance_step` keeps the
step's documents -- the same tokens sequential packing would train in this step -- and moves them
between the step's windows so that every window's predicted cost is close to the mean:

1. Cap: a document so long that its attention alone would put a window above `max_imbalance` x
   the mean is cut into equal pieces below that length, like the cut sequential packing makes at
   every window's end (each piece attends within itself). With `max_imbalance=None` only pieces
   longer than a window are cut, and a step with one dominant document stays unbalanced.
2. The longest pieces, one by one, go to the cheapest window that still has room for them (LPT
   scheduling with token capacities); a piece that fits nowhere fills the roomiest window and its
   rest goes back into the queue.
3. The many short pieces left (together under 0.5 % of the attention) fill the remaining room in
   stream order, cut where a window is full: one vectorised pass.
4. Windows go to (micro step, DP rank) from the most to the least expensive, snaking over the
   ranks, so that each micro step and each rank's sum are balanced.

Every rank computes the same result from the document lengths alone (no randomness, ties broken by
index), so no communication is needed: a few ms for a DP = 64 step.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

REST_SHARE = 0.005  # the short pieces filled in stream order hold at most this share of the attention
GREEDY_PER_WINDOW = 64  # and at most this many pieces per window are placed one by one


class Piece(NamedTuple):
    """A contiguous piece of one of the step's documents."""

    doc: int  # index into the step's doc_lens
    start: int  # offset of the piece inside that document
    length: int


@dataclass(frozen=True)
class WindowCost:
    """Predicted cost of one window per rank of its CP group (FLOPs): dense work plus attention."""

    dense_per_token: float
    attn_per_pair: float  # per (query, key) pair a causal document mask keeps
    cp: int = 1

    @classmethod
    def llama(cls, params: float, dim: int, n_layers: int, cp: int) -> WindowCost:
        """Forward + backward of a Llama: 6 FLOPs per parameter and token, 12 d L per attended pair."""
        return cls(6.0 * params, 12.0 * dim * n_layers, cp)

    def __call__(self, doc_lens: Sequence[int]) -> float:
        """The window's work spread evenly over its CP group (what FlashCP plans for)."""
        lens = np.asarray(doc_lens, dtype=np.float64)
        return (self.dense_per_token * float(lens.sum()) + self.attn_per_pair * _pairs(lens)) / self.cp


def _pairs(lens: np.ndarray) -> float:
    return float((lens * (lens + 1) / 2).sum())


def stream_windows(doc_lens: Sequence[int], window: int) -> list[list[int]]:
    """The baseline: the step's documents packed in stream order, each cut where a window ends."""
    out, cur, room = [], [], window
    for n in doc_lens:
        while n:
            take = min(n, room)
            cur.append(take)
            n, room = n - take, room - take
            if not room:
                out.append(cur)
                cur, room = [], window
    return out


def length_cap(lens: np.ndarray, n_windows: int, window: int, cost: WindowCost, max_imbalance: float) -> int:
    """The longest piece whose attention keeps its window within `max_imbalance` x the mean cost.

    The mean falls as long documents are cut, so the cap is found by a few fixed-point rounds.
    """
    cap = window
    for _ in range(4):
        k = np.ceil(lens / cap)
        piece = lens / k  # documents longer than the cap become k equal pieces
        pairs = float((k * piece * (piece + 1) / 2).sum())
        mean = cost.dense_per_token * window + cost.attn_per_pair * pairs / n_windows
        room = max_imbalance * mean - cost.dense_per_token * window
        new = int(min(window, max(1, math.sqrt(2 * max(room, 0) / cost.attn_per_pair))))
        if new == cap:
            break
        cap = new
    return cap


def balance_step(
    doc_lens: Sequence[int],
    dp: int,
    micro: int,
    window: int,
    cost: WindowCost,
    max_imbalance: float | None = 1.05,
) -> list[list[list[Piece]]]:
    """The step's documents (stream order, summing to dp * micro * window tokens) as pieces in
    windows `[dp rank][micro step]`, each exactly `window` tokens, every token once."""
    lens = np.asarray(doc_lens, dtype=np.int64)
    n_windows = dp * micro
    if dp < 1 or micro < 1 or window < 1:
        raise ValueError(f"dp, micro and window must be >= 1, got {dp}, {micro}, {window}")
    if lens.size and lens.min() < 1:
        raise ValueError("document lengths must be >= 1")
    if int(lens.sum()) != n_windows * window:
        raise ValueError(f"the step's documents hold {int(lens.sum())} tokens, not dp x micro x window = "
                         f"{n_windows * window}")  # fmt: skip
    # The capped piece's window also takes short documents: aim the cap at half the tolerance.
    cap = window if max_imbalance is None else length_cap(lens, n_windows, window, cost, (1 + max_imbalance) / 2)

    windows: list[list[Piece]] = [[] for _ in range(n_windows)]
    room = np.full(n_windows, window, dtype=np.int64)
    pairs = np.zeros(n_windows, dtype=np.float64)

    def put(w: int, piece: Piece) -> None:
        windows[w].append(piece)
        room[w] -= piece.length
        pairs[w] += piece.length * (piece.length + 1) / 2

    # 1. Documents longer than the cap: equal pieces of at most `cap` tokens.
    pieces: list[Piece] = []
    for doc in np.flatnonzero(lens > cap).tolist():
        n = int(lens[doc])
        k = -(-n // cap)
        bounds = [n * i // k for i in range(k + 1)]
        pieces += [Piece(doc, a, b - a) for a, b in zip(bounds, bounds[1:])]
    short = np.flatnonzero(lens <= cap)

    # 2. The longest pieces, one by one, into the cheapest window with room (LPT).
    order = np.argsort(-lens[short], kind="stable")
    sorted_lens = lens[short][order].astype(np.float64)
    suffix = np.cumsum((sorted_lens * (sorted_lens + 1) / 2)[::-1])[::-1]  # pairs of the pieces from i on
    enough = int(np.searchsorted(-suffix, -REST_SHARE * suffix[0])) if len(short) else 0
    n_greedy = max(0, min(enough, GREEDY_PER_WINDOW * n_windows - len(pieces)))
    greedy = pieces + [Piece(int(d), 0, int(lens[d])) for d in short[order[:n_greedy]]]
    queue = [(-p.length, i, p) for i, p in enumerate(greedy)]
    heapq.heapify(queue)
    while queue:
        _, tie, piece = heapq.heappop(queue)
        fits = room >= piece.length
        if fits.any():
            put(int(np.argmin(np.where(fits, pairs, np.inf))), piece)
            continue
        w = int(np.argmax(room))  # fits nowhere: fill the roomiest window, the rest goes back
        head = int(room[w])
        put(w, Piece(piece.doc, piece.start, head))
        rest = Piece(piece.doc, piece.start + head, piece.length - head)
        heapq.heappush(queue, (-rest.length, tie, rest))

    # 3. The short rest, in stream order, into the remaining room, cut where a window is full.
    rest = np.sort(short[order[n_greedy:]])
    if rest.size:
        ends = np.cumsum(lens[rest])
        starts = ends - lens[rest]
        bounds = np.cumsum(room)  # where each window's remaining room ends, in the rest's tokens
        first = np.searchsorted(bounds, starts, side="right")
        last = np.searchsorted(bounds, ends - 1, side="right")
        for doc, a, b, w, w_last in zip(rest.tolist(), starts.tolist(), ends.tolist(), first.tolist(),
                                        last.tolist()):  # fmt: skip
            if w == w_last:
                windows[w].append(Piece(doc, 0, b - a))
                continue
            offset = a
            while offset < b:  # crosses a window end: cut there
                take = min(b, int(bounds[w])) - offset
                if take:  # a window with no room left is passed over
                    windows[w].append(Piece(doc, offset - a, take))
                offset, w = offset + take, w + 1
        room[:] = 0

    # 4. Most expensive windows first, snaking over the ranks micro step by micro step.
    costs = [cost([p.length for p in w]) for w in windows]
    ranked = sorted(range(n_windows), key=lambda w: (-costs[w], w))
    out: list[list[list[Piece]]] = [[[] for _ in range(micro)] for _ in range(dp)]
    for k, w in enumerate(ranked):
        m, r = divmod(k, dp)
        out[r if m % 2 == 0 else dp - 1 - r][m] = sorted(windows[w])
    return out
