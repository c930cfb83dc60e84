"""Oracle for Qwen3.5's hybrid text decoder: transformers' `Qwen3_5ForCausalLM` judges FlashCP's, in float64.

A tiny random model: 4 layers (3 Gated DeltaNet, then full attention with its output gate, partial
RoPE over half the head and 4 heads over 2 KV heads), 4 value heads over 2 key heads in the linear
layers. Ours is `qwen3_5_text_config` of the same config (TorchTitan's Qwen3.5 modules, FlashCP's
Gated DeltaNet and FlashCP's attention), its weights mapped in by TorchTitan's Qwen3.5 adapter,
chunks of 4 tokens.
On two packed windows (`WINDOWS`: a 1-token document, documents shorter than the conv width, one
ending exactly at a rank boundary, one over every rank), each document seen by transformers alone
from position 0, ours must give transformers' logits and every gradient within 1e-10 of each
tensor's largest entry (measured <= 2.4e-12), at CP 1, 2 and 4, for every planner strategy with
the compact exchange and three of them with the needed and two-level exchanges of the full layers;
`_layouts` checks the cases hold the layouts they are meant to. Both sides hard-code float32
casts (transformers' Gated DeltaNet, norms and RoPE; TorchTitan's OffsetRMSNorm and RoPE: `.float()`),
so both run with them read as "at least float32" (`test_gdn_layer.at_least_float32`) and the
comparison is float64 throughout; with TorchTitan's casts left as they are the errors are float32's
(logits 2.7e-6, gradients 2.1e-5).
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
import torch.nn.functional as F

import flashcp.titan  # noqa: F401  (TorchTitan shims before transformers / torchtitan)
import torchtitan.distributed.utils as titan_dist
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM

from flashcp.attention import build_two_level_dispatch
from flashcp.dispatch import build_dispatch
from flashcp.plan import plan_shards, STRATEGIES
from flashcp.plan.linear import doc_pieces
from flashcp.titan.models.gated_deltanet import hybrid_masks, qwen3_5, qwen3_5_text_config
from flashcp.titan.models.windows import build_hybrid_dispatches
from tests.titan.test_gdn_layer import at_least_float32
from tests.titan.test_hf_oracle import _hf_reference, _labels, check, PLAN_OPTIONS

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


def run_window(rank: int, group, plans: list, state: dict[str, torch.Tensor], tokens: torch.Tensor,
               comms: list[str] | None = None, doc_lens=DOC_LENS) -> list[dict]:  # fmt: skip
    """Each plan (with its comm, compact by default): this rank's logits, token_index and share of the
    gradients (transformers' names). Comm "two_level" puts two ranks on a node (one at CP 2)."""
    backend = titan_dist.get_spmd_backend()
    titan_dist.set_spmd_backend("partial_dtensor")  # as the trainer sets it for FlashCP's jobs
    model = adapter()[0].build().to(torch.float64)
    model.load_state_dict(state)
    out = []
    try:
        for plan, comm in zip(plans, comms or ["compact"] * len(plans)):
            model.zero_grad()
            if comm == "two_level":
                full = functools.partial(build_two_level_dispatch, rank=rank, ranks_per_node=max(1, plan.cp_size // 2))
            else:
                full = functools.partial(build_dispatch, rank=rank, comm=comm)
            dispatches = build_hybrid_dispatches(plan, full, rank, CONFIG.linear_conv_kernel_dim)
            masks = hybrid_masks(dispatches, group if plan.cp_size > 1 else None)
            index = masks["deltanet"].dispatch.token_index
            assert torch.equal(index, masks["quadratic_attention"].dispatch.token_index)
            labels = _labels(tokens, doc_lens)
            with at_least_float32():
                logits = model(tokens[index][None], dispatches.positions[None], masks)[0]
                loss = F.cross_entropy(logits, labels[index], ignore_index=-100, reduction="sum")
                (loss / (labels != -100).sum()).backward()
            grads = to_hf({n: p.grad for n, p in model.named_parameters()})
            out.append({"index": index, "logits": logits.detach(), "grads": grads})
    finally:
        titan_dist.set_spmd_backend(backend)
    return out


# Two windows of 32 tokens. "mixed": a 1-token document and one shorter than the conv width, and a
# document ending exactly where rank 0's rows end at CP 2 and 4 (contiguous halves / quarters); its
# documents fit two ranks whole (whole_doc at CP 2). "spanning": a document over every rank at CP 4
# (contiguous quarters: pieces of 8, 8, 8 and 1 tokens, a middle piece with three predecessors).
WINDOWS = {"mixed": DOC_LENS, "spanning": (25, 3, 2, 1, 1)}
# Every strategy with the compact exchange; three of them with each other exchange of the full layers.
CASES = [(s, "compact") for s in STRATEGIES] + [(s, c) for s in ("flashcp", "per_doc", "per_seq") for c in ("needed", "two_level")]


@pytest.fixture(scope="module", params=sorted(WINDOWS))
def window(request) -> tuple[str, dict]:
    doc_lens = WINDOWS[request.param]
    model = hf_model()
    tokens = torch.randint(0, CONFIG.vocab_size, (sum(doc_lens),), generator=torch.Generator().manual_seed(1))
    with at_least_float32():
        ref = _hf_reference(model, tokens, doc_lens, fused_experts=False)
    return request.param, ref | {"state": to_titan(model.state_dict()), "doc_lens": doc_lens}


def _check(parts: list[dict], ref: dict, what: str) -> None:
    logits, grads = check(parts, ref, what)
    print(f"{what}: logits {logits:.1e}, gradients {grads:.1e} (relative)")
    assert logits <= TOLERANCE and grads <= TOLERANCE, (what, logits, grads)


def _layouts(plans: list, doc_lens: tuple[int, ...]) -> set[str]:
    """The layouts the plans hold, so that the cases below cannot silently stop covering them."""
    found = set()
    ends = set(itertools.accumulate(doc_lens))
    for plan in plans:
        docs = doc_pieces(plan)
        found |= {"whole documents only"} if all(len(d) == 1 for d in docs) else {"cut documents"}
        found |= {"a document over every rank"} if any(len({p.owner for p in d}) == plan.cp_size for d in docs) else set()
        found |= {"three pieces or more"} if any(len(d) > 2 for d in docs) else set()
        found |= {"head-tail cuts"} if any(d[0].owner == d[-1].owner != d[1].owner for d in docs if len(d) > 2) else set()
        found |= {"a document ending at a rank boundary"} if any(
            k * plan.tokens_per_rank in ends for k in range(1, plan.cp_size)) and plan.strategy == "per_seq" else set()
    return found


def test_cp1_matches_transformers(window):
    name, ref = window
    (part,) = run_window(0, None, [plan_shards(list(ref["doc_lens"]), 1, "flashcp")], ref["state"], ref["tokens"],
                         doc_lens=ref["doc_lens"])  # fmt: skip
    _check([part], ref, f"{name} window, CP 1")


@pytest.mark.parametrize("cp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_every_strategy_and_exchange_matches_transformers(window, gloo_pool, cp):
    name, ref = window
    plans = [plan_shards(list(ref["doc_lens"]), cp, s, **PLAN_OPTIONS.get(s, {})) for s, _ in CASES]
    per_rank = gloo_pool(cp).run(run_window, (plans, ref["state"], ref["tokens"], [c for _, c in CASES], ref["doc_lens"]))
    for case, (strategy, comm) in enumerate(CASES):
        _check([rank[case] for rank in per_rank], ref, f"{name} window, CP {cp} {strategy}/{comm}")
    expected = {"cut documents", "three pieces or more", "head-tail cuts"}
    expected |= {"a document ending at a rank boundary"} if name == "mixed" else set()
    expected |= {"whole documents only"} if (name, cp) == ("mixed", 2) else set()
    expected |= {"a document over every rank"} if name == "spanning" else set()
    assert expected <= _layouts(plans, ref["doc_lens"]), expected - _layouts(plans, ref["doc_lens"])
