"""A hybrid model's Gated DeltaNet layers on fake tensors: the GPU kernel's memory and the state exchange
at the window's busiest rank.

The op (`flashcp.attention.linear_cp.cp_gated_delta`) builds its chunk layout from the pieces' lengths
as tensors, which under fake tensors are fake too and have no values to lay chunks out with; and its
CPU reference kernel keeps per-chunk tensors the GPU kernel does not. Here each layer's op is a stand-in
with the GPU kernel's footprint (flash-linear-attention's `chunk_gated_delta_rule`: the output, and
for the backward its inputs and the chunks' intra-chunk matrix A [T, H, 64] in float32; in the backward
the chunk states h and their gradients [T / 64, H, d_k, d_v] float32, recomputed there) and with the
summaries a rank receives (float32 B and M rows, kept for the fold's backward) sized at the window's
busiest rank (`flashcp/state_recv_bytes_per_layer`, which the metrics count from the plan before the
step runs): rank 0 may hold no cut piece, the worst rank's step decides whether the job fits. The
convolution's halo exchange runs for real (`cp_causal_conv1d`, rank 0's rows). The op's memory is
labelled "flashcp_buffers" beside the attention layers' exchange.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from flashcp.titan.dryrun.memtrack import CategoryTracker

CHUNK = 64  # fla's chunk: A's columns, the rows per chunk state


class _GatedDeltaFootprint(torch.autograd.Function):
    """Shapes and saved tensors of the GPU kernel with the received summaries; values are never read."""

    @staticmethod
    def forward(ctx, state_bytes: int, q, k, v, g, beta):
        t, h, dv = v.shape
        summaries = q.new_empty(state_bytes // 4, dtype=torch.float32)  # received B / M rows, folded in fp32
        a = q.new_empty(t, h, CHUNK, dtype=torch.float32)
        ctx.save_for_backward(q, k, v, g, beta, a, summaries)
        return q.new_empty(t, h, dv)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, g, beta, a, summaries = ctx.saved_tensors
        t, h, dv = v.shape
        states = q.new_empty(2, -(-t // CHUNK), h, q.shape[-1], dv, dtype=torch.float32)  # h and dh, recomputed
        grads = tuple(torch.empty_like(x) for x in (q, k, v, g, beta))
        del states, summaries, a
        return None, *grads


class GatedDeltaStandIn(torch.nn.Module):
    """`cp_gated_delta` as a module (so that hooks label its memory), with the footprint above."""

    def __init__(self, state_bytes: Callable[[], float]) -> None:
        super().__init__()
        self.state_bytes = state_bytes

    def forward(self, q, k, v, g, beta, d, group=None, **options: Any) -> torch.Tensor:
        return _GatedDeltaFootprint.apply(int(self.state_bytes()), q, k, v, g, beta)


@contextlib.contextmanager
def gated_delta_stand_in(trainer, tracker: CategoryTracker) -> Iterator[None]:
    """While it runs, a hybrid model's layers call the stand-in, its memory labelled for `tracker`."""
    from flashcp.titan.models import gated_deltanet

    metrics = trainer.metrics_processor
    if metrics.attention_workload.linear is None:
        yield
        return
    op = GatedDeltaStandIn(lambda: metrics.stats.state_bytes.get("state_recv_bytes_per_layer", 0.0))
    push, pop = (lambda *args: tracker.push("flashcp_buffers")), (lambda *args: tracker.pop())
    handles = [op.register_forward_pre_hook(push), op.register_forward_hook(pop),
               op.register_full_backward_pre_hook(push), op.register_full_backward_hook(pop)]  # fmt: skip
    real, gated_deltanet.cp_gated_delta = gated_deltanet.cp_gated_delta, op
    try:
        yield
    finally:
        gated_deltanet.cp_gated_delta = real
        for handle in handles:
            handle.remove()
