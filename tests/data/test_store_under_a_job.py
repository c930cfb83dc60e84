"""A token store that changes under a running loader: no changed token reaches a batch, the change
is named with the store and the span, and the loader's `fault` says so as soon as its thread found it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from flashcp.data.errors import DataChanged
from flashcp.data.loader import build_loader
from flashcp.data.prepare import prepare
from flashcp.data.sources import DataConfig

SEQ = 128


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("store")
    corpus = root / "docs.jsonl"
    texts = [f"document {i}: " + " ".join(f"w{(i * 7 + j) % 97}" for j in range(20 + i % 60)) for i in range(200)]
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return prepare(str(corpus), "default", root / "tokens", progress=False)


def loader(path: Path, prefetch: int):
    return build_loader(DataConfig(source=str(path), prefetch=prefetch, balance="off"), SEQ,
                        planner_kwargs={"strategy": "per_doc"})  # fmt: skip


@pytest.mark.parametrize("prefetch", [0, 2])
def test_no_batch_holds_a_changed_token_and_the_change_is_named(tmp_path, store, prefetch):
    """Every token XOR 1 after 3 batches (each chunk has been read by then: the store is one MiB
    chunk): the batches handed out after it are the unchanged store's, up to the first one the loader
    read after the change, which raises DataChanged naming the store and the span; with prefetching
    the producer thread sets `fault` itself (only it reads the store then), before it queues the error.
    The change is written in place: the producer may be reading meanwhile, and a truncating rewrite
    would be a store cut short, another fault with its own line."""
    path = Path(shutil.copytree(store, tmp_path / "tokens"))
    reference = loader(store, 0)
    expected = [next(reference)["input"] for _ in range(12)]
    with loader(path, prefetch) as changing:
        got = [next(changing)["input"] for _ in range(3)]
        tokens = np.fromfile(path / "tokens.bin", dtype=np.uint16)
        with open(path / "tokens.bin", "r+b") as f:  # in place: a truncating rewrite is a different fault
            f.write((tokens ^ 1).tobytes())
        with pytest.raises(DataChanged) as e:
            while True:
                got.append(next(changing)["input"])
    assert 3 <= len(got) <= 3 + prefetch + 1 and all((g == x).all() for g, x in zip(got, expected))
    message = str(e.value)
    assert message.startswith(f"token store {path}: tokens.bin changed under the job: tokens [") and "\n" not in message
    assert "no longer hold what was verified when the job first read them" in message
    if prefetch:
        assert changing.fault is e.value
