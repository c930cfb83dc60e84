"""`[flashcp] scope = "mesh"`: the step's global batch planned over all DP x CP ranks as one FlashCP group.

DP 2 x CP 2 in mesh scope trains each step's 2C tokens as one window planned by `plan_mesh` over the 4
ranks; CP 4 in group scope with seq_len 2C trains the same tokens as one window planned over its 4 ranks.
On one node `plan_mesh` is `plan_shards(.., "flashcp")`, so both run the same plan: in float64 (harness
`float64`) the losses and every parameter's first gradient agree to 1e-10, with FSDP sharding over
dp_shard x cp, the first window holding a document across the DP boundary (token C). In float32 the
trainer's losses agree to 1e-5 with the needed exchange and with two_level on 2 simulated nodes (the
mesh plan then cuts by node first, another plan of the same tokens). Beside TP and EP, float32, 3 steps,
the mesh job's losses and first gradients agree with its group-scope reference to 1e-5 (observed: bit for
bit): DP 2 x TP 2 (each mesh rank a TP group) against CP 2 x TP 2 over one window of 2C, and Qwen3-MoE
with DP 2 x CP 2 x EP 2 against CP 4 x EP 2 (the same plan: the same tokens reach each rank and expert);
dp_replicate 2 x CP 2 (HSDP) against CP 4 (observed: losses equal, gradients 1.8e-7 relative).
A mesh-scope run resumed from its checkpoint trains the uninterrupted run's losses; the loader's state
resumes across scopes, and a group-scope checkpoint resumed in mesh scope trains the uninterrupted mesh
run's next windows; the settings the mesh scope does not run are refused in one line. Each 4-rank
comparison takes 2-4 min on a loaded 2-core machine: the default tier keeps the float32 3-step runs and
the loader's resume, the slow tier the float64 exactness, the 20 steps, TP, EP, HSDP and the trainer's resumes.
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import float64, single_rank, tiny_job, train, train_on_pool_rank
from test_moe_train import MOE

from flashcp import plan_shards
from flashcp.data.loader import build_loader
from flashcp.data.sources import DataConfig
from flashcp.plan.mesh import plan_mesh
from flashcp.titan.config import check_layout, ConfigError

C = 256  # the mesh run's seq_len; the CP 4 run's window is 2C
MESH = {"data_parallel_shard_degree": 2, "context_parallel_degree": 2}
CP4 = {"data_parallel_shard_degree": 1, "context_parallel_degree": 4}
NEEDED = {"comm": "needed"}
DATA = {"balance": "off", "prefetch": 0}
TOLERANCES = {"float64": 1e-10, "float32": 1e-5}  # absolute on losses (~8.3), relative (to the largest entry) on gradients


def _dtype(dtype: str) -> contextlib.AbstractContextManager:
    return float64() if dtype == "float64" else contextlib.nullcontext()


def _seed(tmp: Path, dtype: str, **sections: Any) -> dict[str, Any]:
    with single_rank(), _dtype(dtype):
        train(tiny_job(tmp / "seed", checkpoint={"enable": True, "create_seed_checkpoint": True}, **sections),
              seed_checkpoint=True)  # fmt: skip
    return {"enable": True, "initial_load_path": str(tmp / "seed/checkpoint/step-0")}


def _job(tmp: Path, name: str, mesh: bool, steps: int, seed: dict, flashcp: dict = NEEDED,
         layout: tuple[dict, dict] = (MESH, CP4), **sections: Any) -> dict:  # fmt: skip
    """The mesh job (`layout`'s first parallelism, seq_len C) or its reference (the second, group scope,
    one window of 2C over as many FlashCP ranks)."""
    return tiny_job(tmp / name, checkpoint=seed, data=DATA, parallelism=layout[0] if mesh else layout[1],
                    training={"steps": steps, "seq_len": C if mesh else 2 * C},
                    flashcp={"scope": "mesh" if mesh else "group", **flashcp}, **sections)  # fmt: skip


def _flashcp_ranks(cfg: dict) -> int:
    """The ranks of one FlashCP group: the CP group's, or in mesh scope the DP x CP mesh's."""
    p = cfg["parallelism"]
    dp = p["data_parallel_replicate_degree"] * p["data_parallel_shard_degree"]
    return (dp if cfg["flashcp"]["scope"] == "mesh" else 1) * p["context_parallel_degree"]


def _train_rank(rank: int, group: Any, cfg: dict, dtype: str, stop_after: int | None = None) -> tuple:
    """DistributedPool task: a rank's losses, every parameter's whole first gradient, the (strategy,
    ranks, tokens) of the plans its windows had and each window's document lengths, in order."""
    from flashcp.titan.components.metrics import FlashCPMetrics

    grads: dict[str, torch.Tensor] = {}
    plans: set[tuple[str, int, int]] = set()
    windows: list[list[int]] = []
    record = FlashCPMetrics.record_window

    def recording(self: FlashCPMetrics, plan: Any, *args: Any, **kwargs: Any) -> None:
        plans.add((plan.strategy, plan.cp_size, plan.context))
        windows.append(list(plan.doc_lens))
        record(self, plan, *args, **kwargs)

    FlashCPMetrics.record_window = recording
    try:
        with _dtype(dtype):
            losses = train_on_pool_rank(rank, group, cfg, stop_after=stop_after, first_grads=grads)
    finally:
        FlashCPMetrics.record_window = record
    return losses, grads, plans, windows


def _relative(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def _reference(pool: Any, cfg: dict, dtype: str) -> tuple[dict, dict]:
    """The group-scope job's losses and first gradients (CP 4, or a layout's reference)."""
    ref, ref_grads, ref_plans, _ = pool.run(_train_rank, (cfg, dtype))[0]
    assert ref_plans == {("flashcp", _flashcp_ranks(cfg), 2 * C)} and len(ref) == cfg["training"]["steps"], ref_plans
    return ref, ref_grads


def _compare(pool: Any, reference: tuple[dict, dict], mesh_cfg: dict, dtype: str) -> tuple[float, float]:
    """(worst loss difference, worst relative gradient difference) of the mesh job against the reference,
    asserted within tolerance."""
    ref, ref_grads = reference
    runs = pool.run(_train_rank, (mesh_cfg, dtype))
    losses, grads, plans, _ = runs[0]
    assert plans == {("mesh", _flashcp_ranks(mesh_cfg), 2 * C)}, plans
    assert all(r[0] == losses for r in runs)  # every rank logs the loss summed over the mesh
    assert losses.keys() == ref.keys()
    worst = max(abs(losses[s] - ref[s]) for s in ref)
    assert grads.keys() == ref_grads.keys() and {g.dtype for g in grads.values()} == {getattr(torch, dtype)}
    worst_grad = max(_relative(grads[n], g) for n, g in ref_grads.items())
    assert max(worst, worst_grad) <= TOLERANCES[dtype], (losses, ref, worst_grad)
    return worst, worst_grad


def _data(tmp: Path) -> DataConfig:
    return DataConfig(**tiny_job(tmp, data=DATA)["data"])


def _first_window(tmp: Path, seq_len: int) -> list[int]:
    cfg = _data(tmp)
    with build_loader(cfg, seq_len) as loader:
        return next(loader)["doc_lens"]


@pytest.mark.slow
def test_mesh_scope_float64_equals_cp4_over_one_window_of_2c(tmp_path, gloo_pool):
    doc_lens = _first_window(tmp_path, 2 * C)
    starts = [sum(doc_lens[:i]) for i in range(len(doc_lens))]
    across = [d for d, (s, n) in enumerate(zip(starts, doc_lens)) if s < C < s + n]
    assert across, doc_lens  # a document crosses the DP boundary: per-group scope would cut it there
    plan = plan_mesh(doc_lens, 2, 2, ranks_per_node=4)
    assert plan.ranks == plan_shards(doc_lens, 4, "flashcp").ranks  # one node: the CP 4 run's plan
    holders = {r for r, shards in enumerate(plan.ranks) for s in shards if s.doc == across[0]}
    print(f"first window {doc_lens}: document {across[0]} crosses token {C}, held by mesh ranks {sorted(holders)}")
    seed = _seed(tmp_path, "float64")
    pool = gloo_pool(4)
    reference = _reference(pool, _job(tmp_path, "cp4", False, 2, seed), "float64")
    worst, worst_grad = _compare(pool, reference, _job(tmp_path, "mesh", True, 2, seed), "float64")
    print(f"float64 DP 2 x CP 2 mesh scope vs CP 4 (2C): loss {worst:.1e}, gradients {worst_grad:.1e} (relative)")


def _float32_runs(tmp_path: Path, pool: Any, steps: int) -> None:
    seed = _seed(tmp_path, "float32")
    reference = _reference(pool, _job(tmp_path, "cp4", False, steps, seed), "float32")
    two_level = {"comm": "two_level", "ranks_per_node": 2, "plan_worker": True}  # planned in the worker process
    for name, flashcp in (("needed", NEEDED), ("two_level", two_level)):
        worst, worst_grad = _compare(pool, reference, _job(tmp_path, name, True, steps, seed, flashcp), "float32")
        print(f"float32 {steps} steps, mesh scope {name} vs CP 4 (2C): loss {worst:.1e}, gradients {worst_grad:.1e}")


def test_mesh_scope_trains_the_cp4_losses(tmp_path, gloo_pool):
    _float32_runs(tmp_path, gloo_pool(4), 3)


@pytest.mark.slow
def test_mesh_scope_trains_the_cp4_losses_over_20_steps(tmp_path, gloo_pool):
    _float32_runs(tmp_path, gloo_pool(4), 20)


# (mesh, reference) layouts on 4 ranks whose FlashCP group is 2 or 4 ranks beside TP, EP or DP replicas
TP2 = ({"data_parallel_shard_degree": 2, "context_parallel_degree": 1, "tensor_parallel_degree": 2},
       {"data_parallel_shard_degree": 1, "context_parallel_degree": 2, "tensor_parallel_degree": 2})  # fmt: skip
EP2 = ({**MESH, "expert_parallel_degree": 2}, {**CP4, "expert_parallel_degree": 2})
REPLICATED = ({"data_parallel_replicate_degree": 2, "data_parallel_shard_degree": 1, "context_parallel_degree": 2},
              CP4)  # fmt: skip


def _beside(tmp_path: Path, pool: Any, layout: tuple[dict, dict], **sections: Any) -> tuple[float, float]:
    """The mesh job of `layout` against its reference, float32, 3 steps from one seed checkpoint."""
    seed = _seed(tmp_path, "float32", **sections)
    reference = _reference(pool, _job(tmp_path, "group", False, 3, seed, layout=layout, **sections), "float32")
    return _compare(pool, reference, _job(tmp_path, "mesh", True, 3, seed, layout=layout, **sections), "float32")


@pytest.mark.slow
def test_mesh_scope_with_tp2_trains_the_losses_of_one_window_over_cp2(tmp_path, gloo_pool):
    """DP 2 x TP 2: the mesh's two ranks each hold a TP group (same tokens, weights split over tp)."""
    worst, worst_grad = _beside(tmp_path, gloo_pool(4), TP2)
    print(f"float32 3 steps, DP 2 x TP 2 mesh scope vs CP 2 x TP 2 (2C): loss {worst:.1e}, gradients {worst_grad:.1e}")


@pytest.mark.slow
def test_mesh_scope_with_ep2_trains_the_cp4_losses_of_qwen3_moe(tmp_path, gloo_pool):
    """Qwen3-MoE, experts split by EP 2 over ranks borrowed from dp_shard x cp in both runs."""
    worst, worst_grad = _beside(tmp_path, gloo_pool(4), EP2, model=MOE)
    print(f"float32 3 steps, Qwen3-MoE DP 2 x CP 2 x EP 2 mesh scope vs CP 4 x EP 2 (2C): loss {worst:.1e}, "
          f"gradients {worst_grad:.1e}")  # fmt: skip


@pytest.mark.slow
def test_mesh_scope_with_dp_replicate_trains_the_cp4_losses(tmp_path, gloo_pool):
    """HSDP: 2 replicas of FSDP over cp 2; the mesh is dp_replicate x cp, the reference shards over cp 4."""
    worst, worst_grad = _beside(tmp_path, gloo_pool(4), REPLICATED)
    print(f"float32 3 steps, dp_replicate 2 x CP 2 mesh scope vs CP 4 (2C): loss {worst:.1e}, gradients "
          f"{worst_grad:.1e}")  # fmt: skip


@pytest.mark.slow
def test_a_mesh_scope_run_resumes_to_the_uninterrupted_losses(tmp_path, gloo_pool):
    seed = _seed(tmp_path, "float32")
    pool = gloo_pool(4)

    def job(name: str) -> dict:
        cfg = _job(tmp_path, name, True, 4, seed)
        cfg["checkpoint"] |= {"interval": 2}
        return cfg

    whole = pool.run(_train_rank, (job("whole"), "float32"))[0][0]
    first = pool.run(_train_rank, (job("resumed"), "float32", 2))[0][0]
    rest = pool.run(_train_rank, (job("resumed"), "float32"))[0][0]
    assert sorted(first) == [1, 2] and sorted(rest) == [3, 4]
    assert {**first, **rest} == pytest.approx(whole, abs=1e-6)


@pytest.mark.slow
def test_a_group_scope_checkpoint_resumes_in_mesh_scope(tmp_path, gloo_pool):
    """DP 2 x CP 2 saved at step 2 in group scope (the same FSDP shards as the mesh's) and resumed in mesh
    scope trains steps 3-4 on the uninterrupted mesh run's windows 3-4: the next DP windows as one. Its
    losses differ from that run's by what steps 1-2 changed: documents cut at the DP boundary there."""
    seed = _seed(tmp_path, "float32")
    pool = gloo_pool(4)

    def job(name: str, scope: str) -> dict:
        return tiny_job(tmp_path / name, checkpoint=seed | {"interval": 2}, data=DATA, parallelism=MESH,
                        training={"steps": 4, "seq_len": C}, flashcp={"scope": scope, **NEEDED})  # fmt: skip

    whole, _, _, whole_windows = pool.run(_train_rank, (job("whole", "mesh"), "float32"))[0]
    first = pool.run(_train_rank, (job("switched", "group"), "float32", 2))[0]
    rest, _, plans, windows = pool.run(_train_rank, (job("switched", "mesh"), "float32"))[0]
    assert sorted(first[0]) == [1, 2] and first[2] == {("flashcp", 2, C)} and sorted(rest) == [3, 4]
    assert plans == {("mesh", 4, 2 * C)} and windows == whole_windows[2:], (windows, whole_windows)
    print(f"group -> mesh at step 2: steps 3-4 {rest} vs uninterrupted mesh {whole}")


def test_the_loader_resumes_across_scopes(tmp_path):
    """A mesh window is the stream's next DP windows of C as one (documents whole across them); the
    state counts windows of C and holds the stream's cursor, so either scope resumes the other's state."""
    cfg = _data(tmp_path)
    mesh_planner = functools.partial(plan_mesh, dp=2, cp=2, ranks_per_node=4)
    group = [build_loader(cfg, C, dp_rank=r, dp_world=2, cp_size=2) for r in range(2)]
    rounds = [[next(loader) for loader in group] for _ in range(3)]
    mesh = build_loader(cfg, C, cp_size=2)
    mesh.mesh_with(2, mesh_planner)
    windows = [next(mesh) for _ in range(3)]
    for (a, b), w in zip(rounds, windows):
        assert torch.equal(w["input"], torch.cat([a["input"], b["input"]]))
        assert w["window"] == a["window"] and w["plan"].cp_size == 4
    assert mesh.state_dict() == group[0].state_dict()  # the same cursor and window count
    state = group[0].state_dict()
    group[0].load_state_dict(mesh.state_dict())  # mesh -> group
    after = build_loader(cfg, C, cp_size=2)
    after.mesh_with(2, mesh_planner)
    after.load_state_dict(state)  # group -> mesh
    assert torch.equal(next(after)["input"][:C], next(group[0])["input"])


def test_the_metrics_describe_the_mesh_window():
    """A mesh window's attention is shared by its DP groups (pairs / DP per CP group, as the MFU counts
    them), and its documents cut across nodes are counted with the most nodes one spans."""
    from torchtitan.distributed import ParallelDims

    from flashcp.titan.components.metrics import attention_pairs, FlashCPMetrics

    plan = plan_mesh([26, 46, 440], 4, 1, ranks_per_node=2)  # DP 4 x CP 1 on 2 nodes
    assert plan.info["node_cut"] == [2]
    dims = ParallelDims(dp_replicate=1, dp_shard=4, cp=1, tp=1, pp=1, ep=1, world_size=4)
    metrics = FlashCPMetrics(FlashCPMetrics.Config(), parallel_dims=dims)
    metrics.mesh_groups = 4
    out: list[dict[str, float]] = []
    metrics.logger.log = lambda values, step: out.append(values)
    metrics.record_window(plan, plan_ms=1.0)
    assert metrics.stats.attention_pairs == attention_pairs(plan.doc_lens) / 4
    metrics.log(step=1, global_avg_loss=5.0, global_max_loss=6.0, grad_norm=1.0)
    assert (out[0]["flashcp/node_cut_docs"], out[0]["flashcp/node_cut_nodes_max"]) == (1.0, 2)
    # CP 1, yet TorchTitan's count per rank is its DP group's, not its own tokens': no max loss
    assert "loss_metrics/global_max_loss" not in out[0]


def test_what_the_mesh_scope_does_not_run_is_refused(tmp_path):
    mesh = {"scope": "mesh", "comm": "needed"}
    cases = [
        ({"flashcp": {**mesh, "comm": "full"}}, "[flashcp] comm = 'full' (the full all-gather over the whole mesh; "
                                                "use 'needed', 'two_level' or 'compact')"),
        ({"flashcp": {**mesh, "comm": "ring", "backend": "torch"}}, "[flashcp] comm = 'ring' (a ring around the "
                                                                    "whole mesh; use 'needed' or 'two_level')"),
        ({"flashcp": {**mesh, "strategy": "per_doc"}}, "[flashcp] strategy = 'per_doc' (the mesh is planned by "
                                                       "FlashCP's planner over nodes and ranks, flashcp.plan.mesh)"),
        ({"data": {"balance": "deferral-cut"}}, "[data] balance = 'deferral-cut' (the mesh-wide plan is the balance "
                                                "across DP groups; set balance = 'off')"),
        ({"validation": {"enable": True, "source": "default"}}, "[validation] enable = true (held-out windows are "
                                                                "planned per CP group)"),
    ]  # fmt: skip
    for sections, what in cases:
        with pytest.raises(ConfigError) as e:
            tiny_job(tmp_path, **({"flashcp": mesh, "data": DATA} | sections))
        assert str(e.value) == f"{what}: not with [flashcp] scope = 'mesh'"
    cfg = tiny_job(tmp_path, flashcp={**mesh, "ranks_per_node": 3}, data=DATA, parallelism=MESH)
    with pytest.raises(ConfigError) as e:
        check_layout(cfg, 4, has_cuda=False)
    assert str(e.value) == ("[flashcp] ranks_per_node (3) must divide the mesh's DP x CP = 2 x 2 ranks with scope = "
                            "'mesh': the ranks of one node")  # fmt: skip
