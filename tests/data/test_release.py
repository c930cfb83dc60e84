"""The release choice of deferral (`flashcp.data.release`): forced documents always go, the rest
only as far as the step stays within the aim, which is relative to the step's mean as released."""

from __future__ import annotations

import numpy as np

from flashcp.data.release import choose_release, StepAim, weight


def aim(n_windows: int, window: int, base: float, density: float = 1.0, tolerance: float = 0.05) -> StepAim:
    return StepAim(n_windows, window, density, base, tolerance)


def test_forced_documents_are_always_released_and_the_rest_within_the_aim():
    lens = np.array([100, 90, 80, 20, 10])
    forced = np.array([False, True, False, False, False])
    out = choose_release(lens, forced, aim(2, 128, base=200.0, density=2.0))
    assert out[1]
    assert not out[0]  # 100 beside the forced 90 in a window of its own: far above the aim
    out = choose_release(lens, np.zeros(5, dtype=bool), aim(2, 256, base=1e9, density=2.0))
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
    assert choose_release(lens, np.zeros(4, dtype=bool), a).all()


def test_one_outlier_waits_where_the_others_cannot_match_it():
    lens = np.array([100, 30, 30, 30, 30])
    out = choose_release(lens, np.zeros(5, dtype=bool), aim(4, 128, base=1000.0))
    assert not out[0]
    assert out[1:].all()  # one of the others in each window: balanced
