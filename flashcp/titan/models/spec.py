"""The job's Llama 3 / Qwen3 / DeepSeek-V3 / gpt-oss / Qwen3.5 as a TorchTitan ModelSpec, its attention swapped for FlashCP's from outside.

The architecture comes from `flashcp.titan.models.decoders` (a TorchTitan flavor, a custom size or an HF
config.json, with the job's RoPE keys), built by TorchTitan's own per-layer builders. With
`model.attention = "flashcp"` only each layer's inner-attention config is replaced
(`use_flashcp_attention`) and the model is parallelised by `parallelize_flashcp`: TorchTitan's
recipe for both families ("partial_dtensor" backend) without its own CP forward hook, because
FlashCP's attention op does the CP exchange itself. FSDP shards over dp_shard x cp (TorchTitan's
"fsdp" mesh), TP splits heads; tied embeddings stay one parameter (TorchTitan's FSDP recipe puts the
embedding, final norm and output projection in one group).

DeepSeek-V3's MLA layers become `flashcp.titan.models.latent.FlashCPLatentAttention` (the latent rows
cross the CP group, not K and V); its dense first layers, shared experts and sigmoid router are
TorchTitan's, parallelised as Qwen3-MoE's below.

gpt-oss's attention is TorchTitan's with FlashCP's inner attention (its sliding-window layers on the
step's window dispatch, its sinks inside the op: `flashcp.titan.models.attention`); its MoE layers
(biased experts, clamped SwiGLU) are parallelised as Qwen3-MoE's. The sinks are parameters of
the attention modules, sharded by FSDP over dp_shard x cp like every weight, so their gradient,
each CP rank's from its own queries, is summed over the CP ranks as every other one.

Qwen3.5's hybrid text decoder (`flashcp.titan.models.gated_deltanet`) is built on FlashCP's Gated
DeltaNet and attention; its blocks are checkpointed and FSDP-sharded as every other family's (no TP).

Qwen3-MoE layers are TorchTitan's (router, token dispatcher, grouped experts computed in the
weights' dtype: `flashcp.titan.models.experts`). With `expert_parallel_degree` > 1 the experts are
laid out as in TorchTitan's `parallelize_qwen3`: sharded by expert over the "ep" mesh, which
borrows its ranks from dp_shard x cp x tp, and FSDP-sharded over the rest ("efsdp"). Tokens are
routed one by one, so CP needs nothing more of the MoE layer; the auxiliary-loss-free bias update
is TorchTitan's optimizer pre-step hook, whose expert counts are summed over the "loss" mesh
(dp_replicate x dp_shard x cp): the global batch, as at CP = 1 (docs/training.md, "Mixture of experts").
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl
from torchtitan.components.optimizer import register_moe_load_balancing_hook
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed.fsdp import apply_fsdp_to_decoder
from torchtitan.distributed.pipeline_parallel import pipeline_llm
from torchtitan.models.deepseek_v3 import DeepSeekV3Model, parallelize_deepseekv3
from torchtitan.models.gpt_oss import GptOssModel, parallelize_gptoss
from torchtitan.models.llama3 import parallelize_llama
from torchtitan.models.qwen3 import parallelize_qwen3, Qwen3Model
from torchtitan.models.utils import validate_converter_order
from torchtitan.protocols.model import ModelConfigConverter
from torchtitan.protocols.model_spec import ModelSpec

from flashcp.titan import compat
from flashcp.titan.models.attention import use_flashcp_attention
from flashcp.titan.models.latent import use_flashcp_latent_attention
from flashcp.titan.config import ConfigError
from flashcp.titan.models.decoders import ADAPTERS, job_architecture, titan_config
from flashcp.titan.models.head_groups import use_head_groups
from flashcp.titan.models.offload import offload_layer_inputs
from flashcp.titan.models.rope import attention_scale_factor
from flashcp.titan.models.tiled_block import use_tiled_blocks


def model_spec(
    model_cfg: dict[str, Any], flashcp_cfg: dict[str, Any], tokenizer_vocab: int, seq_len: int,
    offload: bool = False, mlp_tiles: int = 0, converters: list[ModelConfigConverter.Config] | None = None,
    compiled: bool = False, head_groups: int = 1, head_group_prefetch: bool = False,
) -> ModelSpec:
    """The job's model as a TorchTitan ModelSpec, with FlashCP attention when selected; `offload`: full
    activation checkpointing's layer inputs wait in host memory (`[activation_checkpoint] offload`);
    `mlp_tiles` > 1: the MLP runs over sequence tiles (`[activation_checkpoint] mlp_tiles`), in Llama 3's and
    dense Qwen3's blocks with the norms and the FFN's residual add (`tiled_block`);
    `converters`: TorchTitan's model converters (`[model] converters`), applied last to the config as
    TorchTitan's registries apply them, so before the model is built, parallelised and compiled;
    `compiled`: the blocks are compiled (`[compile] enable` with "model"), which changes how a
    checkpointed MoE block counts its tokens (`register_expert_balancing`); `head_groups` != 1: each
    attention layer runs over groups of KV heads (`[activation_checkpoint] head_groups`, `head_groups`), each
    group's KV exchange launched ahead with `head_group_prefetch`."""
    arch = job_architecture(model_cfg, tokenizer_vocab, seq_len)
    if tokenizer_vocab > arch.vocab_size:
        raise ConfigError(
            f"[model] vocab_size ({arch.vocab_size}) is smaller than the tokenizer's vocabulary "
            f"({tokenizer_vocab})"
        )
    attention = model_cfg["attention"]
    # RoPE covers every position inside a document: < seq_len (TorchTitan's tables; FlashCP computes
    # each step's rows instead, flashcp.titan.models.rotary).
    model = titan_config(arch, "flex" if attention == "flashcp" else attention, max_seq_len=seq_len)
    if attention == "flashcp" and arch.hybrid:
        # Qwen3.5: built on FlashCP's ops (its full layers keep their MRoPE); only the kernel is the job's.
        for layer in model.layers:
            if layer.attention is not None:
                layer.attention.inner_attention.backend = flashcp_cfg["backend"]
        parallelize = parallelize_flashcp
    elif attention == "flashcp" and arch.latent:
        # MLA: the latent rows cross the CP group (YaRN's correction is TorchTitan's mscale, in its scale).
        use_flashcp_latent_attention(model, backend=flashcp_cfg["backend"], overlap=flashcp_cfg["overlap"])
        parallelize = parallelize_flashcp
    elif attention == "flashcp":
        # YaRN's attention factor, which TorchTitan's attention has no place for (flashcp.titan.config
        # refuses YaRN with model.attention other than flashcp); gpt-oss's folds in the default one.
        use_flashcp_attention(model, backend=flashcp_cfg["backend"], overlap=flashcp_cfg["overlap"],
                              scale_factor=attention_scale_factor(arch.name, arch.rope))  # fmt: skip
        use_head_groups(model, head_groups, head_group_prefetch)
        parallelize = parallelize_flashcp
    else:
        parallelize = _parallelize_titan_cp
    use_tiled_blocks(model, mlp_tiles)
    if converters:  # as torchtitan.models.llama3.model_registry does
        validate_converter_order(converters)
        for converter in converters:
            model = converter.build().convert(model)
    if offload:
        parallelize = partial(_offloaded, parallelize)
    # Pipeline parallelism is TorchTitan's split (`pipeline_llm`), each stage parallelised by `parallelize`;
    # every microbatch's CPStep reaches every stage as its kwargs (flashcp.titan.trainer). The spec keeps
    # TorchTitan's HF state_dict_adapter: checkpoints stay DCP, the adapter maps Hugging Face weights in
    # (initial_load_in_hf) and out (flashcp.titan.export).
    return ModelSpec(
        name=arch.name,
        flavor="hf" if model_cfg.get("hf_config") else model_cfg["flavor"],
        model=model,
        parallelize_fn=parallelize,
        pipelining_fn=pipeline_llm,
        # MoE: the aux-loss-free expert bias update (a no-op registration for dense models).
        post_optimizer_build_fn=partial(register_expert_balancing, compiled=compiled),
        state_dict_adapter=ADAPTERS.get(arch.name),
    )


def register_expert_balancing(optimizers, model_parts: list[torch.nn.Module], parallel_dims, *, compiled: bool) -> None:
    """TorchTitan's aux-loss-free bias update (`register_moe_load_balancing_hook`), fed the counts it expects.

    It halves the expert token counts of every activation-checkpointed block, since eager
    checkpointing runs the router again in backward and counts each token twice. A compiled
    block's recompute does not repeat the count (torch 2.13: the forward's in-place buffer update
    is not replayed, under full and selective AC alike), so there the update would halve single
    counts and move the bias by other signs than a CP = 1 run's. For compiled checkpointed MoE
    blocks the counts are doubled first (a step pre-hook ahead of TorchTitan's): halved, they are
    exact again.
    """
    if compiled:
        counts = [block.moe.tokens_per_expert_E for part in model_parts for block in part.layers.values()
                  if getattr(block, "moe_enabled", False)
                  and getattr(block, "checkpoint_impl", None) is CheckpointImpl.NO_REENTRANT]  # fmt: skip

        def double(*args, **kwargs) -> None:
            for count in counts:
                count.mul_(2)

        if counts:
            optimizers.register_step_pre_hook(double)
    register_moe_load_balancing_hook(optimizers, model_parts, parallel_dims)


def uncounted_pipeline_inference(schedule: Any, model_parts: list[torch.nn.Module]) -> None:
    """Keep a pipeline schedule's metadata inference out of the expert token counts.

    Before its first microbatch a schedule runs every stage it holds once on the first microbatch's
    inputs (torch 2.13's `_initialize_pp_stages`: the stages' output and gradient shapes, found by
    running them, a later stage on zeros of its input's shape). A MoE block counts the tokens its
    router sends to each expert in every forward, so that one extra forward added a microbatch's
    tokens to the first step's counts, and the aux-loss-free bias update, which moves each expert's
    bias by the sign of (mean - count) over the step, moved some biases the other way than a run
    without PP: the first step's gradients matched and the losses parted from step 2 on. The counts
    are put back as they were before the inference (no-op for dense models and without PP).
    """
    moes = [block.moe for part in model_parts for block in part.layers.values()
            if getattr(block, "moe_enabled", False)]  # fmt: skip
    if not moes:
        return
    initialize = schedule._initialize_pp_stages

    def uncounted(*args: Any, **kwargs: Any) -> Any:
        before = [moe.tokens_per_expert_E.detach().clone() for moe in moes]
        try:
            return initialize(*args, **kwargs)
        finally:
            with torch.no_grad():
                for moe, counts in zip(moes, before, strict=True):
                    moe.tokens_per_expert_E.copy_(counts)

    schedule._initialize_pp_stages = uncounted


def parallelize_flashcp(model: torch.nn.Module, *, parallel_dims, training, parallelism, compile_config,
                        ac_config, dump_folder: str) -> torch.nn.Module:  # fmt: skip
    """TP / EP, activation checkpointing, per-block compile and FSDP over dp_shard x cp (experts: efsdp).

    The same order as TorchTitan's `parallelize_llama` and `parallelize_qwen3` ("partial_dtensor"
    backend), minus their context-parallel forward hook: FlashCP's attention exchanges KV itself,
    and every other layer (MoE included) is token-wise, so CP needs nothing else from the model.
    """
    if parallel_dims.tp_enabled or parallel_dims.ep_enabled:
        model.parallelize(parallel_dims)
    if ac_config is not None:
        ac_config.build(dump_folder=dump_folder).apply(model)
    if compile_config.enable and "model" in compile_config.components:
        # Per block like TorchTitan's apply_compile, each block one graph: FlashCP's attention is a
        # registered op the compiler keeps whole (see flashcp.titan.models.attention). As there, the
        # MoE dispatch's data-dependent sizes are captured as symbolic scalars.
        torch._dynamo.config.capture_scalar_outputs = True
        for block in model.layers.values():
            block.compile(backend=compile_config.backend, fullgraph=True)
    replicate = ["dp_replicate"] if parallel_dims.dp_replicate_enabled else []
    apply_fsdp_to_decoder(
        model,
        parallel_dims.get_mesh([*replicate, "fsdp"]),
        param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
        reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
        pp_enabled=parallel_dims.pp_enabled,  # "default" keeps a stage's weights gathered between microbatches
        cpu_offload=training.enable_cpu_offload,
        reshard_after_forward_policy=parallelism.fsdp_reshard_after_forward,
        enable_symm_mem=parallelism.enable_fsdp_symm_mem,
        ep_degree=parallel_dims.ep,
        edp_mesh=parallel_dims.get_optional_mesh([*replicate, "efsdp"]) if parallel_dims.ep_enabled else None,
    )
    compat.force_sum_reduction_on_gloo(model)
    return model


def _offloaded(parallelize, model: torch.nn.Module, **kwargs) -> torch.nn.Module:
    """`parallelize`, then the offload hooks on the checkpointed (and sharded) blocks."""
    model = parallelize(model, **kwargs)
    offload_layer_inputs(list(model.layers.values()))
    return model


def _parallelize_titan_cp(model: torch.nn.Module, **kwargs) -> torch.nn.Module:
    """TorchTitan's own recipe (its built-in CP included), for comparing against FlashCP."""
    recipe = {Qwen3Model: parallelize_qwen3, DeepSeekV3Model: parallelize_deepseekv3,
              GptOssModel: parallelize_gptoss}.get(type(model), parallelize_llama)  # fmt: skip
    model = recipe(model, **kwargs)
    compat.force_sum_reduction_on_gloo(model)
    return model
