"""Learned attention sinks (gpt-oss): one extra logit per query head in every softmax denominator.

    out = sink_attention(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)

A sink adds exp(sink_h) to each query row's softmax sum and nothing to its output, so it needs the
row's final log-sum-exp. Under FlashCP every local shard's keys are in one kernel call, so that
call's LSE is final and the sink is applied once, with no exchange. The kernel runs unchanged;
forward corrects its output and LSE, `lse' = logaddexp(lse, sink)`, `out' = out * exp(lse - lse')`.
Backward runs the kernel's backward from `out'` and `lse'` (no autograd through the LSE: the
sink's column carries no value, so the softmax backward's rowsum(out' * dout) is already right)
plus the sink's closed form, `dsink_h = -sum_t exp(sink_h - lse'_t) * rowsum(out'_t * dout_t)`.
This needs a backend whose forward returns the LSE and whose backward takes a given output and
LSE (`resolve_lse_backend`): the reference kernel, and torch's varlen_attn on GPUs.
"""

from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

from flashcp.attention.kernels import _check_inputs, _one_head_dim, Backend, resolve_lse_backend, window_args


class _SinkAttention(torch.autograd.Function):
    """The corrected output; backward from the corrected output and LSE (module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, kernel: Backend, shape, scale, extra):  # type: ignore[override]
        out, lse = kernel.run_lse(q, k, v, *shape, True, scale, **extra)
        sink = sinks.to(lse.dtype)[:, None]
        lse_sink = torch.logaddexp(lse, sink)
        out = (out.to(lse.dtype) * torch.exp(lse - lse_sink).T.unsqueeze(-1)).to(out.dtype)
        ctx.save_for_backward(q, k, v, sink, out, lse_sink)
        ctx.kernel, ctx.shape, ctx.scale, ctx.extra, ctx.sink_dtype = kernel, shape, scale, extra, sinks.dtype
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):  # type: ignore[override]
        q, k, v, sink, out, lse_sink = ctx.saved_tensors
        dq, dk, dv = ctx.kernel.run_backward(grad_out, q, k, v, out, lse_sink, *ctx.shape, True, ctx.scale,
                                             **ctx.extra)[:3]  # fmt: skip
        delta = (out.to(lse_sink.dtype) * grad_out.to(lse_sink.dtype)).sum(-1)  # [Tq, Hq]
        dsink = -(torch.exp(sink - lse_sink) * delta.T).sum(1)
        return dq, dk, dv, dsink.to(ctx.sink_dtype), None, None, None, None


def sink_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    softmax_scale: float | None = None,
    backend: str = "auto",
    window: int | None = None,
) -> torch.Tensor:
    """Causal `varlen_attention` with one sink logit per query head, `sinks [Hq]`; differentiable
    in q, k, v and sinks. Returns `[Tq, Hq, Dv]`."""
    _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k)
    if sinks.shape != (q.shape[1],) or not sinks.is_floating_point():
        got = f"{sinks.dtype} {tuple(sinks.shape)}"
        raise ValueError(f"sinks must be one float per query head, [{q.shape[1]}], got {got}")
    extra = window_args(window)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    kernel = resolve_lse_backend(backend, q, k, purpose="sinks")
    dv = v.shape[-1]
    if kernel.name != "reference" and dv != q.shape[-1]:
        q, k, v = _one_head_dim(q, k, v)
    shape = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    out = _SinkAttention.apply(q, k, v, sinks, kernel, shape, scale, extra)
    return out if out.shape[-1] == dv else out[..., :dv]
