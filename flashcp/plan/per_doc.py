"""Per-Doc CP: every document is cut into 2N chunks, rank i takes chunks i and 2N-1-i.

Padding-free: a document of length L gives each chunk L // 2N tokens and spreads the L % 2N
remainder tokens one at a time over the ranks with a pointer that keeps turning across documents.
Since the window holds C/N tokens per rank, the pointer hands every rank the same number of
remainder tokens and each rank ends with exactly C/N tokens, for documents of any length.
"""

from __future__ import annotations

from collections.abc import Iterable

from flashcp.plan.plan import Shard


def per_doc_shards(
    doc_lens: tuple[int, ...], docs: Iterable[int], cp_size: int, pointer: int = 0
) -> tuple[list[list[Shard]], int]:
    """Head-tail shards of `docs` for every rank, and the remainder pointer after them."""
    n = cp_size
    ranks: list[list[Shard]] = [[] for _ in range(n)]
    for d in docs:
        base, rem = divmod(doc_lens[d], 2 * n)
        chunk = [base] * (2 * n)
        for _ in range(rem):
            r = pointer % n
            # A rank's first extra token goes to its head chunk, a second one to its tail chunk.
            chunk[r if chunk[r] == base else 2 * n - 1 - r] += 1
            pointer += 1
        start = 0
        for c, length in enumerate(chunk):
            ranks[c if c < n else 2 * n - 1 - c].append(Shard(d, start, length))
            start += length
    return ranks, pointer


def plan_per_doc(doc_lens: tuple[int, ...], cp_size: int) -> tuple[list[list[Shard]], dict]:
    ranks, _ = per_doc_shards(doc_lens, range(len(doc_lens)), cp_size)
    return ranks, {}
