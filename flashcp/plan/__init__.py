"""Sharding planners: which rank holds which piece of which document of a packed window.

    plan = plan_shards(doc_lens, cp_size, strategy="flashcp", target_imbalance=1.05)
    plan = plan_shards(doc_lens, cp_size, workload=Workload(1, 1, 128))  # gpt-oss: every other layer a window

Every strategy is a small function `(doc_lens, cp_size, **options) -> (ranks, info)` in a module
of its own; `plan_shards` checks the input, runs it, normalises the shards and validates the
result, so a strategy only has to decide placement. Whole-Doc's two steps live apart, placement
in `whole_doc` and trades in `rebalance`, sharing the ranks' state (`fill.RankFill`) with
`hybrid`.

May import: the standard library and numpy (scipy for `ilp`). No torch: planning tools start
fast. Plans at CP 64 can hold tens of thousands of shards; what scales with them (Per-Doc
chunks, normalising, validating, the rank scan of placement) is vectorised in numpy. The
command-line tool (`python -m flashcp.plan`) also draws windows from `flashcp.data`.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Sequence
from typing import Any

from flashcp.plan.plan import CAUSAL, Plan, Shard, Workload, normalized, shard_workload, validate

# name -> "module:function"; imported on first use so that e.g. scipy loads only for "ilp".
STRATEGIES: dict[str, str] = {
    "per_seq": "flashcp.plan.per_seq:plan_per_seq",
    "per_doc": "flashcp.plan.per_doc:plan_per_doc",
    "ring": "flashcp.plan.ring:plan_ring",
    "whole_doc": "flashcp.plan.whole_doc:plan_whole_doc",
    "flashcp": "flashcp.plan.hybrid:plan_flashcp",
    "ilp": "flashcp.plan.ilp:plan_ilp",
}


@functools.cache
def _strategy(name: str) -> tuple[Any, frozenset[str]]:
    """The strategy function and the option names it accepts (looked up once per name)."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; choose one of {', '.join(STRATEGIES)}")
    module, func = STRATEGIES[name].split(":")
    fn = getattr(importlib.import_module(module), func)
    return fn, frozenset(inspect.signature(fn).parameters)


def plan_shards(
    doc_lens: Sequence[int],
    cp_size: int,
    strategy: str = "flashcp",
    target_imbalance: float = 1.05,
    workload: Workload = CAUSAL,
    **options: Any,
) -> Plan:
    """Plan one window of documents (lengths in packed order) over `cp_size` ranks.

    The window length C = sum(doc_lens) must be divisible by `cp_size` so every rank can hold
    exactly C / cp_size tokens; documents themselves may have any positive length.
    `target_imbalance` (max / mean attention workload) is used by the strategies that balance
    workload adaptively; the fixed-grid ones (per_seq, per_doc) ignore it. `workload` is what
    balance means (`Workload`: causal pairs by default, or a model with sliding-window layers):
    the strategies that balance adaptively balance it (ilp: causal pairs only), and the plan's
    metrics report it.
    """
    lens = tuple(int(x) for x in doc_lens)
    if not lens:
        raise ValueError("doc_lens is empty: a window needs at least one document")
    if any(x <= 0 or x != y for x, y in zip(lens, doc_lens)):
        raise ValueError("doc_lens must be positive integers")
    if not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size must be a positive integer, got {cp_size!r}")
    context = sum(lens)
    if context % cp_size:
        raise ValueError(
            f"window length {context} is not divisible by cp_size {cp_size}: every rank must hold "
            f"the same number of tokens (pad or trim the window to a multiple of {cp_size})"
        )
    if not target_imbalance >= 1.0:
        raise ValueError(f"target_imbalance must be >= 1.0, got {target_imbalance}")
    fn, params = _strategy(strategy)
    if "target_imbalance" in params:
        options["target_imbalance"] = target_imbalance
    if not isinstance(workload, Workload):
        raise ValueError(f"workload must be a flashcp.plan.Workload, got {workload!r}")
    if "workload" in params:
        options["workload"] = workload
    unknown = set(options) - set(params)
    if unknown:
        raise ValueError(f"strategy {strategy!r} takes no option(s) {sorted(unknown)}")
    ranks, info = fn(lens, cp_size, **options)
    ranks, *rows = normalized(ranks)
    plan = Plan(lens, cp_size, ranks, strategy, info, workload)
    validate(plan, rows)
    return plan


__all__ = ["CAUSAL", "Plan", "Shard", "STRATEGIES", "Workload", "plan_shards", "shard_workload"]
