"""What a linear-attention layer (Gated DeltaNet) sends under a plan: state summaries and conv halos.

A document kept whole on one rank needs nothing from anyone. A cut document's pieces run
concurrently, so each piece continued on another rank needs the state its predecessors leave:
every non-last piece sends its affine summary `S_out = M S_in + B` (per value head `B [d_k, d_v]`,
and `M [d_k, d_k]` unless it is the document's first piece, whose S_in is zero) to each other
rank holding a later piece of its document, which folds them in order. The short causal
convolution before it (width W, 4 in Qwen3.5) needs each continued piece's W - 1 preceding
pre-convolution rows, from whichever ranks hold them (several when pieces are shorter than W - 1).

`linear_comm` predicts the forward bytes per rank of one layer (the backward sends the same bytes
back); `flashcp.attention.linear_cp` sends exactly these, which tests/test_linear_cp.py checks.
`state_all_gather_bytes` prices the alternative, one compact all-gather of every rank's summaries.
"""

from __future__ import annotations

from typing import NamedTuple

from flashcp.plan.plan import Plan


class Piece(NamedTuple):
    """One shard seen from its document: where it starts, how long, which rank, its first local row."""

    start: int
    length: int
    owner: int
    local_start: int


def doc_pieces(plan: Plan) -> list[list[Piece]]:
    """Per document, its pieces in document order."""
    docs: list[list[Piece]] = [[] for _ in plan.doc_lens]
    for rank, shards in enumerate(plan.ranks):
        row = 0
        for s in shards:
            docs[s.doc].append(Piece(s.start, s.length, rank, row))
            row += s.length
    for pieces in docs:
        pieces.sort()
    return docs


def summary_values(heads: int, k_dim: int, v_dim: int, first: bool) -> int:
    """Values in one piece's summary: B, and M unless the piece starts its document."""
    return heads * k_dim * (v_dim + (0 if first else k_dim))


def halo_sources(pieces: list[Piece], j: int, width: int) -> list[tuple[int, int]]:
    """(owner, owner's local row) of the up to `width - 1` rows before piece `j` of one document,
    in document order: the taps of the causal convolution that reach back before the piece."""
    rows = []
    for pos in range(max(0, pieces[j].start - width + 1), pieces[j].start):
        i = max(i for i in range(j) if pieces[i].start <= pos)
        rows.append((pieces[i].owner, pieces[i].local_start + pos - pieces[i].start))
    return rows


class LinearComm(NamedTuple):
    """Forward bytes of one linear-attention layer, per rank."""

    state_sent: list[int]
    state_recv: list[int]
    halo_sent: list[int]
    halo_recv: list[int]


def linear_comm(plan: Plan, heads: int, k_dim: int, v_dim: int, conv_channels: int, *, state_bytes: int = 4,
                dtype_bytes: int = 2, conv_width: int = 4) -> LinearComm:  # fmt: skip
    """Bytes each rank sends and receives: summaries at `state_bytes` (float32), halo rows of
    `conv_channels` values at `dtype_bytes`. A row needed by several pieces on one rank, or a
    summary by several of its pieces, travels once."""
    n = plan.cp_size
    out = LinearComm([0] * n, [0] * n, [0] * n, [0] * n)
    for pieces in doc_pieces(plan):
        for i, p in enumerate(pieces[:-1]):
            size = summary_values(heads, k_dim, v_dim, i == 0) * state_bytes
            for dest in {q.owner for q in pieces[i + 1:]} - {p.owner}:
                out.state_sent[p.owner] += size
                out.state_recv[dest] += size
        rows = {(q.owner, src) for j, q in enumerate(pieces) for src in halo_sources(pieces, j, conv_width)}
        for dest, (owner, _) in rows:
            if owner != dest:
                out.halo_sent[owner] += conv_channels * dtype_bytes
                out.halo_recv[dest] += conv_channels * dtype_bytes
    return out


def state_all_gather_bytes(plan: Plan, heads: int, k_dim: int, v_dim: int, state_bytes: int = 4) -> int:
    """Bytes every rank receives if each instead all-gathers all non-last pieces' summaries,
    padded to the largest rank's: (N - 1) x that rank's summaries."""
    held = [0] * plan.cp_size
    for pieces in doc_pieces(plan):
        for i, p in enumerate(pieces[:-1]):
            held[p.owner] += summary_values(heads, k_dim, v_dim, i == 0) * state_bytes
    return (plan.cp_size - 1) * max(held)
