"""The tiny CPU example of extending a model's context (train_configs/tiny_extend_cpu.toml), end to end
through run_train.sh: a Hugging Face Llama created locally is imported, trained at 4x its context
with the RoPE base raised under FlashCP CP=2, validated by position, exported at the end
(last_save_in_hf), and the export loads in transformers with its tokenizer and the RoPE settings
trained."""

from __future__ import annotations

import json
import re

import pytest
import torch

pytest.importorskip("transformers", reason="the test extra (pip install -e .[test]) provides transformers")
import transformers  # noqa: E402

from scripts.make_tiny_hf import make_tiny_hf  # noqa: E402
from titan.test_e2e import run_train  # noqa: E402


def test_tiny_extend_example_end_to_end(tmp_path):
    hf = make_tiny_hf(tmp_path / "tiny_hf_llama")
    dump = tmp_path / "out"
    result = run_train("--config", "tiny_extend_cpu", "--job.dump_folder", str(dump), "--training.steps", "4",
                       "--checkpoint.initial_load_path", str(hf), "--metrics.log_freq", "1",
                       "--metrics.disable_color_printing", "true", ngpu=2)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "2 CPU (gloo) rank(s)" in result.stdout and "step: 4/4" in result.stdout
    # Imported, not random: the first loss is the HF model's (random weights: about ln 4096 = 8.3).
    losses = [float(x) for x in re.findall(r"step: +\d+/\d+ +loss: +([\d.]+)", result.stdout)]
    assert len(losses) == 4 and abs(losses[0] - 8.32) < 0.1 and losses[-1] < losses[0]
    validation = re.search(r"validation step 1: loss ([\d.]+) .*by position (.*)", result.stdout)
    assert validation and "1K-2K" in validation.group(2)  # held-out loss by position, past the old context

    out = dump / "checkpoint" / "step-4-hf"
    config = json.loads((out / "config.json").read_text())
    assert config["rope_theta"] == 100000.0 and config["max_position_embeddings"] == 2048
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    ids = tokenizer("It was the best of times", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()
    original = transformers.AutoModelForCausalLM.from_pretrained(hf).state_dict()
    assert all((v - original[k]).abs().max() > 0 for k, v in model.state_dict().items())
