"""The release choice of deferral (`flashcp.data.release`): forced documents always go, the rest
only as far as the step stays within the aim, which is relative to the step's mean as released;
a step whose forced documents will be cut releases what that cut keeps most of."""

from __future__ import annotations

import numpy as np

from flashcp.data.balance import layout_step, weight, WindowCost
from flashcp.data.release import _fill, _Price, choose_release, StepAim

COST = WindowCost(dense_per_token=40.0, attn_per_pair=1.0)


def aim(n_windows: int, window: int, base: float, density: float = 1.0,
        short: np.ndarray | None = None) -> StepAim:  # fmt: skip
    short = np.full(n_windows * window, 2) if short is None else short
    return StepAim(n_windows, window, density, base, 0.05, short, COST)


def tri(n: np.ndarray) -> np.ndarray:
    return n * (n + 1) / 2


def test_forced_documents_are_always_released():
    rng = np.random.default_rng(0)
    for _ in range(20):
        lens = rng.integers(16, 128, 12)
        forced = rng.random(12) < 0.3
        out = choose_release(lens, tri(lens.astype(float)), forced, aim(4, 128, base=300.0, density=2.0))
        assert out[forced].all()
    out = choose_release(np.array([100, 90, 80]), np.ones(3), np.zeros(3, dtype=bool), aim(2, 256, base=1e9))
    assert out.all()


def test_many_similar_long_documents_go_together_within_the_step_mean():
    """One long document per window, within 5 % of the step's mean cost once they are released,
    though their spread is many times 5 % of a short-documents-only window."""
    lens = np.array([100, 96, 100, 96])
    a = aim(4, 128, base=1000.0)
    w = weight(lens.astype(np.float64), a.density)
    spread = w.max() - w.mean()
    assert spread > a.tolerance * a.base  # the aim of a step of short documents would refuse them
    assert spread <= a.tolerance * (a.base + w.mean())
    assert choose_release(lens, tri(lens.astype(float)), np.zeros(4, dtype=bool), a).all()


def test_one_outlier_waits_where_the_others_cannot_match_it():
    lens = np.array([100, 30, 30, 30, 30])
    out = choose_release(lens, tri(lens.astype(float)), np.zeros(5, dtype=bool), aim(4, 128, base=1000.0))
    assert not out[0]
    assert out[1:].all()  # one of the others in each window: balanced


def test_a_forced_step_keeps_at_least_what_stacking_or_the_forced_one_alone_keeps():
    """One forced document of nearly a window; free long documents of every length. Filling up to
    its level puts two long documents in most windows; releasing it alone cuts it short. The release
    chosen by pricing the layout's cut keeps at least as much as either."""
    window, n_windows = 1000, 8
    lens = np.array([950, 940, 930, 700, 650, 600, 550, 500, 450, 400, 350, 300, 300, 250])
    forced = np.zeros(lens.size, dtype=bool)
    forced[0] = True
    short = np.full(n_windows * window // 4, 4)
    a = aim(n_windows, window, base=40.0 * window + 2.5 * window, density=2.5, short=short)
    reference = 0.7 * tri(lens.astype(float))  # stream packing cut most of them at a window's end
    chosen = choose_release(lens, reference, forced, a)
    assert chosen[0]

    def kept(released: np.ndarray) -> float:
        docs = lens[released]
        rest = n_windows * window - int(docs.sum())
        step = np.concatenate((docs, np.full(rest // 4, 4), [rest % 4] if rest % 4 else []))
        layout = layout_step(step, n_windows, 1, window, COST)
        pieces = layout.length[layout.doc < docs.size].astype(float)
        return float(tri(pieces).sum()) - 0.75 * float(reference[released].sum())

    w = weight(lens.astype(np.float64), a.density)
    order = np.argsort(-lens, kind="stable")  # the forced one is the longest
    level = float(w[0])  # a window holding the forced document alone
    up_to_level, _ = _fill(order, lens, w, forced, n_windows, window, level)
    assert up_to_level.sum() > n_windows  # stacked: more long documents than windows
    assert kept(chosen) >= kept(up_to_level)  # the forced level is one of the releases priced by the layout
    assert kept(chosen) > kept(forced)  # and better than the forced one cut alone


def test_a_forced_step_is_priced_by_the_cut_the_layout_makes():
    """Seven window-long documents, one of them forced with two mid-sized ones: the cut `length_cap`
    predicts assumes one capped piece per window and prefers a release the layout cuts much
    further; priced by the layout's cut, the release keeps more."""
    window, n_windows = 1024, 8
    lens = np.array([1024] * 7 + [624, 338, 479, 188, 449, 766])
    forced = np.zeros(lens.size, dtype=bool)
    forced[[5, 7, 8]] = True
    a = aim(n_windows, window, base=40.0 * window + 2.5 * window, density=2.5,
            short=np.full(n_windows * window // 4, 4))  # fmt: skip
    reference = 2 / 3 * tri(lens.astype(float))  # stream packing cuts a window-long one where windows end
    chosen = choose_release(lens, reference, forced, a)
    assert chosen[forced].all()
    price = _Price(lens, reference, a)
    w = weight(lens.astype(np.float64), a.density)
    order = np.lexsort((np.arange(lens.size), -lens, ~forced))
    levels = sorted(set(w.tolist()))
    candidates = [_fill(order, lens, w, forced, n_windows, window, level)[0] for level in levels]
    by_prediction = max(candidates, key=price)
    assert price.layout(by_prediction) < price(by_prediction) - 0.2 * reference.sum()  # cut far more
    assert price.layout(chosen) > price.layout(by_prediction) + 0.2 * reference.sum()


def test_a_released_document_the_stream_does_not_reach_keeps_nothing():
    """The step walks the stream in order: a released document after more short tokens than the
    step has room for waits again, so its release is priced as if it were held back."""
    window, n_windows = 1024, 4
    lens = np.array([900, 800, 700])
    short = np.full(n_windows * window // 4, 4)
    reference = tri(lens.astype(float))
    reached = aim(n_windows, window, base=40.0 * window + 2.5 * window, density=2.5, short=short)
    late = reached._replace(short_before=np.array([-1, 100, 3900]))  # the third after 3,900 short tokens
    both, first_two = np.ones(3, dtype=bool), np.array([True, True, False])
    assert _Price(lens, reference, late).layout(both) == _Price(lens, reference, late).layout(first_two)
    assert _Price(lens, reference, reached).layout(both) != _Price(lens, reference, reached).layout(first_two)
    early = reached._replace(short_before=np.array([-1, 100, 1000]))
    assert _Price(lens, reference, early).layout(both) == _Price(lens, reference, reached).layout(both)
