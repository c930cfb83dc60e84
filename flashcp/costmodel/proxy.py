"""The balancer's cost of a window in seconds, from the model's real FLOPs at measured efficiencies.

Balancing compares windows by predicted time, so dense work and attention must be priced at what
each achieves, not both as FLOPs: the dense GEMMs at TorchTitan's published MFU for Llama 3.1 8B
on H100 (33 %, eager, FSDP on 8 GPUs: docs/performance.md of TorchTitan, Table 1's 5,762
tokens/s per GPU at 8K against the SXM peak), attention at what the step model's kernel model
(fitted to the H100 FlashAttention profile) gives a long causal document forward + backward
(`ATTENTION_TFLOPS`, read off `kernel_tflops`). The embedding lookup is no GEMM and is left out.
With full activation checkpointing the forward runs twice: dense 8 instead of 6 FLOPs per
parameter and token, attention one more forward (the kernel model's backward is
`DEFAULT_BWD_RATIO` = 2.5 x its forward: 14 FLOPs per head dimension and pair, 18 with AC).

This module is the one source of these numbers: `flashcp.costmodel.step` prices dense work with
`DENSE_MFU`, `H100_BF16_TFLOPS` and `FULL_AC_DENSE`, and attention with the kernel model that
`ATTENTION_TFLOPS` summarises (tests/test_step_model.py holds the two to agreeing;
benchmarks/step_model.py validate compares them with published measurements).
"""

from __future__ import annotations

from flashcp.costmodel.kernel import DEFAULT_BWD_RATIO, KernelModel
from flashcp.data.balance import WindowCost
from flashcp.plan.plan import CAUSAL, Workload

H100_BF16_TFLOPS = 989.0  # dense bf16 peak of an H100 SXM (datasheet)
DENSE_MFU = 0.33  # TorchTitan, Llama 3.1 8B, 8 x H100, FSDP, no torch.compile (published)
FULL_AC_DENSE = 8 / 6  # full activation checkpointing: the forward's 2 FLOPs per parameter again
ATTENTION_TFLOPS = 326.0  # kernel_tflops of the shared H100 profile's fit (326.5)
CALIBRATION_CALL = (32768, 32, 128)  # ... on one causal document of this many tokens, heads, head_dim


def attention_factor(full_ac: bool) -> float:
    """FLOPs of attention per pair relative to TorchTitan's count (12 per head dimension: a 4 FLOP
    forward and twice that backward): the kernel's backward ratio, and a second forward with AC."""
    return (1 + DEFAULT_BWD_RATIO + (1 if full_ac else 0)) / 3


def kernel_tflops(kernel: KernelModel, tokens: int, heads: int, head_dim: int) -> float:
    """TFLOP/s of the kernel model's forward + backward on one causal document (FLOPs as
    `attention_factor` counts them)."""
    fwd_bwd_ms = kernel.forward_ms([tokens], [tokens], heads, head_dim=head_dim) + kernel.backward_ms(
        [tokens], [tokens], heads, head_dim=head_dim)  # fmt: skip
    flops = 12.0 * heads * head_dim * tokens * (tokens + 1) / 2 * attention_factor(False)
    return flops / (fwd_bwd_ms * 1e-3) / 1e12


def window_cost(dense_flops_per_token: float, attention_flops_per_pair: float, cp: int,
                full_ac: bool = False, workload: Workload = CAUSAL) -> WindowCost:  # fmt: skip
    """Seconds per token and per attended pair on one of `cp` ranks. `dense_flops_per_token`:
    6 x the non-embedding parameters; `attention_flops_per_pair`: 12 x heads x head_dim x layers
    (forward and backward matmuls, as TorchTitan's MFU counts them).

    With sliding-window layers (`workload`, the model's layer counts) only the full layers' share is
    priced per causal pair; a window layer's query sees min(p + 1, W) keys, W past its document's
    first W tokens, so its share is priced as W pairs per token: above the exact count by
    W (W - 1) / 2 pairs per document at most (`WindowCost` holds tokens and causal pairs only)."""
    if not workload.full_layers:  # the balancer divides by the price of a causal pair
        raise ValueError("the balance weighs causal pairs, which a model of sliding-window layers only never "
                         "attends: set [data] balance = 'off' (its windows cost the same per token)")
    layers = workload.full_layers + workload.window_layers
    windowed = attention_flops_per_pair * workload.window_layers / layers * (workload.window or 0)
    dense = dense_flops_per_token * (FULL_AC_DENSE if full_ac else 1.0)
    attention = attention_flops_per_pair * workload.full_layers / layers * attention_factor(full_ac)
    per_token = dense / (DENSE_MFU * H100_BF16_TFLOPS * 1e12) + windowed * attention_factor(full_ac) / (
        ATTENTION_TFLOPS * 1e12)  # fmt: skip
    return WindowCost(per_token, attention / (ATTENTION_TFLOPS * 1e12), cp)
