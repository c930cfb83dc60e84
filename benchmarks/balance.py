"""How evenly a step's windows load the DP groups, per `[data] balance` mode, and at what price.

    python benchmarks/balance.py (--distribution NAME | --lengths-file F.json) --context C --dp K --cp N
                                 --steps S [--micro M] [--seed X] [--mode M] [--max-delay K]
                                 [--all-modes] [--json]

Documents are drawn from the length distribution into one stream (`prolong` is a ProLong-like mix
defined here: 40 % of tokens in long documents, ASSUMED mean 64K, 60 % in Pile-like short ones;
`prolong-32k` has long documents of mean 32K, `prolong-24k-50` also 50 % of the tokens in them;
`prolong-pool`, from `flashcp.data.lengths`, is a held-out ProLong-style pool with a Pareto tail);
every mode trains that stream, S optimizer steps of dp x micro windows of exactly C tokens:
  off           stream packing (each window's last document carried into the next)
  mesh          the stream step's pieces moved between the step's windows
  mesh-cut      the stream step's documents joined, the longest cut to reach 1.05 x the mean
  deferral      long documents (>= C / 16) wait up to --max-delay steps (`flashcp.data.deferral`)
  deferral-cut  the same, and what deferral could not place is cut to 1.05 x the mean
"balanced" is the trainer's default mode (`DataConfig`) unless --mode names another. A DP group's
predicted step time is the sum over its micro steps of its window's: dense time per token plus
attention time per attended pair on the busiest rank of the window's FlashCP plan, Llama 3 8B with
full activation checkpointing at measured efficiencies (`flashcp.costmodel.proxy`). Printed: the
mean and p95 over steps of max / mean across DP groups; attended (query, key) pairs kept relative to
stream packing of the same documents; for deferral, delay p50 / p90 (steps, over documents that
waited) and the share of tokens that waited; balancing time per step (wall and CPU, p50 / p99, one
core: what one rank does, deferral's selection, the step's layout and its own windows' pieces;
drawing the stream's lengths is not counted: the loader reads them from a store's offsets in every
mode). The JSON keeps `{"off", "balanced", "plan_ms",
"plan_cpu_ms", "attention_pairs_kept_vs_off"}` plus `step_pairs_kept_min` (the worst step's pairs
kept vs stream packing of its own documents), `steps_over_target` (the share of steps above the
default `balance_target`, 1.05), `balanced.max`, `delay_steps`, `delayed_token_share`,
`pieces_bound` and, with --all-modes, `modes`: the same figures for every mode.

    python benchmarks/balance.py --mesh-scope (--distribution NAME | --lengths-file F.json) --context C --dp K
                                 [--cp N] [--steps S] [--ranks-per-node G] [--json]
    python benchmarks/balance.py --mesh-grid [--steps S] [--lengths-dir DIR] [--json]

the mesh scope (`flashcp.plan.mesh.plan_mesh`: each step's dp x C tokens planned as one FlashCP group over all
dp x cp ranks on nodes of G ranks, documents longer than C as C-long pieces) beside deferral-cut on the same
stream: max / mean predicted rank time over all the mesh's ranks, pairs kept vs stream packing at C, KV bytes a
rank receives per layer (Llama 3 8B, bf16), the share of received rows crossing nodes and planning CPU time;
then one plan of 64M tokens over 512 ranks timed. --mesh-grid runs every shipped distribution and the lengths
files of DIR (default ../shared/data/lengths) at C = 128K and 512K, DP 8 and 64.

    python benchmarks/balance.py --rule benchmarks/results/balance_modes.jsonl

applies the default-picking rule to saved `--json` lines (one per setting, --all-modes or one --mode each):
the default is the mode that reaches p95 <= 1.05 with delay p90 <= 8 steps in the most settings,
then keeps the most attended pairs; it prints every setting's figures and says whether the chosen
mode meets the rule everywhere.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from flashcp import Plan, plan_shards
from flashcp.costmodel.proxy import window_cost
from flashcp.data.balance import layout_step, StepLayout, stream_windows, WindowCost
from flashcp.data.deferral import Deferral, DocSpan, stream_pairs
from flashcp.data.lengths import DISTRIBUTIONS, length_sampler, LengthSampler, LognormalMixture
from flashcp.data.sources import DataConfig
from flashcp.plan.mesh import plan_mesh
from flashcp.plan.nodes import node_traffic
from flashcp.plan.plan import row_bytes

LLAMA3_8B = {"params": 8.03e9, "vocab": 128256, "dim": 4096, "n_layers": 32}
MODES = ("off", "mesh", "mesh-cut", "deferral", "deferral-cut")
SWEEP = (("off", 0), ("mesh", 0), ("mesh-cut", 0), *(("deferral", k) for k in (4, 8, 16, 32)),
         *(("deferral-cut", k) for k in (8, 16)))  # fmt: skip
KV_ROW = row_bytes(num_kv_heads=8, head_dim=128, dtype_bytes=2)  # Llama 3 8B: K and V of one token, bf16
MESH_TARGET = 1.02  # plan_mesh's target at each of its two levels
PROLONG = LognormalMixture.from_token_shares(("long", "short"), (0.4, 0.6), (65536.0, 1500.0))


def sampler(name: str, seed: int) -> LengthSampler:
    """`prolong[-<mean>k[-<long share %>]]` or a `flashcp.data.lengths` distribution / lengths file."""
    match = re.fullmatch(r"prolong(?:-(\d+)k(?:-(\d+))?)?", name)
    if not match:
        return length_sampler(name, seed=seed)
    mean, share = match.groups()
    if mean is None:
        return LengthSampler(PROLONG, seed, name)
    long = float(share or 40) / 100
    mix = LognormalMixture.from_token_shares(("long", "short"), (long, 1 - long), (1024.0 * int(mean), 1500.0))
    return LengthSampler(mix, seed, name)


class Stream:
    """Documents drawn from a sampler, read like the loader's packer: whole documents from a cursor.
    With `tokens`, the data holds exactly that many (its last document cut) and then ends, as data
    without looping does: a read near the end gives fewer tokens."""

    def __init__(self, lengths: LengthSampler, tokens: int | None = None):
        self.lengths, self.lens, self.doc, self.offset = lengths, np.zeros(0, dtype=np.int64), 0, 0
        self.finite = tokens is not None
        if tokens is not None:
            while int(self.lens.sum()) < tokens:
                self.lens = np.concatenate((self.lens, lengths.sample(4096)))
            n = int(np.searchsorted(np.cumsum(self.lens), tokens, side="left")) + 1
            self.lens = self.lens[:n].copy()
            self.lens[-1] -= int(self.lens.sum()) - tokens

    def read(self, tokens: int) -> DocSpan:
        while not self.finite and int(self.lens[self.doc :].sum()) - self.offset < tokens:
            self.lens = np.concatenate((self.lens, self.lengths.sample(4096)))
        ends = np.cumsum(self.lens[self.doc :]) - self.offset
        last = min(self.doc + int(np.searchsorted(ends, tokens, side="left")) + 1, self.lens.size)
        index = np.arange(self.doc, last)
        start = np.where(index == self.doc, self.offset, 0)
        span = DocSpan(np.zeros(index.size, dtype=np.int64), index, start, self.lens[index] - start, index)
        self.doc, self.offset = last, 0
        return span

    def restore(self, epoch: int, doc: int, offset: int) -> None:
        self.doc, self.offset = doc, offset

    def step(self, tokens: int) -> tuple[list[int], int]:
        """Stream packing's next step: lengths of its document pieces, and its first token's offset."""
        first = int(self.lens[: self.doc].sum()) + self.offset if self.lens.size else 0
        span = self.read(tokens)
        lens = span.length.tolist()
        lens[-1] -= sum(lens) - tokens
        self.restore(0, int(span.position[-1]) + (lens[-1] == span.length[-1]),
                     0 if lens[-1] == span.length[-1] else int(span.start[-1]) + lens[-1])  # fmt: skip
        return lens, first


def rank_times(plan: Plan, cost: WindowCost) -> list[float]:
    """Predicted time of each rank of a plan: dense time of its tokens plus attention of its pairs."""
    return [cost.dense_per_token * plan.tokens_per_rank + cost.attn_per_pair * w for w in plan.workloads()]


def planned_cost(doc_lens: list[int], cost: WindowCost) -> float:
    """Predicted time of the busiest rank of the window's FlashCP plan."""
    return max(rank_times(plan_shards(doc_lens, cost.cp, strategy="flashcp"), cost))


def summary(values: list[float]) -> dict[str, float]:
    return {"mean": float(np.mean(values)), "p95": float(np.percentile(values, 95)), "max": float(max(values))}


def pct(values: list[float]) -> dict[str, float]:
    return {"p50": float(np.percentile(values, 50)), "p99": float(np.percentile(values, 99))}


def ratio(per_group: list[float]) -> float:
    return max(per_group) / (sum(per_group) / len(per_group))


def pairs(lens) -> float:
    lens = np.asarray(lens, dtype=np.float64)
    return float((lens * (lens + 1) / 2).sum())


def window_lengths(layout: StepLayout) -> list[list[list[int]]]:
    """Piece lengths of every window `[dp rank][micro step]`."""
    return [[layout.length[layout.bounds[w] : layout.bounds[w + 1]].tolist() for w in rank] for rank in layout.slot]


def llama_cost(cp: int) -> WindowCost:
    m = LLAMA3_8B
    return window_cost(6.0 * (m["params"] - m["vocab"] * m["dim"]), 12.0 * m["dim"] * m["n_layers"], cp, True)


def run(distribution: str, context: int, dp: int, cp: int, n_steps: int, micro: int, seed: int,
        mode: str = "deferral", max_delay: int = DataConfig.max_delay_steps) -> dict:  # fmt: skip
    """One mode on `n_steps` steps of the stream (see the module docstring)."""
    cost, n_windows = llama_cost(cp), dp * micro
    settings = DataConfig(balance=mode, max_delay_steps=max_delay).balance_args()  # the trainer's, for `mode`
    target = settings["cut_target"] if settings else None
    warm = Stream(sampler(distribution, seed + 1)).step(n_windows * context)[0]
    layout_step(warm, dp, micro, context, cost, target).rank(0)  # untimed: numpy's first-call costs are not a step's
    stream = Stream(sampler(distribution, seed))
    deferral = (Deferral(context, n_windows, max_delay, cost, settings["target"], min_kept=settings["min_kept"])
                if mode.startswith("deferral") else None)  # fmt: skip
    off, balanced, bound, wall, cpu, kept, ref, delays, waited, tokens = [], [], [], [], [], 0.0, 0.0, [], 0, 0
    step_kept = []  # each step's pairs kept vs stream packing of its own documents
    over_mesh, received, received_mean = [], [], []  # max / mean over all ranks; rows received per layer
    reading = [0.0, 0.0]  # wall, CPU seconds drawing the stream's lengths inside a step (not balancing)

    def read(tokens: int) -> DocSpan:
        t, c = time.perf_counter(), time.process_time()
        span = stream.read(tokens)
        reading[0] += time.perf_counter() - t
        reading[1] += time.process_time() - c
        return span

    for _ in range(n_steps):
        lens, _ = stream.step(n_windows * context) if deferral is None else (None, None)
        t0, c0, reading[:] = time.perf_counter(), time.process_time(), [0.0, 0.0]
        if deferral is None:
            seq = stream_windows(lens, context)
            docs = [n for w in seq for n in w] if mode == "mesh" else lens
            groups = [[seq[m * dp + r] for m in range(micro)] for r in range(dp)]
            if mode != "off":
                layout = layout_step(docs, dp, micro, context, cost, target)
                layout.rank(0)  # what one rank builds
        else:
            step = deferral.next_step(read)
            stream.restore(*step.cursor)
            layout = deferral.layout(step, dp, micro, target)
            layout.rank(0)
        wall.append((time.perf_counter() - t0 - reading[0]) * 1e3)
        cpu.append((time.process_time() - c0 - reading[1]) * 1e3)
        if mode != "off":
            groups = window_lengths(layout)
        if deferral is not None:
            delay = np.asarray(step.delay)
            delays += delay[delay > 0].tolist()
            waited += int(np.asarray(step.length)[delay > 0].sum())
            step_ref = float(stream_pairs(np.asarray(step.offset), np.asarray(step.length), context).sum())
        else:
            step_ref = pairs([n for w in seq for n in w])
        tokens += n_windows * context
        plans = [[plan_shards(w, cp, strategy="flashcp") for w in rank] for rank in groups]
        times = [[rank_times(p, cost) for p in rank] for rank in plans]
        per_group = [sum(max(t) for t in rank) for rank in times]
        balanced.append(ratio(per_group))
        over_mesh.append(ratio([sum(ts) for rank in times for ts in zip(*rank)]))  # each rank over its micro steps
        received.append(max(max(p.needed_tokens()) for rank in plans for p in rank))
        received_mean.append(float(np.mean([sum(p.needed_tokens()) / cp for rank in plans for p in rank])))
        trained = pairs([n for rank in groups for w in rank for n in w])
        kept, ref = kept + trained, ref + step_ref
        step_kept.append(trained / step_ref)
        if deferral is None:
            windows = stream_windows(lens, context)
            off.append(ratio([sum(planned_cost(windows[m * dp + r], cost) for m in range(micro)) for r in range(dp)]))
            bound.append((cost.dense_per_token * context + cost.attn_per_pair * max(pairs([n]) for n in docs))
                         / cost.cp / (sum(per_group) / dp) if mode == "mesh" else 1.0)  # fmt: skip

    out = {
        "balanced": summary(balanced),
        "mesh_ratio": summary(over_mesh),
        "received_rows": {"p50": float(np.percentile(received, 50)), "max": float(max(received)),
                          "mean": float(np.mean(received_mean))},
        "plan_ms": pct(wall),
        "plan_cpu_ms": pct(cpu),
        "attention_pairs_kept_vs_off": kept / ref,
        "step_pairs_kept_min": float(min(step_kept)),
        "steps_over_target": float(np.mean(np.asarray(balanced) > DataConfig.balance_target)),
        "delay_steps": {"p50": float(np.percentile(delays, 50)) if delays else 0.0,
                        "p90": float(np.percentile(delays, 90)) if delays else 0.0,
                        "max": float(max(delays, default=0))},  # fmt: skip
        "delayed_token_share": waited / tokens,
        "setting": {"distribution": distribution, "context": context, "dp": dp, "cp": cp, "micro": micro,
                    "steps": n_steps, "seed": seed, "model": "Llama 3 8B, full AC", "mode": mode,
                    "max_delay": max_delay if deferral is not None else None},  # fmt: skip
    }
    if off:
        out["off"] = summary(off)
    if mode == "mesh":
        out["pieces_bound"] = summary(bound)
    return out


def run_mesh_scope(distribution: str, context: int, dp: int, cp: int, n_steps: int, micro: int, seed: int,
                   ranks_per_node: int = 8, target: float = MESH_TARGET) -> dict:  # fmt: skip
    """The mesh scope on the stream `run` trains: each micro step's dp x C tokens of the stream (documents longer
    than C as C-long pieces, `window_pieces`) planned as one FlashCP group over all dp x cp ranks
    (`flashcp.plan.mesh.plan_mesh`), nothing deferred. Figures: max / mean
    predicted rank time over the mesh, pairs kept vs stream packing at C, rows the busiest receiver gets per
    layer, the share of all received rows that cross nodes (flat exchange, `flashcp.plan.nodes`), documents cut
    across nodes, and planning time (the whole mesh's plan, what every rank computes)."""
    cost = llama_cost(cp)
    plan_mesh(Stream(sampler(distribution, seed + 1)).step(dp * context)[0], dp, cp, ranks_per_node, target)  # warm
    stream = Stream(sampler(distribution, seed))
    over_mesh, step_kept, received, received_mean, node_cut, wall, cpu = [], [], [], [], [], [], []
    inter = rows = 0
    kept = ref = 0.0
    for _ in range(n_steps):
        lens, _ = stream.step(dp * micro * context)
        t0, c0 = time.perf_counter(), time.process_time()
        batches = [window_pieces(b, context) for b in stream_windows(lens, dp * context)]
        plans = [plan_mesh(b, dp, cp, ranks_per_node, target) for b in batches]
        wall.append((time.perf_counter() - t0) * 1e3)
        cpu.append((time.process_time() - c0) * 1e3)
        over_mesh.append(ratio([sum(ts) for ts in zip(*(rank_times(p, cost) for p in plans))]))
        trained, step_ref = sum(pairs(b) for b in batches), pairs([n for w in stream_windows(lens, context) for n in w])
        kept, ref = kept + trained, ref + step_ref
        step_kept.append(trained / step_ref)
        received.append(max(max(p.needed_tokens()) for p in plans))
        received_mean.append(float(np.mean([np.mean(p.needed_tokens()) for p in plans])))
        for p in plans:
            traffic = node_traffic(p, p.info["ranks_per_node"])
            inter, rows = inter + traffic.totals()["flat_inter"], rows + sum(map(sum, traffic.needed))
        node_cut.append(sum(len(p.info["node_cut"]) for p in plans))
    return {
        "mesh_ratio": summary(over_mesh),
        "attention_pairs_kept_vs_off": kept / ref,
        "step_pairs_kept_min": float(min(step_kept)),
        "received_rows": {"p50": float(np.percentile(received, 50)), "max": float(max(received)),
                          "mean": float(np.mean(received_mean))},
        "cross_node_share": inter / rows if rows else 0.0,
        "node_cut_docs": float(np.mean(node_cut)),
        "plan_ms": pct(wall),
        "plan_cpu_ms": pct(cpu),
        "setting": {"distribution": distribution, "context": context, "dp": dp, "cp": cp, "micro": micro,
                    "steps": n_steps, "seed": seed, "model": "Llama 3 8B, full AC", "mode": "mesh scope",
                    "ranks_per_node": ranks_per_node, "target": target},  # fmt: skip
    }


def window_pieces(lens: list[int], window: int) -> list[int]:
    """Documents longer than a window as window-long pieces from their head and a rest, as deferral trains
    them: a whole 1M document would make its later ranks receive up to 1M rows per layer."""
    return [min(window, n - start) for n in lens for start in range(0, n, window)]


def time_mesh_plan(distribution: str, seed: int, dp: int = 64, cp: int = 8, per_rank: int = 131072,
                   ranks_per_node: int = 8, repeats: int = 3) -> list[float]:  # fmt: skip
    """CPU ms of `plan_mesh` on one global batch of dp x cp x per_rank tokens (default 512 ranks, 64M tokens)."""
    lens = window_pieces(Stream(sampler(distribution, seed)).step(dp * cp * per_rank)[0], cp * per_rank)
    times = []
    for _ in range(repeats):
        c0 = time.process_time()
        plan_mesh(lens, dp, cp, ranks_per_node)
        times.append((time.process_time() - c0) * 1e3)
    return times


def mesh_scope_report(source: str, context: int, dp: int, cp: int, n_steps: int, micro: int, seed: int,
                      ranks_per_node: int) -> dict:  # fmt: skip
    """The mesh scope beside the default (`deferral-cut`) on the same stream; the latter's windows stay inside
    a node when its ranks hold whole CP groups (no rows cross nodes)."""
    mesh = run_mesh_scope(source, context, dp, cp, n_steps, micro, seed, ranks_per_node)
    default = run(source, context, dp, cp, n_steps, micro, seed, "deferral-cut")
    default["cross_node_share"] = 0.0 if ranks_per_node % cp == 0 else None
    return {"mesh": mesh, "deferral-cut": default}


def print_mesh_scope(result: dict) -> None:
    s = result["mesh"]["setting"]
    print(f"{s['distribution']} C={s['context']} DP={s['dp']} CP={s['cp']} micro={s['micro']}, {s['steps']} steps, "
          f"{s['ranks_per_node']} ranks a node: max / mean predicted rank time over the {s['dp'] * s['cp']} ranks "
          "(mean / p95), pairs kept vs stream packing at C, KV MiB a rank receives per layer (mean over ranks; the "
          "busiest rank's p50 / max over steps), "
          "received rows crossing nodes, plan CPU ms p50 / p99:")
    for name, r in result.items():
        mib = {k: v * KV_ROW / 2**20 for k, v in r["received_rows"].items()}
        cross = "n/a" if r["cross_node_share"] is None else f"{100 * r['cross_node_share']:.0f} %"
        print(f"  {name:13s} {r['mesh_ratio']['mean']:.3f} / {r['mesh_ratio']['p95']:.3f}  pairs "
              f"{100 * r['attention_pairs_kept_vs_off']:5.1f} %  recv {mib['mean']:6.1f}; {mib['p50']:6.1f} / "
              f"{mib['max']:6.1f} MiB  "
              f"cross {cross:>4s}  CPU ms {r['plan_cpu_ms']['p50']:6.1f} / {r['plan_cpu_ms']['p99']:6.1f}")


def mesh_sources(lengths_dir: str) -> list[str]:
    """Every shipped length distribution and the lengths files in `lengths_dir`."""
    return [*DISTRIBUTIONS, *sorted(str(p) for p in Path(lengths_dir).glob("*.json"))]


def default_mode() -> tuple[str, int]:
    """The trainer's default `[data] balance` and delay bound."""
    return DataConfig.balance, DataConfig.max_delay_steps


def report(source: str, context: int, dp: int, cp: int, n_steps: int, micro: int, seed: int, mode: str | None,
           max_delay: int | None, all_modes: bool) -> dict:  # fmt: skip
    """The JSON other tooling reads: "off", "balanced" (the default or --mode), their keys, and every mode."""
    name, delay = default_mode()
    name, delay = mode or name, max_delay if max_delay is not None else delay
    off = run(source, context, dp, cp, n_steps, micro, seed, "off")
    result = {**run(source, context, dp, cp, n_steps, micro, seed, name, delay), "off": off["balanced"]}
    if all_modes:
        result["modes"] = {}
        for m, k in SWEEP:
            key = f"{m}-{k}" if m.startswith("deferral") else m
            result["modes"][key] = off if m == "off" else run(source, context, dp, cp, n_steps, micro, seed, m, k)
    return result


def by_setting(records: Iterable[dict]) -> dict[str, dict[str, dict]]:
    """Every mode's figures per setting ("pile 512K DP 64"), deferral modes named with their bound."""
    table: dict[str, dict[str, dict]] = {}
    for record in records:
        s = record["setting"]
        key = f"{s['distribution']} {s['context'] // 1024}K DP {s['dp']}"
        for fig in (record.get("modes") or {"": record}).values():
            mode, delay = fig["setting"]["mode"], fig["setting"]["max_delay"]
            table.setdefault(key, {})[mode if delay is None else f"{mode}-{delay}"] = fig
    return table


def meets(fig: dict, target: float = 1.05, max_p90: float = 8.0) -> bool:
    return fig["balanced"]["p95"] <= target and fig["delay_steps"]["p90"] <= max_p90


def choose(table: dict[str, dict[str, dict]]) -> tuple[str, dict[str, tuple[int, float]]]:
    """The mode meeting the rule in the most settings, then keeping the most pairs (mean over settings),
    among the modes measured in every setting; and each such mode's (settings met, mean pairs kept)."""
    modes = set.intersection(*(set(m) for m in table.values()))
    if not modes:
        raise SystemExit("no mode was measured in every setting")
    score = {}
    for m in modes:
        kept = float(np.mean([t[m]["attention_pairs_kept_vs_off"] for t in table.values()]))
        score[m] = (sum(meets(t[m]) for t in table.values()), kept)
    return max(score, key=score.__getitem__), score


def print_rule(path: str) -> None:
    with open(path) as f:
        table = by_setting(json.loads(line) for line in f if line.strip())
    best, score = choose(table)
    print("p95 max / mean, attended pairs kept vs stream packing, delay p90 (steps), balancing CPU ms p99:")
    for setting, modes in table.items():
        print(f"  {setting}")
        for mode, fig in sorted(modes.items()):
            kept = 100 * fig["attention_pairs_kept_vs_off"]
            print(f"    {mode:16s} {fig['balanced']['p95']:6.3f}  {kept:5.1f} %  p90 {fig['delay_steps']['p90']:4.1f}"
                  f"  CPU p99 {fig['plan_cpu_ms']['p99']:5.1f}" + ("  meets" if meets(fig) else ""))
    for mode, (met, kept) in sorted(score.items(), key=lambda kv: kv[1], reverse=True):
        print(f"  {mode:16s} meets p95 <= 1.05 with delay p90 <= 8 in {met} / {len(table)} settings, "
              f"mean pairs kept {100 * kept:.1f} %")
    met = score[best][0]
    verdict = "everywhere" if met == len(table) else f"in {met} of {len(table)} settings: none meets it everywhere"
    print(f"rule's choice: {best} (meets the rule {verdict})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--distribution", help="a flashcp.data.lengths distribution (wlbllm, pile, redpajama) "
                        "or prolong[-<long mean>k[-<long share %%>]]")
    source.add_argument("--lengths-file", help="a JSON list of document lengths to sample from")
    source.add_argument("--rule", help="apply the default's rule to saved --json lines (a .jsonl file)")
    source.add_argument("--mesh-grid", action="store_true", help="the mesh scope beside deferral-cut on every "
                        "shipped distribution and --lengths-dir file at C = 128K and 512K, DP 8 and 64")
    parser.add_argument("--mesh-scope", action="store_true", help="the mesh scope (one plan over all DP x CP "
                        "ranks) beside deferral-cut, then one plan of 512 ranks and 64M tokens timed")
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--lengths-dir", default="../shared/data/lengths", help="lengths files for --mesh-grid")
    parser.add_argument("--context", type=int, help="window length C (tokens)")
    parser.add_argument("--dp", type=int)
    parser.add_argument("--cp", type=int)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--micro", type=int, default=1, help="gradient-accumulation micro steps per step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mode", choices=MODES, help="[data] balance mode (default: the trainer's)")
    parser.add_argument("--max-delay", type=int, help="deferral's bound in steps (default: the trainer's)")
    parser.add_argument("--all-modes", action="store_true", help="also report every mode (key 'modes')")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.rule:
        print_rule(args.rule)
        return 0
    if args.mesh_grid or args.mesh_scope:
        return mesh_main(args)
    if None in (args.context, args.dp, args.cp, args.steps):
        parser.error("--context, --dp, --cp and --steps are required")
    if min(args.context, args.dp, args.cp, args.steps, args.micro) < 1 or args.context % args.cp:
        parser.error("--context, --dp, --cp, --steps and --micro must be >= 1 and --context divisible by --cp")
    result = report(args.distribution or args.lengths_file, args.context, args.dp, args.cp, args.steps, args.micro,
                    args.seed, args.mode, args.max_delay, args.all_modes)  # fmt: skip
    if args.json:
        print(json.dumps(result))
        return 0
    s = result["setting"]
    print(f"{s['distribution']} C={s['context']} DP={s['dp']} CP={s['cp']} micro={s['micro']}, {s['steps']} steps; "
          "max / mean predicted step time over DP groups (mean / p95), pairs kept vs stream packing, delay:")
    rows = result.get("modes", {"off": {"balanced": result["off"], "attention_pairs_kept_vs_off": 1.0},
                                f"balanced ({s['mode']})": result})  # fmt: skip
    for name, r in rows.items():
        d = r.get("delay_steps", {})
        print(f"  {name:14s} {r['balanced']['mean']:.3f} / {r['balanced']['p95']:.3f}  pairs "
              f"{100 * r['attention_pairs_kept_vs_off']:5.1f} %  delay p50 {d.get('p50', 0):.0f} p90 "
              f"{d.get('p90', 0):.0f}  CPU ms p50 {r.get('plan_cpu_ms', {}).get('p50', 0):.1f} "
              f"p99 {r.get('plan_cpu_ms', {}).get('p99', 0):.1f}")  # fmt: skip
    return 0

def mesh_main(args: argparse.Namespace) -> int:
    """--mesh-scope on one setting, or on the whole grid with --mesh-grid; then the 512-rank plan timed."""
    cp, steps = args.cp or 8, args.steps or 10
    if args.mesh_grid:
        settings = [(src, c, dp) for src in mesh_sources(args.lengths_dir) for c in (131072, 524288) for dp in (8, 64)]
    else:
        if None in (args.context, args.dp):
            raise SystemExit("--mesh-scope needs --context and --dp (or --mesh-grid)")
        settings = [(args.distribution or args.lengths_file, args.context, args.dp)]
    for source, context, dp in settings:
        result = mesh_scope_report(source, context, dp, cp, steps, args.micro, args.seed, args.ranks_per_node)
        print(json.dumps(result)) if args.json else print_mesh_scope(result)
    source = settings[0][0]
    times = time_mesh_plan(source, args.seed, ranks_per_node=args.ranks_per_node)
    print(f"plan_mesh, {source}, 64M tokens over DP 64 x CP 8 (128K a rank, {args.ranks_per_node} ranks a node): "
          f"CPU ms {', '.join(f'{t:.0f}' for t in times)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
