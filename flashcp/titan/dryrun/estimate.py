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
it should sit at or above the tracked peak. With FSDP's CPU offload (`Layout.cpu_offload`) the fp32
shards, their gradients and AdamW's moments are on the host: only the gathered bf16 copies and the
unsharded gradients of one layer stay in the GPU's terms.

A mixture-of-experts layer (Qwen3-MoE: `ModelShape.experts` > 0) counts its router (dim x experts)
and all its experts in the parameters, gradients and AdamW moments, sharded over every rank a
dense parameter is (EP borrows its ranks from FSDP x TP, and FSDP shards the experts over the rest);
its gathered bf16 copy holds the dense part and this EP rank's experts (experts / EP). Its working
set replaces the dense MLP's: the token dispatcher's copies of the routed rows (tokens x top_k x
dim each: the reordered input, the all-to-all's receive buffer, its expert-major permutation, the
experts' output, its unpermuted copy and the all-to-all back, 6 in all) and the experts'
intermediates (4 x tokens x top_k x expert width), assuming balanced routing (the dry run's
dispatcher splits evenly, `flashcp.titan.dryrun.fakes.balanced_routing`); the router's fp32 scores
(3 x tokens x experts) are added. A step whose routing is skewed receives more on its busiest rank.

Multi-head latent attention (DeepSeek-V3: `ModelShape.latent_rank` > 0) counts its own projections
(q, or q's low-rank pair; wkv_a to the latent row; wkv_b up to each head's key and value; wo) and
FlashCP's latent exchange (`flashcp.attention.latent`): the rows a rank receives are latent rows
(`latent_rank + rope_dim` values, the exchange's receive buffer and, in the backward, its
gradient), the gathered key rows its shards attend are kept as latent rows (the up-projection's
saved input) and as the up-projected per-head K and V the kernel saves (heads x (qk + v)), each
with its gradient. The first `dense_layers` layers of such a model are dense MLPs (`ffn` wide),
the rest mixtures of experts with `shared_ffn` wide shared experts beside the routed ones.

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

import dataclasses
from dataclasses import dataclass

from flashcp.costmodel.step import mla_attention_params

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
    dense_layers: int = 0  # of a mixture of experts, the first layers that are dense MLPs (`ffn` wide)
    shared_ffn: int = 0  # a mixture-of-experts layer's shared experts, their width together
    v_head_dim: int = 0  # 0: head_dim (MLA's value head is narrower than its qk head)
    latent_rank: int = 0  # MLA's kv_lora_rank (0: K/V attention)
    rope_dim: int = 0  # MLA's RoPE key, shared by the heads: a latent row is latent_rank + rope_dim
    q_lora_rank: int = 0  # MLA's low-rank query (0: one dim x heads x head_dim projection)

    @property
    def latent(self) -> int:
        """Values of one exchanged MLA row (0: not MLA)."""
        return self.latent_rank + self.rope_dim if self.latent_rank else 0

    @property
    def v_dim(self) -> int:
        return self.v_head_dim or self.head_dim


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
    kv_rows: int  # rows FlashCP's exchange holds in one layer (received and gathered; MLA: latent rows)
    loss_tokens: int  # tokens of one loss slice
    full_ac: bool
    mlp_tiles: int = 1  # the MLP's sequence tiles ([activation_checkpoint] mlp_tiles)
    offload: bool = False  # full AC's layer inputs in host memory, all but two on the GPU at the peak
    low_precision: LowPrecision | None = None  # [model] converters
    ep: int = 1  # expert parallelism: each rank gathers experts / ep experts of a layer
    key_rows: int = 0  # MLA: the gathered key rows this rank's shards attend, up-projected to K and V
    cpu_offload: bool = False  # [training] enable_cpu_offload: the sharded fp32 state on the host


def cast_bytes(lp: LowPrecision) -> float:
    """The low-precision copies alive in the backward of the converted linear where they are largest
    (see the module doc): (2 T N + T K + K N) elements, (T N + K N) with the weight gradient in high
    precision, 1 byte each plus MXFP8's scale byte per 32."""
    per_element = 1 + (1 / 32 if lp.converter == "mx" else 0)
    casts = [t * n + k * n + (0 if lp.grad_weight_hp else t * n + t * k) for k, n, t in lp.linears]
    return per_element * max(casts, default=0)


def attention_params(m: ModelShape) -> int:
    """One layer's attention projections (and MLA's latent norm)."""
    if not m.latent_rank:
        return 2 * m.dim * m.heads * m.head_dim + 2 * m.dim * m.kv_heads * m.head_dim
    return mla_attention_params(m.dim, m.heads, m.q_lora_rank, m.latent_rank, m.head_dim - m.rope_dim, m.rope_dim,
                                m.v_dim)  # fmt: skip


def layer_params(m: ModelShape, ep: int = 1) -> int:
    """The largest layer's parameters; of a mixture of experts, those one of `ep` expert-parallel ranks
    gathers (a model whose first layers are dense: the larger of the two kinds)."""
    dense = attention_params(m) + 3 * m.dim * m.ffn + 2 * m.dim
    if m.experts:
        routed = m.expert_ffn * m.experts // ep
        moe = attention_params(m) + m.dim * m.experts + 3 * m.dim * (routed + m.shared_ffn) + 2 * m.dim
        return max(moe, dense) if m.dense_layers else moe
    return dense


def model_params(m: ModelShape) -> int:
    """Every layer's parameters (all the experts), without the embedding and output projection."""
    if not m.experts:
        return m.layers * layer_params(m)
    dense = dataclasses.replace(m, experts=0)
    moe = dataclasses.replace(m, dense_layers=0)
    return m.dense_layers * layer_params(dense) + (m.layers - m.dense_layers) * layer_params(moe)


def all_params(m: ModelShape) -> int:
    """The whole model's parameters: the layers', the embedding and output projection, the final norm."""
    return model_params(m) + 2 * m.vocab * m.dim + m.dim


def feed_forward_working(m: ModelShape, tokens: int, tiles: int) -> int:
    """bf16 elements the feed-forward keeps in one layer's working set (see the module doc)."""
    dense = 4 * tokens * m.ffn // tiles
    if m.experts:
        rows = tokens * m.top_k
        moe = 6 * rows * m.dim + 4 * rows * m.expert_ffn + 2 * 3 * tokens * m.experts
        moe += 4 * tokens * m.shared_ffn  # the shared experts' intermediates, as a dense MLP's
        return max(moe, dense) if m.dense_layers else moe
    return dense


def exchange_bytes(m: ModelShape, lay: Layout) -> int:
    """FlashCP's buffers in one layer's backward, bf16: the exchanged rows (K/V rows, or MLA's latent
    rows) and their gradients, plus for MLA the up-projected K and V of the key rows and their
    gradients."""
    if not m.latent:
        return 2 * 2 * lay.kv_rows * (m.kv_heads // lay.tp) * (m.head_dim + m.v_dim)
    # K and V, kept for the kernel, with their gradients, and the contiguous copy of k_nope's gradient
    # (a column slice of dK) the up-projection's backward multiplies
    per_key = m.heads * (2 * (m.head_dim + m.v_dim) + m.head_dim - m.rope_dim)
    return 2 * (2 * lay.kv_rows * m.latent + lay.key_rows * per_key)


def estimate(m: ModelShape, lay: Layout) -> dict[str, float]:
    """GiB per category (the dry run's names) and their sum, "peak"."""
    vocab_params = m.vocab * m.dim
    params = all_params(m)
    shard = lay.fsdp * lay.tp
    seq = lay.tokens // (lay.tp if lay.sequence_parallel else 1)  # tokens between blocks
    local_kv = m.latent or 2 * (m.kv_heads // lay.tp) * m.head_dim  # a row of K and V (MLA: latent) here
    # One layer's bf16 elements: gathered projection inputs and gradients (full width); q, attention
    # output, k / v and the feed-forward's four intermediates (this rank's share); the residual
    # stream, norms and their gradients between blocks (fp32 in places, hence 8).
    attention = lay.tokens * (m.heads * (m.head_dim + m.v_dim) + local_kv)
    sharded = (attention + feed_forward_working(m, lay.tokens, lay.mlp_tiles)) // lay.tp
    working = 4 * lay.tokens * m.dim + sharded + 8 * seq * m.dim
    on_gpu = min(2, m.layers) if lay.offload else m.layers  # layer inputs on the GPU at the peak
    checkpoints = on_gpu * seq * m.dim if lay.full_ac else m.layers * working
    chunked = lay.loss_tokens < lay.tokens
    chunk_buffers = 4 * lay.tokens * m.dim + (2 * 4 * vocab_params // lay.tp if lay.fsdp > 1 else 0)
    shard_on_gpu = 0 if lay.cpu_offload else params / shard  # fp32 elements of this rank's shards on the GPU
    out = {
        "parameters": (4 * shard_on_gpu + 2 * (2 * layer_params(m, lay.ep) + vocab_params) / lay.tp) / GIB,
        "gradients": (4 * shard_on_gpu + 4 * layer_params(m, lay.ep) / lay.tp) / GIB,
        "optimizer_states": 8 * shard_on_gpu / GIB,
        "model_buffers": m.rope_rows * m.rope_row_bytes / GIB,
        "activations": 2 * (checkpoints + (working if lay.full_ac else 0) + lay.tokens * m.dim) / GIB,
        "flashcp_buffers": exchange_bytes(m, lay) / GIB,
        "loss": (14 * lay.loss_tokens * m.vocab / lay.tp + (chunk_buffers if chunked else 0)) / GIB,
    }  # fmt: skip
    if lay.low_precision is not None:
        out["low_precision_casts"] = cast_bytes(lay.low_precision) / GIB
    out["peak"] = sum(out.values())
    return out
