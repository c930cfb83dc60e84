"""Llama3-style CP: cut the packed window into 2N equal chunks, rank i takes chunks i and 2N-1-i.

Document boundaries are ignored, so pieces of one document land wherever the chunk grid puts them;
pairing an early chunk with a late one only balances a single causal sequence, not packed ones.
"""

from __future__ import annotations

from flashcp.plan.plan import Shard


def plan_per_seq(doc_lens: tuple[int, ...], cp_size: int) -> tuple[list[list[Shard]], dict]:
    n = cp_size
    per_rank = sum(doc_lens) // n
    head = per_rank // 2  # chunks 0..N-1; chunks N..2N-1 take the other ceil half
    bounds = [0]
    for c in range(2 * n):
        bounds.append(bounds[-1] + (head if c < n else per_rank - head))
    ranks: list[list[Shard]] = [[] for _ in range(n)]
    doc, doc_start = 0, 0  # current document and its window offset
    for c in range(2 * n):
        owner = c if c < n else 2 * n - 1 - c
        pos, end = bounds[c], bounds[c + 1]
        while pos < end:
            while doc_start + doc_lens[doc] <= pos:
                doc_start += doc_lens[doc]
                doc += 1
            take = min(end, doc_start + doc_lens[doc]) - pos
            ranks[owner].append(Shard(doc, pos - doc_start, take))
            pos += take
    return ranks, {}
