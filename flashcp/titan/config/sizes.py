"""A job's model counted from its sizes before anything is built: a config.json or a `[model]` table
is not trusted to describe a model any machine can hold.

With 10^9 experts in a config.json the pre-launch check built one checkpoint key per expert until
the kernel's OOM killer ended it, host-wide. Every size is checked by arithmetic first, by two
counts, lower bounds both (a model that fits is never refused), against this machine's memory,
which stands for a node's:

- `check_host_objects` (every job, before the world size is known): each process that checks,
  builds or imports the model holds, in host memory whatever its device, one module per layer
  (LAYER_BYTES, built on the meta device) and one named tensor per checkpoint key (TENSOR_BYTES;
  Hugging Face names one per expert matrix and layer);
- `check_weights` (with the world size): one rank's share of the bf16 weights, 2 bytes per
  parameter over every rank of the job, must fit, since no rank holds more than its whole node.

A refusal is one line naming the size that, at its least, shrinks the count the most, by the key
it was read from.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

from flashcp.costmodel.step import mla_attention_params
from flashcp.titan.config.keys import ConfigError
from flashcp.titan.hf.config import Architecture, architecture_from_hf, HFConfigError, read_hf_json, size_keys
from flashcp.titan.models.registry import flavor_architecture

LAYER_BYTES = 32 << 10  # a decoder layer's modules on the meta device (measured: about 60 KiB)
TENSOR_BYTES = 256  # a named tensor of a state dict and of its Hugging Face copy (measured: about 500 B)
WEIGHT_BYTES = 2  # bf16: the least a rank holds of a parameter
MAX_SIZE = 2**63 - 1  # torch's sizes are int64
GIB = 2**30
SIZES = (
    "vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "hidden_dim", "experts.num_experts",
    "experts.hidden_dim", "experts.shared", "latent.q_lora_rank", "latent.kv_lora_rank", "latent.qk_nope_head_dim",
    "latent.qk_rope_head_dim", "latent.v_head_dim",
)  # fmt: skip
# A custom size's keys; its feed-forward width is derived from three of them.
CUSTOM_KEYS = {
    "vocab_size": "[model] vocab_size", "dim": "[model] dim", "n_layers": "[model] n_layers",
    "n_heads": "[model] n_heads", "n_kv_heads": "[model] n_kv_heads", "head_dim": "[model] head_dim",
    "hidden_dim": "the feed-forward width ([model] dim, ffn_dim_multiplier, multiple_of)",
    "experts.num_experts": "[model] num_experts", "experts.hidden_dim": "[model] moe_hidden_dim",
}  # fmt: skip


def check_host_objects(cfg: dict) -> None:
    """ConfigError naming the size when the model's layers and named tensors would not fit this
    machine's memory (see the module doc), or a size is beyond torch's int64."""
    arch, keys = _model(cfg)
    need, have = host_bytes(arch), _memory()
    if need > have:
        layers, tensors = arch.n_layers, named_tensors(arch)
        raise ConfigError(
            f"{_blame(arch, keys, host_bytes)} makes a model of {layers:,} layers and {tensors:,} named tensors (one "
            "per expert matrix and layer), which every process that checks, builds or imports it holds in host "
            f"memory: at least {need / GIB:,.1f} GiB, and this machine has {have / GIB:.1f} GiB"
        )


def check_weights(cfg: dict, world_size: int) -> None:
    """ConfigError naming the size when one rank's share of the bf16 weights, over `world_size` ranks,
    exceeds this machine's memory (see the module doc)."""
    arch, keys = _model(cfg)
    count = parameters(arch)
    need, have = WEIGHT_BYTES * count / world_size, _memory()
    if need > have:
        raise ConfigError(
            f"{_blame(arch, keys, parameters)} makes a model of {count:.3g} parameters: one rank's share "
            f"of its bf16 weights over the job's {world_size} rank(s) is at least {need / GIB:,.1f} GiB, more than "
            f"this machine's {have / GIB:.1f} GiB of memory (no rank holds more than its node)"
        )


def parameters(arch: Architecture) -> int:
    """The parameters TorchTitan builds for `arch`."""
    dense, moe = _layers(arch)
    dim, experts, latent = arch.dim, arch.experts, arch.latent
    if latent:
        attention = mla_attention_params(
            dim, arch.n_heads, latent.q_lora_rank, latent.kv_lora_rank, latent.qk_nope_head_dim,
            latent.qk_rope_head_dim, latent.v_head_dim,
        )
    else:
        attention = 2 * dim * arch.head_dim * (arch.n_heads + arch.n_kv_heads) + 2 * arch.head_dim * arch.qk_norm
    feed_forward = 3 * dim * arch.hidden_dim * dense
    if experts:  # the router, the routed and the shared experts
        routed = experts.num_experts
        feed_forward += dim * (routed + 3 * experts.hidden_dim * (routed + experts.shared)) * moe
    embeddings = arch.vocab_size * dim * (1 if arch.tie_embeddings else 2)
    return arch.n_layers * (attention + 2 * dim) + feed_forward + embeddings + dim


def named_tensors(arch: Architecture) -> int:
    """The tensors of `arch`'s Hugging Face checkpoint, at least: the embedding, final norm and
    output; per layer four attention projections, two norms and a dense MLP's three, or a router and
    three per expert."""
    dense, moe = _layers(arch)
    per_expert = 3 * arch.experts.num_experts if arch.experts else 0
    return 3 + 6 * arch.n_layers + 3 * dense + (1 + per_expert) * moe


def host_bytes(arch: Architecture) -> int:
    """Host memory a process that builds `arch` on the meta device or names its checkpoint holds, at least."""
    return arch.n_layers * LAYER_BYTES + named_tensors(arch) * TENSOR_BYTES


def _layers(arch: Architecture) -> tuple[int, int]:
    """(dense layers, mixture-of-experts layers)."""
    if arch.experts is None:
        return arch.n_layers, 0
    dense = min(arch.n_dense_layers, arch.n_layers)
    return dense, arch.n_layers - dense


def _model(cfg: dict) -> tuple[Architecture, dict[str, str]]:
    """The job's architecture (a custom size's vocabulary, the tokenizer's, counted as 1) and the key
    each size was read from; ConfigError for a size beyond int64."""
    model = cfg["model"]
    if model["hf_config"] is not None:
        try:
            file, hf = read_hf_json(model["hf_config"])
            arch = architecture_from_hf(hf, where=str(file))
        except HFConfigError as e:
            raise ConfigError(f"[model] hf_config: {e}") from e
        keys = {size: f"[model] hf_config: {file}: {key}" for size, key in size_keys(hf).items()}
    elif model["flavor"] == "custom":
        from flashcp.titan.models.decoders import job_architecture  # it imports this package

        arch, keys = job_architecture(model, 1, cfg["training"]["seq_len"]), CUSTOM_KEYS
    else:
        arch = flavor_architecture(model["name"], model["flavor"])
        keys = {size: f"{size} of [model] flavor {model['flavor']!r}" for size in SIZES}
    for size in SIZES:
        value = _size(arch, size)
        if value is not None and value > MAX_SIZE:
            raise ConfigError(f"{keys[size]} is a {len(str(value))}-digit number, beyond 2**63 - 1, the largest size "
                              "torch holds")  # fmt: skip
    return arch, keys


def _size(arch: Architecture, size: str) -> int | None:
    """`arch`'s size named as in SIZES ("experts.num_experts"); None where it has no such part."""
    value = arch
    for name in size.split("."):
        value = getattr(value, name) if value is not None else None
    return value


def _blame(arch: Architecture, keys: dict[str, str], count: Callable[[Architecture], int]) -> str:
    """"key = value" of the size that, at its least, shrinks `count` the most."""
    sizes = [size for size in SIZES if size in keys and _size(arch, size) is not None]
    size = min(sizes, key=lambda s: count(_least(arch, s)))
    return f"{keys[size]} = {_size(arch, size):,}"


def _least(arch: Architecture, size: str) -> Architecture:
    """`arch` with `size` at its least, 1, and what is bound to it with it: the KV heads of one head;
    as layers, one of each kind the model has (dense, mixture of experts)."""
    part, _, name = size.rpartition(".")
    if part:
        return dataclasses.replace(arch, **{part: dataclasses.replace(getattr(arch, part), **{name: 1})})
    if name == "n_layers":
        dense, moe = _layers(arch)
        return dataclasses.replace(arch, n_layers=(dense > 0) + (moe > 0), n_dense_layers=int(dense > 0))
    return dataclasses.replace(arch, **{name: 1}, **({"n_kv_heads": 1} if name == "n_heads" else {}))


def _memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
