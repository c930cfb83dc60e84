"""The dry run of a job whose files this machine lacks (`flashcp.titan.dryrun.standin`): the shipped
tokenizer, synthetic documents of the job's lengths and no validation or loading stand in, one line each.

Every shipped job's files are resolved here (its tokenizer, first documents and held-out data opened
as the launcher's pre-flight opens them), which costs seconds; the full dry run is that of a tiny job
with every file absent, which must measure what the same job measures with the stand-ins given as
overrides. `python -m flashcp.titan.dryrun --config qwen3_30b_a3b_128k --world-size 16` itself takes
minutes (docs/dryrun.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flashcp.titan.config import CONFIG_DIR, load_job, resolve_config_path
from flashcp.titan.dryrun import cli
from flashcp.titan.dryrun.standin import absent, with_stand_ins
from flashcp.titan.launch.preflight import check_inputs

from tests.titan.test_dryrun import JOB
from tests.titan.test_hf_config import hf_folder, LLAMA31_8B

SHIPPED = sorted(path.stem for path in CONFIG_DIR.glob("*.toml"))
NOWHERE = "/nonexistent/flashcp-dryrun"


def _job(name: str, tmp_path: Path) -> dict:
    """A shipped job as checked, its architecture named where the job takes it from its HF folder."""
    overrides = []
    if name == "tiny_extend_cpu":  # the folder scripts/make_tiny_hf.py writes; only its config.json is read here
        overrides = ["--model.hf_config", str(hf_folder(tmp_path, LLAMA31_8B))]
    return load_job(resolve_config_path(name), overrides)


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_job_reads_its_files_or_their_stand_ins(name, tmp_path):
    cfg, lines = with_stand_ins(_job(name, tmp_path))
    data, val, ckpt = cfg["data"], cfg["validation"], cfg["checkpoint"]
    assert data["tokenizer"] == "default" or Path(data["tokenizer"]).exists()
    assert not any(absent(entry["source"]) for entry in [data, *data["mix"].values()])
    assert not (val["enable"] and absent(val["source"] or "default"))
    if ckpt["initial_load_in_hf"] and not Path(ckpt["initial_load_path"]).exists():  # its headers the model's:
        ckpt["initial_load_path"], ckpt["initial_load_in_hf"] = None, False  # test_dryrun_hf_import.py
    assert ckpt["initial_load_path"] is None or Path(ckpt["initial_load_path"]).exists()
    check_inputs(cfg)  # the tokenizer loads, every source and the held-out data give a first document
    assert len(lines) == len(set(lines)) and all("is absent: " in line for line in lines)


def test_the_30b_moe_recipe_says_what_stands_in(tmp_path):
    cfg, lines = with_stand_ins(_job("qwen3_30b_a3b_128k", tmp_path))
    assert lines == [
        "[data] tokenizer /models/Qwen3-30B-A3B-Base/tokenizer.json is absent: the shipped tokenizer "
        "(data/default/tokenizer.json) stands in",
        "[data.mix.long] source /data/qwen3moe/long.tokens is absent: synthetic documents of wlbllm lengths "
        "stand in (min_tokens 65536 kept)",
        "[data.mix.short] source /data/qwen3moe/short.tokens is absent: synthetic documents of wlbllm lengths "
        "stand in",
        "[checkpoint] initial_load_path /models/Qwen3-30B-A3B-Base is absent: its load is planned against the "
        "headers the model implies, the model is qwen3 30B-A3B as the job names it",
    ]  # fmt: skip
    assert cfg["data"]["mix"]["long"] == {"source": "synthetic", "weight": 0.6, "min_tokens": 65536}


def _dry_run(tmp_path: Path, capsys, *overrides: str):
    """`python -m flashcp.titan.dryrun --json` on test_dryrun's tiny job reading files that are not there."""
    job = tmp_path / "absent.toml"
    job.write_text(JOB.replace('source = "synthetic"\nsynthetic_lengths = "wlbllm"',
                               f'source = "{NOWHERE}/docs.jsonl"\ntokenizer = "{NOWHERE}/tokenizer.json"'))  # fmt: skip
    absent_files = ["--validation.enable", "true", "--validation.source", f"{NOWHERE}/heldout.tokens",
                    "--checkpoint.enable", "true", "--checkpoint.initial_load_in_hf", "true",
                    "--checkpoint.initial_load_path", f"{NOWHERE}/hf"]  # fmt: skip
    capsys.readouterr()
    code = cli.main(["--config", str(job), "--world-size", "8", "--json", *absent_files, *overrides])
    out = capsys.readouterr()
    return code, out.out, out.err.strip().splitlines()


def test_a_job_without_its_files_dry_runs_as_with_the_stand_ins_given(tmp_path, capsys):
    code, out, err = _dry_run(tmp_path, capsys)
    assert code == 0, err[-5:]
    notes = [line for line in err if line.startswith("note: ")]
    assert [note.split(" is absent: ")[0] for note in notes] == [
        f"note: [data] tokenizer {NOWHERE}/tokenizer.json", f"note: [data] source {NOWHERE}/docs.jsonl",
        f"note: [validation] source {NOWHERE}/heldout.tokens", f"note: [checkpoint] initial_load_path {NOWHERE}/hf",
    ]  # fmt: skip
    given = ["--data.tokenizer", "default", "--data.source", "synthetic", "--validation.enable", "false"]
    code, out_given, err_given = _dry_run(tmp_path, capsys, *given)
    assert code == 0 and len([line for line in err_given if line.startswith("note: ")]) == 1  # the HF folder
    report, report_given = json.loads(out), json.loads(out_given)
    for timed in (report, report_given):
        del timed["plan"]["planning_ms"]
    assert report["peak_gib"] == report_given["peak_gib"] and report["plan"] == report_given["plan"]


def test_data_that_is_there_but_unreadable_is_one_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    code, _, err = _dry_run(tmp_path, capsys, "--data.source", str(tmp_path / "empty"))
    assert code == 2
    assert err[-1].startswith(f"error: no supported data files in {tmp_path / 'empty'}")
    assert err[-1].endswith("--data.source synthetic (a mixture: --data.mix.NAME.source synthetic) stands in for it")
