"""The dry run of a hybrid Gated DeltaNet job (debug_hybrid_cpu's tiny Qwen3.5, CP 2): its linear layers
run the stand-in with the GPU kernel's footprint (`flashcp.titan.dryrun.linear`), and the report gives
their state summaries and conv halo rows per layer beside the K/V bytes, counted here from the window's
plan (`linear_comm`); the stand-in holds the busiest rank's summaries."""

from __future__ import annotations

import torch
from test_dryrun_gpt_oss import dry_run
from torch._subclasses.fake_tensor import FakeTensorMode

from flashcp.plan.linear import linear_comm
from flashcp.titan.dryrun.linear import GatedDeltaStandIn
from flashcp.titan.dryrun.report import format_report, Report

ARGS = ["--config", "debug_hybrid_cpu", "--world-size", "2", "--data.source", "synthetic",
        "--data.synthetic_lengths", "wlbllm", "--training.seq_len", "4096"]  # fmt: skip


def test_a_hybrid_dry_run_reports_its_state_bytes_beside_the_kv_bytes(monkeypatch, capsys):
    report, plans = dry_run(monkeypatch, capsys, ARGS)
    figures = report["plan"]
    (window,) = plans
    # tiny_qwen3_5: 4 value heads of d_k = d_v = 16; q, k, v convolved over 2 x 32 + 64 channels; the job
    # computes in float32, so do its halo rows
    comm = linear_comm(window, 4, 16, 16, 128, dtype_bytes=4)
    assert max(comm.state_recv) > 0, "the synthetic window cuts no document: pick another seq_len"
    assert figures["state_recv_bytes_per_layer"] == max(comm.state_recv)
    assert figures["state_recv_bytes_per_layer_mean"] == sum(comm.state_recv) / 2
    assert figures["halo_recv_bytes_per_layer"] == max(comm.halo_recv)
    assert figures["kv_recv_bytes_per_layer_compact"] > 0
    assert report["fits"]
    text = format_report(Report.from_json(report))
    (line,) = [line for line in text.splitlines() if line.startswith("Gated DeltaNet layers")]
    mib = max(comm.state_recv) / 2**20
    assert line.startswith(f"Gated DeltaNet layers: state summaries received per layer {mib:.1f} MiB on the busiest")


def test_the_stand_in_keeps_the_kernels_tensors_and_the_busiest_ranks_summaries():
    """Forward: the output and, kept for the backward, A [T, H, 64] and the summaries in float32; its
    backward gives every input a gradient of the input's shape and dtype."""
    t, h, dk, dv, state = 256, 4, 16, 32, 3 * 4096
    op = GatedDeltaStandIn(lambda: state)
    with FakeTensorMode():
        q, k = (torch.empty(t, h, dk, requires_grad=True) for _ in range(2))
        v = torch.empty(t, h, dv, dtype=torch.bfloat16, requires_grad=True)
        g, beta = (torch.empty(t, h, requires_grad=True) for _ in range(2))
        o = op(q, k, v, g, beta, d=None)
        saved = o.grad_fn.saved_tensors
        o.sum().backward()
    assert o.shape == (t, h, dv) and o.dtype == q.dtype
    assert [tuple(x.shape) for x in saved[-2:]] == [(t, h, 64), (state // 4,)]
    assert all(x.dtype == torch.float32 for x in saved[-2:])
    assert all(x.grad is not None and x.grad.shape == x.shape and x.grad.dtype == x.dtype for x in (q, k, v, g, beta))

