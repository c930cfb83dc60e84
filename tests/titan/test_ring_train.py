"""`[flashcp] comm = "ring"` in a training job: the key, and CP 2 and 4 training the compact losses.

The ring computes the same attention as the compact exchange up to floating-point summation order
(blockwise calls merged by log-sum-exp), so a job on the ring gives the compact job's losses and
gradient norms over 20 steps: Ring-Attn (`strategy = "ring"`) and Ring-Attn (Zigzag)
(`"per_doc"`), eager and with full activation checkpointing and `[compile] enable` (the op, the
ring's steps included, recomputed inside the compiled backward). Every layer runs the ring's
transfers forward and backward, and no collective of the other exchanges.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from harness import tiny_job, tiny_seed_checkpoint, train_on_pool_rank

from flashcp.attention import record_comm
from flashcp.titan.config import ConfigError

STEPS = 20
# Relative, on losses and gradient norms: the exchanges differ in summation order only (observed
# below 1e-6); a wrong mask or a missing gradient term moves them by orders of magnitude more.
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def seed(tmp_path_factory):
    return tiny_seed_checkpoint(tmp_path_factory.mktemp("seed"))


def train_logging(rank: int, group: Any, cfg: dict) -> dict[str, Any]:
    """DistributedPool task: a rank's losses, gradient norms and the KV transfers by (op, pass)."""
    norms: dict[int, float] = {}
    with record_comm() as log:
        losses = train_on_pool_rank(rank, group, cfg, norms)
    return {"losses": losses, "norms": norms, "ops": Counter((e.op, e.pass_) for e in log)}


def _worst(a: dict[int, float], b: dict[int, float]) -> float:
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1)), (a, b)
    return max(abs(a[s] - b[s]) / abs(b[s]) for s in b)


def test_the_job_file_offers_the_ring_and_refuses_what_it_cannot_run(tmp_path):
    cfg = tiny_job(tmp_path, parallelism={"context_parallel_degree": 2}, flashcp={"comm": "ring", "strategy": "ring"})
    assert (cfg["flashcp"]["comm"], cfg["flashcp"]["strategy"]) == ("ring", "ring")
    with pytest.raises(ConfigError, match="overlaps each step's transfer with its kernel already"):
        tiny_job(tmp_path, flashcp={"comm": "ring", "overlap": True})
    with pytest.raises(ConfigError, match="runs on backend 'torch' or 'reference'"):
        tiny_job(tmp_path, flashcp={"comm": "ring", "backend": "flash_attn"})


@pytest.mark.parametrize("cp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_the_ring_trains_the_compact_losses(tmp_path, seed, gloo_pool, cp):
    def job(name: str, ac: str = "none", compiled: bool = False, **flashcp: Any) -> dict:
        return tiny_job(tmp_path / name, checkpoint=seed, training={"steps": STEPS},
                        parallelism={"context_parallel_degree": cp}, flashcp=flashcp,
                        activation_checkpoint={"mode": ac}, compile={"enable": compiled, "components": ["model"]})  # fmt: skip

    pool = gloo_pool(cp)
    compact = pool.run(train_logging, (job("compact", comm="compact"),))[0]
    runs = {
        "Ring-Attn": job("ring", comm="ring", strategy="ring"),
        "Ring-Attn (Zigzag), full AC, compiled": job("zigzag", "full", True, comm="ring", strategy="per_doc"),
    }
    layers = 2  # the tiny model's
    for name, cfg in runs.items():
        got = pool.run(train_logging, (cfg,))[0]
        loss, norm = _worst(got["losses"], compact["losses"]), _worst(got["norms"], compact["norms"])
        print(f"CP {cp} {name} vs compact over {STEPS} steps: loss {loss:.1e}, grad norm {norm:.1e} (relative); "
              f"transfers {dict(got['ops'])}")  # fmt: skip
        assert got["losses"][STEPS] < got["losses"][1]  # it trains
        assert loss <= TOLERANCE and norm <= TOLERANCE, (name, got, compact)
        assert set(got["ops"]) == {("ring", "forward"), ("ring", "backward")}, got["ops"]
        # per layer and step: N - 1 forward shifts (again in the recompute of full AC); backward N - 1
        # shifts carrying KV and/or sums, and the sums' way home
        recomputes = 2 if "full AC" in name else 1
        assert got["ops"][("ring", "forward")] == STEPS * layers * (cp - 1) * recomputes, got["ops"]
        assert got["ops"][("ring", "backward")] == STEPS * layers * (2 * (cp - 1)), got["ops"]


def test_the_metrics_add_the_ring_bytes_per_layer():
    """With comm = "ring" each logged step adds the ring's bytes per layer (forward: the full
    all-gather's; backward: KV again and the dK/dV sums, float32) and the log line's ratio is the
    ring's forward + backward over the all-gather's + reduce-scatter's; other comms add nothing."""
    from torchtitan.distributed import ParallelDims

    from flashcp.plan import plan_shards
    from flashcp.titan.components.metrics import FlashCPMetrics

    plan = plan_shards([90, 30, 8], 4, "ring")

    def logged(comm: str) -> dict[str, float]:
        dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=4, tp=1, pp=1, ep=1, world_size=4)
        metrics = FlashCPMetrics(FlashCPMetrics.Config(), parallel_dims=dims)
        metrics.kv_row_bytes, metrics.kv_dtype_bytes, metrics.comm = 8, 2, comm
        out: list[dict[str, float]] = []
        metrics.logger.log = lambda values, step: out.append(values)
        metrics.record_window(plan, plan_ms=1.0)
        metrics.log(step=1, global_avg_loss=5.0, global_max_loss=6.0, grad_norm=1.0)
        return {k.removeprefix("flashcp/"): v for k, v in out[0].items() if "ring" in k}

    hops = 3 * 32  # (N - 1) x C / N rows
    assert logged("ring") == {"kv_recv_bytes_per_layer_ring": hops * 8,
                              "kv_recv_bytes_per_layer_ring_backward": hops * 8 + hops * 16,
                              "comm_ring_over_full": 2.0}  # fmt: skip
    assert logged("compact") == {}


def test_the_dry_run_counts_the_ring_buffers(tmp_path):
    """`python -m flashcp.titan.dryrun` runs the ring on fake tensors (torch's kernel with the LSE and
    the aten backward, the fake process group's sends and receives); its estimate holds two KV blocks
    in flight and four float32 blocks of dK/dV sums per layer, and its report the ring's bytes."""
    from flashcp.titan.dryrun.report import format_report
    from flashcp.titan.dryrun.run import dry_run

    cfg = tiny_job(tmp_path, parallelism={"context_parallel_degree": 2},
                   flashcp={"comm": "ring", "strategy": "ring", "backend": "auto"}) | {"_path": "tiny"}  # fmt: skip
    report = dry_run(cfg, world_size=2)
    rows, kv_dim = 10 * 128, 2 * 2 * 8  # (2 + 4 x 2) x the 128 tokens per rank; K and V of 2 heads x 8
    assert report.estimate_gib["flashcp_buffers"] * 2**30 == pytest.approx(2 * 2 * rows * kv_dim)
    assert report.plan["kv_recv_bytes_per_layer_ring"] == 128 * kv_dim * 4  # (N - 1) x 128 float32 rows
    assert "the ring " in format_report(report)
