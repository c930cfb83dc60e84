"""Oracle for Qwen3.5's hybrid text decoder: transformers' `Qwen3_5ForCausalLM` judges FlashCP's, in float64.

A tiny random model: 4 layers (3 Gated DeltaNet, then full attention with its output gate, partial
RoPE over half the head and 4 heads over 2 KV heads), 4 value heads over 2 key heads in the linear
layers. Ours is `qwen3_5_text_config` of the same config (TorchTitan's Qwen3.5 modules, FlashCP's
Gated DeltaNet and FlashCP's attention), its weights mapped in by TorchTitan's Qwen3.5 adapter,
chunks of 4 tokens. On one packed window (documents of 13, 1, 2, 9 and 7 tokens, each seen by
transformers alone from position 0) ours must give transformers' logits and every gradient within
1e-10 of each tensor's largest entry (measured ~1e-13), at CP 1 and at CP 2 (the flashcp plan, and
contiguous halves that cut a document), with the compact exchange. Both sides hard-code float32
casts (transformers' Gated DeltaNet, norms and RoPE; TorchTitan's OffsetRMSNorm and RoPE: `.float()`),
so both run with them read as "at least float32" (`test_gdn_layer.at_least_float32`) and the
comparison is float64 throughout; with TorchTitan's casts left as they are the errors are float32's
(logits 2.7e-6, gradients 2.1e-5).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import flashcp.titan  # noqa: F401  (TorchTitan shims before transformers / torchtitan)
import torchtitan.distributed.utils as titan_dist
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM

from flashcp.plan import plan_shards
from flashcp.plan.linear import doc_pieces
from flashcp.titan.models.gated_deltanet import hybrid_step, qwen3_5, qwen3_5_text_config
from tests.titan.test_gdn_layer import at_least_float32
from tests.titan.test_hf_oracle import _hf_reference, _labels, check

TOLERANCE = 1e-10  # max |ours - HF| / max |HF|, float64 throughout
DOC_LENS = (13, 1, 2, 9, 7)  # a 1-token document and one shorter than the conv width
CONFIG = Qwen3_5TextConfig(
    vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=4, linear_value_head_dim=3, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
)  # fmt: skip
CHUNK = 4


def hf_model() -> torch.nn.Module:
    """transformers' model in float64, every parameter moved off its initial value (zero norms included)."""
    torch.manual_seed(0)
    CONFIG._attn_implementation = "eager"
    model = Qwen3_5ForCausalLM(CONFIG).to(torch.float64)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return model


def adapter():
    config = qwen3_5_text_config(CONFIG.to_dict(), max_seq_len=sum(DOC_LENS), chunk_size=CHUNK)
    return config, qwen3_5.Qwen35StateDictAdapter(config, None)


def to_titan(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' text names are the VLM adapter's under `model.language_model.`."""
    return adapter()[1].from_hf({k.replace("model.", "model.language_model.", 1): v for k, v in hf.items()})


def to_hf(titan: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k.replace("model.language_model.", "model.", 1): v for k, v in adapter()[1].to_hf(titan).items()}


def run_window(rank: int, group, plans: list, state: dict[str, torch.Tensor], tokens: torch.Tensor
               ) -> list[dict]:  # fmt: skip
    """Each plan: this rank's logits, token_index and share of the gradients (transformers' names)."""
    backend = titan_dist.get_spmd_backend()
    titan_dist.set_spmd_backend("partial_dtensor")  # as the trainer sets it for FlashCP's jobs
    model = adapter()[0].build().to(torch.float64)
    model.load_state_dict(state)
    out = []
    try:
        for plan in plans:
            model.zero_grad()
            masks, positions = hybrid_step(plan, rank, group if plan.cp_size > 1 else None, "compact", 4)
            index = masks["deltanet"].dispatch.token_index
            assert torch.equal(index, masks["quadratic_attention"].dispatch.token_index)
            labels = _labels(tokens, DOC_LENS)
            with at_least_float32():
                logits = model(tokens[index][None], positions, masks)[0]
                loss = F.cross_entropy(logits, labels[index], ignore_index=-100, reduction="sum")
                (loss / (labels != -100).sum()).backward()
            grads = to_hf({n: p.grad for n, p in model.named_parameters()})
            out.append({"index": index, "logits": logits.detach(), "grads": grads})
    finally:
        titan_dist.set_spmd_backend(backend)
    return out


@pytest.fixture(scope="module")
def reference() -> dict:
    model = hf_model()
    tokens = torch.randint(0, CONFIG.vocab_size, (sum(DOC_LENS),), generator=torch.Generator().manual_seed(1))
    with at_least_float32():
        ref = _hf_reference(model, tokens, DOC_LENS, fused_experts=False)
    return ref | {"state": to_titan(model.state_dict())}


def _check(parts: list[dict], ref: dict, what: str) -> None:
    logits, grads = check(parts, ref, what)
    print(f"{what}: logits {logits:.1e}, gradients {grads:.1e} (relative)")
    assert logits <= TOLERANCE and grads <= TOLERANCE, (what, logits, grads)


def test_cp1_matches_transformers(reference):
    (part,) = run_window(0, None, [plan_shards(list(DOC_LENS), 1, "flashcp")], reference["state"],
                         reference["tokens"])  # fmt: skip
    _check([part], reference, "CP 1")


def test_cp2_matches_transformers(reference, gloo_pool):
    plans = [plan_shards(list(DOC_LENS), 2, strategy) for strategy in ("flashcp", "per_seq")]
    assert any(len(p) > 1 for p in doc_pieces(plans[1]))
    per_rank = gloo_pool(2).run(run_window, (plans, reference["state"], reference["tokens"]))
    for case, strategy in enumerate(("flashcp", "per_seq")):
        _check([rank[case] for rank in per_rank], reference, f"CP 2 {strategy}")
