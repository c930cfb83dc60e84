"""FlashCP as TorchTitan's inner attention, swapped into a stock model from outside.

TorchTitan's `GQAttention` projects q/k/v, applies RoPE and hands `(q, k, v, attention_masks=...)`
to its `inner_attention` module; the decoder passes the same `attention_masks` object to every
layer. FlashCP uses that channel: the trainer puts one `CPStep` (this rank's dispatch for the
current window, the CP process group and the communication mode) in `attention_masks`, and
`FlashCPAttention` runs FlashCP's attention op on it. The model file stays TorchTitan's; only the
inner-attention and RoPE configs of each layer are replaced (`use_flashcp_attention`): the RoPE
module keeps no table and the inner attention rotates q and k with the step's rows, computed once
per step for this rank's tokens (`flashcp.titan.models.rotary`).

gpt-oss: a sliding-window layer (TorchTitan's `sliding_window_size`) runs on the step's dispatch
for its window, built from the same plan beside the full one (`LayerDispatches`: the same rows, a
smaller exchange); its learned sinks arrive as TorchTitan's `out_transform`, a method of the
attention module that owns them, and go into the op, which applies them exactly (their correction
of the output and their gradient; `flashcp.attention.sinks`). The transform itself is never applied
to the op's output: the sinks would count twice.

Compiled blocks (`[compile] enable`) are one graph each: the attention is the registered op
`flashcp::cp_attention` (`flashcp.attention.op`), which the compiler sees as one node taking q, k,
v and the step's key tensor, and the RoPE rows come in the `CPStep` as tensors computed by the
trainer before the forward (`CPStep.of`). What the compiler reads of a `CPStep` is the key and the
rows, tensors of fixed shapes (tokens per rank are seq_len / cp in every window) and the rotation dict's keys,
the same at every step, so a new window neither breaks the graph nor recompiles it.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torchtitan.models.common.rope import RoPE
from torchtitan.protocols.module import Module

from flashcp.attention.op import cp_attention, launch_exchange_ahead, step_key
from flashcp.dispatch import Dispatch
from flashcp.titan.models.rotary import rotate, rotation, rotation_key, tableless
from flashcp.titan.models.windows import LayerDispatches


@dataclass(frozen=True)
class CPStep:
    """What every attention layer needs for one window: built once per step by the trainer."""

    dispatch: Dispatch  # this CP rank's dispatch, already on the compute device
    group: dist.ProcessGroup | None  # the CP group; None when cp_size == 1
    rotations: dict[tuple, torch.Tensor] = field(default_factory=dict, repr=False, compare=False)
    """RoPE rows at this rank's in-document positions, by `rotation_key`: one tensor per distinct
    RoPE, shared by all layers (autograd saves one per step; a checkpoint's recompute reuses it)."""
    windows: dict[int, Dispatch] = field(default_factory=dict, repr=False, compare=False)
    """The sliding-window layers' dispatches, by window (empty for a model without such layers)."""
    key: torch.Tensor = field(init=False, repr=False, compare=False)
    """Names (dispatch, group) to the attention op; the step stays registered while this lives."""
    window_keys: dict[int, torch.Tensor] = field(init=False, repr=False, compare=False)
    """The key of each window's dispatch, as `key`."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", step_key(self.dispatch, self.group))
        object.__setattr__(self, "window_keys", {w: step_key(d, self.group) for w, d in self.windows.items()})

    @classmethod
    def of(cls, ropes: dict[tuple, RoPE.Config], dispatch: Dispatch | LayerDispatches,
           group: dist.ProcessGroup | None) -> CPStep:  # fmt: skip
        """The step with the rows of every RoPE in `ropes` (`flashcp_ropes(model)`), computed here,
        outside the model (and any compiled block), once per step; `LayerDispatches` also give the
        sliding-window layers theirs."""
        full, windows = (dispatch.full, dispatch.windows) if isinstance(dispatch, LayerDispatches) else (dispatch, {})
        rotations = {key: rotation(rope, full.positions) for key, rope in ropes.items()}
        return cls(full, group, rotations, windows)

    def key_for(self, window: int | None) -> torch.Tensor:
        """The op's key for a layer with this sliding window (None: full attention)."""
        if window is None:
            return self.key
        if window not in self.window_keys:
            raise ValueError(f"the CPStep has no dispatch for a sliding window of {window} keys: build it from "
                             "LayerDispatches with that window (the trainer does, for flashcp_windows(model))")  # fmt: skip
        return self.window_keys[window]


def flashcp_ropes(model: torch.nn.Module) -> dict[tuple, RoPE.Config]:
    """The distinct RoPEs the FlashCP attention layers of `model` apply, by `rotation_key` (every module
    with a `rotation_key` and its `rotation_config`: this file's and MLA's, flashcp.titan.models.latent)."""
    return {m.rotation_key: m.rotation_config for m in model.modules() if getattr(m, "rotation_key", None) is not None}


def flashcp_windows(model: torch.nn.Module) -> tuple[int, ...]:
    """The sliding windows of the FlashCP attention layers of `model`, ascending (empty: all full)."""
    return tuple(sorted({m.window for m in model.modules() if isinstance(m, FlashCPAttention) and m.window}))


def step_rows(attention_masks, key: tuple | None, batch: int) -> tuple[CPStep, torch.Tensor | None]:
    """The trainer's CPStep passed as `attention_masks` and its RoPE rows for `key` (None: no rows);
    TypeError / ValueError naming what the caller got wrong."""
    if not isinstance(attention_masks, CPStep):
        raise TypeError(
            "FlashCP's attention needs the trainer's CPStep as attention_masks, got "
            f"{type(attention_masks).__name__}: train this model with FlashCPTrainer"
        )
    if batch != 1:
        raise ValueError(f"FlashCP attention takes one window per step (batch 1), got {batch}")
    if key is None:
        return attention_masks, None
    rows = attention_masks.rotations.get(key)
    if rows is None:
        raise ValueError("the CPStep has no RoPE rows for this layer: build it with "
                         "CPStep.of(flashcp_ropes(model), dispatch, group)")  # fmt: skip
    return attention_masks, rows


class FlashCPAttention(Module):
    """Document-masked causal attention over the CP window through FlashCP's KV exchange.

    q/k/v arrive as `[1, T, heads, head_dim]` holding this rank's T tokens in the dispatch's
    local order (under tensor parallelism: this rank's heads). One window per step, so B == 1.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        backend: str = "auto"
        """Varlen kernel: auto | flash_attn | torch | reference (see flashcp.attention.kernels)."""

        overlap: bool = False
        """Compute shards whose keys are all local while the KV exchange is in flight."""

        scale_factor: float = 1.0
        """Multiplies the softmax scale (1 / sqrt(head_dim) unless the model passes its own): YaRN's
        attention factor squared, which HF applies to cos and sin (flashcp.titan.models.rope)."""

        rope: RoPE.Config | None = None
        """The layer's RoPE, applied here with the step's rows; None: q and k arrive rotated."""

        window: int | None = None
        """The layer's sliding window: each query sees its last W keys, itself included (HF
        sliding_window); None: full attention."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.backend = config.backend
        self.overlap = config.overlap
        self.scale_factor = config.scale_factor
        self.window = config.window
        self.rope = self.rotation_config = config.rope
        self.rotation_key = None if config.rope is None else rotation_key(config.rope)

    def forward(
        self,
        q_BLNH: torch.Tensor,
        k_BLNH: torch.Tensor,
        v_BLNH: torch.Tensor,
        *,
        attention_masks: CPStep,
        scale: float | None = None,
        out_transform: Callable | None = None,
        exchange: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """`exchange`: this call's KV exchange, launched ahead by `launch_exchange` on k and v of these values."""
        _, rows = step_rows(attention_masks, self.rotation_key, q_BLNH.shape[0])
        if rows is not None:
            q_BLNH, k_BLNH = rotate(self.rope, q_BLNH, k_BLNH, rows)
        if self.scale_factor != 1.0:
            scale = (q_BLNH.shape[-1] ** -0.5 if scale is None else scale) * self.scale_factor
        out = cp_attention(q_BLNH[0], k_BLNH[0], v_BLNH[0], attention_masks.key_for(self.window), self.backend,
                           overlap=self.overlap, softmax_scale=scale,
                           sinks=None if out_transform is None else sinks_of(out_transform),
                           exchange=exchange)  # fmt: skip
        return out.unsqueeze(0)

    def launch_exchange(self, k_BLNH: torch.Tensor, v_BLNH: torch.Tensor, attention_masks: CPStep) -> torch.Tensor:
        """Start, without waiting, the KV exchange that `forward` on k and v of these values would run (k
        rotated as there), and return its handle for forward's `exchange=` (eager code only)."""
        _, rows = step_rows(attention_masks, self.rotation_key, k_BLNH.shape[0])
        if rows is not None:
            _, k_BLNH = rotate(self.rope, k_BLNH, k_BLNH, rows)
        return launch_exchange_ahead(k_BLNH[0], v_BLNH[0], attention_masks.key_for(self.window))


def sinks_of(out_transform: Callable) -> torch.Tensor:
    """The learned sinks (one logit per local head) of the attention module whose `out_transform` this
    is (gpt-oss's `_apply_sinks`): the op applies them (see the module docstring). Under TP they are
    split by head as q is (TorchTitan's layout); the local shard, its gradient kept sharded.
    The owner is found by type, not `getattr(out_transform, "__self__", None)`: compiling a block
    under FSDP, dynamo (torch 2.13) answers that getattr with the default (it asks the unbound
    function for `__self__`), and the block would fail here."""
    owner = out_transform.__self__ if isinstance(out_transform, types.MethodType) else None
    sinks = getattr(owner, "sinks", None)
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"FlashCP's attention takes an out_transform only as learned sinks (a method of a module "
                        f"with a `sinks` parameter, gpt-oss's), got {out_transform!r}")  # fmt: skip
    return sinks.to_local(grad_placements=sinks.placements) if isinstance(sinks, DTensor) else sinks


def use_flashcp_attention(
    model_config, backend: str = "auto", overlap: bool = False, scale_factor: float = 1.0
) -> None:
    """Replace the inner attention and RoPE of every layer of a TorchTitan decoder config, in place.

    Works for every TorchTitan `GQAttention` (Llama 3, Qwen3) and gpt-oss's `Attention`: q / k / v
    reach the inner attention after QK-norm as `[B, L, heads, head_dim]`, K/V with their own (fewer)
    heads under GQA, and the softmax scale of a head_dim other than dim / n_heads comes as `scale`.
    The layer's RoPE module (between QK-norm and the inner attention) becomes table-less; the inner
    attention rotates. A layer's `sliding_window_size` (gpt-oss) becomes its window."""
    for layer in model_config.layers:
        attention = getattr(layer, "attention", None)
        if attention is not None:
            attention.rope = tableless(attention.rope)
            attention.inner_attention = FlashCPAttention.Config(
                backend=backend, overlap=overlap, scale_factor=scale_factor, rope=attention.rope,
                window=getattr(attention, "sliding_window_size", None),
            )
