"""`[flashcp] comm = "two_level"` in a training job: the key, the CP group's nodes, the compiled op
and CP 4 training on 2 simulated nodes.

The two-level exchange delivers exactly the "needed" rows, so a job trains what the compact
exchange trains up to floating-point summation order: a CP 4 job on 2 nodes of 2 CP ranks
(`ranks_per_node = 2`, through the planning worker; and the same nodes read off
LOCAL_WORLD_SIZE = 2 as torchrun sets it, planned in the loader's thread with overlap) gives the
compact job's losses, gradient norms, held-out losses and retrieval-probe log-probabilities, and
both of its stages run in every layer's forward and backward. A launch whose nodes split a CP
group unevenly (LOCAL_WORLD_SIZE = 3 for CP 4) stops every rank before training with one line.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from distributed_pool import DistributedPool
from harness import TINY, tiny_job, train_on_pool_rank
from test_compile import _block

from flashcp.attention import build_two_level_dispatch, group_ranks_per_node, NodeLayoutError, record_comm
from flashcp.attention.simulate import run_ranks
from flashcp.plan import plan_shards
from flashcp.titan import config
from flashcp.titan.config import ConfigError
from flashcp.titan.models.attention import CPStep
from flashcp.titan.probe import loop as probe_loop

STEPS = 4
CP4 = {"context_parallel_degree": 4}
VALIDATION = {"enable": True, "source": "default", "freq": 2, "steps": 1}
PROBE = {"enable": True, "freq": 2, "min_length": 128, "samples": 1, "depths": [0.0, 1.0]}
# Absolute on losses of ~8.5 and probe log-probabilities of ~ -8; relative on gradient norms: the
# exchanges differ only in summation order (observed: training losses and norms equal bit for bit,
# held-out losses within 1e-8, probe log-probabilities within 3e-7).
TOLERANCE = 2e-6


def test_the_job_file_offers_two_level_and_checks_ranks_per_node(tmp_path):
    cfg = tiny_job(tmp_path, parallelism=CP4, flashcp={"comm": "two_level", "ranks_per_node": 2})
    assert (cfg["flashcp"]["comm"], cfg["flashcp"]["ranks_per_node"], cfg["_warnings"]) == ("two_level", 2, [])
    assert tiny_job(tmp_path, flashcp={"comm": "two_level"})["flashcp"]["ranks_per_node"] == 0  # from the launch
    lines = "\n".join(config.key_lines(["flashcp"]))
    assert "[flashcp] comm = \"compact\"  (a string, one of compact, full, needed, two_level, ring)" in lines
    assert "[flashcp] ranks_per_node = 0  (an integer)  two_level or scope = 'mesh' only" in lines
    for bad in (3, -1):
        with pytest.raises(ConfigError) as e:
            tiny_job(tmp_path, parallelism=CP4, flashcp={"comm": "two_level", "ranks_per_node": bad})
        assert str(e.value) == (
            "[flashcp] ranks_per_node must be 0 (from the launch) or a divisor of context_parallel_degree (4): "
            f"the CP group's ranks per node, got {bad}"
        )
    with pytest.raises(ConfigError, match="comm must be one of compact, full, needed, two_level, ring; got 'zigzag'"):
        tiny_job(tmp_path, flashcp={"comm": "zigzag"})
    with pytest.raises(ConfigError) as e:
        tiny_job(tmp_path, parallelism=CP4, flashcp={"comm": "needed", "ranks_per_node": 2, "scope": "group"})
    assert str(e.value) == ("[flashcp] ranks_per_node = 2 has no effect with comm = 'needed': only comm = "
                            "'two_level' or scope = 'mesh' uses it; remove it or choose that mode")  # fmt: skip


def test_a_cp_group_must_sit_in_equal_contiguous_blocks_per_node():
    assert [group_ranks_per_node(nodes) for nodes in ([0, 0, 1, 1], [5, 5, 5, 5], [0, 1, 2, 3], [7])] == [2, 4, 1, 1]
    for nodes, where in (([0, 0, 0, 1], "0-2 on node 0, 3 on node 1"),
                         ([0, 1, 0, 1], "0 on node 0, 1 on node 1, 2 on node 0, 3 on node 1"),
                         ([0, 0, 1, 1, 1, 1], "0-1 on node 0, 2-5 on node 1")):  # fmt: skip
        with pytest.raises(NodeLayoutError) as e:
            group_ranks_per_node(nodes)
        assert str(e.value) == ("the two-level exchange needs a CP group's ranks in equal contiguous blocks per "
                                f"node, in CP-rank order; CP ranks {where}")  # fmt: skip


def test_a_compiled_block_runs_two_level_as_one_graph_with_the_eager_results():
    """The registered op takes the two-level dispatch as any other (its comm rides in the dispatch):
    the block compiles with `fullgraph=True` (one graph, no break), runs both stages forward and
    backward, and its outputs and gradients are the eager block's."""
    block, ropes = _block({"name": "llama3"}, overlap=True)
    plan = plan_shards([40, 3, 30, 23], 4, "flashcp")
    dispatches = [build_two_level_dispatch(plan, r, ranks_per_node=2, overlap=True) for r in range(4)]
    x, g = torch.randn(2, 1, plan.context, 64, dtype=torch.float64)

    def step(model):
        def program(rank, group):
            d = dispatches[rank]
            xl = x[:, d.token_index].clone().requires_grad_()
            model.zero_grad(set_to_none=True)
            with record_comm() as log:
                out = model(xl, CPStep.of(ropes, d, group), d.positions[None])
                (out * g[:, d.token_index]).sum().backward()
            ops = Counter(entry.op for entry in log)
            return out.detach(), xl.grad, *(p.grad.clone() for p in model.parameters()), ops

        return run_ranks(4, program)

    torch._dynamo.reset()
    eager, compiled = step(block), step(torch.compile(block, backend="aot_eager", fullgraph=True))
    for want, got in zip(eager, compiled):
        assert want[-1] == got[-1] == {"two_level_inter": 2, "two_level_intra": 2}  # forward and backward
        assert max((a - b).abs().max().item() for a, b in zip(want[:-1], got[:-1])) <= 1e-10


def test_the_metrics_add_the_fabric_bytes_of_a_group_across_nodes():
    """With the two-level exchange across nodes each logged step adds, per window, the busiest NIC's
    KV bytes per layer of both exchanges and the NVLink stage's (`flashcp.plan.nodes`); on one node
    (or another exchange) nothing is added."""
    from torchtitan.distributed import ParallelDims

    from flashcp.plan.nodes import node_metrics
    from flashcp.titan.components.metrics import FlashCPMetrics

    plans = [plan_shards([90, 30, 8], 4, "flashcp"), plan_shards([128], 4, "per_doc")]

    def logged(ranks_per_node: int) -> dict[str, float]:
        dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=4, tp=1, pp=1, ep=1, world_size=4)
        metrics = FlashCPMetrics(FlashCPMetrics.Config(), parallel_dims=dims)
        metrics.kv_row_bytes, metrics.ranks_per_node = 8, ranks_per_node
        out: list[dict[str, float]] = []
        metrics.logger.log = lambda values, step: out.append(values)
        for plan in plans:
            metrics.record_window(plan, plan_ms=1.0)
        metrics.log(step=1, global_avg_loss=5.0, global_max_loss=6.0, grad_norm=1.0)
        return {k.removeprefix("flashcp/"): v for k, v in out[0].items() if "fabric" in k or "nvlink" in k}

    expected = [node_metrics(plan, 2, row_bytes=8) for plan in plans]
    assert logged(2) == {
        "kv_fabric_bytes_per_layer_needed": sum(e["flat_inter_bytes"] for e in expected) / 2,
        "kv_fabric_bytes_per_layer_two_level": sum(e["two_level_inter_bytes"] for e in expected) / 2,
        "kv_nvlink_bytes_per_layer_two_level": sum(e["two_level_intra_bytes"] for e in expected) / 2,
    }
    assert 0 < logged(2)["kv_fabric_bytes_per_layer_two_level"] < logged(2)["kv_fabric_bytes_per_layer_needed"]
    assert logged(4) == logged(0) == {}


def train_two_level(rank: int, group: Any, cfg: dict, local_world_size: int | None = None) -> dict[str, Any]:
    """DistributedPool task: a rank's losses, gradient norms, held-out losses, probe log-probabilities
    and KV collectives per op, with LOCAL_WORLD_SIZE as torchrun would set it (None: unset); or the
    error that stopped it."""
    saved, run = os.environ.get("LOCAL_WORLD_SIZE"), probe_loop.run
    if local_world_size is None:
        os.environ.pop("LOCAL_WORLD_SIZE", None)
    else:
        os.environ["LOCAL_WORLD_SIZE"] = str(local_world_size)
    probes: list[Any] = []

    def probing(*args: Any, **kwargs: Any) -> Any:
        probes.append(run(*args, **kwargs))
        return probes[-1]

    probe_loop.run = probing
    norms: dict[int, float] = {}
    validations: list[Any] = []
    try:
        with record_comm() as log:
            losses = train_on_pool_rank(rank, group, cfg, norms, validations)
    except NodeLayoutError as e:
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        probe_loop.run = run
        if saved is None:
            os.environ.pop("LOCAL_WORLD_SIZE", None)
        else:
            os.environ["LOCAL_WORLD_SIZE"] = saved
    return {"losses": losses, "norms": norms, "validation": [v.loss for v in validations],
            "probe": [p.logprob for p in probes], "ops": Counter((e.op, e.pass_) for e in log),
            "fabric_rows": sum(e.recv_rows for e in log if e.op == "two_level_inter")}  # fmt: skip


def _worst(a: dict[int, float], b: dict[int, float], relative: bool = False) -> float:
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1)), (a, b)
    return max(abs(a[s] - b[s]) / (abs(b[s]) if relative else 1.0) for s in b)


@pytest.mark.slow
def test_cp4_on_two_nodes_trains_the_compact_losses_and_an_uneven_layout_is_refused(tmp_path: Path):
    def job(name: str, **flashcp: Any) -> dict:
        return tiny_job(tmp_path / name, training={"steps": STEPS}, parallelism=CP4, data={"prefetch": 2},
                        validation=VALIDATION, probe=PROBE, flashcp=flashcp)  # fmt: skip

    layers = TINY["model"]["n_layers"]
    with DistributedPool(world_size=4) as pool:
        compact = pool.run(train_two_level, (job("compact", comm="compact", plan_worker=False),))[0]
        runs = {
            "ranks_per_node 2, plan worker": pool.run(train_two_level, (
                job("worker", comm="two_level", ranks_per_node=2, plan_worker=True),))[0],
            "LOCAL_WORLD_SIZE 2, loader thread, overlap": pool.run(train_two_level, (
                job("launch", comm="two_level", plan_worker=False, overlap=True), 2))[0],
        }  # fmt: skip
        refused = pool.run(train_two_level, (job("uneven", comm="two_level"), 3))
    assert {op for op, _ in compact["ops"]} == {"all_gather", "reduce_scatter"}, compact["ops"]
    assert compact["validation"] and compact["probe"]
    for name, got in runs.items():
        worst = _worst(got["losses"], compact["losses"])
        worst_norm = _worst(got["norms"], compact["norms"], relative=True)
        worst_validation = max(abs(a - b) for a, b in zip(got["validation"], compact["validation"], strict=True))
        worst_probe = max(abs(a - b).max() for a, b in zip(got["probe"], compact["probe"], strict=True))
        print(f"CP 4 two_level ({name}) vs compact: loss {worst:.1e}, grad norm {worst_norm:.1e} (relative), "
              f"held-out loss {worst_validation:.1e}, probe log-prob {worst_probe:.1e}")  # fmt: skip
        assert max(worst, worst_norm, worst_validation, worst_probe) <= TOLERANCE, (name, got, compact)
        # Both stages in every layer of every training step, forward and backward, plus the
        # forwards of validation and the probe.
        forwards = got["ops"][("two_level_inter", "forward")]
        assert forwards == got["ops"][("two_level_intra", "forward")] > STEPS * layers, got["ops"]
        assert got["ops"][("two_level_inter", "backward")] == STEPS * layers, got["ops"]
        assert not {op for op, _ in got["ops"]} - {"two_level_inter", "two_level_intra"}, got["ops"]
        assert got["fabric_rows"] > 0  # two nodes: rows did cross between them
    for rank, result in enumerate(refused):
        assert result["error"] == (
            "NodeLayoutError: [flashcp] comm = 'two_level': the two-level exchange needs a CP group's ranks in "
            "equal contiguous blocks per node, in CP-rank order; CP ranks 0-2 on node 0, 3 on node 1 (global "
            "ranks 0, 1, 2, 3; 3 ranks per node, LOCAL_WORLD_SIZE); use comm = 'needed' or 'compact', or a CP "
            "degree whose groups fill whole nodes or split them evenly"
        ), rank
    assert not (tmp_path / "uneven" / "checkpoint").exists()


def test_the_dry_run_places_the_ranks_on_nodes_of_eight(tmp_path):
    """`python -m flashcp.titan.dryrun` lays W ranks on nodes of 8, as torchrun would: CP 16 spans two
    nodes and the report has both exchanges' fabric bytes; CP 12 on them is refused with one line."""
    from flashcp.titan.dryrun.report import format_report
    from flashcp.titan.dryrun.run import dry_run

    def job(cp: int) -> dict:
        cfg = tiny_job(tmp_path, training={"seq_len": 128 * cp}, flashcp={"comm": "two_level", "backend": "auto"},
                       parallelism={"context_parallel_degree": cp, "data_parallel_shard_degree": -1})  # fmt: skip
        return cfg | {"_path": "tiny"}

    report = dry_run(job(16), world_size=16)
    fabric = {k: v for k, v in report.plan.items() if "fabric" in k or "nvlink" in k}
    assert set(fabric) == {"kv_fabric_bytes_per_layer_needed", "kv_fabric_bytes_per_layer_two_level",
                           "kv_nvlink_bytes_per_layer_two_level"}  # fmt: skip
    assert 0 < fabric["kv_fabric_bytes_per_layer_two_level"] <= fabric["kv_fabric_bytes_per_layer_needed"]
    assert "two-level exchange: the busiest NIC's KV per layer" in format_report(report)
    with pytest.raises(NodeLayoutError, match=r"; CP ranks 0-7 on node 0, 8-11 on node 1 \(global ranks 0, 1, "
                                              r"2, \.\.\., 11; 8 ranks per node, LOCAL_WORLD_SIZE\)"):  # fmt: skip
        dry_run(job(12), world_size=24)
