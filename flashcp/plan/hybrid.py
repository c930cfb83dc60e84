"""FlashCP's hybrid sharding (Algorithm 1): Per-Doc for the few longest documents, Whole-Doc for the rest.

The loop of Algorithm 1: plan every document Whole-Doc; while the workload imbalance exceeds the
target, move the longest remaining document to Per-Doc and plan the rest Whole-Doc again.

What this module adds is how the two parts fit together. Per-Doc documents are spread over all
ranks anyway, so the longest of them (the "absorber") takes the slack of the Whole-Doc part:
its 2N head-tail chunks get sizes solved per rank (`balanced_head_tail`) so that every rank
ends with exactly C/N tokens and the mean workload. The Whole-Doc documents therefore never
have to be cut just to make token counts exact, and the rank holding the absorber's last
chunk (which is never sent) is given fewer Whole-Doc tokens so that all ranks send about the
same. The other Per-Doc documents use the plain head-tail layout of `per_doc_shards`.

A document that cannot stay whole on any rank (longer than C/N tokens, or heavier alone than
the target workload) would make the all-Whole-Doc attempt fail, so the loop starts with it in
Per-Doc. With many documents the loop moves them in growing batches (1, 1, 1, 1, 2, 3, 4, 6,
...) so a window of thousands of documents needs a logarithmic number of attempts.
"""

from __future__ import annotations

import math

from flashcp.plan.per_doc import per_doc_shards
from flashcp.plan.plan import Shard, shard_workload
from flashcp.plan.whole_doc import GOAL_SHARE, RankFill, place_documents, rebalance

# The absorber's last chunk is sized to carry about this share of a rank's mean workload:
# enough to spare its holder many sent tokens, little enough to leave it room for other work.
LAST_CHUNK_SHARE = 0.5
EXTRA = 1
CAP = True
CAP0 = True
CAPF = 1.0
MAX_FLEX = 4
HEAVY0 = False
HEAVYK = False


def _sent(doc_lens, ranks):
    return [sum(s.length for s in shards if s.start + s.length < doc_lens[s.doc]) for shards in ranks]


def plan_flashcp(
    doc_lens: tuple[int, ...], cp_size: int, target_imbalance: float = 1.05
) -> tuple[list[list[Shard]], dict]:
    """Hybrid plan meeting `target_imbalance` with as few Per-Doc documents as possible.

    `info["per_doc"]` lists the documents sharded Per-Doc (sorted); `info["target_met"]` is
    False only when even all-Per-Doc misses the target (possible for a target of ~1.0), in which
    case the attempt with the lowest imbalance is returned.
    """
    n = cp_size
    order = sorted(range(len(doc_lens)), key=lambda d: (-doc_lens[d], d))
    per_rank = sum(doc_lens) // n
    mean = sum(shard_workload(0, x) for x in doc_lens) / n
    longest = doc_lens[order[0]]
    k = int(longest > per_rank or shard_workload(0, longest) > target_imbalance * mean)
    best = None
    met_at = None
    while True:
        ranks, work = _attempt(doc_lens, n, order, k, mean, target_imbalance)
        imbalance = max(work) / mean
        met = imbalance <= target_imbalance
        key = (not met, max(_sent(doc_lens, ranks)) if met else imbalance)
        if best is None or key < best[0]:
            best = (key, imbalance, ranks, k)
        if met and met_at is None:
            met_at = k
        if k == len(order) or (met_at is not None and k >= met_at + EXTRA):
            break
        k = min(len(order), k + max(1, k // 2))
    _, imbalance, ranks, k = best
    return ranks, {"per_doc": sorted(order[:k]), "target_met": imbalance <= target_imbalance}


def _attempt(doc_lens, n, order, k, mean, target_imbalance):
    """Plan with the `k` longest documents Per-Doc; returns shards and exact workloads per rank."""
    per_rank = sum(doc_lens) // n
    if k == 0:
        goal = mean * (1 + GOAL_SHARE * (target_imbalance - 1))
        fill = RankFill([per_rank] * n, [0] * n, [0] * n, [0] * n)
        place_documents(doc_lens, order, fill, goal if HEAVY0 else None)
        nxt = doc_lens[order[0]] / n
        rebalance(doc_lens, fill, goal, max(fill.sent) + CAPF * nxt if CAP0 else math.inf)
        return fill.shards, [int(x) for x in fill.load]

    absorbers = order[: min(k, MAX_FLEX)]
    ranks, _ = per_doc_shards(doc_lens, order[len(absorbers) : k], n)
    tokens = [sum(s.length for s in shards) for shards in ranks]
    work = [sum(shard_workload(s.start, s.length) for s in shards) for shards in ranks]
    sent = _sent(doc_lens, ranks)

    # The longest absorber's last chunk (never sent) goes to the rank that sends most so far;
    # the other ranks share the rest of the absorbers so that all send about the same.
    holder = max(range(n), key=lambda r: (sent[r], -r))
    first = doc_lens[absorbers[0]]
    last = min(first, LAST_CHUNK_SHARE * mean / first)
    length = sum(doc_lens[d] for d in absorbers)
    even = (length + sum(sent) - last) / n
    share = [max(0.0, even - sent[r]) + (last if r == holder else 0.0) for r in range(n)]
    capacity = [per_rank - tokens[r] for r in range(n)]
    room = [int(capacity[r] - share[r]) for r in range(n)]
    density = sum(shard_workload(0, doc_lens[d]) for d in absorbers) / length
    fill = RankFill(
        room,
        [capacity[r] - room[r] for r in range(n)],
        [work[r] + share[r] * density for r in range(n)],
        sent,
    )
    place_documents(doc_lens, order[k:], fill)

    for r in range(n):
        ranks[r] += fill.shards[r]
        work[r] += sum(shard_workload(s.start, s.length) for s in fill.shards[r])
        tokens[r] += sum(s.length for s in fill.shards[r])
    taken = [per_rank - tokens[r] for r in range(n)]
    wanted = [mean - work[r] for r in range(n)]
    bonus = min(int(last), taken[holder])
    taken[holder] -= bonus
    left_work = sum(shard_workload(0, doc_lens[d]) for d in absorbers)
    for j, d in enumerate(absorbers):
        size = doc_lens[d]
        rest = size - (bonus if j == 0 else 0)
        part = list(taken) if j == len(absorbers) - 1 else _apportion(taken, rest)
        for r in range(n):
            taken[r] -= part[r]
        if j == 0:
            part[holder] += bonus
        wants = [wanted[r] * shard_workload(0, size) / left_work for r in range(n)]
        for r, shards in enumerate(balanced_head_tail(d, size, part, wants, holder)):
            ranks[r] += shards
            got = sum(shard_workload(s.start, s.length) for s in shards)
            work[r] += got
            wanted[r] -= got
        left_work -= shard_workload(0, size)
    goal = mean * (1 + GOAL_SHARE * (target_imbalance - 1))
    if max(work) > goal:
        sent = [sum(s.length for s in shards if s.start + s.length < doc_lens[s.doc]) for shards in ranks]
        fill = RankFill([0] * n, [0] * n, work, sent)
        fill.shards = ranks
        nxt = doc_lens[order[k]] / n if k < len(order) else 0.0
        rebalance(doc_lens, fill, goal, max(sent) + CAPF * nxt if CAP else math.inf)
        ranks, work = fill.shards, fill.load
    return ranks, work


def balanced_head_tail(
    doc: int, length: int, tokens: list[int], work: list[float], outermost: int
) -> list[list[Shard]]:
    """Head-tail chunks of one document, sized so rank r gets `tokens[r]` tokens and ~`work[r]` workload.

    Ranks are nested from the outside in: the first takes a head chunk at the document's start
    and a tail chunk at its end (`outermost` holds the last chunk, which is never sent), the next
    the chunks just inside those, and so on; the innermost takes one middle piece. For a rank
    whose two chunks must fit in [lo, hi), a head of h tokens leaves a tail of t = tokens - h and
    a workload that is linear in h:
        2 W(h) = t (2 hi - t + 1) + h (2 lo + h + 1) = tokens (2 hi + 1 - tokens) - 2 h (hi - lo - tokens),
    so h is solved exactly (then clamped to [0, tokens]); whatever a clamped rank misses ends up
    on the innermost rank. Ranks whose wanted density is furthest from the document's mean go
    outermost, where head and tail are furthest apart and the reachable workloads widest.
    With equal tokens and equal wanted workloads this is Per-Doc's head-tail layout.
    """
    n = len(tokens)
    assert sum(tokens) == length and min(tokens) >= 0, (tokens, length)
    mean_pos = length / 2
    inner = sorted(
        (r for r in range(n) if r != outermost and tokens[r]),
        key=lambda r: (-abs(work[r] / tokens[r] - mean_pos), r),
    )
    nest = ([outermost] if tokens[outermost] else []) + inner
    out: list[list[Shard]] = [[] for _ in range(n)]
    lo, hi = 0, length
    for i, r in enumerate(nest):
        size, slack = tokens[r], hi - lo - tokens[r]
        if i == len(nest) - 1 or slack == 0:
            head = size
        else:
            head = round((size * (2 * hi + 1 - size) - 2 * work[r]) / (2 * slack))
            head = min(size, max(0, head))
        tail = size - head
        out[r] = [Shard(doc, lo, head), Shard(doc, hi - tail, tail)]
        lo, hi = lo + head, hi - tail
    return out


def _apportion(total: list[int], size: int) -> list[int]:
    """Integer shares of `size` proportional to `total` (largest remainders), each <= its total."""
    whole = sum(total)
    exact = [t * size / whole for t in total]
    part = [int(x) for x in exact]
    for r in sorted(range(len(total)), key=lambda r: (part[r] - exact[r], r))[: size - sum(part)]:
        part[r] += 1
    return part
