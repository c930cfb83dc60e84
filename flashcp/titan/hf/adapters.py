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
  `Qwen3_5ForCausalLM` folder, the only kind FlashCP trains from, holds them as `model.*`. Its MoE
  text decoder's folders (`Qwen3_5MoeForCausalLM`, as transformers saves them) hold one tensor per
  expert (`mlp.experts.{e}.gate_proj.weight`, ...), as Qwen3-MoE's: mapped as TorchTitan's Qwen3
  adapter maps those (under EP each rank names, reads and stacks only its own experts); TorchTitan's
  Qwen3.5 adapter names the fused `experts.gate_up_proj` instead. Qwen3-Next's folders
  (`Qwen3NextForCausalLM`, `model_config.hf_layout` "qwen3_next") are those of the MoE text decoder
  with the Gated DeltaNet's q, k, v, z projections fused into `in_proj_qkvz` and b, a into
  `in_proj_ba`, interleaved per key-head group as transformers' `fix_query_key_value_ordering` reads
  them: for each key head g, [q_g (d_k rows), k_g (d_k), v_g (r d_v), z_g (r d_v)] and [b_g (r), a_g
  (r)], r value heads per key head. Fused on export and split on import by reshapes and one
  concatenation each: the round trip is bit-exact.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate
from torchtitan.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter
from torchtitan.models.gpt_oss.state_dict_adapter import GptOssStateDictAdapter as TitanGptOssStateDictAdapter
from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter
from torchtitan.models.utils import MoEStateDictAdapter
from torchtitan.protocols.state_dict_adapter import BaseStateDictAdapter

from flashcp.titan.compat import import_qwen3_5

HEAD, EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"
TEXT, VLM_TEXT = "model.", "model.language_model."  # a Qwen3.5 text folder's prefix, and the VLM's
_EXPERTS = "moe.routed_experts.inner_experts"
# transformers' unquantized gpt-oss experts -> TorchTitan's, and whether the matrix is transposed.
# TorchTitan's routed experts -> each expert's HF projection (Qwen3-MoE's and Qwen3.5-MoE's folders).
PER_EXPERT = {"w1_EFD": "gate_proj", "w3_EFD": "up_proj", "w2_EDF": "down_proj"}
_ONE_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight")
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


class Qwen35TextStateDictAdapter(import_qwen3_5().Qwen35StateDictAdapter, MoEStateDictAdapter):
    """TorchTitan's Qwen3.5 adapter with the text-only folder's names, one tensor per expert, and
    Qwen3-Next's fused projections (see the module docstring)."""

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        experts = {k: v for k, v in state_dict.items() if f".{_EXPERTS}." in k}
        rest = super().to_hf({k: v for k, v in state_dict.items() if k not in experts})
        out = {_renamed(k, VLM_TEXT, TEXT): v for k, v in rest.items()}
        for key, value in experts.items():
            layer, name = key.split(".")[1], key.rpartition(".")[2]
            hf = "model.layers.{}.mlp.experts.{}." + PER_EXPERT[name] + ".weight"
            if isinstance(value, DTensor):  # this rank's experts, as TorchTitan's Qwen3 adapter names them
                titan = f"layers.{{}}.{_EXPERTS}.{name}"
                self.grouped_expert_weight_placements[titan] = value.placements
                self.grouped_expert_weight_shape[titan] = value.shape
                self.grouped_expert_weight_mesh[titan] = value.device_mesh
                out |= self._get_local_experts_weights(hf, titan, layer, value)
            else:
                out |= {hf.format(layer, e): value[e] for e in range(value.shape[0])}
        return fuse_qwen3_next(out, self.model_config) if self._next else out

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        if self._next:
            hf_state_dict = split_qwen3_next(hf_state_dict, self.model_config)
        experts = {k: v for k, v in hf_state_dict.items() if _ONE_EXPERT.fullmatch(k)}
        out = super().from_hf({_renamed(k, TEXT, VLM_TEXT): v for k, v in hf_state_dict.items() if k not in experts})
        grouped: dict[str, dict[int, torch.Tensor]] = {}
        titan_names = {hf: titan for titan, hf in PER_EXPERT.items()}
        for key, value in experts.items():
            layer, expert, name = _ONE_EXPERT.fullmatch(key).groups()
            grouped.setdefault(f"layers.{layer}.{_EXPERTS}.{titan_names[name]}", {})[int(expert)] = value
        for key, parts in grouped.items():
            layer, abstract = key.split(".")[1], re.sub(r"\d+", "{}", key, count=1)
            if abstract in self.local_experts_indices:  # an EP-sharded DTensor's local experts (named by to_hf)
                out[key] = self._concatenate_expert_weights_dtensor({layer: {abstract: parts}}, abstract, layer)
            else:
                out[key] = torch.stack([parts[e] for e in sorted(parts)])
        return out

    @property
    def _next(self) -> bool:
        return getattr(self.model_config, "hf_layout", None) == "qwen3_next"


def _deltanet_groups(model_config: Any, layer: int) -> tuple[int, int, int, int]:
    """(key heads, d_k, value heads per key head r, d_v) of Gated DeltaNet layer `layer`."""
    net = model_config.layers[layer].delta_net
    key_heads = net.in_proj_q.out_features // net.key_head_dim
    value_heads = net.in_proj_v.out_features // net.value_head_dim
    return key_heads, net.key_head_dim, value_heads // key_heads, net.value_head_dim


def _whole(t: torch.Tensor) -> torch.Tensor:
    """`t` replicated when it is a DTensor (FSDP shards rows, which the per-group reshapes regroup)."""
    return t.redistribute(placements=[Replicate()] * t.device_mesh.ndim) if isinstance(t, DTensor) else t


_LINEAR = "model.layers.{}.linear_attn."


def fuse_qwen3_next(hf: dict[str, Any], model_config: Any) -> dict[str, Any]:
    """Qwen3.5's Gated DeltaNet names (in_proj_qkv, _z, _b, _a) -> Qwen3-Next's in_proj_qkvz and in_proj_ba."""
    out = dict(hf)
    for layer, net in enumerate(model_config.layers):
        prefix = _LINEAR.format(layer)
        if net.delta_net is None or prefix + "in_proj_qkv.weight" not in out:
            continue
        groups, d_k, r, d_v = _deltanet_groups(model_config, layer)
        qkv, z, b, a = (_whole(out.pop(prefix + f"in_proj_{n}.weight")) for n in ("qkv", "z", "b", "a"))
        dim = qkv.shape[-1]
        q, k, v = qkv.split([groups * d_k, groups * d_k, groups * r * d_v])
        parts = [t.reshape(groups, -1, dim) for t in (q, k, v, z)]
        out[prefix + "in_proj_qkvz.weight"] = torch.cat(parts, 1).reshape(-1, dim)
        out[prefix + "in_proj_ba.weight"] = torch.cat([t.reshape(groups, r, dim) for t in (b, a)], 1).reshape(-1, dim)
    return out


def split_qwen3_next(hf: dict[str, Any], model_config: Any) -> dict[str, Any]:
    """Qwen3-Next's in_proj_qkvz and in_proj_ba -> Qwen3.5's in_proj_qkv, _z, _b, _a (`fuse_qwen3_next` undone)."""
    out = dict(hf)
    for layer, net in enumerate(model_config.layers):
        prefix = _LINEAR.format(layer)
        if net.delta_net is None or prefix + "in_proj_qkvz.weight" not in out:
            continue
        groups, d_k, r, d_v = _deltanet_groups(model_config, layer)
        qkvz, ba = (_whole(out.pop(prefix + f"in_proj_{n}.weight")) for n in ("qkvz", "ba"))
        dim = qkvz.shape[-1]
        q, k, v, z = qkvz.reshape(groups, -1, dim).split([d_k, d_k, r * d_v, r * d_v], 1)
        out[prefix + "in_proj_qkv.weight"] = torch.cat([t.reshape(-1, dim) for t in (q, k, v)])
        out[prefix + "in_proj_z.weight"] = z.reshape(-1, dim)
        b, a = ba.reshape(groups, 2 * r, dim).split([r, r], 1)
        out[prefix + "in_proj_b.weight"], out[prefix + "in_proj_a.weight"] = b.reshape(-1, dim), a.reshape(-1, dim)
    return out


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
