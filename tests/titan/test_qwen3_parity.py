"""Qwen3 through the trainer: FSDP x FlashCP CP = 2 and TP = 2 reproduce one rank.

The model comes from a config.json (`[model] hf_config`) written by `to_hf_config`: QK-norm, GQA,
a head_dim other than dim / heads, tied embeddings (one parameter under FSDP, which shards over
dp_shard x cp) and YaRN scaling beyond its original context, whose attention factor FlashCP's
op applies. Same initial weights (a seed checkpoint), same windows: the losses and gradient norms
agree to the tolerances of `test_parity`, and every layout trains.
"""

from __future__ import annotations

import copy
import json

import pytest
from harness import single_rank, TINY, train, train_counting_exchanges
from test_parity import _worst, GRAD_TOLERANCE, TOLERANCE

from flashcp.titan.config import validate
from flashcp.titan.hf.config import Architecture, to_hf_config
from flashcp.titan.models.rope import Rope

STEPS = 4
QWEN3 = Architecture(
    name="qwen3", dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=64, vocab_size=4096,
    norm_eps=1e-6, rope=Rope(theta=1e6, scaling="yarn", factor=4.0, original_max_position_embeddings=64),
    tie_embeddings=True, max_position_embeddings=256,
)  # fmt: skip


def qwen3_job(dump, hf_folder, **sections) -> dict:
    raw = copy.deepcopy(TINY) | {"job": {"dump_folder": str(dump)}, "model": {"hf_config": str(hf_folder)}}
    raw["training"] |= {"steps": STEPS}
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return validate(raw)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3")
    folder = root / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(to_hf_config(QWEN3)))
    with single_rank():
        train(qwen3_job(root / "seed", folder, checkpoint={"enable": True, "create_seed_checkpoint": True}),
              seed_checkpoint=True)  # fmt: skip
    seed = {"enable": True, "initial_load_path": str(root / "seed/checkpoint/step-0")}
    return folder, seed


def test_qwen3_cp2_and_tp2_reproduce_one_rank(tmp_path, setup, gloo_pool):
    folder, seed = setup
    norms: dict[int, float] = {}
    with single_rank():
        reference = train(qwen3_job(tmp_path / "one", folder, checkpoint=seed), grad_norms=norms)
    assert reference[STEPS] < reference[1]  # it trains
    pool = gloo_pool(2)
    for cp, tp in [(2, 1), (1, 2)]:
        layout = {"context_parallel_degree": cp, "tensor_parallel_degree": tp}
        cfg = qwen3_job(tmp_path / f"cp{cp}_tp{tp}", folder, checkpoint=seed, parallelism=layout)
        losses, run_norms, _ = pool.run(train_counting_exchanges, (cfg,))[0]
        worst, worst_norm = _worst(losses, reference), _worst(run_norms, norms, relative=True)
        print(
            f"Qwen3 CP={cp} TP={tp}: max |loss - one rank| = {worst:.1e}, "
            f"grad norm rel. diff {worst_norm:.1e}"
        )
        assert worst <= TOLERANCE, (cp, tp, losses, reference)
        assert worst_norm <= GRAD_TOLERANCE, (cp, tp, run_norms, norms)
