"""Will a job fit its GPUs? One rank of it, built and stepped on fake tensors, on any machine.

    python -m flashcp.titan.dryrun --config llama8b_128k --world-size 8 [--json] [--gpu-gib 80]

Builds the job as rank 0 of W ranks on TorchTitan's fake process group (`comm.mode =
"fake_backend"`), with the real FSDP / TP / FlashCP parallelisation, the model and optimizer as
fake tensors (shapes and sizes, no memory, no values), draws one window from the job's data (its
plan and this rank's dispatch are real), and runs one forward / backward / optimizer step under
`flashcp.titan.dryrun.memtrack`. Attention runs torch's `varlen_attn` op, whose registered fake kernel
has FlashAttention-2's output and saved-tensor shapes. It prints the peak per category next to
the analytic estimate (`flashcp.titan.dryrun.estimate`) and the window's plan figures. Not
counted: the CUDA context, NCCL buffers and allocator fragmentation, hence `--reserve-gib`.
A job that does not fit exits 1 with one line naming its biggest term and what to change.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from flashcp.attention import kernels
from flashcp.data.errors import DataError
from flashcp.data.tokenizer import TokenizerError
from flashcp.titan.config import ConfigError, check_layout, load_job, resolve_config_path, world_size_hint
from flashcp.titan.dryrun.estimate import GIB, estimate, Layout, ModelShape
from flashcp.titan.dryrun.memtrack import CategoryTracker
from flashcp.titan.models.rotary import rotation

KERNEL = "dryrun"  # the attention backend name the dry run registers while it runs
ADVICE = {
    "parameters": "shard them wider: more ranks (data_parallel_shard_degree) or a higher tensor_parallel_degree",
    "gradients": "shard them wider: more ranks (data_parallel_shard_degree) or a higher tensor_parallel_degree",
    "optimizer_states": "shard them wider: more ranks (data_parallel_shard_degree) or a higher tensor_parallel_degree",
    "model_buffers": "TorchTitan's attention keeps one RoPE table per layer (model.attention = 'flashcp' computes "
                     "each step's rows for this rank's tokens instead)",
    "activations": "set [activation_checkpoint] mode = 'full', or raise context_parallel_degree (fewer tokens per rank)",
    "flashcp_buffers": "raise tensor_parallel_degree (fewer KV heads per rank) or context_parallel_degree",
    "loss": "lower [loss] chunk_tokens (0 turns chunking off), or raise tensor_parallel_degree (vocabulary split)",
}  # fmt: skip


@dataclasses.dataclass
class Report:
    """What one dry run measured; `as_json()` is the `--json` object."""

    config: str
    world_size: int
    degrees: dict[str, int]
    gpu_gib: float
    reserve_gib: float
    peak_gib: float
    by_category: dict[str, float]
    estimate_gib: dict[str, float]
    plan: dict[str, float]
    loss_chunks: int
    seconds: float

    @property
    def fits(self) -> bool:
        return self.peak_gib + self.reserve_gib <= self.gpu_gib

    def biggest(self) -> str:
        return max(self.by_category, key=self.by_category.get)

    def as_json(self) -> dict[str, Any]:
        return {"fits": self.fits, **dataclasses.asdict(self)}


def dry_run(cfg: dict[str, Any], world_size: int, gpu_gib: float = 80.0, reserve_gib: float = 6.0) -> Report:
    """Build rank 0 of a `world_size`-rank job on fake tensors and measure one step (see the module doc)."""
    if cfg["model"]["attention"] != "flashcp":
        raise ConfigError("the dry run drives FlashCP's attention: model.attention must be 'flashcp'")
    degrees = check_layout(_cpu_checkable(cfg), world_size, has_cuda=False)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp, _fake_world(world_size), _fake_kernel():
        trainer = _build(_dry_job(cfg, tmp))
        try:
            input_dict, labels = next(trainer.batch_generator(trainer.dataloader))
            peak, by_category = _measure(trainer, input_dict, labels)
            plan = _plan_figures(trainer)
            est = estimate(*_shape_and_layout(trainer, input_dict["dispatch"]))
        finally:
            trainer.close()
    chunks = getattr(trainer.loss_fn, "num_chunks", 1)
    return Report(
        config=cfg["_path"], world_size=world_size, degrees=degrees, gpu_gib=gpu_gib, reserve_gib=reserve_gib,
        peak_gib=peak / GIB, by_category={k: v / GIB for k, v in by_category.items()},
        estimate_gib=est, plan=plan, loss_chunks=chunks, seconds=time.perf_counter() - start,
    )  # fmt: skip


def _cpu_checkable(cfg: dict[str, Any]) -> dict[str, Any]:
    """The job as the layout check sees it on this GPU-less machine: any GPU kernel is replaced here."""
    out = copy.deepcopy(cfg)
    out["flashcp"]["backend"] = "auto"
    return out


def _dry_job(cfg: dict[str, Any], folder: str) -> dict[str, Any]:
    """The job on the fake backend, writing nothing: no checkpoints or TensorBoard, a scratch folder.
    Nor loading: a job importing HF weights with its flavor named needs no HF folder here (without a
    flavor the architecture is the folder's, `[model] hf_config` since the config check)."""
    out = copy.deepcopy(cfg)
    out["comm"]["mode"] = "fake_backend"
    out["checkpoint"]["enable"] = False
    out["checkpoint"]["initial_load_path"], out["checkpoint"]["initial_load_in_hf"] = None, False
    out["metrics"]["enable_tensorboard"] = False
    out["job"]["dump_folder"] = folder
    out["data"]["prefetch"] = 0
    out["flashcp"]["backend"] = KERNEL
    return out


@contextlib.contextmanager
def _fake_world(world_size: int) -> Iterator[None]:
    """TorchTitan's fake mode reads the world from NGPU / RANK; the process group ends with the run."""
    saved = {name: os.environ.get(name) for name in ("NGPU", "RANK", "LOCAL_RANK", "WORLD_SIZE")}
    os.environ.update(NGPU=str(world_size), RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(world_size))
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def _fake_kernel() -> Iterator[None]:
    """torch's varlen_attn without its CUDA check: fake tensors stay on the CPU, and its fake kernel
    gives FlashAttention-2's shapes (real GPUs run flash-attn's kernel, whose buffers are the same)."""
    kernels.BACKENDS[KERNEL] = kernels.Backend(KERNEL, lambda q, k: None, kernels.BACKENDS["torch"].run)
    try:
        yield
    finally:
        del kernels.BACKENDS[KERNEL]


def _build(cfg: dict[str, Any]):
    """The trainer with every tensor from parallelisation on fake (device meshes, built before, stay real)."""
    from flashcp.titan.launch.job import trainer_config
    from flashcp.titan.trainer import FlashCPTrainer

    config = trainer_config(cfg)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    parallelize = config.model_spec.parallelize_fn

    def parallelize_then_fake(model: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
        model = parallelize(model, **kwargs)
        mode.__enter__()
        return model

    config.model_spec = dataclasses.replace(config.model_spec, parallelize_fn=parallelize_then_fake)
    try:
        with _no_rejection_sampling():
            trainer = FlashCPTrainer(config)
    finally:
        if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is mode:
            mode.__exit__(None, None, None)
    trainer.fake_mode = mode
    # The model's fake tensors are on "cpu" (TorchTitan's device type); fake tensors, unlike real ones,
    # keep "cpu" and the trainer's "cpu:0" apart.
    trainer.device = torch.device("cpu")
    return trainer


@contextlib.contextmanager
def _no_rejection_sampling() -> Iterator[None]:
    """trunc_normal_ redraws until no value is out of bounds (`mask.any()`), which reads values that fake
    tensors lack; the weights' values do not matter here, so initialisation draws a plain normal
    (torch 2.11-2.13 look `_no_grad_trunc_normal_` up at each call)."""
    truncated = torch.nn.init._no_grad_trunc_normal_
    torch.nn.init._no_grad_trunc_normal_ = lambda tensor, mean, std, *args, **kwargs: tensor.normal_(mean, std)
    try:
        yield
    finally:
        torch.nn.init._no_grad_trunc_normal_ = truncated


def _measure(trainer, input_dict: dict[str, Any], labels: torch.Tensor) -> tuple[int, dict[str, int]]:
    """Peak bytes of one training step (optimizer states already allocated), by category."""
    from torchtitan.components.loss import IGNORE_INDEX
    from torchtitan.distributed import utils as dist_utils

    model, optimizers = trainer.model_parts[0], trainer.optimizers
    params = [p for p in model.parameters() if p.requires_grad]
    with trainer.fake_mode:
        for p in params:  # AdamW allocates its moments at the first step: as in any later step, they exist
            p.grad = torch.zeros_like(p)
        optimizers.step()
        optimizers.zero_grad(set_to_none=True)
        tracker = CategoryTracker(model, optimizers.optimizers[0])
        handles = _label_regions(trainer, tracker)
        try:
            with tracker:
                valid = (labels != IGNORE_INDEX).sum()
                trainer.forward_backward_step(input_dict=input_dict, labels=labels, global_valid_tokens=valid)
                dist_utils.clip_grad_norm_(params, trainer.config.training.max_norm, foreach=True)
                optimizers.step()
                optimizers.zero_grad(set_to_none=True)
        finally:
            for handle in handles:
                handle.remove()
            trainer.loss_fn = trainer.loss_fn.inner
    peak, by_category = tracker.peak_by_category()
    return peak, {"flashcp_buffers": 0, "loss": 0, **by_category}


class _LabelledLoss:
    """The trainer's loss with its memory labelled "loss": the call (with a chunked loss's own
    backward) and the backward from the loss down to the model's output."""

    def __init__(self, inner: Any, tracker: CategoryTracker) -> None:
        self.inner, self.tracker = inner, tracker

    def __call__(self, pred: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        with self.tracker.region("loss"):
            loss, extra = self.inner(pred, *args, **kwargs)
        loss.register_hook(lambda grad: self.tracker.push("loss"))
        pred.register_hook(lambda grad: self.tracker.pop())
        return loss, extra


def _label_regions(trainer, tracker: CategoryTracker) -> list[Any]:
    """Label FlashCP's attention (forward, recompute, backward) and the output projection's forward."""
    from flashcp.titan.models.attention import FlashCPAttention

    model = trainer.model_parts[0]
    push = lambda label: lambda *args: tracker.push(label)  # noqa: E731
    pop = lambda *args: tracker.pop()  # noqa: E731
    handles = []
    for module in model.modules():
        if isinstance(module, FlashCPAttention):
            handles += [
                module.register_forward_pre_hook(push("flashcp_buffers")),
                module.register_forward_hook(pop),
                module.register_full_backward_pre_hook(push("flashcp_buffers")),
                module.register_full_backward_hook(pop),
            ]
    lm_head = model.lm_head
    handles += [lm_head.register_forward_pre_hook(push("loss")), lm_head.register_forward_hook(pop)]
    trainer.loss_fn = _LabelledLoss(trainer.loss_fn, tracker)
    return handles


def _plan_figures(trainer) -> dict[str, float]:
    """The window's imbalance and KV bytes received per layer (compact / full / needed)."""
    figures = trainer.metrics_processor._flashcp_metrics()
    return {key.removeprefix("flashcp/"): value for key, value in figures.items()}


def _shape_and_layout(trainer, dispatch) -> tuple[ModelShape, Layout]:
    from torchtitan.distributed.activation_checkpoint import FullAC

    model, dims, cfg = trainer.model_config, trainer.parallel_dims, trainer.config
    attention = model.first_attention
    tokens = cfg.training.seq_len // dims.cp
    rope_row = rotation(attention.rope, torch.zeros(1, dtype=torch.long))  # one position's RoPE row
    tables = hasattr(trainer.model_parts[0].layers["0"].attention.rope, "cache")  # TorchTitan's, else per step
    shape = ModelShape(
        dim=model.dim, layers=len(model.layers), heads=attention.n_heads,
        kv_heads=attention.n_kv_heads or attention.n_heads, head_dim=attention.head_dim or model.dim // attention.n_heads,
        ffn=model.layers[0].feed_forward.w1.out_features, vocab=model.vocab_size,
        rope_rows=len(model.layers) * attention.rope.max_seq_len if tables else tokens,
        rope_row_bytes=rope_row.numel() * rope_row.element_size(),
    )  # fmt: skip
    chunks = getattr(trainer.loss_fn, "num_chunks", 1)
    layout = Layout(
        fsdp=dims.dp_shard * dims.cp, tp=dims.tp, sequence_parallel=cfg.parallelism.enable_sequence_parallel,
        tokens=tokens, kv_rows=dispatch.kv_index.numel() + dispatch.recv_size, loss_tokens=tokens // chunks,
        full_ac=isinstance(cfg.activation_checkpoint, FullAC.Config),
    )  # fmt: skip
    return shape, layout


def _format(r: Report) -> str:
    deg = " x ".join(f"{k} {v}" for k, v in r.degrees.items() if v > 1) or "1 rank"
    lines = [
        f"dry run: {r.config} as rank 0 of {r.world_size} ({deg}), one step on fake tensors in {r.seconds:.0f} s",
        f"{'category':<18}{'tracked GiB':>12}{'estimate GiB':>14}",
    ]
    for name, gib in sorted(r.by_category.items(), key=lambda kv: -kv[1]):
        lines.append(f"{name:<18}{gib:>12.2f}{r.estimate_gib.get(name, 0.0):>14.2f}")
    lines.append(f"{'peak':<18}{r.peak_gib:>12.2f}{r.estimate_gib['peak']:>14.2f}")
    if r.loss_chunks > 1:
        lines.append(f"loss: cross-entropy in {r.loss_chunks} slices ([loss] chunk_tokens)")
    if "imbalance" in r.plan:
        mib = {k.removeprefix("kv_recv_bytes_per_layer_"): v / 2**20 for k, v in r.plan.items() if "kv_recv" in k}
        lines.append(
            f"window: {r.plan['docs_per_window']:.0f} documents, imbalance {r.plan['imbalance']:.3f}, "
            f"{r.plan['split_docs']:.0f} split; KV received per layer: compact {mib['compact']:.1f} MiB, "
            f"full {mib['full']:.1f} MiB, needed {mib['needed']:.1f} MiB"
        )
    verdict = "fits" if r.fits else "does NOT fit"
    lines.append(f"{verdict}: {r.peak_gib:.1f} GiB tracked + {r.reserve_gib:g} GiB reserve (CUDA context, NCCL, "
                 f"fragmentation) against a {r.gpu_gib:g} GiB GPU")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m flashcp.titan.dryrun",
        description="Peak memory per rank of a job, measured on fake tensors (no GPU needed). "
        "Overrides (--section.key value) apply as in training.",
    )
    parser.add_argument("--config", required=True, help="job file or name in train_configs/")
    parser.add_argument("--world-size", type=int, help="ranks of the job (default: what its layout fixes)")
    parser.add_argument("--gpu-gib", type=float, default=80.0, help="GPU memory to check against (default 80)")
    parser.add_argument("--reserve-gib", type=float, default=6.0,
                        help="untracked memory: CUDA context, NCCL buffers, fragmentation (default 6)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args, overrides = parser.parse_known_args(argv)
    try:
        cfg = load_job(resolve_config_path(args.config), overrides)
        world = args.world_size or world_size_hint(cfg)
        if world is None:
            raise ConfigError("data_parallel_shard_degree = -1 leaves the world open: pass --world-size")
        report = dry_run(cfg, world, args.gpu_gib, args.reserve_gib)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (DataError, TokenizerError) as e:  # e.g. a recipe's stores, not prepared yet
        print(f"error: {e}; the dry run draws one window from the job's data: until it exists, "
              "--data.tokenizer default and --data.source synthetic (a mixture: "
              "--data.mix.NAME.source synthetic for each source) stand in for it, with "
              "--validation.enable false", file=sys.stderr)  # fmt: skip
        return 2
    print(json.dumps(report.as_json()) if args.json else _format(report), flush=True)
    if not report.fits:
        biggest = report.biggest()
        print(f"error: does not fit: {report.peak_gib:.1f} GiB + {report.reserve_gib:g} GiB reserve > "
              f"{report.gpu_gib:g} GiB; biggest term: {biggest} {report.by_category[biggest]:.1f} GiB: "
              f"{ADVICE[biggest]}", file=sys.stderr)  # fmt: skip
        return 1
    return 0

