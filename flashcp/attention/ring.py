"""The ring KV exchange: N - 1 steps passing KV blocks to the next rank, blockwise attention, LSE merge.

    dispatch = build_ring_dispatch(plan, rank)
    out = cp_varlen_attention(q, k, v, dispatch, group, comm="ring")

Ring-Attn's exchange (ring-flash-attention's varlen ring, TransformerEngine's p2p CP) as one more
comm of the same op, so it runs any plan: the `ring` layout is Ring-Attn, `per_doc` Ring-Attn
(Zigzag), and a FlashCP plan runs over a ring too. At step s each rank holds the K and V of rank
(rank - s) mod N; it starts passing them to the next rank (`batch_isend_irecv`, in flight while
it computes), attends its queries to them with the document mask -- the call `ring_schedule`
(`flashcp.plan.ring`) gives: each query sees its own document's earlier keys by window position,
causally within its own block at step 0, whole blocks after; a step with nothing to attend calls
no kernel -- and merges the block's output into the running one by log-sum-exp, in at least
float32:

    lse = logaddexp(lse, lse_s);  out = out * exp(lse_old - lse) + out_s * exp(lse_s - lse)

Backward (ring-flash-attention's scheme): the steps again, each rank receiving K and V as in the
forward and running the kernel backward of every block with the merged output and LSE (which makes
each block's gradients its share of the whole attention's); dQ stays local, and the dK/dV partial
sums of a block (at least float32) travel with it: rank r starts block r - 1's at step 1, each
later rank adds its share, and one last shift hands the sums to the block's owner. Every rank
sends (N - 1) KV blocks forward and (N - 1) KV blocks plus (N - 1) gradient blocks backward per
layer; `record_comm()` logs them ("ring"), and `flashcp.plan.ring.ring_transfers` is the same
count step by step, which the cost model prices.

Nothing reads device data on the host: every call's rows and lengths are built with the dispatch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
from torch.autograd.function import once_differentiable

from flashcp.attention.collectives import _check_group, _record, Collectives
from flashcp.attention.kernels import Backend, resolve_lse_backend
from flashcp.dispatch import build_dispatch, Dispatch, expand_ranges
from flashcp.plan.plan import Plan
from flashcp.plan.ring import ring_schedule


@dataclass(frozen=True)
class RingStep:
    """One step's kernel call: local query rows (None: all, in order) against rows of the held block
    (None: the block as it is), as a varlen problem."""

    q_rows: torch.Tensor | None
    k_rows: torch.Tensor | None
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    causal: bool


@dataclass(frozen=True)
class RingDispatch(Dispatch):
    """A `Dispatch` with comm "ring": `steps[s]` runs on the block of rank (rank - s) mod N."""

    steps: tuple[RingStep | None, ...] = ()


def _rows(ranges: tuple[tuple[int, int], ...], total: int) -> torch.Tensor | None:
    """The rows of `ranges` as one index, or None when they are all `total` rows in order."""
    if ranges[0][0] == 0 and ranges[-1][1] == total and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])):
        return None
    starts, ends = torch.tensor(ranges, dtype=torch.long).unbind(1)
    return expand_ranges(starts, ends - starts)


def _lengths(ranges: tuple[tuple[int, int], ...]) -> tuple[torch.Tensor, int]:
    lens = torch.tensor([b - a for a, b in ranges], dtype=torch.int32)
    return torch.cat([lens.new_zeros(1), lens.cumsum(0, dtype=torch.int32)]), int(lens.max())


def build_ring_dispatch(plan: Plan, rank: int) -> RingDispatch:
    """Rank `rank`'s dispatch for the ring: its rows (as every comm's) and one call per ring step."""
    base = build_dispatch(plan, rank, "full")
    steps = []
    for call in ring_schedule(plan, rank):
        if call is None:
            steps.append(None)
            continue
        cu_q, max_q = _lengths(call.q_ranges)
        cu_k, max_k = _lengths(call.k_ranges)
        held = plan.tokens_per_rank
        steps.append(RingStep(_rows(call.q_ranges, held), _rows(call.k_ranges, held), cu_q, cu_k, max_q, max_k,
                              call.causal))  # fmt: skip
    # no collective buffer: the ring holds one block of the source's rows at a time
    fixed = {f.name: getattr(base, f.name) for f in fields(Dispatch)}
    fixed.update(comm="ring", send_pad=0, recv_size=plan.tokens_per_rank)
    return RingDispatch(**fixed, steps=tuple(steps))


def _select(t: torch.Tensor, rows: torch.Tensor | None, dim: int = 0) -> torch.Tensor:
    return t if rows is None else t.index_select(dim, rows)


def _operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: RingStep):
    q, k, v = _select(q, step.q_rows), _select(k, step.k_rows), _select(v, step.k_rows)
    return q, k, v, step.cu_seqlens_q, step.cu_seqlens_k, step.max_seqlen_q, step.max_seqlen_k, step.causal


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor,
           rows: torch.Tensor | None) -> None:  # fmt: skip
    """Fold one block's output and LSE [Hq, rows] into the running ones (both of `out`'s dtype)."""
    old_out, old_lse = _select(out, rows), _select(lse, rows, 1)
    block_lse = block_lse.to(lse.dtype)
    new_lse = torch.logaddexp(old_lse, block_lse)
    merged = old_out * torch.exp(old_lse - new_lse).T.unsqueeze(-1)
    merged += block_out.to(out.dtype) * torch.exp(block_lse - new_lse).T.unsqueeze(-1)
    if rows is None:
        out.copy_(merged)
        lse.copy_(new_lse)
    else:
        out.index_copy_(0, rows, merged)
        lse.index_copy_(1, rows, new_lse)


def _shift(comms: Collectives, pass_: str, kv: tuple = (), sums: tuple = ()):
    """Start one ring step's transfers: `kv` = ((k_in, v_in), (k_out, v_out)) and/or `sums` = (in, out);
    log them (K and V as one record of KV rows)."""
    pairs = list(zip(*kv)) + ([sums] if sums else [])
    work = comms.ring_shift(pairs)
    if kv:
        (k_in, _), (k_out, _) = kv
        _record("ring", pass_, len(k_out), len(k_in), k_out.new_empty(0, 2, *k_out.shape[1:]))
    if sums:
        _record("ring", pass_, len(sums[1]), len(sums[0]), sums[1])
    return work


def forward_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: RingStep, kernel: Backend, scale: float,
                 out: torch.Tensor, lse: torch.Tensor) -> None:  # fmt: skip
    """One step's forward on one rank: its call on the held block `k, v`, merged into `out`, `lse`."""
    block_out, block_lse = kernel.run_lse(*_operands(q, k, v, step), scale)
    _merge(out, lse, block_out, block_lse, step.q_rows)


def backward_step(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, step: RingStep, kernel: Backend, scale: float, dq: torch.Tensor,
                  part: torch.Tensor) -> None:  # fmt: skip
    """One step's backward on one rank, from the merged `out` and `lse`: dQ added to `dq`, the held
    block's dK/dV share to `part` ([rows, 2, Hkv, D])."""
    rows = step.q_rows
    block_q, block_k, block_v, *shape = _operands(q, k, v, step)
    dq_s, dk_s, dv_s = kernel.run_backward(_select(grad_out, rows), block_q, block_k, block_v, _select(out, rows),
                                           _select(lse, rows, 1).contiguous(), *shape, scale)  # fmt: skip
    if rows is None:
        dq += dq_s
    else:
        dq.index_add_(0, rows, dq_s.to(dq.dtype))
    for i, g in enumerate((dk_s, dv_s)):
        if step.k_rows is None:
            part[:, i] += g
        else:
            part[:, i].index_add_(0, step.k_rows, g.to(part.dtype))


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, dispatch: RingDispatch, comms: Collectives, kernel: Backend, scale: float):  # type: ignore
        n, held = dispatch.cp_size, (k, v)
        stat = torch.promote_types(q.dtype, torch.float32)
        out = q.new_zeros(q.shape, dtype=stat)
        lse = q.new_full((q.shape[1], q.shape[0]), float("-inf"), dtype=stat)
        for s, step in enumerate(dispatch.steps):
            work = None
            if s < n - 1:
                arriving = (torch.empty_like(k), torch.empty_like(v))
                work = _shift(comms, "forward", kv=(arriving, held))
            if step is not None:
                forward_step(q, *held, step, kernel, scale, out, lse)
            if work is not None:
                work.wait()
                held = arriving
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.dispatch, ctx.comms, ctx.kernel, ctx.scale = dispatch, comms, kernel, scale
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        dispatch, comms, kernel = ctx.dispatch, ctx.comms, ctx.kernel
        n, held, grad_out = dispatch.cp_size, (k, v), grad_out.contiguous()
        stat = torch.promote_types(q.dtype, torch.float32)
        dq = q.new_zeros(q.shape, dtype=stat)
        own = sums = None  # this rank's block's dK/dV; the sums travelling with the held block
        for s, step in enumerate(dispatch.steps):
            kv, travel = (), ()
            if s < n - 1:
                arriving = (torch.empty_like(k), torch.empty_like(v))
                kv = (arriving, held)
            if s >= 2:  # the previous step's sums go on with the block they belong to
                incoming = torch.empty_like(sums)
                travel = (incoming, sums)
            work = _shift(comms, "backward", kv, travel) if kv or travel else None
            part = k.new_zeros(k.shape[0], 2, *k.shape[1:], dtype=stat) if step is not None or s < 2 else None
            if step is not None:
                backward_step(grad_out, q, *held, out, lse, step, kernel, ctx.scale, dq, part)
            if work is not None:
                work.wait()
            if s == 0:
                own = part
            elif s == 1:
                sums = part
            else:
                sums = incoming if part is None else incoming.add_(part)
            if s < n - 1:
                held = arriving
        if n > 1:  # the sums of block r + 1 (every other rank's share) go home
            home = torch.empty_like(sums)
            _shift(comms, "backward", sums=(home, sums)).wait()
            own += home
        return dq.to(q.dtype), own[:, 0].to(k.dtype), own[:, 1].to(v.dtype), None, None, None, None


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dispatch: RingDispatch, comms: Collectives,
    backend: str = "auto", softmax_scale: float | None = None,
) -> torch.Tensor:  # fmt: skip
    """Document-masked attention of this rank's rows over the window by the ring (module docstring);
    `cp_varlen_attention(..., comm="ring")` calls it."""
    if not isinstance(dispatch, RingDispatch):
        raise ValueError("comm='ring' needs a ring dispatch: build it with build_ring_dispatch(plan, rank)")
    if dispatch.cp_size > 1:
        _check_group(dispatch, comms)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    return _Ring.apply(q, k, v, dispatch, comms, resolve_lse_backend(backend, q, k), scale)
