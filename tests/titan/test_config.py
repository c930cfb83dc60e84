"""Job files: the shipped configs validate, every kind of mistake is rejected naming its key, and
overrides parse like TorchTitan's CLI (the keys read from TorchTitan's classes:
test_config_titan.py; the flavors read from TorchTitan's registries: test_hf_config.py)."""

from __future__ import annotations

import subprocess
import sys
import typing
from pathlib import Path

import pytest
from harness import TINY, tiny_job

from flashcp.titan.config import (
    CONFIG_DIR,
    SCHEMA,
    ConfigError,
    apply_overrides,
    check_layout,
    load_job,
    resolve_config_path,
    validate,
)

ROOT = Path(__file__).resolve().parents[2]


# Every job file in train_configs/ with the world size it is meant for, whether it is a GPU job, and
# the layout it must give there. A shipped config missing here fails test_shipped_configs_validate.
SHIPPED = {
    "default": (2, False, {"dp_shard": 1, "cp": 2, "tp": 1}),
    "debug_cpu": (4, False, {"dp_shard": 2, "cp": 2, "tp": 1}),
    "debug_moe_cpu": (4, False, {"dp_shard": 2, "cp": 2, "tp": 1}),
    "debug_gpt_oss_cpu": (2, False, {"dp_shard": 1, "cp": 2, "tp": 1}),
    "debug_hybrid_cpu": (2, False, {"dp_shard": 1, "cp": 2, "tp": 1}),
    "debug_pp_cpu": (4, False, {"dp_shard": 1, "cp": 2, "tp": 1, "pp": 2}),
    "tiny_extend_cpu": (2, False, {"dp_shard": 1, "cp": 2, "tp": 1}),
    "llama8b_128k": (8, True, {"dp_shard": 1, "cp": 8, "tp": 1}),
    "llama70b_128k": (64, True, {"dp_shard": 2, "cp": 4, "tp": 8}),
    "llama3_405b_128k": (512, True, {"dp_shard": 1, "cp": 8, "tp": 8, "pp": 8}),
    "llama3_8b_extend_128k": (8, True, {"dp_shard": 1, "cp": 8, "tp": 1}),
    "qwen3_8b_128k": (8, True, {"dp_shard": 1, "cp": 8, "tp": 1}),
    "qwen3_30b_a3b_128k": (16, True, {"dp_shard": 2, "cp": 8, "tp": 1}),
    "deepseek_v3_16b_128k": (16, True, {"dp_shard": 2, "cp": 8, "tp": 1}),
    "deepseek_v3_671b_128k": (512, True, {"dp_shard": 8, "cp": 8, "tp": 1, "pp": 8}),
    "gpt_oss_20b_128k": (8, True, {"dp_shard": 1, "cp": 8, "tp": 1}),
    "qwen3_5_9b_128k": (8, True, {"dp_shard": 1, "cp": 8, "tp": 1}),
}
# Recipes that read a Hugging Face folder and token stores the user prepares (absent on CI).
RECIPES = ("llama3_8b_extend_128k", "qwen3_8b_128k", "qwen3_30b_a3b_128k")


@pytest.mark.parametrize("name", sorted(path.stem for path in CONFIG_DIR.glob("*.toml")))
def test_shipped_configs_validate(tmp_path, name):
    """Every shipped job file passes the pre-launch config check (every key, the architecture, RoPE,
    the layout at its world size). The recipes name their architecture (flavor), so this opens none
    of their files: their HF folder, tokenizer and data stores are opened by the launcher before any
    rank starts (test_recipes_name_a_missing_input_in_one_line), which checks the folder's
    safetensors headers against the model. tiny_extend_cpu reads its architecture from the HF folder
    that scripts/make_tiny_hf.py writes first, so the test writes it too."""
    if name not in SHIPPED:
        pytest.fail(f"train_configs/{name}.toml has no world size and layout in SHIPPED: add it there")
    world, has_cuda, expect = SHIPPED[name]
    overrides = []
    if name == "tiny_extend_cpu":
        from scripts.make_tiny_hf import make_tiny_hf

        overrides = ["--checkpoint.initial_load_path", str(make_tiny_hf(tmp_path / "tiny_hf_llama"))]
    cfg = load_job(resolve_config_path(name), overrides)
    degrees = check_layout(cfg, world, has_cuda=has_cuda)
    assert {k: degrees[k] for k in expect} == expect


def test_every_checked_layout_is_a_shipped_config():
    assert set(SHIPPED) <= {path.stem for path in CONFIG_DIR.glob("*.toml")}


@pytest.mark.parametrize("name", RECIPES)
def test_recipes_name_a_missing_input_in_one_line(name):
    """The launcher's input check of a recipe whose files are not there: the tokenizer, then (with the
    shipped one) the first store, then (with synthetic data) the HF folder, each named in one line."""
    from flashcp.titan.launch.preflight import check_inputs

    synthetic = ["--data.tokenizer", "default"]
    stages = [
        ([], r"^tokenizer file not found: /models/\S+/tokenizer\.json$"),
        (synthetic, r"^\[data\.mix\.long\] data path not found: /data/\S+/long\.tokens$"),
        (synthetic + ["--data.mix.long.source", "synthetic", "--data.mix.short.source", "synthetic",
                      "--validation.source", "synthetic"],
         r"^\[checkpoint\] initial_load_path: /models/\S+ does not exist$"),
    ]  # fmt: skip
    for overrides, message in stages:
        with pytest.raises(ValueError, match=message):
            check_inputs(load_job(resolve_config_path(name), overrides))


def test_a_named_gpu_backend_refuses_a_cpu_machine():
    cfg = load_job(resolve_config_path("llama8b_128k"), ["--flashcp.backend", "flash_attn"])
    with pytest.raises(ConfigError, match=r"\[flashcp\] backend = 'flash_attn' needs CUDA"):
        check_layout(cfg, 8, has_cuda=False)


@pytest.mark.parametrize(
    "backend, capability, flash_attn_error, message",
    [
        ("flash_attn", (9, 0), "flash-attn is not installed (pip install flash-attn)",
         r"backend = 'flash_attn' cannot run on this machine: flash-attn is not installed .*torch <= 2.10.*"
         r"pip install flash-attn --no-build-isolation.*or set backend = 'auto'"),
        ("torch", (7, 5), None, r"backend = 'torch' cannot run on this machine: .*needs an sm80\+ GPU"),
        ("torch", (9, 0), None, None),
        ("flash_attn", (9, 0), None, None),
        ("auto", (7, 5), "flash-attn is not installed", None),  # auto takes what runs
    ],
)
def test_named_gpu_backend_is_checked_before_launch(
    monkeypatch, backend, capability, flash_attn_error, message
):
    """On a GPU machine (capabilities monkeypatched here) a named backend must run there: the job
    fails before any rank starts, not at its first attention call after the model is built."""
    from flashcp.attention import kernels

    monkeypatch.setattr(kernels, "_capability", lambda device=None: capability)
    monkeypatch.setattr(kernels, "_flash_attn_import_error", lambda: flash_attn_error)
    cfg = load_job(resolve_config_path("llama8b_128k"), ["--flashcp.backend", backend])
    if message is None:
        assert check_layout(cfg, 8, has_cuda=True)["cp"] == 8
    else:
        with pytest.raises(ConfigError, match=message) as err:
            check_layout(cfg, 8, has_cuda=True)
        assert "\n" not in str(err.value)


def test_a_named_torch_backend_needs_torch_2_11(monkeypatch):
    from flashcp.attention import kernels

    monkeypatch.setattr(kernels, "_torch_varlen_params", lambda: frozenset({"is_causal"}))  # torch 2.10's
    monkeypatch.setattr(kernels, "_capability", lambda device=None: (9, 0))
    cfg = load_job(resolve_config_path("llama8b_128k"), ["--flashcp.backend", "torch"])
    with pytest.raises(ConfigError, match=r"backend = 'torch' cannot run on this machine: .*torch >= 2.11"):
        check_layout(cfg, 8, has_cuda=True)


def test_shipped_gpu_configs_pick_the_kernel_that_is_installed():
    for name in (name for name, (_, has_cuda, _) in SHIPPED.items() if has_cuda):
        assert load_job(resolve_config_path(name))["flashcp"]["backend"] == "auto"


@pytest.mark.parametrize(
    "sections, message",
    [
        ({"trainig": {"steps": 3}}, r"unknown section \[trainig\]; allowed sections: job, model"),
        ({"training": {"stepz": 3}}, r"unknown key \[training\] stepz; allowed keys: .*steps"),
        ({"training": {"steps": "20"}}, r"\[training\] steps must be an integer, got '20'"),
        ({"training": {"steps": True}}, r"\[training\] steps must be an integer"),
        ({"optimizer": {"lr": "fast"}}, r"\[optimizer\] lr must be a number"),
        ({"flashcp": {"strategy": "zigzag"}}, r"\[flashcp\] strategy must be one of per_seq, per_doc, .*flashcp"),
        ({"flashcp": {"comm": "zigzag"}}, r"\[flashcp\] comm must be one of compact, full, needed"),
        ({"flashcp": {"target_imbalance": 0.9}}, r"target_imbalance must be >= 1.0"),
        ({"training": {"local_batch_size": 2}}, r"local_batch_size must be 1 with FlashCP"),
        ({"checkpoint": {"keep_latest_k": 1}}, r"keep_latest_k must be 0 .* or >= 2"),
        ({"model": {"flavor": "8B"}}, r"\[model\] dim, .* only apply to flavor = 'custom'; flavor '8B'"),
        ({"model": {"dim": 30}}, r"dim \(30\) must be divisible by n_heads \(4\)"),
        ({"parallelism": {"spmd_backend": "spmd_types"}}, r"spmd_backend must be 'partial_dtensor'"),
        ({"parallelism": {"context_parallel_load_balancer": "ptrr"}}, r"load_balancer is TorchTitan's CP"),
        ({"data": {"overflow": 3}}, r"\[data\] overflow must be a string"),
        ({"checkpoint": {"create_seed_checkpoint": True}}, r"create_seed_checkpoint needs .* enable"),
        ({"checkpoint": {"initial_load_path": "/x"}}, r"initial_load_path needs \[checkpoint\] enable"),
        ({"job": {"description": "x" * 5000}},
         r"^\[job\] description is 5000 characters long; a setting may hold at most 4096 \(it is copied"),
        ({"compile": {"components": ["model", "y" * 4097]}}, r"^\[compile\] components is 4097 characters long"),
        ({"training": {"seq_len": 2**40}},
         r"^\[training\] seq_len \(1099511627776\) must be < 2\*\*31: the attention kernels index a window with int32"),
        ({"comm": {"init_timeout_seconds": 0}}, r"^\[comm\] init_timeout_seconds must be >= 1, got 0$"),
        ({"comm": {"train_timeout_seconds": -5}}, r"^\[comm\] train_timeout_seconds must be >= 1, got -5$"),
        ({"activation_checkpoint": {"mlp_tiles": -2}}, r"^\[activation_checkpoint\] mlp_tiles must be >= -1, got -2$"),
        ({"data": {"min_pairs_kept": 1.5}}, r"^data\.min_pairs_kept must be within \[0, 1\] \(the share of stream "
                                            r"packing's attended pairs each step keeps\), got 1\.5$"),
        ({"data": {"min_pairs_kept": float("nan")}}, r"^\[data\] min_pairs_kept must be finite, got nan$"),
        ({"data": {"prefetch": 1000000}}, r"^\[data\] prefetch must be in \[0, 64\] \(windows the loader builds "
                                          r"ahead; more only holds memory\), got 1000000$"),
    ],
)
def test_bad_files_name_the_key(tmp_path, sections, message):
    with pytest.raises(ConfigError, match=message):
        tiny_job(tmp_path, **sections)


@pytest.mark.parametrize(
    "sections, message",
    [
        ({"parallelism": {"context_parallel_degree": 4},
          "flashcp": {"comm": "compact", "ranks_per_node": 2, "scope": "group"}},
         "[flashcp] ranks_per_node = 2 has no effect with comm = 'compact': only comm = 'two_level' or scope = 'mesh' "
         "uses it"),
        ({"flashcp": {"plan_worker": False, "plan_worker_timeout_seconds": 20.0}},
         "[flashcp] plan_worker_timeout_seconds = 20.0 has no effect with plan_worker = false: only plan_worker = "
         "true uses it"),
        ({"data": {"balance": "mesh", "max_delay_steps": 4}},
         "[data] max_delay_steps = 4 has no effect with balance = 'mesh': only balance = 'deferral' or "
         "'deferral-cut' uses it"),
        ({"data": {"balance": "mesh-cut", "min_pairs_kept": 0.9}},
         "[data] min_pairs_kept = 0.9 has no effect with balance = 'mesh-cut': only balance = 'deferral-cut' "
         "uses it"),
        ({"data": {"balance": "off", "balance_target": 1.1}},
         "[data] balance_target = 1.1 has no effect with balance = 'off': only balance = 'deferral' or "
         "'deferral-cut' or 'mesh-cut' uses it"),
        ({"data": {"synthetic_lengths": "pile"}},
         "[data] synthetic_lengths = 'pile' has no effect with no synthetic source: only a \"synthetic\" source uses it"),
        ({"data": {"hf_split": "test"}},
         "[data] hf_split = 'test' has no effect with no hub source in [data]: only an \"hf:NAME\" source of [data] "
         "uses it"),
    ],
)
def test_a_setting_the_chosen_mode_does_not_read_is_refused(tmp_path, sections, message):
    with pytest.raises(ConfigError) as e:
        tiny_job(tmp_path, **sections)
    assert str(e.value) == message + "; remove it or choose that mode"


def test_settings_in_their_mode_are_accepted_and_the_worker_time_out_is_below_the_peers(tmp_path):
    cfg = tiny_job(tmp_path, parallelism={"context_parallel_degree": 4}, data={"source": "synthetic",
                   "synthetic_lengths": "pile", "balance": "deferral", "max_delay_steps": 4, "balance_target": 1.1},
                   flashcp={"comm": "two_level", "ranks_per_node": 2, "plan_worker": True,
                            "plan_worker_timeout_seconds": 20.0})  # fmt: skip
    assert (cfg["flashcp"]["plan_worker_timeout_seconds"], cfg["data"]["max_delay_steps"]) == (20.0, 4)
    assert tiny_job(tmp_path, data={"min_pairs_kept": 0.95})["data"]["min_pairs_kept"] == 0.95  # deferral-cut's
    assert tiny_job(tmp_path, flashcp={"plan_worker": True})["flashcp"]["plan_worker_timeout_seconds"] == 50.0
    short = tiny_job(tmp_path, flashcp={"plan_worker": True}, comm={"train_timeout_seconds": 5})
    assert short["flashcp"]["plan_worker_timeout_seconds"] == 2.5
    for bad in (-1.0, 100.0):
        with pytest.raises(ConfigError, match=rf"^\[flashcp\] plan_worker_timeout_seconds must be 0 \(half of \[comm\] "
                                              rf"train_timeout_seconds\) or > 0 and below \[comm\] "
                                              rf"train_timeout_seconds \(100\), got {bad}$"):
            tiny_job(tmp_path, flashcp={"plan_worker": True, "plan_worker_timeout_seconds": bad})


@pytest.mark.parametrize(
    "sections, world, message",
    [
        ({"parallelism": {"data_parallel_shard_degree": 2, "context_parallel_degree": 2}}, 6,
         r"degrees multiply to 4 .* but the job has 6 ranks"),
        ({"parallelism": {"data_parallel_shard_degree": -1, "context_parallel_degree": 4}}, 6,
         r"world size 6 is not divisible by .* = 4"),
        ({"parallelism": {"context_parallel_degree": 4}, "training": {"seq_len": 260}}, 4,
         r"seq_len \(260\) must be divisible by 8"),
        ({"parallelism": {"tensor_parallel_degree": 4}, "model": {"n_kv_heads": 2}}, 4,
         r"tensor_parallel_degree \(4\) must divide n_heads \(4\) and n_kv_heads \(2\)"),
        ({"training": {"global_batch_size": 3}, "parallelism": {"data_parallel_shard_degree": 2}}, 2,
         r"global_batch_size \(3\) must be a positive multiple"),
        ({"flashcp": {"backend": "torch"}}, 1, r"backend = 'torch' needs CUDA"),
        ({"model": {"attention": "flex"}, "flashcp": None}, 1, r"'flex' cannot train on CPU"),
        ({"model": {"attention": "varlen"}, "flashcp": None, "parallelism": {"context_parallel_degree": 2}},
         2,
         r"'varlen' has no CP in TorchTitan"),
    ],
)
def test_impossible_layouts(tmp_path, sections, world, message):
    with pytest.raises(ConfigError, match=message):
        check_layout(tiny_job(tmp_path, **sections), world, has_cuda=False)


def test_overrides_parse_like_torchtitan():
    raw = apply_overrides(
        {"training": {"steps": 10}},
        ["--training.steps", "20", "--optimizer.lr=1e-3", "--flashcp.strategy", "per_doc",
         "--metrics.enable_tensorboard", "--compile.components", '["model"]'],
    )  # fmt: skip
    assert raw == {
        "training": {"steps": 20},
        "optimizer": {"lr": 1e-3},
        "flashcp": {"strategy": "per_doc"},
        "metrics": {"enable_tensorboard": True},
        "compile": {"components": ["model"]},
    }
    for bad in (["steps", "3"], ["--steps", "3"], ["--a.b.c", "1"]):
        with pytest.raises(ConfigError, match="--section.key"):
            apply_overrides({}, bad)


def test_list_keys_take_the_comma_form_a_negative_first_element_included(tmp_path):
    """Every list key of strings or numbers takes `a,b` as [a, b] (a negative first element is a value,
    not a flag) and one value as a list of one; an out-of-range element is then one line naming the key."""
    samples = {str: ("model,loss", ["model", "loss"]), int: ("-5,10", [-5, 10]), float: ("-0.1,0.5", [-0.1, 0.5])}
    keys = [(section, name, typing.get_args(key.type)[0]) for section, table in SCHEMA.items()
            for name, key in table.items()
            if typing.get_origin(key.type) is list and typing.get_args(key.type)[0] in samples]  # fmt: skip
    assert {("probe", "depths", float), ("probe", "lengths", int), ("compile", "components", str)} <= set(keys)
    for section, name, item in keys:
        text, value = samples[item]
        assert apply_overrides({}, [f"--{section}.{name}", text]) == {section: {name: value}}
        assert apply_overrides({}, [f"--{section}.{name}={text}"]) == {section: {name: value}}
        last = text.split(",")[-1]
        assert apply_overrides({}, [f"--{section}.{name}", last]) == {section: {name: value[-1:]}}
    raw = {**TINY, "job": {"dump_folder": str(tmp_path)}}
    with pytest.raises(ConfigError, match=r"^\[probe\] depths must be distinct fractions .*got \[-0.1, 0.5\]"):
        validate(apply_overrides(raw, ["--probe.depths", "-0.1,0.5"]))
    assert validate(apply_overrides(raw, ["--probe.depths", "0.1,0.5"]))["probe"]["depths"] == [0.1, 0.5]


def test_config_lookup_by_name_or_path(tmp_path):
    assert resolve_config_path("debug_cpu") == CONFIG_DIR / "debug_cpu.toml"
    assert resolve_config_path(None) == CONFIG_DIR / "default.toml"
    own = tmp_path / "mine.toml"
    own.write_text("[training]\nsteps = 3\n[lr_scheduler]\nwarmup_steps = 1\n")
    assert load_job(resolve_config_path(str(own)))["training"]["steps"] == 3
    with pytest.raises(ConfigError, match="'nope' not found .* shipped configs: .*debug_cpu"):
        resolve_config_path("nope")
    broken = tmp_path / "broken.toml"
    broken.write_text("[training\n")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_job(broken)


def test_a_job_file_of_any_name_is_read_and_a_directory_is_named_as_such(tmp_path):
    conf = tmp_path / "job.conf"
    conf.write_text("[training]\nsteps = 3\n[lr_scheduler]\nwarmup_steps = 1\n")
    assert load_job(resolve_config_path(str(conf)))["training"]["steps"] == 3
    (tmp_path / "runs").mkdir()
    with pytest.raises(ConfigError, match=r"^\S+/runs is a directory, not a job file$"):
        load_job(resolve_config_path(str(tmp_path / "runs")))
    (tmp_path / "debug_cpu").mkdir()  # a folder of a shipped config's name does not hide the config
    assert resolve_config_path(str(tmp_path / "debug_cpu")) == tmp_path / "debug_cpu"


@pytest.mark.parametrize(
    "text, message",
    [
        ("x = " + "[" * 100_000 + "]" * 100_000, r"job.toml: line 1: arrays or tables nested more than 32 deep"),
        ("[job]\n" + "x = " + "{a = " * 40 + "1" + "}" * 40, r"job.toml: line 2: arrays or tables nested more than 32"),
        ("x = " + "[" * 10**6 + "]" * 10**6, r"job.toml is larger than 1 MiB, the most a job file may hold$"),
        ("# " + "x" * (1 << 20), r"job.toml is larger than 1 MiB"),
    ],
)
def test_a_hostile_job_file_is_refused_before_parsing(tmp_path, text, message):
    """Checked on the raw text: tomllib recurses once per level (RecursionError at 100,000, minutes at 10^6)."""
    path = tmp_path / "job.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_job(path)
    with pytest.raises(ConfigError, match=r"^override --compile.components: line 1: arrays or tables nested more"):
        apply_overrides({}, ["--compile.components", "[" * 100_000])


def test_brackets_in_strings_and_comments_are_not_nesting(tmp_path):
    deep = "[" * 40 + "{" * 40
    path = tmp_path / "job.toml"
    path.write_text(f'[job]\ndescription = "{deep}"  # {deep}\n[compile]\n'
                    f"components = ['{deep}', \"\"\"\n{deep}\\\"\"\"\"]\n")  # fmt: skip
    assert load_job(path)["compile"]["components"] == [deep, f'{deep}"']


def test_every_tiny_section_is_in_the_schema(tmp_path):
    cfg = tiny_job(tmp_path)
    assert set(TINY) <= set(SCHEMA)
    assert cfg["model"]["dim"] == 32 and cfg["flashcp"]["strategy"] == "flashcp"


def test_check_cli_exit_codes(capsys):
    """`python -m flashcp.titan.config` exits with `main`'s code (tests/test_docs.py runs the command)."""
    from flashcp.titan.config import main

    run = ["--check", "debug_cpu"]
    capsys.readouterr()
    assert main(run) == 0
    ok = capsys.readouterr()
    assert "OK for 4 ranks" in ok.out, ok.err
    assert main([*run, "--training.steps", "x"]) == 2
    assert capsys.readouterr().err.strip() == "error: [training] steps must be an integer, got 'x' (str)"


def test_check_cli_refuses_a_deeply_nested_file_with_one_line(tmp_path):
    path = tmp_path / "deep.conf"  # any name
    path.write_text("[job]\nx = " + "[" * 100_000 + "]" * 100_000)
    run = [sys.executable, "-m", "flashcp.titan.config", "--check", str(path)]
    bad = subprocess.run(run, cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2
    assert bad.stderr.strip() == f"error: {path}: line 2: arrays or tables nested more than 32 deep; a job file " \
                                 "may nest at most that"  # fmt: skip


def test_validate_fills_defaults():
    cfg = validate({})
    resolved = {"plan_worker_timeout_seconds": cfg["comm"]["train_timeout_seconds"] / 2}  # 0: half of it
    assert cfg["flashcp"] == {key: SCHEMA["flashcp"][key].default for key in SCHEMA["flashcp"]} | resolved
    assert cfg["training"]["seq_len"] == 2048
