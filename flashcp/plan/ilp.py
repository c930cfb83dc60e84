"""Exact sharding by mixed-integer programming: the reference the heuristic is judged against.

Every document is cut into blocks of `block` tokens (its last block may be shorter, so no
length has to divide anything) and the solver assigns blocks to ranks. Only whole blocks would
rarely give every rank exactly C/N tokens, so any block may also be cut once, at an integer
point the solver chooses, into a head on one rank and a tail on another; every block is a
candidate for that cut and an equal-token plan always exists when `block <= C/N`.

Variables, per block k = [s, s + l) of its document and rank j:
  x[k,j] in {0,1}   rank j holds the whole block
  p[k,j], q[k,j]    rank j holds the head / the tail of a cut block; h[k,j], g[k,j] their tokens
  c[k,j] in [0,1]   the piece of rank j ending block k lies in a non-last shard of its document
  m[k,j] >= 0       tokens that piece contributes to rank j's compact send buffer

Constraints:
  coverage    sum_j x + p = 1 and sum_j x + q = 1 (each block whole on one rank, or cut once);
              sum_j h + g = l * sum_j p;  p <= h <= (l-1) p,  q <= g <= (l-1) q,  p + q <= 1
  tokens      sum_k l x + h + g = C/N for every rank (Eq. 2, exact)
  balance     W_j <= R * mean workload, where the mean is fixed by the window alone
  compact     a piece is non-last iff its document continues on another rank later (Eq. 5):
              c[k] >= (x + q)[k] - x[k+1] and c[k] >= (x + q)[k] + c[k+1] - 1 along each
              document; m >= l x + g - l (1 - c); every head counts in full (its tail is
              elsewhere); comm_j = sum_k h + m <= Z
Objective: minimise Z, the largest per-rank compact send buffer, subject to the balance bound.

A whole block costs its exact workload (start, length fixed). A cut block's pieces have
quadratic workloads, linearised conservatively: the head is charged the chord h * mean cost
per token of the block (an upper bound, the head holds its cheaper tokens) and the tail the
tangent at half the block, chord + l^2/8 (also an upper bound). So every rank's true workload
is at most its modelled one, a plan the solver accepts meets the target for real, and the
modelling slack is at most block^2/8 per cut. If the target is infeasible at this granularity
the solver instead minimises the largest workload (plus 1e-3 x the comm ratio to break ties)
and `info["target_met"]` is False.

This is the optimality study's yardstick, not a training-time planner: solve times grow quickly
with the number of blocks. Needs scipy (HiGHS through `scipy.optimize.milp`).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from scipy import sparse
from scipy.optimize import Bounds, LinearConstraint, milp

from flashcp.plan.plan import Shard, shard_workload


class _Blocks:
    """The block grid of a window: block k covers tokens [start[k], start[k] + length[k]) of doc[k]."""

    def __init__(self, doc_lens: tuple[int, ...], block: int) -> None:
        doc, start, length = [], [], []
        for d, n in enumerate(doc_lens):
            for s in range(0, n, block):
                doc.append(d)
                start.append(s)
                length.append(min(block, n - s))
        self.doc = np.array(doc)
        self.start = np.array(start, dtype=np.float64)
        self.length = np.array(length, dtype=np.float64)
        self.doc_len = np.array([doc_lens[d] for d in doc], dtype=np.float64)
        self.k = len(doc)
        # Block k's successor in its document, or -1 for a document's last block.
        self.next = np.where(np.r_[self.doc[1:] == self.doc[:-1], False], np.arange(1, self.k + 1), -1)


class _Model:
    """Variable layout and constraint rows of the sharding MILP for one window."""

    FAMILIES = ("x", "p", "q", "h", "g", "c", "m")

    def __init__(self, blocks: _Blocks, n: int, tokens_per_rank: int, mean_work: float) -> None:
        self.b, self.n, self.t, self.mean = blocks, n, tokens_per_rank, mean_work
        kn = blocks.k * n
        self.idx = {f: np.arange(i * kn, (i + 1) * kn).reshape(blocks.k, n) for i, f in enumerate(self.FAMILIES)}
        self.z = len(self.FAMILIES) * kn  # largest send buffer
        self.wmax = self.z + 1  # largest workload (scaled by the mean), used when the target is infeasible
        self.nvar = self.z + 2
        self.rows: list[tuple[dict[int, float], float, float]] = []

    def row(self, coefs: dict[int, float], lo: float, hi: float) -> None:
        self.rows.append((coefs, lo, hi))

    def build(self) -> None:
        b, n, v = self.b, self.n, self.idx
        x, p, q, h, g, c, m = (v[f] for f in self.FAMILIES)
        length = b.length
        # Workload per block (exact when whole), per token of a cut piece (chord), and the tail's
        # tangent offset, all scaled by the mean workload to keep coefficients near 1.
        whole = (2 * b.start + length + 1) * length / 2 / self.mean
        per_token = (b.start + (length + 1) / 2) / self.mean
        tail_extra = length**2 / 8 / self.mean
        inf = np.inf
        for k in range(b.k):
            self.row({**{x[k, j]: 1 for j in range(n)}, **{p[k, j]: 1 for j in range(n)}}, 1, 1)
            self.row({**{x[k, j]: 1 for j in range(n)}, **{q[k, j]: 1 for j in range(n)}}, 1, 1)
            cover = {h[k, j]: 1.0 for j in range(n)} | {g[k, j]: 1.0 for j in range(n)}
            self.row(cover | {p[k, j]: -length[k] for j in range(n)}, 0, 0)
            for j in range(n):
                self.row({h[k, j]: 1, p[k, j]: -(length[k] - 1)}, -inf, 0)
                self.row({h[k, j]: 1, p[k, j]: -1}, 0, inf)
                self.row({g[k, j]: 1, q[k, j]: -(length[k] - 1)}, -inf, 0)
                self.row({g[k, j]: 1, q[k, j]: -1}, 0, inf)
                self.row({p[k, j]: 1, q[k, j]: 1}, -inf, 1)
                nxt = b.next[k]
                if nxt >= 0:
                    self.row({c[k, j]: 1, x[k, j]: -1, q[k, j]: -1, x[nxt, j]: 1}, 0, inf)
                    if b.next[nxt] >= 0:
                        self.row({c[k, j]: 1, x[k, j]: -1, q[k, j]: -1, c[nxt, j]: -1}, -1, inf)
                    self.row({m[k, j]: 1, x[k, j]: -length[k], g[k, j]: -1, c[k, j]: -length[k]}, -length[k], inf)
        for j in range(n):
            tokens = {x[k, j]: length[k] for k in range(b.k)} | {h[k, j]: 1.0 for k in range(b.k)}
            self.row(tokens | {g[k, j]: 1.0 for k in range(b.k)}, self.t, self.t)
            comm = {h[k, j]: 1.0 for k in range(b.k)} | {m[k, j]: 1.0 for k in range(b.k)}
            self.row(comm | {self.z: -1}, -inf, 0)
        self.work_rows = []
        for j in range(n):
            work = {x[k, j]: whole[k] for k in range(b.k)}
            work |= {h[k, j]: per_token[k] for k in range(b.k)} | {g[k, j]: per_token[k] for k in range(b.k)}
            work |= {q[k, j]: tail_extra[k] for k in range(b.k)}
            self.work_rows.append(work)
        for j in range(n):
            # At most one cut head per rank: enough for exact tokens (see the sequential fill).
            self.row({p[k, j]: 1 for k in range(b.k)}, -np.inf, 1)
        # Ranks are interchangeable: number them by the first block they touch, so rank j may
        # touch block k only if rank j-1 touched an earlier block (and block 0 is on rank 0).
        for j in range(1, n):
            for k in range(b.k):
                row = {x[k, j]: 1.0, p[k, j]: 1.0, q[k, j]: 1.0}
                for f in (x, p, q):
                    row |= {f[i, j - 1]: -1.0 for i in range(k)}
                self.row(row, -np.inf, 0)

    def bounds_and_integrality(self) -> tuple[Bounds, np.ndarray]:
        b, v = self.b, self.idx
        lo, hi = np.zeros(self.nvar), np.ones(self.nvar)
        integral = np.zeros(self.nvar)
        for f in ("x", "p", "q", "h", "g"):
            integral[v[f].ravel()] = 1
        splittable = (b.length > 1)[:, None]
        for f in ("p", "q"):
            hi[v[f]] = np.broadcast_to(splittable, v[f].shape)
        for f in ("h", "g"):
            hi[v[f]] = np.broadcast_to(np.where(splittable, b.length[:, None] - 1, 0), v[f].shape)
        not_last = (b.next >= 0)[:, None]
        hi[v["c"]] = np.broadcast_to(not_last, v["c"].shape)
        hi[v["m"]] = np.broadcast_to(np.where(not_last, b.length[:, None], 0), v["m"].shape)
        hi[self.z] = hi[self.wmax] = np.inf
        return Bounds(lo, hi), integral

    def solve(self, cap: float | None, time_limit: float, mip_rel_gap: float):
        """Minimise Z with workloads <= cap (scaled), or, with cap None, minimise the largest workload."""
        rows = list(self.rows)
        if cap is not None:
            b, x, q, c = self.b, self.idx["x"], self.idx["q"], self.idx["c"]
            end = b.start + b.length
            whole_suffix = (b.doc_len - b.start) * (b.doc_len + b.start + 1) / 2 / self.mean
            tail_suffix = (b.doc_len - end + 1) * (b.doc_len + end) / 2 / self.mean
            for k in np.flatnonzero(b.next >= 0):
                for j in range(self.n):
                    if tail_suffix[k] > cap:
                        rows.append(({c[k, j]: 1, x[k, j]: -1, q[k, j]: -1}, 0, np.inf))
                    elif whole_suffix[k] > cap:
                        rows.append(({c[k, j]: 1, x[k, j]: -1}, 0, np.inf))
        for work in self.work_rows:
            rows.append((work, -np.inf, cap) if cap is not None else (work | {self.wmax: -1}, -np.inf, 0))
        data, ri, ci = [], [], []
        for r, (coefs, _, _) in enumerate(rows):
            ri += [r] * len(coefs)
            ci += list(coefs)
            data += list(coefs.values())
        a = sparse.csr_array((data, (ri, ci)), shape=(len(rows), self.nvar))
        cons = LinearConstraint(a, [lo for _, lo, _ in rows], [hi for _, _, hi in rows])
        obj = np.zeros(self.nvar)
        if cap is not None:
            obj[self.z] = 1.0
        else:
            obj[self.wmax] = 1.0
            obj[self.z] = 1e-3 / self.t
        bounds, integral = self.bounds_and_integrality()
        opts = {"time_limit": time_limit, "mip_rel_gap": mip_rel_gap}
        return milp(obj, constraints=cons, integrality=integral, bounds=bounds, options=opts)

    def shards(self, sol: np.ndarray) -> list[list[Shard]]:
        b, v = self.b, self.idx
        ranks: list[list[Shard]] = [[] for _ in range(self.n)]
        for k in range(b.k):
            d, s, length = int(b.doc[k]), int(b.start[k]), int(b.length[k])
            owner = np.flatnonzero(sol[v["x"][k]] > 0.5)
            if len(owner):
                ranks[owner[0]].append(Shard(d, s, length))
                continue
            head = int(np.argmax(sol[v["p"][k]]))
            tail = int(np.argmax(sol[v["q"][k]]))
            cut = int(round(sol[v["h"][k, head]]))
            ranks[head].append(Shard(d, s, cut))
            ranks[tail].append(Shard(d, s + cut, length - cut))
        return ranks


def plan_ilp(
    doc_lens: tuple[int, ...],
    cp_size: int,
    target_imbalance: float = 1.05,
    block: int | None = None,
    time_limit: float = 60.0,
    mip_rel_gap: float = 1e-4,
) -> tuple[list[list[Shard]], dict[str, Any]]:
    """Least compact communication subject to max/mean workload <= `target_imbalance`.

    `block` is the sharding granularity in tokens (default C / (8 N), at most C / N);
    `time_limit` bounds each solver call in seconds. The best plan found is returned;
    `info` says whether it is proven optimal, the relative MIP gap, the solver's lower bound on
    the largest send buffer (tokens), the solve time and whether the target was met.
    """
    n = cp_size
    per_rank = sum(doc_lens) // n
    block = max(1, per_rank // 8) if block is None else block
    if not isinstance(block, int) or not 1 <= block <= per_rank:
        raise ValueError(f"ilp block must be an integer in [1, C/N = {per_rank}], got {block!r}")
    if not time_limit > 0:
        raise ValueError(f"ilp time_limit must be positive, got {time_limit}")
    mean_work = sum(shard_workload(0, x) for x in doc_lens) / n
    model = _Model(_Blocks(doc_lens, block), n, per_rank, mean_work)
    model.build()
    t0 = time.perf_counter()
    res = model.solve(target_imbalance, time_limit, mip_rel_gap)
    target_met = res.x is not None
    if res.status == 2:  # proven infeasible: balance as well as this granularity allows instead
        res = model.solve(None, time_limit, mip_rel_gap)
    solve_s = time.perf_counter() - t0
    if res.x is None:
        raise RuntimeError(
            f"ilp found no plan within {time_limit:g} s ({res.message}); "
            "raise time_limit or use a coarser block"
        )
    info = {
        "optimal": res.status == 0,
        "mip_gap": float(res.mip_gap) if res.mip_gap is not None else None,
        "comm_bound_tokens": float(res.mip_dual_bound) if target_met else None,
        "solve_s": solve_s,
        "target_met": target_met,
        "block": block,
        "num_blocks": model.b.k,
        "status": res.message,
    }
    return model.shards(res.x), info
