"""Hugging Face <-> TorchTitan state-dict adapters: TorchTitan's, where it lacks a case, completed.

    adapter = ADAPTERS[family](model_config, hf_assets_path)   # via decoders.state_dict_adapter
    hf_state = adapter.to_hf(titan_state); titan_state = adapter.from_hf(hf_state)

- Llama 3 and Qwen3 (Qwen3-MoE too): TorchTitan's own adapters.
- DeepSeek-V3 and gpt-oss with tied embeddings (`TiedHead`): the folder stores only the embedding,
  which is also the output projection's weight (TorchTitan 0.3.0 maps lm_head.weight always).
- gpt-oss (`GptOssStateDictAdapter`): TorchTitan 0.3.0 names only the MXFP4 `*_blocks` of the
  released checkpoints (and expert names its experts no longer have); this one maps transformers'
  unquantized experts, `GptOssExperts`'s [E, in, out] matrices with gate and up interleaved in the
  last dim as TorchTitan's SwiGLU reads them (`x[..., ::2]`, `x[..., 1::2]`), to TorchTitan's
  [E, out, in]: a transpose, nothing permuted. The transposes are views (a DTensor's too, its
  placements moved with the dims), so DCP's HF reader fills the model's own parameters, each rank
  its share of the experts.
- Qwen3.5's text decoder (`Qwen35TextStateDictAdapter`): TorchTitan's adapter names the released
  vision-language checkpoints' text weights (`model.language_model.*`); a text-only
  `Qwen3_5ForCausalLM` folder, the only kind FlashCP trains from, holds them as `model.*`.
"""

from __future__ import annotations

from typing import Any

from torchtitan.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter
from torchtitan.models.gpt_oss.state_dict_adapter import GptOssStateDictAdapter as TitanGptOssStateDictAdapter
from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter
from torchtitan.protocols.state_dict_adapter import BaseStateDictAdapter

from flashcp.titan.compat import import_qwen3_5

HEAD, EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"
TEXT, VLM_TEXT = "model.", "model.language_model."  # a Qwen3.5 text folder's prefix, and the VLM's
_EXPERTS = "moe.routed_experts.inner_experts"
# transformers' unquantized gpt-oss experts -> TorchTitan's, and whether the matrix is transposed.
GPT_OSS_EXPERTS = {"gate_up_proj": ("mlp1_weight_EGD", True), "gate_up_proj_bias": ("mlp1_bias_EG", False),
                   "down_proj": ("mlp2_weight_EDF", True), "down_proj_bias": ("mlp2_bias_ED", False)}  # fmt: skip


class TiedHead:
    """An adapter mixin for tied embeddings, as TorchTitan's Qwen3 adapter handles them: the HF folder
    of a tied model stores the embedding only."""

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        if self.model_config.enable_weight_tying:
            state_dict = {k: v for k, v in state_dict.items() if k != HEAD}
            if self.fqn_to_index_mapping:
                self.fqn_to_index_mapping.pop(HEAD, None)
        return super().to_hf(state_dict)

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        if self.model_config.enable_weight_tying and HEAD not in hf_state_dict:
            hf_state_dict = hf_state_dict | {HEAD: hf_state_dict[EMBEDDING]}
        return super().from_hf(hf_state_dict)


class TiedDeepSeekV3StateDictAdapter(TiedHead, DeepSeekV3StateDictAdapter):
    """TorchTitan's DeepSeek-V3 adapter, tied embeddings included."""


class GptOssStateDictAdapter(TiedHead, TitanGptOssStateDictAdapter):
    """TorchTitan's gpt-oss adapter for everything but the experts, which map to and from transformers'
    unquantized names (see the module docstring)."""

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        experts = {k: v for k, v in state_dict.items() if f".{_EXPERTS}." in k}
        out = super().to_hf({k: v for k, v in state_dict.items() if k not in experts})
        ours = {titan: (hf, transposed) for hf, (titan, transposed) in GPT_OSS_EXPERTS.items()}
        for key, value in experts.items():
            layer, name = key.split(".")[1], key.rpartition(".")[2]
            hf, transposed = ours[name]
            out[f"model.layers.{layer}.mlp.experts.{hf}"] = value.transpose(1, 2) if transposed else value
        return out

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        experts = {k: v for k, v in hf_state_dict.items() if k.rpartition(".")[2] in GPT_OSS_EXPERTS
                   and ".mlp.experts." in k}  # fmt: skip
        out = super().from_hf({k: v for k, v in hf_state_dict.items() if k not in experts})
        for key, value in experts.items():
            layer, name = key.split(".")[2], key.rpartition(".")[2]
            titan, transposed = GPT_OSS_EXPERTS[name]
            out[f"layers.{layer}.{_EXPERTS}.{titan}"] = value.transpose(1, 2) if transposed else value
        return out


class Qwen35TextStateDictAdapter(import_qwen3_5().Qwen35StateDictAdapter):
    """TorchTitan's Qwen3.5 adapter with the text-only folder's names (see the module docstring)."""

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return {_renamed(k, VLM_TEXT, TEXT): v for k, v in super().to_hf(state_dict).items()}

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        return super().from_hf({_renamed(k, TEXT, VLM_TEXT): v for k, v in hf_state_dict.items()})


def _renamed(key: str, old: str, new: str) -> str:
    """`key` with the prefix `old` replaced by `new` (other keys, lm_head.weight, as they are)."""
    return new + key.removeprefix(old) if key.startswith(old) else key


ADAPTERS: dict[str, type[BaseStateDictAdapter]] = {
    "llama3": Llama3StateDictAdapter,
    "qwen3": Qwen3StateDictAdapter,
    "deepseek_v3": TiedDeepSeekV3StateDictAdapter,
    "gpt_oss": GptOssStateDictAdapter,
    "qwen3_5": Qwen35TextStateDictAdapter,
}
