"""One FlashCP plan over a whole data-parallel x context-parallel mesh.

A step waits for its slowest DP group, and windows of different groups differ severalfold in
attention work. Planning the step's global batch (DP x C tokens) over all DP x CP ranks as one
FlashCP group balances across groups as the planner balances inside one: every rank holds C / CP
tokens, most documents stay whole on one rank, and only the heaviest are cut.

What a cut costs is the rows its later pieces' ranks receive: a rank receives, per document it holds
a piece of, about that document's prefix. Spreading every heavy document over all ranks (Per-Doc)
makes each rank receive the prefixes of all of them (at 512 ranks, 5 GiB a layer); so the plan is
two levels over the node layout, each cutting a document over the fewest units balance needs:
- nodes (`_nodes`): the heavy documents, heaviest first, each whole on a node whose work it leaves
  within the goal (its room counted at the light documents' density), else in contiguous pieces, each
  as long as the node with the most spare work takes; the light ones fill the room left whole
  (`place_documents`, the few that fit nowhere cut to fill it), and trades (`rebalance`) even out
  what placement left.
- ranks (`_split`): each node's whole documents by FlashCP's hybrid planner over its ranks, as a
  per-group plan would, and its pieces head-tail over the node's ranks.
A document is thus cut across nodes when its length or work needs it, over about as many nodes as it
takes nodes' mean work, or as one of the few fillers of exact token counts and trades. Ranks are
node-major: mesh rank r is local rank r % ranks_per_node of node r // ranks_per_node. With one node
the plan is `plan_shards(doc_lens, ranks, "flashcp")`'s. The plan depends on the lengths alone, so every rank
computes the same one and reads only its own tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from flashcp.plan.fill import RankFill
from flashcp.plan.hybrid import apportion, balanced_head_tail, plan_flashcp
from flashcp.plan.plan import normalized, Plan, Shard, shard_workload, validate
from flashcp.plan.rebalance import rebalance
from flashcp.plan.whole_doc import GOAL_SHARE, place_documents

# Documents longer than 1 / HEAVY of a node's tokens or heavier than 1 / HEAVY of its mean work are placed
# one by one over the nodes, cut where the node with the most spare work cannot hold them (`_nodes`).
HEAVY = 32


def plan_mesh(
    doc_lens: Sequence[int], dp: int, cp: int, ranks_per_node: int = 8, target_imbalance: float = 1.05
) -> Plan:
    """Plan a step's global batch (documents in stream order, DP x C tokens) over `dp * cp` ranks
    on nodes of `ranks_per_node` (fewer when the mesh is smaller), balancing causal pairs to
    `target_imbalance` inside each node. `info["node_cut"]` lists the documents cut across nodes,
    `info["spans"]` maps each document spread over nodes for its length or work to its node count."""
    lens = tuple(int(x) for x in doc_lens)
    if not lens or any(x <= 0 for x in lens):
        raise ValueError("doc_lens must be a non-empty list of positive integers")
    if min(dp, cp, ranks_per_node) < 1:
        raise ValueError(f"dp, cp and ranks_per_node must be >= 1, got {dp}, {cp}, {ranks_per_node}")
    n = dp * cp
    g = min(ranks_per_node, n)
    if n % g or sum(lens) % n:
        raise ValueError(f"{n} ranks must fill nodes of {g} and divide the batch's {sum(lens)} tokens")
    nodes, spans = [[Shard(d, 0, x) for d, x in enumerate(lens)]], {}
    if n > g:
        nodes, spans = _nodes(lens, n // g, sum(lens) // (n // g), 1 + GOAL_SHARE * (target_imbalance - 1))
    on: dict[int, set[int]] = {}
    for node, shards in enumerate(nodes):
        for s in shards:
            on.setdefault(s.doc, set()).add(node)
    cut = sorted(d for d, held in on.items() if len(held) > 1)
    per_rank = sum(lens) // n
    out, *rows = normalized([r for node in nodes for r in (_split(lens, node, g, per_rank, target_imbalance)
                                                            if g > 1 else [node])])  # fmt: skip
    plan = Plan(lens, n, out, "mesh", {"node_cut": cut, "spans": spans, "ranks_per_node": g})
    validate(plan, rows)
    return plan


def _nodes(
    lens: tuple[int, ...], nodes: int, per_node: int, goal: float
) -> tuple[list[list[Shard]], dict[int, int]]:
    """Each node's shards (the first level of the module docstring) and the documents cut over several
    nodes for their work or length, with their node counts.

    The heavy documents (more than 1 / HEAVY of a node's tokens or mean work) go heaviest first. Spare
    work is `goal` times the mean less a node's work and its room filled at the light documents' density.
    A heavy document goes whole, if some node has the spare and room for it, to the one `place_documents`
    would pick (the lowest load predicted at the density of the documents left); else piece by piece to
    the node with the most spare: the longest prefix of what is left that the spare takes, or, where that
    prefix would not fit the node's room, the suffix the spare takes (dense tokens, for a node whose room
    is short of its spare), or all that is left once no node has spare. The light ones fill the room left
    whole (`place_documents`, cutting the few that fit nowhere), and `rebalance` trades to the goal."""
    works = [shard_workload(0, x) for x in lens]
    mean = sum(works) / nodes
    light = [lens[d] * HEAVY <= per_node and works[d] * HEAVY <= mean for d in range(len(lens))]
    tokens = sum(x for x, small in zip(lens, light) if small)
    density = sum(w for w, small in zip(works, light) if small) / tokens if tokens else 0.0
    room, load = [per_node] * nodes, [0] * nodes
    held: list[list[Shard]] = [[] for _ in range(nodes)]
    rest_tokens, rest_work = sum(lens), sum(works)
    spans: dict[int, int] = {}
    for d in sorted((d for d in range(len(lens)) if not light[d]), key=lambda d: (-works[d], d)):
        rest_tokens, rest_work = rest_tokens - lens[d], rest_work - works[d]
        need = works[d] - lens[d] * density
        whole = [j for j in range(nodes)
                 if room[j] >= lens[d] and goal * mean - load[j] - room[j] * density >= need]  # fmt: skip
        if whole:  # as `place_documents`: the lowest load predicted at the density of the documents left
            rest = rest_work / rest_tokens if rest_tokens else 0.0
            j = min(whole, key=lambda j: (load[j] + works[d] + (room[j] - lens[d]) * rest, j))
            held[j].append(Shard(d, 0, lens[d]))
            room[j], load[j] = room[j] - lens[d], load[j] + works[d]
            continue
        lo, hi, used = 0, lens[d], 0  # [lo, hi): the part still to place
        while lo < hi:
            spare = [goal * mean - load[j] - room[j] * density if room[j] else -math.inf for j in range(nodes)]
            j = max(range(nodes), key=lambda j: (spare[j], -j))
            front = _fitting(lo, spare[j], density)
            if front >= hi - lo or spare[j] <= 0:
                piece = Shard(d, lo, min(hi - lo, room[j]))
            elif front <= room[j]:
                piece = Shard(d, lo, max(1, front))
            else:  # the prefix that fits the spare would not fit the room: take the dense end instead
                back = min(room[j], hi - lo, max(1, _fitting_end(hi, spare[j], density)))
                piece = Shard(d, hi - back, back)
            held[j].append(piece)
            room[j] -= piece.length
            load[j] += shard_workload(piece.start, piece.length)
            lo, hi = (lo + piece.length, hi) if piece.start == lo else (lo, hi - piece.length)
            used += 1
        if used > 1:
            spans[d] = used
    fill = RankFill(room)
    fill.shards, fill.work = held, load
    place_documents(lens, [d for d in range(len(lens)) if light[d]], fill)
    rebalance(lens, fill, goal * mean)
    return fill.shards, spans


def _fitting_end(end: int, spare: float, density: float) -> int:
    """The most tokens x before `end` of a document whose causal work less x * density is within `spare`:
    (2 end - x + 1) x / 2 - x density <= spare, the smaller root in x."""
    b = 2 * end + 1 - 2 * density
    return int((b - math.sqrt(max(0.0, b * b - 8 * spare))) / 2) if spare > 0 else 0


def _fitting(start: int, spare: float, density: float) -> int:
    """The most tokens x from `start` of a document whose causal work less x * density (the filler they
    displace) is within `spare`: (2 start + x + 1) x / 2 - x density <= spare, solved for x."""
    b = 2 * start + 1 - 2 * density
    return int((-b + math.sqrt(max(0.0, b * b + 8 * spare))) / 2) if spare > 0 else 0


def _split(
    lens: tuple[int, ...], shards: Sequence[Shard], g: int, per_unit: int, target_imbalance: float
) -> list[list[Shard]]:
    """One unit's shards laid out over its `g` sub-units of `per_unit` tokens each (a level of the
    module docstring): its whole documents by the hybrid planner, its pieces head-tail over all."""
    whole = [s for s in shards if s.length == lens[s.doc]]
    pieces = [s for s in shards if s.length < lens[s.doc]]
    pad = sum(s.length for s in pieces) % g
    sub = [s.length for s in whole] + ([pad] if pad else [])
    ranks: list[list[Shard]] = [[] for _ in range(g)]  # per sub-unit
    work, taken = [0] * g, [per_unit] * g  # taken: tokens each sub-unit takes of the pieces
    for r, held in enumerate(plan_flashcp(tuple(sub), g, target_imbalance)[0] if sub else ranks):
        for i, start, length in held:
            taken[r] -= length
            if i < len(whole):
                ranks[r].append(Shard(whole[i].doc, start, length))
                work[r] += shard_workload(start, length)
            else:
                taken[r] += length  # the pad's tokens are the pieces'
    if not pieces:
        return ranks
    left = sum(shard_workload(s.start, s.length) for s in pieces)
    mean = (sum(work) + left) / g
    for j, piece in enumerate(pieces):
        part = list(taken) if j == len(pieces) - 1 else apportion(taken, piece.length)
        taken = [t - p for t, p in zip(taken, part)]
        whole_work = shard_workload(piece.start, piece.length)
        wants = [(mean - w) * whole_work / left for w in work]  # the missing work's share
        left -= whole_work
        outermost = part.index(max(part))

        def cost(start: int, length: int, offset: int = piece.start) -> int:
            return shard_workload(offset + start, length)

        chunks, got, _ = balanced_head_tail(piece.doc, piece.length, part, wants, outermost, cost)
        for r, pair in enumerate(chunks):
            ranks[r] += [Shard(c.doc, piece.start + c.start, c.length) for c in pair]
        work = [w + x for w, x in zip(work, got)]
    return ranks
