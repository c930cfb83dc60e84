"""Checks of a job's inputs that open files: run once by the launcher, before any rank starts.

`flashcp.titan.config` checks every key without touching the disk; this opens what the job will
read -- the tokenizer and the data source, down to its first document -- so that a missing file, an
undecodable corpus or a vocabulary the model cannot embed fails in seconds with one line, instead
of after the ranks spawned behind torchrun's start-up messages.
"""

from __future__ import annotations

from typing import Any

from flashcp.titan.config import ConfigError, model_dims
from flashcp.titan.sources import build_source, DataConfig, DEFAULT_TOKENIZER
from flashcp.titan.tokenizer import load_tokenizer


def check_inputs(cfg: dict[str, Any]) -> None:
    """Load the tokenizer, check the model's vocabulary against it, open the data; DataError /
    TokenizerError / ConfigError name the problem."""
    data = DataConfig(**cfg["data"])
    tokenizer = load_tokenizer(DEFAULT_TOKENIZER if data.tokenizer == "default" else data.tokenizer)
    vocab = model_dims(cfg)[4]
    if vocab is not None and vocab < tokenizer.vocab_size:
        raise ConfigError(
            f"[model] vocab_size ({vocab}, flavor {cfg['model']['flavor']!r}) is smaller than the "
            f"tokenizer's vocabulary ({tokenizer.vocab_size}, [data] tokenizer = {data.tokenizer!r})"
        )
    source = build_source(data, tokenizer)
    next(iter(source.epoch(0, 0)), None)  # reads and tokenises the first document
