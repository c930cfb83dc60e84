"""Oracle: transformers' own models decide whether ours are right.

Tiny random Hugging Face models are built locally (`save_pretrained`): a Llama with Llama 3.1's
`rope_scaling` and GQA, a Qwen3 with QK-norm, tied embeddings and a head_dim other than
hidden_size / heads, a Llama with YaRN (its attention factor included) and a Qwen3-MoE (8 experts,
top-2, every layer routed; its routers' top-2 choices must be the same tokens' on both sides, on a
window whose every token's 2nd and 3rd expert scores differ by far more than float32 rounding, so
that no near-tie can flip a choice). Our model is built
from the saved config.json (`[model] hf_config`) and loaded with TorchTitan's state_dict_adapter
(`from_hf`: q / k permuted for Llama's complex RoPE). On one packed window of several documents,
ours (FlashCP's attention, the document mask, per-document positions, fp32) must give
transformers' logits -- each document run alone from position 0 -- to RELATIVE_TOLERANCE, at
CP = 1 and at CP = 2 on gloo under every sharding strategy, and one step's gradients (mean
cross-entropy over the packed documents) mapped back to HF names by the adapter (`to_hf`) must
equal transformers' gradients. The Qwen3-MoE runs at CP = 2 and 4 also with expert parallelism
(EP = 2, 4, borrowing the CP ranks as the trainer lays it out): its experts sharded over the "ep"
mesh, tokens sent to them and back by TorchTitan's all-to-all dispatcher (MOE_CASES). With
`[activation_checkpoint] head_groups = 2` (each attention layer over 2 groups of KV heads, each
group recomputed in backward; flashcp.titan.models.head_groups) every family still gives
transformers' logits and gradients at CP = 2.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor, Shard

import flashcp.titan  # noqa: F401  (TorchTitan shims before transformers / torchtitan)
import torchtitan.distributed.utils as titan_dist
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

from flashcp.attention import build_two_level_dispatch
from flashcp.dispatch import build_dispatch
from flashcp.plan import plan_shards, STRATEGIES
from flashcp.titan.models.attention import CPStep, flashcp_ropes
from flashcp.titan.config import validate
from flashcp.titan.models.decoders import state_dict_adapter
from flashcp.titan.models.head_groups import use_head_groups
from flashcp.titan.models.spec import model_spec

transformers = pytest.importorskip("transformers", reason="the oracle needs the test extra (transformers)")
from safetensors.torch import load_file

RELATIVE_TOLERANCE = 1e-5  # max |ours - HF| / max |HF|, fp32; measured: logits 1.4e-6, gradients 3.0e-6
ROUTE_MARGIN = 1e-4  # smallest gap between a chosen and an unchosen expert's score the MoE window allows
DOC_LENS = (23, 9, 30, 2)  # one window of 64 tokens: documents cut across the CP ranks by most plans
WINDOW = sum(DOC_LENS)
VOCAB = 101
PLAN_OPTIONS = {"ilp": dict(target_imbalance=2.0, time_limit=60.0)}  # the ILP solver: any valid plan (quick; the limit only catches a hang)
COMMON = {
    "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
    "initializer_range": 0.2,
}  # fmt: skip
LLAMA3_SCALING = {
    "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
}  # fmt: skip
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16}
MODELS = {  # name -> (transformers config class, its arguments)
    "llama3-scaled": ("LlamaConfig", COMMON | {"rms_norm_eps": 1e-5, "rope_parameters": LLAMA3_SCALING}),
    "qwen3-tied": (
        "Qwen3Config",
        COMMON
        | {
            "head_dim": 32,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        },
    ),  # fmt: skip
    "llama3-yarn": (
        "LlamaConfig",
        COMMON
        | {
            "max_position_embeddings": 64,
            "rms_norm_eps": 1e-5,
            "rope_parameters": YARN,
        },
    ),  # fmt: skip
    "qwen3-moe": (
        "Qwen3MoeConfig",
        COMMON
        | {
            "head_dim": 32, "rms_norm_eps": 1e-6, "moe_intermediate_size": 32, "num_experts": 8,
            "num_experts_per_tok": 2, "norm_topk_prob": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        },
    ),  # fmt: skip
}


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    """name -> (saved folder, transformers' logits and gradients on the window)."""
    torch.manual_seed(0)
    tokens = torch.randint(0, VOCAB, (WINDOW,))
    return {name: reference(tmp_path_factory.mktemp(name), config_class, kwargs, tokens)
            for name, (config_class, kwargs) in MODELS.items()}  # fmt: skip


def reference(folder: Path, config_class: str, kwargs: dict, tokens: torch.Tensor, doc_lens=DOC_LENS,
              prepare=None) -> tuple[Path, dict]:  # fmt: skip
    """A transformers model built from `config_class(**kwargs)` (then `prepare(model)` if given), saved
    to `folder`, and its logits and gradients on `tokens` packed as `doc_lens`; an MoE model's window is
    the first of a fixed sequence whose routers have no near-ties."""
    config = getattr(transformers, config_class)(**kwargs)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()
    if prepare is not None:
        prepare(model)
    model.save_pretrained(folder)
    ref = _hf_reference(model, tokens, doc_lens)
    for seed in range(1, 20):
        if ref.get("margin", 1.0) > ROUTE_MARGIN:
            break
        model.zero_grad()
        generator = torch.Generator().manual_seed(seed)
        ref = _hf_reference(model, torch.randint(0, VOCAB, (len(tokens),), generator=generator), doc_lens)
    return folder, ref


def _labels(tokens: torch.Tensor, doc_lens=DOC_LENS) -> torch.Tensor:
    """Next token inside each document; -100 (ignored) at each document's last token."""
    labels = torch.full_like(tokens, -100)
    start = 0
    for n in doc_lens:
        labels[start : start + n - 1] = tokens[start + 1 : start + n]
        start += n
    return labels


def _hf_reference(model, tokens: torch.Tensor, doc_lens=DOC_LENS, router: str = "mlp.gate",
                  fused_experts: bool = True) -> dict:  # fmt: skip
    """Each document alone through transformers (positions from 0); loss over the packed window.
    An MoE model also gives each layer's top-k experts per token (sorted) and the smallest gap
    between a token's k-th and (k+1)-th expert score (DeepSeek-V3's: sigmoid scores plus the bias).
    `router`: the name ending of its routers; `fused_experts`: gradients split per expert, as the
    adapter's names are (gpt-oss keeps them fused)."""
    labels = _labels(tokens, doc_lens)
    routers = [m for name, m in model.named_modules() if name.endswith(router)]
    calls: list[tuple] = []
    hooks = [m.register_forward_hook(lambda m, args, out: calls.append(out)) for m in routers]
    logits = torch.cat([model(input_ids=doc[None]).logits[0] for doc in tokens.split(list(doc_lens))])
    for hook in hooks:
        hook.remove()
    loss = torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")
    (loss / (labels != -100).sum()).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    ref = {"tokens": tokens, "logits": logits.detach(), "grads": _per_expert(grads) if fused_experts else grads}
    if routers:  # calls: document by document, layer by layer
        n = len(routers)
        ref["routes"] = [torch.cat([calls[d * n + i][2] for d in range(len(doc_lens))]).sort(-1).values
                         for i in range(n)]  # fmt: skip
        k = calls[0][2].shape[-1]
        if model.config.model_type == "deepseek_v3":
            score = lambda logits, gate: logits.sigmoid() + gate.e_score_correction_bias  # noqa: E731
        else:
            score = lambda logits, gate: logits.softmax(-1)  # noqa: E731
        probs = torch.cat([score(out[0], gate) for out, gate in zip(calls, routers * len(doc_lens))])
        probs = probs.sort(-1, descending=True).values
        ref["margin"] = (probs[:, k - 1] - probs[:, k]).min().item()
    return ref


def _per_expert(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5 keeps a layer's experts fused (`experts.gate_up_proj`: [E, 2F, D], gate first;
    `experts.down_proj`: [E, D, F]); its checkpoints, and so the adapter's names, hold one per expert."""
    out = {}
    for name, grad in grads.items():
        prefix, _, last = name.rpartition(".")
        if last == "gate_up_proj":
            gate, up = grad.chunk(2, dim=1)
            for e in range(grad.shape[0]):
                out[f"{prefix}.{e}.gate_proj.weight"], out[f"{prefix}.{e}.up_proj.weight"] = gate[e], up[e]
        elif last == "down_proj" and prefix.endswith("experts"):
            out |= {f"{prefix}.{e}.down_proj.weight": grad[e] for e in range(grad.shape[0])}
        else:
            out[name] = grad
    return out


def our_model(folder: Path, parallel_dims=None, head_groups: int = 1) -> torch.nn.Module:
    """Ours from the folder's config.json, its weights mapped in by TorchTitan's adapter; with
    `parallel_dims` (EP > 1) its experts then sharded over the "ep" mesh as the trainer does;
    `head_groups` > 1: its attention layers over that many groups of KV heads (same parameters)."""
    cfg = validate({"model": {"hf_config": str(folder)}, "flashcp": {"backend": "reference"},
                    "training": {"seq_len": WINDOW}})  # fmt: skip
    spec = model_spec(cfg["model"], cfg["flashcp"], VOCAB, WINDOW)
    if parallel_dims is not None:  # what Qwen3Model.Config.update_from_config does for the trainer
        set_qwen3_sharding_config(spec.model, enable_sp=False, enable_ep=True)
    use_head_groups(spec.model, head_groups)
    model = spec.model.build()
    adapter = state_dict_adapter(spec.model)
    missing, unexpected = model.load_state_dict(adapter.from_hf(load_file(folder / "model.safetensors")), strict=False)
    # The aux-loss-free routing bias is TorchTitan's training state, not HF's: zero, as built.
    assert not unexpected and all(key.endswith("moe.expert_bias_E") for key in missing), (missing, unexpected)
    if parallel_dims is not None:
        model.parallelize(parallel_dims)
    return model


_EP_DIMS: dict[tuple[int, int], ParallelDims] = {}  # (CP, EP) -> this worker's meshes, built once


def _ep_dims(cp: int, ep: int) -> ParallelDims:
    """EP borrowing its ranks from the CP ranks (no data parallelism): efsdp = CP / EP."""
    if (cp, ep) not in _EP_DIMS:
        dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=cp, tp=1, pp=1, ep=ep, world_size=cp,
                            spmd_backend="partial_dtensor")  # fmt: skip
        dims.build_mesh()
        _EP_DIMS[cp, ep] = dims
    return _EP_DIMS[cp, ep]


def _grad_share(grad: torch.Tensor) -> torch.Tensor:
    """A gradient as a full-size tensor holding this rank's share: an EP-sharded expert gradient
    (Shard(0) over "ep") is its local experts' rows, computed from every token routed to them
    from this rank's EP group, and zero for the other experts; summed over the ranks, every
    token's contribution is counted once."""
    if not isinstance(grad, DTensor):
        return grad
    assert grad.placements == (Shard(0),), grad.placements
    local = grad.to_local()
    share = local.new_zeros(grad.shape)
    start = grad.device_mesh.get_local_rank() * local.shape[0]
    share[start : start + local.shape[0]] = local
    return share


def run_window(rank: int, group, folder: Path, tokens: torch.Tensor, plan, comm: str, doc_lens=DOC_LENS,
               ranks_per_node: int = 1, ep: int = 1, head_groups: int = 1) -> dict:  # fmt: skip
    """This rank's logits (window order given by token_index) and its share of the gradients, HF
    names; `ranks_per_node` for comm "two_level"; `ep` > 1: the experts split over EP ranks borrowed
    from the CP ranks, tokens sent to them by TorchTitan's all-to-all dispatcher; `head_groups`: as
    `[activation_checkpoint] head_groups`."""
    torch.manual_seed(0)
    backend = titan_dist.get_spmd_backend()
    titan_dist.set_spmd_backend("partial_dtensor")  # as the trainer sets it for FlashCP's jobs
    try:
        model = our_model(folder, _ep_dims(plan.cp_size, ep) if ep > 1 else None, head_groups)
        if comm == "two_level":
            dispatch = build_two_level_dispatch(plan, rank, ranks_per_node)
        else:
            dispatch = build_dispatch(plan, rank, comm)
        labels = _labels(tokens, doc_lens)[dispatch.token_index]
        routes: list[torch.Tensor] = []  # each MoE layer's top-k experts of this rank's tokens
        for name, module in model.named_modules():
            if name.endswith("moe.router"):
                module.register_forward_hook(lambda m, args, out: routes.append(out[1][0].sort(-1).values))
        logits = model(tokens[dispatch.token_index][None], positions=dispatch.positions[None],
                       attention_masks=CPStep.of(flashcp_ropes(model), dispatch, group if plan.cp_size > 1 else None))[0]  # fmt: skip
        # Each rank's token sum over the window's count, as the trainer normalises: the ranks' gradients add up.
        loss = torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")
        (loss / (_labels(tokens, doc_lens) != -100).sum()).backward()
    finally:
        titan_dist.set_spmd_backend(backend)
    # An unsharded copy holding the gradients as weights, mapped to HF names through its state_dict
    # (which splits the fused QKV) by the adapter.
    grads = our_model(folder)
    with torch.no_grad():
        for name, p in grads.named_parameters():
            p.copy_(_grad_share(model.get_parameter(name).grad))
    buffers = {name for name, _ in grads.named_buffers()}  # DeepSeek-V3's routing bias: no gradient
    params = {k: v for k, v in grads.state_dict().items() if k not in buffers}
    hf_grads = state_dict_adapter(model.config).to_hf(params)
    return {"index": dispatch.token_index, "logits": logits.detach(), "grads": hf_grads, "routes": routes}


def _relative(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def check(parts: list[dict], ref: dict, what: str) -> tuple[float, float]:
    """Assembles the ranks' logits and sums their gradients; returns the worst relative errors."""
    logits = torch.empty_like(ref["logits"])
    for part in parts:
        logits[part["index"]] = part["logits"]
    grads = {k: sum(part["grads"][k] for part in parts) for k in parts[0]["grads"]}
    assert sorted(grads) == sorted(ref["grads"]), what
    for layer, expected in enumerate(ref.get("routes", [])):
        routes = torch.empty_like(expected)
        for part in parts:
            routes[part["index"]] = part["routes"][layer]
        assert torch.equal(routes, expected), f"{what}: layer {layer}'s router chose other experts than transformers'"
    logit_err = _relative(logits, ref["logits"])
    grad_err = max(_relative(grads[k], ref["grads"][k]) for k in grads)
    assert logit_err <= RELATIVE_TOLERANCE, f"{what}: logits off by {logit_err:.2e} (relative)"
    assert grad_err <= RELATIVE_TOLERANCE, f"{what}: gradients off by {grad_err:.2e} (relative)"
    return logit_err, grad_err


@pytest.mark.parametrize("name", MODELS)
def test_cp1_matches_transformers(hf_models, name):
    folder, ref = hf_models[name]
    plan = plan_shards(DOC_LENS, 1, "per_seq")
    check([run_window(0, None, folder, ref["tokens"], plan, "compact")], ref, f"{name} CP=1")


def test_transformers_sees_scaling(hf_models):
    """The scaled RoPEs matter on this window: dropping the scaling moves transformers' logits far
    beyond the tolerance, so the CP tests above compare RoPE, not only the rest of the model."""
    folder, ref = hf_models["llama3-scaled"]
    config = transformers.AutoConfig.from_pretrained(folder)
    config.rope_parameters = {"rope_type": "default", "rope_theta": config.rope_parameters["rope_theta"]}
    plain = transformers.AutoModelForCausalLM.from_pretrained(
        folder, config=config, attn_implementation="eager"
    )
    logits = torch.cat([plain(input_ids=doc[None]).logits[0] for doc in ref["tokens"].split(DOC_LENS)])
    assert _relative(logits.detach(), ref["logits"]) > 100 * RELATIVE_TOLERANCE


@pytest.fixture(scope="module")
def pool(gloo_pool):
    return gloo_pool(2)


# Every strategy with FlashCP's compact exchange; the other exchanges once.
CP2_CASES = [(s, "compact") for s in STRATEGIES] + [("flashcp", "full"), ("flashcp", "needed")]


@pytest.mark.parametrize("name", [name for name in MODELS if name != "qwen3-moe"])
def test_cp2_matches_transformers_for_every_strategy(hf_models, pool, name):
    folder, ref = hf_models[name]
    for strategy, comm in CP2_CASES:
        plan = plan_shards(DOC_LENS, 2, strategy, **PLAN_OPTIONS.get(strategy, {}))
        parts = pool.run(run_window, (folder, ref["tokens"], plan, comm))
        check(parts, ref, f"{name} CP=2 {strategy}/{comm}")


@pytest.mark.parametrize("name", MODELS)
def test_head_groups_match_transformers(hf_models, pool, name):
    """Each attention layer over 2 groups of its 2 KV heads (one head a group), checkpointed per group,
    at CP = 2 with FlashCP's plan and the compact and two-level exchanges (under 1 s a family once the
    pool is up); measured: logits <= 1.4e-6, gradients <= 2.5e-6 relative."""
    folder, ref = hf_models[name]
    plan = plan_shards(DOC_LENS, 2, "flashcp")
    for comm in ("compact", "two_level"):
        parts = pool.run(run_window, (folder, ref["tokens"], plan, comm, DOC_LENS, 1, 1, 2))
        what = f"{name} CP=2 flashcp/{comm} head_groups=2"
        print(what, "relative errors: logits {:.1e}, gradients {:.1e}".format(*check(parts, ref, what)))


def test_moe_window_has_no_router_ties(hf_models):
    """The MoE window's routing is decided by margins far above float32 rounding (see ROUTE_MARGIN),
    so equal choices on both sides test the router, not luck."""
    _, ref = hf_models["qwen3-moe"]
    assert ref["margin"] > ROUTE_MARGIN, f"a near-tie in the routers (gap {ref['margin']:.2e}): pick another window"


# Qwen3-MoE at CP x EP, EP borrowing the CP ranks: the full product at CP = 2 and CP = 4 x EP = 4
# (one expert pair per rank), CP = 4 x EP = 2 (two ranks per expert pair, efsdp = 2) with each
# exchange once; every case's tokens reach their experts through TorchTitan's all-to-all.
MOE_CASES = [(2, ep, case) for ep in (1, 2) for case in CP2_CASES] + [(4, ep, case) for ep in (1, 4) for case in CP2_CASES] \
    + [(4, 2, case) for case in (("flashcp", "compact"), ("per_doc", "full"), ("flashcp", "needed"))]  # fmt: skip


@pytest.mark.parametrize("cp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_moe_matches_transformers_at_every_cp_and_ep(hf_models, gloo_pool, cp):
    """Logits, gradients and every router's choices at each (CP, EP, strategy, comm) of MOE_CASES."""
    folder, ref = hf_models["qwen3-moe"]
    pool = gloo_pool(cp)
    for _, ep, (strategy, comm) in (case for case in MOE_CASES if case[0] == cp):
        plan = plan_shards(DOC_LENS, cp, strategy, **PLAN_OPTIONS.get(strategy, {}))
        parts = pool.run(run_window, (folder, ref["tokens"], plan, comm, DOC_LENS, 1, ep))
        what = f"qwen3-moe CP={cp} EP={ep} {strategy}/{comm}"
        print(what, "relative errors: logits {:.1e}, gradients {:.1e}".format(*check(parts, ref, what)))
