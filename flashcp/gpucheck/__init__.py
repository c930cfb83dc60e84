"""One command that verifies and measures FlashCP on whatever GPU is at hand.

    python -m flashcp.gpucheck --out DIR [--device cuda|cpu] [--quick]

Needs torch (>= 2.11) and numpy only: no torchtitan, no pytest, no network, so it runs on a bare
GPU machine. It prints its progress, writes every row the moment it is measured (a run cut off
still leaves its results) and ends within about 9 minutes on one H100. Sections:

1. `exactness`: every attention backend that runs here, forward and backward, fp16 and bf16,
   GQA ratios 1/4/8, against the reference kernel in float32 (bottom-right causal shards with
   more keys than queries, 1-token documents, random shard mixes), with the tolerance and worst
   error of each case; and whether passing KV heads through natively (GQA) is exact.
2. `cp`: the CP op end to end, N in {2, 4, 8} ranks simulated in one process
   (`flashcp.attention.simulate`), every strategy and comm mode (the ring too), forward and backward against
   single-device attention.
3. `window_sinks`: sliding windows with learned sinks (gpt-oss) on every backend that takes sinks,
   forward and backward (dq, dk, dv, dsinks), float32 and bfloat16, against dense float64 attention
   with a sink column and against FlexAttention (document + window mask_mod, the sink on its LSE).
4. `critical_path`: the slowest rank's forward and forward+backward kernel time per window at the
   paper's setting (C = 128K, N in {4, 8}, 16 / 32 heads of dim 128, bf16, wlbllm and pile); for
   the ring systems the sum over ring steps of the slowest rank's call and merge, with the ring's
   communication modelled.
5. `efficiency`: the paper's Fig. 3 (one 128K document vs 16 x 8K, whole vs Per-Doc shards) and
   achieved TFLOP/s against shard length, per backend.
6. `decoder`: a Llama 3 8B decoder layer forward+backward on 16K tokens with the FlashCP op:
   attention vs dense time, peak memory.
7. `gdn`: the Gated DeltaNet CP op (Qwen3.5's linear layers: `cp_causal_conv1d`, `cp_gated_delta`),
   N in {2, 4, 8} simulated ranks, FlashCP / Per-Doc plans and one document cut across every rank
   beside 1-token documents, float32 and bf16, forward and backward (y, o and dx, dconv_weight, dq,
   dk, dv, dg, dbeta) against the op unsharded, with flash-linear-attention's kernel on CUDA (the
   reference on a CPU); and fla's forward / forward+backward time against the reference.

Files in DIR: summary.md, env.json, exactness.csv, cp.csv, window_sinks.csv, gdn.csv, gdn_timing.csv,
critical_path.csv, efficiency.csv, decoder.json and kernel_calls.csv (every timed kernel call in the format the cost model reads:
`python benchmarks/costmodel.py refit --gpucheck DIR`). `--device cpu --quick` runs every section
at toy sizes and is part of the test suite.

May import: torch, numpy, the engine, `flashcp.data` (length distributions) and
`flashcp.costmodel`; never TorchTitan (GPU machines have none).
"""

from __future__ import annotations

import torch

from flashcp.attention.kernels import BACKENDS
from flashcp.gpucheck import cp_check, critical_path, decoder, efficiency, exactness, gdn, window_sinks

SECTIONS = {
    "exactness": ("1. Kernel exactness", exactness.run),
    "cp": ("2. CP op on simulated ranks", cp_check.run),
    "window_sinks": ("3. Sliding windows with sinks", window_sinks.run),
    "critical_path": ("4. Per-rank critical path", critical_path.run),
    "efficiency": ("5. Kernel efficiency", efficiency.run),
    "decoder": ("6. Llama 3 8B decoder layer", decoder.run),
    "gdn": ("7. Gated DeltaNet CP op on simulated ranks", gdn.run),
}
CORRECTNESS = ("exactness", "cp", "window_sinks", "gdn")  # sections that pass or fail; the others measure


def backends_for(device: torch.device) -> list[str]:
    """The fast backends that run half-precision inputs on `device`; the reference if there are none
    (always so on a CPU)."""
    probe = torch.zeros(1, 1, 64, device=device, dtype=torch.bfloat16)
    fast = [name for name, b in BACKENDS.items() if name != "reference" and b.reject(probe, probe) is None]
    return fast or ["reference"]
