"""The commands of README.md and docs/*.md work as written, or say why no test runs them.

Every command line of a fenced ```bash block is one of:
- run here, as written, in a scratch folder laid out like a clone (`HERE`: the test below that runs it);
- run by another test, named with what it changes (`ELSEWHERE`);
- minutes of CPU, so run by no test as written: the test that runs the same entry point on a small
  job is named (`SLOW`);
- marked in the docs `# needs GPUs` or `# needs your data` (paths the reader fills in).
A new command in the docs that is none of these fails `test_every_command_is_run_or_marked`.

Also: every ```toml block is a valid job fragment, every repository path the docs name exists, links
between the pages resolve, and `python -m flashcp...` works from the parent folder of a clone named
`flashcp`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKS = ("# needs GPUs", "# needs your data")
TIMEOUT = 600  # catches a hang only

CHECK_8B = ".venv/bin/python -m flashcp.titan.config --check train_configs/llama8b_128k.toml --world-size 8"
KEYS = ".venv/bin/python -m flashcp.titan.config --keys model"
SMALL_DRY_RUN = ".venv/bin/python -m flashcp.titan.dryrun --config debug_cpu --world-size 4"
PLANNER = ".venv/bin/python -m flashcp.plan --distribution wlbllm --cp 8 --strategy all"
PREPARE = ".venv/bin/python -m flashcp.data.prepare default --tokenizer default --out outputs/corpus.tokens"
VERIFY = ".venv/bin/python -m flashcp.data.prepare --verify outputs/corpus.tokens"
SETUP = "scripts/setup_env.sh"
TINY_HF = ".venv/bin/python scripts/make_tiny_hf.py outputs/tiny_hf_llama"
EXPORT_CHECK = (
    ".venv/bin/python -c \"import transformers as t; m = t.AutoModelForCausalLM.from_pretrained("
    "'outputs/tiny_extend_cpu/checkpoint/step-20-hf'); print(m.config.rope_parameters['rope_theta'], "
    "m.config.max_position_embeddings)\""
)

HERE = {
    CHECK_8B: "test_config_check_and_keys",
    KEYS: "test_config_check_and_keys",
    SMALL_DRY_RUN: "test_a_small_dry_run",
    PLANNER: "test_planner_cli",
    PREPARE: "test_prepare_and_verify_the_shipped_corpus",
    VERIFY: "test_prepare_and_verify_the_shipped_corpus",
    SETUP: "test_extend_walk_on_a_fresh_layout",
    TINY_HF: "test_extend_walk_on_a_fresh_layout",
    EXPORT_CHECK: "test_extend_walk_on_a_fresh_layout",
}
ELSEWHERE = {  # command -> (the test that runs it, what that test changes)
    "./run_train.sh --config debug_cpu --training.steps 20": (
        "tests/titan/test_e2e.py::test_fsdp2_x_flashcp2_on_4_ranks", "3 steps, its own dump folder"),
    "./run_train.sh --config tiny_extend_cpu": (
        "tests/titan/test_tiny_extend.py::test_tiny_extend_example_end_to_end",
        "4 steps, the probe on (--probe.freq 4), its own folders"),
    ".venv/bin/python -m flashcp.titan.export --checkpoint outputs/tiny_extend_cpu/checkpoint/step-20 "
    "--out outputs/tiny_bf16 --dtype bfloat16": (
        "tests/titan/test_hf_checkpoint.py::test_export_shards_above_the_size_limit_and_casts",
        "in process, a checkpoint of the same tiny Llama"),
    "./run_train.sh --config tiny_extend_cpu --probe.enable true": (
        "tests/titan/test_tiny_extend.py::test_tiny_extend_example_end_to_end",
        "4 steps, --probe.freq 4, its own folders"),
    ".venv/bin/python -m flashcp.titan.probe --checkpoint outputs/tiny_extend_cpu/checkpoint/step-20 --config "
    "tiny_extend_cpu": (
        "tests/titan/test_probe.py::test_cli_probes_a_checkpoint_on_the_jobs_layout_as_training_does",
        "a tiny job's seed checkpoint"),
    ".venv/bin/python -m flashcp.titan.probe --hf outputs/tiny_extend_cpu/checkpoint/step-20-hf --config "
    "tiny_extend_cpu": (
        "tests/titan/test_probe_oracle.py::test_probe_matches_transformers_on_each_prompt_alone",
        "a tiny random HF Llama and a tiny job"),
    ".venv/bin/python -m flashcp.gpucheck --device cpu --quick --out outputs/gpucheck": (
        "tests/test_gpu_lease.py::test_quick_check_runs_every_section",
        "as the lease rehearsal's part a: --no-budgets, its own folder"),
    "bash scripts/gpu_lease.sh outputs/lease --device cpu --quick": (
        "tests/test_gpu_lease.py::test_the_lease_rehearses_every_part_on_the_cpu", "its own folder and wheel site"),
    ".venv/bin/python -m flashcp.titan.config --check default --model.attention flex": (
        "tests/titan/test_flex_switch.py::test_check_on_cpu_refuses_in_one_line", "CUDA_VISIBLE_DEVICES empty"),
}  # fmt: skip
SLOW = {  # command -> (the test that runs the same entry point on a small job, how)
    "./run_train.sh": (
        "tests/titan/test_e2e.py::test_flashcp_cp2_on_2_ranks",
        "debug_cpu on 2 ranks for 3 steps; the default job (300 steps, minutes) is checked by "
        "tests/titan/test_config.py::test_shipped_configs_validate"),
    "bash scripts/test.sh": (None, "the whole suite, this file included; .ci/run runs it"),
    "bash scripts/gpu_wheels.sh": (
        "tests/test_gpu_wheels.py::test_every_requirement_of_a_carried_wheel_travels_or_is_there",
        "it downloads from PyPI; the tests check the list it downloads, offline"),
    ".venv/bin/python -m flashcp.titan.dryrun --config llama8b_128k --world-size 8": (
        "tests/titan/test_dryrun.py::test_dry_run_prints_the_peak_by_category_as_one_json_object",
        "a tiny job; the shipped 8B and 70B jobs take 0.5-2 minutes each"),
    ".venv/bin/python -m flashcp.titan.dryrun --config llama70b_128k --world-size 64 --json": (
        "tests/titan/test_dryrun.py::test_dry_run_prints_the_peak_by_category_as_one_json_object", "a tiny job"),
    ".venv/bin/python -m flashcp.titan.dryrun --config llama8b_128k --world-size 8 --loss.chunk_tokens 0 "
    "--gpu-gib 80 --reserve-gib 6": (
        "tests/titan/test_dryrun.py::test_a_gpu_too_small_exits_1_naming_the_biggest_term",
        "a tiny job with --gpu-gib and --reserve-gib"),
    ".venv/bin/python -m flashcp.titan.dryrun --config llama8b_128k --world-size 8 --training.seq_len 2097152 "
    "--activation_checkpoint.mlp_tiles 16 --activation_checkpoint.offload true": (
        "tests/titan/test_dryrun.py::test_offload_moves_the_layer_inputs_to_host_memory", "a tiny job with offload"),
    ".venv/bin/python -m flashcp.titan.dryrun --config llama8b_128k --world-size 8 --training.seq_len 4194304 "
    "--activation_checkpoint.mlp_tiles 32 --parallelism.context_parallel_degree 8 --activation_checkpoint.offload true "
    "--activation_checkpoint.head_groups 8 --training.enable_cpu_offload true": (
        "tests/titan/test_dryrun.py::test_cpu_offload_moves_the_sharded_state_to_host_memory",
        "a tiny job with and without CPU offload; the 8B job at 4M tokens takes tens of minutes on 2 loaded cores"),
    ".venv/bin/python benchmarks/compile_step.py": (
        "tests/titan/test_parity.py::test_compiled_blocks_train_the_eager_losses",
        "a tiny job on the same layouts, compiled and eager for 20 steps; the benchmark's timed runs take ~10 minutes"),
    **{f".venv/bin/python benchmarks/dryrun_frontier.py {rows}": (
        "tests/titan/test_dryrun.py::test_offload_moves_the_layer_inputs_to_host_memory",
        "each of its rows is one such dry run (head groups: tests/titan/test_dryrun.py's CPU offload job); the 25 "
        "base rows take about an hour, a 4M-6M row 20-75 minutes")
       for rows in ("--rows base", "--rows levers --tokens 4M --tokens 5M --tokens 6M", "--rows 70b --cpu-offload")},
    ".venv/bin/python -m flashcp.titan.dryrun --config llama3_8b_extend_128k --world-size 8": (
        "tests/titan/test_dryrun_no_data.py::test_a_job_without_its_files_dry_runs_as_with_the_stand_ins_given",
        "a tiny job with every file absent (the same file resolves every shipped job's stand-ins); the recipe "
        "takes 0.5-2 minutes"),
    ".venv/bin/python -m flashcp.titan.dryrun --config qwen3_30b_a3b_128k --world-size 16": (
        "tests/titan/test_dryrun_no_data.py::test_a_job_without_its_files_dry_runs_as_with_the_stand_ins_given",
        "a tiny job with every file absent (the same file checks this recipe's stand-in lines); the recipe "
        "takes about 4 minutes"),
    ".venv/bin/python -m flashcp.titan.dryrun --config llama8b_128k --world-size 8 --model.converters float8": (
        "tests/titan/test_converters.py::test_the_dry_run_of_a_float8_job_adds_its_modelled_casts",
        "debug_cpu with and without float8; the 8B job takes 0.5-2 minutes"),
}  # fmt: skip


def without_comment(line: str) -> str:
    """The command without its trailing `# ...` comment (a `#` inside quotes is kept)."""
    quote = None
    for i, c in enumerate(line):
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def doc_commands() -> list[tuple[str, str, str]]:
    """(page, command, the line as written) for every command of every ```bash block."""
    found = []
    for page in PAGES:
        for block in re.findall(r"^ *```bash\n(.*?)^ *```", page.read_text(), re.M | re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.strip()
                if line and not line.startswith("#"):
                    found.append((page.name, re.sub(r"\s+", " ", without_comment(line)), line))
    return found


def test_every_command_is_run_or_marked():
    unaccounted = [f"{page}: {line}" for page, cmd, line in doc_commands()
                   if not any(mark in line for mark in MARKS) and cmd not in HERE | ELSEWHERE | SLOW]  # fmt: skip
    assert not unaccounted, (
        "commands no test runs; run them in tests/test_docs.py (HERE), name the test that runs them "
        f"(ELSEWHERE / SLOW) or mark them {' / '.join(MARKS)} in the docs:\n" + "\n".join(unaccounted)
    )
    written = {cmd for _, cmd, _ in doc_commands()}
    stale = [cmd for cmd in HERE | ELSEWHERE | SLOW if cmd not in written]
    assert not stale, f"listed here but in no page any more: {stale}"


def test_the_named_tests_exist():
    this = Path(__file__).read_text()
    for name in set(HERE.values()):
        assert f"def {name}(" in this, name
    for node, _ in [*ELSEWHERE.values(), *SLOW.values()]:
        if node is not None:
            path, name = node.split("::")
            assert f"def {name}(" in (ROOT / path).read_text(), node


def test_pages_say_how_to_get_the_venv_before_using_it():
    """A reader who opens a page first learns where `.venv` comes from before a command uses it."""
    for page in PAGES:
        text = page.read_text()
        first = text.find(".venv/bin/")
        if first >= 0:
            before = " ".join(text[:first].split())
            assert "setup_env.sh" in before or '"Two commands"' in before, page.name
    walk = [cmd for page, cmd, _ in doc_commands() if page == "extend.md"]
    assert walk[0] == SETUP  # the walk starts on a fresh clone


def test_named_paths_and_links_exist():
    missing = []
    for page in PAGES:
        text = page.read_text()
        for path in re.findall(r"`((?:flashcp|tests|scripts|benchmarks|train_configs|data)/[\w./-]*)`", text):
            if not (ROOT / path).exists():
                missing.append(f"{page.name}: {path}")
        for link in re.findall(r"\]\(([\w./-]+\.md)(?:#[\w-]*)?\)", text):
            if not (page.parent / link).exists():
                missing.append(f"{page.name}: link {link}")
    assert not missing, missing


# Running the commands: a scratch folder laid out like a clone (.venv, scripts/, train_configs/), so that
# what they write (outputs/) stays out of the checkout.


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("clone")
    for name in ("scripts", "train_configs"):
        (folder / name).symlink_to(ROOT / name)
    if sys.prefix != sys.base_prefix:  # the venv this suite runs in, as the clone's .venv
        (folder / ".venv").symlink_to(sys.prefix)
    else:
        (folder / ".venv" / "bin").mkdir(parents=True)
        (folder / ".venv" / "bin" / "python").symlink_to(sys.executable)
    return folder


def run(cmd: str, cwd: Path) -> subprocess.CompletedProcess:
    assert cmd in {c for _, c, _ in doc_commands()}, f"not in the docs as written: {cmd}"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FLASHCP_VENV")}
    proc = subprocess.run(["bash", "-c", cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def test_config_check_and_keys(clone):
    assert "OK for 8 ranks" in run(CHECK_8B, clone).stdout
    assert "[model] rope_theta" in run(KEYS, clone).stdout


def test_a_small_dry_run(clone):
    assert "fits:" in run(SMALL_DRY_RUN, clone).stdout


def test_planner_cli(clone):
    rows = run(PLANNER, clone).stdout
    assert all(s in rows for s in ("per_seq", "per_doc", "whole_doc", "flashcp"))


def test_prepare_and_verify_the_shipped_corpus(clone):
    run(PREPARE, clone)
    assert (clone / "outputs" / "corpus.tokens" / "tokens.bin").is_file()
    run(VERIFY, clone)


@pytest.fixture(scope="module")
def tiny_hf(clone) -> Path:
    """The extend walk's first steps, in its order: setup (a no-op on a ready venv), the tiny model."""
    run(SETUP, clone)
    run(TINY_HF, clone)
    return clone / "outputs" / "tiny_hf_llama"


def test_extend_walk_on_a_fresh_layout(clone, tiny_hf):
    """The walk's cheap steps (the fixture) and the check of the export. Training and exporting are
    tests/titan/test_tiny_extend.py's; here the export is stood in for by the tiny model with the
    config.json an export writes (a flat rope_theta, the context trained), which is what the check reads."""
    export = clone / "outputs" / "tiny_extend_cpu" / "checkpoint" / "step-20-hf"
    shutil.copytree(tiny_hf, export)
    config = json.loads((export / "config.json").read_text())
    config.pop("rope_parameters", None)
    config |= {"rope_theta": 100000.0, "max_position_embeddings": 2048}
    (export / "config.json").write_text(json.dumps(config))
    assert run(EXPORT_CHECK, clone).stdout.split()[-2:] == ["100000.0", "2048"]


def test_toml_blocks_are_valid_job_fragments(tiny_hf):
    """Each ```toml block of the docs validates as a job; the HF folder the docs name is stood in for
    by the tiny model."""
    from flashcp.titan.config import validate

    blocks = [(page.name, block) for page in PAGES
              for block in re.findall(r"^ *```toml\n(.*?)^ *```", page.read_text(), re.M | re.S)]  # fmt: skip
    assert len(blocks) >= 4
    for page, block in blocks:
        validate(tomllib.loads(block.replace('"/models/Llama-3.1-8B"', json.dumps(str(tiny_hf)))))


def test_python_m_from_the_parent_folder_of_a_clone_named_flashcp(tmp_path):
    """There, the clone's folder is a namespace package `flashcp` on sys.path; the installed package
    must win over it (pyproject: package-dir "" = ".", an editable install puts the checkout on
    sys.path) instead of `No module named 'flashcp.data.errors'`."""
    (tmp_path / "flashcp").symlink_to(ROOT)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-m", "flashcp.plan", "--help"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT)  # fmt: skip
    assert proc.returncode == 0, (
        "an install from before pyproject's package-dir: run .venv/bin/pip install -e . again\n" + proc.stderr
    )
