"""The dry run of a gpt-oss job (the tiny one of debug_gpt_oss_cpu, CP 2): it runs with the window layers'
own dispatch beside the full one and reports a window layer's K/V rows apart from a full layer's (both
window exchanges' and the one its layers run), in
`--json` and in the table, counted here token by token from the window's plan
(`test_window_metrics.window_rows`)."""

from __future__ import annotations

import json

from test_window_metrics import window_rows

from flashcp.titan.components.metrics import FlashCPMetrics
from flashcp.titan.dryrun import cli
from flashcp.titan.dryrun.report import format_report, Report

ARGS = ["--config", "debug_gpt_oss_cpu", "--world-size", "2", "--training.mixed_precision_param", "bfloat16",
        "--data.source", "synthetic", "--data.synthetic_lengths", "wlbllm", "--training.seq_len", "2048"]  # fmt: skip


def dry_run(monkeypatch, capsys, args: list[str]) -> tuple[dict, list]:
    """The `--json` report of the dry run of `args` and the plans of the windows it recorded."""
    plans = []
    record = FlashCPMetrics.record_window
    monkeypatch.setattr(FlashCPMetrics, "record_window", lambda self, plan, *a, **k: (plans.append(plan),
                                                                                     record(self, plan, *a, **k)))
    capsys.readouterr()
    code = cli.main([*args, "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err[-3000:]
    return json.loads(out.out), plans


def test_a_gpt_oss_dry_run_reports_its_window_layers_rows_apart(monkeypatch, capsys):
    report, plans = dry_run(monkeypatch, capsys, ARGS)
    plan = report["plan"]
    assert (plan["window"], plan["window_layers"], plan["full_layers"]) == (128, 2, 2)
    (window,) = plans
    compact, needed = window_rows(window, 128)
    row = 2 * 2 * 16 * 2  # K and V, 2 KV heads of 16, bf16
    assert compact > 0, "the synthetic window cuts no document: pick another seq_len"
    assert plan["kv_recv_bytes_per_layer_window_compact"] == compact * row
    assert plan["kv_recv_bytes_per_layer_window_needed"] == needed * row
    assert plan["kv_recv_bytes_per_layer_window_compact"] < plan["kv_recv_bytes_per_layer_compact"]
    # the window layers run the needed exchange ([flashcp] window_comm = "auto" beside comm = "compact")
    assert (plan["window_comm"], plan["kv_recv_bytes_per_layer_window"]) == ("needed", needed * row)
    assert report["fits"] and report["estimate_gib"]["flashcp_buffers"] > 0
    text = format_report(Report.from_json(report))
    (line,) = [line for line in text.splitlines() if line.startswith("window layers")]
    assert line == (f"window layers (2 of 4, W = 128): KV received per layer {needed * row / 2**20:.2f} MiB by "
                    f"needed ([flashcp] window_comm; compact {compact * row / 2**20:.2f} MiB, needed "
                    f"{needed * row / 2**20:.2f} MiB; the figures above are the full layers')")
