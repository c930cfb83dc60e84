"""Section 5: one Llama 3 8B decoder layer, forward and backward, with the FlashCP attention op.

What an end-to-end step model needs from a GPU: how long the dense part of a layer takes per
token (the GEMMs, at what fraction of peak) next to the attention of a packed window, and how
much memory one layer's activations take. The layer is written out in plain torch (RMSNorm,
q/k/v projections, RoPE at each token's position inside its document, FlashCP's op, output
projection, SwiGLU), bf16 on a GPU. The attention op runs alone on the same inputs as well;
the dense time is the layer's time minus that.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flashcp import plan_shards
from flashcp.attention import cp_varlen_attention
from flashcp.data import length_sampler, pack_windows
from flashcp.dispatch import Dispatch
from flashcp.gpucheck.report import Budget, Report, Section
from flashcp.gpucheck.sizes import Sizes
from flashcp.gpucheck.timing import Timer, causal_flops


class DecoderLayer(torch.nn.Module):
    """Llama 3's block: x + attn(norm(x)), then + ffn(norm(.)); attention through FlashCP."""

    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int, backend: str) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.backend = heads, kv_heads, dim // heads, backend
        self.wq = torch.nn.Linear(dim, dim, bias=False)
        self.wkv = torch.nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=False)
        self.wo = torch.nn.Linear(dim, dim, bias=False)
        self.w13 = torch.nn.Linear(dim, 2 * hidden, bias=False)
        self.w2 = torch.nn.Linear(hidden, dim, bias=False)
        self.norm1, self.norm2 = torch.nn.RMSNorm(dim, eps=1e-5), torch.nn.RMSNorm(dim, eps=1e-5)

    def qkv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.norm1(x)
        q = self.wq(h).view(len(x), self.heads, self.head_dim)
        k, v = self.wkv(h).view(len(x), 2, self.kv_heads, self.head_dim).unbind(1)
        return rope(q, positions), rope(k, positions), v

    def forward(self, x: torch.Tensor, positions: torch.Tensor, dispatch: Dispatch) -> torch.Tensor:
        q, k, v = self.qkv(x, positions)
        attn = cp_varlen_attention(q, k, v, dispatch, None, comm=dispatch.comm, backend=self.backend)
        x = x + self.wo(attn.reshape(len(x), -1))
        gate, up = self.w13(self.norm2(x)).chunk(2, dim=-1)
        return x + self.w2(F.silu(gate) * up)

    def dense_flops(self, tokens: int) -> float:
        """Forward FLOPs of the layer's matrix products (2 per multiply-add)."""
        return 2.0 * tokens * sum(m.weight.numel() for m in (self.wq, self.wkv, self.wo, self.w13, self.w2))


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float = 500000.0) -> torch.Tensor:
    """Rotary embedding of `x [T, H, D]` at `positions [T]` (pairs of adjacent channels)."""
    d = x.shape[-1]
    freqs = theta ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    angles = positions.float()[:, None] * freqs[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2).to(x.dtype)


def run(report: Report, sec: Section, device: torch.device, sizes: Sizes, budget: Budget,
        backends: list[str]) -> None:  # fmt: skip
    dim, heads, kv_heads, hidden = sizes.layer_dims
    tokens = sizes.layer_tokens
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # bf16 matmuls crawl on CPUs
    doc_lens = pack_windows(length_sampler("wlbllm", seed=0), tokens, 1)[0]
    dispatch = plan_shards(doc_lens, 1, "flashcp").dispatch(0, "compact").to(device)
    timer = Timer(device, sizes.repeats)
    record = {"tokens": tokens, "documents": len(doc_lens), "dim": dim, "heads": heads, "kv_heads": kv_heads,
              "ffn_hidden": hidden, "dtype": str(dtype).removeprefix("torch."), "backends": {}}  # fmt: skip
    attn_flops = causal_flops(doc_lens, doc_lens, heads, dim // heads)
    for backend in backends:
        if budget.spent():
            sec.status = "cut short"
            break
        torch.manual_seed(0)
        layer = DecoderLayer(dim, heads, kv_heads, hidden, backend).to(device=device, dtype=dtype)
        x = torch.randn(tokens, dim, device=device, dtype=dtype, requires_grad=True)
        q, k, v = (t.detach().requires_grad_() for t in layer.qkv(x.detach(), dispatch.positions))
        grad, grad_attn = torch.randn_like(x), torch.randn_like(q)

        def layer_fwd() -> torch.Tensor:
            return layer(x, dispatch.positions, dispatch)

        def attn_fwd() -> torch.Tensor:
            return cp_varlen_attention(q, k, v, dispatch, None, comm="compact", backend=backend)

        def fwd_bwd(fn, g):
            return lambda: fn().backward(g)

        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        out = layer_fwd()
        out.backward(grad)
        peak = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else None
        if not bool(torch.isfinite(out).all()) or not bool(torch.isfinite(x.grad).all()):
            sec.failures.append(f"{backend}: the layer's output or input gradient is not finite")
        with torch.no_grad():
            layer_ms, attn_ms = timer(layer_fwd), timer(attn_fwd)
        layer_fb, attn_fb = timer(fwd_bwd(layer_fwd, grad)), timer(fwd_bwd(attn_fwd, grad_attn))
        layer.zero_grad(set_to_none=True)
        dense_flops = layer.dense_flops(tokens)
        result = {
            "layer_fwd_ms": layer_ms, "layer_fwd_bwd_ms": layer_fb, "attention_fwd_ms": attn_ms,
            "attention_fwd_bwd_ms": attn_fb, "dense_fwd_ms": layer_ms - attn_ms, "dense_fwd_bwd_ms": layer_fb - attn_fb,
            "attention_share_fwd_bwd": attn_fb / layer_fb,
            "dense_tflops_fwd_bwd": 3 * dense_flops / max(layer_fb - attn_fb, 1e-9) / 1e9,
            "attention_tflops_fwd_bwd": attn_flops["fwd_bwd"] / attn_fb / 1e9,
            "peak_memory_gib": None if peak is None else peak / 2**30,
        }  # fmt: skip
        record["backends"][backend] = result
        report.write_json("decoder", record)
        mem = "n/a on CPU" if peak is None else f"{result['peak_memory_gib']:.2f} GiB"
        line = (f"- {backend}: layer fwd+bwd {layer_fb:.2f} ms, attention {attn_fb:.2f} ms "
                f"({100 * result['attention_share_fwd_bwd']:.0f} %), dense {result['dense_tflops_fwd_bwd']:.3g} "
                f"TFLOP/s, attention {result['attention_tflops_fwd_bwd']:.3g} TFLOP/s, peak memory {mem}")
        sec.lines.append(line)
        print(line[2:], flush=True)
    else:
        sec.status = "failed" if sec.failures else "measured"
    report.write_json("decoder", record)
