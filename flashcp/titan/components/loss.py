"""The training loss: cross-entropy over the vocabulary, a chunk of tokens at a time.

With a 128K-entry vocabulary the output projection and its loss dominate a rank's memory: for
16K tokens (Llama 3 8B, 128K context, CP 8) the bf16 logits, their fp32 copy, the saved
log-softmax and its gradient are 4 GiB each. TorchTitan 0.3.0's `ChunkedLossWrapper` computes
`lm_head` + cross-entropy + their backward for one slice of the tokens at a time (the model skips
its `lm_head`), so only one slice's logits live at once, plus an fp32 buffer of the hidden
states' gradient. The loss and every gradient are the same sums in another order (equal to float
rounding; tests/titan/test_loss.py). `[loss] chunk_tokens` bounds the slice; 0 turns it off.
"""

from __future__ import annotations

from torchtitan.components.loss import BaseLoss, ChunkedLossWrapper, CrossEntropyLoss


def loss_chunks(tokens: int, chunk_tokens: int) -> int:
    """The fewest equal slices of `tokens` holding at most `chunk_tokens` each (1: no chunking).

    TorchTitan's wrapper needs the slices equal, so the count is a divisor of `tokens`."""
    if chunk_tokens <= 0 or tokens <= chunk_tokens:
        return 1
    return next(n for n in range(-(-tokens // chunk_tokens), tokens + 1) if tokens % n == 0)


def loss_config(vocab_size: int, local_tokens: int, chunk_tokens: int) -> BaseLoss.Config:
    """Cross-entropy for a rank that holds `local_tokens` tokens before the output projection."""
    cross_entropy = CrossEntropyLoss.Config(global_vocab_size=vocab_size)
    chunks = loss_chunks(local_tokens, chunk_tokens)
    if chunks == 1:
        return cross_entropy
    return ChunkedLossWrapper.Config(num_chunks=chunks, loss_fn=cross_entropy)
