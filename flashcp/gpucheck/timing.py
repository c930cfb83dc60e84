"""Timing one varlen attention call, and counting the work it does.

`Timer` takes the best of a few synchronised runs after a warm-up: the run least disturbed by
anything else on the machine. `time_varlen` times forward and forward+backward of one packed
call on random data; `causal_flops` counts the multiply-adds the bottom-right causal mask keeps,
so TFLOP/s figures compare kernels by the work they had to do, not by the rectangle they cover.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from flashcp.attention.kernels import varlen_attention


class Timer:
    """Best wall time (ms) of `repeats` runs after one warm-up, device synchronised."""

    def __init__(self, device: torch.device, repeats: int) -> None:
        self.device, self.repeats = device, repeats

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __call__(self, fn: Callable[[], object]) -> float:
        fn()
        times = []
        for _ in range(self.repeats):
            self._sync()
            t0 = time.perf_counter()
            fn()
            self._sync()
            times.append((time.perf_counter() - t0) * 1e3)
        return min(times)


def _cu(lengths: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0).to(device=device, dtype=torch.int32)


def time_varlen(
    q_lens: Sequence[int],
    k_lens: Sequence[int],
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    backend: str,
    timer: Timer,
) -> dict[str, float]:
    """`fwd_ms` and `fwd_bwd_ms` of one causal varlen call over the given sequences."""
    device = timer.device
    q = torch.randn(sum(q_lens), heads, head_dim, device=device, dtype=dtype, requires_grad=True)
    k, v = (
        torch.randn(sum(k_lens), kv_heads, head_dim, device=device, dtype=dtype, requires_grad=True)
        for _ in "kv"
    )
    grad = torch.randn_like(q)
    cu_q, cu_k, max_q, max_k = _cu(q_lens, device), _cu(k_lens, device), max(q_lens), max(k_lens)

    def forward() -> torch.Tensor:
        return varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, backend=backend)

    def forward_backward() -> None:
        forward().backward(grad)
        q.grad = k.grad = v.grad = None

    with torch.no_grad():
        fwd = timer(forward)
    return {"fwd_ms": fwd, "fwd_bwd_ms": timer(forward_backward)}


def causal_pairs(q_lens: Sequence[int], k_lens: Sequence[int]) -> int:
    """(query, key) pairs a bottom-right causal mask keeps: query j of (Lq, Lk) sees j + Lk - Lq + 1."""
    return sum(lq * (lk - lq) + lq * (lq + 1) // 2 for lq, lk in zip(q_lens, k_lens))


def causal_flops(q_lens: Sequence[int], k_lens: Sequence[int], heads: int, head_dim: int) -> dict[str, float]:
    """Forward and forward+backward FLOPs of the kept pairs: QK^T and PV make 4 d per pair forward,
    and the backward counts 2.5x the forward (FlashAttention's accounting), 3.5x in all."""
    fwd = 4.0 * head_dim * heads * causal_pairs(q_lens, k_lens)
    return {"fwd": fwd, "fwd_bwd": 3.5 * fwd}


# kernel_calls.csv: every timed call, in the per-rank table format flashcp.costmodel.profiles reads.
KERNEL_CALL_COLUMNS = ["section", "backend", "dtype", "heads", "kv_heads", "head_dim", "q_lens", "k_lens",
                       "fwd_ms", "fwd_bwd_ms"]  # fmt: skip


def time_and_log(calls, section: str, q_lens: Sequence[int], k_lens: Sequence[int], heads: tuple[int, int],
                 head_dim: int, dtype: torch.dtype, backend: str, timer: Timer) -> dict[str, float]:  # fmt: skip
    """`time_varlen` with `heads` = (query heads, key/value heads), recorded in `calls` (the
    kernel_calls table). GQA as the models have it: fewer K/V rows to read than query heads."""
    t = time_varlen(q_lens, k_lens, *heads, head_dim, dtype, backend, timer)
    calls.add(section=section, backend=backend, dtype=str(dtype).removeprefix("torch."), heads=heads[0],
              kv_heads=heads[1], head_dim=head_dim, q_lens=list(q_lens), k_lens=list(k_lens), **t)  # fmt: skip
    return t
