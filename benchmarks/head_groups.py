"""The time head groups cost: one attention layer's forward + backward with G = 1, 2, 4, 8 groups of KV heads,
measured on the CPU, then modelled on H100s.

    python benchmarks/head_groups.py                 # 8K tokens of 1K-token documents, CP 1; then the model
    python benchmarks/head_groups.py --tokens 16384  # another size
    python benchmarks/head_groups.py --model-only    # the H100 model alone (no CPU run)

The layer is the job's Llama 3 attention (FlashCP's op, the exact reference kernel, float32, one
thread) at 16 query heads, 8 KV heads and head dim 64 (dim 1024), built as a training job builds it
(`model_spec`), with `use_head_groups` for G > 1. G = 1 is the plain layer. Each G runs once to
warm up, then `--repeats` rounds in which the Gs take turns (what other processes on a shared
machine add falls on all of them alike); the median of each G's forward + backward CPU time
(`process_time`) and its ratio to G = 1 are printed, one run, with the q, k, v and o bytes of one
group (the working set the groups divide). Groups recompute the q/k/v projections and the
attention forward in backward, so a ratio above 1 is that recompute's cost.

MODELLED, not measured: Llama 3 8B's layer (32 heads, 8 KV heads, head dim 128, dim 4096, SwiGLU
14336) on CP 8 in one H100 node, at 512K and 128K tokens per rank (4M and 1M a window), full
activation checkpointing as the shipped configs, one document a window and the ProLong-like mix
(benchmarks/balance.py), FlashCP's plan and compact exchange. `flashcp.costmodel` prices each call:
the varlen kernel fitted to the shared H100 FlashAttention profile (its grid is heads x query
blocks; below `half_ctas` blocks a call runs at half rate, so a group's call at 1/G of the heads is
priced at its own occupancy, and each call pays the launch), the exchange from the measured
nccl-tests NVLink tables (bus bandwidth up to 365 GB/s at 8 GiB, against NVLink's 450 GB/s per
direction; a group's message is 1/G of the layer's, priced at its own size), the copies at HBM rate,
the projections at TorchTitan's 33 % MFU (`DENSE_MFU`, whatever their width). The plain layer
runs its attention forward twice (forward, AC's recompute) and backward once; a grouped layer runs
each group's forward three times (forward, the block's recompute, the group's own recompute before
its backward: its q/k/v and output projections, exchange and kernel) and its backward once, so it
adds one forward of the layer, at G calls of 1/G of the heads. "prefetch" (`head_group_prefetch`) is
the same with group g+1's exchange hidden behind group g's kernel in each pass, only the first
group's exposed, and with what it costs: each group's k and v but the first's projected a second
time in each pass (the launch ahead runs outside the group's autograd). The block adds the MLP (and its AC recompute),
the same for all G. The tables are one node (CP 8, compact exchange, NVLink) and two nodes (CP 16,
the two-level exchange, `flashcp.costmodel.fabric`'s default fabric of 8 GPUs a node and one 400 Gb/s
NIC a GPU), where each group's exchange crosses the fabric.
Printed per G: one group's forward call on the slowest rank in kernel blocks (heads x query blocks) and
in waves of one block per SM of an H100's 132, the kernel model's rate 1 / (1 + half_ctas / blocks) there
(half_ctas = 44 in the fit), one group's forward exchange, the layer's time and its ratio to G = 1.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

import flashcp.titan  # noqa: F401  (TorchTitan shims before torchtitan)
from flashcp.costmodel import AttentionShape, CostModel, load_cost_model
from flashcp.costmodel.fabric import multinode_model
from flashcp.costmodel.model import key_rows
from flashcp.costmodel.step import LLAMA3_8B
from flashcp.dispatch import build_dispatch
from flashcp.plan import plan_shards
from flashcp.titan.config import validate
from flashcp.titan.models.attention import CPStep, flashcp_ropes
from flashcp.titan.models.head_groups import use_head_groups
from flashcp.titan.models.spec import model_spec

MODEL = {"name": "llama3", "flavor": "custom", "dim": 1024, "n_layers": 1, "n_heads": 16, "n_kv_heads": 8,
         "multiple_of": 256, "vocab_size": 128}  # fmt: skip
GROUPS = (1, 2, 4, 8)
ROOT = Path(__file__).resolve().parents[1]
PROFILES = ROOT.parent / "shared" / "data" / "gpu_profiles"  # the H100 kernel profile, the NVLink tables
H100_SMS = 132
CP = 8
FFN = 14336  # Llama 3 8B's SwiGLU width


def layers(tokens: int) -> dict[int, tuple[torch.nn.Module, dict]]:
    """The attention layer with the same weights for every G, and the model's RoPEs."""
    cfg = validate({"model": MODEL, "flashcp": {"backend": "reference"}, "training": {"seq_len": tokens}})
    out, state = {}, None
    for groups in GROUPS:
        config = model_spec(cfg["model"], cfg["flashcp"], MODEL["vocab_size"], tokens).model
        use_head_groups(config, groups)
        torch.manual_seed(0)
        model = config.build()
        model.init_states()
        layer = model.layers["0"].attention
        state = state or layer.state_dict()
        layer.load_state_dict(state)
        out[groups] = layer, flashcp_ropes(model)
    return out


def window(tokens: int, docs: str) -> list[int]:
    """One window's document lengths: one document, or the ProLong-like mix (seed 0, the last one cut)."""
    if docs == "one":
        return [tokens]
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from balance import sampler, Stream

    return Stream(sampler("prolong", 0), tokens).lens.tolist()


def grouped_layer_ms(model: CostModel, plan, groups: int, prefetch: bool, comm: str) -> dict[str, float]:
    """One Llama 3 8B attention layer's training time (ms, slowest rank) with `groups` groups and full AC
    (see the module docstring), and what one group's forward call looks like on the kernel's grid."""
    m = LLAMA3_8B
    shape = AttentionShape(heads=m.heads // groups, kv_heads=m.kv_heads // groups, head_dim=m.head_dim)
    t = model.collective_step(plan, comm, shape)
    tokens = plan.tokens_per_rank
    proj = model.memory.gemm_ms(2 * tokens * m.dim * m.head_dim * (2 * m.heads + 2 * m.kv_heads) / groups)
    passes = 2 if groups == 1 else 3  # forwards per layer (group): forward, AC's recompute, the group's own
    forward = t.attn_fwd + t.other_fwd + proj  # one group's forward but its exchange
    backward = t.attn_bwd + t.other_bwd + 2 * proj + t.comm_bwd
    # a pass's exchanges: each group's in turn, or with prefetch the first one's and what outlasts a kernel,
    # and each group's k and v but the first's projected again for its launch ahead
    prefetch = prefetch and groups > 1  # one group has nothing to launch ahead
    exchanges = t.comm_fwd + (groups - 1) * (max(0.0, t.comm_fwd - t.attn_fwd) if prefetch else t.comm_fwd)
    if prefetch:
        exchanges += (groups - 1) * model.memory.gemm_ms(2 * tokens * m.dim * m.head_dim * 2 * m.kv_heads / groups)
    total = groups * (passes * forward + backward) + passes * exchanges
    rank = plan.ranks[int(np.argmax(t.per_rank_fwd))]
    ctas = model.kernel.counts([s.length for s in rank], key_rows(rank), shape.heads)[0]
    return {"ms": total, "ctas": ctas, "efficiency": 1 / (1 + model.kernel.fwd.half_ctas / ctas),
            "exchange_ms": t.comm_fwd}  # fmt: skip


SETTINGS = ((1, 8, "compact"), (2, 16, "two_level"))  # (nodes, CP, exchange) of the tables


def h100_model() -> None:
    """Print the modelled H100 table (module docstring) for 512K and 128K tokens a rank, on one and two nodes."""
    one_node, _ = load_cost_model([PROFILES], [PROFILES])
    m = LLAMA3_8B
    print("MODELLED (flashcp.costmodel, H100 kernel profile, H200 NVLink nccl-tests tables, the default fabric): "
          "Llama 3 8B layer, FlashCP plan, full AC, bf16; layer = attention (projections, exchange, kernel, "
          "copies), block = layer + MLP")  # fmt: skip
    for nodes, cp, comm in SETTINGS:
        model = one_node if nodes == 1 else multinode_model(one_node)
        for per_rank in (2**19, 2**17):
            for docs in ("one", "prolong"):
                lens = window(per_rank * cp, docs)
                plan = plan_shards(lens, cp, "flashcp")
                mlp = 4 * model.memory.gemm_ms(2 * per_rank * 3 * m.dim * FFN)  # forward, AC's recompute, backward x2
                print(f"\nCP {cp} on {nodes} node{'s' * (nodes > 1)} ({comm} exchange), {per_rank // 1024}K tokens a "
                      f"rank ({per_rank * cp // 2**20}M a window), "
                      f"{'one document' if docs == 'one' else f'{len(lens)} ProLong-like documents'}; MLP {mlp:.0f} ms")
                print("| G | q, k, v, o of a group (GiB) | kernel blocks a call (waves on 132 SMs) | rate | exchange "
                      "a group (ms) | layer (ms) | ratio | with prefetch (ms) | ratio | block ratio |")  # fmt: skip
                print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
                base = grouped_layer_ms(model, plan, 1, False, comm)["ms"]
                for groups in GROUPS:
                    seq = grouped_layer_ms(model, plan, groups, False, comm)
                    pre = grouped_layer_ms(model, plan, groups, True, comm)
                    gib = 2 * (m.heads + m.kv_heads) * per_rank * m.head_dim * 2 / groups / 2**30
                    print(f"| {groups} | {gib:.2f} | {seq['ctas']:.0f} ({seq['ctas'] / H100_SMS:.0f}) | "
                          f"{seq['efficiency']:.4f} | {seq['exchange_ms']:.2f} | {seq['ms']:.0f} | "
                          f"{seq['ms'] / base:.3f} | {pre['ms']:.0f} | {pre['ms'] / base:.3f} | "
                          f"{(seq['ms'] + mlp) / (base + mlp):.3f} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--doc-len", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model-only", action="store_true", help="print the modelled H100 table only")
    args = parser.parse_args()
    if args.model_only:
        return h100_model()
    torch.set_num_threads(1)
    dispatch = build_dispatch(plan_shards([args.doc_len] * (args.tokens // args.doc_len), 1, "per_seq"), 0, "compact")
    x = torch.randn(1, args.tokens, MODEL["dim"])
    grad = torch.randn_like(x)
    built = layers(args.tokens)

    def step(groups: int) -> float:
        layer, ropes = built[groups]
        xl = x.clone().requires_grad_()
        start = time.process_time()
        layer(xl, CPStep.of(ropes, dispatch, None), dispatch.positions[None]).backward(grad)
        return time.process_time() - start

    for groups in GROUPS:
        step(groups)
    times: dict[int, list[float]] = {g: [] for g in GROUPS}
    for _ in range(args.repeats):
        for groups in GROUPS:
            times[groups].append(step(groups))
    heads, kv_heads, head_dim = MODEL["n_heads"], MODEL["n_kv_heads"], MODEL["dim"] // MODEL["n_heads"]
    layer_mib = 2 * (heads + kv_heads) * args.tokens * head_dim * x.element_size() / 2**20
    base = statistics.median(times[1])
    print(f"one Llama 3 attention layer ({heads} heads, {kv_heads} KV heads, head dim {head_dim}), {args.tokens} "
          f"tokens in {args.doc_len}-token documents, CP 1, reference kernel, float32, 1 thread; median of "
          f"{args.repeats} forward + backward")  # fmt: skip
    print("| G | q, k, v, o of one group (MiB) | forward + backward (s) | ratio to G = 1 |")
    print("| --- | --- | --- | --- |")
    for groups in GROUPS:
        median = statistics.median(times[groups])
        print(f"| {groups} | {layer_mib / groups:.0f} | {median:.2f} | {median / base:.2f} |")
    print()
    h100_model()


if __name__ == "__main__":
    main()
