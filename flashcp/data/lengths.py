"""Document-length workloads: seeded length samplers and the packer that fills context windows.

Planning quality depends on which documents share a window, so the planner is judged on windows
packed the way the evaluation packs them: documents are drawn independently (with replacement)
from a length distribution and appended until the window holds C tokens; the document that
overflows is truncated to fit, so every window sums to C exactly (and C a multiple of the CP
size makes every window plannable).

    sampler = length_sampler("pile", seed=0)      # or "wlbllm", "redpajama", "lengths.json"
    windows = pack_windows(sampler, context=131072, num_windows=200)

Named distributions (all lengths in tokens):

- ``wlbllm``: the production length distribution of the WLB-LLM paper (as publicly
  reconstructed), stored as our own 140-knot quantile table (tail knots every 0.05 % of
  probability above the 99th percentile, where the long documents that drive imbalance live).
  Sampling is inverse-CDF with linear interpolation of log(length) between knots. Median ~3.2K,
  mean ~4.0K, 1 % of documents above 26K, longest ~125K: ~36 documents per 128K window.
- ``pile``: a lognormal mixture over the 22 components of The Pile (Gao et al. 2020, Table 1).
  Each component's share of training bytes is its published weight (effective size) and its
  mean document length is the published mean document size converted at 4 bytes per token
  (a rule of thumb for BPE tokenizers on English text; code and math compress differently).
  Documents are drawn per component in proportion to weight / mean size (the document count
  share, so token shares match the weights), each component lognormal with the published mean
  and log-space sigma 1.0 (an assumption: the paper publishes means only). Mean ~1.5K tokens
  (the table's overall 5.91 KiB), median ~500: ~100 documents per 128K window.
- ``redpajama``: the same construction over the seven RedPajama-1T sources with their published
  token counts (878B CommonCrawl, 175B C4, 59B GitHub, 26B Books, 28B ArXiv, 24B Wikipedia,
  20B StackExchange). RedPajama publishes no document counts, so mean document lengths are
  assumptions: C4 from its 365M documents (Dodge et al. 2021), the others from the matching
  Pile component (CommonCrawl ~ Pile-CC, GitHub, Books ~ Books3, ArXiv, Wikipedia (en),
  StackExchange) at 4 bytes per token; sigma 1.0 as for ``pile``. Mean ~0.9K tokens, median
  ~490: ~150 documents per 128K window.

- ``prolong-pool``: a held-out stand-in for ProLong-style data (`HeavyTailed`, below): a pool of
  77,932 lengths, a log-normal body of median 1.9K tokens and 0.2 % of the documents from a
  Pareto tail above 32K reaching 340K. Tuning was never done on it.

`HeavyTailed` generates such pools for any body, tail share and maximum (the balance property
tests draw them: maxima 10K-400K, 0.05-5 % of the documents long).

Any JSON list of positive integers can serve as an empirical pool (sampled uniformly with
replacement) through `LengthPool.from_json` or by passing its path to `length_sampler`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

BYTES_PER_TOKEN = 4.0
LOG_SIGMA = 1.0

# (probability in units of 1e-4, length in tokens): quantiles of the WLB-LLM length distribution.
_WLBLLM_QUANTILES: tuple[tuple[int, int], ...] = (
    (0, 1), (5, 4), (10, 7), (20, 13), (50, 32), (100, 63), (200, 129), (300, 193), (400, 256),
    (500, 324), (600, 386), (700, 450), (800, 518), (900, 581), (1000, 646), (1100, 708),
    (1200, 772), (1300, 836), (1400, 897), (1500, 961), (1600, 1027), (1700, 1091), (1800, 1154),
    (1900, 1218), (2000, 1283), (2100, 1347), (2200, 1414), (2300, 1478), (2400, 1542),
    (2500, 1606), (2600, 1674), (2700, 1738), (2800, 1802), (2900, 1867), (3000, 1932),
    (3100, 2002), (3200, 2065), (3300, 2132), (3400, 2195), (3500, 2257), (3600, 2322),
    (3700, 2388), (3800, 2454), (3900, 2519), (4000, 2582), (4100, 2646), (4200, 2711),
    (4300, 2774), (4400, 2840), (4500, 2909), (4600, 2975), (4700, 3040), (4800, 3104),
    (4900, 3166), (5000, 3227), (5100, 3290), (5200, 3353), (5300, 3417), (5400, 3480),
    (5500, 3543), (5600, 3605), (5700, 3668), (5800, 3731), (5900, 3795), (6000, 3861),
    (6100, 3924), (6200, 3990), (6300, 4053), (6400, 4116), (6500, 4181), (6600, 4248),
    (6700, 4313), (6800, 4382), (6900, 4446), (7000, 4514), (7100, 4579), (7200, 4644),
    (7300, 4704), (7400, 4767), (7500, 4832), (7600, 4897), (7700, 4961), (7800, 5025),
    (7900, 5089), (8000, 5156), (8100, 5219), (8200, 5281), (8300, 5343), (8400, 5407),
    (8500, 5470), (8600, 5536), (8700, 5600), (8800, 5657), (8900, 5717), (9000, 5784),
    (9100, 5851), (9200, 5917), (9300, 5980), (9400, 6045), (9500, 6110), (9600, 6173),
    (9625, 6189), (9650, 6205), (9675, 6221), (9700, 6236), (9725, 6250), (9730, 6549),
    (9735, 6761), (9740, 7000), (9745, 7278), (9750, 7482), (9775, 8804), (9800, 10078),
    (9825, 11412), (9850, 13210), (9875, 17760), (9900, 26058), (9905, 28940), (9910, 31811),
    (9915, 35147), (9920, 38054), (9925, 42128), (9930, 46548), (9935, 50822), (9940, 56080),
    (9945, 62378), (9950, 69098), (9955, 73458), (9960, 78661), (9965, 86873), (9970, 91216),
    (9975, 95098), (9980, 99303), (9985, 107915), (9990, 119794), (9992, 121142), (9994, 122229),
    (9996, 123008), (9998, 123745), (10000, 124913),
)

# The Pile, Table 1: (component, weight in % of effective bytes, mean document size in KiB).
_PILE_COMPONENTS: tuple[tuple[str, float, float], ...] = (
    ("Pile-CC", 18.11, 4.33),
    ("PubMed Central", 14.40, 30.55),
    ("Books3", 12.07, 538.36),
    ("OpenWebText2", 10.01, 3.85),
    ("ArXiv", 8.96, 46.61),
    ("Github", 7.59, 5.25),
    ("FreeLaw", 6.12, 15.06),
    ("StackExchange", 5.13, 2.16),
    ("USPTO Backgrounds", 3.65, 4.08),
    ("PubMed Abstracts", 3.07, 1.30),
    ("Gutenberg (PG-19)", 2.17, 398.73),
    ("OpenSubtitles", 1.55, 30.48),
    ("Wikipedia (en)", 1.53, 1.11),
    ("DM Mathematics", 1.24, 8.00),
    ("Ubuntu IRC", 0.88, 545.48),
    ("BookCorpus2", 0.75, 369.87),
    ("EuroParl", 0.73, 68.87),
    ("HackerNews", 0.62, 4.92),
    ("YoutubeSubtitles", 0.60, 22.55),
    ("PhilPapers", 0.38, 73.37),
    ("NIH ExPorter", 0.30, 2.11),
    ("Enron Emails", 0.14, 1.78),
)


def _kib_tokens(kib: float) -> float:
    return kib * 1024 / BYTES_PER_TOKEN


# RedPajama-1T: (source, billions of tokens, assumed mean document length in tokens).
_REDPAJAMA_SOURCES: tuple[tuple[str, float, float], ...] = (
    ("CommonCrawl", 878, _kib_tokens(4.33)),
    ("C4", 175, 175e9 / 365e6),
    ("GitHub", 59, _kib_tokens(5.25)),
    ("Books", 26, _kib_tokens(538.36)),
    ("ArXiv", 28, _kib_tokens(46.61)),
    ("Wikipedia", 24, _kib_tokens(1.11)),
    ("StackExchange", 20, _kib_tokens(2.16)),
)


class LengthDistribution(Protocol):
    """Anything that draws `n` document lengths (int64 >= 1) from a numpy generator."""

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray: ...


@dataclass(frozen=True)
class QuantileLengths:
    """Inverse-CDF sampling from quantile knots, log(length) linear between knots."""

    probs: tuple[float, ...]
    lengths: tuple[int, ...]

    def __post_init__(self) -> None:
        p = np.asarray(self.probs)
        if p[0] != 0.0 or p[-1] != 1.0 or np.any(np.diff(p) <= 0) or np.any(np.diff(self.lengths) < 0):
            raise ValueError("quantile knots must rise from probability 0 to 1 with non-decreasing lengths")
        if min(self.lengths) < 1:
            raise ValueError("quantile knot lengths must be >= 1")

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        log_len = np.interp(rng.random(n), self.probs, np.log(self.lengths))
        return np.maximum(1, np.rint(np.exp(log_len))).astype(np.int64)


@dataclass(frozen=True)
class LognormalMixture:
    """Documents from named components; each component's lengths are lognormal.

    `doc_weights` are the probabilities of drawing a document from each component, `means` the
    components' mean lengths in tokens and `sigma` the shared log-space standard deviation.
    """

    names: tuple[str, ...]
    doc_weights: tuple[float, ...]
    means: tuple[float, ...]
    sigma: float = LOG_SIGMA

    @classmethod
    def from_token_shares(
        cls,
        names: Sequence[str],
        token_shares: Sequence[float],
        means: Sequence[float],
        sigma: float = LOG_SIGMA,
    ) -> LognormalMixture:
        """Mixture whose components hold the given shares of all tokens (documents ~ share / mean)."""
        counts = [s / m for s, m in zip(token_shares, means)]
        total = sum(counts)
        return cls(tuple(names), tuple(c / total for c in counts), tuple(means), sigma)

    def mean_length(self) -> float:
        return sum(w * m for w, m in zip(self.doc_weights, self.means))

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        comp = rng.choice(len(self.means), size=n, p=self.doc_weights)
        # A lognormal with log-space (mu, sigma) has mean exp(mu + sigma^2 / 2).
        mu = np.log(np.asarray(self.means))[comp] - self.sigma**2 / 2
        lengths = np.exp(mu + self.sigma * rng.standard_normal(n))
        return np.maximum(1, np.rint(lengths)).astype(np.int64)


@dataclass(frozen=True)
class LengthPool:
    """An empirical list of document lengths, sampled uniformly with replacement."""

    lengths: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.lengths:
            raise ValueError("a length pool needs at least one document length")
        bad = [x for x in self.lengths if isinstance(x, bool) or not isinstance(x, int) or x < 1]
        if bad:
            raise ValueError(f"document lengths must be positive integers, got {bad[0]!r}")

    @classmethod
    def from_json(cls, path: str | Path) -> LengthPool:
        """Read a JSON list of positive integers (document lengths in tokens)."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read lengths file {path}: {e}") from e
        except json.JSONDecodeError as e:
            raise ValueError(f"lengths file {path} is not valid JSON: {e}") from e
        if not isinstance(data, list):
            kind = type(data).__name__
            raise ValueError(f"lengths file {path} must hold a JSON list of integers, got {kind}")
        try:
            return cls(tuple(data))
        except ValueError as e:
            raise ValueError(f"lengths file {path}: {e}") from e

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.asarray(self.lengths, dtype=np.int64)[rng.integers(0, len(self.lengths), size=n)]


@dataclass(frozen=True)
class HeavyTailed:
    """A log-normal body with a Pareto tail: `long_share` of the documents are drawn from a Pareto
    of index `alpha` above `long_min` (truncated at `max_len`), the others from a log-normal of
    median `median` and log-space `sigma` truncated below `long_min`. So exactly `long_share` of
    the documents are long (in expectation), whatever the body's own spread: what a balancer
    tuned on one corpus must survive on another."""

    median: float
    sigma: float
    long_share: float
    long_min: int
    max_len: int
    alpha: float = 1.0

    def __post_init__(self) -> None:
        if not (0 <= self.long_share <= 1 and 1 <= self.median < self.long_min < self.max_len and self.sigma > 0
                and self.alpha > 0):  # fmt: skip
            raise ValueError("need 0 <= long_share <= 1, 1 <= median < long_min < max_len, sigma > 0, alpha > 0")

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        long = rng.random(n) < self.long_share
        out = np.empty(n, dtype=np.float64)
        # Pareto truncated at max_len, by its inverse CDF.
        u = rng.random(int(long.sum()))
        out[long] = self.long_min * (1 - u * (1 - (self.long_min / self.max_len) ** self.alpha)) ** (-1 / self.alpha)
        body = np.flatnonzero(~long)
        while body.size:  # the body below long_min: redraw the few above it
            out[body] = self.median * np.exp(self.sigma * rng.standard_normal(body.size))
            body = body[out[body] >= self.long_min]
        return np.clip(np.rint(out), 1, self.max_len).astype(np.int64)

    def pool(self, size: int, seed: int) -> LengthPool:
        """`size` lengths drawn once with `seed`, sampled uniformly with replacement from then on
        (like a corpus's lengths), the longest set to `max_len` so that the pool reaches it."""
        lengths = self.draw(np.random.default_rng(seed), size)
        lengths[np.argmax(lengths)] = self.max_len
        return LengthPool(tuple(lengths.tolist()))


# ProLong-style lengths nothing was tuned on: median 1.9K, 0.2 % above 32K, the longest 340K.
PROLONG_POOL = HeavyTailed(median=1900.0, sigma=1.0, long_share=0.002, long_min=32768, max_len=340_000)


def _wlbllm() -> QuantileLengths:
    probs, lengths = zip(*_WLBLLM_QUANTILES)
    return QuantileLengths(tuple(p / 1e4 for p in probs), lengths)


def _pile() -> LognormalMixture:
    names, weights, kib = zip(*_PILE_COMPONENTS)
    return LognormalMixture.from_token_shares(names, weights, [_kib_tokens(k) for k in kib])


def _redpajama() -> LognormalMixture:
    names, tokens, means = zip(*_REDPAJAMA_SOURCES)
    return LognormalMixture.from_token_shares(names, tokens, means)


DISTRIBUTIONS: dict[str, Callable[[], LengthDistribution]] = {
    "wlbllm": _wlbllm,
    "pile": _pile,
    "redpajama": _redpajama,
    "prolong-pool": lambda: PROLONG_POOL.pool(77_932, seed=38),
}


class LengthSampler:
    """A length distribution bound to its own seeded stream: same seed, same documents."""

    def __init__(self, dist: LengthDistribution, seed: int = 0, name: str = "") -> None:
        self.dist = dist
        self.seed = seed
        self.name = name
        self._rng = np.random.default_rng(seed)

    def sample(self, n: int) -> np.ndarray:
        """The next `n` document lengths (int64, each >= 1)."""
        return self.dist.draw(self._rng, n)


def length_sampler(name_or_path: str | Path, seed: int = 0) -> LengthSampler:
    """Sampler for a named distribution (see `DISTRIBUTIONS`) or a JSON file of lengths."""
    name = str(name_or_path)
    if name in DISTRIBUTIONS:
        return LengthSampler(DISTRIBUTIONS[name](), seed, name)
    if name.endswith(".json") or Path(name).exists():
        return LengthSampler(LengthPool.from_json(name), seed, name)
    raise ValueError(
        f"unknown length distribution {name!r}: choose one of {', '.join(DISTRIBUTIONS)} "
        "or give the path of a JSON list of document lengths"
    )


def pack_windows(sampler: LengthSampler, context: int, num_windows: int) -> list[list[int]]:
    """Fill `num_windows` windows of exactly `context` tokens with sampled documents.

    Documents are consumed in the order the sampler yields them; the one that overflows a window
    is truncated to the room left and its remainder dropped, so every window sums to `context`.
    """
    if not isinstance(context, int) or context < 1:
        raise ValueError(f"context must be a positive integer, got {context!r}")
    if not isinstance(num_windows, int) or num_windows < 0:
        raise ValueError(f"num_windows must be a non-negative integer, got {num_windows!r}")
    batch = 4096
    buf, pos = np.empty(0, dtype=np.int64), 0
    windows = []
    for _ in range(num_windows):
        window: list[int] = []
        room = context
        while room:
            if pos == len(buf):
                buf, pos = sampler.sample(batch), 0
            filled = np.cumsum(buf[pos:])
            k = int(np.searchsorted(filled, room))  # first document that reaches the end of the window
            if k == len(filled):
                window += buf[pos:].tolist()
                room -= int(filled[-1])
                pos = len(buf)
            else:
                window += buf[pos : pos + k].tolist()
                window.append(room - (int(filled[k - 1]) if k else 0))
                pos += k + 1
                room = 0
        windows.append(window)
    return windows
