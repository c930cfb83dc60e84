"""The files an HF export carries and an HF import reads are the folder's own regular files.

An export is made to be published: a tokenizer-side file of the source folder (or beside the job's
tokenizer) that is a symbolic link out of the folder (to a system file, a 0600 secret, another
job's node token), a fifo, a folder or a sparse 1 GiB file is refused by name, before the weights
are read, by the export command, by the export at the end of a run (checked at launch) and by the
import's checks; links inside the folder and a hub cache snapshot's links into its `blobs/` are
followed. A generation_config.json that transformers could not use (non-finite numbers, wrong
types) is refused naming the key. What is exported is written anew with a new file's permissions
and loads in transformers with its GenerationConfig.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the test extra (pip install -e .[test]) provides transformers")
from titan.harness import load_export  # noqa: E402
from titan.test_hf_checkpoint import GENERATION, hf_job, negligible_step, tiny_llama  # noqa: E402, F401

from flashcp.titan.config import ConfigError  # noqa: E402
from flashcp.titan.export import main as export_main  # noqa: E402
from flashcp.titan.launch.preflight import check_inputs  # noqa: E402

SIDE = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def _source(tiny_llama: Path, folder: Path) -> Path:
    """A folder holding the tiny Llama's tokenizer-side files (an export reads no weights from it)."""
    folder.mkdir(parents=True)
    for name in SIDE:
        shutil.copy(tiny_llama / name, folder / name)
    return folder


def _checkpoint_from(negligible_step: Path, tmp_path: Path, source: Path, tokenizer: Path) -> Path:
    """A copy of the checkpoint whose manifest names `source` as the HF folder and `tokenizer`."""
    copy = tmp_path / "step-1"
    shutil.copytree(negligible_step, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["model"] |= {"hf_folder": str(source), "tokenizer": str(tokenizer)}
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


def _secret(tmp_path: Path) -> Path:
    secret = tmp_path / "private" / "key"
    secret.parent.mkdir()
    secret.write_text("SECRET-KEY-0123")
    secret.chmod(0o600)
    return secret


def _bad_source(tmp_path: Path, source: Path, case: str) -> tuple[Path, str]:
    """Make `case` in `source`; (the tokenizer the manifest names, the file the refusal names)."""
    tokenizer = source / "tokenizer.json"
    if case == "link to a system file":
        (source / "chat_template.jinja").unlink()
        (source / "chat_template.jinja").symlink_to("/etc/hostname")
        return tokenizer, "chat_template.jinja is a symbolic link to /etc/hostname, outside"
    if case == "link to a 0600 secret":
        (source / "added_tokens.json").symlink_to(_secret(tmp_path))
        return tokenizer, "added_tokens.json is a symbolic link to"
    if case == "relative link out":
        _secret(tmp_path)
        (source / "spiece.model").symlink_to(Path("..") / "private" / "key")
        return tokenizer, "spiece.model is a symbolic link to"
    if case == "link to a node token":
        token = tmp_path / "other-job" / ".flashcp-node-token"
        token.parent.mkdir()
        token.write_bytes(os.urandom(32))
        (source / "special_tokens_map.json").symlink_to(token)
        return tokenizer, "special_tokens_map.json is a symbolic link to"
    if case == "link beside the job's tokenizer":
        job = _source(source.parent / "tiny", tmp_path / "job-tokenizer")
        (job / "tokenizer_config.json").unlink()
        (job / "tokenizer_config.json").symlink_to(_secret(tmp_path))
        return job / "tokenizer.json", "job-tokenizer/tokenizer_config.json is a symbolic link to"
    if case == "sparse 1 GiB vocab.txt":
        with open(source / "vocab.txt", "wb") as f:
            f.truncate(1 << 30)
        return tokenizer, "vocab.txt is 1,073,741,824 bytes, more than the 67,108,864 bytes"
    if case == "fifo":
        os.mkfifo(source / "merges.txt")
        return tokenizer, "merges.txt is a fifo, not a regular file"
    if case == "folder":
        (source / "vocab.json").mkdir()
        return tokenizer, "vocab.json is a folder, not a regular file"
    raise AssertionError(case)


BAD_SOURCES = ["link to a system file", "link to a 0600 secret", "relative link out", "link to a node token",
               "link beside the job's tokenizer", "sparse 1 GiB vocab.txt", "fifo", "folder"]  # fmt: skip


@pytest.mark.parametrize("case", BAD_SOURCES)
def test_the_export_refuses_a_side_file_that_is_not_the_folders_own(negligible_step, tiny_llama, tmp_path,
                                                                      capsys, case):  # fmt: skip
    source = _source(tiny_llama, tmp_path / "source")
    shutil.copytree(source, tmp_path / "tiny")  # an intact copy, for the job tokenizer's folder
    tokenizer, named = _bad_source(tmp_path, source, case)
    checkpoint = _checkpoint_from(negligible_step, tmp_path, source, tokenizer)
    assert export_main(["--checkpoint", str(checkpoint), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and named in err, err
    assert "SECRET" not in err and not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", ["link to a system file", "link to a node token", "fifo"])
def test_a_run_that_exports_at_its_end_is_refused_at_launch(tiny_llama, tmp_path, case):
    """`last_save_in_hf`: the files the export would refuse after training are named before it starts."""
    source = tmp_path / "source"
    shutil.copytree(tiny_llama, source)
    shutil.copytree(source, tmp_path / "tiny")
    tokenizer, named = _bad_source(tmp_path, source, case)
    cfg = hf_job(tmp_path / "run", source, checkpoint={"last_save_in_hf": True},
                 data={"tokenizer": str(tokenizer)})  # fmt: skip
    with pytest.raises(ConfigError, match=r"^\[checkpoint\] last_save_in_hf: ") as e:
        check_inputs(cfg)
    assert named in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("content, named", [
    ('{"temperature": NaN, "do_sample": true}', "temperature = NaN is not a finite number"),
    ('{"top_p": Infinity}', "top_p = Infinity is not a finite number"),
    ('{"sampling": {"scale": -Infinity}}', 'sampling = {"scale": -Infinity} is not a finite number'),
    ('{"temperature": "hot"}', 'temperature = "hot" is not a number'),
    ('{"temperature": 0}', "temperature = 0 is not positive"),
    ('{"top_p": 1.5}', "top_p = 1.5 is not in [0, 1]"),
    ('{"max_new_tokens": -5}', "max_new_tokens = -5 is not a positive integer"),
    ('{"top_k": 2.5}', "top_k = 2.5 is not a non-negative integer"),
    ('{"pad_token_id": true}', "pad_token_id = true is not a token id"),
    ('{"eos_token_id": "x"}', 'eos_token_id = "x" is not a token id or a non-empty list of token ids'),
    ('{"eos_token_id": [1, "x"]}', 'eos_token_id = [1, "x"] is not a token id'),
    ('{"do_sample": "yes"}', 'do_sample = "yes" is not true or false'),
    ('[1, 2]', "holds a JSON list, not an object"),
    ('{"temperature": 0.6', "is not valid JSON"),
])  # fmt: skip
def test_a_generation_config_transformers_cannot_use_is_refused_naming_the_key(negligible_step, tiny_llama,
                                                                                 tmp_path, capsys, content,
                                                                                 named):  # fmt: skip
    source = _source(tiny_llama, tmp_path / "source")
    (source / "generation_config.json").write_text(content)
    checkpoint = _checkpoint_from(negligible_step, tmp_path, source, source / "tokenizer.json")
    assert export_main(["--checkpoint", str(checkpoint), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {source / 'generation_config.json'}") and err.count("\n") == 1, err
    assert named in err and not (tmp_path / "out").exists(), err


def test_links_inside_the_folder_and_a_hub_snapshot_are_followed_and_written_anew(negligible_step, tiny_llama,
                                                                                    tmp_path):  # fmt: skip
    """A hub cache snapshot links every file into `blobs/`; a link inside the folder stays inside; a
    0600 file of the folder is exported as a new file (the umask's permissions), not a copy of its mode."""
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot, blobs = repo / "snapshots" / "0123abcd", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for name in SIDE:
        shutil.copy(tiny_llama / name, blobs / f"sha-{name}")
        (snapshot / name).symlink_to(Path("..") / ".." / "blobs" / f"sha-{name}")
    (blobs / "sha-generation_config.json").write_text(json.dumps(GENERATION | {"top_k": None, "pad_token_id": None}))
    (snapshot / "templates").mkdir()
    (snapshot / "templates" / "chat.json").write_text('{"chat_template": "{{ messages }}"}')
    (snapshot / "chat_template.json").symlink_to(Path("templates") / "chat.json")
    (blobs / "sha-tokenizer_config.json").chmod(0o600)
    checkpoint = _checkpoint_from(negligible_step, tmp_path, snapshot, snapshot / "tokenizer.json")
    out = tmp_path / "out"
    assert export_main(["--checkpoint", str(checkpoint), "--out", str(out)]) == 0
    for name in (*SIDE[:3], "chat_template.json"):
        assert not (out / name).is_symlink() and (out / name).read_bytes() == (snapshot / name).read_bytes(), name
    umask = os.umask(0)
    os.umask(umask)
    assert {stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()} == {0o666 & ~umask}
    unset = {"top_k": None, "pad_token_id": None}  # null: unset, kept
    assert json.loads((out / "generation_config.json").read_text()) == GENERATION | unset | {"eos_token_id": [1, 7]}
    load_export(out)


def _import_case(tiny_llama: Path, tmp_path: Path, case: str) -> tuple[Path, str | None]:
    """An HF folder to import, with `case` made in it; the file the refusal names (None: accepted)."""
    if case == "hub snapshot":
        repo = tmp_path / "hub" / "models--org--tiny"
        folder, blobs = repo / "snapshots" / "0123abcd", repo / "blobs"
        shutil.copytree(tiny_llama, blobs)
        folder.mkdir(parents=True)
        for path in blobs.iterdir():
            (folder / path.name).symlink_to(Path("..") / ".." / "blobs" / path.name)
        return folder, None
    folder = tmp_path / "hf"
    shutil.copytree(tiny_llama, folder)
    if case == "config.json linked out":
        shutil.move(folder / "config.json", tmp_path / "config.json")
        (folder / "config.json").symlink_to(tmp_path / "config.json")
        return folder, "config.json is a symbolic link to"
    if case == "weights linked out":
        shutil.move(folder / "model.safetensors", tmp_path / "model.safetensors")
        (folder / "model.safetensors").symlink_to(tmp_path / "model.safetensors")
        return folder, "model.safetensors is a symbolic link to"
    if case == "weights a fifo":
        (folder / "model.safetensors").unlink()
        os.mkfifo(folder / "model.safetensors")
        return folder, "model.safetensors is a fifo, not a regular file"
    if case == "index a fifo":
        (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
        os.mkfifo(folder / "model.safetensors.index.json")
        return folder, "model.safetensors.index.json is a fifo, not a regular file"
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["hub snapshot", "config.json linked out", "weights linked out", "weights a fifo",
                                  "index a fifo"])  # fmt: skip
def test_an_import_reads_only_the_folders_own_regular_files(tiny_llama, tmp_path, case):
    """Refused at launch naming the file (a fifo would have blocked the check); a hub snapshot imports."""
    folder, named = _import_case(tiny_llama, tmp_path, case)
    if named is None:
        check_inputs(hf_job(tmp_path / "run", folder))
        return
    with pytest.raises(ConfigError) as e:  # config.json is read by the job's check, the weights at launch
        check_inputs(hf_job(tmp_path / "run", folder))
    assert named in str(e.value) and "\n" not in str(e.value)
