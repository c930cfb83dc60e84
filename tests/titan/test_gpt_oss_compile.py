"""`[compile] enable` with gpt-oss: compiled blocks train the eager job at CP = 2.

gpt-oss's block has what the Llama / Qwen3 compiled runs (test_parity.py) do not: a sliding-window
layer whose op key is the step's dispatch for its window (`CPStep.key_for`), learned sinks read
through TorchTitan's `out_transform` and passed into the op as an input, and an MoE with a biased
router, expert biases and a clamped SwiGLU. Each block must be one graph (fullgraph: a break is an
error; tracing the sinks' lookup raised until `sinks_of` found their module by type) and the
compiled job must train the eager job's losses and first gradients, the sinks' included. One
case, under full activation checkpointing (the CPU job's mode): the compiled backward recomputes
the block, the op and its KV exchange with it. Without checkpointing the same comparison gave
equal losses and gradients within 5.7e-7.
"""

from __future__ import annotations

import pytest
import torch
from harness import single_rank, tiny_job, train, train_on_pool_rank

from tests.titan.test_gpt_oss_oracle import TRAIN_CONFIG, transformers
from tests.titan.test_hf_oracle import _relative
from tests.titan.test_parity import COMPILE_TOLERANCE

STEPS = 4


@pytest.fixture(scope="module")
def seeded(tmp_path_factory) -> tuple[dict, dict]:
    """The tiny gpt-oss [model] (TRAIN_CONFIG: a sliding and a full layer) and the [checkpoint] that
    starts it from weights initialised on one rank: initialised on the CP = 2 ranks, each rank's
    shard of the router and the experts would come out the same, every expert with a twin whose
    route ties with it, and the router's gradient would be rounding noise."""
    root = tmp_path_factory.mktemp("gpt_oss")
    transformers.GptOssConfig(**TRAIN_CONFIG).save_pretrained(root / "model")
    model = {"hf_config": str(root / "model")}
    with single_rank():
        train(tiny_job(root, ("model",), model=model, checkpoint={"enable": True, "create_seed_checkpoint": True}),
              seed_checkpoint=True)  # fmt: skip
    return model, {"enable": True, "initial_load_path": str(root / "checkpoint/step-0")}


def _train(rank: int, group, cfg: dict) -> tuple[dict[int, float], dict[str, torch.Tensor], tuple[int, int]]:
    """DistributedPool task: a rank's losses, first gradients, and the graphs dynamo compiled and its
    breaks (the pool's workers are reused: compiled code and counters start empty)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    grads: dict[str, torch.Tensor] = {}
    losses = train_on_pool_rank(rank, group, cfg, first_grads=grads)
    return losses, grads, (counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()))


def test_compiled_gpt_oss_blocks_train_the_eager_losses_and_gradients(tmp_path, gloo_pool, seeded):
    model, seed = seeded

    def job(name: str, compiled: bool) -> dict:
        return tiny_job(tmp_path / name, ("model",), model=model, checkpoint=seed, training={"steps": STEPS},
                        parallelism={"context_parallel_degree": 2}, activation_checkpoint={"mode": "full"},
                        compile={"enable": compiled, "components": ["model"]})  # fmt: skip

    pool = gloo_pool(2)
    eager, eager_grads, _ = pool.run(_train, (job("eager", False),))[0]
    compiled, grads, (graphs, breaks) = pool.run(_train, (job("compiled", True),))[0]
    loss_diff = max(abs(compiled[s] - eager[s]) / eager[s] for s in eager)
    grad_diff = {name: _relative(grads[name], grad) for name, grad in eager_grads.items()}
    worst = max(grad_diff, key=grad_diff.get)
    sinks = max(diff for name, diff in grad_diff.items() if name.endswith("attention.sinks"))
    print(f"gpt-oss CP=2 AC full, compiled vs eager over {STEPS} steps: loss {loss_diff:.1e}, first gradients "
          f"{grad_diff[worst]:.1e} ({worst}), sinks' {sinks:.1e} (relative); graphs compiled {graphs}, "
          f"breaks {breaks}")  # fmt: skip
    assert sorted(compiled) == sorted(eager) == list(range(1, STEPS + 1))
    assert compiled[STEPS] < compiled[1]  # it trains
    assert loss_diff <= COMPILE_TOLERANCE, (compiled, eager)
    assert grad_diff[worst] <= COMPILE_TOLERANCE, grad_diff
    # One graph per layer kind (the window layer's attention differs in its window), none per window.
    assert (graphs, breaks) == (2, 0)
