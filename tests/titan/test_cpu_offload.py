"""`[training] enable_cpu_offload`: FSDP2's CPU offload (sharded parameters, gradients and AdamW's
states on the host, the optimizer stepping there) trains what the job trains without it.

On this GPU-less machine every tensor is on the CPU anyway, so these runs check the path, not the
bytes moved: FSDP builds its parameters with `CPUOffloadPolicy` (unpinned here, `flashcp.titan.compat`)
and the losses and gradient norms equal the run without it, bit for bit; one rank in the default
tier, CP 2 x FSDP 2 ranks with a resume from its checkpoint in the slow tier. What it saves on a GPU
is the dry run's (test_dryrun.py). TP 2 x CP 2 trains the same losses too (slow tier), and the launcher
refuses a node whose memory cannot hold what its ranks keep.
"""

from __future__ import annotations

import os
from unittest.mock import patch

import pytest
from harness import single_rank, tiny_job, train

STEPS = 2


def train_counting_policies(rank: int, group, cfg: dict, stop_after: int | None = None):
    """DistributedPool task (or a call in this process on one rank): a rank's losses, gradient norms and
    how many CPU offload policies TorchTitan's FSDP recipe made (one per model)."""
    import torchtitan.distributed.fsdp as tt_fsdp  # after flashcp.titan (harness), which points it at the CPU

    if group is not None:
        os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(group.size())})
    norms: dict[int, float] = {}
    policy, made = tt_fsdp.CPUOffloadPolicy, []
    with patch.object(tt_fsdp, "CPUOffloadPolicy", lambda: made.append(1) or policy()):
        losses = train(cfg, stop_after=stop_after, grad_norms=norms)
    return losses, norms, len(made)


def _job(root, name: str, offload: bool, **sections) -> dict:
    return tiny_job(root / name, training={"steps": STEPS, "enable_cpu_offload": offload}, **sections)


def test_cpu_offload_trains_what_the_job_trains_on_one_rank(tmp_path):
    with single_rank():
        kept, kept_norms, none = train_counting_policies(0, None, _job(tmp_path, "kept", False))
    with single_rank():
        moved, moved_norms, units = train_counting_policies(0, None, _job(tmp_path, "moved", True))
    assert none == 0 and units == 1
    assert sorted(moved) == list(range(1, STEPS + 1)) and moved[STEPS] < moved[1]  # it trains
    assert moved == kept and moved_norms == kept_norms


@pytest.mark.slow
def test_cpu_offload_under_cp_and_fsdp_trains_the_same_losses_and_resumes_exactly(tmp_path, gloo_pool):
    """CP 2 x FSDP 2 (4 ranks: each parameter sharded over 4, the gradients reduce-scattered to the host
    shards, clipped there as DTensors), then stopped after step 1 and resumed from its checkpoint."""
    layout = {"parallelism": {"context_parallel_degree": 2, "data_parallel_shard_degree": 2}}
    pool = gloo_pool(4)
    kept, kept_norms, none = pool.run(train_counting_policies, (_job(tmp_path, "kept", False, **layout),))[0]
    moved, moved_norms, units = pool.run(train_counting_policies, (_job(tmp_path, "moved", True, **layout),))[0]
    assert none == 0 and units == 1
    assert moved == kept and moved_norms == kept_norms
    resumed = _job(tmp_path, "resumed", True, checkpoint={"enable": True, "interval": 1}, **layout)
    first = pool.run(train_counting_policies, (resumed, 1))[0][0]
    rest = pool.run(train_counting_policies, (resumed,))[0][0]
    assert first == {1: moved[1]} and rest == {2: moved[2]}


@pytest.mark.slow
def test_cpu_offload_under_tp_and_cp_trains_the_same_losses(tmp_path, gloo_pool):
    """TP 2 x CP 2: the host shards are DTensors over FSDP x TP, their norm for clipping reduced over both."""
    layout = {"parallelism": {"context_parallel_degree": 2, "tensor_parallel_degree": 2}}
    pool = gloo_pool(4)
    kept, kept_norms, none = pool.run(train_counting_policies, (_job(tmp_path, "kept", False, **layout),))[0]
    moved, moved_norms, units = pool.run(train_counting_policies, (_job(tmp_path, "moved", True, **layout),))[0]
    assert none == 0 and units == 1
    assert moved == kept and moved_norms == kept_norms


def test_launcher_refuses_a_cpu_offload_the_node_cannot_hold(tmp_path, monkeypatch):
    """Llama 3 8B's dims (at least 6.7B parameters by the launcher's lower bound): 16 bytes each over 8
    ranks is 12.5 GiB per rank, 100 GiB for a node of 8, more than its 64 GiB; over 16 ranks it fits."""
    from flashcp.titan.config import ConfigError
    from flashcp.titan.launch.preflight import check_offload_memory

    cfg = tiny_job(tmp_path, model={"dim": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 8, "vocab_size": 128256},
                   training={"enable_cpu_offload": True})  # fmt: skip
    monkeypatch.setattr(os, "sysconf", {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 16 << 20}.get)  # 64 GiB
    with pytest.raises(ConfigError, match=r"the offloads keep 12.5 GiB of host memory per rank \(\[training\] "
                                          r"enable_cpu_offload = true: 12.5 GiB of fp32 weights, gradients and AdamW "
                                          r"states at least\), 100 GiB for this node's 8 ranks, which has 64 GiB"):  # fmt: skip
        check_offload_memory(cfg, 8, 8)
    check_offload_memory(cfg, 8, 16)
    check_offload_memory(cfg | {"training": {**cfg["training"], "enable_cpu_offload": False}}, 8, 8)
