"""Time of one varlen FlashAttention call from its sequence shapes, fitted to measured calls.

Functional form (per pass, forward or backward):

    time = launch + (cta * n_cta + tile * n_tiles) * (1 + half_ctas / n_cta)

- n_tiles: the (query block x key block x head) tiles the kernel visits. FlashAttention walks
  each sequence in `block_q x block_k` tiles and skips only tiles wholly above the causal
  diagonal, so a sequence costs its tile count, not its exact score count: a 64-token shard pays
  for a 128-row tile, and a short shard with a long prefix pays for every prefix tile. This is
  the workload term, quantised by shard length.
- n_cta: query blocks x heads, the kernel's thread blocks. Each pays a fixed cost (load Q, finish
  the softmax, write O and the log-sum-exp) however few keys it visits: the per-shard overhead
  that makes fine-grained sharding slow.
- (1 + half_ctas / n_cta): a call with few thread blocks cannot fill the GPU (and ends on a
  ragged last wave); `half_ctas` is the block count at which it runs at half its full rate.
  Calls of a whole CP rank (thousands of blocks) are barely affected; single short documents are.
- launch: fixed per call (launch and host overhead), what a ring step pays once per step.

Given half_ctas the form is linear in (launch, cta, tile), so the fit is a non-negative weighted
least squares (relative error) inside a 1-D search over half_ctas: numpy only, deterministic.
The backward pass has its own coefficients when the samples carry fwd+bwd times; otherwise it
is the forward's per-block and per-tile costs times `bwd_ratio` (2.5 by default: the backward
does 2.5x the forward's matmul FLOPs at about the same efficiency).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from flashcp.costmodel.profiles import KernelSample, ProfileError

DEFAULT_BWD_RATIO = 2.5


def call_counts(
    q_lens: np.ndarray, k_lens: np.ndarray, heads: int, causal: bool = True,
    block_q: int = 128, block_k: int = 128, head_dim: int = 128, window: int | None = None,
) -> tuple[float, float]:
    """(thread blocks, head-dim-weighted tiles) of one varlen call over sequences (q_i, k_i).

    Causal masks are bottom-right aligned (query j of a sequence sees keys 0 .. j + k - q).
    Closed form per sequence, valid because block_q is a multiple of block_k: query block j < nb-1
    ends at row (j+1)*block_q and so sees (j+1)*m + ceil((k-q)/block_k) key blocks (m =
    block_q / block_k); the last block sees all ceil(k / block_k). A sliding `window` (HF
    `sliding_window`: query j sees keys j + k - q - window + 1 .. j + k - q) skips the key blocks
    wholly before the band, as FlashAttention's `window_size = (window - 1, 0)` does.
    """
    q = np.asarray(q_lens, dtype=np.int64)
    k = np.asarray(k_lens, dtype=np.int64)
    live = (q > 0) & (k > 0)
    q, k = q[live], k[live]
    nb = -(-q // block_q)
    kb = -(-k // block_k)
    if window is not None:
        if not causal:
            raise ValueError("a sliding window is causal: call_counts(..., causal=True, window=W)")
        tiles = _window_tiles(q, k, nb, window, block_q, block_k)
    elif causal:
        m = block_q // block_k
        off = -(-(k - q) // block_k)
        tiles = m * (nb - 1) * nb // 2 + (nb - 1) * off + kb
    else:
        tiles = nb * kb
    return float(heads * nb.sum()), float(heads * tiles.sum() * head_dim / 128)


def _window_tiles(
    q: np.ndarray, k: np.ndarray, nb: np.ndarray, window: int, block_q: int, block_k: int
) -> np.ndarray:
    """Key blocks each query block of a sliding-window call visits, from its first row's first key
    to its last row's last key (one entry per query block of every sequence)."""
    seq = np.repeat(np.arange(len(q)), nb)
    block = np.arange(int(nb.sum())) - np.repeat(np.cumsum(nb) - nb, nb)
    offset = (k - q)[seq]
    first = np.maximum(offset + block * block_q - window + 1, 0)
    last = offset + np.minimum((block + 1) * block_q, q[seq]) - 1
    return last // block_k - first // block_k + 1


@dataclass(frozen=True)
class PassCost:
    """Coefficients of one pass (ms): see the module docstring for the form."""

    launch_ms: float
    cta_ms: float
    tile_ms: float
    half_ctas: float

    def time_ms(self, n_cta: float, n_tiles: float) -> float:
        if n_cta <= 0:
            return 0.0
        work = self.cta_ms * n_cta + self.tile_ms * n_tiles
        return self.launch_ms + work * (1.0 + self.half_ctas / n_cta)

    def scaled(self, ratio: float) -> PassCost:
        """The same kernel doing `ratio` times the work per block and per tile."""
        return replace(self, cta_ms=self.cta_ms * ratio, tile_ms=self.tile_ms * ratio)


@dataclass(frozen=True)
class KernelModel:
    """Forward and backward cost of varlen attention calls on one GPU."""

    fwd: PassCost
    bwd: PassCost
    block_q: int = 128
    block_k: int = 128

    def __post_init__(self) -> None:
        if self.block_q % self.block_k:
            raise ValueError(f"block_q {self.block_q} must be a multiple of block_k {self.block_k}")

    def counts(
        self, q_lens, k_lens, heads: int, causal: bool = True, head_dim: int = 128, window: int | None = None
    ) -> tuple[float, float]:
        return call_counts(q_lens, k_lens, heads, causal, self.block_q, self.block_k, head_dim, window)

    def forward_ms(self, q_lens, k_lens, heads: int, causal: bool = True, head_dim: int = 128) -> float:
        return self.fwd.time_ms(*self.counts(q_lens, k_lens, heads, causal, head_dim))

    def backward_ms(self, q_lens, k_lens, heads: int, causal: bool = True, head_dim: int = 128) -> float:
        return self.bwd.time_ms(*self.counts(q_lens, k_lens, heads, causal, head_dim))

    def peak_tflops(self) -> float:
        """Forward TFLOP/s of a large call (4 * block_q * block_k * 128 FLOPs per tile)."""
        return 4 * self.block_q * self.block_k * 128 / (self.fwd.tile_ms * 1e-3) / 1e12


@dataclass(frozen=True)
class FitReport:
    """Relative errors of a fit: log(predicted / measured) per sample."""

    log_errors: np.ndarray
    n_cta: np.ndarray

    def summary(self, min_ctas: float = 0.0) -> dict[str, float]:
        e = self.log_errors[self.n_cta >= min_ctas]
        if e.size == 0:
            return {"n": 0, "rms": float("nan"), "max": float("nan"), "bias": float("nan")}
        return {"n": int(e.size), "rms": float(np.sqrt(np.mean(e**2))), "max": float(np.abs(e).max()),
                "bias": float(np.mean(e))}


def fit_pass(n_cta: np.ndarray, n_tiles: np.ndarray, ms: np.ndarray) -> PassCost:
    """Least-relative-error non-negative fit of PassCost to measured calls."""
    n_cta, n_tiles, ms = (np.asarray(a, dtype=float) for a in (n_cta, n_tiles, ms))
    if len(ms) < 4:
        raise ProfileError(f"need at least 4 timed calls to fit the kernel model, got {len(ms)}")
    if not np.all(ms > 0):  # the fit divides by them (relative error)
        raise ProfileError("every timed call must take a positive time to fit the kernel model")
    if np.unique(np.round(np.log(n_tiles / n_cta), 6)).size < 2:
        raise ProfileError(
            "the timed calls all have the same tiles per block: cannot separate block and tile costs"
        )

    def solve(h: float) -> tuple[float, np.ndarray]:
        occ = 1.0 + h / n_cta
        cols = np.stack([np.ones_like(ms), n_cta * occ, n_tiles * occ], axis=1) / ms[:, None]
        best = (np.inf, np.zeros(3))
        for keep in itertools.chain.from_iterable(itertools.combinations(range(3), r) for r in (3, 2, 1)):
            coef = np.zeros(3)
            coef[list(keep)] = np.linalg.lstsq(cols[:, keep], np.ones_like(ms), rcond=None)[0]
            if np.all(coef >= 0):
                err = float(np.sum((cols @ coef - 1.0) ** 2))
                if err < best[0]:
                    best = (err, coef)
        return best

    grid = np.concatenate([[0.0], np.geomspace(1.0, 1e5, 121)])
    errs = [solve(h)[0] for h in grid]
    i = int(np.argmin(errs))
    lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
    for _ in range(60):  # golden-section refinement around the best grid point
        a, b = lo + 0.382 * (hi - lo), lo + 0.618 * (hi - lo)
        if solve(a)[0] < solve(b)[0]:
            hi = b
        else:
            lo = a
    h = 0.5 * (lo + hi)
    coef = solve(h)[1]
    return PassCost(float(coef[0]), float(coef[1]), float(coef[2]), float(h))


def fit_kernel_model(
    samples: Sequence[KernelSample],
    bwd_ratio: float = DEFAULT_BWD_RATIO,
    block_q: int = 128,
    block_k: int = 128,
) -> tuple[KernelModel, dict[str, FitReport]]:
    """Fit forward (and, when measured, backward) costs; returns the model and its residuals."""
    if not samples:
        raise ProfileError("no kernel samples to fit: give a per-doc profile or a measured per-call table")
    counts = np.array(
        [call_counts(s.q_lens, s.k_lens, s.heads, True, block_q, block_k, s.head_dim) for s in samples]
    )
    fwd_ms = np.array([s.fwd_ms for s in samples])
    fwd = fit_pass(counts[:, 0], counts[:, 1], fwd_ms)
    reports = {"fwd": _report(fwd, counts, fwd_ms)}
    timed = np.array([s.fwd_bwd_ms is not None for s in samples])
    if timed.sum() >= 4:
        bwd_ms = np.array([s.fwd_bwd_ms - s.fwd_ms for s in samples if s.fwd_bwd_ms is not None])
        bwd = fit_pass(counts[timed, 0], counts[timed, 1], bwd_ms)
        reports["bwd"] = _report(bwd, counts[timed], bwd_ms)
    else:
        bwd = fwd.scaled(bwd_ratio)
    return KernelModel(fwd, bwd, block_q, block_k), reports


def _report(cost: PassCost, counts: np.ndarray, ms: np.ndarray) -> FitReport:
    pred = np.array([cost.time_ms(c, t) for c, t in counts])
    return FitReport(np.log(pred / ms), counts[:, 0])
