"""DeepSeek-V3's multi-head latent attention (MLA) through FlashCP's latent exchange, swapped in from outside.

TorchTitan's MLA (`torchtitan.models.deepseek_v3.model.Attention`) up-projects K and V per head
before its inner attention, so swapping only the inner attention (as `flashcp.titan.models.attention`
does for Llama 3 / Qwen3) would make the CP exchange carry `heads x (qk + v)` values per token.
`FlashCPLatentAttention` is TorchTitan's module with its forward replaced: the same parameters
(names, shapes, initialisation: checkpoints and HF adapters are TorchTitan's), q and the latent row
projected as there, q_pe and k_pe rotated with the step's RoPE rows (table-less, once per step as
for the dense models), and `flashcp.attention.latent.cp_latent_attention` given q, `kv_norm(c_kv)`,
k_pe and `wkv_b`, so that ranks exchange the 576-wide latent rows and up-project locally. It runs
as the registered op `flashcp::cp_latent_attention` (`flashcp.attention.op.latent_attention`, keyed
by the step like the dense op), so a compiled block is one graph. The
softmax scale is TorchTitan's: 1 / sqrt(qk_nope + qk_rope), times YaRN's mscale correction squared.

Tensor parallelism: TorchTitan's plan splits q's and wkv_b's rows by head; each TP rank runs the
op on its heads with the whole latent and k_pe rows (head-independent, replicated over TP), which
it exchanges once in its own CP group; their gradients are partial over TP, summed by DTensor.

`[flashcp] overlap`: the shards whose keys are all local run while the latent rows are in flight.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate
from torchtitan.models.deepseek_v3.model import Attention

from flashcp.attention.op import latent_attention
from flashcp.titan.models.attention import step_rows
from flashcp.titan.models.rotary import rotate, rotation_key, tableless


class FlashCPLatentAttention(Attention):
    """TorchTitan's MLA whose keys and values cross the CP group as latent rows."""

    @dataclass(kw_only=True, slots=True)
    class Config(Attention.Config):
        backend: str = "auto"
        """Varlen kernel: auto | flash_attn | torch | reference (see flashcp.attention.kernels)."""
        overlap: bool = False
        """Compute shards whose keys are all local while the latent exchange is in flight."""

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.backend = config.backend
        self.overlap = config.overlap
        self.rotation_config = config.rope
        self.rotation_key = rotation_key(config.rope)

    def forward(self, x: torch.Tensor, attention_masks, positions: torch.Tensor | None = None) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        step, rows = step_rows(attention_masks, self.rotation_key, bsz)
        q = self.wq(x) if self.q_lora_rank == 0 else self.wq_b(self.q_norm(self.wq_a(x)))
        latent, k_pe = self.wkv_a(x).split([self.kv_lora_rank, self.qk_rope_head_dim], -1)
        latent = self.kv_norm(latent)
        # TP (TorchTitan's plan: wq / wq_b and wkv_b colwise, wkv_a and kv_norm replicated): this
        # rank's heads of q and of wkv_b, and the whole (head-independent) latent and k_pe rows.
        q, out_layout = _local(q)
        latent, k_pe, wkv_b = _local(latent)[0], _local(k_pe)[0], _local(self.wkv_b.weight)[0]
        q_nope, q_pe = q.view(bsz, seqlen, -1, self.qk_head_dim).split([self.qk_nope_head_dim, self.qk_rope_head_dim], -1)
        q_pe, k_pe = rotate(self.rotation_config, q_pe, k_pe.unsqueeze(2), rows)
        out = latent_attention(
            torch.cat([q_nope, q_pe], -1)[0], latent[0], k_pe[0, :, 0], wkv_b, step.key, self.backend,
            overlap=self.overlap, softmax_scale=self.softmax_scale,
        ).reshape(bsz, seqlen, -1)  # fmt: skip
        if out_layout is not None:  # this rank's heads' values, sharded as q: wo is rowwise
            out = DTensor.from_local(out, *out_layout, run_check=False)
        return self.wo(out)


def _local(t: torch.Tensor) -> tuple[torch.Tensor, tuple | None]:
    """A TP DTensor's local part and its (mesh, placements); a tensor as is. A replicated input's
    local gradient is partial (each TP rank's heads add theirs), summed on the way back."""
    if not isinstance(t, DTensor):
        return t, None
    grads = tuple(Partial() if isinstance(p, Replicate) else p for p in t.placements)
    return t.to_local(grad_placements=grads), (t.device_mesh, t.placements)


def use_flashcp_latent_attention(model_config, backend: str = "auto", overlap: bool = False) -> None:
    """Make every MLA layer of a TorchTitan DeepSeek-V3 config `FlashCPLatentAttention`, its RoPE table-less."""
    for layer in model_config.layers:
        attention = layer.attention
        fields = {f.name: getattr(attention, f.name) for f in dataclasses.fields(attention)}
        fields["rope"] = tableless(attention.rope)
        layer.attention = FlashCPLatentAttention.Config(**fields, backend=backend, overlap=overlap)
