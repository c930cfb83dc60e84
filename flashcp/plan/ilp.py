"""Sharding by mixed-integer programming: the yardstick the heuristic planner is judged against.

The compact all-gather (Eq. 5) sends every token that is not in its document's last shard, so a
plan is, for each document d, (1) the rank that holds its last shard and where that shard starts,
and (2) how the tokens before it (its *prefix*, all of them sent) are spread over ranks. Last
shards start on a grid of `block` tokens; prefixes are spread in slices of `prefix_block` tokens.
Grids restart at every document and the last block or slice of a document may be shorter, so no
length has to divide anything. Variables, for document d, block k of it, slice i and rank j:

  y[d,j] in {0,1}    rank j holds d's last shard                  sum_j y[d,j] = 1
  z[k] in {0,1}      block k lies in its document's last shard     z[k] <= z[k+1]; z = 1 on d's last block
  v[k,j] >= 0        z[k] * y[d,j], exactly:                       sum_j v[k,j] = z[k], v[k,j] <= y[d,j]
  u[i,j] integer     prefix tokens of slice i on rank j            sum_j u[i,j] = len_i (1 - z[block of i])

  tokens      sum_k len_k v[k,j] + sum_i u[i,j] = C / N              (Eq. 2, exact)
  balance     sum_k W_k v[k,j] + sum_i c_i u[i,j] <= R * mean work    (Eq. 3 as a bound: the mean is
              fixed by the window, so "imbalance <= R" is linear)
  comm        sum_i u[i,j] <= Z;   objective: minimise Z, the largest compact send buffer (tokens)

W_k is block k's exact causal workload and c_i the mean cost per token of slice i, exact for a
slice on one rank. A slice shared by ranks is charged c_i per token, within len_i^2 / 8 of each
piece's true cost; the pieces are laid out with the most loaded rank first (early tokens are
cheaper), and the last shard's owner last before its last shard so the two merge (the plan then
sends at most what the model counts). Should a rank still end above the target, the bound is
lowered by the miss and the model solved again (at most 3 times), so `target_met` is the plan's
true balance. If no plan meets the target at this granularity (a document's last block alone may
be too heavy), the strategy minimises the largest workload instead, plus 1e-3 x the comm ratio.

A block whose suffix [start, end of document) alone exceeds the bound cannot be in a last shard
(z[k] = 0), which rules long documents out cheaply; ranks are numbered by the first document
whose last shard they hold, removing the N! relabelings of every plan.

The MILP optimises communication and balance only: its prefixes can be cut into many small
shards. It is the optimality study's reference, not a training-time planner: solve time grows
quickly with documents and blocks (seconds to a minute for 8K-token windows at 256-token blocks).
Needs scipy (HiGHS through `scipy.optimize.milp`).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
from scipy import sparse
from scipy.optimize import Bounds, LinearConstraint, OptimizeResult, milp

from flashcp.plan.plan import Shard, shard_workload

_MAX_RESOLVES = 3


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Route C-level stdout to stderr: the HiGHS bundled with scipy can print debug lines there,
    which would corrupt machine-readable output (e.g. `python -m flashcp.plan --json`)."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


class _Model:
    """The MILP of one window: last-shard blocks of `block` tokens, prefix slices of `prefix_block`."""

    def __init__(self, doc_lens: tuple[int, ...], n: int, block: int, prefix_block: int) -> None:
        self.doc_lens, self.n = doc_lens, n
        self.tokens_per_rank = sum(doc_lens) // n
        self.mean = sum(shard_workload(0, x) for x in doc_lens) / n
        doc, start, length = [], [], []
        for d, size in enumerate(doc_lens):
            for s in range(0, size, block):
                doc.append(d)
                start.append(s)
                length.append(min(block, size - s))
        self.doc, self.start, self.length = np.array(doc), np.array(start), np.array(length)
        self.last = np.r_[self.doc[1:] != self.doc[:-1], True]  # a document's last block
        # Slices: block k's tokens in runs of prefix_block; slice i lies in block parent[i].
        parent, s_start, s_len = [], [], []
        for k, (s, l) in enumerate(zip(start, length)):
            for a in range(s, s + l, prefix_block):
                parent.append(k)
                s_start.append(a)
                s_len.append(min(prefix_block, s + l - a))
        self.parent, self.s_start, self.s_len = np.array(parent), np.array(s_start), np.array(s_len)
        n_docs, k, m = len(doc_lens), len(doc), len(parent)
        self.y = np.arange(n_docs * n).reshape(n_docs, n)
        self.z = np.arange(k) + self.y.size
        self.v = np.arange(k * n).reshape(k, n) + self.z[-1] + 1
        self.u = np.arange(m * n).reshape(m, n) + self.v[-1, -1] + 1
        self.comm = self.u[-1, -1] + 1  # Z: largest send buffer
        self.wmax = self.comm + 1  # largest workload, for the fallback objective
        self.nvar = self.wmax + 1
        st, sl = self.s_start.astype(float), self.s_len.astype(float)
        b, bl = self.start.astype(float), self.length.astype(float)
        self.work = (2 * b + bl + 1) * bl / 2 / self.mean
        self.cost = (st + (sl + 1) / 2) / self.mean
        size = np.array(doc_lens, dtype=float)[self.doc]
        self.suffix_work = (size - b) * (size + b + 1) / 2 / self.mean
        self.rows = self._rows()

    def _rows(self) -> list[tuple[dict[int, float], float, float]]:
        n, y, z, v, u, inf = self.n, self.y, self.z, self.v, self.u, np.inf
        n_docs, slices = len(self.doc_lens), range(len(self.parent))
        rows = [({y[d, j]: 1 for j in range(n)}, 1, 1) for d in range(n_docs)]
        for k, d in enumerate(self.doc):
            rows.append(({**{v[k, j]: 1 for j in range(n)}, z[k]: -1}, 0, 0))
            rows += [({v[k, j]: 1, y[d, j]: -1}, -inf, 0) for j in range(n)]
            if not self.last[k]:
                rows.append(({z[k]: 1, z[k + 1]: -1}, -inf, 0))
        for i, (k, l) in enumerate(zip(self.parent, self.s_len)):
            rows.append(({**{u[i, j]: 1 for j in range(n)}, z[k]: l}, l, l))
        for j in range(n):
            tokens = {v[k, j]: l for k, l in enumerate(self.length)} | {u[i, j]: 1 for i in slices}
            rows.append((tokens, self.tokens_per_rank, self.tokens_per_rank))
            rows.append(({**{u[i, j]: 1 for i in slices}, self.comm: -1}, -inf, 0))
            if j:  # rank j holds a last shard of document d only if rank j-1 holds one of an earlier one
                for d in range(n_docs):
                    rows.append(({y[d, j]: 1, **{y[e, j - 1]: -1 for e in range(d)}}, -inf, 0))
        return rows

    def solve(self, cap: float | None, time_limit: float, mip_rel_gap: float,
              node_limit: int | None = None) -> OptimizeResult:
        """Minimise Z with every workload <= cap; with cap None minimise the largest workload."""
        rows = list(self.rows)
        for j in range(self.n):
            work = {self.v[k, j]: w for k, w in enumerate(self.work)}
            work |= {self.u[i, j]: c for i, c in enumerate(self.cost)}
            rows.append((work, -np.inf, cap) if cap is not None else ({**work, self.wmax: -1}, -np.inf, 0))
        coefs = [(r, i, a) for r, (row, _, _) in enumerate(rows) for i, a in row.items()]
        r, i, a = zip(*coefs)
        matrix = sparse.csr_array((a, (r, i)), shape=(len(rows), self.nvar))
        lo, hi = np.zeros(self.nvar), np.ones(self.nvar)
        hi[self.u] = self.s_len[:, None]
        lo[self.z] = self.last
        if cap is not None:
            hi[self.z] = np.where(self.last, 1, self.suffix_work <= cap)
        hi[self.comm] = hi[self.wmax] = np.inf
        integral = np.zeros(self.nvar)
        integral[np.r_[self.y.ravel(), self.z, self.u.ravel(), self.comm]] = 1
        objective = np.zeros(self.nvar)
        if cap is not None:
            objective[self.comm] = 1.0
        else:
            objective[self.wmax] = 1.0
            objective[self.comm] = 1e-3 / self.tokens_per_rank
        with _stdout_to_stderr():
            return milp(
                objective,
                constraints=LinearConstraint(matrix, [x for _, x, _ in rows], [x for _, _, x in rows]),
                integrality=integral,
                bounds=Bounds(lo, hi),
                options={"time_limit": time_limit, "mip_rel_gap": mip_rel_gap}
                | ({} if node_limit is None else {"node_limit": node_limit}),
            )

    def shards(self, sol: np.ndarray) -> list[list[Shard]]:
        """The plan of a solution. A prefix slice shared by several ranks is charged at its mean
        cost per token whatever the order of its pieces; the order decides the true costs (early
        tokens are cheaper), so pieces are laid out heaviest rank first: the rank with the most
        workload so far gets the cheapest positions. The owner of the document's last shard goes
        last in the slice just before that shard, where its piece merges into the last shard."""
        ranks: list[list[Shard]] = [[] for _ in range(self.n)]
        owner = np.argmax(sol[self.y], axis=1)
        in_last = sol[self.z] > 0.5
        amounts = np.rint(sol[self.u]).astype(int)
        load = (sol[self.v].T @ self.work + amounts.T @ self.cost) * self.mean  # as charged
        for k in np.flatnonzero(in_last):
            ranks[owner[self.doc[k]]].append(Shard(int(self.doc[k]), int(self.start[k]), int(self.length[k])))
        for i in np.flatnonzero(~in_last[self.parent]):
            k, l = self.parent[i], int(self.s_len[i])
            d, s, offset = int(self.doc[k]), int(self.s_start[i]), 0
            order = sorted(np.flatnonzero(amounts[i]), key=lambda j: -load[j])
            ends_prefix = s + l == self.start[k] + self.length[k] and not self.last[k] and in_last[k + 1]
            if ends_prefix and owner[d] in order:
                order.remove(owner[d])
                order.append(owner[d])
            for j in order:
                a = int(amounts[i, j])
                ranks[j].append(Shard(d, s + offset, a))
                load[j] += a * (offset - (l - a) / 2)  # true cost minus charged cost
                offset += a
        return ranks


def _imbalance(ranks: list[list[Shard]], mean: float) -> float:
    return max(sum(shard_workload(s.start, s.length) for s in shards) for shards in ranks) / mean


def plan_ilp(
    doc_lens: tuple[int, ...],
    cp_size: int,
    target_imbalance: float = 1.05,
    block: int | None = None,
    prefix_block: int | None = None,
    time_limit: float = 60.0,
    mip_rel_gap: float = 1e-4,
    node_limit: int | None = None,
) -> tuple[list[list[Shard]], dict[str, Any]]:
    """Least compact communication subject to max/mean workload <= `target_imbalance`.

    `block` is the last-shard granularity in tokens (default C / (8 N)), `prefix_block` the
    granularity prefixes are spread in (default block / 8); `time_limit` bounds all solver
    calls together, in seconds (the infeasible-target fallback gets at least a tenth of it);
    `node_limit` bounds each solver call's branch-and-bound nodes, a limit that, unlike time, gives
    the same plan on a fast machine and a loaded one.
    Returns the best plan found; `info` says whether the last solve was proven optimal
    (`optimal`, `mip_gap`; after `resolves` > 0 that is for the lowered bound), the first solve's
    lower bound on the largest send buffer in tokens (`comm_bound_tokens`), the solve time and
    whether the plan meets the target (`target_met`, from the plan's true workloads).
    """
    n = cp_size
    per_rank = sum(doc_lens) // n
    block = max(1, per_rank // 8) if block is None else block
    prefix_block = max(1, block // 8) if prefix_block is None else prefix_block
    checked = [("block", block), ("prefix_block", prefix_block)] + ([("node_limit", node_limit)] if node_limit is not None else [])
    for name, value in checked:
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"ilp {name} must be a positive integer, got {value!r}")
    if not time_limit > 0:
        raise ValueError(f"ilp time_limit must be positive, got {time_limit}")
    model = _Model(doc_lens, n, block, prefix_block)
    t0 = time.perf_counter()

    def left() -> float:
        return time_limit - (time.perf_counter() - t0)

    cap, resolves, best, bound = target_imbalance, 0, None, None
    while True:
        res = model.solve(cap, max(left(), 0.01), mip_rel_gap, node_limit)
        if bound is None and res.x is not None:
            bound = float(res.mip_dual_bound)  # a lower bound for the untightened model only
        if res.x is None:
            break
        ranks = model.shards(res.x)
        best = ranks, res
        miss = _imbalance(ranks, model.mean) - target_imbalance
        if miss <= 0 or resolves == _MAX_RESOLVES or left() <= 0:
            break
        cap -= miss * (1 + 1e-6)
        resolves += 1
    if best is None and res.status == 2:  # target infeasible: balance as well as blocks allow instead
        res = model.solve(None, max(left(), 0.1 * time_limit), mip_rel_gap, node_limit)
        best = None if res.x is None else (model.shards(res.x), res)
    if best is None:
        raise RuntimeError(
            f"ilp found no plan in {time_limit:g} s ({res.message}); raise time_limit or coarsen block"
        )
    ranks, res = best
    imbalance = _imbalance(ranks, model.mean)
    info = {
        "optimal": res.status == 0,
        "mip_gap": None if res.mip_gap is None else float(res.mip_gap),
        "comm_bound_tokens": bound,
        "solve_s": time.perf_counter() - t0,
        "target_met": imbalance <= target_imbalance,
        "resolves": resolves,
        "block": block,
        "prefix_block": prefix_block,
        "num_blocks": len(model.doc),
    }
    return ranks, info
