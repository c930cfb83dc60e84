"""Predicted time of one training step of a Llama model on a DP x CP mesh (MODELLED, not measured).

`CostModel` prices one attention layer of one CP group; a step also runs the dense layers and
FSDP's parameter and gradient traffic, on every DP group, and waits for the slowest:

- Dense work per CP rank: 6 x (parameters outside the embedding table) FLOPs per token of its
  C / N tokens, at `dense_tflops`: by default TorchTitan's published MFU for Llama 3.1 8B on
  H100 (`proxy.DENSE_MFU`, the number the balancer's cost uses too) times the bf16 peak; a GPU
  check's decoder measurement can replace it. Projections, MLP and LM head as GEMMs, norms and
  activations included.
- Attention: `CostModel.step(system, ...)` of the window's plan (KV exchange, kernels, copies,
  forward + backward) times the layer count, times the system's `attention_scale` on more than
  one rank (see `paper_ratio_scales`: the layer model's speedups are above the paper's measured
  ones, so until per-rank kernel timings calibrate it, each system's time is scaled to the
  measured ratios; one rank runs the same kernel whatever the system). The
  CP group synchronises at every layer's collective, so the group's time is its slowest rank's.
- Full activation checkpointing (the shipped configs) runs every layer's forward again in the
  backward: 2 more FLOPs per parameter and token of dense work (`proxy.FULL_AC_DENSE`) and one
  more attention forward
  (its KV exchange included, the op is re-run whole), counted as `recompute`.
- FSDP over all DP x CP ranks (TorchTitan shards parameters over dp_shard x cp): per micro step
  every rank gathers the bf16 parameters twice (forward, and again in backward after
  `reshard_after_forward`) and reduce-scatters fp32 gradients, 8 bytes per parameter in all.
  Inside one node (<= `gpus_per_node` ranks) it is priced with the measured NVLink tables,
  across nodes at `inter_node_busbw_gbps` (ASSUMED), or with the hierarchical model of
  `flashcp.costmodel.fabric` when the attention model's comm is one. It overlaps with compute (prefetching the
  next layer); only what exceeds the compute is exposed (ASSUMED: perfect overlap up to that).
- A micro step ends with FSDP's collectives, which every rank joins: it takes as long as the
  slowest DP group's window. The step is the sum over its micro steps; the optimizer update is
  the same for every system and left out.

A mixture-of-experts model (`LlamaShape.expert_params` > 0, e.g. Qwen3-30B-A3B) costs per token
what its active parameters cost: the dense GEMMs count the non-expert parameters and top_k /
experts of the routed experts' (`active_params`), as TorchTitan's MFU count does. With expert
parallelism (`ep` ranks) each MoE layer adds the token dispatcher's all-to-all (dispatch and
combine, tokens x top_k x dim bf16 rows each way; forward, backward and full AC's recompute),
priced as an all-gather of the same bytes over the EP ranks and not overlapped (TorchTitan's
standard dispatcher waits for it), counted in `dense` (and its forward again in `recompute`), and
FSDP gathers a rank's experts only (expert parameters / ep) over the remaining ranks. Balanced
routing is assumed: a skewed step waits for its busiest expert rank.

An MLA model (DeepSeek-V3 family) prices its attention layer at Q/K head dim nope + rope and V's
own head dim (`AttentionShape`: the kernel at the larger, V padded) and, with `kv_lora_rank`, the
latent exchange: latent rows on the wire and each rank's up-projection of its key rows.

A model with sliding-window layers (`LlamaShape.window_layers` of `window` keys; gpt-oss: half its
layers, W = 128) prices those layers with `CostModel.step(..., window=W)` (the kernel over the
band; the exchange `model.window_exchange` picks, as the trainer's `[flashcp] window_comm`: by
default FlashCP's needed window rows, the baselines' halo of W - 1 rows per cut; `window_comm`
overrides it) and the rest as full layers; FlashCP plans balance both kinds' work
(`LlamaShape.workload`, `flashcp.plan.Workload`).

A hybrid model (`LlamaShape.linear`, `flashcp.plan.linear.LinearLayers`: Qwen3.5's Gated DeltaNet
layers, 3 of every 4) prices its full layers as above and its linear layers on the slowest rank:
their recurrence, linear in its tokens, plus what its cut pieces add (middle pieces' summary pass,
folds; `LinearLayers.cut_work`), at `linear_tflops` (ASSUMED until a GPU check measures the kernel;
x3 with the backward), and the state and conv-halo all-to-all-v of the plan (`linear_comm`, its
busiest rank's bytes; the backward sends as many back). FlashCP plans balance both kinds
(`Workload.linear`). The projections of every layer kind are dense work per token, as above.

Memory is not modelled: Llama 3 70B on one node at DP = 1 would not fit without TP.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from flashcp import plan_shards
from flashcp.costmodel.model import AttentionShape, check_window_comm, CostModel
from flashcp.costmodel.proxy import DENSE_MFU, FULL_AC_DENSE, H100_BF16_TFLOPS
from flashcp.plan.linear import HYBRID_SHAPES, hybrid_from_hf, linear_comm, LinearLayers
from flashcp.plan.plan import Plan, Workload


@dataclass(frozen=True)
class LlamaShape:
    """What a step's cost needs of a Llama model."""

    name: str
    params: float
    dim: int
    n_layers: int
    heads: int
    kv_heads: int
    vocab: int
    head_dim: int = 128
    expert_params: float = 0.0  # routed experts' parameters, all layers (0: a dense model)
    experts: int = 0
    top_k: int = 0
    v_head_dim: int | None = None  # MLA: V's head dim (head_dim is Q's and K's, nope + rope)
    kv_lora_rank: int | None = None  # MLA with the latent exchange (None: K/V rows are exchanged)
    rope_dim: int = 0  # MLA: the RoPE part of head_dim
    window_layers: int = 0  # layers of sliding-window attention (the others attend the whole document)
    window: int | None = None  # their keys per query (HF sliding_window)
    linear: LinearLayers | None = None  # a hybrid's Gated DeltaNet layers (counted in n_layers too)

    @property
    def full_layers(self) -> int:
        return self.n_layers - self.window_layers - (self.linear.layers if self.linear else 0)

    @property
    def workload(self) -> Workload:
        """What FlashCP plans balance: both layer kinds' work, the counts reduced (equal ratios,
        equal plans); a hybrid's full layers and its `linear` ones."""
        if self.linear is not None:
            return Workload(full_layers=self.full_layers, linear=self.linear)
        full = self.n_layers - self.window_layers
        g = math.gcd(full, self.window_layers)
        return Workload(full // g, self.window_layers // g, self.window)

    @property
    def active_params(self) -> float:
        """Parameters one token runs through: all of a dense model's, top_k of each layer's experts."""
        routed = self.expert_params * self.top_k / self.experts if self.experts else 0.0
        return self.params - self.expert_params + routed

    @property
    def dense_flops_per_token(self) -> float:
        """Forward + backward of every weight matrix a token runs through (the embedding lookup is no GEMM)."""
        return 6.0 * (self.active_params - self.vocab * self.dim)

    @property
    def attention(self) -> AttentionShape:
        return AttentionShape(heads=self.heads, kv_heads=self.kv_heads, head_dim=self.head_dim,
                              v_head_dim=self.v_head_dim, kv_lora_rank=self.kv_lora_rank, rope_dim=self.rope_dim)  # fmt: skip


def mla_attention_params(dim: int, heads: int, q_lora_rank: int, kv_lora_rank: int, nope: int, rope: int,
                         v: int) -> int:  # fmt: skip
    """One MLA layer's projections: q (or its low-rank pair and norm), wkv_a to the latent row, the
    latent norm, wkv_b up to each head's k_nope and v, and wo."""
    q = (dim + 1 + heads * (nope + rope)) * q_lora_rank if q_lora_rank else dim * heads * (nope + rope)
    return q + dim * (kv_lora_rank + rope) + kv_lora_rank + kv_lora_rank * heads * (nope + v) + heads * v * dim


def mla_moe_shape(name: str, *, dim: int, n_layers: int, dense_layers: int, vocab: int, heads: int, q_lora_rank: int,
                  kv_lora_rank: int, nope: int, rope: int, v: int, dense_hidden: int, moe_hidden: int, experts: int,
                  shared: int, top_k: int) -> LlamaShape:  # fmt: skip
    """A DeepSeek-V3-family model (MLA attention, `dense_layers` dense then MoE layers with `shared`
    always-on experts), its parameters counted from its dimensions as TorchTitan builds it (untied
    output, no MTP head), exchanging latent rows (`dataclasses.replace(..., kv_lora_rank=None)`
    prices the same model exchanging K/V)."""
    attention = mla_attention_params(dim, heads, q_lora_rank, kv_lora_rank, nope, rope, v)
    routed = experts * 3 * dim * moe_hidden
    moe_rest = dim * experts + shared * 3 * dim * moe_hidden
    params = 2 * vocab * dim + dim + n_layers * (attention + 2 * dim) + dense_layers * 3 * dim * dense_hidden
    params += (n_layers - dense_layers) * (routed + moe_rest)
    return LlamaShape(name, float(params), dim, n_layers, heads, heads, vocab, head_dim=nope + rope,
                      expert_params=float((n_layers - dense_layers) * routed), experts=experts, top_k=top_k,
                      v_head_dim=v, kv_lora_rank=kv_lora_rank, rope_dim=rope)  # fmt: skip


LLAMA3_8B = LlamaShape("Llama 3 8B", 8.03e9, 4096, 32, 32, 8, 128256)
LLAMA3_70B = LlamaShape("Llama 3 70B", 70.6e9, 8192, 80, 64, 8, 128256)
# TorchTitan's 30B-A3B flavor: 48 layers of 128 experts (768 wide), 8 per token; 3.35e9 active.
QWEN3_30B_A3B = LlamaShape("Qwen3 30B-A3B", 30.532e9, 2048, 48, 32, 4, 151936, expert_params=48 * 128 * 3 * 2048 * 768,
                           experts=128, top_k=8)  # fmt: skip
# TorchTitan's deepseek_v3 flavors: 16B (DeepSeek-V2-Lite's shape; 15.7e9 parameters, 2.66e9 active)
# and 671B (DeepSeek-V3; 671e9, 37.6e9 active), both kv_lora_rank 512, rope 64, qk_nope 128, v 128.
DEEPSEEK_V3_16B = mla_moe_shape("DeepSeek-V3 16B", dim=2048, n_layers=27, dense_layers=1, vocab=102400, heads=16,
                                q_lora_rank=0, kv_lora_rank=512, nope=128, rope=64, v=128, dense_hidden=10944,
                                moe_hidden=1408, experts=64, shared=2, top_k=6)  # fmt: skip
# gpt-oss (OpenAI's model card, HF configs): hidden 2880, 64 query / 8 KV heads of 64, every other
# layer a 128-key sliding window; 32 / 128 experts of 3 x 2880 x 2880 (SwiGLU), 4 per token; vocabulary
# o200k_harmony. 20.91e9 / 116.83e9 parameters, 3.61e9 / 5.13e9 active (without the embedding).
GPT_OSS_20B = LlamaShape("gpt-oss-20b", 20.91e9, 2880, 24, 64, 8, 201088, head_dim=64,
                         expert_params=24 * 32 * 3 * 2880**2, experts=32, top_k=4, window_layers=12,
                         window=128)  # fmt: skip
GPT_OSS_120B = LlamaShape("gpt-oss-120b", 116.83e9, 2880, 36, 64, 8, 201088, head_dim=64,
                          expert_params=36 * 128 * 3 * 2880**2, experts=128, top_k=4, window_layers=18,
                          window=128)  # fmt: skip
# TorchTitan's qwen3_5 9B flavor, text decoder (its vision encoder left out): 32 layers, every 4th full
# attention (16 heads of 256, 4 K/V heads), the others Gated DeltaNet; untied 248,320-token vocabulary.
QWEN3_5_9B = LlamaShape("Qwen3.5 9B", 8.953803264e9, 4096, 32, 16, 4, 248320, head_dim=256,
                        linear=hybrid_from_hf(HYBRID_SHAPES["qwen3_5_9b"]))  # fmt: skip
DEEPSEEK_V3_671B = mla_moe_shape("DeepSeek-V3 671B", dim=7168, n_layers=61, dense_layers=3, vocab=129280, heads=128,
                                 q_lora_rank=1536, kv_lora_rank=512, nope=128, rope=64, v=128, dense_hidden=18432,
                                 moe_hidden=2048, experts=256, shared=1, top_k=8)  # fmt: skip


@dataclass(frozen=True)
class MeshAssumptions:
    """The constants the step model does not take from the attention model's measured tables."""

    dense_tflops: float = DENSE_MFU * H100_BF16_TFLOPS  # published MFU (see flashcp.costmodel.proxy)
    full_ac: bool = True  # full activation checkpointing: every layer's forward runs twice
    attention_scale: Mapping[str, float] = field(default_factory=dict)  # per system, 1 where absent
    inter_node_busbw_gbps: float = 40.0  # ASSUMED: FSDP across nodes, 400 Gb/s NIC per GPU, 80 % achieved
    gpus_per_node: int = 8
    fsdp_bytes_per_param: float = 8.0  # bf16 all-gather x 2 + fp32 reduce-scatter
    linear_tflops: float = 0.25 * H100_BF16_TFLOPS  # ASSUMED: a chunked Gated DeltaNet kernel on LinearLayers' FLOPs


@dataclass
class StepBreakdown:
    """One step's predicted time (ms) and where it goes, for the slowest DP group of each micro step."""

    total: float = 0.0
    dense: float = 0.0
    attention: float = 0.0  # KV exchange, kernels and copies of every layer
    recompute: float = 0.0  # activation checkpointing's second forward, dense and attention
    fsdp_exposed: float = 0.0
    group_spread: list[float] = field(default_factory=list)  # per micro step: max / mean over DP groups


class StepModel:
    """Step time of `model` on a DP x CP mesh for one CP system; see the module docstring."""

    def __init__(self, attention: CostModel, model: LlamaShape, cp: int, dp: int,
                 assumptions: MeshAssumptions | None = None, plans: dict | None = None, ep: int = 1,
                 window_comm: str = "auto"):  # fmt: skip
        """`plans`: a cache of window plans to share between models of the same CP size; `ep`: an MoE
        model's expert-parallel ranks (borrowed from DP x CP); `window_comm`: the sliding-window layers'
        exchange (`model.window_exchange`; "auto": what the trainer's default runs)."""
        if ep > 1 and (not model.experts or (dp * cp) % ep or model.experts % ep):
            raise ValueError(f"ep = {ep} needs a mixture of experts whose experts and DP x CP ({dp * cp}) it divides")
        self.attention, self.model, self.cp, self.dp, self.ep = attention, model, cp, dp, ep
        check_window_comm(window_comm)
        self.window_comm = window_comm
        self.assume = assumptions or MeshAssumptions()
        self._plans: dict[tuple[str, tuple[int, ...]], Plan] = {} if plans is None else plans

    def plan(self, strategy: str, doc_lens: Sequence[int]) -> Plan:
        workload = self.model.workload
        key = (strategy, tuple(doc_lens), workload)
        if key not in self._plans:
            self._plans[key] = plan_shards(list(doc_lens), self.cp, strategy=strategy, workload=workload)
        return self._plans[key]

    def dense_ms(self, tokens: int) -> float:
        """Dense work of one CP rank holding `tokens` tokens (forward + backward, no recompute), with
        an MoE model's expert all-to-all (forward + backward)."""
        gemms = self.model.dense_flops_per_token * tokens / (self.assume.dense_tflops * 1e12) * 1e3
        return gemms + 2 * self.all_to_all_ms(tokens)

    def all_to_all_ms(self, tokens: int) -> float:
        """Every MoE layer's dispatch and combine for one forward of `tokens` tokens on this rank."""
        if self.ep == 1:
            return 0.0
        rows = tokens * self.model.top_k * self.model.dim * 2  # bf16 bytes each way
        return 2 * self.model.n_layers * self.attention.comm.all_gather_ms(rows / self.ep, self.ep)

    def attention_ms(self, system: str, doc_lens: Sequence[int]) -> tuple[float, float]:
        """All layers' attention of one window on its CP group (slowest rank): forward + backward,
        and the forward again that full activation checkpointing recomputes (0 without it)."""
        # ring systems read only the window's lengths off whichever plan they are given
        systems, m = self.attention.systems, self.model
        strategy = systems[system][0] if system in systems else "per_seq"
        plans = {strategy: self.plan(strategy, doc_lens)}
        # one rank runs one kernel whatever the system: the CP systems' measured ratios do not apply
        scale = self.assume.attention_scale.get(system, 1.0) if self.cp > 1 else 1.0
        training = inference = 0.0
        for layers, window in ((m.full_layers, None), (m.window_layers, m.window)):
            if layers:
                layer = self.attention.step(system, m.attention, plans, window, self.window_comm)
                training += layer.training * (scale * layers)
                inference += layer.inference * (scale * layers) if self.assume.full_ac else 0.0
        if m.linear is not None:
            compute, exchange = self.linear_ms(plans[strategy])
            training += 3 * compute + 2 * exchange
            inference += compute + exchange if self.assume.full_ac else 0.0
        return training, inference

    def linear_ms(self, plan: Plan) -> tuple[float, float]:
        """A hybrid's linear layers' forward on the slowest rank: the kernel's time (recurrence and what
        cuts add) and the state and halo exchange's (all layers; `linear_comm`'s busiest rank)."""
        lin, n = self.model.linear, plan.cp_size
        work = max(lin.token_flops * plan.tokens_per_rank + c for c in lin.cut_work(plan))
        compute = work / (self.assume.linear_tflops * 1e12) * 1e3
        if n == 1:
            return compute, 0.0
        comm = linear_comm(plan, lin.heads, lin.key_dim, lin.value_dim, lin.conv_channels, conv_width=lin.conv_width)
        link = max(max(a + b for a, b in zip(comm.state_sent, comm.halo_sent)),
                   max(a + b for a, b in zip(comm.state_recv, comm.halo_recv)))  # fmt: skip
        return compute, lin.layers * self.attention.comm.all_to_all_ms(link, n) if link else 0.0

    def window_ms(self, system: str, doc_lens: Sequence[int]) -> tuple[float, float, float]:
        """(dense, attention, recompute) of one window on its CP group."""
        tokens = sum(doc_lens) // self.cp
        dense = self.dense_ms(tokens)
        gemms = dense - 2 * self.all_to_all_ms(tokens)
        again_dense = gemms * (FULL_AC_DENSE - 1) + self.all_to_all_ms(tokens) if self.assume.full_ac else 0.0
        attention, again = self.attention_ms(system, doc_lens)
        return dense, attention, again + again_dense

    def fsdp_ms(self) -> float:
        """FSDP's traffic of one micro step on one rank, not yet overlapped."""
        n = self.dp * self.cp
        if n == 1:
            return 0.0
        m = self.model
        total = (m.params - m.expert_params + m.expert_params / self.ep) * self.assume.fsdp_bytes_per_param
        if n <= self.assume.gpus_per_node or self.attention.comm.spans_nodes:  # the comm model's own
            return self.attention.comm.all_gather_ms(total / n, n)  # (all-gather priced for both)
        return total * (n - 1) / n / (self.assume.inter_node_busbw_gbps * 1e9) * 1e3

    def step(self, system: str, windows: Sequence[Sequence[Sequence[int]]]) -> StepBreakdown:
        """`windows[dp rank][micro step]` are document lengths of each window (all of one length)."""
        if len(windows) != self.dp or len({len(w) for w in windows}) != 1:
            raise ValueError(f"expected windows[dp={self.dp}][micro] with the same micro steps per rank")
        out = StepBreakdown()
        fsdp = self.fsdp_ms()
        for m in range(len(windows[0])):
            groups = [self.window_ms(system, w[m]) for w in windows]
            times = [sum(g) for g in groups]
            slowest = max(range(len(times)), key=times.__getitem__)
            exposed = max(0.0, fsdp - times[slowest])
            out.dense += groups[slowest][0]
            out.attention += groups[slowest][1]
            out.recompute += groups[slowest][2]
            out.fsdp_exposed += exposed
            out.total += times[slowest] + exposed
            out.group_spread.append(float(times[slowest] / (sum(times) / len(times))))
        return out


def paper_ratio_scales(modelled: Mapping[str, float], measured: Mapping[str, float]) -> dict[str, float]:
    """Per-system factors on the layer model's attention times that reproduce measured speedups.

    `modelled` and `measured`: FlashCP's average speedup over each baseline at the same setting
    (the paper's Fig. 5: 1.38x over "llama3", 1.63x "per_doc", 1.97x "ring", 2.14x "zigzag";
    averages of per-configuration ratios, so a common factor on one system scales its average
    exactly). The layer model predicts other speedups and nothing measured says which system it
    times wrongly. Llama3 CP's slowest rank runs long whole-document pieces like the calibration
    profile, so its time is kept (scale 1), FlashCP's is scaled to its measured ratio over Llama3
    CP, and every other measured system to its ratio over FlashCP: the cautious reading for
    FlashCP's claims. A system without a measurement keeps the layer model's time."""
    flashcp = modelled["llama3"] / measured["llama3"]
    return {"flashcp": flashcp, **{s: flashcp * measured[s] / modelled[s] for s in measured}}
