"""The probe separates a model that retrieves from one that cannot.

Both are `copying_model`'s hand-written two-layer Llama (a bigram induction circuit, 1024 wide),
loaded into the job's trainer and probed through the CP path at CP = 2: with its lookup the model
copies the pass key out of the needle at every length and depth (accuracy 1, answer tokens at
log-probability ~0); with the lookup's query zeroed it attends uniformly and gets none (accuracy 0,
log-probabilities near the uniform -log 4096 = -8.3). The two heatmaps are written beside the test's
output; docs/img/probe_retrieval.png is `heatmap_png` of the figures it prints.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch.distributed as dist
from torch.distributed.tensor import distribute_tensor, DTensor
from copying_model import copying_state_dict, MODEL
from harness import tiny_job

from flashcp.titan.config import check_layout
from flashcp.titan.launch.job import trainer_config
from flashcp.titan.probe import loop, ProbeResult
from flashcp.titan.probe.report import heatmap_png
from flashcp.titan.trainer import FlashCPTrainer

SEQ_LEN = 512
PROBE = {"enable": True, "lengths": [128, 256, 512], "depths": [0.0, 0.5, 1.0], "samples": 2}


def probe_copying_model(rank: int, group: Any, dump: Path, retrieve: bool) -> ProbeResult:
    """DistributedPool task: the trainer of a CP = 2 job, its weights replaced by the hand-written ones, probed."""
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(dist.get_world_size())})
    cfg = tiny_job(dump, model=MODEL, training={"seq_len": SEQ_LEN}, probe=PROBE, validation={"source": "default"},
                   parallelism={"context_parallel_degree": 2})  # fmt: skip
    check_layout(cfg, 2, has_cuda=False)
    trainer = FlashCPTrainer(trainer_config(cfg))
    try:
        model = trainer.model_parts[0]
        current = model.state_dict()  # DTensors where FSDP shards over the CP ranks; wq, wk, wv as a job saves them
        weights = copying_state_dict({k: v.shape for k, v in current.items()}, trainer.tokenizer.get_vocab_size(),
                                     retrieve)  # fmt: skip
        model.load_state_dict({k: distribute_tensor(weights[k], v.device_mesh, v.placements) if isinstance(v, DTensor)
                               else weights[k] for k, v in current.items()})  # fmt: skip
        return loop.run(trainer, trainer.probe, 1)
    finally:
        trainer.close()


@pytest.fixture(scope="module")
def pool(gloo_pool):
    return gloo_pool(2)


def test_the_probe_separates_a_retrieving_model_from_one_that_cannot(tmp_path, pool):
    results = {}
    for retrieve in (True, False):
        name = "retrieves" if retrieve else "cannot"
        result, other_rank = pool.run(probe_copying_model, (tmp_path / name, retrieve))
        assert (result.logprob == other_rank.logprob).all()
        results[name] = result
        title = "copying model" if retrieve else "copying model, lookup off"
        (tmp_path / f"{name}.png").write_bytes(heatmap_png(result, title))
        print(f"{name}: accuracy {result.mean_accuracy:.2f}, answer log-prob by cell "
              f"{np.round(result.logprob, 3).tolist()}; heatmap {tmp_path / name}.png")  # fmt: skip
    good, bad = results["retrieves"], results["cannot"]
    assert good.accuracy.shape == (3, 3)
    assert (good.accuracy == 1.0).all() and (good.logprob > -0.05).all()
    assert (bad.accuracy == 0.0).all() and (bad.logprob < -6.0).all()
