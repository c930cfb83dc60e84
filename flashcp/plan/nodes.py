"""KV traffic of a plan when its CP group spans nodes: what crosses the fabric, what stays on NVLink.

Ranks are placed node-major, `ranks_per_node` consecutive CP ranks per node (rank r on node
r // g, rail r % g: the rail is the GPU's own NIC, as in rail-optimised clusters). A piece of a
document is needed by the owners of its document's later pieces; two exchanges deliver it:

- flat "needed" (one all-to-all-v): every (source, receiver) pair gets its own copy, so a piece
  needed by three ranks of another node crosses the fabric three times. NCCL routes a row for a
  remote rank through the sender's node-mate on the receiver's rail (PXN, on by default since
  NCCL 2.12): an NVLink hop, then that GPU's NIC, so each NIC sends what its node owes its rail;
- "two_level": stage 1 sends each piece once to every other node that needs it, to the rank of the
  source's rail there (the proxy: NIC to NIC on one rail); stage 2 shares it over NVLink with the
  proxy's node-mates that need it, together with the pieces they need from their own node.

`node_traffic` counts both per rank, in rows (one row is one token's K and V over all KV heads).
Pure Python over the plan's pieces: O(pieces x ranks holding a later piece), no window-long tables.
"""

from __future__ import annotations

from dataclasses import dataclass

from flashcp.plan.plan import Plan


@dataclass(frozen=True)
class NodeTraffic:
    """Rows each rank sends / receives per link class, for the flat and the two-level exchange."""

    ranks_per_node: int
    needed: list[list[int]]  # needed[r][s]: rows rank r attends to that rank s holds (r != s)
    flat_inter_send: list[int]  # rows through the NIC of each rank's rail (what its node owes that rail)
    flat_inter_recv: list[int]
    flat_intra_send: list[int]  # NVLink: rows to node-mates, and to the node-mate on a receiver's rail
    flat_intra_recv: list[int]
    stage1_send: list[int]  # two-level, over the fabric (deduplicated per destination node)
    stage1_recv: list[int]
    stage2_send: list[int]  # two-level, over NVLink (forwarded rows + same-node rows)
    stage2_recv: list[int]

    def totals(self) -> dict[str, int]:
        """Rows summed over ranks: what the fabric and NVLink carry in all, per exchange."""
        return {
            "flat_inter": sum(self.flat_inter_recv),
            "flat_intra": sum(self.flat_intra_recv),
            "two_level_inter": sum(self.stage1_recv),
            "two_level_intra": sum(self.stage2_recv),
        }


def doc_pieces(plan: Plan) -> dict[int, list[tuple[int, int, int]]]:
    """Each document's pieces in window order as (start, length, owner)."""
    out: dict[int, list[tuple[int, int, int]]] = {}
    for owner, shards in enumerate(plan.ranks):
        for s in shards:
            out.setdefault(s.doc, []).append((s.start, s.length, owner))
    for pieces in out.values():
        pieces.sort()
    return out


def node_traffic(plan: Plan, ranks_per_node: int) -> NodeTraffic:
    """Per-rank rows of the flat and the two-level needed exchange (see the module docstring)."""
    n, g = plan.cp_size, ranks_per_node
    if g < 1 or n % g:
        raise ValueError(f"ranks_per_node={g} must divide the CP size {n}")
    node = [r // g for r in range(n)]
    needed = [[0] * n for _ in range(n)]
    stage1_send, stage1_recv = [0] * n, [0] * n
    for pieces in doc_pieces(plan).values():
        later: set[int] = set()  # owners of the pieces after the current one
        for _, length, owner in reversed(pieces):
            for r in later - {owner}:
                needed[r][owner] += length
            for a in {node[r] for r in later} - {node[owner]}:  # once per other node (stage 1)
                stage1_send[owner] += length
                stage1_recv[a * g + owner % g] += length
            later.add(owner)
    inter = [[needed[r][s] if node[r] != node[s] else 0 for s in range(n)] for r in range(n)]
    intra = [[needed[r][s] if node[r] == node[s] else 0 for s in range(n)] for r in range(n)]
    # Stage 2: proxy p forwards to r the rows r needs from remote sources on p's rail (p == r: a
    # local copy, no link); same-node rows go straight from their owner.
    def forwarded(r: int, p: int) -> int:
        return sum(inter[r][s] for s in range(p % g, n, g)) if p != r else 0

    stage2 = [[intra[r][p] + forwarded(r, p) if node[p] == node[r] else 0 for p in range(n)]
              for r in range(n)]
    # PXN: the rows s owes a remote r cross NVLink to s's node-mate on r's rail, then its NIC
    nic_send, hop_send, hop_recv = [0] * n, [0] * n, [0] * n
    for s in range(n):
        for r in range(n):
            if inter[r][s]:
                via = node[s] * g + r % g
                nic_send[via] += inter[r][s]
                if via != s:
                    hop_send[s] += inter[r][s]
                    hop_recv[via] += inter[r][s]
    return NodeTraffic(
        ranks_per_node=g,
        needed=needed,
        flat_inter_send=nic_send,
        flat_inter_recv=[sum(row) for row in inter],
        flat_intra_send=[sum(intra[r][s] for r in range(n)) + hop_send[s] for s in range(n)],
        flat_intra_recv=[sum(row) + hop_recv[r] for r, row in enumerate(intra)],
        stage1_send=stage1_send,
        stage1_recv=stage1_recv,
        stage2_send=[sum(stage2[r][p] for r in range(n)) for p in range(n)],
        stage2_recv=[sum(row) for row in stage2],
    )


def node_metrics(plan: Plan, ranks_per_node: int, row_bytes: int = 1) -> dict[str, int | float]:
    """The planner's figures of the needed exchange on nodes of `ranks_per_node` CP ranks: the
    busiest rank's fabric and NVLink rows (and bytes at `row_bytes` per row), flat vs two-level."""
    t = node_traffic(plan, ranks_per_node)

    def busiest(send: list[int], recv: list[int]) -> int:
        return max(max(send), max(recv))

    out: dict[str, int | float] = {
        "flat_inter_rows": busiest(t.flat_inter_send, t.flat_inter_recv),
        "flat_intra_rows": busiest(t.flat_intra_send, t.flat_intra_recv),
        "two_level_inter_rows": busiest(t.stage1_send, t.stage1_recv),
        "two_level_intra_rows": busiest(t.stage2_send, t.stage2_recv),
    }
    out.update({k.replace("_rows", "_bytes"): v * row_bytes for k, v in list(out.items())})
    totals = t.totals()
    out["fabric_rows_flat"], out["fabric_rows_two_level"] = totals["flat_inter"], totals["two_level_inter"]
    flat = totals["flat_inter"]
    out["fabric_saving"] = 1 - totals["two_level_inter"] / flat if flat else 0.0
    return out
