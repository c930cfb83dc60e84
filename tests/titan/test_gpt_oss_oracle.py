"""Oracle for gpt-oss: transformers' `GptOssForCausalLM` decides whether FlashCP's is right, in float64.

A tiny random model is built locally: 3 layers (sliding, full, sliding: HF layer_types) with a
6-key sliding window, 4 heads of 16 over 2 KV heads, learned sinks far from zero, biases on every
projection and expert, 8 experts top-2 behind a biased router, a SwiGLU clamped at 1.0 (so the
clamp bites) and YaRN RoPE (factor 4 from 16 positions, untruncated correction range, as gpt-oss).
Ours is built from the saved config.json through FlashCP's one build path (TorchTitan's gpt-oss
layers, `FlashCPAttention` with the window layers on their own dispatch and the sinks inside the
op), in float64, its weights mapped in by TorchTitan's adapter (the experts, which transformers
saves unquantized and the adapter maps only as MXFP4 blocks, by `_EXPERTS`). On one packed window
(documents of 23, 1, 4, 29 and 7 tokens: one token, shorter than the window, far longer; each
seen by transformers alone from position 0) ours must give transformers' logits and every
gradient (the sinks' included), with the same experts chosen for every token, to TOLERANCE at
CP = 1, 2 and 4, with the flashcp strategy and the compact, needed, full and two-level exchanges
(every strategy at CP = 2), and with the experts split over EP = 2 ranks borrowed from CP = 2.
The controls show that the sinks, the window, the clamp and YaRN's softmax scale each move
transformers' own logits far beyond the tolerance.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import flashcp.titan  # noqa: F401  (TorchTitan shims before transformers / torchtitan)
import torchtitan.distributed.utils as titan_dist
from torchtitan.models.gpt_oss.sharding import set_gpt_oss_sharding_config

from flashcp.attention import build_two_level_dispatch
from flashcp.dispatch import build_dispatch
from flashcp.plan import plan_shards, STRATEGIES
from flashcp.titan.config import validate
from flashcp.titan.models.attention import CPStep, flashcp_ropes, flashcp_windows
from flashcp.titan.models.decoders import state_dict_adapter
from flashcp.titan.models.spec import model_spec
from flashcp.titan.models.windows import build_layer_dispatches

from tests.titan.test_hf_oracle import _ep_dims, _grad_share, _hf_reference, _labels, _relative, check, \
    PLAN_OPTIONS, ROUTE_MARGIN, transformers  # fmt: skip

from safetensors.torch import load_file

TOLERANCE = 1e-6  # max |ours - HF| / max |HF|, float64; both sides compute RoPE's rows in float32
DOC_LENS = (23, 1, 4, 29, 7)  # 64 tokens: a 1-token document, one shorter than the window, longer ones
WINDOW = sum(DOC_LENS)
VOCAB = 101
SLIDING_WINDOW = 6
CONFIG = {
    "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 3,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"], "sliding_window": SLIDING_WINDOW,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 8,
    "num_experts_per_tok": 2, "swiglu_limit": 1.0, "max_position_embeddings": 64, "rms_norm_eps": 1e-5,
    "initializer_range": 0.2, "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                        "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16},
}  # fmt: skip
# transformers' unquantized expert tensors -> ours (TorchTitan's: [E, out, in], transformers': [E, in, out]).
_EXPERTS = {"gate_up_proj": "mlp1_weight_EGD", "gate_up_proj_bias": "mlp1_bias_EG",
            "down_proj": "mlp2_weight_EDF", "down_proj_bias": "mlp2_bias_ED"}  # fmt: skip
_OURS = "moe.routed_experts.inner_experts"
EAGER = {"attn_implementation": "eager", "experts_implementation": "eager"}  # transformers' float64-capable paths


def _prepare(model) -> None:
    """Sinks and every bias drawn far from zero (transformers initialises the biases to zero)."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
            elif name.endswith("bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))


def _hf_run(model, tokens: torch.Tensor) -> dict:
    """Each document alone through transformers, as the other families' oracle runs it (its routers
    are `mlp.router`, its experts' gradients stay fused)."""
    return _hf_reference(model, tokens, DOC_LENS, router="mlp.router", fused_experts=False)


def _hf_model(folder: Path, **changes):
    """The saved model in float64, its config changed by `changes`."""
    config = transformers.AutoConfig.from_pretrained(folder)
    for key, value in changes.items():
        setattr(config, key, value)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, config=config, **EAGER)
    return model.double()


def _norm_in_model_dtype(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """`GptOssRMSNorm.forward` without its cast to float32: an upcast for bfloat16, a rounding in float64
    (it alone put transformers 1.5e-6 off float64, its only such cast outside RoPE; the same math)."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


@pytest.fixture(scope="module")
def oracle(tmp_path_factory) -> Iterator[tuple[Path, dict]]:
    """(the saved folder, transformers' float64 run on the first window without router near-ties);
    transformers' norms in float64 while the module's tests run."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(transformers.models.gpt_oss.modeling_gpt_oss.GptOssRMSNorm, "forward", _norm_in_model_dtype)
        yield _reference(tmp_path_factory.mktemp("gpt_oss"))


def _reference(folder: Path) -> tuple[Path, dict]:
    torch.manual_seed(0)
    config = transformers.GptOssConfig(**CONFIG)
    model = transformers.AutoModelForCausalLM.from_config(config, **EAGER).double()
    _prepare(model)
    model.save_pretrained(folder)
    for seed in range(20):
        tokens = torch.randint(0, VOCAB, (WINDOW,), generator=torch.Generator().manual_seed(seed))
        model.zero_grad()
        ref = _hf_run(model, tokens)
        if ref["margin"] > ROUTE_MARGIN:
            return folder, ref
    raise AssertionError("no window without a near-tie in the routers")


def _our_model(folder: Path, ep_dims=None) -> torch.nn.Module:
    """Ours from the folder's config.json in float64, transformers' weights mapped in; with `ep_dims`
    its experts then sharded over the "ep" mesh as the trainer does."""
    cfg = validate({"model": {"hf_config": str(folder)}, "flashcp": {"backend": "reference"},
                    "training": {"seq_len": WINDOW}})  # fmt: skip
    spec = model_spec(cfg["model"], cfg["flashcp"], VOCAB, WINDOW)
    if ep_dims is not None:  # what GptOssModel.Config.update_from_config does for the trainer
        set_gpt_oss_sharding_config(spec.model, enable_sp=False, enable_ep=True)
    model = spec.model.build().to(torch.float64)
    hf = load_file(folder / "model.safetensors")
    # TorchTitan 0.3.0's adapter maps transformers' expert biases to names its experts no longer have.
    state = {k: v for k, v in state_dict_adapter(spec.model).from_hf(hf).items() if _OURS not in k}
    for name, value in hf.items():
        prefix, _, last = name.rpartition(".")
        if last in _EXPERTS:
            layer = prefix.split(".")[2]
            state[f"layers.{layer}.{_OURS}.{_EXPERTS[last]}"] = value.transpose(1, 2) if value.ndim == 3 else value
    missing, unexpected = model.load_state_dict(state, strict=False)
    # The aux-loss-free routing bias is TorchTitan's training state, not HF's: zero, as built.
    assert not unexpected and all(key.endswith("moe.expert_bias_E") for key in missing), (missing, unexpected)
    if ep_dims is not None:
        model.parallelize(ep_dims)
    return model


def _hf_grads(model: torch.nn.Module, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`grads` (ours, by parameter name) under transformers' names and layouts: the adapter maps a
    copy holding them as weights (its state_dict splits the fused QKV), `_EXPERTS` the experts."""
    copy = model.config.build().to(torch.float64)
    with torch.no_grad():
        for name, p in copy.named_parameters():
            p.copy_(grads[name])
    buffers = {name for name, _ in copy.named_buffers()}
    out = state_dict_adapter(copy.config).to_hf({k: v for k, v in copy.state_dict().items() if k not in buffers})
    hf_names = {ours: hf for hf, ours in _EXPERTS.items()}
    for name, grad in grads.items():
        if _OURS in name:
            hf = f"model.layers.{name.split('.')[1]}.mlp.experts.{hf_names[name.rpartition('.')[2]]}"
            out[hf] = grad.transpose(1, 2) if grad.ndim == 3 else grad
    return out


def run_window(rank: int, group, folder: Path, tokens: torch.Tensor, plan, comm: str, ep: int = 1) -> dict:
    """This rank's logits (window order given by token_index), its share of the gradients under
    transformers' names and each MoE layer's top-k experts of its tokens."""
    torch.manual_seed(0)
    backend = titan_dist.get_spmd_backend()
    titan_dist.set_spmd_backend("partial_dtensor")  # as the trainer sets it for FlashCP's jobs
    try:
        model = _our_model(folder, _ep_dims(plan.cp_size, ep) if ep > 1 else None)
        if comm == "two_level":  # nodes of cp / 2 ranks
            build = functools.partial(build_two_level_dispatch, rank=rank, ranks_per_node=plan.cp_size // 2)
        else:
            build = functools.partial(build_dispatch, rank=rank, comm=comm)
        dispatches = build_layer_dispatches(plan, build, flashcp_windows(model))
        assert set(dispatches.windows) == {SLIDING_WINDOW}
        routes: list[torch.Tensor] = []
        for name, module in model.named_modules():
            if name.endswith("moe.router"):
                module.register_forward_hook(lambda m, args, out: routes.append(out[1][0].sort(-1).values))
        index = dispatches.token_index
        step = CPStep.of(flashcp_ropes(model), dispatches, group if plan.cp_size > 1 else None)
        logits = model(tokens[index][None], positions=dispatches.positions[None], attention_masks=step)[0]
        labels = _labels(tokens, DOC_LENS)
        loss = torch.nn.functional.cross_entropy(logits, labels[index], ignore_index=-100, reduction="sum")
        (loss / (labels != -100).sum()).backward()
    finally:
        titan_dist.set_spmd_backend(backend)
    grads = {name: _grad_share(p.grad) for name, p in model.named_parameters()}
    return {"index": index, "logits": logits.detach(), "grads": _hf_grads(model, grads), "routes": routes}


def _check(parts: list[dict], ref: dict, what: str) -> None:
    """The test_hf_oracle check (assembled logits, summed gradients, same routes), then to TOLERANCE."""
    logits, grads = check(parts, ref, what)
    print(f"{what}: logits {logits:.1e}, gradients {grads:.1e} (relative)")
    assert logits <= TOLERANCE and grads <= TOLERANCE, f"{what}: logits {logits:.2e}, gradients {grads:.2e}"


def test_window_has_no_router_ties(oracle):
    _, ref = oracle
    assert ref["margin"] > ROUTE_MARGIN


def test_cp1_matches_transformers(oracle):
    folder, ref = oracle
    _check([run_window(0, None, folder, ref["tokens"], plan_shards(DOC_LENS, 1, "per_seq"), "compact")], ref,
           "CP=1")  # fmt: skip


@pytest.mark.parametrize("change", ["sinks", "window", "clamp", "yarn"])
def test_each_feature_moves_transformers_far_beyond_the_tolerance(oracle, change):
    """Zero sinks, no window, no clamp or no YaRN scale change transformers' own logits by far more
    than TOLERANCE: the CP tests compare each, not only the rest of the model."""
    folder, ref = oracle
    changes = {"window": {"layer_types": ["full_attention"] * 3}, "clamp": {"swiglu_limit": 1e9},
               "yarn": {"rope_parameters": CONFIG["rope_parameters"] | {"attention_factor": 1.0}}}  # fmt: skip
    model = _hf_model(folder, **changes.get(change, {}))
    if change == "sinks":
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("sinks"):
                    p.zero_()
    with torch.no_grad():
        logits = torch.cat([model(input_ids=doc[None]).logits[0] for doc in ref["tokens"].split(list(DOC_LENS))])
    assert _relative(logits, ref["logits"]) > 1000 * TOLERANCE, change


# CP = 2: every strategy with the compact exchange, the needed and full exchanges and EP = 2 once;
# CP = 4: flashcp with the compact, needed and two-level exchanges (nodes of 2 ranks).
CASES = [(2, s, "compact", 1) for s in STRATEGIES] + [(2, "flashcp", "needed", 1), (2, "flashcp", "full", 1),
         (2, "flashcp", "compact", 2)] + [(4, "flashcp", comm, 1) for comm in ("compact", "needed", "two_level")]  # fmt: skip


@pytest.mark.parametrize("cp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_cp_matches_transformers(oracle, gloo_pool, cp):
    folder, ref = oracle
    pool = gloo_pool(cp)  # a pool of exactly CP ranks: EP = 2 builds a mesh, which every pool rank must join
    for case_cp, strategy, comm, ep in CASES:
        if case_cp == cp:
            plan = plan_shards(DOC_LENS, cp, strategy, **PLAN_OPTIONS.get(strategy, {}))
            parts = pool.run(run_window, (folder, ref["tokens"], plan, comm, ep))
            _check(parts, ref, f"CP={cp} EP={ep} {strategy}/{comm}")


# A tiny gpt-oss the trainer runs (the tiny job's tokenizer has 4,096 tokens; 256-token windows).
TRAIN_CONFIG = CONFIG | {"vocab_size": 4096, "hidden_size": 32, "num_hidden_layers": 2, "head_dim": 8,
                         "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 16,
                         "max_position_embeddings": 256}  # fmt: skip
TRAIN_TOLERANCE = 1e-5  # absolute on losses and relative on gradients, float32


def test_trainer_at_cp2_reproduces_cp1(tmp_path, gloo_pool):
    """FlashCPTrainer on a gpt_oss config.json: each step's window dispatches (the full one and the
    sliding window's) come from the loader, the sinks' gradients are summed over the CP ranks by
    FSDP (dp_shard x cp) like every other weight's, neither dropped nor counted twice: from one seed
    checkpoint, CP = 2's first gradients (the sinks' included) and 4 losses are CP = 1's."""
    from harness import single_rank, tiny_job, train

    folder = tmp_path / "model"
    folder.mkdir()
    transformers.GptOssConfig(**TRAIN_CONFIG).save_pretrained(folder)
    model = {"hf_config": str(folder)}
    with single_rank():
        train(tiny_job(tmp_path / "seed", ("model",), model=model, checkpoint={"enable": True,
                                                                              "create_seed_checkpoint": True}),
              seed_checkpoint=True)  # fmt: skip
    seed = {"enable": True, "initial_load_path": str(tmp_path / "seed/checkpoint/step-0")}
    grads: dict[str, torch.Tensor] = {}
    with single_rank():
        losses = train(tiny_job(tmp_path / "cp1", ("model",), model=model, checkpoint=seed), first_grads=grads)
    cfg = tiny_job(tmp_path / "cp2", ("model",), model=model, checkpoint=seed,
                   parallelism={"context_parallel_degree": 2})  # fmt: skip
    runs = gloo_pool(2).run(_train_rank, (cfg,))
    assert any(name.endswith("attention.sinks") for name in grads)
    for rank_losses, rank_grads in runs:
        assert max(abs(rank_losses[s] - losses[s]) for s in losses) <= TRAIN_TOLERANCE, (rank_losses, losses)
        for name, grad in grads.items():
            assert _relative(rank_grads[name], grad) <= TRAIN_TOLERANCE, name


def _train_rank(rank: int, group, cfg: dict) -> tuple[dict[int, float], dict[str, torch.Tensor]]:
    from harness import train_on_pool_rank

    grads: dict[str, torch.Tensor] = {}
    return train_on_pool_rank(rank, group, cfg, first_grads=grads), grads
