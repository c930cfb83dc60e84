"""DeepSeek-V3 (MLA) under tensor parallelism x CP against transformers' `DeepseekV3ForCausalLM`.

TP 2 x CP 2 on 4 gloo ranks: TorchTitan's DeepSeek-V3 TP plan (`set_deepseek_v3_sharding_config`:
wq_b and wkv_b colwise, so each TP rank holds half the heads and their rows of wkv_b; wkv_a, kv_norm,
wq_a and q_norm replicated; wo rowwise; the MoE experts TP-sharded) applied by `model.parallelize`,
and FlashCP's latent exchange in each TP rank's CP group. Each TP rank exchanges the whole latent
and k_pe rows once (they are head-independent), in its own CP group, and up-projects them with its
heads' rows of wkv_b; the latent and k_pe gradients are partial over TP and summed by DTensor.
The q-lora model of test_mla_oracle.py (its fixture) on the same packed window: logits and every
gradient (each CP rank's, TP rank 0's full tensors, summed over CP) to 1e-5 relative of transformers'.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

import flashcp.titan  # noqa: F401  (TorchTitan shims before transformers / torchtitan)
import torchtitan.distributed.utils as titan_dist
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models.deepseek_v3.sharding import set_deepseek_v3_sharding_config

from flashcp.dispatch import build_dispatch
from flashcp.plan import plan_shards
from flashcp.titan.config import validate
from flashcp.titan.models.attention import CPStep, flashcp_ropes
from flashcp.titan.models.decoders import state_dict_adapter
from flashcp.titan.models.spec import model_spec

from tests.titan.test_hf_oracle import _labels, check, our_model, VOCAB, WINDOW
from tests.titan.test_mla_oracle import DOC_LENS, models  # noqa: F401  (the module-scoped fixture)

from safetensors.torch import load_file

_DIMS: dict[tuple[int, int], ParallelDims] = {}


def _dims(tp: int, cp: int) -> ParallelDims:
    if (tp, cp) not in _DIMS:
        dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=cp, tp=tp, pp=1, ep=1, world_size=tp * cp,
                            spmd_backend="partial_dtensor")  # fmt: skip
        dims.build_mesh()
        _DIMS[tp, cp] = dims
    return _DIMS[tp, cp]


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def run_tp_window(rank: int, group, folder, tokens: torch.Tensor, plan, tp: int) -> dict | None:
    """This CP rank's logits and gradients (HF names) from TP rank 0; None from the other TP ranks."""
    torch.manual_seed(0)
    backend = titan_dist.get_spmd_backend()
    titan_dist.set_spmd_backend("partial_dtensor")
    try:
        dims = _dims(tp, plan.cp_size)
        cfg = validate({"model": {"hf_config": str(folder)}, "flashcp": {"backend": "reference"},
                        "training": {"seq_len": WINDOW}})  # fmt: skip
        spec = model_spec(cfg["model"], cfg["flashcp"], VOCAB, WINDOW)
        set_deepseek_v3_sharding_config(spec.model, enable_sp=False, enable_ep=False)
        model = spec.model.build()
        missing, unexpected = model.load_state_dict(state_dict_adapter(spec.model).from_hf(
            load_file(folder / "model.safetensors")), strict=False)  # fmt: skip
        assert not unexpected and all(key.endswith("moe.expert_bias_E") for key in missing), (missing, unexpected)
        model.parallelize(dims)
        attention = model.layers["0"].attention
        assert isinstance(attention.wkv_b.weight, DTensor) and attention.wkv_b.weight.to_local().shape[0] * tp == \
            attention.wkv_b.weight.shape[0]  # fmt: skip
        cp_mesh = dims.get_mesh("cp")
        dispatch = build_dispatch(plan, cp_mesh.get_local_rank(), "compact")
        labels = _labels(tokens, DOC_LENS)[dispatch.token_index]
        routes: list[torch.Tensor] = []
        for name, module in model.named_modules():
            if name.endswith("moe.router"):
                module.register_forward_hook(lambda m, args, out: routes.append(_full(out[1])[0].sort(-1).values))
        logits = _full(model(tokens[dispatch.token_index][None], positions=dispatch.positions[None],
                             attention_masks=CPStep.of(flashcp_ropes(model), dispatch, cp_mesh.get_group()))[0])  # fmt: skip
        loss = torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")
        (loss / (_labels(tokens, DOC_LENS) != -100).sum()).backward()
        grads_full = {name: _full(p.grad) for name, p in model.named_parameters()}
    finally:
        titan_dist.set_spmd_backend(backend)
    if dims.get_mesh("tp").get_local_rank() != 0:
        return None
    grads = our_model(folder)
    with torch.no_grad():
        for name, p in grads.named_parameters():
            p.copy_(grads_full[name])
    buffers = {name for name, _ in grads.named_buffers()}
    params = {k: v for k, v in grads.state_dict().items() if k not in buffers}
    hf_grads = state_dict_adapter(model.config).to_hf(params)
    return {"index": dispatch.token_index, "logits": logits.detach(), "grads": hf_grads, "routes": routes}


def test_tp2_cp2_matches_transformers(models, gloo_pool):
    folder, ref = models["q-lora"]
    plan = plan_shards(DOC_LENS, 2, "flashcp")
    parts = gloo_pool(4).run(run_tp_window, (folder, ref["tokens"], plan, 2), size=4)
    parts = [p for p in parts if p is not None]
    assert len(parts) == 2
    errors = check(parts, ref, "q-lora TP=2 x CP=2 flashcp/compact")
    print(f"q-lora TP=2 x CP=2 flashcp/compact: logits {errors[0]:.1e}, gradients {errors[1]:.1e} (relative)")
