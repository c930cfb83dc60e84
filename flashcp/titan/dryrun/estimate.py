"""An analytic estimate of one rank's peak memory, to check the dry run's measurement against.

Counts bytes from the model's shape and the layout alone: fp32 master weights, gradients and
AdamW's two moments sharded over FSDP x TP; bf16 copies of the layers FSDP has gathered (the
layer at work, the one prefetched, and the output projection, kept through the step); one RoPE
rows per layer (TorchTitan's tables) or per step (FlashCP's rows of this rank's tokens); with full
activation checkpointing one bf16 input per layer (two with offload: the last layer's and the one
being fetched back) plus one layer's recomputed working set (the MLP's intermediates for one of
`mlp_tiles` tiles) (under TP the projections' inputs and their gradients are
gathered to all of the rank's tokens at full width, the rest is split by TP), and the final hidden
states the output projection reads; FlashCP's gathered K/V and their gradients; and the loss's
logits (bf16, fp32 copy, saved log-softmax, its fp32 gradient) for one loss slice. A chunked loss
adds the fp32 gradient of the hidden states and, under FSDP, the output projection's gradient kept
unsharded across the slices in fp32 (FSDP's reduce dtype in the shipped configs) plus the fp32
reduce-scatter input it is copied into at the last slice. It assumes every term peaks at once, so
it should sit at or above the tracked peak.

A mixture-of-experts layer (Qwen3-MoE: `ModelShape.experts` > 0) counts its router (dim x experts)
and all its experts in the parameters, gradients and AdamW moments, sharded over every rank a
dense parameter is (EP borrows its ranks from FSDP x TP, and FSDP shards the experts over the rest);
its gathered bf16 copy holds the dense part and this EP rank's experts (experts / EP). Its working
set replaces the dense MLP's: the token dispatcher's copies of the routed rows (tokens x top_k x
dim each: the reordered input, the all-to-all's receive buffer, its expert-major permutation, the
experts' output, its unpermuted copy and the all-to-all back, 6 in all) and the experts'
intermediates (4 x tokens x top_k x expert width), assuming balanced routing (the dry run's
dispatcher splits evenly, `flashcp.titan.dryrun.run._balanced_routing`); the router's fp32 scores
(3 x tokens x experts) are added. A step whose routing is skewed receives more on its busiest rank.

With a low-precision converter (`[model] converters`, `LowPrecision`) one term is added, the casts
of one converted linear's backward, the largest (`cast_bytes`); nothing else changes. Source:
torchao's `Float8Linear` (`matmul_with_hp_or_float8_args`) and `MXFP8Linear` (`mx_mm`) save the
high-precision input and weight for backward and cast them again there, so the saved activations
stay bf16; the weights stay high-precision parameters (master copy, gradients and AdamW moments as
before); FSDP gathers them in bf16 (torchao gathers in float8 only with tensorwise scaling, which
TorchTitan 0.3.0's recipes, rowwise and rowwise_with_gw_hp, do not use). The backward casts
grad_output along both dims, the weight and the input (rowwise_with_gw_hp: grad_output once and the
weight), 1 byte per element (MXFP8 adds an 8-bit scale per 32; Float8's fp32 scale per row, 4 /
row length of the data, is left out). Not modelled: under torch.compile the partitioner may save
the float8 casts in place of the bf16 inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30


@dataclass(frozen=True)
class ModelShape:
    dim: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int  # Qwen3's is not always dim / heads
    ffn: int
    vocab: int
    rope_rows: int  # RoPE rows a rank holds: TorchTitan's table per layer (layers x seq_len), FlashCP's step rows (tokens)
    rope_row_bytes: int  # one position of it (complex Llama RoPE: 4 x head_dim, cos / sin Qwen3 RoPE: 8 x)
    experts: int = 0  # routed experts per layer (0: a dense model, `ffn` wide)
    top_k: int = 0  # experts per token
    expert_ffn: int = 0  # one expert's width


@dataclass(frozen=True)
class LowPrecision:
    """The linears a converter swaps, as this rank runs them: (in, out, tokens) each, split by TP."""

    converter: str  # "float8" | "mx"
    linears: tuple[tuple[int, int, int], ...]
    grad_weight_hp: bool = False  # Float8's rowwise_with_gw_hp: the weight gradient's matmul in high precision


@dataclass(frozen=True)
class Layout:
    fsdp: int  # ranks a parameter is sharded over (dp_shard x cp)
    tp: int
    sequence_parallel: bool
    tokens: int  # this rank's tokens (seq_len / cp)
    kv_rows: int  # K/V rows FlashCP gathers for this rank's shards in one layer
    loss_tokens: int  # tokens of one loss slice
    full_ac: bool
    mlp_tiles: int = 1  # the MLP's sequence tiles ([activation_checkpoint] mlp_tiles)
    offload: bool = False  # full AC's layer inputs in host memory, all but two on the GPU at the peak
    low_precision: LowPrecision | None = None  # [model] converters
    ep: int = 1  # expert parallelism: each rank gathers experts / ep experts of a layer


def cast_bytes(lp: LowPrecision) -> float:
    """The low-precision copies alive in the backward of the converted linear where they are largest
    (see the module doc): (2 T N + T K + K N) elements, (T N + K N) with the weight gradient in high
    precision, 1 byte each plus MXFP8's scale byte per 32."""
    per_element = 1 + (1 / 32 if lp.converter == "mx" else 0)
    casts = [t * n + k * n + (0 if lp.grad_weight_hp else t * n + t * k) for k, n, t in lp.linears]
    return per_element * max(casts, default=0)


def layer_params(m: ModelShape, ep: int = 1) -> int:
    """One layer's parameters; of a mixture of experts, those one of `ep` expert-parallel ranks gathers."""
    attention = 2 * m.dim * m.heads * m.head_dim + 2 * m.dim * m.kv_heads * m.head_dim
    if m.experts:
        return attention + m.dim * m.experts + 3 * m.dim * m.expert_ffn * m.experts // ep + 2 * m.dim
    return attention + 3 * m.dim * m.ffn + 2 * m.dim


def feed_forward_working(m: ModelShape, tokens: int, tiles: int) -> int:
    """bf16 elements the feed-forward keeps in one layer's working set (see the module doc)."""
    if m.experts:
        rows = tokens * m.top_k
        return 6 * rows * m.dim + 4 * rows * m.expert_ffn + 2 * 3 * tokens * m.experts
    return 4 * tokens * m.ffn // tiles


def estimate(m: ModelShape, lay: Layout) -> dict[str, float]:
    """GiB per category (the dry run's names) and their sum, "peak"."""
    vocab_params = m.vocab * m.dim
    params = m.layers * layer_params(m) + 2 * vocab_params + m.dim
    shard = lay.fsdp * lay.tp
    seq = lay.tokens // (lay.tp if lay.sequence_parallel else 1)  # tokens between blocks
    kv_dim = 2 * (m.kv_heads // lay.tp) * m.head_dim  # one row of K and V on this rank
    # One layer's bf16 elements: gathered projection inputs and gradients (full width); q, attention
    # output, k / v and the feed-forward's four intermediates (this rank's share); the residual
    # stream, norms and their gradients between blocks (fp32 in places, hence 8).
    sharded = (lay.tokens * (2 * m.heads * m.head_dim + kv_dim) + feed_forward_working(m, lay.tokens, lay.mlp_tiles)) \
        // lay.tp  # fmt: skip
    working = 4 * lay.tokens * m.dim + sharded + 8 * seq * m.dim
    on_gpu = min(2, m.layers) if lay.offload else m.layers  # layer inputs on the GPU at the peak
    checkpoints = on_gpu * seq * m.dim if lay.full_ac else m.layers * working
    chunked = lay.loss_tokens < lay.tokens
    chunk_buffers = 4 * lay.tokens * m.dim + (2 * 4 * vocab_params // lay.tp if lay.fsdp > 1 else 0)
    out = {
        "parameters": (4 * params / shard + 2 * (2 * layer_params(m, lay.ep) + vocab_params) / lay.tp) / GIB,
        "gradients": (4 * params / shard + 4 * layer_params(m, lay.ep) / lay.tp) / GIB,
        "optimizer_states": 8 * params / shard / GIB,
        "model_buffers": m.rope_rows * m.rope_row_bytes / GIB,
        "activations": 2 * (checkpoints + (working if lay.full_ac else 0) + lay.tokens * m.dim) / GIB,
        "flashcp_buffers": 2 * 2 * lay.kv_rows * kv_dim / GIB,
        "loss": (14 * lay.loss_tokens * m.vocab / lay.tp + (chunk_buffers if chunked else 0)) / GIB,
    }  # fmt: skip
    if lay.low_precision is not None:
        out["low_precision_casts"] = cast_bytes(lay.low_precision) / GIB
    out["peak"] = sum(out.values())
    return out
