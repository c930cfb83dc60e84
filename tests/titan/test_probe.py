"""`[probe]`: the retrieval probe's prompts, its scores through the CP path on every layout, TensorBoard, bad settings.

The prompts are built the same on every rank and run (seeded), hold the needle at its depth of
held-out text and label only the answer, which is the number inside the needle; windows pack
them as separate documents. Scored on the same weights, CP = 2, TP = 2 and FSDP over 2 ranks give
CP = 1's per-cell log-probabilities (to 1e-5) and accuracies; training with the probe on logs the
heatmap image and the scalars and trains exactly as with it off.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from harness import load_export, single_rank, tiny_job, tiny_seed_checkpoint, train
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from flashcp.data.errors import DataError
from flashcp.titan.components.data import resolve_tokenizer
from flashcp.titan.components.heldout import held_out_data
from flashcp.titan.config import check_layout, ConfigError
from flashcp.titan.launch.job import trainer_config
from flashcp.titan.probe import loop, ProbeResult, ProbeSettings
from flashcp.titan.probe.prompts import build_prompts, haystack_stream, pack
from flashcp.titan.trainer import FlashCPTrainer

ROOT = Path(__file__).resolve().parents[2]
SEQ_LEN = 256  # the tiny job's
PROBE = {"enable": True, "freq": 1, "min_length": 64, "samples": 2, "depths": [0.0, 0.5, 1.0]}
TOLERANCE = 1e-5  # absolute, on per-cell mean log-probabilities of ~ -8.3 in float32


@pytest.fixture(scope="module")
def seed(tmp_path_factory):
    return tiny_seed_checkpoint(tmp_path_factory.mktemp("seed"))


def job(dump: Path, seed: dict | None = None, probe: dict | None = None, **sections: Any) -> dict:
    return tiny_job(dump, checkpoint=seed, probe={**PROBE, **(probe or {})}, validation={"source": "default"},
                    **sections)  # fmt: skip


def probe_here(cfg: dict, layout: dict | None = None) -> ProbeResult:
    """The probe once on the job's initial weights, on the current world; `layout`, when given,
    receives what the trainer actually built (see `built_layout`)."""
    check_layout(cfg, int(os.environ["WORLD_SIZE"]), has_cuda=False)
    trainer = FlashCPTrainer(trainer_config(cfg))
    try:
        trainer.checkpointer.load(step=cfg["checkpoint"]["load_step"])
        if layout is not None:
            layout.update(built_layout(trainer))
        return loop.run(trainer, trainer.probe, 1)
    finally:
        trainer.close()


def built_layout(trainer: FlashCPTrainer) -> dict:
    """The parallel layout this rank really runs the probe on: each parameter's (mesh axis: placement)
    and local shape, the CP group's size, and the window positions of this rank's probe tokens."""
    params = {}
    for name, p in trainer.model_parts[0].named_parameters():
        axes = dict(zip(p.device_mesh.mesh_dim_names, map(str, p.placements))) if isinstance(p, DTensor) else {}
        params[name] = (axes, tuple(p.shape), tuple(p.to_local().shape if isinstance(p, DTensor) else p.shape))
    cp = dist.get_world_size(trainer.cp_group) if trainer.cp_group is not None else 1
    return {"params": params, "cp": cp, "tokens": [d.token_index.tolist() for _, d in trainer.probe.mine]}


def probe_on_pool_rank(rank: int, group: Any, cfg: dict) -> tuple[ProbeResult, dict]:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(dist.get_world_size())})
    layout: dict = {}
    return probe_here(cfg, layout), layout


def assert_sharded(name: str, layouts: list[dict]) -> None:
    """The layout `name` really is applied on both ranks, so that scoring as CP = 1 is not a run on one
    unsharded copy: TP 2 splits every projection over the "tp" axis (Q/K/V, w1, w3 by output rows,
    wo, w2 by input columns) and the vocabulary; FSDP 2 shards every parameter by rows over "fsdp";
    CP 2 has a group of 2 whose ranks hold disjoint token sets that together are each whole window."""
    params = layouts[0]["params"]
    if name == "tp2":
        for key, split in (("wqkv", "S(0)"), ("w1", "S(0)"), ("w3", "S(0)"), ("wo", "S(1)"), ("w2", "S(1)"),
                           ("lm_head", "S(0)")):  # fmt: skip
            found = {n: v for n, v in params.items() if n.split(".")[-2] == key}
            assert found, key
            for n, (axes, full, local) in found.items():
                dim = int(split[2])
                assert axes.get("tp") == split and local[dim] * 2 == full[dim], (n, axes, full, local)
    if name in ("fsdp2", "cp2"):  # FSDP shards over dp_shard x cp
        for n, (axes, full, local) in params.items():
            assert axes == {"fsdp": "S(0)"} and local[0] * 2 == full[0], (n, axes, full, local)
    assert all(lay["cp"] == (2 if name == "cp2" else 1) for lay in layouts)
    if name == "cp2":
        mine, theirs = layouts[0]["tokens"], layouts[1]["tokens"]
        assert len(mine) == len(theirs) > 0
        for a, b in zip(mine, theirs):
            assert a and b and not set(a) & set(b) and sorted(a + b) == list(range(SEQ_LEN))


def settings(cfg: dict) -> ProbeSettings:
    return ProbeSettings(**cfg["probe"], haystack=held_out_data(cfg))


def test_lengths_double_up_to_seq_len():
    assert ProbeSettings(min_length=4096).grid_lengths(131072) == [4096, 8192, 16384, 32768, 65536, 131072]
    assert ProbeSettings(min_length=4096).grid_lengths(2048) == [2048]
    assert ProbeSettings(min_length=300).grid_lengths(1000) == [300, 600, 1000]
    assert ProbeSettings(lengths=[512, 128]).grid_lengths(1024) == [128, 512]


def test_prompts_hide_the_answer_at_its_depth_in_held_out_text(tmp_path):
    cfg = job(tmp_path)
    tok = resolve_tokenizer("default")
    s = settings(cfg)
    stream = haystack_stream(s.haystack, tok, SEQ_LEN)
    assert len(stream) == SEQ_LEN and tok.bos_id not in stream and tok.eos_id not in stream
    prompts = build_prompts(s, SEQ_LEN, tok, stream, tok.bos_id)
    assert len(prompts) == 3 * 3 * 2  # lengths 64, 128, 256 x 3 depths x 2 samples
    again = build_prompts(s, SEQ_LEN, tok, stream, tok.bos_id)  # what another rank or run builds
    assert all((a.tokens == b.tokens).all() and a.answer == b.answer for a, b in zip(prompts, again))
    keys = set()
    for p in prompts:
        length, depth = [64, 128, 256][p.cell[0]], [0.0, 0.5, 1.0][p.cell[1]]
        assert len(p.tokens) == length and p.tokens[0] == tok.bos_id
        text = tok.decode(p.tokens[1:].tolist())
        key = tok.decode(p.tokens[p.answer:].tolist())
        keys.add(key)
        assert key.strip().isdigit() and len(key.strip()) == 5
        assert text.endswith(f"What is the pass key? The pass key is{key}")
        needle = f"The pass key is{key}. Remember it.{key} is the pass key."
        assert needle in text
        # the needle's start, as a fraction of the haystack (prompt minus BOS, needle, question, answer)
        where = text.index(needle) / (len(text) - len(needle) - len(f"\nWhat is the pass key? The pass key is{key}"))
        assert abs(where - depth) < 0.2, (where, depth)
    assert len(keys) > len(prompts) // 2  # keys drawn per prompt


def test_windows_pack_prompts_as_documents_and_label_only_answers(tmp_path):
    tok = resolve_tokenizer("default")
    s = settings(job(tmp_path))
    stream = haystack_stream(s.haystack, tok, SEQ_LEN)
    prompts = build_prompts(s, SEQ_LEN, tok, stream, tok.bos_id)
    windows = pack(prompts, SEQ_LEN, stream, dp_world=4)
    assert len(windows) % 4 == 0
    answers = {p.sample: p.tokens[p.answer:] for p in prompts}
    found = {}
    for w in windows:
        assert len(w.input) == len(w.labels) == len(w.slot) == SEQ_LEN == sum(w.doc_lens)
        labelled = np.flatnonzero(w.labels != -100)
        assert (w.labels[labelled] == w.input[labelled + 1]).all()
        assert (w.slot[w.labels == -100] == len(prompts)).all()
        for sample in set(w.slot[labelled].tolist()):
            found[sample] = w.labels[w.slot == sample]
    assert sorted(found) == sorted(answers)
    assert all((found[k] == answers[k]).all() for k in answers)
    # 6 prompts of 256, 6 of 128 (two per window), 6 of 64 (four per window): 6 + 3 + 2 windows, then to 12
    assert len(windows) == 12


def _worst(a: ProbeResult, b: ProbeResult) -> float:
    assert (a.lengths, a.depths) == (b.lengths, b.depths)
    assert (a.accuracy == b.accuracy).all()
    return float(np.abs(a.logprob - b.logprob).max())


def test_cp2_tp2_and_fsdp2_score_as_cp1(tmp_path, seed, gloo_pool):
    """The same prompts and weights give the same per-cell log-probabilities and accuracies on every layout.

    The layouts are checked to be really built (`assert_sharded`). Measured 0.0 on every cell, also
    for TP 2, whose row-parallel sums change 2.5% of the float32 logits by one ulp: the log-probs of
    ~-8.3 round to steps of 9.5e-7, so only ~0.2% of them move, and here no answer token's does."""
    with single_rank():
        reference = probe_here(job(tmp_path / "cp1", seed, loss={"chunk_tokens": 0}))
    assert reference.logprob.shape == (3, 3) and np.isfinite(reference.logprob).all()
    assert reference.tokens == 11 * SEQ_LEN  # the windows of test_windows_pack_prompts_as_documents...
    assert len(set(reference.logprob.flatten().tolist())) == 9  # every cell its own figure
    cases = {
        "cp2": job(tmp_path / "cp2", seed, parallelism={"context_parallel_degree": 2}, loss={"chunk_tokens": 64}),
        "tp2": job(tmp_path / "tp2", seed, parallelism={"tensor_parallel_degree": 2}, loss={"chunk_tokens": 64}),
        "fsdp2": job(tmp_path / "fsdp2", seed, parallelism={"data_parallel_shard_degree": 2}),
    }
    pool = gloo_pool(2)
    for name, cfg in cases.items():
        (ours, layout), (other_rank, other_layout) = pool.run(probe_on_pool_rank, (cfg,))
        assert_sharded(name, [layout, other_layout])
        assert _worst(ours, other_rank) == 0.0  # summed over the ranks
        worst = _worst(ours, reference)
        print(f"{name}: max |per-cell answer log-prob - CP = 1| = {worst:.2e} (CP = 1: {reference.logprob.min():.6f}"
              f" .. {reference.logprob.max():.6f})")
        assert worst <= TOLERANCE, (name, ours, reference)
        assert ours.tokens == (12 if name == "fsdp2" else 11) * SEQ_LEN  # FSDP: windows even over 2 ranks


def test_training_logs_the_heatmap_and_trains_as_without_the_probe(tmp_path, seed):
    norms_on: dict[int, float] = {}
    norms_off: dict[int, float] = {}
    sections = {"training": {"steps": 2}, "metrics": {"enable_tensorboard": True, "log_freq": 1}}
    with single_rank():
        losses_on = train(job(tmp_path / "on", seed, **sections), grad_norms=norms_on)
    with single_rank():
        losses_off = train(job(tmp_path / "off", seed, {"enable": False}, **sections), grad_norms=norms_off)
    assert losses_on == losses_off and norms_on == norms_off  # no gradient, no state
    assert sorted(p.name for p in (tmp_path / "on" / "probe").iterdir()) == ["step-1.png", "step-2.png"]
    assert not (tmp_path / "off" / "probe").exists()
    events = EventAccumulator(str(tmp_path / "on" / "tb" / "run"), size_guidance={"images": 0})
    events.Reload()
    assert [e.step for e in events.Images("probe/heatmap")] == [1, 2]
    scalars = set(events.Tags()["scalars"])
    assert {"probe/accuracy", "probe/accuracy/64", "probe/logprob/256"} <= scalars, scalars
    logged = [e.value for e in events.Scalars("probe/logprob/64")]
    assert len(logged) == 2 and all(-20 < v < 0 for v in logged)


@pytest.mark.parametrize(
    "section, message",
    [
        ({"freq": 0}, "[probe] freq must be >= 1, got 0"),
        ({"samples": 0}, "[probe] samples must be >= 1, got 0"),
        ({"lengths": [64, 512]}, "[probe] lengths must be in [1, seq_len = 256] (each prompt fits a window), got 512"),
        ({"lengths": [64, 64]}, "[probe] lengths must differ from each other, got [64, 64]"),
        ({"depths": [0.5, 1.5]}, "[probe] depths must be distinct fractions in [0, 1]"),
        ({"depths": []}, "[probe] depths must be distinct fractions in [0, 1]"),
        ({"key_digits": 40}, "[probe] key_digits must be <= 18, got 40"),
        ({"lengths": "64"}, "[probe] lengths must be a list of integers, got '64' (str)"),
        ({"depht": [0.5]}, "unknown key [probe] depht; allowed keys: enable, freq, lengths, min_length, depths"),
    ],
)
def test_bad_probe_settings_are_one_line(tmp_path, section, message):
    with pytest.raises(ConfigError) as info:
        tiny_job(tmp_path, probe=section)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_the_probe_needs_held_out_text_and_flashcp_attention(tmp_path):
    with pytest.raises(ConfigError, match=r"\[probe\] enable = true needs \[validation\] source"):
        tiny_job(tmp_path, probe={"enable": True})
    with pytest.raises(ConfigError, match=r"\[probe\] enable = true needs model.attention = 'flashcp'"):
        tiny_job(tmp_path, probe={"enable": True}, validation={"source": "default"}, model={"attention": "flex"},
                 flashcp=None)  # fmt: skip
    tiny_job(tmp_path, probe={"lengths": [64]})  # off: nothing needed


def test_a_length_too_short_for_the_needle_is_one_line(tmp_path):
    tok = resolve_tokenizer("default")
    s = dataclasses.replace(settings(job(tmp_path)), lengths=[16])
    with pytest.raises(DataError, match=r"\[probe\] a prompt of 16 tokens cannot hold the needle, question and answer"):
        build_prompts(s, SEQ_LEN, tok, haystack_stream(s.haystack, tok, 16), tok.bos_id)


TINY_JOB_TOML = """
[model]
flavor = "custom"
dim = 32
n_layers = 2
n_heads = 4
n_kv_heads = 2
multiple_of = 32
[data]
prefetch = 0
[training]
seq_len = 256
steps = 1
mixed_precision_param = "float32"
[lr_scheduler]
warmup_steps = 1
[parallelism]
data_parallel_shard_degree = 1
context_parallel_degree = 2
[flashcp]
backend = "reference"
[activation_checkpoint]
mode = "none"
[validation]
source = "default"
[probe]
min_length = 64
samples = 2
depths = [0.0, 0.5, 1.0]
"""


def cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("WORLD_SIZE", None)
    return subprocess.run([sys.executable, "-m", "flashcp.titan.probe", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip


def _bad_weights(tmp_path: Path, seed: dict, case: str) -> list[str]:
    """The probe's arguments for one bad weights folder, made from the seed checkpoint."""
    source = Path(seed["initial_load_path"])
    names = {"unfinished": "step-0.partial-0123456789ab", "not a checkpoint folder": "my-model"}
    folder = tmp_path / names.get(case, "step-0")
    if case.startswith("hf"):
        from flashcp.titan.hf.export import export

        export(source, folder)
        load_export(folder)  # a sound export, then broken
        weights = folder / "model.safetensors"
        weights.unlink() if case == "hf without weights" else weights.write_bytes(b"\x00" * 4096)
        return ["--hf", str(folder)]
    if case == "not a checkpoint":
        folder.mkdir()
        (folder / "notes.txt").write_text("not a checkpoint")
        return ["--checkpoint", str(folder)]
    shutil.copytree(source, folder)
    data = sorted(folder.glob("*.distcp"))[0]
    if case == "damaged":
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))
    elif case == "missing file":
        data.unlink()
    elif case == "no manifest":
        (folder / "manifest.json").unlink()
    return ["--checkpoint", str(folder)]


@pytest.mark.parametrize("case, named", [
    ("damaged", "is damaged: __0_0.distcp: contents changed since the save"),
    ("missing file", "is damaged: __0_0.distcp: missing"),
    ("no manifest", "is not a complete FlashCP checkpoint (no manifest.json)"),
    ("not a checkpoint", "is not a complete FlashCP checkpoint (no .metadata)"),
    ("not a checkpoint folder", "my-model is not a published checkpoint folder (step-N"),
    ("unfinished", "step-0.partial-0123456789ab is an unfinished save (never published)"),
    ("hf without weights", "no model.safetensors or model.safetensors.index.json"),
    ("hf with garbage weights", "model.safetensors: unreadable safetensors header"),
])  # fmt: skip
def test_cli_refuses_bad_weights_before_any_rank_starts(tmp_path, seed, capsys, monkeypatch, case, named):
    """Each bad folder is one `error:` line and exit 2 from the launching process itself: no rank ran."""
    from flashcp.titan.probe.cli import main

    args = _bad_weights(tmp_path, seed, case)
    (tmp_path / "job.toml").write_text(TINY_JOB_TOML)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail(f"ranks started for {case}"))
    capsys.readouterr()
    assert main([*args, "--config", "job.toml"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and named in err, err


def test_cli_starts_the_ranks_on_a_checkpoint_without_manifest_only_with_load_unverified(tmp_path, seed, capsys,
                                                                                         monkeypatch):  # fmt: skip
    from flashcp.titan.probe.cli import main

    args = _bad_weights(tmp_path, seed, "no manifest")
    (tmp_path / "job.toml").write_text(TINY_JOB_TOML)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    started = []
    monkeypatch.setattr(subprocess, "run", lambda command: started.append(command) or subprocess.CompletedProcess(
        command, 0))  # fmt: skip
    assert main([*args, "--config", "job.toml"]) == 2 and not started
    assert main([*args, "--config", "job.toml", "--checkpoint.load_unverified", "true"]) == 0 and len(started) == 1


@pytest.mark.slow
def test_cli_probes_a_checkpoint_on_the_jobs_layout_as_training_does(tmp_path, seed, capsys, monkeypatch):
    """`python -m flashcp.titan.probe --checkpoint` on the seed checkpoint, CP = 2 through torchrun, gives
    the probe of training at CP = 1 on the same weights; bad folders are one line, exit 2."""
    with single_rank():
        reference = probe_here(job(tmp_path / "ref", seed))
    (tmp_path / "job.toml").write_text(TINY_JOB_TOML)
    out = tmp_path / "out"
    done = cli(tmp_path, "--checkpoint", seed["initial_load_path"], "--config", "job.toml", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    print(done.stdout)
    assert "tokens); accuracy / log-prob of an answer token by depth and length:" in done.stdout
    record = json.loads((out / "probe.json").read_text())
    assert record["lengths"] == [64, 128, 256] and record["depths"] == [0.0, 0.5, 1.0]
    assert record["tokens"] == reference.tokens
    assert np.abs(np.array(record["logprob"]) - reference.logprob).max() <= TOLERANCE
    assert (np.array(record["accuracy"]) == reference.accuracy).all()
    assert (out / "probe" / f"step-{record['step']}.png").is_file()

    # Refused before any rank starts: the same `main`, called here.
    from flashcp.titan.probe.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    capsys.readouterr()
    assert main(["--checkpoint", str(tmp_path / "nowhere"), "--config", "job.toml"]) == 2
    assert capsys.readouterr().err == f"error: --checkpoint {tmp_path / 'nowhere'}: no such folder\n"
    assert main(["--hf", seed["initial_load_path"], "--config", "job.toml"]) == 2
    assert capsys.readouterr().err == (
        f"error: --hf {seed['initial_load_path']}: no config.json, not a Hugging Face model folder\n")


def test_a_mixture_of_experts_is_probed_without_touching_its_routing(tmp_path):
    """A tiny Qwen3-MoE: the probe's forward (eval mode) adds nothing to the routers' token counts, so
    the aux-loss-free bias update and the losses are those of the run without the probe."""
    moe = {"model": {"name": "qwen3", "num_experts": 4, "num_experts_per_tok": 2, "moe_hidden_dim": 32},
           "training": {"steps": 2}}  # fmt: skip
    biases_on: list[torch.Tensor] = []
    biases_off: list[torch.Tensor] = []
    with single_rank():
        losses_on = train(job(tmp_path / "on", **moe), expert_biases=biases_on)
    with single_rank():
        losses_off = train(job(tmp_path / "off", None, {"enable": False}, **moe), expert_biases=biases_off)
    assert sorted(p.name for p in (tmp_path / "on" / "probe").iterdir()) == ["step-1.png", "step-2.png"]
    assert losses_on == losses_off and biases_on and all(b.abs().sum() > 0 for b in biases_on)
    assert all(torch.equal(a, b) for a, b in zip(biases_on, biases_off, strict=True))
