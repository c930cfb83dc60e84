"""Qwen3-MoE trained with expert parallelism on FlashCP's mesh reproduces the one-rank run.

A tiny custom Qwen3-MoE (4 experts, top-2) trains 20 steps of two windows from one seed checkpoint
on one rank (CP = 1, EP = 1, two micro steps) and on 4 gloo ranks with FSDP 2 x CP 2 and EP 2: the
experts split by EP over ranks borrowed from dp_shard x cp, tokens sent to them by TorchTitan's
all-to-all dispatcher, the same two windows per step (`[data] balance = "mesh"` packs a step's
documents over DP ranks x micro steps from their lengths alone). The losses must agree to TOLERANCE and
each layer's aux-loss-free routing bias after the last step exactly: every step moves it by
coeff x sign(mean - count) of the step's expert token counts, so one count summed over other ranks
than the global batch's (DP x CP) moves it differently. Full activation checkpointing counts every
token twice (forward and recompute), which TorchTitan's bias update halves.
"""

from __future__ import annotations

import pytest
import torch
from harness import single_rank, tiny_job, tiny_seed_checkpoint, train, train_on_pool_rank

STEPS = 20
TOLERANCE = 1e-5  # absolute, on losses of ~8 in float32
MOE = {"name": "qwen3", "num_experts": 4, "num_experts_per_tok": 2, "moe_hidden_dim": 32}


def moe_job(dump, checkpoint, **sections):
    return tiny_job(dump, model=MOE, checkpoint=checkpoint, training={"steps": STEPS, "global_batch_size": 2},
                    data={"balance": "mesh", "prefetch": 0}, **sections)  # fmt: skip


def _pool_run(rank, group, cfg):
    """A rank's losses, final routing biases, expert counts per step, and the graphs dynamo compiled
    and its graph breaks (the pool's workers are reused: compiled code and counters start empty)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    biases: list[torch.Tensor] = []
    counts: list[torch.Tensor] = []
    losses = train_on_pool_rank(rank, group, cfg, expert_biases=biases, expert_counts=counts)
    return losses, biases, counts, (counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()))


def check_run(runs: list, reference: tuple, recounted: int) -> float:
    """Every rank's losses within TOLERANCE of the one-rank run's and its routing biases equal to
    them; the ranks' expert counts, summed, `recounted` times the one-rank run's at every step
    (a recompute that runs the router again counts its tokens again). Returns the worst loss gap."""
    _, losses, biases, counts = reference
    worst = 0.0
    for rank_losses, rank_biases, _, _ in runs:
        worst = max(worst, *(abs(rank_losses[s] - losses[s]) for s in losses))
        assert worst <= TOLERANCE, f"losses off by {worst:.2e}"
        for layer, (ours, ref) in enumerate(zip(rank_biases, biases, strict=True)):
            assert torch.equal(ours, ref), f"layer {layer}'s routing bias differs: {ours} vs {ref}"
    summed = [sum(run[2][step] for run in runs) for step in range(len(counts))]
    assert len(runs[0][2]) == len(counts) == STEPS
    for step, (ours, ref) in enumerate(zip(summed, counts, strict=True), start=1):
        assert torch.equal(ours, recounted * ref), f"step {step}'s expert counts {ours} vs {recounted} x {ref}"
    return worst


def one_rank_reference(root, model: dict, job, replace: tuple[str, ...] = ()):
    """A seed checkpoint of the tiny job with `model`, and `job(dump, seed)`'s one-rank losses, final
    routing biases and expert counts per step from it: (seed section, losses, biases, counts)."""
    with single_rank():
        train(tiny_job(root / "seed", replace, model=model, checkpoint={"enable": True, "create_seed_checkpoint": True}),
              seed_checkpoint=True)  # fmt: skip
    seed = {"enable": True, "initial_load_path": str(root / "seed/checkpoint/step-0")}
    biases: list[torch.Tensor] = []
    counts: list[torch.Tensor] = []
    with single_rank():
        losses = train(job(root / "cp1", seed), expert_biases=biases, expert_counts=counts)
    return seed, losses, biases, counts


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The seed checkpoint and the one-rank run's losses, final routing biases and expert counts."""
    seed, losses, biases, counts = one_rank_reference(tmp_path_factory.mktemp("moe"), MOE, moe_job)
    assert losses[STEPS] < losses[1] - 0.1  # it trains
    assert any(b.abs().sum() > 0 for b in biases)  # the routing bias moved
    return seed, losses, biases, counts


@pytest.mark.slow
@pytest.mark.parametrize("offload", [False, True], ids=["full AC", "full AC offloaded"])
def test_ep2_cp2_reproduces_the_one_rank_run(reference, gloo_pool, tmp_path, offload):
    """With `offload` the MoE blocks' checkpointed inputs wait in host memory: nothing else changes."""
    cfg = moe_job(tmp_path, reference[0], parallelism={"context_parallel_degree": 2, "expert_parallel_degree": 2,
                                                       "data_parallel_shard_degree": 2},
                  activation_checkpoint={"mode": "full", "offload": offload})  # fmt: skip
    worst = check_run(gloo_pool(4).run(_pool_run, (cfg,)), reference, recounted=2)
    print(f"EP 2 x CP 2 x FSDP 2, full AC{' offloaded' if offload else ''}: losses within {worst:.1e} of CP 1")


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"])
def test_ep2_cp2_on_two_ranks_reproduces_the_one_rank_run(reference, gloo_pool, tmp_path, compiled):
    """EP borrowing both CP ranks (no data parallelism; the experts' FSDP mesh has one rank), full AC.

    Compiled (`[compile] enable`, inductor): each block is one graph, the MoE dispatch's sizes
    symbolic and the experts' float32 grouped matmuls the op `flashcp::expert_grouped_mm`. Its
    recompute does not count the tokens again, unlike eager checkpointing, which TorchTitan's bias
    update halves for: FlashCP doubles a compiled checkpointed block's counts first, so the biases
    still move as at CP = 1 (without that they part within 20 steps)."""
    cfg = moe_job(tmp_path, reference[0], parallelism={"context_parallel_degree": 2, "expert_parallel_degree": 2,
                                                       "data_parallel_shard_degree": 1},
                  activation_checkpoint={"mode": "full"},
                  compile={"enable": compiled, "components": ["model"]})  # fmt: skip
    runs = gloo_pool(2).run(_pool_run, (cfg,))
    worst = check_run(runs, reference, recounted=1 if compiled else 2)
    graphs = {run[3] for run in runs}
    print(f"EP 2 x CP 2, full AC, {'compiled' if compiled else 'eager'}: losses within {worst:.1e} of CP 1; "
          f"graphs compiled, breaks: {graphs}")  # fmt: skip
    assert graphs == ({(1, 0)} if compiled else {(0, 0)})


@pytest.mark.slow
def test_ep2_cp2_resumes_bit_exactly(reference, gloo_pool, tmp_path):
    """The 4-rank job stopped after step 10 and started again: its steps 11-20 are the uninterrupted
    run's bit for bit (weights, optimizer, routing bias and data cursor all restored), and the
    routing bias ends where the one-rank run's does."""
    seed, _, biases, _ = reference

    def job(name):
        return moe_job(tmp_path / name, seed | {"interval": 10},
                       parallelism={"context_parallel_degree": 2, "expert_parallel_degree": 2,
                                    "data_parallel_shard_degree": 2},
                       activation_checkpoint={"mode": "full"})  # fmt: skip

    pool = gloo_pool(4)
    whole = pool.run(_pool_run, (job("whole"),))
    pool.run(train_on_pool_rank, (job("resumed"), None, None, 10))
    resumed = pool.run(_pool_run, (job("resumed"),))
    for (whole_losses, whole_biases, *_), (resumed_losses, resumed_biases, *_) in zip(whole, resumed, strict=True):
        assert sorted(resumed_losses) == list(range(11, STEPS + 1))
        assert all(resumed_losses[s] == whole_losses[s] for s in resumed_losses), (resumed_losses, whole_losses)
        for ours, resumed_bias, ref in zip(whole_biases, resumed_biases, biases, strict=True):
            assert torch.equal(ours, ref) and torch.equal(resumed_bias, ref)


def test_the_balance_costs_a_token_by_its_active_parameters():
    """The loader's window cost (`FlashCPTrainer._window_cost`) prices a token of Qwen3-MoE's
    debugmodel_moe by what it runs through: every non-expert matrix and top_k of each layer's
    experts, counted here from the built model's parameters, not all the experts."""
    from types import SimpleNamespace

    from torchtitan.distributed.activation_checkpoint import FullAC

    from flashcp.costmodel.proxy import window_cost
    from flashcp.titan.models.decoders import titan_config
    from flashcp.titan.models.registry import flavor_architecture
    from flashcp.titan.trainer import FlashCPTrainer

    seq_len, arch = 4096, flavor_architecture("qwen3", "debugmodel_moe")
    config = titan_config(arch, "flex", seq_len)
    with torch.device("meta"):
        model = config.build()
    experts = sum(p.numel() for n, p in model.named_parameters() if "routed_experts" in n)
    embedding = model.tok_embeddings.weight.numel()
    active = sum(p.numel() for p in model.parameters()) - experts - embedding + \
        experts * arch.experts.top_k // arch.experts.num_experts  # fmt: skip
    assert experts > 0 and arch.experts.top_k < arch.experts.num_experts
    metrics = SimpleNamespace(num_flops_per_token=config.get_nparams_and_flops(model, seq_len)[1])
    trainer = SimpleNamespace(
        metrics_processor=metrics, model_config=config, cp_ranks_per_node=1, flashcp=SimpleNamespace(comm="compact"),
        parallel_dims=SimpleNamespace(tp=1, cp=2),
        config=SimpleNamespace(training=SimpleNamespace(steps=1, seq_len=seq_len, mixed_precision_param="bfloat16"),
                               activation_checkpoint=FullAC.Config()),
    )  # fmt: skip
    FlashCPTrainer._configure_metrics(trainer)
    assert metrics.dense_flops_per_token == 6 * active
    cost = FlashCPTrainer._window_cost(trainer)
    assert cost == window_cost(6 * active, metrics.attention_flops_per_pair, cp=2, full_ac=True)
