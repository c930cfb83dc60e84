"""All CP ranks in one process (flashcp.attention.simulate) against single-process attention, and
the device-side path of the op free of host reads."""

from __future__ import annotations

import pytest
import torch
from test_cp_attention import PLAN_OPTIONS, Case, oracle, window_tensors

from flashcp import plan_shards
from flashcp.attention import cp_varlen_attention, kernels
from flashcp.attention.simulate import run_ranks, simulate_cp_attention
from flashcp.dispatch import build_dispatch, COMM_MODES
from flashcp.plan import STRATEGIES

WINDOW = [61, 3, 1, 27, 9, 1, 40, 18, 2]  # 162 tokens; with +2 below divisible by 2, 4 and 8


@pytest.mark.parametrize("cp_size", [2, 4, 8])
@pytest.mark.parametrize("overlap", [False, True])
def test_simulated_group_matches_single_process(cp_size, overlap):
    doc_lens = WINDOW[:-1] + [WINDOW[-1] + (-sum(WINDOW) % cp_size)]
    heads = (4, 2, 8)
    want = oracle(Case(plan_shards(doc_lens, 1, "per_seq"), "compact", heads=heads))
    q, k, v, g = window_tensors(sum(doc_lens), heads, torch.float64, 0)
    for strategy in STRATEGIES:
        plan = plan_shards(doc_lens, cp_size, strategy, **PLAN_OPTIONS.get(strategy, {}))
        for comm in COMM_MODES:
            got = simulate_cp_attention(plan, comm, q, k, v, g, backend="reference", overlap=overlap)
            for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
                torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=f"{strategy}/{comm} {name}")


def test_ranks_that_disagree_on_collectives_are_reported():
    def program(rank, group):
        if rank == 0:
            group.all_gather(torch.zeros(2), torch.zeros(1))

    with pytest.raises(RuntimeError, match="different numbers of collectives"):
        run_ranks(2, program)


def test_overlap_split_is_required_and_built_on_the_host():
    plan = plan_shards([40, 3, 9, 1, 17, 2, 8], 2, "flashcp")
    t = torch.zeros(plan.tokens_per_rank, 1, 4)
    with pytest.raises(ValueError, match="overlap=True"):
        cp_varlen_attention(t, t, t, build_dispatch(plan, 0), comm="compact", overlap=True)


@pytest.mark.parametrize("comm", COMM_MODES)
def test_device_path_reads_nothing_back(monkeypatch, comm):
    """The op on "meta" tensors, which hold no data: any host read of a device value (`.tolist()`,
    `.item()`, `int(t)`, a copy to the CPU) raises. Exchange, gathers, both overlap halves and the
    inverse permutation all run; the kernel is a shape-only stand-in (the flash kernels take
    sizes as Python numbers from the dispatch, as it does)."""

    def shape_only(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        assert isinstance(max_q, int) and isinstance(max_k, int)
        return q.new_empty(q.shape)

    monkeypatch.setitem(kernels.BACKENDS, "shape_only", kernels.Backend("shape_only", lambda q, k: None, shape_only))
    plan = plan_shards([40, 3, 9, 1, 17, 2, 8], 2, "flashcp")
    dispatches = [build_dispatch(plan, r, comm, overlap=True).to("meta") for r in range(2)]
    assert all(d.overlap.local.rows.numel() and d.overlap.remote.rows.numel() for d in dispatches)

    def program(rank, group):
        d = dispatches[rank]
        q = torch.empty(plan.tokens_per_rank, 4, 8, device="meta")
        kv = torch.empty(plan.tokens_per_rank, 2, 8, device="meta")
        return cp_varlen_attention(q, kv, kv, d, group, comm=comm, backend="shape_only", overlap=True)

    outs = run_ranks(2, program)
    assert all(o.device.type == "meta" and o.shape == (plan.tokens_per_rank, 4, 8) for o in outs)
