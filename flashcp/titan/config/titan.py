"""TorchTitan's sections of a job file, read from TorchTitan 0.3.0's own config classes.

`[training]`, `[optimizer]`, `[lr_scheduler]`, `[parallelism]`, `[checkpoint]`, `[metrics]`,
`[activation_checkpoint]`, `[compile]`, `[comm]`, `[profiler]` and `[debug]` hold the fields of the
class `FlashCPTrainer.Config` has under that name, with TorchTitan's names, types, Literal choices
and defaults (`dataclasses.fields`, `typing.get_type_hints`), so a TorchTitan upgrade brings its
settings along instead of a copied list falling behind. FlashCP departs from TorchTitan only where
the tables below say so, each with its reason: fields FlashCP fills itself, a few settings kept
under FlashCP's earlier names, and defaults that differ. `titan_configs` turns a validated job
back into those classes (the validator runs their own `__post_init__` checks before launch).

Only these config modules are imported here, not TorchTitan's trainer, so a job file is checked
without building anything.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import tyro
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
from torchtitan.components.optimizer.optimizer import ParamGroupConfig
from torchtitan.config.configs import CommConfig, CompileConfig, DebugConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed.activation_checkpoint import ActivationCheckpointingConfig
from torchtitan.tools.profiler import Profiler

from flashcp.titan import compat
from flashcp.titan.components.checkpoint import Checkpointer
from flashcp.titan.config.keys import field_default, Key, key_from_hint
from flashcp.titan.components.metrics import FlashCPMetrics

# Section -> the class FlashCPTrainer.Config holds there (tests/titan/test_config.py keeps this
# table equal to FlashCPTrainer.Config's fields).
SECTIONS: dict[str, type] = {
    "training": TrainingConfig,
    "optimizer": OptimizersContainer.Config,
    "lr_scheduler": LRSchedulersContainer.Config,
    "parallelism": ParallelismConfig,
    "checkpoint": Checkpointer.Config,
    "metrics": FlashCPMetrics.Config,
    "compile": CompileConfig,
    "comm": CommConfig,
    "profiler": Profiler.Config,
    "debug": DebugConfig,
}


def _ac_modes() -> dict[str, type | None]:
    """`[activation_checkpoint] mode` -> its class, named as TorchTitan's CLI names its subcommands
    (selective, full, memory-budget, none)."""
    modes = {}
    for option in typing.get_args(ActivationCheckpointingConfig):
        cls, marker = typing.get_args(option)[:2]
        modes[marker.name] = None if cls is type(None) else cls
    return modes


AC_MODES = _ac_modes()
AC_DEFAULT = "selective"  # Trainer.Config's activation_checkpoint default: SelectiveAC.Config

# Trainer.Config fields that are no TorchTitan section of a job file, and where they come from.
NOT_SECTIONS = {
    "model_spec": "[model] (flashcp.titan.models.spec builds the spec with FlashCP's attention)",
    "hf_assets_path": "TorchTitan's tokenizer / HF weights folder: FlashCP reads [data] tokenizer and "
                      "[checkpoint] initial_load_path",
    "dump_folder": "[job] dump_folder",
    "tokenizer": "[data] tokenizer",
    "dataloader": "[data] and [flashcp] (FlashCP's window loader)",
    "loss": "[loss] (FlashCP's chunked cross-entropy; TorchTitan's BaseLoss.Config has no settings)",
    "validator": "[validation]",
    "override": "TorchTitan's code hooks (modules imported to replace its functions), not settings",
    "flashcp": "[flashcp]",
    "probe": "[probe] (flashcp.titan.probe: the retrieval probe, not a TorchTitan section)",
}  # fmt: skip

# Fields of the sections' classes that FlashCP sets itself, and why (not keys of a job file).
FILLED = {
    ("training", "disable_cuda_graphs"): "always true: every window has its own plan, so shapes change "
                                         "from step to step",
    ("optimizer", "param_groups"): "one group over every parameter, from [optimizer] name, lr, beta1, "
                                   "beta2, eps, weight_decay",
    ("optimizer", "optimizer_factory_kwargs_by_name"): "Python objects for DistMuon; Adam and AdamW take none",
    ("checkpoint", "model_record"): "the job's model, recorded in each manifest (flashcp.titan.launch.job)",
    ("validation", "dataloader"): "FlashCP's held-out window loader, from [validation] source "
                                  "(flashcp.titan.components.validate)",
}  # fmt: skip
# TorchTitan fields kept under FlashCP's earlier name: (section, field) -> (section, key).
RENAMED = {("debug", "seed"): ("training", "seed"), ("debug", "deterministic"): ("training", "deterministic")}
# Defaults FlashCP changes: (section, field) -> (default, why).
OWN_DEFAULTS = {
    ("training", "local_batch_size"): (1, "FlashCP plans whole windows: one per data-parallel rank and micro "
                                          "step (global_batch_size for more)"),
    ("checkpoint", "last_save_model_only"): (False, "full state in the last checkpoint too, so that a finished "
                                                    "run can be extended"),
    ("parallelism", "spmd_backend"): (None, "unset: partial_dtensor with FlashCP attention (its parallelize "
                                            "follows that recipe) and on torch < 2.14, else TorchTitan's"),
}
# Closed sets TorchTitan types as plain `str` (its docstring and distributed/context_parallel/api.py
# name them; None, no balancing, has no TOML form).
CHOICES = {("parallelism", "context_parallel_load_balancer"): ("headtail", "ptrr")}
# What a derived key means in FlashCP where TorchTitan's field says less (shown by --keys).
NOTES = {
    ("training", "seq_len"): "the context window C",
    ("parallelism", "data_parallel_shard_degree"): "-1: the ranks left after the other degrees",
    ("parallelism", "context_parallel_load_balancer"): "TorchTitan's CP only (model.attention = 'flex')",
    ("checkpoint", "folder"): "relative to job.dump_folder",
    ("checkpoint", "keep_latest_k"): "0 keeps all; 1 is not allowed (one may be mid-write)",
    ("checkpoint", "load_step"): "-1: the latest complete checkpoint",
    ("checkpoint", "load_unverified"): "let the checkpoint named by load_step / initial_load_path load without "
                                       "a manifest.json (one written by another tool): unverified",
    ("checkpoint", "create_seed_checkpoint"): "save the initial model as step-0 on 1 rank and exit: identical "
                                              "initial weights for any later layout",
    ("checkpoint", "initial_load_in_hf"): "initial_load_path is a Hugging Face model folder (safetensors)",
    ("checkpoint", "last_save_in_hf"): "also export the final checkpoint as a Hugging Face folder, "
                                       "<checkpoint folder>/step-N-hf (python -m flashcp.titan.export)",
    ("checkpoint", "export_dtype"): "dtype of the last_save_in_hf export (and of a model-only last save)",
    ("metrics", "peak_tflops"): "per-device peak for MFU (default: TorchTitan's GPU table; CPU: none)",
    ("comm", "mode"): "fake_backend: TorchTitan's dry-run process group (python -m flashcp.titan.dryrun)",
    ("debug", "seed"): "TorchTitan's [debug] seed",
    ("debug", "deterministic"): "TorchTitan's [debug] deterministic",
}  # fmt: skip
# FlashCP's own keys in TorchTitan's sections. TorchTitan 0.3.0's optimizer has no defaults (a
# param group names every kwarg); these are its Llama 3 recipes' values (models/llama3/config_registry.py).
OWN_KEYS: dict[str, dict[str, Key]] = {
    "optimizer": {
        "name": Key(str, "AdamW", ("AdamW", "Adam"), "optimizer_name of the one param group (every parameter)"),
        "lr": Key(float, 8e-4, doc="the param group's optimizer_kwargs lr"),
        "beta1": Key(float, 0.9, doc="the param group's betas[0]"),
        "beta2": Key(float, 0.95, doc="the param group's betas[1]"),
        "eps": Key(float, 1e-8, doc="the param group's eps"),
        "weight_decay": Key(float, 0.1, doc="the param group's weight_decay"),
    },
    "activation_checkpoint": {
        "mode": Key(str, AC_DEFAULT, tuple(AC_MODES), "TorchTitan's policy class (its CLI subcommand name)"),
        "offload": Key(bool, False, doc="mode = 'full' only: the layer inputs it keeps wait in pinned host memory "
                       "(flashcp.titan.models.offload)"),
        "mlp_tiles": Key(int, 0, doc="every mode: the MLP runs over this many sequence tiles, each recomputed in "
                         "backward, so its intermediate exists for one tile at a time (flashcp.titan.models."
                         "tiled_mlp); 0 or 1: untiled; -1: automatic, tiles whose intermediates fit 1 GiB"),
        "head_groups": Key(int, 1, doc="every mode: each attention layer runs over this many groups of KV heads, "
                           "each recomputed in backward, so q, K/V and o exist for one group at a time (flashcp."
                           "titan.models.head_groups); 1: off; -1: automatic, groups whose q, k, v, o fit 1 GiB"),
        "head_group_prefetch": Key(bool, False, doc="with head_groups: each group's K/V exchange is launched before "
                                   "the previous group's kernel, so it crosses the wire while that one computes "
                                   "(eager model only; one more group's exchange buffer held)"),
    },
}


def class_keys(cls: type, section: str) -> dict[str, Key]:
    """The settable fields of a config class (TorchTitan's CLI-suppressed ones left out) as Keys."""
    hints = typing.get_type_hints(cls, include_extras=True)
    keys = {}
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if (section, f.name) in FILLED or _suppressed(hint):
            continue
        default, why = OWN_DEFAULTS.get((section, f.name), (field_default(f), ""))
        key = key_from_hint(hint, default, f"{cls.__qualname__}.{f.name}")
        own = why and f"FlashCP's default ({why}); TorchTitan's: {field_default(f)!r}"
        note = NOTES.get((section, f.name)) or own
        choices = CHOICES.get((section, f.name), key.choices)
        keys[f.name] = dataclasses.replace(key, choices=choices, doc=note or "")
    return keys


def _suppressed(hint: Any) -> bool:
    """TorchTitan marks fields no user sets (set in code) with tyro.conf.Suppress."""
    return typing.get_origin(hint) is typing.Annotated and tyro.conf.Suppress in typing.get_args(hint)[1:]


def _section_keys() -> dict[str, dict[str, Key]]:
    sections: dict[str, dict[str, Key]] = {}
    for section, cls in SECTIONS.items():
        sections[section] = {**OWN_KEYS.get(section, {}), **class_keys(cls, section)}
    ac = dict(OWN_KEYS["activation_checkpoint"])
    for cls in filter(None, AC_MODES.values()):
        for name, key in class_keys(cls, "activation_checkpoint").items():
            if ac.setdefault(name, key) != key:
                raise TypeError(f"[activation_checkpoint] {name} differs between the policies")
    sections["activation_checkpoint"] = ac
    for (section, name), (to_section, to_name) in RENAMED.items():
        sections[to_section][to_name] = sections[section].pop(name)
    return sections


TITAN_KEYS = _section_keys()


def ac_keys(mode: str) -> set[str]:
    """The [activation_checkpoint] keys that apply to `mode`."""
    cls = AC_MODES[mode]
    own = {"mode", "mlp_tiles", "head_groups", "head_group_prefetch"} | ({"offload"} if mode == "full" else set())
    return own | ({f.name for f in dataclasses.fields(cls)} if cls is not None else set())


SEED_DEGREES = ("data_parallel_replicate", "data_parallel_shard", "context_parallel", "tensor_parallel")


def _values(cfg: dict, section: str, cls: type) -> dict[str, Any]:
    """The job's values of `cls`'s fields (renamed ones fetched from their FlashCP section)."""
    out = {}
    for f in dataclasses.fields(cls):
        if (section, f.name) in RENAMED:
            to_section, to_name = RENAMED[(section, f.name)]
            out[f.name] = cfg[to_section][to_name]
        elif f.name in cfg[section]:
            out[f.name] = cfg[section][f.name]
    return out


def section_config(cfg: dict, section: str) -> Any:
    """TorchTitan's config object for `section` of a validated job (ValueError from its own checks)."""
    if section == "activation_checkpoint":
        cls = AC_MODES[cfg[section]["mode"]]
        return None if cls is None else cls(**_values(cfg, section, cls))
    values = _values(cfg, section, SECTIONS[section])
    if section == "training":
        values["disable_cuda_graphs"] = True
    elif section == "optimizer":
        opt = cfg["optimizer"]
        kwargs = {"lr": opt["lr"], "betas": (opt["beta1"], opt["beta2"]), "eps": opt["eps"],
                  "weight_decay": opt["weight_decay"]}  # fmt: skip
        group = ParamGroupConfig(pattern=r".*", optimizer_name=opt["name"], optimizer_kwargs=kwargs)
        values["param_groups"] = [group]
    elif section == "parallelism":
        if cfg["checkpoint"]["create_seed_checkpoint"]:  # one rank, no sharding
            values |= {f"{name}_degree": 1 for name in SEED_DEGREES}
        if values["spmd_backend"] is None:
            flashcp_on = cfg["model"]["attention"] == "flashcp"
            values["spmd_backend"] = "partial_dtensor" if flashcp_on else compat.default_spmd_backend()
    elif section == "checkpoint":
        # Model-only applies to an initial load; without one TorchTitan would only warn that it has no effect.
        values["initial_load_model_only"] &= values["initial_load_path"] is not None
    return SECTIONS[section](**values)


def titan_configs(cfg: dict) -> dict[str, Any]:
    """Every TorchTitan section of a validated job as TorchTitan's config objects."""
    return {section: section_config(cfg, section) for section in TITAN_KEYS}
