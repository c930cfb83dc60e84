"""The data pipeline as TorchTitan components.

TorchTitan's Trainer builds its tokenizer and data loader from configs; these classes plug
FlashCP's pipeline (`flashcp.data.loader`, `flashcp.data.tokenizer`) into those slots (the
checkpointer is `flashcp.titan.components.checkpoint`):

- `PipelineTokenizer`: the pipeline's tokenizer (HF tokenizer.json or SentencePiece) behind
  TorchTitan's tokenizer interface.
- `WindowDataLoader`: one packed window per `next()`, planned for this rank's CP group inside the
  loader (with `[flashcp] scope = "mesh"`, the whole mesh's window of DP x C tokens, `flashcp.titan.mesh_scope`); its state (window counter and document cursor, identical on every rank) is saved in
  every checkpoint, so a resumed run continues with the next unseen window.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.tools.logging import logger

from flashcp.data.loader import build_loader, WindowLoader
from flashcp.data.errors import DataError
from flashcp.data.sources import DEFAULT_TOKENIZER, DataConfig
from flashcp.data.tokenizer import Tokenizer, load_tokenizer


def resolve_tokenizer(name: str) -> Tokenizer:
    """`"default"` (the tokenizer shipped with FlashCP) or a path; TokenizerError if unusable."""
    return load_tokenizer(DEFAULT_TOKENIZER if name == "default" else name)


class PipelineTokenizer(BaseTokenizer):
    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        path: str = "default"

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__()
        self.tokenizer = resolve_tokenizer(config.path)
        self.eos_id = self.tokenizer.eos_id

    def encode(self, text: str, **kwargs: Any) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        return self.tokenizer.decode(ids)

    def get_vocab_size(self) -> int:
        return self.tokenizer.vocab_size


class WindowDataLoader(BaseDataLoader):
    """Yields the pipeline's batch dicts (input, labels, doc_lens, plan, timings)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        data: DataConfig = field(default_factory=DataConfig)
        cp_size: int = 1
        planner: dict[str, Any] = field(default_factory=dict)
        """plan_shards keyword arguments: strategy, target_imbalance."""
        infinite: bool | None = None
        """Repeat the data (`data.loop`) when set; TorchTitan's validator sets it (steps != -1)."""

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer: PipelineTokenizer,
                 seq_len: int, local_batch_size: int, **kwargs: Any) -> None:  # fmt: skip
        if local_batch_size != 1:
            raise DataError(f"the window loader yields one window per micro step, not {local_batch_size}")
        data = config.data if config.infinite is None else replace(config.data, loop=config.infinite)
        self.loader: WindowLoader = build_loader(
            data,
            seq_len,
            dp_rank=dp_rank,
            dp_world=dp_world_size,
            cp_size=config.cp_size,
            planner_kwargs=config.planner,
            tokenizer=tokenizer.tokenizer,
        )
        tok = tokenizer.tokenizer
        logger.info(f"data: {self.loader.source_name}; tokenizer {tok.path} ({tok.vocab_size} tokens)")

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.loader)

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loader.load_state_dict(state_dict)

    def close(self) -> None:
        self.loader.close()
