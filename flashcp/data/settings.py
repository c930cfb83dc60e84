"""`DataConfig`, the `[data]` settings, and the checks of a data mixture's entries.

One source is `source = ...`; a mixture is a table of named entries instead, each a source with a
weight and an optional length filter (`flashcp.data.mixture`):

    [data.mix.long]
    source = "data/books_tokens"     # any `source` value: a token store, files, "default", "synthetic"
    weight = 0.4                     # share of the tokens; weights are normalised to sum to 1
    min_tokens = 8192                # keep documents of at least / at most this many tokens
    [data.mix.short]
    source = "data/web"
    weight = 0.6
    max_tokens = 8191

An entry may also set the settings that describe one source (`SOURCE_KEYS`); everything else
(tokenizer, BOS / EOS, seed, packing, balance) is the whole stream's and stays in `[data]`.
Bad entries raise DataError naming `[data.mix.NAME] key`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields, replace
from typing import Any

from flashcp.data.errors import DataError

BALANCE_MODES = ("deferral", "deferral-cut", "mesh", "mesh-cut", "off")
SOURCE_KEYS = ("text_field", "txt_sample_by", "hf_config", "hf_split", "synthetic_lengths", "shuffle",
               "max_doc_tokens")  # fmt: skip
ENTRY_KEYS = ("source", "weight", "min_tokens", "max_tokens", *SOURCE_KEYS)
NO_LIMIT = 2**62  # a mixture entry's max_tokens when none is given
_NAME = re.compile(r"[A-Za-z0-9_-]+")  # names become TensorBoard tags and state keys


@dataclass
class DataConfig:
    """Where documents come from and how they are packed; see `flashcp.data.sources`."""

    source: str = "default"
    tokenizer: str = "default"  # tokenizer.json, SentencePiece .model, or a directory holding one
    text_field: str = "text"  # column with the text in .jsonl/.json/.parquet and hub datasets
    txt_sample_by: str = "document"  # .txt files: "document" (whole file), "paragraph" or "line"
    hf_config: str | None = None
    hf_split: str = "train"
    overflow: str = "carry"  # "carry" or "truncate": what happens to a document cut by a window end
    add_bos: bool = True
    add_eos: bool = True
    max_doc_tokens: int = 1 << 20  # a longer text document is an error (a mangled or non-text file)
    shuffle: bool = True
    seed: int = 0
    loop: bool = True
    prefetch: int = 2
    synthetic_lengths: str = "wlbllm"  # a flashcp.data.lengths name or a JSON list of lengths
    cache_dir: str | None = None  # HF datasets cache (default: HF's own)
    # "mesh": the pieces stream packing gives one optimizer step moved between all its windows (DP
    # ranks x micro steps) so that every window's predicted cost is close to the mean; the step trains
    # the same tokens with the same attention context, except where a window's end cuts a short piece.
    # "mesh-cut": the step's documents joined again and the longest cut where needed to bring every
    # window within balance_target x the mean (less attention context, tighter balance).
    # "deferral": documents of at least seq_len / 16 tokens may wait up to max_delay_steps steps
    # for a step where they can be balanced (flashcp.data.deferral); windows stay exactly seq_len,
    # every document is trained once, whole unless it is longer than a window (then in window-long
    # pieces). "deferral-cut" also cuts what deferral could not bring within balance_target.
    # "off": windows in stream order.
    # Default by measurement (docs/results.md "Global-batch balance"): deferral-cut keeps the most attended
    # pairs of the modes that reach p95 <= 1.05 (mesh-cut 73 % of stream packing's); with every step held
    # at min_pairs_kept of stream packing's pairs, long documents need up to 16 steps to gather into steps
    # that balance whole (at 8, p95 <= 1.05 in 10 of 72 measured runs).
    balance: str = "deferral-cut"
    balance_target: float = 1.05
    max_delay_steps: int = 16
    # "deferral-cut" never cuts a step below this share of the attended pairs stream packing keeps
    # of the step's own documents (flashcp.data.deferral); 0 lets balance take any.
    min_pairs_kept: float = 0.99
    # Several sources mixed by token weights instead of `source` (module docstring): name -> entry.
    mix: dict[str, dict[str, Any]] = field(default_factory=dict)

    def balance_args(self) -> dict[str, Any] | None:
        """`WindowLoader.balance_with`'s arguments for `balance` (None: off)."""
        if self.balance == "off":
            return None
        cut = self.balance_target if self.balance.endswith("-cut") else None
        delay = self.max_delay_steps if self.balance.startswith("deferral") else None
        return {"cut_target": cut, "max_delay": delay, "target": self.balance_target,
                "min_kept": self.min_pairs_kept}  # fmt: skip

    def __post_init__(self) -> None:
        choices = {"overflow": ("carry", "truncate"), "txt_sample_by": ("document", "paragraph", "line"),
                   "balance": BALANCE_MODES}  # fmt: skip
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                raise DataError(f"data.{key} must be one of {allowed}, got {getattr(self, key)!r}")
        if not self.balance_target >= 1.0:
            raise DataError(f"data.balance_target must be >= 1.0 (max / mean step cost), got {self.balance_target}")
        if not 0.0 <= self.min_pairs_kept <= 1.0:
            raise DataError(f"data.min_pairs_kept must be within [0, 1] (the share of stream packing's attended "
                            f"pairs each step keeps), got {self.min_pairs_kept}")  # fmt: skip
        if self.max_delay_steps < 0:
            raise DataError(f"data.max_delay_steps must be >= 0 (steps a long document may wait), got "
                            f"{self.max_delay_steps}")  # fmt: skip
        if self.max_doc_tokens < 1 or self.prefetch < 0:
            raise DataError(
                f"data.max_doc_tokens must be >= 1 and data.prefetch >= 0, got "
                f"{self.max_doc_tokens} and {self.prefetch}"
            )
        if self.mix:
            mix_entries(self)

    def of_entry(self, entry: MixEntry) -> DataConfig:
        """The settings of one mixture entry's source: the stream's, with the entry's own on top."""
        return replace(self, source=entry.source, mix={}, **entry.settings)


@dataclass(frozen=True)
class MixEntry:
    """One source of a mixture: its share of the tokens and which documents of it are kept."""

    name: str
    source: str
    share: float  # the weight normalised over the entries
    min_tokens: int  # documents are kept when min_tokens <= length <= max_tokens (BOS / EOS included)
    max_tokens: int
    settings: dict[str, Any]  # SOURCE_KEYS the entry sets


def _number(where: str, value: Any, kind: type) -> Any:
    ok = isinstance(value, kind) and not isinstance(value, bool) if kind is int else (
        isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value))  # fmt: skip
    if not ok:
        raise DataError(f"{where} must be {'an integer' if kind is int else 'a finite number'}, got {value!r}")
    return value


def mix_entries(cfg: DataConfig) -> list[MixEntry]:
    """`cfg.mix` checked and normalised, in name order; DataError naming the first bad key."""
    if not isinstance(cfg.mix, dict):
        raise DataError(f"data.mix must be a table of named sources ([data.mix.NAME]), got {cfg.mix!r}")
    if cfg.source != "default":
        raise DataError(f"data.source ({cfg.source!r}) and data.mix are exclusive: name every source of a "
                        "mixture in its own [data.mix.NAME] table")  # fmt: skip
    types = {f.name: type(f.default) for f in fields(DataConfig) if f.name in SOURCE_KEYS}
    entries, weights = [], []
    for name in sorted(cfg.mix):
        entry, where = cfg.mix[name], f"[data.mix.{name}]"
        if not _NAME.fullmatch(name):
            raise DataError(f"{where}: a source's name may hold only letters, digits, '_' and '-'")
        if not isinstance(entry, dict):
            raise DataError(f"{where} must be a table (source, weight, ...), got {entry!r}")
        unknown = sorted(set(entry) - set(ENTRY_KEYS))
        if unknown:
            raise DataError(f"{where} {unknown[0]}: unknown key; allowed keys: {', '.join(ENTRY_KEYS)}")
        for key in ("source", "weight"):
            if key not in entry:
                raise DataError(f"{where} {key} is missing: every source of a mixture names its source and weight")
        if not isinstance(entry["source"], str):
            raise DataError(f"{where} source must be a string, got {entry['source']!r}")
        weight = _number(f"{where} weight", entry["weight"], float)
        if not weight > 0:
            raise DataError(f"{where} weight must be > 0 (a share of the tokens), got {weight}")
        low = _number(f"{where} min_tokens", entry.get("min_tokens", 0), int)
        high = _number(f"{where} max_tokens", entry.get("max_tokens", NO_LIMIT), int)
        if low < 0 or high < max(low, 1):
            raise DataError(f"{where} min_tokens ({low}) and max_tokens ({high}) must satisfy "
                            "0 <= min_tokens <= max_tokens, max_tokens >= 1")  # fmt: skip
        settings = {k: v for k, v in entry.items() if k in SOURCE_KEYS}
        for key, value in settings.items():
            kind = str if key == "hf_config" else types[key]
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise DataError(f"{where} {key} must be {kind.__name__}, got {value!r}")
        try:
            replace(cfg, mix={}, source=entry["source"], **settings)
        except DataError as e:
            raise DataError(f"{where} {e}") from e
        entries.append((name, entry["source"], low, high, settings))
        weights.append(weight)
    if not entries:
        raise DataError("data.mix names no source: give at least one [data.mix.NAME] table, or use data.source")
    top = max(weights)  # scaled first: weights near the float maximum would overflow their sum
    total = math.fsum(w / top for w in weights)
    shares = [w / top / total for w in weights]
    if 0 in shares:
        name = entries[shares.index(0)][0]
        raise DataError(f"[data.mix.{name}] weight {weights[shares.index(0)]} is no share of the tokens beside "
                        f"{top}: its share rounds to 0")  # fmt: skip
    return [MixEntry(name, source, share, low, high, settings)
            for (name, source, low, high, settings), share in zip(entries, shares)]  # fmt: skip
