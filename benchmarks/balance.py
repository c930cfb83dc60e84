"""How evenly a step's windows load the DP groups, packed in stream order vs balanced.

    python benchmarks/balance.py (--distribution NAME | --lengths-file F.json) --context C --dp K --cp N
                                 --steps S [--micro M] [--seed X] [--json]

Each step draws documents from the distribution until dp x micro x C tokens (the last one cut):
the tokens one optimizer step trains. "off" packs them into windows in stream order (cut at each
window's end); "balanced" is `flashcp.data.balance.balance_step` on the same documents: `--mode mesh-cut` (the
default here) joins documents and cuts the longest to bring every window within 1.05 x the mean,
`--mode mesh` (the trainer's default) moves the stream's pieces without joining or cutting them. A DP
group's predicted step cost is the sum over its micro steps of its window's cost: dense work
(6 x params FLOPs per token) plus 12 d L FLOPs per attended (query, key) pair on the busiest rank of
the window's actual FlashCP plan (`plan_shards(..., "flashcp")`), for Llama 3 8B (8.03e9 params,
d = 4096, L = 32), all per CP rank. Printed: over the S steps, the mean and p95 of max / mean
across the DP groups, and the time to balance one step on this core (p50 / p99). The JSON keeps
exactly `{"off": {"mean", "p95"}, "balanced": {"mean", "p95"}, "plan_ms": {"p50", "p99"}}` plus
extra keys (balancing CPU time, cut documents, attention pairs kept, and `pieces_bound`: the
max / mean no balance that keeps the stream's pieces whole can go below, from the step's piece with
the most attended pairs).

"off" continues a window's last document in the next window, so both columns train the same tokens;
`flashcp.data.lengths.pack_windows` drops that remainder instead, which loses most of the long
documents' tails and gives lower figures on pile (e.g. 2.1-2.2 instead of 2.2-2.3 at 128K, DP = 64).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator

import numpy as np

from flashcp import plan_shards
from flashcp.data.balance import balance_step, stream_windows, WindowCost
from flashcp.data.lengths import length_sampler

LLAMA3_8B = {"params": 8.03e9, "dim": 4096, "n_layers": 32}


def steps(sampler, tokens: int) -> Iterator[list[int]]:
    """Endless steps: document lengths in stream order summing to exactly `tokens` (the last one cut)."""
    buf: list[int] = []
    while True:
        lens, total = [], 0
        while total < tokens:
            if not buf:
                buf = sampler.sample(4096).tolist()
            n = min(buf.pop(0), tokens - total)
            lens.append(n)
            total += n
        yield lens


def planned_cost(doc_lens: list[int], cost: WindowCost) -> float:
    """Dense work per CP rank plus the attention of the busiest rank of the FlashCP plan."""
    plan = plan_shards(doc_lens, cost.cp, strategy="flashcp")
    return cost.dense_per_token * sum(doc_lens) / cost.cp + cost.attn_per_pair * max(plan.workloads())


def piece_bound(seq: list[list[int]], context: int, cost: WindowCost) -> float:
    """A floor under the costliest DP group of any balance that keeps the stream's pieces whole
    ("mesh"): the window that holds the piece with the most attended pairs costs at least its dense
    work plus those pairs spread evenly over the CP ranks."""
    pairs = max(n * (n + 1) // 2 for w in seq for n in w)
    return (cost.dense_per_token * context + cost.attn_per_pair * pairs) / cost.cp


def ratio(per_group: list[float]) -> float:
    return max(per_group) / (sum(per_group) / len(per_group))


def run(distribution: str, context: int, dp: int, cp: int, n_steps: int, micro: int, seed: int,
        mode: str = "mesh-cut") -> dict:  # fmt: skip
    cost = WindowCost.llama(LLAMA3_8B["params"], LLAMA3_8B["dim"], LLAMA3_8B["n_layers"], cp)
    target = 1.05 if mode == "mesh-cut" else None
    stream = steps(length_sampler(distribution, seed=seed), dp * micro * context)
    warm_up = next(steps(length_sampler(distribution, seed=seed + 1), dp * micro * context))
    balance_step(warm_up, dp, micro, context, cost, target)  # untimed: numpy's first-call costs are not a step's
    off, balanced, bound, plan_ms, cpu_ms, cut, kept = [], [], [], [], [], [], []
    for _ in range(n_steps):
        lens = next(stream)
        seq = stream_windows(lens, context)
        off.append(ratio([sum(planned_cost(seq[m * dp + r], cost) for m in range(micro)) for r in range(dp)]))
        docs = lens if target else [n for w in seq for n in w]  # "mesh" moves the stream's pieces
        start, cpu = time.perf_counter(), time.process_time()
        windows = balance_step(docs, dp, micro, context, cost, target)
        plan_ms.append((time.perf_counter() - start) * 1e3)
        cpu_ms.append((time.process_time() - cpu) * 1e3)
        groups = [[[p.length for p in w] for w in rank] for rank in windows]
        per_group = [sum(planned_cost(w, cost) for w in rank) for rank in groups]
        balanced.append(ratio(per_group))
        bound.append(piece_bound(seq, context, cost) / (sum(per_group) / dp))
        pieces = sum(len(w) for rank in groups for w in rank)
        cut.append(pieces - len(docs))
        pairs = lambda ws: sum(n * (n + 1) // 2 for w in ws for n in w)  # noqa: E731
        kept.append(pairs([w for rank in groups for w in rank]) / pairs(seq))

    def summary(values: list[float]) -> dict[str, float]:
        return {"mean": float(np.mean(values)), "p95": float(np.percentile(values, 95))}

    return {
        "off": summary(off),
        "balanced": summary(balanced),
        "pieces_bound": summary(bound),
        "plan_ms": {"p50": float(np.percentile(plan_ms, 50)), "p99": float(np.percentile(plan_ms, 99))},
        "plan_cpu_ms": {"p50": float(np.percentile(cpu_ms, 50)), "p99": float(np.percentile(cpu_ms, 99))},
        "cuts_per_step": float(np.mean(cut)),
        "attention_pairs_kept_vs_off": float(np.mean(kept)),
        "setting": {"distribution": distribution, "context": context, "dp": dp, "cp": cp, "micro": micro,
                    "steps": n_steps, "seed": seed, "model": "Llama 3 8B", "mode": mode},  # fmt: skip
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--distribution", help="a flashcp.data.lengths distribution: wlbllm, pile, redpajama")
    source.add_argument("--lengths-file", help="a JSON list of document lengths to sample from")
    parser.add_argument("--context", type=int, required=True, help="window length C (tokens)")
    parser.add_argument("--dp", type=int, required=True)
    parser.add_argument("--cp", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--micro", type=int, default=1, help="gradient-accumulation micro steps per step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mode", choices=("mesh-cut", "mesh"), default="mesh-cut",
                        help="[data] balance mode: cut documents to 1.05 x the mean, or move the stream's pieces")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if min(args.context, args.dp, args.cp, args.steps, args.micro) < 1 or args.context % args.cp:
        parser.error("--context, --dp, --cp, --steps and --micro must be >= 1 and --context divisible by --cp")
    result = run(args.distribution or args.lengths_file, args.context, args.dp, args.cp, args.steps, args.micro,
                 args.seed, args.mode)  # fmt: skip
    if args.json:
        print(json.dumps(result))
        return 0
    s = result["setting"]
    print(f"{s['distribution']} C={s['context']} DP={s['dp']} CP={s['cp']} micro={s['micro']}, {s['steps']} steps, "
          "max / mean predicted step cost over DP groups:")  # fmt: skip
    for name in ("off", "balanced", "pieces_bound"):
        print(f"  {name:9s} mean {result[name]['mean']:.3f}  p95 {result[name]['p95']:.3f}")
    print(f"  balancing one step: p50 {result['plan_ms']['p50']:.1f} ms, p99 {result['plan_ms']['p99']:.1f} ms "
          f"(CPU p99 {result['plan_cpu_ms']['p99']:.1f} ms); "
          f"{result['cuts_per_step']:.1f} extra cuts per step, attention pairs kept "
          f"{100 * result['attention_pairs_kept_vs_off']:.1f} % of stream order")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
