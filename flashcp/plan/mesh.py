"""One FlashCP plan over a whole data-parallel x context-parallel mesh.

A step waits for its slowest DP group, and windows of different groups differ severalfold in
attention work. Planning the step's global batch (DP x C tokens) over all DP x CP ranks as one
FlashCP group balances across groups as the planner balances inside one: every rank holds C / CP
tokens, most documents stay whole on one rank, and only the heaviest are cut.

A flat plan over all ranks would spread each Per-Doc document over every rank of the mesh, so it
plans in two levels, each FlashCP's hybrid planner (`plan_flashcp`):
1. nodes: the documents over the nodes, each holding `ranks_per_node` ranks' tokens; only the
   documents a node cannot hold within the target are cut across nodes;
2. the ranks of each node: the node's whole documents plus a pad standing for the tokens of the
   cut documents' pieces it holds (pad = those tokens mod the node's ranks, so that the rest splits
   evenly); then each such piece is laid out head-tail over the node's ranks
   (`balanced_head_tail`, its cost counted at the piece's offset in its document), taking each
   rank's pad and share of tokens and the work the rank still misses of the node's mean.
Ranks are node-major: mesh rank r is local rank r % ranks_per_node of node r // ranks_per_node.
With one node the plan is `plan_shards(doc_lens, ranks, "flashcp")`'s. The plan depends on the
lengths alone, so every rank computes the same one and reads only its own tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

from flashcp.plan.hybrid import apportion, balanced_head_tail, plan_flashcp
from flashcp.plan.plan import normalize, normalized, Plan, Shard, shard_workload, validate


def plan_mesh(
    doc_lens: Sequence[int], dp: int, cp: int, ranks_per_node: int = 8, target_imbalance: float = 1.05
) -> Plan:
    """Plan a step's global batch (documents in stream order, DP x C tokens) over `dp * cp` ranks
    on nodes of `ranks_per_node` (fewer when the mesh is smaller), balancing causal pairs to
    `target_imbalance` at both levels. `info["node_cut"]` lists the documents cut across nodes."""
    lens = tuple(int(x) for x in doc_lens)
    if not lens or any(x <= 0 for x in lens):
        raise ValueError("doc_lens must be a non-empty list of positive integers")
    if min(dp, cp, ranks_per_node) < 1:
        raise ValueError(f"dp, cp and ranks_per_node must be >= 1, got {dp}, {cp}, {ranks_per_node}")
    n = dp * cp
    g = min(ranks_per_node, n)
    if n % g or sum(lens) % n:
        raise ValueError(f"{n} ranks must fill nodes of {g} and divide the batch's {sum(lens)} tokens")
    per_rank = sum(lens) // n
    if n == g:
        node_shards = [[Shard(d, 0, x) for d, x in enumerate(lens)]]
    else:
        node_shards = normalize(plan_flashcp(lens, n // g, target_imbalance)[0])
    ranks: list[list[Shard]] = []
    for shards in node_shards:
        ranks += _node_ranks(lens, shards, g, per_rank, target_imbalance)
    cut = sorted({s.doc for shards in node_shards for s in shards if s.length < lens[s.doc]})
    out, *rows = normalized(ranks)
    plan = Plan(lens, n, out, "mesh", {"node_cut": cut, "nodes": n // g, "ranks_per_node": g})
    validate(plan, rows)
    return plan


def _node_ranks(
    lens: tuple[int, ...], shards: Sequence[Shard], g: int, per_rank: int, target_imbalance: float
) -> list[list[Shard]]:
    """One node's shards laid out over its `g` ranks (level 2 of the module docstring)."""
    whole = [s for s in shards if s.length == lens[s.doc]]
    pieces = [s for s in shards if s.length < lens[s.doc]]
    pad = sum(s.length for s in pieces) % g
    sub = [s.length for s in whole] + ([pad] if pad else [])
    ranks: list[list[Shard]] = [[] for _ in range(g)]
    work, taken = [0] * g, [per_rank] * g  # taken: tokens each rank takes of the pieces
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
