"""Pipeline parallelism in the step model: the schedule's bubble and the stages' sends (MODELLED).

A pipeline of `p` ranks runs `m` microbatches (FlashCP: `[training] local_batch_size`, one packed
window each), each rank `v` stages (v = 1 for GPipe and 1F1B; v > 1 for Interleaved1F1B). With `t`
the time of one microbatch's forward + backward (+ full AC's recompute) on a rank's whole share of
the layers, every rank does m x t of work; the schedule adds the fill and drain:

- GPipe and 1F1B: the last microbatch's forward leaves rank 0 after m forwards and reaches the
  last rank p - 1 forwards later, its backward returns as many: the step is (m + p - 1) x t and the
  bubble (p - 1) / (m + p - 1) of it (Narayanan et al. 2021, "Efficient Large-Scale Language Model
  Training on GPU Clusters", eq. 1; 1F1B changes what is in flight, not the bubble).
- Interleaved1F1B with v stages per rank: the fill and drain run chunks of t / v, so the step is
  (v m + p - 1) x t / v and the bubble (p - 1) / (v m + p - 1) (the same paper, section 2.2.2).
- Point-to-point: at every stage boundary each microbatch sends its activations forward and their
  gradients back, one bf16 row of `dim` per token of the rank (divided by TP under sequence
  parallelism, each TP rank sending its sequence shard). ASSUMED: not overlapped (torch's schedules
  wait for a stage's receive before it computes), so each of the (v m + p - 1) slots of the critical
  path pays one send each way; across nodes at one NIC's achieved rate (`fabric.Fabric.nic`) plus
  NCCL's network hop latency, inside a node at NVLink's `nvlink_gbps`.

`in_flight` is the number of microbatch-stages whose activations a rank holds at once, from torch's
own schedules (torch.distributed.pipelining.schedules): GPipe all m; 1F1B min(m, p - rank) (its
warmup); Interleaved1F1B its warmup ops + 1, capped at v m (`_get_warmup_ops`, multiply_factor 2).
"""

from __future__ import annotations

from dataclasses import dataclass

from flashcp.costmodel.fabric import Fabric

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")  # the ones modelled here
NVLINK_GBPS = 300.0  # ASSUMED: a point-to-point send between two GPUs of one node (NVLink 4, 450 GB/s a way)


def _schedule(schedule: str) -> str:
    for name in SCHEDULES:
        if name.lower() == schedule.lower():
            return name
    raise ValueError(f"schedule {schedule!r} is not modelled (modelled: {', '.join(SCHEDULES)})")


def bubble_fraction(schedule: str, p: int, m: int, v: int = 1) -> float:
    """The share of a pipelined step that a rank idles: (p - 1) / (v m + p - 1), v = 1 but for interleaved."""
    name = _schedule(schedule)
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"p, m and v must be >= 1, got {p}, {m}, {v}")
    if name != "Interleaved1F1B" and v != 1:
        raise ValueError(f"{name} runs one stage per rank, got v = {v}")
    return (p - 1) / (v * m + p - 1)


def in_flight(schedule: str, p: int, m: int, rank: int, v: int = 1) -> int:
    """Microbatch-stages whose saved activations pipeline rank `rank` holds at its peak (torch's schedules)."""
    name = _schedule(schedule)
    if not 0 <= rank < p:
        raise ValueError(f"rank {rank} outside a pipeline of {p}")
    if name == "GPipe":
        return m
    if name == "1F1B":
        return min(m, p - rank)
    from torch.distributed.pipelining.schedules import _get_warmup_ops

    rounds = max(1, m // p)  # torch's Interleaved1F1B: number_of_rounds, microbatches_per_round
    return min(v * m, _get_warmup_ops(rank, v, m // rounds, p, m, multiply_factor=2) + 1)


def p2p_ms(tokens: int, dim: int, tp: int = 1, sequence_parallel: bool = True, across_nodes: bool = True,
           fabric: Fabric | None = None) -> float:
    """One stage boundary's send of one microbatch's activations (or their gradients), ms."""
    nbytes = tokens * dim * 2 / (tp if sequence_parallel else 1)
    if across_nodes:
        fabric = fabric or Fabric()
        return nbytes / (fabric.nic * 1e9) * 1e3 + fabric.network_hop_us / 1e3
    return nbytes / (NVLINK_GBPS * 1e9) * 1e3


@dataclass(frozen=True)
class PipelineStep:
    """A pipelined step (ms): the work, the bubble and the sends on the critical path."""

    total: float
    work: float  # m x t: what every rank computes
    bubble: float  # (p - 1) x t / v idle
    p2p: float  # 2 sends per slot of the critical path
    bubble_fraction: float  # of the step without the sends: (p - 1) / (v m + p - 1)


def pipeline_step(schedule: str, p: int, m: int, microbatch_ms: float, send_ms: float = 0.0,
                  v: int = 1) -> PipelineStep:
    """`microbatch_ms`: one microbatch's forward + backward (+ recompute) on one rank's layers (all its
    v stages); `send_ms`: one boundary's send of one microbatch (`p2p_ms`), paid both ways per slot."""
    frac = bubble_fraction(schedule, p, m, v)
    slots = v * m + p - 1
    work, bubble = m * microbatch_ms, (p - 1) * microbatch_ms / v
    p2p = 2 * slots * send_ms if p > 1 else 0.0
    return PipelineStep(total=work + bubble + p2p, work=work, bubble=bubble, p2p=p2p, bubble_fraction=frac)
