"""TorchTitan's Trainer with a FlashCP context-parallel dimension.

Everything else (meshes, FSDP/TP, optimizer, LR schedule, loss normalisation, checkpoints) is
TorchTitan's; this subclass only changes how a batch reaches the model:

1. The loader yields one packed window (`input`, `labels`, `doc_lens`) with its sharding `plan`,
   the same on every rank of a CP group, and this rank's `Dispatch`, which the loader's
   background thread builds from the plan (index arithmetic, a few ms per window at 128K) into
   pinned memory on GPUs, so the main thread only starts its asynchronous copy to the device.
   With `[flashcp] plan_worker` (the default) and CP > 1, planning and the dispatch run in a
   child process (`flashcp.data.plan_worker`), so they do not hold the training thread's GIL;
   the loader's thread pins what it receives. The loader's state does not involve the worker.
   With `[flashcp] comm = "two_level"` the dispatch is `build_two_level_dispatch`'s for the CP
   group's ranks per node, read off the launch at start (`_cp_ranks_per_node`); with
   `comm = "ring"` it is `build_ring_dispatch`'s (Ring-Attn with `strategy = "ring"`, Ring-Attn
   (Zigzag) with `"per_doc"`).
2. `post_dataloading_process` keeps this rank's tokens, labels and in-document positions in the
   dispatch's `token_index` order and hands every attention layer the dispatch and CP group
   (`CPStep`, through the decoder's `attention_masks` argument). A model with sliding-window layers
   (gpt-oss) gets, beside the full dispatch, one per window, built from the same plan by the same
   thread or worker (`LayerDispatches`) with its own exchange (`[flashcp] window_comm`); its sinks'
   gradients, like every weight's, are summed over the CP ranks by FSDP (dp_shard x cp).
   A Qwen3.5 model (Gated DeltaNet layers) gets its linear layers' dispatch beside the full one, built
   in the same place (`HybridDispatches`), and its blocks the dict of both steps (`hybrid_masks`).
   With `[flashcp] scope = "mesh"` the window is the step's global batch (DP x C tokens), planned over
   all DP x CP ranks, whose group replaces the CP group (`flashcp.titan.mesh_scope`).
3. Labels stay whole-window until then, so TorchTitan's count of valid tokens (summed over
   data-parallel ranks only) is the global count; each rank's loss is its token sum over that
   count and the reported loss is the sum over DP x CP ranks. CP = 1 and CP = N therefore give
   the same loss and gradients on the same data.

With `[data] balance` (default "deferral-cut" with max_delay_steps 16 and every step keeping
min_pairs_kept of stream packing's attended pairs, docs/results.md; "deferral", "mesh-cut",
"mesh") the loader spreads each optimizer step's documents over all DP ranks x
micro steps by the model's predicted time per window (`flashcp.data.balance`,
`flashcp.data.deferral`): the MFU's FLOPs per token and per attended pair at measured dense and
attention efficiencies (`flashcp.costmodel.proxy`).

Around the loop (a stop on SIGTERM / SIGINT, unsound states never saved, restores checked, HF export
at the end) the run's safety is the base class's, `flashcp.titan.safe_trainer.SafeTrainer`.

With `[validation]`, TorchTitan's validator slot holds `flashcp.titan.components.validate.FlashCPValidator`,
which reads held-out windows through `window_inputs` / `flashcp_inputs`, the same steps as
training minus the counting (plan metrics, tokens seen).

With `[probe]`, `flashcp.titan.probe` scores a retrieval probe (a number hidden at a depth of held-out
text) through the same path after the training step at its frequency.

With pipeline parallelism TorchTitan's `pp_forward_backward_step` runs `post_dataloading_process` once
per microbatch (one window each, `[training] local_batch_size` of them a step) and hands each
microbatch's `CPStep` to every stage with that microbatch; the schedule holds them all until the
step's last backward (`flashcp.titan.config.pipeline`: what it runs).

With `model.attention` set to TorchTitan's flex attention instead, batches go through
TorchTitan's own path (document positions, its block masks and its built-in CP), so both CP
implementations can be compared inside one application.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torchtitan.distributed.activation_checkpoint import FullAC
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from flashcp.attention import build_two_level_dispatch, group_ranks_per_node, NodeLayoutError
from flashcp.attention.ring import build_ring_dispatch
from flashcp.costmodel.model import window_exchange
from flashcp.costmodel.proxy import window_cost
from flashcp.data.balance import WindowCost
from flashcp.data.errors import DataError
from flashcp.data.plan_worker import TIMEOUT_S as PLAN_WORKER_TIMEOUT_S
from flashcp.dispatch import build_dispatch
from flashcp.plan.plan import row_bytes
from flashcp.titan.models.attention import CPStep, flashcp_ropes, flashcp_windows
from flashcp.titan.models.gated_deltanet import deltanet_conv_width, hybrid_masks
from flashcp.titan.models.spec import uncounted_pipeline_inference
from flashcp.titan.models.windows import (
    attention_layers, build_hybrid_dispatches, build_layer_dispatches, HybridDispatches, planner_workload,
)
from flashcp.titan import mesh_scope
from flashcp.titan.mesh_scope import MeshScope, RANK_LABELS
from flashcp.titan.components.checkpoint import Checkpointer
from flashcp.titan.components.data import PipelineTokenizer, WindowDataLoader
from flashcp.titan.components.metrics import FlashCPMetrics
from flashcp.titan.components.validate import FlashCPValidator
from flashcp.titan.probe import loop as probe_loop
from flashcp.titan.probe.prompts import ProbeSettings
from flashcp.titan.safe_trainer import SafeTrainer


@dataclass(kw_only=True, slots=True)
class FlashCPSettings:
    """The job's `[flashcp]` section (see flashcp.titan.config.SCHEMA)."""

    enable: bool = True
    strategy: str = "flashcp"
    scope: str = "group"  # "mesh": one plan over all DP x CP ranks (flashcp.titan.mesh_scope)
    target_imbalance: float = 1.05
    comm: str = "compact"
    backend: str = "auto"
    overlap: bool = False
    plan_worker: bool = True
    plan_worker_timeout_seconds: float = PLAN_WORKER_TIMEOUT_S  # a worker silent this long: a WorkerError naming it
    ranks_per_node: int = 0  # comm = "two_level": the CP group's ranks per node; 0: from the launch
    window_comm: str = "auto"  # sliding-window layers' exchange (window_exchange); auto: needed / two_level


def document_positions(doc_lens: list[int]) -> torch.Tensor:
    """Each token's position inside its own document (RoPE and TorchTitan's document masks)."""
    lens = torch.tensor(doc_lens)
    starts = torch.cumsum(lens, 0) - lens
    return torch.arange(int(lens.sum())) - torch.repeat_interleave(starts, lens)


class FlashCPTrainer(SafeTrainer):
    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        """TorchTitan's config with FlashCP's components as defaults and the `[flashcp]` settings."""

        tokenizer: PipelineTokenizer.Config = field(default_factory=PipelineTokenizer.Config)
        dataloader: WindowDataLoader.Config = field(default_factory=WindowDataLoader.Config)
        checkpoint: Checkpointer.Config = field(default_factory=Checkpointer.Config)
        metrics: FlashCPMetrics.Config = field(default_factory=FlashCPMetrics.Config)
        validator: FlashCPValidator.Config = field(default_factory=FlashCPValidator.Config)
        flashcp: FlashCPSettings = field(default_factory=FlashCPSettings)
        probe: ProbeSettings = field(default_factory=ProbeSettings)

    metrics_processor: FlashCPMetrics
    dataloader: WindowDataLoader

    def _setup(self, config: Config) -> None:
        """FlashCP's setup after TorchTitan's (SafeTrainer's hook, inside its guard), then the run-safety hooks."""
        self.flashcp = config.flashcp
        dims = self.parallel_dims
        self.mesh = MeshScope.of(dims) if self.flashcp.scope == "mesh" and self.flashcp.enable else None
        if self.mesh is not None:  # the FlashCP group is the whole DP x CP mesh
            self.cp_rank, self.cp_group = self.mesh.rank, self.mesh.group
        elif dims.cp_enabled:
            cp_mesh = dims.get_mesh("cp")
            self.cp_rank, self.cp_group = cp_mesh.get_local_rank(), cp_mesh.get_group()
        else:
            self.cp_rank, self.cp_group = 0, None
        two_level, ranks = self.flashcp.comm == "two_level", self.mesh.ranks if self.mesh else dims.cp
        ranks_per_node = self._cp_ranks_per_node() if two_level or self.mesh else 0
        self.cp_ranks_per_node = ranks_per_node if two_level else 0
        if self.cp_ranks_per_node:
            g, nodes = self.cp_ranks_per_node, ranks // self.cp_ranks_per_node
            logger.info(f"two-level KV exchange: the {'mesh' if self.mesh else 'CP'} group spans {nodes} node(s) "
                        f"of {g} rank(s)"
                        + (" (set by [flashcp] ranks_per_node)" if self.flashcp.ranks_per_node else "")
                        + ("; on one node it is the needed exchange" if nodes == 1 else ""))  # fmt: skip
        self._configure_metrics()
        model = torch.nn.ModuleList(self.model_parts)  # every stage this rank holds (one without PP)
        if dims.pp_enabled:
            uncounted_pipeline_inference(self.pp_schedule, self.model_parts)  # MoE: real microbatches' counts
        self._flashcp_ropes = flashcp_ropes(model)  # RoPEs whose rows each step computes
        self._flashcp_windows = flashcp_windows(model)  # sliding windows each step dispatches
        self._flashcp_conv_width = deltanet_conv_width(model)  # Gated DeltaNet layers: their width
        if self._flashcp_windows and self.flashcp.comm != "ring":  # the ring with windows: refused below
            exchange = window_exchange(self.flashcp.comm, self.flashcp.window_comm)
            self.metrics_processor.window_comm = exchange
            logger.info(f"sliding-window layers exchange K/V by {exchange} ([flashcp] window_comm = "
                        f"{self.flashcp.window_comm!r}), the full layers by {self.flashcp.comm}")  # fmt: skip
        if self.mesh is not None:
            mesh_scope.attach(self, ranks_per_node)
        if self.flashcp.enable:
            worker = self.flashcp.plan_worker and ranks > 1
            self.dataloader.loader.dispatch_with(self.window_dispatcher(), worker=worker, finish=self.pin_dispatch,
                                                 worker_timeout_s=self.flashcp.plan_worker_timeout_seconds)  # fmt: skip
        if config.validator.enable:
            self.validator.connect(self, flashcp=self.flashcp.enable)
        self.probe = probe_loop.attach(self) if config.probe.enable else None
        data = config.dataloader.data
        balance = data.balance_args()
        if balance is not None:
            windows = self.gradient_accumulation_steps * self.num_pipeline_parallel_microbatches  # per DP rank and step
            self.dataloader.loader.balance_with(windows, self._window_cost(), **balance)
        self._connect_run_safety()

    def _cp_ranks_per_node(self) -> int:
        """The two-level exchange's (and the mesh plan's) ranks per node for this rank's FlashCP group (mesh
        scope: the DP x CP mesh's): `[flashcp] ranks_per_node`, else where the launch put every group's
        ranks (torchrun numbers ranks node by node, LOCAL_WORLD_SIZE per node; without it, one node). A
        layout the routes cannot describe stops every rank here, before training, with one line
        (NodeLayoutError, a job error)."""
        dims, mesh = self.parallel_dims, self.mesh
        cp = mesh.ranks if mesh else dims.cp
        if self.flashcp.ranks_per_node:  # simulated nodes (the config check: it divides cp, or DP x CP)
            return self.flashcp.ranks_per_node
        if cp == 1:
            return 1
        local = int(os.environ.get("LOCAL_WORLD_SIZE") or torch.distributed.get_world_size())
        # Every group, so that all ranks agree: TorchTitan's CP mesh is the cp axis of pp x batch x cp x tp
        # over the ranks in row-major order (ParallelDims.build_mesh), its loss mesh batch x cp flattened;
        # this rank's group is checked against it.
        outer, tp = dims.pp * dims.dp_replicate * dims.dp_shard, dims.tp
        groups = mesh.groups if mesh else [[(b * cp + c) * tp + t for c in range(cp)] for b in range(outer)
                                           for t in range(tp)]  # fmt: skip
        mine = torch.distributed.get_process_group_ranks(self.cp_group)
        if mine not in groups:
            raise RuntimeError(f"this rank's FlashCP group (global ranks {mine}) is not one of the pp x batch x cp "
                               f"x tp mesh's: TorchTitan's mesh order changed")  # fmt: skip

        what, fix = (("scope = 'mesh'", "scope = 'group', or DP x CP degrees") if mesh else
                     ("comm = 'two_level'", "comm = 'needed' or 'compact', or a CP degree"))  # fmt: skip

        def ranks_per_node(ranks: list[int]) -> int:
            try:
                return group_ranks_per_node([r // local for r in ranks])
            except NodeLayoutError as e:
                named = [str(r) for r in ranks] if len(ranks) <= 8 else [*map(str, ranks[:3]), "...", str(ranks[-1])]
                raise NodeLayoutError(
                    f"[flashcp] {what}: {e} (global ranks {', '.join(named)}; {local} ranks per node, "
                    f"LOCAL_WORLD_SIZE); use {fix} whose groups fill whole nodes or split them evenly"
                ) from None

        g = ranks_per_node(mine)  # a bad layout anywhere stops every rank, naming its own group if it is bad
        for ranks in groups:
            ranks_per_node(ranks)
        return g

    def train_step(self, data_iterator: Iterator[tuple[dict[str, Any], torch.Tensor]]) -> None:
        """TorchTitan's step, then the retrieval probe when `[probe]` asks for it at this step."""
        super().train_step(data_iterator)
        if self.probe is not None and self.config.probe.due(self.step):
            probe_loop.run(self, self.probe, self.step)

    def _window_cost(self) -> WindowCost:
        """What the loader balances by: the model's FLOPs at measured efficiencies (`flashcp.costmodel.proxy`),
        window layers by the W keys their queries see."""
        m = self.metrics_processor
        full_ac = isinstance(self.config.activation_checkpoint, FullAC.Config)
        return window_cost(m.dense_flops_per_token, m.attention_flops_per_pair, self.parallel_dims.cp, full_ac,
                           m.attention_workload)  # fmt: skip

    def _configure_metrics(self) -> None:
        """Tell the metrics what one token and one attended (query, key) pair cost, and which layers see at
        most W keys per query (`planner_workload`: the MFU's pairs and the balance count them so)."""
        metrics = self.metrics_processor
        model = self.model_config
        attention = model.first_attention
        n_heads = attention.n_heads
        dtype_bytes = torch.finfo(getattr(torch, self.config.training.mixed_precision_param)).bits // 8
        latent = None
        if getattr(attention, "kv_lora_rank", None):  # MLA: a QK head of nope + rope, its own V head; latent rows
            n_kv, qk_dim, v_dim = n_heads, attention.qk_nope_head_dim + attention.qk_rope_head_dim, attention.v_head_dim
            latent = attention.kv_lora_rank + attention.qk_rope_head_dim
        else:
            n_kv = attention.n_kv_heads or n_heads
            qk_dim = v_dim = attention.head_dim or model.dim // n_heads  # Qwen3's differs from dim / n_heads
        # QK^T and PV, forward + backward, in the layers that attend (a Qwen3.5 model's Gated DeltaNet layers
        # do not: their projections and recurrence are per-token FLOPs, `HybridDecoder`)
        per_pair = 6 * len(attention_layers(model)) * n_heads * (qk_dim + v_dim)
        metrics.total_steps = self.config.training.steps
        metrics.attention_flops_per_pair = per_pair
        metrics.attention_workload = planner_workload(model)
        # TorchTitan's per-token count includes full (unmasked) attention over seq_len keys in those layers.
        metrics.dense_flops_per_token = metrics.num_flops_per_token - per_pair * self.config.training.seq_len
        # K/V rows (what `kv: x full` compares with) and, for MLA, the latent rows the exchange moves
        metrics.kv_row_bytes = row_bytes(n_kv // self.parallel_dims.tp, qk_dim, dtype_bytes, v_dim)
        metrics.exchange_row_bytes = row_bytes(latent_dim=latent, dtype_bytes=dtype_bytes) if latent else 0
        metrics.ranks_per_node = self.cp_ranks_per_node
        metrics.kv_dtype_bytes, metrics.comm = dtype_bytes, self.flashcp.comm

    def batch_generator(
        self, data_iterable: Iterable[dict[str, Any]]
    ) -> Iterator[tuple[dict[str, Any], torch.Tensor]]:
        """Windows from the loader as TorchTitan's `(input_dict, labels)`, with this rank's dispatch.

        The loader ends only with `[data] loop = false`, and every step this is asked for is one that
        `training.steps` still wants: a DataError (exit 2, one line on the launcher's console), where
        TorchTitan's DataloaderExhaustedError would end the run early with exit 0 and a rank-log warning.
        """
        data_iterator = iter(data_iterable)
        while True:
            start = time.perf_counter()
            try:
                batch = next(data_iterator)
            except StopIteration as ex:
                data = self.config.dataloader.data
                named = f"the mixture of {', '.join(sorted(data.mix))}" if data.mix else repr(data.source)
                raise DataError(
                    f"the data ran out in step {self.step} of [training] steps = {self.config.training.steps} with "
                    f"[data] loop = false ({named} holds too few windows); set "
                    f"training.steps to at most {self.step - 1} or data.loop = true"
                ) from ex
            self.metrics_processor.data_loading_times.append(time.perf_counter() - start)
            input_dict, labels = self._window_inputs(batch)
            if self.mesh is not None:  # TorchTitan counts its DP group's labels; the rank's loss reads its own
                input_dict, labels = self.mesh.rank_inputs(input_dict, labels, batch["valid_labels"],
                                                           sum(batch["doc_lens"]))  # fmt: skip
            self.metrics_processor.ntokens_since_last_log += labels.numel()
            yield input_dict, labels

    def window_dispatcher(self) -> functools.partial:
        """`dispatcher(plan)`: this rank's dispatch of a window's plan (`LayerDispatches` when the model
        has sliding-window layers); picklable, for the plan worker."""
        if self.flashcp.comm == "ring":
            if self._flashcp_windows:  # the config check refuses it first
                raise ValueError("[flashcp] comm = 'ring' runs full attention only: not with sliding-window layers")
            return functools.partial(build_ring_dispatch, rank=self.cp_rank)
        full = self._dispatch_builder(self.flashcp.comm)
        if self._flashcp_conv_width:  # Qwen3.5: its Gated DeltaNet layers' dispatch beside the full layers'
            return functools.partial(build_hybrid_dispatches, build=full, rank=self.cp_rank,
                                     conv_width=self._flashcp_conv_width)  # fmt: skip
        if not self._flashcp_windows:
            return full
        window = self._dispatch_builder(window_exchange(self.flashcp.comm, self.flashcp.window_comm))
        return functools.partial(build_layer_dispatches, build=full, windows=self._flashcp_windows,
                                 build_window=window)  # fmt: skip

    def _dispatch_builder(self, comm: str) -> functools.partial:
        """`builder(plan, window=None)`: this rank's dispatch exchanging by `comm` (compact, full, needed
        or two_level, on the job's node layout)."""
        if comm == "two_level":
            return functools.partial(build_two_level_dispatch, rank=self.cp_rank,
                                     ranks_per_node=self.cp_ranks_per_node, overlap=self.flashcp.overlap)  # fmt: skip
        return functools.partial(build_dispatch, rank=self.cp_rank, comm=comm, overlap=self.flashcp.overlap)

    def pin_dispatch(self, dispatch: Any) -> Any:
        """Pinned on GPUs, so that post_dataloading_process's copy to the device does not block the host."""
        return dispatch.pin_memory() if self.device.type == "cuda" else dispatch

    def dispatch_window(self, plan: Any) -> Any:
        """This rank's dispatch of a window's plan, pinned; runs in the (validation) loader's thread."""
        return self.pin_dispatch(self.window_dispatcher()(plan))

    def _window_inputs(self, batch: dict[str, Any]) -> tuple[dict[str, Any], torch.Tensor]:
        self.metrics_processor.record_window(batch["plan"], batch["plan_ms"], batch.get("deferral"),
                                             batch.get("source_tokens"),
                                             batch.get("new_source_tokens"))  # fmt: skip
        return self.window_inputs(batch)

    def window_inputs(self, batch: dict[str, Any]) -> tuple[dict[str, Any], torch.Tensor]:
        """A loader window as TorchTitan's `(input_dict, labels)` (shared with validation, which counts nothing)."""
        input_dict: dict[str, Any] = {"input": batch["input"][None]}
        if self.flashcp.enable:
            input_dict["dispatch"] = batch["dispatch"]
        else:
            input_dict["positions"] = document_positions(batch["doc_lens"])[None]
        return input_dict, batch["labels"][None]

    def post_dataloading_process(
        self, input_dict: dict[str, Any], labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        if not self.flashcp.enable:
            return super().post_dataloading_process(input_dict, labels)
        inputs, labels, extra = self.flashcp_inputs(input_dict, labels)
        self.ntokens_seen += labels.numel()
        return inputs, labels, extra

    def flashcp_inputs(
        self, input_dict: dict[str, Any], labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """This rank's tokens, labels and in-document positions in dispatch order, and the `CPStep`."""
        dispatch = input_dict["dispatch"].to(self.device, non_blocking=True)
        if RANK_LABELS in input_dict:  # mesh scope: this rank's tokens and labels, taken on the host
            inputs, labels = input_dict["input"], input_dict[RANK_LABELS]
        else:
            inputs, labels = input_dict["input"][:, dispatch.token_index], labels[:, dispatch.token_index]
        if isinstance(dispatch, HybridDispatches):  # Qwen3.5: the full layers' CPStep, the linear ones' LinearStep
            step = hybrid_masks(dispatch, self.cp_group, self._flashcp_ropes)
        else:
            step = CPStep.of(self._flashcp_ropes, dispatch, self.cp_group)
        extra = {"positions": dispatch.positions[None], "attention_masks": step}
        return inputs, labels, extra

    def close(self) -> None:
        if hasattr(self, "dataloader"):  # absent when __init__ failed before building it
            self.dataloader.close()
        super().close()  # SafeTrainer's: the stop request, then TorchTitan's
