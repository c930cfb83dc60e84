"""`python -m flashcp.plan`: table and JSON output, window sources, one-line errors (exit 2)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from flashcp.plan import STRATEGIES
from flashcp.plan.__main__ import DEFAULT_STRATEGIES, METRICS, WINDOW_METRICS, main

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--context", "4096", "--windows", "6", "--cp", "4"]


def run_json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_table_has_one_row_per_strategy(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--distribution", "pile", *SMALL]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("6 window(s) of 4096 tokens from pile (seed 0)")
    assert lines[1].split()[0] == "strategy"
    assert [line.split()[0] for line in lines[2:-1]] == DEFAULT_STRATEGIES
    assert "ilp" not in DEFAULT_STRATEGIES and set(DEFAULT_STRATEGIES) == set(STRATEGIES) - {"ilp"}


def test_json_summaries(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--distribution", "redpajama", *SMALL, "--strategy", "per_doc", "--strategy", "flashcp"]
    out = run_json(capsys, argv)
    assert list(out) == ["per_doc", "flashcp"]
    for summary in out.values():
        assert set(summary) == set(METRICS)
        for stats in summary.values():
            assert set(stats) == {"mean", "p50", "p95", "max"}
            assert stats["p50"] <= stats["p95"] <= stats["max"]
        assert summary["imbalance"]["mean"] >= 1.0
        assert 0.0 <= summary["comm_compact_ratio"]["mean"] <= 1.0
    # Every Per-Doc rank but the first holds two non-last chunks: it sends all its tokens.
    assert out["per_doc"]["comm_compact_ratio"]["max"] == 1.0
    assert out["flashcp"]["split_docs"]["mean"] <= out["per_doc"]["split_docs"]["mean"]


def test_sources_and_ilp(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    one = run_json(capsys, [
        "--lengths", "100,100", "--cp", "2", "--strategy", "ilp", "--strategy", "per_seq"
    ])
    assert one["ilp"]["comm_compact_ratio"]["max"] == 0.0 and one["ilp"]["imbalance"]["max"] == 1.0
    assert one["per_seq"]["comm_compact_ratio"]["max"] > 0.0  # its chunk grid splits both documents
    pool = tmp_path / "lens.json"
    pool.write_text("[300, 500, 1200]")
    out = run_json(capsys, ["--lengths-file", str(pool), *SMALL, "--strategy", "all"])
    assert list(out) == DEFAULT_STRATEGIES


def test_mla_latent_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    """--mla: the busiest rank's latent bytes per layer are its received rows x 576 values x 2
    bytes, and `kv: x full` divides them by the K/V all-gather of the same plan (16 heads x
    (192 + 128) values a row: 576 / 5120 of the K/V ratio); named and spelled-out shapes agree."""
    lens = ["--lengths", "3000,700,200,100,96", "--cp", "4"]
    named = run_json(capsys, [*lens, "--mla", "moonlight", "--ranks-per-node", "2"])
    spelled = run_json(capsys, [*lens, "--mla", "512,64,16,128,128", "--ranks-per-node", "2"])
    for out in (named, spelled):
        for s in out.values():
            del s["plan_ms"]  # a timing
    assert named == spelled
    plain = run_json(capsys, [*lens, "--ranks-per-node", "2"])
    for name, s in named.items():
        full_rows = 3 * 4096 // 4  # (N - 1) C / N
        mean = {k: v["mean"] for k, v in s.items()}
        assert mean["kv_full_mib"] == full_rows * 16 * 320 * 2 / 2**20, name
        for mode in ("compact", "needed"):
            assert mean[f"latent_{mode}_mib"] == pytest.approx(mean[f"comm_{mode}_ratio"] * full_rows * 576 * 2 / 2**20)
            assert mean[f"latent_{mode}_kv_full"] == pytest.approx(mean[f"comm_{mode}_ratio"] * 576 / 5120)
        fabric = plain[name]["fabric_two_level_inter_ratio"]["mean"]
        assert mean["latent_fabric_two_level_kv_full"] == pytest.approx(fabric * 576 / 5120), name
    assert main([*lens, "--mla", "deepseek_v3"]) == 0
    out = capsys.readouterr().out
    assert "MLA deepseek_v3: latent row 512 + 64 = 576 values vs K/V row 128 x (192 + 128) = 40960 (71.1x)" in out
    assert "kv: x full compact / needed" in out.splitlines()[2]


def test_window_rows_and_the_mixed_imbalance(capsys: pytest.CaptureFixture[str]) -> None:
    """--window 16 on Llama3 CP's split of [300, 200] over 2 ranks: rank 0 holds document 0's
    [0, 125) and document 1's [75, 200), rank 1 the rest. A full layer receives 125 rows (compact:
    rank 0 sends its non-last 125; needed: rank 1 attends 125 of them), a window layer 15 (the
    last W - 1 of a non-last shard; the 15 before a cut). The imbalance is of 1 full : 1 window
    layer's work, counted by hand: queries at p < 16 see p + 1 window keys, later ones 16."""
    out = run_json(capsys, ["--lengths", "300,200", "--cp", "2", "--strategy", "per_seq", "--window", "16"])
    mean = {k: v["mean"] for k, v in out["per_seq"].items()}
    assert (mean["comm_compact_tokens"], mean["comm_needed_tokens"]) == (125, 125)
    assert (mean["window_compact_tokens"], mean["window_needed_tokens"]) == (15, 15)
    window = lambda a, b: sum(min(p + 1, 16) for p in range(a, b))  # noqa: E731
    causal = lambda a, b: sum(p + 1 for p in range(a, b))  # noqa: E731
    ranks = [[(0, 125), (75, 200)], [(125, 300), (0, 75)]]
    work = [sum(causal(a, b) + window(a, b) for a, b in r) for r in ranks]
    assert work == [29005, 44005]
    assert mean["imbalance"] == pytest.approx(44005 / 36505)
    plain = run_json(capsys, ["--lengths", "300,200", "--cp", "2", "--strategy", "per_seq"])
    assert plain["per_seq"]["imbalance"]["mean"] == pytest.approx(
        sum(causal(a, b) for a, b in ranks[1]) / (causal(0, 300) + causal(0, 200)) * 2)  # fmt: skip


def test_window_layers_as_a_share_or_a_count(capsys: pytest.CaptureFixture[str]) -> None:
    """12/24 layers is 0.5, the default share; the table adds both kinds' rows and names the mix."""
    base = ["--distribution", "pile", *SMALL, "--strategy", "flashcp", "--strategy", "per_doc",
            "--window", "128"]  # fmt: skip
    shares = ([], ["--window-layers", "0.5"], ["--window-layers", "12/24"])
    runs = [run_json(capsys, [*base, *share]) for share in shares]
    for out in runs:
        for s in out.values():
            del s["plan_ms"]  # a timing
    assert runs[0] == runs[1] == runs[2]
    assert set(runs[0]["flashcp"]) == set(METRICS) - {"plan_ms"} | set(WINDOW_METRICS)
    assert main([*base, "--window-layers", "3/4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "workload: 1 full : 3 window layers, W = 128 (the imbalance counts both)"
    assert "full-layer rows compact / needed" in lines[2] and "window rows compact / needed" in lines[2]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--window", "0"], "--window takes the keys a query sees (HF sliding_window), a positive integer"),
        (["--window", "-128"], "a positive integer, got '-128'"),
        (["--window", "12.5"], "a positive integer, got '12.5'"),
        (["--window", "128", "--window-layers", "1.5"], "with the window in [0, 1] (0.5 or 12/24), got '1.5'"),
        (["--window", "128", "--window-layers", "-0.25"], "in [0, 1] (0.5 or 12/24), got '-0.25'"),
        (["--window", "128", "--window-layers", "3/0"], "in [0, 1] (0.5 or 12/24), got '3/0'"),
        (["--window", "128", "--window-layers", "half"], "got 'half'"),
        (["--lengths", "4,4", "--cp", "2", "--window-layers", "0.5"], "--window-layers needs --window"),
        (["--distribution", "zipf"], "unknown length distribution 'zipf'"),
        (["--lengths", "1,2,3", "--cp", "4"], "not divisible by cp_size 4"),
        (["--lengths", "1,x"], "comma-separated integers"),
        (["--lengths", "4,4", "--context", "8"], "--context applies to packed windows"),
        (["--lengths-file", "/nonexistent/lens.json"], "cannot read lengths file"),
        (["--strategy", "zigzag"], "invalid choice: 'zigzag'"),
        (["--cp", "0"], "positive integer"),
        (["--mla", "512,64"], "kv_lora_rank,rope,heads,qk_nope,v (five positive integers), got '512,64'"),
        (["--mla", "kimi"], "--mla takes moonlight or deepseek_v3"),
        (["--lengths", "4,4", "--cp", "2", "--target-imbalance", "0.9"], "target_imbalance must be >= 1.0"),
        (["--lengths", "4,4", "--cp", "2", "--strategy", "ilp", "--ilp-time-limit", "0"], "time_limit"),
        *((["--lengths", "4,4", "--cp", "2", option, value], f"expected a finite number, got '{value}'")
          for option in ("--target-imbalance", "--ilp-time-limit") for value in ("inf", "nan", "1e999")),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("python -m flashcp.plan: error:") and message in err


def test_module_entry_point() -> None:
    ok = subprocess.run(
        [sys.executable, "-m", "flashcp.plan", "--lengths", "60,40,20,8", "--cp", "4", "--json"],
        cwd=ROOT, capture_output=True, text=True, check=False,
    )
    assert ok.returncode == 0, ok.stderr
    assert list(json.loads(ok.stdout)) == DEFAULT_STRATEGIES
    bad = subprocess.run(
        [sys.executable, "-m", "flashcp.plan", "--windows", "-3"],
        cwd=ROOT, capture_output=True, text=True, check=False,
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and bad.stderr.count("\n") == 1
