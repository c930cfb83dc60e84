"""RoPE base and scaling of a model, as Hugging Face's config.json and the job's `[model]` keys say.

One `Rope` value describes the rotary embedding a model trains with; it is read from a base
model's config.json (`rope_parameters` in transformers 5, `rope_theta` + `rope_scaling` before),
changed by the job's `[model] rope_*` keys, written back into an export's config.json and turned
into TorchTitan's RoPE config (`flashcp.titan.models.decoders`). Supported scalings: none, llama3 (Llama
3.1's NTK-by-parts wavelength bands) and yarn. YaRN's attention factor ("mscale") multiplies HF's
cos / sin, i.e. both q and k, so it scales the attention logits by its square: FlashCP passes that
square in the softmax scale (TorchTitan's RoPE stays a pure rotation).

Job keys (flat, in `[model]`; unset = the base model's value):
    rope_theta, rope_scaling = "none" | "llama3" | "yarn", rope_factor,
    rope_original_max_position_embeddings, rope_low_freq_factor, rope_high_freq_factor (llama3),
    rope_beta_fast, rope_beta_slow, rope_attention_factor (yarn).
A base model's scaling is kept unless the job sets `rope_scaling`; a job that names another type
starts from that type's defaults; single `rope_*` keys change the kept or chosen scaling.

Pure Python: imported by the pre-launch checks (`flashcp.titan.config`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

SCALINGS = ("none", "llama3", "yarn")
# [model] key -> Rope field, for the keys that only make sense with a scaling.
SCALING_KEYS = {
    "rope_factor": "factor",
    "rope_original_max_position_embeddings": "original_max_position_embeddings",
    "rope_low_freq_factor": "low_freq_factor",
    "rope_high_freq_factor": "high_freq_factor",
    "rope_beta_fast": "beta_fast",
    "rope_beta_slow": "beta_slow",
    "rope_attention_factor": "attention_factor",
}
KEYS_OF = {
    "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor"),
    "none": (),
}


class RopeError(ValueError):
    """A RoPE setting that cannot be trained; the message names it."""


@dataclass(frozen=True)
class Rope:
    """The rotary embedding: base and scaling, with HF's defaults for each scaling type."""

    theta: float
    scaling: str = "none"  # none | llama3 | yarn
    factor: float = 8.0
    original_max_position_embeddings: int = 8192
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn; None: 0.1 ln(factor) + 1, HF's default
    truncate: bool = True  # yarn: integer correction range (HF's default; gpt-oss style models set false)

    @property
    def yarn_attention_factor(self) -> float:
        """HF's multiplier of cos / sin (1 unless yarn)."""
        if self.scaling != "yarn":
            return 1.0
        return self.attention_factor if self.attention_factor is not None else _mscale(self.factor)

    @property
    def softmax_scale_factor(self) -> float:
        """What the attention logits are multiplied by on top of 1 / sqrt(head_dim)."""
        return self.yarn_attention_factor**2

    def check(self) -> None:
        """RopeError unless every value is one RoPE can use."""
        if self.scaling not in SCALINGS:
            raise RopeError(
                f"rope scaling {self.scaling!r} is not supported; supported: {', '.join(SCALINGS)}"
            )
        if not self.theta > 0:
            raise RopeError(f"rope_theta must be > 0, got {self.theta}")
        if self.scaling == "none":
            return
        if not self.factor >= 1:
            raise RopeError(f"rope_factor must be >= 1 with {self.scaling} scaling, got {self.factor}")
        if self.original_max_position_embeddings < 1:
            raise RopeError(
                "rope_original_max_position_embeddings must be >= 1, got "
                f"{self.original_max_position_embeddings}"
            )
        if self.scaling == "llama3" and not 0 < self.low_freq_factor < self.high_freq_factor:
            raise RopeError(
                f"llama3 scaling needs 0 < rope_low_freq_factor < rope_high_freq_factor, got "
                f"{self.low_freq_factor} and {self.high_freq_factor}"
            )
        if self.scaling == "yarn":
            if not self.beta_fast > self.beta_slow > 0:
                raise RopeError(
                    "yarn scaling needs rope_beta_fast > rope_beta_slow > 0, got "
                    f"{self.beta_fast} and {self.beta_slow}"
                )
            if self.attention_factor is not None and not self.attention_factor > 0:
                raise RopeError(f"rope_attention_factor must be > 0, got {self.attention_factor}")


def _mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention factor for a context `factor` times longer (HF's get_mscale)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


# Each family's RoPE in TorchTitan's flavors (tests/titan/test_hf_config.py checks them), also what a
# custom size takes: Llama 3.1's scaling in every Llama 3 flavor, none in Qwen3's; DeepSeek-V3's YaRN
# from 4K, 40x, its correction in the softmax scale (MLA's RoPE is a pure rotation: attention factor 1).
FAMILY_ROPE = {
    "llama3": Rope(theta=500000.0, scaling="llama3"), "qwen3": Rope(theta=1000000.0),
    "deepseek_v3": Rope(theta=10000.0, scaling="yarn", factor=40.0, original_max_position_embeddings=4096,
                        attention_factor=1.0),
    "gpt_oss": Rope(theta=150000.0, scaling="yarn", factor=32.0, original_max_position_embeddings=4096,
                    truncate=False),
}  # fmt: skip


def attention_scale_factor(name: str, rope: Rope) -> float:
    """What FlashCP's attention multiplies family `name`'s softmax scale by under `rope`: YaRN's attention
    factor squared, less what TorchTitan's attention of the family already folds in (gpt-oss: the default
    factor, 0.1 ln(factor) + 1, squared), so that a config's own attention_factor still counts once."""
    if name == "gpt_oss" and rope.scaling == "yarn":
        return (rope.yarn_attention_factor / _mscale(rope.factor)) ** 2
    return rope.softmax_scale_factor


def rope_from_hf(hf: dict[str, Any], default_theta: float) -> Rope:
    """The Rope of an HF config.json (either layout); RopeError for a scaling FlashCP cannot train."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise RopeError(f"rope_scaling / rope_parameters must be an object, got {params!r}")
    if any(isinstance(v, dict) for v in params.values()):
        raise RopeError("RoPE parameters per layer type are not supported (one RoPE for every layer)")
    theta = float(params.get("rope_theta", hf.get("rope_theta", default_theta)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return Rope(theta=theta)
    if kind not in ("llama3", "yarn"):
        raise RopeError(f"rope type {kind!r} is not supported; supported: default, llama3, yarn")
    original = int(
        params.get("original_max_position_embeddings") or hf.get("max_position_embeddings") or 8192
    )
    factor = params.get("factor")
    if factor is None and kind == "yarn":  # HF: the ratio of the context to the original one
        factor = hf["max_position_embeddings"] / original
    values: dict[str, Any] = {"theta": theta, "scaling": kind, "original_max_position_embeddings": original}
    if factor is not None:
        values["factor"] = float(factor)
    if kind == "llama3":
        for name in ("low_freq_factor", "high_freq_factor"):
            if params.get(name) is not None:
                values[name] = float(params[name])
    else:
        for name in ("beta_fast", "beta_slow", "attention_factor"):
            if params.get(name):  # HF treats 0 / null as unset
                values[name] = float(params[name])
        if params.get("mscale") and params.get("mscale_all_dim") and params.get("attention_factor") is None:
            factor = values.get("factor", 1.0)
            values["attention_factor"] = _mscale(factor, params["mscale"]) / _mscale(
                factor, params["mscale_all_dim"]
            )
        if "truncate" in params:
            values["truncate"] = bool(params["truncate"])
    rope = Rope(**values)
    rope.check()
    return rope


def rope_to_hf(rope: Rope) -> dict[str, Any]:
    """`rope_theta` and `rope_scaling` as config.json holds them (read by transformers 4.x and 5.x)."""
    if rope.scaling == "none":
        return {"rope_theta": rope.theta, "rope_scaling": None}
    scaling: dict[str, Any] = {"rope_type": rope.scaling}
    scaling |= {name: getattr(rope, name) for name in KEYS_OF[rope.scaling] if name != "attention_factor"}
    if rope.scaling == "yarn":
        scaling["attention_factor"] = rope.yarn_attention_factor
        scaling["truncate"] = rope.truncate
    return {"rope_theta": rope.theta, "rope_scaling": scaling}


def rope_for_job(base: Rope, model_cfg: dict[str, Any]) -> Rope:
    """The base model's Rope changed by the job's `[model] rope_*` keys (None = unset)."""
    rope = base
    if model_cfg.get("rope_theta") is not None:
        rope = dataclasses.replace(rope, theta=float(model_cfg["rope_theta"]))
    scaling = model_cfg.get("rope_scaling")
    if scaling is not None and scaling != rope.scaling:
        rope = Rope(theta=rope.theta, scaling=scaling)  # another type: its own defaults
    given = {field: model_cfg[key] for key, field in SCALING_KEYS.items() if model_cfg.get(key) is not None}
    if scaling not in (None, "none", base.scaling):
        missing = [key for key in ("rope_factor", "rope_original_max_position_embeddings")
                   if SCALING_KEYS[key] not in given]  # fmt: skip
        if missing:
            raise RopeError(f"rope_scaling = {scaling!r} needs {' and '.join(missing)} (the model has "
                            f"{base.scaling!r} scaling)")  # fmt: skip
    stray = [
        key for key, field in SCALING_KEYS.items() if field in given and field not in KEYS_OF[rope.scaling]
    ]
    if stray:
        raise RopeError(
            f"{', '.join(stray)} {'does' if len(stray) == 1 else 'do'} not apply to rope scaling "
            f"{rope.scaling!r}"
            + (" (the model's own; set rope_scaling to choose one)" if scaling is None else "")
        )
    rope = dataclasses.replace(rope, **given)
    rope.check()
    return rope
