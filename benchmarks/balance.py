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

import numpy as np

from flashcp import plan_shards
from flashcp.costmodel.proxy import window_cost
from flashcp.data.balance import layout_step, StepLayout, stream_windows, WindowCost
from flashcp.data.deferral import Deferral, DocSpan, stream_pairs
from flashcp.data.lengths import length_sampler, LengthSampler, LognormalMixture
from flashcp.data.sources import DataConfig

LLAMA3_8B = {"params": 8.03e9, "vocab": 128256, "dim": 4096, "n_layers": 32}
MODES = ("off", "mesh", "mesh-cut", "deferral", "deferral-cut")
SWEEP = (("off", 0), ("mesh", 0), ("mesh-cut", 0), *(("deferral", k) for k in (4, 8, 16, 32)),
         *(("deferral-cut", k) for k in (8, 16)))  # fmt: skip
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


def planned_cost(doc_lens: list[int], cost: WindowCost) -> float:
    """Dense time per CP rank plus the attention of the busiest rank of the FlashCP plan."""
    plan = plan_shards(doc_lens, cost.cp, strategy="flashcp")
    return cost.dense_per_token * sum(doc_lens) / cost.cp + cost.attn_per_pair * max(plan.workloads())


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
        per_group = [sum(planned_cost(w, cost) for w in rank) for rank in groups]
        balanced.append(ratio(per_group))
        trained = pairs([n for rank in groups for w in rank for n in w])
        kept, ref = kept + trained, ref + step_ref
        step_kept.append(trained / step_ref)
        if deferral is None:
            windows = stream_windows(lens, context)
            off.append(ratio([sum(planned_cost(windows[m * dp + r], cost) for m in range(micro)) for r in range(dp)]))
            bound.append((cost.dense_per_token * context + cost.attn_per_pair * max(pairs([n]) for n in docs))
                         / cost.cp / (sum(per_group) / dp) if mode == "mesh" else 1.0)  # fmt: skip

    def summary(values: list[float]) -> dict[str, float]:
        return {"mean": float(np.mean(values)), "p95": float(np.percentile(values, 95)), "max": float(max(values))}

    def pct(values: list[float]) -> dict[str, float]:
        return {"p50": float(np.percentile(values, 50)), "p99": float(np.percentile(values, 99))}

    out = {
        "balanced": summary(balanced),
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

if __name__ == "__main__":
    raise SystemExit(main())
