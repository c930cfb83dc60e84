"""The data pipeline and checkpoints as TorchTitan components.

TorchTitan's Trainer builds its tokenizer, data loader and checkpointer from configs; these
classes plug FlashCP's pipeline (`flashcp.titan.data`, `flashcp.titan.tokenizer`) into those
slots and make checkpoint failures readable:

- `PipelineTokenizer`: the pipeline's tokenizer (HF tokenizer.json or SentencePiece) behind
  TorchTitan's tokenizer interface.
- `WindowDataLoader`: one packed window per `next()`, planned for this rank's CP group inside the
  loader; its state (window counter and document cursor, identical on every rank) is saved in
  every checkpoint, so a resumed run continues with the next unseen window.
- `Checkpointer`: TorchTitan's DCP checkpoint manager; a step folder counts as a checkpoint only
  once DCP has renamed its `.metadata` into place (written last, after every rank's data), so a
  save interrupted midway is skipped; a missing or mismatched checkpoint raises CheckpointError.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch.distributed.checkpoint.api as dcp_api
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.tools.logging import logger

from flashcp.titan.data import build_loader, WindowLoader
from flashcp.titan.sources import DEFAULT_TOKENIZER, DataConfig, DataError
from flashcp.titan.tokenizer import Tokenizer, load_tokenizer


class CheckpointError(RuntimeError):
    """A checkpoint to resume from is missing, incomplete or does not fit this job."""


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

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer: PipelineTokenizer,
                 seq_len: int, local_batch_size: int, **kwargs: Any) -> None:  # fmt: skip
        if local_batch_size != 1:
            raise DataError(f"the window loader yields one window per micro step, not {local_batch_size}")
        self.loader: WindowLoader = build_loader(
            config.data,
            seq_len,
            dp_rank=dp_rank,
            dp_world=dp_world_size,
            cp_size=config.cp_size,
            planner_kwargs=config.planner,
            tokenizer=tokenizer.tokenizer,
        )

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.loader)

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loader.load_state_dict(state_dict)

    def close(self) -> None:
        self.loader.close()


class Checkpointer(CheckpointManager):
    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        pass

    def _step_folders(self) -> dict[int, bool]:
        if not os.path.isdir(self.folder):
            return {}
        found = {}
        for name in os.listdir(self.folder):
            match = re.fullmatch(r"step-(\d+)", name)
            if match:
                found[int(match.group(1))] = os.path.isfile(os.path.join(self.folder, name, ".metadata"))
        return found

    def _load(self, step: int = -1) -> bool:
        folders = self._step_folders()
        complete = sorted(s for s, ok in folders.items() if ok)
        if step != -1 and not folders.get(step, False):
            state = "is incomplete (its save was interrupted)" if step in folders else "does not exist"
            raise CheckpointError(
                f"checkpoint.load_step = {step}: {os.path.join(self.folder, f'step-{step}')} {state}; "
                f"complete checkpoints: {complete or 'none'}"
            )
        latest = complete[-1] if complete else -1
        for s in sorted(s for s, ok in folders.items() if not ok and s > latest):
            logger.warning(f"skipping checkpoint step-{s}: incomplete (its save was interrupted)")
        try:
            return super()._load(step)
        except (DataError, CheckpointError):
            raise
        except (Exception, dcp_api.CheckpointException) as e:  # the latter is a BaseException
            target = step if step != -1 else latest
            raise CheckpointError(
                f"checkpoint {os.path.join(self.folder, f'step-{target}')} does not fit this job "
                f"(different model or optimizer?): {_root_cause(e)}"
            ) from e


def _root_cause(e: BaseException) -> str:
    """The first rank's underlying error of a DCP failure, in one line."""
    if isinstance(e, dcp_api.CheckpointException) and e.failures:
        e = next(iter(e.failures.values()))[0]
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__
