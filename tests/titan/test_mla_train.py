"""TorchTitan's DeepSeek-V3 debugmodel trained through FlashCP's latent exchange reproduces the one-rank run.

The `debugmodel` flavor (MLA with kv_lora_rank 512 and 16 heads, YaRN with mscale, a dense first
layer, then 8 routed experts, top-3, and 2 shared ones) trains STEPS steps of two 256-token windows
from one seed checkpoint on one rank (CP = 1, two micro steps) and on 2 gloo ranks with CP = 2 and
EP = 2 (the experts split over the ranks borrowed from CP, TorchTitan's all-to-all dispatcher, the
latent rows exchanged by the compact all-gather; `[data] balance = "mesh"` gives both runs the same
windows). Losses must agree to TOLERANCE and every MoE layer's aux-loss-free routing bias after the
last step exactly, as for Qwen3-MoE (test_moe_train.py): the expert counts are summed over the same
"loss" mesh.
"""

from __future__ import annotations

import pytest
import torch
from harness import tiny_job
from test_moe_train import _pool_run, one_rank_reference

STEPS = 8
TOLERANCE = 1e-5  # absolute, on losses of ~8 in float32
MLA = {"name": "deepseek_v3", "flavor": "debugmodel"}


def mla_job(dump, checkpoint, **sections):
    # The tiny job's learning rate (3e-3) makes this larger model's loss jump (8.0 -> 9.9 at step 3), which
    # would grow float32's rounding differences between layouts (DP 2 alone: 5e-6 by step 3) past TOLERANCE.
    return tiny_job(dump, ("model",), model=MLA, checkpoint=checkpoint, training={"steps": STEPS, "global_batch_size": 2},
                    data={"balance": "mesh", "prefetch": 0}, optimizer={"lr": 3e-4}, **sections)  # fmt: skip


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The seed checkpoint and the one-rank run's losses and final routing biases."""
    seed, losses, biases, _ = one_rank_reference(tmp_path_factory.mktemp("mla"), MLA, mla_job, ("model",))
    assert losses[STEPS] < losses[1] - 0.1  # it trains
    assert len(biases) == 5 and any(b.abs().sum() > 0 for b in biases)  # 5 MoE layers; the routing bias moved
    return seed, losses, biases


@pytest.mark.slow
def test_the_checkpoint_of_a_model_without_an_hf_class_refuses_export_in_one_line(reference, tmp_path):
    """debugmodel routes by softmax (DeepSeek-V2's router): it trains and saves; its export is one line."""
    from flashcp.titan.hf.export import export, ExportError

    seed, _, _ = reference
    with pytest.raises(ExportError, match=r"step-0: this deepseek_v3 model routes by softmax; DeepseekV3ForCausalLM "
                                          r"routes by sigmoid only: no Hugging Face class holds it$"):  # fmt: skip
        export(seed["initial_load_path"], tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


@pytest.mark.slow
def test_cp2_ep2_reproduces_the_one_rank_run(reference, gloo_pool, tmp_path):
    seed, losses, biases = reference
    cfg = mla_job(tmp_path, seed, parallelism={"context_parallel_degree": 2, "expert_parallel_degree": 2})
    runs = gloo_pool(2).run(_pool_run, (cfg,))
    for rank_losses, rank_biases, *_ in runs:
        worst = max(abs(rank_losses[s] - losses[s]) for s in losses)
        print(f"CP 2 x EP 2 vs one rank: losses within {worst:.1e} over {STEPS} steps ({losses[1]:.3f} -> "
              f"{losses[STEPS]:.3f})")
        assert worst <= TOLERANCE, f"losses off by {worst:.2e}"
        for layer, (ours, ref) in enumerate(zip(rank_biases, biases, strict=True)):
            assert torch.equal(ours, ref), f"layer {layer}'s routing bias differs: {ours} vs {ref}"
