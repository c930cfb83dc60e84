"""FlashCP's hybrid sharding (Algorithm 1): Per-Doc for the few longest documents, Whole-Doc for the rest.

The loop of Algorithm 1: plan all documents Whole-Doc; while the workload imbalance exceeds the
target, move the longest remaining document to Per-Doc and plan the rest Whole-Doc again.

How the two parts fit together is what decides the communication. Per-Doc documents are spread
over all ranks anyway, so they take the slack of the Whole-Doc part: their head-tail chunks
get sizes solved per rank (`balanced_head_tail`) so that every rank ends with exactly C/N
tokens and the mean workload. Whole-Doc documents then never have to be cut merely to make
token counts exact, and the Whole-Doc part needs only rough balance. Three more details keep
the largest send buffer small:
- Ranks take as many Per-Doc tokens (all sent, but for one last chunk) as evens out what they
  send, and the rank holding the longest Per-Doc document's last chunk (never sent) gets that
  chunk on top, sized to carry about half a rank's workload.
- If the Whole-Doc part still needs trades (`flashcp.plan.rebalance`), no trade may leave a rank
  sending more than the largest buffer so far plus what moving the next document d to Per-Doc
  would add (|d| / N): past that, the loop moves d instead.
- Once the target is met, the loop makes one more attempt with the next document in Per-Doc
  when that could still lower the largest send buffer, and keeps the better plan.

Beyond the first few, Per-Doc documents use the plain layout of `per_doc_shards`: their
chunks add balance nobody needs. A document that cannot stay whole on any rank (longer than
C/N tokens, or heavier than the target workload, alone or with the plain Per-Doc chunks every
rank holds) would only make the attempt fail, so the loop starts with it in Per-Doc; with many
documents it moves them in growing batches (1, 1, 1, 1, 2, 3, 4, 6, ...) so thousands of
documents need few attempts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from flashcp.plan.fill import RankFill
from flashcp.plan.per_doc import per_doc_layout
from flashcp.plan.plan import CAUSAL, normalize, Plan, Shard, Workload, shard_workload, shards_of
from flashcp.plan.rebalance import rebalance
from flashcp.plan.whole_doc import GOAL_SHARE, Sorted, place_documents

# Workload the last chunk of the longest Per-Doc document is sized to carry, as a share of the
# mean per rank: large enough to spare its holder many sends, small enough to leave room for
# other work on that rank.
LAST_CHUNK_SHARE = 0.5
# Per-Doc documents laid out by `balanced_head_tail`; further ones use `per_doc_shards`.
FLEXIBLE = 4
# Send buffers below this share of a rank's tokens are not worth another planning attempt.
NEGLIGIBLE = 0.02


def plan_flashcp(
    doc_lens: tuple[int, ...], cp_size: int, target_imbalance: float = 1.05, bounded: bool = True,
    workload: Workload = CAUSAL,
) -> tuple[list[list[Shard]], dict]:
    """Hybrid plan meeting `target_imbalance` of `workload` (`Workload`: causal pairs, or a
    model's full and sliding-window layers together) with few Per-Doc documents and small send
    buffers.

    `info["per_doc"]` lists the documents sharded Per-Doc (sorted). `info["target_met"]` is
    False only when no attempt met the target (even all-Per-Doc can miss a target of 1.0 by
    rounding); the attempt with the lowest imbalance is returned then. `info["attempts"]`
    counts the attempts planned. `bounded=False` tries every attempt of the sequence from the
    first, as Algorithm 1's loop (see `_Search`); the plans differ only where meeting the target
    is not monotone along the sequence.
    """
    window = _Window(doc_lens, cp_size, target_imbalance, workload)
    ranks, k, met, attempts = _Search(window, bounded).run()
    return ranks, {"per_doc": sorted(window.order[:k]), "target_met": met, "attempts": attempts}


class _Search:
    """Algorithm 1's loop over k (documents in Per-Doc), bounded.

    The loop tries k along a fixed sequence (growing batches: k, k + max(1, k // 2), ...), stops
    at the first k that meets the target, plus one more attempt when that could lower the
    largest send buffer, and keeps the best of those. Every attempt costs a Whole-Doc placement
    of all remaining documents (documents x ranks), and with few documents per rank dozens of
    documents cannot stay whole: the loop then tried a dozen attempts bound to fail before the
    first that meets. The bounded search starts instead at the first k of the sequence whose
    longest Whole-Doc document can stay whole beside the plain Per-Doc chunks of that attempt
    (`_Window.longest_whole_fits`: pile lengths at 2M tokens / CP 64, where those chunks weigh
    ~0.1-0.25 of a rank's mean workload, start there one attempt before the first that meets in
    10 % of windows instead of 25 %); if that attempt meets the target it steps back one
    attempt when the previous one meets too, and if not it gallops forward (1, 2, 4, ...
    steps) to an attempt that meets and bisects back, so the first k meeting the target, and the
    plan, are those of the full loop whenever meeting the target is monotone in k and the start
    is at most one attempt past it (on random windows with few documents per rank, 99.2 % of
    plans are the same; where meeting is not monotone it settles on a later k, which sent less
    on average). It does not walk back further: with many documents per rank each attempt places
    them all, and the attempts further back, where they met, sent no less (pile lengths at
    1M-2M / CP 64: 2-5 % less compact communication with the one step). If no attempt meets,
    the skipped ones are tried as well and the least imbalanced of all is kept.
    """

    def __init__(self, window: _Window, bounded: bool) -> None:
        self.window, self.bounded = window, bounded
        order, lens = window.order, window.doc_lens
        longest = lens[order[0]]
        self.sequence = [int(longest > window.per_rank or window.workload.shard(0, longest) > window.cap)]
        while self.sequence[-1] < len(order):
            k = self.sequence[-1]
            self.sequence.append(min(len(order), k + max(1, k // 2)))
        fits = (i for i, k in enumerate(self.sequence) if window.longest_whole_fits(k))
        self.start = next(fits) if bounded else 0  # the last k, all in Per-Doc, fits
        self.tried: dict[int, tuple[tuple, Callable[[], list[list[Shard]]]]] = {}

    def key(self, i: int) -> tuple:
        """(not met, largest send buffer if met else imbalance) of attempt i, planned once."""
        if i not in self.tried:
            window = self.window
            shards, work, sent = window.attempt(self.sequence[i])
            imbalance = max(work) / window.mean
            largest = max(sent)
            if window.workload.linear is not None:  # a cut's state and halo bytes: the whole plan's
                largest += window.linear_costs(shards())
            met = imbalance <= window.target
            self.tried[i] = ((not met, largest if met else imbalance), shards)
        return self.tried[i][0]

    def met(self, i: int) -> bool:
        return not self.key(i)[0]

    def run(self) -> tuple[list[list[Shard]], int, bool, int]:
        """The chosen attempt's ranks, its k, whether it met the target and the attempts planned."""
        last = len(self.sequence) - 1
        first = self.start
        if self.met(first):
            if first > 0 and self.met(first - 1):
                first -= 1
        else:  # gallop forward to an attempt that meets, then bisect back to the first
            failed, step, first = first, 1, last + 1
            while failed < last:
                i = min(last, failed + step)
                if self.met(i):
                    first = i
                    break
                failed, step = i, 2 * step if self.bounded else 1
            while first <= last and first - failed > 1:
                middle = (failed + first) // 2
                failed, first = (failed, middle) if self.met(middle) else (middle, first)
        if first > last:  # nothing meets: the least imbalanced attempt of the whole sequence
            candidates = range(last + 1)
        else:
            candidates = [first]
            sent = self.key(first)[1]
            floor = self.window.sent_floor(self.sequence[first + 1]) if first < last else 0.0
            if first < last and sent > max(floor, NEGLIGIBLE * self.window.per_rank):
                candidates.append(first + 1)
        best = min(candidates, key=lambda i: (self.key(i), i))
        return self.tried[best][1](), self.sequence[best], not self.key(best)[0], len(self.tried)


class _Window:
    """One window's documents and targets; `attempt(k)` plans it with the k longest Per-Doc."""

    def __init__(
        self, doc_lens: tuple[int, ...], cp_size: int, target_imbalance: float, workload: Workload = CAUSAL
    ) -> None:
        self.doc_lens = doc_lens
        self.n = cp_size
        self.per_rank = sum(doc_lens) // cp_size
        self.workload = workload
        self.docs = Sorted.of(doc_lens, range(len(doc_lens)), workload)  # placement's, shared by the attempts
        self.order = [d for _, d, _ in self.docs.items]
        self.mean = self.docs.work[0] / cp_size
        self.target = target_imbalance
        self.cap = target_imbalance * self.mean
        self.goal = self.mean * (1 + GOAL_SHARE * (target_imbalance - 1))
        # Plain Per-Doc layout of order[FLEXIBLE:], extended as k grows: every attempt takes a
        # prefix of it (a document's chunks do not depend on the documents after it). The
        # layout's arrays (`per_doc_layout`), per rank the running tokens, workload and sent
        # tokens after each document (column j: the first j documents), and the shards per rank
        # made so far, in document order.
        self.per_doc_docs = np.zeros(0, dtype=np.int64)
        self.per_doc_starts = self.per_doc_lengths = np.zeros((cp_size, 0), dtype=np.int64)
        self.per_doc_totals = np.zeros((3, cp_size, 1), dtype=np.int64)
        self.per_doc_pointer = 0
        self.per_doc_ranks: list[list[Shard]] = [[] for _ in range(cp_size)]

    def linear_costs(self, ranks: list[list[Shard]]) -> int:
        """The state and halo bytes a hybrid model's cuts send under an attempt, in send-buffer tokens
        (`LinearLayers.exchange_tokens`). What cuts add to the linear layers' compute (summary passes,
        folds: `Plan.workloads`) stays out of the target: Per-Doc layouts balance the rest, and charging
        it there tipped attempts that met over the target, so that more documents were cut."""
        plan = Plan(self.doc_lens, self.n, normalize(ranks), "flashcp", workload=self.workload)
        return self.workload.linear.exchange_tokens(plan)

    def longest_whole_fits(self, k: int) -> bool:
        """Whether the longest document left out of Per-Doc with the k longest in it, order[k],
        can stay whole on a rank beside the plain Per-Doc chunks every rank holds: within C/N
        tokens and the target workload. If not, the attempt is bound to cut or trade it."""
        if k >= len(self.order):
            return True
        length = self.doc_lens[self.order[k]]
        tokens, work, _ = self.per_doc_part(k - min(k, FLEXIBLE))
        heavy = self.workload.shard(0, length) + min(work) > self.cap
        return length + min(tokens) <= self.per_rank and not heavy

    def per_doc_part(self, count: int) -> tuple[list[int], list[int], list[int]]:
        """Tokens, workload and sent tokens per rank of `order[FLEXIBLE:FLEXIBLE + count]` laid
        out by `per_doc_shards`: a prefix of the layout, which is extended when `count` goes
        beyond it."""
        done = self.per_doc_totals.shape[2] - 1
        if count > done:
            docs = self.order[FLEXIBLE + done : FLEXIBLE + count]
            doc, starts, lengths, self.per_doc_pointer = per_doc_layout(
                self.doc_lens, docs, self.n, self.per_doc_pointer
            )
            ends = starts + lengths
            sent = np.where(ends < np.asarray(self.doc_lens)[doc], lengths, 0)
            adds = np.stack((lengths, self.workload.shards(starts, lengths), sent))  # 3 x n x 2 docs
            adds = adds[:, :, 0::2] + adds[:, :, 1::2]  # per document (the sum over an axis of 2 is slow)
            adds = adds.cumsum(2) + self.per_doc_totals[:, :, -1:]
            self.per_doc_totals = np.concatenate((self.per_doc_totals, adds), axis=2)
            self.per_doc_docs = np.concatenate((self.per_doc_docs, doc))
            self.per_doc_starts = np.concatenate((self.per_doc_starts, starts), axis=1)
            self.per_doc_lengths = np.concatenate((self.per_doc_lengths, lengths), axis=1)
        tokens, work, sent = self.per_doc_totals[:, :, count].tolist()
        return tokens, work, sent

    def per_doc_shards(self, count: int) -> list[list[Shard]]:
        """The shards of `per_doc_part(count)` per rank (fresh lists). Each shard object is made
        once per window, however many attempts use it, and only once an attempt that holds it is
        kept (see `attempt`): with many ranks and Per-Doc documents they are tens of thousands,
        and up to a third of them would belong to attempts planned only to be compared."""
        self.per_doc_part(count)
        made = len(self.per_doc_ranks[0]) // 2
        if count > made:
            columns = slice(2 * made, 2 * count)
            doc = self.per_doc_docs[columns].tolist()
            starts, lengths = self.per_doc_starts[:, columns], self.per_doc_lengths[:, columns]
            for shards, s, x in zip(self.per_doc_ranks, starts.tolist(), lengths.tolist()):
                shards += shards_of(doc, s, x)
        return [shards[: 2 * count] for shards in self.per_doc_ranks]

    def last_chunk(self) -> float:
        """Tokens of the longest document's last chunk: about LAST_CHUNK_SHARE of a rank's work
        (each of its tokens costing about what the document's last one does)."""
        longest = self.doc_lens[self.order[0]]
        return min(longest, LAST_CHUNK_SHARE * self.mean / self.workload.shard(longest - 1, 1))

    def sent_floor(self, k: int) -> float:
        """About the least any rank but one sends with the k longest documents Per-Doc."""
        return (sum(self.doc_lens[d] for d in self.order[:k]) - self.last_chunk()) / self.n

    def trade_cap(self, sent: Sequence[int], k: int) -> float:
        """Most sends a Whole-Doc trade may leave: more would cost more than moving document k."""
        return max(sent) + (self.doc_lens[self.order[k]] / self.n if k < len(self.order) else 0)

    def attempt(self, k: int) -> tuple[Callable[[], list[list[Shard]]], list[int], list[int]]:
        """Shards (a call returns them), workloads and sent tokens per rank with the k longest
        documents Per-Doc. The search compares attempts by workloads and sent tokens alone, so
        the Per-Doc shards are added only when the attempt is kept; trades see only those of
        them they may take (`_tradeable`)."""
        if k == 0:
            fill = RankFill([self.per_rank] * self.n, workload=self.workload)
            place_documents(self.doc_lens, self.docs, fill)
            rebalance(self.doc_lens, fill, self.goal, self.trade_cap(fill.sent, 0))
            return lambda: fill.shards, fill.work, fill.sent
        count = k - min(k, FLEXIBLE)
        others, work, sent = self._hybrid(k)
        if max(work) <= self.goal:
            return lambda: self._with_per_doc(count, others), work, sent
        # Trades take last pieces and whole documents only: the other plain Per-Doc chunks, most
        # of the shards, stay out of the trades' scans (and are made only if the attempt is kept).
        rank, column, chunks = self._tradeable(count)
        fill = RankFill([0] * self.n, workload=self.workload)
        for r, shard in zip(rank, chunks):
            fill.shards[r].append(shard)
        for shards, more in zip(fill.shards, others):
            shards += more
        fill.work, fill.sent = work, sent  # traded in place
        rebalance(self.doc_lens, fill, self.goal, self.trade_cap(sent, k))

        def kept() -> list[list[Shard]]:
            ranks = self.per_doc_shards(count)
            for r, j in zip(rank[::-1], column[::-1]):  # within a rank, the last column first
                del ranks[r][j]
            return [fixed + traded for fixed, traded in zip(ranks, fill.shards)]

        return kept, work, sent

    def _tradeable(self, count: int) -> tuple[list[int], list[int], list[Shard]]:
        """The plain Per-Doc chunks of `per_doc_part(count)` a trade of `rebalance` may take: last
        pieces of more than one token (mostly the tail chunks of rank 0) and whole documents.
        Their ranks and columns in the layout (by rank, then column) and the shards."""
        columns = slice(0, 2 * count)
        doc = self.per_doc_docs[columns]
        starts, lengths = self.per_doc_starts[:, columns], self.per_doc_lengths[:, columns]
        ends = starts + lengths
        rank, column = np.nonzero((ends == np.asarray(self.doc_lens)[doc]) & ((lengths > 1) | (starts == 0)))
        picked = (doc[column], starts[rank, column], lengths[rank, column])
        chunks = shards_of(*(x.tolist() for x in picked))
        return rank.tolist(), column.tolist(), chunks

    def _with_per_doc(self, count: int, others: list[list[Shard]]) -> list[list[Shard]]:
        """Per rank, the plain Per-Doc shards of the first `count` documents, then `others`."""
        ranks = self.per_doc_shards(count)
        for shards, more in zip(ranks, others):
            shards += more
        return ranks

    def _hybrid(self, k: int) -> tuple[list[list[Shard]], list[int], list[int]]:
        """Shards but the plain Per-Doc ones, workloads and sent tokens (all shards) per rank."""
        doc_lens, n, mean = self.doc_lens, self.n, self.mean
        flexible = self.order[: min(k, FLEXIBLE)]
        tokens, work, sent = self.per_doc_part(k - len(flexible))

        # Flexible Per-Doc tokens each rank should take so that all ranks send about the same,
        # the longest document's last chunk going to the rank that sends most so far.
        holder = sent.index(max(sent))
        last = self.last_chunk()
        length = sum(doc_lens[d] for d in flexible)
        cost = self.workload.shard
        flex_work = sum(cost(0, doc_lens[d]) for d in flexible)
        even = (length + sum(sent) - last) / n
        share = [max(0.0, even - sent[r]) + (last if r == holder else 0.0) for r in range(n)]
        capacity = [self.per_rank - tokens[r] for r in range(n)]
        room = [int(capacity[r] - share[r]) for r in range(n)]
        fill = RankFill(
            room,
            spare=[capacity[r] - room[r] for r in range(n)],
            bias=[work[r] + share[r] * flex_work / length for r in range(n)],
            sent=sent,
            workload=self.workload,
        )
        place_documents(doc_lens, self.docs, fill, k)

        # The flexible documents take exactly the tokens left and the workload missing.
        taken = [capacity[r] - room[r] + fill.room[r] for r in range(n)]
        ranks = fill.shards
        work = [w + x for w, x in zip(work, fill.work)]
        sent = fill.sent
        bonus = min(int(last), taken[holder])
        taken[holder] -= bonus
        for j, d in enumerate(flexible):
            size = doc_lens[d]
            rest = size - (bonus if j == 0 else 0)
            part = list(taken) if j == len(flexible) - 1 else apportion(taken, rest)
            taken = [t - p for t, p in zip(taken, part)]
            if j == 0:
                part[holder] += bonus
            whole = cost(0, size)
            wants = [(mean - w) * whole / flex_work for w in work]  # the missing workload's share
            flex_work -= whole
            shards, got, sends = balanced_head_tail(d, size, part, wants, holder, cost)
            for rank, pieces in zip(ranks, shards):
                rank += pieces
            work = [w + g for w, g in zip(work, got)]
            sent = [s + x for s, x in zip(sent, sends)]
        return ranks, work, sent


def apportion(total: list[int], size: int) -> list[int]:
    """Integer shares of `size` proportional to `total` (largest remainders); each <= its total
    as long as size <= sum(total)."""
    whole = sum(total)
    exact = [t * size / whole for t in total]
    part = [int(x) for x in exact]
    for _, r in sorted(zip([p - x for p, x in zip(part, exact)], range(len(total))))[: size - sum(part)]:
        part[r] += 1
    return part


def balanced_head_tail(
    doc: int, length: int, tokens: list[int], work: list[float], outermost: int,
    cost: Callable[[int, int], int] = shard_workload,
) -> tuple[list[list[Shard]], list[int], list[int]]:
    """Head-tail chunks of one document sized so rank r gets `tokens[r]` tokens and ~`work[r]` workload.

    Ranks nest from the outside in: the first takes a head chunk at the document's start and a
    tail chunk at its end (`outermost` comes first and holds the last chunk, never sent), the
    next the chunks just inside those, and so on; the innermost takes one middle piece. A rank
    whose chunks lie in [lo, hi) with a head of h tokens and a tail of t = tokens - h has
        2 W = h (2 lo + h + 1) + t (2 hi - t + 1) = tokens (2 hi + 1 - tokens) - 2 h (hi - lo - tokens),
    linear in h, so h is solved exactly, then rounded and clamped to [0, tokens]; what a rank gets
    beyond (or short of) its target is shared out among the ranks nested inside it. Ranks whose
    wanted density (workload per token) is furthest from the document's mean go outermost, where
    head and tail lie furthest apart and the reachable workloads span the widest range. Equal
    tokens and workloads give Per-Doc's head-tail layout.

    `cost` is the workload of a chunk (`Workload.shard`; causal pairs by default). The line
    through h = 0 and h = tokens is the exact one above for causal pairs; window layers add a
    part that is the same for every h once lo is past their window, and only the outermost
    rank's chunks lie closer to the document's start: its error is shared out inwards as well.

    Returns per rank the two chunks, their exact workload and their sent tokens (those of
    chunks ending before the document's end), which the caller adds to its running totals:
    the loop knows them already, cheaper than summing the shards again once per attempt.
    """
    n = len(tokens)
    assert sum(tokens) == length and min(tokens) >= 0, (tokens, length)
    middle = cost(0, length) / length - 0.5  # the mean density, less half a pair (causal: length / 2)
    inner = sorted(
        [(-abs(work[r] / tokens[r] - middle), r) for r in range(n) if r != outermost and tokens[r]]
    )
    nest = ([outermost] if tokens[outermost] else []) + [r for _, r in inner]
    out: list[list[Shard]] = [[] for _ in range(n)]
    got, sent = [0] * n, [0] * n
    lo, hi = 0, length
    excess = 0.0  # workload placed so far beyond what those ranks wanted
    # This loop runs for every rank, flexible document and attempt: Shard(...) is spelled out
    # (tuple.__new__ skips the named tuple's Python-level __new__).
    for left, r in zip(range(len(nest), 0, -1), nest):  # left: ranks from r inwards
        size = tokens[r]
        head = size
        if left > 1 and hi - lo > size:
            target = work[r] - excess / left
            all_tail = cost(hi - size, size)
            drop = all_tail - cost(lo, size)  # workload lost moving all tokens from tail to head
            if drop > 0:  # causal: size x slack, the line above
                head = round((all_tail - target) / (drop / size))
                head = size if head > size else max(head, 0)
        tail = size - head
        out[r] = [tuple.__new__(Shard, (doc, lo, head)), tuple.__new__(Shard, (doc, hi - tail, tail))]
        got[r] = cost(lo, head) + cost(hi - tail, tail)
        sent[r] = (head if lo + head < length else 0) + (tail if hi < length else 0)
        excess += got[r] - work[r]
        lo, hi = lo + head, hi - tail
    return out, got, sent
