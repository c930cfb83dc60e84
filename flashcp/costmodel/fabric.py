"""Collectives of CP and FSDP groups that span nodes: NVLink inside a node, the fabric across (MODELLED).

The single-node model (`comm.CommModel`) reads measured nccl-tests tables; no table exists for a
group of 16-64 GPUs on several nodes, so such groups are priced with an alpha-beta model of how
NCCL runs them, from these constants (each with its source; change them to match a cluster):

- NVLink inside a node: the measured tables themselves (8 x H200, NVLink 4: all-gather bus
  bandwidth 367 GB/s at 8 GiB; H100 SXM has the same NVLink 4, 900 GB/s bidirectional per GPU,
  NVIDIA H100 datasheet), at the same buffer size as the collective being priced.
- The fabric: one 400 Gb/s ConnectX-7 NIC per GPU (NVIDIA DGX H100 datasheet: 8 single-port
  ConnectX-7, 400 Gb/s InfiniBand NDR), 50 GB/s per direction at line rate. ASSUMED: NCCL achieves
  90 % of it, 45 GB/s per NIC (`nic_gbps`, `nic_efficiency`).
- Latency: NCCL's own tuning model (NVIDIA/nccl `src/graph/tuning.cc`, commit 01afd20): a ring
  collective costs base + (steps - inter-node steps) x NVLink hop + inter-node steps x network
  hop, with the Simple protocol's base 8.4 us, NVLink hop 3.4 us and network hop 9.6 us.

What is priced (g = ranks of the group per node, m = N / g nodes, ranks node-major):
- all-gather / reduce-scatter (NCCL's ring; the cited tuning model has trees for all-reduce only):
  NCCL builds one ring per NIC, each leaving a node on its own rail, and every ring edge carries
  all N - 1 other chunks, so the bus bandwidth is the lower of NVLink's (the g-rank table at the
  buffer size) and g NICs' (g x nic). With a whole
  node in the group (g = 8) the fabric's 8 x 45 = 360 GB/s is about NVLink's: a ring across
  nodes is not slower per byte; with one rank per node (g = 1) it falls to one NIC's 45 GB/s.
- all-to-all-v (the "needed" mode): rows for a remote rank cross NVLink to the sender's node-mate
  on the receiver's rail and leave through that GPU's NIC (NCCL's PXN), rows for node-mates go
  over NVLink, all at once: latency + max(the busiest NIC's rows / nic, the busiest GPU's NVLink
  rows at the single-node all-to-all rate); `flashcp.plan.nodes` counts the rows.
- two-level (`flashcp.plan.nodes`): stage 1 over the fabric, each row once per node that needs it,
  NIC to NIC on one rail, then stage 2 over NVLink; the two stages run one after the other.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from flashcp.costmodel.comm import CommModel, interpolated_busbw
from flashcp.costmodel.model import COLLECTIVE_SYSTEMS, CostModel, MemoryCosts
from flashcp.costmodel.kernel import KernelModel
from flashcp.costmodel.profiles import CollectiveTable, ProfileError
from flashcp.plan.nodes import NodeTraffic, node_traffic
from flashcp.plan.plan import Plan


@dataclass(frozen=True)
class Fabric:
    """The constants of the multi-node model; see the module docstring for their sources."""

    gpus_per_node: int = 8  # DGX / HGX H100
    nic_gbps: float = 50.0  # one 400 Gb/s ConnectX-7 per GPU, line rate per direction (GB/s)
    nic_efficiency: float = 0.9  # ASSUMED: NCCL's achieved share of the line rate
    group_ranks_per_node: int | None = None  # a group's ranks per node; None: whole nodes (min(N, gpus))
    base_latency_us: float = 8.4  # NCCL tuning.cc, ring / Simple
    nvlink_hop_us: float = 3.4
    network_hop_us: float = 9.6

    @property
    def nic(self) -> float:
        """Achieved bandwidth of one NIC, GB/s."""
        return self.nic_gbps * self.nic_efficiency

    def ranks_per_node(self, n_ranks: int) -> int:
        g = min(n_ranks, self.group_ranks_per_node or self.gpus_per_node)
        if n_ranks % g:
            raise ProfileError(f"a group of {n_ranks} ranks does not fill nodes of {g} ranks")
        return g

    def ring_latency_ms(self, n_ranks: int) -> float:
        """NCCL's ring latency of an all-gather / reduce-scatter on `n_ranks` (N - 1 steps)."""
        nodes = n_ranks // self.ranks_per_node(n_ranks)
        inter = nodes - 1
        return (self.base_latency_us + (n_ranks - 1 - inter) * self.nvlink_hop_us
                + inter * self.network_hop_us) / 1e3  # fmt: skip


class MultiNodeComm(CommModel):
    """`CommModel` whose groups may span nodes: measured tables inside one, the fabric model across."""

    spans_nodes = True

    def __init__(self, tables: Iterable[CollectiveTable], fabric: Fabric | None = None):
        super().__init__(tables)
        self.fabric = fabric or Fabric()

    def spans(self, n_ranks: int) -> bool:
        return n_ranks > self.fabric.ranks_per_node(n_ranks)

    def ring_busbw(self, op: str, size: float, n_ranks: int) -> float:
        """Bus bandwidth (GB/s) of NCCL's ring over nodes: min(NVLink's at `size`, g NICs')."""
        g = self.fabric.ranks_per_node(n_ranks)
        rails = g * self.fabric.nic
        return rails if g == 1 else min(interpolated_busbw(self.table(op, g), size), rails)

    def _ring_ms(self, op: str, per_rank_bytes: float, n_ranks: int) -> float:
        size = n_ranks * per_rank_bytes
        if size <= 0:
            return 0.0
        moved = size * (n_ranks - 1) / n_ranks
        return self.fabric.ring_latency_ms(n_ranks) + moved / (self.ring_busbw(op, size, n_ranks) * 1e9) * 1e3

    def all_gather_ms(self, per_rank_bytes: float, n_ranks: int) -> float:
        if not self.spans(n_ranks):
            return super().all_gather_ms(per_rank_bytes, n_ranks)
        return self._ring_ms("all_gather", per_rank_bytes, n_ranks)

    def reduce_scatter_ms(self, per_rank_bytes: float, n_ranks: int) -> float:
        if not self.spans(n_ranks):
            return super().reduce_scatter_ms(per_rank_bytes, n_ranks)
        return self._ring_ms("reduce_scatter", per_rank_bytes, n_ranks)

    def _intra_ms(self, link_bytes: float, g: int) -> float:
        """Point-to-point traffic of one rank to its node-mates, at the single-node all-to-all rate."""
        return super().all_to_all_ms(link_bytes, g) if g > 1 and link_bytes > 0 else 0.0

    def _fabric_ms(self, link_bytes: float, nodes: int) -> float:
        if link_bytes <= 0:
            return 0.0
        return self.fabric.network_hop_us * (nodes - 1) / 1e3 + link_bytes / (self.fabric.nic * 1e9) * 1e3

    def needed_ms(self, traffic: NodeTraffic, row_bytes: int) -> float:
        """The flat all-to-all-v: every NIC's and GPU's rows at once, the busiest one's time."""
        g, n = traffic.ranks_per_node, len(traffic.needed)
        inter = max(max(traffic.flat_inter_send), max(traffic.flat_inter_recv)) * row_bytes
        intra = max(max(traffic.flat_intra_send), max(traffic.flat_intra_recv)) * row_bytes
        latency = self.fabric.base_latency_us / 1e3
        return latency + max(self._fabric_ms(inter, n // g), self._intra_ms(intra, g))

    def two_level_ms(self, traffic: NodeTraffic, row_bytes: int) -> float:
        """Stage 1 over the fabric (deduplicated per node, rail to rail), then stage 2 over NVLink."""
        g, n = traffic.ranks_per_node, len(traffic.needed)
        inter = max(max(traffic.stage1_send), max(traffic.stage1_recv)) * row_bytes
        intra = max(max(traffic.stage2_send), max(traffic.stage2_recv)) * row_bytes
        latency = 2 * self.fabric.base_latency_us / 1e3  # two collectives
        return latency + self._fabric_ms(inter, n // g) + self._intra_ms(intra, g)


# The collective systems on many nodes: FlashCP's plan with the two-level needed exchange too.
MULTINODE_SYSTEMS: dict[str, tuple[str, str, bool]] = {
    **COLLECTIVE_SYSTEMS,
    "flashcp_two_level": ("flashcp", "two_level", False),
}


class MultiNodeCostModel(CostModel):
    """`CostModel` of CP groups that may span nodes (its comm a `MultiNodeComm`)."""

    systems = MULTINODE_SYSTEMS

    def __init__(self, kernel: KernelModel, comm: MultiNodeComm, memory: MemoryCosts | None = None):
        super().__init__(kernel, comm, memory)
        self.comm: MultiNodeComm = comm

    def exchange_ms(
        self, plan: Plan, comm: str, row: int, pad: int, window: int | None = None
    ) -> tuple[float, float]:
        """A window layer's halo (`window`) is priced as the one-node model prices it, its
        all-to-all-v at the ring's rate over the nodes: conservative for rows sent point to point."""
        n = plan.cp_size
        if comm not in ("needed", "two_level") or not self.comm.spans(n) or window is not None:
            return super().exchange_ms(plan, comm, row, pad, window)
        traffic = node_traffic(plan, self.comm.fabric.ranks_per_node(n))
        t = self.comm.needed_ms(traffic, row) if comm == "needed" else self.comm.two_level_ms(traffic, row)
        return t, t  # the backward sends the same rows back (the transposed exchange)


def multinode_model(model: CostModel, fabric: Fabric | None = None) -> MultiNodeCostModel:
    """The same kernel, tables and memory constants as `model`, priced on many nodes."""
    comm = MultiNodeComm(model.comm.tables.values(), fabric)
    return MultiNodeCostModel(model.kernel, comm, model.memory)
