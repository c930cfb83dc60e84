"""A Hugging Face MoE folder imported on many ranks trains as it does on one.

An unmodified `scripts/make_tiny_hf.py` Qwen3-MoE, DeepSeek-V3 or gpt-oss folder (`initial_load_in_hf`)
is imported directly on 4 gloo ranks, FSDP 2 x CP 2 with EP 2 and with EP 1, and TP 2 x CP 2 x EP 2
where the family takes TP (gpt-oss refuses it in one line): each rank reads only
the experts it holds (the other ranks' experts are in the folder but not this rank's to load; gpt-oss
stores each layer's experts as one [E, in, out] tensor, of which a rank reads its rows), and
the first step's loss and every parameter's gradient (gathered) equal the one-rank import's to
TOLERANCE. A folder that truly does not fit (an expert too many, one missing, one reshaped) is
still refused on every rank in one line that names the key.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the test extra (pip install -e .[test]) provides transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from scripts.make_tiny_hf import make_tiny_hf  # noqa: E402
from titan.harness import single_rank, tiny_job, train, train_on_pool_rank  # noqa: E402

from flashcp.titan.config import ConfigError  # noqa: E402

TOLERANCE = 1e-6  # relative: the loss, and each gradient's |difference| / |one-rank gradient| (norms)
LAYOUTS = {  # name -> [parallelism] of a 4-rank job
    "fsdp2-cp2-ep2": {"data_parallel_shard_degree": 2, "context_parallel_degree": 2, "expert_parallel_degree": 2},
    "fsdp2-cp2-ep1": {"data_parallel_shard_degree": 2, "context_parallel_degree": 2, "expert_parallel_degree": 1},
    "tp2-cp2-ep2": {"tensor_parallel_degree": 2, "context_parallel_degree": 2, "expert_parallel_degree": 2},
}


def import_job(dump: Path, hf: Path, **parallelism: int) -> dict:
    """One step of the tiny job from the HF folder `hf`: two windows a step (one per DP rank, or two
    micro steps on one rank), the same documents whatever the layout."""
    return tiny_job(dump, model=None, training={"steps": 1, "global_batch_size": 2},
                    data={"balance": "mesh", "prefetch": 0},
                    checkpoint={"enable": True, "initial_load_path": str(hf), "initial_load_in_hf": True},
                    parallelism={"data_parallel_shard_degree": 1} | parallelism)  # fmt: skip


def first_step(rank: int, group, cfg: dict) -> tuple[float, dict[str, torch.Tensor]]:
    """DistributedPool task: the first step's loss and gathered gradients."""
    grads: dict[str, torch.Tensor] = {}
    losses = train_on_pool_rank(rank, group, cfg, first_grads=grads)
    return losses[1], grads


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3", "gpt_oss"])
def folder_and_reference(request, tmp_path_factory) -> tuple[str, Path, float, dict[str, torch.Tensor]]:
    """The tiny folder of the family and its one-rank import's first-step loss and gradients."""
    root = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_hf(root / "hf", model_type=request.param)
    grads: dict[str, torch.Tensor] = {}
    with single_rank():
        losses = train(import_job(root / "cp1", hf), first_grads=grads)
    assert {name for name in grads if "experts" in name}, "the tiny folder has routed experts"
    return request.param, hf, losses[1], grads


@pytest.mark.parametrize("layout", [name if name == "fsdp2-cp2-ep2" else pytest.param(name, marks=pytest.mark.slow)
                                    for name in LAYOUTS])
def test_import_on_four_ranks_gives_the_one_rank_step(folder_and_reference, gloo_pool, tmp_path, layout):
    family, hf, loss, grads = folder_and_reference
    refusals = {"gpt_oss": r"tensor_parallel_degree > 1 .*wo\.bias"}
    if family in refusals and "tp2" in layout:
        with pytest.raises(ConfigError, match=refusals[family]):
            import_job(tmp_path, hf, **LAYOUTS[layout])
        return
    runs = gloo_pool(4).run(first_step, (import_job(tmp_path, hf, **LAYOUTS[layout]),))
    for rank, (rank_loss, rank_grads) in enumerate(runs):
        assert abs(rank_loss - loss) <= TOLERANCE * abs(loss), f"rank {rank}: loss {rank_loss} vs {loss}"
        assert rank_grads.keys() == grads.keys()
        for name, ref in grads.items():
            gap = (rank_grads[name] - ref).norm() / ref.norm()
            assert gap <= TOLERANCE, f"rank {rank}: {name}'s gradient off by {gap:.1e} (relative)"


def _rewrite(hf: Path, out: Path, change: str) -> str:
    """A copy of the folder `hf` with one expert key changed; the key the refusal must name."""
    out.mkdir()
    for f in hf.iterdir():
        if f.name != "model.safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    tensors = load_file(hf / "model.safetensors")
    config = json.loads((hf / "config.json").read_text())
    last = config["num_hidden_layers"] - 1  # routed in every family
    if config["model_type"] == "gpt_oss":  # each layer's experts in one tensor, [E, in, out]
        key, extra = (f"model.layers.{layer}.mlp.experts.down_proj" for layer in (last, last + 1))
    else:
        experts = config.get("num_local_experts") or config.get("num_experts") or config["n_routed_experts"]
        key, extra = (f"model.layers.{last}.mlp.experts.{e}.down_proj.weight" for e in (experts - 1, experts))
    if change == "extra":
        tensors[extra] = tensors[key].clone()
    elif change == "missing":
        del tensors[key]
    else:
        tensors[key] = tensors[key][:, :-1].contiguous()
    named = extra if change == "extra" else key
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return named


def _refusal(rank: int, group, cfg: dict) -> str:
    """DistributedPool task: the one line a rank fails with."""
    from flashcp.titan.components.checkpoint import CheckpointError

    try:
        train_on_pool_rank(rank, group, cfg)
    except CheckpointError as e:
        return str(e)
    return "trained"


@pytest.mark.parametrize("change", [pytest.param("extra", marks=pytest.mark.slow), "missing", pytest.param("reshaped", marks=pytest.mark.slow)])
def test_a_folder_that_does_not_fit_is_refused_on_every_rank(folder_and_reference, gloo_pool, tmp_path, change):
    _, hf, _, _ = folder_and_reference
    named = _rewrite(hf, tmp_path / "hf", change)
    cfg = import_job(tmp_path / "run", tmp_path / "hf", **LAYOUTS["fsdp2-cp2-ep2"])
    for rank, line in enumerate(gloo_pool(4).run(_refusal, (cfg,))):
        assert named in line and "\n" not in line, f"rank {rank}: {line}"
