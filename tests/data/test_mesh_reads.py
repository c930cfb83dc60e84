"""Mesh scope from a token store: each rank reads only its own tokens of the DP x C window (and the token
after each run, its label), planned from the document offsets alone, and gets exactly what the whole
window would have given it; a changed byte elsewhere in the store is never read, one in its range is
DataChanged. DP 4 x CP 2 on 2 nodes, C = 64, the store re-chunked to 32 tokens per checksum."""

from __future__ import annotations

import functools
import json
import shutil
import zlib
from pathlib import Path

import numpy as np
import pytest

from flashcp.data.errors import DataChanged
from flashcp.data.loader import build_loader, WindowLoader
from flashcp.data.prepare import prepare
from flashcp.data.sources import DataConfig
from flashcp.data.store import TokenStore
from flashcp.dispatch import build_dispatch
from flashcp.plan.mesh import plan_mesh

C, DP, CP, CHUNK = 64, 4, 2, 64  # CHUNK bytes: 32 uint16 ids per checksum, so ranks' ranges lie in other chunks
WINDOWS = 3


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("store")
    corpus = root / "docs.jsonl"
    texts = [f"document {i}: " + " ".join(f"w{(i * 7 + j) % 97}" for j in range(5 + (i * 37) % 150)) for i in range(120)]
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    path = prepare(str(corpus), "default", root / "tokens", progress=False)
    data = (path / "tokens.bin").read_bytes()
    np.save(path / "checksums.npy", np.array([zlib.crc32(data[i : i + CHUNK]) for i in range(0, len(data), CHUNK)],
                                             dtype=np.uint32))  # fmt: skip
    manifest = json.loads((path / "manifest.json").read_text())
    (path / "manifest.json").write_text(json.dumps({**manifest, "chunk_bytes": CHUNK}))
    return path


def mesh_loader(path: Path, rank: int | None) -> WindowLoader:
    """The mesh loader of mesh rank `rank` (None: no dispatch, so the whole window)."""
    loader = build_loader(DataConfig(source=str(path), prefetch=0, balance="off"), C, cp_size=CP)
    loader.mesh_with(DP, functools.partial(plan_mesh, dp=DP, cp=CP, ranks_per_node=4))
    if rank is not None:
        loader.dispatch_with(functools.partial(build_dispatch, rank=rank, comm="needed"))
    return loader


@pytest.fixture
def reads(monkeypatch) -> list[tuple[int, int]]:
    """The token-file ranges [start, stop) read from now on."""
    done: list[tuple[int, int]] = []
    read = TokenStore.read

    def recording(self, i, lo=0, hi=None):
        got = read(self, i, lo, hi)
        done.append((int(self.offsets[i]) + lo, int(self.offsets[i]) + lo + len(got)))
        return got

    monkeypatch.setattr(TokenStore, "read", recording)
    return done


def test_every_rank_gets_the_whole_windows_tokens_and_labels_reading_its_own(store, reads):
    loader = mesh_loader(store, None)
    whole = [next(loader) for _ in range(WINDOWS)]
    assert any(int(w["labels"][-1]) != -100 for w in whole)  # a document carried into the next window
    for w in whole:  # a document across a DP boundary inside every window
        starts = np.concatenate(([0], np.cumsum(w["doc_lens"])))
        assert any(s < k * C < e for k in range(1, DP) for s, e in zip(starts[:-1], starts[1:]))
    for rank in range(DP * CP):
        reads.clear()
        mine = mesh_loader(store, rank)
        for w in whole:
            b = next(mine)
            index = b["dispatch"].token_index
            assert b["input"].tolist() == w["input"][index].tolist()
            assert b["labels"].tolist() == w["labels"][index].tolist()
            assert b["doc_lens"] == w["doc_lens"] and b["window"] == w["window"]
            assert b["valid_labels"] == w["valid_labels"] == (w["labels"].view(DP, C) != -100).sum(1).tolist()
        read = sum(hi - lo for lo, hi in reads)
        assert 0 < read <= WINDOWS * (C // CP) * 2  # its shards and a label token per run, not the 3 x DP x C
        assert mine.state_dict() == loader.state_dict()


def change(store: Path, at: int, where: Path) -> Path:
    """A copy of the store with token `at` changed in place."""
    path = Path(shutil.copytree(store, where))
    tokens = np.memmap(path / "tokens.bin", dtype=np.uint16, mode="r+")
    tokens[at] ^= 1
    tokens.flush()
    return path


def test_a_change_outside_the_ranks_range_is_not_read_inside_it_is_data_changed(store, reads, tmp_path):
    rank = 5
    expected = next(mesh_loader(store, rank))
    ours = list(reads)
    chunks = {t * 2 // CHUNK for lo, hi in ours for t in range(lo, hi)}  # checked whole at their first read
    reads.clear()
    next(mesh_loader(store, 1))  # another DP group's rank
    theirs = [t for lo, hi in reads for t in range(lo, hi) if t * 2 // CHUNK not in chunks]
    assert theirs
    got = next(mesh_loader(change(store, theirs[0], tmp_path / "theirs"), rank))
    assert got["input"].tolist() == expected["input"].tolist() and got["labels"].tolist() == expected["labels"].tolist()
    with pytest.raises(DataChanged, match="tokens.bin changed since it was prepared"):
        next(mesh_loader(change(store, ours[0][0], tmp_path / "ours"), rank))
