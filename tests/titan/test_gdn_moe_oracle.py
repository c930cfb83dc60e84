"""Oracle for the hybrid MoE text decoders: transformers' `Qwen3_5MoeForCausalLM` and `Qwen3NextForCausalLM`
judge FlashCP's, in float64, at CP 1, 2 and 4 with expert parallelism.

Tiny random models of each kind: 4 layers (3 Gated DeltaNet, then gated full attention with partial
RoPE over half the head and 4 heads over 2 KV heads), 4 value heads over 2 key heads in the linear
layers, and in every layer 8 experts (top 2, softmax router) beside a sigmoid-gated shared expert.
Ours is `qwen3_5_text_config` of the same config.json (TorchTitan's Qwen3.5 MoE blocks, FlashCP's
Gated DeltaNet and attention, experts in the weights' dtype), its weights mapped in by FlashCP's
adapter (Qwen3-Next's fused in_proj_qkvz / in_proj_ba split per key-head group), chunks of 4 tokens.
transformers sees each document alone from position 0 (its torch Gated DeltaNet ignores packing);
ours one packed window (documents of 13, 1, 2, 9 and 7 tokens), planned by flashcp and by contiguous
ranks (per_seq: documents cut), with experts on 1 or 2 EP ranks
borrowed from the CP ranks (TorchTitan's all-to-all). The loss, the logits and every gradient mapped
back to transformers' names (conv weights, A_log, dt_bias, routers, each expert and the shared
expert's gate included) must agree within TOLERANCE of each tensor's largest entry, and every
router must choose transformers' experts (the window's top-2 margins are far above rounding).
Both sides' float32 casts are read as "at least float32" (`test_gdn_layer.at_least_float32`; the
routers' `dtype=torch.float` and TorchTitan's token dispatcher too), so the comparison is float64
throughout; with the dispatcher's cast left as it is, the errors are float32's (1.5e-5 on a dt_bias
gradient, 7e-7 on the logits at CP 1).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import flashcp.titan  # noqa: F401  (TorchTitan shims before transformers / torchtitan)
import torchtitan.distributed.utils as titan_dist
from torchtitan.models.common import token_dispatcher
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
from transformers.models.qwen3_next import modeling_qwen3_next
from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig

from flashcp.plan import plan_shards
from flashcp.plan.linear import doc_pieces
from flashcp.titan.models.decoders import state_dict_adapter
from flashcp.titan.models.gated_deltanet import hybrid_step, qwen3_5_text_config, shard_experts
from tests.titan.test_gdn_layer import at_least_float32
from tests.titan.test_gdn_oracle import DOC_LENS
from tests.titan.test_hf_oracle import _ep_dims, _grad_share, _hf_reference, _labels, _per_expert, check, ROUTE_MARGIN

TOLERANCE = 1e-10  # max |ours - HF| / max |HF| per tensor, float64 throughout; measured at most 1.0e-12
CHUNK = 4
SIZES = {
    "vocab_size": 61, "hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_key_head_dim": 4, "linear_value_head_dim": 3, "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
    "shared_expert_intermediate_size": 12,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
}  # fmt: skip
KINDS = {  # name -> (config, transformers' modeling module, its causal LM class)
    "qwen3_5_moe": (Qwen3_5MoeTextConfig(**SIZES), modeling_qwen3_5_moe, "Qwen3_5MoeForCausalLM"),
    "qwen3_next": (Qwen3NextConfig(**SIZES, intermediate_size=20), modeling_qwen3_next, "Qwen3NextForCausalLM"),
}
# (CP, EP, strategy): EP borrows the CP ranks; per_seq cuts documents.
CASES = [(2, ep, s) for ep in (1, 2) for s in ("flashcp", "per_seq")] + [(4, ep, s) for ep in (1, 2)
                                                                          for s in ("flashcp", "per_seq")]


@contextlib.contextmanager
def float64_throughout(module):
    """`at_least_float32` for transformers' `module` and for TorchTitan's token dispatcher, which scales
    the experts' outputs in float32 (an upcast in training, a rounding in float64); softmax's dtype read
    the same way (transformers' routers: `dtype=torch.float`, which is also RoPE's, left as it is on
    both sides)."""
    softmax = F.softmax

    def at_least(x: torch.Tensor, dim=None, _stacklevel: int = 3, dtype=None) -> torch.Tensor:
        return softmax(x, dim=dim, dtype=dtype and torch.promote_types(x.dtype, dtype))

    with at_least_float32(module, token_dispatcher), pytest.MonkeyPatch.context() as mp:
        mp.setattr(F, "softmax", at_least)
        yield


def hf_model(kind: str, seed: int = 0) -> torch.nn.Module:
    """transformers' model in float64, every parameter moved off its initial value (zero norms and routers too)."""
    config, module, cls = KINDS[kind]
    torch.manual_seed(seed)
    config._attn_implementation = config._experts_implementation = "eager"  # transformers' float64-capable paths
    model = getattr(module, cls)(config).to(torch.float64)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return model


def our_config(kind: str):
    return qwen3_5_text_config(KINDS[kind][0].to_dict(), max_seq_len=sum(DOC_LENS), chunk_size=CHUNK)


def run_window(rank: int, group, kind: str, cases: list[tuple[int, int, str]], state: dict[str, torch.Tensor],
               tokens: torch.Tensor) -> list[dict]:  # fmt: skip
    """Each (CP, EP, strategy) case: this rank's logits, loss share, token_index, routes and share of the
    gradients (transformers' names)."""
    backend = titan_dist.get_spmd_backend()
    titan_dist.set_spmd_backend("partial_dtensor")  # as the trainer sets it for FlashCP's jobs
    adapter = state_dict_adapter(our_config(kind))  # unsharded: maps full-size gradient shares
    labels = _labels(tokens, DOC_LENS)
    out = []
    try:
        for cp, ep, strategy in cases:
            config = our_config(kind)
            shard_experts(config, enable_ep=ep > 1)
            model = config.build().to(torch.float64)
            missing, unexpected = model.load_state_dict(state, strict=False)
            assert not unexpected and all(key.endswith("moe.expert_bias_E") for key in missing), (missing, unexpected)
            if ep > 1:
                model.parallelize(_ep_dims(cp, ep))
                assert isinstance(model.layers["0"].moe.routed_experts.inner_experts.w1_EFD, DTensor)
            routes: list[torch.Tensor] = []
            for name, module in model.named_modules():
                if name.endswith("moe.router"):
                    module.register_forward_hook(lambda m, args, o: routes.append(o[1][0].sort(-1).values))
            plan = plan_shards(list(DOC_LENS), cp, strategy)
            masks, positions = hybrid_step(plan, rank, group if cp > 1 else None, "compact", 4)
            index = masks["deltanet"].dispatch.token_index
            with float64_throughout(KINDS[kind][1]):
                logits = model(tokens[index][None], positions, masks)[0]
                loss = F.cross_entropy(logits, labels[index], ignore_index=-100, reduction="sum")
                loss = loss / (labels != -100).sum()
                loss.backward()
            grads = adapter.to_hf({n: _grad_share(p.grad) for n, p in model.named_parameters()})
            out.append({"index": index, "logits": logits.detach(), "loss": loss.item(), "grads": grads,
                        "routes": routes, "pieces": max(len(p) for p in doc_pieces(plan))})  # fmt: skip
    finally:
        titan_dist.set_spmd_backend(backend)
    return out


@pytest.fixture(scope="module", params=sorted(KINDS))
def reference(request) -> tuple[str, dict]:
    """transformers on each document alone: logits, gradients (one tensor per expert), routes, loss,
    and the weights by FlashCP's names; the first seed whose window has no near-tie in any router."""
    kind = request.param
    for seed in range(10):
        model = hf_model(kind, seed)
        tokens = torch.randint(0, SIZES["vocab_size"], (sum(DOC_LENS),), generator=torch.Generator().manual_seed(seed))
        with float64_throughout(KINDS[kind][1]):
            ref = _hf_reference(model, tokens, DOC_LENS)
        if ref["margin"] > ROUTE_MARGIN:
            break
    labels = _labels(tokens, DOC_LENS)
    ref["loss"] = F.cross_entropy(ref["logits"], labels, ignore_index=-100).item()
    state = state_dict_adapter(our_config(kind)).from_hf(_per_expert(model.state_dict()))
    return kind, ref | {"state": state}


def _check(parts: list[dict], ref: dict, what: str) -> None:
    logits, grads = check(parts, ref, what)
    loss = abs(sum(part["loss"] for part in parts) - ref["loss"]) / abs(ref["loss"])
    print(f"{what}: loss {loss:.1e}, logits {logits:.1e}, gradients {grads:.1e} (relative)")
    assert max(loss, logits, grads) <= TOLERANCE, (what, loss, logits, grads)


def test_the_window_has_no_router_ties(reference):
    kind, ref = reference
    assert ref["margin"] > ROUTE_MARGIN, f"{kind}: a near-tie in the routers (gap {ref['margin']:.2e})"


def test_cp1_matches_transformers(reference):
    kind, ref = reference
    (part,) = run_window(0, None, kind, [(1, 1, "flashcp")], ref["state"], ref["tokens"])
    _check([part], ref, f"{kind} CP 1")


@pytest.mark.parametrize("cp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_cp_and_ep_match_transformers(reference, gloo_pool, cp):
    kind, ref = reference
    cases = [case for case in CASES if case[0] == cp]
    per_rank = gloo_pool(cp).run(run_window, (kind, cases, ref["state"], ref["tokens"]))
    for i, (_, ep, strategy) in enumerate(cases):
        _check([rank[i] for rank in per_rank], ref, f"{kind} CP {cp} EP {ep} {strategy}")
    assert max(rank[i]["pieces"] for rank in per_rank for i, case in enumerate(cases) if case[2] == "per_seq") >= 2
