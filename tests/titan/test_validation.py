"""Everything a job reads or sets is checked before any rank starts: optimizer and schedule values,
the all-default job, the tokenizer and the data (opened pre-launch), with file and line in errors."""

from __future__ import annotations

import gzip
import json
import os
import re
from pathlib import Path

import pytest

from flashcp.titan.launch import node as launch
from flashcp.titan.config import CONFIG_DIR, ConfigError, load_job
from flashcp.titan.launch.preflight import check_inputs
from flashcp.data.errors import DataError


def job(tmp_path: Path, *overrides: str, text: str = "") -> dict:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return load_job(path, list(overrides))


@pytest.mark.parametrize(
    "override, message",
    [
        ("--optimizer.lr=-1", "[optimizer] lr must be > 0, got -1.0"),
        ("--optimizer.lr=0", "[optimizer] lr must be > 0, got 0.0"),
        ("--optimizer.eps=0", "[optimizer] eps must be > 0"),
        ("--optimizer.beta1=1.0", "[optimizer] beta1 must be in [0, 1)"),
        ("--optimizer.beta2=-0.1", "[optimizer] beta2 must be in [0, 1)"),
        ("--optimizer.weight_decay=-0.1", "[optimizer] weight_decay must be >= 0"),
        ("--training.max_norm=0", "[training] max_norm must be > 0"),
        ("--lr_scheduler.min_lr_factor=2", "[lr_scheduler] min_lr_factor must be in [0, 1]"),
        ("--lr_scheduler.decay_ratio=1.5", "[lr_scheduler] decay_ratio must be in [0, 1]"),
        ("--lr_scheduler.warmup_steps=30", "[lr_scheduler] warmup_steps (30) must be <= [training] steps (20)"),
        ("--training.steps=20", "[lr_scheduler] warmup_steps (200, the default) must be <= [training] steps (20)"),
    ],
)
def test_optimizer_and_schedule_values_are_checked(tmp_path, override, message):
    with pytest.raises(ConfigError) as e:
        job(tmp_path, "--training.steps=20", override)
    assert message in str(e.value)


@pytest.mark.parametrize(
    "override, message",
    [
        ("--training.seq_len=1099511627776",
         "error: [training] seq_len (1099511627776) must be < 2**31: the attention kernels index a window with int32"),
        ("--comm.init_timeout_seconds=-1", "error: [comm] init_timeout_seconds must be >= 1, got -1"),
        ("--comm.train_timeout_seconds=0", "error: [comm] train_timeout_seconds must be >= 1, got 0"),
        ("--data.prefetch=1000000", "error: [data] prefetch must be in [0, 64] (windows the loader builds ahead; "
                                    "more only holds memory), got 1000000"),
        ("--job.description=" + "x" * 5000, "error: [job] description is 5000 characters long; a setting may hold "
                                            "at most 4096 (it is copied into every log)"),
    ],
)
def test_values_that_would_hang_or_exhaust_the_machine_stop_the_launcher_with_one_line(tmp_path, capsys, override,
                                                                                       message):  # fmt: skip
    dump = tmp_path / "out"
    assert launch.main(["--config", "debug_cpu", f"--job.dump_folder={dump}", override]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [message]
    assert not dump.exists()


def test_a_window_larger_than_the_host_memory_is_refused(tmp_path, cpu_machine):
    with pytest.raises(ConfigError) as e:
        job(tmp_path, "--training.seq_len=2147483646")
    assert str(e.value) == ("[training] seq_len (2147483646) is too long for this host: one window's int64 tokens "
                            "and labels alone need 32.0 GiB and it has 24.0 GiB of memory")  # fmt: skip


def test_data_running_out_before_the_last_step_ends_the_run_with_a_job_error(tmp_path):
    """loop = false: TorchTitan's trainer stops early on exhausted data and exits 0; this is a DataError
    (train.py: exit 2 and one line the launcher prints), naming the step and what to change."""
    from harness import single_rank, tiny_job, train

    data = tmp_path / "few.jsonl"
    data.write_text("".join(json.dumps({"text": f"document {i} " + "word " * 120}) + "\n" for i in range(20)))
    cfg = tiny_job(tmp_path / "out", data={"source": str(data), "loop": False},
                   training={"steps": 50})  # fmt: skip
    with single_rank(), pytest.raises(DataError) as e:
        train(cfg)
    found = re.fullmatch(
        rf"the data ran out in step (\d+) of \[training\] steps = 50 with \[data\] loop = false \({str(data)!r} "
        r"holds too few windows\); set training.steps to at most (\d+) or data.loop = true",
        str(e.value),
    )
    assert found and 1 < int(found[1]) < 50 and int(found[2]) == int(found[1]) - 1, str(e.value)


def test_a_relative_dump_folder_becomes_absolute_where_the_job_is_loaded(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = job(tmp_path, "--job.dump_folder=runs/a")
    assert cfg["job"]["dump_folder"] == str(tmp_path / "runs" / "a")


def test_the_all_default_job_passes_every_check_and_builds(tmp_path):
    """An empty TOML: debugmodel (2048 tokens in TorchTitan) takes the default tokenizer's 4096."""
    from flashcp.titan.config import check_layout
    from flashcp.titan.launch.job import trainer_config

    cfg = job(tmp_path)
    check_layout(cfg, 2, has_cuda=False)
    check_inputs(cfg)
    assert trainer_config(cfg).model_spec.model.vocab_size == 4096


def test_a_model_vocabulary_below_the_tokenizer_fails_before_launch(tmp_path):
    cfg = job(tmp_path, text="[model]\nflavor = 'custom'\ndim = 32\nn_layers = 1\nn_heads = 4\nvocab_size = 100\n")
    with pytest.raises(ConfigError, match=r"vocab_size \(100, flavor 'custom'\) is smaller than the tokenizer's "
                                          r"vocabulary \(4096"):  # fmt: skip
        check_inputs(cfg)


def write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)
    return path


@pytest.mark.parametrize(
    "name, data, message",
    [
        ("latin1.txt", "first line\ncaf\xe9 ol\xe9\n".encode("latin-1"),
         "latin1.txt: line 2: not UTF-8 text (byte 3 of the line: invalid continuation byte)"),
        ("binary.txt", b"\x89PNG\r\n\x1a\n\x00\x00", "binary.txt: line 1: not UTF-8 text"),
        ("docs.jsonl", b'{"text": "a"}\n{"text": "b"}\n{"text": oops}\n', "docs.jsonl: line 3: not a JSON object"),
        ("docs.jsonl.gz", b'{"text": "a"}\n{"text\n', "docs.jsonl.gz: line 2: not a JSON object"),
    ],
)
def test_unreadable_data_names_the_file_the_line_and_the_cause(tmp_path, name, data, message):
    path = write(tmp_path / "data" / name, data)
    cfg = job(tmp_path, f"--data.source={path}")
    with pytest.raises(DataError) as e:
        check_inputs(cfg)
    assert str(path.parent) in str(e.value) and message in str(e.value)


@pytest.mark.parametrize(
    "override, message",
    [
        ("--data.source=/no/such/data.jsonl", "error: data path not found: /no/such/data.jsonl"),
        ("--data.tokenizer=/no/such/tokenizer.json", "/no/such/tokenizer.json"),
        ("--data.synthetic_lengths=nonsense", "data.synthetic_lengths"),
    ],
)
def test_data_and_tokenizer_errors_stop_the_launcher_before_any_rank(tmp_path, capsys, override, message):
    dump = tmp_path / "out"
    extra = ["--data.source=synthetic"] if "synthetic_lengths" in override else []
    code = launch.main(["--config", "debug_cpu", f"--job.dump_folder={dump}", *extra, override])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0], err
    assert not dump.exists()  # checked before the folders are even created


@pytest.fixture
def cpu_machine(monkeypatch):
    """No GPU and 24 GiB of memory, whatever machine runs the test."""
    monkeypatch.setattr("torch.cuda.device_count", lambda: 0)
    sysconf = os.sysconf
    memory = {"SC_PHYS_PAGES": 24 * 2**18, "SC_PAGE_SIZE": 4096}
    monkeypatch.setattr(os, "sysconf", lambda name: memory.get(name) or sysconf(name))


def test_a_gpu_model_on_a_cpu_machine_is_named_before_anything_else(tmp_path, capsys, cpu_machine, monkeypatch):
    monkeypatch.setenv("NGPU", "8")
    dump = tmp_path / "out"
    code = launch.main(["--config", "llama8b_128k.toml", f"--job.dump_folder={dump}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("error: no GPU found, and llama3 8B (at least 6.7B parameters) is not a CPU job: ")
    assert "on this node's 8 CPU rank(s), which has 24 GiB of memory" in err[0]
    job = CONFIG_DIR / "llama8b_128k.toml"
    assert err[0].endswith(f"without GPUs: python -m flashcp.titan.dryrun --config {job} --world-size 8")
    assert not dump.exists()


def test_a_layout_that_does_not_fit_the_assumed_cpu_ranks_says_they_were_assumed(tmp_path, capsys, cpu_machine,
                                                                                 monkeypatch):  # fmt: skip
    monkeypatch.delenv("NGPU", raising=False)
    argv = ["--config", "debug_cpu", f"--job.dump_folder={tmp_path / 'out'}",
            "--parallelism.data_parallel_shard_degree", "-1", "--parallelism.context_parallel_degree", "8"]  # fmt: skip
    assert launch.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "error: no GPU found, so the job was laid out on 2 CPU rank(s) (the default for CPU runs; set NGPU to the "
        "ranks per node to choose): "
    ), err
    monkeypatch.setenv("NGPU", "2")  # chosen, not assumed: the layout's own message
    assert launch.main(argv) == 2
    assert "no GPU found, so" not in capsys.readouterr().err
