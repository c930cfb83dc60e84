"""Ring-Attn's layout: every document cut into N contiguous pieces, piece r on rank r.

The layout of ring attention over packed documents (ring-flash-attention's
`ring_flash_attn_varlen_func`, TransformerEngine's p2p CP): rank r holds the r-th N-th of every
document, so its queries see whole pieces of ranks 0 .. r-1 and causal half of its own, and the
last rank works most. Padding-free as Per-Doc CP is: a document of length L gives each piece
L // N tokens and its L % N remainder tokens go one at a time to the ranks a pointer names, the
pointer turning across documents, so every rank ends with exactly C / N tokens. A document
shorter than N leaves some ranks an empty piece (no shard).

`ring_schedule(plan, rank)` is what one rank computes at every step of a KV ring over any plan:
the attention op (`flashcp.attention.ring`) and the cost model (`flashcp.costmodel.model`) both
read it, so what is timed is what runs.
"""

from __future__ import annotations

import bisect
from typing import NamedTuple

import numpy as np

from flashcp.plan.plan import Plan, Shard, shards_of


def plan_ring(doc_lens: tuple[int, ...], cp_size: int) -> tuple[list[list[Shard]], dict]:
    n = cp_size
    lens = np.asarray(doc_lens, dtype=np.int64)
    base, rem = np.divmod(lens, n)
    first = np.cumsum(rem) - rem  # the pointer when each document starts handing out its remainder
    # piece[r, d]: rank r's share of document d; remainder token j goes to rank (first + j) % n
    piece = base + ((np.arange(n)[:, None] - first) % n < rem)
    starts = np.cumsum(piece, axis=0) - piece
    docs = range(len(lens))
    return [shards_of(docs, s, x) for s, x in zip(starts.tolist(), piece.tolist())], {}


class RingCall(NamedTuple):
    """One step's kernel call on one rank: query sequence i is local rows `q_ranges[i]`, its keys
    are rows `k_ranges[i]` of the KV block held at that step (the `source` rank's local rows).
    `causal` (step 0 only): each sequence's mask is aligned to the bottom right."""

    source: int
    causal: bool
    q_ranges: tuple[tuple[int, int], ...]
    k_ranges: tuple[tuple[int, int], ...]


def ring_schedule(plan: Plan, rank: int) -> list[RingCall | None]:
    """Per ring step s, the call `rank` runs on the block of rank (rank - s) mod N, None when
    none of its queries sees any of those keys.

    A query shard sees the shards of its document that end where it starts or earlier; plans keep
    each rank's shards sorted by (document, start), so those keys are one contiguous row range of
    the source's block. At step 0 (its own block) a shard also sees itself, causally. At later
    steps every visible block is whole, so neighbouring query shards with the same keys (the head
    and tail chunks of a Per-Doc document) are one sequence."""
    n = plan.cp_size
    mine = plan.ranks[rank]
    rows = np.cumsum([0] + [s.length for s in mine]).tolist()
    calls: list[RingCall | None] = []
    for step in range(n):
        source = (rank - step) % n
        first: dict[int, int] = {}  # document -> its first row in the source's block
        ends: dict[int, tuple[list[int], list[int]]] = {}  # document -> (shard ends in the doc, their end rows)
        row = 0
        for s in plan.ranks[source]:
            first.setdefault(s.doc, row)
            row += s.length
            doc_ends, end_rows = ends.setdefault(s.doc, ([], []))
            doc_ends.append(s.start + s.length)
            end_rows.append(row)
        q_ranges: list[tuple[int, int]] = []
        k_ranges: list[tuple[int, int]] = []
        for s, r0 in zip(mine, rows):
            if s.doc not in first:
                continue
            if step == 0:
                k1 = r0 + s.length
            else:
                doc_ends, end_rows = ends[s.doc]
                seen = bisect.bisect_right(doc_ends, s.start)
                if not seen:
                    continue
                k1 = end_rows[seen - 1]
            k = (first[s.doc], k1)
            if step and q_ranges and k_ranges[-1] == k and q_ranges[-1][1] == r0:
                q_ranges[-1] = (q_ranges[-1][0], r0 + s.length)
            else:
                q_ranges.append((r0, r0 + s.length))
                k_ranges.append(k)
        calls.append(RingCall(source, step == 0, tuple(q_ranges), tuple(k_ranges)) if q_ranges else None)
    return calls


def ring_transfers(tokens_per_rank: int, cp_size: int, kv_row_bytes: int, grad_row_bytes: int
                   ) -> tuple[list[int], list[int]]:  # fmt: skip
    """Bytes every rank sends (and receives) at each step of the ring, per layer: forward, then
    backward with one more entry for the dK/dV sums' last hop home. A step passes the held KV block
    on (all but the last); from backward step 2 the previous step's sums go with it."""
    n, block, sums = cp_size, tokens_per_rank * kv_row_bytes, tokens_per_rank * grad_row_bytes
    forward = [block if s < n - 1 else 0 for s in range(n)]
    backward = [(block if s < n - 1 else 0) + (sums if s >= 2 else 0) for s in range(n)]
    return forward, backward + [sums if n > 1 else 0]


def call_pairs(call: RingCall) -> int:
    """The (query, key) pairs one call scores."""
    pairs = 0
    for (q0, q1), (k0, k1) in zip(call.q_ranges, call.k_ranges):
        q, k = q1 - q0, k1 - k0
        pairs += q * (k - q) + q * (q + 1) // 2 if call.causal else q * k
    return pairs


def ring_metrics(plan: Plan, kv_bytes: int = 2, sum_bytes: int = 4) -> dict[str, float]:
    """The plan run over a ring: its steps' imbalance (sum over steps of the busiest rank's pairs,
    over the mean rank's pairs: the ring waits for its slowest rank at every step) and the KV bytes
    a rank moves per layer, forward and backward (KV elements of `kv_bytes`, dK/dV sums of
    `sum_bytes`), relative to the full all-gather and its reduce-scatter."""
    n = plan.cp_size
    work = [[call_pairs(c) if c else 0 for c in ring_schedule(plan, r)] for r in range(n)]
    mean = sum(map(sum, work)) / n
    busiest = sum(max(work[r][s] for r in range(n)) for s in range(n))
    fwd, bwd = ring_transfers(plan.tokens_per_rank, n, kv_bytes, sum_bytes)
    full = 2 * (n - 1) * plan.tokens_per_rank * kv_bytes
    return {"ring_step_imbalance": busiest / mean if mean else 1.0,
            "ring_comm_ratio": (sum(fwd) + sum(bwd)) / full if full else 0.0}  # fmt: skip
