"""What a dry run found, and what to say about it: the `--json` object, the table, the levers.

`advice` names, for the term that does not fit, only levers the job does not already use; the
offload's time is modelled here (its bytes are tracked by the run) against the layer's compute, and
so are FSDP's CPU offload's copies per step. The verdict names the host memory a node needs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from flashcp.costmodel.proxy import H100_BF16_TFLOPS
from flashcp.titan.config.model import model_experts
from flashcp.titan.dryrun.estimate import all_params, cast_bytes, GIB, Layout, layer_params, LowPrecision
from flashcp.titan.dryrun.estimate import ModelShape
from flashcp.titan.models.offload import layer_input_bytes, offload_seconds, PCIE_GEN5_X16

SHARD_WIDER = "shard them wider: more ranks (data_parallel_shard_degree) or a higher tensor_parallel_degree"


def advice(category: str, cfg: dict[str, Any]) -> str:
    """What would shrink `category` in this job: only levers it does not already use, each naming its
    section, so that a job already at full AC with offload is never told to set either."""
    ac, loss = cfg["activation_checkpoint"], cfg["loss"]
    if category == "activations":
        levers = [] if ac["mode"] == "full" else ["set [activation_checkpoint] mode = 'full'"]
        if ac["mlp_tiles"] in (0, 1) and model_experts(cfg) is None:  # experts are not tiled (refused)
            levers.append("set [activation_checkpoint] mlp_tiles = 16 (the MLP's intermediate a tile at a time)")
        if not ac["offload"]:
            levers.append("set [activation_checkpoint] offload = true (full AC's layer inputs in host memory)")
        return ", or ".join([*levers, "raise context_parallel_degree (fewer tokens per rank)"])
    if category == "loss":
        chunks = ("set [loss] chunk_tokens = 2048 (the logits a slice at a time)" if loss["chunk_tokens"] == 0
                  else f"lower [loss] chunk_tokens (now {loss['chunk_tokens']})")  # fmt: skip
        return f"{chunks}, or raise tensor_parallel_degree (vocabulary split)"
    if category == "flashcp_buffers":
        return "raise tensor_parallel_degree (fewer KV heads per rank) or context_parallel_degree"
    if category == "model_buffers":
        return "raise context_parallel_degree (the RoPE rows of fewer tokens per rank)"
    if category == "host":
        inputs = "raise context_parallel_degree (fewer tokens per rank to keep)"
        levers = [inputs, "set [activation_checkpoint] offload = false"] if ac["offload"] else []
        if cfg["training"]["enable_cpu_offload"]:
            levers += ["set [training] enable_cpu_offload = false", SHARD_WIDER]
        return ", or ".join(levers) or inputs
    return SHARD_WIDER


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
    plan: dict[str, float | str]
    loss_chunks: int
    seconds: float
    host_gib: float = 0.0  # tracked: the host memory one rank keeps (offloaded layer inputs, CPU-offloaded shards)
    host_limit_gib: float = 256.0
    host_by_category: dict[str, float] = dataclasses.field(default_factory=dict)  # host_gib by category at its peak
    ranks_per_node: int = 8  # min(world_size, --ranks-per-node)
    cpu_offload: dict[str, Any] | None = None  # modelled: FSDP's CPU offload's copies per step
    offload: dict[str, Any] | None = None  # modelled: the copies' time against the layer's compute
    low_precision: dict[str, Any] | None = None  # modelled: a converter's casts, added to the tracked peak
    hf_import: str | None = None  # [checkpoint] initial_load_in_hf: rank 0's strict load plan (hfload.py)
    # PP: one stage measured, every pipeline rank derived (dryrun/pipeline.py); peak_gib and by_category
    # are then the worst rank's
    pipeline: dict[str, Any] | None = None
    # the largest tensors live at the tracked peak (of the measured stage under PP): name, kind, shape,
    # dtype, gib, op (the aten op that made it; "" for what existed before the step)
    peak_tensors: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    # [flashcp] scope = "mesh": the mesh window's K/V rows received per layer by rank (needed rows), the
    # busiest (the rank measured, `measured_rank`, and its receive buffer's rows), the share crossing nodes
    mesh: dict[str, Any] | None = None

    @property
    def casts_gib(self) -> float:
        return self.low_precision["casts_gib"] if self.low_precision else 0.0

    @property
    def fits_gpu(self) -> bool:
        return self.peak_gib + self.casts_gib + self.reserve_gib <= self.gpu_gib

    @property
    def fits(self) -> bool:
        return self.fits_gpu and self.host_gib <= self.host_limit_gib

    @property
    def host_gib_per_node(self) -> float:
        return self.host_gib * self.ranks_per_node

    def biggest(self) -> str:
        return max(self.by_category, key=self.by_category.get)

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Report:
        """The report an `as_json()` object holds (its derived keys, `fits` and `host_gib_per_node`, dropped)."""
        return cls(**{f.name: obj[f.name] for f in dataclasses.fields(cls) if f.name in obj})

    def as_json(self) -> dict[str, Any]:
        return {"fits": self.fits, **dataclasses.asdict(self), "host_gib_per_node": self.host_gib_per_node}


def offload_time(m: ModelShape, lay: Layout) -> dict[str, Any]:
    """Modelled: one layer's input copied each way at PCIe Gen5 x16 (`PCIE_GEN5_X16`) against that
    layer's dense forward at the H100's bf16 peak (a lower bound of its time: attention, MFU < 1 and
    the backward, 2 x more, only add), so `hides` errs on the side of saying no."""
    nbytes = layer_input_bytes(lay.tokens, 1, m.dim, 2, tp=lay.tp if lay.sequence_parallel else 1)
    forward_s = 2 * layer_params(m) / lay.tp * lay.tokens / (H100_BF16_TFLOPS * 1e12)
    return {
        "layer_gib_each_way": nbytes / GIB, "step_gib_each_way": (m.layers - 1) * nbytes / GIB,
        "copy_ms": offload_seconds(nbytes) * 1e3, "layer_forward_ms_at_peak": forward_s * 1e3,
        "link_gb_per_s": PCIE_GEN5_X16 / 1e9, "hides": offload_seconds(nbytes) <= forward_s,
    }  # fmt: skip


def cpu_offload_time(m: ModelShape, lay: Layout) -> dict[str, Any]:
    """Modelled: FSDP2's CPU offload copies a rank's fp32 parameter shards to the GPU before each
    all-gather (forward, and backward's re-gather: 2 a step), then casts them to bf16 there, and its
    fp32 gradient shards back once, at PCIe Gen5 x16 (`PCIE_GEN5_X16`); the copies of pinned memory
    overlap the compute, so the time is what the step has to hide. AdamW steps on the host's CPUs."""
    shard = 4 * all_params(m) / (lay.fsdp * lay.tp)
    up, down = 2 * shard, shard
    return {"up_gib_per_step": up / GIB, "down_gib_per_step": down / GIB,
            "copy_s_per_step": offload_seconds(up + down), "link_gb_per_s": PCIE_GEN5_X16 / 1e9}  # fmt: skip


def low_precision_report(lp: LowPrecision | None) -> dict[str, Any] | None:
    """Modelled: the converter's linears (run unconverted here: no torchao on fake tensors) and
    the casts their backward adds at most (`estimate.cast_bytes`, which states its source)."""
    if lp is None:
        return None
    return {"converter": lp.converter, "linears": len(lp.linears), "casts_gib": cast_bytes(lp) / GIB}


def pipeline_lines(pp: dict[str, Any]) -> list[str]:
    """The per-stage table: GiB per GPU of each pipeline rank, derived from the measured stage."""
    m = pp["measured"]
    lines = [
        f"pipeline: {pp['stages']} stages ({pp['stages_per_rank']} per rank), {pp['schedule']}, {pp['microbatches']} "
        f"microbatches; one stage measured ({m['layers']} layers, {m['world_size']} ranks, one microbatch: "
        f"{m['peak_gib']:.2f} GiB), every rank derived (dry run: flashcp/titan/dryrun/pipeline.py); the table "
        "above is the worst rank's",
        f"{'pp rank':<8}{'layers':>7}{'in flight':>10}{'params':>8}{'grads':>7}{'optim':>7}{'activ':>7}"
        f"{'other':>7}{'GiB/GPU':>9}",
    ]
    for s in pp["per_rank"]:
        g = s["by_category"]
        other = s["peak_gib"] - g["parameters"] - g["gradients"] - g["optimizer_states"] - g["activations"]
        ends = ("+emb" if s["embedding"] else "") + ("+out" if s["output"] else "")
        lines.append(f"{s['rank']:<8}{str(s['layers']) + ends:>7}{s['in_flight']:>10}{g['parameters']:>8.2f}"
                     f"{g['gradients']:>7.2f}{g['optimizer_states']:>7.2f}{g['activations']:>7.2f}{other:>7.2f}"
                     f"{s['peak_gib']:>9.2f}")  # fmt: skip
    return lines


def peak_tensor_lines(tensors: list[dict[str, Any]]) -> list[str]:
    """The largest tensors live at the peak, one line each."""
    if not tensors:
        return []
    lines = [f"largest at the peak: {'GiB':>6}  {'dtype':<9}{'shape':<22}{'op':<26}name"]
    for t in tensors:
        shape = "x".join(map(str, t["shape"])) or "-"
        lines.append(f"{'':<21}{t['gib']:>6.2f}  {t['dtype']:<9}{shape:<22}{t['op'] or '-':<26}{t['name']}")
    return lines


def mesh_line(m: dict[str, Any]) -> str:
    """The mesh window's plan: K/V received per rank, the busiest (measured), the share crossing nodes."""
    mib = m["kv_row_bytes"] / 2**20
    return (f"mesh scope: one plan of {m['window_tokens']} tokens over {m['ranks']} ranks ({m['nodes']} nodes of "
            f"{m['ranks_per_node']}), {m['node_cut_docs']} documents cut across nodes; KV received per layer "
            f"(needed rows): busiest rank {m['busiest_rank']} {m['kv_recv_rows_busiest'] * mib:.1f} MiB, mean "
            f"{m['kv_recv_rows_mean'] * mib:.1f} MiB, {100 * m['kv_fabric_share']:.0f} % of it across nodes; "
            f"measured as rank {m['measured_rank']} (receive buffer {m['kv_recv_rows_measured'] * mib:.1f} MiB)")


def format_report(r: Report) -> str:
    deg = " x ".join(f"{k} {v}" for k, v in r.degrees.items() if v > 1) or "1 rank"
    who = "rank 0" if r.mesh is None else f"mesh rank {r.mesh['measured_rank']} (the busiest)"
    lines = [
        f"dry run: {r.config} as {who} of {r.world_size} ({deg}), one step on fake tensors in {r.seconds:.0f} s",
        f"{'category':<18}{'tracked GiB':>12}{'estimate GiB':>14}",
    ]
    for name, gib in sorted(r.by_category.items(), key=lambda kv: -kv[1]):
        lines.append(f"{name:<18}{gib:>12.2f}{r.estimate_gib.get(name, 0.0):>14.2f}")
    lines.append(f"{'peak':<18}{r.peak_gib:>12.2f}{r.estimate_gib['peak']:>14.2f}")
    lines += peak_tensor_lines(r.peak_tensors)
    if r.loss_chunks > 1:
        lines.append(f"loss: cross-entropy in {r.loss_chunks} slices ([loss] chunk_tokens)")
    if "imbalance" in r.plan:
        mib = {k.removeprefix("kv_recv_bytes_per_layer_"): v / 2**20 for k, v in r.plan.items() if "kv_recv" in k}
        rows = "KV"
        if "latent_row_bytes" in r.plan:  # MLA
            rows = f"latent rows ({r.plan['kv_row_bytes'] / r.plan['latent_row_bytes']:.1f}x fewer bytes than K/V)"
        lines.append(
            f"window: {r.plan['docs_per_window']:.0f} documents, imbalance {r.plan['imbalance']:.3f}, "
            f"{r.plan['split_docs']:.0f} split; {rows} received per layer: compact {mib['compact']:.1f} MiB, "
            f"full {mib['full']:.1f} MiB, needed {mib['needed']:.1f} MiB"
            + (f"; the ring {mib['ring']:.1f} MiB forward, {mib['ring_backward']:.1f} MiB backward (KV and "
               f"float32 dK/dV sums)" if "ring" in mib else "")
        )
    if r.mesh is not None:
        lines.append(mesh_line(r.mesh))
    if "window" in r.plan:  # sliding-window layers: at most W - 1 rows before each cut shard
        mib = {k.removeprefix("kv_recv_bytes_per_layer_window_"): v / 2**20 for k, v in r.plan.items()
               if k.startswith("kv_recv_bytes_per_layer_window_")}  # fmt: skip
        used = r.plan["kv_recv_bytes_per_layer_window"] / 2**20
        lines.append(
            f"window layers ({r.plan['window_layers']} of {r.plan['window_layers'] + r.plan['full_layers']}, "
            f"W = {r.plan['window']}): KV received per layer {used:.2f} MiB by {r.plan['window_comm']} ([flashcp] "
            f"window_comm; compact {mib['compact']:.2f} MiB, needed {mib['needed']:.2f} MiB; the figures above are "
            "the full layers')"
        )
    if "state_recv_bytes_per_layer" in r.plan:  # a hybrid's Gated DeltaNet layers (dryrun/linear.py)
        mib = {k: v / 2**20 for k, v in r.plan.items() if k.startswith(("state_", "halo_"))}
        lines.append(
            f"Gated DeltaNet layers: state summaries received per layer {mib['state_recv_bytes_per_layer']:.1f} MiB "
            f"on the busiest rank (mean {mib['state_recv_bytes_per_layer_mean']:.1f} MiB, float32; tracked at the "
            f"busiest), conv halo rows {mib['halo_recv_bytes_per_layer']:.2f} MiB; the estimate prices these layers "
            "as full-attention ones"
        )
    if "kv_fabric_bytes_per_layer_two_level" in r.plan:  # comm = "two_level" across nodes
        mib = {k.removeprefix("kv_").removesuffix("_bytes_per_layer_two_level"): v / 2**20
               for k, v in r.plan.items() if k.startswith("kv_") and k.endswith("two_level")}  # fmt: skip
        needed = r.plan["kv_fabric_bytes_per_layer_needed"] / 2**20
        lines.append(
            f"two-level exchange: the busiest NIC's KV per layer {mib['fabric']:.1f} MiB (the flat needed "
            f"exchange's {needed:.1f} MiB), then {mib['nvlink']:.1f} MiB over NVLink"
        )
    if r.offload is not None:
        o = r.offload
        held = (f"{r.host_gib:.1f} GiB per rank in host memory (tracked; {r.host_limit_gib:g} GiB allowed)"
                if r.cpu_offload is None else "the layer inputs in host memory (with the shards: below)")  # fmt: skip
        lines.append(
            f"offload: {held}; "
            f"{o['step_gib_each_way']:.1f} GiB each way per step, a layer's {o['layer_gib_each_way']:.2f} GiB in "
            f"{o['copy_ms']:.1f} ms at {o['link_gb_per_s']:g} GB/s against its dense forward's "
            f"{o['layer_forward_ms_at_peak']:.1f} ms at peak (modelled): {'hides' if o['hides'] else 'does NOT hide'}"
        )
    if r.cpu_offload is not None:
        c, h = r.cpu_offload, r.host_by_category
        lines.append(
            f"cpu offload: {r.host_gib:.2f} GiB per rank in host memory at its peak (tracked: layer inputs "
            f"{h['layer_inputs']:.2f}, parameters {h['parameters']:.2f}, gradients {h['gradients']:.2f}, optimizer "
            f"states {h['optimizer_states']:.2f}; AdamW steps on the CPU); per step "
            f"{c['up_gib_per_step']:.1f} GiB of fp32 shards up, {c['down_gib_per_step']:.1f} GiB of gradients down, "
            f"{c['copy_s_per_step']:.2f} s at {c['link_gb_per_s']:g} GB/s to hide behind the step (modelled)"
        )
    if r.hf_import is not None:
        lines.append(f"HF import: {r.hf_import}")
    if r.pipeline is not None:
        lines += pipeline_lines(r.pipeline)
    casts = ""
    if r.low_precision is not None:
        lp = r.low_precision
        lines.append(
            f"{lp['converter']}: {lp['linears']} linears converted, tracked here unconverted (the same saved inputs, "
            f"weights and FSDP gathers); their casts in a backward add {lp['casts_gib']:.2f} GiB (modelled)"
        )
        casts = f" + {r.casts_gib:.1f} GiB casts (modelled)"
    verdict = "fits" if r.fits else "does NOT fit"
    host = ""
    if r.host_gib > 0:
        host = (f"; needs {r.host_gib_per_node:.0f} GiB of host memory per node of {r.ranks_per_node} ranks "
                f"({r.host_gib:.1f} GiB per rank, {r.host_limit_gib:g} GiB allowed)")  # fmt: skip
    lines.append(f"{verdict}: {r.peak_gib:.1f} GiB tracked{casts} + {r.reserve_gib:g} GiB reserve (CUDA context, "
                 f"NCCL, fragmentation) against a {r.gpu_gib:g} GiB GPU{host}")  # fmt: skip
    return "\n".join(lines)
