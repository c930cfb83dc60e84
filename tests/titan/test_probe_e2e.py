"""`./run_train.sh --config tiny_extend_cpu --probe.enable true` end to end: the tiny HF Llama imported and
trained at CP = 2 on 2 gloo ranks, probed at step 1 and at the end, the probe's cost stated in the
log, its table printed, its heatmap written as a PNG and logged to TensorBoard with its scalars."""

from __future__ import annotations

import re

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

pytest.importorskip("transformers", reason="the test extra (pip install -e .[test]) provides transformers")

from scripts.make_tiny_hf import make_tiny_hf  # noqa: E402
from titan.test_e2e import run_train  # noqa: E402


def test_tiny_extend_with_the_probe_end_to_end(tmp_path):
    hf = make_tiny_hf(tmp_path / "tiny_hf_llama")
    dump = tmp_path / "out"
    result = run_train("--config", "tiny_extend_cpu", "--probe.enable", "true", "--job.dump_folder", str(dump),
                       "--training.steps", "2", "--probe.freq", "2", "--validation.enable", "false",
                       "--checkpoint.initial_load_path", str(hf), "--checkpoint.last_save_in_hf", "false",
                       "--metrics.disable_color_printing", "true", ngpu=2)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert ("probe: 20 cells (lengths [256, 512, 1024, 2048], depths [0.0, 0.25, 0.5, 0.75, 1.0]) x 2 prompts, "
            "38,912 tokens per run (19 windows), every 2 steps") in result.stdout  # fmt: skip
    for step in (1, 2):
        cost = rf"probe step {step}: accuracy ([\d.]+) over the cells \(38,912 tokens per probe run, [\d.]+ s;"
        line = re.search(cost, result.stdout)
        assert line, result.stdout[-3000:]
        assert (dump / "probe" / f"step-{step}.png").is_file()
    last = result.stdout[result.stdout.index("probe step 2:"):]
    assert re.search(r"depth +256 +512 +1K +2K\n", last)
    rows = re.findall(r"^.*?(\d\.\d\d)((?: +-?\d+\.\d\d){8})$", last, re.M)[:5]  # depth, 4 x (accuracy, log-prob)
    assert [depth for depth, _ in rows] == ["0.00", "0.25", "0.50", "0.75", "1.00"], last[:2000]
    events = EventAccumulator(str(dump / "tb" / "run"), size_guidance={"images": 0})
    events.Reload()
    assert [e.step for e in events.Images("probe/heatmap")] == [1, 2]
    assert {"probe/accuracy", "probe/accuracy/2K", "probe/logprob/256"} <= set(events.Tags()["scalars"])
    logprobs = [e.value for e in events.Scalars("probe/logprob/2K")]
    assert len(logprobs) == 2 and all(-12 < v < 0 for v in logprobs)  # an untrained tiny model: near -ln 4096
