"""What a linear-attention layer (Gated DeltaNet) sends under a plan: state summaries and conv halos.

A document kept whole on one rank needs nothing from anyone. A cut document's pieces run
concurrently, so each piece continued on another rank needs the state its predecessors leave.
Every non-last piece has an affine summary `S_out = M S_in + B` (per value head `B [d_k, d_v]`,
and `M [d_k, d_k]` unless it is the document's first piece, whose S_in is zero). One owner of the
document's pieces, its composer (`composers`), receives the others' summaries, folds them in order
and sends each continued piece its initial state (one `[d_k, d_v]` per value head). Sending every
summary to every rank holding a later piece instead costs a piece the summaries of all pieces
before it: with Per-Doc's 2N pieces a document that is 2N x N summaries per layer, gigabytes a
layer at CP 32 (Qwen3.5 9B, 128K, benchmarks/linear_state.py); through the composer it is 2N to
one rank and one state to each. The short causal convolution before it (width W, 4 in Qwen3.5)
needs each continued piece's W - 1 preceding pre-convolution rows, from whichever ranks hold them
(several when pieces are shorter than W - 1).

`linear_comm` predicts the forward bytes per rank of one layer (the backward sends the same bytes
back); `flashcp.attention.linear_cp` sends exactly these, which tests/test_linear_cp.py checks.
`state_all_gather_bytes` prices the alternative, one compact all-gather of every rank's summaries.
`LinearLayers` is what the planner charges for these layers (`Workload.linear`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
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
    i = j - 1
    for pos in range(pieces[j].start - 1, max(0, pieces[j].start - width + 1) - 1, -1):  # backwards: i only falls
        while pieces[i].start > pos:
            i -= 1
        rows.append((pieces[i].owner, pieces[i].local_start + pos - pieces[i].start))
    return rows[::-1]


def composers(plan: Plan, docs: list[list[Piece]] | None = None) -> list[int | None]:
    """Per document, the rank that folds its pieces' summaries (None: kept whole). Cut documents,
    most pieces first, each take the owner of one of its pieces that leaves the busiest rank's
    received states lowest so far (then the fewest in all, then the lowest rank): the composer
    receives the summaries of pieces other ranks hold, each other owner one state per piece.
    Counted in units of d_k x d_v a value head (a first piece's B 1, a middle piece's [B | M] 2,
    exact where d_k = d_v, as in Qwen3.5 and Qwen3-Next), so the choice needs no model shapes and
    every rank makes the same one from the plan alone."""
    docs = doc_pieces(plan) if docs is None else docs
    load = [0] * plan.cp_size
    out: list[int | None] = [None] * len(docs)
    cut = [d for d, pieces in enumerate(docs) if len(pieces) > 1]
    for d in sorted(cut, key=lambda d: (-len(docs[d]), d)):
        pieces = docs[d]
        summaries: dict[int, int] = {}  # per owner, its non-last pieces' summary units
        continued: dict[int, int] = {}  # per owner, its pieces after the first (one state each)
        for i, p in enumerate(pieces):
            summaries[p.owner] = summaries.get(p.owner, 0) + (0 if i == len(pieces) - 1 else 1 if i == 0 else 2)
            continued[p.owner] = continued.get(p.owner, 0) + (i > 0)
        # the busiest rank if c composes: c itself, the busiest other owner, or a rank outside
        others = sorted(((load[o] + continued[o], o) for o in continued), reverse=True)[:2]
        outside = max((x for r, x in enumerate(load) if r not in continued), default=0)
        total, base = sum(summaries.values()), sum(load) + sum(continued.values())

        def cost(c: int) -> tuple[int, int, int]:
            busiest_other = next((x for x, o in others if o != c), 0)
            mine = load[c] + total - summaries[c]
            return max(mine, busiest_other, outside), base + total - summaries[c] - continued[c], c

        c = min(continued, key=cost)
        out[d] = c
        for o in continued:
            load[o] += total - summaries[c] if o == c else continued[o]
    return out


class LinearComm(NamedTuple):
    """Forward bytes of one linear-attention layer, per rank."""

    state_sent: list[int]
    state_recv: list[int]
    halo_sent: list[int]
    halo_recv: list[int]


def linear_comm(plan: Plan, heads: int, k_dim: int, v_dim: int, conv_channels: int, *, state_bytes: int = 4,
                dtype_bytes: int = 2, conv_width: int = 4) -> LinearComm:  # fmt: skip
    """Bytes each rank sends and receives: summaries to each cut document's composer and initial
    states from it at `state_bytes` (float32), halo rows of `conv_channels` values at `dtype_bytes`.
    A halo row needed by several pieces on one rank travels once."""
    n = plan.cp_size
    out = LinearComm([0] * n, [0] * n, [0] * n, [0] * n)
    state = summary_values(heads, k_dim, v_dim, True) * state_bytes
    middle = summary_values(heads, k_dim, v_dim, False) * state_bytes
    docs = doc_pieces(plan)
    for pieces, c in zip(docs, composers(plan, docs)):
        for i, p in enumerate(pieces):
            if c is None or p.owner == c:
                continue
            if i < len(pieces) - 1:  # its summary to the composer
                out.state_sent[p.owner] += state if i == 0 else middle
                out.state_recv[c] += state if i == 0 else middle
            if i > 0:  # its initial state from the composer
                out.state_sent[c] += state
                out.state_recv[p.owner] += state
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


@dataclass(frozen=True)
class LinearLayers:
    """A hybrid model's Gated DeltaNet layers as the planner prices them (`Workload.linear`), in forward
    FLOPs (the backward is about twice each term, so the ratios balance depends on hold).

    Every token costs its recurrence: per value head three products with the d_k x d_v state
    (`token_flops`; the projections and convolution are per token in every layer kind, uniform over
    ranks, so balance leaves them out as it leaves out the MLP). Only cut documents add work
    (`cut_work`): a middle piece runs the chunked kernel a second time over `[v | 0]` from `[0 | I]`
    for its M (d_k + d_v state columns), and the composer of a document of m pieces folds m - 2
    summaries (S <- M S + B: d_k x d_k x d_v per value head). With `kv_row_bytes` (a full layer's K/V
    row, `row_bytes`) the planner also weighs the state and halo bytes a cut sends (`exchange_tokens`)."""

    layers: int
    heads: int  # value heads
    key_dim: int
    value_dim: int
    pair_flops: int  # forward FLOPs of one (query, key) pair in one attending layer: 4 x heads x head_dim
    kv_row_bytes: int = 0
    full_layers: int = 1  # the layers whose K/V rows the compact all-gather sends
    conv_channels: int = 0  # pre-convolution channels (q, k and v), the halo rows' width
    conv_width: int = 4

    def __post_init__(self) -> None:
        sizes = (self.layers, self.heads, self.key_dim, self.value_dim, self.pair_flops)
        if not all(isinstance(v, int) and v > 0 for v in sizes):
            raise ValueError(f"linear layers, heads, key and value dims and pair FLOPs must be positive "
                             f"integers, got {sizes}")

    @property
    def token_flops(self) -> int:
        """One token's recurrence over all linear layers: 3 products x 2 FLOPs a multiply-add."""
        return self.layers * 6 * self.heads * self.key_dim * self.value_dim

    def cut_work(self, plan: Plan) -> list[int]:
        """Per rank, the FLOPs cut documents add: middle pieces' summary pass, and the composer's folds."""
        h, dk, dv = self.heads, self.key_dim, self.value_dim
        work = [0] * plan.cp_size
        docs = doc_pieces(plan)
        for pieces, c in zip(docs, composers(plan, docs)):
            for p in pieces[1:-1]:
                work[p.owner] += self.layers * p.length * 6 * h * dk * (dk + dv)
            if c is not None:
                work[c] += self.layers * (len(pieces) - 2) * 2 * h * dk * dk * dv
        return work

    def exchange_tokens(self, plan: Plan) -> int:
        """The busiest rank's state and halo bytes received over the linear layers, as the K/V rows that
        many bytes would add to each rank's share of the full layers' compact all-gather (0 without
        `kv_row_bytes`): what the planner adds to its largest send buffer when it compares plans."""
        if not self.kv_row_bytes:
            return 0
        comm = linear_comm(plan, self.heads, self.key_dim, self.value_dim, self.conv_channels,
                           conv_width=self.conv_width)  # fmt: skip
        recv = max(s + h for s, h in zip(comm.state_recv, comm.halo_recv))
        per_token = max(1, plan.cp_size - 1) * self.full_layers * self.kv_row_bytes
        return math.ceil(self.layers * recv / per_token)


def _qwen3_5(layers: int, heads: int, value_heads: int) -> dict:
    """The text config.json keys `hybrid_from_hf` reads, of a Qwen3.5 dense model (TorchTitan's `qwen3_5`
    registry: every 4th layer full, 4 K/V heads of 256, 16 key heads; d_k = d_v = 128, conv width 4)."""
    return {"layer_types": ["linear_attention"] * 3 + ["full_attention"], "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": 4, "head_dim": 256,
            "linear_num_key_heads": 16, "linear_num_value_heads": value_heads, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4}  # fmt: skip


# named hybrid shapes (their text config.json keys); tests/titan/test_hybrid_counting.py holds them to TorchTitan
HYBRID_SHAPES: dict[str, dict] = {"qwen3_5_9b": _qwen3_5(32, 16, 32), "qwen3_5_27b": _qwen3_5(64, 24, 48)}


def hybrid_from_hf(config: dict, dtype_bytes: int = 2) -> LinearLayers:
    """The linear layers of a hybrid text config.json (Qwen3.5 `layer_types`, or Qwen3-Next's
    `full_attention_interval`; a vision-language one's `text_config`), priced against its full
    layers' pairs and K/V rows of `dtype_bytes`. KeyError / ValueError name what is missing."""
    text = config.get("text_config", config)
    layers = text["num_hidden_layers"]
    kinds = text.get("layer_types") or [
        "full_attention" if (i + 1) % text["full_attention_interval"] == 0 else "linear_attention"
        for i in range(layers)
    ]
    kinds = [kinds[i % len(kinds)] for i in range(layers)]  # a pattern shorter than the layers repeats
    full = kinds.count("full_attention")
    if not full or full == layers:
        raise ValueError(f"a hybrid needs both full and linear attention layers, this config has {full} "
                         f"full of {layers}")
    heads, dk, dv = text["linear_num_value_heads"], text["linear_key_head_dim"], text["linear_value_head_dim"]
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    return LinearLayers(
        layers=layers - full, heads=heads, key_dim=dk, value_dim=dv,
        pair_flops=4 * text["num_attention_heads"] * head_dim,
        kv_row_bytes=2 * text["num_key_value_heads"] * head_dim * dtype_bytes, full_layers=full,
        conv_channels=2 * text["linear_num_key_heads"] * dk + heads * dv, conv_width=text["linear_conv_kernel_dim"],
    )  # fmt: skip


def hybrid_shape(name_or_path: str) -> LinearLayers:
    """`hybrid_from_hf` of a named shape (`HYBRID_SHAPES`) or of a config.json file; ValueError in one line."""
    if name_or_path in HYBRID_SHAPES:
        return hybrid_from_hf(HYBRID_SHAPES[name_or_path])
    try:
        with open(name_or_path) as f:
            return hybrid_from_hf(json.load(f))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{name_or_path}: neither {' nor '.join(HYBRID_SHAPES)} nor a readable hybrid "
                         f"config.json ({type(e).__name__}: {e})") from None  # fmt: skip


def contiguous_all_gather_bytes(cp_size: int, heads: int, k_dim: int, v_dim: int, state_bytes: int = 4) -> int:
    """Bytes every rank receives per layer when the window is split in N contiguous chunks and each rank
    all-gathers every chunk's summary `[B | M]` (flash-linear-attention's context parallelism)."""
    return (cp_size - 1) * summary_values(heads, k_dim, v_dim, first=False) * state_bytes


def linear_metrics(plan: Plan, lin: LinearLayers, dtype_bytes: int = 2) -> dict[str, float]:
    """One linear layer's forward bytes under `plan`: state summaries received, busiest rank and mean;
    conv halo rows, busiest rank; the contiguous split's summary all-gather; and the full layers' K/V
    all-gather (`lin.kv_row_bytes` a row) for scale."""
    comm = linear_comm(plan, lin.heads, lin.key_dim, lin.value_dim, lin.conv_channels, dtype_bytes=dtype_bytes,
                       conv_width=lin.conv_width)  # fmt: skip
    n = plan.cp_size
    return {
        "state_recv_bytes": max(comm.state_recv), "state_recv_bytes_mean": sum(comm.state_recv) / n,
        "halo_recv_bytes": max(comm.halo_recv),
        "state_contiguous_bytes": contiguous_all_gather_bytes(n, lin.heads, lin.key_dim, lin.value_dim),
        "kv_all_gather_bytes": (n - 1) * plan.tokens_per_rank * lin.kv_row_bytes,
    }
