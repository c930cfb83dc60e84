"""The probe's prompts: a number hidden at a depth of real held-out text, asked for at the end.

A prompt of `length` tokens is one document: BOS (when the job adds it), haystack, the needle
("The pass key is 48213. Remember it. 48213 is the pass key.") at `depth` of the haystack, more
haystack, the question ("What is the pass key? The pass key is") and the answer (" 48213"), whose
tokens alone carry labels. The haystack is the job's held-out text, its documents joined into
one stream (BOS / EOS dropped) from an offset drawn per prompt, read around when a prompt is
longer than the stream. Needle, question and answer go through the job's tokenizer in pieces, so
the answer's token ids are exactly those inside the needle. Keys and offsets come from
`numpy`'s generator seeded by (seed, length, depth, sample): every rank and every run builds the
same prompts, and a cell's prompts do not change when the grid around it does.

Prompts are packed into windows of `seq_len` as separate documents (first fit, longest first),
each window filled up with one unlabelled haystack document, so a 128K window holds one 128K
prompt or 32 of 4K; the window count is rounded up to a multiple of the data-parallel ranks
(FSDP runs every forward on every rank) with unlabelled windows.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

import numpy as np

from flashcp.data.errors import DataError
from flashcp.data.sources import build_source, DataConfig
from flashcp.data.tokenizer import Tokenizer

NEEDLE = "The pass key is{key}. Remember it.{key} is the pass key."
QUESTION = "\nWhat is the pass key? The pass key is"


@dataclass(kw_only=True, slots=True)
class ProbeSettings:
    """The job's `[probe]` section (flashcp.titan.config.SCHEMA) and the haystack's data (`[validation]
    source` read as `[data]`, `flashcp.titan.components.heldout`); `lengths` resolved by `grid_lengths`."""

    enable: bool = False
    freq: int = 100
    lengths: list[int] = field(default_factory=list)
    min_length: int = 4096
    depths: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    samples: int = 4
    seed: int = 0
    key_digits: int = 5
    haystack: DataConfig | None = None

    def due(self, step: int) -> bool:
        """Probe at step 1 (the model as loaded) and every `freq` steps, as validation does."""
        return self.enable and (step == 1 or step % self.freq == 0)

    def grid_lengths(self, seq_len: int) -> list[int]:
        """`lengths` sorted, or doubling from `min_length` (at most seq_len) up to seq_len."""
        if self.lengths:
            return sorted(self.lengths)
        out, n = [], min(self.min_length, seq_len)
        while n < seq_len:
            out.append(n)
            n *= 2
        return [*out, seq_len]


@dataclass(frozen=True)
class Prompt:
    tokens: np.ndarray  # int64, `length` ids
    answer: int  # index of the answer's first token; the answer runs to the end
    cell: tuple[int, int]  # (length index, depth index)
    sample: int  # the prompt's index in the probe (its slot in the score sums)


@dataclass
class Window:
    """One packed window as the loader yields it (`input`, `labels`, `doc_lens`) and each token's prompt slot."""

    input: np.ndarray
    labels: np.ndarray  # -100 but at the token before each answer token
    doc_lens: list[int]
    slot: np.ndarray  # the prompt a labelled token belongs to; `prompts` (the spare slot) elsewhere


def haystack_stream(data: DataConfig, tokenizer: Tokenizer, tokens: int) -> np.ndarray:
    """The first `tokens` tokens of the held-out documents, joined without BOS / EOS (all of them if fewer)."""
    plain = dataclasses.replace(data, add_bos=False, add_eos=False, shuffle=False, mix={})
    source = build_source(plain, tokenizer)
    parts, have = [], 0
    for _, doc in source.epoch(0, 0):
        parts.append(np.asarray(doc, dtype=np.int64))
        have += len(doc)
        if have >= tokens:
            break
    if not have:
        raise DataError(f"the probe's haystack ([validation] source {data.source}) holds no tokens")
    return np.concatenate(parts)[:tokens]


def _encode(tokenizer: Tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text)) if text else []


def build_prompts(settings: ProbeSettings, seq_len: int, tokenizer: Tokenizer, stream: np.ndarray,
                  bos: int | None) -> list[Prompt]:  # fmt: skip
    """Every (length, depth, sample) prompt; DataError when a length cannot hold needle, question and answer."""
    lengths, depths = settings.grid_lengths(seq_len), settings.depths
    prefix, middle, suffix = (_encode(tokenizer, t) for t in NEEDLE.replace("{key}", "\0").split("\0"))
    question = _encode(tokenizer, QUESTION)
    head = [bos] if bos is not None else []
    prompts: list[Prompt] = []
    for (li, length), (di, depth) in itertools.product(enumerate(lengths), enumerate(depths)):
        for s in range(settings.samples):
            rng = np.random.default_rng([settings.seed, length, int(round(depth * 1e6)), s])
            key = " " + "".join(str(d) for d in rng.integers(0, 10, settings.key_digits))
            answer = _encode(tokenizer, key)
            needle = [*prefix, *answer, *middle, *answer, *suffix]
            hay = length - len(head) - len(needle) - len(question) - len(answer)
            if hay < 0:
                raise DataError(f"[probe] a prompt of {length} tokens cannot hold the needle, question and answer "
                                f"({length - hay} tokens); raise the shortest length")  # fmt: skip
            text = stream[(rng.integers(len(stream)) + np.arange(hay)) % len(stream)]
            at = int(round(depth * hay))
            tokens = np.array([*head, *text[:at], *needle, *text[at:], *question, *answer], dtype=np.int64)
            prompts.append(Prompt(tokens, length - len(answer), (li, di), len(prompts)))
    return prompts


def pack(prompts: list[Prompt], seq_len: int, stream: np.ndarray, dp_world: int = 1) -> list[Window]:
    """The prompts as windows of `seq_len` (first fit, longest first), filled up with unlabelled haystack,
    their count a multiple of `dp_world`."""
    bins: list[list[Prompt]] = []
    free: list[int] = []
    for p in sorted(prompts, key=lambda p: -len(p.tokens)):
        i = next((i for i, room in enumerate(free) if room >= len(p.tokens)), len(bins))
        if i == len(bins):
            bins.append([])
            free.append(seq_len)
        bins[i].append(p)
        free[i] -= len(p.tokens)
    bins += [[] for _ in range(-len(bins) % dp_world)]
    spare = len(prompts)
    windows = []
    for group in bins:
        docs = [p.tokens for p in group]
        filler = seq_len - sum(len(d) for d in docs)
        if filler:
            docs.append(stream[np.arange(filler) % len(stream)])
        tokens = np.concatenate(docs)
        labels = np.full(seq_len, -100, dtype=np.int64)
        slot = np.full(seq_len, spare, dtype=np.int64)
        start = 0
        for p in group:
            at = np.arange(start + p.answer, start + len(p.tokens))  # the answer tokens; each is the label one before
            labels[at - 1] = tokens[at]
            slot[at - 1] = p.sample
            start += len(p.tokens)
        windows.append(Window(tokens, labels, [len(d) for d in docs], slot))
    return windows
