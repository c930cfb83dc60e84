"""TOML job files for `train.py`: schema, CLI overrides and every check that needs no process group.

    cfg = load_job("train_configs/debug_cpu.toml", ["--training.steps", "20"])
    check_layout(cfg, world_size=4)
    python -m flashcp.titan.config --check train_configs/debug_cpu.toml --world-size 4

A job file has the sections of TorchTitan 0.3.0's `Trainer.Config` (job, model, data, training,
optimizer, lr_scheduler, parallelism, checkpoint, metrics, activation_checkpoint, compile, comm)
plus `[flashcp]` and `[loss]`. Every key a job may set is declared in `SCHEMA` with its type, default and,
where the set is closed, its allowed values; `flashcp.titan.job` maps the validated dict onto
TorchTitan's dataclasses. Defaults equal TorchTitan's except where a comment says why not.

All of this runs before any process is spawned and imports neither TorchTitan nor CUDA, so a bad
file fails in about a second with one message naming the key and what it accepts.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import shlex
import sys
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomllib

from flashcp.attention.kernels import BACKENDS as KERNELS
from flashcp.attention.kernels import gpu_backend_problem
from flashcp.dispatch import COMM_MODES
from flashcp.plan import STRATEGIES
from flashcp.data.errors import DataError
from flashcp.data.sources import DataConfig
from flashcp.titan.hf_config import Architecture, HFConfigError, read_hf_config
from flashcp.titan.rope import FAMILY_ROPE, rope_for_job, RopeError, SCALINGS

CONFIG_DIR = Path(__file__).resolve().parents[2] / "train_configs"
DEFAULT_CONFIG = "default.toml"
# Bounds on what a job may hold, so that a mangled or hostile file fails in milliseconds with one
# line: tomllib recurses once per nesting level (RecursionError at ~1,000, minutes at 10^6), a
# setting is copied into every rank's log and every node's job card, and the loader holds whole
# windows in host memory while its cu_seqlens are int32.
MAX_JOB_BYTES = 1 << 20
MAX_NESTING = 32  # arrays / inline tables inside each other; real jobs nest 2 deep
MAX_STRING_CHARS = 4096  # PATH_MAX on Linux: no path or description needs more
MAX_SEQ_LEN = 2**31 - 1  # cu_seqlens (flashcp.dispatch, the varlen kernels) are int32
WINDOW_BYTES_PER_TOKEN = 16  # a window's int64 tokens and labels, a lower bound on the loader's memory
MAX_PREFETCH = 64  # windows the loader's thread builds ahead; more only costs memory


class ConfigError(ValueError):
    """A job file, override or layout that cannot run; the message names the key."""


@dataclass(frozen=True)
class Key:
    """One setting: its type, default (None: unset, the consumer decides) and allowed values."""

    type: Any
    default: Any = None
    choices: tuple | None = None
    doc: str = ""


# Llama 3 flavors of TorchTitan 0.3.0 (torchtitan.models.llama3.llama3_configs):
# flavor -> (dim, n_layers, n_heads, n_kv_heads, vocab_size). Used to check layouts before any
# process starts; tests/titan/test_config.py keeps it equal to TorchTitan's table.
LLAMA3_FLAVORS: dict[str, tuple[int, int, int, int, int]] = {
    "debugmodel": (256, 6, 16, 16, 2048),
    "1B": (2048, 16, 32, 8, 128256),
    "3B": (3072, 28, 24, 8, 128256),
    "8B": (4096, 32, 32, 8, 128256),
    "70B": (8192, 80, 64, 8, 128256),
    "405B": (16384, 126, 128, 8, 128256),
}
# Qwen3 dense flavors of TorchTitan 0.3.0 (torchtitan.models.qwen3.qwen3_configs), the same
# fields; every one has head_dim 128 (QWEN3_HEAD_DIM), which is not dim / n_heads in all of them.
QWEN3_FLAVORS: dict[str, tuple[int, int, int, int, int]] = {
    "debugmodel": (256, 8, 16, 8, 2048),
    "0.6B": (1024, 28, 16, 8, 151936),
    "1.7B": (2048, 28, 16, 8, 151936),
    "4B": (2560, 36, 32, 8, 151936),
    "8B": (4096, 36, 32, 8, 151936),
    "14B": (5120, 40, 40, 8, 151936),
    "32B": (5120, 64, 64, 8, 151936),
}
QWEN3_HEAD_DIM = 128
QWEN3_MOE_FLAVORS = ("debugmodel_moe", "30B-A3B", "235B-A22B")
FLAVORS = {"llama3": LLAMA3_FLAVORS, "qwen3": QWEN3_FLAVORS}
CUSTOM_MODEL_KEYS = (
    "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size", "ffn_dim_multiplier", "multiple_of"
)  # fmt: skip
# A debug model has no vocabulary of its own: it takes the tokenizer's, so that the defaults
# (debugmodel, 2048 in TorchTitan, and the shipped 4,096-token tokenizer) train together.
TOKENIZER_SIZED_FLAVORS = ("debugmodel",)
BACKENDS = ("auto", *KERNELS)
GPU_BACKENDS = tuple(name for name in KERNELS if name != "reference")
DTYPES = ("bfloat16", "float32")


def _data_keys() -> dict[str, Key]:
    """`[data]` is the data pipeline's `DataConfig`, key for key."""
    hints = typing.get_type_hints(DataConfig)
    keys = {}
    for f in dataclasses.fields(DataConfig):
        hint = hints[f.name]
        optional = type(None) in typing.get_args(hint)
        base = next(a for a in typing.get_args(hint) if a is not type(None)) if optional else hint
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        keys[f.name] = Key(typing.get_origin(base) or base, default)  # dict[str, ...] -> dict (data.mix)
    return keys


def _validation_keys() -> dict[str, Key]:
    """`[validation]`: TorchTitan's validator settings with its types and defaults (`Validator.Config`;
    its data loader is FlashCP's, `flashcp.titan.validate`), then the held-out data and the buckets."""
    from torchtitan.components.validate import Validator  # after flashcp.titan's shims (package import)

    hints = typing.get_type_hints(Validator.Config)
    fields = [f for f in dataclasses.fields(Validator.Config) if f.name != "dataloader"]
    return {f.name: Key(hints[f.name], f.default) for f in fields} | {
        "source": Key(str, doc='held-out data, as [data] source (a token store, files, "synthetic"); "default": '
                      "the shipped corpus's held-out split, data/default/valid.jsonl.gz"),
        "hf_split": Key(str, "validation", doc='the split a "hf:NAME" source reads'),
        "bucket_min": Key(int, 1024, doc="loss by position in the document: buckets [0, bucket_min), then "
                          "doubling up to seq_len"),
    }


SCHEMA: dict[str, dict[str, Key]] = {
    "job": {
        "description": Key(str, ""),
        "dump_folder": Key(str, "./outputs", doc="logs, TensorBoard files and checkpoints go here"),
    },
    "model": {
        "name": Key(str, "llama3", tuple(FLAVORS), "the model family (TorchTitan's registry)"),
        "flavor": Key(str, "debugmodel", doc="a dense flavor TorchTitan registers for the family, or custom"),
        "hf_config": Key(str, doc="a Hugging Face model folder (or its config.json) giving the architecture "
                         "instead of flavor; default with [checkpoint] initial_load_in_hf: initial_load_path"),
        "attention": Key(
            str, "flashcp", ("flashcp", "flex", "varlen"),
            "flashcp: FlashCP's op (CP through [flashcp]); flex / varlen: TorchTitan's own "
            "attention, with TorchTitan's built-in CP for flex",
        ),
        # flavor = "custom" only; vocab_size defaults to the tokenizer's.
        "dim": Key(int),
        "n_layers": Key(int),
        "n_heads": Key(int),
        "n_kv_heads": Key(int),
        "head_dim": Key(int, doc="qwen3 only; default dim / n_heads"),
        "vocab_size": Key(int),
        "ffn_dim_multiplier": Key(float),
        "multiple_of": Key(int),
        # RoPE (flashcp.titan.rope); unset: the model's own (flavor, config.json; custom: the family's).
        "rope_theta": Key(float, doc="RoPE base"),
        "rope_scaling": Key(str, None, SCALINGS, "RoPE scaling type; unset keeps the model's"),
        "rope_factor": Key(float, doc="llama3 / yarn: context extension factor"),
        "rope_original_max_position_embeddings": Key(int, doc="llama3 / yarn: the context before scaling"),
        "rope_low_freq_factor": Key(float, doc="llama3 (HF default 1)"),
        "rope_high_freq_factor": Key(float, doc="llama3 (HF default 4)"),
        "rope_beta_fast": Key(float, doc="yarn (HF default 32)"),
        "rope_beta_slow": Key(float, doc="yarn (HF default 1)"),
        "rope_attention_factor": Key(float, doc="yarn: logits scale factor (squared); default 0.1 ln(factor) + 1"),
    },
    "data": _data_keys(),
    "training": {
        # One window per data-parallel rank and micro step: FlashCP plans whole windows.
        "local_batch_size": Key(int, 1),
        "global_batch_size": Key(int, -1),
        "seq_len": Key(int, 2048, doc="the context window C"),
        "max_norm": Key(float, 1.0),
        "steps": Key(int, 10000),
        "dtype": Key(str, "float32", DTYPES),
        "mixed_precision_param": Key(str, "bfloat16", DTYPES),
        "mixed_precision_reduce": Key(str, "float32", ("float32",)),
        "enable_cpu_offload": Key(bool, False),
        "gc_freq": Key(int, 50),
        "seed": Key(int),
        "deterministic": Key(bool, False),
    },
    "optimizer": {
        "name": Key(str, "AdamW", ("AdamW", "Adam")),
        "lr": Key(float, 8e-4),
        "beta1": Key(float, 0.9),
        "beta2": Key(float, 0.95),
        "eps": Key(float, 1e-8),
        "weight_decay": Key(float, 0.1),
        "implementation": Key(str, "fused", ("for-loop", "foreach", "fused")),
    },
    "lr_scheduler": {
        "warmup_steps": Key(int, 200),
        "decay_ratio": Key(float),
        "decay_type": Key(str, "linear", ("linear", "sqrt", "cosine")),
        "min_lr_factor": Key(float, 0.0),
    },
    "parallelism": {
        "data_parallel_replicate_degree": Key(int, 1),
        "data_parallel_shard_degree": Key(int, -1, doc="-1: the ranks left after the other degrees"),
        "context_parallel_degree": Key(int, 1),
        "tensor_parallel_degree": Key(int, 1),
        "enable_sequence_parallel": Key(bool, True),
        "fsdp_reshard_after_forward": Key(str, "default", ("default", "always", "never")),
        "context_parallel_load_balancer": Key(str, "headtail", ("headtail", "ptrr"), "TorchTitan's CP only"),
        # None: "partial_dtensor" on torch < 2.14 (the default "spmd_types" needs 2.14), else TorchTitan's.
        "spmd_backend": Key(str, None, ("partial_dtensor", "full_dtensor", "spmd_types")),
    },
    "checkpoint": {
        "enable": Key(bool, False),
        "folder": Key(str, "checkpoint", doc="relative to job.dump_folder"),
        "interval": Key(int, 500),
        "keep_latest_k": Key(int, 10, doc="0 keeps all; 1 is not allowed (one may be mid-write)"),
        "load_step": Key(int, -1, doc="-1: the latest complete checkpoint"),
        "load_unverified": Key(bool, False, doc="let the checkpoint named by load_step / initial_load_path load "
                               "without a manifest.json (one written by another tool): unverified"),
        # Full state in the last checkpoint too, so a finished run can be extended.
        "last_save_model_only": Key(bool, False),
        "async_mode": Key(str, "disabled", ("disabled", "async", "async_with_pinned_mem")),
        "initial_load_path": Key(str),
        "initial_load_in_hf": Key(bool, False, doc="initial_load_path is a Hugging Face model folder (safetensors)"),
        "last_save_in_hf": Key(bool, False, doc="also export the final checkpoint as a Hugging Face folder, "
                               "<checkpoint folder>/step-N-hf (python -m flashcp.titan.export)"),
        "export_dtype": Key(str, "float32", ("float16", "bfloat16", "float32"),
                            "dtype of the last_save_in_hf export (and of a model-only last save)"),
        "enable_first_step_checkpoint": Key(bool, False),
        "create_seed_checkpoint": Key(
            bool, False, doc="save the initial model as step-0 on 1 rank and exit: identical initial "
            "weights for any later layout (sharded init differs between layouts on CPU)",
        ),
    },
    "metrics": {
        "log_freq": Key(int, 10),
        "enable_tensorboard": Key(bool, False),
        "save_tb_folder": Key(str, "tb"),
        "disable_color_printing": Key(bool, False),
        "enable_wandb": Key(bool, False),
        "peak_tflops": Key(float, doc="per-device peak for MFU (default: TorchTitan's GPU table; CPU: none)"),
    },
    "activation_checkpoint": {
        "mode": Key(str, "selective", ("none", "selective", "full")),
    },
    "compile": {
        "enable": Key(bool, False),
        "components": Key(list, ["model", "loss"]),
        "backend": Key(str, "inductor"),
    },
    "comm": {
        "init_timeout_seconds": Key(int, 300),
        "train_timeout_seconds": Key(int, 100),
        "mode": Key(str, "default", ("default", "fake_backend"),
                    "fake_backend: TorchTitan's dry-run process group (python -m flashcp.titan.dryrun)"),
    },
    "loss": {
        "chunk_tokens": Key(int, 2048, doc="cross-entropy over at most this many tokens at a time "
                            "(flashcp.titan.loss); 0: all of a rank's tokens at once"),
    },
    "flashcp": {
        "strategy": Key(str, "flashcp", tuple(STRATEGIES), "how each window is sharded over the CP ranks"),
        "target_imbalance": Key(float, 1.05, doc="max / mean attention workload the planner aims for"),
        "comm": Key(str, "compact", COMM_MODES, "KV exchange: compact (FlashCP) | full (Llama3 CP) | needed"),
        "backend": Key(str, "auto", BACKENDS, "varlen kernel; auto: flash_attn, torch, then reference"),
        "overlap": Key(bool, False, doc="compute all-local shards while the KV exchange is in flight"),
    },
    # TorchTitan's `validator` section, named as the job files name it.
    "validation": _validation_keys(),
}
# Sections TorchTitan names otherwise: an unknown-section error names FlashCP's.
RENAMED_SECTIONS = {"validator": "validation"}


def _shown(value: Any) -> str:
    """repr(value), cut short: a message stays one readable line whatever a file holds."""
    text = repr(value)
    return text if len(text) <= 200 else f"{text[:200]}... ({len(text)} characters)"


def _type_name(t: Any) -> str:
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string", list: "a list",
            dict: "a table"}[t]


def _check_value(section: str, name: str, key: Key, value: Any) -> Any:
    where = f"[{section}] {name}"
    if key.type is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    ok = isinstance(value, key.type) and not (key.type is int and isinstance(value, bool))
    if not ok:
        raise ConfigError(f"{where} must be {_type_name(key.type)}, got {_shown(value)} ({type(value).__name__})")
    if key.type is float and not math.isfinite(value):
        raise ConfigError(f"{where} must be finite, got {value!r}")
    if key.type is list and not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{where} must be a list of strings, got {_shown(value)}")
    for text in value if key.type is list else [value] if key.type is str else []:
        if len(text) > MAX_STRING_CHARS:
            raise ConfigError(f"{where} is {len(text)} characters long; a setting may hold at most "
                              f"{MAX_STRING_CHARS} (it is copied into every log)")  # fmt: skip
    if key.choices is not None and value not in key.choices:
        raise ConfigError(f"{where} must be one of {', '.join(map(str, key.choices))}; got {value!r}")
    return value


def validate(raw: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Types, choices and known names; returns every section with defaults filled in."""
    for section, values in raw.items():
        if section in RENAMED_SECTIONS:
            raise ConfigError(f"unknown section [{section}]: TorchTitan's [{section}] is [{RENAMED_SECTIONS[section]}] "
                              "in a FlashCP job")  # fmt: skip
        if section not in SCHEMA:
            raise ConfigError(f"unknown section [{section}]; allowed sections: {', '.join(SCHEMA)}")
        if not isinstance(values, dict):
            raise ConfigError(f"[{section}] must be a table of settings, got {values!r}")
        for name in values:
            if name not in SCHEMA[section]:
                raise ConfigError(
                    f"unknown key [{section}] {name}; allowed keys: {', '.join(SCHEMA[section])}"
                )
    cfg: dict[str, dict[str, Any]] = {}
    for section, keys in SCHEMA.items():
        given = raw.get(section, {})
        cfg[section] = {
            name: _check_value(section, name, key, given[name]) if name in given else key.default
            for name, key in keys.items()
        }
    cfg["_given"] = {section: sorted(values) for section, values in raw.items()}
    # Relative to the directory the job is started from, resolved once so that nothing depends
    # on a later working directory and everything printed is absolute.
    cfg["job"]["dump_folder"] = os.path.abspath(cfg["job"]["dump_folder"])
    if cfg["checkpoint"]["initial_load_path"]:  # the same for the folder loaded first (TorchTitan wants it absolute)
        cfg["checkpoint"]["initial_load_path"] = os.path.abspath(cfg["checkpoint"]["initial_load_path"])
    _check_semantics(cfg)
    return cfg


def _positive(cfg: dict, section: str, *names: str, minimum: int = 1) -> None:
    for name in names:
        value = cfg[section][name]
        if value is not None and value < minimum:
            raise ConfigError(f"[{section}] {name} must be >= {minimum}, got {value}")


def _check_semantics(cfg: dict) -> None:
    """Checks that need several keys but no world size."""
    try:  # the data pipeline's own checks of [data] (choices, bounds, a mixture's entries)
        DataConfig(**cfg["data"])
    except DataError as e:
        raise ConfigError(str(e)) from e
    model, train, par, fcp = cfg["model"], cfg["training"], cfg["parallelism"], cfg["flashcp"]
    _positive(cfg, "training", "seq_len", "steps", "local_batch_size", "gc_freq")
    names = ("data_parallel_replicate_degree", "context_parallel_degree", "tensor_parallel_degree")
    _positive(cfg, "parallelism", *names)
    _positive(cfg, "checkpoint", "interval")
    _positive(cfg, "metrics", "log_freq")
    _positive(cfg, "loss", "chunk_tokens", minimum=0)
    _positive(cfg, "lr_scheduler", "warmup_steps", minimum=0)
    shard = par["data_parallel_shard_degree"]
    if shard == 0 or shard < -1:
        raise ConfigError(f"[parallelism] data_parallel_shard_degree must be -1 or >= 1, got {shard}")
    if cfg["checkpoint"]["keep_latest_k"] < 0 or cfg["checkpoint"]["keep_latest_k"] == 1:
        raise ConfigError(
            "[checkpoint] keep_latest_k must be 0 (keep all) or >= 2 (the newest may be mid-write), "
            f"got {cfg['checkpoint']['keep_latest_k']}"
        )
    for name in ("create_seed_checkpoint", "initial_load_path", "last_save_in_hf"):
        if cfg["checkpoint"][name] and not cfg["checkpoint"]["enable"]:
            raise ConfigError(f"[checkpoint] {name} needs [checkpoint] enable = true")
    if cfg["checkpoint"]["initial_load_in_hf"] and not cfg["checkpoint"]["initial_load_path"]:
        raise ConfigError("[checkpoint] initial_load_in_hf needs initial_load_path (the Hugging Face model folder)")
    _check_optimizer(cfg)
    _check_bounds(cfg)
    _check_validation(cfg)
    if not fcp["target_imbalance"] >= 1.0:
        raise ConfigError(f"[flashcp] target_imbalance must be >= 1.0, got {fcp['target_imbalance']}")

    _check_model(cfg)
    custom = [k for k in CUSTOM_MODEL_KEYS if model[k] is not None]
    if model["flavor"] == "custom":
        missing = [k for k in ("dim", "n_layers", "n_heads") if model[k] is None]
        if missing:
            raise ConfigError(f"[model] flavor = 'custom' needs {', '.join(missing)}")
        _positive(cfg, "model", "dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "multiple_of")
        n_kv = model["n_kv_heads"] or model["n_heads"]
        if (model["head_dim"] is None and model["dim"] % model["n_heads"]) or model["n_heads"] % n_kv:
            raise ConfigError(
                f"[model] dim ({model['dim']}) must be divisible by n_heads ({model['n_heads']}) and "
                f"n_heads by n_kv_heads ({n_kv})"
            )
    elif custom:
        raise ConfigError(
            f"[model] {', '.join(custom)} only apply to flavor = 'custom'; "
            f"flavor {model['flavor']!r} fixes them"
        )

    flashcp_given = "flashcp" in cfg["_given"]
    if model["attention"] == "flashcp":
        if train["local_batch_size"] != 1:
            raise ConfigError(
                "[training] local_batch_size must be 1 with FlashCP (one window per rank and micro step; "
                f"use global_batch_size for more windows per step), got {train['local_batch_size']}"
            )
        if "context_parallel_load_balancer" in cfg["_given"].get("parallelism", []):
            raise ConfigError(
                "[parallelism] context_parallel_load_balancer is TorchTitan's CP; with model.attention = "
                "'flashcp' the sharding is [flashcp] strategy"
            )
    elif flashcp_given:
        raise ConfigError(
            f"[flashcp] settings need model.attention = 'flashcp'; TorchTitan's {model['attention']!r} "
            "attention cannot run FlashCP's sharding"
        )
    elif model["attention"] == "varlen" and par["context_parallel_degree"] > 1:
        raise ConfigError(
            "model.attention = 'varlen' has no CP in TorchTitan 0.3.0; use 'flashcp' or 'flex' with "
            "context_parallel_degree > 1"
        )
    if par["spmd_backend"] not in (None, "partial_dtensor") and model["attention"] == "flashcp":
        raise ConfigError(
            "[parallelism] spmd_backend must be 'partial_dtensor' with FlashCP attention, "
            f"got {par['spmd_backend']!r}"
        )


def _check_validation(cfg: dict) -> None:
    """Validation needs held-out data: reading the training data would hide overfitting, so there is no default."""
    val = cfg["validation"]
    _positive(cfg, "validation", "freq", "bucket_min")
    if val["steps"] == 0 or val["steps"] < -1:
        raise ConfigError(f"[validation] steps must be >= 1 (windows per data-parallel rank) or -1 (the whole "
                          f"held-out data), got {val['steps']}")  # fmt: skip
    if val["enable"] and val["source"] is None:
        raise ConfigError(
            '[validation] enable = true needs [validation] source, the held-out data (as [data] source; "default": '
            "the shipped corpus's held-out split)"
        )


def _check_bounds(cfg: dict) -> None:
    """Values that pass every type check yet would hang or exhaust the machine instead of failing:
    a zero timeout, a window larger than the host's memory, an unbounded prefetch queue."""
    _positive(cfg, "comm", "init_timeout_seconds", "train_timeout_seconds")
    prefetch = cfg["data"]["prefetch"]
    if not 0 <= prefetch <= MAX_PREFETCH:
        raise ConfigError(f"[data] prefetch must be in [0, {MAX_PREFETCH}] (windows the loader builds ahead; "
                          f"more only holds memory), got {prefetch}")  # fmt: skip
    seq_len = cfg["training"]["seq_len"]
    if seq_len > MAX_SEQ_LEN:
        raise ConfigError(f"[training] seq_len ({seq_len}) must be < 2**31: the attention kernels index a "
                          "window with int32")  # fmt: skip
    need = seq_len * WINDOW_BYTES_PER_TOKEN
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > have:
        raise ConfigError(
            f"[training] seq_len ({seq_len}) is too long for this host: one window's int64 tokens and labels "
            f"alone need {need / 2**30:.1f} GiB and it has {have / 2**30:.1f} GiB of memory"
        )


def _check_optimizer(cfg: dict) -> None:
    """Values that would train silently wrong (a negative lr is gradient ascent) or not at all."""
    opt, sched, train = cfg["optimizer"], cfg["lr_scheduler"], cfg["training"]
    rules = [
        ("optimizer", "lr", opt["lr"] > 0, "> 0"),
        ("optimizer", "eps", opt["eps"] > 0, "> 0"),
        ("optimizer", "beta1", 0 <= opt["beta1"] < 1, "in [0, 1)"),
        ("optimizer", "beta2", 0 <= opt["beta2"] < 1, "in [0, 1)"),
        ("optimizer", "weight_decay", opt["weight_decay"] >= 0, ">= 0"),
        ("training", "max_norm", train["max_norm"] > 0, "> 0"),
        ("lr_scheduler", "min_lr_factor", 0 <= sched["min_lr_factor"] <= 1, "in [0, 1]"),
        ("lr_scheduler", "decay_ratio", sched["decay_ratio"] is None or 0 <= sched["decay_ratio"] <= 1, "in [0, 1]"),
    ]
    for section, name, ok, allowed in rules:
        if not ok:
            raise ConfigError(f"[{section}] {name} must be {allowed}, got {cfg[section][name]}")
    if sched["warmup_steps"] > train["steps"]:
        default = "" if "warmup_steps" in cfg["_given"].get("lr_scheduler", []) else ", the default"
        raise ConfigError(
            f"[lr_scheduler] warmup_steps ({sched['warmup_steps']}{default}) must be <= [training] steps "
            f"({train['steps']})"
        )


def _check_model(cfg: dict) -> None:
    """The architecture named once (flavor of the family, or an HF config.json read now) and its RoPE.

    With [checkpoint] initial_load_in_hf and no flavor given, the architecture is the loaded folder's:
    `hf_config` is set to initial_load_path and `flavor` to "hf"."""
    model, given = cfg["model"], cfg["_given"].get("model", [])
    ckpt = cfg["checkpoint"]
    if model["hf_config"] is None and ckpt.get("initial_load_in_hf") and "flavor" not in given:
        model["hf_config"] = ckpt["initial_load_path"]
    if model["hf_config"] is not None:
        if "flavor" in given:
            raise ConfigError("[model] flavor and hf_config both name the architecture; give one of them")
        arch = _hf_architecture(model["hf_config"])
        if "name" in given and model["name"] != arch.name:
            raise ConfigError(f"[model] name = {model['name']!r} but {model['hf_config']} holds a {arch.name} model")
        model["name"], model["flavor"], base = arch.name, "hf", arch.rope
    else:
        flavors = FLAVORS[model["name"]]
        if model["name"] == "qwen3" and model["flavor"] in QWEN3_MOE_FLAVORS:
            raise ConfigError(f"[model] flavor {model['flavor']!r} is a mixture-of-experts Qwen3: FlashCP trains dense "
                              f"models only ({', '.join(flavors)})")  # fmt: skip
        if model["flavor"] not in (*flavors, "custom"):
            raise ConfigError(f"[model] flavor must be one of {', '.join((*flavors, 'custom'))} for "
                              f"name = {model['name']!r}; got {model['flavor']!r}")  # fmt: skip
        base = FAMILY_ROPE[model["name"]]
    try:
        rope = rope_for_job(base, model)
        if model["name"] == "qwen3" and rope.scaling == "llama3":
            raise RopeError("llama3 RoPE scaling is Llama's; TorchTitan's Qwen3 RoPE takes none or yarn")
    except RopeError as e:
        raise ConfigError(f"[model] {e}") from e
    if rope.softmax_scale_factor != 1.0 and model["attention"] != "flashcp":
        raise ConfigError(
            f"[model] yarn RoPE's attention factor ({rope.yarn_attention_factor:.4g}) is applied by FlashCP's "
            f"attention; model.attention = {model['attention']!r} would drop it: use 'flashcp'"
        )
    if model["head_dim"] is not None and model["name"] != "qwen3":
        raise ConfigError("[model] head_dim applies to name = 'qwen3' only; Llama 3's is dim / n_heads")


def _hf_architecture(path: str) -> Architecture:
    try:
        return read_hf_config(path)
    except HFConfigError as e:
        raise ConfigError(f"[model] hf_config: {e}") from e


def model_dims(cfg: dict) -> tuple[int, int, int, int, int | None]:
    """(dim, n_layers, n_heads, n_kv_heads, vocab_size or None = the tokenizer's) of the job's model."""
    model = cfg["model"]
    if model["hf_config"] is not None:
        arch = _hf_architecture(model["hf_config"])
        return arch.dim, arch.n_layers, arch.n_heads, arch.n_kv_heads, arch.vocab_size
    flavors = FLAVORS[model["name"]]
    if model["flavor"] in TOKENIZER_SIZED_FLAVORS:
        return (*flavors[model["flavor"]][:4], None)
    if model["flavor"] != "custom":
        return flavors[model["flavor"]]
    n_kv = model["n_kv_heads"] or model["n_heads"]
    return model["dim"], model["n_layers"], model["n_heads"], n_kv, model["vocab_size"]


def model_head_dim(cfg: dict) -> int:
    """The job's attention head size (Qwen3's is not always dim / n_heads)."""
    model = cfg["model"]
    if model["hf_config"] is not None:
        return _hf_architecture(model["hf_config"]).head_dim
    if model["name"] == "qwen3" and model["flavor"] != "custom":
        return QWEN3_HEAD_DIM
    dim, _, n_heads, _, _ = model_dims(cfg)
    return model["head_dim"] or dim // n_heads


def degrees(cfg: dict, world_size: int) -> dict[str, int]:
    """Parallel degrees for `world_size` ranks (dp_shard = -1 resolved); ConfigError if they do not fit."""
    if cfg["checkpoint"]["create_seed_checkpoint"]:
        if world_size != 1:
            raise ConfigError(
                f"[checkpoint] create_seed_checkpoint runs on 1 rank (NGPU=1), not {world_size}"
            )
        return {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1}
    par = cfg["parallelism"]
    rep, shard = par["data_parallel_replicate_degree"], par["data_parallel_shard_degree"]
    cp, tp = par["context_parallel_degree"], par["tensor_parallel_degree"]
    fixed = rep * cp * tp
    if shard == -1:
        if world_size % fixed:
            raise ConfigError(
                f"world size {world_size} is not divisible by data_parallel_replicate_degree ({rep}) x "
                f"context_parallel_degree ({cp}) x tensor_parallel_degree ({tp}) = {fixed}"
            )
        shard = world_size // fixed
    elif fixed * shard != world_size:
        raise ConfigError(
            f"[parallelism] degrees multiply to {fixed * shard} (replicate {rep} x shard {shard} x cp {cp} x "
            f"tp {tp}) but the job has {world_size} ranks; set data_parallel_shard_degree = -1 or launch "
            f"{fixed * shard} ranks (NGPU / NNODES)"
        )
    return {"dp_replicate": rep, "dp_shard": shard, "cp": cp, "tp": tp}


def world_size_hint(cfg: dict) -> int | None:
    """The rank count the layout fixes, or None when data_parallel_shard_degree = -1 leaves it open."""
    if cfg["checkpoint"]["create_seed_checkpoint"]:
        return 1
    par = cfg["parallelism"]
    if par["data_parallel_shard_degree"] == -1:
        return None
    return (
        par["data_parallel_replicate_degree"] * par["data_parallel_shard_degree"]
        * par["context_parallel_degree"] * par["tensor_parallel_degree"]
    )  # fmt: skip


def check_layout(cfg: dict, world_size: int, has_cuda: bool | None = None) -> dict[str, int]:
    """Everything that depends on the number of ranks and the machine; returns the degrees."""
    deg = degrees(cfg, world_size)
    cp, tp = deg["cp"], deg["tp"]
    seq_len = cfg["training"]["seq_len"]
    sp = tp if cfg["parallelism"]["enable_sequence_parallel"] else 1
    divisor = sp * (2 * cp if cp > 1 else 1)  # TorchTitan 0.3.0's Trainer requires this
    if seq_len % divisor:
        tp_part = f" x tensor_parallel_degree {tp} for sequence parallel" if sp > 1 else ""
        raise ConfigError(
            f"[training] seq_len ({seq_len}) must be divisible by {divisor} (= 2 x context_parallel_degree "
            f"{cp}{tp_part}): every CP rank holds seq_len / cp tokens"
        )
    _, _, n_heads, n_kv, _ = model_dims(cfg)
    if n_heads % tp or n_kv % tp:
        raise ConfigError(
            f"[parallelism] tensor_parallel_degree ({tp}) must divide n_heads ({n_heads}) "
            f"and n_kv_heads ({n_kv})"
        )
    global_bs = cfg["training"]["global_batch_size"]
    dp = deg["dp_replicate"] * deg["dp_shard"]
    if global_bs != -1 and (global_bs < 1 or global_bs % (dp * cfg["training"]["local_batch_size"])):
        raise ConfigError(
            f"[training] global_batch_size ({global_bs}) must be a positive multiple of local_batch_size x "
            f"data-parallel degree ({cfg['training']['local_batch_size']} x {dp})"
        )
    if has_cuda is None:
        import torch

        has_cuda = torch.cuda.is_available()
    attention, backend = cfg["model"]["attention"], cfg["flashcp"]["backend"]
    if has_cuda and attention == "flashcp" and backend in GPU_BACKENDS:
        problem = gpu_backend_problem(backend)
        if problem:
            raise ConfigError(f"[flashcp] backend = {backend!r} cannot run on this machine: {problem}; "
                              "or set backend = 'auto'")  # fmt: skip
    if not has_cuda:
        if attention == "flashcp" and backend in GPU_BACKENDS:
            raise ConfigError(
                f"[flashcp] backend = {backend!r} needs CUDA and this machine has no GPU; "
                "use 'auto' or 'reference'"
            )
        if attention in ("flex", "varlen"):
            raise ConfigError(
                f"model.attention = {attention!r} cannot train on CPU (FlexAttention has no CPU backward, "
                "varlen attention no CPU kernel); use 'flashcp'"
            )
    return deg


# ----------------------------------------------------------------------------- files and CLI


def resolve_config_path(name: str | None) -> Path:
    """A job file by path of any name, or by name (with or without .toml) inside train_configs/.

    A path that exists but is no file (a directory, a pipe) is returned too, so that reading it
    says what it is instead of "not found"."""
    name = name or DEFAULT_CONFIG
    path = Path(name)
    named = path if path.suffix == ".toml" else path.with_name(path.name + ".toml")
    candidates = [path, named]
    if len(path.parts) == 1:
        candidates.append(CONFIG_DIR / named.name)
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    if path.exists():
        return path
    shipped = ", ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.toml")))
    raise ConfigError(f"config {name!r} not found (as a path or in {CONFIG_DIR}); shipped configs: {shipped}")


def _check_nesting(text: str, where: str) -> None:
    """ConfigError when arrays / inline tables nest deeper than MAX_NESTING, found on the raw text
    (brackets outside strings and comments) before tomllib, which recurses once per level."""
    depth = 0
    for token in _TOML_TOKENS.finditer(text):
        bracket = token.group()
        if bracket in ("[", "{"):
            depth += 1
            if depth > MAX_NESTING:
                line = text.count("\n", 0, token.start()) + 1
                raise ConfigError(f"{where}: line {line}: arrays or tables nested more than {MAX_NESTING} deep; "
                                  "a job file may nest at most that")  # fmt: skip
        elif bracket in ("]", "}"):
            depth = max(depth - 1, 0)


# Strings (basic, literal, multi-line) and comments, matched whole so that their brackets are
# skipped, or a single bracket.
_TOML_TOKENS = re.compile(
    r'"""(?:\\.|[^\\])*?"""' r"|'''.*?'''" r'|"(?:\\.|[^"\\\n])*"' r"|'[^'\n]*'" r"|#[^\n]*" r"|[\[\]{}]",
    re.DOTALL,
)


def _parse_value(text: str, where: str) -> Any:
    """A CLI value as a TOML value (20, 1e-3, true, ["a"]) or else the plain string."""
    _check_nesting(text, where)
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(raw: dict[str, Any], args: list[str]) -> dict[str, Any]:
    """TorchTitan-style `--section.key value` / `--section.key=value` overrides, in order."""
    out = {section: dict(values) if isinstance(values, dict) else values for section, values in raw.items()}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(f"unexpected argument {arg!r}; overrides look like --section.key value")
        name, _, value = arg[2:].partition("=")
        if not _:
            if i + 1 < len(args) and not args[i + 1].startswith("--"):
                value, i = args[i + 1], i + 1
            else:
                value = "true"  # a bare flag switches a boolean on
        section, _, key = name.partition(".")
        path = key.split(".")
        nested = len(path) > 1 and getattr(SCHEMA.get(section, {}).get(path[0]), "type", None) is dict
        if not section or not all(path) or (len(path) > 1 and not nested):
            raise ConfigError(f"override {arg!r} must name one key as --section.key (--section.table.key "
                              "inside a table key such as data.mix)")  # fmt: skip
        if not isinstance(out.get(section, {}), dict):
            raise ConfigError(f"[{section}] is not a table")
        table = out.setdefault(section, {})
        for depth, part in enumerate(path[:-1]):  # copied on the way down: `raw` stays as read
            inner = table.get(part, {})
            if not isinstance(inner, dict):
                raise ConfigError(f"[{section}] {'.'.join(path[: depth + 1])} is not a table")
            table[part] = dict(inner)
            table = table[part]
        table[path[-1]] = _parse_value(value, f"override --{name}")
        i += 1
    return out


def load_job(path: str | Path, overrides: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """Read, override and validate a job file (see the module docstring)."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{path} is a directory, not a job file")
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_JOB_BYTES + 1)  # bounded: a path may be a device or a pipe
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e}") from e
    if len(data) > MAX_JOB_BYTES:
        raise ConfigError(f"{path} is larger than {MAX_JOB_BYTES >> 20} MiB, the most a job file may hold")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path} is not UTF-8 text (byte {e.start}): not a job file") from e
    _check_nesting(text, str(path))
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path} is not valid TOML: {e}") from e
    cfg = validate(apply_overrides(raw, overrides or []))
    cfg["_path"] = str(path)
    return cfg


def dryrun_command(path: str | Path, world_size: int, overrides: list[str] | None = None) -> str:
    """The command that measures a job's memory per GPU on a machine without GPUs (`flashcp.titan.dryrun`):
    named wherever a check passes or fails for lack of GPUs, since no other check sees activations."""
    argv = ["python", "-m", "flashcp.titan.dryrun", "--config", str(path), "--world-size", str(world_size)]
    return shlex.join([*argv, *(overrides or [])])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Check a FlashCP job file without launching anything.")
    parser.add_argument("--check", metavar="CONFIG", required=True, help="job file or name in train_configs/")
    parser.add_argument("--world-size", type=int, help="number of ranks to check the layout for")
    args, overrides = parser.parse_known_args(argv)
    try:
        path = resolve_config_path(args.check)
        cfg = load_job(path, overrides)
        world = args.world_size or world_size_hint(cfg)
        if world is None:
            print(f"{path}: OK (data_parallel_shard_degree = -1: pass --world-size to check a layout)")
            return 0
        deg = check_layout(cfg, world)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{path}: OK for {world} ranks: " + ", ".join(f"{k}={v}" for k, v in deg.items()))
    if cfg["model"]["attention"] == "flashcp":  # the jobs the dry run builds
        print(f"memory per GPU, checked without GPUs: {dryrun_command(path, world, overrides)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
