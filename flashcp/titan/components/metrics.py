"""TorchTitan's metrics plus what FlashCP changes: document-masked FLOPs, plan figures, progress.

TorchTitan counts attention FLOPs as if every token attended to the whole sequence; with packed
documents under a document mask a token only sees its own document's prefix, so the MFU here
counts exactly the (query, key) pairs the mask keeps: sum over documents of d (d + 1) / 2, and in a
sliding-window layer (gpt-oss) at most W keys per query (`flashcp.plan.Workload`).
Each logged step also reports the sharding plans of the windows this rank trained on since the
last log (workload imbalance, KV bytes received per layer under the full, compact and needed
exchanges, and a sliding-window layer's compact and needed ones apart with the one its layers run,
`kv_recv_bytes_per_layer_window` (`[flashcp] window_comm`); a hybrid model's Gated DeltaNet layers'
state summaries and conv halo rows received per layer beside them, `state_recv_bytes_per_layer`,
busiest rank and mean, `flashcp.plan.linear.linear_comm`), documents split across
ranks, planning time; with `comm = "two_level"` across nodes
also the busiest NIC's bytes per layer of the flat needed and the two-level exchange, and the
latter's NVLink stage, `flashcp.plan.nodes`; with `comm = "ring"` the ring's bytes per layer,
forward and backward, `flashcp.plan.ring.ring_transfers`), a data mixture's tokens per source in the
windows all ranks trained (`data/step_token_share/<name>`: of the steps since the last log, the
`mix:` of the log line; `data/tokens/<name>` and `data/token_share/<name>`: since the run's first
step, `so far`), counted by the loader from the first step on, and a progress line with an ETA.
In mesh scope (`flashcp.titan.mesh_scope`) a window is the whole mesh's, planned over all DP x CP ranks:
its figures describe the mesh, its attention pairs are shared by the DP groups, and `node_cut_docs` /
`node_cut_nodes_max` count the documents cut across nodes and the most nodes one of them spans.

TensorBoard: one run per dump folder (`<dump_folder>/<save_tb_folder>/run`), appended to by every
launch. TorchTitan's folder per launch time showed a resumed run as a separate run repeating
steps; here the first event of a launch purges whatever an earlier launch logged from the
restored step on (SummaryWriter's `purge_step`), so a run reads as one curve across resumes.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils.tensorboard import SummaryWriter
from torchtitan.components.metrics import _get_metrics_rank, BaseLogger, LoggerContainer, MetricsProcessor
from torchtitan.tools.logging import logger
from torchtitan.tools.utils import device_module, device_type

from flashcp.plan import CAUSAL, Plan, Workload
from flashcp.plan.linear import linear_comm
from flashcp.plan.nodes import node_metrics
from flashcp.plan.ring import ring_transfers
from flashcp.plan.window import window_metrics


@dataclass
class WindowStats:
    """Sums over the windows one rank processed since the last log."""

    windows: int = 0
    attention_pairs: float = 0.0  # per layer, averaged over the model's layers (`attention_pairs`)
    plan_ms: float = 0.0
    imbalance: list[float] = field(default_factory=list)
    # comm mode -> bytes per layer (window_<mode>: a window layer's; window: the mode its layers run)
    recv_bytes: dict[str, float] = field(default_factory=dict)
    kv_full_bytes: float = 0.0  # what the K/V all-gather of the same plans receives per layer
    fabric_bytes: dict[str, float] = field(default_factory=dict)  # needed / two_level -> busiest NIC's bytes per layer
    nvlink_bytes: float = 0.0  # two_level's second stage: the busiest rank's bytes per layer
    state_bytes: dict[str, float] = field(default_factory=dict)  # a linear layer's state / halo bytes (busiest, mean)
    split_docs: int = 0
    docs: int = 0
    node_cut_docs: int = 0  # mesh scope: documents cut across nodes
    node_cut_nodes: int = 0  # mesh scope: the most nodes one of them spans
    deferral: dict[str, float] = field(default_factory=dict)  # sums of the loader's per-step figures (max: max)
    source_tokens: dict[str, int] = field(default_factory=dict)  # a mixture: tokens trained per source so far
    new_source_tokens: dict[str, int] = field(default_factory=dict)  # of those, since the last log


def node_spans(plan: Plan) -> list[int]:
    """For each document a mesh plan cut across nodes (`plan_mesh`'s `node_cut`), the nodes holding a piece."""
    g, cut = plan.info["ranks_per_node"], set(plan.info["node_cut"])
    nodes: dict[int, set[int]] = {d: set() for d in cut}
    for rank, shards in enumerate(plan.ranks):
        for shard in shards:
            if shard.doc in cut:
                nodes[shard.doc].add(rank // g)
    return [len(n) for n in nodes.values()]


def attention_pairs(doc_lens: list[int], workload: Workload = CAUSAL) -> float:
    """(query, key) pairs a causal document mask keeps, averaged over the `workload`'s layers: d (d + 1) / 2
    per document in a full layer, min(p + 1, W) keys for the query at p in a sliding-window one."""
    attending = dataclasses.replace(workload, linear=None)  # a hybrid's linear layers attend no pairs
    work = attending.shards(np.zeros(len(doc_lens), dtype=np.int64), np.asarray(doc_lens, dtype=np.int64))
    return int(work.sum()) / (workload.full_layers + workload.window_layers)


def shares(prefix: str, tokens: dict[str, int]) -> dict[str, float]:
    """`prefix/<name>`: each name's share of the tokens (0 for all when there are none)."""
    total = sum(tokens.values())
    return {f"{prefix}/{name}": n / max(total, 1) for name, n in tokens.items()}


def format_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


class RunTensorBoardLogger(BaseLogger):
    """TensorBoard events of one run, across launches; opened at the first event of a launch."""

    def __init__(self, log_dir: str):
        self.log_dir = log_dir
        self.first_step = 1  # the first step this launch trains; earlier launches' events from it on are purged
        self.writer: SummaryWriter | None = None

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if self.writer is None:
            self.writer = SummaryWriter(self.log_dir, max_queue=1000, purge_step=self.first_step)
            logger.info(f"TensorBoard: {self.log_dir} (from step {self.first_step})")
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class FlashCPMetrics(MetricsProcessor):
    """MetricsProcessor whose `log` reports document-masked MFU, FlashCP plan figures and an ETA.

    The trainer sets `total_steps`, `dense_flops_per_token`, `attention_flops_per_pair` (every attending
    layer's FLOPs of one attended pair: a hybrid's Gated DeltaNet layers attend none, their FLOPs are
    per token), `attention_workload` (the model's full and sliding-window layers: the pairs are counted
    per layer with window layers' queries capped at W keys, and window layers' rows are reported apart)
    and `kv_row_bytes` (an MLA model's latent rows also `exchange_row_bytes`: bytes are counted in the
    rows the exchange moves, `kv: x full` against the K/V all-gather) after building the model, and
    calls `record_window` for every window.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        peak_tflops: float | None = None
        """Per-device peak for MFU; None: TorchTitan's GPU table (no MFU on CPU)."""

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        if config.peak_tflops is not None:
            self.peak_flops: float | None = config.peak_tflops * 1e12
        else:
            self.peak_flops = None if device_type == "cpu" else self.gpu_peak_flops
        self.total_steps = 0
        self.dense_flops_per_token = 0
        self.attention_flops_per_pair = 0
        self.attention_workload = CAUSAL  # the model's full and sliding-window layers (planner_workload)
        self.kv_row_bytes = 0  # bytes of one token's K and V on one rank (heads / tp)
        self.exchange_row_bytes = 0  # bytes of one row the exchange moves (MLA: a latent row); 0: K/V's
        self.kv_dtype_bytes = 2  # bytes of one of their elements
        self.ranks_per_node = 0  # comm = "two_level": the CP group's ranks per node (fabric figures); 0: none
        self.mesh_groups = 1  # DP groups one window spans (mesh scope: all of them, which share its attention)
        self.comm = "compact"  # the job's KV exchange: "ring" adds the ring's bytes and its ratio on the log line
        self.window_comm = "needed"  # the sliding-window layers' exchange (window_exchange; auto beside compact)
        self.stats = WindowStats()
        self._start: tuple[int, float] | None = None  # (step, time) of the first logged step

    def _build_metric_logger(self, *, config: Config, dump_folder: str, **kwargs: Any) -> BaseLogger:
        """TorchTitan's loggers without its per-launch TensorBoard folder, plus the run's own."""
        self.tensorboard: RunTensorBoardLogger | None = None
        loggers = super()._build_metric_logger(
            config=dataclasses.replace(config, enable_tensorboard=False), dump_folder=dump_folder, **kwargs
        )
        metrics_rank = _get_metrics_rank(parallel_dims=kwargs["parallel_dims"], pp_schedule=kwargs["pp_schedule"])
        if not config.enable_tensorboard or torch.distributed.get_rank() != metrics_rank:
            return loggers
        if not isinstance(loggers, LoggerContainer):
            loggers = LoggerContainer()
        self.tensorboard = RunTensorBoardLogger(os.path.join(dump_folder, config.save_tb_folder, "run"))
        loggers.add_logger(self.tensorboard)
        return loggers

    def resume_from(self, step: int) -> None:
        """The run continues after `step` (a restored checkpoint)."""
        if self.tensorboard is not None:
            self.tensorboard.first_step = step + 1

    def record_window(self, plan: Plan, plan_ms: float, deferral: dict[str, float] | None = None,
                      source_tokens: dict[str, int] | None = None,
                      new_source_tokens: dict[str, int] | None = None) -> None:  # fmt: skip
        """Account one window's plan (called once per micro step, on every rank), the figures of
        its step's deferral (the same on each window of a step, so their mean is the steps' mean) and
        a mixture's tokens per source in all ranks' windows (the same on every rank): so far, and
        those its batch added (summed: the steps since the last log)."""
        s = self.stats
        s.source_tokens = dict(source_tokens or s.source_tokens)
        for name, tokens in (new_source_tokens or {}).items():
            s.new_source_tokens[name] = s.new_source_tokens.get(name, 0) + tokens
        for key, value in (deferral or {}).items():
            old = s.deferral.get(key, 0.0)
            s.deferral[key] = max(old, value) if key == "delay_max" else old + value
        s.windows += 1
        s.attention_pairs += attention_pairs(plan.doc_lens, self.attention_workload) / self.mesh_groups
        if "node_cut" in plan.info:  # plan_mesh's
            spans = node_spans(plan)
            s.node_cut_docs += len(spans)
            s.node_cut_nodes = max([s.node_cut_nodes, *spans])
        s.plan_ms += plan_ms
        s.docs += len(plan.doc_lens)
        if plan.cp_size > 1:
            m = plan.metrics(num_kv_heads=1, head_dim=1, dtype_bytes=1)
            s.imbalance.append(m["imbalance"])
            s.split_docs += m["split_docs"]
            row = self.exchange_row_bytes or self.kv_row_bytes
            for mode in ("full", "compact", "needed"):
                rows = m[f"comm_{mode}_tokens"]
                s.recv_bytes[mode] = s.recv_bytes.get(mode, 0.0) + rows * row
            s.kv_full_bytes += m["comm_full_tokens"] * self.kv_row_bytes
            if self.attention_workload.window_layers:  # at most W - 1 rows before each cut shard
                w = window_metrics(plan, self.attention_workload.window)
                rows = {"full": m["comm_full_tokens"], "compact": w["window_compact_tokens"],
                        "needed": w["window_needed_tokens"], "two_level": w["window_needed_tokens"]}  # fmt: skip
                # both modes, then "window": the one the window layers run (two_level delivers the needed rows)
                for key, mode in (("window_compact", "compact"), ("window_needed", "needed"),
                                  ("window", self.window_comm)):  # fmt: skip
                    s.recv_bytes[key] = s.recv_bytes.get(key, 0.0) + rows[mode] * row
            if self.attention_workload.linear is not None:
                self._record_state(plan)
            if self.comm == "ring":  # KV blocks both ways, and the dK/dV sums (float32: twice bf16's bytes)
                sums_row = self.kv_row_bytes // self.kv_dtype_bytes * max(self.kv_dtype_bytes, 4)
                fwd, bwd = ring_transfers(plan.tokens_per_rank, plan.cp_size, self.kv_row_bytes, sums_row)
                s.recv_bytes["ring"] = s.recv_bytes.get("ring", 0.0) + sum(fwd)
                s.recv_bytes["ring_backward"] = s.recv_bytes.get("ring_backward", 0.0) + sum(bwd)
            if 0 < self.ranks_per_node < plan.cp_size:  # a CP group across nodes: what crosses the fabric
                nodes = node_metrics(plan, self.ranks_per_node, row)
                for mode, key in (("needed", "flat_inter_bytes"), ("two_level", "two_level_inter_bytes")):
                    s.fabric_bytes[mode] = s.fabric_bytes.get(mode, 0.0) + nodes[key]
                s.nvlink_bytes += nodes["two_level_intra_bytes"]

    def _record_state(self, plan: Plan) -> None:
        """A Gated DeltaNet layer's forward receives per rank: summaries (float32) and conv halo rows."""
        lin, s = self.attention_workload.linear, self.stats
        comm = linear_comm(plan, lin.heads, lin.key_dim, lin.value_dim, lin.conv_channels,
                           dtype_bytes=self.kv_dtype_bytes, conv_width=lin.conv_width)  # fmt: skip
        for kind, rows in (("state", comm.state_recv), ("halo", comm.halo_recv)):
            for key, value in ((f"{kind}_recv_bytes_per_layer", max(rows)),
                               (f"{kind}_recv_bytes_per_layer_mean", sum(rows) / len(rows))):  # fmt: skip
                s.state_bytes[key] = s.state_bytes.get(key, 0.0) + value

    def _flashcp_metrics(self) -> dict[str, float]:
        s = self.stats
        if not s.windows:
            return {}
        out = {
            "flashcp/planning_ms": s.plan_ms / s.windows,
            "flashcp/docs_per_window": s.docs / s.windows,
        }
        for key, value in s.deferral.items():
            out[f"flashcp/deferral_{key}"] = value if key == "delay_max" else value / s.windows
        out |= {f"data/tokens/{name}": tokens for name, tokens in s.source_tokens.items()}
        out |= shares("data/token_share", s.source_tokens)
        out |= shares("data/step_token_share", s.new_source_tokens)
        if s.imbalance:
            out |= {
                "flashcp/imbalance": sum(s.imbalance) / len(s.imbalance),
                "flashcp/imbalance_max": max(s.imbalance),
                "flashcp/split_docs": s.split_docs / s.windows,
            }
            if self.mesh_groups > 1:
                out |= {"flashcp/node_cut_docs": s.node_cut_docs / s.windows,
                        "flashcp/node_cut_nodes_max": s.node_cut_nodes}  # fmt: skip
            for mode, total in s.recv_bytes.items():
                out[f"flashcp/kv_recv_bytes_per_layer_{mode}"] = total / s.windows
            if s.kv_full_bytes:  # `kv: x full` is against the K/V all-gather, latent rows or not
                out["flashcp/comm_compact_over_full"] = s.recv_bytes["compact"] / s.kv_full_bytes
                if "ring" in s.recv_bytes:  # forward + backward over the all-gather's + reduce-scatter's
                    ring = s.recv_bytes["ring"] + s.recv_bytes["ring_backward"]
                    out["flashcp/comm_ring_over_full"] = ring / (2 * s.kv_full_bytes)
            out |= {f"flashcp/{key}": total / s.windows for key, total in s.state_bytes.items()}
            for mode, total in s.fabric_bytes.items():
                out[f"flashcp/kv_fabric_bytes_per_layer_{mode}"] = total / s.windows
            if s.fabric_bytes:
                out["flashcp/kv_nvlink_bytes_per_layer_two_level"] = s.nvlink_bytes / s.windows
        return out

    def log(
        self,
        step: int,
        global_avg_loss: float,
        global_max_loss: float,
        grad_norm: float,
        extra_metrics: dict[str, Any] | None = None,
    ) -> None:
        now = time.perf_counter()
        dt = now - self.time_last_log
        devices = self.parallel_dims.non_data_parallel_size  # ranks that share one window
        tps = self.ntokens_since_last_log / (dt * devices)
        flops = (
            self.dense_flops_per_token * self.ntokens_since_last_log
            + self.attention_flops_per_pair * self.stats.attention_pairs
        ) / (dt * devices)
        mem = self.device_memory_monitor.get_peak_stats()
        loading = self.data_loading_times
        metrics = {
            "loss_metrics/global_avg_loss": global_avg_loss,
            "grad_norm": grad_norm,
            "throughput(tps)": tps,
            "tflops": flops / 1e12,
            "time_metrics/end_to_end(s)": dt / self.config.log_freq,
            "time_metrics/data_loading(s)": sum(loading) / max(len(loading), 1),
            "time_metrics/data_loading(%)": 100 * sum(loading) / dt,
            "memory/max_active(GiB)": mem.max_active_gib,
            "memory/max_reserved(GiB)": mem.max_reserved_gib,
            "memory/max_reserved(%)": mem.max_reserved_pct,
            **self._allocated_peak(),
            **self._flashcp_metrics(),
            **(extra_metrics or {}),
        }
        if self.peak_flops:
            metrics["mfu(%)"] = 100 * flops / self.peak_flops
        if self.parallel_dims.cp == 1 and self.mesh_groups == 1:
            # TorchTitan divides each rank's loss by the whole window's token count, which under CP
            # is not the rank's own count: the max over ranks is only meaningful without CP.
            metrics["loss_metrics/global_max_loss"] = global_max_loss
        self.logger.log(metrics, step)
        logger.info(self._console_line(step, metrics, now))

        self.ntokens_since_last_log = 0
        self.data_loading_times.clear()
        self.stats = WindowStats()
        self.time_last_log = time.perf_counter()
        self.device_memory_monitor.reset_peak_stats()

    def _allocated_peak(self) -> dict[str, float]:
        """torch.cuda.max_memory_allocated() since the last log, beside TorchTitan's active / reserved
        peaks: what the dry run's tracked peak is compared with (none on the CPU)."""
        stats = device_module.memory_stats(self.device_memory_monitor.device)
        peak = stats.get("allocated_bytes.all.peak")
        return {} if peak is None else {"memory/max_allocated(GiB)": peak / 2**30}

    def _console_line(self, step: int, m: dict[str, Any], now: float) -> str:
        c = self.color
        lr = next((v for k, v in m.items() if k.startswith("lr/")), None)
        parts = [
            f"{c.red}step: {step}/{self.total_steps}",
            f"{c.green}loss: {m['loss_metrics/global_avg_loss']:8.5f}",
            f"{c.orange}grad_norm: {m['grad_norm']:7.4f}",
        ]
        if lr is not None:
            parts.append(f"lr: {lr:.2e}")
        parts += [
            f"{c.turquoise}memory: {m['memory/max_reserved(GiB)']:5.2f}GiB",
            f"{c.blue}tps: {round(m['throughput(tps)']):,}",
            f"{c.cyan}tflops: {m['tflops']:,.3f}",
        ]
        if "mfu(%)" in m:
            parts.append(f"{c.magenta}mfu: {m['mfu(%)']:.2f}%")
        if "flashcp/imbalance" in m:
            parts.append(
                f"{c.yellow}imbalance: {m['flashcp/imbalance']:.3f}  "
                f"kv: {m.get('flashcp/comm_ring_over_full', m.get('flashcp/comm_compact_over_full', 0.0)):.2f}x full"
                f"{' (ring, fwd+bwd)' if 'flashcp/comm_ring_over_full' in m else ''}  "
                f"plan: {m['flashcp/planning_ms']:.1f}ms"
            )
        recent, so_far = ([f"{k.removeprefix(p)} {100 * v:.1f}%" for k, v in m.items() if k.startswith(p)]
                          for p in ("data/step_token_share/", "data/token_share/"))  # fmt: skip
        if recent:
            parts.append(f"{c.white}mix: {' '.join(recent)} (so far {' '.join(so_far)})")
        if self._start is None:
            self._start = (step, now)
        elif step > self._start[0]:
            rate = (now - self._start[1]) / (step - self._start[0])
            eta = format_duration(rate * (self.total_steps - step))
            parts.append(f"{c.white}{rate:.2f}s/step  eta: {eta}")
        return "  ".join(parts) + c.reset
