"""Qwen3-MoE's routed experts computed in the dtype their weights arrive in.

TorchTitan 0.3.0's `GroupedExperts.forward` casts tokens and weights to bfloat16 before its three
grouped matmuls, whatever the training dtype. Under FSDP's default mixed precision the weights
arrive in bfloat16 anyway, so `ParamDtypeGroupedExperts` computes exactly what TorchTitan does;
with float32 parameters (`mixed_precision_param = "float32"`, CPU runs, the transformers oracle)
it computes in float32, where the cast would lose 3 digits against the rest of the model and where
CPU's grouped matmul has no bfloat16 backward (torch 2.13). Weights, names, sharding and the
token dispatcher stay TorchTitan's.

torch.compile traces `torch._grouped_mm` for bfloat16 only (its fake kernel refuses other dtypes,
torch 2.13), so a grouped matmul in any other dtype runs as the op `flashcp::expert_grouped_mm`,
which calls the same aten op and which the compiler keeps whole, as it keeps FlashCP's attention:
a compiled float32 block compiles everything but the experts' three matmuls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torchtitan.models.common.moe import GroupedExperts


@torch.library.custom_op("flashcp::expert_grouped_mm", mutates_args=())
def _expert_grouped_mm(a: torch.Tensor, b_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(a, b_t, offs=offs)


@_expert_grouped_mm.register_fake
def _(a, b_t, offs):
    return a.new_empty(a.shape[0], b_t.shape[-1])


@torch.library.custom_op("flashcp::expert_grouped_mm_backward", mutates_args=())
def _expert_grouped_mm_backward(
    grad: torch.Tensor, a: torch.Tensor, b_t: torch.Tensor, offs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    # aten's own backward of the product (torch.func runs autograd inside the op).
    _, vjp = torch.func.vjp(lambda a, b_t: torch._grouped_mm(a, b_t, offs=offs), a, b_t)
    return tuple(g.contiguous() for g in vjp(grad.contiguous()))


@_expert_grouped_mm_backward.register_fake
def _(grad, a, b_t, offs):
    return a.new_empty(a.shape), b_t.new_empty(b_t.shape)


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad):
    grad_a, grad_b_t = torch.ops.flashcp.expert_grouped_mm_backward(grad, *ctx.saved_tensors)
    return grad_a, grad_b_t, None


_expert_grouped_mm.register_autograd(_backward, setup_context=_setup_context)


class ParamDtypeGroupedExperts(GroupedExperts):
    """TorchTitan's grouped SwiGLU experts, in the weights' dtype instead of always bfloat16."""

    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        pass

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        # Under EP / FSDP the weights are DTensors; the grouped matmul takes their local experts.
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
        offsets_E = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
        x = x_RD.to(w1.dtype)
        h_RF = F.silu(self._grouped_mm(A=x, B_t=w1.transpose(-2, -1), offs=offsets_E))
        h_RF = h_RF * self._grouped_mm(A=x, B_t=w3.transpose(-2, -1), offs=offsets_E)
        return self._grouped_mm(A=h_RF, B_t=w2.transpose(-2, -1), offs=offsets_E).type_as(x_RD)

    def _grouped_mm(self, *, A: torch.Tensor, B_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        if A.dtype == torch.bfloat16:
            return super()._grouped_mm(A=A, B_t=B_t, offs=offs)
        return _expert_grouped_mm(A, B_t, offs)


def use_param_dtype_experts(layers: list) -> None:
    """Make the experts of every MoE layer config in `layers` `ParamDtypeGroupedExperts`, in place."""
    for layer in layers:
        moe = getattr(layer, "moe", None)
        if moe is not None and type(moe.routed_experts.inner_experts) is GroupedExperts.Config:
            inner = moe.routed_experts.inner_experts
            moe.routed_experts.inner_experts = ParamDtypeGroupedExperts.Config(
                dim=inner.dim, hidden_dim=inner.hidden_dim, num_experts=inner.num_experts,
                param_init=inner.param_init, sharding_config=inner.sharding_config,
            )  # fmt: skip
