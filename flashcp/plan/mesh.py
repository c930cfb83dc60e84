"""One FlashCP plan over a whole data-parallel x context-parallel mesh.

A step waits for its slowest DP group, and windows of different groups differ severalfold in
attention work. Planning the step's global batch (DP x C tokens) over all DP x CP ranks as one
FlashCP group balances across groups as the planner balances inside one: every rank holds C / CP
tokens, most documents stay whole on one rank, and only the heaviest are cut.

A flat plan over all ranks would spread each Per-Doc document over every rank of the mesh, so it
plans top-down over the node layout: groups of nodes, the fewest that hold the longest and the
heaviest document well within their share (`_group_size`), by Whole-Doc sharding (`plan_whole_doc`:
no group needs a document cut but to fill it exactly); then the nodes of each group and the ranks
of each node by FlashCP's hybrid planner (`plan_flashcp`). At each of these two levels a unit
splits its shards over its sub-units (`_split`): its whole documents, plus a pad standing for the
tokens of the cut documents' pieces it holds (pad = those tokens mod the sub-units, so that the rest
splits evenly), by the hybrid planner; then each piece head-tail over the sub-units
(`balanced_head_tail`, its cost counted at the piece's offset in its document), each taking its pad
and even share of tokens and the work it still misses of the unit's mean. A document is cut across
nodes only when a node cannot hold it within the target, and then over the nodes of one group.
Ranks are node-major: mesh rank r is local rank r % ranks_per_node of node r // ranks_per_node.
With one node the plan is `plan_shards(doc_lens, ranks, "flashcp")`'s. The plan depends on the
lengths alone, so every rank computes the same one and reads only its own tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

from flashcp.plan.hybrid import apportion, balanced_head_tail, plan_flashcp
from flashcp.plan.plan import normalize, normalized, Plan, Shard, shard_workload, validate
from flashcp.plan.whole_doc import plan_whole_doc

# A group of nodes is large enough when its longest document takes at most this share of its tokens
# and its heaviest at most this share of its mean work (`_group_size`).
HEAVY_SHARE = 0.5


def plan_mesh(
    doc_lens: Sequence[int], dp: int, cp: int, ranks_per_node: int = 8, target_imbalance: float = 1.05
) -> Plan:
    """Plan a step's global batch (documents in stream order, DP x C tokens) over `dp * cp` ranks
    on nodes of `ranks_per_node` (fewer when the mesh is smaller), balancing causal pairs to
    `target_imbalance` at every level. `info["node_cut"]` lists the documents cut across nodes,
    `info["groups"]` counts the groups of nodes."""
    lens = tuple(int(x) for x in doc_lens)
    if not lens or any(x <= 0 for x in lens):
        raise ValueError("doc_lens must be a non-empty list of positive integers")
    if min(dp, cp, ranks_per_node) < 1:
        raise ValueError(f"dp, cp and ranks_per_node must be >= 1, got {dp}, {cp}, {ranks_per_node}")
    n = dp * cp
    g = min(ranks_per_node, n)
    if n % g or sum(lens) % n:
        raise ValueError(f"{n} ranks must fill nodes of {g} and divide the batch's {sum(lens)} tokens")
    groups = n // g // _group_size(lens, n // g)
    units, tokens = [[Shard(d, 0, x) for d, x in enumerate(lens)]], sum(lens)
    if groups > 1:  # no group holds a heavy document: Whole-Doc, cutting only to fill each exactly
        tokens //= groups
        units = normalize(plan_whole_doc(lens, groups, target_imbalance)[0])
    levels = [k for k in (n // g // groups, g) if k > 1] or [1]
    node_units = units
    for k in levels:
        tokens //= k
        units = [sub for unit in units for sub in normalize(_split(lens, unit, k, tokens, target_imbalance))]
        if len(units) == n // g:
            node_units = units
    cut = sorted({s.doc for shards in node_units for s in shards if s.length < lens[s.doc]})
    out, *rows = normalized(units)
    plan = Plan(lens, n, out, "mesh", {"node_cut": cut, "groups": groups, "ranks_per_node": g})
    validate(plan, rows)
    return plan


def _group_size(lens: tuple[int, ...], nodes: int) -> int:
    """Nodes per group: the fewest (a power of two dividing `nodes`) whose group could hold the longest
    document within HEAVY_SHARE of its tokens and the heaviest within HEAVY_SHARE of its mean work, so
    that Whole-Doc can fill the groups and a document cut across nodes spreads over one group's, not all."""
    works = [shard_workload(0, x) for x in lens]
    size = 1
    while size < nodes and nodes % (2 * size) == 0:
        share = HEAVY_SHARE * size / nodes
        if max(lens) <= share * sum(lens) and max(works) <= share * sum(works):
            break
        size *= 2
    return size


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
