"""Document-length samplers and the window packer (flashcp.data.lengths)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashcp.data import (
    DISTRIBUTIONS,
    HeavyTailed,
    LengthPool,
    LengthSampler,
    LognormalMixture,
    length_sampler,
    pack_windows,
)

WLBLLM_FILE = Path(__file__).resolve().parents[3] / "shared" / "data" / "lengths" / "wlbllm.json"


@pytest.mark.parametrize("name", list(DISTRIBUTIONS))
def test_samplers_are_deterministic_per_seed(name: str) -> None:
    a = length_sampler(name, seed=3).sample(1000)
    assert a.dtype == np.int64 and a.min() >= 1
    assert np.array_equal(a, length_sampler(name, seed=3).sample(1000))
    assert not np.array_equal(a, length_sampler(name, seed=4).sample(1000))
    assert pack_windows(length_sampler(name, 5), 8192, 4) == pack_windows(length_sampler(name, 5), 8192, 4)


@pytest.mark.parametrize("name", list(DISTRIBUTIONS))
@pytest.mark.parametrize("context", [1, 4096, 131072])
def test_windows_sum_to_the_context(name: str, context: int) -> None:
    windows = pack_windows(length_sampler(name, 0), context, 20)
    assert len(windows) == 20
    for w in windows:
        assert sum(w) == context and min(w) >= 1


def test_overflowing_document_is_truncated_and_its_rest_dropped() -> None:
    sampler = LengthSampler(LengthPool((7,)), seed=0)
    assert pack_windows(sampler, 20, 3) == [[7, 7, 6]] * 3
    assert pack_windows(LengthSampler(LengthPool((50,))), 20, 2) == [[20], [20]]


@settings(max_examples=50, deadline=None)
@given(
    pool=st.lists(st.integers(1, 300), min_size=1, max_size=20),
    context=st.integers(1, 1000),
    seed=st.integers(0, 99),
)
def test_packing_consumes_pool_documents_in_order(pool: list[int], context: int, seed: int) -> None:
    """Windows are the sampler's documents in order, each window's last one cut to fit."""
    windows = pack_windows(LengthSampler(LengthPool(tuple(pool)), seed), context, 3)
    stream = LengthSampler(LengthPool(tuple(pool)), seed).sample(4096).tolist()
    pos = 0
    for w in windows:
        assert sum(w) == context
        assert w[:-1] == stream[pos : pos + len(w) - 1]
        assert 1 <= w[-1] <= stream[pos + len(w) - 1]
        pos += len(w)


def test_the_prolong_style_pool_has_the_held_out_pools_shape() -> None:
    lengths = np.array(DISTRIBUTIONS["prolong-pool"]().lengths)
    assert lengths.size == 77_932 and lengths.max() == 340_000
    assert 1800 <= np.median(lengths) <= 2000
    assert 0.0015 <= (lengths > 32768).mean() <= 0.0025


@settings(max_examples=20, deadline=None)
@given(max_len=st.integers(10_000, 400_000), share=st.floats(0.0005, 0.05), seed=st.integers(0, 99))
def test_heavy_tailed_pools_hold_their_share_of_long_documents_up_to_their_maximum(max_len, share, seed):
    dist = HeavyTailed(median=1000.0, sigma=1.0, long_share=share, long_min=max_len // 4, max_len=max_len)
    lengths = np.array(dist.pool(20_000, seed).lengths)
    assert lengths.min() >= 1 and lengths.max() == max_len
    long = (lengths >= max_len // 4).mean()
    assert abs(long - share) <= 4 * np.sqrt(share / 20_000) + 1 / 20_000  # binomial: 4 sigma


def test_a_heavy_tail_needs_a_body_below_its_long_documents() -> None:
    with pytest.raises(ValueError, match="median < long_min < max_len"):
        HeavyTailed(median=5000.0, sigma=1.0, long_share=0.01, long_min=4000, max_len=10_000)


def test_pool_from_json(tmp_path: Path) -> None:
    path = tmp_path / "lens.json"
    path.write_text(json.dumps([5, 10, 15]))
    sampler = length_sampler(str(path), seed=1)
    assert set(sampler.sample(200).tolist()) == {5, 10, 15}
    assert LengthPool.from_json(path).lengths == (5, 10, 15)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("[1, 2,", "not valid JSON"),
        ('{"a": 1}', "JSON list of integers"),
        ("[]", "at least one"),
        ("[3, 0]", "positive integers"),
        ("[3, 2.5]", "positive integers"),
        ("[true]", "positive integers"),
    ],
)
def test_bad_pool_files_are_named(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message) as err:
        LengthPool.from_json(path)
    assert str(path) in str(err.value)


def test_bad_names_and_arguments() -> None:
    with pytest.raises(ValueError, match="unknown length distribution 'zipf'.*wlbllm, pile, redpajama"):
        length_sampler("zipf")
    with pytest.raises(ValueError, match="cannot read lengths file"):
        length_sampler("missing/lengths.json")
    with pytest.raises(ValueError, match="context"):
        pack_windows(length_sampler("pile"), 0, 1)
    with pytest.raises(ValueError, match="num_windows"):
        pack_windows(length_sampler("pile"), 16, -1)


def test_mixture_components_hold_their_token_shares() -> None:
    mix = LognormalMixture.from_token_shares(["a", "b"], [3.0, 1.0], [100.0, 10.0])
    tokens = np.array(mix.doc_weights) * np.array(mix.means)
    assert np.allclose(tokens / tokens.sum(), [0.75, 0.25])


@pytest.mark.parametrize("name", ["pile", "redpajama"])
def test_mixture_samples_have_the_published_mean(name: str) -> None:
    """Lognormal parameters are set so each component keeps its published mean length."""
    sampler = length_sampler(name, seed=0)
    draws = sampler.sample(400_000)
    assert abs(draws.mean() / sampler.dist.mean_length() - 1) < 0.05


def test_wlbllm_sampler_matches_the_shared_length_file() -> None:
    """Our quantile table reproduces the shared WLB-LLM lengths: CDFs within 0.01 everywhere
    (Kolmogorov distance), the mean within 3% and the 99th percentile within 10%."""
    if not WLBLLM_FILE.exists():
        pytest.skip(f"{WLBLLM_FILE} is absent (it is development material, not shipped)")
    data = np.sort(np.array(json.loads(WLBLLM_FILE.read_text())))
    draws = np.sort(length_sampler("wlbllm", seed=0).sample(400_000))
    grid = np.unique(data)
    cdf_data = np.searchsorted(data, grid, side="right") / len(data)
    cdf_draws = np.searchsorted(draws, grid, side="right") / len(draws)
    assert np.abs(cdf_data - cdf_draws).max() < 0.01
    assert abs(draws.mean() / data.mean() - 1) < 0.03
    assert abs(np.quantile(draws, 0.99) / np.quantile(data, 0.99) - 1) < 0.10
