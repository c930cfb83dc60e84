"""`python -m flashcp.gpucheck --device cpu --quick`: what every section writes (`check_quick_output`, on
the lease rehearsal's run of that command), the checks catch a wrong kernel, a broken exchange and a
wrong sink correction, and a failing section does not stop the rest."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from flashcp.attention import kernels, sinks
from flashcp.attention.simulate import SimulatedGroup
from flashcp.costmodel.profiles import KERNEL_CSV_REQUIRED
from flashcp.gpucheck import SECTIONS
from flashcp.gpucheck import timing, window_sinks
from flashcp.gpucheck.__main__ import main
from flashcp.gpucheck.efficiency import sweep_calls
from flashcp.gpucheck.report import Table
from flashcp.gpucheck.sizes import GPU, QUICK
from test_gpucheck_gdn import check_gdn_rows

FILES = ["summary.md", "env.json", "exactness.csv", "cp.csv", "window_sinks.csv", "critical_path.csv",
         "efficiency.csv", "decoder.json", "kernel_calls.csv", "gdn.csv", "gdn_timing.csv"]  # fmt: skip


def fewer_cp_sizes(monkeypatch, *sizes: int) -> None:
    """The quick check's CP section on these group sizes only: a test of one failure mode needs not all."""
    import flashcp.gpucheck.__main__ as entry

    monkeypatch.setattr(entry, "QUICK", dataclasses.replace(QUICK, cp_sizes=sizes))


def _rows(path: Path) -> list[dict]:
    with path.open() as f:
        return list(csv.DictReader(f))


def check_quick_output(out: Path, last_line: str) -> None:
    """What `python -m flashcp.gpucheck --device cpu --quick --no-budgets` must leave in `out` and print
    last: every section's file and status, every case of the four correctness sections passed. The
    suite's run of it is the lease rehearsal's part a (tests/test_gpu_lease.py), which calls this."""
    assert "sections passed or measured" in last_line, last_line
    assert sorted(p.name for p in out.iterdir()) == sorted(FILES)
    summary = (out / "summary.md").read_text()
    for title, _ in SECTIONS.values():
        assert f"## {title}" in summary
    assert summary.count("status: **passed**") == 4 and summary.count("status: **measured**") == 3
    env = json.loads((out / "env.json").read_text())
    assert env["backend reference"] == "available" and env["torch"]

    exact = _rows(out / "exactness.csv")
    assert {r["gqa"] for r in exact} == {"1", "4", "8"} and {r["dtype"] for r in exact} == {"float16", "bfloat16"}
    assert {"1-token documents", "more keys than queries"} <= {r["case"] for r in exact}
    assert all(r["ok"] == "True" for r in exact)
    cp = _rows(out / "cp.csv")
    assert {(r["cp"], r["comm"]) for r in cp} >= {(n, c) for n in "248" for c in ("compact", "full", "needed", "ring")}
    assert {r["strategy"] for r in cp} >= {"per_seq", "per_doc", "whole_doc", "flashcp"}
    assert all(r["ok"] == "True" for r in cp)
    check_window_sinks_rows(_rows(out / "window_sinks.csv"))
    check_gdn_rows(_rows(out / "gdn.csv"))
    assert {r["strategy"] for r in _rows(out / "critical_path.csv")} == {"per_seq", "per_doc", "flashcp", "ring", "zigzag"}
    assert {r["kind"] for r in _rows(out / "efficiency.csv")} == {"fig3", "sweep"}
    assert json.loads((out / "decoder.json").read_text())
    # The timed calls are in the cost model's per-rank table format (tests/test_costmodel.py parses
    # that format; toy CPU timings are too noisy for its plausibility checks, so only the shape here).
    calls = _rows(out / "kernel_calls.csv")
    assert calls and set(KERNEL_CSV_REQUIRED) <= set(calls[0])
    assert all(len(r["q_lens"].split()) == len(r["k_lens"].split()) > 0 for r in calls)
    assert all(int(r["kv_heads"]) < int(r["heads"]) for r in calls)  # GQA, as the models have it


def check_window_sinks_rows(rows: list[dict]) -> None:
    """The window + sinks section's rows on a CPU: the reference kernel in both dtypes, every edge case and
    tensor, all within tolerance; flex (no backward on a CPU) is not among them."""
    assert {r["dtype"] for r in rows} == {"float32", "bfloat16"} and {r["implementation"] for r in rows} == {"reference"}
    assert {r["tensor"] for r in rows} == {"out", "dq", "dk", "dv", "dsinks"}
    assert {"W = 1", "a CP shard: more keys than queries", "no window (full causal)"} <= {r["case"] for r in rows}
    assert {"1", "none"} <= {r["window"] for r in rows}
    assert all(r["ok"] == "True" for r in rows)


def test_the_window_sinks_section_passes_on_the_cpu(tmp_path):
    assert main(["--out", str(tmp_path), "--device", "cpu", "--quick", "--no-budgets", "--sections", "window_sinks"]) == 0
    check_window_sinks_rows(_rows(tmp_path / "window_sinks.csv"))
    summary = (tmp_path / "summary.md").read_text()
    assert "status: **passed**" in summary and "flex float32: not run: FlexAttention refuses a backward on CPU" in summary


def _sink_counted_twice(monkeypatch):
    real = sinks._SinkAttention.forward
    monkeypatch.setattr(sinks._SinkAttention, "forward",
                        staticmethod(lambda ctx, q, k, v, s, *rest: real(ctx, q, k, v, s + math.log(2), *rest)))


def _dsinks_sign_flipped(monkeypatch):
    real = sinks._SinkAttention.backward

    def flipped(ctx, grad_out):
        dq, dk, dv, dsinks, *rest = real(ctx, grad_out)
        return (dq, dk, dv, -dsinks, *rest)

    monkeypatch.setattr(sinks._SinkAttention, "backward", staticmethod(flipped))


@pytest.mark.parametrize(("wrong", "failed"), [(_sink_counted_twice, {"out", "dq", "dk", "dv", "dsinks"}),
                                               (_dsinks_sign_flipped, {"dsinks"})], ids=["forward", "backward"])
def test_a_wrong_sink_correction_fails_the_window_sinks_section(tmp_path, monkeypatch, wrong, failed):
    """The engine's sink correction made wrong in its forward (exp(sink) counted twice in the denominator)
    or its backward (dsinks of the wrong sign): the float64 truth, written apart from it, sees each."""
    wrong(monkeypatch)
    assert main(["--out", str(tmp_path), "--device", "cpu", "--quick", "--no-budgets", "--sections", "window_sinks"]) == 1
    assert "status: **failed**" in (tmp_path / "summary.md").read_text()
    assert {r["tensor"] for r in _rows(tmp_path / "window_sinks.csv") if r["ok"] == "False"} == failed


def test_flex_s_side_agrees_with_the_truth(monkeypatch):
    """What only a GPU run uses, FlexAttention with a document + window mask_mod and the sink applied to
    its LSE (autograd through it), here on the CPU with flex's refusal of a CPU backward lifted (its
    eager backward is the same math on every device): W = 1 and a CP shard, in both dtypes."""
    import torch.nn.attention.flex_attention as flex

    monkeypatch.setattr(flex, "_validate_device", lambda *tensors: None)
    for case in (window_sinks.cases(QUICK)[1], window_sinks.cases(QUICK)[4]):
        for dtype in window_sinks.DTYPES:
            gen = torch.Generator().manual_seed(0)
            rows = window_sinks.check_case(case, dtype, ["reference", "flex"], QUICK, torch.device("cpu"), gen)
            assert {(r["implementation"], r["against"]) for r in rows} == {
                ("reference", "float64"), ("flex", "float64"), ("reference", "flex")}
            assert all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]


def test_a_wrong_kernel_fails_the_exactness_section(tmp_path, monkeypatch):
    good = kernels.BACKENDS["reference"]

    def off_by_a_bit(q, k, v, *args):  # 1 % too large: far beyond half-precision rounding
        return good.run(q, k, v, *args) * 1.01

    monkeypatch.setitem(kernels.BACKENDS, "reference", kernels.Backend("reference", good.reject, off_by_a_bit))
    assert main(["--out", str(tmp_path), "--device", "cpu", "--quick", "--no-budgets", "--sections", "exactness"]) == 1
    assert "status: **failed**" in (tmp_path / "summary.md").read_text()
    assert not all(r["ok"] == "True" for r in _rows(tmp_path / "exactness.csv"))


def test_a_broken_exchange_fails_the_cp_section(tmp_path, monkeypatch):
    """Gradients of rows another rank used never come back: only the CP check can see this."""
    monkeypatch.setattr(SimulatedGroup, "reduce_scatter", lambda self, out, inp: out.zero_())
    fewer_cp_sizes(monkeypatch, 4)
    assert main(["--out", str(tmp_path), "--device", "cpu", "--quick", "--no-budgets", "--sections", "cp"]) == 1
    failed = {r["tensor"] for r in _rows(tmp_path / "cp.csv") if r["ok"] == "False"}
    assert failed == {"dk", "dv"}


def test_a_crashing_section_is_reported_and_the_rest_still_run(tmp_path, monkeypatch, capsys):
    def crash(*args):
        raise MemoryError("out of device memory")

    monkeypatch.setitem(SECTIONS, "critical_path", (SECTIONS["critical_path"][0], crash))
    argv = ["--out", str(tmp_path), "--device", "cpu", "--quick", "--no-budgets", "--sections", "critical_path", "efficiency"]
    code = main(argv)
    assert code == 1
    summary = (tmp_path / "summary.md").read_text()
    assert "status: **error: MemoryError: out of device memory**" in summary
    assert "## 5. Kernel efficiency\n\nstatus: **measured**" in summary
    assert capsys.readouterr().out.splitlines()[-1].startswith("gpucheck: FAILED in critical_path")


def test_a_spent_budget_cuts_sections_short_and_says_so(tmp_path):
    assert main(["--out", str(tmp_path), "--device", "cpu", "--quick", "--budget-scale", "1e-9",
                 "--sections", "critical_path", "efficiency"]) == 0  # fmt: skip
    assert (tmp_path / "summary.md").read_text().count("status: **cut short**") == 2


def test_a_section_s_own_budget_replaces_its_scaled_default(tmp_path, capsys):
    """`--budget critical_path=1e-9` cuts that section alone; the other keeps its default; a bad item is refused."""
    assert main(["--out", str(tmp_path), "--device", "cpu", "--quick", "--budget", "critical_path=1e-9",
                 "--sections", "critical_path", "efficiency"]) == 0  # fmt: skip
    summary = (tmp_path / "summary.md").read_text()
    assert summary.count("status: **cut short**") == 1 and "status: **measured**" in summary
    for bad in ("critical_path", "nosuch=5", "cp=-1"):
        with pytest.raises(SystemExit):
            main(["--out", str(tmp_path), "--device", "cpu", "--quick", "--budget", bad])
        assert "--budget" in capsys.readouterr().err


def test_a_correctness_section_cut_short_has_not_passed(tmp_path, capsys):
    assert main(["--out", str(tmp_path), "--device", "cpu", "--quick", "--budget-scale", "1e-9",
                 "--sections", "exactness"]) == 1  # fmt: skip
    assert "status: **cut short**" in (tmp_path / "summary.md").read_text()
    assert capsys.readouterr().out.splitlines()[-1].startswith("gpucheck: NOT ALL CHECKED: exactness cut short")


def test_cuda_without_a_gpu_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        main(["--out", str(tmp_path), "--device", "cuda"])
    assert e.value.code == 2 and "sees no CUDA GPU" in capsys.readouterr().err


def test_without_scipy_the_cp_section_skips_the_ilp_plan_and_says_so(tmp_path, monkeypatch):
    """A bare GPU machine has torch and numpy only: the ILP plan (scipy's MILP) is skipped, not a crash."""
    import flashcp.plan as planning

    for name in [m for m in sys.modules if m == "scipy" or m.startswith("scipy.")] + ["flashcp.plan.ilp"]:
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setitem(sys.modules, "scipy", None)  # import scipy -> ImportError
    planning._strategy.cache_clear()  # an earlier test may have looked the ILP strategy up already
    fewer_cp_sizes(monkeypatch, QUICK.cp_sizes[0])  # the one group size the ILP plan is checked at
    try:
        assert main(["--out", str(tmp_path), "--device", "cpu", "--quick", "--no-budgets", "--sections", "cp"]) == 0
    finally:
        planning._strategy.cache_clear()
    summary = (tmp_path / "summary.md").read_text()
    assert "status: **passed**" in summary and "ilp: skipped, scipy is not installed" in summary
    assert "ilp" not in {r["strategy"] for r in _rows(tmp_path / "cp.csv")}


@pytest.mark.parametrize("sizes", [GPU, QUICK], ids=["gpu", "quick"])
def test_every_efficiency_point_is_a_window_that_can_exist(sizes):
    """Whole documents fit the rank's T tokens; a Per-Doc document of 2N chunks fits the window."""
    c, n = sizes.eff_context, sizes.eff_cp
    layouts = {}
    for s in sizes.eff_shard_lens:
        calls = sweep_calls(c, s, n)
        layouts[s] = set(calls)
        for layout, (q_lens, k_lens) in calls.items():
            assert sum(q_lens) == c // n and len(q_lens) == len(k_lens)
            documents = k_lens if layout == "whole" else k_lens[1::2]  # a pair's last shard sees its whole document
            assert max(documents) <= c and sum(documents) <= c
    assert layouts[max(sizes.eff_shard_lens)] == {"whole"}  # its Per-Doc document would not fit the window
    assert any(layouts[s] == {"whole", "per_doc"} for s in sizes.eff_shard_lens)


def test_timings_use_the_shipped_models_kv_heads(tmp_path, monkeypatch):
    """Llama 3 8B on one rank (32 query / 8 KV heads) and 70B under TP 8 (8 / 1): K and V are timed
    with the models' KV heads, not one per query head."""
    from flashcp.titan.models.registry import flavor_architecture

    llama8b, llama70b = flavor_architecture("llama3", "8B"), flavor_architecture("llama3", "70B")
    shipped = {(llama8b.n_heads, llama8b.n_kv_heads), (llama70b.n_heads // 8, llama70b.n_kv_heads // 8)}
    assert set(GPU.path_heads) == shipped and GPU.eff_heads in shipped
    shapes = []

    def record(q, k, v, *args, **kwargs):
        shapes.append((tuple(q.shape), tuple(k.shape), tuple(v.shape)))
        return kernels.varlen_attention(q, k, v, *args, **kwargs)

    monkeypatch.setattr(timing, "varlen_attention", record)
    calls = Table(tmp_path / "kernel_calls.csv", timing.KERNEL_CALL_COLUMNS)
    timer = timing.Timer(torch.device("cpu"), 1)
    timing.time_and_log(calls, "test", [8, 4], [8, 12], (8, 2), 16, torch.float32, "reference", timer)
    assert set(shapes) == {((12, 8, 16), (20, 2, 16), (20, 2, 16))}
    assert (calls.rows[0]["heads"], calls.rows[0]["kv_heads"]) == (8, 2)
