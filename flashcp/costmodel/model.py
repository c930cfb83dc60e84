"""Predicted time of one context-parallel attention layer, per CP system, from its sharding.

What is modelled: one attention layer's KV exchange, attention kernels and the data movement
around them, on N GPUs of one NVLink node. Everything else in a training step (projections,
MLP, optimizer) is identical across systems because every system gives every rank C / N tokens,
so speedups between systems are ratios of these layer times (as in the paper's Fig. 5-7).

Collective systems (one varlen kernel per rank over its shards, keys = document prefix + shard):
- llama3:  `per_seq` plan, all-gather of every rank's whole KV (full);
- per_doc: `per_doc` plan, full all-gather;
- flashcp: `flashcp` plan, compact all-gather of non-last-shard KV only;
- flashcp_needed: `flashcp` plan, all-to-all-v of exactly the prefix KV each rank attends to;
- flashcp_overlap: `flashcp` plan, compact all-gather, with the shards whose keys are all local
  (whole documents, first shards) computed while the all-gather is in flight: a rank finishes
  the forward at max(all-gather, local-only kernel) + the other shards' kernel, paying a second
  kernel call and the gathers of queries and outputs. The backward is ASSUMED not to overlap
  (the reduce-scatter is counted in full), which is conservative.
  inference = comm + max over ranks (KV copies + forward kernel)
  training  = inference + max over ranks (backward kernel + gradient copies) + transposed comm
  (reduce-scatter of dKV, or all-to-all-v back). The collective synchronises the ranks, so each
  pass waits for its slowest rank. KV copies are what our implementation moves through HBM:
  pack local KV, gather the send rows, gather every shard's keys (forward); the backward
  scatter-adds and returns them (ASSUMED 1.5x the forward bytes: read-modify-write).

Ring systems (P2P ring with blockwise kernels, step-synchronous):
- ring:   every document cut into N contiguous pieces, rank r holds piece r (the `ring` plan);
  at step j rank r attends its pieces to rank r-j's (causal at j = 0, full blocks after, idle
  when r < j);
- zigzag: every document cut into 2N chunks, rank r holds chunks r and 2N-1-r (the Per-Doc
  layout); at step j > 0 with source s = (r - j) mod N, rank r attends both its chunks to s's
  head chunk if s < r, else its tail chunk to both of s's chunks (balanced work every step).
  The calls are those `comm = "ring"` runs (`flashcp.plan.ring.ring_schedule`), and so are the
  bytes (`ring_transfers`). Each step is one varlen call (so it pays the per-call overhead and the short blocks' tile
  waste), overlapped with sending the current KV block to the next rank:
  step time = max(slowest rank's kernel + partial-result merge, P2P of one KV block).
  Merge (ASSUMED): the forward rescales and accumulates the fp32 output with the block's
  log-sum-exp in elementwise passes moving `merge_bytes_per_elem` bytes per output element;
  the backward accumulates dQ, dK, dV in fp32 (`grad_acc_bytes_per_elem`) and sends KV plus the
  fp32 dK/dV partial sums around the ring, and one last step returns dK/dV to their owner.

Sliding-window layers (`window` W, HF `sliding_window`; gpt-oss alternates them with full layers)
run on the same plan as the full layers, as `build_dispatch(..., window=W)` does: a shard's key
rows are its own plus at most W - 1 before it, and the kernel visits only the key blocks of the
band. A window layer exchanges by `window_exchange(comm, window_comm)`, the rule the trainer's
`[flashcp] window_comm` follows: with "auto" exactly the rows its windows reach (needed; two_level
for a two_level job), whatever the full layers' comm, since a compact all-gather pads every rank
to the busiest sender's W - 1 rows per cut shard; an explicit mode prices that one (compact: the
rows windows can reach, all-gathered, `flashcp.plan.window`). ASSUMED: Llama3 and Per-Doc CP
exchange a halo for their window layers, the W - 1 rows before each of their chunks, point to
point (the same rule: needed, not the full all-gather their full layers use); ring systems take no window.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np

from flashcp.costmodel.comm import CommModel
from flashcp.costmodel.kernel import KernelModel
from flashcp.costmodel.proxy import DENSE_MFU, H100_BF16_TFLOPS
from flashcp.plan import plan_shards
from flashcp.plan.plan import Plan, row_bytes
from flashcp.plan.ring import ring_schedule, ring_transfers
from flashcp.plan.window import window_needed_tokens, window_send_tokens

# system -> (planner strategy, KV communication mode, overlap local-only shards with the comm)
COLLECTIVE_SYSTEMS: dict[str, tuple[str, str, bool]] = {
    "llama3": ("per_seq", "full", False),
    "per_doc": ("per_doc", "full", False),
    "flashcp": ("flashcp", "compact", False),
    "flashcp_needed": ("flashcp", "needed", False),
    "flashcp_overlap": ("flashcp", "compact", True),
}
# KV exchange modes of the collective systems: the dispatch's, and the two-level exchange of CP
# groups that span nodes (flashcp.attention.two_level)
EXCHANGE_MODES = ("full", "compact", "needed", "two_level")
RING_SYSTEMS = ("ring", "zigzag")
SYSTEMS = (*COLLECTIVE_SYSTEMS, *RING_SYSTEMS)
WINDOW_COMMS = ("auto", *EXCHANGE_MODES)  # a sliding-window layer's exchange ([flashcp] window_comm)


def check_window_comm(window_comm: str) -> None:
    """ValueError unless `window_comm` names a window layer's exchange (`WINDOW_COMMS`)."""
    if window_comm not in WINDOW_COMMS:
        raise ValueError(f"unknown window exchange {window_comm!r}; choose one of {', '.join(WINDOW_COMMS)}")


def window_exchange(comm: str, window_comm: str = "auto") -> str:
    """The exchange of a sliding-window layer whose full layers exchange by `comm`: `window_comm` as
    given, or with "auto" the needed all-to-all-v (only the W - 1 rows before each cut; a compact
    all-gather pads every rank to the busiest sender, 72-87 % of the full all-gather at 128K on CP
    32-64, counted) and, for a two_level job, two_level (its routes already send a window's suffix once
    per node). ValueError naming the combination the dispatch cannot build."""
    check_window_comm(window_comm)
    if comm not in EXCHANGE_MODES:
        raise ValueError(f"sliding-window layers run beside comm {', '.join(EXCHANGE_MODES)}, not comm = {comm!r}")
    if window_comm == "two_level" and comm != "two_level":
        raise ValueError(f"window_comm = 'two_level' needs comm = 'two_level' (the node layout it routes by), "
                         f"got comm = {comm!r}")  # fmt: skip
    if window_comm != "auto":
        return window_comm
    return "two_level" if comm == "two_level" else "needed"


@dataclass(frozen=True)
class AttentionShape:
    """Heads and element size of the attention layer being modelled.

    MLA (DeepSeek-V3, Moonlight): `head_dim` is Q's and K's (qk_nope + rope, 192), `v_head_dim`
    V's (128), and with `kv_lora_rank` the exchange carries latent rows (`kv_lora_rank +
    rope_dim` values, `flashcp.attention.latent`) that each rank up-projects for its key rows.
    FlashAttention-2 takes one head dim, so the kernel is priced at the larger (V padded to 192:
    1.2x the matmul work of 192 / 128 unpadded, `flashcp.attention.kernels`)."""

    heads: int = 32
    kv_heads: int | None = None  # defaults to `heads` (MHA, as in the paper's Eq. 4)
    head_dim: int = 128
    dtype_bytes: int = 2  # bf16
    v_head_dim: int | None = None  # defaults to head_dim
    kv_lora_rank: int | None = None  # MLA: exchange latent rows instead of K/V
    rope_dim: int = 0  # MLA: the RoPE part of head_dim, shared by all heads

    @property
    def n_kv(self) -> int:
        return self.kv_heads or self.heads

    @property
    def v_dim(self) -> int:
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    @property
    def kernel_head_dim(self) -> int:
        """The head dim the kernel runs at: FlashAttention-2 pads V (or Q and K) to one."""
        return max(self.head_dim, self.v_dim)

    @property
    def kv_row_bytes(self) -> int:
        """Bytes of one token's K and V over all KV heads."""
        return row_bytes(self.n_kv, self.head_dim, self.dtype_bytes, self.v_dim)

    @property
    def exchange_row_bytes(self) -> int:
        """Bytes of one row the exchange moves: K and V, or the latent row with `kv_lora_rank`."""
        latent = None if self.kv_lora_rank is None else self.kv_lora_rank + self.rope_dim
        return row_bytes(self.n_kv, self.head_dim, self.dtype_bytes, self.v_dim, latent)

    @property
    def upproject_flops(self) -> float:
        """Forward FLOPs of up-projecting one latent row to every head's k_nope and v (0 without MLA)."""
        if self.kv_lora_rank is None:
            return 0.0
        return 2.0 * self.kv_lora_rank * self.heads * (self.head_dim - self.rope_dim + self.v_dim)

    @property
    def q_row_bytes(self) -> int:
        """Bytes of one token's query (or attention output) over all query heads."""
        return self.heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True)
class MemoryCosts:
    """Data-movement constants (ASSUMED, H100-class; override to match a measured machine)."""

    hbm_gbps: float = 2600.0  # achieved copy bandwidth (H100 SXM peak is 3350 GB/s)
    merge_bytes_per_elem: float = 32.0  # ring forward: fp32 out/lse rescale-and-add passes
    grad_acc_bytes_per_elem: float = 12.0  # ring backward: fp32 read + read + write per gradient
    ring_grad_bytes: int = 4  # ring backward sends fp32 dK/dV partial sums
    bwd_copy_ratio: float = 1.5  # collective systems: backward copy bytes / forward copy bytes
    gemm_tflops: float = DENSE_MFU * H100_BF16_TFLOPS  # MLA up-projection (the dense layers' rate)

    def ms(self, nbytes: float) -> float:
        return nbytes / (self.hbm_gbps * 1e9) * 1e3

    def gemm_ms(self, flops: float) -> float:
        return flops / (self.gemm_tflops * 1e12) * 1e3


@dataclass
class StepTime:
    """One attention layer's time split into the paper's Fig. 6 categories (ms)."""

    comm_fwd: float = 0.0  # exposed (not overlapped) forward KV communication
    comm_bwd: float = 0.0  # exposed backward communication (reduce-scatter / ring dKV)
    attn_fwd: float = 0.0
    attn_bwd: float = 0.0
    other_fwd: float = 0.0  # KV copies, ring merges
    other_bwd: float = 0.0
    per_rank_fwd: list[float] = field(default_factory=list)  # kernel time of every rank
    per_rank_bwd: list[float] = field(default_factory=list)

    @property
    def inference(self) -> float:
        return self.comm_fwd + self.attn_fwd + self.other_fwd

    @property
    def training(self) -> float:
        return self.inference + self.comm_bwd + self.attn_bwd + self.other_bwd

    def as_dict(self) -> dict[str, float]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("per_rank")}
        out.update(inference=self.inference, training=self.training)
        return out


class CostModel:
    """Kernel + collective + memory model of one CP attention layer; see the module docstring."""

    systems: dict[str, tuple[str, str, bool]] = COLLECTIVE_SYSTEMS  # the collective systems it prices

    def __init__(self, kernel: KernelModel, comm: CommModel, memory: MemoryCosts | None = None):
        self.kernel = kernel
        self.comm = comm
        self.memory = memory or MemoryCosts()

    # --- per-rank kernels --------------------------------------------------------------------

    def rank_attention_ms(
        self, plan: Plan, shape: AttentionShape, window: int | None = None
    ) -> tuple[list[float], list[float]]:
        """Forward and backward kernel time of every rank's single varlen call under `plan`."""
        fwd, bwd = [], []
        for shards in plan.ranks:
            f, b = self._call_ms(shards, shape, window)
            fwd.append(f)
            bwd.append(b)
        return fwd, bwd

    def _call_ms(self, shards, shape: AttentionShape, window: int | None = None) -> tuple[float, float]:
        q = np.array([s.length for s in shards], dtype=np.int64)
        k = np.array(key_rows(shards, window), dtype=np.int64)
        counts = self.kernel.counts(q, k, shape.heads, True, shape.kernel_head_dim, window)
        return self.kernel.fwd.time_ms(*counts), self.kernel.bwd.time_ms(*counts)

    # --- collective systems ------------------------------------------------------------------

    def collective_step(
        self, plan: Plan, comm: str, shape: AttentionShape, overlap: bool = False, window: int | None = None
    ) -> StepTime:
        """Step time of an all-gather (full / compact) or all-to-all-v (needed) system; of a
        sliding-window layer with `window` (see the module docstring)."""
        n, row = plan.cp_size, shape.exchange_row_bytes
        fwd, bwd = self.rank_attention_ms(plan, shape, window)
        local = plan.tokens_per_rank
        if comm not in EXCHANGE_MODES:
            raise ValueError(f"unknown comm mode {comm!r}; choose one of {', '.join(EXCHANGE_MODES)}")
        if comm == "full":
            send = [local] * n
        else:
            send = plan.send_tokens() if window is None else window_send_tokens(plan, window)
        keys = [sum(key_rows(shards, window)) for shards in plan.ranks]
        comm_fwd, comm_bwd = self.exchange_ms(plan, comm, row, max(send), window) if n > 1 else (0.0, 0.0)
        copy = [self.memory.ms(2 * row * (local + send[r] + keys[r])) for r in range(n)]
        bwd_copy = [c * self.memory.bwd_copy_ratio for c in copy]
        if shape.kv_lora_rank is not None:  # MLA: each rank up-projects its key rows, writing K/V
            for r in range(n):
                # the local rows' up-projection is the model's own (any CP system does it): only
                # the key rows beyond them are CP's, forward and (twice the FLOPs) backward
                extra = self.memory.gemm_ms(shape.upproject_flops * (keys[r] - local))
                written = self.memory.ms(shape.kv_row_bytes * keys[r])
                copy[r] += extra + written
                bwd_copy[r] += 2 * extra + written * self.memory.bwd_copy_ratio
        r_b = int(np.argmax(np.add(bwd, bwd_copy)))
        if overlap and comm_fwd > 0:
            done, r_f, fwd, copy = self._overlapped_forward(plan, shape, comm_fwd, copy, window)
            exposed = done - fwd[r_f] - copy[r_f]
        else:
            r_f = int(np.argmax(np.add(fwd, copy)))
            exposed = comm_fwd
        return StepTime(exposed, comm_bwd, fwd[r_f], bwd[r_b], copy[r_f], bwd_copy[r_b], list(fwd), list(bwd))

    def exchange_ms(
        self, plan: Plan, comm: str, row: int, pad: int, window: int | None = None
    ) -> tuple[float, float]:
        """Forward and backward time of the KV exchange of `plan` (N > 1) in mode `comm`; `pad`:
        rows every rank contributes to an all-gather; `window`: of a sliding-window layer. On one
        node "two_level" is "needed" (no fabric to spare); `flashcp.costmodel.fabric` prices groups
        that span nodes."""
        n = plan.cp_size
        if comm in ("needed", "two_level"):
            needed = plan.needed_tokens() if window is None else window_needed_tokens(plan, window)
            t = self.comm.all_to_all_ms(max(needed) * row, n)
            return t, t
        return self.comm.all_gather_ms(pad * row, n), self.comm.reduce_scatter_ms(pad * row, n)

    def _overlapped_forward(self, plan: Plan, shape: AttentionShape, comm_ms: float, copy: list[float],
                            window: int | None = None):  # fmt: skip
        """Forward finish time with local-only shards run under the collective, per rank."""
        finish, fwd, copies = [], [], []
        for r, shards in enumerate(plan.ranks):
            # Plans merge adjacent pieces, so a shard's keys are all local iff it starts its document.
            local = [s for s in shards if s.start == 0]
            remote = [s for s in shards if s.start > 0]
            if not local or not remote:  # nothing to overlap: the plain path
                f_all, _ = self._call_ms(shards, shape, window)
                finish.append(comm_ms + f_all + copy[r])
                fwd.append(f_all)
                copies.append(copy[r])
                continue
            f_local, _ = self._call_ms(local, shape, window)
            f_remote, _ = self._call_ms(remote, shape, window)
            extra = self.memory.ms(2 * 3 * shape.q_row_bytes * plan.tokens_per_rank)  # gather q, out; cat
            finish.append(max(comm_ms, f_local) + f_remote + copy[r] + extra)
            fwd.append(f_local + f_remote)
            copies.append(copy[r] + extra)
        r = int(np.argmax(finish))
        return finish[r], r, fwd, copies

    # --- ring systems ------------------------------------------------------------------------

    def ring_step(
        self, doc_lens: tuple[int, ...], cp_size: int, layout: str, shape: AttentionShape
    ) -> StepTime:
        """Step time of P2P ring attention with the `ring` or `zigzag` layout: the calls and bytes of
        `comm = "ring"` (`flashcp.plan.ring`: `ring_schedule`, `ring_transfers`)."""
        n = cp_size
        calls = ring_calls(doc_lens, n, layout)  # calls[j][r] = (q_lens, k_lens, causal)
        mem, row = self.memory, shape.kv_row_bytes
        grad_row = 2 * shape.n_kv * shape.head_dim * mem.ring_grad_bytes  # dK/dV partial sums
        sent_f, sent_b = ring_transfers(sum(doc_lens) // n, n, row, grad_row)
        out = StepTime(per_rank_fwd=[0.0] * n, per_rank_bwd=[0.0] * n)
        for j, step in enumerate(calls):
            send_f = self.comm.ring_step_ms(sent_f[j], n) if n > 1 else 0.0
            send_b = self.comm.ring_step_ms(sent_b[j], n) if n > 1 else 0.0
            best_f = best_b = (0.0, 0.0, 0.0)  # (total, kernel, merge) of the slowest rank
            for r, (q, k, causal) in enumerate(step):
                if q.size == 0:
                    continue
                counts = self.kernel.counts(q, k, shape.heads, causal, shape.kernel_head_dim)
                kf, kb = self.kernel.fwd.time_ms(*counts), self.kernel.bwd.time_ms(*counts)
                out.per_rank_fwd[r] += kf
                out.per_rank_bwd[r] += kb
                q_elems = float(q.sum()) * shape.heads * shape.head_dim
                k_elems = float(k.sum()) * shape.n_kv * shape.head_dim
                merge = mem.ms(q_elems * mem.merge_bytes_per_elem) if j > 0 else 0.0
                acc = mem.ms((q_elems + 2 * k_elems) * mem.grad_acc_bytes_per_elem)
                best_f = max(best_f, (kf + merge, kf, merge))
                best_b = max(best_b, (kb + acc, kb, acc))
            out.attn_fwd += best_f[1]
            out.other_fwd += best_f[2]
            out.comm_fwd += max(0.0, send_f - best_f[0])
            out.attn_bwd += best_b[1]
            out.other_bwd += best_b[2]
            out.comm_bwd += max(0.0, send_b - best_b[0])
        if n > 1:  # the dK/dV partial sums travel one more hop back to their owner
            out.comm_bwd += self.comm.ring_step_ms(sent_b[n], n)
        return out

    # --- all systems -------------------------------------------------------------------------

    def step(
        self, system: str, shape: AttentionShape, plans: dict[str, Plan], window: int | None = None,
        window_comm: str = "auto",
    ) -> StepTime:
        """Step time of `system`, given the window's plans keyed by planner strategy; of one of its
        sliding-window layers with `window`, exchanging by `window_exchange(its comm, window_comm)`."""
        if system in self.systems:
            strategy, comm, overlap = self.systems[system]
            if strategy not in plans:
                raise KeyError(f"system {system!r} needs a {strategy!r} plan of the window")
            if window is not None:
                comm = window_exchange(comm, window_comm)
            return self.collective_step(plans[strategy], comm, shape, overlap, window)
        if window is not None and system in RING_SYSTEMS:
            raise ValueError(f"the ring systems take no window, got system {system!r} with window {window}")
        if system in RING_SYSTEMS:
            any_plan = next(iter(plans.values()))
            return self.ring_step(any_plan.doc_lens, any_plan.cp_size, system, shape)
        raise ValueError(f"unknown system {system!r}; choose one of {', '.join(SYSTEMS)}")


def key_rows(shards, window: int | None = None) -> list[int]:
    """Key rows of each shard's sequence in a rank's varlen call: its document's prefix and itself,
    or with a `window` itself and the at most W - 1 rows before it that its window reaches."""
    if window is None:
        return [s.start + s.length for s in shards]
    return [s.length + min(s.start, window - 1) for s in shards]


RING_LAYOUTS = {"ring": "ring", "zigzag": "per_doc"}  # ring system -> the planner strategy of its layout


def ring_calls(
    doc_lens: tuple[int, ...], n: int, layout: str
) -> list[list[tuple[np.ndarray, np.ndarray, bool]]]:
    """Per ring step j and rank r, the blockwise varlen call (q_lens, k_lens, causal) it runs: the
    `ring_schedule` of the layout's plan (`ring`: N contiguous pieces per document; `zigzag`: the
    Per-Doc layout, 2N chunks, r and 2N-1-r), empty where the rank skips the step."""
    if layout not in RING_LAYOUTS:
        raise ValueError(f"unknown ring layout {layout!r}; choose ring or zigzag")
    plan = plan_shards(doc_lens, n, RING_LAYOUTS[layout])
    empty = (np.zeros(0, int), np.zeros(0, int), False)
    steps: list[list[tuple[np.ndarray, np.ndarray, bool]]] = [[empty] * n for _ in range(n)]
    for r in range(n):
        for j, call in enumerate(ring_schedule(plan, r)):
            if call is not None:
                q = np.array([b - a for a, b in call.q_ranges])
                k = np.array([b - a for a, b in call.k_ranges])
                steps[j][r] = (q, k, call.causal)
    return steps
