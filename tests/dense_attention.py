"""A plain dense oracle for windowed attention with sinks, written apart from every kernel.

Per document: all scores q k^T * scale, a causal mask cut to each query's last `window` keys (HF
`sliding_window`: query t sees keys t - window + 1 .. t), and with `sinks` one extra logit column
per head that joins the softmax's denominator only. Autograd through it gives the gradients the
blocked kernels' closed forms must reproduce.
"""

from __future__ import annotations

import math

import torch


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_lens: list[int], window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """`[T, Hq, Dv]` attention of the packed documents `doc_lens` (rows of q, k, v in window order)."""
    group = q.shape[1] // k.shape[1]
    outs, start = [], 0
    for length in doc_lens:
        rows = slice(start, start + length)
        keys, values = (t[rows].repeat_interleave(group, 1) for t in (k, v))
        scores = torch.einsum("qhd,khd->hqk", q[rows], keys) / math.sqrt(q.shape[-1])
        t = torch.arange(length)
        seen = t[None, :] <= t[:, None]
        if window is not None:
            seen &= t[None, :] > t[:, None] - window
        scores = scores.masked_fill(~seen, -math.inf)
        if sinks is not None:
            scores = torch.cat([scores, sinks[:, None, None].expand(-1, length, 1)], -1)
        probs = scores.softmax(-1)[..., :length]
        outs.append(torch.einsum("hqk,khd->qhd", probs, values))
        start += length
    return torch.cat(outs)
