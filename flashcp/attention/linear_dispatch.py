"""Plan -> what one rank's linear-attention layers run on: piece batches, summary routes, conv taps.

    d = build_linear_dispatch(plan, rank)        # once per step, on the host, no communication

Built from the replicated plan like `flashcp.dispatch.build_dispatch` (same local row order,
`token_index`), so the per-layer op (`flashcp.attention.linear_cp`) reads no device data back:

- `first`: the pieces that start their document (whole documents included), which need no
  state; `continued`: the others; `middle`: continued pieces that are not last, whose summaries
  need M.
- The summary tables, on each cut document's composer (`flashcp.plan.linear.composers`): local B
  rows are the `first` batch's final states picked by `first_summaries`, then the `middle` batch's;
  local M rows are the `middle` batch's. `b_route` / `m_route` send the rows of documents another
  rank composes to it; the tables the fold indexes are `cat([received, local])`.
- The fold, for the documents this rank composes (most pieces first): piece 1's initial state is
  its document's B_0 (`fold_init`), piece i + 1's is M_i S + B_i of piece i's (`fold_steps[i - 1]`,
  for the documents with a piece i + 1: a prefix). The states, step after step, form one table;
  `state_route` sends each continued piece's row to its owner, and `init_index` picks this rank's
  continued pieces' initial states from `cat([received, composed])`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from flashcp.dispatch import _map_tensors
from flashcp.plan.linear import composers, doc_pieces, halo_sources, Piece
from flashcp.plan.plan import Plan


@dataclass(frozen=True)
class PieceBatch:
    """Some local pieces as one varlen batch: their rows (local indices, in batch order) and lengths."""

    rows: torch.Tensor
    lens: tuple[int, ...]


@dataclass(frozen=True)
class Route:
    """An all-to-all-v of table rows: `send_index` grouped by destination rank, row counts per peer.
    `active`: some rank of the group sends (every rank then takes part, possibly with nothing)."""

    send_index: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    active: bool


@dataclass(frozen=True)
class LinearDispatch:
    rank: int
    cp_size: int
    token_index: torch.Tensor  # [T] window position of each local row
    first: PieceBatch
    continued: PieceBatch
    middle: PieceBatch
    inverse: torch.Tensor  # cat([first rows, continued rows])[inverse] is local order
    first_summaries: torch.Tensor  # first-batch sequences that are not last: their final state is a B row
    b_route: Route
    m_route: Route
    fold_init: torch.Tensor  # B row of the first piece of each document this rank composes
    fold_steps: tuple[tuple[torch.Tensor, torch.Tensor], ...]  # (M rows, B rows) for a prefix of those
    state_route: Route  # composed initial states to the owners of the continued pieces
    init_index: torch.Tensor  # [len(continued)] rows of cat([received, composed]) in continued's order
    halo_route: Route
    conv_index: torch.Tensor  # [T, W] into cat([zero row, received halo rows, local rows])

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> LinearDispatch:
        """`fn` on every tensor (to move or pin the dispatch), the fold's (M rows, B rows) pairs included."""
        steps = tuple((fn(m), fn(b)) for m, b in self.fold_steps)
        return dataclasses.replace(_map_tensors(self, fn), fold_steps=steps)


def _batch(pieces: list[Piece]) -> PieceBatch:
    rows = [torch.arange(p.local_start, p.local_start + p.length) for p in pieces]
    lens = tuple(p.length for p in pieces)
    return PieceBatch(torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long), lens)


def _route(sends: list[tuple[int, object, int]], recvs: list[tuple[int, object]], n: int, active: bool
           ) -> tuple[Route, dict]:  # fmt: skip
    """A route from (destination, key, local row) triples and the (source, key) pairs received;
    returns it and each received key's row in the receive buffer. Both sides order a peer's rows
    by key, which names the same row on both (a piece (doc, index), or the owner's local row)."""
    sends, recvs = sorted(set(sends)), sorted(set(recvs))
    send_splits, recv_splits = [0] * n, [0] * n
    for dest, *_ in sends:
        send_splits[dest] += 1
    for src, _ in recvs:
        recv_splits[src] += 1
    index = torch.tensor([row for *_, row in sends], dtype=torch.long)
    return Route(index, send_splits, recv_splits, active), {key: i for i, (_, key) in enumerate(recvs)}


def build_linear_dispatch(plan: Plan, rank: int, conv_width: int = 4) -> LinearDispatch:
    """Rank `rank`'s linear-attention dispatch under `plan` (see the module docstring)."""
    n = plan.cp_size
    if not 0 <= rank < n:
        raise ValueError(f"rank {rank} out of range for cp_size {n}")
    if conv_width < 1:
        raise ValueError(f"conv_width must be positive, got {conv_width}")
    docs = doc_pieces(plan)
    index = {(p.owner, p.local_start): (d, j) for d, pieces in enumerate(docs) for j, p in enumerate(pieces)}
    mine = []  # (doc, piece) in local order
    row = 0
    for shard in plan.ranks[rank]:
        mine.append(index[rank, row])
        row += shard.length
    first = [dj for dj in mine if dj[1] == 0]
    continued = [dj for dj in mine if dj[1] > 0]
    middle = [(d, j) for d, j in mine if 0 < j < len(docs[d]) - 1]
    held = {dj: docs[dj[0]][dj[1]] for dj in mine}
    composer = composers(plan, docs)

    # Summary tables on the composers: local B rows (first batch's, then middle's) and middle M rows,
    # received rows before them.
    first_sent = [i for i, (d, _) in enumerate(first) if len(docs[d]) > 1]
    local_b = [first[i] for i in first_sent] + middle
    tables = []
    for local, from_piece in ((local_b, 0), (middle, 1)):
        sends = [(composer[d], (d, i), row) for row, (d, i) in enumerate(local) if composer[d] != rank]
        recvs = [(p.owner, (d, i)) for d, pieces in enumerate(docs) if composer[d] == rank
                 for i, p in enumerate(pieces[:-1]) if i >= from_piece and p.owner != rank]  # fmt: skip
        route, at = _route(sends, recvs, n, any(len(pieces) > 1 + from_piece for pieces in docs))
        at.update({dj: len(recvs) + row for row, dj in enumerate(local)})
        tables.append((route, at))
    (b_route, b_at), (m_route, m_at) = tables

    # The fold's steps and the composed table: step j - 1 gives the initial states of the pieces j.
    composed = sorted((d for d in range(len(docs)) if composer[d] == rank), key=lambda d: (-len(docs[d]), d))
    longest = max((len(docs[d]) for d in composed), default=0)
    fold_steps = tuple(
        (torch.tensor([m_at[d, i] for d in composed if len(docs[d]) > i + 1], dtype=torch.long),
         torch.tensor([b_at[d, i] for d in composed if len(docs[d]) > i + 1], dtype=torch.long))
        for i in range(1, longest - 1)
    )  # fmt: skip
    state_at = {}
    for j in range(1, longest):
        reaching = [d for d in composed if len(docs[d]) > j]
        state_at.update({(d, j): len(state_at) + k for k, d in enumerate(reaching)})
    sends = [(docs[d][j].owner, (d, j), row) for (d, j), row in state_at.items() if docs[d][j].owner != rank]
    recvs = [(composer[d], (d, j)) for d, j in continued if composer[d] != rank]
    state_route, states = _route(sends, recvs, n, any(len(pieces) > 1 for pieces in docs))
    states.update({dj: len(recvs) + row for dj, row in state_at.items()})

    # Convolution taps: local rows shifted back; rows before a continued piece from the halo.
    halo = {(d, j): halo_sources(docs[d], j, conv_width) for d, j in continued}
    recvs = [(owner, (owner, r)) for rows in halo.values() for owner, r in rows if owner != rank]
    sends = [(p.owner, r, r) for d, pieces in enumerate(docs) for j, p in enumerate(pieces) if p.owner != rank
             for owner, r in halo_sources(pieces, j, conv_width) if owner == rank]  # fmt: skip
    halo_route, halo_at = _route(sends, recvs, n, any(len(pieces) > 1 for pieces in docs))
    local = _batch([held[dj] for dj in mine])
    offset = torch.cat([torch.arange(length) for length in local.lens])  # row within its piece
    back = torch.arange(conv_width - 1, -1, -1)  # how far each tap reaches back
    local0 = 1 + sum(halo_route.recv_splits)
    taps = torch.where(offset[:, None] >= back, local0 + torch.arange(len(offset))[:, None] - back, 0)
    for dj, before in halo.items():  # taps before a continued piece; those before its document stay 0
        start = held[dj].local_start
        for t in range(min(conv_width - 1, held[dj].length)):
            for w in range(conv_width - 1 - t):  # the taps before the piece
                h = len(before) - (conv_width - 1 - w - t)  # their row in `before`, if the document has it
                if h >= 0:
                    owner, r = before[h]
                    taps[start + t, w] = local0 + r if owner == rank else 1 + halo_at[owner, r]

    doc_start = [0]
    for length in plan.doc_lens:
        doc_start.append(doc_start[-1] + length)
    first_b, cont_b = _batch([held[dj] for dj in first]), _batch([held[dj] for dj in continued])
    return LinearDispatch(
        rank=rank,
        cp_size=n,
        token_index=torch.cat([doc_start[d] + held[d, j].start + torch.arange(held[d, j].length)
                               for d, j in mine]),
        first=first_b,
        continued=cont_b,
        middle=_batch([held[dj] for dj in middle]),
        inverse=torch.cat([first_b.rows, cont_b.rows]).argsort(),
        first_summaries=torch.tensor(first_sent, dtype=torch.long),
        b_route=b_route,
        m_route=m_route,
        fold_init=torch.tensor([b_at[d, 0] for d in composed], dtype=torch.long),
        fold_steps=fold_steps,
        state_route=state_route,
        init_index=torch.tensor([states[dj] for dj in continued], dtype=torch.long),
        halo_route=halo_route,
        conv_index=taps,
    )
