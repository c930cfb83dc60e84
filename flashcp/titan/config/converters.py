"""`[model] converters`: TorchTitan 0.3.0's low-precision linear converters, set from a job file.

TorchTitan 0.3.0 converts the model config before the model is built (`ModelConfigConverter`:
`Float8LinearConverter`, `MXFP8LinearConverter` swap matching `Linear.Config`s for torchao's
modules), so the conversion precedes TP, activation checkpointing, compile and FSDP, which act on
the built model. `[model] converters = ["float8"]` (or `["mx"]`) names them; `[float8]` and `[mx]`
hold their config classes' fields, read from TorchTitan as its other sections are
(`flashcp.titan.config.titan.class_keys`); `model_compile_enabled` comes from `[compile]`.
Attention is not a Linear: FlashCP's op (and TorchTitan's flex) keeps its dtype.

Both need torchao and recent GPUs: `converter_problem` names what is missing, and the layout check
refuses the job before launch with it (`flashcp.titan.config.layout`).
"""

from __future__ import annotations

import dataclasses
import importlib
from importlib.util import find_spec
from typing import Any

from torchtitan.components.quantization import Float8LinearConverter, MXFP8LinearConverter

from flashcp.titan.config.keys import ConfigError, Key
from flashcp.titan.config.titan import class_keys

# Converter name in [model] converters -> TorchTitan's config class, its section of the same name.
CONVERTERS: dict[str, type] = {"float8": Float8LinearConverter.Config, "mx": MXFP8LinearConverter.Config}
# What each runs on (TorchTitan's converters check the same): Float8 on NVIDIA sm_89 (Ada, Hopper) or
# newer, or AMD MI300 (gfx942); MXFP8 on NVIDIA sm_100 (Blackwell) or newer.
MIN_CAPABILITY = {"float8": (8, 9), "mx": (10, 0)}
ROCM_CAPABILITY = {"float8": (9, 4)}
REQUIREMENT = {"float8": "an NVIDIA GPU of compute capability >= 8.9 or an AMD MI300",
               "mx": "an NVIDIA GPU of compute capability >= 10.0"}  # fmt: skip
# torchao's module TorchTitan imports for each (its converter is None when the import failed).
TORCHAO_MODULE = {"float8": ("float8", "Float8Linear", "torchao.float8"),
                  "mx": ("mx", "MXFP8Linear", "torchao.prototype.moe_training.mxfp8_linear")}  # fmt: skip
NAMES = {"float8": "Float8", "mx": "MXFP8"}
# Defaults FlashCP changes, and why: the output projection stays in bf16, as in TorchTitan's own
# recipes (Llama 3 405B's float8 filter_fqns = ["lm_head"]; NVFP4's fqns = ["layers"]).
OWN_DEFAULTS = {
    ("float8", "filter_fqns"): ["lm_head"],
    ("mx", "fqns"): ["layers"],
}
FILLED = "model_compile_enabled"  # from [compile] enable and "model" in components
DOCS = {
    ("float8", "recipe_name"): "torchao's recipe: rowwise (the three matmuls in float8, per-row scales) | "
                               "rowwise_with_gw_hp (the weight gradient's in high precision)",
    ("float8", "filter_fqns"): "linears whose name contains one of these stay in high precision (and any with a "
                               "size not divisible by 16)",
    ("float8", "emulate"): "float8 emulated in high precision, eager only: TorchTitan's test mode, no GPU needed",
    ("mx", "fqns"): "only linears whose name contains one of these are converted ([]: all)",
}  # fmt: skip


def _keys(name: str) -> dict[str, Key]:
    keys = class_keys(CONVERTERS[name], name)
    del keys[FILLED]
    for field, key in keys.items():
        doc = DOCS.get((name, field), "")
        if (name, field) in OWN_DEFAULTS:
            key = dataclasses.replace(key, default=OWN_DEFAULTS[name, field])
            doc += "; FlashCP's default keeps the output projection in high precision, as TorchTitan's recipes do"
        keys[field] = dataclasses.replace(key, doc=doc)
    return keys


CONVERTER_KEYS: dict[str, dict[str, Key]] = {name: _keys(name) for name in CONVERTERS}


def check_converters(cfg: dict, given: dict[str, list[str]]) -> None:
    """Known names, at most one linear converter, and no `[float8]` / `[mx]` settings left unused."""
    names = cfg["model"]["converters"]
    unknown = [n for n in names if n not in CONVERTERS]
    if unknown:
        raise ConfigError(f"[model] converters: unknown {unknown[0]!r}; allowed: {', '.join(CONVERTERS)}")
    if len(names) > 1:
        raise ConfigError(f"[model] converters = {names}: both swap the same linears; name one of "
                          f"{', '.join(CONVERTERS)}")  # fmt: skip
    for name in CONVERTERS:
        if given.get(name) and name not in names:
            raise ConfigError(f"[{name}] settings need [model] converters = [{name!r}]")
    if "float8" in names and cfg["float8"]["emulate"] and model_compiled(cfg):
        raise ConfigError("[float8] emulate = true runs in eager mode only (TorchTitan's Float8 emulation): "
                          "not with [compile] enable and 'model' in components")  # fmt: skip


def model_compiled(cfg: dict) -> bool:
    """The job compiles the model's blocks: [compile] enable with "model" in components."""
    return cfg["compile"]["enable"] and "model" in cfg["compile"]["components"]


def converter_configs(cfg: dict) -> list[Any]:
    """TorchTitan's converter configs for a validated job, in the order of `[model] converters`."""
    return [CONVERTERS[name](model_compile_enabled=model_compiled(cfg), **cfg[name]) for name in cfg["model"]["converters"]]


def converter_problem(name: str, emulate: bool, has_cuda: bool, capability: tuple[int, int] | None = None,
                      rocm: bool = False) -> str | None:  # fmt: skip
    """Why converter `name` cannot run on this machine, one line (None: it can): torchao missing (or
    without the module TorchTitan imports), no GPU, or a GPU too old. `capability`: the GPU's compute
    capability; `emulate`: TorchTitan's Float8 emulation, which needs no GPU."""
    problems = []
    if not torchao_module(name):
        installed = find_spec("torchao") is not None
        module = TORCHAO_MODULE[name][2]
        problems.append(f"this torchao has no {module}" if installed else "torchao is not installed")
    if not (name == "float8" and emulate):
        if not has_cuda:
            problems.append(f"{NAMES[name]} needs {REQUIREMENT[name]} and this machine has no GPU")
        elif not _runs_on(name, capability, rocm):
            shown = ".".join(map(str, capability))
            problems.append(f"{NAMES[name]} needs {REQUIREMENT[name]}; this GPU's compute capability is {shown}")
    return "; ".join(problems) or None


def torchao_module(name: str) -> bool:
    """Whether TorchTitan could import torchao's module for `name` (it sets the class to None otherwise)."""
    module, cls, _ = TORCHAO_MODULE[name]
    return getattr(importlib.import_module(f"torchtitan.components.quantization.{module}"), cls) is not None


def _runs_on(name: str, capability: tuple[int, int], rocm: bool) -> bool:
    if rocm:
        return name in ROCM_CAPABILITY and capability >= ROCM_CAPABILITY[name]
    return capability >= MIN_CAPABILITY[name]


def converted_linears(model_config: Any, cfg: dict) -> list[tuple[str, Any]]:
    """(fqn, Linear.Config) of every linear the job's converter would swap, by TorchTitan's own rules:
    Float8's `module_filter_fn` (sizes divisible by 16, no `filter_fqns` match; "auto_filter_small_kn",
    torchao's size filter, is left out: more linears, so an upper bound), MXFP8's `fqns` match."""
    from torchtitan.components.quantization.utils import module_filter_fn
    from torchtitan.models.common.linear import Linear

    names = cfg["model"]["converters"]
    if not names:
        return []
    linears = list(model_config.traverse(Linear.Config))
    if names[0] == "float8":
        skip = [f for f in cfg["float8"]["filter_fqns"] if f != "auto_filter_small_kn"]
        return [(fqn, lin) for fqn, lin, _, _ in linears if module_filter_fn(lin, fqn, skip)]
    fqns = cfg["mx"]["fqns"]
    return [(fqn, lin) for fqn, lin, _, _ in linears if not fqns or any(f in fqn for f in fqns)]
