"""What the analytic estimate (`flashcp.titan.dryrun.estimate`) needs from the job the dry run built
(`flashcp.titan.dryrun.run`): the model's shape and this rank's layout (FlashCP's K/V rows at their
peak, the converted linears as this rank runs them), and the window's plan figures for the report.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from flashcp.titan.config.converters import converted_linears
from flashcp.titan.dryrun.estimate import Layout, LowPrecision, ModelShape
from flashcp.titan.models.rotary import rotation
from flashcp.titan.models.tiled_mlp import tile_count
from flashcp.titan.models.windows import HybridDispatches, LayerDispatches


def plan_figures(trainer) -> dict[str, float | str]:
    """The window's imbalance and KV bytes received per layer (compact / full / needed; an MLA model's
    in latent rows, with the bytes of one latent and one K/V row; a model with sliding-window layers
    also a window layer's compact / needed and those of the exchange its layers run, `window_comm`, with
    W and the layer counts)."""
    metrics = trainer.metrics_processor
    figures = {key.removeprefix("flashcp/"): value for key, value in metrics._flashcp_metrics().items()}
    workload = metrics.attention_workload
    if workload.window_layers:
        figures |= {"window": workload.window, "window_layers": workload.window_layers,
                    "full_layers": workload.full_layers, "window_comm": metrics.window_comm}  # fmt: skip
    if metrics.exchange_row_bytes:  # MLA: the bytes above are latent rows; a K/V row's for comparison
        figures |= {"latent_row_bytes": metrics.exchange_row_bytes, "kv_row_bytes": metrics.kv_row_bytes}
    return figures


def shape_and_layout(trainer, dispatch, job: dict[str, Any]) -> tuple[ModelShape, Layout]:
    """The model's shape and this rank's layout; FlashCP's rows are a full layer's, the largest (a
    sliding-window layer receives at most W - 1 rows before each cut shard)."""
    from torchtitan.distributed.activation_checkpoint import FullAC

    if isinstance(dispatch, (LayerDispatches, HybridDispatches)):
        dispatch = dispatch.full

    model, dims, cfg = trainer.model_config, trainer.parallel_dims, trainer.config
    ac = job["activation_checkpoint"]
    attention = model.first_attention
    tokens = cfg.training.seq_len // dims.cp
    rope_row = rotation(attention.rope, torch.zeros(1, dtype=torch.long))  # one position's RoPE row
    first = next(i for i, layer in enumerate(model.layers) if layer.attention is not None)  # a hybrid's: not "0"
    block = trainer.model_parts[0].layers[str(first)]
    tables = hasattr((getattr(block, "attention", None) or block.attn).rope, "cache")  # TorchTitan's, else per step
    moe = next((layer.moe for layer in model.layers if layer.moe is not None), None)
    dense = [layer.feed_forward for layer in model.layers if layer.moe is None]  # DeepSeek's first layers
    experts = {} if moe is None else dict(
        experts=moe.num_experts, top_k=moe.router.top_k,
        expert_ffn=moe.routed_experts.inner_experts.hidden_dim, dense_layers=len(dense),
        shared_ffn=moe.shared_experts.w1.out_features if moe.shared_experts else 0,
    )  # fmt: skip
    if getattr(attention, "kv_lora_rank", 0):  # MLA: latent rows cross the CP group (attention/latent.py)
        rope = attention.qk_rope_head_dim
        heads = dict(kv_heads=attention.n_heads, head_dim=attention.qk_nope_head_dim + rope,
                     v_head_dim=attention.v_head_dim, latent_rank=attention.kv_lora_rank, rope_dim=rope,
                     q_lora_rank=attention.q_lora_rank)  # fmt: skip
    else:
        heads = dict(kv_heads=attention.n_kv_heads or attention.n_heads,
                     head_dim=attention.head_dim or model.dim // attention.n_heads)  # fmt: skip
    shape = ModelShape(
        dim=model.dim, layers=len(model.layers), heads=attention.n_heads, **heads,
        ffn=dense[0].w1.out_features if dense else 0, vocab=model.vocab_size,
        rope_rows=len(model.layers) * attention.rope.max_seq_len if tables else tokens,
        rope_row_bytes=rope_row.numel() * rope_row.element_size(), **experts,
    )  # fmt: skip
    chunks = getattr(trainer.loss_fn, "num_chunks", 1)
    layout = Layout(
        fsdp=dims.dp_shard * dims.cp, tp=dims.tp, sequence_parallel=cfg.parallelism.enable_sequence_parallel,
        tokens=tokens, kv_rows=_kv_rows(dispatch), loss_tokens=tokens // chunks,
        full_ac=isinstance(cfg.activation_checkpoint, FullAC.Config),
        mlp_tiles=max(1, tile_count(ac["mlp_tiles"], tokens, shape.ffn // dims.tp, 2)) if shape.ffn else 1,
        offload=ac["offload"], ep=dims.ep, key_rows=dispatch.kv_index.numel(),
        cpu_offload=cfg.training.enable_cpu_offload,
    )  # fmt: skip
    return shape, dataclasses.replace(layout, low_precision=_low_precision(job, model, layout, dims.tp))


def _kv_rows(dispatch) -> int:
    """K/V rows of one layer's exchange at its peak: the receive buffer with the gathered keys or, in the
    two-level exchange's second stage, with the first stage's output, its copy joined to the local rows
    and the rows sent on (`flashcp.attention.two_level.launch`). The ring's peak is its backward: two KV
    blocks in flight and four blocks of float32 dK/dV sums (this rank's, the travelling, the arriving
    and one step's share; two bf16 rows each), whatever the window (`flashcp.attention.ring`)."""
    if dispatch.comm == "ring":
        return (2 + 4 * 2) * dispatch.token_index.numel()
    route = getattr(dispatch, "route", None)
    staged = 0
    if route is not None:
        first = sum(route.stage1_recv_splits)
        staged = 2 * first + dispatch.token_index.numel() + route.stage2_index.numel()
    return dispatch.recv_size + max(dispatch.kv_index.numel(), staged)


def _low_precision(job: dict[str, Any], model_config: Any, lay: Layout, tp: int) -> LowPrecision | None:
    """The job's converted linears as this rank runs them: TorchTitan's TP splits wo and w2 along their
    input (row-wise), the others along their output; the MLP runs a tile's tokens at a time, the output
    projection a loss slice's."""
    names = job["model"]["converters"]
    if not names:
        return None
    linears = []
    for fqn, lin in converted_linears(model_config, job):
        k, n = lin.in_features, lin.out_features
        k, n = (k // tp, n) if fqn.rsplit(".", 1)[-1] in ("wo", "w2") else (k, n // tp)
        tokens = lay.loss_tokens if fqn == "lm_head" else \
            math.ceil(lay.tokens / lay.mlp_tiles) if ".feed_forward." in fqn else lay.tokens  # fmt: skip
        linears.append((k, n, tokens))
    gw_hp = names[0] == "float8" and job["float8"]["recipe_name"] == "rowwise_with_gw_hp"
    return LowPrecision(names[0], tuple(linears), grad_weight_hp=gw_hp)
