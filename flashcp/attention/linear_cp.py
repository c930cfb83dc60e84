"""Context-parallel Gated DeltaNet: state passed only for cut documents, halos only for their pieces.

    d = build_linear_dispatch(plan, rank)                    # once per step
    x = cp_causal_conv1d(x, conv_weight, d, group)           # [T, C] pre-convolution rows
    o = cp_gated_delta(q, k, v, g, beta, d, group)            # [T, H, d_k], [T, H, d_v], [T, H]

Rows are this rank's tokens in the dispatch's local order (`d.token_index`, the same as
`build_dispatch`'s). FlashCP's plan keeps most documents whole on one rank; those take the plain
local path. For the few cut ones (`flashcp.plan.linear`):

- `cp_gated_delta` runs the pieces that start their document first (they need no state), whose
  final states are the B summaries of the cut ones; the middle pieces' `[B | M]` come from one
  more local run (`affine_summary`). One all-to-all-v sends the B rows and one the M rows (only
  if some document has three pieces) to each cut document's composer (`flashcp.plan.linear.
  composers`: one owner of its pieces, chosen to spread the load), which folds its documents'
  initial states in the summaries' dtype (float32 for bf16 inputs: matmuls, which torch runs
  without TF32 unless a job turns it on); one more all-to-all-v sends each continued piece its
  initial state, then those pieces run. A piece receives one state, not the summaries of every
  piece before it (which grow with the pieces squared: gigabytes a layer at CP 32 under Per-Doc).
- `cp_causal_conv1d`, the depthwise causal convolution (width W) before it, receives each
  continued piece's W - 1 preceding pre-convolution rows from their owners.

The local pieces run on one kernel chosen per call (`backend`, `flashcp.attention.gdn_kernels`):
flash-linear-attention's `chunk_gated_delta_rule` on CUDA tensors (per-sequence initial states
and final states, float32), the chunked torch reference (`flashcp.attention.gated_delta`) on
CPU and in float64; the middle pieces' `[B | M]` come from the same kernel (`affine_summary`).
Both are differentiable; the exchanges are autograd functions whose backward is the transposed
all-to-all-v, so the gradients of received summaries and halo rows return to the ranks that
computed them. Each exchange's bytes are `flashcp.plan.linear.linear_comm`'s (`record_comm` logs
them). The convolution stays torch: one gather and a width-W weighted sum, bandwidth-bound and a
small share of the layer next to its projections; fla's `causal_conv1d` would need the halo rows
spliced into each piece's start as an initial conv state, for no measured gain yet.
`python -m flashcp.gpucheck --sections gdn` checks the op sharded against one device on a GPU.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from flashcp.attention.collectives import _record, Collectives, collectives
from flashcp.attention.gated_delta import affine_summary
from flashcp.attention.gdn_kernels import gdn_kernel
from flashcp.attention.linear_dispatch import LinearDispatch, PieceBatch, Route


class _Exchange(torch.autograd.Function):
    """For each `(table, route)`, `cat([rows received through route, table])`; backward sends the
    received rows' gradients back the same way and adds them onto the rows that were sent.

    One function for all of an op's tables, so that every rank runs their transposed exchanges in
    the same order. A table with no route passes through: the gated delta op passes its inputs
    and its first pieces' output, one of which every rank's result depends on whatever it holds,
    so the backward (a collective) runs on every rank, also where the received summaries feed
    nothing (a rank whose documents all start on it) or only some inputs need gradients."""

    @staticmethod
    def forward(ctx, routes: tuple[Route | None, ...], comms: Collectives, *tables: torch.Tensor):
        ctx.routes, ctx.comms = routes, comms
        out = []
        for t, r in zip(tables, routes):
            if r is None or not r.active:
                out.append(t.view_as(t))
            else:
                rows = t.index_select(0, r.send_index)
                out.append(torch.cat([_send(rows, r.recv_splits, r.send_splits, comms, "forward"), t]))
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        local = []
        for g, r in zip(grads, ctx.routes):
            if r is None or not r.active:
                local.append(g)
                continue
            received = sum(r.recv_splits)
            back = _send(g[:received], r.send_splits, r.recv_splits, ctx.comms, "backward")
            local.append(g[received:].index_add(0, r.send_index, back))
        return None, None, *local


def _send(rows: torch.Tensor, out_splits: list[int], in_splits: list[int], comms: Collectives, pass_: str
          ) -> torch.Tensor:  # fmt: skip
    out = rows.new_empty(sum(out_splits), *rows.shape[1:])
    comms.all_to_all(out, rows.contiguous(), out_splits, in_splits)
    _record("all_to_all", pass_, len(rows), len(out), rows)  # a route never sends to its own rank
    return out


def _comms(d: LinearDispatch, group: dist.ProcessGroup | Collectives | None) -> Collectives:
    comms = collectives(group)
    if d.cp_size > 1 and (comms.size(), comms.rank()) != (d.cp_size, d.rank):
        raise ValueError(
            f"dispatch is for rank {d.rank} of {d.cp_size} but the process group has this process "
            f"as rank {comms.rank()} of {comms.size()}"
        )
    return comms


def _check_rows(d: LinearDispatch, *rows: torch.Tensor) -> None:
    tokens = d.token_index.numel()
    if {t.shape[0] for t in rows} != {tokens}:
        raise ValueError(f"inputs must hold this rank's {tokens} tokens, got {[t.shape[0] for t in rows]}")


def cp_causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, d: LinearDispatch,
    group: dist.ProcessGroup | Collectives | None = None,
) -> torch.Tensor:  # fmt: skip
    """The depthwise causal convolution of each document: `x [T, C]`, `weight [C, W]` (an
    `nn.Conv1d(C, C, W, groups=C)` weight squeezed), no bias or activation. Taps before a
    document's start read zeros."""
    _check_rows(d, x)
    if weight.shape != (x.shape[1], d.conv_index.shape[1]):
        want = (x.shape[1], d.conv_index.shape[1])
        raise ValueError(f"weight must be [C, W] = {want}, got {tuple(weight.shape)}")
    (rows,) = _Exchange.apply((d.halo_route,), _comms(d, group), x)
    rows = torch.cat([x.new_zeros(1, x.shape[1]), rows])
    return torch.einsum("twc,cw->tc", rows[d.conv_index], weight)


def _pieces(batch: PieceBatch, *rows: torch.Tensor) -> list[torch.Tensor]:
    return [x.index_select(0, batch.rows) for x in rows]


def cp_gated_delta(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, d: LinearDispatch,
    group: dist.ProcessGroup | Collectives | None = None, chunk_size: int = 64, backend: str = "auto",
) -> torch.Tensor:  # fmt: skip
    """The gated delta rule over every document of the window (see `gated_delta`): `q, k
    [T, H, d_k]` (L2-normalised, q scaled), `v [T, H, d_v]`, log-decay `g` and `beta [T, H]`.
    Returns `o [T, H, d_v]`. `backend`: "auto", "fla" or "reference" (`gdn_kernels`)."""
    _check_rows(d, q, k, v, g, beta)
    comms = _comms(d, group)
    kernel = gdn_kernel(backend, q, v, chunk_size)
    o_first, final = kernel(*_pieces(d.first, q, k, v, g, beta), d.first.lens, None, chunk_size)
    b_mid, m_mid = affine_summary(*_pieces(d.middle, k, v, g, beta), d.middle.lens, chunk_size, kernel)
    b = torch.cat([final.index_select(0, d.first_summaries), b_mid])
    routes = (None,) * 6 + (d.b_route, d.m_route)
    o_first, q, k, v, g, beta, b, m = _Exchange.apply(routes, comms, o_first, q, k, v, g, beta, b, m_mid)
    state = b.index_select(0, d.fold_init)  # the composed documents' pieces 1
    composed = [state]
    for m_rows, b_rows in d.fold_steps:  # step i: pieces i + 1, of a prefix of the documents
        state = m.index_select(0, m_rows) @ state[: len(m_rows)] + b.index_select(0, b_rows)
        composed.append(state)
    # The second exchange takes the first's pass-through outputs, so that every rank runs its
    # backward before the first's.
    routes = (None,) * 6 + (d.state_route,)
    composed = torch.cat(composed)
    o_first, q, k, v, g, beta, states = _Exchange.apply(routes, comms, o_first, q, k, v, g, beta, composed)
    cont = _pieces(d.continued, q, k, v, g, beta)
    o_cont, _ = kernel(*cont, d.continued.lens, states.index_select(0, d.init_index), chunk_size)
    return torch.cat([o_first, o_cont]).index_select(0, d.inverse)
