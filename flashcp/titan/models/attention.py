"""FlashCP as TorchTitan's inner attention, swapped into a stock model from outside.

TorchTitan's `GQAttention` projects q/k/v, applies RoPE and hands `(q, k, v, attention_masks=...)`
to its `inner_attention` module; the decoder passes the same `attention_masks` object to every
layer. FlashCP uses that channel: the trainer puts one `CPStep` (this rank's dispatch for the
current window, the CP process group and the communication mode) in `attention_masks`, and
`FlashCPAttention` runs `cp_varlen_attention` on it. The model file stays TorchTitan's; only the
inner-attention and RoPE configs of each layer are replaced (`use_flashcp_attention`): the RoPE
module keeps no table and the inner attention rotates q and k with the step's rows, computed once
per step for this rank's tokens (`flashcp.titan.models.rotary`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torchtitan.models.common.rope import RoPE
from torchtitan.protocols.module import Module

from flashcp.attention.cp import cp_varlen_attention
from flashcp.dispatch import Dispatch
from flashcp.titan.models.rotary import rotate, rotation, rotation_key, tableless


@dataclass(frozen=True)
class CPStep:
    """What every attention layer needs for one window: set once per step by the trainer."""

    dispatch: Dispatch  # this CP rank's dispatch, already on the compute device
    group: dist.ProcessGroup | None  # the CP group; None when cp_size == 1
    rotations: dict[tuple, torch.Tensor] = field(default_factory=dict, repr=False, compare=False)

    def rotation(self, rope: RoPE.Config) -> torch.Tensor:
        """RoPE rows at this rank's in-document positions: computed by the first layer, shared by all
        (autograd saves one tensor per step; a checkpoint's recompute reuses it)."""
        key = rotation_key(rope)
        if key not in self.rotations:
            self.rotations[key] = rotation(rope, self.dispatch.positions)
        return self.rotations[key]


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

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.backend = config.backend
        self.overlap = config.overlap
        self.scale_factor = config.scale_factor
        self.rope = config.rope

    def forward(
        self,
        q_BLNH: torch.Tensor,
        k_BLNH: torch.Tensor,
        v_BLNH: torch.Tensor,
        *,
        attention_masks: CPStep,
        scale: float | None = None,
        **kwargs,
    ) -> torch.Tensor:
        if not isinstance(attention_masks, CPStep):
            raise TypeError(
                "FlashCPAttention needs the trainer's CPStep as attention_masks, got "
                f"{type(attention_masks).__name__}: train this model with FlashCPTrainer"
            )
        if q_BLNH.shape[0] != 1:
            raise ValueError(f"FlashCP attention takes one window per step (batch 1), got {q_BLNH.shape[0]}")
        if self.rope is not None:
            rows = _rotation(attention_masks, self.rope)
            q_BLNH, k_BLNH = rotate(self.rope, q_BLNH, k_BLNH, rows)
        if self.scale_factor != 1.0:
            scale = (q_BLNH.shape[-1] ** -0.5 if scale is None else scale) * self.scale_factor
        out = _attention(q_BLNH[0], k_BLNH[0], v_BLNH[0], attention_masks, self.backend, scale, self.overlap)
        return out.unsqueeze(0)


@torch.compiler.disable  # a per-step cache: no guards on it in a compiled block
def _rotation(step: CPStep, rope: RoPE.Config) -> torch.Tensor:
    return step.rotation(rope)


# Outside compiled graphs (compile.enable compiles each block): the op's sizes, index tensors and
# collectives change with every window's plan, so tracing it would recompile at every step.
@torch.compiler.disable
def _attention(q, k, v, step: CPStep, backend: str, scale: float | None, overlap: bool) -> torch.Tensor:
    return cp_varlen_attention(
        q, k, v, step.dispatch, step.group, comm=step.dispatch.comm, backend=backend,
        softmax_scale=scale, overlap=overlap,
    )  # fmt: skip


def use_flashcp_attention(
    model_config, backend: str = "auto", overlap: bool = False, scale_factor: float = 1.0
) -> None:
    """Replace the inner attention and RoPE of every layer of a TorchTitan decoder config, in place.

    Works for every TorchTitan `GQAttention` (Llama 3, Qwen3): q / k / v reach the inner attention
    after QK-norm as `[B, L, heads, head_dim]`, K/V with their own (fewer) heads under GQA, and the
    softmax scale of a head_dim other than dim / n_heads comes as `scale`. The layer's RoPE module
    (between QK-norm and the inner attention) becomes table-less; the inner attention rotates."""
    for layer in model_config.layers:
        attention = getattr(layer, "attention", None)
        if attention is not None:
            attention.rope = tableless(attention.rope)
            attention.inner_attention = FlashCPAttention.Config(
                backend=backend, overlap=overlap, scale_factor=scale_factor, rope=attention.rope
            )
