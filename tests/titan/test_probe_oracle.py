"""Oracle: transformers run on each probe prompt alone gives the probe's per-cell figures.

A tiny random Hugging Face Llama (vocabulary 4096, the shipped tokenizer's) is saved with
`save_pretrained` and imported as a job imports one (`initial_load_in_hf`). The probe runs on it
through FlashCP's path at CP = 2, its prompts packed several to a window; transformers runs each
prompt alone from position 0 (eager attention, fp32). Per (length, depth) cell the mean answer-token
log-probability must agree to RELATIVE_TOLERANCE and the accuracy exactly. The same folder probed
by `python -m flashcp.titan.probe --hf` (torchrun, 2 ranks) gives the same figures.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from harness import TINY

import flashcp.titan  # noqa: F401  (TorchTitan shims before transformers / torchtitan)
from flashcp.titan.components.data import resolve_tokenizer
from flashcp.titan.components.heldout import held_out_data
from flashcp.titan.config import check_layout, validate
from flashcp.titan.launch.job import trainer_config
from flashcp.titan.probe import loop, ProbeResult, ProbeSettings
from flashcp.titan.probe.prompts import build_prompts, haystack_stream
from flashcp.titan.trainer import FlashCPTrainer

transformers = pytest.importorskip("transformers", reason="the oracle needs the test extra (transformers)")

ROOT = Path(__file__).resolve().parents[2]
RELATIVE_TOLERANCE = 1e-4  # max |ours - HF| / max |HF| over the cells' mean answer log-probabilities
SEQ_LEN = 256
PROBE = {"enable": True, "lengths": [64, 128, 256], "depths": [0.0, 0.5, 1.0], "samples": 2}
HF = {"vocab_size": 4096, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": SEQ_LEN,
      "initializer_range": 0.2, "rms_norm_eps": 1e-5,
      "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}  # fmt: skip


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny_hf")
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF))
    model.float().save_pretrained(folder)
    return folder


def hf_job(dump: Path, folder: Path, cp: int = 2) -> dict:
    raw = copy.deepcopy(TINY)
    raw.pop("model")  # the architecture is the folder's (initial_load_in_hf)
    raw["training"]["seq_len"] = SEQ_LEN
    raw |= {"job": {"dump_folder": str(dump)}, "probe": PROBE, "validation": {"source": "default"},
            "checkpoint": {"enable": True, "initial_load_path": str(folder), "initial_load_in_hf": True},
            "loss": {"chunk_tokens": 64}}  # fmt: skip
    raw["parallelism"] = {"data_parallel_shard_degree": 1, "context_parallel_degree": cp}
    return validate(raw)


def probe_on_pool_rank(rank: int, group: Any, cfg: dict) -> ProbeResult:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(dist.get_world_size())})
    check_layout(cfg, 2, has_cuda=False)
    trainer = FlashCPTrainer(trainer_config(cfg))
    try:
        trainer.checkpointer.load(step=-1)
        return loop.run(trainer, trainer.probe, 1)
    finally:
        trainer.close()


@torch.no_grad()
def transformers_cells(folder: Path, cfg: dict) -> tuple[np.ndarray, np.ndarray]:
    """Each prompt alone through transformers; per cell the mean answer log-prob and the accuracy."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").float().eval()
    settings = ProbeSettings(**cfg["probe"], haystack=held_out_data(cfg))
    tok = resolve_tokenizer("default")
    stream = haystack_stream(settings.haystack, tok, max(settings.grid_lengths(SEQ_LEN)))
    shape = (3, 3)
    sums, counts, right, prompts = (np.zeros(shape) for _ in range(4))
    for p in build_prompts(settings, SEQ_LEN, tok, stream, tok.bos_id):
        tokens = torch.from_numpy(p.tokens)
        logp = torch.log_softmax(model(input_ids=tokens[None]).logits[0].double(), dim=-1)
        at = torch.arange(p.answer, len(tokens))
        sums[p.cell] += float(logp[at - 1, tokens[at]].sum())
        counts[p.cell] += len(at)
        right[p.cell] += bool((logp[at - 1].argmax(-1) == tokens[at]).all())
        prompts[p.cell] += 1
    return sums / counts, right / prompts


@pytest.mark.slow
def test_probe_matches_transformers_on_each_prompt_alone(tmp_path, hf_folder, gloo_pool):
    cfg = hf_job(tmp_path / "cp2", hf_folder)
    pool = gloo_pool(2)
    ours, _ = pool.run(probe_on_pool_rank, (cfg,))
    logprob, accuracy = transformers_cells(hf_folder, cfg)
    assert len(set(np.round(logprob, 4).flatten().tolist())) > 1  # a model whose answers differ by cell
    relative = float(np.abs(ours.logprob - logprob).max() / np.abs(logprob).max())
    print(f"probe (CP = 2) vs transformers per prompt: max relative difference of the cells' answer log-prob "
          f"{relative:.2e}; log-probs {logprob.min():.3f} .. {logprob.max():.3f}")  # fmt: skip
    assert relative <= RELATIVE_TOLERANCE, (ours.logprob, logprob)
    assert (ours.accuracy == accuracy).all()

    job_file = tmp_path / "job.toml"
    job_file.write_text(f'[training]\nseq_len = {SEQ_LEN}\nsteps = 1\nmixed_precision_param = "float32"\n'
                        '[lr_scheduler]\nwarmup_steps = 1\n'
                        '[parallelism]\ndata_parallel_shard_degree = 1\ncontext_parallel_degree = 2\n'
                        '[flashcp]\nbackend = "reference"\n[validation]\nsource = "default"\n'
                        '[activation_checkpoint]\nmode = "none"\n'
                        '[probe]\nlengths = [64, 128, 256]\ndepths = [0.0, 0.5, 1.0]\nsamples = 2\n')  # fmt: skip
    out = tmp_path / "cli"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("WORLD_SIZE", None)
    done = subprocess.run([sys.executable, "-m", "flashcp.titan.probe", "--hf", str(hf_folder), "--config",
                           str(job_file), "--out", str(out)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "probe of" in done.stdout and "depth" in done.stdout
    record = json.loads((out / "probe.json").read_text())
    assert record["lengths"] == [64, 128, 256] and record["step"] == 0
    cli = np.array(record["logprob"])
    assert float(np.abs(cli - logprob).max() / np.abs(logprob).max()) <= RELATIVE_TOLERANCE
    assert (np.array(record["accuracy"]) == accuracy).all()
    assert (out / "probe" / "step-0.png").is_file()
