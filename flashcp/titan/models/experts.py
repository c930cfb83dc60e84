"""Qwen3-MoE's, DeepSeek-V3's and gpt-oss's routed experts computed in the dtype their weights arrive in.

TorchTitan 0.3.0's `GroupedExperts.forward` (and gpt-oss's `GptOssGroupedExperts.forward`) casts
tokens and weights to bfloat16 before its grouped matmuls, whatever the training dtype. Under
FSDP's default mixed precision the weights arrive in bfloat16 anyway, so `ParamDtypeGroupedExperts` computes exactly what TorchTitan does;
with float32 parameters (`mixed_precision_param = "float32"`, CPU runs, the transformers oracle)
it computes in float32, where the cast would lose 3 digits against the rest of the model and where
CPU's grouped matmul has no bfloat16 backward (torch 2.13). Weights, names, sharding and the
token dispatcher stay TorchTitan's (gpt-oss's: its biases, clamped SwiGLU and TP bias scaling too).

torch.compile traces `torch._grouped_mm` for bfloat16 only (its fake kernel refuses other dtypes,
torch 2.13), so a grouped matmul in any other dtype runs as the op `flashcp::expert_grouped_mm`,
which calls the same aten op and which the compiler keeps whole, as it keeps FlashCP's attention:
a compiled float32 block compiles everything but the experts' three matmuls. torch's grouped
matmul has no float64 kernel: there (the float64 transformers oracle) the op runs one matmul per expert.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torchtitan.models.common.moe import GroupedExperts
from torchtitan.models.gpt_oss.moe import GptOssGroupedExperts, ScaleBiasForward, swiglu


def _grouped_mm(a: torch.Tensor, b_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """aten's grouped matmul; in float64, which it has no kernel for, one matmul per expert."""
    if a.dtype != torch.float64:
        return torch._grouped_mm(a, b_t, offs=offs)
    ends = offs.tolist()
    return torch.cat([a[start:end] @ b for start, end, b in zip([0, *ends[:-1]], ends, b_t)]
                     + [a.new_zeros(a.shape[0] - ends[-1], b_t.shape[-1])])  # fmt: skip


@torch.library.custom_op("flashcp::expert_grouped_mm", mutates_args=())
def _expert_grouped_mm(a: torch.Tensor, b_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return _grouped_mm(a, b_t, offs)


@_expert_grouped_mm.register_fake
def _(a, b_t, offs):
    return a.new_empty(a.shape[0], b_t.shape[-1])


@torch.library.custom_op("flashcp::expert_grouped_mm_backward", mutates_args=())
def _expert_grouped_mm_backward(
    grad: torch.Tensor, a: torch.Tensor, b_t: torch.Tensor, offs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    # aten's own backward of the product (torch.func runs autograd inside the op).
    _, vjp = torch.func.vjp(lambda a, b_t: _grouped_mm(a, b_t, offs), a, b_t)
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


class _ParamDtypeMatmul:
    """The grouped matmul of an experts module in its inputs' dtype: TorchTitan's seam for bfloat16
    (low-precision converters replace it), FlashCP's op for any other dtype (see the docstring)."""

    def _grouped_mm(self, *, A: torch.Tensor, B_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        if A.dtype == torch.bfloat16:
            return super()._grouped_mm(A=A, B_t=B_t, offs=offs)
        return _expert_grouped_mm(A, B_t, offs)


def _local(*params: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Under EP / FSDP the weights are DTensors; the grouped matmul takes their local experts."""
    return tuple(p.to_local() if isinstance(p, DTensor) else p for p in params)


class ParamDtypeGroupedExperts(_ParamDtypeMatmul, GroupedExperts):
    """TorchTitan's grouped SwiGLU experts, in the weights' dtype instead of always bfloat16."""

    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        pass

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = _local(self.w1_EFD, self.w2_EDF, self.w3_EFD)
        offsets_E = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
        x = x_RD.to(w1.dtype)
        h_RF = F.silu(self._grouped_mm(A=x, B_t=w1.transpose(-2, -1), offs=offsets_E))
        h_RF = h_RF * self._grouped_mm(A=x, B_t=w3.transpose(-2, -1), offs=offsets_E)
        return self._grouped_mm(A=h_RF, B_t=w2.transpose(-2, -1), offs=offsets_E).type_as(x_RD)


class ParamDtypeGptOssExperts(_ParamDtypeMatmul, GptOssGroupedExperts):
    """gpt-oss's grouped experts (a bias after each projection, the clamped SwiGLU), in the weights' dtype."""

    @dataclass(kw_only=True, slots=True)
    class Config(GptOssGroupedExperts.Config):
        pass

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        w1, b1, w2, b2 = _local(self.mlp1_weight_EGD, self.mlp1_bias_EG, self.mlp2_weight_EDF, self.mlp2_bias_ED)
        offsets_E = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
        # Each row's expert; rows past the last expert's (EP's padding) take a zero bias.
        slack = (x_RD.shape[0] - offsets_E[-1]).unsqueeze(0).to(num_tokens_per_expert_E.dtype)
        counts = torch.cat([num_tokens_per_expert_E, slack]).long()

        def per_row(bias: torch.Tensor) -> torch.Tensor:
            padded = torch.cat([bias, bias.new_zeros(1, bias.shape[-1])])
            return padded.repeat_interleave(counts, dim=0, output_size=x_RD.shape[0])

        x = x_RD.to(w1.dtype)
        h_RG = self._grouped_mm(A=x, B_t=w1.transpose(-2, -1), offs=offsets_E) + per_row(b1)
        h_RF = swiglu(h_RG, limit=self.swiglu_limit)
        h_RD = self._grouped_mm(A=h_RF, B_t=w2.transpose(-2, -1), offs=offsets_E)
        # TP shards the second projection's input (its output is summed over TP): as TorchTitan, the
        # replicated bias enters each share divided by the TP degree.
        return (h_RD + ScaleBiasForward.apply(per_row(b2), _tp_degree(self.mlp1_weight_EGD), h_RD.dtype)).type_as(x_RD)


def _tp_degree(param: torch.Tensor) -> int:
    """The TP ranks `param` is split over (1 without TP)."""
    if not isinstance(param, DTensor):
        return 1
    names = param.device_mesh.mesh_dim_names or ()
    return param.device_mesh.size(names.index("tp")) if "tp" in names else 1


_IN_PARAM_DTYPE = {GroupedExperts.Config: ParamDtypeGroupedExperts.Config,
                   GptOssGroupedExperts.Config: ParamDtypeGptOssExperts.Config}  # fmt: skip


def use_param_dtype_experts(layers: list) -> None:
    """Make the experts of every MoE layer config in `layers` compute in their weights' dtype
    (`ParamDtypeGroupedExperts`, `ParamDtypeGptOssExperts`), in place, every setting kept."""
    for layer in layers:
        moe = getattr(layer, "moe", None)
        cls = moe and _IN_PARAM_DTYPE.get(type(moe.routed_experts.inner_experts))
        if cls is not None:
            inner = moe.routed_experts.inner_experts
            moe.routed_experts.inner_experts = cls(**{f.name: getattr(inner, f.name) for f in dataclasses.fields(inner)})
