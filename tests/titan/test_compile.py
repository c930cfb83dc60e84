"""A compiled TorchTitan block with FlashCP attention is one graph: no breaks, no recompiles.

FlashCP's attention is the registered op `flashcp::cp_attention` (flashcp.attention.op): the
compiler sees one node taking q, k, v and the step's key tensor, and the RoPE rows as a tensor
the trainer computed. These tests trace a real block (Llama 3 with GQA, Qwen3 with its own
head_dim) with `torch._dynamo.explain` for every KV exchange with and without overlap, train it
compiled over 50 random windows of a CP group of 2 (all ranks in this process,
flashcp.attention.simulate) counting the frames compiled, and compare every fifth window's output
and gradients with the eager block's. The multi-rank trainer runs (compiled = eager losses under
FSDP and TP) are in test_parity.py.
"""

from __future__ import annotations

import gc
import random

import pytest
import torch
import torch._dynamo.testing

import flashcp.titan  # noqa: F401  (TorchTitan shims before torchtitan)
from flashcp.attention.op import live_entries
from flashcp.attention.simulate import run_ranks
from flashcp.dispatch import build_dispatch, COMM_MODES
from flashcp.plan import plan_shards
from flashcp.titan.config import validate
from flashcp.titan.models.attention import CPStep, flashcp_ropes
from flashcp.titan.models.spec import model_spec

WINDOW = 96  # tokens per window; 48 per rank
MODELS = {  # GQA (4 query heads over 2 KV heads), and Qwen3's head_dim 24 != dim / n_heads = 16
    "llama3": {"name": "llama3"},
    "qwen3": {"name": "qwen3", "head_dim": 24},
}
EAGER_EVERY = 5  # windows compared with the eager block (all ranks' outputs and gradients)
TOLERANCE = 1e-10  # float64 block, compiled (aot_eager) vs eager: summation order only; observed 0-1e-15
INDUCTOR_TOLERANCE = 1e-10  # relative, float64, inductor's fused kernels vs eager


def _block(keys: dict, overlap: bool = False) -> tuple[torch.nn.Module, dict]:
    model = {"flavor": "custom", "dim": 64, "n_layers": 1, "n_heads": 4, "n_kv_heads": 2, "multiple_of": 32,
             "vocab_size": 97} | keys  # fmt: skip
    cfg = validate({"model": model, "flashcp": {"backend": "reference", "overlap": overlap},
                    "training": {"seq_len": WINDOW}})  # fmt: skip
    torch.manual_seed(0)
    decoder = model_spec(cfg["model"], cfg["flashcp"], 97, WINDOW).model.build()
    decoder.init_states()
    return decoder.layers["0"].double(), flashcp_ropes(decoder)


def _window(rng: random.Random) -> list[int]:
    cuts = sorted(rng.sample(range(1, WINDOW), rng.randint(1, 9)))
    return [b - a for a, b in zip([0, *cuts], [*cuts, WINDOW])]


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("comm", COMM_MODES)
@pytest.mark.parametrize("overlap", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_explain_finds_one_graph_and_no_break(name, comm, overlap):
    block, ropes = _block(MODELS[name], overlap)
    # Documents cut across the ranks, so with overlap both halves (local-only and remote shards) run.
    plan = plan_shards([40, 3, 30, 23], 2, "flashcp")
    dispatches = [build_dispatch(plan, r, comm, overlap=overlap) for r in range(2)]
    assert not overlap or all(d.overlap.local.rows.numel() and d.overlap.remote.rows.numel() for d in dispatches)
    x = torch.randn(1, plan.tokens_per_rank, 64, dtype=torch.float64)

    def explain(rank, group):
        d = dispatches[rank]
        return torch._dynamo.explain(block)(x, CPStep.of(ropes, d, group), d.positions[None])

    explained = run_ranks(2, explain)[0]
    print(f"{name} {comm} overlap={overlap}: {explained.graph_count} graph(s), {explained.graph_break_count} "
          f"break(s), {explained.op_count} ops")  # fmt: skip
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    assert any("flashcp.cp_attention" in str(node.target) for g in explained.graphs for node in g.graph.nodes)


def _train_window(block, ropes, plan, comm: str, x: torch.Tensor, g: torch.Tensor, grad: bool = True):
    """Every rank's block output and the gradients of its input and parameters for one window."""
    dispatches = [build_dispatch(plan, r, comm) for r in range(plan.cp_size)]

    def program(rank, group):
        d = dispatches[rank]
        xl = x[:, d.token_index].clone().requires_grad_(grad)
        block.zero_grad(set_to_none=True)
        out = block(xl, CPStep.of(ropes, d, group), d.positions[None])
        if not grad:
            return (out,)
        (out * g[:, d.token_index]).sum().backward()
        return out.detach(), xl.grad, *(p.grad.clone() for p in block.parameters())

    return run_ranks(plan.cp_size, program)


@pytest.mark.parametrize("name", ["llama3", pytest.param("qwen3", marks=pytest.mark.slow)])
def test_fifty_random_windows_compile_once_and_match_eager(name):
    """Each window has other documents, so other shard lengths, buffer sizes, splits and index
    tensors: none reaches the compiler. The first validation (no_grad) compiles once more (grad mode
    is a guard), and later ones reuse it. Nothing the op registers outlives its step."""
    block, ropes = _block(MODELS[name])
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(block, backend=counter, fullgraph=True)
    rng = random.Random(0)
    worst = 0.0
    for i in range(50):
        plan = plan_shards(_window(rng), 2, "flashcp")
        comm = COMM_MODES[i % len(COMM_MODES)]
        x, g = torch.randn(2, 1, WINDOW, 64, dtype=torch.float64)
        got = _train_window(compiled, ropes, plan, comm, x, g)
        if i % EAGER_EVERY == 0:
            want = _train_window(block, ropes, plan, comm, x, g)
            for rank_want, rank_got in zip(want, got):
                for a, b in zip(rank_want, rank_got):
                    worst = max(worst, (a - b).abs().max().item())
    print(f"{name}: 50 windows, {counter.frame_count} frame(s) compiled, max |compiled - eager| {worst:.1e} "
          f"over {50 // EAGER_EVERY} of them")  # fmt: skip
    assert counter.frame_count == 1
    assert worst <= TOLERANCE
    with torch.no_grad():
        for _ in range(3):
            plan = plan_shards(_window(rng), 2, "flashcp")
            x, g = torch.randn(2, 1, WINDOW, 64, dtype=torch.float64)
            want = _train_window(block, ropes, plan, "compact", x, g, grad=False)
            got = _train_window(compiled, ropes, plan, "compact", x, g, grad=False)
            assert all((a[0] - b[0]).abs().max().item() <= TOLERANCE for a, b in zip(want, got))
    assert counter.frame_count == 2
    gc.collect()
    assert live_entries() == (0, 0, 0)


# q's buffer is as large as the attention projection's output when heads x head_dim = dim: then
# inductor reused it for that output before the fix (Qwen3's head_dim 24 above did not trigger it).
INDUCTOR_MODELS = {"llama3": {"name": "llama3"}, "qwen3": {"name": "qwen3"}}


@pytest.mark.parametrize("name", INDUCTOR_MODELS)
@pytest.mark.parametrize("cp", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_inductor_block_matches_eager_gradients(name, cp):
    """`[compile] enable`'s backend: inductor reuses a buffer once the graph stops reading it, so the
    op must not leave q, k, v or its output in the graph it keeps for the backward (it did: a Qwen3
    block's rotated q was overwritten, its query/key-side gradients ~100 % off). float64."""
    block, ropes = _block(INDUCTOR_MODELS[name])
    compiled = torch.compile(block, backend="inductor", fullgraph=True)
    plan = plan_shards([40, 3, 30, 23], cp, "flashcp")
    x, g = torch.randn(2, 1, WINDOW, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    want = _train_window(block, ropes, plan, "compact", x, g)
    got = _train_window(compiled, ropes, plan, "compact", x, g)
    names = ["output", "input", *(n for n, _ in block.named_parameters())]
    worst = {n: max((a - b).norm().item() / a.norm().item() for a, b in ((w[i], o[i]) for w, o in zip(want, got)))
             for i, n in enumerate(names)}  # fmt: skip
    print(f"{name} CP {cp} inductor vs eager, worst relative error over ranks: "
          + ", ".join(f"{n} {e:.1e}" for n, e in worst.items()))
    assert max(worst.values()) <= INDUCTOR_TOLERANCE, worst
