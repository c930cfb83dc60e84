"""Will a job fit its GPUs? One rank of it, built and stepped on fake tensors, on any machine.

    report = dry_run(load_job(path, overrides), world_size=8)  # `python -m flashcp.titan.dryrun` (cli)

Builds the job as rank 0 of W ranks on TorchTitan's fake process group (`comm.mode =
"fake_backend"`), with the real FSDP / TP / FlashCP parallelisation, the model and optimizer as
fake tensors (shapes and sizes, no memory, no values), draws one window from the job's data (its
plan and this rank's dispatch are real), and runs one forward / backward / optimizer step under
`flashcp.titan.dryrun.memtrack`. Attention runs torch's `varlen_attn` op, whose registered fake kernel
has FlashAttention-2's output and saved-tensor shapes; a hybrid's Gated DeltaNet layers run a stand-in
with flash-linear-attention's footprint and the busiest rank's state summaries (`dryrun/linear.py`).
It prints the peak per category next to the analytic estimate (`flashcp.titan.dryrun.estimate`)
and the window's plan figures (`flashcp.titan.dryrun.report`); in mesh scope the window is the mesh's and the
rank measured its busiest (`dryrun/mesh.py`). Not counted: the CUDA context, NCCL
buffers and allocator fragmentation, hence `--reserve-gib`.
With `[activation_checkpoint] offload` the layer inputs sent to host memory are tracked apart
(`host_gib`, against `--host-gib` per rank: 1/8 of a 2 TB node by default), and the copies' time
is modelled against the layer's compute (`offload`). With `[training] enable_cpu_offload` (FSDP2's
CPU offload) the sharded parameters, gradients and optimizer states are host memory too
(`memtrack`), and their copies per step are modelled (`cpu_offload`). The host memory a node needs
is the rank's times its ranks per node. A job that does not fit exits 1 with one line naming its
biggest term (or the host memory) and the levers it does not already use.
"""

from __future__ import annotations

import copy
import dataclasses
import tempfile
import time
from types import SimpleNamespace
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from flashcp.attention.op import latent_attention
from flashcp.titan.config import check_layout, ConfigError
from flashcp.titan.config.model import model_experts
from flashcp.titan.dryrun.estimate import estimate, GIB
from flashcp.titan.dryrun.fakes import (
    balanced_routing, fake_kernel, fake_world, host_copies, KERNEL, no_rejection_sampling,
)  # fmt: skip
from flashcp.titan.dryrun.hfload import plan_hf_import
from flashcp.titan.dryrun import pipeline
from flashcp.titan.dryrun.linear import gated_delta_stand_in
from flashcp.titan.dryrun.memtrack import CategoryTracker
from flashcp.titan.dryrun.mesh import as_busiest, mesh_figures
from flashcp.titan.dryrun.report import cpu_offload_time, low_precision_report, offload_time, Report
from flashcp.titan.dryrun.shape import plan_figures, shape_and_layout
from flashcp.titan.models.offload import layer_input_bytes


def dry_run(cfg: dict[str, Any], world_size: int, gpu_gib: float = 80.0, reserve_gib: float = 6.0,
            host_gib: float = 256.0, ranks_per_node: int = 8) -> Report:
    """Build rank 0 of a `world_size`-rank job on fake tensors and measure one step (see the module doc)."""
    if cfg["model"]["attention"] != "flashcp":
        raise ConfigError("the dry run drives FlashCP's attention: model.attention must be 'flashcp'")
    checked = _cpu_checkable(cfg)
    degrees = check_layout(checked, world_size, has_cuda=False)
    if checked["flashcp"]["scope"] != cfg["flashcp"]["scope"]:  # "auto" resolved by DP and seq_len, as the launcher does
        cfg = copy.deepcopy(cfg)
        cfg["flashcp"]["scope"], cfg["data"]["balance"] = checked["flashcp"]["scope"], checked["data"]["balance"]
    if model_experts(cfg) is not None and cfg["training"]["mixed_precision_param"] != "bfloat16":
        raise ConfigError("the dry run sizes a mixture-of-experts job with [training] mixed_precision_param = "
                          "'bfloat16' only: torch's fake grouped matmul (the experts) takes bfloat16")  # fmt: skip
    pp = degrees.get("pp", 1)
    if pp > 1 and cfg["training"]["enable_cpu_offload"]:
        raise ConfigError("the dry run derives a pipeline's ranks from one stage's GPU memory: not with [training] "
                          "enable_cpu_offload (each rank's host shards are not derived)")  # fmt: skip
    split = v = None
    run_cfg, run_world, layers = cfg, world_size, None
    if pp > 1:  # one stage measured as a job of its own, every stage derived from it (dryrun/pipeline.py)
        split, v = pipeline.stage_split(cfg)
        run_cfg, run_world, layers = pipeline.stage_job(cfg), world_size // pp, pipeline.measured_layers(split)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp, fake_world(run_world), fake_kernel(), balanced_routing(run_cfg):
        trainer = _build(_dry_job(run_cfg, tmp), layers)
        plans = as_busiest(trainer) if trainer.mesh is not None else None
        try:
            ckpt = cfg["checkpoint"]
            hf_import = plan_hf_import(trainer, ckpt["initial_load_path"]) if ckpt["initial_load_in_hf"] else None
            input_dict, labels = next(trainer.batch_generator(trainer.dataloader))
            peak, by_category, host, host_by_category, top = _measure(trainer, input_dict, labels)
            plan = plan_figures(trainer)
            mesh = None
            if plans:  # mesh scope: measured as the busiest rank of the mesh window's plan
                row = trainer.metrics_processor.exchange_row_bytes or trainer.metrics_processor.kv_row_bytes
                mesh = {**mesh_figures(plans[-1], row), "measured_rank": trainer.cp_rank,
                        "kv_recv_rows_measured": input_dict["dispatch"].recv_size}  # fmt: skip
            shape, layout = shape_and_layout(trainer, input_dict["dispatch"], run_cfg)
            est = estimate(shape, layout)
            stages = None
            if pp > 1:
                sp = layout.tp if layout.sequence_parallel else 1
                layer_input = layer_input_bytes(layout.tokens, 1, shape.dim, 2, tp=sp) / GIB
                stages = pipeline.per_stage(cfg, trainer, {k: b / GIB for k, b in by_category.items()}, split, v,
                                            layer_input)  # fmt: skip
        finally:
            trainer.close()
    chunks = getattr(trainer.loss_fn, "num_chunks", 1)
    by_gib = {k: b / GIB for k, b in by_category.items()}
    piped = None
    if stages is not None:
        worst = max(stages, key=lambda s: s["peak_gib"])
        piped = {"schedule": cfg["parallelism"]["pipeline_parallel_schedule"], "stages": len(split),
                 "stages_per_rank": v, "microbatches": cfg["training"]["local_batch_size"],
                 "measured": {"world_size": run_world, "layers": len(layers), "peak_gib": peak / GIB,
                              "by_category": by_gib},
                 "per_rank": stages, "worst_rank": worst["rank"]}  # fmt: skip
        peak, by_gib = worst["peak_gib"] * GIB, dict(worst["by_category"])
    return Report(
        config=cfg["_path"], world_size=world_size, degrees=degrees, gpu_gib=gpu_gib, reserve_gib=reserve_gib,
        peak_gib=peak / GIB, by_category=by_gib,
        estimate_gib=est, plan=plan, loss_chunks=chunks, seconds=time.perf_counter() - start,
        host_gib=host / GIB, host_limit_gib=host_gib, offload=offload_time(shape, layout) if layout.offload else None,
        host_by_category={k: b / GIB for k, b in host_by_category.items()},
        ranks_per_node=min(world_size, ranks_per_node),
        cpu_offload=cpu_offload_time(shape, layout) if layout.cpu_offload else None,
        low_precision=low_precision_report(layout.low_precision), hf_import=hf_import, pipeline=piped, mesh=mesh,
        peak_tensors=[{**{k: v for k, v in t.items() if k != "bytes"}, "gib": t["bytes"] / GIB} for t in top],
    )  # fmt: skip


def _cpu_checkable(cfg: dict[str, Any]) -> dict[str, Any]:
    """The job as the layout check sees it on this GPU-less machine: any GPU kernel is replaced here."""
    out = copy.deepcopy(cfg)
    out["flashcp"]["backend"] = "auto"
    out["model"]["converters"] = []  # nor torchao or its GPU: the converters' casts are modelled
    return out


def _dry_job(cfg: dict[str, Any], folder: str) -> dict[str, Any]:
    """The job on the fake backend, writing nothing: no checkpoints or TensorBoard, a scratch folder.
    Nor loading: an HF import's load is planned apart (`hfload.plan_hf_import`), so a job naming its
    flavor needs no HF folder here (without a flavor the architecture is the folder's, `[model]
    hf_config` since the config check)."""
    out = copy.deepcopy(cfg)
    out["comm"]["mode"] = "fake_backend"
    out["checkpoint"]["enable"] = False
    out["checkpoint"]["initial_load_path"], out["checkpoint"]["initial_load_in_hf"] = None, False
    out["metrics"]["enable_tensorboard"] = False
    out["job"]["dump_folder"] = folder
    out["data"]["prefetch"] = 0
    # Nor the retrieval probe: its prompts are planned from token values, which fake tensors lack, and
    # it scores them forward only between steps, a window at a time, below the step's peak.
    out["probe"]["enable"] = False
    out["flashcp"]["backend"] = KERNEL
    # torchao's linears cannot be built without torchao: the linears run in bf16, whose saved tensors,
    # weights and FSDP gathers are the converted ones' (estimate.py), and their casts are modelled.
    out["model"]["converters"] = []
    return out


def _build(cfg: dict[str, Any], layers: list[int] | None = None):
    """The trainer with every tensor from parallelisation on fake (device meshes, built before, stay real);
    `layers`: the model cut to these decoder layers (a pipeline stage's, `dryrun/pipeline.py`)."""
    from flashcp.titan.launch.job import trainer_config
    from flashcp.titan.trainer import FlashCPTrainer

    config = trainer_config(cfg)
    if layers is not None:
        model = config.model_spec.model
        model = dataclasses.replace(model, layers=[model.layers[i] for i in layers])
        config.model_spec = dataclasses.replace(config.model_spec, model=model)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    parallelize = config.model_spec.parallelize_fn

    def parallelize_then_fake(model: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
        model = parallelize(model, **kwargs)
        mode.__enter__()
        return model

    config.model_spec = dataclasses.replace(config.model_spec, parallelize_fn=parallelize_then_fake)
    try:
        with no_rejection_sampling():
            trainer = FlashCPTrainer(config)
    finally:
        if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is mode:
            mode.__exit__(None, None, None)
    trainer.fake_mode = mode
    # The model's fake tensors are on "cpu" (TorchTitan's device type); fake tensors, unlike real ones,
    # keep "cpu" and the trainer's "cpu:0" apart.
    trainer.device = torch.device("cpu")
    return trainer


def _measure(trainer, input_dict: dict[str, Any], labels: torch.Tensor) -> tuple[int, dict[str, int], int,
                                                                               dict[str, int], list]:
    """Peak bytes of one training step (optimizer states already allocated), by category, the peak
    of host memory the offloads hold, by category, and the largest tensors live at the peak (named
    while the gradients still exist)."""
    from torchtitan.components.loss import IGNORE_INDEX
    from torchtitan.distributed import utils as dist_utils

    model, optimizers = trainer.model_parts[0], trainer.optimizers
    params = [p for p in model.parameters() if p.requires_grad]
    with trainer.fake_mode:
        for p in params:  # AdamW allocates its moments at the first step: as in any later step, they exist
            p.grad = torch.zeros_like(p)
        optimizers.step()
        optimizers.zero_grad(set_to_none=True)
        offloaded = trainer.config.training.enable_cpu_offload  # FSDP's: the shards and AdamW's states on the host
        tracker = CategoryTracker(model, optimizers.optimizers[0], offloaded=offloaded)
        handles = _label_regions(trainer, tracker)
        try:
            with tracker, host_copies(tracker), gated_delta_stand_in(trainer, tracker):
                valid = (labels != IGNORE_INDEX).sum()
                trainer.forward_backward_step(input_dict=input_dict, labels=labels, global_valid_tokens=valid)
                dist_utils.clip_grad_norm_(params, trainer.config.training.max_norm, foreach=True,
                                           ep_enabled=trainer.parallel_dims.ep_enabled)
                optimizers.step()
                top = tracker.peak_tensors()
                optimizers.zero_grad(set_to_none=True)
        finally:
            for handle in handles:
                handle.remove()
            trainer.loss_fn = trainer.loss_fn.inner
    peak, by_category = tracker.peak_by_category()
    host = tracker.peak_host_by_category
    return peak, {"flashcp_buffers": 0, "loss": 0, **by_category}, tracker.peak_host, host, top


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


class _LatentOp(torch.nn.Module):
    """The MLA layer's op (`latent_attention`) as a module, so that hooks label its forward and backward
    (the exchange, the up-projected K / V and the kernel) apart from the MLA layer's own projections."""

    op = staticmethod(latent_attention)

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.op(*args, **kwargs)


def _label_regions(trainer, tracker: CategoryTracker) -> list[Any]:
    """Label FlashCP's attention (forward, recompute, backward) and the output projection's forward."""
    from flashcp.titan.models import latent as latent_model
    from flashcp.titan.models.attention import FlashCPAttention
    from flashcp.titan.models.latent import FlashCPLatentAttention

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
    if any(isinstance(module, FlashCPLatentAttention) for module in model.modules()):
        op = _LatentOp()  # MLA's projections are the model's; the exchange and its K/V are FlashCP's
        handles += [
            op.register_forward_pre_hook(push("flashcp_buffers")),
            op.register_forward_hook(pop),
            op.register_full_backward_pre_hook(push("flashcp_buffers")),
            op.register_full_backward_hook(pop),
        ]
        latent_model.latent_attention = op
        restore = lambda: setattr(latent_model, "latent_attention", _LatentOp.op)  # noqa: E731
        handles.append(SimpleNamespace(remove=restore))
    lm_head = model.lm_head
    handles += [lm_head.register_forward_pre_hook(push("loss")), lm_head.register_forward_hook(pop)]
    trainer.loss_fn = _LabelledLoss(trainer.loss_fn, tracker)
    return handles
