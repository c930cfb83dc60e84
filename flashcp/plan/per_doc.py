"""Per-Doc CP: every document is cut into 2N chunks, rank i takes chunks i and 2N-1-i.

Padding-free: a document of length L gives each chunk L // 2N tokens and spreads the L % 2N
remainder tokens one at a time over the ranks with a pointer that keeps turning across documents.
Since the window holds C/N tokens per rank, the pointer hands every rank the same number of
remainder tokens and each rank ends with exactly C/N tokens, for documents of any length.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from flashcp.plan.plan import Shard


def per_doc_layout(
    doc_lens: tuple[int, ...], docs: Sequence[int], cp_size: int, pointer: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """The head-tail chunks of `docs` as arrays: the document of each of a rank's pieces (head,
    tail, head, tail, ... in `docs` order), their starts and lengths per rank (cp_size x 2 len(docs)),
    and the remainder pointer after them. In numpy: with many ranks and many Per-Doc documents
    these are tens of thousands of chunks."""
    n = cp_size
    docs = np.asarray(docs, dtype=np.int64)
    lens = np.asarray(doc_lens, dtype=np.int64)[docs]
    base, rem = np.divmod(lens, 2 * n)
    # Remainder token j of a document goes to rank (pointer + j) % n: its head chunk the first
    # time (j < n), its tail chunk the second (j >= n).
    first = (pointer + np.cumsum(rem) - rem) % n
    # Chunks as columns, one per document (2n x len(docs)): numpy runs cumsum along the rows'
    # contiguous memory several times faster than along each document's row.
    turn = (np.arange(n)[:, None] - first) % n
    chunk = np.concatenate((turn < rem, (turn + n < rem)[::-1])) + base
    starts = np.cumsum(chunk, axis=0) - chunk
    return np.repeat(docs, 2), _by_rank(starts, n), _by_rank(chunk, n), pointer + int(rem.sum())


def _by_rank(chunks: np.ndarray, n: int) -> np.ndarray:
    """Per-document columns of 2n chunks -> per-rank rows: rank r holds chunks r and 2n - 1 - r."""
    out = np.empty((n, chunks.shape[1], 2), dtype=chunks.dtype)
    out[:, :, 0] = chunks[:n]
    out[:, :, 1] = chunks[: n - 1 : -1]
    return out.reshape(n, -1)


def per_doc_shards(
    doc_lens: tuple[int, ...], docs: Sequence[int], cp_size: int, pointer: int = 0
) -> tuple[list[list[Shard]], int]:
    """Head-tail shards of `docs` for every rank, and the remainder pointer after them."""
    doc, starts, lengths, pointer = per_doc_layout(doc_lens, docs, cp_size, pointer)
    doc = doc.tolist()
    return [list(map(Shard, doc, s, x)) for s, x in zip(starts.tolist(), lengths.tolist())], pointer


def plan_per_doc(doc_lens: tuple[int, ...], cp_size: int) -> tuple[list[list[Shard]], dict]:
    ranks, _ = per_doc_shards(doc_lens, range(len(doc_lens)), cp_size)
    return ranks, {}
