"""What each model family does not run (yet), refused before anything starts, with the reason.

Mixture-of-experts settings need experts; MLA (DeepSeek-V3), gpt-oss (sinks, sliding windows) and
Qwen3.5 (hybrid Gated DeltaNet) each refuse the settings their attention cannot serve, in one line
naming the setting, why, and the family.
"""

from __future__ import annotations

import json
from pathlib import Path

from flashcp.titan.config.converters import model_compiled
from flashcp.titan.config.keys import ConfigError
from flashcp.titan.config.model import model_experts, model_latent


def check_families(cfg: dict) -> None:
    """Every family's refusals (a validated job's sections)."""
    _check_experts(cfg)
    _check_latent(cfg)
    _check_sinks(cfg)
    _check_hybrid(cfg)


def _refuse(refused: list[tuple[bool, str]], family: str) -> None:
    """ConfigError for the first (bad, what) that holds: "<what>: not with <family>"."""
    for bad, what in refused:
        if bad:
            raise ConfigError(f"{what}: not with {family}")


def _check_experts(cfg: dict) -> None:
    """Expert settings need a mixture-of-experts model; forced round-robin routing stays out of checkpoints."""
    par, debug, model = cfg["parallelism"], cfg["debug"], cfg["model"]
    ep, forced = par["expert_parallel_degree"], debug["moe_force_load_balance"]
    experts = model_experts(cfg)
    if experts is None and (ep != 1 or forced):
        name = "[parallelism] expert_parallel_degree" if ep != 1 else "[debug] moe_force_load_balance"
        raise ConfigError(f"{name} applies to mixture-of-experts models; {model['name']} {model['flavor']!r} is dense "
                          "(Qwen3-MoE: flavor debugmodel_moe, 30B-A3B, 235B-A22B or a qwen3_moe hf_config; "
                          "any deepseek_v3)")  # fmt: skip
    if experts is not None and experts.num_experts % ep:
        raise ConfigError(f"[parallelism] expert_parallel_degree ({ep}) must divide the model's {experts.num_experts} "
                          "experts: each EP rank holds the same number")  # fmt: skip
    if forced and cfg["checkpoint"]["enable"]:
        raise ConfigError("[debug] moe_force_load_balance routes tokens round-robin, ignoring the router (debugging "
                          "only): not with [checkpoint] enable = true, which would save or resume such weights as a "
                          "real run's")  # fmt: skip
    if experts is not None and cfg["activation_checkpoint"]["mlp_tiles"] not in (0, 1):
        raise ConfigError(f"[activation_checkpoint] mlp_tiles = {cfg['activation_checkpoint']['mlp_tiles']} tiles "
                          "dense feed-forward layers; this model's are routed experts (set mlp_tiles = 0)")  # fmt: skip


def _check_latent(cfg: dict) -> None:
    """What FlashCP's MLA (`flashcp.titan.models.latent`) does not run yet, refused with the reason."""
    if model_latent(cfg) is None or cfg["model"]["attention"] != "flashcp":
        return
    flashcp = cfg["flashcp"]
    refused = [
        (flashcp["comm"] == "ring", "[flashcp] comm = 'ring' (the latent exchange runs compact, full, needed "
                                    "and two_level)"),
    ]  # fmt: skip
    _refuse(refused, f"an MLA model ({cfg['model']['name']}), whose attention is FlashCP's latent exchange")


def _check_sinks(cfg: dict) -> None:
    """gpt-oss under FlashCP's attention: its sinks need a kernel returning the LSE and an exchange that
    takes them and its sliding windows (not the ring)."""
    model, flashcp = cfg["model"], cfg["flashcp"]
    if model["name"] != "gpt_oss" or model["attention"] != "flashcp":
        return
    refused = [
        # TorchTitan 0.3.0's ScaledBiasRowwiseLinear adds wo.bias / TP on each TP rank but takes the bias's
        # local gradient as the replicated one: 1/TP of it (tests/titan/test_hf_import_ranks.py).
        (cfg["parallelism"]["tensor_parallel_degree"] != 1, "[parallelism] tensor_parallel_degree > 1 (TorchTitan's "
                                                            "TP plan leaves attention.wo.bias's gradient 1/TP of its value)"),
        (flashcp["backend"] == "flash_attn", "[flashcp] backend = 'flash_attn' (its kernel returns no LSE, which "
                                             "the sinks need; auto, torch and reference do)"),
        (flashcp["comm"] == "ring", "[flashcp] comm = 'ring' (the ring takes neither sinks nor sliding windows)"),
    ]  # fmt: skip
    _refuse(refused, "a gpt_oss model (learned sinks in every attention layer)")


def _check_hybrid(cfg: dict) -> None:
    """What FlashCP's Qwen3.5 (`flashcp.titan.models.gated_deltanet`) does not run yet, refused with the reason."""
    if cfg["model"]["name"] != "qwen3_5":
        return
    flashcp, par, ckpt = cfg["flashcp"], cfg["parallelism"], cfg["checkpoint"]
    refused = [
        (cfg["model"]["attention"] != "flashcp", f"[model] attention = {cfg['model']['attention']!r} (its Gated "
                                                 "DeltaNet layers run on FlashCP's ops only)"),
        (par["tensor_parallel_degree"] != 1, "[parallelism] tensor_parallel_degree > 1 (no TP plan for its layers)"),
        (model_compiled(cfg), "[compile] enable with 'model' (the linear-attention ops are not registered ops yet)"),
        (flashcp["comm"] == "ring", "[flashcp] comm = 'ring' (no ring dispatch beside the linear layers')"),
        (flashcp["overlap"], "[flashcp] overlap = true"),
        (ckpt["initial_load_in_hf"] and _vision_folder(ckpt["initial_load_path"]),
         f"[checkpoint] initial_load_path {ckpt['initial_load_path']} is a vision-language folder (its text weights "
         "are model.language_model.*, beside model.visual.*; FlashCP imports a text-only Qwen3_5ForCausalLM "
         "folder's model.*)"),
    ]  # fmt: skip
    _refuse(refused, "a qwen3_5 model (hybrid Gated DeltaNet)")


def _vision_folder(folder: str) -> bool:
    """Whether the HF folder's config.json is a vision-language model's (checked again when its
    weights are read: their names would not match)."""
    try:
        hf = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):  # none or unreadable: the folder's own check names it
        return False
    if not isinstance(hf, dict):
        return False
    return "vision_config" in hf or any("ConditionalGeneration" in str(c) for c in hf.get("architectures") or ())
