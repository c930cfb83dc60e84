"""How big each section of the check runs: the GPU sizes the check is specified at, and toy sizes for CPU.

The full sizes are chosen so that the whole check ends within about 9 minutes on one H100; each
section also has a time budget and stops adding cases when it is spent (saying so).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Sizes:
    # 1. kernel exactness
    exact_mixes: int  # random shard mixes per (backend, dtype, GQA ratio)
    exact_max_tokens: int  # query tokens of one mix at most
    exact_head_dim: int
    exact_kv_heads: int
    # 2. the CP op on simulated ranks
    cp_context: int
    cp_sizes: tuple[int, ...]
    cp_heads: tuple[int, int, int]  # query heads, key/value heads, head dim
    # 3. sliding windows with sinks
    ws_tokens: int  # query tokens of a fixed case (of a random mix at most)
    ws_heads: tuple[int, int, int]  # query heads, key/value heads, head dim
    ws_window: int  # W of the fixed cases (the mixes also take 1, 2W and none)
    ws_mixes: int
    # 7. Gated DeltaNet CP op
    gdn_context: int  # a multiple of 2 N: the spanning layout is per_seq's split
    gdn_cp_sizes: tuple[int, ...]
    gdn_heads: tuple[int, int, int]  # heads, d_k, d_v of the exactness runs
    gdn_time_tokens: int
    gdn_time_heads: tuple[int, int, int]
    # 4. per-rank critical path
    path_context: int
    path_cp_sizes: tuple[int, ...]
    path_heads: tuple[tuple[int, int], ...]  # (query heads, key/value heads) per rank
    path_head_dim: int
    path_windows: int  # per dataset, at most
    # 5. kernel efficiency
    eff_context: int
    eff_cp: int
    eff_heads: tuple[int, int]  # query heads, key/value heads
    eff_shard_lens: tuple[int, ...]
    # 6. decoder layer
    layer_tokens: int
    layer_dims: tuple[int, int, int, int]  # dim, query heads, key/value heads, SwiGLU hidden
    # timing
    repeats: int
    budgets_s: dict[str, float]  # per section


GPU = Sizes(
    exact_mixes=200, exact_max_tokens=2048, exact_head_dim=128, exact_kv_heads=2,
    cp_context=32768, cp_sizes=(2, 4, 8), cp_heads=(8, 2, 128),
    ws_tokens=4096, ws_heads=(8, 2, 64), ws_window=128, ws_mixes=8,  # gpt-oss: head dim 64, W = 128
    # Qwen3.5's Gated DeltaNet heads are 128 wide; the timing row has Qwen3.5-27B's 48 value heads.
    gdn_context=8192, gdn_cp_sizes=(2, 4, 8), gdn_heads=(4, 128, 128),
    gdn_time_tokens=32768, gdn_time_heads=(48, 128, 128),
    # The shipped models' heads on one rank: Llama 3 8B (32 / 8), 70B under TP 8 (64 / 8 split 8 ways).
    path_context=131072, path_cp_sizes=(4, 8), path_heads=((32, 8), (8, 1)), path_head_dim=128, path_windows=3,
    eff_context=131072, eff_cp=8, eff_heads=(32, 8),
    eff_shard_lens=(128, 256, 512, 1024, 2048, 4096, 8192, 16384),
    layer_tokens=16384, layer_dims=(4096, 32, 8, 14336),
    repeats=3,
    budgets_s={"exactness": 70, "cp": 90, "window_sinks": 40, "critical_path": 150, "efficiency": 60, "decoder": 60,
               "gdn": 60},
)  # fmt: skip

QUICK = Sizes(
    exact_mixes=6, exact_max_tokens=64, exact_head_dim=16, exact_kv_heads=1,
    cp_context=256, cp_sizes=(2, 4, 8), cp_heads=(4, 2, 8),
    ws_tokens=64, ws_heads=(4, 2, 16), ws_window=8, ws_mixes=3,
    gdn_context=256, gdn_cp_sizes=(2, 4, 8), gdn_heads=(2, 8, 4),
    gdn_time_tokens=256, gdn_time_heads=(2, 16, 16),
    path_context=1024, path_cp_sizes=(4,), path_heads=((4, 2),), path_head_dim=16, path_windows=1,
    eff_context=512, eff_cp=4, eff_heads=(4, 2), eff_shard_lens=(16, 64, 128),
    layer_tokens=256, layer_dims=(64, 4, 2, 128),
    repeats=3,  # the best of 3: even toy timings on a busy CPU keep forward+backward above forward
    budgets_s={"exactness": 60, "cp": 120, "window_sinks": 60, "critical_path": 60, "efficiency": 60, "decoder": 60,
               "gdn": 60},
)  # fmt: skip
