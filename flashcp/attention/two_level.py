"""The two-level KV exchange of a CP group that spans nodes: the fabric once per node, then NVLink.

    dispatch = build_two_level_dispatch(plan, rank, ranks_per_node=8)
    out = cp_varlen_attention(q, k, v, dispatch, group, comm="two_level")

    # a sliding-window layer (HF sliding_window W): only the rows the windows reach
    dispatch = build_two_level_dispatch(plan, rank, ranks_per_node=8, window=W)
    out = cp_varlen_attention(q, k, v, dispatch, group, comm="two_level", window=W)

The "needed" all-to-all-v sends a piece of KV to every rank that attends to it, so a piece that
three ranks of another node need crosses the fabric three times, on the sender's one NIC. Here
(ranks node-major, `ranks_per_node` per node; `flashcp.plan.nodes` counts the rows):

- stage 1 (fabric): each rank sends each of its pieces once to every other node that needs it,
  to the rank there on the same rail (local index), so every transfer is NIC to NIC on one rail;
- stage 2 (NVLink): each rank forwards what it received to the node-mates that need it, together
  with its own pieces they need (same-node traffic goes direct, as in "needed").

A piece travels as the suffix its receivers' windows reach (all of it without a window): stage 1
carries the longest suffix any rank of the destination node needs, stage 2 each rank its own.

Both stages are one all-to-all-v over the CP group (stage 1 has only inter-node splits, stage 2
only intra-node ones); launched asynchronously, stage 1 runs under whatever precedes the wait
(`overlap=True`: the local-only shards) and stage 2 at the wait. Stage 2's output is the receive
buffer: the dispatch's `kv_index` points straight into it, so no permutation is copied. The
backward runs the transposes in reverse order and sums a forwarded piece's gradients on the proxy
before they cross the fabric once.

This module builds the routes on the host from the plan (O(pieces x ranks)) and runs the two
stages; `flashcp.attention.collectives` calls it for dispatches whose comm is "two_level".
`EXCHANGES` names every exchange the op runs (a job's `[flashcp] comm`), and
`group_ranks_per_node` reads `ranks_per_node` off where a CP group's ranks sit, refusing a layout
the routes cannot describe.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from flashcp.dispatch import build_dispatch, COMM_MODES, Dispatch, expand_ranges
from flashcp.plan.nodes import doc_pieces
from flashcp.plan.plan import Plan

# Every KV exchange `cp_varlen_attention` runs: `build_dispatch`'s modes, this module's and the
# ring's (`flashcp.attention.ring`).
EXCHANGES = (*COMM_MODES, "two_level", "ring")


class NodeLayoutError(ValueError):
    """A CP group whose ranks do not sit in equal contiguous blocks per node (the message names them)."""


def group_ranks_per_node(nodes: Sequence[int]) -> int:
    """The `ranks_per_node` of a CP group whose rank r runs on node `nodes[r]`.

    The routes put CP ranks r // ranks_per_node on one node, so the group's ranks must form equal
    contiguous blocks per node in CP-rank order; any other layout raises `NodeLayoutError`."""
    blocks = [(node, len(list(run))) for node, run in itertools.groupby(nodes)]
    sizes = {size for _, size in blocks}
    if len(blocks) == len({node for node, _ in blocks}) and len(sizes) == 1:
        return sizes.pop()
    where, first = [], 0
    for node, size in blocks:
        ranks = f"{first}-{first + size - 1}" if size > 1 else f"{first}"
        where.append(f"{ranks} on node {node}")
        first += size
    raise NodeLayoutError(
        f"the two-level exchange needs a CP group's ranks in equal contiguous blocks per node, in CP-rank "
        f"order; CP ranks {', '.join(where)}"
    )


@dataclass(frozen=True)
class TwoLevelRoute:
    """Rows and splits of the two stages for one rank (splits per rank of the CP group)."""

    ranks_per_node: int
    stage1_index: torch.Tensor  # local rows sent over the fabric, grouped by destination (proxy)
    stage1_send_splits: list[int]
    stage1_recv_splits: list[int]
    stage2_index: torch.Tensor  # rows of cat([stage-1 output, local rows]) sent over NVLink
    stage2_send_splits: list[int]
    stage2_recv_splits: list[int]


@dataclass(frozen=True)
class TwoLevelDispatch(Dispatch):
    """A `Dispatch` with comm "two_level": the receive buffer is stage 2's output."""

    route: TwoLevelRoute | None = None


def build_two_level_dispatch(
    plan: Plan, rank: int, ranks_per_node: int, overlap: bool = False, window: int | None = None
) -> TwoLevelDispatch:
    """Rank `rank`'s dispatch for the two-level exchange; ranks r // ranks_per_node share a node.
    With `overlap`, also the split of `cp_varlen_attention(overlap=True)` (local-only shards run
    while stage 1 crosses the fabric); with `window`, for a sliding-window layer of W keys."""
    n, g = plan.cp_size, ranks_per_node
    if g < 1 or n % g:
        raise ValueError(f"ranks_per_node={g} must be a positive divisor of the CP size {n}")
    # the same shards, queries and key lengths; also checks the window
    needed = build_dispatch(plan, rank, "needed", overlap, window)
    node = [r // g for r in range(n)]
    local_start, pieces_of = _local_pieces(plan)
    needers = _needers(doc_pieces(plan), window)  # piece -> {rank attending to it: rows it reaches}
    need_nodes: dict[tuple, dict[int, int]] = {}  # piece -> {node: the longest suffix its ranks reach}
    for p, rs in needers.items():
        reach = need_nodes.setdefault(p, {})
        for r, rows in rs.items():
            reach[node[r]] = max(reach.get(node[r], 0), rows)
    mine = node[rank]
    forwarded = [s for s in range(n) if node[s] != mine]  # sources whose pieces arrive via a proxy

    # stage 1: my pieces' suffixes to the rail-mate of every other node that needs them
    s1_rows, s1_send = _Ranges(), [0] * n
    for a in sorted(set(node) - {mine}):
        for p in pieces_of[rank]:
            rows = need_nodes[p].get(a, 0)
            if rows:
                s1_rows.add(local_start[p] + p[2] - rows, rows)
                s1_send[a * g + rank % g] += rows
    # what arrives here in stage 1, and where each piece's suffix ends in stage 1's output
    s1_recv, end1, offset = [0] * n, {}, 0
    for s in forwarded:
        if s % g == rank % g:
            for p in pieces_of[s]:
                rows = need_nodes[p].get(mine, 0)
                if rows:
                    offset += rows
                    end1[p] = offset
                    s1_recv[s] += rows
    n1 = offset

    def segment(src: int, dest: int) -> list[tuple[tuple, int]]:
        """(piece, rows) `src` hands `dest` in stage 2: its own, then those it forwards, in that order."""
        own = pieces_of[src] if src != dest else []
        ahead = [p for s in forwarded if s % g == src % g for p in pieces_of[s]]
        return [(p, needers[p][dest]) for p in own + ahead if dest in needers[p]]

    s2_rows, s2_send, s2_recv, recv_pos, offset = _Ranges(), [0] * n, [0] * n, {}, 0
    for peer in range(mine * g, mine * g + g):
        for p, rows in segment(rank, peer):  # what I send to `peer`: the suffix of a piece it needs
            end = n1 + local_start[p] + p[2] if p[3] == rank else end1[p]
            s2_rows.add(end - rows, rows)
            s2_send[peer] += rows
        for p, rows in segment(peer, rank):  # what `peer` sends me
            recv_pos[p], offset = offset, offset + rows
            s2_recv[peer] += rows
    recv_size = offset

    # The needed dispatch's keys point into its own buffer (sources in rank order, window order
    # within, each piece's suffix, then the local rows): move each received row to where stage 2
    # delivers it.
    moved = _Ranges()
    for s in range(n):
        for p in pieces_of[s] if s != rank else ():
            if rank in needers[p]:
                moved.add(recv_pos[p], needers[p][rank])
    moved.add(recv_size, plan.tokens_per_rank)
    remap = moved.index()
    split = needed.overlap
    if split is not None:  # the remote shards' keys move like all keys; local ones read local K/V
        split = replace(split, remote=replace(split.remote, kv_index=remap[split.remote.kv_index]))
    s1_index, s2_index = s1_rows.index(), s2_rows.index()
    route = TwoLevelRoute(g, s1_index, s1_send, s1_recv, s2_index, s2_send, s2_recv)
    base = {f.name: getattr(needed, f.name) for f in fields(Dispatch)}
    base.update(comm="two_level", send_index=route.stage1_index, send_pad=0, send_splits=s1_send,
                recv_splits=s2_recv, recv_size=recv_size, kv_index=remap[needed.kv_index], overlap=split)  # fmt: skip
    return TwoLevelDispatch(**base, route=route)


class _Ranges:
    """Row ranges collected on the host, expanded into one index tensor without a Python loop."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.lengths: list[int] = []

    def add(self, start: int, length: int) -> None:
        self.starts.append(start)
        self.lengths.append(length)

    def index(self) -> torch.Tensor:
        return expand_ranges(torch.tensor(self.starts, dtype=torch.long), torch.tensor(self.lengths, dtype=torch.long))


def _local_pieces(plan: Plan) -> tuple[dict[tuple, int], list[list[tuple]]]:
    """Pieces as (doc, start, length, owner), each rank's in local order, and their local first row."""
    local_start, pieces_of = {}, []
    for owner, shards in enumerate(plan.ranks):
        row, mine = 0, []
        for s in shards:
            piece = (s.doc, s.start, s.length, owner)
            local_start[piece], row = row, row + s.length
            mine.append(piece)
        pieces_of.append(mine)
    return local_start, pieces_of


def _needers(docs: dict[int, list[tuple[int, int, int]]], window: int | None) -> dict[tuple, dict[int, int]]:
    """Every piece -> {each other rank holding a later piece of its document: the rows of the piece
    that rank attends to}: all of them, or with a window the suffix its first later piece's window
    reaches (W - 1 rows before that piece's start, `flashcp.plan.window`)."""
    out = {}
    for doc, pieces in docs.items():
        first_later: dict[int, int] = {}  # owner -> start of its first piece after the current one
        for start, length, owner in reversed(pieces):
            end = start + length
            reach = {r: length if window is None else min(length, end - a + window - 1)
                     for r, a in first_later.items() if r != owner}  # fmt: skip
            out[(doc, start, length, owner)] = {r: rows for r, rows in reach.items() if rows > 0}
            first_later[owner] = start
    return out


Record = Callable[[str, str, int, int, torch.Tensor], None]


class _Staged:
    """Stage 1 in flight; `wait()` completes it, then runs stage 2 (which forwards its output)."""

    def __init__(self, work: Any, stage2: Callable[[], None]) -> None:
        self.work, self.stage2 = work, stage2

    def wait(self) -> None:
        self.work.wait()
        self.stage2()


def launch(recv: torch.Tensor, local: torch.Tensor, dispatch: TwoLevelDispatch, comms: Any, async_op: bool,
           record: Record) -> tuple[Any, torch.Tensor]:  # fmt: skip
    """Start stage 1 into a buffer of its own and run stage 2 into `recv`, the receive buffer: at
    once, or with `async_op` when the returned handle is waited for (so the work done before the
    wait overlaps the fabric stage). Returns the handle and stage 1's send rows to keep alive."""
    route, me = dispatch.route, dispatch.rank
    send1 = local.index_select(0, route.stage1_index)
    out1 = local.new_empty(sum(route.stage1_recv_splits), *local.shape[1:])
    work = comms.all_to_all(out1, send1, route.stage1_recv_splits, route.stage1_send_splits, async_op)
    record("two_level_inter", "forward", len(send1), len(out1), send1)

    def stage2() -> None:
        send2 = torch.cat([out1, local]).index_select(0, route.stage2_index)
        comms.all_to_all(recv, send2, route.stage2_recv_splits, route.stage2_send_splits)
        record("two_level_intra", "forward", len(send2) - route.stage2_send_splits[me],
               len(recv) - route.stage2_recv_splits[me], send2)  # fmt: skip

    if async_op:
        return _Staged(work, stage2), send1
    stage2()
    return None, send1


def backward(grad_recv: torch.Tensor, local_rows: int, dispatch: TwoLevelDispatch, comms: Any,
             record: Record) -> torch.Tensor:  # fmt: skip
    """The transposed stages: the gradient every other rank computed for this rank's local rows."""
    route, me = dispatch.route, dispatch.rank
    n1 = sum(route.stage1_recv_splits)
    back2 = grad_recv.new_empty(len(route.stage2_index), *grad_recv.shape[1:])
    comms.all_to_all(back2, grad_recv, route.stage2_send_splits, route.stage2_recv_splits)
    record("two_level_intra", "backward", len(grad_recv) - route.stage2_recv_splits[me],
           len(back2) - route.stage2_send_splits[me], back2)  # fmt: skip
    # a forwarded piece's gradients from every node-mate sum here, then cross the fabric once
    summed = grad_recv.new_zeros(n1 + local_rows, *grad_recv.shape[1:])
    summed.index_add_(0, route.stage2_index, back2)
    back1 = grad_recv.new_empty(len(route.stage1_index), *grad_recv.shape[1:])
    comms.all_to_all(back1, summed[:n1], route.stage1_send_splits, route.stage1_recv_splits)
    record("two_level_inter", "backward", n1, len(back1), back1)
    return summed[n1:].index_add(0, route.stage1_index, back1)
