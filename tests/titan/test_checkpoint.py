"""Checkpoints are published whole, never rewritten in place, verified before loading, and a
damaged newest checkpoint falls back to the newest one that loads."""

from __future__ import annotations

import json
import pickle
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch.distributed.checkpoint as dcp
from harness import single_rank, tiny_job, train

from flashcp.titan.components.checkpoint import CheckpointError
from flashcp.run.manifest import checksum, MANIFEST, read_manifest, verify_files


@pytest.fixture
def rank():
    with single_rank():
        yield


def job(dump: Path, **checkpoint):
    """The tiny job for 6 steps with a checkpoint every 3."""
    return tiny_job(dump, training={"steps": 6}, checkpoint={"enable": True, "interval": 3, "keep_latest_k": 0,
                                                            **checkpoint})  # fmt: skip


def data_file(step_dir: Path) -> Path:
    return step_dir / "__0_0.distcp"


def flip_bytes(path: Path, offset: int = 4096) -> None:
    """Overwrite a few bytes in place (same size), as a bad disk or a stray write would."""
    with open(path, "r+b") as f:
        f.seek(offset)
        old = f.read(8)
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in old))


class Killed(BaseException):
    """Stands in for the process dying in the middle of a save."""


def test_a_rewind_sets_newer_checkpoints_aside_and_a_save_killed_there_leaves_them_whole(tmp_path, rank, monkeypatch):
    dump = tmp_path / "run"
    whole = train(job(dump))
    old_manifest = read_manifest(dump / "checkpoint/step-6")
    real_save = dcp.save

    def dying_save(state_dict, *, checkpoint_id, **kwargs):
        real_save(state_dict, checkpoint_id=checkpoint_id, **kwargs)
        data = data_file(Path(checkpoint_id))
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])  # cut mid-write
        raise Killed

    monkeypatch.setattr(dcp, "save", dying_save)
    with pytest.raises(Killed):
        train(job(dump, load_step=3))  # re-trains 4..6 and dies saving step 6
    monkeypatch.undo()
    (aside,) = (dump / "checkpoint/set-aside").iterdir()
    assert aside.name.startswith("after-step-3.") and read_manifest(aside / "step-6") == old_manifest  # untouched
    assert any(p.name.startswith("step-6.partial-") for p in (dump / "checkpoint").iterdir())
    with single_rank():
        assert train(job(dump)) == {s: whole[s] for s in (4, 5, 6)}  # the new branch, from step 3


def test_a_rewind_point_survives_retention_and_a_plain_resume_continues_its_branch(tmp_path, rank, caplog):
    dump = tmp_path / "run"

    def ten_steps(**checkpoint):
        return tiny_job(dump, training={"steps": 10}, checkpoint={"enable": True, "interval": 5, "keep_latest_k": 2,
                                                                  **checkpoint})  # fmt: skip

    train(ten_steps())
    train(ten_steps(load_step=5, interval=1), stop_after=6)  # preempted at 6 after saving it
    assert "load_step = 5 starts a new branch: the newer checkpoints (step-10) were moved to" in caplog.text
    folder = dump / "checkpoint"
    assert sorted(p.name for p in folder.iterdir()) == ["set-aside", "step-5", "step-6"]
    assert [p.name for p in folder.glob("set-aside/after-step-5.*/*")] == ["step-10"]  # moved, not deleted
    with single_rank():
        assert sorted(train(ten_steps())) == [7, 8, 9, 10]  # the new branch, not the abandoned step 10


def test_a_kill_between_the_two_renames_keeps_the_replaced_checkpoint_loadable(tmp_path, rank):
    def eight_steps(dump: Path) -> dict:
        return tiny_job(dump, training={"steps": 8}, checkpoint={"enable": True, "interval": 3})

    whole = train(eight_steps(tmp_path / "whole"))
    dump = tmp_path / "run"
    train(eight_steps(dump), stop_after=6)
    folder = dump / "checkpoint"
    (folder / "step-6").rename(folder / "step-6.replaced-0123456789ab")
    resumed = train(eight_steps(dump))
    assert resumed == {s: whole[s] for s in (7, 8)}  # resumed from step 6 under its other name
    # It is the only copy of step 6, so the purge after the save of step 8 keeps it.
    assert (folder / "step-6.replaced-0123456789ab").is_dir() and (folder / "step-8").is_dir()


def test_changed_bytes_fall_back_to_the_newest_intact_checkpoint(tmp_path, rank, caplog):
    dump = tmp_path / "run"
    whole = train(job(dump))
    flip_bytes(data_file(dump / "checkpoint/step-6"))
    resumed = train(job(dump, load_step=-1) | {"training": job(dump)["training"] | {"steps": 6}})
    assert resumed == {s: whole[s] for s in (4, 5, 6)}  # from step 3, bit for bit
    assert "step-6 is damaged: __0_0.distcp: contents changed since the save (checksum mismatch)" in caplog.text


def test_an_explicitly_chosen_damaged_checkpoint_is_an_error_naming_the_file(tmp_path, rank):
    dump = tmp_path / "run"
    train(job(dump))
    shutil.copy(data_file(dump / "checkpoint/step-3"), data_file(dump / "checkpoint/step-6"))  # another save's file
    with pytest.raises(CheckpointError, match=r"step-6 is damaged: __0_0.distcp: (\d+ bytes, the save wrote|contents)"):
        train(job(dump, load_step=6))
    (dump / "checkpoint/step-3/__0_1.distcp").write_bytes(b"stray")
    with pytest.raises(CheckpointError, match=r"step-3 is damaged: __0_1.distcp: not written by this save"):
        train(job(dump, load_step=3))


def test_a_malformed_manifest_is_a_damaged_checkpoint_skipped_with_one_line(tmp_path, rank, caplog):
    dump = tmp_path / "run"
    whole = train(job(dump))
    manifest = json.loads((dump / "checkpoint/step-6" / MANIFEST).read_text())
    (dump / "checkpoint/step-6" / MANIFEST).write_text(json.dumps([manifest]))  # JSON, but a list
    resumed = train(job(dump, load_step=-1) | {"training": job(dump)["training"] | {"steps": 6}})
    assert resumed == {s: whole[s] for s in (4, 5, 6)}  # from step 3, bit for bit
    assert "step-6 is damaged: manifest.json: malformed (a JSON list, not an object)" in caplog.text


@pytest.mark.parametrize("edit, problem", [
    (lambda m: [m], "malformed (a JSON list, not an object)"),
    (lambda m: 7, "malformed (a JSON int, not an object)"),
    (lambda m: m | {"format": 2}, "unknown format 2"),
    (lambda m: m | {"files": {"a": 1}}, "malformed (files is dict, not a list)"),
    (lambda m: m | {"files": ["__0_0.distcp"]}, "malformed (files[0] is a JSON str, not an object)"),
    (lambda m: m | {"files": [{"size": 1, "checksum": "crc32:0"}]}, "files[0].name = None is not a file name"),
    (lambda m: m | {"files": [{"name": "../x", "size": 1, "checksum": "crc32:0"}]}, "name = '../x' is not a"),
    (lambda m: m | {"files": [{"name": "a", "checksum": "crc32:0"}]}, "files[0] a: size = None is not a byte count"),
    (lambda m: m | {"files": [{"name": "a", "size": "1", "checksum": "c"}]}, "size = '1' is not a byte count"),
    (lambda m: m | {"files": [{"name": "a", "size": True, "checksum": "c"}]}, "size = True is not a byte count"),
    (lambda m: m | {"files": [{"name": "a", "size": 1, "checksum": 5}]}, "checksum = 5 is not a string"),
])  # fmt: skip
def test_read_manifest_names_every_malformed_manifest(tmp_path, edit, problem):
    good = {"format": 1, "save_id": "x", "files": [{"name": "a", "size": 1, "checksum": "crc32:0", "rank": 0}]}
    (tmp_path / MANIFEST).write_text(json.dumps(good))
    assert read_manifest(tmp_path) == good
    (tmp_path / MANIFEST).write_text(json.dumps(edit(good)))
    manifest = read_manifest(tmp_path)
    assert manifest["files"] == [] and manifest["problem"].startswith("manifest.json: ")
    assert problem in manifest["problem"], manifest["problem"]
    assert verify_files(tmp_path, manifest, 0, 1) == [manifest["problem"]]
    assert verify_files(tmp_path, manifest, 1, 2) == []  # rank 0 reports it; the ranks then agree


def test_every_checkpoint_damaged_is_an_error_not_a_fresh_start(tmp_path, rank):
    dump = tmp_path / "run"
    train(job(dump))
    for step in (3, 6):
        (dump / f"checkpoint/step-{step}" / MANIFEST).write_text("{not json")
    with pytest.raises(CheckpointError, match=r"step-3 is damaged: manifest.json: unreadable .*newer ones were skipped"):
        train(job(dump))


@pytest.mark.parametrize("make, message", [
    (lambda p: None, "does not exist"),
    (lambda p: p.mkdir(), r"not a DCP checkpoint \(no .metadata\)"),
    (lambda p: p.write_text("x"), "is not a folder"),
])  # fmt: skip
def test_a_bad_initial_load_path_is_named(tmp_path, rank, make, message):
    path = tmp_path / "seed"
    make(path)
    with pytest.raises(CheckpointError, match=f"checkpoint.initial_load_path {path}: {message}"):
        train(tiny_job(tmp_path / "run", checkpoint={"enable": True, "initial_load_path": str(path)}))


def test_interrupted_saves_are_ignored_and_cleaned_by_the_next_save(tmp_path, rank):
    dump = tmp_path / "run"
    stale = dump / "checkpoint/step-9.partial-0123456789ab"
    stale.mkdir(parents=True)
    (stale / ".metadata").write_bytes(b"half")
    train(job(dump, keep_latest_k=2))
    names = sorted(p.name for p in (dump / "checkpoint").iterdir())
    assert names == ["step-3", "step-6"]
    assert all((dump / "checkpoint" / n / MANIFEST).is_file() for n in names)


def test_keep_latest_k_holds_after_the_final_save(tmp_path, rank):
    dump = tmp_path / "run"
    train(tiny_job(dump, training={"steps": 9}, checkpoint={"enable": True, "interval": 3, "keep_latest_k": 2}))
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == ["step-6", "step-9"]


def test_an_async_save_is_published_once_complete_and_resumes_exactly(tmp_path, rank):
    def six_steps(dump: Path) -> dict:
        return tiny_job(dump, training={"steps": 6}, checkpoint={"enable": True, "interval": 2,
                                                                 "async_mode": "async"})  # fmt: skip

    whole = train(six_steps(tmp_path / "whole"))
    assert all((tmp_path / f"whole/checkpoint/step-{s}" / MANIFEST).is_file() for s in (2, 4, 6))
    dump = tmp_path / "run"
    train(six_steps(dump), stop_after=5)  # step 4's save is still unpublished when the run ends
    assert not (dump / "checkpoint/step-4").exists()
    assert (dump / "checkpoint/step-2" / MANIFEST).is_file()
    resumed = train(six_steps(dump))
    assert resumed == {s: whole[s] for s in (3, 4, 5, 6)}
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == ["step-2", "step-4", "step-6"]


class RunsCode:
    """Unpickled, it would create `marker`: what a crafted checkpoint file does."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').close()",)


def rehash(step_dir: Path) -> None:
    """Recompute the manifest's sizes and CRCs, as an attacker would."""
    manifest = read_manifest(step_dir)
    for entry in manifest["files"]:
        entry["size"], entry["checksum"] = (step_dir / entry["name"]).stat().st_size, checksum(step_dir / entry["name"])
    (step_dir / MANIFEST).write_text(json.dumps(manifest))


def test_a_crafted_metadata_pickle_is_refused_and_runs_nothing(tmp_path, rank):
    dump, marker = tmp_path / "run", tmp_path / "marker"
    train(job(dump))
    step = dump / "checkpoint/step-6"
    (step / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    rehash(step)
    with pytest.raises(CheckpointError, match=r"step-6/.metadata asks to build builtins.exec, which DCP never writes"):
        train(job(dump))
    # The same file through initial_load_path, its manifest removed and unverified loading allowed.
    (step / MANIFEST).unlink()
    seeded = tiny_job(tmp_path / "other", checkpoint={"enable": True, "initial_load_path": str(step),
                                                      "load_unverified": True})  # fmt: skip
    with pytest.raises(CheckpointError, match=r"asks to build builtins.exec"):
        train(seeded)
    assert not marker.exists()


def test_a_crafted_loader_state_item_is_refused_and_runs_nothing(tmp_path, rank, monkeypatch):
    from flashcp.data.loader import WindowLoader

    dump, marker = tmp_path / "run", tmp_path / "marker"
    real = WindowLoader.state_dict
    monkeypatch.setattr(WindowLoader, "state_dict", lambda self: {**real(self), "window": RunsCode(marker)})
    train(job(dump))  # every save stores the object's pickle as the loader's `window`
    monkeypatch.undo()
    with pytest.raises(CheckpointError, match=r"item dataloader.window is not plain data .*refused, nothing of it was run"):
        train(job(dump))
    assert not marker.exists()


@pytest.mark.parametrize("removed", [MANIFEST, ".metadata"])
def test_a_newest_checkpoint_without_manifest_or_metadata_is_damaged_not_loaded(tmp_path, rank, caplog, removed):
    dump = tmp_path / "run"
    whole = train(job(dump))
    flip_bytes(data_file(dump / "checkpoint/step-6"))
    (dump / "checkpoint/step-6" / removed).unlink()
    if removed == MANIFEST:  # named explicitly, it loads only when the option says it is unverified
        with pytest.raises(CheckpointError, match="no manifest.json.*set checkpoint.load_unverified = true"):
            train(job(dump, load_step=6))
    assert train(job(dump)) == {s: whole[s] for s in (4, 5, 6)}  # from step 3, the newest verified one
    assert f"skipping checkpoint {dump / 'checkpoint/step-6'} is damaged: no {removed}" in caplog.text


def test_a_checkpoint_of_another_model_size_is_refused_naming_the_keys(tmp_path, rank):
    dump = tmp_path / "run"
    train(job(dump))
    smaller = tiny_job(dump, training={"steps": 9}, checkpoint={"enable": True, "interval": 3},
                       model={"n_layers": 1})  # fmt: skip
    with pytest.raises(CheckpointError, match=r"step-6 does not fit this job .*the checkpoint holds "
                                              r"optimizer.state.layers.1.\S+ \[\], \S+ \[64, 32\] \(and \d+ more\) which"):
        train(smaller)
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == ["step-3", "step-6"]  # nothing saved over it


def test_a_state_whose_loss_is_not_finite_is_not_published(tmp_path, rank, monkeypatch):
    from torchtitan.trainer import Trainer

    real = Trainer.forward_backward_step

    def diverging(self, **kwargs):  # TorchTitan's step, its loss infinite at step 5
        loss = real(self, **kwargs)
        return loss * float("inf") if self.step == 5 else loss

    monkeypatch.setattr(Trainer, "forward_backward_step", diverging)
    dump = tmp_path / "run"
    with pytest.raises(CheckpointError, match=r"not saving step-6: the loss was not finite .* up to 6"):
        train(job(dump) | {"metrics": {"log_freq": 100}})  # no logging step catches it first
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == ["step-3"]


def test_no_checkpoint_is_published_once_the_data_changed_under_the_job(tmp_path, rank, monkeypatch):
    """Every token of the store XOR 1 after step 4. The loader's thread, reading ahead, finds it while
    step 5 trains (the test waits for that, so the verdict does not depend on timing); steps 5 and 6
    still train the unchanged tokens they read before, but step 6's checkpoint is refused with the
    store and the span, and nothing after step 3 is published."""
    from flashcp.data.errors import DataChanged
    from flashcp.data.prepare import prepare
    from flashcp.titan.trainer import FlashCPTrainer

    corpus = tmp_path / "docs.jsonl"
    texts = [f"document {i}: " + " ".join(f"w{(i * 7 + j) % 97}" for j in range(20 + i % 60)) for i in range(300)]
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    store = prepare(str(corpus), "default", tmp_path / "tokens", progress=False)
    real = FlashCPTrainer.train_step

    def changing_store(self, data_iterator):
        real(self, data_iterator)
        if self.step == 4:
            tokens = np.fromfile(store / "tokens.bin", dtype=np.uint16)
            (tokens ^ 1).tofile(store / "tokens.bin")
        if self.step == 5:  # only catches a hang: the thread reads the next window once step 5 took its batch
            deadline = time.monotonic() + 120
            while self.dataloader.loader.fault is None and time.monotonic() < deadline:
                time.sleep(0.01)

    monkeypatch.setattr(FlashCPTrainer, "train_step", changing_store)
    dump = tmp_path / "run"
    cfg = tiny_job(dump, training={"steps": 6}, checkpoint={"enable": True, "interval": 3, "keep_latest_k": 0},
                   data={"source": str(store), "prefetch": 2})  # fmt: skip
    with pytest.raises(DataChanged, match=rf"^not saving step-6: token store {store}: tokens.bin changed under the "
                                          r"job: tokens \[[\d,]+, [\d,]+\) \(bytes .*the newest checkpoint is the "
                                          "last sound state$"):  # fmt: skip
        train(cfg)
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == ["step-3"]
