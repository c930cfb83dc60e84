"""The gated delta rule (Gated DeltaNet: Qwen3-Next / Qwen3.5 linear attention) in plain torch.

Per head, a state `S [d_k, d_v]` runs over a sequence; for each token t

    S <- (I - beta_t k_t k_t^T) exp(g_t) S + beta_t k_t v_t^T,     o_t = S^T q_t.

`q` and `k` arrive L2-normalised and `q` scaled (d_k^-0.5) by the caller, as flash-linear-attention's
`chunk_gated_delta_rule` does with its flags off. Every sequence of a varlen batch may start from
its own initial state, which is how context parallelism hands a cut document's state to the rank
holding its next piece. Each token's update is affine in S, so a whole sequence is too:
`S_out = M S_in + B`; `affine_summary` returns (B, M), the piece summary CP exchanges.

Two kernels, both differentiable by autograd and float64-capable (the exactness oracle of the CP
op): `gated_delta_recurrence`, token by token, and `chunk_gated_delta`, the chunked (WY) form:
within a chunk one triangular solve, across chunks one state update per chunk. They compute in
float32 at least (bf16 inputs), return outputs in q's dtype and states in the compute dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def _check(q, k, v, g, beta, seq_lens: Sequence[int], initial_state) -> None:
    t, h, dk = q.shape
    if k.shape != q.shape or v.shape[:2] != (t, h) or g.shape != (t, h) or beta.shape != (t, h):
        raise ValueError(
            f"expected q, k [T, H, d_k], v [T, H, d_v], g, beta [T, H]; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}, g {tuple(g.shape)}, beta {tuple(beta.shape)}"
        )
    if any(n < 1 for n in seq_lens) or sum(seq_lens) != t:
        raise ValueError(f"seq_lens must be positive and sum to the {t} rows, got {list(seq_lens)}")
    want = (len(seq_lens), h, dk, v.shape[2])
    if initial_state is not None and initial_state.shape != want:
        raise ValueError(f"initial_state must be {want} (sequences, H, d_k, d_v), "
                         f"got {tuple(initial_state.shape)}")


def _compute_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.promote_types(q.dtype, torch.float32)


def _initial(initial_state, n: int, h: int, dk: int, dv: int, like: torch.Tensor) -> torch.Tensor:
    if initial_state is None:
        return like.new_zeros(n, h, dk, dv)
    return initial_state.to(like.dtype)


def gated_delta_recurrence(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    seq_lens: Sequence[int], initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The rule token by token: `o [T, H, d_v]` and each sequence's final state `[N, H, d_k, d_v]`.

    The definition, kept literal so it can judge the chunked kernel and the CP op; one Python
    step per token, so for tests and small problems only."""
    _check(q, k, v, g, beta, seq_lens, initial_state)
    dtype, out_dtype = _compute_dtype(q), q.dtype
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    states = _initial(initial_state, len(seq_lens), q.shape[1], q.shape[2], v.shape[2], q)
    outs, finals, start = [], [], 0
    for n, length in enumerate(seq_lens):
        s = states[n]
        for t in range(start, start + length):
            s = s * g[t].exp()[:, None, None]
            error = v[t] - torch.einsum("hkv,hk->hv", s, k[t])
            s = s + beta[t][:, None, None] * k[t][:, :, None] * error[:, None, :]
            outs.append(torch.einsum("hkv,hk->hv", s, q[t]))
        start += length
        finals.append(s)
    return torch.stack(outs).to(out_dtype), torch.stack(finals)


def chunk_gated_delta(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    seq_lens: Sequence[int], initial_state: torch.Tensor | None = None, chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The same result as `gated_delta_recurrence`, by chunks of `chunk_size` tokens.

    Chunks never straddle sequences (a sequence's last chunk is zero padded: a padded token has
    k = v = beta = g = 0, the identity update). Chunks are laid out step-major, the sequences
    sorted by chunk count, so step j's chunks are one slice and its states a prefix: the
    sequential part is one batched state update per step, whatever the number of sequences."""
    _check(q, k, v, g, beta, seq_lens, initial_state)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    dtype, out_dtype = _compute_dtype(q), q.dtype
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    t, h, dk = q.shape
    dv, c = v.shape[2], chunk_size
    if not seq_lens:  # a rank may hold no piece of a kind
        return v.new_zeros(0, h, dv, dtype=out_dtype), v.new_zeros(0, h, dk, dv)
    counts = [-(-n // c) for n in seq_lens]
    order = sorted(range(len(seq_lens)), key=lambda i: -counts[i])
    active = [sum(1 for i in order if counts[i] > j) for j in range(max(counts))]  # sequences per step
    step_start = [0]
    for n in active:
        step_start.append(step_start[-1] + n)
    chunks = step_start[-1]
    # Each row's slot in the padded step-major layout: its chunk (step p // C, its sequence's place).
    lens = torch.tensor(seq_lens)
    place = torch.empty(len(order), dtype=torch.long)
    place[order] = torch.arange(len(order))
    row_seq = torch.repeat_interleave(torch.arange(len(seq_lens)), lens)
    pos = torch.arange(t) - (lens.cumsum(0) - lens)[row_seq]
    chunk = torch.tensor(step_start)[pos // c] + place[row_seq]
    slot_of_row = (chunk * c + pos % c).to(q.device)

    def chunked(x: torch.Tensor) -> torch.Tensor:  # [T, H, ...] -> [chunks, H, C, ...]
        padded = x.new_zeros(chunks * c, *x.shape[1:]).index_copy(0, slot_of_row, x)
        return padded.view(chunks, c, *x.shape[1:]).transpose(1, 2)

    qc, kc, vc, gc, bc = (chunked(x) for x in (q, k, v, g, beta))
    cum = gc.cumsum(-1)  # log of the decay from the chunk's start through each token
    lower = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    # (I + A) [U | W] = [beta v | beta exp(cum) k]: the chunk's delta terms before and per unit of S_0.
    a = (bc[..., None] * (kc @ kc.transpose(-1, -2)) * decay).tril(-1)
    eye = torch.eye(c, dtype=dtype, device=q.device)
    rhs = torch.cat([bc[..., None] * vc, (bc * cum.exp())[..., None] * kc], -1)
    u, w = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True).split([dv, dk], -1)
    qk = (qc @ kc.transpose(-1, -2)) * decay
    q_decayed = qc * cum.exp()[..., None]
    k_to_end = kc * (cum[..., -1:] - cum).exp()[..., None]
    last = cum[..., -1].exp()[..., None, None]

    s = _initial(initial_state, len(seq_lens), h, dk, dv, q)[order]
    outs = []
    for j, n in enumerate(active):
        at = slice(step_start[j], step_start[j + 1])
        s_j = s[:n]
        delta = u[at] - w[at] @ s_j
        outs.append(q_decayed[at] @ s_j + qk[at] @ delta)
        s = torch.cat([last[at] * s_j + k_to_end[at].transpose(-1, -2) @ delta, s[n:]])
    o = torch.cat(outs).transpose(1, 2).reshape(chunks * c, h, dv).index_select(0, slot_of_row)
    return o.to(out_dtype), s.index_select(0, place.to(q.device))


def affine_summary(
    k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, seq_lens: Sequence[int],
    chunk_size: int = 64, kernel: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Each sequence's map `S_out = M S_in + B`: `B [N, H, d_k, d_v]` and `M [N, H, d_k, d_k]`.

    The state's columns evolve independently (the update multiplies S on the left; a value column
    only adds into its own state column), so one run over the values `[v | 0]` from the initial
    state `[0 | I]` yields `[B | M]` exactly, by any kernel with `chunk_gated_delta`'s contract
    (`kernel`, default that one; `flashcp.attention.gdn_kernels`). q does not enter the state; k
    stands in."""
    t, h, dk = k.shape
    dv, n = v.shape[2], len(seq_lens)
    dtype = _compute_dtype(k)
    eye = torch.eye(dk, dtype=dtype, device=k.device).expand(n, h, dk, dk)
    initial = torch.cat([eye.new_zeros(n, h, dk, dv), eye], -1)
    values = torch.cat([v.to(dtype), v.new_zeros(t, h, dk, dtype=dtype)], -1)
    _, final = (kernel or chunk_gated_delta)(k, k, values, g, beta, seq_lens, initial, chunk_size)
    return final[..., :dv], final[..., dv:]
