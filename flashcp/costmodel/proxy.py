"""The balancer's cost of a window in seconds, from the model's real FLOPs at measured efficiencies.

Balancing compares windows by predicted time, so dense work and attention must be priced at what
each achieves, not both as FLOPs: the dense GEMMs at TorchTitan's published MFU for Llama 3.1 8B
on H100 (33 %, eager, FSDP on 8 GPUs: docs/performance.md of TorchTitan, Table 1's 5,762
tokens/s per GPU at 8K against the SXM peak; `DENSE_MFU` is the one place this number lives),
attention at what the step model's kernel model (fitted to the H100 FlashAttention profile) gives
a long causal document forward + backward (~326 TFLOP/s). The embedding lookup is no GEMM and is
left out. With full activation checkpointing the forward runs twice: dense 8 instead of 6 FLOPs
per parameter and token, attention 18 instead of 14 FLOPs per head dimension and pair (backward =
2.5 x forward).
`flashcp.costmodel.step` uses the same constants (and validates them: benchmarks/step_model.py validate).
"""

from __future__ import annotations

from flashcp.data.balance import WindowCost

H100_BF16_TFLOPS = 989.0  # dense bf16 peak of an H100 SXM (datasheet)
DENSE_MFU = 0.33  # TorchTitan, Llama 3.1 8B, 8 x H100, FSDP, no torch.compile (published)
ATTENTION_TFLOPS = 326.0  # the kernel model: one 32K causal document, 32 heads of 128, fwd + bwd


def window_cost(dense_flops_per_token: float, attention_flops_per_pair: float, cp: int,
                full_ac: bool = False) -> WindowCost:  # fmt: skip
    """Seconds per token and per attended pair on one of `cp` ranks. `dense_flops_per_token`:
    6 x the non-embedding parameters; `attention_flops_per_pair`: 12 x heads x head_dim x layers
    (forward and backward matmuls, as TorchTitan's MFU counts them)."""
    dense = dense_flops_per_token * (8 / 6 if full_ac else 1.0)
    attention = attention_flops_per_pair * ((18 if full_ac else 14) / 12)
    return WindowCost(dense / (DENSE_MFU * H100_BF16_TFLOPS * 1e12), attention / (ATTENTION_TFLOPS * 1e12), cp)
