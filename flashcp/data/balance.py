"""Balance one optimizer step's documents over the DP x micro-batch windows of the whole mesh.

FlashCP balances attention inside a CP group; a training step still waits for the slowest data-
parallel rank, and FSDP synchronises the DP ranks at every micro step. With windows packed in
stream order, the one that draws a long document costs several times the mean (attention grows
with the square of a document's length, dense work only with its tokens). `balance_step` keeps the
step's documents -- the same tokens sequential packing would train in this step -- and moves them
between the step's windows so that every window's predicted cost is close to the mean:

1. Cap: a document so long that its attention would put its window above the aimed share of
   `max_imbalance` x the mean is cut into pieces of the cap from its head on and one shorter rest,
   like the cut sequential packing makes at a window's end (each piece attends within itself;
   fewer, longer pieces keep more attended pairs than equal ones). The cap counts the shortest
   documents that will fill the rest of such a window (`length_cap`). With `max_imbalance=None`
   only pieces longer than a window are cut, and a step with one dominant document stays
   unbalanced.
2. The longest pieces (all but those holding the last 0.5 % of the attention, at most 64 per
   window), one by one, go to the least loaded window that has room for them (LPT scheduling with
   token capacities, `lpt`); once that window is at the mean load, the piece is left to step 3, so
   a window made heavy by one long piece is not given more long ones.
3. The short pieces, shortest first, fill the remaining room of the windows from the most to the
   least loaded, cut where a window is full: one vectorised pass (`fill`).
   If a window still ends above most of the tolerance (a long uncut document whose window got
   longer short pieces than the cap predicted), the cap is tightened to that window's longest
   piece and the step is packed again (at most `RETRIES` times: a step whose forced deferred
   documents arrive without company may need several; it stops when two passes in a row do not
   improve the worst window, and the best pass is kept; a step still above the tolerance then tries
   lower caps, `SCAN_STEP` apart, until one is within it). A pass within the tolerance whose cuts
   lose more than `GROW_LOSS` of the pairs and whose capped pieces outnumber the windows is tried
   once more with a cap halfway to the longest document (the cap's estimate assumes every long
   document cut, which then lowers the mean it aims at, so it can fall far too low).
   Given the least attended pairs the step must keep (`min_pairs`: deferral-cut's floor of stream
   packing's pairs), a step whose cuts keep fewer is packed at the most balanced of the caps that
   keep them (`keep_pairs`), however unbalanced that leaves it.
4. Windows go to (micro step, DP rank) from the most to the least expensive, snaking over the
   ranks, so that each micro step and each rank's sum are balanced.

Each rank builds only its own windows' pieces (`layout_step(...).rank(r)`). Pieces are a
`NamedTuple` (immutable, ordered, field access like a frozen dataclass) because a
step at DP = 64 holds ~20K of them and a tuple is built in half the time.

Every rank computes the same result from the document lengths alone (no randomness, ties broken by
index), so no communication is needed: 4-40 ms for a DP = 64 step on one core.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import heapq
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

REST_SHARE = 0.005  # the short pieces poured in step 3 hold at most this share of the attention
GREEDY_PER_WINDOW = 64  # and at most this many pieces per window are placed one by one
CAP_SHARE = 0.8  # a capped piece's window aims at this share of the tolerated imbalance
RETRY_SHARE = 0.9  # a step with a window above this share of it is packed again with a tighter cap
RETRIES = 8
GROW_LOSS = 0.2  # a cap within the bound that cuts away this share of the pairs tries a larger one
SCAN, SCAN_STEP = 8, 0.92  # a step the retries left above the bound tries SCAN caps, each this share lower
KEEP_STEP = 1 / 64  # a cap that keeps a step's least pairs is found to within this share of a window


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


def length_cap(lens: np.ndarray, n_windows: int, window: int, cost: WindowCost, max_imbalance: float,
               other_pairs: float = 0.0, fillers: np.ndarray | None = None,
               rounds: int = 8) -> int:  # fmt: skip
    """The longest piece that keeps its window within `max_imbalance` x the mean cost.

    Documents longer than the cap are cut into pieces of the cap and one shorter rest (`cut_long`),
    which keeps more attended pairs than equal pieces would. The rest of a capped piece's window
    holds the step's shortest pieces (`fill`), whose pairs per token are counted. Cutting lowers
    the mean and changes how many windows hold a capped piece, so the cap is found by a few
    fixed-point rounds (`rounds`; the layout's 8 may stop on the way down, and its retries correct).
    A caller predicting the cap of a step not yet made may pass only its long documents as `lens`,
    the short ones' pairs as `other_pairs` and the step's lengths, ascending, as `fillers`.
    """
    ascending = np.sort(lens) if fillers is None else fillers
    tokens, pairs_upto = np.cumsum(ascending), np.cumsum(ascending * (ascending + 1) / 2)
    cap = window
    for _ in range(rounds):
        full, rest = np.divmod(lens, cap)
        pairs = other_pairs + float((full * (cap * (cap + 1) / 2) + rest * (rest + 1) / 2).sum())
        mean = cost.dense_per_token * window + cost.attn_per_pair * pairs / n_windows
        room = (max_imbalance * mean - cost.dense_per_token * window) / cost.attn_per_pair
        # The shortest documents fill the rest of the capped windows, the last of them the longest:
        # its pairs per token.
        n_capped = min(int(full.sum()), n_windows)
        lo, hi = np.searchsorted(tokens, [(n_capped - 1) * (window - cap), n_capped * (window - cap)])
        lo, hi = min(int(lo), ascending.size - 1), min(int(hi), ascending.size - 1)
        if hi > lo:
            density = float((pairs_upto[hi] - pairs_upto[lo]) / (tokens[hi] - tokens[lo]))
        else:  # one document spans it
            density = float((ascending[hi] + 1) / 2)
        # the largest cap with cap (cap + 1) / 2 + density (window - cap) <= room
        b = 0.5 - density
        new = int(min(window, max(1, -b + math.sqrt(max(b * b - 2 * (density * window - room), 0)))))
        if new == cap:
            break
        cap = new
    return cap


def weight(n: int | np.ndarray, density: float) -> float | np.ndarray:
    """A long piece's load on its window: its attended pairs net of those of the short pieces it
    displaces (`density` pairs per token), since every window ends up full."""
    return n * (n + 1) / 2 - density * n


def cut_long(lens: np.ndarray, cap: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The step's pieces as (doc, start, length) arrays in stream order: a document longer than
    `cap` becomes pieces of `cap` tokens from its head on and one shorter rest."""
    counts = -(-lens // cap)
    doc = np.repeat(np.arange(lens.size), counts)
    first = np.cumsum(counts) - counts
    start = (np.arange(doc.size) - first[doc]) * cap
    return doc, start, np.minimum(cap, lens[doc] - start)


def lpt(lengths: list[int], density: float, n_windows: int, window: int) -> list[tuple[int, int, int, int]]:
    """Longest first (`lengths` is sorted), each piece into the window of least load (`weight`)
    that has room for it. A piece that fits nowhere fills the roomiest window and its rest goes back
    into the queue; one whose best window is already at the mean load is left to the short pieces
    (window -1), so that a window made heavy by one long piece is filled with the shortest ones.
    Returns (piece, offset, length, window) parts."""
    room, load = [window] * n_windows, [0.0] * n_windows
    target = float(weight(np.asarray(lengths, dtype=np.float64), density).sum()) / n_windows
    open_ = [(0.0, w) for w in range(n_windows)]  # (load, window) of windows with room for the piece
    parked: list[tuple[int, int]] = []  # (-room, window) of windows too full for it (pieces only shrink)
    rests: list[tuple[int, int, int]] = []  # (-length, piece, offset) of rests that fitted nowhere
    out, k, count = [], 0, len(lengths)
    while k < count or rests:  # the pieces (sorted) merged with the rests, longest first
        if rests and (k == count or rests[0] < (-lengths[k], k, 0)):
            neg, i, offset = heapq.heappop(rests)
            n = -neg
        else:
            n, i, offset = lengths[k], k, 0
            k += 1
        while parked and -parked[0][0] >= n:
            w = heapq.heappop(parked)[1]
            heapq.heappush(open_, (load[w], w))
        while open_ and room[open_[0][1]] < n:
            w = heapq.heappop(open_)[1]
            heapq.heappush(parked, (-room[w], w))
        if open_ and open_[0][0] >= target:
            out.append((i, offset, n, -1))
            continue
        if open_:
            w = heapq.heappop(open_)[1]
        else:  # fits nowhere: fill the roomiest window, the rest goes back
            w = heapq.heappop(parked)[1]
            heapq.heappush(rests, (room[w] - n, i, offset + room[w]))
            n = room[w]
        out.append((i, offset, n, w))
        room[w] -= n
        load[w] += n * (n + 1) / 2 - density * n  # weight(n, density), inlined: ~4K pieces per step
        if room[w]:
            heapq.heappush(open_, (load[w], w))
    return out


def fill(doc: np.ndarray, start: np.ndarray, length: np.ndarray, room: np.ndarray,
         load: np.ndarray) -> tuple[np.ndarray, ...]:  # fmt: skip
    """The short pieces poured into the windows' remaining room, shortest first into the most
    loaded window, cut where a window is full: (window, doc, start, length) arrays."""
    by_load = np.lexsort((np.arange(load.size), -load))
    ends = np.cumsum(length)
    bounds = np.cumsum(room[by_load])  # where each window's room ends, in the short pieces' tokens
    cuts = np.union1d(ends, bounds[bounds > 0])  # a window with no room left takes nothing
    seg_start = np.concatenate(([0], cuts))[:-1]
    piece = np.searchsorted(ends, seg_start, side="right")
    offset = seg_start - (ends - length)[piece]
    win = by_load[np.searchsorted(bounds, seg_start, side="right")]
    return win, doc[piece], start[piece] + offset, cuts - seg_start


def cut_loss(lens: np.ndarray, cap: int) -> float:
    """Share of the documents' attended pairs that cutting them at `cap` (`cut_long`) loses."""
    full, rest = np.divmod(lens, cap)
    kept = float((full * (cap * (cap + 1) / 2) + rest * (rest + 1) / 2).sum())
    return 1 - kept / _pairs(lens.astype(np.float64))


def _kept(packed: tuple[np.ndarray, ...]) -> float:
    """Attended pairs of packed pieces."""
    return _pairs(packed[3].astype(np.float64))


def keep_pairs(lens: np.ndarray, cap: int, n_windows: int, window: int, need: float,
               dense: float) -> tuple[tuple[np.ndarray, ...], int]:  # fmt: skip
    """The most balanced packing at a cap above `cap` whose pieces keep at least `need` attended
    pairs (the uncapped one where none does), and that cap. The packing cuts more than the cap
    predicts (a capped piece that fits no window whole, short pieces where a window ends), so the
    cap is bisected on the pairs of actual packings, from the lowest the cut alone allows (the
    pairs it keeps never fall as the cap grows) to within `KEEP_STEP` of a window; every packing
    tried that keeps `need`, and the uncapped one, is a candidate. The lowest such cap is not
    always the most balanced: where its pieces outnumber the windows, a window holding two of them
    can be worse than the step with only window-long cuts."""
    top, long = int(min(window, lens.max())), lens[lens > cap].astype(np.float64)
    short = _pairs(lens[lens <= cap].astype(np.float64))

    def cut_kept(c: int) -> float:  # the pairs of the documents over `cap` only change
        full, rest = np.divmod(long, c)
        return short + float((full * (c * (c + 1) / 2) + rest * (rest + 1) / 2).sum())

    lo, hi = cap, top
    while hi - lo > 1:  # the lowest cap the cut alone allows: no packing keeps more there
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if cut_kept(mid) >= need else (mid, hi)
    lo, kept = hi - 1, {top: pack(lens, top, n_windows, window)}
    while True:
        if hi not in kept:
            kept[hi] = pack(lens, hi, n_windows, window)
        top, lo = (hi, lo) if _kept(kept[hi]) >= need else (top, hi)
        if top - lo <= KEEP_STEP * window:
            break
        hi = (lo + top) // 2
    found = [(_ratio(p, n_windows, dense), -c, c) for c, p in kept.items() if _kept(p) >= need]
    c = min(found)[2] if found else max(kept)
    return kept[c], c


def _ratio(packed: tuple[np.ndarray, ...], n_windows: int, dense: float) -> float:
    """Predicted max / mean window cost of packed pieces (`dense`: a window's dense work in pairs)."""
    w_pairs = np.bincount(packed[0], packed[3] * (packed[3] + 1) / 2, n_windows)
    return float((dense + w_pairs.max()) / (dense + w_pairs.mean()))


def pack(lens: np.ndarray, cap: int, n_windows: int, window: int) -> tuple[np.ndarray, ...]:
    """Steps 1-3 of `balance_step` for one cap: (window, doc, start, length) arrays of the pieces."""
    # 1. Cut: pieces of at most `cap` tokens, longest first.
    doc, start, length = cut_long(lens, cap)
    order = np.argsort(-length, kind="stable")
    pairs = length[order] * (length[order] + 1) / 2
    suffix = np.cumsum(pairs[::-1])[::-1]  # pairs of the pieces from i on
    enough = int(np.searchsorted(-suffix, -REST_SHARE * suffix[0]))
    n_big = min(enough, GREEDY_PER_WINDOW * n_windows)
    big, rest = order[:n_big], order[n_big:]
    density = float((length[rest] * (length[rest] + 1) / 2).sum()) / max(int(length[rest].sum()), 1)

    # 2. Long pieces: LPT with token capacities.
    parts = np.array(lpt(length[big].tolist(), density, n_windows, window), dtype=np.int64).reshape(-1, 4)
    p_doc, p_start, p_len = doc[big][parts[:, 0]], start[big][parts[:, 0]] + parts[:, 1], parts[:, 2]
    placed, p_win = parts[:, 3] >= 0, parts[:, 3]
    short = [np.concatenate((c[~placed], c_rest[rest])) for c, c_rest in ((p_doc, doc), (p_start, start),
                                                                         (p_len, length))]  # fmt: skip
    p_doc, p_start, p_len, p_win = p_doc[placed], p_start[placed], p_len[placed], p_win[placed]

    # 3. Short pieces fill the rest of the room, the shortest where the predicted load is highest
    # (the short pieces' pairs per token now counting those LPT left to them).
    room = window - np.bincount(p_win, p_len, n_windows).astype(np.int64)
    density = float((short[2] * (short[2] + 1) / 2).sum()) / max(int(short[2].sum()), 1)
    load = np.bincount(p_win, p_len * (p_len + 1) / 2, n_windows) + density * room
    shortest = np.lexsort((short[1], short[0], short[2]))
    f_win, f_doc, f_start, f_len = fill(*(c[shortest] for c in short), room, load)
    columns = ((p_win, f_win), (p_doc, f_doc), (p_start, f_start), (p_len, f_len))
    return tuple(np.concatenate(c) for c in columns)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector paused: a DP = 64 step allocates ~20K small tuples of ints (no
    cycles to find), and the collections they trigger added up to half a step's time at the tail."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class StepLayout(NamedTuple):
    """A balanced step as arrays: the pieces sorted by (window, doc, start), where each window's
    pieces begin, and which window each (DP rank, micro step) trains. A rank materialises only
    its own windows' pieces (`rank`): a DP = 64 step holds ~20K pieces, 64 x one rank's."""

    doc: np.ndarray
    start: np.ndarray
    length: np.ndarray
    bounds: np.ndarray  # window w's pieces are [bounds[w], bounds[w + 1])
    slot: np.ndarray  # [dp rank, micro step] -> window

    @gc_paused()
    def rank(self, r: int) -> list[list[Piece]]:
        """DP rank r's windows, one per micro step, pieces ordered by (doc, start)."""
        make = functools.partial(tuple.__new__, Piece)  # Piece._make without its Python-level call
        out = []
        for w in self.slot[r].tolist():
            a, b = int(self.bounds[w]), int(self.bounds[w + 1])
            out.append(list(map(make, zip(self.doc[a:b].tolist(), self.start[a:b].tolist(),
                                          self.length[a:b].tolist()))))  # fmt: skip
        return out

    def ranks(self) -> list[list[list[Piece]]]:
        """Every rank's windows `[dp rank][micro step]`."""
        return [self.rank(r) for r in range(self.slot.shape[0])]


@gc_paused()
def layout_step(
    doc_lens: Sequence[int],
    dp: int,
    micro: int,
    window: int,
    cost: WindowCost,
    max_imbalance: float | None = 1.05,
    min_pairs: float | None = None,
) -> StepLayout:
    """`balance_step` as arrays, no piece built (see `StepLayout`). With `min_pairs`, the cuts made
    for balance keep at least that many attended pairs (`keep_pairs`): the step is left less
    balanced rather than cut further."""
    lens = np.asarray(doc_lens, dtype=np.int64)
    n_windows = dp * micro
    if dp < 1 or micro < 1 or window < 1:
        raise ValueError(f"dp, micro and window must be >= 1, got {dp}, {micro}, {window}")
    if lens.size and lens.min() < 1:
        raise ValueError("document lengths must be >= 1")
    if int(lens.sum()) != n_windows * window:
        raise ValueError(f"the step's documents hold {int(lens.sum())} tokens, not dp x micro x window = "
                         f"{n_windows * window}")  # fmt: skip
    if max_imbalance is None:
        win, doc, start, length = pack(lens, window, n_windows, window)
    else:
        # A window the cap's prediction missed (a long uncut document whose window got longer short
        # pieces than predicted) tightens the cap to below its longest piece, and the step is packed again.
        aim = 1 + CAP_SHARE * (max_imbalance - 1)
        bound = 1 + RETRY_SHARE * (max_imbalance - 1)
        dense = cost.dense_per_token * window / cost.attn_per_pair  # a window's dense work in attended pairs
        cap, best, stalled = length_cap(lens, n_windows, window, cost, aim), None, 0
        for retry in range(RETRIES + 1):
            packed = pack(lens, cap, n_windows, window)
            win, length = packed[0], packed[3]
            w_pairs = np.bincount(win, length * (length + 1) / 2, n_windows)
            worst = int(np.argmax(w_pairs))
            ratio = (dense + w_pairs[worst]) / (dense + w_pairs.mean())
            if best is None or ratio < best[0]:
                best, stalled = (ratio, packed, cap), 0
            else:  # a tighter cap did not help; twice in a row: keep the best
                stalled += 1
                if stalled == 2:
                    break
            if retry == RETRIES or ratio <= bound:
                break
            excess = dense + w_pairs[worst] - aim * (dense + w_pairs.mean())
            longest = int(length[win == worst].max())
            cap = min(cap, max(1, int(math.sqrt(max(longest * (longest + 1) - 2 * excess, 1)))))
        # The cap may cut far more than the bound needs where its pieces outnumber the windows: then
        # they set the mean the cap aims at, and cutting lowers it (a step of ~100 released long
        # documents fell to 44K where 82K met the bound). When its cuts cost much, one pass halfway
        # to the longest document. (With fewer, the rest of the windows set the mean: no retry.)
        cap = best[2]
        # The worst window's ratio is not monotonic in the cap: where a cap leaves more capped pieces
        # than windows, those holding two are over, and the retries' tighter caps may stall between
        # such counts (a step of 27 window-long pieces and 13 of 99-126K at DP 64: 1.08 at caps of
        # 71-75K, 1.10-1.19 at 50-68K, 1.01-1.04 at 44-48K). A step left above `max_imbalance` tries
        # lower caps, each SCAN_STEP below the last, until one is within the bound.
        for _ in range(SCAN if best[0] > max_imbalance else 0):
            cap = max(1, int(cap * SCAN_STEP))
            packed = pack(lens, cap, n_windows, window)
            ratio = _ratio(packed, n_windows, dense)
            if ratio < best[0]:
                best = (ratio, packed, cap)
            if ratio <= bound:
                break
        cap = best[2]
        if best[0] <= bound and int((lens // cap).sum()) >= n_windows and cut_loss(lens, cap) > GROW_LOSS:
            mid = (cap + min(int(lens.max()), window)) // 2
            packed = pack(lens, mid, n_windows, window)
            ratio = _ratio(packed, n_windows, dense)
            if ratio <= bound:
                best = (ratio, packed, mid)
        if min_pairs is not None and _kept(best[1]) < min_pairs:
            best = (0.0, *keep_pairs(lens, best[2], n_windows, window, min_pairs, dense))
        win, doc, start, length = best[1]

    # 4. Most expensive windows first, snaking over the ranks micro step by micro step.
    order = np.lexsort((start, doc, win))
    w_pairs = np.bincount(win, length * (length + 1) / 2, n_windows)
    ranked = np.lexsort((np.arange(n_windows), -w_pairs))
    m, r = np.divmod(np.arange(n_windows), dp)
    slot = np.empty((dp, micro), dtype=np.int64)
    slot[np.where(m % 2 == 0, r, dp - 1 - r), m] = ranked
    bounds = np.concatenate(([0], np.cumsum(np.bincount(win, minlength=n_windows))))
    return StepLayout(doc[order], start[order], length[order], bounds, slot)


def balance_step(
    doc_lens: Sequence[int],
    dp: int,
    micro: int,
    window: int,
    cost: WindowCost,
    max_imbalance: float | None = 1.05,
) -> list[list[list[Piece]]]:
    """The step's documents (stream order, summing to dp * micro * window tokens) as pieces in
    windows `[dp rank][micro step]`, each exactly `window` tokens, every token once, pieces of a
    window ordered by (doc, start)."""
    return layout_step(doc_lens, dp, micro, window, cost, max_imbalance).ranks()
