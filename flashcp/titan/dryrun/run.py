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

import contextlib
import copy
import dataclasses
import math
import os
import tempfile
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from flashcp.attention import kernels
from flashcp.attention.op import latent_attention
from flashcp.titan.config import check_layout, ConfigError
from flashcp.titan.config.converters import converted_linears
from flashcp.titan.config.model import model_experts
from flashcp.titan.dryrun.estimate import estimate, GIB, Layout, LowPrecision, ModelShape
from flashcp.titan.dryrun.hfload import plan_hf_import
from flashcp.titan.dryrun import pipeline
from flashcp.titan.dryrun.linear import gated_delta_stand_in
from flashcp.titan.dryrun.memtrack import CategoryTracker
from flashcp.titan.dryrun.mesh import as_busiest, mesh_figures
from flashcp.titan.dryrun.report import cpu_offload_time, low_precision_report, offload_time, Report
from flashcp.titan.models.offload import layer_input_bytes, LayerInputOffload
from flashcp.titan.models.rotary import rotation
from flashcp.titan.models.tiled_mlp import tile_count
from flashcp.titan.models.windows import HybridDispatches, LayerDispatches

KERNEL = "dryrun"  # the attention backend name the dry run registers while it runs


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
    with tempfile.TemporaryDirectory() as tmp, _fake_world(run_world), _fake_kernel(), _balanced_routing(run_cfg):
        trainer = _build(_dry_job(run_cfg, tmp), layers)
        plans = as_busiest(trainer) if trainer.mesh is not None else None
        try:
            ckpt = cfg["checkpoint"]
            hf_import = plan_hf_import(trainer, ckpt["initial_load_path"]) if ckpt["initial_load_in_hf"] else None
            input_dict, labels = next(trainer.batch_generator(trainer.dataloader))
            peak, by_category, host, host_by_category, top = _measure(trainer, input_dict, labels)
            plan = _plan_figures(trainer)
            mesh = None
            if plans:  # mesh scope: measured as the busiest rank of the mesh window's plan
                row = trainer.metrics_processor.exchange_row_bytes or trainer.metrics_processor.kv_row_bytes
                mesh = {**mesh_figures(plans[-1], row), "measured_rank": trainer.cp_rank,
                        "kv_recv_rows_measured": input_dict["dispatch"].recv_size}  # fmt: skip
            shape, layout = _shape_and_layout(trainer, input_dict["dispatch"], run_cfg)
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


GPUS_PER_NODE = 8  # the nodes the dry run lays the ranks on (DGX / HGX), fewer where 8 does not divide the world


@contextlib.contextmanager
def _fake_world(world_size: int) -> Iterator[None]:
    """TorchTitan's fake mode reads the world from NGPU / RANK; the process group ends with the run.
    LOCAL_WORLD_SIZE places the ranks on nodes, as torchrun would (`[flashcp] comm = "two_level"`)."""
    names = ("NGPU", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
    saved = {name: os.environ.get(name) for name in names}
    os.environ.update(NGPU=str(world_size), RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(math.gcd(world_size, GPUS_PER_NODE)))  # fmt: skip
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
    torch_ = kernels.BACKENDS["torch"]
    kernels.BACKENDS[KERNEL] = kernels.Backend(KERNEL, lambda q, k: None, torch_.run, torch_.run_lse, torch_.run_backward)
    try:
        yield
    finally:
        del kernels.BACKENDS[KERNEL]


@contextlib.contextmanager
def _balanced_routing(cfg: dict[str, Any]) -> Iterator[None]:
    """Expert parallelism's all-to-all splits as if the router spread tokens evenly over the EP ranks.

    TorchTitan's dispatcher copies the exchanged token counts to the host to size the all-to-all,
    values fake tensors lack; here every rank sends and receives tokens x top_k / EP rows to and
    from each EP rank (the balance the router's bias update drives towards). A skewed step's
    receive buffer is larger, up to EP times on one rank (`estimate.moe_bytes`)."""
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    exchange = AllToAllTokenDispatcher._sync_token_count_exchange

    def balanced(self, local_counts: torch.Tensor, global_counts: torch.Tensor, ep: int):
        rows = cfg["training"]["seq_len"] * cfg["training"]["local_batch_size"] // \
            cfg["parallelism"]["context_parallel_degree"] * self.top_k  # fmt: skip
        splits = [rows // ep + (i < rows % ep) for i in range(ep)]
        return global_counts.reshape(-1), splits, splits

    AllToAllTokenDispatcher._sync_token_count_exchange = balanced
    try:
        yield
    finally:
        AllToAllTokenDispatcher._sync_token_count_exchange = exchange


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
            with tracker, _host_copies(tracker), gated_delta_stand_in(trainer, tracker):
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


@contextlib.contextmanager
def _host_copies(tracker: CategoryTracker) -> Iterator[None]:
    """The offload's copies to the host (pinned host memory on a GPU; here fake tensors like the rest)
    are counted as host memory, not the GPU's."""
    to_host = LayerInputOffload._to_host

    def counted(self: LayerInputOffload, tensor: torch.Tensor) -> torch.Tensor:
        with tracker.host():
            return to_host(self, tensor)

    LayerInputOffload._to_host = counted
    try:
        yield
    finally:
        LayerInputOffload._to_host = to_host


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


def _plan_figures(trainer) -> dict[str, float | str]:
    """The window's imbalance and KV bytes received per layer (compact / full / needed; an MLA model's
    in latent rows, with the bytes of one latent and one K/V row; a model with sliding-window layers
    also a window layer's compact / needed and those of the exchange its layers run, `window_comm`, with
    W and the layer counts)."""
    metrics = trainer.metrics_processor
    figures = {key.removeprefix("flashcp/"): value for key, value in metrics._flashcp_metrics().items()}
    workload = metrics.attention_workload
    if workload.window_layers:
        figures |= {"window": workload.window, "window_layers": workload.window_layers,
                    "full_layers": workload.full_layers, "window_comm": metrics.window_comm}  # fmt: skip
    if metrics.exchange_row_bytes:  # MLA: the bytes above are latent rows; a K/V row's for comparison
        figures |= {"latent_row_bytes": metrics.exchange_row_bytes, "kv_row_bytes": metrics.kv_row_bytes}
    return figures


def _shape_and_layout(trainer, dispatch, job: dict[str, Any]) -> tuple[ModelShape, Layout]:
    """The model's shape and this rank's layout; FlashCP's rows are a full layer's, the largest (a
    sliding-window layer receives at most W - 1 rows before each cut shard)."""
    from torchtitan.distributed.activation_checkpoint import FullAC

    if isinstance(dispatch, (LayerDispatches, HybridDispatches)):
        dispatch = dispatch.full

    model, dims, cfg = trainer.model_config, trainer.parallel_dims, trainer.config
    ac = job["activation_checkpoint"]
    attention = model.first_attention
    tokens = cfg.training.seq_len // dims.cp
    rope_row = rotation(attention.rope, torch.zeros(1, dtype=torch.long))  # one position's RoPE row
    first = next(i for i, layer in enumerate(model.layers) if layer.attention is not None)  # a hybrid's: not "0"
    block = trainer.model_parts[0].layers[str(first)]
    tables = hasattr((getattr(block, "attention", None) or block.attn).rope, "cache")  # TorchTitan's, else per step
    moe = next((layer.moe for layer in model.layers if layer.moe is not None), None)
    dense = [layer.feed_forward for layer in model.layers if layer.moe is None]  # DeepSeek's first layers
    experts = {} if moe is None else dict(
        experts=moe.num_experts, top_k=moe.router.top_k,
        expert_ffn=moe.routed_experts.inner_experts.hidden_dim, dense_layers=len(dense),
        shared_ffn=moe.shared_experts.w1.out_features if moe.shared_experts else 0,
    )  # fmt: skip
    if getattr(attention, "kv_lora_rank", 0):  # MLA: latent rows cross the CP group (attention/latent.py)
        rope = attention.qk_rope_head_dim
        heads = dict(kv_heads=attention.n_heads, head_dim=attention.qk_nope_head_dim + rope,
                     v_head_dim=attention.v_head_dim, latent_rank=attention.kv_lora_rank, rope_dim=rope,
                     q_lora_rank=attention.q_lora_rank)  # fmt: skip
    else:
        heads = dict(kv_heads=attention.n_kv_heads or attention.n_heads,
                     head_dim=attention.head_dim or model.dim // attention.n_heads)  # fmt: skip
    shape = ModelShape(
        dim=model.dim, layers=len(model.layers), heads=attention.n_heads, **heads,
        ffn=dense[0].w1.out_features if dense else 0, vocab=model.vocab_size,
        rope_rows=len(model.layers) * attention.rope.max_seq_len if tables else tokens,
        rope_row_bytes=rope_row.numel() * rope_row.element_size(), **experts,
    )  # fmt: skip
    chunks = getattr(trainer.loss_fn, "num_chunks", 1)
    layout = Layout(
        fsdp=dims.dp_shard * dims.cp, tp=dims.tp, sequence_parallel=cfg.parallelism.enable_sequence_parallel,
        tokens=tokens, kv_rows=_kv_rows(dispatch), loss_tokens=tokens // chunks,
        full_ac=isinstance(cfg.activation_checkpoint, FullAC.Config),
        mlp_tiles=max(1, tile_count(ac["mlp_tiles"], tokens, shape.ffn // dims.tp, 2)) if shape.ffn else 1,
        offload=ac["offload"], ep=dims.ep, key_rows=dispatch.kv_index.numel(),
        cpu_offload=cfg.training.enable_cpu_offload,
    )  # fmt: skip
    return shape, dataclasses.replace(layout, low_precision=_low_precision(job, model, layout, dims.tp))


def _kv_rows(dispatch) -> int:
    """K/V rows of one layer's exchange at its peak: the receive buffer with the gathered keys or, in the
    two-level exchange's second stage, with the first stage's output, its copy joined to the local rows
    and the rows sent on (`flashcp.attention.two_level.launch`). The ring's peak is its backward: two KV
    blocks in flight and four blocks of float32 dK/dV sums (this rank's, the travelling, the arriving
    and one step's share; two bf16 rows each), whatever the window (`flashcp.attention.ring`)."""
    if dispatch.comm == "ring":
        return (2 + 4 * 2) * dispatch.token_index.numel()
    route = getattr(dispatch, "route", None)
    staged = 0
    if route is not None:
        first = sum(route.stage1_recv_splits)
        staged = 2 * first + dispatch.token_index.numel() + route.stage2_index.numel()
    return dispatch.recv_size + max(dispatch.kv_index.numel(), staged)


def _low_precision(job: dict[str, Any], model_config: Any, lay: Layout, tp: int) -> LowPrecision | None:
    """The job's converted linears as this rank runs them: TorchTitan's TP splits wo and w2 along their
    input (row-wise), the others along their output; the MLP runs a tile's tokens at a time, the output
    projection a loss slice's."""
    names = job["model"]["converters"]
    if not names:
        return None
    linears = []
    for fqn, lin in converted_linears(model_config, job):
        k, n = lin.in_features, lin.out_features
        k, n = (k // tp, n) if fqn.rsplit(".", 1)[-1] in ("wo", "w2") else (k, n // tp)
        tokens = lay.loss_tokens if fqn == "lm_head" else \
            math.ceil(lay.tokens / lay.mlp_tiles) if ".feed_forward." in fqn else lay.tokens  # fmt: skip
        linears.append((k, n, tokens))
    gw_hp = names[0] == "float8" and job["float8"]["recipe_name"] == "rowwise_with_gw_hp"
    return LowPrecision(names[0], tuple(linears), grad_weight_hp=gw_hp)
