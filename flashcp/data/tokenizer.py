"""Tokenizers for FlashCP's data pipeline: a HF `tokenizer.json` or a SentencePiece `.model`.

    tok = load_tokenizer("data/default/tokenizer.json")   # or a .model file, or a directory
    tok.encode("some text")  -> list[int]                  # never adds BOS/EOS
    tok.encode_batch(texts)  -> list[list[int]]
    tok.decode(ids) -> str;  tok.vocab_size, tok.bos_id, tok.eos_id (None when undefined)

Why a module of our own: the packer (`flashcp.data.loader`) decides where BOS/EOS go, so encoding
must return plain text tokens and expose the special ids; TorchTitan 0.3.0's tokenizer rejects
SentencePiece models; and the data pipeline should be usable and testable without TorchTitan.
Special-token strings that happen to occur inside a document (e.g. a literal "<|eos|>") are
encoded as ordinary text, so data can never inject control tokens.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

# Names under which common tokenizers spell BOS/EOS, for a tokenizer.json without a config file.
_BOS_NAMES = ("<|bos|>", "<|begin_of_text|>", "<s>", "<bos>", "[BOS]")
_EOS_NAMES = ("<|eos|>", "<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "[EOS]")


class TokenizerError(ValueError):
    """A tokenizer file is missing, unreadable or of an unsupported kind."""


class Tokenizer(Protocol):
    path: Path  # the file it was loaded from
    vocab_size: int
    bos_id: int | None
    eos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class HFTokenizer:
    """A HF `tokenizers` model from `tokenizer.json`.

    BOS/EOS come from `tokenizer_config.json` beside the file when it names them (the layout
    TorchTitan and transformers use), otherwise from the first well-known special-token name the
    vocabulary contains.
    """

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer as _HF

        self.path = Path(path)
        try:
            self._tok = _HF.from_file(str(self.path))
        except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
            raise TokenizerError(f"cannot read tokenizer {self.path}: {e}") from e
        self._tok.encode_special_tokens = True
        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)
        config = self._config()
        self.bos_id = self._special(config.get("bos_token"), _BOS_NAMES)
        self.eos_id = self._special(config.get("eos_token"), _EOS_NAMES)

    def _config(self) -> dict:
        path = self.path.with_name("tokenizer_config.json")
        if not path.is_file():
            return {}
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise TokenizerError(f"cannot read {path}: {e}") from e

    def _special(self, configured: str | dict | None, names: tuple[str, ...]) -> int | None:
        if isinstance(configured, dict):  # transformers may store {"content": "<s>", ...}
            configured = configured.get("content")
        if configured:
            token_id = self._tok.token_to_id(configured)
            if token_id is None:
                raise TokenizerError(
                    f"{self.path}: configured special token {configured!r} is not in its vocabulary"
                )
            return token_id
        return next((i for i in map(self._tok.token_to_id, names) if i is not None), None)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)


class SentencePieceTokenizer:
    """A SentencePiece `.model` (through the `sentencepiece` package); BOS/EOS as the model defines them."""

    def __init__(self, path: str | Path):
        import sentencepiece as spm

        self.path = Path(path)
        try:
            self._sp = spm.SentencePieceProcessor(model_file=str(self.path))
        except (OSError, RuntimeError) as e:
            raise TokenizerError(f"cannot read SentencePiece model {self.path}: {e}") from e
        self.vocab_size: int = self._sp.get_piece_size()
        self.bos_id = self._sp.bos_id() if self._sp.bos_id() >= 0 else None
        self.eos_id = self._sp.eos_id() if self._sp.eos_id() >= 0 else None

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._sp.encode(list(texts))

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode(list(ids))


def tokenizer_file(path: str | Path) -> Path:
    """The tokenizer file `path` names: itself, or the tokenizer.json / *.model in a directory."""
    path = Path(path)
    if path.is_dir():
        found = [path / "tokenizer.json", *sorted(path.glob("*.model"))]
        found = [p for p in found if p.is_file()]
        if not found:
            raise TokenizerError(f"no tokenizer.json or SentencePiece *.model in directory {path}")
        path = found[0]
    return path


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load `tokenizer.json` (HF) or `*.model` (SentencePiece); a directory may hold either."""
    path = tokenizer_file(path)
    if not path.exists():
        raise TokenizerError(f"tokenizer file not found: {path}")
    if path.suffix == ".json":
        return HFTokenizer(path)
    if path.suffix == ".model":
        return SentencePieceTokenizer(path)
    raise TokenizerError(
        f"unsupported tokenizer file {path}: expected a HF tokenizer.json or a SentencePiece .model"
    )
