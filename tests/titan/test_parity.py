"""CP = 2 (and TP = 2) reproduces CP = 1: same initial weights (a seed checkpoint), same windows,
same losses and gradient norms; activation checkpointing changes neither; and a CP = 2
checkpoint resumes on one rank.

The CP = 1 reference trains in this process; the CP = 2 runs train on a pool of two gloo ranks,
once per sharding strategy, KV exchange and activation-checkpointing mode. They differ only in
floating-point summation order (attention split over shards, loss summed over ranks), so the
losses of the first steps agree to within TOLERANCE while their step-to-step changes are ~1e-2.

Under full and selective activation checkpointing the backward recomputes each layer's forward,
FlashCP's KV collective included (neither TorchTitan policy saves a c10d collective's output),
before the transposed collective runs: each run counts the collectives that actually execute on
the KV buffers, and its losses and gradient norms must match the same job without checkpointing.
"""

from __future__ import annotations

import pytest
from harness import (TINY, single_rank, tiny_job, tiny_seed_checkpoint, train, train_counting_exchanges,
                     train_on_pool_rank)

STEPS = 5
TOLERANCE = 2e-5  # absolute, on losses of ~8.5 in float32 (observed: ~1e-6)
# Relative, on gradient norms (~0.5). Observed: 1.5e-5 against CP = 1 for every two-rank layout
# (CP = 2 or TP = 2), 0 against the same job without activation checkpointing. The gradients
# themselves agree to ~1e-8 per parameter; the float32 norm of the 4096 x 32 output projection's
# gradient is off by ~2e-5 and differs with how FSDP shards it. A recompute that skipped or
# reused a stale KV exchange gives norms off by orders of magnitude.
GRAD_TOLERANCE = 1e-4
CASES = [  # (strategy, KV exchange, cp, tp, activation checkpointing) on 2 ranks
    ("flashcp", "compact", 2, 1, "none"),  # FlashCP
    ("flashcp", "needed", 2, 1, "none"),
    ("per_doc", "full", 2, 1, "none"),  # the Per-Doc CP baseline
    ("per_seq", "full", 2, 1, "none"),  # the Llama3 CP baseline
    ("flashcp", "compact", 1, 2, "none"),  # FlashCP's attention under tensor parallelism (heads split)
    # Recompute re-runs the KV collective inside backward (the 128K configs use "full"); each is
    # compared with its "none" run above. "full" shares the all-gather path with "compact".
    ("flashcp", "compact", 2, 1, "full"),
    ("flashcp", "compact", 2, 1, "selective"),
    ("flashcp", "needed", 2, 1, "full"),
    ("flashcp", "needed", 2, 1, "selective"),
]


def _worst(a: dict[int, float], b: dict[int, float], relative: bool = False) -> float:
    assert sorted(a) == sorted(b), (a, b)
    return max(abs(a[s] - b[s]) / (abs(b[s]) if relative else 1.0) for s in b)


@pytest.fixture(scope="module")
def seed(tmp_path_factory):
    return tiny_seed_checkpoint(tmp_path_factory.mktemp("seed"))


def test_cp2_reproduces_cp1_losses(tmp_path, seed, gloo_pool):
    reference_norms: dict[int, float] = {}
    with single_rank():
        reference = train(
            tiny_job(tmp_path / "cp1", checkpoint=seed, training={"steps": STEPS}), grad_norms=reference_norms
        )
    assert sorted(reference) == list(range(1, STEPS + 1))
    assert reference[STEPS] < reference[1]  # it trains

    layers = TINY["model"]["n_layers"]
    runs = {}
    pool = gloo_pool(2)
    for strategy, comm, cp, tp, ac in CASES:
        # FlashCP's own case plans in the plan worker, as a launched job does; the others in the
        # loader's thread (the harness's tiny job), which test_plan_worker_train.py shows is the same.
        worker = (strategy, comm, cp, tp, ac) == CASES[0]
        cfg = tiny_job(
            tmp_path / f"{strategy}_{comm}_cp{cp}_tp{tp}" / ac,
            checkpoint=seed,
            training={"steps": STEPS},
            parallelism={"context_parallel_degree": cp, "tensor_parallel_degree": tp},
            flashcp={"strategy": strategy, "comm": comm, "plan_worker": worker},
            activation_checkpoint={"mode": ac},
        )
        losses, norms, exchanges = pool.run(train_counting_exchanges, (cfg,))[0]
        runs[strategy, comm, cp, tp, ac] = losses, norms
        worst, worst_norm = _worst(losses, reference), _worst(norms, reference_norms, relative=True)
        line = (f"CP={cp} TP={tp} {strategy}/{comm} AC {ac}: max |loss - CP=1 loss| = {worst:.1e}, "
                f"grad norm rel. diff {worst_norm:.1e}, KV collectives run {exchanges}")  # fmt: skip
        if ac != "none":  # the same job without activation checkpointing
            no_ac_losses, no_ac_norms = runs[strategy, comm, cp, tp, "none"]
            ac_worst = _worst(losses, no_ac_losses)
            ac_worst_norm = _worst(norms, no_ac_norms, relative=True)
            line += f"; vs AC none: loss {ac_worst:.1e}, grad norm {ac_worst_norm:.1e}"
        print(line)
        if ac != "none":
            assert ac_worst <= TOLERANCE, (ac, losses, no_ac_losses)
            assert ac_worst_norm <= GRAD_TOLERANCE, (ac, norms, no_ac_norms)
        assert worst <= TOLERANCE, (strategy, comm, cp, tp, ac, losses, reference)
        assert worst_norm <= GRAD_TOLERANCE, (strategy, comm, cp, tp, ac, norms, reference_norms)
        # Per layer and step: one forward collective, or two when backward recomputes the
        # layer, and one transposed collective in backward. None without CP.
        expected = {"forward": STEPS * layers * (1 if ac == "none" else 2), "backward": STEPS * layers}
        assert exchanges == (expected if cp > 1 else {}), (strategy, comm, ac, exchanges)

    # The CP=2 run's last checkpoint resumes on one rank: weights, optimizer and the data cursor
    # carry over to a different layout, so both continue with the same next windows.
    longer = {"training": {"steps": STEPS + 2}, "checkpoint": seed}
    with single_rank():
        after_cp1 = train(tiny_job(tmp_path / "cp1", **longer))
    with single_rank():
        after_cp2 = train(tiny_job(tmp_path / "flashcp_compact_cp2_tp1" / "none", **longer))
    assert sorted(after_cp2) == [STEPS + 1, STEPS + 2]
    assert max(abs(after_cp2[s] - after_cp1[s]) for s in after_cp1) <= TOLERANCE


def test_a_balanced_dp2_step_reproduces_dp1_with_two_micro_steps(tmp_path, seed, gloo_pool):
    """`[data] balance = "mesh"` packs each step's documents over DP ranks x micro steps from their
    lengths alone: DP = 2 with one micro step trains the same two windows as DP = 1 with two, so the
    losses and gradient norms agree; balancing off (stream order) trains other windows."""
    def job(name: str, dp: int, balance: str) -> dict:
        return tiny_job(
            tmp_path / name, checkpoint=seed, training={"steps": 3, "global_batch_size": 2},
            parallelism={"data_parallel_shard_degree": dp}, data={"balance": balance, "prefetch": 0},
        )  # fmt: skip

    one_norms: dict[int, float] = {}
    with single_rank():
        one = train(job("dp1", 1, "mesh"), grad_norms=one_norms)
    with single_rank():
        stream = train(job("dp1_off", 1, "off"))
    pool = gloo_pool(2)
    two, two_norms, _ = pool.run(train_counting_exchanges, (job("dp2", 2, "mesh"),))[0]
    print(f"balanced DP=2 vs DP=1 x 2 micro steps: loss {_worst(two, one):.1e}, grad norm rel. diff "
          f"{_worst(two_norms, one_norms, relative=True):.1e}; vs stream order {_worst(stream, one):.1e}")  # fmt: skip
    assert _worst(two, one) <= TOLERANCE
    assert _worst(two_norms, one_norms, relative=True) <= GRAD_TOLERANCE
    assert _worst(stream, one) > TOLERANCE  # balancing moved documents between the windows


TILED_CASES = [  # (model, cp, dp_shard, tp, activation checkpointing)
    ("llama3", 2, 2, 1, "full"),  # tiles inside the block's recompute
    pytest.param("qwen3", 2, 2, 1, "none", marks=pytest.mark.slow),
    pytest.param("llama3", 1, 1, 2, "full", marks=pytest.mark.slow),  # w2's outputs reduced per tile under TP, SP
]
TILED_TOLERANCE = 1e-6  # relative, losses and gradient norms: fp32 summation order only


def _train_rank(rank: int, group, cfg: dict, stop_after: int | None = None) -> tuple[dict, dict]:
    norms: dict[int, float] = {}
    return train_on_pool_rank(rank, group, cfg, norms, stop_after=stop_after), norms


@pytest.mark.parametrize("name,cp,dp,tp,ac", TILED_CASES)
def test_mlp_tiles_change_no_loss_gradient_or_resume(tmp_path, gloo_pool, name, cp, dp, tp, ac):
    """`[activation_checkpoint] mlp_tiles = 3` (not dividing a rank's tokens) trains the untiled job's
    losses and gradient norms, and its run stopped at step 3 resumes to the same steps 4 and 5."""
    def job(dump: str, tiles: int) -> dict:
        return tiny_job(tmp_path / dump, model={"name": name}, training={"steps": STEPS},
                        parallelism={"context_parallel_degree": cp, "data_parallel_shard_degree": dp,
                                     "tensor_parallel_degree": tp},
                        checkpoint={"enable": True, "interval": 3},
                        activation_checkpoint={"mode": ac, "mlp_tiles": tiles})  # fmt: skip

    pool = gloo_pool(cp * dp * tp)
    plain, plain_norms = pool.run(_train_rank, (job("plain", 0),))[0]
    tiled, tiled_norms = pool.run(_train_rank, (job("tiled", 3),))[0]
    pool.run(_train_rank, (job("resumed", 3), 3))
    resumed, _ = pool.run(_train_rank, (job("resumed", 3),))[0]
    loss_diff, norm_diff = _worst(tiled, plain, relative=True), _worst(tiled_norms, plain_norms, relative=True)
    resume_diff = max(abs(resumed[s] - tiled[s]) for s in resumed)
    print(f"{name} CP={cp} x FSDP={dp} TP={tp} AC {ac}, 3 MLP tiles vs none: loss {loss_diff:.1e}, grad norm "
          f"{norm_diff:.1e} (relative); resumed at step 3: {resume_diff:.1e}")  # fmt: skip
    assert tiled[STEPS] < tiled[1]  # it trains
    assert loss_diff <= TILED_TOLERANCE and norm_diff <= TILED_TOLERANCE, (tiled, plain, tiled_norms, plain_norms)
    assert sorted(resumed) == [4, 5] and resume_diff <= TILED_TOLERANCE * tiled[STEPS], (resumed, tiled)


COMPILE_STEPS = 20
COMPILE_CASES = [  # (cp, dp_shard, tp, activation checkpointing) on 4 ranks
    (2, 2, 1, "none"),
    (2, 1, 2, "none"),
    (2, 2, 1, "full"),  # the block's recompute (the KV exchange included) inside the compiled backward
]
# Relative, losses and gradient norms over 20 steps; observed 1.1e-7 (inductor's float32 summation
# order); a wrong or missing gradient term moves them by orders of magnitude more.
COMPILE_TOLERANCE = 1e-5


def _train_counting_graphs(rank: int, group, cfg: dict) -> tuple[dict, dict, dict[str, int], tuple[int, int]]:
    """DistributedPool task: losses, gradient norms and KV collectives of a run, and the graphs dynamo
    compiled in it and its graph breaks (the pool's workers are reused: compiled code and counters
    start empty)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    losses, norms, exchanges = train_counting_exchanges(rank, group, cfg)
    return losses, norms, exchanges, (counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()))


@pytest.mark.slow
@pytest.mark.parametrize("cp,dp,tp,ac", COMPILE_CASES)
def test_compiled_blocks_train_the_eager_losses(tmp_path, seed, gloo_pool, cp, dp, tp, ac):
    """`[compile] enable` (inductor, each block one graph with FlashCP's op inside) trains the eager
    job's losses and gradient norms over 20 windows, runs the same KV collectives, and compiles one
    graph for the blocks (two under TP, see below) with no break: no window recompiles them."""
    def job(name: str, compiled: bool) -> dict:
        return tiny_job(tmp_path / name, checkpoint=seed, training={"steps": COMPILE_STEPS},
                        parallelism={"context_parallel_degree": cp, "data_parallel_shard_degree": dp,
                                     "tensor_parallel_degree": tp},
                        activation_checkpoint={"mode": ac}, compile={"enable": compiled, "components": ["model"]})  # fmt: skip

    pool = gloo_pool(cp * dp * tp)
    eager, eager_norms, eager_exchanges, _ = pool.run(_train_counting_graphs, (job("eager", False),))[0]
    compiled, norms, exchanges, (graphs, breaks) = pool.run(_train_counting_graphs, (job("compiled", True),))[0]
    loss_diff, norm_diff = _worst(compiled, eager, relative=True), _worst(norms, eager_norms, relative=True)
    print(f"CP={cp} x FSDP={dp} x TP={tp} AC {ac}, compiled vs eager over {COMPILE_STEPS} steps: loss {loss_diff:.1e}, "
          f"grad norm {norm_diff:.1e} (relative); graphs compiled {graphs}, breaks {breaks}; "
          f"KV collectives {exchanges}")  # fmt: skip
    assert compiled[COMPILE_STEPS] < compiled[1]  # it trains
    assert loss_diff <= COMPILE_TOLERANCE and norm_diff <= COMPILE_TOLERANCE, (compiled, eager, norms, eager_norms)
    assert exchanges == eager_exchanges
    # One graph for all blocks, kept over every window. Under TP the first block's input (the
    # embedding's output, sequence-sharded) holds an AsyncCollectiveTensor and the later blocks' a
    # plain tensor: a guard on that type gives the first block its own graph, whatever the depth.
    assert (graphs, breaks) == (1 + (tp > 1), 0)
