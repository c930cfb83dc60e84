"""`[validation]`: the held-out loss and the loss by position in the document, through FlashCP's path.

Every validation reads the held-out windows planned for the CP group, dispatched per rank and run
with the document mask (the trainer's own input path) in eval mode without gradients. Checked:
CP = 2, TP = 2 and FSDP over 2 ranks give CP = 1's validation (loss and every bucket) on the same
weights, and TorchTitan's flex path gives FlashCP's; the figures are TorchTitan's loss function's,
from one output projection per slice of tokens; the buckets partition the labelled tokens by
their position inside the document; every validation reads the same windows; training is the same
with validation on and off; TensorBoard gets the scalars; bad settings fail before launch with one
line.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import single_rank, tiny_job, tiny_seed_checkpoint, train, train_on_pool_rank
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from torchtitan.models.common import attention as titan_attention

from flashcp.data.errors import DataError
from flashcp.data.loader import build_loader
from flashcp.titan import config
from flashcp.titan.config import ConfigError
from flashcp.titan.components.heldout import held_out_data
from flashcp.titan.launch.job import trainer_config
from flashcp.titan.launch.preflight import check_inputs
from flashcp.titan.trainer import document_positions, FlashCPTrainer
from flashcp.titan.components.validate import bucket_edges, bucket_name, ValidationResult

STEPS = 2
SEQ_LEN = 256  # the tiny job's
VALIDATION = {"enable": True, "source": "default", "freq": 1, "steps": 2, "bucket_min": 32}
TOLERANCE = 1e-5  # absolute, on held-out losses of ~8.8 in float32


@pytest.fixture(scope="module")
def seed(tmp_path_factory):
    return tiny_seed_checkpoint(tmp_path_factory.mktemp("seed"))


def job(dump: Path, seed: dict, validation: dict | None = None, **sections: Any) -> dict:
    return tiny_job(dump, checkpoint=seed, training={"steps": STEPS, **sections.pop("training", {})},
                    validation={**VALIDATION, **(validation or {})}, **sections)  # fmt: skip


Run = tuple[dict[int, float], list[ValidationResult]]  # training losses by step, validations


def run(cfg: dict, grad_norms: dict[int, float] | None = None) -> Run:
    results: list[ValidationResult] = []
    with single_rank():
        losses = train(cfg, grad_norms=grad_norms, validations=results)
    return losses, results


def validate_on_pool_rank(rank: int, group: Any, cfg: dict) -> Run:
    results: list[ValidationResult] = []
    return train_on_pool_rank(rank, group, cfg, validations=results), results


def _worst(a: list[ValidationResult], b: list[ValidationResult]) -> float:
    """Largest difference of the mean loss or a bucket's mean loss; the token counts must be equal."""
    assert [r.step for r in a] == [r.step for r in b] and a
    worst = 0.0
    for x, y in zip(a, b):
        assert (x.tokens, x.counts, x.edges) == (y.tokens, y.counts, y.edges)
        bx, by = x.by_position(), y.by_position()
        worst = max(worst, abs(x.loss - y.loss), *(abs(bx[k] - by[k]) for k in by))
    return worst


def test_bucket_edges_double_from_bucket_min_up_to_the_context():
    assert bucket_edges(256, 32) == [0, 32, 64, 128, 256]
    assert bucket_edges(3000, 1024) == [0, 1024, 2048, 3000]  # the last bucket ends at the context
    assert bucket_edges(512, 1024) == [0, 512]
    edges = bucket_edges(128 * 1024, 1024)
    names = [bucket_name(lo, hi) for lo, hi in zip(edges, edges[1:])]
    assert names == ["0-1K", "1K-2K", "2K-4K", "4K-8K", "8K-16K", "16K-32K", "32K-64K", "64K-128K"]
    assert bucket_name(512 * 1024, 1 << 20) == "512K-1M"
    assert bucket_name(2048, 3000) == "2K-3000"


def test_cp2_tp2_and_fsdp2_validate_as_cp1(tmp_path, seed, gloo_pool):
    """The same held-out windows and weights give the same loss and buckets on every layout.

    Each job trains one step of two windows (two micro steps, or one on each of FSDP's two data-
    parallel ranks, balanced alike), then validates 4 held-out windows (FSDP: 2 on each rank). The
    reference's loss is whole; the others' chunked (TorchTitan's wrapper, FSDP's unshard of lm_head)."""
    def layout(name: str, windows: int = 4, chunk_tokens: int = 64, **sections: Any) -> dict:
        return job(tmp_path / name, seed, {"steps": windows}, training={"steps": 1, "global_batch_size": 2},
                   data={"balance": "mesh", "prefetch": 0}, loss={"chunk_tokens": chunk_tokens},
                   **sections)  # fmt: skip

    reference = run(layout("cp1", chunk_tokens=0))[1]
    assert [(r.step, r.windows) for r in reference] == [(1, 4)]
    cases = {  # CP = 2; TP = 2 with selective AC; FSDP 2 with full AC
        "cp2": layout("cp2", parallelism={"context_parallel_degree": 2}),
        "tp2 selective AC": layout(
            "tp2", parallelism={"tensor_parallel_degree": 2}, activation_checkpoint={"mode": "selective"}
        ),
        "fsdp2 full AC": layout(
            "fsdp2", 2, parallelism={"data_parallel_shard_degree": 2}, activation_checkpoint={"mode": "full"}
        ),
    }
    pool = gloo_pool(2)
    for name, cfg in cases.items():
        (_, results), (_, other_rank) = pool.run(validate_on_pool_rank, (cfg,))
        assert [r.loss for r in results] == [r.loss for r in other_rank]  # summed over the ranks
        worst = _worst(results, reference)
        print(f"{name}: max |validation loss - CP = 1| over the loss and its buckets = {worst:.1e}")
        assert worst <= TOLERANCE, (name, results, reference)


def test_buckets_partition_the_labelled_tokens_by_position_and_training_is_unchanged(tmp_path, seed):
    norms_on: dict[int, float] = {}
    norms_off: dict[int, float] = {}
    cfg = job(tmp_path / "on", seed, metrics={"enable_tensorboard": True})
    losses_on, results = run(cfg, norms_on)
    losses_off, none = run(job(tmp_path / "off", seed, {"enable": False}), norms_off)
    assert none == []
    assert losses_on == losses_off and norms_on == norms_off  # bit for bit: no gradient, no state
    assert [r.step for r in results] == [1, 2]

    # The labelled tokens of the first `steps` held-out windows, by position inside their document.
    loader = build_loader(held_out_data(cfg), SEQ_LEN)
    counts = torch.zeros(len(results[0].edges) - 1, dtype=torch.int64)
    for _, batch in zip(range(VALIDATION["steps"]), loader):
        positions = document_positions(batch["doc_lens"])[batch["labels"] != -100]
        bucket = torch.bucketize(positions, torch.tensor([32, 64, 128]), right=True)
        counts += torch.bincount(bucket, minlength=4)
    loader.close()
    for r in results:
        assert r.edges == [0, 32, 64, 128, 256] and r.windows == VALIDATION["steps"]
        assert r.counts == counts.tolist() and r.tokens == sum(r.counts)
        # The buckets' token-weighted mean is the mean loss (their sums, not their means, are added).
        assert sum(r.sums) / sum(r.counts) == pytest.approx(r.loss, rel=1e-6)
    assert results[1].loss < results[0].loss  # a step of training lowered the held-out loss

    events = EventAccumulator(str(tmp_path / "on" / "tb" / "run"))
    events.Reload()
    tags = events.Tags()["scalars"]
    by_position = [f"validation/loss_by_position/{name}" for name in ("0-32", "32-64", "64-128", "128-256")]
    assert {"validation/loss", *by_position} <= set(tags), tags
    logged = [(e.step, e.value) for e in events.Scalars("validation/loss")]
    assert [s for s, _ in logged] == [1, 2]
    assert [v for _, v in logged] == pytest.approx([r.loss for r in results], rel=1e-6)
    logged = [e.value for e in events.Scalars(by_position[-1])]
    assert logged == pytest.approx([r.by_position()["128-256"] for r in results], rel=1e-6)


def test_every_validation_reads_the_same_held_out_windows(tmp_path, seed):
    """With a learning rate too small to change a float32 weight, validations must agree bit for bit
    (a loader that went on to later windows would not), while training reads new windows."""
    losses, results = run(job(tmp_path / "still", seed, training={"steps": 3}, optimizer={"lr": 1e-30}))
    assert len(set(losses.values())) == 3  # every training step read another window
    assert len(results) == 3
    first = results[0]
    assert all((r.loss, r.sums, r.counts) == (first.loss, first.sums, first.counts) for r in results)


def validate_once(cfg: dict) -> ValidationResult:
    """One validation of the job's initial (seed) weights, without training."""
    results: list[ValidationResult] = []
    with single_rank():
        trainer = FlashCPTrainer(trainer_config(cfg))
        try:
            assert trainer.validator.flashcp == (cfg["model"]["attention"] == "flashcp")
            trainer.checkpointer.load(step=cfg["checkpoint"]["load_step"])
            trainer.validator.log = results.append
            trainer.validator.validate(trainer.model_parts, 1)
        finally:
            trainer.close()
    return results[0]


@dataclasses.dataclass
class Instrumented:
    """One validation of the seed weights, its lm_head calls, and the same windows the old way."""

    chunk_tokens: int
    result: ValidationResult
    lm_head_calls: int
    old_sums: list[float]  # TorchTitan's loss function on [all labels, each bucket's labels], summed
    old_counts: list[int]


@pytest.fixture(scope="module", params=[64, 0], ids=["chunked", "whole"])
def instrumented(request, tmp_path_factory, seed) -> Instrumented:
    """Validates 2 windows with `[loss] chunk_tokens` = 64 (4 slices of the 256 tokens) or 0, counting
    lm_head's forward calls; then applies TorchTitan's loss function to the model's output on each
    window once for all labels and once per bucket (labels outside it masked), as validation did."""
    cfg = job(tmp_path_factory.mktemp("instrumented"), seed, loss={"chunk_tokens": request.param})
    results: list[ValidationResult] = []
    windows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (model output, labels, positions)
    with single_rank():
        trainer = FlashCPTrainer(trainer_config(cfg))
        try:
            trainer.checkpointer.load(step=cfg["checkpoint"]["load_step"])
            model, validator = trainer.model_parts[0], trainer.validator
            calls: list[None] = []
            model.lm_head.register_forward_hook(lambda *_: calls.append(None))
            inputs_of = validator.post_dataloading_process
            labelled: list[tuple[torch.Tensor, torch.Tensor]] = []

            def keep_labels(*args: Any) -> Any:
                inputs, labels, extra = inputs_of(*args)
                labelled.append((labels, extra["positions"]))
                return inputs, labels, extra

            validator.post_dataloading_process = keep_labels
            outputs: list[torch.Tensor] = []
            model.register_forward_hook(lambda _m, _i, out: outputs.append(out))
            validator.log = results.append
            validator.validate(trainer.model_parts, 1)
            lm_head_calls = len(calls)
            windows = [(out, labels, positions) for out, (labels, positions) in zip(outputs, labelled)]
            assert len(windows) == VALIDATION["steps"]
            edges = torch.tensor(results[0].edges[1:-1])
            old_sums, old_counts = [0.0] * 5, [0] * 5
            with torch.no_grad():
                for out, labels, positions in windows:
                    bucket = torch.bucketize(positions, edges, right=True)
                    valid = labels != -100
                    masks = [valid] + [valid & (bucket == b) for b in range(4)]
                    for i, m in enumerate(masks):
                        old_sums[i] += float(trainer.loss_fn(out, torch.where(m, labels, -100))[0])
                        old_counts[i] += int(m.sum())
        finally:
            trainer.close()
    return Instrumented(request.param, results[0], lm_head_calls, old_sums, old_counts)


def test_validation_projects_each_token_once(instrumented):
    """One output projection per window and slice of tokens: 4 slices of 64 tokens, or the model's own
    call when the loss is whole (projecting per bucket as well made it 4 x (1 + 4) per window)."""
    per_window = {64: 4, 0: 1}[instrumented.chunk_tokens]
    assert instrumented.lm_head_calls == VALIDATION["steps"] * per_window


def test_validation_loss_is_torchtitans_loss_function(instrumented):
    """The mean and every bucket are TorchTitan's loss function on the same windows (labels outside
    a bucket masked), to float rounding: the one pass changes the cost, not the figures."""
    result, sums, counts = instrumented.result, instrumented.old_sums, instrumented.old_counts
    assert [result.tokens, *result.counts] == counts and all(counts)
    assert result.loss == pytest.approx(sums[0] / counts[0], rel=1e-6)
    assert result.sums == pytest.approx(sums[1:], rel=1e-6)


def test_steps_minus_one_reads_the_whole_held_out_data(tmp_path, seed):
    cfg = job(tmp_path, seed, {"steps": -1})
    loader = build_loader(dataclasses.replace(held_out_data(cfg), loop=False), SEQ_LEN)
    windows = list(loader)
    result = validate_once(cfg)
    assert result.windows == len(windows) > VALIDATION["steps"]
    assert result.tokens == sum(int((w["labels"] != -100).sum()) for w in windows)


def test_held_out_data_shorter_than_a_window_is_one_line(tmp_path, seed):
    short = tmp_path / "short.jsonl"
    short.write_text('{"text": "A held-out set of one sentence."}\n')
    with pytest.raises(DataError) as info:
        validate_once(job(tmp_path / "out", seed, {"steps": -1, "source": str(short)}))
    assert f"the held-out data ({short}) gave no labelled tokens in windows of seq_len = 256" in str(info.value)
    assert "\n" not in str(info.value)


def test_torchtitans_flex_path_validates_as_flashcp(tmp_path, seed, monkeypatch):
    """`model.attention = "flex"` validates through TorchTitan's own input path (its document block
    mask from the positions). Flex has no CPU backward, so this validates the seed weights without
    training, and with torch.compile off (TorchTitan compiles flex, minutes on a CPU): the same loss
    and buckets as FlashCP's attention."""
    monkeypatch.setattr(titan_attention.FlexAttention, "_compiled_flex_attn", flex_attention)
    monkeypatch.setattr(titan_attention, "_compiled_create_block_mask", create_block_mask)
    flashcp = validate_once(job(tmp_path / "flashcp", seed))
    flex = validate_once(job(tmp_path / "flex", seed, model={"attention": "flex"}, flashcp=None))
    worst = _worst([flex], [flashcp])
    print(f"flex vs FlashCP attention, CP = 1: {worst:.1e}")
    assert worst <= TOLERANCE


@pytest.mark.parametrize(
    "section, message",
    [
        ({"enable": True}, "[validation] enable = true needs [validation] source, the held-out data"),
        ({"freq": 0}, "[validation] freq must be >= 1, got 0"),
        ({"steps": 0}, "[validation] steps must be >= 1 (windows per data-parallel rank) or -1"),
        ({"steps": -2}, "[validation] steps must be >= 1"),
        ({"bucket_min": 0}, "[validation] bucket_min must be >= 1, got 0"),
        ({"freq": "often"}, "[validation] freq must be an integer, got 'often' (str)"),
        ({"sorce": "default"}, "unknown key [validation] sorce; allowed keys: freq, enable, steps, source"),
    ],
)
def test_bad_validation_settings_are_one_line(tmp_path, section, message):
    with pytest.raises(ConfigError) as info:
        tiny_job(tmp_path, validation=section)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_torchtitans_validator_section_is_named_as_validation(tmp_path, capsys):
    path = tmp_path / "job.toml"
    path.write_text("[validator]\nenable = true\n")
    assert config.main(["--check", str(path)]) == 2
    err = capsys.readouterr().err
    expected = "unknown section [validator]: TorchTitan's [validator] is [validation] in a FlashCP job"
    assert err == f"error: {expected}\n"
    with pytest.raises(ConfigError, match=r"TorchTitan's \[validator\] is \[validation\]"):
        config.load_job(tmp_path / "job.toml", [])
    path.write_text("")
    with pytest.raises(ConfigError, match=r"TorchTitan's \[validator\] is \[validation\]"):
        config.load_job(path, ["--validator.freq", "5"])


def test_a_missing_held_out_source_is_named_before_launch(tmp_path):
    missing = tmp_path / "held_out.jsonl"
    with pytest.raises(DataError, match=str(missing)):
        check_inputs(tiny_job(tmp_path, validation={"enable": True, "source": str(missing)}))
    with pytest.raises(DataError, match=str(missing)):  # validation off, but the probe's haystack
        check_inputs(tiny_job(tmp_path, validation={"source": str(missing)}, probe={"enable": True, "freq": 1}))
    check_inputs(tiny_job(tmp_path, validation={"source": str(missing)}))  # neither reads it: not read
