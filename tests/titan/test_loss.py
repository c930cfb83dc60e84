"""The chunked cross-entropy equals the unchunked one: loss, hidden-state and lm_head gradients."""

from __future__ import annotations

import pytest
import torch

import flashcp.titan  # noqa: F401  (TorchTitan's CPU shims before torchtitan is imported)
from flashcp.titan.components.loss import loss_chunks, loss_config


@pytest.mark.parametrize(
    "tokens, chunk, expect",
    [(16384, 2048, 8), (16384, 0, 1), (1000, 2048, 1), (1000, 300, 4), (96, 40, 3), (13, 5, 13)],
)
def test_chunk_count_is_the_fewest_equal_slices_within_the_bound(tokens, chunk, expect):
    assert loss_chunks(tokens, chunk) == expect
    assert tokens % expect == 0 and (expect == 1 or tokens // expect <= chunk)


def _loss_and_grads(hidden, labels, weight, chunk_tokens):
    hidden = hidden.clone().requires_grad_(True)
    lm_head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
    with torch.no_grad():
        lm_head.weight.copy_(weight)
    loss_fn = loss_config(weight.shape[0], hidden.shape[1], chunk_tokens).build()
    valid = (labels != -100).sum()
    if chunk_tokens:
        loss_fn.set_lm_head(lm_head)
        loss, _ = loss_fn(hidden, labels, valid)
    else:
        loss, _ = loss_fn(lm_head(hidden), labels, valid)
    loss.backward()
    return loss.detach(), hidden.grad, lm_head.weight.grad


def test_chunked_loss_equals_unchunked_values_and_gradients():
    torch.manual_seed(0)
    tokens, dim, vocab = 96, 32, 1000
    hidden = torch.randn(1, tokens, dim)
    weight = torch.randn(vocab, dim) / dim**0.5
    labels = torch.randint(0, vocab, (1, tokens))
    labels[0, ::7] = -100  # document ends: ignored tokens
    whole = _loss_and_grads(hidden, labels, weight, chunk_tokens=0)
    chunked = _loss_and_grads(hidden, labels, weight, chunk_tokens=40)
    assert loss_chunks(tokens, 40) == 3
    for a, b in zip(whole, chunked):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
