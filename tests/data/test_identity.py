"""Data cannot change under a run: a resume with other text under the same file names and row
count, or a tokenizer with other ids but the same size and specials, is refused naming what changed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from flashcp.data.errors import DataError
from flashcp.data.loader import build_loader
from flashcp.data.sources import DEFAULT_TOKENIZER, DataConfig

PLANNER = {"strategy": "per_doc"}


def write_corpus(path: Path, word: str) -> Path:
    path.write_text("".join(json.dumps({"text": f"{word} number {i} " * 20}) + "\n" for i in range(40)))
    return path


def saved_state(cfg: DataConfig) -> dict:
    loader = build_loader(cfg, 64, planner_kwargs=PLANNER)
    next(loader), next(loader)
    return loader.state_dict()


def test_a_source_replaced_by_other_text_of_the_same_name_and_rows_is_refused(tmp_path):
    source = write_corpus(tmp_path / "docs.jsonl", "apple")
    cfg = DataConfig(source=str(source), prefetch=0)
    state = saved_state(cfg)
    write_corpus(source, "pear")
    with pytest.raises(DataError, match=r"its packing changed \(source: saved 'files:sha256:"):
        build_loader(cfg, 64, planner_kwargs=PLANNER).load_state_dict(state)


def test_a_tokenizer_with_other_ids_of_the_same_size_and_specials_is_refused(tmp_path):
    tokenizer = tmp_path / "tok" / "tokenizer.json"
    tokenizer.parent.mkdir()
    shutil.copy(DEFAULT_TOKENIZER, tokenizer)
    cfg = DataConfig(tokenizer=str(tokenizer), prefetch=0)
    state = saved_state(cfg)
    spec = json.loads(tokenizer.read_text())
    vocab = spec["model"]["vocab"]
    a, b = "the", "and"  # swap two ordinary tokens' ids: same size, same BOS / EOS
    vocab[a], vocab[b] = vocab[b], vocab[a]
    tokenizer.write_text(json.dumps(spec))
    with pytest.raises(DataError, match=r"its packing changed \(tokenizer: saved 'tokenizer.json sha256:"):
        build_loader(cfg, 64, planner_kwargs=PLANNER).load_state_dict(state)
