"""Sliding-window layers under a plan: what each rank receives per layer.

`window` is Hugging Face's `sliding_window` W: a query at document position t attends the keys at
(t - W, t], W keys counting itself (FlashAttention's `window_size = (W - 1, 0)`); None is full
attention. A shard starting at position a of its document then needs only the rows
[max(0, a - W + 1), a) of that document from before it, at most W - 1, whatever the context; a
whole document needs nothing. One plan serves both layer kinds: the window layers' exchange is
the same plan's with those rows (`flashcp.dispatch.build_dispatch(..., window=W)`).

Counted here in plain Python, apart from the dispatch's tensors, so that tests can hold the
op's recorded rows to an independent prediction; `window_metrics` puts the busiest rank's beside
`Plan.metrics`. What window layers cost the planners to balance is `flashcp.plan.Workload`.
"""

from __future__ import annotations

from flashcp.plan.plan import Plan, Shard, row_bytes


def check_window(window: int | None) -> None:
    """Raise ValueError unless `window` is None or a positive number of keys."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
        raise ValueError(
            f"window must be a positive number of keys (HF sliding_window) or None, got {window!r}"
        )


def window_send_tokens(plan: Plan, window: int) -> list[int]:
    """Per rank, the rows of its compact all-gather in a window layer: the last min(length,
    W - 1) rows of each non-last shard, the only ones a later shard's window can reach."""
    check_window(window)
    return [sum(min(s.length, window - 1) for s in shards if not plan.is_last(s)) for shards in plan.ranks]


def window_needed_tokens(plan: Plan, window: int) -> list[int]:
    """Per rank, the rows of other ranks its shards' windows reach: per document, the union of
    [max(0, a - W + 1), a) over its shards' starts a, less its own rows."""
    check_window(window)
    needed = []
    for shards in plan.ranks:
        by_doc: dict[int, list[Shard]] = {}  # one pass: Per-Doc plans hold thousands of documents
        for s in shards:
            by_doc.setdefault(s.doc, []).append(s)
        total = 0
        for pieces in by_doc.values():
            covered = _union([(max(0, s.start - window + 1), s.start) for s in pieces])
            own = [(s.start, s.start + s.length) for s in pieces]
            total += sum(hi - lo for lo, hi in covered)
            total -= sum(max(0, min(hi, b) - max(lo, a)) for lo, hi in covered for a, b in own)
        needed.append(total)
    return needed


def _union(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Disjoint intervals covering the half-open `spans`."""
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(s for s in spans if s[1] > s[0]):
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(hi, merged[-1][1]))
        else:
            merged.append((lo, hi))
    return merged


def window_recv_tokens(plan: Plan, window: int, comm: str) -> list[int]:
    """Per rank, the rows one window layer's forward exchange delivers from other ranks
    (`comm`: "full", "compact" or "needed"; the backward sends as many back)."""
    n = plan.cp_size
    if comm == "full":
        check_window(window)
        return [(n - 1) * plan.tokens_per_rank] * n
    if comm == "compact":
        return [(n - 1) * max(window_send_tokens(plan, window))] * n
    if comm == "needed":
        return window_needed_tokens(plan, window)
    raise ValueError(f"window layers exchange by full, compact or needed, got comm={comm!r}")


def window_recv_bytes(plan: Plan, window: int, comm: str, num_kv_heads: int = 1, head_dim: int = 1,
                      dtype_bytes: int = 2, v_head_dim: int | None = None) -> list[int]:  # fmt: skip
    """`window_recv_tokens` in bytes of K and V over all KV heads (`row_bytes`)."""
    per_row = row_bytes(num_kv_heads, head_dim, dtype_bytes, v_head_dim)
    return [t * per_row for t in window_recv_tokens(plan, window, comm)]


def window_metrics(plan: Plan, window: int) -> dict[str, float]:
    """One window layer's exchange on the busiest rank, beside the full layers' of
    `Plan.metrics`: rows received compact and needed, and as ratios of the full all-gather."""
    full = (plan.cp_size - 1) * plan.tokens_per_rank
    rows = {mode: max(window_recv_tokens(plan, window, mode)) for mode in ("compact", "needed")}
    out: dict[str, float] = {f"window_{mode}_tokens": r for mode, r in rows.items()}
    out.update({f"window_{mode}_ratio": r / full if full else 0.0 for mode, r in rows.items()})
    return out
