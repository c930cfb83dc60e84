"""The chunked gated delta kernel equals the token-by-token recurrence, and the recurrence is the rule.

Float64 throughout (only summation order differs: errors ~1e-15, asserted below 1e-10): outputs,
final states and the gradients of every input, the per-sequence initial states included, over
varlen batches with 1-token sequences, sequences shorter and longer than a chunk and chunks of
1, 3 and 64 tokens. `affine_summary`'s (B, M) reproduce any initial state's final state.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flashcp.attention.gated_delta import affine_summary, chunk_gated_delta, gated_delta_recurrence

TOL = 1e-10
LENS = [5, 1, 13, 7, 2, 3]


def inputs(seq_lens: list[int], heads: int = 2, dk: int = 4, dv: int = 3, seed: int = 0) -> list:
    """q, k (L2-normalised, q scaled), v, log-decay g < 0, beta in (0, 1), initial states."""
    gen = torch.Generator().manual_seed(seed)
    t = sum(seq_lens)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    return [
        F.normalize(rand(t, heads, dk), dim=-1) * dk**-0.5, F.normalize(rand(t, heads, dk), dim=-1),
        rand(t, heads, dv), -F.softplus(rand(t, heads)), torch.sigmoid(rand(t, heads)),
        rand(len(seq_lens), heads, dk, dv),
    ]  # fmt: skip


def outputs_and_grads(kernel, tensors: list[torch.Tensor], seq_lens: list[int], **kw) -> list[torch.Tensor]:
    leaves = [t.clone().requires_grad_() for t in tensors]
    *rows, initial = leaves
    o, final = kernel(*rows, seq_lens, initial, **kw)
    weights = torch.Generator().manual_seed(1)
    loss = (o * torch.randn(o.shape, generator=weights, dtype=o.dtype)).sum()
    (loss + (final * torch.randn(final.shape, generator=weights, dtype=o.dtype)).sum()).backward()
    return [o.detach(), final.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("chunk_size", [1, 3, 64])
def test_chunked_kernel_equals_recurrence_with_gradients(chunk_size):
    tensors = inputs(LENS)
    want = outputs_and_grads(gated_delta_recurrence, tensors, LENS)
    got = outputs_and_grads(chunk_gated_delta, tensors, LENS, chunk_size=chunk_size)
    names = ("o", "final", "dq", "dk", "dv", "dg", "dbeta", "dinitial")
    for name, a, b in zip(names, got, want):
        assert (a - b).abs().max() < TOL, f"{name}: {(a - b).abs().max():.3g}"


def test_affine_summary_maps_any_initial_state_to_the_final_one():
    q, k, v, g, beta, initial = inputs(LENS, dk=3, dv=5, seed=2)
    b, m = affine_summary(k, v, g, beta, LENS, chunk_size=4)
    _, final = gated_delta_recurrence(q, k, v, g, beta, LENS, initial)
    assert b.shape == (len(LENS), 2, 3, 5) and m.shape == (len(LENS), 2, 3, 3)
    assert (m @ initial + b - final).abs().max() < TOL


def test_recurrence_reads_back_what_it_wrote():
    """The rule itself: with no decay and beta = 1 a unit key overwrites its value, so querying
    that key returns it while an orthogonal key's value is kept."""
    e = torch.eye(3, dtype=torch.float64)
    k = e[[0, 1, 0]][:, None]  # write key 0, key 1, then key 0 again
    v = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], dtype=torch.float64)[:, None]
    ones = torch.ones(3, 1, dtype=torch.float64)
    o, final = gated_delta_recurrence(k, k, v, 0 * ones, ones, [3])
    assert torch.equal(o[:, 0], v[:, 0]) and torch.equal(final[0, 0, :2], v[[2, 1], 0])
    o, _ = gated_delta_recurrence(k, k, v, torch.log(ones / 2), ones, [3])  # halving decay before each write
    assert torch.equal(o[:, 0], v[:, 0])  # the delta rule writes the value itself, whatever the decay


def test_bfloat16_inputs_run_in_float32():
    tensors = inputs([9, 4], seed=3)
    *rows, initial = tensors
    o, final = chunk_gated_delta(*(t.bfloat16() for t in rows), [9, 4], initial.float(), chunk_size=4)
    want, want_final = gated_delta_recurrence(*rows, [9, 4], initial)
    assert o.dtype == torch.bfloat16 and final.dtype == torch.float32
    assert (o.double() - want).abs().max() < 0.05 and (final.double() - want_final).abs().max() < 0.05


def test_bad_input_is_refused_in_one_line():
    q, k, v, g, beta, initial = inputs([3, 2])
    with pytest.raises(ValueError, match="sum to the 5 rows"):
        chunk_gated_delta(q, k, v, g, beta, [3, 3])
    with pytest.raises(ValueError, match="g, beta"):
        chunk_gated_delta(q, k, v, g[:, :1], beta, [3, 2])
    with pytest.raises(ValueError, match="initial_state"):
        gated_delta_recurrence(q, k, v, g, beta, [5], initial)
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_gated_delta(q, k, v, g, beta, [3, 2], chunk_size=0)
