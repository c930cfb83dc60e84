"""A two-layer Llama whose weights are written by hand so that it retrieves: a bigram induction circuit.

Layer 1 has two previous-token heads: their queries and keys are constant (a bias coordinate of
every embedding) and rotated by RoPE's fast frequencies so that the score peaks at a relative
offset of 1 (head 0) or 2 (head 1); each copies that token's embedding into its own subspace.
Layer 2's head 0 matches the current bigram (token, previous token) against each earlier
position's (previous, second previous) using RoPE's slow frequencies, near 0 with `rope_theta` =
1e21 (no rotation over a few thousand positions: content, not position, decides), and copies the
matched position's token into an output subspace that `lm_head` reads. So after "... pass key
is" it predicts the token that followed "key is" inside the needle, and after each answer token
the next one: the probe's answer, teacher-forced. Token embeddings are random unit vectors in 192
dimensions (4096 tokens, cross similarity at most ~0.35). With `retrieve=False` layer 2's query
is zero: uniform attention over the document, the same model without its lookup.
"""

from __future__ import annotations

import math
import torch

DIM, HEADS, HEAD_DIM, EMB = 1024, 2, 512, 192
T, BIAS, P1, P2, OUT = slice(0, EMB), 192, slice(256, 256 + EMB), slice(512, 512 + EMB), slice(768, 768 + EMB)
FAST = 64  # RoPE pairs 0..63 turn fast enough to find an offset; 64..255 are still (content matching)
THETA = 1e21
MODEL = {"flavor": "custom", "dim": DIM, "n_layers": 2, "n_heads": HEADS, "n_kv_heads": HEADS,
         "multiple_of": 32, "ffn_dim_multiplier": 0.01, "rope_theta": THETA}  # fmt: skip


def _frequencies() -> torch.Tensor:
    return 1.0 / (THETA ** (torch.arange(0, HEAD_DIM, 2).double() / HEAD_DIM))


def copying_state_dict(shapes: dict[str, torch.Size], vocab: int, retrieve: bool = True) -> dict[str, torch.Tensor]:
    """Float32 weights for a model of `MODEL`'s shape (`shapes`: its parameter names and global shapes)."""
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(vocab, EMB, generator=g, dtype=torch.float64)
    emb /= emb.norm(dim=1, keepdim=True)
    sd = {k: torch.zeros(shape, dtype=torch.float64) for k, shape in shapes.items()}
    sd["tok_embeddings.weight"][:, T] = emb
    sd["tok_embeddings.weight"][:, BIAS] = 1.0
    for name in ("layers.0.attention_norm.weight", "layers.1.attention_norm.weight", "layers.0.ffn_norm.weight",
                 "layers.1.ffn_norm.weight", "norm.weight"):  # fmt: skip
        sd[name][:] = 1.0
    # RMSNorm scales a residual of n unit-norm parts by sqrt(DIM / n): undone where read
    n1, n2, n3 = math.sqrt(DIM / 2), math.sqrt(DIM / 4), math.sqrt(DIM / 5)
    freqs = _frequencies()[:FAST]
    gap = float((1 - torch.cos(freqs)).sum())  # score drop one position off the peak
    c = math.sqrt(30 * math.sqrt(HEAD_DIM) / gap)  # that drop is 30 after the softmax scale
    pre = "layers.0.attention."
    for head, offset in ((0, 1), (1, 2)):
        rows = head * HEAD_DIM + 2 * torch.arange(FAST)
        sd[pre + "qkv_linear.wq.weight"][rows, BIAS] = c / n1
        sd[pre + "qkv_linear.wk.weight"][rows, BIAS] = c / n1 * torch.cos(offset * freqs)
        sd[pre + "qkv_linear.wk.weight"][rows + 1, BIAS] = c / n1 * torch.sin(offset * freqs)
        sd[pre + "qkv_linear.wv.weight"][head * HEAD_DIM + torch.arange(EMB), torch.arange(EMB)] = 1 / n1
        target = (P1, P2)[head]
        sd[pre + "wo.weight"][torch.arange(target.start, target.stop), head * HEAD_DIM + torch.arange(EMB)] = 1.0
    pre = "layers.1.attention."
    s = math.sqrt(40 * math.sqrt(HEAD_DIM))  # an exact bigram scores 40 more than none after the softmax scale
    slow = 2 * FAST + torch.arange(2 * EMB)  # head dims of the still pairs
    lookup = s / n2 if retrieve else 0.0
    sd[pre + "qkv_linear.wq.weight"][slow[:EMB], torch.arange(T.start, T.stop)] = lookup
    sd[pre + "qkv_linear.wq.weight"][slow[EMB:], torch.arange(P1.start, P1.stop)] = lookup
    sd[pre + "qkv_linear.wk.weight"][slow[:EMB], torch.arange(P1.start, P1.stop)] = s / n2
    sd[pre + "qkv_linear.wk.weight"][slow[EMB:], torch.arange(P2.start, P2.stop)] = s / n2
    sd[pre + "qkv_linear.wv.weight"][torch.arange(EMB), torch.arange(EMB)] = 1 / n2
    sd[pre + "wo.weight"][torch.arange(OUT.start, OUT.stop), torch.arange(EMB)] = 1.0
    sd["lm_head.weight"][:, OUT] = 40.0 * emb / n3
    return {k: v.float() for k, v in sd.items()}
