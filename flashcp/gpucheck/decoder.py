"""Section 6: one Llama 3 8B decoder layer, forward and backward, with the FlashCP attention op.

An end-to-end step model needs two efficiencies from a GPU: how fast the dense part of a layer
(its GEMMs) runs, and how fast the attention of a packed window runs. Both are measured here in
their real context, one layer on one packed window of documents, rather than as isolated
kernels. The layer is written out in plain torch, as TorchTitan's Llama 3 block does it (RMSNorm,
q/k/v projections, RoPE at each token's position inside its document, FlashCP's op with CP size 1,
output projection, SwiGLU), bf16 on a GPU (float32 on a CPU, where bf16 matmuls crawl). The
attention op is also timed alone on the same q/k/v; the dense time is the layer's minus that, so
it includes the norms, RoPE and SwiGLU's elementwise work, and dense TFLOP/s (GEMM FLOPs over that
time) is the effective rate a step model should use.

The layer is also checked against the same layer with a dense document-masked causal attention
in plain torch, on a few short documents (the window's dense mask would be too large at 16K):
a wrong document mask, GQA head mapping or position inside a document shows up there, which
timings would not reveal (in float32 even one token's position off by one; in bf16 only gross
errors). Positions counted from the window's start instead would pass: RoPE is relative, so under
the document mask they give the same result.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn.functional as F

from flashcp import plan_shards
from flashcp.attention import cp_varlen_attention
from flashcp.data import length_sampler, pack_windows
from flashcp.dispatch import build_dispatch, Dispatch
from flashcp.gpucheck.report import Budget, Report, Section
from flashcp.gpucheck.sizes import Sizes
from flashcp.gpucheck.timing import Timer, causal_flops

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # q, k, v -> out
Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin [T, 1, head_dim / 2]
CHECK_TOKENS = 1024  # at most; the dense mask of 16K tokens would take gigabytes
FACTOR = 2.0  # the FlashCP layer may be this many times as far from exact as the dense one


class DecoderLayer(torch.nn.Module):
    """Llama 3's block: h = x + wo(attn(rope(q), rope(k), v)), out = h + w2(silu(w1 n) * w3 n)."""

    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int, **factory) -> None:
        super().__init__()
        self.dim, self.heads, self.kv_heads, self.head_dim = dim, heads, kv_heads, dim // heads
        kv = kv_heads * self.head_dim
        self.wq = torch.nn.Linear(dim, dim, bias=False, **factory)
        self.wk = torch.nn.Linear(dim, kv, bias=False, **factory)
        self.wv = torch.nn.Linear(dim, kv, bias=False, **factory)
        self.wo = torch.nn.Linear(dim, dim, bias=False, **factory)
        self.w1 = torch.nn.Linear(dim, hidden, bias=False, **factory)
        self.w3 = torch.nn.Linear(dim, hidden, bias=False, **factory)
        self.w2 = torch.nn.Linear(hidden, dim, bias=False, **factory)
        self.attention_norm = torch.nn.RMSNorm(dim, eps=1e-5, **factory)
        self.ffn_norm = torch.nn.RMSNorm(dim, eps=1e-5, **factory)

    def qkv(self, x: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h, t = self.attention_norm(x), len(x)
        q, k = self.wq(h).view(t, self.heads, -1), self.wk(h).view(t, self.kv_heads, -1)
        return apply_rope(q, rope), apply_rope(k, rope), self.wv(h).view(t, self.kv_heads, -1)

    def forward(self, x: torch.Tensor, rope: Rope, attention: Attention) -> torch.Tensor:
        h = x + self.wo(attention(*self.qkv(x, rope)).flatten(1))
        n = self.ffn_norm(h)
        return h + self.w2(F.silu(self.w1(n)) * self.w3(n))

    def matmul_params(self) -> int:
        return sum(m.weight.numel() for m in (self.wq, self.wk, self.wv, self.wo, self.w1, self.w3, self.w2))


def rope_tables(positions: torch.Tensor, head_dim: int, dtype: torch.dtype, theta: float = 500000.0) -> Rope:
    """cos, sin of RoPE's angles at `positions`, computed once per window (as a model shares them
    between layers); the angles in float64, since float32 loses 1e-3 rad at position 16K."""
    freqs = theta ** -(torch.arange(0, head_dim, 2, device=positions.device).double() / head_dim)
    angles = positions.double()[:, None, None] * freqs
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """Rotate adjacent channel pairs of `x [T, H, D]` (Llama's complex-number layout), computed in
    the tables' precision and returned in x's."""
    cos, sin = rope
    x1, x2 = x.to(cos.dtype).unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2).to(x.dtype)


def flashcp_attention(doc_lens: list[int], device: torch.device, backend: str) -> tuple[Attention, Dispatch]:
    """FlashCP's op on one window with CP size 1 (no process group), and the dispatch it runs on."""
    d = build_dispatch(plan_shards(doc_lens, 1, "flashcp"), 0, "compact").to(device)
    return (lambda q, k, v: cp_varlen_attention(q, k, v, d, None, comm="compact", backend=backend)), d


def masked_attention(doc_lens: list[int], device: torch.device) -> tuple[Attention, torch.Tensor]:
    """Dense softmax attention under the causal document mask, in plain torch, and each token's
    position inside its document: the check's independent account of what FlashCP computes."""
    lens = torch.tensor(doc_lens, device=device)
    doc = torch.repeat_interleave(torch.arange(len(doc_lens), device=device), lens)
    row = torch.arange(len(doc), device=device)
    mask = (doc[:, None] == doc[None, :]) & (row[None, :] <= row[:, None])

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))  # h uses h // group
        scores = torch.einsum("qhd,khd->hqk", q, k) * q.shape[-1] ** -0.5
        compute = torch.promote_types(q.dtype, torch.float32)  # float64 stays float64
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1, dtype=compute).to(q.dtype)
        return torch.einsum("hqk,khd->qhd", probs, v)

    return attend, row - torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)


def check(layer: DecoderLayer, tokens: int, backend: str) -> dict[str, dict]:
    """Output and input gradient of the layer with FlashCP's op against a float64 dense-mask copy,
    on `tokens` tokens of four documents (one of 1 token); the same layer with the dense mask in
    the layer's dtype is the yardstick of the rounding error allowed (as in section 1)."""
    p = next(layer.parameters())
    lens = [tokens // 2, 1, tokens // 8, tokens - tokens // 2 - 1 - tokens // 8]
    gen = torch.Generator(p.device).manual_seed(1)
    x, grad = (torch.randn(tokens, layer.dim, generator=gen, device=p.device).double() for _ in "xg")
    dense, positions = masked_attention(lens, p.device)
    ours, d = flashcp_attention(lens, p.device, backend)

    def out_dx(lay: DecoderLayer, x: torch.Tensor, pos: torch.Tensor, attn: Attention, g: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        x = x.detach().requires_grad_()
        out = lay(x, rope_tables(pos, lay.head_dim, torch.promote_types(x.dtype, torch.float32)), attn)
        return out.detach().double(), torch.autograd.grad(out, x, g)[0].double()

    exact = out_dx(copy.deepcopy(layer).double(), x, positions, dense, grad)
    x, grad = x.to(p.dtype), grad.to(p.dtype)
    yard = out_dx(layer, x, positions, dense, grad)
    got = out_dx(layer, x[d.token_index], d.positions, ours, grad[d.token_index])
    result = {"documents": lens}
    for i, name in enumerate(("out", "dx")):
        ref, yard_i = exact[i][d.token_index], yard[i][d.token_index]
        error, yardstick = float((got[i] - ref).abs().max()), float((yard_i - ref).abs().max())
        tolerance = FACTOR * yardstick + torch.finfo(p.dtype).eps * float(ref.abs().max())
        result[name] = {"error": error, "yardstick": yardstick, "tolerance": tolerance,
                        "ok": error <= tolerance}  # fmt: skip
    return result


def peak_memory(step: Callable[[], None], device: torch.device) -> tuple[float | None, float | None]:
    """GiB allocated at the peak of `step`, in all and above what was allocated before it (its
    activations, gradients and workspace); None on a CPU, whose allocations torch does not track."""
    if device.type != "cuda":
        return None, None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    return peak / 2**30, (peak - base) / 2**30


def summary_lines(backend: str, r: dict, tokens: int, check_tokens: int) -> list[str]:
    """One backend's figures as Markdown bullets for summary.md."""
    lines = []
    for p in ("fwd_bwd", "fwd"):
        dense = r[f"dense_tflops_{p}"]
        dense = "unknown (attention alone took longer: timing noise)" if dense is None else f"{dense:.3g}"
        lines.append(f"- {backend}, {p.replace('_', '+')}: layer {r[f'layer_{p}_ms']:.3g} ms, attention "
                     f"{r[f'attention_{p}_ms']:.3g} ms ({100 * r[f'attention_share_{p}']:.0f} %); TFLOP/s: "
                     f"attention {r[f'attention_tflops_{p}']:.3g}, dense {dense}")  # fmt: skip
    mem = r["peak_memory_gib"]
    if mem is not None:
        mem = f"{mem:.2f} GiB ({r['step_memory_gib']:.2f} GiB above the weights and inputs)"
    c = r["check"]
    errors = ", ".join(f"{n} error {c[n]['error']:.2g} (tolerance {c[n]['tolerance']:.2g})"
                       for n in ("out", "dx"))  # fmt: skip
    cut = f"; the {tokens}-token window's dense mask is too large" if check_tokens < tokens else ""
    return lines + [f"- {backend}, peak memory of fwd+bwd: {mem or 'not tracked on CPU'}",
                    f"- {backend}, vs dense document-masked attention on {check_tokens} tokens "
                    f"({len(c['documents'])} documents, one of 1 token{cut}): {errors}"]  # fmt: skip


def run(report: Report, sec: Section, device: torch.device, sizes: Sizes, budget: Budget,
        backends: list[str]) -> None:  # fmt: skip
    dim, heads, kv_heads, hidden = sizes.layer_dims
    tokens, head_dim = sizes.layer_tokens, dim // heads
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # bf16 matmuls crawl on CPUs
    doc_lens = pack_windows(length_sampler("wlbllm", seed=0), tokens, 1)[0]
    torch.manual_seed(0)
    layer = DecoderLayer(dim, heads, kv_heads, hidden, device=device, dtype=dtype)
    x = torch.randn(tokens, dim, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)
    dense_flops = {"fwd": 2.0 * tokens * layer.matmul_params()}  # 2 per multiply-add
    dense_flops["fwd_bwd"] = 3 * dense_flops["fwd"]  # the backward: input and weight gradients
    attn_flops = causal_flops(doc_lens, doc_lens, heads, head_dim)
    config = {"tokens": tokens, "doc_lens": doc_lens, "dim": dim, "heads": heads, "kv_heads": kv_heads,
              "head_dim": head_dim, "ffn_hidden": hidden, "dtype": str(dtype).removeprefix("torch."),
              "matmul_params": layer.matmul_params(), "dense_flops": dense_flops,
              "attention_flops": attn_flops, "repeats": sizes.repeats}  # fmt: skip
    record = {"config": config, "backends": {}}
    report.write_json("decoder", record)
    timer, check_tokens = Timer(device, sizes.repeats), min(tokens, CHECK_TOKENS)
    print(f"{tokens} tokens in documents {doc_lens}, dims {sizes.layer_dims}, {config['dtype']}", flush=True)
    for backend in backends:
        if budget.spent():
            sec.status = "cut short"
            sec.lines.append(f"- budget spent before backend {backend}")
            break
        result = {"check": check(layer, check_tokens, backend)}
        attention, d = flashcp_attention(doc_lens, device, backend)
        rope = rope_tables(d.positions, head_dim, torch.float32)  # x: the window in the op's row order
        q, k, v = (t.detach().requires_grad_() for t in layer.qkv(x.detach(), rope))
        grad_attn = torch.randn_like(q)

        def layer_step() -> None:
            layer(x, rope, attention).backward(grad)
            layer.zero_grad(set_to_none=True)
            x.grad = None

        def attention_step() -> None:
            attention(q, k, v).backward(grad_attn)
            q.grad = k.grad = v.grad = None

        with torch.no_grad():
            finite = bool(torch.isfinite(layer(x, rope, attention)).all())
            t = {"layer_fwd_ms": timer(lambda: layer(x, rope, attention)),
                 "attention_fwd_ms": timer(lambda: attention(q, k, v))}  # fmt: skip
        t |= {"layer_fwd_bwd_ms": timer(layer_step), "attention_fwd_bwd_ms": timer(attention_step)}
        result |= t
        result["peak_memory_gib"], result["step_memory_gib"] = peak_memory(layer_step, device)
        for p in ("fwd", "fwd_bwd"):
            layer_ms, attn_ms = t[f"layer_{p}_ms"], t[f"attention_{p}_ms"]
            dense_tflops = dense_flops[p] / (layer_ms - attn_ms) / 1e9 if layer_ms > attn_ms else None
            result |= {f"dense_{p}_ms": layer_ms - attn_ms, f"attention_share_{p}": attn_ms / layer_ms,
                       f"dense_tflops_{p}": dense_tflops,
                       f"attention_tflops_{p}": attn_flops[p] / attn_ms / 1e9,
                       f"layer_tflops_{p}": (dense_flops[p] + attn_flops[p]) / layer_ms / 1e9}  # fmt: skip
        record["backends"][backend] = result
        report.write_json("decoder", record)
        c = result["check"]
        sec.failures += [f"{backend}: the layer's output is not finite"] * (not finite) + [
            f"{backend}: layer {n} off the dense-mask layer by {c[n]['error']:.3g} (tolerance "
            f"{c[n]['tolerance']:.3g})" for n in ("out", "dx") if not c[n]["ok"]]  # fmt: skip
        lines = summary_lines(backend, result, tokens, check_tokens)
        sec.lines += lines
        print("\n".join(line[2:] for line in lines), flush=True)
    else:
        sec.status = "measured"
    if sec.failures:  # a failed check outranks a cut-short run: the check must exit non-zero
        sec.status = "failed"
