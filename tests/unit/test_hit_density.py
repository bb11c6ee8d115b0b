"""The smoothed survival of gaps (``policies._hit_density.smoothed_survival``) that the
default eviction's density ranking tabulates a person's delays from."""

from __future__ import annotations

import math

import numpy as np

from tieredkv.policies._hit_density import HORIZONS, best_density, smoothed_survival


def empirical(values: np.ndarray, points: np.ndarray) -> np.ndarray:
    ordered = np.sort(values)
    share: np.ndarray = (len(ordered) - np.searchsorted(ordered, points, side="right")) / len(
        ordered
    )
    return share


def lognormal_survival(x: np.ndarray, median: float, sigma: float) -> np.ndarray:
    z = (np.log(x) - math.log(median)) / (sigma * math.sqrt(2.0))
    out: np.ndarray = 0.5 * np.vectorize(math.erfc)(z)
    return out


def test_the_hit_density_from_it_is_closer_to_the_true_one_than_from_the_staircase() -> None:
    """2,048 lognormal delays (the synthetic workload's: median 28 s, shape 0.75), a chance
    of 0.8 of a next turn: the hit density tabulated from the samples' staircase strays
    from the one of the true distribution by 45-124% on average over 0.05 s to 20 min (each
    step of the staircase is a spike of density, most in the sparse tail); from the
    smoothed survival by less than half as much."""
    grid = np.geomspace(0.05, 1200.0, 400)
    ahead = grid[:, None] + HORIZONS[None, 1:]
    q = np.full(len(grid), 0.8)
    true = best_density(
        q, lognormal_survival(grid, 28.0, 0.75), lognormal_survival(ahead, 28.0, 0.75)
    )
    for seed in range(5):
        values = np.random.default_rng(seed).lognormal(math.log(28.0), 0.75, 2048)
        steps = best_density(q, empirical(values, grid), empirical(values, ahead))
        survival = smoothed_survival(values)
        smooth = best_density(q, survival(grid), survival(ahead))
        off_steps = np.mean(np.abs(steps - true) / true)
        off_smooth = np.mean(np.abs(smooth - true) / true)
        assert off_smooth < 0.5 * off_steps, (seed, off_smooth, off_steps)


def test_values_at_or_below_zero_are_counted_as_they_are() -> None:
    """A person who replies before the fitted reading time has a delay at or below 0:
    at those points the survival is the samples' own share, and it never rises."""
    rng = np.random.default_rng(1)
    values = np.concatenate([rng.uniform(-30.0, 0.0, 300), rng.lognormal(3.0, 0.8, 1700)])
    below = np.linspace(-40.0, 0.0, 81)
    assert np.array_equal(smoothed_survival(values)(below), empirical(values, below))
    x = np.linspace(-40.0, 2000.0, 4001)
    s = smoothed_survival(values)(x)
    assert np.all(np.diff(s) <= 1e-12)
    assert s[0] == 1.0
    assert s[-1] == 0.0
    assert np.array_equal(smoothed_survival(values)(x.reshape(1, -1))[0], s)  # any shape


def test_the_same_gap_over_and_over_is_not_smoothed() -> None:
    values = np.full(2000, 12.5)
    x = np.array([-1.0, 0.0, 12.0, 12.5, 13.0, 1e4])
    assert np.array_equal(smoothed_survival(values)(x), empirical(values, x))
    one = np.array([3.0])
    assert np.array_equal(smoothed_survival(one)(x), empirical(one, x))


def test_sharp_modes_keep_a_narrow_kernel() -> None:
    """Half the gaps at 10 s, half at 100 s, each within 2%: the width is chosen by
    cross-validation, so the estimate keeps the modes sharp (the normal-reference width
    alone, about a quarter in log scale here, would put 13% of the first mode past 13 s)."""
    rng = np.random.default_rng(2)
    values = np.concatenate([rng.lognormal(math.log(10.0), 0.02, 1000),
                             rng.lognormal(math.log(100.0), 0.02, 1000)])  # fmt: skip
    s = smoothed_survival(values)(np.array([5.0, 13.0, 30.0, 75.0, 130.0]))
    assert s[0] > 1 - 1e-9
    assert abs(s[1] - 0.5) < 0.01
    assert abs(s[2] - 0.5) < 0.01
    assert abs(s[3] - 0.5) < 0.01
    assert s[4] < 0.01
