"""The CPU time head groups cost: one attention layer's forward + backward with G = 1, 2, 4, 8 groups of KV heads.

    python benchmarks/head_groups.py                 # 8K tokens of 1K-token documents, CP 1
    python benchmarks/head_groups.py --tokens 16384  # another size

The layer is the job's Llama 3 attention (FlashCP's op, the exact reference kernel, float32, one
thread) at 16 query heads, 8 KV heads and head dim 64 (dim 1024), built as a training job builds it
(`model_spec`), with `use_head_groups` for G > 1. G = 1 is the plain layer. Each G runs once to
warm up, then `--repeats` rounds in which the Gs take turns (what other processes on a shared
machine add falls on all of them alike); the median of each G's forward + backward CPU time
(`process_time`) and its ratio to G = 1 are printed, one run, with the q, k, v and o bytes of one
group (the working set the groups divide). Groups recompute the q/k/v projections and the
attention forward in backward, so a ratio above 1 is that recompute's cost.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import flashcp.titan  # noqa: F401  (TorchTitan shims before torchtitan)
from flashcp.dispatch import build_dispatch
from flashcp.plan import plan_shards
from flashcp.titan.config import validate
from flashcp.titan.models.attention import CPStep, flashcp_ropes
from flashcp.titan.models.head_groups import use_head_groups
from flashcp.titan.models.spec import model_spec

MODEL = {"name": "llama3", "flavor": "custom", "dim": 1024, "n_layers": 1, "n_heads": 16, "n_kv_heads": 8,
         "multiple_of": 256, "vocab_size": 128}  # fmt: skip
GROUPS = (1, 2, 4, 8)


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--doc-len", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()
