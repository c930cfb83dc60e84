"""The tiny CPU example of extending a model's context (train_configs/tiny_extend_cpu.toml), end to end
through run_train.sh: a Hugging Face Llama created locally is imported, trained at 4x its context
with the RoPE base raised under FlashCP CP=2, validated by position, exported at the end
(last_save_in_hf), and the export loads in transformers with its tokenizer and the RoPE settings
trained.

The same launch runs the retrieval probe (`--probe.enable true`, docs/probe.md): probed at step 1
and at the end, the probe's cost stated in the log, its table printed, its heatmap written as a PNG
and logged to TensorBoard with its scalars. One launch checks both: each costs a minute of CPU,
most of it start-up."""

from __future__ import annotations

import json
import re

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

pytest.importorskip("transformers", reason="the test extra (pip install -e .[test]) provides transformers")
import transformers  # noqa: E402

from scripts.make_tiny_hf import make_tiny_hf  # noqa: E402
from titan.harness import load_export  # noqa: E402
from titan.test_e2e import run_train  # noqa: E402

STEPS = 4


@pytest.mark.slow
def test_tiny_extend_example_end_to_end(tmp_path):
    hf = make_tiny_hf(tmp_path / "tiny_hf_llama")
    dump = tmp_path / "out"
    result = run_train("--config", "tiny_extend_cpu", "--job.dump_folder", str(dump), "--training.steps", str(STEPS),
                       "--checkpoint.initial_load_path", str(hf), "--metrics.log_freq", "1",
                       "--probe.enable", "true", "--probe.freq", str(STEPS),
                       "--metrics.disable_color_printing", "true", ngpu=2)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "2 CPU (gloo) rank(s)" in result.stdout and f"step: {STEPS}/{STEPS}" in result.stdout
    # Imported, not random: the first loss is the HF model's (random weights: about ln 4096 = 8.3).
    losses = [float(x) for x in re.findall(r"step: +\d+/\d+ +loss: +([\d.]+)", result.stdout)]
    assert len(losses) == STEPS and abs(losses[0] - 8.32) < 0.1 and losses[-1] < losses[0]
    validation = re.search(r"validation step 1: loss ([\d.]+) .*by position (.*)", result.stdout)
    assert validation and "1K-2K" in validation.group(2)  # held-out loss by position, past the old context

    out = dump / "checkpoint" / f"step-{STEPS}-hf"
    config = json.loads((out / "config.json").read_text())
    assert config["rope_theta"] == 100000.0 and config["max_position_embeddings"] == 2048
    model = load_export(out)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    ids = tokenizer("It was the best of times", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()
    original = transformers.AutoModelForCausalLM.from_pretrained(hf).state_dict()
    assert all((v - original[k]).abs().max() > 0 for k, v in model.state_dict().items())

    # The probe, at step 1 (the model as imported) and at the last step.
    assert ("probe: 20 cells (lengths [256, 512, 1024, 2048], depths [0.0, 0.25, 0.5, 0.75, 1.0]) x 2 prompts, "
            f"38,912 tokens per run (19 windows), every {STEPS} steps") in result.stdout  # fmt: skip
    for step in (1, STEPS):
        cost = rf"probe step {step}: accuracy ([\d.]+) over the cells \(38,912 tokens per probe run, [\d.]+ s;"
        line = re.search(cost, result.stdout)
        assert line, result.stdout[-3000:]
        assert (dump / "probe" / f"step-{step}.png").is_file()
    last = result.stdout[result.stdout.index(f"probe step {STEPS}:"):]
    assert re.search(r"depth +256 +512 +1K +2K\n", last)
    rows = re.findall(r"^.*?(\d\.\d\d)((?: +-?\d+\.\d\d){8})$", last, re.M)[:5]  # depth, 4 x (accuracy, log-prob)
    assert [depth for depth, _ in rows] == ["0.00", "0.25", "0.50", "0.75", "1.00"], last[:2000]
    events = EventAccumulator(str(dump / "tb" / "run"), size_guidance={"images": 0})
    events.Reload()
    assert [e.step for e in events.Images("probe/heatmap")] == [1, STEPS]
    assert {"probe/accuracy", "probe/accuracy/2K", "probe/logprob/256"} <= set(events.Tags()["scalars"])
    logprobs = [e.value for e in events.Scalars("probe/logprob/2K")]
    assert len(logprobs) == 2 and all(-12 < v < 0 for v in logprobs)  # barely trained: near -ln 4096
