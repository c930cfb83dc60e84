"""TorchTitan's Llama 3, its attention swapped for FlashCP's, and parallelism applied from outside.

The model definition is TorchTitan's (`torchtitan.models.llama3`): named flavors come from its
registry, a "custom" flavor is built with the same per-layer builder and initialisers. With
`model.attention = "flashcp"` only each layer's inner-attention config is replaced
(`use_flashcp_attention`) and the model is parallelised by `parallelize_flashcp`: TorchTitan's
Llama 3 recipe without its own CP forward hook, because FlashCP's attention op does the CP
exchange itself. FSDP shards over dp_shard x cp (TorchTitan's "fsdp" mesh), TP splits heads.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed.fsdp import apply_fsdp_to_decoder
from torchtitan.models.common import ComplexRoPE, compute_ffn_hidden_dim, Embedding, Linear, RMSNorm
from torchtitan.models.llama3 import model_registry, parallelize_llama
from torchtitan.models.llama3 import (  # TorchTitan 0.3.0's own Llama 3 builder and initialisers
    _build_llama3_layers,
    _EMBEDDING_INIT,
    _NORM_INIT,
    _output_linear_init,
)
from torchtitan.models.llama3.model import Llama3Model
from torchtitan.protocols.model_spec import ModelSpec

from flashcp.titan import compat
from flashcp.titan.attention import use_flashcp_attention
from flashcp.titan.config import ConfigError, TOKENIZER_SIZED_FLAVORS


def llama3_spec(model_cfg: dict[str, Any], flashcp_cfg: dict[str, Any], tokenizer_vocab: int) -> ModelSpec:
    """The job's Llama 3 as a TorchTitan ModelSpec, with FlashCP attention when selected."""
    attention = model_cfg["attention"]
    titan_backend = "flex" if attention == "flashcp" else attention  # replaced below for flashcp
    if model_cfg["flavor"] == "custom":
        vocab = model_cfg["vocab_size"] or tokenizer_vocab
        spec = dataclasses.replace(
            model_registry("debugmodel"),
            flavor="custom",
            model=_custom_llama3(model_cfg, vocab, titan_backend),
        )
    else:
        spec = model_registry(model_cfg["flavor"], attn_backend=titan_backend)
        vocab = spec.model.vocab_size
        if model_cfg["flavor"] in TOKENIZER_SIZED_FLAVORS:
            vocab = tokenizer_vocab
            model = spec.model
            spec = dataclasses.replace(spec, model=dataclasses.replace(
                model,
                vocab_size=vocab,
                tok_embeddings=dataclasses.replace(model.tok_embeddings, num_embeddings=vocab),
                lm_head=dataclasses.replace(model.lm_head, out_features=vocab),
            ))  # fmt: skip
    if tokenizer_vocab > vocab:
        raise ConfigError(
            f"[model] vocab_size ({vocab}) is smaller than the tokenizer's vocabulary ({tokenizer_vocab})"
        )
    # No pipeline parallelism. The spec keeps TorchTitan's HF state_dict_adapter: checkpoints stay
    # DCP, the adapter maps Hugging Face weights in (initial_load_in_hf) and out (flashcp.titan.export).
    spec = dataclasses.replace(spec, pipelining_fn=None)
    if attention == "flashcp":
        use_flashcp_attention(spec.model, backend=flashcp_cfg["backend"], overlap=flashcp_cfg["overlap"])
        return dataclasses.replace(spec, parallelize_fn=parallelize_flashcp)
    return dataclasses.replace(spec, parallelize_fn=_parallelize_titan_cp)


def _custom_llama3(model_cfg: dict[str, Any], vocab: int, attn_backend: str) -> Llama3Model.Config:
    """A Llama 3 of any size, built like TorchTitan's flavors (llama3_configs)."""
    dim, n_heads = model_cfg["dim"], model_cfg["n_heads"]
    hidden = compute_ffn_hidden_dim(
        dim, multiple_of=model_cfg["multiple_of"] or 256, ffn_dim_multiplier=model_cfg["ffn_dim_multiplier"]
    )
    return Llama3Model.Config(
        dim=dim,
        vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_output_linear_init(dim)),
        layers=_build_llama3_layers(
            n_layers=model_cfg["n_layers"],
            dim=dim,
            n_heads=n_heads,
            n_kv_heads=model_cfg["n_kv_heads"],
            hidden_dim=hidden,
            rope=ComplexRoPE.Config(
                dim=dim // n_heads, max_seq_len=131072, theta=model_cfg["rope_theta"], scaling="llama"
            ),
            attn_backend=attn_backend,
        ),
    )


def parallelize_flashcp(model: torch.nn.Module, *, parallel_dims, training, parallelism, compile_config,
                        ac_config, dump_folder: str) -> torch.nn.Module:  # fmt: skip
    """TP, activation checkpointing, per-block compile and FSDP over dp_shard x cp.

    The same order as TorchTitan's `parallelize_llama` ("partial_dtensor" backend), minus its
    context-parallel forward hook: FlashCP's attention exchanges KV itself, and every other
    layer is token-wise, so CP needs nothing else from the model.
    """
    if parallel_dims.tp_enabled:
        model.parallelize(parallel_dims)
    if ac_config is not None:
        ac_config.build(dump_folder=dump_folder).apply(model)
    if compile_config.enable and "model" in compile_config.components:
        # Per block like TorchTitan's apply_compile, but not fullgraph: each block breaks its graph
        # around FlashCP's attention op, which runs eagerly (see flashcp.titan.attention).
        for block in model.layers.values():
            block.compile(backend=compile_config.backend, fullgraph=False)
    names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
    apply_fsdp_to_decoder(
        model,
        parallel_dims.get_mesh(names),
        param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
        reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
        pp_enabled=False,
        cpu_offload=training.enable_cpu_offload,
        reshard_after_forward_policy=parallelism.fsdp_reshard_after_forward,
        enable_symm_mem=parallelism.enable_fsdp_symm_mem,
    )
    compat.force_sum_reduction_on_gloo(model)
    return model


def _parallelize_titan_cp(model: torch.nn.Module, **kwargs) -> torch.nn.Module:
    """TorchTitan's own recipe (its built-in CP included), for comparing against FlashCP."""
    model = parallelize_llama(model, **kwargs)
    compat.force_sum_reduction_on_gloo(model)
    return model
